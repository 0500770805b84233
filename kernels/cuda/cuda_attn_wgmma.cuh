/* cuda_attn_wgmma.cuh: the Hopper (sm_90a) pieces of the wgmma prefill attention kernel
 * (cuda_attn_prefill_wg.cu): shared-memory matrix descriptors for 128-byte-swizzled tiles, the
 * wgmma fences, and the warpgroup MMAs it issues (m64nNk16, bf16 in, fp32 accumulate), plus the
 * prefill-kernel choice that cuda_attention.cu plans with (internal to kernels/cuda/).
 *
 * The asm strings list every accumulator register (64 x N / 128 per thread), so they are written
 * out per N. Everything is static or inline (one copy per translation unit, as
 * cuda_attn_device.cuh). Ownership: nothing is allocated here. Errors: none (device code).
 */
#ifndef KVS_CUDA_ATTN_WGMMA_CUH
#define KVS_CUDA_ATTN_WGMMA_CUH

#include "kernels/cuda/cuda_attn_device.cuh"

/* Descriptor of a shared-memory matrix in the 128-byte swizzle mode (layout type 1): start
 * address, leading and stride byte offsets, each in 16-byte units. K-major operands use rows of
 * 64 bf16 (128 bytes), 8-row groups 1024 bytes apart (sbo); lbo is unused for them. N-major B (V)
 * has lbo = the distance between its 64-column blocks. */
static __device__ __forceinline__ uint64_t wg_desc(const void *smem, uint32_t lbo, uint32_t sbo)
{
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(smem);
    return (uint64_t)((a & 0x3FFFF) >> 4) | (uint64_t)((lbo & 0x3FFFF) >> 4) << 16 |
           (uint64_t)((sbo & 0x3FFFF) >> 4) << 32 | 1ull << 62;
}
static __device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
static __device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wg_wait_group()
{
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
/* ties a register to the asm around it, so that the compiler neither reads an accumulator before
 * wg_wait_group nor moves writes to it past the next wgmma */
static __device__ __forceinline__ void wg_reg_fence(float &r) { asm volatile("" : "+f"(r)::"memory"); }
/* shared memory written through the generic proxy (stores, cp.async) made visible to wgmma */
static __device__ __forceinline__ void fence_proxy_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

/* D[64 x 64] (+)= A . B, A and B from shared memory (descriptors), both K-major */
static __device__ __forceinline__ void wgmma_ss_n64(float *d, uint64_t da, uint64_t db, int accumulate)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "l"(da), "l"(db), "r"(accumulate));
}

/* D[64 x 128] (+)= A . B, A and B from shared memory (descriptors), both K-major */
static __device__ __forceinline__ void wgmma_ss_n128(float *d, uint64_t da, uint64_t db, int accumulate)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "l"(da), "l"(db), "r"(accumulate));
}

/* D[64 x 64] += A . B, A from registers (the m16n8k16 A fragment of each warp's 16 rows), B
 * from shared memory N-major (transposed: imm-trans-b 1) */
static __device__ __forceinline__ void wgmma_rs_n64_tb(float *d, const uint32_t *a, uint64_t db)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

/* D[64 x 128] += A . B, A from registers (the m16n8k16 A fragment of each warp's 16 rows), B
 * from shared memory N-major (transposed: imm-trans-b 1) */
static __device__ __forceinline__ void wgmma_rs_n128_tb(float *d, const uint32_t *a, uint64_t db)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

/* ---- the pieces both prefill kernels (k_attn_wg, k_attn_fa3) build on ---- */

#define WG_ROWS 128 /* rows of a prefill block: 2 (consumer) warpgroups x 64 */

/* element offset of (row r, column d) in a tile of R rows x HD columns stored as HD / 64 blocks of
 * R rows x 64 columns, 16-byte chunk c of row r at chunk c ^ (r & 7) (the 128-byte swizzle) */
template <int R>
__device__ __forceinline__ int sw128(int r, int d)
{
    return (d >> 6) * (R * 64) + r * 64 + ((((d >> 3) & 7) ^ (r & 7)) << 3) + (d & 7);
}

static __device__ __forceinline__ float ex2(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

template <int N>
__device__ __forceinline__ void wgmma_qk(float *d, uint64_t da, uint64_t db, int acc)
{
    if constexpr (N == 128) wgmma_ss_n128(d, da, db, acc);
    else wgmma_ss_n64(d, da, db, acc);
}
template <int N>
__device__ __forceinline__ void wgmma_pv(float *d, const uint32_t *a, uint64_t db)
{
    if constexpr (N == 128) wgmma_rs_n128_tb(d, a, db);
    else wgmma_rs_n64_tb(d, a, db);
}

/* S[64 x KN] = Q . K^T for the warpgroup's 64 rows of a Q tile of QR rows: HD / 16 k-steps; a
 * k-step of 16 columns is 32 bytes further along a row, a 64-column block R x 128 bytes further (R:
 * the tile's rows; in the descriptors' 16-byte units: 2, R x 8) */
template <int HD, int KN, int QR = WG_ROWS>
__device__ __forceinline__ void qk_issue(float *sc, uint64_t qdesc, uint64_t kdesc)
{
#pragma unroll
    for (int ks = 0; ks < HD / 16; ks++)
        wgmma_qk<KN>(sc, qdesc + (uint64_t)((ks >> 2) * QR * 8 + (ks & 3) * 2),
                     kdesc + (uint64_t)((ks >> 2) * KN * 8 + (ks & 3) * 2), ks > 0);
}

/* O[64 x HD] += P . V: KN / 16 k-steps of 16 keys, 2 groups of 8 V rows (2048 bytes) each; V is
 * N-major, its 64-column blocks KN x 128 bytes apart (the descriptor's lbo) */
template <int HD, int KN>
__device__ __forceinline__ void pv_issue(float *o, const uint32_t (*pa)[4], uint64_t vdesc)
{
#pragma unroll
    for (int kk = 0; kk < KN / 16; kk++) wgmma_pv<HD>(o, pa[kk], vdesc + (uint64_t)(kk * 128));
}

/* One online-softmax step on the scores sc of a KN-key tile (log2 domain; the m64nNk16
 * accumulator layout: sc[j * 4 + e] is row g + 8 (e >> 1), key 8 j + 2 t + (e & 1)), masked
 * already where needed: updates the running max m and the thread's partial sum l, leaves the
 * probabilities in sc and the factor O must be rescaled by in alpha. */
template <int KN>
__device__ __forceinline__ void softmax_core(float *sc, float *m, float *l, float *alpha)
{
    float mx[2] = {-INFINITY, -INFINITY}, mu[2], ps[2] = {0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < KN / 2; i++) mx[(i >> 1) & 1] = fmaxf(mx[(i >> 1) & 1], sc[i]);
#pragma unroll
    for (int h = 0; h < 2; h++) {
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(FULL, mx[h], 1));
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(FULL, mx[h], 2));
        const float mn = fmaxf(m[h], mx[h]);
        mu[h] = mn == -INFINITY ? 0.0f : mn; /* a row with nothing visible yet: exp2(-inf) = 0 */
        alpha[h] = ex2(m[h] - mu[h]);
        m[h] = mn;
    }
#pragma unroll
    for (int i = 0; i < KN / 2; i++) {
        const float p = ex2(sc[i] - mu[(i >> 1) & 1]);
        sc[i] = p;
        ps[(i >> 1) & 1] += p;
    }
#pragma unroll
    for (int h = 0; h < 2; h++) l[h] = l[h] * alpha[h] + ps[h];
}

/* softmax_core after the masks (when mask) of a tile starting at key kb: slots ko[] marks
 * KEY_PAD, keys past a row's last lim[] */
template <int KN>
__device__ __forceinline__ void softmax_wg(float *sc, const int *ko, int kb, bool mask, const int *lim, float *m,
                                           float *l, float *alpha, int t)
{
    if (mask) {
#pragma unroll
        for (int j = 0; j < KN / 8; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int col = j * 8 + 2 * t + (e & 1);
                if (ko[col] == KEY_PAD || kb + col > lim[e >> 1]) sc[j * 4 + e] = -INFINITY;
            }
    }
    softmax_core<KN>(sc, m, l, alpha);
}

/* P as the A fragments of each 16-key k-step (bf16) */
template <int KN>
__device__ __forceinline__ void pack_p(const float *sc, uint32_t (*pa)[4])
{
#pragma unroll
    for (int kk = 0; kk < KN / 16; kk++) {
        pa[kk][0] = pack_bf16(sc[8 * kk + 0], sc[8 * kk + 1]);
        pa[kk][1] = pack_bf16(sc[8 * kk + 2], sc[8 * kk + 3]);
        pa[kk][2] = pack_bf16(sc[8 * kk + 4], sc[8 * kk + 5]);
        pa[kk][3] = pack_bf16(sc[8 * kk + 6], sc[8 * kk + 7]);
    }
}

/* cuda_attn_prefill_wg.cu: the prefill kernel a launch takes (1: k_attn_tc, 2 to 6: k_attn_wg's
 * variants, 7 to 25: k_attn_fa3's; kvs_cuda_set_pre_attn, KVS_CUDA_PRE_ATTN) and its query tokens per tile
 * for a group of G query heads per KV head: the plan (cuda_attention.cu) and the launch agree. */
int kvs_cu_attn_prefill_kind(int hd, int rot);
int kvs_cu_attn_prefill_qt(int kind, int G);
/* cuda_attn_prefill_wg.cu: kind (kvs_cu_attn_prefill_kind's) for a launch of `items` tiles x KV
 * heads on n_sms SMs: the default kind 14 becomes kind 25 at a few waves (same tiles) */
int kvs_cu_attn_prefill_kind_for(int kind, long long items, int n_sms);
/* cuda_attn_prefill_wg.cu: launches k_attn_wg (kind 2 to 6) or k_attn_fa3 (7 to 25) over prefill tiles
 * of x.qt tokens (k_attn_wg's kind 6 where k_attn_fa3 cannot take the launch) */
void kvs_cu_attn_prefill_wg(at_args &x, int kind, int hd, int n_tiles, int max_ctx, cudaStream_t st, int n_sms,
                            size_t ws_floats, int n, int force);
/* cuda_attn_prefill_fa3.cu: launches k_attn_fa3 (kind 7 to 25); false (nothing launched) where it
 * does not apply: head_dim other than 64 / 128, blocks of other than a multiple of 16 slots, no
 * tensor maps from the driver (never with rotation offsets: kvs_cu_attn_fa3_rotates) */
bool kvs_cu_attn_prefill_fa3(at_args &x, int kind, int hd, int n_tiles, int max_ctx, cudaStream_t st, int n_sms,
                             size_t ws_floats, int n, int force);
/* cuda_attn_prefill_fa3.cu: true for the k_attn_fa3 kinds with the deferred rotation built in (14,
 * 19 to 25); a launch with rotation offsets in one of them must have blocks of a multiple of 16
 * slots (the plan hands others to k_attn_tc) */
bool kvs_cu_attn_fa3_rotates(int kind);
/* cuda_attn_decode.cu: x.tm_k / x.tm_v, the K and V pools as 2D tensors [kv_rows][hd] for the copy
 * engine (boxes of 16 rows x 64 columns, 128-byte swizzle); false where the driver cannot encode them */
bool fd_tma_maps(at_args &x, int hd);

/* The epilogue of the wgmma prefill kernels (k_attn_wg, k_attn_fa3): a warp's rows rw and rw + 8
 * of the O accumulator o (the mma's C layout: thread t of its quad holds columns 2t and 2t + 1 of
 * each 8-column group), each divided by its row sum l (reduced over the quad here) and stored as
 * fp32 (and bf16 where a.outh), or, in a split launch, stored unnormalised into a.part with the
 * row's max (m, log2 units, turned into natural log) and sum for attn_merge. Rows at or past nr
 * (the tile's real rows) are skipped. */
template <int HD>
__device__ __forceinline__ void wg_store_rows(const at_args &a, const float (&o)[HD / 2], const float (&m)[2],
                                              const float (&l)[2], int rw, int nr, int t, int qs, int r0, int kvh,
                                              int split)
{
#pragma unroll
    for (int h = 0; h < 2; h++) {
        float ls = l[h];
        ls += __shfl_xor_sync(FULL, ls, 1);
        ls += __shfl_xor_sync(FULL, ls, 2);
        const int row = rw + 8 * h;
        if (row >= nr) continue;
        const size_t tq = (size_t)qs + r0 + row / a.G;
        const size_t orow = tq * a.n_heads + (size_t)kvh * a.G + row % a.G;
        if (a.n_splits == 1) {
            float *op = a.out + orow * HD + 2 * t;
            bf16 *oh = a.outh ? a.outh + orow * HD + 2 * t : nullptr;
            const float inv = 1.0f / ls;
#pragma unroll
            for (int nd = 0; nd < HD / 8; nd++) {
                const float v0 = o[nd * 4 + 2 * h] * inv, v1 = o[nd * 4 + 2 * h + 1] * inv;
                *(float2 *)(op + nd * 8) = make_float2(v0, v1);
                if (oh) *(__nv_bfloat162 *)(oh + nd * 8) = __floats2bfloat162_rn(v0, v1);
            }
        } else {
            float *pp = a.part + (orow * a.n_splits + split) * (size_t)(HD + 2);
#pragma unroll
            for (int nd = 0; nd < HD / 8; nd++) {
                pp[nd * 8 + 2 * t] = o[nd * 4 + 2 * h];
                pp[nd * 8 + 2 * t + 1] = o[nd * 4 + 2 * h + 1];
            }
            if (t == 0) {
                pp[HD] = m[h] * 0.6931471805599453f; /* the merge works in natural log */
                pp[HD + 1] = ls;
            }
        }
    }
}

#endif
