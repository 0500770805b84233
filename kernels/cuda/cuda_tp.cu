/* cuda_tp.cu: the CUDA backend's tensor-parallel ops (kernels/backend.h: tp_group, allreduce_sum;
 * engine/runner_tp.c drives them): one NCCL communicator per GPU, all made by one
 * ncclCommInitAll from the thread that joins the ranks, then each rank's all-reduce enqueued on
 * its backend's stream by its own thread (so a recorded step graph captures it: the capture mode
 * is thread-local, as NCCL asks for one thread per GPU).
 *
 * NCCL is the CUDA toolkit's (nccl.h, libnccl.so.2; Debian's libnccl-dev installs the same
 * names). The Makefile compiles the NCCL path (KVS_HAVE_NCCL=1) when it finds nccl.h next to
 * nvcc's headers or in /usr/include; the library is opened with dlopen("libnccl.so.2") when a
 * group is first made, so no program needs NCCL to start and parallel.tensor = 1 never touches
 * it. Without nccl.h at build time or libnccl.so.2 at run time, tp_group fails with -ENOSYS and a
 * message saying which. A failing all-reduce aborts (every rank issued it with the same count:
 * a broken invariant, not a client error).
 */
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>

#include "kernels/cuda/cuda_internal.cuh"

#if defined(KVS_HAVE_NCCL) && KVS_HAVE_NCCL
#include <nccl.h>

/* the entry points used, resolved once */
static struct {
    int tried, ok;
    char why[200];
    ncclResult_t (*init_all)(ncclComm_t *, int, const int *);
    ncclResult_t (*all_reduce)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t);
    ncclResult_t (*destroy)(ncclComm_t);
    const char *(*error_string)(ncclResult_t);
    ncclResult_t (*version)(int *);
} nccl;
static pthread_mutex_t nccl_lock = PTHREAD_MUTEX_INITIALIZER;

static int nccl_open(void)
{
    pthread_mutex_lock(&nccl_lock);
    if (!nccl.tried) {
        nccl.tried = 1;
        void *h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_GLOBAL);
        if (!h) {
            snprintf(nccl.why, sizeof nccl.why, "cannot open libnccl.so.2 (%s)", dlerror());
        } else {
            nccl.init_all = (decltype(nccl.init_all))dlsym(h, "ncclCommInitAll");
            nccl.all_reduce = (decltype(nccl.all_reduce))dlsym(h, "ncclAllReduce");
            nccl.destroy = (decltype(nccl.destroy))dlsym(h, "ncclCommDestroy");
            nccl.error_string = (decltype(nccl.error_string))dlsym(h, "ncclGetErrorString");
            nccl.version = (decltype(nccl.version))dlsym(h, "ncclGetVersion");
            nccl.ok = nccl.init_all && nccl.all_reduce && nccl.destroy && nccl.error_string && nccl.version;
            if (!nccl.ok) snprintf(nccl.why, sizeof nccl.why, "libnccl.so.2 lacks an entry point");
        }
    }
    const int ok = nccl.ok;
    pthread_mutex_unlock(&nccl_lock);
    return ok;
}

int kvs_cu_op_tp_group(struct kvs_backend *const *bs, int n, size_t max_elems, char *err, size_t errlen)
{
    (void)max_elems; /* NCCL needs no scratch of ours */
    if (n < 2 || n > 64) return kvs_err(err, errlen, -EINVAL, "cuda tp: %d ranks", n);
    int devs[64] = {0};
    for (int i = 0; i < n; i++) {
        devs[i] = bs[i]->device;
        for (int j = 0; j < i; j++)
            if (devs[j] == devs[i]) return kvs_err(err, errlen, -EINVAL, "cuda tp: ranks %d and %d share GPU %d", j, i, devs[i]);
    }
    if (!nccl_open()) return kvs_err(err, errlen, -ENOSYS, "parallel.tensor: %s", nccl.why);
    int v = 0;
    nccl.version(&v);
    /* every connection at init, none on a first use inside a graph capture (the runner also runs
     * a warm-up all-reduce, engine/runner_tp.c); a value the user set wins */
    setenv("NCCL_RUNTIME_CONNECT", "0", 0);
    int cur = 0;
    CUDA_CHECK(cudaGetDevice(&cur));
    ncclComm_t cs[64];
    ncclResult_t r = nccl.init_all(cs, n, devs);
    CUDA_CHECK(cudaSetDevice(cur)); /* the caller's thread keeps its device */
    if (r != ncclSuccess)
        return kvs_err(err, errlen, -EIO, "parallel.tensor: ncclCommInitAll over %d GPUs: %s", n, nccl.error_string(r));
    for (int i = 0; i < n; i++) bs[i]->tp_comm = cs[i];
    kvs_log(KVS_LOG_INFO, "cuda: NCCL %d.%d.%d, %d ranks", v / 10000, v / 100 % 100, v % 100, n);
    return 0;
}

/* ACT is fp32 on this backend: the sum is taken in fp32, in NCCL's order, the same on every rank */
void kvs_cu_op_allreduce_sum(struct kvs_backend *b, struct kvs_dbuf *buf, size_t n)
{
    KVS_ASSERT(b->tp_comm && buf->kind == KVS_BUF_ACT && n <= buf->n);
    xh_forget(b, buf->d);
    ncclResult_t r = nccl.all_reduce(buf->d, buf->d, n, ncclFloat32, ncclSum, (ncclComm_t)b->tp_comm, b->stream);
    if (r != ncclSuccess) kvs_panic(__FILE__, __LINE__, "ncclAllReduce: %s", nccl.error_string(r));
}

void kvs_cu_tp_release(struct kvs_backend *b)
{
    if (b->tp_comm) nccl.destroy((ncclComm_t)b->tp_comm);
    b->tp_comm = nullptr;
}

#else /* no nccl.h at build time */

int kvs_cu_op_tp_group(struct kvs_backend *const *bs, int n, size_t max_elems, char *err, size_t errlen)
{
    (void)bs, (void)n, (void)max_elems;
    return kvs_err(err, errlen, -ENOSYS, "parallel.tensor: this build has no NCCL (nccl.h was not found next to "
                   "nvcc's headers nor in /usr/include at build time); install the CUDA toolkit's NCCL or Debian's "
                   "libnccl-dev and rebuild");
}

void kvs_cu_op_allreduce_sum(struct kvs_backend *b, struct kvs_dbuf *buf, size_t n)
{
    (void)b, (void)buf, (void)n;
    kvs_panic(__FILE__, __LINE__, "allreduce_sum without NCCL (tp_group refuses to make a group)");
}

void kvs_cu_tp_release(struct kvs_backend *b) { (void)b; }

#endif
