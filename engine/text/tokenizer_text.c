/* tokenizer_text.c: helpers for the tokenizer: growable buffers, string and merge hash tables,
 * UTF-8 (lossy decoding with the maximal-subpart rule), the GPT-2 byte mapping, the added-token
 * trie and the normalizers (NFC & co via utf8proc, Prepend, Replace).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "engine/text/tokenizer_internal.h"

/* ---- buffers ---- */

int tk_buf_put(struct tk_buf *b, const void *s, size_t n)
{
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 64;
        while (cap < b->n + n + 1) cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) return -ENOMEM;
        b->p = p;
        b->cap = cap;
    }
    if (n) memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
    return 0;
}

int tk_ids_push(struct tk_ids *v, int32_t id)
{
    if (v->n == v->cap) {
        size_t cap = v->cap ? v->cap * 2 : 64;
        int32_t *p = realloc(v->p, cap * sizeof *p);
        if (!p) return -ENOMEM;
        v->p = p;
        v->cap = cap;
    }
    v->p[v->n++] = id;
    return 0;
}

/* ---- hashing ---- */

static uint64_t hash_bytes(const char *s, size_t n)
{
    uint64_t h = 1469598103934665603ull; /* FNV-1a, then a final mix */
    for (size_t i = 0; i < n; i++) h = (h ^ (uint8_t)s[i]) * 1099511628211ull;
    h ^= h >> 29;
    h *= 0xbf58476d1ce4e5b9ull;
    h ^= h >> 32;
    return h;
}

static uint64_t hash_u64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

static uint32_t pow2_cap(uint32_t expected)
{
    uint32_t cap = 16;
    while (cap < expected * 2 + 1 && cap < (1u << 30)) cap *= 2;
    return cap;
}

int tk_strmap_init(struct tk_strmap *m, uint32_t expected)
{
    m->cap = pow2_cap(expected);
    m->n = 0;
    m->e = calloc(m->cap, sizeof *m->e);
    return m->e ? 0 : -ENOMEM;
}

static int strmap_grow(struct tk_strmap *m)
{
    struct tk_strmap old = *m;
    if (tk_strmap_init(m, old.cap) != 0) {
        *m = old;
        return -ENOMEM;
    }
    for (uint32_t i = 0; i < old.cap; i++)
        if (old.e[i].s) tk_strmap_put(m, old.e[i].s, old.e[i].len, old.e[i].val);
    free(old.e);
    return 0;
}

int tk_strmap_put(struct tk_strmap *m, const char *s, uint32_t len, int32_t val)
{
    if ((m->n + 1) * 2 > m->cap && strmap_grow(m) != 0) return -ENOMEM;
    uint32_t i = (uint32_t)hash_bytes(s, len) & (m->cap - 1);
    while (m->e[i].s) {
        if (m->e[i].len == len && memcmp(m->e[i].s, s, len) == 0) return 1;
        i = (i + 1) & (m->cap - 1);
    }
    m->e[i].s = s;
    m->e[i].len = len;
    m->e[i].val = val;
    m->n++;
    return 0;
}

int32_t tk_strmap_get(const struct tk_strmap *m, const char *s, size_t len)
{
    if (!m->e) return -1;
    uint32_t i = (uint32_t)hash_bytes(s, len) & (m->cap - 1);
    while (m->e[i].s) {
        if (m->e[i].len == len && memcmp(m->e[i].s, s, len) == 0) return m->e[i].val;
        i = (i + 1) & (m->cap - 1);
    }
    return -1;
}

void tk_strmap_free(struct tk_strmap *m)
{
    free(m->e);
    m->e = NULL;
    m->cap = m->n = 0;
}

int tk_mergemap_init(struct tk_mergemap *m, uint32_t expected)
{
    m->cap = pow2_cap(expected);
    m->n = 0;
    m->e = malloc((size_t)m->cap * sizeof *m->e);
    if (!m->e) return -ENOMEM;
    for (uint32_t i = 0; i < m->cap; i++) m->e[i].key = UINT64_MAX;
    return 0;
}

int tk_mergemap_put(struct tk_mergemap *m, int32_t a, int32_t b, int32_t rank, int32_t id)
{
    if ((m->n + 1) * 2 > m->cap) {
        struct tk_mergemap old = *m;
        if (tk_mergemap_init(m, old.cap) != 0) {
            *m = old;
            return -ENOMEM;
        }
        for (uint32_t i = 0; i < old.cap; i++)
            if (old.e[i].key != UINT64_MAX)
                tk_mergemap_put(m, (int32_t)(old.e[i].key >> 32), (int32_t)(uint32_t)old.e[i].key, old.e[i].rank,
                                old.e[i].id);
        free(old.e);
    }
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    uint32_t i = (uint32_t)hash_u64(key) & (m->cap - 1);
    while (m->e[i].key != UINT64_MAX) {
        if (m->e[i].key == key) return 1; /* first (lowest) rank wins, as in HF */
        i = (i + 1) & (m->cap - 1);
    }
    m->e[i].key = key;
    m->e[i].rank = rank;
    m->e[i].id = id;
    m->n++;
    return 0;
}

const struct tk_merge_ent *tk_mergemap_get(const struct tk_mergemap *m, int32_t a, int32_t b)
{
    if (!m->e) return NULL;
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    uint32_t i = (uint32_t)hash_u64(key) & (m->cap - 1);
    while (m->e[i].key != UINT64_MAX) {
        if (m->e[i].key == key) return &m->e[i];
        i = (i + 1) & (m->cap - 1);
    }
    return NULL;
}

void tk_mergemap_free(struct tk_mergemap *m)
{
    free(m->e);
    m->e = NULL;
    m->cap = m->n = 0;
}

/* ---- UTF-8 ---- */

int tk_utf8_next(const uint8_t *s, size_t n, uint32_t *cp)
{
    uint8_t c = s[0];
    if (c < 0x80) {
        *cp = c;
        return 1;
    }
    int need;
    uint8_t lo = 0x80, hi = 0xBF;
    uint32_t v;
    if (c >= 0xC2 && c <= 0xDF) {
        need = 1;
        v = c & 0x1F;
    } else if (c >= 0xE0 && c <= 0xEF) {
        need = 2;
        v = c & 0x0F;
        if (c == 0xE0) lo = 0xA0;
        if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
        need = 3;
        v = c & 0x07;
        if (c == 0xF0) lo = 0x90;
        if (c == 0xF4) hi = 0x8F;
    } else {
        return -1;
    }
    for (int i = 1; i <= need; i++) {
        if ((size_t)i >= n) return 0; /* valid so far, bytes ran out */
        uint8_t d = s[i];
        if (d < lo || d > hi) return -i;
        lo = 0x80;
        hi = 0xBF;
        v = (v << 6) | (d & 0x3F);
    }
    *cp = v;
    return need + 1;
}

int tk_utf8_put(char *out, uint32_t cp)
{
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xC0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (char)(0xF0 | (cp >> 18));
    out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

int tk_utf8_valid(const char *s, size_t n)
{
    const uint8_t *u = (const uint8_t *)s;
    size_t i = 0;
    while (i < n) {
        if (u[i] < 0x80) {
            i++;
            continue;
        }
        uint32_t cp;
        int k = tk_utf8_next(u + i, n - i, &cp);
        if (k <= 0) return 0;
        i += (size_t)k;
    }
    return 1;
}

int tk_utf8_lossy(struct tk_buf *out, const char *s, size_t n)
{
    static const char repl[3] = {(char)0xEF, (char)0xBF, (char)0xBD};
    const uint8_t *u = (const uint8_t *)s;
    size_t i = 0, run = 0;
    while (i < n) {
        uint32_t cp;
        int k = u[i] < 0x80 ? 1 : tk_utf8_next(u + i, n - i, &cp);
        if (k > 0) {
            i += (size_t)k;
            continue;
        }
        if (tk_buf_put(out, s + run, i - run) || tk_buf_put(out, repl, 3)) return -ENOMEM;
        i += k == 0 ? n - i : (size_t)-k;
        run = i;
    }
    return tk_buf_put(out, s + run, n - run);
}

int tk_is_whitespace(uint32_t cp)
{
    return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
           (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
           cp == 0x3000;
}

/* GPT-2's bytes_to_unicode: printable Latin-1 bytes map to themselves, the other 68 bytes to
 * U+0100.. in byte order (0x00-0x20, 0x7F-0xA0, 0xAD). */
uint32_t tk_byte_to_cp(uint8_t b)
{
    if (b <= 0x20) return 256u + b;
    if (b >= 0x7F && b <= 0xA0) return 289u + (b - 0x7Fu);
    if (b == 0xAD) return 323u;
    return b;
}

int tk_cp_to_byte(uint32_t cp)
{
    if (cp < 256) {
        if (cp <= 0x20 || (cp >= 0x7F && cp <= 0xA0) || cp == 0xAD) return -1;
        return (int)cp;
    }
    if (cp <= 288) return (int)(cp - 256);
    if (cp <= 322) return (int)(cp - 289 + 0x7F);
    if (cp == 323) return 0xAD;
    return -1;
}

/* ---- added-token trie ---- */

int tk_trie_build(struct tk_trie *tr, const char *const *strs, const uint32_t *lens, const int32_t *vals, int n)
{
    memset(tr, 0, sizeof *tr);
    size_t total = 1;
    for (int i = 0; i < n; i++) total += lens[i];
    if (total > INT32_MAX / 2) return -ENOMEM;
    tr->term = malloc(total * sizeof *tr->term);
    if (!tr->term || tk_mergemap_init(&tr->edges, (uint32_t)total) != 0) {
        tk_trie_free(tr);
        return -ENOMEM;
    }
    tr->n_nodes = 1;
    tr->term[0] = -1;
    for (int i = 0; i < n; i++) {
        if (lens[i] == 0) continue;
        int32_t node = 0;
        tr->first[(uint8_t)strs[i][0]] = 1;
        for (uint32_t j = 0; j < lens[i]; j++) {
            uint8_t c = (uint8_t)strs[i][j];
            const struct tk_merge_ent *e = tk_mergemap_get(&tr->edges, node, c);
            if (e) {
                node = e->id;
                continue;
            }
            int32_t child = tr->n_nodes++;
            tr->term[child] = -1;
            if (tk_mergemap_put(&tr->edges, node, c, 0, child) < 0) {
                tk_trie_free(tr);
                return -ENOMEM;
            }
            node = child;
        }
        if (tr->term[node] < 0) tr->term[node] = vals[i];
    }
    return 0;
}

void tk_trie_free(struct tk_trie *tr)
{
    free(tr->term);
    tk_mergemap_free(&tr->edges);
    memset(tr, 0, sizeof *tr);
}

size_t tk_trie_longest(const struct tk_trie *tr, const char *s, size_t n, int32_t *val)
{
    if (!tr->term || n == 0 || !tr->first[(uint8_t)s[0]]) return 0;
    int32_t node = 0;
    size_t best = 0;
    for (size_t i = 0; i < n; i++) {
        const struct tk_merge_ent *e = tk_mergemap_get(&tr->edges, node, (uint8_t)s[i]);
        if (!e) break;
        node = e->id;
        if (tr->term[node] >= 0) {
            best = i + 1;
            *val = tr->term[node];
        }
    }
    return best;
}

/* ---- normalizers ---- */

static int unicode_norm(enum tk_norm_kind kind, const char *s, size_t n, struct tk_buf *out)
{
    int opts = UTF8PROC_STABLE;
    if (kind == TK_NORM_NFC) opts |= UTF8PROC_COMPOSE;
    else if (kind == TK_NORM_NFD) opts |= UTF8PROC_DECOMPOSE;
    else if (kind == TK_NORM_NFKC) opts |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT;
    else opts |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT;
    if (n == 0) return 0;
    /* fast path: ASCII is stable under all four forms, and nothing below U+0300 changes under
     * NFC (the first code point that is not NFC_Quick_Check=Yes is U+0300) */
    uint8_t limit = kind == TK_NORM_NFC ? 0xCC : 0x80; /* U+0300 is 0xCC 0x80 */
    size_t i = 0;
    while (i < n && (uint8_t)s[i] < limit) i++;
    if (i == n) return tk_buf_put(out, s, n);
    utf8proc_uint8_t *res = NULL;
    utf8proc_ssize_t r = utf8proc_map((const utf8proc_uint8_t *)s, (utf8proc_ssize_t)n, &res, (utf8proc_option_t)opts);
    if (r < 0) return r == UTF8PROC_ERROR_NOMEM ? -ENOMEM : -EINVAL;
    int rc = tk_buf_put(out, res, (size_t)r);
    free(res);
    return rc;
}

int tk_normalize(const struct kvs_tokenizer *t, const char *s, size_t n, struct tk_buf *out)
{
    struct tk_buf tmp = {0};
    out->n = 0;
    int rc = tk_buf_put(out, s, n);
    for (int i = 0; rc == 0 && i < t->n_norms; i++) {
        const struct tk_norm *nm = &t->norms[i];
        tmp.n = 0;
        rc = tk_buf_put(&tmp, "", 0);
        if (rc) break;
        switch (nm->kind) {
        case TK_NORM_PREPEND:
            if (out->n == 0) continue; /* HF prepends only to non-empty text */
            rc = tk_buf_put(&tmp, nm->a, nm->alen);
            if (rc == 0) rc = tk_buf_put(&tmp, out->p, out->n);
            break;
        case TK_NORM_REPLACE: {
            size_t j = 0, run = 0;
            while (rc == 0 && nm->alen > 0 && j + nm->alen <= out->n) {
                if (memcmp(out->p + j, nm->a, nm->alen) == 0) {
                    rc = tk_buf_put(&tmp, out->p + run, j - run);
                    if (rc == 0) rc = tk_buf_put(&tmp, nm->b, nm->blen);
                    j += nm->alen;
                    run = j;
                } else {
                    j++;
                }
            }
            if (rc == 0) rc = tk_buf_put(&tmp, out->p + run, out->n - run);
            break;
        }
        default:
            rc = unicode_norm(nm->kind, out->p, out->n, &tmp);
            break;
        }
        if (rc) break;
        struct tk_buf sw = *out;
        *out = tmp;
        tmp = sw;
    }
    free(tmp.p);
    if (rc == 0 && !out->p) rc = tk_buf_put(out, "", 0);
    return rc;
}
