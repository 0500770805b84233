/* generate.c: `kvserve generate`: one prompt through the runner and the sampler, no server and
 * no scheduler; prints the continuation as it is produced, then timings on stderr.
 *
 *   kvserve generate [--model DIR] (--prompt TEXT | --prompt-ids 1,2,3) [-n N] [sampling options]
 *                    [--config FILE] [--set key=value ...]
 *
 * The config (engine/config.h) supplies model.path, device, cpu_threads and kv.block_size unless
 * the flags say otherwise. The KV pool is sized to exactly the blocks this one sequence needs. Without a tokenizer in
 * DIR, --prompt-ids still works and the output is token ids. Returns 0, 1 on a runtime error,
 * 2 on bad usage (with a message naming the option).
 */
#include <limits.h>
#include <stdio.h>
#include <string.h>

#include "engine/config.h"
#include "engine/generate.h"
#include "engine/runner.h"
#include "engine/sampler.h"
#include "engine/text/tokenizer.h"
#include "base/util.h"
#include "models/model.h"


static void usage(FILE *f)
{
    fprintf(f,
            "usage: kvserve generate [--model DIR] (--prompt TEXT | --prompt-ids 1,2,3) [options]\n"
            "  --model DIR               model directory (default: the config's model.path)\n"
            "  --config FILE             JSON config file (kvserve --help-config lists the keys)\n"
            "  --set key=value           config override, repeatable\n"
            "  -n, --max-tokens N        tokens to generate (default 64)\n"
            "  --temperature T           0 = greedy (default 1.0)\n"
            "  --top-p P                 nucleus mass, 1 = off (default 1.0)\n"
            "  --top-k K                 0 = off (default 0)\n"
            "  --min-p P                 0 = off (default 0)\n"
            "  --repetition-penalty R    1 = off (default 1.0)\n"
            "  --presence-penalty P      (default 0)\n"
            "  --frequency-penalty P     (default 0)\n"
            "  --seed S                  RNG seed (default: random)\n"
            "  --ignore-eos              do not stop at end-of-sequence tokens\n"
            "  --no-bos                  do not add the tokenizer's BOS token\n"
            "  --print-ids               print token ids instead of text\n"
            "  --device auto|cpu|cuda    (default: config device, auto)\n"
            "  --threads N               CPU threads, 0 = all cores (default: config cpu_threads, 0)\n"
            "  --prefill-chunk N         prompt tokens per forward pass (default 512)\n");
}

static int parse_int(const char *opt, const char *s, long lo, long hi, int *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) {
        fprintf(stderr, "generate: %s: expected an integer in [%ld, %ld], got \"%s\"\n", opt, lo, hi, s);
        return -EINVAL;
    }
    *out = (int)v;
    return 0;
}

static int parse_float(const char *opt, const char *s, float *out)
{
    char *end;
    errno = 0;
    float v = strtof(s, &end);
    if (errno || end == s || *end) {
        fprintf(stderr, "generate: %s: expected a number, got \"%s\"\n", opt, s);
        return -EINVAL;
    }
    *out = v;
    return 0;
}

/* "1,2,3" -> ids (malloc'ed); returns count or -EINVAL */
static int parse_ids(const char *s, int32_t **out)
{
    int cap = 16, n = 0;
    int32_t *ids = kvs_xmalloc((size_t)cap * sizeof *ids);
    const char *p = s;
    while (*p) {
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (errno || end == p || v < 0 || v > INT32_MAX || (*end && *end != ',')) {
            free(ids);
            fprintf(stderr, "generate: --prompt-ids: expected comma-separated token ids, got \"%s\"\n", s);
            return -EINVAL;
        }
        if (n == cap) ids = kvs_xrealloc(ids, (size_t)(cap *= 2) * sizeof *ids);
        ids[n++] = (int32_t)v;
        p = *end ? end + 1 : end;
    }
    if (n == 0) {
        free(ids);
        fprintf(stderr, "generate: --prompt-ids is empty\n");
        return -EINVAL;
    }
    *out = ids;
    return n;
}

int kvs_generate_main(int argc, char **argv)
{
    const char *model_dir = NULL, *prompt = NULL, *prompt_ids = NULL, *device = NULL;
    int n_gen = 64, threads = -1, chunk = 512, ignore_eos = 0, no_bos = 0, print_ids = 0;
    struct kvs_config cfg;
    char err[512];
    kvs_config_init(&cfg);
    struct kvs_sampling sp;
    memset(&sp, 0, sizeof sp);
    sp.temperature = 1.0f;
    sp.top_p = 1.0f;
    sp.repetition_penalty = 1.0f;
    int rc = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        int takes = 1;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--ignore-eos")) {
            ignore_eos = 1;
            takes = 0;
        } else if (!strcmp(a, "--no-bos")) {
            no_bos = 1;
            takes = 0;
        } else if (!strcmp(a, "--print-ids")) {
            print_ids = 1;
            takes = 0;
        }
        if (takes && !v) {
            fprintf(stderr, "generate: unknown option or missing value: %s\n", a);
            usage(stderr);
            kvs_config_free(&cfg);
            return 2;
        }
        if (!takes) continue;
        if (!strcmp(a, "--model") || !strcmp(a, "-m")) model_dir = v;
        else if (!strcmp(a, "--prompt") || !strcmp(a, "-p")) prompt = v;
        else if (!strcmp(a, "--prompt-ids")) prompt_ids = v;
        else if (!strcmp(a, "--config")) {
            if ((rc = kvs_config_load_file(&cfg, v, err, sizeof err)) != 0) fprintf(stderr, "generate: %s\n", err);
        } else if (!strcmp(a, "--set")) {
            if ((rc = kvs_config_set(&cfg, v, err, sizeof err)) != 0) fprintf(stderr, "generate: %s\n", err);
        }
        else if (!strcmp(a, "-n") || !strcmp(a, "--max-tokens")) rc = parse_int(a, v, 1, 1 << 24, &n_gen);
        else if (!strcmp(a, "--temperature")) rc = parse_float(a, v, &sp.temperature);
        else if (!strcmp(a, "--top-p")) rc = parse_float(a, v, &sp.top_p);
        else if (!strcmp(a, "--top-k")) rc = parse_int(a, v, -1, INT_MAX, &sp.top_k);
        else if (!strcmp(a, "--min-p")) rc = parse_float(a, v, &sp.min_p);
        else if (!strcmp(a, "--repetition-penalty")) rc = parse_float(a, v, &sp.repetition_penalty);
        else if (!strcmp(a, "--presence-penalty")) rc = parse_float(a, v, &sp.presence_penalty);
        else if (!strcmp(a, "--frequency-penalty")) rc = parse_float(a, v, &sp.frequency_penalty);
        else if (!strcmp(a, "--seed")) {
            char *end;
            errno = 0;
            sp.seed = strtoull(v, &end, 10);
            sp.has_seed = 1;
            if (errno || end == v || *end) {
                fprintf(stderr, "generate: --seed: expected an unsigned integer, got \"%s\"\n", v);
                rc = -EINVAL;
            }
        } else if (!strcmp(a, "--device")) device = v;
        else if (!strcmp(a, "--threads")) rc = parse_int(a, v, 0, 1024, &threads);
        else if (!strcmp(a, "--prefill-chunk")) rc = parse_int(a, v, 1, 1 << 20, &chunk);
        else {
            fprintf(stderr, "generate: unknown option %s\n", a);
            usage(stderr);
            rc = -EINVAL;
        }
        if (rc) {
            kvs_config_free(&cfg);
            return 2;
        }
        i++;
    }
    if (!model_dir) model_dir = cfg.model_path;
    if (!model_dir || !*model_dir || (!prompt == !prompt_ids)) {
        fprintf(stderr, "generate: need a model (--model or model.path) and exactly one of --prompt / --prompt-ids\n");
        usage(stderr);
        kvs_config_free(&cfg);
        return 2;
    }
    struct kvs_model *model = NULL;
    struct kvs_tokenizer *tok = NULL;
    struct kvs_runner *runner = NULL;
    struct kvs_sampler smp;
    int sampler_ready = 0;
    int32_t *ids = NULL;
    float *logits = NULL;
    int32_t *bt = NULL;
    int ret = 1, n_prompt = 0;

    if (prompt_ids && (n_prompt = parse_ids(prompt_ids, &ids)) < 0) {
        kvs_config_free(&cfg);
        return 2;
    }
    if ((rc = kvs_model_load(model_dir, &model, err, sizeof err)) != 0) {
        fprintf(stderr, "generate: %s\n", err);
        goto out;
    }
    const struct kvs_model_config *mc = kvs_model_config(model);
    if ((rc = kvs_tokenizer_load(model_dir, &tok, err, sizeof err)) != 0) {
        tok = NULL;
        if (prompt) {
            fprintf(stderr, "generate: --prompt needs a tokenizer: %s\n", err);
            goto out;
        }
        print_ids = 1;
    }

    if (!prompt_ids) {
        int add_bos = !no_bos;
        int cap = (int)strlen(prompt) + 8;
        ids = kvs_xmalloc((size_t)cap * sizeof *ids);
        n_prompt = kvs_tokenizer_encode(tok, prompt, strlen(prompt), add_bos, 1, ids, cap);
        if (n_prompt > cap) {
            ids = kvs_xrealloc(ids, (size_t)n_prompt * sizeof *ids);
            cap = n_prompt;
            n_prompt = kvs_tokenizer_encode(tok, prompt, strlen(prompt), add_bos, 1, ids, cap);
        }
        if (n_prompt < 0) {
            fprintf(stderr, "generate: cannot tokenize the prompt (%s)\n", strerror(-n_prompt));
            goto out;
        }
        if (n_prompt == 0) {
            fprintf(stderr, "generate: the prompt is empty after tokenization\n");
            ret = 2;
            goto out;
        }
    }
    for (int i = 0; i < n_prompt; i++)
        if (ids[i] < 0 || ids[i] >= mc->vocab_size) {
            fprintf(stderr, "generate: prompt token id %d is outside the vocabulary [0, %d)\n", ids[i],
                    mc->vocab_size);
            ret = 2;
            goto out;
        }
    int max_ctx = mc->max_position_embeddings > 0 ? mc->max_position_embeddings : n_prompt + n_gen;
    if (n_prompt >= max_ctx) {
        fprintf(stderr, "generate: prompt of %d tokens does not fit the context of %d\n", n_prompt, max_ctx);
        ret = 2;
        goto out;
    }
    if (n_prompt + n_gen > max_ctx) {
        kvs_log(KVS_LOG_WARN, "generate: -n %d cut to %d to fit the context of %d tokens", n_gen, max_ctx - n_prompt,
                max_ctx);
        n_gen = max_ctx - n_prompt;
    }

    /* a pool sized for this one sequence */
    const int block = cfg.kv_block_size > 0 ? cfg.kv_block_size : 16;
    int total = n_prompt + n_gen, n_blocks = (total + block - 1) / block;
    if (device) {
        free(cfg.device);
        cfg.device = kvs_xstrdup(device);
    }
    if (threads >= 0) cfg.cpu_threads = threads;
    cfg.kv_block_size = block;
    cfg.max_model_len = total;
    cfg.max_batch_tokens = chunk < n_prompt ? chunk : n_prompt;
    cfg.max_running = 1;
    cfg.kv_memory_bytes = (int64_t)n_blocks * block * mc->n_layers * 2 * mc->n_kv_heads * mc->head_dim * 4;
    if ((rc = kvs_runner_create(&cfg, model, &runner, err, sizeof err)) != 0) {
        fprintf(stderr, "generate: %s\n", err);
        goto out;
    }
    if (kvs_runner_num_blocks(runner) < n_blocks) {
        fprintf(stderr, "generate: KV pool too small (%d blocks, need %d)\n", kvs_runner_num_blocks(runner), n_blocks);
        goto out;
    }
    uint64_t rid = (uint64_t)(kvs_wall_time() * 1e6);
    if ((rc = kvs_sampler_init(&smp, &sp, rid, mc->vocab_size, err, sizeof err)) != 0) {
        fprintf(stderr, "generate: %s\n", err);
        ret = 2;
        goto out;
    }
    sampler_ready = 1;
    bt = kvs_xmalloc((size_t)n_blocks * sizeof *bt);
    for (int i = 0; i < n_blocks; i++) bt[i] = i;
    ids = kvs_xrealloc(ids, (size_t)total * sizeof *ids);
    logits = kvs_xmalloc((size_t)mc->vocab_size * sizeof *logits);

    /* stop ids: the model's EOS list plus the tokenizer's */
    int32_t stop[KVS_MAX_EOS + 16];
    int n_stop = 0;
    for (int i = 0; i < mc->n_eos && n_stop < KVS_MAX_EOS; i++) stop[n_stop++] = mc->eos_token_ids[i];
    if (tok) {
        const int32_t *te;
        int nte = kvs_tokenizer_eos(tok, &te);
        for (int i = 0; i < nte && n_stop < (int)(sizeof stop / sizeof stop[0]); i++) stop[n_stop++] = te[i];
    }

    struct kvs_detok dt;
    if (tok && !print_ids) kvs_detok_init(&dt, tok, 1);
    char piece[1024];

    /* plain greedy: the backend picks the token (argmax_rows) and only its id comes back */
    const int dev_greedy = kvs_sampler_is_argmax(&smp);
    const int want = dev_greedy ? KVS_LOGITS_ARGMAX : KVS_LOGITS_LAST;
    int32_t picked = -1;
    double t0 = kvs_now();
    for (int pos = 0; pos < n_prompt;) {
        int c = n_prompt - pos < cfg.max_batch_tokens ? n_prompt - pos : cfg.max_batch_tokens;
        struct kvs_batch_seq q = {.tokens = ids + pos, .n_tokens = c, .pos = pos, .block_table = bt,
                                  .n_blocks = n_blocks, .want_logits = pos + c == n_prompt ? want : KVS_LOGITS_NONE};
        struct kvs_batch b = {&q, 1, &picked};
        if ((rc = kvs_runner_forward(runner, &b, logits)) != 0) {
            fprintf(stderr, "generate: forward failed: %s\n", strerror(-rc));
            goto out;
        }
        pos += c;
    }
    double t1 = kvs_now();
    int n_done = 0;
    const char *finish = "length";
    while (n_done < n_gen) {
        struct kvs_sample_result res = {.token = picked};
        if (dev_greedy ? picked < 0 : (rc = kvs_sampler_sample(&smp, logits, ids, n_prompt, n_prompt + n_done, &res)) != 0) {
            fprintf(stderr, "generate: sampling failed (no token has a finite logit)\n");
            rc = -EINVAL;
            goto out;
        }
        int is_stop = 0;
        for (int i = 0; i < n_stop && !ignore_eos; i++) is_stop |= res.token == stop[i];
        if (is_stop) {
            finish = "stop";
            break;
        }
        ids[n_prompt + n_done] = res.token;
        n_done++;
        if (print_ids) {
            printf("%s%d", n_done > 1 ? " " : "", res.token);
        } else {
            int w = kvs_detok_feed(&dt, res.token, piece, sizeof piece);
            if (w > 0) fwrite(piece, 1, (size_t)w, stdout);
        }
        fflush(stdout);
        if (n_done == n_gen) break;
        int pos = n_prompt + n_done - 1;
        struct kvs_batch_seq q = {.tokens = ids + pos, .n_tokens = 1, .pos = pos, .block_table = bt,
                                  .n_blocks = n_blocks, .want_logits = want};
        struct kvs_batch b = {&q, 1, &picked};
        if ((rc = kvs_runner_forward(runner, &b, logits)) != 0) {
            fprintf(stderr, "\ngenerate: forward failed: %s\n", strerror(-rc));
            goto out;
        }
    }
    if (tok && !print_ids) {
        int w = kvs_detok_flush(&dt, piece, sizeof piece);
        if (w > 0) fwrite(piece, 1, (size_t)w, stdout);
    }
    printf("\n");
    fflush(stdout);
    double t2 = kvs_now();
    fprintf(stderr,
            "generate: %s backend; prompt %d tokens in %.3f s (%.1f tok/s); generated %d tokens in %.3f s "
            "(%.1f tok/s); finish %s\n",
            kvs_runner_backend_name(runner), n_prompt, t1 - t0, n_prompt / (t1 - t0 > 0 ? t1 - t0 : 1e-9), n_done,
            t2 - t1, n_done / (t2 - t1 > 0 ? t2 - t1 : 1e-9), finish);
    ret = 0;
out:
    if (sampler_ready) kvs_sampler_free(&smp);
    free(ids);
    free(bt);
    free(logits);
    kvs_runner_free(runner);
    kvs_tokenizer_free(tok);
    kvs_model_free(model);
    kvs_config_free(&cfg);
    return ret;
}
