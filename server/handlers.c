/* handlers.c: the endpoints. Routing, auth, OpenAI request -> engine requests, engine events ->
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
static int respond_json(struct call *c, int status, cJSON *j)
{
    char *s = cJSON_PrintUnformatted(j);
    cJSON_Delete(j);
    if (!s) return MHD_NO;
    return queue_body(c, status, "application/json", s, strlen(s), NULL);
}

static cJSON *error_object(const char *message, const char *type, const char *param, const char *code)
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
    cJSON *j = error_object(msg, type, param, code);
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
static int parse_body(struct kvs_server *s, struct call *c, enum kvs_api_kind kind, int check_model,
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

/* Encodes text into a malloc'ed id array. Returns count or negative errno. */
static void new_id(struct call *c, const char *prefix)
{
    static uint64_t counter;
    uint64_t x = (uint64_t)(kvs_wall_time() * 1e6) ^ (++counter * 0x9E3779B97F4A7C15ull);
    x ^= x >> 29;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 32;
    snprintf(c->id, sizeof c->id, "%s-%016llx%04llx", prefix, (unsigned long long)x,
             (unsigned long long)(counter & 0xffff));
}

static const char *finish_name(enum kvs_finish f)
{
    switch (f) {
    case KVS_FINISH_STOP: return "stop";
    case KVS_FINISH_LENGTH: return "length";
    case KVS_FINISH_TIMEOUT: return "timeout";
    case KVS_FINISH_CANCELLED: return "abort";
    default: return "error";
    }
}

static enum kvs_metric_reason finish_reason_metric(enum kvs_finish f)
{
    switch (f) {
    case KVS_FINISH_STOP: return KVS_REASON_STOP;
    case KVS_FINISH_LENGTH: return KVS_REASON_LENGTH;
    case KVS_FINISH_TIMEOUT: return KVS_REASON_TIMEOUT;
    case KVS_FINISH_CANCELLED: return KVS_REASON_ABORT;
    default: return KVS_REASON_ERROR;
    }
}

static cJSON *bytes_array(const char *t)
{
    cJSON *a = cJSON_CreateArray();
    for (const unsigned char *p = (const unsigned char *)t; *p; p++) cJSON_AddItemToArray(a, cJSON_CreateNumber(*p));
    return a;
}

/* ------------------------------------------------------------------------------------------ */
/* logprobs                                                                                    */

/* Chat: one entry of logprobs.content. */
static cJSON *chat_lp_entry(struct kvs_server *s, const struct call *c, const struct kvs_event *ev)
{
    cJSON *e = cJSON_CreateObject();
    char *t = kvs_token_str(s, c->tokens_as_ids, ev->token);
    cJSON_AddStringToObject(e, "token", t);
    cJSON_AddNumberToObject(e, "logprob", ev->logprob);
    cJSON_AddItemToObject(e, "bytes", bytes_array(t));
    free(t);
    cJSON *tops = cJSON_AddArrayToObject(e, "top_logprobs");
    for (int i = 0; i < ev->n_top; i++) {
        cJSON *o = cJSON_CreateObject();
        char *ts = kvs_token_str(s, c->tokens_as_ids, ev->top_ids[i]);
        cJSON_AddStringToObject(o, "token", ts);
        cJSON_AddNumberToObject(o, "logprob", ev->top_logprobs[i]);
        cJSON_AddItemToObject(o, "bytes", bytes_array(ts));
        free(ts);
        cJSON_AddItemToArray(tops, o);
    }
    return e;
}

/* ------------------------------------------------------------------------------------------ */
/* streaming                                                                                   */

static cJSON *chunk_new(struct call *c)
{
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "id", c->id);
    cJSON_AddStringToObject(j, "object", c->chat ? "chat.completion.chunk" : "text_completion");
    cJSON_AddNumberToObject(j, "created", (double)c->created);
    cJSON_AddStringToObject(j, "model", c->srv->model_name);
    return j;
}

static void emit(struct call *c, cJSON *j)
{
    char *s = cJSON_PrintUnformatted(j);
    cJSON_Delete(j);
    KVS_ASSERT(s != NULL);
    kvs_sbuf_append(&c->out, "data: ", 6);
    kvs_sbuf_append(&c->out, s, strlen(s));
    kvs_sbuf_append(&c->out, "\n\n", 2);
    free(s);
}

/* One chunk for one choice: text delta (or NULL), role (chat, first chunk), finish reason. */
static void emit_choice_chunk(struct call *c, struct choice *ch, const char *text, int role, const char *finish,
                              cJSON *logprobs)
{
    cJSON *j = chunk_new(c);
    cJSON *arr = cJSON_AddArrayToObject(j, "choices");
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "index", ch->index);
    if (c->chat) {
        cJSON *d = cJSON_AddObjectToObject(o, "delta");
        if (role) cJSON_AddStringToObject(d, "role", "assistant");
        if (text) cJSON_AddStringToObject(d, "content", text);
    } else {
        cJSON_AddStringToObject(o, "text", text ? text : "");
    }
    if (logprobs) cJSON_AddItemToObject(o, "logprobs", logprobs);
    else cJSON_AddNullToObject(o, "logprobs");
    if (finish) cJSON_AddStringToObject(o, "finish_reason", finish);
    else cJSON_AddNullToObject(o, "finish_reason");
    cJSON_AddItemToArray(arr, o);
    if (c->include_usage) cJSON_AddNullToObject(j, "usage");
    emit(c, j);
}

static void emit_error_chunk(struct call *c, const char *msg)
{
    cJSON *j = error_object(msg, "server_error", NULL, NULL);
    emit(c, j);
    c->stream_error = 1;
}

/* Streaming echo: the prompt (text and, with logprobs, its scored tokens) is the choice's first
 * chunk, sent once the prompt is scored, before its first token or its end. */
static void echo_flush(struct call *c, struct choice *ch)
{
    if (!ch->echo_pending) return;
    ch->echo_pending = 0;
    emit_choice_chunk(c, ch, ch->text.s ? ch->text.s : "", 0, NULL, ch->lp);
    ch->lp = NULL;
    kvs_sbuf_free(&ch->text);
}

/* usage: the prompt counts once per prompt (not per choice), completions add up. */
static cJSON *usage_object(struct call *c)
{
    int prompt = 0, completion = 0, cached = 0;
    for (int i = 0; i < c->n_choices; i++) {
        if (!c->choices[i].dropped) completion += c->choices[i].n_completion;   /* as vLLM: returned ones */
        if (i % c->n_per_prompt == 0) {
            prompt += c->choices[i].n_prompt;
            cached += c->choices[i].n_cached;
        }
    }
    cJSON *u = cJSON_CreateObject();
    cJSON_AddNumberToObject(u, "prompt_tokens", prompt);
    cJSON_AddNumberToObject(u, "completion_tokens", completion);
    cJSON_AddNumberToObject(u, "total_tokens", prompt + completion);
    cJSON *d = cJSON_AddObjectToObject(u, "prompt_tokens_details");
    cJSON_AddNumberToObject(d, "cached_tokens", cached);
    return u;
}

static void finish_stream(struct call *c)
{
    if (c->include_usage && !c->stream_error) {
        cJSON *j = chunk_new(c);
        cJSON_AddArrayToObject(j, "choices");
        cJSON_AddItemToObject(j, "usage", usage_object(c));
        emit(c, j);
    }
    kvs_sbuf_append(&c->out, "data: [DONE]\n\n", 14);
}

/* ------------------------------------------------------------------------------------------ */
/* engine events                                                                               */

static void on_token(struct kvs_server *s, struct call *c, struct choice *ch, const struct kvs_event *ev)
{
    double now = kvs_now();
    if (ch->last_token_at > 0) kvs_hist_observe(&s->metrics.itl, now - ch->last_token_at);
    else ch->first_token_at = now;
    ch->last_token_at = now;
    ch->n_completion++;
    ch->cum_logprob += ev->logprob;
    const char *text = ev->text ? ev->text : "";
    if (c->stream) {
        if (c->stream_error || c->client_gone) return;
        echo_flush(c, ch);
        cJSON *lp = NULL;
        if (c->logprobs) {
            if (c->chat) {
                lp = cJSON_CreateObject();
                cJSON *arr = cJSON_AddArrayToObject(lp, "content");
                cJSON_AddItemToArray(arr, chat_lp_entry(s, c, ev));
            } else {
                lp = kvs_cmpl_lp_new();
                kvs_cmpl_lp_add(s, c, lp, ev, ch->text_offset);
            }
        } else if (!*text) {
            return; /* an incomplete UTF-8 sequence: nothing to show yet */
        }
        /* chat: the role goes with the first token, as in vLLM (clients time the first chunk) */
        emit_choice_chunk(c, ch, text, c->chat && !ch->sent_role, NULL, lp);
        ch->sent_role = 1;
        ch->text_offset += (int)strlen(text);
        return;
    }
    if (c->logprobs) {
        if (!ch->lp) {
            if (c->chat) {
                ch->lp = cJSON_CreateObject();
                cJSON_AddArrayToObject(ch->lp, "content");
            } else {
                ch->lp = kvs_cmpl_lp_new();
            }
        }
        if (c->chat) cJSON_AddItemToArray(cJSON_GetObjectItem(ch->lp, "content"), chat_lp_entry(s, c, ev));
        else kvs_cmpl_lp_add(s, c, ch->lp, ev, ch->text_offset);
    }
    kvs_sbuf_append(&ch->text, text, strlen(text));
    ch->text_offset += (int)strlen(text);
}

static void on_final(struct kvs_server *s, struct call *c, struct choice *ch, const struct kvs_event *ev)
{
    ch->done = 1;
    c->n_done++;
    ch->finish = ev->type == KVS_EV_ERROR ? KVS_FINISH_ERROR : ev->finish;
    ch->n_prompt = ev->n_prompt_tokens;
    ch->n_completion = ev->n_completion_tokens;
    ch->n_cached = ev->n_cached_tokens;
    ch->queue_s = ev->queue_time_s;
    ch->ttft_s = ev->ttft_s;
    ch->e2e_s = ev->e2e_s;
    s->metrics.success[finish_reason_metric(ch->finish)]++;
    if (ch->finish != KVS_FINISH_CANCELLED && ch->finish != KVS_FINISH_ERROR) {
        if (ch->n_completion > 0) kvs_hist_observe(&s->metrics.ttft, ev->ttft_s);
        kvs_hist_observe(&s->metrics.e2e, ev->e2e_s);
        kvs_hist_observe(&s->metrics.queue, ev->queue_time_s);
    }
    if (ev->type == KVS_EV_ERROR) {
        ch->error = kvs_xstrdup(ev->error ? ev->error : "internal error");
        kvs_log(KVS_LOG_ERROR, "%s choice %d failed: %s", c->id, ch->index, ch->error);
    }
    if (!c->stream || c->client_gone || c->stream_error) return;
    if (ev->type == KVS_EV_ERROR) {
        emit_error_chunk(c, ch->error);
        kvs_call_cancel(c); /* the other choices cannot be reported any more */
        return;
    }
    echo_flush(c, ch);
    emit_choice_chunk(c, ch, c->chat ? NULL : "", c->chat && !ch->sent_role, finish_name(ch->finish), NULL);
    ch->sent_role = 1;
}

void kvs_call_cancel(struct call *c)
{
    for (int i = 0; i < c->n_choices; i++)
        if (c->choices[i].req && !c->choices[i].done) kvs_request_cancel(c->choices[i].req);
}

void kvs_call_cut(struct kvs_server *s, struct call *c, const char *msg)
{
    if (!c->n_choices || c->finished) return;
    kvs_call_cancel(c);
    c->cut = 1;
    if (c->stream && c->headers_sent && !c->client_gone) {
        if (!c->stream_error) emit_error_chunk(c, msg);
        kvs_sbuf_append(&c->out, "data: [DONE]\n\n", 14);
    }
    c->finished = 1;
    if (c->counted) {
        c->counted = 0;
        s->n_gen_calls--;
    }
    kvs_server_resume(s, c);
}

void kvs_call_pump(struct kvs_server *s, struct call *c)
{
    if (!c->n_choices || c->finished) return;
    struct kvs_event ev[32];
    int news = 0;
    for (int i = 0; i < c->n_choices; i++) {
        struct choice *ch = &c->choices[i];
        if (!ch->req || ch->done) continue;
        int n;
        while (!ch->done && (n = kvs_request_poll(ch->req, ev, 32)) > 0) {
            for (int k = 0; k < n; k++) {
                if (!ch->done) {
                    if (ev[k].type == KVS_EV_TOKEN) on_token(s, c, ch, &ev[k]);
                    else if (ev[k].type == KVS_EV_PROMPT) kvs_echo_prompt_token(s, c, ch, &ev[k]);
                    else on_final(s, c, ch, &ev[k]);
                }
                kvs_event_clear(&ev[k]);
            }
            news = 1;
        }
    }
    if (c->n_done == c->n_choices) {
        if (c->stream && !c->client_gone) finish_stream(c);
        c->finished = 1;
        if (c->counted) {
            c->counted = 0;
            s->n_gen_calls--;
        }
        news = 1;
    }
    if (!news) return;
    if (c->stream || c->finished) kvs_server_resume(s, c);
}

/* ------------------------------------------------------------------------------------------ */
/* generation                                                                                  */

static ssize_t stream_reader(void *cls, uint64_t pos, char *buf, size_t max)
{
    (void)pos;
    struct call *c = cls;
    if (c->aborting || c->client_gone) return MHD_CONTENT_READER_END_WITH_ERROR;
    size_t avail = c->out.len - c->out_off;
    if (avail) {
        size_t n = avail < max ? avail : max;
        memcpy(buf, c->out.s + c->out_off, n);
        c->out_off += n;
        if (c->out_off == c->out.len) c->out.len = c->out_off = 0;
        c->last_write = kvs_now();
        return (ssize_t)n;
    }
    if (c->finished) return MHD_CONTENT_READER_END_OF_STREAM;
    MHD_suspend_connection(c->conn);
    c->suspended = 1;
    return 0;
}

static int context_error(struct call *c, int ctx, int n_prompt, int max_tokens)
{
    return kvs_call_error(c, 400, "invalid_request_error", "context_length_exceeded",
                          c->chat ? "messages" : "prompt",
                          "This model's maximum context length is %d tokens. However, you requested %d tokens "
                          "(%d in the messages, %d in the completion). Please reduce the length of the messages "
                          "or completion.",
                          ctx, n_prompt + max_tokens, n_prompt, max_tokens);
}

/* Builds the token ids of every prompt, laid out for the engine's KV reuse strategy
 * (engine/prompt_layout.h). Returns 0 or queues an error (-1). */
static int build_prompts(struct kvs_server *s, struct call *c, const struct kvs_api_request *r,
                         struct kvs_prompt_set *ps, int *mhd_rc)
{
    const struct kvs_doc *docs[KVS_API_MAX_DOCS];
    struct kvs_prompt_doc pd[KVS_API_MAX_DOCS];
    for (int i = 0; i < r->n_documents; i++) {
        docs[i] = kvs_docstore_get(s->docs, r->documents[i]);
        if (!docs[i]) {
            for (int k = 0; k < i; k++) kvs_doc_release(docs[k]);
            *mhd_rc = kvs_call_error(c, 404, "invalid_request_error", "document_not_found", "documents",
                                     "document '%s' not found", r->documents[i]);
            return -1;
        }
        pd[i] = (struct kvs_prompt_doc){docs[i]->text, docs[i]->text_len, docs[i]->tokens, docs[i]->n_tokens};
    }
    struct kvs_chat_message *msgs = kvs_xcalloc((size_t)r->n_messages + 1, sizeof *msgs);
    for (int i = 0; i < r->n_messages; i++) msgs[i] = (struct kvs_chat_message){r->messages[i].role, r->messages[i].content};
    const char **ptext = kvs_xcalloc((size_t)r->n_prompts + 1, sizeof *ptext);
    const int32_t **pids = kvs_xcalloc((size_t)r->n_prompts + 1, sizeof *pids);
    int *pn = kvs_xcalloc((size_t)r->n_prompts + 1, sizeof *pn);
    for (int p = 0; p < r->n_prompts; p++) {
        ptext[p] = r->prompts[p].text;
        pids[p] = r->prompts[p].ids;
        pn[p] = r->prompts[p].n_ids;
    }
    struct kvs_prompt_in in = {
        .tok = s->tok, .chat_format = s->chat_format, .chat = c->chat, .messages = msgs, .n_messages = r->n_messages,
        .n_prompts = r->n_prompts, .prompt_text = ptext, .prompt_ids = pids, .prompt_n_ids = pn,
        .add_special_tokens = r->add_special_tokens, .docs = pd, .n_docs = r->n_documents,
    };
    in.doc_segments = s->engine ? kvs_engine_doc_layout(s->engine, &in.segment_align) : 0;
    char err[256] = "";
    const char *param = NULL;
    int rc = kvs_prompt_build(&in, ps, &param, err, sizeof err);
    for (int i = 0; i < r->n_documents; i++) kvs_doc_release(docs[i]);
    free(msgs);
    free(ptext);
    free(pids);
    free(pn);
    if (rc < 0) {
        *mhd_rc = kvs_call_error(c, 400, "invalid_request_error", NULL, param, "%s", err);
        return -1;
    }
    return 0;
}

static int submit_error(struct call *c, int rc, const char *msg)
{
    switch (rc) {
    case -EAGAIN:
        return kvs_call_error(c, 429, "rate_limit_error", "rate_limit_exceeded", NULL,
                              "the server is at capacity (%s); retry later", msg[0] ? msg : "queue full");
    case -E2BIG:
        return kvs_call_error(c, 400, "invalid_request_error", "context_length_exceeded", c->chat ? "messages" : "prompt",
                              "%s", msg[0] ? msg : "prompt too long");
    case -EINVAL:
        return kvs_call_error(c, 400, "invalid_request_error", NULL, NULL, "%s", msg[0] ? msg : "invalid request");
    case -ESHUTDOWN:
        c->srv->metrics.rejected++;
        return kvs_call_error(c, 503, "unavailable_error", NULL, NULL, "the server is shutting down");
    case -ENOSYS:
        return kvs_call_error(c, 501, "not_supported_error", NULL, NULL, "%s", msg[0] ? msg : "not supported");
    default:
        return kvs_call_error(c, 500, "server_error", NULL, NULL, "internal error: %s", msg[0] ? msg : "submit failed");
    }
}

static int gen_dispatch(struct kvs_server *s, struct call *c)
{
    struct kvs_api_request r;
    int parse_rc;
    if (parse_body(s, c, c->chat ? KVS_API_CHAT : KVS_API_COMPLETIONS, 1, &r, &parse_rc)) return parse_rc;
    struct kvs_prompt_set ps = {0};
    int mhd_rc = MHD_NO;
    if (build_prompts(s, c, &r, &ps, &mhd_rc)) {
        kvs_prompt_set_free(&ps);
        kvs_api_request_free(&r);
        return mhd_rc;
    }
    int ctx = s->max_context;
    int *max_tokens = kvs_xcalloc((size_t)ps.n, sizeof *max_tokens);
    for (int p = 0; p < ps.n; p++) {
        /* documents as segments count too, each padded (engine/prompt_layout.h) */
        int64_t slots = kvs_prompt_slots(&ps, p);
        int plen = slots > INT32_MAX / 2 ? INT32_MAX / 2 : (int)slots;
        int mt = r.max_tokens;
        if (mt < 0) {
            /* none given: scheduler.max_tokens_default; else completions 16 (the OpenAI and vLLM
             * default), chat up to the context */
            int dflt = s->cfg->max_tokens_default > 0 ? s->cfg->max_tokens_default : c->chat ? 0 : 16;
            mt = ctx - plen;
            if (dflt > 0 && dflt < mt) mt = dflt;
            if (mt < 1) mt = 1;
        }
        if ((int64_t)plen + mt > ctx) {
            int rc = context_error(c, ctx, plen, mt);
            free(max_tokens);
            kvs_prompt_set_free(&ps);
            kvs_api_request_free(&r);
            return rc;
        }
        max_tokens[p] = mt;
    }

    /* more choices than the waiting queue holds would get 429 forever: never retryable */
    if ((int64_t)ps.n * r.best_of > s->cfg->max_waiting) {
        int n_total = ps.n * r.best_of;
        free(max_tokens);
        kvs_prompt_set_free(&ps);
        kvs_api_request_free(&r);
        return kvs_call_error(c, 400, "invalid_request_error", "too_many_choices", "n",
                              "this request asks for %d choices (prompts x n) but scheduler.max_waiting is %d: it "
                              "could never be queued",
                              n_total, s->cfg->max_waiting);
    }
    c->stream = r.stream;
    c->include_usage = r.include_usage;
    c->logprobs = r.logprobs;
    c->top_logprobs = r.top_logprobs;
    c->tokens_as_ids = r.tokens_as_ids;
    c->created = (int64_t)kvs_wall_time();
    c->n_per_prompt = r.best_of;
    c->n_return = r.n;
    new_id(c, c->chat ? "chatcmpl" : "cmpl");
    int total = ps.n * r.best_of;
    c->choices = kvs_xcalloc((size_t)total, sizeof *c->choices);
    int submitted = 0, rc = 0;
    char err[256] = "";
    for (int p = 0; p < ps.n && !rc; p++) {
        for (int j = 0; j < r.best_of && !rc; j++) {
            struct kvs_request_params params;
            memset(&params, 0, sizeof params);
            params.prompt = ps.ids[p];
            params.n_prompt = ps.len[p];
            params.docs = ps.segs;
            params.n_docs = ps.n_segs;
            params.max_tokens = max_tokens[p];
            struct kvs_sampling *sp = &params.sampling;
            sp->temperature = r.temperature;
            sp->top_p = r.top_p;
            sp->top_k = r.top_k;
            sp->min_p = r.min_p;
            sp->has_seed = r.has_seed;
            sp->seed = r.seed + (uint64_t)j; /* n choices with one seed must still differ */
            sp->presence_penalty = r.presence_penalty;
            sp->frequency_penalty = r.frequency_penalty;
            sp->repetition_penalty = r.repetition_penalty;
            sp->n_logit_bias = r.n_bias;
            sp->logit_bias_ids = r.bias_ids;
            sp->logit_bias_values = r.bias_values;
            sp->logprobs = r.logprobs || r.best_of > r.n;   /* best_of ranks by cumulative logprob */
            sp->top_logprobs = r.top_logprobs;
            params.stop_strings = (const char *const *)r.stop;
            params.n_stop_strings = r.n_stop;
            params.ignore_eos = r.ignore_eos;
            params.skip_special = r.skip_special_tokens;
            params.timeout_s = s->cfg->request_timeout_s;
            /* echo: max_tokens 0 needs the engine's scoring mode even without logprobs */
            params.prompt_logprobs = r.echo && (r.logprobs || max_tokens[p] == 0);
            struct choice *ch = &c->choices[submitted];
            ch->index = submitted;
            ch->n_prompt = ps.len[p] + ps.seg_tokens;   /* the engine's count replaces it when it ends */
            if (r.echo) kvs_echo_begin(s, c, ch, r.prompts[p].text, ps.ids[p], ps.len[p]);
            ch->echo_pending = r.echo && r.stream;
            ch->req = kvs_request_new(&params, s->notify, s);
            if (!ch->req) {
                rc = -ENOMEM;
                snprintf(err, sizeof err, "cannot create the request");
                break;
            }
            rc = kvs_engine_submit(s->engine, ch->req, err, sizeof err);
            if (rc) {
                kvs_request_unref(ch->req);
                ch->req = NULL;
                break;
            }
            submitted++;
        }
    }
    free(max_tokens);
    kvs_prompt_set_free(&ps);
    kvs_api_request_free(&r);
    if (rc) {
        for (int i = 0; i < submitted; i++) {
            kvs_request_cancel(c->choices[i].req);
            kvs_request_unref(c->choices[i].req);
        }
        free(c->choices);
        c->choices = NULL;
        return submit_error(c, rc, err);
    }
    c->n_choices = total;
    c->counted = 1;
    s->n_gen_calls++;
    if (c->stream) {
        struct MHD_Response *resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 4096, stream_reader, c, NULL);
        if (!resp) return MHD_NO;
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
        MHD_add_response_header(resp, "X-Request-Id", c->id);
        enum MHD_Result q = MHD_queue_response(c->conn, MHD_HTTP_OK, resp);
        MHD_destroy_response(resp);
        c->responded = 1;
        c->status = 200;
        c->headers_sent = 1;
        c->last_write = kvs_now();
        s->metrics.http_requests++;
        return q;
    }
    MHD_suspend_connection(c->conn);
    c->suspended = 1;
    return MHD_YES;
}

/* best_of > n: of each prompt's best_of candidates the n with the highest cumulative logprob
 * are returned, best first, indexed prompt * n + rank (vLLM); the others are marked dropped. */
static void best_of_select(struct call *c)
{
    int per = c->n_per_prompt, keep = c->n_return;
    for (int p = 0; p < c->n_choices / per; p++) {
        struct choice *g = c->choices + (size_t)p * (size_t)per;
        for (int k = 0; k < per; k++) g[k].dropped = 1;
        for (int rank = 0; rank < keep; rank++) {
            int best = -1;
            for (int k = 0; k < per; k++)
                if (g[k].dropped && (best < 0 || g[k].cum_logprob > g[best].cum_logprob)) best = k;
            g[best].dropped = 0;
            g[best].index = p * keep + rank;
        }
    }
}

/* Non-streaming generation resumed: answer once every choice is done. */
int kvs_call_resumed(struct kvs_server *s, struct call *c)
{
    if (c->aborting || c->client_gone) return MHD_NO;
    if (c->stream || c->responded) return MHD_YES;
    if (!c->finished) {
        MHD_suspend_connection(c->conn);
        c->suspended = 1;
        return MHD_YES;
    }
    if (c->cut)
        return kvs_call_error(c, 503, "unavailable_error", NULL, NULL,
                              "the server is shutting down: the request was cancelled at the end of the grace period");
    for (int i = 0; i < c->n_choices; i++)
        if (c->choices[i].finish == KVS_FINISH_ERROR)
            return kvs_call_error(c, 500, "server_error", NULL, NULL, "generation failed: %s",
                                  c->choices[i].error ? c->choices[i].error : "internal error");
    if (c->n_return < c->n_per_prompt) best_of_select(c);
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "id", c->id);
    cJSON_AddStringToObject(j, "object", c->chat ? "chat.completion" : "text_completion");
    cJSON_AddNumberToObject(j, "created", (double)c->created);
    cJSON_AddStringToObject(j, "model", s->model_name);
    cJSON *arr = cJSON_AddArrayToObject(j, "choices");
    for (int out = 0; out < c->n_choices; out++) {
        /* in index order (best_of reorders); without best_of choice i has index i */
        struct choice *ch = NULL;
        for (int i = 0; i < c->n_choices && !ch; i++)
            if (!c->choices[i].dropped && c->choices[i].index == out) ch = &c->choices[i];
        if (!ch) break;
        cJSON *o = cJSON_CreateObject();
        cJSON_AddNumberToObject(o, "index", ch->index);
        const char *text = ch->text.s ? ch->text.s : "";
        if (c->chat) {
            cJSON *m = cJSON_AddObjectToObject(o, "message");
            cJSON_AddStringToObject(m, "role", "assistant");
            cJSON_AddStringToObject(m, "content", text);
        } else {
            cJSON_AddStringToObject(o, "text", text);
        }
        if (ch->lp) {
            cJSON_AddItemToObject(o, "logprobs", ch->lp);
            ch->lp = NULL;
        } else if (c->logprobs) {
            /* asked for but no tokens generated: an empty list, not null */
            cJSON *lp = c->chat ? cJSON_CreateObject() : kvs_cmpl_lp_new();
            if (c->chat) cJSON_AddArrayToObject(lp, "content");
            cJSON_AddItemToObject(o, "logprobs", lp);
        } else {
            cJSON_AddNullToObject(o, "logprobs");
        }
        cJSON_AddStringToObject(o, "finish_reason", finish_name(ch->finish));
        cJSON_AddItemToArray(arr, o);
    }
    cJSON_AddItemToObject(j, "usage", usage_object(c));
    return respond_json(c, 200, j);
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
    return respond_json(c, 200, j);
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
    return respond_json(c, 200, j);
}

/* GET /v1/models/{id} (the OpenAI client's models.retrieve) */
static int h_model_one(struct kvs_server *s, struct call *c, const char *id)
{
    if (strcmp(id, s->model_name) != 0)
        return model_not_found(c, id);
    return respond_json(c, 200, model_card(s));
}

static int h_tokenize(struct kvs_server *s, struct call *c)
{
    struct kvs_api_request r;
    int parse_rc;
    if (parse_body(s, c, KVS_API_TOKENIZE, 1, &r, &parse_rc)) return parse_rc;
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
    return respond_json(c, 200, j);
}

static int h_detokenize(struct kvs_server *s, struct call *c)
{
    struct kvs_api_request r;
    int parse_rc;
    if (parse_body(s, c, KVS_API_DETOKENIZE, 0, &r, &parse_rc)) return parse_rc;
    char *text = kvs_tokenizer_decode(s->tok, r.tokens, r.n_tokens, 0);
    kvs_api_request_free(&r);
    if (!text) return kvs_call_error(c, 500, "server_error", NULL, NULL, "out of memory");
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "prompt", text);
    free(text);
    return respond_json(c, 200, j);
}

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

static int h_doc_create(struct kvs_server *s, struct call *c)
{
    struct kvs_api_request r;
    int parse_rc;
    if (parse_body(s, c, KVS_API_DOC_CREATE, 0, &r, &parse_rc)) return parse_rc;
    int32_t *ids = NULL;
    int n;
    char *text;
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
        text = kvs_tokenizer_decode(s->tok, ids, n, 0);
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
    return respond_json(c, 200, j);
}

/* GET /v1/documents[?limit=N&after=ID&order=asc|desc]: OpenAI list shape with has_more. */
static int h_doc_list(struct kvs_server *s, struct call *c)
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
    return respond_json(c, 200, j);
}

static int h_doc_one(struct kvs_server *s, struct call *c, const char *id)
{
    const struct kvs_doc *d = kvs_doc_id_valid(id) ? kvs_docstore_get(s->docs, id) : NULL;
    if (!d)
        return kvs_call_error(c, 404, "invalid_request_error", "document_not_found", "id", "document '%.80s' not found", id);
    if (!strcmp(c->method, "GET")) {
        cJSON *j = doc_json(d, 1);
        kvs_doc_release(d);
        return respond_json(c, 200, j);
    }
    kvs_doc_release(d);
    char err[512] = "";
    int rc = kvs_docstore_delete(s->docs, id, err, sizeof err);
    if (rc) return doc_error(c, rc, err);
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "id", id);
    cJSON_AddStringToObject(j, "object", "document");
    cJSON_AddBoolToObject(j, "deleted", 1);
    return respond_json(c, 200, j);
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
        return respond_json(c, 200, j);
    }
    if (rt == R_METRICS) return h_metrics(s, c);
    if (!check_auth(s, c))
        return kvs_call_error(c, 401, "invalid_request_error", "invalid_api_key", NULL,
                              "Incorrect API key provided. Pass it as 'Authorization: Bearer <key>'.");
    if (rt == R_MODELS) return h_models(s, c);
    if (rt == R_MODEL) return h_model_one(s, c, c->url + 11);
    if (rt == R_DOCS && !strcmp(c->method, "GET")) return h_doc_list(s, c);
    if (rt == R_DOC) return h_doc_one(s, c, c->url + 14);
    if (s->state != KVS_SRV_SERVING) {
        s->metrics.rejected++;
        return kvs_call_error(c, 503, "unavailable_error", NULL, NULL,
                              s->state == KVS_SRV_LOADING ? "Loading model" : "the server is shutting down");
    }
    switch (rt) {
    case R_CMPL: return gen_dispatch(s, c);
    case R_CHAT: c->chat = 1; return gen_dispatch(s, c);
    case R_TOKENIZE: return h_tokenize(s, c);
    case R_DETOKENIZE: return h_detokenize(s, c);
    case R_DOCS: return h_doc_create(s, c);
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
