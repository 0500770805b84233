/* test_tokenizer: unit tests for engine/text/tokenizer.h.
 *
 * 1. Tiny hand-written tokenizer.json files whose ids are worked out by hand (byte-level BPE
 *    with both merge formats, SentencePiece-style with byte fallback, TemplateProcessing, added
 *    tokens, BOS/EOS from configs).
 * 2. Malformed files: every one must fail with a message naming the field, never crash.
 * 3. The real Qwen3 / Llama-3 / Llama-2 files (unpacked from $KVS_TOKENIZERS, CONTRIBUTING.md):
 *    reference ids from Hugging Face tokenizers for a few strings, and streaming decode of
 *    multilingual text with emoji: every piece is complete UTF-8 and the pieces concatenate to
 *    the full decode, which equals the input.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/text/tokenizer.h"
#include "tests/unit/test_util.h"


static int utf8_complete(const char *s, size_t n)
{
    size_t i = 0;
    while (i < n) {
        unsigned char c = (unsigned char)s[i];
        int k = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
        if (!k || i + (size_t)k > n) return 0;
        for (int j = 1; j < k; j++)
            if (((unsigned char)s[i + j] & 0xC0) != 0x80) return 0;
        i += (size_t)k;
    }
    return 1;
}

static int ids_eq(const int32_t *a, int na, const int32_t *b, int nb)
{
    return na == nb && (na == 0 || memcmp(a, b, (size_t)na * sizeof *a) == 0);
}

static void print_ids(const char *tag, const int32_t *a, int n)
{
    fprintf(stderr, "  %s:", tag);
    for (int i = 0; i < n; i++) fprintf(stderr, " %d", a[i]);
    fprintf(stderr, "\n");
}

static void expect_encode(const struct kvs_tokenizer *t, const char *text, int add, int parse, const int32_t *want, int nwant)
{
    int32_t got[256];
    int n = kvs_tokenizer_encode(t, text, strlen(text), add, parse, got, 256);
    CHECK(ids_eq(got, n, want, nwant), "encode(\"%s\", add=%d, parse=%d)", text, add, parse);
    if (!ids_eq(got, n, want, nwant)) {
        print_ids("got ", got, n < 0 ? 0 : n);
        print_ids("want", want, nwant);
    }
}

/* Streams ids through kvs_detok one at a time; checks pieces and returns the concatenation. */
static char *stream_decode(const struct kvs_tokenizer *t, const int32_t *ids, int n, int skip)
{
    struct kvs_detok d;
    kvs_detok_init(&d, t, skip);
    size_t cap = 1 << 16, len = 0;
    char *acc = malloc(cap), piece[256];
    if (!acc) return NULL;
    acc[0] = 0;
    for (int i = 0; i <= n; i++) {
        int k = i < n ? kvs_detok_feed(&d, ids[i], piece, sizeof piece) : kvs_detok_flush(&d, piece, sizeof piece);
        CHECK(k >= 0, "detok feed returned %d", k);
        if (k < 0) break;
        CHECK(utf8_complete(piece, (size_t)k), "piece %d is not complete UTF-8", i);
        CHECK(strlen(piece) == (size_t)k, "piece length");
        if (len + (size_t)k + 1 > cap) break;
        memcpy(acc + len, piece, (size_t)k + 1);
        len += (size_t)k;
    }
    return acc;
}

/* ---- tiny tokenizers ---- */

static const char *BYTE_LEVEL_JSON =
    "{\"version\":\"1.0\",\"added_tokens\":[{\"id\":7,\"content\":\"<|x|>\",\"special\":true,\"lstrip\":false,"
    "\"rstrip\":false,\"normalized\":false,\"single_word\":false},{\"id\":8,\"content\":\"<t>\",\"special\":false,"
    "\"normalized\":false}],"
    "\"normalizer\":null,\"pre_tokenizer\":{\"type\":\"ByteLevel\",\"add_prefix_space\":false,\"use_regex\":true},"
    "\"post_processor\":{\"type\":\"Sequence\",\"processors\":[{\"type\":\"ByteLevel\"},{\"type\":\"TemplateProcessing\","
    "\"single\":[{\"SpecialToken\":{\"id\":\"<|x|>\",\"type_id\":0}},{\"Sequence\":{\"id\":\"A\",\"type_id\":0}}],"
    "\"special_tokens\":{\"<|x|>\":{\"id\":\"<|x|>\",\"ids\":[7],\"tokens\":[\"<|x|>\"]}}}]},"
    "\"decoder\":{\"type\":\"ByteLevel\"},"
    "\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"b\":1,\"c\":2,\"\\u0120\":3,\"ab\":4,\"abc\":5,\"\\u0120a\":6},"
    "\"merges\":[\"a b\",[\"ab\",\"c\"],\"\\u0120 a\"]}}";

static void test_byte_level_tiny(void)
{
    struct kvs_tokenizer *t;
    char err[256];
    int rc = kvs_tokenizer_load_json(BYTE_LEVEL_JSON, strlen(BYTE_LEVEL_JSON),
                                     "{\"bos_token\":{\"content\":\"<|x|>\"},\"eos_token\":\"<t>\"}", &t, err, sizeof err);
    CHECK(rc == 0, "load tiny byte-level: %s", err);
    if (rc) return;
    /* "abc" merges fully; " ab": (a,b) has rank 0 < (Ġ,a) rank 2, so Ġ + ab */
    expect_encode(t, "abc ab", 0, 1, (int32_t[]){5, 3, 4}, 3);
    /* BOS from TemplateProcessing inside a Sequence */
    expect_encode(t, "abc ab", 1, 1, (int32_t[]){7, 5, 3, 4}, 4);
    /* special token matched only with parse_special; unknown bytes (no unk) are dropped */
    expect_encode(t, "ab<|x|>c", 0, 1, (int32_t[]){4, 7, 2}, 3);
    expect_encode(t, "ab<|x|>c", 0, 0, (int32_t[]){4, 2}, 2);
    /* non-special added tokens are matched either way */
    expect_encode(t, "a<t>b", 0, 0, (int32_t[]){0, 8, 1}, 3);
    CHECK(kvs_tokenizer_bos(t) == 7, "bos from {content:...}");
    CHECK(kvs_tokenizer_add_bos_default(t) == 1, "post-processor adds BOS");
    const int32_t *eos;
    CHECK(kvs_tokenizer_eos(t, &eos) == 1 && eos[0] == 8, "eos from string");
    CHECK(kvs_tokenizer_is_special(t, 7) && !kvs_tokenizer_is_special(t, 8), "special flags");
    CHECK(kvs_tokenizer_token_id(t, "\xc4\xa0" "a") == 6 && kvs_tokenizer_token_id(t, "zz") == -1, "token_id");
    CHECK(kvs_tokenizer_vocab_size(t) == 9, "vocab size");
    /* cap smaller than the count: the full count comes back, only cap ids written */
    int32_t two[2] = {-1, -1};
    CHECK(kvs_tokenizer_encode(t, "abc ab", 6, 1, 1, two, 1) == 4 && two[0] == 7 && two[1] == -1, "cap");
    char *s = kvs_tokenizer_decode(t, (int32_t[]){7, 5, 3, 4, 8}, 5, 0);
    CHECK(s && !strcmp(s, "<|x|>abc ab<t>"), "decode: %s", s ? s : "(null)");
    free(s);
    s = kvs_tokenizer_decode(t, (int32_t[]){7, 5, 3, 4, 8, 99, -4}, 7, 1);
    CHECK(s && !strcmp(s, "abc ab<t>"), "decode skip_special, bad ids dropped: %s", s ? s : "(null)");
    free(s);
    kvs_tokenizer_free(t);
}

static const char *SP_JSON =
    "{\"added_tokens\":[{\"id\":0,\"content\":\"<unk>\",\"special\":true,\"normalized\":false},{\"id\":1,\"content\":"
    "\"<s>\",\"special\":true,\"normalized\":false},{\"id\":2,\"content\":\"</s>\",\"special\":true,\"normalized\":false}],"
    "\"normalizer\":{\"type\":\"Sequence\",\"normalizers\":[{\"type\":\"Prepend\",\"prepend\":\"\\u2581\"},{\"type\":"
    "\"Replace\",\"pattern\":{\"String\":\" \"},\"content\":\"\\u2581\"}]},\"pre_tokenizer\":null,"
    "\"post_processor\":{\"type\":\"TemplateProcessing\",\"single\":[{\"SpecialToken\":{\"id\":\"<s>\",\"type_id\":0}},"
    "{\"Sequence\":{\"id\":\"A\",\"type_id\":0}}],\"special_tokens\":{\"<s>\":{\"id\":\"<s>\",\"ids\":[1],\"tokens\":"
    "[\"<s>\"]}}},\"decoder\":{\"type\":\"Sequence\",\"decoders\":[{\"type\":\"Replace\",\"pattern\":{\"String\":"
    "\"\\u2581\"},\"content\":\" \"},{\"type\":\"ByteFallback\"},{\"type\":\"Fuse\"},{\"type\":\"Strip\",\"content\":\" \","
    "\"start\":1,\"stop\":0}]},"
    "\"model\":{\"type\":\"BPE\",\"unk_token\":\"<unk>\",\"fuse_unk\":true,\"byte_fallback\":true,\"vocab\":{\"<unk>\":0,"
    "\"<s>\":1,\"</s>\":2,\"<0xC3>\":3,\"<0xA9>\":4,\"\\u2581\":5,\"h\":6,\"i\":7,\"\\u2581h\":8,\"\\u2581hi\":9},"
    "\"merges\":[\"\\u2581 h\",\"\\u2581h i\"]}}";

static void test_sentencepiece_tiny(void)
{
    struct kvs_tokenizer *t;
    char err[256];
    int rc = kvs_tokenizer_load_json(SP_JSON, strlen(SP_JSON), "{\"add_bos_token\":true,\"bos_token\":\"<s>\","
                                     "\"eos_token\":{\"content\":\"</s>\"}}", &t, err, sizeof err);
    CHECK(rc == 0, "load tiny sentencepiece: %s", err);
    if (rc) return;
    /* "▁hi▁hé": leftmost (▁,h) first, then the second (▁,h), then (▁h,i); é -> <0xC3><0xA9> */
    expect_encode(t, "hi hé", 1, 1, (int32_t[]){1, 9, 8, 3, 4}, 5);
    /* x has no token and no byte token: fused into one <unk> */
    expect_encode(t, "hxx", 0, 1, (int32_t[]){8, 0}, 2);
    /* the normalizer runs per segment between added tokens: Prepend again after <s> */
    expect_encode(t, "h<s>h", 0, 1, (int32_t[]){8, 1, 8}, 3);
    expect_encode(t, "", 1, 1, (int32_t[]){1}, 1);
    char *s = kvs_tokenizer_decode(t, (int32_t[]){1, 9, 8, 3, 4}, 5, 1);
    CHECK(s && !strcmp(s, "hi hé"), "sp decode: %s", s ? s : "(null)");
    free(s);
    s = kvs_tokenizer_decode(t, (int32_t[]){1, 9}, 2, 0);
    CHECK(s && !strcmp(s, "<s> hi"), "sp decode keeps <s>: %s", s ? s : "(null)");
    free(s);
    /* streaming: é completes only with its second byte token; a dangling byte flushes as U+FFFD */
    struct kvs_detok d;
    char out[64];
    kvs_detok_init(&d, t, 1);
    CHECK(kvs_detok_feed(&d, 9, out, sizeof out) == 2 && !strcmp(out, "hi"), "stream hi: '%s'", out);
    CHECK(kvs_detok_feed(&d, 5, out, sizeof out) == 1 && !strcmp(out, " "), "stream space");
    CHECK(kvs_detok_feed(&d, 3, out, sizeof out) == 0, "stream first byte held");
    CHECK(kvs_detok_feed(&d, 4, out, sizeof out) == 2 && !strcmp(out, "é"), "stream é");
    CHECK(kvs_detok_feed(&d, 3, out, sizeof out) == 0, "stream dangling byte held");
    CHECK(kvs_detok_feed(&d, 6, out, 3) == -ENOSPC, "ENOSPC when the buffer is too small");
    CHECK(kvs_detok_feed(&d, 6, out, sizeof out) == 4 && !strcmp(out, "\xef\xbf\xbdh"), "dangling byte -> U+FFFD");
    CHECK(kvs_detok_flush(&d, out, sizeof out) == 0, "nothing left");
    CHECK(kvs_tokenizer_add_bos_default(t) == 1 && kvs_tokenizer_bos(t) == 1, "bos");
    kvs_tokenizer_free(t);
}

/* ---- malformed input ---- */

static void test_malformed(void)
{
    struct {
        const char *json, *field;
    } cases[] = {
        {"", "not valid JSON"},
        {"{", "not valid JSON"},
        {"[]", "not a JSON object"},
        {"{}", "model"},
        {"{\"model\":{\"type\":\"WordPiece\",\"vocab\":{}}}", "model.type"},
        {"{\"model\":{\"type\":\"BPE\",\"vocab\":[]}}", "model.vocab"},
        {"{\"model\":{\"type\":\"BPE\",\"vocab\":{}}}", "model.vocab"},
        {"{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":\"x\"}}}", "model.vocab[0]"},
        {"{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":-1}}}", "model.vocab[0]"},
        {"{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":1e12}}}", "model.vocab[0]"},
        {"{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0.5}}}", "model.vocab[0]"},
        {"{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"b\":0}}}", "used twice"},
        {"{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":{}}}", "model.merges"},
        {"{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[\"a\"]}}", "model.merges[0]"},
        {"{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[\"a a\"]}}", "model.merges[0]"},
        {"{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[[\"a\"]]}}", "model.merges[0]"},
        {"{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[[1,2]]}}", "model.merges[0]"},
        {"{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"unk_token\":\"<unk>\"}}", "model.unk_token"},
        {"{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"byte_fallback\":\"yes\"}}", "model.byte_fallback"},
        {"{\"model\":{\"vocab\":{\"a\":0}},\"added_tokens\":{}}", "added_tokens"},
        {"{\"model\":{\"vocab\":{\"a\":0}},\"added_tokens\":[{\"id\":1}]}", "added_tokens[0].content"},
        {"{\"model\":{\"vocab\":{\"a\":0}},\"added_tokens\":[{\"content\":\"x\"}]}", "added_tokens[0].id"},
        {"{\"model\":{\"vocab\":{\"a\":0}},\"added_tokens\":[{\"id\":0,\"content\":\"b\"}]}", "added_tokens[0]"},
        {"{\"model\":{\"vocab\":{\"a\":0}},\"normalizer\":{\"type\":\"Lowercase\"}}", "normalizer.type"},
        {"{\"model\":{\"vocab\":{\"a\":0}},\"normalizer\":{\"type\":\"Sequence\",\"normalizers\":[{\"type\":\"NFC\"},{}]}}",
         "normalizer.normalizers[1].type"},
        {"{\"model\":{\"vocab\":{\"a\":0}},\"normalizer\":{\"type\":\"Replace\",\"pattern\":{\"String\":\"a\"}}}",
         "normalizer.content"},
        {"{\"model\":{\"vocab\":{\"a\":0}},\"pre_tokenizer\":{\"type\":\"Split\",\"pattern\":{\"Regex\":\"(\"},"
         "\"behavior\":\"Isolated\"}}",
         "pre_tokenizer.pattern"},
        {"{\"model\":{\"vocab\":{\"a\":0}},\"pre_tokenizer\":{\"type\":\"Split\",\"pattern\":{\"Regex\":\"a\"},"
         "\"behavior\":\"Sideways\"}}",
         "pre_tokenizer.behavior"},
        {"{\"model\":{\"vocab\":{\"a\":0}},\"pre_tokenizer\":{\"type\":\"Sequence\",\"pretokenizers\":[{\"type\":"
         "\"Whitespace\"}]}}",
         "pre_tokenizer.pretokenizers[0].type"},
        {"{\"model\":{\"vocab\":{\"a\":0}},\"decoder\":{\"type\":\"WordPiece\"}}", "decoder.type"},
        {"{\"model\":{\"vocab\":{\"a\":0}},\"decoder\":{\"type\":\"Strip\",\"content\":\" \",\"start\":1,\"stop\":1}}",
         "decoder"},
        {"{\"model\":{\"vocab\":{\"a\":0}},\"post_processor\":{\"type\":\"TemplateProcessing\",\"single\":[{\"SpecialToken\""
         ":{\"id\":\"<s>\"}}],\"special_tokens\":{}}}",
         "special_tokens"},
        {"{\"model\":{\"vocab\":{\"a\":0}},\"post_processor\":{\"type\":\"TemplateProcessing\",\"single\":[{\"SpecialToken\""
         ":{\"id\":\"<s>\"}}],\"special_tokens\":{\"<s>\":{\"ids\":[5]}}}}",
         "post_processor"},
        {"{\"model\":{\"vocab\":{\"a\":0}},\"post_processor\":{\"type\":\"Magic\"}}", "post_processor.type"},
        {"{\"model\":{\"vocab\":{\"a\\u0000\":0}}}", NULL},
    };
    int n = (int)(sizeof cases / sizeof cases[0]);
    for (int i = 0; i < n; i++) {
        struct kvs_tokenizer *t = NULL;
        char err[256] = "";
        int rc = kvs_tokenizer_load_json(cases[i].json, strlen(cases[i].json), NULL, &t, err, sizeof err);
        if (!cases[i].field) { /* only: must not crash; if it loads, it must work */
            if (rc == 0) {
                int32_t ids[8];
                CHECK(kvs_tokenizer_encode(t, "a", 1, 1, 1, ids, 8) >= 0, "encode after odd load");
                kvs_tokenizer_free(t);
            }
            continue;
        }
        CHECK(rc < 0 && t == NULL, "case %d must fail: %s", i, cases[i].json);
        CHECK(strstr(err, cases[i].field) != NULL, "case %d: message '%s' should name '%s'", i, err, cases[i].field);
        kvs_tokenizer_free(t);
    }
    /* bad config texts name the file */
    struct kvs_tokenizer *t = NULL;
    char err[256] = "";
    const char *ok = "{\"model\":{\"vocab\":{\"a\":0}}}";
    CHECK(kvs_tokenizer_load_json(ok, strlen(ok), "[1]", &t, err, sizeof err) < 0 && strstr(err, "tokenizer_config.json"),
          "bad tokenizer_config: %s", err);
    /* a missing directory is an error, not a crash */
    CHECK(kvs_tokenizer_load("/nonexistent/dir", &t, err, sizeof err) < 0 && t == NULL, "missing dir");
    printf("malformed: %d cases rejected with the field named\n", n - 1);
}

/* ---- real tokenizers ---- */

static const char *MULTI =
    "Hello, world! Привет мир. Καλημέρα. 你好，世界！日本語テキスト 한국어 مرحبا नमस्ते สวัสดี "
    "emoji: 😀 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 🇫🇷 1️⃣ 🧑🏻‍🤝‍🧑🏾 — ok?\n\tcode: if (x != 0) { y = x*2; }\r\n"
    "numbers 1234567 3.14159 and ſ's, I'LL, we're.  Ω≈ç√∫ ☕ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \xef\xbf\xbd done";

struct ref {
    const char *name, *text;
    int add;
    int32_t ids[16];
    int n;
};

static void test_real(void)
{
    char tmp[512];
    if (kvs_test_mkdtemp(tmp, sizeof tmp, "kvs_tok") != 0) {
        CHECK(0, "mkdtemp");
        return;
    }
    /* reference ids from Hugging Face tokenizers 0.22.1 (Tokenizer.from_file(...).encode) */
    static const struct ref refs[] = {
        {"qwen3", "Hello world, this is a test!", 0, {9707, 1879, 11, 419, 374, 264, 1273, 0}, 8},
        {"qwen3", "你好 😀 123456", 0, {108386, 90316, 220, 16, 17, 18, 19, 20, 21}, 9},
        {"llama3", "你好 😀 123456", 0, {57668, 53901, 91416, 220, 4513, 10961}, 6},
        {"llama3", "<|im_start|>user", 0, {27, 91, 318, 5011, 91, 29, 882}, 7},
        {"llama2", "Hello world, this is a test!", 1, {1, 22557, 1526, 28725, 456, 349, 264, 1369, 28808}, 9},
        {"llama2", "你好 😀 123456", 1, {1, 28705, 29383, 29530, 28705, 30575, 28705, 28740, 28750, 28770, 28781, 28782, 28784}, 13},
    };
    const char *names[3] = {"qwen3", "llama3", "llama2"};
    for (int k = 0; k < 3; k++) {
        if (kvs_test_tokenizer_skip(names[k])) continue;
        if (kvs_test_unpack_tokenizer(names[k], tmp, NULL) != 0) {
            CHECK(0, "cannot unpack %s.tar.xz from %s", names[k], kvs_test_tokenizer_places);
            continue;
        }
        char dir[1200], err[512];
        snprintf(dir, sizeof dir, "%s/%s", tmp, names[k]);
        struct kvs_tokenizer *t;
        int rc = kvs_tokenizer_load(dir, &t, err, sizeof err);
        CHECK(rc == 0, "load %s: %s", names[k], err);
        if (rc) continue;
        for (size_t r = 0; r < sizeof refs / sizeof refs[0]; r++)
            if (!strcmp(refs[r].name, names[k])) expect_encode(t, refs[r].text, refs[r].add, 1, refs[r].ids, refs[r].n);
        int32_t *ids = malloc(4096 * sizeof *ids);
        int n = kvs_tokenizer_encode(t, MULTI, strlen(MULTI), 0, 0, ids, 4096);
        CHECK(n > 0 && n <= 4096, "encode multilingual");
        if (n > 0 && n <= 4096) {
            char *full = kvs_tokenizer_decode(t, ids, n, 0);
            char *streamed = stream_decode(t, ids, n, 0);
            CHECK(full && !strcmp(full, MULTI), "%s: decode(encode(x)) == x", names[k]);
            CHECK(full && streamed && !strcmp(full, streamed), "%s: streamed == full", names[k]);
            /* byte-at-a-time tokens: feed ids in every split and check again with skip_special */
            free(full);
            free(streamed);
            printf("%s: %d tokens, decode and streaming decode round-trip the multilingual text\n", names[k], n);
        }
        free(ids);
        const int32_t *eos;
        int ne = kvs_tokenizer_eos(t, &eos);
        CHECK(ne >= 1, "%s has an EOS", names[k]);
        if (!strcmp(names[k], "qwen3")) CHECK(kvs_tokenizer_bos(t) == -1 && eos[0] == 151645, "qwen3 bos/eos");
        if (!strcmp(names[k], "llama3")) CHECK(kvs_tokenizer_bos(t) == 128000 && eos[0] == 128001, "llama3 bos/eos");
        if (!strcmp(names[k], "llama2")) CHECK(kvs_tokenizer_bos(t) == 1 && eos[0] == 2 && kvs_tokenizer_add_bos_default(t),
                                               "llama2 bos/eos");
        kvs_tokenizer_free(t);
    }
    if (kvs_test_rmtree(tmp) != 0) fprintf(stderr, "warning: could not remove %s\n", tmp);
}

int main(void)
{
    test_byte_level_tiny();
    test_sentencepiece_tiny();
    test_malformed();
    test_real();
    return kvs_test_summary("test_tokenizer");
}
