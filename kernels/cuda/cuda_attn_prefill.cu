/* cuda_attn_prefill.cu: k_attn_tc, the tensor-core attention kernel (FlashAttention-2 style,
 * mma.sync; the pieces are in cuda_attn_device.cuh), and its launchers.
 *
 * Prefill tiles (sequences with more than one query row): a block of PRE_WARPS warps owns up to
 * 64 / G consecutive tokens of one sequence, 64 (token, head) rows that share every staged K/V
 * tile; K/V stream in 32-key tiles with cp.async, two in flight. The same kernel with one warp a
 * block (16 or 32 rows, of which the G query heads of a group are live) takes decode rows that
 * the decode kernel (cuda_attn_decode.cu) does not: groups of more than 16 heads, head_dim 16 /
 * 32, or KVS_CUDA_DEC_ATTN=2 / 3 (2 or 3 tiles in flight).
 * Deferred RoPE (ROT): the q fragments are rotated backward in registers at document boundaries
 * (cuda_attention.cu's header comment), so shared memory holds only the K/V stages.
 */
#include "kernels/cuda/cuda_attn_device.cuh"

template <int HD, int NW, int MT, int ST, bool ROT>
struct tc_cfg {
    static constexpr int ROWS = NW * 16 * MT;
    static constexpr int KST = HD + 8;
    static constexpr size_t kv_elems = (size_t)ST * AT_TILE * KST;
    static constexpr size_t smem =
        2 * kv_elems * sizeof(bf16) + (ROT ? HD : 0) * sizeof(float) + (size_t)ST * AT_TILE * sizeof(int);
};

template <int HD, int NW, int MT, int ST, bool ROT>
__global__ void __launch_bounds__(NW * 32) k_attn_tc(at_args a)
{
    grid_dep_wait(); /* cuda_launch.h: q (and the K/V just written) are ready */
    typedef tc_cfg<HD, NW, MT, ST, ROT> C;
    constexpr int KST = C::KST, NT = NW * 32;
    extern __shared__ __align__(16) unsigned char smraw[];
    bf16 *sk = (bf16 *)smraw;
    bf16 *sv = sk + C::kv_elems;
    float *rtab = (float *)(sv + C::kv_elems); /* ROT: [HD] cos, sin of the current rotation */
    int *soff = (int *)(rtab + (ROT ? HD : 0)); /* [ST][AT_TILE] per key: rotation offset or KEY_PAD */

    int s, r0;
    const int tile = a.tile0 + blockIdx.x;
    if (!find_tile(a, tile, &s, &r0)) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int kvh = blockIdx.y, split = blockIdx.z;
    const int qs = a.q_start[s], ntok = min(a.qt, a.q_start[s + 1] - qs - r0);
    const int pos0 = a.pos[s] + r0;
    const int nr = ntok * a.G;
    int k0, k1;
    at_split_keys(a, split, pos0 + ntok, &k0, &k1);
    const int32_t *bt = a.bt + (size_t)s * a.max_blocks;
    const int32_t *vt = a.valid ? a.valid + (size_t)s * a.max_blocks : nullptr;
    const int32_t *rt = ROT ? a.rot + (size_t)s * a.max_blocks : nullptr;
    const int2 *wt = a.words ? a.words + (size_t)s * a.max_blocks : nullptr;

    auto lookup = [=](int it) { return tile_lookup<HD>(a, k0 + it * AT_TILE, k1, kvh, bt, vt, rt, wt); };
    auto issue = [=](const tile_meta &tm, int it) {
        const size_t so = (size_t)(it % ST) * AT_TILE;
        tile_issue<HD, NT>(a, tm, sk + so * KST, sv + so * KST, KST, soff + so);
    };

    const int ntiles = k1 > k0 ? (k1 - k0 + AT_TILE - 1) / AT_TILE : 0;
#pragma unroll
    for (int st = 0; st < ST - 1; st++) {
        if (st < ntiles) issue(lookup(st), st);
        cp_async_commit();
    }
    /* decode blocks: the metadata of the next tile to stage, looked up one iteration early */
    tile_meta next = {};
    if (NW == 1) next = lookup(ST - 1);

    const int wrow = warp * 16 * MT; /* the warp's first row */
    uint32_t qa[MT][HD / 16][4];
    q_frags<HD, MT>(a, qs, r0, kvh, nr, wrow, lane, nullptr, qa);
    int cur_rot = 0;                 /* the offset qa is rotated by */
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
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            m[mt][h] = -INFINITY;
            l[mt][h] = 0.0f;
        }
#pragma unroll
        for (int nd = 0; nd < HD / 8; nd++)
#pragma unroll
            for (int e = 0; e < 4; e++) o[mt][nd][e] = 0.0f;
    }
    /* the token index (within the tile) of this thread's two rows per m-tile, for the causal mask */
    int rtok[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int r = wrow + mt * 16 + g + 8 * h;
            rtok[mt][h] = r < nr ? r / a.G : -1 - pos0; /* padding rows see nothing */
        }

    for (int it = 0; it < ntiles; it++) {
        if (NW == 1) {
            if (it + ST - 1 < ntiles) issue(next, it + ST - 1);
            cp_async_commit();
            next = lookup(it + ST); /* its loads overlap this tile's wait and compute; past k1 none */
        } else {
            if (it + ST - 1 < ntiles) issue(lookup(it + ST - 1), it + ST - 1);
            cp_async_commit();
        }
        cp_async_wait<ST - 1>();
        __syncthreads();
        const bf16 *tk = sk + (size_t)(it % ST) * AT_TILE * KST;
        const bf16 *tv = sv + (size_t)(it % ST) * AT_TILE * KST;
        const int kb = k0 + it * AT_TILE;
        const int *ko = soff + (it % ST) * AT_TILE;
        float sc[MT][4][4];
        if constexpr (!ROT) {
            qk_tc<HD, MT>(tk, qa, sc, lane);
        } else {
            /* inside a document every key has the offset qa is rotated by; lane l tests key l (the
             * offsets come from shared memory: every warp takes the same branches) */
            const int myoff = ko[lane];
            if (__all_sync(FULL, myoff == cur_rot || myoff == KEY_PAD)) {
                qk_tc<HD, MT>(tk, qa, sc, lane);
            } else {
                /* one pass per distinct offset in the tile: S for the whole tile, kept for its keys */
                qk_by_offset<HD, MT>(tk, ko, myoff, cur_rot, [&](int ofs) {
                    rot_table(rtab, HD, ofs, a.inv_freq);
                    rotate_frags<HD, MT>(q0, rtab, lane, qa);
                }, qa, sc, lane);
            }
        }
        /* masks and the online softmax, then O += P . V */
        uint32_t pa[MT][2][4]; /* P as A fragments: [m-tile][k-step of 16 keys][4] */
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            const int lim[2] = {pos0 + rtok[mt][0], pos0 + rtok[mt][1]}; /* last visible key of each row */
            softmax_tile<HD, NW == 1>(sc[mt], ko, kb, lim, m[mt], l[mt], o[mt], pa[mt], lane);
        }
        pv_tile<HD, MT>(tv, KST, pa, o, lane);
        __syncthreads(); /* the stage buffer is reloaded next iteration */
    }
    cp_async_wait<0>();

#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float ls = l[mt][h];
            ls += __shfl_xor_sync(FULL, ls, 1);
            ls += __shfl_xor_sync(FULL, ls, 2);
            const int row = wrow + mt * 16 + g + 8 * h;
            if (row >= nr) continue;
            const size_t tq = (size_t)qs + r0 + row / a.G;
            const size_t orow = tq * a.n_heads + (size_t)kvh * a.G + row % a.G;
            if (at_direct(a)) {
                float *op = a.out + orow * HD + 2 * t;
                bf16 *oh = a.outh ? a.outh + orow * HD + 2 * t : nullptr;
#pragma unroll
                for (int nd = 0; nd < HD / 8; nd++) {
                    const float v0 = o[mt][nd][2 * h] / ls, v1 = o[mt][nd][2 * h + 1] / ls;
                    op[nd * 8] = v0;
                    op[nd * 8 + 1] = v1;
                    if (oh) *(__nv_bfloat162 *)(oh + nd * 8) = __floats2bfloat162_rn(v0, v1);
                }
            } else {
                float *pp = a.part + (at_part_row(a, tile, kvh * a.G + row % a.G, orow) * a.n_splits + split) *
                                         (size_t)(HD + 2);
#pragma unroll
                for (int nd = 0; nd < HD / 8; nd++) {
                    pp[nd * 8 + 2 * t] = o[mt][nd][2 * h];
                    pp[nd * 8 + 2 * t + 1] = o[mt][nd][2 * h + 1];
                }
                if (t == 0) {
                    pp[HD] = m[mt][h];
                    pp[HD + 1] = ls;
                }
            }
        }
}

/* the tensor-core kernel: NW warps of MT m-tiles of 16 rows, ST K/V tiles in flight */
template <int HD, int NW, int MT, int ST, bool ROT>
static void launch_tc(at_args &x, int n_tiles, int max_ctx, cudaStream_t st, int n_sms, size_t ws_floats, int n,
                      int force)
{
    static kvs_cu_resident resident;
    /* Causal prefill tiles do unequal work (a tile's keys grow with its position), so splitting
     * contexts to fill whole waves does not pay once the tiles alone cover the SMs (measured:
     * bench/RESULTS.md, "Attention design measurements"). Fewer tiles than SMs (a short suffix
     * over a long cached context) still split. */
    if (force <= 0 && (long long)n_tiles * x.n_kv >= n_sms) force = 1;
    kvs_cu_attn_launch(k_attn_tc<HD, NW, MT, ST, ROT>, NW * 32, tc_cfg<HD, NW, MT, ST, ROT>::smem, kvs_cu_resident_here(resident), x,
                       n_tiles, max_ctx, st, n_sms, ws_floats, n, HD, force);
}

/* prefill tiles: PRE_WARPS warps of 16 rows, 2 K/V tiles in flight */
template <int HD>
static void launch_tc_hd(at_args &x, int n_tiles, int max_ctx, cudaStream_t st, int n_sms, size_t ws_floats, int n,
                         int force)
{
    if (x.rot) launch_tc<HD, PRE_WARPS, 1, 2, true>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force);
    else launch_tc<HD, PRE_WARPS, 1, 2, false>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force);
}

/* decode rows: one warp a block, 16 (G <= 16) or 32 rows of which G are live, ST K/V tiles in
 * flight */
template <int HD, int ST>
static void launch_tc_dec(at_args &x, int n_tiles, int max_ctx, cudaStream_t st, int n_sms, size_t ws_floats, int n,
                          int force)
{
    if (x.G <= 16) {
        if (x.rot) launch_tc<HD, 1, 1, ST, true>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force);
        else launch_tc<HD, 1, 1, ST, false>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force);
    } else {
        if (x.rot) launch_tc<HD, 1, 2, ST, true>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force);
        else launch_tc<HD, 1, 2, ST, false>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force);
    }
}

void kvs_cu_attn_prefill(at_args &x, int hd, int n_tiles, int max_ctx, cudaStream_t st, int n_sms, size_t ws_floats,
                         int n, int force)
{
    switch (hd) {
    case 16: launch_tc_hd<16>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force); break;
    case 32: launch_tc_hd<32>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force); break;
    case 64: launch_tc_hd<64>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force); break;
    case 128: launch_tc_hd<128>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force); break;
    default: launch_tc_hd<256>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force); break;
    }
}

template <int HD>
static void launch_tc_dec_st(at_args &x, int stages, int n_tiles, int max_ctx, cudaStream_t st, int n_sms,
                             size_t ws_floats, int n, int force)
{
    if (stages == 2) launch_tc_dec<HD, 2>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force);
    else launch_tc_dec<HD, 3>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force);
}

void kvs_cu_attn_tc_decode(at_args &x, int hd, int stages, int n_tiles, int max_ctx, cudaStream_t st, int n_sms,
                           size_t ws_floats, int n, int force)
{
    switch (hd) {
    case 16: launch_tc_dec_st<16>(x, stages, n_tiles, max_ctx, st, n_sms, ws_floats, n, force); break;
    case 32: launch_tc_dec_st<32>(x, stages, n_tiles, max_ctx, st, n_sms, ws_floats, n, force); break;
    case 64: launch_tc_dec_st<64>(x, stages, n_tiles, max_ctx, st, n_sms, ws_floats, n, force); break;
    case 128: launch_tc_dec_st<128>(x, stages, n_tiles, max_ctx, st, n_sms, ws_floats, n, force); break;
    default: launch_tc_dec_st<256>(x, stages, n_tiles, max_ctx, st, n_sms, ws_floats, n, force); break;
    }
}
