/* test_sched_overlap.c: scheduler.overlap (the previous step's text and events emitted while
 * the runner's next step runs, engine/scheduler.c) changes no output. The full engine on the
 * tiny Llama test model runs the same 24 requests with overlap on and off and must give the same
 * token ids, finish reasons and token counts for each:
 *   - greedy requests (device argmax) and seeded sampled ones (host logits, temperature 0.9),
 *     with logprobs on some;
 *   - stop ids that end requests mid-stream (a request ending while the next step holding it is
 *     already queued: its token there is dropped, not emitted);
 *   - a KV pool small enough to force preemption and recompute, and chunked prefill;
 * and the runs end with every block free. scheduler.async (the next step begun before the
 * previous step's picks are back; greedy rows take their token on the backend) must give the
 * same too, and begin steps ahead; at its default, auto, it is off on the CPU backend (no step
 * begun ahead). The stop-string path (text that ends a request while
 * its next step runs) is test_engine_text's, which runs with the default, overlap on. */
#include "engine/config.h"
#include "engine/engine.h"
#include "engine/runner.h"
#include "base/util.h"
#include "models/model.h"
#include "tests/unit/engine_overlap_run.h"
#include "tests/unit/test_util.h"

#include <stdio.h>
#include <string.h>

int main(void)
{
    kvs_log_set_level(KVS_LOG_WARN);
    char dir[1024], err[256];
    snprintf(dir, sizeof dir, "%s/tests/data/models/llama", kvs_test_root());
    struct kvs_model *m;
    REQUIRE(kvs_model_load(dir, &m, err, sizeof err) == 0, "%s", err);
    int vocab = kvs_model_config(m)->vocab_size;

    static struct job on[NJ], off[NJ], ref[NJ];
    uint64_t rng = 0x9E3779B97F4A7C15ULL;
    for (int i = 0; i < NJ; i++) {
        struct job *j = &ref[i];
        memset(j, 0, sizeof *j);
        j->n_prompt = 3 + (int)(kvs_test_xorshift(&rng) % 60);
        for (int t = 0; t < j->n_prompt; t++) j->prompt[t] = (int32_t)(kvs_test_xorshift(&rng) % (uint32_t)vocab);
        j->sampled = i % 3 == 1;
        j->logprobs = i % 4 == 3;
        j->stop_id = -1;
    }
    struct kvs_config c;
    kvs_config_init(&c);
    REQUIRE(c.sched_async && !strcmp(c.sched_async, "auto"), "scheduler.async defaults to %s, not auto", c.sched_async);
    free(c.device);
    c.device = kvs_xstrdup("cpu");
    c.cpu_threads = 2;
    c.max_running = 16;
    c.max_waiting = 64;
    c.max_model_len = 128;
    c.max_batch_tokens = 64;
    c.prefill_chunk = 16;
    struct kvs_engine_stats st;

    /* the stop ids: for every other request, a token its unstopped run emits in the middle */
    memcpy(on, ref, sizeof on);
    run(&c, m, on, &st);
    for (int i = 0; i < NJ; i += 2) ref[i].stop_id = on[i].got[GEN / 3 + i % 7];

    for (int pool = 0; pool < 2; pool++) {
        /* pool 1: 10 blocks of 16 tokens for 16 running requests of up to 103 tokens */
        c.kv_memory_bytes = pool ? 0 : 8 << 20;
        if (pool) small_pool(&c, m);
        memcpy(on, ref, sizeof on);
        memcpy(off, ref, sizeof off);
        c.sched_overlap = 1;
        run(&c, m, on, &st);
        uint64_t preempt_on = st.num_preemptions;
        c.sched_overlap = 0;
        run(&c, m, off, &st);
        /* scheduler.async: the next step begun before the last one's picks are applied */
        static struct job as[NJ];
        memcpy(as, ref, sizeof as);
        set_async(&c, "true");
        run(&c, m, as, &st);
        set_async(&c, "false");
        const uint64_t async_steps = st.async_steps, preempt_as = st.num_preemptions;
        REQUIRE(async_steps > 0, "pool %d: no step was begun ahead with scheduler.async", pool);
        for (int i = 0; i < NJ; i++) {
            REQUIRE(as[i].finish == off[i].finish && as[i].n_got == off[i].n_got,
                    "pool %d request %d: async finish %d after %d tokens, sync %d after %d", pool, i, as[i].finish,
                    as[i].n_got, off[i].finish, off[i].n_got);
            REQUIRE(memcmp(as[i].got, off[i].got, (size_t)as[i].n_got * sizeof *as[i].got) == 0,
                    "pool %d request %d: tokens differ with scheduler.async", pool, i);
            REQUIRE(memcmp(as[i].lp, off[i].lp, (size_t)as[i].n_got * sizeof *as[i].lp) == 0,
                    "pool %d request %d: logprobs differ with scheduler.async", pool, i);
        }
        printf("pool %s: scheduler.async == sync (tokens, logprobs, finish); %llu steps begun ahead, preemptions "
               "%llu\n", pool ? "small" : "roomy", (unsigned long long)async_steps, (unsigned long long)preempt_as);
        int stopped = 0;
        for (int i = 0; i < NJ; i++) {
            REQUIRE(on[i].finish == off[i].finish && on[i].n_got == off[i].n_got,
                    "pool %d request %d: overlap finish %d after %d tokens, without %d after %d", pool, i, on[i].finish,
                    on[i].n_got, off[i].finish, off[i].n_got);
            REQUIRE(memcmp(on[i].got, off[i].got, (size_t)on[i].n_got * sizeof *on[i].got) == 0,
                    "pool %d request %d: tokens differ with overlap", pool, i);
            REQUIRE(memcmp(on[i].lp, off[i].lp, (size_t)on[i].n_got * sizeof *on[i].lp) == 0,
                    "pool %d request %d: logprobs differ with overlap", pool, i);
            if (ref[i].stop_id >= 0) {
                REQUIRE(on[i].finish == KVS_FINISH_STOP && on[i].got[on[i].n_got - 1] == ref[i].stop_id,
                        "pool %d request %d: did not end at its stop id", pool, i);
                stopped++;
            } else {
                REQUIRE(on[i].finish == KVS_FINISH_LENGTH && on[i].n_got == GEN, "pool %d request %d: %d tokens",
                        pool, i, on[i].n_got);
            }
        }
        if (pool) REQUIRE(preempt_on > 0 && st.num_preemptions > 0, "the small pool did not preempt");
        printf("pool %s: %d requests (%d ended by stop ids, %d sampled), overlap on == off (tokens, logprobs, "
               "finish); preemptions %llu / %llu\n", pool ? "small" : "roomy", NJ, stopped, (NJ + 1) / 3,
               (unsigned long long)preempt_on, (unsigned long long)st.num_preemptions);
    }
    /* 24 greedy rows in one step: the LM head's one pass over more rows than its 16-row host
     * chunks (runner.c argmax_chunk) picks the same ids as 16 running requests did (the CPU
     * backend is batch invariant) */
    c.kv_memory_bytes = 8 << 20;
    c.sched_overlap = 1;
    for (int i = 0; i < NJ; i++) ref[i].sampled = ref[i].logprobs = 0;   /* all greedy: device argmax rows */
    memcpy(off, ref, sizeof off);
    run(&c, m, off, &st);
    c.max_running = 24;
    memcpy(on, ref, sizeof on);
    run(&c, m, on, &st);
    for (int i = 0; i < NJ; i++)
        REQUIRE(on[i].n_got == off[i].n_got && !memcmp(on[i].got, off[i].got, (size_t)on[i].n_got * sizeof *on[i].got),
                "request %d: 24 running requests gave other tokens than 16", i);
    REQUIRE(st.argmax_tokens == st.generation_tokens, "not all on the device argmax path");
    printf("24 running greedy requests (one LM head pass for their rows) == 16 running requests\n");
    /* all greedy under scheduler.async: every decode row after the first takes its token from
     * the step before on the backend (runner.h token_on_device); stop ids end requests whose
     * next row is already queued */
    for (int i = 0; i < NJ; i++) ref[i].stop_id = i % 2 ? -1 : off[i].got[GEN / 4 + i % 5];
    const int64_t roomy = c.kv_memory_bytes;
    for (int pool = 0; pool < 2; pool++) {
        if (pool) small_pool(&c, m);   /* 24 running requests: preemption while a step is out */
        run_sync_then_async(&c, m, ref, off, on, &st);
        for (int i = 0; i < NJ; i++)
            REQUIRE(same_tokens(&on[i], &off[i]),
                    "pool %d request %d: greedy tokens differ with scheduler.async", pool, i);
        REQUIRE(st.async_steps * 2 > st.steps, "only %llu of %llu steps begun ahead",
                (unsigned long long)st.async_steps, (unsigned long long)st.steps);
        REQUIRE(!pool || st.num_preemptions > 0, "the small pool did not preempt");
        printf("24 greedy requests (12 ended by stop ids), %s pool, under scheduler.async == sync; %llu of %llu steps "
               "begun ahead, preemptions %llu\n", pool ? "small" : "roomy", (unsigned long long)st.async_steps,
               (unsigned long long)st.steps, (unsigned long long)st.num_preemptions);
    }
    c.kv_memory_bytes = roomy;
    /* the default, auto, is off on the CPU backend: it computes each step inside forward_begin,
     * so a step begun ahead would overlap nothing and only hold back the text of the one before */
    set_async(&c, "auto");
    memcpy(on, ref, sizeof on);
    run(&c, m, on, &st);
    REQUIRE(st.async_steps == 0, "scheduler.async=auto began %llu steps ahead on the CPU",
            (unsigned long long)st.async_steps);
    printf("scheduler.async=auto on the CPU backend: no step begun ahead\n");
    set_async(&c, "false");
    kvs_config_free(&c);
    kvs_model_free(m);
    return kvs_test_summary("test_sched_overlap");
}
