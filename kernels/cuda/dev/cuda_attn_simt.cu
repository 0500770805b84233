/* dev/cuda_attn_simt.cu: k_attn, the attention decode kernel on CUDA cores, kept for comparisons
 * only (KVS_CUDA_DEC_ATTN=0 / kvs_cuda_set_dec_attn(b, 0): the GPU tests and
 * `kvserve-gpubench --attn-variants`); nothing picks it by default. As llm.c keeps its reference
 * kernels in dev/, this corner holds kernels that only benchmarks and tests run.
 *
 * 4 warps a block, one lane per key in QK, an online softmax per row held by its warp, then PV
 * with each lane owning head_dim / 32 output dims. It was bound by its shared-memory reads (each
 * warp re-reads the whole tile), which is why the tensor-core kernels replaced it
 * (bench/RESULTS.md). Deferred RoPE: the rotated copy of q is kept in shared memory and
 * recomputed at document boundaries.
 */
#include "kernels/cuda/cuda_attn_device.cuh"

#define AT_STAGES 2 /* tiles in flight: fewer stages, more resident blocks (2 measured fastest) */

__device__ __forceinline__ float warp_max(float v)
{
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL, v, o));
    return v;
}
__device__ __forceinline__ float warp_sum(float v)
{
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    return v;
}

template <int HD> struct at_smem {
    static constexpr int KST = HD + 8;   /* K/V row stride in bf16: +16 bytes keeps lane-per-row reads conflict-free */
    static constexpr size_t kv_elems = (size_t)AT_STAGES * AT_TILE * KST;
    static constexpr size_t bytes(int rows, bool rot)
    {
        return 2 * kv_elems * sizeof(bf16) +
               ((size_t)rows * HD * (rot ? 3 : 1) + (rot ? HD : 0) + (size_t)rows * AT_TILE) * sizeof(float) +
               (size_t)AT_STAGES * AT_TILE * sizeof(int);
    }
};

/* s[r] = <q row r of this warp, key row `key` of the tile> for the warp's RPW rows */
template <int HD, int RPW>
__device__ __forceinline__ void qk_rows(const bf16 *tk, const float *qw, int key, float *s)
{
    constexpr int KST = at_smem<HD>::KST;
#pragma unroll
    for (int r = 0; r < RPW; r++) s[r] = 0.0f;
    const bf16 *kr = tk + key * KST;
#pragma unroll 4
    for (int c = 0; c < HD / 8; c++) {
        uint4 u = *(const uint4 *)(kr + c * 8);
        const __nv_bfloat162 *p2 = (const __nv_bfloat162 *)&u;
        float kf[8];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float2 f = __bfloat1622float2(p2[i]);
            kf[2 * i] = f.x;
            kf[2 * i + 1] = f.y;
        }
#pragma unroll
        for (int r = 0; r < RPW; r++) {
            const float4 *qq = (const float4 *)(qw + r * HD + c * 8);
            float4 a = qq[0], b = qq[1];
            s[r] += a.x * kf[0] + a.y * kf[1] + a.z * kf[2] + a.w * kf[3] + b.x * kf[4] + b.y * kf[5] + b.z * kf[6] +
                    b.w * kf[7];
        }
    }
}

/* Looks the tile up and stages it (the CUDA-core kernel and prefill blocks) */
template <int HD, int NT>
__device__ __forceinline__ void stage_tile(const at_args &a, int kb, int k1, int kvh, const int32_t *bt,
                                           const int32_t *vt, const int32_t *rt, const int2 *wt, bf16 *dk, bf16 *dv,
                                           int kst, int *ko)
{
    tile_issue<HD, NT>(a, tile_lookup<HD>(a, kb, k1, kvh, bt, vt, rt, wt), dk, dv, kst, ko);
}
/* sqr = sq rotated backward by offset o (the first n_rows rows), between block barriers. The
 * angles depend only on the frequency, so the hd/2 sincos are computed once into cs_sn (shared,
 * hd floats) and applied to every row. Kept out of line: sincosf's range reduction needs local
 * memory and registers that the main loop should not pay for. */
__device__ __noinline__ void rotate_q(const float *sq, float *sqr, float *cs_sn, int n_rows, int hd, int o,
                                      const float *inv_freq)
{
    const int half = hd / 2;
    rot_table(cs_sn, hd, o, inv_freq);
    for (int idx = threadIdx.x; idx < n_rows * half; idx += blockDim.x) {
        int r = idx / half, i = idx % half;
        float cs = cs_sn[i], sn = cs_sn[half + i];
        float x0 = sq[r * hd + i], x1 = sq[r * hd + i + half];
        sqr[r * hd + i] = x0 * cs + x1 * sn;
        sqr[r * hd + i + half] = x1 * cs - x0 * sn;
    }
    __syncthreads();
}

template <int HD, int RPW, bool ROT>
__global__ void __launch_bounds__(AT_THREADS) k_attn(at_args a)
{
    grid_dep_wait(); /* cuda_launch.h: q (and the K/V just written) are ready */
    constexpr int R = AT_WARPS * RPW;
    constexpr int KST = at_smem<HD>::KST;
    constexpr int DPL = HD >= 32 ? HD / 32 : 1;   /* output dims per lane in PV */
    extern __shared__ __align__(16) unsigned char smraw[];
    bf16 *sk = (bf16 *)smraw;
    bf16 *sv = sk + at_smem<HD>::kv_elems;
    float *sq = (float *)(sv + at_smem<HD>::kv_elems); /* [R][HD] q * scale */
    float *sp = sq + R * HD;                           /* [R][AT_TILE] probabilities of the tile */
    float *sqr = sp + R * AT_TILE;                     /* ROT: [2][R][HD] q rotated backward by rot_of[0], [1] */
    float *rtab = sqr + (ROT ? 2 * R * HD : 0);        /* ROT: [HD] cos, sin of the last rotation */
    int *soff = (int *)(rtab + (ROT ? HD : 0));        /* [AT_STAGES][AT_TILE] per key: rotation offset or KEY_PAD */

    int s, r0;
    const int tile = a.tile0 + blockIdx.x;
    if (!find_tile(a, tile, &s, &r0)) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = blockIdx.y, split = blockIdx.z;
    const int qs = a.q_start[s], ntok = min(a.qt, a.q_start[s + 1] - qs - r0);
    const int pos0 = a.pos[s] + r0;               /* position of the tile's first token */
    const int nr = ntok * a.G;                    /* live rows: row = token * G + head */
    int k0, k1; /* keys [k0, k1) are visible to some row */
    at_split_keys(a, split, pos0 + ntok, &k0, &k1);
    const int32_t *bt = a.bt + (size_t)s * a.max_blocks;
    const int32_t *vt = a.valid ? a.valid + (size_t)s * a.max_blocks : nullptr;
    const int32_t *rt = ROT ? a.rot + (size_t)s * a.max_blocks : nullptr;
    const int2 *wt = a.words ? a.words + (size_t)s * a.max_blocks : nullptr;

    for (int idx = threadIdx.x; idx < R * HD; idx += AT_THREADS) {
        int r = idx / HD, d = idx % HD;
        float v = 0.0f;
        if (r < nr) {
            size_t t = (size_t)qs + r0 + r / a.G;
            v = a.q[(t * a.n_heads + (size_t)g * a.G + r % a.G) * HD + d] * a.scale;
        }
        sq[idx] = v;
        if (ROT) sqr[idx] = sqr[R * HD + idx] = 0.0f; /* rotate_q writes only the live rows */
    }

    auto load = [=](int it) {
        const size_t so = (size_t)(it % AT_STAGES) * AT_TILE;
        stage_tile<HD, AT_THREADS>(a, k0 + it * AT_TILE, k1, g, bt, vt, rt, wt, sk + so * KST, sv + so * KST, KST, soff + so);
    };

    const int ntiles = k1 > k0 ? (k1 - k0 + AT_TILE - 1) / AT_TILE : 0;
#pragma unroll
    for (int st = 0; st < AT_STAGES - 1; st++) {
        if (st < ntiles) load(st);
        cp_async_commit();
    }

    float m[RPW], l[RPW], acc[RPW][DPL];
#pragma unroll
    for (int r = 0; r < RPW; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
#pragma unroll
        for (int i = 0; i < DPL; i++) acc[r][i] = 0.0f;
    }
    int rot_of0 = KEY_PAD, rot_of1 = KEY_PAD;     /* ROT: the offsets the two rotated copies hold */
    const float *qw = sq + warp * RPW * HD;       /* this warp's rows */
    const float *qwr0 = sqr + warp * RPW * HD, *qwr1 = qwr0 + R * HD;

    for (int it = 0; it < ntiles; it++) {
        if (it + AT_STAGES - 1 < ntiles) load(it + AT_STAGES - 1);
        cp_async_commit();
        cp_async_wait<AT_STAGES - 1>();
        __syncthreads();
        const bf16 *tk = sk + (size_t)(it % AT_STAGES) * AT_TILE * KST;
        const bf16 *tv = sv + (size_t)(it % AT_STAGES) * AT_TILE * KST;
        const int kb = k0 + it * AT_TILE, p = kb + lane;
        const int myoff = soff[(it % AT_STAGES) * AT_TILE + lane]; /* this lane's key */
        const bool key_ok = myoff != KEY_PAD;
        float sc[RPW];
        if constexpr (!ROT) {
            qk_rows<HD, RPW>(tk, qw, lane, sc);
        } else {
            /* Two rotated copies of q: inside a document every key has the offset of one of them;
             * at a document boundary the tile holds the old document's keys and the new one's,
             * so only the new offset is rotated (into the copy the tile does not use) and QK
             * still runs once, each lane reading the copy of its key's offset. The per-key
             * offsets come from shared memory, so every warp takes the same branches (rotate_q's
             * barriers are block-uniform). */
            const bool live = myoff != KEY_PAD;
            /* inside a document: one vote finds the copy every key uses */
            int uniform_copy = -1;
            if (__all_sync(FULL, myoff == rot_of0 || !live)) uniform_copy = 0;
            else if (__all_sync(FULL, myoff == rot_of1 || !live)) uniform_copy = 1;
            bool one_pass = true;
            const unsigned fresh = uniform_copy >= 0 ? 0u : __ballot_sync(FULL, live && myoff != rot_of0 && myoff != rot_of1);
            if (fresh) {
                const int o = __shfl_sync(FULL, myoff, __ffs((int)fresh) - 1);
                const bool more = __any_sync(FULL, live && myoff != rot_of0 && myoff != rot_of1 && myoff != o);
                const bool used0 = __any_sync(FULL, live && myoff == rot_of0);
                const bool used1 = __any_sync(FULL, live && myoff == rot_of1);
                if (!more && !(used0 && used1)) {
                    if (used0) {
                        rotate_q(sq, sqr + R * HD, rtab, nr, HD, o, a.inv_freq);
                        rot_of1 = o;
                    } else {
                        rotate_q(sq, sqr, rtab, nr, HD, o, a.inv_freq);
                        rot_of0 = o;
                    }
                } else {
                    one_pass = false;
                }
            }
            if (uniform_copy >= 0) {
                qk_rows<HD, RPW>(tk, uniform_copy ? qwr1 : qwr0, lane, sc); /* as in the ordinary kernel */
            } else if (one_pass) {
                qk_rows<HD, RPW>(tk, myoff == rot_of1 ? qwr1 : qwr0, lane, sc); /* per lane at a boundary */
            } else {
                /* more than two offsets in one tile (blocks shorter than the tile): one pass per
                 * offset through copy 0 */
#pragma unroll
                for (int r = 0; r < RPW; r++) sc[r] = 0.0f;
                unsigned todo = __ballot_sync(FULL, live);
                while (todo) {
                    const int o = __shfl_sync(FULL, myoff, __ffs((int)todo) - 1);
                    if (o != rot_of0) {
                        rotate_q(sq, sqr, rtab, nr, HD, o, a.inv_freq);
                        rot_of0 = o;
                    }
                    if (myoff == o) qk_rows<HD, RPW>(tk, qwr0, lane, sc);
                    todo &= __ballot_sync(FULL, myoff != o);
                }
            }
        }
        /* masks: past the range or a padding slot (key_ok), beyond the row's own position (causal) */
        float alpha[RPW];
#pragma unroll
        for (int r = 0; r < RPW; r++) {
            const int row = warp * RPW + r;
            const bool ok = key_ok && row < nr && p <= pos0 + row / a.G;
            const float x = ok ? sc[r] : -INFINITY;
            const float mn = fmaxf(m[r], warp_max(x));
            alpha[r] = m[r] == -INFINITY ? 0.0f : __expf(m[r] - mn);
            const float pr = x == -INFINITY ? 0.0f : __expf(x - mn);
            m[r] = mn;
            l[r] = l[r] * alpha[r] + pr;
            sp[row * AT_TILE + lane] = pr;
        }
        __syncwarp();
        /* PV over the tile's keys (masked ones carry probability 0 and zero-filled V) */
        const int nk = min(AT_TILE, k1 - kb);
        const int d0 = lane * DPL;
#pragma unroll
        for (int r = 0; r < RPW; r++)
#pragma unroll
            for (int i = 0; i < DPL; i++) acc[r][i] *= alpha[r];
        if (d0 < HD) {
#pragma unroll 4
            for (int j = 0; j < nk; j++) {
                float vf[DPL];
                const bf16 *vr = tv + j * KST + d0;
                if constexpr (DPL == 1) {
                    vf[0] = __bfloat162float(vr[0]);
                } else {
                    /* one 4-, 8- or 16-byte shared load (rows and lane offsets are aligned to it) */
                    __align__(16) __nv_bfloat162 h2[DPL / 2];
                    if constexpr (DPL == 2) *(uint32_t *)h2 = *(const uint32_t *)vr;
                    else if constexpr (DPL == 4) *(uint2 *)h2 = *(const uint2 *)vr;
                    else *(uint4 *)h2 = *(const uint4 *)vr;
#pragma unroll
                    for (int i = 0; i < DPL / 2; i++) {
                        float2 f = __bfloat1622float2(h2[i]);
                        vf[2 * i] = f.x;
                        vf[2 * i + 1] = f.y;
                    }
                }
#pragma unroll
                for (int r = 0; r < RPW; r++) {
                    const float pj = sp[(warp * RPW + r) * AT_TILE + j];
#pragma unroll
                    for (int i = 0; i < DPL; i++) acc[r][i] += pj * vf[i];
                }
            }
        }
        __syncthreads(); /* the stage buffer and sp are rewritten next iteration */
    }
    cp_async_wait<0>();

#pragma unroll
    for (int r = 0; r < RPW; r++) {
        const float lsum = warp_sum(l[r]);
        const int row = warp * RPW + r;
        if (row >= nr) continue;
        const size_t t = (size_t)qs + r0 + row / a.G;
        const size_t orow = t * a.n_heads + (size_t)g * a.G + row % a.G;
        const int d0 = lane * DPL;
        if (d0 >= HD) continue;
        if (at_direct(a)) {
#pragma unroll
            for (int i = 0; i < DPL; i++) {
                const float v = acc[r][i] / lsum;
                a.out[orow * HD + d0 + i] = v;
                if (a.outh) a.outh[orow * HD + d0 + i] = __float2bfloat16(v);
            }
        } else {
            float *pp = a.part + (at_part_row(a, tile, g * a.G + row % a.G, orow) * a.n_splits + split) * (size_t)(HD + 2);
#pragma unroll
            for (int i = 0; i < DPL; i++) pp[d0 + i] = acc[r][i];
            if (lane == 0) {
                pp[HD] = m[r];
                pp[HD + 1] = lsum;
            }
        }
    }
}

/* the CUDA-core kernel (decode rows) */
template <int HD, int RPW, bool ROT>
static void launch_simt(at_args &x, int n_tiles, int max_ctx, cudaStream_t st, int n_sms, size_t ws_floats, int n,
                        int force)
{
    static kvs_cu_resident resident;
    kvs_cu_attn_launch(k_attn<HD, RPW, ROT>, AT_THREADS, at_smem<HD>::bytes(AT_WARPS * RPW, ROT), kvs_cu_resident_here(resident), x,
                       n_tiles, max_ctx, st, n_sms, ws_floats, n, HD, force);
}

template <int HD>
static void launch_simt_hd(at_args &x, int n_tiles, int max_ctx, cudaStream_t st, int n_sms, size_t ws_floats, int n,
                           int force)
{
    const bool rot = x.rot != nullptr;
    if (x.G <= AT_WARPS) {
        if (rot) launch_simt<HD, 1, true>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force);
        else launch_simt<HD, 1, false>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force);
    } else {
        if (rot) launch_simt<HD, AT_WIDE_RPW, true>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force);
        else launch_simt<HD, AT_WIDE_RPW, false>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force);
    }
}

void kvs_cu_attn_simt(at_args &x, int hd, int n_tiles, int max_ctx, cudaStream_t st, int n_sms, size_t ws_floats,
                      int n, int force)
{
    switch (hd) {
    case 16: launch_simt_hd<16>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force); break;
    case 32: launch_simt_hd<32>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force); break;
    case 64: launch_simt_hd<64>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force); break;
    case 128: launch_simt_hd<128>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force); break;
    default: launch_simt_hd<256>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force); break;
    }
}
