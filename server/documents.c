/* documents.c: document registry: an array in creation order (counts are small: a lookup is a
 * linear scan), plus optional JSON-file persistence. */
#include "server/documents.h"

#include "engine/util.h"
#include "server/request_parse.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

struct kvs_docs {
    char *dir;              /* NULL = memory only */
    int max_count, max_tokens;
    struct kvs_doc *docs;
    int n, cap;
    uint64_t rng;
};

static void doc_clear(struct kvs_doc *d)
{
    free(d->id);
    free(d->text);
    free(d->tokens);
    memset(d, 0, sizeof *d);
}

static int find(const struct kvs_docs *d, const char *id)
{
    for (int i = 0; i < d->n; i++)
        if (!strcmp(d->docs[i].id, id)) return i;
    return -1;
}

static int persist(const struct kvs_docs *d, const struct kvs_doc *doc, char *err, size_t errlen)
{
    if (!d->dir) return 0;
    cJSON *o = cJSON_CreateObject();
    cJSON *toks = cJSON_CreateArray();
    if (!o || !toks) {
        cJSON_Delete(o);
        cJSON_Delete(toks);
        return kvs_err(err, errlen, -ENOMEM, "out of memory");
    }
    cJSON_AddStringToObject(o, "id", doc->id);
    cJSON_AddNumberToObject(o, "created", (double)doc->created);
    cJSON_AddStringToObject(o, "text", doc->text);
    for (int i = 0; i < doc->n_tokens; i++) cJSON_AddItemToArray(toks, cJSON_CreateNumber(doc->tokens[i]));
    cJSON_AddItemToObject(o, "tokens", toks);
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    if (!s) return kvs_err(err, errlen, -ENOMEM, "out of memory");
    char tmp[4096], path[4096];
    snprintf(path, sizeof path, "%s/%s.json", d->dir, doc->id);
    snprintf(tmp, sizeof tmp, "%s/.%s.json.tmp", d->dir, doc->id);
    FILE *f = fopen(tmp, "wb");
    int ok = f && fwrite(s, 1, strlen(s), f) == strlen(s);
    if (f && fclose(f) != 0) ok = 0;
    free(s);
    if (!ok || rename(tmp, path) != 0) {
        int e = errno;
        unlink(tmp);
        return kvs_err(err, errlen, -EIO, "cannot write document file %s: %s", path, strerror(e));
    }
    return 0;
}

static int append(struct kvs_docs *d, char *id, char *text, int32_t *tokens, int n_tokens, int64_t created)
{
    if (d->n == d->cap) {
        int cap = d->cap ? d->cap * 2 : 16;
        struct kvs_doc *nd = realloc(d->docs, sizeof *nd * (size_t)cap);
        if (!nd) return -ENOMEM;
        d->docs = nd;
        d->cap = cap;
    }
    d->docs[d->n++] = (struct kvs_doc){.id = id, .text = text, .tokens = tokens, .n_tokens = n_tokens, .created = created};
    return 0;
}

static int load_one(struct kvs_docs *d, const char *path, char *err, size_t errlen)
{
    size_t len;
    char *s = kvs_read_file(path, &len, err, errlen);
    if (!s) return -EIO;
    cJSON *o = cJSON_ParseWithLength(s, len);
    free(s);
    const cJSON *id = cJSON_GetObjectItemCaseSensitive(o, "id");
    const cJSON *text = cJSON_GetObjectItemCaseSensitive(o, "text");
    const cJSON *toks = cJSON_GetObjectItemCaseSensitive(o, "tokens");
    const cJSON *created = cJSON_GetObjectItemCaseSensitive(o, "created");
    if (!cJSON_IsString(id) || !kvs_api_valid_doc_id(id->valuestring) || !cJSON_IsString(text) ||
        !cJSON_IsArray(toks) || cJSON_GetArraySize(toks) == 0 || find(d, id->valuestring) >= 0) {
        cJSON_Delete(o);
        return kvs_err(err, errlen, -EINVAL, "%s: not a valid document file", path);
    }
    int n = cJSON_GetArraySize(toks);
    int32_t *ids = malloc(sizeof *ids * (size_t)n);
    char *ids_s = kvs_xstrdup(id->valuestring), *text_s = kvs_xstrdup(text->valuestring);
    int i = 0, bad = !ids;
    const cJSON *el;
    cJSON_ArrayForEach(el, toks)
    {
        if (bad) break;
        if (!cJSON_IsNumber(el) || el->valuedouble < 0 || el->valuedouble > INT32_MAX) bad = 1;
        else ids[i++] = (int32_t)el->valuedouble;
    }
    int64_t c = cJSON_IsNumber(created) ? (int64_t)created->valuedouble : (int64_t)kvs_wall_time();
    cJSON_Delete(o);
    if (bad || append(d, ids_s, text_s, ids, n, c) != 0) {
        free(ids);
        free(ids_s);
        free(text_s);
        return kvs_err(err, errlen, -EINVAL, "%s: bad token list", path);
    }
    return 0;
}

static int load_dir(struct kvs_docs *d, char *err, size_t errlen)
{
    DIR *dir = opendir(d->dir);
    if (!dir) return kvs_err(err, errlen, -EIO, "cannot open documents dir %s: %s", d->dir, strerror(errno));
    struct dirent *de;
    int rc = 0;
    while ((de = readdir(dir)) != NULL) {
        size_t n = strlen(de->d_name);
        if (de->d_name[0] == '.' || n < 6 || strcmp(de->d_name + n - 5, ".json") != 0) continue;
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", d->dir, de->d_name);
        char e[512];
        int r = load_one(d, path, e, sizeof e);
        if (r) kvs_log(KVS_LOG_WARN, "documents: skipping %s", e);
    }
    closedir(dir);
    /* creation order, so listings and ids are stable across restarts */
    for (int i = 1; i < d->n; i++)
        for (int j = i; j > 0 && d->docs[j - 1].created > d->docs[j].created; j--) {
            struct kvs_doc t = d->docs[j];
            d->docs[j] = d->docs[j - 1];
            d->docs[j - 1] = t;
        }
    return rc;
}

int kvs_docs_create(const char *dir, int max_count, int max_tokens, struct kvs_docs **out, char *err,
                    size_t errlen)
{
    struct kvs_docs *d = kvs_xcalloc(1, sizeof *d);
    d->max_count = max_count > 0 ? max_count : 1 << 30;
    d->max_tokens = max_tokens > 0 ? max_tokens : 1 << 30;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    d->rng = (uint64_t)ts.tv_nsec * 0x9E3779B97F4A7C15ull ^ (uint64_t)ts.tv_sec ^ (uint64_t)getpid();
    if (dir && *dir) {
        d->dir = kvs_xstrdup(dir);
        if (mkdir(dir, 0755) != 0 && errno != EEXIST) {
            int rc = kvs_err(err, errlen, -EIO, "cannot create documents dir %s: %s", dir, strerror(errno));
            kvs_docs_free(d);
            return rc;
        }
        int rc = load_dir(d, err, errlen);
        if (rc) {
            kvs_docs_free(d);
            return rc;
        }
    }
    *out = d;
    return 0;
}

void kvs_docs_free(struct kvs_docs *d)
{
    if (!d) return;
    for (int i = 0; i < d->n; i++) doc_clear(&d->docs[i]);
    free(d->docs);
    free(d->dir);
    free(d);
}

int kvs_docs_add(struct kvs_docs *d, const char *id, const char *text, const int32_t *tokens, int n_tokens,
                 const struct kvs_doc **out, char *err, size_t errlen)
{
    char gen[32];
    if (!id) {
        do {
            d->rng ^= d->rng << 13;
            d->rng ^= d->rng >> 7;
            d->rng ^= d->rng << 17;
            snprintf(gen, sizeof gen, "doc-%016llx", (unsigned long long)d->rng);
        } while (find(d, gen) >= 0);
        id = gen;
    }
    if (!kvs_api_valid_doc_id(id)) return kvs_err(err, errlen, -EINVAL, "invalid document id");
    if (find(d, id) >= 0) return kvs_err(err, errlen, -EEXIST, "document '%s' already exists", id);
    if (d->n >= d->max_count) return kvs_err(err, errlen, -ENOSPC, "the document store is full (%d documents)", d->max_count);
    if (n_tokens <= 0) return kvs_err(err, errlen, -EINVAL, "a document needs at least one token");
    if (n_tokens > d->max_tokens)
        return kvs_err(err, errlen, -E2BIG, "document has %d tokens; the limit is %d", n_tokens, d->max_tokens);
    int32_t *t = malloc(sizeof *t * (size_t)n_tokens);
    if (!t) return kvs_err(err, errlen, -ENOMEM, "out of memory");
    memcpy(t, tokens, sizeof *t * (size_t)n_tokens);
    char *ids = kvs_xstrdup(id), *txt = kvs_xstrdup(text);
    if (append(d, ids, txt, t, n_tokens, (int64_t)kvs_wall_time()) != 0) {
        free(t);
        free(ids);
        free(txt);
        return kvs_err(err, errlen, -ENOMEM, "out of memory");
    }
    int rc = persist(d, &d->docs[d->n - 1], err, errlen);
    if (rc) {
        doc_clear(&d->docs[--d->n]);
        return rc;
    }
    *out = &d->docs[d->n - 1];
    return 0;
}

const struct kvs_doc *kvs_docs_get(const struct kvs_docs *d, const char *id)
{
    int i = find(d, id);
    return i < 0 ? NULL : &d->docs[i];
}

int kvs_docs_delete(struct kvs_docs *d, const char *id, char *err, size_t errlen)
{
    int i = find(d, id);
    if (i < 0) return kvs_err(err, errlen, -ENOENT, "document '%s' not found", id);
    if (d->dir) {
        char path[4096];
        snprintf(path, sizeof path, "%s/%s.json", d->dir, id);
        if (unlink(path) != 0 && errno != ENOENT)
            return kvs_err(err, errlen, -EIO, "cannot delete %s: %s", path, strerror(errno));
    }
    doc_clear(&d->docs[i]);
    memmove(&d->docs[i], &d->docs[i + 1], sizeof *d->docs * (size_t)(d->n - i - 1));
    d->n--;
    return 0;
}

int kvs_docs_count(const struct kvs_docs *d) { return d->n; }

const struct kvs_doc *kvs_docs_at(const struct kvs_docs *d, int i)
{
    return (i >= 0 && i < d->n) ? &d->docs[i] : NULL;
}
