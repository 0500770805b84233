/* test_engine_tiny.c: the full engine (scheduler + real runner + sampler) on the tiny test
 * models (tests/data/models/NAME), greedy, checked against two independent references:
 *   1. transformers' greedy continuations in <model>/reference.json (prompt lengths 1/7/33/100,
 *      32 tokens each);
 *   2. the runner run alone (one prefill of the whole prompt, then one token per forward,
 *      argmax) for a handful of random prompts.
 * Each set runs alone (max_running 1), batched with chunk sizes 1/7/64/unchunked, with
 * prefix reuse on and off, and with a KV pool small enough to force preemption.
 * Plain greedy requests take the device-argmax fast path (stats.argmax_tokens counts every one
 * of their tokens); a batch mixing them with greedy requests that need the host logits
 * (logprobs, top_logprobs) or are greedy through top_k = 1 gives the same tokens for all. */
#include "engine/config.h"
#include "engine/engine.h"
#include "engine/runner.h"
#include "base/util.h"
#include "models/model.h"
#include "tests/unit/test_util.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <string.h>

#define MAXJ 16
#define MAXP 128
#define GEN 32

struct job {
    int32_t prompt[MAXP];
    int n_prompt;
    int32_t want[GEN];
    int32_t got[GEN];
    int n_got;
    enum kvs_finish finish;
    int n_cached;
    int variant;                  /* sampling: 0 temperature 0; 1 + logprobs; 2 temperature 0.8, top_k 1;
                                   * 3 + top_logprobs 2 (all greedy: same tokens; 0 and 2 take the fast path) */
    struct kvs_request *r;
};

static uint64_t rng = 0x2545F4914F6CDD1DULL;
static uint32_t rnd(void) { return kvs_test_xorshift(&rng); }

static int load_reference(const char *model_dir, struct job *jobs)
{
    char path[1100], err[256];
    snprintf(path, sizeof path, "%s/reference.json", model_dir);
    char *txt = kvs_read_file(path, NULL, err, sizeof err);
    REQUIRE(txt, "%s", err);
    cJSON *j = cJSON_Parse(txt);
    free(txt);
    REQUIRE(j, "bad JSON in %s", path);
    cJSON *ps = cJSON_GetObjectItem(j, "prompts");
    int n = 0;
    cJSON *p;
    cJSON_ArrayForEach(p, ps)
    {
        cJSON *pr = cJSON_GetObjectItem(p, "prompt"), *g = cJSON_GetObjectItem(p, "greedy");
        REQUIRE(cJSON_GetArraySize(pr) <= MAXP && cJSON_GetArraySize(g) == GEN, "reference shape");
        struct job *jb = &jobs[n++];
        memset(jb, 0, sizeof *jb);
        jb->n_prompt = cJSON_GetArraySize(pr);
        for (int i = 0; i < jb->n_prompt; i++) jb->prompt[i] = cJSON_GetArrayItem(pr, i)->valueint;
        for (int i = 0; i < GEN; i++) jb->want[i] = cJSON_GetArrayItem(g, i)->valueint;
    }
    cJSON_Delete(j);
    return n;
}

static int argmax(const float *x, int n)
{
    int b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

/* Greedy with the runner alone: whole-prompt prefill, then one token per forward. */
static void runner_alone(const struct kvs_config *cfg, const struct kvs_model *m, struct job *j)
{
    struct kvs_runner *r;
    char err[256];
    int rc = kvs_runner_create(cfg, m, &r, err, sizeof err);
    REQUIRE(rc == 0, "%s", err);
    int bs = kvs_runner_block_size(r), V = kvs_runner_vocab_size(r);
    int32_t bt[64];
    int nb = (j->n_prompt + GEN + bs - 1) / bs;
    REQUIRE(nb <= 64 && nb <= kvs_runner_num_blocks(r), "pool too small for the reference");
    for (int i = 0; i < nb; i++) bt[i] = nb - 1 - i;   /* any order */
    float *lg = kvs_xmalloc((size_t)V * sizeof *lg);
    int32_t toks[MAXP + GEN];
    memcpy(toks, j->prompt, (size_t)j->n_prompt * sizeof *toks);
    int n = j->n_prompt, pos = 0;
    for (int g = 0; g < GEN; g++) {
        struct kvs_batch_seq s = {toks + pos, n - pos, pos, bt, (n + bs - 1) / bs, NULL, KVS_LOGITS_LAST, NULL, -1, 0, 0};
        struct kvs_batch b = {&s, 1, NULL};
        rc = kvs_runner_forward(r, &b, lg);
        REQUIRE(rc == 0, "forward %d", rc);
        pos = n;
        toks[n++] = argmax(lg, V);
        j->want[g] = toks[n - 1];
    }
    free(lg);
    kvs_runner_free(r);
}

static void run_engine(const struct kvs_config *cfg, const struct kvs_model *m, struct job *jobs, int n,
                       struct kvs_engine_stats *st_out)
{
    struct kvs_engine *e;
    char err[256];
    int rc = kvs_engine_create(cfg, m, NULL, &e, err, sizeof err);
    REQUIRE(rc == 0, "%s", err);
    for (int i = 0; i < n; i++) {
        struct kvs_request_params p;
        memset(&p, 0, sizeof p);
        p.prompt = jobs[i].prompt;
        p.n_prompt = jobs[i].n_prompt;
        p.max_tokens = GEN;
        p.sampling.top_p = 1;
        p.sampling.repetition_penalty = 1;
        p.sampling.logprobs = jobs[i].variant == 1;
        p.sampling.temperature = jobs[i].variant == 2 ? 0.8f : 0.0f;
        p.sampling.top_k = jobs[i].variant == 2 ? 1 : 0;
        p.sampling.top_logprobs = jobs[i].variant == 3 ? 2 : 0;
        p.ignore_eos = 1;
        p.skip_special = 1;
        jobs[i].r = kvs_request_new(&p, NULL, NULL);
        REQUIRE(jobs[i].r, "request_new");
        rc = kvs_engine_submit(e, jobs[i].r, err, sizeof err);
        REQUIRE(rc == 0, "submit: %s", err);
        jobs[i].n_got = 0;
        jobs[i].finish = KVS_FINISH_NONE;
    }
    for (int i = 0; i < n; i++) {
        struct kvs_event ev[16];
        while (jobs[i].finish == KVS_FINISH_NONE) {
            int k = kvs_request_wait(jobs[i].r, ev, 16, 60.0);
            REQUIRE(k > 0, "no event for 60 s");
            for (int q = 0; q < k; q++) {
                if (ev[q].type == KVS_EV_TOKEN) {
                    REQUIRE(jobs[i].n_got < GEN, "too many tokens");
                    jobs[i].got[jobs[i].n_got++] = ev[q].token;
                } else {
                    if (ev[q].type == KVS_EV_ERROR) fprintf(stderr, "error: %s\n", ev[q].error);
                    jobs[i].finish = ev[q].finish;
                    jobs[i].n_cached = ev[q].n_cached_tokens;
                }
                kvs_event_clear(&ev[q]);
            }
        }
        kvs_request_unref(jobs[i].r);
    }
    kvs_engine_stats(e, st_out);
    REQUIRE(st_out->kv_blocks_used == 0, "blocks still used: %d", st_out->kv_blocks_used);
    kvs_engine_free(e);
}

static void check_jobs(const char *what, struct job *jobs, int n)
{
    for (int i = 0; i < n; i++) {
        int ok = jobs[i].finish == KVS_FINISH_LENGTH && jobs[i].n_got == GEN &&
                 memcmp(jobs[i].got, jobs[i].want, sizeof jobs[i].want) == 0;
        if (!ok) {
            fprintf(stderr, "%s: request %d (prompt %d tokens): finish %d, %d tokens\n", what, i, jobs[i].n_prompt,
                    jobs[i].finish, jobs[i].n_got);
            for (int t = 0; t < GEN; t++) fprintf(stderr, "  %d: got %d want %d\n", t, jobs[i].got[t], jobs[i].want[t]);
            exit(1);
        }
    }
}

static void base_cfg(struct kvs_config *c)
{
    kvs_config_init(c);
    free(c->device);
    c->device = kvs_xstrdup("cpu");
    c->cpu_threads = 2;
    c->kv_block_size = 16;
    c->kv_memory_bytes = 4 << 20;
    c->max_batch_tokens = 256;
    c->max_running = 16;
    c->max_waiting = 64;
    c->max_model_len = 256;
}

static void set_str(char **f, const char *v)
{
    free(*f);
    *f = kvs_xstrdup(v);
}

static void test_model(const char *name)
{
    char dir[1024], err[256];
    snprintf(dir, sizeof dir, "%s/tests/data/models/%s", kvs_test_root(), name);
    struct kvs_model *m;
    int rc = kvs_model_load(dir, &m, err, sizeof err);
    REQUIRE(rc == 0, "%s", err);

    static struct job ref[MAXJ], rnd_jobs[MAXJ];
    int n_ref = load_reference(dir, ref);
    REQUIRE(n_ref == 4, "4 reference prompts");

    struct kvs_config c;
    base_cfg(&c);
    /* runner-alone references for random prompts, some sharing a prefix */
    int n_rnd = 8;
    for (int i = 0; i < n_rnd; i++) {
        memset(&rnd_jobs[i], 0, sizeof rnd_jobs[i]);
        rnd_jobs[i].n_prompt = 1 + (int)(rnd() % 90);
        for (int t = 0; t < rnd_jobs[i].n_prompt; t++)
            rnd_jobs[i].prompt[t] = (i >= 4 && t < 40) ? ref[3].prompt[t] : (int32_t)(rnd() % 1000);
        runner_alone(&c, m, &rnd_jobs[i]);
    }

    struct kvs_engine_stats st;
    /* alone */
    c.max_running = 1;
    run_engine(&c, m, ref, n_ref, &st);
    check_jobs("transformers greedy, alone", ref, n_ref);
    REQUIRE(st.argmax_tokens == st.generation_tokens && st.generation_tokens == (uint64_t)n_ref * GEN,
            "greedy tokens picked on the backend: %llu of %llu", (unsigned long long)st.argmax_tokens,
            (unsigned long long)st.generation_tokens);
    run_engine(&c, m, rnd_jobs, n_rnd, &st);
    check_jobs("runner alone vs engine alone", rnd_jobs, n_rnd);
    /* one at a time with kv.reuse=prefix (the default): later prompts sharing 40 tokens hit */
    REQUIRE(!strcmp(c.kv_reuse, "prefix") && st.cache_hits >= 32, "prefix hits %llu", (unsigned long long)st.cache_hits);
    c.max_running = 16;

    /* batched, chunked, prefix on/off */
    static struct job all[2 * MAXJ];
    int n_all = 0;
    for (int i = 0; i < n_ref; i++) all[n_all++] = ref[i];
    for (int i = 0; i < n_rnd; i++) all[n_all++] = rnd_jobs[i];
    int chunks[] = {1, 7, 64, 0};
    for (int ci = 0; ci < 4; ci++) {
        for (int reuse = 0; reuse < 2; reuse++) {
            c.prefill_chunk = chunks[ci];
            c.max_batch_tokens = chunks[ci] == 0 ? 256 : 64;
            set_str(&c.kv_reuse, reuse ? "prefix" : "none");
            run_engine(&c, m, all, n_all, &st);
            char what[64];
            snprintf(what, sizeof what, "batched, chunk %d, reuse %s", chunks[ci], reuse ? "prefix" : "none");
            check_jobs(what, all, n_all);
        }
    }
    /* greedy with and without the fast path in one batch: the same tokens */
    uint64_t fast = 0;
    for (int i = 0; i < n_all; i++) {
        all[i].variant = i % 4;
        fast += all[i].variant % 2 == 0 ? GEN : 0;
    }
    c.prefill_chunk = 7;
    c.max_batch_tokens = 64;
    run_engine(&c, m, all, n_all, &st);
    check_jobs("greedy fast path mixed with logprobs / top_k 1 / top_logprobs", all, n_all);
    REQUIRE(st.argmax_tokens == fast, "fast-path tokens %llu, want %llu", (unsigned long long)st.argmax_tokens,
            (unsigned long long)fast);
    for (int i = 0; i < n_all; i++) all[i].variant = 0;
    printf("%s: greedy fast path (%llu of %llu tokens picked on the backend) mixed with host-sampled greedy: same "
           "tokens\n", name, (unsigned long long)st.argmax_tokens, (unsigned long long)st.generation_tokens);

    /* a small pool: 12 blocks of 16 tokens for 12 requests of up to 132 tokens */
    size_t per_block = 0;
    {
        struct kvs_runner *r;
        rc = kvs_runner_create(&c, m, &r, err, sizeof err);
        REQUIRE(rc == 0, "%s", err);
        per_block = kvs_runner_kv_bytes_per_token(r) * 16;
        kvs_runner_free(r);
    }
    c.kv_memory_bytes = (int64_t)(per_block * 12);
    c.max_model_len = 192;
    c.prefill_chunk = 16;
    c.max_batch_tokens = 64;
    for (int reuse = 0; reuse < 2; reuse++) {
        set_str(&c.kv_reuse, reuse ? "prefix" : "none");
        run_engine(&c, m, all, n_all, &st);
        check_jobs("small pool (preemption)", all, n_all);
        REQUIRE(st.num_preemptions > 0, "expected preemptions");
        printf("%s: small pool, reuse %s: %llu preemptions, all match\n", name, reuse ? "prefix" : "none",
               (unsigned long long)st.num_preemptions);
    }
    kvs_config_free(&c);
    kvs_model_free(m);
    printf("%s: engine greedy == transformers (4 prompts) and == runner alone (%d prompts): alone, batched "
           "x chunk 1/7/64/unchunked x prefix on/off, preemption\n", name, n_rnd);
}

int main(void)
{
    kvs_log_set_level(KVS_LOG_WARN);
    test_model("llama");
    test_model("qwen3");
    return kvs_test_summary("test_engine_tiny");
}
