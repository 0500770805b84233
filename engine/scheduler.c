/* scheduler.c: the engine thread: iteration-level continuous batching over the paged KV cache.
 *
 * Each step:
 *   1. picks up submitted requests (FCFS waiting queue) and ends cancelled / timed-out ones;
 *   2. builds one mixed batch under max_batch_tokens and max_running: first one decode token
 *      for every running request whose prompt is done, then prefill chunks (<= prefill_chunk
 *      tokens) of partially prefilled running requests, then admits waiting requests in order
 *      while KV blocks last (no skipping ahead: FCFS);
 *   3. when a running request needs a block and none is free (or evictable from the reuse
 *      strategy's cache), preempts the newest running request: its blocks return to the pool and it goes
 *      back to the front of the waiting queue, to be recomputed later from prompt + generated
 *      tokens (its sampler and detokenizer state carry on, so greedy output is unchanged);
 *   4. runs the forward pass with no lock held;
 *   5. samples, detokenizes, matches stop ids / stop strings, and appends events.
 * Plain greedy requests (engine_exec.h sample_is_argmax) take a fast path: their row is a
 * KVS_LOGITS_ARGMAX row, whose token is picked on the backend and comes back as an id (the
 * [vocab] logits never reach the host), and it is emitted without calling the sampler; the
 * pick is the one the sampler would make, so the output is the same either way.
 * Requests that finish (EOS, stop, length, cancel, timeout, error) release their blocks at once.
 *
 * Events (what callers see, beyond engine.h):
 *   - every sampled token gets one TOKEN event, including a stop token (EOS or a stop id),
 *     which counts as a completion token (as vLLM does) but whose own text is never emitted;
 *     its event carries whatever text was still held back (usually "");
 *   - text that could be the start of a stop string is held back until resolved; at a stop
 *     string the text before it is emitted and the request ends STOP; on cancel / timeout
 *     held-back text is dropped;
 *   - NUL bytes are dropped from text (events carry C strings);
 *   - the stats snapshot already shows a request's blocks free when its final event arrives.
 */
#include "engine/engine_internal.h"

#include "base/util.h"

#include <math.h>
#include <string.h>

/* ---- lists ------------------------------------------------------------------------------- */

static void wait_remove(struct kvs_engine *e, struct kvs_request *r)
{
    if (r->prev) r->prev->next = r->next; else e->wait_head = r->next;
    if (r->next) r->next->prev = r->prev; else e->wait_tail = r->prev;
    r->next = r->prev = NULL;
    e->n_waiting--;
}

static void wait_push_back(struct kvs_engine *e, struct kvs_request *r)
{
    r->next = NULL;
    r->prev = e->wait_tail;
    if (e->wait_tail) e->wait_tail->next = r; else e->wait_head = r;
    e->wait_tail = r;
    e->n_waiting++;
}

static void wait_push_front(struct kvs_engine *e, struct kvs_request *r)
{
    r->prev = NULL;
    r->next = e->wait_head;
    if (e->wait_head) e->wait_head->prev = r; else e->wait_tail = r;
    e->wait_head = r;
    e->n_waiting++;
}

static void running_remove(struct kvs_engine *e, struct kvs_request *r)
{
    int i = 0;
    while (i < e->n_running && e->running[i] != r) i++;
    KVS_ASSERT(i < e->n_running);
    memmove(e->running + i, e->running + i + 1, (size_t)(e->n_running - i - 1) * sizeof *e->running);
    e->n_running--;
}

/* ---- events ------------------------------------------------------------------------------ */

static void notify(struct kvs_request *r)
{
    if (r->notify) r->notify(r->user);
}

static char *dup_n(const char *s, int n)
{
    char *d = malloc((size_t)n + 1);
    if (!d) return NULL;
    memcpy(d, s, (size_t)n);
    d[n] = 0;
    return d;
}

static void publish_stats(struct kvs_engine *e);

/* Gives back everything r holds in the KV cache: its block references, then what the reuse
 * strategy holds for it (after the blocks, so that blocks the strategy frees with its last
 * user are already unreferenced), and its request slot. */
static void release_kv(struct kvs_engine *e, struct kvs_request *r)
{
    if (r->table.n) kvs_block_table_release(&r->table, &e->pool);
    if (e->kv.reuse->release) e->kv.reuse->release(&e->kv, &r->kvrq);
    if (r->slot >= 0) {
        if (e->x.seq_end) e->x.seq_end(e->x.ctx, r->slot);
        e->free_slots[e->n_free_slots++] = r->slot;
        r->slot = -1;
    }
}

/* 1 when the reuse strategy lets r run (its side prefills are done) */
static int kv_ready(struct kvs_engine *e, struct kvs_request *r)
{
    return !e->kv.reuse->ready || e->kv.reuse->ready(&e->kv, &r->kvrq);
}

/* Takes r's token off the deferred list without emitting it. */
static void drop_deferred(struct kvs_engine *e, struct kvs_request *r)
{
    int i = 0;
    while (i < e->n_deferred && e->deferred[i] != r) i++;
    KVS_ASSERT(i < e->n_deferred);
    memmove(e->deferred + i, e->deferred + i + 1, (size_t)(e->n_deferred - i - 1) * sizeof *e->deferred);
    memmove(e->deferred_so + i, e->deferred_so + i + 1, (size_t)(e->n_deferred - i - 1) * sizeof *e->deferred_so);
    e->n_deferred--;
    r->emit_pending = 0;
}

void kvs_scheduler_finish(struct kvs_engine *e, struct kvs_request *r, enum kvs_finish why, const char *msg)
{
    double now = kvs_now();
    if (r->emit_pending) drop_deferred(e, r);   /* every path that must emit it did so first */
    if (r->state == KVS_REQ_RUNNING) running_remove(e, r);
    else if (r->state == KVS_REQ_WAITING) wait_remove(e, r);
    release_kv(e, r);
    struct kvs_event ev;
    memset(&ev, 0, sizeof ev);
    ev.type = msg ? KVS_EV_ERROR : KVS_EV_DONE;
    ev.finish = msg ? KVS_FINISH_ERROR : why;
    if (msg) ev.error = strdup(msg);
    ev.n_prompt_tokens = r->n_real_prompt;
    ev.n_completion_tokens = r->n_gen;
    ev.n_cached_tokens = r->n_cached_tokens;
    ev.queue_time_s = (r->t_first_sched > 0 ? r->t_first_sched : now) - r->t_submit;
    ev.ttft_s = r->t_first_token > 0 ? r->t_first_token - r->t_submit : 0;
    ev.e2e_s = now - r->t_submit;
    r->state = KVS_REQ_FINISHED;
    r->sched_tokens = 0;
    e->counters.requests_finished++;
    kvs_request_release_engine_state(r, e);
    /* the snapshot shows the blocks free and the request gone before its final event is seen */
    publish_stats(e);
    if (kvs_request_push_event(r, &ev) < 0) {
        kvs_log(KVS_LOG_ERROR, "engine: out of memory queueing the final event of request %llu",
                (unsigned long long)r->id);
        kvs_event_clear(&ev);
    }
    notify(r);
    kvs_request_unref(r);
}

static int is_member(const int32_t *ids, int n, int32_t id)
{
    for (int i = 0; i < n; i++)
        if (ids[i] == id) return 1;
    return 0;
}

/* Earliest occurrence of any stop string in buf[0..n), or -1. */
static int find_stop(const struct kvs_request *r, const char *buf, int n)
{
    int best = -1;
    for (int i = 0; i < r->n_stop_strings; i++) {
        const char *p = memmem(buf, (size_t)n, r->stop_strings[i], strlen(r->stop_strings[i]));
        if (p && (best < 0 || p - buf < best)) best = (int)(p - buf);
    }
    return best;
}

/* Length of the longest suffix of buf[0..n) that is a proper prefix of some stop string: that
 * text must be held back until the next tokens show whether the stop string completes. */
static int holdback(const struct kvs_request *r, const char *buf, int n)
{
    int maxk = r->max_stop_len - 1 < n ? r->max_stop_len - 1 : n;
    for (int k = maxk; k > 0; k--)
        for (int i = 0; i < r->n_stop_strings; i++)
            if ((int)strlen(r->stop_strings[i]) > k && memcmp(buf + n - k, r->stop_strings[i], (size_t)k) == 0)
                return k;
    return 0;
}

/* Appends the detokenizer's n bytes to the held text. Event text is a C string, so a NUL byte
 * in the decoded text (the byte-level token for 0x00) is dropped rather than cutting the
 * delta short. */
static int append_text(struct kvs_engine *e, struct kvs_request *r, int n)
{
    if (n <= 0) return 0;
    if (r->n_text + n > r->text_cap) return -ENOSPC;   /* cannot happen: held < max_stop_len */
    for (int i = 0; i < n; i++)
        if (e->piece[i]) r->text[r->n_text++] = e->piece[i];
    return 0;
}

/* Appends r's newly sampled token and counts it. Returns 1 when it ends the request (a stop
 * id, max_tokens, the context), with the reason in *why; its text is emit_text's job. */
static int apply_token(struct kvs_engine *e, struct kvs_request *r, int32_t tok, double now, enum kvs_finish *why)
{
    KVS_ASSERT(r->n_tokens < r->n_full_prompt + r->max_tokens);
    r->tokens[r->n_tokens++] = tok;
    r->n_gen++;
    e->counters.generation_tokens++;
    if (r->t_first_token == 0) r->t_first_token = now;
    int is_stop = is_member(r->stop_ids, r->n_stop_ids, tok);
    *why = is_stop ? KVS_FINISH_STOP : KVS_FINISH_LENGTH;
    return is_stop || r->n_gen >= r->max_tokens || r->n_tokens >= e->max_context;
}

/* Ends r now, or, when r is in the step the device is running (scheduler.overlap: its text is
 * emitted during that step), once the step is back; that step's token for r is dropped. */
static void end_request(struct kvs_engine *e, struct kvs_request *r, enum kvs_finish why, const char *msg)
{
    if ((e->in_flight && r->sched_tokens > 0) || r->n_inflight > 0) {   /* n_inflight: scheduler.async */
        r->finish_pending = 1;
        r->pend_why = why;
        r->pend_msg = msg;
        notify(r);   /* the TOKEN event already queued goes out now */
        return;
    }
    kvs_scheduler_finish(e, r, why, msg);
}

/* The text delta and TOKEN event of r's last token (apply_token's; final and why are what it
 * returned): stop strings, held-back text, the final flush. Returns 1 when the request ended
 * (or will: end_request), 0 otherwise. */
static int emit_text(struct kvs_engine *e, struct kvs_request *r, const struct kvs_sample_out *so, int final,
                     enum kvs_finish why)
{
    int32_t tok = r->tokens[r->n_tokens - 1];
    int is_stop = final && why == KVS_FINISH_STOP;

    /* a stop token's own text is never emitted; what the detokenizer still holds is */
    int n = 0;
    if (!is_stop) n = e->x.detok_feed(&r->detok, tok, e->piece, e->piece_cap);
    if (n >= 0 && append_text(e, r, n) < 0) n = -ENOSPC;
    if (n >= 0 && final) {
        n = e->x.detok_flush(&r->detok, e->piece, e->piece_cap);
        if (n >= 0 && append_text(e, r, n) < 0) n = -ENOSPC;
    }
    if (n < 0) {
        end_request(e, r, KVS_FINISH_ERROR, "detokenizer output does not fit its buffer");
        return 1;
    }
    int emit = r->n_text;
    int stop_at = r->n_stop_strings ? find_stop(r, r->text, r->n_text) : -1;
    if (stop_at >= 0) {
        emit = stop_at;
        final = 1;
        why = KVS_FINISH_STOP;
    } else if (!final && r->n_stop_strings) {
        emit = r->n_text - holdback(r, r->text, r->n_text);
    }

    struct kvs_event ev;
    memset(&ev, 0, sizeof ev);
    ev.type = KVS_EV_TOKEN;
    ev.token = tok;
    ev.text = dup_n(r->text, emit);
    ev.logprob = so->logprob;
    ev.n_top = so->n_top;
    if (ev.n_top > 0) {
        memcpy(ev.top_ids, so->top_ids, (size_t)ev.n_top * sizeof *ev.top_ids);
        memcpy(ev.top_logprobs, so->top_logprobs, (size_t)ev.n_top * sizeof *ev.top_logprobs);
    }
    memmove(r->text, r->text + emit, (size_t)(r->n_text - emit));
    r->n_text -= emit;
    if (!ev.text || kvs_request_push_event(r, &ev) < 0) {
        kvs_event_clear(&ev);
        end_request(e, r, KVS_FINISH_ERROR, "out of memory queueing a token event");
        return 1;
    }
    if (final) {
        end_request(e, r, why, NULL);
        return 1;
    }
    notify(r);
    return 0;
}

/* Emits r's deferred token now (r is in no running step); 1 when that ended r. */
static int emit_deferred_one(struct kvs_engine *e, struct kvs_request *r)
{
    int i = 0;
    while (i < e->n_deferred && e->deferred[i] != r) i++;
    KVS_ASSERT(i < e->n_deferred);
    struct kvs_sample_out so = e->deferred_so[i];
    drop_deferred(e, r);
    return emit_text(e, r, &so, 0, KVS_FINISH_LENGTH);
}

/* Emits the tokens whose text was deferred (scheduler.overlap), oldest first. */
static void flush_deferred(struct kvs_engine *e)
{
    for (int i = 0; i < e->n_deferred; i++) {
        struct kvs_request *r = e->deferred[i];
        if (!r) continue;   /* taken off while this ran */
        r->emit_pending = 0;
        e->deferred[i] = NULL;
        emit_text(e, r, &e->deferred_so[i], 0, KVS_FINISH_LENGTH);
    }
    e->n_deferred = 0;
}

/* ---- prompt scoring (prompt_logprobs: echo with logprobs) -------------------------------- */

static int plp_pending(const struct kvs_request *r)
{
    return r->prompt_logprobs && r->n_prompt_lp < r->n_full_prompt;
}

/* A chunk of a request still scoring its prompt returns one logits row per token: capped to the
 * step's remaining KVS_PROMPT_LP_ROWS (0: not this step). */
static int plp_cap(const struct kvs_engine *e, const struct kvs_request *r, int c)
{
    if (!plp_pending(r)) return c;
    int room = KVS_PROMPT_LP_ROWS - e->plp_rows;
    return c < room ? c : room;
}

/* ev's logprob of ev->token and its n_top most likely alternatives under the raw row lg. */
static void prompt_logprob(const float *lg, int vocab, int n_top, struct kvs_event *ev)
{
    float mx = -INFINITY;
    for (int v = 0; v < vocab; v++)
        if (lg[v] > mx) mx = lg[v];
    double sum = 0;
    for (int v = 0; v < vocab; v++) sum += exp((double)lg[v] - mx);
    float lse = mx + (float)log(sum);
    ev->logprob = lg[ev->token] - lse;
    int n = 0;
    for (int v = 0; v < vocab && n_top > 0; v++) {
        float x = lg[v];
        if (!(x > -INFINITY) || (n == n_top && x <= ev->top_logprobs[n - 1] + lse)) continue;
        int at = n < n_top ? n++ : n - 1;   /* lowest id first among ties: strict > below */
        while (at > 0 && x > ev->top_logprobs[at - 1] + lse) {
            ev->top_logprobs[at] = ev->top_logprobs[at - 1];
            ev->top_ids[at] = ev->top_ids[at - 1];
            at--;
        }
        ev->top_logprobs[at] = x - lse;
        ev->top_ids[at] = v;
    }
    ev->n_top = n;
}

/* PROMPT events for the positions predicted by rows[0..c) (a chunk that started at start).
 * Returns 0, or -1 when r was ended (out of memory). */
static int score_prompt(struct kvs_engine *e, struct kvs_request *r, int start, int c, const float *rows)
{
    int emitted = 0;
    for (int i = 0; i < c; i++) {
        int pos = start + i + 1;
        if (pos < r->n_prompt_lp || pos >= r->n_full_prompt) continue;   /* scored before a preemption */
        struct kvs_event ev;
        memset(&ev, 0, sizeof ev);
        ev.type = KVS_EV_PROMPT;
        ev.pos = pos;
        ev.token = r->tokens[pos];
        prompt_logprob(rows + (size_t)i * (size_t)e->x.vocab_size, e->x.vocab_size, r->sampling.top_logprobs, &ev);
        if (kvs_request_push_event(r, &ev) < 0) {
            kvs_scheduler_finish(e, r, KVS_FINISH_ERROR, "out of memory queueing a prompt logprob event");
            return -1;
        }
        r->n_prompt_lp = pos + 1;
        emitted = 1;
    }
    if (emitted) notify(r);
    return 0;
}

/* ---- scheduling -------------------------------------------------------------------------- */

static void unschedule(struct kvs_engine *e, struct kvs_request *r, int *n_sched, int *budget)
{
    if (!r->sched_tokens) return;
    int i = 0;
    while (i < *n_sched && e->sched[i] != r) i++;
    KVS_ASSERT(i < *n_sched);
    memmove(e->sched + i, e->sched + i + 1, (size_t)(*n_sched - i - 1) * sizeof *e->sched);
    (*n_sched)--;
    *budget += r->sched_tokens;
    r->sched_tokens = 0;
}

static void preempt(struct kvs_engine *e, struct kvs_request *r, int *n_sched, int *budget)
{
    unschedule(e, r, n_sched, budget);
    running_remove(e, r);
    release_kv(e, r);
    r->n_computed = 0;
    r->state = KVS_REQ_WAITING;
    wait_push_front(e, r);
    e->counters.num_preemptions++;
    kvs_log(KVS_LOG_DEBUG, "engine: preempted request %llu (%d tokens to recompute)", (unsigned long long)r->id,
            r->n_tokens);
}

static int min3(int a, int b, int c)
{
    int m = a < b ? a : b;
    return m < c ? m : c;
}

/* Pool blocks request r still needs for all of its n_tokens: need (its blocks without offload),
 * or less when the decode policy keeps part of it in host pages (kv_footprint: its peak in the
 * pool with the host pages free now, less the blocks it holds) */
static int peak_need(struct kvs_engine *e, const struct kvs_request *r, int need)
{
    int hp, hf, ht;
    if (!e->x.kv_footprint || need <= 0) return need;
    int peak = e->x.kv_footprint(e->x.ctx, r->n_tokens, e->prefill_chunk, -1, &hp, &hf, &ht);
    if (peak < 0) return need;
    peak -= kvs_block_table_held(&r->table);
    return peak < 0 ? 0 : peak < need ? peak : need;
}

/* Chooses this step's batch into e->sched; returns its size. */
static int schedule(struct kvs_engine *e, double now)
{
    int bs = e->pool.block_size;
    int budget = e->max_batch_tokens;
    int n_sched = 0;
    int preempted = 0;
    e->plp_rows = 0;

    /* pass 0: decode tokens, pass 1: prefill chunks of running requests; oldest first. Prefill
     * (pass 1, admissions, side prefills) also spends pbudget: decode first, then what the
     * adaptive budget (sched_policy.h) allows next to this step's decodes */
    int pbudget = budget;
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1) pbudget = kvs_prefill_ctl_budget(&e->pctl, n_sched);
        for (int i = 0; i < e->n_running && budget > 0 && pbudget > 0; i++) {
            struct kvs_request *r = e->running[i];
            if (r->sched_tokens) continue;
            if (r->tok_final || r->finish_pending) continue;   /* scheduler.async: ending */
            if (!kv_ready(e, r)) continue;   /* the strategy's side prefills are not done */
            int remaining = r->n_tokens - r->n_computed;
            KVS_ASSERT(remaining >= 1);
            int is_decode = remaining == 1;
            if (is_decode != (pass == 0)) continue;
            int c = plp_cap(e, r, is_decode ? 1 : min3(remaining, e->prefill_chunk, budget < pbudget ? budget : pbudget));
            if (c <= 0) continue;   /* no scoring rows left this step */
            int dropped = 0;
            for (;;) {
                int need = kvs_block_table_blocks_needed(&r->table, bs, r->n_computed + c);
                int avail = kvs_block_pool_available(&e->pool);
                if (need <= avail) break;
                if (!is_decode) {
                    int fit = (r->table.n + avail) * bs - r->n_computed;
                    if (fit > 0) {
                        c = fit < c ? fit : c;
                        break;
                    }
                }
                struct kvs_request *victim = e->running[e->n_running - 1];
                preempt(e, victim, &n_sched, &budget);
                preempted = 1;
                if (victim == r) {
                    dropped = 1;
                    break;
                }
            }
            if (dropped) break;   /* r was the newest: nothing after it */
            int rc = kvs_block_table_reserve(&r->table, &e->pool, r->n_computed + c);
            KVS_ASSERT(rc == 0);
            r->sched_tokens = c;
            e->sched[n_sched++] = r;
            budget -= c;
            if (!is_decode) pbudget -= c;
            if (plp_pending(r)) e->plp_rows += c;
        }
    }

    /* admission: FCFS, only when nobody had to be preempted this step (the pool is tight), and
     * only when the whole prompt fits next to what running prompts still need plus a small
     * reserve for decodes; otherwise admitted prompts would preempt each other chunk by chunk */
    int promised = 0;
    for (int i = 0; !preempted && i < e->n_running; i++) {
        struct kvs_request *r = e->running[i];
        promised += peak_need(e, r, kvs_block_table_blocks_needed(&r->table, bs, r->n_tokens));
    }
    while (!preempted && e->wait_head && e->n_running < e->max_running && budget > 0 && pbudget > 0) {
        struct kvs_request *r = e->wait_head;
        if (r->n_inflight > 0) break;   /* preempted in a begun step (scheduler.async): once it is back */
        int matched = 0;
        if (r->table.n == 0) {
            /* a prompt being scored needs the logits of every position: no cache hits */
            int rc = plp_pending(r) ? 0 : e->kv.reuse->admit(&e->kv, &r->kvrq, r->tokens, r->n_tokens, &r->table, &matched);
            if (rc < 0) break;   /* the pool cannot hold what the strategy shares now: wait (FCFS) */
            r->n_computed = rc;
        }
        int remaining = r->n_tokens - r->n_computed;
        int c = plp_cap(e, r, min3(remaining, e->prefill_chunk, budget < pbudget ? budget : pbudget));
        if (c <= 0) {
            release_kv(e, r);
            r->n_computed = 0;
            break;
        }
        int need = kvs_block_table_blocks_needed(&r->table, bs, r->n_computed + c);
        int avail = kvs_block_pool_available(&e->pool);
        int reserve = e->n_running > 0 ? e->watermark_blocks + promised : 0;
        int need_all = peak_need(e, r, kvs_block_table_blocks_needed(&r->table, bs, r->n_tokens));
        if (e->n_running > 0 && need_all + reserve > avail) {
            release_kv(e, r);
            r->n_computed = 0;
            break;
        }
        if (need + reserve > avail) {
            int fit = (r->table.n + avail - reserve) * bs - r->n_computed;
            if (fit <= 0) {
                /* not even one token fits: give the matched blocks back and wait */
                release_kv(e, r);
                r->n_computed = 0;
                break;
            }
            c = fit < c ? fit : c;
        }
        int rc = kvs_block_table_reserve(&r->table, &e->pool, r->n_computed + c);
        KVS_ASSERT(rc == 0);
        wait_remove(e, r);
        e->running[e->n_running++] = r;
        r->state = KVS_REQ_RUNNING;
        KVS_ASSERT(r->slot < 0 && e->n_free_slots > 0);
        r->slot = e->free_slots[--e->n_free_slots];
        r->slot_fresh = 1;
        if (!r->admitted_once) {
            r->admitted_once = 1;
            r->t_first_sched = now;
            r->n_cached_tokens = matched;
            if (e->kv.reuse->count) e->kv.reuse->count(&e->kv, &r->kvrq);
            e->counters.prompt_tokens += (uint64_t)r->n_real_prompt;
            if (e->kv.reuse->caches) {
                e->counters.cache_queries += (uint64_t)r->n_full_prompt;
                e->counters.cache_hits += (uint64_t)matched;
            }
        }
        promised += peak_need(e, r, kvs_block_table_blocks_needed(&r->table, bs, r->n_tokens));
        if (!kv_ready(e, r)) continue;   /* runs once the strategy's side prefills are in */
        r->sched_tokens = c;
        e->sched[n_sched++] = r;
        budget -= c;
        pbudget -= c;
        if (plp_pending(r)) e->plp_rows += c;
    }

    /* side prefills the reuse strategy asks for (kv.h: e.g. missing documents, each computed
     * once however many requests wait for it), as sequences of their own after the requests */
    e->n_jobs = 0;
    for (int i = 0; e->kv.reuse->jobs && i < e->n_running && budget > 0 && pbudget > 0; i++) {
        struct kvs_request *r = e->running[i];
        int jb = budget < pbudget ? budget : pbudget, before = jb;
        e->n_jobs += e->kv.reuse->jobs(&e->kv, &r->kvrq, r->tokens, &r->table, e->prefill_chunk, &jb,
                                       e->jobs + e->n_jobs, e->max_running - n_sched - e->n_jobs);
        budget -= before - jb;
        pbudget -= before - jb;
    }
    return n_sched;
}

/* Ends cancelled and timed-out requests (running and waiting). */
static void reap(struct kvs_engine *e, double now)
{
    for (int i = 0; i < e->n_running;) {
        struct kvs_request *r = e->running[i];
        int cancel = atomic_load(&r->cancelled);
        int timeout = r->timeout_s > 0 && now - r->t_submit > r->timeout_s;
        if (cancel || timeout) {
            /* its last token's event first, as without overlap (it may end the request itself) */
            if (r->emit_pending && emit_deferred_one(e, r)) continue;
            if (r->n_inflight > 0) {   /* scheduler.async: once its steps are back */
                if (!r->finish_pending) end_request(e, r, cancel ? KVS_FINISH_CANCELLED : KVS_FINISH_TIMEOUT, NULL);
                i++;
                continue;
            }
            kvs_scheduler_finish(e, r, cancel ? KVS_FINISH_CANCELLED : KVS_FINISH_TIMEOUT, NULL);
        } else {
            i++;
        }
    }
    for (struct kvs_request *r = e->wait_head, *nx; r; r = nx) {
        nx = r->next;
        int cancel = atomic_load(&r->cancelled);
        int timeout = r->timeout_s > 0 && now - r->t_submit > r->timeout_s;
        if (cancel || timeout) {
            if (r->emit_pending && emit_deferred_one(e, r)) continue;
            if (r->n_inflight > 0) {   /* preempted while in a begun step (scheduler.async) */
                if (!r->finish_pending) end_request(e, r, cancel ? KVS_FINISH_CANCELLED : KVS_FINISH_TIMEOUT, NULL);
                continue;
            }
            kvs_scheduler_finish(e, r, cancel ? KVS_FINISH_CANCELLED : KVS_FINISH_TIMEOUT, NULL);
        }
    }
}

static void publish_stats(struct kvs_engine *e)
{
    pthread_mutex_lock(&e->mu);
    struct kvs_engine_stats s = e->counters;
    s.requests_rejected = e->stats.requests_rejected;   /* counted by submit, under the lock */
    s.num_running = e->n_running;
    s.num_waiting = e->n_waiting;
    s.kv_blocks_total = e->pool.n_blocks;
    s.kv_blocks_used = kvs_block_pool_used(&e->pool);
    s.kv_blocks_cached = e->pool.n_lru;
    s.block_size = e->pool.block_size;
    /* the strategies' own counters: reuse (engine side), then the executor's (decode policy,
     * fidelity meter). They are gathered with twice the room the snapshot keeps, so that a
     * list grown past KVS_KV_MAX_COUNTERS is seen and said instead of cut without a word (each
     * strategy stops at the room it is given; the meter then leaves its histogram out). */
    struct kvs_kv_counter all[2 * KVS_KV_MAX_COUNTERS];
    const int room = 2 * KVS_KV_MAX_COUNTERS;
    int n = 0;
    if (e->kv.reuse->counters) n = e->kv.reuse->counters(&e->kv, all, room);
    if (e->x.kv_counters) n += e->x.kv_counters(e->x.ctx, all + n, room - n);
    s.n_kv_counters = n < KVS_KV_MAX_COUNTERS ? n : KVS_KV_MAX_COUNTERS;
    memcpy(s.kv_counters, all, (size_t)s.n_kv_counters * sizeof all[0]);
    s.kv_counters_dropped = n - s.n_kv_counters;
    if (s.kv_counters_dropped > 0 && !e->kv_counters_warned) {
        e->kv_counters_warned = 1;
        kvs_log(KVS_LOG_WARN, "engine: the KV strategies export %d%s counters, room for %d (KVS_KV_MAX_COUNTERS, "
                "engine/engine.h): /metrics leaves out %s from \"%s\" on; raise the constant",
                n, n >= room ? "+" : "", KVS_KV_MAX_COUNTERS, n >= room ? "the rest" : "the last ones",
                all[KVS_KV_MAX_COUNTERS].name);
    }
    e->stats = s;
    pthread_mutex_unlock(&e->mu);
}

/* The greedy fast path for r (engine_exec.h sample_is_argmax). */
static int takes_argmax(const struct kvs_engine *e, const struct kvs_request *r)
{
    return e->x.sample_is_argmax && e->x.sample_is_argmax(e->x.ctx, r->sampler);
}

/* r's next token into so: the backend's argmax id for an ARGMAX row (lg NULL), otherwise the
 * sampler's pick from the host row lg. 0, or negative when no valid token came out. */
static int pick_token(struct kvs_engine *e, struct kvs_request *r, int32_t argmax_id, float *lg,
                      struct kvs_sample_out *so)
{
    memset(so, 0, sizeof *so);
    int rc = 0, top = r->sampling.top_logprobs;
    if (lg)
        rc = e->x.sample(e->x.ctx, r->sampler, lg, r->tokens, r->n_full_prompt, r->n_tokens,
                         r->sampling.logprobs || top > 0, top, so);
    else
        so->token = argmax_id;   /* -1 where the sampler would have failed (runner.h) */
    if (rc < 0 || so->token < 0 || so->token >= e->x.vocab_size) return rc < 0 ? rc : -EINVAL;
    if (so->n_top > top) so->n_top = top;
    if (!lg) e->counters.argmax_tokens++;
    return 0;
}

static void step_body(struct kvs_engine *e, double now);

/* One scheduler step; the wall time of those that ran a forward pass goes to step_s. */
static void step(struct kvs_engine *e)
{
    double now = kvs_now();
    uint64_t steps = e->counters.steps;
    step_body(e, now);
    if (e->counters.steps != steps) {
        e->counters.step_s += kvs_now() - now;
        pthread_mutex_lock(&e->mu);   /* into the snapshot the step already published */
        e->stats.step_s = e->counters.step_s;
        pthread_mutex_unlock(&e->mu);
    }
}

/* The batch of the n scheduled requests and the side prefills into e->seqs; returns whether any
 * row is an ARGMAX row, with the sequences that want host logits rows (LAST / ALL) in *n_host.
 * A request whose token is a pick still on the device (scheduler.async) runs it from there. */
static int build_seqs(struct kvs_engine *e, int n, int *n_host)
{
    *n_host = 0;
    int n_logits = 0, any_argmax = 0;
    for (int k = 0; k < n; k++) {
        struct kvs_request *r = e->sched[k];
        struct kvs_batch_seq *s = &e->seqs[k];
        s->tokens = r->tokens + r->n_computed;
        s->n_tokens = r->sched_tokens;
        s->pos = r->n_computed;
        s->block_table = r->table.ids;
        s->n_blocks = r->table.n;
        s->block_rot_offset = s->block_valid = NULL;
        if (e->kv.reuse->block_meta) e->kv.reuse->block_meta(&e->kv, &r->kvrq, &s->block_rot_offset, &s->block_valid);
        s->slot = r->slot;
        s->slot_fresh = r->slot_fresh;
        s->token_on_device = r->tok_pending;
        int last = r->n_computed + r->sched_tokens == r->n_tokens;
        if (plp_pending(r)) {
            s->want_logits = KVS_LOGITS_ALL;   /* one row per token: the prompt is being scored */
            n_logits += r->sched_tokens;
        } else {
            s->want_logits = !last ? KVS_LOGITS_NONE : takes_argmax(e, r) ? KVS_LOGITS_ARGMAX : KVS_LOGITS_LAST;
            n_logits += last;
        }
        any_argmax |= s->want_logits == KVS_LOGITS_ARGMAX;
        if (s->want_logits == KVS_LOGITS_ALL || s->want_logits == KVS_LOGITS_LAST) (*n_host)++;
    }
    KVS_ASSERT(n_logits <= e->max_running + KVS_PROMPT_LP_ROWS);
    for (int j = 0; j < e->n_jobs; j++) {
        const struct kvs_kv_job *jb = &e->jobs[j];
        struct kvs_batch_seq *s = &e->seqs[n + j];
        memset(s, 0, sizeof *s);
        s->tokens = jb->tokens;
        s->n_tokens = jb->n_tokens;
        s->pos = jb->pos;
        s->block_table = jb->block_table;
        s->n_blocks = jb->n_blocks;
        s->want_logits = KVS_LOGITS_NONE;
        s->slot = -1;
    }
    return any_argmax;
}

/* ---- scheduler.async ----------------------------------------------------------------------
 * While the device runs step N (begun, "pending"), the scheduler reaps, schedules, stages and
 * begins step N+1, and only then waits for N's picks and applies them (tokens, stop checks, text
 * and events: a step late). A request of N whose row samples gets a placeholder token at once
 * (async_begun); if it continues, its N+1 row takes the token from N's pick on the device
 * (kvs_batch_seq.token_on_device). A request N ends (stop id, stop string, error) is already in
 * N+1: its row there is dropped, never emitted (end_request's finish_pending); a request whose
 * N token is its last by count (max_tokens, the context) runs no N+1 row (tok_final).
 * Steps whose rows come back as host logits (sampled, logprobs, scored prompts) or that carry
 * side prefills are ended before the next one is scheduled (no lookahead): their sampler needs
 * the host, and the reuse strategy learns of its jobs at the end. Greedy output is the same as
 * the synchronous path's: the same rows run with the same tokens, in other step groupings only
 * where a request was not scheduled while its last pick was out (the backends are batch
 * invariant). */

/* A begun step's bookkeeping that needs no pick: positions advance, placeholders for the rows
 * that sample, the step becomes the pending one (its arrays swap with the builder's). */
static void async_begun(struct kvs_engine *e, int n, int rc, int lookahead, double t0)
{
    for (int k = 0; k < n; k++) {
        struct kvs_request *r = e->sched[k];
        const struct kvs_batch_seq *q = &e->seqs[k];
        r->n_computed += r->sched_tokens;
        r->sched_tokens = 0;
        r->slot_fresh = 0;
        /* (n_inflight was counted at the begin; a request the step before ended is dropped) */
        if (q->want_logits != KVS_LOGITS_NONE && r->n_computed == r->n_tokens && r->max_tokens > 0 &&
            !r->finish_pending) {
            KVS_ASSERT(!r->tok_pending && r->n_tokens < r->n_full_prompt + r->max_tokens);
            r->tok_idx = r->n_tokens;
            r->tokens[r->n_tokens++] = 0;
            r->tok_pending = 1;
            r->tok_final = r->n_gen + 1 >= r->max_tokens || r->n_tokens >= e->max_context;
        }
    }
    struct kvs_request **ts = e->p_sched;
    e->p_sched = e->sched;
    e->sched = ts;
    struct kvs_batch_seq *tq = e->p_seqs;
    e->p_seqs = e->seqs;
    e->seqs = tq;
    e->p_on = 1;
    e->p_n = n;
    e->p_n_jobs = e->n_jobs;
    e->p_rc = rc;
    e->p_lookahead = lookahead && rc == 0;
    e->p_t0 = t0;
    e->n_jobs = lookahead ? 0 : e->n_jobs;   /* jobs stay in e->jobs until async_end (no lookahead) */
}

/* Waits for the pending step and applies it: picks, stop checks, text and events, counters. */
static void async_end(struct kvs_engine *e)
{
    KVS_ASSERT(e->p_on);
    int rc_end = e->x.forward_end(e->x.ctx);
    int rc = e->p_rc < 0 ? e->p_rc : rc_end;
    const int n = e->p_n;
    e->p_on = 0;
    double t1 = kvs_now();
    /* the device's time on this step: from its begin, or from the previous step's end when it
     * was queued behind that one */
    double busy = t1 - (e->p_t0 > e->last_end ? e->p_t0 : e->last_end);
    e->last_end = t1;
    e->counters.busy_s += busy;
    e->counters.steps++;
    int n_dec = 0, n_pre = 0;
    for (int k = 0; k < n + e->p_n_jobs; k++) {
        if (k < n && e->p_seqs[k].n_tokens == 1 && e->p_seqs[k].pos > 0) n_dec++;
        else n_pre += e->p_seqs[k].n_tokens;
    }
    if (rc == 0) kvs_prefill_ctl_observe(&e->pctl, n_dec, n_pre, e->x.step_seconds ? e->x.step_seconds(e->x.ctx) : busy);
    if (n_pre == 0) {
        e->counters.decode_steps++;
        e->counters.decode_rows += (uint64_t)n;
        e->counters.decode_busy_s += busy;
    }
    for (int j = 0; j < e->p_n_jobs; j++) e->kv.reuse->job_done(&e->kv, e->jobs[j].handle, e->jobs[j].n_tokens, rc == 0);
    if (e->p_n_jobs) e->n_jobs = 0;
    e->p_n_jobs = 0;
    int row = 0, host_row = 0;
    for (int k = 0; k < n; k++) {
        struct kvs_request *r = e->p_sched[k];
        const struct kvs_batch_seq *q = &e->p_seqs[k];
        const int want = q->want_logits, start = q->pos, c = q->n_tokens;
        const int n_rows = want == KVS_LOGITS_ALL ? c : want != KVS_LOGITS_NONE;
        const int32_t id = want == KVS_LOGITS_ARGMAX ? e->argmax[row] : -1;
        row += n_rows;
        float *rows = want == KVS_LOGITS_ARGMAX || want == KVS_LOGITS_NONE
                          ? NULL
                          : e->logits + (size_t)host_row * (size_t)e->x.vocab_size;
        if (want != KVS_LOGITS_ARGMAX) host_row += n_rows;
        r->n_inflight--;
        const int sampled = r->tok_pending && r->tok_idx == start + c;   /* this step's pick */
        if (sampled) r->tok_pending = r->tok_final = 0;
        if (r->finish_pending || rc < 0) {   /* ended while in flight: its rows here are dropped */
            if (!r->finish_pending) {
                r->finish_pending = 1;
                r->pend_why = KVS_FINISH_ERROR;
                r->pend_msg = "forward pass failed";
            }
            if (r->n_inflight == 0) kvs_scheduler_finish(e, r, r->pend_why, r->pend_msg);
            continue;
        }
        /* the reuse strategy's commit of the positions this step wrote (none were lost: a
         * preempted request has no table) */
        if (e->kv.reuse->commit && r->state == KVS_REQ_RUNNING && r->table.n)
            e->kv.reuse->commit(&e->kv, &r->kvrq, r->tokens, start + c, &r->table);
        if (want == KVS_LOGITS_NONE) continue;
        if (atomic_load(&r->cancelled)) continue;   /* ended by the next step's reap */
        if (want == KVS_LOGITS_ALL && score_prompt(e, r, start, c, rows) < 0) continue;
        if (r->max_tokens == 0 && start + c == r->n_tokens) {   /* scoring only: done once the prompt is */
            end_request(e, r, KVS_FINISH_LENGTH, NULL);
            continue;
        }
        if (!sampled) continue;   /* a middle chunk of a scored prompt */
        float *lg = rows ? rows + (size_t)(n_rows - 1) * (size_t)e->x.vocab_size : NULL;
        struct kvs_sample_out so;
        /* the sampler sees the sequence without the placeholder, as on the synchronous path */
        const int n_tok = r->n_tokens;
        r->n_tokens = r->tok_idx;
        int prc = pick_token(e, r, id, lg, &so);
        r->n_tokens = n_tok;
        if (prc < 0) {
            end_request(e, r, KVS_FINISH_ERROR, "sampling failed");
            continue;
        }
        r->tokens[r->tok_idx] = so.token;
        r->n_gen++;
        e->counters.generation_tokens++;
        if (r->t_first_token == 0) r->t_first_token = t1;
        const int is_stop = is_member(r->stop_ids, r->n_stop_ids, so.token);
        const int final = is_stop || r->n_gen >= r->max_tokens || r->tok_idx + 1 >= e->max_context;
        /* its text and event now: the next step is already on the device */
        emit_text(e, r, &so, final, is_stop ? KVS_FINISH_STOP : KVS_FINISH_LENGTH);
    }
    publish_stats(e);
}

static void step_async(struct kvs_engine *e, double now)
{
    if (e->p_on && !e->p_lookahead) async_end(e);   /* its results first (module comment) */
    reap(e, now);
    int n = schedule(e, now);
    if (n == 0 && e->n_jobs == 0) {
        if (e->p_on) async_end(e);   /* nothing to queue behind it */
        publish_stats(e);
        return;
    }
    int n_host;
    int any_argmax = build_seqs(e, n, &n_host);
    publish_stats(e);   /* admissions are visible (queue limit) while the pass runs */
    struct kvs_batch batch = {e->seqs, n + e->n_jobs, any_argmax ? e->argmax : NULL};
    double t0 = kvs_now();
    e->counters.sched_s += t0 - now;
    int rc = e->x.forward_begin(e->x.ctx, &batch, e->logits);
    e->counters.launch_s += kvs_now() - t0;
    e->counters.async_steps += e->p_on;
    /* in flight from now: a request that the step before ends is kept until this one is back */
    for (int k = 0; k < n; k++) e->sched[k]->n_inflight++;
    if (e->p_on) async_end(e);   /* the step before, while this one runs */
    async_begun(e, n, rc, n_host == 0 && e->n_jobs == 0, t0);
}

static void step_body(struct kvs_engine *e, double now)
{
    if (e->async) {
        step_async(e, now);
        return;
    }
    reap(e, now);
    int n = schedule(e, now);
    if (n == 0 && e->n_jobs == 0) {
        flush_deferred(e);
        publish_stats(e);
        return;
    }
    int n_host;
    int any_argmax = build_seqs(e, n, &n_host);
    (void)n_host;
    publish_stats(e);   /* admissions are visible (queue limit) while the pass runs */
    struct kvs_batch batch = {e->seqs, n + e->n_jobs, any_argmax ? e->argmax : NULL};
    double t0 = kvs_now();
    e->counters.sched_s += t0 - now;
    int rc;
    if (e->overlap) {
        /* the previous step's text and events while the device runs this one (the executor
         * without forward_begin runs it first: same order of events, no overlap) */
        int split = e->x.forward_begin && e->x.forward_end;
        rc = split ? e->x.forward_begin(e->x.ctx, &batch, e->logits) : e->x.forward(e->x.ctx, &batch, e->logits);
        e->counters.launch_s += kvs_now() - t0;
        e->in_flight = 1;
        flush_deferred(e);
        e->in_flight = 0;
        if (split) {
            int rc_end = e->x.forward_end(e->x.ctx);
            if (rc == 0) rc = rc_end;
        }
    } else {
        rc = e->x.forward(e->x.ctx, &batch, e->logits);
        e->counters.launch_s += kvs_now() - t0;
    }
    double t1 = kvs_now();
    e->counters.busy_s += t1 - t0;
    e->counters.steps++;
    int n_dec = 0, n_pre = 0;
    for (int k = 0; k < n + e->n_jobs; k++) {
        if (k < n && e->seqs[k].n_tokens == 1 && e->seqs[k].pos > 0) n_dec++;
        else n_pre += e->seqs[k].n_tokens;
    }
    if (rc == 0)
        kvs_prefill_ctl_observe(&e->pctl, n_dec, n_pre, e->x.step_seconds ? e->x.step_seconds(e->x.ctx) : t1 - t0);
    if (n_pre == 0) {
        e->counters.decode_steps++;
        e->counters.decode_rows += (uint64_t)n;
        e->counters.decode_busy_s += t1 - t0;
    }
    for (int j = 0; j < e->n_jobs; j++) e->kv.reuse->job_done(&e->kv, e->jobs[j].handle, e->jobs[j].n_tokens, rc == 0);
    for (int k = 0; k < n; k++) e->sched[k]->slot_fresh = 0;
    e->n_jobs = 0;
    if (rc < 0) {
        char msg[128];
        snprintf(msg, sizeof msg, "forward pass failed (%s)", strerror(-rc));
        kvs_log(KVS_LOG_ERROR, "engine: %s; ending the %d requests of the batch", msg, n);
        for (int k = 0; k < n; k++) kvs_scheduler_finish(e, e->sched[k], KVS_FINISH_ERROR, msg);
        publish_stats(e);
        return;
    }
    /* logits rows in batch order: row counts all of them (batch.argmax), host_row those whose
     * logits came back (every kind but ARGMAX) */
    int row = 0, host_row = 0;
    for (int k = 0; k < n; k++) {
        struct kvs_request *r = e->sched[k];
        int want = e->seqs[k].want_logits;
        int start = r->n_computed, c = r->sched_tokens;
        r->n_computed += r->sched_tokens;
        r->sched_tokens = 0;
        if (e->kv.reuse->commit) e->kv.reuse->commit(&e->kv, &r->kvrq, r->tokens, r->n_computed, &r->table);
        /* blocks the decode policy moved off the pool (kv.h `offloaded`) go back to it */
        int off_lo, off_hi;
        if (e->x.kv_offloaded && r->slot >= 0 && e->x.kv_offloaded(e->x.ctx, r->slot, &off_lo, &off_hi) > 0)
            kvs_block_table_offload(&r->table, &e->pool, off_lo, off_hi);
        if (!want && !r->finish_pending) continue;
        /* an ALL chunk's rows are its tokens'; the last one is the sampling row */
        int n_rows = want == KVS_LOGITS_ALL ? c : want != KVS_LOGITS_NONE;
        int32_t id = want == KVS_LOGITS_ARGMAX ? e->argmax[row] : -1;   /* written for ARGMAX rows */
        row += n_rows;
        float *rows = want == KVS_LOGITS_ARGMAX ? NULL : e->logits + (size_t)host_row * (size_t)e->x.vocab_size;
        if (want != KVS_LOGITS_ARGMAX) host_row += n_rows;
        float *lg = rows ? rows + (size_t)(n_rows - 1) * (size_t)e->x.vocab_size : NULL;
        if (r->finish_pending) {   /* ended during the pass (overlap): its rows here are dropped */
            kvs_scheduler_finish(e, r, r->pend_why, r->pend_msg);
            continue;
        }
        if (atomic_load(&r->cancelled)) continue;   /* ended by the next step's reap */
        if (want == KVS_LOGITS_ALL && score_prompt(e, r, start, c, rows) < 0) continue;
        if (r->n_computed < r->n_tokens) continue;   /* a middle chunk of a scored prompt */
        if (r->max_tokens == 0) {   /* scoring only: done once the prompt is */
            kvs_scheduler_finish(e, r, KVS_FINISH_LENGTH, NULL);
            continue;
        }
        struct kvs_sample_out so;
        if (pick_token(e, r, id, lg, &so) < 0) {
            kvs_scheduler_finish(e, r, KVS_FINISH_ERROR, "sampling failed");
            continue;
        }
        enum kvs_finish why;
        int final = apply_token(e, r, so.token, t1, &why);
        if (e->overlap && !final) {   /* its text and event during the next pass */
            e->deferred[e->n_deferred] = r;
            e->deferred_so[e->n_deferred++] = so;
            r->emit_pending = 1;
        } else {
            emit_text(e, r, &so, final, why);
        }
    }
    publish_stats(e);
}

void *kvs_scheduler_main(void *arg)
{
    struct kvs_engine *e = arg;
    for (;;) {
        pthread_mutex_lock(&e->mu);
        while (!e->stop && !e->in_head && e->n_running == 0 && !e->wait_head && !e->p_on)
            pthread_cond_wait(&e->cv, &e->mu);
        if (e->stop) {
            pthread_mutex_unlock(&e->mu);
            break;
        }
        int moved = 0;
        while (e->in_head) {
            struct kvs_request *r = e->in_head;
            e->in_head = r->next;
            r->state = KVS_REQ_WAITING;
            wait_push_back(e, r);
            moved++;
        }
        e->in_tail = NULL;
        e->n_incoming = 0;
        e->stats.num_waiting += moved;
        pthread_mutex_unlock(&e->mu);
        step(e);
    }
    /* shutdown: every request the scheduler knows ends CANCELLED (after its last token) */
    if (e->p_on) async_end(e);
    flush_deferred(e);
    while (e->n_running) kvs_scheduler_finish(e, e->running[e->n_running - 1], KVS_FINISH_CANCELLED, NULL);
    while (e->wait_head) kvs_scheduler_finish(e, e->wait_head, KVS_FINISH_CANCELLED, NULL);
    publish_stats(e);
    return NULL;
}
