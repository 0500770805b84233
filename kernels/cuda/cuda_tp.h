/* cuda_tp.h: NCCL for the CUDA backend's tensor-parallel ops (kernels/backend.h's tensor-parallel
 * section; cuda_backend.cu implements the ops on top of these).
 *
 * NCCL is the CUDA toolkit's (nccl.h, libnccl.so.2; Debian's libnccl-dev installs the same
 * names). The build compiles this with KVS_HAVE_NCCL=1 when the Makefile finds nccl.h next to
 * nvcc's headers, and the library is opened with dlopen("libnccl.so.2") when a group is first
 * made: programs never need NCCL to start, and parallel.tensor = 1 never touches it. Without
 * nccl.h at build time, or libnccl.so.2 at run time, kvs_cu_nccl_group fails with -ENOSYS and a
 * message saying which.
 *
 * Ownership: kvs_cu_nccl_group fills comms[0..n) (one communicator per device, rank i on
 * devs[i]); each is released with kvs_cu_nccl_free. Errors: 0 / negative errno + message; a
 * failing all-reduce aborts (a broken invariant: every rank issued it with the same count).
 */
#ifndef KVS_CUDA_TP_H
#define KVS_CUDA_TP_H

#include <cuda_runtime.h>
#include <stddef.h>

int kvs_cu_nccl_group(int n, const int *devs, void **comms, char *err, size_t errlen);
/* in place: p[0 .. n) = sum over the ranks, enqueued on st (graph-capturable) */
void kvs_cu_nccl_allreduce(void *comm, float *p, size_t n, cudaStream_t st);
void kvs_cu_nccl_free(void *comm);

#endif
