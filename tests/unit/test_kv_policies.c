/* test_kv_policies.c: the KV seam (engine/kv/kv.h) as a table over its registry, through the
 * whole engine (scheduler + runner + sampler) on the tiny Llama test model, CPU backend:
 *   1. every built decode policy at its neutral setting gives full attention's greedy tokens,
 *      bitwise (today: full, plus the two test policies of kv_test_policies.h; each new policy
 *      adds a row to NEUTRAL below); planned-but-unbuilt names are refused with -ENOSYS;
 *   2. an approximate policy (test_window) is measured by the live fidelity meter
 *      (kv.fidelity.sample_every): the rel-L2 histogram fills, bytes read < bytes full;
 *      with full attention the meter reports exactly 0;
 *   3. the composition matrix: every refused pair is refused by the registry with a message
 *      naming both keys; every combination of built strategies serves requests (with
 *      documents, so the lazy document cache runs its side prefills) and exports all its KV
 *      counters, fidelity meter on (none past KVS_KV_MAX_COUNTERS);
 *   4. per-request policy state: each admitted request gets a zeroed arena slot (seq_init)
 *      and gives it back (seq_free), preemption included. */
#include "base/util.h"
#include "engine/config.h"
#include "engine/engine.h"
#include "engine/kv/fidelity.h"
#include "engine/kv/kv.h"
#include "models/model.h"
#include "tests/unit/kv_engine_run.h"
#include "tests/unit/kv_test_policies.h"
#include "tests/unit/test_util.h"

#include <stdio.h>
#include <string.h>

#define NJ 6
#define GEN 24
#define MAXP 96

struct job {
    int32_t prompt[MAXP];
    int n_prompt;
    int32_t doc[40];
    int n_doc;
    int32_t got[GEN];
    int n_got;
    enum kvs_finish finish;
};

static struct kvs_model *model;
static uint64_t rng = 0x9E3779B97F4A7C15ull;

static void set_str(char **f, const char *v)
{
    free(*f);
    *f = kvs_xstrdup(v);
}

static void base_cfg(struct kvs_config *c, const char *storage, const char *reuse, const char *decode)
{
    kvs_config_init(c);
    set_str(&c->device, "cpu");
    set_str(&c->kv_storage, storage);
    set_str(&c->kv_reuse, reuse);
    set_str(&c->kv_decode, decode);
    c->cpu_threads = 2;
    c->kv_block_size = 16;
    c->kv_memory_bytes = 4 << 20;
    c->max_batch_tokens = 128;
    c->max_running = 4;
    c->max_waiting = 64;
    c->max_model_len = 256;
}

static void make_jobs(struct job *jobs, int with_docs)
{
    for (int i = 0; i < NJ; i++) {
        struct job *j = &jobs[i];
        memset(j, 0, sizeof *j);
        j->n_prompt = 20 + (int)(kvs_test_xorshift(&rng) % 60);
        for (int t = 0; t < j->n_prompt; t++) j->prompt[t] = 1 + (int32_t)(kvs_test_xorshift(&rng) % 200);
        if (with_docs) {
            /* two requests share each document: the second one hits the document cache */
            uint64_t drng = 1000 + (uint64_t)(i / 2);
            j->n_doc = 17 + (int)(drng % 20);
            for (int t = 0; t < j->n_doc; t++) j->doc[t] = 1 + (int32_t)(kvs_test_xorshift(&drng) % 200);
        }
    }
}

/* Runs the jobs through an engine with cfg; 0, or the engine's create error (message in err). */
static int run(const struct kvs_config *cfg, struct job *jobs, struct kvs_engine_stats *st, char *err, size_t errlen)
{
    struct kvs_test_job tj[NJ];
    for (int i = 0; i < NJ; i++)
        tj[i] = (struct kvs_test_job){jobs[i].prompt, jobs[i].n_prompt, jobs[i].n_doc ? jobs[i].doc : NULL, jobs[i].n_doc, jobs[i].got, 0, KVS_FINISH_NONE};
    int rc = kvs_test_engine_run(cfg, model, tj, NJ, GEN, st, err, errlen);
    for (int i = 0; i < NJ; i++) {
        jobs[i].n_got = tj[i].n_got;
        jobs[i].finish = tj[i].finish;
    }
    return rc;
}

static int same_tokens(const struct job *a, const struct job *b)
{
    for (int i = 0; i < NJ; i++)
        if (a[i].n_got != GEN || b[i].n_got != GEN || memcmp(a[i].got, b[i].got, sizeof a[i].got)) return 0;
    return 1;
}

/* ---- 1. neutral settings ------------------------------------------------------------------ */

/* Each built decode policy and how to put it at its neutral setting (NULL: it has none to set). */
static void neutral_window(void) { test_window_w = 1 << 30, test_window_sink = 0; }
static const struct {
    const char *name;
    void (*neutral)(void);
} NEUTRAL[] = {
    {"full", NULL},
    {"test_spans", NULL},
    {"test_window", neutral_window},
    /* the default min_budget of 256 tokens covers these contexts (at most 104): every page */
    {"quest", NULL},
    {"mac", NULL},   /* kv.mac.gen_min (2048) is above every context here: no lookup */
    {"paris", NULL}, /* kv.paris.dense_threshold (2000) is above every context here: dense */
    /* Quest's budget covers every page (as above) and w = 2 re-runs each request's previous
     * token: no supplement, and the re-run reproduces the same states (kv_decode_retro.c) */
    {"retro", NULL},
};

static void test_neutral(void)
{
    static struct job ref[NJ], got[NJ];
    char err[256];
    struct kvs_engine_stats st;
    struct kvs_config c;
    make_jobs(ref, 0);
    base_cfg(&c, "auto", "none", "full");
    REQUIRE(run(&c, ref, &st, err, sizeof err) == 0, "%s", err);
    kvs_config_free(&c);
    for (int i = 0; i < NJ; i++) REQUIRE(ref[i].n_got == GEN, "reference request %d: %d tokens", i, ref[i].n_got);

    const char *names[32];
    int n = kvs_kv_names("decode", names, 32);
    int covered = 0;
    for (int k = 0; k < n; k++) {
        if (!kvs_kv_find_decode(names[k])) {
            /* planned, not built: refused by name */
            base_cfg(&c, "auto", "none", names[k]);
            int rc = kvs_config_validate(&c, err, sizeof err);
            CHECK(rc == -ENOSYS && strstr(err, "kv.decode") && strstr(err, names[k]), "unbuilt %s: rc %d (%s)",
                  names[k], rc, err);
            kvs_config_free(&c);
            continue;
        }
        int row = -1;
        for (size_t i = 0; i < sizeof NEUTRAL / sizeof NEUTRAL[0]; i++)
            if (!strcmp(NEUTRAL[i].name, names[k])) row = (int)i;
        REQUIRE(row >= 0, "decode policy %s has no row in NEUTRAL", names[k]);
        if (NEUTRAL[row].neutral) NEUTRAL[row].neutral();
        memcpy(got, ref, sizeof got);
        base_cfg(&c, "auto", "none", names[k]);
        REQUIRE(run(&c, got, &st, err, sizeof err) == 0, "%s: %s", names[k], err);
        kvs_config_free(&c);
        CHECK(same_tokens(ref, got), "%s at its neutral setting: greedy tokens differ from full attention", names[k]);
        printf("ok %s at its neutral setting: %d requests x %d greedy tokens equal to full attention\n", names[k], NJ,
               GEN);
        covered++;
    }
    CHECK(covered == (int)(sizeof NEUTRAL / sizeof NEUTRAL[0]), "%d built policies tested", covered);
}

/* ---- 2. the fidelity meter ---------------------------------------------------------------- */

static void test_fidelity(void)
{
    static struct job jobs[NJ];
    char err[256];
    struct kvs_engine_stats st;
    struct kvs_config c;
    make_jobs(jobs, 0);
    base_cfg(&c, "auto", "none", "full");
    c.kv_fidelity_sample_every = 1;
    REQUIRE(run(&c, jobs, &st, err, sizeof err) == 0, "%s", err);
    double cnt = kvs_engine_kv_counter(&st, "kvserve:kv_fidelity_rel_l2_count");
    double sum = kvs_engine_kv_counter(&st, "kvserve:kv_fidelity_rel_l2_sum");
    double rd = kvs_engine_kv_counter(&st, "kvserve:kv_decode_bytes_read_total");
    double full = kvs_engine_kv_counter(&st, "kvserve:kv_decode_bytes_full_total");
    CHECK(cnt >= NJ * (GEN - 1) / 2 && sum == 0 && rd == full && full > 0,
          "full: %g samples, rel-L2 sum %g, read %g of %g bytes", cnt, sum, rd, full);
    printf("ok fidelity meter on full attention: %g sampled rows, rel-L2 exactly 0, bytes read = full (%g)\n", cnt, full);
    kvs_config_free(&c);

    test_window_w = 8, test_window_sink = 2;
    base_cfg(&c, "auto", "none", "test_window");
    c.kv_fidelity_sample_every = 2;
    REQUIRE(run(&c, jobs, &st, err, sizeof err) == 0, "%s", err);
    cnt = kvs_engine_kv_counter(&st, "kvserve:kv_fidelity_rel_l2_count");
    sum = kvs_engine_kv_counter(&st, "kvserve:kv_fidelity_rel_l2_sum");
    rd = kvs_engine_kv_counter(&st, "kvserve:kv_decode_bytes_read_total");
    full = kvs_engine_kv_counter(&st, "kvserve:kv_decode_bytes_full_total");
    int in_hist = 0;
    double last = 0;
    for (int i = 0; i < st.n_kv_counters; i++)
        if (st.kv_counters[i].le) {
            CHECK(st.kv_counters[i].value >= last, "histogram buckets are cumulative");
            last = st.kv_counters[i].value;
            in_hist++;
        }
    CHECK(cnt > 0 && sum / cnt > 1e-4 && rd > 0 && rd < 0.5 * full && in_hist == KVS_FID_BUCKETS && last == cnt,
          "window 2+8: %g samples, mean rel-L2 %g, read %g of %g bytes, %d buckets", cnt, sum / (cnt > 0 ? cnt : 1), rd,
          full, in_hist);
    printf("ok fidelity meter on a 2+8 sliding window: %g sampled rows, mean rel-L2 %.3g, KV read %.1f%% of full\n", cnt,
           sum / cnt, 100.0 * rd / full);
    kvs_config_free(&c);
    neutral_window();
}

/* ---- 3. the composition matrix ------------------------------------------------------------ */

static void test_matrix(void)
{
    char err[256];
    const char *sa, *a, *sb, *b, *why;
    int allowed, refused = 0;
    for (int i = 0; kvs_kv_matrix_row(i, &sa, &a, &sb, &b, &allowed, &why) == 0; i++) {
        const char *names[3] = {"auto", "none", "full"};
        const char *slots[3] = {"storage", "reuse", "decode"};
        for (int k = 0; k < 3; k++) {
            if (!strcmp(slots[k], sa)) names[k] = a;
            if (!strcmp(slots[k], sb)) names[k] = b;
        }
        const struct kvs_kv_storage_ops *st;
        const struct kvs_kv_reuse_ops *ru;
        const struct kvs_kv_decode_ops *dc;
        err[0] = 0;
        int rc = kvs_kv_resolve(names[0], names[1], names[2], &st, &ru, &dc, err, sizeof err);
        char ka[64], kb[64];
        snprintf(ka, sizeof ka, "'kv.%s' = \"%s\"", sa, a);
        snprintf(kb, sizeof kb, "'kv.%s' = \"%s\"", sb, b);
        if (!allowed) {
            CHECK(rc == -EINVAL && strstr(err, ka) && strstr(err, kb) && strstr(err, why),
                  "pair %s + %s: rc %d, message \"%s\"", ka, kb, rc, err);
            refused++;
        } else {
            /* allowed under a condition the strategy enforces: never refused by the matrix */
            CHECK(kvs_kv_check_pair(sa, a, sb, b, err, sizeof err) == 0, "conditional pair %s + %s refused", ka, kb);
        }
    }
    CHECK(refused >= 6, "%d refused pairs in the matrix", refused);
    printf("ok composition matrix: %d refused pairs refused with both keys and the reason\n", refused);

    /* every combination of built strategies serves requests with documents */
    static struct job jobs[NJ];
    make_jobs(jobs, 1);
    const char *storages[8], *reuses[8], *decodes[16];
    int ns = kvs_kv_names("storage", storages, 8), nr = kvs_kv_names("reuse", reuses, 8);
    int nd = kvs_kv_names("decode", decodes, 16), served = 0, max_counters = 0;
    for (int i = 0; i < ns; i++)
        for (int j = 0; j < nr; j++)
            for (int k = 0; k < nd; k++) {
                if (!kvs_kv_find_storage(storages[i]) || !kvs_kv_find_reuse(reuses[j]) || !kvs_kv_find_decode(decodes[k]))
                    continue;
                struct kvs_config c;
                base_cfg(&c, storages[i], reuses[j], decodes[k]);
                c.kv_fidelity_sample_every = 4;   /* the meter's counters too: every list must fit */
                struct kvs_engine_stats st;
                int rc = kvs_config_validate(&c, err, sizeof err);
                if (rc == 0) rc = run(&c, jobs, &st, err, sizeof err);
                kvs_config_free(&c);
                char why[256];
                if (kvs_kv_check_pair("reuse", reuses[j], "decode", decodes[k], why, sizeof why) < 0 ||
                    kvs_kv_check_pair("storage", storages[i], "decode", decodes[k], why, sizeof why) < 0) {
                    /* refused by the matrix (part 3's first half checks the message) */
                    CHECK(rc == -EINVAL, "storage %s, reuse %s, decode %s: not refused (rc %d)", storages[i], reuses[j],
                          decodes[k], rc);
                    continue;
                }
                if (!strcmp(storages[i], "bf16")) {
                    /* the cpu backend stores f32: refused with a message, never ignored */
                    CHECK(rc < 0 && strstr(err, "bf16"), "bf16 storage on cpu: rc %d (%s)", rc, err);
                    continue;
                }
                if (!strcmp(storages[i], "lean") && !strcmp(decodes[k], "mac")) {
                    /* the matrix allows it (quantization only); MAC's kernels over LeanKV pages
                     * are not built: refused at startup, naming both */
                    CHECK(rc == -ENOSYS && strstr(err, "mac") && strstr(err, "lean"), "lean + mac: rc %d (%s)", rc,
                          err);
                    continue;
                }
                int ok = rc == 0;
                for (int q = 0; ok && q < NJ; q++) ok = jobs[q].finish == KVS_FINISH_LENGTH && jobs[q].n_got == GEN;
                CHECK(ok, "storage %s, reuse %s, decode %s: rc %d (%s)", storages[i], reuses[j], decodes[k], rc, err);
                CHECK(!ok || st.kv_counters_dropped == 0, "storage %s, reuse %s, decode %s: %d counters past "
                      "KVS_KV_MAX_COUNTERS (%d) left out of /metrics", storages[i], reuses[j], decodes[k],
                      st.kv_counters_dropped, KVS_KV_MAX_COUNTERS);
                if (ok && st.n_kv_counters > max_counters) max_counters = st.n_kv_counters;
                if (ok && !strcmp(reuses[j], "lazy"))
                    CHECK(kvs_engine_kv_counter(&st, "kvserve:doc_cache_hits_total") > 0, "lazy: no document hit");
                served += ok;
            }
    printf("ok %d combinations of built strategies serve %d requests with documents each; at most %d KV counters "
           "exported (room %d, none dropped)\n", served, NJ, max_counters, KVS_KV_MAX_COUNTERS);
}

/* ---- 4. per-request state ----------------------------------------------------------------- */

static void test_request_state(void)
{
    static struct job jobs[NJ];
    char err[256];
    struct kvs_engine_stats st;
    struct kvs_config c;
    make_jobs(jobs, 0);
    base_cfg(&c, "auto", "prefix", "test_spans");
    c.kv_memory_bytes = 96 * 1024;   /* a few blocks: requests preempt each other */
    tp_inits = tp_frees = tp_plans = 0;
    REQUIRE(run(&c, jobs, &st, err, sizeof err) == 0, "%s", err);
    for (int q = 0; q < NJ; q++) CHECK(jobs[q].n_got == GEN, "request %d: %d tokens", q, jobs[q].n_got);
    CHECK(tp_inits >= NJ && tp_frees == tp_inits && tp_plans > 0, "slots: %d inits, %d frees, %d plans", tp_inits,
          tp_frees, tp_plans);
    CHECK(kvs_engine_kv_counter(&st, "kvserve:kv_decode_state_bytes") == (double)(sizeof(uint64_t) * 4),
          "arena bytes %g", kvs_engine_kv_counter(&st, "kvserve:kv_decode_state_bytes"));
    printf("ok per-request policy state: %d slot inits (%llu preemptions), as many frees\n", tp_inits,
           (unsigned long long)st.num_preemptions);
    kvs_config_free(&c);

    /* a budget too small for the arena is refused at startup, naming the key */
    base_cfg(&c, "auto", "none", "test_spans");
    c.kv_decode_state_bytes = 8;
    struct kvs_engine *e = NULL;
    int rc = kvs_engine_create(&c, model, NULL, &e, err, sizeof err);
    CHECK(rc == -ENOMEM && strstr(err, "kv.decode_state_bytes"), "arena budget: rc %d (%s)", rc, err);
    if (e) kvs_engine_free(e);
    kvs_config_free(&c);
}

int main(void)
{
    kvs_log_set_level(KVS_LOG_WARN);
    kvs_test_register_policies();
    char dir[1024], err[256];
    snprintf(dir, sizeof dir, "%s/tests/data/models/llama", kvs_test_root());
    REQUIRE(kvs_model_load(dir, &model, err, sizeof err) == 0, "%s", err);
    test_neutral();
    test_fidelity();
    test_matrix();
    test_request_state();
    kvs_model_free(model);
    return kvs_test_summary("test_kv_policies");
}
