/* engine_internal.h: the engine's and the request's private state, shared by engine.c (create,
 * submit, stats), request.c (request object, event queue) and scheduler.c (the step loop).
 *
 * Locks: each request has its own mutex (event queue); the engine has one mutex (incoming
 * list, flags, stats snapshot). Neither is held while taking the other, and no lock is held
 * across a forward pass.
 */
#ifndef KVS_ENGINE_INTERNAL_H
#define KVS_ENGINE_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>

#include "engine/engine.h"
#include "engine/engine_exec.h"
#include "engine/kv/block_pool.h"
#include "engine/kv/kv.h"
#include "engine/sched_policy.h"
#include "engine/text/tokenizer.h"

/* Extra host logits rows per step for prompt scoring (prompt_logprobs): a scored prefill chunk
 * returns one row per token, so such chunks are capped to this many tokens per step in all. */
#define KVS_PROMPT_LP_ROWS 64

enum kvs_req_state { KVS_REQ_NEW = 0, KVS_REQ_INCOMING, KVS_REQ_WAITING, KVS_REQ_RUNNING, KVS_REQ_FINISHED };

struct kvs_request {
    atomic_int refs;
    uint64_t id;
    atomic_int cancelled;
    atomic_int submitted;         /* 1 once accepted by kvs_engine_submit (or while it runs) */

    /* copied parameters */
    int32_t *prompt;              /* [n_prompt] */
    int n_prompt;
    int max_tokens;
    struct kvs_sampling sampling;
    int32_t *logit_bias_ids;      /* [sampling.n_logit_bias] */
    float *logit_bias_values;
    int32_t *stop_ids;            /* [n_stop_ids] (+ EOS ids added at submit) */
    int n_stop_ids;
    char **stop_strings;          /* [n_stop_strings] */
    int n_stop_strings;
    int max_stop_len;
    int ignore_eos;
    int skip_special;
    double timeout_s;
    int32_t *doc_tokens;          /* [sum of doc_len] the documents' ids, concatenated */
    int *doc_len;                 /* [n_docs] */
    int n_docs;
    int prompt_logprobs;          /* score the prompt (engine.h) */
    int n_prompt_lp;              /* next prompt position whose PROMPT event is due (from 1) */
    void (*notify)(void *user);
    void *user;

    /* event queue (guarded by mu) */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct kvs_event *ev;         /* ring [ev_cap] */
    int ev_head, ev_count, ev_cap;

    /* scheduler-thread state (allocated at submit, sized by prompt + max_tokens) */
    enum kvs_req_state state;
    int32_t *tokens;              /* [n_prompt + max_tokens] prompt, then generated */
    int n_tokens;
    int n_gen;
    int n_computed;               /* leading tokens whose KV is in the cache */
    int n_cached_tokens;          /* prompt tokens reused at first admission */
    int admitted_once;
    struct kvs_block_table table;
    struct kvs_kv_req kvrq;       /* the reuse strategy's per-request state (engine/kv/kv.h) */
    const struct kvs_kv_reuse_ops *kv_reuse;   /* whose seq_free releases kvrq */
    int slot;                     /* request slot while running (decode-policy state), else -1 */
    int slot_fresh;               /* the next step is its first in this slot */
    int n_real_prompt;            /* prompt tokens: documents (unpadded) + own prompt */
    int n_full_prompt;            /* leading entries of tokens[] before the generated ones
                                   * (documents with their padding, then the own prompt) */
    void *sampler;                /* exec->sampler_state_size bytes */
    struct kvs_detok detok;
    char *text;                   /* held-back text (possible start of a stop string) */
    int n_text, text_cap;
    double t_submit, t_first_sched, t_first_token;
    int sched_tokens;             /* tokens scheduled in the current step (0 = not scheduled) */
    /* scheduler.overlap: the last token's text and event are still to be emitted (its slot in
     * engine.deferred); the request ended (stop string, error) while a step holding it ran:
     * it is finished (pend_why, pend_msg) once that step is back, its token dropped */
    int emit_pending;
    int finish_pending;
    /* scheduler.async: steps begun and not yet finished that hold r (0-2); tokens[tok_idx] is
     * the placeholder of a pick still on the device (tok_pending), the request's last token
     * when tok_final (then it runs no step until the pick is back) */
    int n_inflight, tok_pending, tok_final, tok_idx;
    enum kvs_finish pend_why;
    const char *pend_msg;
    struct kvs_request *next, *prev;   /* incoming / waiting lists */
};

struct kvs_engine {
    struct kvs_engine_exec x;
    int32_t *eos_ids;
    int n_eos;
    /* scheduler knobs (copied from the config) */
    int max_batch_tokens, max_running, max_waiting, prefill_chunk, max_context;
    int watermark_blocks;
    /* set when the decode policy's host memory (kv_footprint) lifts max_context past the pool:
     * appended to the context-length error, naming both memories */
    char ctx_note[320];
    int overlap;                             /* scheduler.overlap */
    int async;                               /* scheduler.async, where the executor has async_steps */
    int kv_counters_warned;                  /* publish_stats logged a dropped counter once */
    struct kvs_prefill_ctl pctl;             /* prefill budget next to decodes (sched_policy.h) */

    struct kvs_block_pool pool;
    struct kvs_kv kv;
    int32_t *free_slots;                     /* [max_running] request slots not in use */
    int n_free_slots;

    pthread_t thread;
    int thread_started;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int stop, draining;
    struct kvs_request *in_head, *in_tail;   /* submitted, not yet seen by the scheduler */
    int n_incoming;
    struct kvs_engine_stats stats;           /* snapshot, guarded by mu */

    /* scheduler-thread state */
    struct kvs_request *wait_head, *wait_tail;
    int n_waiting;
    struct kvs_request **running;            /* [max_running] in admission order */
    int n_running;
    struct kvs_request **sched;              /* [max_running] this step's batch order */
    struct kvs_batch_seq *seqs;              /* [max_running] requests, then document prefills */
    /* this step's side prefills asked for by the reuse strategy (kv.h), after the requests */
    struct kvs_kv_job *jobs;                 /* [max_running] */
    int n_jobs;
    int plp_rows;                            /* this step's scored prompt rows (<= KVS_PROMPT_LP_ROWS) */
    float *logits;                           /* [max_running + KVS_PROMPT_LP_ROWS][vocab] host rows (non-ARGMAX), in batch order */
    int32_t *argmax;                         /* [max_running + KVS_PROMPT_LP_ROWS] ids of every logits row (batch.argmax) */
    /* scheduler.overlap: tokens applied (appended, counted) whose text and TOKEN event are
     * emitted during the next step's forward pass, with their sampler outputs */
    struct kvs_request **deferred;           /* [max_running] */
    struct kvs_sample_out *deferred_so;      /* [max_running] */
    int n_deferred;
    int in_flight;                           /* between forward_begin and forward_end */
    /* scheduler.async: the begun step whose results are still to come (p_on), its batch (the
     * arrays are swapped with sched / seqs when a step is begun), its begin time and result,
     * whether the next step may be begun before its end (lookahead: no host logits rows, no
     * side prefills), and when the last step's end was seen (its busy time counts from there) */
    struct kvs_request **p_sched;            /* [max_running] */
    struct kvs_batch_seq *p_seqs;            /* [max_running] */
    int p_on, p_n, p_n_jobs, p_rc, p_lookahead;
    double p_t0, last_end;
    char *piece;                             /* detokenizer output scratch */
    size_t piece_cap;
    struct kvs_engine_stats counters;        /* scheduler-thread copy of the counters */
};

/* request.c */
int kvs_request_push_event(struct kvs_request *r, struct kvs_event *ev);
void kvs_request_release_engine_state(struct kvs_request *r, struct kvs_engine *e);

/* scheduler.c */
void *kvs_scheduler_main(void *arg);
/* Ends r: takes it off the waiting / running list (an incoming one must already be off its
 * list), releases its blocks, publishes the stats, emits DONE (or ERROR when msg is set) and
 * drops the engine's reference. */
void kvs_scheduler_finish(struct kvs_engine *e, struct kvs_request *r, enum kvs_finish why, const char *msg);

#endif
