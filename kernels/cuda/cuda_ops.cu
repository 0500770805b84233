/* cuda_ops.cu: the small ops of the CUDA backend, each one kernel (or a copy): embedding,
 * RMSNorm (with the residual add, per head), RoPE, the K/V cache writes (alone and fused with
 * RoPE), SwiGLU, row gathers, block copies, the greedy argmax, and attention's entry into
 * cuda_attention.cu. Decode steps run them on one or a few rows, so they are latency bound:
 * every kernel is launched with programmatic dependent launch (cuda_launch.h) and waits for the
 * previous kernel's output only where it first reads it.
 */
#include "kernels/cuda/cuda_internal.cuh"

/* ---- kernels -------------------------------------------------------------------------------- */

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
                              float eps, int dim, float *__restrict__ out, bf16 *__restrict__ outh, int trig)
{
    grid_dep_wait(); /* cuda_launch.h: the previous kernel's output is ready */
    grid_dep_launch(trig); /* the next GEMM may start fetching its weights */
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
__global__ void k_rmsnorm(const float *x, const float *w, float eps, int dim, float *out, bf16 *outh, int trig)
{
    grid_dep_wait(); /* cuda_launch.h: the previous kernel's output is ready */
    grid_dep_launch(trig);
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
                              bf16 *outh, int trig)
{
    grid_dep_wait(); /* cuda_launch.h: the previous kernel's output is ready */
    grid_dep_launch(trig);
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
    const int trig = (kvs_cu_pdl_early() & 4) && n >= 2; /* cuda_skinny.cu: not at batch 1 */
    cudaError_t e;
    if (delta) {
        if (v == 1) e = kvs_cu_launch(k_rmsnorm_vec<1, true>, n, threads, 0, st, res, delta, w, eps, dim, out, outh, trig);
        else if (v == 2) e = kvs_cu_launch(k_rmsnorm_vec<2, true>, n, threads, 0, st, res, delta, w, eps, dim, out, outh, trig);
        else e = kvs_cu_launch(k_rmsnorm_vec<4, true>, n, threads, 0, st, res, delta, w, eps, dim, out, outh, trig);
    } else {
        if (v == 1) e = kvs_cu_launch(k_rmsnorm_vec<1, false>, n, threads, 0, st, res, delta, w, eps, dim, out, outh, trig);
        else if (v == 2) e = kvs_cu_launch(k_rmsnorm_vec<2, false>, n, threads, 0, st, res, delta, w, eps, dim, out, outh, trig);
        else e = kvs_cu_launch(k_rmsnorm_vec<4, false>, n, threads, 0, st, res, delta, w, eps, dim, out, outh, trig);
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
    grid_dep_launch(a.trig); /* the attention may start its block-table lookups */
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
__global__ void __launch_bounds__(ARGMAX_THREADS) k_argmax_rows(const float *logits, int vocab, int vec4, int32_t *out,
                                                                 float *vals)
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
    if (l == 0) {
        out[blockIdx.x] = bi >= 0 && bv == -INFINITY ? -1 : bi;
        if (vals) vals[blockIdx.x] = bv; /* argmax_rows_val: the winner's value */
    }
}

void kvs_cu_op_embed(struct kvs_backend *b, const struct kvs_dweight *emb, const struct kvs_dbuf *tokens, int n,
                     int dim, struct kvs_dbuf *out)
{
    if (n <= 0) return;
    KVS_ASSERT(!emb->is_vector && emb->cols == dim);
    xh_forget(b, out->d);
    CUDA_CHECK(kvs_cu_launch(k_embed, n, 256, 0, b->stream, emb->h, (const int32_t *)tokens->d, dim, (float *)out->d));
    LAUNCH_CHECK();
}

void kvs_cu_op_rmsnorm(struct kvs_backend *b, const struct kvs_dbuf *x, const struct kvs_dweight *w, float eps, int n,
                       int dim, struct kvs_dbuf *out)
{
    if (n <= 0) return;
    KVS_ASSERT(w->is_vector && w->cols == dim);
    bf16 *outh = xh_claim(b, out->d, (size_t)n * dim);
    /* the vectorised kernel reads x through its first (res) argument without writing it (no ADD) */
    if (!launch_rmsnorm_vec(b->stream, n, (float *)x->d, NULL, w->f, eps, dim, (float *)out->d, outh))
        CUDA_CHECK(kvs_cu_launch(k_rmsnorm, n, NORM_THREADS, 0, b->stream, (const float *)x->d, w->f, eps, dim, (float *)out->d, outh,
                                 (kvs_cu_pdl_early() & 4) && n >= 2));
    LAUNCH_CHECK();
}

void kvs_cu_op_add_rmsnorm(struct kvs_backend *b, struct kvs_dbuf *res, const struct kvs_dbuf *delta,
                           const struct kvs_dweight *w, float eps, int n, int dim, struct kvs_dbuf *out)
{
    if (n <= 0) return;
    KVS_ASSERT(w->is_vector && w->cols == dim);
    xh_forget(b, res->d);
    bf16 *outh = xh_claim(b, out->d, (size_t)n * dim);
    if (!launch_rmsnorm_vec(b->stream, n, (float *)res->d, (const float *)delta->d, w->f, eps, dim, (float *)out->d, outh))
        CUDA_CHECK(kvs_cu_launch(k_add_rmsnorm, n, NORM_THREADS, 0, b->stream, (float *)res->d, (const float *)delta->d, w->f,
                                 eps, dim, (float *)out->d, outh, (kvs_cu_pdl_early() & 4) && n >= 2));
    LAUNCH_CHECK();
}

void kvs_cu_op_head_rmsnorm(struct kvs_backend *b, struct kvs_dbuf *x, const struct kvs_dweight *w, float eps, int n,
                            int n_heads, int head_dim)
{
    if (n <= 0) return;
    KVS_ASSERT(w->is_vector && w->cols == head_dim);
    size_t rh = (size_t)n * n_heads;
    xh_forget(b, x->d);
    CUDA_CHECK(kvs_cu_launch(k_head_rmsnorm, (unsigned)((rh + 7) / 8), 256, 0, b->stream, (float *)x->d, w->f, eps, rh, head_dim));
    LAUNCH_CHECK();
}

void kvs_cu_op_rope(struct kvs_backend *b, struct kvs_dbuf *x, const struct kvs_dbuf *pos, const struct kvs_dbuf *rot,
                    const struct kvs_dbuf *inv_freq, int n, int n_heads, int head_dim)
{
    if (n <= 0) return;
    xh_forget(b, x->d);
    CUDA_CHECK(kvs_cu_launch(k_rope, n, 256, 0, b->stream, (float *)x->d, (const int32_t *)pos->d, rot ? (const int32_t *)rot->d : nullptr,
                                     (const float *)inv_freq->d, n_heads, head_dim));
    LAUNCH_CHECK();
}

void kvs_cu_op_kv_write(struct kvs_backend *b, const struct kvs_dbuf *k, const struct kvs_dbuf *v,
                        const struct kvs_dbuf *slots, int n, int n_kv_heads, int head_dim, int block_size,
                        struct kvs_dbuf *kc, struct kvs_dbuf *vc)
{
    if (n <= 0) return;
    CUDA_CHECK(kvs_cu_launch(k_kv_write, n, 256, 0, b->stream, (const float *)k->d, (const float *)v->d, (const int32_t *)slots->d,
                                         n_kv_heads, head_dim, block_size, (bf16 *)kc->d, (bf16 *)vc->d));
    LAUNCH_CHECK();
}

void kvs_cu_launch_rope_kv_write(struct kvs_backend *b, struct rkv_args *a, int n)
{
    const int units = a->nh + 2 * a->nkv;
    const dim3 grid((unsigned)n, (unsigned)((units + RKV_HEADS - 1) / RKV_HEADS));
    a->trig = (kvs_cu_pdl_early() & 4) && n >= 2;
    CUDA_CHECK(kvs_cu_launch(k_rope_kv_write, grid, 256, (size_t)a->hd * sizeof(float), b->stream, *a));
    LAUNCH_CHECK();
}

void kvs_cu_rkv_common(struct rkv_args *a, const struct kvs_dbuf *pos, const struct kvs_dbuf *inv_freq,
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

void kvs_cu_op_rope_kv_write(struct kvs_backend *b, struct kvs_dbuf *q, struct kvs_dbuf *k, const struct kvs_dbuf *v,
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
    kvs_cu_rkv_common(&a, pos, inv_freq, slots, n_heads, n_kv_heads, head_dim, block_size, kc, vc);
    kvs_cu_launch_rope_kv_write(b, &a, n);
}
void kvs_cu_op_attention(struct kvs_backend *b, const struct kvs_dbuf *q, const struct kvs_dbuf *kc,
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
    a.skip_lead = m->skip_lead;
    a.batch_invariant = b->batch_invariant;
    a.scale = scale;
    a.out = (float *)out->d;
    /* the o projection reads the bf16 copy, which the attention writes as it goes */
    a.outh = xh_claim(b, out->d, (size_t)n * n_heads * head_dim);
    kvs_cu_attention(&a, b->stream, b->n_sms, b->attn_ws, ATTN_WS_BYTES, b->attn_splits, b->dec_attn);
}

void kvs_cu_op_swiglu(struct kvs_backend *b, const struct kvs_dbuf *gate, const struct kvs_dbuf *up, int n, int ff,
                      struct kvs_dbuf *out)
{
    if (n <= 0) return;
    size_t nn = (size_t)n * ff;
    bf16 *outh = xh_claim(b, out->d, nn);
    CUDA_CHECK(kvs_cu_launch(k_swiglu, grid_for(nn, 256), 256, 0, b->stream, (const float *)gate->d, (const float *)up->d, nn,
                                                        (float *)out->d, outh));
    LAUNCH_CHECK();
}

void kvs_cu_op_gather_rows(struct kvs_backend *b, const struct kvs_dbuf *x, const struct kvs_dbuf *rows, int m,
                           int dim, struct kvs_dbuf *out)
{
    if (m <= 0) return;
    xh_forget(b, out->d);
    CUDA_CHECK(kvs_cu_launch(k_gather_rows, m, 256, 0, b->stream, (const float *)x->d, (const int32_t *)rows->d, dim, (float *)out->d));
    LAUNCH_CHECK();
}

void kvs_cu_op_kv_copy_block(struct kvs_backend *b, struct kvs_dbuf *kc, struct kvs_dbuf *vc, int src, int dst,
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

/* backend.h ids_to_tokens: the previous step's greedy picks become this step's tokens */
__global__ void k_ids_to_tokens(const int32_t *ids, const int32_t *pairs, int n, int32_t *tokens)
{
    grid_dep_wait(); /* cuda_launch.h: the ids are the previous kernels' output */
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int32_t v = ids[pairs[2 * i + 1]];
    tokens[pairs[2 * i]] = v < 0 ? 0 : v;
}

void kvs_cu_op_ids_to_tokens(struct kvs_backend *b, const struct kvs_dbuf *ids, const struct kvs_dbuf *pairs, int n,
                             struct kvs_dbuf *tokens)
{
    if (n <= 0) return;
    KVS_ASSERT(ids->kind == KVS_BUF_I32 && pairs->kind == KVS_BUF_I32 && tokens->kind == KVS_BUF_I32);
    KVS_ASSERT((size_t)n * 2 <= pairs->n);
    CUDA_CHECK(kvs_cu_launch(k_ids_to_tokens, (n + 255) / 256, 256, 0, b->stream, (const int32_t *)ids->d,
                             (const int32_t *)pairs->d, n, (int32_t *)tokens->d));
    LAUNCH_CHECK();
}

void kvs_cu_op_argmax_rows(struct kvs_backend *b, const struct kvs_dbuf *logits, int m, int vocab,
                           struct kvs_dbuf *out, size_t out_off)
{
    if (m <= 0) return;
    KVS_ASSERT(logits->kind != KVS_BUF_KV && out->kind == KVS_BUF_I32);
    KVS_ASSERT((size_t)m * vocab <= logits->n && out_off + (size_t)m <= out->n);
    int vec4 = vocab % 4 == 0 && ((uintptr_t)logits->d & 15) == 0;
    xh_forget(b, out->d);
    CUDA_CHECK(kvs_cu_launch(k_argmax_rows, m, ARGMAX_THREADS, 0, b->stream, (const float *)logits->d, vocab, vec4,
                             (int32_t *)out->d + out_off, (float *)nullptr));
    LAUNCH_CHECK();
}

/* argmax_rows plus each winner's value (a vocabulary-split LM head merges the ranks' picks) */
void kvs_cu_op_argmax_rows_val(struct kvs_backend *b, const struct kvs_dbuf *logits, int m, int vocab,
                               struct kvs_dbuf *out, struct kvs_dbuf *vals, size_t out_off)
{
    if (m <= 0) return;
    KVS_ASSERT(logits->kind != KVS_BUF_KV && out->kind == KVS_BUF_I32 && vals->kind == KVS_BUF_F32);
    KVS_ASSERT((size_t)m * vocab <= logits->n && out_off + (size_t)m <= out->n && out_off + (size_t)m <= vals->n);
    int vec4 = vocab % 4 == 0 && ((uintptr_t)logits->d & 15) == 0;
    xh_forget(b, out->d);
    xh_forget(b, vals->d);
    CUDA_CHECK(kvs_cu_launch(k_argmax_rows, m, ARGMAX_THREADS, 0, b->stream, (const float *)logits->d, vocab, vec4,
                             (int32_t *)out->d + out_off, (float *)vals->d + out_off));
    LAUNCH_CHECK();
}

