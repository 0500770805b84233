/* cuda_skinny.h: the decode GEMM of the CUDA backend (internal to kernels/cuda/; cuda_gemm.cu
 * calls it for matmuls of at most KVS_SKINNY_MAX_N rows).
 *
 * y[t][o] = <x[t], W[o]> for n <= KVS_SKINNY_MAX_N (128) token rows. The backend uses it up to
 * skinny_max rows (64 by default): k_skinny, below, past ~12 rows falls behind cuBLASLt (every
 * block re-reads all of x); on Hopper the wgmma kernel (cuda_dgemm.cu, kvs_cu_dgemm) takes 2-64
 * rows of the launches it does not split K for (gate/up, the LM head: 2,750-2,990 GB/s up to 32
 * rows), and k_dgemm_n (cuda_dgemm.cu, kvs_cu_dgemm_n: K whole) 2-64 rows of the others (q/k/v,
 * o, down), which k_skinny (up to 8 rows) or cuBLAS took before (bench/RESULTS.md, issue 22,
 * decode4 to decode6). A decode step multiplies a few rows by every
 * weight matrix of the model once, so it is bound by reading W. The kernel streams W with 16-byte
 * loads, not cached in L1, and multiplies it on the tensor cores (mma m16n8k16, bf16 in, fp32
 * accumulate) with W as the 16-row operand and the tokens as the 8-wide one; the K dimension of
 * each 16-row tile is split over the 16 warps of a block and the partial sums are added in warp
 * order (deterministic; a row's result does not depend on the other rows of the batch).
 *
 * Batch invariance (variant bit 512; KVS_CUDA_BATCH_INVARIANT=1, not the default: it slows the
 * batch-1 step, cuda_skinny.cu): which kernel runs a launch is a function of
 * its shapes alone, from 1 row up (a single row runs the n-row kernel, not the GEMV), so on Hopper
 * every row count the backend gives the decode GEMM (1..skinny_max, 64 by default; up to 128 with
 * KVS_CUDA_SKINNY_MAX=128, k_dgemm_n then in launches of 64 rows) yields a row's bits whatever n
 * and wherever the row sits. Not invariant: launches past skinny_max (cuBLAS), shapes the kernels
 * reject (cuBLAS at every n).
 *
 * One launch may cover up to three matrices that read the same x (the q, k and v projections),
 * each with its own output and bias, or a gate/up pair whose epilogue applies SwiGLU
 * (y = silu(x Wg^T) * (x Wu^T)) and also writes the bf16 copy of y for the down projection.
 *
 * Ownership: nothing is allocated; the caller passes device pointers. Errors: kvs_cu_skinny
 * returns the launch status (cudaSuccess or the launch error); call kvs_cu_skinny_supported
 * first (shapes it rejects are bugs to pass).
 */
#ifndef KVS_CUDA_SKINNY_H
#define KVS_CUDA_SKINNY_H

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#define KVS_SKINNY_MAX_N 128
/* rows the decode GEMM takes for every shape it supports at the default variant (k_skinny or the
 * wgmma kernel); from 9 rows launches that the wgmma kernel would split go to cuBLAS */
#define KVS_SKINNY_ALWAYS_N 8
#define KVS_SKINNY_MAX_PARTS 3

struct kvs_cu_skinny {
    const __nv_bfloat16 *x;       /* [n][in] bf16 */
    int n, in;
    int swiglu;                   /* 0: n_parts plain matrices; 1: w[0] = gate, w[1] = up, both [out[0]][in] */
    int n_parts;
    const __nv_bfloat16 *w[KVS_SKINNY_MAX_PARTS]; /* [out[p]][in] row-major (Hugging Face Linear) */
    const float *bias[KVS_SKINNY_MAX_PARTS];      /* [out[p]] or NULL (plain only) */
    int out[KVS_SKINNY_MAX_PARTS];
    float *y[KVS_SKINNY_MAX_PARTS];               /* [n][out[p]] fp32 */
    __nv_bfloat16 *yh;            /* swiglu: NULL or the bf16 copy of y[0] [n][out[0]] */
    const struct kvs_cu_dgemm_ws *ws; /* NULL: never the wgmma kernel (below) */
};

/* The wgmma kernel's split-K scratch (cuda_dgemm.cu), owned by the backend: ws holds floats
 * (kvs_cu_dgemm_ws_floats), sem n_sems counters, zeroed once (each launch leaves them zero). */
struct kvs_cu_dgemm_ws {
    float *ws;
    size_t floats;
    unsigned *sem;
    int n_sems, n_sms;
};

/* 1 when the kernel takes this shape: 1 <= n <= KVS_SKINNY_MAX_N, in a multiple of 32, every
 * out a multiple of 16 (plain) or of 8 (swiglu). */
int kvs_cu_skinny_supported(int n, int in, const int *out, int n_parts, int swiglu);

/* 1 when kvs_cu_skinny should run this matmul at the current variant: k_skinny's shapes, and
 * with the wgmma kernel chosen (variant bit 4) past 8 rows only the shapes that kernel takes
 * (dg_sms: the device's SM count where it runs that kernel, else 0: those matmuls belong to
 * cuBLAS); with variant bit 8 also not the launches it would split (cuBLAS above 8 rows,
 * k_skinny up to 8). With bit 512 (batch invariance) every shape k_skinny supports, at any n. */
int kvs_cu_skinny_takes(int n, int in, const int *out, int n_parts, int swiglu, int dg_sms);

/* Variant of the kernel for later launches (benchmarks; bits in cuda_skinny.cu, results bitwise
 * the same except bit 512 at one row and bits 1024 / 2048 at 65-128 rows); -1: back to KVS_CUDA_SKINNY_VARIANT (| 512 with
 * KVS_CUDA_BATCH_INVARIANT=1) or the default. Not thread-safe: set it while
 * no other thread launches. */
void kvs_cu_skinny_set_variant(int v);
/* Bit 512 on (1) or off (0) for the variant that kvs_cu_skinny_set_variant did not force
 * (kvs_cuda_set_batch_invariant: the config key batch_invariant); -1: back to
 * KVS_CUDA_BATCH_INVARIANT. Not thread-safe, as kvs_cu_skinny_set_variant. */
void kvs_cu_skinny_set_invariant(int on);

/* Enqueues y = x W^T (+ bias) for every part, or the SwiGLU pair, on `stream`; only launches
 * kvs_cu_skinny_takes accepts (others: cudaErrorInvalidValue). */
cudaError_t kvs_cu_skinny(const struct kvs_cu_skinny *a, cudaStream_t stream);

/* cuda_dgemm.cu: the Hopper decode GEMM (wgmma, sm_90a only; variant bit 4 of
 * kvs_cu_skinny_set_variant picks it for 2..128 rows, bit 512 for 1..128). Weights on the MMA's M side in 128-row
 * tiles, K split over blocks where the tiles do not fill the GPU: the split is a function of the
 * launch's shapes and the SM count (two blocks per SM, or one: per_sm), not of n, so a row's bits
 * do not depend on the batch; they do depend on the launch (q alone may split K otherwise than
 * q/k/v together: equal to ~1e-6, not bitwise). Shapes: 1 <= n <= 128, in % 64 == 0, every out
 * a multiple of 8. */
int kvs_cu_dgemm_supported(int n, int in, const int *out, int n_parts, int swiglu);
/* the K splits kvs_cu_dgemm plans for this launch shape (1: none) */
int kvs_cu_dgemm_splits(int in, const int *out, int n_parts, int swiglu, int n_sms, int per_sm);
/* floats of split-K workspace for a device of n_sms SMs (counters: 2 a tile, 4 x n_sms will do) */
size_t kvs_cu_dgemm_ws_floats(int n_sms);
/* cluster: 1 reduces the splits of a unit in its cluster's shared memory (at most 8 splits; more
 * take the workspace), 0 through the workspace; the same order of additions, the same bits */
/* one_tile: blocks of one 128-row tile (two per SM) at 64-128 tokens too, instead of two tiles
 * (one per SM); the same order of additions, the same bits */
cudaError_t kvs_cu_dgemm(const struct kvs_cu_skinny *a, const struct kvs_cu_dgemm_ws *ws, int per_sm, int cluster,
                         int one_tile, cudaStream_t stream);

/* cuda_dgemm.cu, k_dgemm_n (variant bit 32): the weights on the wgmma's N side, R rows a block,
 * the whole of K a block (no split, no workspace) for 1..64 tokens. Returns R (32 / 48 / 64, the
 * least that keeps the launch within one block per SM; a function of the shapes, not of n) or 0
 * where the kernel does not apply (SwiGLU, n outside 1..64, K not a multiple of 128, shapes
 * kvs_cu_dgemm_supported rejects). */
int kvs_cu_dgemm_n_rows(int n, int in, const int *out, int n_parts, int swiglu, int n_sms);
/* x_fit: stage x in tiles of 16 rows at n <= 16 (bit 1) / of 32 rows at n <= 32 (bit 2), not 64,
 * and more weights a stage, where K allows (a multiple of 256); the same order of additions, the
 * same bits */
cudaError_t kvs_cu_dgemm_n(const struct kvs_cu_skinny *a, int rows, int x_fit, cudaStream_t stream);

/* cuda_dgemm128.cu, k_dgemm_n2 (variant bits 1024 / 2048 / 4096): k_dgemm_n for 65..128 tokens,
 * two warpgroups of 64 tokens sharing each weight tile (the weights read once for all rows), plain
 * parts or the SwiGLU pair. Returns the tile's weight rows N (plain: 32 / 48 / 64 / 96, the least
 * that keeps the launch within one block per SM, from 64 with wide; SwiGLU: 128 or 224, half gate
 * and half up rows), or 0 where it does not apply (n outside 65..128, K not a multiple of 64,
 * shapes kvs_cu_dgemm_supported rejects, n_sms 0). A function of the shapes, not of n. */
int kvs_cu_dgemm_n2_rows(int n, int in, const int *out, int n_parts, int swiglu, int n_sms, int wide);
/* rows: what kvs_cu_dgemm_n2_rows returned for the launch (others: cudaErrorInvalidValue), plain
 * launches | 4096 for a deeper x ring (variant bit 8192); | 16384 / 8192: k_dgemm_n3 instead, x
 * shared by clusters of 4 / 2 blocks (variant bits 16384 / 32768; it picks its own tile rows, and
 * runs k_dgemm_n2 where no cluster plan fits one wave) */
cudaError_t kvs_cu_dgemm_n2(const struct kvs_cu_skinny *a, int rows, cudaStream_t stream);
/* kvs_cu_dgemm_n2's calls so far in this process (not thread-safe; tests only: C linkage, so the C
 * test declares it itself) */
extern "C" unsigned long kvs_cu_dgemm_n2_launches(void);
/* k_dgemm_n3's launches so far (the same terms) */
extern "C" unsigned long kvs_cu_dgemm_n3_launches(void);

#endif
