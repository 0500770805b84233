/* fake_backend.c: test doubles for the model, tokenizer, chat format and engine, so the HTTP
 * layer can be tested end to end before (and independently of) the real ones. Included only
 * by tests/fake/kvserve_fake_main.c (build/kvserve-fake); never part of libkvserve.
 *
 * The behaviour is simple enough for the Python tests to predict independently:
 *   tokenizer: byte-level: ids 0..255 are bytes; 256 "<|endoftext|>" (EOS), 257 "<|im_start|>",
 *              258 "<|im_end|>" (EOS), 259 "<|bos|>" (BOS, prepended when add_special).
 *   engine:    completion token k is prompt[n-1 - (k mod n)] (the prompt read backwards,
 *              cyclically); an EOS id ends with finish "stop" unless ignore_eos; stop strings
 *              end with "stop" and are never emitted; logprob of every sampled token is
 *              log(0.5), alternative i (i >= 1) is token+i with log(0.5 / 2^i).
 *              prompt_logprobs (echo): position p >= 1 of the prompt, token t: odd p: t is the
 *              top choice, logprob log(0.5), alternative i (i >= 1) is (t+i) mod 256 with
 *              log(0.5 / 2^i); even p: t has logprob log(0.05) and alternative i (i >= 0) is
 *              (t+1+i) mod 256 with log(0.5 / 2^i). max_tokens 0 then ends LENGTH at once.
 *              KV: pool of FAKE_BLOCKS blocks of 16 tokens, a request reserves
 *              ceil((prompt + max_tokens) / 16) at admission, returns them when it ends.
 *              A prompt containing the bytes "!fail!" ends with an ERROR event after 2 tokens
 *              (to test how the server reports engine failures).
 * Environment: KVS_FAKE_STEP_MS (default 2) per decode step, KVS_FAKE_PREFILL_MS (default 0)
 * per admitted request, KVS_FAKE_LOAD_MS (default 0) in kvs_engine_create,
 * KVS_FAKE_BLOCKS (default 512).
 */
#include "engine/config.h"
#include "engine/engine.h"
#include "engine/text/tokenizer.h"
#include "base/util.h"
#include "models/model.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define FAKE_EOT 256
#define FAKE_IM_START 257
#define FAKE_IM_END 258
#define FAKE_BOS 259
#define FAKE_VOCAB 260
#define FAKE_BLOCK 16

static const char *k_special[] = {"<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|bos|>"};

static double env_num(const char *name, double dflt)
{
    const char *v = getenv(name);
    return v && *v ? atof(v) : dflt;
}

/* ---------------------------------------------------------------- model */

struct kvs_model {
    struct kvs_model_config c;
    char *dir;
};

int kvs_model_load(const char *dir, struct kvs_model **out, char *err, size_t errlen)
{
    struct stat st;
    if (!dir || stat(dir, &st) != 0 || !S_ISDIR(st.st_mode))
        return kvs_err(err, errlen, -ENOENT, "model directory '%s' not found", dir ? dir : "(null)");
    struct kvs_model *m = kvs_xcalloc(1, sizeof *m);
    m->dir = kvs_xstrdup(dir);
    m->c.vocab_size = FAKE_VOCAB;
    m->c.max_position_embeddings = 256;
    *out = m;
    return 0;
}

void kvs_model_free(struct kvs_model *m)
{
    if (!m) return;
    free(m->dir);
    free(m);
}

/* ---------------------------------------------------------------- tokenizer */

struct kvs_tokenizer {
    int dummy;
};

int kvs_tokenizer_load(const char *dir, struct kvs_tokenizer **out, char *err, size_t errlen)
{
    (void)dir;
    (void)err;
    (void)errlen;
    *out = kvs_xcalloc(1, sizeof **out);
    return 0;
}

void kvs_tokenizer_free(struct kvs_tokenizer *t) { free(t); }
int kvs_tokenizer_vocab_size(const struct kvs_tokenizer *t) { (void)t; return FAKE_VOCAB; }
int kvs_tokenizer_bos(const struct kvs_tokenizer *t) { (void)t; return FAKE_BOS; }

int kvs_tokenizer_encode(const struct kvs_tokenizer *t, const char *text, size_t len, int add_special,
                         int parse_special, int32_t *ids, int cap)
{
    (void)t;
    int n = 0;
    if (add_special) {
        if (n < cap) ids[n] = FAKE_BOS;
        n++;
    }
    for (size_t i = 0; i < len;) {
        int32_t id = (unsigned char)text[i];
        size_t adv = 1;
        if (parse_special)
            for (int s = 0; s < 4; s++) {
                size_t sl = strlen(k_special[s]);
                if (i + sl <= len && !memcmp(text + i, k_special[s], sl)) {
                    id = FAKE_EOT + s;
                    adv = sl;
                    break;
                }
            }
        if (n < cap) ids[n] = id;
        n++;
        i += adv;
    }
    return n;
}

static void append_piece(char **buf, size_t *len, size_t *cap, const char *p, size_t n)
{
    if (*len + n + 1 > *cap) {
        *cap = (*len + n + 1) * 2;
        *buf = kvs_xrealloc(*buf, *cap);
    }
    memcpy(*buf + *len, p, n);
    *len += n;
    (*buf)[*len] = 0;
}

char *kvs_tokenizer_decode(const struct kvs_tokenizer *t, const int32_t *ids, int n, int skip_special)
{
    (void)t;
    size_t len = 0, cap = 16;
    char *buf = kvs_xmalloc(cap);
    buf[0] = 0;
    for (int i = 0; i < n; i++) {
        if (ids[i] < 256) {
            char b = (char)ids[i];
            append_piece(&buf, &len, &cap, &b, 1);
        } else if (!skip_special && ids[i] < FAKE_VOCAB) {
            append_piece(&buf, &len, &cap, k_special[ids[i] - 256], strlen(k_special[ids[i] - 256]));
        }
    }
    return buf;
}

void kvs_detok_init(struct kvs_detok *d, const struct kvs_tokenizer *t, int skip_special)
{
    memset(d, 0, sizeof *d);
    d->tok = t;
    d->skip_special = skip_special;
}

static int utf8_len(unsigned char b)
{
    if (b < 0x80) return 1;
    if ((b & 0xE0) == 0xC0) return 2;
    if ((b & 0xF0) == 0xE0) return 3;
    if ((b & 0xF8) == 0xF0) return 4;
    return 0;
}

int kvs_detok_flush(struct kvs_detok *d, char *out, size_t cap)
{
    if (!d->n_pending) {
        if (cap) out[0] = 0;
        return 0;
    }
    if (cap < 4) return -ENOSPC;
    memcpy(out, "\xEF\xBF\xBD", 4);
    d->n_pending = 0;
    return 3;
}

int kvs_detok_feed(struct kvs_detok *d, int32_t id, char *out, size_t cap)
{
    d->n_seen++;
    if (id >= 256) {
        int n = 0;
        if (d->n_pending) n = kvs_detok_flush(d, out, cap);
        if (n < 0) return n;
        const char *s = (d->skip_special || id >= FAKE_VOCAB) ? "" : k_special[id - 256];
        size_t sl = strlen(s);
        if ((size_t)n + sl + 1 > cap) return -ENOSPC;
        memcpy(out + n, s, sl + 1);
        return n + (int)sl;
    }
    unsigned char b = (unsigned char)id;
    int n = 0;
    if (d->n_pending && (b & 0xC0) != 0x80) { /* a new lead byte cuts a partial sequence short */
        n = kvs_detok_flush(d, out, cap);
        if (n < 0) return n;
    }
    if (!d->n_pending && utf8_len(b) == 0) { /* stray continuation byte */
        if ((size_t)n + 4 > cap) return -ENOSPC;
        memcpy(out + n, "\xEF\xBF\xBD", 4);
        return n + 3;
    }
    d->pending[d->n_pending++] = (char)b;
    if (d->n_pending == utf8_len((unsigned char)d->pending[0])) {
        if ((size_t)n + (size_t)d->n_pending + 1 > cap) return -ENOSPC;
        memcpy(out + n, d->pending, (size_t)d->n_pending);
        n += d->n_pending;
        d->n_pending = 0;
    }
    out[n] = 0;
    return n;
}

/* ---------------------------------------------------------------- engine */

#define FAKE_MAX_EVENTS 4096

struct kvs_request {
    atomic_int refs;
    uint64_t id;
    int32_t *prompt;
    int n_prompt;
    int max_tokens;
    char **stop;
    int n_stop;
    int ignore_eos, skip_special, logprobs, top_logprobs;
    int prompt_logprobs, scored;
    int inject_failure;
    double timeout_s;
    void (*notify)(void *);
    void *user;
    atomic_int cancelled;
    /* engine side */
    struct kvs_request *next;
    int blocks;
    int n_gen;
    double t_submit, t_sched, t_first, ready_at;
    struct kvs_detok detok;
    char *text;            /* generated text (detokenized) */
    size_t text_len, text_cap, emitted;
    /* event queue (mutex) */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct kvs_event *evs;
    int n_ev, cap_ev;
};

struct kvs_engine {
    const struct kvs_config *cfg;
    const struct kvs_tokenizer *tok;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int stop, draining;
    struct kvs_request *waiting, *running;
    int n_waiting, n_running;
    int blocks_total, blocks_used;
    struct kvs_engine_stats st;
    int max_ctx;
    double step_s, prefill_s;
};

static atomic_ullong g_next_id = 1;

struct kvs_request *kvs_request_new(const struct kvs_request_params *p, void (*notify)(void *user), void *user)
{
    if (!p || p->n_prompt <= 0 || !p->prompt) return NULL;
    struct kvs_request *r = kvs_xcalloc(1, sizeof *r);
    atomic_init(&r->refs, 1);
    r->id = atomic_fetch_add(&g_next_id, 1);
    r->prompt = kvs_xmalloc(sizeof *r->prompt * (size_t)p->n_prompt);
    memcpy(r->prompt, p->prompt, sizeof *r->prompt * (size_t)p->n_prompt);
    r->n_prompt = p->n_prompt;
    for (int i = 0; i + 6 <= p->n_prompt && !r->inject_failure; i++) {
        static const int32_t pat[6] = {'!', 'f', 'a', 'i', 'l', '!'};
        r->inject_failure = !memcmp(p->prompt + i, pat, sizeof pat);
    }
    r->max_tokens = p->max_tokens;
    r->n_stop = p->n_stop_strings;
    if (r->n_stop) r->stop = kvs_xcalloc((size_t)r->n_stop, sizeof *r->stop);
    for (int i = 0; i < r->n_stop; i++) r->stop[i] = kvs_xstrdup(p->stop_strings[i]);
    r->ignore_eos = p->ignore_eos;
    r->skip_special = p->skip_special;
    r->logprobs = p->sampling.logprobs || p->sampling.top_logprobs > 0;
    r->top_logprobs = p->sampling.top_logprobs;
    r->prompt_logprobs = p->prompt_logprobs;
    r->timeout_s = p->timeout_s;
    r->notify = notify;
    r->user = user;
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
    return r;
}

void kvs_request_ref(struct kvs_request *r) { atomic_fetch_add(&r->refs, 1); }

void kvs_event_clear(struct kvs_event *ev)
{
    free(ev->text);
    free(ev->error);
    memset(ev, 0, sizeof *ev);
}

void kvs_request_unref(struct kvs_request *r)
{
    if (!r || atomic_fetch_sub(&r->refs, 1) != 1) return;
    for (int i = 0; i < r->n_ev; i++) kvs_event_clear(&r->evs[i]);
    free(r->evs);
    for (int i = 0; i < r->n_stop; i++) free(r->stop[i]);
    free(r->stop);
    free(r->prompt);
    free(r->text);
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cv);
    free(r);
}

uint64_t kvs_request_id(const struct kvs_request *r) { return r->id; }
void kvs_request_cancel(struct kvs_request *r) { atomic_store(&r->cancelled, 1); }

static void push_event(struct kvs_request *r, struct kvs_event *ev)
{
    pthread_mutex_lock(&r->mu);
    if (r->n_ev == r->cap_ev) {
        r->cap_ev = r->cap_ev ? r->cap_ev * 2 : 16;
        r->evs = kvs_xrealloc(r->evs, sizeof *r->evs * (size_t)r->cap_ev);
    }
    r->evs[r->n_ev++] = *ev;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
}

int kvs_request_poll(struct kvs_request *r, struct kvs_event *out, int max)
{
    pthread_mutex_lock(&r->mu);
    int n = r->n_ev < max ? r->n_ev : max;
    if (n > 0) {
        memcpy(out, r->evs, sizeof *out * (size_t)n);
        memmove(r->evs, r->evs + n, sizeof *r->evs * (size_t)(r->n_ev - n));
        r->n_ev -= n;
    }
    pthread_mutex_unlock(&r->mu);
    return n;
}

int kvs_request_wait(struct kvs_request *r, struct kvs_event *out, int max, double timeout_s)
{
    double end = kvs_now() + timeout_s;
    pthread_mutex_lock(&r->mu);
    while (r->n_ev == 0 && kvs_now() < end) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 10 * 1000 * 1000;
        if (ts.tv_nsec >= 1000000000) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000;
        }
        pthread_cond_timedwait(&r->cv, &r->mu, &ts);
    }
    pthread_mutex_unlock(&r->mu);
    return kvs_request_poll(r, out, max);
}

static int blocks_for(const struct kvs_request *r) { return (r->n_prompt + r->max_tokens + FAKE_BLOCK - 1) / FAKE_BLOCK; }

int kvs_engine_create(const struct kvs_config *cfg, const struct kvs_model *model, const struct kvs_tokenizer *tok,
                      struct kvs_engine **out, char *err, size_t errlen)
{
    (void)model;
    (void)err;
    (void)errlen;
    double load_ms = env_num("KVS_FAKE_LOAD_MS", 0);
    if (load_ms > 0) usleep((useconds_t)(load_ms * 1000));
    struct kvs_engine *e = kvs_xcalloc(1, sizeof *e);
    e->cfg = cfg;
    e->tok = tok;
    e->blocks_total = (int)env_num("KVS_FAKE_BLOCKS", 512);
    e->max_ctx = cfg->max_model_len > 0 ? cfg->max_model_len : 256;
    e->step_s = env_num("KVS_FAKE_STEP_MS", 2) / 1000.0;
    e->prefill_s = env_num("KVS_FAKE_PREFILL_MS", 0) / 1000.0;
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->cv, NULL);
    extern void *fake_engine_main(void *);
    if (pthread_create(&e->thread, NULL, fake_engine_main, e) != 0) {
        free(e);
        return kvs_err(err, errlen, -EAGAIN, "cannot start the engine thread");
    }
    *out = e;
    return 0;
}

static void finish(struct kvs_engine *e, struct kvs_request *r, enum kvs_finish f, double now)
{
    struct kvs_event ev;
    memset(&ev, 0, sizeof ev);
    ev.type = KVS_EV_DONE;
    ev.finish = f;
    ev.n_prompt_tokens = r->n_prompt;
    ev.n_completion_tokens = r->n_gen;
    ev.queue_time_s = (r->t_sched > 0 ? r->t_sched : now) - r->t_submit;
    ev.ttft_s = (r->t_first > 0 ? r->t_first : now) - r->t_submit;
    ev.e2e_s = now - r->t_submit;
    e->blocks_used -= r->blocks;
    e->st.requests_finished++;
    push_event(r, &ev);
    if (r->notify) r->notify(r->user);
    kvs_request_unref(r);
}

/* Longest suffix of text that is a proper prefix of some stop string (held back while streaming). */
static size_t stop_holdback(const struct kvs_request *r)
{
    size_t best = 0;
    for (int s = 0; s < r->n_stop; s++) {
        size_t sl = strlen(r->stop[s]);
        for (size_t k = sl - 1; k > best; k--)
            if (k <= r->text_len && !memcmp(r->text + r->text_len - k, r->stop[s], k)) {
                best = k;
                break;
            }
    }
    return best;
}

/* PROMPT events of the whole prompt (prompt_logprobs), the model in the header comment. */
static void score_prompt(struct kvs_request *r)
{
    for (int p = 1; p < r->n_prompt; p++) {
        struct kvs_event ev;
        memset(&ev, 0, sizeof ev);
        ev.type = KVS_EV_PROMPT;
        ev.pos = p;
        ev.token = r->prompt[p];
        ev.logprob = logf(p % 2 ? 0.5f : 0.05f);
        ev.n_top = r->top_logprobs;
        for (int i = 0; i < ev.n_top; i++) {
            ev.top_ids[i] = p % 2 ? (i ? (ev.token + i) % 256 : ev.token) : (ev.token + 1 + i) % 256;
            ev.top_logprobs[i] = logf(0.5f / (float)(1 << i));
        }
        push_event(r, &ev);
    }
    r->scored = 1;
}

/* One decode step of one running request. Returns 1 when it finished. */
static int step_one(struct kvs_engine *e, struct kvs_request *r, double now)
{
    if (r->prompt_logprobs && !r->scored) score_prompt(r);
    if (r->max_tokens == 0) {
        finish(e, r, KVS_FINISH_LENGTH, now);
        return 1;
    }
    int k = r->n_gen;
    if (k == 2 && r->inject_failure) {
        struct kvs_event ev;
        memset(&ev, 0, sizeof ev);
        ev.type = KVS_EV_ERROR;
        ev.error = kvs_xstrdup("injected failure");
        ev.n_prompt_tokens = r->n_prompt;
        ev.n_completion_tokens = r->n_gen;
        e->blocks_used -= r->blocks;
        push_event(r, &ev);
        if (r->notify) r->notify(r->user);
        kvs_request_unref(r);
        return 1;
    }
    int32_t tok = r->prompt[r->n_prompt - 1 - (k % r->n_prompt)];
    if (!r->ignore_eos && (tok == FAKE_EOT || tok == FAKE_IM_END)) {
        finish(e, r, KVS_FINISH_STOP, now);
        return 1;
    }
    r->n_gen++;
    e->st.generation_tokens++;
    if (!r->t_first) r->t_first = now;
    char piece[64];
    int n = kvs_detok_feed(&r->detok, tok, piece, sizeof piece);
    if (n < 0) n = 0;
    append_piece(&r->text, &r->text_len, &r->text_cap, piece, (size_t)n);
    if (!r->text) append_piece(&r->text, &r->text_len, &r->text_cap, "", 0);
    /* stop strings: the earliest match ends the text there */
    size_t cut = (size_t)-1;
    for (int s = 0; s < r->n_stop; s++) {
        char *p = memmem(r->text, r->text_len, r->stop[s], strlen(r->stop[s]));
        if (p && (size_t)(p - r->text) < cut) cut = (size_t)(p - r->text);
    }
    int done = 0;
    enum kvs_finish f = KVS_FINISH_NONE;
    size_t upto;
    if (cut != (size_t)-1) {
        upto = cut < r->emitted ? r->emitted : cut;
        done = 1;
        f = KVS_FINISH_STOP;
    } else if (r->n_gen >= r->max_tokens) {
        upto = r->text_len;
        done = 1;
        f = KVS_FINISH_LENGTH;
    } else {
        upto = r->text_len - stop_holdback(r);
        if (upto < r->emitted) upto = r->emitted;
    }
    struct kvs_event ev;
    memset(&ev, 0, sizeof ev);
    ev.type = KVS_EV_TOKEN;
    ev.token = tok;
    ev.text = kvs_xmalloc(upto - r->emitted + 1);
    memcpy(ev.text, r->text + r->emitted, upto - r->emitted);
    ev.text[upto - r->emitted] = 0;
    r->emitted = upto;
    if (r->logprobs) {
        ev.logprob = logf(0.5f);
        ev.n_top = r->top_logprobs;
        for (int i = 0; i < ev.n_top; i++) {
            ev.top_ids[i] = (tok + i) % 256;
            ev.top_logprobs[i] = logf(0.5f / (float)(1 << i));
        }
    }
    push_event(r, &ev);
    if (done) {
        finish(e, r, f, now);
        return 1;
    }
    if (r->notify) r->notify(r->user);
    return 0;
}

void *fake_engine_main(void *arg)
{
    struct kvs_engine *e = arg;
    pthread_mutex_lock(&e->mu);
    while (!e->stop) {
        double now = kvs_now();
        /* admit in FIFO order while blocks and running slots last */
        int max_running = e->cfg->max_running > 0 ? e->cfg->max_running : 256;
        while (e->waiting && e->n_running < max_running && e->blocks_used + e->waiting->blocks <= e->blocks_total) {
            struct kvs_request *r = e->waiting;
            e->waiting = r->next;
            e->n_waiting--;
            r->next = e->running;
            e->running = r;
            e->n_running++;
            e->blocks_used += r->blocks;
            r->t_sched = now;
            r->ready_at = now + e->prefill_s;
            e->st.prompt_tokens += (uint64_t)r->n_prompt;
        }
        /* waiting requests can be cancelled or time out too */
        for (struct kvs_request **pp = &e->waiting; *pp;) {
            struct kvs_request *r = *pp;
            int cancel = atomic_load(&r->cancelled);
            int tmo = r->timeout_s > 0 && now - r->t_submit > r->timeout_s;
            if (cancel || tmo) {
                *pp = r->next;
                e->n_waiting--;
                e->blocks_used += r->blocks; /* finish() gives them back */
                finish(e, r, cancel ? KVS_FINISH_CANCELLED : KVS_FINISH_TIMEOUT, now);
            } else {
                pp = &r->next;
            }
        }
        for (struct kvs_request **pp = &e->running; *pp;) {
            struct kvs_request *r = *pp, *next = r->next; /* finish() may free r */
            int ended = 0;
            if (atomic_load(&r->cancelled)) {
                finish(e, r, KVS_FINISH_CANCELLED, now);
                ended = 1;
            } else if (r->timeout_s > 0 && now - r->t_submit > r->timeout_s) {
                finish(e, r, KVS_FINISH_TIMEOUT, now);
                ended = 1;
            } else if (now >= r->ready_at) {
                ended = step_one(e, r, now);
            }
            if (ended) {
                *pp = next;
                e->n_running--;
            } else {
                pp = &r->next;
            }
        }
        e->st.steps++;
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        long ns = (long)(e->step_s * 1e9);
        if (!e->running && !e->waiting) ns = 50 * 1000 * 1000;
        ts.tv_nsec += ns % 1000000000;
        ts.tv_sec += ns / 1000000000;
        if (ts.tv_nsec >= 1000000000) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000;
        }
        pthread_cond_timedwait(&e->cv, &e->mu, &ts);
    }
    double now = kvs_now();
    while (e->running) {
        struct kvs_request *r = e->running;
        e->running = r->next;
        finish(e, r, KVS_FINISH_CANCELLED, now);
    }
    while (e->waiting) {
        struct kvs_request *r = e->waiting;
        e->waiting = r->next;
        e->blocks_used += r->blocks;
        finish(e, r, KVS_FINISH_CANCELLED, now);
    }
    pthread_mutex_unlock(&e->mu);
    return NULL;
}

void kvs_engine_free(struct kvs_engine *e)
{
    if (!e) return;
    pthread_mutex_lock(&e->mu);
    e->stop = 1;
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->mu);
    pthread_join(e->thread, NULL);
    pthread_mutex_destroy(&e->mu);
    pthread_cond_destroy(&e->cv);
    free(e);
}

void kvs_engine_drain(struct kvs_engine *e)
{
    pthread_mutex_lock(&e->mu);
    e->draining = 1;
    pthread_mutex_unlock(&e->mu);
}

int kvs_engine_max_context(const struct kvs_engine *e) { return e->max_ctx; }

/* documents inline: the test double keeps no KV strategy */
int kvs_engine_doc_layout(const struct kvs_engine *e, int *align)
{
    (void)e;
    *align = 1;
    return 0;
}

void kvs_engine_stats(struct kvs_engine *e, struct kvs_engine_stats *out)
{
    pthread_mutex_lock(&e->mu);
    *out = e->st;
    out->num_running = e->n_running;
    out->num_waiting = e->n_waiting;
    out->kv_blocks_total = e->blocks_total;
    out->kv_blocks_used = e->blocks_used;
    out->block_size = FAKE_BLOCK;
    pthread_mutex_unlock(&e->mu);
}

int kvs_engine_submit(struct kvs_engine *e, struct kvs_request *r, char *err, size_t errlen)
{
    if (r->max_tokens < 0 || (r->max_tokens == 0 && !r->prompt_logprobs))
        return kvs_err(err, errlen, -EINVAL, "max_tokens must be positive");
    if (r->n_prompt + r->max_tokens > e->max_ctx)
        return kvs_err(err, errlen, -E2BIG, "This model's maximum context length is %d tokens", e->max_ctx);
    r->blocks = blocks_for(r);
    pthread_mutex_lock(&e->mu);
    int rc = 0;
    int max_waiting = e->cfg->max_waiting > 0 ? e->cfg->max_waiting : 1 << 30;
    if (e->draining) rc = kvs_err(err, errlen, -ESHUTDOWN, "draining");
    else if (r->blocks > e->blocks_total) rc = kvs_err(err, errlen, -E2BIG, "request needs more KV blocks than the pool has");
    else if (e->n_waiting >= max_waiting) {
        e->st.requests_rejected++;
        rc = kvs_err(err, errlen, -EAGAIN, "waiting queue full (%d)", max_waiting);
    }
    if (!rc) {
        kvs_request_ref(r);
        kvs_detok_init(&r->detok, e->tok, r->skip_special);
        r->t_submit = kvs_now();
        r->next = NULL;
        struct kvs_request **pp = &e->waiting;
        while (*pp) pp = &(*pp)->next;
        *pp = r;
        e->n_waiting++;
        pthread_cond_broadcast(&e->cv);
    }
    pthread_mutex_unlock(&e->mu);
    return rc;
}
