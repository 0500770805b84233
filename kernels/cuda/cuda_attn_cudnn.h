/* cuda_attn_cudnn.h: the prefill attention through cuDNN's fused SDPA (prefill-attention kind 26,
 * kernels/cuda/cuda_attn_cudnn.cu), internal to kernels/cuda/. Built only when the build is given
 * cuDNN's headers (`make CUDA=1 CUDNN=/dir`, which defines KVS_HAVE_CUDNN=1); libcudnn.so.9 is
 * opened with dlopen at the first use, so no program needs cuDNN to start.
 *
 * Ownership: the file owns its per-device state (a cuDNN handle, the built graphs, scratch
 * buffers for the bf16 Q / O copies, the metadata and cuDNN's workspace), kept for the process.
 * Errors: nothing aborts and nothing fails silently: where cuDNN cannot be opened, is older than
 * 9.6, or cannot build or run a launch's graph, kvs_cu_attn_cudnn returns 0 having enqueued
 * nothing, the caller runs its own kernel (kind 14) instead, and the first such failure of the
 * process is logged (one line, KVS_LOG_WARN) with its reason. CUDA errors of its own kernels
 * abort (CUDA_CHECK) as elsewhere in the backend.
 */
#ifndef KVS_CUDA_ATTN_CUDNN_H
#define KVS_CUDA_ATTN_CUDNN_H

#include "kernels/cuda/cuda_attention.h"

/* the prefill-attention kind number (kvs_cuda_set_pre_attn, KVS_CUDA_PRE_ATTN), in every build:
 * without cuDNN built in, or where it cannot take a launch, kind 14 runs instead */
#define KVS_PRE_ATTN_CUDNN 26

#if defined(KVS_HAVE_CUDNN) && KVS_HAVE_CUDNN
/* 1 when libcudnn.so.9 (9.6 or later) could be opened; opens it at the first call (thread-safe). */
int kvs_cu_attn_cudnn_available(void);
/* Enqueues on `st` the attention of every prefill row of the launch (rows of sequences of more
 * than one query row; one-row sequences are left alone for the decode pass) into a->out / a->outh.
 * Takes launches without rotation offsets or block_valid, head_dim 64 / 128, query heads a
 * multiple of the KV heads. Returns 1 when done, 0 when it enqueued nothing (see above). */
int kvs_cu_attn_cudnn(const struct kvs_cu_attn *a, cudaStream_t st);
/* launches kvs_cu_attn_cudnn has taken so far (returned 1 with prefill rows), process-wide */
long long kvs_cu_attn_cudnn_count(void);
#endif

#endif
