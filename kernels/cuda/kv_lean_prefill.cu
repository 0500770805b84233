/* kv_lean_prefill.cu: LeanKV's prompt-chunk attention over quantized pages on tensor cores
 * (k_lean_pf), the static formats K8V8, K8V4, K4V4 and K4V2; kv_lean.cu's run_attn launches it
 * (lean_pf_launch) for the rows-on-M launches (some sequence has more than 8 / G rows: a prompt
 * chunk) and merges its splits' partials.
 *
 * Why: k_lean_fd's rows-on-M layout gives each one-warp block 16 query rows (16 / G tokens of a
 * KV group), so every K/V byte staged serves 16 rows, each block stages the whole causal prefix of
 * its few tokens, and one warp's copies wait behind its own compute: a 4K prompt's attention over
 * K8V4 pages cost about 50 ms more a step than bf16's FA3 prefill (bench/RESULTS.md, "LeanKV
 * kernels, part 12" and "part 14"). Here a block of NW warps (8 by default, or 4) owns NW x 16 query rows (NW x 16 / G
 * tokens of one sequence x the G query heads of one KV head): the block stages each 32-key tile
 * of quantized codes and (s, z) once into shared memory (16-byte cp.async, every warp issuing its
 * share, PF_ST stages in flight) and all NW warps compute against it, so the bytes staged and the
 * page lookups per query row drop NW-fold, and the copies of the next PF_ST - 1 tiles run while
 * the warps compute.
 *
 * Each staged tile is then dequantized once for the block into fp16 tiles in shared memory (x^ =
 * s c - z by one fused fp16 multiply-add from the stored fp16 s and z: x^ rounded once; fp16, not
 * bf16, so 3 more mantissa bits), and the warps run QK^T and PV on mma.sync m16n8k16 (fp16 in,
 * fp32 accumulate) with ldmatrix fragments, and the online softmax in fp32 (softmax_stats, the
 * dense kernels'); causal within the chunk by each row's last position (lim); keys of invalid
 * slots masked (block_valid). Why not k_lean_fd's arithmetic (the codes fed raw as fp16 1024 + c,
 * s and z applied per key outside the products): each warp would decode every tile again (4-8x
 * the permutes of one conversion a block; a first build of this kernel that did so ran only
 * 1.2-1.3x faster than k_lean_fd), and the identity sum_k p'_k (1024 + c_k) - corr, with the
 * 1024 term kept to the end, cancelled two fp32 sums ~1024 l against a result ~|v| l (rel-L2
 * 0.06-0.27 against the CPU at 3-7K keys in one split; k_lean_fd rows on M now takes each
 * tile's 1024 sum p' out of its accumulators right after the tile's PV: kv_lean_device.cuh
 * lean_softmax).
 * What it does not take (run_attn keeps k_lean_fd there): spans, deferred-RoPE offsets (cached
 * documents: the backward rotation of q per tile stays with k_lean_fd), K2V2 and K16V16, and the
 * layouts forced by kvs_cuda_set_lean_layout (1 forces k_lean_fd rows on M).
 *
 * Grid: (query tile x KV head, split); tiles in reverse order, so that a chunk's last tiles (the
 * longest causal walks) start first. Splits only where the tiles do not fill the resident blocks.
 * Ownership: the caller's buffers. Errors: CUDA failures abort (CUDA_CHECK / LAUNCH_CHECK). */
#include "kernels/cuda/cuda_attention.h"
#include "kernels/cuda/kv_lean_cuda.h"
#include "kernels/cuda/kv_lean_device.cuh"

#ifndef PF_ST
#define PF_ST 4 /* stages of the ring: PF_ST - 1 tiles in flight beside the one computed */
#endif
/* warps a block by default: 8 (128 query rows a staged tile) ran 8-13% faster than 4 at every format
 * and 4K chunk timed on the H100, at 1 block an SM against 2 (bench/RESULTS.md, "part 15") */
#define PF_DEFAULT_WARPS 8

/* the formats the kernel is built for (LEAN_FMTS less K2V2 and K16V16) */
#define LEAN_PF_FMTS(X) X(8, 8) X(8, 4) X(4, 4) X(4, 2)

/* kv_lean.cu: a kernel's shared memory raised, its resident blocks an SM (KVS_LEAN_PLAN: printed) */
int lean_resident(const void *fn, int threads, size_t smem, int carve, const char *label);

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

/* ---- the dequantized tile: x^ = s c - z as fp16, [32 keys][HD + 8] for K and for V ---------- */

/* fp16 row stride (halves): 16 bytes of padding, so the 8 rows an ldmatrix reads fall in distinct banks */
template <int HD> struct pf_tile {
    static constexpr int LD = HD + 8, HALVES = AT_TILE * LD, BYTES = 2 * HALVES * 2; /* K then V */
};

/* four codes in the bytes of z (code i in byte i, < 256) as two half2 of 1024 + code, exactly */
__device__ __forceinline__ void pf_bytes_h(uint32_t z, uint32_t *h)
{
    h[0] = __byte_perm(z, 0x64646464u, 0x4140);
    h[1] = __byte_perm(z, 0x64646464u, 0x4342);
}

/* the 32 / B codes of a packed word (code i at bits B i, kv_lean_format.c's packing) in order, as
 * 16 / B half2 of 1024 + code */
template <int B>
__device__ __forceinline__ void pf_word_h(uint32_t w, uint32_t *h)
{
    if constexpr (B == 8) {
        pf_bytes_h(w, h);
    } else if constexpr (B == 4) {
        const uint32_t y0 = w & 0x0f0f0f0fu, y1 = (w >> 4) & 0x0f0f0f0fu; /* codes 0 2 4 6, 1 3 5 7 */
        pf_bytes_h(__byte_perm(y0, y1, 0x5140), h);
        pf_bytes_h(__byte_perm(y0, y1, 0x7362), h + 2);
    } else {
        static_assert(B == 2, "pf_word_h: 8, 4 or 2 bits");
        uint32_t y[4];
#pragma unroll
        for (int j = 0; j < 4; j++) y[j] = (w >> (2 * j)) & 0x03030303u; /* codes j, 4 + j, 8 + j, 12 + j */
        const uint32_t a = __byte_perm(y[0], y[1], 0x5140), b = __byte_perm(y[2], y[3], 0x5140); /* 0 1 4 5, 2 3 6 7 */
        const uint32_t c = __byte_perm(y[0], y[1], 0x7362), d = __byte_perm(y[2], y[3], 0x7362); /* 8 9 12 13, 10 11 14 15 */
        pf_bytes_h(__byte_perm(a, b, 0x5410), h);
        pf_bytes_h(__byte_perm(a, b, 0x7632), h + 2);
        pf_bytes_h(__byte_perm(c, d, 0x5410), h + 4);
        pf_bytes_h(__byte_perm(c, d, 0x7632), h + 6);
    }
}

/* one side (K or V) of a staged tile into the fp16 tile dst: thread by thread a packed word of a
 * key, x^ = s c - z by one fused fp16 multiply-add (c exact in fp16, s and z the stored fp16
 * values: x^ rounded once, as the fp32 reference's value rounded to fp16). Keys not read have
 * zero codes and (s, z) (lean_issue's zero fill): x^ = 0. */
template <int HD, int B, int NW>
__device__ __forceinline__ void pf_convert(const uint8_t *codes, int stride, const uint8_t *szp, __half *dst)
{
    constexpr int KW = HD * B / 32, EPW = 32 / B; /* words a key, codes a word */
    const __half2 k1024 = __float2half2_rn(1024.0f);
#pragma unroll
    for (int idx = threadIdx.x; idx < AT_TILE * KW; idx += NW * 32) {
        const int j = idx / KW, w = idx % KW;
        const uint32_t word = *reinterpret_cast<const uint32_t *>(codes + j * stride + w * 4);
        const __half2 sz = lean_u2h(*reinterpret_cast<const uint32_t *>(szp + j * 4)); /* (s, z) */
        const __half2 s2 = __low2half2(sz), nz2 = __hneg2(__high2half2(sz));
        uint32_t h[EPW / 2];
        pf_word_h<B>(word, h);
#pragma unroll
        for (int i = 0; i < EPW / 2; i++) h[i] = lean_h2u(__hfma2(s2, __hsub2(lean_u2h(h[i]), k1024), nz2));
        uint32_t *out = reinterpret_cast<uint32_t *>(dst + j * pf_tile<HD>::LD + w * EPW);
        if constexpr (EPW == 4) {
            *reinterpret_cast<uint2 *>(out) = make_uint2(h[0], h[1]);
        } else {
#pragma unroll
            for (int i = 0; i < EPW / 2; i += 4) *reinterpret_cast<uint4 *>(out + i) = make_uint4(h[i], h[i + 1], h[i + 2], h[i + 3]);
        }
    }
}

__device__ __forceinline__ void pf_ldsm_x4(uint32_t *r, const void *p)
{
    const unsigned sa = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(sa));
}

__device__ __forceinline__ void pf_ldsm_x4_t(uint32_t *r, const void *p)
{
    const unsigned sa = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(sa));
}

/* block (tile, KV head, split): a.qt tokens of one sequence x G heads (at most NW x 16 rows; row
 * r is token r / G, head r % G), warp w computing rows 16 w .. 16 w + 15. Per 32-key tile: the
 * block's copies land in a stage of the ring (the lean_stage layout), the block converts them to
 * the fp16 tile (double-buffered: tile it + 1 is converted while tile it is computed, one barrier
 * a tile), and each warp runs S = q K^T (ldmatrix, mma m16n8k16 fp16 / fp32), the online softmax
 * and O += P V on it. */
template <int HD, int KB, int VB, int NW>
__global__ void __launch_bounds__(NW * 32, NW <= 4 ? 2 : 1) k_lean_pf(const __grid_constant__ lean_fd_args a)
{
    static_assert(KB < 16 && VB < 16, "k_lean_pf: quantized formats only");
    static_assert(PF_ST >= 3, "k_lean_pf: the stage converted must not be the one refilled");
    using S = lean_stage<HD, KB, VB>;
    using T = pf_tile<HD>;
    extern __shared__ __align__(16) uint8_t pf_smem[];
    __half *ftile = reinterpret_cast<__half *>(pf_smem + PF_ST * S::BYTES); /* [2][K, V][32][LD] */
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
    auto convert = [&](int i) { /* staged tile i into fp16 tile i % 2 */
        const uint8_t *stg = pf_smem + (i % PF_ST) * S::BYTES;
        __half *ft = ftile + (i & 1) * 2 * T::HALVES;
        pf_convert<HD, KB, NW>(stg + S::K_OFF, S::KS, stg + S::KSZ_OFF, ft);
        pf_convert<HD, VB, NW>(stg + S::V_OFF, S::VS, stg + S::VSZ_OFF, ft + T::HALVES);
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
    cp_async_wait<PF_ST - 2>(); /* tile 0 */
    __syncthreads();
    if (ntiles > 0) convert(0);

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
     * rows compute nothing (they still copy, convert and meet the barriers) */
    const int wlim = rb < nr ? first + (min(rb + 15, nr - 1)) / a.G : -1;
    /* q as A fragments, dims in order: qa[ks] = rows (g, g + 8) x dims 16 ks + (2t, 2t + 1) and + 8;
     * scaled, rounded to fp16 (saturated) */
    uint32_t qa[HD / 16][4];
#pragma unroll
    for (int ks = 0; ks < HD / 16; ks++)
#pragma unroll
        for (int e = 0; e < 2; e++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int d = 16 * ks + 8 * e + 2 * t;
                float v0 = 0.0f, v1 = 0.0f;
                if (qr[h]) v0 = __ldg(qr[h] + d) * a.scale, v1 = __ldg(qr[h] + d + 1) * a.scale;
                qa[ks][h + 2 * e] = lean_pack_f16(fminf(fmaxf(v0, -65504.0f), 65504.0f), fminf(fmaxf(v1, -65504.0f), 65504.0f));
            }

    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}, o[HD / 8][4];
#pragma unroll
    for (int nd = 0; nd < HD / 8; nd++) o[nd][0] = o[nd][1] = o[nd][2] = o[nd][3] = 0.0f;

    for (int it = 0; it < ntiles; it++) {
        /* tile it + 1 landed (pending: the PF_ST - 3 after it); the barrier also publishes fp16
         * tile it and frees the stage and fp16 tile that tile it - 1 used */
        cp_async_wait<PF_ST - 3>();
        __syncthreads();
        if (it + PF_ST - 1 < ntiles) {
            pf_issue<HD, KB, VB, NW>(a.pool, nxt, pf_smem + ((it + PF_ST - 1) % PF_ST) * S::BYTES, warp, lane);
            nxt = lookup();
        } else {
            cp_async_commit();
        }
        if (it + 1 < ntiles) convert(it + 1);
        const int kb = (int)((w0 + it) * AT_TILE);
        if (kb > wlim) continue; /* warp-uniform: every key of the tile is past the warp's rows */
        const int *ko = reinterpret_cast<const int *>(pf_smem + (it % PF_ST) * S::BYTES + S::KO_OFF);
        const __half *fk = ftile + (it & 1) * 2 * T::HALVES, *fv = fk + T::HALVES;
        /* S = q K^T: n-tile j = keys 8j .. 8j + 7; one ldmatrix.x4 gives two k-steps' B fragments */
        float sc[4][4];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.0f;
#pragma unroll
            for (int d0 = 0; d0 < HD; d0 += 32) {
                uint32_t b[4];
                pf_ldsm_x4(b, fk + (j * 8 + (lane & 7)) * T::LD + d0 + (lane >> 3) * 8);
                lean_mma(sc[j], qa[d0 / 16], b[0], b[1]);
                lean_mma(sc[j], qa[d0 / 16 + 1], b[2], b[3]);
            }
        }
        float alpha[2];
        softmax_stats<HD, true>(sc, ko, kb, lim, m, l, o, alpha, lane);
        uint32_t pa[2][4];
#pragma unroll
        for (int kk = 0; kk < 2; kk++) {
            pa[kk][0] = lean_pack_f16(sc[2 * kk][0], sc[2 * kk][1]);
            pa[kk][1] = lean_pack_f16(sc[2 * kk][2], sc[2 * kk][3]);
            pa[kk][2] = lean_pack_f16(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
            pa[kk][3] = lean_pack_f16(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
        }
        /* O += P V: V^T fragments by ldmatrix.trans, two 8-dim n-tiles a load */
        const int mi = lane >> 3, ri = lane & 7;
#pragma unroll
        for (int kk = 0; kk < 2; kk++)
#pragma unroll
            for (int nd = 0; nd < HD / 8; nd += 2) {
                uint32_t b[4];
                pf_ldsm_x4_t(b, fv + (kk * 16 + (mi & 1) * 8 + ri) * T::LD + (nd + (mi >> 1)) * 8);
                lean_mma(o[nd], pa[kk], b[0], b[1]);
                lean_mma(o[nd + 1], pa[kk], b[2], b[3]);
            }
    }
    cp_async_wait<0>();

    /* o[nd][2h + c] is row g + 8h, dim 8 nd + 2t + c */
#pragma unroll
    for (int h = 0; h < 2; h++) {
        float ls = l[h];
        ls += __shfl_xor_sync(FULL, ls, 1);
        ls += __shfl_xor_sync(FULL, ls, 2);
        const int r = rb + gq + 8 * h;
        if (r >= nr) continue;
        const long long orow = (long long)(qs + r0 + r / a.G) * a.n_heads + (long long)kvh * a.G + r % a.G;
        if (a.n_splits == 1) {
            const float inv = ls > 0.0f ? 1.0f / ls : 0.0f; /* no key: out = 0, lse = -inf */
            float *op = a.out + orow * HD;
#pragma unroll
            for (int nd = 0; nd < HD / 8; nd++)
                *reinterpret_cast<float2 *>(op + nd * 8 + 2 * t) = make_float2(o[nd][2 * h] * inv, o[nd][2 * h + 1] * inv);
            if (a.lse && t == 0) a.lse[orow] = ls > 0.0f ? m[h] + logf(ls) : -INFINITY;
        } else {
            float *pp = a.part + (orow * a.n_splits + split) * (long long)(HD + 2);
#pragma unroll
            for (int nd = 0; nd < HD / 8; nd++)
                *reinterpret_cast<float2 *>(pp + nd * 8 + 2 * t) = make_float2(o[nd][2 * h], o[nd][2 * h + 1]);
            if (t == 0) {
                pp[HD] = ls > 0.0f ? m[h] : -INFINITY;
                pp[HD + 1] = ls;
            }
        }
    }
}

/* warps a block (kvs_cuda_set_lean_prefill): 0 off, else 4 or 8 (PF_DEFAULT_WARPS); -1: not yet read */
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
    const size_t smem = (size_t)PF_ST * lean_stage<HD, KB, VB>::BYTES + pf_tile<HD>::BYTES * 2;
    if (!resident) {
        char label[96];
        snprintf(label, sizeof label, "lean prefill plan: HD %d K%dV%d, %d warps", HD, KB, VB, NW);
        resident = lean_resident((const void *)k_lean_pf<HD, KB, VB, NW>, NW * 32, smem, -1, label);
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
    x.part -= x.prow0 * x.n_splits * (long long)(HD + 2); /* lean_fd_args.prow0 */
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

/* kv_lean.cu */
bool lean_pf_takes(const lean_fd_args &x)
{
    if (!pf_cfg() || x.spans || x.rot || x.g.hd % 64) return false;
    bool fmt = false;
#define LEAN_PF_IS(K, V) fmt |= x.g.kbits == K && x.g.vbits == V;
    LEAN_PF_FMTS(LEAN_PF_IS)
#undef LEAN_PF_IS
    return fmt;
}

/* kv_lean.cu */
bool lean_pf_launch(lean_fd_args &x, const int *h_q_start, const int *h_pos, long long by_ws, int n_sms, cudaStream_t st)
{
    if (!lean_pf_takes(x)) return false;
    const int nw = pf_cfg();
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

/* ---- the bf16 road: dequantize the chunks' context, then the dense prefill kernel --------------
 *
 * Why: k_lean_pf still ran at 0.19-0.29x the bf16 FA3-style prefill (k_attn_fa3, cuda_attn_prefill_fa3.cu)
 * after two sessions of tuning ("part 15"), and a prompt chunk's attention is FLOP-bound while
 * dequantizing its context is bandwidth-cheap (an 8K context of Llama-3.1-8B's shape writes 32 MB
 * of bf16 K and V a layer). So lean_dq_attention dequantizes, per layer, the quantized context of a
 * range of the step's sequences (earlier pages and the chunk's own, as stored) into a bf16 scratch in
 * the dense cache layout ([block][KV head][slot][dim], the lean blocks' own size, with a block table
 * of its own: sequence s's blocks contiguous from base[s]; valid counts the same as the pages'), and
 * hands the range to the dense attention (kvs_cu_attention: k_attn_fa3 for its chunks at blocks of a
 * multiple of 16 slots, else the dense plan's other kernels; its decode pass for any one-row
 * sequence inside the range). The result is attention over the dequantized tensors rounded to bf16
 * (x^ in fp32 as the host computes it, lean_dequant, then round-to-nearest-even to bf16: the CPU
 * reference's x^ within bf16 rounding; k_lean_pf's fp16 keeps 3 more bits).
 *
 * k_lean_dq: block (lean block j of the range's sequence si, KV head); each thread turns one packed
 * 32-bit word of a slot's codes into 32 / B bf16 values. The block (0, si, 0) also writes row si of
 * the scratch block table (0 past the sequence's blocks). Whole blocks are converted: slots past
 * the context or a block's valid count hold whatever the page holds and are never read (the dense
 * kernels mask them and zero-fill their copies). */

/* the most sequences a range may hold (the kernel argument carries their block bases) */
#define LEAN_DQ_MAXS 64

struct lean_dq_args {
    lean_geom g;
    const uint8_t *pool;
    const int32_t *bt;      /* the range's lean block tables [n][max_blocks] */
    int max_blocks;
    bf16 *kd, *vd;          /* [blocks][n_kv][bs][hd] */
    int32_t *bt_out;        /* [n][max_blocks] */
    int base[LEAN_DQ_MAXS + 1]; /* sequence si's scratch blocks: base[si] .. base[si + 1] - 1 */
};

/* one side (K or V) of a page's bs slots: hd codes of B bits a slot (code i at bits B i of the
 * little-endian packing, kv_lean_format.c), (s, z) as two fp16 a slot */
template <int B>
__device__ __forceinline__ void dq_side(const uint8_t *codes, const uint8_t *szp, int bs, int hd, bf16 *dst)
{
    constexpr int E = 32 / B; /* codes a word */
    const int W = hd / E;     /* words a slot */
    for (int idx = threadIdx.x; idx < bs * W; idx += blockDim.x) {
        const int t = idx / W, w = idx % W;
        const uint32_t word = *reinterpret_cast<const uint32_t *>(codes + (long long)t * W * 4 + w * 4);
        const uint32_t sz = *reinterpret_cast<const uint32_t *>(szp + t * 4);
        const float s = lean_h2f((uint16_t)(sz & 0xffff)), z = lean_h2f((uint16_t)(sz >> 16));
        uint32_t h[E / 2];
#pragma unroll
        for (int i = 0; i < E / 2; i++) {
            const bf16 lo = __float2bfloat16_rn(lean_dequant(s, z, (int)((word >> (B * 2 * i)) & ((1u << B) - 1))));
            const bf16 hi = __float2bfloat16_rn(lean_dequant(s, z, (int)((word >> (B * (2 * i + 1))) & ((1u << B) - 1))));
            h[i] = (uint32_t)__bfloat16_as_ushort(lo) | (uint32_t)__bfloat16_as_ushort(hi) << 16;
        }
        uint32_t *out = reinterpret_cast<uint32_t *>(dst + (long long)t * hd + w * E);
        if constexpr (E == 4) {
            *reinterpret_cast<uint2 *>(out) = make_uint2(h[0], h[1]);
        } else {
#pragma unroll
            for (int i = 0; i < E / 2; i += 4) *reinterpret_cast<uint4 *>(out + i) = make_uint4(h[i], h[i + 1], h[i + 2], h[i + 3]);
        }
    }
}

template <int B>
__device__ __forceinline__ void dq_pick(int bits, const uint8_t *codes, const uint8_t *szp, int bs, int hd, bf16 *dst)
{
    if (bits == B) dq_side<B>(codes, szp, bs, hd, dst);
}

#define LEAN_DQ_THREADS 128
__global__ void __launch_bounds__(LEAN_DQ_THREADS) k_lean_dq(const __grid_constant__ lean_dq_args a)
{
    const int j = blockIdx.x, si = blockIdx.y, kvh = blockIdx.z;
    const int b0 = a.base[si], nb = a.base[si + 1] - b0;
    if (j == 0 && kvh == 0)
        for (int i = threadIdx.x; i < a.max_blocks; i += blockDim.x)
            a.bt_out[(long long)si * a.max_blocks + i] = i < nb ? b0 + i : 0;
    if (j >= nb) return;
    const lean_geom &g = a.g;
    uint8_t *kc, *vc, *ksz, *vsz;
    lean_token(g, const_cast<uint8_t *>(a.pool), a.bt[(long long)si * a.max_blocks + j], kvh, 0, &kc, &vc, &ksz, &vsz);
    const long long o = ((long long)(b0 + j) * g.n_kv + kvh) * g.bs * g.hd;
    dq_pick<8>(g.kbits, kc, ksz, g.bs, g.hd, a.kd + o);
    dq_pick<4>(g.kbits, kc, ksz, g.bs, g.hd, a.kd + o);
    dq_pick<2>(g.kbits, kc, ksz, g.bs, g.hd, a.kd + o);
    dq_pick<8>(g.vbits, vc, vsz, g.bs, g.hd, a.vd + o);
    dq_pick<4>(g.vbits, vc, vsz, g.bs, g.hd, a.vd + o);
    dq_pick<2>(g.vbits, vc, vsz, g.bs, g.hd, a.vd + o);
}

/* The scratch, one a device (a tensor-parallel rank's thread launches on its own): grown on demand
 * (a whole-device cudaFree then cudaMalloc, steps with prompt chunks only: rare, monotone) unless a
 * reservation (kvs_cuda_lean_dq_reserve: the lean storage's, at create) fixed it; a step that needs
 * more than a fixed scratch, or whose growth fails, takes k_lean_pf (lean_dq_attention false). */
struct dq_scratch {
    void *p;
    size_t bytes;
    int fixed, warned;
    long long taken, fallbacks;
};
static dq_scratch dq_sc[KVS_CU_MAX_DEVICES];

static dq_scratch &dq_here(void)
{
    int dev = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    KVS_ASSERT(dev >= 0 && dev < KVS_CU_MAX_DEVICES);
    return dq_sc[dev];
}

extern "C" int kvs_cuda_lean_dq_reserve(size_t bytes)
{
    dq_scratch &sc = dq_here();
    if (sc.p) CUDA_CHECK(cudaFree(sc.p));
    sc.p = NULL, sc.bytes = 0, sc.fixed = 0;
    if (bytes == 0) return 0;
    if (cudaMalloc(&sc.p, bytes) != cudaSuccess) {
        (void)cudaGetLastError(); /* the failed allocation's error, not a sticky one */
        sc.p = NULL;
        return -1;
    }
    sc.bytes = bytes, sc.fixed = 1;
    return 0;
}

extern "C" void kvs_cuda_lean_dq_counts(long long *taken, long long *fallbacks)
{
    const dq_scratch &sc = dq_here();
    *taken = sc.taken, *fallbacks = sc.fallbacks;
}

/* the path's switch (kvs_cuda_set_lean_dq / KVS_LEAN_DQ): 0 off (k_lean_pf / k_lean_fd), 1 every
 * prompt chunk it can take, 2 (the default) ranges whose longest chunk has LEAN_DQ_MIN_ROWS rows or
 * more; -1: not yet read */
#define LEAN_DQ_MIN_ROWS 64
static int dq_mode = -1;

extern "C" void kvs_cuda_set_lean_dq(int mode)
{
    dq_mode = mode < 0 ? -1 : mode > 2 ? 2 : mode;
}

/* kv_lean.cu */
int lean_dq_cfg(void)
{
    if (dq_mode < 0) {
        const char *e = getenv("KVS_LEAN_DQ");
        const int v = e && *e ? atoi(e) : 2;
        dq_mode = v <= 0 ? 0 : v == 1 ? 1 : 2;
    }
    return dq_mode;
}

/* kv_lean.cu */
int lean_dq_min_rows(void) { return LEAN_DQ_MIN_ROWS; }

/* scratch bytes for blocks scratch blocks and n sequences' tables (16-byte aligned parts) */
static size_t dq_bytes(const lean_geom &g, long long blocks, int n, int max_blocks, size_t *v_off, size_t *bt_off)
{
    const size_t side = ((size_t)blocks * g.n_kv * g.bs * g.hd * sizeof(bf16) + 15) / 16 * 16;
    *v_off = side, *bt_off = 2 * side;
    return 2 * side + (size_t)n * max_blocks * sizeof(int32_t);
}

/* kv_lean.cu: the step's sequences [s0, s1) of launch a (a's device pointers index every
 * sequence; h_q_start / h_pos are the host copies) through the scratch and the dense attention,
 * rows written to a.out; false with nothing launched where the scratch cannot hold them (then the
 * caller takes k_lean_pf / k_lean_fd). The dense attention's merge may also write rows of sequences
 * before s0 (it walks rows from 0): the caller computes those after this. */
bool lean_dq_attention(struct kvs_backend *b, const lean_fd_args &a, const int *h_q_start, const int *h_pos, int s0,
                       int s1, float scale)
{
    const int n = s1 - s0;
    if (n < 1 || n > LEAN_DQ_MAXS) return false;
    lean_dq_args d;
    memset(&d, 0, sizeof d);
    d.g = a.g;
    long long blocks = 0, max_nb = 0;
    for (int i = 0; i < n; i++) {
        const int s = s0 + i;
        const long long ctx = (long long)h_pos[s] + h_q_start[s + 1] - h_q_start[s];
        const long long nb = (ctx + a.g.bs - 1) / a.g.bs;
        d.base[i] = (int)blocks;
        blocks += nb;
        if (nb > max_nb) max_nb = nb;
        if (nb > a.max_blocks || blocks > INT_MAX / 2) return false; /* cannot happen for an engine's tables */
    }
    d.base[n] = (int)blocks;
    if (blocks == 0) return false;
    size_t v_off, bt_off;
    const size_t need = dq_bytes(a.g, blocks, n, a.max_blocks, &v_off, &bt_off);
    dq_scratch &sc = dq_here();
    if (need > sc.bytes) {
        if (sc.fixed) {
            sc.fallbacks++;
            return false;
        }
        if (sc.p) CUDA_CHECK(cudaFree(sc.p));
        sc.p = NULL, sc.bytes = 0;
        const size_t want = need + need / 4;
        if (cudaMalloc(&sc.p, want) != cudaSuccess) {
            (void)cudaGetLastError();
            sc.p = NULL;
            sc.fallbacks++;
            if (!sc.warned)
                kvs_log(KVS_LOG_WARN, "lean attention: no %zu bytes for the bf16 scratch of a prompt chunk's context; "
                        "such steps take the quantized prefill kernel", want);
            sc.warned = 1;
            return false;
        }
        sc.bytes = want;
    }
    uint8_t *base = (uint8_t *)sc.p;
    d.pool = a.pool;
    d.bt = a.bt + (long long)s0 * a.max_blocks;
    d.max_blocks = a.max_blocks;
    d.kd = (bf16 *)base, d.vd = (bf16 *)(base + v_off);
    d.bt_out = (int32_t *)(base + bt_off);
    k_lean_dq<<<dim3((unsigned)max_nb, (unsigned)n, (unsigned)a.g.n_kv), LEAN_DQ_THREADS, 0, b->stream>>>(d);
    LAUNCH_CHECK();

    struct kvs_cu_attn x;
    memset(&x, 0, sizeof x);
    x.q = a.q;
    x.kc = d.kd, x.vc = d.vd;
    x.kv_elems = (size_t)blocks * a.g.n_kv * a.g.bs * a.g.hd;
    x.q_start = a.q_start + s0, x.pos = a.pos + s0, x.bt = d.bt_out;
    x.rot = NULL, x.valid = a.valid ? a.valid + (long long)s0 * a.max_blocks : NULL;
    x.inv_freq = NULL, x.words = NULL;
    x.h_q_start = h_q_start + s0, x.h_pos = h_pos + s0;
    x.n_seqs = n, x.max_blocks = a.max_blocks;
    x.n = h_q_start[s1]; /* the rows up to the range's end: the merge walks rows from 0 */
    x.n_heads = a.n_heads, x.n_kv = a.g.n_kv, x.hd = a.g.hd, x.bs = a.g.bs;
    x.scale = scale;
    x.out = a.out, x.outh = NULL;
    kvs_cu_attention(&x, b->stream, b->n_sms, b->attn_ws, ATTN_WS_BYTES, 0, -1);
    sc.taken++;
    return true;
}

/* test entry (kv_lean_cuda.h): every sequence of m through k_lean_dq into k / v / bt */
extern "C" void kvs_cuda_lean_dequant(struct kvs_backend *b, struct kvs_lean_fmt f, const struct kvs_dbuf *pool,
                                      const struct kvs_attn_meta *m, int n_kv_heads, int head_dim, int block_size,
                                      struct kvs_dbuf *k, struct kvs_dbuf *v, struct kvs_dbuf *bt)
{
    KVS_ASSERT(m->n_seqs >= 1 && m->n_seqs <= LEAN_DQ_MAXS);
    KVS_ASSERT(f.kbits < 16 && f.vbits < 16);
    lean_dq_args d;
    memset(&d, 0, sizeof d);
    d.g = make_geom(f, head_dim, block_size, n_kv_heads);
    long long blocks = 0, max_nb = 0;
    for (int s = 0; s < m->n_seqs; s++) {
        const long long nb = ((long long)m->h_pos[s] + m->h_q_start[s + 1] - m->h_q_start[s] + block_size - 1) / block_size;
        d.base[s] = (int)blocks;
        blocks += nb;
        if (nb > max_nb) max_nb = nb;
    }
    d.base[m->n_seqs] = (int)blocks;
    const size_t elems = (size_t)blocks * n_kv_heads * block_size * head_dim;
    KVS_ASSERT(k->n >= elems && v->n >= elems && bt->n >= (size_t)m->n_seqs * m->max_blocks);
    d.pool = (const uint8_t *)pool->d;
    d.bt = (const int32_t *)m->block_tables->d;
    d.max_blocks = m->max_blocks;
    d.kd = (bf16 *)k->d, d.vd = (bf16 *)v->d, d.bt_out = (int32_t *)bt->d;
    if (max_nb == 0) return;
    k_lean_dq<<<dim3((unsigned)max_nb, (unsigned)m->n_seqs, (unsigned)n_kv_heads), LEAN_DQ_THREADS, 0, b->stream>>>(d);
    LAUNCH_CHECK();
}
