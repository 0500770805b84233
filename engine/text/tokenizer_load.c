/* tokenizer_load.c: parses tokenizer.json (+ tokenizer_config.json, generation_config.json,
 * config.json) into struct kvs_tokenizer.
 *
 * Every field read is checked for type and range; anything we do not implement (a model other
 * than BPE, an unknown normalizer / pre-tokenizer / decoder / post-processor) is refused with
 * -ENOSYS and a message naming the field, rather than silently tokenizing differently from
 * Hugging Face. Sizes a file controls are bounded (ids < KVS_TOK_MAX_ID) so a hostile file
 * cannot ask for gigabytes.
 */
#include <cjson/cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/text/tokenizer_internal.h"
#include "base/util.h"
#include "models/gguf.h"

#define KVS_TOK_MAX_ID (1 << 23)

static const char GPT2_REGEX[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

struct ctx {
    char *err;
    size_t errlen;
};

static const cJSON *get(const cJSON *o, const char *k)
{
    return cJSON_IsObject(o) ? cJSON_GetObjectItemCaseSensitive(o, k) : NULL;
}

/* Reads an optional bool field (absent/null -> def); -EINVAL if present with another type. */
static int get_bool(struct ctx *c, const cJSON *o, const char *k, const char *where, int def, int *out)
{
    const cJSON *v = get(o, k);
    if (!v || cJSON_IsNull(v)) {
        *out = def;
        return 0;
    }
    if (!cJSON_IsBool(v)) return kvs_err(c->err, c->errlen, -EINVAL, "tokenizer.json: %s.%s: expected a boolean", where, k);
    *out = cJSON_IsTrue(v);
    return 0;
}

static int get_id(struct ctx *c, const cJSON *v, const char *where, int32_t *out)
{
    if (!cJSON_IsNumber(v) || v->valuedouble < 0 || v->valuedouble >= KVS_TOK_MAX_ID ||
        v->valuedouble != (double)(int32_t)v->valuedouble)
        return kvs_err(c->err, c->errlen, -EINVAL, "tokenizer.json: %s: expected a token id in [0, %d)", where,
                       KVS_TOK_MAX_ID);
    *out = (int32_t)v->valuedouble;
    return 0;
}

static char *dupn(const char *s, size_t n)
{
    char *d = malloc(n + 1);
    if (!d) return NULL;
    memcpy(d, s, n);
    d[n] = 0;
    return d;
}

/* The code points of Unicode White_Space, which is what \s means to Oniguruma (the regex
 * engine behind HF tokenizers). PCRE2's UCP \s differs (it also takes U+180E), so \s and \S
 * are rewritten into explicit classes. */
#define WS_CLASS "\\t\\n\\x{0b}\\f\\r \\x{85}\\x{a0}\\x{1680}\\x{2000}-\\x{200a}\\x{2028}\\x{2029}\\x{202f}\\x{205f}\\x{3000}"

static int rewrite_ws(const char *pat, size_t len, struct tk_buf *out)
{
    int in_class = 0, rc = 0;
    for (size_t i = 0; i < len && rc == 0; i++) {
        char ch = pat[i];
        if (ch == '\\' && i + 1 < len) {
            char nx = pat[++i];
            if (nx == 's') rc = tk_buf_put(out, in_class ? WS_CLASS : "[" WS_CLASS "]", strlen(in_class ? WS_CLASS : "[" WS_CLASS "]"));
            else if (nx == 'S' && !in_class) rc = tk_buf_put(out, "[^" WS_CLASS "]", strlen("[^" WS_CLASS "]"));
            else {
                char two[2] = {ch, nx};
                rc = tk_buf_put(out, two, 2);
            }
            continue;
        }
        if (!in_class && ch == '[') {
            in_class = 1;
            rc = tk_buf_put(out, &ch, 1);
            if (i + 1 < len && pat[i + 1] == '^') rc = rc ? rc : tk_buf_put(out, &pat[++i], 1);
            if (i + 1 < len && pat[i + 1] == ']') rc = rc ? rc : tk_buf_put(out, &pat[++i], 1);
            continue;
        }
        if (in_class && ch == ']') in_class = 0;
        rc = tk_buf_put(out, &ch, 1);
    }
    return rc;
}

static int compile_re(struct ctx *c, const char *pat, size_t len, int literal, const char *where, pcre2_code **out)
{
    int ec;
    PCRE2_SIZE eo;
    uint32_t opts = PCRE2_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP);
    struct tk_buf rw = {0};
    if (!literal) {
        if (rewrite_ws(pat, len, &rw) != 0) {
            free(rw.p);
            return -ENOMEM;
        }
        pat = rw.p ? rw.p : "";
        len = rw.n;
    }
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pat, len, opts, &ec, &eo, NULL);
    free(rw.p);
    if (!re) {
        PCRE2_UCHAR msg[160];
        pcre2_get_error_message(ec, msg, sizeof msg);
        return kvs_err(c->err, c->errlen, -EINVAL, "tokenizer.json: %s: regex does not compile at offset %zu: %s",
                       where, (size_t)eo, (char *)msg);
    }
    pcre2_jit_compile(re, PCRE2_JIT_COMPLETE); /* falls back to the interpreter if JIT is unavailable */
    *out = re;
    return 0;
}

/* pattern: {"String": s} or {"Regex": r} */
static int parse_pattern(struct ctx *c, const cJSON *pat, const char *where, const char **s, int *is_regex)
{
    const cJSON *v;
    if ((v = get(pat, "String")) && cJSON_IsString(v)) {
        *s = v->valuestring;
        *is_regex = 0;
        return 0;
    }
    if ((v = get(pat, "Regex")) && cJSON_IsString(v)) {
        *s = v->valuestring;
        *is_regex = 1;
        return 0;
    }
    return kvs_err(c->err, c->errlen, -EINVAL, "tokenizer.json: %s.pattern: expected {\"String\": ...} or {\"Regex\": ...}",
                   where);
}

static const char *type_of(const cJSON *o)
{
    const cJSON *t = get(o, "type");
    return cJSON_IsString(t) ? t->valuestring : NULL;
}

/* ---- normalizer ---- */

static int add_norm(struct kvs_tokenizer *t, struct tk_norm nm)
{
    struct tk_norm *p = realloc(t->norms, (size_t)(t->n_norms + 1) * sizeof *p);
    if (!p) return -ENOMEM;
    t->norms = p;
    t->norms[t->n_norms++] = nm;
    return 0;
}

static int parse_normalizer(struct ctx *c, struct kvs_tokenizer *t, const cJSON *n, const char *where, int depth)
{
    if (!n || cJSON_IsNull(n)) return 0;
    const char *ty = type_of(n);
    if (!ty) return kvs_err(c->err, c->errlen, -EINVAL, "tokenizer.json: %s.type: missing or not a string", where);
    if (depth > 8) return kvs_err(c->err, c->errlen, -EINVAL, "tokenizer.json: %s: nested too deeply", where);
    struct tk_norm nm = {0};
    if (!strcmp(ty, "Sequence")) {
        const cJSON *arr = get(n, "normalizers"), *e;
        if (!cJSON_IsArray(arr))
            return kvs_err(c->err, c->errlen, -EINVAL, "tokenizer.json: %s.normalizers: expected an array", where);
        int i = 0;
        cJSON_ArrayForEach(e, arr) {
            char w[128];
            snprintf(w, sizeof w, "%s.normalizers[%d]", where, i++);
            int rc = parse_normalizer(c, t, e, w, depth + 1);
            if (rc) return rc;
        }
        return 0;
    }
    if (!strcmp(ty, "NFC")) nm.kind = TK_NORM_NFC;
    else if (!strcmp(ty, "NFD")) nm.kind = TK_NORM_NFD;
    else if (!strcmp(ty, "NFKC")) nm.kind = TK_NORM_NFKC;
    else if (!strcmp(ty, "NFKD")) nm.kind = TK_NORM_NFKD;
    else if (!strcmp(ty, "Prepend")) {
        const cJSON *p = get(n, "prepend");
        if (!cJSON_IsString(p) || !tk_utf8_valid(p->valuestring, strlen(p->valuestring)))
            return kvs_err(c->err, c->errlen, -EINVAL, "tokenizer.json: %s.prepend: expected a string", where);
        nm.kind = TK_NORM_PREPEND;
        nm.alen = strlen(p->valuestring);
        nm.a = dupn(p->valuestring, nm.alen);
        if (!nm.a) return -ENOMEM;
    } else if (!strcmp(ty, "Replace")) {
        const char *pat;
        int is_re;
        int rc = parse_pattern(c, get(n, "pattern"), where, &pat, &is_re);
        if (rc) return rc;
        if (is_re)
            return kvs_err(c->err, c->errlen, -ENOSYS, "tokenizer.json: %s.pattern: Regex replace is not supported", where);
        const cJSON *ct = get(n, "content");
        if (!cJSON_IsString(ct))
            return kvs_err(c->err, c->errlen, -EINVAL, "tokenizer.json: %s.content: expected a string", where);
        if (!tk_utf8_valid(pat, strlen(pat)) || !tk_utf8_valid(ct->valuestring, strlen(ct->valuestring)))
            return kvs_err(c->err, c->errlen, -EINVAL, "tokenizer.json: %s: pattern/content not valid UTF-8", where);
        nm.kind = TK_NORM_REPLACE;
        nm.alen = strlen(pat);
        nm.blen = strlen(ct->valuestring);
        nm.a = dupn(pat, nm.alen);
        nm.b = dupn(ct->valuestring, nm.blen);
        if (!nm.a || !nm.b) {
            free(nm.a);
            free(nm.b);
            return -ENOMEM;
        }
    } else {
        return kvs_err(c->err, c->errlen, -ENOSYS, "tokenizer.json: %s.type: normalizer '%s' is not supported", where, ty);
    }
    int rc = add_norm(t, nm);
    if (rc) {
        free(nm.a);
        free(nm.b);
    }
    return rc;
}

/* ---- pre-tokenizer ---- */

static int add_pre(struct kvs_tokenizer *t, struct tk_pre pr)
{
    struct tk_pre *p = realloc(t->pres, (size_t)(t->n_pres + 1) * sizeof *p);
    if (!p) return -ENOMEM;
    t->pres = p;
    t->pres[t->n_pres++] = pr;
    return 0;
}

static int parse_pre(struct ctx *c, struct kvs_tokenizer *t, const cJSON *n, const char *where, int depth)
{
    if (!n || cJSON_IsNull(n)) return 0;
    const char *ty = type_of(n);
    if (!ty) return kvs_err(c->err, c->errlen, -EINVAL, "tokenizer.json: %s.type: missing or not a string", where);
    if (depth > 8) return kvs_err(c->err, c->errlen, -EINVAL, "tokenizer.json: %s: nested too deeply", where);
    if (t->n_pres > 0 && t->pres[t->n_pres - 1].kind == TK_PRE_BYTELEVEL)
        return kvs_err(c->err, c->errlen, -ENOSYS, "tokenizer.json: %s: pre-tokenizers after ByteLevel are not supported",
                       where);
    struct tk_pre pr = {0};
    int rc;
    if (!strcmp(ty, "Sequence")) {
        const cJSON *arr = get(n, "pretokenizers"), *e;
        if (!cJSON_IsArray(arr))
            return kvs_err(c->err, c->errlen, -EINVAL, "tokenizer.json: %s.pretokenizers: expected an array", where);
        int i = 0;
        cJSON_ArrayForEach(e, arr) {
            char w[128];
            snprintf(w, sizeof w, "%s.pretokenizers[%d]", where, i++);
            if ((rc = parse_pre(c, t, e, w, depth + 1))) return rc;
        }
        return 0;
    }
    if (!strcmp(ty, "Split")) {
        const char *pat;
        int is_re;
        if ((rc = parse_pattern(c, get(n, "pattern"), where, &pat, &is_re))) return rc;
        const cJSON *b = get(n, "behavior");
        if (!cJSON_IsString(b))
            return kvs_err(c->err, c->errlen, -EINVAL, "tokenizer.json: %s.behavior: expected a string", where);
        const char *bs = b->valuestring;
        if (!strcmp(bs, "Removed")) pr.behavior = TK_SPLIT_REMOVED;
        else if (!strcmp(bs, "Isolated")) pr.behavior = TK_SPLIT_ISOLATED;
        else if (!strcmp(bs, "MergedWithPrevious")) pr.behavior = TK_SPLIT_MERGED_PREV;
        else if (!strcmp(bs, "MergedWithNext")) pr.behavior = TK_SPLIT_MERGED_NEXT;
        else if (!strcmp(bs, "Contiguous")) pr.behavior = TK_SPLIT_CONTIGUOUS;
        else return kvs_err(c->err, c->errlen, -EINVAL, "tokenizer.json: %s.behavior: unknown '%s'", where, bs);
        if ((rc = get_bool(c, n, "invert", where, 0, &pr.invert))) return rc;
        char w[160];
        snprintf(w, sizeof w, "%s.pattern", where);
        if ((rc = compile_re(c, pat, strlen(pat), !is_re, w, &pr.re))) return rc;
        pr.kind = TK_PRE_SPLIT;
    } else if (!strcmp(ty, "ByteLevel")) {
        int use_regex;
        if ((rc = get_bool(c, n, "add_prefix_space", where, 1, &pr.add_prefix_space))) return rc;
        if ((rc = get_bool(c, n, "use_regex", where, 1, &use_regex))) return rc;
        if (use_regex) {
            char w[160];
            snprintf(w, sizeof w, "%s (GPT-2 regex)", where);
            if ((rc = compile_re(c, GPT2_REGEX, sizeof GPT2_REGEX - 1, 0, w, &pr.re))) return rc;
        }
        pr.kind = TK_PRE_BYTELEVEL;
        pr.behavior = TK_SPLIT_ISOLATED;
        t->byte_level = 1;
    } else if (!strcmp(ty, "Metaspace")) {
        const cJSON *r = get(n, "replacement"), *ps = get(n, "prepend_scheme");
        const char *rep = "\xe2\x96\x81";
        if (r && !cJSON_IsNull(r)) {
            if (!cJSON_IsString(r) || strlen(r->valuestring) == 0 || strlen(r->valuestring) > 4 ||
                !tk_utf8_valid(r->valuestring, strlen(r->valuestring)))
                return kvs_err(c->err, c->errlen, -EINVAL, "tokenizer.json: %s.replacement: expected one character", where);
            rep = r->valuestring;
        }
        memcpy(pr.replacement, rep, strlen(rep) + 1);
        int aps;
        if ((rc = get_bool(c, n, "add_prefix_space", where, 1, &aps))) return rc;
        pr.prepend_scheme = aps ? 2 : 0;
        if (ps && !cJSON_IsNull(ps)) {
            if (!cJSON_IsString(ps))
                return kvs_err(c->err, c->errlen, -EINVAL, "tokenizer.json: %s.prepend_scheme: expected a string", where);
            if (!strcmp(ps->valuestring, "always")) pr.prepend_scheme = 2;
            else if (!strcmp(ps->valuestring, "first")) pr.prepend_scheme = 1;
            else if (!strcmp(ps->valuestring, "never")) pr.prepend_scheme = 0;
            else return kvs_err(c->err, c->errlen, -EINVAL, "tokenizer.json: %s.prepend_scheme: unknown '%s'", where,
                                ps->valuestring);
        }
        if ((rc = get_bool(c, n, "split", where, 1, &pr.split))) return rc;
        pr.kind = TK_PRE_METASPACE;
    } else if (!strcmp(ty, "Digits")) {
        if ((rc = get_bool(c, n, "individual_digits", where, 0, &pr.individual_digits))) return rc;
        pr.kind = TK_PRE_DIGITS;
        char w[160];
        snprintf(w, sizeof w, "%s (digits)", where);
        /* HF splits on Rust's char::is_numeric: general categories Nd, Nl and No ("①", "²") */
        const char *dre = pr.individual_digits ? "\\p{N}" : "\\p{N}+";
        if ((rc = compile_re(c, dre, strlen(dre), 0, w, &pr.re))) return rc;
        pr.behavior = TK_SPLIT_ISOLATED;
    } else {
        return kvs_err(c->err, c->errlen, -ENOSYS, "tokenizer.json: %s.type: pre-tokenizer '%s' is not supported", where,
                       ty);
    }
    if ((rc = add_pre(t, pr))) pcre2_code_free(pr.re);
    return rc;
}

/* ---- decoder ---- */

struct dec_spec {
    int bytelevel, byte_fallback, strip_start, fused, join_space;
    int n_repl;
    const char *repl_from[8], *repl_to[8];
};

static int parse_decoder(struct ctx *c, const cJSON *n, const char *where, struct dec_spec *d, int depth)
{
    if (!n || cJSON_IsNull(n)) {
        d->join_space = 1;
        return 0;
    }
    const char *ty = type_of(n);
    if (!ty) return kvs_err(c->err, c->errlen, -EINVAL, "tokenizer.json: %s.type: missing or not a string", where);
    if (depth > 8) return kvs_err(c->err, c->errlen, -EINVAL, "tokenizer.json: %s: nested too deeply", where);
    int rc;
    if (!strcmp(ty, "Sequence")) {
        const cJSON *arr = get(n, "decoders"), *e;
        if (!cJSON_IsArray(arr))
            return kvs_err(c->err, c->errlen, -EINVAL, "tokenizer.json: %s.decoders: expected an array", where);
        int i = 0;
        cJSON_ArrayForEach(e, arr) {
            char w[128];
            snprintf(w, sizeof w, "%s.decoders[%d]", where, i++);
            if ((rc = parse_decoder(c, e, w, d, depth + 1))) return rc;
        }
        return 0;
    }
    if (d->bytelevel)
        return kvs_err(c->err, c->errlen, -ENOSYS, "tokenizer.json: %s: decoders after ByteLevel are not supported", where);
    if (d->strip_start && strcmp(ty, "Fuse"))
        return kvs_err(c->err, c->errlen, -ENOSYS, "tokenizer.json: %s: decoders after Strip are not supported", where);
    if (!strcmp(ty, "ByteLevel")) {
        if (d->n_repl || d->byte_fallback)
            return kvs_err(c->err, c->errlen, -ENOSYS, "tokenizer.json: %s: ByteLevel after other decoders is not supported",
                           where);
        d->bytelevel = 1;
    } else if (!strcmp(ty, "Replace")) {
        const char *pat;
        int is_re;
        if ((rc = parse_pattern(c, get(n, "pattern"), where, &pat, &is_re))) return rc;
        const cJSON *ct = get(n, "content");
        if (is_re || !cJSON_IsString(ct) || d->n_repl == 8 || !*pat)
            return kvs_err(c->err, c->errlen, -ENOSYS,
                           "tokenizer.json: %s: only literal, non-empty Replace decoders (at most 8) are supported", where);
        d->repl_from[d->n_repl] = pat;
        d->repl_to[d->n_repl++] = ct->valuestring;
    } else if (!strcmp(ty, "ByteFallback")) {
        d->byte_fallback = 1;
    } else if (!strcmp(ty, "Fuse")) {
        d->fused = 1;
    } else if (!strcmp(ty, "Strip")) {
        const cJSON *ct = get(n, "content"), *st = get(n, "start"), *sp = get(n, "stop");
        if (!cJSON_IsString(ct) || strcmp(ct->valuestring, " ") || !cJSON_IsNumber(st) || st->valuedouble < 0 ||
            st->valuedouble > 64 || (sp && !(cJSON_IsNumber(sp) && sp->valuedouble == 0)))
            return kvs_err(c->err, c->errlen, -ENOSYS,
                           "tokenizer.json: %s: only Strip of leading spaces (content \" \", stop 0) is supported", where);
        if (!d->fused)
            return kvs_err(c->err, c->errlen, -ENOSYS, "tokenizer.json: %s: Strip before Fuse is not supported", where);
        d->strip_start = (int)st->valuedouble;
    } else if (!strcmp(ty, "Metaspace")) {
        const cJSON *r = get(n, "replacement"), *ps = get(n, "prepend_scheme");
        int aps;
        if ((rc = get_bool(c, n, "add_prefix_space", where, 1, &aps))) return rc;
        if (ps && cJSON_IsString(ps)) aps = strcmp(ps->valuestring, "never") != 0;
        if (d->n_repl == 8) return kvs_err(c->err, c->errlen, -ENOSYS, "tokenizer.json: %s: too many decoders", where);
        d->repl_from[d->n_repl] = cJSON_IsString(r) && *r->valuestring ? r->valuestring : "\xe2\x96\x81";
        d->repl_to[d->n_repl++] = " ";
        d->fused = 1;
        d->strip_start = aps ? 1 : 0;
    } else {
        return kvs_err(c->err, c->errlen, -ENOSYS, "tokenizer.json: %s.type: decoder '%s' is not supported", where, ty);
    }
    return 0;
}

/* ---- post-processor ---- */

static int push_i32(int32_t **arr, int *n, int32_t v)
{
    int32_t *p = realloc(*arr, (size_t)(*n + 1) * sizeof *p);
    if (!p) return -ENOMEM;
    *arr = p;
    p[(*n)++] = v;
    return 0;
}

static int parse_post(struct ctx *c, struct kvs_tokenizer *t, const cJSON *n, const char *where, int depth)
{
    if (!n || cJSON_IsNull(n)) return 0;
    const char *ty = type_of(n);
    if (!ty) return kvs_err(c->err, c->errlen, -EINVAL, "tokenizer.json: %s.type: missing or not a string", where);
    if (depth > 8) return kvs_err(c->err, c->errlen, -EINVAL, "tokenizer.json: %s: nested too deeply", where);
    int rc;
    if (!strcmp(ty, "Sequence")) {
        const cJSON *arr = get(n, "processors"), *e;
        if (!cJSON_IsArray(arr))
            return kvs_err(c->err, c->errlen, -EINVAL, "tokenizer.json: %s.processors: expected an array", where);
        int i = 0;
        cJSON_ArrayForEach(e, arr) {
            char w[128];
            snprintf(w, sizeof w, "%s.processors[%d]", where, i++);
            if ((rc = parse_post(c, t, e, w, depth + 1))) return rc;
        }
        return 0;
    }
    if (!strcmp(ty, "ByteLevel")) return 0; /* only moves offsets */
    if (!strcmp(ty, "BertProcessing") || !strcmp(ty, "RobertaProcessing")) {
        const cJSON *cls = get(n, "cls"), *sep = get(n, "sep");
        int32_t a, b;
        if (!cJSON_IsArray(cls) || cJSON_GetArraySize(cls) != 2 || !cJSON_IsArray(sep) || cJSON_GetArraySize(sep) != 2)
            return kvs_err(c->err, c->errlen, -EINVAL, "tokenizer.json: %s.cls/sep: expected [token, id]", where);
        if ((rc = get_id(c, cJSON_GetArrayItem(cls, 1), where, &a)) || (rc = get_id(c, cJSON_GetArrayItem(sep, 1), where, &b)))
            return rc;
        if (push_i32(&t->pre_ids, &t->n_pre_ids, a) || push_i32(&t->post_ids, &t->n_post_ids, b)) return -ENOMEM;
        return 0;
    }
    if (strcmp(ty, "TemplateProcessing"))
        return kvs_err(c->err, c->errlen, -ENOSYS, "tokenizer.json: %s.type: post-processor '%s' is not supported", where, ty);
    const cJSON *single = get(n, "single"), *specials = get(n, "special_tokens"), *e;
    if (!cJSON_IsArray(single))
        return kvs_err(c->err, c->errlen, -EINVAL, "tokenizer.json: %s.single: expected an array", where);
    int seen_seq = 0, i = 0;
    cJSON_ArrayForEach(e, single) {
        char w[160];
        snprintf(w, sizeof w, "%s.single[%d]", where, i++);
        const cJSON *st = get(e, "SpecialToken"), *sq = get(e, "Sequence");
        if (sq) {
            seen_seq = 1;
            continue;
        }
        const cJSON *name = get(st, "id");
        if (!cJSON_IsString(name))
            return kvs_err(c->err, c->errlen, -EINVAL, "tokenizer.json: %s: expected {SpecialToken:{id}} or {Sequence:{}}", w);
        const cJSON *sp = get(specials, name->valuestring);
        const cJSON *ids = get(sp, "ids"), *idv;
        if (!cJSON_IsArray(ids))
            return kvs_err(c->err, c->errlen, -EINVAL, "tokenizer.json: %s.special_tokens[\"%s\"].ids: missing", where,
                           name->valuestring);
        cJSON_ArrayForEach(idv, ids) {
            int32_t id;
            if ((rc = get_id(c, idv, w, &id))) return rc;
            if (seen_seq ? push_i32(&t->post_ids, &t->n_post_ids, id) : push_i32(&t->pre_ids, &t->n_pre_ids, id))
                return -ENOMEM;
        }
    }
    return 0;
}

/* ---- model ---- */

static int set_token(struct kvs_tokenizer *t, int32_t id, const char *s, size_t len)
{
    if (t->tok_str[id]) return 0; /* the first definition of an id wins */
    t->tok_str[id] = dupn(s, len);
    if (!t->tok_str[id]) return -ENOMEM;
    t->tok_len[id] = (uint32_t)len;
    return 0;
}

static int parse_model(struct ctx *c, struct kvs_tokenizer *t, const cJSON *model, const cJSON *added)
{
    const char *ty = type_of(model);
    if (!cJSON_IsObject(model)) return kvs_err(c->err, c->errlen, -EINVAL, "tokenizer.json: model: missing or not an object");
    if (ty && strcmp(ty, "BPE"))
        return kvs_err(c->err, c->errlen, -ENOSYS, "tokenizer.json: model.type: '%s' is not supported (only BPE)", ty);
    const cJSON *vocab = get(model, "vocab"), *merges = get(model, "merges"), *e;
    if (!cJSON_IsObject(vocab)) return kvs_err(c->err, c->errlen, -EINVAL, "tokenizer.json: model.vocab: expected an object");
    if (merges && !cJSON_IsNull(merges) && !cJSON_IsArray(merges))
        return kvs_err(c->err, c->errlen, -EINVAL, "tokenizer.json: model.merges: expected an array");
    const cJSON *csp = get(model, "continuing_subword_prefix"), *eow = get(model, "end_of_word_suffix");
    if ((cJSON_IsString(csp) && *csp->valuestring) || (cJSON_IsString(eow) && *eow->valuestring))
        return kvs_err(c->err, c->errlen, -ENOSYS,
                       "tokenizer.json: model.continuing_subword_prefix/end_of_word_suffix: not supported");
    const cJSON *dropout = get(model, "dropout");
    if (cJSON_IsNumber(dropout) && dropout->valuedouble > 0)
        return kvs_err(c->err, c->errlen, -ENOSYS, "tokenizer.json: model.dropout: BPE dropout is not supported");
    int rc;
    if ((rc = get_bool(c, model, "byte_fallback", "model", 0, &t->byte_fallback))) return rc;
    if ((rc = get_bool(c, model, "ignore_merges", "model", 0, &t->ignore_merges))) return rc;
    if ((rc = get_bool(c, model, "fuse_unk", "model", 0, &t->fuse_unk))) return rc;

    /* ids: max over vocab and added tokens */
    int32_t max_id = -1, id;
    int n_vocab = 0;
    cJSON_ArrayForEach(e, vocab) {
        char w[96];
        snprintf(w, sizeof w, "model.vocab[%d]", n_vocab);
        if ((rc = get_id(c, e, w, &id))) return rc;
        if (!e->string) return kvs_err(c->err, c->errlen, -EINVAL, "tokenizer.json: %s: missing key", w);
        if (id > max_id) max_id = id;
        n_vocab++;
    }
    if (added && !cJSON_IsNull(added) && !cJSON_IsArray(added))
        return kvs_err(c->err, c->errlen, -EINVAL, "tokenizer.json: added_tokens: expected an array");
    int n_added = 0;
    cJSON_ArrayForEach(e, added) {
        char w[96];
        snprintf(w, sizeof w, "added_tokens[%d].id", n_added);
        if ((rc = get_id(c, get(e, "id"), w, &id))) return rc;
        const cJSON *ct = get(e, "content");
        if (!cJSON_IsString(ct) || !*ct->valuestring)
            return kvs_err(c->err, c->errlen, -EINVAL, "tokenizer.json: added_tokens[%d].content: expected a non-empty string",
                           n_added);
        if (id > max_id) max_id = id;
        n_added++;
    }
    if (max_id < 0) return kvs_err(c->err, c->errlen, -EINVAL, "tokenizer.json: model.vocab: empty");
    t->n_ids = max_id + 1;
    size_t n = (size_t)t->n_ids;
    t->tok_str = calloc(n, sizeof *t->tok_str);
    t->tok_len = calloc(n, sizeof *t->tok_len);
    t->tok_dec = calloc(n, sizeof *t->tok_dec);
    t->tok_dec_len = calloc(n, sizeof *t->tok_dec_len);
    t->tok_byte = malloc(n * sizeof *t->tok_byte);
    t->tok_special = calloc(n, 1);
    t->added = calloc((size_t)n_added + 1, sizeof *t->added);
    if (!t->tok_str || !t->tok_len || !t->tok_dec || !t->tok_dec_len || !t->tok_byte || !t->tok_special || !t->added ||
        tk_strmap_init(&t->vocab, (uint32_t)n_vocab) != 0)
        return -ENOMEM;
    for (size_t i = 0; i < n; i++) t->tok_byte[i] = -1;

    /* the vocab map's keys point into tok_str, so tokens whose id repeats need their own copy:
     * only the first string of an id is kept and later duplicates of an id are refused */
    cJSON_ArrayForEach(e, vocab) {
        id = (int32_t)e->valuedouble;
        size_t len = strlen(e->string);
        if (t->tok_str[id])
            return kvs_err(c->err, c->errlen, -EINVAL, "tokenizer.json: model.vocab[\"%.40s\"]: id %d used twice", e->string, id);
        if (!tk_utf8_valid(e->string, len))
            return kvs_err(c->err, c->errlen, -EINVAL, "tokenizer.json: model.vocab: token with id %d is not valid UTF-8", id);
        if ((rc = set_token(t, id, e->string, len))) return rc;
        if (tk_strmap_put(&t->vocab, t->tok_str[id], (uint32_t)len, id) < 0) return -ENOMEM;
    }

    int i = 0;
    cJSON_ArrayForEach(e, added) {
        struct tk_added *a = &t->added[i];
        a->id = (int32_t)get(e, "id")->valuedouble;
        const char *s = get(e, "content")->valuestring;
        char w[64];
        snprintf(w, sizeof w, "added_tokens[%d]", i);
        if (!tk_utf8_valid(s, strlen(s)))
            return kvs_err(c->err, c->errlen, -EINVAL, "tokenizer.json: %s.content: not valid UTF-8", w);
        int sp, ls, rs, sw, nz;
        if ((rc = get_bool(c, e, "special", w, 0, &sp)) || (rc = get_bool(c, e, "lstrip", w, 0, &ls)) ||
            (rc = get_bool(c, e, "rstrip", w, 0, &rs)) || (rc = get_bool(c, e, "single_word", w, 0, &sw)) ||
            (rc = get_bool(c, e, "normalized", w, !sp, &nz)))
            return rc;
        a->special = (uint8_t)sp;
        a->lstrip = (uint8_t)ls;
        a->rstrip = (uint8_t)rs;
        a->single_word = (uint8_t)sw;
        a->normalized = (uint8_t)nz;
        a->len = (uint32_t)strlen(s);
        a->content = dupn(s, a->len);
        if (!a->content) return -ENOMEM;
        t->n_added = i + 1; /* owned from here on, freed by kvs_tokenizer_free */
        if (t->tok_str[a->id] && (t->tok_len[a->id] != a->len || memcmp(t->tok_str[a->id], s, a->len)))
            return kvs_err(c->err, c->errlen, -EINVAL, "tokenizer.json: %s: id %d already names another token", w, a->id);
        if ((rc = set_token(t, a->id, s, a->len))) return rc;
        if (sp) t->tok_special[a->id] = 1;
        t->n_added = ++i;
    }

    /* merges: "a b" strings or [a, b] pairs; the rank is the position */
    i = 0;
    if ((rc = tk_mergemap_init(&t->merges, (uint32_t)cJSON_GetArraySize(merges)))) return rc;
    struct tk_buf cat = {0};
    cJSON_ArrayForEach(e, merges) {
        const char *a, *b;
        size_t al, bl;
        if (cJSON_IsString(e)) {
            a = e->valuestring;
            const char *sp = strchr(a, ' ');
            if (!sp) {
                free(cat.p);
                return kvs_err(c->err, c->errlen, -EINVAL, "tokenizer.json: model.merges[%d]: expected \"a b\"", i);
            }
            al = (size_t)(sp - a);
            b = sp + 1;
            bl = strlen(b);
        } else if (cJSON_IsArray(e) && cJSON_GetArraySize(e) == 2 && cJSON_IsString(cJSON_GetArrayItem(e, 0)) &&
                   cJSON_IsString(cJSON_GetArrayItem(e, 1))) {
            a = cJSON_GetArrayItem(e, 0)->valuestring;
            b = cJSON_GetArrayItem(e, 1)->valuestring;
            al = strlen(a);
            bl = strlen(b);
        } else {
            free(cat.p);
            return kvs_err(c->err, c->errlen, -EINVAL, "tokenizer.json: model.merges[%d]: expected \"a b\" or [a, b]", i);
        }
        int32_t ia = tk_strmap_get(&t->vocab, a, al), ib = tk_strmap_get(&t->vocab, b, bl);
        cat.n = 0;
        if (tk_buf_put(&cat, a, al) || tk_buf_put(&cat, b, bl)) {
            free(cat.p);
            return -ENOMEM;
        }
        int32_t im = tk_strmap_get(&t->vocab, cat.p, cat.n);
        if (ia < 0 || ib < 0 || im < 0) {
            free(cat.p);
            return kvs_err(c->err, c->errlen, -EINVAL, "tokenizer.json: model.merges[%d]: token '%.*s' not in the vocab", i,
                           (int)(ia < 0 ? (al > 40 ? 40 : al) : ib < 0 ? (bl > 40 ? 40 : bl) : (cat.n > 40 ? 40 : cat.n)),
                           ia < 0 ? a : ib < 0 ? b : cat.p);
        }
        if (tk_mergemap_put(&t->merges, ia, ib, i, im) < 0) {
            free(cat.p);
            return -ENOMEM;
        }
        i++;
    }
    free(cat.p);

    const cJSON *unk = get(model, "unk_token");
    t->unk_id = -1;
    if (unk && !cJSON_IsNull(unk)) {
        if (!cJSON_IsString(unk)) return kvs_err(c->err, c->errlen, -EINVAL, "tokenizer.json: model.unk_token: expected a string");
        t->unk_id = tk_strmap_get(&t->vocab, unk->valuestring, strlen(unk->valuestring));
        if (t->unk_id < 0)
            return kvs_err(c->err, c->errlen, -EINVAL, "tokenizer.json: model.unk_token: '%.40s' is not in the vocab",
                           unk->valuestring);
    }
    return 0;
}

/* Per-token decoded bytes, so decoding is a table lookup. */
static int build_decode_table(struct kvs_tokenizer *t, const struct dec_spec *d)
{
    struct tk_buf b = {0}, tmp = {0};
    t->dec_kind = d->bytelevel ? TK_DEC_BYTELEVEL : d->join_space ? TK_DEC_NONE : TK_DEC_PIECES;
    t->dec_strip_start = d->strip_start;
    t->dec_byte_fallback = d->byte_fallback;
    t->dec_join_space = d->join_space;
    for (int32_t id = 0; id < t->n_ids; id++) {
        const char *s = t->tok_str[id];
        if (!s) continue;
        size_t len = t->tok_len[id];
        b.n = 0;
        if (tk_buf_put(&b, "", 0)) goto oom;
        if (d->bytelevel) {
            const uint8_t *u = (const uint8_t *)s;
            size_t i = 0;
            int ok = 1;
            while (i < len && ok) {
                uint32_t cp;
                int k = tk_utf8_next(u + i, len - i, &cp);
                int byte = k > 0 ? tk_cp_to_byte(cp) : -1;
                if (byte < 0) {
                    ok = 0;
                    break;
                }
                char c = (char)byte;
                if (tk_buf_put(&b, &c, 1)) goto oom;
                i += (size_t)k;
            }
            if (!ok) { /* HF keeps such tokens (e.g. added ones) as their raw text */
                b.n = 0;
                if (tk_buf_put(&b, s, len)) goto oom;
            }
        } else {
            if (tk_buf_put(&b, s, len)) goto oom;
            for (int r = 0; r < d->n_repl; r++) {
                const char *from = d->repl_from[r], *to = d->repl_to[r];
                size_t fl = strlen(from), tl = strlen(to), j = 0, run = 0;
                tmp.n = 0;
                if (tk_buf_put(&tmp, "", 0)) goto oom;
                while (j + fl <= b.n) {
                    if (memcmp(b.p + j, from, fl) == 0) {
                        if (tk_buf_put(&tmp, b.p + run, j - run) || tk_buf_put(&tmp, to, tl)) goto oom;
                        j += fl;
                        run = j;
                    } else {
                        j++;
                    }
                }
                if (tk_buf_put(&tmp, b.p + run, b.n - run)) goto oom;
                struct tk_buf sw = b;
                b = tmp;
                tmp = sw;
            }
            if (d->byte_fallback && len == 6 && !memcmp(s, "<0x", 3) && s[5] == '>') {
                unsigned v;
                char hex[3] = {s[3], s[4], 0};
                char *endp;
                v = (unsigned)strtoul(hex, &endp, 16);
                if (*endp == 0 && ((hex[0] >= '0' && hex[0] <= '9') || (hex[0] >= 'A' && hex[0] <= 'F') ||
                                   (hex[0] >= 'a' && hex[0] <= 'f')))
                    t->tok_byte[id] = (int16_t)v;
            }
        }
        t->tok_dec[id] = dupn(b.p, b.n);
        if (!t->tok_dec[id]) goto oom;
        t->tok_dec_len[id] = (uint32_t)b.n;
    }
    free(b.p);
    free(tmp.p);
    return 0;
oom:
    free(b.p);
    free(tmp.p);
    return -ENOMEM;
}

static int build_added_matchers(struct kvs_tokenizer *t)
{
    int n = t->n_added, rc = 0;
    const char **strs = calloc((size_t)n + 1, sizeof *strs);
    uint32_t *lens = calloc((size_t)n + 1, sizeof *lens);
    int32_t *vals = calloc((size_t)n + 1, sizeof *vals);
    t->added_norm = calloc((size_t)n + 1, sizeof *t->added_norm);
    t->added_norm_len = calloc((size_t)n + 1, sizeof *t->added_norm_len);
    if (!strs || !lens || !vals || !t->added_norm || !t->added_norm_len) {
        rc = -ENOMEM;
        goto out;
    }
    int k = 0;
    for (int i = 0; i < n; i++) {
        if (t->added[i].normalized) continue;
        strs[k] = t->added[i].content;
        lens[k] = t->added[i].len;
        vals[k++] = i;
    }
    if ((rc = tk_trie_build(&t->trie_raw, strs, lens, vals, k))) goto out;
    k = 0;
    struct tk_buf nb = {0};
    for (int i = 0; i < n; i++) {
        if (!t->added[i].normalized) continue;
        if ((rc = tk_normalize(t, t->added[i].content, t->added[i].len, &nb))) break;
        t->added_norm[i] = dupn(nb.p, nb.n);
        if (!t->added_norm[i]) {
            rc = -ENOMEM;
            break;
        }
        t->added_norm_len[i] = (uint32_t)nb.n;
        strs[k] = t->added_norm[i];
        lens[k] = (uint32_t)nb.n;
        vals[k++] = i;
    }
    free(nb.p);
    if (rc == 0) rc = tk_trie_build(&t->trie_norm, strs, lens, vals, k);
out:
    free(strs);
    free(lens);
    free(vals);
    return rc;
}

/* ---- configs: BOS / EOS ---- */

static int token_from_cfg(const struct kvs_tokenizer *t, const cJSON *v, int32_t *id)
{
    const char *s = NULL;
    if (cJSON_IsString(v)) s = v->valuestring;
    else if (cJSON_IsObject(v) && cJSON_IsString(get(v, "content"))) s = get(v, "content")->valuestring;
    if (!s) return 0;
    *id = kvs_tokenizer_token_id(t, s);
    return *id >= 0;
}

static int add_eos(struct kvs_tokenizer *t, int32_t id)
{
    if (id < 0 || id >= t->n_ids) return 0;
    for (int i = 0; i < t->n_eos; i++)
        if (t->eos[i] == id) return 0;
    return push_i32(&t->eos, &t->n_eos, id);
}

static int eos_ids_from(struct ctx *c, struct kvs_tokenizer *t, const cJSON *root, const char *file)
{
    const cJSON *v = get(root, "eos_token_id"), *e;
    if (!v || cJSON_IsNull(v)) return 0;
    if (cJSON_IsNumber(v)) return add_eos(t, (int32_t)v->valuedouble);
    if (!cJSON_IsArray(v)) return kvs_err(c->err, c->errlen, -EINVAL, "%s: eos_token_id: expected an int or a list", file);
    cJSON_ArrayForEach(e, v) {
        if (!cJSON_IsNumber(e))
            return kvs_err(c->err, c->errlen, -EINVAL, "%s: eos_token_id: expected a list of ints", file);
        int rc = add_eos(t, (int32_t)e->valuedouble);
        if (rc) return rc;
    }
    return 0;
}

static int parse_configs(struct ctx *c, struct kvs_tokenizer *t, const char *tcfg, const char *gen, const char *cfg)
{
    int rc = 0;
    t->bos = -1;
    t->add_bos_default = t->n_pre_ids > 0;
    if (t->n_pre_ids > 0) t->bos = t->pre_ids[0];
    const char *names[3] = {"tokenizer_config.json", "generation_config.json", "config.json"};
    const char *texts[3] = {tcfg, gen, cfg};
    for (int f = 0; f < 3 && rc == 0; f++) {
        if (!texts[f]) continue;
        cJSON *root = cJSON_Parse(texts[f]);
        if (!cJSON_IsObject(root)) {
            cJSON_Delete(root);
            return kvs_err(c->err, c->errlen, -EINVAL, "%s: not a JSON object", names[f]);
        }
        if (f == 0) {
            const cJSON *b = get(root, "bos_token"), *e = get(root, "eos_token"), *ab = get(root, "add_bos_token");
            int32_t id;
            if (b) {
                t->bos = -1;
                if (token_from_cfg(t, b, &id)) t->bos = id;
            }
            if (e && token_from_cfg(t, e, &id)) rc = add_eos(t, id);
            if (cJSON_IsBool(ab)) t->add_bos_default = cJSON_IsTrue(ab);
        } else {
            rc = eos_ids_from(c, t, root, names[f]);
        }
        cJSON_Delete(root);
    }
    if (t->add_bos_default && t->bos < 0) t->add_bos_default = 0;
    return rc;
}

/* ---- entry points ---- */

static int load_all(const char *json, size_t len, const char *tcfg, const char *gen, const char *cfg,
                    struct kvs_tokenizer **out, char *err, size_t errlen)
{
    struct ctx c = {err, errlen};
    *out = NULL;
    if (!json) return kvs_err(err, errlen, -EINVAL, "tokenizer.json: no text");
    cJSON *root = cJSON_ParseWithLength(json, len);
    if (!root) return kvs_err(err, errlen, -EINVAL, "tokenizer.json: not valid JSON (near byte %zu)",
                              cJSON_GetErrorPtr() ? (size_t)(cJSON_GetErrorPtr() - json) : (size_t)0);
    struct kvs_tokenizer *t = calloc(1, sizeof *t);
    if (!t) {
        cJSON_Delete(root);
        return kvs_err(err, errlen, -ENOMEM, "tokenizer: out of memory");
    }
    int rc;
    struct dec_spec d = {0};
    if (!cJSON_IsObject(root)) {
        rc = kvs_err(err, errlen, -EINVAL, "tokenizer.json: not a JSON object");
        goto fail;
    }
    if ((rc = parse_model(&c, t, get(root, "model"), get(root, "added_tokens")))) goto fail;
    if ((rc = parse_normalizer(&c, t, get(root, "normalizer"), "normalizer", 0))) goto fail;
    if ((rc = parse_pre(&c, t, get(root, "pre_tokenizer"), "pre_tokenizer", 0))) goto fail;
    if ((rc = parse_decoder(&c, get(root, "decoder"), "decoder", &d, 0))) goto fail;
    if ((rc = parse_post(&c, t, get(root, "post_processor"), "post_processor", 0))) goto fail;
    for (int i = 0; i < t->n_pre_ids; i++)
        if (t->pre_ids[i] >= t->n_ids || !t->tok_str[t->pre_ids[i]]) {
            rc = kvs_err(err, errlen, -EINVAL, "tokenizer.json: post_processor: special token id %d is not a token",
                         t->pre_ids[i]);
            goto fail;
        }
    for (int i = 0; i < t->n_post_ids; i++)
        if (t->post_ids[i] >= t->n_ids || !t->tok_str[t->post_ids[i]]) {
            rc = kvs_err(err, errlen, -EINVAL, "tokenizer.json: post_processor: special token id %d is not a token",
                         t->post_ids[i]);
            goto fail;
        }
    for (int b = 0; b < 256; b++) {
        char s[8];
        int k;
        if (t->byte_level) k = tk_utf8_put(s, tk_byte_to_cp((uint8_t)b));
        else k = snprintf(s, sizeof s, "<0x%02X>", b);
        t->byte_id[b] = tk_strmap_get(&t->vocab, s, (size_t)k);
    }
    if (!t->byte_level && t->n_pres == 0) {
        /* BPE merges are local: if no vocab token contains "▁" after a character other than
         * "▁", no merge can cross the start of a "▁" run, so each such word can be merged on
         * its own with identical results (and far faster than one line-long word). */
        t->sp_split = 1;
        for (int32_t id = 0; id < t->n_ids && t->sp_split; id++) {
            const char *s = t->tok_str[id];
            if (!s) continue;
            const char *p = s;
            while ((p = strstr(p, "\xe2\x96\x81")) != NULL) {
                if (p > s && !(p - s >= 3 && memcmp(p - 3, "\xe2\x96\x81", 3) == 0)) {
                    t->sp_split = 0;
                    break;
                }
                p += 3;
            }
        }
    }
    t->cache = tk_cache_new(); /* optional: encode works (slower) without it */
    if ((rc = build_decode_table(t, &d))) goto fail;
    if ((rc = build_added_matchers(t))) goto fail;
    if ((rc = parse_configs(&c, t, tcfg, gen, cfg))) goto fail;
    cJSON_Delete(root);
    *out = t;
    return 0;
fail:
    if (rc == -ENOMEM) kvs_err(err, errlen, -ENOMEM, "tokenizer.json: out of memory");
    cJSON_Delete(root);
    kvs_tokenizer_free(t);
    return rc;
}

int kvs_tokenizer_load_json(const char *tokenizer_json, size_t len, const char *config_json, struct kvs_tokenizer **out,
                            char *err, size_t errlen)
{
    return load_all(tokenizer_json, len, config_json, NULL, NULL, out, err, errlen);
}

static char *read_optional(const char *dir, const char *name, int *rc, char *err, size_t errlen)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "rb");
    if (!f) return NULL; /* optional */
    fclose(f);
    char *s = kvs_read_file(path, NULL, err, errlen);
    if (!s) *rc = -EIO;
    return s;
}

int kvs_tokenizer_load(const char *dir, struct kvs_tokenizer **out, char *err, size_t errlen)
{
    char path[4096];
    size_t len = 0;
    int rc = 0;
    *out = NULL;
    int gguf = kvs_gguf_find(dir, path, sizeof path, err, errlen);
    if (gguf < 0) return gguf;
    if (gguf) return kvs_tokenizer_load_gguf(path, out, err, errlen);
    if (snprintf(path, sizeof path, "%s/tokenizer.json", dir) >= (int)sizeof path)
        return kvs_err(err, errlen, -ENAMETOOLONG, "%s: path too long", dir);
    char *json = kvs_read_file(path, &len, err, errlen);
    if (!json) return -ENOENT;
    char *tcfg = read_optional(dir, "tokenizer_config.json", &rc, err, errlen);
    char *gen = rc ? NULL : read_optional(dir, "generation_config.json", &rc, err, errlen);
    char *cfg = rc ? NULL : read_optional(dir, "config.json", &rc, err, errlen);
    if (rc == 0) {
        rc = load_all(json, len, tcfg, gen, cfg, out, err, errlen);
        if (rc && err && errlen > 0) { /* prefix the directory so the message names the file */
            char tmp[512];
            snprintf(tmp, sizeof tmp, "%s", err);
            snprintf(err, errlen, "%s/%s", dir, tmp);
        }
    }
    free(json);
    free(tcfg);
    free(gen);
    free(cfg);
    return rc;
}

void kvs_tokenizer_free(struct kvs_tokenizer *t)
{
    if (!t) return;
    for (int32_t i = 0; i < t->n_ids; i++) {
        if (t->tok_str) free(t->tok_str[i]);
        if (t->tok_dec) free(t->tok_dec[i]);
    }
    free(t->tok_str);
    free(t->tok_len);
    free(t->tok_dec);
    free(t->tok_dec_len);
    free(t->tok_byte);
    free(t->tok_special);
    tk_strmap_free(&t->vocab);
    tk_mergemap_free(&t->merges);
    for (int i = 0; i < t->n_added; i++) {
        free(t->added[i].content);
        if (t->added_norm) free(t->added_norm[i]);
    }
    free(t->added);
    free(t->added_norm);
    free(t->added_norm_len);
    tk_trie_free(&t->trie_raw);
    tk_trie_free(&t->trie_norm);
    for (int i = 0; i < t->n_norms; i++) {
        free(t->norms[i].a);
        free(t->norms[i].b);
    }
    free(t->norms);
    for (int i = 0; i < t->n_pres; i++) pcre2_code_free(t->pres[i].re);
    free(t->pres);
    free(t->pre_ids);
    free(t->post_ids);
    free(t->eos);
    tk_cache_free(t->cache);
    free(t);
}
