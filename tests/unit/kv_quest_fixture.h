/* kv_quest_fixture.h: random Quest cases (kernels/kv_quest.h) that run on any backend, shared by
 * tests/unit/test_kv_quest.c (the CPU reference against double references) and
 * tests/gpu/test_cuda_kv_quest.c (CUDA against the CPU reference). A case is a KV pool with
 * shuffled block tables, a step that writes a prefill chunk or a decode token per sequence on
 * top of an earlier prefill, and one decode query per sequence; keys and queries are rounded to
 * bf16 so that every backend holds the same values. Needles: a few pages per (sequence, KV
 * head) get one key aligned with the group's query, scaled. Header-only (static). */
#ifndef KVS_KV_QUEST_FIXTURE_H
#define KVS_KV_QUEST_FIXTURE_H

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/half.h"
#include "base/util.h"
#include "kernels/backend.h"
#include "kernels/kv_quest.h"
#include "tests/unit/test_util.h"

#define QF_MAX_SEQS 16
#define QF_NEEDLES 3
#define QF_MAX_KV 64      /* KV heads of a case, at most */

struct qf_case {
    int n_seqs, nh, nkv, hd, bs, ps, n_blocks, max_blocks;
    int bits;                     /* digest bits: 0 or 16 bf16 digests, 8 or 4 quantized (set after qf_make) */
    int ctx[QF_MAX_SEQS];         /* context after the step */
    int step_rows[QF_MAX_SEQS];   /* rows the step writes: positions ctx - step_rows .. ctx - 1 */
    int keep[QF_MAX_SEQS];
    int needle[QF_MAX_SEQS][QF_MAX_KV][QF_NEEDLES]; /* planted pages per (seq, kv head); -1 none */
    int32_t *bt;                  /* [n_seqs][max_blocks] */
    float *k, *v;                 /* [n_blocks][nkv][bs][hd] */
    float *q;                     /* [n_seqs][nh][hd]: the decode query of each sequence */
};

static float qf_rand(uint64_t *r) { return (float)((double)kvs_test_xorshift(r) / 4294967296.0 * 2.0 - 1.0); }

/* a random case: ctx in [lo, hi], keep from ratio (0: every page) */
static void qf_make(struct qf_case *c, uint64_t seed, int n_seqs, int nh, int nkv, int hd, int bs, int ps, int lo,
                    int hi, double ratio, int min_budget, int needles)
{
    uint64_t r = seed;
    if (n_seqs > QF_MAX_SEQS || nkv > QF_MAX_KV) kvs_panic(__FILE__, __LINE__, "qf_make: %d seqs, %d KV heads", n_seqs, nkv);
    memset(c, 0, sizeof *c);
    c->n_seqs = n_seqs, c->nh = nh, c->nkv = nkv, c->hd = hd, c->bs = bs, c->ps = ps;
    c->max_blocks = (hi + bs - 1) / bs;
    c->n_blocks = n_seqs * c->max_blocks + 3;
    c->bt = kvs_xcalloc((size_t)n_seqs * c->max_blocks, sizeof *c->bt);
    int *perm = kvs_xmalloc((size_t)c->n_blocks * sizeof *perm);
    for (int i = 0; i < c->n_blocks; i++) perm[i] = i;
    for (int i = c->n_blocks - 1; i > 0; i--) {
        int j = (int)(kvs_test_xorshift(&r) % (uint32_t)(i + 1)), t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }
    for (int s = 0; s < n_seqs; s++) {
        c->ctx[s] = lo + (int)(kvs_test_xorshift(&r) % (uint32_t)(hi - lo + 1));
        /* every third sequence writes a prefill chunk that crosses pages, the rest one token */
        c->step_rows[s] = s % 3 == 2 ? 1 + (int)(kvs_test_xorshift(&r) % 40) : 1;
        if (c->step_rows[s] >= c->ctx[s]) c->step_rows[s] = c->ctx[s] - 1;
        if (c->step_rows[s] < 1) c->step_rows[s] = 1;
        for (int b = 0; b < c->max_blocks; b++) c->bt[s * c->max_blocks + b] = perm[s * c->max_blocks + b];
        double b = ceil(ratio * c->ctx[s]);
        if (b < min_budget) b = min_budget;
        c->keep[s] = ratio > 0 ? (int)ceil(b / ps) : 1 << 30;
    }
    free(perm);
    const size_t nk = (size_t)c->n_blocks * nkv * bs * hd;
    c->k = kvs_xmalloc(nk * sizeof *c->k);
    c->v = kvs_xmalloc(nk * sizeof *c->v);
    for (size_t i = 0; i < nk; i++) c->k[i] = kvs_bf16_round(qf_rand(&r)), c->v[i] = kvs_bf16_round(qf_rand(&r));
    c->q = kvs_xmalloc((size_t)n_seqs * nh * hd * sizeof *c->q);
    for (size_t i = 0; i < (size_t)n_seqs * nh * hd; i++) c->q[i] = kvs_bf16_round(qf_rand(&r));
    memset(c->needle, 0xff, sizeof c->needle);
    const int G = nh / nkv;
    for (int s = 0; needles && s < n_seqs; s++) {
        const int cur = (c->ctx[s] - 1) / ps;
        if (cur < 2 * QF_NEEDLES) continue;
        for (int g = 0; g < nkv; g++)
            for (int k = 0; k < QF_NEEDLES; k++) {
                int pg;
                do pg = (int)(kvs_test_xorshift(&r) % (uint32_t)cur);
                while ((k > 0 && c->needle[s][g][0] == pg) || (k > 1 && c->needle[s][g][1] == pg));
                c->needle[s][g][k] = pg;
                const int p = pg * ps + (int)(kvs_test_xorshift(&r) % (uint32_t)ps);
                float *kr = c->k + (((size_t)c->bt[s * c->max_blocks + p / bs] * nkv + g) * bs + p % bs) * hd;
                for (int i = 0; i < hd; i++) {
                    double m = 0;
                    for (int h = g * G; h < (g + 1) * G; h++) m += c->q[((size_t)s * nh + h) * hd + i];
                    kr[i] = kvs_bf16_round((float)(6.0 * m / G));
                }
            }
    }
}

static void qf_free(struct qf_case *c)
{
    free(c->bt);
    free(c->k);
    free(c->v);
    free(c->q);
}

/* The outputs of a case on one backend. */
struct qf_out {
    float *dig;                   /* [n_pages][nkv][2][hd] (bf16 digests) */
    uint32_t *qdig;               /* kvs_quest_qdig_words (quantized digests); nq words */
    size_t nq;
    float *scores;                /* [n_seqs][nkv][max_pages] */
    int32_t *n_spans, *spans;     /* [n_seqs][nkv], [n_seqs][nkv][max_spans][2] */
    float *out, *lse;             /* attention_spans over the spans: [n_seqs][nh][hd], [n_seqs][nh] */
    int max_pages, max_spans, n_pages;
};

/* uploads a meta whose sequence s has rows[s] rows ending at ctx[s] */
struct qf_meta {
    struct kvs_attn_meta m;
    int32_t qs[QF_MAX_SEQS + 1], pos[QF_MAX_SEQS];
};

static void qf_meta_make(const struct kvs_backend_ops *o, struct kvs_backend *be, const struct qf_case *c,
                         const int *rows, const int *end, struct qf_meta *qm)
{
    memset(qm, 0, sizeof *qm);
    qm->qs[0] = 0;
    int mx = 0;
    for (int s = 0; s < c->n_seqs; s++) {
        qm->qs[s + 1] = qm->qs[s] + rows[s];
        qm->pos[s] = end[s] - rows[s];
        if (end[s] > mx) mx = end[s];
    }
    struct kvs_attn_meta *m = &qm->m;
    m->n_seqs = c->n_seqs;
    m->max_blocks = c->max_blocks;
    m->q_start = o->alloc(be, KVS_BUF_I32, (size_t)c->n_seqs + 1);
    m->pos = o->alloc(be, KVS_BUF_I32, (size_t)c->n_seqs);
    m->block_tables = o->alloc(be, KVS_BUF_I32, (size_t)c->n_seqs * c->max_blocks);
    KVS_ASSERT(m->q_start && m->pos && m->block_tables);
    o->upload(be, m->q_start, 0, qm->qs, (size_t)c->n_seqs + 1);
    o->upload(be, m->pos, 0, qm->pos, (size_t)c->n_seqs);
    o->upload(be, m->block_tables, 0, c->bt, (size_t)c->n_seqs * c->max_blocks);
    m->h_q_start = qm->qs;
    m->h_pos = qm->pos;
    m->max_ctx = mx;
}

static void qf_meta_free(const struct kvs_backend_ops *o, struct kvs_backend *be, struct qf_meta *qm)
{
    o->free_buf(be, qm->m.q_start);
    o->free_buf(be, qm->m.pos);
    o->free_buf(be, qm->m.block_tables);
}

/* the spans a (row, KV head) may need: the largest keep of the case's rows, at most max_pages */
static int qf_max_spans(const struct qf_case *c, int max_pages)
{
    int m = 1;
    for (int s = 0; s < c->n_seqs; s++) {
        const int kp = c->keep[s] < max_pages ? c->keep[s] : max_pages;
        m = kp > m ? kp : m;
    }
    return m;
}

/* digest_update (bits 16) or qdigest_update (quant) of the writes of rows[s] rows ending at end[s] */
static void qf_refresh(const struct kvs_backend_ops *o, struct kvs_backend *be, const struct kvs_quest_kernels *k,
                       const struct qf_case *c, const int *rows, const int *end, const struct kvs_dbuf *kc, int quant,
                       int n_pages, struct kvs_dbuf *dig)
{
    struct qf_meta qm;
    qf_meta_make(o, be, c, rows, end, &qm);
    if (quant) k->qdigest_update(be, kc, &qm.m, c->nkv, c->hd, c->bs, c->ps, c->bits, (size_t)n_pages, dig);
    else k->digest_update(be, kc, &qm.m, c->nkv, c->hd, c->bs, c->ps, dig);
    qf_meta_free(o, be, &qm);
}

/* the selection's results to the host: scores [S][nkv][max_pages], n_spans [S][nkv], spans
 * [S][nkv][max_spans][2] (the caller frees them) */
static void qf_fetch_sel(const struct kvs_backend_ops *o, struct kvs_backend *be, int S, int nkv, int max_pages,
                         int max_spans, const struct kvs_dbuf *sc, const struct kvs_dbuf *ns, const struct kvs_dbuf *sp,
                         float **scores, int32_t **n_spans, int32_t **spans)
{
    *scores = kvs_xmalloc((size_t)S * nkv * max_pages * sizeof **scores);
    o->download(be, *scores, sc, 0, (size_t)S * nkv * max_pages);
    *n_spans = kvs_xmalloc((size_t)S * nkv * sizeof **n_spans);
    o->download(be, *n_spans, ns, 0, (size_t)S * nkv);
    *spans = kvs_xmalloc((size_t)S * nkv * max_spans * 2 * sizeof **spans);
    o->download(be, *spans, sp, 0, (size_t)S * nkv * max_spans * 2);
}

/* qf_run's selection: 0 score (or qscore) then select; 1 the table's score_select where it has
 * one (asking for the scores too), else as 0; 2 as 1 with the step's digest refresh passed to
 * score_select (the step then writes one row per sequence: the earlier prefill ends at ctx - 2);
 * 3 as 2 with the step's rows that lie in the current page (qf_win_rows: a Retro window, up to
 * step_rows of them) written by the refresh passed to score_select */
static int qf_fused;

/* the rows of sequence s's step that lie in its current page (at least 1) */
static int qf_win_rows(const struct qf_case *c, int s)
{
    const int in_page = (c->ctx[s] - 1) % c->ps + 1;
    return c->step_rows[s] < in_page ? c->step_rows[s] : in_page;
}

/* Runs digest_update (an earlier prefill of positions 0 .. ctx - step_rows - 1, then the step),
 * score, select and attention_spans of the case on backend o with kernels k. */
static void qf_run(const struct kvs_backend_ops *o, struct kvs_backend *be, const struct kvs_quest_kernels *k,
                   const struct qf_case *c, struct qf_out *r)
{
    const int S = c->n_seqs, nkv = c->nkv, hd = c->hd;
    memset(r, 0, sizeof *r);
    r->n_pages = c->n_blocks * (c->bs / c->ps);
    r->max_pages = c->max_blocks * (c->bs / c->ps);
    r->max_spans = qf_max_spans(c, r->max_pages);
    const size_t nk = (size_t)c->n_blocks * nkv * c->bs * hd, nd = (size_t)r->n_pages * nkv * 2 * hd;
    const int quant = c->bits == 8 || c->bits == 4;
    const size_t nq = quant ? kvs_quest_qdig_words((size_t)r->n_pages, nkv, hd, c->bits) : 0;
    struct kvs_dbuf *kc = o->alloc(be, KVS_BUF_KV, nk), *vc = o->alloc(be, KVS_BUF_KV, nk);
    struct kvs_dbuf *dig = quant ? o->alloc(be, KVS_BUF_I32, nq) : o->alloc(be, KVS_BUF_KV, nd);
    KVS_ASSERT(kc && vc && dig);
    o->upload(be, kc, 0, c->k, nk);
    o->upload(be, vc, 0, c->v, nk);
    /* stale garbage everywhere: only what digest_update writes may be read */
    if (quant) {
        int32_t *junk = kvs_xmalloc(nq * sizeof *junk);
        for (size_t i = 0; i < nq; i++) junk[i] = (int32_t)(0x5A5A5A5Au ^ (uint32_t)i);
        o->upload(be, dig, 0, junk, nq);
        free(junk);
    } else {
        float *junk = kvs_xmalloc(nd * sizeof *junk);
        for (size_t i = 0; i < nd; i++) junk[i] = (i & 1) ? 8192.0f : -8192.0f;   /* bf16-exact */
        o->upload(be, dig, 0, junk, nd);
        free(junk);
    }

    int rows[QF_MAX_SEQS] = {0}, end[QF_MAX_SEQS] = {0};
    struct qf_meta qm;
    const int fold = (qf_fused == 2 || qf_fused == 3) && k->score_select;
    for (int s = 0; s < S; s++) {
        const int step = !fold ? c->step_rows[s] : qf_fused == 3 ? qf_win_rows(c, s) : 1;
        rows[s] = c->ctx[s] - step, end[s] = c->ctx[s] - step;
    }
    qf_refresh(o, be, k, c, rows, end, kc, quant, r->n_pages, dig);
    for (int s = 0; s < S; s++) rows[s] = c->step_rows[s], end[s] = c->ctx[s];
    if (!fold) qf_refresh(o, be, k, c, rows, end, kc, quant, r->n_pages, dig);

    /* the decode query of each sequence */
    for (int s = 0; s < S; s++) rows[s] = 1;
    qf_meta_make(o, be, c, rows, end, &qm);
    struct kvs_dbuf *q = o->alloc(be, KVS_BUF_ACT, (size_t)S * c->nh * hd);
    struct kvs_dbuf *keep = o->alloc(be, KVS_BUF_I32, (size_t)S);
    struct kvs_dbuf *sc = o->alloc(be, KVS_BUF_F32, (size_t)S * nkv * r->max_pages);
    struct kvs_dbuf *ns = o->alloc(be, KVS_BUF_I32, (size_t)S * nkv);
    struct kvs_dbuf *sp = o->alloc(be, KVS_BUF_I32, (size_t)S * nkv * r->max_spans * 2);
    struct kvs_dbuf *out = o->alloc(be, KVS_BUF_ACT, (size_t)S * c->nh * hd);
    struct kvs_dbuf *lse = o->alloc(be, KVS_BUF_F32, (size_t)S * c->nh);
    KVS_ASSERT(q && keep && sc && ns && sp && out && lse);
    o->upload(be, q, 0, c->q, (size_t)S * c->nh * hd);
    int32_t hk[QF_MAX_SEQS];
    for (int s = 0; s < S; s++) {
        const int cur = (c->ctx[s] - 1) / c->ps;
        hk[s] = c->keep[s] > cur + 1 ? cur + 1 : c->keep[s];
    }
    o->upload(be, keep, 0, hk, (size_t)S);
    float *zero = kvs_xcalloc((size_t)S * nkv * r->max_pages, sizeof *zero);
    o->upload(be, sc, 0, zero, (size_t)S * nkv * r->max_pages);
    free(zero);
    struct qf_meta wq;   /* freed with qm, after the downloads */
    memset(&wq, 0, sizeof wq);
    if (qf_fused && k->score_select) {
        /* the refresh's meta: the step's rows of each sequence (one, or its window's in-page rows) */
        for (int s = 0; s < S; s++) rows[s] = qf_fused == 3 ? qf_win_rows(c, s) : 1;
        if (fold) qf_meta_make(o, be, c, rows, end, &wq);
        k->score_select(be, q, dig, &qm.m, keep, S, c->nh, nkv, hd, c->bs, c->ps, quant ? c->bits : 16,
                        (size_t)r->n_pages, r->max_pages, r->max_spans, sc, 1, ns, sp, fold ? kc : NULL,
                        fold ? &wq.m : NULL);
    } else {
        if (quant)
            k->qscore(be, q, dig, &qm.m, keep, S, c->nh, nkv, hd, c->bs, c->ps, c->bits, (size_t)r->n_pages,
                      r->max_pages, sc);
        else
            k->score(be, q, dig, &qm.m, keep, S, c->nh, nkv, hd, c->bs, c->ps, r->max_pages, sc);
        k->select(be, sc, &qm.m, keep, S, nkv, c->ps, r->max_pages, r->max_spans, ns, sp);
    }
    /* launch planning copies: one span holding at least the kept keys (as the policy does) */
    int32_t *hn = kvs_xmalloc((size_t)S * nkv * sizeof *hn);
    int32_t *hs = kvs_xcalloc((size_t)S * nkv * r->max_spans * 2, sizeof *hs);
    for (int s = 0; s < S; s++)
        for (int g = 0; g < nkv; g++) {
            hn[s * nkv + g] = 1;
            const int b = hk[s] * c->ps < c->ctx[s] ? hk[s] * c->ps : c->ctx[s];
            hs[((size_t)s * nkv + g) * r->max_spans * 2 + 1] = b;
        }
    const struct kvs_span_list sl = {r->max_spans, ns, sp, hn, hs};
    o->attention_spans(be, q, kc, vc, &qm.m, &sl, S, c->nh, nkv, hd, c->bs, 1.0f / sqrtf((float)hd), out, lse);

    if (quant) {
        r->nq = nq;
        r->qdig = kvs_xmalloc(nq * sizeof *r->qdig);
        o->download(be, (int32_t *)r->qdig, dig, 0, nq);
    } else {
        r->dig = kvs_xmalloc(nd * sizeof *r->dig);
        o->download(be, r->dig, dig, 0, nd);
    }
    qf_fetch_sel(o, be, S, nkv, r->max_pages, r->max_spans, sc, ns, sp, &r->scores, &r->n_spans, &r->spans);
    r->out = kvs_xmalloc((size_t)S * c->nh * hd * sizeof *r->out);
    o->download(be, r->out, out, 0, (size_t)S * c->nh * hd);
    r->lse = kvs_xmalloc((size_t)S * c->nh * sizeof *r->lse);
    o->download(be, r->lse, lse, 0, (size_t)S * c->nh);
    free(hn);
    free(hs);
    qf_meta_free(o, be, &qm);
    if (fold) qf_meta_free(o, be, &wq);
    struct kvs_dbuf *bufs[] = {kc, vc, dig, q, keep, sc, ns, sp, out, lse};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) o->free_buf(be, bufs[i]);
}

static void qf_out_free(struct qf_out *r)
{
    free(r->dig);
    free(r->qdig);
    free(r->scores);
    free(r->n_spans);
    free(r->spans);
    free(r->out);
    free(r->lse);
}

/* the kept pages of (s, g) as flags [max_pages] from the spans; -1 when the spans are malformed
 * (unsorted, overlapping, not page-aligned, or the last not ending at ctx) */
static int qf_kept_pages(const struct qf_case *c, const struct qf_out *r, int s, int g, unsigned char *kept)
{
    memset(kept, 0, (size_t)r->max_pages);
    const int n = r->n_spans[s * c->nkv + g];
    const int32_t *sp = r->spans + ((size_t)s * c->nkv + g) * r->max_spans * 2;
    if (n < 1 || n > r->max_spans) return -1;
    int prev = -1, count = 0;
    for (int i = 0; i < n; i++) {
        const int a = sp[2 * i], b = sp[2 * i + 1];
        if (a <= prev || a % c->ps || b <= a || b > c->ctx[s]) return -1;
        if (i < n - 1 ? b % c->ps != 0 : b != c->ctx[s]) return -1;
        for (int p = a / c->ps; p * c->ps < b; p++) kept[p] = 1, count++;
        prev = b;
    }
    return count;
}

/* ---- two-level (super-page) selection (kernels/kv_quest.h super_select) ---- */

/* super-pages a row with keep pages (the current one included) and cur candidates keeps, as the
 * policy sizes it (engine/kv/kv_decode_quest.c) */
static int qf_super_keep(int keep, int cur, int N, double factor)
{
    const int nsup = (cur + N - 1) / N;
    const double k = ceil(factor * (double)(keep - 1) / N) + 1;
    return k >= nsup ? nsup : (int)k;
}

struct qf_sout {
    float *sdig;                  /* [n_seqs (slot = row)][max_super][nkv][2][hd] */
    float *scores;                /* [n_seqs][nkv][max_pages]: the candidates' page scores */
    int32_t *n_spans, *spans;
    int max_pages, max_spans, max_super, skeep[QF_MAX_SEQS];
};

/* The case's digests as qf_run makes them (bits of c; one refresh of every written position),
 * then super_select with every super-page of every selecting row listed as a ref (row s in slot
 * n_seqs - 1 - s: reversed, so a slot mix-up shows), run twice: the second time with no refs,
 * reading the digests that the first made (what a later step does). */
static void qf_super_run(const struct kvs_backend_ops *o, struct kvs_backend *be, const struct kvs_quest_kernels *k,
                         const struct qf_case *c, int N, double factor, struct qf_sout *r)
{
    const int S = c->n_seqs, nkv = c->nkv, hd = c->hd, ppb = c->bs / c->ps, w = 2 + N;
    memset(r, 0, sizeof *r);
    const int n_pages = c->n_blocks * ppb;
    r->max_pages = c->max_blocks * ppb;
    r->max_super = (r->max_pages + N - 1) / N;
    r->max_spans = qf_max_spans(c, r->max_pages);
    const size_t nk = (size_t)c->n_blocks * nkv * c->bs * hd;
    const int quant = c->bits == 8 || c->bits == 4;
    const size_t nd = quant ? kvs_quest_qdig_words((size_t)n_pages, nkv, hd, c->bits) : (size_t)n_pages * nkv * 2 * hd;
    const size_t nsd = (size_t)S * r->max_super * nkv * 2 * hd;
    struct kvs_dbuf *kc = o->alloc(be, KVS_BUF_KV, nk), *dig = o->alloc(be, quant ? KVS_BUF_I32 : KVS_BUF_KV, nd);
    struct kvs_dbuf *sdig = o->alloc(be, KVS_BUF_F32, nsd);
    KVS_ASSERT(kc && dig && sdig);
    o->upload(be, kc, 0, c->k, nk);
    float *junk = kvs_xmalloc(nsd * sizeof *junk);
    for (size_t i = 0; i < nsd; i++) junk[i] = (i & 1) ? -4096.0f : 4096.0f;   /* only refs may fill it */
    o->upload(be, sdig, 0, junk, nsd);
    free(junk);
    int rows[QF_MAX_SEQS] = {0}, end[QF_MAX_SEQS] = {0};
    struct qf_meta qm;
    for (int s = 0; s < S; s++) rows[s] = end[s] = c->ctx[s];
    qf_refresh(o, be, k, c, rows, end, kc, quant, n_pages, dig);
    for (int s = 0; s < S; s++) rows[s] = 1;
    qf_meta_make(o, be, c, rows, end, &qm);
    int32_t hk[QF_MAX_SEQS], hrs[QF_MAX_SEQS], hrn[QF_MAX_SEQS];
    int32_t *hrefs = kvs_xcalloc((size_t)S * r->max_super * w, sizeof *hrefs);
    for (int s = 0; s < S; s++) {
        const int cur = (c->ctx[s] - 1) / c->ps, nsup = (cur + N - 1) / N;
        hk[s] = c->keep[s] > cur + 1 ? cur + 1 : c->keep[s];
        hrs[s] = S - 1 - s;
        r->skeep[s] = hk[s] > cur ? 0 : qf_super_keep(hk[s], cur, N, factor);
        hrn[s] = hk[s] > cur ? 0 : nsup;
        for (int j = 0; j < hrn[s]; j++) {
            int32_t *e = hrefs + ((size_t)s * r->max_super + j) * w;
            e[0] = j, e[1] = cur - j * N < N ? cur - j * N : N;
            for (int t = 0; t < e[1]; t++) {
                const int pg = j * N + t;
                e[2 + t] = c->bt[(size_t)s * c->max_blocks + pg / ppb] * ppb + pg % ppb;
            }
        }
    }
    struct kvs_dbuf *q = o->alloc(be, KVS_BUF_ACT, (size_t)S * c->nh * hd);
    struct kvs_dbuf *keep = o->alloc(be, KVS_BUF_I32, (size_t)S), *skeep = o->alloc(be, KVS_BUF_I32, (size_t)S);
    struct kvs_dbuf *rslot = o->alloc(be, KVS_BUF_I32, (size_t)S), *refn = o->alloc(be, KVS_BUF_I32, (size_t)S);
    struct kvs_dbuf *refs = o->alloc(be, KVS_BUF_I32, (size_t)S * r->max_super * w);
    struct kvs_dbuf *sc = o->alloc(be, KVS_BUF_F32, (size_t)S * nkv * r->max_pages);
    struct kvs_dbuf *ns = o->alloc(be, KVS_BUF_I32, (size_t)S * nkv);
    struct kvs_dbuf *sp = o->alloc(be, KVS_BUF_I32, (size_t)S * nkv * r->max_spans * 2);
    KVS_ASSERT(q && keep && skeep && rslot && refn && refs && sc && ns && sp);
    o->upload(be, q, 0, c->q, (size_t)S * c->nh * hd);
    o->upload(be, keep, 0, hk, (size_t)S);
    o->upload(be, skeep, 0, r->skeep, (size_t)S);
    o->upload(be, rslot, 0, hrs, (size_t)S);
    o->upload(be, refn, 0, hrn, (size_t)S);
    o->upload(be, refs, 0, hrefs, (size_t)S * r->max_super * w);
    {   /* NaN everywhere: the pages a backend scored are the ones it wrote */
        const size_t nsc = (size_t)S * nkv * r->max_pages;
        float *nan = kvs_xmalloc(nsc * sizeof *nan);
        for (size_t i = 0; i < nsc; i++) nan[i] = NAN;
        o->upload(be, sc, 0, nan, nsc);
        free(nan);
    }
    struct kvs_quest_super_args a = {
        .q = q, .dig = dig, .sdig = sdig, .m = &qm.m, .keep = keep, .skeep = skeep, .rslot = rslot, .refs = refs,
        .ref_n = refn, .n = S, .n_heads = c->nh, .n_kv_heads = nkv, .head_dim = hd, .block_size = c->bs,
        .page_size = c->ps, .bits = quant ? c->bits : 16, .n_pages = (size_t)n_pages, .max_pages = r->max_pages,
        .max_spans = r->max_spans, .super_pages = N, .max_super = r->max_super, .max_ref = r->max_super,
        .scores = sc, .n_spans = ns, .spans = sp};
    k->super_select(be, &a);
    memset(hrn, 0, sizeof hrn);
    o->upload(be, refn, 0, hrn, (size_t)S);
    k->super_select(be, &a);
    r->sdig = kvs_xmalloc(nsd * sizeof *r->sdig);
    o->download(be, r->sdig, sdig, 0, nsd);
    qf_fetch_sel(o, be, S, nkv, r->max_pages, r->max_spans, sc, ns, sp, &r->scores, &r->n_spans, &r->spans);
    free(hrefs);
    qf_meta_free(o, be, &qm);
    struct kvs_dbuf *bufs[] = {kc, dig, sdig, q, keep, skeep, rslot, refn, refs, sc, ns, sp};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) o->free_buf(be, bufs[i]);
}

static void qf_sout_free(struct qf_sout *r)
{
    free(r->sdig);
    free(r->scores);
    free(r->n_spans);
    free(r->spans);
}

/* 1 when (s, g)'s spans of a and b are the same (n_spans, then the spans) */
static int qf_same_spans(const struct qf_case *c, const int32_t *an, const int32_t *asp, int amax, const int32_t *bn,
                         const int32_t *bsp, int bmax, int s, int g)
{
    const int i = s * c->nkv + g;
    return an[i] == bn[i] && !memcmp(asp + (size_t)i * amax * 2, bsp + (size_t)i * bmax * 2, (size_t)an[i] * 2 * 4);
}

#endif
