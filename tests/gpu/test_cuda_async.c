/* test_cuda_async.c: scheduler.async and the skip_lead hint on the CUDA backend.
 *   - The engine on the tiny Llama test model (device=cuda) runs 24 greedy requests, half of them
 *     ended by stop ids mid-stream, with scheduler.async off and on (and, in the roomy pool, at its
 *     default, auto, which is on for CUDA): the same token ids and finish
 *     reasons (greedy rows take their token from the previous step's pick on the device; two steps
 *     in flight), and most steps begun while the one before was still running. The CUDA backend is
 *     made batch invariant for this (KVS_CUDA_SKINNY_MAX=128: one GEMM kernel at every row count;
 *     KVS_CUDA_ATTN_SPLITS=1), since async steps group rows differently (a request that stopped
 *     still runs its queued row; one whose last token is due skips a step).
 *     In a pool small enough to preempt, async holds an ending request's blocks one step longer,
 *     so preemptions (and the recomputed prompts, whose KV the prefill kernels compute with other
 *     rounding than the decode steps did) differ: there every request must complete with its
 *     blocks freed, and the requests whose tokens differ are counted, not failed (on the CPU
 *     backend, batch invariant to the bit, test_sched_overlap requires equality there too).
 *   - ids_to_tokens and the two fetch areas (backend.h) give what the CPU backend gives.
 *   - attention() of a mixed step with skip_lead = the leading decode sequences: the prefill rows
 *     are bitwise those of the pass without the hint (the prefill launch is unchanged), the other
 *     decode rows equal within 1e-6 (their launch may split the context differently).
 * Needs a GPU; exits 1 with a message when none.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/util.h"
#include "engine/config.h"
#include "engine/engine.h"
#include "engine/runner.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "models/model.h"
#include "tests/unit/engine_overlap_run.h"
#include "tests/unit/test_util.h"

static void engine_case(void)
{
    char dir[1024], err[256];
    snprintf(dir, sizeof dir, "%s/tests/data/models/llama", kvs_test_root());
    struct kvs_model *m;
    REQUIRE(kvs_model_load(dir, &m, err, sizeof err) == 0, "%s", err);
    const int vocab = kvs_model_config(m)->vocab_size;
    static struct job ref[NJ], on[NJ], off[NJ];
    uint64_t rng = 0x9E3779B97F4A7C15ULL;
    for (int i = 0; i < NJ; i++) {
        ref[i].n_prompt = 3 + (int)(kvs_test_xorshift(&rng) % 60);
        for (int t = 0; t < ref[i].n_prompt; t++) ref[i].prompt[t] = (int32_t)(kvs_test_xorshift(&rng) % (uint32_t)vocab);
        ref[i].stop_id = -1;
    }
    setenv("KVS_CUDA_SKINNY_MAX", "128", 1);
    setenv("KVS_CUDA_ATTN_SPLITS", "1", 1);
    struct kvs_config c;
    kvs_config_init(&c);
    free(c.device);
    c.device = kvs_xstrdup("cuda");
    c.max_running = 24;
    c.max_waiting = 64;
    c.max_model_len = 128;
    c.max_batch_tokens = 64;
    c.prefill_chunk = 16;
    c.kv_memory_bytes = 8 << 20;
    struct kvs_engine_stats st;
    set_async(&c, "false");
    memcpy(on, ref, sizeof on);
    run(&c, m, on, &st);
    for (int i = 0; i < NJ; i += 2) ref[i].stop_id = on[i].got[GEN / 4 + i % 5];
    for (int pool = 0; pool < 2; pool++) {
        if (pool) small_pool(&c, m);
        run_sync_then_async(&c, m, ref, off, on, &st);
        int stopped = 0, differ = 0;
        for (int i = 0; i < NJ; i++) {
            const int same = same_tokens(&on[i], &off[i]);
            if (!pool) CHECK(same, "roomy pool request %d: greedy tokens differ with scheduler.async", i);
            CHECK(on[i].finish == KVS_FINISH_STOP || (on[i].finish == KVS_FINISH_LENGTH && on[i].n_got == GEN),
                  "pool %d request %d: finish %d after %d tokens", pool, i, on[i].finish, on[i].n_got);
            differ += !same;
            stopped += off[i].finish == KVS_FINISH_STOP;
        }
        if (pool) printf("small pool: %d of %d requests' tokens differ from the synchronous run's\n", differ, NJ);
        CHECK(st.async_steps * 2 > st.steps, "only %llu of %llu steps begun ahead", (unsigned long long)st.async_steps,
              (unsigned long long)st.steps);
        CHECK(!pool || st.num_preemptions > 0, "the small pool did not preempt");
        printf("ok %s pool: 24 greedy requests (%d ended by stop ids), scheduler.async == sync; %llu of %llu steps begun "
               "ahead, %llu preemptions\n", pool ? "small" : "roomy", stopped, (unsigned long long)st.async_steps,
               (unsigned long long)st.steps, (unsigned long long)st.num_preemptions);
        if (pool) continue;
        /* the default, auto: on for the CUDA backend (it queues the step behind the host) */
        set_async(&c, "auto");
        memcpy(on, ref, sizeof on);
        run(&c, m, on, &st);
        for (int i = 0; i < NJ; i++)
            CHECK(same_tokens(&on[i], &off[i]),
                  "roomy pool request %d: greedy tokens differ with scheduler.async=auto", i);
        CHECK(st.async_steps * 2 > st.steps, "scheduler.async=auto on CUDA: only %llu of %llu steps begun ahead",
              (unsigned long long)st.async_steps, (unsigned long long)st.steps);
        printf("ok roomy pool, scheduler.async=auto (the default) on CUDA: %llu of %llu steps begun ahead, tokens == sync\n",
               (unsigned long long)st.async_steps, (unsigned long long)st.steps);
    }
    kvs_config_free(&c);
    kvs_model_free(m);
}

static struct kvs_dbuf *buf(const struct kvs_backend_ops *o, struct kvs_backend *b, enum kvs_buf_kind k, size_t n,
                            const void *src)
{
    struct kvs_dbuf *d = o->alloc(b, k, n);
    REQUIRE(d, "alloc %zu", n);
    if (src) o->upload(b, d, 0, src, n);
    return d;
}

static void ops_case(void)
{
    const struct kvs_backend_ops *o = &kvs_cuda_backend;
    char err[256];
    struct kvs_backend *b = o->create(0, err, sizeof err);
    REQUIRE(b, "%s", err);
    const int32_t ids[6] = {7, -1, 42, 3, 9, 11}, pairs[6] = {4, 2, 0, 1, 2, 5};
    const int32_t tok[6] = {100, 101, 102, 103, 104, 105}, want[6] = {0, 101, 11, 103, 42, 105};
    struct kvs_dbuf *I = buf(o, b, KVS_BUF_I32, 6, ids), *P = buf(o, b, KVS_BUF_I32, 6, pairs);
    struct kvs_dbuf *T = buf(o, b, KVS_BUF_I32, 6, tok);
    o->ids_to_tokens(b, I, P, 3, T);
    int32_t got[6], a0[6], a1[6];
    o->fetch_begin(b, I, 6, 0);
    o->fetch_begin(b, T, 6, 1);
    o->fetch_end(b, 1, a1, 6);
    o->fetch_end(b, 0, a0, 6);
    o->download(b, got, T, 0, 6);
    CHECK(!memcmp(got, want, sizeof want) && !memcmp(a1, want, sizeof want) && !memcmp(a0, ids, sizeof ids),
          "ids_to_tokens / fetch: %d %d %d %d %d %d", got[0], got[1], got[2], got[3], got[4], got[5]);
    printf("ok ids_to_tokens (negative picks become 0), two fetch areas\n");

    /* skip_lead: 6 decode sequences, then prefill chunks of 40 and 70 rows; Llama-3 8B heads */
    enum { S = 8, NH = 32, NKV = 8, HD = 128, BS = 16, NB = 256, MAXB = 16 };
    const int rows[S] = {1, 1, 1, 1, 1, 1, 40, 70}, pos[S] = {200, 17, 90, 130, 3, 250, 60, 0};
    int32_t qs[S + 1], ps[S], bt[S * MAXB];
    qs[0] = 0;
    for (int s = 0; s < S; s++) {
        qs[s + 1] = qs[s] + rows[s];
        ps[s] = pos[s];
        for (int j = 0; j < MAXB; j++) bt[s * MAXB + j] = (s * 31 + j * 7) % NB;
    }
    const int n = qs[S];
    const size_t kvn = (size_t)NB * NKV * BS * HD, qn = (size_t)n * NH * HD;
    float *kc = malloc(kvn * 4), *q = malloc(qn * 4), *o0 = malloc(qn * 4), *o1 = malloc(qn * 4);
    uint64_t rng = 42;
    for (size_t i = 0; i < kvn; i++) kc[i] = (float)(kvs_test_xorshift(&rng) % 2001) / 1000.0f - 1.0f;
    for (size_t i = 0; i < qn; i++) q[i] = (float)(kvs_test_xorshift(&rng) % 2001) / 1000.0f - 1.0f;
    struct kvs_dbuf *Kc = buf(o, b, KVS_BUF_KV, kvn, kc), *Q = buf(o, b, KVS_BUF_ACT, qn, q);
    for (size_t i = 0; i < kvn; i++) kc[i] = (float)(kvs_test_xorshift(&rng) % 2001) / 1000.0f - 1.0f;
    struct kvs_dbuf *Vc = buf(o, b, KVS_BUF_KV, kvn, kc), *Out = buf(o, b, KVS_BUF_ACT, qn, NULL);
    struct kvs_dbuf *Qs = buf(o, b, KVS_BUF_I32, S + 1, qs), *Ps = buf(o, b, KVS_BUF_I32, S, ps);
    struct kvs_dbuf *Bt = buf(o, b, KVS_BUF_I32, S * MAXB, bt);
    struct kvs_attn_meta m = {.n_seqs = S, .max_blocks = MAXB, .q_start = Qs, .pos = Ps, .block_tables = Bt,
                              .h_q_start = qs, .h_pos = ps, .max_ctx = 0};
    for (int s = 0; s < S; s++)
        if (ps[s] + rows[s] > m.max_ctx) m.max_ctx = ps[s] + rows[s];
    const float scale = 1.0f / sqrtf((float)HD);
    o->attention(b, Q, Kc, Vc, &m, n, NH, NKV, HD, BS, scale, Out);
    o->download(b, o0, Out, 0, qn);
    for (int skip = 1; skip <= 6; skip += 5) {
        m.skip_lead = skip;
        o->attention(b, Q, Kc, Vc, &m, n, NH, NKV, HD, BS, scale, Out);
        o->download(b, o1, Out, 0, qn);
        const size_t pre = (size_t)qs[6] * NH * HD, cut = (size_t)qs[skip] * NH * HD;
        double md = 0;
        for (size_t i = cut; i < pre; i++) md = fmax(md, fabs((double)o1[i] - o0[i]));
        CHECK(!memcmp(o1 + pre, o0 + pre, (qn - pre) * 4), "skip_lead %d: prefill rows differ", skip);
        CHECK(md <= 1e-6, "skip_lead %d: decode rows past the skipped ones differ by %g", skip, md);
        printf("ok skip_lead %d: prefill rows bitwise equal, other decode rows within %.1e\n", skip, md);
    }
    free(kc), free(q), free(o0), free(o1);
    o->free(b);
}

int main(void)
{
    kvs_log_set_level(KVS_LOG_WARN);
    ops_case();
    engine_case();
    return kvs_test_summary("test_cuda_async");
}
