/* engine.h: the serving core's interface to its callers (the HTTP server, kvserve generate,
 * kvserve-bench and the tests): submit a request, receive its events, cancel it.
 *
 * Threads: the engine runs its scheduler loop on its own thread (started by kvs_engine_create).
 * Callers submit from any thread. For each request the engine appends events (tokens with
 * their text deltas, then exactly one DONE or ERROR) to the request's queue and then calls
 * the request's notify callback (the server's is a uv_async_send; it must not block). Callers
 * drain the queue with kvs_request_poll. No lock is held across a forward pass.
 *
 * Ownership: a request is reference counted. kvs_request_new returns it with one reference (the
 * caller's); kvs_engine_submit takes a second one for the engine, which the engine drops after
 * the final event. Each side calls kvs_request_unref when done with it. Prompt and stop arrays
 * are copied into the request by kvs_request_new. Event text is owned by the event; free
 * drained events with kvs_event_clear.
 *
 * Errors: kvs_engine_submit returns 0, -EAGAIN (waiting queue full: HTTP 429/503),
 * -E2BIG (prompt + max_tokens over the context: HTTP 400 context_length_exceeded),
 * -EINVAL (bad parameters), -ESHUTDOWN (draining).
 */
#ifndef KVS_ENGINE_H
#define KVS_ENGINE_H

#include <stddef.h>
#include <stdint.h>

struct kvs_config;
struct kvs_model;
struct kvs_tokenizer;
struct kvs_engine;
struct kvs_request;

#define KVS_MAX_TOP_LOGPROBS 20

struct kvs_sampling {
    float temperature;            /* 0 = greedy */
    float top_p;                  /* 1 = off */
    int top_k;                    /* 0 = off */
    float min_p;                  /* 0 = off */
    uint64_t seed;
    int has_seed;                 /* 0: seeded from the request id */
    float presence_penalty;       /* 0 = off */
    float frequency_penalty;      /* 0 = off */
    float repetition_penalty;     /* 1 = off */
    int n_logit_bias;
    const int32_t *logit_bias_ids;   /* copied by kvs_request_new */
    const float *logit_bias_values;
    int logprobs;                 /* 1: report the sampled token's logprob */
    int top_logprobs;             /* 0..KVS_MAX_TOP_LOGPROBS alternatives per token */
};

/* A RAG document cited by a request (token ids from the docstore). With kv.reuse=lazy it is a
 * doc segment: its KV comes from the document cache (computed once, Block-Attention semantics,
 * reused at any offset); otherwise its tokens are plain prompt text. */
struct kvs_doc_segment {
    uint64_t id;                  /* caller's document id (logs only: the cache keys by content) */
    const int32_t *tokens;        /* copied by kvs_request_new */
    int n_tokens;                 /* > 0 */
};

struct kvs_request_params {
    const int32_t *prompt;        /* token ids (copied): the request's own tokens, after its documents */
    int n_prompt;
    int max_tokens;               /* > 0 */
    struct kvs_sampling sampling;
    const int32_t *stop_ids;      /* extra stop token ids (copied); EOS ids are added unless ignore_eos */
    int n_stop_ids;
    const char *const *stop_strings; /* copied; matched on the detokenized text, never emitted */
    int n_stop_strings;
    int ignore_eos;
    int skip_special;             /* detokenize without special tokens (default 1) */
    double timeout_s;             /* 0 = none; past it the request ends with finish "timeout" */
    /* documents first, in order, then prompt (NULL / 0: none). With kv.reuse=lazy each starts
     * on a KV block boundary and the request's positions are padded coordinates
     * (engine/kv/doc_cache.h); n_prompt_tokens in DONE counts real tokens only. */
    const struct kvs_doc_segment *docs;
    int n_docs;
    /* 1: score the prompt (echo with logprobs): one KVS_EV_PROMPT event per prompt position
     * 1..n-1, in order, before any TOKEN; max_tokens may then be 0 (the request ends with DONE,
     * finish LENGTH, once the prompt is scored). Such a request does not take prefix-cache
     * hits (their logits were never computed); with kv.reuse=lazy documents submit refuses it
     * (-ENOSYS). */
    int prompt_logprobs;
};

/* KVS_EV_PROMPT only for requests with prompt_logprobs: token is the prompt token at position
 * pos, logprob its log-probability given the tokens before it (the model's own distribution:
 * no temperature, penalties or bias), top_* the sampling.top_logprobs most likely tokens there;
 * text is NULL. */
enum kvs_event_type { KVS_EV_TOKEN = 1, KVS_EV_DONE = 2, KVS_EV_ERROR = 3, KVS_EV_PROMPT = 4 };
enum kvs_finish { KVS_FINISH_NONE = 0, KVS_FINISH_STOP, KVS_FINISH_LENGTH, KVS_FINISH_CANCELLED,
                  KVS_FINISH_TIMEOUT, KVS_FINISH_ERROR };

struct kvs_event {
    enum kvs_event_type type;
    /* TOKEN */
    int32_t token;
    char *text;                   /* UTF-8 delta completed by this token (may be ""); owned */
    float logprob;
    int n_top;
    int32_t top_ids[KVS_MAX_TOP_LOGPROBS];
    float top_logprobs[KVS_MAX_TOP_LOGPROBS];
    int pos;                      /* PROMPT: position in the prompt (>= 1) */
    /* DONE / ERROR */
    enum kvs_finish finish;
    char *error;                  /* ERROR: message (owned) */
    int n_prompt_tokens;
    int n_completion_tokens;
    int n_cached_tokens;          /* prompt tokens served from a cache (prefix / documents) */
    double queue_time_s;          /* submit -> first scheduled */
    double ttft_s;                /* submit -> first token */
    double e2e_s;                 /* submit -> done */
};

/* A KV strategy's own counter or gauge (engine/kv/kv.h), exported by /metrics under its name. */
struct kvs_kv_counter {
    const char *name;             /* full metric name, e.g. "kvserve:doc_cache_hits_total" (static) */
    const char *help;             /* static */
    int is_counter;               /* 1: monotonic counter, 0: gauge */
    double value;
    /* histogram series: family is the histogram's name (name its _bucket / _sum / _count
     * series) and le the bucket's bound ("+Inf" last; NULL for _sum and _count); else NULL */
    const char *family, *le;
};
/* room for the reuse strategy's, the decode policy's (ParisKV alone has over 20) and the fidelity meter's counters */
#define KVS_KV_MAX_COUNTERS 48

/* Gauges and counters for /metrics and the benchmarks (a consistent snapshot). */
struct kvs_engine_stats {
    int num_running;
    int num_waiting;
    int kv_blocks_total;
    int kv_blocks_used;           /* referenced by running requests */
    int kv_blocks_cached;         /* free but holding reusable prefix/doc KV */
    int block_size;
    uint64_t num_preemptions;
    uint64_t prompt_tokens;
    uint64_t generation_tokens;
    uint64_t cache_queries;       /* prompt tokens looked up in the reuse strategy's cache */
    uint64_t cache_hits;          /* of those, served from it (vllm:prefix_cache_*) */
    uint64_t requests_finished;
    uint64_t requests_rejected;   /* -EAGAIN at submit */
    uint64_t steps;
    uint64_t argmax_tokens;       /* of generation_tokens, those picked on the backend (greedy
                                   * fast path: KVS_LOGITS_ARGMAX rows, no host logits, no sampler) */
    double busy_s;                /* time spent in forward passes */
    /* step timing for the serving benchmark's ceiling (bench/serve_bench.py): step_s is the
     * scheduler's wall time of non-empty steps (host work + forward); the decode_* fields count
     * the steps in which every sequence decoded one token (their forward time and rows) */
    double step_s;
    uint64_t decode_steps;
    uint64_t decode_rows;
    double decode_busy_s;
    double sched_s;               /* of step_s, before the forward pass: reap, schedule, batch */
    double launch_s;              /* of busy_s, until the executor has queued the step (forward_begin,
                                   * or all of forward without overlap): its host share */
    uint64_t async_steps;         /* steps begun while the step before was still running (scheduler.async) */
    /* the KV strategies' own counters (kv.h: reuse, then decode policy, then fidelity meter) */
    int n_kv_counters;
    struct kvs_kv_counter kv_counters[KVS_KV_MAX_COUNTERS];
    /* counters the strategies exported past KVS_KV_MAX_COUNTERS, not shown (logged once when
     * it first happens; raise the constant): 0 in every shipped combination */
    int kv_counters_dropped;
};

/* Creates the runner (backend, weights, KV pool) and starts the scheduler thread.
 * model and tokenizer are borrowed and must outlive the engine. */
int kvs_engine_create(const struct kvs_config *cfg, const struct kvs_model *model,
                      const struct kvs_tokenizer *tok, struct kvs_engine **out, char *err, size_t errlen);
/* Stops the scheduler thread: in-flight requests get a DONE event with finish CANCELLED. */
void kvs_engine_free(struct kvs_engine *e);

/* Stops admitting (submit returns -ESHUTDOWN); running requests go on. */
void kvs_engine_drain(struct kvs_engine *e);
int kvs_engine_max_context(const struct kvs_engine *e);
/* "" or, when KV memory outside the GPU pool sets max_context (kv.paris.offload), a sentence
 * naming the memories that bound it (for the context-length error). */
const char *kvs_engine_context_note(const struct kvs_engine *e);
void kvs_engine_stats(struct kvs_engine *e, struct kvs_engine_stats *out);
/* How the KV reuse strategy wants a request's documents (engine/prompt_layout.h): 1 as segments
 * of their own, each padded to *align slots (the block size), 0 inline (*align = 1). */
int kvs_engine_doc_layout(const struct kvs_engine *e, int *align);
/* The value of a KV strategy's counter in a snapshot, by metric name (0 when it has none). */
double kvs_engine_kv_counter(const struct kvs_engine_stats *st, const char *name);

/* notify(user) is called from the engine thread after events are appended; may be NULL. */
struct kvs_request *kvs_request_new(const struct kvs_request_params *p, void (*notify)(void *user), void *user);
void kvs_request_ref(struct kvs_request *r);
void kvs_request_unref(struct kvs_request *r);
uint64_t kvs_request_id(const struct kvs_request *r);

int kvs_engine_submit(struct kvs_engine *e, struct kvs_request *r, char *err, size_t errlen);
/* Cancels (client gone): takes effect at the next step; the request's blocks return to the
 * pool and it ends with DONE/CANCELLED. Safe from any thread, any number of times. */
void kvs_request_cancel(struct kvs_request *r);

/* Moves up to max queued events into out (caller clears each with kvs_event_clear); returns
 * how many. Non-blocking. */
int kvs_request_poll(struct kvs_request *r, struct kvs_event *out, int max);
/* Blocks until at least one event is queued or timeout_s passes (for CLI tools and tests). */
int kvs_request_wait(struct kvs_request *r, struct kvs_event *out, int max, double timeout_s);
void kvs_event_clear(struct kvs_event *ev);

#endif
