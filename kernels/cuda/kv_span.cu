/* kv_span.cu: the CUDA backend's KV-strategy primitives (backend.h): attention_spans, the
 * attention of each query row over explicit token spans of its own sequence with the log-sum-exp
 * of the result, and attn_merge, the merge of two (o, lse) partials over disjoint key sets. Every
 * sparse or reuse decode policy (engine/kv/kv.h) builds on these two.
 *
 * attention_spans: one warp a block owns (query row t, KV head g, split): its rows are the G query
 * heads of the group (GQA: every K/V byte read serves all of them; 16 rows a tensor-core m-tile,
 * two m-tiles for groups of up to 32), q rounded to bf16 for the products, softmax and every
 * accumulation in fp32 (the tensor-core pieces of the paged attention, cuda_attn_device.cuh).
 * The selected keys (each span clipped to the row's own position: causal) are taken in span
 * order and gathered 32 at a time into one staged K/V tile, so page-sized spans fill whole tiles
 * (a tile of 32 consecutive positions from a multiple of 16 takes the paged attention's
 * two-pointer copies, any other tile one copy source per key); slots past a block's valid count
 * (block_valid) are not read (the cp.async copies zero-fill them). Long span sets (up to 128K
 * tokens) are cut into splits of equal tile counts over the grid's y dimension, so a single row
 * still fills the GPU, and a second kernel merges the splits' partials (acc, max, sum) in split
 * order, writing out and lse (deterministic for a given launch shape). Deferred RoPE
 * (rot_offsets) as the paged attention does it: q rotated backward
 * by a block's offset at document boundaries (rot_table + rotate_frags).
 *
 * Four kinds (kvs_cuda_set_span_kernel). The start of a split deep in a long span list: kind 1
 * (main's up to quest7) finds it 32 spans a step from the first (cursor_seek_linear: each step a
 * dependent load and warp scan, ns / 32 of them for the last split: a Quest row keeps one span per
 * page, 1229 at 128K), kinds 2 and 3 with the lanes' shares of the list summed at once and one
 * scan (cursor_seek: the same cursor). The staging: kinds 1 and 3, SPAN_ST tiles of K and V
 * together in flight; kind 2, k_attn_fd's FlashAttention-2 order per warp (cuda_attn_decode.cu):
 * one K and one V buffer of 32 keys,
 *     issue V_i; wait K_i; S = Q K_i^T, softmax; issue K_{i+1}; wait V_i; O += P V_i
 * half the shared memory a block, so about twice the resident blocks (one warp each) a SM and
 * twice the splits in one wave (groups of up to 16 heads; others take kind 3). Kind 4: kind 3 with
 * the two-pointer copies also for tiles whose two 16-key halves are each consecutive from a
 * multiple of 16 (cuda_span_walk.cuh span_lookup, halves): a Quest tile is two kept pages of 16
 * slots in unrelated blocks, which kinds 1-3 gather key by key. Every kind takes the same keys in
 * the same order within a split, and kinds 3 and 4 stage the same bytes in the same slots (the
 * same bits, test_cuda_span); the A/B is in bench/RESULTS.md (quest8, quest10).
 *
 * attn_merge: elementwise, one block per (row, head).
 *
 * Nothing is allocated: the split partials go to the backend's attention workspace (ops run in
 * order on one stream, so attention() and this op never use it at the same time). Shapes the
 * kernels do not take (those kvs_cuda_supports_attention rejects) abort with a message (bugs:
 * the loader refuses such models on this backend first).
 */
#include "kernels/cuda/cuda_attn_device.cuh"
#include "kernels/cuda/cuda_attn_pool_issue.cuh"
#include "kernels/cuda/cuda_internal.cuh"
#include "kernels/cuda/cuda_span_walk.cuh"
#include "kernels/cuda/kv_span.h"

#define SPAN_ST 2          /* tiles in flight */
#define SPAN_MIN_TILES 4   /* tiles a split is planned with at least (128 keys) */
#define SPAN_MAX_SPLITS 256
#define SPAN_KIND_DEFAULT 4   /* kvs_cuda_set_span_kernel: the kind the A/B chose (bench/RESULTS.md, quest8, quest10) */

struct span_args {
    at_args a;                    /* q, kc, vc, q_start, pos, bt, rot, valid, inv_freq, n_seqs, max_blocks,
                                   * n_heads, n_kv, bs, G, scale, part (its other fields are unused) */
    const int32_t *n_spans;       /* [n][n_kv] */
    const int32_t *spans;         /* [n][n_kv][max_spans][2] */
    int max_spans;
    int chunk;                    /* tiles per split */
    int n_splits;
    int idx;                      /* cursor_seek + total_keys (else main's cursor_seek_linear + total_keys_strided) */
    int halves;                   /* span_lookup's two-pointer copies for tiles of two 16-key halves (kind 4) */
    float *out;                   /* [n][n_heads][hd] (n_splits == 1) */
    float *lse;                   /* [n][n_heads] (n_splits == 1) */
};

/* SEP: kind 2's staging (one K and one V buffer, issued apart), else kind 1's (SPAN_ST tiles) */
template <int HD, int MT, bool ROT, bool SEP>
__global__ void __launch_bounds__(32) k_attn_spans(const __grid_constant__ span_args sa)
{
    constexpr int KST = HD + 8, ST = SEP ? 1 : SPAN_ST;
    const at_args &a = sa.a;
    extern __shared__ __align__(16) unsigned char smraw[];
    bf16 *sk = (bf16 *)smraw;
    bf16 *sv = sk + (size_t)ST * AT_TILE * KST;
    float *rtab = (float *)(sv + (size_t)ST * AT_TILE * KST); /* ROT: [HD] cos, sin of the current rotation */
    int *soff = (int *)(rtab + (ROT ? HD : 0));              /* [ST][AT_TILE] per key: offset or KEY_PAD */

    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int row = blockIdx.x / a.n_kv, kvh = blockIdx.x % a.n_kv, split = blockIdx.y;
    /* the row's sequence (the metadata is the step's upload: read before the previous kernel ends) */
    int lo_s = 0, hi_s = a.n_seqs - 1;
    while (lo_s < hi_s) {
        const int mid = (lo_s + hi_s + 1) >> 1;
        if (a.q_start[mid] <= row) lo_s = mid; else hi_s = mid - 1;
    }
    const int s = lo_s;
    const int last = a.pos[s] + row - a.q_start[s]; /* the row's own position: keys up to it */
    const int32_t *bt = a.bt + (size_t)s * a.max_blocks;
    const int32_t *vt = a.valid ? a.valid + (size_t)s * a.max_blocks : nullptr;
    const int32_t *rt = ROT ? a.rot + (size_t)s * a.max_blocks : nullptr;
    /* cuda_launch.h: from here on q, the K/V just written and the spans (which a policy's own
     * kernel may have written) are read */
    grid_dep_wait();
    const size_t pair = (size_t)row * a.n_kv + kvh;
    const int ns = sa.n_spans[pair];
    const int32_t *sp = sa.spans + pair * (size_t)sa.max_spans * 2;
    const long long n_tiles_all =
        ((sa.idx ? total_keys(sp, ns, last) : total_keys_strided(sp, ns, last)) + AT_TILE - 1) / AT_TILE;
    /* the last split takes every tile past the others' chunks: the plan comes from the host copies,
     * and a recorded graph may replay the launch with longer span sets */
    const long long w0 = (long long)split * sa.chunk;
    const long long w1 = split == sa.n_splits - 1 ? n_tiles_all : min(n_tiles_all, w0 + sa.chunk);
    const int ntiles = w1 > w0 ? (int)(w1 - w0) : 0;

    span_cursor cur; /* the first key of the next tile to look up */
    cur.j = ns;
    cur.o = 0;
    if (ntiles > 0) cur = sa.idx ? cursor_seek(sp, ns, last, w0 * AT_TILE) : cursor_seek_linear(sp, ns, last, w0 * AT_TILE);
    bool nxt_contig = false;
    auto lookup = [&]() {
        const tile_meta tm = span_lookup<HD>(a, sp, ns, last, cur, kvh, bt, vt, rt, &nxt_contig, sa.halves != 0);
        cursor_advance(sp, ns, last, cur, AT_TILE);
        return tm;
    };
    auto issue = [&](const tile_meta &tm, bool contig, int it) {
        const int st = it % ST;
        bf16 *dk = sk + (size_t)st * AT_TILE * KST, *dv = sv + (size_t)st * AT_TILE * KST;
        if (contig) tile_issue<HD, 32>(a, tm, dk, dv, KST, soff + st * AT_TILE);
        else gather_issue<HD>(a, tm, dk, dv, KST, soff + st * AT_TILE);
    };

    tile_meta nxt = lookup();
    tile_meta cur_t = nxt; /* SEP: the tile whose K is staged and whose V is issued next */
    bool cur_contig = nxt_contig;
    if constexpr (SEP) {
        nxt = lookup(); /* the tile after: its K is issued during cur_t's compute */
        if (ntiles > 0) {
            soff[lane] = cur_t.info;
            pool_issue<HD>(a.kc, cur_t, cur_contig, sk, KST);
        }
        cp_async_commit();
    } else {
#pragma unroll
        for (int st = 0; st < ST - 1; st++) {
            if (st < ntiles) {
                issue(nxt, nxt_contig, st);
                nxt = lookup();
            }
            cp_async_commit();
        }
    }

    const int nr = a.G; /* live rows: the group's heads */
    uint32_t qa[MT][HD / 16][4];
    q_frags<HD, MT>(a, a.q_start[s], row - a.q_start[s], kvh, nr, 0, lane, nullptr, qa);
    int cur_rot = 0;
    uint32_t q0[ROT ? MT : 1][HD / 16][4]; /* ROT: the unrotated fragments */
    if (ROT) {
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int ks = 0; ks < HD / 16; ks++)
#pragma unroll
                for (int j = 0; j < 4; j++) q0[mt][ks][j] = qa[mt][ks][j];
    }

    float m[MT][2], l[MT][2], o[MT][HD / 8][4];
    int lim[MT][2]; /* every selected key is visible to live rows (0 .. 31 <= INT_MAX); padding rows: -1 */
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            m[mt][h] = -INFINITY;
            l[mt][h] = 0.0f;
            lim[mt][h] = mt * 16 + g + 8 * h < nr ? INT_MAX : -1;
        }
#pragma unroll
        for (int nd = 0; nd < HD / 8; nd++)
#pragma unroll
            for (int e = 0; e < 4; e++) o[mt][nd][e] = 0.0f;
    }

    for (int it = 0; it < ntiles; it++) {
        if constexpr (SEP) {
            pool_issue<HD>(a.vc, cur_t, cur_contig, sv, KST); /* V_it: its buffer was freed last iteration */
            cp_async_commit();
            cp_async_wait<1>(); /* K_it has landed (V_it may still be in flight) */
        } else {
            if (it + ST - 1 < ntiles) {
                issue(nxt, nxt_contig, it + ST - 1);
                nxt = lookup(); /* its loads overlap this tile's wait and compute */
            }
            cp_async_commit();
            cp_async_wait<ST - 1>();
        }
        __syncwarp();
        const int st = it % ST;
        const bf16 *tk = sk + (size_t)st * AT_TILE * KST;
        const bf16 *tv = sv + (size_t)st * AT_TILE * KST;
        const int *ko = soff + st * AT_TILE;
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
        uint32_t pa[MT][2][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) softmax_tile<HD, true>(sc[mt], ko, 0, lim[mt], m[mt], l[mt], o[mt], pa[mt], lane);
        if constexpr (SEP) {
            __syncwarp(); /* every lane is done with K_it and its key offsets */
            const bool more = it + 1 < ntiles;
            const bool nc = nxt_contig;
            if (more) {
                soff[lane] = nxt.info;
                pool_issue<HD>(a.kc, nxt, nc, sk, KST); /* K_{it+1} flies during PV */
            }
            cp_async_commit();
            cur_t = nxt;
            cur_contig = nc;
            if (more) nxt = lookup();
            cp_async_wait<1>(); /* V_it has landed */
            __syncwarp();
        }
        pv_tile<HD, MT>(tv, KST, pa, o, lane);
        __syncwarp(); /* the stage is reloaded next iteration */
    }
    cp_async_wait<0>();

#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float ls = l[mt][h];
            ls += __shfl_xor_sync(FULL, ls, 1);
            ls += __shfl_xor_sync(FULL, ls, 2);
            const int r = mt * 16 + g + 8 * h;
            if (r >= nr) continue;
            const size_t orow = (size_t)row * a.n_heads + (size_t)kvh * a.G + r;
            span_store_row<HD>(o[mt], h, m[mt][h], ls, t, orow, sa.n_splits, split, sa.out, sa.lse, a.part);
        }
}

/* kvs_cuda_set_span_merge: nonzero = the merge of before (each thread walks the partials' maxima and
 * sums one dependent global load at a time), for the benches' A/B; 0 (default) = staged */
__device__ int span_merge_serial;

static int span_merge_host = -1;   /* what span_merge_serial holds; -1: the environment not read yet */

extern "C" void kvs_cuda_set_span_merge(int serial)
{
    span_merge_host = serial ? 1 : 0;
    CUDA_CHECK(cudaMemcpyToSymbol(span_merge_serial, &span_merge_host, sizeof span_merge_host));
}

/* cuda_span_walk.cuh: KVS_CUDA_SPAN_MERGE=serial sets the knob once, before the first merge (for
 * whole-step benches) */
void kvs_cu_span_merge_env(void)
{
    if (span_merge_host >= 0) return;
    const char *e = getenv("KVS_CUDA_SPAN_MERGE");
    if (e && !strcmp(e, "serial")) kvs_cuda_set_span_merge(1);
    else span_merge_host = 0;
}

#define MERGE_STAGED_MAX 512   /* splits whose (max, sum) the merge stages in shared memory, at most */

/* cuda_span_walk.cuh declares it (Retro launches it too). One block per (row, head). Staged (up to
 * MERGE_STAGED_MAX splits): the splits' maxima and sums are loaded once by the whole block and
 * each split's weight exp(m_s - M) made once into shared memory, then each thread's dimension
 * takes the partials' values 8 loads at a time. The serial form (each thread three walks over the
 * splits, one dependent load a step) took 18 us at one row of 32K tokens (38 splits; ncu,
 * bench/RESULTS.md quest9), longer than the span walk it merges. Both forms do the same
 * operations in the same split order (M is an exact max; L and A sum in increasing split), so
 * they give the same bits. */
__global__ void k_spans_merge(const float *part, int n_splits, int hd, float *out, float *lse)
{
    __shared__ float sm[MERGE_STAGED_MAX], sl[MERGE_STAGED_MAX], se[MERGE_STAGED_MAX];
    grid_dep_wait(); /* cuda_launch.h: the partials are written */
    const size_t rh = blockIdx.x;
    const float *pp = part + rh * n_splits * (size_t)(hd + 2);
    if (span_merge_serial || n_splits > MERGE_STAGED_MAX) {
        float M = -INFINITY;
        for (int s = 0; s < n_splits; s++) M = fmaxf(M, pp[(size_t)s * (hd + 2) + hd]);
        float L = 0.0f;
        if (M != -INFINITY)
            for (int s = 0; s < n_splits; s++) {
                const float *q = pp + (size_t)s * (hd + 2);
                if (q[hd] != -INFINITY) L += q[hd + 1] * __expf(q[hd] - M);
            }
        for (int d = threadIdx.x; d < hd; d += blockDim.x) {
            float A = 0.0f;
            if (M != -INFINITY)
                for (int s = 0; s < n_splits; s++) {
                    const float *q = pp + (size_t)s * (hd + 2);
                    if (q[hd] != -INFINITY) A += q[d] * __expf(q[hd] - M);
                }
            out[rh * hd + d] = M == -INFINITY ? 0.0f : A / L;
        }
        if (threadIdx.x == 0) lse[rh] = M == -INFINITY ? -INFINITY : M + logf(L);
        return;
    }
    float M, L;
    span_merge_stats(pp, n_splits, hd, sm, sl, se, M, L);
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        const float A = span_merge_acc(pp, n_splits, hd, d, sm, se, M);
        out[rh * hd + d] = M == -INFINITY ? 0.0f : A / L;
    }
    if (threadIdx.x == 0) lse[rh] = M == -INFINITY ? -INFINITY : M + logf(L);
}

/* o_a, lse_a = the merge of (o_a, lse_a) and (o_b, lse_b) per (row, head) (block) */
__global__ void k_attn_merge2(float *oa, float *la, const float *ob, const float *lb, int hd)
{
    grid_dep_wait(); /* cuda_launch.h: both partials are written */
    const size_t rh = blockIdx.x;
    const float a = la[rh], b = lb[rh];
    const float mx = fmaxf(a, b);
    float wa = 0.0f, wb = 0.0f, l = -INFINITY;
    if (mx != -INFINITY) {
        const float ea = a == -INFINITY ? 0.0f : expf(a - mx), eb = b == -INFINITY ? 0.0f : expf(b - mx);
        const float sum = ea + eb;
        wa = ea / sum;
        wb = eb / sum;
        l = mx + logf(sum);
    }
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        const size_t i = rh * hd + d;
        /* a weight of 0 never multiplies (an -inf side's o may be anything finite or not) */
        oa[i] = (wa != 0.0f ? wa * oa[i] : 0.0f) + (wb != 0.0f ? wb * ob[i] : 0.0f);
    }
    __syncthreads(); /* every thread has read la[rh] */
    if (threadIdx.x == 0) la[rh] = l;
}

/* ---- host side -------------------------------------------------------------------------------- */

/* Splits: the longest (row, KV head) walk (w_max tiles of 32 selected keys) cut so that the grid
 * fills every SM with as many blocks as fit (one warp each: a single row must still keep every
 * SM busy), at least SPAN_MIN_TILES tiles a split, the partials within the workspace (by_ws). */
/* kvs_cuda_set_span_kernel: the kind (0: KVS_CUDA_SPAN_KERNEL, else SPAN_KIND_DEFAULT) and the
 * least tiles a split (0: KVS_CUDA_SPAN_MIN_TILES, else SPAN_MIN_TILES) */
static int span_kind_set, span_min_set;

extern "C" void kvs_cuda_set_span_kernel(int kind, int min_tiles)
{
    span_kind_set = kind >= 1 && kind <= 4 ? kind : 0;
    span_min_set = min_tiles >= 1 && min_tiles <= 64 ? min_tiles : 0;
}

static int span_env(const char *name, int lo, int hi, int dflt)
{
    const char *e = getenv(name);
    const int v = e ? atoi(e) : 0;
    return v >= lo && v <= hi ? v : dflt;
}

static int span_kind(void)
{
    static int env = -1;
    if (env < 0) env = span_env("KVS_CUDA_SPAN_KERNEL", 1, 4, SPAN_KIND_DEFAULT);
    return span_kind_set ? span_kind_set : env;
}

int kvs_cu_span_halves(void) { return span_kind() == 4; }

static int span_min_tiles(void)
{
    static int env = -1;
    if (env < 0) env = span_env("KVS_CUDA_SPAN_MIN_TILES", 1, 64, SPAN_MIN_TILES);
    return span_min_set ? span_min_set : env;
}

static void plan_splits(span_args &x, long long pairs, int resident, int n_sms, long long w_max, long long by_ws)
{
    /* as many splits as fit in ONE wave (rounded down): rounding up left a second wave of a few
     * blocks (e.g. 32 rows x 8 heads x 4 splits = 1024 blocks on 792 slots), in which the GPU
     * reads at a fraction of its bandwidth */
    long long ns = (long long)resident * n_sms / pairs;
    const int min_tiles = span_min_tiles();
    const long long by_len = (w_max + min_tiles - 1) / min_tiles;
    if (ns > by_len) ns = by_len;
    if (ns > by_ws) ns = by_ws;
    if (ns > SPAN_MAX_SPLITS) ns = SPAN_MAX_SPLITS;
    if (ns < 1) ns = 1;
    x.chunk = (int)((w_max + ns - 1) / ns);
    if (x.chunk < 1) x.chunk = 1;
    x.n_splits = (int)((w_max + x.chunk - 1) / x.chunk);
    if (x.n_splits < 1) x.n_splits = 1;
}

template <int HD, int MT, bool ROT, bool SEP>
static void launch_spans(span_args &x, int n, cudaStream_t st, int n_sms, long long w_max, long long by_ws)
{
    static kvs_cu_resident resident_all;
    int &resident = *kvs_cu_resident_here(resident_all);
    constexpr size_t ST = SEP ? 1 : SPAN_ST;
    const size_t smem = 2 * ST * AT_TILE * (HD + 8) * sizeof(bf16) + (ROT ? HD : 0) * sizeof(float) +
                        (ST * AT_TILE + ST) * sizeof(int);
    if (!resident) {
        CUDA_CHECK(cudaFuncSetAttribute((const void *)k_attn_spans<HD, MT, ROT, SEP>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        int nb = 0;
        CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&nb, k_attn_spans<HD, MT, ROT, SEP>, 32, smem));
        if (nb < 1) kvs_panic(__FILE__, __LINE__, "cuda attention_spans: kernel does not fit an SM (%zu bytes)", smem);
        resident = nb;
    }
    plan_splits(x, (long long)n * x.a.n_kv, resident, n_sms, w_max, by_ws);
    const dim3 grid((unsigned)((size_t)n * x.a.n_kv), (unsigned)x.n_splits);
    CUDA_CHECK(kvs_cu_launch(k_attn_spans<HD, MT, ROT, SEP>, grid, 32, smem, st, x));
}

template <int HD>
static void launch_spans_hd(span_args &x, int n, cudaStream_t st, int n_sms, long long w_max, long long by_ws)
{
    const bool rot = x.a.rot != nullptr;
    if (x.a.G <= 16) { /* groups of up to 16 heads (one m-tile): either staging */
        if (span_kind() == 2) { /* K and V apart */
            if (rot) launch_spans<HD, 1, true, true>(x, n, st, n_sms, w_max, by_ws);
            else launch_spans<HD, 1, false, true>(x, n, st, n_sms, w_max, by_ws);
        } else {
            if (rot) launch_spans<HD, 1, true, false>(x, n, st, n_sms, w_max, by_ws);
            else launch_spans<HD, 1, false, false>(x, n, st, n_sms, w_max, by_ws);
        }
    } else { /* two m-tiles (groups of 17-32 heads): K and V together (kind 2's staging is built for one m-tile) */
        if (rot) launch_spans<HD, 2, true, false>(x, n, st, n_sms, w_max, by_ws);
        else launch_spans<HD, 2, false, false>(x, n, st, n_sms, w_max, by_ws);
    }
}

/* tiles of 32 selected keys of the host copy of a (row, KV head)'s spans for a row at position last */
static long long host_tiles(const int32_t *sp, int ns, int last)
{
    long long k = 0;
    for (int j = 0; j < ns; j++) {
        const int lo = sp[2 * j] > 0 ? sp[2 * j] : 0, hi = sp[2 * j + 1] < last + 1 ? sp[2 * j + 1] : last + 1;
        if (hi > lo) k += hi - lo;
    }
    return (k + AT_TILE - 1) / AT_TILE;
}

void kvs_cu_op_attention_spans(struct kvs_backend *b, const struct kvs_dbuf *q, const struct kvs_dbuf *kc,
                               const struct kvs_dbuf *vc, const struct kvs_attn_meta *m,
                               const struct kvs_span_list *sp, int n, int n_heads, int n_kv_heads, int head_dim,
                               int block_size, float scale, struct kvs_dbuf *out, struct kvs_dbuf *lse)
{
    if (n <= 0) return;
    if (!kvs_cu_attention_supported(n_heads, n_kv_heads, head_dim))
        kvs_panic(__FILE__, __LINE__, "cuda attention_spans: unsupported shape: %d query heads, %d KV heads, head_dim %d",
                  n_heads, n_kv_heads, head_dim);
    if (m->rot_offsets && !m->inv_freq)
        kvs_panic(__FILE__, __LINE__, "cuda attention_spans: rotation offsets without inv_freq");
    KVS_ASSERT(kc->n == vc->n && out->kind != KVS_BUF_KV && lse->kind == KVS_BUF_F32);
    KVS_ASSERT((size_t)n * n_heads * head_dim <= out->n && (size_t)n * n_heads <= lse->n);
    xh_forget(b, out->d);
    xh_forget(b, lse->d);
    span_args x;
    memset(&x, 0, sizeof x);
    at_args &a = x.a;
    span_at_args(a, q, kc, vc, m, m->n_seqs, n_heads, n_kv_heads, block_size, scale, b->attn_ws);
    x.n_spans = (const int32_t *)sp->n_spans->d;
    x.spans = (const int32_t *)sp->spans->d;
    x.max_spans = sp->max_spans;
    x.out = (float *)out->d;
    x.lse = (float *)lse->d;
    x.idx = span_kind() != 1;
    x.halves = span_kind() == 4;

    /* the longest walk, from the host copies (the launch is planned without a device round trip) */
    long long w_max = 0;
    for (int s = 0; s < m->n_seqs; s++)
        for (int t = m->h_q_start[s]; t < m->h_q_start[s + 1]; t++) {
            const int last = m->h_pos[s] + t - m->h_q_start[s];
            for (int g = 0; g < n_kv_heads; g++) {
                const size_t pair = (size_t)t * n_kv_heads + g;
                const long long w = host_tiles(sp->h_spans + pair * (size_t)sp->max_spans * 2, sp->h_n_spans[pair], last);
                if (w > w_max) w_max = w;
            }
        }
    const long long by_ws = (long long)(ATTN_WS_BYTES / sizeof(float) / ((size_t)n * n_heads * (head_dim + 2)));
    switch (head_dim) {
    case 16: launch_spans_hd<16>(x, n, b->stream, b->n_sms, w_max, by_ws); break;
    case 32: launch_spans_hd<32>(x, n, b->stream, b->n_sms, w_max, by_ws); break;
    case 64: launch_spans_hd<64>(x, n, b->stream, b->n_sms, w_max, by_ws); break;
    case 128: launch_spans_hd<128>(x, n, b->stream, b->n_sms, w_max, by_ws); break;
    default: launch_spans_hd<256>(x, n, b->stream, b->n_sms, w_max, by_ws); break;
    }
    kvs_cu_span_merge_env();
    if (x.n_splits > 1)
        CUDA_CHECK(kvs_cu_launch(k_spans_merge, (unsigned)((size_t)n * n_heads), head_dim < 128 ? head_dim : 128, 0,
                                 b->stream, (const float *)a.part, x.n_splits, head_dim, x.out, x.lse));
}

void kvs_cu_op_attn_merge(struct kvs_backend *b, struct kvs_dbuf *o_a, struct kvs_dbuf *lse_a,
                          const struct kvs_dbuf *o_b, const struct kvs_dbuf *lse_b, int n, int n_heads, int head_dim)
{
    if (n <= 0) return;
    KVS_ASSERT((size_t)n * n_heads * head_dim <= o_a->n && (size_t)n * n_heads * head_dim <= o_b->n);
    KVS_ASSERT((size_t)n * n_heads <= lse_a->n && (size_t)n * n_heads <= lse_b->n);
    xh_forget(b, o_a->d);
    xh_forget(b, lse_a->d);
    CUDA_CHECK(kvs_cu_launch(k_attn_merge2, (unsigned)((size_t)n * n_heads), head_dim < 128 ? head_dim : 128, 0,
                             b->stream, (float *)o_a->d, (float *)lse_a->d, (const float *)o_b->d,
                             (const float *)lse_b->d, head_dim));
}
