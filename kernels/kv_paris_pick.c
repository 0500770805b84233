/* kv_paris_pick.c: which ParisKV kernel table (kernels/kv_paris.h) a backend has. Only the CPU
 * reference is built so far; a CUDA backend is refused with -ENOSYS until its kernels exist. */
#include "kernels/kv_paris.h"

#include <errno.h>
#include <string.h>

#include "base/util.h"

const struct kvs_paris_kernels *kvs_paris_kernels_for(const struct kvs_backend_ops *o, char *err, size_t errlen)
{
    /* by name: a reference to kvs_cpu_backend would link the whole CPU backend into programs
     * that bring their own (tests/fake) */
    if (!strcmp(o->name, "cpu")) return &kvs_paris_kernels_cpu;
    kvs_err(err, errlen, -ENOSYS, "kv.decode \"paris\": backend %s has no ParisKV kernels (only the CPU reference "
            "is built)", o->name);
    return NULL;
}
