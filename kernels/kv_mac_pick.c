/* kv_mac_pick.c: which MAC-Attention kernel table (kernels/kv_mac.h) a backend has, by the
 * backend's name. The KV registry reaches this file from every program that validates a config
 * (kv.c -> kv_decode_mac.c), and those need not link a backend: so the CPU table is found by name
 * (kernels/cpu/kv_mac.c needs no CPU backend object) and the CUDA table through a weak reference
 * that kernels/backend_pick.c, linked by whatever picks the CUDA backend, makes strong. */
#include "kernels/kv_mac.h"

#include <errno.h>
#include <string.h>

#include "base/util.h"

#if defined(KVS_HAVE_CUDA) && KVS_HAVE_CUDA
extern const struct kvs_mac_kernels kvs_mac_kernels_cuda __attribute__((weak));
#endif

const struct kvs_mac_kernels *kvs_mac_kernels_for(const struct kvs_backend_ops *o, char *err, size_t errlen)
{
    const char *name = o && o->name ? o->name : "?";
    if (strcmp(name, "cpu") == 0) return &kvs_mac_kernels_cpu;
#if defined(KVS_HAVE_CUDA) && KVS_HAVE_CUDA
    if (strcmp(name, "cuda") == 0 && &kvs_mac_kernels_cuda) return &kvs_mac_kernels_cuda;
#endif
    kvs_err(err, errlen, -ENOSYS, "config key 'kv.decode': \"mac\" has no kernels on backend %s", name);
    return NULL;
}
