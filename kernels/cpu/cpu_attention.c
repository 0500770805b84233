/* cpu_attention.c: paged causal attention on the CPU (cpu_kernels.h), two ways:
 *
 * The reference (the oracle of the tests, and the kernel where AVX2 is missing): one task per
 * (row, head), keys in increasing position, an online softmax updated per key (running max,
 * rescale on a new max, libm expf), kvs_cpu_dot for the scores.
 *
 * The key-tiled kernel (AVX2 and FMA sets): one task per tile of (up to 16 query rows of one
 * sequence) x (query heads of one kv head); the tile walks key tiles of KVS_CPU_ATTN_KT keys,
 * each read from memory once for all its (row, head) pairs (the reference rereads it per pair:
 * GQA heads and a prefill chunk's rows). Per pair the steps of cpu_attn_tile.h: the scores of
 * eight keys per vector, one online-softmax step per key tile with a vector exp. Within
 * rounding of the reference, batch invariant (a pair's steps depend on nothing but its own row
 * and the cache), and attention_spans() over one full span gives the same bits. Tiles are
 * shaped per call (one head per tile when there are too few tiles to keep the threads busy,
 * e.g. a single decode row); that changes which thread computes a pair, never its bits. Pairs
 * that read every key of a full key tile (prefill rows below the diagonal) share register
 * tiles (cpu_attn_tile.h: 3 queries x 4 keys for the scores, 2 pairs x 32 elements for the
 * values), with exactly the one-pair steps' bits, so the grouping never shows in a result. */
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
    int t = j->row0 + task / j->n_heads, h = task % j->n_heads;
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

/* ---- key-tiled AVX2 / FMA (cpu_attn_tile.h) -------------------------------------------------- */
#if KVS_CPU_X86
#include "kernels/cpu/cpu_attn_tile.h"

#define TILE_FLOATS 8192          /* accumulators of one tile: (rows x heads) x head_dim floats */

struct tile_plan {
    const struct kvs_cpu_attn_args *a;
    int qt;                       /* query rows per tile */
    int ht;                       /* query heads per tile (divides the GQA group) */
    int n_hchunks;                /* n_heads / ht */
    int fm;                       /* FMA kernel set (or avx512) */
    int w5;                       /* avx512 set: the softmax and value halves at 16 lanes (bitwise fm's) */
    int n_tasks;
};

/* One tile: pairs i = (row r0 + i / nh, head h0 + i % nh) of one sequence and kv head walk the
 * key tiles together, so each key tile is read from memory once and from L1 by every pair. */
ATT_AVX2 ATT_INLINE void tile_run(const struct tile_plan *pl, int s, int r0, int r1, int h0, int h1, const int fm,
                                  const int w5)
{
    const struct kvs_cpu_attn_args *j = pl->a;
    const int hd = j->head_dim, bs = j->block_size, nh = h1 - h0;
    const int g = h0 / (j->n_heads / j->n_kv_heads);
    const int32_t *bt = j->bt + (size_t)s * j->max_blocks;
    const int32_t *rot = j->rot ? j->rot + (size_t)s * j->max_blocks : NULL;
    const int32_t *valid = j->valid ? j->valid + (size_t)s * j->max_blocks : NULL;
    const int np = (r1 - r0) * nh;
    float acc[TILE_FLOATS], qr[TILE_FLOATS];
    float sc[KT];
    float scs[TILE_FLOATS / 8 * KT], pws[TILE_FLOATS / 8 * KT];   /* per pair: scores, weights */
    struct kt_pair pr[TILE_FLOATS / 8];
    struct kt_keys keys;
    KVS_ASSERT(np * hd <= TILE_FLOATS);
    const int ctx0 = j->pos[s] + (r0 - j->q_start[s]) + 1, ctx_max = ctx0 + (r1 - r0) - 1;
    for (int i = 0; i < np; i++)
        kt_pair_init(&pr[i], j->q + ((size_t)(r0 + i / nh) * j->n_heads + h0 + i % nh) * hd, qr + (size_t)i * hd,
                     acc + (size_t)i * hd, hd);
    for (int p0 = 0; p0 < ctx_max; p0 += KT) {
        const int nk = ctx_max - p0 < KT ? ctx_max - p0 : KT;
        kt_fill(&keys, j->kc, j->vc, bt, rot, valid, j->n_kv_heads, g, bs, hd, p0, nk);
        /* pairs from i0 on have keys in this tile (rows are in increasing context): the tiles
         * above a row's context are skipped (causal) */
        const int i0 = p0 < ctx0 ? 0 : (p0 - ctx0 + 1) * nh;
        /* pairs from i_full on read every key of a full tile (all valid, one rotation): those
         * take the register tiles over several pairs; the rest (the diagonal tile, padding,
         * mixed rotations) the one-pair steps. Same bits either way (cpu_attn_tile.h). */
        int i_full = np;
        if (nk == KT && hd % 8 == 0) {
            int ok = 1;
            for (int i = 0; i < KT && ok; i++) ok = keys.k[i] && keys.rot[i] == keys.rot[0];
            if (ok) {
                const int first = (p0 + KT - ctx0) * nh;
                i_full = first < i0 ? i0 : first > np ? np : first;
            }
        }
        for (int i = i0; i < i_full; i++) {
            const int ctx = ctx0 + i / nh, kend = ctx - p0 < nk ? ctx - p0 : nk;
            kt_scores(&pr[i], &keys, kend, NULL, j->inv_freq, hd, j->scale, sc, fm);
            if (w5) {
                float pw[KT];
                if (kvs_cpu_kt512_softmax(&pr[i], sc, pw, hd)) kvs_cpu_kt512_pv(&pr[i], &keys, sc, pw, hd);
            } else {
                kt_update(&pr[i], &keys, sc, hd, fm);
            }
        }
        if (i_full >= np) continue;
        const int r = keys.rot[0];
        for (int i = i_full; i < np; i++)
            if (pr[i].cur_rot != r) {
                pr[i].cur_rot = r;
                if (r) kvs_cpu_rotate_back(pr[i].q0, j->inv_freq, r, hd, pr[i].qr);
                pr[i].q = r ? pr[i].qr : pr[i].q0;
            }
        int i = i_full;
        for (; i + 3 <= np; i += 3)
            if (w5)
                kvs_cpu_kt512_scores3(pr[i].q, pr[i + 1].q, pr[i + 2].q, keys.k, hd, j->scale, scs + (size_t)i * KT,
                                      scs + (size_t)(i + 1) * KT, scs + (size_t)(i + 2) * KT);
            else
                kt_scores3(pr[i].q, pr[i + 1].q, pr[i + 2].q, keys.k, hd, j->scale, scs + (size_t)i * KT,
                           scs + (size_t)(i + 1) * KT, scs + (size_t)(i + 2) * KT, fm);
        for (; i < np; i++)
            for (int k8 = 0; k8 < KT; k8 += 8)
                _mm256_storeu_ps(scs + (size_t)i * KT + k8,
                                 _mm256_mul_ps(kt_dot8(pr[i].q, keys.k + k8, hd, fm), _mm256_set1_ps(j->scale)));
        int pend = -1;   /* a pair waiting for a partner of kt_pv2 */
        i = i_full;
        if (hd % 32 == 0)
            /* eight pairs at a time, one per lane (kt_softmax8: the same bits as one by one) */
            for (; i + 8 <= np; i += 8) {
                struct kt_pair *p8[8];
                float pwT[KT * 8];
                for (int q = 0; q < 8; q++) p8[q] = &pr[i + q];
                if (!kt_softmax8(p8, scs + (size_t)i * KT, pwT, hd)) break;
                for (int q = 0; q < 8; q += 2)
                    if (w5)
                        kvs_cpu_kt512_pv2(pr[i + q].acc, pr[i + q + 1].acc, &keys, pwT + q, pwT + q + 1, hd, 8);
                    else
                        kt_pv2(pr[i + q].acc, pr[i + q + 1].acc, &keys, pwT + q, pwT + q + 1, hd, fm, 8);
            }
        for (; i < np; i++) {
            const float *s_i = scs + (size_t)i * KT;
            float *pw_i = pws + (size_t)i * KT;
            if (!(w5 ? kvs_cpu_kt512_softmax(&pr[i], s_i, pw_i, hd) : kt_softmax(&pr[i], s_i, pw_i, hd))) continue;
            int finite = hd % 32 == 0;
            for (int k = 0; k < KT && finite; k++) finite = s_i[k] != -INFINITY;
            if (!finite) {
                if (w5)
                    kvs_cpu_kt512_pv(&pr[i], &keys, s_i, pw_i, hd);
                else
                    kt_pv(&pr[i], &keys, s_i, pw_i, hd, fm);
            } else if (pend < 0) {
                pend = i;
            } else {
                if (w5)
                    kvs_cpu_kt512_pv2(pr[pend].acc, pr[i].acc, &keys, pws + (size_t)pend * KT, pw_i, hd, 1);
                else
                    kt_pv2(pr[pend].acc, pr[i].acc, &keys, pws + (size_t)pend * KT, pw_i, hd, fm, 1);
                pend = -1;
            }
        }
        if (pend >= 0) {
            if (w5)
                kvs_cpu_kt512_pv(&pr[pend], &keys, scs + (size_t)pend * KT, pws + (size_t)pend * KT, hd);
            else
                kt_pv(&pr[pend], &keys, scs + (size_t)pend * KT, pws + (size_t)pend * KT, hd, fm);
        }
    }
    for (int i = 0; i < np; i++) {
        float *o = j->out + ((size_t)(r0 + i / nh) * j->n_heads + h0 + i % nh) * hd;
        const float inv = 1.0f / pr[i].l;
        for (int e = 0; e < hd; e++) o[e] = pr[i].acc[e] * inv;
    }
}

ATT_AVX2 static void tile_avx2(const struct tile_plan *pl, int s, int r0, int r1, int h0, int h1)
{
    tile_run(pl, s, r0, r1, h0, h1, 0, 0);
}
ATT_AVX2 static void tile_fma(const struct tile_plan *pl, int s, int r0, int r1, int h0, int h1)
{
    tile_run(pl, s, r0, r1, h0, h1, 1, 0);
}
/* the avx512 set: the three-query score tiles, softmax and values at 512 bits (bitwise tile_fma) */
ATT_AVX2 static void tile_avx512(const struct tile_plan *pl, int s, int r0, int r1, int h0, int h1)
{
    tile_run(pl, s, r0, r1, h0, h1, 1, 1);
}

static void tile_task(void *c, int task)
{
    const struct tile_plan *pl = c;
    const struct kvs_cpu_attn_args *a = pl->a;
    /* the last tasks first: the pool hands tasks out in increasing order, and the last query
     * tiles of a sequence read the most keys, so the long ones start first and the short ones
     * fill in at the end (a causal prefill otherwise ends on one thread's longest tile) */
    task = pl->n_tasks - 1 - task;
    int hc = task % pl->n_hchunks, qtile = task / pl->n_hchunks;
    int s = 0;
    for (;; s++) {
        int rows = a->q_start[s + 1] - a->q_start[s], nt = (rows + pl->qt - 1) / pl->qt;
        if (qtile < nt) break;
        qtile -= nt;
    }
    int r0 = a->q_start[s] + qtile * pl->qt, r1 = r0 + pl->qt < a->q_start[s + 1] ? r0 + pl->qt : a->q_start[s + 1];
    (pl->w5 ? tile_avx512 : pl->fm ? tile_fma : tile_avx2)(pl, s, r0, r1, hc * pl->ht, (hc + 1) * pl->ht);
}
#endif

void kvs_cpu_attention(struct kvs_cpu_pool *pool, const struct kvs_cpu_kernels *k, const struct kvs_cpu_attn_args *a)
{
#if KVS_CPU_X86
    if (k->isa != KVS_CPU_ISA_REF) {
        const int group = a->n_heads / a->n_kv_heads;
        struct tile_plan pl = {.a = a, .ht = group, .fm = k->isa >= KVS_CPU_ISA_FMA,
                              .w5 = k->isa == KVS_CPU_ISA_AVX512};
        int max_rows = 0;
        for (int s = 0; s < a->n_seqs; s++) {
            int rows = a->q_start[s + 1] - a->q_start[s];
            if (rows > max_rows) max_rows = rows;
        }
        /* whole GQA groups share the most loads (each key tile is read once per tile); split
         * them, halving while the tiles would not keep every thread busy (a lone decode row, a
         * short batch), so each thread still reads each key tile once for its heads */
        if (max_rows <= 4)
            while (pl.ht % 2 == 0 && a->n_seqs * a->n_kv_heads * (a->n_heads / a->n_kv_heads / pl.ht) <
                                         kvs_cpu_pool_threads(pool))
                pl.ht /= 2;
        while (pl.ht > 1 && pl.ht * a->head_dim > TILE_FLOATS) pl.ht = pl.ht % 2 == 0 ? pl.ht / 2 : 1;
        int qt = TILE_FLOATS / (pl.ht * a->head_dim);
        pl.qt = qt < 1 ? 1 : qt > 16 ? 16 : qt;
        pl.n_hchunks = a->n_heads / pl.ht;
        int n_qtiles = 0;
        for (int s = 0; s < a->n_seqs; s++) n_qtiles += (a->q_start[s + 1] - a->q_start[s] + pl.qt - 1) / pl.qt;
        double work = 0;   /* multiply-adds: scores and values, each row over its context */
        for (int s = 0; s < a->n_seqs; s++) {
            const double rows = a->q_start[s + 1] - a->q_start[s];
            work += rows * (a->pos[s] + (rows + 1) / 2) * 2.0 * a->n_heads * a->head_dim;
        }
        pl.n_tasks = n_qtiles * pl.n_hchunks;
        kvs_cpu_pool_run_sized(pool, pl.n_tasks, work, tile_task, &pl);
        return;
    }
#else
    (void)k;
#endif
    kvs_cpu_pool_run(pool, (a->n - a->row0) * a->n_heads, ref_task, (void *)a);
}
