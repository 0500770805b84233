/* cpu_act.c: the SwiGLU activation y = silu(g) * u with a vector exp, and RMSNorm's row with
 * its sum of squares in four double lanes (AVX2 + FMA sets; the reference set keeps libm expf
 * and the serial double sum in cpu_backend.c). Why: with libm's scalar expf the activation
 * took ~6% of a demo-model prefill (perf, bench/RESULTS.md), as much as a quarter of the
 * attention's softmax; the serial double sum (one dependent add per element) was ~4% of a
 * concurrency-16 serving run. SwiGLU within ~2 ulp of the libm form per element (test_cpu_ops
 * bounds it); RMSNorm within 1 ulp of the serial form (test_cpu_kernels); both per row, so
 * batch invariant.
 * Ownership: the caller's arrays. Errors: none. */
#include <math.h>

#include "kernels/cpu/cpu_kernels.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

/* exp(x), x clamped to [-87, 88] (Cephes' expf: range reduction by ln 2 in two parts, degree-5
 * polynomial; about 1 ulp). Clamping keeps the exponent bits in range; the caller handles
 * x > 88. */
__attribute__((target("avx2,fma"))) static inline __m256 exp_clamped(__m256 x)
{
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    const __m256 z = _mm256_mul_ps(x, x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_fmadd_ps(y, z, x), _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

__attribute__((target("avx2,fma"))) void kvs_cpu_swiglu_row(const float *g, const float *u, int n, float *y)
{
    int i = 0;
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    for (; i + 8 <= n; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 d = _mm256_add_ps(one, exp_clamped(_mm256_xor_ps(gv, sign)));
        /* below -88 exp(-g) would overflow: the libm form gives g / inf = 0 there, and the
         * clamp would not (a huge g over exp(88)) */
        const __m256 under = _mm256_cmp_ps(gv, _mm256_set1_ps(-88.0f), _CMP_LT_OQ);
        _mm256_storeu_ps(y + i, _mm256_andnot_ps(under, _mm256_mul_ps(_mm256_div_ps(gv, d), _mm256_loadu_ps(u + i))));
    }
    for (; i < n; i++) y[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

/* Squares are exact in double (24-bit mantissas), so only the order of the sum differs from
 * the serial loop: 16 lanes (four vectors of four doubles), combined as (a0 + a1) + (a2 + a3)
 * lane-wise, then ((l0 + l1) + (l2 + l3)), then the tail in order. */
__attribute__((target("avx2,fma"))) void kvs_cpu_rmsnorm_row(const float *x, const float *w, float eps, int dim,
                                                             float *out)
{
    __m256d a0 = _mm256_setzero_pd(), a1 = a0, a2 = a0, a3 = a0;
    int i = 0;
    for (; i + 16 <= dim; i += 16) {
        const __m256d x0 = _mm256_cvtps_pd(_mm_loadu_ps(x + i)), x1 = _mm256_cvtps_pd(_mm_loadu_ps(x + i + 4));
        const __m256d x2 = _mm256_cvtps_pd(_mm_loadu_ps(x + i + 8)), x3 = _mm256_cvtps_pd(_mm_loadu_ps(x + i + 12));
        a0 = _mm256_fmadd_pd(x0, x0, a0), a1 = _mm256_fmadd_pd(x1, x1, a1);
        a2 = _mm256_fmadd_pd(x2, x2, a2), a3 = _mm256_fmadd_pd(x3, x3, a3);
    }
    double l[4];
    _mm256_storeu_pd(l, _mm256_add_pd(_mm256_add_pd(a0, a1), _mm256_add_pd(a2, a3)));
    double ss = (l[0] + l[1]) + (l[2] + l[3]);
    for (; i < dim; i++) ss += (double)x[i] * (double)x[i];
    const float inv = (float)(1.0 / sqrt(ss / dim + (double)eps));
    const __m256 iv = _mm256_set1_ps(inv);
    i = 0;
    for (; i + 8 <= dim; i += 8)   /* w * (x * inv): the reference's two roundings */
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(x + i), iv)));
    for (; i < dim; i++) out[i] = w[i] * (x[i] * inv);
}
#else
void kvs_cpu_rmsnorm_row(const float *x, const float *w, float eps, int dim, float *out)
{
    double ss = 0.0;
    for (int i = 0; i < dim; i++) ss += (double)x[i] * (double)x[i];
    float inv = (float)(1.0 / sqrt(ss / dim + (double)eps));
    for (int i = 0; i < dim; i++) out[i] = w[i] * (x[i] * inv);
}

void kvs_cpu_swiglu_row(const float *g, const float *u, int n, float *y)
{
    for (int i = 0; i < n; i++) y[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}
#endif
