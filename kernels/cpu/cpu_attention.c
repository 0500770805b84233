/* cpu_attention.c: paged causal attention on the CPU (cpu_kernels.h), two ways:
 *
 * The reference (the oracle of the tests, and the kernel where AVX2 is missing): one task per
 * (row, head), keys in increasing position, an online softmax updated per key (running max,
 * rescale on a new max, libm expf), kvs_cpu_dot for the scores.
 *
 * The tiled AVX2 kernel: one task per tile of (up to 16 query rows of one sequence) x (query
 * heads of one kv head), so each key and value row is loaded once for every (row, head) pair of
 * the tile, where the reference reloads it per pair (GQA heads and a prefill chunk's rows all
 * reread it). Keys go in key tiles of KT positions: the scores of eight keys per vector, then
 * one online-softmax step per pair and key tile (tile max, one rescale, a vector exp), then the
 * weighted values in key order. The result differs from the reference's by rounding (the
 * vector exp and the per-tile rescale; tests/unit/test_cpu_kernels.c bounds it) but stays
 * batch invariant: key tiles start at absolute multiples of KT, each pair reads only keys below
 * its own context, and nothing a pair computes depends on the other pairs of its tile, so a row
 * gets the same bits alone, in a prefill chunk or in any batch (the test checks exactly that).
 * Tiles are shaped per call (one head per tile when there are too few tiles to keep the
 * threads busy, e.g. a single decode row); that changes which thread computes a pair, never
 * its bits. */
#include <math.h>
#include <string.h>

#include "engine/util.h"
#include "kernels/cpu/cpu_kernels.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define KVS_CPU_X86 1
#else
#define KVS_CPU_X86 0
#endif

/* rotates q backward by off positions (neox half-split): the deferred-RoPE query for keys
 * stored off positions short of their true rotation */
static void rotate_back(const float *q, const float *inv_freq, int off, int head_dim, float *out)
{
    int half = head_dim / 2;
    for (int i = 0; i < half; i++) {
        float a = (float)off * inv_freq[i];
        float c = cosf(a), s = sinf(a);
        out[i] = q[i] * c + q[i + half] * s;
        out[i + half] = -q[i] * s + q[i + half] * c;
    }
}

/* ---- reference ---------------------------------------------------------------------------- */

static void ref_task(void *c, int task)
{
    const struct kvs_cpu_attn_args *j = c;
    int t = task / j->n_heads, h = task % j->n_heads;
    int hd = j->head_dim, bs = j->block_size;
    /* sequence of row t: q_start is increasing, n_seqs small */
    int s = 0;
    while (j->q_start[s + 1] <= t) s++;
    int ctx = j->pos[s] + (t - j->q_start[s]) + 1;
    int g = h / (j->n_heads / j->n_kv_heads);
    const float *q0 = j->q + ((size_t)t * j->n_heads + h) * hd;
    const int32_t *bt = j->bt + (size_t)s * j->max_blocks;
    const int32_t *rot = j->rot ? j->rot + (size_t)s * j->max_blocks : NULL;
    const int32_t *valid = j->valid ? j->valid + (size_t)s * j->max_blocks : NULL;
    float qr[KVS_CPU_MAX_HEAD_DIM], acc[KVS_CPU_MAX_HEAD_DIM];
    const float *q = q0;
    int cur_rot = 0;
    for (int i = 0; i < hd; i++) acc[i] = 0.0f;
    float mx = -INFINITY, l = 0.0f;
    for (int p = 0; p < ctx; p++) {
        int bi = p / bs, off = p % bs;
        if (rot && off == 0 && rot[bi] != cur_rot) {
            cur_rot = rot[bi];
            if (cur_rot) {
                rotate_back(q0, j->inv_freq, cur_rot, hd, qr);
                q = qr;
            } else {
                q = q0;
            }
        }
        if (valid && off >= valid[bi]) {
            p += bs - off - 1;   /* the rest of this block is padding: skip it */
            continue;
        }
        size_t base = (((size_t)bt[bi] * j->n_kv_heads + g) * bs + off) * hd;
        float sc = kvs_cpu_dot(q, j->kc + base, hd) * j->scale;
        const float *v = j->vc + base;
        if (sc > mx) {
            float corr = expf(mx - sc);   /* exp(-inf) = 0 on the first position */
            l *= corr;
            for (int i = 0; i < hd; i++) acc[i] *= corr;
            mx = sc;
        }
        float w = expf(sc - mx);
        l += w;
        for (int i = 0; i < hd; i++) acc[i] += w * v[i];
    }
    float *o = j->out + ((size_t)t * j->n_heads + h) * hd;
    float inv = 1.0f / l;
    for (int i = 0; i < hd; i++) o[i] = acc[i] * inv;
}

/* ---- tiled AVX2 ----------------------------------------------------------------------------- */
#if KVS_CPU_X86
#define AVX2 __attribute__((target("avx2")))
#define TILE_FLOATS 8192          /* accumulators of one tile: (rows x heads) x head_dim floats */

struct tile_plan {
    const struct kvs_cpu_attn_args *a;
    int qt;                       /* query rows per tile */
    int ht;                       /* query heads per tile (divides the GQA group) */
    int n_hchunks;                /* n_heads / ht */
};

#define KT 16                     /* keys per key tile, aligned at multiples of KT from position 0 */

/* exp(x) for x <= 0 (Cephes' expf: range reduction by ln 2 in two parts, degree-5 polynomial,
 * about 1 ulp), exactly 0 below -87 (and for -inf): a masked-out score contributes nothing */
AVX2 static inline __m256 exp_avx2(__m256 x)
{
    const __m256 lo = _mm256_set1_ps(-87.0f), one = _mm256_set1_ps(1.0f);
    __m256 zero_mask = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    __m256 fx = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                              _mm256_set1_ps(0.5f)));
    x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(0.693359375f)));
    x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 z = _mm256_mul_ps(x, x), y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(y, z), x), one);
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(zero_mask, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

AVX2 static inline float hsum8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

AVX2 static inline float dot_avx2(const float *a, const float *b, int n)
{
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
    float s = hsum8(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* the dot products of q with eight keys, as one vector (n a multiple of 8) */
AVX2 static inline __m256 dot8_avx2(const float *q, const float *const k[8], int n)
{
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int i = 0; i < n; i += 8) {
        __m256 v = _mm256_loadu_ps(q + i);
        a0 = _mm256_add_ps(a0, _mm256_mul_ps(v, _mm256_loadu_ps(k[0] + i)));
        a1 = _mm256_add_ps(a1, _mm256_mul_ps(v, _mm256_loadu_ps(k[1] + i)));
        a2 = _mm256_add_ps(a2, _mm256_mul_ps(v, _mm256_loadu_ps(k[2] + i)));
        a3 = _mm256_add_ps(a3, _mm256_mul_ps(v, _mm256_loadu_ps(k[3] + i)));
        a4 = _mm256_add_ps(a4, _mm256_mul_ps(v, _mm256_loadu_ps(k[4] + i)));
        a5 = _mm256_add_ps(a5, _mm256_mul_ps(v, _mm256_loadu_ps(k[5] + i)));
        a6 = _mm256_add_ps(a6, _mm256_mul_ps(v, _mm256_loadu_ps(k[6] + i)));
        a7 = _mm256_add_ps(a7, _mm256_mul_ps(v, _mm256_loadu_ps(k[7] + i)));
    }
    __m256 g1 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    __m256 g2 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(g1, g2, 0x20), _mm256_permute2f128_ps(g1, g2, 0x31));
}

/* One tile: pairs i = (row r0 + i / nh, head h0 + i % nh). For each key tile [p0, p0 + KT): the
 * scores of every pair (eight keys per vector where they share a rotation), then per pair one
 * online-softmax step for the whole key tile (tile max, one rescale, vector exp) and the
 * weighted values in key order. Key tiles start at absolute multiples of KT and each pair only
 * reads keys below its own context, so a pair's result does not depend on the tile it is in. */
AVX2 static void tile_avx2(const struct tile_plan *pl, int s, int r0, int r1, int h0, int h1)
{
    const struct kvs_cpu_attn_args *j = pl->a;
    const int hd = j->head_dim, bs = j->block_size, nh = h1 - h0, hd8 = hd / 8 * 8;
    const int g = h0 / (j->n_heads / j->n_kv_heads);
    const int32_t *bt = j->bt + (size_t)s * j->max_blocks;
    const int32_t *rot = j->rot ? j->rot + (size_t)s * j->max_blocks : NULL;
    const int32_t *valid = j->valid ? j->valid + (size_t)s * j->max_blocks : NULL;
    const int np = (r1 - r0) * nh;
    float acc[TILE_FLOATS], qr[TILE_FLOATS], mx[TILE_FLOATS / 8], l[TILE_FLOATS / 8];
    float sc[TILE_FLOATS / 8][KT] __attribute__((aligned(32)));
    const float *q[TILE_FLOATS / 8];
    KVS_ASSERT(np * hd <= TILE_FLOATS);
    const int ctx0 = j->pos[s] + (r0 - j->q_start[s]) + 1, ctx_max = ctx0 + (r1 - r0) - 1;
    for (int i = 0; i < np; i++) {
        q[i] = j->q + ((size_t)(r0 + i / nh) * j->n_heads + h0 + i % nh) * hd;
        mx[i] = -INFINITY;
        l[i] = 0.0f;
    }
    memset(acc, 0, (size_t)np * hd * sizeof(float));
    int cur_rot = 0;
    for (int p0 = 0; p0 < ctx_max; p0 += KT) {
        const int nk = ctx_max - p0 < KT ? ctx_max - p0 : KT;
        const float *kp[KT], *vp[KT];
        int rv[KT];
        for (int t = 0; t < nk; t++) {
            int p = p0 + t, bi = p / bs, off = p % bs;
            rv[t] = rot ? rot[bi] : 0;
            if (valid && off >= valid[bi]) {
                kp[t] = vp[t] = NULL;   /* padding of a partial block: never read */
                continue;
            }
            size_t base = (((size_t)bt[bi] * j->n_kv_heads + g) * bs + off) * hd;
            kp[t] = j->kc + base;
            vp[t] = j->vc + base;
        }
        /* pairs from i0 on have keys in this tile (rows are in increasing context) */
        const int i0 = p0 < ctx0 ? 0 : (p0 - ctx0 + 1) * nh;
        /* scores, by runs of keys that share a rotation offset */
        for (int t0 = 0; t0 < nk;) {
            int t1 = t0 + 1;
            while (t1 < nk && rv[t1] == rv[t0]) t1++;
            if (rv[t0] != cur_rot) {
                cur_rot = rv[t0];
                for (int i = 0; i < np; i++) {
                    const float *q0 = j->q + ((size_t)(r0 + i / nh) * j->n_heads + h0 + i % nh) * hd;
                    if (cur_rot) {
                        rotate_back(q0, j->inv_freq, cur_rot, hd, qr + (size_t)i * hd);
                        q[i] = qr + (size_t)i * hd;
                    } else {
                        q[i] = q0;
                    }
                }
            }
            for (int i = i0; i < np; i++) {
                const int kend = ctx0 + i / nh - p0 < t1 ? ctx0 + i / nh - p0 : t1;   /* keys < own context */
                int t = t0;
                if (hd8 == hd)
                    for (; t + 8 <= kend; t += 8) {
                        int all = 1;
                        for (int u = 0; u < 8; u++) all &= kp[t + u] != NULL;
                        if (!all) break;
                        _mm256_storeu_ps(sc[i] + t, _mm256_mul_ps(dot8_avx2(q[i], kp + t, hd), _mm256_set1_ps(j->scale)));
                    }
                for (; t < kend; t++) sc[i][t] = kp[t] ? dot_avx2(q[i], kp[t], hd) * j->scale : -INFINITY;
                for (t = kend > t0 ? kend : t0; t < t1; t++) sc[i][t] = -INFINITY;
            }
            t0 = t1;
        }
        /* one softmax step per pair over the key tile */
        for (int i = i0; i < np; i++) {
            float *si = sc[i];
            for (int t = nk; t < KT; t++) si[t] = -INFINITY;
            __m256 m8 = _mm256_max_ps(_mm256_load_ps(si), _mm256_load_ps(si + 8));
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            const float tmax = _mm_cvtss_f32(m4);
            if (tmax == -INFINITY) continue;   /* no key of this tile for this pair */
            const float mnew = tmax > mx[i] ? tmax : mx[i];
            const __m256 mb = _mm256_set1_ps(mnew);
            float pw[KT] __attribute__((aligned(32)));
            _mm256_store_ps(pw, exp_avx2(_mm256_sub_ps(_mm256_load_ps(si), mb)));
            _mm256_store_ps(pw + 8, exp_avx2(_mm256_sub_ps(_mm256_load_ps(si + 8), mb)));
            float *ac = acc + (size_t)i * hd;
            if (mnew > mx[i]) {
                const float corr = mx[i] == -INFINITY ? 0.0f : expf(mx[i] - mnew);
                l[i] *= corr;
                const __m256 c8 = _mm256_set1_ps(corr);
                int e = 0;
                for (; e < hd8; e += 8) _mm256_storeu_ps(ac + e, _mm256_mul_ps(_mm256_loadu_ps(ac + e), c8));
                for (; e < hd; e++) ac[e] *= corr;
                mx[i] = mnew;
            }
            float lsum = 0.0f;
            for (int t = 0; t < nk; t++) lsum += pw[t];
            l[i] += lsum;
            const int kend = ctx0 + i / nh - p0 < nk ? ctx0 + i / nh - p0 : nk;
            int e = 0;
            for (; e + 16 <= hd8; e += 16) {   /* two accumulators in registers across the keys */
                __m256 o0 = _mm256_loadu_ps(ac + e), o1 = _mm256_loadu_ps(ac + e + 8);
                for (int t = 0; t < kend; t++) {
                    if (!vp[t]) continue;
                    const __m256 w = _mm256_set1_ps(pw[t]);
                    o0 = _mm256_add_ps(o0, _mm256_mul_ps(w, _mm256_loadu_ps(vp[t] + e)));
                    o1 = _mm256_add_ps(o1, _mm256_mul_ps(w, _mm256_loadu_ps(vp[t] + e + 8)));
                }
                _mm256_storeu_ps(ac + e, o0);
                _mm256_storeu_ps(ac + e + 8, o1);
            }
            for (; e < hd; e++)
                for (int t = 0; t < kend; t++)
                    if (vp[t]) ac[e] += pw[t] * vp[t][e];
        }
    }
    for (int i = 0; i < np; i++) {
        float *o = j->out + ((size_t)(r0 + i / nh) * j->n_heads + h0 + i % nh) * hd;
        const float *ac = acc + (size_t)i * hd;
        float inv = 1.0f / l[i];
        for (int e = 0; e < hd; e++) o[e] = ac[e] * inv;
    }
}

static void tile_task(void *c, int task)
{
    const struct tile_plan *pl = c;
    const struct kvs_cpu_attn_args *a = pl->a;
    int hc = task % pl->n_hchunks, qtile = task / pl->n_hchunks;
    int s = 0;
    for (;; s++) {
        int rows = a->q_start[s + 1] - a->q_start[s], nt = (rows + pl->qt - 1) / pl->qt;
        if (qtile < nt) break;
        qtile -= nt;
    }
    int r0 = a->q_start[s] + qtile * pl->qt, r1 = r0 + pl->qt < a->q_start[s + 1] ? r0 + pl->qt : a->q_start[s + 1];
    tile_avx2(pl, s, r0, r1, hc * pl->ht, (hc + 1) * pl->ht);
}
#endif

void kvs_cpu_attention(struct kvs_cpu_pool *pool, const struct kvs_cpu_kernels *k, const struct kvs_cpu_attn_args *a)
{
#if KVS_CPU_X86
    if (k->isa == KVS_CPU_ISA_AVX2) {
        const int group = a->n_heads / a->n_kv_heads;
        struct tile_plan pl = {.a = a, .ht = group};
        int max_rows = 0;
        for (int s = 0; s < a->n_seqs; s++) {
            int rows = a->q_start[s + 1] - a->q_start[s];
            if (rows > max_rows) max_rows = rows;
        }
        /* whole GQA groups share the most loads; split them when the tiles would not keep every
         * thread busy (a lone decode row, a short batch) */
        if (a->n_seqs * a->n_kv_heads < 2 * kvs_cpu_pool_threads(pool) && max_rows <= 4) pl.ht = 1;
        while (pl.ht > 1 && pl.ht * a->head_dim > TILE_FLOATS) pl.ht = pl.ht % 2 == 0 ? pl.ht / 2 : 1;
        int qt = TILE_FLOATS / (pl.ht * a->head_dim);
        pl.qt = qt < 1 ? 1 : qt > 16 ? 16 : qt;
        pl.n_hchunks = a->n_heads / pl.ht;
        int n_qtiles = 0;
        for (int s = 0; s < a->n_seqs; s++) n_qtiles += (a->q_start[s + 1] - a->q_start[s] + pl.qt - 1) / pl.qt;
        kvs_cpu_pool_run(pool, n_qtiles * pl.n_hchunks, tile_task, &pl);
        return;
    }
#else
    (void)k;
#endif
    kvs_cpu_pool_run(pool, a->n * a->n_heads, ref_task, (void *)a);
}
