/* cuda_attn_prefill_fa3.cu: k_attn_fa3, the FlashAttention-3-style Hopper prefill attention kernel
 * (sm_90a: wgmma, the copy engine, mbarriers, setmaxnreg), kinds 7 to 18 of the prefill choice
 * (cuda_attn_prefill_wg.cu), and kinds 19 to 25.
 *
 * A block owns 128 (token, head) rows of one sequence and one KV head, as k_attn_wg: 128 / G
 * consecutive tokens times the G query heads of the group (GQA packing). Three warpgroups:
 *  - warpgroup 0, the producer (setmaxnreg down to 56 registers): one warp stages each 128-key tile
 *    of K and of V into a ring of ST stages. A tile is 8 groups of 16 keys; with blocks of a
 *    multiple of 16 slots a group is 16 consecutive rows of the pool, which the copy engine moves
 *    as HD / 64 boxes of 16 rows x 64 columns (the tensor maps of k_attn_fd, 128-byte swizzle,
 *    written in the layout wgmma reads). A group with slots that are not read (past the block's
 *    valid slots, past the split's or the block's last key) is copied by cp.async instead, its
 *    unread keys zero-filled (0 x a NaN in the pool would poison P . V); the producer warp waits
 *    for those copies and fences them into the async proxy before it arrives. Each stage has a
 *    "full" mbarrier (the producer's arrival plus the copy engine's bytes) and an "empty" one (every
 *    consumer thread's arrival once its wgmma no longer reads the stage), for K and V apart. Kinds 13
 *    to 15 (SP): two producer warps, K's and V's, and one "empty" arrival a consumer warp.
 *  - warpgroups 1 and 2, the consumers (setmaxnreg up to 224), 64 rows each: Q (scaled by
 *    scale x log2 e, bf16) into shared memory, then per tile S = Q . K^T (wgmma, both from shared
 *    memory), the online softmax in registers, O += P . V (P from registers). FlashAttention-3's
 *    intra-warpgroup overlap: S(i) and P(i - 1) . V(i - 1) are issued together and the softmax of
 *    S(i) runs while the tensor cores do P . V. With PP (kinds 11, 12) the two warpgroups also take
 *    turns to issue their wgmma (named barriers, FlashAttention-3's ping-pong), so one's softmax
 *    runs under the other's products. Kind 12: persistent blocks (one an SM) walk the work items
 *    longest first, so the producer stages an item's first tiles while the consumers finish the last.
 * Kind 14 stages 3 tiles (225 KB of shared memory at head_dim 128); kind 16 runs 3 consumer
 * warpgroups (192 rows a block, 192 / G tokens) on 64-key tiles. Causal tile skipping: a block's keys
 * end at its last token; tiles that need no mask (wholly visible to every row of a warpgroup, no
 * unread slot) skip it. Blocks run longest first.
 * Deferred RoPE (R: rot offsets, LazyAttention's cached documents, keys stored at document-local
 * positions and attended as if rotated by their block's offset o, <q, R(o) k> = <R(-o) q, k>), in
 * kinds 14 and 19 to 25: the K producer publishes each 16-key group's offset with its keys read (a
 * group is one block's: blocks of a multiple of 16 slots). A consumer warpgroup keeps its Q tile
 * rotated backward by one offset; before a tile's S it rewrites Q (from the fp32 q, a cos / sin
 * table a warpgroup) when the tile's first read group has another offset, which inside a document
 * happens once, at its first tile. A tile with a document boundary inside it gets the groups of
 * the other offsets scored again after S by mma.sync from the same swizzled Q and K tiles, Q
 * rewritten per offset. The other kinds' rotated launches take k_attn_tc (cuda_attn_prefill.cu).
 * Kind 14 is the default prefill kernel on sm_90 (cuda_attn_prefill_wg.cu; measurements in
 * bench/RESULTS.md).
 * Ownership: nothing is allocated here (the launch goes through kvs_cu_attn_launch). Errors: CUDA
 * failures abort (CUDA_CHECK).
 */
#include "kernels/cuda/cuda_attn_wgmma.cuh"

#define FA_BAR_Q 1    /* named barriers 1 .. NC: a consumer warpgroup's Q is in shared memory */
#define FA_BAR_TURN 4 /* named barriers 4, 5: consumer warpgroup 0's / 1's turn to issue (PP) */

/* NC consumer warpgroups (64 rows each) and KN keys a tile; their registers: 56 for the producer
 * (40 spilled its loop, ptxas -v), and 224 for NC = 2 consumers (56 x 128 + 224 x 256 <= 64K), 144
 * for NC = 3 (56 x 128 + 144 x 384 <= 64K: no spill with 64-key tiles; 32 / 160 spilled) */
template <int HD, int ST, int NC = 2, int KN = 128, bool R = false>
struct fa_cfg {
    static constexpr int ROWS = NC * 64;                /* rows of a block */
    static constexpr int THREADS = (NC + 1) * 128;      /* the producer warpgroup + the consumers */
    static constexpr int CONSUMERS = NC * 128;
    static constexpr int NG = KN / 16;                  /* 16-key groups of a tile: a box (or cp.async group) each */
    static constexpr int PREGS = 56, CREGS = NC == 2 ? 224 : 144;
    static_assert(PREGS * 128 + CREGS * CONSUMERS <= 65536, "registers of an SM");
    static constexpr int QE = ROWS * HD; /* elements of the Q tile */
    static constexpr int TE = KN * HD;   /* elements of one K or V stage */
    static constexpr size_t k_off = (size_t)QE * sizeof(bf16);
    static constexpr size_t v_off = k_off + (size_t)ST * TE * sizeof(bf16);
    /* [ST][GVS]: the keys read of each group of the tile in the stage, then 1 if any group has
     * fewer than 16; with R (deferred rotation) then each group's rotation offset (a group with
     * no key read: the tile's first read group's) and 1 if every read group has the same one */
    static constexpr int GVS = R ? 2 * NG + 2 : NG + 1;
    static constexpr size_t gv_off = v_off + (size_t)ST * TE * sizeof(bf16);
    /* R: [NC][HD] each consumer warpgroup's cos (HD / 2), then sin (HD / 2) of its Q's rotation */
    static constexpr size_t rt_off = gv_off + (size_t)ST * GVS * sizeof(int);
    static constexpr size_t mb_off = (rt_off + (R ? (size_t)NC * HD * sizeof(float) : 0) + 7) / 8 * 8;
    /* a word that FX_SM's consumers store to and nobody reads (fa_softmax_done) */
    static constexpr size_t sink_off = mb_off + 4 * ST * sizeof(uint64_t);
    /* 1024: the swizzle atoms start on 1024-byte boundaries; dynamic shared memory is only known to
     * be 16-byte aligned */
    static constexpr size_t smem = 1024 + sink_off + 16;
    static_assert(smem <= 232448, "227 KB of shared memory a block (sm_90)");
};

__device__ __forceinline__ unsigned fa_smem(const void *p) { return (unsigned)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void fa_mbar_init(uint64_t *mb, unsigned count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(fa_smem(mb)), "r"(count) : "memory");
}

/* waits until the phase of parity `parity` of mb has completed */
__device__ __forceinline__ void fa_mbar_wait(uint64_t *mb, unsigned parity)
{
    unsigned done = 0;
    while (!done)
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     " selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(fa_smem(mb)), "r"(parity)
                     : "memory");
}

__device__ __forceinline__ void fa_mbar_arrive(uint64_t *mb)
{
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(fa_smem(mb)) : "memory");
}

__device__ __forceinline__ void fa_bar_sync(int id, int n)
{
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void fa_bar_arrive(int id, int n)
{
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}

/* The producer warp stages one half (K or V) of a tile into dst: groups whose 16 keys are all read
 * (bit g of whole) by the copy engine, the others by cp.async with their unread keys zeroed. Lane
 * g < KN / 16 holds group g's first pool row and its keys read (row, nv). gv (K only) receives
 * each group's keys read and the tile's short flag before the arrival that publishes them. */
template <int HD, int KN, bool R>
static __device__ __forceinline__ void fa_stage(const CUtensorMap *map, const bf16 *pool, bf16 *dst, uint64_t *full,
                                                int *gv, unsigned whole, int row, int nv, int ofs, int lane)
{
    constexpr int CH = HD / 8, NG = KN / 16; /* 16-byte chunks of a row, groups of a tile */
    const unsigned part = ((1u << NG) - 1) & ~whole;
    if (part) {
        /* rare: the tile's last groups, a cached document's short block */
        for (int g = 0; g < NG; g++) {
            const int grow = __shfl_sync(FULL, row, g), gnv = __shfl_sync(FULL, nv, g);
            if (!((part >> g) & 1)) continue; /* uniform across the warp */
            for (int idx = lane; idx < 16 * CH; idx += 32) {
                const int j = idx / CH, c = idx % CH;
                const bool ok = j < gnv;
                cp_async16(dst + sw128<KN>(g * 16 + j, c * 8), ok ? pool + (size_t)(grow + j) * HD + c * 8 : pool,
                           ok ? 16 : 0);
            }
        }
        cp_async_commit();
        cp_async_wait<0>();
        fence_proxy_async_smem(); /* the wgmma (async proxy) reads what cp.async wrote */
    }
    if (gv) {
        if (lane < NG) gv[lane] = nv;
        if (lane == 0) gv[NG] = part != 0;
        if (R) {
            /* lane g < NG's ofs: group g's rotation offset; groups with no key read take the first
             * read group's, so that they never split a tile that is otherwise of one document */
            const unsigned rd = __ballot_sync(FULL, lane < NG && nv > 0);
            const int ref = __shfl_sync(FULL, ofs, rd ? __ffs((int)rd) - 1 : 0);
            const bool same = __all_sync(FULL, !(lane < NG && nv > 0) || ofs == ref);
            if (lane < NG) gv[NG + 1 + lane] = nv > 0 ? ofs : ref;
            if (lane == 0) gv[2 * NG + 1] = same;
        }
    }
    __syncwarp();
    const unsigned bytes = (unsigned)__popc(whole) * 16u * HD * (unsigned)sizeof(bf16);
    if (lane == 0)
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(fa_smem(full)), "r"(bytes)
                     : "memory");
#pragma unroll
    for (int g = 0; g < NG; g++) {
        const int grow = __shfl_sync(FULL, row, g);
        if (lane == 0 && ((whole >> g) & 1)) {
#pragma unroll
            for (int b = 0; b < HD / 64; b++)
                asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, "
                             "%3}], [%4];\n" ::"r"(fa_smem(dst + sw128<KN>(g * 16, b * 64))),
                             "l"(map), "r"(b * 64), "r"(grow), "r"(fa_smem(full))
                             : "memory");
        }
    }
}

/* FX, the bits of kinds 22 to 25 (each a change to kind 14 that an A/B can take apart):
 *  FX_QF: the consumers' first Q load issues every global read of the warpgroup's rows before it
 *    converts any (kind 14's loop waits for each chunk's read in turn: 8 round trips to memory at
 *    head_dim 128 before the first S, in every block);
 *  FX_SM: the softmax step with each row's max and sum over 4 partial chains instead of one chain
 *    of 32 dependent operations, and all of it (every exp2, the row sums) finished before the wait
 *    for P(i - 1) . V(i - 1): ptxas otherwise hoists that wait (WARPGROUP.DEPBAR) above more than
 *    half of the exp2 (kind 14's SASS: 37 of 66; the split chains alone: 49 of 66), so the warp
 *    sits out the product and then does the rest of its softmax with the tensor cores idle on its
 *    side (fa_softmax_done). */
#define FX_QF 1
#define FX_SM 2
#define FX_SN 4 /* persistent blocks (PER) take their items in snake order: fa_item_at */

/* softmax_core (cuda_attn_wgmma.cuh) with each row's max and sum split over NP partial
 * accumulators: the same max (fmaxf is exact in any order), the sum in another order */
template <int KN>
__device__ __forceinline__ void fa_softmax_split(float *sc, float *m, float *l, float *alpha)
{
    constexpr int NP = 4;
    float mx[2][NP], ps[2][NP], mu[2];
#pragma unroll
    for (int h = 0; h < 2; h++)
#pragma unroll
        for (int p = 0; p < NP; p++) {
            mx[h][p] = -INFINITY;
            ps[h][p] = 0.0f;
        }
    /* sc[i]: row (i >> 1) & 1 of the thread's two; partial chain (i >> 2) % NP */
#pragma unroll
    for (int i = 0; i < KN / 2; i++) mx[(i >> 1) & 1][(i >> 2) % NP] = fmaxf(mx[(i >> 1) & 1][(i >> 2) % NP], sc[i]);
#pragma unroll
    for (int h = 0; h < 2; h++) {
        float x = fmaxf(fmaxf(mx[h][0], mx[h][1]), fmaxf(mx[h][2], mx[h][3]));
        x = fmaxf(x, __shfl_xor_sync(FULL, x, 1));
        x = fmaxf(x, __shfl_xor_sync(FULL, x, 2));
        const float mn = fmaxf(m[h], x);
        mu[h] = mn == -INFINITY ? 0.0f : mn; /* a row with nothing visible yet: exp2(-inf) = 0 */
        alpha[h] = ex2(m[h] - mu[h]);
        m[h] = mn;
    }
#pragma unroll
    for (int i = 0; i < KN / 2; i++) {
        const float p = ex2(sc[i] - mu[(i >> 1) & 1]);
        sc[i] = p;
        ps[(i >> 1) & 1][(i >> 2) % NP] += p;
    }
#pragma unroll
    for (int h = 0; h < 2; h++) l[h] = l[h] * alpha[h] + ((ps[h][0] + ps[h][1]) + (ps[h][2] + ps[h][3]));
}

/* FX_SM, right before the wait for P . V: a shared-memory store of a value that every exp2 of the
 * step feeds (the row sums) to a word nobody reads. ptxas keeps the store above the wait, so the
 * whole softmax stays there too (without it, kind 14's SASS has the wait above 37 of the 66 exp2,
 * and a branch on the sums instead made ptxas serialise the wgmma: C7512, 252 bytes of spill). One
 * 4-byte store a thread a tile; every thread of the block writes the same word. */
__device__ __forceinline__ void fa_softmax_done(const float *l, unsigned addr)
{
    asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(addr), "f"(l[0] + l[1]) : "memory");
}

/* the prefill tiles of a launch (find_tile's enumeration; the same in every lane) */
__device__ int fa_count_tiles(const at_args &a)
{
    const int lane = threadIdx.x & 31;
    int total = 0;
    for (int c = 0; c < a.n_seqs; c += 32) {
        const int s = c + lane;
        int cnt = 0;
        if (s < a.n_seqs) {
            const int ns = a.q_start[s + 1] - a.q_start[s];
            cnt = ns > 1 ? (ns + a.qt - 1) / a.qt : 0;
        }
        for (int o = 16; o > 0; o >>= 1) cnt += __shfl_xor_sync(FULL, cnt, o);
        total += cnt;
    }
    return total;
}

/* One work item: a prefill tile of 128 rows, one KV head, one context split (k0 .. k1). */
struct fa_item {
    int s, r0, kvh, split, qs, ntok, pos0, nr, k0, k1, ntiles;
};

/* Work item w of the block: PER (persistent blocks, no context splits): item w of n_items = tiles
 * x KV heads, tile n_tiles - 1 - w / n_kv (longest first) and KV head w % n_kv; otherwise the
 * block's own (w = 0). SN (FX_SN): block b takes items in snake order, round k's b-th item from
 * the front in even rounds and from the back in odd ones, so that over two rounds every block
 * gets about the same number of tiles (in plain order, block 0 takes the longest item of every
 * round: kind 19's 10% loss at 8K). False: no such tile. */
template <bool PER, int KN, bool SN = false>
static __device__ __forceinline__ bool fa_item_at(const at_args &a, int w, int n_items, fa_item &it)
{
    int tile;
    if (PER) {
        if (SN) {
            /* w = k x grid + b (the block's k-th item); round k has min(grid, n_items - k x grid)
             * items, and b is below that since w < n_items: a bijection of [0, n_items) */
            const int G = (int)gridDim.x, k = w / G, b = w - k * G, rn = min(G, n_items - k * G);
            w = k * G + ((k & 1) ? rn - 1 - b : b);
        }
        tile = n_items / a.n_kv - 1 - w / a.n_kv;
        it.kvh = w % a.n_kv;
        it.split = 0;
    } else {
        tile = (int)(gridDim.x - 1 - blockIdx.x);
        it.kvh = blockIdx.y;
        it.split = blockIdx.z;
    }
    if (!find_tile(a, tile, &it.s, &it.r0)) return false;
    it.qs = a.q_start[it.s];
    it.ntok = min(a.qt, a.q_start[it.s + 1] - it.qs - it.r0);
    it.pos0 = a.pos[it.s] + it.r0;
    it.nr = it.ntok * a.G;
    it.k0 = it.split * a.chunk;
    it.k1 = min(it.pos0 + it.ntok, it.k0 + a.chunk);
    it.ntiles = it.k1 > it.k0 ? (it.k1 - it.k0 + KN - 1) / KN : 0;
    return true;
}

template <int HD, int ST, bool PP, bool PER, bool TMA, bool OVL, bool SP, int NC, int KN, bool ER, bool SK, bool R,
          int FX>
__global__ void __launch_bounds__(fa_cfg<HD, ST, NC, KN>::THREADS, 1) k_attn_fa3(const __grid_constant__ at_args a)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    grid_dep_wait(); /* cuda_launch.h: q (and the K/V just written) are ready */
    typedef fa_cfg<HD, ST, NC, KN, R> C;
    static_assert(!PP || NC == 2, "ping-pong takes turns between two consumer warpgroups");
    static_assert(!R || (OVL && !ER), "the deferred rotation is in the overlapped form in the default issue order");
    static_assert(!(FX & FX_SM) || (OVL && !ER && !SK), "FX_SM is a step of the overlapped form's default order");
    constexpr int CH = HD / 8, NG = C::NG;
    extern __shared__ __align__(16) unsigned char smraw[];
    unsigned char *base = smraw + ((1024 - (fa_smem(smraw) & 1023)) & 1023);
    bf16 *sq = (bf16 *)base;                 /* [ROWS x HD] swizzled */
    bf16 *sk = (bf16 *)(base + C::k_off);    /* [ST][KN x HD] swizzled */
    bf16 *sv = (bf16 *)(base + C::v_off);    /* [ST][KN x HD] swizzled */
    int *gv = (int *)(base + C::gv_off);     /* [ST][GVS] */
    uint64_t *full_k = (uint64_t *)(base + C::mb_off), *full_v = full_k + ST, *empty_k = full_v + ST,
             *empty_v = empty_k + ST;

    const int tid = threadIdx.x, lane = tid & 31, wg = tid >> 7;
    const int n_items = PER ? fa_count_tiles(a) * a.n_kv : 1;
    const int w0 = PER ? (int)blockIdx.x : 0, wstep = PER ? (int)gridDim.x : 1;

    if (tid == 0) {
        for (int i = 0; i < ST; i++) {
            fa_mbar_init(full_k + i, 1);
            fa_mbar_init(full_v + i, 1);
            fa_mbar_init(empty_k + i, SP ? C::CONSUMERS / 32 : C::CONSUMERS);
            fa_mbar_init(empty_v + i, SP ? C::CONSUMERS / 32 : C::CONSUMERS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (wg == 0) {
        /* ---- producer ---- */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(C::PREGS));
        /* SP: warp 0 stages K, warp 1 V, so that K(q + 1), which the consumers need first, never
         * waits behind V(q)'s wait for the release of V(q - ST) (P . V of tile q - ST completes a
         * whole softmax later than its S) */
        if (tid >= (SP ? 64 : 32)) return;
        const bool do_k = !SP || tid < 32, do_v = !SP || tid >= 32;
        int gt = 0; /* tiles this block staged before the item: the ring position */
        for (int w = w0; w < n_items; w += wstep) {
        fa_item I;
        if (!fa_item_at<PER, KN, (FX & FX_SN) != 0>(a, w, n_items, I)) continue;
        const int s = I.s, kvh = I.kvh, k0 = I.k0, k1 = I.k1, ntiles = I.ntiles;
        const int32_t *bt = a.bt + (size_t)s * a.max_blocks;
        const int32_t *vt = a.valid ? a.valid + (size_t)s * a.max_blocks : nullptr;
        const int2 *wt = a.words ? a.words + (size_t)s * a.max_blocks : nullptr;
        const int32_t *rt = R ? a.rot + (size_t)s * a.max_blocks : nullptr;
        /* lane g < NG: group g of tile it, its first pool row ((block x n_kv + kvh) x bs +
         * slot; a group never straddles blocks, as bs is a multiple of 16 and tiles start on
         * multiples of 32), its keys read (a prefix of the group: slots below the block's valid
         * count, keys below k1) and (R) its block's rotation offset */
        auto look = [&](int it, int &row, int &nv, int &ofs) {
            row = 0;
            nv = 0;
            ofs = 0;
            const int p = k0 + it * KN + lane * 16;
            if (lane < NG && p < k1) {
                const int pb = p / a.bs, sl = p - pb * a.bs;
                int blk, lim = a.bs;
                if (wt) {
                    const int2 w = wt[pb]; /* backend.h kvs_pack_block_words: block, offset << 11 | valid */
                    blk = w.x;
                    lim = w.y & 2047;
                    if (R) ofs = w.y >> 11;
                } else {
                    blk = bt[pb];
                    if (vt) lim = vt[pb];
                    if (R) ofs = rt[pb];
                }
                nv = max(0, min(min(lim - sl, 16), k1 - p));
                row = (blk * a.n_kv + kvh) * a.bs + sl;
            }
        };
        int row, nv, ofs;
        look(0, row, nv, ofs);
        for (int it = 0; it < ntiles; it++) {
            const int q = gt + it, st = q % ST;
            const unsigned ph = (unsigned)(q / ST) & 1u;
            /* !TMA (a diagnostic form): every group by cp.async */
            const unsigned whole = TMA ? __ballot_sync(FULL, lane < NG && nv == 16) : 0u;
            if (do_k) {
                if (q >= ST) fa_mbar_wait(empty_k + st, ph ^ 1u); /* the consumers are done with ring tile q - ST */
                fa_stage<HD, KN, R>(&a.tm_k, a.kc, sk + st * C::TE, full_k + st, gv + st * C::GVS, whole, row, nv,
                                    ofs, lane);
            }
            if (do_v) {
                if (q >= ST) fa_mbar_wait(empty_v + st, ph ^ 1u);
                fa_stage<HD, KN, R>(&a.tm_v, a.vc, sv + st * C::TE, full_v + st, nullptr, whole, row, nv, ofs, lane);
            }
            if (it + 1 < ntiles) look(it + 1, row, nv, ofs); /* its loads overlap the wait for the next stage */
        }
        gt += ntiles;
        }
    } else {
        /* ---- consumers ---- */
        asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(C::CREGS));
        const int cw = wg - 1, ctid = tid & 127, warp = ctid >> 5, g = lane >> 2, t = lane & 3;
        /* PP: the warpgroups take turns over all the block's items (a turn passed at each item's
         * start and end instead could let warpgroup 1 arrive twice at barrier 3 before warpgroup 0
         * syncs once); warpgroup 0 issues first */
        if (PP && cw == 1) fa_bar_arrive(FA_BAR_TURN, 256);
        int gt = 0; /* tiles this block consumed before the item: the ring position */
        for (int w = w0; w < n_items; w += wstep) {
        fa_item I;
        if (!fa_item_at<PER, KN, (FX & FX_SN) != 0>(a, w, n_items, I)) continue;
        const int kvh = I.kvh, split = I.split, qs = I.qs, r0 = I.r0, pos0 = I.pos0, nr = I.nr, k0 = I.k0,
                  ntiles = I.ntiles;

        /* Q, this warpgroup's 64 rows (no wgmma of the warpgroup that reads them is in flight):
         * rows past nr are zero; the scale carries log2 e, so the softmax runs on exp2. R: rotated
         * backward by ofs (the deferred rotation of a cached document's keys, <q, R(o) k> =
         * <R(-o) q, k>: x0 cos + x1 sin for the first half of the dims, x1 cos - x0 sin for the
         * second, as rot_table / q_dim), from the fp32 q, with the angles of rot_table */
        const float qscale = a.scale * 1.4426950408889634f;
        auto load_q = [&](int ofs) {
            float *rtab = R ? (float *)(base + C::rt_off) + cw * HD : nullptr;
            if (R) {
                /* every warp of the warpgroup is past its reads of the previous Q and table */
                fa_bar_sync(FA_BAR_Q + cw, 128);
                if (ctid < HD / 2) {
                    float sn, cs;
                    sincosf((float)((double)ofs * (double)a.inv_freq[ctid]), &sn, &cs);
                    rtab[ctid] = cs;
                    rtab[HD / 2 + ctid] = sn;
                }
                fa_bar_sync(FA_BAR_Q + cw, 128);
            }
            if constexpr ((FX & FX_QF) && !R) {
                /* every read in flight at once (FX_QF): rows past nr are zero */
                constexpr int IT = 64 * CH / 128;
                float4 x[IT][2];
#pragma unroll
                for (int k = 0; k < IT; k++) {
                    const int idx = ctid + k * 128, r = cw * 64 + idx / CH, c = idx % CH;
                    x[k][0] = x[k][1] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                    if (r < nr) {
                        const float4 *qr = (const float4 *)(a.q + (((size_t)qs + r0 + r / a.G) * a.n_heads +
                                                                   (size_t)kvh * a.G + r % a.G) * HD + c * 8);
                        x[k][0] = __ldg(qr);
                        x[k][1] = __ldg(qr + 1);
                    }
                }
#pragma unroll
                for (int k = 0; k < IT; k++) {
                    const int idx = ctid + k * 128, r = cw * 64 + idx / CH, c = idx % CH;
                    uint4 v;
                    v.x = pack_bf16(x[k][0].x * qscale, x[k][0].y * qscale);
                    v.y = pack_bf16(x[k][0].z * qscale, x[k][0].w * qscale);
                    v.z = pack_bf16(x[k][1].x * qscale, x[k][1].y * qscale);
                    v.w = pack_bf16(x[k][1].z * qscale, x[k][1].w * qscale);
                    *(uint4 *)(sq + sw128<C::ROWS>(r, c * 8)) = v;
                }
            } else
            for (int idx = ctid; idx < 64 * CH; idx += 128) {
                const int r = cw * 64 + idx / CH, c = idx % CH;
                uint4 v = make_uint4(0u, 0u, 0u, 0u);
                if (r < nr) {
                    const float *qrow = a.q + (((size_t)qs + r0 + r / a.G) * a.n_heads + (size_t)kvh * a.G + r % a.G) * HD;
                    const float4 *qr = (const float4 *)(qrow + c * 8);
                    float4 x0 = __ldg(qr), x1 = __ldg(qr + 1);
                    if (R) {
                        /* the partner chunk (dims d +- HD / 2) and the angles of dims i0 .. i0 + 7 */
                        const bool lo = c < CH / 2;
                        const int i0 = (c % (CH / 2)) * 8;
                        const float4 *pr = (const float4 *)(qrow + (c ^ (CH / 2)) * 8);
                        const float4 p0 = __ldg(pr), p1 = __ldg(pr + 1);
                        const float x[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
                        const float pp[8] = {p0.x, p0.y, p0.z, p0.w, p1.x, p1.y, p1.z, p1.w};
                        float y[8];
#pragma unroll
                        for (int e = 0; e < 8; e++) {
                            const float cs = rtab[i0 + e], sn = rtab[HD / 2 + i0 + e];
                            y[e] = lo ? x[e] * cs + pp[e] * sn : x[e] * cs - pp[e] * sn;
                        }
                        x0 = make_float4(y[0], y[1], y[2], y[3]);
                        x1 = make_float4(y[4], y[5], y[6], y[7]);
                    }
                    v.x = pack_bf16(x0.x * qscale, x0.y * qscale);
                    v.y = pack_bf16(x0.z * qscale, x0.w * qscale);
                    v.z = pack_bf16(x1.x * qscale, x1.y * qscale);
                    v.w = pack_bf16(x1.z * qscale, x1.w * qscale);
                }
                *(uint4 *)(sq + sw128<C::ROWS>(r, c * 8)) = v;
            }
            fence_proxy_async_smem();
            fa_bar_sync(FA_BAR_Q + cw, 128);
        };
        /* R: the offset Q is rotated by; KEY_PAD: none yet (Q is written at the first tile, with
         * that tile's offset) */
        int cur_rot = KEY_PAD;
        if (!R) load_q(0);

        /* this thread's rows rw and rw + 8 (the accumulator layout of m64nNk16), the last key each
         * sees (-1: a padding row, which sees nothing), and its warpgroup's first visible key limit */
        const int rw = cw * 64 + warp * 16 + g;
        int lim[2];
#pragma unroll
        for (int h = 0; h < 2; h++) lim[h] = rw + 8 * h < nr ? pos0 + (rw + 8 * h) / a.G : -1;
        const int wlo = pos0 + (cw * 64) / a.G;

        float o[HD / 2], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
#pragma unroll
        for (int i = 0; i < HD / 2; i++) o[i] = 0.0f;
        const uint64_t qdesc = wg_desc(sq + cw * 64 * 64, 16, 1024);

        /* the mask of tile it in stage st, read before the stage is released: the keys read of
         * each group (the producer rewrites them for tile it + ST) */
        auto mask_scores = [&](float *sc, int it, int st) {
            const int *gs = gv + st * C::GVS;
            const int kb = k0 + it * KN;
            if (kb + KN - 1 > wlo || gs[NG]) {
                int gn[NG];
#pragma unroll
                for (int q = 0; q < NG; q++) gn[q] = gs[q];
#pragma unroll
                for (int j = 0; j < KN / 8; j++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int col = j * 8 + 2 * t + (e & 1);
                        if ((col & 15) >= gn[j >> 1] || kb + col > lim[e >> 1]) sc[j * 4 + e] = -INFINITY;
                    }
            }
        };
        /* a consumer's release of a stage: SP, one arrival a warp (its lanes' wgmma and mask reads
         * are done: wgmma.wait_group, __syncwarp), else one a thread */
        auto release = [&](uint64_t *mb) {
            if (SP) {
                __syncwarp();
                if (lane == 0) fa_mbar_arrive(mb);
            } else {
                fa_mbar_arrive(mb);
            }
        };
        /* R, before S of the tile in stage st is issued (its K is in, no wgmma of the warpgroup in
         * flight): Q rotated by the tile's first read group's offset (every group's but at a
         * document boundary inside the tile). The S issue itself stays unconditional: S issued
         * in a branch, or into the scores' registers group by group, made ptxas serialise every
         * wgmma of the kernel (C7511). */
        auto rot_pre = [&](int st) {
            const int o = gv[st * C::GVS + NG + 1];
            if (o != cur_rot) {
                load_q(o);
                cur_rot = o;
            }
        };
        /* R, once S of the tile in stage st is complete (P . V of the previous tile may still
         * run: it reads neither Q nor K): at a document boundary inside the tile, the groups of
         * other offsets are scored again, Q rewritten at each change of offset. mma.sync
         * (m16n8k16: the same per-warp layout as the wgmma accumulator, a warp's 16 rows x 8 keys),
         * Q and K read from their swizzled tiles: a wgmma here, even into registers of its own,
         * made ptxas serialise every wgmma of the kernel (C7511). Groups with no key read are left
         * alone: the mask sets their scores (gs[NG], a short group). */
        auto rot_fix = [&](float *sc, int st) {
            const int *gs = gv + st * C::GVS;
            if (gs[2 * NG + 1]) return;
            const int o0 = gs[NG + 1], qr = rw; /* this thread's first row of the Q tile */
            const bf16 *tk = sk + st * C::TE;
#pragma unroll
            for (int gg = 1; gg < NG; gg++) {
                const int o = gs[NG + 1 + gg];
                if (gs[gg] == 0 || o == o0) continue;
                if (o != cur_rot) {
                    load_q(o);
                    cur_rot = o;
                }
                float *c8 = sc + 8 * gg;
#pragma unroll
                for (int i = 0; i < 8; i++) c8[i] = 0.0f;
#pragma unroll
                for (int ks = 0; ks < HD / 16; ks++) {
                    const int d = ks * 16 + 2 * t;
                    uint32_t af[4];
                    af[0] = *(const uint32_t *)(sq + sw128<C::ROWS>(qr, d));
                    af[1] = *(const uint32_t *)(sq + sw128<C::ROWS>(qr + 8, d));
                    af[2] = *(const uint32_t *)(sq + sw128<C::ROWS>(qr, d + 8));
                    af[3] = *(const uint32_t *)(sq + sw128<C::ROWS>(qr + 8, d + 8));
#pragma unroll
                    for (int j = 0; j < 2; j++) {
                        const int key = gg * 16 + j * 8 + g;
                        mma_bf16(c8 + j * 4, af, *(const uint32_t *)(tk + sw128<KN>(key, d)),
                                 *(const uint32_t *)(tk + sw128<KN>(key, d + 8)));
                    }
                }
            }
        };
        auto turn_wait = [&]() {
            if (PP) fa_bar_sync(FA_BAR_TURN + cw, 256);
        };
        auto turn_pass = [&]() {
            if (PP) fa_bar_arrive(FA_BAR_TURN + 1 - cw, 256);
        };

        if (!OVL) {
            /* the serial form (a diagnostic): S, softmax, P . V one after the other per tile */
            for (int it = 0; it < ntiles; it++) {
                const int q = gt + it, st = q % ST;
                const unsigned ph = (unsigned)(q / ST) & 1u;
                float sc[KN / 2], alpha[2];
                uint32_t pa[KN / 16][4];
                fa_mbar_wait(full_k + st, ph);
                fa_mbar_wait(full_v + st, ph);
                turn_wait();
                wg_fence();
                qk_issue<HD, KN, C::ROWS>(sc, qdesc, wg_desc(sk + st * C::TE, 16, 1024));
                wg_commit();
                turn_pass();
                wg_wait_group<0>();
#pragma unroll
                for (int i = 0; i < KN / 2; i++) wg_reg_fence(sc[i]);
                mask_scores(sc, it, st);
                release(empty_k + st);
                softmax_core<KN>(sc, m, l, alpha);
#pragma unroll
                for (int i = 0; i < HD / 2; i++) o[i] *= alpha[(i >> 1) & 1];
                pack_p<KN>(sc, pa);
#pragma unroll
                for (int i = 0; i < HD / 2; i++) wg_reg_fence(o[i]);
                turn_wait();
                wg_fence();
                pv_issue<HD, KN>(o, pa, wg_desc(sv + st * C::TE, KN * 128, 1024));
                wg_commit();
                turn_pass();
                wg_wait_group<0>();
#pragma unroll
                for (int i = 0; i < HD / 2; i++) wg_reg_fence(o[i]);
                release(empty_v + st);
            }
        } else if (ntiles > 0) {
            float sc[KN / 2], alpha[2];
            uint32_t pa[KN / 16][4];
            /* tile 0: S alone */
            const int st0 = gt % ST;
            fa_mbar_wait(full_k + st0, (unsigned)(gt / ST) & 1u);
            if constexpr (R) rot_pre(st0);
            turn_wait();
            wg_fence();
            qk_issue<HD, KN, C::ROWS>(sc, qdesc, wg_desc(sk + st0 * C::TE, 16, 1024));
            wg_commit();
            turn_pass();
            wg_wait_group<0>();
#pragma unroll
            for (int i = 0; i < KN / 2; i++) wg_reg_fence(sc[i]);
            if constexpr (R) rot_fix(sc, st0);
            mask_scores(sc, 0, st0);
            release(empty_k + st0);
            if constexpr ((FX & FX_SM) != 0) fa_softmax_split<KN>(sc, m, l, alpha);
            else softmax_core<KN>(sc, m, l, alpha);
            pack_p<KN>(sc, pa);
            for (int it = 1; it < ntiles; it++) {
                const int q = gt + it, st = q % ST, pst = (q - 1) % ST;
                fa_mbar_wait(full_k + st, (unsigned)(q / ST) & 1u);
                if constexpr (ER) {
                    /* FlashAttention-3's order: S(it) is issued as soon as K(it) is in, O's rescale for
                     * tile it - 1's max runs under it (O is in no wgmma: P(it - 2) . V(it - 2) is
                     * complete), then P(it - 1) . V(it - 1) once V(it - 1) is in */
                    turn_wait();
                    wg_fence();
                    qk_issue<HD, KN, C::ROWS>(sc, qdesc, wg_desc(sk + st * C::TE, 16, 1024));
                    wg_commit();
#pragma unroll
                    for (int i = 0; i < HD / 2; i++) o[i] *= alpha[(i >> 1) & 1];
                    fa_mbar_wait(full_v + pst, (unsigned)((q - 1) / ST) & 1u);
#pragma unroll
                    for (int i = 0; i < HD / 2; i++) wg_reg_fence(o[i]);
                    wg_fence();
                    pv_issue<HD, KN>(o, pa, wg_desc(sv + pst * C::TE, KN * 128, 1024));
                    wg_commit();
                    turn_pass();
                } else {
                    if constexpr (R) rot_pre(st); /* no wgmma in flight yet */
                    fa_mbar_wait(full_v + pst, (unsigned)((q - 1) / ST) & 1u);
                    turn_wait();
#pragma unroll
                    for (int i = 0; i < HD / 2; i++) wg_reg_fence(o[i]);
                    wg_fence();
                    qk_issue<HD, KN, C::ROWS>(sc, qdesc, wg_desc(sk + st * C::TE, 16, 1024));
                    wg_commit();
                    pv_issue<HD, KN>(o, pa, wg_desc(sv + pst * C::TE, KN * 128, 1024));
                    wg_commit();
                    turn_pass();
                }
                wg_wait_group<1>(); /* S is done; P . V may still run */
#pragma unroll
                for (int i = 0; i < KN / 2; i++) wg_reg_fence(sc[i]);
                if constexpr (R) rot_fix(sc, st);
                mask_scores(sc, it, st);
                release(empty_k + st);
                if constexpr ((FX & FX_SM) != 0) {
                    fa_softmax_split<KN>(sc, m, l, alpha);
                    fa_softmax_done(l, fa_smem(base + C::sink_off));
                } else {
                    softmax_core<KN>(sc, m, l, alpha);
                }
                wg_wait_group<0>(); /* P(it - 1) . V(it - 1) is done: O and pa may change */
                release(empty_v + pst);
#pragma unroll
                for (int i = 0; i < HD / 2; i++) wg_reg_fence(o[i]);
                /* SK: the rescale is skipped where no row of the warp has a new max (every alpha is
                 * exactly 1: exp2(0)), so O is what the multiply would leave */
                if (!ER && (!SK || __any_sync(FULL, alpha[0] != 1.0f || alpha[1] != 1.0f))) {
#pragma unroll
                    for (int i = 0; i < HD / 2; i++) o[i] *= alpha[(i >> 1) & 1];
                }
                pack_p<KN>(sc, pa);
            }
            if constexpr (ER) {
#pragma unroll
                for (int i = 0; i < HD / 2; i++) o[i] *= alpha[(i >> 1) & 1];
            }
            const int ql = gt + ntiles - 1, lst = ql % ST;
            fa_mbar_wait(full_v + lst, (unsigned)(ql / ST) & 1u);
            turn_wait();
#pragma unroll
            for (int i = 0; i < HD / 2; i++) wg_reg_fence(o[i]);
            wg_fence();
            pv_issue<HD, KN>(o, pa, wg_desc(sv + lst * C::TE, KN * 128, 1024));
            wg_commit();
            turn_pass();
            wg_wait_group<0>();
#pragma unroll
            for (int i = 0; i < HD / 2; i++) wg_reg_fence(o[i]);
            release(empty_v + lst);
        }

        wg_store_rows<HD>(a, o, m, l, rw, nr, t, qs, r0, kvh, split);
        gt += ntiles;
        }
        /* PP: warpgroup 1's last pass (or its first, with no tiles) is taken here, so that no
         * named barrier is left half-arrived */
        if (PP && cw == 0) fa_bar_sync(FA_BAR_TURN, 256);
    }
#else
    __trap(); /* built for another architecture: kvs_cu_attn_prefill_kind never picks it there */
#endif
}

template <int HD, int ST, bool PP, bool PER, bool TMA = true, bool OVL = true, bool SP = false, int NC = 2,
          int KN = 128, bool ER = false, bool SK = false, bool R = false, int FX = 0>
static void launch_fa(at_args &x, int n_tiles, int max_ctx, cudaStream_t st, int n_sms, size_t ws_floats, int n,
                      int force)
{
    typedef fa_cfg<HD, ST, NC, KN, R> C;
    static kvs_cu_resident resident;
    /* as launch_tc (cuda_attn_prefill.cu): causal tiles do unequal work, so once they cover the SMs
     * the context is not split */
    if (force <= 0 && (long long)n_tiles * x.n_kv >= n_sms) force = 1;
    if (PER && force == 1) {
        /* persistent: one block an SM walks the items, so the producer stages the next item's
         * first tiles while the consumers finish the last one's */
        auto kern = k_attn_fa3<HD, ST, PP, PER, TMA, OVL, SP, NC, KN, ER, SK, R, FX>;
        int *res = kvs_cu_resident_here(resident);
        if (!*res) {
            CUDA_CHECK(cudaFuncSetAttribute((const void *)kern, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            (int)C::smem));
            *res = 1;
        }
        x.chunk = (max_ctx + AT_TILE - 1) / AT_TILE * AT_TILE;
        x.n_splits = 1;
        const long long items = (long long)n_tiles * x.n_kv;
        const unsigned grid = (unsigned)(items < n_sms ? items : n_sms);
        CUDA_CHECK(kvs_cu_launch(kern, dim3(grid), dim3(C::THREADS), C::smem, st, x));
        CUDA_CHECK(cudaGetLastError());
        return;
    }
    static kvs_cu_resident resident_np;
    kvs_cu_attn_launch(k_attn_fa3<HD, ST, PP, false, TMA, OVL, SP, NC, KN, ER, SK, R, FX>, C::THREADS, C::smem,
                       kvs_cu_resident_here(resident_np), x, n_tiles, max_ctx, st, n_sms, ws_floats, n, HD, force,
                       KN);
}

/* Kind 7: the FlashAttention-3 form (copy engine, overlap, 2 stages); 8: cp.async staging only
 * (no copy engine); 9: the copy engine with the serial consumer (no overlap); 10: neither; 11:
 * kind 7 with ping-pong; 12: kind 11 with persistent blocks (where the context is not split);
 * 13: kind 7 with K and V staged by two producer warps (SP) and one release a consumer warp; 14:
 * kind 13 in 3 stages; 15: kind 13 with ping-pong; 16: kind 13 with 3 consumer warpgroups (192
 * rows a block, so each staged K / V byte serves 1.5x the rows) and 64-key tiles in 4 stages
 * (their registers allow no more); 17 and 18: kinds 14 and 16 with FlashAttention-3's order (ER:
 * S issued before V is waited for, O rescaled while S runs); 19: kind 14 with persistent blocks
 * (the producer stages an item's first tiles while the consumers finish the previous item); 20:
 * kind 14 that skips O's rescale where no row of a warp has a new max (SK: exact, the factors
 * are then 1); 21: kind 19 with kind 20's skip; 22: kind 14 with FX_QF and FX_SM (every Q read in
 * flight at once, the softmax in shorter chains and done before the P . V wait); 23: kind 22 with
 * ping-pong; 24: kind 14 with FX_QF only; 25: kind 22 with persistent blocks that take their items
 * in snake order (FX_SN). 8 to 10 are diagnostic forms: they tell apart the
 * staging and the consumer pipeline.
 * The deferred rotation (x.rot: cached documents' keys stored at document-local positions, R) is
 * built into kinds 14 and 19 to 25 (kvs_cu_attn_prefill_kind gives the other kinds' launches
 * with rotation offsets to k_attn_tc); without tensor maps, kind 14's rotating form stages every
 * group by cp.async (TMA false) rather than hand the launch to k_attn_wg, which cannot rotate. */
template <int HD, bool R>
static void launch_fa_rot(at_args &x, int kind, bool tma, int n_tiles, int max_ctx, cudaStream_t st, int n_sms,
                          size_t ws_floats, int n, int force)
{
    if constexpr (R) {
        if (!tma) {
            launch_fa<HD, 3, false, false, false, true, true, 2, 128, false, false, R>(x, n_tiles, max_ctx, st, n_sms,
                                                                                      ws_floats, n, force);
            return;
        }
    }
    switch (kind) {
    case 19:
        launch_fa<HD, 3, false, true, true, true, true, 2, 128, false, false, R>(x, n_tiles, max_ctx, st, n_sms,
                                                                                ws_floats, n, force);
        break;
    case 20:
        launch_fa<HD, 3, false, false, true, true, true, 2, 128, false, true, R>(x, n_tiles, max_ctx, st, n_sms,
                                                                                ws_floats, n, force);
        break;
    case 21:
        launch_fa<HD, 3, false, true, true, true, true, 2, 128, false, true, R>(x, n_tiles, max_ctx, st, n_sms,
                                                                               ws_floats, n, force);
        break;
    case 22:
        launch_fa<HD, 3, false, false, true, true, true, 2, 128, false, false, R, FX_QF | FX_SM>(
            x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force);
        break;
    case 23:
        launch_fa<HD, 3, true, false, true, true, true, 2, 128, false, false, R, FX_QF | FX_SM>(
            x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force);
        break;
    case 24:
        launch_fa<HD, 3, false, false, true, true, true, 2, 128, false, false, R, FX_QF>(x, n_tiles, max_ctx, st,
                                                                                        n_sms, ws_floats, n, force);
        break;
    case 25:
        launch_fa<HD, 3, false, true, true, true, true, 2, 128, false, false, R, FX_QF | FX_SM | FX_SN>(
            x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force);
        break;
    default: /* 14 */
        launch_fa<HD, 3, false, false, true, true, true, 2, 128, false, false, R>(x, n_tiles, max_ctx, st, n_sms,
                                                                                 ws_floats, n, force);
        break;
    }
}

template <int HD>
static void launch_fa_kind(at_args &x, int kind, int n_tiles, int max_ctx, cudaStream_t st, int n_sms,
                           size_t ws_floats, int n, int force)
{
    switch (kind) {
    case 7: launch_fa<HD, 2, false, false>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force); break;
    case 8: launch_fa<HD, 2, false, false, false, true>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force); break;
    case 9: launch_fa<HD, 2, false, false, true, false>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force); break;
    case 10: launch_fa<HD, 2, false, false, false, false>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force); break;
    case 11: launch_fa<HD, 2, true, false>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force); break;
    case 12: launch_fa<HD, 2, true, true>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force); break;
    case 13: launch_fa<HD, 2, false, false, true, true, true>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force); break;
    case 15: launch_fa<HD, 2, true, false, true, true, true>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force); break;
    case 16: launch_fa<HD, 4, false, false, true, true, true, 3, 64>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force);
        break;
    case 17:
        launch_fa<HD, 3, false, false, true, true, true, 2, 128, true>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force);
        break;
    case 18:
        launch_fa<HD, 4, false, false, true, true, true, 3, 64, true>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force);
        break;
    default: /* 14, 19 to 25 */
        launch_fa_rot<HD, false>(x, kind, true, n_tiles, max_ctx, st, n_sms, ws_floats, n, force);
        break;
    }
}

bool kvs_cu_attn_fa3_rotates(int kind) { return kind == 14 || kind >= 19; }

bool kvs_cu_attn_prefill_fa3(at_args &x, int kind, int hd, int n_tiles, int max_ctx, cudaStream_t st, int n_sms,
                             size_t ws_floats, int n, int force)
{
    KVS_ASSERT(kind >= 7 && kind <= 25);
    if (x.rot) {
        /* the plan (cuda_attention.cu) gives k_attn_fa3 launches with rotation offsets only in its
         * rotating kinds, at head_dim 64 / 128, with blocks of a multiple of 16 slots */
        KVS_ASSERT(kvs_cu_attn_fa3_rotates(kind) && (hd == 64 || hd == 128) && x.bs % 16 == 0 && x.inv_freq);
        KVS_ASSERT(x.kv_rows < INT_MAX);
        const bool tma = fd_tma_maps(x, hd);
        if (hd == 128) launch_fa_rot<128, true>(x, kind, tma, n_tiles, max_ctx, st, n_sms, ws_floats, n, force);
        else launch_fa_rot<64, true>(x, kind, tma, n_tiles, max_ctx, st, n_sms, ws_floats, n, force);
        return true;
    }
    if ((hd != 64 && hd != 128) || x.bs % 16 != 0 || x.kv_rows >= INT_MAX || !fd_tma_maps(x, hd)) {
        /* kinds 16 and 18's tiles of 192 rows have no other kernel (the plan gives them blocks of a
         * multiple of 16 slots only); they are chosen only on request (kvs_cuda_set_pre_attn,
         * KVS_CUDA_PRE_ATTN) */
        if (kind == 16 || kind == 18)
            kvs_panic(__FILE__, __LINE__, "cuda attention: prefill kind %d needs the copy engine's tensor maps", kind);
        return false;
    }
    if (hd == 128) launch_fa_kind<128>(x, kind, n_tiles, max_ctx, st, n_sms, ws_floats, n, force);
    else launch_fa_kind<64>(x, kind, n_tiles, max_ctx, st, n_sms, ws_floats, n, force);
    return true;
}
