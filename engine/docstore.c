/* docstore.c: refcounted, thread-safe document store with one-file-per-document persistence
 * (see docstore.h). */
#include "engine/docstore.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include "engine/config.h"
#include "base/util.h"

_Static_assert(sizeof(int) == sizeof(int32_t), "token ids are written with cJSON_CreateIntArray");

enum entry_state { E_PENDING, E_VISIBLE, E_DELETING };

/* One stored document in the index: hash chain + creation-ordered list. */
struct entry {
    struct kvs_doc *doc;
    enum entry_state state;
    struct entry *hnext;
    struct entry *prev, *next;
};

struct kvs_docstore {
    pthread_mutex_t mu;
    char *dir;                 /* NULL = memory only */
    int max_count, max_tokens; /* <= 0: no limit */
    struct entry **buckets;    /* [n_buckets], chains by id */
    size_t n_buckets;
    int n_entries;             /* all states: pending adds count against max_count */
    int n_visible;
    int64_t n_tokens, n_bytes; /* of visible documents */
    struct entry *head, *tail; /* creation order */
    uint64_t next_seq;
    double last_created;       /* created times are strictly increasing (ms steps) */
};

/* ---------------------------------------------------------------- documents */

uint64_t kvs_doc_hash_tokens(const int32_t *tokens, int n)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (int i = 0; i < n; i++) {
        uint32_t v = (uint32_t)tokens[i];
        for (int b = 0; b < 4; b++) {
            h ^= (v >> (8 * b)) & 0xffu;
            h *= 0x100000001b3ull;
        }
    }
    return h;
}

int kvs_doc_id_valid(const char *id)
{
    if (!id || !id[0] || id[0] == '.') return 0;
    size_t n = 0;
    for (const char *p = id; *p; p++, n++) {
        char c = *p;
        int ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
                 c == '_' || c == '-';
        if (!ok || n >= KVS_DOC_ID_MAX) return 0;
    }
    return 1;
}

static void doc_free(struct kvs_doc *d)
{
    if (!d) return;
    free(d->text);
    free(d->tokens);
    free(d->file);
    free(d);
}

const struct kvs_doc *kvs_doc_ref(const struct kvs_doc *d)
{
    if (d) atomic_fetch_add(&((struct kvs_doc *)d)->refs, 1);
    return d;
}

void kvs_doc_release(const struct kvs_doc *d)
{
    if (!d) return;
    struct kvs_doc *m = (struct kvs_doc *)d;
    int before = atomic_fetch_sub(&m->refs, 1);
    KVS_ASSERT(before >= 1);
    if (before == 1) doc_free(m);
}

/* Returns 1 when s[0..n) is well-formed UTF-8 without NUL bytes. */
static int utf8_valid_no_nul(const char *s, size_t n)
{
    const unsigned char *p = (const unsigned char *)s;
    size_t i = 0;
    while (i < n) {
        unsigned c = p[i];
        if (c == 0) return 0;
        if (c < 0x80) {
            i++;
            continue;
        }
        size_t len;
        uint32_t v, min;
        if ((c & 0xe0) == 0xc0) len = 2, v = c & 0x1f, min = 0x80;
        else if ((c & 0xf0) == 0xe0) len = 3, v = c & 0x0f, min = 0x800;
        else if ((c & 0xf8) == 0xf0) len = 4, v = c & 0x07, min = 0x10000;
        else return 0;
        if (n - i < len) return 0;
        for (size_t k = 1; k < len; k++) {
            if ((p[i + k] & 0xc0) != 0x80) return 0;
            v = (v << 6) | (p[i + k] & 0x3f);
        }
        if (v < min || v > 0x10ffff || (v >= 0xd800 && v <= 0xdfff)) return 0;
        i += len;
    }
    return 1;
}

/* Builds a document (refs = 1) from validated input; NULL on OOM. */
static struct kvs_doc *doc_new(const char *id, const char *text, size_t text_len, const int32_t *tokens,
                               int n_tokens)
{
    struct kvs_doc *d = calloc(1, sizeof *d);
    if (!d) return NULL;
    d->text = malloc(text_len + 1);
    d->tokens = malloc((size_t)n_tokens * sizeof *d->tokens);
    if (!d->text || !d->tokens) {
        doc_free(d);
        return NULL;
    }
    snprintf(d->id, sizeof d->id, "%s", id);
    memcpy(d->text, text, text_len);
    d->text[text_len] = 0;
    d->text_len = text_len;
    memcpy(d->tokens, tokens, (size_t)n_tokens * sizeof *d->tokens);
    d->n_tokens = n_tokens;
    d->hash = kvs_doc_hash_tokens(tokens, n_tokens);
    atomic_init(&d->refs, 1);
    return d;
}

/* ---------------------------------------------------------------- index (caller holds mu) */

static uint64_t id_hash(const char *id)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (const unsigned char *p = (const unsigned char *)id; *p; p++) {
        h ^= *p;
        h *= 0x100000001b3ull;
    }
    return h;
}

static struct entry *index_find(struct kvs_docstore *s, const char *id)
{
    for (struct entry *e = s->buckets[id_hash(id) & (s->n_buckets - 1)]; e; e = e->hnext)
        if (strcmp(e->doc->id, id) == 0) return e;
    return NULL;
}

static int index_grow(struct kvs_docstore *s)
{
    size_t nb = s->n_buckets * 2;
    struct entry **b = calloc(nb, sizeof *b);
    if (!b) return -ENOMEM;
    for (size_t i = 0; i < s->n_buckets; i++) {
        struct entry *e = s->buckets[i];
        while (e) {
            struct entry *next = e->hnext;
            size_t k = id_hash(e->doc->id) & (nb - 1);
            e->hnext = b[k];
            b[k] = e;
            e = next;
        }
    }
    free(s->buckets);
    s->buckets = b;
    s->n_buckets = nb;
    return 0;
}

/* Links e at the tail (newest) of the creation list and into its hash chain. */
static void index_insert(struct kvs_docstore *s, struct entry *e)
{
    size_t k = id_hash(e->doc->id) & (s->n_buckets - 1);
    e->hnext = s->buckets[k];
    s->buckets[k] = e;
    e->prev = s->tail;
    e->next = NULL;
    if (s->tail) s->tail->next = e;
    else s->head = e;
    s->tail = e;
    s->n_entries++;
}

static void index_remove(struct kvs_docstore *s, struct entry *e)
{
    struct entry **pp = &s->buckets[id_hash(e->doc->id) & (s->n_buckets - 1)];
    while (*pp != e) {
        KVS_ASSERT(*pp != NULL);
        pp = &(*pp)->hnext;
    }
    *pp = e->hnext;
    if (e->prev) e->prev->next = e->next;
    else s->head = e->next;
    if (e->next) e->next->prev = e->prev;
    else s->tail = e->prev;
    s->n_entries--;
}

static void make_visible(struct kvs_docstore *s, struct entry *e)
{
    e->state = E_VISIBLE;
    s->n_visible++;
    s->n_tokens += e->doc->n_tokens;
    s->n_bytes += (int64_t)e->doc->text_len;
}

static void make_invisible(struct kvs_docstore *s, struct entry *e)
{
    KVS_ASSERT(e->state == E_VISIBLE);
    s->n_visible--;
    s->n_tokens -= e->doc->n_tokens;
    s->n_bytes -= (int64_t)e->doc->text_len;
}

/* ---------------------------------------------------------------- files */

static int fsync_dir(const char *dir)
{
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return -errno;
    int rc = fsync(fd) == 0 ? 0 : -errno;
    close(fd);
    return rc;
}

static int write_all(int fd, const char *p, size_t n)
{
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

static char *doc_to_json(const struct kvs_doc *d)
{
    cJSON *o = cJSON_CreateObject();
    if (!o) return NULL;
    cJSON *toks = cJSON_CreateIntArray((const int *)d->tokens, d->n_tokens);
    char *out = NULL;
    if (toks && cJSON_AddStringToObject(o, "id", d->id) && cJSON_AddStringToObject(o, "text", d->text) &&
        cJSON_AddItemToObject(o, "tokens", toks) && cJSON_AddNumberToObject(o, "created", d->created)) {
        toks = NULL; /* owned by o now */
        out = cJSON_PrintUnformatted(o);
    }
    cJSON_Delete(toks);
    cJSON_Delete(o);
    return out;
}

/* Writes d to dir/<id>.json atomically (temp file, fsync, rename, dir fsync). */
static int doc_write_file(const char *dir, struct kvs_doc *d, char *err, size_t errlen)
{
    char *json = doc_to_json(d);
    if (!json) return kvs_err(err, errlen, -ENOMEM, "document %s: out of memory serializing", d->id);
    char path[4096], tmp[4096];
    int n1 = snprintf(path, sizeof path, "%s/%s.json", dir, d->id);
    int n2 = snprintf(tmp, sizeof tmp, "%s/.%s.json.tmp", dir, d->id);
    if (n1 < 0 || n2 < 0 || (size_t)n1 >= sizeof path || (size_t)n2 >= sizeof tmp) {
        free(json);
        return kvs_err(err, errlen, -EIO, "documents dir path too long: %s", dir);
    }
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) {
        int e = errno;
        free(json);
        return kvs_err(err, errlen, -EIO, "%s: %s", tmp, strerror(e));
    }
    int rc = write_all(fd, json, strlen(json));
    if (rc == 0 && fsync(fd) != 0) rc = -errno;
    if (close(fd) != 0 && rc == 0) rc = -errno;
    free(json);
    if (rc == 0 && rename(tmp, path) != 0) rc = -errno;
    if (rc != 0) {
        unlink(tmp);
        return kvs_err(err, errlen, -EIO, "writing %s: %s", path, strerror(-rc));
    }
    rc = fsync_dir(dir);
    if (rc != 0) {
        unlink(path);
        return kvs_err(err, errlen, -EIO, "fsync %s: %s", dir, strerror(-rc));
    }
    char name[KVS_DOC_ID_MAX + 8];
    snprintf(name, sizeof name, "%s.json", d->id);
    d->file = strdup(name);
    if (!d->file) {
        unlink(path);
        return kvs_err(err, errlen, -ENOMEM, "out of memory");
    }
    return 0;
}

/* Parses one document file; NULL + reason in err when it is not a valid document. */
static struct kvs_doc *doc_from_file(const char *dir, const char *name, char *err, size_t errlen)
{
    char path[4096];
    int n = snprintf(path, sizeof path, "%s/%s", dir, name);
    if (n < 0 || (size_t)n >= sizeof path) {
        kvs_err(err, errlen, -EINVAL, "path too long");
        return NULL;
    }
    size_t len;
    char *json = kvs_read_file(path, &len, err, errlen);
    if (!json) return NULL;
    cJSON *o = cJSON_ParseWithLength(json, len);
    free(json);
    struct kvs_doc *d = NULL;
    int32_t *toks = NULL;
    const char *why = NULL;
    if (!o) {
        why = "not valid JSON";
        goto out;
    }
    if (!cJSON_IsObject(o)) {
        why = "not a JSON object";
        goto out;
    }
    const cJSON *id = cJSON_GetObjectItemCaseSensitive(o, "id");
    const cJSON *text = cJSON_GetObjectItemCaseSensitive(o, "text");
    const cJSON *tokens = cJSON_GetObjectItemCaseSensitive(o, "tokens");
    const cJSON *created = cJSON_GetObjectItemCaseSensitive(o, "created");
    if (!cJSON_IsString(id) || !kvs_doc_id_valid(id->valuestring)) {
        why = "missing or invalid \"id\"";
        goto out;
    }
    if (!cJSON_IsString(text) || !utf8_valid_no_nul(text->valuestring, strlen(text->valuestring))) {
        why = "missing or invalid \"text\"";
        goto out;
    }
    if (!cJSON_IsNumber(created) || !isfinite(created->valuedouble) || created->valuedouble < 0) {
        why = "missing or invalid \"created\"";
        goto out;
    }
    int nt = cJSON_GetArraySize(tokens);
    if (!cJSON_IsArray(tokens) || nt <= 0) {
        why = "missing or empty \"tokens\"";
        goto out;
    }
    toks = malloc((size_t)nt * sizeof *toks);
    if (!toks) {
        why = "out of memory";
        goto out;
    }
    int i = 0;
    const cJSON *t;
    cJSON_ArrayForEach(t, tokens)
    {
        double v = cJSON_IsNumber(t) ? t->valuedouble : -1;
        if (!(v >= 0 && v <= INT32_MAX && v == floor(v))) {
            why = "a token id is not an integer in [0, 2^31)";
            goto out;
        }
        toks[i++] = (int32_t)v;
    }
    d = doc_new(id->valuestring, text->valuestring, strlen(text->valuestring), toks, nt);
    if (!d) {
        why = "out of memory";
        goto out;
    }
    d->created = created->valuedouble;
    d->file = strdup(name);
    if (!d->file) {
        doc_free(d);
        d = NULL;
        why = "out of memory";
    }
out:
    if (why) kvs_err(err, errlen, -EINVAL, "%s", why);
    free(toks);
    cJSON_Delete(o);
    return d;
}

static int ends_with(const char *s, const char *suf)
{
    size_t n = strlen(s), k = strlen(suf);
    return n >= k && strcmp(s + n - k, suf) == 0;
}

static int cmp_created(const void *a, const void *b)
{
    const struct kvs_doc *x = *(struct kvs_doc *const *)a, *y = *(struct kvs_doc *const *)b;
    if (x->created != y->created) return x->created < y->created ? -1 : 1;
    return strcmp(x->id, y->id);
}

/* Loads every document file of s->dir into the (empty) index. */
static int load_dir(struct kvs_docstore *s, char *err, size_t errlen)
{
    DIR *dh = opendir(s->dir);
    if (!dh) return kvs_err(err, errlen, -errno, "documents dir %s: %s", s->dir, strerror(errno));
    struct kvs_doc **docs = NULL;
    size_t n = 0, cap = 0;
    int skipped = 0, rc = 0;
    struct dirent *de;
    while ((de = readdir(dh)) != NULL) {
        const char *name = de->d_name;
        if (name[0] == '.') {
            if (ends_with(name, ".json.tmp")) {
                /* a write that crashed before its rename: never a committed document */
                char path[4096];
                int k = snprintf(path, sizeof path, "%s/%s", s->dir, name);
                if (k > 0 && (size_t)k < sizeof path && unlink(path) == 0)
                    kvs_log(KVS_LOG_INFO, "documents: removed leftover temp file %s", path);
            }
            continue;
        }
        if (!ends_with(name, ".json")) continue;
        char why[512];
        struct kvs_doc *d = doc_from_file(s->dir, name, why, sizeof why);
        if (!d) {
            kvs_log(KVS_LOG_WARN, "documents: skipping %s/%s: %s", s->dir, name, why);
            skipped++;
            continue;
        }
        if (n == cap) {
            cap = cap ? cap * 2 : 64;
            struct kvs_doc **nd = realloc(docs, cap * sizeof *nd);
            if (!nd) {
                doc_free(d);
                rc = kvs_err(err, errlen, -ENOMEM, "documents: out of memory loading %s", s->dir);
                break;
            }
            docs = nd;
        }
        docs[n++] = d;
    }
    closedir(dh);
    if (rc == 0 && n) qsort(docs, n, sizeof *docs, cmp_created);
    for (size_t i = 0; i < n; i++) {
        struct kvs_doc *d = docs[i];
        if (rc != 0) {
            doc_free(d);
            continue;
        }
        struct entry *old = index_find(s, d->id);
        if (old) {
            /* sorted by creation: the one already indexed is older; keep the newer */
            kvs_log(KVS_LOG_WARN, "documents: %s and %s hold the same id %s; keeping the newer %s", old->doc->file,
                    d->file, d->id, d->file);
            make_invisible(s, old);
            index_remove(s, old);
            kvs_doc_release(old->doc);
            free(old);
            skipped++;
        }
        struct entry *e = calloc(1, sizeof *e);
        if (!e || ((size_t)s->n_entries + 1 > s->n_buckets && index_grow(s) != 0)) {
            free(e);
            doc_free(d);
            rc = kvs_err(err, errlen, -ENOMEM, "documents: out of memory loading %s", s->dir);
            continue;
        }
        e->doc = d;
        d->seq = s->next_seq++;
        if (d->created > s->last_created) s->last_created = d->created;
        index_insert(s, e);
        make_visible(s, e);
    }
    free(docs);
    if (rc == 0) {
        kvs_log(KVS_LOG_INFO, "documents: loaded %d from %s (%d skipped)", s->n_visible, s->dir, skipped);
        if (s->max_count > 0 && s->n_visible > s->max_count)
            kvs_log(KVS_LOG_WARN, "documents: %d stored, more than documents.max_count=%d; adds fail until deletes",
                    s->n_visible, s->max_count);
    }
    return rc;
}

/* ---------------------------------------------------------------- store */

int kvs_docstore_open(const char *dir, int max_count, int max_tokens, struct kvs_docstore **out, char *err,
                      size_t errlen)
{
    *out = NULL;
    struct kvs_docstore *s = kvs_xcalloc(1, sizeof *s);
    if (pthread_mutex_init(&s->mu, NULL) != 0) {
        free(s);
        return kvs_err(err, errlen, -ENOMEM, "documents: cannot create a mutex");
    }
    s->max_count = max_count;
    s->max_tokens = max_tokens;
    s->n_buckets = 64;
    s->buckets = kvs_xcalloc(s->n_buckets, sizeof *s->buckets);
    if (dir && dir[0]) {
        s->dir = kvs_xstrdup(dir);
        if (mkdir(dir, 0700) != 0 && errno != EEXIST) {
            int e = errno;
            kvs_docstore_free(s);
            return kvs_err(err, errlen, -e, "documents dir %s: %s", dir, strerror(e));
        }
        int rc = load_dir(s, err, errlen);
        if (rc != 0) {
            kvs_docstore_free(s);
            return rc;
        }
    }
    *out = s;
    return 0;
}

int kvs_docstore_open_config(const struct kvs_config *cfg, struct kvs_docstore **out, char *err, size_t errlen)
{
    return kvs_docstore_open(cfg->documents_dir, cfg->documents_max_count, cfg->documents_max_tokens, out, err,
                             errlen);
}

void kvs_docstore_free(struct kvs_docstore *s)
{
    if (!s) return;
    struct entry *e = s->head;
    while (e) {
        struct entry *next = e->next;
        kvs_doc_release(e->doc);
        free(e);
        e = next;
    }
    free(s->buckets);
    free(s->dir);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

static int random_hex(char *out, int n_chars)
{
    unsigned char buf[32];
    int nb = (n_chars + 1) / 2;
    KVS_ASSERT(nb <= (int)sizeof buf);
    int got = 0;
    while (got < nb) {
        ssize_t r = getrandom(buf + got, (size_t)(nb - got), 0);
        if (r < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        got += (int)r;
    }
    static const char hex[] = "0123456789abcdef";
    for (int i = 0; i < n_chars; i++) out[i] = hex[(buf[i / 2] >> ((i & 1) ? 0 : 4)) & 15];
    out[n_chars] = 0;
    return 0;
}

int kvs_docstore_add(struct kvs_docstore *s, const char *id, const char *text, size_t text_len,
                     const int32_t *tokens, int n_tokens, const struct kvs_doc **out, char *err, size_t errlen)
{
    if (out) *out = NULL;
    int generated = !id || !id[0];
    if (!generated && !kvs_doc_id_valid(id))
        return kvs_err(err, errlen, -EINVAL,
                       "invalid document id '%.80s': use 1-%d characters of A-Z a-z 0-9 . _ - (not starting with '.')",
                       id, KVS_DOC_ID_MAX);
    if (!text && text_len) return kvs_err(err, errlen, -EINVAL, "document text is missing");
    if (!utf8_valid_no_nul(text ? text : "", text_len))
        return kvs_err(err, errlen, -EINVAL, "document text is not valid UTF-8 (or contains NUL)");
    if (!tokens || n_tokens <= 0) return kvs_err(err, errlen, -EINVAL, "document has no tokens");
    if (s->max_tokens > 0 && n_tokens > s->max_tokens)
        return kvs_err(err, errlen, -E2BIG, "document has %d tokens; documents.max_tokens is %d", n_tokens,
                       s->max_tokens);
    for (int i = 0; i < n_tokens; i++)
        if (tokens[i] < 0) return kvs_err(err, errlen, -EINVAL, "token %d of the document is negative", i);

    char gen[KVS_DOC_ID_MAX + 1];
    if (generated) {
        memcpy(gen, "doc-", 4);
        int rc = random_hex(gen + 4, 24);
        if (rc != 0) return kvs_err(err, errlen, -EIO, "no random source for a document id: %s", strerror(-rc));
        id = gen;
    }
    struct kvs_doc *d = doc_new(id, text ? text : "", text_len, tokens, n_tokens);
    struct entry *e = calloc(1, sizeof *e);
    if (!d || !e) {
        doc_free(d);
        free(e);
        return kvs_err(err, errlen, -ENOMEM, "out of memory storing a document of %zu bytes", text_len);
    }
    e->doc = d;
    e->state = E_PENDING;

    pthread_mutex_lock(&s->mu);
    int rc = 0;
    while (index_find(s, d->id)) {
        if (!generated) {
            rc = kvs_err(err, errlen, -EEXIST, "document id '%s' already exists", d->id);
            break;
        }
        /* 96 random bits: a collision means the random source is broken, but retrying is cheap */
        if (random_hex(d->id + 4, 24) != 0) {
            rc = kvs_err(err, errlen, -EIO, "no random source for a document id");
            break;
        }
    }
    if (rc == 0 && s->max_count > 0 && s->n_entries >= s->max_count)
        rc = kvs_err(err, errlen, -ENOSPC, "document store is full (documents.max_count = %d)", s->max_count);
    if (rc == 0 && (size_t)s->n_entries + 1 > s->n_buckets && index_grow(s) != 0)
        rc = kvs_err(err, errlen, -ENOMEM, "out of memory growing the document index");
    if (rc == 0) {
        d->seq = s->next_seq++;
        /* Millisecond resolution survives the JSON round trip exactly (cJSON prints 15
         * digits); strictly increasing so creation order survives a reload too. */
        double now_ms = floor(kvs_wall_time() * 1000.0);
        double last_ms = floor(s->last_created * 1000.0 + 0.5);
        d->created = (now_ms > last_ms ? now_ms : last_ms + 1.0) / 1000.0;
        s->last_created = d->created;
        index_insert(s, e);
    }
    pthread_mutex_unlock(&s->mu);
    if (rc != 0) {
        doc_free(d);
        free(e);
        return rc;
    }

    /* the id is reserved (pending): the file is written without holding the lock */
    if (s->dir) rc = doc_write_file(s->dir, d, err, errlen);

    pthread_mutex_lock(&s->mu);
    if (rc != 0) {
        index_remove(s, e);
    } else {
        make_visible(s, e);
        if (out) *out = kvs_doc_ref(d);
    }
    pthread_mutex_unlock(&s->mu);
    if (rc != 0) {
        doc_free(d);
        free(e);
    }
    return rc;
}

const struct kvs_doc *kvs_docstore_get(struct kvs_docstore *s, const char *id)
{
    if (!id) return NULL;
    pthread_mutex_lock(&s->mu);
    struct entry *e = index_find(s, id);
    const struct kvs_doc *d = (e && e->state == E_VISIBLE) ? kvs_doc_ref(e->doc) : NULL;
    pthread_mutex_unlock(&s->mu);
    return d;
}

int kvs_docstore_delete(struct kvs_docstore *s, const char *id, char *err, size_t errlen)
{
    if (!id) return kvs_err(err, errlen, -ENOENT, "no document id given");
    pthread_mutex_lock(&s->mu);
    struct entry *e = index_find(s, id);
    if (!e || e->state != E_VISIBLE) {
        pthread_mutex_unlock(&s->mu);
        return kvs_err(err, errlen, -ENOENT, "no document with id '%.80s'", id);
    }
    make_invisible(s, e);
    e->state = E_DELETING;
    pthread_mutex_unlock(&s->mu);

    int rc = 0;
    if (s->dir && e->doc->file) {
        char path[4096];
        int n = snprintf(path, sizeof path, "%s/%s", s->dir, e->doc->file);
        if (n < 0 || (size_t)n >= sizeof path) rc = -ENAMETOOLONG;
        else if (unlink(path) != 0 && errno != ENOENT) rc = -errno;
        if (rc != 0) {
            rc = kvs_err(err, errlen, -EIO, "deleting document %s: %s", id, strerror(-rc));
        } else {
            int frc = fsync_dir(s->dir);
            /* the name is gone already; only its durability is in doubt */
            if (frc != 0) kvs_log(KVS_LOG_WARN, "documents: fsync %s after deleting %s: %s", s->dir, id, strerror(-frc));
        }
    }

    pthread_mutex_lock(&s->mu);
    if (rc != 0) {
        /* the file is still there: keep the document so that memory and disk agree */
        make_visible(s, e);
        e = NULL;
    } else {
        index_remove(s, e);
    }
    pthread_mutex_unlock(&s->mu);
    if (e) {
        kvs_doc_release(e->doc);
        free(e);
    }
    return rc;
}

int kvs_docstore_list(struct kvs_docstore *s, const char *after, int desc, const struct kvs_doc **out, int cap,
                      int *has_more, char *err, size_t errlen)
{
    if (has_more) *has_more = 0;
    if (cap < 0 || (cap > 0 && !out)) return kvs_err(err, errlen, -EINVAL, "invalid list capacity");
    pthread_mutex_lock(&s->mu);
    struct entry *e;
    if (after) {
        struct entry *a = index_find(s, after);
        if (!a || a->state != E_VISIBLE) {
            pthread_mutex_unlock(&s->mu);
            return kvs_err(err, errlen, -ENOENT, "no document with id '%.80s' (after)", after);
        }
        e = desc ? a->prev : a->next;
    } else {
        e = desc ? s->tail : s->head;
    }
    int n = 0;
    for (; e; e = desc ? e->prev : e->next) {
        if (e->state != E_VISIBLE) continue;
        if (n == cap) {
            if (has_more) *has_more = 1;
            break;
        }
        out[n++] = kvs_doc_ref(e->doc);
    }
    pthread_mutex_unlock(&s->mu);
    return n;
}

int kvs_docstore_count(struct kvs_docstore *s)
{
    pthread_mutex_lock(&s->mu);
    int n = s->n_visible;
    pthread_mutex_unlock(&s->mu);
    return n;
}

void kvs_docstore_stats(struct kvs_docstore *s, int *n_docs, int64_t *n_tokens, int64_t *n_bytes)
{
    pthread_mutex_lock(&s->mu);
    if (n_docs) *n_docs = s->n_visible;
    if (n_tokens) *n_tokens = s->n_tokens;
    if (n_bytes) *n_bytes = s->n_bytes;
    pthread_mutex_unlock(&s->mu);
}
