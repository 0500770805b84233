/* cuda_skinny.h: the decode GEMM of the CUDA backend (internal to kernels/cuda/; cuda_gemm.cu
 * calls it for matmuls of at most KVS_SKINNY_MAX_N rows).
 *
 * y[t][o] = <x[t], W[o]> for n <= KVS_SKINNY_MAX_N (128) token rows. The backend uses it up to
 * skinny_max rows (8 by default): past ~12 rows cuBLASLt reads the weights faster and at 32-128
 * rows this kernel falls far behind (bench/RESULTS.md, issue 22; every block re-reads all of x,
 * the likely limit, not profiled); the wide instantiations serve measurements and
 * KVS_CUDA_SKINNY_MAX experiments. A decode step multiplies a few rows by every
 * weight matrix of the model once, so it is bound by reading W. The kernel streams W with 16-byte
 * loads, not cached in L1, and multiplies it on the tensor cores (mma m16n8k16, bf16 in, fp32
 * accumulate) with W as the 16-row operand and the tokens as the 8-wide one; the K dimension of
 * each 16-row tile is split over the 16 warps of a block and the partial sums are added in warp
 * order (deterministic; a row's result does not depend on the other rows of the batch).
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
};

/* 1 when the kernel takes this shape: 1 <= n <= KVS_SKINNY_MAX_N, in a multiple of 32, every
 * out a multiple of 16 (plain) or of 8 (swiglu). */
int kvs_cu_skinny_supported(int n, int in, const int *out, int n_parts, int swiglu);

/* Variant of the kernel for later launches (benchmarks; bits in cuda_skinny.cu, results bitwise
 * the same); -1: back to KVS_CUDA_SKINNY_VARIANT or the default. Not thread-safe: set it while
 * no other thread launches. */
void kvs_cu_skinny_set_variant(int v);

/* Enqueues y = x W^T (+ bias) for every part, or the SwiGLU pair, on `stream`. */
cudaError_t kvs_cu_skinny(const struct kvs_cu_skinny *a, cudaStream_t stream);

#endif
