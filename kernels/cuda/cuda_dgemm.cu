/* cuda_dgemm.cu: the decode GEMM's Hopper kernel (cuda_skinny.h, kvs_cu_dgemm): y = x W^T for 1 to
 * 128 token rows with the weights on the wgmma's M side.
 *
 * A block owns MW tiles of 128 weight rows (a tile: 64 + 64 rows, SwiGLU: 64 gate rows and the
 * same 64 up rows; MW = 1 up to 32 tokens, each warpgroup 64 rows; MW = 2 from 64, each
 * warpgroup a tile) and all n tokens (the wgmma's N = n rounded up to 8, 16, 32, 64 or 128), over
 * one split of K. Each stage of its pipeline is one 64-column atom of K: MW x 128 weight rows x
 * 128 bytes and N token rows x 128 bytes, copied with cp.async (16 bytes a thread, the L2::256B
 * fetch hint) into 128-byte-swizzled shared memory, which the wgmma reads through matrix
 * descriptors. Stages run 4 deep with 2 blocks per SM (MW = 1), 4-5 deep with one (MW = 2), so
 * 6-8 atoms of weights per SM are in flight. x is read once per block from L2 (n / (128 MW) of
 * the weight bytes), not once per 16 rows as in k_skinny.
 *
 * Split-K: when the tiles alone do not fill a wave, K is cut into `splits` ranges (plan in
 * dg_splits: a function of the launch's shapes and the SM count, never of n); each block writes
 * its fp32 partial tiles to a workspace, waits for the other splits of its unit (the grid is one
 * wave, so they all run), and adds a slice of the unit's rows over the partials in split order,
 * with the epilogue (bias; SwiGLU and its bf16 copy): dg_reduce. Or (cluster, variant bit 16) a
 * unit's splits run as one thread-block cluster: each block leaves its partials in its own shared
 * memory, and after the cluster barrier reads the peers' (distributed shared memory) in the same
 * order, with no workspace traffic and no counters. So a row's result is the same
 * bits whatever n (batch invariance), and deterministic. Measured (bench/RESULTS.md, decode4):
 * the unsplit launches stream at 2,750-2,970 GB/s up to 32 tokens; the split ones are slower than
 * cuBLASLt, so the default variant gives them to k_dgemm_n (below: the weights on the N side, K
 * never split; decode5) where it applies, else k_skinny / cuBLAS (cuda_skinny.cu); with the
 * cluster's reduction they were slower still from 32 tokens (part 2 there).
 *
 * The weights of the first stages are fetched before the grid dependency wait (cuda_launch.h);
 * x, the workspace and the outputs only after it.
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/cuda/cuda_launch.h"
#include "kernels/cuda/cuda_skinny.h"
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#include "kernels/cuda/cuda_dgemm_wgmma.cuh"
#endif

typedef __nv_bfloat16 bf16;

#define DG_M 128       /* weight rows of a tile: two warpgroups of 64 */
#define DG_KA 64       /* K columns of one stage: one 128-byte swizzle atom */
#define DG_THREADS 256
#define DG_A_BYTES (DG_M * DG_KA * 2) /* 16 KB */

struct dg_params {
    const bf16 *x;
    int n, in, swiglu, n_parts;
    int tiles[KVS_SKINNY_MAX_PARTS];       /* 128-row tiles of each part (plain) */
    const bf16 *w[KVS_SKINNY_MAX_PARTS];
    const float *bias[KVS_SKINNY_MAX_PARTS];
    int out[KVS_SKINNY_MAX_PARTS];
    float *y[KVS_SKINNY_MAX_PARTS];
    bf16 *yh;
    int splits, atoms;                     /* K splits; K atoms = in / 64 */
    float *ws;                             /* splits > 1: [tile][split][128][NB] partial tiles */
    unsigned *sem;                         /* splits > 1: two zeroed counters per unit (arrived, left) */
    int cluster;                           /* 1: a unit's splits are one cluster, reduced on chip (dg_reduce_rows) */
    int trig;                              /* kvs_cu_pdl_early(): grid_dep_launch after the wait */
};

/* a block: MW tiles of 128 A rows (MW = 1: each warpgroup 64 rows of the tile; MW = 2: each
 * warpgroup a whole tile, halving the x bytes per weight byte). Up to 32 tokens 2 blocks per SM
 * (<= ~113 KB, <= 128 registers a thread); from 64 tokens one block of two tiles per SM, or (variant
 * bit 64: kvs_cu_dgemm's one_tile) still one tile a block and two blocks per SM: gate/up's 224 tiles
 * then fill all 132 SMs (two-tile blocks: 112 of them) at the price of twice the x bytes from L2
 * (n / 128 of the weight bytes), and 3 stages of 32 KB at 128 tokens. */
template <int NB, int MW_> struct dg_cfg {
    static constexpr int MW = MW_;
    static constexpr int A_BYTES = MW * DG_A_BYTES;
    static constexpr int B_BYTES = NB * DG_KA * 2;
    static constexpr int SLOT = A_BYTES + B_BYTES;
    static constexpr int PER_SM = MW == 2 ? 1 : 2;
    static constexpr int P = MW == 2 ? (NB >= 128 ? 4 : 5) : (NB >= 128 ? 3 : 4);
    static constexpr int SMEM = P * SLOT + 1024; /* + alignment to 1024 bytes */
};
/* the tiles of a block by default (above) */
template <int NB> constexpr int dg_mw() { return NB >= 64 ? 2 : 1; }

__device__ __forceinline__ void dg_cp16(uint32_t dst, const void *src, bool ok)
{
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void dg_commit_cp() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void dg_wait_cp() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

/* Stage st of a P-slot cp.async ring may now be read by wgmma: its copies landed (the first stage
 * waits for every group, later ones leave the P - 2 younger stages in flight), they are made
 * visible to the async proxy, and stage st - 1's slot is read by no one (so it may be refilled). */
template <int P> __device__ __forceinline__ void dg_stage_ready(int st)
{
    if (st == 0) dg_wait_cp<0>();
    else dg_wait_cp<P - 2>();
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); /* cp.async data -> wgmma */
    __syncthreads();
}

/* the swizzled address of 16-byte chunk c (0..7) of row r in a 128-byte-row tile at base */
__device__ __forceinline__ uint32_t dg_swz(uint32_t base, int r, int c)
{
    return base + (uint32_t)(r * 128 + ((c ^ (r & 7)) << 4));
}

/* the weight rows of a block's tile: A row i (0..127) comes from wrow[i / 64] + (i % 64) * in,
 * valid below vrows[i / 64] (rows past a part's end are zero-filled and never stored) */
struct dg_tile {
    const bf16 *wrow[2];
    int vrows[2];
    int part, r0;                          /* plain: the part and its first row; swiglu: f0 */
};

__device__ __forceinline__ dg_tile dg_tile_of(const dg_params &p, int tile)
{
    dg_tile t;
    if (p.swiglu) {
        t.part = 0;
        t.r0 = tile * 64;
        t.wrow[0] = p.w[0] + (size_t)t.r0 * p.in;
        t.wrow[1] = p.w[1] + (size_t)t.r0 * p.in;
        t.vrows[0] = t.vrows[1] = min(64, p.out[0] - t.r0);
    } else {
        int part = 0;
        while (part + 1 < p.n_parts && tile >= p.tiles[part]) tile -= p.tiles[part++];
        t.part = part;
        t.r0 = tile * DG_M;
        t.wrow[0] = p.w[part] + (size_t)t.r0 * p.in;
        t.wrow[1] = t.wrow[0] + (size_t)64 * p.in;
        t.vrows[0] = min(64, p.out[part] - t.r0);
        t.vrows[1] = min(64, p.out[part] - t.r0 - 64);
    }
    return t;
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
template <int NB> __device__ __forceinline__ void dg_mma(float *acc, uint64_t da, uint64_t db)
{
    if constexpr (NB == 8) dg_wgmma_n8(acc, da, db);
    else if constexpr (NB == 16) dg_wgmma_n16(acc, da, db);
    else if constexpr (NB == 32) dg_wgmma_n32(acc, da, db);
    else if constexpr (NB == 64) dg_wgmma_n64(acc, da, db);
    else dg_wgmma_n128(acc, da, db);
}
#endif

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
/* the cluster's barrier (all threads of all its blocks): release / acquire orders the shared-memory
 * partials written before it with the peers' reads after it */
__device__ __forceinline__ void dg_cluster_sync()
{
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
/* the float at shared address a (this block's layout) in the shared memory of cluster block rank */
__device__ __forceinline__ float dg_ld_peer(uint32_t a, int rank)
{
    uint32_t ra;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(ra) : "r"(a), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(ra) : "memory");
    return v;
}
#endif

/* the rows of a split launch that block `split` finishes, once every block of the unit (its MW
 * tiles) has its partial in place: rows [split R / S, (split + 1) R / S) of the unit's R = MW x 128
 * A rows, summed over the S partials in split order, with the epilogue (bias; SwiGLU pairs gate
 * row m with up row 64 + m of the same tile). CL: the partials are in the shared memory of the
 * cluster's blocks (rank s = split s; layout [tile i][128][NB] from address part0), else in the
 * workspace. The order of the additions is the same either way: the same bits. */
template <int NB, int MW, bool CL>
__device__ __forceinline__ void dg_reduce_rows(const dg_params &p, const dg_tile T0, const dg_tile T1, int unit,
                                               int split, uint32_t part0)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    const int S = p.splits, tid = threadIdx.x;
    const int fr = p.swiglu ? 64 : 128;                 /* output rows a tile: SwiGLU's f rows or 128 */
    const int R = MW * fr, r0 = split * R / S, r1 = (split + 1) * R / S;
    for (int e = r0 * NB + tid; e < r1 * NB; e += DG_THREADS) {
        const int rr = e / NB, t = e % NB, i = rr / fr, m = rr % fr;
        if (t >= p.n) continue;
        /* the tile's fields by value (a reference chosen at run time would put T in local memory) */
        const int vr0 = i ? T1.vrows[0] : T0.vrows[0], vr1 = i ? T1.vrows[1] : T0.vrows[1];
        const int tr0 = i ? T1.r0 : T0.r0, tpart = i ? T1.part : T0.part;
        const int tile = unit * MW + i;
        float a = 0.0f, u = 0.0f;
        for (int s = 0; s < S; s++) {
            float va, vu = 0.0f;
            if constexpr (CL) {
                const uint32_t at = part0 + (uint32_t)(((i * DG_M + m) * NB + t) * 4);
                va = dg_ld_peer(at, s);
                if (p.swiglu) vu = dg_ld_peer(at + 64 * NB * 4, s);
            } else {
                const float *ps = p.ws + (size_t)(tile * S + s) * DG_M * NB;
                va = __ldcg(ps + (size_t)m * NB + t);
                if (p.swiglu) vu = __ldcg(ps + (size_t)(64 + m) * NB + t);
            }
            a = s ? a + va : va;
            u = s ? u + vu : vu;
        }
        if (p.swiglu) {
            if (m >= vr0) continue;
            const float v = a / (1.0f + expf(-a)) * u; /* as k_swiglu */
            const size_t f = (size_t)t * p.out[0] + tr0 + m;
            p.y[0][f] = v;
            if (p.yh) p.yh[f] = __float2bfloat16(v);
        } else {
            if (m >= (m < 64 ? vr0 : 64 + vr1)) continue;
            const int r = tr0 + m;
            const float *bias = p.bias[tpart];
            p.y[tpart][(size_t)t * p.out[tpart] + r] = bias ? a + bias[r] : a;
        }
    }
#endif
}

/* the reduction of a split launch through the workspace: every block of a unit has written its
 * partial there; the blocks wait for each other (all blocks of a launch are resident at once: the
 * plan keeps the grid within one wave, so the wait cannot deadlock), then each finishes its rows */
template <int NB, int MW>
__device__ __forceinline__ void dg_reduce(const dg_params &p, const dg_tile T0, const dg_tile T1, int unit, int split)
{
    const int S = p.splits, tid = threadIdx.x;
    __syncthreads(); /* every thread's partial is written */
    if (tid == 0) {
        __threadfence();
        atomicAdd(p.sem + 2 * unit, 1u);
        unsigned spins = 0;
        while (atomicAdd(p.sem + 2 * unit, 0u) < (unsigned)S) {
            __nanosleep(64);
            if (++spins > (1u << 26)) __trap(); /* a broken plan: fail loudly, never hang */
        }
        __threadfence();
    }
    __syncthreads();
    dg_reduce_rows<NB, MW, false>(p, T0, T1, unit, split, 0u);
    __syncthreads();
    if (tid == 0) {
        /* the last block to leave resets both counters for the next launch */
        if (atomicAdd(p.sem + 2 * unit + 1, 1u) == (unsigned)(S - 1)) {
            p.sem[2 * unit] = 0;
            p.sem[2 * unit + 1] = 0;
        }
    }
}

template <int NB, int MW_> __global__ void __launch_bounds__(DG_THREADS, dg_cfg<NB, MW_>::PER_SM) k_dgemm(dg_params p)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using C = dg_cfg<NB, MW_>;
    constexpr int MW = C::MW;
    extern __shared__ uint8_t dg_smem_raw[];
    const uint32_t smem0 = ((uint32_t)__cvta_generic_to_shared(dg_smem_raw) + 1023u) & ~1023u;
    const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
    const int g = lane >> 2, q = lane & 3;
    const int S = p.splits, unit = blockIdx.x / S, split = blockIdx.x % S;
    const int a0 = split * p.atoms / S, a1 = (split + 1) * p.atoms / S, ns = a1 - a0;
    dg_tile T[MW];
#pragma unroll
    for (int i = 0; i < MW; i++) T[i] = dg_tile_of(p, unit * MW + i);
    const int in = p.in;

    /* this thread's copies of a stage: A chunk tid + 256 k is row tid / 8 + 32 k (tile k / 4, half
     * k / 2 % 2: compile-time), chunk tid % 8; B chunks likewise below NB x 8 */
    auto load_a = [&](int st) {
        const uint32_t base = smem0 + (uint32_t)((st % C::P) * C::SLOT);
        const int col = (a0 + st) * DG_KA;
#pragma unroll
        for (int k = 0; k < C::A_BYTES / 16 / DG_THREADS; k++) {
            const int idx = tid + k * DG_THREADS, r = idx >> 3, c = idx & 7, rr = r & 63;
            const dg_tile &Tk = T[k >> 2];
            const int h = (k >> 1) & 1;
            const bool ok = rr < (h ? Tk.vrows[1] : Tk.vrows[0]);
            const bf16 *src = ok ? (h ? Tk.wrow[1] : Tk.wrow[0]) + (unsigned)(rr * in + col + c * 8) : p.x;
            dg_cp16(dg_swz(base, r, c), src, ok);
        }
    };
    auto load_b = [&](int st) {
        const uint32_t base = smem0 + (uint32_t)((st % C::P) * C::SLOT + C::A_BYTES);
        const int col = (a0 + st) * DG_KA;
#pragma unroll
        for (int k = 0; k < (NB * 8 + DG_THREADS - 1) / DG_THREADS; k++) {
            const int idx = tid + k * DG_THREADS, r = idx >> 3, c = idx & 7;
            if (idx < NB * 8) {
                const bool ok = r < p.n;
                dg_cp16(dg_swz(base, r, c), p.x + (ok ? (unsigned)(r * in + col + c * 8) : 0u), ok);
            }
        }
    };

    /* prologue: the weights of the first P - 1 stages before the wait (they never depend on the
     * previous kernel), their x after it */
    for (int st = 0; st < C::P - 1; st++)
        if (st < ns) load_a(st);
    dg_commit_cp();
    grid_dep_wait(); /* cuda_launch.h: x is ready, the workspace and outputs are free */
    /* the next kernel may start as this grid's blocks leave (its split blocks wait only for each
     * other, and every block of this grid is resident before the next one can launch) */
    grid_dep_launch(p.trig);
    for (int st = 0; st < C::P - 1; st++)
        if (st < ns) load_b(st);
    dg_commit_cp();

    /* acc[mi]: this warpgroup's 64-row block mi: A rows 64 wg (MW = 1) or 128 wg + 64 mi (MW = 2) */
    float acc[MW][NB / 2];
#pragma unroll
    for (int mi = 0; mi < MW; mi++)
#pragma unroll
        for (int i = 0; i < NB / 2; i++) acc[mi][i] = 0.0f;

    for (int st = 0; st < ns; st++) {
        dg_stage_ready<C::P>(st);
        if (st + C::P - 1 < ns) {
            load_a(st + C::P - 1);
            load_b(st + C::P - 1);
        }
        dg_commit_cp(); /* one group per stage, empty ones too: the wait count stays exact */
        const uint32_t slot = smem0 + (uint32_t)((st % C::P) * C::SLOT);
        const uint64_t db = dg_desc(slot + C::A_BYTES);
        dg_fence();
#pragma unroll
        for (int mi = 0; mi < MW; mi++) {
            const uint64_t da = dg_desc(slot + (uint32_t)((MW * wg + mi) * 64 * 128));
#pragma unroll
            for (int k = 0; k < DG_KA / 16; k++) dg_mma<NB>(acc[mi], da + 2 * k, db + 2 * k); /* +32 bytes a k16 step */
        }
        dg_commit();
        dg_wait0();
#pragma unroll
        for (int mi = 0; mi < MW; mi++)
#pragma unroll
            for (int i = 0; i < NB / 2; i++) asm volatile("" : "+f"(acc[mi][i])::"memory");
    }

    /* acc[mi][4 b + 2 h + j]: row m = 16 warp + g + 8 h of the block's 64-row block (tile, half):
     * MW = 1: (0, wg); MW = 2: (wg, mi); token t = 8 b + 2 q + j */
    if (S > 1 && p.cluster) {
        /* the partials stay on chip: each block's in its own (pipeline) shared memory, once no
         * warpgroup reads a stage any more; the cluster's blocks read each other's (dg_reduce_rows) */
        static_assert(MW * DG_M * NB * 4 <= C::P * C::SLOT, "the partial tiles fit the pipeline's shared memory");
        dg_wait_cp<0>();
        __syncthreads();
        float *part = (float *)(dg_smem_raw + (smem0 - (uint32_t)__cvta_generic_to_shared(dg_smem_raw)));
#pragma unroll
        for (int mi = 0; mi < MW; mi++) {
            const int ti = MW == 1 ? 0 : wg, half = MW == 1 ? wg : mi;
#pragma unroll
            for (int b = 0; b < NB / 8; b++)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int m = 64 * half + 16 * warp + g + 8 * h;
                    *(float2 *)(part + (size_t)(ti * DG_M + m) * NB + 8 * b + 2 * q) =
                        make_float2(acc[mi][4 * b + 2 * h], acc[mi][4 * b + 2 * h + 1]);
                }
        }
        dg_cluster_sync(); /* every block's partials are written */
        dg_reduce_rows<NB, MW, true>(p, T[0], T[MW - 1], unit, split, smem0);
        dg_cluster_sync(); /* no block leaves (its shared memory) while a peer still reads it */
        return;
    }
    if (S > 1) {
#pragma unroll
        for (int mi = 0; mi < MW; mi++) {
            const int ti = MW == 1 ? 0 : wg, half = MW == 1 ? wg : mi;
            float *part = p.ws + (size_t)((unit * MW + ti) * S + split) * DG_M * NB;
#pragma unroll
            for (int b = 0; b < NB / 8; b++)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int m = 64 * half + 16 * warp + g + 8 * h;
                    __stcg((float2 *)(part + (size_t)m * NB + 8 * b + 2 * q),
                           make_float2(acc[mi][4 * b + 2 * h], acc[mi][4 * b + 2 * h + 1]));
                }
        }
        dg_reduce<NB, MW>(p, T[0], T[MW - 1], unit, split);
        return;
    }

    if (p.swiglu) {
        if (MW == 1) {
            /* warpgroup 1 holds up, warpgroup 0 gate of the same 64 rows: up goes through shared
             * memory (the pipeline's, all read by now) */
            float *up = (float *)(dg_smem_raw + (smem0 - (uint32_t)__cvta_generic_to_shared(dg_smem_raw)));
            __syncthreads();
            if (wg == 1)
#pragma unroll
                for (int b = 0; b < NB / 8; b++)
#pragma unroll
                    for (int h = 0; h < 2; h++)
#pragma unroll
                        for (int j = 0; j < 2; j++)
                            up[(16 * warp + g + 8 * h) * (NB + 1) + 8 * b + 2 * q + j] = acc[0][4 * b + 2 * h + j];
            __syncthreads();
            if (wg == 1) return;
        }
        const int tv0 = wg && MW == 2 ? T[MW - 1].vrows[0] : T[0].vrows[0], tr0 = wg && MW == 2 ? T[MW - 1].r0 : T[0].r0;
        const float *up = (const float *)(dg_smem_raw + (smem0 - (uint32_t)__cvta_generic_to_shared(dg_smem_raw)));
#pragma unroll
        for (int b = 0; b < NB / 8; b++)
#pragma unroll
            for (int h = 0; h < 2; h++)
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    const int m = 16 * warp + g + 8 * h, t = 8 * b + 2 * q + j;
                    if (m >= tv0 || t >= p.n) continue;
                    const float a = acc[0][4 * b + 2 * h + j];
                    const float u = MW == 1 ? up[m * (NB + 1) + t] : acc[MW - 1][4 * b + 2 * h + j];
                    const float v = a / (1.0f + expf(-a)) * u; /* as k_swiglu */
                    const size_t f = (size_t)t * p.out[0] + tr0 + m;
                    p.y[0][f] = v;
                    if (p.yh) p.yh[f] = __float2bfloat16(v);
                }
        return;
    }
#pragma unroll
    for (int mi = 0; mi < MW; mi++) {
        const bool t1 = wg && MW == 2;
        const int half = MW == 1 ? wg : mi, part = t1 ? T[MW - 1].part : T[0].part;
        const int tr0 = t1 ? T[MW - 1].r0 : T[0].r0;
        const int vrows = half ? (t1 ? T[MW - 1].vrows[1] : T[0].vrows[1]) : (t1 ? T[MW - 1].vrows[0] : T[0].vrows[0]);
        const float *bias = p.bias[part];
        float *y = p.y[part];
        const int out = p.out[part];
#pragma unroll
        for (int b = 0; b < NB / 8; b++)
#pragma unroll
            for (int h = 0; h < 2; h++)
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    const int m = 16 * warp + g + 8 * h, t = 8 * b + 2 * q + j;
                    if (m >= vrows || t >= p.n) continue;
                    const int r = tr0 + 64 * half + m;
                    const float a = acc[mi][4 * b + 2 * h + j];
                    y[(size_t)t * out + r] = bias ? a + bias[r] : a;
                }
    }
#else
    /* built only for sm_90a; kvs_cu_dgemm_supported keeps other devices away */
    __trap();
#endif
}

/* ---- k_dgemm_n: the weights on the wgmma's N side, K never split (variant bit 32) ----------
 *
 * For the launches k_dgemm would split (q/k/v, o, down: 32-48 tiles of 128 rows on 132 SMs): a
 * block owns R weight rows (32, 48 or 64: the least that keeps the tiles within one per SM) as the
 * wgmma's N, and the n <= 64 tokens as its M (64 rows of x; rows past n are never copied, so their
 * accumulators hold garbage that is never stored: a row of D depends on its row of A alone). It
 * streams the whole of K, two 64-column atoms a stage (a block moves only R x 256 bytes of
 * weights a stage, so the per-stage barrier and copy issue are paid over two atoms), 6-8 stages
 * deep (~195 KB of shared memory, one block per SM), so no partial sums leave the block: no
 * workspace, no counters, no second pass. x is re-read from L2 by every block (n / R of the
 * weight bytes). A row's sum runs over the atoms in order whatever n (batch invariance); R is a
 * function of the launch's shapes only. */
/* XR: the x rows a stage holds: 64, or (kvs_cu_dgemm_n's x_fit, variant bits 128 / 256) 16 at
 * n <= 16 / 32 at n <= 32. The wgmma still reads 64 rows of A from an atom's address: past XR
 * rows it reads whatever follows in the same slot (the next atom's x, the weights), which lands
 * only in the accumulator rows of tokens >= n, never stored; the slot is at least 8 KB past every
 * A atom's start, so those reads stay in the block's shared memory and in a slot no copy writes
 * while it is read. The bytes saved go to the weights: 4 atoms a stage, up to 8 stages, so with
 * 16-row x tiles 96-120 KB of weights are in flight per SM instead of 56-80 (k_dgemm's unsplit
 * launches, 2,750-2,970 GB/s, keep ~96 KB). */
template <int R, int XR> struct dn_cfg {
    static constexpr int AS = XR == 64 ? 2 : 4;     /* atoms a stage */
    static constexpr int A_BYTES = XR * DG_KA * 2;  /* x: XR token rows of one atom */
    static constexpr int B_BYTES = R * DG_KA * 2;   /* weights: R rows of one atom (a multiple of 8: 1 KB groups) */
    static constexpr int SLOT = AS * (A_BYTES + B_BYTES); /* [A atom 0..AS-1][B atom 0..AS-1] */
    static constexpr int P0 = 196 * 1024 / SLOT;
    static constexpr int P = P0 > 8 ? 8 : P0;        /* cp.async.wait_group counts of at most 6 */
    static constexpr int SMEM = P * SLOT + 1024;
    static constexpr int THREADS = 128;
    static_assert(SLOT - (AS - 1) * A_BYTES >= 64 * DG_KA * 2, "a 64-row read of any A atom stays in its slot");
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
template <int R> __device__ __forceinline__ void dn_mma(float *acc, uint64_t da, uint64_t db)
{
    if constexpr (R == 32) dg_wgmma_n32(acc, da, db);
    else if constexpr (R == 48) dg_wgmma_n48(acc, da, db);
    else dg_wgmma_n64(acc, da, db);
}
#endif

template <int R, int XR> __global__ void __launch_bounds__(dn_cfg<R, XR>::THREADS, 1) k_dgemm_n(dg_params p)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using C = dn_cfg<R, XR>;
    extern __shared__ uint8_t dg_smem_raw[];
    const uint32_t smem0 = ((uint32_t)__cvta_generic_to_shared(dg_smem_raw) + 1023u) & ~1023u;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    int tile = blockIdx.x, part = 0;
    while (part + 1 < p.n_parts && tile >= p.tiles[part]) tile -= p.tiles[part++];
    const int r0 = tile * R, vrows = min(R, p.out[part] - r0), in = p.in, na = p.atoms;
    const int ns = na / C::AS; /* stages (K is a multiple of AS atoms: kvs_cu_dgemm_n_rows, kvs_cu_dgemm_n) */
    const bf16 *wrow = p.w[part] + (size_t)r0 * in;

    /* a stage's copies: R x 8 weight chunks and n x 8 x chunks of 16 bytes an atom, over 128
     * threads */
    auto load_w = [&](int st) {
#pragma unroll
        for (int a = 0; a < C::AS; a++) {
            const int at = st * C::AS + a;
            const uint32_t base = smem0 + (uint32_t)((st % C::P) * C::SLOT + C::AS * C::A_BYTES + a * C::B_BYTES);
            const int col = at * DG_KA;
#pragma unroll
            for (int k = 0; k < R * 8 / C::THREADS; k++) {
                const int idx = tid + k * C::THREADS, r = idx >> 3, c = idx & 7;
                const bool ok = r < vrows;
                dg_cp16(dg_swz(base, r, c), ok ? wrow + (size_t)r * in + col + c * 8 : p.x, ok);
            }
        }
    };
    auto load_x = [&](int st) {
#pragma unroll
        for (int a = 0; a < C::AS; a++) {
            const int at = st * C::AS + a;
            const uint32_t base = smem0 + (uint32_t)((st % C::P) * C::SLOT + a * C::A_BYTES);
            const int col = at * DG_KA;
#pragma unroll
            for (int k = 0; k < XR * 8 / C::THREADS; k++) {
                const int idx = tid + k * C::THREADS, r = idx >> 3, c = idx & 7;
                if (r < p.n) dg_cp16(dg_swz(base, r, c), p.x + (size_t)r * in + col + c * 8, true);
            }
        }
    };

    /* as k_dgemm: the weights of the first P - 1 stages before the wait, their x after it */
    for (int st = 0; st < C::P - 1; st++)
        if (st < ns) load_w(st);
    dg_commit_cp();
    grid_dep_wait(); /* cuda_launch.h: x is ready, the outputs are free */
    grid_dep_launch(p.trig);
    for (int st = 0; st < C::P - 1; st++)
        if (st < ns) load_x(st);
    dg_commit_cp();

    float acc[R / 2];
#pragma unroll
    for (int i = 0; i < R / 2; i++) acc[i] = 0.0f;
    for (int st = 0; st < ns; st++) {
        dg_stage_ready<C::P>(st);
        if (st + C::P - 1 < ns) {
            load_w(st + C::P - 1);
            load_x(st + C::P - 1);
        }
        dg_commit_cp();
        const uint32_t slot = smem0 + (uint32_t)((st % C::P) * C::SLOT);
        dg_fence();
#pragma unroll
        for (int a = 0; a < C::AS; a++) {
            const uint64_t da = dg_desc(slot + (uint32_t)(a * C::A_BYTES));
            const uint64_t db = dg_desc(slot + (uint32_t)(C::AS * C::A_BYTES + a * C::B_BYTES));
#pragma unroll
            for (int k = 0; k < DG_KA / 16; k++) dn_mma<R>(acc, da + 2 * k, db + 2 * k); /* +32 bytes a k16 step */
        }
        dg_commit();
        dg_wait0();
#pragma unroll
        for (int i = 0; i < R / 2; i++) asm volatile("" : "+f"(acc[i])::"memory");
    }

    /* acc[4 b + 2 h + j]: token t = 16 warp + g + 8 h, weight row r0 + 8 b + 2 q + j */
    const float *bias = p.bias[part];
    float *y = p.y[part];
    const int out = p.out[part];
#pragma unroll
    for (int b = 0; b < R / 8; b++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int t = 16 * warp + g + 8 * h;
            if (t >= p.n) continue;
#pragma unroll
            for (int j = 0; j < 2; j++) {
                const int r = 8 * b + 2 * q + j;
                if (r >= vrows) continue;
                const float a = acc[4 * b + 2 * h + j];
                y[(size_t)t * out + r0 + r] = bias ? a + bias[r0 + r] : a;
            }
        }
#else
    __trap();
#endif
}

/* the K splits of a launch of `tiles` 128-row tiles: as many as keep the grid within one wave both
 * for blocks of one tile (two per SM) and of two tiles (one per SM), times per_sm / 2; at least 2
 * atoms a split, at most 16. A function of the launch's shapes (not n): batch invariance. The
 * one-wave grid is what lets a split's blocks wait for each other (dg_reduce). */
static int dg_splits(int tiles, int atoms, int n_sms, int per_sm)
{
    int s = per_sm * n_sms / tiles;
    const int pairs = (tiles + 1) / 2, s2 = per_sm * n_sms / (2 * pairs);
    if (s2 < s) s = s2;
    if (s > atoms / 2) s = atoms / 2;
    if (s > 16) s = 16;
    return s < 1 ? 1 : s;
}

int kvs_cu_dgemm_supported(int n, int in, const int *out, int n_parts, int swiglu)
{
    if (n < 1 || n > 128 || in <= 0 || in % DG_KA != 0) return 0;
    if (swiglu) return n_parts == 2 && out[0] > 0 && out[0] % 8 == 0 && out[1] == out[0];
    if (n_parts < 1 || n_parts > KVS_SKINNY_MAX_PARTS) return 0;
    for (int i = 0; i < n_parts; i++)
        if (out[i] <= 0 || out[i] % 8 != 0) return 0;
    return 1;
}

size_t kvs_cu_dgemm_ws_floats(int n_sms)
{
    return (size_t)2 * n_sms * DG_M * 128;
}

/* raises the kernel's shared-memory limit (once per device: tensor parallelism has several in a
 * process; a lost update of the mask only sets it again) and returns in *fits whether the blocks
 * per SM that the split plan counts on are resident at once */
template <int NB, int MW> static cudaError_t dg_prepare(int *fits)
{
    static unsigned attr_set = 0, fit_mask = 0;
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess) return e;
    if (dev >= 32 || !(attr_set >> dev & 1u)) {
        e = cudaFuncSetAttribute(k_dgemm<NB, MW>, cudaFuncAttributeMaxDynamicSharedMemorySize, dg_cfg<NB, MW>::SMEM);
        if (e != cudaSuccess) return e;
        int nb = 0;
        e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&nb, k_dgemm<NB, MW>, DG_THREADS, dg_cfg<NB, MW>::SMEM);
        if (e != cudaSuccess) return e;
        if (dev < 32) {
            if (nb >= dg_cfg<NB, MW>::PER_SM) fit_mask |= 1u << dev;
            attr_set |= 1u << dev;
        }
        *fits = nb >= dg_cfg<NB, MW>::PER_SM;
        return cudaSuccess;
    }
    *fits = fit_mask >> dev & 1u;
    return cudaSuccess;
}

/* kvs_cu_launch (cuda_launch.h) with clusters of cluster_x blocks along x (grid.x a multiple of
 * it): the blocks of a cluster run at once and share their shared memory (dg_reduce_rows) */
template <int NB, int MW>
static cudaError_t dg_launch_cluster(dim3 grid, unsigned cluster_x, cudaStream_t stream, const dg_params &p)
{
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = dim3(DG_THREADS);
    cfg.dynamicSmemBytes = (size_t)dg_cfg<NB, MW>::SMEM;
    cfg.stream = stream;
    cudaLaunchAttribute at[2];
    at[0].id = cudaLaunchAttributeClusterDimension;
    at[0].val.clusterDim.x = cluster_x;
    at[0].val.clusterDim.y = 1;
    at[0].val.clusterDim.z = 1;
    at[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[1].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = at;
    cfg.numAttrs = kvs_cu_pdl_enabled() ? 2 : 1;
    return cudaLaunchKernelEx(&cfg, k_dgemm<NB, MW>, p);
}

template <int NB, int MW> static cudaError_t dg_launch_mw(dg_params &p, int tiles, cudaStream_t stream)
{
    int fits = 0;
    const cudaError_t e = dg_prepare<NB, MW>(&fits);
    if (e != cudaSuccess) return e;
    if (!fits) p.splits = 1; /* never on an H100 / H200; waiting splits need their one wave */
    const int units = (tiles + MW - 1) / MW;
    const unsigned blocks = (unsigned)(units * p.splits);
    /* a unit's splits as one cluster: at most 8 blocks (the portable cluster size) */
    if (p.cluster && p.splits > 1 && p.splits <= 8)
        return dg_launch_cluster<NB, MW>(dim3(blocks), (unsigned)p.splits, stream, p);
    p.cluster = 0;
    return kvs_cu_launch(k_dgemm<NB, MW>, dim3(blocks), dim3(DG_THREADS), (size_t)dg_cfg<NB, MW>::SMEM, stream, p);
}

/* one_tile: blocks of one tile at 64-128 tokens too (dg_cfg); the split plan (dg_splits) keeps a
 * grid of either block size within one wave, so it holds for both */
template <int NB> static cudaError_t dg_launch(dg_params &p, int tiles, int one_tile, cudaStream_t stream)
{
    if (dg_mw<NB>() == 2 && one_tile) return dg_launch_mw<NB, 1>(p, tiles, stream);
    return dg_launch_mw<NB, dg_mw<NB>()>(p, tiles, stream);
}

/* 128-row tiles of a launch (SwiGLU: 64 gate + 64 up rows a tile) */
static int dg_tiles(const int *out, int n_parts, int swiglu)
{
    if (swiglu) return (out[0] + 63) / 64;
    int tiles = 0;
    for (int i = 0; i < n_parts; i++) tiles += (out[i] + DG_M - 1) / DG_M;
    return tiles;
}

/* The launch parameters both decode-GEMM kernels share: the input, the parts (weights, bias,
 * outputs) and each part's tiles of tile_rows output rows (their sum in *tiles), the K atoms and
 * the early-launch bit; the caller sets the rest (splits, SwiGLU, cluster). */
static dg_params dg_params_of(const struct kvs_cu_skinny *a, int tile_rows, int *tiles)
{
    dg_params p = {};
    /* one-row launches (batch 1, bit 512) keep the GEMV's rule: no early launch (cuda_skinny.cu) */
    p.trig = (kvs_cu_pdl_early() & 1) && a->n >= 2;
    p.x = a->x;
    p.n = a->n;
    p.in = a->in;
    p.n_parts = a->n_parts;
    p.atoms = a->in / DG_KA;
    *tiles = 0;
    for (int i = 0; i < a->n_parts; i++) {
        p.w[i] = a->w[i];
        p.bias[i] = a->bias[i];
        p.out[i] = a->out[i];
        p.y[i] = a->y[i];
        p.tiles[i] = (a->out[i] + tile_rows - 1) / tile_rows;
        *tiles += p.tiles[i];
    }
    return p;
}

int kvs_cu_dgemm_splits(int in, const int *out, int n_parts, int swiglu, int n_sms, int per_sm)
{
    return dg_splits(dg_tiles(out, n_parts, swiglu), in / DG_KA, n_sms, per_sm);
}

cudaError_t kvs_cu_dgemm(const struct kvs_cu_skinny *a, const struct kvs_cu_dgemm_ws *ws, int per_sm, int cluster,
                         int one_tile, cudaStream_t stream)
{
    int tiles;
    dg_params p = dg_params_of(a, DG_M, &tiles);
    p.cluster = cluster;
    p.swiglu = a->swiglu;
    p.yh = a->yh;
    if (a->swiglu) tiles = (a->out[0] + 63) / 64;
    p.splits = dg_splits(tiles, p.atoms, ws->n_sms, per_sm);
    /* the workspace holds a partial tile per block of a one-tile wave and two counters a tile */
    if ((size_t)tiles * p.splits * DG_M * 128 > ws->floats || 2 * tiles > ws->n_sems) p.splits = 1;
    p.ws = ws->ws;
    p.sem = ws->sem;
    const int nb = a->n <= 8 ? 8 : a->n <= 16 ? 16 : a->n <= 32 ? 32 : a->n <= 64 ? 64 : 128;
    switch (nb) {
    case 8: return dg_launch<8>(p, tiles, one_tile, stream);
    case 16: return dg_launch<16>(p, tiles, one_tile, stream);
    case 32: return dg_launch<32>(p, tiles, one_tile, stream);
    case 64: return dg_launch<64>(p, tiles, one_tile, stream);
    default: return dg_launch<128>(p, tiles, one_tile, stream);
    }
}

/* k_dgemm_n's rows a block for this launch, or 0 where it does not apply: 1..64 tokens, plain
 * parts (not SwiGLU), K a multiple of a stage (two atoms, 128), and at most one block per SM with
 * 64 rows a block */
int kvs_cu_dgemm_n_rows(int n, int in, const int *out, int n_parts, int swiglu, int n_sms)
{
    if (swiglu || n < 1 || n > 64 || in % (2 * DG_KA) != 0 || !kvs_cu_dgemm_supported(n, in, out, n_parts, swiglu))
        return 0;
    static const int rs[3] = {32, 48, 64};
    for (int i = 0; i < 3; i++) {
        int tiles = 0;
        for (int k = 0; k < n_parts; k++) tiles += (out[k] + rs[i] - 1) / rs[i];
        if (tiles <= n_sms) return rs[i];
    }
    return 0;
}

template <int R, int XR> static cudaError_t dn_launch_x(dg_params &p, int tiles, cudaStream_t stream)
{
    static unsigned attr_set = 0;
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess) return e;
    if (dev >= 32 || !(attr_set >> dev & 1u)) {
        e = cudaFuncSetAttribute(k_dgemm_n<R, XR>, cudaFuncAttributeMaxDynamicSharedMemorySize, dn_cfg<R, XR>::SMEM);
        if (e != cudaSuccess) return e;
        if (dev < 32) attr_set |= 1u << dev;
    }
    return kvs_cu_launch(k_dgemm_n<R, XR>, dim3((unsigned)tiles), dim3(dn_cfg<R, XR>::THREADS),
                         (size_t)dn_cfg<R, XR>::SMEM, stream, p);
}

template <int R> static cudaError_t dn_launch(dg_params &p, int tiles, int xr, cudaStream_t stream)
{
    if (xr == 16) return dn_launch_x<R, 16>(p, tiles, stream);
    if (xr == 32) return dn_launch_x<R, 32>(p, tiles, stream);
    return dn_launch_x<R, 64>(p, tiles, stream);
}

cudaError_t kvs_cu_dgemm_n(const struct kvs_cu_skinny *a, int rows, int x_fit, cudaStream_t stream)
{
    int tiles;
    dg_params p = dg_params_of(a, rows, &tiles);
    p.splits = 1;
    /* x_fit: x tiles of 16 rows (bit 1, n <= 16) or 32 (bit 2, n <= 32) where K is a multiple of
     * their 4-atom stages (the order of the additions is the same: atom by atom, whatever the stage) */
    int xr = 64;
    if (a->in % (4 * DG_KA) == 0) {
        if ((x_fit & 1) && a->n <= 16) xr = 16;
        else if ((x_fit & 2) && a->n <= 32) xr = 32;
    }
    switch (rows) {
    case 32: return dn_launch<32>(p, tiles, xr, stream);
    case 48: return dn_launch<48>(p, tiles, xr, stream);
    default: return dn_launch<64>(p, tiles, xr, stream);
    }
}
