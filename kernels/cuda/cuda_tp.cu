/* cuda_tp.cu: NCCL, opened at run time, for tensor parallelism (cuda_tp.h). */
#include "kernels/cuda/cuda_tp.h"

#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#define _Noreturn [[noreturn]] /* base/util.h is C11 */
extern "C" {
#include "base/util.h"
}

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

int kvs_cu_nccl_group(int n, const int *devs, void **comms, char *err, size_t errlen)
{
    if (!nccl_open()) return kvs_err(err, errlen, -ENOSYS, "parallel.tensor: %s", nccl.why);
    int v = 0;
    nccl.version(&v);
    /* every connection at init, none on a first use inside a graph capture (a warm-up all-reduce
     * runs too, engine/runner_tp.c); a value the user set wins */
    setenv("NCCL_RUNTIME_CONNECT", "0", 0);
    int cur = 0;
    cudaGetDevice(&cur);
    ncclComm_t *cs = (ncclComm_t *)kvs_xcalloc((size_t)n, sizeof *cs);
    ncclResult_t r = nccl.init_all(cs, n, devs);
    cudaSetDevice(cur); /* the caller's thread keeps its device */
    if (r != ncclSuccess) {
        free(cs);
        return kvs_err(err, errlen, -EIO, "parallel.tensor: ncclCommInitAll over %d GPUs: %s", n, nccl.error_string(r));
    }
    for (int i = 0; i < n; i++) comms[i] = cs[i];
    free(cs);
    kvs_log(KVS_LOG_INFO, "cuda: NCCL %d.%d.%d, %d ranks", v / 10000, v / 100 % 100, v % 100, n);
    return 0;
}

void kvs_cu_nccl_allreduce(void *comm, float *p, size_t n, cudaStream_t st)
{
    ncclResult_t r = nccl.all_reduce(p, p, n, ncclFloat32, ncclSum, (ncclComm_t)comm, st);
    if (r != ncclSuccess) kvs_panic(__FILE__, __LINE__, "ncclAllReduce: %s", nccl.error_string(r));
}

void kvs_cu_nccl_free(void *comm)
{
    if (comm) nccl.destroy((ncclComm_t)comm);
}

#else /* no nccl.h at build time */

int kvs_cu_nccl_group(int n, const int *devs, void **comms, char *err, size_t errlen)
{
    (void)n, (void)devs, (void)comms;
    return kvs_err(err, errlen, -ENOSYS, "parallel.tensor: this build has no NCCL (nccl.h was not found next to "
                   "nvcc's headers at build time); install the CUDA toolkit's NCCL or Debian's libnccl-dev and rebuild");
}

void kvs_cu_nccl_allreduce(void *comm, float *p, size_t n, cudaStream_t st)
{
    (void)comm, (void)p, (void)n, (void)st;
    kvs_panic(__FILE__, __LINE__, "ncclAllReduce without NCCL");
}

void kvs_cu_nccl_free(void *comm) { (void)comm; }

#endif
