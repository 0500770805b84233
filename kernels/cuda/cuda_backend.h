/* cuda_backend.h: extras of the CUDA backend beyond the op table (kernels/backend.h), for the
 * GPU tests and the decode benchmark: random device data without host files, event timing
 * and the device-to-device copy bandwidth that the benchmark uses as its floor (step graphs are
 * in the op table: graph_begin / graph_end / graph_launch / graph_free), and switches between
 * the GEMM paths (decode GEMM, cuBLASLt tuned or heuristic, cublasGemmEx).
 *
 * Only declared when the build has CUDA (KVS_HAVE_CUDA=1). Every CUDA failure aborts with
 * file:line (CUDA_CHECK); functions that allocate return NULL on out-of-memory.
 * Ownership: weights from kvs_cuda_random_weight are freed by the op table's free_weight (or
 * by the backend's free).
 */
#ifndef KVS_CUDA_BACKEND_H
#define KVS_CUDA_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/backend.h"

#if defined(KVS_HAVE_CUDA) && KVS_HAVE_CUDA
#ifdef __cplusplus
extern "C" {
#endif

/* The op table (kernels/backend.h), defined in cuda_backend.cu; engine/runner.c selects it for
 * device "cuda" (and "auto" when a GPU is usable). */
extern const struct kvs_backend_ops kvs_cuda_backend;

/* A weight of rows x cols (rows = 1 and is_vector = 1 for a 1-D vector) filled on the device
 * with uniform random values in [-scale, scale) from seed. NULL on out-of-memory. */
struct kvs_dweight *kvs_cuda_random_weight(struct kvs_backend *b, int64_t rows, int64_t cols,
                                           int is_vector, float scale, uint64_t seed);
/* Fills n elements of buf from off (ACT/F32/KV kinds) with uniform values in [-scale, scale). */
void kvs_cuda_fill_random(struct kvs_backend *b, struct kvs_dbuf *buf, size_t off, size_t n,
                          float scale, uint64_t seed);

/* Event timing on the backend's stream: mark, then elapsed ms since the mark (waits). */
void kvs_cuda_timer_start(struct kvs_backend *b);
float kvs_cuda_timer_stop_ms(struct kvs_backend *b);

/* Measured device-to-device copy bandwidth in bytes/s (bytes read + bytes written over time),
 * median of several cudaMemcpyAsync of `bytes` bytes; uses a temporary allocation (setup
 * only, never inside a step). Returns 0 if the memory cannot be had. */
double kvs_cuda_copy_bandwidth(struct kvs_backend *b, size_t bytes);

/* Forces n_splits context splits on every attention launch (benchmark comparisons); 0 restores
 * the automatic choice. */
void kvs_cuda_set_attn_splits(struct kvs_backend *b, int n_splits);

/* Batch-invariant numerics (config key batch_invariant; the backend op set_batch_invariant):
 * on > 0: the decode attention plans its splits from each row's own context
 * (cuda_attn_device.cuh at_split_keys) and the decode GEMM takes variant bit 512 (process-wide,
 * cuda_skinny.h), so a decode row's bits do not depend on the batch, the other rows' contexts or
 * a recorded graph's capacity; 0: back to the default plan (and the GEMM variant without the bit).
 * Ignored where KVS_CUDA_BATCH_INVARIANT is set (the environment overrides the config). Later
 * launches and graph recordings take it. */
void kvs_cuda_set_batch_invariant(struct kvs_backend *b, int on);

/* Forces the decode attention kernel (tests, benchmark comparisons): 0 CUDA cores, 2 / 3 tensor
 * cores with one warp a block and 2 / 3 K/V tiles in flight, 4 the FlashAttention-2-style 4-warp
 * kernel, its KV staged by the copy engine (TMA) where it can (blocks of a multiple of 16
 * slots), 5 the same kernel staged with cp.async always (4 and 5: decode launches of
 * at most 16 query heads per KV head, head_dim 64 / 128 / 256, with or without rotation offsets;
 * others keep the automatic choice); -1 (or any other value) restores the default:
 * KVS_CUDA_DEC_ATTN if set, else automatic. */
void kvs_cuda_set_dec_attn(struct kvs_backend *b, int kind);

/* Forces the layout of the LeanKV attention kernel (kernels/cuda/kv_lean.cu; tests, benchmark
 * comparisons) for every backend of the process: 1 query rows on the mma's M side (tiles of up to
 * 16 rows), 2 keys on M (tiles of up to 8 rows; taken only where a group has at most 8 query
 * heads); 0 (or any other value) restores the automatic choice (keys on M for decode rows and
 * spans, rows on M for prefill chunks). */
void kvs_cuda_set_lean_layout(int layout);

/* Picks the prefill attention kernel, process-wide (tests, benchmark comparisons): 1 the
 * FlashAttention-2-style mma.sync kernel (k_attn_tc), 2 the Hopper wgmma kernel (k_attn_wg) with
 * 128-key tiles, 3 with 64-key tiles, 4 / 5 the same with the softmax overlapping the P.V product
 * (128- / 64-key tiles), 6 64-key tiles with two blocks an SM, 7 to 25 the FlashAttention-3-style
 * k_attn_fa3's forms (cuda_attn_prefill_fa3.cu; 14: K and V producer warps, 3 stages; 19: 14 with
 * persistent blocks; 20 / 21: 14 / 19 skipping O's rescale where no max grew; 22: 14 with the Q
 * reads in flight at once and the softmax in shorter chains ahead of the P . V wait; 23: 22 with
 * ping-pong; 24: 14 with the Q reads only; 25: 22 with persistent blocks in snake order) (2 to
 * 25: head_dim 64 / 128 on an sm_90 GPU; with rotation offsets only 14 and 19 to 25, with blocks of a multiple of 16 slots; other launches
 * take 1; fa3 launches it cannot stage take 6); 26 cuDNN's fused SDPA (cuda_attn_cudnn.cu: built
 * only with `make CUDNN=...`, libcudnn.so.9 9.6+ opened at run time; head_dim 64 / 128 on sm_90,
 * without rotation offsets or block_valid; every other launch, a build without cuDNN, a cuDNN
 * that cannot be opened or a graph it cannot build or run takes kind 14, with one log line a
 * process); -1 (or any other value)
 * restores the default: KVS_CUDA_PRE_ATTN if set, else kind 14 where the wgmma kernels apply. */
void kvs_cuda_set_pre_attn(int kind);
/* 1 when prefill-attention kind 26 can run: cuDNN built in and libcudnn.so.9 (9.6 or later)
 * opened (the first call opens it); 0 otherwise. */
int kvs_cuda_cudnn_prefill_available(void);
/* Launches whose prefill rows kind 26 has computed so far, process-wide (tests: a launch kind 26
 * gave back to kind 14 does not count); 0 in a build without cuDNN. */
long long kvs_cuda_cudnn_prefill_launches(void);
/* The prefill kernel a launch of this head_dim (rot: with rotation offsets) takes now, on the
 * current device: 1 to 26 as above (with rotation offsets and blocks of other than a multiple of
 * 16 slots, 1 where this says 14 or 19 to 25; 26 only where cuDNN can be had). */
int kvs_cuda_pre_attn_kind(int head_dim, int rot);

/* Matmuls of at most max_n rows may use the decode GEMM (cuda_skinny.h, at most KVS_SKINNY_MAX_N;
 * which launches it takes depends on the variant), larger ones cuBLAS; 0: cuBLAS always; -1:
 * back to the default (64, or KVS_CUDA_SKINNY_MAX at create). */
void kvs_cuda_set_skinny_max(struct kvs_backend *b, int max_n);
/* The decode GEMM's variant (cuda_skinny.cu: bit 1 two K groups in flight at 9+ rows, bit 2 the
 * L2::256B hint: bitwise the same results; bit 4 the wgmma kernel on Hopper, with bit 1 its K
 * split for one block per SM, bit 8 only where it does not split: other sums, close; bit 32
 * k_dgemm_n for the launches it would split, 2-64 rows), for benchmarks and tests; -1: the
 * default (46). Process-wide. */
void kvs_cuda_set_skinny_variant(struct kvs_backend *b, int v);
/* Early launch of the next kernel in a decode step (cuda_launch.h, grid_dep_launch), a mask: 1
 * the decode GEMMs, 2 the decode attention and its merge, 4 the RMSNorms and RoPE + KV write
 * (launches of 2 rows or more; default 7); -1 back to KVS_CUDA_PDL_EARLY or the default. The
 * same results either way (tests compare bitwise). Later launches and graph captures take it;
 * process-wide. */
void kvs_cuda_set_pdl_early(struct kvs_backend *b, int on);

/* How the matmuls that do not take the decode GEMM run (benchmark A/B comparisons and tests). */
enum kvs_cuda_gemm {
    KVS_CUDA_GEMM_TUNED = 0,     /* cuBLASLt, the algorithm picked by timing per shape (default) */
    KVS_CUDA_GEMM_HEURISTIC = 1, /* cuBLASLt, always its heuristic's first pick (KVS_CUDA_GEMM_TUNE=0) */
    KVS_CUDA_GEMM_EX = 2,        /* the former path: cublasGemmEx, CUBLAS_GEMM_DEFAULT (KVS_CUDA_GEMM=ex) */
};
/* Selects one of enum kvs_cuda_gemm; -1: back to the default (from the environment at create).
 * Picks already timed stay cached, so switching back to TUNED does not time them again. */
void kvs_cuda_set_gemm(struct kvs_backend *b, int mode);

/* Times the cuBLASLt algorithms for w (a 2-D weight of rows = out x cols = in) at the decode
 * graphs' row counts, as upload_weight does for every matrix of a new shape (once per shape):
 * for weights that bypass upload_weight (kvs_cuda_random_weight). Load time only (allocates a
 * scratch, synchronises); a no-op when timing is off or the shape was done. */
void kvs_cuda_pretune(struct kvs_backend *b, const struct kvs_dweight *w);

/* y += x W^T through the cuBLAS path whatever n (the accumulate form of the GEMM, which no op of
 * the table uses yet: for tests). x [n][in] ACT, w [out][in], y [n][out] ACT. */
void kvs_cuda_matmul_accumulate(struct kvs_backend *b, const struct kvs_dbuf *x, const struct kvs_dweight *w,
                                int n, int in, int out, struct kvs_dbuf *y);

/* 1 when the CUDA attention supports this model shape (head_dim 16/32/64/128/256, at most 32
 * query heads per KV head); the runner refuses other shapes on this backend with a message. */
int kvs_cuda_supports_attention(int n_heads, int n_kv_heads, int head_dim);

/* "NVIDIA H100 80GB HBM3, 132 SMs, 79.1 GiB" style description. */
void kvs_cuda_device_desc(struct kvs_backend *b, char *out, size_t outlen);

#ifdef __cplusplus
}
#endif
#endif
#endif
