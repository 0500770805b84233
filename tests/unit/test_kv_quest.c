/* test_kv_quest.c: kv.decode=quest (engine/kv/kv_decode_quest.c, kernels/kv_quest.h) on the CPU.
 *   1. kernels against plain references on random cases (kv_quest_fixture.h): digests equal the
 *      min/max of each page's keys after an earlier prefill and a step (prefill chunks crossing
 *      pages, decode tokens, partial pages), scores equal a double evaluation of the bound,
 *      the selection equals a brute-force ranking of the same scores (ties to the lower page),
 *      spans are sorted, merged and end at the row's context, planted needles are found, and
 *      the attention over the spans equals a double softmax over the kept positions;
 *   2. through the engine: budget >= context gives full attention's greedy tokens bitwise with
 *      every layer selecting (dense_layers 0); a small budget reads less and changes the
 *      outputs (the fidelity meter sees it); digests stay exact under prefix sharing, a pool
 *      small enough to preempt and block reuse (the policy's check, kv_decode_quest.h), and the
 *      check catches digests that are not refreshed (its negative control); prefix sharing
 *      gives the same tokens as no sharing; 500 requests with random cancellations end, give
 *      every block back and never see a stale digest. */
#include "base/util.h"
#include "engine/config.h"
#include "engine/engine.h"
#include "engine/kv/kv_decode_quest.h"
#include "models/model.h"
#include "tests/unit/kv_engine_run.h"
#include "tests/unit/kv_quest_fixture.h"

#include <stdio.h>

/* ---- 1. kernels ----------------------------------------------------------------------------- */

static void check_case(const struct qf_case *c, const struct qf_out *r, const char *what)
{
    const int nkv = c->nkv, hd = c->hd, G = c->nh / nkv;
    int bad_dig = 0, bad_sel = 0, bad_spans = 0, needles = 0, found = 0, sparse = 0;
    double score_err = 0, out_err = 0, lse_err = 0;
    unsigned char *kept = kvs_xmalloc((size_t)r->max_pages);
    for (int s = 0; s < c->n_seqs; s++) {
        const int ctx = c->ctx[s], cur = (ctx - 1) / c->ps;
        const int32_t *bt = c->bt + (size_t)s * c->max_blocks;
        for (int g = 0; g < nkv; g++) {
            /* digests of every page up to the current one */
            for (int pg = 0; pg <= cur; pg++) {
                const int p0 = pg * c->ps, p1 = p0 + c->ps < ctx ? p0 + c->ps : ctx;
                const size_t pp = (size_t)bt[p0 / c->bs] * (c->bs / c->ps) + (size_t)(p0 % c->bs) / c->ps;
                const float *dg = r->dig + (pp * nkv + g) * 2 * hd;
                for (int i = 0; i < hd; i++) {
                    float mn = INFINITY, mx = -INFINITY;
                    for (int p = p0; p < p1; p++) {
                        const float x = c->k[(((size_t)bt[p / c->bs] * nkv + g) * c->bs + p % c->bs) * hd + i];
                        mn = x < mn ? x : mn;
                        mx = x > mx ? x : mx;
                    }
                    bad_dig += dg[i] != mn || dg[hd + i] != mx;
                }
            }
            const int n = qf_kept_pages(c, r, s, g, kept);
            if (n < 0) {
                bad_spans++;
                continue;
            }
            const int top = c->keep[s] - 1;
            if (top >= cur) {   /* every page: one span [0, ctx) */
                bad_spans += r->n_spans[s * nkv + g] != 1 || n != cur + 1;
                continue;
            }
            sparse++;
            const float *sc = r->scores + ((size_t)s * nkv + g) * r->max_pages;
            for (int pg = 0; pg < cur; pg++) {
                /* the bound in double, from the keys' min/max */
                const size_t pp = (size_t)bt[pg * c->ps / c->bs] * (c->bs / c->ps) + (size_t)(pg * c->ps % c->bs) / c->ps;
                const float *dg = r->dig + (pp * nkv + g) * 2 * hd;
                double ref = 0, mag = 0;
                for (int h = g * G; h < (g + 1) * G; h++)
                    for (int i = 0; i < hd; i++) {
                        const double qi = c->q[((size_t)s * c->nh + h) * hd + i];
                        const double a = qi * dg[i], b = qi * dg[hd + i];
                        ref += a > b ? a : b;
                        mag += fabs(a) + fabs(b);
                    }
                const double e = fabs(sc[pg] - ref) / (mag > 0 ? mag : 1);
                if (e > score_err) score_err = e;
                /* brute-force rank of the same float scores: ahead of pg are higher scores and
                 * equal scores of lower pages */
                int ahead = 0;
                const uint32_t kp = kvs_quest_order_key(sc[pg]);
                for (int p2 = 0; p2 < cur; p2++) {
                    const uint32_t k2 = kvs_quest_order_key(sc[p2]);
                    ahead += k2 > kp || (k2 == kp && p2 < pg);
                }
                bad_sel += kept[pg] != (ahead < top);
            }
            int pages = 0;
            for (int pg = 0; pg <= cur; pg++) pages += kept[pg];
            bad_sel += pages != top + 1 || !kept[cur];
            for (int k = 0; k < QF_NEEDLES; k++)
                if (c->needle[s][g][k] >= 0 && top >= QF_NEEDLES) needles++, found += kept[c->needle[s][g][k]];
            /* attention over the kept positions, in double */
            for (int h = g * G; h < (g + 1) * G; h++) {
                const float *q = c->q + ((size_t)s * c->nh + h) * hd;
                double mxs = -INFINITY, l = 0, acc[256] = {0};
                for (int pass = 0; pass < 2; pass++)
                    for (int p = 0; p < ctx; p++) {
                        if (!kept[p / c->ps]) continue;
                        const size_t base = (((size_t)bt[p / c->bs] * nkv + g) * c->bs + p % c->bs) * hd;
                        double d = 0;
                        for (int i = 0; i < hd; i++) d += (double)q[i] * c->k[base + i];
                        d /= sqrt((double)hd);
                        if (pass == 0) {
                            if (d > mxs) mxs = d;
                            continue;
                        }
                        const double w = exp(d - mxs);
                        l += w;
                        for (int i = 0; i < hd; i++) acc[i] += w * c->v[base + i];
                    }
                const float *o = r->out + ((size_t)s * c->nh + h) * hd;
                for (int i = 0; i < hd; i++) {
                    const double e = fabs(o[i] - acc[i] / l);
                    if (e > out_err) out_err = e;
                }
                const double e = fabs(r->lse[s * c->nh + h] - (mxs + log(l)));
                if (e > lse_err) lse_err = e;
            }
        }
    }
    free(kept);
    CHECK(bad_dig == 0, "%s: %d digest entries differ from the pages' min/max", what, bad_dig);
    CHECK(bad_spans == 0, "%s: %d malformed span lists", what, bad_spans);
    CHECK(bad_sel == 0, "%s: %d selection errors against the brute-force ranking", what, bad_sel);
    CHECK(score_err < 1e-5, "%s: score error %g", what, score_err);
    CHECK(out_err < 1e-4 && lse_err < 1e-4, "%s: attention over the spans: out error %g, lse error %g", what, out_err,
          lse_err);
    CHECK(found == needles, "%s: %d of %d planted needles kept", what, found, needles);
    printf("ok %s: digests exact, %d sparse (row, head) selections equal to brute force, %d/%d needles, score err "
           "%.1e, attention err %.1e\n",
           what, sparse, found, needles, score_err, out_err);
}

/* The kernel tests' fixture: the CPU backend (2 threads) and its Quest kernels (freed with
 * kvs_cpu_backend.free) */
static struct kvs_backend *cpu_quest(const struct kvs_quest_kernels **k)
{
    char err[256];
    struct kvs_backend *be = kvs_cpu_backend.create(2, err, sizeof err);
    REQUIRE(be, "%s", err);
    *k = kvs_quest_kernels_for(&kvs_cpu_backend, err, sizeof err);
    REQUIRE(*k, "%s", err);
    return be;
}

static void test_kernels(void)
{
    const struct kvs_backend_ops *o = &kvs_cpu_backend;
    const struct kvs_quest_kernels *k;
    struct kvs_backend *be = cpu_quest(&k);
    static const struct {
        int S, nh, nkv, hd, bs, ps, lo, hi;
        double ratio;
        int min_budget, needles;
        const char *what;
    } CASES[] = {
        {6, 8, 2, 32, 16, 16, 340, 700, 0.15, 32, 1, "GQA 4, pages = blocks of 16, needles"},
        {5, 4, 4, 16, 16, 8, 20, 400, 0.2, 16, 1, "MHA, pages of 8 in blocks of 16, needles"},
        {4, 16, 2, 64, 32, 16, 300, 1200, 0.1, 64, 1, "GQA 8, head_dim 64, blocks of 32"},
        {7, 8, 2, 32, 16, 16, 1, 90, 0.15, 48, 0, "short contexts (some keep every page)"},
        {3, 8, 2, 32, 16, 16, 100, 300, 0, 0, 0, "every page (one span)"},
    };
    for (size_t i = 0; i < sizeof CASES / sizeof CASES[0]; i++) {
        struct qf_case c;
        struct qf_out r;
        qf_make(&c, 77 + i, CASES[i].S, CASES[i].nh, CASES[i].nkv, CASES[i].hd, CASES[i].bs, CASES[i].ps, CASES[i].lo,
                CASES[i].hi, CASES[i].ratio, CASES[i].min_budget, CASES[i].needles);
        qf_run(o, be, k, &c, &r);
        check_case(&c, &r, CASES[i].what);
        qf_out_free(&r);
        qf_free(&c);
    }
    /* ties: every score equal (all-zero queries) keeps the lowest pages */
    struct qf_case c;
    struct qf_out r;
    qf_make(&c, 5, 2, 4, 2, 16, 16, 16, 200, 300, 0.1, 32, 0);
    memset(c.q, 0, (size_t)c.n_seqs * c.nh * c.hd * sizeof *c.q);
    qf_run(o, be, k, &c, &r);
    unsigned char kept[64];
    int ok = 1;
    for (int s = 0; s < c.n_seqs; s++) {
        const int cur = (c.ctx[s] - 1) / c.ps;
        for (int g = 0; g < c.nkv; g++) {
            ok &= qf_kept_pages(&c, &r, s, g, kept) == c.keep[s] && kept[cur];
            for (int pg = 0; pg < cur; pg++) ok &= kept[pg] == (pg < c.keep[s] - 1);
        }
    }
    CHECK(ok, "equal scores: the lowest pages are kept");
    printf("ok equal scores keep the lowest pages\n");
    qf_out_free(&r);
    qf_free(&c);
    o->free(be);
}

/* ---- 1c. two-level (super-page) selection (kernels/kv_quest.h super_select) ------------------ */

static float super_bound(const float *qr, int g, int G, int hd, const float *mn, const float *mx)
{
    if (mn[0] == -INFINITY && mx[0] == INFINITY) return INFINITY;
    float sc = 0.0f;   /* the contract's order: heads, then dimensions, fp32 */
    for (int h = g * G; h < (g + 1) * G; h++) {
        float hs = 0.0f;
        for (int i = 0; i < hd; i++) {
            const float a = qr[(size_t)h * hd + i] * mn[i], b = qr[(size_t)h * hd + i] * mx[i];
            hs += a > b ? a : b;
        }
        sc += hs;
    }
    return sc;
}

/* a page digest of r (bf16 floats or decoded codes) as values; 0 when unbounded */
static int page_values(const struct qf_case *c, const struct qf_out *r, size_t pp, int g, float *mn, float *mx)
{
    const int nkv = c->nkv, hd = c->hd;
    if (!r->qdig) {
        memcpy(mn, r->dig + (pp * nkv + g) * 2 * hd, (size_t)hd * 4);
        memcpy(mx, r->dig + (pp * nkv + g) * 2 * hd + hd, (size_t)hd * 4);
        return 1;
    }
    const size_t vw = kvs_quest_qdig_vec_words(hd, c->bits);
    const uint32_t par = r->qdig[(size_t)r->n_pages * nkv * 2 * vw + pp * nkv + g], mask = (1u << c->bits) - 1;
    if (par == KVS_QD_UNBOUNDED) return 0;
    const float l = kvs_qd_f16_to_f32(par & 0xFFFFu), sc = kvs_qd_f16_to_f32(par >> 16);
    const uint32_t *cm = r->qdig + (pp * nkv + g) * 2 * vw;
    const int per = 32 / c->bits;
    for (int i = 0; i < hd; i++) {
        mn[i] = kvs_qd_value(cm[i / per] >> (i % per * c->bits) & mask, l, sc);
        mx[i] = kvs_qd_value(cm[vw + i / per] >> (i % per * c->bits) & mask, l, sc);
    }
    return 1;
}

static int okey_before(uint32_t ka, int ia, uint32_t kb, int ib) { return ka > kb || (ka == kb && ia < ib); }

/* Every super-page kept: the spans equal select's bitwise. Super_keep 1: the super digests equal
 * the union of the page digests bitwise; the kept pages equal a brute-force two-level ranking
 * (super scores in the contract's order from those digests, the last super-page and the top
 * skeep - 1 of the others with ties to the lower index, then the top keep - 1 candidate pages by the exact path's own page scores, which the
 * super path's candidate scores equal bitwise); fewer page digests are read. */
static void test_super(void)
{
    const struct kvs_backend_ops *o = &kvs_cpu_backend;
    const struct kvs_quest_kernels *k;
    struct kvs_backend *be = cpu_quest(&k);
    static const struct {
        int S, nh, nkv, hd, bs, ps, lo, hi;
        double ratio;
        int min_budget, needles, N, bits;
    } CASES[] = {
        {6, 8, 2, 32, 16, 16, 340, 700, 0.15, 32, 1, 4, 16}, {6, 8, 2, 32, 16, 16, 340, 700, 0.15, 32, 1, 4, 8},
        {5, 4, 4, 16, 16, 8, 20, 400, 0.2, 16, 1, 3, 8},     {4, 16, 2, 64, 32, 16, 300, 1200, 0.1, 64, 1, 8, 8},
        {7, 8, 2, 32, 16, 16, 1, 90, 0.15, 48, 0, 2, 16},    {4, 16, 2, 64, 32, 16, 300, 1200, 0.1, 64, 1, 5, 4},
    };
    int bad_exact = 0, bad_sd = 0, bad_sel = 0, bad_sc = 0, rows = 0, sparse = 0;
    double read = 0, all = 0;
    for (size_t ci = 0; ci < sizeof CASES / sizeof CASES[0]; ci++) {
        struct qf_case c;
        struct qf_out r;
        struct qf_sout ex, ap;
        qf_make(&c, 377 + ci, CASES[ci].S, CASES[ci].nh, CASES[ci].nkv, CASES[ci].hd, CASES[ci].bs, CASES[ci].ps,
                CASES[ci].lo, CASES[ci].hi, CASES[ci].ratio, CASES[ci].min_budget, CASES[ci].needles);
        c.bits = CASES[ci].bits;
        const int N = CASES[ci].N, nkv = c.nkv, hd = c.hd, G = c.nh / nkv, ppb = c.bs / c.ps;
        qf_run(o, be, k, &c, &r);
        qf_super_run(o, be, k, &c, N, 1e9, &ex);
        qf_super_run(o, be, k, &c, N, 1.0, &ap);
        struct qf_out av = r;
        av.n_spans = ap.n_spans, av.spans = ap.spans, av.max_spans = ap.max_spans;
        unsigned char *got = kvs_xmalloc((size_t)r.max_pages), *want = kvs_xcalloc((size_t)r.max_pages + 1, 1);
        float *mn = kvs_xmalloc(4 * (size_t)hd * sizeof *mn), *mx = mn + hd, *umn = mx + hd, *umx = umn + hd;
        uint32_t *key = kvs_xmalloc((size_t)r.max_pages * sizeof *key);
        int *idx = kvs_xmalloc((size_t)r.max_pages * sizeof *idx);
        for (int s = 0; s < c.n_seqs; s++) {
            const int cur = (c.ctx[s] - 1) / c.ps, nsup = (cur + N - 1) / N, top = c.keep[s] - 1;
            const int32_t *bt = c.bt + (size_t)s * c.max_blocks;
            for (int g = 0; g < nkv; g++) {
                rows++;
                bad_exact += !qf_same_spans(&c, ex.n_spans, ex.spans, ex.max_spans, r.n_spans, r.spans, r.max_spans, s, g);
                if (top >= cur) {
                    bad_sel += !qf_same_spans(&c, ap.n_spans, ap.spans, ap.max_spans, r.n_spans, r.spans, r.max_spans, s, g);
                    continue;
                }
                sparse++;
                /* super digests: the union of the page digests, slot n_seqs - 1 - s */
                for (int j = 0; j < nsup; j++) {
                    int unb = 0;
                    for (int t = 0; t < N && j * N + t < cur; t++) {
                        const int pg = j * N + t;
                        unb |= !page_values(&c, &r, (size_t)bt[pg / ppb] * ppb + pg % ppb, g, mn, mx);
                        for (int i = 0; i < hd; i++) {
                            umn[i] = t == 0 || mn[i] < umn[i] ? mn[i] : umn[i];
                            umx[i] = t == 0 || mx[i] > umx[i] ? mx[i] : umx[i];
                        }
                    }
                    if (unb)
                        for (int i = 0; i < hd; i++) umn[i] = -INFINITY, umx[i] = INFINITY;
                    const float *sd = ap.sdig + ((((size_t)(c.n_seqs - 1 - s)) * ap.max_super + j) * nkv + g) * 2 * hd;
                    bad_sd += memcmp(sd, umn, (size_t)hd * 4) || memcmp(sd + hd, umx, (size_t)hd * 4);
                    key[j] = kvs_quest_order_key(super_bound(c.q + (size_t)s * c.nh * hd, g, G, hd, sd, sd + hd));
                }
                /* the top skeep super-pages, then the top candidates */
                unsigned char *ks = kvs_xcalloc((size_t)nsup, 1);
                for (int j = 0; j < nsup - 1; j++) {   /* the last one always, the top skeep - 1 of the rest */
                    int ahead = 0;
                    for (int x = 0; x < nsup - 1; x++) ahead += okey_before(key[x], x, key[j], j);
                    ks[j] = ahead < ap.skeep[s] - 1;
                }
                ks[nsup - 1] = ap.skeep[s] > 0;
                const float *rs = r.scores + ((size_t)s * nkv + g) * r.max_pages;
                const float *as = ap.scores + ((size_t)s * nkv + g) * ap.max_pages;
                int nc = 0;
                for (int pg = 0; pg < cur; pg++)
                    if (ks[pg / N]) {
                        bad_sc += memcmp(&rs[pg], &as[pg], 4) != 0;
                        key[nc] = kvs_quest_order_key(rs[pg]), idx[nc++] = pg;
                    }
                read += nsup + nc, all += cur;
                memset(want, 0, (size_t)r.max_pages + 1);
                for (int a = 0; a < nc; a++) {
                    int ahead = 0;
                    for (int b = 0; b < nc; b++) ahead += okey_before(key[b], idx[b], key[a], idx[a]);
                    want[idx[a]] = ahead < top;
                }
                want[cur] = 1;
                const int n = qf_kept_pages(&c, &av, s, g, got);
                bad_sel += n < 0 || memcmp(got, want, (size_t)cur + 1) != 0 || nc < top;
                free(ks);
            }
        }
        free(got);
        free(want);
        free(mn);
        free(key);
        free(idx);
        qf_sout_free(&ex);
        qf_sout_free(&ap);
        qf_out_free(&r);
        qf_free(&c);
    }
    CHECK(bad_exact == 0, "super-pages, every one kept: %d of %d (row, KV head) selections differ from select's",
          bad_exact, rows);
    CHECK(bad_sd == 0 && bad_sc == 0 && bad_sel == 0 && sparse > 0 && read < 0.9 * all,
          "super-pages at super_keep 1: %d super digests differ from the union, %d candidate scores differ, %d of %d "
          "selections differ from the brute-force two-level ranking; %g of %g digests read",
          bad_sd, bad_sc, bad_sel, sparse, read, all);
    printf("ok two-level selection: every super-page kept = select's spans (%d rows); at super_keep 1 the brute-force "
           "ranking (%d sparse rows), %.0f%% of the page digests read\n", rows, sparse, 100.0 * read / all);
    o->free(be);
}

/* ---- 1b. quantized digests (kv.quest.digest_bits 8 / 4) -------------------------------------- */

/* the shared coding functions: fp16 rounding toward -inf / +inf against double, and the grid's
 * bound on edge cases (one value, zeros, a single huge key, subnormal ranges) */
static void test_qd_coding(void)
{
    uint64_t r = 0xD16E57ull;
    int bad = 0;
    for (int t = 0; t < 200000; t++) {
        const int e = (int)(kvs_test_xorshift(&r) % 50) - 30;
        const float x = ldexpf(qf_rand(&r), e) * (t % 1000 == 0 ? 1e6f : 1.0f);
        const float d = kvs_qd_f16_to_f32(kvs_qd_f16_down(x)), u = kvs_qd_f16_to_f32(kvs_qd_f16_up(x));
        /* the result bounds x, and no fp16 lies strictly between (its neighbour crosses x) */
        bad += !(d <= x && u >= x);
        if (fabsf(x) <= 65504.0f) {
            const uint32_t hd = kvs_qd_f16_down(x), hu = kvs_qd_f16_up(x);
            bad += d != x && kvs_qd_f16_to_f32(hd < 0x8000u ? hd + 1 : hd - 1) <= x && hd != 0x8000u;
            bad += u != x && kvs_qd_f16_to_f32(hu >= 0x8000u ? hu + 1 : hu - 1) >= x && hu != 0u;
        }
    }
    CHECK(bad == 0, "fp16 directed rounding: %d errors", bad);
    /* grids: every value of a vector bounded by its codes' values */
    static const float edge[][4] = {
        {0.5f, 0.5f, 0.5f, 0.5f}, {0.0f, -0.0f, 0.0f, 0.0f}, {-3.0f, 7.25f, 1e-6f, -1e-6f},
        {1e-7f, 2e-7f, 3e-7f, 1e-7f}, {65000.0f, -65000.0f, 1.0f, 2.0f}, {-1.5f, -1.25f, -1.0f, -1.75f},
    };
    int bad_grid = 0;
    for (int bits = 4; bits <= 8; bits += 4)
        for (int t = 0; t < 2000 + (int)(sizeof edge / sizeof edge[0]); t++) {
            float mn[8], mx[8];
            uint32_t cmin[2], cmax[2];
            for (int i = 0; i < 8; i++) {
                float a, b;
                if (t < (int)(sizeof edge / sizeof edge[0])) a = edge[t][i % 4], b = edge[t][(i + 1) % 4];
                else a = ldexpf(qf_rand(&r), (int)(kvs_test_xorshift(&r) % 20) - 10), b = a + fabsf(qf_rand(&r)) * ldexpf(1, t % 7 - 3);
                mn[i] = a < b ? a : b, mx[i] = a < b ? b : a;
            }
            const uint32_t par = kvs_qd_encode(mn, mx, 8, bits, cmin, cmax);
            bad_grid += par == KVS_QD_UNBOUNDED;
            const float l = kvs_qd_f16_to_f32(par & 0xFFFFu), sc = kvs_qd_f16_to_f32(par >> 16);
            const int per = 32 / bits;
            for (int i = 0; i < 8; i++) {
                const uint32_t a = cmin[i / per] >> (i % per * bits) & ((1u << bits) - 1);
                const uint32_t b = cmax[i / per] >> (i % per * bits) & ((1u << bits) - 1);
                bad_grid += !(kvs_qd_value(a, l, sc) <= mn[i] && kvs_qd_value(b, l, sc) >= mx[i]);
            }
        }
    CHECK(bad_grid == 0, "quantized digest grids: %d bound violations", bad_grid);
    /* beyond fp16's range: the page is unbounded (scores +inf) */
    float big_mn[8] = {0}, big_mx[8] = {0};
    big_mx[3] = 1e5f;
    uint32_t w[2], w2[2];
    CHECK(kvs_qd_encode(big_mn, big_mx, 8, 4, w, w2) == KVS_QD_UNBOUNDED, "a key of 1e5 gave a bounded grid");
    printf("ok quantized digest coding: fp16 rounding down / up, grids bound every value (4 and 8 bits)\n");
}

/* quantized against bf16 digests on the same cases: every decoded min / max bounds the page's
 * keys, the codes are the encoding of the pages' exact min / max, each quantized score is >= the
 * exact digest's score in fp32 (same order) and equals a double evaluation over the decoded
 * values; the selection is the brute-force ranking of the quantized scores; needles are found */
static void test_quantized_kernels(void)
{
    const struct kvs_backend_ops *o = &kvs_cpu_backend;
    const struct kvs_quest_kernels *k;
    struct kvs_backend *be = cpu_quest(&k);
    static const struct {
        int S, nh, nkv, hd, bs, ps, lo, hi;
        double ratio;
        int min_budget, needles, bits;
    } CASES[] = {
        {6, 8, 2, 32, 16, 16, 340, 700, 0.15, 32, 1, 4}, {6, 8, 2, 32, 16, 16, 340, 700, 0.15, 32, 1, 8},
        {5, 4, 4, 16, 16, 8, 20, 400, 0.2, 16, 1, 8},    {4, 16, 2, 64, 32, 16, 300, 1200, 0.1, 64, 1, 4},
        {7, 8, 2, 32, 16, 16, 1, 90, 0.15, 48, 0, 4},     {3, 8, 2, 32, 16, 16, 100, 300, 0, 0, 0, 4},
    };
    for (size_t ci = 0; ci < sizeof CASES / sizeof CASES[0]; ci++) {
        struct qf_case c;
        struct qf_out r16, rq;
        qf_make(&c, 177 + ci, CASES[ci].S, CASES[ci].nh, CASES[ci].nkv, CASES[ci].hd, CASES[ci].bs, CASES[ci].ps,
                CASES[ci].lo, CASES[ci].hi, CASES[ci].ratio, CASES[ci].min_budget, CASES[ci].needles);
        qf_run(o, be, k, &c, &r16);
        c.bits = CASES[ci].bits;
        qf_run(o, be, k, &c, &rq);
        const int nkv = c.nkv, hd = c.hd, G = c.nh / nkv, bits = c.bits, per = 32 / bits;
        const size_t vw = kvs_quest_qdig_vec_words(hd, bits);
        const uint32_t *params = rq.qdig + (size_t)rq.n_pages * nkv * 2 * vw;
        int bad_bound = 0, bad_code = 0, below = 0, bad_sel = 0, bad_spans = 0, needles = 0, found = 0, sparse = 0;
        double score_err = 0, loose = 0;
        int n_loose = 0;
        unsigned char *kept = kvs_xmalloc((size_t)rq.max_pages);
        float *mn = kvs_xmalloc(2 * (size_t)hd * sizeof *mn), *mx = mn + hd, *dmn = kvs_xmalloc(2 * (size_t)hd * sizeof *dmn), *dmx = dmn + hd;
        uint32_t *want = kvs_xmalloc(2 * vw * sizeof *want);
        for (int s = 0; s < c.n_seqs; s++) {
            const int ctx = c.ctx[s], cur = (ctx - 1) / c.ps;
            const int32_t *bt = c.bt + (size_t)s * c.max_blocks;
            for (int g = 0; g < nkv; g++) {
                for (int pg = 0; pg <= cur; pg++) {
                    const int p0 = pg * c.ps, p1 = p0 + c.ps < ctx ? p0 + c.ps : ctx;
                    const size_t pp = (size_t)bt[p0 / c.bs] * (c.bs / c.ps) + (size_t)(p0 % c.bs) / c.ps;
                    for (int i = 0; i < hd; i++) {
                        mn[i] = INFINITY, mx[i] = -INFINITY;
                        for (int p = p0; p < p1; p++) {
                            const float x = c.k[(((size_t)bt[p / c.bs] * nkv + g) * c.bs + p % c.bs) * hd + i];
                            mn[i] = x < mn[i] ? x : mn[i];
                            mx[i] = x > mx[i] ? x : mx[i];
                        }
                    }
                    const uint32_t par = params[pp * nkv + g];
                    const uint32_t *cw = rq.qdig + (pp * nkv + g) * 2 * vw;
                    const uint32_t wp = kvs_qd_encode(mn, mx, hd, bits, want, want + vw);
                    bad_code += wp != par || memcmp(want, cw, 2 * vw * sizeof *want);
                    const float l = kvs_qd_f16_to_f32(par & 0xFFFFu), sc = kvs_qd_f16_to_f32(par >> 16);
                    for (int i = 0; i < hd; i++) {
                        dmn[i] = kvs_qd_value(cw[i / per] >> (i % per * bits) & ((1u << bits) - 1), l, sc);
                        dmx[i] = kvs_qd_value(cw[vw + i / per] >> (i % per * bits) & ((1u << bits) - 1), l, sc);
                        bad_bound += !(dmn[i] <= mn[i] && dmx[i] >= mx[i]);
                    }
                    if (pg == cur || c.keep[s] - 1 >= cur) continue;
                    const float s16 = r16.scores[((size_t)s * nkv + g) * r16.max_pages + pg];
                    const float sq = rq.scores[((size_t)s * nkv + g) * rq.max_pages + pg];
                    below += !(sq >= s16);
                    double ref = 0, mag = 0;
                    for (int h = g * G; h < (g + 1) * G; h++)
                        for (int i = 0; i < hd; i++) {
                            const double qi = c.q[((size_t)s * c.nh + h) * hd + i];
                            const double a = qi * dmn[i], b = qi * dmx[i];
                            ref += a > b ? a : b;
                            mag += fabs(a) + fabs(b);
                        }
                    const double e = fabs(sq - ref) / (mag > 0 ? mag : 1);
                    score_err = e > score_err ? e : score_err;
                    loose += (sq - s16) / (mag > 0 ? mag : 1), n_loose++;
                }
                const int n = qf_kept_pages(&c, &rq, s, g, kept);
                if (n < 0) {
                    bad_spans++;
                    continue;
                }
                const int top = c.keep[s] - 1;
                if (top >= cur) {
                    bad_spans += rq.n_spans[s * nkv + g] != 1 || n != cur + 1;
                    continue;
                }
                sparse++;
                const float *scq = rq.scores + ((size_t)s * nkv + g) * rq.max_pages;
                for (int pg = 0; pg < cur; pg++) {
                    int ahead = 0;
                    const uint32_t kp = kvs_quest_order_key(scq[pg]);
                    for (int p2 = 0; p2 < cur; p2++) {
                        const uint32_t k2 = kvs_quest_order_key(scq[p2]);
                        ahead += k2 > kp || (k2 == kp && p2 < pg);
                    }
                    bad_sel += kept[pg] != (ahead < top);
                }
                bad_sel += n != top + 1 || !kept[cur];
                for (int kk = 0; kk < QF_NEEDLES; kk++)
                    if (c.needle[s][g][kk] >= 0 && top >= QF_NEEDLES) needles++, found += kept[c.needle[s][g][kk]];
            }
        }
        CHECK(bad_bound == 0 && bad_code == 0, "%d bits case %zu: %d decoded values outside the keys' min/max, %d "
              "(page, head) codes differ from the encoding", bits, ci, bad_bound, bad_code);
        CHECK(below == 0, "%d bits case %zu: %d quantized scores below the exact digest's", bits, ci, below);
        CHECK(score_err < 1e-5, "%d bits case %zu: score error %g", bits, ci, score_err);
        CHECK(bad_sel == 0 && bad_spans == 0, "%d bits case %zu: %d selection errors, %d malformed span lists", bits,
              ci, bad_sel, bad_spans);
        CHECK(found == needles, "%d bits case %zu: %d of %d needles kept", bits, ci, found, needles);
        printf("ok %d-bit digests, case %zu: bounds and codes exact, scores >= exact digest's (mean looseness %.3g of "
               "the terms' size), %d sparse selections = brute force, %d/%d needles\n",
               bits, ci, n_loose ? loose / n_loose : 0.0, sparse, found, needles);
        free(kept);
        free(mn);
        free(dmn);
        free(want);
        qf_out_free(&r16);
        qf_out_free(&rq);
        qf_free(&c);
    }
    o->free(be);
}

/* ---- 2. through the engine ------------------------------------------------------------------- */

#define NJ 6
#define GEN 20
#define MAXP 240

struct job {
    int32_t prompt[MAXP];
    int n_prompt;
    int32_t got[GEN];
    int n_got;
};

static struct kvs_model *model;

static void set_str(char **f, const char *v)
{
    free(*f);
    *f = kvs_xstrdup(v);
}

static void base_cfg(struct kvs_config *c, const char *reuse, const char *decode)
{
    kvs_config_init(c);
    set_str(&c->device, "cpu");
    set_str(&c->kv_reuse, reuse);
    set_str(&c->kv_decode, decode);
    c->cpu_threads = 2;
    c->kv_block_size = 16;
    c->kv_memory_bytes = 8 << 20;
    c->max_batch_tokens = 256;
    c->max_running = 4;
    c->max_waiting = 64;
    c->max_model_len = 512;
    c->quest_dense_layers = 0;
}

/* prompts of 120-230 tokens; pairs share their first 96 tokens (prefix sharing) */
static void make_jobs(struct job *jobs)
{
    uint64_t rng = 0x51ED2701ull;
    for (int i = 0; i < NJ; i++) {
        struct job *j = &jobs[i];
        memset(j, 0, sizeof *j);
        j->n_prompt = 120 + (int)(kvs_test_xorshift(&rng) % 110);
        uint64_t shared = 900 + (uint64_t)(i / 2);
        for (int t = 0; t < j->n_prompt; t++)
            j->prompt[t] = 1 + (int32_t)(kvs_test_xorshift(t < 96 ? &shared : &rng) % 1000);
    }
}

static int run(const struct kvs_config *cfg, struct job *jobs, struct kvs_engine_stats *st, char *err, size_t errlen)
{
    struct kvs_test_job tj[NJ];
    for (int i = 0; i < NJ; i++)
        tj[i] = (struct kvs_test_job){jobs[i].prompt, jobs[i].n_prompt, NULL, 0, jobs[i].got, 0, KVS_FINISH_NONE};
    int rc = kvs_test_engine_run(cfg, model, tj, NJ, GEN, st, err, errlen);
    for (int i = 0; i < NJ; i++) {
        jobs[i].n_got = tj[i].n_got;
    }
    return rc;
}

static int same_tokens(const struct job *a, const struct job *b)
{
    for (int i = 0; i < NJ; i++)
        if (a[i].n_got != GEN || b[i].n_got != GEN || memcmp(a[i].got, b[i].got, sizeof a[i].got)) return 0;
    return 1;
}

static void test_engine(void)
{
    static struct job ref[NJ], got[NJ], shared[NJ];
    char err[256];
    struct kvs_engine_stats st;
    struct kvs_config c;
    make_jobs(ref);
    memcpy(got, ref, sizeof got);
    memcpy(shared, ref, sizeof shared);
    base_cfg(&c, "none", "full");
    REQUIRE(run(&c, ref, &st, err, sizeof err) == 0, "%s", err);
    kvs_config_free(&c);

    /* budget >= context: every page, every layer through the spans */
    base_cfg(&c, "none", "quest");
    c.quest_budget_ratio = 1.0;
    c.quest_min_budget = 0;
    REQUIRE(run(&c, got, &st, err, sizeof err) == 0, "%s", err);
    kvs_config_free(&c);
    CHECK(same_tokens(ref, got), "quest with budget >= context: greedy tokens differ from full attention");
    printf("ok quest with budget >= context (all layers selecting): %d x %d greedy tokens equal to full\n", NJ, GEN);
    for (int bits = 8; bits >= 4; bits -= 4) {
        base_cfg(&c, "none", "quest");
        c.quest_budget_ratio = 1.0;
        c.quest_min_budget = 0;
        c.quest_digest_bits = bits;
        REQUIRE(run(&c, got, &st, err, sizeof err) == 0, "%s", err);
        kvs_config_free(&c);
        CHECK(same_tokens(ref, got), "quest, %d-bit digests, budget >= context: tokens differ from full", bits);
        printf("ok quest with %d-bit digests at budget >= context: %d x %d greedy tokens equal to full\n", bits, NJ,
               GEN);
    }

    /* a small budget: fewer bytes, other outputs, exact digests under sharing and preemption */
    base_cfg(&c, "prefix", "quest");
    c.quest_budget_ratio = 0.15;
    c.quest_min_budget = 32;
    c.kv_memory_bytes = 18 * 8192;   /* 24 blocks of 8 KiB for 4 running requests of 9-16 blocks: preemption */
    c.kv_fidelity_sample_every = 1;
    kvs_quest_set_check(1);
    REQUIRE(run(&c, got, &st, err, sizeof err) == 0, "%s", err);
    kvs_quest_set_check(0);
    const double rows = kvs_engine_kv_counter(&st, "kvserve:kv_quest_sparse_rows_total");
    const double stale = kvs_engine_kv_counter(&st, "kvserve:kv_quest_stale_digests_total");
    const double rd = kvs_engine_kv_counter(&st, "kvserve:kv_decode_bytes_read_total");
    const double full = kvs_engine_kv_counter(&st, "kvserve:kv_decode_bytes_full_total");
    const double kept = kvs_engine_kv_counter(&st, "kvserve:kv_quest_pages_kept_total");
    const double pages = kvs_engine_kv_counter(&st, "kvserve:kv_quest_pages_total");
    const double l2 = kvs_engine_kv_counter(&st, "kvserve:kv_fidelity_rel_l2_sum") / kvs_engine_kv_counter(&st, "kvserve:kv_fidelity_rel_l2_count");
    CHECK(rows >= NJ * (GEN - 1) / 2 && stale == 0 && rd < 0.7 * full && kept < 0.5 * pages && l2 > 1e-4,
          "sparse: %g rows, %g stale pages, read %g of %g bytes, %g of %g pages, mean rel-L2 %g", rows, stale, rd, full,
          kept, pages, l2);
    CHECK(st.num_preemptions > 0, "the small pool preempted nothing");
    printf("ok quest at 15%% (min 32): %g sparse rows, KV read %.1f%% of full, pages kept %.1f%%, mean rel-L2 %.3g, "
           "%llu preemptions, 0 stale digests\n",
           rows, 100 * rd / full, 100 * kept / pages, l2, (unsigned long long)st.num_preemptions);
    /* mixed steps (prompts recomputed after preemption next to sparse decodes): the dense pass
     * skips the lead decode rows (attention meta skip_lead) and the tokens are those of a run
     * without the hint */
    {
        static struct job nohint[NJ];
        memcpy(nohint, ref, sizeof nohint);
        const double skipped = kvs_engine_kv_counter(&st, "kvserve:kv_quest_dense_skipped_rows_total");
        kvs_quest_set_skip_hint(0);
        REQUIRE(run(&c, nohint, &st, err, sizeof err) == 0, "%s", err);
        kvs_quest_set_skip_hint(1);
        CHECK(skipped > 0 && kvs_engine_kv_counter(&st, "kvserve:kv_quest_dense_skipped_rows_total") == 0,
              "skipped lead rows: %g with the hint, %g without", skipped,
              kvs_engine_kv_counter(&st, "kvserve:kv_quest_dense_skipped_rows_total"));
        CHECK(same_tokens(got, nohint), "the skip_lead hint changed the greedy tokens");
        printf("ok quest at 15%%, mixed steps: %g lead rows (x layers) skipped by the dense pass; tokens equal to the "
               "run without the hint\n", skipped);
    }
    kvs_config_free(&c);

    /* 4-bit digests: codes exact (the policy's check re-encodes the cache's keys) under prefix
     * sharing and preemption; the check's negative control catches skipped refreshes */
    for (int mode = 1; mode <= 2; mode++) {
        base_cfg(&c, mode == 1 ? "prefix" : "none", "quest");
        c.quest_budget_ratio = 0.15;
        c.quest_min_budget = 32;
        c.quest_digest_bits = 4;
        if (mode == 1) c.kv_memory_bytes = 18 * 8192;
        kvs_quest_set_check(mode);
        REQUIRE(run(&c, got, &st, err, sizeof err) == 0, "%s", err);
        kvs_quest_set_check(0);
        const double st4 = kvs_engine_kv_counter(&st, "kvserve:kv_quest_stale_digests_total");
        const double rows4 = kvs_engine_kv_counter(&st, "kvserve:kv_quest_sparse_rows_total");
        if (mode == 1)
            CHECK(st4 == 0 && rows4 > 0 && st.num_preemptions > 0, "4-bit digests: %g stale, %g sparse rows, %llu "
                  "preemptions", st4, rows4, (unsigned long long)st.num_preemptions);
        else
            CHECK(st4 > 0, "4-bit digests: the check saw no stale page when refreshes were skipped");
        kvs_config_free(&c);
    }
    printf("ok quest with 4-bit digests at 15%%: codes exact under sharing and preemption; skipped refreshes caught\n");
    base_cfg(&c, "none", "quest");
    c.quest_digest_bits = 6;
    {
        struct kvs_engine *e6 = NULL;
        const int rc6 = kvs_engine_create(&c, model, NULL, &e6, err, sizeof err);
        CHECK(rc6 == -EINVAL && strstr(err, "kv.quest.digest_bits"), "digest_bits 6: rc %d (%s)", rc6, err);
        if (e6) kvs_engine_free(e6);
    }
    kvs_config_free(&c);

    /* the check's negative control: refreshes skipped every other step leave stale digests */
    base_cfg(&c, "none", "quest");
    c.quest_min_budget = 32;
    kvs_quest_set_check(2);
    REQUIRE(run(&c, got, &st, err, sizeof err) == 0, "%s", err);
    kvs_quest_set_check(0);
    CHECK(kvs_engine_kv_counter(&st, "kvserve:kv_quest_stale_digests_total") > 0, "the digest check saw no stale page when refreshes "
          "were skipped");
    printf("ok the digest check catches skipped refreshes (%g stale pages)\n",
           kvs_engine_kv_counter(&st, "kvserve:kv_quest_stale_digests_total"));
    kvs_config_free(&c);

    /* prefix sharing (no preemption) gives the tokens of private blocks */
    base_cfg(&c, "none", "quest");
    c.quest_min_budget = 32;
    REQUIRE(run(&c, got, &st, err, sizeof err) == 0, "%s", err);
    kvs_config_free(&c);
    base_cfg(&c, "prefix", "quest");
    c.quest_min_budget = 32;
    REQUIRE(run(&c, shared, &st, err, sizeof err) == 0, "%s", err);
    CHECK(kvs_engine_kv_counter(&st, "kvserve:kv_quest_sparse_rows_total") > 0 && st.cache_hits >= 96,
          "sparse rows %g, prefix cache hits %llu", kvs_engine_kv_counter(&st, "kvserve:kv_quest_sparse_rows_total"),
          (unsigned long long)st.cache_hits);
    CHECK(same_tokens(got, shared), "quest with prefix sharing: tokens differ from private blocks");
    CHECK(!same_tokens(ref, got), "quest at a small budget gave full attention's tokens for every request");
    printf("ok quest with prefix sharing (%llu prompt tokens from the cache) gives the tokens of private blocks\n",
           (unsigned long long)st.cache_hits);
    kvs_config_free(&c);

    /* super-pages (kv.quest.super_pages): every super-page kept gives Quest's tokens bitwise;
     * super_keep 1 under prefix sharing and a pool that preempts keeps every super digest current
     * (the check recomputes each one the selection read) */
    base_cfg(&c, "none", "quest");
    c.quest_min_budget = 32;
    c.quest_super_pages = 2;
    c.quest_super_keep = 1e9;
    static struct job sup[NJ];
    memcpy(sup, ref, sizeof sup);
    REQUIRE(run(&c, sup, &st, err, sizeof err) == 0, "%s", err);
    CHECK(same_tokens(got, sup) && kvs_engine_kv_counter(&st, "kvserve:kv_quest_super_scored_total") > 0,
          "super-pages, every one kept: tokens differ from Quest's (or no super-page scored)");
    kvs_config_free(&c);
    base_cfg(&c, "prefix", "quest");
    c.quest_min_budget = 32;
    c.quest_super_pages = 2;
    c.quest_super_keep = 1;
    c.kv_memory_bytes = 18 * 8192;
    kvs_quest_set_check(1);
    REQUIRE(run(&c, sup, &st, err, sizeof err) == 0, "%s", err);
    kvs_quest_set_check(0);
    {
        const double sst = kvs_engine_kv_counter(&st, "kvserve:kv_quest_stale_digests_total");
        const double srows = kvs_engine_kv_counter(&st, "kvserve:kv_quest_sparse_rows_total");
        const double sref = kvs_engine_kv_counter(&st, "kvserve:kv_quest_super_refreshed_total");
        const double sread = kvs_engine_kv_counter(&st, "kvserve:kv_quest_super_scored_total");
        CHECK(sst == 0 && srows > 0 && sref > 0 && st.num_preemptions > 0 && st.cache_hits > 0,
              "super-pages at super_keep 1: %g stale digests, %g sparse rows, %g super-pages refreshed, %llu "
              "preemptions, %llu cache hits", sst, srows, sref, (unsigned long long)st.num_preemptions,
              (unsigned long long)st.cache_hits);
        printf("ok super-pages: every one kept = Quest's tokens; at super_keep 1 under sharing and preemption %g sparse "
               "rows, %g super-pages scored, %g refreshed (x layers), 0 stale\n", srows, sread, sref);
    }
    kvs_config_free(&c);
    base_cfg(&c, "none", "quest");
    c.quest_min_budget = 32;
    c.quest_super_pages = 2;
    c.quest_super_keep = 1;
    kvs_quest_set_check(3);
    REQUIRE(run(&c, sup, &st, err, sizeof err) == 0, "%s", err);
    kvs_quest_set_check(0);
    CHECK(kvs_engine_kv_counter(&st, "kvserve:kv_quest_stale_digests_total") > 0,
          "the check saw no stale super-page when their refreshes were skipped");
    printf("ok the check catches skipped super-page refreshes (%g stale)\n",
           kvs_engine_kv_counter(&st, "kvserve:kv_quest_stale_digests_total"));
    kvs_config_free(&c);
    base_cfg(&c, "none", "quest");
    c.quest_super_pages = 4;
    c.quest_super_keep = 0.5;
    {
        struct kvs_engine *es = NULL;
        const int rcs = kvs_engine_create(&c, model, NULL, &es, err, sizeof err);
        CHECK(rcs == -EINVAL && strstr(err, "kv.quest.super_keep"), "super_keep 0.5: rc %d (%s)", rcs, err);
        if (es) kvs_engine_free(es);
    }
    kvs_config_free(&c);

    /* a page size that does not divide the block is refused, naming the key */
    base_cfg(&c, "none", "quest");
    c.quest_page_size = 12;
    struct kvs_engine *e = NULL;
    int rc = kvs_engine_create(&c, model, NULL, &e, err, sizeof err);
    CHECK(rc == -EINVAL && strstr(err, "kv.quest.page_size"), "page size 12: rc %d (%s)", rc, err);
    if (e) kvs_engine_free(e);
    kvs_config_free(&c);
}

/* 500 requests, random lengths, shared prefixes, random cancellations, a pool that preempts:
 * every request ends, every block comes back, no digest is ever stale */
static void test_stress(void)
{
    enum { N = 500, GL = 12 };
    struct kvs_config c;
    base_cfg(&c, "prefix", "quest");
    c.quest_min_budget = 32;
    c.kv_memory_bytes = 20 * 8192;
    c.max_waiting = N;
    char err[256];
    struct kvs_engine *e;
    REQUIRE(kvs_engine_create(&c, model, NULL, &e, err, sizeof err) == 0, "%s", err);
    kvs_quest_set_check(1);
    struct kvs_test_stress sr;
    kvs_test_engine_stress(e, N, GL, 40, 150, 0xC0FFEEull, &sr);
    const struct kvs_engine_stats st = sr.st;
    const int finished = sr.finished, cancelled = sr.cancelled, n_cancel = sr.n_cancel;
    kvs_quest_set_check(0);
    const double stale = kvs_engine_kv_counter(&st, "kvserve:kv_quest_stale_digests_total");
    const double rows = kvs_engine_kv_counter(&st, "kvserve:kv_quest_sparse_rows_total");
    CHECK(finished + cancelled == N && cancelled <= n_cancel && finished >= N - n_cancel, "%d finished, %d cancelled",
          finished, cancelled);
    CHECK(st.kv_blocks_used == 0 && st.num_running == 0 && st.num_waiting == 0, "blocks used %d, running %d",
          st.kv_blocks_used, st.num_running);
    CHECK(stale == 0 && rows > 0 && st.num_preemptions > 0, "%g stale digests, %g sparse rows, %llu preemptions", stale,
          rows, (unsigned long long)st.num_preemptions);
    printf("ok stress: %d requests (%d cancelled), %llu preemptions, %g sparse rows, all blocks free, 0 stale digests\n",
           N, cancelled, (unsigned long long)st.num_preemptions, rows);
    kvs_engine_free(e);
    kvs_config_free(&c);
}

int main(void)
{
    kvs_log_set_level(KVS_LOG_WARN);
    test_kernels();
    test_qd_coding();
    test_quantized_kernels();
    test_super();
    char dir[1024], err[256];
    snprintf(dir, sizeof dir, "%s/tests/data/models/llama", kvs_test_root());
    REQUIRE(kvs_model_load(dir, &model, err, sizeof err) == 0, "%s", err);
    test_engine();
    test_stress();
    kvs_model_free(model);
    return kvs_test_summary("test_kv_quest");
}
