/* kvserve_eval_main.c: kvserve-eval, the quality harness (docs/eval.md).
 *
 * Compares the current config (--config + --set, the same machinery as kvserve) with the
 * reference setting of the same model (kv.decode=full, kv.storage=auto = the backend's full
 * precision, kv.reuse=none) on the same inputs, and prints one table (or --json):
 *   teacher-forced on held-out text (--text, or --tokens ids): perplexity of both, per-position
 *     KL(p_ref || p_cfg) (mean, p95, max) and top-1 agreement (eval_tf.c);
 *   retrieval probes at several context lengths, greedy through the engine (eval_retrieval.c);
 *   the strategies' counters: KV bytes read per decode step, bytes per token, compression,
 *     prefix hit rate (eval_counters.c).
 * --lossy-window N is the eval-only lossy setting: the candidate sees only the last N tokens.
 *
 *   build/kvserve-eval --model models/demo --text held-out.txt --lengths 1024,2048
 *   build/kvserve-eval --model tests/data/models/llama --tokens ids.txt --lossy-window 16 --json
 */
#include "engine/config.h"
#include "tools/eval.h"
#include "engine/text/tokenizer.h"
#include "base/util.h"
#include "models/model.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* context a retrieval probe leaves for its answer (text answers: up to 24 tokens) */
#define ANSWER_ROOM 24

static void usage(FILE *f)
{
    fprintf(f,
            "usage: kvserve-eval [options]\n"
            "  --model DIR           model directory (= --set model.path=DIR)\n"
            "  --config FILE         JSON config of the candidate (then --set overrides)\n"
            "  --set key=value       config override (repeatable), e.g. kv.decode=full\n"
            "  --text FILE           held-out text for perplexity/KL (needs the model's tokenizer)\n"
            "  --tokens FILE         held-out token ids (whitespace-separated) instead of --text\n"
            "  --seq-len N           tokens per teacher-forced sequence (default 256)\n"
            "  --n-seqs N            sequences cut from the input (default 4)\n"
            "  --prefill N           first N tokens as one prefill, the rest decode steps (default 1)\n"
            "  --filler FILE         filler text for retrieval probes (default: the --text file)\n"
            "  --lengths A,B,...     retrieval context lengths (default 1024,2048,4096,8192,16384\n"
            "                        up to the context; smaller ones for short-context models)\n"
            "  --probes N            probes per length (default 10), the formats in turn\n"
            "  --formats A,B,...     text probe formats: fact, passkey, kv (default all three)\n"
            "  --seed N              probe generator seed (default 1)\n"
            "  --probe-timeout S     seconds a probe may take from submission (default 600)\n"
            "  --lossy-window N      eval-only lossy candidate: sees only the last N tokens\n"
            "  --all-policies        every built kv.decode policy against full, one row each\n"
            "  --no-tf | --no-retrieval   skip a part\n"
            "  --json                machine-readable output on stdout\n"
            "  --dump-probes FILE    write the retrieval probes as JSON lines and exit\n"
            "  -h, --help\n");
}

struct cfg_op {
    int is_file;
    const char *arg;
};

static int build_config(struct kvs_config *c, const struct cfg_op *ops, int n_ops, int reference, char *err,
                        size_t errlen)
{
    for (int i = 0; i < n_ops; i++) {
        int rc = ops[i].is_file ? kvs_config_load_file(c, ops[i].arg, err, errlen)
                                : kvs_config_set(c, ops[i].arg, err, errlen);
        if (rc) return rc;
    }
    if (reference) {
        const char *ref[] = {"kv.decode=full", "kv.storage=auto", "kv.reuse=none"};
        for (int i = 0; i < 3; i++) {
            int rc = kvs_config_set(c, ref[i], err, errlen);
            if (rc) return rc;
        }
    }
    return kvs_config_validate(c, err, errlen);
}

static int parse_int(const char *s, int lo, int hi, int *out)
{
    if (!s || !*s) return -EINVAL;
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || *end || v < lo || v > hi) return -EINVAL;
    *out = (int)v;
    return 0;
}

static int read_ids(const char *path, int vocab, int32_t **out, char *err, size_t errlen)
{
    size_t len;
    char *s = kvs_read_file(path, &len, err, errlen);
    if (!s) return -ENOENT;
    int n = 0, cap = 1024;
    int32_t *ids = kvs_xmalloc((size_t)cap * sizeof *ids);
    char *p = s;
    for (;;) {
        while (*p == ' ' || *p == '\n' || *p == '\t' || *p == '\r' || *p == ',') p++;
        if (!*p) break;
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (end == p || errno || v < 0 || v >= vocab) {
            free(ids);
            free(s);
            return kvs_err(err, errlen, -EINVAL, "%s: token %d is not an id in [0, %d)", path, n + 1, vocab);
        }
        if (n == cap) ids = kvs_xrealloc(ids, (size_t)(cap *= 2) * sizeof *ids);
        ids[n++] = (int32_t)v;
        p = end;
    }
    free(s);
    *out = ids;
    return n;
}

static void fmt_bytes(char *buf, size_t n, double b)
{
    if (b >= 1e9) snprintf(buf, n, "%.2f GB", b / 1e9);
    else if (b >= 1e6) snprintf(buf, n, "%.2f MB", b / 1e6);
    else if (b >= 1e3) snprintf(buf, n, "%.1f kB", b / 1e3);
    else snprintf(buf, n, "%.0f B", b);
}

static double per_step(const struct kvs_eval_counters *c, double v)
{
    return c->decode_steps ? v / (double)c->decode_steps : 0;
}

/* one JSON object per line: length, ids, answer (text or ids) */
static int dump_probes(const char *path, const struct kvs_eval_probes *pr)
{
    FILE *f = fopen(path, "w");
    if (!f) {
        fprintf(stderr, "kvserve-eval: cannot write %s: %s\n", path, strerror(errno));
        return -errno;
    }
    for (int i = 0; i < pr->n; i++) {
        const struct kvs_eval_probe *p = &pr->p[i];
        fprintf(f, "{\"length\": %d, \"format\": \"%s\", \"ids\": [", p->length, kvs_eval_format_name(p->format));
        for (int k = 0; k < p->n; k++) fprintf(f, "%s%d", k ? "," : "", p->ids[k]);
        fprintf(f, "], \"answer_ids\": [");
        for (int k = 0; k < p->n_answer; k++) fprintf(f, "%s%d", k ? "," : "", p->answer_ids[k]);
        fprintf(f, "], \"answer_text\": \"%s\"}\n", p->answer_text ? p->answer_text : "");
    }
    if (fclose(f) != 0) {
        fprintf(stderr, "kvserve-eval: cannot write %s\n", path);
        return -EIO;
    }
    return 0;
}

static void row(const char *name, const char *ref, const char *cand) { printf("  %-34s %16s %16s\n", name, ref, cand); }

int main(int argc, char **argv)
{
    struct cfg_op *ops = kvs_xcalloc((size_t)argc + 1, sizeof *ops);
    int n_ops = 0, seq_len = 256, n_seqs = 4, prefill = 1, probes_per = 10, window = 0, seed = 1;
    int do_tf = 1, do_ret = 1, ret_once = 0, json = 0, n_lengths = 0, lengths[16], all_policies = 0;
    unsigned formats = KVS_EVAL_ALL_FORMATS;
    int probe_timeout = 600;
    const char *dump_path = NULL, *text_path = NULL, *tokens_path = NULL, *filler_path = NULL, *model_arg = NULL;
    char model_set[PATH_MAX + 16];
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int bad = 0, takes = 1;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            free(ops);
            return 0;
        } else if (!strcmp(a, "--json")) json = 1, takes = 0;
        else if (!strcmp(a, "--no-tf")) do_tf = 0, takes = 0;
        else if (!strcmp(a, "--no-retrieval")) do_ret = 0, takes = 0;
        else if (!strcmp(a, "--all-policies")) all_policies = 1, takes = 0;
        else if (!v) bad = 1;
        else if (!strcmp(a, "--model")) model_arg = v;
        else if (!strcmp(a, "--config")) ops[n_ops++] = (struct cfg_op){1, v};
        else if (!strcmp(a, "--set")) ops[n_ops++] = (struct cfg_op){0, v};
        else if (!strcmp(a, "--text")) text_path = v;
        else if (!strcmp(a, "--tokens")) tokens_path = v;
        else if (!strcmp(a, "--filler")) filler_path = v;
        else if (!strcmp(a, "--dump-probes")) dump_path = v, do_tf = 0;
        else if (!strcmp(a, "--seq-len")) bad = parse_int(v, 2, 1 << 24, &seq_len);
        else if (!strcmp(a, "--n-seqs")) bad = parse_int(v, 1, 1 << 20, &n_seqs);
        else if (!strcmp(a, "--prefill")) bad = parse_int(v, 1, 1 << 24, &prefill);
        else if (!strcmp(a, "--probes")) bad = parse_int(v, 1, 100000, &probes_per);
        else if (!strcmp(a, "--seed")) bad = parse_int(v, 0, INT_MAX, &seed);
        else if (!strcmp(a, "--lossy-window")) bad = parse_int(v, 1, 1 << 24, &window);
        else if (!strcmp(a, "--formats")) bad = kvs_eval_parse_formats(v, &formats);
        else if (!strcmp(a, "--probe-timeout")) bad = parse_int(v, 1, 1 << 24, &probe_timeout);
        else if (!strcmp(a, "--lengths")) {
            char buf[256];
            snprintf(buf, sizeof buf, "%s", v);
            n_lengths = 0;
            for (char *t = strtok(buf, ","); t && !bad; t = strtok(NULL, ",")) {
                if (n_lengths == 16) bad = 1;
                else bad = parse_int(t, 16, 1 << 24, &lengths[n_lengths++]);
            }
            if (!n_lengths) bad = 1;
        } else {
            fprintf(stderr, "kvserve-eval: unknown option %s\n", a);
            usage(stderr);
            free(ops);
            return 2;
        }
        if (bad) {
            fprintf(stderr, "kvserve-eval: bad or missing value for %s\n", a);
            free(ops);
            return 2;
        }
        i += takes;
    }
    if (model_arg) {
        snprintf(model_set, sizeof model_set, "model.path=%s", model_arg);
        ops[n_ops++] = (struct cfg_op){0, model_set};
    }
    if (do_tf && !text_path && !tokens_path) {
        fprintf(stderr, "kvserve-eval: teacher-forced metrics need --text FILE or --tokens FILE (or --no-tf)\n");
        free(ops);
        return 2;
    }
    if (prefill >= seq_len) {
        fprintf(stderr, "kvserve-eval: --prefill (%d) must be below --seq-len (%d)\n", prefill, seq_len);
        free(ops);
        return 2;
    }
    kvs_log_set_level(KVS_LOG_WARN);

    char err[1024];
    int ret = 1, rc;
    struct kvs_config cfg, ref;
    struct kvs_model *model = NULL;
    struct kvs_tokenizer *tok = NULL;
    int32_t *tokens = NULL;
    char *filler = NULL;
    struct kvs_eval_probes probes = {0};
    struct kvs_eval_tf_result tf;
    struct kvs_eval_retrieval_result rr_ref, rr_cfg;
    memset(&tf, 0, sizeof tf);
    memset(&rr_ref, 0, sizeof rr_ref);
    memset(&rr_cfg, 0, sizeof rr_cfg);
    kvs_config_init(&cfg);
    kvs_config_init(&ref);
    if ((rc = build_config(&cfg, ops, n_ops, 0, err, sizeof err)) || (rc = build_config(&ref, ops, n_ops, 1, err, sizeof err))) {
        fprintf(stderr, "kvserve-eval: config: %s\n", err);
        kvs_config_free(&cfg);
        kvs_config_free(&ref);
        free(ops);
        return 2;
    }
    if ((rc = kvs_model_load(cfg.model_path, &model, err, sizeof err))) {
        fprintf(stderr, "kvserve-eval: %s\n", err);
        goto out;
    }
    const struct kvs_model_config *mc = kvs_model_config(model);
    if (kvs_tokenizer_load(cfg.model_path, &tok, err, sizeof err) != 0) tok = NULL;
    int ctx = cfg.max_model_len > 0 ? cfg.max_model_len : mc->max_position_embeddings;
    if (ctx <= 0) ctx = 4096;

    /* held-out input */
    int n_tokens = 0;
    if (do_tf) {
        if (tokens_path) {
            if ((n_tokens = read_ids(tokens_path, mc->vocab_size, &tokens, err, sizeof err)) < 0) {
                fprintf(stderr, "kvserve-eval: %s\n", err);
                goto out;
            }
        } else {
            if (!tok) {
                fprintf(stderr, "kvserve-eval: --text needs the model's tokenizer (%s has none); use --tokens\n",
                        cfg.model_path);
                goto out;
            }
            size_t len;
            char *s = kvs_read_file(text_path, &len, err, sizeof err);
            if (!s) {
                fprintf(stderr, "kvserve-eval: %s\n", err);
                goto out;
            }
            int cap = (int)(len < INT_MAX / 2 ? len : INT_MAX / 2) + 16;
            tokens = kvs_xmalloc((size_t)cap * sizeof *tokens);
            n_tokens = kvs_tokenizer_encode(tok, s, len, 0, 0, tokens, cap);
            free(s);
            if (n_tokens < 0 || n_tokens > cap) {
                fprintf(stderr, "kvserve-eval: cannot tokenize %s\n", text_path);
                goto out;
            }
        }
        if ((int64_t)seq_len * n_seqs > n_tokens) {
            fprintf(stderr, "kvserve-eval: %d sequences of %d tokens need %lld tokens; the input has %d\n", n_seqs,
                    seq_len, (long long)seq_len * n_seqs, n_tokens);
            goto out;
        }
        if (seq_len > ctx) {
            fprintf(stderr, "kvserve-eval: --seq-len %d exceeds the model context %d\n", seq_len, ctx);
            goto out;
        }
    }

    /* retrieval lengths that fit the context (an answer needs a few tokens after the prompt) */
    if (do_ret) {
        int user = n_lengths > 0;
        if (!user) {
            const int def[] = {1024, 2048, 4096, 8192, 16384};
            for (int i = 0; i < 5; i++)
                if (def[i] + ANSWER_ROOM <= ctx) lengths[n_lengths++] = def[i];
            if (!n_lengths) lengths[n_lengths++] = (ctx - ANSWER_ROOM) / 2, lengths[n_lengths++] = ctx - ANSWER_ROOM;
        }
        for (int i = 0; i < n_lengths; i++)
            if (lengths[i] + ANSWER_ROOM > ctx) {
                fprintf(stderr, "kvserve-eval: retrieval length %d does not fit the context %d (length + %d)\n",
                        lengths[i], ctx, ANSWER_ROOM);
                goto out;
            }
        if (tok) {
            const char *fp = filler_path ? filler_path : text_path;
            if (!fp) {
                fprintf(stderr, "kvserve-eval: text retrieval probes need filler text (--filler FILE or --text FILE)\n");
                goto out;
            }
            size_t len;
            if (!(filler = kvs_read_file(fp, &len, err, sizeof err))) {
                fprintf(stderr, "kvserve-eval: %s\n", err);
                goto out;
            }
            rc = kvs_eval_probes_text_formats(tok, filler, len, lengths, n_lengths, probes_per, formats, (uint64_t)seed,
                                              &probes, err, sizeof err);
        } else {
            rc = kvs_eval_probes_ids(mc->vocab_size, lengths, n_lengths, probes_per, (uint64_t)seed, &probes, err,
                                     sizeof err);
        }
        if (rc) {
            fprintf(stderr, "kvserve-eval: %s\n", err);
            goto out;
        }
    }

    probes.timeout_s = probe_timeout;
    if (dump_path) {
        ret = dump_probes(dump_path, &probes) ? 1 : 0;
        goto out;
    }

    /* KV pools sized to the work unless the config says otherwise (two runners share memory) */
    if (cfg.kv_memory_bytes == 0) {
        int64_t bpt = (int64_t)mc->n_layers * 2 * mc->n_kv_heads * mc->head_dim * 4;
        int64_t bs = cfg.kv_block_size > 0 ? cfg.kv_block_size : 16;
        int conc = cfg.max_running < n_seqs ? cfg.max_running : n_seqs;
        int64_t need = (int64_t)conc * (seq_len + bs);
        int maxlen = 0;
        for (int i = 0; i < n_lengths; i++)
            if (lengths[i] > maxlen) maxlen = lengths[i];
        if (do_ret && (int64_t)4 * (maxlen + ANSWER_ROOM + bs) > need) need = (int64_t)4 * (maxlen + ANSWER_ROOM + bs);
        if (window > 0 && (int64_t)cfg.max_batch_tokens * 2 > need) need = (int64_t)cfg.max_batch_tokens * 2;
        char set[64];
        snprintf(set, sizeof set, "kv.memory_bytes=%lld", (long long)((need + 4 * bs) * bpt));
        if (kvs_config_set(&cfg, set, err, sizeof err) || kvs_config_set(&ref, set, err, sizeof err)) {
            fprintf(stderr, "kvserve-eval: %s\n", err);
            goto out;
        }
    }

    if (all_policies) {
        struct kvs_eval_tf_opts o = {seq_len, n_seqs, prefill, 0};
        if ((rc = kvs_eval_all_policies(&cfg, &ref, model, tok, tokens, n_tokens, &o, &probes, do_tf, do_ret, err,
                                        sizeof err))) {
            fprintf(stderr, "kvserve-eval: %s\n", err);
            goto out;
        }
        ret = 0;
        goto out;
    }
    if (do_tf) {
        struct kvs_eval_tf_opts o = {seq_len, n_seqs, prefill, window};
        if ((rc = kvs_eval_teacher_forced(&ref, &cfg, model, tokens, n_tokens, &o, &tf, err, sizeof err))) {
            fprintf(stderr, "kvserve-eval: %s\n", err);
            goto out;
        }
    }
    if (do_ret) {
        /* The candidate is the reference itself (full attention, full precision, no reuse, no
         * window): greedy decoding of the same prompts through the same engine gives the same
         * answers, so the probes run once (they dominate the time at long contexts). */
        int same = window == 0 && !strcmp(cfg.kv_decode, "full") && !strcmp(cfg.kv_storage, "auto") &&
                   !strcmp(cfg.kv_reuse, "none");
        if ((rc = kvs_eval_retrieval(&ref, model, tok, &probes, 0, &rr_ref, err, sizeof err))) {
            fprintf(stderr, "kvserve-eval: %s\n", err);
            goto out;
        }
        ret_once = same;
        if (same) rr_cfg = rr_ref;
        else if ((rc = kvs_eval_retrieval(&cfg, model, tok, &probes, window, &rr_cfg, err, sizeof err))) {
            fprintf(stderr, "kvserve-eval: %s\n", err);
            goto out;
        }
    }

    char cand_name[160];
    if (window > 0)
        snprintf(cand_name, sizeof cand_name, "storage=%s reuse=%s decode=%s + lossy-window %d", cfg.kv_storage,
                 cfg.kv_reuse, cfg.kv_decode, window);
    else
        snprintf(cand_name, sizeof cand_name, "storage=%s reuse=%s decode=%s", cfg.kv_storage, cfg.kv_reuse,
                 cfg.kv_decode);

    if (json) {
        cJSON *root = cJSON_CreateObject();
        cJSON_AddStringToObject(root, "model", cfg.model_path);
        cJSON_AddStringToObject(root, "backend", do_tf ? tf.backend : cfg.device);
        cJSON_AddStringToObject(root, "reference", "storage=auto reuse=none decode=full");
        cJSON_AddStringToObject(root, "candidate", cand_name);
        cJSON_AddNumberToObject(root, "lossy_window", window);
        if (do_tf) {
            cJSON *t = cJSON_AddObjectToObject(root, "teacher_forced");
            cJSON_AddNumberToObject(t, "seq_len", seq_len);
            cJSON_AddNumberToObject(t, "n_seqs", n_seqs);
            cJSON_AddNumberToObject(t, "prefill", prefill);
            cJSON_AddNumberToObject(t, "positions", tf.n_positions);
            cJSON_AddNumberToObject(t, "ppl_ref", tf.ppl_ref);
            cJSON_AddNumberToObject(t, "ppl_cfg", tf.ppl_cfg);
            cJSON_AddNumberToObject(t, "nll_ref", tf.nll_ref);
            cJSON_AddNumberToObject(t, "nll_cfg", tf.nll_cfg);
            cJSON_AddNumberToObject(t, "kl_mean", tf.kl_mean);
            cJSON_AddNumberToObject(t, "kl_p95", tf.kl_p95);
            cJSON_AddNumberToObject(t, "kl_max", tf.kl_max);
            cJSON_AddNumberToObject(t, "top1_agreement", tf.top1_agree);
            cJSON_AddNumberToObject(t, "seconds", tf.seconds);
        }
        if (do_ret) {
            cJSON *r = cJSON_AddObjectToObject(root, "retrieval");
            cJSON_AddStringToObject(r, "probes", probes.text ? "text" : "ids");
            cJSON *arr = cJSON_AddArrayToObject(r, "lengths");
            for (int i = 0; i < rr_ref.n_lengths; i++) {
                cJSON *e = cJSON_CreateObject();
                cJSON_AddNumberToObject(e, "length", rr_ref.lengths[i]);
                cJSON_AddNumberToObject(e, "n", rr_ref.total[i]);
                cJSON_AddNumberToObject(e, "acc_ref", (double)rr_ref.correct[i] / rr_ref.total[i]);
                cJSON_AddNumberToObject(e, "acc_cfg", (double)rr_cfg.correct[i] / rr_cfg.total[i]);
                cJSON *fo = cJSON_AddObjectToObject(e, "formats");
                for (int f = 0; f <= KVS_EVAL_N_FORMATS; f++) {
                    int nt = rr_ref.fmt_total[i][f];
                    if (!nt) continue;
                    cJSON *x = cJSON_AddObjectToObject(fo, kvs_eval_format_name(f));
                    cJSON_AddNumberToObject(x, "n", nt);
                    cJSON_AddNumberToObject(x, "acc_ref", (double)rr_ref.fmt_correct[i][f] / nt);
                    cJSON_AddNumberToObject(x, "acc_cfg", (double)rr_cfg.fmt_correct[i][f] / rr_cfg.fmt_total[i][f]);
                }
                cJSON_AddItemToArray(arr, e);
            }
            cJSON_AddStringToObject(r, "example_cfg", rr_cfg.example);
            cJSON_AddBoolToObject(r, "run_once", ret_once);
        }
        cJSON *c = cJSON_AddObjectToObject(root, "counters");
        if (do_tf) {
            cJSON_AddNumberToObject(c, "kv_bytes_per_token_ref", (double)tf.ref.kv_bytes_per_token);
            cJSON_AddNumberToObject(c, "kv_bytes_per_token_cfg", (double)tf.cfg.kv_bytes_per_token);
            cJSON_AddNumberToObject(c, "compression_ratio",
                                    tf.cfg.kv_bytes_per_token ? (double)tf.ref.kv_bytes_per_token / tf.cfg.kv_bytes_per_token : 0);
            cJSON_AddNumberToObject(c, "kv_bytes_read_per_step_ref", per_step(&tf.ref, tf.ref.kv_bytes_read));
            if (tf.cfg.kv_read_known)
                cJSON_AddNumberToObject(c, "kv_bytes_read_per_step_cfg", per_step(&tf.cfg, tf.cfg.kv_bytes_read));
            else cJSON_AddNullToObject(c, "kv_bytes_read_per_step_cfg");
            cJSON_AddNumberToObject(c, "kv_bytes_full_per_step", per_step(&tf.cfg, tf.cfg.kv_bytes_full));
            for (int i = 0; i < tf.cfg.n_extra; i++)
                cJSON_AddNumberToObject(c, tf.cfg.extra_name[i], tf.cfg.extra_value[i]);
        }
        if (do_ret) {
            if (rr_cfg.counters.hit_queries)
                cJSON_AddNumberToObject(c, "prefix_hit_rate",
                                        (double)rr_cfg.counters.hits / (double)rr_cfg.counters.hit_queries);
            else cJSON_AddNullToObject(c, "prefix_hit_rate");
        }
        char *s = cJSON_Print(root);
        printf("%s\n", s);
        free(s);
        cJSON_Delete(root);
    } else {
        char a[64], b[64];
        printf("kvserve-eval: model %s, backend %s\n", cfg.model_path, do_tf ? tf.backend : cfg.device);
        printf("  reference: storage=auto reuse=none decode=full\n  candidate: %s\n\n", cand_name);
        row("metric", "reference", "candidate");
        if (do_tf) {
            char name[96];
            snprintf(name, sizeof name, "perplexity (%d pos)", tf.n_positions);
            snprintf(a, sizeof a, "%.4f", tf.ppl_ref);
            snprintf(b, sizeof b, "%.4f", tf.ppl_cfg);
            row(name, a, b);
            snprintf(b, sizeof b, "%.6f", tf.kl_mean);
            row("KL(ref||cfg) mean, nats", "0", b);
            snprintf(b, sizeof b, "%.6f", tf.kl_p95);
            row("KL p95", "0", b);
            snprintf(b, sizeof b, "%.6f", tf.kl_max);
            row("KL max", "0", b);
            snprintf(b, sizeof b, "%.2f%%", 100 * tf.top1_agree);
            row("top-1 agreement", "100.00%", b);
        }
        if (do_ret) {
            for (int i = 0; i < rr_ref.n_lengths; i++) {
                char name[96];
                snprintf(name, sizeof name, "retrieval@%d (%s, n=%d)", rr_ref.lengths[i], probes.text ? "text" : "ids",
                         rr_ref.total[i]);
                snprintf(a, sizeof a, "%.1f%%", 100.0 * rr_ref.correct[i] / rr_ref.total[i]);
                snprintf(b, sizeof b, "%.1f%%", 100.0 * rr_cfg.correct[i] / rr_cfg.total[i]);
                row(name, a, b);
                int nf = 0;
                for (int f = 0; f <= KVS_EVAL_N_FORMATS; f++) nf += rr_ref.fmt_total[i][f] > 0;
                for (int f = 0; f <= KVS_EVAL_N_FORMATS && nf > 1; f++) {
                    int nt = rr_ref.fmt_total[i][f];
                    if (!nt) continue;
                    snprintf(name, sizeof name, "  %s (n=%d)", kvs_eval_format_name(f), nt);
                    snprintf(a, sizeof a, "%.1f%%", 100.0 * rr_ref.fmt_correct[i][f] / nt);
                    snprintf(b, sizeof b, "%.1f%%", 100.0 * rr_cfg.fmt_correct[i][f] / rr_cfg.fmt_total[i][f]);
                    row(name, a, b);
                }
            }
        }
        if (do_tf) {
            fmt_bytes(a, sizeof a, per_step(&tf.ref, tf.ref.kv_bytes_read));
            if (tf.cfg.kv_read_known) fmt_bytes(b, sizeof b, per_step(&tf.cfg, tf.cfg.kv_bytes_read));
            else snprintf(b, sizeof b, "not reported");
            row("KV bytes read / decode step", a, b);
            snprintf(a, sizeof a, "%zu", tf.ref.kv_bytes_per_token);
            snprintf(b, sizeof b, "%zu", tf.cfg.kv_bytes_per_token);
            row("KV bytes stored / token", a, b);
            snprintf(b, sizeof b, "%.2fx",
                     tf.cfg.kv_bytes_per_token ? (double)tf.ref.kv_bytes_per_token / tf.cfg.kv_bytes_per_token : 0);
            row("compression ratio", "1.00x", b);
            for (int i = 0; i < tf.cfg.n_extra; i++) {
                snprintf(b, sizeof b, "%.4f", tf.cfg.extra_value[i]);
                row(tf.cfg.extra_name[i], "-", b);
            }
        }
        if (do_ret) {
            if (rr_cfg.counters.hit_queries)
                snprintf(b, sizeof b, "%.1f%%", 100.0 * rr_cfg.counters.hits / rr_cfg.counters.hit_queries);
            else snprintf(b, sizeof b, "n/a");
            row("prefix hit rate (retrieval)", "n/a", b);
        }
        if (do_tf) printf("\n  teacher-forced: %d x %d tokens, prefill %d, %.1f s\n", n_seqs, seq_len, prefill, tf.seconds);
        if (do_ret && ret_once)
            printf("  retrieval: %d probes, %.1f s (the candidate is the reference: run once)%s%s\n", probes.n,
                   rr_ref.seconds, rr_cfg.example[0] ? "; e.g. " : "", rr_cfg.example);
        else if (do_ret)
            printf("  retrieval: %d probes, %.1f s (ref) + %.1f s (cfg)%s%s\n", probes.n, rr_ref.seconds,
                   rr_cfg.seconds, rr_cfg.example[0] ? "; e.g. " : "", rr_cfg.example);
    }
    ret = 0;
out:
    kvs_eval_probes_free(&probes);
    free(filler);
    free(tokens);
    kvs_tokenizer_free(tok);
    kvs_model_free(model);
    kvs_config_free(&cfg);
    kvs_config_free(&ref);
    free(ops);
    return ret;
}
