/* tokenizer.c: encode (added tokens -> normalizer -> pre-tokenizer -> BPE -> post-processor),
 * decode and streaming decode, and the small accessors.
 *
 * The order of operations follows Hugging Face tokenizers' TokenizerImpl::encode: added tokens
 * that are not "normalized" are cut out of the raw text first (leftmost-longest), each piece in
 * between is normalized on its own (so Llama-2's Prepend("▁") applies after every special
 * token), normalized added tokens are cut from the normalized text, then the pre-tokenizer
 * splits words and BPE runs per word. Invalid UTF-8 input is first replaced the way
 * String::from_utf8_lossy does, which is what a Python caller would have sent after
 * bytes.decode("utf-8", "replace").
 *
 * Per-call scratch (buffers, PCRE2 match data, BPE heap) is allocated per encode call and
 * freed before returning, so one tokenizer serves many threads.
 */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "engine/text/tokenizer_internal.h"

/* ---- pieces produced by pre-tokenizers ---- */

struct pieces {
    struct tk_buf buf;
    size_t *off, *len;
    size_t n, cap;
};

static int pieces_add(struct pieces *p, const char *s, size_t n)
{
    if (n == 0) return 0;
    if (p->n == p->cap) {
        size_t cap = p->cap ? p->cap * 2 : 64;
        size_t *o = realloc(p->off, cap * sizeof *o);
        if (!o) return -ENOMEM;
        p->off = o;
        size_t *l = realloc(p->len, cap * sizeof *l);
        if (!l) return -ENOMEM;
        p->len = l;
        p->cap = cap;
    }
    p->off[p->n] = p->buf.n;
    p->len[p->n] = n;
    p->n++;
    return tk_buf_put(&p->buf, s, n);
}

/* Appends to the last piece (MergedWithPrevious) or starts one. */
static int pieces_extend(struct pieces *p, size_t base, const char *s, size_t n)
{
    if (n == 0) return 0;
    if (p->n == base) return pieces_add(p, s, n);
    p->len[p->n - 1] += n;
    return tk_buf_put(&p->buf, s, n);
}

static void pieces_clear(struct pieces *p)
{
    p->n = 0;
    p->buf.n = 0;
}

static void pieces_free(struct pieces *p)
{
    free(p->buf.p);
    free(p->off);
    free(p->len);
}

/* ---- word cache ---- */

struct tk_cache {
    pthread_mutex_t mu;
    struct tk_cache_slot slot[TK_CACHE_SLOTS];
};

struct tk_cache *tk_cache_new(void)
{
    struct tk_cache *c = calloc(1, sizeof *c);
    if (c && pthread_mutex_init(&c->mu, NULL) != 0) {
        free(c);
        return NULL;
    }
    return c;
}

void tk_cache_free(struct tk_cache *c)
{
    if (!c) return;
    pthread_mutex_destroy(&c->mu);
    free(c);
}

static uint32_t word_hash(const char *s, size_t n)
{
    uint32_t h = 2166136261u;
    for (size_t i = 0; i < n; i++) h = (h ^ (uint8_t)s[i]) * 16777619u;
    return h ^ (h >> 15);
}

static int bpe_cached(const struct kvs_tokenizer *t, const char *w, size_t n, struct tk_ids *out, void *scratch)
{
    struct tk_cache *c = t->cache;
    if (!c || n == 0 || n > TK_CACHE_WORD) return tk_bpe_word(t, w, n, out, scratch);
    struct tk_cache_slot *sl = &c->slot[word_hash(w, n) & (TK_CACHE_SLOTS - 1)];
    int32_t ids[TK_CACHE_IDS];
    int hit = 0, nids = 0;
    pthread_mutex_lock(&c->mu);
    if (sl->wlen == n && memcmp(sl->word, w, n) == 0) {
        hit = 1;
        nids = sl->nids;
        memcpy(ids, sl->ids, (size_t)nids * sizeof *ids);
    }
    pthread_mutex_unlock(&c->mu);
    if (hit) {
        for (int i = 0; i < nids; i++)
            if (tk_ids_push(out, ids[i]) != 0) return -ENOMEM;
        return 0;
    }
    size_t before = out->n;
    int rc = tk_bpe_word(t, w, n, out, scratch);
    if (rc || out->n - before > TK_CACHE_IDS) return rc;
    pthread_mutex_lock(&c->mu);
    sl->wlen = (uint8_t)n;
    memcpy(sl->word, w, n);
    sl->nids = (uint8_t)(out->n - before);
    if (sl->nids) memcpy(sl->ids, out->p + before, (size_t)sl->nids * sizeof *sl->ids);
    pthread_mutex_unlock(&c->mu);
    return 0;
}

struct enc {
    const struct kvs_tokenizer *t;
    int parse_special;
    struct tk_ids out;
    struct tk_buf lossy, norm, tmp;
    struct pieces pa, pb;
    pcre2_match_data *md;
    pcre2_match_context *mctx;
    pcre2_jit_stack *jstack;
    void *bpe;
};

/* Matches re over s[0..n) into segments (start, end, is_match) covering s. */
struct seg {
    size_t a, b;
    int m;
};

static int regex_segments(struct enc *e, const pcre2_code *re, const char *s, size_t n, struct seg **segs, size_t *nseg,
                          size_t *capseg)
{
    size_t pos = 0, prev = 0;
    *nseg = 0;
    while (pos <= n) {
        int rc = pcre2_match(re, (PCRE2_SPTR)s, n, pos, PCRE2_NO_UTF_CHECK, e->md, e->mctx);
        if (rc == PCRE2_ERROR_JIT_STACKLIMIT && !e->jstack) {
            /* very long runs can need more than the default 32 KiB JIT stack */
            e->mctx = pcre2_match_context_create(NULL);
            e->jstack = pcre2_jit_stack_create(64 * 1024, 64 * 1024 * 1024, NULL);
            if (!e->mctx || !e->jstack) return -ENOMEM;
            pcre2_jit_stack_assign(e->mctx, NULL, e->jstack);
            continue;
        }
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) return -EINVAL;
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(e->md);
        size_t ms = ov[0], me = ov[1];
        if (me <= ms) { /* empty match: step one character */
            if (pos >= n) break;
            pos++;
            while (pos < n && ((uint8_t)s[pos] & 0xC0) == 0x80) pos++;
            continue;
        }
        for (int k = 0; k < 2; k++) {
            size_t a = k == 0 ? prev : ms, b = k == 0 ? ms : me;
            if (a == b) continue;
            if (*nseg == *capseg) {
                size_t cap = *capseg ? *capseg * 2 : 64;
                struct seg *p = realloc(*segs, cap * sizeof *p);
                if (!p) return -ENOMEM;
                *segs = p;
                *capseg = cap;
            }
            (*segs)[(*nseg)++] = (struct seg){a, b, k == 1};
        }
        prev = pos = me;
    }
    if (prev < n) {
        if (*nseg == *capseg) {
            size_t cap = *capseg ? *capseg * 2 : 64;
            struct seg *p = realloc(*segs, cap * sizeof *p);
            if (!p) return -ENOMEM;
            *segs = p;
            *capseg = cap;
        }
        (*segs)[(*nseg)++] = (struct seg){prev, n, 0};
    }
    return 0;
}

static int split_piece(struct enc *e, const struct tk_pre *pr, const char *s, size_t n, struct pieces *out, struct seg **segs,
                       size_t *capseg)
{
    size_t ns;
    int rc = regex_segments(e, pr->re, s, n, segs, &ns, capseg);
    if (rc) return rc;
    struct seg *sg = *segs;
    size_t base = out->n;
    /* HF's SplitDelimiterBehavior, segment by segment: does segment i start a new piece? */
    for (size_t i = 0; i < ns && rc == 0; i++) {
        int m = sg[i].m ^ pr->invert, pm = i > 0 ? sg[i - 1].m ^ pr->invert : 0;
        const char *p = s + sg[i].a;
        size_t l = sg[i].b - sg[i].a;
        int join = 0;
        switch (pr->behavior) {
        case TK_SPLIT_ISOLATED:
            break;
        case TK_SPLIT_REMOVED:
            if (m) continue;
            break;
        case TK_SPLIT_MERGED_PREV:
            join = i > 0 && m && !pm;
            break;
        case TK_SPLIT_MERGED_NEXT:
            join = i > 0 && pm && !m;
            break;
        case TK_SPLIT_CONTIGUOUS:
            join = i > 0 && m == pm;
            break;
        }
        rc = join ? pieces_extend(out, base, p, l) : pieces_add(out, p, l);
    }
    return rc;
}

static int pretokenize(struct enc *e, const char *s, size_t n, int at_start)
{
    const struct kvs_tokenizer *t = e->t;
    struct pieces *in = &e->pa, *out = &e->pb;
    struct seg *segs = NULL;
    size_t capseg = 0;
    int rc;
    pieces_clear(in);
    if ((rc = pieces_add(in, s, n))) return rc;
    for (int k = 0; k < t->n_pres; k++) {
        const struct tk_pre *pr = &t->pres[k];
        pieces_clear(out);
        for (size_t i = 0; i < in->n && rc == 0; i++) {
            const char *p = in->buf.p + in->off[i];
            size_t l = in->len[i];
            if (pr->kind == TK_PRE_BYTELEVEL) {
                if (pr->add_prefix_space && p[0] != ' ') {
                    e->tmp.n = 0;
                    if ((rc = tk_buf_put(&e->tmp, " ", 1)) || (rc = tk_buf_put(&e->tmp, p, l))) break;
                    p = e->tmp.p;
                    l = e->tmp.n;
                }
                rc = pr->re ? split_piece(e, pr, p, l, out, &segs, &capseg) : pieces_add(out, p, l);
            } else if (pr->kind == TK_PRE_METASPACE) {
                size_t rl = strlen(pr->replacement);
                e->tmp.n = 0;
                int first = at_start && i == 0 && in->off[i] == 0;
                int pre = pr->prepend_scheme == 2 || (pr->prepend_scheme == 1 && first);
                rc = tk_buf_put(&e->tmp, "", 0);
                for (size_t j = 0; j < l && rc == 0; j++)
                    rc = p[j] == ' ' ? tk_buf_put(&e->tmp, pr->replacement, rl) : tk_buf_put(&e->tmp, p + j, 1);
                if (rc) break;
                if (pre && !(e->tmp.n >= rl && memcmp(e->tmp.p, pr->replacement, rl) == 0)) {
                    struct tk_buf b2 = {0};
                    if ((rc = tk_buf_put(&b2, pr->replacement, rl)) || (rc = tk_buf_put(&b2, e->tmp.p, e->tmp.n))) {
                        free(b2.p);
                        break;
                    }
                    free(e->tmp.p);
                    e->tmp = b2;
                }
                if (!pr->split) {
                    rc = pieces_add(out, e->tmp.p, e->tmp.n);
                } else { /* split on the replacement, MergedWithNext */
                    size_t a = 0;
                    for (size_t j = 1; j + rl <= e->tmp.n && rc == 0; j++)
                        if (memcmp(e->tmp.p + j, pr->replacement, rl) == 0) {
                            rc = pieces_add(out, e->tmp.p + a, j - a);
                            a = j;
                        }
                    if (rc == 0) rc = pieces_add(out, e->tmp.p + a, e->tmp.n - a);
                }
            } else {
                rc = split_piece(e, pr, p, l, out, &segs, &capseg);
            }
        }
        if (rc) break;
        struct pieces sw = *in;
        *in = *out;
        *out = sw;
    }
    free(segs);
    if (rc) return rc;
    for (size_t i = 0; i < in->n; i++) {
        const char *w = in->buf.p + in->off[i];
        size_t wl = in->len[i], a = 0;
        if (t->sp_split) /* cut before each "▁" run that follows another character */
            for (size_t j = 1; j + 3 <= wl; j++)
                if (memcmp(w + j, "\xe2\x96\x81", 3) == 0 && !(j >= 3 && memcmp(w + j - 3, "\xe2\x96\x81", 3) == 0)) {
                    if ((rc = bpe_cached(t, w + a, j - a, &e->out, e->bpe))) return rc;
                    a = j;
                    j += 2;
                }
        if ((rc = bpe_cached(t, w + a, wl - a, &e->out, e->bpe))) return rc;
    }
    return 0;
}

/* ---- added tokens ---- */

static uint32_t cp_before(const char *s, size_t pos)
{
    if (pos == 0) return 0;
    size_t i = pos - 1;
    while (i > 0 && ((uint8_t)s[i] & 0xC0) == 0x80) i--;
    uint32_t cp = 0;
    if (tk_utf8_next((const uint8_t *)s + i, pos - i, &cp) <= 0) return 0;
    return cp;
}

static int is_word_cp(uint32_t cp)
{
    if (cp == 0) return 0;
    utf8proc_category_t c = utf8proc_category((utf8proc_int32_t)cp);
    return (c >= UTF8PROC_CATEGORY_LU && c <= UTF8PROC_CATEGORY_LO) || (c >= UTF8PROC_CATEGORY_ND && c <= UTF8PROC_CATEGORY_NO);
}

typedef int (*text_fn)(struct enc *e, const char *s, size_t n, int at_start);

/* Cuts added tokens out of s (leftmost-longest, non-overlapping), emitting their ids and
 * handing the text between them to fn. Special tokens are ignored when !parse_special, as
 * HF's encode_special_tokens does: the match is skipped, not re-searched. */
static int split_added(struct enc *e, const struct tk_trie *tr, int use_norm, const char *s, size_t n, int at_start,
                       text_fn fn)
{
    const struct kvs_tokenizer *t = e->t;
    size_t i = 0, start_off = 0;
    int rc;
    while (i < n) {
        int32_t ai;
        size_t ml = tk_trie_longest(tr, s + i, n - i, &ai);
        if (ml == 0) {
            i++;
            continue;
        }
        const struct tk_added *a = &t->added[ai];
        size_t ms = i, me = i + ml;
        if (a->special && !e->parse_special) {
            i = me;
            continue;
        }
        if (a->single_word) {
            uint32_t after = 0;
            if (me < n) tk_utf8_next((const uint8_t *)s + me, n - me, &after);
            if (is_word_cp(cp_before(s, ms)) || is_word_cp(after)) {
                i = me;
                continue;
            }
        }
        if (a->lstrip) {
            while (ms > start_off) {
                uint32_t cp = cp_before(s, ms);
                if (!tk_is_whitespace(cp)) break;
                char tmp[4];
                ms -= (size_t)tk_utf8_put(tmp, cp);
            }
        }
        if (a->rstrip) {
            while (me < n) {
                uint32_t cp;
                int k = tk_utf8_next((const uint8_t *)s + me, n - me, &cp);
                if (k <= 0 || !tk_is_whitespace(cp)) break;
                me += (size_t)k;
            }
        }
        if (ms > start_off && (rc = fn(e, s + start_off, ms - start_off, at_start && start_off == 0))) return rc;
        if ((rc = tk_ids_push(&e->out, a->id))) return rc;
        (void)use_norm;
        start_off = i = me;
    }
    if (start_off < n && (rc = fn(e, s + start_off, n - start_off, at_start && start_off == 0))) return rc;
    return 0;
}

static int normalized_text(struct enc *e, const char *s, size_t n, int at_start)
{
    return pretokenize(e, s, n, at_start);
}

static int raw_text(struct enc *e, const char *s, size_t n, int at_start)
{
    int rc = tk_normalize(e->t, s, n, &e->norm);
    if (rc) return rc;
    if (e->t->trie_norm.n_nodes > 1) {
        /* the normalized text must outlive the nested calls, which reuse e->norm */
        char *copy = malloc(e->norm.n + 1);
        if (!copy) return -ENOMEM;
        memcpy(copy, e->norm.p, e->norm.n);
        size_t len = e->norm.n;
        rc = split_added(e, &e->t->trie_norm, 1, copy, len, at_start, normalized_text);
        free(copy);
        return rc;
    }
    return pretokenize(e, e->norm.p, e->norm.n, at_start);
}

int kvs_tokenizer_encode(const struct kvs_tokenizer *t, const char *text, size_t len, int add_special, int parse_special,
                         int32_t *ids, int cap)
{
    if (!t || (!text && len) || cap < 0 || (cap > 0 && !ids)) return -EINVAL;
    struct enc e = {.t = t, .parse_special = parse_special};
    int rc = 0;
    e.bpe = tk_bpe_scratch_new();
    e.md = pcre2_match_data_create(4, NULL);
    if (!e.bpe || !e.md) {
        rc = -ENOMEM;
        goto out;
    }
    const char *s = text ? text : "";
    if (!tk_utf8_valid(s, len)) {
        if ((rc = tk_utf8_lossy(&e.lossy, s, len))) goto out;
        s = e.lossy.p;
        len = e.lossy.n;
    }
    if (add_special)
        for (int i = 0; i < t->n_pre_ids && rc == 0; i++) rc = tk_ids_push(&e.out, t->pre_ids[i]);
    if (rc == 0) rc = split_added(&e, &t->trie_raw, 0, s, len, 1, raw_text);
    if (add_special)
        for (int i = 0; i < t->n_post_ids && rc == 0; i++) rc = tk_ids_push(&e.out, t->post_ids[i]);
    if (rc) goto out;
    if (e.out.n > INT32_MAX) {
        rc = -E2BIG;
        goto out;
    }
    size_t ncopy = e.out.n < (size_t)cap ? e.out.n : (size_t)cap;
    if (ncopy) memcpy(ids, e.out.p, ncopy * sizeof *ids);
    rc = (int)e.out.n;
out:
    tk_bpe_scratch_free(e.bpe);
    pcre2_match_data_free(e.md);
    pcre2_match_context_free(e.mctx);
    pcre2_jit_stack_free(e.jstack);
    free(e.out.p);
    free(e.lossy.p);
    free(e.norm.p);
    free(e.tmp.p);
    pieces_free(&e.pa);
    pieces_free(&e.pb);
    return rc;
}

/* ---- decoding ---- */

/* Output sink: a growable buffer (decode) or the caller's fixed one (detok). */
struct sink {
    char *p;
    size_t n, cap;
    int grow, overflow;
};

static void sink_put_raw(struct sink *o, const char *s, size_t n)
{
    if (o->overflow) return;
    if (o->n + n + 1 > o->cap) {
        if (!o->grow) {
            o->overflow = 1;
            return;
        }
        size_t cap = o->cap ? o->cap : 64;
        while (cap < o->n + n + 1) cap *= 2;
        char *p = realloc(o->p, cap);
        if (!p) {
            o->overflow = 1;
            return;
        }
        o->p = p;
        o->cap = cap;
    }
    memcpy(o->p + o->n, s, n);
    o->n += n;
    o->p[o->n] = 0;
}

/* Writes complete text, applying the decoder's Strip of leading spaces (n_seen counts the
 * leading characters examined so far). */
static void emit(struct kvs_detok *d, struct sink *o, const char *s, size_t n)
{
    const struct kvs_tokenizer *t = d->tok;
    if (t->dec_kind == TK_DEC_PIECES && d->n_seen < t->dec_strip_start) {
        while (n > 0 && d->n_seen < t->dec_strip_start) {
            if (s[0] == ' ') {
                s++;
                n--;
                d->n_seen++;
            } else {
                d->n_seen = t->dec_strip_start;
            }
        }
    }
    sink_put_raw(o, s, n);
}

static const char REPL[3] = {(char)0xEF, (char)0xBF, (char)0xBD};

/* Feeds bytes through the UTF-8 assembler. per_byte: an invalid sequence yields one U+FFFD per
 * byte (HF ByteFallback); otherwise one per maximal invalid subpart (from_utf8_lossy). */
static void feed_bytes(struct kvs_detok *d, struct sink *o, const uint8_t *b, size_t n, int per_byte)
{
    size_t i = 0;
    while (d->n_pending > 0 && i < n) {
        uint8_t tmp[8];
        memcpy(tmp, d->pending, (size_t)d->n_pending);
        tmp[d->n_pending] = b[i];
        uint32_t cp;
        int r = tk_utf8_next(tmp, (size_t)d->n_pending + 1, &cp);
        if (r > 0) {
            emit(d, o, (const char *)tmp, (size_t)r);
            d->n_pending = 0;
            i++;
        } else if (r == 0) {
            d->pending[d->n_pending++] = (char)b[i++];
        } else {
            int k = per_byte ? d->n_pending : 1;
            for (int j = 0; j < k; j++) emit(d, o, REPL, 3);
            d->n_pending = 0; /* b[i] is examined again from scratch */
        }
    }
    size_t run = i;
    while (i < n) {
        if (b[i] < 0x80) {
            i++;
            continue;
        }
        uint32_t cp;
        int r = tk_utf8_next(b + i, n - i, &cp);
        if (r > 0) {
            i += (size_t)r;
            continue;
        }
        emit(d, o, (const char *)b + run, i - run);
        if (r == 0) {
            memcpy(d->pending, b + i, n - i);
            d->n_pending = (int)(n - i);
            return;
        }
        int k = per_byte ? -r : 1;
        for (int j = 0; j < k; j++) emit(d, o, REPL, 3);
        i += (size_t)-r;
        run = i;
    }
    emit(d, o, (const char *)b + run, n - run);
}

static void flush_pending(struct kvs_detok *d, struct sink *o)
{
    if (d->n_pending == 0) return;
    int k = d->tok->dec_kind == TK_DEC_BYTELEVEL ? 1 : d->n_pending;
    d->n_pending = 0;
    for (int j = 0; j < k; j++) emit(d, o, REPL, 3);
}

static void detok_step(struct kvs_detok *d, int32_t id, struct sink *o)
{
    const struct kvs_tokenizer *t = d->tok;
    if (id < 0 || id >= t->n_ids || !t->tok_str[id]) return; /* HF drops unknown ids */
    if (d->skip_special && t->tok_special[id]) return;
    const uint8_t *b = (const uint8_t *)t->tok_dec[id];
    size_t n = t->tok_dec_len[id];
    switch (t->dec_kind) {
    case TK_DEC_BYTELEVEL:
        feed_bytes(d, o, b, n, 0);
        break;
    case TK_DEC_PIECES:
        if (t->dec_byte_fallback && t->tok_byte[id] >= 0) {
            uint8_t c = (uint8_t)t->tok_byte[id];
            feed_bytes(d, o, &c, 1, 1);
        } else {
            flush_pending(d, o);
            feed_bytes(d, o, b, n, 1);
        }
        break;
    case TK_DEC_NONE:
        flush_pending(d, o);
        if (d->n_seen++ > 0) emit(d, o, " ", 1);
        feed_bytes(d, o, b, n, 0);
        flush_pending(d, o);
        break;
    }
}

char *kvs_tokenizer_decode(const struct kvs_tokenizer *t, const int32_t *ids, int n, int skip_special)
{
    struct kvs_detok d;
    struct sink o = {.grow = 1};
    kvs_detok_init(&d, t, skip_special);
    for (int i = 0; i < n; i++) detok_step(&d, ids[i], &o);
    flush_pending(&d, &o);
    sink_put_raw(&o, "", 0);
    if (o.overflow) {
        free(o.p);
        return NULL;
    }
    return o.p;
}

void kvs_detok_init(struct kvs_detok *d, const struct kvs_tokenizer *t, int skip_special)
{
    memset(d, 0, sizeof *d);
    d->tok = t;
    d->skip_special = skip_special;
}

int kvs_detok_feed(struct kvs_detok *d, int32_t id, char *out, size_t cap)
{
    if (!out || cap == 0) return -ENOSPC;
    struct kvs_detok saved = *d;
    struct sink o = {.p = out, .cap = cap};
    out[0] = 0;
    detok_step(d, id, &o);
    if (o.overflow) {
        *d = saved; /* unchanged: the caller may retry with a bigger buffer */
        out[0] = 0;
        return -ENOSPC;
    }
    return (int)o.n;
}

int kvs_detok_flush(struct kvs_detok *d, char *out, size_t cap)
{
    if (!out || cap == 0) return -ENOSPC;
    struct kvs_detok saved = *d;
    struct sink o = {.p = out, .cap = cap};
    out[0] = 0;
    flush_pending(d, &o);
    if (o.overflow) {
        *d = saved;
        out[0] = 0;
        return -ENOSPC;
    }
    return (int)o.n;
}

/* ---- accessors ---- */

int kvs_tokenizer_vocab_size(const struct kvs_tokenizer *t)
{
    return t->n_ids;
}

int kvs_tokenizer_bos(const struct kvs_tokenizer *t)
{
    return t->bos;
}

int kvs_tokenizer_eos(const struct kvs_tokenizer *t, const int32_t **ids)
{
    if (ids) *ids = t->eos;
    return t->n_eos;
}

int kvs_tokenizer_add_bos_default(const struct kvs_tokenizer *t)
{
    return t->add_bos_default;
}

int32_t kvs_tokenizer_token_id(const struct kvs_tokenizer *t, const char *token)
{
    if (!token) return -1;
    size_t n = strlen(token);
    for (int i = 0; i < t->n_added; i++)
        if (t->added[i].len == n && memcmp(t->added[i].content, token, n) == 0) return t->added[i].id;
    return tk_strmap_get(&t->vocab, token, n);
}

int kvs_tokenizer_is_special(const struct kvs_tokenizer *t, int32_t id)
{
    return id >= 0 && id < t->n_ids && t->tok_special[id];
}
