/* test_tp.c: tensor parallelism (parallel.tensor, engine/runner_tp.c) on the CPU backend, whose
 * ranks are threads joined by a host all-reduce (kernels/cpu/cpu_tp.c): the same sharding and
 * reductions the NCCL path runs on GPUs. For each model, every TP size N that divides its KV
 * heads runs the same steps as N = 1 and must give:
 *   1. a prefill with every position's logits (chunks of 7 tokens, several sequences at once,
 *      block tables shuffled over the pool): per row max|tpN - tp1| / max|tp1| < TOL (fp32; the
 *      sums are split over ranks, so equal only up to rounding);
 *   2. greedy decoding, all sequences in one batch, 24 steps, ARGMAX rows (the picks merged over
 *      the ranks' vocabulary shares) and LAST rows: the same tokens as N = 1 at every step, and
 *      the ARGMAX ids equal to the sampler's pick on the LAST rows' assembled logits;
 *   3. copy_block reaches every rank (a sequence continued on a copied block = the original);
 *   4. the same KV pool size (blocks) as N = 1, and the total KV bytes per token.
 * Models: the tiny committed ones (2 KV heads: N = 2; their greedy continuations also equal
 * transformers' reference.json), and two written here with 12 KV heads (N = 2, 3, 4), a
 * vocabulary of 1001 (uneven shares), Qwen2-style q/k/v biases + an o_proj bias with untied LM
 * head, and Qwen3-style q/k norms with tied embeddings.
 * 5. Through the engine (scheduler thread, prefix sharing with copy-on-write, request ends), with
 *    the decode policies of kv_test_policies.h (per rank, over its heads): test_window (an
 *    approximate sliding window with sinks, lse scratch, no graphs) and test_spans: greedy
 *    continuations of 6 requests (pairs share a prompt prefix) equal at TP 1 and TP 2.
 * Refusals: N not dividing the KV heads (-EINVAL, message).
 * The real KV strategies (quest, retro, mac, paris, lean, lazy) under TP: test_tp_kv.c.
 */
#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "base/util.h"
#include "engine/config.h"
#include "engine/engine.h"
#include "engine/runner.h"
#include "engine/sampler.h"
#include "models/model.h"
#include "tests/unit/kv_test_policies.h"
#include "tests/unit/test_util.h"
#include "tests/unit/tp_test_model.h"

#define TOL 2e-5
#define BLOCK 8
#define MAXS 4
#define STEPS 24
#define NB 17                         /* blocks per sequence: 128 + STEPS + 1 tokens */
#define POOL 96

/* ---- running the same steps at each TP size --------------------------------------------- */

struct run {
    float *prefill;               /* [total prompt rows][vocab] */
    int32_t gen[MAXS][STEPS];
    float *copy_logits;           /* [vocab]: 3. */
    int n_blocks;
    size_t kv_bpt;
};

static struct kvs_runner *make_runner(const struct kvs_model *m, int tp, char *err, size_t errlen, int *rc)
{
    struct kvs_config cfg;
    kvs_config_init(&cfg);
    free(cfg.device);
    cfg.device = kvs_xstrdup("cpu");
    cfg.cpu_threads = 1;
    cfg.kv_block_size = BLOCK;
    cfg.max_batch_tokens = 64;
    cfg.max_running = 8;
    cfg.tensor_parallel = tp;
    const struct kvs_model_config *mc = kvs_model_config(m);
    cfg.kv_memory_bytes = (int64_t)POOL * BLOCK * mc->n_layers * 2 * mc->n_kv_heads * mc->head_dim * 4;
    struct kvs_runner *r = NULL;
    *rc = kvs_runner_create(&cfg, m, &r, err, errlen);
    kvs_config_free(&cfg);
    return r;
}

static int32_t greedy_pick(const float *row, int V)
{
    struct kvs_sampler smp;
    struct kvs_sampling sp;
    char err[256];
    memset(&sp, 0, sizeof sp);
    sp.top_p = 1.0f;
    sp.repetition_penalty = 1.0f;
    KVS_ASSERT(kvs_sampler_init(&smp, &sp, 1, V, err, sizeof err) == 0);
    struct kvs_sample_result res;
    int rc = kvs_sampler_sample(&smp, row, NULL, 0, 0, &res);
    kvs_sampler_free(&smp);
    return rc == 0 ? res.token : -1;
}

/* runs prompts[0..P) through the steps of the header on runner r; 0 or the failing step's rc */
static int run_steps(struct kvs_runner *r, int V, int P, int32_t prompts[][128], const int *plen, struct run *out,
                     const char *name)
{
    int32_t toks[MAXS][128 + STEPS + 1], bt[MAXS][NB];
    int n[MAXS], pos[MAXS];
    /* a shuffled block order, the same at every TP size */
    int32_t perm[POOL];
    for (int i = 0; i < POOL; i++) perm[i] = i;
    uint64_t s = 99;
    for (int i = POOL - 1; i > 0; i--) {
        int j = (int)(kvs_test_xorshift(&s) % (uint64_t)(i + 1)), t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    int next = 0, rows = 0, row = 0;
    for (int p = 0; p < P; p++) {
        memcpy(toks[p], prompts[p], (size_t)plen[p] * 4);
        n[p] = plen[p];
        pos[p] = 0;
        for (int j = 0; j < NB; j++) bt[p][j] = perm[next++];
        rows += plen[p];
    }
    out->prefill = kvs_xcalloc((size_t)rows * V, sizeof(float));
    /* 1. prefill in chunks of 7, all sequences in each step, every position's logits */
    int busy = 1;
    float *buf = kvs_xmalloc((size_t)MAXS * 7 * V * sizeof(float));
    while (busy) {
        struct kvs_batch_seq qs[MAXS];
        int k = 0, who[MAXS];
        busy = 0;
        for (int p = 0; p < P; p++) {
            if (pos[p] >= n[p]) continue;
            int c = n[p] - pos[p] < 7 ? n[p] - pos[p] : 7;
            who[k] = p;
            qs[k++] = (struct kvs_batch_seq){.tokens = toks[p] + pos[p], .n_tokens = c, .pos = pos[p],
                                             .block_table = bt[p], .n_blocks = NB, .want_logits = KVS_LOGITS_ALL,
                                             .slot = p, .slot_fresh = pos[p] == 0};
        }
        if (!k) break;
        busy = 1;
        struct kvs_batch b = {qs, k, NULL};
        int rc = kvs_runner_forward(r, &b, buf);
        if (rc) {
            printf("%s: prefill step: %d\n", name, rc);
            return rc;
        }
        int at = 0;
        for (int i = 0; i < k; i++) {
            /* rows of prompt p go to its place in prefill (prompts are laid out one after another) */
            int p = who[i], base = 0;
            for (int q = 0; q < p; q++) base += plen[q];
            memcpy(out->prefill + (size_t)(base + pos[p]) * V, buf + (size_t)at * V, (size_t)qs[i].n_tokens * V * 4);
            at += qs[i].n_tokens;
            row += qs[i].n_tokens;
            pos[p] += qs[i].n_tokens;
        }
    }
    free(buf);
    /* the first generated token of each, from its last prompt row */
    int base = 0;
    for (int p = 0; p < P; p++) {
        base += plen[p];
        toks[p][n[p]++] = greedy_pick(out->prefill + (size_t)(base - 1) * V, V);
    }
    /* 2. greedy decoding: even sequences ARGMAX, odd ones LAST (+ the sampler) */
    float *lg = kvs_xmalloc((size_t)MAXS * V * sizeof(float));
    int ok_ids = 1;
    for (int st = 0; st < STEPS; st++) {
        struct kvs_batch_seq qs[MAXS];
        int32_t ids[MAXS];
        for (int p = 0; p < P; p++)
            qs[p] = (struct kvs_batch_seq){.tokens = toks[p] + pos[p], .n_tokens = 1, .pos = pos[p],
                                           .block_table = bt[p], .n_blocks = NB,
                                           .want_logits = p % 2 ? KVS_LOGITS_LAST : KVS_LOGITS_ARGMAX, .slot = p};
        struct kvs_batch b = {qs, P, ids};
        int rc = kvs_runner_forward(r, &b, lg);
        if (rc) return rc;
        int host = 0;
        for (int p = 0; p < P; p++) {
            int32_t t = ids[p];
            if (p % 2) {
                t = greedy_pick(lg + (size_t)host++ * V, V);
                if (t != ids[p]) ok_ids = 0;
            }
            out->gen[p][st] = t;
            toks[p][n[p]++] = t;
            pos[p]++;
        }
    }
    CHECK(ok_ids, "%s: ARGMAX ids of LAST rows differ from the sampler's pick on their logits", name);
    free(lg);
    /* 3. copy sequence 0's last (partial) block into a free one, then the next decode step on the
     * copy and on the original give the same logits */
    {
        const int last = (pos[0]) / BLOCK, fresh = perm[next++];
        int rc = kvs_runner_copy_block(r, bt[0][last], fresh);
        if (rc) return rc;
        int32_t bt2[NB];
        memcpy(bt2, bt[0], sizeof bt2);
        bt2[last] = fresh;
        float *a = kvs_xmalloc((size_t)V * 4), *c = kvs_xmalloc((size_t)V * 4);
        struct kvs_batch_seq q = {.tokens = toks[0] + pos[0], .n_tokens = 1, .pos = pos[0], .block_table = bt2,
                                  .n_blocks = NB, .want_logits = KVS_LOGITS_LAST, .slot = -1};
        struct kvs_batch b = {&q, 1, NULL};
        if ((rc = kvs_runner_forward(r, &b, c))) return rc;
        q.block_table = bt[0];
        if ((rc = kvs_runner_forward(r, &b, a))) return rc;
        CHECK(memcmp(a, c, (size_t)V * 4) == 0, "%s: a copied block gives other logits than its original", name);
        out->copy_logits = a;
        free(c);
    }
    out->n_blocks = kvs_runner_num_blocks(r);
    out->kv_bpt = kvs_runner_kv_bytes_per_token(r);
    return 0;
}

static double row_rel_err(const float *a, const float *b, int rows, int V)
{
    double worst = 0;
    for (int t = 0; t < rows; t++) {
        double md = 0, mb = 0;
        for (int i = 0; i < V; i++) {
            double d = fabs((double)a[(size_t)t * V + i] - b[(size_t)t * V + i]);
            if (!(d <= md)) md = d;
            if (fabs(b[(size_t)t * V + i]) > mb) mb = fabs(b[(size_t)t * V + i]);
        }
        double e = mb > 0 ? md / mb : md;
        if (!(e <= worst)) worst = e;
    }
    return worst;
}

/* the model in dir at each TP size of sizes[] against TP 1; ref_greedy (or NULL): transformers'
 * greedy continuations of the prompts, [P][>= STEPS + 1] */
static void check_model(const char *dir, const char *name, const int *sizes, int n_sizes, int P, int32_t prompts[][128],
                        const int *plen, const int32_t (*ref_greedy)[32])
{
    char err[512];
    struct kvs_model *m;
    REQUIRE(kvs_model_load(dir, &m, err, sizeof err) == 0, "%s: %s", name, err);
    const int V = kvs_model_config(m)->vocab_size;
    int rows = 0;
    for (int p = 0; p < P; p++) rows += plen[p];
    struct run base = {0};
    int rc;
    struct kvs_runner *r = make_runner(m, 1, err, sizeof err, &rc);
    REQUIRE(r, "%s: tp 1: %s", name, err);
    REQUIRE(run_steps(r, V, P, prompts, plen, &base, name) == 0, "%s: tp 1 steps failed", name);
    kvs_runner_free(r);
    if (ref_greedy)
        for (int p = 0; p < P; p++)
            for (int s = 0; s < STEPS; s++)
                CHECK(base.gen[p][s] == ref_greedy[p][s + 1], "%s: tp 1 greedy differs from transformers", name);
    for (int k = 0; k < n_sizes; k++) {
        const int N = sizes[k];
        struct run t = {0};
        r = make_runner(m, N, err, sizeof err, &rc);
        REQUIRE(r, "%s: tp %d: %s", name, N, err);
        CHECK(run_steps(r, V, P, prompts, plen, &t, name) == 0, "%s: tp %d steps failed", name, N);
        kvs_runner_free(r);
        double e = t.prefill ? row_rel_err(t.prefill, base.prefill, rows, V) : 1.0;
        double ec = t.copy_logits ? row_rel_err(t.copy_logits, base.copy_logits, 1, V) : 1.0;
        int same = 1;
        for (int p = 0; p < P; p++)
            for (int s = 0; s < STEPS; s++) same &= t.gen[p][s] == base.gen[p][s];
        printf("%-14s tp %d: prefill logits rel err %.2e, decode-step logits %.2e, %d greedy tokens %s, %d blocks\n",
               name, N, e, ec, P * STEPS, same ? "equal" : "DIFFER", t.n_blocks);
        CHECK(e < TOL, "%s: tp %d prefill logits differ from tp 1 by %.3e", name, N, e);
        CHECK(ec < TOL, "%s: tp %d decode logits differ from tp 1 by %.3e", name, N, ec);
        CHECK(same, "%s: tp %d greedy tokens differ from tp 1", name, N);
        CHECK(t.n_blocks == base.n_blocks && t.kv_bpt == base.kv_bpt,
              "%s: tp %d pool %d blocks, %zu B/token; tp 1 %d, %zu", name, N, t.n_blocks, t.kv_bpt, base.n_blocks,
              base.kv_bpt);
        free(t.prefill);
        free(t.copy_logits);
    }
    free(base.prefill);
    free(base.copy_logits);
    kvs_model_free(m);
}

/* ---- 5. the engine ----------------------------------------------------------------------- */

#define NJ 6
#define GEN 16

/* greedy tokens of NJ requests through an engine at TP tp with decode policy `decode` */
static int run_engine(const struct kvs_model *m, int tp, const char *decode, int32_t got[NJ][GEN])
{
    struct kvs_config c;
    char err[512];
    kvs_config_init(&c);
    free(c.device);
    c.device = kvs_xstrdup("cpu");
    free(c.kv_decode);
    c.kv_decode = kvs_xstrdup(decode);
    free(c.kv_reuse);
    c.kv_reuse = kvs_xstrdup("prefix");
    c.cpu_threads = 1;
    c.kv_block_size = 8;
    c.kv_memory_bytes = 2 << 20;
    c.max_batch_tokens = 64;
    c.max_running = 4;
    c.max_model_len = 256;
    c.tensor_parallel = tp;
    struct kvs_engine *e;
    int rc = kvs_engine_create(&c, m, NULL, &e, err, sizeof err);
    if (rc) {
        printf("engine tp %d %s: %s\n", tp, decode, err);
        kvs_config_free(&c);
        return rc;
    }
    int32_t prompt[NJ][80];
    struct kvs_request *r[NJ];
    uint64_t s = 3;
    for (int i = 0; i < NJ; i++) {
        const int n = 40 + 6 * i;
        for (int t = 0; t < n; t++) prompt[i][t] = i % 2 && t < 32 ? prompt[i - 1][t] : 1 + (int32_t)(kvs_test_xorshift(&s) % 900);
        struct kvs_request_params p;
        memset(&p, 0, sizeof p);
        p.prompt = prompt[i];
        p.n_prompt = n;
        p.max_tokens = GEN;
        p.sampling.top_p = 1;
        p.sampling.repetition_penalty = 1;
        p.ignore_eos = 1;
        r[i] = kvs_request_new(&p, NULL, NULL);
        REQUIRE(r[i] && kvs_engine_submit(e, r[i], err, sizeof err) == 0, "submit: %s", err);
    }
    for (int i = 0; i < NJ; i++) {
        int n_got = 0, done = 0;
        while (!done) {
            struct kvs_event ev[16];
            int k = kvs_request_wait(r[i], ev, 16, 60.0);
            REQUIRE(k > 0, "no event for 60 s");
            for (int q = 0; q < k; q++) {
                if (ev[q].type == KVS_EV_TOKEN && n_got < GEN) got[i][n_got++] = ev[q].token;
                if (ev[q].type == KVS_EV_ERROR) printf("engine tp %d: error %s\n", tp, ev[q].error);
                if (ev[q].type != KVS_EV_TOKEN) done = 1;
                kvs_event_clear(&ev[q]);
            }
        }
        CHECK(n_got == GEN, "engine tp %d %s: request %d got %d tokens", tp, decode, i, n_got);
        kvs_request_unref(r[i]);
    }
    kvs_engine_free(e);
    kvs_config_free(&c);
    return 0;
}

static void check_engine(void)
{
    char dir[1024], err[512];
    snprintf(dir, sizeof dir, "%s/tests/data/models/llama", kvs_test_root());
    struct kvs_model *m;
    REQUIRE(kvs_model_load(dir, &m, err, sizeof err) == 0, "%s", err);
    kvs_test_register_policies();
    const char *decodes[] = {"full", "test_window", "test_spans"};
    for (int d = 0; d < 3; d++) {
        test_window_w = 12;
        test_window_sink = 4;
        int32_t a[NJ][GEN], b[NJ][GEN];
        memset(a, 0xff, sizeof a);
        memset(b, 0xfe, sizeof b);
        CHECK(run_engine(m, 1, decodes[d], a) == 0 && run_engine(m, 2, decodes[d], b) == 0, "engine %s", decodes[d]);
        const int same = memcmp(a, b, sizeof a) == 0;
        printf("engine llama  tp 2 vs 1, kv.decode %-11s: %d requests x %d greedy tokens %s\n", decodes[d], NJ, GEN,
               same ? "equal" : "DIFFER");
        CHECK(same, "engine, kv.decode %s: tp 2 tokens differ from tp 1", decodes[d]);
    }
    kvs_model_free(m);
}

/* the prompts and greedy continuations of a committed tiny model's reference.json */
static int load_prompts(const char *dir, int32_t prompts[][128], int *plen, int32_t (*greedy)[32])
{
    char path[1200], err[256];
    snprintf(path, sizeof path, "%s/reference.json", dir);
    char *js = kvs_read_file(path, NULL, err, sizeof err);
    REQUIRE(js, "%s: %s", path, err);
    cJSON *root = cJSON_Parse(js), *p;
    free(js);
    REQUIRE(root, "%s: bad JSON", path);
    int P = 0;
    cJSON_ArrayForEach(p, cJSON_GetObjectItem(root, "prompts"))
    {
        if (P == MAXS) break;
        cJSON *ids = cJSON_GetObjectItem(p, "prompt"), *g = cJSON_GetObjectItem(p, "greedy");
        plen[P] = cJSON_GetArraySize(ids);
        REQUIRE(plen[P] <= 128, "%s: prompt of %d tokens", path, plen[P]);
        for (int j = 0; j < plen[P]; j++) prompts[P][j] = cJSON_GetArrayItem(ids, j)->valueint;
        for (int j = 0; j < 32 && j < cJSON_GetArraySize(g); j++) greedy[P][j] = cJSON_GetArrayItem(g, j)->valueint;
        P++;
    }
    cJSON_Delete(root);
    return P;
}

int main(void)
{
    kvs_log_set_level(KVS_LOG_WARN);
    char dir[1024];
    /* the committed tiny models: 2 KV heads */
    const char *tiny[] = {"llama", "llama-bf16", "llama31", "qwen2", "qwen3"};
    for (size_t i = 0; i < sizeof tiny / sizeof tiny[0]; i++) {
        snprintf(dir, sizeof dir, "%s/tests/data/models/%s", kvs_test_root(), tiny[i]);
        int32_t prompts[MAXS][128], greedy[MAXS][32];
        int plen[MAXS];
        int P = load_prompts(dir, prompts, plen, greedy);
        const int sizes[] = {2};
        check_model(dir, tiny[i], sizes, 1, P, prompts, plen, (const int32_t(*)[32])greedy);
    }
    /* written here: 12 KV heads, vocabulary 1001 */
    char tmp[512];
    REQUIRE(kvs_test_mkdtemp(tmp, sizeof tmp, "kvs-tp") == 0, "mkdtemp");
    for (int qwen3 = 0; qwen3 < 2; qwen3++) {
        snprintf(dir, sizeof dir, "%s/%s", tmp, qwen3 ? "q3" : "q2");
        REQUIRE(mkdir(dir, 0755) == 0 && kvs_test_write_tp_model(dir, qwen3, 7 + (uint64_t)qwen3) == 0, "writing %s", dir);
        int32_t prompts[MAXS][128];
        int plen[MAXS] = {19, 5, 33, 12};
        uint64_t s = 5;
        for (int p = 0; p < MAXS; p++)
            for (int j = 0; j < plen[p]; j++) prompts[p][j] = (int32_t)(kvs_test_xorshift(&s) % 1001);
        const int sizes[] = {2, 3, 4};
        check_model(dir, qwen3 ? "rand-qwen3" : "rand-qwen2", sizes, 3, MAXS, prompts, plen, NULL);
    }
    check_engine();
    /* refusals */
    {
        char err[512];
        struct kvs_model *m;
        snprintf(dir, sizeof dir, "%s/tests/data/models/llama", kvs_test_root());
        REQUIRE(kvs_model_load(dir, &m, err, sizeof err) == 0, "%s", err);
        int rc;
        err[0] = 0;
        struct kvs_runner *r = make_runner(m, 3, err, sizeof err, &rc);
        CHECK(!r && rc == -EINVAL && strstr(err, "parallel.tensor"), "tp 3 over 2 KV heads: rc %d (%s)", rc, err);
        kvs_model_free(m);
    }
    kvs_test_rmtree(tmp);
    return kvs_test_summary("test_tp");
}
