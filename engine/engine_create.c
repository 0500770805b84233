/* engine_create.c: kvs_engine_create: the engine over the real runner (engine/runner.h), sampler
 * (engine/sampler.h) and streaming detokenizer (engine/text/tokenizer.h), as an executor table for
 * kvs_engine_create_exec. Kept apart from engine.c so that programs which bring their own
 * executor (scheduler tests, fake benchmarks) do not link the model stack.
 *
 * Without a tokenizer (tok == NULL: token-id-only models such as the tiny test models) text
 * deltas are empty and stop strings never match; EOS ids then come from the model config.
 */
#include "engine/engine_exec.h"

#include "engine/config.h"
#include "engine/runner.h"
#include "engine/sampler.h"
#include "engine/text/tokenizer.h"
#include "base/util.h"
#include "models/model.h"

#include <string.h>

struct real_exec {
    struct kvs_runner *runner;
    int vocab;
    int32_t eos[2 * KVS_MAX_EOS + 16];
};

static int real_forward(void *ctx, const struct kvs_batch *b, float *logits)
{
    struct real_exec *x = ctx;
    return kvs_runner_forward(x->runner, b, logits);
}

static int real_forward_begin(void *ctx, const struct kvs_batch *b, float *logits)
{
    struct real_exec *x = ctx;
    return kvs_runner_forward_begin(x->runner, b, logits);
}

static int real_forward_end(void *ctx)
{
    struct real_exec *x = ctx;
    return kvs_runner_forward_end(x->runner);
}

static void real_seq_end(void *ctx, int slot)
{
    struct real_exec *x = ctx;
    kvs_runner_seq_end(x->runner, slot);
}

static int real_kv_counters(void *ctx, struct kvs_kv_counter *out, int cap)
{
    struct real_exec *x = ctx;
    return kvs_runner_kv_counters(x->runner, out, cap);
}

static int real_kv_offloaded(void *ctx, int slot, int *lo, int *hi)
{
    struct real_exec *x = ctx;
    return kvs_runner_kv_offloaded(x->runner, slot, lo, hi);
}

static int real_kv_footprint(void *ctx, int n_tokens, int chunk, int host_avail, int *host_pages, int *host_free,
                             int *host_total)
{
    struct real_exec *x = ctx;
    return kvs_runner_kv_footprint(x->runner, n_tokens, chunk, host_avail, host_pages, host_free, host_total);
}

static int real_sampler_init(void *ctx, void *state, const struct kvs_sampling *p, uint64_t request_id)
{
    struct real_exec *x = ctx;
    char err[256];
    int rc = kvs_sampler_init(state, p, request_id, x->vocab, err, sizeof err);
    if (rc < 0) kvs_log(KVS_LOG_DEBUG, "engine: sampler init: %s", err);
    return rc;
}

static int real_sample(void *ctx, void *state, float *logits, const int32_t *tokens, int n_prompt, int n_tokens,
                       int want_logprobs, int want_top, struct kvs_sample_out *out)
{
    (void)ctx, (void)want_logprobs;
    struct kvs_sample_result res;
    int rc = kvs_sampler_sample(state, logits, tokens, n_prompt, n_tokens, &res);
    if (rc < 0) return rc;
    out->token = res.token;
    out->logprob = res.logprob;
    out->n_top = res.n_top < want_top ? res.n_top : want_top;
    if (out->n_top > KVS_MAX_TOP_LOGPROBS) out->n_top = KVS_MAX_TOP_LOGPROBS;
    if (out->n_top < 0) out->n_top = 0;
    memcpy(out->top_ids, res.top_ids, (size_t)out->n_top * sizeof *out->top_ids);
    memcpy(out->top_logprobs, res.top_logprobs, (size_t)out->n_top * sizeof *out->top_logprobs);
    return 0;
}

/* the real sampler's greedy pick is argmax_rows' (sampler.h kvs_sampler_is_argmax) */
static int real_sample_is_argmax(void *ctx, const void *state)
{
    (void)ctx;
    return kvs_sampler_is_argmax(state);
}

static void real_sampler_free(void *ctx, void *state)
{
    (void)ctx;
    kvs_sampler_free(state);
}

static void null_detok_init(struct kvs_detok *d, const struct kvs_tokenizer *t, int skip_special)
{
    memset(d, 0, sizeof *d);
    d->tok = t;
    d->skip_special = skip_special;
}

static int null_detok_feed(struct kvs_detok *d, int32_t id, char *out, size_t cap)
{
    (void)id;
    if (cap < 1) return -ENOSPC;
    out[0] = 0;
    d->n_seen++;
    return 0;
}

static int null_detok_flush(struct kvs_detok *d, char *out, size_t cap)
{
    (void)d;
    if (cap < 1) return -ENOSPC;
    out[0] = 0;
    return 0;
}

static void real_destroy(void *ctx)
{
    struct real_exec *x = ctx;
    kvs_runner_free(x->runner);
    free(x);
}

static int add_eos(struct real_exec *x, int n, int32_t id)
{
    if (id < 0 || n >= (int)(sizeof x->eos / sizeof *x->eos)) return n;
    for (int i = 0; i < n; i++)
        if (x->eos[i] == id) return n;
    x->eos[n] = id;
    return n + 1;
}

int kvs_engine_create(const struct kvs_config *cfg, const struct kvs_model *model, const struct kvs_tokenizer *tok,
                      struct kvs_engine **out, char *err, size_t errlen)
{
    *out = NULL;
    if (!cfg || !model) return kvs_err(err, errlen, -EINVAL, "engine: no config or model");
    struct real_exec *rx = calloc(1, sizeof *rx);
    if (!rx) return kvs_err(err, errlen, -ENOMEM, "engine: out of memory");
    int rc = kvs_runner_create(cfg, model, &rx->runner, err, errlen);
    if (rc < 0) {
        free(rx);
        return rc;
    }
    rx->vocab = kvs_runner_vocab_size(rx->runner);
    int n_eos = 0;
    const struct kvs_model_config *mc = kvs_model_config(model);
    for (int i = 0; i < mc->n_eos; i++) n_eos = add_eos(rx, n_eos, mc->eos_token_ids[i]);
    if (tok) {
        const int32_t *ids = NULL;
        int n = kvs_tokenizer_eos(tok, &ids);
        for (int i = 0; i < n; i++) n_eos = add_eos(rx, n_eos, ids[i]);
    }

    struct kvs_engine_exec x;
    memset(&x, 0, sizeof x);
    x.ctx = rx;
    x.backend_name = kvs_runner_backend_name(rx->runner);
    x.n_blocks = kvs_runner_num_blocks(rx->runner);
    x.block_size = kvs_runner_block_size(rx->runner);
    x.vocab_size = rx->vocab;
    x.max_context = kvs_runner_max_context(rx->runner);
    x.kv_bytes_per_block = kvs_runner_kv_bytes_per_token(rx->runner) * (size_t)x.block_size;
    x.forward = real_forward;
    x.forward_begin = real_forward_begin;
    x.forward_end = real_forward_end;
    x.async_steps = kvs_runner_async_ok(rx->runner);
    x.seq_end = real_seq_end;
    x.kv_counters = real_kv_counters;
    x.kv_offloaded = real_kv_offloaded;
    x.kv_footprint = real_kv_footprint;
    x.sampler_state_size = sizeof(struct kvs_sampler);
    x.sampler_init = real_sampler_init;
    x.sample = real_sample;
    x.sampler_free = real_sampler_free;
    x.sample_is_argmax = real_sample_is_argmax;
    x.tok = tok;
    x.detok_init = tok ? kvs_detok_init : null_detok_init;
    x.detok_feed = tok ? kvs_detok_feed : null_detok_feed;
    x.detok_flush = tok ? kvs_detok_flush : null_detok_flush;
    x.eos_ids = rx->eos;
    x.n_eos = n_eos;
    x.destroy = real_destroy;
    rc = kvs_engine_create_exec(cfg, &x, out, err, errlen);
    if (rc < 0) real_destroy(rx);
    return rc;
}
