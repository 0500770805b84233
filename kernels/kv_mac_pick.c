/* kv_mac_pick.c: which MAC-Attention kernel table (kernels/kv_mac.h) a backend has, by the
 * backend's name. The KV registry reaches this file from every program that validates a config
 * (kv.c -> kv_decode_mac.c), and those need not link a backend: so the tables are found by name,
 * and neither kernels/cpu/kv_mac.c nor kernels/cuda/kv_mac.cu calls into a backend object. */
#include "kernels/kv_mac.h"

#include <errno.h>
#include <string.h>

#include "base/util.h"

#if defined(KVS_HAVE_CUDA) && KVS_HAVE_CUDA
#include "kernels/cuda/kv_mac_cuda.h"
#endif

const struct kvs_mac_kernels *kvs_mac_kernels_for(const struct kvs_backend_ops *o, char *err, size_t errlen)
{
    const char *name = o && o->name ? o->name : "?";
    if (strcmp(name, "cpu") == 0) return &kvs_mac_kernels_cpu;
#if defined(KVS_HAVE_CUDA) && KVS_HAVE_CUDA
    if (strcmp(name, "cuda") == 0) return &kvs_mac_kernels_cuda;
#endif
    kvs_err(err, errlen, -ENOSYS, "config key 'kv.decode': \"mac\" has no kernels on backend %s", name);
    return NULL;
}
