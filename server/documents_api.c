/* documents_api.c: the documents endpoints (/v1/documents: create, list, get, delete) over the
 * docstore (engine/docstore.h). RAG clients post a document once and cite it by id in
 * generation requests (openai_gen.c). Loop thread only. */
#include "server/handlers.h"

#include <cjson/cJSON.h>
#include <microhttpd.h>
#include <string.h>

#include "base/util.h"
#include "engine/config.h"
#include "engine/docstore.h"
#include "engine/text/tokenizer.h"
#include "server/request_parse.h"

static cJSON *doc_json(const struct kvs_doc *d, int with_text)
{
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "id", d->id);
    cJSON_AddStringToObject(j, "object", "document");
    cJSON_AddNumberToObject(j, "created", (double)(int64_t)d->created);
    cJSON_AddNumberToObject(j, "tokens", d->n_tokens);
    cJSON_AddNumberToObject(j, "bytes", (double)d->text_len);
    if (with_text) cJSON_AddStringToObject(j, "text", d->text);
    return j;
}

static int doc_error(struct call *c, int rc, const char *err)
{
    switch (rc) {
    case -EEXIST: return kvs_call_error(c, 409, "invalid_request_error", "document_exists", "id", "%s", err);
    case -ENOENT: return kvs_call_error(c, 404, "invalid_request_error", "document_not_found", "id", "%s", err);
    case -ENOSPC: return kvs_call_error(c, 400, "invalid_request_error", "document_store_full", NULL, "%s", err);
    case -E2BIG: return kvs_call_error(c, 400, "invalid_request_error", "document_too_long", "text", "%s", err);
    case -EINVAL: return kvs_call_error(c, 400, "invalid_request_error", NULL, NULL, "%s", err);
    default: return kvs_call_error(c, 500, "server_error", NULL, NULL, "%s", err);
    }
}

int kvs_docs_create(struct kvs_server *s, struct call *c)
{
    struct kvs_api_request r;
    int parse_rc;
    if (kvs_call_parse_body(s, c, KVS_API_DOC_CREATE, 0, &r, &parse_rc)) return parse_rc;
    int32_t *ids = NULL;
    int n;
    char *text;
    if (r.text && !s->tok) {
        kvs_api_request_free(&r);
        return kvs_call_no_tokenizer(c, "text");
    }
    if (r.text) {
        /* document text is content, never instructions: special tokens stay plain text */
        n = kvs_tokenizer_encode_alloc(s->tok, r.text, 0, 0, &ids);
        text = kvs_xstrdup(r.text);
        if (n <= 0) {
            free(ids);
            free(text);
            kvs_api_request_free(&r);
            return kvs_call_error(c, 400, "invalid_request_error", NULL, "text", "cannot tokenize the text");
        }
    } else {
        n = r.n_tokens;
        ids = r.tokens;
        r.tokens = NULL;
        text = s->tok ? kvs_tokenizer_decode(s->tok, ids, n, 0) : NULL;
        if (!text) text = kvs_xstrdup("");
    }
    if (n >= s->max_context) {   /* it could never be cited: nothing would be left for the question */
        const char *param = r.text ? "text" : "tokens";
        free(ids);
        free(text);
        kvs_api_request_free(&r);
        return kvs_call_error(c, 400, "invalid_request_error", "document_too_long", param,
                              "the document has %d tokens but the model's context is %d tokens: it could never be "
                              "cited",
                              n, s->max_context);
    }
    const struct kvs_doc *doc = NULL;
    char err[512] = "";
    int rc = kvs_docstore_add(s->docs, r.doc_id, text, strlen(text), ids, n, &doc, err, sizeof err);
    free(ids);
    free(text);
    kvs_api_request_free(&r);
    if (rc) return doc_error(c, rc, err);
    cJSON *j = doc_json(doc, 0);
    kvs_doc_release(doc);
    return kvs_call_respond_json(c, 200, j);
}

/* GET /v1/documents[?limit=N&after=ID&order=asc|desc]: OpenAI list shape with has_more. */
int kvs_docs_list(struct kvs_server *s, struct call *c)
{
    const char *ls = MHD_lookup_connection_value(c->conn, MHD_GET_ARGUMENT_KIND, "limit");
    const char *after = MHD_lookup_connection_value(c->conn, MHD_GET_ARGUMENT_KIND, "after");
    const char *order = MHD_lookup_connection_value(c->conn, MHD_GET_ARGUMENT_KIND, "order");
    int limit = 1000;
    if (ls) {
        char *end;
        long v = strtol(ls, &end, 10);
        if (*end || v < 1 || v > 1000)
            return kvs_call_error(c, 400, "invalid_request_error", NULL, "limit", "'limit' must be in [1, 1000]");
        limit = (int)v;
    }
    if (order && strcmp(order, "asc") && strcmp(order, "desc"))
        return kvs_call_error(c, 400, "invalid_request_error", NULL, "order", "'order' must be asc or desc");
    const struct kvs_doc **docs = kvs_xcalloc((size_t)limit, sizeof *docs);
    int has_more = 0;
    char err[256] = "";
    int n = kvs_docstore_list(s->docs, after && *after ? after : NULL, order && !strcmp(order, "desc"), docs, limit,
                              &has_more, err, sizeof err);
    if (n < 0) {
        free(docs);
        return n == -ENOENT ? kvs_call_error(c, 400, "invalid_request_error", NULL, "after", "%s", err)
                            : kvs_call_error(c, 500, "server_error", NULL, NULL, "%s", err);
    }
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "object", "list");
    cJSON *data = cJSON_AddArrayToObject(j, "data");
    for (int i = 0; i < n; i++) {
        cJSON_AddItemToArray(data, doc_json(docs[i], 0));
        kvs_doc_release(docs[i]);
    }
    free(docs);
    cJSON_AddBoolToObject(j, "has_more", has_more);
    return kvs_call_respond_json(c, 200, j);
}

int kvs_docs_one(struct kvs_server *s, struct call *c, const char *id)
{
    const struct kvs_doc *d = kvs_doc_id_valid(id) ? kvs_docstore_get(s->docs, id) : NULL;
    if (!d)
        return kvs_call_error(c, 404, "invalid_request_error", "document_not_found", "id", "document '%.80s' not found", id);
    if (!strcmp(c->method, "GET")) {
        cJSON *j = doc_json(d, 1);
        kvs_doc_release(d);
        return kvs_call_respond_json(c, 200, j);
    }
    kvs_doc_release(d);
    char err[512] = "";
    int rc = kvs_docstore_delete(s->docs, id, err, sizeof err);
    if (rc) return doc_error(c, rc, err);
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "id", id);
    cJSON_AddStringToObject(j, "object", "document");
    cJSON_AddBoolToObject(j, "deleted", 1);
    return kvs_call_respond_json(c, 200, j);
}
