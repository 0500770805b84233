/* cpu_attention.c: paged causal attention on the CPU (cpu_kernels.h), two ways with the same bits:
 *
 * The reference: one task per (row, head), keys in increasing position, an online softmax
 * (running max, rescale on a new max, libm expf), kvs_cpu_dot for the scores.
 *
 * The tiled AVX2 kernel: one task per tile of (up to 16 query rows of one sequence) x (query
 * heads of one kv head). The tile walks the keys once; each key and value row is loaded into L1
 * once for every (row, head) pair of the tile (the reference loads it once per pair: the GQA
 * heads and a prefill chunk's rows all reread it), and each pair keeps its own running max, sum
 * and accumulator. Per pair, the operations and their order are the reference's (the scores
 * with kvs_cpu_dot's lanes and tree, expf from libm, multiplies and adds without FMA), so the
 * outputs are bitwise equal to the reference's, hence to attention_spans() over one full span
 * (cpu_attn_span.c), and cannot depend on how rows were grouped into tiles: batch invariant.
 * Tiles are shaped per call (one head per tile when there are too few tiles to keep the threads
 * busy, e.g. a single decode row); that changes which thread computes a pair, never its bits.
 * (A variant with key tiles of 16 and a vector exp measured about 2x faster at prefill 2,000 but
 * is not bitwise the reference, which the span primitives' neutral setting needs:
 * bench/RESULTS.md.) */
#include <math.h>
#include <string.h>

#include "base/util.h"
#include "kernels/cpu/cpu_internal.h"
#include "kernels/cpu/cpu_kernels.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define KVS_CPU_X86 1
#else
#define KVS_CPU_X86 0
#endif

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
                kvs_cpu_rotate_back(q0, j->inv_freq, cur_rot, hd, qr);
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

/* kvs_cpu_dot with vectors: the same lanes, tree and tail */
AVX2 static inline float dot_avx2(const float *a, const float *b, int n)
{
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
    float l[8];
    _mm256_storeu_ps(l, acc);
    float s = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

AVX2 static void tile_avx2(const struct tile_plan *pl, int s, int r0, int r1, int h0, int h1)
{
    const struct kvs_cpu_attn_args *j = pl->a;
    const int hd = j->head_dim, bs = j->block_size, nh = h1 - h0, hd8 = hd / 8 * 8;
    const int g = h0 / (j->n_heads / j->n_kv_heads);
    const int32_t *bt = j->bt + (size_t)s * j->max_blocks;
    const int32_t *rot = j->rot ? j->rot + (size_t)s * j->max_blocks : NULL;
    const int32_t *valid = j->valid ? j->valid + (size_t)s * j->max_blocks : NULL;
    /* pair i = (row r0 + i / nh, head h0 + i % nh) */
    const int np = (r1 - r0) * nh;
    float acc[TILE_FLOATS], qr[TILE_FLOATS], mx[TILE_FLOATS / 8], l[TILE_FLOATS / 8];
    const float *q[TILE_FLOATS / 8];
    KVS_ASSERT(np * hd <= TILE_FLOATS);
    const int ctx0 = j->pos[s] + (r0 - j->q_start[s]) + 1;
    for (int i = 0; i < np; i++) {
        int r = r0 + i / nh, h = h0 + i % nh;
        q[i] = j->q + ((size_t)r * j->n_heads + h) * hd;
        mx[i] = -INFINITY;
        l[i] = 0.0f;
    }
    memset(acc, 0, (size_t)np * hd * sizeof(float));
    const int ctx_max = ctx0 + (r1 - r0) - 1;
    int cur_rot = 0;
    for (int p = 0; p < ctx_max; p++) {
        int bi = p / bs, off = p % bs;
        if (rot && off == 0 && rot[bi] != cur_rot) {
            cur_rot = rot[bi];
            for (int i = 0; i < np; i++) {
                const float *q0 = j->q + ((size_t)(r0 + i / nh) * j->n_heads + h0 + i % nh) * hd;
                if (cur_rot) {
                    kvs_cpu_rotate_back(q0, j->inv_freq, cur_rot, hd, qr + (size_t)i * hd);
                    q[i] = qr + (size_t)i * hd;
                } else {
                    q[i] = q0;
                }
            }
        }
        if (valid && off >= valid[bi]) {
            p += bs - off - 1;   /* the rest of this block is padding: skip it */
            continue;
        }
        size_t base = (((size_t)bt[bi] * j->n_kv_heads + g) * bs + off) * hd;
        const float *k = j->kc + base, *v = j->vc + base;
        /* rows are in increasing ctx: the first pair still inside its context onwards */
        int i0 = p < ctx0 ? 0 : (p - ctx0 + 1) * nh;
        for (int i = i0; i < np; i++) {
            float *ac = acc + (size_t)i * hd;
            float sc = dot_avx2(q[i], k, hd) * j->scale;
            if (sc > mx[i]) {
                float corr = expf(mx[i] - sc);
                l[i] *= corr;
                __m256 c8 = _mm256_set1_ps(corr);
                int e = 0;
                for (; e < hd8; e += 8) _mm256_storeu_ps(ac + e, _mm256_mul_ps(_mm256_loadu_ps(ac + e), c8));
                for (; e < hd; e++) ac[e] *= corr;
                mx[i] = sc;
            }
            float w = expf(sc - mx[i]);
            l[i] += w;
            __m256 w8 = _mm256_set1_ps(w);
            int e = 0;
            for (; e < hd8; e += 8)
                _mm256_storeu_ps(ac + e, _mm256_add_ps(_mm256_loadu_ps(ac + e), _mm256_mul_ps(w8, _mm256_loadu_ps(v + e))));
            for (; e < hd; e++) ac[e] += w * v[e];
        }
    }
    for (int i = 0; i < np; i++) {
        int r = r0 + i / nh, h = h0 + i % nh;
        float *o = j->out + ((size_t)r * j->n_heads + h) * hd;
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
