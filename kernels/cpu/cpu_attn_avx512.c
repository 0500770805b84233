/* cpu_attn_avx512.c: the AVX-512 halves of the key-tiled attention's online-softmax step (the
 * avx512 kernel set, cpu_kernels.h): the value accumulation (kt_pv, kt_pv2) and the softmax
 * (kt_softmax) of cpu_attn_tile.h with 512-bit vectors, and the three-query score tile
 * (kt_scores3) with two keys per vector. They compute exactly the FMA set's
 * operations per element (one fused multiply-add per element and key in key order, the same
 * vector exp with separate multiplies and adds, the same libm rescale and key-order weight sum),
 * so every result is BITWISE the FMA set's: the avx512 attention inherits its batch invariance
 * and its tolerance against the reference, and attention_spans() (which runs the FMA steps for
 * both sets) still gives attention()'s bits. Only the width changes: 16 floats per instruction
 * and masked tails instead of 8 and scalar ones.
 *
 * Compiled with target attributes, so this file builds for any x86-64; the functions must only
 * be called where __builtin_cpu_supports("avx512f") (kvs_cpu_isa_best() == KVS_CPU_ISA_AVX512).
 * Ownership: plain pointers into the caller's buffers; nothing allocates. Errors: none. */
#include <math.h>

#include "kernels/cpu/cpu_kernels.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include "kernels/cpu/cpu_attn_tile.h"

#define AVX512 __attribute__((target("avx512f,avx2,fma")))

/* mask of the first n (< 16) lanes */
static inline __mmask16 lanes(int n) { return (__mmask16)((1u << n) - 1u); }

/* kt_exp with 16 lanes: the same constants and operations in the same order (floor by
 * roundscale toward -inf is floor exactly), so the same bits lane for lane */
AVX512 static inline __m512 exp16(__m512 x)
{
    const __m512 lo = _mm512_set1_ps(-87.0f), one = _mm512_set1_ps(1.0f);
    const __mmask16 zero = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_max_ps(x, lo);
    const __m512 fx = _mm512_roundscale_ps(
        _mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _mm512_set1_ps(0.5f)),
        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    x = _mm512_sub_ps(x, _mm512_mul_ps(fx, _mm512_set1_ps(0.693359375f)));
    x = _mm512_sub_ps(x, _mm512_mul_ps(fx, _mm512_set1_ps(-2.12194440e-4f)));
    const __m512 z = _mm512_mul_ps(x, x);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_add_ps(_mm512_mul_ps(y, x), _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_add_ps(_mm512_mul_ps(y, x), _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_add_ps(_mm512_mul_ps(y, x), _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_add_ps(_mm512_mul_ps(y, x), _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_add_ps(_mm512_mul_ps(y, x), _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(y, z), x), one);
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mov_ps((__mmask16)~zero, _mm512_mul_ps(y, _mm512_castsi512_ps(e)));
}

/* keys a and b's 8 values from i as one vector (a low, b high) */
AVX512 static inline __m512 key_pair(const float *a, const float *b, int i)
{
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(_mm256_loadu_ps(a + i))),
                                               _mm256_castps_pd(_mm256_loadu_ps(b + i)), 1));
}

/* a query's 8 values from i in both halves */
AVX512 static inline __m512 query_both(const float *q, int i)
{
    return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(q + i))));
}

AVX512 static inline __m256 hi_half(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }

/* kt_scores3 (fm = 1) with two keys per 512-bit accumulator: each half is the 256-bit
 * accumulator of one (query, key) of kt_scores3, lane for lane the same fused multiply-adds, and
 * the halves go through the same kt_reduce4 tree, so the same bits with half the multiply-adds */
AVX512 void kvs_cpu_kt512_scores3(const float *q0, const float *q1, const float *q2, const float *const *k, int hd,
                                  float scale, float *sc0, float *sc1, float *sc2)
{
    const __m128 s4 = _mm_set1_ps(scale);
    for (int j = 0; j < KT; j += 4) {
        const float *k0 = k[j], *k1 = k[j + 1], *k2 = k[j + 2], *k3 = k[j + 3];
        __m512 a01 = _mm512_setzero_ps(), a23 = a01, b01 = a01, b23 = a01, c01 = a01, c23 = a01;
        for (int i = 0; i < hd; i += 8) {
            const __m512 x0 = query_both(q0, i), x1 = query_both(q1, i), x2 = query_both(q2, i);
            const __m512 k01 = key_pair(k0, k1, i), k23 = key_pair(k2, k3, i);
            a01 = _mm512_fmadd_ps(x0, k01, a01), a23 = _mm512_fmadd_ps(x0, k23, a23);
            b01 = _mm512_fmadd_ps(x1, k01, b01), b23 = _mm512_fmadd_ps(x1, k23, b23);
            c01 = _mm512_fmadd_ps(x2, k01, c01), c23 = _mm512_fmadd_ps(x2, k23, c23);
        }
        _mm_storeu_ps(sc0 + j, _mm_mul_ps(kt_reduce4(_mm512_castps512_ps256(a01), hi_half(a01),
                                                     _mm512_castps512_ps256(a23), hi_half(a23)), s4));
        _mm_storeu_ps(sc1 + j, _mm_mul_ps(kt_reduce4(_mm512_castps512_ps256(b01), hi_half(b01),
                                                     _mm512_castps512_ps256(b23), hi_half(b23)), s4));
        _mm_storeu_ps(sc2 + j, _mm_mul_ps(kt_reduce4(_mm512_castps512_ps256(c01), hi_half(c01),
                                                     _mm512_castps512_ps256(c23), hi_half(c23)), s4));
    }
}

AVX512 int kvs_cpu_kt512_softmax(struct kt_pair *p, const float *sc, float *pw, int hd)
{
    _Static_assert(KT == 16, "one key tile is one 512-bit vector");
    const __m512 s = _mm512_loadu_ps(sc);
    const float tmax = _mm512_reduce_max_ps(s);   /* max is exact: any order gives kt_softmax's */
    if (tmax == -INFINITY) return 0;
    float *ac = p->acc;
    if (tmax > p->mx) {
        const float corr = p->mx == -INFINITY ? 0.0f : expf(p->mx - tmax);
        p->l *= corr;
        const __m512 c = _mm512_set1_ps(corr);
        int e = 0;
        for (; e + 16 <= hd; e += 16) _mm512_storeu_ps(ac + e, _mm512_mul_ps(_mm512_loadu_ps(ac + e), c));
        if (e < hd) {
            const __mmask16 m = lanes(hd - e);
            _mm512_mask_storeu_ps(ac + e, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, ac + e), c));
        }
        p->mx = tmax;
    }
    _mm512_storeu_ps(pw, exp16(_mm512_sub_ps(s, _mm512_set1_ps(p->mx))));
    float lsum = 0.0f;
    for (int i = 0; i < KT; i++) lsum += pw[i];   /* key order, as kt_softmax */
    p->l += lsum;
    return 1;
}

AVX512 void kvs_cpu_kt512_pv(struct kt_pair *p, const struct kt_keys *t, const float *sc, const float *pw, int hd)
{
    float *ac = p->acc;
    const int nk = t->nk;
    int e = 0;
    for (; e + 64 <= hd; e += 64) {   /* four accumulators in registers across the keys */
        __m512 o0 = _mm512_loadu_ps(ac + e), o1 = _mm512_loadu_ps(ac + e + 16);
        __m512 o2 = _mm512_loadu_ps(ac + e + 32), o3 = _mm512_loadu_ps(ac + e + 48);
        for (int i = 0; i < nk; i++) {
            if (sc[i] == -INFINITY) continue;
            const __m512 w = _mm512_set1_ps(pw[i]);
            const float *v = t->v[i] + e;
            o0 = _mm512_fmadd_ps(w, _mm512_loadu_ps(v), o0);
            o1 = _mm512_fmadd_ps(w, _mm512_loadu_ps(v + 16), o1);
            o2 = _mm512_fmadd_ps(w, _mm512_loadu_ps(v + 32), o2);
            o3 = _mm512_fmadd_ps(w, _mm512_loadu_ps(v + 48), o3);
        }
        _mm512_storeu_ps(ac + e, o0);
        _mm512_storeu_ps(ac + e + 16, o1);
        _mm512_storeu_ps(ac + e + 32, o2);
        _mm512_storeu_ps(ac + e + 48, o3);
    }
    for (; e < hd; e += 16) {   /* 16 at a time, the last one masked: masked lanes are never stored */
        const __mmask16 m = hd - e >= 16 ? (__mmask16)0xFFFF : lanes(hd - e);
        __m512 o = _mm512_maskz_loadu_ps(m, ac + e);
        for (int i = 0; i < nk; i++)
            if (sc[i] != -INFINITY) o = _mm512_fmadd_ps(_mm512_set1_ps(pw[i]), _mm512_maskz_loadu_ps(m, t->v[i] + e), o);
        _mm512_mask_storeu_ps(ac + e, m, o);
    }
}

AVX512 void kvs_cpu_kt512_pv2(float *acA, float *acB, const struct kt_keys *t, const float *pwA, const float *pwB,
                              int hd, int ws)
{
    int e = 0;
    for (; e + 32 <= hd; e += 32) {
        __m512 a0 = _mm512_loadu_ps(acA + e), a1 = _mm512_loadu_ps(acA + e + 16);
        __m512 b0 = _mm512_loadu_ps(acB + e), b1 = _mm512_loadu_ps(acB + e + 16);
        for (int i = 0; i < KT; i++) {
            const float *v = t->v[i] + e;
            const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
            const __m512 wa = _mm512_set1_ps(pwA[i * ws]), wb = _mm512_set1_ps(pwB[i * ws]);
            a0 = _mm512_fmadd_ps(wa, v0, a0), a1 = _mm512_fmadd_ps(wa, v1, a1);
            b0 = _mm512_fmadd_ps(wb, v0, b0), b1 = _mm512_fmadd_ps(wb, v1, b1);
        }
        _mm512_storeu_ps(acA + e, a0), _mm512_storeu_ps(acA + e + 16, a1);
        _mm512_storeu_ps(acB + e, b0), _mm512_storeu_ps(acB + e + 16, b1);
    }
    for (; e < hd; e += 16) {
        const __mmask16 m = hd - e >= 16 ? (__mmask16)0xFFFF : lanes(hd - e);
        __m512 a = _mm512_maskz_loadu_ps(m, acA + e), b = _mm512_maskz_loadu_ps(m, acB + e);
        for (int i = 0; i < KT; i++) {
            const __m512 v = _mm512_maskz_loadu_ps(m, t->v[i] + e);
            a = _mm512_fmadd_ps(_mm512_set1_ps(pwA[i * ws]), v, a);
            b = _mm512_fmadd_ps(_mm512_set1_ps(pwB[i * ws]), v, b);
        }
        _mm512_mask_storeu_ps(acA + e, m, a), _mm512_mask_storeu_ps(acB + e, m, b);
    }
}
#endif
