/* openai_gen.c: the generation endpoints, /v1/completions and /v1/chat/completions: prompt
 * building (laid out for the KV reuse strategy by engine/prompt_layout.c), context checks,
 * submission of one engine request per choice (n, best_of), and the way back: engine events to
 * SSE chunks (streaming) or the final JSON, logprobs, echo, usage, finish reasons. Routing, auth
 * and the error helpers are handlers.c's. Loop thread only. */
#include "server/handlers.h"

#include <cjson/cJSON.h>
#include <microhttpd.h>
#include <string.h>

#include "base/util.h"
#include "engine/config.h"
#include "engine/docstore.h"
#include "engine/prompt_layout.h"
#include "engine/text/tokenizer.h"
#include "server/cmpl_logprobs.h"
#include "server/request_parse.h"
#include "server/server.h"

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
    cJSON *j = kvs_error_object(msg, "server_error", NULL, NULL);
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
        } else if (!*text && s->tok) {
            return; /* an incomplete UTF-8 sequence: nothing to show yet */
        }
        /* a token-id-only model (no tokenizer) has no text at all: one chunk per token still,
         * so that streaming clients see each token arrive (ITL, as vLLM does without detokenizing) */
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

static int context_error(struct kvs_server *s, struct call *c, int ctx, int n_prompt, int max_tokens)
{
    /* the engine's note names the KV memories when they, not the model, set the limit */
    return kvs_call_error(c, 400, "invalid_request_error", "context_length_exceeded",
                          c->chat ? "messages" : "prompt",
                          "This model's maximum context length is %d tokens. However, you requested %d tokens "
                          "(%d in the messages, %d in the completion). Please reduce the length of the messages "
                          "or completion.%s",
                          ctx, n_prompt + max_tokens, n_prompt, max_tokens,
                          s->engine ? kvs_engine_context_note(s->engine) : "");
}

/* Builds the token ids of every prompt, laid out for the engine's KV reuse strategy
 * (engine/prompt_layout.h). Returns 0 or queues an error (-1). */
static int build_prompts(struct kvs_server *s, struct call *c, const struct kvs_api_request *r,
                         struct kvs_prompt_set *ps, int *mhd_rc)
{
    if (!s->tok) {   /* token-id-only model: text inputs cannot be tokenized */
        int text = r->n_messages > 0 || c->chat;
        for (int p = 0; p < r->n_prompts; p++) text |= r->prompts[p].text != NULL;
        if (text) {
            *mhd_rc = kvs_call_no_tokenizer(c, c->chat ? "messages" : "prompt");
            return -1;
        }
    }
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

int kvs_openai_generate(struct kvs_server *s, struct call *c)
{
    struct kvs_api_request r;
    int parse_rc;
    if (kvs_call_parse_body(s, c, c->chat ? KVS_API_CHAT : KVS_API_COMPLETIONS, 1, &r, &parse_rc)) return parse_rc;
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
            int rc = context_error(s, c, ctx, plen, mt);
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
    return kvs_call_respond_json(c, 200, j);
}
