/* cuda_backend.cu: the CUDA implementation of the backend op table (kernels/backend.h).
 *
 * Formats (the choices backend.h leaves to each backend):
 *   KVS_BUF_ACT  fp32. The residual stream, norms, RoPE, softmax state and every activation stay
 *                in fp32, so the CUDA backend tracks the fp32 CPU reference closely; only GEMM
 *                inputs are rounded to bf16 (one small conversion pass of x before cuBLAS).
 *   KVS_BUF_F32  fp32;  KVS_BUF_I32 int32;  KVS_BUF_KV bf16.
 *   weights      2-D matrices bf16 (converted at upload from bf16/f16/f32); 1-D vectors (norm
 *                weights, biases) fp32, exact.
 * GEMMs: cublasGemmEx, bf16 x bf16 -> fp32 output, CUBLAS_COMPUTE_32F, for every n (a hand-written
 * small-batch GEMV reading fp32 x was measured slower than cuBLAS on H200 and dropped).
 * Attention: one kernel for prefill and decode rows (flash-decoding): a block per (query row,
 * KV head, split of the context); the block keeps the query heads of one GQA group in
 * registers so that every K/V element read from memory serves all of them; online softmax in
 * fp32; when the context is split, a second kernel reduces the partial (max, sum, acc) triples
 * in split order.
 *
 * Limits: attention needs head_dim a multiple of 16 and <= 256 (Llama / Qwen use 64 or 128; other
 * values abort with a message). Results are deterministic but not bitwise batch invariant as
 * backend.h asks: cuBLAS picks its kernel by n, and the context split of the attention depends
 * on the number of rows (differences are at bf16 rounding level).
 * Prefill rows use the same attention kernel (a block per query row): correct, not tiled.
 *
 * Memory: plain cudaMalloc, only in create, alloc and upload_weight (the matmul's bf16 copy of
 * x and the attention workspace are carved at create / grown in alloc). One stream; ops never
 * synchronise; download/logits_to_host/sync wait. Every CUDA/cuBLAS call is checked:
 * failures log file:line and abort (bugs, not client errors).
 */
#include <climits>
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
#include "engine/util.h"
#include "kernels/backend.h"
#include "models/model.h"
}
#include "kernels/cuda/cuda_backend.h"

#define CUDA_CHECK(call)                                                                     \
    do {                                                                                     \
        cudaError_t e_ = (call);                                                             \
        if (e_ != cudaSuccess)                                                               \
            kvs_panic(__FILE__, __LINE__, "CUDA error %s (%s) in %s", cudaGetErrorName(e_),   \
                      cudaGetErrorString(e_), #call);                                        \
    } while (0)
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

struct kvs_dweight {
    struct kvs_dweight *prev, *next; /* the backend's list of live weights */
    int64_t rows, cols;           /* a vector has rows = 1 */
    int is_vector;                /* 1: fp32 vector in f; 0: bf16 matrix [rows][cols] in h */
    float *f;
    bf16 *h;
};

struct kvs_cuda_graph {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
};

#define ATTN_WS_BYTES ((size_t)64 << 20)   /* split-attention partials */
#define BLAS_WS_BYTES ((size_t)32 << 20)   /* cuBLAS workspace (fixed, so graphs can capture) */
#define BOUNCE_ELEMS ((size_t)1 << 20)     /* host conversion chunk */

struct kvs_backend {
    int device;
    int n_sms;
    cudaStream_t stream;
    cublasHandle_t blas;
    void *blas_ws;
    bf16 *xh;                     /* bf16 copy of a matmul input [xh_cap] */
    size_t xh_cap;
    float *attn_ws;               /* ATTN_WS_BYTES */
    void *bounce;                 /* host: BOUNCE_ELEMS fp32, then BOUNCE_ELEMS bf16 */
    cudaEvent_t ev0, ev1;
    int attn_occ;                 /* 1 (default): attention built with __launch_bounds__(128, 3), at
                                   * most 168 registers, 3 resident blocks/SM; 0: uncapped (180
                                   * registers, 2 blocks/SM: up to 1.6x slower on H200).
                                   * KVS_CUDA_ATTN_OCC overrides. */
    int attn_blocks_per_sm;       /* split target, blocks per SM; 0 = auto: 8 when (rows x KV heads) < SMs,
                                   * else 4 (the better of the two in 6 of the 8 H200 rows of bench/RESULTS.md) */
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

__global__ void k_rmsnorm(const float *x, const float *w, float eps, int dim, float *out)
{
    __shared__ float red[32];
    size_t t = blockIdx.x;
    const float *xr = x + t * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss, red);
    float r = rsqrtf(ss / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) out[t * dim + i] = xr[i] * r * w[i];
}

__global__ void k_add_rmsnorm(float *res, const float *delta, const float *w, float eps, int dim, float *out)
{
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
    for (int i = threadIdx.x; i < dim; i += blockDim.x) out[t * dim + i] = xr[i] * r * w[i];
}

/* one warp per (row, head) */
__global__ void k_head_rmsnorm(float *x, const float *w, float eps, size_t n_rows_heads, int hd)
{
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
__global__ void k_rope(float *x, const int32_t *pos, const int32_t *rot, const float *inv_freq, int n_heads, int hd)
{
    size_t t = blockIdx.x;
    int half = hd / 2;
    long long p = (long long)pos[t] + (rot ? rot[t] : 0);
    for (int j = threadIdx.x; j < n_heads * half; j += blockDim.x) {
        int h = j / half, i = j % half;
        float ang = (float)((double)p * (double)inv_freq[i]);
        float c = cosf(ang), s = sinf(ang);
        float *xh = x + (t * n_heads + h) * hd;
        float a = xh[i], b = xh[i + half];
        xh[i] = a * c - b * s;
        xh[i + half] = b * c + a * s;
    }
}

/* block per row; threads over (kv head, d) */
__global__ void k_kv_write(const float *k, const float *v, const int32_t *slots, int nkv, int hd, int bs, bf16 *kc, bf16 *vc)
{
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

__global__ void k_swiglu(const float *g, const float *u, size_t n, float *out)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float x = g[i];
        out[i] = x / (1.0f + expf(-x)) * u[i];
    }
}

__global__ void k_gather_rows(const float *x, const int32_t *rows, int dim, float *out)
{
    size_t i = blockIdx.x;
    const float *src = x + (size_t)rows[i] * dim;
    for (int j = threadIdx.x; j < dim; j += blockDim.x) out[i * dim + j] = src[j];
}

__global__ void k_add_bias(float *y, const float *bias, size_t n, int out)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        y[i] += bias[i % out];
}

/* ---- attention ---------------------------------------------------------------------------- */
/*
 * Block = ATT_WARPS warps, for (query row t = blockIdx.x, KV head g and query-head chunk =
 * blockIdx.y, context split = blockIdx.z). Lanes form groups of LG = pow2 >= head_dim / 8;
 * each lane owns 8 consecutive dims (one 16-byte bf16 load of K or V) and every group streams
 * its own positions (TP at a time: all their K and V loads are issued before the first use)
 * with a private online-softmax state for the GT query heads, held in registers. At the end the
 * groups are merged through shared memory in group order (deterministic).
 */
#define ATT_WARPS 4
#define ATT_TP 4
#define PAD_SLOT INT_MIN          /* rotation-offset sentinel of a masked (padding) key slot */

struct attn_args {
    const float *q;
    const bf16 *kc, *vc;
    const int32_t *q_start, *pos, *bt, *rot;
    const int32_t *valid;         /* [n_seqs][max_blocks] leading valid slots per block, or null */
    const float *inv_freq;
    int n_seqs, max_blocks, n_heads, n_kv, hd, bs, lg, n_hchunks;
    float scale;
    int chunk, n_splits;
    float *out, *part;            /* part: [n][n_heads][n_splits][hd + 2] (acc..., m, l) */
};

__device__ __forceinline__ void bf16x8_to_f32(uint4 u, float *f)
{
    const __nv_bfloat162 *p = (const __nv_bfloat162 *)&u;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float2 x = __bfloat1622float2(p[i]);
        f[2 * i] = x.x;
        f[2 * i + 1] = x.y;
    }
}

/* ROT: the batch has rotation offsets (LazyAttention's cached documents). Then the *query* is
 * rotated backward by a block's offset instead of rotating every key forward:
 * <q, R(o) k> = <R(-o) q, k>. The rotated copy qx is recomputed only when the offset changes
 * (at document boundaries), so the cost is a compare per key plus a few sincos per document,
 * and the ordinary instantiation (ROT = false) carries no extra registers. */
template <int GT, int MINB, bool ROT>
__global__ void __launch_bounds__(ATT_WARPS * 32, MINB) k_attention(attn_args a)
{
    extern __shared__ float sm[];
    const int t = blockIdx.x;
    const int g = blockIdx.y / a.n_hchunks, hc = blockIdx.y % a.n_hchunks;
    const int split = blockIdx.z;
    const int G = a.n_heads / a.n_kv;
    const int h0 = g * G + hc * GT;
    const int nh = min(GT, G - hc * GT);
    const int hd = a.hd, lg = a.lg;

    /* sequence of row t: the last s with q_start[s] <= t */
    int lo = 0, hi = a.n_seqs - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (a.q_start[mid] <= t) lo = mid; else hi = mid - 1;
    }
    const int s = lo;
    const int L = a.pos[s] + (t - a.q_start[s]) + 1; /* positions 0 .. L-1 are visible */
    const int p0 = split * a.chunk, p1 = min(L, p0 + a.chunk);

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int gl = lane & (lg - 1);                  /* lane in group */
    const int gid = warp * (32 / lg) + lane / lg;    /* group index in block */
    const int ng = ATT_WARPS * (32 / lg);
    const int d0 = gl * 8;
    const bool active = d0 < hd;
    const int32_t *btab = a.bt + (size_t)s * a.max_blocks;
    const int32_t *rtab = a.rot ? a.rot + (size_t)s * a.max_blocks : nullptr;
    const int32_t *vtab = a.valid ? a.valid + (size_t)s * a.max_blocks : nullptr;
    const int half = hd / 2;
    /* RoPE partner lane (dims d0 +- half) for rotated keys */
    const int partner = (lane - gl) + (d0 < half ? gl + half / 8 : gl - half / 8);

    float qr[GT][8];
#pragma unroll
    for (int h = 0; h < GT; h++)
#pragma unroll
        for (int i = 0; i < 8; i++)
            qr[h][i] = (h < nh && active) ? a.q[((size_t)t * a.n_heads + h0 + h) * hd + d0 + i] * a.scale : 0.0f;

    /* ROT: qr rotated backward by cur_rot (see above); starts equal to qr (offset 0) */
    float qx[GT][8];
    int cur_rot = 0;
    if constexpr (ROT)
#pragma unroll
        for (int h = 0; h < GT; h++)
#pragma unroll
            for (int i = 0; i < 8; i++) qx[h][i] = qr[h][i];

    float m[GT], l[GT], acc[GT][8];
#pragma unroll
    for (int h = 0; h < GT; h++) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; i++) acc[h][i] = 0.0f;
    }

    /* The loop bound is warp-uniform (every lane runs every shuffle); groups past the end of
     * the range see only masked positions. (Register double buffering of the next tile's K/V
     * was measured slower on H200: its registers cost a resident block per SM.) */
    const int gpw = 32 / lg;
    uint4 ku[ATT_TP], vu[ATT_TP];
    int rofs[ATT_TP];
    auto load_tile = [&](int wb, uint4 *kk, uint4 *vv, int *ro) {
        const int bb = wb + (lane / lg) * ATT_TP;
#pragma unroll
        for (int j = 0; j < ATT_TP; j++) {
            int p = bb + j;
            kk[j] = make_uint4(0, 0, 0, 0);
            vv[j] = make_uint4(0, 0, 0, 0);
            ro[j] = 0;
            if (p < p1 && vtab && p % a.bs >= vtab[p / a.bs]) {
                ro[j] = PAD_SLOT;   /* the unused tail of a cached document's last block: never read */
            } else if (p < p1) {
                int pb = p / a.bs;
                size_t blk = (size_t)btab[pb];
                size_t off = ((blk * a.n_kv + g) * a.bs + (size_t)(p % a.bs)) * hd + d0;
                if (active) {
                    kk[j] = __ldg((const uint4 *)(a.kc + off));
                    vv[j] = __ldg((const uint4 *)(a.vc + off));
                }
                if (rtab) ro[j] = rtab[pb];
            }
        }
    };
    const int wstart = p0 + warp * gpw * ATT_TP;
    for (int wbase = wstart; wbase < p1; wbase += ng * ATT_TP) {
        const int base = wbase + (lane / lg) * ATT_TP;
        load_tile(wbase, ku, vu, rofs);
        float sc[ATT_TP][GT];
#pragma unroll
        for (int j = 0; j < ATT_TP; j++) {
            float kf[8];
            bf16x8_to_f32(ku[j], kf);
            if constexpr (ROT) {
                const int want = rofs[j] == PAD_SLOT ? cur_rot : rofs[j];
                const bool chg = want != cur_rot;
                if (__any_sync(0xffffffffu, chg)) { /* warp-uniform: every lane shuffles */
                    float pq[GT][8];
#pragma unroll
                    for (int h = 0; h < GT; h++)
#pragma unroll
                        for (int i = 0; i < 8; i++) pq[h][i] = __shfl_sync(0xffffffffu, qr[h][i], partner);
                    if (chg) {
#pragma unroll
                        for (int i = 0; i < 8; i++) {
                            int d = d0 + i, fi = d < half ? d : d - half;
                            float ang = active ? (float)((double)want * (double)a.inv_freq[fi]) : 0.0f;
                            float c, sn;
                            sincosf(ang, &sn, &c);
#pragma unroll
                            for (int h = 0; h < GT; h++)
                                qx[h][i] = d < half ? qr[h][i] * c + pq[h][i] * sn : qr[h][i] * c - pq[h][i] * sn;
                        }
                        cur_rot = want;
                    }
                }
            }
#pragma unroll
            for (int h = 0; h < GT; h++) {
                float d = 0.0f;
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    if constexpr (ROT) d += qx[h][i] * kf[i];
                    else d += qr[h][i] * kf[i];
                }
                sc[j][h] = d;
            }
        }
        /* reduce the dot products over the lanes of the group */
#pragma unroll
        for (int j = 0; j < ATT_TP; j++)
#pragma unroll
            for (int h = 0; h < GT; h++) {
                float d = sc[j][h];
                for (int o = lg >> 1; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
                sc[j][h] = (base + j < p1 && rofs[j] != PAD_SLOT) ? d : -INFINITY;
            }
#pragma unroll
        for (int h = 0; h < GT; h++) {
            float mt = sc[0][h];
#pragma unroll
            for (int j = 1; j < ATT_TP; j++) mt = fmaxf(mt, sc[j][h]);
            float mn = fmaxf(m[h], mt);
            if (mn == -INFINITY) continue; /* nothing visible yet for this group */
            float alpha = __expf(m[h] - mn);
            float pj[ATT_TP], ps = 0.0f;
#pragma unroll
            for (int j = 0; j < ATT_TP; j++) {
                pj[j] = __expf(sc[j][h] - mn);
                ps += pj[j];
            }
            l[h] = l[h] * alpha + ps;
            m[h] = mn;
#pragma unroll
            for (int i = 0; i < 8; i++) acc[h][i] *= alpha;
#pragma unroll
            for (int j = 0; j < ATT_TP; j++) {
                float vf[8];
                bf16x8_to_f32(vu[j], vf);
#pragma unroll
                for (int i = 0; i < 8; i++) acc[h][i] += pj[j] * vf[i];
            }
        }
    }

    /* merge the groups: shared layout [ng][GT][hd] acc, then [ng][GT] m and l */
    float *s_acc = sm;
    float *s_m = sm + (size_t)ng * GT * hd;
    float *s_l = s_m + ng * GT;
#pragma unroll
    for (int h = 0; h < GT; h++) {
        if (active)
#pragma unroll
            for (int i = 0; i < 8; i++) s_acc[((size_t)gid * GT + h) * hd + d0 + i] = acc[h][i];
        if (gl == 0) {
            s_m[gid * GT + h] = m[h];
            s_l[gid * GT + h] = l[h];
        }
    }
    __syncthreads();
    for (int j = threadIdx.x; j < nh * hd; j += blockDim.x) {
        int h = j / hd, d = j % hd;
        float M = -INFINITY;
        for (int q = 0; q < ng; q++) M = fmaxf(M, s_m[q * GT + h]);
        float Ls = 0.0f, A = 0.0f;
        if (M != -INFINITY)
            for (int q = 0; q < ng; q++) {
                float mq = s_m[q * GT + h];
                if (mq == -INFINITY) continue;
                float e = __expf(mq - M);
                Ls += s_l[q * GT + h] * e;
                A += s_acc[((size_t)q * GT + h) * hd + d] * e;
            }
        size_t row = (size_t)t * a.n_heads + h0 + h;
        if (a.n_splits == 1) {
            a.out[row * hd + d] = A / Ls;
        } else {
            float *pp = a.part + (row * a.n_splits + split) * (size_t)(hd + 2);
            pp[d] = A;
            if (d == 0) {
                pp[hd] = M;
                pp[hd + 1] = Ls;
            }
        }
    }
}

/* block per (row, head); threads over dims; splits merged in order */
__global__ void k_attn_reduce(const float *part, int n_splits, int hd, float *out)
{
    size_t row = blockIdx.x;
    const float *pp = part + row * n_splits * (size_t)(hd + 2);
    float M = -INFINITY;
    for (int s = 0; s < n_splits; s++) M = fmaxf(M, pp[(size_t)s * (hd + 2) + hd]);
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float Ls = 0.0f, A = 0.0f;
        for (int s = 0; s < n_splits; s++) {
            const float *q = pp + (size_t)s * (hd + 2);
            if (q[hd] == -INFINITY) continue;
            float e = __expf(q[hd] - M);
            Ls += q[hd + 1] * e;
            A += q[d] * e;
        }
        out[row * hd + d] = A / Ls;
    }
}

/* ---- lifetime ----------------------------------------------------------------------------- */

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
    CUDA_CHECK(cudaMalloc((void **)&b->attn_ws, ATTN_WS_BYTES));
    CUDA_CHECK(cudaEventCreate(&b->ev0));
    CUDA_CHECK(cudaEventCreate(&b->ev1));
    b->bounce = kvs_xmalloc(BOUNCE_ELEMS * 6); /* fp32 chunk + bf16 chunk */
    /* the attention kernels may need more than 48 KB of shared memory for small head dims */
    CUDA_CHECK(cudaFuncSetAttribute(k_attention<1, 1, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, 96 * 1024));
    CUDA_CHECK(cudaFuncSetAttribute(k_attention<1, 1, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, 96 * 1024));
    CUDA_CHECK(cudaFuncSetAttribute(k_attention<2, 1, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, 96 * 1024));
    CUDA_CHECK(cudaFuncSetAttribute(k_attention<2, 1, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, 96 * 1024));
    CUDA_CHECK(cudaFuncSetAttribute(k_attention<4, 1, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, 96 * 1024));
    CUDA_CHECK(cudaFuncSetAttribute(k_attention<4, 1, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, 96 * 1024));
    CUDA_CHECK(cudaFuncSetAttribute(k_attention<8, 1, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, 96 * 1024));
    CUDA_CHECK(cudaFuncSetAttribute(k_attention<8, 1, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, 96 * 1024));
    CUDA_CHECK(cudaFuncSetAttribute(k_attention<1, 3, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, 96 * 1024));
    CUDA_CHECK(cudaFuncSetAttribute(k_attention<1, 3, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, 96 * 1024));
    CUDA_CHECK(cudaFuncSetAttribute(k_attention<2, 3, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, 96 * 1024));
    CUDA_CHECK(cudaFuncSetAttribute(k_attention<2, 3, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, 96 * 1024));
    CUDA_CHECK(cudaFuncSetAttribute(k_attention<4, 3, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, 96 * 1024));
    CUDA_CHECK(cudaFuncSetAttribute(k_attention<4, 3, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, 96 * 1024));
    CUDA_CHECK(cudaFuncSetAttribute(k_attention<8, 3, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, 96 * 1024));
    CUDA_CHECK(cudaFuncSetAttribute(k_attention<8, 3, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, 96 * 1024));
    {
        const char *e = getenv("KVS_CUDA_ATTN_OCC");
        b->attn_occ = e ? atoi(e) != 0 : 1;
        e = getenv("KVS_CUDA_ATTN_BLOCKS_PER_SM");
        b->attn_blocks_per_sm = e && atoi(e) > 0 ? atoi(e) : 0;
    }
    kvs_log(KVS_LOG_INFO, "cuda: %s, %d SMs, %.1f GiB, compute %d.%d", prop.name, prop.multiProcessorCount,
            (double)prop.totalGlobalMem / (1u << 30), prop.major, prop.minor);
    return b;
}

static void cu_free(struct kvs_backend *b)
{
    if (!b) return;
    CUDA_CHECK(cudaStreamSynchronize(b->stream));
    while (b->bufs) {
        struct kvs_dbuf *x = b->bufs;
        list_del(&b->bufs, x);
        CUDA_CHECK(cudaFree(x->d));
        free(x);
    }
    while (b->weights) {
        struct kvs_dweight *w = b->weights;
        list_del(&b->weights, w);
        CUDA_CHECK(cudaFree(w->f));
        CUDA_CHECK(cudaFree(w->h));
        free(w);
    }
    CUDA_CHECK(cudaFree(b->xh));
    CUDA_CHECK(cudaFree(b->attn_ws));
    CUDA_CHECK(cudaFree(b->blas_ws));
    CUBLAS_CHECK(cublasDestroy(b->blas));
    CUDA_CHECK(cudaEventDestroy(b->ev0));
    CUDA_CHECK(cudaEventDestroy(b->ev1));
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
    /* the matmul's bf16 copy of x is as large as the largest activation buffer */
    if (kind == KVS_BUF_ACT && n > b->xh_cap) {
        bf16 *nx = (bf16 *)dev_alloc(n * sizeof(bf16));
        if (!nx) return NULL;
        CUDA_CHECK(cudaStreamSynchronize(b->stream));
        CUDA_CHECK(cudaFree(b->xh));
        b->xh = nx;
        b->xh_cap = n;
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
    CUDA_CHECK(cudaFree(buf->d));
    free(buf);
}

static void cu_upload(struct kvs_backend *b, struct kvs_dbuf *dst, size_t off, const void *src, size_t n)
{
    KVS_ASSERT(off + n <= dst->n);
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
    list_del(&b->weights, w);
    CUDA_CHECK(cudaFree(w->f));
    CUDA_CHECK(cudaFree(w->h));
    free(w);
}

/* ---- ops ---------------------------------------------------------------------------------- */

static void cu_embed(struct kvs_backend *b, const struct kvs_dweight *emb, const struct kvs_dbuf *tokens, int n,
                     int dim, struct kvs_dbuf *out)
{
    if (n <= 0) return;
    KVS_ASSERT(!emb->is_vector && emb->cols == dim);
    k_embed<<<n, 256, 0, b->stream>>>(emb->h, (const int32_t *)tokens->d, dim, (float *)out->d);
    LAUNCH_CHECK();
}

static void cu_rmsnorm(struct kvs_backend *b, const struct kvs_dbuf *x, const struct kvs_dweight *w, float eps, int n,
                       int dim, struct kvs_dbuf *out)
{
    if (n <= 0) return;
    KVS_ASSERT(w->is_vector && w->cols == dim);
    k_rmsnorm<<<n, NORM_THREADS, 0, b->stream>>>((const float *)x->d, w->f, eps, dim, (float *)out->d);
    LAUNCH_CHECK();
}

static void cu_add_rmsnorm(struct kvs_backend *b, struct kvs_dbuf *res, const struct kvs_dbuf *delta,
                           const struct kvs_dweight *w, float eps, int n, int dim, struct kvs_dbuf *out)
{
    if (n <= 0) return;
    KVS_ASSERT(w->is_vector && w->cols == dim);
    k_add_rmsnorm<<<n, NORM_THREADS, 0, b->stream>>>((float *)res->d, (const float *)delta->d, w->f, eps, dim,
                                                     (float *)out->d);
    LAUNCH_CHECK();
}

static void cu_head_rmsnorm(struct kvs_backend *b, struct kvs_dbuf *x, const struct kvs_dweight *w, float eps, int n,
                            int n_heads, int head_dim)
{
    if (n <= 0) return;
    KVS_ASSERT(w->is_vector && w->cols == head_dim);
    size_t rh = (size_t)n * n_heads;
    k_head_rmsnorm<<<(unsigned)((rh + 7) / 8), 256, 0, b->stream>>>((float *)x->d, w->f, eps, rh, head_dim);
    LAUNCH_CHECK();
}

static void cu_matmul(struct kvs_backend *b, const struct kvs_dbuf *x, const struct kvs_dweight *w,
                      const struct kvs_dweight *bias, int n, int in, int out, struct kvs_dbuf *y)
{
    if (n <= 0) return;
    KVS_ASSERT(!w->is_vector && w->rows == out && w->cols == in);
    size_t nx = (size_t)n * in;
    KVS_ASSERT(nx <= b->xh_cap);
    k_f32_to_bf16<<<grid_for(nx, 256), 256, 0, b->stream>>>((const float *)x->d, b->xh, nx);
    LAUNCH_CHECK();
    const float one = 1.0f, zero = 0.0f;
    /* column-major view: y^T[out][n] = W[out][in] (stored as col-major in x out, so op T) * x^T[in][n] */
    CUBLAS_CHECK(cublasGemmEx(b->blas, CUBLAS_OP_T, CUBLAS_OP_N, out, n, in, &one, w->h, CUDA_R_16BF, in, b->xh,
                              CUDA_R_16BF, in, &zero, y->d, CUDA_R_32F, out, CUBLAS_COMPUTE_32F,
                              CUBLAS_GEMM_DEFAULT));
    if (bias) {
        KVS_ASSERT(bias->is_vector && bias->cols == out);
        size_t ny = (size_t)n * out;
        k_add_bias<<<grid_for(ny, 256), 256, 0, b->stream>>>((float *)y->d, bias->f, ny, out);
        LAUNCH_CHECK();
    }
}

static void cu_rope(struct kvs_backend *b, struct kvs_dbuf *x, const struct kvs_dbuf *pos, const struct kvs_dbuf *rot,
                    const struct kvs_dbuf *inv_freq, int n, int n_heads, int head_dim)
{
    if (n <= 0) return;
    k_rope<<<n, 256, 0, b->stream>>>((float *)x->d, (const int32_t *)pos->d, rot ? (const int32_t *)rot->d : nullptr,
                                     (const float *)inv_freq->d, n_heads, head_dim);
    LAUNCH_CHECK();
}

static void cu_kv_write(struct kvs_backend *b, const struct kvs_dbuf *k, const struct kvs_dbuf *v,
                        const struct kvs_dbuf *slots, int n, int n_kv_heads, int head_dim, int block_size,
                        struct kvs_dbuf *kc, struct kvs_dbuf *vc)
{
    if (n <= 0) return;
    k_kv_write<<<n, 256, 0, b->stream>>>((const float *)k->d, (const float *)v->d, (const int32_t *)slots->d,
                                         n_kv_heads, head_dim, block_size, (bf16 *)kc->d, (bf16 *)vc->d);
    LAUNCH_CHECK();
}

static int pow2_at_least(int x)
{
    int p = 1;
    while (p < x) p <<= 1;
    return p;
}

static void cu_attention(struct kvs_backend *b, const struct kvs_dbuf *q, const struct kvs_dbuf *kc,
                         const struct kvs_dbuf *vc, const struct kvs_attn_meta *m, int n, int n_heads, int n_kv_heads,
                         int head_dim, int block_size, float scale, struct kvs_dbuf *out)
{
    if (n <= 0) return;
    /* 16-byte K/V loads of 8 dims per lane; the RoPE partner of a lane is a whole lane away */
    if (head_dim % 16 != 0 || head_dim > 256 || n_heads % n_kv_heads != 0)
        kvs_panic(__FILE__, __LINE__, "cuda attention: head_dim %d (need a multiple of 16, <= 256), heads %d/%d",
                  head_dim, n_heads, n_kv_heads);
    int G = n_heads / n_kv_heads;
    int GT = G >= 8 ? 8 : pow2_at_least(G);
    int n_hchunks = (G + GT - 1) / GT;
    int lg = pow2_at_least(head_dim / 8);
    int ng = ATT_WARPS * (32 / lg);

    attn_args a;
    a.q = (const float *)q->d;
    a.kc = (const bf16 *)kc->d;
    a.vc = (const bf16 *)vc->d;
    a.q_start = (const int32_t *)m->q_start->d;
    a.pos = (const int32_t *)m->pos->d;
    a.bt = (const int32_t *)m->block_tables->d;
    a.rot = m->rot_offsets ? (const int32_t *)m->rot_offsets->d : nullptr;
    a.valid = m->block_valid ? (const int32_t *)m->block_valid->d : nullptr;
    a.inv_freq = m->inv_freq ? (const float *)m->inv_freq->d : nullptr;
    KVS_ASSERT(!a.rot || a.inv_freq);
    a.n_seqs = m->n_seqs;
    a.max_blocks = m->max_blocks;
    a.n_heads = n_heads;
    a.n_kv = n_kv_heads;
    a.hd = head_dim;
    a.bs = block_size;
    a.lg = lg;
    a.n_hchunks = n_hchunks;
    a.scale = scale;
    a.out = (float *)out->d;
    a.part = b->attn_ws;

    /* Split the context so that the grid has about attn_blocks_per_sm blocks per SM, with at
     * least 64 positions per split and the partials fitting the workspace. */
    long long base_blocks = (long long)n * n_kv_heads * n_hchunks;
    int max_ctx = m->max_ctx > 0 ? m->max_ctx : 1;
    int bps = b->attn_blocks_per_sm > 0 ? b->attn_blocks_per_sm : (base_blocks < b->n_sms ? 8 : 4);
    long long want = ((long long)bps * b->n_sms + base_blocks - 1) / base_blocks;
    long long by_len = (max_ctx + 63) / 64;
    long long by_ws = (long long)(ATTN_WS_BYTES / 4 / ((size_t)n * n_heads * (head_dim + 2)));
    long long ns = want;
    if (ns > by_len) ns = by_len;
    if (ns > by_ws) ns = by_ws;
    if (ns > 256) ns = 256;
    if (ns < 1) ns = 1;
    int chunk = (int)((max_ctx + ns - 1) / ns);
    chunk = (chunk + ATT_TP - 1) / ATT_TP * ATT_TP;
    a.chunk = chunk;
    a.n_splits = (max_ctx + chunk - 1) / chunk;

    dim3 grid((unsigned)n, (unsigned)(n_kv_heads * n_hchunks), (unsigned)a.n_splits);
    size_t smem = ((size_t)ng * GT * head_dim + 2 * (size_t)ng * GT) * sizeof(float);
    KVS_ASSERT(smem <= 96 * 1024);
    dim3 blk(ATT_WARPS * 32);
    if (b->attn_occ) {
        switch (GT) {
        case 1: if (a.rot) k_attention<1, 3, true><<<grid, blk, smem, b->stream>>>(a); else k_attention<1, 3, false><<<grid, blk, smem, b->stream>>>(a); break;
        case 2: if (a.rot) k_attention<2, 3, true><<<grid, blk, smem, b->stream>>>(a); else k_attention<2, 3, false><<<grid, blk, smem, b->stream>>>(a); break;
        case 4: if (a.rot) k_attention<4, 3, true><<<grid, blk, smem, b->stream>>>(a); else k_attention<4, 3, false><<<grid, blk, smem, b->stream>>>(a); break;
        default: if (a.rot) k_attention<8, 3, true><<<grid, blk, smem, b->stream>>>(a); else k_attention<8, 3, false><<<grid, blk, smem, b->stream>>>(a); break;
        }
    } else {
        switch (GT) {
        case 1: if (a.rot) k_attention<1, 1, true><<<grid, blk, smem, b->stream>>>(a); else k_attention<1, 1, false><<<grid, blk, smem, b->stream>>>(a); break;
        case 2: if (a.rot) k_attention<2, 1, true><<<grid, blk, smem, b->stream>>>(a); else k_attention<2, 1, false><<<grid, blk, smem, b->stream>>>(a); break;
        case 4: if (a.rot) k_attention<4, 1, true><<<grid, blk, smem, b->stream>>>(a); else k_attention<4, 1, false><<<grid, blk, smem, b->stream>>>(a); break;
        default: if (a.rot) k_attention<8, 1, true><<<grid, blk, smem, b->stream>>>(a); else k_attention<8, 1, false><<<grid, blk, smem, b->stream>>>(a); break;
        }
    }
    LAUNCH_CHECK();
    if (a.n_splits > 1) {
        k_attn_reduce<<<(unsigned)((size_t)n * n_heads), head_dim < 128 ? head_dim : 128, 0, b->stream>>>(
            a.part, a.n_splits, head_dim, a.out);
        LAUNCH_CHECK();
    }
}

static void cu_swiglu(struct kvs_backend *b, const struct kvs_dbuf *gate, const struct kvs_dbuf *up, int n, int ff,
                      struct kvs_dbuf *out)
{
    if (n <= 0) return;
    size_t nn = (size_t)n * ff;
    k_swiglu<<<grid_for(nn, 256), 256, 0, b->stream>>>((const float *)gate->d, (const float *)up->d, nn,
                                                        (float *)out->d);
    LAUNCH_CHECK();
}

static void cu_gather_rows(struct kvs_backend *b, const struct kvs_dbuf *x, const struct kvs_dbuf *rows, int m,
                           int dim, struct kvs_dbuf *out)
{
    if (m <= 0) return;
    k_gather_rows<<<m, 256, 0, b->stream>>>((const float *)x->d, (const int32_t *)rows->d, dim, (float *)out->d);
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
    if (buf->kind == KVS_BUF_KV)
        k_bf16_fill_random<<<grid_for(n, 256), 256, 0, b->stream>>>((bf16 *)buf->d + off, n, scale, seed);
    else
        k_f32_fill_random<<<grid_for(n, 256), 256, 0, b->stream>>>((float *)buf->d + off, n, scale, seed);
    LAUNCH_CHECK();
}

extern "C" void kvs_cuda_graph_begin(struct kvs_backend *b)
{
    CUDA_CHECK(cudaStreamBeginCapture(b->stream, cudaStreamCaptureModeThreadLocal));
}

extern "C" struct kvs_cuda_graph *kvs_cuda_graph_end(struct kvs_backend *b)
{
    struct kvs_cuda_graph *g = (struct kvs_cuda_graph *)kvs_xcalloc(1, sizeof *g);
    CUDA_CHECK(cudaStreamEndCapture(b->stream, &g->graph));
    CUDA_CHECK(cudaGraphInstantiate(&g->exec, g->graph, 0));
    return g;
}

extern "C" void kvs_cuda_graph_launch(struct kvs_backend *b, struct kvs_cuda_graph *g)
{
    CUDA_CHECK(cudaGraphLaunch(g->exec, b->stream));
}

extern "C" void kvs_cuda_graph_free(struct kvs_cuda_graph *g)
{
    if (!g) return;
    CUDA_CHECK(cudaGraphExecDestroy(g->exec));
    CUDA_CHECK(cudaGraphDestroy(g->graph));
    free(g);
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

extern "C" void kvs_cuda_set_attn_variant(struct kvs_backend *b, int high_occupancy, int blocks_per_sm)
{
    b->attn_occ = high_occupancy != 0;
    b->attn_blocks_per_sm = blocks_per_sm > 0 ? blocks_per_sm : 0;
}
