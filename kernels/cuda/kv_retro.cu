/* kv_retro.cu: the CUDA table of Retro's device bookkeeping (kernels/kv_retro.h), tested against the
 * CPU table and reference (kernels/cpu/kv_retro.c) by tests/gpu/test_cuda_kv_retro.c.
 *
 * reset   A[off .. off + n) = -1, one thread an entry.
 * spans   one block of RS_THREADS threads per (request, KV head). The newest row's spans are the
 *         selection, copied. Only the selected pages are walked (about 15% of the context), in
 *         ascending order, RS_THREADS at a time, a thread a page (a scan numbers the pages of a
 *         chunk of spans): m = its A before this step (cur: t - 1), then A = t (each page belongs
 *         to one thread: no hazard); an unselected current page gets A = t - 1. For each past
 *         row, a page is in the supplement when m < t' and its first position <= pos'; a run of
 *         adjacent such pages is one span (the reference merges adjacent pages the same way): a
 *         page whose predecessor (page p - 1) is out or unselected opens a span at the index a block scan gives it,
 *         every page of the run raises the span's end with atomicMax (ends grow with the page,
 *         so the last page's clipped end wins: the same spans as kvs_retro_supplement).
 *         The keys counted (own, supplement) go to two uint64 with one atomicAdd a block.
 * merge   one block per (row, head): attn_merge's arithmetic (kv_span.cu k_attn_merge2) with the
 *         cached row cidx[t] of the previous step's cache, then the row is copied to the next
 *         cache (the caches alternate by step: the gather is never overwritten while read).
 * step    the table's step (kernels/kv_retro.h): the fused attend with the mask step in its walk
 *         (fused_args fold) where one block reads each selected page, else k_retro_mask (the
 *         spans kernel's A / M / keys without the lists) before it; then k_retro_merge_sp (the
 *         splits' merge and the cache merge in one launch) or k_retro_merge (one split): fewer
 *         launches in the layer's dependent chain (their cost: bench/RESULTS.md, retro12).
 *
 * Every kernel is launched with kvs_cu_launch (programmatic dependent launch) and waits on the
 * grid dependency before it reads what earlier kernels (Quest's select, attention_spans) wrote.
 */
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "kernels/cuda/cuda_attn_device.cuh"
#include "kernels/cuda/cuda_internal.cuh"
#include "kernels/cuda/cuda_span_walk.cuh"
#include "kernels/kv_retro.h"

#define RS_THREADS 256

__global__ void k_retro_reset(int32_t *a, size_t n)
{
    grid_dep_wait();
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) a[i] = -1;
}

static void cu_retro_reset(struct kvs_backend *b, struct kvs_dbuf *A, size_t off, size_t n)
{
    KVS_ASSERT(off + n <= A->n);
    if (!n) return;
    CUDA_CHECK(kvs_cu_launch(k_retro_reset, (unsigned)((n + 255) / 256), 256, 0, b->stream, (int32_t *)A->d + off, n));
}

/* whether page p (first position p * ps) lies in one of the ascending spans sp[0 .. ns) */
__device__ __forceinline__ bool in_spans(const int32_t *sp, int ns, int lo)
{
    int a = 0, z = ns - 1, j = -1;
    while (a <= z) {   /* the last span starting at or before lo */
        const int mid = (a + z) >> 1;
        if (sp[2 * mid] <= lo) j = mid, a = mid + 1;
        else z = mid - 1;
    }
    return j >= 0 && lo < sp[2 * j + 1];
}

__global__ void __launch_bounds__(RS_THREADS)
k_retro_spans(const int32_t *__restrict__ sel_n, const int32_t *__restrict__ sel, const int32_t *__restrict__ req,
              int n_kv, int ms, int ps, int32_t *__restrict__ A, int a_layers, int a_layer, int max_pages,
              int32_t *__restrict__ n_spans, int32_t *__restrict__ spans, unsigned long long *__restrict__ keys,
              int32_t *__restrict__ m_out)
{
    typedef cub::BlockScan<int, RS_THREADS> scan_t;
    typedef cub::BlockReduce<long long, RS_THREADS> red_t;
    __shared__ union {
        typename scan_t::TempStorage scan;
        typename red_t::TempStorage red;
    } tmp;
    __shared__ int s_inc[RS_THREADS];
    __shared__ int s_base[64], s_carry[64];   /* per past row: spans opened, whether the last page was in */
    __shared__ int s_cum[RS_THREADS], s_first[RS_THREADS];   /* a chunk of spans: page offsets, first pages */
    __shared__ int s_page[RS_THREADS], s_lastp;               /* the walk's pages; the last one walked */
    grid_dep_wait();
    const int q = blockIdx.x / n_kv, g = blockIdx.x % n_kv, tid = threadIdx.x;
    const int row0 = req[5 * q], rows = req[5 * q + 1], pos = req[5 * q + 2], t = req[5 * q + 3], slot = req[5 * q + 4];
    const size_t ms2 = (size_t)ms * 2;
    const int32_t *sp = sel + ((size_t)q * n_kv + g) * ms2;
    const int nsel = sel_n[q * n_kv + g];
    int32_t *a = A + (((size_t)slot * a_layers + a_layer) * n_kv + g) * max_pages;
    const int cur = pos / ps, past = rows - 1;
    /* the newest row: the selection */
    const size_t tn = (size_t)(row0 + rows - 1) * n_kv + g;
    long long own = 0;
    for (int i = tid; i < 2 * nsel; i += RS_THREADS) spans[tn * ms2 + i] = sp[i];
    for (int i = tid; i < nsel; i += RS_THREADS) own += sp[2 * i + 1] - sp[2 * i];
    own = red_t(tmp.red).Sum(own);
    if (tid == 0) {
        n_spans[tn] = nsel;
        atomicAdd(&keys[0], (unsigned long long)own);
    }
    for (int j = tid; j < 64; j += RS_THREADS) s_base[j] = 0, s_carry[j] = 0;
    if (tid == 0) s_lastp = -2;
    __syncthreads();   /* tmp and the row states */
    long long sup = 0;
    /* the selected pages in ascending order: the spans RS_THREADS at a time, their pages (those
     * whose first position lies in the span, as in_spans has it) numbered by a scan, then walked
     * RS_THREADS at a time, a thread a page (found by a binary search over the chunk's offsets) */
    for (int i0 = 0; i0 < nsel; i0 += RS_THREADS) {
        const int i = i0 + tid;
        int np = 0, first = 0;
        if (i < nsel) {
            const int lo = max(sp[2 * i], 0), hi = min(sp[2 * i + 1], pos + 1);
            first = (lo + ps - 1) / ps;
            np = max((hi + ps - 1) / ps - first, 0);
        }
        int off, T;
        scan_t(tmp.scan).ExclusiveSum(np, off, T);
        s_cum[tid] = off;
        s_first[tid] = first;
        __syncthreads();   /* s_cum, s_first; tmp */
        const int n_in = min(RS_THREADS, nsel - i0);
        for (int k0 = 0; k0 < T; k0 += RS_THREADS) {
            const int k = k0 + tid, last = min(RS_THREADS, T - k0) - 1;
            const bool in = k < T;
            int p = -1;
            if (in) {   /* the last span of the chunk whose offset is <= k (it has pages: k < T) */
                int a0 = 0, z = n_in - 1;
                while (a0 < z) {
                    const int mid = (a0 + z + 1) >> 1;
                    if (s_cum[mid] <= k) a0 = mid; else z = mid - 1;
                }
                p = s_first[a0] + (k - s_cum[a0]);
            }
            /* the current page was loaded by the previous step's query (kvs_retro_mask_step) */
            const int m = !in ? 0 : p == cur ? t - 1 : a[p];
            if (in) a[p] = t;
            if (in && m_out) m_out[((size_t)q * n_kv + g) * max_pages + p] = m;
            s_page[tid] = p;
            for (int j = 0; j < past; j++) {
                const int back = past - j, tp = t - back, posp = pos - back;
                const int inc = in && m < tp && p * ps <= posp;
                s_inc[tid] = inc;
                __syncthreads();   /* s_inc, s_page; the row's state */
                /* a span opens at an included page whose page before is not included (or not selected) */
                const int prev = tid > 0 ? s_inc[tid - 1] && s_page[tid - 1] == p - 1 : s_carry[j] && s_lastp == p - 1;
                const int start = inc && !prev;
                int idx, total;
                scan_t(tmp.scan).ExclusiveSum(start, idx, total);
                const int base = s_base[j];
                int32_t *out = spans + ((size_t)(row0 + j) * n_kv + g) * ms2;
                const int hi = min((p + 1) * ps, posp + 1);
                if (start && base + idx < ms) out[2 * (base + idx)] = p * ps, out[2 * (base + idx) + 1] = hi;
                __syncthreads();   /* the opened spans are visible before their ends are raised; s_base read */
                const int kk = base + idx + start - 1;
                if (inc && !start && kk >= 0 && kk < ms) atomicMax(&out[2 * kk + 1], hi);
                if (inc) sup += hi - p * ps;
                if (tid == last) s_base[j] = base + total, s_carry[j] = inc;
                __syncthreads();   /* s_inc, tmp and the row's state are rewritten next */
            }
            if (tid == last) s_lastp = p;
            __syncthreads();   /* s_lastp; s_page and the chunk's offsets are rewritten next */
        }
    }
    /* the current page, when not selected, was still loaded by the previous step's query */
    if (tid == 0 && !in_spans(sp, nsel, cur * ps)) a[cur] = t - 1;
    if (past > 0) {
        sup = red_t(tmp.red).Sum(sup);
        if (tid == 0) atomicAdd(&keys[1], (unsigned long long)sup);
    }
    for (int j = tid; j < past; j += RS_THREADS) n_spans[(size_t)(row0 + j) * n_kv + g] = min(s_base[j], ms);
}

static void cu_retro_spans(struct kvs_backend *b, const struct kvs_dbuf *sel_n, const struct kvs_dbuf *sel,
                           const struct kvs_dbuf *req, int n_req, int n_kv_heads, int max_spans, int page_size,
                           struct kvs_dbuf *A, int a_layers, int a_layer, int max_pages, struct kvs_dbuf *n_spans,
                           struct kvs_dbuf *spans, struct kvs_dbuf *keys, struct kvs_dbuf *m_out)
{
    if (n_req <= 0) return;
    KVS_ASSERT(keys->n >= 4);
    CUDA_CHECK(kvs_cu_launch(k_retro_spans, (unsigned)(n_req * n_kv_heads), RS_THREADS, 0, b->stream,
                             (const int32_t *)sel_n->d, (const int32_t *)sel->d, (const int32_t *)req->d, n_kv_heads,
                             max_spans, page_size, (int32_t *)A->d, a_layers, a_layer, max_pages,
                             (int32_t *)n_spans->d, (int32_t *)spans->d, (unsigned long long *)keys->d,
                             m_out ? (int32_t *)m_out->d : nullptr));
}

/* The mask step of the fused path (kvs_retro_kernels step): what k_retro_spans does to A, M and the
 * keys counters, without the past rows' span lists (the fused attend reads the selection and M,
 * not the lists). One block per (request, KV head), a thread per selected span, its pages in
 * ascending order (each page lies in one span, so one thread: no hazard on A); the supplement's
 * keys are counted per page with the clip k_retro_spans applies, then one reduction a block. No
 * scan, one barrier pair, against k_retro_spans' scan and three barriers per chunk of pages and
 * past row. */
#define RM_THREADS 128

__global__ void __launch_bounds__(RM_THREADS)
k_retro_mask(const int32_t *__restrict__ sel_n, const int32_t *__restrict__ sel, const int32_t *__restrict__ req,
             int n_kv, int ms, int ps, int32_t *__restrict__ A, int a_layers, int a_layer, int max_pages,
             unsigned long long *__restrict__ keys, int32_t *__restrict__ m_out)
{
    typedef cub::BlockReduce<long long, RM_THREADS> red_t;
    __shared__ typename red_t::TempStorage tmp;
    grid_dep_wait();
    const int q = blockIdx.x / n_kv, g = blockIdx.x % n_kv, tid = threadIdx.x;
    const int rows = req[5 * q + 1], pos = req[5 * q + 2], t = req[5 * q + 3], slot = req[5 * q + 4];
    const int32_t *sp = sel + ((size_t)q * n_kv + g) * (size_t)ms * 2;
    const int nsel = sel_n[q * n_kv + g];
    int32_t *a = A + (((size_t)slot * a_layers + a_layer) * n_kv + g) * max_pages;
    int32_t *mo = m_out + ((size_t)q * n_kv + g) * max_pages;
    const int cur = pos / ps, past = rows - 1;
    long long own = 0, sup = 0;
    for (int i = tid; i < nsel; i += RM_THREADS) {
        own += sp[2 * i + 1] - sp[2 * i];
        const int lo = max(sp[2 * i], 0), hi = min(sp[2 * i + 1], pos + 1);
        for (int p = (lo + ps - 1) / ps; p * ps < hi; p++) {
            /* the current page was loaded by the previous step's query (kvs_retro_mask_step) */
            const int m = p == cur ? t - 1 : a[p];
            a[p] = t;
            mo[p] = m;
            for (int j = 0; j < past; j++) {
                const int back = past - j, posp = pos - back;
                if (m < t - back && p * ps <= posp) sup += min((p + 1) * ps, posp + 1) - p * ps;
            }
        }
    }
    /* the current page, when not selected (no thread above wrote it), was still loaded by the
     * previous step's query */
    if (tid == 0 && !in_spans(sp, nsel, cur * ps)) a[cur] = t - 1;
    own = red_t(tmp).Sum(own);
    __syncthreads();   /* tmp is reused */
    sup = red_t(tmp).Sum(sup);
    if (tid == 0) {
        atomicAdd(&keys[0], (unsigned long long)own);
        if (past > 0) atomicAdd(&keys[1], (unsigned long long)sup);
    }
}

__global__ void k_retro_merge(float *__restrict__ out, float *__restrict__ lse, const int32_t *__restrict__ cidx,
                              int n_heads, int hd, const float *__restrict__ o_prev, const float *__restrict__ l_prev,
                              int prev_rows, float *__restrict__ o_next, float *__restrict__ l_next)
{
    grid_dep_wait();   /* out and lse are attention_spans' */
    const size_t rh = blockIdx.x;
    const int t = (int)(rh / n_heads), h = (int)(rh % n_heads);
    const int c = cidx[t];
    float *oa = out + rh * hd;
    float *on = o_next + rh * hd;
    const float a = lse[rh];
    if (c < 0 || c >= prev_rows) {
        for (int d = threadIdx.x; d < hd; d += blockDim.x) on[d] = oa[d];
        if (threadIdx.x == 0) l_next[rh] = a;
        return;
    }
    const size_t crh = (size_t)c * n_heads + h;
    const float bl = l_prev[crh];
    const float *ob = o_prev + crh * hd;
    const float mx = fmaxf(a, bl);
    float wa = 0.0f, wb = 0.0f, l = -INFINITY;
    if (mx != -INFINITY) {
        const float ea = a == -INFINITY ? 0.0f : expf(a - mx), eb = bl == -INFINITY ? 0.0f : expf(bl - mx);
        const float sum = ea + eb;
        wa = ea / sum;
        wb = eb / sum;
        l = mx + logf(sum);
    }
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        const float v = (wa != 0.0f ? wa * oa[d] : 0.0f) + (wb != 0.0f ? wb * ob[d] : 0.0f);
        oa[d] = v;
        on[d] = v;
    }
    __syncthreads();   /* every thread has read lse[rh] */
    if (threadIdx.x == 0) lse[rh] = l, l_next[rh] = l;
}

/* The fused path's splits' merge and Retro's cache merge in one kernel (kvs_retro_kernels step):
 * one block per (row, head), k_spans_merge's staged arithmetic (kv_span.cu: the same operations in
 * the same split order) into registers, then k_retro_merge's with the cached row cidx[t], so the
 * results are bitwise those of the two launches (a float stored and read back is unchanged). */
#define RMS_MAX 512

__global__ void k_retro_merge_sp(const float *__restrict__ part, int n_splits, int hd, float *__restrict__ out,
                                 float *__restrict__ lse, const int32_t *__restrict__ cidx, int n_heads,
                                 const float *__restrict__ o_prev, const float *__restrict__ l_prev, int prev_rows,
                                 float *__restrict__ o_next, float *__restrict__ l_next)
{
    __shared__ float sm[RMS_MAX], sl[RMS_MAX], se[RMS_MAX];
    grid_dep_wait();   /* the partials are the fused attend's */
    const size_t rh = blockIdx.x;
    const int t = (int)(rh / n_heads), h = (int)(rh % n_heads);
    const float *pp = part + rh * n_splits * (size_t)(hd + 2);
    float M, L;
    span_merge_stats(pp, n_splits, hd, sm, sl, se, M, L);
    const float a = M == -INFINITY ? -INFINITY : M + logf(L);
    /* the cached side (k_retro_merge) */
    const int c = cidx[t];
    const bool merge = c >= 0 && c < prev_rows;
    const size_t crh = merge ? (size_t)c * n_heads + h : 0;
    const float bl = merge ? l_prev[crh] : -INFINITY;
    const float mx = fmaxf(a, bl);
    float wa = 0.0f, wb = 0.0f, l = -INFINITY;
    if (merge && mx != -INFINITY) {
        const float ea = a == -INFINITY ? 0.0f : expf(a - mx), eb = bl == -INFINITY ? 0.0f : expf(bl - mx);
        const float sum = ea + eb;
        wa = ea / sum;
        wb = eb / sum;
        l = mx + logf(sum);
    }
    const float *ob = o_prev + crh * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        const float A = span_merge_acc(pp, n_splits, hd, d, sm, se, M);
        float v = M == -INFINITY ? 0.0f : A / L;
        if (merge) v = (wa != 0.0f ? wa * v : 0.0f) + (wb != 0.0f ? wb * ob[d] : 0.0f);
        out[rh * hd + d] = v;
        o_next[rh * hd + d] = v;
    }
    if (threadIdx.x == 0) {
        const float lo = merge ? l : a;
        lse[rh] = lo;
        l_next[rh] = lo;
    }
}

static void cu_retro_merge(struct kvs_backend *b, struct kvs_dbuf *out, struct kvs_dbuf *lse,
                           const struct kvs_dbuf *cidx, int n, int n_heads, int head_dim, const struct kvs_dbuf *o_prev,
                           const struct kvs_dbuf *l_prev, int prev_rows, struct kvs_dbuf *o_next,
                           struct kvs_dbuf *l_next)
{
    if (n <= 0) return;
    const size_t qd = (size_t)n_heads * head_dim;
    KVS_ASSERT((size_t)n * qd <= out->n && (size_t)n * qd <= o_next->n && (size_t)n * n_heads <= l_next->n);
    KVS_ASSERT((size_t)prev_rows * qd <= o_prev->n && (size_t)prev_rows * n_heads <= l_prev->n);
    xh_forget(b, out->d);
    xh_forget(b, lse->d);
    xh_forget(b, o_next->d);
    xh_forget(b, l_next->d);
    CUDA_CHECK(kvs_cu_launch(k_retro_merge, (unsigned)((size_t)n * n_heads), head_dim < 128 ? head_dim : 128, 0,
                             b->stream, (float *)out->d, (float *)lse->d, (const int32_t *)cidx->d, n_heads, head_dim,
                             (const float *)o_prev->d, (const float *)l_prev->d, prev_rows, (float *)o_next->d,
                             (float *)l_next->d));
}

/* ---- the fused attention ----------------------------------------------------------------------
 * The span walk of attention_spans (kv_span.cu: the selected keys taken in span order, 32 a tile,
 * cp.async stages, tensor-core QK and PV, splits over grid y merged by k_spans_merge), with the
 * same cursor, lookup and gather helpers (cuda_span_walk.cuh). What differs: a block's m-tiles hold the
 * G heads of every row of the request (row-major: row r of the tile = window row r / G, head
 * r % G; grid z takes 32 rows at a time where the window has more), and each staged key carries
 * b = min(t - M[page] - 1, pos - position): the largest "back" (rows before the newest) that may
 * see it, so a tile row of window row j sees the key iff rows - 1 - j <= b (the newest: b >= 0
 * always; past row t': M < t' and position <= pos'). Scores of unseen keys become -inf before the
 * online softmax, which leaves a row that sees no key at 0 / -inf. */

#define RF_ST 2
#define RF_MIN_TILES 4
#define RF_MAX_SPLITS 256

struct fused_args {
    at_args a;                     /* q, kc, vc, q_start, pos, bt, n_seqs, max_blocks, n_heads, n_kv, bs, G, scale, part */
    const int32_t *sel_n, *sel;    /* the newest rows' selections [n_req][n_kv](x max_spans x 2) */
    const int32_t *req, *msel;     /* kvs_retro_kernels: req [n_req][5]; M [n_req][n_kv][max_pages] */
    int max_spans, max_pages, ps;
    /* fold != 0 (the table's step, where one block reads each selected page: grid z of 1): the
     * mask step rides the walk. A key's m is read from the masks A (slot, layer a_layer) instead
     * of msel, the page's first key's lane writes A = t and msel (M) once every lane of the warp
     * has used its m, the block's own and supplement keys go to keys, and split 0 sets an
     * unselected current page to t - 1: what k_retro_mask does, without its launch. */
    int fold, a_layers, a_layer;
    int32_t *A, *m_out;
    unsigned long long *keys;
    int chunk, n_splits;
    int halves;                    /* span_lookup's two-pointer copies for tiles of two 16-key halves (kvs_cu_span_halves) */
    float *out, *lse;
};

template <int HD, int MT>
__global__ void __launch_bounds__(32) k_retro_fused(const __grid_constant__ fused_args fa)
{
    constexpr int KST = HD + 8, ST = RF_ST;
    const at_args &a = fa.a;
    extern __shared__ __align__(16) unsigned char smraw[];
    bf16 *sk = (bf16 *)smraw;
    bf16 *sv = sk + (size_t)ST * AT_TILE * KST;
    int *soff = (int *)(sv + (size_t)ST * AT_TILE * KST); /* [ST][AT_TILE] KEY_PAD or 0 */
    int *sb = soff + ST * AT_TILE;                         /* [ST][AT_TILE] the key's b */

    const int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    const int q = blockIdx.x / a.n_kv, kvh = blockIdx.x % a.n_kv, split = blockIdx.y, wrow = blockIdx.z * MT * 16;
    grid_dep_wait();
    const int qs = a.q_start[q], rows = a.q_start[q + 1] - qs, nr = rows * a.G;
    if (wrow >= nr) return;
    const int last = a.pos[q] + rows - 1, t = fa.req[5 * q + 3];
    const int32_t *bt = a.bt + (size_t)q * a.max_blocks;
    const size_t pair = (size_t)q * a.n_kv + kvh;
    const int ns = fa.sel_n[pair];
    const int32_t *sp = fa.sel + pair * (size_t)fa.max_spans * 2;
    const int32_t *mq = fa.msel + pair * (size_t)fa.max_pages;
    const int cpage = last / fa.ps, past = rows - 1;
    int32_t *ga = nullptr, *mo = nullptr;
    if (fa.fold) {
        ga = fa.A + (((size_t)fa.req[5 * q + 4] * fa.a_layers + fa.a_layer) * a.n_kv + kvh) * fa.max_pages;
        mo = fa.m_out + pair * (size_t)fa.max_pages;
        /* the current page, when not selected (no lane below writes it), was still loaded by the
         * previous step's query (kvs_retro_mask_step) */
        if (split == 0 && lane == 0 && !in_spans(sp, ns, cpage * fa.ps)) ga[cpage] = t - 1;
    }
    const long long n_tiles_all = (total_keys(sp, ns, last) + AT_TILE - 1) / AT_TILE;
    const long long w0 = (long long)split * fa.chunk;
    const long long w1 = split == fa.n_splits - 1 ? n_tiles_all : min(n_tiles_all, w0 + fa.chunk);
    const int ntiles = w1 > w0 ? (int)(w1 - w0) : 0;

    span_cursor cur;
    cur.j = ns;
    cur.o = 0;
    if (ntiles > 0) cur = cursor_seek(sp, ns, last, w0 * AT_TILE);
    bool nxt_contig = false;
    int nxt_p = -1, nxt_m = 0;
    long long own = 0, sup = 0;   /* fold: this block's keys */
    /* the key's M is loaded here and first used at the tile's issue, one tile of compute later,
     * so its latency is not a stall before the current tile's compute */
    auto lookup = [&]() {
        const tile_meta tm = span_lookup<HD>(a, sp, ns, last, cur, kvh, bt, nullptr, nullptr, &nxt_contig, fa.halves != 0);
        const int p = key_after(sp, ns, last, cur, lane);
        const int pg = p / fa.ps;
        nxt_p = p;
        nxt_m = p < 0 ? 0 : fa.fold ? (pg == cpage ? t - 1 : ga[pg]) : mq[pg];
        cursor_advance(sp, ns, last, cur, AT_TILE);
        return tm;
    };
    auto issue = [&](const tile_meta &tm, bool contig, int p, int m, int it) {
        const int st = it % ST;
        bf16 *dk = sk + (size_t)st * AT_TILE * KST, *dv = sv + (size_t)st * AT_TILE * KST;
        m = min(m, t - 1);   /* M is A before this step: never t (the newest row sees every selected key) */
        const int b = p >= 0 ? min(t - m - 1, last - p) : -1;
        if (fa.fold) {
            own += p >= 0;
            sup += p >= 0 ? max(0, min(b, past)) : 0;   /* the past rows that see the key */
            __syncwarp();   /* every lane has used its A before the page's first lane rewrites it */
            if (p >= 0 && p % fa.ps == 0) ga[p / fa.ps] = t, mo[p / fa.ps] = m;
        }
        sb[st * AT_TILE + lane] = b;
        if (contig) tile_issue<HD, 32>(a, tm, dk, dv, KST, soff + st * AT_TILE);
        else gather_issue<HD>(a, tm, dk, dv, KST, soff + st * AT_TILE);
    };

    tile_meta nxt = lookup();
#pragma unroll
    for (int st = 0; st < ST - 1; st++) {
        if (st < ntiles) {
            issue(nxt, nxt_contig, nxt_p, nxt_m, st);
            nxt = lookup();
        }
        cp_async_commit();
    }

    uint32_t qa[MT][HD / 16][4];
    q_frags<HD, MT>(a, qs, 0, kvh, nr, wrow, lane, nullptr, qa);
    float m[MT][2], l[MT][2], o[MT][HD / 8][4];
    int lim[MT][2], back[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int r = wrow + mt * 16 + g + 8 * h;
            m[mt][h] = -INFINITY;
            l[mt][h] = 0.0f;
            lim[mt][h] = r < nr ? INT_MAX : -1;
            back[mt][h] = r < nr ? rows - 1 - r / a.G : INT_MAX;
        }
#pragma unroll
        for (int nd = 0; nd < HD / 8; nd++)
#pragma unroll
            for (int e = 0; e < 4; e++) o[mt][nd][e] = 0.0f;
    }

    for (int it = 0; it < ntiles; it++) {
        if (it + ST - 1 < ntiles) {
            issue(nxt, nxt_contig, nxt_p, nxt_m, it + ST - 1);
            nxt = lookup();
        }
        cp_async_commit();
        cp_async_wait<ST - 1>();
        __syncwarp();
        const int st = it % ST;
        const bf16 *tk = sk + (size_t)st * AT_TILE * KST;
        const bf16 *tv = sv + (size_t)st * AT_TILE * KST;
        const int *ko = soff + st * AT_TILE, *kb = sb + st * AT_TILE;
        float sc[MT][4][4];
        qk_tc<HD, MT>(tk, qa, sc, lane);
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int bk = kb[j * 8 + 2 * t4 + e];
#pragma unroll
                for (int mt = 0; mt < MT; mt++)
#pragma unroll
                    for (int h = 0; h < 2; h++)
                        if (back[mt][h] > bk) sc[mt][j][2 * h + e] = -INFINITY;
            }
        uint32_t pa[MT][2][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) softmax_tile<HD, true>(sc[mt], ko, 0, lim[mt], m[mt], l[mt], o[mt], pa[mt], lane);
        pv_tile<HD, MT>(tv, KST, pa, o, lane);
        __syncwarp();
    }
    cp_async_wait<0>();
    if (fa.fold) {
#pragma unroll
        for (int d = 16; d > 0; d >>= 1) {
            own += __shfl_xor_sync(FULL, own, d);
            sup += __shfl_xor_sync(FULL, sup, d);
        }
        if (lane == 0 && own) atomicAdd(&fa.keys[0], (unsigned long long)own);
        if (lane == 0 && sup) atomicAdd(&fa.keys[1], (unsigned long long)sup);
    }

#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float ls = l[mt][h];
            ls += __shfl_xor_sync(FULL, ls, 1);
            ls += __shfl_xor_sync(FULL, ls, 2);
            const int r = wrow + mt * 16 + g + 8 * h;
            if (r >= nr) continue;
            const size_t orow = (size_t)(qs + r / a.G) * a.n_heads + (size_t)kvh * a.G + r % a.G;
            span_store_row<HD>(o[mt], h, m[mt][h], ls, t4, orow, fa.n_splits, split, fa.out, fa.lse, a.part);
        }
}

template <int HD, int MT>
static void launch_fused(fused_args &x, int n_req, int zgroups, cudaStream_t st, int n_sms, long long w_max,
                         long long by_ws)
{
    static kvs_cu_resident resident_all;
    int &resident = *kvs_cu_resident_here(resident_all);
    const size_t smem = 2 * (size_t)RF_ST * AT_TILE * (HD + 8) * sizeof(bf16) + 2 * (size_t)RF_ST * AT_TILE * sizeof(int);
    if (!resident) {
        CUDA_CHECK(cudaFuncSetAttribute((const void *)k_retro_fused<HD, MT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)smem));
        int nb = 0;
        CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&nb, k_retro_fused<HD, MT>, 32, smem));
        if (nb < 1) kvs_panic(__FILE__, __LINE__, "cuda retro attend: kernel does not fit an SM (%zu bytes)", smem);
        resident = nb;
    }
    /* splits as attention_spans plans them (kv_span.cu plan_splits): as many as fit in one wave,
     * rounded down. Rounded up (main's plan until retro13; KVS_CUDA_RETRO_SPLITS=up keeps it for
     * the benches' A/B, read every call) the grid overran the resident blocks by up to a split per
     * pair, a short second wave the walk waited on (bench/RESULTS.md, retro13). */
    const long long pairs = (long long)n_req * x.a.n_kv * zgroups;
    const char *e = getenv("KVS_CUDA_RETRO_SPLITS");
    long long ns = ((long long)resident * n_sms + (e && !strcmp(e, "up") ? pairs - 1 : 0)) / pairs;
    const long long by_len = (w_max + RF_MIN_TILES - 1) / RF_MIN_TILES;
    if (ns > by_len) ns = by_len;
    if (ns > by_ws) ns = by_ws;
    if (ns > RF_MAX_SPLITS) ns = RF_MAX_SPLITS;
    if (ns < 1) ns = 1;
    x.chunk = (int)((w_max + ns - 1) / ns);
    if (x.chunk < 1) x.chunk = 1;
    x.n_splits = (int)((w_max + x.chunk - 1) / x.chunk);
    if (x.n_splits < 1) x.n_splits = 1;
    const dim3 grid((unsigned)((size_t)n_req * x.a.n_kv), (unsigned)x.n_splits, (unsigned)zgroups);
    CUDA_CHECK(kvs_cu_launch(k_retro_fused<HD, MT>, grid, 32, smem, st, x));
}

template <int HD>
static void launch_fused_hd(fused_args &x, int n_req, int rows_max, cudaStream_t st, int n_sms, long long w_max,
                            long long by_ws)
{
    const int nr = rows_max * x.a.G;
    if (nr <= 16) launch_fused<HD, 1>(x, n_req, 1, st, n_sms, w_max, by_ws);
    else launch_fused<HD, 2>(x, n_req, (nr + 31) / 32, st, n_sms, w_max, by_ws);
}

/* Retro's cache merge after the fused attend (kvs_retro_kernels step); NULL: attend alone. fold:
 * the mask step in the attend's walk (fused_args fold; A .. keys its arguments), else M is read
 * from msel as spans or k_retro_mask wrote it. */
struct cache_merge {
    const struct kvs_dbuf *cidx, *o_prev, *l_prev;
    int prev_rows;
    struct kvs_dbuf *o_next, *l_next;
    int fold, a_layers, a_layer;
    struct kvs_dbuf *A, *keys;
};

/* -ENOSYS for a shape the fused kernel does not take (checked before any launch) */
static int fused_takes(const struct kvs_attn_meta *m, int n_heads, int n_kv_heads, int head_dim)
{
    if (head_dim != 16 && head_dim != 64 && head_dim != 128) return -ENOSYS;
    if (!kvs_cu_attention_supported(n_heads, n_kv_heads, head_dim) || m->rot_offsets || m->block_valid) return -ENOSYS;
    return 0;
}

static void retro_attend_launch(struct kvs_backend *b, const struct kvs_dbuf *q, const struct kvs_dbuf *kc,
                                const struct kvs_dbuf *vc, const struct kvs_attn_meta *m, const struct kvs_dbuf *sel_n,
                                const struct kvs_dbuf *sel, int max_spans, const struct kvs_dbuf *req,
                                const struct kvs_dbuf *m_sel, int max_pages, int page_size, int n_req, int n_heads,
                                int n_kv_heads, int head_dim, int block_size, float scale, long long max_keys,
                                struct kvs_dbuf *out, struct kvs_dbuf *lse, const struct cache_merge *cm)
{
    int rows_max = 0;
    for (int s = 0; s < n_req; s++)
        rows_max = m->h_q_start[s + 1] - m->h_q_start[s] > rows_max ? m->h_q_start[s + 1] - m->h_q_start[s] : rows_max;
    const int n = m->h_q_start[n_req];
    KVS_ASSERT((size_t)n * n_heads * head_dim <= out->n && (size_t)n * n_heads <= lse->n);
    xh_forget(b, out->d);
    xh_forget(b, lse->d);
    fused_args x;
    memset(&x, 0, sizeof x);
    at_args &a = x.a;
    span_at_args(a, q, kc, vc, m, n_req, n_heads, n_kv_heads, block_size, scale, b->attn_ws);   /* no rotation: refused */
    x.sel_n = (const int32_t *)sel_n->d;
    x.sel = (const int32_t *)sel->d;
    x.req = (const int32_t *)req->d;
    x.msel = (const int32_t *)m_sel->d;
    x.max_spans = max_spans;
    x.max_pages = max_pages;
    x.ps = page_size;
    x.halves = kvs_cu_span_halves();
    x.out = (float *)out->d;
    x.lse = (float *)lse->d;
    if (cm && cm->fold) {
        KVS_ASSERT(rows_max * (n_heads / n_kv_heads) <= 32);   /* one block a selected page (grid z of 1) */
        x.fold = 1, x.a_layers = cm->a_layers, x.a_layer = cm->a_layer;
        x.A = (int32_t *)cm->A->d, x.m_out = (int32_t *)m_sel->d, x.keys = (unsigned long long *)cm->keys->d;
    }
    const long long w_max = (max_keys + AT_TILE - 1) / AT_TILE;
    const long long by_ws = (long long)(ATTN_WS_BYTES / sizeof(float) / ((size_t)n * n_heads * (head_dim + 2)));
    switch (head_dim) {
    case 16: launch_fused_hd<16>(x, n_req, rows_max, b->stream, b->n_sms, w_max, by_ws); break;
    case 64: launch_fused_hd<64>(x, n_req, rows_max, b->stream, b->n_sms, w_max, by_ws); break;
    default: launch_fused_hd<128>(x, n_req, rows_max, b->stream, b->n_sms, w_max, by_ws); break;
    }
    const unsigned mthreads = head_dim < 128 ? head_dim : 128;
    if (cm && x.n_splits > 1 && x.n_splits <= RMS_MAX) {   /* the two merges in one launch */
        const size_t qd = (size_t)n_heads * head_dim;
        KVS_ASSERT((size_t)n * qd <= cm->o_next->n && (size_t)n * n_heads <= cm->l_next->n);
        KVS_ASSERT((size_t)cm->prev_rows * qd <= cm->o_prev->n && (size_t)cm->prev_rows * n_heads <= cm->l_prev->n);
        xh_forget(b, cm->o_next->d);
        xh_forget(b, cm->l_next->d);
        CUDA_CHECK(kvs_cu_launch(k_retro_merge_sp, (unsigned)((size_t)n * n_heads), mthreads, 0, b->stream,
                                 (const float *)a.part, x.n_splits, head_dim, x.out, x.lse,
                                 (const int32_t *)cm->cidx->d, n_heads, (const float *)cm->o_prev->d,
                                 (const float *)cm->l_prev->d, cm->prev_rows, (float *)cm->o_next->d,
                                 (float *)cm->l_next->d));
        return;
    }
    kvs_cu_span_merge_env();
    if (x.n_splits > 1)
        CUDA_CHECK(kvs_cu_launch(k_spans_merge, (unsigned)((size_t)n * n_heads), mthreads, 0, b->stream,
                                 (const float *)a.part, x.n_splits, head_dim, x.out, x.lse));
    if (cm)
        cu_retro_merge(b, out, lse, cm->cidx, n, n_heads, head_dim, cm->o_prev, cm->l_prev, cm->prev_rows, cm->o_next,
                       cm->l_next);
}

static int cu_retro_attend(struct kvs_backend *b, const struct kvs_dbuf *q, const struct kvs_dbuf *kc,
                           const struct kvs_dbuf *vc, const struct kvs_attn_meta *m, const struct kvs_dbuf *sel_n,
                           const struct kvs_dbuf *sel, int max_spans, const struct kvs_dbuf *req,
                           const struct kvs_dbuf *m_sel, int max_pages, int page_size, int n_req, int n_heads,
                           int n_kv_heads, int head_dim, int block_size, float scale, long long max_keys,
                           struct kvs_dbuf *out, struct kvs_dbuf *lse)
{
    if (n_req <= 0) return 0;
    const int rc = fused_takes(m, n_heads, n_kv_heads, head_dim);
    if (rc) return rc;
    retro_attend_launch(b, q, kc, vc, m, sel_n, sel, max_spans, req, m_sel, max_pages, page_size, n_req, n_heads,
                        n_kv_heads, head_dim, block_size, scale, max_keys, out, lse, NULL);
    return 0;
}

/* kvs_retro_kernels step: the fused attend with the mask step in its walk (or k_retro_mask before
 * it, where several blocks read a page), and one merge launch (k_retro_merge_sp where the attend
 * split its keys, else k_retro_merge): two launches where spans + attend + merge take four */
static int cu_retro_step(struct kvs_backend *b, const struct kvs_dbuf *q, const struct kvs_dbuf *kc,
                         const struct kvs_dbuf *vc, const struct kvs_attn_meta *m, const struct kvs_dbuf *sel_n,
                         const struct kvs_dbuf *sel, int max_spans, const struct kvs_dbuf *req, struct kvs_dbuf *A,
                         int a_layers, int a_layer, struct kvs_dbuf *m_out, struct kvs_dbuf *keys, int max_pages,
                         int page_size, int n_req, int n_heads, int n_kv_heads, int head_dim, int block_size,
                         float scale, long long max_keys, const struct kvs_dbuf *cidx, const struct kvs_dbuf *o_prev,
                         const struct kvs_dbuf *l_prev, int prev_rows, struct kvs_dbuf *o_next, struct kvs_dbuf *l_next,
                         struct kvs_dbuf *out, struct kvs_dbuf *lse)
{
    if (n_req <= 0) return 0;
    const int rc = fused_takes(m, n_heads, n_kv_heads, head_dim);
    if (rc) return rc;
    KVS_ASSERT(m_out && keys->n >= 4);
    int rows_max = 0;
    for (int s = 0; s < n_req; s++)
        rows_max = m->h_q_start[s + 1] - m->h_q_start[s] > rows_max ? m->h_q_start[s + 1] - m->h_q_start[s] : rows_max;
    /* the mask step in the walk where one block reads each page (at most 32 window rows x heads of
     * a group: grid z of 1); KVS_CUDA_RETRO_MASK=kernel keeps k_retro_mask (the benches' A/B; read
     * every call, so a bench can switch it between runs) */
    const char *e = getenv("KVS_CUDA_RETRO_MASK");
    const int fold = rows_max * (n_heads / n_kv_heads) <= 32 && !(e && !strcmp(e, "kernel"));
    if (!fold)
        CUDA_CHECK(kvs_cu_launch(k_retro_mask, (unsigned)(n_req * n_kv_heads), RM_THREADS, 0, b->stream,
                                 (const int32_t *)sel_n->d, (const int32_t *)sel->d, (const int32_t *)req->d,
                                 n_kv_heads, max_spans, page_size, (int32_t *)A->d, a_layers, a_layer, max_pages,
                                 (unsigned long long *)keys->d, (int32_t *)m_out->d));
    const struct cache_merge cm = {cidx, o_prev, l_prev, prev_rows, o_next, l_next, fold, a_layers, a_layer, A, keys};
    retro_attend_launch(b, q, kc, vc, m, sel_n, sel, max_spans, req, m_out, max_pages, page_size, n_req, n_heads,
                        n_kv_heads, head_dim, block_size, scale, max_keys, out, lse, &cm);
    return 0;
}

extern "C" const struct kvs_retro_kernels kvs_retro_kernels_cuda = {"cuda", cu_retro_reset, cu_retro_spans,
                                                                    cu_retro_attend, cu_retro_merge, cu_retro_step};
