/* kv_paris_pick.c: which ParisKV kernel table (kernels/kv_paris.h) a backend has. The CUDA table
 * exists only in builds with nvcc (KVS_HAVE_CUDA=1); elsewhere a CUDA backend cannot exist. */
#include "kernels/kv_paris.h"

#include <errno.h>
#include <string.h>

#include "base/util.h"

const struct kvs_paris_kernels *kvs_paris_kernels_for(const struct kvs_backend_ops *o, char *err, size_t errlen)
{
    /* by name: a reference to kvs_cpu_backend would link the whole CPU backend into programs
     * that bring their own (tests/fake) */
    if (!strcmp(o->name, "cpu")) return &kvs_paris_kernels_cpu;
#if defined(KVS_HAVE_CUDA) && KVS_HAVE_CUDA
    if (!strcmp(o->name, "cuda")) return &kvs_paris_kernels_cuda;
#endif
    kvs_err(err, errlen, -ENOSYS, "kv.decode \"paris\": backend %s has no ParisKV kernels", o->name);
    return NULL;
}
