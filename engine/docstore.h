/* docstore.h: the document store for RAG (POST/GET/DELETE /v1/documents; requests cite ids).
 *
 * A document is immutable once added: {id, text (UTF-8), token ids, content hash, created,
 * size}. The tokenizer is not here: the caller passes the token ids it made from the text.
 *
 * Ownership: documents are reference counted. kvs_docstore_add (its out), kvs_docstore_get and
 * kvs_docstore_list hand out references; every one is given back with kvs_doc_release. The
 * store holds one reference per stored document; delete drops it, so a request that cites a
 * document keeps reading it (text, tokens) until it releases it, even after a DELETE or after
 * kvs_docstore_free. kvs_doc_ref takes an extra reference (e.g. one per request that cites it).
 *
 * Thread safety: every function may be called from any thread concurrently (one mutex guards
 * the index; file writes run outside it, so a slow disk does not stall get/list).
 *
 * Persistence (dir set): one file per document, "<id>.json" holding {"id", "text", "tokens",
 * "created"} (cJSON); written to a dot-temp file in the same directory,
 * fsync'ed, renamed into place, then the directory is fsync'ed; delete unlinks the file and
 * fsyncs the directory. kvs_docstore_open loads every *.json file: unreadable or invalid ones
 * are skipped with a warning (never fatal), leftover temp files are removed, and of two files
 * with the same id the newer is kept (the other is left on disk, with a warning). Documents
 * loaded beyond the limits are kept (warning); adds fail until deletes make room.
 * While an add or delete of an id is writing its file, the id is neither visible nor free:
 * get/list/delete answer -ENOENT/skip it and a second add of it gets -EEXIST.
 *
 * Errors: 0 / negative errno with a message in err:
 *   -EINVAL  bad id (1..64 chars of [A-Za-z0-9._-], not starting with '.'), text not UTF-8 or
 *            containing NUL, no tokens, negative token id
 *   -EEXIST  the client id is taken          -ENOENT  no such document
 *   -E2BIG   more tokens than max_tokens     -ENOSPC  max_count documents already stored
 *   -EIO     the file could not be written/removed (the store is left unchanged for add)
 */
#ifndef KVS_DOCSTORE_H
#define KVS_DOCSTORE_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

struct kvs_config;

#define KVS_DOC_ID_MAX 64

struct kvs_doc {
    char id[KVS_DOC_ID_MAX + 1];
    char *text;            /* [text_len + 1], NUL-terminated UTF-8 */
    size_t text_len;       /* bytes: the "size" of the document */
    int32_t *tokens;       /* [n_tokens] */
    int n_tokens;
    uint64_t hash;         /* kvs_doc_hash_tokens(tokens): keys the document's KV in caches */
    double created;        /* wall-clock seconds since the epoch */
    uint64_t seq;          /* creation order inside this store (listing order) */
    /* private */
    atomic_int refs;
    char *file;            /* file name inside dir, NULL when in memory only */
};

struct kvs_docstore;

/* Opens a store. dir NULL or "" = in memory only; otherwise the directory is created when
 * missing (one level) and its documents are loaded. max_count / max_tokens <= 0 = no limit. */
int kvs_docstore_open(const char *dir, int max_count, int max_tokens, struct kvs_docstore **out,
                      char *err, size_t errlen);
/* Opens with cfg's documents_dir, documents_max_count, documents_max_tokens. */
int kvs_docstore_open_config(const struct kvs_config *cfg, struct kvs_docstore **out, char *err, size_t errlen);
/* Drops the store's references; documents still referenced by callers stay valid. NULL ok. */
void kvs_docstore_free(struct kvs_docstore *s);

/* Adds a document. id NULL or "" generates "doc-" + 24 lowercase hex chars (random).
 * text need not be NUL-terminated (text_len bytes). out (may be NULL) receives a reference. */
int kvs_docstore_add(struct kvs_docstore *s, const char *id, const char *text, size_t text_len,
                     const int32_t *tokens, int n_tokens, const struct kvs_doc **out, char *err, size_t errlen);
/* A referenced document, or NULL when there is none with this id. */
const struct kvs_doc *kvs_docstore_get(struct kvs_docstore *s, const char *id);
/* Removes the document (and its file). Holders of references keep reading it. */
int kvs_docstore_delete(struct kvs_docstore *s, const char *id, char *err, size_t errlen);

/* Lists documents in creation order (desc=1: newest first), starting after the document
 * `after` (NULL = from the start; an id that is not stored gives -ENOENT), at most cap of them.
 * Writes referenced documents into out and *has_more (may be NULL) = 1 when more follow.
 * Returns the number written or a negative errno. */
int kvs_docstore_list(struct kvs_docstore *s, const char *after, int desc, const struct kvs_doc **out, int cap,
                      int *has_more, char *err, size_t errlen);

int kvs_docstore_count(struct kvs_docstore *s);
/* Totals for metrics: documents, tokens, text bytes. Any pointer may be NULL. */
void kvs_docstore_stats(struct kvs_docstore *s, int *n_docs, int64_t *n_tokens, int64_t *n_bytes);

const struct kvs_doc *kvs_doc_ref(const struct kvs_doc *d);
/* Gives back a reference; the last one frees the document. NULL ok. */
void kvs_doc_release(const struct kvs_doc *d);

/* 64-bit FNV-1a over the token ids (each as 4 little-endian bytes). */
uint64_t kvs_doc_hash_tokens(const int32_t *tokens, int n);

/* 1 when id is acceptable as a client-given document id (see -EINVAL above). */
int kvs_doc_id_valid(const char *id);

#endif
