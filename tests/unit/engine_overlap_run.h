/* engine_overlap_run.h: how the scheduler overlap / async tests (tests/unit/test_sched_overlap.c on
 * the CPU backend, tests/gpu/test_cuda_async.c on CUDA) run their NJ requests through the whole
 * engine and collect what each gave, so that runs with scheduler.async or overlap on and off can
 * be compared. Header-only (static); one copy per test program.
 * Ownership: the caller owns cfg, the model and jobs[NJ]; overlap_run creates and frees its engine.
 * Errors: none returned: a config value the engine refuses, an engine that cannot be created, a
 * request that cannot be submitted, ends in an error, gives more than GEN tokens or a usage count
 * other than its events, stays silent for 60 s, or a run that ends with blocks still used fails
 * the test (REQUIRE). */
#ifndef KVS_TEST_ENGINE_OVERLAP_RUN_H
#define KVS_TEST_ENGINE_OVERLAP_RUN_H

#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "engine/config.h"
#include "engine/engine.h"
#include "engine/runner.h"
#include "tests/unit/test_util.h"

#define NJ 24   /* requests a run */
#define GEN 40  /* tokens a request at most (ignore_eos: exactly, unless a stop id ends it) */

/* scheduler.async as the config file or --set gives it (auto | true | false) */
static void set_async(struct kvs_config *c, const char *v)
{
    char kv[64], err[256];
    snprintf(kv, sizeof kv, "scheduler.async=%s", v);
    REQUIRE(kvs_config_set(c, kv, err, sizeof err) == 0, "%s", err);
}

/* one request: the caller fills prompt..logprobs (zero: greedy, no logprobs); run fills the rest */
struct job {
    int32_t prompt[64];
    int n_prompt;
    int32_t stop_id;         /* -1: none */
    int sampled, logprobs;   /* sampled: temperature 0.9, seed 1000 + its index */
    int32_t got[GEN];
    float lp[GEN];           /* with logprobs: each token's */
    int n_got;
    enum kvs_finish finish;
};

/* jobs[0..NJ) submitted at once on a fresh engine, each run to its end; st gets the engine's stats */
static void run(const struct kvs_config *cfg, const struct kvs_model *m, struct job *jobs, struct kvs_engine_stats *st)
{
    struct kvs_engine *e;
    struct kvs_request *r[NJ];
    char err[256];
    REQUIRE(kvs_engine_create(cfg, m, NULL, &e, err, sizeof err) == 0, "%s", err);
    for (int i = 0; i < NJ; i++) {
        struct kvs_request_params p;
        memset(&p, 0, sizeof p);
        p.prompt = jobs[i].prompt;
        p.n_prompt = jobs[i].n_prompt;
        p.max_tokens = GEN;
        p.sampling.top_p = 1;
        p.sampling.repetition_penalty = 1;
        p.sampling.temperature = jobs[i].sampled ? 0.9f : 0.0f;
        p.sampling.seed = 1000 + (uint64_t)i;
        p.sampling.has_seed = 1;
        p.sampling.logprobs = jobs[i].logprobs;
        p.ignore_eos = 1;
        if (jobs[i].stop_id >= 0) {
            p.stop_ids = &jobs[i].stop_id;
            p.n_stop_ids = 1;
        }
        r[i] = kvs_request_new(&p, NULL, NULL);
        REQUIRE(r[i], "request_new");
        REQUIRE(kvs_engine_submit(e, r[i], err, sizeof err) == 0, "submit: %s", err);
        jobs[i].n_got = 0;
        jobs[i].finish = KVS_FINISH_NONE;
    }
    for (int i = 0; i < NJ; i++) {
        struct kvs_event ev[16];
        while (jobs[i].finish == KVS_FINISH_NONE) {
            int k = kvs_request_wait(r[i], ev, 16, 60.0);
            REQUIRE(k > 0, "no event for 60 s");
            for (int q = 0; q < k; q++) {
                if (ev[q].type == KVS_EV_TOKEN) {
                    REQUIRE(jobs[i].n_got < GEN, "request %d: too many tokens", i);
                    jobs[i].lp[jobs[i].n_got] = ev[q].logprob;
                    jobs[i].got[jobs[i].n_got++] = ev[q].token;
                } else {
                    REQUIRE(ev[q].type == KVS_EV_DONE, "request %d: error %s", i, ev[q].error ? ev[q].error : "");
                    jobs[i].finish = ev[q].finish;
                    REQUIRE(ev[q].n_completion_tokens == jobs[i].n_got, "request %d: usage %d tokens, events %d", i,
                            ev[q].n_completion_tokens, jobs[i].n_got);
                }
                kvs_event_clear(&ev[q]);
            }
        }
        kvs_request_unref(r[i]);
    }
    kvs_engine_stats(e, st);
    REQUIRE(st->kv_blocks_used == 0, "blocks still used: %d", st->kv_blocks_used);
    kvs_engine_free(e);
}


/* the same output: finish reason, token count and token ids (logprobs not compared) */
static int same_tokens(const struct job *a, const struct job *b)
{
    return a->finish == b->finish && a->n_got == b->n_got && !memcmp(a->got, b->got, (size_t)a->n_got * sizeof *a->got);
}

/* shrinks c's KV pool to 10 blocks of 16 tokens, so that 16 or 24 running requests preempt */
static void small_pool(struct kvs_config *c, const struct kvs_model *m)
{
    struct kvs_runner *rn;
    char err[256];
    REQUIRE(kvs_runner_create(c, m, &rn, err, sizeof err) == 0, "%s", err);
    c->kv_memory_bytes = (int64_t)(kvs_runner_kv_bytes_per_token(rn) * 16 * 10);
    kvs_runner_free(rn);
}

/* ref[] run with scheduler.async false into off[], then true into on[] (async is left true);
 * st gets the async run's stats */
static void run_sync_then_async(struct kvs_config *c, const struct kvs_model *m, const struct job *ref, struct job *off,
                                struct job *on, struct kvs_engine_stats *st)
{
    memcpy(off, ref, NJ * sizeof *off);
    set_async(c, "false");
    run(c, m, off, st);
    memcpy(on, ref, NJ * sizeof *on);
    set_async(c, "true");
    run(c, m, on, st);
}

#endif
