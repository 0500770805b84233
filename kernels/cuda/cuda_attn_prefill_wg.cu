/* cuda_attn_prefill_wg.cu: k_attn_wg, the Hopper prefill attention kernel (sm_90a: wgmma), and the
 * choice between it, k_attn_tc (cuda_attn_prefill.cu) and k_attn_fa3 (cuda_attn_prefill_fa3.cu, kinds
 * 7 to 18, kind 14 the default on sm_90) for a prefill launch. The wgmma pieces both wgmma kernels
 * use (descriptors, QK / PV issue, the online softmax) are in cuda_attn_wgmma.cuh.
 *
 * A block of two warpgroups owns 128 (token, head) rows of one sequence and one KV head: 128 / G
 * consecutive tokens times the G query heads of the group (GQA packing: every staged K/V byte
 * serves all of them), 64 rows a warpgroup. Q is converted once (scaled by scale x log2 e, bf16)
 * into shared memory; K and V stream in tiles of KN keys (128 or 64) through ST cp.async stages,
 * written straight into the 128-byte-swizzled layout wgmma reads (the paged block table allows
 * neither one TMA box per tile nor contiguous rows). Per tile and warpgroup:
 *   S[64 x KN]  = Q . K^T   wgmma, A and B from shared memory (K is K-major as stored),
 *   online softmax in registers (exp2), P rounded to bf16 in the A-fragment layout,
 *   O[64 x HD] += P . V     wgmma, A from registers, B = V N-major (transposed descriptor).
 * One barrier a tile: the stage freed by the previous tile is refilled right after it, so a
 * tile's copies overlap the compute of ST - 1 tiles. Causal skipping: the block's keys end at its
 * last token, a warpgroup skips tiles past its own last token, and tiles wholly visible to every
 * row of a warpgroup (no padded slot: the loader records the last tile with one) skip the mask.
 * Kinds 4 and 5 overlap the softmax of tile i with the P.V product of tile i - 1 (FlashAttention-3's
 * intra-warpgroup pipelining). Kind 6 (the default) runs two blocks an SM instead (64-key tiles,
 * 2 stages, at most 128 registers a thread), so one block's softmax overlaps the other's wgmma.
 * Blocks run longest first (the reversed tile order) so that the short causal tiles fill the tail
 * of the wave. Deferred RoPE (rot offsets) is not done here: such launches take k_attn_fa3's
 * rotating kinds (14, 19 to 25; the default) or k_attn_tc, which rotates q fragments in registers
 * at document boundaries.
 */
#include <stdlib.h>

#include "kernels/cuda/cuda_attn_cudnn.h"
#include "kernels/cuda/cuda_attn_wgmma.cuh"

#define WG_THREADS 256
/* the prefill kernel without kvs_cuda_set_pre_attn / KVS_CUDA_PRE_ATTN: k_attn_fa3 with K and V
 * producer warps in 3 stages, the fastest kind at 1K and 8K on the H100 (bench/RESULTS.md,
 * "k_attn_fa3 verified"); where k_attn_fa3 cannot take a launch (blocks of other than a multiple of
 * 16 slots, no tensor maps) kind 6 does, whose tiles have the same 128 rows */
#define KVS_PRE_ATTN_DEFAULT 14
#define KVS_PRE_ATTN_KINDS 25 /* kinds 1 .. 25 (7 .. 25: k_attn_fa3, cuda_attn_prefill_fa3.cu) */
/* kind 26 (KVS_PRE_ATTN_CUDNN, cuda_attn_cudnn.cu) is not a kernel of this file: the plan
 * (cuda_attention.cu) hands its launches to cuDNN, or to kind 14 where cuDNN cannot take them */
#define KVS_PRE_ATTN_MAX KVS_PRE_ATTN_CUDNN

template <int HD, int KN, int ST>
struct wg_cfg {
    static constexpr int QE = WG_ROWS * HD; /* elements of the Q tile */
    static constexpr int TE = KN * HD;      /* elements of one K or V stage */
    /* 1024: the swizzle atoms must start on 1024-byte boundaries, and the dynamic shared memory
     * is only known to be 16-byte aligned */
    static constexpr size_t smem = 1024 + (size_t)(QE + 2 * ST * TE) * sizeof(bf16) + (size_t)ST * KN * sizeof(int) +
                                   (size_t)ST * sizeof(int);
};

template <int HD, int KN, int ST, bool OVL, int MINB>
__global__ void __launch_bounds__(WG_THREADS, MINB) k_attn_wg(at_args a)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    grid_dep_wait(); /* cuda_launch.h: q (and the K/V just written) are ready */
    typedef wg_cfg<HD, KN, ST> C;
    static_assert(ST >= 2, "one stage is computed while the next loads");
    extern __shared__ __align__(16) unsigned char smraw[];
    unsigned char *base = smraw + ((1024 - ((uint32_t)__cvta_generic_to_shared(smraw) & 1023)) & 1023);
    bf16 *sq = (bf16 *)base;          /* [WG_ROWS x HD] swizzled */
    bf16 *sk = sq + C::QE;            /* [ST][KN x HD] swizzled */
    bf16 *sv = sk + ST * C::TE;       /* [ST][KN x HD] swizzled */
    int *ko = (int *)(sv + ST * C::TE); /* [ST][KN]: 0, or KEY_PAD for a slot that is not read */
    int *padt = ko + ST * KN;         /* [ST]: the last tile staged there that had a KEY_PAD slot */

    int s, r0;
    if (!find_tile(a, (int)(gridDim.x - 1 - blockIdx.x), &s, &r0)) return;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2, g = lane >> 2, t = lane & 3;
    const int kvh = blockIdx.y, split = blockIdx.z;
    const int qs = a.q_start[s], ntok = min(a.qt, a.q_start[s + 1] - qs - r0);
    const int pos0 = a.pos[s] + r0, nr = ntok * a.G;
    const int k0 = split * a.chunk;
    const int k1 = min(pos0 + ntok, k0 + a.chunk);
    const int32_t *bt = a.bt + (size_t)s * a.max_blocks;
    const int32_t *vt = a.valid ? a.valid + (size_t)s * a.max_blocks : nullptr;
    const int2 *wt = a.words ? a.words + (size_t)s * a.max_blocks : nullptr;
    const int ntiles = k1 > k0 ? (k1 - k0 + KN - 1) / KN : 0;

    if (tid < ST) padt[tid] = -1;
    __syncthreads(); /* before any loader may record a padded tile */

    /* the loader: thread tid copies 16-byte chunk lc of keys lj, lj + KPP, ... of a tile, K and V */
    constexpr int CH = HD / 8, KPP = WG_THREADS / CH;
    static_assert(KN % KPP == 0, "whole passes");
    const int lc = tid % CH, lj = tid / CH;
    /* Each key's pool row ((block x n_kv + kvh) x bs + slot, or -1: not read) comes from the block
     * table: the lookup of the next tile runs right after a tile's copies, so its global loads are in
     * flight during a whole tile of compute instead of stalling the copies (and the wgmma after them). */
    constexpr int NP = KN / KPP;
    int nrow[NP];
    auto lookup = [&](int it) {
        int p = k0 + it * KN + lj;
        int pb = p / a.bs, sl = p - pb * a.bs;
#pragma unroll
        for (int i = 0; i < NP; i++) {
            int row = -1;
            if (p < k1) {
                if (wt) {
                    const int2 w = wt[pb]; /* backend.h kvs_pack_block_words: block, offset << 11 | valid */
                    if (sl < (w.y & 2047)) row = (w.x * a.n_kv + kvh) * a.bs + sl;
                } else if (!vt || sl < vt[pb]) {
                    row = (bt[pb] * a.n_kv + kvh) * a.bs + sl;
                }
            }
            nrow[i] = row;
            p += KPP;
            sl += KPP;
            while (sl >= a.bs) { /* no division per key: one step for blocks of >= KPP slots */
                sl -= a.bs;
                pb++;
            }
        }
    };
    /* stages tile it (whose rows nrow holds), then looks up tile it + 1 */
    auto issue = [&](int it) {
        const int st = it % ST;
        bf16 *dk = sk + st * C::TE, *dv = sv + st * C::TE;
        bool pad = false;
#pragma unroll
        for (int i = 0; i < NP; i++) {
            const int j = lj + i * KPP;
            const bool ok = nrow[i] >= 0;
            const size_t src = ok ? (size_t)nrow[i] * HD + lc * 8 : 0;
            pad |= !ok;
            const int off = sw128<KN>(j, lc * 8);
            cp_async16(dk + off, a.kc + src, ok ? 16 : 0);
            cp_async16(dv + off, a.vc + src, ok ? 16 : 0);
            if (lc == 0) ko[st * KN + j] = ok ? 0 : KEY_PAD;
        }
        if (pad) padt[st] = it; /* stale entries name older tiles: no reset needed */
        lookup(it + 1);
    };
    lookup(0);
    /* the prologue: ST - 1 tiles ahead, ST - 2 in the overlapped form (tile it - 1's V stays in use
     * during iteration it); tile t is then cp.async group t */
#pragma unroll
    for (int st = 0; st < ST - (OVL ? 2 : 1); st++) {
        if (st < ntiles) issue(st);
        cp_async_commit();
    }

    /* Q: rows past nr are zero; the scale carries log2 e, so the softmax runs on exp2 */
    const float qscale = a.scale * 1.4426950408889634f;
    for (int idx = tid; idx < WG_ROWS * CH; idx += WG_THREADS) {
        const int r = idx / CH, c = idx % CH;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (r < nr) {
            const float4 *qr = (const float4 *)(a.q + (((size_t)qs + r0 + r / a.G) * a.n_heads + (size_t)kvh * a.G +
                                                       r % a.G) * HD + c * 8);
            const float4 x0 = __ldg(qr), x1 = __ldg(qr + 1);
            v.x = pack_bf16(x0.x * qscale, x0.y * qscale);
            v.y = pack_bf16(x0.z * qscale, x0.w * qscale);
            v.z = pack_bf16(x1.x * qscale, x1.y * qscale);
            v.w = pack_bf16(x1.z * qscale, x1.w * qscale);
        }
        *(uint4 *)(sq + sw128<WG_ROWS>(r, c * 8)) = v;
    }

    /* this thread's rows rw and rw + 8 (the accumulator layout of m64nNk16), the last key each
     * sees (-1: a padding row, which sees nothing), and its warpgroup's first and last visible key */
    const int rw = wg * 64 + (warp & 3) * 16 + g;
    int lim[2];
#pragma unroll
    for (int h = 0; h < 2; h++) lim[h] = rw + 8 * h < nr ? pos0 + (rw + 8 * h) / a.G : -1;
    const int wlo = pos0 + (wg * 64) / a.G;
    const int whi = nr > wg * 64 ? pos0 + (min(nr, wg * 64 + 64) - 1) / a.G : -1;

    float o[HD / 2], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < HD / 2; i++) o[i] = 0.0f;
    const uint64_t qdesc = wg_desc(sq + wg * 64 * 64, 16, 1024);

    if constexpr (!OVL) {
        for (int it = 0; it < ntiles; it++) {
            cp_async_wait<ST - 2>(); /* this thread's copies of tile it landed */
            fence_proxy_async_smem();
            __syncthreads(); /* everyone's copies landed; everyone is done with tile it - 1's stage */
            if (it + ST - 1 < ntiles) issue(it + ST - 1);
            cp_async_commit();
            const int st = it % ST, kb = k0 + it * KN;
            if (kb > whi) continue; /* past the warpgroup's last token (uniform in the warpgroup) */
            float sc[KN / 2];
            wg_fence();
            qk_issue<HD, KN>(sc, qdesc, wg_desc(sk + st * C::TE, 16, 1024));
            wg_commit();
            wg_wait_group<0>();
#pragma unroll
            for (int i = 0; i < KN / 2; i++) wg_reg_fence(sc[i]);
            float alpha[2];
            softmax_wg<KN>(sc, ko + st * KN, kb, kb + KN - 1 > wlo || kb + KN > k1 || padt[st] == it, lim, m, l,
                           alpha, t);
#pragma unroll
            for (int i = 0; i < HD / 2; i++) o[i] *= alpha[(i >> 1) & 1];
            uint32_t pa[KN / 16][4];
            pack_p<KN>(sc, pa);
#pragma unroll
            for (int i = 0; i < HD / 2; i++) wg_reg_fence(o[i]);
            wg_fence();
            pv_issue<HD, KN>(o, pa, wg_desc(sv + st * C::TE, KN * 128, 1024));
            wg_commit();
            wg_wait_group<0>();
#pragma unroll
            for (int i = 0; i < HD / 2; i++) wg_reg_fence(o[i]);
        }
    } else if (ntiles > 0) {
        /* Overlapped (FlashAttention-3's intra-warpgroup pipelining): S = Q . K(it) and O += P(it - 1)
         * . V(it - 1) are issued together, and the softmax of S runs while the tensor cores do the
         * PV product; O is rescaled once that product is done. Tile it - 1's V stays in use during
         * iteration it, so the stage refilled at iteration it is that of tile it - 2: ST - 2 tiles
         * ahead. No wgmma stays in flight across a branch (ptxas would serialize them all), so the
         * first tile is peeled off and both warpgroups take every tile (the mask covers the one
         * past the first warpgroup's tokens). */
        static_assert(ST >= 3, "K(it), V(it - 1) and the tile in flight");
        uint32_t pa[KN / 16][4];
        float sc[KN / 2], alpha[2];
        auto top = [&](int it) {
            cp_async_wait<ST - 3>();
            fence_proxy_async_smem();
            __syncthreads(); /* tile it landed everywhere; tile it - 2's stage is free */
            if (it + ST - 2 < ntiles) issue(it + ST - 2);
            cp_async_commit();
        };
        top(0);
        wg_fence();
        qk_issue<HD, KN>(sc, qdesc, wg_desc(sk, 16, 1024));
        wg_commit();
        wg_wait_group<0>();
#pragma unroll
        for (int i = 0; i < KN / 2; i++) wg_reg_fence(sc[i]);
        softmax_wg<KN>(sc, ko, k0, k0 + KN - 1 > wlo || k0 + KN > k1 || padt[0] == 0, lim, m, l, alpha, t);
        pack_p<KN>(sc, pa);
        for (int it = 1; it < ntiles; it++) {
            top(it);
            const int st = it % ST, kb = k0 + it * KN;
            const bf16 *vprev = sv + ((it - 1) % ST) * C::TE;
#pragma unroll
            for (int i = 0; i < HD / 2; i++) wg_reg_fence(o[i]);
            wg_fence();
            qk_issue<HD, KN>(sc, qdesc, wg_desc(sk + st * C::TE, 16, 1024));
            wg_commit();
            pv_issue<HD, KN>(o, pa, wg_desc(vprev, KN * 128, 1024));
            wg_commit();
            wg_wait_group<1>(); /* S is done; P . V may still run */
#pragma unroll
            for (int i = 0; i < KN / 2; i++) wg_reg_fence(sc[i]);
            softmax_wg<KN>(sc, ko + st * KN, kb, kb + KN - 1 > wlo || kb + KN > k1 || padt[st] == it, lim, m, l,
                           alpha, t);
            wg_wait_group<0>(); /* P(it - 1) . V(it - 1) is done: O and pa may change */
#pragma unroll
            for (int i = 0; i < HD / 2; i++) {
                wg_reg_fence(o[i]);
                o[i] *= alpha[(i >> 1) & 1];
            }
            pack_p<KN>(sc, pa);
        }
#pragma unroll
        for (int i = 0; i < HD / 2; i++) wg_reg_fence(o[i]);
        wg_fence();
        pv_issue<HD, KN>(o, pa, wg_desc(sv + ((ntiles - 1) % ST) * C::TE, KN * 128, 1024));
        wg_commit();
        wg_wait_group<0>();
#pragma unroll
        for (int i = 0; i < HD / 2; i++) wg_reg_fence(o[i]);
    }
    cp_async_wait<0>();

    wg_store_rows<HD>(a, o, m, l, rw, nr, t, qs, r0, kvh, split);
#else
    __trap(); /* built for another architecture: kvs_cu_attn_prefill_kind never picks it there */
#endif
}

template <int HD, int KN, int ST, bool OVL, int MINB = 1>
static void launch_wg(at_args &x, int n_tiles, int max_ctx, cudaStream_t st, int n_sms, size_t ws_floats, int n,
                      int force)
{
    static kvs_cu_resident resident;
    /* as launch_tc (cuda_attn_prefill.cu): causal tiles do unequal work, so once they cover the SMs
     * the context is not split */
    if (force <= 0 && (long long)n_tiles * x.n_kv >= n_sms) force = 1;
    kvs_cu_attn_launch(k_attn_wg<HD, KN, ST, OVL, MINB>, WG_THREADS, wg_cfg<HD, KN, ST>::smem,
                       kvs_cu_resident_here(resident), x, n_tiles, max_ctx, st, n_sms, ws_floats, n, HD, force, KN);
}

/* kinds 2 .. 6: 128-key tiles in 2 stages, 64-key tiles in 3, the overlapped forms (128-key tiles
 * in 3 stages, 224 KB of shared memory; 64-key tiles in 4), and 64-key tiles in 2 stages with two
 * blocks an SM (at most 128 registers a thread), whose warpgroups overlap across blocks */
template <int HD>
static void launch_wg_kind(at_args &x, int kind, int n_tiles, int max_ctx, cudaStream_t st, int n_sms,
                           size_t ws_floats, int n, int force)
{
    switch (kind) {
    case 2: launch_wg<HD, 128, 2, false>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force); break;
    case 3: launch_wg<HD, 64, 3, false>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force); break;
    case 4: launch_wg<HD, 128, 3, true>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force); break;
    case 5: launch_wg<HD, 64, 4, true>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force); break;
    default: launch_wg<HD, 64, 2, false, 2>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force); break;
    }
}

void kvs_cu_attn_prefill_wg(at_args &x, int kind, int hd, int n_tiles, int max_ctx, cudaStream_t st, int n_sms,
                            size_t ws_floats, int n, int force)
{
    KVS_ASSERT(kind >= 2 && kind <= KVS_PRE_ATTN_KINDS);
    KVS_ASSERT(x.kv_rows < INT_MAX); /* pool rows are int in the kernel */
    if (kind >= 7) {
        if (kvs_cu_attn_prefill_fa3(x, kind, hd, n_tiles, max_ctx, st, n_sms, ws_floats, n, force)) return;
        kind = 6; /* blocks of other than a multiple of 16 slots: the same tiles of 128 rows */
    }
    KVS_ASSERT(!x.rot); /* k_attn_wg does not rotate: the plan gives it no rotation offsets */
    if (hd == 128) launch_wg_kind<128>(x, kind, n_tiles, max_ctx, st, n_sms, ws_floats, n, force);
    else {
        KVS_ASSERT(hd == 64);
        launch_wg_kind<64>(x, kind, n_tiles, max_ctx, st, n_sms, ws_floats, n, force);
    }
}

/* the kind forced by kvs_cuda_set_pre_attn (-1: none) */
static int g_pre_kind = -1;

extern "C" void kvs_cuda_set_pre_attn(int kind) { g_pre_kind = kind >= 1 && kind <= KVS_PRE_ATTN_MAX ? kind : -1; }

/* 1 where kind 26 can run: cuDNN built in (make CUDNN=...) and libcudnn.so.9 (9.6+) opened */
static bool cudnn_usable()
{
#if defined(KVS_HAVE_CUDNN) && KVS_HAVE_CUDNN
    return kvs_cu_attn_cudnn_available() != 0;
#else
    static int said; /* one line a process: the request cannot be met in this build */
    if (!said) {
        said = 1;
        kvs_log(KVS_LOG_WARN, "cuda: prefill attention kind 26 (cuDNN) asked for, but this build has no cuDNN (make CUDNN=...); "
                              "kind 14 runs instead");
    }
    return false;
#endif
}

extern "C" int kvs_cuda_cudnn_prefill_available(void)
{
#if defined(KVS_HAVE_CUDNN) && KVS_HAVE_CUDNN
    return kvs_cu_attn_cudnn_available();
#else
    return 0;
#endif
}

extern "C" long long kvs_cuda_cudnn_prefill_launches(void)
{
#if defined(KVS_HAVE_CUDNN) && KVS_HAVE_CUDNN
    return kvs_cu_attn_cudnn_count();
#else
    return 0;
#endif
}

/* 1 where the current device runs sm_90a code (the wgmma kernel's only SASS) */
static bool device_is_sm90()
{
    static int known[KVS_CU_MAX_DEVICES]; /* 0 unknown, 1 yes, 2 no */
    int dev = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    KVS_ASSERT(dev >= 0 && dev < KVS_CU_MAX_DEVICES);
    if (!known[dev]) {
        int major = 0, minor = 0;
        CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
        CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
        known[dev] = major == 9 && minor == 0 ? 1 : 2;
    }
    return known[dev] == 1;
}

/* the kind forced by kvs_cuda_set_pre_attn or KVS_CUDA_PRE_ATTN (read once), -1 where none was */
static int forced_pre_kind()
{
    static int env_kind = -2; /* -2: not read yet */
    if (env_kind == -2) {
        const char *e = getenv("KVS_CUDA_PRE_ATTN");
        const int v = e && *e ? atoi(e) : -1;
        env_kind = v >= 1 && v <= KVS_PRE_ATTN_MAX ? v : -1;
    }
    return g_pre_kind >= 1 ? g_pre_kind : env_kind;
}

int kvs_cu_attn_prefill_kind(int hd, int rot)
{
    const int forced = forced_pre_kind();
    int kind = forced >= 1 ? forced : KVS_PRE_ATTN_DEFAULT;
    /* kind 26, cuDNN's SDPA: launches without rotation offsets at head_dim 64 / 128 (what its test
     * covers) on sm_90 (where it was measured, and kind 14 is its fallback), where cuDNN can be
     * had; the others take kind 14's path */
    if (kind == KVS_PRE_ATTN_CUDNN) {
        if (!rot && (hd == 64 || hd == 128) && device_is_sm90() && cudnn_usable()) return kind;
        kind = KVS_PRE_ATTN_DEFAULT;
    }
    /* the wgmma kernels: head_dim 64 / 128, Hopper; the deferred rotation only in k_attn_fa3's
     * rotating kinds (14, 19 to 25), the others' rotated launches stay on k_attn_tc (and blocks of
     * other than a multiple of 16 slots too: the plan, cuda_attention.cu) */
    if (kind >= 2 && ((rot && !kvs_cu_attn_fa3_rotates(kind)) || (hd != 64 && hd != 128) || !device_is_sm90()))
        kind = 1;
    return kind;
}

/* The default kind for a launch of `items` work items (tiles x KV heads): kind 14 gives each item a
 * block of its own, so a launch of a few waves ends on its longest causal tiles; kind 25 (kind 22
 * with persistent blocks taking items in snake order) balances them, and wins up to 4K-token prompts
 * of the Llama-3.1-8B shape (~8 waves on an H100) but loses at 8K (~16 waves; bench/RESULTS.md, the
 * lead's threshold table of 2026-11-25). So a launch of at most KVS_CUDA_PRE_PERSIST_WAVES waves
 * (default 8; 0 turns it off) takes kind 25, where no kind was forced and the default applies. Both kinds take tiles of the same rows, so the plan's tile count
 * (kvs_cu_attn_prefill_qt) holds for either, and both do the deferred rotation. */
int kvs_cu_attn_prefill_kind_for(int kind, long long items, int n_sms)
{
    static int env_waves = -2; /* -2: not read yet */
    if (env_waves == -2) {
        const char *e = getenv("KVS_CUDA_PRE_PERSIST_WAVES");
        env_waves = e && *e ? atoi(e) : 8;
        if (env_waves < 0) env_waves = 0;
    }
    if (kind != 14 || forced_pre_kind() >= 1) return kind;
    return items <= (long long)env_waves * n_sms ? 25 : kind;
}

/* kinds 16 and 18: k_attn_fa3 with three consumer warpgroups, 192 rows a block */
int kvs_cu_attn_prefill_qt(int kind, int G)
{
    return (kind == 16 || kind == 18 ? 192 : kind >= 2 ? WG_ROWS : PRE_WARPS * 16) / G;
}

extern "C" int kvs_cuda_pre_attn_kind(int head_dim, int rot) { return kvs_cu_attn_prefill_kind(head_dim, rot); }
