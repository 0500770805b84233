/* test_prompt_logprobs.c: prompt scoring (kvs_request_params.prompt_logprobs, the engine side of
 * echo with logprobs) on the tiny llama test model, CPU. Reference: the runner alone, one
 * KVS_LOGITS_ALL forward of the whole prompt, log-softmax in double precision here. Checked:
 * one PROMPT event per position 1..n-1 in order, before any TOKEN, with the reference logprob
 * and top-3 (ids in order); max_tokens 0 ends LENGTH with no TOKEN; max_tokens 4 then
 * generates; chunked (7) and unchunked prefill; 6 scoring requests of up to 100 tokens at once
 * (more rows than KVS_PROMPT_LP_ROWS per step) next to plain requests; a prompt already in the
 * prefix cache is still scored in full; kv.reuse=lazy documents are refused (-ENOSYS). */
#include "engine/config.h"
#include "engine/engine.h"
#include "engine/runner.h"
#include "base/util.h"
#include "models/model.h"
#include "tests/unit/test_util.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#define MAXP 100
#define NJ 8

struct job {
    int32_t prompt[MAXP];
    int n;
    double want_lp[MAXP];       /* [pos] reference logprob of prompt[pos] */
    int32_t want_top[MAXP][3];
    int max_tokens, score;
    struct kvs_request *r;
};

static uint64_t rng = 0x9E3779B97F4A7C15ULL;

static void reference(const struct kvs_config *cfg, const struct kvs_model *m, struct job *j)
{
    struct kvs_runner *r;
    char err[256];
    REQUIRE(kvs_runner_create(cfg, m, &r, err, sizeof err) == 0, "%s", err);
    int bs = kvs_runner_block_size(r), V = kvs_runner_vocab_size(r);
    int32_t bt[64];
    int nb = (j->n + bs - 1) / bs;
    for (int i = 0; i < nb; i++) bt[i] = i;
    float *lg = kvs_xmalloc((size_t)j->n * (size_t)V * sizeof *lg);
    struct kvs_batch_seq s = {j->prompt, j->n, 0, bt, nb, NULL, KVS_LOGITS_ALL, NULL, -1, 0, 0};
    struct kvs_batch b = {&s, 1, NULL};
    REQUIRE(kvs_runner_forward(r, &b, lg) == 0, "reference forward");
    for (int p = 1; p < j->n; p++) {
        const float *row = lg + (size_t)(p - 1) * (size_t)V;
        double mx = -INFINITY, sum = 0;
        for (int v = 0; v < V; v++) mx = row[v] > mx ? row[v] : mx;
        for (int v = 0; v < V; v++) sum += exp(row[v] - mx);
        j->want_lp[p] = row[j->prompt[p]] - mx - log(sum);
        for (int k = 0; k < 3; k++) {
            int best = -1;
            for (int v = 0; v < V; v++) {
                int taken = 0;
                for (int q = 0; q < k; q++) taken |= j->want_top[p][q] == v;
                if (!taken && (best < 0 || row[v] > row[best])) best = v;
            }
            j->want_top[p][k] = best;
        }
    }
    free(lg);
    kvs_runner_free(r);
}

static void run(const struct kvs_config *cfg, const struct kvs_model *m, struct job *jobs, int n, const char *what)
{
    struct kvs_engine *e;
    char err[256];
    REQUIRE(kvs_engine_create(cfg, m, NULL, &e, err, sizeof err) == 0, "%s", err);
    for (int i = 0; i < n; i++) {
        struct kvs_request_params p;
        memset(&p, 0, sizeof p);
        p.prompt = jobs[i].prompt;
        p.n_prompt = jobs[i].n;
        p.max_tokens = jobs[i].max_tokens;
        p.sampling.top_p = 1;
        p.sampling.repetition_penalty = 1;
        p.sampling.top_logprobs = jobs[i].score ? 3 : 0;
        p.ignore_eos = 1;
        p.prompt_logprobs = jobs[i].score;
        jobs[i].r = kvs_request_new(&p, NULL, NULL);
        REQUIRE(jobs[i].r && kvs_engine_submit(e, jobs[i].r, err, sizeof err) == 0, "submit: %s", err);
    }
    for (int i = 0; i < n; i++) {
        struct job *j = &jobs[i];
        int next_pos = 1, n_tok = 0, done = 0;
        enum kvs_finish fin = KVS_FINISH_NONE;
        while (!done) {
            struct kvs_event ev[16];
            int k = kvs_request_wait(j->r, ev, 16, 60.0);
            REQUIRE(k > 0, "%s: no event for 60 s", what);
            for (int q = 0; q < k; q++) {
                if (ev[q].type == KVS_EV_PROMPT) {
                    REQUIRE(j->score && n_tok == 0, "%s: job %d: PROMPT event after a token or unasked", what, i);
                    int p = ev[q].pos;
                    REQUIRE(p == next_pos && ev[q].token == j->prompt[p], "%s: job %d: position %d, want %d", what, i,
                            p, next_pos);
                    REQUIRE(fabs(ev[q].logprob - j->want_lp[p]) < 2e-4, "%s: job %d pos %d: logprob %f want %f", what,
                            i, p, ev[q].logprob, j->want_lp[p]);
                    REQUIRE(ev[q].n_top == 3, "%s: n_top %d", what, ev[q].n_top);
                    for (int t = 0; t < 3; t++)
                        REQUIRE(ev[q].top_ids[t] == j->want_top[p][t], "%s: job %d pos %d top %d: %d want %d", what,
                                i, p, t, ev[q].top_ids[t], j->want_top[p][t]);
                    next_pos++;
                } else if (ev[q].type == KVS_EV_TOKEN) {
                    n_tok++;
                } else {
                    REQUIRE(ev[q].type == KVS_EV_DONE, "%s: error %s", what, ev[q].error ? ev[q].error : "");
                    fin = ev[q].finish;
                    REQUIRE(!j->score || ev[q].n_cached_tokens == 0, "%s: scored prompt took cache hits", what);
                    done = 1;
                }
                kvs_event_clear(&ev[q]);
            }
        }
        REQUIRE(!j->score || next_pos == j->n, "%s: job %d: %d of %d positions scored", what, i, next_pos - 1, j->n - 1);
        REQUIRE(fin == KVS_FINISH_LENGTH && n_tok == j->max_tokens, "%s: job %d: finish %d, %d tokens (want %d)", what,
                i, fin, n_tok, j->max_tokens);
        kvs_request_unref(j->r);
    }
    struct kvs_engine_stats st;
    kvs_engine_stats(e, &st);
    REQUIRE(st.kv_blocks_used == 0, "%s: blocks still used", what);
    kvs_engine_free(e);
    printf("%s: ok\n", what);
}

int main(void)
{
    kvs_log_set_level(KVS_LOG_WARN);
    char dir[1024], err[256];
    snprintf(dir, sizeof dir, "%s/tests/data/models/llama", kvs_test_root());
    struct kvs_model *m;
    REQUIRE(kvs_model_load(dir, &m, err, sizeof err) == 0, "%s", err);
    struct kvs_config c;
    kvs_config_init(&c);
    free(c.device);
    c.device = kvs_xstrdup("cpu");
    c.cpu_threads = 2;
    c.kv_memory_bytes = 8 << 20;
    c.max_batch_tokens = 256;
    c.max_running = 16;
    c.max_waiting = 64;
    c.max_model_len = 256;

    static struct job jobs[NJ];
    for (int i = 0; i < NJ; i++) {
        struct job *j = &jobs[i];
        memset(j, 0, sizeof *j);
        j->n = i == 0 ? 2 : 40 + (int)(kvs_test_xorshift(&rng) % 61);
        for (int t = 0; t < j->n; t++) j->prompt[t] = (int32_t)(kvs_test_xorshift(&rng) % 1000);
        j->score = i < 6;
        j->max_tokens = i % 2 ? 4 : (j->score ? 0 : 3);
        if (j->score) reference(&c, m, j);
    }
    run(&c, m, jobs, 1, "one short prompt, max_tokens 0, unchunked");
    run(&c, m, jobs, NJ, "6 scored + 2 plain, unchunked (rows over the per-step cap)");
    c.prefill_chunk = 7;
    run(&c, m, jobs, NJ, "6 scored + 2 plain, chunk 7");
    c.prefill_chunk = 0;
    /* the same prompt plain first (its blocks enter the prefix cache), then scored */
    static struct job twice[2];
    twice[0] = jobs[3];
    twice[0].score = 0;
    twice[0].max_tokens = 1;
    twice[1] = jobs[3];
    c.max_running = 1;   /* one after the other: the second finds the first's blocks */
    run(&c, m, twice, 2, "scored after the same prompt was cached (prefix reuse)");

    /* kv.reuse=lazy with documents: refused */
    free(c.kv_reuse);
    c.kv_reuse = kvs_xstrdup("lazy");
    struct kvs_engine *e;
    REQUIRE(kvs_engine_create(&c, m, NULL, &e, err, sizeof err) == 0, "%s", err);
    struct kvs_doc_segment doc = {1, jobs[1].prompt, 20};
    struct kvs_request_params p;
    memset(&p, 0, sizeof p);
    p.prompt = jobs[2].prompt;
    p.n_prompt = 5;
    p.max_tokens = 0;
    p.prompt_logprobs = 1;
    p.docs = &doc;
    p.n_docs = 1;
    struct kvs_request *r = kvs_request_new(&p, NULL, NULL);
    int rc = kvs_engine_submit(e, r, err, sizeof err);
    REQUIRE(rc == -ENOSYS, "lazy documents + prompt logprobs: rc %d (%s)", rc, err);
    kvs_request_unref(r);
    kvs_engine_free(e);
    printf("lazy documents + prompt logprobs: -ENOSYS (%s)\n", err);
    kvs_config_free(&c);
    kvs_model_free(m);
    return kvs_test_summary("test_prompt_logprobs");
}
