/* cuda_attention.h: paged causal attention of the CUDA backend (internal to kernels/cuda/; the op
 * table's attention() in cuda_ops.cu calls it). Semantics are those of backend.h's
 * attention op and struct kvs_attn_meta (deferred RoPE offsets, per-block valid slots).
 *
 * Ownership: nothing is allocated here; the caller passes device pointers and a workspace for the
 * split partials. Errors: shapes the kernels do not support (head_dim not in {16, 32, 64, 128,
 * 256}, more than 32 query heads per KV head) abort with a message (bugs, not client errors: the
 * model loader rejects such models first via kvs_cu_attention_supported).
 */
#ifndef KVS_CUDA_ATTENTION_H
#define KVS_CUDA_ATTENTION_H

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

struct kvs_cu_attn {
    const float *q;               /* [n][n_heads][hd] fp32 */
    const __nv_bfloat16 *kc, *vc; /* one layer's cache [n_blocks][n_kv][bs][hd] */
    size_t kv_elems;              /* elements in each of kc, vc (n_blocks x n_kv x bs x hd) */
    const int32_t *q_start, *pos, *bt, *rot, *valid; /* device metadata (rot, valid may be NULL) */
    const float *inv_freq;        /* [hd / 2], needed when rot != NULL */
    const int32_t *words;         /* NULL, or packed (block, offset << 11 | valid) pairs (backend.h) */
    const int32_t *h_q_start, *h_pos; /* host copies of q_start [n_seqs + 1] and pos [n_seqs] */
    int n_seqs, max_blocks, n, n_heads, n_kv, hd, bs;
    int plan_ctx;                 /* 0, or plan the decode launch for contexts up to this (graphs) */
    int skip_lead;                /* backend.h kvs_attn_meta skip_lead: the decode pass leaves the rows of
                                   * sequences [0, skip_lead) alone (one-row sequences only) */
    int batch_invariant;          /* nonzero: decode rows take the batch-invariant split plan
                                   * (cuda_attn_device.cuh at_split_keys): a row's bits depend on its
                                   * own context only, not on the launch (rows, plan_ctx, SMs) */
    float scale;
    float *out;                   /* [n][n_heads][hd] fp32 */
    __nv_bfloat16 *outh;          /* NULL, or [n][n_heads][hd]: the bf16 copy of out, written alongside */
};

/* 1 when the kernels support this shape (see the header comment). */
int kvs_cu_attention_supported(int n_heads, int n_kv, int head_dim);

/* Enqueues the attention on `stream`. ws (ws_bytes) holds split partials. n_splits_force > 0
 * forces that many context splits per launch (benchmark comparisons); 0 = automatic.
 * dec_kind_force 0 / 2 / 3 / 4 / 5 forces the decode kernel as KVS_CUDA_DEC_ATTN does (4 and 5
 * only where k_attn_fd takes the launch); -1 = KVS_CUDA_DEC_ATTN, else automatic. */
void kvs_cu_attention(const struct kvs_cu_attn *a, cudaStream_t stream, int n_sms, float *ws, size_t ws_bytes,
                      int n_splits_force, int dec_kind_force);

#endif
