/* chat.c: ChatML / Qwen3 / Llama-3 prompt rendering and chat-template detection (see chat.h). */
#include "engine/text/chat.h"

#include <cjson/cJSON.h>
#include <stdint.h>
#include <string.h>

#include "base/util.h"
#include "models/gguf.h"

/* ---------------------------------------------------------------- growable output buffer */

struct sbuf {
    char *p;
    size_t len, cap;
    int oom;
};

static void sb_add(struct sbuf *b, const char *s, size_t n)
{
    if (b->oom) return;
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n + 1) {
            if (cap > SIZE_MAX / 2) {
                b->oom = 1;
                return;
            }
            cap *= 2;
        }
        /* sizes come from client content: plain realloc, so OOM is an error and not an abort */
        char *q = realloc(b->p, cap);
        if (!q) {
            b->oom = 1;
            return;
        }
        b->p = q;
        b->cap = cap;
    }
    if (n) memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = 0;
}

static void sb_str(struct sbuf *b, const char *s) { sb_add(b, s, strlen(s)); }

/* ---------------------------------------------------------------- Python string helpers */

/* Python's str.isspace() set (checked against CPython: U+0009-000D, 001C-001F, 0020, 0085,
 * 00A0, 1680, 2000-200A, 2028, 2029, 202F, 205F, 3000). */
static int py_isspace(uint32_t c)
{
    return (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 ||
           c == 0x1680 || (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f ||
           c == 0x205f || c == 0x3000;
}

/* Decodes one well-formed UTF-8 sequence at s (n bytes available); returns its length or 0. */
static size_t utf8_decode(const unsigned char *s, size_t n, uint32_t *cp)
{
    if (n == 0) return 0;
    unsigned c = s[0];
    size_t len;
    uint32_t v, min;
    if (c < 0x80) {
        *cp = c;
        return 1;
    } else if ((c & 0xe0) == 0xc0) {
        len = 2, v = c & 0x1f, min = 0x80;
    } else if ((c & 0xf0) == 0xe0) {
        len = 3, v = c & 0x0f, min = 0x800;
    } else if ((c & 0xf8) == 0xf0) {
        len = 4, v = c & 0x07, min = 0x10000;
    } else {
        return 0;
    }
    if (n < len) return 0;
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xc0) != 0x80) return 0;
        v = (v << 6) | (s[i] & 0x3f);
    }
    if (v < min || v > 0x10ffff || (v >= 0xd800 && v <= 0xdfff)) return 0;
    *cp = v;
    return len;
}

/* Bytes of leading Python whitespace in s[0..n). */
static size_t py_lspace(const char *s, size_t n)
{
    size_t i = 0;
    while (i < n) {
        uint32_t cp;
        size_t k = utf8_decode((const unsigned char *)s + i, n - i, &cp);
        if (!k || !py_isspace(cp)) break;
        i += k;
    }
    return i;
}

/* Bytes of trailing Python whitespace in s[from..n) (never reaching below from). */
static size_t py_rspace(const char *s, size_t from, size_t n)
{
    size_t end = n;
    while (end > from) {
        size_t start = end - 1;
        /* back over continuation bytes to the lead byte (at most 3) */
        while (start > from && end - start < 4 && ((unsigned char)s[start] & 0xc0) == 0x80) start--;
        uint32_t cp;
        size_t k = utf8_decode((const unsigned char *)s + start, end - start, &cp);
        if (k != end - start || !py_isspace(cp)) break;
        end = start;
    }
    return n - end;
}

/* A byte range of some string. */
struct slice {
    const char *p;
    size_t n;
};

static struct slice lstrip_nl(struct slice s)
{
    while (s.n && s.p[0] == '\n') s.p++, s.n--;
    return s;
}

static struct slice rstrip_nl(struct slice s)
{
    while (s.n && s.p[s.n - 1] == '\n') s.n--;
    return s;
}

static const char *memfind(const char *h, size_t hn, const char *needle)
{
    size_t nn = strlen(needle);
    if (nn > hn) return NULL;
    for (size_t i = 0; i + nn <= hn; i++)
        if (h[i] == needle[0] && memcmp(h + i, needle, nn) == 0) return h + i;
    return NULL;
}

static const char *memfind_last(const char *h, size_t hn, const char *needle)
{
    size_t nn = strlen(needle);
    if (nn > hn) return NULL;
    for (size_t i = hn - nn + 1; i-- > 0;)
        if (h[i] == needle[0] && memcmp(h + i, needle, nn) == 0) return h + i;
    return NULL;
}

static int starts_with(struct slice s, const char *pre)
{
    size_t n = strlen(pre);
    return s.n >= n && memcmp(s.p, pre, n) == 0;
}

static int ends_with(struct slice s, const char *suf)
{
    size_t n = strlen(suf);
    return s.n >= n && memcmp(s.p + s.n - n, suf, n) == 0;
}

/* ---------------------------------------------------------------- names and detection */

enum kvs_chat_format kvs_chat_format_from_name(const char *name)
{
    if (!name) return KVS_CHAT_UNKNOWN;
    if (strcmp(name, "chatml") == 0) return KVS_CHAT_CHATML;
    if (strcmp(name, "qwen3") == 0) return KVS_CHAT_QWEN3;
    if (strcmp(name, "llama3") == 0) return KVS_CHAT_LLAMA3;
    if (strcmp(name, "smollm") == 0) return KVS_CHAT_SMOLLM;
    return KVS_CHAT_UNKNOWN;
}

const char *kvs_chat_format_name(enum kvs_chat_format f)
{
    switch (f) {
    case KVS_CHAT_CHATML: return "chatml";
    case KVS_CHAT_QWEN3: return "qwen3";
    case KVS_CHAT_LLAMA3: return "llama3";
    case KVS_CHAT_SMOLLM: return "smollm";
    case KVS_CHAT_UNKNOWN: break;
    }
    return "unknown";
}

int kvs_chat_has_bos(enum kvs_chat_format f) { return f == KVS_CHAT_LLAMA3; }

enum kvs_chat_format kvs_chat_detect_template(const char *t)
{
    if (!t) return KVS_CHAT_UNKNOWN;
    if (strstr(t, "<|im_start|>")) {
        if (strstr(t, SMOLLM_SYSTEM) && !strstr(t, "</think>")) return KVS_CHAT_SMOLLM;
        if (strstr(t, "You are Qwen") || strstr(t, "You are a helpful assistant"))
            kvs_log(KVS_LOG_WARN, "chat template: ChatML with a default system prompt; kvserve renders "
                                  "no default system prompt (send one explicitly)");
        return strstr(t, "</think>") ? KVS_CHAT_QWEN3 : KVS_CHAT_CHATML;
    }
    if (strstr(t, "<|start_header_id|>")) {
        if (strstr(t, "Cutting Knowledge Date"))
            kvs_log(KVS_LOG_WARN, "chat template: Llama-3.1-style date preamble is not rendered; "
                                  "kvserve uses the Llama-3 header format");
        return KVS_CHAT_LLAMA3;
    }
    return KVS_CHAT_UNKNOWN;
}

/* Returns the template text from a tokenizer_config.json document (malloc'ed) or NULL. */
static char *template_from_config(const char *json, const char *path)
{
    cJSON *root = cJSON_Parse(json);
    if (!root) {
        kvs_log(KVS_LOG_WARN, "%s: not valid JSON; chat format unknown", path);
        return NULL;
    }
    char *out = NULL;
    const cJSON *ct = cJSON_GetObjectItemCaseSensitive(root, "chat_template");
    if (cJSON_IsString(ct) && ct->valuestring) {
        out = kvs_xstrdup(ct->valuestring);
    } else if (cJSON_IsArray(ct)) {
        const cJSON *it;
        cJSON_ArrayForEach(it, ct)
        {
            const cJSON *name = cJSON_GetObjectItemCaseSensitive(it, "name");
            const cJSON *tmpl = cJSON_GetObjectItemCaseSensitive(it, "template");
            if (cJSON_IsString(name) && cJSON_IsString(tmpl) && strcmp(name->valuestring, "default") == 0) {
                out = kvs_xstrdup(tmpl->valuestring);
                break;
            }
        }
        if (!out) kvs_log(KVS_LOG_WARN, "%s: chat_template list has no \"default\" entry", path);
    } else if (ct) {
        kvs_log(KVS_LOG_WARN, "%s: chat_template is neither a string nor a list", path);
    }
    cJSON_Delete(root);
    return out;
}

/* The template text of a GGUF file (tokenizer.chat_template), malloc'ed, or NULL (logged). */
static char *template_from_gguf(const char *path)
{
    struct kvs_gguf *g;
    char err[512];
    if (kvs_gguf_open(path, &g, err, sizeof err)) {
        kvs_log(KVS_LOG_WARN, "chat format unknown: %s", err);
        return NULL;
    }
    struct kvs_gguf_str t;
    char *out = NULL;
    if (kvs_gguf_get_str(g, "tokenizer.chat_template", 1, &t, err, sizeof err) == 0 && !memchr(t.p, 0, t.len)) {
        out = kvs_xmalloc(t.len + 1);
        memcpy(out, t.p, t.len);
        out[t.len] = 0;
    } else {
        kvs_log(KVS_LOG_WARN, "%s: no usable tokenizer.chat_template; chat format unknown", path);
    }
    kvs_gguf_close(g);
    return out;
}

enum kvs_chat_format kvs_chat_detect(const char *model_dir)
{
    if (!model_dir) return KVS_CHAT_UNKNOWN;
    char path[4096], err[512];
    char *tmpl = NULL;
    int gguf = kvs_gguf_find(model_dir, path, sizeof path, err, sizeof err);
    if (gguf < 0) {
        kvs_log(KVS_LOG_WARN, "chat format unknown: %s", err);
        return KVS_CHAT_UNKNOWN;
    }
    if (gguf) {
        tmpl = template_from_gguf(path);
        if (!tmpl) return KVS_CHAT_UNKNOWN;
        enum kvs_chat_format f = kvs_chat_detect_template(tmpl);
        if (f == KVS_CHAT_UNKNOWN) kvs_log(KVS_LOG_WARN, "%s: chat template not recognized (no ChatML or Llama-3 markers)", path);
        free(tmpl);
        return f;
    }
    int n = snprintf(path, sizeof path, "%s/chat_template.jinja", model_dir);
    if (n > 0 && (size_t)n < sizeof path) tmpl = kvs_read_file(path, NULL, err, sizeof err);
    if (!tmpl) {
        n = snprintf(path, sizeof path, "%s/tokenizer_config.json", model_dir);
        if (n <= 0 || (size_t)n >= sizeof path) {
            kvs_log(KVS_LOG_WARN, "chat format: model path too long");
            return KVS_CHAT_UNKNOWN;
        }
        char *json = kvs_read_file(path, NULL, err, sizeof err);
        if (!json) {
            kvs_log(KVS_LOG_WARN, "chat format unknown: %s", err);
            return KVS_CHAT_UNKNOWN;
        }
        tmpl = template_from_config(json, path);
        free(json);
        if (!tmpl) {
            kvs_log(KVS_LOG_WARN, "%s: no chat_template; chat format unknown", path);
            return KVS_CHAT_UNKNOWN;
        }
    }
    enum kvs_chat_format f = kvs_chat_detect_template(tmpl);
    if (f == KVS_CHAT_UNKNOWN) kvs_log(KVS_LOG_WARN, "%s: chat template not recognized (no ChatML or Llama-3 markers)", path);
    free(tmpl);
    return f;
}

/* ---------------------------------------------------------------- rendering */

enum role { R_SYSTEM, R_USER, R_ASSISTANT, R_DEVELOPER, R_TOOL };
static const char *role_names[] = {"system", "user", "assistant", "developer", "tool"};

struct msg {
    enum role role;
    struct slice content;
};

static void render_chatml(struct sbuf *b, const struct msg *m, int n)
{
    for (int i = 0; i < n; i++) {
        sb_str(b, "<|im_start|>");
        sb_str(b, role_names[m[i].role]);
        sb_str(b, "\n");
        sb_add(b, m[i].content.p, m[i].content.n);
        sb_str(b, "<|im_end|>\n");
    }
    sb_str(b, "<|im_start|>assistant\n");
}

/* SmolLM2-Instruct: ChatML, with a default system turn when the conversation opens without one. */
static void render_smollm(struct sbuf *b, const struct msg *m, int n)
{
    if (n > 0 && m[0].role != R_SYSTEM) {
        sb_str(b, "<|im_start|>system\n");
        sb_str(b, SMOLLM_SYSTEM);
        sb_str(b, "<|im_end|>\n");
    }
    render_chatml(b, m, n);
}

static void render_qwen3(struct sbuf *b, const struct msg *m, int n)
{
    /* the last user turn that is a real query (not a tool response): assistant turns after it
     * belong to the current, still reasoning, exchange */
    int last_query = n - 1;
    for (int i = n - 1; i >= 0; i--) {
        if (m[i].role == R_USER &&
            !(starts_with(m[i].content, "<tool_response>") && ends_with(m[i].content, "</tool_response>"))) {
            last_query = i;
            break;
        }
    }
    for (int i = 0; i < n; i++) {
        if (m[i].role == R_TOOL) {
            /* Qwen3's template: a run of tool results is one user turn of <tool_response> blocks */
            if (i == 0 || m[i - 1].role != R_TOOL) sb_str(b, "<|im_start|>user");
            sb_str(b, "\n<tool_response>\n");
            sb_add(b, m[i].content.p, m[i].content.n);
            sb_str(b, "\n</tool_response>");
            if (i == n - 1 || m[i + 1].role != R_TOOL) sb_str(b, "<|im_end|>\n");
            continue;
        }
        if (m[i].role != R_ASSISTANT) {
            sb_str(b, "<|im_start|>");
            sb_str(b, role_names[m[i].role]);
            sb_str(b, "\n");
            sb_add(b, m[i].content.p, m[i].content.n);
            sb_str(b, "<|im_end|>\n");
            continue;
        }
        struct slice content = m[i].content, reasoning = {"", 0};
        const char *first_close = memfind(content.p, content.n, "</think>");
        if (first_close) {
            const char *last_close = memfind_last(content.p, content.n, "</think>");
            struct slice after = {last_close + 8, (size_t)(content.p + content.n - (last_close + 8))};
            struct slice before = rstrip_nl((struct slice){content.p, (size_t)(first_close - content.p)});
            const char *open = memfind_last(before.p, before.n, "<think>");
            if (open) before = (struct slice){open + 7, (size_t)(before.p + before.n - (open + 7))};
            reasoning = lstrip_nl(before);
            content = lstrip_nl(after);
        }
        sb_str(b, "<|im_start|>assistant\n");
        if (i > last_query && (i == n - 1 || reasoning.n)) {
            struct slice r = rstrip_nl(lstrip_nl(reasoning));
            sb_str(b, "<think>\n");
            sb_add(b, r.p, r.n);
            sb_str(b, "\n</think>\n\n");
            content = lstrip_nl(content);
        }
        sb_add(b, content.p, content.n);
        sb_str(b, "<|im_end|>\n");
    }
    sb_str(b, "<|im_start|>assistant\n");
}

/* Llama-3 strips each content (Python str.strip); *sys_base and *sys_lskip say where message 0's
 * content starts in the output and how many bytes the strip cut from its front (document spans). */
static void render_llama3(struct sbuf *b, const struct msg *m, int n, size_t *sys_base, size_t *sys_lskip)
{
    sb_str(b, "<|begin_of_text|>");
    for (int i = 0; i < n; i++) {
        sb_str(b, "<|start_header_id|>");
        sb_str(b, role_names[m[i].role]);
        sb_str(b, "<|end_header_id|>\n\n");
        size_t l = py_lspace(m[i].content.p, m[i].content.n);
        size_t r = py_rspace(m[i].content.p, l, m[i].content.n);
        if (i == 0) {
            *sys_base = b->len;
            *sys_lskip = l;
        }
        sb_add(b, m[i].content.p + l, m[i].content.n - l - r);
        sb_str(b, "<|eot_id|>");
    }
    sb_str(b, "<|start_header_id|>assistant<|end_header_id|>\n\n");
}

const char *kvs_chat_generation_prompt(enum kvs_chat_format f)
{
    switch (f) {
    case KVS_CHAT_CHATML:
    case KVS_CHAT_SMOLLM:
    case KVS_CHAT_QWEN3: return "<|im_start|>assistant\n";
    case KVS_CHAT_LLAMA3: return "<|start_header_id|>assistant<|end_header_id|>\n\n";
    default: return "";
    }
}

/* Start of message 0's content in the ChatML-family output (for document spans). */
static size_t chatml_sys_base(void) { return strlen("<|im_start|>system\n"); }

/* developer is kept where the format's template renders the role name as given (transformers
 * renders "developer" there) and becomes system for QWEN3, whose template drops the message */
static int parse_role(enum kvs_chat_format f, const char *r, enum role *out)
{
    if (strcmp(r, "system") == 0) *out = R_SYSTEM;
    else if (strcmp(r, "developer") == 0) *out = f == KVS_CHAT_QWEN3 ? R_SYSTEM : R_DEVELOPER;
    else if (strcmp(r, "user") == 0) *out = R_USER;
    else if (strcmp(r, "assistant") == 0) *out = R_ASSISTANT;
    else if (strcmp(r, "tool") == 0) *out = R_TOOL;
    else return -EINVAL;
    return 0;
}

char *kvs_chat_render_spans(enum kvs_chat_format f, const struct kvs_chat_message *msgs, int n_msgs,
                            const char *const *documents, int n_docs, struct kvs_chat_span *doc_spans,
                            char *err, size_t errlen)
{
    if (f != KVS_CHAT_CHATML && f != KVS_CHAT_QWEN3 && f != KVS_CHAT_LLAMA3 && f != KVS_CHAT_SMOLLM) {
        kvs_err(err, errlen, -EINVAL, "chat format %d is not supported (set model.chat_format)", (int)f);
        return NULL;
    }
    if (!msgs || n_msgs <= 0) {
        kvs_err(err, errlen, -EINVAL, "messages must be a non-empty list");
        return NULL;
    }
    if (n_docs < 0 || (n_docs > 0 && !documents)) {
        kvs_err(err, errlen, -EINVAL, "invalid document list");
        return NULL;
    }
    for (int d = 0; d < n_docs; d++) {
        if (!documents[d]) {
            kvs_err(err, errlen, -EINVAL, "document %d has no text", d);
            return NULL;
        }
    }
    int insert_sys = 0;
    struct msg *m = malloc(((size_t)n_msgs + 1) * sizeof *m);
    if (!m) {
        kvs_err(err, errlen, -ENOMEM, "out of memory rendering %d messages", n_msgs);
        return NULL;
    }
    for (int i = 0; i < n_msgs; i++) {
        if (!msgs[i].role) {
            kvs_err(err, errlen, -EINVAL, "messages[%d].role is missing", i);
            free(m);
            return NULL;
        }
        enum role r;
        if (parse_role(f, msgs[i].role, &r) != 0) {
            kvs_err(err, errlen, -EINVAL,
                    "messages[%d].role '%.64s' is not supported (system, developer, user, assistant, tool)", i,
                    msgs[i].role);
            free(m);
            return NULL;
        }
        if (!msgs[i].content && r != R_ASSISTANT) {
            kvs_err(err, errlen, -EINVAL, "messages[%d].content is missing", i);
            free(m);
            return NULL;
        }
        if (i == 0 && n_docs > 0 && r != R_SYSTEM) insert_sys = 1;
        const char *c = msgs[i].content ? msgs[i].content : "";
        m[i + insert_sys] = (struct msg){r, {c, strlen(c)}};
    }
    int n = n_msgs + insert_sys;

    /* the system turn with the documents in front, and where each document sits inside it */
    struct sbuf sys = {0};
    size_t *doc_off = NULL;
    if (n_docs > 0) {
        doc_off = malloc((size_t)n_docs * sizeof *doc_off);
        if (!doc_off) {
            kvs_err(err, errlen, -ENOMEM, "out of memory rendering %d documents", n_docs);
            free(m);
            return NULL;
        }
        struct slice orig = insert_sys ? (struct slice){"", 0} : m[0].content;
        sb_add(&sys, "", 0);
        for (int d = 0; d < n_docs; d++) {
            if (d) sb_str(&sys, "\n\n");
            doc_off[d] = sys.len;
            sb_str(&sys, documents[d]);
        }
        if (orig.n) {
            sb_str(&sys, "\n\n");
            sb_add(&sys, orig.p, orig.n);
        }
        if (sys.oom) {
            kvs_err(err, errlen, -ENOMEM, "out of memory rendering documents");
            free(sys.p), free(doc_off), free(m);
            return NULL;
        }
        m[0] = (struct msg){R_SYSTEM, {sys.p, sys.len}};
    }

    struct sbuf out = {0};
    size_t base = 0, lskip = 0;
    switch (f) {
    case KVS_CHAT_CHATML:
        render_chatml(&out, m, n);
        base = chatml_sys_base();
        break;
    case KVS_CHAT_SMOLLM:
        render_smollm(&out, m, n);
        base = chatml_sys_base();
        break;
    case KVS_CHAT_QWEN3:
        render_qwen3(&out, m, n);
        base = chatml_sys_base();
        break;
    case KVS_CHAT_LLAMA3:
        render_llama3(&out, m, n, &base, &lskip);
        break;
    case KVS_CHAT_UNKNOWN: break;
    }
    if (doc_spans && n_docs > 0) {
        /* the visible part of the system content is [lskip, lskip + kept) of sys */
        size_t kept = sys.len - lskip - py_rspace(sys.p, lskip, sys.len);
        for (int d = 0; d < n_docs; d++) {
            size_t s = doc_off[d], e = s + strlen(documents[d]);
            /* a document stripped away entirely (whitespace at either end of the system turn)
             * gets an empty span at the edge of the visible content */
            if (s < lskip) s = lskip;
            if (s > lskip + kept) s = lskip + kept;
            if (e > lskip + kept) e = lskip + kept;
            if (e < s) e = s;
            doc_spans[d].offset = base + s - lskip;
            doc_spans[d].len = e - s;
        }
    }
    free(sys.p);
    free(doc_off);
    free(m);
    if (out.oom || !out.p) {
        free(out.p);
        kvs_err(err, errlen, -ENOMEM, "out of memory rendering the prompt");
        return NULL;
    }
    return out.p;
}

char *kvs_chat_render(enum kvs_chat_format f, const struct kvs_chat_message *msgs, int n_msgs,
                      const char *const *documents, int n_docs, char *err, size_t errlen)
{
    return kvs_chat_render_spans(f, msgs, n_msgs, documents, n_docs, NULL, err, errlen);
}
