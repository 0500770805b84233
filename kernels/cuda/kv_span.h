/* kv_span.h: the knob of the CUDA backend's attention_spans (kernels/cuda/kv_span.cu) that tests
 * and benchmarks set; a header of its own so that a change to it rebuilds only its users.
 * Ownership: nothing is allocated. Errors: none (values out of range restore the default).
 */
#ifndef KVS_CUDA_KV_SPAN_H
#define KVS_CUDA_KV_SPAN_H

#ifdef __cplusplus
extern "C" {
#endif

/* Forces the kind of attention_spans for every backend of the process (tests, benchmark
 * comparisons): 1 main's up to quest7 (K and V tiles staged together, two tiles in flight; a
 * split's first key found 32 spans a step), 2 K and V staged apart (the FlashAttention-2 order,
 * half the shared memory a block; groups of up to 16 query heads, others take kind 3) with the
 * indexed seek (the lanes' shares of the span list summed at once), 3 kind 1's staging with the
 * indexed seek, 4 kind 3 with the two-pointer copies also for tiles of two 16-key halves that are
 * each consecutive from a multiple of 16 (a Quest tile: two kept pages; the same bits as kind 3);
 * min_tiles, the least tiles of 32 keys a split is planned with (1-64). 0 (or any
 * other value) for either restores its default: KVS_CUDA_SPAN_KERNEL / KVS_CUDA_SPAN_MIN_TILES if
 * set, else the built-in choice. Every kind gives the same keys to each split in the same order. */
void kvs_cuda_set_span_kernel(int kind, int min_tiles);

/* The merge of attention_spans' splits (k_spans_merge, Retro's fused attend too): serial nonzero
 * takes the form of before (one dependent load a step), 0 (the default) the staged one; the same
 * bits. For the benches' A/B and the tests; process-wide, the current device. */
void kvs_cuda_set_span_merge(int serial);

#ifdef __cplusplus
}
#endif

#endif
