/* request_parse.c: JSON body -> struct kvs_api_request, with every field type- and range-checked.
 * Unknown fields are ignored (OpenAI clients send extras); known fields with the wrong type or
 * an out-of-range value are a 400 naming the field in "param". */
#include "server/request_parse.h"

#include "server/json_strict.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int kvs_api_error_set(struct kvs_api_error *err, int status, const char *type, const char *code,
                      const char *param, const char *fmt, ...)
{
    err->status = status;
    err->type = type ? type : "invalid_request_error";
    err->code = code;
    snprintf(err->param, sizeof err->param, "%s", param ? param : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->message, sizeof err->message, fmt, ap);
    va_end(ap);
    return -EINVAL;
}

#define BAD(param, ...) kvs_api_error_set(err, 400, "invalid_request_error", NULL, param, __VA_ARGS__)

int kvs_api_valid_doc_id(const char *s)
{
    size_t n = strlen(s);
    if (n == 0 || n > KVS_API_MAX_ID_LEN) return 0;
    if (s[0] == '.') return 0; /* hidden / temp files in the documents dir */
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
              c == '-' || c == '.'))
            return 0;
    }
    return 1;
}

static char *dupstr(const char *s)
{
    size_t n = strlen(s) + 1;
    char *p = malloc(n);
    if (p) memcpy(p, s, n);
    return p;
}

/* Optional field: absent or JSON null -> NULL. */
static const cJSON *field(const cJSON *root, const char *name)
{
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(root, name);
    if (!it || cJSON_IsNull(it)) return NULL;
    return it;
}

static int get_number(const cJSON *root, const char *name, double lo, double hi, float *dst,
                      struct kvs_api_error *err)
{
    const cJSON *it = field(root, name);
    if (!it) return 0;
    if (!cJSON_IsNumber(it) || !isfinite(it->valuedouble)) return BAD(name, "'%s' must be a number", name);
    double v = it->valuedouble;
    if (v < lo || v > hi) return BAD(name, "'%s' must be between %g and %g, got %g", name, lo, hi, v);
    *dst = (float)v;
    return 0;
}

static int json_int(const cJSON *it, int64_t lo, int64_t hi, int64_t *out)
{
    if (!cJSON_IsNumber(it)) return -1;
    double v = it->valuedouble;
    if (!isfinite(v) || v != floor(v)) return -1;
    if (v < (double)lo || v > (double)hi) return -2;
    *out = (int64_t)v;
    return 0;
}

static int get_int(const cJSON *root, const char *name, int64_t lo, int64_t hi, int *dst,
                   struct kvs_api_error *err)
{
    const cJSON *it = field(root, name);
    if (!it) return 0;
    int64_t v;
    int rc = json_int(it, lo, hi, &v);
    if (rc == -1) return BAD(name, "'%s' must be an integer", name);
    if (rc == -2)
        return BAD(name, "'%s' must be between %lld and %lld, got %g", name, (long long)lo, (long long)hi,
                   it->valuedouble);
    *dst = (int)v;
    return 0;
}

static int get_bool(const cJSON *root, const char *name, int *dst, struct kvs_api_error *err)
{
    const cJSON *it = field(root, name);
    if (!it) return 0;
    if (!cJSON_IsBool(it)) return BAD(name, "'%s' must be a boolean", name);
    *dst = cJSON_IsTrue(it) ? 1 : 0;
    return 0;
}

static int get_string(const cJSON *root, const char *name, char **dst, struct kvs_api_error *err)
{
    const cJSON *it = field(root, name);
    if (!it) return 0;
    if (!cJSON_IsString(it)) return BAD(name, "'%s' must be a string", name);
    *dst = dupstr(it->valuestring);
    if (!*dst) return kvs_api_error_set(err, 500, "server_error", NULL, NULL, "out of memory");
    return 0;
}

/* A JSON array of token ids -> malloc'ed int32 array. An empty array is allowed only if allow_empty. */
static int parse_ids(const cJSON *arr, const char *param, int vocab_size, int allow_empty, int32_t **ids_out,
                     int *n_out, struct kvs_api_error *err)
{
    int n = cJSON_GetArraySize(arr);
    if (n == 0 && !allow_empty) return BAD(param, "'%s' must not be empty", param);
    if (n > KVS_API_MAX_TOKEN_IDS) return BAD(param, "'%s' has too many tokens (%d)", param, n);
    int32_t *ids = malloc(sizeof *ids * (size_t)(n > 0 ? n : 1));
    if (!ids) return kvs_api_error_set(err, 500, "server_error", NULL, NULL, "out of memory");
    int i = 0;
    const cJSON *el;
    cJSON_ArrayForEach(el, arr)
    {
        int64_t v;
        int64_t hi = vocab_size > 0 ? vocab_size - 1 : INT32_MAX;
        int rc = json_int(el, 0, hi, &v);
        if (rc) {
            free(ids);
            if (rc == -1) return BAD(param, "'%s' must contain integer token ids", param);
            return BAD(param, "token id %g in '%s' is out of range [0, %lld]", el->valuedouble, param,
                       (long long)hi);
        }
        ids[i++] = (int32_t)v;
    }
    *ids_out = ids;
    *n_out = n;
    return 0;
}

static int is_int_array(const cJSON *arr)
{
    const cJSON *el = arr->child;
    return el && cJSON_IsNumber(el);
}

static int parse_prompt(const cJSON *root, int vocab_size, struct kvs_api_request *r, struct kvs_api_error *err)
{
    const cJSON *p = field(root, "prompt");
    if (!p) return BAD("prompt", "'prompt' is required");
    if (cJSON_IsString(p)) {
        r->prompts = calloc(1, sizeof *r->prompts);
        if (!r->prompts) return kvs_api_error_set(err, 500, "server_error", NULL, NULL, "out of memory");
        r->n_prompts = 1;
        r->prompts[0].text = dupstr(p->valuestring);
        if (!r->prompts[0].text) return kvs_api_error_set(err, 500, "server_error", NULL, NULL, "out of memory");
        return 0;
    }
    if (!cJSON_IsArray(p)) return BAD("prompt", "'prompt' must be a string, an array of strings or token ids");
    int n = cJSON_GetArraySize(p);
    if (n == 0) return BAD("prompt", "'prompt' must not be empty");
    if (is_int_array(p)) {
        r->prompts = calloc(1, sizeof *r->prompts);
        if (!r->prompts) return kvs_api_error_set(err, 500, "server_error", NULL, NULL, "out of memory");
        r->n_prompts = 1;
        return parse_ids(p, "prompt", vocab_size, 0, &r->prompts[0].ids, &r->prompts[0].n_ids, err);
    }
    if (n > KVS_API_MAX_PROMPTS) return BAD("prompt", "at most %d prompts per request, got %d", KVS_API_MAX_PROMPTS, n);
    r->prompts = calloc((size_t)n, sizeof *r->prompts);
    if (!r->prompts) return kvs_api_error_set(err, 500, "server_error", NULL, NULL, "out of memory");
    r->n_prompts = n;
    int i = 0;
    const cJSON *el;
    cJSON_ArrayForEach(el, p)
    {
        if (cJSON_IsString(el)) {
            r->prompts[i].text = dupstr(el->valuestring);
            if (!r->prompts[i].text) return kvs_api_error_set(err, 500, "server_error", NULL, NULL, "out of memory");
        } else if (cJSON_IsArray(el)) {
            int rc = parse_ids(el, "prompt", vocab_size, 0, &r->prompts[i].ids, &r->prompts[i].n_ids, err);
            if (rc) return rc;
        } else {
            return BAD("prompt", "'prompt' must be a string, an array of strings or token ids");
        }
        i++;
    }
    return 0;
}

/* content: string, null (assistant only), or an array of {"type":"text","text":...} parts. */
static int parse_content(const cJSON *c, const char *role, char **out, struct kvs_api_error *err)
{
    if (!c || cJSON_IsNull(c)) {
        if (strcmp(role, "assistant") != 0) return BAD("messages", "message content is required for role '%s'", role);
        *out = dupstr("");
    } else if (cJSON_IsString(c)) {
        *out = dupstr(c->valuestring);
    } else if (cJSON_IsArray(c)) {
        size_t total = 1;
        const cJSON *part;
        cJSON_ArrayForEach(part, c)
        {
            const cJSON *type = cJSON_GetObjectItemCaseSensitive(part, "type");
            const cJSON *text = cJSON_GetObjectItemCaseSensitive(part, "text");
            if (!cJSON_IsObject(part) || !cJSON_IsString(type)) return BAD("messages", "content parts must be objects with a 'type'");
            if (strcmp(type->valuestring, "text") != 0)
                return BAD("messages", "content part type '%.64s' is not supported (text only)", type->valuestring);
            if (!cJSON_IsString(text)) return BAD("messages", "a text content part needs a string 'text'");
            total += strlen(text->valuestring);
        }
        char *s = malloc(total);
        if (!s) return kvs_api_error_set(err, 500, "server_error", NULL, NULL, "out of memory");
        size_t off = 0;
        cJSON_ArrayForEach(part, c)
        {
            const char *t = cJSON_GetObjectItemCaseSensitive(part, "text")->valuestring;
            size_t n = strlen(t);
            memcpy(s + off, t, n);
            off += n;
        }
        s[off] = 0;
        *out = s;
        return 0;
    } else {
        return BAD("messages", "message content must be a string or an array of text parts");
    }
    if (!*out) return kvs_api_error_set(err, 500, "server_error", NULL, NULL, "out of memory");
    return 0;
}

/* The OpenAI schema's tool fields of a message. A tool message must name the call it answers
 * (tool_call_id, a string); the chat templates print no id, so it is checked and not rendered.
 * tool_calls / function_call (an assistant's earlier calls) are refused like the request's
 * tools: this server does not call tools, and rendering the turn without them would show the
 * model a conversation other than the client's. Their empty values are accepted. */
static int check_tool_fields(const cJSON *msg, const char *role, int i, struct kvs_api_error *err)
{
    const cJSON *id = cJSON_GetObjectItemCaseSensitive(msg, "tool_call_id");
    if (!strcmp(role, "tool")) {
        if (!id) return BAD("messages", "messages[%d]: a tool message needs 'tool_call_id'", i);
        if (!cJSON_IsString(id)) return BAD("messages", "messages[%d].tool_call_id must be a string", i);
    } else if (id && !cJSON_IsNull(id)) {
        return BAD("messages", "messages[%d].tool_call_id is only for role 'tool' (role is '%.64s')", i, role);
    }
    static const char *const calls[] = {"tool_calls", "function_call"};
    for (size_t k = 0; k < sizeof calls / sizeof *calls; k++) {
        const cJSON *it = cJSON_GetObjectItemCaseSensitive(msg, calls[k]);
        if (!it || cJSON_IsNull(it) || (cJSON_IsArray(it) && cJSON_GetArraySize(it) == 0)) continue;
        return kvs_api_error_set(err, 400, "invalid_request_error", "unsupported_parameter", "messages",
                                 "messages[%d].%s is not supported by this server (it does not call tools)",
                                 i, calls[k]);
    }
    return 0;
}

static int parse_messages(const cJSON *root, struct kvs_api_request *r, struct kvs_api_error *err)
{
    const cJSON *m = field(root, "messages");
    if (!m) return BAD("messages", "'messages' is required");
    if (!cJSON_IsArray(m)) return BAD("messages", "'messages' must be an array");
    int n = cJSON_GetArraySize(m);
    if (n == 0) return BAD("messages", "'messages' must not be empty");
    if (n > KVS_API_MAX_MESSAGES) return BAD("messages", "at most %d messages, got %d", KVS_API_MAX_MESSAGES, n);
    r->messages = calloc((size_t)n, sizeof *r->messages);
    if (!r->messages) return kvs_api_error_set(err, 500, "server_error", NULL, NULL, "out of memory");
    r->n_messages = n;
    int i = 0;
    const cJSON *el;
    cJSON_ArrayForEach(el, m)
    {
        if (!cJSON_IsObject(el)) return BAD("messages", "each message must be an object");
        const cJSON *role = cJSON_GetObjectItemCaseSensitive(el, "role");
        if (!cJSON_IsString(role)) return BAD("messages", "each message needs a string 'role'");
        const char *rs = role->valuestring;
        if (strcmp(rs, "system") && strcmp(rs, "user") && strcmp(rs, "assistant") && strcmp(rs, "developer") &&
            strcmp(rs, "tool"))
            return BAD("messages", "unsupported message role '%.64s' (system, developer, user, assistant, tool)", rs);
        int rc = check_tool_fields(el, rs, i, err);
        if (rc) return rc;
        r->messages[i].role = dupstr(rs);
        if (!r->messages[i].role) return kvs_api_error_set(err, 500, "server_error", NULL, NULL, "out of memory");
        rc = parse_content(cJSON_GetObjectItemCaseSensitive(el, "content"), rs, &r->messages[i].content, err);
        if (rc) return rc;
        i++;
    }
    return 0;
}

static int parse_stop(const cJSON *root, struct kvs_api_request *r, struct kvs_api_error *err)
{
    const cJSON *s = field(root, "stop");
    if (!s) return 0;
    int n;
    if (cJSON_IsString(s)) n = 1;
    else if (cJSON_IsArray(s)) n = cJSON_GetArraySize(s);
    else return BAD("stop", "'stop' must be a string or an array of strings");
    if (n > KVS_API_MAX_STOP) return BAD("stop", "at most %d stop sequences, got %d", KVS_API_MAX_STOP, n);
    if (n == 0) return 0;
    r->stop = calloc((size_t)n, sizeof *r->stop);
    if (!r->stop) return kvs_api_error_set(err, 500, "server_error", NULL, NULL, "out of memory");
    const cJSON *el = cJSON_IsString(s) ? s : s->child;
    for (int i = 0; i < n; i++, el = el->next) {
        if (!cJSON_IsString(el)) return BAD("stop", "'stop' must contain strings");
        size_t len = strlen(el->valuestring);
        if (len == 0) return BAD("stop", "stop sequences must not be empty");
        if (len > KVS_API_MAX_STOP_LEN) return BAD("stop", "stop sequences are limited to %d bytes", KVS_API_MAX_STOP_LEN);
        r->stop[i] = dupstr(el->valuestring);
        if (!r->stop[i]) return kvs_api_error_set(err, 500, "server_error", NULL, NULL, "out of memory");
        r->n_stop = i + 1;
    }
    return 0;
}

static int parse_logit_bias(const cJSON *root, int vocab_size, struct kvs_api_request *r, struct kvs_api_error *err)
{
    const cJSON *b = field(root, "logit_bias");
    if (!b) return 0;
    if (!cJSON_IsObject(b)) return BAD("logit_bias", "'logit_bias' must be an object mapping token ids to biases");
    int n = cJSON_GetArraySize(b);
    if (n > KVS_API_MAX_LOGIT_BIAS) return BAD("logit_bias", "at most %d logit_bias entries", KVS_API_MAX_LOGIT_BIAS);
    if (n == 0) return 0;
    r->bias_ids = malloc(sizeof *r->bias_ids * (size_t)n);
    r->bias_values = malloc(sizeof *r->bias_values * (size_t)n);
    if (!r->bias_ids || !r->bias_values) return kvs_api_error_set(err, 500, "server_error", NULL, NULL, "out of memory");
    const cJSON *el;
    cJSON_ArrayForEach(el, b)
    {
        const char *k = el->string;
        char *end = NULL;
        errno = 0;
        long id = (k && *k >= '0' && *k <= '9') ? strtol(k, &end, 10) : -1;
        if (id < 0 || errno || !end || *end || id > INT32_MAX || (vocab_size > 0 && id >= vocab_size))
            return BAD("logit_bias", "logit_bias key '%.32s' is not a token id in [0, %d)", k ? k : "", vocab_size);
        if (!cJSON_IsNumber(el) || !isfinite(el->valuedouble) || el->valuedouble < -100 || el->valuedouble > 100)
            return BAD("logit_bias", "logit_bias values must be numbers in [-100, 100]");
        r->bias_ids[r->n_bias] = (int32_t)id;
        r->bias_values[r->n_bias] = (float)el->valuedouble;
        r->n_bias++;
    }
    return 0;
}

static int parse_documents(const cJSON *root, struct kvs_api_request *r, struct kvs_api_error *err)
{
    const cJSON *d = field(root, "documents");
    if (!d) return 0;
    if (!cJSON_IsArray(d)) return BAD("documents", "'documents' must be an array of document ids");
    int n = cJSON_GetArraySize(d);
    if (n > KVS_API_MAX_DOCS) return BAD("documents", "at most %d documents per request", KVS_API_MAX_DOCS);
    if (n == 0) return 0;
    r->documents = calloc((size_t)n, sizeof *r->documents);
    if (!r->documents) return kvs_api_error_set(err, 500, "server_error", NULL, NULL, "out of memory");
    const cJSON *el;
    cJSON_ArrayForEach(el, d)
    {
        if (!cJSON_IsString(el) || !kvs_api_valid_doc_id(el->valuestring))
            return BAD("documents", "'documents' must contain document ids ([A-Za-z0-9_.-], at most %d bytes)",
                       KVS_API_MAX_ID_LEN);
        r->documents[r->n_documents] = dupstr(el->valuestring);
        if (!r->documents[r->n_documents]) return kvs_api_error_set(err, 500, "server_error", NULL, NULL, "out of memory");
        r->n_documents++;
    }
    return 0;
}

/* Fields of the OpenAI API this server does not implement: refused by name rather than ignored,
 * so a client never believes a JSON mode or a tool call was honoured. Their neutral values
 * (no tools, tool_choice "none", response_format text, an empty suffix) are accepted. */
static int refuse_unsupported(const cJSON *root, struct kvs_api_error *err)
{
    static const char *const names[] = {"tools", "tool_choice", "response_format", "suffix", "functions",
                                        "function_call"};
    for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
        const cJSON *it = field(root, names[i]);
        if (!it) continue;
        if (cJSON_IsArray(it) && cJSON_GetArraySize(it) == 0) continue;
        if (cJSON_IsString(it) && (!strcmp(it->valuestring, "") || !strcmp(it->valuestring, "none"))) continue;
        const cJSON *type = cJSON_IsObject(it) ? cJSON_GetObjectItemCaseSensitive(it, "type") : NULL;
        if (!strcmp(names[i], "response_format") && cJSON_IsString(type) && !strcmp(type->valuestring, "text") &&
            cJSON_GetArraySize(it) == 1)
            continue;
        return kvs_api_error_set(err, 400, "invalid_request_error", "unsupported_parameter", names[i],
                                 "'%s' is not supported by this server", names[i]);
    }
    return 0;
}

static int parse_generation(const cJSON *root, int vocab_size, struct kvs_api_request *r, struct kvs_api_error *err)
{
    int rc;
    if ((rc = refuse_unsupported(root, err))) return rc;
    if ((rc = get_string(root, "model", &r->model, err))) return rc;
    int mt = -1, mct = -1;
    if ((rc = get_int(root, "max_tokens", 0, INT32_MAX, &mt, err))) return rc;
    if ((rc = get_int(root, "max_completion_tokens", 1, INT32_MAX, &mct, err))) return rc;
    r->max_tokens = mct > 0 ? mct : mt;
    if ((rc = get_int(root, "n", 1, KVS_API_MAX_N, &r->n, err))) return rc;
    r->best_of = 0;
    if ((rc = get_int(root, "best_of", 1, KVS_API_MAX_N, &r->best_of, err))) return rc;
    if ((rc = get_bool(root, "stream", &r->stream, err))) return rc;
    const cJSON *so = field(root, "stream_options");
    if (so) {
        if (!cJSON_IsObject(so)) return BAD("stream_options", "'stream_options' must be an object");
        const cJSON *iu = field(so, "include_usage");
        if (iu && !cJSON_IsBool(iu)) return BAD("stream_options.include_usage", "'include_usage' must be a boolean");
        r->include_usage = iu && cJSON_IsTrue(iu);
    }
    if ((rc = get_number(root, "temperature", 0, 2, &r->temperature, err))) return rc;
    if ((rc = get_number(root, "top_p", 1e-9, 1, &r->top_p, err))) return rc;
    if ((rc = get_int(root, "top_k", -1, 1 << 20, &r->top_k, err))) return rc;
    if (r->top_k < 0) r->top_k = 0;
    if ((rc = get_number(root, "min_p", 0, 1, &r->min_p, err))) return rc;
    if ((rc = get_number(root, "presence_penalty", -2, 2, &r->presence_penalty, err))) return rc;
    if ((rc = get_number(root, "frequency_penalty", -2, 2, &r->frequency_penalty, err))) return rc;
    if ((rc = get_number(root, "repetition_penalty", 1e-6, 10, &r->repetition_penalty, err))) return rc;
    const cJSON *seed = field(root, "seed");
    if (seed) {
        int64_t v;
        if (!cJSON_IsNumber(seed) || seed->valuedouble != floor(seed->valuedouble))
            return BAD("seed", "'seed' must be an integer");
        /* JSON numbers arrive as doubles: integers beyond 2^53 cannot be told apart */
        if (json_int(seed, -((int64_t)1 << 53), (int64_t)1 << 53, &v))
            return BAD("seed", "'seed' must be between -2^53 and 2^53 (-9007199254740992 .. 9007199254740992), "
                               "the integers a JSON number holds exactly");
        r->has_seed = 1;
        r->seed = (uint64_t)v;
    }
    if ((rc = parse_stop(root, r, err))) return rc;
    if ((rc = parse_logit_bias(root, vocab_size, r, err))) return rc;
    if ((rc = parse_documents(root, r, err))) return rc;
    if ((rc = get_string(root, "user", &r->user, err))) return rc;
    if ((rc = get_bool(root, "ignore_eos", &r->ignore_eos, err))) return rc;
    if ((rc = get_bool(root, "skip_special_tokens", &r->skip_special_tokens, err))) return rc;
    if ((rc = get_bool(root, "add_special_tokens", &r->add_special_tokens, err))) return rc;
    if ((rc = get_bool(root, "return_tokens_as_token_ids", &r->tokens_as_ids, err))) return rc;

    const cJSON *lp = field(root, "logprobs");
    if (r->kind == KVS_API_COMPLETIONS) {
        if (lp) {
            int64_t v;
            if (json_int(lp, 0, KVS_API_MAX_LOGPROBS, &v))
                return BAD("logprobs", "'logprobs' must be an integer in [0, %d]", KVS_API_MAX_LOGPROBS);
            r->logprobs = 1;
            r->top_logprobs = (int)v;
        }
        if ((rc = get_bool(root, "echo", &r->echo, err))) return rc;
        if (r->echo && r->n_documents)
            return BAD("echo", "'echo' cannot be combined with 'documents' (the echoed prompt would leave them out)");
        if ((rc = parse_prompt(root, vocab_size, r, err))) return rc;
    } else {
        if ((rc = get_bool(root, "logprobs", &r->logprobs, err))) return rc;
        if ((rc = get_int(root, "top_logprobs", 0, KVS_API_MAX_LOGPROBS, &r->top_logprobs, err))) return rc;
        if (r->top_logprobs > 0 && !r->logprobs) return BAD("top_logprobs", "'top_logprobs' requires 'logprobs': true");
        if ((rc = parse_messages(root, r, err))) return rc;
    }
    if (r->best_of == 0) r->best_of = r->n;
    if (r->best_of < r->n) return BAD("best_of", "'best_of' must be at least 'n' (%d)", r->n);
    if (r->best_of > r->n && r->stream) return BAD("best_of", "'best_of' > 'n' cannot be streamed");
    if (r->best_of > r->n && r->kind == KVS_API_CHAT) return BAD("best_of", "'best_of' applies to completions only");
    if (r->n_prompts * r->best_of > KVS_API_MAX_CHOICES)
        return BAD(r->best_of > r->n ? "best_of" : "n", "prompts x %s is limited to %d choices",
                   r->best_of > r->n ? "best_of" : "n", KVS_API_MAX_CHOICES);
    if (r->max_tokens == 0 && !r->echo)
        return BAD("max_tokens", "'max_tokens' must be at least 1 (0 only with 'echo': true: score the prompt)");
    if (!r->stream && field(root, "stream_options")) return BAD("stream_options", "'stream_options' requires 'stream': true");
    return 0;
}

static int parse_tokenize(const cJSON *root, int vocab_size, struct kvs_api_request *r, struct kvs_api_error *err)
{
    int rc;
    if ((rc = get_string(root, "model", &r->model, err))) return rc;
    int has_prompt = field(root, "prompt") != NULL, has_msgs = field(root, "messages") != NULL;
    if (has_prompt == has_msgs) return BAD("prompt", "give exactly one of 'prompt' and 'messages'");
    if (has_msgs) {
        r->kind = KVS_API_CHAT;
        r->add_special_tokens = 0;
        if ((rc = parse_messages(root, r, err))) return rc;
        r->kind = KVS_API_TOKENIZE;
    } else {
        const cJSON *p = field(root, "prompt");
        if (!cJSON_IsString(p)) return BAD("prompt", "'prompt' must be a string");
        r->prompts = calloc(1, sizeof *r->prompts);
        if (!r->prompts) return kvs_api_error_set(err, 500, "server_error", NULL, NULL, "out of memory");
        r->n_prompts = 1;
        r->prompts[0].text = dupstr(p->valuestring);
        if (!r->prompts[0].text) return kvs_api_error_set(err, 500, "server_error", NULL, NULL, "out of memory");
    }
    (void)vocab_size;
    if ((rc = get_bool(root, "add_generation_prompt", &r->add_generation_prompt, err))) return rc;
    if (!has_msgs && field(root, "add_generation_prompt"))
        return BAD("add_generation_prompt", "'add_generation_prompt' applies to 'messages' only");
    return get_bool(root, "add_special_tokens", &r->add_special_tokens, err);
}

static int parse_token_field(const cJSON *root, const char *name, int vocab_size, int required,
                             struct kvs_api_request *r, struct kvs_api_error *err)
{
    const cJSON *t = field(root, name);
    if (!t) return required ? BAD(name, "'%s' is required", name) : 0;
    if (!cJSON_IsArray(t)) return BAD(name, "'%s' must be an array of token ids", name);
    return parse_ids(t, name, vocab_size, 1, &r->tokens, &r->n_tokens, err);
}

/* cJSON would silently cut a string at an escaped NUL: find "\u0000" preceded by an even number
 * of backslashes (an odd count means the backslash itself is escaped). */
static int has_escaped_nul(const char *body, size_t len)
{
    for (size_t i = 0; i + 6 <= len; i++) {
        if (body[i] != '\\' || body[i + 1] != 'u' || memcmp(body + i + 2, "0000", 4) != 0) continue;
        size_t k = i, n = 0;
        while (k > 0 && body[k - 1] == '\\') {
            k--;
            n++;
        }
        if (n % 2 == 0) return 1;
    }
    return 0;
}

int kvs_api_parse(enum kvs_api_kind kind, const char *body, size_t len, int vocab_size,
                  struct kvs_api_request *out, struct kvs_api_error *err)
{
    memset(out, 0, sizeof *out);
    memset(err, 0, sizeof *err);
    out->kind = kind;
    out->n = 1;
    out->temperature = 1.0f;
    out->top_p = 1.0f;
    out->repetition_penalty = 1.0f;
    out->max_tokens = -1;
    out->skip_special_tokens = 1;
    out->add_special_tokens = 1;
    out->add_generation_prompt = 1;
    if (!body || len == 0) return BAD(NULL, "request body is empty (expected a JSON object)");
    char why[200];
    if (kvs_json_check_bytes(body, len, why, sizeof why)) return BAD(NULL, "%s", why);
    if (has_escaped_nul(body, len)) return BAD(NULL, "strings must not contain NUL characters (\\u0000)");
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(body, len, &end, 0);
    if (!root) return BAD(NULL, "request body is not valid JSON");
    kvs_json_dedupe_keys(root);   /* the last of duplicate keys wins, as in JavaScript and Python */
    /* cJSON stops after the first value: anything but whitespace after it is malformed */
    for (const char *p = end; p && p < body + len; p++)
        if (*p != ' ' && *p != '\t' && *p != '\n' && *p != '\r') {
            cJSON_Delete(root);
            return BAD(NULL, "request body is not valid JSON (data after the object)");
        }
    int rc;
    if (!cJSON_IsObject(root)) {
        rc = BAD(NULL, "request body must be a JSON object");
    } else {
        switch (kind) {
        case KVS_API_COMPLETIONS:
        case KVS_API_CHAT: rc = parse_generation(root, vocab_size, out, err); break;
        case KVS_API_TOKENIZE: rc = parse_tokenize(root, vocab_size, out, err); break;
        case KVS_API_DETOKENIZE: rc = parse_token_field(root, "tokens", vocab_size, 1, out, err); break;
        case KVS_API_DOC_CREATE: {
            int has_text = field(root, "text") != NULL, has_tokens = field(root, "tokens") != NULL;
            if (has_text == has_tokens) {
                rc = BAD("text", "give exactly one of 'text' and 'tokens'");
                break;
            }
            rc = get_string(root, "text", &out->text, err);
            if (!rc) rc = parse_token_field(root, "tokens", vocab_size, 0, out, err);
            if (!rc && has_tokens && out->n_tokens == 0) rc = BAD("tokens", "'tokens' must not be empty");
            if (!rc && out->text && !out->text[0]) rc = BAD("text", "'text' must not be empty");
            if (!rc) rc = get_string(root, "id", &out->doc_id, err);
            if (!rc && out->doc_id && !kvs_api_valid_doc_id(out->doc_id))
                rc = BAD("id", "'id' must be 1-%d characters of [A-Za-z0-9_.-]", KVS_API_MAX_ID_LEN);
            break;
        }
        default: rc = BAD(NULL, "unknown endpoint");
        }
    }
    cJSON_Delete(root);
    return rc;
}

void kvs_api_request_free(struct kvs_api_request *r)
{
    if (!r) return;
    free(r->model);
    for (int i = 0; i < r->n_prompts && r->prompts; i++) {
        free(r->prompts[i].text);
        free(r->prompts[i].ids);
    }
    free(r->prompts);
    for (int i = 0; i < r->n_messages && r->messages; i++) {
        free(r->messages[i].role);
        free(r->messages[i].content);
    }
    free(r->messages);
    for (int i = 0; i < r->n_stop; i++) free(r->stop[i]);
    free(r->stop);
    free(r->bias_ids);
    free(r->bias_values);
    free(r->user);
    for (int i = 0; i < r->n_documents; i++) free(r->documents[i]);
    free(r->documents);
    free(r->tokens);
    free(r->text);
    free(r->doc_id);
    memset(r, 0, sizeof *r);
}
