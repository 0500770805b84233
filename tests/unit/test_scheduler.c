/* test_scheduler.c: the engine + scheduler over a deterministic fake model (fake_model.h),
 * checked against fake_reference() (greedy continuation computed without the engine):
 *   - batch invariance: alone, batched with 1..64 others, prefill chunks 1/7/64/unchunked,
 *     a pool small enough to force preemption (greedy and seeded sampling); greedy requests
 *     take the argmax fast path (every token, KVS_LOGITS_ARGMAX rows), sampled ones never;
 *   - prefix reuse: identical outputs with and without, expected hit counts;
 *   - stress: 500 requests, random lengths, random cancellations, preemption, shared prefixes:
 *     every non-cancelled request correct, no deadlock, every block free at the end;
 *   - -EAGAIN on a full queue, -E2BIG / -EINVAL / -ESHUTDOWN, metrics values, stop strings
 *     (never emitted, held back while ambiguous), logprobs, timeout, shutdown with requests
 *     in flight;
 *   - the fake's rules for build/kvserve-fake (next-byte prompt logprobs scored over chunk
 *     boundaries, reverse picks, injected failure). */
#include "engine/config.h"
#include "engine/engine.h"
#include "engine/kv/kv.h"
#include "engine/engine_exec.h"
#include "tests/fake/fake_model.h"
#include "tests/unit/test_util.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#define VOCAB 64
#define BS 4
#define MAXP 96
#define MAXG 48

static uint64_t rng = 0x9e3779b97f4a7c15ULL;
static uint32_t rnd(void) { return kvs_test_xorshift(&rng); }

struct job {
    int32_t prompt[MAXP];
    int n_prompt, max_tokens, ignore_eos;
    float temperature;
    int top_logprobs;
    const char *stop[2];
    int n_stop;
    int cancel_after;             /* -1: never; k: cancel after k token events */
    double timeout_s;
    /* expected */
    int32_t ref[MAXG];
    int n_ref;
    /* observed */
    struct kvs_request *r;
    int32_t out[MAXG];
    int n_out;
    char text[1024];
    int n_text;
    enum kvs_finish finish;
    struct kvs_event done;
    int cancelled;
};

static void job_ref(struct job *j)
{
    j->n_ref = fake_reference(VOCAB, j->prompt, j->n_prompt, j->max_tokens, j->ignore_eos, j->ref);
}

static void random_job(struct job *j, int max_prompt, int max_gen)
{
    memset(j, 0, sizeof *j);
    j->n_prompt = 1 + (int)(rnd() % (unsigned)max_prompt);
    for (int i = 0; i < j->n_prompt; i++) j->prompt[i] = 1 + (int32_t)(rnd() % (VOCAB - 1));
    j->max_tokens = 1 + (int)(rnd() % (unsigned)max_gen);
    j->ignore_eos = rnd() % 2;
    j->cancel_after = -1;
    job_ref(j);
}

static struct kvs_config make_cfg(int max_batch_tokens, int max_running, int max_waiting, int chunk, const char *reuse)
{
    struct kvs_config c;
    memset(&c, 0, sizeof c);
    c.max_batch_tokens = max_batch_tokens;
    c.max_running = max_running;
    c.max_waiting = max_waiting;
    c.prefill_chunk = chunk;
    c.kv_storage = (char *)"auto";
    c.kv_reuse = (char *)reuse;
    c.kv_decode = (char *)"full";
    return c;
}

static void submit_job(struct kvs_engine *e, struct job *j)
{
    struct kvs_request_params p;
    memset(&p, 0, sizeof p);
    p.prompt = j->prompt;
    p.n_prompt = j->n_prompt;
    p.max_tokens = j->max_tokens;
    p.sampling.temperature = j->temperature;
    p.sampling.top_p = 1;
    p.sampling.repetition_penalty = 1;
    p.sampling.seed = 1234;
    p.sampling.has_seed = 1;
    p.sampling.logprobs = j->top_logprobs > 0;
    p.sampling.top_logprobs = j->top_logprobs;
    p.ignore_eos = j->ignore_eos;
    p.skip_special = 1;
    p.stop_strings = j->stop;
    p.n_stop_strings = j->n_stop;
    p.timeout_s = j->timeout_s;
    j->r = kvs_request_new(&p, NULL, NULL);
    REQUIRE(j->r);
    char err[256];
    int rc = kvs_engine_submit(e, j->r, err, sizeof err);
    if (rc != 0) fprintf(stderr, "submit: %d %s\n", rc, err);
    REQUIRE(rc == 0);
    j->n_out = 0;
    j->n_text = 0;
    j->finish = KVS_FINISH_NONE;
}

/* Drains j's events until DONE/ERROR; cancels after cancel_after tokens. */
static void collect(struct job *j)
{
    struct kvs_event ev[32];
    for (;;) {
        int n = kvs_request_wait(j->r, ev, 32, 30.0);
        if (n == 0) {
            fprintf(stderr, "FAIL: no event for 30 s (deadlock?) request %llu\n", (unsigned long long)kvs_request_id(j->r));
            exit(1);
        }
        for (int i = 0; i < n; i++) {
            if (ev[i].type == KVS_EV_TOKEN) {
                REQUIRE(j->n_out < MAXG);
                j->out[j->n_out++] = ev[i].token;
                int l = (int)strlen(ev[i].text);
                REQUIRE(j->n_text + l < (int)sizeof j->text);
                memcpy(j->text + j->n_text, ev[i].text, (size_t)l + 1);
                j->n_text += l;
                if (j->top_logprobs) {
                    REQUIRE(ev[i].n_top == j->top_logprobs);
                    REQUIRE(ev[i].logprob <= 0);
                    for (int k = 1; k < ev[i].n_top; k++) REQUIRE(ev[i].top_logprobs[k] <= ev[i].top_logprobs[k - 1]);
                }
                if (j->cancel_after >= 0 && j->n_out >= j->cancel_after && !j->cancelled) {
                    kvs_request_cancel(j->r);
                    j->cancelled = 1;
                }
                kvs_event_clear(&ev[i]);
            } else {
                REQUIRE(i == n - 1);   /* nothing after the final event */
                j->finish = ev[i].finish;
                if (ev[i].type == KVS_EV_ERROR) fprintf(stderr, "request error: %s\n", ev[i].error);
                j->done = ev[i];
                j->done.error = NULL;
                j->done.text = NULL;
                kvs_event_clear(&ev[i]);
                kvs_request_unref(j->r);
                j->r = NULL;
                return;
            }
        }
    }
}

static void check_exact(const struct job *j)
{
    int ok = j->n_out == j->n_ref && memcmp(j->out, j->ref, (size_t)j->n_ref * sizeof(int32_t)) == 0;
    enum kvs_finish want = (j->n_ref > 0 && j->ref[j->n_ref - 1] == FAKE_EOS && !j->ignore_eos) ? KVS_FINISH_STOP
                                                                                                  : KVS_FINISH_LENGTH;
    if (!ok || j->finish != want) {
        fprintf(stderr, "mismatch: prompt %d max %d ignore_eos %d: got %d tokens finish %d, want %d finish %d\n",
                j->n_prompt, j->max_tokens, j->ignore_eos, j->n_out, j->finish, j->n_ref, want);
        for (int i = 0; i < j->n_out || i < j->n_ref; i++)
            fprintf(stderr, "  %d: got %d want %d\n", i, i < j->n_out ? j->out[i] : -1, i < j->n_ref ? j->ref[i] : -1);
        exit(1);
    }
    REQUIRE(j->done.n_prompt_tokens == j->n_prompt);
    REQUIRE(j->done.n_completion_tokens == j->n_ref);
}

struct run_result {
    struct kvs_engine_stats st;
    int max_seqs, max_tokens;
    int argmax_rows;              /* KVS_LOGITS_ARGMAX rows the fake answered */
};

/* Runs jobs through a fresh engine (all submitted at once) and returns its stats. */
static struct run_result run_jobs(struct kvs_config *cfg, int n_blocks, struct job *jobs, int n)
{
    struct fake_model m;
    fake_model_init(&m, n_blocks, BS, VOCAB, 256);
    struct kvs_engine_exec x = fake_exec(&m);
    struct kvs_engine *e;
    char err[256];
    int rc = kvs_engine_create_exec(cfg, &x, &e, err, sizeof err);
    if (rc) fprintf(stderr, "create: %s\n", err);
    REQUIRE(rc == 0);
    for (int i = 0; i < n; i++) submit_job(e, &jobs[i]);
    for (int i = 0; i < n; i++) collect(&jobs[i]);
    struct run_result res;
    kvs_engine_stats(e, &res.st);
    REQUIRE(res.st.kv_blocks_used == 0 && res.st.num_running == 0 && res.st.num_waiting == 0);
    REQUIRE(m.errors == 0);
    res.max_seqs = m.max_seqs_seen;
    res.max_tokens = m.max_tokens_seen;
    res.argmax_rows = m.n_argmax_rows;
    kvs_engine_free(e);
    fake_model_free(&m);
    return res;
}

static void test_invariance(void)
{
    enum { N = 65 };
    static struct job jobs[N];
    for (int i = 0; i < N; i++) random_job(&jobs[i], 60, 30);
    /* alone: one running request at a time */
    struct kvs_config c = make_cfg(64, 1, 1000, 0, "none");
    struct run_result r0 = run_jobs(&c, 1024, jobs, N);
    for (int i = 0; i < N; i++) check_exact(&jobs[i]);
    REQUIRE(r0.st.argmax_tokens == r0.st.generation_tokens && r0.st.generation_tokens > 0 &&
            r0.argmax_rows == (int)r0.st.argmax_tokens);   /* greedy: every token through the fast path */
    printf("alone (max_running=1): %d requests match the reference\n", N);

    int sizes[] = {2, 16, 65};
    int chunks[] = {1, 7, 64, 0};
    for (int si = 0; si < 3; si++) {
        for (int ci = 0; ci < 4; ci++) {
            int mbt = chunks[ci] == 0 ? 4096 : 96;
            c = make_cfg(mbt, 64, 1000, chunks[ci], "none");
            struct run_result rr = run_jobs(&c, 2048, jobs, sizes[si]);
            for (int i = 0; i < sizes[si]; i++) check_exact(&jobs[i]);
            REQUIRE(rr.max_tokens <= mbt);
            REQUIRE(rr.max_seqs <= 64);
            REQUIRE(rr.st.num_preemptions == 0);
            if (sizes[si] > 2 && chunks[ci] != 1) REQUIRE(rr.max_seqs > 1);   /* really batched */
        }
    }
    printf("batched with 1..64 others x chunk 1/7/64/unchunked: all match\n");

    /* a pool of 30 blocks (120 tokens) for 65 requests of up to 90 tokens: preemption */
    for (int ci = 0; ci < 4; ci++) {
        c = make_cfg(chunks[ci] == 0 ? 4096 : 64, 32, 1000, chunks[ci], "none");
        struct run_result rr = run_jobs(&c, 30, jobs, N);
        for (int i = 0; i < N; i++) check_exact(&jobs[i]);
        REQUIRE(rr.st.num_preemptions > 0);
        printf("small pool, chunk %d: all match, %llu preemptions\n", chunks[ci], (unsigned long long)rr.st.num_preemptions);
    }

    /* seeded sampling: the sampler state continues across preemption */
    enum { NS = 24 };
    static struct job sj[NS];
    static int32_t first[NS][MAXG];
    static int n_first[NS];
    for (int i = 0; i < NS; i++) {
        random_job(&sj[i], 60, 30);
        sj[i].temperature = 0.9f;
        sj[i].ignore_eos = 1;
    }
    c = make_cfg(64, 1, 1000, 0, "none");
    r0 = run_jobs(&c, 1024, sj, NS);
    REQUIRE(r0.st.argmax_tokens == 0 && r0.argmax_rows == 0);   /* sampled: never the fast path */
    int differs_from_greedy = 0;
    for (int i = 0; i < NS; i++) {
        n_first[i] = sj[i].n_out;
        memcpy(first[i], sj[i].out, sizeof first[i]);
        REQUIRE(sj[i].n_out == sj[i].max_tokens);
        differs_from_greedy |= memcmp(sj[i].out, sj[i].ref, (size_t)sj[i].n_out * sizeof(int32_t)) != 0;
    }
    REQUIRE(differs_from_greedy);
    c = make_cfg(64, 24, 1000, 7, "none");
    struct run_result rr = run_jobs(&c, 24, sj, NS);
    REQUIRE(rr.st.num_preemptions > 0);
    for (int i = 0; i < NS; i++)
        REQUIRE(sj[i].n_out == n_first[i] && memcmp(sj[i].out, first[i], (size_t)n_first[i] * sizeof(int32_t)) == 0);
    printf("seeded sampling: identical alone and under preemption (%llu preemptions)\n",
           (unsigned long long)rr.st.num_preemptions);
}

static void test_prefix(void)
{
    /* A: 40-token prompt. B: A's first 32 tokens + 8 others. A2: same as A. */
    static struct job a, b, a2;
    random_job(&a, 1, 1);
    a.n_prompt = 40;
    for (int i = 0; i < 40; i++) a.prompt[i] = 1 + (int32_t)(rnd() % (VOCAB - 1));
    a.max_tokens = 10;
    a.ignore_eos = 1;
    job_ref(&a);
    b = a;
    for (int i = 32; i < 40; i++) b.prompt[i] = 1 + (b.prompt[i] % (VOCAB - 2));
    job_ref(&b);
    a2 = a;

    struct fake_model m;
    fake_model_init(&m, 256, BS, VOCAB, 256);
    struct kvs_engine_exec x = fake_exec(&m);
    struct kvs_config c = make_cfg(64, 8, 100, 16, "prefix");
    struct kvs_engine *e;
    char err[256];
    REQUIRE(kvs_engine_create_exec(&c, &x, &e, err, sizeof err) == 0);
    submit_job(e, &a);
    collect(&a);
    check_exact(&a);
    REQUIRE(a.done.n_cached_tokens == 0);
    submit_job(e, &b);
    collect(&b);
    check_exact(&b);
    REQUIRE(b.done.n_cached_tokens == 32);
    submit_job(e, &a2);
    collect(&a2);
    check_exact(&a2);
    REQUIRE(a2.done.n_cached_tokens == 36);   /* (40-1)/4 full blocks: the last token is recomputed */
    struct kvs_engine_stats st;
    kvs_engine_stats(e, &st);
    REQUIRE(st.cache_queries == 120 && st.cache_hits == 68);
    REQUIRE(st.kv_blocks_used == 0 && st.kv_blocks_cached > 0);
    /* A's generated tokens were cached too: a prompt = A's prompt + its first 8 outputs */
    static struct job a3;
    a3 = a;
    memcpy(a3.prompt + 40, a.ref, 8 * sizeof(int32_t));
    a3.n_prompt = 48;
    job_ref(&a3);
    submit_job(e, &a3);
    collect(&a3);
    check_exact(&a3);
    REQUIRE(a3.done.n_cached_tokens == 44);
    kvs_engine_free(e);
    fake_model_free(&m);
    printf("prefix reuse: hits 0/32/36/44 tokens as expected, outputs match\n");

    /* identical outputs with and without reuse for a batch with shared prefixes, with a pool
     * small enough to evict and preempt */
    enum { N = 48 };
    static struct job jobs[N];
    int32_t fam[3][MAXP];
    for (int f = 0; f < 3; f++)
        for (int i = 0; i < MAXP; i++) fam[f][i] = 1 + (int32_t)(rnd() % (VOCAB - 1));
    for (int i = 0; i < N; i++) {
        random_job(&jobs[i], 70, 20);
        int shared = (int)(rnd() % (unsigned)jobs[i].n_prompt);
        memcpy(jobs[i].prompt, fam[i % 3], (size_t)shared * sizeof(int32_t));
        job_ref(&jobs[i]);
    }
    c = make_cfg(48, 16, 1000, 16, "none");
    struct run_result r0 = run_jobs(&c, 40, jobs, N);
    for (int i = 0; i < N; i++) check_exact(&jobs[i]);
    c = make_cfg(48, 16, 1000, 16, "prefix");
    struct run_result r1 = run_jobs(&c, 40, jobs, N);
    for (int i = 0; i < N; i++) check_exact(&jobs[i]);
    REQUIRE(r0.st.cache_hits == 0 && r1.st.cache_hits > 0);
    printf("with/without prefix reuse: identical (%llu of %llu prompt tokens hit, %llu preemptions)\n",
           (unsigned long long)r1.st.cache_hits, (unsigned long long)r1.st.cache_queries,
           (unsigned long long)r1.st.num_preemptions);
}

static void test_stress(void)
{
    enum { N = 500 };
    static struct job jobs[N];
    int32_t fam[4][MAXP];
    for (int f = 0; f < 4; f++)
        for (int i = 0; i < MAXP; i++) fam[f][i] = 1 + (int32_t)(rnd() % (VOCAB - 1));
    int n_cancel = 0;
    for (int i = 0; i < N; i++) {
        random_job(&jobs[i], 80, 40);
        if (rnd() % 2) {
            int shared = (int)(rnd() % (unsigned)jobs[i].n_prompt);
            memcpy(jobs[i].prompt, fam[rnd() % 4], (size_t)shared * sizeof(int32_t));
            job_ref(&jobs[i]);
        }
        if (rnd() % 5 == 0) {
            jobs[i].cancel_after = (int)(rnd() % 10);
            n_cancel++;
        }
    }
    struct fake_model m;
    fake_model_init(&m, 48, BS, VOCAB, 256);
    struct kvs_engine_exec x = fake_exec(&m);
    struct kvs_config c = make_cfg(64, 24, 1000, 16, "prefix");
    struct kvs_engine *e;
    char err[256];
    REQUIRE(kvs_engine_create_exec(&c, &x, &e, err, sizeof err) == 0);
    for (int i = 0; i < N; i++) {
        submit_job(e, &jobs[i]);
        if (jobs[i].cancel_after == 0) {   /* cancelled before it could start */
            kvs_request_cancel(jobs[i].r);
            jobs[i].cancelled = 1;
        }
    }
    for (int i = 0; i < N; i++) collect(&jobs[i]);
    int n_ok = 0, n_cancelled = 0;
    uint64_t gen = 0;
    for (int i = 0; i < N; i++) {
        struct job *j = &jobs[i];
        gen += (uint64_t)j->n_out;
        if (j->finish == KVS_FINISH_CANCELLED) {
            REQUIRE(j->cancelled);
            REQUIRE(j->n_out <= j->n_ref && memcmp(j->out, j->ref, (size_t)j->n_out * sizeof(int32_t)) == 0);
            REQUIRE(j->done.n_completion_tokens >= j->n_out);
            n_cancelled++;
        } else {
            check_exact(j);
            n_ok++;
        }
    }
    struct kvs_engine_stats st;
    kvs_engine_stats(e, &st);
    REQUIRE(st.kv_blocks_used == 0 && st.num_running == 0 && st.num_waiting == 0);
    REQUIRE(st.requests_finished == N);
    REQUIRE(st.num_preemptions > 0);
    REQUIRE(st.generation_tokens >= gen);
    REQUIRE(m.errors == 0);
    kvs_engine_free(e);
    fake_model_free(&m);
    printf("stress: %d requests (%d finished correctly, %d cancelled), %llu preemptions, %llu steps, all blocks free\n",
           N, n_ok, n_cancelled, (unsigned long long)st.num_preemptions, (unsigned long long)st.steps);
}

static void test_queue_and_errors(void)
{
    struct fake_model m;
    fake_model_init(&m, 64, BS, VOCAB, 200);
    struct kvs_engine_exec x = fake_exec(&m);
    struct kvs_config c = make_cfg(64, 1, 3, 0, "none");
    struct kvs_engine *e;
    char err[256];
    REQUIRE(kvs_engine_create_exec(&c, &x, &e, err, sizeof err) == 0);
    REQUIRE(kvs_engine_max_context(e) == 200);
    fake_gate(&m, 1);
    static struct job jobs[6];
    for (int i = 0; i < 6; i++) {
        random_job(&jobs[i], 10, 5);
        jobs[i].ignore_eos = 1;
        job_ref(&jobs[i]);
    }
    submit_job(e, &jobs[0]);
    /* wait until the first request runs (and blocks in the gated forward) */
    for (int t = 0; t < 5000; t++) {
        pthread_mutex_lock(&m.mu);
        int busy = m.n_entered > 0;
        pthread_mutex_unlock(&m.mu);
        if (busy) break;
        usleep(1000);
    }
    for (int i = 1; i <= 3; i++) submit_job(e, &jobs[i]);
    /* the 4th waiting request is refused at once */
    struct kvs_request_params p;
    memset(&p, 0, sizeof p);
    p.prompt = jobs[4].prompt;
    p.n_prompt = jobs[4].n_prompt;
    p.max_tokens = 4;
    struct kvs_request *r = kvs_request_new(&p, NULL, NULL);
    double t0 = kvs_now();
    REQUIRE(kvs_engine_submit(e, r, err, sizeof err) == -EAGAIN);
    REQUIRE(kvs_now() - t0 < 0.1);
    struct kvs_engine_stats st;
    kvs_engine_stats(e, &st);
    REQUIRE(st.requests_rejected == 1 && st.num_waiting == 3 && st.num_running == 1);
    kvs_request_unref(r);

    /* errors: context, vocabulary, empty prompt, max_tokens, resubmission */
    p.max_tokens = 200;
    r = kvs_request_new(&p, NULL, NULL);
    REQUIRE(kvs_engine_submit(e, r, err, sizeof err) == -E2BIG);
    REQUIRE(strstr(err, "maximum context length is 200 tokens"));
    kvs_request_unref(r);
    int32_t bad[2] = {1, VOCAB};
    p.prompt = bad;
    p.n_prompt = 2;
    p.max_tokens = 4;
    r = kvs_request_new(&p, NULL, NULL);
    REQUIRE(kvs_engine_submit(e, r, err, sizeof err) == -EINVAL);
    kvs_request_unref(r);
    p.n_prompt = 0;
    r = kvs_request_new(&p, NULL, NULL);
    REQUIRE(kvs_engine_submit(e, r, err, sizeof err) == -EINVAL);
    kvs_request_unref(r);
    p.n_prompt = 1;
    p.max_tokens = 0;
    r = kvs_request_new(&p, NULL, NULL);
    REQUIRE(kvs_engine_submit(e, r, err, sizeof err) == -EINVAL);
    kvs_request_unref(r);
    REQUIRE(kvs_engine_submit(e, jobs[1].r, err, sizeof err) == -EINVAL);

    fake_gate(&m, 0);
    for (int i = 0; i <= 3; i++) {
        collect(&jobs[i]);
        check_exact(&jobs[i]);
        REQUIRE(jobs[i].done.e2e_s >= jobs[i].done.ttft_s && jobs[i].done.ttft_s >= jobs[i].done.queue_time_s);
        REQUIRE(jobs[i].done.ttft_s > 0);
    }
    kvs_engine_stats(e, &st);
    uint64_t gen = 0, prompt = 0;
    for (int i = 0; i <= 3; i++) gen += (uint64_t)jobs[i].n_out, prompt += (uint64_t)jobs[i].n_prompt;
    REQUIRE(st.requests_finished == 4 && st.generation_tokens == gen && st.prompt_tokens == prompt);
    REQUIRE(st.steps >= gen && st.busy_s > 0 && st.kv_blocks_total == 64 && st.block_size == BS);
    REQUIRE(st.cache_queries == 0 && st.num_preemptions == 0);

    /* drain: no more admissions */
    kvs_engine_drain(e);
    p.max_tokens = 2;
    r = kvs_request_new(&p, NULL, NULL);
    REQUIRE(kvs_engine_submit(e, r, err, sizeof err) == -ESHUTDOWN);
    kvs_request_unref(r);
    kvs_engine_free(e);

    /* strategies not built in this version are refused by name, unknown names too */
    const char *bad_kv[16][3] = {{"f16", "none", "full"}};
    int n_bad = 1;
    {   /* and whichever decode policies the registry still lists as planned */
        const char *names[16];
        int nd = kvs_kv_names("decode", names, 16);
        for (int k = 0; k < nd && n_bad < 16; k++)
            if (!kvs_kv_find_decode(names[k])) {
                bad_kv[n_bad][0] = "auto", bad_kv[n_bad][1] = "none", bad_kv[n_bad][2] = names[k];
                n_bad++;
            }
    }
    for (int i = 0; i < n_bad; i++) {
        c.kv_storage = (char *)bad_kv[i][0];
        c.kv_reuse = (char *)bad_kv[i][1];
        c.kv_decode = (char *)bad_kv[i][2];
        int rc = kvs_engine_create_exec(&c, &x, &e, err, sizeof err);
        REQUIRE(rc == (i == 0 ? -EINVAL : -ENOSYS) && e == NULL);
        REQUIRE(strstr(err, "kv."));
    }
    fake_model_free(&m);
    printf("queue limit -EAGAIN (immediate), -E2BIG/-EINVAL/-ESHUTDOWN, metrics, unbuilt strategies -ENOSYS: ok\n");
}

static void test_text_stop_logprobs_timeout(void)
{
    struct fake_model m;
    fake_model_init(&m, 256, BS, VOCAB, 256);
    struct kvs_engine_exec x = fake_exec(&m);
    struct kvs_config c = make_cfg(64, 16, 100, 8, "none");
    struct kvs_engine *e;
    char err[256];
    REQUIRE(kvs_engine_create_exec(&c, &x, &e, err, sizeof err) == 0);

    /* find requests whose reference text contains a 3-character stop string starting late
     * enough that hold-back matters */
    int found = 0;
    for (int attempt = 0; attempt < 500 && found < 8; attempt++) {
        static struct job j;
        random_job(&j, 20, 40);
        j.max_tokens = 40;
        j.ignore_eos = 1;
        job_ref(&j);
        char full[1024] = "";
        int off[MAXG + 1];
        for (int i = 0; i < j.n_ref; i++) {
            off[i] = (int)strlen(full);
            strcat(full, fake_piece(j.ref[i]));
        }
        off[j.n_ref] = (int)strlen(full);
        int L = off[j.n_ref];
        if (L < 20) continue;
        int at = L / 2 + (int)(rnd() % (unsigned)(L / 2 - 3));
        char stop[4];
        memcpy(stop, full + at, 3);
        stop[3] = 0;
        char *first = strstr(full, stop);
        int pos = (int)(first - full);
        /* tokens needed: the first k with off[k] >= pos + 3 */
        int k = 0;
        while (off[k] < pos + 3) k++;
        j.stop[0] = stop;
        j.stop[1] = "\x01never";
        j.n_stop = 2;
        j.top_logprobs = (attempt % 2) ? 3 : 0;
        submit_job(e, &j);
        collect(&j);
        REQUIRE(j.finish == KVS_FINISH_STOP);
        REQUIRE(j.n_out == k && memcmp(j.out, j.ref, (size_t)k * sizeof(int32_t)) == 0);
        REQUIRE(j.n_text == pos && memcmp(j.text, full, (size_t)pos) == 0);
        REQUIRE(!strstr(j.text, stop));
        found++;
    }
    REQUIRE(found == 8);

    /* plain text and logprobs against the reference log-softmax */
    static struct job j;
    random_job(&j, 20, 20);
    j.ignore_eos = 1;
    j.top_logprobs = 5;
    job_ref(&j);
    submit_job(e, &j);
    collect(&j);
    check_exact(&j);
    char full[1024] = "";
    for (int i = 0; i < j.n_ref; i++) strcat(full, fake_piece(j.ref[i]));
    REQUIRE(strcmp(full, j.text) == 0);

    /* stop strings whose first bytes keep matching but that never complete: every held-back
     * byte is released, also at the very end (length) */
    for (int rep = 0; rep < 4; rep++) {
        random_job(&j, 20, 30);
        j.ignore_eos = 1;
        j.stop[0] = "a\x01";
        j.stop[1] = "e\x02\x03";
        j.n_stop = 2;
        job_ref(&j);
        submit_job(e, &j);
        collect(&j);
        check_exact(&j);
        full[0] = 0;
        for (int i = 0; i < j.n_ref; i++) strcat(full, fake_piece(j.ref[i]));
        REQUIRE(strcmp(full, j.text) == 0);
    }
    j.n_stop = 0;

    /* EOS: not part of the text, finish STOP */
    for (int attempt = 0; attempt < 400; attempt++) {
        random_job(&j, 20, 40);
        j.ignore_eos = 0;
        j.max_tokens = 40;
        job_ref(&j);
        if (j.ref[j.n_ref - 1] != FAKE_EOS) continue;
        submit_job(e, &j);
        collect(&j);
        check_exact(&j);
        REQUIRE(!strstr(j.text, "<eos>"));
        break;
    }

    /* timeout: a slow model and a 50 ms limit */
    m.sleep_s = 0.01;
    random_job(&j, 10, 10);
    j.max_tokens = 40;
    j.ignore_eos = 1;
    j.timeout_s = 0.05;
    submit_job(e, &j);
    collect(&j);
    REQUIRE(j.finish == KVS_FINISH_TIMEOUT && j.n_out < 40);

    /* shutdown with requests in flight: they end CANCELLED */
    static struct job fl[4];
    for (int i = 0; i < 4; i++) {
        random_job(&fl[i], 10, 10);
        fl[i].max_tokens = 40;
        fl[i].ignore_eos = 1;
        submit_job(e, &fl[i]);
    }
    usleep(30000);
    kvs_engine_free(e);
    for (int i = 0; i < 4; i++) {
        collect(&fl[i]);
        REQUIRE(fl[i].finish == KVS_FINISH_CANCELLED);
    }
    fake_model_free(&m);
    printf("stop strings (held back, never emitted), text, logprobs, EOS, timeout, shutdown: ok\n");
}

/* fake_model.h's rules for build/kvserve-fake, through the real engine: FAKE_LOGITS_NEXT_BYTE
 * prompt logprobs scored in chunks of 7 (rows across chunk boundaries), FAKE_PICK_REVERSE
 * tokens and logprobs, and the injected sampling failure (ERROR after fail_at tokens). */
static void test_fake_rules(void)
{
    enum { V = 300, NP = 37, MT = 40 };
    static const int32_t fail[] = {'!', 'f', 'a', 'i', 'l', '!'};
    struct fake_model m;
    fake_model_init(&m, 64, BS, V, 256);
    m.logits_rule = FAKE_LOGITS_NEXT_BYTE;
    m.pick_rule = FAKE_PICK_REVERSE;
    m.fail_pattern = fail;
    m.n_fail_pattern = 6;
    m.fail_at = 2;
    struct kvs_engine_exec x = fake_exec(&m);
    x.eos_ids = NULL, x.n_eos = 0;
    struct kvs_config c = make_cfg(64, 8, 100, 7, "prefix");
    struct kvs_engine *e;
    char err[256];
    REQUIRE(kvs_engine_create_exec(&c, &x, &e, err, sizeof err) == 0);
    int32_t prompt[NP];
    for (int i = 0; i < NP; i++) prompt[i] = i % 5 == 4 ? 290 : (int32_t)((i * 37 + 11) % 256);
    prompt[10] = (prompt[9] + 1) % 256;   /* a top-1 token */
    for (int pass = 0; pass < 2; pass++) {   /* pass 1: the prompt carries the failure marker */
        if (pass) memcpy(prompt + 20, fail, sizeof fail);
        struct kvs_request_params p;
        memset(&p, 0, sizeof p);
        p.prompt = prompt;
        p.n_prompt = NP;
        p.max_tokens = MT;
        p.sampling.top_p = 1;
        p.sampling.repetition_penalty = 1;
        p.sampling.logprobs = 1;
        p.sampling.top_logprobs = 3;
        p.skip_special = 1;
        p.prompt_logprobs = 1;
        struct kvs_request *r = kvs_request_new(&p, NULL, NULL);
        REQUIRE(r && kvs_engine_submit(e, r, err, sizeof err) == 0);
        int next_pos = 1, n_tok = 0, ended = 0;
        struct kvs_event ev[16];
        while (!ended) {
            int n = kvs_request_wait(r, ev, 16, 30.0);
            REQUIRE(n > 0);
            for (int i = 0; i < n; i++) {
                if (ev[i].type == KVS_EV_PROMPT) {
                    REQUIRE(ev[i].pos == next_pos && n_tok == 0);
                    int32_t u = prompt[next_pos - 1];
                    REQUIRE(fabs(ev[i].logprob - fake_next_byte_logprob(u, prompt[next_pos], V)) < 1e-5);
                    REQUIRE(ev[i].n_top == 3);
                    for (int k = 0; k < 3; k++)
                        REQUIRE(ev[i].top_ids[k] == (u + 1 + k) % 256 &&
                                fabs(ev[i].top_logprobs[k] + (k + 1) * log(2.0)) < 1e-5);
                    next_pos++;
                } else if (ev[i].type == KVS_EV_TOKEN) {
                    REQUIRE(ev[i].token == prompt[NP - 1 - n_tok % NP]);
                    REQUIRE(fabs(ev[i].logprob - log(0.5)) < 1e-6 && ev[i].n_top == 3);
                    for (int k = 0; k < 3; k++) REQUIRE(ev[i].top_ids[k] == (ev[i].token + k) % V);
                    n_tok++;
                } else {
                    REQUIRE(ev[i].type == (pass ? KVS_EV_ERROR : KVS_EV_DONE));
                    ended = 1;
                }
                kvs_event_clear(&ev[i]);
            }
        }
        REQUIRE(next_pos == NP && n_tok == (pass ? 2 : MT));
        kvs_request_unref(r);
    }
    REQUIRE(m.errors == 0);
    kvs_engine_free(e);
    fake_model_free(&m);
    printf("fake rules: next-byte prompt logprobs over 7-token chunks, reverse picks, injected failure: ok\n");
}

int main(void)
{
    kvs_log_set_level(KVS_LOG_WARN);
    test_queue_and_errors();
    test_text_stop_logprobs_timeout();
    test_invariance();
    test_prefix();
    test_stress();
    test_fake_rules();
    return kvs_test_summary("test_scheduler");
}
