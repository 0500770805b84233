/* kv_lean.cu: the CUDA backend's LeanKV kernels (kernels/kv_lean.h): the quantized page write
 * and attention over quantized pages (the static modes of kv.storage = lean).
 *
 * write: one warp per (row, KV head). The warp reduces min / max of the vector, derives fp16 z
 * and s exactly as the host quantizer does (kernels/kv_lean_format.c: same IEEE operations, in
 * the same order, with no contraction), so the codes are bitwise the CPU reference's; the codes
 * go through shared memory and are packed a byte per lane.
 *
 * attention: one block of 4 warps per (query row, KV head); the G query heads of the group
 * share every K/V byte read. Warp w takes the selected positions p with p % 4 == w (spans
 * clipped to the row: causal; slots past a block's valid count skipped); lane l holds elements
 * [l E, l E + E) of a vector (E = head_dim / 32): it dequantizes its K elements
 * (x^ = s * code - z, rounded as the host does), each group head's dot product is a warp
 * all-reduce, the online softmax (fp32) keeps a max, a sum and E accumulators per head in
 * registers. Deferred RoPE: q is rotated backward by a block's offset (kvs_cpu_rotate_back's
 * formula) into the warp's shared copy when the offset changes. The four warps' partials are
 * merged in shared memory; out = acc / sum, lse = max + ln(sum) (no key: 0 and -inf).
 * Straightforward rather than tuned: bytes read are what shrink, the arithmetic is not.
 *
 * Shapes: head_dim a multiple of 32 up to 256, G <= 16 and G * head_dim <= 2048 (else the
 * launch aborts with a message: the storage refuses such models first via supports()), and the
 * 16-bit formats (K16V16) are refused: their pages did not match the CPU reference in the GPU test.
 * Ownership: the caller's buffers. Errors: CUDA failures abort (CUDA_CHECK). */
#include "kernels/cuda/cuda_internal.cuh"

extern "C" {
#include "kernels/kv_lean.h"
}

#define LEAN_WARPS 4
#define LEAN_FULL 0xffffffffu
#define LEAN_MAXG 16

__device__ __forceinline__ float lean_sat_half(float x) { return fminf(fmaxf(x, -65504.0f), 65504.0f); }

__device__ __forceinline__ uint16_t lean_half_ceil(float x)
{
    if (x > 65504.0f) return 0x7bff;
    uint16_t u = __half_as_ushort(__float2half_rn(x));
    if (__half2float(__ushort_as_half(u)) < x) u++;
    return u;
}

__device__ __forceinline__ float lean_h2f(uint16_t u) { return __half2float(__ushort_as_half(u)); }

/* page addressing (kernels/kv_lean.h): K codes [bs][kc], V codes [bs][vc], K (s, z) [bs][4 bytes]
 * below 16 bits, V (s, z) likewise */
struct lean_geom {
    int kbits, vbits, hd, bs, n_kv;
    int kc, vc;                   /* code bytes of a vector */
    long long page;               /* bytes of a page */
};

static lean_geom make_geom(struct kvs_lean_fmt f, int hd, int bs, int n_kv)
{
    lean_geom g;
    g.kbits = f.kbits, g.vbits = f.vbits, g.hd = hd, g.bs = bs, g.n_kv = n_kv;
    g.kc = hd * f.kbits / 8, g.vc = hd * f.vbits / 8;
    g.page = (long long)kvs_lean_page_bytes(f, hd, bs);
    return g;
}

__device__ __forceinline__ void lean_token(const lean_geom &g, uint8_t *pool, int block, int kvh, int off, uint8_t **k,
                                           uint8_t **v, uint8_t **ksz, uint8_t **vsz)
{
    uint8_t *page = pool + ((long long)block * g.n_kv + kvh) * g.page;
    uint8_t *meta = page + (long long)g.bs * (g.kc + g.vc);
    *k = page + (long long)off * g.kc;
    *v = page + (long long)g.bs * g.kc + (long long)off * g.vc;
    *ksz = *vsz = NULL;
    if (g.kbits < 16) {
        *ksz = meta + off * 4;
        meta += g.bs * 4;
    }
    if (g.vbits < 16) *vsz = meta + off * 4;
}

/* element i of a vector at `bits` (s, z already decoded), as the host dequantizes it */
__device__ __forceinline__ float lean_elem(const uint8_t *codes, int i, int bits, float s, float z)
{
    if (bits == 16) return lean_h2f((uint16_t)(codes[2 * i] | codes[2 * i + 1] << 8));
    const int per = 8 / bits;
    const int q = codes[i / per] >> (bits * (i % per)) & ((1 << bits) - 1);
    return __fsub_rn(__fmul_rn(s, (float)q), z);
}

__device__ __forceinline__ void lean_sz(const uint8_t *p, float *s, float *z)
{
    if (!p) {
        *s = *z = 0.0f;
        return;
    }
    *s = lean_h2f((uint16_t)(p[0] | p[1] << 8));
    *z = lean_h2f((uint16_t)(p[2] | p[3] << 8));
}

/* ---- write ---------------------------------------------------------------------------------- */

/* quantizes x (hd floats, lane-strided reads) to bits into codes / sz, as kvs_lean_quantize */
__device__ void lean_quantize_warp(const float *x, int hd, int bits, uint8_t *codes, uint8_t *sz, uint8_t *stage)
{
    const int lane = threadIdx.x & 31;
    if (bits == 16) {
        for (int i = lane; i < hd; i += 32) {
            const uint16_t h = __half_as_ushort(__float2half_rn(lean_sat_half(x[i])));
            codes[2 * i] = (uint8_t)h, codes[2 * i + 1] = (uint8_t)(h >> 8);
        }
        return;
    }
    float mn = INFINITY, mx = -INFINITY;
    for (int i = lane; i < hd; i += 32) mn = fminf(mn, x[i]), mx = fmaxf(mx, x[i]);
    for (int o = 16; o > 0; o >>= 1) {
        mn = fminf(mn, __shfl_xor_sync(LEAN_FULL, mn, o));
        mx = fmaxf(mx, __shfl_xor_sync(LEAN_FULL, mx, o));
    }
    const int top = (1 << bits) - 1;
    const uint16_t zh = __half_as_ushort(__float2half_rn(lean_sat_half(-mn)));
    const float z = lean_h2f(zh);
    const float lo = __fadd_rn(mn, z), hi = __fadd_rn(mx, z);
    float need = __fdiv_rn(hi, (float)top);
    if (__fmul_rn(-2.0f, lo) > need) need = __fmul_rn(-2.0f, lo);
    if (need < 5.9604645e-08f) need = 5.9604645e-08f;
    const uint16_t sh = lean_half_ceil(need);
    const float s = lean_h2f(sh);
    for (int i = lane; i < hd; i += 32) {
        const float c = floorf(__fadd_rn(__fdiv_rn(__fadd_rn(x[i], z), s), 0.5f));
        stage[i] = (uint8_t)(c < 0.0f ? 0 : c > (float)top ? top : (int)c);
    }
    __syncwarp();
    const int per = 8 / bits, nb = hd * bits / 8;
    for (int b = lane; b < nb; b += 32) {
        unsigned byte = 0;
        for (int j = 0; j < per; j++) byte |= (unsigned)stage[b * per + j] << (bits * j);
        codes[b] = (uint8_t)byte;
    }
    if (lane == 0) {
        sz[0] = (uint8_t)sh, sz[1] = (uint8_t)(sh >> 8), sz[2] = (uint8_t)zh, sz[3] = (uint8_t)(zh >> 8);
    }
    __syncwarp();
}

__global__ void k_lean_write(lean_geom g, int n, const float *k, const float *v, const int32_t *slots, uint8_t *pool)
{
    extern __shared__ uint8_t lean_stage[];   /* [hd] per warp */
    const int warp = threadIdx.x >> 5;
    const int task = blockIdx.x * (blockDim.x >> 5) + warp;
    const int t = task / g.n_kv, h = task % g.n_kv;
    if (t >= n) return;   /* whole warps leave together */
    const int32_t slot = slots[t];
    if (slot < 0) return;
    uint8_t *kc, *vc, *ksz, *vsz;
    lean_token(g, pool, slot / g.bs, h, slot % g.bs, &kc, &vc, &ksz, &vsz);
    const long long row = ((long long)t * g.n_kv + h) * g.hd;
    uint8_t *stage = lean_stage + warp * g.hd;
    lean_quantize_warp(k + row, g.hd, g.kbits, kc, ksz, stage);
    lean_quantize_warp(v + row, g.hd, g.vbits, vc, vsz, stage);
}

static void cu_lean_write(struct kvs_backend *b, struct kvs_lean_fmt f, const struct kvs_dbuf *k, const struct kvs_dbuf *v,
                          const struct kvs_dbuf *slots, int n, int n_kv_heads, int head_dim, int block_size,
                          struct kvs_dbuf *pool)
{
    if (n <= 0) return;
    const lean_geom g = make_geom(f, head_dim, block_size, n_kv_heads);
    const int warps = 4, tasks = n * n_kv_heads;
    k_lean_write<<<(tasks + warps - 1) / warps, warps * 32, warps * head_dim, b->stream>>>(g, n, (const float *)k->d,
                                                                                         (const float *)v->d,
                                                                    (const int32_t *)slots->d, (uint8_t *)pool->d);
    LAUNCH_CHECK();
}

/* ---- attention ------------------------------------------------------------------------------ */

struct lean_attn_args {
    lean_geom g;
    const float *q, *inv_freq;
    const uint8_t *pool;
    float *out, *lse;             /* lse may be NULL */
    const int32_t *q_start, *pos, *bt, *rot, *valid, *n_spans, *spans; /* spans NULL: [0, ctx) */
    int n_seqs, max_blocks, max_spans, n_heads, G;
    float scale;
};

template <int E, int MG>
__global__ void __launch_bounds__(LEAN_WARPS * 32) k_lean_attn(const __grid_constant__ lean_attn_args a)
{
    extern __shared__ float lean_sm[];   /* [LEAN_WARPS][G][hd] q (rotated), then the partials */
    const lean_geom &g = a.g;
    const int hd = g.hd, G = a.G, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int row = blockIdx.x / g.n_kv, kvh = blockIdx.x % g.n_kv;
    int s = 0;
    {
        int lo = 0, hi = a.n_seqs - 1;
        while (lo < hi) {
            const int mid = (lo + hi + 1) >> 1;
            if (a.q_start[mid] <= row) lo = mid; else hi = mid - 1;
        }
        s = lo;
    }
    const int ctx = a.pos[s] + (row - a.q_start[s]) + 1;
    const int32_t *bt = a.bt + (long long)s * a.max_blocks;
    const int32_t *rot = a.rot ? a.rot + (long long)s * a.max_blocks : NULL;
    const int32_t *valid = a.valid ? a.valid + (long long)s * a.max_blocks : NULL;
    int ns = 1;
    const int32_t *sp = NULL;
    if (a.spans) {
        const long long sl = (long long)row * g.n_kv + kvh;
        ns = a.n_spans[sl];
        sp = a.spans + sl * a.max_spans * 2;
    }
    float *qs = lean_sm + (long long)warp * G * hd;
    const float *q0 = a.q + ((long long)row * a.n_heads + (long long)kvh * G) * hd;
    for (int i = lane; i < G * hd; i += 32) qs[i] = q0[i];
    __syncwarp();
    int cur_rot = 0;

    float m[MG], l[MG], acc[MG][E];
#pragma unroll
    for (int h = 0; h < MG; h++) {
        m[h] = -INFINITY, l[h] = 0.0f;
#pragma unroll
        for (int e = 0; e < E; e++) acc[h][e] = 0.0f;
    }
    for (int j = 0; j < ns; j++) {
        const int p0 = sp ? max(sp[2 * j], 0) : 0, p1 = sp ? min(sp[2 * j + 1], ctx) : ctx;
        /* this warp's positions: p % LEAN_WARPS == warp */
        for (int p = p0 + ((warp - p0 % LEAN_WARPS) + LEAN_WARPS) % LEAN_WARPS; p < p1; p += LEAN_WARPS) {
            const int bi = p / g.bs, off = p - bi * g.bs;
            if (valid && off >= valid[bi]) continue;
            const int r = rot ? rot[bi] : 0;
            if (r != cur_rot) {
                /* q rotated backward by r (kvs_cpu_rotate_back) into the warp's copy */
                __syncwarp();
                const int half = hd / 2;
                for (int idx = lane; idx < G * half; idx += 32) {
                    const int h = idx / half, i = idx % half;
                    const float ang = (float)r * a.inv_freq[i];
                    float sn, cs;
                    sincosf(ang, &sn, &cs);
                    const float x = q0[h * hd + i], y = q0[h * hd + i + half];
                    qs[h * hd + i] = x * cs + y * sn;
                    qs[h * hd + i + half] = -x * sn + y * cs;
                }
                __syncwarp();
                cur_rot = r;
            }
            uint8_t *kcp, *vcp, *ksz, *vsz;
            lean_token(g, (uint8_t *)a.pool, bt[bi], kvh, off, &kcp, &vcp, &ksz, &vsz);
            float ks, kz, vs, vz, kx[E], vx[E];
            lean_sz(ksz, &ks, &kz);
            lean_sz(vsz, &vs, &vz);
#pragma unroll
            for (int e = 0; e < E; e++) {
                kx[e] = lean_elem(kcp, lane * E + e, g.kbits, ks, kz);
                vx[e] = lean_elem(vcp, lane * E + e, g.vbits, vs, vz);
            }
#pragma unroll
            for (int h = 0; h < MG; h++) {
                if (h >= G) break;
                float d = 0.0f;
#pragma unroll
                for (int e = 0; e < E; e++) d += qs[h * hd + lane * E + e] * kx[e];
                for (int o = 16; o > 0; o >>= 1) d += __shfl_xor_sync(LEAN_FULL, d, o);
                const float sc = d * a.scale;
                if (sc > m[h]) {
                    const float corr = __expf(m[h] - sc);
                    l[h] *= corr;
#pragma unroll
                    for (int e = 0; e < E; e++) acc[h][e] *= corr;
                    m[h] = sc;
                }
                const float w = __expf(sc - m[h]);
                l[h] += w;
#pragma unroll
                for (int e = 0; e < E; e++) acc[h][e] += w * vx[e];
            }
        }
    }
    /* merge the warps: partials to shared memory (over the q copies) */
    __syncthreads();
    float *pacc = lean_sm;                                     /* [LEAN_WARPS][G][hd] */
    float *pml = lean_sm + (long long)LEAN_WARPS * G * hd;     /* [LEAN_WARPS][G][2] */
#pragma unroll
    for (int h = 0; h < MG; h++) {
        if (h >= G) break;
#pragma unroll
        for (int e = 0; e < E; e++) pacc[((long long)warp * G + h) * hd + lane * E + e] = acc[h][e];
        if (lane == 0) pml[(warp * G + h) * 2] = m[h], pml[(warp * G + h) * 2 + 1] = l[h];
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < G * hd; idx += blockDim.x) {
        const int h = idx / hd, i = idx % hd;
        float M = -INFINITY;
        for (int w = 0; w < LEAN_WARPS; w++) M = fmaxf(M, pml[(w * G + h) * 2]);
        float L = 0.0f, o = 0.0f;
        if (M != -INFINITY)
            for (int w = 0; w < LEAN_WARPS; w++) {
                const float mw = pml[(w * G + h) * 2];
                if (mw == -INFINITY) continue;
                const float c = __expf(mw - M);
                L += pml[(w * G + h) * 2 + 1] * c;
                o += pacc[((long long)w * G + h) * hd + i] * c;
            }
        const long long orow = (long long)row * a.n_heads + (long long)kvh * G + h;
        a.out[orow * hd + i] = L > 0.0f ? o / L : 0.0f;
        if (a.lse && i == 0) a.lse[orow] = L > 0.0f ? M + logf(L) : -INFINITY;
    }
}

template <int MG>
static void launch_e(const lean_attn_args &a, int n, cudaStream_t st)
{
    const int hd = a.g.hd;
    const size_t smem = ((size_t)LEAN_WARPS * a.G * hd + (size_t)LEAN_WARPS * a.G * 2) * sizeof(float);
    const dim3 grid(n * a.g.n_kv), block(LEAN_WARPS * 32);
    switch (hd / 32) {
    case 1: k_lean_attn<1, MG><<<grid, block, smem, st>>>(a); break;
    case 2: k_lean_attn<2, MG><<<grid, block, smem, st>>>(a); break;
    case 4: k_lean_attn<4, MG><<<grid, block, smem, st>>>(a); break;
    case 8: k_lean_attn<8, MG><<<grid, block, smem, st>>>(a); break;
    default: kvs_panic(__FILE__, __LINE__, "lean attention: head_dim %d not 32, 64, 128 or 256", hd);
    }
    LAUNCH_CHECK();
}

static void run_attn(struct kvs_backend *b, struct kvs_lean_fmt f, const struct kvs_dbuf *q, const struct kvs_dbuf *pool,
                     const struct kvs_attn_meta *m, const struct kvs_span_list *sp, int n, int n_heads, int n_kv_heads,
                     int head_dim, int block_size, float scale, struct kvs_dbuf *out, struct kvs_dbuf *lse)
{
    if (n <= 0) return;
    const int G = n_heads / n_kv_heads;
    if (G > LEAN_MAXG || G * head_dim > 2048 || head_dim % 32)
        kvs_panic(__FILE__, __LINE__, "lean attention: group %d x head_dim %d not supported", G, head_dim);
    lean_attn_args a;
    a.g = make_geom(f, head_dim, block_size, n_kv_heads);
    a.q = (const float *)q->d;
    a.inv_freq = m->inv_freq ? (const float *)m->inv_freq->d : NULL;
    a.pool = (const uint8_t *)pool->d;
    a.out = (float *)out->d;
    a.lse = lse ? (float *)lse->d : NULL;
    a.q_start = (const int32_t *)m->q_start->d;
    a.pos = (const int32_t *)m->pos->d;
    a.bt = (const int32_t *)m->block_tables->d;
    a.rot = m->rot_offsets ? (const int32_t *)m->rot_offsets->d : NULL;
    a.valid = m->block_valid ? (const int32_t *)m->block_valid->d : NULL;
    a.n_spans = sp ? (const int32_t *)sp->n_spans->d : NULL;
    a.spans = sp ? (const int32_t *)sp->spans->d : NULL;
    a.n_seqs = m->n_seqs, a.max_blocks = m->max_blocks, a.max_spans = sp ? sp->max_spans : 0;
    a.n_heads = n_heads, a.G = G, a.scale = scale;
    if (G <= 1) launch_e<1>(a, n, b->stream);
    else if (G <= 4) launch_e<4>(a, n, b->stream);
    else if (G <= 8) launch_e<8>(a, n, b->stream);
    else launch_e<16>(a, n, b->stream);
}

static void cu_lean_attention_spans(struct kvs_backend *b, struct kvs_lean_fmt f, const struct kvs_dbuf *q,
                                    const struct kvs_dbuf *pool, const struct kvs_attn_meta *m,
                                    const struct kvs_span_list *sp, int n, int n_heads, int n_kv_heads, int head_dim,
                                    int block_size, float scale, struct kvs_dbuf *out, struct kvs_dbuf *lse)
{
    run_attn(b, f, q, pool, m, sp, n, n_heads, n_kv_heads, head_dim, block_size, scale, out, lse);
}

static void cu_lean_attention(struct kvs_backend *b, struct kvs_lean_fmt f, const struct kvs_dbuf *q,
                              const struct kvs_dbuf *pool, const struct kvs_attn_meta *m, int n, int n_heads,
                              int n_kv_heads, int head_dim, int block_size, float scale, struct kvs_dbuf *out)
{
    run_attn(b, f, q, pool, m, NULL, n, n_heads, n_kv_heads, head_dim, block_size, scale, out, NULL);
}

/* ---- pages ---------------------------------------------------------------------------------- */

static struct kvs_dbuf *cu_lean_alloc_pages(struct kvs_backend *b, size_t n)
{
    return kvs_cuda_backend.alloc(b, KVS_BUF_I32, (n + 3) / 4);
}

static void cu_lean_copy_block(struct kvs_backend *b, struct kvs_dbuf *pool, int src, int dst, size_t block_bytes)
{
    if (src == dst) return;
    uint8_t *p = (uint8_t *)pool->d;
    CUDA_CHECK(cudaMemcpyAsync(p + (size_t)dst * block_bytes, p + (size_t)src * block_bytes, block_bytes,
                               cudaMemcpyDeviceToDevice, b->stream));
}

/* 16-bit formats are refused: their pages did not match the CPU reference's in the GPU test
 * (tests/gpu/test_cuda_kv_lean.c, bench/RESULTS.md), a bug not found yet; the quantized ones do */
static int cu_lean_supports(struct kvs_lean_fmt f, int n_heads, int n_kv_heads, int head_dim)
{
    const int G = n_kv_heads > 0 ? n_heads / n_kv_heads : 0;
    return f.kbits < 16 && f.vbits < 16 && head_dim % 32 == 0 && head_dim <= 256 && G >= 1 && G <= LEAN_MAXG && G * head_dim <= 2048;
}

extern "C" const struct kvs_lean_kernels kvs_lean_kernels_cuda = {
    cu_lean_alloc_pages, cu_lean_write, cu_lean_attention_spans, cu_lean_attention, cu_lean_copy_block,
    cu_lean_supports,
};
