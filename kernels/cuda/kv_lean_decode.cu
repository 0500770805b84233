/* kv_lean_decode.cu: LeanKV's decode attention over quantized pages with a copy warp (k_lean_dec),
 * the keys-on-M tiles of kv_lean.cu (at most 8 query rows a tile: decode rows, G <= 8) without
 * spans; kv_lean.cu's run_attn launches it (lean_dec_launch) and merges its partials.
 *
 * Why: the one-warp blocks of k_lean_fd stage their own tiles, so a warp's copies wait behind its
 * compute: while a tile is computed only the next one or two are in flight, and the copies alone
 * (16-byte cp.async, 11 one-warp blocks an SM) ran well ahead of the whole kernel (bench/RESULTS.md,
 * "LeanKV kernels, part 9"). Here a block of NC + 1 warps owns (tile, KV head, split): its last warp only copies,
 * the NC others only compute. The block's shared memory is a ring of NST stages (kv_lean_device.cuh's
 * 32-key stage); the copy warp walks the split's tiles in order, tile i into stage i % NST, as soon
 * as the stage is free, and compute warp i % NC takes tile i. Each stage has two mbarriers: `full`
 * completes when the copy warp's cp.async of the tile have landed (cp.async.mbarrier.arrive.noinc,
 * one per lane) and its key infos are stored (a plain arrive per lane, release), `empty` when the
 * compute warp is done reading it (one arrive after a warp barrier). So up to NST - NC tiles are in
 * flight while every compute warp works, whatever the compute takes, and the copy warp never waits
 * for a compute warp except on a full ring. Each compute warp keeps its own online softmax over its
 * tiles (the same QK / softmax / PV as k_lean_fd's keys-on-M layout, deferred RoPE per warp) and
 * writes it as its own partial, split * NC + warp, which k_lean_merge (kv_lean.cu) merges in order,
 * as it merges k_lean_fd's splits: no block-wide barrier after the start but the fold below.
 * At the end the compute warps may fold their states into one partial a block (COMBINE; the
 * default is a partial a warp). NC and NST are launch parameters (kvs_cuda_set_lean_dec, else
 * KVS_LEAN_DEC=NC[,NST[,SPLITS[,COMBINE]]]):
 * by default NST fills the shared memory of the blocks the registers let stay resident; NST is a
 * multiple of NC (stage st is computed by warp st % NC only: see dec_launch).
 * Ownership: the caller's buffers. Errors: CUDA failures abort (CUDA_CHECK / LAUNCH_CHECK). */
#include "kernels/cuda/kv_lean_cuda.h"
#include "kernels/cuda/kv_lean_device.cuh"

#include <stdlib.h>

#define LEAN_DEC_MAXW 6     /* warps a block: at most 5 compute warps + the copy warp */
#define LEAN_DEC_MAXST 24   /* stages a ring */
#ifndef LEAN_DEC_MINB
/* __launch_bounds__ minimum blocks of LEAN_DEC_MAXW warps: 2 caps ptxas at 168 registers (no
 * spills, as k_lean_fd's K8V8), i.e. 12 warps an SM whatever NC */
#define LEAN_DEC_MINB 2
#endif

__device__ __forceinline__ unsigned lean_sa(const void *p) { return (unsigned)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void lean_mbar_init(uint64_t *mb, unsigned count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(lean_sa(mb)), "r"(count) : "memory");
}

/* a plain arrive (release: the thread's earlier shared-memory stores are seen by the waiters) */
__device__ __forceinline__ void lean_mbar_arrive(uint64_t *mb)
{
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(lean_sa(mb)) : "memory");
}

/* an arrive that fires when every cp.async this thread issued before it has landed; .noinc: the
 * barrier's count includes it */
__device__ __forceinline__ void lean_mbar_cp_arrive(uint64_t *mb)
{
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(lean_sa(mb)) : "memory");
}

/* waits until the phase of parity `parity` of mb has completed (acquire) */
__device__ __forceinline__ void lean_mbar_wait(uint64_t *mb, unsigned parity)
{
    unsigned done = 0;
    while (!done)
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     " selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(lean_sa(mb)), "r"(parity)
                     : "memory");
}

/* cos and sin of the backward rotation by o (rot_table's arithmetic) into one compute warp's own
 * table, between warp barriers: the warps of a block meet document boundaries at different tiles,
 * so rot_table's block barriers cannot be used here */
__device__ __forceinline__ void lean_rot_table_warp(float *cs_sn, int hd, int o, const float *inv_freq, int lane)
{
    const int half = hd / 2;
    __syncwarp();
    for (int i = lane; i < half; i += 32) {
        float sn, cs;
        sincosf((float)((double)o * (double)inv_freq[i]), &sn, &cs);
        cs_sn[i] = cs;
        cs_sn[half + i] = sn;
    }
    __syncwarp();
}

/* shared memory: the ring, then its 2 NST mbarriers, then a rotation table per compute warp */
template <int HD, int KB, int VB>
__host__ __device__ constexpr size_t lean_dec_smem(int nc, int nst)
{
    return (size_t)nst * lean_stage<HD, KB, VB>::BYTES + (size_t)nst * 2 * sizeof(uint64_t) + (size_t)nc * HD * sizeof(float);
}

template <int HD, int KB, int VB>
__global__ void __launch_bounds__(LEAN_DEC_MAXW * 32, LEAN_DEC_MINB) k_lean_dec(const __grid_constant__ lean_fd_args a, int nst, int trig, int combine)
{
    using S = lean_stage<HD, KB, VB>;
    extern __shared__ __align__(16) uint8_t lean_ring[];
    const int nc = (int)(blockDim.x >> 5) - 1, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    uint64_t *full = reinterpret_cast<uint64_t *>(lean_ring + (size_t)nst * S::BYTES), *empty = full + nst;
    const lean_geom &g = a.g;
    const int tile = blockIdx.x / g.n_kv, kvh = blockIdx.x % g.n_kv, split = blockIdx.y;
    /* the barriers are the block's own shared memory: set up before the wait */
    if (threadIdx.x == 0)
        for (int i = 0; i < nst; i++) {
            lean_mbar_init(full + i, 64); /* 32 cp.async arrivals + 32 plain ones */
            lean_mbar_init(empty + i, 1);
        }
    grid_dep_wait(); /* cuda_launch.h: launched early behind the previous kernel (q) */
    /* the merge (kv_lean.cu) may take SM slots as this grid's last blocks run (its own wait holds
     * it until this grid is done): it then starts without a launch's latency */
    grid_dep_launch(trig);
    __syncthreads();

    int s = 0, r0 = 0;
    if (!lean_tile_seq(a, tile, lane, &s, &r0)) return; /* cannot happen: the grid has exactly the tiles */
    const int qs = a.q_start[s], rows_s = a.q_start[s + 1] - qs;
    const int nt = min(a.qt, rows_s - r0), nr = nt * a.G;
    const int first = a.pos[s] + r0, last = first + nt - 1; /* the tile's tokens' positions */
    const int32_t *bt = a.bt + (long long)s * a.max_blocks;
    const int32_t *vt = a.valid ? a.valid + (long long)s * a.max_blocks : nullptr;
    const int32_t *rt = a.rot ? a.rot + (long long)s * a.max_blocks : nullptr;
    const long long n_tiles_all = (last + 1 + AT_TILE - 1) / AT_TILE;
    const long long w0 = (long long)split * a.chunk;
    const long long w1 = split == (int)gridDim.y - 1 ? n_tiles_all : min(n_tiles_all, w0 + a.chunk);
    const int ntiles = w1 > w0 ? (int)(w1 - w0) : 0;

    if (warp == nc) {
        /* the copy warp: tile i into stage i % nst once its previous tile (i - nst) is computed;
         * each lane looks its key up a tile ahead (the block table's load overlaps a wait) */
        auto lookup = [&](int i) {
            const long long p = (w0 + i) * AT_TILE + lane;
            return lean_lookup<HD, KB, VB>(a, p <= last ? (int)p : -1, kvh, bt, vt, rt);
        };
        lean_key nxt = lookup(0);
        for (int i = 0; i < ntiles; i++) {
            const lean_key k = nxt;
            if (i + 1 < ntiles) nxt = lookup(i + 1);
            const int st = i % nst;
            if (i >= nst) lean_mbar_wait(empty + st, (unsigned)((i / nst - 1) & 1));
            lean_issue<HD, KB, VB>(a.pool, k, lean_ring + (size_t)st * S::BYTES, lane);
            lean_mbar_cp_arrive(full + st);
            lean_mbar_arrive(full + st); /* the key infos (plain stores) */
        }
        cp_async_wait<0>();
        return;
    }

    /* a compute warp: tiles warp, warp + nc, ... of the split; the KT layout of k_lean_fd (its q
     * row g is the lane's B column, its score columns 2t and 2t + 1) */
    const int gq = lane >> 2, t = lane & 3;
    float *cs_sn = reinterpret_cast<float *>(empty + nst) + warp * HD;
    const float *qr = gq < nr ? a.q + ((long long)(qs + r0 + gq / a.G) * a.n_heads + (long long)kvh * a.G + gq % a.G) * HD
                              : nullptr;
    int lim[2];
#pragma unroll
    for (int e = 0; e < 2; e++) lim[e] = 2 * t + e < nr ? first + (2 * t + e) / a.G : -1;
    uint32_t qb[HD / 16][2];
    float qcol[2];
    lean_qfrags_kt<HD, KB>(qr, a.scale, nullptr, lane, qb, qcol);
    int cur_rot = 0;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}, o[HD / 16][4];
#pragma unroll
    for (int x = 0; x < HD / 16; x++) o[x][0] = o[x][1] = o[x][2] = o[x][3] = 0.0f;

    for (int i = warp; i < ntiles; i += nc) {
        const int st = i % nst;
        const uint8_t *stg = lean_ring + (size_t)st * S::BYTES;
        lean_mbar_wait(full + st, (unsigned)((i / nst) & 1));
        const int *ko = reinterpret_cast<const int *>(stg + S::KO_OFF);
        float sc[2][4];
        const int myoff = ko[lane];
        if (!rt || __all_sync(FULL, myoff == cur_rot || myoff == KEY_PAD)) {
            lean_qk_kt<HD, KB, VB>(stg, qb, qcol, sc, lane);
        } else {
            /* a document boundary: one QK pass per rotation offset in the tile (k_lean_fd's) */
#pragma unroll
            for (int j = 0; j < 2; j++) sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.0f;
            unsigned todo = __ballot_sync(FULL, myoff != KEY_PAD);
            while (todo) {
                const int ofs = __shfl_sync(FULL, myoff, __ffs((int)todo) - 1);
                if (ofs != cur_rot) {
                    if (ofs) lean_rot_table_warp(cs_sn, HD, ofs, a.inv_freq, lane);
                    lean_qfrags_kt<HD, KB>(qr, a.scale, ofs ? cs_sn : nullptr, lane, qb, qcol);
                    cur_rot = ofs;
                }
                float sr[2][4];
                lean_qk_kt<HD, KB, VB>(stg, qb, qcol, sr, lane);
#pragma unroll
                for (int j = 0; j < 2; j++)
#pragma unroll
                    for (int e = 0; e < 4; e++)
                        if (ko[lean_sc_key<true>(j, e, lane)] == ofs) sc[j][e] = sr[j][e];
                todo &= __ballot_sync(FULL, myoff != ofs);
            }
        }
        uint32_t pb[2][2];
        float ct[2] = {0.0f, 0.0f}; /* this tile's V correction, 1024 p' + p z_v (the lane's keys) */
        lean_softmax_kt<HD, KB, VB>(stg, sc, ko, (int)((w0 + i) * AT_TILE), lim, m, l, ct, o, pb, lane);
        lean_pv_kt<HD, KB, VB>(stg, pb, o, lane);
        __syncwarp(); /* every lane is done with the stage */
        if (lane == 0) lean_mbar_arrive(empty + st);
        /* The correction is taken off o at every tile, not once at the end as k_lean_fd does: o
         * accumulates p' (1024 + c) on the tensor cores, whose fp32 sums round to the magnitude of
         * 1024 sum p', so over a whole walk of thousands of keys (one warp's share of a split of
         * 8K-32K keys) the small part p' c drowned at 2 and 4 bits (test_cuda_kv_lean's forced
         * single split failed K4V2 on the H100: bench/RESULTS.md, "part 11"). Taken off per tile, o
         * stays at the size of the output and only one tile's offset is ever in the accumulator. */
#pragma unroll
        for (int e = 0; e < 2; e++)
#pragma unroll
            for (int x = 4; x < 32; x <<= 1) ct[e] += __shfl_xor_sync(FULL, ct[e], x);
#pragma unroll
        for (int x = 0; x < HD / 16; x++) o[x][0] -= ct[0], o[x][1] -= ct[1], o[x][2] -= ct[0], o[x][3] -= ct[1];
    }

    int part = split * nc + warp;
    if (combine && nc > 1) {
        /* the block's compute warps fold their states into warp 0's, in warp order, so the
         * merge reads one partial a split instead of nc (fewer loads in its dependent walk, and
         * fewer bytes written): each warp's o, m, l lane by lane (the same register layout in
         * every warp: lane (g, t)'s elements are the same dims and rows), through the ring's
         * shared memory once every compute warp is past its last stage (named barrier 1; the
         * copy warp has left). dec_launch checks that the ring holds nc - 1 warps' states. */
        constexpr int PER = HD / 16 * 4 + 4; /* floats a lane: o, m[2], l[2]; stored [float][lane] */
        float *xs = reinterpret_cast<float *>(lean_ring);
        asm volatile("bar.sync 1, %0;\n" ::"r"(nc * 32) : "memory");
        if (warp > 0) {
            float *d = xs + (warp - 1) * 32 * PER + lane;
#pragma unroll
            for (int x = 0; x < HD / 16; x++)
#pragma unroll
                for (int k = 0; k < 4; k++) d[(x * 4 + k) * 32] = o[x][k];
            d[HD / 4 * 32] = m[0], d[(HD / 4 + 1) * 32] = m[1], d[(HD / 4 + 2) * 32] = l[0], d[(HD / 4 + 3) * 32] = l[1];
        }
        asm volatile("bar.sync 1, %0;\n" ::"r"(nc * 32) : "memory");
        if (warp > 0) return;
        for (int w = 1; w < nc; w++) {
            const float *d = xs + (w - 1) * 32 * PER + lane;
            float a0[2], a1[2];
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const float mw = d[(HD / 4 + e) * 32], mn = fmaxf(m[e], mw);
                a0[e] = m[e] == -INFINITY ? 0.0f : __expf(m[e] - mn);
                a1[e] = mw == -INFINITY ? 0.0f : __expf(mw - mn);
                l[e] = l[e] * a0[e] + d[(HD / 4 + 2 + e) * 32] * a1[e];
                m[e] = mn;
            }
#pragma unroll
            for (int x = 0; x < HD / 16; x++)
#pragma unroll
                for (int k = 0; k < 4; k++) o[x][k] = o[x][k] * a0[k & 1] + d[(x * 4 + k) * 32] * a1[k & 1];
        }
        part = split;
    }
    /* the warp's partial (k_lean_fd's keys-on-M epilogue with a.n_splits partials, the
     * correction already taken off): column e of the lane is row 2t + e; l summed over the
     * column's 8 lanes */
#pragma unroll
    for (int e = 0; e < 2; e++) {
        float ls = l[e];
#pragma unroll
        for (int x = 4; x < 32; x <<= 1) ls += __shfl_xor_sync(FULL, ls, x);
        const int r = 2 * t + e;
        if (r >= nr) continue;
        const long long orow = (long long)(qs + r0 + r / a.G) * a.n_heads + (long long)kvh * a.G + r % a.G;
        float *pp = a.part + (orow * a.n_splits + part) * (long long)(HD + 2);
        /* o[x][e] is dim g HD/8 + 2x, o[x][2 + e] the next */
#pragma unroll
        for (int x = 0; x < HD / 16; x++)
            *reinterpret_cast<float2 *>(pp + gq * (HD / 8) + 2 * x) = make_float2(o[x][e], o[x][2 + e]);
        if (gq == 0) {
            pp[HD] = ls > 0.0f ? m[e] : -INFINITY;
            pp[HD + 1] = ls;
        }
    }
}

/* the launch configuration: compute warps a block (1 .. LEAN_DEC_MAXW - 1), stages a ring (0: as
 * many as the shared memory of the resident blocks holds) and splits (0: planned; tests force a
 * few, so that each block walks its ring many times round); kvs_cuda_set_lean_dec, else
 * KVS_LEAN_DEC=NC[,NST[,SPLITS[,COMBINE]]] (benchmarks), else the default */
#ifndef LEAN_DEC_NC
#define LEAN_DEC_NC 2 /* 3-warp blocks, 4 an SM: the fastest of 1-5 compute warps on the H100 (RESULTS "part 11") */
#endif
#ifndef LEAN_DEC_COMBINE
/* the compute warps' states folded in the block: 0, a partial a warp; the fold halved the merge's
 * time at batch 8 x 8K (ncu: 8 partials a row, 4.9 us) but the whole attention was no faster at
 * any shape timed (within 1%, RESULTS "part 12"), so the simpler default */
#define LEAN_DEC_COMBINE 0
#endif
static int dec_nc = -1, dec_nst = 0, dec_splits = 0, dec_combine = LEAN_DEC_COMBINE;

extern "C" void kvs_cuda_set_lean_dec(int compute_warps, int stages, int splits, int combine)
{
    dec_nc = compute_warps >= 1 && compute_warps < LEAN_DEC_MAXW ? compute_warps : LEAN_DEC_NC;
    dec_nst = stages >= 2 && stages <= LEAN_DEC_MAXST ? stages : 0; /* rounded to a multiple of nc at launch */
    dec_splits = splits >= 1 && splits <= LEAN_MAX_SPLITS ? splits : 0;
    dec_combine = combine == 0 || combine == 1 ? combine : LEAN_DEC_COMBINE;
}

static void dec_cfg(int *nc, int *nst, int *splits, int *combine)
{
    if (dec_nc < 0) {
        const char *e = getenv("KVS_LEAN_DEC");
        int c = 0, n = 0, sp = 0, cb = -1;
        if (e && *e) sscanf(e, "%d,%d,%d,%d", &c, &n, &sp, &cb);
        kvs_cuda_set_lean_dec(c, n, sp, cb);
    }
    *nc = dec_nc, *nst = dec_nst, *splits = dec_splits, *combine = dec_combine;
}

/* one entry per (device, nc, nst) configuration met: resident blocks and the ring's stages */
struct dec_plan_cache {
    int nc, nst_req, nst, resident;
};

template <int HD, int KB, int VB>
static void dec_launch(lean_fd_args &x, long long n_tiles, long long w_max, long long by_ws, int n_sms, cudaStream_t st)
{
    static kvs_cu_resident seen_all; /* the shared-memory attribute raised on this device */
    static thread_local dec_plan_cache pc[KVS_CU_MAX_DEVICES];
    int &seen = *kvs_cu_resident_here(seen_all);
    int dev = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    int nc, nst_req, force, combine;
    dec_cfg(&nc, &nst_req, &force, &combine);
    const int threads = (nc + 1) * 32;
    dec_plan_cache &c = pc[dev];
    if (!seen) {
        int optin = 0;
        CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
        CUDA_CHECK(cudaFuncSetAttribute((const void *)k_lean_dec<HD, KB, VB>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        optin));
        seen = 1;
        c.nc = 0;
    }
    if (c.nc != nc || c.nst_req != nst_req) {
        /* the blocks the registers allow, then the stages their shared memory holds */
        int nb = 0, per_sm = 0, reserved = 0, optin = 0;
        CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&nb, k_lean_dec<HD, KB, VB>, threads,
                                                                 lean_dec_smem<HD, KB, VB>(nc, 2)));
        CUDA_CHECK(cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev));
        CUDA_CHECK(cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, dev));
        CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
        if (nb < 1) kvs_panic(__FILE__, __LINE__, "lean decode attention: %d warps do not fit an SM", nc + 1);
        int nst = nst_req;
        if (!nst) {
            const long long per_block = min((long long)per_sm / nb - reserved, (long long)optin);
            nst = (int)((per_block - (long long)lean_dec_smem<HD, KB, VB>(nc, 0)) /
                        (long long)lean_dec_smem<HD, KB, VB>(0, 1));
            if (nst > LEAN_DEC_MAXST) nst = LEAN_DEC_MAXST;
        }
        /* a multiple of nc, so that stage st is only ever computed by warp st % nc: the warp waiting
         * on a stage's `full` barrier has itself released the stage's previous tile, so the barrier
         * is at most one phase behind the parity it waits for; at least a tile in flight beside
         * each compute warp's */
        nst = nst / nc * nc;
        if (nst < 2 * nc) nst = 2 * nc;
        int res = 0;
        CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&res, k_lean_dec<HD, KB, VB>, threads,
                                                                 lean_dec_smem<HD, KB, VB>(nc, nst)));
        if (res < 1) kvs_panic(__FILE__, __LINE__, "lean decode attention: %d stages do not fit an SM", nst);
        c.nc = nc, c.nst_req = nst_req, c.nst = nst, c.resident = res;
        if (getenv("KVS_LEAN_PLAN")) {
            cudaFuncAttributes fa;
            CUDA_CHECK(cudaFuncGetAttributes(&fa, (const void *)k_lean_dec<HD, KB, VB>));
            fprintf(stderr, "lean dec plan: HD %d K%dV%d, %d compute warps + 1, %d stages, %zu B shared, %d registers, "
                    "%zu B local, %d blocks an SM\n", HD, KB, VB, nc, nst, lean_dec_smem<HD, KB, VB>(nc, nst), fa.numRegs,
                    (size_t)fa.localSizeBytes, res);
        }
    }
    /* the in-block fold needs nc - 1 compute warps' states in the ring's shared memory */
    if (combine && (size_t)(nc - 1) * 32 * (HD / 16 * 4 + 4) * sizeof(float) > (size_t)c.nst * lean_stage<HD, KB, VB>::BYTES)
        combine = 0;
    const int ppb = combine ? 1 : nc; /* partials a block writes */
    /* splits: the fewest splits that fill the resident blocks' slots best (blocks do equal work: a
     * part-filled last wave costs a whole one; a second wave of as well filled waves is not taken:
     * one wave of twice the tiles a block was 0.4-6.5% faster, most at batch 8: RESULTS "part 12"),
     * at least 2 tiles a compute warp, the partials within the workspace */
    const long long pairs = n_tiles * x.g.n_kv, cap = (long long)c.resident * n_sms;
    long long lim = w_max / (2LL * nc);
    if (lim > by_ws / ppb) lim = by_ws / ppb;
    if (lim > LEAN_MAX_SPLITS) lim = LEAN_MAX_SPLITS;
    if (lim < 1) lim = 1;
    long long ns = 1;
    double best = 0.0;
    for (long long k = 1; k <= lim; k++) {
        const long long blocks = pairs * k, waves = (blocks + cap - 1) / cap;
        const double fill = (double)blocks / (double)(waves * cap);
        if (fill > best + 0.05) best = fill, ns = k;
        if (waves > 1 && fill >= 0.85) break; /* more splits only add waves */
    }
    if (force) ns = force;
    x.chunk = (int)((w_max + ns - 1) / ns);
    if (x.chunk < 1) x.chunk = 1;
    const int splits = (int)((w_max + x.chunk - 1) / x.chunk);
    if ((long long)splits * ppb > by_ws) kvs_panic(__FILE__, __LINE__, "lean decode attention: partials past the workspace");
    x.n_splits = splits * ppb; /* the partials k_lean_merge takes */
    x.part -= x.prow0 * x.n_splits * (long long)(HD + 2); /* lean_fd_args.prow0 */
    const dim3 grid((unsigned)pairs, (unsigned)splits);
    CUDA_CHECK(kvs_cu_launch(k_lean_dec<HD, KB, VB>, grid, dim3(threads), lean_dec_smem<HD, KB, VB>(nc, c.nst), st, x,
                             c.nst, lean_merge_early(), combine));
    CUDA_CHECK(cudaGetLastError());
}

/* kv_lean_device.cuh; the formats of kv_lean.cu's LEAN_FMTS */
bool lean_dec_launch(lean_fd_args &x, long long n_tiles, long long w_max, long long by_ws, int n_sms, cudaStream_t st)
{
    if (x.spans || x.G > 8 || x.qt * x.G > 8 || by_ws < LEAN_DEC_MAXW) return false;
#define LEAN_DEC_GO(K, V)                                                                                              \
    if (x.g.kbits == K && x.g.vbits == V) {                                                                            \
        if (x.g.hd == 128) dec_launch<128, K, V>(x, n_tiles, w_max, by_ws, n_sms, st);                                 \
        else dec_launch<64, K, V>(x, n_tiles, w_max, by_ws, n_sms, st);                                                \
        return true;                                                                                                   \
    }
    LEAN_FMTS(LEAN_DEC_GO)
#undef LEAN_DEC_GO
    return false;
}
