/* config.h: the daemon's configuration: one struct, filled from one declarative table.
 *
 * The table in config.c (name, type, bounds, default, allowed values, help) drives JSON parsing,
 * validation, `--set key=value` overrides, `--help`, the effective-config dump and the README
 * reference. Adding a key = adding a field here and a row there.
 *
 * Ownership: kvs_config_init() fills defaults; strings inside are owned by the struct and freed
 * by kvs_config_free(). Error convention: 0 or negative errno, with a message in err naming the
 * key, the value and what is allowed.
 */
#ifndef KVS_CONFIG_H
#define KVS_CONFIG_H

#include <stddef.h>
#include <stdint.h>

struct kvs_config {
    /* model */
    char *model_path;        /* Hugging Face model directory */
    char *model_name;        /* name served in /v1/models ("" = directory basename) */
    char *chat_format;       /* auto | chatml | llama3 */
    int max_model_len;       /* 0 = model's max_position_embeddings */

    /* device */
    char *device;            /* auto | cpu | cuda */
    int cpu_threads;         /* 0 = number of cores */
    int tensor_parallel;     /* parallel.tensor: ranks (GPUs) a model is split over; 1 = none */
    char *batch_invariant;   /* auto | true | false: kvs_config_batch_invariant */

    /* server */
    char *host;
    int port;
    char *api_key;           /* "" = no authentication */
    int64_t max_body_bytes;
    int max_connections;
    double request_timeout_s;   /* 0 = none */
    double idle_timeout_s;      /* libmicrohttpd's per-connection inactivity timeout */
    int max_connections_per_client;   /* 0 = no cap (libmicrohttpd's per-IP limit) */
    int reserved_connections;   /* above max_connections, for the probe routes only */
    double shutdown_grace_s;
    double sse_keepalive_s;
    int access_log;             /* bool */
    char *log_level;            /* debug | info | warn | error */

    /* scheduler */
    int max_batch_tokens;    /* tokens per step (decode tokens + prefill chunk tokens) */
    int max_running;         /* running requests */
    int max_waiting;         /* queued requests before 429 */
    int prefill_chunk;       /* max prefill tokens of one request per step; 0 = max_batch_tokens */
    int max_tokens_default;  /* max_tokens when a request gives none; 0 = up to the context */
    int sched_overlap;       /* bool: a step's text and events while the next step runs */
    char *sched_async;       /* auto | true | false: the next step is prepared and queued while the device
                              * runs one (auto: where the backend queues work, i.e. not the CPU) */
    double itl_ratio;        /* prefill budget target: mixed / decode-only step time; 0 = off */
    int prefill_min;         /* prefill tokens every step may carry while requests decode */

    /* kv: paged cache and its three strategy slots */
    int kv_block_size;
    int64_t kv_memory_bytes;     /* 0 = kv_memory_fraction of free device memory */
    double kv_memory_fraction;
    char *kv_storage;            /* auto | f32 | bf16 | lean */
    char *kv_reuse;              /* none | prefix | lazy */
    char *kv_decode;             /* full | quest | retro | mac | paris (kv.h registry) */
    int64_t kv_decode_state_bytes; /* budget of the decode policy's per-request states */
    int kv_fidelity_sample_every;  /* live fidelity meter: every N-th decode step (0 = off) */

    /* kv.lazy (LazyAttention doc cache) */
    int64_t lazy_budget_bytes;
    char *lazy_eviction;         /* lru | lfu */
    int lazy_position_aware;     /* bool: key documents by (content, offset) (benchmark baseline) */

    /* kv.mac (MAC-Attention) */
    int mac_ring_size;
    int mac_band;
    double mac_tau;
    int mac_gen_min;

    /* kv.paris (ParisKV) */
    int paris_topk;
    int paris_sink;
    int paris_local;
    int paris_update_interval;
    int paris_dense_threshold;
    int paris_offload;           /* bool */
    double paris_beta;           /* 0: adaptive */
    double paris_rho;            /* 0: adaptive */
    int paris_recall_every;      /* 0: off */
    int64_t paris_host_bytes;    /* offload host page pool; 0: auto (one page per KV pool block) */

    /* kv.quest (Quest page selection; RetroAttention builds on it) */
    double quest_budget_ratio;
    int quest_min_budget;
    int quest_dense_layers;
    int quest_page_size;         /* 0: kv.block_size */
    int quest_digest_bits;       /* 16 (bf16 min/max), 8 or 4 (codes on a per-page grid) */
    int quest_super_pages;       /* two-level selection: pages per super-page (0: off) */
    double quest_super_keep;     /* super-pages kept, as a factor over the pages to choose (>= 1) */

    /* kv.retro (RetroAttention on Quest) */
    int retro_window;

    /* kv.lean (LeanKV) */
    char *lean_mode;             /* dynamic | K16V16 | K8V8 | K8V4 | K4V4 (static: one format, no pruning) */
    char *lean_high, *lean_low;  /* the dynamic tiers' formats (KxVy) */
    int lean_window;
    double lean_alpha_h, lean_alpha_l;

    /* documents (RAG) */
    char *documents_dir;         /* "" = in memory only */
    int documents_max_count;
    int documents_max_tokens;    /* per document */
};

/* Fills every field with its default. */
void kvs_config_init(struct kvs_config *cfg);
void kvs_config_free(struct kvs_config *cfg);

/* Applies a JSON config file (nested objects: {"kv": {"reuse": "prefix"}}) on top of cfg.
 * Unknown keys, wrong types and out-of-range values are errors naming the key. */
int kvs_config_load_file(struct kvs_config *cfg, const char *path, char *err, size_t errlen);
int kvs_config_load_json(struct kvs_config *cfg, const char *json, const char *origin, char *err, size_t errlen);

/* Applies one override "dotted.key=value" (value parsed per the key's type). */
int kvs_config_set(struct kvs_config *cfg, const char *assignment, char *err, size_t errlen);

/* Cross-key checks (strategy built? combination allowed?). Call after all overrides. */
int kvs_config_validate(const struct kvs_config *cfg, char *err, size_t errlen);

/* Whether steps run with batch-invariant numerics (key batch_invariant): true, false, or auto:
 * on for kv.decode=retro (its re-run rows must round as their first runs did), else off. */
int kvs_config_batch_invariant(const struct kvs_config *cfg);

/* Returns the effective config as pretty JSON (malloc'ed, caller frees). */
char *kvs_config_dump_json(const struct kvs_config *cfg);

/* Prints the key reference (name, type, default, range/choices, help) to f; markdown=1 gives
 * the README table. */
void kvs_config_print_reference(void *file, int markdown);

#endif
