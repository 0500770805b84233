/* kv_lean_cuda.h: the tests' and benchmarks' knobs of LeanKV's CUDA attention kernels (the
 * multi-warp decode kernel kernels/cuda/kv_lean_decode.cu, the merge, mixed steps, the prompt-chunk
 * kernel kv_lean_prefill.cu), beside kvs_cuda_set_lean_layout (cuda_backend.h). Only with
 * KVS_HAVE_CUDA=1. Process-wide state, no ownership; no errors (out-of-range values select the
 * defaults). */
#ifndef KVS_KV_LEAN_CUDA_H
#define KVS_KV_LEAN_CUDA_H

#if defined(KVS_HAVE_CUDA) && KVS_HAVE_CUDA
#ifdef __cplusplus
extern "C" {
#endif
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
#ifdef __cplusplus
}
#endif
#endif

#endif
