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

static void test_kernels(void)
{
    const struct kvs_backend_ops *o = &kvs_cpu_backend;
    char err[256];
    struct kvs_backend *be = o->create(2, err, sizeof err);
    REQUIRE(be, "%s", err);
    const struct kvs_quest_kernels *k = kvs_quest_kernels_for(o, err, sizeof err);
    REQUIRE(k, "%s", err);
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

static double counter(const struct kvs_engine_stats *st, const char *name)
{
    return kvs_engine_kv_counter(st, name);
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

    /* a small budget: fewer bytes, other outputs, exact digests under sharing and preemption */
    base_cfg(&c, "prefix", "quest");
    c.quest_budget_ratio = 0.15;
    c.quest_min_budget = 32;
    c.kv_memory_bytes = 18 * 8192;   /* 24 blocks of 8 KiB for 4 running requests of 9-16 blocks: preemption */
    c.kv_fidelity_sample_every = 1;
    kvs_quest_set_check(1);
    REQUIRE(run(&c, got, &st, err, sizeof err) == 0, "%s", err);
    kvs_quest_set_check(0);
    const double rows = counter(&st, "kvserve:kv_quest_sparse_rows_total");
    const double stale = counter(&st, "kvserve:kv_quest_stale_digests_total");
    const double rd = counter(&st, "kvserve:kv_decode_bytes_read_total");
    const double full = counter(&st, "kvserve:kv_decode_bytes_full_total");
    const double kept = counter(&st, "kvserve:kv_quest_pages_kept_total");
    const double pages = counter(&st, "kvserve:kv_quest_pages_total");
    const double l2 = counter(&st, "kvserve:kv_fidelity_rel_l2_sum") / counter(&st, "kvserve:kv_fidelity_rel_l2_count");
    CHECK(rows >= NJ * (GEN - 1) / 2 && stale == 0 && rd < 0.7 * full && kept < 0.5 * pages && l2 > 1e-4,
          "sparse: %g rows, %g stale pages, read %g of %g bytes, %g of %g pages, mean rel-L2 %g", rows, stale, rd, full,
          kept, pages, l2);
    CHECK(st.num_preemptions > 0, "the small pool preempted nothing");
    printf("ok quest at 15%% (min 32): %g sparse rows, KV read %.1f%% of full, pages kept %.1f%%, mean rel-L2 %.3g, "
           "%llu preemptions, 0 stale digests\n",
           rows, 100 * rd / full, 100 * kept / pages, l2, (unsigned long long)st.num_preemptions);
    kvs_config_free(&c);

    /* the check's negative control: refreshes skipped every other step leave stale digests */
    base_cfg(&c, "none", "quest");
    c.quest_min_budget = 32;
    kvs_quest_set_check(2);
    REQUIRE(run(&c, got, &st, err, sizeof err) == 0, "%s", err);
    kvs_quest_set_check(0);
    CHECK(counter(&st, "kvserve:kv_quest_stale_digests_total") > 0, "the digest check saw no stale page when refreshes "
          "were skipped");
    printf("ok the digest check catches skipped refreshes (%g stale pages)\n",
           counter(&st, "kvserve:kv_quest_stale_digests_total"));
    kvs_config_free(&c);

    /* prefix sharing (no preemption) gives the tokens of private blocks */
    base_cfg(&c, "none", "quest");
    c.quest_min_budget = 32;
    REQUIRE(run(&c, got, &st, err, sizeof err) == 0, "%s", err);
    kvs_config_free(&c);
    base_cfg(&c, "prefix", "quest");
    c.quest_min_budget = 32;
    REQUIRE(run(&c, shared, &st, err, sizeof err) == 0, "%s", err);
    CHECK(counter(&st, "kvserve:kv_quest_sparse_rows_total") > 0 && st.cache_hits >= 96,
          "sparse rows %g, prefix cache hits %llu", counter(&st, "kvserve:kv_quest_sparse_rows_total"),
          (unsigned long long)st.cache_hits);
    CHECK(same_tokens(got, shared), "quest with prefix sharing: tokens differ from private blocks");
    CHECK(!same_tokens(ref, got), "quest at a small budget gave full attention's tokens for every request");
    printf("ok quest with prefix sharing (%llu prompt tokens from the cache) gives the tokens of private blocks\n",
           (unsigned long long)st.cache_hits);
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
    const double stale = counter(&st, "kvserve:kv_quest_stale_digests_total");
    const double rows = counter(&st, "kvserve:kv_quest_sparse_rows_total");
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
    char dir[1024], err[256];
    snprintf(dir, sizeof dir, "%s/tests/data/models/llama", kvs_test_root());
    REQUIRE(kvs_model_load(dir, &model, err, sizeof err) == 0, "%s", err);
    test_engine();
    test_stress();
    kvs_model_free(model);
    return kvs_test_summary("test_kv_quest");
}
