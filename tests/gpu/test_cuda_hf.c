/* test_cuda_hf.c: the CUDA runner's logits against Hugging Face transformers on random-weight
 * models built from the real Llama-3.1-8B and Qwen3-8B configs (llama3 RoPE scaling; Qwen3's
 * per-head q/k norms and eps 1e-6; head_dim 128, GQA 4, 128K / 152K vocabularies).
 *
 * scripts/check-hf-logits (run by make test-gpu before this test) writes, for each shape, the
 * model (scripts/make-random-model.py --layers 4 --random-norms: the real layer shapes, 4 of
 * them) and the transformers reference (scripts/hf-logits-reference.py: fp32 logits of the last
 * 16 of 200 teacher-forced positions) under $KVS_HF_DIR (default $KVS_BUILD/hf-check/<shape>/).
 * A missing directory FAILS the test with the command that makes it: the check is never
 * skipped silently.
 *
 * kvserve runs the same 200 ids on device=cuda: the first 192 in one prefill step (logits of
 * its last 8 rows), then 8 decode steps of one id each (each decode step replays a recorded
 * graph), and every one of the 16 logits rows is compared:
 *   - relative L2 error under TOL (bf16 weights, bf16 KV and bf16 GEMM inputs against an fp32
 *     reference; the per-op error is ~3e-3, test_cuda_ops);
 *   - the greedy token equal to the reference's, unless the reference's top-2 margin is under
 *     4x the rms difference of the two rows (a near-tie bf16 may flip; counted, printed);
 *   - no NaN / inf.
 * KVS_HF_DEVICE=cpu runs the same check on the fp32 CPU backend (a check of the check: its
 * errors are ~1e-6).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/config.h"
#include "engine/runner.h"
#include "base/util.h"
#include "models/model.h"
#include "tests/unit/test_util.h"

#define TOL 3e-2
#define BS 16

struct ref {
    int vocab, n_tokens, first, n_rows;
    int32_t *tokens;
    float *logits;                /* [n_rows][vocab] */
};

static int read_ref(const char *path, struct ref *r)
{
    FILE *f = fopen(path, "rb");
    if (!f) return -1;
    char magic[8];
    int32_t h[4];
    int ok = fread(magic, 1, 8, f) == 8 && !memcmp(magic, "KVSHF001", 8) && fread(h, 4, 4, f) == 4;
    if (ok) {
        r->vocab = h[0], r->n_tokens = h[1], r->first = h[2], r->n_rows = h[3];
        ok = r->vocab > 0 && r->n_tokens > 0 && r->n_rows > 0 && r->first + r->n_rows == r->n_tokens;
    }
    if (ok) {
        r->tokens = kvs_xmalloc((size_t)r->n_tokens * 4);
        r->logits = kvs_xmalloc((size_t)r->n_rows * r->vocab * 4);
        ok = fread(r->tokens, 4, (size_t)r->n_tokens, f) == (size_t)r->n_tokens &&
             fread(r->logits, 4, (size_t)r->n_rows * r->vocab, f) == (size_t)r->n_rows * r->vocab;
    }
    fclose(f);
    return ok ? 0 : -2;
}

/* compares one row; returns 1 on failure */
static int compare_row(const char *name, int pos, const float *ref, const float *got, int vocab, double *worst,
                       int *ties)
{
    double num = 0, den = 0;
    int bad = 0;
    for (int i = 0; i < vocab; i++) {
        if (!isfinite(got[i])) bad = 1;
        num += ((double)got[i] - ref[i]) * ((double)got[i] - ref[i]);
        den += (double)ref[i] * ref[i];
    }
    const double e = sqrt(num / den), rms = sqrt(num / vocab);
    float mr, mg;
    const int tr = kvs_test_argmax(ref, vocab, &mr), tg = kvs_test_argmax(got, vocab, &mg);
    const int tie = tr != tg && mr < 4.0 * rms;
    if (e > *worst) *worst = e;
    if (tie) {
        (*ties)++;
        printf("near-tie %s position %d: transformers %d, kvserve %d, reference margin %.4f < 4 x rms diff %.4f\n",
               name, pos, tr, tg, mr, rms);
    }
    if (bad || e >= TOL || (tr != tg && !tie)) {
        printf("FAIL %s position %d: rel_l2 %.3e%s, greedy transformers %d (margin %.4f) kvserve %d\n", name, pos, e,
               bad ? " NON-FINITE" : "", tr, mr, tg);
        return 1;
    }
    return 0;
}

static int run_shape(const char *dir, const char *shape)
{
    char path[1200], err[512];
    snprintf(path, sizeof path, "%s/%s/ref.bin", dir, shape);
    struct ref R;
    int rc = read_ref(path, &R);
    if (rc) {
        printf("FAIL %s: %s %s; make it with: scripts/check-hf-logits (python3 with torch + transformers)\n", shape,
               path, rc == -1 ? "is missing" : "is malformed");
        return 1;
    }
    snprintf(path, sizeof path, "%s/%s", dir, shape);
    struct kvs_model *m = NULL;
    if (kvs_model_load(path, &m, err, sizeof err)) {
        printf("FAIL %s: %s\n", shape, err);
        return 1;
    }
    if (kvs_model_config(m)->vocab_size != R.vocab) {
        printf("FAIL %s: vocabulary %d, reference %d\n", shape, kvs_model_config(m)->vocab_size, R.vocab);
        return 1;
    }
    struct kvs_config cfg;
    kvs_config_init(&cfg);
    char dev[64];
    snprintf(dev, sizeof dev, "device=%s", getenv("KVS_HF_DEVICE") ? getenv("KVS_HF_DEVICE") : "cuda");
    if (kvs_config_set(&cfg, dev, err, sizeof err) || kvs_config_set(&cfg, "kv.block_size=16", err, sizeof err) ||
        kvs_config_set(&cfg, "model.max_model_len=256", err, sizeof err)) {
        printf("FAIL config: %s\n", err);
        return 1;
    }
    cfg.kv_memory_bytes = 64 << 20;
    struct kvs_runner *r = NULL;
    rc = kvs_runner_create(&cfg, m, &r, err, sizeof err);
    kvs_config_free(&cfg);
    if (rc || strcmp(kvs_runner_backend_name(r), dev + 7) != 0) {
        printf("FAIL %s: no %s runner (%s)\n", shape, dev + 7, rc ? err : kvs_runner_backend_name(r));
        return 1;
    }
    const int V = R.vocab, n = R.n_tokens, prompt = R.first + R.n_rows / 2, in_prefill = prompt - R.first;
    int32_t bt[64];
    for (int i = 0; i < 64; i++) bt[i] = 63 - i; /* blocks in reverse: a non-trivial table */
    float *lg = kvs_xmalloc((size_t)prompt * V * 4);
    int fails = 0, ties = 0;
    double worst = 0;
    /* prefill: every row's logits, the last in_prefill compared */
    struct kvs_batch_seq s = {.tokens = R.tokens, .n_tokens = prompt, .pos = 0, .block_table = bt,
                              .n_blocks = (prompt + BS - 1) / BS, .want_logits = KVS_LOGITS_ALL};
    struct kvs_batch b = {&s, 1, NULL};
    if ((rc = kvs_runner_forward(r, &b, lg))) {
        printf("FAIL %s: prefill forward %d\n", shape, rc);
        return 1;
    }
    for (int i = 0; i < in_prefill; i++)
        fails += compare_row(shape, R.first + i, R.logits + (size_t)i * V, lg + (size_t)(prompt - in_prefill + i) * V,
                             V, &worst, &ties);
    /* decode: one id a step, teacher forced */
    for (int p = prompt; p < n; p++) {
        s = (struct kvs_batch_seq){.tokens = R.tokens + p, .n_tokens = 1, .pos = p, .block_table = bt,
                                   .n_blocks = (p + 1 + BS - 1) / BS, .want_logits = KVS_LOGITS_LAST};
        if ((rc = kvs_runner_forward(r, &b, lg))) {
            printf("FAIL %s: decode forward at %d: %d\n", shape, p, rc);
            return 1;
        }
        fails += compare_row(shape, p, R.logits + (size_t)(p - R.first) * V, lg, V, &worst, &ties);
    }
    printf("%s %s: %d prefill + %d decode rows vs transformers (fp32), worst rel_l2 %.3e (tolerance %.0e), "
           "near-tie flips %d\n", fails ? "FAIL" : "ok  ", shape, in_prefill, n - prompt, worst, TOL, ties);
    free(lg);
    free(R.tokens);
    free(R.logits);
    kvs_runner_free(r);
    kvs_model_free(m);
    return fails != 0;
}

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    char dflt[1024];
    const char *dir = getenv("KVS_HF_DIR");
    if (!dir) {
        const char *b = getenv("KVS_BUILD");
        snprintf(dflt, sizeof dflt, "%s/hf-check", b ? b : "build");
        dir = dflt;
    }
    int bad = run_shape(dir, "llama-3.1-8b") + run_shape(dir, "qwen3-8b");
    printf("%d shapes failed\n", bad);
    return bad ? 1 : 0;
}
