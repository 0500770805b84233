/* kv_quest.cu: the CUDA kernels of Quest's page selection (kernels/kv_quest.h), tested against
 * the CPU reference (kernels/cpu/kv_quest.c) by tests/gpu/test_cuda_kv_quest.c.
 *
 * digest_update  one block per (sequence, KV head, page slice), one thread per dimension: each
 *                page the step wrote is recomputed from its written slots (bf16 min/max are
 *                bf16 values: stored exactly, equal to the CPU's on the same keys).
 * score          one block per (row, KV head, slice of candidate pages), four warps, the slice
 *                sized for about eight blocks per SM (score_pages_per_block); the group's
 *                queries staged in shared memory; head_dim / 8 lanes score a page, each over 8
 *                dimensions (16-byte loads of kmin and kmax), four page groups' loads in flight
 *                per warp; fp32 sums reduced over the lanes (another order than the CPU's:
 *                rounding-level differences, so near-ties may rank differently; the test allows
 *                exactly that).
 * qdigest_update as digest_update, then the page's grid (kernels/kv_quest.h: the shared coding
 *                functions, so the codes are bitwise the CPU's): a block min / max reduction,
 *                one thread's params, every thread its dimension's two codes, packed by words.
 * qscore         the score's blocks and lanes over the codes: the group's query heads folded
 *                first into Qp = sum of max(q, 0) and Qn = sum of min(q, 0) per dimension
 *                (max(q a, q b) = max(q, 0) b + min(q, 0) a for a <= b: one pass over the
 *                digest for the whole group), each lane one 16-byte load of min codes and one of
 *                max codes (32 / 16 dimensions at 4 / 8 bits; the lane's Qp / Qn in registers),
 *                the grid's affine map taken out of the sum (one fma per code, q_code_1c),
 *                fp32 sums (another order and form than the CPU's: equal up to rounding).
 * select         one block of 1024 threads per (row, KV head): the row's order keys
 *                (kvs_quest_order_key) made once into shared memory where they fit (up to
 *                SEL_STAGED_MAX bytes: 128K-token rows and more), then a radix select (4 passes of
 *                8-bit digits, MSB first) finds the k-th largest
 *                score (warp 0 finds each digit's bin by a scan over the 256 counts); pages
 *                above it and the lowest-indexed ones equal to it are kept (a
 *                block scan over contiguous chunks ranks the ties in page order); the kept
 *                pages, as a bitmask in shared memory, become merged spans in page order
 *                through a second scan. Deterministic: no atomics decide any order.
 *
 * Each sequence s is scored with its last row's query (q row q_start[s + 1] - 1, read in the score
 * kernels: a Retro window's newest row without a gather launch; row s for one-row sequences).
 *
 * score_select  score (or qscore) then select; a digest refresh the policy hands it (a decode-only
 *                step) runs as one more slice of blocks of the score launch (cu_score_r): the
 *                page it rewrites is each row's current page, never a candidate. The fused
 *                form (k_quest_fsel: one block per (row, KV head), the keys in shared memory,
 *                then sel_run) lost the A/B (bench/RESULTS.md, quest7) and runs only when
 *                kvs_quest_cuda_select_path asks for it.
 *
 * Every kernel is launched with kvs_cu_launch (programmatic dependent launch) and waits on the
 * grid dependency before reading what earlier kernels wrote; what they write is read only by
 * later kernels (attention_spans reads the spans after its own wait).
 */
#include <cub/block/block_scan.cuh>

#include "kernels/cuda/cuda_internal.cuh"
#include "kernels/kv_quest.h"

#define QS_WARPS 4
#define QS_MIN_PAGES 64      /* candidate pages per score block: at least, and a multiple of */
#define QS_BLOCKS_PER_SM 8   /* score blocks the grid aims at per SM (the sweep in bench/RESULTS.md, quest5) */
#define SEL_THREADS 1024
#define SEL_SMALL_PAGES 0   /* steps whose longest row has at most this many candidate pages take 256-thread select blocks */
#define SEL_STAGED_MAX (160 * 1024)   /* shared bytes up to which select stages the keys */
#define FS_SMEM_MAX (200 * 1024)      /* the fused score + select's dynamic shared bytes, at most */

__device__ __forceinline__ uint32_t q_okey(float x)
{
    const uint32_t u = __float_as_uint(x);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ size_t q_phys_page(const int32_t *bt, int p, int bs, int ps)
{
    return (size_t)bt[p / bs] * (size_t)(bs / ps) + (size_t)((p % bs) / ps);
}

/* ---- digests ------------------------------------------------------------------------------- */

/* kvs_quest_cuda_serial_loads: nonzero = the loops of before (one dependent global load at a
 * time in a page's slots, the group's queries and the select's keys), for the bench's A/B in
 * one run; 0 (the default) = the batched loads below. Both give the same bits. */
__constant__ int qs_serial;
static int qs_serial_host = -1;   /* what qs_serial holds on the device; -1: not read from the environment yet */

extern "C" void kvs_quest_cuda_serial_loads(int on)
{
    qs_serial_host = on ? 1 : 0;
    CUDA_CHECK(cudaMemcpyToSymbol(qs_serial, &qs_serial_host, sizeof qs_serial_host));
}

/* KVS_QUEST_SERIAL_LOADS=1 in the environment sets the knob at the first launch (for whole-step
 * benches); host only, once */
static void qs_serial_env(void)
{
    if (qs_serial_host >= 0) return;
    const char *e = getenv("KVS_QUEST_SERIAL_LOADS");
    if (e && atoi(e)) kvs_quest_cuda_serial_loads(1);
    else qs_serial_host = 0;
}

#define QS_SLOTS 8   /* a page's slots loaded at once by a digest thread */

/* The element-wise min and max of dimension i of KV head g over slots first .. end-1 of one page
 * (a page lies in one KV block: one block-table read). The slots' loads are issued QS_SLOTS at a
 * time before any is used: the loop of one load per iteration waited on a memory round trip per
 * slot (16 at a full page), and the refresh slice of the score launch, the longest block of that
 * launch, was mostly that wait. fminf / fmaxf in the same slot order as the serial loop: the same
 * bits (a NaN key is skipped by both; the padding is NaN). */
__device__ __forceinline__ void slot_minmax(const bf16 *__restrict__ kc, const int32_t *__restrict__ bt, int first,
                                            int end, int g, int n_kv, int hd, int bs, int i, float &mn, float &mx)
{
    mn = INFINITY, mx = -INFINITY;
    if (first >= end) return;
    const bf16 *base = kc + (((size_t)bt[first / bs] * n_kv + g) * bs + first % bs) * hd + i;
    const int n = end - first;
    if (qs_serial) {
        for (int p = 0; p < n; p++) {
            const float x = __bfloat162float(base[(size_t)p * hd]);
            mn = fminf(mn, x);
            mx = fmaxf(mx, x);
        }
        return;
    }
    for (int p0 = 0; p0 < n; p0 += QS_SLOTS) {
        float x[QS_SLOTS];
#pragma unroll
        for (int k = 0; k < QS_SLOTS; k++) x[k] = p0 + k < n ? __bfloat162float(base[(size_t)(p0 + k) * hd]) : NAN;
#pragma unroll
        for (int k = 0; k < QS_SLOTS; k++) {
            mn = fminf(mn, x[k]);
            mx = fmaxf(mx, x[k]);
        }
    }
}

/* one bf16 digest page (bf16 min / max are bf16 values: stored exactly), threads over dimensions */
__device__ __forceinline__ void bd_page(const bf16 *__restrict__ kc, const int32_t *__restrict__ bt, int first,
                                        int end, int g, int n_kv, int hd, int bs, int ps, bf16 *__restrict__ dig)
{
    for (int i = threadIdx.x; i < hd; i += blockDim.x) {
        float mn, mx;
        slot_minmax(kc, bt, first, end, g, n_kv, hd, bs, i, mn, mx);
        bf16 *d = dig + (q_phys_page(bt, first, bs, ps) * n_kv + g) * 2 * hd;
        d[i] = __float2bfloat16(mn);
        d[hd + i] = __float2bfloat16(mx);
    }
}

__global__ void k_quest_digest(const bf16 *__restrict__ kc, const int32_t *__restrict__ q_start,
                               const int32_t *__restrict__ pos, const int32_t *__restrict__ bts, int max_blocks,
                               int n_kv, int hd, int bs, int ps, bf16 *__restrict__ dig)
{
    grid_dep_wait();
    const int s = blockIdx.x, g = blockIdx.y;
    const int n = q_start[s + 1] - q_start[s];
    if (n <= 0) return;
    const int p0 = pos[s], p1 = pos[s] + n;
    const int32_t *bt = bts + (size_t)s * max_blocks;
    for (int pg = p0 / ps + (int)blockIdx.z; pg * ps < p1; pg += (int)gridDim.z)
        bd_page(kc, bt, pg * ps, min((pg + 1) * ps, p1), g, n_kv, hd, bs, ps, dig);
}

static void cu_digest_update(struct kvs_backend *b, const struct kvs_dbuf *kc, const struct kvs_attn_meta *m,
                             int n_kv_heads, int head_dim, int block_size, int page_size, struct kvs_dbuf *dig)
{
    qs_serial_env();
    int most = 0;   /* pages the longest write touches */
    for (int s = 0; s < m->n_seqs; s++) {
        const int n = m->h_q_start[s + 1] - m->h_q_start[s];
        if (n <= 0) continue;
        const int pages = (m->h_pos[s] + n - 1) / page_size - m->h_pos[s] / page_size + 1;
        most = pages > most ? pages : most;
    }
    if (!most) return;
    xh_forget(b, dig->d);
    const dim3 grid((unsigned)m->n_seqs, (unsigned)n_kv_heads, (unsigned)(most < 32 ? most : 32));
    const int threads = (head_dim + 31) / 32 * 32;
    CUDA_CHECK(kvs_cu_launch(k_quest_digest, grid, threads, 0, b->stream, (const bf16 *)kc->d,
                             (const int32_t *)m->q_start->d, (const int32_t *)m->pos->d,
                             (const int32_t *)m->block_tables->d, m->max_blocks, n_kv_heads, head_dim, block_size,
                             page_size, (bf16 *)dig->d));
}

/* ---- scores -------------------------------------------------------------------------------- */

/* Candidate pages per score block: as many as give about QS_BLOCKS_PER_SM blocks per SM over the
 * (row, KV head) pairs, at least QS_MIN_PAGES. Each block stages (or folds) its group's queries
 * before its first load, and a block of a few pages is mostly that: 128 pages per block (two
 * loop iterations at 8 bits) left the quantized score at a third of the bandwidth
 * (bench/RESULTS.md, quest4); fewer, longer blocks keep every warp's loads streaming. The shape
 * depends only on (pairs, most), both fixed by the step's plan, so a recorded graph replays it. */
static int qs_fixed_pages, qs_blocks_per_sm = QS_BLOCKS_PER_SM;   /* kvs_quest_cuda_score_shape */

extern "C" void kvs_quest_cuda_score_shape(int pages_per_block, int blocks_per_sm)
{
    qs_fixed_pages = pages_per_block > 0 ? (pages_per_block + QS_MIN_PAGES - 1) / QS_MIN_PAGES * QS_MIN_PAGES : 0;
    qs_blocks_per_sm = blocks_per_sm > 0 ? blocks_per_sm : QS_BLOCKS_PER_SM;
}

static int score_pages_per_block(const struct kvs_backend *b, int pairs, int most)
{
    if (qs_fixed_pages) return qs_fixed_pages;
    const long target = (long)(b->n_sms > 0 ? b->n_sms : 1) * qs_blocks_per_sm;
    long chunks = (target + pairs - 1) / pairs;
    if (chunks < 1) chunks = 1;
    long ppb = ((long)most + chunks - 1) / chunks;
    ppb = (ppb + QS_MIN_PAGES - 1) / QS_MIN_PAGES * QS_MIN_PAGES;
    return ppb < QS_MIN_PAGES ? QS_MIN_PAGES : (int)ppb;
}

/* The physical pages of pages first + u P (u < U) that are below end (0 for the others): the
 * block-table reads of the next loop iteration, issued before this iteration's sums so that each
 * iteration waits on one memory round trip (the digests), not two (the table, then the digests). */
/* Index maps of the score loops: index v of [pg0, pg1) scores page map(v), none where map(v) < 0.
 * q_ident: v itself (every page); q_smap: the pages of the kept super-pages (the two-level
 * selection: v / N is a slot of the kept list, v % N a page of that super-page, below cur). */
struct q_ident {
    __device__ __forceinline__ int operator()(int v) const { return v; }
};
struct q_smap {
    const int *list;   /* kept super-page indices (shared memory) */
    int N, cur;
    __device__ __forceinline__ int operator()(int v) const
    {
        const int pg = list[v / N] * N + v % N;
        return pg < cur ? pg : -1;
    }
};

template <int U, int P, class M>
__device__ __forceinline__ void q_phys_ahead(size_t *ph, const int32_t *__restrict__ bt, int first, int end, int bs,
                                             int ps, M map)
{
#pragma unroll
    for (int u = 0; u < U; u++) {
        const int v = first + u * P, pg = v < end ? map(v) : -1;
        ph[u] = pg >= 0 ? q_phys_page(bt, pg * ps, bs, ps) : 0;
    }
}

/* L = hd / 8 lanes score a page, each over 8 dimensions read as one 16-byte load of kmin and one of
 * kmax; a warp scores 32 / L pages at a time, QS_UNROLL such groups with their loads issued
 * first (the digests are read once, so the kernel is bound by how many loads are in flight) */
#define QS_UNROLL 4

__device__ __forceinline__ void bf16x8(const uint4 &v, float *f)
{
    const __nv_bfloat162 *h = (const __nv_bfloat162 *)&v;
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const float2 t = __bfloat1622float2(h[k]);
        f[2 * k] = t.x, f[2 * k + 1] = t.y;
    }
}

/* sq[0 .. n) = qg[0 .. n) by the block (the group's queries for the bf16 scores): QS_SLOTS loads a
 * thread in flight before its stores (the strided loop waited on one round trip per element) */
__device__ __forceinline__ void q_stage_group(const float *__restrict__ qg, int n, float *sq)
{
    const int T = (int)blockDim.x;
    if (qs_serial) {
        for (int x = threadIdx.x; x < n; x += T) sq[x] = qg[x];
        return;
    }
    for (int x0 = threadIdx.x; x0 < n; x0 += QS_SLOTS * T) {
        float v[QS_SLOTS];
#pragma unroll
        for (int k = 0; k < QS_SLOTS; k++) v[k] = x0 + k * T < n ? qg[x0 + k * T] : 0.0f;
#pragma unroll
        for (int k = 0; k < QS_SLOTS; k++)
            if (x0 + k * T < n) sq[x0 + k * T] = v[k];
    }
}

/* Scores of pages pg0 .. pg1-1 of one (row, KV head) by the block's warps (warp of nwarps), the
 * group's queries sq [G][HD] staged in shared memory: each page's score to out[pg] (when out) and
 * its order key to okeys[pg] (when okeys). One body for the score kernel and the fused
 * score + select, so both give the same bits per page. */
template <int HD, class M = q_ident>
__device__ __forceinline__ void q_score_range(const float *sq, int G, const bf16 *__restrict__ dig,
                                              const int32_t *__restrict__ bt, int g, int n_kv, int bs, int ps,
                                              int pg0, int pg1, int warp, int nwarps, float *out, uint32_t *okeys,
                                              M map = M())
{
    constexpr int L = HD / 8, P = 32 / L;   /* lanes per page, pages per warp step */
    const int lane = threadIdx.x & 31, sub = lane / L, l = lane % L;
    const int step = nwarps * P * QS_UNROLL;
    size_t ph[QS_UNROLL];   /* this iteration's physical pages, looked up one iteration ahead */
    q_phys_ahead<QS_UNROLL, P>(ph, bt, pg0 + warp * P * QS_UNROLL + sub, pg1, bs, ps, map);
    for (int base = pg0 + warp * P * QS_UNROLL; base < pg1; base += step) {
        uint4 mn[QS_UNROLL] = {}, mx[QS_UNROLL] = {};
#pragma unroll
        for (int u = 0; u < QS_UNROLL; u++) {
            const int v = base + u * P + sub, pg = v < pg1 ? map(v) : -1;
            if (pg >= 0) {
                const uint4 *d = (const uint4 *)(dig + (ph[u] * n_kv + g) * 2 * HD);
                mn[u] = __ldcg(d + l);   /* L2 loads: read once, and coherent with a refresh earlier in the kernel */
                mx[u] = __ldcg(d + L + l);
            }
        }
        q_phys_ahead<QS_UNROLL, P>(ph, bt, base + step + sub, pg1, bs, ps, map);
#pragma unroll
        for (int u = 0; u < QS_UNROLL; u++) {
            const int v = base + u * P + sub, pg = v < pg1 ? map(v) : -1;
            float a[8], c[8], acc = 0.0f;
            bf16x8(mn[u], a);
            bf16x8(mx[u], c);
            for (int h = 0; h < G; h++) {
                const float *qh = sq + h * HD + 8 * l;
#pragma unroll
                for (int k = 0; k < 8; k++) acc += fmaxf(qh[k] * a[k], qh[k] * c[k]);
            }
#pragma unroll
            for (int o = L / 2; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
            if (l == 0 && pg >= 0) {
                if (out) out[pg] = acc;
                if (okeys) okeys[pg] = q_okey(acc);
            }
        }
    }
}

template <int HD>
__global__ void __launch_bounds__(32 * QS_WARPS)
k_quest_score(const float *__restrict__ q, const bf16 *__restrict__ dig, const int32_t *__restrict__ pos,
              const int32_t *__restrict__ bts, const int32_t *__restrict__ keep, int max_blocks, int n_heads,
              int n_kv, int bs, int ps, int max_pages, int ppb, float *__restrict__ scores,
              const bf16 *__restrict__ kc, const int32_t *__restrict__ wqs, bf16 *__restrict__ digw,
              const int32_t *__restrict__ qs)
{
    extern __shared__ float sq[];           /* [G][HD] */
    const int row = blockIdx.x / n_kv, g = blockIdx.x % n_kv, G = n_heads / n_kv;
    grid_dep_wait();
    const int cur = pos[row] / ps;
    if (wqs && blockIdx.y == gridDim.y - 1) {   /* the refresh slice (cu_score_r) */
        if (wqs[row + 1] - wqs[row] >= 1)
            bd_page(kc, bts + (size_t)row * max_blocks, cur * ps, pos[row] + 1, g, n_kv, HD, bs, ps, digw);
        return;
    }
    const int pg0 = (int)blockIdx.y * ppb;
    if (keep[row] > cur || pg0 >= cur) return;
    q_stage_group(q + ((size_t)(qs[row + 1] - 1) * n_heads + g * G) * HD, G * HD, sq);
    __syncthreads();
    q_score_range<HD>(sq, G, dig, bts + (size_t)row * max_blocks, g, n_kv, bs, ps, pg0, min(pg0 + ppb, cur),
                      threadIdx.x >> 5, QS_WARPS, scores + ((size_t)row * n_kv + g) * max_pages, nullptr);
}

/* wqs (device, NULL: none): the score kernels also refresh each row's current page (the page a
 * write ending at pos[row] touched, where wqs[row + 1] - wqs[row] >= 1: the caller guarantees that
 * those rows lie in that page, kv_quest.h score_select) in one more slice of
 * blocks (grid y = the last): that page is never a candidate, so no score block of the launch
 * reads what the refresh writes, and the refresh leaves the chain of dependent launches
 * (bench/RESULTS.md, quest7; the caller checks most > 0 and head_dim <= 32 * QS_WARPS). */
static void cu_score_r(struct kvs_backend *b, const struct kvs_dbuf *q, const struct kvs_dbuf *dig,
                       const struct kvs_attn_meta *m, const struct kvs_dbuf *keep, int n, int n_heads, int n_kv_heads,
                       int head_dim, int block_size, int page_size, int max_pages, struct kvs_dbuf *scores,
                       const struct kvs_dbuf *kc, const int32_t *wqs)
{
    qs_serial_env();
    if (n <= 0) return;
    int most = 0;
    for (int s = 0; s < n; s++) most = m->h_pos[s] / page_size > most ? m->h_pos[s] / page_size : most;
    if (!most) return;
    xh_forget(b, scores->d);
    if (wqs) xh_forget(b, dig->d);
    const int ppb = score_pages_per_block(b, n * n_kv_heads, most);
    const dim3 grid((unsigned)(n * n_kv_heads), (unsigned)((most + ppb - 1) / ppb + (wqs ? 1 : 0)));
    const size_t smem = (size_t)(n_heads / n_kv_heads) * head_dim * sizeof(float);
#define QS_ARGS                                                                                                   \
    grid, 32 * QS_WARPS, smem, b->stream, (const float *)q->d, (const bf16 *)dig->d, (const int32_t *)m->pos->d, \
        (const int32_t *)m->block_tables->d, (const int32_t *)keep->d, m->max_blocks, n_heads, n_kv_heads,       \
        block_size, page_size, max_pages, ppb, (float *)scores->d, wqs ? (const bf16 *)kc->d : nullptr, wqs,      \
        (bf16 *)dig->d, (const int32_t *)m->q_start->d
    switch (head_dim) {
    case 16: CUDA_CHECK(kvs_cu_launch(k_quest_score<16>, QS_ARGS)); break;
    case 32: CUDA_CHECK(kvs_cu_launch(k_quest_score<32>, QS_ARGS)); break;
    case 64: CUDA_CHECK(kvs_cu_launch(k_quest_score<64>, QS_ARGS)); break;
    case 128: CUDA_CHECK(kvs_cu_launch(k_quest_score<128>, QS_ARGS)); break;
    case 256: CUDA_CHECK(kvs_cu_launch(k_quest_score<256>, QS_ARGS)); break;
    default: kvs_panic(__FILE__, __LINE__, "cuda Quest scores: head_dim %d (16, 32, 64, 128 or 256)", head_dim);
    }
#undef QS_ARGS
}

static void cu_score(struct kvs_backend *b, const struct kvs_dbuf *q, const struct kvs_dbuf *dig,
                     const struct kvs_attn_meta *m, const struct kvs_dbuf *keep, int n, int n_heads, int n_kv_heads,
                     int head_dim, int block_size, int page_size, int max_pages, struct kvs_dbuf *scores)
{
    cu_score_r(b, q, dig, m, keep, n, n_heads, n_kv_heads, head_dim, block_size, page_size, max_pages, scores, NULL,
               NULL);
}

/* ---- quantized digests ------------------------------------------------------------------------ */

/* One page's quantized digest for KV head g, recomputed from slots first .. end-1 by the whole
 * block (blockDim >= hd and >= the page's 2 hd bits / 32 words; every thread calls it): the
 * exact min / max per dimension, a block min / max reduction, one thread's params, every thread
 * its dimension's two codes, packed by words. red, s_par, codes [2][hd]: the caller's shared
 * memory. Shared by the digest kernel and the fused score + select's refresh. */
__device__ __forceinline__ void qd_page(const bf16 *__restrict__ kc, const int32_t *__restrict__ bt, int first,
                                        int end, int g, int n_kv, int hd, int bs, int ps, int bits, size_t n_pages,
                                        uint32_t *__restrict__ qdig, float (*red)[32], uint32_t *s_par, uint8_t *codes)
{
    const int i = threadIdx.x, lane = i & 31, warp = i >> 5;
    const int levels = (1 << bits) - 1, per = 32 / bits, vw = hd * bits / 32, nw = (int)(blockDim.x >> 5);
    uint32_t *params = qdig + n_pages * (size_t)n_kv * 2 * vw;
    float mn = INFINITY, mx = -INFINITY;
    if (i < hd) slot_minmax(kc, bt, first, end, g, n_kv, hd, bs, i, mn, mx);
    /* the page's lo / hi: min and max are exact, so any reduction order gives the CPU's */
    float lo = mn, hi = mx;
    for (int o = 16; o > 0; o >>= 1) {
        lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, o));
        hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, o));
    }
    if (lane == 0) red[0][warp] = lo, red[1][warp] = hi;
    __syncthreads();
    if (i == 0) {
        for (int w = 1; w < nw; w++) lo = fminf(lo, red[0][w]), hi = fmaxf(hi, red[1][w]);
        *s_par = kvs_qd_params(lo, hi, levels);
    }
    __syncthreads();
    const uint32_t par = *s_par;
    const size_t ph = q_phys_page(bt, first, bs, ps) * n_kv + g;
    if (i < hd) {
        const float l = kvs_qd_f16_to_f32(par & 0xFFFFu), sc = kvs_qd_f16_to_f32(par >> 16);
        const bool ok = par != KVS_QD_UNBOUNDED;
        codes[i] = ok ? (uint8_t)kvs_qd_code_down(mn, l, sc, levels) : 0;
        codes[hd + i] = ok ? (uint8_t)kvs_qd_code_up(mx, l, sc, levels) : 0;
    }
    __syncthreads();
    if (i < 2 * vw) {   /* word i of the min then max vectors */
        const int v = i / vw, w = i % vw;
        uint32_t word = 0;
        for (int k = 0; k < per; k++) word |= (uint32_t)codes[v * hd + w * per + k] << (k * bits);
        qdig[ph * 2 * vw + i] = word;
    }
    if (i == 0) params[ph] = par;
    __syncthreads();   /* codes and red are reused by the next page */
}

__global__ void k_quest_qdigest(const bf16 *__restrict__ kc, const int32_t *__restrict__ q_start,
                                const int32_t *__restrict__ pos, const int32_t *__restrict__ bts, int max_blocks,
                                int n_kv, int hd, int bs, int ps, int bits, size_t n_pages, uint32_t *__restrict__ qdig)
{
    __shared__ float red[2][32];
    __shared__ uint32_t s_par;
    extern __shared__ uint8_t codes[];   /* [2][hd] */
    grid_dep_wait();
    const int s = blockIdx.x, g = blockIdx.y;
    const int n = q_start[s + 1] - q_start[s];
    if (n <= 0) return;   /* block-uniform */
    const int p0 = pos[s], p1 = pos[s] + n;
    const int32_t *bt = bts + (size_t)s * max_blocks;
    for (int pg = p0 / ps + (int)blockIdx.z; pg * ps < p1; pg += (int)gridDim.z)
        qd_page(kc, bt, pg * ps, min((pg + 1) * ps, p1), g, n_kv, hd, bs, ps, bits, n_pages, qdig, red, &s_par,
                codes);
}

static void cu_qdigest_update(struct kvs_backend *b, const struct kvs_dbuf *kc, const struct kvs_attn_meta *m,
                              int n_kv_heads, int head_dim, int block_size, int page_size, int bits, size_t n_pages,
                              struct kvs_dbuf *qdig)
{
    qs_serial_env();
    int most = 0;
    for (int s = 0; s < m->n_seqs; s++) {
        const int n = m->h_q_start[s + 1] - m->h_q_start[s];
        if (n <= 0) continue;
        const int pages = (m->h_pos[s] + n - 1) / page_size - m->h_pos[s] / page_size + 1;
        most = pages > most ? pages : most;
    }
    if (!most) return;
    if (head_dim > 1024 || 2 * (head_dim * bits / 32) > 1024)
        kvs_panic(__FILE__, __LINE__, "cuda Quest quantized digests: head_dim %d", head_dim);
    xh_forget(b, qdig->d);
    const dim3 grid((unsigned)m->n_seqs, (unsigned)n_kv_heads, (unsigned)(most < 32 ? most : 32));
    int threads = (head_dim + 31) / 32 * 32;
    const int words = 2 * head_dim * bits / 32;
    if (threads < words) threads = (words + 31) / 32 * 32;
    CUDA_CHECK(kvs_cu_launch(k_quest_qdigest, grid, threads, (size_t)2 * head_dim, b->stream, (const bf16 *)kc->d,
                             (const int32_t *)m->q_start->d, (const int32_t *)m->pos->d,
                             (const int32_t *)m->block_tables->d, m->max_blocks, n_kv_heads, head_dim, block_size,
                             page_size, bits, n_pages, (uint32_t *)qdig->d));
}

template <int V> struct q_words;
template <> struct q_words<4> { typedef uint4 T; };
template <> struct q_words<2> { typedef uint2 T; };
template <> struct q_words<1> { typedef uint32_t T; };

/* code k of word w as the float 1 + c / 2^BITS (c placed under the exponent of 1.0: one shift,
 * one and-or): exact, and no integer-to-float conversion */
template <int BITS>
__device__ __forceinline__ float q_code_1c(uint32_t w, int k)
{
    const int sh = 23 - BITS - k * BITS;
    const uint32_t x = sh >= 0 ? w << sh : w >> -sh;
    return __uint_as_float((x & (((1u << BITS) - 1) << (23 - BITS))) | 0x3F800000u);
}

/* score = sum_i Qp_i dmax_i + Qn_i dmin_i with d = lo + c scale, computed as
 * lo sum_i (Qp_i + Qn_i) + scale 2^BITS sum_i (Qp_i (1 + cmax_i / 2^BITS) + Qn_i (1 + cmin_i / 2^BITS) - Qp_i - Qn_i):
 * one fma per code; each lane's own sum of Qp + Qn is taken off before the lanes' reduction (the
 * terms it cancels are of the lane's size). Equal to the CPU's up to rounding. */
/* The group's queries folded for the quantized score: sqp[i] = sum of max(q, 0), sqn[i] = sum of
 * min(q, 0) over the group's heads, in increasing head */
template <int HD>
__device__ __forceinline__ void q_fold_group(const float *__restrict__ q, int row, int g, int G, int n_heads,
                                             float *sqp, float *sqn)
{
    const float *qg = q + ((size_t)row * n_heads + g * G) * HD;
    for (int i = threadIdx.x; i < HD; i += blockDim.x) {
        float p = 0.0f, n = 0.0f;
        if (qs_serial) {
            for (int h = 0; h < G; h++) {
                const float x = qg[(size_t)h * HD + i];
                p += fmaxf(x, 0.0f);
                n += fminf(x, 0.0f);
            }
        } else {   /* the heads' loads first (QS_SLOTS at a time), then the sums in the same head order */
            for (int h0 = 0; h0 < G; h0 += QS_SLOTS) {
                float x[QS_SLOTS];
#pragma unroll
                for (int k = 0; k < QS_SLOTS; k++) x[k] = h0 + k < G ? qg[(size_t)(h0 + k) * HD + i] : 0.0f;
#pragma unroll
                for (int k = 0; k < QS_SLOTS; k++)
                    if (h0 + k < G) p += fmaxf(x[k], 0.0f), n += fminf(x[k], 0.0f);
            }
        }
        sqp[i] = p, sqn[i] = n;
    }
}

/* Quantized scores of pages pg0 .. pg1-1 of one (row, KV head) by the block's warps, the folded
 * queries in shared memory; outputs as q_score_range (one body for both kernels). */
template <int HD, int BITS, class M = q_ident>
__device__ __forceinline__ void q_qscore_range(const float *sqp, const float *sqn, const uint32_t *__restrict__ qdig,
                                               size_t n_pages, const int32_t *__restrict__ bt, int g, int n_kv,
                                               int bs, int ps, int pg0, int pg1, int warp, int nwarps, float *out,
                                               uint32_t *okeys, M map = M())
{
    constexpr int NW = HD * BITS / 32;            /* words per code vector */
    constexpr int V = NW >= 4 ? 4 : NW;           /* words per lane load */
    constexpr int L = NW / V, P = 32 / L;         /* lanes per page, pages per warp step */
    constexpr int PER = 32 / BITS, DL = V * PER;  /* dimensions per word, per lane */
    typedef typename q_words<V>::T vec;
    const int lane = threadIdx.x & 31, sub = lane / L, l = lane % L;
    /* a lane always scores the same dimensions: its Qp / Qn live in registers */
    float rp[DL], rn[DL], rq = 0.0f;
#pragma unroll
    for (int j = 0; j < DL; j++) rp[j] = sqp[l * DL + j], rn[j] = sqn[l * DL + j], rq += rp[j] + rn[j];
    float qsum = rq;
#pragma unroll
    for (int o = L / 2; o > 0; o >>= 1) qsum += __shfl_xor_sync(0xffffffffu, qsum, o);
    const uint32_t *params = qdig + n_pages * (size_t)n_kv * 2 * NW;
    const int step = nwarps * P * QS_UNROLL;
    size_t php[QS_UNROLL];   /* this iteration's physical pages, looked up one iteration ahead */
    q_phys_ahead<QS_UNROLL, P>(php, bt, pg0 + warp * P * QS_UNROLL + sub, pg1, bs, ps, map);
    for (int base = pg0 + warp * P * QS_UNROLL; base < pg1; base += step) {
        vec mn[QS_UNROLL], mx[QS_UNROLL];
        uint32_t par[QS_UNROLL];
#pragma unroll
        for (int u = 0; u < QS_UNROLL; u++) {
            const int v = base + u * P + sub, pg = v < pg1 ? map(v) : -1;
            par[u] = KVS_QD_UNBOUNDED;
            if (pg >= 0) {
                const size_t ph = php[u] * n_kv + g;
                const vec *d = (const vec *)(qdig + ph * 2 * NW);
                mn[u] = __ldcg(d + l);   /* as q_score_range */
                mx[u] = __ldcg(d + L + l);
                par[u] = __ldcg(params + ph);
            }
        }
        q_phys_ahead<QS_UNROLL, P>(php, bt, base + step + sub, pg1, bs, ps, map);
#pragma unroll
        for (int u = 0; u < QS_UNROLL; u++) {
            const int v = base + u * P + sub, pg = v < pg1 ? map(v) : -1;
            const uint32_t *wn = (const uint32_t *)&mn[u], *wx = (const uint32_t *)&mx[u];
            float acc = 0.0f;
            if (pg >= 0 && par[u] != KVS_QD_UNBOUNDED) {
#pragma unroll
                for (int w = 0; w < V; w++)
#pragma unroll
                    for (int k = 0; k < PER; k++) {
                        acc = fmaf(rp[w * PER + k], q_code_1c<BITS>(wx[w], k), acc);
                        acc = fmaf(rn[w * PER + k], q_code_1c<BITS>(wn[w], k), acc);
                    }
                acc -= rq;
            }
#pragma unroll
            for (int o = L / 2; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
            if (l == 0 && pg >= 0) {
                const float lo = kvs_qd_f16_to_f32(par[u] & 0xFFFFu), sc = kvs_qd_f16_to_f32(par[u] >> 16);
                const float v = par[u] == KVS_QD_UNBOUNDED ? INFINITY : fmaf(lo, qsum, sc * (float)(1 << BITS) * acc);
                if (out) out[pg] = v;
                if (okeys) okeys[pg] = q_okey(v);
            }
        }
    }
}

/* score = sum_i Qp_i dmax_i + Qn_i dmin_i with d = lo + c scale, computed as
 * lo sum_i (Qp_i + Qn_i) + scale 2^BITS sum_i (Qp_i (1 + cmax_i / 2^BITS) + Qn_i (1 + cmin_i / 2^BITS) - Qp_i - Qn_i):
 * one fma per code; each lane's own sum of Qp + Qn is taken off before the lanes' reduction (the
 * terms it cancels are of the lane's size). Equal to the CPU's up to rounding. */
template <int HD, int BITS>
__global__ void __launch_bounds__(32 * QS_WARPS)
k_quest_qscore(const float *__restrict__ q, const uint32_t *__restrict__ qdig, size_t n_pages,
               const int32_t *__restrict__ pos, const int32_t *__restrict__ bts, const int32_t *__restrict__ keep,
               int max_blocks, int n_heads, int n_kv, int bs, int ps, int max_pages, int ppb,
               float *__restrict__ scores, const bf16 *__restrict__ kc, const int32_t *__restrict__ wqs,
               uint32_t *__restrict__ qdigw, const int32_t *__restrict__ qs)
{
    __shared__ float sqp[HD], sqn[HD];
    const int row = blockIdx.x / n_kv, g = blockIdx.x % n_kv, G = n_heads / n_kv;
    grid_dep_wait();
    const int cur = pos[row] / ps;
    if constexpr (HD <= 32 * QS_WARPS) {   /* the refresh slice (cu_score_r): qd_page wants a thread per dimension */
        __shared__ float red[2][32];
        __shared__ uint32_t s_par;
        __shared__ uint8_t codes[2 * HD];
        if (wqs && blockIdx.y == gridDim.y - 1) {
            if (wqs[row + 1] - wqs[row] >= 1)
                qd_page(kc, bts + (size_t)row * max_blocks, cur * ps, pos[row] + 1, g, n_kv, HD, bs, ps, BITS, n_pages,
                        qdigw, red, &s_par, codes);
            return;
        }
    }
    const int pg0 = (int)blockIdx.y * ppb;
    if (keep[row] > cur || pg0 >= cur) return;
    q_fold_group<HD>(q, qs[row + 1] - 1, g, G, n_heads, sqp, sqn);
    __syncthreads();
    q_qscore_range<HD, BITS>(sqp, sqn, qdig, n_pages, bts + (size_t)row * max_blocks, g, n_kv, bs, ps, pg0,
                             min(pg0 + ppb, cur), threadIdx.x >> 5, QS_WARPS,
                             scores + ((size_t)row * n_kv + g) * max_pages, nullptr);
}

/* as cu_score_r (wqs: the refresh slice) */
static void cu_qscore_r(struct kvs_backend *b, const struct kvs_dbuf *q, const struct kvs_dbuf *qdig,
                        const struct kvs_attn_meta *m, const struct kvs_dbuf *keep, int n, int n_heads, int n_kv_heads,
                        int head_dim, int block_size, int page_size, int bits, size_t n_pages, int max_pages,
                        struct kvs_dbuf *scores, const struct kvs_dbuf *kc, const int32_t *wqs)
{
    qs_serial_env();
    if (n <= 0) return;
    int most = 0;
    for (int s = 0; s < n; s++) most = m->h_pos[s] / page_size > most ? m->h_pos[s] / page_size : most;
    if (!most) return;
    xh_forget(b, scores->d);
    if (wqs) xh_forget(b, qdig->d);
    const int ppb = score_pages_per_block(b, n * n_kv_heads, most);
    const dim3 grid((unsigned)(n * n_kv_heads), (unsigned)((most + ppb - 1) / ppb + (wqs ? 1 : 0)));
#define QQ_ARGS                                                                                                 \
    grid, 32 * QS_WARPS, 0, b->stream, (const float *)q->d, (const uint32_t *)qdig->d, n_pages,                \
        (const int32_t *)m->pos->d, (const int32_t *)m->block_tables->d, (const int32_t *)keep->d, m->max_blocks, \
        n_heads, n_kv_heads, block_size, page_size, max_pages, ppb, (float *)scores->d,                        \
        wqs ? (const bf16 *)kc->d : nullptr, wqs, (uint32_t *)qdig->d, (const int32_t *)m->q_start->d
#define QQ_CASE(H, B)                                                        \
    if (head_dim == H && bits == B) {                                         \
        CUDA_CHECK(kvs_cu_launch(k_quest_qscore<H, B>, QQ_ARGS));                  \
        return;                                                               \
    }
    QQ_CASE(16, 4); QQ_CASE(32, 4); QQ_CASE(64, 4); QQ_CASE(128, 4); QQ_CASE(256, 4);
    QQ_CASE(16, 8); QQ_CASE(32, 8); QQ_CASE(64, 8); QQ_CASE(128, 8); QQ_CASE(256, 8);
#undef QQ_CASE
#undef QQ_ARGS
    kvs_panic(__FILE__, __LINE__, "cuda Quest quantized scores: head_dim %d at %d bits (16, 32, 64, 128 or 256)",
              head_dim, bits);
}

static void cu_qscore(struct kvs_backend *b, const struct kvs_dbuf *q, const struct kvs_dbuf *qdig,
                      const struct kvs_attn_meta *m, const struct kvs_dbuf *keep, int n, int n_heads, int n_kv_heads,
                      int head_dim, int block_size, int page_size, int bits, size_t n_pages, int max_pages,
                      struct kvs_dbuf *scores)
{
    cu_qscore_r(b, q, qdig, m, keep, n, n_heads, n_kv_heads, head_dim, block_size, page_size, bits, n_pages,
                max_pages, scores, NULL, NULL);
}

/* ---- top-k and spans ------------------------------------------------------------------------- */

__device__ __forceinline__ bool bit_at(const uint32_t *bits, int j) { return (bits[j >> 5] >> (j & 31)) & 1u; }

/* The top-k and spans of one (row, KV head) by a block of T threads: bits (cur + 1 bits, zeroed
 * by the caller before its last barrier) receives the kept pages; STAGED reads the order keys
 * from sk (shared memory), the unstaged form converts sc (global) on every pass. One body for
 * the select kernel and the fused score + select. */
template <int T, bool STAGED>
__device__ __forceinline__ void sel_run(const float *__restrict__ sc, const uint32_t *sk, uint32_t *bits, int ctx,
                                        int cur, int top, int ps, int max_spans, int32_t *__restrict__ sp,
                                        int32_t *__restrict__ n_spans_out)
{
    typedef cub::BlockScan<int, T> scan_t;
    __shared__ int hist[256];
    __shared__ int s_sel[2];               /* the digit's bin, keys still to take inside it */
    __shared__ typename scan_t::TempStorage scan_tmp;
    const int tid = threadIdx.x;
#define SEL_KEY(j) (STAGED ? sk[j] : q_okey(sc[j]))

    /* radix select of the top-th largest key: prefix / mask hold the digits fixed so far */
    uint32_t prefix = 0, mask = 0;
    int remaining = top;               /* keys to take among those matching the prefix */
    if (top > 0) {
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int x = tid; x < 256; x += T) hist[x] = 0;
            __syncthreads();
            /* warp-aggregated counts: the leading digits of close scores agree, so plain atomics
             * would serialise on a few bins */
            for (int j0 = 0; j0 < cur; j0 += T) {
                const int j = j0 + tid;
                int bin = -1;
                if (j < cur) {
                    const uint32_t k = SEL_KEY(j);
                    if ((k & mask) == prefix) bin = (int)((k >> shift) & 255);
                }
                const unsigned same = __match_any_sync(0xffffffffu, bin);
                if (bin >= 0 && (tid & 31) == __ffs((int)same) - 1) atomicAdd(&hist[bin], __popc(same));
            }
            __syncthreads();
            if (tid < 32) {   /* the digit: the highest bin whose count from the top reaches remaining */
                int sum = 0;
#pragma unroll
                for (int k = 0; k < 8; k++) sum += hist[255 - 8 * tid - k];
                int incl = sum;
                for (int o = 1; o < 32; o <<= 1) {
                    const int v = __shfl_up_sync(0xffffffffu, incl, o);
                    if (tid >= o) incl += v;
                }
                const unsigned hit = __ballot_sync(0xffffffffu, incl >= remaining);
                if (tid == (hit ? __ffs((int)hit) - 1 : 31)) {
                    int above = incl - sum, d = 255 - 8 * tid;
                    for (int k = 0; k < 7 && above + hist[d] < remaining; k++) above += hist[d--];
                    s_sel[0] = d;
                    s_sel[1] = remaining - above;
                }
            }
            __syncthreads();
            prefix |= (uint32_t)s_sel[0] << shift;
            mask |= 255u << shift;
            remaining = s_sel[1];
            __syncthreads();
        }
    }
    /* keep keys above the threshold, and the first `remaining` equal to it in page order */
    const int chunk = (cur + T - 1) / T;
    const int j0 = min(tid * chunk, cur), j1 = min(j0 + chunk, cur);
    int eq = 0;
    if (top > 0)
        for (int j = j0; j < j1; j++) eq += SEL_KEY(j) == prefix;
    int eq_before;
    scan_t(scan_tmp).ExclusiveSum(eq, eq_before);
    __syncthreads();
    if (top > 0)
        for (int j = j0; j < j1; j++) {
            const uint32_t k = SEL_KEY(j);
            bool take = k > prefix;
            if (k == prefix) take = eq_before++ < remaining;
            if (take) atomicOr(&bits[j >> 5], 1u << (j & 31));
        }
    if (tid == 0) atomicOr(&bits[cur >> 5], 1u << (cur & 31));
    __syncthreads();

    /* merged spans in page order: a span starts at a kept page whose predecessor is not kept */
    const int c2 = (cur + 1 + T - 1) / T;
    const int a0 = min(tid * c2, cur + 1), a1 = min(a0 + c2, cur + 1);
    int starts = 0;
    for (int j = a0; j < a1; j++) starts += bit_at(bits, j) && (j == 0 || !bit_at(bits, j - 1));
    int idx, total;
    scan_t(scan_tmp).ExclusiveSum(starts, idx, total);
    for (int j = a0; j < a1; j++) {
        if (!bit_at(bits, j) || (j > 0 && bit_at(bits, j - 1))) continue;
        int e = j;
        while (e < cur && bit_at(bits, e + 1)) e++;
        if (idx < max_spans) {
            sp[2 * idx] = j * ps;
            sp[2 * idx + 1] = e == cur ? ctx : (e + 1) * ps;
        }
        idx++;
    }
    if (tid == 0) *n_spans_out = min(total, max_spans);
#undef SEL_KEY
}

/* The select kernels' whole-context exit: a row that keeps every page (top >= cur) gets the
 * single span [0, ctx), as attention() computes it; true for such a row (block-uniform: the
 * caller returns) */
__device__ __forceinline__ bool sel_whole(int top, int cur, int ctx, int32_t *sp, int32_t *n_spans_pair)
{
    if (top < cur) return false;
    if (threadIdx.x == 0) {
        sp[0] = 0, sp[1] = ctx;
        *n_spans_pair = 1;
    }
    return true;
}

/* STAGED: the row's order keys are made once into shared memory (after the kept-page bits,
 * max_pages words), so the radix passes and the tie ranking read shared memory instead of
 * converting the scores from L2 on every pass; the unstaged form serves rows too long for it */
template <int T, bool STAGED>
__global__ void __launch_bounds__(T)
k_quest_select(const float *__restrict__ scores, const int32_t *__restrict__ pos, const int32_t *__restrict__ keep,
               int n_kv, int ps, int max_pages, int max_spans, int32_t *__restrict__ n_spans,
               int32_t *__restrict__ spans)
{
    extern __shared__ uint32_t bits[];     /* kept pages 0 .. cur; STAGED: then the keys [max_pages] */
    const int pair = blockIdx.x, row = pair / n_kv, tid = threadIdx.x;
    grid_dep_wait();
    const int ctx = pos[row] + 1, cur = pos[row] / ps, top = keep[row] - 1;
    int32_t *sp = spans + (size_t)pair * max_spans * 2;
    if (sel_whole(top, cur, ctx, sp, n_spans + pair)) return;
    const float *sc = scores + (size_t)pair * max_pages;
    const int words = (cur + 1 + 31) / 32;
    for (int w = tid; w < words; w += T) bits[w] = 0;
    uint32_t *sk = bits + (max_pages + 1 + 31) / 32;
    if (STAGED) {
        if (qs_serial) {
            for (int j = tid; j < cur; j += T) sk[j] = q_okey(sc[j]);
        } else {   /* QS_SLOTS loads a thread in flight (8192 keys at 128K: 8 per thread) */
            for (int j0 = tid; j0 < cur; j0 += QS_SLOTS * T) {
                float v[QS_SLOTS];
#pragma unroll
                for (int k = 0; k < QS_SLOTS; k++) v[k] = j0 + k * T < cur ? sc[j0 + k * T] : 0.0f;
#pragma unroll
                for (int k = 0; k < QS_SLOTS; k++)
                    if (j0 + k * T < cur) sk[j0 + k * T] = q_okey(v[k]);
            }
        }
    }
    __syncthreads();
    sel_run<T, STAGED>(sc, sk, bits, ctx, cur, top, ps, max_spans, sp, n_spans + pair);
}

/* kvs_quest_cuda_select_threads: the select's block, 0 by shape (SEL_SMALL_PAGES), else 256 or
 * 1024 at every shape */
static int sel_threads;

extern "C" void kvs_quest_cuda_select_threads(int threads) { sel_threads = threads == 256 || threads == 1024 ? threads : 0; }

static void cu_select(struct kvs_backend *b, const struct kvs_dbuf *scores, const struct kvs_attn_meta *m,
                      const struct kvs_dbuf *keep, int n, int n_kv_heads, int page_size, int max_pages, int max_spans,
                      struct kvs_dbuf *n_spans, struct kvs_dbuf *spans)
{
    qs_serial_env();
    if (n <= 0) return;
    xh_forget(b, n_spans->d);
    xh_forget(b, spans->d);
    const size_t bits_bytes = (size_t)(max_pages + 1 + 31) / 32 * sizeof(uint32_t);
    const size_t staged = bits_bytes + (size_t)max_pages * sizeof(uint32_t);
    const bool stage = staged <= SEL_STAGED_MAX;
    const size_t smem = stage ? staged : bits_bytes;
    int most = 0;   /* the longest row's candidates (pages) */
    for (int s = 0; s < n; s++) most = m->h_pos[s] / page_size > most ? m->h_pos[s] / page_size : most;
    const int small = sel_threads == 256 || (sel_threads == 0 && most <= SEL_SMALL_PAGES);
    static int attr_set[2][2];
    if (!attr_set[small][stage] && smem > 48 * 1024) {
        const void *fn = small ? (stage ? (const void *)k_quest_select<256, true> : (const void *)k_quest_select<256, false>)
                               : (stage ? (const void *)k_quest_select<SEL_THREADS, true>
                                        : (const void *)k_quest_select<SEL_THREADS, false>);
        CUDA_CHECK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)(smem < SEL_STAGED_MAX ? SEL_STAGED_MAX : smem)));
        attr_set[small][stage] = 1;
    }
#define SEL_ARGS(T)                                                                                            \
    (unsigned)(n * n_kv_heads), T, smem, b->stream, (const float *)scores->d, (const int32_t *)m->pos->d,       \
        (const int32_t *)keep->d, n_kv_heads, page_size, max_pages, max_spans, (int32_t *)n_spans->d,          \
        (int32_t *)spans->d
    if (small && stage)
        CUDA_CHECK(kvs_cu_launch(k_quest_select<256, true>, SEL_ARGS(256)));
    else if (small)
        CUDA_CHECK(kvs_cu_launch(k_quest_select<256, false>, SEL_ARGS(256)));
    else if (stage)
        CUDA_CHECK(kvs_cu_launch(k_quest_select<SEL_THREADS, true>, SEL_ARGS(SEL_THREADS)));
    else
        CUDA_CHECK(kvs_cu_launch(k_quest_select<SEL_THREADS, false>, SEL_ARGS(SEL_THREADS)));
#undef SEL_ARGS
    (void)m;
}

/* ---- fused score + select --------------------------------------------------------------------- */

/* One block of T threads per (row, KV head): the group's queries staged, every candidate page
 * scored by the block's warps (q_score_range / q_qscore_range: the score kernels' bits) with the
 * order keys kept in shared memory, then sel_run over them: one launch and no score round trip
 * through global memory instead of two kernels (bench/RESULTS.md, quest7). BITS 16: bf16
 * digests. scores_out (may be NULL) also receives the scores (the tests compare them). */
template <int HD, int BITS, int T>
__global__ void __launch_bounds__(T, 1)
k_quest_fsel(const float *__restrict__ q, void *__restrict__ dig, size_t n_pages, const bf16 *__restrict__ kc,
             const int32_t *__restrict__ wqs, const int32_t *__restrict__ pos, const int32_t *__restrict__ bts,
             const int32_t *__restrict__ keep, int max_blocks, int n_heads, int n_kv, int bs, int ps, int max_pages,
             int max_spans, float *__restrict__ scores_out, int32_t *__restrict__ n_spans,
             int32_t *__restrict__ spans)
{
    extern __shared__ uint32_t fs_smem[];   /* bits [(max_pages + 1 + 31) / 32], keys [max_pages], queries, codes */
    __shared__ float red[2][32];
    __shared__ uint32_t s_par;
    const int pair = blockIdx.x, row = pair / n_kv, g = pair % n_kv, G = n_heads / n_kv, tid = threadIdx.x;
    grid_dep_wait();
    const int ctx = pos[row] + 1, cur = pos[row] / ps, top = keep[row] - 1;
    int32_t *sp = spans + (size_t)pair * max_spans * 2;
    const int32_t *bt = bts + (size_t)row * max_blocks;
    uint32_t *bits = fs_smem, *sk = bits + (max_pages + 1 + 31) / 32;
    float *sq = (float *)(sk + max_pages);   /* bf16: [G][HD]; quantized: Qp [HD], Qn [HD] */
    /* the refresh of the page the row wrote (its current page, never a candidate: no block of
     * this grid reads it) */
    if (wqs && wqs[row + 1] - wqs[row] >= 1) {   /* block-uniform */
        if constexpr (BITS == 16)
            bd_page(kc, bt, cur * ps, ctx, g, n_kv, HD, bs, ps, (bf16 *)dig);
        else
            qd_page(kc, bt, cur * ps, ctx, g, n_kv, HD, bs, ps, BITS, n_pages, (uint32_t *)dig, red, &s_par,
                    (uint8_t *)(sq + 2 * HD));
    }
    if (sel_whole(top, cur, ctx, sp, n_spans + pair)) return;
    if (BITS == 16)
        q_stage_group(q + ((size_t)row * n_heads + g * G) * HD, G * HD, sq);
    else
        q_fold_group<HD>(q, row, g, G, n_heads, sq, sq + HD);
    for (int w = tid; w < (cur + 1 + 31) / 32; w += T) bits[w] = 0;
    __syncthreads();
    float *out = scores_out ? scores_out + (size_t)pair * max_pages : nullptr;
    if constexpr (BITS == 16)
        q_score_range<HD>(sq, G, (const bf16 *)dig, bt, g, n_kv, bs, ps, 0, cur, tid >> 5, T / 32, out, sk);
    else
        q_qscore_range<HD, BITS>(sq, sq + HD, (const uint32_t *)dig, n_pages, bt, g, n_kv, bs, ps, 0, cur, tid >> 5,
                                 T / 32, out, sk);
    __syncthreads();
    sel_run<T, true>(nullptr, sk, bits, ctx, cur, top, ps, max_spans, sp, n_spans + pair);
}

/* kvs_quest_cuda_select_path: 0 by shape (fsel_wanted), 1 never fused, 2 always where it fits,
 * 3 as 2 with 512-thread blocks at any shape */
static int fsel_mode;

extern "C" void kvs_quest_cuda_select_path(int mode) { fsel_mode = mode >= 0 && mode <= 3 ? mode : 0; }

/* One block per (row, KV head) reads that pair's digests at what one SM can pull: the A/B
 * (bench/RESULTS.md, quest7) measured the fused kernel slower than score + select at batch 1
 * and 8 (0.062 vs 0.031 ms at 1 x 32K, 0.070 vs 0.051 at 8 x 32K) and within 3% at batch 32,
 * so by shape it is never taken; it stays for the A/B (modes 2 and 3) and its tests. */
static bool fsel_wanted(int pairs, int most)
{
    (void)pairs, (void)most;
    return fsel_mode >= 2;
}

template <int HD, int BITS>
static void fsel_launch(struct kvs_backend *b, int T, unsigned pairs, size_t smem, const float *q, void *dig,
                        size_t n_pages, const bf16 *kc, const int32_t *wqs, const struct kvs_attn_meta *m,
                        const int32_t *keep, int n_heads, int n_kv_heads, int block_size, int page_size, int max_pages,
                        int max_spans, float *scores_out, int32_t *n_spans, int32_t *spans)
{
    static bool attr_set[2];
    const void *fn = T == 1024 ? (const void *)k_quest_fsel<HD, BITS, 1024> : (const void *)k_quest_fsel<HD, BITS, 512>;
    if (!attr_set[T == 1024]) {
        CUDA_CHECK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, FS_SMEM_MAX));
        attr_set[T == 1024] = true;
    }
#define FS_ARGS                                                                                              \
    pairs, T, smem, b->stream, q, dig, n_pages, kc, wqs, (const int32_t *)m->pos->d,                         \
        (const int32_t *)m->block_tables->d, keep, m->max_blocks, n_heads, n_kv_heads, block_size, page_size, \
        max_pages, max_spans, scores_out, n_spans, spans
    if (T == 1024)
        CUDA_CHECK(kvs_cu_launch(k_quest_fsel<HD, BITS, 1024>, FS_ARGS));
    else
        CUDA_CHECK(kvs_cu_launch(k_quest_fsel<HD, BITS, 512>, FS_ARGS));
#undef FS_ARGS
}

/* the separate refresh (digest_update or qdigest_update) of the pages wm's rows wrote */
static void digests_refresh(struct kvs_backend *b, const struct kvs_dbuf *kc, const struct kvs_attn_meta *wm,
                            int n_kv_heads, int head_dim, int block_size, int page_size, int bits, size_t n_pages,
                            const struct kvs_dbuf *dig)
{
    struct kvs_dbuf *d = (struct kvs_dbuf *)dig;   /* score_select takes the digests as the score ops do */
    if (bits == 16) cu_digest_update(b, kc, wm, n_kv_heads, head_dim, block_size, page_size, d);
    else cu_qdigest_update(b, kc, wm, n_kv_heads, head_dim, block_size, page_size, bits, n_pages, d);
}

static void cu_score_select(struct kvs_backend *b, const struct kvs_dbuf *q, const struct kvs_dbuf *dig,
                            const struct kvs_attn_meta *m, const struct kvs_dbuf *keep, int n, int n_heads,
                            int n_kv_heads, int head_dim, int block_size, int page_size, int bits, size_t n_pages,
                            int max_pages, int max_spans, struct kvs_dbuf *scores, int want_scores,
                            struct kvs_dbuf *n_spans, struct kvs_dbuf *spans, const struct kvs_dbuf *kc,
                            const struct kvs_attn_meta *wm)
{
    qs_serial_env();
    if (n <= 0) {
        if (wm) digests_refresh(b, kc, wm, n_kv_heads, head_dim, block_size, page_size, bits, n_pages, dig);
        return;
    }
    int most = 0;
    for (int s = 0; s < n; s++) most = m->h_pos[s] / page_size > most ? m->h_pos[s] / page_size : most;
    /* the queries (bf16 digests: the group's heads; quantized: Qp, Qn), then a refresh's code bytes */
    const size_t qbytes = (size_t)(bits == 16 ? n_heads / n_kv_heads : 2) * head_dim * sizeof(float) +
                          (bits == 16 ? 0 : 2 * (size_t)head_dim);
    const size_t smem = (size_t)(max_pages + 1 + 31) / 32 * sizeof(uint32_t) + (size_t)max_pages * sizeof(uint32_t) +
                        qbytes;
    const int pairs = n * n_kv_heads;
    const bool hd_ok = head_dim == 64 || head_dim == 128 || head_dim == 256;
    /* the fused kernel reads sequence s's query at row s: a step whose sequences have more rows
     * (a Retro window, its newest row scored) takes the score kernels, which read q_start */
    const bool one_row = m->h_q_start[n] - m->h_q_start[0] == n;
    if (!hd_ok || (bits != 16 && bits != 8 && bits != 4) || smem > FS_SMEM_MAX || !one_row ||
        !fsel_wanted(pairs, most)) {
        /* the refresh as a slice of the score launch where it can be (a candidate page exists and a
         * score block has a thread per dimension), else its own launch first */
        const bool in_score = wm && most > 0 && head_dim <= 32 * QS_WARPS;
        if (wm && !in_score)
            digests_refresh(b, kc, wm, n_kv_heads, head_dim, block_size, page_size, bits, n_pages, dig);
        const int32_t *wqs = in_score ? (const int32_t *)wm->q_start->d : NULL;
        if (bits == 16)
            cu_score_r(b, q, dig, m, keep, n, n_heads, n_kv_heads, head_dim, block_size, page_size, max_pages, scores,
                       kc, wqs);
        else
            cu_qscore_r(b, q, dig, m, keep, n, n_heads, n_kv_heads, head_dim, block_size, page_size, bits, n_pages,
                        max_pages, scores, kc, wqs);
        cu_select(b, scores, m, keep, n, n_kv_heads, page_size, max_pages, max_spans, n_spans, spans);
        return;
    }
    xh_forget(b, n_spans->d);
    xh_forget(b, spans->d);
    if (wm) xh_forget(b, dig->d);
    float *so = NULL;
    if (want_scores) {
        xh_forget(b, scores->d);
        so = (float *)scores->d;
    }
    /* fewer pairs than SMs: each block is alone on its SM, so it takes the SM's every warp */
    const int sms = b->n_sms > 0 ? b->n_sms : 1, T = pairs <= sms && fsel_mode != 3 ? 1024 : 512;
#define FS_CALL(H, B)                                                                                        \
    if (head_dim == H && bits == B) {                                                                        \
        fsel_launch<H, B>(b, T, (unsigned)pairs, smem, (const float *)q->d, dig->d, n_pages,                 \
                          wm ? (const bf16 *)kc->d : nullptr, wm ? (const int32_t *)wm->q_start->d : nullptr, \
                          m, (const int32_t *)keep->d, n_heads, n_kv_heads, block_size, page_size, max_pages, \
                          max_spans, so, (int32_t *)n_spans->d, (int32_t *)spans->d);                        \
        return;                                                                                              \
    }
    FS_CALL(64, 16); FS_CALL(128, 16); FS_CALL(256, 16);
    FS_CALL(64, 8); FS_CALL(128, 8); FS_CALL(256, 8);
    FS_CALL(64, 4); FS_CALL(128, 4); FS_CALL(256, 4);
#undef FS_CALL
}

/* ---- two-level (super-page) selection (kernels/kv_quest.h super_select) ------------------------ */

#define SS_OUT 0xFFFFFFFFu    /* a page outside the kept super-pages: a NaN whose q_okey is 0 */
#define SS_CANDIDATE 0x7FFFFFFFu   /* a candidate page of the split form, scored by the next launch (a NaN no score takes) */

/* Steps (1)-(3) of the two-level selection for one (row, KV head) by the whole block (every
 * thread calls it; it ends on a barrier): (1) the row's refs for head g, a thread per (ref,
 * dimension): min / max over the ref's pages of the page digests' values (bf16 as stored, codes
 * decoded with the shared kvs_qd_value: the CPU's bits), -inf / +inf for a super-page with an
 * unbounded page; the group's queries into sq (bf16: [G][HD]; quantized: Qp [HD], Qn [HD]);
 * (2) every super-page scored by the warps, HD / 8 lanes a super-page over 8 dimensions each
 * (F32 digests, the lanes' sums reduced as q_score_range's: equal to the CPU's up to rounding),
 * keys to skey; (3) the last super-page and the top skeep - 1 of the others by rank (each thread
 * counts the keys ahead of its super-pages: deterministic, no atomics decide an order) into
 * slist. Returns S, the kept super-pages. One body for the one-block kernel and the split path's
 * first launch, so both keep the same super-pages. */
template <int HD, int BITS>
__device__ __forceinline__ int ss_supers(const float *__restrict__ q, const void *__restrict__ dig, size_t n_pages,
                                         float *__restrict__ sdig, const int32_t *__restrict__ skeep,
                                         const int32_t *__restrict__ rslot, const int32_t *__restrict__ refs,
                                         const int32_t *__restrict__ ref_n, int row, int g, int n_heads, int n_kv,
                                         int cur, int N, int max_super, int max_ref, uint32_t *skey, int *slist,
                                         float *sq)
{
    const int tid = threadIdx.x, T = (int)blockDim.x, G = n_heads / n_kv;
    float *sd = sdig + ((size_t)rslot[row] * max_super * n_kv + g) * 2 * HD;
    const size_t sstride = (size_t)n_kv * 2 * HD;   /* one super-page to the next */
    /* (1) the refs. A ref's pages are taken QS_SLOTS at a time: their table entries, then their
     * digests (bf16) or params and code words (quantized), each batch's loads issued before any
     * is used; the loop of one page at a time waited on two or three dependent round trips a page
     * (entry -> params -> codes), N pages in a row. The min / max run over the pages in the same
     * order as before: the same bits. */
    const int nref = ref_n[row];
    constexpr int NW = HD * BITS / 32, PER = 32 / BITS;
    for (int x = tid; x < nref * HD; x += T) {
        const int e = x / HD, i = x % HD;
        const int32_t *ent = refs + ((size_t)row * max_ref + e) * (2 + N);
        const int cnt = ent[1];
        float mn = 0.0f, mx = 0.0f;
        bool unb = false;
        for (int t0 = 0; t0 < cnt; t0 += QS_SLOTS) {
            size_t ph[QS_SLOTS];
            float a[QS_SLOTS], c[QS_SLOTS];
#pragma unroll
            for (int k = 0; k < QS_SLOTS; k++) ph[k] = t0 + k < cnt ? (size_t)ent[2 + t0 + k] * n_kv + g : 0;
            if constexpr (BITS == 16) {
#pragma unroll
                for (int k = 0; k < QS_SLOTS; k++) {
                    const bf16 *d = (const bf16 *)dig + ph[k] * 2 * HD;
                    a[k] = t0 + k < cnt ? __bfloat162float(d[i]) : 0.0f;
                    c[k] = t0 + k < cnt ? __bfloat162float(d[HD + i]) : 0.0f;
                }
            } else {
                uint32_t par[QS_SLOTS], wn[QS_SLOTS], wx[QS_SLOTS];
#pragma unroll
                for (int k = 0; k < QS_SLOTS; k++) {
                    const uint32_t *cw = (const uint32_t *)dig + ph[k] * 2 * NW;
                    const bool in = t0 + k < cnt;
                    par[k] = in ? ((const uint32_t *)dig)[n_pages * (size_t)n_kv * 2 * NW + ph[k]] : 0u;
                    wn[k] = in ? cw[i / PER] : 0u;
                    wx[k] = in ? cw[NW + i / PER] : 0u;
                }
                const uint32_t mask = (1u << BITS) - 1;
#pragma unroll
                for (int k = 0; k < QS_SLOTS; k++) {
                    unb |= t0 + k < cnt && par[k] == KVS_QD_UNBOUNDED;   /* the super-page is unbounded: its pages' values no matter */
                    const float lo = kvs_qd_f16_to_f32(par[k] & 0xFFFFu), sc = kvs_qd_f16_to_f32(par[k] >> 16);
                    a[k] = kvs_qd_value(wn[k] >> (i % PER * BITS) & mask, lo, sc);
                    c[k] = kvs_qd_value(wx[k] >> (i % PER * BITS) & mask, lo, sc);
                }
            }
#pragma unroll
            for (int k = 0; k < QS_SLOTS; k++)
                if (t0 + k < cnt) {
                    mn = t0 + k == 0 || a[k] < mn ? a[k] : mn;
                    mx = t0 + k == 0 || c[k] > mx ? c[k] : mx;
                }
        }
        float *o = sd + (size_t)ent[0] * sstride;
        o[i] = unb ? -INFINITY : mn;
        o[HD + i] = unb ? INFINITY : mx;
    }
    if (BITS == 16)
        q_stage_group(q + ((size_t)row * n_heads + g * G) * HD, G * HD, sq);
    else
        q_fold_group<HD>(q, row, g, G, n_heads, sq, sq + HD);
    __syncthreads();   /* the refs' digests (global, this block's own writes) and the queries */
    /* (2) super-page scores (quantized digests: the folded queries, max(q a, q c) = max(q, 0) c +
     * min(q, 0) a for a <= c) */
    const int nsup = (cur + N - 1) / N;
    {
        constexpr int L = HD / 8, P = 32 / L;
        const int lane = tid & 31, sub = lane / L, l = lane % L, warp = tid >> 5;
        /* SU super-pages a lane group in flight: their loads first, then the sums (at 128K a row has
         * 512 super-pages, eight steps of a 1024-thread block that each waited on one round trip) */
        constexpr int SU = 4;
        const int step = (T / 32) * P;
        for (int j0 = warp * P; j0 < nsup; j0 += SU * step) {
            float4 d4[SU][4];
            float e0[SU], e1[SU];
#pragma unroll
            for (int u = 0; u < SU; u++) {
                const int j = j0 + u * step + sub;
                if (j < nsup) {
                    const float4 *d = (const float4 *)(sd + (size_t)j * sstride);
                    d4[u][0] = __ldcg(d + 2 * l), d4[u][1] = __ldcg(d + 2 * l + 1);
                    d4[u][2] = __ldcg(d + HD / 4 + 2 * l), d4[u][3] = __ldcg(d + HD / 4 + 2 * l + 1);
                    e0[u] = __ldcg(sd + (size_t)j * sstride), e1[u] = __ldcg(sd + (size_t)j * sstride + HD);
                } else {
                    d4[u][0] = d4[u][1] = d4[u][2] = d4[u][3] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                    e0[u] = e1[u] = 0.0f;
                }
            }
#pragma unroll
            for (int u = 0; u < SU; u++) {
                const int j = j0 + u * step + sub;
                float acc = 0.0f;
                const float a[8] = {d4[u][0].x, d4[u][0].y, d4[u][0].z, d4[u][0].w,
                                    d4[u][1].x, d4[u][1].y, d4[u][1].z, d4[u][1].w};
                const float c[8] = {d4[u][2].x, d4[u][2].y, d4[u][2].z, d4[u][2].w,
                                    d4[u][3].x, d4[u][3].y, d4[u][3].z, d4[u][3].w};
                const bool unb = e0[u] == -INFINITY && e1[u] == INFINITY;
                if (j < nsup) {
                    if constexpr (BITS == 16) {
                        for (int h = 0; h < G; h++) {
                            const float *qh = sq + h * HD + 8 * l;
#pragma unroll
                            for (int k = 0; k < 8; k++) acc += fmaxf(qh[k] * a[k], qh[k] * c[k]);
                        }
                    } else {
#pragma unroll
                        for (int k = 0; k < 8; k++) acc += sq[8 * l + k] * c[k] + sq[HD + 8 * l + k] * a[k];
                    }
                }
#pragma unroll
                for (int o = L / 2; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
                if (l == 0 && j < nsup) skey[j] = q_okey(unb ? INFINITY : acc);
            }
        }
    }
    __syncthreads();
    /* (3) the last super-page, then the top S - 1 of the others: rank = the keys ahead (higher, or
     * equal at a lower index) */
    const int S = min(max(skeep[row], 0), nsup);
    for (int j = tid; j < nsup - 1; j += T) {
        const uint32_t kj = skey[j];
        int ahead = 0;
        for (int x = 0; x < nsup - 1; x++) {
            const uint32_t kx = skey[x];
            ahead += kx > kj || (kx == kj && x < j);
        }
        if (ahead < S - 1) slist[ahead] = j;
    }
    if (tid == 0 && S > 0) slist[S - 1] = nsup - 1;
    __syncthreads();
    return S;
}

/* The one-block form: one block of T threads per (row, KV head), as k_quest_fsel: ss_supers, then
 * (4) the pages of the kept super-pages scored by q_score_range / q_qscore_range through q_smap,
 * so each page gets the bits that the exact path's score kernels give it, their order keys in
 * shared memory (the other pages' keys 0); (5) sel_run over all cur keys. */
template <int HD, int BITS, int T>
__global__ void __launch_bounds__(T, 1)
k_quest_ssel(const float *__restrict__ q, const void *__restrict__ dig, size_t n_pages, float *__restrict__ sdig,
             const int32_t *__restrict__ pos, const int32_t *__restrict__ bts, const int32_t *__restrict__ keep,
             const int32_t *__restrict__ skeep, const int32_t *__restrict__ rslot, const int32_t *__restrict__ refs,
             const int32_t *__restrict__ ref_n, int max_blocks, int n_heads, int n_kv, int bs, int ps, int max_pages,
             int max_spans, int N, int max_super, int max_ref, float *__restrict__ scores_out,
             int32_t *__restrict__ n_spans, int32_t *__restrict__ spans)
{
    extern __shared__ uint32_t ss_smem[];   /* bits, keys [max_pages], super keys / list [max_super], queries */
    const int pair = blockIdx.x, row = pair / n_kv, g = pair % n_kv, G = n_heads / n_kv, tid = threadIdx.x;
    grid_dep_wait();
    const int ctx = pos[row] + 1, cur = pos[row] / ps, top = keep[row] - 1;
    int32_t *sp = spans + (size_t)pair * max_spans * 2;
    if (sel_whole(top, cur, ctx, sp, n_spans + pair)) return;
    const int32_t *bt = bts + (size_t)row * max_blocks;
    uint32_t *bits = ss_smem, *sk = bits + (max_pages + 1 + 31) / 32, *skey = sk + max_pages;
    int *slist = (int *)(skey + max_super);
    float *sq = (float *)(slist + max_super);
    for (int w = tid; w < (cur + 1 + 31) / 32; w += T) bits[w] = 0;
    float *out = scores_out ? scores_out + (size_t)pair * max_pages : nullptr;
    for (int j = tid; j < cur; j += T) {   /* pages outside the kept super-pages: below every score */
        sk[j] = 0;
        if (out) out[j] = __uint_as_float(SS_OUT);   /* overwritten by (4) for the candidates, after its barriers */
    }
    const int S = ss_supers<HD, BITS>(q, dig, n_pages, sdig, skeep, rslot, refs, ref_n, row, g, n_heads, n_kv, cur, N,
                                      max_super, max_ref, skey, slist, sq);
    /* (4) the kept super-pages' pages, with the exact path's bits */
    const q_smap map = {slist, N, cur};
    if constexpr (BITS == 16)
        q_score_range<HD, q_smap>(sq, G, (const bf16 *)dig, bt, g, n_kv, bs, ps, 0, S * N, tid >> 5, T / 32, out, sk,
                                  map);
    else
        q_qscore_range<HD, BITS, q_smap>(sq, sq + HD, (const uint32_t *)dig, n_pages, bt, g, n_kv, bs, ps, 0, S * N,
                                         tid >> 5, T / 32, out, sk, map);
    __syncthreads();
    /* (5) */
    sel_run<T, true>(nullptr, sk, bits, ctx, cur, top, ps, max_spans, sp, n_spans + pair);
}

/* The split form, three launches (kvs_quest_cuda_super_path): the one-block kernel runs a row's
 * phases one after the other in one block a (row, KV head), which at batch 1-8 leaves most SMs
 * idle while one block reads every candidate page's digest (bench/RESULTS.md, quest11). Here:
 * k_quest_ssup (one block a pair: ss_supers, then the row's scores row marked: SS_CANDIDATE for the
 * pages of the kept super-pages, SS_OUT for the rest), k_quest_scand (the score kernels' grid:
 * a block a (pair, slice of pages) scores its slice's SS_CANDIDATE pages with the exact path's code),
 * then the one-level select launch over the scores. SS_OUT is a NaN whose order key is 0, the
 * key the one-block kernel gives a page outside the kept super-pages, and every candidate's key
 * comes from the same score code: the same keys, so the same selection, bitwise. */
template <int HD, int BITS>
__global__ void __launch_bounds__(1024, 1)
k_quest_ssup(const float *__restrict__ q, const void *__restrict__ dig, size_t n_pages, float *__restrict__ sdig,
             const int32_t *__restrict__ pos, const int32_t *__restrict__ keep, const int32_t *__restrict__ skeep,
             const int32_t *__restrict__ rslot, const int32_t *__restrict__ refs, const int32_t *__restrict__ ref_n,
             int n_heads, int n_kv, int ps, int max_pages, int N, int max_super, int max_ref, float *__restrict__ scores)
{
    extern __shared__ uint32_t su_smem[];   /* super keys / list [max_super], queries */
    const int pair = blockIdx.x, row = pair / n_kv, g = pair % n_kv, tid = threadIdx.x, T = (int)blockDim.x;
    grid_dep_wait();
    const int cur = pos[row] / ps;
    if (keep[row] - 1 >= cur) return;   /* the select writes its one span */
    uint32_t *skey = su_smem;
    int *slist = (int *)(skey + max_super);
    uint32_t *sc = (uint32_t *)(scores + (size_t)pair * max_pages);
    for (int j = tid; j < cur; j += T) sc[j] = SS_OUT;
    const int S = ss_supers<HD, BITS>(q, dig, n_pages, sdig, skeep, rslot, refs, ref_n, row, g, n_heads, n_kv, cur, N,
                                      max_super, max_ref, skey, slist, (float *)(slist + max_super));
    for (int x = tid; x < S * N; x += T) {   /* after ss_supers' barriers: after every SS_OUT store */
        const int pg = slist[x / N] * N + x % N;
        if (pg < cur) sc[pg] = SS_CANDIDATE;
    }
}

/* index map of k_quest_scand: page v where its mark (staged in shared memory from pg0) is SS_CANDIDATE */
struct q_fmap {
    const uint8_t *todo;
    int pg0;
    __device__ __forceinline__ int operator()(int v) const { return todo[v - pg0] ? v : -1; }
};

template <int HD, int BITS>
__global__ void __launch_bounds__(32 * QS_WARPS)
k_quest_scand(const float *__restrict__ q, const void *__restrict__ dig, size_t n_pages,
              const int32_t *__restrict__ pos, const int32_t *__restrict__ bts, const int32_t *__restrict__ keep,
              int max_blocks, int n_heads, int n_kv, int bs, int ps, int max_pages, int ppb, float *__restrict__ scores)
{
    extern __shared__ float sc_smem[];   /* queries (bf16: [G][HD]; quantized: Qp, Qn [HD]), then ppb marks */
    const int pair = blockIdx.x, row = pair / n_kv, g = pair % n_kv, G = n_heads / n_kv, tid = threadIdx.x;
    grid_dep_wait();
    const int cur = pos[row] / ps, pg0 = (int)blockIdx.y * ppb;
    if (keep[row] - 1 >= cur || pg0 >= cur) return;
    const int pg1 = min(pg0 + ppb, cur);
    float *sc = scores + (size_t)pair * max_pages;
    uint8_t *todo = (uint8_t *)(sc_smem + (BITS == 16 ? G : 2) * HD);
    int any = 0;
    for (int v = pg0 + tid; v < pg1; v += 32 * QS_WARPS) {
        const bool t = __float_as_uint(__ldcg(sc + v)) == SS_CANDIDATE;
        todo[v - pg0] = t;
        any |= t;
    }
    if (!__syncthreads_or(any)) return;   /* block-uniform */
    if (BITS == 16)
        q_stage_group(q + ((size_t)row * n_heads + g * G) * HD, G * HD, sc_smem);
    else
        q_fold_group<HD>(q, row, g, G, n_heads, sc_smem, sc_smem + HD);
    __syncthreads();
    const int32_t *bt = bts + (size_t)row * max_blocks;
    const q_fmap map = {todo, pg0};
    if constexpr (BITS == 16)
        q_score_range<HD, q_fmap>(sc_smem, G, (const bf16 *)dig, bt, g, n_kv, bs, ps, pg0, pg1, tid >> 5, QS_WARPS, sc,
                                  nullptr, map);
    else
        q_qscore_range<HD, BITS, q_fmap>(sc_smem, sc_smem + HD, (const uint32_t *)dig, n_pages, bt, g, n_kv, bs, ps, pg0,
                                         pg1, tid >> 5, QS_WARPS, sc, nullptr, map);
}

/* kvs_quest_cuda_super_path: 0 by shape (split where the caller passes scores scratch and the
 * (row, KV head) pairs are at most an eighth of the SMs: the A/B in bench/RESULTS.md, quest12,
 * where the split form won only at batch 1), 1 the one-block kernel, 2 split (with scores);
 * KVS_QUEST_SUPER_PATH in the environment sets it once */
static int ss_path = -1;

extern "C" void kvs_quest_cuda_super_path(int mode) { ss_path = mode >= 0 && mode <= 2 ? mode : 0; }

static void ss_split(struct kvs_backend *b, const struct kvs_quest_super_args *a, int T)
{
    const int hd = a->head_dim, G = a->n_heads / a->n_kv_heads, pairs = a->n * a->n_kv_heads;
    const struct kvs_attn_meta *m = a->m;
    int most = 0;
    for (int s = 0; s < a->n; s++) most = m->h_pos[s] / a->page_size > most ? m->h_pos[s] / a->page_size : most;
    const size_t qbytes = (size_t)(a->bits == 16 ? G : 2) * hd * sizeof(float);
    const size_t smem1 = 2 * (size_t)a->max_super * sizeof(uint32_t) + qbytes;
    int ppb = score_pages_per_block(b, pairs, most > 0 ? most : 1);
    ppb = ppb < 16384 ? ppb : 16384;   /* its marks in shared memory: a byte a page */
    const dim3 grid2((unsigned)pairs, (unsigned)((most + ppb - 1) / ppb > 0 ? (most + ppb - 1) / ppb : 1));
    const size_t smem2 = qbytes + (size_t)ppb;
    if (smem1 > FS_SMEM_MAX || smem2 > 48 * 1024)
        kvs_panic(__FILE__, __LINE__, "cuda Quest two-level selection (split): %zu / %zu shared bytes", smem1, smem2);
    float *sc = (float *)a->scores->d;
#define SU_CASE(H, B)                                                                                                 \
    if (hd == H && a->bits == B) {                                                                                    \
        static bool attr;                                                                                             \
        if (!attr) {                                                                                                  \
            CUDA_CHECK(cudaFuncSetAttribute(k_quest_ssup<H, B>, cudaFuncAttributeMaxDynamicSharedMemorySize, FS_SMEM_MAX)); \
            attr = true;                                                                                              \
        }                                                                                                             \
        CUDA_CHECK(kvs_cu_launch(k_quest_ssup<H, B>, (unsigned)pairs, T, smem1, b->stream, (const float *)a->q->d,     \
                                 (const void *)a->dig->d, a->n_pages, (float *)a->sdig->d, (const int32_t *)m->pos->d, \
                                 (const int32_t *)a->keep->d, (const int32_t *)a->skeep->d,                           \
                                 (const int32_t *)a->rslot->d, (const int32_t *)a->refs->d, (const int32_t *)a->ref_n->d, \
                                 a->n_heads, a->n_kv_heads, a->page_size, a->max_pages, a->super_pages, a->max_super,  \
                                 a->max_ref, sc));                                                                    \
        CUDA_CHECK(kvs_cu_launch(k_quest_scand<H, B>, grid2, 32 * QS_WARPS, smem2, b->stream, (const float *)a->q->d,  \
                                 (const void *)a->dig->d, a->n_pages, (const int32_t *)m->pos->d,                     \
                                 (const int32_t *)m->block_tables->d, (const int32_t *)a->keep->d, m->max_blocks,     \
                                 a->n_heads, a->n_kv_heads, a->block_size, a->page_size, a->max_pages, ppb, sc));      \
        cu_select(b, a->scores, m, a->keep, a->n, a->n_kv_heads, a->page_size, a->max_pages, a->max_spans, a->n_spans, \
                  a->spans);                                                                                          \
        return;                                                                                                       \
    }
    SU_CASE(16, 16); SU_CASE(32, 16); SU_CASE(64, 16); SU_CASE(128, 16); SU_CASE(256, 16);
    SU_CASE(16, 8); SU_CASE(32, 8); SU_CASE(64, 8); SU_CASE(128, 8); SU_CASE(256, 8);
    SU_CASE(16, 4); SU_CASE(32, 4); SU_CASE(64, 4); SU_CASE(128, 4); SU_CASE(256, 4);
#undef SU_CASE
    kvs_panic(__FILE__, __LINE__, "cuda Quest two-level selection: head_dim %d, bits %d", hd, a->bits);
}

template <int HD, int BITS>
static void ssel_launch(struct kvs_backend *b, int T, size_t smem, const struct kvs_quest_super_args *a, float *so)
{
    static bool attr_set[2];
    constexpr bool big = HD >= 64;   /* 1024-thread blocks only there (cu_super_select) */
    const void *fn = big && T == 1024 ? (const void *)k_quest_ssel<HD, BITS, big ? 1024 : 512>
                                      : (const void *)k_quest_ssel<HD, BITS, 512>;
    if (!attr_set[T == 1024]) {
        CUDA_CHECK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, FS_SMEM_MAX));
        attr_set[T == 1024] = true;
    }
    const struct kvs_attn_meta *m = a->m;
#define SS_ARGS                                                                                                  \
    (unsigned)(a->n * a->n_kv_heads), T, smem, b->stream, (const float *)a->q->d, (const void *)a->dig->d,        \
        a->n_pages, (float *)a->sdig->d, (const int32_t *)m->pos->d, (const int32_t *)m->block_tables->d,           \
        (const int32_t *)a->keep->d, (const int32_t *)a->skeep->d, (const int32_t *)a->rslot->d,                    \
        (const int32_t *)a->refs->d, (const int32_t *)a->ref_n->d, m->max_blocks, a->n_heads, a->n_kv_heads,        \
        a->block_size, a->page_size, a->max_pages, a->max_spans, a->super_pages, a->max_super, a->max_ref, so,      \
        (int32_t *)a->n_spans->d, (int32_t *)a->spans->d
    if (big && T == 1024)
        CUDA_CHECK(kvs_cu_launch(k_quest_ssel<HD, BITS, big ? 1024 : 512>, SS_ARGS));
    else
        CUDA_CHECK(kvs_cu_launch(k_quest_ssel<HD, BITS, 512>, SS_ARGS));
#undef SS_ARGS
}

static void cu_super_select(struct kvs_backend *b, const struct kvs_quest_super_args *a)
{
    qs_serial_env();
    if (ss_path < 0) {
        const char *e = getenv("KVS_QUEST_SUPER_PATH");
        kvs_quest_cuda_super_path(e ? atoi(e) : 0);
    }
    if (a->n <= 0) return;
    const int hd = a->head_dim, G = a->n_heads / a->n_kv_heads;
    const size_t qbytes = (size_t)(a->bits == 16 ? G : 2) * hd * sizeof(float);
    const size_t smem = (size_t)(a->max_pages + 1 + 31) / 32 * sizeof(uint32_t) + (size_t)a->max_pages * sizeof(uint32_t) +
                        2 * (size_t)a->max_super * sizeof(uint32_t) + qbytes;
    const int pairs = a->n * a->n_kv_heads, sms = b->n_sms > 0 ? b->n_sms : 1;
    const bool split = a->scores && (ss_path == 2 || (ss_path == 0 && 8 * pairs <= sms));
    if (!split && smem > FS_SMEM_MAX)   /* as the score launch's head_dim: the shape is the model's, a panic, not an error */
        kvs_panic(__FILE__, __LINE__, "cuda Quest two-level selection: %zu shared bytes (max %d: at most ~%d candidate "
                  "pages a row)", smem, FS_SMEM_MAX, FS_SMEM_MAX / 8);
    xh_forget(b, a->n_spans->d);
    xh_forget(b, a->spans->d);
    xh_forget(b, a->sdig->d);
    float *so = NULL;
    if (a->scores) {
        xh_forget(b, a->scores->d);
        so = (float *)a->scores->d;
    }
    /* fewer pairs than SMs: each block alone on its SM takes its every warp (as the fused select);
     * head_dim 16 / 32 (test models) only at 512 */
    const int T = pairs <= sms && hd >= 64 ? 1024 : 512;
    if (split) {
        ss_split(b, a, T);
        return;
    }
#define SS_CALL(H, B)                                     \
    if (hd == H && a->bits == B) {                        \
        ssel_launch<H, B>(b, T, smem, a, so);             \
        return;                                           \
    }
    SS_CALL(16, 16); SS_CALL(32, 16); SS_CALL(64, 16); SS_CALL(128, 16); SS_CALL(256, 16);
    SS_CALL(16, 8); SS_CALL(32, 8); SS_CALL(64, 8); SS_CALL(128, 8); SS_CALL(256, 8);
    SS_CALL(16, 4); SS_CALL(32, 4); SS_CALL(64, 4); SS_CALL(128, 4); SS_CALL(256, 4);
#undef SS_CALL
    kvs_panic(__FILE__, __LINE__, "cuda Quest two-level selection: head_dim %d, bits %d (16, 32, 64, 128 or 256; 16, 8 "
              "or 4)", hd, a->bits);
}

extern "C" const struct kvs_quest_kernels kvs_quest_kernels_cuda = {
    "cuda",
    cu_digest_update,
    cu_score,
    cu_select,
    cu_qdigest_update,
    cu_qscore,
    cu_score_select,
    cu_super_select,
};
