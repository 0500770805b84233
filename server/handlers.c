/* handlers.c: routing and the small endpoints. Routing, auth, OpenAI request -> engine requests, engine events ->
 * JSON responses and SSE chunks, tokenize/detokenize, models, health, metrics, documents. */
#include "server/handlers.h"

#include "engine/config.h"
#include "engine/text/tokenizer.h"
#include "base/util.h"
#include "engine/docstore.h"
#include "engine/prompt_layout.h"
#include "server/cmpl_logprobs.h"
#include "server/server.h"
#include "server/request_parse.h"

#include <cjson/cJSON.h>
#include <microhttpd.h>
#include <netdb.h>
#include <stdarg.h>
#include <string.h>

/* ------------------------------------------------------------------------------------------ */
/* responses                                                                                   */

static int queue_body(struct call *c, int status, const char *ctype, char *body, size_t len, const char *retry_after)
{
    struct MHD_Response *r = MHD_create_response_from_buffer(len, body, MHD_RESPMEM_MUST_FREE);
    if (!r) {
        free(body);
        return MHD_NO;
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, ctype);
    if (retry_after) MHD_add_response_header(r, MHD_HTTP_HEADER_RETRY_AFTER, retry_after);
    if (status == 405 && c->allow) MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, c->allow);
    if (c->close_conn) MHD_add_response_header(r, MHD_HTTP_HEADER_CONNECTION, "close");
    enum MHD_Result rc = MHD_queue_response(c->conn, (unsigned)status, r);
    MHD_destroy_response(r);
    c->responded = 1;
    c->status = status;
    c->srv->metrics.http_requests++;
    return rc;
}

/* Queues j (consumed) as the JSON body. */
int kvs_call_respond_json(struct call *c, int status, cJSON *j)
{
    char *s = cJSON_PrintUnformatted(j);
    cJSON_Delete(j);
    if (!s) return MHD_NO;
    return queue_body(c, status, "application/json", s, strlen(s), NULL);
}

cJSON *kvs_error_object(const char *message, const char *type, const char *param, const char *code)
{
    cJSON *e = cJSON_CreateObject();
    cJSON_AddStringToObject(e, "message", message);
    cJSON_AddStringToObject(e, "type", type);
    if (param && *param) cJSON_AddStringToObject(e, "param", param);
    else cJSON_AddNullToObject(e, "param");
    if (code) cJSON_AddStringToObject(e, "code", code);
    else cJSON_AddNullToObject(e, "code");
    cJSON *root = cJSON_CreateObject();
    cJSON_AddItemToObject(root, "error", e);
    return root;
}

int kvs_call_error(struct call *c, int status, const char *type, const char *code, const char *param,
                   const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (!type) {
        type = status == 401   ? "authentication_error"
               : status == 404 ? "not_found_error"
               : status == 429 ? "rate_limit_error"
               : status >= 500 ? (status == 503 ? "unavailable_error" : "server_error")
                               : "invalid_request_error";
    }
    cJSON *j = kvs_error_object(msg, type, param, code);
    const char *retry = (status == 429) ? "1" : (status == 503 ? "5" : NULL);
    char *body = cJSON_PrintUnformatted(j);
    cJSON_Delete(j);
    if (!body) return MHD_NO;
    return queue_body(c, status, "application/json", body, strlen(body), retry);
}

static int api_error(struct call *c, const struct kvs_api_error *e)
{
    return kvs_call_error(c, e->status, e->type, e->code, e->param, "%s", e->message);
}

static int model_not_found(struct call *c, const char *model)
{
    return kvs_call_error(c, 404, "invalid_request_error", "model_not_found", "model",
                          "The model `%.200s` does not exist.", model);
}

/* Parses the call's body as `kind` into *r. 0: parsed, the caller frees r. -1: the error
 * response is queued, r is freed, and *mhd_rc is what the handler returns. With check_model, a
 * "model" other than the one served is that error (404). */
int kvs_call_parse_body(struct kvs_server *s, struct call *c, enum kvs_api_kind kind, int check_model,
                      struct kvs_api_request *r, int *mhd_rc)
{
    struct kvs_api_error e;
    if (kvs_api_parse(kind, c->body.s, c->body.len, s->vocab_size, r, &e)) {
        kvs_api_request_free(r);
        *mhd_rc = api_error(c, &e);
        return -1;
    }
    if (check_model && r->model && strcmp(r->model, s->model_name) != 0) {
        *mhd_rc = model_not_found(c, r->model);
        kvs_api_request_free(r);
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* helpers                                                                                     */

int kvs_server_resolve(const char *host, int port, struct sockaddr_storage *out, char *err, size_t errlen)
{
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE;
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    int rc = getaddrinfo(host && *host ? host : NULL, ps, &hints, &res);
    if (rc != 0 || !res) return kvs_err(err, errlen, -EINVAL, "cannot resolve host '%s': %s", host, gai_strerror(rc));
    memcpy(out, res->ai_addr, res->ai_addrlen);
    freeaddrinfo(res);
    return 0;
}

/* Constant-time comparison of the bearer token (no early exit on the first difference). */
static int check_auth(struct kvs_server *s, struct call *c)
{
    const char *key = s->cfg->api_key;
    if (!key || !*key) return 1;
    const char *h = MHD_lookup_connection_value(c->conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    if (!h || strncmp(h, "Bearer ", 7) != 0) return 0;
    const char *tok = h + 7;
    size_t a = strlen(tok), b = strlen(key);
    size_t n = a > b ? a : b;
    unsigned char diff = (unsigned char)(a != b);
    for (size_t i = 0; i < n; i++) {
        unsigned char x = i < a ? (unsigned char)tok[i] : 0, y = i < b ? (unsigned char)key[i] : 0;
        diff |= (unsigned char)(x ^ y);
    }
    return diff == 0;
}

/* ------------------------------------------------------------------------------------------ */
/* other endpoints                                                                             */

static int h_health(struct kvs_server *s, struct call *c)
{
    if (s->state == KVS_SRV_LOADING)
        return kvs_call_error(c, 503, "unavailable_error", NULL, NULL, "Loading model");
    if (s->state == KVS_SRV_DRAINING)
        return kvs_call_error(c, 503, "unavailable_error", NULL, NULL, "Shutting down");
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "status", "ok");
    return kvs_call_respond_json(c, 200, j);
}

static int h_metrics(struct kvs_server *s, struct call *c)
{
    struct kvs_engine_stats es;
    if (s->engine) kvs_engine_stats(s->engine, &es);
    struct kvs_sbuf b = {0};
    kvs_metrics_render(&s->metrics, s->engine ? &es : NULL, s->model_name, kvs_docstore_count(s->docs), &b);
    char *body = b.s ? b.s : kvs_xstrdup("");
    return queue_body(c, 200, "text/plain; version=0.0.4; charset=utf-8", body, b.len, NULL);
}

static cJSON *model_card(struct kvs_server *s)
{
    cJSON *m = cJSON_CreateObject();
    cJSON_AddStringToObject(m, "id", s->model_name);
    cJSON_AddStringToObject(m, "object", "model");
    cJSON_AddNumberToObject(m, "created", (double)s->created);
    cJSON_AddStringToObject(m, "owned_by", "kvserve");
    cJSON_AddStringToObject(m, "root", s->cfg->model_path ? s->cfg->model_path : "");
    if (s->loaded) cJSON_AddNumberToObject(m, "max_model_len", s->max_context);
    else cJSON_AddNullToObject(m, "max_model_len");
    return m;
}

static int h_models(struct kvs_server *s, struct call *c)
{
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "object", "list");
    cJSON *data = cJSON_AddArrayToObject(j, "data");
    cJSON_AddItemToArray(data, model_card(s));
    return kvs_call_respond_json(c, 200, j);
}

/* GET /v1/models/{id} (the OpenAI client's models.retrieve) */
static int h_model_one(struct kvs_server *s, struct call *c, const char *id)
{
    if (strcmp(id, s->model_name) != 0)
        return model_not_found(c, id);
    return kvs_call_respond_json(c, 200, model_card(s));
}

int kvs_call_no_tokenizer(struct call *c, const char *param)
{
    return kvs_call_error(c, 400, "invalid_request_error", "no_tokenizer", param,
                          "this model has no tokenizer (no tokenizer.json in its directory): it takes and "
                          "returns token ids only");
}

static int h_tokenize(struct kvs_server *s, struct call *c)
{
    if (!s->tok) return kvs_call_no_tokenizer(c, "prompt");
    struct kvs_api_request r;
    int parse_rc;
    if (kvs_call_parse_body(s, c, KVS_API_TOKENIZE, 1, &r, &parse_rc)) return parse_rc;
    int32_t *ids = NULL;
    int n;
    if (r.n_messages) {
        if (s->chat_format == KVS_CHAT_UNKNOWN) {
            kvs_api_request_free(&r);
            return kvs_call_error(c, 400, "invalid_request_error", NULL, "messages", "this model has no chat format");
        }
        struct kvs_chat_message *msgs = kvs_xcalloc((size_t)r.n_messages, sizeof *msgs);
        for (int i = 0; i < r.n_messages; i++) msgs[i] = (struct kvs_chat_message){r.messages[i].role, r.messages[i].content};
        char err[256] = "";
        char *text = kvs_chat_render(s->chat_format, msgs, r.n_messages, NULL, 0, err, sizeof err);
        free(msgs);
        if (!text) {
            kvs_api_request_free(&r);
            return kvs_call_error(c, 400, "invalid_request_error", NULL, "messages", "%s", err);
        }
        size_t gl = strlen(kvs_chat_generation_prompt(s->chat_format)), tl = strlen(text);
        if (!r.add_generation_prompt && tl >= gl) text[tl - gl] = 0;
        n = kvs_tokenizer_encode_alloc(s->tok, text, r.add_special_tokens, 1, &ids);
        free(text);
    } else {
        n = kvs_tokenizer_encode_alloc(s->tok, r.prompts[0].text, r.add_special_tokens, 1, &ids);
    }
    kvs_api_request_free(&r);
    if (n < 0) return kvs_call_error(c, 400, "invalid_request_error", NULL, "prompt", "cannot tokenize the input");
    cJSON *j = cJSON_CreateObject();
    cJSON *arr = cJSON_AddArrayToObject(j, "tokens");
    for (int i = 0; i < n; i++) cJSON_AddItemToArray(arr, cJSON_CreateNumber(ids[i]));
    free(ids);
    cJSON_AddNumberToObject(j, "count", n);
    cJSON_AddNumberToObject(j, "max_model_len", s->max_context);
    return kvs_call_respond_json(c, 200, j);
}

static int h_detokenize(struct kvs_server *s, struct call *c)
{
    if (!s->tok) return kvs_call_no_tokenizer(c, "tokens");
    struct kvs_api_request r;
    int parse_rc;
    if (kvs_call_parse_body(s, c, KVS_API_DETOKENIZE, 0, &r, &parse_rc)) return parse_rc;
    char *text = kvs_tokenizer_decode(s->tok, r.tokens, r.n_tokens, 0);
    kvs_api_request_free(&r);
    if (!text) return kvs_call_error(c, 500, "server_error", NULL, NULL, "out of memory");
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "prompt", text);
    free(text);
    return kvs_call_respond_json(c, 200, j);
}

/* ------------------------------------------------------------------------------------------ */
/* routing                                                                                     */

enum route { R_NONE, R_HEALTH, R_VERSION, R_METRICS, R_MODELS, R_MODEL, R_CMPL, R_CHAT, R_TOKENIZE, R_DETOKENIZE, R_DOCS, R_DOC };

static enum route route_of(const char *url, const char **allowed)
{
    static const struct {
        const char *path;
        enum route r;
        const char *methods;
    } table[] = {
        {"/health", R_HEALTH, "GET, HEAD"},   /* load balancers probe with HEAD */
        {"/ping", R_HEALTH, "GET, POST, HEAD"},   /* vLLM's liveness route */
        {"/version", R_VERSION, "GET, HEAD"},
        {"/metrics", R_METRICS, "GET"},
        {"/v1/models", R_MODELS, "GET"},
        {"/v1/completions", R_CMPL, "POST"},
        {"/v1/chat/completions", R_CHAT, "POST"},
        {"/tokenize", R_TOKENIZE, "POST"},
        {"/detokenize", R_DETOKENIZE, "POST"},
        {"/v1/documents", R_DOCS, "GET, POST"},
    };
    for (size_t i = 0; i < sizeof table / sizeof *table; i++)
        if (!strcmp(url, table[i].path)) {
            *allowed = table[i].methods;
            return table[i].r;
        }
    if (!strncmp(url, "/v1/documents/", 14) && url[14]) {
        *allowed = "GET, DELETE";
        return R_DOC;
    }
    if (!strncmp(url, "/v1/models/", 11) && url[11]) {
        *allowed = "GET";
        return R_MODEL;
    }
    return R_NONE;
}

static int method_allowed(const char *allowed, const char *method)
{
    size_t n = strlen(method);
    for (const char *p = allowed; (p = strstr(p, method)) != NULL; p += n)
        if ((p == allowed || p[-1] == ' ') && (p[n] == 0 || p[n] == ',')) return 1;
    return 0;
}

int kvs_call_dispatch(struct kvs_server *s, struct call *c)
{
    const char *allowed = "";
    enum route rt = route_of(c->url, &allowed);
    if (rt == R_NONE) return kvs_call_error(c, 404, "not_found_error", NULL, NULL, "no route for %.200s", c->url);
    c->allow = allowed;
    if (!method_allowed(allowed, c->method))
        return kvs_call_error(c, 405, "invalid_request_error", NULL, NULL, "method %s not allowed on %.200s",
                              c->method, c->url);
    if (rt == R_HEALTH) return h_health(s, c);
    if (rt == R_VERSION) {
        cJSON *j = cJSON_CreateObject();
        cJSON_AddStringToObject(j, "version", KVS_VERSION);
        return kvs_call_respond_json(c, 200, j);
    }
    if (rt == R_METRICS) return h_metrics(s, c);
    if (!check_auth(s, c))
        return kvs_call_error(c, 401, "invalid_request_error", "invalid_api_key", NULL,
                              "Incorrect API key provided. Pass it as 'Authorization: Bearer <key>'.");
    if (rt == R_MODELS) return h_models(s, c);
    if (rt == R_MODEL) return h_model_one(s, c, c->url + 11);
    if (rt == R_DOCS && !strcmp(c->method, "GET")) return kvs_docs_list(s, c);
    if (rt == R_DOC) return kvs_docs_one(s, c, c->url + 14);
    if (s->state != KVS_SRV_SERVING) {
        s->metrics.rejected++;
        return kvs_call_error(c, 503, "unavailable_error", NULL, NULL,
                              s->state == KVS_SRV_LOADING ? "Loading model" : "the server is shutting down");
    }
    switch (rt) {
    case R_CMPL: return kvs_openai_generate(s, c);
    case R_CHAT: c->chat = 1; return kvs_openai_generate(s, c);
    case R_TOKENIZE: return h_tokenize(s, c);
    case R_DETOKENIZE: return h_detokenize(s, c);
    case R_DOCS: return kvs_docs_create(s, c);
    default: return kvs_call_error(c, 500, "server_error", NULL, NULL, "unrouted path");
    }
}

/* ------------------------------------------------------------------------------------------ */

void kvs_call_log(struct kvs_server *s, struct call *c, int toe)
{
    if (!s->cfg->access_log) return;
    int prompt = 0, completion = 0;
    double queue = 0, ttft = 0;
    for (int i = 0; i < c->n_choices; i++) {
        const struct choice *ch = &c->choices[i];
        completion += ch->n_completion;
        if (i % c->n_per_prompt == 0) prompt += ch->n_prompt;
        if (ch->queue_s > queue) queue = ch->queue_s;
        /* a choice that never finished has no engine TTFT: the server saw its first token */
        double t = ch->done ? ch->ttft_s : ch->first_token_at > 0 ? ch->first_token_at - c->t_start : 0;
        if (t > ttft) ttft = t;
    }
    /* who ended a request that did not complete normally */
    const char *ended = c->cut                                               ? " ended_by=server reason=shutdown_grace"
                        : toe == MHD_REQUEST_TERMINATED_COMPLETED_OK         ? ""
                        : c->aborting                                        ? " ended_by=server reason=shutdown"
                        : toe == MHD_REQUEST_TERMINATED_TIMEOUT_REACHED      ? " ended_by=server reason=idle_timeout"
                        : toe == MHD_REQUEST_TERMINATED_DAEMON_SHUTDOWN      ? " ended_by=server reason=shutdown"
                        : c->client_gone || toe == MHD_REQUEST_TERMINATED_CLIENT_ABORT ? " ended_by=client"
                                                                             : " ended_by=server reason=error";
    kvs_log(KVS_LOG_INFO, "access %s %s %d prompt_tokens=%d completion_tokens=%d queue=%.3fs ttft=%.3fs total=%.3fs%s",
            c->method, c->url, c->status ? c->status : 499, prompt, completion, queue, ttft, kvs_now() - c->t_start,
            ended);
}

void kvs_call_free(struct kvs_server *s, struct call *c)
{
    for (int i = 0; i < c->n_choices; i++) {
        struct choice *ch = &c->choices[i];
        if (ch->req) {
            if (!ch->done) {
                /* the client left first: its engine events will never be read, count it here */
                kvs_request_cancel(ch->req);
                s->metrics.success[KVS_REASON_ABORT]++;
            }
            kvs_request_unref(ch->req);
        }
        kvs_sbuf_free(&ch->text);
        cJSON_Delete(ch->lp);
        free(ch->error);
    }
    if (c->counted) s->n_gen_calls--;
    free(c->choices);
    kvs_sbuf_free(&c->body);
    kvs_sbuf_free(&c->out);
    free(c->url);
    free(c);
}
