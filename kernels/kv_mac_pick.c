/* kv_mac_pick.c: which MAC-Attention kernel table (kernels/kv_mac.h) a backend has. By name, not
 * by the backend's symbol: the registry reaches this file from every program that validates a
 * config, and those need not link a backend. Today only the CPU reference exists; the CUDA
 * backend answers -ENOSYS, so kv.decode=mac on device cuda is refused at startup. */
#include "kernels/kv_mac.h"

#include <errno.h>
#include <string.h>

#include "base/util.h"

const struct kvs_mac_kernels *kvs_mac_kernels_for(const struct kvs_backend_ops *o, char *err, size_t errlen)
{
    if (o && o->name && strcmp(o->name, "cpu") == 0) return &kvs_mac_kernels_cpu;
    kvs_err(err, errlen, -ENOSYS, "config key 'kv.decode': \"mac\" has no kernels on backend %s (CPU only so far)",
            o && o->name ? o->name : "?");
    return NULL;
}
