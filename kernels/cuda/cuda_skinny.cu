/* cuda_skinny.cu: the decode GEMM (cuda_skinny.h), y = x W^T for a few token rows.
 *
 * A block owns one tile of 16 weight rows (plain) or 8 gate rows + the same 8 up rows (SwiGLU)
 * and all n tokens; its 16 warps split the K dimension (groups of 1 or 2 chunks of 32 columns,
 * dealt round robin) and each streams its groups of the 16 rows. In a chunk, lane (g = lane / 4, q = lane % 4)
 * loads 16 bytes of row g and of row g + 8 (columns 8q .. 8q + 7) and 16 bytes of x for token g
 * of each 8-token group: exactly the registers of two m16n8k16 MMAs if the 32 columns are taken
 * in a permuted order. A dot product does not care about the order of its terms, so W and x
 * just have to use the same one: MMA 0 sees columns (8q, 8q+1 | 8q+2, 8q+3) as its k pairs
 * (2q, 2q+1 | 2q+8, 2q+9), MMA 1 sees 8q+4 .. 8q+7. No shuffles, no shared memory in the loop.
 *
 * Memory: every weight byte is read once (ld.global.nc, L1::no_allocate, by default with the
 * L2::256B fetch hint, two groups in flight per lane); x (at most 128 x in bf16) stays in L1/L2. The first group is loaded before the grid
 * dependency wait (cuda_launch.h): weights never depend on the previous kernel.
 * A single row (batch-1 decode) takes k_gemv1 instead (not with variant bit 512, batch invariance):
 * a warp per output row, which streamed the weights faster than any tiling of the MMA kernel that
 * was tried (bench/RESULTS.md).
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels/cuda/cuda_launch.h"
#include "kernels/cuda/cuda_skinny.h"

typedef __nv_bfloat16 bf16;

#define GV_WARPS 4   /* single-row kernel: warps (rows) per block */

struct sk_params {
    const bf16 *x;
    int n, in, swiglu, n_parts;
    int tiles[KVS_SKINNY_MAX_PARTS];       /* 16-row tiles of each part (plain) */
    const bf16 *w[KVS_SKINNY_MAX_PARTS];
    const float *bias[KVS_SKINNY_MAX_PARTS];
    int out[KVS_SKINNY_MAX_PARTS];
    float *y[KVS_SKINNY_MAX_PARTS];
    bf16 *yh;
    int trig;                              /* kvs_cu_pdl_early(): grid_dep_launch after the wait */
};

__device__ __forceinline__ uint4 sk_ld_stream(const uint4 *p)
{
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}

/* the same load asking L2 to fetch the whole 256-byte piece around it: a warp reads 64 bytes of
 * each of 16 rows per load and the block's warps read neighbouring pieces, so one 256-byte DRAM
 * fetch serves two warps' loads (variant bit 2, KVS_CUDA_SKINNY_VARIANT) */
__device__ __forceinline__ uint4 sk_ld_stream256(const uint4 *p)
{
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}

template <bool H256> __device__ __forceinline__ uint4 sk_ld(const uint4 *p)
{
    return H256 ? sk_ld_stream256(p) : sk_ld_stream(p);
}

__device__ __forceinline__ void mma16816(float c[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                         unsigned b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

/* loads chunks c .. c + SK_U - 1 (those below c1) of the lane's two rows */
template <int SK_U, bool H256>
__device__ __forceinline__ void sk_load(const uint4 *lo, const uint4 *hi, int c, int c1, uint4 *wa, uint4 *wb)
{
#pragma unroll
    for (int u = 0; u < SK_U; u++)
        if (c + u < c1) {
            wa[u] = sk_ld<H256>(lo + (size_t)(c + u) * 4);
            wb[u] = sk_ld<H256>(hi + (size_t)(c + u) * 4);
        }
}

/* multiplies the loaded chunks by the lane's x columns of each 8-token group */
template <int NT, int SK_U>
__device__ __forceinline__ void sk_mma(const uint4 *xg, int xs, int valid_t, int c, int c1, const uint4 *wa,
                                       const uint4 *wb, float (*acc)[4])
{
#pragma unroll
    for (int u = 0; u < SK_U; u++) {
        if (c + u >= c1) break;
#pragma unroll
        for (int t = 0; t < NT; t++) {
            uint4 xv = make_uint4(0, 0, 0, 0);
            if (t < valid_t) xv = __ldg(xg + (size_t)t * 8 * xs + (size_t)(c + u) * 4);
            mma16816(acc[t], wa[u].x, wb[u].x, wa[u].y, wb[u].y, xv.x, xv.y);
            mma16816(acc[t], wa[u].z, wb[u].z, wa[u].w, wb[u].w, xv.z, xv.w);
        }
    }
}

/* partial sums of up to RED_T token groups per round of the cross-warp reduction: 16 warps x 16
 * groups (128 tokens) would need 120 KB of shared memory at once */
#define RED_T 4

template <int NT, int SK_WARPS, int SK_U, bool DB, bool H256>
__global__ void __launch_bounds__(SK_WARPS * 32) k_skinny(sk_params p)
{
    constexpr int RT = NT < RED_T ? NT : RED_T;
    __shared__ float red[SK_WARPS > 1 ? SK_WARPS - 1 : 1][RT * 4][32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const int in = p.in;

    /* this block's tile: rows (lo, hi) = (r0 + g, r0 + g + 8) of part `part`, or gate / up row f0 + g */
    int tile = blockIdx.x, part = 0;
    const bf16 *wlo, *whi;
    if (p.swiglu) {
        wlo = p.w[0] + ((size_t)tile * 8 + g) * in;
        whi = p.w[1] + ((size_t)tile * 8 + g) * in;
    } else {
        while (part + 1 < p.n_parts && tile >= p.tiles[part]) tile -= p.tiles[part++];
        wlo = p.w[part] + ((size_t)tile * 16 + g) * in;
        whi = wlo + (size_t)8 * in;
    }
    const uint4 *lo = (const uint4 *)(wlo + 8 * q), *hi = (const uint4 *)(whi + 8 * q);
    /* K is dealt to the warps in groups of SK_U chunks, round robin: at any moment the block's
     * warps read neighbouring 256-byte pieces of each row, so DRAM sees long runs (contiguous K
     * ranges per warp read at 8 places per row and were ~7% slower) */
    const int nc = in / 32, step = SK_WARPS * SK_U, c0 = warp * SK_U, c1 = nc;

    /* x: token g of each group of 8, columns 8q .. of each chunk; groups past n read nothing */
    const uint4 *xg = (const uint4 *)(p.x + (size_t)g * in + 8 * q);
    const int xs = in / 8;                       /* uint4 per x row */
    int valid_t = 0;                             /* groups t with token t * 8 + g < n */
#pragma unroll
    for (int t = 0; t < NT; t++) valid_t += t * 8 + g < p.n;

    float acc[NT][4];
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.0f;

    uint4 wa0[SK_U], wb0[SK_U];
    sk_load<SK_U, H256>(lo, hi, c0, c1, wa0, wb0);     /* before the wait: weights are constant */
    grid_dep_wait();                             /* cuda_launch.h: x is ready */
    grid_dep_launch(p.trig);                     /* the next kernel may start as blocks leave */
    if (DB) {
        /* two groups in flight: the next group loads while this one multiplies */
        uint4 wa1[SK_U], wb1[SK_U];
        for (int c = c0; c < c1; c += 2 * step) {
            sk_load<SK_U, H256>(lo, hi, c + step, c1, wa1, wb1);
            sk_mma<NT, SK_U>(xg, xs, valid_t, c, c1, wa0, wb0, acc);
            sk_load<SK_U, H256>(lo, hi, c + 2 * step, c1, wa0, wb0);
            sk_mma<NT, SK_U>(xg, xs, valid_t, c + step, c1, wa1, wb1, acc);
        }
    } else {
        /* one group (more x fragments leave fewer registers); the same chunks in the same order */
        for (int c = c0; c < c1; c += step) {
            if (c != c0) sk_load<SK_U, H256>(lo, hi, c, c1, wa0, wb0);
            sk_mma<NT, SK_U>(xg, xs, valid_t, c, c1, wa0, wb0, acc);
        }
    }

    /* add the warps' partial sums in warp order, RT token groups a round (the same order of
     * additions for every round size: batch invariance) */
#pragma unroll
    for (int t0 = 0; t0 < NT; t0 += RT) {
        if (t0 > 0) __syncthreads();             /* warp 0 has read the previous round */
        if (warp > 0)
#pragma unroll
            for (int t = 0; t < RT; t++)
#pragma unroll
                for (int i = 0; i < 4; i++) red[warp - 1][t * 4 + i][lane] = acc[t0 + t][i];
        __syncthreads();
        if (warp == 0)
            for (int w = 0; w < SK_WARPS - 1; w++)
#pragma unroll
                for (int t = 0; t < RT; t++)
#pragma unroll
                    for (int i = 0; i < 4; i++) acc[t0 + t][i] += red[w][t * 4 + i][lane];
    }
    if (warp > 0) return;

    /* acc[t]: (row g, tokens 2q, 2q+1 of group t), (row g + 8, the same tokens) */
#pragma unroll
    for (int t = 0; t < NT; t++)
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const int tok = t * 8 + 2 * q + j;
            if (tok >= p.n) continue;
            const float a = acc[t][j], b = acc[t][2 + j];
            if (p.swiglu) {
                const size_t f = (size_t)tok * p.out[0] + (size_t)tile * 8 + g;
                const float v = a / (1.0f + expf(-a)) * b;   /* as k_swiglu */
                p.y[0][f] = v;
                if (p.yh) p.yh[f] = __float2bfloat16(v);
            } else {
                const int r = tile * 16 + g;
                const float *bias = p.bias[part];
                float *y = p.y[part] + (size_t)tok * p.out[part];
                y[r] = bias ? a + bias[r] : a;
                y[r + 8] = bias ? b + bias[r + 8] : b;
            }
        }
}

__device__ __forceinline__ float dot8_bf16(uint4 a, uint4 b)
{
    const __nv_bfloat162 *p = (const __nv_bfloat162 *)&a, *q = (const __nv_bfloat162 *)&b;
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float2 x = __bfloat1622float2(p[i]), y = __bfloat1622float2(q[i]);
        s += x.x * y.x + x.y * y.y;
    }
    return s;
}

/* <W row, x> by one warp: 16-byte loads, four in flight per lane, the first four issued before the
 * grid dependency wait (weights do not depend on the previous kernel) */
__device__ __forceinline__ float gv_row(const bf16 *W, const bf16 *x, int in, bool waited, int trig)
{
    const int lane = threadIdx.x & 31;
    const uint4 *w4 = (const uint4 *)W, *x4 = (const uint4 *)x;
    const int nc = in / 8;
    float acc = 0.0f;
    uint4 w0 = make_uint4(0, 0, 0, 0), w1 = w0, w2 = w0, w3 = w0;
    if (lane + 96 < nc) {
        w0 = sk_ld_stream(w4 + lane);
        w1 = sk_ld_stream(w4 + lane + 32);
        w2 = sk_ld_stream(w4 + lane + 64);
        w3 = sk_ld_stream(w4 + lane + 96);
    }
    if (!waited) {
        grid_dep_wait(); /* cuda_launch.h: x is ready */
        grid_dep_launch(trig);
    }
    int c = lane;
    for (; c + 96 < nc; c += 128) {
        if (c != lane) {
            w0 = sk_ld_stream(w4 + c);
            w1 = sk_ld_stream(w4 + c + 32);
            w2 = sk_ld_stream(w4 + c + 64);
            w3 = sk_ld_stream(w4 + c + 96);
        }
        acc += dot8_bf16(w0, __ldg(x4 + c)) + dot8_bf16(w1, __ldg(x4 + c + 32)) + dot8_bf16(w2, __ldg(x4 + c + 64)) +
               dot8_bf16(w3, __ldg(x4 + c + 96));
    }
    for (; c < nc; c += 32) acc += dot8_bf16(sk_ld_stream(w4 + c), __ldg(x4 + c));
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    return acc;
}

/* n = 1: a warp per output row (plain: the rows of all parts in order; SwiGLU: gate row f and up
 * row f). Summation order differs from k_skinny's; a decode step always has n fixed per launch. */
__global__ void __launch_bounds__(GV_WARPS * 32) k_gemv1(sk_params p)
{
    int row = blockIdx.x * GV_WARPS + (threadIdx.x >> 5), part = 0;
    const int lane = threadIdx.x & 31;
    if (p.swiglu) {
        if (row >= p.out[0]) {
            grid_dep_wait();
            return;
        }
        const float a = gv_row(p.w[0] + (size_t)row * p.in, p.x, p.in, false, p.trig);
        const float b = gv_row(p.w[1] + (size_t)row * p.in, p.x, p.in, true, p.trig);
        if (lane == 0) {
            const float v = a / (1.0f + expf(-a)) * b; /* as k_swiglu */
            p.y[0][row] = v;
            if (p.yh) p.yh[row] = __float2bfloat16(v);
        }
        return;
    }
    while (part < p.n_parts && row >= p.out[part]) row -= p.out[part++];
    if (part >= p.n_parts) {
        grid_dep_wait();
        return;
    }
    const float a = gv_row(p.w[part] + (size_t)row * p.in, p.x, p.in, false, p.trig);
    if (lane == 0) p.y[part][row] = p.bias[part] ? a + p.bias[part][row] : a;
}

/* The variant (kvs_cu_skinny_set_variant; at first use KVS_CUDA_SKINNY_VARIANT, else
 * KVS_SKINNY_VARIANT_DEFAULT): bit 1 keeps two groups of K chunks in flight at 9+ rows too (1-8
 * rows always do), bit 2 the L2::256B fetch hint. Neither changes the order of the additions, so
 * results are bitwise the same whatever the variant. Bit 4 takes the wgmma kernel (cuda_dgemm.cu)
 * for 2..128 rows where it applies, with K split for two blocks per SM, or one with bit 1 (another
 * order of additions: close to k_skinny's results, not equal); bit 8 keeps it to the launches it
 * does not split (k_skinny up to 8 rows, cuBLAS above, for the others); bit 16 reduces its splits
 * on chip (a unit's splits one thread-block cluster, partials in shared memory: the same bits;
 * slower than the workspace at 8-128 rows on an H100, bench/RESULTS.md, decode4 part 2). Bit 32
 * sends the launches that the wgmma kernel would split (with bit 8: those k_skinny or cuBLAS
 * would take) to k_dgemm_n (cuda_dgemm.cu: the weights on the N side, K whole) at 2..64 rows,
 * and from 33 rows leaves the unsplit ones to cuBLAS. Bit 64 keeps k_dgemm's blocks at one 128-row
 * tile (two per SM) at 64-128 tokens too, and with bit 32 gives it the unsplit launches (gate/up,
 * the LM head) at 33-128 rows. Bits 128 / 256 stage k_dgemm_n's x in tiles of 16 rows at 2-16
 * tokens / of 32 rows at 17-32 tokens (instead of 64), which leaves room for more weights in
 * flight. All of them keep the order of the additions: the same bits as without. */
/* default 14: the wgmma kernel for the launches it does not split (2,750-2,970 GB/s at 2-32 rows,
 * vs 2,650-2,850 for k_skinny and cuBLAS; its split launches were slower than both), else k_skinny
 * with the L2::256B hint up to 8 rows (faster at 2-8 rows, the same at 1: the GEMV does not use
 * it) and cuBLAS above; two groups in flight above 8 rows (bit 1) was not faster
 * (bench/RESULTS.md, issue 22 sections). Default 46 = 14 | 32: the launches the wgmma kernel
 * would split (q/k/v, o, down) on k_dgemm_n at 2-64 rows instead of k_skinny / cuBLAS
 * (bench/RESULTS.md, decode5: 3-4% off the whole step at batch 8 and 32). Default 238 = 46 | 64 |
 * 128 (bench/RESULTS.md, decode6, one call on an H100): k_dgemm_n's 16-row x tiles read q/k/v 8%
 * and o 10% faster at 8-16 rows (the step at batch 8 x 1K 2% faster); one-tile k_dgemm blocks for
 * gate/up and the LM head at 33-64 rows (instead of cuBLAS) the step at batch 64 1.6% faster. Not
 * bit 256: its 32-row x tiles read the GEMMs alone 0.8% faster at 32 rows, but the step at batch
 * 32 took 1% (1K) and 4% (8K) longer. Nor, were the row limit raised to 128, bit 64 there: gate/up
 * on one-tile blocks was 4% slower than cuBLAS at 128 rows (the LM head 7% faster).
 * Bit 512 (batch invariance; KVS_CUDA_BATCH_INVARIANT=1 adds it to the variant) picks the kernel
 * by the launch's shapes alone (sk_route_of), so that a row's output bits do not depend on the
 * batch: one-row launches run the n-row kernels with one token instead of the GEMV, whose CUDA-core
 * sums round otherwise than the tensor cores'. Not in the default: on the H100 the n-row kernels
 * stream the weights at one row as at eight (~2,745 GB/s), the GEMV at ~2,900, so the batch-1
 * step took 5.8% longer (84.7% of the floor instead of 89.6%), batch 8-128 the same (branch gemm7,
 * bench/RESULTS.md).
 * Bits 1024 / 2048 (65-128 rows, with KVS_CUDA_SKINNY_MAX=128) send gate/up + SwiGLU / the launches
 * k_dgemm would split (q/k/v, o, down) to k_dgemm_n2 (cuda_dgemm128.cu: two warpgroups of 64 tokens
 * sharing each weight tile); bit 4096 gives its plain launches tiles of at least 64 rows, bit 8192 a
 * deeper x ring. Not in the default, nor the row limit 128: on the H100 every combination read the
 * weights slower than cuBLAS at 96-128 rows (o 1,200-1,560 GB/s vs 2,200, q/k/v 1,490-1,740 vs
 * 1,720, gate/up + down 1,870-2,170 vs 2,430) and the batch-128 step took 6.7-15% longer (branch
 * dec9, bench/RESULTS.md): with 32-64 weight rows a block, every block re-reads all 128 tokens'
 * x from L2 (2-4 times the weight bytes) and neither DRAM nor L2 was busy (38-70% / 44-79%: ncu),
 * the x ring's latency bound.
 * Bits 16384 / 32768 (with 1024 / 2048) run k_dgemm_n3 instead of k_dgemm_n2 (cuda_dgemm128.cu:
 * x shared by clusters of 4 / 2 blocks through the copy engine's multicast, so its L2 reads drop
 * by the cluster size). Not in the default either: on the H100 it read q/k/v faster than cuBLAS at
 * 128 rows (1,910 GB/s vs 1,724, clusters of 2) but o (1,375 vs 2,200) and gate/up + down (2,074
 * vs 2,438) slower, about as k_dgemm_n2 did: dividing x's L2 traffic did not move o and down
 * (ncu: 30 / 78 us, DRAM 36-47% busy, as k_dgemm_n2's 29 / 76), and the batch-128 step took 10%
 * longer (branch dec10, bench/RESULTS.md). */
#define KVS_SKINNY_VARIANT_DEFAULT 238

/* cuda_launch.h's early launch (grid_dep_launch) of the decode-step kernels, a mask by kernel
 * class: 1 the decode GEMMs (k_skinny, k_dgemm, k_dgemm_n), 2 the decode attention and its merge,
 * 4 the RMSNorms and RoPE + KV write; KVS_CUDA_PDL_EARLY or this default. Launches of one row
 * (batch-1 decode: the GEMV) never use it: measured at 8-128 rows only. Default all three: with
 * variant 46 the whole step at 8 / 32 / 64 / 128 x 1K took 3.3 / 3.7 / 1.8 / 0.4% less than
 * with none, each class alone less than that (bench/RESULTS.md, decode5); with variant 14 the
 * GEMMs alone were slower at 8 rows (k_skinny after k_dgemm). */
#define KVS_PDL_EARLY_DEFAULT 7
static int pdl_early = -1;

int kvs_cu_pdl_early(void)
{
    if (pdl_early < 0) {
        const char *e = getenv("KVS_CUDA_PDL_EARLY");
        pdl_early = e ? atoi(e) & 7 : KVS_PDL_EARLY_DEFAULT;
    }
    return kvs_cu_pdl_enabled() ? pdl_early : 0;
}

void kvs_cu_set_pdl_early(int on)
{
    pdl_early = on < 0 ? -1 : on & 7;
}
static int sk_variant = -1; /* kvs_cu_skinny_set_variant's, taken as it is; -1: none */
static int sk_base = -1;    /* KVS_CUDA_SKINNY_VARIANT or the default */
static int sk_bi = -1;      /* kvs_cu_skinny_set_invariant's bit 512; -1: KVS_CUDA_BATCH_INVARIANT's */

static int kvs_cu_skinny_variant()
{
    if (sk_variant >= 0) return sk_variant;
    if (sk_base < 0) {
        const char *e = getenv("KVS_CUDA_SKINNY_VARIANT");
        sk_base = e ? atoi(e) & 65535 : KVS_SKINNY_VARIANT_DEFAULT;
    }
    int bi = sk_bi;
    if (bi < 0) {
        const char *e = getenv("KVS_CUDA_BATCH_INVARIANT");
        bi = e && atoi(e) > 0;
    }
    return sk_base | (bi ? 512 : 0);
}

void kvs_cu_skinny_set_variant(int v)
{
    sk_variant = v < 0 ? -1 : v & 65535;
}

void kvs_cu_skinny_set_invariant(int on)
{
    sk_bi = on < 0 ? -1 : on > 0;
}

template <int NT, bool DB>
static cudaError_t sk_launch_h(bool h256, dim3 grid, dim3 blk, cudaStream_t stream, const sk_params &p)
{
    if (h256) return kvs_cu_launch(k_skinny<NT, 16, 2, DB, true>, grid, blk, 0, stream, p);
    return kvs_cu_launch(k_skinny<NT, 16, 2, DB, false>, grid, blk, 0, stream, p);
}

template <int NT>
static cudaError_t sk_launch_db(bool db, bool h256, dim3 grid, dim3 blk, cudaStream_t stream, const sk_params &p)
{
    return db ? sk_launch_h<NT, true>(h256, grid, blk, stream, p) : sk_launch_h<NT, false>(h256, grid, blk, stream, p);
}

/* 16 warps a block hide the load latency best, with groups of two chunks (measured on the
 * Llama-3.1-8B GEMMs of a step: bench/RESULTS.md). Every n deals K the same way, so a row's sum
 * is the same whatever the batch (batch invariance). 1-8 rows keep two groups in flight; above,
 * the x fragments take registers, and whether two groups still pay is variant bit 1. */
static cudaError_t sk_launch_nt(int nt, bool db, bool h256, dim3 grid, dim3 blk, cudaStream_t stream,
                                const sk_params &p)
{
    switch (nt) {
    case 1: return sk_launch_h<1, true>(h256, grid, blk, stream, p);
    case 2: return sk_launch_db<2>(db, h256, grid, blk, stream, p);
    case 4: return sk_launch_db<4>(db, h256, grid, blk, stream, p);
    case 8: return sk_launch_db<8>(db, h256, grid, blk, stream, p);
    default: return sk_launch_db<16>(db, h256, grid, blk, stream, p);
    }
}

int kvs_cu_skinny_supported(int n, int in, const int *out, int n_parts, int swiglu)
{
    if (n < 1 || n > KVS_SKINNY_MAX_N || in <= 0 || in % 32 != 0) return 0;
    if (swiglu) return n_parts == 2 && out[0] > 0 && out[0] % 8 == 0 && out[1] == out[0];
    if (n_parts < 1 || n_parts > KVS_SKINNY_MAX_PARTS) return 0;
    for (int i = 0; i < n_parts; i++)
        if (out[i] <= 0 || out[i] % 16 != 0) return 0;
    return 1;
}

/* the wgmma kernel's split plan at variant v (bit 1: one block per SM) */
static int sk_dg_splits(int v, int in, const int *out, int n_parts, int swiglu, int dg_sms)
{
    return kvs_cu_dgemm_splits(in, out, n_parts, swiglu, dg_sms, (v & 1) ? 1 : 2);
}

/* Which kernel runs a launch: cuBLAS (the caller's), the GEMV, k_skinny, k_dgemm or k_dgemm_n.
 * dg_sms: the device's SM count where the wgmma kernels may run (the backend has their
 * workspace), else 0. Without bit 512 this is decode4-6's choice by row count (the GEMV at one row,
 * k_skinny / the wgmma kernels / cuBLAS above, by the bits above). Bit 512 (batch invariance)
 * makes the choice a function of the launch's shapes alone, never of n: every launch of 1 to
 * KVS_SKINNY_MAX_N rows of one shape runs the same kernel with the same split of K, so a row's
 * bits do not depend on how many rows share the launch, nor on its position in it (each kernel
 * adds a row's terms in an order that n does not change: the headers above). A one-row launch
 * then runs the n-row kernel with one token (the GEMV adds in another order, on the CUDA cores). */
enum sk_route { SK_CUBLAS, SK_GEMV, SK_SKINNY, SK_DGEMM, SK_DGEMM_N, SK_DGEMM_N2 };

static sk_route sk_route_of(int v, int n, int in, const int *out, int n_parts, int swiglu, int dg_sms)
{
    if (!kvs_cu_skinny_supported(n, in, out, n_parts, swiglu)) return SK_CUBLAS;
    if (v & 512) {
        /* k_dgemm_n takes the launches k_dgemm would split (n past 64 in launches of 64 rows:
         * kvs_cu_skinny), k_dgemm the others it supports (split or not: its plan is the shape's),
         * k_skinny the shapes neither supports and devices without the wgmma kernels */
        if (!(v & 4) || !dg_sms || !kvs_cu_dgemm_supported(1, in, out, n_parts, swiglu)) return SK_SKINNY;
        if (sk_dg_splits(v, in, out, n_parts, swiglu, dg_sms) > 1 &&
            kvs_cu_dgemm_n_rows(1, in, out, n_parts, swiglu, dg_sms) > 0)
            return SK_DGEMM_N;
        return SK_DGEMM;
    }
    if (n == 1) return SK_GEMV;
    if (v & 4) {
        if (dg_sms && kvs_cu_dgemm_supported(n, in, out, n_parts, swiglu)) {
            const bool split = sk_dg_splits(v, in, out, n_parts, swiglu, dg_sms) > 1;
            /* 65-128 rows: bit 1024 gate/up + SwiGLU, bit 2048 the launches k_dgemm would split, on
             * k_dgemm_n2 (the weights read once for all rows, not twice as k_dgemm_n's launches of 64) */
            if (n > 64 && (((v & 1024) && swiglu) || ((v & 2048) && !swiglu && split)) &&
                kvs_cu_dgemm_n2_rows(n, in, out, n_parts, swiglu, dg_sms, (v & 4096) != 0) > 0)
                return SK_DGEMM_N2;
            /* bit 32: the launches the wgmma kernel would split go to k_dgemm_n where it applies;
             * from 33 rows only those (k_dgemm's two-tile blocks were slower than cuBLAS there),
             * unless bit 64 gives k_dgemm one-tile blocks there */
            if ((v & 32) && split && kvs_cu_dgemm_n_rows(n, in, out, n_parts, swiglu, dg_sms) > 0) return SK_DGEMM_N;
            if (n > 8 && (v & 32) && (split || (n > 32 && !(v & 64)))) return SK_CUBLAS;
            if (!(v & 8) || !split) return SK_DGEMM;
            return n > 8 ? SK_CUBLAS : SK_SKINNY; /* bit 8: split launches to k_skinny up to 8 rows */
        }
        if (n > 8) return SK_CUBLAS; /* k_skinny past 8 rows falls behind cuBLAS */
    }
    return SK_SKINNY;
}

int kvs_cu_skinny_takes(int n, int in, const int *out, int n_parts, int swiglu, int dg_sms)
{
    return sk_route_of(kvs_cu_skinny_variant(), n, in, out, n_parts, swiglu, dg_sms) != SK_CUBLAS;
}

cudaError_t kvs_cu_skinny(const struct kvs_cu_skinny *a, cudaStream_t stream)
{
    sk_params p = {};
    p.x = a->x;
    p.n = a->n;
    p.in = a->in;
    p.swiglu = a->swiglu;
    p.n_parts = a->n_parts;
    p.yh = a->yh;
    p.trig = (kvs_cu_pdl_early() & 1) && a->n >= 2;
    unsigned blocks = 0;
    for (int i = 0; i < a->n_parts; i++) {
        p.w[i] = a->w[i];
        p.bias[i] = a->bias[i];
        p.out[i] = a->out[i];
        p.y[i] = a->y[i];
        p.tiles[i] = a->out[i] / 16;
        blocks += (unsigned)p.tiles[i];
    }
    if (a->swiglu) blocks = (unsigned)(a->out[0] / 8);
    const int v = kvs_cu_skinny_variant();
    const int dg_sms = a->ws ? a->ws->n_sms : 0;
    switch (sk_route_of(v, a->n, a->in, a->out, a->n_parts, a->swiglu, dg_sms)) {
    case SK_CUBLAS: return cudaErrorInvalidValue; /* kvs_cu_skinny_takes said no: a caller's bug */
    case SK_GEMV: {
        unsigned rows = 0;
        for (int i = 0; i < a->n_parts; i++) rows += (unsigned)a->out[i];
        if (a->swiglu) rows = (unsigned)a->out[0];
        return kvs_cu_launch(k_gemv1, dim3((rows + GV_WARPS - 1) / GV_WARPS), dim3(GV_WARPS * 32), 0, stream, p);
    }
    case SK_DGEMM_N: {
        /* at most 64 tokens a launch: more go in launches of 64 rows (each row's bits are the
         * same in any of them; the weights are read once per launch) */
        const int rows = kvs_cu_dgemm_n_rows(1, a->in, a->out, a->n_parts, a->swiglu, dg_sms);
        struct kvs_cu_skinny c = *a;
        for (int t0 = 0; t0 < a->n; t0 += 64) {
            c.n = a->n - t0 < 64 ? a->n - t0 : 64;
            c.x = a->x + (size_t)t0 * a->in;
            for (int i = 0; i < a->n_parts; i++) c.y[i] = a->y[i] + (size_t)t0 * a->out[i];
            const cudaError_t e = kvs_cu_dgemm_n(&c, rows, (v >> 7) & 3, stream);
            if (e != cudaSuccess) return e;
        }
        return cudaSuccess;
    }
    case SK_DGEMM_N2: {
        /* bit 8192: the deeper x ring (4096 in rows: cuda_dgemm128.cu's KVS_DGEMM_N2_DEEP_X); bits
         * 16384 / 32768: x shared by clusters of 4 / 2 blocks (k_dgemm_n3; 16384 / 8192 in rows) */
        const int rows = kvs_cu_dgemm_n2_rows(a->n, a->in, a->out, a->n_parts, a->swiglu, dg_sms, (v & 4096) != 0);
        const int cl = (v & 16384) ? 16384 : (v & 32768) ? 8192 : 0;
        return kvs_cu_dgemm_n2(a, rows | ((v & 8192) && !a->swiglu ? 4096 : 0) | cl, stream);
    }
    case SK_DGEMM: return kvs_cu_dgemm(a, a->ws, (v & 1) ? 1 : 2, (v & 16) != 0, (v & 64) != 0, stream);
    case SK_SKINNY: break;
    }
    const dim3 grid(blocks), blk(16 * 32);
    const int nt = a->n <= 8 ? 1 : a->n <= 16 ? 2 : a->n <= 32 ? 4 : a->n <= 64 ? 8 : 16;
    return sk_launch_nt(nt, (v & 1) != 0, (v & 2) != 0, grid, blk, stream, p);
}
