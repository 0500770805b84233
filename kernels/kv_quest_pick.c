/* kv_quest_pick.c: which Quest kernel table (kernels/kv_quest.h) a backend has. The CUDA table
 * exists only in builds with nvcc (KVS_HAVE_CUDA=1); elsewhere a CUDA backend cannot exist. */
#include "kernels/kv_quest.h"

#include <errno.h>
#include <string.h>

#include "base/util.h"

const struct kvs_quest_kernels *kvs_quest_kernels_for(const struct kvs_backend_ops *o, char *err, size_t errlen)
{
    /* by name: a reference to kvs_cpu_backend would link the whole CPU backend into programs
     * that bring their own (tests/fake) */
    if (!strcmp(o->name, "cpu")) return &kvs_quest_kernels_cpu;
#if defined(KVS_HAVE_CUDA) && KVS_HAVE_CUDA
    if (!strcmp(o->name, "cuda")) return &kvs_quest_kernels_cuda;
#endif
    kvs_err(err, errlen, -ENOSYS, "kv.decode \"quest\": backend %s has no Quest kernels", o->name);
    return NULL;
}
