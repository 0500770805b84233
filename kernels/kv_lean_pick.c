/* kv_lean_pick.c: which LeanKV kernel table (kernels/kv_lean.h) a backend has. The CUDA table
 * exists only in builds with nvcc (KVS_HAVE_CUDA=1); elsewhere a CUDA backend cannot exist. */
#include "kernels/kv_lean.h"

#include <errno.h>
#include <string.h>

#include "base/util.h"

const struct kvs_lean_kernels *kvs_lean_kernels_for(const struct kvs_backend_ops *o, char *err, size_t errlen)
{
    /* by name, as kv_quest_pick.c: a reference to a backend's op table would link that whole
     * backend into every program that validates a config */
    if (!strcmp(o->name, "cpu")) return &kvs_lean_kernels_cpu;
#if defined(KVS_HAVE_CUDA) && KVS_HAVE_CUDA
    if (!strcmp(o->name, "cuda")) return &kvs_lean_kernels_cuda;
#endif
    kvs_err(err, errlen, -ENOSYS,
            "config key 'kv.storage': \"lean\" has no kernels on the %s backend (quantized write and attention over "
            "LeanKV pages)", o->name);
    return NULL;
}
