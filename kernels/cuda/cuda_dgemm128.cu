/* cuda_dgemm128.cu: k_dgemm_n2, the decode GEMM's Hopper kernel for 65 to 128 token rows
 * (cuda_skinny.h, kvs_cu_dgemm_n2; variant bits 1024 / 2048 / 4096 of cuda_skinny.cu), and
 * k_dgemm_n3 (below: the same with x shared by a thread-block cluster; bits 16384 / 32768).
 * Neither is in the default variant (measurements: bench/RESULTS.md, dec9 and dec10).
 *
 * Why: at 65-128 rows the decode GEMMs went to cuBLAS (k_dgemm_n takes at most 64 tokens, the
 * wgmma's M; two launches of 64 read every weight twice), and cuBLAS reads q/k/v there at ~1,725
 * GB/s, o at ~2,200 and gate/up + down at ~2,430 (bench/RESULTS.md, decode6), against ~2,900 for
 * the batch-1 GEMV. This is k_dgemm_n (cuda_dgemm.cu: the weights on the wgmma's N side, the whole
 * of K a block, no split, no workspace) with two consumer warpgroups: warpgroup w multiplies tokens
 * 64 w .. 64 w + 63 (its M = 64) by the same weight tile in shared memory, so each weight byte is
 * read from DRAM once for all 128 tokens.
 *
 * The price is x: a block re-reads all n tokens' x from L2 (n / N of its weight bytes), and x
 * takes 16 KB of shared memory an atom (64 K columns x 128 rows). So x and the weights get rings
 * of their own depth: PX atoms of x (4-5: x comes from L2), PW atoms of weights (as many as the
 * rest of ~210 KB holds: 5 atoms of a 224-row tile, 36 of a 32-row one), the weights issued PW - 1
 * atoms ahead (the first ones before the grid dependency wait: they never depend on the previous
 * kernel), x PX - 1 ahead. One cp.async group an atom; x's groups are the younger, so waiting for
 * x's atom (wait_group PX - 2) also covers its weights.
 *
 * SwiGLU (gate/up): a tile's N rows are h = N / 2 gate rows and the same h up rows, so a thread
 * holds gate row r and up row r + h of its tokens in registers (accumulator blocks b and b + h / 8)
 * and applies the epilogue there (as k_swiglu: y = silu(gate) * up, and the bf16 copy).
 *
 * A row's sum runs over the K atoms in order (k16 steps within each) whatever n: the same order
 * as k_dgemm_n's, though not necessarily the same bits (another wgmma N may group the MMA's
 * internal sums otherwise; not relied on). Batch-invariant mode (variant bit 512) never routes
 * here (cuda_skinny.cu). Built for sm_90a only; other devices never take it
 * (kvs_cu_dgemm_n2_rows needs the wgmma kernels' SM count, which the backend gives only there).
 */
#include <cuda.h> /* CUtensorMap (types only: the encoder is reached through the runtime) */
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/cuda/cuda_launch.h"
#include "kernels/cuda/cuda_skinny.h"
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#include "kernels/cuda/cuda_dgemm_wgmma.cuh"
#endif

typedef __nv_bfloat16 bf16;

#define D2_KA 64          /* K columns an atom: one 128-byte swizzle row */
#define D2_TOK 128        /* token rows a block: two warpgroups of the wgmma's M = 64 */
#define D2_THREADS 256
#define D2_SMEM_BUDGET (210 * 1024)
/* flags in kvs_cu_dgemm_n2's rows (cuda_skinny.h): the deeper x ring (d2_cfg's DX); x shared by
 * clusters of 2 / 4 blocks (k_dgemm_n3, below) */
#define KVS_DGEMM_N2_DEEP_X 4096
#define KVS_DGEMM_N2_CL2 8192
#define KVS_DGEMM_N2_CL4 16384

struct d2_params {
    const bf16 *x;
    int n, in, atoms, swiglu, n_parts;
    int tiles[KVS_SKINNY_MAX_PARTS];       /* N-row tiles of each part (plain) */
    const bf16 *w[KVS_SKINNY_MAX_PARTS];
    const float *bias[KVS_SKINNY_MAX_PARTS];
    int out[KVS_SKINNY_MAX_PARTS];
    float *y[KVS_SKINNY_MAX_PARTS];
    bf16 *yh;
    int trig;                              /* kvs_cu_pdl_early(): grid_dep_launch after the wait */
};

/* N: the weight rows of a tile (SwiGLU: N / 2 gate + N / 2 up rows); DX: a deeper x ring for
 * tiles of at most 96 rows (8 atoms, 128 KB, instead of 5: at 32-64 rows a tile, x is 2-4 times
 * the weight bytes; variant bit 8192; tiles of 96 rows keep 5: 8 would leave fewer weight atoms) */
template <int N, bool DX = false> struct d2_cfg {
    static constexpr int X_BYTES = D2_TOK * D2_KA * 2;   /* 16 KB: an atom of x */
    static constexpr int W_BYTES = N * D2_KA * 2;        /* an atom of the tile's weights (N % 8 == 0: 1 KB groups) */
    static constexpr int PX = N >= 128 ? 4 : DX && N <= 64 ? 8 : 5;
    static constexpr int PW0 = (D2_SMEM_BUDGET - PX * X_BYTES) / W_BYTES;
    static constexpr int PW = PW0 > 40 ? 40 : PW0;
    static constexpr int SMEM = PX * X_BYTES + PW * W_BYTES + 1024; /* + alignment to 1024 bytes */
    static constexpr int KW = (N * 8 + D2_THREADS - 1) / D2_THREADS; /* weight chunks a thread an atom */
    static_assert(PW >= PX, "weights are issued no later than x (one wait covers both)");
    static_assert(N % 8 == 0, "tiles of whole 8-row swizzle groups");
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
/* D[64 x 96] += A . B, both from shared memory (descriptors), K-major (generated like
 * cuda_dgemm_wgmma.cuh's: every accumulator register listed) */
static __device__ __forceinline__ void d2_wgmma_n96(float *d, uint64_t da, uint64_t db)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n96k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}, %48, %49, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
                 : "l"(da), "l"(db));
}

/* D[64 x 224] += A . B, both from shared memory (descriptors), K-major (generated like
 * cuda_dgemm_wgmma.cuh's: every accumulator register listed) */
static __device__ __forceinline__ void d2_wgmma_n224(float *d, uint64_t da, uint64_t db)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n224k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111}, %112, %113, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111])
                 : "l"(da), "l"(db));
}

template <int N> __device__ __forceinline__ void d2_mma(float *acc, uint64_t da, uint64_t db)
{
    if constexpr (N == 32) dg_wgmma_n32(acc, da, db);
    else if constexpr (N == 48) dg_wgmma_n48(acc, da, db);
    else if constexpr (N == 64) dg_wgmma_n64(acc, da, db);
    else if constexpr (N == 96) d2_wgmma_n96(acc, da, db);
    else if constexpr (N == 128) dg_wgmma_n128(acc, da, db);
    else d2_wgmma_n224(acc, da, db);
}
#endif

__device__ __forceinline__ void d2_cp16(uint32_t dst, const void *src, bool ok)
{
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void d2_commit_cp() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

/* 16-byte chunk c (0..7) of row r in a 128-byte-swizzled tile at base (1024-byte aligned) */
__device__ __forceinline__ uint32_t d2_swz(uint32_t base, int r, int c)
{
    return base + (uint32_t)(r * 128 + ((c ^ (r & 7)) << 4));
}

/* The epilogue of k_dgemm_n2 and k_dgemm_n3 (P: d2_params or d3_params): acc[4 b + 2 h + j] is
 * token t0 + g + 8 h (t0: the warp's first token), tile row 8 b + 2 q + j; SW: gate rows in the
 * first half of the tile, up rows in the second, stored as SwiGLU (as k_swiglu) in p.y[0] (and
 * bf16 in p.yh); else rows r0 + 8 b + 2 q + j of part `part` (+ its bias) */
template <int N, bool SW, class P>
__device__ __forceinline__ void d2_store(const P &p, const float (&acc)[N / 2], int t0, int g, int q, int r0, int part,
                                         int out)
{
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int t = t0 + g + 8 * h;
        if (t >= p.n) continue;
        if (SW) {
#pragma unroll
            for (int b = 0; b < N / 16; b++)
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    const int f = r0 + 8 * b + 2 * q + j;
                    if (f >= out) continue;
                    const float a = acc[4 * b + 2 * h + j], u = acc[4 * (b + N / 16) + 2 * h + j];
                    const float v = a / (1.0f + expf(-a)) * u; /* as k_swiglu */
                    p.y[0][(size_t)t * out + f] = v;
                    if (p.yh) p.yh[(size_t)t * out + f] = __float2bfloat16(v);
                }
        } else {
            const float *bias = p.bias[part];
            float *y = p.y[part] + (size_t)t * out;
#pragma unroll
            for (int b = 0; b < N / 8; b++)
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    const int r = r0 + 8 * b + 2 * q + j;
                    if (r >= out) continue;
                    const float a = acc[4 * b + 2 * h + j];
                    y[r] = bias ? a + bias[r] : a;
                }
        }
    }
}

template <int N, bool SW, bool DX> __global__ void __launch_bounds__(D2_THREADS, 1) k_dgemm_n2(d2_params p)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using C = d2_cfg<N, DX>;
    extern __shared__ uint8_t d2_smem_raw[];
    const uint32_t smem0 = ((uint32_t)__cvta_generic_to_shared(d2_smem_raw) + 1023u) & ~1023u;
    const uint32_t xring = smem0, wring = smem0 + (uint32_t)(C::PX * C::X_BYTES);
    const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
    const int g = lane >> 2, q = lane & 3;
    const int in = p.in, na = p.atoms;

    /* this block's tile and the source of each weight row this thread copies (row idx / 8,
     * chunk idx % 8 of every atom): plain, rows r0 .. r0 + N - 1 of one part; SwiGLU, gate rows
     * f0 .. f0 + h - 1 then the same up rows */
    int tile = blockIdx.x, part = 0;
    if (!SW)
        while (part + 1 < p.n_parts && tile >= p.tiles[part]) tile -= p.tiles[part++];
    const int r0 = tile * (SW ? N / 2 : N), out = p.out[part];
    const bf16 *wsrc[C::KW];
    bool wok[C::KW];
#pragma unroll
    for (int k = 0; k < C::KW; k++) {
        const int idx = tid + k * D2_THREADS, r = idx >> 3, c = idx & 7;
        int row = r0 + r;
        const bf16 *w = p.w[part];
        if (SW && r >= N / 2) {
            row -= N / 2;
            w = p.w[1];
        }
        wok[k] = idx < N * 8 && row < out;
        wsrc[k] = wok[k] ? w + (size_t)row * in + c * 8 : p.x;
    }
    auto load_w = [&](int at) {
        const uint32_t base = wring + (uint32_t)((at % C::PW) * C::W_BYTES);
#pragma unroll
        for (int k = 0; k < C::KW; k++) {
            const int idx = tid + k * D2_THREADS;
            if (idx < N * 8) d2_cp16(d2_swz(base, idx >> 3, idx & 7), wsrc[k] + (wok[k] ? at * D2_KA : 0), wok[k]);
        }
    };
    /* x: rows past n are not copied; the wgmma reads whatever the slot held, which lands only in
     * the accumulator rows of tokens >= n (a row of D depends on its row of A alone), never stored */
    auto load_x = [&](int at) {
        const uint32_t base = xring + (uint32_t)((at % C::PX) * C::X_BYTES);
#pragma unroll
        for (int k = 0; k < D2_TOK * 8 / D2_THREADS; k++) {
            const int idx = tid + k * D2_THREADS, r = idx >> 3, c = idx & 7;
            if (r < p.n) d2_cp16(d2_swz(base, r, c), p.x + (size_t)r * in + (size_t)at * D2_KA + c * 8, true);
        }
    };

    /* prologue: weights of atoms 0 .. PW - 2 before the wait (one group), x of atoms 0 .. PX - 2
     * after it (a group each) */
    for (int at = 0; at < C::PW - 1; at++)
        if (at < na) load_w(at);
    d2_commit_cp();
    grid_dep_wait(); /* cuda_launch.h: x is ready, the outputs are free */
    grid_dep_launch(p.trig);
    for (int at = 0; at < C::PX - 1; at++) {
        if (at < na) load_x(at);
        d2_commit_cp();
    }

    float acc[N / 2];
#pragma unroll
    for (int i = 0; i < N / 2; i++) acc[i] = 0.0f;
    for (int at = 0; at < na; at++) {
        /* x of atom `at` is in the group PX - 2 from the youngest (the prologue's or the loop's, one
         * an atom); its weights in an older one */
        asm volatile("cp.async.wait_group %0;\n" ::"n"(C::PX - 2) : "memory");
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); /* cp.async data -> wgmma */
        __syncthreads(); /* and atom at - 1's slots are read by no one: refill them */
        if (at + C::PW - 1 < na) load_w(at + C::PW - 1);
        if (at + C::PX - 1 < na) load_x(at + C::PX - 1);
        d2_commit_cp(); /* one group an atom, empty ones too: the wait count stays exact */
        const uint64_t da = dg_desc(xring + (uint32_t)((at % C::PX) * C::X_BYTES + wg * 64 * 128));
        const uint64_t db = dg_desc(wring + (uint32_t)((at % C::PW) * C::W_BYTES));
        dg_fence();
#pragma unroll
        for (int k = 0; k < D2_KA / 16; k++) d2_mma<N>(acc, da + 2 * k, db + 2 * k); /* +32 bytes a k16 step */
        dg_commit();
        dg_wait0();
#pragma unroll
        for (int i = 0; i < N / 2; i++) asm volatile("" : "+f"(acc[i])::"memory");
    }

    d2_store<N, SW>(p, acc, 64 * wg + 16 * warp, g, q, r0, part, out);
#else
    /* built only for sm_90a; kvs_cu_dgemm_n2_rows keeps other devices away */
    __trap();
#endif
}

/* plain tiles: the least N of {32, 48, 64, 96} (wide: of {64, 96}) that keeps the launch within
 * one block per SM, else 96 (more than one wave: still correct); SwiGLU: h = 64 or 112 gate rows
 * (N = 128 / 224) by the same rule. A function of the launch's shapes, not of n. */
int kvs_cu_dgemm_n2_rows(int n, int in, const int *out, int n_parts, int swiglu, int n_sms, int wide)
{
    if (n <= 64 || n > D2_TOK || n_sms <= 0 || in % D2_KA != 0 || !kvs_cu_dgemm_supported(n, in, out, n_parts, swiglu))
        return 0;
    if (swiglu) return (out[0] + 63) / 64 <= n_sms ? 128 : 224;
    static const int rs[4] = {32, 48, 64, 96};
    for (int i = wide ? 2 : 0; i < 4; i++) {
        int tiles = 0;
        for (int k = 0; k < n_parts; k++) tiles += (out[k] + rs[i] - 1) / rs[i];
        if (tiles <= n_sms) return rs[i];
    }
    return 96;
}

template <int N, bool SW, bool DX = false>
static cudaError_t d2_launch(const d2_params &p, int tiles, cudaStream_t stream)
{
    static unsigned attr_set = 0; /* per device (tensor parallelism); a lost update only sets it again */
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess) return e;
    if (dev >= 32 || !(attr_set >> dev & 1u)) {
        e = cudaFuncSetAttribute(k_dgemm_n2<N, SW, DX>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 d2_cfg<N, DX>::SMEM);
        if (e != cudaSuccess) return e;
        if (dev < 32) attr_set |= 1u << dev;
    }
    return kvs_cu_launch(k_dgemm_n2<N, SW, DX>, dim3((unsigned)tiles), dim3(D2_THREADS), (size_t)d2_cfg<N, DX>::SMEM,
                         stream, p);
}

/* ---- k_dgemm_n3: k_dgemm_n2 with x shared by a cluster (variant bits 16384 / 32768) ----------
 *
 * Why: k_dgemm_n2 waits on x (ncu, bench/RESULTS.md dec9): with 32-48 weight rows a block, every
 * block reads all 128 tokens' x from L2, 2.7-4 times its weight bytes. Here C = 2 or 4 blocks with
 * neighbouring weight tiles form a cluster and share x: each block fetches 128 / C rows of every x
 * atom with the copy engine (cp.async.bulk.tensor, 128-byte swizzle: the layout the wgmma reads)
 * and multicasts them into the same slot of every block of the cluster, so x's L2 reads drop by C.
 * The weights come by the copy engine too (a box of the tile's N rows a K atom; SwiGLU: N / 2 gate
 * rows and the same up rows), with an evict-first L2 hint (x should stay in L2; the weights are
 * read once). Rows past n (x) and past a part's end (weights) are filled with zeros by the copy
 * engine, and never stored.
 *
 * Block: warps 0-7 are two consumer warpgroups (warpgroup w multiplies tokens 64 w .. 64 w + 63 by
 * the tile, as k_dgemm_n2), warp 8's lane 0 the producer. Rings: PX atoms of x, PW of weights,
 * each slot with a "full" mbarrier (the producer's expected bytes, then the copies' completion)
 * and an "empty" one. A weight slot is free when the block's 8 consumer warps have arrived; an x
 * slot only when the 8 warps of every block of the cluster have (each warp arrives on that slot's
 * barrier in every block: a peer's multicast writes into this block's slot too). Consumers keep one
 * atom's wgmma in flight (wait_group 1) and free atom at - 1's slots once it has completed.
 * The cluster's barrier follows the mbarriers' initialisation (a peer's copy or arrival may come
 * first otherwise) and precedes the exit (a peer may still arrive on this block's barriers).
 *
 * A row's sum runs over the K atoms in order, k16 steps within each: k_dgemm_n2's order, and for
 * the same N the same bits. N (and C) is a function of the launch's shapes, not of n: a row's bits
 * do not depend on n. Batch-invariant mode (bit 512) never routes here. */
#define D3_THREADS 288 /* two consumer warpgroups + the producer warp */
#define D3_SMEM_BUDGET (220 * 1024)

struct d3_params {
    CUtensorMap tx;                        /* x [n][in]: boxes of 64 columns x 128 / C rows */
    CUtensorMap tw[KVS_SKINNY_MAX_PARTS];  /* weights [out][in]: boxes of 64 x N (SwiGLU: gate, up, 64 x N / 2) */
    int n, atoms, n_parts;
    int tiles[KVS_SKINNY_MAX_PARTS];
    const float *bias[KVS_SKINNY_MAX_PARTS];
    int out[KVS_SKINNY_MAX_PARTS];
    float *y[KVS_SKINNY_MAX_PARTS];
    bf16 *yh;
    int trig;
};

template <int N> struct d3_cfg {
    static constexpr int X_BYTES = D2_TOK * D2_KA * 2;
    static constexpr int W_BYTES = N * D2_KA * 2;
    static constexpr int PX = N >= 128 ? 4 : 6;
    static constexpr int PW0 = (D3_SMEM_BUDGET - PX * X_BYTES) / W_BYTES;
    static constexpr int PW = PW0 > 32 ? 32 : PW0;
    static constexpr int BAR_BYTES = 16 * (PX + PW);
    static constexpr int SMEM = PX * X_BYTES + PW * W_BYTES + BAR_BYTES + 1024;
    static_assert(PW >= 2, "two weight atoms in flight at least");
    static_assert(SMEM <= 232448, "227 KB of shared memory a block (sm_90)");
    static_assert(W_BYTES % 1024 == 0 && (N / 2 * 128) % 1024 == 0, "slots on the swizzle's 1024-byte period");
};

__device__ __forceinline__ void d3_mbar_init(uint32_t mb, unsigned count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(mb), "r"(count) : "memory");
}
__device__ __forceinline__ void d3_mbar_wait(uint32_t mb, unsigned parity)
{
    unsigned done = 0;
    while (!done)
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     " selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(mb), "r"(parity)
                     : "memory");
}
__device__ __forceinline__ void d3_expect(uint32_t mb, unsigned bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(mb), "r"(bytes) : "memory");
}
/* arrival on the barrier at this block's shared address mb in cluster block `rank` (itself too).
 * The default semantics (release at CTA scope), not .release.cluster: what it orders is the
 * wgmma's reads of the slot, complete once wgmma.wait_group has returned; the cluster-scope
 * release made every arrival a fence, and the first build with it ran ~2.4 us an atom whatever
 * the tile (bench/RESULTS.md, dec10) */
__device__ __forceinline__ void d3_arrive_at(uint32_t mb, unsigned rank)
{
    uint32_t ra;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(ra) : "r"(mb), "r"(rank));
    asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(ra) : "memory");
}
__device__ __forceinline__ void d3_cluster_sync()
{
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ unsigned d3_rank()
{
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}

template <int N, bool SW, int C>
__global__ void __launch_bounds__(D3_THREADS, 1) k_dgemm_n3(const __grid_constant__ d3_params p)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using G = d3_cfg<N>;
    constexpr int XR = D2_TOK / C; /* x rows this block fetches for the cluster */
    extern __shared__ uint8_t d3_smem_raw[];
    /* the same offset in every block (one kernel, one layout): multicast and remote arrivals
     * address a peer's slots and barriers by this block's offsets */
    const uint32_t smem0 = ((uint32_t)__cvta_generic_to_shared(d3_smem_raw) + 1023u) & ~1023u;
    const uint32_t xring = smem0, wring = smem0 + (uint32_t)(G::PX * G::X_BYTES);
    const uint32_t bars = wring + (uint32_t)(G::PW * G::W_BYTES);
    const uint32_t xfull = bars, xempty = bars + 8 * G::PX, wfull = bars + 16 * G::PX, wempty = wfull + 8 * G::PW;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const unsigned rank = d3_rank();
    const int na = p.atoms;

    int tile = blockIdx.x, part = 0;
    if (!SW)
        while (part + 1 < p.n_parts && tile >= p.tiles[part]) tile -= p.tiles[part++];
    const int r0 = tile * (SW ? N / 2 : N), out = p.out[part];

    if (tid == 0) {
        for (int i = 0; i < G::PX; i++) {
            d3_mbar_init(xfull + 8 * i, 1);
            d3_mbar_init(xempty + 8 * i, 8 * C);
        }
        for (int i = 0; i < G::PW; i++) {
            d3_mbar_init(wfull + 8 * i, 1);
            d3_mbar_init(wempty + 8 * i, 8);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    d3_cluster_sync();

    if (warp == 8) {
        /* the producer: weights PW atoms ahead (the first ones before the grid dependency wait:
         * they never depend on the previous kernel), x PX atoms ahead */
        if (lane == 0) {
            uint64_t pol;
            asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(pol));
            auto issue_w = [&](int at) {
                const uint32_t dst = wring + (uint32_t)((at % G::PW) * G::W_BYTES), mb = wfull + 8 * (at % G::PW);
                d3_expect(mb, G::W_BYTES);
#pragma unroll
                for (int h = 0; h < (SW ? 2 : 1); h++)
                    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
                                 " [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst + (uint32_t)(h * (N / 2) * 128)),
                                 "l"((uint64_t)&p.tw[SW ? h : part]), "r"(at * D2_KA), "r"(r0), "r"(mb), "l"(pol)
                                 : "memory");
            };
            auto issue_x = [&](int at) {
                const uint32_t slot = xring + (uint32_t)((at % G::PX) * G::X_BYTES), mb = xfull + 8 * (at % G::PX);
                d3_expect(mb, G::X_BYTES); /* every block's slices land on this barrier */
                asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
                             " [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(slot + rank * (uint32_t)(XR * 128)),
                             "l"((uint64_t)&p.tx), "r"(at * D2_KA), "r"((int)rank * XR), "r"(mb),
                             "h"((unsigned short)((1u << C) - 1))
                             : "memory");
            };
            for (int at = 0; at < G::PW && at < na; at++) issue_w(at);
            grid_dep_wait(); /* cuda_launch.h: x is ready */
            grid_dep_launch(p.trig);
            for (int at = 0; at < G::PX && at < na; at++) issue_x(at);
            for (int c = 0; c < na; c++) {
                /* atom c consumed (x: by the whole cluster): its slots take atoms c + PX / c + PW */
                if (c + G::PX < na) {
                    d3_mbar_wait(xempty + 8 * (c % G::PX), (unsigned)(c / G::PX) & 1u);
                    issue_x(c + G::PX);
                }
                if (c + G::PW < na) {
                    d3_mbar_wait(wempty + 8 * (c % G::PW), (unsigned)(c / G::PW) & 1u);
                    issue_w(c + G::PW);
                }
            }
        } else {
            grid_dep_wait();
            grid_dep_launch(p.trig);
        }
        __syncwarp();
    } else {
        const int wg = warp >> 2, wq = warp & 3, g = lane >> 2, q = lane & 3;
        grid_dep_wait(); /* the outputs are free */
        grid_dep_launch(p.trig);
        float acc[N / 2];
#pragma unroll
        for (int i = 0; i < N / 2; i++) acc[i] = 0.0f;
        for (int at = 0; at < na; at++) {
            d3_mbar_wait(xfull + 8 * (at % G::PX), (unsigned)(at / G::PX) & 1u);
            d3_mbar_wait(wfull + 8 * (at % G::PW), (unsigned)(at / G::PW) & 1u);
            const uint64_t da = dg_desc(xring + (uint32_t)((at % G::PX) * G::X_BYTES + wg * 64 * 128));
            const uint64_t db = dg_desc(wring + (uint32_t)((at % G::PW) * G::W_BYTES));
            dg_fence();
#pragma unroll
            for (int k = 0; k < D2_KA / 16; k++) d2_mma<N>(acc, da + 2 * k, db + 2 * k);
            dg_commit();
            asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory"); /* atom at - 1's products are done */
#pragma unroll
            for (int i = 0; i < N / 2; i++) asm volatile("" : "+f"(acc[i])::"memory");
            if (at > 0) {
                __syncwarp();
                if (lane == 0) {
                    const int pa = at - 1;
                    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(wempty + 8 * (pa % G::PW)) : "memory");
#pragma unroll
                    for (int r = 0; r < C; r++) d3_arrive_at(xempty + 8 * (pa % G::PX), (unsigned)r);
                }
            }
        }
        dg_wait0();
#pragma unroll
        for (int i = 0; i < N / 2; i++) asm volatile("" : "+f"(acc[i])::"memory");

        d2_store<N, SW>(p, acc, 64 * wg + 16 * wq, g, q, r0, part, out);   /* as k_dgemm_n2 */
    }
    d3_cluster_sync(); /* no block leaves while a peer may still arrive on its barriers */
#else
    __trap();
#endif
}

/* cuTensorMapEncodeTiled, reached through the runtime (no link against the driver library); NULL
 * where the driver has none (k_dgemm_n2 then runs instead) */
static PFN_cuTensorMapEncodeTiled_v12000 d3_encoder(void)
{
    static int done = 0;
    static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
    if (!done) {
        done = 1;
        void *f = nullptr;
        cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) == cudaSuccess &&
            q == cudaDriverEntryPointSuccess)
            fn = (PFN_cuTensorMapEncodeTiled_v12000)f;
        else
            (void)cudaGetLastError();
    }
    return fn;
}

/* the map of a bf16 matrix [rows][cols] (row-major) in boxes of 64 columns x box_rows rows,
 * 128-byte swizzle, out-of-bounds elements read as zero. Encoded maps are remembered per thread by
 * (address, shape, box): a map holds nothing else, so an entry stays right even after its buffer
 * is freed and another takes the address. Encoding costs ~1 us of host time, 2-4 a launch:
 * recorded graphs pay it at capture only, eager launches (benchmarks) hit the cache. */
#define D3_MAP_CACHE 256
static bool d3_map(const bf16 *base, int rows, int cols, int box_rows, CUtensorMap *out)
{
    struct ent {
        const void *base;
        int rows, cols, box;
        CUtensorMap map;
    };
    static thread_local ent cache[D3_MAP_CACHE];
    static thread_local int n_cached, next;
    for (int i = 0; i < n_cached; i++)
        if (cache[i].base == base && cache[i].rows == rows && cache[i].cols == cols && cache[i].box == box_rows) {
            *out = cache[i].map;
            return true;
        }
    PFN_cuTensorMapEncodeTiled_v12000 enc = d3_encoder();
    if (!enc) return false;
    const cuuint64_t dims[2] = {(cuuint64_t)cols, (cuuint64_t)rows};
    const cuuint64_t strides[1] = {(cuuint64_t)cols * sizeof(bf16)};
    const cuuint32_t box[2] = {D2_KA, (cuuint32_t)box_rows}, es[2] = {1, 1};
    if (enc(out, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, (void *)base, dims, strides, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
        return false;
    ent *e = &cache[next];
    next = (next + 1) % D3_MAP_CACHE;
    if (n_cached < D3_MAP_CACHE) n_cached++;
    e->base = base;
    e->rows = rows;
    e->cols = cols;
    e->box = box_rows;
    e->map = *out;
    return true;
}

/* the launch's shared-memory limit raised (once per device) and how many clusters of C blocks can
 * run at once (0 on failure: the caller falls back to k_dgemm_n2) */
template <int N, bool SW, int C> static int d3_prepare()
{
    static unsigned attr_set = 0;
    static int max_cl[32];
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev >= 32) return 0;
    if (!(attr_set >> dev & 1u)) {
        if (cudaFuncSetAttribute(k_dgemm_n3<N, SW, C>, cudaFuncAttributeMaxDynamicSharedMemorySize, d3_cfg<N>::SMEM) !=
            cudaSuccess) {
            (void)cudaGetLastError();
            return 0;
        }
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(C);
        cfg.blockDim = dim3(D3_THREADS);
        cfg.dynamicSmemBytes = (size_t)d3_cfg<N>::SMEM;
        cudaLaunchAttribute at[1];
        at[0].id = cudaLaunchAttributeClusterDimension;
        at[0].val.clusterDim.x = C;
        at[0].val.clusterDim.y = 1;
        at[0].val.clusterDim.z = 1;
        cfg.attrs = at;
        cfg.numAttrs = 1;
        int n = 0;
        if (cudaOccupancyMaxActiveClusters(&n, k_dgemm_n3<N, SW, C>, &cfg) != cudaSuccess) {
            (void)cudaGetLastError();
            n = 0;
        }
        max_cl[dev] = n;
        attr_set |= 1u << dev;
    }
    return max_cl[dev];
}

template <int N, bool SW, int C> static cudaError_t d3_launch(const d3_params &p, int blocks, cudaStream_t stream)
{
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3((unsigned)blocks);
    cfg.blockDim = dim3(D3_THREADS);
    cfg.dynamicSmemBytes = (size_t)d3_cfg<N>::SMEM;
    cfg.stream = stream;
    cudaLaunchAttribute at[2];
    at[0].id = cudaLaunchAttributeClusterDimension;
    at[0].val.clusterDim.x = C;
    at[0].val.clusterDim.y = 1;
    at[0].val.clusterDim.z = 1;
    at[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[1].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = at;
    cfg.numAttrs = kvs_cu_pdl_enabled() ? 2 : 1;
    return cudaLaunchKernelEx(&cfg, k_dgemm_n3<N, SW, C>, p);
}

/* the tiles of N rows of a launch (SwiGLU: N / 2 gate rows a tile) */
static int d3_tiles(const struct kvs_cu_skinny *a, int N)
{
    if (a->swiglu) return (a->out[0] + N / 2 - 1) / (N / 2);
    int t = 0;
    for (int i = 0; i < a->n_parts; i++) t += (a->out[i] + N - 1) / N;
    return t;
}

/* the launch's clusters fit one wave at tile rows N and cluster size C */
template <int N, bool SW, int C> static bool d3_fits(const struct kvs_cu_skinny *a)
{
    const int mc = d3_prepare<N, SW, C>();
    return mc > 0 && (d3_tiles(a, N) + C - 1) / C <= mc;
}

static unsigned long d3_launches;
extern "C" unsigned long kvs_cu_dgemm_n3_launches(void)
{
    return d3_launches;
}

/* k_dgemm_n3 at cluster size C for this launch: tile rows by kvs_cu_dgemm_n2_rows's rule (the least
 * of 32 / 48 / 64 / 96; SwiGLU 128 or 224) with clusters instead of blocks within one wave (the
 * wide tiles of bit 4096 paid only for x's traffic, which the cluster divides). Returns
 * cudaErrorNotSupported where no tile size fits (or no tensor maps): the caller runs k_dgemm_n2.
 * A function of the shapes and the device, not of n. */
template <int C> static cudaError_t d3_run(const struct kvs_cu_skinny *a, cudaStream_t stream)
{
    int N = 0;
    if (a->swiglu) N = d3_fits<128, true, C>(a) ? 128 : d3_fits<224, true, C>(a) ? 224 : 0;
    else if (d3_fits<32, false, C>(a)) N = 32;
    else if (d3_fits<48, false, C>(a)) N = 48;
    else if (d3_fits<64, false, C>(a)) N = 64;
    else if (d3_fits<96, false, C>(a)) N = 96;
    if (!N) return cudaErrorNotSupported;
    d3_params p = {};
    p.n = a->n;
    p.atoms = a->in / D2_KA;
    p.n_parts = a->n_parts;
    p.yh = a->yh;
    p.trig = kvs_cu_pdl_early() & 1;
    if (!d3_map(a->x, a->n, a->in, D2_TOK / C, &p.tx)) return cudaErrorNotSupported;
    for (int i = 0; i < a->n_parts; i++) {
        p.bias[i] = a->bias[i];
        p.out[i] = a->out[i];
        p.y[i] = a->y[i];
        p.tiles[i] = (a->out[i] + N - 1) / N;
        if (!d3_map(a->w[i], a->out[i], a->in, a->swiglu ? N / 2 : N, &p.tw[i])) return cudaErrorNotSupported;
    }
    const int blocks = (d3_tiles(a, N) + C - 1) / C * C; /* blocks past the last tile store nothing */
    d3_launches++;
    if (a->swiglu) return N == 128 ? d3_launch<128, true, C>(p, blocks, stream) : d3_launch<224, true, C>(p, blocks, stream);
    switch (N) {
    case 32: return d3_launch<32, false, C>(p, blocks, stream);
    case 48: return d3_launch<48, false, C>(p, blocks, stream);
    case 64: return d3_launch<64, false, C>(p, blocks, stream);
    default: return d3_launch<96, false, C>(p, blocks, stream);
    }
}

/* launches so far (host side), for tests/gpu/test_cuda_dgemm128.c: a test of this kernel must
 * know the routing sent its launches here, not to cuBLAS, whose results are as close to the CPU's */
static unsigned long d2_launches;
extern "C" unsigned long kvs_cu_dgemm_n2_launches(void)
{
    return d2_launches;
}

cudaError_t kvs_cu_dgemm_n2(const struct kvs_cu_skinny *a, int rows, cudaStream_t stream)
{
    /* KVS_DGEMM_N2_DEEP_X in rows: the deeper x ring (plain tiles only); _CL4 / _CL2: k_dgemm_n3,
     * x shared by clusters of 4 (else 2, where 4 does not fit one wave) / of 2 blocks */
    const bool dx = (rows & KVS_DGEMM_N2_DEEP_X) != 0;
    const int cl = rows & KVS_DGEMM_N2_CL4 ? 4 : rows & KVS_DGEMM_N2_CL2 ? 2 : 0;
    rows &= ~(KVS_DGEMM_N2_DEEP_X | KVS_DGEMM_N2_CL2 | KVS_DGEMM_N2_CL4);
    if (a->n <= 64 || a->n > D2_TOK || a->in % D2_KA != 0) return cudaErrorInvalidValue;
    d2_launches++;
    if (cl) {
        cudaError_t e = cl == 4 ? d3_run<4>(a, stream) : cudaErrorNotSupported;
        if (e == cudaErrorNotSupported) e = d3_run<2>(a, stream);
        if (e != cudaErrorNotSupported) return e;
    }
    d2_params p = {};
    p.x = a->x;
    p.n = a->n;
    p.in = a->in;
    p.atoms = a->in / D2_KA;
    p.swiglu = a->swiglu;
    p.n_parts = a->n_parts;
    p.yh = a->yh;
    p.trig = kvs_cu_pdl_early() & 1;
    int tiles = 0;
    for (int i = 0; i < a->n_parts; i++) {
        p.w[i] = a->w[i];
        p.bias[i] = a->bias[i];
        p.out[i] = a->out[i];
        p.y[i] = a->y[i];
        p.tiles[i] = (a->out[i] + rows - 1) / rows;
        tiles += p.tiles[i];
    }
    if (a->swiglu) {
        if (rows != 128 && rows != 224) return cudaErrorInvalidValue;
        tiles = (a->out[0] + rows / 2 - 1) / (rows / 2);
        return rows == 128 ? d2_launch<128, true>(p, tiles, stream) : d2_launch<224, true>(p, tiles, stream);
    }
    switch (rows) {
    case 32: return dx ? d2_launch<32, false, true>(p, tiles, stream) : d2_launch<32, false>(p, tiles, stream);
    case 48: return dx ? d2_launch<48, false, true>(p, tiles, stream) : d2_launch<48, false>(p, tiles, stream);
    case 64: return dx ? d2_launch<64, false, true>(p, tiles, stream) : d2_launch<64, false>(p, tiles, stream);
    case 96: return dx ? d2_launch<96, false, true>(p, tiles, stream) : d2_launch<96, false>(p, tiles, stream);
    default: return cudaErrorInvalidValue;
    }
}
