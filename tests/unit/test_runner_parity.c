/* test_runner_parity.c: the model runner on the CPU backend against transformers (fp32
 * references committed under tests/data/models/, see its README), for every tiny model:
 *   1. one prefill with all-position logits: per row, max|ours - ref| / max|ref| < 1e-4;
 *   2. the same prompt token by token (decode steps) and in chunks of 7 give the same logits as
 *      the single prefill within 1e-5 (same relative-error definition; they are in fact
 *      expected to be bitwise equal since every row is computed independently);
 *   3. all prompts of a model together in mixed batches (one sequence prefilling in chunks of 7
 *      while the others decode, block tables shuffled over the pool) match the references;
 *   4. 32 greedy tokens (argmax through the sampler at temperature 0), all prompts decoded
 *      together in one batch, equal transformers' greedy continuations;
 *   5. malformed batches are refused with -EINVAL, never crash;
 *   6. 1, 2 and 3 CPU threads give bitwise identical logits;
 *   7. per-block rotation offsets reach attention for their own sequence only (zero offsets =
 *      no offsets, bitwise). Their exact semantics are checked per op in test_cpu_ops;
 *   8. KVS_LOGITS_ARGMAX: a prefill batch mixing ARGMAX, LAST and ALL rows (more rows than one
 *      LM-head chunk) gives the full rows' logits bitwise as a batch without ARGMAX, and ids
 *      equal to the sampler's greedy pick on every row; then greedy decoding with ARGMAX rows only
 *      (no host logits at all) picks, every step, what LAST logits + the sampler pick, which is
 *      transformers' greedy continuation.
 */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/config.h"
#include "engine/runner.h"
#include "engine/sampler.h"
#include "base/util.h"
#include "models/model.h"
#include "tests/unit/test_util.h"

#define MAX_PROMPTS 8
#define N_GREEDY 32
#define BLOCK 16


struct ref {
    int vocab, n_prompts;
    int32_t *prompt[MAX_PROMPTS];
    int n_prompt[MAX_PROMPTS];
    int32_t greedy[MAX_PROMPTS][N_GREEDY];
    const float *logits[MAX_PROMPTS];   /* [n_prompt][vocab] into bin */
    float *bin;
};

static int load_ref(const char *dir, struct ref *r)
{
    memset(r, 0, sizeof *r);
    char path[2048], err[256];
    snprintf(path, sizeof path, "%s/reference.json", dir);
    char *js = kvs_read_file(path, NULL, err, sizeof err);
    if (!js) {
        printf("cannot read %s: %s\n", path, err);
        return -1;
    }
    cJSON *root = cJSON_Parse(js);
    free(js);
    if (!root) {
        printf("%s: bad JSON\n", path);
        return -1;
    }
    r->vocab = cJSON_GetObjectItem(root, "vocab_size")->valueint;
    snprintf(path, sizeof path, "%s/%s", dir, cJSON_GetObjectItem(root, "logits_file")->valuestring);
    size_t len;
    r->bin = (float *)kvs_read_file(path, &len, err, sizeof err);
    if (!r->bin) {
        printf("cannot read %s: %s\n", path, err);
        cJSON_Delete(root);
        return -1;
    }
    cJSON *ps = cJSON_GetObjectItem(root, "prompts"), *p;
    cJSON_ArrayForEach(p, ps)
    {
        KVS_ASSERT(r->n_prompts < MAX_PROMPTS);
        int i = r->n_prompts++;
        cJSON *ids = cJSON_GetObjectItem(p, "prompt"), *g = cJSON_GetObjectItem(p, "greedy");
        r->n_prompt[i] = cJSON_GetArraySize(ids);
        r->prompt[i] = kvs_xmalloc((size_t)r->n_prompt[i] * sizeof(int32_t));
        for (int j = 0; j < r->n_prompt[i]; j++) r->prompt[i][j] = cJSON_GetArrayItem(ids, j)->valueint;
        KVS_ASSERT(cJSON_GetArraySize(g) == N_GREEDY);
        for (int j = 0; j < N_GREEDY; j++) r->greedy[i][j] = cJSON_GetArrayItem(g, j)->valueint;
        size_t off = (size_t)cJSON_GetObjectItem(p, "logits_offset")->valuedouble;
        KVS_ASSERT((off + (size_t)r->n_prompt[i] * r->vocab) * 4 <= len);
        r->logits[i] = r->bin + off;
    }
    cJSON_Delete(root);
    return 0;
}

static void free_ref(struct ref *r)
{
    for (int i = 0; i < r->n_prompts; i++) free(r->prompt[i]);
    free(r->bin);
}

/* max over rows of max|a-b| / max|b| */
static double row_rel_err(const float *a, const float *b, int rows, int vocab)
{
    double worst = 0;
    for (int t = 0; t < rows; t++) {
        double md = 0, mb = 0;
        for (int i = 0; i < vocab; i++) {
            double d = fabs((double)a[(size_t)t * vocab + i] - b[(size_t)t * vocab + i]);
            if (!(d <= md)) md = d;
            if (fabs(b[(size_t)t * vocab + i]) > mb) mb = fabs(b[(size_t)t * vocab + i]);
        }
        double e = mb > 0 ? md / mb : md;
        if (!(e <= worst)) worst = e;
    }
    return worst;
}

/* a sequence being run: its tokens so far and its private blocks */
struct seqst {
    int32_t toks[1024];
    int n;                        /* tokens known */
    int pos;                      /* tokens in the KV cache */
    int32_t bt[64];
    int nb;                       /* blocks assigned */
};

static void give_blocks(struct seqst *s, const int32_t *perm, int *next, int n_blocks)
{
    for (int j = 0; j < n_blocks; j++) s->bt[j] = perm[(*next)++];
    s->nb = n_blocks;
}

static struct kvs_batch_seq bseq(struct seqst *s, int n_new, int want)
{
    struct kvs_batch_seq q = {.tokens = s->toks + s->pos, .n_tokens = n_new, .pos = s->pos, .block_table = s->bt,
                              .n_blocks = (s->pos + n_new + BLOCK - 1) / BLOCK, .want_logits = want};
    return q;
}

/* the sampler's greedy pick (temperature 0, nothing else) on one logits row */
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

/* 8. ARGMAX rows (see the header). out / one: [256][V] scratch. */
static void test_argmax_mode(struct kvs_runner *r, const struct ref *ref, const int32_t *perm, const char *name,
                             float *out, float *one)
{
    const int V = ref->vocab, P = ref->n_prompts;
    struct seqst *ss = kvs_xcalloc((size_t)P, sizeof *ss);
    int next = 0;
    for (int p = 0; p < P; p++) {
        memcpy(ss[p].toks, ref->prompt[p], (size_t)ref->n_prompt[p] * 4);
        ss[p].n = ref->n_prompt[p];
        give_blocks(&ss[p], perm, &next, (ss[p].n + N_GREEDY + BLOCK - 1) / BLOCK);
    }
    /* 8a. whole prompts in one batch: the last prompt (the longest) ALL, even ones ARGMAX, odd LAST */
    struct kvs_batch_seq qs[MAX_PROMPTS], qr[MAX_PROMPTS];
    int32_t ids[256];
    int rows = 0;
    for (int p = 0; p < P; p++) {
        int want = p == P - 1 ? KVS_LOGITS_ALL : p % 2 == 0 ? KVS_LOGITS_ARGMAX : KVS_LOGITS_LAST;
        qs[p] = bseq(&ss[p], ss[p].n, want);
        qr[p] = bseq(&ss[p], ss[p].n, want == KVS_LOGITS_ARGMAX ? KVS_LOGITS_LAST : want);
        rows += want == KVS_LOGITS_ALL ? ss[p].n : 1;
    }
    KVS_ASSERT(rows <= 256);
    struct kvs_batch bref = {qr, P, NULL}, bmix = {qs, P, ids};
    CHECK(kvs_runner_forward(r, &bref, one) == 0, "%s: reference forward", name);
    for (int i = 0; i < rows; i++) ids[i] = -5;
    CHECK(kvs_runner_forward(r, &bmix, out) == 0, "%s: mixed ARGMAX forward", name);
    int row = 0, host = 0, ok_logits = 1, ok_ids = 1;
    for (int p = 0; p < P; p++) {
        int nr = qs[p].want_logits == KVS_LOGITS_ALL ? ss[p].n : 1;
        for (int i = 0; i < nr; i++, row++) {
            const float *want_row = one + (size_t)row * V;
            if (qs[p].want_logits != KVS_LOGITS_ARGMAX)
                ok_logits &= memcmp(out + (size_t)host++ * V, want_row, (size_t)V * 4) == 0;
            int32_t g = greedy_pick(want_row, V);
            if (ids[row] != g) {
                if (ok_ids) printf("%s: mixed batch row %d (prompt %d): argmax %d, sampler %d\n", name, row, p, ids[row], g);
                ok_ids = 0;
            }
        }
        /* the first generated token, for 8b */
        ss[p].toks[ss[p].n++] = greedy_pick(one + (size_t)(row - 1) * V, V);
        ss[p].pos = ss[p].n - 1;
    }
    CHECK(ok_logits, "%s: mixed batch: host rows' logits differ from a batch without ARGMAX rows", name);
    CHECK(ok_ids, "%s: mixed batch: argmax ids differ from the sampler's greedy pick", name);
    CHECK(rows > 16 && host == rows - P / 2, "%s: the mixed batch should span several LM-head chunks", name);

    /* 8b. greedy decoding, all prompts together: LAST + sampler, then the same step again with
     * ARGMAX rows only and no logits array (the KV writes repeat identically) */
    int ok_step = 1, ok_ref = 1;
    for (int p = 0; p < P; p++) ok_ref &= ss[p].toks[ss[p].n - 1] == ref->greedy[p][0];
    for (int step = 1; step < N_GREEDY; step++) {
        for (int p = 0; p < P; p++) {
            qr[p] = bseq(&ss[p], 1, KVS_LOGITS_LAST);
            qs[p] = bseq(&ss[p], 1, KVS_LOGITS_ARGMAX);
        }
        CHECK(kvs_runner_forward(r, &bref, one) == 0, "%s: greedy LAST forward", name);
        for (int p = 0; p < P; p++) ids[p] = -5;
        CHECK(kvs_runner_forward(r, &bmix, NULL) == 0, "%s: greedy ARGMAX forward", name);
        for (int p = 0; p < P; p++) {
            int32_t g = greedy_pick(one + (size_t)p * V, V);
            if (ids[p] != g) {
                if (ok_step) printf("%s: greedy step %d prompt %d: argmax %d, sampler %d\n", name, step, p, ids[p], g);
                ok_step = 0;
            }
            ok_ref &= ids[p] == ref->greedy[p][step];
            ss[p].toks[ss[p].n++] = ids[p];
            ss[p].pos++;
        }
    }
    CHECK(ok_step, "%s: ARGMAX decode ids differ from LAST logits + sampler", name);
    CHECK(ok_ref, "%s: ARGMAX greedy continuation differs from transformers", name);
    /* an ARGMAX row needs somewhere to put its id */
    bmix.argmax = NULL;
    CHECK(kvs_runner_forward(r, &bmix, out) == -EINVAL, "%s: ARGMAX rows without batch.argmax accepted", name);
    printf("%s: ARGMAX rows: mixed with LAST/ALL rows (%d logits rows) and %d greedy steps x %d prompts match the "
           "sampler's pick on full logits\n", name, rows, N_GREEDY, P);
    free(ss);
}

static void run_model(const char *root, const char *name, const char *refname)
{
    char dir[1024], refdir[1024], err[512];
    snprintf(dir, sizeof dir, "%s/tests/data/models/%s", root, name);
    snprintf(refdir, sizeof refdir, "%s/tests/data/models/%s", root, refname);
    struct ref ref;
    if (load_ref(refdir, &ref) != 0) {
        kvs_test_fails++;
        return;
    }
    struct kvs_model *model;
    int rc = kvs_model_load(dir, &model, err, sizeof err);
    if (rc != 0) {
        printf("FAIL %s: model load: %s\n", name, err);
        kvs_test_fails++;
        free_ref(&ref);
        return;
    }
    struct kvs_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.device = "cpu";
    cfg.cpu_threads = 2;
    cfg.kv_block_size = BLOCK;
    cfg.kv_memory_bytes = 0;
    cfg.max_batch_tokens = 256;
    cfg.max_running = 8;
    /* a pool of exactly 64 blocks */
    struct kvs_runner *r;
    {
        const struct kvs_model_config *mc = kvs_model_config(model);
        cfg.kv_memory_bytes = (int64_t)64 * BLOCK * mc->n_layers * 2 * mc->n_kv_heads * mc->head_dim * 4;
    }
    rc = kvs_runner_create(&cfg, model, &r, err, sizeof err);
    if (rc != 0) {
        printf("FAIL %s: runner create: %s\n", name, err);
        kvs_test_fails++;
        kvs_model_free(model);
        free_ref(&ref);
        return;
    }
    KVS_ASSERT(kvs_runner_num_blocks(r) == 64 && kvs_runner_vocab_size(r) == ref.vocab);
    const int V = ref.vocab;
    int32_t perm[64];
    for (int i = 0; i < 64; i++) perm[i] = (i * 37 + 11) % 64;   /* scattered, all distinct */
    float *out = kvs_xmalloc((size_t)256 * V * sizeof(float));
    float *one = kvs_xmalloc((size_t)256 * V * sizeof(float));
    double worst_ref = 0, worst_tok = 0, worst_chunk = 0;
    int bitwise = 1;

    for (int p = 0; p < ref.n_prompts; p++) {
        int L = ref.n_prompt[p];
        struct seqst s;
        memset(&s, 0, sizeof s);
        memcpy(s.toks, ref.prompt[p], (size_t)L * 4);
        s.n = L;
        int next = 0;
        give_blocks(&s, perm, &next, (L + BLOCK - 1) / BLOCK);
        /* 1. one prefill, all positions */
        struct kvs_batch_seq q = bseq(&s, L, KVS_LOGITS_ALL);
        struct kvs_batch b = {&q, 1, NULL};
        rc = kvs_runner_forward(r, &b, one);
        CHECK(rc == 0, "%s: forward rc %d", name, rc);
        double e = row_rel_err(one, ref.logits[p], L, V);
        CHECK(e < 1e-4, "%s prompt %d (len %d): prefill logits rel err %g", name, p, L, e);
        if (e > worst_ref) worst_ref = e;
        /* 2a. token by token, on other blocks */
        memset(s.bt, 0, sizeof s.bt);
        give_blocks(&s, perm, &next, (L + BLOCK - 1) / BLOCK);
        for (s.pos = 0; s.pos < L; s.pos++) {
            q = bseq(&s, 1, KVS_LOGITS_LAST);
            rc = kvs_runner_forward(r, &b, out + (size_t)s.pos * V);
            CHECK(rc == 0, "%s: forward rc %d", name, rc);
        }
        e = row_rel_err(out, one, L, V);
        CHECK(e < 1e-5, "%s prompt %d: token-by-token vs prefill rel err %g", name, p, e);
        if (e > worst_tok) worst_tok = e;
        bitwise &= memcmp(out, one, (size_t)L * V * 4) == 0;
        /* 2b. chunks of 7 (reusing the same blocks: rewrites them) */
        for (s.pos = 0; s.pos < L;) {
            int c = L - s.pos < 7 ? L - s.pos : 7;
            q = bseq(&s, c, KVS_LOGITS_ALL);
            rc = kvs_runner_forward(r, &b, out + (size_t)s.pos * V);
            CHECK(rc == 0, "%s: forward rc %d", name, rc);
            s.pos += c;
        }
        e = row_rel_err(out, one, L, V);
        CHECK(e < 1e-5, "%s prompt %d: chunks of 7 vs prefill rel err %g", name, p, e);
        if (e > worst_chunk) worst_chunk = e;
        bitwise &= memcmp(out, one, (size_t)L * V * 4) == 0;
    }

    /* 3. mixed batches: prompt k prefills in chunks of 7 while the prompts before it decode their
     * prompts one token per step (teacher forcing) */
    {
        struct seqst *ss = kvs_xcalloc((size_t)ref.n_prompts, sizeof *ss);
        int next = 0;
        for (int p = 0; p < ref.n_prompts; p++) {
            memcpy(ss[p].toks, ref.prompt[p], (size_t)ref.n_prompt[p] * 4);
            ss[p].n = ref.n_prompt[p];
            give_blocks(&ss[p], perm, &next, (ss[p].n + BLOCK - 1) / BLOCK);
        }
        float *got[MAX_PROMPTS];
        for (int p = 0; p < ref.n_prompts; p++) got[p] = kvs_xcalloc((size_t)ref.n_prompt[p] * V, 4);
        int remaining = 1, steps = 0;
        while (remaining) {
            struct kvs_batch_seq qs[MAX_PROMPTS];
            int owner[MAX_PROMPTS], cnt[MAX_PROMPTS], nq = 0;
            /* reverse order so the longest prompt's chunk comes first and decode rows follow */
            for (int p = ref.n_prompts - 1; p >= 0; p--) {
                struct seqst *s = &ss[p];
                if (s->pos >= s->n) continue;
                int c = (p % 2 == 1) ? (s->n - s->pos < 7 ? s->n - s->pos : 7) : 1;
                qs[nq] = bseq(s, c, KVS_LOGITS_ALL);
                owner[nq] = p;
                cnt[nq++] = c;
            }
            remaining = nq > 0;
            if (!nq) break;
            struct kvs_batch b = {qs, nq, NULL};
            rc = kvs_runner_forward(r, &b, out);
            CHECK(rc == 0, "%s: mixed forward rc %d", name, rc);
            size_t row = 0;
            for (int i = 0; i < nq; i++) {
                struct seqst *s = &ss[owner[i]];
                memcpy(got[owner[i]] + (size_t)s->pos * V, out + row * V, (size_t)cnt[i] * V * 4);
                row += (size_t)cnt[i];
                s->pos += cnt[i];
            }
            steps++;
        }
        double worst_mixed = 0;
        for (int p = 0; p < ref.n_prompts; p++) {
            double e = row_rel_err(got[p], ref.logits[p], ref.n_prompt[p], V);
            CHECK(e < 1e-4, "%s prompt %d: mixed-batch logits rel err %g", name, p, e);
            if (e > worst_mixed) worst_mixed = e;
            free(got[p]);
        }
        printf("%s: mixed batches (%d steps, chunks of 7 + decode rows): max rel err vs transformers %.2e\n", name,
               steps, worst_mixed);

        /* 4. greedy: all prompts decode together, one batch per step, through the sampler */
        struct kvs_sampler smp[MAX_PROMPTS];
        struct kvs_sampling sp;
        memset(&sp, 0, sizeof sp);
        sp.temperature = 0.0f;
        sp.top_p = 1.0f;
        sp.repetition_penalty = 1.0f;
        for (int p = 0; p < ref.n_prompts; p++) {
            KVS_ASSERT(kvs_sampler_init(&smp[p], &sp, (uint64_t)p, V, err, sizeof err) == 0);
            /* step 0 re-runs the last prompt token: a pure decode batch from the start */
            ss[p].pos = ss[p].n - 1;
        }
        int ok_greedy = 1;
        for (int step = 0; step < N_GREEDY; step++) {
            struct kvs_batch_seq qs[MAX_PROMPTS];
            for (int p = 0; p < ref.n_prompts; p++) {
                if (ss[p].pos / BLOCK >= ss[p].nb) {
                    KVS_ASSERT(next < 64);
                    ss[p].bt[ss[p].nb++] = perm[next++];
                }
                qs[p] = bseq(&ss[p], 1, KVS_LOGITS_LAST);
            }
            struct kvs_batch b = {qs, ref.n_prompts, NULL};
            rc = kvs_runner_forward(r, &b, out);
            CHECK(rc == 0, "%s: greedy forward rc %d", name, rc);
            for (int p = 0; p < ref.n_prompts; p++) {
                struct kvs_sample_result res;
                rc = kvs_sampler_sample(&smp[p], out + (size_t)p * V, ss[p].toks, ref.n_prompt[p], ss[p].n, &res);
                KVS_ASSERT(rc == 0);
                if (res.token != ref.greedy[p][step]) {
                    if (ok_greedy)
                        printf("%s prompt %d: greedy step %d: got %d want %d\n", name, p, step, res.token,
                               ref.greedy[p][step]);
                    ok_greedy = 0;
                }
                ss[p].toks[ss[p].n++] = res.token;
                ss[p].pos++;
            }
        }
        CHECK(ok_greedy, "%s: greedy continuation differs from transformers", name);
        for (int p = 0; p < ref.n_prompts; p++) kvs_sampler_free(&smp[p]);
        free(ss);
    }

    test_argmax_mode(r, &ref, perm, name, out, one);

    /* 6. thread-count invariance: the longest prompt's prefill with 1 and 3 threads gives the
     * same bits as with 2 */
    for (int th = 1; th <= 3; th += 2) {
        int p = ref.n_prompts - 1, L = ref.n_prompt[p];
        struct kvs_config c2 = cfg;
        c2.cpu_threads = th;
        struct kvs_runner *r2;
        KVS_ASSERT(kvs_runner_create(&c2, model, &r2, err, sizeof err) == 0);
        int32_t bt[64];
        for (int j = 0; j < 64; j++) bt[j] = perm[63 - j];
        struct kvs_batch_seq q = {.tokens = ref.prompt[p], .n_tokens = L, .pos = 0, .block_table = bt,
                                  .n_blocks = 64, .want_logits = KVS_LOGITS_ALL};
        struct kvs_batch b = {&q, 1, NULL};
        KVS_ASSERT(kvs_runner_forward(r, &b, one) == 0);
        KVS_ASSERT(kvs_runner_forward(r2, &b, out) == 0);
        CHECK(memcmp(one, out, (size_t)L * V * 4) == 0, "%s: %d threads vs 2 threads: logits differ", name, th);
        kvs_runner_free(r2);
    }

    /* 7. block rotation offsets plumbing: a batch where one sequence passes an all-zero offset
     * array and another passes NULL gives the plain logits bitwise; non-zero offsets on the
     * cached blocks of a sequence change its logits (and only its own) */
    {
        int p = ref.n_prompts - 1, L = ref.n_prompt[p];   /* longest prompt: several blocks */
        int32_t bt0[64], bt1[64], zero[64], rot[64];
        for (int j = 0; j < 64; j++) {
            bt0[j] = perm[j];
            bt1[j] = perm[63 - j];
            zero[j] = 0;
            rot[j] = 1000 + 7 * j;
        }
        int nb = (L + BLOCK - 1) / BLOCK;
        /* fill the caches with the prompt but the last token, then run the last token */
        struct kvs_batch_seq q2[2] = {
            {.tokens = ref.prompt[p], .n_tokens = L - 1, .pos = 0, .block_table = bt0, .n_blocks = nb},
            {.tokens = ref.prompt[p], .n_tokens = L - 1, .pos = 0, .block_table = bt1, .n_blocks = nb},
        };
        struct kvs_batch b2 = {q2, 2, NULL};
        KVS_ASSERT(kvs_runner_forward(r, &b2, NULL) == 0);
        for (int variant = 0; variant < 2; variant++) {
            for (int i = 0; i < 2; i++) {
                q2[i].tokens = ref.prompt[p] + L - 1;
                q2[i].n_tokens = 1;
                q2[i].pos = L - 1;
                q2[i].want_logits = KVS_LOGITS_LAST;
            }
            q2[0].block_rot_offset = variant ? rot : zero;
            q2[1].block_rot_offset = NULL;
            /* offsets only on fully cached blocks, never on the block being written */
            if (variant)
                for (int j = (L - 1) / BLOCK; j < 64; j++) rot[j] = 0;
            KVS_ASSERT(kvs_runner_forward(r, &b2, out) == 0);
            const float *want = ref.logits[p] + (size_t)(L - 1) * V;
            double e1 = row_rel_err(out + V, want, 1, V);
            CHECK(e1 < 1e-4, "%s: rot plumbing: sequence without offsets rel err %g", name, e1);
            if (!variant) {
                CHECK(memcmp(out, out + V, (size_t)V * 4) == 0, "%s: zero offsets differ from NULL offsets", name);
            } else {
                double e0 = row_rel_err(out, want, 1, V);
                CHECK(e0 > 1e-3, "%s: non-zero rotation offsets had no effect (rel err %g)", name, e0);
            }
        }
    }

    /* 5. malformed batches */
    {
        int32_t tok = 5, bad_tok = V, bt = 0, bad_bt = 64;
        struct kvs_batch_seq q = {.tokens = &tok, .n_tokens = 1, .pos = 0, .block_table = &bt, .n_blocks = 1,
                                  .want_logits = 1};
        struct kvs_batch b = {&q, 1, NULL};
        q.tokens = &bad_tok;
        CHECK(kvs_runner_forward(r, &b, out) == -EINVAL, "token id = vocab accepted");
        q.tokens = &tok;
        q.block_table = &bad_bt;
        CHECK(kvs_runner_forward(r, &b, out) == -EINVAL, "block id = n_blocks accepted");
        q.block_table = &bt;
        q.pos = BLOCK;   /* needs 2 blocks, table has 1 */
        CHECK(kvs_runner_forward(r, &b, out) == -EINVAL, "short block table accepted");
        q.pos = 0;
        q.n_tokens = 0;
        CHECK(kvs_runner_forward(r, &b, out) == -EINVAL, "empty sequence accepted");
        b.n_seqs = 0;
        CHECK(kvs_runner_forward(r, &b, out) == -EINVAL, "empty batch accepted");
        CHECK(kvs_runner_copy_block(r, 0, 64) == -EINVAL, "copy_block out of range accepted");
    }

    printf("%s: prefill vs transformers max row rel err %.2e; token-by-token %.2e, chunks of 7 %.2e vs prefill "
           "(%s); greedy %d tokens x %d prompts\n",
           name, worst_ref, worst_tok, worst_chunk, bitwise ? "bitwise equal" : "not bitwise", N_GREEDY,
           ref.n_prompts);
    free(out);
    free(one);
    kvs_runner_free(r);
    kvs_model_free(model);
    free_ref(&ref);
}

/* KV pool sizing: from a byte budget, from a fraction of available memory, and errors */
static void test_pool_sizing(const char *root)
{
    char dir[1024], err[512];
    snprintf(dir, sizeof dir, "%s/tests/data/models/llama", root);
    struct kvs_model *model;
    KVS_ASSERT(kvs_model_load(dir, &model, err, sizeof err) == 0);
    const struct kvs_model_config *mc = kvs_model_config(model);
    size_t per_token = (size_t)mc->n_layers * 2 * mc->n_kv_heads * mc->head_dim * 4;
    struct kvs_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.device = "cpu";
    cfg.cpu_threads = 1;
    cfg.kv_block_size = 8;
    cfg.kv_memory_bytes = (int64_t)(per_token * 8 * 10 + per_token * 3);   /* 10 blocks and a bit */
    struct kvs_runner *r;
    KVS_ASSERT(kvs_runner_create(&cfg, model, &r, err, sizeof err) == 0);
    CHECK(kvs_runner_num_blocks(r) == 10, "budget for 10.4 blocks gave %d", kvs_runner_num_blocks(r));
    CHECK(kvs_runner_kv_bytes_per_token(r) == per_token, "kv bytes/token %zu want %zu", kvs_runner_kv_bytes_per_token(r),
          per_token);
    CHECK(kvs_runner_block_size(r) == 8 && kvs_runner_max_context(r) == mc->max_position_embeddings,
          "block size / context");
    kvs_runner_free(r);
    cfg.kv_memory_bytes = 0;
    cfg.kv_memory_fraction = 0.01;
    KVS_ASSERT(kvs_runner_create(&cfg, model, &r, err, sizeof err) == 0);
    size_t bytes = (size_t)kvs_runner_num_blocks(r) * 8 * per_token;
    CHECK(kvs_runner_num_blocks(r) > 0 && bytes <= ((size_t)4 << 30), "fraction sizing gave %d blocks",
          kvs_runner_num_blocks(r));
    kvs_runner_free(r);
    /* by need (kv.memory_bytes 0 on the CPU): max_running requests at the full context in
     * whole blocks, 3 x ceil(100 / 8) = 39 blocks (context x requests in tokens, 300 / 8 = 37,
     * left the third request at 100 tokens a block short) */
    CHECK(kvs_runner_kv_need_blocks(100, 8, 3) == 39 && kvs_runner_kv_need_blocks(96, 8, 3) == 36 &&
              kvs_runner_kv_need_blocks(1, 16, 64) == 64 && kvs_runner_kv_need_blocks(0, 8, 3) == 0 &&
              kvs_runner_kv_need_blocks(100, 0, 3) == 0 && kvs_runner_kv_need_blocks(100, 8, 0) == 0 &&
              kvs_runner_kv_need_blocks(INT32_MAX, 1, INT32_MAX) == (size_t)INT32_MAX * INT32_MAX,
          "kvs_runner_kv_need_blocks");
    cfg.kv_memory_fraction = 0.5;
    cfg.max_model_len = 100;
    cfg.max_running = 3;
    KVS_ASSERT(kvs_runner_create(&cfg, model, &r, err, sizeof err) == 0);
    CHECK(kvs_runner_num_blocks(r) == 39, "by-need sizing gave %d blocks, want 3 x ceil(100 / 8) = 39",
          kvs_runner_num_blocks(r));
    kvs_runner_free(r);
    cfg.max_model_len = 0;
    cfg.max_running = 0;
    cfg.kv_memory_bytes = 1;
    err[0] = 0;
    CHECK(kvs_runner_create(&cfg, model, &r, err, sizeof err) == -ENOMEM && strstr(err, "block"),
          "a budget below one block should fail with a message (%s)", err);
    cfg.kv_memory_bytes = 1 << 20;
    cfg.device = "tpu";
    CHECK(kvs_runner_create(&cfg, model, &r, err, sizeof err) == -EINVAL && strstr(err, "tpu"),
          "unknown device accepted (%s)", err);
    cfg.device = "cpu";
    cfg.kv_block_size = 0;
    CHECK(kvs_runner_create(&cfg, model, &r, err, sizeof err) == -EINVAL, "block size 0 accepted");
    kvs_model_free(model);
    printf("ok KV pool sizing (bytes, fraction of available memory, by need in whole blocks, errors)\n");
}

int main(void)
{
    /* every job through the workers, however small (cpu_pool.h runs small ones inline by
     * default), so the thread-count checks below compare real splits */
    setenv("KVS_CPU_MIN_WORK", "0", 1);
    const char *root = kvs_test_root();
    kvs_log_set_level(KVS_LOG_WARN);
    test_pool_sizing(root);
    const char *models[][2] = {{"llama", "llama"}, {"llama-bf16", "llama-bf16"}, {"llama31", "llama31"},
                               {"qwen2", "qwen2"}, {"qwen3", "qwen3"}, {"qwen3-sharded", "qwen3"}};
    for (size_t i = 0; i < sizeof models / sizeof models[0]; i++) run_model(root, models[i][0], models[i][1]);
    return kvs_test_summary("test_runner_parity");
}
