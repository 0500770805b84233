/* tokenizer_bpe.c: the BPE merge core for one pre-tokenized word.
 *
 * Symbols live in a doubly linked list over arrays; candidate merges sit in a binary min-heap
 * ordered by (rank, position), so a word of n symbols costs O(n log n) instead of the naive
 * O(n^2) rescans (matters for 3,000-space runs and for SentencePiece, which has no
 * pre-tokenizer and merges whole lines). Stale heap entries are dropped when popped, checking
 * the pair still produces the same token, exactly as Hugging Face's Word::merge_all does.
 * The scratch arrays are per call (one per encode), so the tokenizer itself stays read-only.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "engine/text/tokenizer_internal.h"

struct heap_ent {
    int32_t rank, pos, id;
};

struct bpe_scratch {
    int32_t *sym, *prev, *next;   /* [cap] */
    size_t cap;
    struct heap_ent *heap;        /* [hcap] */
    size_t hn, hcap;
    struct tk_buf mapped;         /* byte-level text of the word (ignore_merges lookups) */
};

void *tk_bpe_scratch_new(void)
{
    return calloc(1, sizeof(struct bpe_scratch));
}

void tk_bpe_scratch_free(void *p)
{
    struct bpe_scratch *s = p;
    if (!s) return;
    free(s->sym);
    free(s->prev);
    free(s->next);
    free(s->heap);
    free(s->mapped.p);
    free(s);
}

static int reserve(struct bpe_scratch *s, size_t n)
{
    if (n <= s->cap) return 0;
    size_t cap = s->cap ? s->cap : 64;
    while (cap < n) cap *= 2;
    int32_t *a = realloc(s->sym, cap * sizeof *a);
    if (!a) return -ENOMEM;
    s->sym = a;
    a = realloc(s->prev, cap * sizeof *a);
    if (!a) return -ENOMEM;
    s->prev = a;
    a = realloc(s->next, cap * sizeof *a);
    if (!a) return -ENOMEM;
    s->next = a;
    struct heap_ent *h = realloc(s->heap, cap * 2 * sizeof *h);
    if (!h) return -ENOMEM;
    s->heap = h;
    s->hcap = cap * 2;
    s->cap = cap;
    return 0;
}

static int heap_less(const struct heap_ent *a, const struct heap_ent *b)
{
    return a->rank < b->rank || (a->rank == b->rank && a->pos < b->pos);
}

static int heap_push(struct bpe_scratch *s, struct heap_ent e)
{
    if (s->hn == s->hcap) {
        struct heap_ent *h = realloc(s->heap, s->hcap * 2 * sizeof *h);
        if (!h) return -ENOMEM;
        s->heap = h;
        s->hcap *= 2;
    }
    size_t i = s->hn++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!heap_less(&e, &s->heap[p])) break;
        s->heap[i] = s->heap[p];
        i = p;
    }
    s->heap[i] = e;
    return 0;
}

static struct heap_ent heap_pop(struct bpe_scratch *s)
{
    struct heap_ent top = s->heap[0], last = s->heap[--s->hn];
    size_t i = 0, n = s->hn;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && heap_less(&s->heap[c + 1], &s->heap[c])) c++;
        if (!heap_less(&s->heap[c], &last)) break;
        s->heap[i] = s->heap[c];
        i = c;
    }
    if (n) s->heap[i] = last;
    return top;
}

static int push_pair(const struct kvs_tokenizer *t, struct bpe_scratch *s, int32_t pos)
{
    if (pos < 0) return 0;
    int32_t nx = s->next[pos];
    if (nx < 0) return 0;
    const struct tk_merge_ent *m = tk_mergemap_get(&t->merges, s->sym[pos], s->sym[nx]);
    if (!m) return 0;
    return heap_push(s, (struct heap_ent){m->rank, pos, m->id});
}

/* Unknown characters: HF keeps one pending <unk> and extends it while fuse_unk is set. */
struct unk_state {
    int pending;
};

static int add_sym(struct bpe_scratch *s, size_t *n, int32_t id)
{
    if (reserve(s, *n + 1) != 0) return -ENOMEM;
    s->sym[(*n)++] = id;
    return 0;
}

static int flush_unk(const struct kvs_tokenizer *t, struct bpe_scratch *s, size_t *n, struct unk_state *u)
{
    if (!u->pending) return 0;
    u->pending = 0;
    return add_sym(s, n, t->unk_id);
}

static int on_unknown(const struct kvs_tokenizer *t, struct bpe_scratch *s, size_t *n, struct unk_state *u)
{
    if (t->unk_id < 0) return 0; /* HF drops characters it cannot represent when there is no unk */
    if (u->pending && !t->fuse_unk) {
        if (add_sym(s, n, t->unk_id) != 0) return -ENOMEM;
    }
    u->pending = 1;
    return 0;
}

int tk_bpe_word(const struct kvs_tokenizer *t, const char *w, size_t len, struct tk_ids *out, void *scratch)
{
    struct bpe_scratch *s = scratch;
    size_t n = 0;
    struct unk_state u = {0};
    if (len == 0) return 0;

    if (t->byte_level) {
        if (t->ignore_merges) {
            s->mapped.n = 0;
            for (size_t i = 0; i < len; i++) {
                char tmp[4];
                int k = tk_utf8_put(tmp, tk_byte_to_cp((uint8_t)w[i]));
                if (tk_buf_put(&s->mapped, tmp, (size_t)k) != 0) return -ENOMEM;
            }
            int32_t id = tk_strmap_get(&t->vocab, s->mapped.p, s->mapped.n);
            if (id >= 0) return tk_ids_push(out, id);
        }
        if (reserve(s, len) != 0) return -ENOMEM;
        for (size_t i = 0; i < len; i++) {
            int32_t id = t->byte_id[(uint8_t)w[i]];
            if (id >= 0) {
                if (flush_unk(t, s, &n, &u) || add_sym(s, &n, id)) return -ENOMEM;
            } else if (on_unknown(t, s, &n, &u) != 0) {
                return -ENOMEM;
            }
        }
    } else {
        if (t->ignore_merges) {
            int32_t id = tk_strmap_get(&t->vocab, w, len);
            if (id >= 0) return tk_ids_push(out, id);
        }
        const uint8_t *p = (const uint8_t *)w;
        size_t i = 0;
        while (i < len) {
            uint32_t cp;
            int k = tk_utf8_next(p + i, len - i, &cp);
            size_t cl = k > 0 ? (size_t)k : 1; /* input is valid UTF-8; be safe anyway */
            int32_t id = tk_strmap_get(&t->vocab, w + i, cl);
            if (id >= 0) {
                if (flush_unk(t, s, &n, &u) || add_sym(s, &n, id)) return -ENOMEM;
            } else {
                int all = t->byte_fallback;
                for (size_t j = 0; all && j < cl; j++) all = t->byte_id[p[i + j]] >= 0;
                if (all) {
                    /* HF adds the byte tokens without flushing a pending <unk> first */
                    for (size_t j = 0; j < cl; j++)
                        if (add_sym(s, &n, t->byte_id[p[i + j]]) != 0) return -ENOMEM;
                } else if (on_unknown(t, s, &n, &u) != 0) {
                    return -ENOMEM;
                }
            }
            i += cl;
        }
    }
    if (flush_unk(t, s, &n, &u) != 0) return -ENOMEM;
    if (n == 0) return 0;
    if (reserve(s, n) != 0) return -ENOMEM;
    for (size_t i = 0; i < n; i++) {
        s->prev[i] = (int32_t)i - 1;
        s->next[i] = i + 1 < n ? (int32_t)i + 1 : -1;
    }
    s->hn = 0;
    for (size_t i = 0; i + 1 < n; i++)
        if (push_pair(t, s, (int32_t)i) != 0) return -ENOMEM;
    while (s->hn > 0) {
        struct heap_ent top = heap_pop(s);
        int32_t pos = top.pos, nx = s->next[pos];
        if (s->sym[pos] < 0 || nx < 0) continue;
        const struct tk_merge_ent *m = tk_mergemap_get(&t->merges, s->sym[pos], s->sym[nx]);
        if (!m || m->id != top.id) continue;
        s->sym[pos] = m->id;
        s->next[pos] = s->next[nx];
        if (s->next[nx] >= 0) s->prev[s->next[nx]] = pos;
        s->sym[nx] = -1;
        if (push_pair(t, s, s->prev[pos]) != 0 || push_pair(t, s, pos) != 0) return -ENOMEM;
    }
    for (int32_t i = 0; i >= 0; i = s->next[i])
        if (tk_ids_push(out, s->sym[i]) != 0) return -ENOMEM;
    return 0;
}
