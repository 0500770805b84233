/* test_gguf_smollm2.c: SmolLM2-135M-Instruct (Q4_1 GGUF) end to end on the CPU backend against
 * transformers 5 loading the same file (from_pretrained(dir, gguf_file=...), dequantized by the
 * gguf package, fp32): tests/data/gguf/smollm2_ref.bin, made by scripts/make-gguf-references.py.
 *
 * For each of 8 chat prompts:
 *   - the chat format detected from the file's tokenizer.chat_template, rendered and tokenized by
 *     kvserve, gives transformers' apply_chat_template ids exactly;
 *   - the logits at the last prompt position match on transformers' top 2048 ids: relative L2
 *     error and max |diff| / max |logit| both under 1e-4;
 *   - 64 greedy steps give transformers' 64 tokens exactly.
 * (Under AddressSanitizer: 2 prompts, 16 steps.) The model lives in the git-ignored cache that scripts/setup fills (scripts/fetch-smollm2). If it
 * is missing the test FAILS and says how to fetch it; KVS_ALLOW_NO_SMOLLM2=1 (offline machines)
 * turns that into a printed SKIP.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/text/chat.h"
#include "engine/config.h"
#include "engine/runner.h"
#include "engine/text/tokenizer.h"
#include "base/util.h"
#include "models/model.h"
#include "tests/unit/test_util.h"

#define BS 16
#define TOL 1e-4

/* Under AddressSanitizer (make test SAN=1) the fp32 CPU forward pass is many times slower: check
 * the first 2 prompts and 16 greedy steps there, everything otherwise. */
#if defined(__SANITIZE_ADDRESS__)
#define MAX_PROMPTS 2
#define MAX_STEPS 16
#else
#define MAX_PROMPTS 8
#define MAX_STEPS 64
#endif

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    char path[1200], ref_path[1200], err[512];
    snprintf(path, sizeof path, "%s/models/cache/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", kvs_test_root());
    snprintf(ref_path, sizeof ref_path, "%s/tests/data/gguf/smollm2_ref.bin", kvs_test_root());
    if (access(path, R_OK)) {
        if (getenv("KVS_ALLOW_NO_SMOLLM2") && !strcmp(getenv("KVS_ALLOW_NO_SMOLLM2"), "1")) {
            printf("SKIP: %s is missing and KVS_ALLOW_NO_SMOLLM2=1\n", path);
            return 0;
        }
        printf("FAIL: %s is missing: fetch it with scripts/fetch-smollm2 (scripts/setup does), or set "
               "KVS_ALLOW_NO_SMOLLM2=1 on an offline machine\n", path);
        return 1;
    }
    size_t len;
    uint8_t *ref = (uint8_t *)kvs_read_file(ref_path, &len, err, sizeof err);
    REQUIRE(ref && len >= 24 && !memcmp(ref, "KVSGSM01", 8), "%s: missing or malformed (%s)", ref_path, err);
    uint32_t h[4];
    memcpy(h, ref + 8, 16);
    const int n_ref_steps = (int)h[2], top = (int)h[3], V = (int)h[1];
    const int n_prompts = (int)h[0] < MAX_PROMPTS ? (int)h[0] : MAX_PROMPTS;
    const int n_steps = n_ref_steps < MAX_STEPS ? n_ref_steps : MAX_STEPS;
    size_t off = 24;

    struct kvs_model *m = NULL;
    REQUIRE(kvs_model_load(path, &m, err, sizeof err) == 0, "%s", err);
    REQUIRE(kvs_model_config(m)->vocab_size == V, "vocab %d, reference %d", kvs_model_config(m)->vocab_size, V);
    struct kvs_tokenizer *tok = NULL;
    REQUIRE(kvs_tokenizer_load(path, &tok, err, sizeof err) == 0, "%s", err);
    const enum kvs_chat_format fmt = kvs_chat_detect(path);
    CHECK(fmt == KVS_CHAT_SMOLLM, "chat format detected from the GGUF: %s", kvs_chat_format_name(fmt));

    struct kvs_config cfg;
    kvs_config_init(&cfg);
    REQUIRE(!kvs_config_set(&cfg, "device=cpu", err, sizeof err) &&
                !kvs_config_set(&cfg, "kv.block_size=16", err, sizeof err) &&
                !kvs_config_set(&cfg, "model.max_model_len=512", err, sizeof err),
            "config: %s", err);
    cfg.kv_memory_bytes = 64 << 20;
    struct kvs_runner *r = NULL;
    REQUIRE(kvs_runner_create(&cfg, m, &r, err, sizeof err) == 0, "runner: %s", err);
    kvs_config_free(&cfg);

    float *lg = kvs_xmalloc((size_t)V * 4);
    int32_t bt[32], ids[512];
    for (int i = 0; i < 32; i++) bt[i] = 31 - i;
    double worst_l2 = 0, worst_max = 0;
    int greedy_ok = 0, ids_ok = 0;
    for (int p = 0; p < n_prompts; p++) {
        uint32_t n;
        REQUIRE(off + 4 <= len, "truncated reference");
        memcpy(&n, ref + off, 4);
        off += 4;
        REQUIRE(n > 0 && n + n_ref_steps <= 512 && off + (n + n_ref_steps + 2 * (size_t)top) * 4 <= len,
                "bad reference");
        const int32_t *rids = (const int32_t *)(ref + off), *rgen = rids + n, *rtop = rgen + n_ref_steps;
        const float *rlog = (const float *)(rtop + top);
        off += (n + n_ref_steps + 2 * (size_t)top) * 4;

        /* the prompt text is the reference ids decoded (user content only), rendered again */
        static const char *const prompts[] = {"What is the capital of France?", "Write a haiku about the sea.",
                                              "Explain photosynthesis in one sentence.", "List three prime numbers.",
                                              "Who wrote Romeo and Juliet?", "Translate 'good morning' into Spanish.",
                                              "What is 12 times 7?", "Give me a tip for learning to code."};
        REQUIRE(p < 8, "more prompts than the test knows");
        struct kvs_chat_message msg = {"user", prompts[p]};
        char *text = kvs_chat_render(fmt, &msg, 1, NULL, 0, err, sizeof err);
        CHECK(text != NULL, "render: %s", err);
        int k = text ? kvs_tokenizer_encode(tok, text, strlen(text), 0, 1, ids, 512) : -1;
        free(text);
        int same = k == (int)n && !memcmp(ids, rids, n * 4);
        CHECK(same, "prompt %d: kvserve's %d chat ids differ from transformers' %u", p, k, n);
        ids_ok += same;

        /* prefill transformers' ids, then greedy decode */
        struct kvs_batch_seq s = {.tokens = (int32_t *)rids, .n_tokens = (int)n, .pos = 0, .block_table = bt,
                                  .n_blocks = ((int)n + BS - 1) / BS, .want_logits = KVS_LOGITS_LAST};
        struct kvs_batch b = {&s, 1, NULL};
        REQUIRE(kvs_runner_forward(r, &b, lg) == 0, "prefill");
        double num = 0, den = 0, maxd = 0, maxr = 0;
        for (int i = 0; i < top; i++) {
            const double d = (double)lg[rtop[i]] - rlog[i];
            num += d * d;
            den += (double)rlog[i] * rlog[i];
            if (fabs(d) > maxd) maxd = fabs(d);
            if (fabs(rlog[i]) > maxr) maxr = fabs(rlog[i]);
        }
        const double l2 = sqrt(num / den), mx = maxd / maxr;
        if (l2 > worst_l2) worst_l2 = l2;
        if (mx > worst_max) worst_max = mx;
        CHECK(l2 < TOL && mx < TOL, "prompt %d: logits rel L2 %.2e, max |diff|/max|logit| %.2e", p, l2, mx);
        int32_t gen[512];
        int agree = 0;
        for (int t = 0; t < n_steps; t++) {
            float margin;
            gen[t] = kvs_test_argmax(lg, V, &margin);
            if (gen[t] != rgen[t]) break;
            agree++;
            s = (struct kvs_batch_seq){.tokens = &gen[t], .n_tokens = 1, .pos = (int)n + t, .block_table = bt,
                                       .n_blocks = ((int)n + t + 1 + BS - 1) / BS, .want_logits = KVS_LOGITS_LAST};
            REQUIRE(kvs_runner_forward(r, &b, lg) == 0, "decode");
        }
        CHECK(agree == n_steps, "prompt %d: greedy tokens agree for %d of %d steps", p, agree, n_steps);
        greedy_ok += agree == n_steps;
        if (p == 0) {
            char *ans = kvs_tokenizer_decode(tok, gen, 8, 1);
            printf("prompt 0 answer starts: \"%s\"\n", ans ? ans : "?");
            CHECK(ans && !strncmp(ans, "The capital of France is Paris.", 31), "answer: %s", ans ? ans : "?");
            free(ans);
        }
    }
    printf("SmolLM2-135M-Instruct vs transformers (fp32, same GGUF): %d/%d prompts with identical chat ids, "
           "worst logits rel L2 %.2e, worst max|diff|/max|logit| %.2e (tolerance %.0e), %d/%d prompts with "
           "identical %d-step greedy tokens\n",
           ids_ok, n_prompts, worst_l2, worst_max, TOL, greedy_ok, n_prompts, n_steps);
    free(lg);
    free(ref);
    kvs_runner_free(r);
    kvs_tokenizer_free(tok);
    kvs_model_free(m);
    return kvs_test_summary("test_gguf_smollm2");
}
