/* kv_retro_pick.c: which Retro kernel table (kernels/kv_retro.h) a backend has. The CUDA table
 * exists only in builds with nvcc (KVS_HAVE_CUDA=1). The CPU backend has one too, but it is
 * returned here only by name "cpu" for tests; the policy keeps its host path there unless told
 * otherwise (kv_decode_retro.h). */
#include "kernels/kv_retro.h"

#include <string.h>

const struct kvs_retro_kernels *kvs_retro_kernels_for(const struct kvs_backend_ops *o)
{
    if (!strcmp(o->name, "cpu")) return &kvs_retro_kernels_cpu;
#if defined(KVS_HAVE_CUDA) && KVS_HAVE_CUDA
    if (!strcmp(o->name, "cuda")) return &kvs_retro_kernels_cuda;
#endif
    return NULL;
}
