/* test_cuda_kv_quest.c: the CUDA kernels of Quest (kernels/cuda/kv_quest.cu) against the CPU
 * reference (kernels/cpu/kv_quest.c), on fresh random cases each run (kv_quest_fixture.h; seed
 * from the clock, printed; replay with KVS_SEED=<seed>), then kv.decode=quest through the whole
 * engine on device cuda.
 *   digests   bitwise equal to the CPU's (bf16 keys on both: min/max are exact);
 *   scores    within 1e-5 of the CPU's, relative to the bound's magnitude (another fp32 order);
 *   fused     score_select (the fused kernel at 1024 threads with the step's digest refresh
 *             folded in, at 512 without; score then select with the refresh as a slice of the
 *             score launch, for one row a sequence and for a Retro window's rows inside the
 *             current page with 256-thread select blocks; the same under the serial loads at
 *             1024 threads; the 128K row only at the default 8 bits and not these last two) passes every check below (digests bitwise the CPU's) and gives the two
 *             kernels' scores and spans bitwise;
 *   selection the CUDA select equals a brute-force ranking of the CUDA scores exactly (ties to
 *             the lower page), and differs from the CPU's choice only on pages whose CPU score
 *             is within rounding of the CPU's k-th score; planted needles are found; spans are
 *             sorted, merged and end at the context;
 *   attention attention_spans over the CUDA spans: out and lse against the CPU op over the same
 *             spans (out relative L2 < 1e-2, lse within 1e-2 relative: bf16 K/V and q);
 *   sizes     one 128K-token row (8192 candidate pages), 1024 (row, KV head) pairs (one score
 *             block per pair: its pages in several loop iterations), and equal scores (the
 *             lowest pages);
 *   super     the two-level selection (super_select): the split form (kvs_quest_cuda_super_path 2)
 *             gives the one-block kernel's spans, super digests and candidate scores bitwise; every
 *             super-page kept gives the exact CUDA path's spans bitwise; otherwise super digests bitwise the CPU's, candidates whole
 *             super-pages scored with the exact path's bits, the last super-page kept and the other
 *             kept ones ranked first up to rounding, the kept pages a brute-force ranking of the candidates, and the CPU's
 *             selection for at least 90% of the pairs (the rest: near-ties in another fp32 order);
 *             through the engine: every super-page kept gives Quest's tokens, super_keep 1 serves
 *             every request with graphs = eager and no stale digest under the eager check;
 *   engine    the tiny Llama on device cuda with kv.decode=quest at budget >= context gives the
 *             same greedy tokens as full attention on cuda for most requests (bf16 rounding may
 *             flip a near-tie), and at a small budget serves every request and reads less; the
 *             same with step graphs off (KVS_GRAPHS=0) gives the graphed run's tokens for most
 *             requests and the same sparse rows.
 * Needs a GPU: exits 1 with a message when none. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/util.h"
#include "kernels/backend.h"
#include "engine/kv/kv_decode_quest.h"
#include "tests/unit/kv_quest_fixture.h"
#include "tests/unit/test_util.h"

#if defined(KVS_HAVE_CUDA) && KVS_HAVE_CUDA
#include "engine/config.h"
#include "engine/engine.h"
#include "kernels/cuda/cuda_backend.h"
#include "models/model.h"

static const struct kvs_backend_ops *C = &kvs_cpu_backend, *G = &kvs_cuda_backend;
static struct kvs_backend *bc, *bg;

static double rel_l2(const float *a, const float *b, size_t n)
{
    double d = 0, r = 0;
    for (size_t i = 0; i < n; i++) d += ((double)a[i] - b[i]) * ((double)a[i] - b[i]), r += (double)b[i] * b[i];
    return r > 0 ? sqrt(d / r) : sqrt(d);
}

static void compare(const struct qf_case *c, const struct qf_out *rc, const struct qf_out *rg, const char *what)
{
    const int nkv = c->nkv, hd = c->hd, S = c->n_seqs;
    const size_t nd = (size_t)rc->n_pages * nkv * 2 * hd;
    /* digests of pages no sequence owns hold the junk both were given: compare everything */
    size_t bad_dig = 0;
    if (rc->qdig)   /* quantized: every word (codes and params) bitwise */
        for (size_t i = 0; i < rc->nq; i++) bad_dig += rc->qdig[i] != rg->qdig[i];
    else
        for (size_t i = 0; i < nd; i++) bad_dig += rc->dig[i] != rg->dig[i];
    double score_err = 0;
    int bad_sel = 0, near = 0, bad_spans = 0, needles = 0, found = 0, sparse = 0;
    unsigned char *kc = kvs_xmalloc((size_t)rc->max_pages), *kg = kvs_xmalloc((size_t)rc->max_pages);
    for (int s = 0; s < S; s++) {
        const int cur = (c->ctx[s] - 1) / c->ps, top = c->keep[s] - 1;
        for (int g = 0; g < nkv; g++) {
            const int nc = qf_kept_pages(c, rc, s, g, kc), ng = qf_kept_pages(c, rg, s, g, kg);
            if (nc < 0 || ng < 0 || nc != ng) {
                bad_spans++;
                continue;
            }
            if (top >= cur) continue;
            sparse++;
            const float *sc = rc->scores + ((size_t)s * nkv + g) * rc->max_pages;
            const float *sg = rg->scores + ((size_t)s * nkv + g) * rg->max_pages;
            double mag = 0;
            for (int pg = 0; pg < cur; pg++) mag = fabs(sc[pg]) > mag ? fabs(sc[pg]) : mag;
            /* the CPU's k-th score */
            float thr = INFINITY;
            for (int pg = 0; pg < cur; pg++)
                if (kc[pg] && sc[pg] < thr) thr = sc[pg];
            for (int pg = 0; pg < cur; pg++) {
                const double e = fabs((double)sg[pg] - sc[pg]) / (mag > 0 ? mag : 1);
                score_err = e > score_err ? e : score_err;
                int ahead = 0;
                const uint32_t kp = kvs_quest_order_key(sg[pg]);
                for (int p2 = 0; p2 < cur; p2++) {
                    const uint32_t k2 = kvs_quest_order_key(sg[p2]);
                    ahead += k2 > kp || (k2 == kp && p2 < pg);
                }
                bad_sel += kg[pg] != (ahead < top);
                if (kg[pg] != kc[pg]) {
                    if (fabs((double)sc[pg] - thr) <= 1e-5 * (mag > 0 ? mag : 1)) near++;
                    else bad_sel++;
                }
            }
            bad_sel += !kg[cur];
            for (int k = 0; k < QF_NEEDLES; k++)
                if (c->needle[s][g][k] >= 0 && top >= QF_NEEDLES) needles++, found += kg[c->needle[s][g][k]];
        }
    }
    free(kc);
    free(kg);
    const double out_err = rel_l2(rg->out, rc->out, (size_t)S * c->nh * hd);
    double lse_err = 0;
    for (int i = 0; i < S * c->nh; i++) {
        /* relative to the lse's size: needles make scores of 20+ (bf16 q products) */
        const double e = fabs((double)rg->lse[i] - rc->lse[i]) / (fabs(rc->lse[i]) > 1 ? fabs(rc->lse[i]) : 1);
        lse_err = e > lse_err ? e : lse_err;
    }
    CHECK(bad_dig == 0, "%s: %zu digest entries differ", what, bad_dig);
    CHECK(bad_spans == 0, "%s: %d malformed or differently sized span lists", what, bad_spans);
    CHECK(bad_sel == 0, "%s: %d selection errors", what, bad_sel);
    CHECK(score_err < 1e-5, "%s: score error %g", what, score_err);
    CHECK(found == needles, "%s: %d of %d needles", what, found, needles);
    /* outputs compared only when both chose the same pages (else the rows differ by design) */
    if (!near) CHECK(out_err < 1e-2 && lse_err < 1e-2, "%s: out rel-L2 %g, lse err %g", what, out_err, lse_err);
    printf("ok %s: digests bitwise, %d sparse selections exact on the CUDA scores (%d near-tie pages differ from "
           "the CPU's), %d/%d needles, score err %.1e, out rel-L2 %.1e\n",
           what, sparse, near, found, needles, score_err, out_err);
}

static void test_kernels(uint64_t seed)
{
    char err[256];
    const struct kvs_quest_kernels *kc = kvs_quest_kernels_for(C, err, sizeof err);
    const struct kvs_quest_kernels *kg = kvs_quest_kernels_for(G, err, sizeof err);
    REQUIRE(kc && kg, "%s", err);
    static const struct {
        int S, nh, nkv, hd, bs, ps, lo, hi;
        double ratio;
        int min_budget, needles;
        const char *what;
    } CASES[] = {
        {8, 32, 8, 128, 16, 16, 300, 4000, 0.15, 64, 1, "Llama-8B heads (G4, hd128), needles"},
        {5, 16, 2, 64, 16, 8, 100, 2000, 0.2, 32, 1, "G8 hd64, pages of 8"},
        {6, 8, 8, 128, 32, 16, 40, 900, 0.15, 32, 1, "MHA hd128, blocks of 32"},
        {4, 32, 8, 128, 16, 16, 1, 300, 0.15, 256, 0, "short (every page: one span)"},
        {1, 32, 8, 128, 16, 16, 131072, 131072, 0.15, 256, 1, "one 128K row (8192 pages)"},
        {3, 64, 8, 256, 16, 16, 1000, 3000, 0.1, 64, 1, "G8 hd256"},
        /* 1024 (row, KV head) pairs: one score block per pair over all its candidates (more
         * pages per block than one loop iteration of its warps) */
        {16, 64, 64, 64, 16, 16, 2000, 3000, 0.15, 64, 1, "MHA 64 heads hd64, 16 rows: one long score block each"},
    };
    /* each case with bf16 digests, then 8- and 4-bit ones (kv.quest.digest_bits) */
    for (size_t i = 0; i < 3 * (sizeof CASES / sizeof CASES[0]); i++) {
        const size_t ci = i % (sizeof CASES / sizeof CASES[0]);
        const int bits = i < sizeof CASES / sizeof CASES[0] ? 16 : i < 2 * (sizeof CASES / sizeof CASES[0]) ? 8 : 4;
        struct qf_case c;
        struct qf_out rc, rg;
        char what[160];
        qf_make(&c, seed + ci, CASES[ci].S, CASES[ci].nh, CASES[ci].nkv, CASES[ci].hd, CASES[ci].bs, CASES[ci].ps,
                CASES[ci].lo, CASES[ci].hi, CASES[ci].ratio, CASES[ci].min_budget, CASES[ci].needles);
        c.bits = bits;
        snprintf(what, sizeof what, "%s, %d-bit digests", CASES[ci].what, bits);
        qf_run(C, bc, kc, &c, &rc);
        kvs_quest_cuda_select_path(1);
        qf_run(G, bg, kg, &c, &rg);
        compare(&c, &rc, &rg, what);
        /* the fused score + select (both block sizes) against the CPU, and bitwise against the
         * two kernels: the same scores, so the same spans */
        /* the fused kernel at both block sizes (1024 where the pairs are fewer than SMs, forced
         * 512), with and without the refresh folded in; then score then select with the refresh
         * as a slice of the score launch (path 1 + the folded fixture: the policy's default) */
        /* the 128K-token row (each run uploads 1 GB of K/V): these paths at the default width only */
        /* then (v 3, 4) score then select with the refresh slice writing a Retro window's rows of
         * the current page (fixture mode 3) and 256-thread select blocks, and with the refresh
         * folded under the serial loads (kvs_quest_cuda_serial_loads: the loops of before the
         * batched loads, the same bits) and 1024-thread select blocks */
        const int paths = CASES[ci].lo < 131072 ? 5 : bits == KVS_QUEST_DIGEST_BITS_DEFAULT ? 3 : 0;
        for (int v = 0; v < paths; v++) {
            const int mode = v == 0 ? 2 : v == 1 ? 3 : 1;
            struct qf_out rf;
            char fw[320];
            snprintf(fw, sizeof fw, "%s, %s%s%s", what,
                     mode == 2   ? "fused score + select"
                     : mode == 3 ? "fused score + select (512 threads)"
                                 : "score + select",
                     v == 1   ? ""
                     : v == 3 ? ", window's in-page rows refreshed in the launch, 256-thread select"
                              : ", refresh folded",
                     v == 4 ? ", serial loads" : "");
            kvs_quest_cuda_select_path(mode);
            kvs_quest_cuda_serial_loads(v == 4);
            kvs_quest_cuda_select_threads(v == 3 ? 256 : v == 4 ? 1024 : 0);
            qf_fused = v == 1 ? 1 : v == 3 ? 3 : 2;
            qf_run(G, bg, kg, &c, &rf);
            qf_fused = 0;
            kvs_quest_cuda_serial_loads(0);
            kvs_quest_cuda_select_threads(0);
            compare(&c, &rc, &rf, fw);
            const size_t ns = (size_t)c.n_seqs * c.nkv, np = ns * (size_t)rg.max_pages;
            size_t bad_sc = 0, bad_sp = 0;
            for (size_t j = 0; j < ns; j++) {
                const int cur = (c.ctx[j / c.nkv] - 1) / c.ps;
                if (c.keep[j / c.nkv] - 1 < cur)   /* a selecting row: its candidates' scores */
                    for (int pg = 0; pg < cur; pg++)
                        bad_sc += memcmp(&rf.scores[j * rg.max_pages + pg], &rg.scores[j * rg.max_pages + pg], 4) != 0;
                bad_sp += rf.n_spans[j] != rg.n_spans[j];
                for (int k = 0; k < 2 * rg.n_spans[j] && k < 2 * rg.max_spans; k++)
                    bad_sp += rf.spans[j * rg.max_spans * 2 + k] != rg.spans[j * rg.max_spans * 2 + k];
            }
            CHECK(bad_sc == 0 && bad_sp == 0, "%s: %zu scores and %zu span entries differ from the two kernels' (of %zu)",
                  fw, bad_sc, bad_sp, np);
            qf_out_free(&rf);
        }
        kvs_quest_cuda_select_path(0);
        qf_out_free(&rc);
        qf_out_free(&rg);
        qf_free(&c);
    }
    /* equal scores (zero queries): both keep the lowest pages */
    struct qf_case c;
    struct qf_out rc, rg;
    qf_make(&c, seed, 3, 8, 2, 64, 16, 16, 3000, 9000, 0.1, 64, 0);
    memset(c.q, 0, (size_t)c.n_seqs * c.nh * c.hd * sizeof *c.q);
    qf_run(C, bc, kc, &c, &rc);
    for (int fused = 0; fused <= 1; fused++) {   /* the two kernels, then the fused one */
        kvs_quest_cuda_select_path(fused ? 2 : 1);
        qf_fused = fused;
        qf_run(G, bg, kg, &c, &rg);
        qf_fused = 0;
        int same = 1;
        for (int i = 0; i < c.n_seqs * c.nkv; i++) {
            same &= rc.n_spans[i] == rg.n_spans[i] && rg.n_spans[i] == 2;
            for (int k = 0; k < 2 * rc.n_spans[i] && k < 2 * rc.max_spans; k++)
                same &= rc.spans[(size_t)i * rc.max_spans * 2 + k] == rg.spans[(size_t)i * rg.max_spans * 2 + k];
        }
        CHECK(same, "equal scores%s: CUDA spans differ from the CPU's [0, (keep-1) ps), [cur ps, ctx)",
              fused ? " (fused)" : "");
        printf("ok equal scores%s: the lowest pages on both backends\n", fused ? " (fused score + select)" : "");
        qf_out_free(&rg);
    }
    kvs_quest_cuda_select_path(0);
    qf_out_free(&rc);
    qf_free(&c);
}

/* ---- the engine on device cuda --------------------------------------------------------------- */

#define NJ 6
#define GEN 16

/* ---- two-level (super-page) selection --------------------------------------------------------- */

/* fresh cases at 16, 8 and 4 bits: every super-page kept gives the exact CUDA path's spans
 * bitwise; at super_keep 1 (and 2) the super digests equal the CPU's bitwise, the CUDA candidates
 * are whole super-pages, skeep of them, scored with the exact path's bits, the kept super-pages
 * rank first up to rounding (double scores from the digests), the kept pages equal a brute-force
 * ranking of the CUDA candidates' scores, and the selection equals the CPU's for most pairs */
static void test_super(uint64_t seed)
{
    char err[256];
    const struct kvs_quest_kernels *kc = kvs_quest_kernels_for(C, err, sizeof err), *kg = kvs_quest_kernels_for(G, err, sizeof err);
    REQUIRE(kc && kg && kg->super_select, "quest kernels: %s", err);
    static const struct {
        int S, nh, nkv, hd, bs, ps, lo, hi;
        double ratio;
        int min_budget, N, bits;
        double factor;
    } CASES[] = {
        {6, 32, 8, 128, 16, 16, 3000, 9000, 0.15, 256, 16, 8, 1.0},
        {6, 32, 8, 128, 16, 16, 3000, 9000, 0.15, 256, 16, 16, 2.0},
        {5, 16, 4, 128, 16, 16, 1000, 5000, 0.15, 256, 8, 4, 2.0},
        {4, 8, 2, 64, 32, 16, 300, 3000, 0.1, 64, 4, 8, 1.0},
        {4, 16, 2, 256, 16, 8, 500, 2000, 0.2, 64, 5, 16, 1.5},
    };
    int bad_split = 0, bad_split_sd = 0, bad_all = 0, bad_sd = 0, bad_cand = 0, bad_sc = 0, bad_rank = 0, bad_sel = 0, pairs = 0, sparse = 0, same_cpu = 0;
    for (size_t ci = 0; ci < sizeof CASES / sizeof CASES[0]; ci++) {
        struct qf_case c;
        struct qf_out rg;
        struct qf_sout ag, eg, ac, a1, e1;
        qf_make(&c, seed + 1000 + ci, CASES[ci].S, CASES[ci].nh, CASES[ci].nkv, CASES[ci].hd, CASES[ci].bs, CASES[ci].ps,
                CASES[ci].lo, CASES[ci].hi, CASES[ci].ratio, CASES[ci].min_budget, 1);
        c.bits = CASES[ci].bits;
        const int N = CASES[ci].N, nkv = c.nkv, hd = c.hd, Gq = c.nh / nkv;
        qf_run(G, bg, kg, &c, &rg);
        kvs_quest_cuda_super_path(2);   /* the split form (the default with scores scratch) */
        qf_super_run(G, bg, kg, &c, N, 1e9, &eg);
        qf_super_run(G, bg, kg, &c, N, CASES[ci].factor, &ag);
        kvs_quest_cuda_super_path(1);   /* the one-block kernel: the same bits */
        qf_super_run(G, bg, kg, &c, N, 1e9, &e1);
        qf_super_run(G, bg, kg, &c, N, CASES[ci].factor, &a1);
        kvs_quest_cuda_super_path(0);
        qf_super_run(C, bc, kc, &c, N, CASES[ci].factor, &ac);
        struct qf_out vg = rg, vc = rg;
        vg.n_spans = ag.n_spans, vg.spans = ag.spans, vg.max_spans = ag.max_spans;
        vc.n_spans = ac.n_spans, vc.spans = ac.spans, vc.max_spans = ac.max_spans;
        unsigned char *kg_ = kvs_xmalloc((size_t)rg.max_pages), *kc_ = kvs_xmalloc((size_t)rg.max_pages);
        unsigned char *want = kvs_xmalloc((size_t)rg.max_pages + 1);
        double *sup = kvs_xmalloc((size_t)ag.max_super * 2 * sizeof *sup);
        for (int s = 0; s < c.n_seqs; s++) {
            const int cur = (c.ctx[s] - 1) / c.ps, nsup = (cur + N - 1) / N, top = c.keep[s] - 1;
            for (int g = 0; g < nkv; g++) {
                pairs++;
                bad_all += !qf_same_spans(&c, eg.n_spans, eg.spans, eg.max_spans, rg.n_spans, rg.spans, rg.max_spans, s, g);
                /* split = one-block: spans (both settings), and the scores' candidates and bits */
                int diff = !qf_same_spans(&c, eg.n_spans, eg.spans, eg.max_spans, e1.n_spans, e1.spans, e1.max_spans, s, g) ||
                           !qf_same_spans(&c, ag.n_spans, ag.spans, ag.max_spans, a1.n_spans, a1.spans, a1.max_spans, s, g);
                if (top < cur)
                    for (int pg = 0; pg < cur; pg++) {
                        const float x = ag.scores[((size_t)s * nkv + g) * ag.max_pages + pg];
                        const float y = a1.scores[((size_t)s * nkv + g) * a1.max_pages + pg];
                        diff |= isnan(x) != isnan(y) || (!isnan(x) && memcmp(&x, &y, sizeof x) != 0);
                    }
                bad_split += diff;
                if (top >= cur) continue;
                sparse++;
                const size_t so = ((size_t)(c.n_seqs - 1 - s) * ag.max_super * nkv + g) * 2 * hd;
                const float *sq = c.q + (size_t)s * c.nh * hd;
                for (int j = 0; j < nsup; j++) {
                    const float *dg = ag.sdig + so + (size_t)j * nkv * 2 * hd, *dc = ac.sdig + so + (size_t)j * nkv * 2 * hd;
                    bad_sd += memcmp(dg, dc, 2 * (size_t)hd * sizeof *dg) != 0;
                    double sc = 0, mag = 0;
                    for (int h = g * Gq; h < (g + 1) * Gq; h++)
                        for (int i = 0; i < hd; i++) {
                            const double a = (double)sq[(size_t)h * hd + i] * dg[i], b = (double)sq[(size_t)h * hd + i] * dg[hd + i];
                            sc += a > b ? a : b;
                            mag += fabs(a) + fabs(b);
                        }
                    sup[2 * j] = dg[0] == -INFINITY && dg[hd] == INFINITY ? INFINITY : sc, sup[2 * j + 1] = mag;
                }
                /* the candidates: pages the kernel scored (the rest keep the NaN) */
                const float *gs = ag.scores + ((size_t)s * nkv + g) * ag.max_pages;
                const float *es = rg.scores + ((size_t)s * nkv + g) * rg.max_pages;
                int nk = 0, whole = 1;
                double kmin = INFINITY, omax = -INFINITY, tol = 0;
                for (int j = 0; j < nsup; j++) {
                    int w = 0, n = 0;
                    for (int pg = j * N; pg < (j + 1) * N && pg < cur; pg++) w += !isnan(gs[pg]), n++;
                    whole &= w == 0 || w == n;
                    nk += w > 0;
                    if (j == nsup - 1) {   /* the last super-page: always kept, not ranked */
                        whole &= w > 0;
                        continue;
                    }
                    if (w) kmin = sup[2 * j] < kmin ? sup[2 * j] : kmin;
                    else omax = sup[2 * j] > omax ? sup[2 * j] : omax;
                    tol = 1e-5 * sup[2 * j + 1] > tol ? 1e-5 * sup[2 * j + 1] : tol;
                }
                bad_cand += !whole || nk != (ag.skeep[s] < nsup ? ag.skeep[s] : nsup);
                bad_rank += !(kmin >= omax - tol);
                int nc = 0;
                for (int pg = 0; pg < cur; pg++)
                    if (!isnan(gs[pg])) nc++, bad_sc += memcmp(&gs[pg], &es[pg], sizeof *gs) != 0;
                /* brute force over the CUDA candidates */
                memset(want, 0, (size_t)cur + 1);
                for (int a = 0; a < cur; a++) {
                    if (isnan(gs[a])) continue;
                    const uint32_t ka = kvs_quest_order_key(gs[a]);
                    int ahead = 0;
                    for (int b = 0; b < cur; b++) {
                        if (isnan(gs[b])) continue;
                        const uint32_t kb = kvs_quest_order_key(gs[b]);
                        ahead += kb > ka || (kb == ka && b < a);
                    }
                    want[a] = ahead < top;
                }
                want[cur] = 1;
                const int ng = qf_kept_pages(&c, &vg, s, g, kg_), nc_ = qf_kept_pages(&c, &vc, s, g, kc_);
                bad_sel += ng < 0 || nc < top || memcmp(kg_, want, (size_t)cur + 1) != 0;
                same_cpu += nc_ >= 0 && ng >= 0 && !memcmp(kg_, kc_, (size_t)cur + 1);
            }
        }
        free(kg_);
        free(kc_);
        free(want);
        free(sup);
        const size_t nsd = (size_t)c.n_seqs * ag.max_super * nkv * 2 * hd;
        bad_split_sd += memcmp(ag.sdig, a1.sdig, nsd * sizeof *ag.sdig) != 0;
        qf_sout_free(&ag);
        qf_sout_free(&eg);
        qf_sout_free(&a1);
        qf_sout_free(&e1);
        qf_sout_free(&ac);
        qf_out_free(&rg);
        qf_free(&c);
    }
    CHECK(bad_split == 0 && bad_split_sd == 0,
          "cuda super-pages, split form vs one-block kernel: %d of %d pairs' spans or candidate scores differ, %d cases' "
          "super digests", bad_split, pairs, bad_split_sd);
    CHECK(bad_all == 0, "cuda super-pages, every one kept: %d of %d pairs differ from the exact CUDA path", bad_all, pairs);
    CHECK(bad_sd == 0 && bad_cand == 0 && bad_sc == 0 && bad_rank == 0 && bad_sel == 0 && sparse > 0,
          "cuda super-pages: %d super digests differ from the CPU's, %d pairs' candidates not skeep whole super-pages, "
          "%d candidate scores differ from the exact path's, %d pairs rank a dropped super-page above a kept one, %d "
          "selections differ from the brute force (%d sparse pairs)", bad_sd, bad_cand, bad_sc, bad_rank, bad_sel, sparse);
    CHECK(same_cpu >= sparse * 9 / 10, "cuda super-pages: only %d of %d sparse selections equal the CPU's", same_cpu, sparse);
    printf("ok cuda two-level selection: split form = one-block kernel bitwise (%d pairs); every super-page kept = the exact path (%d pairs); %d sparse pairs: digests = "
           "CPU's, candidates whole super-pages with the exact path's bits, brute-force ranking; %d/%d equal to the "
           "CPU's selection\n", pairs, pairs, sparse, same_cpu, sparse);
}

static int eng_bits = 16;   /* kv.quest.digest_bits of the next run_engine */
static int eng_sup = 0;     /* kv.quest.super_pages / super_keep of the next run_engine */
static double eng_sup_keep = 2;

static void run_engine(struct kvs_model *model, const char *decode, double ratio, int min_budget, int32_t out[NJ][GEN],
                       struct kvs_engine_stats *st)
{
    struct kvs_config c;
    kvs_config_init(&c);
    free(c.device), c.device = kvs_xstrdup("cuda");
    free(c.kv_decode), c.kv_decode = kvs_xstrdup(decode);
    free(c.kv_reuse), c.kv_reuse = kvs_xstrdup("prefix");
    c.kv_block_size = 16;
    c.kv_memory_bytes = 16 << 20;
    c.max_batch_tokens = 256;
    c.max_running = 4;
    c.max_model_len = 512;
    c.quest_dense_layers = 0;
    c.quest_budget_ratio = ratio;
    c.quest_min_budget = min_budget;
    c.quest_digest_bits = eng_bits;
    c.quest_super_pages = eng_sup;
    c.quest_super_keep = eng_sup_keep;
    char err[256];
    struct kvs_engine *e;
    REQUIRE(kvs_engine_create(&c, model, NULL, &e, err, sizeof err) == 0, "%s", err);
    uint64_t rng = 4242;
    struct kvs_request *r[NJ];
    int32_t prompt[NJ][300];
    for (int i = 0; i < NJ; i++) {
        struct kvs_request_params p;
        memset(&p, 0, sizeof p);
        const int n = 150 + (int)(kvs_test_xorshift(&rng) % 140);
        for (int t = 0; t < n; t++) prompt[i][t] = 1 + (int32_t)(kvs_test_xorshift(&rng) % 1000);
        p.prompt = prompt[i];
        p.n_prompt = n;
        p.max_tokens = GEN;
        p.sampling.top_p = 1;
        p.sampling.repetition_penalty = 1;
        p.ignore_eos = 1;
        r[i] = kvs_request_new(&p, NULL, NULL);
        REQUIRE(r[i] && kvs_engine_submit(e, r[i], err, sizeof err) == 0, "submit: %s", err);
    }
    for (int i = 0; i < NJ; i++) {
        int n = 0, done = 0;
        struct kvs_event ev[16];
        while (!done) {
            int k = kvs_request_wait(r[i], ev, 16, 60.0);
            REQUIRE(k > 0, "no event for 60 s");
            for (int q = 0; q < k; q++) {
                if (ev[q].type == KVS_EV_TOKEN && n < GEN) out[i][n++] = ev[q].token;
                if (ev[q].type == KVS_EV_ERROR) fprintf(stderr, "error: %s\n", ev[q].error);
                if (ev[q].type != KVS_EV_TOKEN) done = 1;
                kvs_event_clear(&ev[q]);
            }
        }
        CHECK(n == GEN, "%s: request %d got %d tokens", decode, i, n);
        kvs_request_unref(r[i]);
    }
    kvs_engine_stats(e, st);
    kvs_engine_free(e);
    kvs_config_free(&c);
}

static void test_engine(void)
{
    char dir[1024], err[256];
    struct kvs_model *model;
    snprintf(dir, sizeof dir, "%s/tests/data/models/llama", kvs_test_root());
    REQUIRE(kvs_model_load(dir, &model, err, sizeof err) == 0, "%s", err);
    static int32_t full[NJ][GEN], all[NJ][GEN], sparse[NJ][GEN];
    struct kvs_engine_stats st;
    run_engine(model, "full", 0.15, 256, full, &st);
    run_engine(model, "quest", 1.0, 0, all, &st);
    int same = 0;
    for (int i = 0; i < NJ; i++) same += !memcmp(full[i], all[i], sizeof full[i]);
    CHECK(same >= NJ - 1, "quest at budget >= context on cuda: %d of %d requests equal to full", same, NJ);
    run_engine(model, "quest", 0.15, 32, sparse, &st);
    const double rd = kvs_engine_kv_counter(&st, "kvserve:kv_decode_bytes_read_total");
    const double fb = kvs_engine_kv_counter(&st, "kvserve:kv_decode_bytes_full_total");
    const double rows = kvs_engine_kv_counter(&st, "kvserve:kv_quest_sparse_rows_total");
    CHECK(rows > 0 && rd < 0.6 * fb, "quest at 15%% on cuda: %g sparse rows, read %g of %g", rows, rd, fb);
    printf("ok engine on cuda: quest at budget >= context equals full for %d/%d requests; at 15%% (min 32) %g sparse "
           "rows read %.1f%% of full\n",
           same, NJ, rows, 100 * rd / fb);
    /* the same run with the runner's step graphs off: Quest's recorded steps (launch shapes from
     * the context capacity, dummy sequences kept out of the digest refresh: 4 slots, 6 requests,
     * so batches of 3 are padded) select as its eager ones do */
    static int32_t eager[NJ][GEN];
    struct kvs_engine_stats st_e;
    setenv("KVS_GRAPHS", "0", 1);
    run_engine(model, "quest", 0.15, 32, eager, &st_e);
    unsetenv("KVS_GRAPHS");
    int same_e = 0;
    for (int i = 0; i < NJ; i++) same_e += !memcmp(sparse[i], eager[i], sizeof sparse[i]);
    const double rows_e = kvs_engine_kv_counter(&st_e, "kvserve:kv_quest_sparse_rows_total");
    CHECK(same_e >= NJ - 1 && rows_e == rows, "quest at 15%% on cuda, graphs vs eager: %d of %d requests equal, sparse "
          "rows %g vs %g", same_e, NJ, rows, rows_e);
    printf("ok engine on cuda: quest with step graphs equals eager for %d/%d requests (%g sparse rows each)\n", same_e,
           NJ, rows);
    /* 4-bit digests: budget >= context equals full (one span), and at 15% every request is
     * served with sparse rows, graphed and eager alike */
    static int32_t all4[NJ][GEN], sparse4[NJ][GEN], eager4[NJ][GEN];
    struct kvs_engine_stats st4, st4e;
    eng_bits = 4;
    run_engine(model, "quest", 1.0, 0, all4, &st4);
    int same4 = 0;
    for (int i = 0; i < NJ; i++) same4 += !memcmp(full[i], all4[i], sizeof full[i]);
    CHECK(same4 >= NJ - 1, "quest 4-bit at budget >= context on cuda: %d of %d requests equal to full", same4, NJ);
    run_engine(model, "quest", 0.15, 32, sparse4, &st4);
    setenv("KVS_GRAPHS", "0", 1);
    run_engine(model, "quest", 0.15, 32, eager4, &st4e);
    unsetenv("KVS_GRAPHS");
    eng_bits = 16;
    const double rows4 = kvs_engine_kv_counter(&st4, "kvserve:kv_quest_sparse_rows_total");
    int same4e = 0, same416 = 0;
    for (int i = 0; i < NJ; i++)
        same4e += !memcmp(sparse4[i], eager4[i], sizeof sparse4[i]), same416 += !memcmp(sparse4[i], sparse[i], sizeof sparse4[i]);
    CHECK(rows4 > 0 && same4e >= NJ - 1 && rows4 == kvs_engine_kv_counter(&st4e, "kvserve:kv_quest_sparse_rows_total"),
          "quest 4-bit at 15%% on cuda: %g sparse rows, graphs vs eager %d of %d equal", rows4, same4e, NJ);
    printf("ok engine on cuda: quest with 4-bit digests: budget >= context equals full for %d/%d; at 15%% %g sparse "
           "rows, graphs = eager for %d/%d, same tokens as bf16 digests for %d/%d\n",
           same4, NJ, rows4, same4e, NJ, same416, NJ);
    /* super-pages: every one kept gives the 15% run's tokens; at super_keep 1 every request is
     * served with sparse rows, graphed = eager, and the eager run's check sees no stale digest */
    static int32_t supall[NJ][GEN], sup1[NJ][GEN], sup1e[NJ][GEN];
    struct kvs_engine_stats ss, sse;
    eng_sup = 2, eng_sup_keep = 1e9;
    run_engine(model, "quest", 0.15, 32, supall, &ss);
    int samesa = 0;
    for (int i = 0; i < NJ; i++) samesa += !memcmp(supall[i], sparse[i], sizeof sparse[i]);
    CHECK(samesa >= NJ - 1, "super-pages, every one kept, on cuda: %d of %d requests equal to quest's", samesa, NJ);
    eng_sup_keep = 1;
    run_engine(model, "quest", 0.15, 32, sup1, &ss);
    setenv("KVS_GRAPHS", "0", 1);
    kvs_quest_set_check(1);
    run_engine(model, "quest", 0.15, 32, sup1e, &sse);
    kvs_quest_set_check(0);
    unsetenv("KVS_GRAPHS");
    eng_sup = 0, eng_sup_keep = 2;
    const double srows = kvs_engine_kv_counter(&ss, "kvserve:kv_quest_sparse_rows_total");
    const double sstale = kvs_engine_kv_counter(&sse, "kvserve:kv_quest_stale_digests_total");
    int same1e = 0, same1q = 0;
    for (int i = 0; i < NJ; i++)
        same1e += !memcmp(sup1[i], sup1e[i], sizeof sup1[i]), same1q += !memcmp(sup1[i], sparse[i], sizeof sup1[i]);
    CHECK(srows > 0 && sstale == 0 && same1e >= NJ - 1 &&
          kvs_engine_kv_counter(&ss, "kvserve:kv_quest_super_scored_total") > 0,
          "super-pages at super_keep 1 on cuda: %g sparse rows, %g stale (eager check), graphs vs eager %d of %d", srows,
          sstale, same1e, NJ);
    printf("ok engine on cuda: super-pages, every one kept = quest's tokens for %d/%d; at super_keep 1 %g sparse rows, "
           "0 stale, graphs = eager for %d/%d, quest's tokens for %d/%d\n", samesa, NJ, srows, same1e, NJ, same1q, NJ);
    kvs_model_free(model);
}

int main(void)
{
    const char *es = getenv("KVS_SEED");
    uint64_t seed = es ? strtoull(es, NULL, 10) : (uint64_t)time(NULL) * 2654435761u + (uint64_t)clock();
    if (!seed) seed = 1;
    setvbuf(stdout, NULL, _IOLBF, 0);
    printf("seed %llu (replay with KVS_SEED=%llu)\n", (unsigned long long)seed, (unsigned long long)seed);
    kvs_log_set_level(KVS_LOG_WARN);
    char err[256];
    bc = C->create(2, err, sizeof err);
    if (!bc) { fprintf(stderr, "cpu backend: %s\n", err); return 1; }
    bg = G->create(0, err, sizeof err);
    if (!bg) { fprintf(stderr, "cuda backend unavailable: %s\n", err); return 1; }
    REQUIRE(G->attention_spans, "the CUDA backend has no attention_spans");
    test_kernels(seed);
    test_super(seed);
    C->free(bc);
    G->free(bg);
    test_engine();
    return kvs_test_summary("test_cuda_kv_quest");
}
#else
int main(void)
{
    fprintf(stderr, "test_cuda_kv_quest: built without CUDA (nvcc not found)\n");
    return 1;
}
#endif
