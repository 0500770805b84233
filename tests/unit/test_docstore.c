/* test_docstore: add/get/list/delete, ids, limits, refcounts that outlive a delete, persistence
 * across a reopen (with corrupt and leftover files in the directory) and concurrent adds. */
#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "engine/config.h"
#include "engine/docstore.h"
#include "base/util.h"
#include "tests/unit/test_util.h"


static int add_simple(struct kvs_docstore *s, const char *id, const char *text, int n_tokens, const struct kvs_doc **out)
{
    int32_t toks[64];
    KVS_ASSERT(n_tokens <= 64);
    for (int i = 0; i < n_tokens; i++) toks[i] = 1000 + i;
    char err[256];
    return kvs_docstore_add(s, id, text, strlen(text), toks, n_tokens, out, err, sizeof err);
}

static int is_generated_id(const char *id)
{
    if (strncmp(id, "doc-", 4) != 0 || strlen(id) != 28) return 0;
    for (int i = 4; i < 28; i++)
        if (!((id[i] >= '0' && id[i] <= '9') || (id[i] >= 'a' && id[i] <= 'f'))) return 0;
    return 1;
}

static void test_basic(void)
{
    struct kvs_docstore *s;
    char err[256];
    CHECK(kvs_docstore_open(NULL, 0, 0, &s, err, sizeof err) == 0, "open in memory: %s", err);

    /* hash: 64-bit FNV-1a over little-endian token bytes (values from an independent Python run) */
    const int32_t hv[] = {1, 256, 151643, 0};
    CHECK(kvs_doc_hash_tokens(NULL, 0) == 0xcbf29ce484222325ull, "hash of nothing");
    CHECK(kvs_doc_hash_tokens(hv, 4) == 0x5575ba0033a02096ull, "hash of {1,256,151643,0}");

    const struct kvs_doc *d = NULL;
    const char *text = "Paris is the capital of France. Ünïcødé ✓";
    CHECK(kvs_docstore_add(s, "paris", text, strlen(text), hv, 4, &d, err, sizeof err) == 0, "add: %s", err);
    CHECK(d && strcmp(d->id, "paris") == 0 && d->n_tokens == 4 && d->hash == 0x5575ba0033a02096ull &&
              d->text_len == strlen(text) && strcmp(d->text, text) == 0 && d->created > 1.7e9,
          "added document fields");
    kvs_doc_release(d);

    d = kvs_docstore_get(s, "paris");
    CHECK(d && memcmp(d->tokens, hv, sizeof hv) == 0, "get returns the tokens");
    kvs_doc_release(d);
    CHECK(kvs_docstore_get(s, "nope") == NULL, "get of a missing id");
    CHECK(kvs_docstore_get(s, NULL) == NULL, "get of NULL");

    /* generated ids */
    const struct kvs_doc *g1 = NULL, *g2 = NULL;
    CHECK(add_simple(s, NULL, "one", 3, &g1) == 0 && add_simple(s, "", "two", 3, &g2) == 0, "generated adds");
    CHECK(g1 && g2 && is_generated_id(g1->id) && is_generated_id(g2->id) && strcmp(g1->id, g2->id) != 0,
          "generated ids are doc-<24 hex> and differ (%s, %s)", g1 ? g1->id : "-", g2 ? g2->id : "-");
    kvs_doc_release(g1);
    kvs_doc_release(g2);

    /* bad input */
    CHECK(add_simple(s, "paris", "again", 2, NULL) == -EEXIST, "duplicate id");
    const char *bad_ids[] = {"../etc", ".hidden", "a b", "a/b", "x\n",
                             "12345678901234567890123456789012345678901234567890123456789012345"};
    for (int i = 0; i < 6; i++) CHECK(add_simple(s, bad_ids[i], "t", 1, NULL) == -EINVAL, "bad id %d", i);
    CHECK(add_simple(s, "1234567890123456789012345678901234567890123456789012345678901234", "t", 1, NULL) == 0,
          "64-char id is fine");
    int32_t one = 5, neg = -1;
    CHECK(kvs_docstore_add(s, "u1", "\xff\xfe", 2, &one, 1, NULL, err, sizeof err) == -EINVAL, "invalid UTF-8");
    CHECK(kvs_docstore_add(s, "u2", "a\0b", 3, &one, 1, NULL, err, sizeof err) == -EINVAL, "NUL in text");
    CHECK(kvs_docstore_add(s, "u3", "\xed\xa0\x80", 3, &one, 1, NULL, err, sizeof err) == -EINVAL, "surrogate");
    CHECK(kvs_docstore_add(s, "u4", "abc", 3, &one, 0, NULL, err, sizeof err) == -EINVAL, "no tokens");
    CHECK(kvs_docstore_add(s, "u5", "abc", 3, NULL, 3, NULL, err, sizeof err) == -EINVAL, "NULL tokens");
    CHECK(kvs_docstore_add(s, "u6", "abc", 3, &neg, 1, NULL, err, sizeof err) == -EINVAL, "negative token");
    CHECK(kvs_docstore_add(s, "u7", NULL, 3, &one, 1, NULL, err, sizeof err) == -EINVAL, "NULL text");
    CHECK(kvs_docstore_count(s) == 4, "count after rejected adds: %d", kvs_docstore_count(s));

    int nd;
    int64_t nt, nb;
    kvs_docstore_stats(s, &nd, &nt, &nb);
    CHECK(nd == 4 && nt == 4 + 3 + 3 + 1 && nb == (int64_t)(strlen(text) + 3 + 3 + 1), "stats");

    /* delete */
    CHECK(kvs_docstore_delete(s, "paris", err, sizeof err) == 0, "delete: %s", err);
    CHECK(kvs_docstore_get(s, "paris") == NULL, "deleted is gone");
    CHECK(kvs_docstore_delete(s, "paris", err, sizeof err) == -ENOENT, "double delete");
    CHECK(kvs_docstore_delete(s, NULL, err, sizeof err) == -ENOENT, "delete NULL");
    CHECK(add_simple(s, "paris", "re-added", 2, NULL) == 0, "a deleted id can be reused");
    kvs_docstore_free(s);
    kvs_docstore_free(NULL);
    printf("basic: add/get/delete, ids, hash, validation\n");
}

static void test_limits(void)
{
    struct kvs_docstore *s;
    char err[256];
    CHECK(kvs_docstore_open("", 3, 5, &s, err, sizeof err) == 0, "open: %s", err);
    CHECK(add_simple(s, "a", "a", 5, NULL) == 0, "5 tokens fit");
    CHECK(add_simple(s, "b", "b", 6, NULL) == -E2BIG, "6 tokens exceed max_tokens");
    CHECK(add_simple(s, "b", "b", 1, NULL) == 0 && add_simple(s, "c", "c", 1, NULL) == 0, "fill up");
    CHECK(add_simple(s, "d", "d", 1, NULL) == -ENOSPC, "max_count reached");
    CHECK(add_simple(s, NULL, "d", 1, NULL) == -ENOSPC, "max_count reached (generated id)");
    CHECK(kvs_docstore_delete(s, "b", err, sizeof err) == 0 && add_simple(s, "d", "d", 1, NULL) == 0,
          "delete makes room");
    kvs_docstore_free(s);

    /* the config keys: documents.dir "" = memory, documents.max_tokens applies */
    struct kvs_config cfg;
    kvs_config_init(&cfg);
    CHECK(kvs_config_set(&cfg, "documents.max_tokens=4", err, sizeof err) == 0, "set: %s", err);
    CHECK(kvs_docstore_open_config(&cfg, &s, err, sizeof err) == 0, "open from config: %s", err);
    CHECK(add_simple(s, "a", "a", 4, NULL) == 0 && add_simple(s, "b", "b", 5, NULL) == -E2BIG,
          "documents.max_tokens from the config");
    kvs_docstore_free(s);
    kvs_config_free(&cfg);
    printf("limits: -E2BIG, -ENOSPC\n");
}

static void test_list(void)
{
    struct kvs_docstore *s;
    char err[256];
    CHECK(kvs_docstore_open(NULL, 0, 0, &s, err, sizeof err) == 0, "open");
    char id[16];
    for (int i = 0; i < 10; i++) {
        snprintf(id, sizeof id, "d%d", i);
        CHECK(add_simple(s, id, id, 1, NULL) == 0, "add %s", id);
    }
    CHECK(kvs_docstore_delete(s, "d4", err, sizeof err) == 0, "delete d4");
    const struct kvs_doc *out[10];
    int more = -1;
    int n = kvs_docstore_list(s, NULL, 0, out, 3, &more, err, sizeof err);
    CHECK(n == 3 && more == 1 && strcmp(out[0]->id, "d0") == 0 && strcmp(out[2]->id, "d2") == 0, "first page asc");
    for (int i = 0; i < n; i++) kvs_doc_release(out[i]);
    n = kvs_docstore_list(s, "d2", 0, out, 3, &more, err, sizeof err);
    CHECK(n == 3 && more == 1 && strcmp(out[0]->id, "d3") == 0 && strcmp(out[1]->id, "d5") == 0 &&
              strcmp(out[2]->id, "d6") == 0,
          "second page skips the deleted d4");
    for (int i = 0; i < n; i++) kvs_doc_release(out[i]);
    n = kvs_docstore_list(s, "d6", 0, out, 3, &more, err, sizeof err);
    CHECK(n == 3 && more == 0 && strcmp(out[2]->id, "d9") == 0, "last page");
    for (int i = 0; i < n; i++) kvs_doc_release(out[i]);
    n = kvs_docstore_list(s, NULL, 1, out, 2, &more, err, sizeof err);
    CHECK(n == 2 && more == 1 && strcmp(out[0]->id, "d9") == 0 && strcmp(out[1]->id, "d8") == 0, "desc");
    for (int i = 0; i < n; i++) kvs_doc_release(out[i]);
    n = kvs_docstore_list(s, "d5", 1, out, 10, &more, err, sizeof err);
    CHECK(n == 4 && more == 0 && strcmp(out[0]->id, "d3") == 0 && strcmp(out[3]->id, "d0") == 0, "desc after");
    for (int i = 0; i < n; i++) kvs_doc_release(out[i]);
    CHECK(kvs_docstore_list(s, "d4", 0, out, 3, &more, err, sizeof err) == -ENOENT, "after a deleted id");
    CHECK(kvs_docstore_list(s, NULL, 0, NULL, 0, &more, err, sizeof err) == 0 && more == 1, "cap 0 says more");
    CHECK(kvs_docstore_list(s, NULL, 0, out, -1, NULL, err, sizeof err) == -EINVAL, "negative cap");
    kvs_docstore_free(s);
    printf("list: creation order, after-cursor pages, desc, has_more\n");
}

static void test_refcount(void)
{
    struct kvs_docstore *s;
    char err[256];
    CHECK(kvs_docstore_open(NULL, 0, 0, &s, err, sizeof err) == 0, "open");
    const struct kvs_doc *held = NULL;
    CHECK(add_simple(s, "cited", "a cited document", 7, NULL) == 0, "add");
    held = kvs_docstore_get(s, "cited");
    const struct kvs_doc *second = kvs_doc_ref(held);
    CHECK(kvs_docstore_delete(s, "cited", err, sizeof err) == 0, "delete while held");
    CHECK(kvs_docstore_get(s, "cited") == NULL, "gone for new requests");
    /* the holder still reads it (ASan would flag a use after free) */
    CHECK(held && strcmp(held->text, "a cited document") == 0 && held->n_tokens == 7 && held->tokens[6] == 1006,
          "holder reads the deleted document");
    kvs_doc_release(second);
    CHECK(held->tokens[0] == 1000, "still readable with one reference left");
    kvs_doc_release(held);
    /* a reference outlives the store itself */
    CHECK(add_simple(s, "outlive", "x", 1, &held) == 0, "add");
    kvs_docstore_free(s);
    CHECK(strcmp(held->text, "x") == 0, "reference outlives kvs_docstore_free");
    kvs_doc_release(held);
    kvs_doc_release(NULL);
    printf("refcount: deleted documents stay readable by their holders\n");
}

static int count_files(const char *dir, const char *suffix, int dot)
{
    DIR *d = opendir(dir);
    if (!d) return -1;
    int n = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        size_t l = strlen(de->d_name), k = strlen(suffix);
        if ((de->d_name[0] == '.') == dot && l >= k && strcmp(de->d_name + l - k, suffix) == 0 &&
            strcmp(de->d_name, ".") != 0 && strcmp(de->d_name, "..") != 0)
            n++;
    }
    closedir(d);
    return n;
}

static void write_text(const char *dir, const char *name, const char *text)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    KVS_ASSERT(f != NULL);
    KVS_ASSERT(fwrite(text, 1, strlen(text), f) == strlen(text));
    KVS_ASSERT(fclose(f) == 0);
}

/* Runs kvs_docstore_open with stderr captured into buf (for the warnings). */
static int open_capturing(const char *dir, struct kvs_docstore **s, char *buf, size_t cap)
{
    char logpath[] = "/tmp/kvs-test-docstore-log-XXXXXX";
    int lfd = mkstemp(logpath);
    KVS_ASSERT(lfd >= 0);
    fflush(stderr);
    int saved = dup(2);
    KVS_ASSERT(saved >= 0 && dup2(lfd, 2) >= 0);
    char err[256];
    int rc = kvs_docstore_open(dir, 0, 0, s, err, sizeof err);
    fflush(stderr);
    KVS_ASSERT(dup2(saved, 2) >= 0);
    close(saved);
    ssize_t n = pread(lfd, buf, cap - 1, 0);
    buf[n > 0 ? n : 0] = 0;
    close(lfd);
    unlink(logpath);
    fputs(buf, stderr);
    if (rc != 0) fprintf(stderr, "open: %s\n", err);
    return rc;
}

static void test_persistence(void)
{
    char root[512];
    KVS_ASSERT(kvs_test_mkdtemp(root, sizeof root, "kvs-test-docstore") == 0);
    char dir[4200], err[256];
    snprintf(dir, sizeof dir, "%s/docs", root);

    struct kvs_docstore *s;
    CHECK(kvs_docstore_open(dir, 0, 0, &s, err, sizeof err) == 0, "open creates the dir: %s", err);
    const char *tricky = "quote \" backslash \\ newline \n tab \t ctrl \x01 unicode 東京 🙂 </document>";
    int32_t toks[5] = {0, 1, 2147483647, 42, 151643};
    const struct kvs_doc *d = NULL;
    CHECK(kvs_docstore_add(s, "tricky", tricky, strlen(tricky), toks, 5, &d, err, sizeof err) == 0, "add: %s", err);
    double created = d ? d->created : 0;
    uint64_t hash = d ? d->hash : 0;
    kvs_doc_release(d);
    CHECK(add_simple(s, "second", "second doc", 2, NULL) == 0, "add second");
    CHECK(add_simple(s, "third", "third doc", 3, NULL) == 0, "add third");
    const struct kvs_doc *gen = NULL;
    CHECK(add_simple(s, NULL, "generated", 1, &gen) == 0, "add generated");
    char gen_id[KVS_DOC_ID_MAX + 1] = "";
    if (gen) snprintf(gen_id, sizeof gen_id, "%s", gen->id);
    kvs_doc_release(gen);
    CHECK(kvs_docstore_delete(s, "second", err, sizeof err) == 0, "delete second");
    CHECK(count_files(dir, ".json", 0) == 3, "three document files");
    CHECK(count_files(dir, ".tmp", 1) == 0, "no temp files left");
    kvs_docstore_free(s);

    /* the directory also holds junk a crash or an operator could leave */
    write_text(dir, "corrupt.json", "{\"id\": \"corrupt\", \"text\": \"unterminated");
    write_text(dir, "empty.json", "");
    write_text(dir, "badtokens.json", "{\"id\":\"bt\",\"text\":\"x\",\"tokens\":[1,-2],\"created\":1}");
    write_text(dir, "fraction.json", "{\"id\":\"fr\",\"text\":\"x\",\"tokens\":[1.5],\"created\":1}");
    write_text(dir, "badid.json", "{\"id\":\"../x\",\"text\":\"x\",\"tokens\":[1],\"created\":1}");
    write_text(dir, "array.json", "[1,2,3]");
    write_text(dir, ".crashed.json.tmp", "{\"id\":\"crashed\"");
    write_text(dir, "README.txt", "not a document");
    char sub[4300];
    snprintf(sub, sizeof sub, "%s/dir.json", dir);
    KVS_ASSERT(mkdir(sub, 0700) == 0);

    char log[16384];
    CHECK(open_capturing(dir, &s, log, sizeof log) == 0, "reopen");
    if (!s) return;
    CHECK(kvs_docstore_count(s) == 3, "three documents after reopen, got %d", kvs_docstore_count(s));
    const char *skipped[] = {"corrupt.json", "empty.json", "badtokens.json", "fraction.json", "badid.json",
                             "array.json", "dir.json"};
    for (int i = 0; i < 7; i++) {
        char needle[4400];
        snprintf(needle, sizeof needle, "skipping %s/%s", dir, skipped[i]);
        CHECK(strstr(log, needle) != NULL, "a warning names %s", skipped[i]);
    }
    CHECK(strstr(log, "warn") != NULL, "warnings are at warn level");
    CHECK(count_files(dir, ".tmp", 1) == 0, "leftover temp file removed");

    d = kvs_docstore_get(s, "tricky");
    CHECK(d && d->text_len == strlen(tricky) && strcmp(d->text, tricky) == 0, "text survives (escapes, unicode)");
    CHECK(d && d->n_tokens == 5 && memcmp(d->tokens, toks, sizeof toks) == 0, "tokens survive");
    CHECK(d && d->created == created && d->hash == hash, "created and hash survive");
    kvs_doc_release(d);
    CHECK(kvs_docstore_get(s, "second") == NULL, "the deleted document stays deleted");
    d = kvs_docstore_get(s, gen_id);
    CHECK(d && strcmp(d->text, "generated") == 0, "generated id survives");
    kvs_doc_release(d);
    const struct kvs_doc *out[8];
    int n = kvs_docstore_list(s, NULL, 0, out, 8, NULL, err, sizeof err);
    CHECK(n == 3 && strcmp(out[0]->id, "tricky") == 0 && strcmp(out[1]->id, "third") == 0 &&
              strcmp(out[2]->id, gen_id) == 0,
          "creation order survives");
    for (int i = 0; i < n; i++) kvs_doc_release(out[i]);
    CHECK(add_simple(s, "tricky", "dup", 1, NULL) == -EEXIST, "loaded ids are taken");
    CHECK(kvs_docstore_delete(s, "third", err, sizeof err) == 0, "delete a loaded document");
    kvs_docstore_free(s);
    CHECK(kvs_docstore_open(dir, 0, 0, &s, err, sizeof err) == 0 && kvs_docstore_count(s) == 2,
          "deleting a loaded document removes its file");
    kvs_docstore_free(s);

    /* a documents "dir" that is a file, or whose parent is missing */
    char file[4300];
    snprintf(file, sizeof file, "%s/tricky.json", dir);
    s = NULL;
    CHECK(kvs_docstore_open(file, 0, 0, &s, err, sizeof err) < 0 && s == NULL, "dir is a file: %s", err);
    snprintf(file, sizeof file, "%s/missing/parent", root);
    CHECK(kvs_docstore_open(file, 0, 0, &s, err, sizeof err) < 0 && s == NULL, "missing parent: %s", err);

    CHECK(kvs_test_rmtree(root) == 0, "cleanup");
    printf("persistence: reopen keeps documents, order, deletes; corrupt files skipped with warnings\n");
}

/* ---------------------------------------------------------------- concurrency */

#define N_THREADS 4
#define N_PER_THREAD 150
#define N_SHARED 40

struct worker {
    struct kvs_docstore *s;
    int tid;
    int added, shared_won, errors;
};

static void *worker_main(void *arg)
{
    struct worker *w = arg;
    char id[32], err[256];
    for (int i = 0; i < N_PER_THREAD; i++) {
        int32_t toks[3] = {w->tid, i, 7};
        snprintf(id, sizeof id, "t%d-%d", w->tid, i);
        /* a mix of client ids, generated ids, contested ids and readers */
        const char *use = (i % 3 == 0) ? NULL : id;
        int rc = kvs_docstore_add(w->s, use, "concurrent", 10, toks, 3, NULL, err, sizeof err);
        if (rc == 0) w->added++;
        else w->errors++;
        if (i < N_SHARED) {
            snprintf(id, sizeof id, "shared-%d", i);
            rc = kvs_docstore_add(w->s, id, "contested", 9, toks, 3, NULL, err, sizeof err);
            if (rc == 0) w->shared_won++;
            else if (rc != -EEXIST) w->errors++;
        }
        const struct kvs_doc *page[4];
        int n = kvs_docstore_list(w->s, NULL, i & 1, page, 4, NULL, err, sizeof err);
        for (int k = 0; k < n; k++) kvs_doc_release(page[k]);
        const struct kvs_doc *d = kvs_docstore_get(w->s, "shared-0");
        if (d && strcmp(d->text, "contested") != 0) w->errors++;
        kvs_doc_release(d);
    }
    return NULL;
}

static void run_concurrent(const char *dir, const char *what)
{
    struct kvs_docstore *s;
    char err[256];
    CHECK(kvs_docstore_open(dir, 0, 0, &s, err, sizeof err) == 0, "open: %s", err);
    pthread_t th[N_THREADS];
    struct worker w[N_THREADS];
    for (int t = 0; t < N_THREADS; t++) {
        w[t] = (struct worker){.s = s, .tid = t};
        KVS_ASSERT(pthread_create(&th[t], NULL, worker_main, &w[t]) == 0);
    }
    int added = 0, won = 0, errors = 0;
    for (int t = 0; t < N_THREADS; t++) {
        KVS_ASSERT(pthread_join(th[t], NULL) == 0);
        added += w[t].added, won += w[t].shared_won, errors += w[t].errors;
    }
    CHECK(errors == 0 && added == N_THREADS * N_PER_THREAD, "%s: all adds succeed (%d errors)", what, errors);
    CHECK(won == N_SHARED, "%s: each contested id is won exactly once (%d)", what, won);
    CHECK(kvs_docstore_count(s) == N_THREADS * N_PER_THREAD + N_SHARED, "%s: count %d", what, kvs_docstore_count(s));
    /* listing everything gives each document once, in increasing creation order */
    int total = N_THREADS * N_PER_THREAD + N_SHARED;
    const struct kvs_doc **all = kvs_xcalloc((size_t)total + 1, sizeof *all);
    int more = 0;
    int n = kvs_docstore_list(s, NULL, 0, all, total + 1, &more, err, sizeof err);
    int ordered = n == total && !more;
    for (int i = 1; i < n; i++)
        if (all[i]->seq <= all[i - 1]->seq) ordered = 0;
    CHECK(ordered, "%s: list is complete and ordered", what);
    for (int i = 0; i < n; i++) kvs_doc_release(all[i]);
    free(all);
    kvs_docstore_free(s);
    if (dir) {
        CHECK(kvs_docstore_open(dir, 0, 0, &s, err, sizeof err) == 0 && kvs_docstore_count(s) == total,
              "%s: all documents persisted", what);
        kvs_docstore_free(s);
    }
}

static void test_concurrent(void)
{
    run_concurrent(NULL, "memory");
    char root[512];
    KVS_ASSERT(kvs_test_mkdtemp(root, sizeof root, "kvs-test-docstore-conc") == 0);
    run_concurrent(root, "persistent");
    CHECK(kvs_test_rmtree(root) == 0, "cleanup");
    printf("concurrency: %d threads x %d adds + %d contested ids, with readers\n", N_THREADS, N_PER_THREAD, N_SHARED);
}

int main(void)
{
    test_basic();
    test_limits();
    test_list();
    test_refcount();
    test_persistence();
    test_concurrent();
    return kvs_test_summary("test_docstore");
}
