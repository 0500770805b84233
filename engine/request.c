/* request.c: the request object: copied parameters, reference counting, the event queue that
 * the engine fills and callers drain, cancellation. */
#include "engine/engine_internal.h"
#include "base/util.h"

#include <string.h>
#include <time.h>

static atomic_uint_fast64_t g_next_id = 1;

static void *dup_array(const void *src, size_t n, size_t elem, int *fail)
{
    if (!src || n == 0) return NULL;
    void *d = malloc(n * elem);
    if (!d) {
        *fail = 1;
        return NULL;
    }
    memcpy(d, src, n * elem);
    return d;
}

struct kvs_request *kvs_request_new(const struct kvs_request_params *p, void (*notify)(void *user), void *user)
{
    if (!p) return NULL;
    struct kvs_request *r = calloc(1, sizeof *r);
    if (!r) return NULL;
    int fail = 0;
    atomic_init(&r->refs, 1);
    atomic_init(&r->cancelled, 0);
    atomic_init(&r->submitted, 0);
    r->id = atomic_fetch_add(&g_next_id, 1);
    r->n_prompt = p->n_prompt > 0 && p->prompt ? p->n_prompt : 0;
    r->prompt = dup_array(p->prompt, (size_t)r->n_prompt, sizeof(int32_t), &fail);
    r->max_tokens = p->max_tokens;
    r->prompt_logprobs = p->prompt_logprobs ? 1 : 0;
    r->n_prompt_lp = 1;
    r->sampling = p->sampling;
    int nb = p->sampling.n_logit_bias > 0 && p->sampling.logit_bias_ids && p->sampling.logit_bias_values
                 ? p->sampling.n_logit_bias : 0;
    r->sampling.n_logit_bias = nb;
    r->logit_bias_ids = dup_array(p->sampling.logit_bias_ids, (size_t)nb, sizeof(int32_t), &fail);
    r->logit_bias_values = dup_array(p->sampling.logit_bias_values, (size_t)nb, sizeof(float), &fail);
    r->sampling.logit_bias_ids = r->logit_bias_ids;
    r->sampling.logit_bias_values = r->logit_bias_values;
    r->n_stop_ids = p->n_stop_ids > 0 && p->stop_ids ? p->n_stop_ids : 0;
    r->stop_ids = dup_array(p->stop_ids, (size_t)r->n_stop_ids, sizeof(int32_t), &fail);
    int ns = p->n_stop_strings > 0 && p->stop_strings ? p->n_stop_strings : 0;
    if (ns) {
        r->stop_strings = calloc((size_t)ns, sizeof *r->stop_strings);
        if (!r->stop_strings) fail = 1;
        for (int i = 0; r->stop_strings && i < ns; i++) {
            const char *s = p->stop_strings[i] ? p->stop_strings[i] : "";
            if (!*s) continue;   /* an empty stop string would match everywhere: ignored */
            char *c = strdup(s);
            if (!c) {
                fail = 1;
                break;
            }
            r->stop_strings[r->n_stop_strings++] = c;
            int len = (int)strlen(c);
            if (len > r->max_stop_len) r->max_stop_len = len;
        }
    }
    int nd = p->n_docs > 0 && p->docs ? p->n_docs : 0;
    if (nd) {
        size_t total = 0;
        for (int i = 0; i < nd; i++) total += p->docs[i].n_tokens > 0 ? (size_t)p->docs[i].n_tokens : 0;
        r->doc_len = calloc((size_t)nd, sizeof *r->doc_len);
        r->doc_tokens = malloc((total ? total : 1) * sizeof *r->doc_tokens);
        if (!r->doc_len || !r->doc_tokens) fail = 1;
        size_t at = 0;
        for (int i = 0; !fail && i < nd; i++) {
            /* an empty or missing document is kept as length 0 and refused at submit */
            int n = p->docs[i].n_tokens > 0 && p->docs[i].tokens ? p->docs[i].n_tokens : 0;
            if (p->docs[i].n_tokens > 0 && !p->docs[i].tokens) n = -1;
            r->doc_len[i] = n;
            if (n > 0) memcpy(r->doc_tokens + at, p->docs[i].tokens, (size_t)n * sizeof *r->doc_tokens);
            if (n > 0) at += (size_t)n;
        }
        r->n_docs = nd;
    }
    r->ignore_eos = p->ignore_eos;
    r->skip_special = p->skip_special;
    r->timeout_s = p->timeout_s;
    r->notify = notify;
    r->user = user;
    pthread_mutex_init(&r->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&r->cv, &ca);
    pthread_condattr_destroy(&ca);
    r->state = KVS_REQ_NEW;
    if (fail) {
        kvs_request_unref(r);
        return NULL;
    }
    return r;
}

void kvs_request_ref(struct kvs_request *r) { atomic_fetch_add(&r->refs, 1); }

void kvs_event_clear(struct kvs_event *ev)
{
    if (!ev) return;
    free(ev->text);
    free(ev->error);
    memset(ev, 0, sizeof *ev);
}

void kvs_request_release_engine_state(struct kvs_request *r, struct kvs_engine *e)
{
    if (e && r->sampler && e->x.sampler_free) e->x.sampler_free(e->x.ctx, r->sampler);
    free(r->sampler);
    r->sampler = NULL;
    free(r->tokens);
    r->tokens = NULL;
    free(r->text);
    r->text = NULL;
    if (r->kv_reuse && r->kv_reuse->seq_free) r->kv_reuse->seq_free(&r->kvrq);
    r->kv_reuse = NULL;
    kvs_block_table_free(&r->table);
}

void kvs_request_unref(struct kvs_request *r)
{
    if (!r) return;
    if (atomic_fetch_sub(&r->refs, 1) != 1) return;
    for (int i = 0; i < r->ev_count; i++) kvs_event_clear(&r->ev[(r->ev_head + i) % r->ev_cap]);
    free(r->ev);
    kvs_request_release_engine_state(r, NULL);
    free(r->prompt);
    free(r->doc_tokens);
    free(r->doc_len);
    free(r->logit_bias_ids);
    free(r->logit_bias_values);
    free(r->stop_ids);
    for (int i = 0; i < r->n_stop_strings; i++) free(r->stop_strings[i]);
    free(r->stop_strings);
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cv);
    free(r);
}

uint64_t kvs_request_id(const struct kvs_request *r) { return r->id; }

void kvs_request_cancel(struct kvs_request *r)
{
    if (!r) return;
    /* the scheduler checks the flag at the start of every step; it never sleeps while the
     * request is queued or running, so no wake-up is needed */
    atomic_store(&r->cancelled, 1);
}

int kvs_request_push_event(struct kvs_request *r, struct kvs_event *ev)
{
    pthread_mutex_lock(&r->mu);
    if (r->ev_count == r->ev_cap) {
        int cap = r->ev_cap ? r->ev_cap * 2 : 16;
        struct kvs_event *n = malloc((size_t)cap * sizeof *n);
        if (!n) {
            pthread_mutex_unlock(&r->mu);
            return -ENOMEM;
        }
        for (int i = 0; i < r->ev_count; i++) n[i] = r->ev[(r->ev_head + i) % r->ev_cap];
        free(r->ev);
        r->ev = n;
        r->ev_cap = cap;
        r->ev_head = 0;
    }
    r->ev[(r->ev_head + r->ev_count) % r->ev_cap] = *ev;
    r->ev_count++;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    memset(ev, 0, sizeof *ev);   /* ownership of text/error moved into the queue */
    return 0;
}

static int take_locked(struct kvs_request *r, struct kvs_event *out, int max)
{
    int n = 0;
    while (n < max && r->ev_count > 0) {
        out[n++] = r->ev[r->ev_head];
        r->ev_head = (r->ev_head + 1) % r->ev_cap;
        r->ev_count--;
    }
    return n;
}

int kvs_request_poll(struct kvs_request *r, struct kvs_event *out, int max)
{
    if (!r || !out || max <= 0) return 0;
    pthread_mutex_lock(&r->mu);
    int n = take_locked(r, out, max);
    pthread_mutex_unlock(&r->mu);
    return n;
}

int kvs_request_wait(struct kvs_request *r, struct kvs_event *out, int max, double timeout_s)
{
    if (!r || !out || max <= 0) return 0;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    if (timeout_s < 0) timeout_s = 0;
    double t = (double)ts.tv_sec + ts.tv_nsec * 1e-9 + timeout_s;
    ts.tv_sec = (time_t)t;
    ts.tv_nsec = (long)((t - (double)ts.tv_sec) * 1e9);
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&r->mu);
    while (r->ev_count == 0) {
        if (pthread_cond_timedwait(&r->cv, &r->mu, &ts) != 0) break;
    }
    int n = take_locked(r, out, max);
    pthread_mutex_unlock(&r->mu);
    return n;
}
