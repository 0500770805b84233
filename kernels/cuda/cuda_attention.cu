/* cuda_attention.cu: paged causal attention (cuda_attention.h), built around memory bandwidth:
 * plans the launches of a step, and merges context splits. The kernels live by job:
 *   cuda_attn_prefill.cu   k_attn_tc, tensor cores (mma.sync, FlashAttention-2 style), for the
 *                          sequences with more than one query row: a block (4 warps) owns up to
 *                          64 / G consecutive tokens of one sequence, 64 (token, head) rows that
 *                          share every staged K/V tile; with one warp a block it also takes decode
 *                          launches that k_attn_fd does not (groups of more than 16 heads, head_dim
 *                          16 / 32, KVS_CUDA_DEC_ATTN=2 / 3);
 *   cuda_attn_prefill_wg.cu k_attn_wg, the Hopper prefill kernel (wgmma, 128 rows a block, 64-key
 *                          tiles, two blocks an SM), for prefill launches on sm_90 at head_dim 64 /
 *                          128 without rotation offsets, and the choice of prefill kernel;
 *   cuda_attn_prefill_fa3.cu k_attn_fa3, the FlashAttention-3-style Hopper prefill kernel (the
 *                          default on sm_90, kind 14), rotation offsets included (blocks of a
 *                          multiple of 16 slots; other rotated launches stay on k_attn_tc);
 *                          KVS_CUDA_PRE_ATTN / kvs_cuda_set_pre_attn pick the kernel;
 *   cuda_attn_cudnn.cu     kind 26: the prefill rows through cuDNN's fused SDPA (built with
 *                          `make CUDNN=...`; launches it cannot take, or where cuDNN cannot be
 *                          opened, run kind 14);
 *   cuda_attn_decode.cu    k_attn_fd for decode rows (one query row per sequence): 4 warps a block
 *                          that owns one sequence, one KV head and one split, 128-key tiles (a
 *                          32-key sub-tile per warp), K and V staged separately (by the copy
 *                          engine, TMA, or cp.async); its 16 rows hold the G query heads of the
 *                          group (GQA: every K/V byte read serves all of them);
 *   dev/cuda_attn_simt.cu  k_attn on CUDA cores, comparisons only (KVS_CUDA_DEC_ATTN=0);
 *   cuda_attn_device.cuh   what they share (tile lookup and staging, rotation, mma pieces).
 * KVS_CUDA_DEC_ATTN=0 / 2 / 3 / 4 / 5 and kvs_cuda_set_dec_attn() force the decode kernel (CUDA
 * cores / one-warp tensor-core blocks with 2 or 3 tiles in flight / k_attn_fd with TMA staging,
 * the default where it applies / k_attn_fd with cp.async staging). Which kernel wins where, and
 * by how much: bench/RESULTS.md ("Attention design measurements").
 *
 * The kernels stream K/V in tiles of 32 keys from the paged cache into shared memory, two or
 * more tiles in flight. Slots past the visible range or in the unused tail of a cached document's
 * block (block_valid) are zero-filled by the copy and never read from memory; the loader also
 * records each key's rotation offset (or KEY_PAD) in shared memory, so masks and rotation runs
 * never wait on a global load in the compute loop.
 * Deferred RoPE (LazyAttention, ROT): keys of a cached block are attended as if rotated by the
 * block's offset o; the block's copy of q is rotated backward instead, <q, R(o)k> = <R(-o)q, k>.
 * The rotated copy is recomputed only when a tile holds keys of another offset, i.e. at document
 * boundaries (hd/2 sincos per boundary, shared by all rows): in shared memory for the CUDA-core
 * kernel, straight into the q fragments (registers, from q in global memory) for the tensor-core
 * one, whose shared memory then holds only the K/V stages (more resident blocks for decode);
 * k_attn_fd does it per warp (a cos / sin table per warp, the unrotated fragments in shared
 * memory); k_attn_fa3 rewrites its warpgroup's Q tile in shared memory (wgmma reads it there).
 * Long contexts are split over blocks (grid z); a second kernel (k_attn_merge, here) merges the
 * per-split partials (acc, max, sum) in split order. Everything is deterministic for a given
 * launch shape. The automatic plan (choose_splits, launch_fd) reads the launch: its rows, its
 * longest context (a recorded graph's capacity, plan_ctx), the workspace and the SM count, so a
 * decode row's bits depend on the batch it runs in. kvs_cu_attn.batch_invariant (the config key
 * batch_invariant) takes for decode rows the plan of cuda_attn_device.cuh at_split_keys instead:
 * splits by the row's own context, merged by k_attn_merge_bi (attn_launch_bi, below).
 */
#include <string.h>

#include "kernels/cuda/cuda_attention.h"
#include "kernels/cuda/cuda_attn_cudnn.h"
#include "kernels/cuda/cuda_attn_device.cuh"
#include "kernels/cuda/cuda_attn_wgmma.cuh"

int kvs_cu_attention_supported(int n_heads, int n_kv, int head_dim)
{
    if (n_kv <= 0 || n_heads % n_kv != 0 || n_heads / n_kv > AT_WARPS * AT_WIDE_RPW) return 0;
    return head_dim == 16 || head_dim == 32 || head_dim == 64 || head_dim == 128 || head_dim == 256;
}

/* Number of context splits: enough blocks to fill the GPU, whole waves where possible (blocks of
 * one launch do equal work, so a half-empty last wave costs as much as a full one), at least
 * min_keys keys per split (two tiles; k_attn_fd: one 128-key tile, a sub-tile per warp), and the
 * partials within the workspace. */
static int choose_splits(long long base_blocks, int resident, int n_sms, int max_ctx, long long by_ws, int min_keys)
{
    long long cap = (long long)resident * n_sms;
    long long by_len = (max_ctx + min_keys - 1) / min_keys;
    long long lim = by_len < by_ws ? by_len : by_ws;
    if (lim > 256) lim = 256;
    if (lim < 1) lim = 1;
    int best = 1;
    double best_fill = 0.0;
    for (long long ns = 1; ns <= lim; ns++) {
        long long blocks = base_blocks * ns;
        long long waves = (blocks + cap - 1) / cap;
        double fill = (double)blocks / (double)(waves * cap);
        if (fill > best_fill + 0.05) {
            best_fill = fill;
            best = (int)ns;
        }
        if (blocks >= cap && fill >= 0.85) return (int)ns;
    }
    return best;
}

/* block per (row, head) of this launch's kind; threads over dims; splits merged in order */
__global__ void k_attn_merge(const float *part, const int32_t *q_start, int n_seqs, int prefill, int n_heads,
                             int n_splits, int hd, float *out, bf16 *outh, int trig)
{
    grid_dep_wait(); /* cuda_launch.h: the previous kernel's output is ready */
    grid_dep_launch(trig); /* the o projection may start fetching its weights */
    const int t = blockIdx.x / n_heads;
    int lo = 0, hi = n_seqs - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (q_start[mid] <= t) lo = mid; else hi = mid - 1;
    }
    const int ns = q_start[lo + 1] - q_start[lo];
    if ((prefill ? ns > 1 : ns == 1) == false) return;
    const size_t row = blockIdx.x;
    const float *pp = part + row * n_splits * (size_t)(hd + 2);
    float M = -INFINITY;
    for (int s = 0; s < n_splits; s++) M = fmaxf(M, pp[(size_t)s * (hd + 2) + hd]);
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float Ls = 0.0f, A = 0.0f;
        for (int s = 0; s < n_splits; s++) {
            const float *q = pp + (size_t)s * (hd + 2);
            if (q[hd] == -INFINITY) continue;
            float e = __expf(q[hd] - M);
            Ls += q[hd + 1] * e;
            A += q[d] * e;
        }
        out[row * hd + d] = A / Ls;
        if (outh) outh[row * hd + d] = __float2bfloat16(A / Ls);
    }
}

/* The merge of the batch-invariant plan (at_split_keys): a block per (decode tile of the launch's
 * group, head), its partials at the group's rows (at_part_row), combined with k_attn_merge's
 * arithmetic in split order, whatever the number of splits (one included: the same operations
 * whether the launch holds longer rows or not). Full warps (find_tile's shuffles). */
#define BI_MERGE_THREADS 128
__global__ void __launch_bounds__(BI_MERGE_THREADS) k_attn_merge_bi(const __grid_constant__ at_args a, int hd)
{
    grid_dep_wait();
    grid_dep_launch(a.trig);
    const int head = blockIdx.x % a.n_heads;
    int s, r0;
    if (!find_tile(a, a.tile0 + (int)(blockIdx.x / a.n_heads), &s, &r0)) return;
    const size_t row = (size_t)a.q_start[s] * a.n_heads + head;
    const float *pp = a.part + (size_t)blockIdx.x * a.n_splits * (size_t)(hd + 2);
    float M = -INFINITY;
    for (int sp = 0; sp < a.n_splits; sp++) M = fmaxf(M, pp[(size_t)sp * (hd + 2) + hd]);
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float Ls = 0.0f, A = 0.0f;
        for (int sp = 0; sp < a.n_splits; sp++) {
            const float *q = pp + (size_t)sp * (hd + 2);
            if (q[hd] == -INFINITY) continue; /* a split past the row's context */
            float e = __expf(q[hd] - M);
            Ls += q[hd + 1] * e;
            A += q[d] * e;
        }
        a.out[row * hd + d] = A / Ls;
        if (a.outh) a.outh[row * hd + d] = __float2bfloat16(A / Ls);
    }
}

/* The batch-invariant plan's launches (decode tiles, one row each): the grid covers the most
 * splits a row of up to max_ctx keys can have (the rows' own plans leave the rest empty: their
 * blocks write a -inf partial that the merge skips), and the tiles go in groups whose partials
 * fit the workspace, each group's kernel then its merge (stream order, and the kernels' grid
 * dependency waits, keep a group from overwriting partials the previous merge still reads). */
static void attn_launch_bi(void (*kern)(at_args), int threads, size_t smem, at_args &x, int n_tiles, int max_ctx,
                           cudaStream_t st, size_t ws_floats, int hd)
{
    long long ns = ((long long)max_ctx + x.bi_keys - 1) / x.bi_keys;
    if (ns > x.bi_splits) ns = x.bi_splits;
    if (ns < 1) ns = 1;
    x.n_splits = (int)ns;
    x.chunk = 0; /* per row: at_bi_chunk */
    const size_t per_tile = (size_t)x.n_heads * (size_t)ns * (size_t)(hd + 2);
    const long long group = (long long)(ws_floats / per_tile);
    if (group < 1) kvs_panic(__FILE__, __LINE__, "cuda attention: %lld splits of %d heads exceed the workspace", ns, x.n_heads);
    for (long long t0 = 0; t0 < n_tiles; t0 += group) {
        const long long nt = n_tiles - t0 < group ? n_tiles - t0 : group;
        x.tile0 = (int)t0;
        dim3 grid((unsigned)nt, (unsigned)x.n_kv, (unsigned)x.n_splits);
        CUDA_CHECK(kvs_cu_launch(kern, grid, threads, smem, st, x));
        CUDA_CHECK(cudaGetLastError());
        CUDA_CHECK(kvs_cu_launch(k_attn_merge_bi, (unsigned)(nt * x.n_heads), BI_MERGE_THREADS, 0, st, x, hd));
        CUDA_CHECK(cudaGetLastError());
    }
    x.tile0 = 0;
}

/* cuda_attn_device.cuh */
void kvs_cu_attn_launch(void (*kern)(at_args), int threads, size_t smem, int *resident, at_args &x, int n_tiles,
                        int max_ctx, cudaStream_t st, int n_sms, size_t ws_floats, int n, int hd, int force,
                        int min_keys)
{
    if (!*resident) {
        int nb = 0;
        CUDA_CHECK(cudaFuncSetAttribute((const void *)kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&nb, kern, threads, smem));
        if (nb < 1) kvs_panic(__FILE__, __LINE__, "cuda attention: kernel does not fit an SM (%zu bytes)", smem);
        *resident = nb;
    }
    if (x.bi_keys > 0) { /* decode launches under the batch-invariant plan: `force` does not apply */
        attn_launch_bi(kern, threads, smem, x, n_tiles, max_ctx, st, ws_floats, hd);
        return;
    }
    const long long base = (long long)n_tiles * x.n_kv;
    /* Launches of 32 to 256 (tile, KV head) pairs plan for 2 blocks per SM, not all that fit:
     * fewer, longer splits read the KV faster there. Small launches (batch 1) need the splits
     * for parallelism, and batch 128 x 1K runs faster in 2 splits than in the 1 this would give
     * (measured: bench/RESULTS.md, "Attention design measurements"). */
    const int res_plan = base >= 32 && base <= 256 && *resident > 2 ? 2 : *resident;
    const long long by_ws = (long long)(ws_floats / ((size_t)n * x.n_heads * (hd + 2)));
    int ns = force > 0 ? force : choose_splits(base, res_plan, n_sms, max_ctx, by_ws, min_keys);
    if (ns > by_ws) ns = (int)(by_ws > 0 ? by_ws : 1);
    int chunk = (max_ctx + ns - 1) / ns;
    chunk = (chunk + AT_TILE - 1) / AT_TILE * AT_TILE;
    x.chunk = chunk;
    x.n_splits = (max_ctx + chunk - 1) / chunk;
    dim3 grid((unsigned)n_tiles, (unsigned)x.n_kv, (unsigned)x.n_splits);
    CUDA_CHECK(kvs_cu_launch(kern, grid, threads, smem, st, x));
    CUDA_CHECK(cudaGetLastError());
    if (x.n_splits > 1) {
        CUDA_CHECK(kvs_cu_launch(k_attn_merge, (unsigned)((size_t)n * x.n_heads), hd < 128 ? hd : 128, 0, st, 
            x.part, x.q_start, x.n_seqs, x.prefill, x.n_heads, x.n_splits, hd, x.out, x.outh, x.trig));
        CUDA_CHECK(cudaGetLastError());
    }
}

/* The batch-invariant plan's parameters (at_bi_chunk): splits of at least BI_MIN_KEYS keys (one
 * k_attn_fd tile), at most BI_MAX_SPLITS a row: the automatic plan's batch-1 splits at the
 * contexts it was tuned on (1K: 8 x 128 keys, 8K: 16 x 512). KVS_CUDA_BI_KEYS (a multiple of 128)
 * and KVS_CUDA_BI_SPLITS change them (comparisons; read once, so every launch of a process plans
 * alike: a row's bits depend on them). */
#define BI_MIN_KEYS 128
#define BI_MAX_SPLITS 16
static int bi_min_keys(void)
{
    static int k = 0;
    if (!k) {
        const char *e = getenv("KVS_CUDA_BI_KEYS");
        k = e && atoi(e) >= 128 && atoi(e) % 128 == 0 ? atoi(e) : BI_MIN_KEYS;
    }
    return k;
}
static int bi_max_splits(void)
{
    static int k = 0;
    if (!k) {
        const char *e = getenv("KVS_CUDA_BI_SPLITS");
        k = e && atoi(e) >= 1 && atoi(e) <= 256 ? atoi(e) : BI_MAX_SPLITS;
    }
    return k;
}

void kvs_cu_attention(const struct kvs_cu_attn *a, cudaStream_t stream, int n_sms, float *ws, size_t ws_bytes,
                      int n_splits_force, int dec_kind_force)
{
    if (a->n <= 0) return;
    if (!kvs_cu_attention_supported(a->n_heads, a->n_kv, a->hd))
        kvs_panic(__FILE__, __LINE__, "cuda attention: unsupported shape: %d query heads, %d KV heads, head_dim %d",
                  a->n_heads, a->n_kv, a->hd);
    if (a->rot && !a->inv_freq) kvs_panic(__FILE__, __LINE__, "cuda attention: rotation offsets without inv_freq");
    const int G = a->n_heads / a->n_kv;
    /* plan both launches from the host copies: decode sequences (one row) and prefill tiles */
    int n_dec = 0, n_pre_tiles = 0, ctx_dec = 1, ctx_pre = 1;
    /* prefill tokens per tile: the rows of the kernel the launch takes (k_attn_tc or k_attn_wg) */
    int pre_kind = kvs_cu_attn_prefill_kind(a->hd, a->rot != NULL);
    /* kind 26 (cuDNN) takes the prefill pass below where it can; kind 14 is planned as its fallback */
    const bool cudnn_pre = pre_kind == KVS_PRE_ATTN_CUDNN && !a->valid && !a->rot;
    if (pre_kind == KVS_PRE_ATTN_CUDNN) pre_kind = 14; /* kvs_cu_attn_prefill_kind gives 26 on sm_90 only */
    /* k_attn_fa3's 192-row forms (kinds 16, 18) have no fallback with tiles of their size: blocks of
     * other than a multiple of 16 slots, which they cannot stage, take kind 6 from the plan on */
    if ((pre_kind == 16 || pre_kind == 18) && a->bs % 16 != 0) pre_kind = 6;
    /* k_attn_fa3's deferred rotation stages 16-key groups of one block each: other block sizes
     * with rotation offsets take k_attn_tc (k_attn_wg, kind 6, does not rotate) */
    if (a->rot && pre_kind >= 2 && a->bs % 16 != 0) pre_kind = 1;
    const int qt_pre = kvs_cu_attn_prefill_qt(pre_kind, G);
    const int skip = a->skip_lead > 0 && a->skip_lead < a->n_seqs ? a->skip_lead : 0;
    for (int s = 0; s < a->n_seqs; s++) {
        int ns = a->h_q_start[s + 1] - a->h_q_start[s], ctx = a->h_pos[s] + ns;
        if (ns == 1 && s < skip) continue;   /* the caller overwrites it (skip_lead) */
        if (ns == 1) {
            n_dec++;
            if (ctx > ctx_dec) ctx_dec = ctx;
        } else if (ns > 1) {
            n_pre_tiles += (ns + qt_pre - 1) / qt_pre;
            if (ctx > ctx_pre) ctx_pre = ctx;
        }
    }
    at_args x;
    if (a->plan_ctx > ctx_dec) ctx_dec = a->plan_ctx;
    x.q = a->q;
    x.kc = a->kc;
    x.vc = a->vc;
    x.q_start = a->q_start;
    x.pos = a->pos;
    x.bt = a->bt;
    x.rot = a->rot;
    x.valid = a->valid;
    x.inv_freq = a->inv_freq;
    x.words = (const int2 *)a->words;
    x.n_seqs = a->n_seqs;
    x.max_blocks = a->max_blocks;
    x.n_heads = a->n_heads;
    x.n_kv = a->n_kv;
    x.bs = a->bs;
    x.G = G;
    x.scale = a->scale;
    x.out = a->out;
    x.outh = a->outh;
    x.kv_rows = (long long)(a->kv_elems / (size_t)a->hd);
    x.part = ws;
    x.trig = (kvs_cu_pdl_early() & 2) && a->n >= 2; /* cuda_skinny.cu: not at batch 1 */
    x.tile0 = 0;
    x.bi_splits = bi_max_splits();
    const size_t ws_floats = ws_bytes / sizeof(float);
    for (int pass = 0; pass < 2; pass++) {
        const int tiles = pass == 0 ? n_dec : n_pre_tiles;
        if (tiles == 0) continue;
        x.prefill = pass;
        x.qt = pass == 0 ? 1 : qt_pre;
        /* the batch-invariant plan: decode rows (prefill tiles keep the automatic plan) */
        x.bi_keys = pass == 0 && a->batch_invariant ? bi_min_keys() : 0;
        const int max_ctx = pass == 0 ? ctx_dec : ctx_pre;
        const bool pre = pass == 1;
        /* skip_lead: the decode pass sees the sequences from skip on (find_tile counts one-row
         * sequences over n_seqs; rows keep their absolute indices from q_start); the prefill
         * pass sees them all */
        const int sk = pre ? 0 : skip;
        const size_t so = (size_t)sk * (size_t)a->max_blocks;
        x.q_start = a->q_start + sk;
        x.pos = a->pos + sk;
        x.bt = a->bt + so;
        x.rot = a->rot ? a->rot + so : nullptr;
        x.valid = a->valid ? a->valid + so : nullptr;
        x.words = a->words ? (const int2 *)a->words + so : nullptr;
        x.n_seqs = a->n_seqs - sk;
#if defined(KVS_HAVE_CUDNN) && KVS_HAVE_CUDNN
        if (pre && cudnn_pre && kvs_cu_attn_cudnn(a, stream)) continue;
#else
        (void)cudnn_pre;
#endif
        if (pre && pre_kind >= 2)
            kvs_cu_attn_prefill_wg(x, kvs_cu_attn_prefill_kind_for(pre_kind, (long long)tiles * a->n_kv, n_sms),
                                   a->hd, tiles, max_ctx, stream, n_sms, ws_floats, a->n, n_splits_force);
        else if (pre) kvs_cu_attn_prefill(x, a->hd, tiles, max_ctx, stream, n_sms, ws_floats, a->n, n_splits_force);
        else kvs_cu_attn_decode(x, a->hd, tiles, max_ctx, stream, n_sms, ws_floats, a->n, n_splits_force, dec_kind_force);
    }
}
