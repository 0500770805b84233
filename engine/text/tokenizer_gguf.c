/* tokenizer_gguf.c: a tokenizer from a GGUF file's tokenizer.ggml.* metadata.
 *
 * A GGUF carries no tokenizer.json, only llama.cpp's description: the model kind
 * (tokenizer.ggml.model), the vocabulary with a type per token, merges, a pre-tokenizer name
 * (tokenizer.ggml.pre) and the special ids. This file writes the tokenizer.json (and the
 * tokenizer_config.json) that transformers 5 builds from the same metadata
 * (transformers/integrations/gguf/gguf_tokenizer_mapping.py) and hands them to the ordinary
 * loader, so one pipeline serves both formats:
 *   "gpt2"  byte-level BPE; tokens outside the byte alphabet are respelled through it, CONTROL
 *           tokens (type 3) become special added tokens (skipped when not byte-spelled, as
 *           transformers does), USER_DEFINED (type 4) plain added tokens. Pre-tokenizer by
 *           tokenizer.ggml.pre: llama3-family / qwen2-family / gpt-4o-family split regexes
 *           (transformers' table); "smollm" and the other names llama.cpp groups with it
 *           (starcoder, refact, command-r, codeshell, exaone, minerva): every digit split off
 *           first, then the GPT-2 regex, as llama.cpp does and as these models' own
 *           tokenizer.json does (Digits(individual_digits) + ByteLevel). transformers 5 drops the
 *           digit split for them; its ids differ where a digit follows a run of whitespace or
 *           is non-ASCII (tests/py/test_gguf_tokenizer.py counts them). Anything else: the
 *           GPT-2 regex.
 *   "llama" SentencePiece BPE with byte fallback: Metaspace("▁", prepend first, no split), the
 *           Replace/ByteFallback/Fuse/Strip decoder of transformers' LlamaTokenizer, unk from
 *           tokenizer.ggml.unknown_token_id; merges from the file (a file without merges is
 *           refused with a message: kvserve builds its BPE from merges, never from scores).
 * BOS / EOS / add_bos_token come from tokenizer.ggml.bos_token_id, eos_token_id, add_bos_token.
 * Other tokenizer models (t5, bert, rwkv, ...) are refused by name.
 */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/text/tokenizer_internal.h"
#include "base/util.h"
#include "models/gguf.h"

#define GGUF_TOKEN_NORMAL 1
#define GGUF_TOKEN_CONTROL 3
#define GGUF_TOKEN_USER_DEFINED 4

static const char LLAMA3_SPLIT[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}"
    "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char QWEN2_SPLIT[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+"
    "|\\s+(?!\\S)|\\s+";
static const char QWEN35_SPLIT[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*"
    "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char GPT4O_SPLIT[] =
    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+"
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    "|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*"
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char TEKKEN_SPLIT[] =
    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+"
    "|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*"
    "|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

/* transformers' GGUF_PRE_TOKENIZER_SPLITS (the regexes as PCRE2 reads them) */
static const struct {
    const char *pre;
    const char *split;
} PRE_SPLITS[] = {
    {"llama3", LLAMA3_SPLIT},   {"llama-v3", LLAMA3_SPLIT}, {"llama-bpe", LLAMA3_SPLIT},  {"falcon3", LLAMA3_SPLIT},
    {"falcon-h1", LLAMA3_SPLIT}, {"pixtral", LLAMA3_SPLIT}, {"midm-2.0", LLAMA3_SPLIT},   {"lfm2", LLAMA3_SPLIT},
    {"jina-v5-nano", LLAMA3_SPLIT}, {"dbrx", LLAMA3_SPLIT}, {"smaug-bpe", LLAMA3_SPLIT}, {"tekken", TEKKEN_SPLIT},
    {"qwen2", QWEN2_SPLIT},     {"deepseek-r1-qwen", QWEN2_SPLIT}, {"kormo", QWEN2_SPLIT}, {"f2llmv2", QWEN2_SPLIT},
    {"megrez", QWEN2_SPLIT},    {"qwen35", QWEN35_SPLIT},   {"gpt-4o", GPT4O_SPLIT},     {"llama4", GPT4O_SPLIT},
    {"kanana2", GPT4O_SPLIT},   {"talkie", GPT4O_SPLIT},    {"minimax-m2", GPT4O_SPLIT},
};

/* llama.cpp's pre-tokenizers that split every digit (\p{N}) off first, then apply the GPT-2
 * regex: the individual-digits pre-tokenizer of these models' own tokenizer.json */
static int digit_split(struct kvs_gguf_str pre)
{
    static const char *const names[] = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (kvs_gguf_str_eq(pre, names[i])) return 1;
    return 0;
}

struct gctx {
    const struct kvs_gguf *g;
    char *err;
    size_t errlen;
};

/* A NUL-terminated copy of a GGUF string (tokens must not hold NUL: JSON strings here cannot). */
static char *dup_str(struct gctx *c, struct kvs_gguf_str s, const char *what, uint64_t i)
{
    if (memchr(s.p, 0, s.len)) {
        kvs_err(c->err, c->errlen, -EINVAL, "%s: %s[%llu] contains a NUL byte", c->g->file, what,
                (unsigned long long)i);
        return NULL;
    }
    char *r = kvs_xmalloc(s.len + 1);
    memcpy(r, s.p, s.len);
    r[s.len] = 0;
    return r;
}

/* 1 when every code point of s is one of the 256 of the GPT-2 byte alphabet. */
static int byte_spelled(const char *s)
{
    size_t n = strlen(s);
    while (n) {
        uint32_t cp;
        int k = tk_utf8_next((const uint8_t *)s, n, &cp);
        if (k <= 0 || tk_cp_to_byte(cp) < 0) return 0;
        s += k;
        n -= (size_t)k;
    }
    return 1;
}

/* The token respelled through the byte alphabet (caller frees). */
static char *respell(const char *s)
{
    size_t n = strlen(s);
    char *r = kvs_xmalloc(n * 2 + 1), *o = r;
    for (size_t i = 0; i < n; i++) o += tk_utf8_put(o, tk_byte_to_cp((uint8_t)s[i]));
    *o = 0;
    return r;
}

static cJSON *json_obj(const char *json_text)
{
    cJSON *j = cJSON_Parse(json_text);
    KVS_ASSERT(j);
    return j;
}

static int get_id(struct gctx *c, const char *key, uint64_t n_tokens, int64_t *out)
{
    uint64_t v;
    *out = -1;
    int rc = kvs_gguf_get_u64(c->g, key, 0, &v, c->err, c->errlen);
    if (rc == -ENOENT) return 0;
    if (rc) return rc;
    if (v >= n_tokens)
        return kvs_err(c->err, c->errlen, -EINVAL, "%s: metadata '%s' = %llu is not a token id (vocabulary of %llu)",
                       c->g->file, key, (unsigned long long)v, (unsigned long long)n_tokens);
    *out = (int64_t)v;
    return 0;
}

static cJSON *added_token(int64_t id, const char *content, int special)
{
    cJSON *a = cJSON_CreateObject();
    cJSON_AddNumberToObject(a, "id", (double)id);
    cJSON_AddStringToObject(a, "content", content);
    cJSON_AddBoolToObject(a, "single_word", 0);
    cJSON_AddBoolToObject(a, "lstrip", 0);
    cJSON_AddBoolToObject(a, "rstrip", 0);
    cJSON_AddBoolToObject(a, "normalized", 0);
    cJSON_AddBoolToObject(a, "special", special);
    return a;
}

/* Builds tokenizer.json and tokenizer_config.json texts (malloc'ed). */
static int build(struct gctx *c, char **tok_json, char **cfg_json)
{
    const struct kvs_gguf *g = c->g;
    struct kvs_gguf_str model, pre = {"default", 7};
    int rc = kvs_gguf_get_str(g, "tokenizer.ggml.model", 1, &model, c->err, c->errlen);
    if (rc) return rc;
    const int gpt2 = kvs_gguf_str_eq(model, "gpt2"), llama = kvs_gguf_str_eq(model, "llama");
    if (!gpt2 && !llama)
        return kvs_err(c->err, c->errlen, -ENOTSUP, "%s: tokenizer.ggml.model \"%.*s\" is not supported (gpt2, llama)",
                       g->file, (int)(model.len < 40 ? model.len : 40), model.p);
    rc = kvs_gguf_get_str(g, "tokenizer.ggml.pre", 0, &pre, c->err, c->errlen);
    if (rc && rc != -ENOENT) return rc;
    const struct kvs_gguf_kv *tokens = kvs_gguf_get(g, "tokenizer.ggml.tokens");
    const struct kvs_gguf_kv *types = kvs_gguf_get(g, "tokenizer.ggml.token_type");
    const struct kvs_gguf_kv *merges = kvs_gguf_get(g, "tokenizer.ggml.merges");
    if (!tokens || tokens->type != KVS_GGUF_ARRAY || tokens->elem_type != KVS_GGUF_STRING || !tokens->n)
        return kvs_err(c->err, c->errlen, -EINVAL, "%s: metadata 'tokenizer.ggml.tokens' must be a non-empty array of "
                       "strings", g->file);
    if (tokens->n > (1u << 24))
        return kvs_err(c->err, c->errlen, -EINVAL, "%s: %llu tokens is too many", g->file,
                       (unsigned long long)tokens->n);
    if (types && (types->type != KVS_GGUF_ARRAY || types->elem_type == KVS_GGUF_STRING || types->n != tokens->n))
        return kvs_err(c->err, c->errlen, -EINVAL, "%s: metadata 'tokenizer.ggml.token_type' must be an integer array "
                       "as long as tokenizer.ggml.tokens (%llu)", g->file, (unsigned long long)tokens->n);
    if (merges && (merges->type != KVS_GGUF_ARRAY || merges->elem_type != KVS_GGUF_STRING))
        return kvs_err(c->err, c->errlen, -EINVAL, "%s: metadata 'tokenizer.ggml.merges' must be an array of strings",
                       g->file);
    if (!merges)
        return kvs_err(c->err, c->errlen, -ENOTSUP, "%s: no tokenizer.ggml.merges: rebuilding BPE merges from token "
                       "scores is not supported", g->file);
    int64_t bos, eos, unk;
    if ((rc = get_id(c, "tokenizer.ggml.bos_token_id", tokens->n, &bos))) return rc;
    if ((rc = get_id(c, "tokenizer.ggml.eos_token_id", tokens->n, &eos))) return rc;
    if ((rc = get_id(c, "tokenizer.ggml.unknown_token_id", tokens->n, &unk))) return rc;
    int add_bos = 0;
    if ((rc = kvs_gguf_get_bool(g, "tokenizer.ggml.add_bos_token", 0, &add_bos, c->err, c->errlen)) && rc != -ENOENT)
        return rc;
    /* llama.cpp's default for SentencePiece files without the key is to add BOS */
    if (rc == -ENOENT) add_bos = llama;

    struct kvs_gguf_str *strs = kvs_xcalloc((size_t)tokens->n, sizeof *strs);
    kvs_gguf_arr_strs(tokens, strs);
    char **toks = kvs_xcalloc((size_t)tokens->n, sizeof *toks);
    cJSON *root = cJSON_CreateObject(), *m = cJSON_AddObjectToObject(root, "model");
    cJSON *added = cJSON_AddArrayToObject(root, "added_tokens");
    cJSON *vocab = cJSON_AddObjectToObject(m, "vocab");
    rc = 0;
    for (uint64_t i = 0; i < tokens->n && !rc; i++) {
        char *s = dup_str(c, strs[i], "tokenizer.ggml.tokens", i);
        if (!s) {
            rc = -EINVAL;
            break;
        }
        int spelled = !gpt2 || byte_spelled(s);
        if (!spelled) {
            char *r = respell(s);
            free(s);
            s = r;
        }
        toks[i] = s;
        /* a spelling listed twice maps to its first id here (the loader keeps the first key) where
         * transformers' dict keeps the last; real vocabularies list each spelling once */
        cJSON_AddNumberToObject(vocab, s, (double)i);
        int64_t ty = types ? kvs_gguf_arr_i64(types, i) : GGUF_TOKEN_NORMAL;
        if (ty == GGUF_TOKEN_CONTROL && spelled) cJSON_AddItemToArray(added, added_token((int64_t)i, s, 1));
        else if (ty == GGUF_TOKEN_USER_DEFINED) cJSON_AddItemToArray(added, added_token((int64_t)i, s, 0));
    }
    if (!rc) {
        struct kvs_gguf_str *ms = kvs_xcalloc((size_t)merges->n + 1, sizeof *ms);
        kvs_gguf_arr_strs(merges, ms);
        cJSON *ma = cJSON_AddArrayToObject(m, "merges");
        for (uint64_t i = 0; i < merges->n && !rc; i++) {
            char *s = dup_str(c, ms[i], "tokenizer.ggml.merges", i);
            if (!s) rc = -EINVAL;
            else cJSON_AddItemToArray(ma, cJSON_CreateString(s));
            free(s);
        }
        free(ms);
    }
    if (!rc) {
        cJSON_AddStringToObject(m, "type", "BPE");
        cJSON_AddBoolToObject(m, "fuse_unk", llama);
        cJSON_AddBoolToObject(m, "byte_fallback", llama);
        cJSON_AddBoolToObject(m, "ignore_merges", 0);
        if (llama && unk >= 0) cJSON_AddStringToObject(m, "unk_token", toks[unk]);
        else cJSON_AddNullToObject(m, "unk_token");
        if (llama) {
            cJSON_AddItemToObject(root, "pre_tokenizer", json_obj("{\"type\":\"Metaspace\",\"replacement\":\"\\u2581\","
                                                                  "\"prepend_scheme\":\"first\",\"split\":false}"));
            cJSON_AddItemToObject(root, "decoder",
                                  json_obj("{\"type\":\"Sequence\",\"decoders\":[{\"type\":\"Replace\",\"pattern\":"
                                           "{\"String\":\"\\u2581\"},\"content\":\" \"},{\"type\":\"ByteFallback\"},"
                                           "{\"type\":\"Fuse\"},{\"type\":\"Strip\",\"content\":\" \",\"start\":1,"
                                           "\"stop\":0}]}"));
        } else {
            const char *split = NULL;
            for (size_t i = 0; i < sizeof PRE_SPLITS / sizeof PRE_SPLITS[0]; i++)
                if (kvs_gguf_str_eq(pre, PRE_SPLITS[i].pre)) split = PRE_SPLITS[i].split;
            cJSON *pt;
            if (split) {
                /* the regex goes in through cJSON, which escapes its backslashes */
                pt = json_obj("{\"type\":\"Sequence\",\"pretokenizers\":[{\"type\":\"Split\",\"pattern\":{},"
                              "\"behavior\":\"Isolated\",\"invert\":false},{\"type\":\"ByteLevel\","
                              "\"add_prefix_space\":false,\"trim_offsets\":true,\"use_regex\":false}]}");
                cJSON *pat = cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(pt, "pretokenizers"), 0),
                                                 "pattern");
                cJSON_AddStringToObject(pat, "Regex", split);
            } else if (digit_split(pre)) {
                pt = json_obj("{\"type\":\"Sequence\",\"pretokenizers\":[{\"type\":\"Digits\","
                              "\"individual_digits\":true},{\"type\":\"ByteLevel\",\"add_prefix_space\":false,"
                              "\"trim_offsets\":true,\"use_regex\":true}]}");
            } else {
                pt = json_obj("{\"type\":\"ByteLevel\",\"add_prefix_space\":false,\"trim_offsets\":true,"
                              "\"use_regex\":true}");
            }
            cJSON_AddItemToObject(root, "pre_tokenizer", pt);
            cJSON_AddItemToObject(root, "decoder", json_obj("{\"type\":\"ByteLevel\",\"add_prefix_space\":true,"
                                                            "\"trim_offsets\":true,\"use_regex\":true}"));
        }
        cJSON *post = cJSON_AddObjectToObject(root, "post_processor");
        cJSON_AddStringToObject(post, "type", "TemplateProcessing");
        cJSON *single = cJSON_AddArrayToObject(post, "single");
        cJSON *specials = cJSON_AddObjectToObject(post, "special_tokens");
        if (add_bos && bos >= 0) {
            cJSON *st = cJSON_CreateObject(), *sp = cJSON_AddObjectToObject(st, "SpecialToken");
            cJSON_AddStringToObject(sp, "id", toks[bos]);
            cJSON_AddNumberToObject(sp, "type_id", 0);
            cJSON_AddItemToArray(single, st);
            cJSON *e = cJSON_AddObjectToObject(specials, toks[bos]);
            cJSON_AddStringToObject(e, "id", toks[bos]);
            cJSON *ids = cJSON_AddArrayToObject(e, "ids");
            cJSON_AddItemToArray(ids, cJSON_CreateNumber((double)bos));
            cJSON *tk = cJSON_AddArrayToObject(e, "tokens");
            cJSON_AddItemToArray(tk, cJSON_CreateString(toks[bos]));
        }
        cJSON *seq = cJSON_CreateObject(), *sq = cJSON_AddObjectToObject(seq, "Sequence");
        cJSON_AddStringToObject(sq, "id", "A");
        cJSON_AddNumberToObject(sq, "type_id", 0);
        cJSON_AddItemToArray(single, seq);
        cJSON *cfg = cJSON_CreateObject();
        if (bos >= 0) cJSON_AddStringToObject(cfg, "bos_token", toks[bos]);
        if (eos >= 0) cJSON_AddStringToObject(cfg, "eos_token", toks[eos]);
        cJSON_AddBoolToObject(cfg, "add_bos_token", add_bos && bos >= 0);
        *tok_json = cJSON_PrintUnformatted(root);
        *cfg_json = cJSON_PrintUnformatted(cfg);
        cJSON_Delete(cfg);
        if (!*tok_json || !*cfg_json) rc = kvs_err(c->err, c->errlen, -ENOMEM, "out of memory");
    }
    cJSON_Delete(root);
    for (uint64_t i = 0; i < tokens->n; i++) free(toks[i]);
    free(toks);
    free(strs);
    return rc;
}

int kvs_tokenizer_from_gguf(const struct kvs_gguf *g, struct kvs_tokenizer **out, char *err, size_t errlen)
{
    *out = NULL;
    struct gctx c = {g, err, errlen};
    char *tj = NULL, *cj = NULL;
    int rc = build(&c, &tj, &cj);
    if (!rc) {
        rc = kvs_tokenizer_load_json(tj, strlen(tj), cj, out, err, errlen);
        if (rc && err && errlen > 0) { /* name the file: the JSON was made from its metadata */
            char tmp[512];
            snprintf(tmp, sizeof tmp, "%s", err);
            snprintf(err, errlen, "%s: tokenizer built from the metadata: %s", g->file, tmp);
        }
    }
    free(tj);
    free(cj);
    return rc;
}

int kvs_tokenizer_load_gguf(const char *path, struct kvs_tokenizer **out, char *err, size_t errlen)
{
    *out = NULL;
    struct kvs_gguf *g;
    int rc = kvs_gguf_open(path, &g, err, errlen);
    if (rc) return rc;
    rc = kvs_tokenizer_from_gguf(g, out, err, errlen);
    kvs_gguf_close(g);
    return rc;
}
