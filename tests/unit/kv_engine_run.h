/* kv_engine_run.h: the KV-strategy tests' way to run a few greedy requests through the whole
 * engine (scheduler + runner + sampler) and collect their tokens (test_kv_policies.c and each
 * strategy's test_kv_<name>.c). Header-only (static); one copy per test program.
 *
 * jobs[i] gives a prompt (and optionally one document, cited as a segment when the reuse
 * strategy caches documents); got[] receives up to gen greedy tokens (ignore_eos, so exactly gen
 * unless the request fails), finish how it ended. Returns 0, or the engine's create error
 * (message in err); a request that cannot be submitted, or one silent for 60 s, fails the test.
 *
 * kvs_test_engine_run submits every job at once: which requests share a step (and so how a
 * prompt is cut into chunks) then depends on when the engine thread wakes. A strategy whose
 * result depends on the chunking (LeanKV's dynamic prefill places the tokens leaving the window
 * at each chunk's end, docs/STRATEGIES.md section 5) needs kvs_test_engine_run_serial, which
 * submits job i + 1 only when job i has ended: every prompt is then cut the same way in every run. */
#ifndef KVS_TEST_KV_ENGINE_RUN_H
#define KVS_TEST_KV_ENGINE_RUN_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"
#include "tests/unit/test_util.h"

struct kvs_test_job {
    const int32_t *prompt;
    int n_prompt;
    const int32_t *doc;           /* NULL: no document */
    int n_doc;
    int32_t *got;                 /* [gen] */
    int n_got;
    enum kvs_finish finish;
};

#define KVS_TEST_MAX_JOBS 16

/* waits for job i's events until it ends, then drops the reference */
static void kvs_test_engine_collect(struct kvs_request *r, struct kvs_test_job *job, int gen)
{
    struct kvs_event ev[16];
    while (job->finish == KVS_FINISH_NONE) {
        int k = kvs_request_wait(r, ev, 16, 60.0);
        REQUIRE(k > 0, "no event for 60 s");
        for (int q = 0; q < k; q++) {
            if (ev[q].type == KVS_EV_TOKEN && job->n_got < gen) job->got[job->n_got++] = ev[q].token;
            if (ev[q].type == KVS_EV_ERROR) fprintf(stderr, "error: %s\n", ev[q].error);
            if (ev[q].type != KVS_EV_TOKEN) job->finish = ev[q].finish ? ev[q].finish : KVS_FINISH_ERROR;
            kvs_event_clear(&ev[q]);
        }
    }
    kvs_request_unref(r);
}

static int kvs_test_engine_run_mode(const struct kvs_config *cfg, const struct kvs_model *model,
                                    struct kvs_test_job *jobs, int n, int gen, int serial,
                                    struct kvs_engine_stats *st, char *err, size_t errlen)
{
    struct kvs_engine *e;
    int rc = kvs_engine_create(cfg, model, NULL, &e, err, errlen);
    if (rc) return rc;
    struct kvs_request *r[KVS_TEST_MAX_JOBS];
    REQUIRE(n <= KVS_TEST_MAX_JOBS, "%d jobs", n);
    for (int i = 0; i < n; i++) {
        struct kvs_request_params p;
        memset(&p, 0, sizeof p);
        struct kvs_doc_segment seg = {(uint64_t)(i + 1), jobs[i].doc, jobs[i].n_doc};
        p.prompt = jobs[i].prompt;
        p.n_prompt = jobs[i].n_prompt;
        p.docs = jobs[i].doc && jobs[i].n_doc ? &seg : NULL;
        p.n_docs = p.docs ? 1 : 0;
        p.max_tokens = gen;
        p.sampling.top_p = 1;
        p.sampling.repetition_penalty = 1;
        p.ignore_eos = 1;
        r[i] = kvs_request_new(&p, NULL, NULL);
        REQUIRE(r[i], "request_new");
        jobs[i].n_got = 0;
        jobs[i].finish = KVS_FINISH_NONE;
        REQUIRE(kvs_engine_submit(e, r[i], err, errlen) == 0, "submit: %s", err);
        if (serial) kvs_test_engine_collect(r[i], &jobs[i], gen);
    }
    for (int i = 0; !serial && i < n; i++) kvs_test_engine_collect(r[i], &jobs[i], gen);
    kvs_engine_stats(e, st);
    kvs_engine_free(e);
    return 0;
}

static int kvs_test_engine_run(const struct kvs_config *cfg, const struct kvs_model *model, struct kvs_test_job *jobs,
                               int n, int gen, struct kvs_engine_stats *st, char *err, size_t errlen)
{
    return kvs_test_engine_run_mode(cfg, model, jobs, n, gen, 0, st, err, errlen);
}

static inline int kvs_test_engine_run_serial(const struct kvs_config *cfg, const struct kvs_model *model,
                                             struct kvs_test_job *jobs, int n, int gen,
                                             struct kvs_engine_stats *st, char *err, size_t errlen)
{
    return kvs_test_engine_run_mode(cfg, model, jobs, n, gen, 1, st, err, errlen);
}

/* The strategies' cancellation stress: n greedy requests of gen tokens on an engine the caller
 * built (a small pool, so that it preempts), prompts of min_len + [0, len_span) random tokens whose
 * first part is shared within three families (prefix sharing), a quarter of them cancelled at a
 * random token (at submit for token 0). Waits for every request to end, then fills out->st.
 * Fails the test if a request cannot be submitted or stays silent for 60 s. */
struct kvs_test_stress {
    int finished;   /* ended by length */
    int cancelled;  /* ended by cancellation */
    int n_cancel;   /* cancellations asked for */
    struct kvs_engine_stats st;
};

static inline void kvs_test_engine_stress(struct kvs_engine *e, int n, int gen, int min_len, int len_span, uint64_t seed,
                                          struct kvs_test_stress *out)
{
    enum { MAXP = 200 };
    REQUIRE(min_len + len_span <= MAXP && n > 0 && gen > 0, "stress shape");
    int32_t *prompts = calloc((size_t)n * MAXP, sizeof *prompts);
    struct kvs_request **r = calloc((size_t)n, sizeof *r);
    int *cancel_at = calloc((size_t)n, sizeof *cancel_at);
    REQUIRE(prompts && r && cancel_at, "out of memory");
    uint64_t rng = seed, fam = 0xFA11ull;
    int32_t family[3][MAXP];
    char err[256];
    for (int f = 0; f < 3; f++)
        for (int t = 0; t < MAXP; t++) family[f][t] = 1 + (int32_t)(kvs_test_xorshift(&fam) % 1000);
    memset(out, 0, sizeof *out);
    for (int i = 0; i < n; i++) {
        int32_t *pr = prompts + (size_t)i * MAXP;
        const int len = min_len + (int)(kvs_test_xorshift(&rng) % (unsigned)len_span);
        const int shared = (int)(kvs_test_xorshift(&rng) % (unsigned)len);
        for (int t = 0; t < len; t++) pr[t] = t < shared ? family[i % 3][t] : 1 + (int32_t)(kvs_test_xorshift(&rng) % 1000);
        cancel_at[i] = kvs_test_xorshift(&rng) % 4 == 0 ? (int)(kvs_test_xorshift(&rng) % (unsigned)gen) : -1;
        out->n_cancel += cancel_at[i] >= 0;
        struct kvs_request_params p;
        memset(&p, 0, sizeof p);
        p.prompt = pr;
        p.n_prompt = len;
        p.max_tokens = gen;
        p.sampling.top_p = 1;
        p.sampling.repetition_penalty = 1;
        p.ignore_eos = 1;
        r[i] = kvs_request_new(&p, NULL, NULL);
        REQUIRE(r[i] && kvs_engine_submit(e, r[i], err, sizeof err) == 0, "submit %d: %s", i, err);
        if (cancel_at[i] == 0) kvs_request_cancel(r[i]);
    }
    for (int i = 0; i < n; i++) {
        int got = 0, done = 0;
        struct kvs_event ev[16];
        while (!done) {
            int k = kvs_request_wait(r[i], ev, 16, 60.0);
            REQUIRE(k > 0, "no event for 60 s");
            for (int q = 0; q < k; q++) {
                if (ev[q].type == KVS_EV_TOKEN && ++got == cancel_at[i]) kvs_request_cancel(r[i]);
                if (ev[q].type != KVS_EV_TOKEN) {
                    done = 1;
                    out->finished += ev[q].finish == KVS_FINISH_LENGTH;
                    out->cancelled += ev[q].finish == KVS_FINISH_CANCELLED;
                }
                kvs_event_clear(&ev[q]);
            }
        }
        kvs_request_unref(r[i]);
    }
    kvs_engine_stats(e, &out->st);
    free(prompts);
    free(r);
    free(cancel_at);
}

#endif
