/* kv_paris.cu: the CUDA kernels of ParisKV's encoder and selection (kernels/kv_paris.h), tested
 * against the CPU reference (kernels/cpu/kv_paris.c) by tests/gpu/test_cuda_kv_paris.c.
 *
 * encode   one warp per (position, KV head): the key (bf16) in registers, head_dim / 32 values
 *          a lane; the SRHT's butterflies within a lane, then across lanes by shuffles, in the
 *          CPU's stage order and with the CPU's operations (the norm summed in index order by one
 *          lane; float products and sums rounded explicitly, no FMA contraction), so the rotated
 *          key has the CPU's bits; then one lane per block of 8 computes cid, codes and
 *          weight exactly as the CPU does (double sums in the same order). Counts by atomics.
 * prep     one block per (row, KV head): qbar (heads summed in increasing order, as the CPU),
 *          its SRHT (butterflies in shared memory), and the tier of every (block, centroid):
 *          a thread per centroid counts the keys of the centroids that rank before it (score
 *          descending, lower id first): the CPU's order, no sort needed.
 * vote     grid over (row x head, position chunks): vote per retrieval position (uint16) and a
 *          histogram of votes (one shared atomic per distinct vote of a warp).
 * keep     one block per (row, head): the vote threshold from the histogram, then a block scan
 *          over contiguous chunks takes the ties in position order (the CPU's stable order) for
 *          the ceil(beta n_r) candidates and for the coarse top-k.
 * rerank   a thread per candidate: the 4-bit estimate with explicit round-to-nearest multiplies
 *          and adds (no FMA contraction), as the CPU computes it (the code values from shared
 *          memory), into a 64-bit key
 *          (order key of est << 32 | ~position): unique, so the top-k has no ties.
 * topk     one block per (row, head): radix select (8 passes of 8 bits) of the k-th largest key,
 *          the passes reading shared memory once the keys with the prefix fit TOPK_LOCAL, the
 *          histograms one atomic per distinct digit of a warp; the chosen positions ranked by
 *          position, spans built by one thread.
 * kvs_paris_cuda_profile(1) makes select record events around its kernels (the bench's breakdown:
 * prep, vote, keep, rerank, top-k), read back by kvs_paris_cuda_last_phases.
 * Scratch: one cudaMallocAsync block per backend, kept between calls and grown (stream-ordered
 * free + alloc) when a call needs more (batch-1 selection is launch-bound: seven allocations
 * and frees per layer cost more than some of the kernels); kept for the process (one table
 * entry per backend, found under a mutex since tensor-parallel ranks select concurrently).
 * Plain launches (stream order), so nothing here relies on programmatic dependence.
 */
#include <cub/block/block_scan.cuh>
#include <pthread.h>

#include "kernels/cuda/cuda_internal.cuh"
#include "kernels/kv_paris.h"

#define PK_THREADS 1024

__constant__ float c_lm_thresh[7] = {.0843f, .1698f, .2578f, .3499f, .4487f, .5585f, .6901f};
__constant__ float c_lm_center[8] = {.0420f, .1266f, .2130f, .3025f, .3973f, .5001f, .6169f, .7633f};

__device__ __forceinline__ uint32_t p_okey(float x)
{
    const uint32_t u = __float_as_uint(x);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ size_t p_slot(const int32_t *bt, int p, int bs)
{
    return (size_t)bt[p / bs] * bs + (size_t)(p % bs);
}

/* one block of 8 rotated values x -> cid, 8 codes (4 bytes), weight; the CPU's operations */
__device__ void encode_block(const float *x, float kn, uint8_t *cid, uint8_t *code4, float *w)
{
    double r2 = 0;
    unsigned c = 0;
    for (int j = 0; j < 8; j++) {
        r2 += (double)x[j] * x[j];
        c |= (unsigned)(x[j] < 0) << j;
    }
    const float r = (float)sqrt(r2);
    double alpha = 0;
    uint8_t cd[8];
    for (int j = 0; j < 8; j++) {
        const float u = r > 0 ? __fdiv_rn(x[j], r) : 0.0f;
        const float a = fabsf(u);
        int t = 0;
        while (t < 7 && a > c_lm_thresh[t]) t++;
        cd[j] = (uint8_t)(((u < 0) << 3) | t);
        alpha += (double)c_lm_center[t] * a;
    }
    *cid = (uint8_t)c;
    for (int j = 0; j < 4; j++) code4[j] = (uint8_t)(cd[2 * j] | (cd[2 * j + 1] << 4));
    *w = r > 0 && alpha > 0 ? (float)((double)kn * r / alpha) : 0.0f;
}

/* ---- encode -------------------------------------------------------------------------------- */

template <int E>
__global__ void k_paris_encode(const bf16 *__restrict__ kc, const int32_t *__restrict__ bts,
                               const int32_t *__restrict__ its, int max_blocks, const int32_t *__restrict__ jobs, int layer, int n_layers, int nkv, int bs,
                               const float *__restrict__ signs, int W, uint8_t *__restrict__ codes,
                               float *__restrict__ wout, int32_t *__restrict__ counts)
{
    constexpr int D = 32 * E, B = D / 8;
    __shared__ float sx[8][D];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int32_t *J = jobs + (size_t)blockIdx.y * KVS_PARIS_JOB_N;
    const long item = (long)blockIdx.x * 8 + warp;
    const int p = J[KVS_PARIS_JOB_FROM] + (int)(item / nkv), g = (int)(item % nkv);
    if (p >= J[KVS_PARIS_JOB_TO]) return;
    const int32_t *bt = bts + (size_t)J[KVS_PARIS_JOB_SEQ] * max_blocks;
    const bf16 *kr = kc + (((size_t)bt[p / bs] * nkv + g) * bs + p % bs) * D;
    float x[E];
#pragma unroll
    for (int e = 0; e < E; e++) sx[warp][lane * E + e] = x[e] = __bfloat162float(kr[lane * E + e]);
    __syncwarp();
    /* the norm as the CPU sums it: squares (exact in double) added in index order, by one lane */
    double n2 = 0;
    if (lane == 0)
        for (int i = 0; i < D; i++) n2 += (double)sx[warp][i] * sx[warp][i];
    const float kn = (float)sqrt(__shfl_sync(0xffffffffu, n2, 0));
    __syncwarp();
#pragma unroll
    for (int e = 0; e < E; e++) x[e] = kn > 0 ? __fmul_rn(__fdiv_rn(x[e], kn), signs[lane * E + e]) : 0.0f;
    if (kn > 0) {
#pragma unroll
        for (int h = 1; h < E; h *= 2)
#pragma unroll
            for (int e = 0; e < E; e++)
                if (!(e & h)) {
                    const float a = x[e], b = x[e + h];
                    x[e] = __fadd_rn(a, b), x[e + h] = __fsub_rn(a, b);
                }
        for (int l = 1; l < 32; l *= 2)
#pragma unroll
            for (int e = 0; e < E; e++) {
                const float other = __shfl_xor_sync(0xffffffffu, x[e], l);
                x[e] = (lane & l) ? __fsub_rn(other, x[e]) : __fadd_rn(x[e], other);
            }
        const float s = __fdiv_rn(1.0f, __fsqrt_rn((float)D));
#pragma unroll
        for (int e = 0; e < E; e++) x[e] = __fmul_rn(x[e], s);
    }
#pragma unroll
    for (int e = 0; e < E; e++) sx[warp][lane * E + e] = x[e];
    __syncwarp();
    const size_t slot = p_slot(its ? its + (size_t)J[KVS_PARIS_JOB_SEQ] * max_blocks : bt, p, bs);
    uint8_t *row = codes + (slot * nkv + g) * (size_t)W * 4;
    float *wr = wout + (slot * nkv + g) * (size_t)B;
    int32_t *cnt = counts + (((size_t)J[KVS_PARIS_JOB_SLOT] * n_layers + layer) * nkv + g) * B * KVS_PARIS_NC;
    for (int b = lane; b < B; b += 32) {
        uint8_t cid;
        encode_block(&sx[warp][b * 8], kn, &cid, row + B + b * 4, wr + b);
        row[b] = cid;
        atomicAdd(cnt + b * KVS_PARIS_NC + cid, 1);
    }
}

static int paris_supports(int head_dim, char *err, size_t errlen)
{
    if (head_dim == 32 || head_dim == 64 || head_dim == 128 || head_dim == 256) return 0;
    return kvs_err(err, errlen, -ENOSYS, "kv.decode \"paris\": the CUDA kernels take head_dim 32, 64, 128 or 256, "
                   "not %d", head_dim);
}

static void cu_encode(struct kvs_backend *b, const struct kvs_dbuf *kc, const struct kvs_attn_meta *m,
                      const struct kvs_dbuf *idx_tables, const struct kvs_dbuf *jobs, const int32_t *h_jobs, int n_jobs, int layer, int n_layers,
                      int n_kv_heads, int head_dim, int block_size, const struct kvs_dbuf *signs,
                      struct kvs_dbuf *codes, struct kvs_dbuf *w, struct kvs_dbuf *counts)
{
    if (n_jobs <= 0) return;
    long most = 0;
    for (int j = 0; j < n_jobs; j++) {
        const long n = h_jobs[j * KVS_PARIS_JOB_N + KVS_PARIS_JOB_TO] - h_jobs[j * KVS_PARIS_JOB_N + KVS_PARIS_JOB_FROM];
        most = n > most ? n : most;
    }
    if (most <= 0) return;
    xh_forget(b, codes->d);
    xh_forget(b, w->d);
    xh_forget(b, counts->d);
    const dim3 grid((unsigned)((most * n_kv_heads + 7) / 8), (unsigned)n_jobs);
    const int W = kvs_paris_words(head_dim);
#define ENC(E)                                                                                                    \
    k_paris_encode<E><<<grid, 256, 0, b->stream>>>((const bf16 *)kc->d, (const int32_t *)m->block_tables->d,       \
                                                   idx_tables ? (const int32_t *)idx_tables->d : nullptr,          \
                                                   m->max_blocks, (const int32_t *)jobs->d, layer, n_layers,       \
                                                   n_kv_heads, block_size, (const float *)signs->d, W,             \
                                                   (uint8_t *)codes->d, (float *)w->d, (int32_t *)counts->d)
    switch (head_dim) {
    case 32: ENC(1); break;
    case 64: ENC(2); break;
    case 128: ENC(4); break;
    case 256: ENC(8); break;
    default: kvs_panic(__FILE__, __LINE__, "paris encode: head_dim %d", head_dim);
    }
#undef ENC
    CUDA_CHECK(cudaGetLastError());
}

/* ---- selection ----------------------------------------------------------------------------- */

struct sel_scratch {
    float *qt, *qn;
    uint8_t *tier;
    uint16_t *vote;
    int32_t *hist, *cand;
    unsigned long long *keys;
};

/* the per-backend scratch block (see the file comment) */
#define SCRATCH_SLOTS 16
static struct { const struct kvs_backend *b; char *p; size_t cap; } g_scratch[SCRATCH_SLOTS];
static pthread_mutex_t g_scratch_mu = PTHREAD_MUTEX_INITIALIZER;

static char *scratch_get(struct kvs_backend *b, size_t bytes)
{
    pthread_mutex_lock(&g_scratch_mu);
    int i = 0;
    while (i < SCRATCH_SLOTS && g_scratch[i].b && g_scratch[i].b != b) i++;
    if (i == SCRATCH_SLOTS) kvs_panic(__FILE__, __LINE__, "kv_paris: more than %d CUDA backends", SCRATCH_SLOTS);
    g_scratch[i].b = b;
    pthread_mutex_unlock(&g_scratch_mu);
    if (g_scratch[i].cap < bytes) {
        if (g_scratch[i].p) CUDA_CHECK(cudaFreeAsync(g_scratch[i].p, b->stream));
        g_scratch[i].cap = bytes + bytes / 4;
        CUDA_CHECK(cudaMallocAsync((void **)&g_scratch[i].p, g_scratch[i].cap, b->stream));
    }
    return g_scratch[i].p;
}

/* bytes rounded to 256 (the carve's alignment) */
static inline size_t al256(size_t x) { return (x + 255) / 256 * 256; }

/* qbar, its rotation (recomputed by each block: a few hundred flops) and the tiers of block b;
 * one block of 256 threads per (row x head, b): all SMs busy even at batch 1 */
__global__ void k_paris_prep(const float *__restrict__ q, const int32_t *__restrict__ rows, int n_layers, int layer,
                             int nh, int nkv, int D, const float *__restrict__ signs,
                             const int32_t *__restrict__ counts, float *__restrict__ qt_out,
                             float *__restrict__ qn_out, uint8_t *__restrict__ tier_out)
{
    __shared__ float x[1024];
    __shared__ uint32_t key[KVS_PARIS_NC];
    __shared__ int32_t cs[KVS_PARIS_NC];
    __shared__ double red[1];
    const int task = blockIdx.x, b = blockIdx.y, r = task / nkv, g = task % nkv, G = nh / nkv, t = threadIdx.x;
    const int B = D / 8;
    const int32_t *R = rows + (size_t)r * KVS_PARIS_ROW_N;
    if (R[KVS_PARIS_ROW_NR] <= 0) return;
    const int32_t *cnt = counts + (((size_t)R[KVS_PARIS_ROW_SLOT] * n_layers + layer) * nkv + g) * B * KVS_PARIS_NC;
    cs[t] = cnt[b * KVS_PARIS_NC + t];   /* blockDim.x == 256 */
    for (int i = t; i < D; i += blockDim.x) {
        float s = 0;
        for (int h = g * G; h < (g + 1) * G; h++) s = __fadd_rn(s, q[((size_t)r * nh + h) * D + i]);
        x[i] = __fdiv_rn(s, (float)G);
    }
    __syncthreads();
    /* the norm as the CPU sums it: in index order, by one thread */
    if (t == 0) {
        double n2 = 0;
        for (int i = 0; i < D; i++) n2 += (double)x[i] * x[i];
        red[0] = n2;
    }
    __syncthreads();
    const float qn = (float)sqrt(red[0]);
    for (int i = t; i < D; i += blockDim.x) x[i] = qn > 0 ? __fmul_rn(__fdiv_rn(x[i], qn), signs[i]) : 0.0f;
    __syncthreads();
    if (qn > 0) {
        for (int h = 1; h < D; h *= 2) {
            for (int pr = t; pr < D / 2; pr += blockDim.x) {
                const int j = (pr / h) * 2 * h + pr % h;
                const float a = x[j], bb = x[j + h];
                x[j] = __fadd_rn(a, bb), x[j + h] = __fsub_rn(a, bb);
            }
            __syncthreads();
        }
        const float s = __fdiv_rn(1.0f, __fsqrt_rn((float)D));
        for (int i = t; i < D; i += blockDim.x) x[i] = __fmul_rn(x[i], s);
        __syncthreads();
    }
    if (b == 0) {
        for (int i = t; i < D; i += blockDim.x) qt_out[(size_t)task * D + i] = x[i];
        if (t == 0) qn_out[task] = qn;
    }
    const int c = t;
    float acc = 0;
    for (int j = 0; j < 8; j++) acc = ((c >> j) & 1) ? __fsub_rn(acc, x[b * 8 + j]) : __fadd_rn(acc, x[b * 8 + j]);
    key[c] = p_okey(acc);
    __syncthreads();
    long long cum = 0;
    const uint32_t kc = key[c];
    for (int c2 = 0; c2 < KVS_PARIS_NC; c2++)
        if (key[c2] > kc || (key[c2] == kc && c2 < c)) cum += cs[c2];
    int n = 0;
    for (int z = 0; z < KVS_PARIS_TIERS; z++) n += cum < R[KVS_PARIS_ROW_T0 + z];
    tier_out[((size_t)task * B + b) * KVS_PARIS_NC + c] = (uint8_t)n;
}

#define VOTE_CHUNK 4096
#define VOTE_THREADS 512

/* votes of VOTE_CHUNK positions; the chunk's histogram of votes goes to chist[task][chunk] and
 * into the task's histogram */
__global__ void __launch_bounds__(VOTE_THREADS)
k_paris_vote(const int32_t *__restrict__ rows, const int32_t *__restrict__ bts, int max_blocks, int nkv, int D, int bs,
             int W, const uint8_t *__restrict__ codes, const uint8_t *__restrict__ tier, int max_nr,
             uint16_t *__restrict__ vote, int32_t *__restrict__ hist, int32_t *__restrict__ chist, int n_chunks)
{
    extern __shared__ unsigned char sm[];
    const int task = blockIdx.x, r = task / nkv, g = task % nkv, B = D / 8, maxv = KVS_PARIS_TIERS * B;
    const int32_t *R = rows + (size_t)r * KVS_PARIS_ROW_N;
    const int n_r = R[KVS_PARIS_ROW_NR], sink = R[KVS_PARIS_ROW_SINK];
    const int i0 = (int)blockIdx.y * VOTE_CHUNK;
    if (n_r <= 0 || i0 >= n_r) return;
    uint8_t *st = sm;
    int32_t *sh = (int32_t *)(sm + ((B * KVS_PARIS_NC + 15) / 16) * 16);
    for (int i = threadIdx.x; i < B * KVS_PARIS_NC; i += blockDim.x) st[i] = tier[(size_t)task * B * KVS_PARIS_NC + i];
    for (int i = threadIdx.x; i <= maxv; i += blockDim.x) sh[i] = 0;
    __syncthreads();
    const int32_t *bt = bts + (size_t)r * max_blocks;
    const int vec = (W * 4) % 16 == 0 && B % 16 == 0;
    /* whole warps step together (the loop bound is uniform), so the vote histogram can count one
     * atomic per distinct vote of the warp: votes crowd into a few values, and same-address
     * shared atomics serialize (the counts are the same) */
    for (int base = i0; base < i0 + VOTE_CHUNK; base += blockDim.x) {
        const int i = base + threadIdx.x;
        int v = -1;
        if (i < n_r) {
            const uint8_t *row = codes + (p_slot(bt, sink + i, bs) * nkv + g) * (size_t)W * 4;
            v = 0;
            for (int b = 0; b < B; b += 16) {
                uint32_t w4[4];
                if (vec) {
                    const uint4 u = *(const uint4 *)(row + b);
                    w4[0] = u.x, w4[1] = u.y, w4[2] = u.z, w4[3] = u.w;
                } else {
                    for (int k = 0; k < 4; k++) w4[k] = b + 4 * k < B ? ((const uint32_t *)row)[b / 4 + k] : 0;
                }
                for (int k = 0; k < 4 && b + 4 * k < B; k++) {
                    const int bb = b + 4 * k;
                    const uint32_t c4 = w4[k];
                    v += st[bb * KVS_PARIS_NC + (c4 & 255)] + st[(bb + 1) * KVS_PARIS_NC + ((c4 >> 8) & 255)] +
                         st[(bb + 2) * KVS_PARIS_NC + ((c4 >> 16) & 255)] + st[(bb + 3) * KVS_PARIS_NC + (c4 >> 24)];
                }
            }
            vote[(size_t)task * max_nr + i] = (uint16_t)v;
        }
        const unsigned same = __match_any_sync(0xffffffffu, v);
        if (v >= 0 && (threadIdx.x & 31) == __ffs(same) - 1) atomicAdd(sh + v, __popc(same));
    }
    __syncthreads();
    int32_t *ch = chist + ((size_t)task * n_chunks + blockIdx.y) * (maxv + 1);
    for (int i = threadIdx.x; i <= maxv; i += blockDim.x) {
        ch[i] = sh[i];
        if (sh[i]) atomicAdd(hist + (size_t)task * (maxv + 1) + i, sh[i]);
    }
}

typedef cub::BlockScan<int, VOTE_THREADS> vc_scan;

/* the top keep by vote (ties: lower position) of one chunk, into cand at slots counted by
 * *n_cand (their order there does not matter: the rerank key is unique) */
__global__ void __launch_bounds__(VOTE_THREADS)
k_paris_collect(const int32_t *__restrict__ rows, int nkv, int D, int max_nr, const uint16_t *__restrict__ vote,
                const int32_t *__restrict__ hist, const int32_t *__restrict__ chist, int n_chunks,
                int32_t *__restrict__ n_cand, int32_t *__restrict__ cand)
{
    __shared__ typename vc_scan::TempStorage tmp;
    __shared__ int s_thr, s_need, s_before, s_base;
    const int task = blockIdx.x, r = task / nkv, maxv = KVS_PARIS_TIERS * (D / 8);
    const int32_t *R = rows + (size_t)r * KVS_PARIS_ROW_N;
    const int n_r = R[KVS_PARIS_ROW_NR], sink = R[KVS_PARIS_ROW_SINK];
    const int chunk = blockIdx.y, i0 = chunk * VOTE_CHUNK;
    if (n_r <= 0 || i0 >= n_r) return;
    if (threadIdx.x == 0) {
        const int keep = min(R[KVS_PARIS_ROW_KEEP], n_r);
        const int32_t *h = hist + (size_t)task * (maxv + 1);
        int cum = 0, v = maxv;
        while (v > 0 && cum + h[v] < keep) cum += h[v--];
        int before = 0;
        for (int c = 0; c < chunk; c++) before += chist[((size_t)task * n_chunks + c) * (maxv + 1) + v];
        s_thr = v, s_need = keep - cum, s_before = before;
    }
    __syncthreads();
    const int thr = s_thr;
    const int a0 = i0 + threadIdx.x * (VOTE_CHUNK / VOTE_THREADS), a1 = min(a0 + VOTE_CHUNK / VOTE_THREADS, n_r);
    const uint16_t *vt = vote + (size_t)task * max_nr;
    int eq = 0;
    for (int i = a0; i < a1; i++) eq += vt[i] == thr;
    int eq_before, total;
    vc_scan(tmp).ExclusiveSum(eq, eq_before, total);
    __syncthreads();
    int rank = s_before + eq_before, take = 0;
    for (int i = a0; i < a1; i++) {
        const int v = vt[i];
        take += v > thr || (v == thr && rank++ < s_need);
    }
    int at;
    vc_scan(tmp).ExclusiveSum(take, at, total);
    if (threadIdx.x == 0) s_base = total ? atomicAdd(n_cand + task, total) : 0;
    __syncthreads();
    int32_t *out = cand + (size_t)task * max_nr + s_base + at;
    rank = s_before + eq_before;
    for (int i = a0; i < a1; i++) {
        const int v = vt[i];
        if (v > thr || (v == thr && rank++ < s_need)) *out++ = sink + i;
    }
}

typedef cub::BlockScan<int, PK_THREADS> pk_scan;

/* takes the top n by vote (ties: lower position) in position order into out; one block */
__device__ void take_by_vote(const uint16_t *vote, const int32_t *hist, int maxv, int n_r, int n, int sink,
                             int32_t *out, int *s_thr, int *s_gt, typename pk_scan::TempStorage &tmp)
{
    if (threadIdx.x == 0) {
        int cum = 0, v = maxv;
        while (v > 0 && cum + hist[v] < n) cum += hist[v--];
        *s_thr = v, *s_gt = cum;
    }
    __syncthreads();
    const int thr = *s_thr, need_eq = n - *s_gt;
    const int chunk = (n_r + PK_THREADS - 1) / PK_THREADS, a0 = threadIdx.x * chunk, a1 = min(a0 + chunk, n_r);
    int eq = 0, gt = 0;
    for (int i = a0; i < a1; i++) eq += vote[i] == thr, gt += vote[i] > thr;
    int eq_before, total;
    pk_scan(tmp).ExclusiveSum(eq, eq_before, total);
    __syncthreads();
    const int take_eq = max(0, min(eq, need_eq - eq_before));
    int at;
    pk_scan(tmp).ExclusiveSum(gt + take_eq, at, total);
    __syncthreads();
    int taken = 0;
    for (int i = a0; i < a1; i++) {
        const int v = vote[i];
        if (v > thr || (v == thr && taken < take_eq)) {
            taken += v == thr;
            out[at++] = sink + i;
        }
    }
    __syncthreads();
}

/* the coarse top-k (recall counters only): the top topk by vote, in position order */
__global__ void __launch_bounds__(PK_THREADS)
k_paris_coarse(const int32_t *__restrict__ rows, int nkv, int D, int max_nr, const uint16_t *__restrict__ vote,
               const int32_t *__restrict__ hist, int32_t *__restrict__ coarse, int max_topk)
{
    __shared__ typename pk_scan::TempStorage tmp;
    __shared__ int s_thr, s_gt;
    const int task = blockIdx.x, r = task / nkv, maxv = KVS_PARIS_TIERS * (D / 8);
    const int32_t *R = rows + (size_t)r * KVS_PARIS_ROW_N;
    const int n_r = R[KVS_PARIS_ROW_NR];
    for (int i = threadIdx.x; i < max_topk; i += blockDim.x) coarse[(size_t)task * max_topk + i] = -1;
    if (n_r <= 0) return;
    __syncthreads();
    const int keep = min(R[KVS_PARIS_ROW_KEEP], n_r), topk = min(R[KVS_PARIS_ROW_TOPK], keep);
    take_by_vote(vote + (size_t)task * max_nr, hist + (size_t)task * (maxv + 1), maxv, n_r, min(topk, max_topk),
                 R[KVS_PARIS_ROW_SINK], coarse + (size_t)task * max_topk, &s_thr, &s_gt, tmp);
}

#define RERANK_CHUNK 128   /* candidates per block, one a thread: the estimate is a serial chain */
__global__ void k_paris_rerank(const int32_t *__restrict__ rows, const int32_t *__restrict__ bts, int max_blocks,
                               int nkv, int D, int bs, int W, const uint8_t *__restrict__ codes,
                               const float *__restrict__ wts, const float *__restrict__ qt,
                               const float *__restrict__ qn, int max_nr, const int32_t *__restrict__ cand,
                               unsigned long long *__restrict__ keys)
{
    __shared__ float sq[1024], s_lm[16];
    const int task = blockIdx.x, r = task / nkv, g = task % nkv, B = D / 8;
    const int32_t *R = rows + (size_t)r * KVS_PARIS_ROW_N;
    const int n_r = R[KVS_PARIS_ROW_NR], keep = min(R[KVS_PARIS_ROW_KEEP], n_r);
    const int i0 = (int)blockIdx.y * RERANK_CHUNK;
    if (n_r <= 0 || i0 >= keep) return;
    for (int i = threadIdx.x; i < D; i += blockDim.x) sq[i] = qt[(size_t)task * D + i];
    /* the 16 signed code values in shared memory: constant memory serializes a warp whose lanes
     * read different entries, as the codes of different keys do (negation is exact: same bits) */
    for (int c = threadIdx.x; c < 16; c += blockDim.x) s_lm[c] = (c & 8) ? -c_lm_center[c & 7] : c_lm_center[c & 7];
    __syncthreads();
    const int32_t *bt = bts + (size_t)r * max_blocks;
    const int vec = (W * 4) % 16 == 0 && B % 16 == 0;   /* 16-byte aligned code rows */
    for (int i = i0 + threadIdx.x; i < keep && i < i0 + RERANK_CHUNK; i += blockDim.x) {
        const int p = cand[(size_t)task * max_nr + i];
        const size_t slot = p_slot(bt, p, bs);
        const uint8_t *row = codes + (slot * nkv + g) * (size_t)W * 4 + B;
        const float *w = wts + (slot * nkv + g) * (size_t)B;
        float est = 0;
        for (int b0 = 0; b0 < B; b0 += 4) {
            uint32_t c4[4];
            if (vec) {
                const uint4 u = *(const uint4 *)(row + b0 * 4);
                c4[0] = u.x, c4[1] = u.y, c4[2] = u.z, c4[3] = u.w;
            } else {
                for (int k = 0; k < 4; k++) c4[k] = ((const uint32_t *)row)[b0 + k];
            }
            const float4 w4 = *(const float4 *)(w + b0);
            const float wk[4] = {w4.x, w4.y, w4.z, w4.w};
#pragma unroll
            for (int k = 0; k < 4; k++) {
                float dot = 0;
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    const float v = s_lm[(c4[k] >> (4 * j)) & 15];
                    dot = __fadd_rn(dot, __fmul_rn(v, sq[(b0 + k) * 8 + j]));
                }
                est = __fadd_rn(est, __fmul_rn(wk[k], dot));
            }
        }
        est = __fmul_rn(qn[task], est);
        keys[(size_t)task * max_nr + i] = (unsigned long long)p_okey(est) << 32 | (0xFFFFFFFFu - (uint32_t)p);
    }
}

#define TOPK_LOCAL 2048   /* keys a top-k block keeps in shared memory once the prefix narrows to them */

/* adds the digits of the keys with the prefix to the histogram, key i by thread i mod blockDim:
 * one atomic per distinct digit of the warp (whole warps step together: the loop bound is
 * uniform), since the leading digits of keys of similar estimates are nearly all the same and
 * same-address shared atomics serialize */
__device__ __forceinline__ void radix_hist(const unsigned long long *keys, int n, unsigned long long mask,
                                           unsigned long long prefix, int shift, int *h)
{
    for (int base = 0; base < n; base += blockDim.x) {
        const int i = base + threadIdx.x;
        unsigned d = 256;
        if (i < n) {
            const unsigned long long x = keys[i];
            if ((x & mask) == prefix) d = (unsigned)(x >> shift) & 255;
        }
        const unsigned same = __match_any_sync(0xffffffffu, d);
        if (d < 256 && (threadIdx.x & 31) == __ffs(same) - 1) atomicAdd(h + d, __popc(same));
    }
}

/* the k largest of n unique keys (radix select, 8 passes of 8 bits), their positions ascending
 * into s_pos[0..k). Once the keys that share the prefix fit TOPK_LOCAL they are copied to shared
 * memory and the remaining passes read only them (the passes over all n keys were most of the
 * top-k's time at a 1M context); the final collection reads all keys once more. */
__device__ void select_top(const unsigned long long *keys, int n, int k, int *s_pos, int *s_hist, int *s_misc,
                           unsigned long long *s_keys)
{
    unsigned long long prefix = 0, mask = 0;
    int remaining = k, n_local = -1;   /* -1: the passes read keys[0..n) */
    for (int shift = 56; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += blockDim.x) s_hist[i] = 0;
        __syncthreads();
        if (n_local < 0) radix_hist(keys, n, mask, prefix, shift, s_hist);
        else radix_hist(s_keys, n_local, mask, prefix, shift, s_hist);
        __syncthreads();
        if (threadIdx.x == 0) {
            int d = 255, cum = 0;
            while (d > 0 && cum + s_hist[d] < remaining) cum += s_hist[d--];
            s_misc[0] = d, s_misc[1] = remaining - cum, s_misc[3] = s_hist[d];
        }
        __syncthreads();
        prefix |= (unsigned long long)s_misc[0] << shift;
        mask |= 255ull << shift;
        remaining = s_misc[1];
        const int matching = s_misc[3];
        __syncthreads();
        if (n_local < 0 && shift > 0 && matching <= TOPK_LOCAL) {
            /* the keys with the new prefix (exactly `matching` of them) into shared memory */
            if (threadIdx.x == 0) s_misc[2] = 0;
            __syncthreads();
            for (int i = threadIdx.x; i < n; i += blockDim.x) {
                const unsigned long long x = keys[i];
                if ((x & mask) == prefix) s_keys[atomicAdd(s_misc + 2, 1)] = x;
            }
            n_local = matching;
            __syncthreads();
        }
    }
    /* prefix is now the k-th largest key: keys >= prefix are the k chosen */
    if (threadIdx.x == 0) s_misc[2] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        if (keys[i] >= prefix) s_pos[k + atomicAdd(s_misc + 2, 1)] = (int)(0xFFFFFFFFu - (uint32_t)keys[i]);
    __syncthreads();
    for (int i = threadIdx.x; i < k; i += blockDim.x) {
        const int p = s_pos[k + i];
        int rank = 0;
        for (int j = 0; j < k; j++) rank += s_pos[k + j] < p;
        s_pos[rank] = p;
    }
    __syncthreads();
}

__global__ void __launch_bounds__(PK_THREADS)
k_paris_topk(const int32_t *__restrict__ rows, int nkv, int max_nr, const unsigned long long *__restrict__ keys,
             int max_spans, int max_topk, int32_t *__restrict__ n_spans, int32_t *__restrict__ spans,
             int32_t *__restrict__ sel)
{
    extern __shared__ int s_pos[];   /* [2 max_topk] */
    __shared__ int s_hist[256], s_misc[4];
    __shared__ unsigned long long s_keys[TOPK_LOCAL];
    const int task = blockIdx.x, r = task / nkv;
    const int32_t *R = rows + (size_t)r * KVS_PARIS_ROW_N;
    const int n_r = R[KVS_PARIS_ROW_NR], sink = R[KVS_PARIS_ROW_SINK], ctx = R[KVS_PARIS_ROW_CTX];
    int32_t *sp = spans + (size_t)task * max_spans * 2;
    if (sel)
        for (int i = threadIdx.x; i < max_topk; i += blockDim.x) sel[(size_t)task * max_topk + i] = -1;
    if (n_r <= 0) {
        if (threadIdx.x == 0) n_spans[task] = 1, sp[0] = 0, sp[1] = ctx;
        return;
    }
    const int keep = min(R[KVS_PARIS_ROW_KEEP], n_r), topk = min(min(R[KVS_PARIS_ROW_TOPK], keep), max_topk);
    select_top(keys + (size_t)task * max_nr, keep, topk, s_pos, s_hist, s_misc, s_keys);
    if (sel)
        for (int i = threadIdx.x; i < topk; i += blockDim.x) sel[(size_t)task * max_topk + i] = s_pos[i];
    if (threadIdx.x == 0) {
        int n = 0;
        auto add = [&](int a, int b) {
            if (a >= b) return;
            if (n && sp[2 * n - 1] == a) sp[2 * n - 1] = b;
            else sp[2 * n] = a, sp[2 * n + 1] = b, n++;
        };
        add(0, sink);
        for (int i = 0; i < topk; i++) add(s_pos[i], s_pos[i] + 1);
        add(sink + n_r, ctx);
        n_spans[task] = n;
    }
}

/* phase timing for the bench (kvs_paris_cuda_profile): events around each kernel of select */
static int prof_on;
static cudaEvent_t prof_ev[6];

extern "C" void kvs_paris_cuda_profile(int on)
{
    if (on && !prof_ev[0])
        for (int i = 0; i < 6; i++) CUDA_CHECK(cudaEventCreate(&prof_ev[i]));
    prof_on = on;
}

extern "C" int kvs_paris_cuda_last_phases(float ms[5])
{
    if (!prof_ev[0]) return -1;
    CUDA_CHECK(cudaEventSynchronize(prof_ev[5]));
    for (int i = 0; i < 5; i++) CUDA_CHECK(cudaEventElapsedTime(&ms[i], prof_ev[i], prof_ev[i + 1]));
    return 0;
}

#define PROF(i)                                                      \
    do {                                                             \
        if (prof_on) CUDA_CHECK(cudaEventRecord(prof_ev[i], st));    \
    } while (0)

/* the top-k kernels' dynamic shared memory (2 max_topk ints) past the default 48 KB less their
 * static arrays (TOPK_LOCAL keys): opt in to the device's larger limit once a size needs it */
template <typename F> static void topk_smem(F *kernel, size_t dyn)
{
    if (dyn > 16384) CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)dyn));
}

static void cu_select(struct kvs_backend *b, const struct kvs_dbuf *q, const struct kvs_attn_meta *m,
                      const struct kvs_dbuf *rows, const int32_t *h_rows, int n, int layer, int n_layers, int n_heads,
                      int n_kv_heads, int head_dim, int block_size, const struct kvs_dbuf *signs,
                      const struct kvs_dbuf *codes, const struct kvs_dbuf *w, const struct kvs_dbuf *counts,
                      int max_spans, int max_topk, struct kvs_dbuf *n_spans, struct kvs_dbuf *spans,
                      struct kvs_dbuf *sel, struct kvs_dbuf *coarse)
{
    if (n <= 0) return;
    const int D = head_dim, B = D / 8, W = kvs_paris_words(D), maxv = KVS_PARIS_TIERS * B, T = n * n_kv_heads;
    int max_nr = 1;
    for (int r = 0; r < n; r++) max_nr = h_rows[r * KVS_PARIS_ROW_N + KVS_PARIS_ROW_NR] > max_nr
                                             ? h_rows[r * KVS_PARIS_ROW_N + KVS_PARIS_ROW_NR] : max_nr;
    xh_forget(b, n_spans->d);
    xh_forget(b, spans->d);
    if (sel) xh_forget(b, sel->d);
    if (coarse) xh_forget(b, coarse->d);
    cudaStream_t st = b->stream;
    sel_scratch s;
    const int n_chunks = (max_nr + VOTE_CHUNK - 1) / VOTE_CHUNK;
    const size_t b_qt = al256((size_t)T * D * 4), b_qn = al256((size_t)T * 4), b_tier = al256((size_t)T * B * KVS_PARIS_NC);
    const size_t b_vote = al256((size_t)T * max_nr * 2), b_cand = al256((size_t)T * max_nr * 4);
    const size_t b_hist = al256(((size_t)T * (maxv + 1) * (1 + n_chunks) + T) * 4), b_keys = al256((size_t)T * max_nr * 8);
    char *sp0 = scratch_get(b, b_keys + b_qt + b_qn + b_tier + b_vote + b_hist + b_cand);
    s.keys = (unsigned long long *)sp0, sp0 += b_keys;
    s.qt = (float *)sp0, sp0 += b_qt;
    s.qn = (float *)sp0, sp0 += b_qn;
    s.tier = (uint8_t *)sp0, sp0 += b_tier;
    s.vote = (uint16_t *)sp0, sp0 += b_vote;
    s.hist = (int32_t *)sp0, sp0 += b_hist;
    s.cand = (int32_t *)sp0;
    /* the rerank's grid: candidates are at most the largest keep */
    int max_keep = 1;
    for (int r = 0; r < n; r++) {
        const int32_t *R = h_rows + r * KVS_PARIS_ROW_N;
        const int k = R[KVS_PARIS_ROW_KEEP] < R[KVS_PARIS_ROW_NR] ? R[KVS_PARIS_ROW_KEEP] : R[KVS_PARIS_ROW_NR];
        max_keep = k > max_keep ? k : max_keep;
    }
    /* hist [T][maxv + 1], then n_cand [T], then the chunk histograms [T][n_chunks][maxv + 1] */
    int32_t *n_cand = s.hist + (size_t)T * (maxv + 1), *chist = n_cand + T;
    CUDA_CHECK(cudaMemsetAsync(s.hist, 0, ((size_t)T * (maxv + 1) + T) * 4, st));
    PROF(0);
    const int32_t *d_rows = (const int32_t *)rows->d, *bts = (const int32_t *)m->block_tables->d;
    k_paris_prep<<<dim3(T, B), 256, 0, st>>>((const float *)q->d, d_rows, n_layers, layer, n_heads, n_kv_heads, D,
                                             (const float *)signs->d, (const int32_t *)counts->d, s.qt, s.qn, s.tier);
    PROF(1);
    const size_t vsm = (size_t)(B * KVS_PARIS_NC + 15) / 16 * 16 + (size_t)(maxv + 1) * 4;
    k_paris_vote<<<dim3(T, n_chunks), VOTE_THREADS, vsm, st>>>(d_rows, bts, m->max_blocks, n_kv_heads, D, block_size, W,
                                                              (const uint8_t *)codes->d, s.tier, max_nr, s.vote,
                                                              s.hist, chist, n_chunks);
    PROF(2);
    k_paris_collect<<<dim3(T, n_chunks), VOTE_THREADS, 0, st>>>(d_rows, n_kv_heads, D, max_nr, s.vote, s.hist, chist,
                                                               n_chunks, n_cand, s.cand);
    if (coarse)
        k_paris_coarse<<<T, PK_THREADS, 0, st>>>(d_rows, n_kv_heads, D, max_nr, s.vote, s.hist, (int32_t *)coarse->d,
                                                 max_topk);
    PROF(3);
    k_paris_rerank<<<dim3(T, (max_keep + RERANK_CHUNK - 1) / RERANK_CHUNK), RERANK_CHUNK, 0, st>>>(d_rows, bts, m->max_blocks, n_kv_heads, D,
                                                                    block_size, W, (const uint8_t *)codes->d,
                                                                    (const float *)w->d, s.qt, s.qn, max_nr, s.cand,
                                                                    s.keys);
    PROF(4);
    topk_smem(k_paris_topk, (size_t)2 * max_topk * 4);
    k_paris_topk<<<T, PK_THREADS, (size_t)2 * max_topk * 4, st>>>(d_rows, n_kv_heads, max_nr, s.keys, max_spans,
                                                                  max_topk, (int32_t *)n_spans->d,
                                                                  (int32_t *)spans->d, sel ? (int32_t *)sel->d : NULL);
    PROF(5);
    CUDA_CHECK(cudaGetLastError());
}

/* ---- exact top-k (the recall reference) ------------------------------------------------------ */

__global__ void k_paris_exact_score(const float *__restrict__ q, const bf16 *__restrict__ kc,
                                    const int32_t *__restrict__ rows, const int32_t *__restrict__ bts, int max_blocks,
                                    int nh, int nkv, int D, int bs, int max_nr, unsigned long long *__restrict__ keys)
{
    __shared__ float qb[1024];
    const int task = blockIdx.x, r = task / nkv, g = task % nkv, G = nh / nkv;
    const int32_t *R = rows + (size_t)r * KVS_PARIS_ROW_N;
    const int n_r = R[KVS_PARIS_ROW_NR], sink = R[KVS_PARIS_ROW_SINK];
    const int i0 = (int)blockIdx.y * 1024;
    if (n_r <= 0 || i0 >= n_r) return;
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        float s = 0;
        for (int h = g * G; h < (g + 1) * G; h++) s = __fadd_rn(s, q[((size_t)r * nh + h) * D + i]);
        qb[i] = __fdiv_rn(s, (float)G);
    }
    __syncthreads();
    const int32_t *bt = bts + (size_t)r * max_blocks;
    for (int i = i0 + threadIdx.x; i < n_r && i < i0 + 1024; i += blockDim.x) {
        const int p = sink + i;
        const bf16 *kr = kc + (((size_t)bt[p / bs] * nkv + g) * bs + p % bs) * D;
        double dot = 0;
        for (int t = 0; t < D; t++) dot += (double)__bfloat162float(kr[t]) * qb[t];
        keys[(size_t)task * max_nr + i] = (unsigned long long)p_okey((float)dot) << 32 | (0xFFFFFFFFu - (uint32_t)p);
    }
}

__global__ void __launch_bounds__(PK_THREADS)
k_paris_exact_top(const int32_t *__restrict__ rows, int nkv, int max_nr, const unsigned long long *__restrict__ keys,
                  int max_topk, int32_t *__restrict__ out)
{
    extern __shared__ int s_pos[];
    __shared__ int s_hist[256], s_misc[4];
    __shared__ unsigned long long s_keys[TOPK_LOCAL];
    const int task = blockIdx.x, r = task / nkv;
    const int32_t *R = rows + (size_t)r * KVS_PARIS_ROW_N;
    const int n_r = R[KVS_PARIS_ROW_NR];
    for (int i = threadIdx.x; i < max_topk; i += blockDim.x) out[(size_t)task * max_topk + i] = -1;
    if (n_r <= 0) return;
    const int topk = min(min(R[KVS_PARIS_ROW_TOPK], n_r), max_topk);
    __syncthreads();
    select_top(keys + (size_t)task * max_nr, n_r, topk, s_pos, s_hist, s_misc, s_keys);
    for (int i = threadIdx.x; i < topk; i += blockDim.x) out[(size_t)task * max_topk + i] = s_pos[i];
}

static void cu_exact_topk(struct kvs_backend *b, const struct kvs_dbuf *q, const struct kvs_dbuf *kc,
                          const struct kvs_attn_meta *m, const int32_t *h_rows, int n, int n_heads, int n_kv_heads,
                          int head_dim, int block_size, int max_topk, struct kvs_dbuf *out)
{
    if (n <= 0) return;
    int max_nr = 1;
    for (int r = 0; r < n; r++) max_nr = h_rows[r * KVS_PARIS_ROW_N + KVS_PARIS_ROW_NR] > max_nr
                                             ? h_rows[r * KVS_PARIS_ROW_N + KVS_PARIS_ROW_NR] : max_nr;
    const int T = n * n_kv_heads;
    xh_forget(b, out->d);
    /* the rows buffer: the policy's d_rows is not passed here, so upload the host copy */
    int32_t *d_rows;
    unsigned long long *keys;
    cudaStream_t st = b->stream;
    CUDA_CHECK(cudaMallocAsync((void **)&d_rows, (size_t)n * KVS_PARIS_ROW_N * 4, st));
    CUDA_CHECK(cudaMallocAsync((void **)&keys, (size_t)T * max_nr * 8, st));
    CUDA_CHECK(cudaMemcpyAsync(d_rows, h_rows, (size_t)n * KVS_PARIS_ROW_N * 4, cudaMemcpyHostToDevice, st));
    k_paris_exact_score<<<dim3(T, (max_nr + 1023) / 1024), 256, 0, st>>>(
        (const float *)q->d, (const bf16 *)kc->d, d_rows, (const int32_t *)m->block_tables->d, m->max_blocks, n_heads,
        n_kv_heads, head_dim, block_size, max_nr, keys);
    topk_smem(k_paris_exact_top, (size_t)2 * max_topk * 4);
    k_paris_exact_top<<<T, PK_THREADS, (size_t)2 * max_topk * 4, st>>>(d_rows, n_kv_heads, max_nr, keys, max_topk,
                                                                       (int32_t *)out->d);
    CUDA_CHECK(cudaGetLastError());
    /* the copy reads h_rows asynchronously: wait before the caller may change it */
    CUDA_CHECK(cudaStreamSynchronize(st));
    CUDA_CHECK(cudaFreeAsync(d_rows, st));
    CUDA_CHECK(cudaFreeAsync(keys, st));
}

/* kernels/cuda/kv_paris_host.cu */
extern "C" void *kvs_paris_cuda_host_alloc(struct kvs_backend *b, size_t bytes, char *err, size_t errlen);
extern "C" void kvs_paris_cuda_host_free(struct kvs_backend *b, void *p);
extern "C" void kvs_paris_cuda_write_out(struct kvs_backend *b, const struct kvs_dbuf *kc, const struct kvs_dbuf *vc,
                                         const struct kvs_attn_meta *m, const struct kvs_dbuf *jobs,
                                         const int32_t *h_jobs, int n_jobs, int layer, int n_layers, int n_kv_heads,
                                         int head_dim, int block_size, const struct kvs_dbuf *pages, int page_stride,
                                         void *host_k, void *host_v);
extern "C" void kvs_paris_cuda_gather(struct kvs_backend *b, const struct kvs_dbuf *kc, const struct kvs_dbuf *vc,
                                      const struct kvs_attn_meta *m, const struct kvs_dbuf *rows,
                                      const int32_t *h_rows, int n, int layer, int n_layers, int n_kv_heads,
                                      int head_dim, int block_size, const struct kvs_dbuf *n_spans,
                                      const struct kvs_dbuf *spans, int max_spans, const struct kvs_dbuf *pages,
                                      int page_stride, const void *host_k, const void *host_v,
                                      struct kvs_dbuf *stage_k, struct kvs_dbuf *stage_v, int stage_blocks);

extern "C" struct kvs_dbuf *kvs_paris_cuda_host_view(struct kvs_backend *b, void *host, size_t off, size_t n);
extern "C" void kvs_paris_cuda_host_view_free(struct kvs_backend *b, struct kvs_dbuf *view);

extern "C" const struct kvs_paris_kernels kvs_paris_kernels_cuda = {
    "cuda",
    paris_supports,
    cu_encode,
    cu_select,
    cu_exact_topk,
    2,
    kvs_paris_cuda_host_alloc,
    kvs_paris_cuda_host_free,
    kvs_paris_cuda_write_out,
    kvs_paris_cuda_gather,
    kvs_paris_cuda_host_view,
    kvs_paris_cuda_host_view_free,
};
