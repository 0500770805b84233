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
    int bi = p0 / bs, off = p0 % bs;   /* one division per tile, not per key */
    for (int i = 0; i < nk; i++, off++) {
        if (off == bs) bi++, off = 0;
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

/* The softmax half of one online-softmax step of pair p over the scores sc[0 .. KT) of a tile
 * (-inf: skipped): the tile max, the rescale of the accumulator when the max grows, the
 * weights pw = exp(sc - max) (0 for -inf) and their sum. Returns 0 when no key of the tile is
 * readable (nothing to add), else 1. */
ATT_AVX2 ATT_INLINE int kt_softmax(struct kt_pair *p, const float *sc, float *pw, int hd)
{
    const __m256 s0 = _mm256_loadu_ps(sc), s1 = _mm256_loadu_ps(sc + 8);
    __m256 m8 = _mm256_max_ps(s0, s1);
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float tmax = _mm_cvtss_f32(m4);
    if (tmax == -INFINITY) return 0;   /* no readable key in this tile */
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
    _mm256_storeu_ps(pw, kt_exp(_mm256_sub_ps(s0, mb)));
    _mm256_storeu_ps(pw + 8, kt_exp(_mm256_sub_ps(s1, mb)));
    float lsum = 0.0f;
    for (int i = 0; i < KT; i++) lsum += pw[i];
    p->l += lsum;
    return 1;
}

/* The value half: acc += pw[i] * v[i] for the keys i < nk of tile t with sc[i] > -inf, in key
 * order, one multiply-add per element and key. */
ATT_AVX2 ATT_INLINE void kt_pv(struct kt_pair *p, const struct kt_keys *t, const float *sc, const float *pw, int hd,
                               const int fm)
{
    const int hd8 = hd / 8 * 8;
    float *ac = p->acc;
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

/* One online-softmax step of pair p over the scores sc[0 .. KT) of tile t (-inf: skipped). */
ATT_AVX2 ATT_INLINE void kt_update(struct kt_pair *p, const struct kt_keys *t, const float *sc, int hd, const int fm)
{
    float pw[KT];
    if (kt_softmax(p, sc, pw, hd)) kt_pv(p, t, sc, pw, hd, fm);
}

/* The avx512 set's versions of kt_softmax, kt_pv, kt_pv2 and kt_scores3 (fm = 1): the same
 * operations per element at 16 lanes, so bitwise those (cpu_attn_avx512.c). Real calls, not
 * inlined (another target): call them only where the CPU has AVX-512F. */
int kvs_cpu_kt512_softmax(struct kt_pair *p, const float *sc, float *pw, int hd);
void kvs_cpu_kt512_pv(struct kt_pair *p, const struct kt_keys *t, const float *sc, const float *pw, int hd);
void kvs_cpu_kt512_scores3(const float *q0, const float *q1, const float *q2, const float *const *k, int hd,
                           float scale, float *sc0, float *sc1, float *sc2);
void kvs_cpu_kt512_pv2(float *acA, float *acB, const struct kt_keys *t, const float *pwA, const float *pwB, int hd,
                       int ws);

/* ---- register tiles over several pairs (full key tiles of the prefill) --------------------
 * Both give every pair exactly the bits of the one-pair steps above (the same lanes, tree and
 * multiply-add per element), only with fewer loads: which pairs share a register tile never
 * changes a result, so tiling stays batch invariant. */

/* the reference tree of four lane accumulators (as kt_dot8's hadds: key order) */
ATT_AVX2 ATT_INLINE __m128 kt_reduce4(__m256 a, __m256 b, __m256 c, __m256 d)
{
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* Scores of three queries against the KT keys k[] (hd a multiple of 8), times scale, into
 * sc0/sc1/sc2 [KT]: tiles of 3 queries x 4 keys (12 accumulators, 7 loads per 12 multiply-adds
 * where kt_dot8 spends 9 per 8). Each score is bitwise kt_dot8's (times scale). */
ATT_AVX2 ATT_INLINE void kt_scores3(const float *q0, const float *q1, const float *q2, const float *const *k, int hd,
                                    float scale, float *sc0, float *sc1, float *sc2, const int fm)
{
    const __m128 s4 = _mm_set1_ps(scale);
    for (int j = 0; j < KT; j += 4) {
        const float *k0 = k[j], *k1 = k[j + 1], *k2 = k[j + 2], *k3 = k[j + 3];
        __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00;
        __m256 a10 = a00, a11 = a00, a12 = a00, a13 = a00, a20 = a00, a21 = a00, a22 = a00, a23 = a00;
        for (int i = 0; i < hd; i += 8) {
            const __m256 x0 = _mm256_loadu_ps(q0 + i), x1 = _mm256_loadu_ps(q1 + i), x2 = _mm256_loadu_ps(q2 + i);
            __m256 kv = _mm256_loadu_ps(k0 + i);
            a00 = KT_MADD(a00, x0, kv), a10 = KT_MADD(a10, x1, kv), a20 = KT_MADD(a20, x2, kv);
            kv = _mm256_loadu_ps(k1 + i);
            a01 = KT_MADD(a01, x0, kv), a11 = KT_MADD(a11, x1, kv), a21 = KT_MADD(a21, x2, kv);
            kv = _mm256_loadu_ps(k2 + i);
            a02 = KT_MADD(a02, x0, kv), a12 = KT_MADD(a12, x1, kv), a22 = KT_MADD(a22, x2, kv);
            kv = _mm256_loadu_ps(k3 + i);
            a03 = KT_MADD(a03, x0, kv), a13 = KT_MADD(a13, x1, kv), a23 = KT_MADD(a23, x2, kv);
        }
        _mm_storeu_ps(sc0 + j, _mm_mul_ps(kt_reduce4(a00, a01, a02, a03), s4));
        _mm_storeu_ps(sc1 + j, _mm_mul_ps(kt_reduce4(a10, a11, a12, a13), s4));
        _mm_storeu_ps(sc2 + j, _mm_mul_ps(kt_reduce4(a20, a21, a22, a23), s4));
    }
}

/* 8 x 8 transpose: r[i] lane j <- r[j] lane i */
ATT_AVX2 ATT_INLINE void kt_transpose8(__m256 r[8])
{
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

/* kt_softmax of eight pairs p[0..7] at once, one pair per lane (their scores sc[q * KT + k]
 * come in per pair and are transposed to key-major), every score finite: the same operations
 * per pair as kt_softmax (max, libm expf rescale when the max grows, kt_exp per score, the
 * weights summed in key order from 0), so the same bits. Writes the weights key-major:
 * pwT[k * 8 + q]. Returns 0 (nothing changed) when some score is -inf: the caller takes the
 * one-pair steps then. */
ATT_AVX2 ATT_INLINE int kt_softmax8(struct kt_pair *const p[8], const float *sc, float *pwT, int hd)
{
    __m256 lo[8], hi[8];
    for (int q = 0; q < 8; q++) {
        lo[q] = _mm256_loadu_ps(sc + (size_t)q * KT);
        hi[q] = _mm256_loadu_ps(sc + (size_t)q * KT + 8);
    }
    kt_transpose8(lo);   /* lo[k]: key k of the eight pairs */
    kt_transpose8(hi);   /* hi[k]: key 8 + k */
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    __m256 m = _mm256_max_ps(lo[0], hi[0]), bad = _mm256_or_ps(_mm256_cmp_ps(lo[0], ninf, _CMP_EQ_OQ),
                                                                 _mm256_cmp_ps(hi[0], ninf, _CMP_EQ_OQ));
    for (int k = 1; k < 8; k++) {
        m = _mm256_max_ps(m, _mm256_max_ps(lo[k], hi[k]));
        bad = _mm256_or_ps(bad, _mm256_or_ps(_mm256_cmp_ps(lo[k], ninf, _CMP_EQ_OQ), _mm256_cmp_ps(hi[k], ninf, _CMP_EQ_OQ)));
    }
    if (_mm256_movemask_ps(bad)) return 0;
    float tmax[8];
    _mm256_storeu_ps(tmax, m);
    const int hd8 = hd / 8 * 8;
    float mxs[8], ls[8];
    for (int q = 0; q < 8; q++) {
        struct kt_pair *pq = p[q];
        if (tmax[q] > pq->mx) {
            const float corr = pq->mx == -INFINITY ? 0.0f : expf(pq->mx - tmax[q]);
            pq->l *= corr;
            const __m256 c8 = _mm256_set1_ps(corr);
            float *ac = pq->acc;
            int e = 0;
            for (; e < hd8; e += 8) _mm256_storeu_ps(ac + e, _mm256_mul_ps(_mm256_loadu_ps(ac + e), c8));
            for (; e < hd; e++) ac[e] *= corr;
            pq->mx = tmax[q];
        }
        mxs[q] = pq->mx;
        ls[q] = pq->l;
    }
    const __m256 mb = _mm256_loadu_ps(mxs);
    __m256 lsum = _mm256_setzero_ps();
    for (int k = 0; k < 8; k++) {
        const __m256 w = kt_exp(_mm256_sub_ps(lo[k], mb));
        _mm256_storeu_ps(pwT + (size_t)k * 8, w);
        lsum = _mm256_add_ps(lsum, w);
    }
    for (int k = 0; k < 8; k++) {
        const __m256 w = kt_exp(_mm256_sub_ps(hi[k], mb));
        _mm256_storeu_ps(pwT + (size_t)(8 + k) * 8, w);
        lsum = _mm256_add_ps(lsum, w);
    }
    _mm256_storeu_ps(ls, _mm256_add_ps(_mm256_loadu_ps(ls), lsum));
    for (int q = 0; q < 8; q++) p[q]->l = ls[q];
    return 1;
}

/* kt_pv of two pairs over all KT keys of a tile (every score finite, hd a multiple of 32):
 * 2 pairs x 32 elements in 8 accumulators, 6 loads per 8 multiply-adds where kt_pv spends 5
 * per 4. The weights of key i: pwA[i * ws], pwB[i * ws]. */
ATT_AVX2 ATT_INLINE void kt_pv2(float *acA, float *acB, const struct kt_keys *t, const float *pwA, const float *pwB,
                                int hd, const int fm, const int ws)
{
    for (int e = 0; e < hd; e += 32) {
        __m256 a0 = _mm256_loadu_ps(acA + e), a1 = _mm256_loadu_ps(acA + e + 8);
        __m256 a2 = _mm256_loadu_ps(acA + e + 16), a3 = _mm256_loadu_ps(acA + e + 24);
        __m256 b0 = _mm256_loadu_ps(acB + e), b1 = _mm256_loadu_ps(acB + e + 8);
        __m256 b2 = _mm256_loadu_ps(acB + e + 16), b3 = _mm256_loadu_ps(acB + e + 24);
        for (int i = 0; i < KT; i++) {
            const float *v = t->v[i] + e;
            const __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8);
            const __m256 v2 = _mm256_loadu_ps(v + 16), v3 = _mm256_loadu_ps(v + 24);
            const __m256 wa = _mm256_set1_ps(pwA[i * ws]), wb = _mm256_set1_ps(pwB[i * ws]);
            a0 = KT_MADD(a0, wa, v0), a1 = KT_MADD(a1, wa, v1), a2 = KT_MADD(a2, wa, v2), a3 = KT_MADD(a3, wa, v3);
            b0 = KT_MADD(b0, wb, v0), b1 = KT_MADD(b1, wb, v1), b2 = KT_MADD(b2, wb, v2), b3 = KT_MADD(b3, wb, v3);
        }
        _mm256_storeu_ps(acA + e, a0), _mm256_storeu_ps(acA + e + 8, a1);
        _mm256_storeu_ps(acA + e + 16, a2), _mm256_storeu_ps(acA + e + 24, a3);
        _mm256_storeu_ps(acB + e, b0), _mm256_storeu_ps(acB + e + 8, b1);
        _mm256_storeu_ps(acB + e + 16, b2), _mm256_storeu_ps(acB + e + 24, b3);
    }
}

#endif
