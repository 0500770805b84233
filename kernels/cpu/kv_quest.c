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
    const int32_t *pos, *bts, *keep;
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
        const float *mn = j->dig + (pp * j->n_kv_heads + g) * 2 * hd, *mx = mn + hd;
        float sc = 0.0f;
        for (int h = g * G; h < (g + 1) * G; h++) {
            const float *q = j->q + ((size_t)s * j->n_heads + h) * hd;
            float hs = 0.0f;
            for (int i = 0; i < hd; i++) {
                const float a = q[i] * mn[i], bb = q[i] * mx[i];
                hs += a > bb ? a : bb;
            }
            sc += hs;
        }
        out[pg] = sc;
    }
}

static void cpu_score(struct kvs_backend *b, const struct kvs_dbuf *q, const struct kvs_dbuf *dig,
                      const struct kvs_attn_meta *m, const struct kvs_dbuf *keep, int n, int n_heads, int n_kv_heads, int head_dim, int block_size,
                      int page_size, int max_pages, struct kvs_dbuf *scores)
{
    struct score_job j = {F(q), F(dig), F(scores), I(m->pos), I(m->block_tables), I(keep), m->max_blocks, n_heads, n_kv_heads,
                          head_dim, block_size, page_size, max_pages};
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
    sel[cur] = 1;
    int ns = 0;
    for (int pg = 0; pg <= cur; pg++) {
        if (!sel[pg]) continue;
        if (pg > 0 && sel[pg - 1]) {
            sp[2 * ns - 1] = (pg + 1) * j->ps;   /* extends the previous span */
        } else {
            KVS_ASSERT(ns < j->max_spans);
            sp[2 * ns] = pg * j->ps, sp[2 * ns + 1] = (pg + 1) * j->ps;
            ns++;
        }
    }
    sp[2 * ns - 1] = ctx;   /* the current page ends the last span */
    j->n_spans[task] = ns;
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
    const int32_t *pos, *bts, *keep;
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
        float sum = 0.0f;
        for (int h = g * G; h < (g + 1) * G; h++) {
            const float *q = j->q + ((size_t)s * j->n_heads + h) * hd;
            float hs = 0.0f;
            for (int i = 0; i < hd; i++) {
                const float a = q[i] * mn[i], bb = q[i] * mx[i];
                hs += a > bb ? a : bb;
            }
            sum += hs;
        }
        out[pg] = sum;
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
                           I(m->block_tables), I(keep), m->max_blocks, n_heads, n_kv_heads, head_dim, block_size,
                           page_size, max_pages, bits, vw};
    kvs_cpu_pool_run(b->pool, n * n_kv_heads, qscore_task, &j);
}

const struct kvs_quest_kernels kvs_quest_kernels_cpu = {
    .name = "cpu",
    .digest_update = cpu_digest_update,
    .score = cpu_score,
    .select = cpu_select,
    .qdigest_update = cpu_qdigest_update,
    .qscore = cpu_qscore,
};
