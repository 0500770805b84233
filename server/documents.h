/* documents.h: the server's registry of RAG documents (POST/GET/DELETE /v1/documents).
 *
 * A document is an id, its token ids and its text; requests cite documents by id and the
 * server places their tokens (completions) or text (chat, in the system turn) before the
 * prompt. With a directory configured every document is persisted as DIR/<id>.json
 * ({"id","created","text","tokens"}) written atomically (temp file + rename) and reloaded at
 * startup. Used from the event-loop thread only (not thread-safe by design).
 *
 * Ownership: kvs_docs_create/kvs_docs_free. Documents are owned by the registry; pointers
 * returned by kvs_docs_get / kvs_docs_at stay valid until the next add or delete.
 * Errors: 0 or negative errno (-ENOENT unknown id, -EEXIST id taken, -ENOSPC count limit,
 * -E2BIG too many tokens, -EIO persistence), with a message in err.
 */
#ifndef KVS_SERVER_DOCUMENTS_H
#define KVS_SERVER_DOCUMENTS_H

#include <stddef.h>
#include <stdint.h>

struct kvs_doc {
    char *id;
    char *text;
    int32_t *tokens;
    int n_tokens;
    int64_t created;     /* unix seconds */
};

struct kvs_docs;

/* dir may be NULL or "" (memory only); the directory is created if missing. */
int kvs_docs_create(const char *dir, int max_count, int max_tokens, struct kvs_docs **out, char *err,
                    size_t errlen);
void kvs_docs_free(struct kvs_docs *d);

/* Takes copies of text and tokens. id NULL = generate "doc-<16 hex>". Returns the stored doc. */
int kvs_docs_add(struct kvs_docs *d, const char *id, const char *text, const int32_t *tokens, int n_tokens,
                 const struct kvs_doc **out, char *err, size_t errlen);
const struct kvs_doc *kvs_docs_get(const struct kvs_docs *d, const char *id);
int kvs_docs_delete(struct kvs_docs *d, const char *id, char *err, size_t errlen);
int kvs_docs_count(const struct kvs_docs *d);
/* i-th document in creation order (0 <= i < count). */
const struct kvs_doc *kvs_docs_at(const struct kvs_docs *d, int i);

#endif
