/* kv_quest.c: the CPU reference of Quest's page selection (kernels/kv_quest.h): digests
 * recomputed from the cache, scores in a fixed order, top-k by sorting, spans merged in order.
 * Plain C that the CUDA kernels are tested against. */
#include "kernels/kv_quest.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/util.h"
#include "kernels/cpu/cpu_internal.h"
#include "kernels/cpu/cpu_pool.h"

/* the physical page of sequence position p */
static inline size_t phys_page(const int32_t *bt, int p, int bs, int ps)
{
    return (size_t)bt[p / bs] * (size_t)(bs / ps) + (size_t)((p % bs) / ps);
}

/* Quest's bound of one page (or super-page) for KV head g of a row (qr: the row's [n_heads][hd]
 * queries): the sum over the group's heads, in increasing h, of sum over i, in increasing i, of
 * max(q mn, q mx), in fp32. Every score of this file goes through it (the order is the contract
 * the CUDA super-page kernel repeats bitwise). */
static inline float bound_score(const float *qr, int g, int G, int hd, const float *mn, const float *mx)
{
    float sc = 0.0f;
    for (int h = g * G; h < (g + 1) * G; h++) {
        const float *q = qr + (size_t)h * hd;
        float hs = 0.0f;
        for (int i = 0; i < hd; i++) {
            const float a = q[i] * mn[i], bb = q[i] * mx[i];
            hs += a > bb ? a : bb;
        }
        sc += hs;
    }
    return sc;
}

static void cpu_digest_update(struct kvs_backend *b, const struct kvs_dbuf *kc, const struct kvs_attn_meta *m,
                              int n_kv_heads, int head_dim, int block_size, int page_size, struct kvs_dbuf *dig)
{
    (void)b;
    const float *k = F(kc);
    float *d = F(dig);
    const int32_t *qs = I(m->q_start), *pos = I(m->pos), *bts = I(m->block_tables);
    const int bs = block_size, ps = page_size, hd = head_dim;
    for (int s = 0; s < m->n_seqs; s++) {
        const int n = qs[s + 1] - qs[s];
        if (n <= 0) continue;
        const int p0 = pos[s], p1 = pos[s] + n;   /* positions written: [p0, p1) */
        const int32_t *bt = bts + (size_t)s * m->max_blocks;
        for (int pg = p0 / ps; pg * ps < p1; pg++) {
            const int first = pg * ps, end = (pg + 1) * ps < p1 ? (pg + 1) * ps : p1;
            const size_t pp = phys_page(bt, first, bs, ps);
            for (int g = 0; g < n_kv_heads; g++) {
                float *mn = d + (pp * n_kv_heads + g) * 2 * hd, *mx = mn + hd;
                for (int p = first; p < end; p++) {
                    const float *kr = k + (((size_t)bt[p / bs] * n_kv_heads + g) * bs + p % bs) * hd;
                    for (int i = 0; i < hd; i++) {
                        if (p == first || kr[i] < mn[i]) mn[i] = kr[i];
                        if (p == first || kr[i] > mx[i]) mx[i] = kr[i];
                    }
                }
            }
        }
    }
}

struct score_job {
    const float *q, *dig;
    float *scores;
    const int32_t *pos, *bts, *keep, *qs;
    int max_blocks, n_heads, n_kv_heads, hd, bs, ps, max_pages;
};

static void score_task(void *c, int task)
{
    const struct score_job *j = c;
    const int s = task / j->n_kv_heads, g = task % j->n_kv_heads, G = j->n_heads / j->n_kv_heads, hd = j->hd;
    const int cur = j->pos[s] / j->ps;
    if (j->keep[s] > cur) return;   /* keeps every page: nothing to rank */
    const int32_t *bt = j->bts + (size_t)s * j->max_blocks;
    float *out = j->scores + ((size_t)s * j->n_kv_heads + g) * j->max_pages;
    for (int pg = 0; pg < cur; pg++) {
        const size_t pp = phys_page(bt, pg * j->ps, j->bs, j->ps);
        const float *mn = j->dig + (pp * j->n_kv_heads + g) * 2 * hd;
        out[pg] = bound_score(j->q + (size_t)(j->qs[s + 1] - 1) * j->n_heads * hd, g, G, hd, mn, mn + hd);
    }
}

static void cpu_score(struct kvs_backend *b, const struct kvs_dbuf *q, const struct kvs_dbuf *dig,
                      const struct kvs_attn_meta *m, const struct kvs_dbuf *keep, int n, int n_heads, int n_kv_heads, int head_dim, int block_size,
                      int page_size, int max_pages, struct kvs_dbuf *scores)
{
    struct score_job j = {F(q), F(dig), F(scores), I(m->pos), I(m->block_tables), I(keep), I(m->q_start), m->max_blocks,
                          n_heads, n_kv_heads, head_dim, block_size, page_size, max_pages};
    kvs_cpu_pool_run(b->pool, n * n_kv_heads, score_task, &j);
}

struct cand {
    uint32_t key;
    int page;
};

static int cand_cmp(const void *a, const void *b)
{
    const struct cand *x = a, *y = b;
    if (x->key != y->key) return x->key > y->key ? -1 : 1;   /* higher score first */
    return x->page < y->page ? -1 : x->page > y->page;       /* then the lower page */
}

/* the kept pages sel[0 .. cur - 1] plus the current page cur as merged spans in page order, the
 * last ending at ctx; returns their count */
static int sel_spans(unsigned char *sel, int cur, int ctx, int ps, int max_spans, int32_t *sp)
{
    sel[cur] = 1;
    int ns = 0;
    for (int pg = 0; pg <= cur; pg++) {
        if (!sel[pg]) continue;
        if (pg > 0 && sel[pg - 1]) {
            sp[2 * ns - 1] = (pg + 1) * ps;   /* extends the previous span */
        } else {
            KVS_ASSERT(ns < max_spans);
            sp[2 * ns] = pg * ps, sp[2 * ns + 1] = (pg + 1) * ps;
            ns++;
        }
    }
    sp[2 * ns - 1] = ctx;   /* the current page ends the last span */
    return ns;
}

struct select_job {
    const float *scores;
    const int32_t *pos, *keep;
    int32_t *n_spans, *spans;
    int n_kv_heads, ps, max_pages, max_spans;
};

static void select_task(void *c, int task)
{
    const struct select_job *j = c;
    const int s = task / j->n_kv_heads;
    const int ctx = j->pos[s] + 1, cur = j->pos[s] / j->ps, top = j->keep[s] - 1;
    int32_t *sp = j->spans + (size_t)task * j->max_spans * 2;
    if (top >= cur) {   /* every page: one span */
        sp[0] = 0, sp[1] = ctx;
        j->n_spans[task] = 1;
        return;
    }
    unsigned char *sel = kvs_xcalloc((size_t)cur + 1, 1);
    struct cand *cd = kvs_xmalloc(((size_t)cur + 1) * sizeof *cd);
    const float *sc = j->scores + (size_t)task * j->max_pages;
    for (int pg = 0; pg < cur; pg++) cd[pg] = (struct cand){kvs_quest_order_key(sc[pg]), pg};
    qsort(cd, (size_t)cur, sizeof *cd, cand_cmp);
    for (int i = 0; i < top; i++) sel[cd[i].page] = 1;
    j->n_spans[task] = sel_spans(sel, cur, ctx, j->ps, j->max_spans, sp);
    free(sel);
    free(cd);
}

static void cpu_select(struct kvs_backend *b, const struct kvs_dbuf *scores, const struct kvs_attn_meta *m,
                       const struct kvs_dbuf *keep, int n, int n_kv_heads, int page_size, int max_pages, int max_spans,
                       struct kvs_dbuf *n_spans, struct kvs_dbuf *spans)
{
    struct select_job j = {F(scores), I(m->pos), I(keep), I(n_spans), I(spans), n_kv_heads, page_size, max_pages,
                           max_spans};
    kvs_cpu_pool_run(b->pool, n * n_kv_heads, select_task, &j);
}

/* ---- quantized digests (kernels/kv_quest.h) ---- */

static void cpu_qdigest_update(struct kvs_backend *b, const struct kvs_dbuf *kc, const struct kvs_attn_meta *m,
                               int n_kv_heads, int head_dim, int block_size, int page_size, int bits, size_t n_pages,
                               struct kvs_dbuf *qdig)
{
    (void)b;
    const float *k = F(kc);
    uint32_t *codes = (uint32_t *)I(qdig);
    const size_t vw = kvs_quest_qdig_vec_words(head_dim, bits);
    uint32_t *params = codes + n_pages * (size_t)n_kv_heads * 2 * vw;
    const int32_t *qs = I(m->q_start), *pos = I(m->pos), *bts = I(m->block_tables);
    const int bs = block_size, ps = page_size, hd = head_dim;
    float *mn = kvs_xmalloc(2 * (size_t)hd * sizeof *mn), *mx = mn + hd;
    for (int s = 0; s < m->n_seqs; s++) {
        const int n = qs[s + 1] - qs[s];
        if (n <= 0) continue;
        const int p0 = pos[s], p1 = pos[s] + n;
        const int32_t *bt = bts + (size_t)s * m->max_blocks;
        for (int pg = p0 / ps; pg * ps < p1; pg++) {
            const int first = pg * ps, end = (pg + 1) * ps < p1 ? (pg + 1) * ps : p1;
            const size_t pp = phys_page(bt, first, bs, ps);
            for (int g = 0; g < n_kv_heads; g++) {
                /* the exact min / max of the slots written so far (as cpu_digest_update) */
                for (int p = first; p < end; p++) {
                    const float *kr = k + (((size_t)bt[p / bs] * n_kv_heads + g) * bs + p % bs) * hd;
                    for (int i = 0; i < hd; i++) {
                        if (p == first || kr[i] < mn[i]) mn[i] = kr[i];
                        if (p == first || kr[i] > mx[i]) mx[i] = kr[i];
                    }
                }
                uint32_t *cmin = codes + (pp * n_kv_heads + g) * 2 * vw;
                const uint32_t par = kvs_qd_encode(mn, mx, hd, bits, cmin, cmin + vw);
                params[pp * n_kv_heads + g] = par;
            }
        }
    }
    free(mn);
}

struct qscore_job {
    const float *q;
    const uint32_t *codes, *params;
    float *scores;
    const int32_t *pos, *bts, *keep, *qs;
    int max_blocks, n_heads, n_kv_heads, hd, bs, ps, max_pages, bits;
    size_t vw;
};

/* score_task's formula over the decoded values, in the same order (kernels/kv_quest.h: so the
 * quantized score is >= the exact digest's score in fp32) */
static void qscore_task(void *c, int task)
{
    const struct qscore_job *j = c;
    const int s = task / j->n_kv_heads, g = task % j->n_kv_heads, G = j->n_heads / j->n_kv_heads, hd = j->hd;
    const int cur = j->pos[s] / j->ps, per = 32 / j->bits;
    const uint32_t mask = (1u << j->bits) - 1;
    if (j->keep[s] > cur) return;
    const int32_t *bt = j->bts + (size_t)s * j->max_blocks;
    float *out = j->scores + ((size_t)s * j->n_kv_heads + g) * j->max_pages;
    float *mn = kvs_xmalloc(2 * (size_t)hd * sizeof *mn), *mx = mn + hd;
    for (int pg = 0; pg < cur; pg++) {
        const size_t pp = phys_page(bt, pg * j->ps, j->bs, j->ps);
        const uint32_t par = j->params[pp * j->n_kv_heads + g];
        if (par == KVS_QD_UNBOUNDED) {
            out[pg] = INFINITY;
            continue;
        }
        const float l = kvs_qd_f16_to_f32(par & 0xFFFFu), sc = kvs_qd_f16_to_f32(par >> 16);
        const uint32_t *cmin = j->codes + (pp * j->n_kv_heads + g) * 2 * j->vw, *cmax = cmin + j->vw;
        for (int i = 0; i < hd; i++) {
            mn[i] = kvs_qd_value(cmin[i / per] >> (i % per * j->bits) & mask, l, sc);
            mx[i] = kvs_qd_value(cmax[i / per] >> (i % per * j->bits) & mask, l, sc);
        }
        out[pg] = bound_score(j->q + (size_t)(j->qs[s + 1] - 1) * j->n_heads * hd, g, G, hd, mn, mx);
    }
    free(mn);
}

static void cpu_qscore(struct kvs_backend *b, const struct kvs_dbuf *q, const struct kvs_dbuf *qdig,
                       const struct kvs_attn_meta *m, const struct kvs_dbuf *keep, int n, int n_heads, int n_kv_heads,
                       int head_dim, int block_size, int page_size, int bits, size_t n_pages, int max_pages,
                       struct kvs_dbuf *scores)
{
    const size_t vw = kvs_quest_qdig_vec_words(head_dim, bits);
    const uint32_t *codes = (const uint32_t *)I(qdig);
    struct qscore_job j = {F(q), codes, codes + n_pages * (size_t)n_kv_heads * 2 * vw, F(scores), I(m->pos),
                           I(m->block_tables), I(keep), I(m->q_start), m->max_blocks, n_heads, n_kv_heads, head_dim,
                           block_size, page_size, max_pages, bits, vw};
    kvs_cpu_pool_run(b->pool, n * n_kv_heads, qscore_task, &j);
}

/* ---- two-level (super-page) selection (kernels/kv_quest.h) ---- */

/* physical page pp's digest for KV head g as values (bf16 digests as stored, codes decoded);
 * 0 where the page is unbounded (KVS_QD_UNBOUNDED) */
static int page_vals(const struct kvs_quest_super_args *a, size_t pp, int g, float *mn, float *mx)
{
    const int hd = a->head_dim, nkv = a->n_kv_heads;
    if (a->bits >= 16) {
        const float *d = F(a->dig) + (pp * nkv + g) * 2 * hd;
        memcpy(mn, d, (size_t)hd * sizeof *mn);
        memcpy(mx, d + hd, (size_t)hd * sizeof *mx);
        return 1;
    }
    const size_t vw = kvs_quest_qdig_vec_words(hd, a->bits);
    const uint32_t *codes = (const uint32_t *)I(a->dig);
    const uint32_t par = codes[a->n_pages * nkv * 2 * vw + pp * nkv + g];
    if (par == KVS_QD_UNBOUNDED) return 0;
    const float l = kvs_qd_f16_to_f32(par & 0xFFFFu), sc = kvs_qd_f16_to_f32(par >> 16);
    const int per = 32 / a->bits;
    const uint32_t mask = (1u << a->bits) - 1, *cmin = codes + (pp * nkv + g) * 2 * vw, *cmax = cmin + vw;
    for (int i = 0; i < hd; i++) {
        mn[i] = kvs_qd_value(cmin[i / per] >> (i % per * a->bits) & mask, l, sc);
        mx[i] = kvs_qd_value(cmax[i / per] >> (i % per * a->bits) & mask, l, sc);
    }
    return 1;
}

/* the refs: each listed super-page recomputed from its pages' digests, for every KV head */
static void super_refresh(const struct kvs_quest_super_args *a)
{
    const int hd = a->head_dim, nkv = a->n_kv_heads, N = a->super_pages;
    const int32_t *refs = I(a->refs), *ref_n = I(a->ref_n), *rslot = I(a->rslot);
    float *sd = F(a->sdig), *mn = kvs_xmalloc(2 * (size_t)hd * sizeof *mn), *mx = mn + hd;
    for (int s = 0; s < a->n; s++)
        for (int e = 0; e < ref_n[s]; e++) {
            const int32_t *ent = refs + ((size_t)s * a->max_ref + e) * (2 + N);
            for (int g = 0; g < nkv; g++) {
                float *o = sd + (((size_t)rslot[s] * a->max_super + ent[0]) * nkv + g) * 2 * hd;
                int unb = 0;
                for (int t = 0; t < ent[1] && !unb; t++) {
                    unb = !page_vals(a, (size_t)ent[2 + t], g, mn, mx);
                    for (int i = 0; i < hd && !unb; i++) {
                        if (t == 0 || mn[i] < o[i]) o[i] = mn[i];
                        if (t == 0 || mx[i] > o[hd + i]) o[hd + i] = mx[i];
                    }
                }
                if (unb)
                    for (int i = 0; i < hd; i++) o[i] = -INFINITY, o[hd + i] = INFINITY;
            }
        }
    free(mn);
}

static void super_task(void *c, int task)
{
    const struct kvs_quest_super_args *a = c;
    const int nkv = a->n_kv_heads, s = task / nkv, g = task % nkv, hd = a->head_dim, G = a->n_heads / nkv;
    const int N = a->super_pages, ps = a->page_size, bs = a->block_size;
    const int32_t *pos = I(a->m->pos), *keep = I(a->keep);
    const int ctx = pos[s] + 1, cur = pos[s] / ps, top = keep[s] - 1;
    int32_t *sp = I(a->spans) + (size_t)task * a->max_spans * 2;
    if (top >= cur) {   /* every page: one span */
        sp[0] = 0, sp[1] = ctx;
        I(a->n_spans)[task] = 1;
        return;
    }
    const float *qr = F(a->q) + (size_t)s * a->n_heads * hd;
    const int nsup = (cur + N - 1) / N;
    int S = I(a->skeep)[s];
    S = S < 0 ? 0 : S > nsup ? nsup : S;
    struct cand *cd = kvs_xmalloc(((size_t)cur + 1) * sizeof *cd);
    unsigned char *kept = kvs_xcalloc((size_t)nsup, 1), *sel = kvs_xcalloc((size_t)cur + 1, 1);
    const float *sd = F(a->sdig) + ((size_t)I(a->rslot)[s] * a->max_super * nkv + g) * 2 * hd;
    for (int j = 0; j < nsup; j++) {
        const float *d = sd + (size_t)j * nkv * 2 * hd;
        const float sc = d[0] == -INFINITY && d[hd] == INFINITY ? INFINITY : bound_score(qr, g, G, hd, d, d + hd);
        cd[j] = (struct cand){kvs_quest_order_key(sc), j};
    }
    /* the last super-page (the pages just before the current one) always, the top S - 1 of the rest */
    qsort(cd, (size_t)nsup - 1, sizeof *cd, cand_cmp);
    for (int i = 0; i < S - 1; i++) kept[cd[i].page] = 1;
    if (S > 0) kept[nsup - 1] = 1;
    float *mn = kvs_xmalloc(2 * (size_t)hd * sizeof *mn), *mx = mn + hd;
    float *out = a->scores ? F(a->scores) + (size_t)task * a->max_pages : NULL;
    const int32_t *bt = I(a->m->block_tables) + (size_t)s * a->m->max_blocks;
    for (int pg = 0; pg < cur; pg++) {
        uint32_t key = 0;   /* outside the kept super-pages: below every score (a NaN in out) */
        if (out) out[pg] = NAN;
        if (kept[pg / N]) {
            const size_t pp = phys_page(bt, pg * ps, bs, ps);
            const float sc = page_vals(a, pp, g, mn, mx) ? bound_score(qr, g, G, hd, mn, mx) : INFINITY;
            key = kvs_quest_order_key(sc);
            if (out) out[pg] = sc;
        }
        cd[pg] = (struct cand){key, pg};
    }
    qsort(cd, (size_t)cur, sizeof *cd, cand_cmp);
    for (int i = 0; i < top; i++) sel[cd[i].page] = 1;
    I(a->n_spans)[task] = sel_spans(sel, cur, ctx, ps, a->max_spans, sp);
    free(mn);
    free(cd);
    free(kept);
    free(sel);
}

static void cpu_super_select(struct kvs_backend *b, const struct kvs_quest_super_args *a)
{
    super_refresh(a);
    kvs_cpu_pool_run(b->pool, a->n * a->n_kv_heads, super_task, (void *)a);
}

const struct kvs_quest_kernels kvs_quest_kernels_cpu = {
    .name = "cpu",
    .digest_update = cpu_digest_update,
    .score = cpu_score,
    .select = cpu_select,
    .qdigest_update = cpu_qdigest_update,
    .qscore = cpu_qscore,
    .super_select = cpu_super_select,
};
