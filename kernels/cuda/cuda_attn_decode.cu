/* cuda_attn_decode.cu: attention of decode rows (one query token per sequence): k_attn_fd, the
 * FlashAttention-2-style kernel (the default where it applies: groups of up to 16 query heads,
 * head_dim 64 / 128 / 256), its K/V staged by the copy engine (TMA) or with cp.async, and the
 * choice of the decode kernel (KVS_CUDA_DEC_ATTN, kvs_cuda_set_dec_attn): launches k_attn_fd does
 * not take go to the one-warp tensor-core blocks of cuda_attn_prefill.cu, kind 0 to the CUDA-core
 * kernel of dev/cuda_attn_simt.cu. The shared pieces are in cuda_attn_device.cuh.
 */
#include <string.h>

#include "kernels/cuda/cuda_attn_device.cuh"
#include "kernels/cuda/cuda_attn_pool_issue.cuh"

/* ---- FlashAttention-2-style decode kernel (KVS_CUDA_DEC_ATTN=4) ----------------------------
 *
 * k_attn_fd: decode rows only (one query token per sequence). The work split of
 * cuDNN's SDPA decode kernel: a block of FD_WARPS warps owns (sequence, KV head, context split);
 * the block walks its keys in tiles of FD_TILE = 128 keys, and warp w computes the 32-key
 * sub-tile w of every tile with its own online-softmax state (m, l, o) over the same 16 rows
 * (the G query heads of the group, the rest padding, as in k_attn_tc's decode blocks). At the
 * end the warps' states are merged through shared memory in warp order (deterministic).
 *
 * Why: the one-warp decode blocks of k_attn_tc are limited to 4 a SM by their shared memory
 * (3 stages of K and V), i.e. one warp per SM sub-partition, so every stall of that warp
 * (a cp.async wait, the MMA and ldmatrix latencies of a tile) leaves its scheduler idle. Here K and
 * V are staged separately, FlashAttention-2 style, each warp holding one K and one V buffer of 32
 * keys:
 *     issue V_i; wait K_i; S = Q K_i^T, softmax; issue K_{i+1} (into the buffer S just freed);
 *     wait V_i; O += P V_i
 * so a warp always has about one 32-key half (K or V) in flight while it computes on the other,
 * and a block needs 2 x 4 x 32 keys of shared memory (HD 128: 68 KB, vs 52 KB for one warp of
 * k_attn_tc with 3 stages): two or three blocks (8 to 12 warps) per SM.
 * Each warp stages the sub-tile it computes itself (tile_lookup's lane-per-key lookup and
 * tile_issue's copies, per pool), so a warp's buffers are private until the final merge: the
 * pipeline needs only warp barriers (__syncwarp orders the cp.async results and the shared
 * loads among the warp's lanes), no block barrier that would make all four warps wait for the
 * slowest copy. Consecutive warps read consecutive 32-key sub-tiles, so the block streams
 * 128-key ranges as cuDNN's kernel does.
 * Splits are planned by launch_kernel; a chunk is a multiple of 32 keys, the last tile of a
 * split may be partial (warps whose sub-tile starts past the range do nothing for it).
 * Deferred RoPE (ROT) as in k_attn_tc, per warp: each warp holds the q fragments rotated backward
 * by cur_rot and, at the first sub-tile with keys of another offset (the vote reads the key
 * offsets that the warp's lookup left in registers), rotates them afresh from the unrotated
 * fragments (in shared memory, one copy for the block: no registers to spare) with its own
 * cos / sin table (shared memory, HD floats a warp, warp barriers only); a sub-tile that holds a
 * document boundary takes one QK pass per offset. Each warp meets a document's first keys itself,
 * so a block computes a rotation per warp and document (k_attn_tc's one-warp blocks: one).
 */
#define FD_WARPS 4
#define FD_TILE (FD_WARPS * AT_TILE) /* keys per block tile: warp w computes keys 32w .. 32w + 31 */

template <int HD, bool ROT, bool TMA = false> struct fd_cfg {
    static constexpr int KST = TMA ? HD : HD + 8;             /* K/V row stride (bf16): k_attn_tc's padded
                                                               * rows, or the TMA's dense swizzled boxes */
    static constexpr int OST = HD + 8;                        /* merge rows (floats): +8 banks a row keeps
                                                               * the float2 stores conflict-free */
    static constexpr size_t sub_elems = (size_t)AT_TILE * KST; /* one warp's K (or V) buffer */
    static constexpr size_t stage_bytes = 2 * FD_WARPS * sub_elems * sizeof(bf16);
    static constexpr size_t merge_bytes = (size_t)FD_WARPS * 16 * (OST + 2) * sizeof(float);
    static constexpr size_t ko_off = stage_bytes > merge_bytes ? stage_bytes : merge_bytes;
    /* ROT: each warp's own table of cos, sin (HD floats) of its current rotation, then the block's
     * unrotated q fragments (the same in every warp: HD / 16 x 4 words a lane) */
    static constexpr size_t rt_off = ko_off + (size_t)FD_WARPS * AT_TILE * sizeof(int);
    static constexpr size_t q0_off = rt_off + (ROT ? (size_t)FD_WARPS * HD * sizeof(float) : 0);
    /* TMA: a K and a V mbarrier per warp */
    static constexpr size_t mb_off = q0_off + (ROT ? (size_t)HD / 16 * 4 * 32 * sizeof(uint32_t) : 0);
    /* TMA: + 1 KB so that the buffers can start on a 1 KB boundary (the 128-byte swizzle's period) */
    static constexpr size_t smem = mb_off + (TMA ? (size_t)FD_WARPS * 2 * sizeof(uint64_t) + 1024 : 0);
};

/* cos and sin of the backward rotation by o into cs_sn (hd floats: [hd/2] cos, then [hd/2] sin),
 * rot_table's arithmetic, but computed and read by one warp alone (k_attn_fd's warps run
 * independently, so its tables are per warp, between warp barriers). Inline: out of line (as
 * rot_table), the registers live across the call spilled in k_attn_fd<128, true>. */
__device__ __forceinline__ void rot_table_warp(float *cs_sn, int hd, int o, const float *inv_freq)
{
    const int half = hd / 2;
    __syncwarp(); /* every lane is done with the previous table */
    for (int i = threadIdx.x & 31; i < half; i += 32) {
        float sn, cs;
        sincosf((float)((double)o * (double)inv_freq[i]), &sn, &cs);
        cs_sn[i] = cs;
        cs_sn[half + i] = sn;
    }
    __syncwarp();
}

/* rotate_frags with the unrotated fragments in shared memory (sq0: word j of k-step ks of lane l
 * at [(ks * 4 + j) * 32 + l], conflict-free): k_attn_fd has no registers to spare for them (q0
 * in registers took k_attn_fd<128> from 168 registers to 251, i.e. from 3 blocks a SM to 2, and
 * spilled at head_dim 256). The same arithmetic as rotate_frags, a pair of partner words at a time
 * (head_dim >= 32: the partner of k-step ks < hd/32 is k-step ks + hd/32, same word), so each
 * word and table entry is loaded once and few registers are live besides the fragments. */
template <int HD>
__device__ __forceinline__ void rotate_frags_sm(const uint32_t *sq0, const float *cs_sn, int lane,
                                                uint32_t (*qa)[HD / 16][4])
{
    static_assert(HD >= 32, "rotate_frags_sm: partners in other k-steps");
    constexpr int HALF = HD / 2, PKS = HD / 32;
    const int t = lane & 3;
#pragma unroll
    for (int ks = 0; ks < PKS; ks++)
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const uint32_t xw = sq0[(ks * 4 + j) * 32 + lane], pw = sq0[((ks + PKS) * 4 + j) * 32 + lane];
            const float2 x = __bfloat1622float2(*(const __nv_bfloat162 *)&xw); /* dims i, i + 1 */
            const float2 p = __bfloat1622float2(*(const __nv_bfloat162 *)&pw); /* dims HALF + i, + 1 */
            const int i = ks * 16 + 8 * (j >> 1) + 2 * t;
            const float c0 = cs_sn[i], c1 = cs_sn[i + 1], s0 = cs_sn[HALF + i], s1 = cs_sn[HALF + i + 1];
            qa[0][ks][j] = pack_bf16(x.x * c0 + p.x * s0, x.y * c1 + p.y * s1);
            qa[0][ks + PKS][j] = pack_bf16(p.x * c0 - x.x * s0, p.y * c1 - x.y * s1);
        }
}

/* One pool's rows (K or V) of the 32-key sub-tile that m describes, staged into dst (rows of
 * HD + 8 elements) by one warp (cuda_attn_pool_issue.cuh: tile_issue's copies, the same fast path
 * for blocks of a multiple of 16 slots), so that any warp of the block can stage its own sub-tile
 * (the sub-tile starts on a 16-key boundary: chunks and sub-tiles are multiples of 32 keys). */
template <int HD>
__device__ __forceinline__ void fd_issue(const at_args &a, const bf16 *pool, const tile_meta &m, bf16 *dst)
{
    pool_issue<HD>(pool, m, a.bs % 16 == 0, dst, HD + 8);
}

/* ---- k_attn_fd's TMA staging (head_dim 64 / 128 / 256, blocks of a multiple of 16 slots, with or
 * without rotation offsets) ----
 * The copy engine moves each 16-slot half of a warp's 32-key sub-tile as HD / 64 boxes of 16 rows x
 * 64 columns (2 KB), completing on the buffer's mbarrier: 4 requests of 2 KB for a K sub-tile at
 * head_dim 128 instead of 512 16-byte cp.async. Dense rows of 256 bytes would put the 8 rows of an
 * ldmatrix phase in the same banks, so the boxes are written with the 128-byte swizzle: 16-byte
 * chunk c of row r sits at chunk c ^ (r & 7) of its 128-byte row, and qk_tc / pv_tile read
 * through the same permutation (tile_at, SW) (conflict-free). The buffers start on a 1 KB boundary, so the
 * hardware's swizzle (address bits 4-6 ^ 7-9) is that of the row index. Keys that are not read
 * are still copied (whole boxes): their scores are masked, and their V rows zeroed after the copy
 * lands (0 x garbage could be NaN).
 * The copy engine and cp.async staging read the KV about equally fast; launches with rotation
 * offsets (cached documents) take the TMA staging too (their QK passes read the swizzled tile:
 * qk_by_offset<..., SW>), which brought them level with the ordinary kernel (bench/RESULTS.md,
 * "Attention design measurements"). */
__device__ __forceinline__ unsigned smem_u32(const void *p) { return (unsigned)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(uint64_t *mb)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_u32(mb)) : "memory");
}

/* waits for the phase of parity `parity` of mb to complete */
__device__ __forceinline__ void mbar_wait(uint64_t *mb, unsigned parity)
{
    unsigned done = 0;
    while (!done)
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     " selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(smem_u32(mb)), "r"(parity)
                     : "memory");
}

/* The sub-tile that m describes (both 16-slot halves, rows base0 / HD and base1 / HD of the pool
 * tensor), one warp: lane 0 arms mb with the bytes and issues the boxes. Every lane first orders its
 * earlier accesses to dst (ldmatrix reads, zero fills) before the copy engine's writes. */
template <int HD>
__device__ __forceinline__ void fd_issue_tma(const CUtensorMap *map, const tile_meta &m, bf16 *dst, uint64_t *mb)
{
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncwarp();
    if ((threadIdx.x & 31) == 0) {
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(mb)),
                     "r"((unsigned)(AT_TILE * HD * sizeof(bf16)))
                     : "memory");
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int row = (int)((h ? m.base1 : m.base0) / HD);
#pragma unroll
            for (int b = 0; b < HD / 64; b++)
                asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
                                 smem_u32(dst + (h * (HD / 64) + b) * 16 * 64)),
                             "l"(map), "r"(b * 64), "r"(row), "r"(smem_u32(mb))
                             : "memory");
        }
    }
}

/* k_attn_fd<128, true>'s resident blocks the compiler must plan registers for (0: none, its own
 * choice). ptxas -v, sm_90a: k_attn_fd<128, false> 168 registers (3 blocks a SM, as its shared
 * memory allows); <128, true> on its own 174 registers, no spills (2 blocks a SM), or at 3: 168
 * registers and 20 bytes of spills (3 blocks a SM; its shared memory, 76 KB, allows 3).
 * <64, true>: 127 registers, no spills. <256, true>: 255 registers, 88 bytes of spills (<256, false>
 * needs 254 already; the one-warp kernel it replaces, k_attn_tc<256, 1, 1, 3, true>, spills 2 KB). */
#ifndef FD_ROT_MIN_BLOCKS
#define FD_ROT_MIN_BLOCKS 0
#endif

template <int HD, bool ROT, bool TMA>
__global__ void __launch_bounds__(FD_WARPS * 32, ROT && HD == 128 ? FD_ROT_MIN_BLOCKS : 0)
    k_attn_fd(const __grid_constant__ at_args a)
{
    typedef fd_cfg<HD, ROT, TMA> C;
    constexpr int KST = C::KST, OST = C::OST;
    extern __shared__ __align__(16) unsigned char smdyn[];
    /* TMA: everything from a 1 KB boundary (the swizzle's period; C::smem has the slack) */
    unsigned char *smraw = TMA ? smdyn + ((1024u - (smem_u32(smdyn) & 1023u)) & 1023u) : smdyn;

    /* Blocks in launch order (x fastest, then y) take the KV heads of one sequence, then the next
     * sequence: the grid is (tiles, KV heads, splits) as for every attention launch, renumbered so
     * that blocks that start together read the same KV blocks of the pool (a block's heads are
     * adjacent there), which helped batch 128 x 1K a little (bench/RESULTS.md). */
    const int lin = blockIdx.x + gridDim.x * blockIdx.y;
    const int kvh = lin % a.n_kv;
    int s, r0;
    const int tile = a.tile0 + lin / a.n_kv;
    if (!find_tile(a, tile, &s, &r0)) return; /* decode tiles: one row each, r0 = 0 */
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    bf16 *wk = (bf16 *)smraw + (size_t)warp * C::sub_elems;              /* this warp's K buffer */
    bf16 *wv = (bf16 *)smraw + (size_t)(FD_WARPS + warp) * C::sub_elems; /* and its V buffer */
    int *ko = (int *)(smraw + C::ko_off) + warp * AT_TILE; /* per key of the staged K: offset (0 without
                                                            * ROT) or KEY_PAD */
    float *rtab = (float *)(smraw + C::rt_off) + warp * HD; /* ROT: this warp's cos, sin table */
    uint32_t *sq0 = (uint32_t *)(smraw + C::q0_off);        /* ROT: the unrotated q fragments */
    uint64_t *mbk = (uint64_t *)(smraw + C::mb_off) + warp * 2, *mbv = mbk + 1; /* TMA: K and V copies */
    if constexpr (TMA) {
        if (lane == 0) {
            mbar_init(mbk);
            mbar_init(mbv);
            asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        }
        __syncwarp();
    }
    const int split = blockIdx.z;
    const int qs = a.q_start[s];
    const int pos0 = a.pos[s];  /* the row's position: keys 0 .. pos0 are visible */
    const int nr = a.G;         /* live rows: the group's heads */
    int k0, k1;
    at_split_keys(a, split, pos0 + 1, &k0, &k1);
    const int32_t *bt = a.bt + (size_t)s * a.max_blocks;
    const int32_t *vt = a.valid ? a.valid + (size_t)s * a.max_blocks : nullptr;
    const int2 *wt = a.words ? a.words + (size_t)s * a.max_blocks : nullptr;
    const int32_t *rt = ROT ? a.rot + (size_t)s * a.max_blocks : nullptr;

    /* this warp's sub-tiles: keys kw + i * FD_TILE .. + 31, i < nsub */
    const int kw = k0 + warp * AT_TILE;
    const int nsub = k1 > kw ? (k1 - kw + FD_TILE - 1) / FD_TILE : 0;
    auto lookup = [=](int i) { return tile_lookup<HD>(a, kw + i * FD_TILE, k1, kvh, bt, vt, rt, wt); };

    /* K_0 in flight first; the metadata of sub-tile i + 1 is looked up an iteration before its K is
     * issued (past k1 a lookup does no load), so the copies never wait on a block-table load */
    tile_meta cur = lookup(0); /* the sub-tile whose K is staged and whose V is issued next */
    tile_meta nxt = lookup(1);
    /* Everything above reads only the step's metadata (sequence starts, positions, block tables),
     * which the host uploaded before the step's first kernel: with programmatic dependent launch
     * it overlaps the end of the previous kernel (RoPE + KV write). From here on, q and the K/V
     * just written are read (cuda_launch.h). */
    grid_dep_wait();
    grid_dep_launch(a.trig); /* cuda_launch.h: the merge (or the o projection) may start */
    if (nsub > 0) {
        ko[lane] = cur.info;
        if constexpr (TMA) fd_issue_tma<HD>(&a.tm_k, cur, wk, mbk);
        else fd_issue<HD>(a, a.kc, cur, wk);
    }
    cp_async_commit();

    uint32_t qa[1][HD / 16][4]; /* the same 16 rows in every warp */
    q_frags<HD, 1>(a, qs, 0, kvh, nr, 0, lane, nullptr, qa);
    int cur_rot = 0; /* ROT: the offset qa is rotated by */
    if constexpr (ROT) {
        /* the unrotated fragments into shared memory, a quarter by each warp (they are the same in
         * every warp); the one block barrier before the tile loop */
#pragma unroll
        for (int ks = 0; ks < HD / 16; ks++)
#pragma unroll
            for (int j = 0; j < 4; j++)
                if ((ks * 4 + j) % FD_WARPS == warp) sq0[(ks * 4 + j) * 32 + lane] = qa[0][ks][j];
        __syncthreads();
    }

    float m[2], l[2], o[1][HD / 8][4]; /* one m-tile: the 16 rows */
    int lim[2]; /* last visible key of this thread's rows g, g + 8: padding rows see nothing */
#pragma unroll
    for (int h = 0; h < 2; h++) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
        lim[h] = g + 8 * h < nr ? pos0 : -1;
    }
#pragma unroll
    for (int nd = 0; nd < HD / 8; nd++)
#pragma unroll
        for (int e = 0; e < 4; e++) o[0][nd][e] = 0.0f;

    for (int i = 0; i < nsub; i++) {
        const int kb = kw + i * FD_TILE;
        const bool vzero = TMA && cur.info == KEY_PAD; /* TMA: lane's V row of this sub-tile is zeroed */
        if constexpr (TMA) {
            fd_issue_tma<HD>(&a.tm_v, cur, wv, mbv); /* V_i */
            mbar_wait(mbk, i & 1);                  /* K_i has landed */
        } else {
            fd_issue<HD>(a, a.vc, cur, wv); /* V_i: its buffer was freed by the end of iteration i - 1 */
            cp_async_commit();
            cp_async_wait<1>(); /* K_i has landed (V_i may still be in flight) */
        }
        __syncwarp();
        float sc[1][4][4]; /* QK on the staged K: swizzled boxes (TMA) or padded rows (cp.async) */
        if constexpr (!ROT) {
            qk_tc<HD, 1, TMA>(wk, qa, sc, lane);
        } else {
            /* k_attn_tc's design, per warp: inside a document every read key of the sub-tile has
             * the offset qa is rotated by. Lane l's key info is still in cur (the lookup of this
             * sub-tile), so the check is one vote on a register. */
            const int myoff = cur.info;
            if (__all_sync(FULL, myoff == cur_rot || myoff == KEY_PAD)) {
                qk_tc<HD, 1, TMA>(wk, qa, sc, lane);
            } else {
                const int first = __shfl_sync(FULL, myoff, __ffs((int)__ballot_sync(FULL, myoff != KEY_PAD)) - 1);
                if (__all_sync(FULL, myoff == first || myoff == KEY_PAD)) {
                    /* a new document from this sub-tile on: rotate once, QK as usual */
                    rot_table_warp(rtab, HD, first, a.inv_freq);
                    rotate_frags_sm<HD>(sq0, rtab, lane, qa);
                    cur_rot = first;
                    qk_tc<HD, 1, TMA>(wk, qa, sc, lane);
                } else {
                    /* a document boundary inside the sub-tile (blocks or documents not a multiple
                     * of 32 keys): one pass per distinct offset */
                    qk_by_offset<HD, 1, TMA>(wk, ko, myoff, cur_rot, [&](int ofs) {
                        rot_table_warp(rtab, HD, ofs, a.inv_freq);
                        rotate_frags_sm<HD>(sq0, rtab, lane, qa);
                    }, qa, sc, lane);
                }
            }
        }
        /* masks and the online softmax, as k_attn_tc's decode blocks */
        uint32_t pa[1][2][4]; /* P as A fragments: [m-tile][k-step of 16 keys][4] */
        softmax_tile<HD, true>(sc[0], ko, kb, lim, m, l, o[0], pa[0], lane);
        __syncwarp(); /* every lane is done with K_i and its key info */
        if (i + 1 < nsub) {
            ko[lane] = nxt.info;
            /* K_{i+1} flies while this warp waits for V_i and does PV */
            if constexpr (TMA) fd_issue_tma<HD>(&a.tm_k, nxt, wk, mbk);
            else fd_issue<HD>(a, a.kc, nxt, wk);
        }
        cur = nxt;
        nxt = lookup(i + 2);
        if constexpr (TMA) {
            mbar_wait(mbv, i & 1); /* V_i has landed */
            if (vzero) {
                /* a key that is not read: its V row (whatever the pool holds there) becomes zeros */
#pragma unroll
                for (int b = 0; b < HD / 64; b++) {
                    uint4 *row = (uint4 *)(wv + (((lane >> 4) * (HD / 64) + b) * 16 + (lane & 15)) * 64);
#pragma unroll
                    for (int c = 0; c < 8; c++) row[c] = make_uint4(0, 0, 0, 0);
                }
            }
        } else {
            cp_async_commit();
            cp_async_wait<1>(); /* V_i has landed (K_{i+1} may still be in flight) */
        }
        __syncwarp();
        pv_tile<HD, 1, TMA>(wv, KST, pa, o, lane); /* O += P . V_i */
        __syncwarp(); /* every lane is done with V_i before V_{i+1} is issued into its buffer */
    }
    cp_async_wait<0>(); /* only empty groups are left; none may write into the merge area */

    /* merge of the warps' states through shared memory (the stage buffers: every warp must be
     * done with its own first), then the same outputs as k_attn_tc: out (+ outh) for one split,
     * else the partial (acc..., max, sum) that k_attn_merge combines */
    __syncthreads();
    float *so = (float *)smraw;              /* [FD_WARPS][16][OST] each warp's o */
    float *sml = so + FD_WARPS * 16 * OST;   /* [FD_WARPS][16][2] each warp's m, l */
#pragma unroll
    for (int h = 0; h < 2; h++) {
        float ls = l[h];
        ls += __shfl_xor_sync(FULL, ls, 1);
        ls += __shfl_xor_sync(FULL, ls, 2);
        const int row = g + 8 * h;
        if (row >= nr) continue;
        float *orow = so + (size_t)(warp * 16 + row) * OST + 2 * t;
#pragma unroll
        for (int nd = 0; nd < HD / 8; nd++) *(float2 *)(orow + nd * 8) = make_float2(o[0][nd][2 * h], o[0][nd][2 * h + 1]);
        if (t == 0) {
            sml[(warp * 16 + row) * 2] = m[h];
            sml[(warp * 16 + row) * 2 + 1] = ls;
        }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < nr * HD; idx += FD_WARPS * 32) {
        const int row = idx / HD, d = idx % HD;
        float M = -INFINITY;
#pragma unroll
        for (int w = 0; w < FD_WARPS; w++) M = fmaxf(M, sml[(w * 16 + row) * 2]);
        float L = 0.0f, A = 0.0f;
#pragma unroll
        for (int w = 0; w < FD_WARPS; w++) {
            const float mw = sml[(w * 16 + row) * 2];
            if (mw == -INFINITY) continue; /* a warp that saw no key: l = 0, o = 0 */
            const float e = __expf(mw - M);
            L += sml[(w * 16 + row) * 2 + 1] * e;
            A += so[(size_t)(w * 16 + row) * OST + d] * e;
        }
        const size_t orow = (size_t)qs * a.n_heads + (size_t)kvh * a.G + row;
        if (at_direct(a)) {
            const float v = A / L;
            a.out[orow * HD + d] = v;
            if (a.outh) a.outh[orow * HD + d] = __float2bfloat16(v);
        } else {
            float *pp = a.part + (at_part_row(a, tile, kvh * a.G + row, orow) * a.n_splits + split) * (size_t)(HD + 2);
            pp[d] = A;
            if (d == 0) {
                pp[HD] = M;
                pp[HD + 1] = L;
            }
        }
    }
}

/* cuTensorMapEncodeTiled, reached through the runtime (no link against the driver library);
 * NULL where the driver has none */
static PFN_cuTensorMapEncodeTiled_v12000 tma_encoder(void)
{
    static int done = 0;
    static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
    if (!done) {
        done = 1;
        void *p = nullptr;
        cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) == cudaSuccess &&
            q == cudaDriverEntryPointSuccess)
            fn = (PFN_cuTensorMapEncodeTiled_v12000)p;
        else
            (void)cudaGetLastError();
        if (!fn) kvs_log(KVS_LOG_WARN, "cuda attention: no cuTensorMapEncodeTiled in the driver; decode KV staged with cp.async");
    }
    return fn;
}

/* the K and V pools of x as TMA tensors [kv_rows][hd] (boxes of 16 rows x 64 columns, 128-byte
 * swizzle); false when the driver cannot encode them (the caller stages with cp.async) */
/* Encoded maps, remembered per thread by (pool, rows, hd): a map holds nothing else, so an entry
 * stays right even after its pool is freed and another takes the address (then it is that
 * pool's map). Encoding costs about 1 us of host time, twice a layer: eager steps (prefill,
 * mixed batches) would pay it 64 times a step on an 8B model; recorded graphs only at capture. */
#define TMA_MAP_CACHE 512 /* two pools x layers of the models in use */
struct tma_map_entry {
    const void *pool;
    long long rows;
    int hd;
    CUtensorMap map;
};

static bool tma_map(const bf16 *pool, long long rows, int hd, CUtensorMap *out)
{
    static thread_local tma_map_entry cache[TMA_MAP_CACHE];
    static thread_local int n_cached, next;
    for (int i = 0; i < n_cached; i++)
        if (cache[i].pool == pool && cache[i].rows == rows && cache[i].hd == hd) {
            *out = cache[i].map;
            return true;
        }
    PFN_cuTensorMapEncodeTiled_v12000 enc = tma_encoder();
    if (!enc || rows <= 0 || rows > 0xffffffffLL) return false;
    const cuuint64_t dims[2] = {(cuuint64_t)hd, (cuuint64_t)rows};
    const cuuint64_t strides[1] = {(cuuint64_t)hd * sizeof(bf16)};
    const cuuint32_t box[2] = {64, 16}, es[2] = {1, 1};
    if (enc(out, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, (void *)pool, dims, strides, box, es,
            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
        return false;
    tma_map_entry *e = &cache[next]; /* full: the oldest entry goes */
    next = (next + 1) % TMA_MAP_CACHE;
    if (n_cached < TMA_MAP_CACHE) n_cached++;
    e->pool = pool;
    e->rows = rows;
    e->hd = hd;
    e->map = *out;
    return true;
}

/* also k_attn_fa3's maps (declared in cuda_attn_wgmma.cuh) */
bool fd_tma_maps(at_args &x, int hd)
{
    return tma_map(x.kc, x.kv_rows, hd, &x.tm_k) && tma_map(x.vc, x.kv_rows, hd, &x.tm_v);
}

/* the FlashAttention-2-style decode kernel: 4 warps a block, K and V pipelined separately; TMA:
 * staged by the copy engine (k_attn_fd's TMA section), which the caller asks for only with
 * blocks of a multiple of 16 slots */
template <int HD, bool ROT, bool TMA>
static void launch_fd(at_args &x, int n_tiles, int max_ctx, cudaStream_t st, int n_sms, size_t ws_floats, int n,
                      int force)
{
    static kvs_cu_resident resident;
    /* Splits: about two blocks per SM in all, at least one 128-key tile each, at most 16: the best
     * forced split counts of `kvserve-gpubench --attn-variants` follow this rule, where the
     * occupancy-filling plan of the one-warp kernel (choose_splits) split too much
     * (bench/RESULTS.md, "Attention design measurements"). */
    if (force <= 0) {
        const long long pairs = (long long)n_tiles * x.n_kv;
        long long ns = 2LL * n_sms / pairs;
        const long long by_len = max_ctx / FD_TILE;
        if (ns > by_len) ns = by_len;
        if (ns > 16) ns = 16; /* 32 splits measured slower than 16 at batch 1 x 8K / 32K */
        force = ns < 1 ? 1 : (int)ns;
    }
    kvs_cu_attn_launch(k_attn_fd<HD, ROT, TMA>, FD_WARPS * 32, fd_cfg<HD, ROT, TMA>::smem, kvs_cu_resident_here(resident), x, n_tiles,
                       max_ctx, st, n_sms, ws_floats, n, HD, force, FD_TILE);
}

static int valid_dec_kind(int k) { return k == 0 || (k >= 2 && k <= 5); }

/* which kernel takes decode rows: `forced` (kvs_cuda_set_dec_attn) if it is a kind, else
 * KVS_CUDA_DEC_ATTN = 0 (CUDA cores), 2 or 3 (tensor cores, one warp a block, that many tiles in
 * flight), 4 (k_attn_fd). Unset: 4, k_attn_fd, which beat the one-warp kernel at every measured
 * shape (bench/RESULTS.md). Kind 4 is only a request: the one-warp kernel with three tiles in
 * flight (as fast or faster than two at every measured shape) takes the launches k_attn_fd does
 * not. */
static int dec_kind(int forced)
{
    static int k = -2;
    if (k == -2) {
        const char *e = getenv("KVS_CUDA_DEC_ATTN");
        k = e ? atoi(e) : -1;
        if (!valid_dec_kind(k)) k = -1;
    }
    if (valid_dec_kind(forced)) return forced;
    return k >= 0 ? k : 4;
}

template <int HD>
static void launch_dec(at_args &x, int n_tiles, int max_ctx, cudaStream_t st, int n_sms, size_t ws_floats, int n,
                       int force, int kind_forced)
{
    int k = dec_kind(kind_forced);
    /* k_attn_fd: groups of up to 16 heads (one m-tile), head_dim 64 / 128 / 256 */
    constexpr bool fd_hd = HD == 64 || HD == 128 || HD == 256;
    if ((k == 4 || k == 5) && (!fd_hd || x.G > 16)) k = 3;
    if constexpr (fd_hd) {
        if (k == 4 || k == 5) {
            /* kind 4: the copy engine stages the KV where it can (blocks of a multiple of 16
             * slots); kind 5: cp.async always (comparisons, tests) */
            const bool tma = k == 4 && x.bs % 16 == 0 && fd_tma_maps(x, HD);
            if (x.rot && tma) launch_fd<HD, true, true>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force);
            else if (x.rot) launch_fd<HD, true, false>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force);
            else if (tma) launch_fd<HD, false, true>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force);
            else launch_fd<HD, false, false>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force);
            return;
        }
    }
    if (k == 2 || k == 3) kvs_cu_attn_tc_decode(x, HD, k, n_tiles, max_ctx, st, n_sms, ws_floats, n, force);
    else kvs_cu_attn_simt(x, HD, n_tiles, max_ctx, st, n_sms, ws_floats, n, force);
}

void kvs_cu_attn_decode(at_args &x, int hd, int n_tiles, int max_ctx, cudaStream_t st, int n_sms, size_t ws_floats,
                        int n, int force, int kind_forced)
{
    switch (hd) {
    case 16: launch_dec<16>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force, kind_forced); break;
    case 32: launch_dec<32>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force, kind_forced); break;
    case 64: launch_dec<64>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force, kind_forced); break;
    case 128: launch_dec<128>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force, kind_forced); break;
    default: launch_dec<256>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force, kind_forced); break;
    }
}
