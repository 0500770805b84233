/* cpu_act.c: the SwiGLU activation y = silu(g) * u with a vector exp (AVX2 + FMA sets; the
 * reference set keeps libm expf in cpu_backend.c). Why: with libm's scalar expf the activation
 * took ~6% of a demo-model prefill (perf, bench/RESULTS.md), as much as a quarter of the
 * attention's softmax. Within ~2 ulp of the libm form per element (test_cpu_ops bounds it);
 * elementwise, so batch invariant.
 * Ownership: the caller's arrays. Errors: none. */
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
#else
void kvs_cpu_swiglu_row(const float *g, const float *u, int n, float *y)
{
    for (int i = 0; i < n; i++) y[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}
#endif
