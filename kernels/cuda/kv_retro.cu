/* kv_retro.cu: the CUDA table of Retro's device bookkeeping (kernels/kv_retro.h), tested against the
 * CPU table and reference (kernels/cpu/kv_retro.c) by tests/gpu/test_cuda_kv_retro.c.
 *
 * reset   A[off .. off + n) = -1, one thread an entry.
 * spans   one block of RS_THREADS threads per (request, KV head). The newest row's spans are the
 *         selection, copied. The pages 0 .. cur are walked RS_THREADS at a time, a thread a page:
 *         whether it is selected (a binary search over the selection's spans), m = its A before
 *         this step (cur: t - 1), then A = t (each page belongs to one thread: no hazard). For each
 *         past row, a page is in the supplement when selected, m < t' and its first position <=
 *         pos'; a run of such pages is one span (the reference merges adjacent pages the same
 *         way): a page whose predecessor is out opens a span at the index a block scan gives it,
 *         every page of the run raises the span's end with atomicMax (ends grow with the page,
 *         so the last page's clipped end wins: the same spans as kvs_retro_supplement).
 *         The keys counted (own, supplement) go to two uint64 with one atomicAdd a block.
 * merge   one block per (row, head): attn_merge's arithmetic (kv_span.cu k_attn_merge2) with the
 *         cached row cidx[t] of the previous step's cache, then the row is copied to the next
 *         cache (the caches alternate by step: the gather is never overwritten while read).
 *
 * Every kernel is launched with kvs_cu_launch (programmatic dependent launch) and waits on the
 * grid dependency before it reads what earlier kernels (Quest's select, attention_spans) wrote.
 */
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "kernels/cuda/cuda_internal.cuh"
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
              int32_t *__restrict__ n_spans, int32_t *__restrict__ spans, unsigned long long *__restrict__ keys)
{
    typedef cub::BlockScan<int, RS_THREADS> scan_t;
    typedef cub::BlockReduce<long long, RS_THREADS> red_t;
    __shared__ union {
        typename scan_t::TempStorage scan;
        typename red_t::TempStorage red;
    } tmp;
    __shared__ int s_inc[RS_THREADS];
    __shared__ int s_base[64], s_carry[64];   /* per past row: spans opened, whether the last page was in */
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
    __syncthreads();   /* tmp and the row states */
    long long sup = 0;
    for (int c0 = 0; c0 <= cur; c0 += RS_THREADS) {
        const int p = c0 + tid;
        const bool in = p <= cur && in_spans(sp, nsel, p * ps);
        /* the current page was loaded by the previous step's query (kvs_retro_mask_step) */
        const int m = !in ? 0 : p == cur ? t - 1 : a[p];
        if (in) a[p] = t;
        else if (p == cur) a[p] = t - 1;
        for (int j = 0; j < past; j++) {
            const int back = past - j, tp = t - back, posp = pos - back;
            const int inc = in && m < tp && p * ps <= posp;
            s_inc[tid] = inc;
            __syncthreads();   /* s_inc; the row's state */
            const int prev = tid > 0 ? s_inc[tid - 1] : s_carry[j];
            const int start = inc && !prev;
            int idx, total;
            scan_t(tmp.scan).ExclusiveSum(start, idx, total);
            const int base = s_base[j];
            int32_t *out = spans + ((size_t)(row0 + j) * n_kv + g) * ms2;
            const int hi = min((p + 1) * ps, posp + 1);
            if (start && base + idx < ms) out[2 * (base + idx)] = p * ps, out[2 * (base + idx) + 1] = hi;
            __syncthreads();   /* the opened spans are visible before their ends are raised; s_base read */
            const int k = base + idx + start - 1;
            if (inc && !start && k >= 0 && k < ms) atomicMax(&out[2 * k + 1], hi);
            if (inc) sup += hi - p * ps;
            if (tid == RS_THREADS - 1) s_base[j] = base + total, s_carry[j] = inc;
            __syncthreads();   /* s_inc, tmp and the row's state are rewritten next */
        }
    }
    if (past > 0) {
        sup = red_t(tmp.red).Sum(sup);
        if (tid == 0) atomicAdd(&keys[1], (unsigned long long)sup);
    }
    for (int j = tid; j < past; j += RS_THREADS) n_spans[(size_t)(row0 + j) * n_kv + g] = min(s_base[j], ms);
}

static void cu_retro_spans(struct kvs_backend *b, const struct kvs_dbuf *sel_n, const struct kvs_dbuf *sel,
                           const struct kvs_dbuf *req, int n_req, int n_kv_heads, int max_spans, int page_size,
                           struct kvs_dbuf *A, int a_layers, int a_layer, int max_pages, struct kvs_dbuf *n_spans,
                           struct kvs_dbuf *spans, struct kvs_dbuf *keys)
{
    if (n_req <= 0) return;
    KVS_ASSERT(keys->n >= 4);
    CUDA_CHECK(kvs_cu_launch(k_retro_spans, (unsigned)(n_req * n_kv_heads), RS_THREADS, 0, b->stream,
                             (const int32_t *)sel_n->d, (const int32_t *)sel->d, (const int32_t *)req->d, n_kv_heads,
                             max_spans, page_size, (int32_t *)A->d, a_layers, a_layer, max_pages,
                             (int32_t *)n_spans->d, (int32_t *)spans->d, (unsigned long long *)keys->d));
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

extern "C" const struct kvs_retro_kernels kvs_retro_kernels_cuda = {"cuda", cu_retro_reset, cu_retro_spans,
                                                                    cu_retro_merge};
