/* kv_lean_cuda.h: the tests' and benchmarks' knobs of LeanKV's CUDA attention kernels (the
 * multi-warp decode kernel kernels/cuda/kv_lean_decode.cu, the merge, mixed steps, the prompt-chunk
 * kernel kv_lean_prefill.cu and its bf16 road's scratch), beside kvs_cuda_set_lean_layout
 * (cuda_backend.h). Only with KVS_HAVE_CUDA=1. Process-wide state (the scratch: one a device, owned
 * here); no errors but kvs_cuda_lean_dq_reserve's -1 (out-of-range values select the defaults). */
#ifndef KVS_KV_LEAN_CUDA_H
#define KVS_KV_LEAN_CUDA_H

#if defined(KVS_HAVE_CUDA) && KVS_HAVE_CUDA
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif
#include "kernels/kv_lean.h"

/* The multi-warp kernel's configuration, process-wide: compute warps a block (1-5, else the
 * default), stages of its ring (2-24, rounded down to a multiple of the compute warps and at least
 * twice them; else as many as the shared memory holds), context splits (1-256, else planned) and
 * combine (1: the compute warps' states folded into one partial a block, 0: a partial a warp,
 * else the default). Layout 3 of kvs_cuda_set_lean_layout forces the kernel where it applies (keys
 * on M, no spans); the automatic choice (layout 0) takes it there too. Never called:
 * KVS_LEAN_DEC=NC[,NST[,SPLITS[,COMBINE]]] from the environment, else the defaults. */
void kvs_cuda_set_lean_dec(int compute_warps, int stages, int splits, int combine);
/* The merge of the attention's split partials (kv_lean.cu), process-wide: staged 1 (the default:
 * the splits' maxima and sums staged in shared memory, the partials' loads batched) or 0 (the
 * serial walks: the same sums in the same order, so the same bits); early 1: the multi-warp
 * kernel lets the merge's blocks start while its last blocks run (programmatic launch). A negative
 * value: back to the environment (KVS_LEAN_MERGE=STAGED[,EARLY]) or the default. */
void kvs_cuda_set_lean_merge(int staged, int early);
/* A mixed step (decode rows beside prompt chunks, no spans, G <= 8, layout 0), process-wide:
 * 1 two launches, the decode rows on the keys-on-M kernels and the chunks' rows on rows on M;
 * 0 one launch of the chunks' layout for every row. A negative value: back to the environment
 * (KVS_LEAN_MIXED=0|1) or, unset, the default: two launches where the chunks go to k_lean_pf and
 * the step holds at least 64 decode rows, else one (kv_lean.cu says why). */
void kvs_cuda_set_lean_mixed(int on);
/* The prompt-chunk kernel (kv_lean_prefill.cu, k_lean_pf: the rows-on-M launches of the automatic
 * layout, K8V8 / K8V4 / K4V4 / K4V2 without spans or rotation offsets), process-wide: warps a
 * block, 8 (the default) or 4 (128 or 64 query rows sharing each staged key tile); 0 off (k_lean_fd
 * rows on M, as before it). A negative value: back to the environment (KVS_LEAN_PF=0|4|8) or the
 * default. */
void kvs_cuda_set_lean_prefill(int warps);
/* The bf16 road for prompt chunks (kv_lean_prefill.cu lean_dq_attention: each layer's quantized
 * context of the step's chunk sequences dequantized into a bf16 scratch, then the dense prefill
 * attention over it, k_attn_fa3 where its shapes allow), process-wide: 0 off (k_lean_pf / k_lean_fd),
 * 1 every prompt chunk it can take, 2 (the default) only steps whose longest chunk has 64 rows or
 * more. A negative value: back to the environment (KVS_LEAN_DQ=0|1|2) or the default. */
void kvs_cuda_set_lean_dq(int mode);
/* Reserves the bf16 road's scratch on the current device: bytes (0: none) allocated now, and never
 * grown afterwards (a step that needs more takes k_lean_pf). Without a reservation the scratch is
 * allocated by the first step that needs it and grown when a step needs more. 0, or -1 when the
 * allocation fails (nothing reserved then). The lean storage reserves it at create
 * (kv_storage_lean.c, which says how it is sized). */
int kvs_cuda_lean_dq_reserve(size_t bytes);
/* The attention calls (a layer's each) on the current device that took the bf16 road, and those
 * it handed back to k_lean_pf because its scratch could not hold their sequences. */
void kvs_cuda_lean_dq_counts(long long *taken, long long *fallbacks);
/* Tests: k_lean_dq over every sequence of m (at most 64, quantized formats only): the context of
 * sequence s (pos + rows tokens, whole blocks) into k / v (KVS_BUF_KV, bf16 [blocks][n_kv][bs][hd],
 * sequence s's blocks from the sum of the earlier ones' ceil(ctx / bs)) and row s of bt (I32
 * [n_seqs][max_blocks]: the scratch block of each of its blocks, 0 past them). Enqueued on the
 * backend's stream; buffers too small abort. */
void kvs_cuda_lean_dequant(struct kvs_backend *b, struct kvs_lean_fmt f, const struct kvs_dbuf *pool,
                           const struct kvs_attn_meta *m, int n_kv_heads, int head_dim, int block_size,
                           struct kvs_dbuf *k, struct kvs_dbuf *v, struct kvs_dbuf *bt);
#ifdef __cplusplus
}
#endif
#endif

#endif
