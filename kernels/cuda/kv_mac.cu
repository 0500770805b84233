/* kv_mac.cu: MAC-Attention's kernels on the CUDA backend (kernels/kv_mac.h; the CPU reference
 * is kernels/cpu/kv_mac.c and tests/gpu/test_cuda_kv_mac.c compares the two).
 *
 *   match (default) k_mac_match_part + k_mac_match_fin: blocks of (row, run of ring entries)
 *                  reading the ring's contiguous [entry][head][dim] bf16 rows coalesced, per-head
 *                  minima per block, then the minimum over blocks, ties to the lower entry (the
 *                  section below; runs of 2-8 entries, the shorter at batch 1-3, where
 *                  KVS_MAC_MATCH_SMALL=0 keeps 8). KVS_MAC_MATCH=0: k_mac_match, one block per
 *                  (row, q head), a thread per ring entry.
 *   span (default) k_mac_span_tc: one warp a block per (row, KV head, split), the group's A and B
 *                  parts as the rows of a tensor-core m-tile over 32-key tiles of the union span
 *                  (flash decoding with the paged attention's pieces, cuda_attn_device.cuh; the
 *                  section below). KVS_MAC_SPAN=0: k_mac_span, the first kernel: one block per
 *                  (row, KV head, split), the group's q heads reading each key and value once,
 *                  4 warps splitting the range, one position per warp step (latency-bound: a
 *                  miss ran 6x slower than full attention, bench/RESULTS.md).
 *   k_mac_combine  one block per (row, q head), a thread per dimension (the splits' weights once per
 *                  block, split_weights; KVS_MAC_COMBINE=0: per dimension): cached (o, lse) merged
 *                  with the A partials of the splits (the rectified summary), stored in the ring
 *                  for F_APPEND rows, then merged with the B partials into out / lse.
 *   k_mac_count    the counters (kv_mac.h count()) added up on the device.
 * Head shapes: head_dim 64 or 128, 1 to 16 q heads per KV head (others: -ENOSYS); the first span
 * kernel (KVS_MAC_SPAN=0) only for 1, 2, 4 or 8 (other group sizes take the tiled one).
 * Over LeanKV pages (kv.storage = lean, static modes; kernels/kv_mac.h) the tiled span kernel's
 * tile stage is its template's other loader (lean_issue_raw, per format): the tile's raw codes
 * and fp16 (s, z) staged with cp.async SPAN_TC_ST tiles in flight like the plain path's K/V, then,
 * when the tile is computed, dequantized from shared memory (lean_deq_raw: x^ = s code - z in
 * fp32, rounded as the host's, then bf16: the precision of the plain pool) into one bf16 tile of
 * the plain layout, so everything after the stage is the plain path's code; the plain
 * instantiation is unchanged.
 * Launched on the backend's stream, in order with its ops; nothing is synchronized or
 * downloaded, so the calls can be recorded in a step graph. Uses only the backend's structs and
 * the attention kernels' header-only pieces (cuda_internal.cuh, cuda_attn_device.cuh), no
 * function of its objects: the KV registry reaches this table from programs that link no backend
 * (kernels/kv_mac_pick.c).
 */
#include <errno.h>

#include <stdlib.h>
#include <string.h>

#include <cuda_fp16.h>

#include "kernels/cuda/cuda_attn_device.cuh"
#include "kernels/cuda/cuda_internal.cuh"
#include "kernels/cuda/kv_mac_cuda.h"
#include "kernels/kv_mac.h"

#define MATCH_THREADS 256
#define SPAN_WARPS 4
#define MAX_SPLITS 64
#define MIN_SPLIT_POS 256     /* positions a split should have before another one pays */
#define WORK_ROWS 512         /* rows of split partials the scratch holds at least (decode steps split) */
#define SPAN_TC_ST 2          /* K/V tiles in flight per block of the tiled span kernel */
#define MATCH2_THREADS 256
#define MATCH2_EPB_MIN 8      /* ring entries per block of the coalesced match (at least, from 4 rows up) */
#define MATCH2_EPB_SMALL 2    /* ... and at least, for steps of 1-3 rows: more blocks in flight (~4 per SM) */

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

/* ---- coalesced match (the default): k_mac_match_part + k_mac_match_fin ----------------------
 *
 * The ring of a (slot, layer) is [K][n_heads][HD]: entry j's queries of all heads are one
 * contiguous run of n_heads x HD bf16. A block takes (row, a run of EPB entries) and reads that
 * run front to back: HD / 8 lanes a (entry, head) pair, 16 bytes each (a 256-byte row per pair at
 * head_dim 128, coalesced), U pairs' loads in flight per lane group; each pair's squared distance
 * is an fp32 sum over the lanes' 8-element partials (a tree, where the CPU reference sums in
 * order: equal distances stay equal, so ties still go to the lower entry). The block keeps, per
 * head, its minimum over its entries (strict <, ascending: the lower entry on ties) and writes
 * (distance, entry) to the scratch; k_mac_match_fin takes, per (row, head), the minimum over the
 * blocks in ascending order (again the lower entry on ties), applies the threshold and writes the
 * matched position. Versus one block per (row, head) with a thread per entry (k_mac_match,
 * KVS_MAC_MATCH=0), the reads are coalesced and a batch-1 step has K / EPB x more blocks. */
template <int HD>
__global__ void __launch_bounds__(MATCH2_THREADS) k_mac_match_part(const float *__restrict__ q_pre, const bf16 *__restrict__ ring_q,
                                                                  const int32_t *__restrict__ tags, const int32_t *__restrict__ rows,
                                                                  float *__restrict__ part, int nh, int K, int layer, int n_layers,
                                                                  int EPB)
{
    constexpr int LPP = HD / 8, NG = MATCH2_THREADS / LPP, U = 4;   /* lanes a pair, pair groups, unroll */
    extern __shared__ float sm2[];
    float *s_q = sm2, *s_d = sm2 + nh * HD;   /* [nh][HD] query (bf16-rounded), [EPB][nh] distances */
    const int t = blockIdx.x, kb = blockIdx.y, KB = gridDim.y;
    const int32_t *row = rows + (size_t)t * 4;
    const int flags = row[3], slot = row[1], m = row[2];
    if (!(flags & KVS_MAC_F_MATCH) || slot < 0) return;   /* k_mac_match_fin writes -1 */
    const int j0 = kb * EPB, j1 = min(j0 + EPB, K), ne = max(j1 - j0, 0);
    for (int i = threadIdx.x; i < nh * HD; i += MATCH2_THREADS)
        s_q[i] = __bfloat162float(__float2bfloat16(q_pre[(size_t)t * nh * HD + i]));
    __syncthreads();
    const size_t base = ((size_t)slot * n_layers + layer) * K;
    const int grp = threadIdx.x / LPP, l = threadIdx.x % LPP, pairs = ne * nh;
    const uint4 *run = (const uint4 *)(ring_q + (base + j0) * nh * HD);   /* pair pr's row: run + pr * LPP */
    for (int b0 = 0; b0 < pairs; b0 += NG * U) {   /* warp-uniform trip count: the shuffles below */
        const int p0 = b0 + grp;
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int pr = p0 + u * NG;
            if (pr < pairs) v[u] = run[(size_t)pr * LPP + l];
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int pr = p0 + u * NG;
            float s = 0.0f;
            if (pr < pairs) {
                const bf16 *b8 = (const bf16 *)&v[u];
                const float *qh = s_q + (pr % nh) * HD + l * 8;
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    const float d = qh[i] - __bfloat162float(b8[i]);
                    s += d * d;
                }
            }
#pragma unroll
            for (int o = LPP / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
            if (pr < pairs && l == 0) {
                const int tag = tags[base + j0 + pr / nh];
                s_d[pr] = tag <= 0 || tag - 1 >= m ? INFINITY : s;   /* empty, or not older than m */
            }
        }
    }
    __syncthreads();
    for (int h = threadIdx.x; h < nh; h += MATCH2_THREADS) {
        float best = INFINITY;
        int bj = -1;
        for (int e = 0; e < ne; e++) {
            const float d = s_d[e * nh + h];
            if (d < best) best = d, bj = j0 + e;   /* ascending, strict: the lower entry on ties */
        }
        float *w = part + (((size_t)t * nh + h) * KB + kb) * 2;
        w[0] = best;
        w[1] = __int_as_float(bj);
    }
}

/* one warp per (row, head) at a time: each lane the minimum over its blocks kb = lane, lane + 32,
 * ... (ascending, strict: the lower entry on ties, the blocks' entry runs being ascending in kb),
 * then the warp's minimum, ties to the lower entry: the serial scan's result */
__global__ void k_mac_match_fin(const float *__restrict__ part, const int32_t *__restrict__ tags,
                                const int32_t *__restrict__ rows, int32_t *__restrict__ p_out, int nh, int K, int KB,
                                int layer, int n_layers, float thresh2)
{
    const int t = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32, nw = blockDim.x / 32;
    const int32_t *row = rows + (size_t)t * 4;
    const int flags = row[3], slot = row[1];
    const int on = (flags & KVS_MAC_F_MATCH) && slot >= 0;   /* block-uniform: the shuffles below */
    const size_t base = on ? ((size_t)slot * n_layers + layer) * K : 0;
    for (int h = warp; h < nh; h += nw) {
        int p = -1;
        if (on) {
            float best = INFINITY;
            int bj = -1;
            const float2 *w = (const float2 *)(part + ((size_t)t * nh + h) * KB * 2);
            for (int k0 = lane; k0 < KB; k0 += 4 * 32) {   /* 4 loads in flight, then the updates */
                float2 v[4];
#pragma unroll
                for (int u = 0; u < 4; u++) v[u] = k0 + 32 * u < KB ? w[k0 + 32 * u] : make_float2(INFINITY, __int_as_float(-1));
#pragma unroll
                for (int u = 0; u < 4; u++) {
                    const int j = __float_as_int(v[u].y);
                    if (j >= 0 && (bj < 0 || v[u].x < best)) best = v[u].x, bj = j;
                }
            }
            for (int o = 16; o > 0; o >>= 1) {
                const float ob = __shfl_xor_sync(0xffffffffu, best, o);
                const int oj = __shfl_xor_sync(0xffffffffu, bj, o);
                if (oj >= 0 && (bj < 0 || ob < best || (ob == best && oj < bj))) best = ob, bj = oj;
            }
            if (bj >= 0 && best < thresh2) p = tags[base + bj] - 1;
        }
        if (lane == 0) p_out[(size_t)t * nh + h] = p;
    }
}

/* ---- the position-tiled span kernel (the default): k_mac_span_tc ----------------------------
 *
 * Flash-decoding on tensor cores with the paged attention's pieces (cuda_attn_device.cuh): one
 * warp a block owns (row t, KV head g, split z); the rows of its MT m-tiles of 16 are (head i,
 * part) pairs, row i the A part [s_i, split_i) of q head g G + i and row G + i its B part
 * [split_i, end_i): 2 G rows live, MT = 1 for G <= 8, 2 for G <= 16 (G is a runtime argument:
 * any group size, odd ones like SmolLM2's 3 included; only the m-tile count is a template). The block walks the union of its heads' ranges (from min s_i rounded
 * down to a multiple of 32, to max end_i) in 32-key tiles staged with cp.async, SPAN_TC_ST tiles
 * in flight and the block table looked up a tile ahead; every K/V byte is read once for the
 * group and serves all 2 G rows (QK on mma.sync, bf16 q, fp32 scores), each row masking the keys
 * outside its own range before the online softmax. The union is cut into Z splits of equal tile
 * counts; each block writes its rows' normalized partials (o, lse) to the scratch as
 * k_mac_span did, and k_mac_combine merges them. Deferred RoPE: the q fragments rotate backward
 * at document boundaries (rot_table + rotate_frags), padded slots are zero-filled and masked. */
struct span_tc_args {
    at_args a;                    /* q, kc, vc, bt, rot, valid, inv_freq, max_blocks, n_heads, n_kv, bs, G, scale */
    const int32_t *rows, *p;
    float *work;
    int band, Z;
    /* LeanKV pages (the LEAN instantiation; kernels/kv_lean.h layout): bits and code bytes of a
     * K / V vector, bytes of a page */
    const uint8_t *pages;
    int kbits, vbits, kcb, vcb;
    long long page;
};

/* Elements 8 c .. 8 c + 7 of a LeanKV vector at B bits from their raw code words w (B / 4 words;
 * szw: the vector's fp16 (s, z) as one little-endian word, unused at 16 bits), dequantized as the
 * host's kvs_lean_dequantize (s * code - z, each operation rounded, no contraction) and rounded
 * to bf16. */
template <int B>
static __device__ __forceinline__ uint4 lean_deq8(const uint32_t (&w)[B / 4], uint32_t szw)
{
    float x[8];
    if constexpr (B == 16) {
#pragma unroll
        for (int i = 0; i < 8; i++)
            x[i] = __half2float(__ushort_as_half((unsigned short)(w[i / 2] >> (16 * (i % 2)))));
    } else {
        const float sc = __half2float(__ushort_as_half((unsigned short)(szw & 0xffffu)));
        const float z = __half2float(__ushort_as_half((unsigned short)(szw >> 16)));
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const uint32_t code = (w[(B * i) / 32] >> ((B * i) % 32)) & ((1u << B) - 1u);
            x[i] = __fsub_rn(__fmul_rn(sc, (float)code), z);
        }
    }
    uint4 out;
    bf16 *o = reinterpret_cast<bf16 *>(&out);
#pragma unroll
    for (int i = 0; i < 8; i++) o[i] = __float2bfloat16(x[i]);
    return out;
}

/* B / 4 aligned words of codes from shared memory (the raw stage below) */
template <int B>
static __device__ __forceinline__ void lean_lds_w(const uint8_t *p, uint32_t (&w)[B / 4])
{
    if constexpr (B == 16) {
        const uint4 v = *reinterpret_cast<const uint4 *>(p);
        w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
    } else if constexpr (B == 8) {
        const uint2 v = *reinterpret_cast<const uint2 *>(p);
        w[0] = v.x, w[1] = v.y;
    } else {
        static_assert(B == 4, "lean_lds_w: 4, 8 or 16 bits");
        w[0] = *reinterpret_cast<const uint32_t *>(p);
    }
}

static __device__ __forceinline__ void mac_cp16(void *dst, const void *src, int bytes)
{
    const unsigned sa = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(sa), "l"(src), "r"(bytes));
}

static __device__ __forceinline__ void mac_cp4(void *dst, const void *src, int bytes)
{
    const unsigned sa = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(sa), "l"(src), "r"(bytes));
}

/* The raw stage of a tile over LeanKV pages of format KB / VB: K codes [32][HD KB / 8], V codes
 * [32][HD VB / 8], K (s, z) [32] words, V (s, z) [32] words (lean_raw_bytes a stage) */
__host__ __device__ constexpr int lean_raw_bytes(int hd, int kb, int vb)
{
    return AT_TILE * (hd * kb / 8 + hd * vb / 8 + 8);
}

/* tile_issue's job over LeanKV pages: the raw codes and (s, z) of the tile that m describes
 * (m.row: the plain pool's element offset of lane l's key, ((page) bs + slot) HD, or -1) copied
 * by cp.async into the raw stage raw, keys not read zero-filled (codes and (s, z) 0: they
 * dequantize to +0, as the plain path's zero fill), each key's info into ko. The copies join the
 * caller's cp.async group, so they are in flight while the previous tile computes (a first
 * version loaded and dequantized the tile synchronously in its stage: a miss over K8V4 pages ran
 * 2.4-3.4x slower than over the bf16 pool, bench/RESULTS.md). One warp (the tiled span kernel's
 * block); 16-byte copies, consecutive lanes on a key's consecutive bytes. */
template <int HD, int KB, int VB>
__device__ __forceinline__ void lean_issue_raw(const span_tc_args &x, const tile_meta &m, uint8_t *raw, int *ko)
{
    constexpr int KCB = HD * KB / 8, VCB = HD * VB / 8, CHK = KCB / 16, CHV = VCB / 16;
    const int lane = threadIdx.x & 31, bs = x.a.bs;
    ko[lane] = m.info;
    long long pg = -1;   /* byte offset of this lane's key's page */
    int sl = 0;
    if (m.row >= 0) {
        const long long slot = m.row / HD, pidx = slot / bs;
        sl = (int)(slot - pidx * bs);
        pg = pidx * x.page;
    }
#pragma unroll
    for (int idx = lane; idx < AT_TILE * CHK; idx += 32) {
        const int j = idx / CHK, c = idx % CHK;
        const long long p = __shfl_sync(FULL, pg, j);
        const int sj = __shfl_sync(FULL, sl, j);
        mac_cp16(raw + j * KCB + c * 16, p >= 0 ? x.pages + p + (long long)sj * KCB + c * 16 : x.pages, p >= 0 ? 16 : 0);
    }
#pragma unroll
    for (int idx = lane; idx < AT_TILE * CHV; idx += 32) {
        const int j = idx / CHV, c = idx % CHV;
        const long long p = __shfl_sync(FULL, pg, j);
        const int sj = __shfl_sync(FULL, sl, j);
        mac_cp16(raw + AT_TILE * KCB + j * VCB + c * 16,
                 p >= 0 ? x.pages + p + (long long)bs * KCB + (long long)sj * VCB + c * 16 : x.pages, p >= 0 ? 16 : 0);
    }
    const uint8_t *meta = pg >= 0 ? x.pages + pg + (long long)bs * (KCB + VCB) : x.pages;
    uint8_t *rsz = raw + AT_TILE * (KCB + VCB);
    if (KB < 16) {
        mac_cp4(rsz + lane * 4, meta + (pg >= 0 ? sl * 4 : 0), pg >= 0 ? 4 : 0);
        meta += pg >= 0 ? bs * 4 : 0;
    }
    if (VB < 16) mac_cp4(rsz + AT_TILE * 4 + lane * 4, meta + (pg >= 0 ? sl * 4 : 0), pg >= 0 ? 4 : 0);
}

/* the staged raw tile dequantized into the bf16 tile dk / dv (row stride kst), each 8-element
 * chunk as lean_deq8 (the host's kvs_lean_dequantize, then bf16) */
template <int HD, int KB, int VB>
__device__ __forceinline__ void lean_deq_raw(const uint8_t *raw, bf16 *dk, bf16 *dv, int kst)
{
    constexpr int KCB = HD * KB / 8, VCB = HD * VB / 8, CH = HD / 8, IT = AT_TILE * CH / 32;
    const int lane = threadIdx.x & 31;
    const uint8_t *rsz = raw + AT_TILE * (KCB + VCB);
#pragma unroll
    for (int u = 0; u < IT; u++) {
        const int idx = lane + 32 * u, j = idx / CH, c = idx % CH;
        uint32_t kw[KB / 4], vw[VB / 4];
        lean_lds_w<KB>(raw + j * KCB + c * KB, kw);
        lean_lds_w<VB>(raw + AT_TILE * KCB + j * VCB + c * VB, vw);
        const uint32_t kz = KB < 16 ? *reinterpret_cast<const uint32_t *>(rsz + j * 4) : 0u;
        const uint32_t vz = VB < 16 ? *reinterpret_cast<const uint32_t *>(rsz + AT_TILE * 4 + j * 4) : 0u;
        *reinterpret_cast<uint4 *>(dk + j * kst + c * 8) = lean_deq8<KB>(kw, kz);
        *reinterpret_cast<uint4 *>(dv + j * kst + c * 8) = lean_deq8<VB>(vw, vz);
    }
}

/* the call's format (warp-uniform switch; the static modes cu_supports_lean lets through) */
#define LEAN_MAC_FMT(x, F)                                                                                             \
    switch ((x).kbits * 100 + (x).vbits) {                                                                             \
    case 1616: F(16, 16); break;                                                                                       \
    case 808: F(8, 8); break;                                                                                          \
    case 804: F(8, 4); break;                                                                                          \
    default: F(4, 4); break;                                                                                           \
    }

template <int HD>
__device__ __forceinline__ void lean_issue_any(const span_tc_args &x, const tile_meta &m, uint8_t *raw, int *ko)
{
#define LEAN_MAC_ISSUE(K, V) lean_issue_raw<HD, K, V>(x, m, raw, ko)
    LEAN_MAC_FMT(x, LEAN_MAC_ISSUE)
#undef LEAN_MAC_ISSUE
}

template <int HD>
__device__ __forceinline__ void lean_deq_any(const span_tc_args &x, const uint8_t *raw, bf16 *dk, bf16 *dv, int kst)
{
#define LEAN_MAC_DEQ(K, V) lean_deq_raw<HD, K, V>(raw, dk, dv, kst)
    LEAN_MAC_FMT(x, LEAN_MAC_DEQ)
#undef LEAN_MAC_DEQ
}

/* shared memory of k_mac_span_tc: bf16 K and V tiles (SPAN_TC_ST stages; over LeanKV pages one,
 * filled from the raw stage just before it is computed), the rotation table, key infos, then (LEAN)
 * SPAN_TC_ST raw stages of the call's format (lean_raw_bytes each, added at launch) */
template <int HD, bool ROT, bool LEAN = false>
struct span_tc_cfg {
    static constexpr int KST = HD + 8;
    static constexpr size_t kv_elems = (size_t)(LEAN ? 1 : SPAN_TC_ST) * AT_TILE * KST;
    static constexpr size_t smem = 2 * kv_elems * sizeof(bf16) + (ROT ? HD : 0) * sizeof(float) +
                                   (size_t)SPAN_TC_ST * AT_TILE * sizeof(int);   /* a multiple of 16 */
};

template <int HD, int MT, bool ROT, bool LEAN>
__global__ void __launch_bounds__(32) k_mac_span_tc(const __grid_constant__ span_tc_args x)
{
    typedef span_tc_cfg<HD, ROT, LEAN> C;
    constexpr int KST = C::KST, ST = SPAN_TC_ST;
    static_assert(C::smem % 16 == 0, "k_mac_span_tc: the raw stages need 16-byte alignment");
    const at_args &a = x.a;
    const int G = a.G;   /* q heads per KV head, 2 G <= 16 MT rows */
    extern __shared__ __align__(16) unsigned char smraw[];
    bf16 *sk = (bf16 *)smraw;
    bf16 *sv = sk + C::kv_elems;
    float *rtab = (float *)(sv + C::kv_elems);
    int *soff = (int *)(rtab + (ROT ? HD : 0));
    uint8_t *raw = smraw + C::smem;                                  /* LEAN: the raw stages */
    const int raw_st = LEAN ? lean_raw_bytes(HD, x.kbits, x.vbits) : 0;
    const int t = blockIdx.x, kvh = blockIdx.y, z = blockIdx.z, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
    const int32_t *row = x.rows + (size_t)t * 4;
    const int flags = row[3], seq = row[0], slot = row[1], m = row[2];
    if (!(flags & (KVS_MAC_F_MAC | KVS_MAC_F_APPEND)) || ((flags & KVS_MAC_F_APPEND) && slot < 0)) return;
    const int mac = (flags & KVS_MAC_F_MAC) != 0;
    const int32_t *ph = x.p + (size_t)t * a.n_heads + (size_t)kvh * G;
    /* the union of the group's ranges */
    int lo_all = INT_MAX, hi_all = 0;
    for (int i = 0; i < G; i++) {
        int s, split, end;
        head_range(mac ? ph[i] : -1, m, x.band, mac, &s, &split, &end);
        if (end > s) lo_all = min(lo_all, s), hi_all = max(hi_all, end);
    }
    /* the ranges of this thread's rows (m-tile mt, rows g and g + 8): row R = 16 mt + g + 8 h is
     * the A part of head R (R < G), the B part of head R - G (R < 2 G), or nothing */
    int rlo[MT][2], rhi[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int R = 16 * mt + g + 8 * h;
            rlo[mt][h] = rhi[mt][h] = 0;
            if (R < 2 * G) {
                int s, split, end;
                head_range(mac ? ph[R % G] : -1, m, x.band, mac, &s, &split, &end);
                rlo[mt][h] = R < G ? s : split;
                rhi[mt][h] = R < G ? split : end;
            }
        }
    const int kbase = hi_all > lo_all ? lo_all & ~(AT_TILE - 1) : 0;
    const int ntot = hi_all > lo_all ? (hi_all - kbase + AT_TILE - 1) / AT_TILE : 0;
    const int per = (ntot + x.Z - 1) / x.Z;
    const int k0 = kbase + z * per * AT_TILE, k1 = min(hi_all, k0 + per * AT_TILE);
    const int ntiles = k1 > k0 ? (k1 - k0 + AT_TILE - 1) / AT_TILE : 0;
    const int32_t *bt = a.bt + (size_t)seq * a.max_blocks;
    const int32_t *vt = a.valid ? a.valid + (size_t)seq * a.max_blocks : nullptr;
    const int32_t *rt = ROT ? a.rot + (size_t)seq * a.max_blocks : nullptr;

    auto lookup = [&](int it) { return tile_lookup<HD>(a, k0 + it * AT_TILE, k1, kvh, bt, vt, rt, nullptr); };
    auto issue = [&](const tile_meta &tm, int it) {
        const size_t so = (size_t)(it % ST) * AT_TILE;
        if constexpr (LEAN) lean_issue_any<HD>(x, tm, raw + (it % ST) * raw_st, soff + so);
        else tile_issue<HD, 32>(a, tm, sk + so * KST, sv + so * KST, KST, soff + so);
    };
#pragma unroll
    for (int st = 0; st < ST - 1; st++) {
        if (st < ntiles) issue(lookup(st), st);
        cp_async_commit();
    }
    tile_meta next = lookup(ST - 1);

    /* q fragments: row R is head R % G's query (rows past 2 G zero), scaled, bf16 */
    uint32_t qa[MT][HD / 16][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int R = 16 * mt + g + 8 * h;
            const float *qr = R < 2 * G ? a.q + ((size_t)t * a.n_heads + (size_t)kvh * G + R % G) * HD : nullptr;
#pragma unroll
            for (int ks = 0; ks < HD / 16; ks++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int d = ks * 16 + 2 * tq + 8 * e;
                    const float v0 = qr ? q_dim<HD>(qr, d, a.scale, nullptr) : 0.0f;
                    const float v1 = qr ? q_dim<HD>(qr, d + 1, a.scale, nullptr) : 0.0f;
                    qa[mt][ks][h + 2 * e] = pack_bf16(v0, v1);
                }
        }
    int cur_rot = 0;
    uint32_t q0[ROT ? MT : 1][HD / 16][4];
    if (ROT) {
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int ks = 0; ks < HD / 16; ks++)
#pragma unroll
                for (int j = 0; j < 4; j++) q0[mt][ks][j] = qa[mt][ks][j];
    }
    float mm[MT][2], l[MT][2], o[MT][HD / 8][4];
    int lim[MT][2];   /* last key of each row (-1: none) */
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int h = 0; h < 2; h++) mm[mt][h] = -INFINITY, l[mt][h] = 0.0f, lim[mt][h] = rhi[mt][h] - 1;
#pragma unroll
        for (int nd = 0; nd < HD / 8; nd++)
#pragma unroll
            for (int e = 0; e < 4; e++) o[mt][nd][e] = 0.0f;
    }

    for (int it = 0; it < ntiles; it++) {
        if (it + ST - 1 < ntiles) issue(next, it + ST - 1);
        cp_async_commit();
        next = lookup(it + ST);
        cp_async_wait<ST - 1>();
        __syncthreads();
        if constexpr (LEAN) {
            /* the one bf16 tile is free (the previous tile's barrier below) */
            lean_deq_any<HD>(x, raw + (it % ST) * raw_st, sk, sv, KST);
            __syncwarp();
        }
        const bf16 *tk = sk + (LEAN ? 0 : (size_t)(it % ST) * AT_TILE * KST);
        const bf16 *tv = sv + (LEAN ? 0 : (size_t)(it % ST) * AT_TILE * KST);
        const int kb = k0 + it * AT_TILE;
        const int *ko = soff + (it % ST) * AT_TILE;
        float sc[MT][4][4];
        if constexpr (!ROT) {
            qk_tc<HD, MT>(tk, qa, sc, lane);
        } else {
            const int myoff = ko[lane];
            if (__all_sync(FULL, myoff == cur_rot || myoff == KEY_PAD)) {
                qk_tc<HD, MT>(tk, qa, sc, lane);
            } else {
                qk_by_offset<HD, MT>(tk, ko, myoff, cur_rot, [&](int ofs) {
                    rot_table(rtab, HD, ofs, a.inv_freq);
                    rotate_frags<HD, MT>(q0, rtab, lane, qa);
                }, qa, sc, lane);
            }
        }
        /* keys before a row's first: masked here; past its last: softmax_tile's lim */
        uint32_t pa[MT][2][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
#pragma unroll
            for (int h = 0; h < 2; h++)
#pragma unroll
                for (int j = 0; j < 4; j++)
#pragma unroll
                    for (int e = 0; e < 2; e++)
                        if (kb + j * 8 + 2 * tq + e < rlo[mt][h]) sc[mt][j][2 * h + e] = -INFINITY;
            softmax_tile<HD, true>(sc[mt], ko, kb, lim[mt], mm[mt], l[mt], o[mt], pa[mt], lane);
        }
        pv_tile<HD, MT>(tv, KST, pa, o, lane);
        __syncthreads();
    }
    cp_async_wait<0>();
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float ls = l[mt][h];
            ls += __shfl_xor_sync(FULL, ls, 1);
            ls += __shfl_xor_sync(FULL, ls, 2);
            const int R = 16 * mt + g + 8 * h;
            if (R >= 2 * G) continue;
            const int i = R % G, part = R / G;
            float *w = x.work + ((((size_t)t * a.n_heads + (size_t)kvh * G + i) * x.Z + z) * 2 + part) * (HD + 1);
            const float inv = ls > 0.0f ? 1.0f / ls : 0.0f;
#pragma unroll
            for (int nd = 0; nd < HD / 8; nd++) {
                w[nd * 8 + 2 * tq] = o[mt][nd][2 * h] * inv;
                w[nd * 8 + 2 * tq + 1] = o[mt][nd][2 * h + 1] * inv;
            }
            if (tq == 0) w[HD] = ls > 0.0f ? mm[mt][h] + logf(ls) : -INFINITY;
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

/* the Z splits' partials of one part (0: A, 1: B) at dimension d as one (o, lse): one pass with
 * the largest lse as the reference (Z merges in a row would cost Z exp + log each); empty
 * splits carry lse -inf and weigh 0 */
template <int HD>
static __device__ __forceinline__ void splits(const float *w, int part, int Z, int d, float *o, float *lse)
{
    float M = -INFINITY;
    for (int z = 0; z < Z; z++) M = fmaxf(M, w[(z * 2 + part) * (HD + 1) + HD]);
    *o = 0.0f;
    *lse = -INFINITY;
    if (M == -INFINITY) return;
    float L = 0.0f, acc = 0.0f;
    for (int z = 0; z < Z; z++) {
        const float *pz = w + (z * 2 + part) * (HD + 1);
        const float f = __expf(pz[HD] - M);
        L += f;
        acc += f * pz[d];
    }
    *o = acc / L;
    *lse = M + logf(L);
}

/* k_mac_combine's split weights, computed once per block instead of per dimension: warp `part` (0: A,
 * 1: B) takes the Z <= MAX_SPLITS = 64 splits' lse, two per lane, and leaves f_z = exp(lse_z - M)
 * in f[part][z] (0 past Z and for empty splits), M and L = sum f_z in ml[part]; the per-dimension
 * pass (split_sum) then reads independent loads (the serial splits() chained Z dependent L2 reads
 * per dimension and part, about half of a batch-1 attend, bench/RESULTS.md) */
template <int HD>
static __device__ __forceinline__ void split_weights(const float *w, int part, int Z, int lane, float (*f)[MAX_SPLITS],
                                                     float (*ml)[2])
{
    const float l0 = lane < Z ? w[(lane * 2 + part) * (HD + 1) + HD] : -INFINITY;
    const float l1 = lane + 32 < Z ? w[((lane + 32) * 2 + part) * (HD + 1) + HD] : -INFINITY;
    float M = fmaxf(l0, l1);
    for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
    const float f0 = M == -INFINITY ? 0.0f : __expf(l0 - M), f1 = M == -INFINITY ? 0.0f : __expf(l1 - M);
    float L = f0 + f1;
    for (int o = 16; o > 0; o >>= 1) L += __shfl_xor_sync(0xffffffffu, L, o);
    f[part][lane] = f0, f[part][lane + 32] = f1;
    if (lane == 0) ml[part][0] = M, ml[part][1] = L;
}

/* the splits' partials of one part at dimension d as one (o, lse), from split_weights' f and ml:
 * splits()'s result, the sum of L in a tree */
template <int HD>
static __device__ __forceinline__ void split_sum(const float *w, int part, int Z, int d, const float (*f)[MAX_SPLITS],
                                                 const float (*ml)[2], float *o, float *lse)
{
    const float M = ml[part][0], L = ml[part][1];
    *o = 0.0f;
    *lse = -INFINITY;
    if (M == -INFINITY) return;
    float acc = 0.0f;
#pragma unroll 8
    for (int z = 0; z < Z; z++) acc += f[part][z] * w[(z * 2 + part) * (HD + 1) + d];
    *o = acc / L;
    *lse = M + logf(L);
}

struct combine_args {
    const int32_t *rows, *p;
    const float *q_pre, *work;
    bf16 *ring_q, *ring_o;
    float *ring_lse, *out, *lse;
    int32_t *ring_tag;
    int nh, K, layer, n_layers, band, Z, serial;
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
    float ob, lb;
    __shared__ float s_f[2][MAX_SPLITS], s_ml[2][2];
    const int fast = !a.serial;   /* KVS_MAC_COMBINE=0: the serial splits() per dimension (comparison) */
    if (fast) {
        if (d < 64) split_weights<HD>(w, d / 32, a.Z, d % 32, s_f, s_ml);   /* HD >= 64: warps 0 and 1 */
        __syncthreads();
        split_sum<HD>(w, 0, a.Z, d, s_f, s_ml, &ob, &lb);
    } else {
        splits<HD>(w, 0, a.Z, d, &ob, &lb);
    }
    merge(o, L, ob, lb);
    if (flags & KVS_MAC_F_APPEND) {
        const size_t j = ring0 + m % a.K, e = j * a.nh + h;
        a.ring_q[e * HD + d] = __float2bfloat16(a.q_pre[((size_t)t * a.nh + h) * HD + d]);
        a.ring_o[e * HD + d] = __float2bfloat16(o);
        if (d == 0) a.ring_lse[e] = L;
        if (d == 0 && h == 0) a.ring_tag[j] = m + 1;
    }
    if (mac) {
        if (fast) split_sum<HD>(w, 1, a.Z, d, s_f, s_ml, &ob, &lb);
        else splits<HD>(w, 1, a.Z, d, &ob, &lb);
        merge(o, L, ob, lb);
        a.out[((size_t)t * a.nh + h) * HD + d] = o;
        if (d == 0) a.lse[(size_t)t * a.nh + h] = L;
    }
}

/* count (kernels/kv_mac.h): (row, layer, KV group) items over the grid, sums per thread, then
 * per warp, one atomic add per warp and counter */
__global__ void k_mac_count(const int32_t *__restrict__ rows, const int32_t *__restrict__ p,
                            unsigned long long *__restrict__ acc, int n, int L, int nh, int nkv, int band)
{
    const int G = nh / nkv, items = n * L * nkv;
    unsigned long long v[KVS_MAC_N_COUNTS] = {0, 0, 0, 0, 0};
    for (int idx = blockIdx.x * blockDim.x + threadIdx.x; idx < items; idx += gridDim.x * blockDim.x) {
        const int t = idx / (L * nkv), l = (idx / nkv) % L, g = idx % nkv;
        const int32_t *r = rows + (size_t)t * 4;
        if (!(r[3] & KVS_MAC_F_COUNT)) continue;
        const int m = r[2];
        const int32_t *ph = p + ((size_t)l * n + t) * nh + (size_t)g * G;
        int min_s = m + 1;
        for (int h = 0; h < G; h++) {
            const int s0 = ph[h] >= 0 ? max(ph[h] - band + 1, 0) : 0;
            min_s = min(min_s, s0);
            v[KVS_MAC_C_LOOKUPS] += (r[3] & KVS_MAC_F_MATCH) != 0;
            v[KVS_MAC_C_HITS] += ph[h] >= 0;
            v[KVS_MAC_C_HEADS] += 1;
            v[KVS_MAC_C_SKIP] += (unsigned long long)((double)s0 * KVS_MAC_SKIP_ONE / (double)(m + 1) + 0.5);
        }
        v[KVS_MAC_C_READ] += (unsigned long long)(m + 1 - min_s);
    }
#pragma unroll
    for (int k = 0; k < KVS_MAC_N_COUNTS; k++) {
        for (int o = 16; o > 0; o >>= 1) v[k] += __shfl_xor_sync(0xffffffffu, v[k], o);
        if ((threadIdx.x & 31) == 0 && v[k]) atomicAdd(acc + k, v[k]);
    }
}

static int cu_supports(int n_heads, int n_kv_heads, int head_dim, char *err, size_t errlen)
{
    const int G = n_kv_heads > 0 && n_heads % n_kv_heads == 0 ? n_heads / n_kv_heads : 0;
    if ((head_dim != 64 && head_dim != 128) || G < 1 || G > 16)
        return kvs_err(err, errlen, -ENOSYS,
                       "config key 'kv.decode': the CUDA mac kernels take head_dim 64 or 128 and 1 to 16 query "
                       "heads per KV head (model: heads %d/%d, head_dim %d)", n_heads, n_kv_heads, head_dim);
    return 0;
}

/* Rows of split partials: the step's rows, and at least WORK_ROWS so that decode steps of few rows
 * still split their spans (the coalesced match's per-block minima use the same scratch). */
static size_t cu_work_elems(int max_rows, int n_heads, int head_dim)
{
    const size_t rows = max_rows > WORK_ROWS ? (size_t)max_rows : WORK_ROWS;
    return rows * (size_t)n_heads * 2 * (size_t)(head_dim + 1);
}

#define P(buf) ((buf)->d)

/* KVS_MAC_MATCH=0 / KVS_MAC_SPAN=0: the first kernels (one block per (row, head) match; the
 * warp-per-position span kernel), kept for comparison (bench/RESULTS.md) */
static int env_off(const char *name)
{
    const char *e = getenv(name);
    return e && strcmp(e, "0") == 0;
}

static void cu_match(struct kvs_backend *b, const struct kvs_mac_call *c)
{
    cudaStream_t st = b->stream;
    const float *q = (const float *)P(c->q_pre);
    const bf16 *rq = (const bf16 *)P(c->ring_q);
    const int32_t *tags = (const int32_t *)P(c->ring_tag), *rows = (const int32_t *)P(c->rows);
    int32_t *p = (int32_t *)P(c->p) + c->p_off;
    const int nh = c->n_heads, hd = c->head_dim;
    /* the coalesced match: K / EPB blocks a row, their minima in the scratch. A step of few rows
     * takes smaller runs (down to MATCH2_EPB_SMALL entries) so that ~4 blocks per SM are in
     * flight: at batch 1 and K = 1024 a run of 8 gave 128 blocks on 132 SMs, each a chain of
     * dependent load rounds (latency-bound, bench/RESULTS.md) */
    const int want = (4 * b->n_sms + c->n - 1) / c->n;
    int EPB0 = (c->K + want - 1) / want;
    EPB0 = EPB0 < MATCH2_EPB_SMALL ? MATCH2_EPB_SMALL : EPB0 > MATCH2_EPB_MIN ? MATCH2_EPB_MIN : EPB0;
    if (env_off("KVS_MAC_MATCH_SMALL")) EPB0 = MATCH2_EPB_MIN;
    int KB = (c->K + EPB0 - 1) / EPB0;
    const size_t cap = c->work ? c->work_n / ((size_t)c->n * nh * 2) : 0;
    if ((size_t)KB > cap) KB = (int)cap;
    const int EPB = KB > 0 ? (c->K + KB - 1) / KB : 0;
    const size_t smem = ((size_t)nh * hd + (size_t)EPB * nh) * sizeof(float);
    if (KB > 0 && smem <= 48 * 1024 && !env_off("KVS_MAC_MATCH")) {
        KB = (c->K + EPB - 1) / EPB;
        float *part = (float *)P(c->work);
        const dim3 grid(c->n, KB);
        if (hd == 64)
            k_mac_match_part<64><<<grid, MATCH2_THREADS, smem, st>>>(q, rq, tags, rows, part, nh, c->K, c->layer, c->n_layers, EPB);
        else
            k_mac_match_part<128><<<grid, MATCH2_THREADS, smem, st>>>(q, rq, tags, rows, part, nh, c->K, c->layer, c->n_layers, EPB);
        CUDA_CHECK(cudaGetLastError());
        const int fin_threads = 32 * (nh < 32 ? nh : 32);   /* a warp per head (the scan is latency-bound) */
        k_mac_match_fin<<<c->n, fin_threads, 0, st>>>(part, tags, rows, p, nh, c->K, KB, c->layer, c->n_layers, c->thresh2);
        CUDA_CHECK(cudaGetLastError());
        return;
    }
    const dim3 grid(c->n, c->n_heads);
    if (hd == 64)
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
    switch (G) {   /* cu_attend sends only these group sizes here */
    case 1: k_mac_span<HD, 1><<<grid, SPAN_WARPS * 32, 0, st>>>(a); break;
    case 2: k_mac_span<HD, 2><<<grid, SPAN_WARPS * 32, 0, st>>>(a); break;
    case 4: k_mac_span<HD, 4><<<grid, SPAN_WARPS * 32, 0, st>>>(a); break;
    case 8: k_mac_span<HD, 8><<<grid, SPAN_WARPS * 32, 0, st>>>(a); break;
    default: KVS_ASSERT(!"k_mac_span: group size not instantiated");
    }
}

template <int HD, bool ROT, bool LEAN>
static void launch_span_tc_rot(int G, dim3 grid, cudaStream_t st, const span_tc_args &x)
{
    typedef span_tc_cfg<HD, ROT, LEAN> C;
    static_assert(C::smem <= 48 * 1024, "k_mac_span_tc's stages exceed 48 KB");
    /* LEAN: + the raw stages of the call's format (K16V16 at head_dim 128: 50 KB, so opted in) */
    const size_t smem = C::smem + (LEAN ? (size_t)SPAN_TC_ST * lean_raw_bytes(HD, x.kbits, x.vbits) : 0);
    if (smem > 48 * 1024) {
        CUDA_CHECK(cudaFuncSetAttribute((const void *)k_mac_span_tc<HD, 1, ROT, LEAN>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        CUDA_CHECK(cudaFuncSetAttribute((const void *)k_mac_span_tc<HD, 2, ROT, LEAN>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    }
    if (G <= 8) k_mac_span_tc<HD, 1, ROT, LEAN><<<grid, 32, smem, st>>>(x);
    else k_mac_span_tc<HD, 2, ROT, LEAN><<<grid, 32, smem, st>>>(x);
}

template <int HD>
static void launch_span_tc(int G, dim3 grid, cudaStream_t st, const span_tc_args &x)
{
    if (x.pages) {
        if (x.a.rot) launch_span_tc_rot<HD, true, true>(G, grid, st, x);
        else launch_span_tc_rot<HD, false, true>(G, grid, st, x);
    } else {
        if (x.a.rot) launch_span_tc_rot<HD, true, false>(G, grid, st, x);
        else launch_span_tc_rot<HD, false, false>(G, grid, st, x);
    }
}

static void cu_attend(struct kvs_backend *b, const struct kvs_mac_call *c)
{
    cudaStream_t st = b->stream;
    const int G = c->n_heads / c->n_kv_heads, hd = c->head_dim;
    const int lean = c->lean.kbits > 0;   /* LeanKV pages: the tiled kernel's lean stage */
    KVS_ASSERT(!lean || c->pages);
    const int tiled = lean || !env_off("KVS_MAC_SPAN") || (G != 1 && G != 2 && G != 4 && G != 8);
    /* splits: enough blocks for several resident waves of one-warp blocks (tiled) or two waves of
     * 4-warp blocks, at most one per MIN_SPLIT_POS positions of the longest context (the plan
     * bound of a recorded step, whose contexts grow), within the scratch */
    const int sms = b->n_sms, pairs = c->n * c->n_kv_heads;
    const int ctx = c->m->plan_ctx > c->m->max_ctx ? c->m->plan_ctx : c->m->max_ctx;
    int Z = ((tiled ? 6 : 2) * sms + pairs - 1) / pairs;
    Z = Z < (ctx + MIN_SPLIT_POS - 1) / MIN_SPLIT_POS ? Z : (ctx + MIN_SPLIT_POS - 1) / MIN_SPLIT_POS;
    const size_t per_split = (size_t)c->n * c->n_heads * 2 * (size_t)(hd + 1);
    if ((size_t)Z * per_split > c->work_n) Z = (int)(c->work_n / per_split);
    if (Z > MAX_SPLITS) Z = MAX_SPLITS;
    if (Z < 1) Z = 1;
    KVS_ASSERT(per_split <= c->work_n);
    const struct kvs_attn_meta *m = c->m;
    const dim3 grid(c->n, c->n_kv_heads, Z);
    if (tiled) {
        span_tc_args x;
        memset(&x, 0, sizeof x);
        x.a.q = (const float *)P(c->q);
        x.a.kc = lean ? NULL : (const bf16 *)P(c->kc);
        x.a.vc = lean ? NULL : (const bf16 *)P(c->vc);
        x.a.bt = (const int32_t *)P(m->block_tables);
        x.a.rot = m->rot_offsets ? (const int32_t *)P(m->rot_offsets) : NULL;
        x.a.valid = m->block_valid ? (const int32_t *)P(m->block_valid) : NULL;
        x.a.inv_freq = m->inv_freq ? (const float *)P(m->inv_freq) : NULL;
        x.a.max_blocks = m->max_blocks;
        x.a.n_heads = c->n_heads;
        x.a.n_kv = c->n_kv_heads;
        x.a.bs = c->block_size;
        x.a.G = G;
        x.a.scale = c->scale;
        x.rows = (const int32_t *)P(c->rows);
        x.p = (const int32_t *)P(c->p) + c->p_off;
        x.work = (float *)P(c->work);
        x.band = c->band;
        x.Z = Z;
        if (lean) {
            x.pages = (const uint8_t *)P(c->pages);
            x.kbits = c->lean.kbits, x.vbits = c->lean.vbits;
            x.kcb = hd * c->lean.kbits / 8, x.vcb = hd * c->lean.vbits / 8;
            x.page = (long long)kvs_lean_page_bytes(c->lean, hd, c->block_size);
        }
        if (hd == 64) launch_span_tc<64>(G, grid, st, x);
        else launch_span_tc<128>(G, grid, st, x);
    } else {
        span_args a = {
            (const float *)P(c->q), (const bf16 *)P(c->kc), (const bf16 *)P(c->vc), (const int32_t *)P(c->rows),
            (const int32_t *)P(c->p) + c->p_off, (const int32_t *)P(m->block_tables),
            m->rot_offsets ? (const int32_t *)P(m->rot_offsets) : NULL,
            m->block_valid ? (const int32_t *)P(m->block_valid) : NULL,
            m->inv_freq ? (const float *)P(m->inv_freq) : NULL, (float *)P(c->work),
            m->max_blocks, c->n_heads, c->n_kv_heads, c->block_size, c->band, Z, c->scale,
        };
        if (hd == 64) launch_span<64>(G, grid, st, a);
        else launch_span<128>(G, grid, st, a);
    }
    CUDA_CHECK(cudaGetLastError());
    combine_args ca = {
        (const int32_t *)P(c->rows), (const int32_t *)P(c->p) + c->p_off, (const float *)P(c->q_pre),
        (const float *)P(c->work), (bf16 *)P(c->ring_q), (bf16 *)P(c->ring_o), (float *)P(c->ring_lse),
        (float *)P(c->out), (float *)P(c->lse), (int32_t *)P(c->ring_tag),
        c->n_heads, c->K, c->layer, c->n_layers, c->band, Z, env_off("KVS_MAC_COMBINE"),
    };
    const dim3 g2(c->n, c->n_heads);
    if (hd == 64) k_mac_combine<64><<<g2, 64, 0, st>>>(ca);
    else k_mac_combine<128><<<g2, 128, 0, st>>>(ca);
    CUDA_CHECK(cudaGetLastError());
}

static void cu_count(struct kvs_backend *b, const struct kvs_mac_call *c, struct kvs_dbuf *acc)
{
    const int items = c->n * c->n_layers * c->n_kv_heads;
    int blocks = (items + 255) / 256;
    if (blocks > 64) blocks = 64;
    if (blocks < 1) blocks = 1;
    k_mac_count<<<blocks, 256, 0, b->stream>>>((const int32_t *)P(c->rows), (const int32_t *)P(c->p),
                                               (unsigned long long *)P(acc), c->n, c->n_layers, c->n_heads,
                                               c->n_kv_heads, c->band);
    CUDA_CHECK(cudaGetLastError());
}

/* LeanKV pages: the formats of 2, 4, 8 or 16 bits a side, pages of a multiple of 16 bytes (the
 * stage's aligned vector loads; LeanKV's own CUDA kernels ask the same) */
static int cu_supports_lean(struct kvs_lean_fmt f, int n_heads, int n_kv_heads, int head_dim, int block_size,
                            char *err, size_t errlen)
{
    int rc = cu_supports(n_heads, n_kv_heads, head_dim, err, errlen);
    if (rc) return rc;
    /* the static modes kv.lean.mode offers */
    const int ok_bits = (f.kbits == 16 && f.vbits == 16) || (f.kbits == 8 && (f.vbits == 8 || f.vbits == 4)) ||
                        (f.kbits == 4 && f.vbits == 4);
    if (!ok_bits || block_size < 1 || kvs_lean_page_bytes(f, head_dim, block_size) % 16)
        return kvs_err(err, errlen, -ENOSYS,
                       "config keys 'kv.decode' = \"mac\" and 'kv.storage' = \"lean\": the CUDA mac kernels read "
                       "LeanKV pages K16V16, K8V8, K8V4 or K4V4 whose size is a multiple of 16 bytes (K%dV%d, head_dim "
                       "%d, block size %d)", f.kbits, f.vbits, head_dim, block_size);
    return 0;
}

extern "C" const struct kvs_mac_kernels kvs_mac_kernels_cuda = {cu_supports, cu_work_elems, cu_match, cu_attend,
                                                                  cu_count, cu_supports_lean};
