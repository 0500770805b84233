/* sampler.h: turns one row of logits into the next token, per request.
 *
 * The pipeline, in vLLM's order (each step optional, off at its neutral value):
 *   1. logit_bias:        logit[id] += bias (OpenAI semantics; -100 effectively bans a token)
 *   2. repetition penalty (over prompt + generated tokens, each distinct token once):
 *                         logit > 0 ? logit / rp : logit * rp
 *   3. frequency / presence penalties (over generated tokens only):
 *                         logit -= frequency * count + presence * (count > 0)
 *   4. temperature == 0:  greedy, argmax of the processed logits (lowest id on ties), stop here
 *   5. temperature:       logit / T, softmax
 *   6. min_p (keep tokens with p >= min_p * p_max), then top_k, then top_p (smallest set of the
 *      most probable remaining tokens whose share of the remaining mass >= top_p); renormalise
 *   7. draw u in [0, 1) from the request's RNG and walk the kept tokens in a deterministic
 *      order (decreasing probability, ties lower id first, when top_k is set; otherwise the
 *      order the filters leave them in) until the cumulative mass passes u * (kept mass).
 * top_p keeps every token tied with the lightest token of the nucleus.
 * top_k = 1 is greedy. top_k <= 0 (0 or -1) means off.
 * Logprobs are RAW, like vLLM's default (logprobs_mode "raw_logprobs"): log-softmax of the
 * model's logits as given, before bias, penalties, temperature and filtering; top_logprobs are
 * the most likely tokens of that same raw distribution (ties: lower id first).
 *
 * RNG: xoshiro256** seeded through splitmix64 from sampling.seed when has_seed, otherwise from
 * the request id; one state per request, so the same seed and logits give the same tokens no
 * matter what else is batched. Stop tokens (EOS, stop ids) are the caller's job.
 *
 * Ownership: kvs_sampler_init copies the scalar parameters and the logit_bias arrays and
 * allocates vocab-sized workspaces (per request, never per step); kvs_sampler_free releases
 * them. The logits passed to kvs_sampler_sample are only read. Not thread-safe per sampler.
 * Errors: init returns 0 or -EINVAL (+ message) for out-of-range parameters or bias ids.
 */
#ifndef KVS_SAMPLER_H
#define KVS_SAMPLER_H

#include <stddef.h>
#include <stdint.h>

#include "engine/engine.h"

struct kvs_sampler {
    struct kvs_sampling p;        /* copy; logit_bias pointers point into bias_ids/bias_values */
    int vocab;
    uint64_t rng[4];              /* xoshiro256** state */
    int32_t *bias_ids;            /* [n_logit_bias] owned */
    float *bias_values;           /* [n_logit_bias] owned */
    float *work;                  /* [vocab] processed logits / probabilities */
    int32_t *idx;                 /* [vocab] candidate ids */
    int32_t *count;               /* [vocab] scratch counts, all zero between calls */
};

struct kvs_sample_result {
    int32_t token;
    float logprob;                /* raw logprob of token (when sampling.logprobs or top_logprobs; else 0) */
    int n_top;                    /* = sampling.top_logprobs */
    int32_t top_ids[KVS_MAX_TOP_LOGPROBS];
    float top_logprobs[KVS_MAX_TOP_LOGPROBS];
};

int kvs_sampler_init(struct kvs_sampler *s, const struct kvs_sampling *params, uint64_t request_id, int vocab,
                     char *err, size_t errlen);
void kvs_sampler_free(struct kvs_sampler *s);

/* Samples one token from logits[vocab]. history = prompt ids followed by generated ids:
 * history[0 .. n_prompt) is the prompt, history[n_prompt .. n_hist) the generated tokens.
 * Ids outside [0, vocab) in history are ignored. Returns 0, or -EINVAL if every token ended up
 * with zero probability (e.g. all logits -inf). */
int kvs_sampler_sample(struct kvs_sampler *s, const float *logits, const int32_t *history, int n_prompt, int n_hist,
                       struct kvs_sample_result *out);

/* 1 when kvs_sampler_sample would return the plain argmax of the logits as given and nothing
 * else: greedy (temperature 0 or top_k 1) with no logit bias and no penalties, so no history is
 * read, no RNG draw is made (the state does not change) and no logprobs are asked for. Its pick
 * is then the first maximum, NaN skipped, and it fails when that maximum is -inf or the row is
 * all NaN: exactly backend.h's argmax_rows (-1 for the failing rows), so a caller may pick the
 * token on the backend and skip the host logits and this sampler (runner.h KVS_LOGITS_ARGMAX). */
int kvs_sampler_is_argmax(const struct kvs_sampler *s);

/* Steps 1-3 only (logit bias and penalties) of logits[vocab] into out[vocab] (may equal
 * logits); for tests and for backends that sample elsewhere. Returns 0. */
int kvs_sampler_processed_logits(struct kvs_sampler *s, const float *logits, const int32_t *history, int n_prompt,
                                 int n_hist, float *out);

/* Uniform double in [0, 1) from the sampler's RNG (advances it); exposed for tests. */
double kvs_sampler_uniform(struct kvs_sampler *s);

#endif
