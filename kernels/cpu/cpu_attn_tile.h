/* cpu_attn_tile.h: the per-(row, head) steps of the key-tiled CPU attention (AVX2 and FMA
 * kernel sets, cpu_kernels.h), shared by attention() (cpu_attention.c) and attention_spans()
 * (cpu_attn_span.c) so that one full span gives attention()'s bits exactly.
 *
 * A pair (one query row, one head) walks key tiles [p0, p0 + KVS_CPU_ATTN_KT) with p0 an
 * absolute multiple of KT. Per tile: the scores of the keys it may read (kvs_cpu_dot's lanes
 * and tree, with FMA in the FMA set: eight keys per vector where they share a rotation, one at
 * a time otherwise, the same bits either way), then one online-softmax step: the tile max, one
 * rescale of the accumulator (libm expf) when the max grows, a vector exp of the tile's
 * scores, the weights summed in key order, and the weighted values added in key order. A key
 * the pair may not read (beyond its context, block padding, outside its spans) scores -inf and
 * is skipped. Nothing depends on the other pairs of a tile or on the tile shapes: batch
 * invariant. Within rounding of the reference (the vector exp, ~1 ulp, and the per-tile
 * rescale); tests/unit/test_cpu_kernels.c bounds the difference.
 *
 * Ownership: plain pointers into the caller's buffers; nothing allocates. Errors: none (bad
 * arguments are bugs, as kernels/backend.h). Included only by kernels/cpu/ files (x86 only). */
#ifndef KVS_CPU_ATTN_TILE_H
#define KVS_CPU_ATTN_TILE_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "kernels/cpu/cpu_internal.h"
#include "kernels/cpu/cpu_kernels.h"

#define ATT_AVX2 __attribute__((target("avx2,fma")))
#define ATT_INLINE __attribute__((always_inline)) static inline
#define KT KVS_CPU_ATTN_KT

/* one key tile of one sequence and kv head */
struct kt_keys {
    const float *k[KT], *v[KT];   /* NULL: padding of a partly valid block (never read) */
    int rot[KT];                  /* deferred-RoPE offset of each key's block */
    int nk;                       /* keys in the tile (the last tile may be short) */
};

/* one (row, head) pair's online softmax */
struct kt_pair {
    const float *q0;              /* the query as stored */
    const float *q;               /* q0, or qr: q0 rotated back by cur_rot */
    float *qr;                    /* head_dim floats of scratch */
    int cur_rot;
    float mx, l;
    float *acc;                   /* head_dim floats */
};

/* the keys of tile [p0, p0 + nk) of one sequence (bt, rot, valid: its rows of the tables) */
static inline void kt_fill(struct kt_keys *t, const float *kc, const float *vc, const int32_t *bt, const int32_t *rot,
                           const int32_t *valid, int n_kv_heads, int g, int bs, int hd, int p0, int nk)
{
    t->nk = nk;
    for (int i = 0; i < nk; i++) {
        const int p = p0 + i, bi = p / bs, off = p % bs;
        t->rot[i] = rot ? rot[bi] : 0;
        if (valid && off >= valid[bi]) {
            t->k[i] = t->v[i] = NULL;
            continue;
        }
        const size_t base = (((size_t)bt[bi] * n_kv_heads + g) * bs + off) * (size_t)hd;
        t->k[i] = kc + base;
        t->v[i] = vc + base;
    }
}

static inline void kt_pair_init(struct kt_pair *p, const float *q0, float *qr, float *acc, int hd)
{
    p->q0 = p->q = q0;
    p->qr = qr;
    p->cur_rot = 0;
    p->mx = -INFINITY;
    p->l = 0.0f;
    for (int e = 0; e < hd; e++) acc[e] = 0.0f;
    p->acc = acc;
}

#define KT_MADD(acc, a, b) ((fm) ? _mm256_fmadd_ps(a, b, acc) : _mm256_add_ps(acc, _mm256_mul_ps(a, b)))

/* kvs_cpu_dot (fm = 0) or kvs_cpu_dot_fma (fm = 1) of one key */
ATT_AVX2 ATT_INLINE float kt_dot1(const float *a, const float *b, int n, const int fm)
{
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) acc = KT_MADD(acc, _mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i));
    float l[8];
    _mm256_storeu_ps(l, acc);
    float s = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* the same for eight keys at once (n a multiple of 8): the two hadds and the add of the halves
 * are the reference tree ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)) of each key, in key order */
ATT_AVX2 ATT_INLINE __m256 kt_dot8(const float *q, const float *const k[8], int n, const int fm)
{
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int i = 0; i < n; i += 8) {
        const __m256 v = _mm256_loadu_ps(q + i);
        a0 = KT_MADD(a0, v, _mm256_loadu_ps(k[0] + i));
        a1 = KT_MADD(a1, v, _mm256_loadu_ps(k[1] + i));
        a2 = KT_MADD(a2, v, _mm256_loadu_ps(k[2] + i));
        a3 = KT_MADD(a3, v, _mm256_loadu_ps(k[3] + i));
        a4 = KT_MADD(a4, v, _mm256_loadu_ps(k[4] + i));
        a5 = KT_MADD(a5, v, _mm256_loadu_ps(k[5] + i));
        a6 = KT_MADD(a6, v, _mm256_loadu_ps(k[6] + i));
        a7 = KT_MADD(a7, v, _mm256_loadu_ps(k[7] + i));
    }
    const __m256 g1 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    const __m256 g2 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(g1, g2, 0x20), _mm256_permute2f128_ps(g1, g2, 0x31));
}

/* exp(x) for x <= 0 (Cephes' expf: range reduction by ln 2 in two parts, degree-5 polynomial,
 * about 1 ulp; separate multiplies and adds in both kernel sets), exactly 0 below -87 and for
 * -inf, so a key scored -inf weighs nothing */
ATT_AVX2 ATT_INLINE __m256 kt_exp(__m256 x)
{
    const __m256 lo = _mm256_set1_ps(-87.0f), one = _mm256_set1_ps(1.0f);
    const __m256 zero_mask = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    const __m256 fx =
        _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _mm256_set1_ps(0.5f)));
    x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(0.693359375f)));
    x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(-2.12194440e-4f)));
    const __m256 z = _mm256_mul_ps(x, x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(y, z), x), one);
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(zero_mask, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

/* The scores of pair p for the keys i < kend of tile t with sel[i] set (sel NULL: all), times
 * scale, into sc[0 .. KT); the rest -inf. inv_freq: for deferred-RoPE rotations. */
ATT_AVX2 ATT_INLINE void kt_scores(struct kt_pair *p, const struct kt_keys *t, int kend, const unsigned char *sel,
                                   const float *inv_freq, int hd, float scale, float *sc, const int fm)
{
    int i = 0;
    while (i < kend) {
        if (!t->k[i] || (sel && !sel[i])) {
            sc[i++] = -INFINITY;
            continue;
        }
        if (t->rot[i] != p->cur_rot) {
            p->cur_rot = t->rot[i];
            if (p->cur_rot) kvs_cpu_rotate_back(p->q0, inv_freq, p->cur_rot, hd, p->qr);
            p->q = p->cur_rot ? p->qr : p->q0;
        }
        int run = 0;   /* readable keys from i on with this rotation, up to 8 */
        if (hd % 8 == 0)
            while (run < 8 && i + run < kend && t->k[i + run] && (!sel || sel[i + run]) && t->rot[i + run] == p->cur_rot)
                run++;
        if (run == 8) {
            _mm256_storeu_ps(sc + i, _mm256_mul_ps(kt_dot8(p->q, t->k + i, hd, fm), _mm256_set1_ps(scale)));
            i += 8;
        } else {
            sc[i] = kt_dot1(p->q, t->k[i], hd, fm) * scale;
            i++;
        }
    }
    for (; i < KT; i++) sc[i] = -INFINITY;
}

/* One online-softmax step of pair p over the scores sc[0 .. KT) of tile t (-inf: skipped). */
ATT_AVX2 ATT_INLINE void kt_update(struct kt_pair *p, const struct kt_keys *t, const float *sc, int hd, const int fm)
{
    const __m256 s0 = _mm256_loadu_ps(sc), s1 = _mm256_loadu_ps(sc + 8);
    __m256 m8 = _mm256_max_ps(s0, s1);
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float tmax = _mm_cvtss_f32(m4);
    if (tmax == -INFINITY) return;   /* no readable key in this tile */
    const int hd8 = hd / 8 * 8;
    float *ac = p->acc;
    if (tmax > p->mx) {
        const float corr = p->mx == -INFINITY ? 0.0f : expf(p->mx - tmax);
        p->l *= corr;
        const __m256 c8 = _mm256_set1_ps(corr);
        int e = 0;
        for (; e < hd8; e += 8) _mm256_storeu_ps(ac + e, _mm256_mul_ps(_mm256_loadu_ps(ac + e), c8));
        for (; e < hd; e++) ac[e] *= corr;
        p->mx = tmax;
    }
    const __m256 mb = _mm256_set1_ps(p->mx);
    float pw[KT];
    _mm256_storeu_ps(pw, kt_exp(_mm256_sub_ps(s0, mb)));
    _mm256_storeu_ps(pw + 8, kt_exp(_mm256_sub_ps(s1, mb)));
    float lsum = 0.0f;
    for (int i = 0; i < KT; i++) lsum += pw[i];
    p->l += lsum;
    const int nk = t->nk;
    int e = 0;
    for (; e + 32 <= hd8; e += 32) {   /* four accumulator vectors in registers across the keys */
        __m256 o0 = _mm256_loadu_ps(ac + e), o1 = _mm256_loadu_ps(ac + e + 8);
        __m256 o2 = _mm256_loadu_ps(ac + e + 16), o3 = _mm256_loadu_ps(ac + e + 24);
        for (int i = 0; i < nk; i++) {
            if (sc[i] == -INFINITY) continue;
            const __m256 w = _mm256_set1_ps(pw[i]);
            const float *v = t->v[i] + e;
            o0 = KT_MADD(o0, w, _mm256_loadu_ps(v));
            o1 = KT_MADD(o1, w, _mm256_loadu_ps(v + 8));
            o2 = KT_MADD(o2, w, _mm256_loadu_ps(v + 16));
            o3 = KT_MADD(o3, w, _mm256_loadu_ps(v + 24));
        }
        _mm256_storeu_ps(ac + e, o0);
        _mm256_storeu_ps(ac + e + 8, o1);
        _mm256_storeu_ps(ac + e + 16, o2);
        _mm256_storeu_ps(ac + e + 24, o3);
    }
    for (; e < hd8; e += 8) {
        __m256 o0 = _mm256_loadu_ps(ac + e);
        for (int i = 0; i < nk; i++)
            if (sc[i] != -INFINITY) o0 = KT_MADD(o0, _mm256_set1_ps(pw[i]), _mm256_loadu_ps(t->v[i] + e));
        _mm256_storeu_ps(ac + e, o0);
    }
    for (; e < hd; e++)
        for (int i = 0; i < nk; i++)
            if (sc[i] != -INFINITY) ac[e] = fm ? fmaf(pw[i], t->v[i][e], ac[e]) : ac[e] + pw[i] * t->v[i][e];
}

#endif
