/* engine.c: engine lifetime (create over an exec table, free), submission with admission
 * control (queue limit, context limit), drain and the stats snapshot. The step loop itself is
 * in scheduler.c; kvs_engine_create over the real runner/sampler/tokenizer in engine_create.c. */
#include "engine/engine_internal.h"

#include "engine/config.h"
#include "base/util.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

/* The engine's own arrays and the engine itself: the last step of both a failed create and
 * kvs_engine_free (free(NULL) is fine for arrays a failed create never reached). */
static void free_engine_memory(struct kvs_engine *e)
{
    free(e->eos_ids);
    free(e->running);
    free(e->sched);
    free(e->seqs);
    free(e->p_sched);
    free(e->p_seqs);
    free(e->jobs);
    free(e->free_slots);
    free(e->logits);
    free(e->argmax);
    free(e->piece);
    free(e->deferred);
    free(e->deferred_so);
    if (e->trace) fclose(e->trace);
    free(e);
}

int kvs_engine_create_exec(const struct kvs_config *cfg, const struct kvs_engine_exec *x, struct kvs_engine **out,
                           char *err, size_t errlen)
{
    *out = NULL;
    if (!cfg || !x || !x->forward || !x->sample || !x->detok_init || !x->detok_feed || !x->detok_flush)
        return kvs_err(err, errlen, -EINVAL, "engine: incomplete executor table");
    if (x->n_blocks <= 0 || x->block_size <= 0 || x->vocab_size <= 0 || x->max_context <= 0)
        return kvs_err(err, errlen, -EINVAL, "engine: executor reports %d blocks of %d tokens, vocab %d, context %d",
                       x->n_blocks, x->block_size, x->vocab_size, x->max_context);
    if (cfg->max_batch_tokens <= 0) return kvs_err(err, errlen, -EINVAL, "scheduler.max_batch_tokens must be > 0");
    if (cfg->max_running <= 0) return kvs_err(err, errlen, -EINVAL, "scheduler.max_running must be > 0");
    if (cfg->max_waiting < 0) return kvs_err(err, errlen, -EINVAL, "scheduler.max_waiting must be >= 0");
    if (cfg->prefill_chunk < 0) return kvs_err(err, errlen, -EINVAL, "scheduler.prefill_chunk must be >= 0");

    struct kvs_engine *e = calloc(1, sizeof *e);
    if (!e) return kvs_err(err, errlen, -ENOMEM, "engine: out of memory");
    e->x = *x;
    e->max_batch_tokens = cfg->max_batch_tokens;
    e->max_running = cfg->max_running;
    e->max_waiting = cfg->max_waiting;
    e->prefill_chunk = cfg->prefill_chunk > 0 ? cfg->prefill_chunk : cfg->max_batch_tokens;
    if (e->prefill_chunk > e->max_batch_tokens) e->prefill_chunk = e->max_batch_tokens;
    /* one request must always fit the pool on its own, or preemption could not guarantee progress */
    int64_t pool_tokens = (int64_t)x->n_blocks * x->block_size;
    e->max_context = x->max_context;
    if (cfg->max_model_len > 0 && cfg->max_model_len < e->max_context) e->max_context = cfg->max_model_len;
    if (pool_tokens < e->max_context) {
        /* a decode policy that keeps part of a request in memory of its own (kv.paris.offload)
         * bounds it by its peak in the pool instead: the longest context whose peak fits */
        int hp = 0, hf = 0, ht = 0, lo = (int)pool_tokens, hi = e->max_context;
        if (x->kv_footprint && x->kv_footprint(x->ctx, lo, e->prefill_chunk, -1, &hp, &hf, &ht) >= 0) {
            while (lo < hi) {
                int mid = lo + (hi - lo + 1) / 2;
                if (x->kv_footprint(x->ctx, mid, e->prefill_chunk, ht, &hp, &hf, &ht) <= x->n_blocks) lo = mid;
                else hi = mid - 1;
            }
            if (lo < e->max_context)
                snprintf(e->ctx_note, sizeof e->ctx_note, " The KV memory sets this limit with "
                         "kv.paris.offload: a request keeps its retrieval zone in the host KV pool (%d pages of %d tokens, "
                         "kv.paris.host_bytes) and the rest in the GPU KV pool (%d blocks of %d tokens).",
                         ht, x->block_size, x->n_blocks, x->block_size);
        }
        e->max_context = lo;
    }
    /* keep ~1% of the pool for running decodes when admitting new prompts (fewer preemptions) */
    e->watermark_blocks = x->n_blocks / 100;
    e->overlap = cfg->sched_overlap;
    /* auto: only where the device runs the step behind the host's back (the CPU backend computes
     * it inside forward_begin, so there async would overlap nothing and emit each step's text a
     * step later) */
    const int async_forced = cfg->sched_async && !strcmp(cfg->sched_async, "true");
    const int async_auto = cfg->sched_async && !strcmp(cfg->sched_async, "auto") && x->backend_name &&
                           strcmp(x->backend_name, "cpu") != 0;
    e->async = (async_forced || async_auto) && x->async_steps && x->forward_begin && x->forward_end;
    if (async_forced && !e->async)
        kvs_log(KVS_LOG_INFO, "engine: scheduler.async is not available with this runner (tensor parallelism, a decode "
                "policy with multi-row decode or host offload, or a backend without the ops): scheduler.overlap runs");
    kvs_prefill_ctl_init(&e->pctl, cfg->itl_ratio, cfg->prefill_min, e->max_batch_tokens);

    int rc = -ENOMEM;
    e->n_eos = x->n_eos > 0 && x->eos_ids ? x->n_eos : 0;
    e->eos_ids = calloc((size_t)e->n_eos + 1, sizeof *e->eos_ids);
    e->running = calloc((size_t)e->max_running, sizeof *e->running);
    e->sched = calloc((size_t)e->max_running, sizeof *e->sched);
    e->seqs = calloc((size_t)e->max_running, sizeof *e->seqs);
    e->p_sched = calloc((size_t)e->max_running, sizeof *e->p_sched);
    e->p_seqs = calloc((size_t)e->max_running, sizeof *e->p_seqs);
    e->jobs = calloc((size_t)e->max_running, sizeof *e->jobs);
    e->free_slots = calloc((size_t)e->max_running, sizeof *e->free_slots);
    e->logits = malloc((size_t)(e->max_running + KVS_PROMPT_LP_ROWS) * (size_t)x->vocab_size * sizeof *e->logits);
    e->argmax = malloc((size_t)(e->max_running + KVS_PROMPT_LP_ROWS) * sizeof *e->argmax);
    e->deferred = calloc((size_t)e->max_running, sizeof *e->deferred);
    e->deferred_so = calloc((size_t)e->max_running, sizeof *e->deferred_so);
    e->piece_cap = 4096;
    e->piece = malloc(e->piece_cap);
    if (!e->eos_ids || !e->running || !e->sched || !e->seqs || !e->p_sched || !e->p_seqs || !e->jobs || !e->free_slots || !e->logits || !e->argmax || !e->piece ||
        !e->deferred || !e->deferred_so) {
        kvs_err(err, errlen, rc, "engine: cannot allocate scheduler buffers (max_running=%d, vocab=%d)",
                e->max_running, x->vocab_size);
        goto fail;
    }
    if (e->n_eos) memcpy(e->eos_ids, x->eos_ids, (size_t)e->n_eos * sizeof *e->eos_ids);
    rc = kvs_block_pool_init(&e->pool, x->n_blocks, x->block_size);
    if (rc < 0) {
        kvs_err(err, errlen, rc, "engine: cannot allocate the block pool (%d blocks)", x->n_blocks);
        goto fail;
    }
    /* request slots for the decode policy's per-request state, lowest first */
    for (int i = 0; i < e->max_running; i++) e->free_slots[i] = e->max_running - 1 - i;
    e->n_free_slots = e->max_running;
    rc = kvs_kv_init(&e->kv, cfg, &e->pool, x->kv_bytes_per_block, err, errlen);
    if (rc < 0) goto fail;
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->cv, NULL);
    e->stats.kv_blocks_total = x->n_blocks;
    e->stats.block_size = x->block_size;
    e->counters = e->stats;
    /* a per-step timeline for diagnosis (scheduler.c step_trace): where a serving run's time
     * goes between the steps, without a profiler */
    const char *trace = getenv("KVS_STEP_TRACE");
    if (trace && *trace) {
        e->trace = fopen(trace, "w");
        if (!e->trace) kvs_log(KVS_LOG_WARN, "engine: KVS_STEP_TRACE: cannot open '%s': %s", trace, strerror(errno));
        else fputs("# step t_sched t_begin t_launched t_end t_applied (ms since start) seqs decode_rows prefill_tokens\n",
                   e->trace);
        e->trace_t0 = kvs_now();
    }
    rc = pthread_create(&e->thread, NULL, kvs_scheduler_main, e);
    if (rc != 0) {
        kvs_err(err, errlen, -rc, "engine: cannot start the scheduler thread");
        rc = -rc;
        pthread_mutex_destroy(&e->mu);
        pthread_cond_destroy(&e->cv);
        goto fail;
    }
    e->thread_started = 1;
    kvs_log(KVS_LOG_INFO,
            "engine: %d KV blocks x %d tokens (%s storage, reuse %s, decode %s), max_running %d, "
            "max_batch_tokens %d, prefill_chunk %d, max_waiting %d, context %d",
            x->n_blocks, x->block_size, e->kv.storage->name, e->kv.reuse->name, e->kv.decode->name, e->max_running,
            e->max_batch_tokens, e->prefill_chunk, e->max_waiting, e->max_context);
    *out = e;
    return 0;
fail:
    if (e->kv.reuse) kvs_kv_free(&e->kv);
    if (e->pool.refcount) kvs_block_pool_free(&e->pool);
    free_engine_memory(e);
    return rc;
}

void kvs_engine_free(struct kvs_engine *e)
{
    if (!e) return;
    if (e->thread_started) {
        pthread_mutex_lock(&e->mu);
        e->stop = 1;
        pthread_cond_broadcast(&e->cv);
        pthread_mutex_unlock(&e->mu);
        pthread_join(e->thread, NULL);
    }
    /* the scheduler thread ended every request it knew; end the ones still incoming */
    for (;;) {
        pthread_mutex_lock(&e->mu);
        struct kvs_request *r = e->in_head;
        if (r) {
            e->in_head = r->next;
            if (!e->in_head) e->in_tail = NULL;
            e->n_incoming--;
            r->next = r->prev = NULL;
        }
        pthread_mutex_unlock(&e->mu);
        if (!r) break;
        kvs_scheduler_finish(e, r, KVS_FINISH_CANCELLED, NULL);
    }
    KVS_ASSERT(kvs_block_pool_used(&e->pool) == 0);
    kvs_kv_free(&e->kv);
    kvs_block_pool_free(&e->pool);
    if (e->x.destroy) e->x.destroy(e->x.ctx);
    pthread_mutex_destroy(&e->mu);
    pthread_cond_destroy(&e->cv);
    free_engine_memory(e);
}

void kvs_engine_drain(struct kvs_engine *e)
{
    pthread_mutex_lock(&e->mu);
    e->draining = 1;
    pthread_mutex_unlock(&e->mu);
}

int kvs_engine_max_context(const struct kvs_engine *e) { return e->max_context; }
const char *kvs_engine_context_note(const struct kvs_engine *e) { return e->ctx_note; }

void kvs_engine_stats(struct kvs_engine *e, struct kvs_engine_stats *out)
{
    pthread_mutex_lock(&e->mu);
    *out = e->stats;
    out->num_waiting += e->n_incoming;
    pthread_mutex_unlock(&e->mu);
}

int kvs_engine_doc_layout(const struct kvs_engine *e, int *align)
{
    const int seg = e->kv.reuse->doc_segments;
    *align = seg ? e->x.block_size : 1;
    return seg;
}

double kvs_engine_kv_counter(const struct kvs_engine_stats *st, const char *name)
{
    for (int i = 0; i < st->n_kv_counters; i++)
        if (!strcmp(st->kv_counters[i].name, name) && !st->kv_counters[i].le) return st->kv_counters[i].value;
    return 0.0;
}

static int is_member(const int32_t *ids, int n, int32_t id)
{
    for (int i = 0; i < n; i++)
        if (ids[i] == id) return 1;
    return 0;
}

/* Per-request allocations happen here, on the caller's thread, so the step never allocates
 * for admission. */
static int prepare(struct kvs_engine *e, struct kvs_request *r, char *err, size_t errlen)
{
    int total = r->n_full_prompt + r->max_tokens;
    r->tokens = malloc((size_t)total * sizeof *r->tokens);
    r->text_cap = r->max_stop_len + (int)e->piece_cap + 8;
    r->text = malloc((size_t)r->text_cap);
    r->sampler = calloc(1, e->x.sampler_state_size ? e->x.sampler_state_size : 1);
    int rc = kvs_block_table_init(&r->table, total, e->x.block_size);
    if (!r->tokens || !r->text || !r->sampler || rc < 0) {
        kvs_request_release_engine_state(r, NULL);
        return kvs_err(err, errlen, -ENOMEM, "out of memory for the request");
    }
    if (e->x.sampler_init) {
        rc = e->x.sampler_init(e->x.ctx, r->sampler, &r->sampling, r->id);
        if (rc < 0) {
            free(r->sampler);   /* not initialised: no sampler_free */
            r->sampler = NULL;
            kvs_request_release_engine_state(r, NULL);
            return kvs_err(err, errlen, rc, "invalid sampling parameters");
        }
    }
    /* documents first (as segments of their own when the reuse strategy says so, each padded
     * to a block boundary; the padding slots
     * are never computed or attended; they repeat the document's last token, so that the
     * sampler's prompt-token set (repetition penalty) is exactly the real prompt's), then the
     * request's own prompt */
    int at = 0, bs = e->x.block_size;
    const int32_t *dt = r->doc_tokens;
    for (int d = 0; d < r->n_docs; d++) {
        memcpy(r->tokens + at, dt, (size_t)r->doc_len[d] * sizeof *r->tokens);
        at += r->doc_len[d];
        dt += r->doc_len[d];
        if (e->kv.reuse->doc_segments)
            for (; at % bs; at++) r->tokens[at] = r->tokens[at - 1];
    }
    memcpy(r->tokens + at, r->prompt, (size_t)r->n_prompt * sizeof *r->tokens);
    KVS_ASSERT(at + r->n_prompt == r->n_full_prompt);
    r->n_tokens = r->n_full_prompt;
    r->slot = -1;
    r->kv_reuse = e->kv.reuse;
    if (e->kv.reuse->seq_init) {
        rc = e->kv.reuse->seq_init(&e->kv, &r->kvrq, r->doc_len, r->n_docs, r->table.cap, err, errlen);
        if (rc < 0) {
            kvs_request_release_engine_state(r, NULL);
            return rc;
        }
    }
    /* EOS ids join the request's stop ids unless ignore_eos */
    if (!r->ignore_eos && e->n_eos) {
        int32_t *s = realloc(r->stop_ids, (size_t)(r->n_stop_ids + e->n_eos) * sizeof *s);
        if (!s) {
            kvs_request_release_engine_state(r, e);
            return kvs_err(err, errlen, -ENOMEM, "out of memory for the request");
        }
        r->stop_ids = s;
        for (int i = 0; i < e->n_eos; i++)
            if (!is_member(r->stop_ids, r->n_stop_ids, e->eos_ids[i])) r->stop_ids[r->n_stop_ids++] = e->eos_ids[i];
    }
    e->x.detok_init(&r->detok, e->x.tok, r->skip_special);
    return 0;
}

static int submit(struct kvs_engine *e, struct kvs_request *r, char *err, size_t errlen);

int kvs_engine_submit(struct kvs_engine *e, struct kvs_request *r, char *err, size_t errlen)
{
    if (!e || !r) return kvs_err(err, errlen, -EINVAL, "no engine or request");
    /* claim the request first: the engine thread owns its state once it is queued */
    if (atomic_exchange(&r->submitted, 1))
        return kvs_err(err, errlen, -EINVAL, "request %llu was already submitted", (unsigned long long)r->id);
    int rc = submit(e, r, err, errlen);
    if (rc < 0) atomic_store(&r->submitted, 0);   /* refused: the caller may submit it again */
    return rc;
}

static int submit(struct kvs_engine *e, struct kvs_request *r, char *err, size_t errlen)
{
    if (r->n_prompt <= 0) return kvs_err(err, errlen, -EINVAL, "the prompt is empty");
    /* documents: checked here, laid out by prepare */
    int64_t full = r->n_prompt, real = r->n_prompt;
    const int32_t *dt = r->doc_tokens;
    for (int d = 0; d < r->n_docs; d++) {
        if (r->doc_len[d] <= 0) return kvs_err(err, errlen, -EINVAL, "document %d is empty", d);
        for (int i = 0; i < r->doc_len[d]; i++)
            if (dt[i] < 0 || dt[i] >= e->x.vocab_size)
                return kvs_err(err, errlen, -EINVAL, "document %d: token %d at index %d is outside the vocabulary (0..%d)",
                               d, dt[i], i, e->x.vocab_size - 1);
        dt += r->doc_len[d];
        int bs = e->x.block_size;
        full += e->kv.reuse->doc_segments ? ((int64_t)r->doc_len[d] + bs - 1) / bs * bs : r->doc_len[d];
        real += r->doc_len[d];
        if (full > INT32_MAX / 2) return kvs_err(err, errlen, -E2BIG, "the documents are too long");
    }
    if (r->max_tokens < 0 || (r->max_tokens == 0 && !r->prompt_logprobs))
        return kvs_err(err, errlen, -EINVAL, "max_tokens must be > 0 (got %d)", r->max_tokens);
    if (r->prompt_logprobs && r->n_docs && e->kv.reuse->doc_segments)
        return kvs_err(err, errlen, -ENOSYS, "prompt logprobs (echo) are not available for requests whose documents "
                                             "are cached segments (kv.reuse=%s)", e->kv.reuse->name);
    for (int i = 0; i < r->n_prompt; i++)
        if (r->prompt[i] < 0 || r->prompt[i] >= e->x.vocab_size)
            return kvs_err(err, errlen, -EINVAL, "prompt token %d at index %d is outside the vocabulary (0..%d)",
                           r->prompt[i], i, e->x.vocab_size - 1);
    const struct kvs_sampling *s = &r->sampling;
    /* the sampler's init checks the rest of the sampling parameters */
    if (!(s->temperature >= 0) || s->top_k < 0 || s->top_logprobs < 0 || s->top_logprobs > KVS_MAX_TOP_LOGPROBS)
        return kvs_err(err, errlen, -EINVAL,
                       "invalid sampling parameters (temperature >= 0, top_k >= 0, 0 <= top_logprobs <= %d)",
                       KVS_MAX_TOP_LOGPROBS);
    for (int i = 0; i < s->n_logit_bias; i++)
        if (s->logit_bias_ids[i] < 0 || s->logit_bias_ids[i] >= e->x.vocab_size)
            return kvs_err(err, errlen, -EINVAL, "logit_bias token %d is outside the vocabulary", s->logit_bias_ids[i]);
    if (full + r->max_tokens > e->max_context)
        return kvs_err(err, errlen, -E2BIG,
                       "This model's maximum context length is %d tokens. However, you requested %lld tokens "
                       "(%lld in the messages%s, %d in the completion).%s",
                       e->max_context, (long long)full + r->max_tokens, (long long)full,
                       full != real ? " and documents, padded to KV blocks" : "", r->max_tokens, e->ctx_note);
    r->n_full_prompt = (int)full;
    r->n_real_prompt = (int)real;
    /* cheap checks under the lock first so that a full queue answers at once */
    pthread_mutex_lock(&e->mu);
    int rc = 0;
    if (e->draining || e->stop) rc = kvs_err(err, errlen, -ESHUTDOWN, "the server is shutting down");
    else if (e->stats.num_waiting + e->n_incoming >= e->max_waiting) {
        rc = kvs_err(err, errlen, -EAGAIN, "too many requests waiting (%d)", e->max_waiting);
        e->stats.requests_rejected++;
    }
    pthread_mutex_unlock(&e->mu);
    if (rc < 0) return rc;
    rc = prepare(e, r, err, errlen);
    if (rc < 0) return rc;

    pthread_mutex_lock(&e->mu);
    if (e->draining || e->stop) rc = kvs_err(err, errlen, -ESHUTDOWN, "the server is shutting down");
    else if (e->stats.num_waiting + e->n_incoming >= e->max_waiting) {
        rc = kvs_err(err, errlen, -EAGAIN, "too many requests waiting (%d)", e->max_waiting);
        e->stats.requests_rejected++;
    }
    if (rc == 0) {
        kvs_request_ref(r);
        r->state = KVS_REQ_INCOMING;
        r->t_submit = kvs_now();
        r->next = NULL;
        r->prev = e->in_tail;
        if (e->in_tail) e->in_tail->next = r; else e->in_head = r;
        e->in_tail = r;
        e->n_incoming++;
        pthread_cond_broadcast(&e->cv);
    }
    pthread_mutex_unlock(&e->mu);
    if (rc < 0) kvs_request_release_engine_state(r, e);
    return rc;
}
