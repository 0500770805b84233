/* test_cuda_model.c: the whole model on the CUDA backend against the CPU backend, through the
 * runner (engine/runner.c, device=cuda vs device=cpu), on every tiny model in tests/data/models.
 *
 * Two sequences share the batch: A is prefilled (33 tokens) then decodes; B joins at step 3 with
 * a 20-token prompt while A decodes (a mixed prefill + decode step), then both decode. Each
 * step both runners get the same tokens (the CPU's greedy choice), and every logits row is
 * compared: the CUDA greedy token must equal the CPU's, and the relative L2 error of the logits
 * must stay under LOGITS_TOL.
 *
 * LOGITS_TOL is 1e-1, not the 1e-2 each single op meets (test_cuda_ops): the CUDA backend
 * stores KV in bf16 and rounds GEMM inputs to bf16, and these tiny random models (weights
 * N(0, 0.3), sharp attention) amplify that rounding; measured on an H200 (2026-11-22): worst
 * rel-L2 2.0e-2 (qwen3) to 5.9e-2 (llama), 3.6e-2 even for llama-bf16 whose weights are exact.
 * A broken kernel gives errors of order 1.
 * Greedy tokens: a CUDA token that differs from the CPU's fails unless the CPU's top-2 margin
 * on that row is under 4x the rms difference of the two logits rows (a near-tie that bf16
 * noise can legitimately flip; seen at margins 0.01 to 0.11 on these models); such flips are
 * counted and printed.
 * Device argmax (runner.h batch.argmax, KVS_LOGITS_ARGMAX): the CUDA forward also returns each
 * row's argmax id, which must equal the host argmax of the logits it downloaded (same values:
 * exact); then the same step runs again on the CUDA runner with ARGMAX rows only and no logits
 * array (the KV writes repeat identically; decode steps replay their graph) and must give the
 * same ids.
 * Needs a GPU; exits 1 with a message when none.
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

#define STEPS 24
#define BS 16
#define LOGITS_TOL 1e-1

static struct kvs_runner *make_runner(const struct kvs_model *m, const char *device)
{
    struct kvs_config cfg;
    kvs_config_init(&cfg);
    char err[512], set[64];
    snprintf(set, sizeof set, "device=%s", device);
    if (kvs_config_set(&cfg, set, err, sizeof err) || kvs_config_set(&cfg, "kv.block_size=16", err, sizeof err) ||
        kvs_config_set(&cfg, "model.max_model_len=256", err, sizeof err)) {
        fprintf(stderr, "config: %s\n", err);
        exit(1);
    }
    cfg.kv_memory_bytes = 8 << 20;
    struct kvs_runner *r = NULL;
    int rc = kvs_runner_create(&cfg, m, &r, err, sizeof err);
    kvs_config_free(&cfg);
    if (rc) {
        fprintf(stderr, "runner (%s): %s (%d)\n", device, err, rc);
        exit(1);
    }
    return r;
}

static int run_model(const char *dir)
{
    char err[512];
    struct kvs_model *m = NULL;
    if (kvs_model_load(dir, &m, err, sizeof err)) {
        fprintf(stderr, "%s: %s\n", dir, err);
        return 1;
    }
    int vocab = kvs_model_config(m)->vocab_size;
    struct kvs_runner *rc = make_runner(m, "cpu"), *rg = make_runner(m, "cuda");
    if (strcmp(kvs_runner_backend_name(rg), "cuda") != 0) {
        fprintf(stderr, "device=cuda gave backend %s\n", kvs_runner_backend_name(rg));
        return 1;
    }
    int32_t ta[64 + STEPS], tb[64 + STEPS];
    uint32_t s = 12345;
    for (int i = 0; i < 33; i++) { s = s * 1664525u + 1013904223u; ta[i] = (int32_t)(s >> 8) % vocab; }
    for (int i = 0; i < 20; i++) { s = s * 1664525u + 1013904223u; tb[i] = (int32_t)(s >> 8) % vocab; }
    int32_t bta[16], btb[16];
    for (int i = 0; i < 16; i++) { bta[i] = 2 * i + 1; btb[i] = 2 * i + 2; } /* interleaved, non-trivial */
    int na = 33, nb = 20, pa = 0, pb = 0, b_started = 0, fails = 0, ties = 0;
    float *lc = kvs_xmalloc((size_t)2 * vocab * 4), *lg = kvs_xmalloc((size_t)2 * vocab * 4);
    double worst = 0, min_margin = INFINITY;
    for (int step = 0; step < STEPS; step++) {
        struct kvs_batch_seq seqs[2];
        int ns = 0;
        seqs[ns++] = (struct kvs_batch_seq){.tokens = ta + pa, .n_tokens = na - pa, .pos = pa, .block_table = bta,
                                            .n_blocks = (na + BS - 1) / BS, .want_logits = 1};
        if (step >= 3) {
            seqs[ns++] = (struct kvs_batch_seq){.tokens = tb + pb, .n_tokens = nb - pb, .pos = pb, .block_table = btb,
                                                .n_blocks = (nb + BS - 1) / BS, .want_logits = 1};
            b_started = 1;
        }
        struct kvs_batch batch = {seqs, ns, NULL};
        int32_t ids[2] = {-5, -5}, ids_only[2] = {-5, -5};
        struct kvs_batch gbatch = {seqs, ns, ids};
        int e1 = kvs_runner_forward(rc, &batch, lc), e2 = kvs_runner_forward(rg, &gbatch, lg);
        /* the same step again, ids only (ARGMAX rows, nothing downloaded but the ids) */
        struct kvs_batch_seq aseqs[2];
        for (int q = 0; q < ns; q++) {
            aseqs[q] = seqs[q];
            aseqs[q].want_logits = KVS_LOGITS_ARGMAX;
        }
        struct kvs_batch abatch = {aseqs, ns, ids_only};
        int e3 = e2 ? 0 : kvs_runner_forward(rg, &abatch, NULL);
        if (e1 || e2 || e3) {
            fprintf(stderr, "%s step %d: forward failed (cpu %d, cuda %d, cuda argmax-only %d)\n", dir, step, e1, e2,
                    e3);
            return 1;
        }
        for (int q = 0; q < ns; q++) {
            const float *c = lc + (size_t)q * vocab, *g = lg + (size_t)q * vocab;
            double num = 0, den = 0;
            int nan = 0;
            for (int i = 0; i < vocab; i++) {
                if (!isfinite(g[i])) nan = 1;
                num += ((double)g[i] - c[i]) * ((double)g[i] - c[i]);
                den += (double)c[i] * c[i];
            }
            double e = sqrt(num / den);
            float mc, mg;
            int tc = kvs_test_argmax(c, vocab, &mc), tg = kvs_test_argmax(g, vocab, &mg);
            if (ids[q] != tg || ids_only[q] != tg) {
                fails++;
                printf("FAIL %s step %d seq %c: device argmax %d (ARGMAX rows only: %d), host argmax of the cuda "
                       "logits %d\n", dir, step, q ? 'B' : 'A', ids[q], ids_only[q], tg);
            }
            if (e > worst) worst = e;
            if (mc < min_margin) min_margin = mc;
            double rms = sqrt(num / vocab);
            int tie = tc != tg && mc < 4.0 * rms;
            if (tie) {
                ties++;
                printf("near-tie %s step %d seq %c: cpu %d cuda %d, cpu margin %.4f < 4 x rms diff %.4f\n", dir, step,
                       q ? 'B' : 'A', tc, tg, mc, rms);
            }
            if (nan || e >= LOGITS_TOL || (tc != tg && !tie)) {
                fails++;
                printf("FAIL %s step %d seq %c: rel_l2 %.3e%s, greedy cpu %d (margin %.4f) cuda %d\n", dir, step,
                       q ? 'B' : 'A', e, nan ? " NON-FINITE" : "", tc, mc, tg);
            }
            if (q == 0) { pa = na; ta[na++] = tc; }
            else { pb = nb; tb[nb++] = tc; }
        }
    }
    printf("%s %s: %d steps, 2 sequences (mixed prefill+decode), worst logits rel_l2 %.3e, smallest cpu "
           "top-2 margin %.4f, near-tie flips %d\n", fails ? "FAIL" : "ok  ", dir, STEPS, worst, min_margin, ties);
    (void)b_started;
    free(lc);
    free(lg);
    kvs_runner_free(rc);
    kvs_runner_free(rg);
    kvs_model_free(m);
    return fails != 0;
}

int main(void)
{
    const char *root = kvs_test_root();
    static const char *models[] = {"llama", "llama-bf16", "llama31", "qwen2", "qwen3", "qwen3-sharded"};
    int bad = 0;
    setvbuf(stdout, NULL, _IOLBF, 0);
    for (size_t i = 0; i < sizeof models / sizeof models[0]; i++) {
        char dir[1024];
        snprintf(dir, sizeof dir, "%s/tests/data/models/%s", root, models[i]);
        bad += run_model(dir);
    }
    printf("%d models failed\n", bad);
    return bad ? 1 : 0;
}
