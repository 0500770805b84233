/* cuda_backend.cu: the CUDA implementation of the backend op table (kernels/backend.h).
 *
 * Formats (the choices backend.h leaves to each backend):
 *   KVS_BUF_ACT  fp32. The residual stream, norms, RoPE, softmax state and every activation stay
 *                in fp32, so the CUDA backend tracks the fp32 CPU reference closely; only GEMM
 *                inputs are rounded to bf16. The norms and SwiGLU write that bf16 copy as they
 *                produce their output (xh_src), and so does the attention: a GEMM input needs
 *                a conversion pass only when nothing mirrored it.
 *   KVS_BUF_F32  fp32;  KVS_BUF_I32 int32;  KVS_BUF_KV bf16.
 *   weights      2-D matrices bf16 (converted at upload from bf16/f16/f32); 1-D vectors (norm
 *                weights, biases) fp32, exact.
 * GEMMs: decode-sized batches (n <= skinny_max) use the decode GEMM of cuda_skinny.cu (tensor
 * cores, weights streamed once; q/k/v in one launch, gate/up with SwiGLU in its epilogue);
 * larger ones cuBLASLt (cublasLtMatmul), bf16 x bf16 -> fp32 output, CUBLAS_COMPUTE_32F, with
 * the algorithm picked per shape by timing cuBLASLt's heuristic candidates (up to 256 rows;
 * timed when a new weight shape is uploaded, at the decode graphs' row counts, else on the
 * shape's first call outside a graph capture; row counts that are no graph's take the pick of
 * the next larger one, untimed, so mixed steps never stall; the timing also tries split-K
 * variants of the first candidates, KVS_CUDA_GEMM_SPLITK=0: not; KVS_CUDA_GEMM_TUNE=0: the
 * heuristic's first pick always). KVS_CUDA_GEMM=ex keeps the former cublasGemmEx path for
 * comparisons.
 * Fused weights (fuse_weights; the runner lays out each layer's q/k/v and gate/up so at load):
 * above the decode GEMM's rows, q/k/v run as one GEMM (up to GEMM_TUNE_MAX_N rows, into the
 * fuse_ws scratch, whose rows go straight to the RoPE and cache write in matmul_rope_kv_write
 * or are split into q, k, v in matmul_multi) and gate/up as one bf16-output GEMM; alone, a
 * k or v projection at 32-128 rows covers 8-16 tiles of an H100's 132 SMs.
 * Attention: kernels/cuda/cuda_attention.cu (paged, flash-decoding with cp.async K/V tiles, a
 * tiled prefill launch, deferred RoPE). Results are deterministic but not bitwise batch
 * invariant as backend.h asks: cuBLAS picks its kernel by n, and the context split of the
 * attention depends on the batch (differences are at bf16 rounding level). A timed pick may
 * also differ between two runs of the server (timing noise), so GEMM results are reproducible
 * within one backend's life (but a graph recorded before its shape was timed keeps the first
 * pick), and across runs only with KVS_CUDA_GEMM_TUNE=0.
 *
 * Memory: plain cudaMalloc, only in create, alloc, upload_weight and fuse_weights (the matmul's
 * bf16 copy of x and the attention workspace are carved at create / grown in alloc; fuse_weights
 * moves a group into one allocation shared by its weights (struct wstore, freed with the last)
 * and allocates the fuse_ws scratch once; alloc and fuse_weights also take a scratch for
 * timing the GEMMs of new weight shapes and free it), plus a scratch for timing
 * a new shape of the accumulate GEMM (once per shape, never inside a graph) and the L2-flush
 * buffer of each timing (twice the L2, freed when the shape is timed). One stream; ops
 * never synchronise, except a GEMM whose shape is timed on its first call (outside graph
 * captures, once per shape); download/logits_to_host/sync wait. Every CUDA/cuBLAS/cuBLASLt call
 * is checked: failures log file:line and abort (bugs, not client errors); the exceptions are
 * handled: a timed candidate that cuBLASLt rejects is skipped, a shape with no cuBLASLt
 * algorithm goes to cublasGemmEx.
 */
#include <climits>
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define _Noreturn [[noreturn]]
extern "C" {
#include "base/util.h"
#include "kernels/backend.h"
#include "models/model.h"
}
#include "kernels/cuda/cuda_attention.h"
#include "kernels/cuda/cuda_launch.h"
#include "kernels/cuda/cuda_skinny.h"

/* matmuls of at most this many rows use the decode GEMM (cuda_skinny.h), larger ones cuBLAS: on
 * H100 the decode GEMM reads the step's weights at 2538 GB/s for 8 rows (cuBLAS 2437) but only
 * 2364 for 12 (cuBLAS 2406), bench/RESULTS.md */
#define SKINNY_MAX_DEFAULT 8
/* nvcc builds only this side: see cuda_backend.h's declarations (the C files get the flag from the Makefile) */
#ifndef KVS_HAVE_CUDA
#define KVS_HAVE_CUDA 1
#endif
#include "kernels/cuda/cuda_backend.h"

/* for cuBLAS and cuBLASLt calls alike (both return cublasStatus_t) */
#define CUBLAS_CHECK(call)                                                                   \
    do {                                                                                     \
        cublasStatus_t s_ = (call);                                                          \
        if (s_ != CUBLAS_STATUS_SUCCESS)                                                     \
            kvs_panic(__FILE__, __LINE__, "cuBLAS error %d (%s) in %s", (int)s_,              \
                      cublasGetStatusString(s_), #call);                                     \
    } while (0)
/* after every kernel launch: launch-configuration errors surface here, with the caller's line */
#define LAUNCH_CHECK() CUDA_CHECK(cudaGetLastError())

typedef __nv_bfloat16 bf16;

/* ---- objects ------------------------------------------------------------------------------ */

struct kvs_dbuf {
    struct kvs_dbuf *prev, *next; /* the backend's list of live buffers (freed by free()) */
    enum kvs_buf_kind kind;
    size_t n;                     /* elements */
    void *d;                      /* device memory: float (ACT, F32), int32 (I32), bf16 (KV) */
};

/* The device storage of matrices laid out back to back by fuse_weights: each of them points into
 * it, and the last one freed frees it. */
struct wstore {
    bf16 *base;
    int refs;
};

struct kvs_dweight {
    struct kvs_dweight *prev, *next; /* the backend's list of live weights */
    int64_t rows, cols;           /* a vector has rows = 1 */
    int is_vector;                /* 1: fp32 vector in f; 0: bf16 matrix [rows][cols] in h */
    float *f;
    bf16 *h;                      /* its own cudaMalloc, or (store != NULL) a slice of store->base */
    struct wstore *store;         /* fused storage shared with its neighbours (fuse_weights), or NULL */
};

struct kvs_graph {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    bf16 *xh;                     /* the bf16 mirror's state after the recorded ops (restored at replay) */
    const void *xh_src;
    size_t xh_n;
};

#define ATTN_WS_BYTES ((size_t)64 << 20)   /* split-attention partials */
#define BLAS_WS_BYTES ((size_t)32 << 20)   /* cuBLAS / cuBLASLt workspace (fixed, so graphs can capture) */
#define BOUNCE_ELEMS ((size_t)1 << 20)     /* host conversion chunk */

/* cuBLASLt algorithm choice. cublasLtMatmulAlgoGetHeuristic ranks its candidates by an estimate;
 * on H100 the fastest at 32-128 rows is often not its first (a [128] x [4096 x 14336]^T GEMM:
 * first pick 53.3 us, best of 8 45.9 us), so the first time a shape runs outside a graph capture
 * its candidates are timed on the call's operands and the pick is kept for the backend's life.
 * Decode steps are graph-captured on first use, where nothing can be timed: each new weight shape
 * is timed at the graphs' row counts up front (gemm_pretune), at the first alloc after its
 * upload, by when the runner has fused q/k/v and gate/up (fuse_weights times the joint shapes). */
#define GEMM_PLAN_SLOTS 2048                 /* hash table of timed picks (open addressing) */
#define GEMM_PLAN_MAX 1536                   /* picks kept at most, so probe chains stay short */
#define GEMM_TUNE_MAX_N 256                  /* rows up to which a shape is timed: the decode graphs'
                                              * sizes; prefill chunks and mixed steps vary their row
                                              * count every step, are compute bound (the first pick
                                              * does well there), and timing each would stall them */
#define GEMM_HEURISTIC 16                    /* heuristic results asked for */
#define GEMM_SPLITK_BASES 4                  /* unsplit candidates given split-K variants (the first
                                              * ones in the heuristic's order that support it) */
#define GEMM_CANDIDATES 64                   /* candidates timed at most: the heuristic's and the
                                              * split-K variants (gemm_splitk_variants) */
#define GEMM_WARMUP 2
#define GEMM_TIMED 5
#define GEMM_SPIN_NS 100000                  /* the stream waits while the timed runs are queued */
#define GEMM_MIN_GAIN 0.98f                  /* another pick must take <= 98% of the first's time */
#define GEMM_PRETUNE_SHAPES 256              /* weight shapes remembered as pre-tuned */
#define GEMM_PRETUNE_SCRATCH ((size_t)256 << 20) /* x + y scratch of one pre-tuned row count, at most */
#define FUSE_WS_MAX ((size_t)16 << 20)       /* matmul_multi's fp32 output scratch for weights fused by
                                              * fuse_weights: groups of which GEMM_TUNE_MAX_N rows fit
                                              * run as one GEMM (q/k/v of the 8B models: 6 MB) */

/* What a cuBLAS(Lt) GEMM writes: y = x W^T in fp32 (ACT), y += x W^T in fp32 (the accumulate
 * GEMM), or y = x W^T rounded to bf16 (matmul_swiglu's gate and up, which SwiGLU reads back:
 * half the bytes written and read, as PyTorch's bf16 Linear layers have it) */
enum gemm_out { GEMM_F32 = 0, GEMM_F32_ACC = 1, GEMM_BF16 = 2 };

/* one timed pick: y[n][out] (+)= x[n][in] W[out][in]^T with pointers aligned to `align` bytes */
struct gemm_plan {
    int n, in, out, kind, align; /* the key (kind: enum gemm_out); n == 0: a free slot */
    int differs;                       /* 1: the pick is not the heuristic's first */
    cublasLtMatmulAlgo_t algo;
};

struct gemm_tuning {
    struct gemm_plan plans[GEMM_PLAN_SLOTS];
    int n_plans;
    int full_warned;                   /* the table-full warning was logged */
    cudaEvent_t ev[2 * GEMM_TIMED];    /* the timing's own events, a pair per timed run
                                        * (kvs_cuda_timer_* may be running) */
    int64_t pretuned[GEMM_PRETUNE_SHAPES][2]; /* weight shapes (rows, cols) done by gemm_pretune */
    int n_pretuned;
    int64_t pending[GEMM_PRETUNE_SHAPES][2]; /* shapes uploaded since, timed at the next alloc
                                              * (gemm_pretune_pending) */
    int n_pending;
    /* pre-tuning since the last summary line (logged when the model load is over: gemm_tune_report) */
    int log_mats, log_gemms, log_differ;
    double log_s;
};

struct kvs_backend {
    int device;
    int n_sms;
    cudaStream_t stream;
    cublasHandle_t blas;
    void *blas_ws;
    bf16 *xh_buf[2];              /* two bf16 mirror buffers [xh_cap]: an op that reads one mirror (the fused
                                   * gate/up GEMM) writes its output's into the other */
    bf16 *xh;                     /* the current mirror: xh_buf[0] or [1] */
    size_t xh_cap;
    const void *xh_src;           /* the fp32 buffer xh currently mirrors (NULL: none), xh_n elements of it.
                                   * The norms and SwiGLU write the bf16 copy of their output as they go, so
                                   * the GEMMs that read it (q/k/v, gate/up, down) skip the conversion pass;
                                   * every op that writes a buffer calls xh_forget() on it. */
    size_t xh_n;
    float *attn_ws;               /* ATTN_WS_BYTES */
    float *fuse_ws;               /* matmul_multi's joint output of fused weights, fuse_cap floats
                                   * (FUSE_WS_MAX bytes, allocated by the first fuse_weights) */
    size_t fuse_cap;
    void *bounce;                 /* host: BOUNCE_ELEMS fp32, then BOUNCE_ELEMS bf16 */
    cudaEvent_t ev0, ev1;
    cublasLtHandle_t lt;
    int gemm_mode;                /* enum kvs_cuda_gemm: how matmuls that skip the decode GEMM run */
    int gemm_default;             /* gemm_mode at create (KVS_CUDA_GEMM, KVS_CUDA_GEMM_TUNE) */
    int gemm_splitk;              /* 1: the timing also tries split-K variants (KVS_CUDA_GEMM_SPLITK=0: no) */
    struct gemm_tuning *tune;     /* the timed cuBLASLt picks (see the GEMM section) */
    int skinny_max;               /* matmuls of n <= skinny_max rows use the decode GEMM (cuda_skinny.h),
                                   * larger ones cuBLAS; KVS_CUDA_SKINNY_MAX (0: cuBLAS always) */
    int skinny_default;           /* skinny_max at create */
    int attn_splits;              /* context splits forced on the attention (benchmark comparisons,
                                   * KVS_CUDA_ATTN_SPLITS); 0 = automatic (cuda_attention.cu) */
    int dec_attn;                 /* decode attention kernel forced (kvs_cuda_set_dec_attn); -1 =
                                   * KVS_CUDA_DEC_ATTN or automatic (cuda_attention.cu) */
    struct kvs_dbuf *bufs;        /* live buffers and weights, released by cu_free */
    struct kvs_dweight *weights;
};

template <typename T> static void list_add(T **head, T *x)
{
    x->prev = NULL;
    x->next = *head;
    if (*head) (*head)->prev = x;
    *head = x;
}
template <typename T> static void list_del(T **head, T *x)
{
    if (x->prev) x->prev->next = x->next; else *head = x->next;
    if (x->next) x->next->prev = x->prev;
}

/* the bf16 mirror of a matmul input (see xh_src): forget it when its buffer is written */
static void xh_forget(struct kvs_backend *b, const void *d)
{
    if (b->xh_src == d) b->xh_src = NULL;
}

/* an op about to write n elements of fp32 output to d: returns where to put their bf16 copy
 * (NULL when it does not fit) and records it as the mirror of d. The two buffers alternate, so
 * the mirror an op reads (claimed before) is never the one it writes. */
static bf16 *xh_claim(struct kvs_backend *b, const void *d, size_t n)
{
    if (n > b->xh_cap) {
        xh_forget(b, d);
        return NULL;
    }
    b->xh = b->xh == b->xh_buf[0] ? b->xh_buf[1] : b->xh_buf[0];
    b->xh_src = d;
    b->xh_n = n;
    return b->xh;
}

static size_t kind_size(enum kvs_buf_kind k)
{
    return k == KVS_BUF_KV ? sizeof(bf16) : 4;
}

/* ---- small kernels ------------------------------------------------------------------------ */

static int grid_for(size_t n, int threads)
{
    size_t g = (n + (size_t)threads - 1) / (size_t)threads;
    return (int)(g > 65535u * 16u ? 65535u * 16u : (g ? g : 1));
}

__global__ void k_f32_to_bf16(const float *x, bf16 *y, size_t n)
{
    grid_dep_wait(); /* cuda_launch.h: the previous kernel's output is ready */
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        y[i] = __float2bfloat16(x[i]);
}

__global__ void k_bf16_fill_random(bf16 *y, size_t n, float scale, uint64_t seed)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint64_t z = seed + i * 0x9E3779B97F4A7C15ull; /* splitmix64 */
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        float u = (float)(z >> 40) * (1.0f / 16777216.0f);
        y[i] = __float2bfloat16((2.0f * u - 1.0f) * scale);
    }
}

__global__ void k_f32_fill_random(float *y, size_t n, float scale, uint64_t seed)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint64_t z = seed + i * 0x9E3779B97F4A7C15ull;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        float u = (float)(z >> 40) * (1.0f / 16777216.0f);
        y[i] = (2.0f * u - 1.0f) * scale;
    }
}

__global__ void k_embed(const bf16 *emb, const int32_t *tok, int dim, float *out)
{
    grid_dep_wait(); /* cuda_launch.h: the previous kernel's output is ready */
    size_t t = blockIdx.x;
    const bf16 *row = emb + (size_t)tok[t] * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) out[t * dim + i] = __bfloat162float(row[i]);
}

/* Sum over the block in a fixed order (warp shuffles, then warp 0 over the warp sums). */
__device__ float block_sum(float v, float *red)
{
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    int w = threadIdx.x >> 5, l = threadIdx.x & 31, nw = (blockDim.x + 31) >> 5;
    __syncthreads(); /* red may still be read by a previous call */
    if (l == 0) red[w] = v;
    __syncthreads();
    float s = 0.0f;
    for (int i = 0; i < nw; i++) s += red[i];
    return s;
}

#define NORM_THREADS 256

/* RMSNorm of one row per block, optionally after the residual add (ADD: res += delta first);
 * outh (may be null): the bf16 copy of out, for the next GEMM. Decode steps run these with one
 * or a few rows, so they are latency-bound: each thread loads its V float4 of every input
 * before it uses any (restrict pointers: no aliasing forces the loads to wait for the stores),
 * and a block holds the whole row (dim / 4 / V threads, at most 1024). dim % 4 == 0. */
template <int V, bool ADD>
__global__ void k_rmsnorm_vec(float *__restrict__ res, const float *__restrict__ delta, const float *__restrict__ w,
                              float eps, int dim, float *__restrict__ out, bf16 *__restrict__ outh)
{
    grid_dep_wait(); /* cuda_launch.h: the previous kernel's output is ready */
    __shared__ float red[32];
    const size_t t = blockIdx.x;
    const int n4 = dim / 4;
    float4 *xr = (float4 *)(res + t * dim);
    float4 v[V];
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < V; k++) {
        const int j = threadIdx.x + k * blockDim.x;
        if (j >= n4) continue;
        v[k] = xr[j];
        if (ADD) {
            const float4 d = ((const float4 *)(delta + t * dim))[j];
            v[k].x += d.x;
            v[k].y += d.y;
            v[k].z += d.z;
            v[k].w += d.w;
        }
    }
#pragma unroll
    for (int k = 0; k < V; k++) {
        const int j = threadIdx.x + k * blockDim.x;
        if (j >= n4) continue;
        if (ADD) xr[j] = v[k];
        ss += v[k].x * v[k].x + v[k].y * v[k].y + v[k].z * v[k].z + v[k].w * v[k].w;
    }
    ss = block_sum(ss, red);
    const float r = rsqrtf(ss / (float)dim + eps);
#pragma unroll
    for (int k = 0; k < V; k++) {
        const int j = threadIdx.x + k * blockDim.x;
        if (j >= n4) continue;
        const float4 g = ((const float4 *)w)[j];
        const float4 y = make_float4(v[k].x * r * g.x, v[k].y * r * g.y, v[k].z * r * g.z, v[k].w * r * g.w);
        ((float4 *)(out + t * dim))[j] = y;
        if (outh) {
            __nv_bfloat162 *oh = (__nv_bfloat162 *)(outh + t * dim) + 2 * j;
            oh[0] = __floats2bfloat162_rn(y.x, y.y);
            oh[1] = __floats2bfloat162_rn(y.z, y.w);
        }
    }
}

/* the general form (any dim): one block of NORM_THREADS per row */
__global__ void k_rmsnorm(const float *x, const float *w, float eps, int dim, float *out, bf16 *outh)
{
    grid_dep_wait(); /* cuda_launch.h: the previous kernel's output is ready */
    __shared__ float red[32];
    size_t t = blockIdx.x;
    const float *xr = x + t * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss, red);
    float r = rsqrtf(ss / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float y = xr[i] * r * w[i];
        out[t * dim + i] = y;
        if (outh) outh[t * dim + i] = __float2bfloat16(y);
    }
}

__global__ void k_add_rmsnorm(float *res, const float *delta, const float *w, float eps, int dim, float *out,
                              bf16 *outh)
{
    grid_dep_wait(); /* cuda_launch.h: the previous kernel's output is ready */
    __shared__ float red[32];
    size_t t = blockIdx.x;
    float *xr = res + t * dim;
    const float *dr = delta + t * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float v = xr[i] + dr[i];
        xr[i] = v;
        ss += v * v;
    }
    ss = block_sum(ss, red);
    float r = rsqrtf(ss / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float y = xr[i] * r * w[i];
        out[t * dim + i] = y;
        if (outh) outh[t * dim + i] = __float2bfloat16(y);
    }
}

/* Launches the vectorised norm when the row fits it (dim % 4 == 0, at most 4 float4 a thread);
 * returns 0 when it does not (the caller launches the general kernel). */
static int launch_rmsnorm_vec(cudaStream_t st, int n, float *res, const float *delta, const float *w, float eps,
                              int dim, float *out, bf16 *outh)
{
    if (dim % 4 != 0 || dim / 4 > 4 * 1024) return 0;
    const int n4 = dim / 4, v = (n4 + 1023) / 1024;
    const int threads = ((n4 + v - 1) / v + 31) / 32 * 32;
    cudaError_t e;
    if (delta) {
        if (v == 1) e = kvs_cu_launch(k_rmsnorm_vec<1, true>, n, threads, 0, st, res, delta, w, eps, dim, out, outh);
        else if (v == 2) e = kvs_cu_launch(k_rmsnorm_vec<2, true>, n, threads, 0, st, res, delta, w, eps, dim, out, outh);
        else e = kvs_cu_launch(k_rmsnorm_vec<4, true>, n, threads, 0, st, res, delta, w, eps, dim, out, outh);
    } else {
        if (v == 1) e = kvs_cu_launch(k_rmsnorm_vec<1, false>, n, threads, 0, st, res, delta, w, eps, dim, out, outh);
        else if (v == 2) e = kvs_cu_launch(k_rmsnorm_vec<2, false>, n, threads, 0, st, res, delta, w, eps, dim, out, outh);
        else e = kvs_cu_launch(k_rmsnorm_vec<4, false>, n, threads, 0, st, res, delta, w, eps, dim, out, outh);
    }
    CUDA_CHECK(e);
    return 1;
}

/* one warp per (row, head) */
__global__ void k_head_rmsnorm(float *x, const float *w, float eps, size_t n_rows_heads, int hd)
{
    grid_dep_wait(); /* cuda_launch.h: the previous kernel's output is ready */
    size_t rh = blockIdx.x * (size_t)(blockDim.x >> 5) + (threadIdx.x >> 5);
    if (rh >= n_rows_heads) return;
    int l = threadIdx.x & 31;
    float *xr = x + rh * hd;
    float ss = 0.0f;
    for (int i = l; i < hd; i += 32) ss += xr[i] * xr[i];
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    float r = rsqrtf(ss / (float)hd + eps);
    for (int i = l; i < hd; i += 32) xr[i] = xr[i] * r * w[i];
}

/* block per row; threads over (head, i < half) */
/* the rotation of one pair by (c, s), with the roundings spelled out: every kernel that rotates
 * (rope, rope_kv_write, matmul_rope_kv_write) gives the same bits, whatever the compiler would
 * contract into FMAs in each */
__device__ __forceinline__ void rope_pair(float a, float b, float c, float s, float *ra, float *rb)
{
    *ra = __fmaf_rn(a, c, -__fmul_rn(b, s));
    *rb = __fmaf_rn(b, c, __fmul_rn(a, s));
}

__global__ void k_rope(float *x, const int32_t *pos, const int32_t *rot, const float *inv_freq, int n_heads, int hd)
{
    grid_dep_wait(); /* cuda_launch.h: the previous kernel's output is ready */
    size_t t = blockIdx.x;
    int half = hd / 2;
    long long p = (long long)pos[t] + (rot ? rot[t] : 0);
    for (int j = threadIdx.x; j < n_heads * half; j += blockDim.x) {
        int h = j / half, i = j % half;
        float ang = (float)((double)p * (double)inv_freq[i]);
        float c = cosf(ang), s = sinf(ang);
        float *xh = x + (t * n_heads + h) * hd;
        rope_pair(xh[i], xh[i + half], c, s, &xh[i], &xh[i + half]);
    }
}

/* k_rope on q and k, then k_kv_write, in one launch (block per row): the decode step's three
 * smallest kernels, with the same arithmetic (bitwise the same results) */
/* RoPE of q and k and the K/V cache write of each row, reading q, k and v from their own
 * buffers (rope_kv_write: in place) or from the joint output of a fused q/k/v GEMM
 * (matmul_rope_kv_write: + bias, and v copied to its buffer too). One block a row and RKV_HEADS
 * heads of the row's q, k, v heads in that order (grid.y); the row's cos / sin table is computed
 * once a block into shared memory instead of once a head, with rope()'s arithmetic. */
#define RKV_HEADS 8
struct rkv_args {
    const float *qs, *ks, *vs;    /* sources of row t: qs + t * ldq etc. (qs == q: in place) */
    int ldq, ldk, ldv;
    const float *bq, *bk, *bv;    /* biases added before the rotation, or NULL */
    float *q, *k, *v;             /* rotated q, k; v (NULL: left alone) */
    const int32_t *pos, *slots;
    const float *inv_freq;
    int nh, nkv, hd, bs;
    bf16 *kc, *vc;
};

__global__ void k_rope_kv_write(struct rkv_args a)
{
    extern __shared__ float cs_sn[]; /* [hd / 2] cos, then [hd / 2] sin */
    const size_t t = blockIdx.x;
    const int half = a.hd / 2;
    const long long p = a.pos[t];
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const float ang = (float)((double)p * (double)a.inv_freq[i]);
        cs_sn[i] = cosf(ang);
        cs_sn[half + i] = sinf(ang);
    }
    __syncthreads();
    grid_dep_wait(); /* cuda_launch.h: the previous kernel's output is ready (the table did not need it) */
    const int slot = a.slots[t];
    const size_t blk = slot >= 0 ? (size_t)(slot / a.bs) : 0, off = slot >= 0 ? (size_t)(slot % a.bs) : 0;
    const int h0 = blockIdx.y * RKV_HEADS, units = a.nh + 2 * a.nkv;
    const int h1 = min(h0 + RKV_HEADS, units);
    for (int j = threadIdx.x; j < (h1 - h0) * half; j += blockDim.x) {
        const int h = h0 + j / half, i = j % half;
        if (h < a.nh + a.nkv) { /* a q or k head: rotate the pair (i, i + half) */
            const int kh = h - a.nh;
            const float *src = h < a.nh ? a.qs + t * a.ldq + (size_t)h * a.hd : a.ks + t * a.ldk + (size_t)kh * a.hd;
            const float *bias = h < a.nh ? (a.bq ? a.bq + (size_t)h * a.hd : nullptr)
                                         : (a.bk ? a.bk + (size_t)kh * a.hd : nullptr);
            float *dst = h < a.nh ? a.q + (t * a.nh + h) * a.hd : a.k + (t * a.nkv + kh) * a.hd;
            float x0 = src[i], x1 = src[i + half];
            if (bias) {
                x0 += bias[i];
                x1 += bias[i + half];
            }
            float ra, rb;
            rope_pair(x0, x1, cs_sn[i], cs_sn[half + i], &ra, &rb);
            dst[i] = ra;
            dst[i + half] = rb;
            if (h >= a.nh && slot >= 0) {
                bf16 *kd = a.kc + ((blk * a.nkv + kh) * a.bs + off) * a.hd;
                kd[i] = __float2bfloat16(ra);
                kd[i + half] = __float2bfloat16(rb);
            }
        } else { /* a v head: elements i and i + half */
            const int vh = h - a.nh - a.nkv;
            const float *src = a.vs + t * a.ldv + (size_t)vh * a.hd;
            const float *bias = a.bv ? a.bv + (size_t)vh * a.hd : nullptr;
            float x0 = src[i], x1 = src[i + half];
            if (bias) {
                x0 += bias[i];
                x1 += bias[i + half];
            }
            if (a.v) {
                float *dst = a.v + (t * a.nkv + vh) * a.hd;
                dst[i] = x0;
                dst[i + half] = x1;
            }
            if (slot >= 0) {
                bf16 *vd = a.vc + ((blk * a.nkv + vh) * a.bs + off) * a.hd;
                vd[i] = __float2bfloat16(x0);
                vd[i + half] = __float2bfloat16(x1);
            }
        }
    }
}

/* block per row; threads over (kv head, d) */
__global__ void k_kv_write(const float *k, const float *v, const int32_t *slots, int nkv, int hd, int bs, bf16 *kc, bf16 *vc)
{
    grid_dep_wait(); /* cuda_launch.h: the previous kernel's output is ready */
    size_t t = blockIdx.x;
    int slot = slots[t];
    if (slot < 0) return; /* padding rows own no slot */
    size_t blk = (size_t)(slot / bs), off = (size_t)(slot % bs);
    for (int j = threadIdx.x; j < nkv * hd; j += blockDim.x) {
        int h = j / hd, d = j % hd;
        size_t dst = ((blk * nkv + h) * bs + off) * hd + d;
        kc[dst] = __float2bfloat16(k[t * nkv * hd + j]);
        vc[dst] = __float2bfloat16(v[t * nkv * hd + j]);
    }
}

__global__ void k_swiglu(const float *g, const float *u, size_t n, float *out, bf16 *outh)
{
    grid_dep_wait(); /* cuda_launch.h: the previous kernel's output is ready */
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float x = g[i];
        float y = x / (1.0f + expf(-x)) * u[i];
        out[i] = y;
        if (outh) outh[i] = __float2bfloat16(y);
    }
}

/* SwiGLU of bf16 gate and up (matmul_swiglu's cuBLAS path), 8 elements a thread: out (fp32) and
 * outh (the bf16 copy the down projection reads). n8 = elements / 8; g, u, out, outh 16-byte
 * aligned. */
__global__ void k_swiglu_h(const uint4 *g, const uint4 *u, size_t n8, int ff8, int ld8, float4 *out, uint4 *outh)
{
    grid_dep_wait(); /* cuda_launch.h: the previous kernel's output is ready */
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n8; i += (size_t)gridDim.x * blockDim.x) {
        const size_t at = i / (size_t)ff8 * (size_t)ld8 + i % (size_t)ff8; /* row i / ff8 of g and u */
        const uint4 gw = g[at], uw = u[at];
        const uint32_t gv[4] = {gw.x, gw.y, gw.z, gw.w}, uv[4] = {uw.x, uw.y, uw.z, uw.w};
        float y[8];
        uint32_t h[4];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const float2 a = __bfloat1622float2(*(const __nv_bfloat162 *)&gv[j]);
            const float2 c = __bfloat1622float2(*(const __nv_bfloat162 *)&uv[j]);
            y[2 * j] = a.x / (1.0f + expf(-a.x)) * c.x;
            y[2 * j + 1] = a.y / (1.0f + expf(-a.y)) * c.y;
            const __nv_bfloat162 p = __floats2bfloat162_rn(y[2 * j], y[2 * j + 1]);
            h[j] = *(const uint32_t *)&p;
        }
        if (out) { /* NULL: only the bf16 copy is wanted (matmul_swiglu_down) */
            out[2 * i] = make_float4(y[0], y[1], y[2], y[3]);
            out[2 * i + 1] = make_float4(y[4], y[5], y[6], y[7]);
        }
        outh[i] = make_uint4(h[0], h[1], h[2], h[3]);
    }
}

/* matmul_multi over fused weights: the parts of a joint GEMM output src [n][total] (part p: the
 * columns after those of parts < p) into their own buffers y[p] [n][out[p]], + bias[p] where
 * given. One block a row and part; every out[p] is a multiple of 4 (float4 copies). */
struct split_args {
    const float *src;
    int total, n_parts;
    int out[KVS_SKINNY_MAX_PARTS];
    float *y[KVS_SKINNY_MAX_PARTS];
    const float *bias[KVS_SKINNY_MAX_PARTS];
};

__global__ void k_split_cols(struct split_args a)
{
    grid_dep_wait(); /* cuda_launch.h: the GEMM's output is ready */
    const size_t t = blockIdx.x;
    const int p = blockIdx.y;
    int c0 = 0;
    for (int i = 0; i < p; i++) c0 += a.out[i];
    const float4 *src = (const float4 *)(a.src + t * (size_t)a.total + c0);
    const int o4 = a.out[p] / 4;
    float4 *y = (float4 *)(a.y[p] + t * (size_t)a.out[p]);
    const float4 *bias = (const float4 *)a.bias[p];
    for (int i = threadIdx.x; i < o4; i += blockDim.x) {
        float4 v = src[i];
        if (bias) {
            const float4 c = bias[i];
            v.x += c.x;
            v.y += c.y;
            v.z += c.z;
            v.w += c.w;
        }
        y[i] = v;
    }
}

__global__ void k_gather_rows(const float *x, const int32_t *rows, int dim, float *out)
{
    grid_dep_wait(); /* cuda_launch.h: the previous kernel's output is ready */
    size_t i = blockIdx.x;
    const float *src = x + (size_t)rows[i] * dim;
    for (int j = threadIdx.x; j < dim; j += blockDim.x) out[i * dim + j] = src[j];
}

/* Greedy pick per row (backend.h argmax_rows), one block per row: each thread scans its share
 * of the row in increasing index order keeping the first maximum (NaN skipped), then the block
 * reduces the (value, index) pairs with argmax_beats. That order is total over the candidates, so
 * the winner is exact and the same whatever the reduction order (deterministic by construction).
 * Rows whose length is a multiple of 4 are read as float4 (16-byte aligned: cudaMalloc'd rows of
 * 4k floats); each thread's four values are still taken in increasing index order. */
#define ARGMAX_THREADS 512

/* (av, ai) ranks before (bv, bi): a is a candidate (ai >= 0) and b is none, or a is larger, or
 * equal with the lower index */
__device__ __forceinline__ bool argmax_beats(float av, int ai, float bv, int bi)
{
    return ai >= 0 && (bi < 0 || av > bv || (av == bv && ai < bi));
}

/* one element, indices increasing: a later equal value never replaces the first */
__device__ __forceinline__ void argmax_take(float v, int i, float &bv, int &bi)
{
    if (!isnan(v) && (bi < 0 || v > bv)) {
        bv = v;
        bi = i;
    }
}

/* reduces (bv, bi) over the warp; every lane ends with the warp's winner */
__device__ __forceinline__ void argmax_warp(float &bv, int &bi)
{
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (argmax_beats(ov, oi, bv, bi)) {
            bv = ov;
            bi = oi;
        }
    }
}

/* blockDim.x == ARGMAX_THREADS (whole warps); out[row] for row = blockIdx.x */
__global__ void __launch_bounds__(ARGMAX_THREADS) k_argmax_rows(const float *logits, int vocab, int vec4, int32_t *out)
{
    __shared__ float wv[ARGMAX_THREADS / 32];
    __shared__ int wi[ARGMAX_THREADS / 32];
    grid_dep_wait(); /* cuda_launch.h: the previous kernel's output is ready */
    const float *x = logits + (size_t)blockIdx.x * vocab;
    float bv = 0.0f;
    int bi = -1;
    if (vec4) {
        const float4 *x4 = (const float4 *)x;
        for (int j = threadIdx.x; j < vocab / 4; j += blockDim.x) {
            float4 v = x4[j];
            argmax_take(v.x, 4 * j, bv, bi);
            argmax_take(v.y, 4 * j + 1, bv, bi);
            argmax_take(v.z, 4 * j + 2, bv, bi);
            argmax_take(v.w, 4 * j + 3, bv, bi);
        }
    } else {
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) argmax_take(x[i], i, bv, bi);
    }
    argmax_warp(bv, bi);
    int w = threadIdx.x >> 5, l = threadIdx.x & 31;
    if (l == 0) {
        wv[w] = bv;
        wi[w] = bi;
    }
    __syncthreads();
    if (w != 0) return;
    bv = l < ARGMAX_THREADS / 32 ? wv[l] : 0.0f;
    bi = l < ARGMAX_THREADS / 32 ? wi[l] : -1;
    argmax_warp(bv, bi);
    /* nothing above -inf: nothing to pick (the sampler's greedy path fails too) */
    if (l == 0) out[blockIdx.x] = bi >= 0 && bv == -INFINITY ? -1 : bi;
}

/* reads n16 x 16 bytes (nothing is written: the L2 is left holding clean lines of p) */
__global__ void k_l2_flush(const uint4 *p, size_t n16, unsigned *sink)
{
    unsigned acc = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n16; i += (size_t)gridDim.x * blockDim.x) {
        const uint4 v = __ldcg(p + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9e3779b9u) *sink = acc; /* keeps the loads; practically never taken */
}

/* holds the stream for ns nanoseconds (one thread): the GEMM timing queues its runs behind it, so
 * the events time the GPU's back-to-back runs, not the host's launch rate (a k/v projection
 * takes about as long on the GPU as cublasLtMatmul takes to enqueue it) */
__global__ void k_spin(uint64_t ns)
{
    uint64_t t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
}

__global__ void k_add_bias(float *y, const float *bias, size_t n, int out)
{
    grid_dep_wait(); /* cuda_launch.h: the previous kernel's output is ready */
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        y[i] += bias[i % out];
}

/* ---- lifetime ----------------------------------------------------------------------------- */

/* defined with the GEMMs below */
static void gemm_tune_report(struct kvs_backend *b);
static void gemm_pretune(struct kvs_backend *b, const bf16 *w, int64_t rows, int64_t cols, unsigned kinds);
static void gemm_pretune_pending(struct kvs_backend *b);

/* the output kinds a weight's GEMMs run with (bits 1 << enum gemm_out): fp32, and bf16 too for
 * more rows than columns (the gate and up projections in matmul_swiglu) */
static unsigned weight_kinds(int64_t rows, int64_t cols)
{
    return 1u << GEMM_F32 | (rows > cols ? 1u << GEMM_BF16 : 0u);
}

/* 1 when (rows, cols) is among the count shapes of list */
static int shape_listed(const int64_t (*list)[2], int count, int64_t rows, int64_t cols)
{
    for (int i = 0; i < count; i++)
        if (list[i][0] == rows && list[i][1] == cols) return 1;
    return 0;
}

static struct kvs_backend *cu_create(int n_threads, char *err, size_t errlen)
{
    (void)n_threads;
    int ndev = 0;
    cudaError_t e = cudaGetDeviceCount(&ndev);
    if (e != cudaSuccess || ndev == 0) {
        kvs_err(err, errlen, -ENODEV, "no CUDA device (%s)", e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
        return NULL;
    }
    struct kvs_backend *b = (struct kvs_backend *)kvs_xcalloc(1, sizeof *b);
    b->device = 0;
    CUDA_CHECK(cudaSetDevice(b->device));
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, b->device));
    if (prop.major < 9) {
        kvs_err(err, errlen, -ENODEV, "CUDA device %s has compute capability %d.%d; this build targets sm_90",
                prop.name, prop.major, prop.minor);
        free(b);
        return NULL;
    }
    b->n_sms = prop.multiProcessorCount;
    CUDA_CHECK(cudaStreamCreateWithFlags(&b->stream, cudaStreamNonBlocking));
    CUBLAS_CHECK(cublasCreate(&b->blas));
    CUBLAS_CHECK(cublasSetStream(b->blas, b->stream));
    CUDA_CHECK(cudaMalloc(&b->blas_ws, BLAS_WS_BYTES));
    CUBLAS_CHECK(cublasSetWorkspace(b->blas, b->blas_ws, BLAS_WS_BYTES));
    CUBLAS_CHECK(cublasSetMathMode(b->blas, CUBLAS_DEFAULT_MATH));
    /* cuBLASLt shares blas_ws: both run on the one stream, so their uses never overlap */
    CUBLAS_CHECK(cublasLtCreate(&b->lt));
    CUDA_CHECK(cudaMalloc((void **)&b->attn_ws, ATTN_WS_BYTES));
    CUDA_CHECK(cudaEventCreate(&b->ev0));
    CUDA_CHECK(cudaEventCreate(&b->ev1));
    b->tune = (struct gemm_tuning *)kvs_xcalloc(1, sizeof *b->tune);
    for (int i = 0; i < 2 * GEMM_TIMED; i++) CUDA_CHECK(cudaEventCreate(&b->tune->ev[i]));
    b->bounce = kvs_xmalloc(BOUNCE_ELEMS * 6); /* fp32 chunk + bf16 chunk */
    {
        const char *e = getenv("KVS_CUDA_ATTN_SPLITS");
        b->attn_splits = e && atoi(e) > 0 ? atoi(e) : 0;
        b->dec_attn = -1; /* KVS_CUDA_DEC_ATTN is read by cuda_attention.cu itself */
        e = getenv("KVS_CUDA_SKINNY_MAX");
        b->skinny_max = b->skinny_default = e ? atoi(e) : SKINNY_MAX_DEFAULT;
        b->gemm_default = KVS_CUDA_GEMM_TUNED;
        e = getenv("KVS_CUDA_GEMM_TUNE");
        if (e && strcmp(e, "0") == 0) b->gemm_default = KVS_CUDA_GEMM_HEURISTIC;
        e = getenv("KVS_CUDA_GEMM");
        if (e && strcmp(e, "ex") == 0) b->gemm_default = KVS_CUDA_GEMM_EX;
        else if (e && *e && strcmp(e, "lt") != 0)
            kvs_log(KVS_LOG_WARN, "cuda: KVS_CUDA_GEMM=%s is neither \"ex\" nor \"lt\"; using cuBLASLt", e);
        b->gemm_mode = b->gemm_default;
        e = getenv("KVS_CUDA_GEMM_SPLITK");
        b->gemm_splitk = !(e && strcmp(e, "0") == 0);
    }
    kvs_log(KVS_LOG_INFO, "cuda: %s, %d SMs, %.1f GiB, compute %d.%d", prop.name, prop.multiProcessorCount,
            (double)prop.totalGlobalMem / (1u << 30), prop.major, prop.minor);
    return b;
}

/* unlinks and frees one weight: its own memory, or its share of a fused storage (the storage
 * goes with its last weight) */
static void weight_release(struct kvs_backend *b, struct kvs_dweight *w)
{
    list_del(&b->weights, w);
    CUDA_CHECK(cudaFree(w->f));
    if (!w->store) {
        CUDA_CHECK(cudaFree(w->h));
    } else if (--w->store->refs == 0) {
        CUDA_CHECK(cudaFree(w->store->base));
        free(w->store);
    }
    free(w);
}

static void cu_free(struct kvs_backend *b)
{
    if (!b) return;
    CUDA_CHECK(cudaStreamSynchronize(b->stream));
    gemm_tune_report(b);
    while (b->bufs) {
        struct kvs_dbuf *x = b->bufs;
        list_del(&b->bufs, x);
        CUDA_CHECK(cudaFree(x->d));
        free(x);
    }
    while (b->weights) weight_release(b, b->weights);
    CUDA_CHECK(cudaFree(b->fuse_ws));
    CUDA_CHECK(cudaFree(b->xh_buf[0]));
    CUDA_CHECK(cudaFree(b->xh_buf[1]));
    CUDA_CHECK(cudaFree(b->attn_ws));
    CUDA_CHECK(cudaFree(b->blas_ws));
    CUBLAS_CHECK(cublasDestroy(b->blas));
    CUBLAS_CHECK(cublasLtDestroy(b->lt));
    CUDA_CHECK(cudaEventDestroy(b->ev0));
    CUDA_CHECK(cudaEventDestroy(b->ev1));
    for (int i = 0; i < 2 * GEMM_TIMED; i++) CUDA_CHECK(cudaEventDestroy(b->tune->ev[i]));
    free(b->tune);
    CUDA_CHECK(cudaStreamDestroy(b->stream));
    free(b->bounce);
    free(b);
}

static size_t cu_mem_available(struct kvs_backend *b)
{
    (void)b;
    size_t fr = 0, tot = 0;
    CUDA_CHECK(cudaMemGetInfo(&fr, &tot));
    return fr;
}

static size_t cu_elem_size(struct kvs_backend *b, enum kvs_buf_kind kind)
{
    (void)b;
    return kind_size(kind);
}

static void cu_sync(struct kvs_backend *b)
{
    CUDA_CHECK(cudaStreamSynchronize(b->stream));
}

/* ---- memory ------------------------------------------------------------------------------- */

static void *dev_alloc(size_t bytes)
{
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, bytes ? bytes : 16);
    if (e == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError(); /* clear the sticky-free error state of the runtime */
        return NULL;
    }
    CUDA_CHECK(e);
    return p;
}

static struct kvs_dbuf *cu_alloc(struct kvs_backend *b, enum kvs_buf_kind kind, size_t n)
{
    /* the runner allocates its workspaces once the weights are in (and fused): time the GEMM
     * shapes they left, then the pre-tuning is over */
    gemm_pretune_pending(b);
    gemm_tune_report(b);
    /* the matmul's bf16 copy of x is as large as the largest activation buffer */
    if (kind == KVS_BUF_ACT && n > b->xh_cap) {
        bf16 *nx = (bf16 *)dev_alloc(n * sizeof(bf16)), *ny = nx ? (bf16 *)dev_alloc(n * sizeof(bf16)) : NULL;
        if (!ny) {
            if (nx) CUDA_CHECK(cudaFree(nx));
            return NULL;
        }
        CUDA_CHECK(cudaStreamSynchronize(b->stream));
        CUDA_CHECK(cudaFree(b->xh_buf[0]));
        CUDA_CHECK(cudaFree(b->xh_buf[1]));
        b->xh_buf[0] = b->xh = nx;
        b->xh_buf[1] = ny;
        b->xh_cap = n;
        b->xh_src = NULL;
    }
    void *d = dev_alloc(n * kind_size(kind));
    if (!d) return NULL;
    struct kvs_dbuf *buf = (struct kvs_dbuf *)kvs_xcalloc(1, sizeof *buf);
    buf->kind = kind;
    buf->n = n;
    buf->d = d;
    list_add(&b->bufs, buf);
    return buf;
}

static void cu_free_buf(struct kvs_backend *b, struct kvs_dbuf *buf)
{
    if (!buf) return;
    CUDA_CHECK(cudaStreamSynchronize(b->stream));
    list_del(&b->bufs, buf);
    xh_forget(b, buf->d); /* a later allocation may get the same address */
    CUDA_CHECK(cudaFree(buf->d));
    free(buf);
}

static void cu_upload(struct kvs_backend *b, struct kvs_dbuf *dst, size_t off, const void *src, size_t n)
{
    KVS_ASSERT(off + n <= dst->n);
    xh_forget(b, dst->d);
    if (dst->kind != KVS_BUF_KV) {
        /* pageable source: the call returns once src is staged, so the caller may reuse it */
        CUDA_CHECK(cudaMemcpyAsync((char *)dst->d + off * 4, src, n * 4, cudaMemcpyHostToDevice, b->stream));
        return;
    }
    const float *s = (const float *)src;
    bf16 *h = (bf16 *)b->bounce;
    for (size_t i = 0; i < n; i += BOUNCE_ELEMS) {
        size_t c = n - i < BOUNCE_ELEMS ? n - i : BOUNCE_ELEMS;
        CUDA_CHECK(cudaStreamSynchronize(b->stream)); /* the bounce buffer is free again */
        for (size_t j = 0; j < c; j++) h[j] = __float2bfloat16(s[i + j]);
        CUDA_CHECK(cudaMemcpyAsync((bf16 *)dst->d + off + i, h, c * sizeof(bf16), cudaMemcpyHostToDevice, b->stream));
    }
    CUDA_CHECK(cudaStreamSynchronize(b->stream));
}

static void cu_download(struct kvs_backend *b, void *dst, const struct kvs_dbuf *src, size_t off, size_t n)
{
    KVS_ASSERT(off + n <= src->n);
    if (src->kind != KVS_BUF_KV) {
        CUDA_CHECK(cudaMemcpyAsync(dst, (const char *)src->d + off * 4, n * 4, cudaMemcpyDeviceToHost, b->stream));
        CUDA_CHECK(cudaStreamSynchronize(b->stream));
        return;
    }
    float *o = (float *)dst;
    bf16 *h = (bf16 *)b->bounce;
    for (size_t i = 0; i < n; i += BOUNCE_ELEMS) {
        size_t c = n - i < BOUNCE_ELEMS ? n - i : BOUNCE_ELEMS;
        CUDA_CHECK(cudaMemcpyAsync(h, (const bf16 *)src->d + off + i, c * sizeof(bf16), cudaMemcpyDeviceToHost, b->stream));
        CUDA_CHECK(cudaStreamSynchronize(b->stream));
        for (size_t j = 0; j < c; j++) o[i + j] = __bfloat162float(h[j]);
    }
}

static void cu_zero(struct kvs_backend *b, struct kvs_dbuf *buf, size_t off, size_t n)
{
    KVS_ASSERT(off + n <= buf->n);
    size_t es = kind_size(buf->kind);
    xh_forget(b, buf->d);
    CUDA_CHECK(cudaMemsetAsync((char *)buf->d + off * es, 0, n * es, b->stream));
}

/* host conversion of a tensor chunk to bf16 (through fp32 scratch for f16/f32 sources) */
static void to_bf16_host(const struct kvs_tensor_view *t, size_t first, size_t n, float *scratch, bf16 *out)
{
    kvs_tensor_to_f32(t, scratch, first, n);
    for (size_t i = 0; i < n; i++) out[i] = __float2bfloat16(scratch[i]);
}

static struct kvs_dweight *cu_upload_weight(struct kvs_backend *b, const struct kvs_tensor_view *t, char *err,
                                            size_t errlen)
{
    if (t->ndim != 1 && t->ndim != 2) {
        kvs_err(err, errlen, -EINVAL, "cuda: weight with %d dims (want 1 or 2)", t->ndim);
        return NULL;
    }
    if (t->dtype != KVS_DTYPE_BF16 && t->dtype != KVS_DTYPE_F16 && t->dtype != KVS_DTYPE_F32) {
        kvs_err(err, errlen, -EINVAL, "cuda: unsupported weight dtype %d", (int)t->dtype);
        return NULL;
    }
    struct kvs_dweight *w = (struct kvs_dweight *)kvs_xcalloc(1, sizeof *w);
    w->is_vector = t->ndim == 1;
    w->rows = t->ndim == 1 ? 1 : t->shape[0];
    w->cols = t->ndim == 1 ? t->shape[0] : t->shape[1];
    size_t n = (size_t)(w->rows * w->cols);
    if (w->is_vector) {
        w->f = (float *)dev_alloc(n * 4);
        if (!w->f) goto oom;
        float *h = (float *)b->bounce;
        for (size_t i = 0; i < n; i += BOUNCE_ELEMS) {
            size_t c = n - i < BOUNCE_ELEMS ? n - i : BOUNCE_ELEMS;
            CUDA_CHECK(cudaStreamSynchronize(b->stream));
            kvs_tensor_to_f32(t, h, i, c);
            CUDA_CHECK(cudaMemcpyAsync(w->f + i, h, c * 4, cudaMemcpyHostToDevice, b->stream));
        }
    } else {
        w->h = (bf16 *)dev_alloc(n * sizeof(bf16));
        if (!w->h) goto oom;
        if (t->dtype == KVS_DTYPE_BF16) {
            CUDA_CHECK(cudaMemcpyAsync(w->h, t->data, n * 2, cudaMemcpyHostToDevice, b->stream));
        } else {
            float *f = (float *)b->bounce;
            bf16 *h = (bf16 *)(f + BOUNCE_ELEMS);
            for (size_t i = 0; i < n; i += BOUNCE_ELEMS) {
                size_t c = n - i < BOUNCE_ELEMS ? n - i : BOUNCE_ELEMS;
                CUDA_CHECK(cudaStreamSynchronize(b->stream));
                to_bf16_host(t, i, c, f, h);
                CUDA_CHECK(cudaMemcpyAsync(w->h + i, h, c * 2, cudaMemcpyHostToDevice, b->stream));
            }
        }
    }
    CUDA_CHECK(cudaStreamSynchronize(b->stream));
    list_add(&b->weights, w);
    /* decode graphs are captured on first use, where no GEMM can be timed: the shape is timed
     * before anything runs, at the next alloc (the runner fuses q/k/v and gate/up first, and
     * the shapes of weights that all went into fused groups need no timing of their own) */
    if (!w->is_vector && !shape_listed(b->tune->pretuned, b->tune->n_pretuned, w->rows, w->cols) &&
        !shape_listed(b->tune->pending, b->tune->n_pending, w->rows, w->cols) &&
        b->tune->n_pending < GEMM_PRETUNE_SHAPES) {
        b->tune->pending[b->tune->n_pending][0] = w->rows;
        b->tune->pending[b->tune->n_pending][1] = w->cols;
        b->tune->n_pending++;
    }
    return w;
oom:
    kvs_err(err, errlen, -ENOMEM, "cuda: out of device memory for a %lld x %lld weight (%s)", (long long)w->rows,
            (long long)w->cols, t->file ? t->file : "?");
    free(w);
    return NULL;
}

static void cu_free_weight(struct kvs_backend *b, struct kvs_dweight *w)
{
    if (!w) return;
    CUDA_CHECK(cudaStreamSynchronize(b->stream));
    weight_release(b, w);
}

/* ---- ops ---------------------------------------------------------------------------------- */

static void cu_embed(struct kvs_backend *b, const struct kvs_dweight *emb, const struct kvs_dbuf *tokens, int n,
                     int dim, struct kvs_dbuf *out)
{
    if (n <= 0) return;
    KVS_ASSERT(!emb->is_vector && emb->cols == dim);
    xh_forget(b, out->d);
    CUDA_CHECK(kvs_cu_launch(k_embed, n, 256, 0, b->stream, emb->h, (const int32_t *)tokens->d, dim, (float *)out->d));
    LAUNCH_CHECK();
}

static void cu_rmsnorm(struct kvs_backend *b, const struct kvs_dbuf *x, const struct kvs_dweight *w, float eps, int n,
                       int dim, struct kvs_dbuf *out)
{
    if (n <= 0) return;
    KVS_ASSERT(w->is_vector && w->cols == dim);
    bf16 *outh = xh_claim(b, out->d, (size_t)n * dim);
    /* the vectorised kernel reads x through its first (res) argument without writing it (no ADD) */
    if (!launch_rmsnorm_vec(b->stream, n, (float *)x->d, NULL, w->f, eps, dim, (float *)out->d, outh))
        CUDA_CHECK(kvs_cu_launch(k_rmsnorm, n, NORM_THREADS, 0, b->stream, (const float *)x->d, w->f, eps, dim, (float *)out->d, outh));
    LAUNCH_CHECK();
}

static void cu_add_rmsnorm(struct kvs_backend *b, struct kvs_dbuf *res, const struct kvs_dbuf *delta,
                           const struct kvs_dweight *w, float eps, int n, int dim, struct kvs_dbuf *out)
{
    if (n <= 0) return;
    KVS_ASSERT(w->is_vector && w->cols == dim);
    xh_forget(b, res->d);
    bf16 *outh = xh_claim(b, out->d, (size_t)n * dim);
    if (!launch_rmsnorm_vec(b->stream, n, (float *)res->d, (const float *)delta->d, w->f, eps, dim, (float *)out->d, outh))
        CUDA_CHECK(kvs_cu_launch(k_add_rmsnorm, n, NORM_THREADS, 0, b->stream, (float *)res->d, (const float *)delta->d, w->f,
                                 eps, dim, (float *)out->d, outh));
    LAUNCH_CHECK();
}

static void cu_head_rmsnorm(struct kvs_backend *b, struct kvs_dbuf *x, const struct kvs_dweight *w, float eps, int n,
                            int n_heads, int head_dim)
{
    if (n <= 0) return;
    KVS_ASSERT(w->is_vector && w->cols == head_dim);
    size_t rh = (size_t)n * n_heads;
    xh_forget(b, x->d);
    CUDA_CHECK(kvs_cu_launch(k_head_rmsnorm, (unsigned)((rh + 7) / 8), 256, 0, b->stream, (float *)x->d, w->f, eps, rh, head_dim));
    LAUNCH_CHECK();
}

/* The bf16 copy of x [n][in] that a GEMM reads: the mirror when it is x's, else converted now. */
static const bf16 *gemm_input(struct kvs_backend *b, const struct kvs_dbuf *x, size_t nx)
{
    if (b->xh_src != x->d || b->xh_n != nx) {
        bf16 *h = xh_claim(b, x->d, nx);
        KVS_ASSERT(h);
        CUDA_CHECK(kvs_cu_launch(k_f32_to_bf16, grid_for(nx, 256), 256, 0, b->stream, (const float *)x->d, h, nx));
        LAUNCH_CHECK();
    }
    return b->xh;
}

/* ---- cuBLAS / cuBLASLt GEMMs ---------------------------------------------------------------- */

/* The former path (KVS_CUDA_GEMM=ex), kept for A/B comparisons: y = xh W^T (+ y). Column-major
 * view: y^T[out][n] = W[out][in] (stored column-major as in x out, so op T) * x^T[in][n]. */
static void gemm_ex(struct kvs_backend *b, const bf16 *xh, const bf16 *w, int n, int in, int out, void *y,
                    enum gemm_out kind)
{
    const float one = 1.0f, beta = kind == GEMM_F32_ACC ? 1.0f : 0.0f;
    CUBLAS_CHECK(cublasGemmEx(b->blas, CUBLAS_OP_T, CUBLAS_OP_N, out, n, in, &one, w, CUDA_R_16BF, in, xh,
                              CUDA_R_16BF, in, &beta, y, kind == GEMM_BF16 ? CUDA_R_16BF : CUDA_R_32F, out,
                              CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

/* The cuBLASLt description of the same product (the column-major view of gemm_ex): A = W with op
 * T, B = x, C = D = y (fp32, or bf16 for GEMM_BF16), fp32 accumulation and scale. Initialised in
 * place (no allocation), so it can be rebuilt on every call. */
struct gemm_lt_desc {
    cublasLtMatmulDescOpaque_t op;
    cublasLtMatrixLayoutOpaque_t a, b, c;
};

static void gemm_lt_describe(struct gemm_lt_desc *d, int n, int in, int out, enum gemm_out kind)
{
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    CUBLAS_CHECK(cublasLtMatmulDescInit(&d->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(&d->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(&d->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    CUBLAS_CHECK(cublasLtMatrixLayoutInit(&d->a, CUDA_R_16BF, (uint64_t)in, (uint64_t)out, in));
    CUBLAS_CHECK(cublasLtMatrixLayoutInit(&d->b, CUDA_R_16BF, (uint64_t)in, (uint64_t)n, in));
    CUBLAS_CHECK(cublasLtMatrixLayoutInit(&d->c, kind == GEMM_BF16 ? CUDA_R_16BF : CUDA_R_32F, (uint64_t)out,
                                          (uint64_t)n, out));
}

/* the largest power of two up to 256 dividing every pointer: cuBLASLt's heuristic assumes
 * 256-byte aligned operands unless told otherwise, and a pick is only valid for the alignment it
 * was chosen for (so the alignment is part of a pick's key) */
static int gemm_align(const void *p0, const void *p1, const void *p2)
{
    uintptr_t bits = (uintptr_t)p0 | (uintptr_t)p1 | (uintptr_t)p2;
    int align = 256;
    while (align > 1 && bits % (uintptr_t)align) align /= 2;
    return align;
}

/* Up to max heuristic candidates for d (best estimate first) that fit the fixed workspace;
 * returns how many (0: cuBLASLt has no algorithm for this shape and alignment). */
static int gemm_lt_candidates(struct kvs_backend *b, struct gemm_lt_desc *d, int align,
                              cublasLtMatmulHeuristicResult_t *res, int max)
{
    cublasLtMatmulPreferenceOpaque_t pref;
    const uint64_t ws = BLAS_WS_BYTES;
    const uint32_t al = (uint32_t)align;
    CUBLAS_CHECK(cublasLtMatmulPreferenceInit(&pref));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(&pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(&pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al, sizeof al));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(&pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al, sizeof al));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(&pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al, sizeof al));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(&pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al, sizeof al));
    int count = 0;
    cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(b->lt, &d->op, &d->a, &d->b, &d->c, &d->c, &pref, max, res, &count);
    if (s == CUBLAS_STATUS_NOT_SUPPORTED) return 0; /* no algorithm at all: the caller falls back */
    CUBLAS_CHECK(s);
    /* keep the usable ones, in order */
    int k = 0;
    for (int i = 0; i < count; i++)
        if (res[i].state == CUBLAS_STATUS_SUCCESS && res[i].workspaceSize <= BLAS_WS_BYTES) res[k++] = res[i];
    return k;
}

/* Split-K variants of the first GEMM_SPLITK_BASES candidates in res[0..count) that run unsplit
 * and support it, appended to res up to max; returns the new count. At 16-256 rows a projection
 * with few output columns covers few tiles (k/v of the 8B models: 1024 columns, 8-16 tiles of an
 * H100's 132 SMs), so one weight read is spread over few SMs; splitting the inner dimension
 * gives each SM a share (PyTorch's cuBLAS runs the k/v GEMM at 128 rows in 7 us with split-K,
 * our unsplit pick took 11). The heuristic rarely proposes splits itself, so they are timed as
 * extra candidates. fp32 outputs are reduced in place (the parts added in a fixed order:
 * deterministic, no extra pass) or through an fp32 workspace; bf16 outputs only through the
 * fp32 workspace, so the sum is rounded once. */
static int gemm_splitk_variants(struct kvs_backend *b, struct gemm_lt_desc *d, enum gemm_out kind,
                                cublasLtMatmulHeuristicResult_t *res, int count, int max)
{
    static const uint32_t splits[] = {2, 4, 8, 16};
    const uint32_t schemes[2] = {CUBLASLT_REDUCTION_SCHEME_INPLACE, CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE};
    const int base = count;
    int bases = 0;
    for (int i = 0; i < base && bases < GEMM_SPLITK_BASES; i++) {
        size_t sz = 0;
        int32_t support = 0;
        uint32_t cur = 1, mask = 0;
        if (cublasLtMatmulAlgoCapGetAttribute(&res[i].algo, CUBLASLT_ALGO_CAP_SPLITK_SUPPORT, &support, sizeof support,
                                              &sz) != CUBLAS_STATUS_SUCCESS || !support)
            continue;
        if (cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &cur, sizeof cur,
                                                 &sz) != CUBLAS_STATUS_SUCCESS || cur > 1)
            continue;
        if (cublasLtMatmulAlgoCapGetAttribute(&res[i].algo, CUBLASLT_ALGO_CAP_REDUCTION_SCHEME_MASK, &mask,
                                              sizeof mask, &sz) != CUBLAS_STATUS_SUCCESS)
            continue;
        bases++;
        for (int si = 0; si < 2; si++) {
            const uint32_t scheme = schemes[si];
            if (!(mask & scheme) || (scheme == CUBLASLT_REDUCTION_SCHEME_INPLACE && kind == GEMM_BF16)) continue;
            for (size_t k = 0; k < sizeof splits / sizeof splits[0]; k++) {
                if (count == max) return count;
                cublasLtMatmulHeuristicResult_t v = res[i];
                if (cublasLtMatmulAlgoConfigSetAttribute(&v.algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splits[k],
                                                         sizeof splits[k]) != CUBLAS_STATUS_SUCCESS ||
                    cublasLtMatmulAlgoConfigSetAttribute(&v.algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &scheme,
                                                         sizeof scheme) != CUBLAS_STATUS_SUCCESS)
                    continue;
                /* the check fills in the workspace the variant needs (and leaves v.algo alone) */
                if (cublasLtMatmulAlgoCheck(b->lt, &d->op, &d->a, &d->b, &d->c, &d->c, &v.algo, &v) !=
                        CUBLAS_STATUS_SUCCESS ||
                    v.workspaceSize > BLAS_WS_BYTES)
                    continue;
                v.state = CUBLAS_STATUS_SUCCESS;
                res[count++] = v;
            }
        }
    }
    return count;
}

/* the split count of an algorithm (1: unsplit), for the log */
static unsigned gemm_algo_splits(const cublasLtMatmulAlgo_t *algo)
{
    uint32_t k = 1;
    size_t sz = 0;
    if (cublasLtMatmulAlgoConfigGetAttribute(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &k, sizeof k, &sz) !=
        CUBLAS_STATUS_SUCCESS)
        return 1;
    return k ? k : 1;
}

/* one cuBLASLt GEMM: y = xh W^T (+ y for GEMM_F32_ACC); returns cuBLASLt's status */
static cublasStatus_t gemm_lt_run(struct kvs_backend *b, struct gemm_lt_desc *d, const cublasLtMatmulAlgo_t *algo,
                                  const bf16 *xh, const bf16 *w, void *y, enum gemm_out kind)
{
    const float one = 1.0f, beta = kind == GEMM_F32_ACC ? 1.0f : 0.0f;
    return cublasLtMatmul(b->lt, &d->op, &one, w, &d->a, xh, &d->b, &beta, y, &d->c, y, &d->c, algo, b->blas_ws,
                          BLAS_WS_BYTES, b->stream);
}

static int gemm_capturing(struct kvs_backend *b)
{
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    CUDA_CHECK(cudaStreamIsCapturing(b->stream, &cs));
    return cs != cudaStreamCaptureStatusNone;
}

static unsigned gemm_hash(int n, int in, int out, int kind, int align)
{
    uint64_t h = (uint64_t)(uint32_t)n * 0x9E3779B97F4A7C15ull;
    h ^= ((uint64_t)(uint32_t)in << 32 | (uint32_t)out) * 0xBF58476D1CE4E5B9ull;
    h ^= (uint64_t)(kind * 512 + align) * 0x94D049BB133111EBull;
    h ^= h >> 29;
    return (unsigned)(h % GEMM_PLAN_SLOTS);
}

/* The slot of the pick for this key: the one holding it (n != 0), else the free slot where it
 * would go (n == 0); NULL when it is not there and the table is full. */
static struct gemm_plan *gemm_plan_slot(struct kvs_backend *b, int n, int in, int out, int kind, int align)
{
    struct gemm_tuning *t = b->tune;
    for (unsigned i = gemm_hash(n, in, out, kind, align);; i = (i + 1) % GEMM_PLAN_SLOTS) {
        struct gemm_plan *p = &t->plans[i];
        if (p->n == 0) break;
        if (p->n == n && p->in == in && p->out == out && p->kind == kind && p->align == align) return p;
    }
    if (t->n_plans >= GEMM_PLAN_MAX) {
        if (!t->full_warned)
            kvs_log(KVS_LOG_WARN, "cuda: %d GEMM shapes timed; further ones take cuBLASLt's first pick", t->n_plans);
        t->full_warned = 1;
        return NULL;
    }
    unsigned i = gemm_hash(n, in, out, kind, align);
    while (t->plans[i].n != 0) i = (i + 1) % GEMM_PLAN_SLOTS;
    return &t->plans[i];
}

/* Times the candidates of d on the given operands, writing y (which the caller may overwrite:
 * its own output, or a scratch), and stores the pick in the free slot p under the key. Keeps the
 * heuristic's first pick unless another takes at most GEMM_MIN_GAIN of its time; a candidate's
 * time is its median run. Each timed run starts with the weight out of the L2 (a read of twice
 * the L2's size before it), as in a decode step, which streams every weight from memory once:
 * timed back to back, a weight that fits the L2 (k/v projections, 8 MB in the 8B models) would be
 * read from there, and the pick would suit a GEMM that never happens (without device memory for
 * the flush, the runs follow each other). Synchronises the stream: never while it is being
 * captured. Returns 0, or -ENOENT when cuBLASLt has no algorithm for the shape (p stays free). */
static int gemm_tune(struct kvs_backend *b, struct gemm_lt_desc *d, struct gemm_plan *p, int n, int in, int out,
                     enum gemm_out kind, int align, const bf16 *xh, const bf16 *w, void *y)
{
    cublasLtMatmulHeuristicResult_t res[GEMM_CANDIDATES];
    int count = gemm_lt_candidates(b, d, align, res, GEMM_HEURISTIC);
    if (count == 0) return -ENOENT;
    const int heuristic = count;
    if (b->gemm_splitk) count = gemm_splitk_variants(b, d, kind, res, count, GEMM_CANDIDATES);
    int l2 = 0;
    CUDA_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, b->device));
    const size_t flush_bytes = (size_t)2 * (size_t)l2 / 16 * 16;
    uint4 *flush = flush_bytes ? (uint4 *)dev_alloc(flush_bytes + 16) : NULL;
    if (flush) CUDA_CHECK(cudaMemsetAsync(flush, 0, flush_bytes + 16, b->stream));
    cudaEvent_t *ev = b->tune->ev;
    float ms[GEMM_CANDIDATES] = {0};
    int best = -1;
    for (int i = 0; i < count; i++) {
        ms[i] = -1.0f; /* a candidate the launch rejects (heuristics may list some) is skipped */
        cublasStatus_t s = CUBLAS_STATUS_SUCCESS;
        for (int r = 0; r < GEMM_WARMUP && s == CUBLAS_STATUS_SUCCESS; r++)
            s = gemm_lt_run(b, d, &res[i].algo, xh, w, y, kind);
        k_spin<<<1, 1, 0, b->stream>>>(GEMM_SPIN_NS);
        LAUNCH_CHECK();
        int runs = 0;
        for (int r = 0; r < GEMM_TIMED && s == CUBLAS_STATUS_SUCCESS; r++) {
            if (flush) {
                k_l2_flush<<<b->n_sms * 4, 512, 0, b->stream>>>(flush, flush_bytes / 16, (unsigned *)(flush + flush_bytes / 16));
                LAUNCH_CHECK();
            }
            CUDA_CHECK(cudaEventRecord(ev[2 * r], b->stream));
            s = gemm_lt_run(b, d, &res[i].algo, xh, w, y, kind);
            CUDA_CHECK(cudaEventRecord(ev[2 * r + 1], b->stream));
            runs++;
        }
        if (runs > 0) CUDA_CHECK(cudaEventSynchronize(ev[2 * runs - 1]));
        if (s != CUBLAS_STATUS_SUCCESS) {
            kvs_log(KVS_LOG_DEBUG, "cuda: GEMM %d x %d x %d: candidate %d failed (%s), skipped", n, in, out, i,
                    cublasGetStatusString(s));
            continue;
        }
        /* the median run: a run now and then takes 2-3x as long (H100), which would decide a mean */
        float e[GEMM_TIMED];
        for (int r = 0; r < runs; r++) CUDA_CHECK(cudaEventElapsedTime(&e[r], ev[2 * r], ev[2 * r + 1]));
        for (int r = 1; r < runs; r++)
            for (int q = r; q > 0 && e[q] < e[q - 1]; q--) {
                const float tmp = e[q];
                e[q] = e[q - 1];
                e[q - 1] = tmp;
            }
        ms[i] = e[runs / 2];
        if (best < 0 || ms[i] < ms[best]) best = i;
    }
    if (flush) {
        CUDA_CHECK(cudaStreamSynchronize(b->stream));
        CUDA_CHECK(cudaFree(flush));
    }
    /* the first pick stays unless another is clearly faster (timing noise is about 1%) */
    int pick = 0;
    if (best > 0 && (ms[0] < 0.0f || ms[best] <= GEMM_MIN_GAIN * ms[0])) pick = best;
    p->n = n;
    p->in = in;
    p->out = out;
    p->kind = kind;
    p->align = align;
    p->differs = pick != 0;
    p->algo = res[pick].algo;
    b->tune->n_plans++;
    kvs_log(KVS_LOG_DEBUG, "cuda: GEMM %d x %d x %d%s: %d candidates (%d split-K), first %.1f us, pick #%d %.1f us (split %u)",
            n, in, out, kind == GEMM_F32_ACC ? " (accumulate)" : kind == GEMM_BF16 ? " (bf16 out)" : "", count,
            count - heuristic, ms[0] * 1e3f, pick, ms[pick] * 1e3f, gemm_algo_splits(&res[pick].algo));
    return 0;
}

static int gemm_is_bucket(int n)
{
    for (int i = 0; i < KVS_N_GRAPH_BUCKETS; i++)
        if (kvs_graph_buckets[i] == n) return 1;
    return 0;
}

/* Fills the free slot p (key n, in, out, kind, align) with the timed pick of the next larger
 * graph row count of the same shape, when there is one and cuBLASLt accepts it for n rows, else
 * with the heuristic's first pick; returns 1, or 0 when cuBLASLt has no algorithm at all. */
static int gemm_borrow(struct kvs_backend *b, struct gemm_lt_desc *d, struct gemm_plan *p, int n, int in, int out,
                       enum gemm_out kind, int align)
{
    const struct gemm_plan *from = NULL;
    for (int i = 0; i < KVS_N_GRAPH_BUCKETS && !from; i++) {
        const int nb = kvs_graph_buckets[i];
        if (nb <= n || nb > GEMM_TUNE_MAX_N) continue;
        const struct gemm_plan *q = gemm_plan_slot(b, nb, in, out, kind, align);
        if (q && q->n) from = q;
    }
    cublasLtMatmulHeuristicResult_t r;
    if (from && cublasLtMatmulAlgoCheck(b->lt, &d->op, &d->a, &d->b, &d->c, &d->c, &from->algo, &r) ==
                    CUBLAS_STATUS_SUCCESS &&
        r.workspaceSize <= BLAS_WS_BYTES) {
        p->algo = from->algo;
        p->differs = from->differs;
    } else if (gemm_lt_candidates(b, d, align, &r, 1) == 1) {
        p->algo = r.algo;
        p->differs = 0;
    } else {
        return 0;
    }
    p->n = n;
    p->in = in;
    p->out = out;
    p->kind = kind;
    p->align = align;
    b->tune->n_plans++;
    return 1;
}

/* y = xh W^T (+ y) through cuBLASLt with the timed pick for the shape (timing it now when it is
 * new, its row count is a decode graph's, and the stream is not being captured; other row counts
 * borrow the next larger one's pick: gemm_borrow), or the heuristic's first pick */
static void gemm_lt(struct kvs_backend *b, const bf16 *xh, const bf16 *w, int n, int in, int out, void *y,
                    enum gemm_out kind)
{
    struct gemm_lt_desc d;
    gemm_lt_describe(&d, n, in, out, kind);
    const int align = gemm_align(xh, w, y);
    const cublasLtMatmulAlgo_t *algo = NULL;
    if (b->gemm_mode == KVS_CUDA_GEMM_TUNED && n <= GEMM_TUNE_MAX_N) {
        struct gemm_plan *p = gemm_plan_slot(b, n, in, out, kind, align);
        if (p && p->n) {
            algo = &p->algo;
        } else if (p && !gemm_is_bucket(n)) {
            /* a row count no decode graph has (mixed steps: a few decodes and a short prompt):
             * never timed, so such a step does not stall */
            if (gemm_borrow(b, &d, p, n, in, out, kind, align)) algo = &p->algo;
        } else if (p && !gemm_capturing(b)) {
            /* the timing overwrites its output: y itself, unless y must be added to */
            const int acc = kind == GEMM_F32_ACC;
            void *yt = acc ? dev_alloc((size_t)n * out * sizeof(float)) : y;
            if (yt) {
                if (acc) CUDA_CHECK(cudaMemsetAsync(yt, 0, (size_t)n * out * sizeof(float), b->stream));
                if (gemm_tune(b, &d, p, n, in, out, kind, align, xh, w, yt) == 0) algo = &p->algo;
                if (acc) {
                    CUDA_CHECK(cudaStreamSynchronize(b->stream));
                    CUDA_CHECK(cudaFree(yt));
                }
            }
        }
        /* while capturing, nothing can be timed: the first pick, not kept, so a later call
         * outside a capture times the shape */
    }
    cublasLtMatmulHeuristicResult_t first;
    if (!algo) {
        if (gemm_lt_candidates(b, &d, align, &first, 1) == 0) {
            /* no cuBLASLt algorithm for this shape and alignment: cublasGemmEx has its own fallbacks */
            gemm_ex(b, xh, w, n, in, out, y, kind);
            return;
        }
        algo = &first.algo;
    }
    CUBLAS_CHECK(gemm_lt_run(b, &d, algo, xh, w, y, kind));
}

/* y = xh W^T (+ y for GEMM_F32_ACC) (+ bias: fp32 outputs only) through cuBLAS(Lt) */
/* y = xh W^T (+ y for GEMM_F32_ACC) on the backend's cuBLAS path (gemm_mode), W [out][in] bf16 */
static void gemm_run(struct kvs_backend *b, const bf16 *xh, const bf16 *w, int n, int in, int out, void *y,
                     enum gemm_out kind)
{
    if (b->gemm_mode == KVS_CUDA_GEMM_EX) gemm_ex(b, xh, w, n, in, out, y, kind);
    else gemm_lt(b, xh, w, n, in, out, y, kind);
}

static void gemm_blas(struct kvs_backend *b, const bf16 *xh, const struct kvs_dweight *w,
                      const struct kvs_dweight *bias, int n, int in, int out, void *y, enum gemm_out kind)
{
    gemm_run(b, xh, w->h, n, in, out, y, kind);
    if (bias) {
        KVS_ASSERT(bias->is_vector && bias->cols == out && kind != GEMM_BF16);
        size_t ny = (size_t)n * out;
        CUDA_CHECK(kvs_cu_launch(k_add_bias, grid_for(ny, 256), 256, 0, b->stream, (float *)y, (const float *)bias->f, ny, out));
        LAUNCH_CHECK();
    }
}

/* Times the picks of a new weight shape at the decode graphs' row counts (kvs_graph_buckets) up to
 * GEMM_TUNE_MAX_N on the weight itself and a random x (the
 * real x is not known yet), outside any graph. Row counts the decode GEMM takes at the default
 * skinny_max are skipped, and so are those whose scratch would pass GEMM_PRETUNE_SCRATCH (the LM
 * head of a large vocabulary). kinds: a bit (1 << enum gemm_out) per output kind to time: fp32
 * for every weight, bf16 too for weights with more rows than columns (the [ff][dim] gate and up
 * projections, which matmul_swiglu runs with bf16 outputs; also some models' q projection).
 * w [rows][cols] bf16. Load time: allocates, synchronises. */
static void gemm_pretune(struct kvs_backend *b, const bf16 *w, int64_t rows, int64_t cols, unsigned kinds)
{
    struct gemm_tuning *t = b->tune;
    if (b->gemm_mode != KVS_CUDA_GEMM_TUNED || gemm_capturing(b)) return;
    if (shape_listed(t->pretuned, t->n_pretuned, rows, cols)) return;
    if (t->n_pretuned == GEMM_PRETUNE_SHAPES || rows > INT_MAX || cols > INT_MAX) return;
    t->pretuned[t->n_pretuned][0] = rows;
    t->pretuned[t->n_pretuned][1] = cols;
    t->n_pretuned++;
    const int in = (int)cols, out = (int)rows;
    const size_t row_bytes = (size_t)in * sizeof(bf16) + (size_t)out * sizeof(float);
    int max_n = 0;
    for (int i = 0; i < KVS_N_GRAPH_BUCKETS; i++) {
        const int n = kvs_graph_buckets[i];
        if (n <= GEMM_TUNE_MAX_N && (size_t)n * row_bytes <= GEMM_PRETUNE_SCRATCH) max_n = n;
    }
    if (max_n <= b->skinny_default) return;
    double t0 = kvs_now();
    bf16 *x = (bf16 *)dev_alloc((size_t)max_n * in * sizeof(bf16));
    float *y = x ? (float *)dev_alloc((size_t)max_n * out * sizeof(float)) : NULL;
    if (!y) {
        kvs_log(KVS_LOG_WARN, "cuda: no device memory to time the GEMMs of a %d x %d weight; they take cuBLASLt's "
                              "first pick", out, in);
        if (x) CUDA_CHECK(cudaFree(x));
        return;
    }
    /* non-zero values: some kernels may take shortcuts on zeros */
    k_bf16_fill_random<<<grid_for((size_t)max_n * in, 256), 256, 0, b->stream>>>(x, (size_t)max_n * in, 1.0f, 12345);
    LAUNCH_CHECK();
    int tuned = 0;
    static const enum gemm_out order[2] = {GEMM_F32, GEMM_BF16};
    for (int ki = 0; ki < 2; ki++) {
        const enum gemm_out kind = order[ki];
        if (!(kinds & (1u << kind))) continue;
        for (int i = 0; i < KVS_N_GRAPH_BUCKETS; i++) {
            const int n = kvs_graph_buckets[i];
            if (n <= b->skinny_default || n > max_n) continue;
            const int align = gemm_align(x, w, y);
            struct gemm_plan *p = gemm_plan_slot(b, n, in, out, kind, align);
            if (!p || p->n) continue;
            struct gemm_lt_desc d;
            gemm_lt_describe(&d, n, in, out, kind);
            if (gemm_tune(b, &d, p, n, in, out, kind, align, x, w, y) != 0) continue;
            tuned++;
            t->log_differ += p->differs;
        }
    }
    CUDA_CHECK(cudaStreamSynchronize(b->stream));
    CUDA_CHECK(cudaFree(x));
    CUDA_CHECK(cudaFree(y));
    t->log_mats++;
    t->log_gemms += tuned;
    t->log_s += kvs_now() - t0;
}

/* gemm_pretune for each shape uploaded since the last alloc that some live unfused weight still
 * has (timed on that weight) */
static void gemm_pretune_pending(struct kvs_backend *b)
{
    struct gemm_tuning *t = b->tune;
    for (int i = 0; i < t->n_pending; i++) {
        const int64_t rows = t->pending[i][0], cols = t->pending[i][1];
        for (const struct kvs_dweight *w = b->weights; w; w = w->next)
            if (!w->is_vector && !w->store && w->rows == rows && w->cols == cols) {
                gemm_pretune(b, w->h, rows, cols, weight_kinds(rows, cols));
                break;
            }
    }
    t->n_pending = 0;
}

/* one line for the pre-tuning of a model load: called when something other than weight uploads
 * follows them (the runner's workspace allocation), and at free */
static void gemm_tune_report(struct kvs_backend *b)
{
    struct gemm_tuning *t = b->tune;
    if (t->log_mats == 0) return;
    kvs_log(KVS_LOG_INFO, "cuda: timed the cuBLASLt algorithms of %d GEMM shapes (%d weight shapes, the decode "
                          "graphs' row counts up to %d) in %.2f s; %d picks differ from the heuristic's first",
            t->log_gemms, t->log_mats, GEMM_TUNE_MAX_N, t->log_s, t->log_differ);
    t->log_mats = t->log_gemms = t->log_differ = 0;
    t->log_s = 0.0;
}

/* 1 when w[0..n) lie back to back, in order, in one storage of fuse_weights */
static int weights_adjacent(const struct kvs_dweight *const *w, int n)
{
    if (n < 2 || !w[0]->store) return 0;
    for (int p = 1; p < n; p++)
        if (w[p]->store != w[0]->store || w[p]->h != w[p - 1]->h + (size_t)(w[p - 1]->rows * w[p - 1]->cols))
            return 0;
    return 1;
}

/* backend.h. The joint copy is made before the parts' own memory is freed (a load-time peak of
 * one group's size). The joint shape is timed as the ops will run it: fp32 output when
 * matmul_multi's scratch can hold GEMM_TUNE_MAX_N rows of it (q/k/v), bf16 when it has more
 * rows than columns (gate/up in matmul_swiglu). */
static int cu_fuse_weights(struct kvs_backend *b, struct kvs_dweight *const *w, int n)
{
    if (n < 2 || n > KVS_SKINNY_MAX_PARTS || gemm_capturing(b)) return -EINVAL;
    int64_t rows = 0;
    for (int p = 0; p < n; p++) {
        if (!w[p] || w[p]->is_vector || w[p]->store || w[p]->cols != w[0]->cols) return -EINVAL;
        for (int q = 0; q < p; q++)
            if (w[q] == w[p]) return -EINVAL;
        rows += w[p]->rows;
    }
    const int64_t cols = w[0]->cols;
    if (rows > INT_MAX || cols > INT_MAX) return -EINVAL;
    /* the scratch is allocated once, at its full size: a recorded graph may hold its address */
    const int for_multi = (size_t)GEMM_TUNE_MAX_N * (size_t)rows * sizeof(float) <= FUSE_WS_MAX;
    if (for_multi && !b->fuse_ws) {
        b->fuse_ws = (float *)dev_alloc(FUSE_WS_MAX);
        if (!b->fuse_ws) return -ENOMEM;
        b->fuse_cap = FUSE_WS_MAX / sizeof(float);
    }
    bf16 *base = (bf16 *)dev_alloc((size_t)rows * (size_t)cols * sizeof(bf16));
    if (!base) return -ENOMEM;
    struct wstore *st = (struct wstore *)kvs_xcalloc(1, sizeof *st);
    st->base = base;
    st->refs = n;
    CUDA_CHECK(cudaStreamSynchronize(b->stream)); /* the parts are not in use */
    bf16 *at = base;
    for (int p = 0; p < n; p++) {
        const size_t elems = (size_t)(w[p]->rows * cols);
        CUDA_CHECK(cudaMemcpyAsync(at, w[p]->h, elems * sizeof(bf16), cudaMemcpyDeviceToDevice, b->stream));
        CUDA_CHECK(cudaStreamSynchronize(b->stream));
        CUDA_CHECK(cudaFree(w[p]->h));
        w[p]->h = at;
        w[p]->store = st;
        at += elems;
    }
    gemm_pretune(b, base, rows, cols, (for_multi ? 1u << GEMM_F32 : 0u) | (rows > cols ? 1u << GEMM_BF16 : 0u));
    return 0;
}

/* Decode-sized batches (n <= skinny_max) go to the decode GEMM, which covers every part in one
 * launch; larger ones to cuBLAS, one call per part. Either way each part's result is what
 * matmul() alone gives. */
/* matmul_multi's set-up, shared with matmul_rope_kv_write: checks the shapes, forgets the
 * outputs' mirrors and returns the bf16 x that the GEMMs read */
static const bf16 *multi_begin(struct kvs_backend *b, const struct kvs_dbuf *x, int n_parts,
                               const struct kvs_dweight *const *w, const struct kvs_dweight *const *bias, int n,
                               int in, const int *out, struct kvs_dbuf *const *y)
{
    KVS_ASSERT(n_parts >= 1 && n_parts <= KVS_SKINNY_MAX_PARTS);
    KVS_ASSERT((size_t)n * in <= b->xh_cap);
    const bf16 *xh = gemm_input(b, x, (size_t)n * in);
    for (int p = 0; p < n_parts; p++) {
        KVS_ASSERT(!w[p]->is_vector && w[p]->rows == out[p] && w[p]->cols == in);
        if (bias && bias[p]) KVS_ASSERT(bias[p]->is_vector && bias[p]->cols == out[p]);
        xh_forget(b, y[p]->d);
    }
    return xh;
}

/* 1 when the decode GEMM takes these parts (decode-sized batches) */
static int multi_skinny(struct kvs_backend *b, int n_parts, int n, int in, const int *out)
{
    return n <= b->skinny_max && kvs_cu_skinny_supported(n, in, out, n_parts, 0);
}

/* 1 when parts laid out back to back (fuse_weights) run as one GEMM into the fuse_ws scratch,
 * [n][*total], every part's columns a multiple of 4: decode-sized batches only (the scratch holds
 * GEMM_TUNE_MAX_N rows); larger ones are compute bound, where separate GEMMs lose nothing */
static int multi_joint(struct kvs_backend *b, const struct kvs_dweight *const *w, int n_parts, int n,
                       const int *out, int *total)
{
    int quads = 1;
    *total = 0;
    for (int p = 0; p < n_parts; p++) {
        *total += out[p];
        quads &= out[p] % 4 == 0;
    }
    return n_parts > 1 && quads && weights_adjacent(w, n_parts) && (size_t)n * *total <= b->fuse_cap;
}

static void cu_matmul_multi(struct kvs_backend *b, const struct kvs_dbuf *x, int n_parts,
                            const struct kvs_dweight *const *w, const struct kvs_dweight *const *bias, int n, int in,
                            const int *out, struct kvs_dbuf *const *y)
{
    if (n <= 0) return;
    const bf16 *xh = multi_begin(b, x, n_parts, w, bias, n, in, out, y);
    int total = 0;
    if (multi_skinny(b, n_parts, n, in, out)) {
        struct kvs_cu_skinny a = {};
        a.x = xh;
        a.n = n;
        a.in = in;
        a.n_parts = n_parts;
        for (int p = 0; p < n_parts; p++) {
            a.w[p] = w[p]->h;
            a.bias[p] = bias && bias[p] ? bias[p]->f : NULL;
            a.out[p] = out[p];
            a.y[p] = (float *)y[p]->d;
        }
        CUDA_CHECK(kvs_cu_skinny(&a, b->stream));
    } else if (multi_joint(b, w, n_parts, n, out, &total)) {
        /* one GEMM into the scratch, then each part's columns to its buffer */
        gemm_run(b, xh, w[0]->h, n, in, total, b->fuse_ws, GEMM_F32);
        struct split_args a = {};
        a.src = b->fuse_ws;
        a.total = total;
        a.n_parts = n_parts;
        for (int p = 0; p < n_parts; p++) {
            a.out[p] = out[p];
            a.y[p] = (float *)y[p]->d;
            a.bias[p] = bias && bias[p] ? bias[p]->f : NULL;
        }
        CUDA_CHECK(kvs_cu_launch(k_split_cols, dim3((unsigned)n, (unsigned)n_parts), 256, 0, b->stream, a));
        LAUNCH_CHECK();
    } else {
        for (int p = 0; p < n_parts; p++)
            gemm_blas(b, xh, w[p], bias ? bias[p] : NULL, n, in, out[p], y[p]->d, GEMM_F32);
    }
}

static void cu_matmul(struct kvs_backend *b, const struct kvs_dbuf *x, const struct kvs_dweight *w,
                      const struct kvs_dweight *bias, int n, int in, int out, struct kvs_dbuf *y)
{
    cu_matmul_multi(b, x, 1, &w, &bias, n, in, &out, &y);
}

static void cu_swiglu(struct kvs_backend *b, const struct kvs_dbuf *gate, const struct kvs_dbuf *up, int n, int ff,
                      struct kvs_dbuf *out);

/* gate = silu(x Wg^T) * (x Wu^T): one decode-GEMM launch with SwiGLU in its epilogue (which also
 * writes the bf16 copy for the down projection), or two cuBLAS GEMMs and the SwiGLU kernel. The
 * cuBLAS GEMMs write bf16 (into up's storage, which holds both: up is scratch), so SwiGLU reads
 * half the bytes that fp32 outputs would take (H100, Llama-3.1-8B shape, the step's GEMMs at
 * batch 128: see bench/RESULTS.md); where ff is not a multiple of 8 they write fp32 as matmul. */
/* matmul_swiglu; f32 = 0: the fp32 result may be left unwritten where only its bf16 copy (the
 * mirror, for the down projection) is needed (matmul_swiglu_down) */
static void swiglu_gemms(struct kvs_backend *b, const struct kvs_dbuf *x, const struct kvs_dweight *wg,
                         const struct kvs_dweight *wu, int n, int in, int ff, struct kvs_dbuf *gate,
                         struct kvs_dbuf *up, int f32)
{
    if (n <= 0) return;
    const int outs[2] = {ff, ff};
    KVS_ASSERT(!wg->is_vector && wg->rows == ff && wg->cols == in && !wu->is_vector && wu->rows == ff && wu->cols == in);
    if (n <= b->skinny_max && kvs_cu_skinny_supported(n, in, outs, 2, 1)) {
        KVS_ASSERT((size_t)n * in <= b->xh_cap);
        const bf16 *xh = gemm_input(b, x, (size_t)n * in);
        xh_forget(b, up->d);
        struct kvs_cu_skinny a = {};
        a.x = xh;
        a.n = n;
        a.in = in;
        a.swiglu = 1;
        a.n_parts = 2;
        a.w[0] = wg->h;
        a.w[1] = wu->h;
        a.out[0] = a.out[1] = ff;
        a.y[0] = (float *)gate->d;
        a.yh = xh_claim(b, gate->d, (size_t)n * ff); /* the other mirror buffer than xh */
        CUDA_CHECK(kvs_cu_skinny(&a, b->stream));
        return;
    }
    if (ff % 8 != 0) {
        cu_matmul(b, x, wg, NULL, n, in, ff, gate);
        cu_matmul(b, x, wu, NULL, n, in, ff, up);
        cu_swiglu(b, gate, up, n, ff, gate);
        return;
    }
    const size_t nn = (size_t)n * ff;
    KVS_ASSERT((size_t)n * in <= b->xh_cap && up->n >= nn && gate->n >= nn);
    const bf16 *xh = gemm_input(b, x, (size_t)n * in);
    xh_forget(b, up->d);
    /* gate and up in bf16 in the scratch `up` (2 n ff bf16 fit its n ff floats): [n][ff] each, or
     * with the weights laid out back to back (fuse_weights) one GEMM writes [n][gate ff | up ff] */
    const struct kvs_dweight *wgu[2] = {wg, wu};
    const int fused = weights_adjacent(wgu, 2);
    bf16 *gh = (bf16 *)up->d, *uh = fused ? gh + ff : gh + nn; /* 16-byte aligned: ff is a multiple of 8 */
    if (fused) {
        gemm_run(b, xh, wg->h, n, in, 2 * ff, gh, GEMM_BF16);
    } else {
        gemm_blas(b, xh, wg, NULL, n, in, ff, gh, GEMM_BF16);
        gemm_blas(b, xh, wu, NULL, n, in, ff, uh, GEMM_BF16);
    }
    bf16 *outh = xh_claim(b, gate->d, nn);
    KVS_ASSERT(outh); /* the mirrors are as large as the largest ACT buffer (alloc), gate included */
    CUDA_CHECK(kvs_cu_launch(k_swiglu_h, grid_for(nn / 8, 256), 256, 0, b->stream, (const uint4 *)gh, (const uint4 *)uh,
                             nn / 8, ff / 8, fused ? ff / 4 : ff / 8, f32 ? (float4 *)gate->d : nullptr, (uint4 *)outh));
    LAUNCH_CHECK();
}

static void cu_matmul_swiglu(struct kvs_backend *b, const struct kvs_dbuf *x, const struct kvs_dweight *wg,
                             const struct kvs_dweight *wu, int n, int in, int ff, struct kvs_dbuf *gate,
                             struct kvs_dbuf *up)
{
    swiglu_gemms(b, x, wg, wu, n, in, ff, gate, up, 1);
}

/* backend.h: matmul_swiglu, then the down projection from the bf16 copy of its result; above the
 * decode GEMM's rows the fp32 result is not written (half the bytes of the SwiGLU pass) */
static void cu_matmul_swiglu_down(struct kvs_backend *b, const struct kvs_dbuf *x, const struct kvs_dweight *wg,
                                  const struct kvs_dweight *wu, const struct kvs_dweight *wd, int n, int in, int ff,
                                  struct kvs_dbuf *gate, struct kvs_dbuf *up, struct kvs_dbuf *y)
{
    if (n <= 0) return;
    /* every path that skips the fp32 result writes the bf16 copy (the mirror), which the down
     * projection reads; the others write both or the fp32 alone (converted for the GEMM) */
    swiglu_gemms(b, x, wg, wu, n, in, ff, gate, up, 0);
    cu_matmul(b, gate, wd, NULL, n, ff, in, y);
    xh_forget(b, gate->d); /* gate's fp32 may be stale: scratch from here on */
}

static void cu_rope(struct kvs_backend *b, struct kvs_dbuf *x, const struct kvs_dbuf *pos, const struct kvs_dbuf *rot,
                    const struct kvs_dbuf *inv_freq, int n, int n_heads, int head_dim)
{
    if (n <= 0) return;
    xh_forget(b, x->d);
    CUDA_CHECK(kvs_cu_launch(k_rope, n, 256, 0, b->stream, (float *)x->d, (const int32_t *)pos->d, rot ? (const int32_t *)rot->d : nullptr,
                                     (const float *)inv_freq->d, n_heads, head_dim));
    LAUNCH_CHECK();
}

static void cu_kv_write(struct kvs_backend *b, const struct kvs_dbuf *k, const struct kvs_dbuf *v,
                        const struct kvs_dbuf *slots, int n, int n_kv_heads, int head_dim, int block_size,
                        struct kvs_dbuf *kc, struct kvs_dbuf *vc)
{
    if (n <= 0) return;
    CUDA_CHECK(kvs_cu_launch(k_kv_write, n, 256, 0, b->stream, (const float *)k->d, (const float *)v->d, (const int32_t *)slots->d,
                                         n_kv_heads, head_dim, block_size, (bf16 *)kc->d, (bf16 *)vc->d));
    LAUNCH_CHECK();
}

static void launch_rope_kv_write(struct kvs_backend *b, struct rkv_args *a, int n)
{
    const int units = a->nh + 2 * a->nkv;
    const dim3 grid((unsigned)n, (unsigned)((units + RKV_HEADS - 1) / RKV_HEADS));
    CUDA_CHECK(kvs_cu_launch(k_rope_kv_write, grid, 256, (size_t)a->hd * sizeof(float), b->stream, *a));
    LAUNCH_CHECK();
}

static void rkv_common(struct rkv_args *a, const struct kvs_dbuf *pos, const struct kvs_dbuf *inv_freq,
                       const struct kvs_dbuf *slots, int n_heads, int n_kv_heads, int head_dim, int block_size,
                       struct kvs_dbuf *kc, struct kvs_dbuf *vc)
{
    a->pos = (const int32_t *)pos->d;
    a->slots = (const int32_t *)slots->d;
    a->inv_freq = (const float *)inv_freq->d;
    a->nh = n_heads;
    a->nkv = n_kv_heads;
    a->hd = head_dim;
    a->bs = block_size;
    a->kc = (bf16 *)kc->d;
    a->vc = (bf16 *)vc->d;
}

static void cu_rope_kv_write(struct kvs_backend *b, struct kvs_dbuf *q, struct kvs_dbuf *k, const struct kvs_dbuf *v,
                             const struct kvs_dbuf *pos, const struct kvs_dbuf *inv_freq, const struct kvs_dbuf *slots,
                             int n, int n_heads, int n_kv_heads, int head_dim, int block_size, struct kvs_dbuf *kc,
                             struct kvs_dbuf *vc)
{
    if (n <= 0) return;
    xh_forget(b, q->d);
    xh_forget(b, k->d);
    struct rkv_args a = {};
    a.qs = a.q = (float *)q->d;
    a.ks = a.k = (float *)k->d;
    a.vs = (const float *)v->d;
    a.ldq = n_heads * head_dim;
    a.ldk = a.ldv = n_kv_heads * head_dim;
    rkv_common(&a, pos, inv_freq, slots, n_heads, n_kv_heads, head_dim, block_size, kc, vc);
    launch_rope_kv_write(b, &a, n);
}

/* backend.h: matmul_multi + rope_kv_write. With q/k/v laid out back to back (fuse_weights) and
 * 9-256 rows, the joint GEMM's output goes straight to the RoPE and cache write (no pass that
 * splits it into q, k, v first); else the two ops. */
static void cu_matmul_rope_kv_write(struct kvs_backend *b, const struct kvs_dbuf *x,
                                    const struct kvs_dweight *const *w, const struct kvs_dweight *const *bias, int n,
                                    int in, struct kvs_dbuf *q, struct kvs_dbuf *k, struct kvs_dbuf *v,
                                    const struct kvs_dbuf *pos, const struct kvs_dbuf *inv_freq,
                                    const struct kvs_dbuf *slots, int n_heads, int n_kv_heads, int head_dim,
                                    int block_size, struct kvs_dbuf *kc, struct kvs_dbuf *vc)
{
    if (n <= 0) return;
    const int outs[3] = {n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim};
    struct kvs_dbuf *y[3] = {q, k, v};
    int total = 0;
    if (multi_skinny(b, 3, n, in, outs) || !multi_joint(b, w, 3, n, outs, &total)) {
        cu_matmul_multi(b, x, 3, w, bias, n, in, outs, y);
        cu_rope_kv_write(b, q, k, v, pos, inv_freq, slots, n, n_heads, n_kv_heads, head_dim, block_size, kc, vc);
        return;
    }
    const bf16 *xh = multi_begin(b, x, 3, w, bias, n, in, outs, y);
    gemm_run(b, xh, w[0]->h, n, in, total, b->fuse_ws, GEMM_F32);
    struct rkv_args a = {};
    a.qs = b->fuse_ws;
    a.ks = b->fuse_ws + outs[0];
    a.vs = b->fuse_ws + outs[0] + outs[1];
    a.ldq = a.ldk = a.ldv = total;
    a.bq = bias && bias[0] ? bias[0]->f : NULL;
    a.bk = bias && bias[1] ? bias[1]->f : NULL;
    a.bv = bias && bias[2] ? bias[2]->f : NULL;
    a.q = (float *)q->d;
    a.k = (float *)k->d;
    a.v = (float *)v->d;
    rkv_common(&a, pos, inv_freq, slots, n_heads, n_kv_heads, head_dim, block_size, kc, vc);
    launch_rope_kv_write(b, &a, n);
}

static void cu_attention(struct kvs_backend *b, const struct kvs_dbuf *q, const struct kvs_dbuf *kc,
                         const struct kvs_dbuf *vc, const struct kvs_attn_meta *m, int n, int n_heads, int n_kv_heads,
                         int head_dim, int block_size, float scale, struct kvs_dbuf *out)
{
    if (n <= 0) return;
    struct kvs_cu_attn a;
    a.q = (const float *)q->d;
    a.kc = (const bf16 *)kc->d;
    a.vc = (const bf16 *)vc->d;
    KVS_ASSERT(kc->n == vc->n);
    a.kv_elems = kc->n;
    a.q_start = (const int32_t *)m->q_start->d;
    a.pos = (const int32_t *)m->pos->d;
    a.bt = (const int32_t *)m->block_tables->d;
    a.rot = m->rot_offsets ? (const int32_t *)m->rot_offsets->d : nullptr;
    a.valid = m->block_valid ? (const int32_t *)m->block_valid->d : nullptr;
    a.inv_freq = m->inv_freq ? (const float *)m->inv_freq->d : nullptr;
    a.words = m->block_words ? (const int32_t *)m->block_words->d : nullptr;
    a.h_q_start = m->h_q_start;
    a.h_pos = m->h_pos;
    a.n_seqs = m->n_seqs;
    a.max_blocks = m->max_blocks;
    a.n = n;
    a.n_heads = n_heads;
    a.n_kv = n_kv_heads;
    a.hd = head_dim;
    a.bs = block_size;
    a.plan_ctx = m->plan_ctx;
    a.scale = scale;
    a.out = (float *)out->d;
    /* the o projection reads the bf16 copy, which the attention writes as it goes */
    a.outh = xh_claim(b, out->d, (size_t)n * n_heads * head_dim);
    kvs_cu_attention(&a, b->stream, b->n_sms, b->attn_ws, ATTN_WS_BYTES, b->attn_splits, b->dec_attn);
}

static void cu_swiglu(struct kvs_backend *b, const struct kvs_dbuf *gate, const struct kvs_dbuf *up, int n, int ff,
                      struct kvs_dbuf *out)
{
    if (n <= 0) return;
    size_t nn = (size_t)n * ff;
    bf16 *outh = xh_claim(b, out->d, nn);
    CUDA_CHECK(kvs_cu_launch(k_swiglu, grid_for(nn, 256), 256, 0, b->stream, (const float *)gate->d, (const float *)up->d, nn,
                                                        (float *)out->d, outh));
    LAUNCH_CHECK();
}

static void cu_gather_rows(struct kvs_backend *b, const struct kvs_dbuf *x, const struct kvs_dbuf *rows, int m,
                           int dim, struct kvs_dbuf *out)
{
    if (m <= 0) return;
    xh_forget(b, out->d);
    CUDA_CHECK(kvs_cu_launch(k_gather_rows, m, 256, 0, b->stream, (const float *)x->d, (const int32_t *)rows->d, dim, (float *)out->d));
    LAUNCH_CHECK();
}

static void cu_kv_copy_block(struct kvs_backend *b, struct kvs_dbuf *kc, struct kvs_dbuf *vc, int src, int dst,
                             int n_kv_heads, int block_size, int head_dim)
{
    if (src == dst) return;
    size_t per = (size_t)n_kv_heads * block_size * head_dim;
    KVS_ASSERT((size_t)(src > dst ? src : dst) * per + per <= kc->n);
    CUDA_CHECK(cudaMemcpyAsync((bf16 *)kc->d + (size_t)dst * per, (bf16 *)kc->d + (size_t)src * per,
                               per * sizeof(bf16), cudaMemcpyDeviceToDevice, b->stream));
    CUDA_CHECK(cudaMemcpyAsync((bf16 *)vc->d + (size_t)dst * per, (bf16 *)vc->d + (size_t)src * per,
                               per * sizeof(bf16), cudaMemcpyDeviceToDevice, b->stream));
}

static void cu_logits_to_host(struct kvs_backend *b, const struct kvs_dbuf *logits, int m, int vocab, float *host)
{
    if (m <= 0) return;
    cu_download(b, host, logits, 0, (size_t)m * vocab);
}

static void cu_argmax_rows(struct kvs_backend *b, const struct kvs_dbuf *logits, int m, int vocab,
                           struct kvs_dbuf *out, size_t out_off)
{
    if (m <= 0) return;
    KVS_ASSERT(logits->kind != KVS_BUF_KV && out->kind == KVS_BUF_I32);
    KVS_ASSERT((size_t)m * vocab <= logits->n && out_off + (size_t)m <= out->n);
    int vec4 = vocab % 4 == 0 && ((uintptr_t)logits->d & 15) == 0;
    xh_forget(b, out->d);
    CUDA_CHECK(kvs_cu_launch(k_argmax_rows, m, ARGMAX_THREADS, 0, b->stream, (const float *)logits->d, vocab, vec4,
                             (int32_t *)out->d + out_off));
    LAUNCH_CHECK();
}

/* ---- step graphs ---------------------------------------------------------------------------- */

static void cu_graph_begin(struct kvs_backend *b)
{
    CUDA_CHECK(cudaStreamBeginCapture(b->stream, cudaStreamCaptureModeThreadLocal));
}

static struct kvs_graph *cu_graph_end(struct kvs_backend *b, char *err, size_t errlen)
{
    struct kvs_graph *g = (struct kvs_graph *)kvs_xcalloc(1, sizeof *g);
    CUDA_CHECK(cudaStreamEndCapture(b->stream, &g->graph));
    cudaError_t e = cudaGraphInstantiate(&g->exec, g->graph, 0);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        kvs_err(err, errlen, -ENOMEM, "cuda: graph instantiation failed (%s)", cudaGetErrorString(e));
        CUDA_CHECK(cudaGraphDestroy(g->graph));
        free(g);
        return NULL;
    }
    g->xh = b->xh;
    g->xh_src = b->xh_src;
    g->xh_n = b->xh_n;
    return g;
}

static void cu_graph_launch(struct kvs_backend *b, struct kvs_graph *g)
{
    CUDA_CHECK(cudaGraphLaunch(g->exec, b->stream));
    /* the replay rewrote the bf16 mirror exactly as the recorded ops did */
    b->xh = g->xh;
    b->xh_src = g->xh_src;
    b->xh_n = g->xh_n;
}

static void cu_graph_free(struct kvs_backend *b, struct kvs_graph *g)
{
    if (!g) return;
    CUDA_CHECK(cudaStreamSynchronize(b->stream));
    CUDA_CHECK(cudaGraphExecDestroy(g->exec));
    CUDA_CHECK(cudaGraphDestroy(g->graph));
    free(g);
}

extern "C" const struct kvs_backend_ops kvs_cuda_backend = {
    /* name */ "cuda",
    cu_create,
    cu_free,
    cu_mem_available,
    cu_elem_size,
    cu_sync,
    cu_alloc,
    cu_free_buf,
    cu_upload,
    cu_download,
    cu_zero,
    cu_upload_weight,
    cu_free_weight,
    cu_embed,
    cu_rmsnorm,
    cu_add_rmsnorm,
    cu_head_rmsnorm,
    cu_matmul,
    cu_rope,
    cu_kv_write,
    cu_attention,
    cu_swiglu,
    cu_gather_rows,
    cu_kv_copy_block,
    cu_logits_to_host,
    cu_graph_begin,
    cu_graph_end,
    cu_graph_launch,
    cu_graph_free,
    cu_matmul_multi,
    cu_matmul_swiglu,
    cu_rope_kv_write,
    cu_argmax_rows,
    cu_fuse_weights,
    cu_matmul_rope_kv_write,
    cu_matmul_swiglu_down,
    /* attention_spans, attn_merge: not on this backend yet (strategies that need them refuse
     * device cuda at startup, kv.h) */
    nullptr,
    nullptr,
};

/* ---- extras (cuda_backend.h) -------------------------------------------------------------- */

extern "C" struct kvs_dweight *kvs_cuda_random_weight(struct kvs_backend *b, int64_t rows, int64_t cols,
                                                      int is_vector, float scale, uint64_t seed)
{
    struct kvs_dweight *w = (struct kvs_dweight *)kvs_xcalloc(1, sizeof *w);
    w->rows = is_vector ? 1 : rows;
    w->cols = cols;
    w->is_vector = is_vector;
    size_t n = (size_t)(w->rows * w->cols);
    if (is_vector) {
        w->f = (float *)dev_alloc(n * 4);
        if (!w->f) { free(w); return NULL; }
        k_f32_fill_random<<<grid_for(n, 256), 256, 0, b->stream>>>(w->f, n, scale, seed);
    } else {
        w->h = (bf16 *)dev_alloc(n * 2);
        if (!w->h) { free(w); return NULL; }
        k_bf16_fill_random<<<grid_for(n, 256), 256, 0, b->stream>>>(w->h, n, scale, seed);
    }
    LAUNCH_CHECK();
    list_add(&b->weights, w);
    return w;
}

extern "C" void kvs_cuda_fill_random(struct kvs_backend *b, struct kvs_dbuf *buf, size_t off, size_t n, float scale,
                                     uint64_t seed)
{
    KVS_ASSERT(off + n <= buf->n && buf->kind != KVS_BUF_I32);
    xh_forget(b, buf->d);
    if (buf->kind == KVS_BUF_KV)
        k_bf16_fill_random<<<grid_for(n, 256), 256, 0, b->stream>>>((bf16 *)buf->d + off, n, scale, seed);
    else
        k_f32_fill_random<<<grid_for(n, 256), 256, 0, b->stream>>>((float *)buf->d + off, n, scale, seed);
    LAUNCH_CHECK();
}

extern "C" void kvs_cuda_timer_start(struct kvs_backend *b)
{
    CUDA_CHECK(cudaEventRecord(b->ev0, b->stream));
}

extern "C" float kvs_cuda_timer_stop_ms(struct kvs_backend *b)
{
    float ms = 0.0f;
    CUDA_CHECK(cudaEventRecord(b->ev1, b->stream));
    CUDA_CHECK(cudaEventSynchronize(b->ev1));
    CUDA_CHECK(cudaEventElapsedTime(&ms, b->ev0, b->ev1));
    return ms;
}

static int cmp_float(const void *x, const void *y)
{
    float a = *(const float *)x, c = *(const float *)y;
    return (a > c) - (a < c);
}

extern "C" double kvs_cuda_copy_bandwidth(struct kvs_backend *b, size_t bytes)
{
    void *src = dev_alloc(bytes), *dst = dev_alloc(bytes);
    if (!src || !dst) {
        if (src) CUDA_CHECK(cudaFree(src));
        if (dst) CUDA_CHECK(cudaFree(dst));
        return 0.0;
    }
    k_bf16_fill_random<<<grid_for(bytes / 2, 256), 256, 0, b->stream>>>((bf16 *)src, bytes / 2, 1.0f, 7);
    LAUNCH_CHECK();
    float t[15];
    for (int i = 0; i < 18; i++) {
        kvs_cuda_timer_start(b);
        CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, b->stream));
        float ms = kvs_cuda_timer_stop_ms(b);
        if (i >= 3) t[i - 3] = ms; /* 3 warm-ups */
    }
    qsort(t, 15, sizeof t[0], cmp_float);
    CUDA_CHECK(cudaFree(src));
    CUDA_CHECK(cudaFree(dst));
    return 2.0 * (double)bytes / (t[7] * 1e-3);
}

extern "C" void *kvs_cuda_buf_ptr(const struct kvs_dbuf *buf) { return buf ? buf->d : NULL; }
extern "C" void *kvs_cuda_stream(struct kvs_backend *b) { return (void *)b->stream; }
extern "C" int kvs_cuda_n_sms(struct kvs_backend *b) { return b->n_sms; }

extern "C" void kvs_cuda_device_desc(struct kvs_backend *b, char *out, size_t outlen)
{
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, b->device));
    int drv = 0, rt = 0;
    CUDA_CHECK(cudaDriverGetVersion(&drv));
    CUDA_CHECK(cudaRuntimeGetVersion(&rt));
    snprintf(out, outlen, "%s, %d SMs, %.1f GiB, driver %d, runtime %d", prop.name, prop.multiProcessorCount,
             (double)prop.totalGlobalMem / (double)(1u << 30), drv, rt);
}

extern "C" void kvs_cuda_set_attn_splits(struct kvs_backend *b, int n_splits)
{
    b->attn_splits = n_splits > 0 ? n_splits : 0;
}

extern "C" void kvs_cuda_set_dec_attn(struct kvs_backend *b, int kind)
{
    b->dec_attn = kind == 0 || kind == 2 || kind == 3 || kind == 4 ? kind : -1;
}

extern "C" int kvs_cuda_supports_attention(int n_heads, int n_kv_heads, int head_dim)
{
    return kvs_cu_attention_supported(n_heads, n_kv_heads, head_dim);
}

extern "C" void kvs_cuda_set_skinny_max(struct kvs_backend *b, int max_n)
{
    b->skinny_max = max_n >= 0 ? max_n : b->skinny_default;
}

extern "C" void kvs_cuda_set_gemm(struct kvs_backend *b, int mode)
{
    KVS_ASSERT(mode >= -1 && mode <= KVS_CUDA_GEMM_EX);
    b->gemm_mode = mode >= 0 ? mode : b->gemm_default;
}

extern "C" void kvs_cuda_pretune(struct kvs_backend *b, const struct kvs_dweight *w)
{
    if (!w->is_vector) gemm_pretune(b, w->h, w->rows, w->cols, weight_kinds(w->rows, w->cols));
}

extern "C" void kvs_cuda_matmul_accumulate(struct kvs_backend *b, const struct kvs_dbuf *x, const struct kvs_dweight *w,
                                           int n, int in, int out, struct kvs_dbuf *y)
{
    if (n <= 0) return;
    KVS_ASSERT(!w->is_vector && w->rows == out && w->cols == in);
    KVS_ASSERT((size_t)n * in <= b->xh_cap && (size_t)n * out <= y->n && x->d != y->d);
    const bf16 *xh = gemm_input(b, x, (size_t)n * in);
    xh_forget(b, y->d);
    gemm_blas(b, xh, w, NULL, n, in, out, y->d, GEMM_F32_ACC);
}
