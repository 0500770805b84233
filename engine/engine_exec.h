/* engine_exec.h: what the engine needs from the model side, as one table of hooks: the forward
 * pass over a mixed batch, the per-request sampler, the streaming detokenizer and the EOS ids.
 *
 * kvs_engine_create (engine.h) builds this table from the real runner, sampler and tokenizer.
 * Tests and benchmarks may pass their own (a deterministic fake model makes scheduler tests
 * fast and exact) through kvs_engine_create_exec; the scheduler cannot tell the difference.
 *
 * Ownership: the table is copied by kvs_engine_create_exec; ctx stays the caller's unless
 * destroy is set, in which case kvs_engine_free calls destroy(ctx) after the scheduler thread
 * has stopped. All hooks are called from the scheduler thread only.
 * Errors: hooks return 0 or a negative errno; a failing forward ends the requests of that
 * batch with an ERROR event; a failing sample ends that request with an ERROR event.
 */
#ifndef KVS_ENGINE_EXEC_H
#define KVS_ENGINE_EXEC_H

#include <stddef.h>
#include <stdint.h>

#include "engine/engine.h"
#include "engine/runner.h"
#include "engine/text/tokenizer.h"

struct kvs_sample_out {
    int32_t token;
    float logprob;                /* log-probability of token (filled when want_logprobs) */
    int n_top;
    int32_t top_ids[KVS_MAX_TOP_LOGPROBS];
    float top_logprobs[KVS_MAX_TOP_LOGPROBS];
};

struct kvs_engine_exec {
    void *ctx;
    const char *backend_name;     /* "cpu", "cuda", "fake": picks kv.storage=auto */
    int n_blocks;                 /* KV pool size (blocks) */
    int block_size;               /* token slots per block */
    int vocab_size;
    int max_context;              /* model context (prompt + generated) */
    size_t kv_bytes_per_block;    /* KV bytes of one block, all layers (0 = unknown: no byte budgets) */

    /* runner.h's kvs_runner_forward contract, KVS_LOGITS_ARGMAX rows and batch.argmax included
     * when sample_is_argmax is set (logits then holds only the non-ARGMAX rows, in batch order) */
    int (*forward)(void *ctx, const struct kvs_batch *b, float *logits);

    /* forward in two halves (may both be NULL: forward only). begin queues the step and
     * returns (host logits rows already filled); end waits for it and fills batch.argmax. The
     * scheduler does the previous step's text and events in between (scheduler.overlap);
     * between the two it leaves the batch unchanged and calls no other hook but detok_*,
     * kv_counters, and seq_end for requests that are not in the step (they ended). */
    int (*forward_begin)(void *ctx, const struct kvs_batch *b, float *logits);
    int (*forward_end)(void *ctx);
    /* 1: begin / end follow kvs_runner_async_ok's contract (two begun steps, token_on_device
     * sequences), which scheduler.async uses; 0: one begun step at a time */
    int async_steps;

    /* May be NULL. The last forward pass's duration in seconds as the executor counts it, for
     * the adaptive prefill budget (engine/sched_policy.h); NULL: the scheduler's wall clock.
     * Tests give modelled times here so that the policy's decisions are deterministic. */
    double (*step_seconds)(void *ctx);

    /* per-request sampler state: sampler_state_size bytes, zeroed, owned by the request */
    size_t sampler_state_size;
    int (*sampler_init)(void *ctx, void *state, const struct kvs_sampling *p, uint64_t request_id);
    /* Samples from logits [vocab] (may be modified in place). tokens[0..n_tokens) is the
     * sequence so far, the first n_prompt of them the prompt. want_top: 0..KVS_MAX_TOP_LOGPROBS. */
    int (*sample)(void *ctx, void *state, float *logits, const int32_t *tokens, int n_prompt, int n_tokens,
                  int want_logprobs, int want_top, struct kvs_sample_out *out);
    void (*sampler_free)(void *ctx, void *state);   /* may be NULL */
    /* The greedy fast path (may be NULL: never taken). Returns 1 when sample() on this state
     * would pick the argmax of the row exactly as forward's batch.argmax reports it (-1 where
     * sample() would fail), ask for no logprobs and leave the state as it was (no RNG draw):
     * the scheduler then runs that request's row as KVS_LOGITS_ARGMAX and emits the id without
     * calling sample(). Depends only on the parameters given to sampler_init. */
    int (*sample_is_argmax)(void *ctx, const void *state);

    /* streaming detokenizer with kvs_detok's contract (tokenizer.h) */
    const struct kvs_tokenizer *tok;
    void (*detok_init)(struct kvs_detok *d, const struct kvs_tokenizer *t, int skip_special);
    int (*detok_feed)(struct kvs_detok *d, int32_t id, char *out, size_t cap);
    int (*detok_flush)(struct kvs_detok *d, char *out, size_t cap);

    const int32_t *eos_ids;       /* copied */
    int n_eos;

    /* The KV decode policy's per-request state (engine/kv/kv.h): the request in slot ended;
     * the executor frees what the policy holds for it. May be NULL. */
    void (*seq_end)(void *ctx, int slot);
    /* The executor's KV counters (decode policy, fidelity meter) into out[0..cap); returns how
     * many. May be NULL. */
    int (*kv_counters)(void *ctx, struct kvs_kv_counter *out, int cap);
    /* The decode policy's `offloaded` (kv.h): after a successful step, logical blocks [*lo, *hi)
     * of the request in slot that the policy moved off the pool; the scheduler gives them back
     * to the block pool. Returns hi - lo (0: none). May be NULL (nothing is ever released). */
    int (*kv_offloaded)(void *ctx, int slot, int *lo, int *hi);
    /* The decode policy's `footprint` (kv.h): pool blocks a request of n_tokens holds at its peak
     * with host_avail pages of the policy's memory (< 0: those free now), or -ENOSYS. May be NULL
     * (the pool bounds a request). The engine's context limit and admission use it. */
    int (*kv_footprint)(void *ctx, int n_tokens, int chunk, int host_avail, int *host_pages, int *host_free,
                        int *host_total);

    void (*destroy)(void *ctx);   /* may be NULL */
};

int kvs_engine_create_exec(const struct kvs_config *cfg, const struct kvs_engine_exec *x, struct kvs_engine **out,
                           char *err, size_t errlen);

#endif
