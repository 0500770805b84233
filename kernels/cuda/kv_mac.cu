/* kv_mac.cu: MAC-Attention's kernels on the CUDA backend (kernels/kv_mac.h; the CPU reference
 * is kernels/cpu/kv_mac.c and tests/gpu/test_cuda_kv_mac.c compares the two).
 *
 *   k_mac_match    one block per (row, q head), a thread per ring entry: bf16 entry loads (16
 *                  bytes at a time), the query rounded to bf16 alike, fp32 sums; the block's
 *                  minimum with ties to the lower entry.
 *   k_mac_span     one block per (row, KV head, split): the group's q heads read each key and
 *                  value once over the union of their spans [min s, end) (the paper's KV-group
 *                  CTA), each head keeping its own online softmax for A = [s_h, split_h) and
 *                  B = [split_h, m] (a head skips positions before its own s_h). Splits cut the
 *                  union span so that small batches still fill the GPU; 4 warps split a block's
 *                  range in contiguous parts. Deferred-RoPE blocks (rot_offsets) rotate the
 *                  group's queries backward when the offset changes; padding slots are skipped.
 *   k_mac_combine  one block per (row, q head), a thread per dimension: cached (o, lse) merged
 *                  with the A partials (the rectified summary), stored in the ring for F_APPEND
 *                  rows, then merged with the B partials into out / lse (attn_merge's formula).
 * Head shapes: head_dim 64 or 128, 1, 2, 4 or 8 q heads per KV head (others: -ENOSYS).
 * Launched on the backend's stream, in order with its ops. Uses only the backend's structs
 * (cuda_internal.cuh), no function of its objects: the KV registry reaches this table from
 * programs that link no backend (kernels/kv_mac_pick.c).
 */
#include <errno.h>

#include "kernels/cuda/cuda_internal.cuh"
#include "kernels/cuda/kv_mac_cuda.h"
#include "kernels/kv_mac.h"

#define MATCH_THREADS 256
#define SPAN_WARPS 4
#define MAX_SPLITS 32
#define MIN_SPLIT_POS 256     /* positions a split should have before another one pays */

/* One block per (row, q head), a thread per ring entry (MATCH_THREADS entries at a time): each
 * thread sums its entry's squared distance over 16-byte loads (8 bf16 each, all in flight at
 * once), the query is read from shared memory; then the block's minimum, ties to the lower
 * entry. */
template <int HD>
__global__ void __launch_bounds__(MATCH_THREADS) k_mac_match(const float *__restrict__ q_pre, const bf16 *__restrict__ ring_q,
                                                            const int32_t *__restrict__ tags, const int32_t *__restrict__ rows,
                                                            int32_t *__restrict__ p_out, int nh, int K, int layer,
                                                            int n_layers, float thresh2)
{
    const int t = blockIdx.x, h = blockIdx.y;
    __shared__ float s_q[HD];
    __shared__ float s_d[MATCH_THREADS / 32];
    __shared__ int s_j[MATCH_THREADS / 32];
    const int32_t *row = rows + (size_t)t * 4;
    const int flags = row[3], slot = row[1], m = row[2];
    if (!(flags & KVS_MAC_F_MATCH) || slot < 0) {
        if (threadIdx.x == 0) p_out[(size_t)t * nh + h] = -1;
        return;
    }
    const float *qh = q_pre + ((size_t)t * nh + h) * HD;
    for (int i = threadIdx.x; i < HD; i += MATCH_THREADS) s_q[i] = __bfloat162float(__float2bfloat16(qh[i]));
    __syncthreads();
    const size_t base = ((size_t)slot * n_layers + layer) * K;
    float best = INFINITY;
    int bj = -1;
    for (int j = threadIdx.x; j < K; j += MATCH_THREADS) {   /* j grows: strict < keeps the lower */
        const int tag = tags[base + j];
        if (tag <= 0 || tag - 1 >= m) continue;   /* empty, or not older than m */
        const uint4 *en = (const uint4 *)(ring_q + ((base + j) * nh + h) * HD);
        float s = 0.0f;
#pragma unroll
        for (int half = 0; half < 2; half++) {   /* half the row a batch of loads: fewer registers */
            uint4 v[HD / 16];
#pragma unroll
            for (int c = 0; c < HD / 16; c++) v[c] = en[half * (HD / 16) + c];
#pragma unroll
            for (int c = 0; c < HD / 16; c++) {
                const bf16 *b8 = (const bf16 *)&v[c];
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    const float d = s_q[(half * (HD / 16) + c) * 8 + i] - __bfloat162float(b8[i]);
                    s += d * d;
                }
            }
        }
        if (s < best) best = s, bj = j;
    }
    /* warp minimum, then the block's: the lower entry among equal distances */
    for (int o = 16; o > 0; o >>= 1) {
        const float ob = __shfl_xor_sync(0xffffffffu, best, o);
        const int oj = __shfl_xor_sync(0xffffffffu, bj, o);
        if (oj >= 0 && (bj < 0 || ob < best || (ob == best && oj < bj))) best = ob, bj = oj;
    }
    if (threadIdx.x % 32 == 0) s_d[threadIdx.x / 32] = best, s_j[threadIdx.x / 32] = bj;
    __syncthreads();
    if (threadIdx.x == 0) {
        float b = INFINITY;
        int j = -1;
        for (int w = 0; w < MATCH_THREADS / 32; w++)
            if (s_j[w] >= 0 && (j < 0 || s_d[w] < b || (s_d[w] == b && s_j[w] < j))) b = s_d[w], j = s_j[w];
        p_out[(size_t)t * nh + h] = j >= 0 && b < thresh2 ? tags[base + j] - 1 : -1;
    }
}

struct span_args {
    const float *q;
    const bf16 *kc, *vc;
    const int32_t *rows, *p, *bt, *rot, *valid;
    const float *inv_freq;
    float *work;
    int max_blocks, nh, nkv, bs, band, Z;
    float scale;
};

/* the part ranges of head h of a row: [s, split) is A, [split, end) is B */
static __device__ __forceinline__ void head_range(int p, int m, int band, int mac, int *s, int *split, int *end)
{
    *s = p >= 0 ? max(p - band + 1, 0) : 0;
    *split = max(*s, m - band + 1);
    *end = mac ? m + 1 : *split;
}

/* one key of the online softmax: score sc, value v (this lane's E elements) */
template <int E>
static __device__ __forceinline__ void online(float &mx, float &l, float (&acc)[E], float sc, const float (&v)[E])
{
    if (sc > mx) {
        const float corr = __expf(mx - sc);   /* exp(-inf) = 0 on the first key */
        l *= corr;
#pragma unroll
        for (int e = 0; e < E; e++) acc[e] *= corr;
        mx = sc;
    }
    const float w = __expf(sc - mx);
    l += w;
#pragma unroll
    for (int e = 0; e < E; e++) acc[e] += w * v[e];
}

template <int HD, int G>
__global__ void __launch_bounds__(SPAN_WARPS * 32) k_mac_span(span_args a)
{
    constexpr int E = HD / 32;
    const int t = blockIdx.x, g = blockIdx.y, z = blockIdx.z, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int32_t *row = a.rows + (size_t)t * 4;
    const int flags = row[3], seq = row[0], slot = row[1], m = row[2];
    if (!(flags & (KVS_MAC_F_MAC | KVS_MAC_F_APPEND)) || ((flags & KVS_MAC_F_APPEND) && slot < 0)) return;
    const int mac = (flags & KVS_MAC_F_MAC) != 0;
    int s_h[G], split_h[G], end_h[G], lo = INT32_MAX, hi = 0;
#pragma unroll
    for (int i = 0; i < G; i++) {
        const int h = g * G + i;
        head_range(mac ? a.p[(size_t)t * a.nh + h] : -1, m, a.band, mac, &s_h[i], &split_h[i], &end_h[i]);
        lo = min(lo, s_h[i]);
        hi = max(hi, end_h[i]);
    }
    /* this split's part of the union span, and this warp's part of that */
    const int len = max(hi - lo, 0), per = (len + a.Z - 1) / a.Z;
    const int za = lo + z * per, zb = min(za + per, hi);
    const int wper = (max(zb - za, 0) + SPAN_WARPS - 1) / SPAN_WARPS;
    const int wa = za + warp * wper, wb = min(wa + wper, zb);

    float q0[G][E], qr[G][E];
#pragma unroll
    for (int i = 0; i < G; i++)
#pragma unroll
        for (int e = 0; e < E; e++) qr[i][e] = q0[i][e] = a.q[((size_t)t * a.nh + g * G + i) * HD + lane + 32 * e];
    /* per head, A's and B's online softmax (separate arrays: constant indices keep them in
     * registers) */
    float mxa[G], la[G], acca[G][E], mxb[G], lb[G], accb[G][E];
#pragma unroll
    for (int i = 0; i < G; i++) {
        mxa[i] = mxb[i] = -INFINITY, la[i] = lb[i] = 0.0f;
#pragma unroll
        for (int e = 0; e < E; e++) acca[i][e] = accb[i][e] = 0.0f;
    }
    const int32_t *bt = a.bt + (size_t)seq * a.max_blocks;
    const int32_t *rot = a.rot ? a.rot + (size_t)seq * a.max_blocks : NULL;
    const int32_t *valid = a.valid ? a.valid + (size_t)seq * a.max_blocks : NULL;
    int cur_rot = 0;
    for (int pos = wa; pos < wb; pos++) {
        const int bi = pos / a.bs, off = pos % a.bs;
        if (valid && off >= valid[bi]) {
            pos += a.bs - off - 1;   /* the rest of this block is padding */
            continue;
        }
        const int r = rot ? rot[bi] : 0;
        if (r != cur_rot) {   /* deferred RoPE: the queries rotated back by r (neox half-split) */
            cur_rot = r;
#pragma unroll
            for (int e = 0; e < E / 2; e++) {
                const int d = lane + 32 * e;
                float sn, cs;
                sincosf((float)r * a.inv_freq[d], &sn, &cs);
#pragma unroll
                for (int i = 0; i < G; i++) {
                    const float x = q0[i][e], y = q0[i][e + E / 2];
                    qr[i][e] = x * cs + y * sn;
                    qr[i][e + E / 2] = -x * sn + y * cs;
                }
            }
        }
        const size_t kb = (((size_t)bt[bi] * a.nkv + g) * a.bs + off) * HD;
        float kv[E], vv[E];
#pragma unroll
        for (int e = 0; e < E; e++) kv[e] = __bfloat162float(a.kc[kb + lane + 32 * e]);
#pragma unroll
        for (int e = 0; e < E; e++) vv[e] = __bfloat162float(a.vc[kb + lane + 32 * e]);
        float d[G];
#pragma unroll
        for (int i = 0; i < G; i++) {
            d[i] = 0.0f;
#pragma unroll
            for (int e = 0; e < E; e++) d[i] += qr[i][e] * kv[e];
        }
        /* the G reductions interleaved (independent shuffles in flight) */
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
#pragma unroll
            for (int i = 0; i < G; i++) d[i] += __shfl_xor_sync(0xffffffffu, d[i], o);
#pragma unroll
        for (int i = 0; i < G; i++) {
            if (pos < s_h[i] || pos >= end_h[i]) continue;   /* warp-uniform */
            const float sc = d[i] * a.scale;
            if (pos < split_h[i]) online(mxa[i], la[i], acca[i], sc, vv);
            else online(mxb[i], lb[i], accb[i], sc, vv);
        }
    }
    /* the warps' partials, merged per (head, part) into work[t][h][z][part] = (o[HD], lse) */
    __shared__ float s_ml[SPAN_WARPS][G][2][2];
    __shared__ float s_acc[SPAN_WARPS][G][2][HD];
#pragma unroll
    for (int i = 0; i < G; i++) {
        if (lane == 0) {
            s_ml[warp][i][0][0] = mxa[i], s_ml[warp][i][0][1] = la[i];
            s_ml[warp][i][1][0] = mxb[i], s_ml[warp][i][1][1] = lb[i];
        }
#pragma unroll
        for (int e = 0; e < E; e++) s_acc[warp][i][0][lane + 32 * e] = acca[i][e], s_acc[warp][i][1][lane + 32 * e] = accb[i][e];
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < G * 2 * HD; idx += SPAN_WARPS * 32) {
        const int i = idx / (2 * HD), k = (idx / HD) % 2, d = idx % HD;
        float M = -INFINITY;
        for (int w = 0; w < SPAN_WARPS; w++) M = fmaxf(M, s_ml[w][i][k][0]);
        float L = 0.0f, o = 0.0f;
        if (M != -INFINITY)
            for (int w = 0; w < SPAN_WARPS; w++) {
                const float f = __expf(s_ml[w][i][k][0] - M);   /* an empty warp: exp(-inf) = 0 */
                L += s_ml[w][i][k][1] * f;
                o += s_acc[w][i][k][d] * f;
            }
        float *out = a.work + ((((size_t)t * a.nh + g * G + i) * a.Z + z) * 2 + k) * (HD + 1);
        out[d] = L > 0.0f ? o / L : 0.0f;
        if (d == 0) out[HD] = L > 0.0f ? M + logf(L) : -INFINITY;
    }
}

/* (o, la) merged with (ob, lb): backend.h attn_merge */
static __device__ __forceinline__ void merge(float &o, float &la, float ob, float lb)
{
    if (la == -INFINITY && lb == -INFINITY) {
        o = 0.0f;
        return;
    }
    const float mx = fmaxf(la, lb), ea = __expf(la - mx), eb = __expf(lb - mx), inv = 1.0f / (ea + eb);
    o = ea * inv * o + eb * inv * ob;
    la = mx + logf(ea + eb);
}

struct combine_args {
    const int32_t *rows, *p;
    const float *q_pre, *work;
    bf16 *ring_q, *ring_o;
    float *ring_lse, *out, *lse;
    int32_t *ring_tag;
    int nh, K, layer, n_layers, band, Z;
};

template <int HD>
__global__ void k_mac_combine(combine_args a)
{
    const int t = blockIdx.x, h = blockIdx.y, d = threadIdx.x;
    const int32_t *row = a.rows + (size_t)t * 4;
    const int flags = row[3], slot = row[1], m = row[2];
    if (!(flags & (KVS_MAC_F_MAC | KVS_MAC_F_APPEND)) || ((flags & KVS_MAC_F_APPEND) && slot < 0)) return;
    const int mac = (flags & KVS_MAC_F_MAC) != 0;
    const int p = mac ? a.p[(size_t)t * a.nh + h] : -1;
    const size_t ring0 = ((size_t)slot * a.n_layers + a.layer) * a.K;
    float o = 0.0f, L = -INFINITY;
    if (p >= 0) {   /* the cached summary of [0, p - r] */
        const size_t e = (ring0 + p % a.K) * a.nh + h;
        o = __bfloat162float(a.ring_o[e * HD + d]);
        L = a.ring_lse[e];
    }
    const float *w = a.work + ((size_t)t * a.nh + h) * a.Z * 2 * (HD + 1);
    for (int z = 0; z < a.Z; z++) merge(o, L, w[(z * 2) * (HD + 1) + d], w[(z * 2) * (HD + 1) + HD]);
    if (flags & KVS_MAC_F_APPEND) {
        const size_t j = ring0 + m % a.K, e = j * a.nh + h;
        a.ring_q[e * HD + d] = __float2bfloat16(a.q_pre[((size_t)t * a.nh + h) * HD + d]);
        a.ring_o[e * HD + d] = __float2bfloat16(o);
        if (d == 0) a.ring_lse[e] = L;
        if (d == 0 && h == 0) a.ring_tag[j] = m + 1;
    }
    if (mac) {
        for (int z = 0; z < a.Z; z++) merge(o, L, w[(z * 2 + 1) * (HD + 1) + d], w[(z * 2 + 1) * (HD + 1) + HD]);
        a.out[((size_t)t * a.nh + h) * HD + d] = o;
        if (d == 0) a.lse[(size_t)t * a.nh + h] = L;
    }
}

static int cu_supports(int n_heads, int n_kv_heads, int head_dim, char *err, size_t errlen)
{
    const int G = n_kv_heads > 0 && n_heads % n_kv_heads == 0 ? n_heads / n_kv_heads : 0;
    if ((head_dim != 64 && head_dim != 128) || (G != 1 && G != 2 && G != 4 && G != 8))
        return kvs_err(err, errlen, -ENOSYS,
                       "config key 'kv.decode': the CUDA mac kernels take head_dim 64 or 128 and 1, 2, 4 or 8 query "
                       "heads per KV head (model: heads %d/%d, head_dim %d)", n_heads, n_kv_heads, head_dim);
    return 0;
}

/* one split per row is always possible; small steps get up to MAX_SPLITS within the same bytes */
static size_t cu_work_elems(int max_rows, int n_heads, int head_dim)
{
    const size_t rows = max_rows > MAX_SPLITS ? (size_t)max_rows : MAX_SPLITS;
    return rows * (size_t)n_heads * 2 * (size_t)(head_dim + 1);
}

#define P(buf) ((buf)->d)

static void cu_match(struct kvs_backend *b, const struct kvs_mac_call *c)
{
    cudaStream_t st = b->stream;
    const dim3 grid(c->n, c->n_heads);
    const float *q = (const float *)P(c->q_pre);
    const bf16 *rq = (const bf16 *)P(c->ring_q);
    const int32_t *tags = (const int32_t *)P(c->ring_tag), *rows = (const int32_t *)P(c->rows);
    int32_t *p = (int32_t *)P(c->p) + c->p_off;
    if (c->head_dim == 64)
        k_mac_match<64><<<grid, MATCH_THREADS, 0, st>>>(q, rq, tags, rows, p, c->n_heads, c->K, c->layer,
                                                           c->n_layers, c->thresh2);
    else
        k_mac_match<128><<<grid, MATCH_THREADS, 0, st>>>(q, rq, tags, rows, p, c->n_heads, c->K, c->layer,
                                                            c->n_layers, c->thresh2);
    CUDA_CHECK(cudaGetLastError());
}

template <int HD>
static void launch_span(int G, dim3 grid, cudaStream_t st, const span_args &a)
{
    switch (G) {
    case 1: k_mac_span<HD, 1><<<grid, SPAN_WARPS * 32, 0, st>>>(a); break;
    case 2: k_mac_span<HD, 2><<<grid, SPAN_WARPS * 32, 0, st>>>(a); break;
    case 4: k_mac_span<HD, 4><<<grid, SPAN_WARPS * 32, 0, st>>>(a); break;
    default: k_mac_span<HD, 8><<<grid, SPAN_WARPS * 32, 0, st>>>(a); break;
    }
}

static void cu_attend(struct kvs_backend *b, const struct kvs_mac_call *c)
{
    cudaStream_t st = b->stream;
    const int G = c->n_heads / c->n_kv_heads, hd = c->head_dim;
    /* splits: enough blocks for two waves, at most one per MIN_SPLIT_POS positions of the
     * longest context, within the scratch */
    const int sms = b->n_sms;
    int Z = (2 * sms + c->n * c->n_kv_heads - 1) / (c->n * c->n_kv_heads);
    Z = Z < (c->m->max_ctx + MIN_SPLIT_POS - 1) / MIN_SPLIT_POS ? Z : (c->m->max_ctx + MIN_SPLIT_POS - 1) / MIN_SPLIT_POS;
    const size_t per_split = (size_t)c->n * c->n_heads * 2 * (size_t)(hd + 1);
    if ((size_t)Z * per_split > c->work_n) Z = (int)(c->work_n / per_split);
    if (Z > MAX_SPLITS) Z = MAX_SPLITS;
    if (Z < 1) Z = 1;
    KVS_ASSERT(per_split <= c->work_n);
    const struct kvs_attn_meta *m = c->m;
    span_args a = {
        (const float *)P(c->q), (const bf16 *)P(c->kc), (const bf16 *)P(c->vc), (const int32_t *)P(c->rows),
        (const int32_t *)P(c->p) + c->p_off, (const int32_t *)P(m->block_tables),
        m->rot_offsets ? (const int32_t *)P(m->rot_offsets) : NULL,
        m->block_valid ? (const int32_t *)P(m->block_valid) : NULL,
        m->inv_freq ? (const float *)P(m->inv_freq) : NULL, (float *)P(c->work),
        m->max_blocks, c->n_heads, c->n_kv_heads, c->block_size, c->band, Z, c->scale,
    };
    const dim3 grid(c->n, c->n_kv_heads, Z);
    if (hd == 64) launch_span<64>(G, grid, st, a);
    else launch_span<128>(G, grid, st, a);
    CUDA_CHECK(cudaGetLastError());
    combine_args ca = {
        (const int32_t *)P(c->rows), (const int32_t *)P(c->p) + c->p_off, (const float *)P(c->q_pre),
        (const float *)P(c->work), (bf16 *)P(c->ring_q), (bf16 *)P(c->ring_o), (float *)P(c->ring_lse),
        (float *)P(c->out), (float *)P(c->lse), (int32_t *)P(c->ring_tag),
        c->n_heads, c->K, c->layer, c->n_layers, c->band, Z,
    };
    const dim3 g2(c->n, c->n_heads);
    if (hd == 64) k_mac_combine<64><<<g2, 64, 0, st>>>(ca);
    else k_mac_combine<128><<<g2, 128, 0, st>>>(ca);
    CUDA_CHECK(cudaGetLastError());
}

extern "C" const struct kvs_mac_kernels kvs_mac_kernels_cuda = {cu_supports, cu_work_elems, cu_match, cu_attend};
