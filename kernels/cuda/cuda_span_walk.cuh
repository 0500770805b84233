/* cuda_span_walk.cuh: the walk over a (row, KV head)'s selected keys that the span attention
 * kernels share (internal; included by kv_span.cu's attention_spans and kv_retro.cu's fused
 * attend, which take the same keys in the same order, 32 a tile): the cursor over the spans, the
 * lookup of a tile's keys and its gathered cp.async copies, and the merge of the splits' partials.
 * Device code only; nothing owned, no
 * errors (a span list is [n][2] int32 positions, backend.h kvs_span_list).
 */
#ifndef KVS_CUDA_SPAN_WALK_CUH
#define KVS_CUDA_SPAN_WALK_CUH

#include "kernels/backend.h"
#include "kernels/cuda/cuda_attn_device.cuh"

namespace {
/* Host side: the at_args of a span walk over the first n_seqs sequences of m (rotation offsets,
 * block_valid and inv_freq as m has them), partials in `part`: what attention_spans and the
 * fused Retro attend both launch with (each adds its own span arguments). */
static inline void span_at_args(at_args &a, const struct kvs_dbuf *q, const struct kvs_dbuf *kc,
                                const struct kvs_dbuf *vc, const struct kvs_attn_meta *m, int n_seqs, int n_heads,
                                int n_kv_heads, int block_size, float scale, float *part)
{
    a.q = (const float *)q->d;
    a.kc = (const bf16 *)kc->d;
    a.vc = (const bf16 *)vc->d;
    a.q_start = (const int32_t *)m->q_start->d;
    a.pos = (const int32_t *)m->pos->d;
    a.bt = (const int32_t *)m->block_tables->d;
    a.rot = m->rot_offsets ? (const int32_t *)m->rot_offsets->d : nullptr;
    a.valid = m->block_valid ? (const int32_t *)m->block_valid->d : nullptr;
    a.inv_freq = m->inv_freq ? (const float *)m->inv_freq->d : nullptr;
    a.n_seqs = n_seqs;
    a.max_blocks = m->max_blocks;
    a.n_heads = n_heads;
    a.n_kv = n_kv_heads;
    a.bs = block_size;
    a.G = n_heads / n_kv_heads;
    a.scale = scale;
    a.part = part;
}

/* The selected keys of a (row, KV head): span j clipped to the row, [lo, hi) with hi <= last + 1
 * (causal), concatenated in span order. A cursor names a key of that list: span j, offset o. */
struct span_cursor {
    int j, o;
};

/* span j's clipped start and length (0: empty) */
__device__ __forceinline__ int span_len(const int32_t *sp, int j, int last, int *lo)
{
    const int a = max(sp[2 * j], 0), b = min(sp[2 * j + 1], last + 1);
    *lo = a;
    return b > a ? b - a : 0;
}

/* the position of the key k keys after c (k >= 0), or -1 past the last span */
__device__ __forceinline__ int key_after(const int32_t *sp, int ns, int last, span_cursor c, int k)
{
    int j = c.j, o = c.o + k;
    while (j < ns) {
        int lo;
        const int len = span_len(sp, j, last, &lo);
        if (o < len) return lo + o;
        o -= len;
        j++;
    }
    return -1;
}

/* c moved k keys on (past the end: j = ns) */
__device__ __forceinline__ void cursor_advance(const int32_t *sp, int ns, int last, span_cursor &c, int k)
{
    int j = c.j, o = c.o + k;
    while (j < ns) {
        int lo;
        const int len = span_len(sp, j, last, &lo);
        if (o < len) break;
        o -= len;
        j++;
    }
    c.j = j;
    c.o = o;
}

/* The cursor of key k among spans a .. b-1, whose keys start at key `base` (base <= k): a warp scan
 * over the span lengths, 32 spans at a time (every lane ends with the same cursor; past span b-1:
 * j = ns). */
__device__ __forceinline__ span_cursor seek_range(const int32_t *sp, int a, int b, int ns, int last, long long k,
                                                  long long base)
{
    const int lane = threadIdx.x & 31;
    for (int c0 = a; c0 < b; c0 += 32) {
        int lo;
        const int len = c0 + lane < b ? span_len(sp, c0 + lane, last, &lo) : 0;
        long long inc = len;
        for (int o = 1; o < 32; o <<= 1) {
            const long long v = __shfl_up_sync(FULL, inc, o);
            if (lane >= o) inc += v;
        }
        const long long total = __shfl_sync(FULL, inc, 31);
        if (k < base + total) {
            const unsigned m = __ballot_sync(FULL, len > 0 && k >= base + inc - len && k < base + inc);
            const int src = __ffs((int)m) - 1;
            span_cursor c;
            c.j = c0 + src;
            c.o = (int)(k - base - __shfl_sync(FULL, inc - len, src));
            return c;
        }
        base += total;
    }
    span_cursor c;
    c.j = ns;
    c.o = 0;
    return c;
}

/* the cursor of key k (k < the total), the walk of main up to quest7: 32 spans a step from the
 * first, each step a dependent load and scan (a split's start deep in a long span list waits on
 * ns / 32 of them); kept as attention_spans' kind 1 for the A/B (kv_span.cu) */
__device__ __forceinline__ span_cursor cursor_seek_linear(const int32_t *sp, int ns, int last, long long k)
{
    return seek_range(sp, 0, ns, ns, last, k, 0);
}

/* Lane l's share of the spans, [*a, *b): ceil(ns / 32) consecutive spans from l ceil(ns / 32), and
 * their keys. The loads are independent of each other (unrolled: several in flight). */
__device__ __forceinline__ long long lane_span_keys(const int32_t *sp, int ns, int last, int *a, int *b)
{
    const int lane = threadIdx.x & 31, per = (ns + 31) >> 5;
    const int j0 = min(ns, lane * per), j1 = min(ns, j0 + per);
    long long sum = 0;
#pragma unroll 4
    for (int j = j0; j < j1; j++) {
        int lo;
        sum += span_len(sp, j, last, &lo);
    }
    *a = j0;
    *b = j1;
    return sum;
}

/* the cursor of key k (k < the total; past it: j = ns): each lane sums its share of the spans
 * (lane_span_keys), one warp scan finds the share that holds key k, and seek_range the span in it
 * (at most ceil(ns / 32) / 32 steps): the same cursor as cursor_seek_linear, with a dependent
 * chain of a few loads instead of ns / 32 */
__device__ __forceinline__ span_cursor cursor_seek(const int32_t *sp, int ns, int last, long long k)
{
    const int lane = threadIdx.x & 31;
    int a, b;
    const long long mine = lane_span_keys(sp, ns, last, &a, &b);
    long long inc = mine;
    for (int o = 1; o < 32; o <<= 1) {
        const long long v = __shfl_up_sync(FULL, inc, o);
        if (lane >= o) inc += v;
    }
    const unsigned m = __ballot_sync(FULL, k < inc); /* inc never decreases over the lanes */
    if (!m) {
        span_cursor c;
        c.j = ns;
        c.o = 0;
        return c;
    }
    const int src = __ffs((int)m) - 1;
    return seek_range(sp, __shfl_sync(FULL, a, src), __shfl_sync(FULL, b, src), ns, last, k,
                      __shfl_sync(FULL, inc - mine, src));
}

/* selected keys of a (row, KV head), 32 spans a step over the lanes (main's up to quest7: kind 1) */
__device__ __forceinline__ long long total_keys_strided(const int32_t *sp, int ns, int last)
{
    const int lane = threadIdx.x & 31;
    long long sum = 0;
    for (int j = lane; j < ns; j += 32) {
        int lo;
        sum += span_len(sp, j, last, &lo);
    }
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(FULL, sum, o);
    return sum;
}

/* selected keys of a (row, KV head): the lanes' shares (lane_span_keys), summed */
__device__ __forceinline__ long long total_keys(const int32_t *sp, int ns, int last)
{
    int a, b;
    long long sum = lane_span_keys(sp, ns, last, &a, &b);
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(FULL, sum, o);
    return sum;
}

/* What the copies of the tile of the 32 selected keys from cursor c need (tile_lookup's contract,
 * cuda_attn_device.cuh): lane l's key (its row, or -1 past the list or in a block's invalid tail;
 * its rotation offset, or KEY_PAD). contig: the 32 keys are consecutive positions from a multiple
 * of 16 in blocks of a multiple of 16 slots, where tile_issue's two-pointer copies apply (base0,
 * base1: the rows of the tile's first and 17th key); else the copies take each key's own row.
 * halves: contig also when each 16-key half alone is consecutive from a multiple of 16 (the two
 * halves anywhere): the two-pointer copies need no more (each half lies in one block, its rows
 * one base apart), and a tile of two kept 16-slot pages, Quest's usual tile, then skips the
 * per-key address arithmetic and shuffles of the gathered copies. Either way the same rows land
 * in the same shared slots (and keys that are not read are zero-filled), so the same bits. */
template <int HD>
__device__ __forceinline__ tile_meta span_lookup(const at_args &a, const int32_t *sp, int ns, int last,
                                                 span_cursor c, int kvh, const int32_t *bt, const int32_t *vt,
                                                 const int32_t *rt, bool *contig, bool halves = false)
{
    const int lane = threadIdx.x & 31;
    const int p = key_after(sp, ns, last, c, lane);
    tile_meta m;
    m.row = -1;
    m.info = KEY_PAD;
    long long brow = 0;
    if (p >= 0) {
        const int pb = p / a.bs, sl = p - pb * a.bs;
        brow = (((long long)bt[pb] * a.n_kv + kvh) * a.bs + sl) * HD;
        if (!vt || sl < vt[pb]) {
            m.row = brow;
            m.info = rt ? rt[pb] : 0;
        }
    }
    const int p0 = __shfl_sync(FULL, p, 0), p16 = __shfl_sync(FULL, p, 16);
    const int want = halves && lane >= 16 ? p16 + lane - 16 : p0 + lane;   /* lane's key in a contiguous tile */
    *contig = a.bs % 16 == 0 && p0 >= 0 && p0 % 16 == 0 && __all_sync(FULL, p == want || p < 0) && p16 >= 0 &&
              (!halves || p16 % 16 == 0);
    m.base0 = __shfl_sync(FULL, brow, 0);
    m.base1 = __shfl_sync(FULL, brow, 16);
    return m;
}

/* tile_issue's general copies (each key's row from the lane that looked it up): gathered keys */
template <int HD>
__device__ __forceinline__ void gather_issue(const at_args &a, const tile_meta &m, bf16 *dk, bf16 *dv, int kst, int *ko)
{
    constexpr int CH = HD / 8;
    ko[threadIdx.x & 31] = m.info;
#pragma unroll
    for (int idx = threadIdx.x & 31; idx < AT_TILE * CH; idx += 32) {
        const int j = idx / CH, c = idx % CH;
        const long long r = __shfl_sync(FULL, m.row, j);
        const bool ok = r >= 0;
        cp_async16(dk + j * kst + c * 8, ok ? a.kc + r + c * 8 : a.kc, ok ? 16 : 0);
        cp_async16(dv + j * kst + c * 8, ok ? a.vc + r + c * 8 : a.vc, ok ? 16 : 0);
    }
}

/* Stores one finished row of a span kernel's m-tile half h: lane (g, t) holds the row's columns
 * 2t, 2t + 1 of each 8-wide slice of o, mx its running max and ls its (quad-reduced) sum. With one
 * split: out = o / ls and lse (no key: 0 and -inf, backend.h). With several: the unnormalized
 * partial (o, max, sum) at part[orow * n_splits + split][HD + 2], which k_spans_merge combines. */
template <int HD>
__device__ __forceinline__ void span_store_row(const float (&o)[HD / 8][4], int h, float mx, float ls, int t,
                                               size_t orow, int n_splits, int split, float *out, float *lse,
                                               float *part)
{
    if (n_splits == 1) {
        const float inv = ls > 0.0f ? 1.0f / ls : 0.0f;
        float *op = out + orow * HD + 2 * t;
#pragma unroll
        for (int nd = 0; nd < HD / 8; nd++) {
            op[nd * 8] = o[nd][2 * h] * inv;
            op[nd * 8 + 1] = o[nd][2 * h + 1] * inv;
        }
        if (t == 0) lse[orow] = ls > 0.0f ? mx + logf(ls) : -INFINITY;
    } else {
        float *pp = part + (orow * n_splits + split) * (size_t)(HD + 2);
#pragma unroll
        for (int nd = 0; nd < HD / 8; nd++) {
            pp[nd * 8 + 2 * t] = o[nd][2 * h];
            pp[nd * 8 + 2 * t + 1] = o[nd][2 * h + 1];
        }
        if (t == 0) {
            pp[HD] = ls > 0.0f ? mx : -INFINITY;
            pp[HD + 1] = ls;
        }
    }
}

/* The staged merge of a (row, head)'s split partials (pp: n_splits x [hd values, m, l]), shared
 * by kv_span.cu's k_spans_merge and kv_retro.cu's k_retro_merge_sp so that the two give the same
 * bits: the whole block loads each split's (m, l) once into sm / sl and its weight exp(m - M)
 * into se (shared, n_splits <= their size), then every thread has the exact max M and
 * L = sum l exp(m - M) in increasing split order. Every thread of the block calls it (barriers). */
__device__ __forceinline__ void span_merge_stats(const float *__restrict__ pp, int n_splits, int hd, float *sm,
                                                 float *sl, float *se, float &M, float &L)
{
    for (int s = threadIdx.x; s < n_splits; s += blockDim.x) {
        sm[s] = pp[(size_t)s * (hd + 2) + hd];
        sl[s] = pp[(size_t)s * (hd + 2) + hd + 1];
    }
    __syncthreads();
    M = -INFINITY;
    for (int s = 0; s < n_splits; s++) M = fmaxf(M, sm[s]);
    for (int s = threadIdx.x; s < n_splits; s += blockDim.x) se[s] = sm[s] != -INFINITY ? __expf(sm[s] - M) : 0.0f;
    __syncthreads();
    L = 0.0f;
    if (M != -INFINITY)
        for (int s = 0; s < n_splits; s++)
            if (sm[s] != -INFINITY) L += sl[s] * se[s];
}

/* Dimension d of the same merge's weighted sum (sum over splits of value * se, 8 loads at a
 * time, increasing split order; 0 where M is -inf): the caller divides by L. */
__device__ __forceinline__ float span_merge_acc(const float *__restrict__ pp, int n_splits, int hd, int d,
                                                const float *sm, const float *se, float M)
{
    float A = 0.0f;
    if (M != -INFINITY)
        for (int s0 = 0; s0 < n_splits; s0 += 8) {
            float v[8];
#pragma unroll
            for (int k = 0; k < 8; k++)
                v[k] = s0 + k < n_splits && sm[s0 + k] != -INFINITY ? pp[(size_t)(s0 + k) * (hd + 2) + d] : 0.0f;
#pragma unroll
            for (int k = 0; k < 8; k++)
                if (s0 + k < n_splits && sm[s0 + k] != -INFINITY) A += v[k] * se[s0 + k];
        }
    return A;
}
}  // namespace

/* The splits' partials of each (row, head) (one block each) into out and lse, in split order;
 * defined in kv_span.cu, launched by attention_spans and Retro's fused attend. */
__global__ void k_spans_merge(const float *part, int n_splits, int hd, float *out, float *lse);
/* reads KVS_CUDA_SPAN_MERGE once (kv_span.cu); the merge's launchers call it first */
void kvs_cu_span_merge_env(void);
/* nonzero where attention_spans' kind (kvs_cuda_set_span_kernel, KVS_CUDA_SPAN_KERNEL) takes the
 * two-pointer copies for tiles of two 16-key halves (span_lookup's halves; kind 4): Retro's fused
 * attend follows it, so one knob switches both walks (kv_span.cu) */
int kvs_cu_span_halves(void);

#endif
