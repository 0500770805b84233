/* config.c: the declarative config table and everything it drives (parse, validate, --set,
 * dump, reference). One row per key: dotted JSON path, type, field offset, bounds, default,
 * allowed values (for enums), and help text. */
#include "engine/config.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/util.h"
#include "engine/kv/kv.h"

enum key_type { T_BOOL, T_INT, T_INT64, T_DOUBLE, T_STRING, T_ENUM };

struct key_def {
    const char *name;          /* dotted path in the JSON file */
    enum key_type type;
    size_t offset;             /* into struct kvs_config */
    double min, max;           /* numeric bounds (inclusive) */
    const char *def;           /* default, as it would be written after --set key= */
    const char *choices;       /* enums: "a|b|c" */
    const char *implemented;   /* enums: the subset this build can run (NULL = all) */
    const char *help;
};

#define F(field) offsetof(struct kvs_config, field)
#define I64MAX 9.0e18

static const struct key_def KEYS[] = {
    {"model.path", T_STRING, F(model_path), 0, 0, "models/demo", NULL, NULL,
     "Hugging Face model directory (config.json, *.safetensors, tokenizer.json), or a GGUF file / a directory holding one"},
    {"model.name", T_STRING, F(model_name), 0, 0, "", NULL, NULL,
     "model id served in /v1/models and accepted in requests (empty: directory name)"},
    {"model.chat_format", T_ENUM, F(chat_format), 0, 0, "auto", "auto|chatml|qwen3|llama3|smollm", NULL,
     "chat format; auto detects it from the chat_template of tokenizer_config.json or of the GGUF file"},
    {"model.max_model_len", T_INT, F(max_model_len), 0, 16777216, "0", NULL, NULL,
     "context length limit in tokens (0: the model's max_position_embeddings)"},

    {"device", T_ENUM, F(device), 0, 0, "auto", "auto|cpu|cuda", NULL,
     "compute backend; auto picks cuda when a GPU and the CUDA build are present"},
    {"cpu_threads", T_INT, F(cpu_threads), 0, 1024, "0", NULL, NULL,
     "CPU backend threads (0: one per core)"},
    {"parallel.tensor", T_INT, F(tensor_parallel), 1, 64, "1", NULL, NULL,
     "tensor parallelism: GPUs (ranks) the model is split over, one thread each (needs NCCL for cuda; cpu: "
     "threads of one process, for tests); must divide the KV heads and the FFN width"},

    {"batch_invariant", T_ENUM, F(batch_invariant), 0, 0, "auto", "auto|true|false", NULL,
     "batch-invariant numerics: a decode row's results do not depend on the batch it runs in (the batch size, the other rows' contexts, a recorded step's capacity), so a row computed again, alone or in another batch, gives the same bits (the decode GEMMs choose their kernel by shape alone, the decode attention splits a row's context by its own length); costs: bench/RESULTS.md (gemm7, bi8); auto: on for kv.decode=retro, whose re-run rows are merged with outputs cached from their first run (docs/STRATEGIES.md §4), off otherwise; the CPU backend is invariant by default either way (KVS_CPU_GEMM); KVS_CUDA_BATCH_INVARIANT overrides it; not covered: how a prompt is cut into chunks, which depends on the load (scheduler.max_batch_tokens is shared), and with it a prompt's rounding on CUDA and kv.lean.mode=dynamic's placement of prompt tokens"},

    {"server.host", T_STRING, F(host), 0, 0, "127.0.0.1", NULL, NULL, "address to listen on"},
    {"server.port", T_INT, F(port), 0, 65535, "8000", NULL, NULL, "TCP port (0: pick a free one and log it)"},
    {"server.api_key", T_STRING, F(api_key), 0, 0, "", NULL, NULL,
     "require 'Authorization: Bearer <key>' on /v1 and document endpoints (empty: no auth)"},
    {"server.max_body_bytes", T_INT64, F(max_body_bytes), 1024, 1073741824, "4194304", NULL, NULL,
     "largest accepted request body (413 above)"},
    {"server.max_connections", T_INT, F(max_connections), 1, 65536, "512", NULL, NULL,
     "simultaneous client connections"},
    {"server.request_timeout_s", T_DOUBLE, F(request_timeout_s), 0, 86400, "600", NULL, NULL,
     "per-request time limit in seconds (0: none)"},
    {"server.idle_timeout_s", T_DOUBLE, F(idle_timeout_s), 1, 86400, "15", NULL, NULL,
     "close a connection that sends or reads nothing for this long (headers, body, keep-alive; "
     "never one waiting on the engine)"},
    {"server.max_connections_per_client", T_INT, F(max_connections_per_client), 0, 65536, "256", NULL, NULL,
     "simultaneous connections from one client address (0: no cap); more are closed at accept"},
    {"server.reserved_connections", T_INT, F(reserved_connections), 0, 1024, "16", NULL, NULL,
     "connections kept above server.max_connections for /health, /metrics, /ping and /version only"},
    {"server.shutdown_grace_s", T_DOUBLE, F(shutdown_grace_s), 0, 3600, "30", NULL, NULL,
     "on SIGTERM/SIGINT, time to let in-flight requests finish before cancelling them"},
    {"server.sse_keepalive_s", T_DOUBLE, F(sse_keepalive_s), 0.1, 3600, "15", NULL, NULL,
     "interval of ': keep-alive' SSE comments while a stream waits (long prefills)"},
    {"server.access_log", T_BOOL, F(access_log), 0, 1, "true", NULL, NULL, "log one line per request"},
    {"server.log_level", T_ENUM, F(log_level), 0, 0, "info", "debug|info|warn|error", NULL, "log verbosity"},

    {"scheduler.max_batch_tokens", T_INT, F(max_batch_tokens), 1, 1048576, "512", NULL, NULL,
     "tokens per engine step (decode tokens + prefill chunks)"},
    {"scheduler.max_running", T_INT, F(max_running), 1, 4096, "64", NULL, NULL,
     "requests decoding at once"},
    {"scheduler.max_waiting", T_INT, F(max_waiting), 0, 1000000, "256", NULL, NULL,
     "queued requests before new ones get 429"},
    {"scheduler.prefill_chunk", T_INT, F(prefill_chunk), 0, 1048576, "0", NULL, NULL,
     "largest prefill chunk of one request per step (0: max_batch_tokens)"},
    {"scheduler.overlap", T_BOOL, F(sched_overlap), 0, 1, "true", NULL, NULL,
     "detokenize and stream a step's tokens while the device runs the next step (greedy output is the same either way)"},
    {"scheduler.async", T_ENUM, F(sched_async), 0, 0, "auto", "auto|true|false", NULL,
     "prepare and queue each step while the device runs the one before (greedy rows take their token from the previous step on the device; the host sees it a step later); auto: on where the backend queues work behind the host (CUDA), off on the CPU, whose backend computes each step when it is called (async would overlap nothing there and hold each step's text back a step); greedy output is the same as without it on the CPU (bitwise; on CUDA steps group rows a little differently, which the GEMM and attention choices by row count may round differently, as any change of batch does); runs where the runner allows it (one GPU or the CPU, a decode policy without multi-row decode or host offload: not kv.decode=paris, not retro with a window above 1), else scheduler.overlap"},
    {"scheduler.itl_ratio", T_DOUBLE, F(itl_ratio), 0, 100, "0", NULL, NULL,
     "while requests decode, prefill tokens per step adapt so that a step carrying prefill takes about this many times a decode-only step (decoders' inter-token latency stays even, e.g. 1.5; fewer prefill tokens per step can cost throughput where prefill is expensive, as on the CPU; a step carries no prefill while no decode-only step near its decode batch was measured: the reference; 0: off, steps fill up to max_batch_tokens)"},
    {"scheduler.prefill_min", T_INT, F(prefill_min), 1, 1048576, "32", NULL, NULL,
     "prefill tokens a step may always carry next to decodes, whatever scheduler.itl_ratio says (prompts keep progressing)"},
    {"scheduler.max_tokens_default", T_INT, F(max_tokens_default), 0, 16777216, "0", NULL, NULL,
     "max_tokens when a request sets none (0: 16 on /v1/completions as in OpenAI and vLLM, chat up to the context length)"},

    {"kv.block_size", T_INT, F(kv_block_size), 1, 1024, "16", NULL, NULL, "tokens per KV block"},
    {"kv.memory_bytes", T_INT64, F(kv_memory_bytes), 0, I64MAX, "0", NULL, NULL,
     "KV pool size in bytes (0: kv.memory_fraction of free device memory; on the CPU at most scheduler.max_running requests x the context in whole blocks, and 4 GiB)"},
    {"kv.memory_fraction", T_DOUBLE, F(kv_memory_fraction), 0.01, 0.99, "0.5", NULL, NULL,
     "share of free memory (after weights) for the KV pool when kv.memory_bytes is 0"},
    /* kv.storage / kv.reuse / kv.decode: which names exist, which are built and which pairs
     * compose is the KV registry's call (engine/kv/kv.c), checked in kvs_config_validate */
    {"kv.storage", T_ENUM, F(kv_storage), 0, 0, "auto", "auto|f32|bf16|lean", NULL,
     "KV storage format: auto (f32 on cpu, bf16 on cuda), f32, bf16, lean (LeanKV mixed precision)"},
    {"kv.reuse", T_ENUM, F(kv_reuse), 0, 0, "prefix", "none|prefix|lazy", NULL,
     "KV sharing across requests: none, prefix (hashed full blocks), lazy (LazyAttention doc cache)"},
    {"kv.decode", T_ENUM, F(kv_decode), 0, 0, "full", "full|quest|retro|mac|paris", NULL,
     "how decode reads the cache: full, quest, retro (Quest + retrospective updates), mac, paris"},
    {"kv.decode_state_bytes", T_INT64, F(kv_decode_state_bytes), 0, I64MAX, "1073741824", NULL, NULL,
     "budget for the decode policy's per-request states, all requests (0: no limit)"},
    {"kv.fidelity.sample_every", T_INT, F(kv_fidelity_sample_every), 0, 1000000, "0", NULL, NULL,
     "live fidelity meter: every N-th decode step one layer also runs exact attention (0: off)"},

    {"kv.lazy.budget_bytes", T_INT64, F(lazy_budget_bytes), 0, I64MAX, "0", NULL, NULL,
     "doc-cache byte budget (0: whatever the KV pool holds)"},
    {"kv.lazy.eviction", T_ENUM, F(lazy_eviction), 0, 0, "lru", "lru|lfu", NULL,
     "doc-cache eviction policy (lru: least recently used document; lfu: fewest uses, ties least recent)"},
    {"kv.lazy.position_aware", T_BOOL, F(lazy_position_aware), 0, 1, "false", NULL, NULL,
     "baseline mode: one replica per (document, offset) instead of position-agnostic reuse (benchmarks)"},

    {"kv.mac.ring_size", T_INT, F(mac_ring_size), 1, 65536, "1024", NULL, NULL, "MAC: recent queries kept (K)"},
    {"kv.mac.band", T_INT, F(mac_band), 1, 65536, "256", NULL, NULL, "MAC: recomputed band r"},
    {"kv.mac.tau", T_DOUBLE, F(mac_tau), 0, 2, "0.75", NULL, NULL, "MAC: match threshold (>= 1 never matches)"},
    {"kv.mac.gen_min", T_INT, F(mac_gen_min), 0, 16777216, "2048", NULL, NULL, "MAC: context length before matching starts"},

    {"kv.paris.topk", T_INT, F(paris_topk), 1, 1048576, "100", NULL, NULL, "ParisKV: keys attended after rerank"},
    {"kv.paris.sink", T_INT, F(paris_sink), 0, 65536, "4", NULL, NULL, "ParisKV: sink tokens always attended"},
    {"kv.paris.local", T_INT, F(paris_local), 0, 1048576, "64", NULL, NULL, "ParisKV: recent window always attended"},
    {"kv.paris.update_interval", T_INT, F(paris_update_interval), 1, 1048576, "512", NULL, NULL,
     "ParisKV: tokens buffered before encoding"},
    {"kv.paris.dense_threshold", T_INT, F(paris_dense_threshold), 0, 16777216, "2000", NULL, NULL,
     "ParisKV: below this context, dense attention"},
    {"kv.paris.offload", T_BOOL, F(paris_offload), 0, 1, "false", NULL, NULL,
     "ParisKV: write the retrieval zone's K/V to a host page pool, give its KV pool blocks back (not with parallel.tensor > 1) and gather the chosen top-k from the host over UVA; chunked prefill writes the zone out as it goes, so a prompt may exceed the pool (the context limit counts host pages)"},
    {"kv.paris.host_bytes", T_INT64, F(paris_host_bytes), 0, I64MAX, "0", NULL, NULL,
     "ParisKV offload: bytes of the (pinned) host page pool; 0: one page per KV pool block"},
    {"kv.paris.beta", T_DOUBLE, F(paris_beta), 0, 1, "0", NULL, NULL,
     "ParisKV: share of the retrieval zone kept by the coarse vote (0: adaptive by retrieval length)"},
    {"kv.paris.rho", T_DOUBLE, F(paris_rho), 0, 1, "0", NULL, NULL,
     "ParisKV: share of keys the vote's tiers cover (0: adaptive by retrieval length)"},
    {"kv.paris.recall_every", T_INT, F(paris_recall_every), 0, 1048576, "0", NULL, NULL,
     "ParisKV: every this many steps, measure recall@k against the exact top-k (0: off; costs a full scan)"},

    {"kv.quest.budget_ratio", T_DOUBLE, F(quest_budget_ratio), 0.0001, 1, "0.15", NULL, NULL,
     "Quest/Retro: token budget as a fraction of the context (budget = max(min_budget, ratio x n))"},
    {"kv.quest.min_budget", T_INT, F(quest_min_budget), 0, 16777216, "256", NULL, NULL,
     "Quest/Retro: minimum token budget"},
    {"kv.quest.dense_layers", T_INT, F(quest_dense_layers), 0, 1024, "2", NULL, NULL,
     "Quest/Retro: first layers that attend densely"},
    {"kv.quest.page_size", T_INT, F(quest_page_size), 0, 1024, "0", NULL, NULL,
     "Quest/Retro: tokens per page digest (0: kv.block_size; must divide kv.block_size)"},
    {"kv.quest.digest_bits", T_INT, F(quest_digest_bits), 4, 16, "8", NULL, NULL,
     "Quest/Retro: bits per page-digest element: 16 (the keys' min/max as stored), 8 or 4 (codes on a per-page fp16 "
     "grid, rounded outward so the score stays an upper bound; 2x / 4x fewer digest bytes read per step; 8 and 4 need "
     "head_dim x bits a multiple of 32)"},
    {"kv.quest.super_pages", T_INT, F(quest_super_pages), 0, 4096, "0", NULL, NULL,
     "Quest: two-level selection (an approximation of Quest's own): pages per super-page, whose min/max digests "
     "(the union of their pages') are scored first; only the pages of the top super-pages and of the last one (the "
     "pages just before the current page) are scored and ranked (0: off, every page scored, Quest exactly; Retro refuses it)"},
    {"kv.quest.super_keep", T_DOUBLE, F(quest_super_keep), 1, 1e9, "2", NULL, NULL,
     "Quest with kv.quest.super_pages > 0: super-pages kept = min(all, ceil(super_keep x (kept pages - 1) / "
     "super_pages) + 1), the last one included, so their pages are at least super_keep times the pages to choose (>= 1; a value that "
     "keeps every super-page gives Quest's selection exactly)"},
    {"kv.retro.window", T_INT, F(retro_window), 1, 64, "2", NULL, NULL, "Retro: window w (1 = plain Quest)"},

    {"kv.lean.mode", T_ENUM, F(lean_mode), 0, 0, "K8V4", "dynamic|adaptive|K16V16|K8V8|K8V4|K4V4", NULL,
     "LeanKV: dynamic (= adaptive: tiers kv.lean.high / low by importance, pruning, a full-precision window; cpu "
     "and cuda) or one static format for every token, no pruning (KxVy: x key bits, y value bits; K16V16 stores fp16)"},
    {"kv.lean.high", T_ENUM, F(lean_high), 0, 0, "K8V4", "K16V16|K8V8|K8V4|K4V4|K4V2", NULL, "LeanKV dynamic: the high tier's format"},
    {"kv.lean.low", T_ENUM, F(lean_low), 0, 0, "K4V2", "K16V16|K8V8|K8V4|K4V4|K4V2", NULL, "LeanKV dynamic: the low tier's format"},
    {"kv.lean.window", T_INT, F(lean_window), 1, 1048576, "64", NULL, NULL,
     "LeanKV dynamic: recent tokens kept at full precision before their tier is chosen"},
    /* the defaults: calibrated on the models kvserve ships and tests (SmolLM2, the demo and the
     * long-context fidelity models: docs/STRATEGIES.md section 5 Defaults); the paper's Llama-3 8B
     * setting is 1 / 0.02 */
    {"kv.lean.alpha_h", T_DOUBLE, F(lean_alpha_h), 0, 100, "5", NULL, NULL,
     "LeanKV dynamic: a token is high when its score >= alpha_h / N (N: the context; a prompt token's own position at prefill)"},
    {"kv.lean.alpha_l", T_DOUBLE, F(lean_alpha_l), 0, 100, "0", NULL, NULL,
     "LeanKV dynamic: a token is low when its score >= alpha_l / N, else pruned (0: nothing pruned)"},

    {"documents.dir", T_STRING, F(documents_dir), 0, 0, "", NULL, NULL,
     "directory where posted documents persist across restarts (empty: memory only)"},
    {"documents.max_count", T_INT, F(documents_max_count), 1, 100000000, "10000", NULL, NULL, "documents stored at most"},
    {"documents.max_tokens", T_INT, F(documents_max_tokens), 1, 16777216, "32768", NULL, NULL, "tokens per document at most"},
};
#define N_KEYS (sizeof KEYS / sizeof KEYS[0])

static const struct key_def *find_key(const char *name)
{
    for (size_t i = 0; i < N_KEYS; i++)
        if (strcmp(KEYS[i].name, name) == 0) return &KEYS[i];
    return NULL;
}

/* 1 if word is one of the '|'-separated choices. */
static int in_choices(const char *choices, const char *word)
{
    size_t n = strlen(word);
    const char *p = choices;
    while (p && *p) {
        const char *bar = strchr(p, '|');
        size_t len = bar ? (size_t)(bar - p) : strlen(p);
        if (len == n && strncmp(p, word, n) == 0) return 1;
        p = bar ? bar + 1 : NULL;
    }
    return 0;
}

/* Levenshtein distance, for "did you mean" hints (keys are short). */
static int edit_distance(const char *a, const char *b)
{
    size_t la = strlen(a), lb = strlen(b);
    if (la > 127 || lb > 127) return 1000;
    int row[128];
    for (size_t j = 0; j <= lb; j++) row[j] = (int)j;
    for (size_t i = 1; i <= la; i++) {
        int diag = row[0];
        row[0] = (int)i;
        for (size_t j = 1; j <= lb; j++) {
            int up = row[j];
            int sub = diag + (a[i - 1] != b[j - 1]);
            int best = up + 1 < row[j - 1] + 1 ? up + 1 : row[j - 1] + 1;
            row[j] = sub < best ? sub : best;
            diag = up;
        }
    }
    return row[lb];
}

static const char *type_name(enum key_type t)
{
    switch (t) {
    case T_BOOL: return "bool";
    case T_INT: return "integer";
    case T_INT64: return "integer";
    case T_DOUBLE: return "number";
    case T_STRING: return "string";
    case T_ENUM: return "string";
    }
    return "?";
}

static void set_string(struct kvs_config *cfg, const struct key_def *k, const char *v)
{
    char **slot = (char **)((char *)cfg + k->offset);
    free(*slot);
    *slot = kvs_xstrdup(v);
}

static int check_range(const struct key_def *k, double v, const char *text, char *err, size_t errlen)
{
    if (!(v >= k->min && v <= k->max))
        return kvs_err(err, errlen, -ERANGE, "config key '%s': value %s is out of range (allowed: %g to %g)",
                       k->name, text, k->min, k->max);
    return 0;
}

/* Applies a value given as text (from --set or a default). */
static int apply_text(struct kvs_config *cfg, const struct key_def *k, const char *v, char *err, size_t errlen)
{
    char *slot = (char *)cfg + k->offset;
    char *end = NULL;
    switch (k->type) {
    case T_BOOL:
        if (!strcmp(v, "true") || !strcmp(v, "1") || !strcmp(v, "yes") || !strcmp(v, "on")) *(int *)slot = 1;
        else if (!strcmp(v, "false") || !strcmp(v, "0") || !strcmp(v, "no") || !strcmp(v, "off")) *(int *)slot = 0;
        else return kvs_err(err, errlen, -EINVAL, "config key '%s': '%s' is not a bool (allowed: true, false)", k->name, v);
        return 0;
    case T_INT:
    case T_INT64: {
        errno = 0;
        long long x = strtoll(v, &end, 10);
        if (errno || end == v || *end)
            return kvs_err(err, errlen, -EINVAL, "config key '%s': '%s' is not an integer", k->name, v);
        int rc = check_range(k, (double)x, v, err, errlen);
        if (rc) return rc;
        if (k->type == T_INT) *(int *)slot = (int)x;
        else *(int64_t *)slot = (int64_t)x;
        return 0;
    }
    case T_DOUBLE: {
        errno = 0;
        double x = strtod(v, &end);
        if (errno || end == v || *end || !isfinite(x))
            return kvs_err(err, errlen, -EINVAL, "config key '%s': '%s' is not a number", k->name, v);
        int rc = check_range(k, x, v, err, errlen);
        if (rc) return rc;
        *(double *)slot = x;
        return 0;
    }
    case T_ENUM:
        if (!in_choices(k->choices, v))
            return kvs_err(err, errlen, -EINVAL, "config key '%s': '%s' is not a valid choice (allowed: %s)", k->name,
                           v, k->choices);
        set_string(cfg, k, v);
        return 0;
    case T_STRING:
        set_string(cfg, k, v);
        return 0;
    }
    return -EINVAL;
}

/* Applies a JSON value (strict types: a string where a number belongs is an error). */
static int apply_json(struct kvs_config *cfg, const struct key_def *k, const cJSON *v, char *err, size_t errlen)
{
    char text[64];
    switch (k->type) {
    case T_BOOL:
        if (!cJSON_IsBool(v)) break;
        return apply_text(cfg, k, cJSON_IsTrue(v) ? "true" : "false", err, errlen);
    case T_INT:
    case T_INT64:
        if (!cJSON_IsNumber(v)) break;
        if (v->valuedouble != floor(v->valuedouble))
            return kvs_err(err, errlen, -EINVAL, "config key '%s': %g is not an integer", k->name, v->valuedouble);
        snprintf(text, sizeof text, "%.0f", v->valuedouble);
        if (fabs(v->valuedouble) > 9.0e18)
            return kvs_err(err, errlen, -ERANGE, "config key '%s': value %s is out of range (allowed: %g to %g)",
                           k->name, text, k->min, k->max);
        return apply_text(cfg, k, text, err, errlen);
    case T_DOUBLE:
        if (!cJSON_IsNumber(v)) break;
        snprintf(text, sizeof text, "%.17g", v->valuedouble);
        return apply_text(cfg, k, text, err, errlen);
    case T_STRING:
    case T_ENUM:
        /* an auto|true|false key (scheduler.async, a bool before) takes a JSON bool too */
        if (k->type == T_ENUM && cJSON_IsBool(v) && in_choices(k->choices, "true") && in_choices(k->choices, "false"))
            return apply_text(cfg, k, cJSON_IsTrue(v) ? "true" : "false", err, errlen);
        if (!cJSON_IsString(v)) break;
        return apply_text(cfg, k, v->valuestring, err, errlen);
    }
    char *got = cJSON_PrintUnformatted(v);
    int rc = kvs_err(err, errlen, -EINVAL, "config key '%s': expected %s %s%s%s, got %s", k->name, k->type == T_INT || k->type == T_INT64 ? "an" : "a", type_name(k->type),
                     k->type == T_ENUM ? " (one of " : "", k->type == T_ENUM ? k->choices : "", got ? got : "?");
    if (k->type == T_ENUM && err && errlen) strncat(err, ")", errlen - strlen(err) - 1);
    free(got);
    return rc;
}

void kvs_config_init(struct kvs_config *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    for (size_t i = 0; i < N_KEYS; i++) {
        char err[256];
        int rc = apply_text(cfg, &KEYS[i], KEYS[i].def, err, sizeof err);
        if (rc) kvs_panic(__FILE__, __LINE__, "bad default: %s", err);
    }
}

void kvs_config_free(struct kvs_config *cfg)
{
    for (size_t i = 0; i < N_KEYS; i++) {
        if (KEYS[i].type != T_STRING && KEYS[i].type != T_ENUM) continue;
        char **slot = (char **)((char *)cfg + KEYS[i].offset);
        free(*slot);
        *slot = NULL;
    }
}

/* Walks a JSON object; prefix is the dotted path so far. Every member must be a known key or
 * a known section (a prefix of some key followed by '.'). */
static int walk(struct kvs_config *cfg, const cJSON *obj, const char *prefix, const char *origin, char *err,
                size_t errlen)
{
    for (const cJSON *m = obj->child; m; m = m->next) {
        char path[256];
        if (!m->string) return kvs_err(err, errlen, -EINVAL, "%s: malformed object", origin);
        int n = snprintf(path, sizeof path, "%s%s%s", prefix, *prefix ? "." : "", m->string);
        if (n < 0 || (size_t)n >= sizeof path) return kvs_err(err, errlen, -EINVAL, "%s: key too long", origin);
        const struct key_def *k = find_key(path);
        if (k) {
            int rc = apply_json(cfg, k, m, err, errlen);
            if (rc) return rc;
            continue;
        }
        /* a section? */
        size_t plen = strlen(path);
        int is_section = 0;
        for (size_t i = 0; i < N_KEYS && !is_section; i++)
            if (!strncmp(KEYS[i].name, path, plen) && KEYS[i].name[plen] == '.') is_section = 1;
        if (is_section) {
            if (!cJSON_IsObject(m))
                return kvs_err(err, errlen, -EINVAL, "config key '%s': expected an object (a section of keys)", path);
            int rc = walk(cfg, m, path, origin, err, errlen);
            if (rc) return rc;
            continue;
        }
        /* Unknown: suggest the closest known key (edit distance on the full dotted path). */
        const char *hint = NULL;
        int best = 4; /* suggest only near misses */
        for (size_t i = 0; i < N_KEYS; i++) {
            int d = edit_distance(KEYS[i].name, path);
            if (d < best) best = d, hint = KEYS[i].name;
        }
        return kvs_err(err, errlen, -EINVAL, "%s: unknown config key '%s'%s%s%s (see kvserve --help-config)", origin,
                       path, hint ? " (did you mean '" : "", hint ? hint : "", hint ? "'?)" : "");
    }
    return 0;
}

int kvs_config_load_json(struct kvs_config *cfg, const char *json, const char *origin, char *err, size_t errlen)
{
    cJSON *root = cJSON_Parse(json);
    if (!root) {
        const char *at = cJSON_GetErrorPtr();
        int line = 1;
        for (const char *p = json; at && p < at && *p; p++)
            if (*p == '\n') line++;
        return kvs_err(err, errlen, -EINVAL, "%s: invalid JSON near line %d", origin, line);
    }
    int rc;
    if (!cJSON_IsObject(root)) rc = kvs_err(err, errlen, -EINVAL, "%s: the config must be a JSON object", origin);
    else rc = walk(cfg, root, "", origin, err, errlen);
    cJSON_Delete(root);
    return rc;
}

int kvs_config_load_file(struct kvs_config *cfg, const char *path, char *err, size_t errlen)
{
    char ferr[256];
    char *text = kvs_read_file(path, NULL, ferr, sizeof ferr);
    if (!text) return kvs_err(err, errlen, -ENOENT, "cannot read config file %s", ferr);
    int rc = kvs_config_load_json(cfg, text, path, err, errlen);
    free(text);
    return rc;
}

int kvs_config_set(struct kvs_config *cfg, const char *assignment, char *err, size_t errlen)
{
    const char *eq = strchr(assignment, '=');
    if (!eq) return kvs_err(err, errlen, -EINVAL, "--set '%s': expected key=value", assignment);
    char name[128];
    size_t n = (size_t)(eq - assignment);
    if (n == 0 || n >= sizeof name) return kvs_err(err, errlen, -EINVAL, "--set '%s': bad key", assignment);
    memcpy(name, assignment, n);
    name[n] = 0;
    const struct key_def *k = find_key(name);
    if (!k) return kvs_err(err, errlen, -EINVAL, "--set: unknown config key '%s' (see kvserve --help-config)", name);
    return apply_text(cfg, k, eq + 1, err, errlen);
}

int kvs_config_validate(const struct kvs_config *cfg, char *err, size_t errlen)
{
    for (size_t i = 0; i < N_KEYS; i++) {
        const struct key_def *k = &KEYS[i];
        if (k->type != T_ENUM || !k->implemented) continue;
        const char *v = *(char *const *)((const char *)cfg + k->offset);
        if (!in_choices(k->implemented, v))
            return kvs_err(err, errlen, -ENOSYS,
                           "config key '%s': strategy '%s' is not available in this build yet (built: %s)",
                           k->name, v, k->implemented);
    }
    {
        const struct kvs_kv_storage_ops *st;
        const struct kvs_kv_reuse_ops *ru;
        const struct kvs_kv_decode_ops *dc;
        int rc = kvs_kv_resolve(cfg->kv_storage, cfg->kv_reuse, cfg->kv_decode, &st, &ru, &dc, err, errlen);
        if (rc < 0) return rc;
    }
    if (cfg->model_path[0] == 0) return kvs_err(err, errlen, -EINVAL, "config key 'model.path' must not be empty");
    if (cfg->host[0] == 0) return kvs_err(err, errlen, -EINVAL, "config key 'server.host' must not be empty");
    if (!strcmp(cfg->device, "cpu") && !strcmp(cfg->kv_storage, "bf16"))
        return kvs_err(err, errlen, -EINVAL, "config key 'kv.storage': 'bf16' needs device 'cuda' (the cpu backend stores f32)");
    if (cfg->prefill_chunk > cfg->max_batch_tokens)
        return kvs_err(err, errlen, -EINVAL,
                       "config key 'scheduler.prefill_chunk' (%d) must not exceed scheduler.max_batch_tokens (%d)",
                       cfg->prefill_chunk, cfg->max_batch_tokens);
    return 0;
}

static cJSON *section(cJSON *root, const char *path, const char **leaf)
{
    /* creates nested objects for "a.b.c" and returns the parent of the leaf "c" */
    char buf[128];
    snprintf(buf, sizeof buf, "%s", path);
    cJSON *cur = root;
    char *p = buf;
    for (char *dot; (dot = strchr(p, '.')); p = dot + 1) {
        *dot = 0;
        cJSON *next = cJSON_GetObjectItemCaseSensitive(cur, p);
        if (!next) next = cJSON_AddObjectToObject(cur, p);
        cur = next;
    }
    *leaf = path + (p - buf);
    return cur;
}

char *kvs_config_dump_json(const struct kvs_config *cfg)
{
    cJSON *root = cJSON_CreateObject();
    for (size_t i = 0; i < N_KEYS; i++) {
        const struct key_def *k = &KEYS[i];
        const char *leaf;
        cJSON *parent = section(root, k->name, &leaf);
        const char *slot = (const char *)cfg + k->offset;
        switch (k->type) {
        case T_BOOL: cJSON_AddBoolToObject(parent, leaf, *(const int *)slot); break;
        case T_INT: cJSON_AddNumberToObject(parent, leaf, *(const int *)slot); break;
        case T_INT64: cJSON_AddNumberToObject(parent, leaf, (double)*(const int64_t *)slot); break;
        case T_DOUBLE: cJSON_AddNumberToObject(parent, leaf, *(const double *)slot); break;
        case T_STRING:
        case T_ENUM: cJSON_AddStringToObject(parent, leaf, *(char *const *)slot); break;
        }
    }
    char *s = cJSON_Print(root);
    cJSON_Delete(root);
    return s;
}

void kvs_config_print_reference(void *file, int markdown)
{
    FILE *f = file;
    if (markdown) {
        fprintf(f, "| key | type | default | allowed | meaning |\n|---|---|---|---|---|\n");
    }
    for (size_t i = 0; i < N_KEYS; i++) {
        const struct key_def *k = &KEYS[i];
        char allowed[160];
        if (k->type == T_ENUM) {
            if (k->implemented && strcmp(k->implemented, k->choices))
                snprintf(allowed, sizeof allowed, "%s (built: %s)", k->choices, k->implemented);
            else snprintf(allowed, sizeof allowed, "%s", k->choices);
        } else if (k->type == T_BOOL) snprintf(allowed, sizeof allowed, "true, false");
        else if (k->type == T_STRING) snprintf(allowed, sizeof allowed, "any");
        else snprintf(allowed, sizeof allowed, "%g .. %g", k->min, k->max);
        if (markdown)
            fprintf(f, "| `%s` | %s | `%s` | %s | %s |\n", k->name, type_name(k->type), k->def, allowed, k->help);
        else
            fprintf(f, "  %-28s %-6s default %-12s [%s]\n      %s\n", k->name, type_name(k->type),
                    k->def[0] ? k->def : "\"\"", allowed, k->help);
    }
}

int kvs_config_batch_invariant(const struct kvs_config *cfg)
{
    const char *v = cfg->batch_invariant ? cfg->batch_invariant : "auto";
    if (!strcmp(v, "true")) return 1;
    if (!strcmp(v, "false")) return 0;
    return cfg->kv_decode && !strcmp(cfg->kv_decode, "retro");
}
