/* cuda_dgemm128.cu: k_dgemm_n2, the decode GEMM's Hopper kernel for 65 to 128 token rows
 * (cuda_skinny.h, kvs_cu_dgemm_n2; variant bits 1024 / 2048 / 4096 of cuda_skinny.cu).
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
/* a flag in kvs_cu_dgemm_n2's rows (cuda_skinny.h): the deeper x ring (d2_cfg's DX) */
#define KVS_DGEMM_N2_DEEP_X 4096

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

    /* acc[4 b + 2 h + j]: token t = 64 wg + 16 warp + g + 8 h, tile row 8 b + 2 q + j */
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int t = 64 * wg + 16 * warp + g + 8 * h;
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

/* launches so far (host side), for tests/gpu/test_cuda_dgemm128.c: a test of this kernel must
 * know the routing sent its launches here, not to cuBLAS, whose results are as close to the CPU's */
static unsigned long d2_launches;
extern "C" unsigned long kvs_cu_dgemm_n2_launches(void)
{
    return d2_launches;
}

cudaError_t kvs_cu_dgemm_n2(const struct kvs_cu_skinny *a, int rows, cudaStream_t stream)
{
    /* KVS_DGEMM_N2_DEEP_X in rows: the deeper x ring (plain tiles only) */
    const bool dx = (rows & KVS_DGEMM_N2_DEEP_X) != 0;
    rows &= ~KVS_DGEMM_N2_DEEP_X;
    if (a->n <= 64 || a->n > D2_TOK || a->in % D2_KA != 0) return cudaErrorInvalidValue;
    d2_launches++;
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
