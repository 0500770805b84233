/* test_kv_retro_engine.c: kv.decode=retro (engine/kv/kv_decode_retro.c) and the runner's
 * multi-row decode (engine/kv/kv.h recompute) on the CPU, through the runner and the engine:
 *   1. the seam: a test policy that re-runs each request's last 3 tokens with full attention
 *      gives full attention's logits, in steps that mix decode rows with prefill chunks (the
 *      re-run reproduces the same K/V);
 *   2. Retro with w = 1 gives Quest's logits bitwise (small budget: pages are skipped);
 *   3. Retro with budget = every page gives full attention's logits for w = 2, 4, 8;
 *   4. Retro at a small budget: supplements happen, effective budget > 1, and the logits
 *      differ from Quest's; the KL of both against full attention is printed;
 *   5. through the engine: greedy tokens of Retro w = 1 equal Quest's; 500 requests with
 *      shared prefixes, preemption and random cancellations leak no block and no request state,
 *      for kv.decode quest, retro (w = 4) and full in turn;
 *   6. Retro refuses kv.quest.super_pages (Quest's two-level selection) with a clear error. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/util.h"
#include "engine/config.h"
#include "engine/engine.h"
#include "engine/kv/kv.h"
#include "engine/kv/kv_decode_retro.h"
#include "engine/runner.h"
#include "models/model.h"
#include "tests/unit/kv_engine_run.h"
#include "tests/unit/test_util.h"

static struct kvs_model *model;

/* ---- a test policy with recompute: full attention, the last 3 tokens re-run ------------------ */
static int rc_asked, rc_rows;

static int trc_create(const struct kvs_kv_decode_env *env, void **state, char *err, size_t errlen)
{
    (void)err, (void)errlen;
    struct kvs_kv_decode_env *e = kvs_xmalloc(sizeof *e);
    *e = *env;
    *state = e;
    return 0;
}
static void trc_destroy(void *state) { free(state); }
static int trc_max(const struct kvs_config *cfg) { (void)cfg; return 3; }
static int trc_recompute(void *state, int slot)
{
    (void)state, (void)slot;
    rc_asked++;
    return 3;
}
static int trc_plan(void *state, const struct kvs_kv_step *st)
{
    (void)state;
    for (int s = 0; s < st->n_seqs; s++)
        if (st->h_decode[s]) rc_rows += st->h_q_start[s + 1] - st->h_q_start[s] - 1;
    return 0;
}
static void trc_attend(void *state, int layer, const struct kvs_kv_attend *a)
{
    (void)layer;
    const struct kvs_kv_decode_env *e = state;
    kvs_kv_attention(e->o, e->be, a, a->out);
}
static const struct kvs_kv_decode_ops test_recompute = {
    .name = "test_recompute", .exact = 1, .needs = KVS_KV_NO_GRAPHS, .rows_per_seq = 1,
    .create = trc_create, .destroy = trc_destroy, .plan = trc_plan, .attend = trc_attend,
    .max_recompute = trc_max, .recompute = trc_recompute,
};

/* ---- 1-4: the runner over fixed tokens ------------------------------------------------------- */
#define NS 3            /* sequences */
#define GEN 24          /* decode steps of each */
#define BPS 32          /* blocks per sequence (16 tokens each: 512 positions) */
#define V 1024          /* the test model's vocabulary (checked) */

static const int PLEN[NS] = {150, 230, 190};
static const int START[NS] = {0, 0, 6};   /* the step at which a sequence begins its prefill */
static int32_t toks[NS][512];

static void base_cfg(struct kvs_config *c, const char *decode)
{
    kvs_config_init(c);
    free(c->device), c->device = kvs_xstrdup("cpu");
    free(c->kv_reuse), c->kv_reuse = kvs_xstrdup("none");
    free(c->kv_decode), c->kv_decode = kvs_xstrdup(decode);
    c->cpu_threads = 2;
    c->kv_block_size = 16;
    c->kv_memory_bytes = 8 << 20;
    c->max_batch_tokens = 256;
    c->max_running = 4;
    c->max_waiting = 600;
    c->max_model_len = 512;
    c->quest_dense_layers = 0;
}

struct out {
    float lg[NS][GEN][V];
    double eff, past, sup, skip;
};

static double find(const struct kvs_kv_counter *c, int n, const char *name)
{
    for (int i = 0; i < n; i++)
        if (!strcmp(c[i].name, name)) return c[i].value;
    return 0;
}

/* Sequence s prefills in chunks of 64 from step START[s], then decodes its fixed tokens: steps
 * mix decode rows (first) with prefill chunks. */
static void run_seqs(const struct kvs_config *c, struct out *o)
{
    char err[256];
    struct kvs_runner *r;
    REQUIRE(kvs_runner_create(c, model, &r, err, sizeof err) == 0, "%s", err);
    REQUIRE(kvs_runner_vocab_size(r) == V, "vocabulary %d", kvs_runner_vocab_size(r));
    int32_t bt[NS][BPS];
    for (int s = 0; s < NS; s++)
        for (int j = 0; j < BPS; j++) bt[s][j] = (NS - 1 - s) * BPS + j;   /* not in order */
    int done[NS] = {0}, gen[NS] = {0};
    static float lg[NS][V];
    for (int step = 0;; step++) {
        struct kvs_batch_seq q[NS];
        int n = 0, who[NS];
        for (int pass = 0; pass < 2; pass++)
            for (int s = 0; s < NS; s++) {
                if (step < START[s] || gen[s] == GEN) continue;
                const int decoding = done[s] == PLEN[s];
                if (decoding != !pass) continue;
                const int len = decoding ? 1 : (PLEN[s] - done[s] < 64 ? PLEN[s] - done[s] : 64);
                q[n] = (struct kvs_batch_seq){.tokens = toks[s] + done[s] + gen[s], .n_tokens = len,
                                              .pos = done[s] + gen[s], .block_table = bt[s], .n_blocks = BPS,
                                              .want_logits = KVS_LOGITS_LAST, .slot = s,
                                              .slot_fresh = done[s] == 0};
                who[n++] = s;
            }
        if (!n) break;
        const struct kvs_batch b = {q, n, NULL};
        REQUIRE(kvs_runner_forward(r, &b, &lg[0][0]) == 0, "forward step %d", step);
        for (int i = 0; i < n; i++) {
            const int s = who[i];
            if (done[s] < PLEN[s]) {
                done[s] += q[i].n_tokens;
                if (done[s] < PLEN[s]) continue;
            } else {
                gen[s]++;
            }
            if (gen[s] < GEN) memcpy(o->lg[s][gen[s]], lg[i], sizeof lg[i]);   /* logits of the next token */
        }
    }
    struct kvs_kv_counter ct[64];
    const int nc = kvs_runner_kv_counters(r, ct, 64);
    o->eff = find(ct, nc, "kvserve:kv_retro_effective_budget");
    o->past = find(ct, nc, "kvserve:kv_retro_past_rows_total");
    o->sup = find(ct, nc, "kvserve:kv_retro_keys_supplement_total");
    o->skip = find(ct, nc, "kvserve:kv_retro_keys_skipped_total");
    kvs_runner_free(r);
}

static double max_diff(const struct out *a, const struct out *b)
{
    double m = 0;
    for (int s = 0; s < NS; s++)
        for (int g = 0; g < GEN; g++)
            for (int i = 0; i < V; i++) {
                const double d = fabs((double)a->lg[s][g][i] - b->lg[s][g][i]);
                m = d > m || d != d ? d : m;
            }
    return m;
}

/* mean KL(full || x) of the next-token distributions */
static double mean_kl(const struct out *full, const struct out *x)
{
    double sum = 0;
    for (int s = 0; s < NS; s++)
        for (int g = 0; g < GEN; g++) {
            const float *p = full->lg[s][g], *q = x->lg[s][g];
            double mp = -INFINITY, mq = -INFINITY, zp = 0, zq = 0, kl = 0;
            for (int i = 0; i < V; i++) mp = p[i] > mp ? p[i] : mp, mq = q[i] > mq ? q[i] : mq;
            for (int i = 0; i < V; i++) zp += exp(p[i] - mp), zq += exp(q[i] - mq);
            for (int i = 0; i < V; i++) {
                const double lp = p[i] - mp - log(zp), lq = q[i] - mq - log(zq);
                kl += exp(lp) * (lp - lq);
            }
            sum += kl;
        }
    return sum / (NS * GEN);
}

static void test_runner(void)
{
    static struct out full, x, quest, retro;
    struct kvs_config c;
    uint64_t rng = 0x3E7A0ull;
    for (int s = 0; s < NS; s++)
        for (int t = 0; t < 512; t++) toks[s][t] = 1 + (int32_t)(kvs_test_xorshift(&rng) % 500);
    base_cfg(&c, "full");
    run_seqs(&c, &full);
    kvs_config_free(&c);

    /* 1. the seam: re-run rows reproduce full attention */
    base_cfg(&c, "test_recompute");
    run_seqs(&c, &x);
    kvs_config_free(&c);
    CHECK(rc_rows > 0 && max_diff(&full, &x) == 0, "test_recompute: %d re-run rows, logits differ by %g", rc_rows,
          max_diff(&full, &x));
    printf("ok multi-row decode (3 re-run tokens, steps mixing prefill chunks): %d re-run rows, full attention's "
           "logits bitwise\n", rc_rows);

    /* 2. w = 1 is Quest */
    base_cfg(&c, "quest");
    c.quest_min_budget = 32;
    run_seqs(&c, &quest);
    kvs_config_free(&c);
    base_cfg(&c, "retro");
    c.quest_min_budget = 32;
    c.retro_window = 1;
    run_seqs(&c, &x);
    kvs_config_free(&c);
    CHECK(max_diff(&quest, &x) == 0 && x.past == 0, "retro w=1: logits differ from quest by %g, %g past rows",
          max_diff(&quest, &x), x.past);
    CHECK(max_diff(&quest, &full) > 1e-4, "quest at min budget 32 gave full attention's logits");
    printf("ok retro w=1 = quest bitwise (%d x %d logits rows; quest vs full max diff %.3g)\n", NS, GEN,
           max_diff(&quest, &full));

    /* 3. every page: dense for any w, with layer 0 dense or not, on the host and the device path
     * (the kept-rows path: past rows keep their cached outputs) */
    static const int W[] = {2, 4, 8};
    for (int v = 0; v < 4; v++)
        for (int i = 0; i < 3; i++) {
            base_cfg(&c, "retro");
            c.quest_budget_ratio = 1.0;
            c.quest_min_budget = 0;
            c.quest_dense_layers = v & 1;
            c.retro_window = W[i];
            kvs_retro_set_table_on_cpu(v >> 1);
            run_seqs(&c, &x);
            kvs_retro_set_table_on_cpu(0);
            kvs_config_free(&c);
            CHECK(max_diff(&full, &x) == 0 && x.past > 0 && x.sup == 0,
                  "retro w=%d every page (dense layers %d, %s path): logits differ from full by %g (%g past rows, %g "
                  "supplement keys)", W[i], v & 1, v >> 1 ? "device" : "host", max_diff(&full, &x), x.past, x.sup);
            printf("ok retro w=%d with every page (dense layers %d, %s path): %g past rows re-run, full attention's "
                   "logits bitwise\n", W[i], v & 1, v >> 1 ? "device" : "host", x.past);
        }

    /* 4. a small budget: supplements, closer to full than Quest (reported) */
    const double kq = mean_kl(&full, &quest);
    for (int i = 0; i < 3; i++) {
        base_cfg(&c, "retro");
        c.quest_min_budget = 32;
        c.retro_window = W[i];
        run_seqs(&c, &retro);
        kvs_config_free(&c);
        CHECK(retro.sup > 0 && retro.eff > 1.0 && max_diff(&quest, &retro) > 0,
              "retro w=%d at min budget 32: %g supplement keys, effective budget %g", W[i], retro.sup, retro.eff);
        /* a past query is supplemented only with keys it skipped in its own step, each once */
        CHECK(retro.skip > 0 && retro.sup <= retro.skip, "retro w=%d at min budget 32: %g supplement keys over %g "
              "skipped", W[i], retro.sup, retro.skip);
        printf("ok retro w=%d at min budget 32: effective budget %.3fx Quest's, %.1f%% of the skipped keys supplied, "
               "mean KL vs full %.3g (quest %.3g)\n", W[i], retro.eff, 100.0 * retro.sup / retro.skip,
               mean_kl(&full, &retro), kq);
    }

    /* 5. the device path (kernels/kv_retro.h's table: masks, spans, merge and output cache as
     * device work; here the CPU's table, kv_decode_retro.h) gives the host path's logits and
     * counters bitwise */
    for (int i = 0; i < 6; i++) {
        static struct out dev;
        base_cfg(&c, "retro");
        c.quest_min_budget = 32;
        c.quest_dense_layers = i / 3;   /* layer 0 dense: its past rows keep their cached outputs */
        c.retro_window = W[i % 3];
        run_seqs(&c, &retro);
        kvs_retro_set_table_on_cpu(1);
        run_seqs(&c, &dev);
        kvs_retro_set_table_on_cpu(0);
        kvs_config_free(&c);
        CHECK(max_diff(&retro, &dev) == 0 && dev.sup > 0 && dev.sup == retro.sup && dev.eff == retro.eff &&
              dev.past == retro.past && dev.skip == retro.skip, "retro w=%d dense layers %d device path: logits differ from the host path by "
              "%g, supplement keys %g vs %g", W[i % 3], i / 3, max_diff(&retro, &dev), dev.sup, retro.sup);
        printf("ok retro w=%d, dense layers %d: device path (CPU table) = host path bitwise (%g supplement keys)\n",
               W[i % 3], i / 3, dev.sup);
    }
}

/* ---- 5. the engine ------------------------------------------------------------------------- */
static void test_engine_tokens(void)
{
    enum { NJ = 6, G = 20 };
    static int32_t prompts[NJ][240], a[NJ][G], b[NJ][G];
    struct kvs_test_job ja[NJ], jb[NJ];
    uint64_t rng = 0x51ED2701ull;
    for (int i = 0; i < NJ; i++) {
        const int n = 120 + (int)(kvs_test_xorshift(&rng) % 110);
        for (int t = 0; t < n; t++) prompts[i][t] = 1 + (int32_t)(kvs_test_xorshift(&rng) % 1000);
        ja[i] = (struct kvs_test_job){prompts[i], n, NULL, 0, a[i], 0, KVS_FINISH_NONE};
        jb[i] = (struct kvs_test_job){prompts[i], n, NULL, 0, b[i], 0, KVS_FINISH_NONE};
    }
    char err[256];
    struct kvs_engine_stats st;
    struct kvs_config c;
    base_cfg(&c, "quest");
    c.quest_min_budget = 32;
    REQUIRE(kvs_test_engine_run(&c, model, ja, NJ, G, &st, err, sizeof err) == 0, "%s", err);
    kvs_config_free(&c);
    base_cfg(&c, "retro");
    c.quest_min_budget = 32;
    c.retro_window = 1;
    REQUIRE(kvs_test_engine_run(&c, model, jb, NJ, G, &st, err, sizeof err) == 0, "%s", err);
    kvs_config_free(&c);
    int same = 1;
    for (int i = 0; i < NJ; i++) same &= ja[i].n_got == G && jb[i].n_got == G && !memcmp(a[i], b[i], sizeof a[i]);
    CHECK(same, "engine: retro w=1 greedy tokens differ from quest's");
    printf("ok engine: retro w=1 gives quest's %d x %d greedy tokens\n", NJ, G);
}

/* 500 requests, random lengths, shared prefixes, random cancellations, a pool that preempts:
 * every request ends, every block comes back, every request state is freed */
static void stress(const char *decode)
{
    enum { N = 500, GL = 12 };
    struct kvs_config c;
    base_cfg(&c, decode);
    free(c.kv_reuse), c.kv_reuse = kvs_xstrdup("prefix");
    c.quest_min_budget = 32;
    c.retro_window = 4;
    c.kv_memory_bytes = 20 * 8192;
    c.max_waiting = N;
    char err[256];
    struct kvs_engine *e;
    REQUIRE(kvs_engine_create(&c, model, NULL, &e, err, sizeof err) == 0, "%s", err);
    struct kvs_test_stress sr;
    kvs_test_engine_stress(e, N, GL, 40, 150, 0xC0FFEEull, &sr);
    const struct kvs_engine_stats st = sr.st;
    const int finished = sr.finished, cancelled = sr.cancelled, n_cancel = sr.n_cancel;
    CHECK(finished + cancelled == N && cancelled <= n_cancel && finished >= N - n_cancel, "%s: %d finished, %d cancelled",
          decode, finished, cancelled);
    CHECK(st.kv_blocks_used == 0 && st.num_running == 0 && st.num_waiting == 0, "%s: blocks used %d, running %d",
          decode, st.kv_blocks_used, st.num_running);
    CHECK(st.num_preemptions > 0, "%s: no preemption", decode);
    const double live = kvs_engine_kv_counter(&st, "kvserve:kv_retro_live_states");
    const double past = kvs_engine_kv_counter(&st, "kvserve:kv_retro_past_rows_total");
    if (!strcmp(decode, "retro"))
        CHECK(live == 0 && past > 0, "retro: %g request states live after the run, %g past rows", live, past);
    printf("ok stress %s: %d requests (%d cancelled), %llu preemptions, all blocks free%s\n", decode, N, cancelled,
           (unsigned long long)st.num_preemptions, strcmp(decode, "retro") ? "" : ", no request state left");
    kvs_engine_free(e);
    kvs_config_free(&c);
}

/* 6. the two-level selection is Quest's alone: Retro refuses the key instead of ignoring it */
static void test_refuses_super_pages(void)
{
    struct kvs_config c;
    char err[256] = "";
    struct kvs_runner *r = NULL;
    base_cfg(&c, "retro");
    REQUIRE(kvs_config_set(&c, "kv.quest.super_pages=16", err, sizeof err) == 0, "%s", err);
    const int rc = kvs_runner_create(&c, model, &r, err, sizeof err);
    CHECK(rc == -ENOSYS && r == NULL && strstr(err, "kv.quest.super_pages"),
          "retro with kv.quest.super_pages 16: rc %d, \"%s\"", rc, err);
    if (r) kvs_runner_free(r);
    kvs_config_free(&c);
}

int main(void)
{
    kvs_log_set_level(KVS_LOG_WARN);
    char dir[1024], err[256];
    snprintf(dir, sizeof dir, "%s/tests/data/models/llama", kvs_test_root());
    REQUIRE(kvs_model_load(dir, &model, err, sizeof err) == 0, "%s", err);
    REQUIRE(kvs_kv_register_decode(&test_recompute) == 0, "register");
    test_runner();
    test_engine_tokens();
    test_refuses_super_pages();
    stress("retro");
    kvs_retro_set_table_on_cpu(1);   /* the device path's slots, resets and caches under churn */
    stress("retro");
    kvs_retro_set_table_on_cpu(0);
    stress("quest");
    stress("full");
    kvs_model_free(model);
    return kvs_test_summary("test_kv_retro_engine");
}
