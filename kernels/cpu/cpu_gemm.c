/* cpu_gemm.c: the CPU matmul y = x @ W^T (+ bias) three ways (cpu_kernels.h): the plain-C
 * reference, register-blocked AVX2 tiles with the reference's summation order (mul + add:
 * bitwise the reference; FMA: bitwise kvs_cpu_dot_fma; both batch invariant), and OpenBLAS
 * (opt-in, not batch invariant). Also the kernel selection
 * from the environment. */
#include <cblas.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/util.h"
#include "kernels/cpu/cpu_kernels.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define KVS_CPU_X86 1
#else
#define KVS_CPU_X86 0
#endif

/* ---- selection -------------------------------------------------------------------------- */

enum kvs_cpu_isa kvs_cpu_isa_best(void)
{
#if KVS_CPU_X86
    __builtin_cpu_init();
    /* AVX-512F: libgcc also checks that the OS saves the 512-bit state (XCR0) */
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return KVS_CPU_ISA_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return KVS_CPU_ISA_FMA;
    if (__builtin_cpu_supports("avx2")) return KVS_CPU_ISA_AVX2;
#endif
    return KVS_CPU_ISA_REF;
}

const char *kvs_cpu_isa_name(enum kvs_cpu_isa isa)
{
    return isa == KVS_CPU_ISA_AVX512 ? "avx512" : isa == KVS_CPU_ISA_FMA ? "fma" : isa == KVS_CPU_ISA_AVX2 ? "avx2" : "ref";
}

int kvs_cpu_kernels_from_env(struct kvs_cpu_kernels *k, char *err, size_t errlen)
{
    const char *e = getenv("KVS_CPU_KERNELS");
    k->isa = kvs_cpu_isa_best();
    if (e && *e && strcmp(e, "auto") != 0) {
        if (strcmp(e, "ref") == 0) {
            k->isa = KVS_CPU_ISA_REF;
        } else if (strcmp(e, "avx2") == 0) {
            if (kvs_cpu_isa_best() < KVS_CPU_ISA_AVX2)
                return kvs_err(err, errlen, -EINVAL, "KVS_CPU_KERNELS=avx2: this CPU has no AVX2");
            k->isa = KVS_CPU_ISA_AVX2;
        } else if (strcmp(e, "fma") == 0) {
            if (kvs_cpu_isa_best() < KVS_CPU_ISA_FMA)
                return kvs_err(err, errlen, -EINVAL, "KVS_CPU_KERNELS=fma: this CPU has no AVX2 + FMA");
            k->isa = KVS_CPU_ISA_FMA;
        } else if (strcmp(e, "avx512") == 0) {
            if (kvs_cpu_isa_best() < KVS_CPU_ISA_AVX512)
                return kvs_err(err, errlen, -EINVAL, "KVS_CPU_KERNELS=avx512: this CPU has no AVX-512F (+ AVX2 + FMA)");
            k->isa = KVS_CPU_ISA_AVX512;
        } else {
            return kvs_err(err, errlen, -EINVAL, "KVS_CPU_KERNELS=%s: want auto, ref, avx2, fma or avx512", e);
        }
    }
    e = getenv("KVS_CPU_GEMM");
    /* panels need FMA; the other sets keep the dot-product tiles ("invariant": bitwise their
     * references) */
    k->gemm = k->isa >= KVS_CPU_ISA_FMA ? KVS_CPU_GEMM_PANEL : KVS_CPU_GEMM_INVARIANT;
    if (e && *e && strcmp(e, "auto") != 0) {
        if (strcmp(e, "blas") == 0) {
            k->gemm = KVS_CPU_GEMM_BLAS;
        } else if (strcmp(e, "invariant") == 0 || strcmp(e, "dot") == 0) {
            k->gemm = KVS_CPU_GEMM_INVARIANT;
        } else if (strcmp(e, "panel") == 0) {
            if (k->isa < KVS_CPU_ISA_FMA)
                return kvs_err(err, errlen, -EINVAL, "KVS_CPU_GEMM=panel needs the fma kernel set (AVX2 + FMA)");
            k->gemm = KVS_CPU_GEMM_PANEL;
        } else {
            return kvs_err(err, errlen, -EINVAL, "KVS_CPU_GEMM=%s: want auto, panel, invariant (dot) or blas", e);
        }
    }
    e = getenv("KVS_CPU_WEIGHTS");
    k->bf16_weights = k->isa != KVS_CPU_ISA_REF && k->gemm != KVS_CPU_GEMM_BLAS;
    if (e && *e) {
        if (strcmp(e, "f32") == 0)
            k->bf16_weights = 0;
        else if (strcmp(e, "auto") != 0)
            return kvs_err(err, errlen, -EINVAL, "KVS_CPU_WEIGHTS=%s: want auto or f32", e);
    }
    return 0;
}

const char *kvs_cpu_blas_name(void)
{
    static char name[96];
    snprintf(name, sizeof name, "OpenBLAS %s", openblas_get_corename());
    return name;
}

void kvs_cpu_blas_init(void)
{
    /* the pool's threads call sgemm on disjoint tiles; OpenBLAS threads of its own would
     * oversubscribe the cores (they spin after each call while the pool runs the next op) */
    openblas_set_num_threads(1);
}

/* ---- reference (the pre-AVX2 path, kept as the oracle) ---------------------------------- */

/* four dot products sharing the loads of w; each result bitwise equal to kvs_cpu_dot */
static inline void dot4(const float *x, size_t stride, const float *w, int n, float out[4])
{
    float acc[4][8] = {{0}};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int r = 0; r < 4; r++)
            for (int j = 0; j < 8; j++) acc[r][j] += x[(size_t)r * stride + i + j] * w[i + j];
    for (int r = 0; r < 4; r++) {
        const float *a = acc[r], *xr = x + (size_t)r * stride;
        float s = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
        for (int k = i; k < n; k++) s += xr[k] * w[k];
        out[r] = s;
    }
}

struct gemm_job {
    const float *x, *w, *bias;
    const uint16_t *wb;           /* bf16 weight (w NULL), AVX2 only */
    const struct kvs_cpu_qblocks *qb;   /* weight blocks (w NULL; kvs_cpu_gemm_qb), AVX2 only */
    float *y;
    int n, in, out;
    int rb, ob, n_ob;             /* tile rows / outputs, output tiles per row tile */
    int n_rb;                     /* row tiles (AVX2 / FMA: tasks are ordered output tile first) */
};

#define REF_TILE 16
#ifndef OB_AVX2
#define OB_AVX2 32
#endif
#ifndef RB_BYTES
#define RB_BYTES (16 * 1024)
#endif

#if KVS_CPU_X86 && !defined(__clang__)
__attribute__((target_clones("avx2", "default")))
#endif
static void ref_task(void *c, int task)
{
    struct gemm_job *j = c;
    int in = j->in, out = j->out;
    int o0 = task * REF_TILE, o1 = o0 + REF_TILE < out ? o0 + REF_TILE : out;
    int t = 0;
    for (; t + 4 <= j->n; t += 4) {
        const float *xr = j->x + (size_t)t * in;
        float *yr = j->y + (size_t)t * out;
        for (int o = o0; o < o1; o++) {
            float s[4];
            dot4(xr, (size_t)in, j->w + (size_t)o * in, in, s);
            for (int k = 0; k < 4; k++) yr[(size_t)k * out + o] = j->bias ? s[k] + j->bias[o] : s[k];
        }
    }
    for (; t < j->n; t++) {
        const float *xr = j->x + (size_t)t * in;
        float *yr = j->y + (size_t)t * out;
        for (int o = o0; o < o1; o++) {
            float s = kvs_cpu_dot(xr, j->w + (size_t)o * in, in);
            yr[o] = j->bias ? s + j->bias[o] : s;
        }
    }
}

/* ---- AVX2 tiles ----------------------------------------------------------------------------
 * Each accumulator is one (row, output) pair's eight reference lanes; mul then add (AVX2 set:
 * bitwise kvs_cpu_dot) or fused (FMA set: bitwise kvs_cpu_dot_fma), the reference's tree and
 * tail. A 4 x 2 tile loads 6 vectors per 8 multiply-
 * adds and keeps 8 accumulators + 6 operands in the 16 ymm registers; leftover rows (n % 4, and
 * all of a one-row decode step) take 1 x 4 tiles, which stream W at memory speed. Tasks are
 * (row block, output block) tiles, output block first: a block of x rows stays in L1 while pairs
 * of W rows pass, and a block of W rows stays in L2 while the row blocks pass. */
#if KVS_CPU_X86
#define AVX2 __attribute__((target("avx2,fma")))

/* one lane step: mul then add (AVX2, the reference's bits), or fused (FMA, kvs_cpu_dot_fma's) */
#define MADD(acc, a, b) acc = fm ? _mm256_fmadd_ps(a, b, acc) : _mm256_add_ps(acc, _mm256_mul_ps(a, b))

/* the reference tree of four accumulators at once: hadd pairs lanes (l0+l1, l2+l3, ...), the
 * second hadd adds those pairs, the last add joins the two 128-bit halves:
 * ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)) for each of a, b, c, d, in that order */
AVX2 static inline __m128 reduce4(__m256 a, __m256 b, __m256 c, __m256 d)
{
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* Weight rows are fp32 or bf16 (widened in registers: exact, so the bits are the fp32 copy's).
 * The tiles are written once, always inline, with the weight type a constant argument, and
 * instantiated for both (tile_f32 / tile_bf16 below). */
#define ALWAYS __attribute__((always_inline))
AVX2 static inline ALWAYS __m256 loadw(const void *w, size_t i, const int bf)
{
    if (bf)
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + i))), 16));
    return _mm256_loadu_ps((const float *)w + i);
}
static inline ALWAYS float wat(const void *w, size_t i, const int bf)
{
    return bf ? kvs_cpu_bf16(((const uint16_t *)w)[i]) : ((const float *)w)[i];
}
static inline ALWAYS const void *wrow(const void *w, size_t row, size_t in, const int bf)
{
    return bf ? (const void *)((const uint16_t *)w + row * in) : (const void *)((const float *)w + row * in);
}

/* the four sums s finished as the reference does: the k tail in order, then the bias */
AVX2 static inline ALWAYS void finish4(__m128 s, const float *const xr[4], const void *const wr[4], int k8, int in,
                                       const float *bias, const int o[4], float out[4], const int bf)
{
    _mm_storeu_ps(out, s);
    if (k8 < in)
        for (int r = 0; r < 4; r++)
            for (int k = k8; k < in; k++) out[r] += xr[r][k] * wat(wr[r], (size_t)k, bf);
    if (bias)
        for (int r = 0; r < 4; r++) out[r] += bias[o[r]];
}

AVX2 static inline ALWAYS void tile4x2(const float *x, const void *w, int in, int k8, float *y, int out,
                                       const float *bias, int o, const int bf, const int fm)
{
    const size_t s = (size_t)in;
    const float *x0 = x, *x1 = x + s, *x2 = x + 2 * s, *x3 = x + 3 * s;
    const void *w0 = w, *w1 = wrow(w, 1, s, bf);
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
#pragma GCC unroll 2   /* GCC schedules two k steps per iteration markedly better (bench/RESULTS.md) */
    for (int i = 0; i < k8; i += 8) {
        __m256 b0 = loadw(w0, (size_t)i, bf), b1 = loadw(w1, (size_t)i, bf);
        __m256 v0 = _mm256_loadu_ps(x0 + i), v1 = _mm256_loadu_ps(x1 + i);
        MADD(a00, v0, b0);
        MADD(a01, v0, b1);
        MADD(a10, v1, b0);
        MADD(a11, v1, b1);
        __m256 v2 = _mm256_loadu_ps(x2 + i), v3 = _mm256_loadu_ps(x3 + i);
        MADD(a20, v2, b0);
        MADD(a21, v2, b1);
        MADD(a30, v3, b0);
        MADD(a31, v3, b1);
    }
    const size_t so = (size_t)out;
    const int oo[4] = {o, o + 1, o, o + 1};
    const void *wr[4] = {w0, w1, w0, w1};
    const float *xa[4] = {x0, x0, x1, x1}, *xb[4] = {x2, x2, x3, x3};
    float r[4];
    finish4(reduce4(a00, a01, a10, a11), xa, wr, k8, in, bias, oo, r, bf);
    y[o] = r[0], y[o + 1] = r[1], y[so + o] = r[2], y[so + o + 1] = r[3];
    finish4(reduce4(a20, a21, a30, a31), xb, wr, k8, in, bias, oo, r, bf);
    y[2 * so + o] = r[0], y[2 * so + o + 1] = r[1], y[3 * so + o] = r[2], y[3 * so + o + 1] = r[3];
}

/* 4 rows x 3 outputs: 12 accumulators, 7 loads per 12 multiply-adds (tile4x2: 6 per 8); each
 * (row, output) the same lanes, tree, tail and bias as every other tile */
AVX2 static inline ALWAYS void tile4x3(const float *x, const void *w, int in, int k8, float *y, int out,
                                       const float *bias, int o, const int bf, const int fm)
{
    const size_t s = (size_t)in;
    const float *x0 = x, *x1 = x + s, *x2 = x + 2 * s, *x3 = x + 3 * s;
    const void *w0 = w, *w1 = wrow(w, 1, s, bf), *w2 = wrow(w, 2, s, bf);
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a10 = a00, a11 = a00, a12 = a00;
    __m256 a20 = a00, a21 = a00, a22 = a00, a30 = a00, a31 = a00, a32 = a00;
    for (int i = 0; i < k8; i += 8) {
        const __m256 b0 = loadw(w0, (size_t)i, bf), b1 = loadw(w1, (size_t)i, bf), b2 = loadw(w2, (size_t)i, bf);
        __m256 v = _mm256_loadu_ps(x0 + i);
        MADD(a00, v, b0);
        MADD(a01, v, b1);
        MADD(a02, v, b2);
        v = _mm256_loadu_ps(x1 + i);
        MADD(a10, v, b0);
        MADD(a11, v, b1);
        MADD(a12, v, b2);
        v = _mm256_loadu_ps(x2 + i);
        MADD(a20, v, b0);
        MADD(a21, v, b1);
        MADD(a22, v, b2);
        v = _mm256_loadu_ps(x3 + i);
        MADD(a30, v, b0);
        MADD(a31, v, b1);
        MADD(a32, v, b2);
    }
    const size_t so = (size_t)out;
    float r[4];
    {
        const int oo[4] = {o, o + 1, o + 2, o};
        const void *wr[4] = {w0, w1, w2, w0};
        const float *xr[4] = {x0, x0, x0, x1};
        finish4(reduce4(a00, a01, a02, a10), xr, wr, k8, in, bias, oo, r, bf);
        y[o] = r[0], y[o + 1] = r[1], y[o + 2] = r[2], y[so + o] = r[3];
    }
    {
        const int oo[4] = {o + 1, o + 2, o, o + 1};
        const void *wr[4] = {w1, w2, w0, w1};
        const float *xr[4] = {x1, x1, x2, x2};
        finish4(reduce4(a11, a12, a20, a21), xr, wr, k8, in, bias, oo, r, bf);
        y[so + o + 1] = r[0], y[so + o + 2] = r[1], y[2 * so + o] = r[2], y[2 * so + o + 1] = r[3];
    }
    {
        const int oo[4] = {o + 2, o, o + 1, o + 2};
        const void *wr[4] = {w2, w0, w1, w2};
        const float *xr[4] = {x2, x3, x3, x3};
        finish4(reduce4(a22, a30, a31, a32), xr, wr, k8, in, bias, oo, r, bf);
        y[2 * so + o + 2] = r[0], y[3 * so + o] = r[1], y[3 * so + o + 1] = r[2], y[3 * so + o + 2] = r[3];
    }
}

AVX2 static inline ALWAYS void tile1x4(const float *x, const void *w, int in, int k8, float *y, const float *bias,
                                       int o, const int bf, const int fm)
{
    const size_t s = (size_t)in;
    const void *w0 = w, *w1 = wrow(w, 1, s, bf), *w2 = wrow(w, 2, s, bf), *w3 = wrow(w, 3, s, bf);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
#pragma GCC unroll 2
    for (int i = 0; i < k8; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        MADD(a0, v, loadw(w0, (size_t)i, bf));
        MADD(a1, v, loadw(w1, (size_t)i, bf));
        MADD(a2, v, loadw(w2, (size_t)i, bf));
        MADD(a3, v, loadw(w3, (size_t)i, bf));
    }
    const int oo[4] = {o, o + 1, o + 2, o + 3};
    const float *xr[4] = {x, x, x, x};
    const void *wr[4] = {w0, w1, w2, w3};
    finish4(reduce4(a0, a1, a2, a3), xr, wr, k8, in, bias, oo, y + o, bf);
}

AVX2 static inline ALWAYS void tile1x1(const float *x, const void *w, int in, int k8, float *y, const float *bias,
                                       int o, const int bf, const int fm)
{
    __m256 a = _mm256_setzero_ps();
    for (int i = 0; i < k8; i += 8) MADD(a, _mm256_loadu_ps(x + i), loadw(w, (size_t)i, bf));
    (void)fm;
    float l[8];
    _mm256_storeu_ps(l, a);
    float s = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
    for (int k = k8; k < in; k++) s += x[k] * wat(w, (size_t)k, bf);
    y[o] = bias ? s + bias[o] : s;
}

AVX2 static inline ALWAYS void avx2_tiles(const struct gemm_job *j, int task, const int bf, const int fm)
{
    const int in = j->in, out = j->out, k8 = in / 8 * 8;
    /* output tile first: consecutive tasks (claimed in order by the threads) keep one block of W
     * rows in cache while the row tiles pass, so W streams from memory once per call (the row-tile-first order streamed
     * it once per row tile: 2.3x slower on SmolLM2's LM head at 16 rows, bench/RESULTS.md) */
    const int rbi = task % j->n_rb, obi = task / j->n_rb;
    const int t0 = rbi * j->rb, t1 = t0 + j->rb < j->n ? t0 + j->rb : j->n;
    const int o0 = obi * j->ob, o1 = o0 + j->ob < out ? o0 + j->ob : out;
    const int t4 = t0 + (t1 - t0) / 4 * 4;
    const float *x = j->x;
    const void *w = bf ? (const void *)j->wb : (const void *)j->w;
    int o = o0;
    for (; o + 3 <= o1; o += 3)
        for (int t = t0; t < t4; t += 4)
            tile4x3(x + (size_t)t * in, wrow(w, (size_t)o, (size_t)in, bf), in, k8, j->y + (size_t)t * out, out,
                    j->bias, o, bf, fm);
    for (; o + 2 <= o1; o += 2)
        for (int t = t0; t < t4; t += 4)
            tile4x2(x + (size_t)t * in, wrow(w, (size_t)o, (size_t)in, bf), in, k8, j->y + (size_t)t * out, out,
                    j->bias, o, bf, fm);
    for (; o < o1; o++)
        for (int t = t0; t < t4; t++)
            tile1x1(x + (size_t)t * in, wrow(w, (size_t)o, (size_t)in, bf), in, k8, j->y + (size_t)t * out, j->bias, o,
                    bf, fm);
    for (int t = t4; t < t1; t++) {
        const float *xr = x + (size_t)t * in;
        float *yr = j->y + (size_t)t * out;
        for (o = o0; o + 4 <= o1; o += 4) tile1x4(xr, wrow(w, (size_t)o, (size_t)in, bf), in, k8, yr, j->bias, o, bf, fm);
        for (; o < o1; o++) tile1x1(xr, wrow(w, (size_t)o, (size_t)in, bf), in, k8, yr, j->bias, o, bf, fm);
    }
}

/* The same tiles on weight blocks. A task is one tile of ob outputs over ALL rows: its W rows
 * are rebuilt in fp32 on the stack once (kvs_cpu_qb_row: bitwise the fp32 copy; at most
 * QB_BUF_FLOATS, which stays in L2), then the row blocks pass over them as in avx2_tiles, so the
 * rebuild is paid once per weight and call, and each (row, output) gets exactly the fp32
 * kernel's bits. W streams from memory at 0.75 (4-bit) or 1.125 (8-bit) bytes per weight
 * instead of 4. */
#define QB_BUF_FLOATS 32768
AVX2 static inline ALWAYS void qb_tiles(const struct gemm_job *j, int task, const int fm)
{
    const int in = j->in, out = j->out, k8 = in / 8 * 8;
    const int o0 = task * j->ob, o1 = o0 + j->ob < out ? o0 + j->ob : out;
    float wbuf[QB_BUF_FLOATS] __attribute__((aligned(32)));
    for (int o = o0; o < o1; o++) kvs_cpu_qb_row(j->qb, in, (size_t)o, wbuf + (size_t)(o - o0) * in);
    const float *x = j->x;
    for (int t0 = 0; t0 < j->n; t0 += j->rb) {
        const int t1 = t0 + j->rb < j->n ? t0 + j->rb : j->n, t4 = t0 + (t1 - t0) / 4 * 4;
        int o = o0;
        for (; o + 3 <= o1; o += 3)
            for (int t = t0; t < t4; t += 4)
                tile4x3(x + (size_t)t * in, wbuf + (size_t)(o - o0) * in, in, k8, j->y + (size_t)t * out, out, j->bias,
                        o, 0, fm);
        for (; o + 2 <= o1; o += 2)
            for (int t = t0; t < t4; t += 4)
                tile4x2(x + (size_t)t * in, wbuf + (size_t)(o - o0) * in, in, k8, j->y + (size_t)t * out, out, j->bias,
                        o, 0, fm);
        for (; o < o1; o++)
            for (int t = t0; t < t4; t++)
                tile1x1(x + (size_t)t * in, wbuf + (size_t)(o - o0) * in, in, k8, j->y + (size_t)t * out, j->bias, o, 0,
                        fm);
        for (int t = t4; t < t1; t++) {
            const float *xr = x + (size_t)t * in;
            float *yr = j->y + (size_t)t * out;
            for (o = o0; o + 4 <= o1; o += 4) tile1x4(xr, wbuf + (size_t)(o - o0) * in, in, k8, yr, j->bias, o, 0, fm);
            for (; o < o1; o++) tile1x1(xr, wbuf + (size_t)(o - o0) * in, in, k8, yr, j->bias, o, 0, fm);
        }
    }
}

AVX2 static void avx2_qb_task(void *c, int task) { qb_tiles(c, task, 0); }
AVX2 static void fma_qb_task(void *c, int task) { qb_tiles(c, task, 1); }
AVX2 static void avx2_task(void *c, int task) { avx2_tiles(c, task, 0, 0); }
AVX2 static void avx2_bf16_task(void *c, int task) { avx2_tiles(c, task, 1, 0); }
AVX2 static void fma_task(void *c, int task) { avx2_tiles(c, task, 0, 1); }
AVX2 static void fma_bf16_task(void *c, int task) { avx2_tiles(c, task, 1, 1); }
#endif

/* ---- OpenBLAS ------------------------------------------------------------------------------
 * Fixed tiles (depending on n and out only, never on the thread count, so the bits do not
 * either); each is one single-threaded sgemm. */
static void blas_task(void *c, int task)
{
    struct gemm_job *j = c;
    const int t0 = task / j->n_ob * j->rb, t1 = t0 + j->rb < j->n ? t0 + j->rb : j->n;
    const int o0 = task % j->n_ob * j->ob, o1 = o0 + j->ob < j->out ? o0 + j->ob : j->out;
    float *y = j->y + (size_t)t0 * j->out + o0;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, t1 - t0, o1 - o0, j->in, 1.0f, j->x + (size_t)t0 * j->in,
                j->in, j->w + (size_t)o0 * j->in, j->in, 0.0f, y, j->out);
    if (j->bias)
        for (int t = 0; t < t1 - t0; t++)
            for (int o = 0; o < o1 - o0; o++) y[(size_t)t * j->out + o] += j->bias[o0 + o];
}

void kvs_cpu_gemm(struct kvs_cpu_pool *pool, const struct kvs_cpu_kernels *k, const float *x, const float *w,
                  const uint16_t *wb, const float *bias, int n, int in, int out, float *y)
{
    if (n <= 0 || out <= 0) return;
    KVS_ASSERT(!wb || (k->bf16_weights && k->isa != KVS_CPU_ISA_REF && k->gemm == KVS_CPU_GEMM_INVARIANT));
    struct gemm_job j = {.x = x, .w = w, .wb = wb, .bias = bias, .y = y, .n = n, .in = in, .out = out};
    if (k->gemm == KVS_CPU_GEMM_BLAS && n >= KVS_CPU_BLAS_MIN_ROWS) {
        j.rb = 256;
        j.ob = n >= 256 ? 256 : 64;
        j.n_ob = (out + j.ob - 1) / j.ob;
        kvs_cpu_pool_run(pool, (n + j.rb - 1) / j.rb * j.n_ob, blas_task, &j);
        return;
    }
#if KVS_CPU_X86
    if (k->isa != KVS_CPU_ISA_REF) {
        /* x rows of a block: ~16 KiB, so they stay in L1 beside the W pair while the 4-row
         * tiles pass over them, a multiple of the 4-row tile */
        int rb = (int)(RB_BYTES / ((size_t)in * sizeof(float))) / 4 * 4;
        j.rb = rb < 4 ? 4 : rb > 256 ? 256 : rb;
        j.ob = OB_AVX2;
        j.n_ob = (out + j.ob - 1) / j.ob;
        j.n_rb = (n + j.rb - 1) / j.rb;
        kvs_cpu_task_fn fn = k->isa >= KVS_CPU_ISA_FMA ? (wb ? fma_bf16_task : fma_task) : (wb ? avx2_bf16_task : avx2_task);
        kvs_cpu_pool_run_sized(pool, (n + j.rb - 1) / j.rb * j.n_ob, (double)n * in * out, fn, &j);
        return;
    }
#endif
    kvs_cpu_pool_run(pool, (out + REF_TILE - 1) / REF_TILE, ref_task, &j);
}

void kvs_cpu_gemm_qb(struct kvs_cpu_pool *pool, const struct kvs_cpu_kernels *k, const float *x,
                     const struct kvs_cpu_qblocks *qb, const float *bias, int n, int in, int out, float *y)
{
    KVS_ASSERT(!qb->panel);   /* panel order is the panel GEMM's */
    if (n <= 0 || out <= 0) return;
    KVS_ASSERT(k->isa != KVS_CPU_ISA_REF && k->gemm != KVS_CPU_GEMM_BLAS && in % KVS_CPU_Q4_BLOCK == 0 &&
               in <= KVS_CPU_Q4_MAX_COLS);
#if KVS_CPU_X86
    /* row blocks as kvs_cpu_gemm's AVX2 / FMA path; one task per output tile (qb_tiles) */
    struct gemm_job j = {.x = x, .qb = qb, .bias = bias, .y = y, .n = n, .in = in, .out = out};
    int rb = (int)(RB_BYTES / ((size_t)in * sizeof(float))) / 4 * 4;
    j.rb = rb < 4 ? 4 : rb > 256 ? 256 : rb;
    int ob = QB_BUF_FLOATS / in / 2 * 2;
    j.ob = ob > OB_AVX2 ? OB_AVX2 : ob;
    kvs_cpu_pool_run_sized(pool, (out + j.ob - 1) / j.ob, (double)n * in * out,
                           k->isa >= KVS_CPU_ISA_FMA ? fma_qb_task : avx2_qb_task, &j);
#else
    (void)pool, (void)x, (void)qb, (void)bias, (void)in, (void)y;
    KVS_ASSERT(!"4-bit weights need the AVX2 kernels");
#endif
}
