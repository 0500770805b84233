/* backend_pick.c: which compute backend a device name means (kernels/backend.h), and whether it
 * can run a model's attention shape. The runner asks here instead of knowing the backends.
 *
 * The CUDA backend is used when nvcc built kernels/cuda/ and it provides its header (a strong
 * reference, so the archive member that defines kvs_cuda_backend gets linked). */
#include "kernels/backend.h"

#include <errno.h>
#include <string.h>

#include "base/util.h"

#if defined(KVS_HAVE_CUDA) && KVS_HAVE_CUDA && defined(__has_include)
#if __has_include("kernels/cuda/cuda_backend.h")
#include "kernels/cuda/cuda_backend.h"
#define PICK_HAS_CUDA 1
#endif
#endif

const struct kvs_backend_ops *kvs_backend_pick(const char *device, char *err, size_t errlen)
{
    const char *d = device && *device ? device : "auto";
    if (strcmp(d, "cpu") == 0) return &kvs_cpu_backend;
    if (strcmp(d, "cuda") == 0 || strcmp(d, "auto") == 0) {
#ifdef PICK_HAS_CUDA
        return &kvs_cuda_backend;
#endif
        if (strcmp(d, "auto") == 0) return &kvs_cpu_backend;
        kvs_err(err, errlen, -ENOSYS, "device \"cuda\" requested but this build has no CUDA backend");
        return NULL;
    }
    kvs_err(err, errlen, -EINVAL, "unknown device \"%s\" (auto, cpu, cuda)", d);
    return NULL;
}

int kvs_backend_supports_model(const struct kvs_backend_ops *o, int n_heads, int n_kv_heads, int head_dim, char *err,
                               size_t errlen)
{
#ifdef PICK_HAS_CUDA
    if (o == &kvs_cuda_backend && !kvs_cuda_supports_attention(n_heads, n_kv_heads, head_dim))
        return kvs_err(err, errlen, -ENOTSUP,
                       "the CUDA attention kernels do not support heads %d/%d, head_dim %d (head_dim 16, 32, 64, 128 or "
                       "256 and at most 32 query heads per KV head); use device \"cpu\"",
                       n_heads, n_kv_heads, head_dim);
#else
    (void)o, (void)n_heads, (void)n_kv_heads, (void)head_dim, (void)err, (void)errlen;
#endif
    return 0;
}
