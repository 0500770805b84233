/* kv_lean_prefill.cu: LeanKV's prompt-chunk attention over quantized pages on tensor cores
 * (k_lean_pf), the static formats K8V8, K8V4, K4V4 and K4V2; kv_lean.cu's run_attn launches it
 * (lean_pf_launch) for the rows-on-M launches (some sequence has more than 8 / G rows: a prompt
 * chunk) and merges its splits' partials.
 *
 * Why: k_lean_fd's rows-on-M layout gives each one-warp block 16 query rows (16 / G tokens of a
 * KV group), so every K/V byte staged serves 16 rows, each block stages the whole causal prefix of
 * its few tokens, and one warp's copies wait behind its own compute: a 4K prompt's attention over
 * K8V4 pages cost about 50 ms more a step than bf16's FA3 prefill (bench/RESULTS.md, "LeanKV
 * kernels, part 12" and "part 14"). Here a block of NW warps owns NW x 16 query rows (NW x 16 / G
 * tokens of one sequence x the G query heads of one KV head): the block stages each 32-key tile
 * of quantized codes and (s, z) once into shared memory (16-byte cp.async, every warp issuing its
 * share, PF_ST stages in flight) and all NW warps compute against it, so the bytes staged and the
 * page lookups per query row drop NW-fold, and the copies of the next PF_ST - 1 tiles run while
 * the warps compute.
 *
 * The arithmetic is k_lean_fd's rows-on-M path, the same device functions (kv_lean_device.cuh):
 * QK^T and PV on mma.sync m16n8k16 (fp16 in, fp32 accumulate), the codes fed to the tensor cores
 * as fp16 1024 + code and the fp16 scale and zero applied per key outside the products
 * (q . x^ = s (q . (1024 + c)) - (1024 s + z) sum(q); the V side likewise through the rows'
 * correction), which is exact: x^ = s c - z itself is never rounded, where a bf16 copy of it in
 * shared memory would lose 5 of fp16's mantissa bits, and no pass over shared memory is added.
 * The online softmax is fp32 (softmax_stats, the dense kernels'); causal within the chunk by each
 * row's last position (lim); keys of invalid slots masked (block_valid).
 *
 * What it does not take (run_attn keeps k_lean_fd there): spans, deferred-RoPE offsets (cached
 * documents: the backward rotation of q per tile stays with k_lean_fd), K2V2 and K16V16, and the
 * layouts forced by kvs_cuda_set_lean_layout (1 forces k_lean_fd rows on M).
 *
 * Grid: (query tile x KV head, split); tiles in reverse order, so that a chunk's last tiles (the
 * longest causal walks) start first. Splits only where the tiles do not fill the resident blocks.
 * Ownership: the caller's buffers. Errors: CUDA failures abort (CUDA_CHECK / LAUNCH_CHECK). */
#include "kernels/cuda/kv_lean_cuda.h"
#include "kernels/cuda/kv_lean_device.cuh"

#ifndef PF_ST
#define PF_ST 4 /* stages of the ring: PF_ST - 1 tiles in flight beside the one computed */
#endif
#define PF_DEFAULT_WARPS 4

/* the formats the kernel is built for (LEAN_FMTS less K2V2 and K16V16) */
#define LEAN_PF_FMTS(X) X(8, 8) X(8, 4) X(4, 4) X(4, 2)

/* the block's share of a tile's copies: key l of the tile is what lane l's k describes (every warp
 * holds the same keys); 16-byte chunks dealt over the NW warps, whole warps per pass (the tile's
 * K and V code bytes are multiples of 32 chunks of 16), (s, z) by warps 1 and 2 (mod NW), the key
 * infos by warp 0; one cp.async group a thread */
template <int HD, int KB, int VB, int NW>
__device__ __forceinline__ void pf_issue(const uint8_t *pool, const lean_key &k, uint8_t *stg, int warp, int lane)
{
    using S = lean_stage<HD, KB, VB>;
    constexpr int CHK = S::KC / 16, CHV = S::VC / 16;
    if (warp == 0) reinterpret_cast<int *>(stg + S::KO_OFF)[lane] = k.info;
#pragma unroll
    for (int idx = warp * 32 + lane; idx < AT_TILE * CHK; idx += NW * 32) {
        const int j = idx / CHK, c = idx % CHK;
        const long long o = __shfl_sync(FULL, k.k, j);
        lean_cp16(stg + S::K_OFF + j * S::KS + c * 16, o >= 0 ? pool + o + c * 16 : pool, o >= 0 ? 16 : 0);
    }
#pragma unroll
    for (int idx = warp * 32 + lane; idx < AT_TILE * CHV; idx += NW * 32) {
        const int j = idx / CHV, c = idx % CHV;
        const long long o = __shfl_sync(FULL, k.v, j);
        lean_cp16(stg + S::V_OFF + j * S::VS + c * 16, o >= 0 ? pool + o + c * 16 : pool, o >= 0 ? 16 : 0);
    }
    if (warp == 1 % NW) lean_cp4(stg + S::KSZ_OFF + lane * 4, k.ksz >= 0 ? pool + k.ksz : pool, k.ksz >= 0 ? 4 : 0);
    if (warp == 2 % NW) lean_cp4(stg + S::VSZ_OFF + lane * 4, k.vsz >= 0 ? pool + k.vsz : pool, k.vsz >= 0 ? 4 : 0);
    cp_async_commit();
}

/* block (tile, KV head, split): a.qt tokens of one sequence x G heads (at most NW x 16 rows; row
 * r is token r / G, head r % G), warp w computing rows 16 w .. 16 w + 15 */
template <int HD, int KB, int VB, int NW>
__global__ void __launch_bounds__(NW * 32, NW <= 4 ? 2 : 1) k_lean_pf(const __grid_constant__ lean_fd_args a)
{
    static_assert(KB < 16 && VB < 16, "k_lean_pf: quantized formats only");
    using S = lean_stage<HD, KB, VB>;
    extern __shared__ __align__(16) uint8_t pf_smem[];
    const lean_geom &g = a.g;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gq = lane >> 2, t = lane & 3;
    const int n_tiles = (int)(gridDim.x / g.n_kv);
    const int tile = n_tiles - 1 - (int)(blockIdx.x / g.n_kv), kvh = blockIdx.x % g.n_kv, split = blockIdx.y;

    int s = 0, r0 = 0;
    if (!lean_tile_seq(a, tile, lane, &s, &r0)) return; /* cannot happen: the grid has exactly the tiles */
    const int qs = a.q_start[s], rows_s = a.q_start[s + 1] - qs;
    const int nt = min(a.qt, rows_s - r0), nr = nt * a.G;
    const int first = a.pos[s] + r0, last = first + nt - 1;
    const int32_t *bt = a.bt + (long long)s * a.max_blocks;
    const int32_t *vt = a.valid ? a.valid + (long long)s * a.max_blocks : nullptr;
    const long long n_tiles_all = ((long long)last + 1 + AT_TILE - 1) / AT_TILE;
    const long long w0 = (long long)split * a.chunk;
    const long long w1 = split == a.n_splits - 1 ? n_tiles_all : min(n_tiles_all, w0 + a.chunk);
    const int ntiles = w1 > w0 ? (int)(w1 - w0) : 0;

    long long cpos = w0 * AT_TILE;
    auto lookup = [&]() {
        const int p = cpos + lane <= last ? (int)(cpos + lane) : -1;
        cpos += AT_TILE;
        return lean_lookup<HD, KB, VB>(a, p, kvh, bt, vt, nullptr);
    };
    lean_key nxt = lookup();
#pragma unroll
    for (int st = 0; st < PF_ST - 1; st++) {
        if (st < ntiles) {
            pf_issue<HD, KB, VB, NW>(a.pool, nxt, pf_smem + st * S::BYTES, warp, lane);
            nxt = lookup();
        } else {
            cp_async_commit();
        }
    }

    /* the warp's rows g + 8h of its 16; lim: a row's last visible key (-1: padding row) */
    const int rb = warp * 16;
    const float *qr[2];
    int lim[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int r = rb + gq + 8 * h;
        qr[h] = r < nr ? a.q + ((long long)(qs + r0 + r / a.G) * a.n_heads + (long long)kvh * a.G + r % a.G) * HD
                       : nullptr;
        lim[h] = r < nr ? first + r / a.G : -1;
    }
    /* the warp's last visible key: tiles past it are skipped (the causal triangle), warps without
     * rows compute nothing (they still copy and meet the barriers) */
    const int wlim = rb < nr ? first + (min(rb + 15, nr - 1)) / a.G : -1;
    uint32_t qa[HD / 16][4];
    float qsum[2];
    lean_qfrags<HD, KB>(qr, a.scale, nullptr, lane, qa, qsum);

    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}, corr[2] = {0.0f, 0.0f}, o[HD / 8][4];
#pragma unroll
    for (int nd = 0; nd < HD / 8; nd++) o[nd][0] = o[nd][1] = o[nd][2] = o[nd][3] = 0.0f;

    for (int it = 0; it < ntiles; it++) {
        /* pending after this tile's group: the next PF_ST - 2 tiles'; the barrier makes every
         * thread's copies visible and frees the stage computed last iteration */
        cp_async_wait<PF_ST - 2>();
        __syncthreads();
        if (it + PF_ST - 1 < ntiles) {
            pf_issue<HD, KB, VB, NW>(a.pool, nxt, pf_smem + ((it + PF_ST - 1) % PF_ST) * S::BYTES, warp, lane);
            nxt = lookup();
        } else {
            cp_async_commit();
        }
        const int kb = (int)((w0 + it) * AT_TILE);
        if (kb > wlim) continue; /* warp-uniform: every key of the tile is past the warp's rows */
        const uint8_t *stg = pf_smem + (it % PF_ST) * S::BYTES;
        const int *ko = reinterpret_cast<const int *>(stg + S::KO_OFF);
        float sc[4][4];
        lean_qk<HD, KB, VB>(stg, qa, qsum, sc, lane);
        uint32_t pa[2][4];
        lean_softmax<HD, KB, VB>(stg, sc, ko, kb, lim, m, l, corr, o, pa, lane);
        lean_pv<HD, KB, VB>(stg, pa, o, lane);
    }
    cp_async_wait<0>();

    /* the rows-on-M epilogue of k_lean_fd: o[nd][2h + c] is dim (2t + c) HD/8 + nd of row g + 8h */
#pragma unroll
    for (int h = 0; h < 2; h++) {
        float ls = l[h], cr = corr[h];
        ls += __shfl_xor_sync(FULL, ls, 1);
        ls += __shfl_xor_sync(FULL, ls, 2);
        cr += __shfl_xor_sync(FULL, cr, 1);
        cr += __shfl_xor_sync(FULL, cr, 2);
        const int r = rb + gq + 8 * h;
        if (r >= nr) continue;
        const long long orow = (long long)(qs + r0 + r / a.G) * a.n_heads + (long long)kvh * a.G + r % a.G;
        if (a.n_splits == 1) {
            const float inv = ls > 0.0f ? 1.0f / ls : 0.0f; /* no key: out = 0, lse = -inf */
            float *op = a.out + orow * HD;
#pragma unroll
            for (int nd = 0; nd < HD / 8; nd++) {
                op[(2 * t) * (HD / 8) + nd] = (o[nd][2 * h] - cr) * inv;
                op[(2 * t + 1) * (HD / 8) + nd] = (o[nd][2 * h + 1] - cr) * inv;
            }
            if (a.lse && t == 0) a.lse[orow] = ls > 0.0f ? m[h] + logf(ls) : -INFINITY;
        } else {
            float *pp = a.part + (orow * a.n_splits + split) * (long long)(HD + 2);
#pragma unroll
            for (int nd = 0; nd < HD / 8; nd++) {
                pp[(2 * t) * (HD / 8) + nd] = o[nd][2 * h] - cr;
                pp[(2 * t + 1) * (HD / 8) + nd] = o[nd][2 * h + 1] - cr;
            }
            if (t == 0) {
                pp[HD] = ls > 0.0f ? m[h] : -INFINITY;
                pp[HD + 1] = ls;
            }
        }
    }
}

/* warps a block (kvs_cuda_set_lean_prefill): 0 off, else 4 or 8; -1: not yet read */
static int pf_warps = -1;

extern "C" void kvs_cuda_set_lean_prefill(int warps)
{
    pf_warps = warps < 0 ? -1 : warps == 0 ? 0 : warps >= 8 ? 8 : 4;
}

static int pf_cfg(void)
{
    if (pf_warps < 0) {
        const char *e = getenv("KVS_LEAN_PF");
        const int w = e && *e ? atoi(e) : PF_DEFAULT_WARPS;
        pf_warps = w <= 0 ? 0 : w >= 8 ? 8 : 4;
    }
    return pf_warps;
}

template <int HD, int KB, int VB, int NW>
static void pf_launch(lean_fd_args &x, long long n_tiles, long long w_max, long long by_ws, int n_sms, cudaStream_t st)
{
    static kvs_cu_resident resident_all;
    int &resident = *kvs_cu_resident_here(resident_all);
    const size_t smem = (size_t)PF_ST * lean_stage<HD, KB, VB>::BYTES;
    if (!resident) {
        CUDA_CHECK(cudaFuncSetAttribute((const void *)k_lean_pf<HD, KB, VB, NW>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)smem));
        int nb = 0;
        CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&nb, k_lean_pf<HD, KB, VB, NW>, NW * 32, smem));
        if (nb < 1) kvs_panic(__FILE__, __LINE__, "lean prefill attention: kernel does not fit an SM (%zu bytes)", smem);
        resident = nb;
        if (getenv("KVS_LEAN_PLAN")) {
            cudaFuncAttributes fa;
            CUDA_CHECK(cudaFuncGetAttributes(&fa, (const void *)k_lean_pf<HD, KB, VB, NW>));
            fprintf(stderr, "lean prefill plan: HD %d K%dV%d, %d warps, %zu B shared, %d registers, %zu B local, %d blocks an SM\n",
                    HD, KB, VB, NW, smem, fa.numRegs, (size_t)fa.localSizeBytes, nb);
        }
    }
    /* splits only where the blocks do not fill every SM's resident slots once: the fewest that do,
     * at least LEAN_MIN_TILES tiles a split, the partials within the workspace (a launch of more
     * rows than the workspace holds partials for takes 1: a 4K-row chunk of 32 heads) */
    const long long pairs = n_tiles * x.g.n_kv, cap = (long long)resident * n_sms;
    long long ns = pairs >= cap ? 1 : (cap + pairs - 1) / pairs;
    const long long by_len = (w_max + LEAN_MIN_TILES - 1) / LEAN_MIN_TILES;
    if (ns > by_len) ns = by_len;
    if (ns > by_ws) ns = by_ws;
    if (ns > LEAN_MAX_SPLITS) ns = LEAN_MAX_SPLITS;
    if (ns < 1) ns = 1;
    x.chunk = (int)((w_max + ns - 1) / ns);
    if (x.chunk < 1) x.chunk = 1;
    x.n_splits = (int)((w_max + x.chunk - 1) / x.chunk);
    if (x.n_splits < 1) x.n_splits = 1;
    const dim3 grid((unsigned)pairs, (unsigned)x.n_splits);
    k_lean_pf<HD, KB, VB, NW><<<grid, NW * 32, smem, st>>>(x);
    LAUNCH_CHECK();
}

template <int NW>
static bool pf_go(lean_fd_args &x, long long n_tiles, long long w_max, long long by_ws, int n_sms, cudaStream_t st)
{
#define LEAN_PF_GO(K, V)                                                                                               \
    if (x.g.kbits == K && x.g.vbits == V) {                                                                            \
        if (x.g.hd == 128) pf_launch<128, K, V, NW>(x, n_tiles, w_max, by_ws, n_sms, st);                              \
        else pf_launch<64, K, V, NW>(x, n_tiles, w_max, by_ws, n_sms, st);                                             \
        return true;                                                                                                   \
    }
    LEAN_PF_FMTS(LEAN_PF_GO)
#undef LEAN_PF_GO
    return false;
}

/* kv_lean_device.cuh */
bool lean_pf_launch(lean_fd_args &x, const int *h_q_start, const int *h_pos, long long by_ws, int n_sms, cudaStream_t st)
{
    const int nw = pf_cfg();
    if (!nw || x.spans || x.rot || x.g.hd % 64) return false;
    bool fmt = false;
#define LEAN_PF_IS(K, V) fmt |= x.g.kbits == K && x.g.vbits == V;
    LEAN_PF_FMTS(LEAN_PF_IS)
#undef LEAN_PF_IS
    if (!fmt) return false;
    x.qt = nw * 16 / x.G; /* tokens a tile: G <= LEAN_MAXG = 16 keeps it >= 2 */
    long long n_tiles = 0, w_max = 0;
    for (int s = 0; s < x.n_seqs; s++) {
        const int rows = lean_sel_rows(x.sel, x.sel_rows, h_q_start[s + 1] - h_q_start[s]);
        if (rows <= 0) continue;
        n_tiles += (rows + x.qt - 1) / x.qt;
        const long long w = ((long long)h_pos[s] + rows + AT_TILE - 1) / AT_TILE;
        if (w > w_max) w_max = w;
    }
    if (n_tiles == 0) {
        x.n_splits = 1;
        return true;
    }
    return nw == 8 ? pf_go<8>(x, n_tiles, w_max, by_ws, n_sms, st) : pf_go<4>(x, n_tiles, w_max, by_ws, n_sms, st);
}
