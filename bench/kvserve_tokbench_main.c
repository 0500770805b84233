/* kvserve-tokbench: tokenizer encode/decode throughput on one core (build/kvserve-tokbench).
 *
 *   kvserve-tokbench MODEL_DIR [TEXT_FILE] [--mb N] [--dump FILE]
 *
 * Without TEXT_FILE it generates N MB (default 8) of deterministic English-like prose
 * (common words, punctuation, numbers, paragraphs); --dump writes that text out so a peer
 * (scripts/tokbench runs Hugging Face tokenizers) can be timed on exactly the same bytes.
 * Encodes paragraph by paragraph (the size of a prompt), then decodes the ids, and prints a
 * table: MB/s, tokens/s, bytes/token. A benchmark, never a test: it has no time limit.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/text/tokenizer.h"
#include "base/util.h"

static const char *WORDS[] = {
    "the", "of", "and", "to", "in", "is", "was", "that", "for", "it", "with", "as", "on", "be", "at", "by", "this",
    "had", "not", "are", "but", "from", "or", "have", "an", "they", "which", "one", "you", "were", "her", "all", "she",
    "there", "would", "their", "we", "him", "been", "has", "when", "who", "will", "more", "no", "if", "out", "so",
    "said", "what", "up", "its", "about", "into", "than", "them", "can", "only", "other", "new", "some", "could",
    "time", "these", "two", "may", "then", "do", "first", "any", "my", "now", "such", "like", "our", "over", "man",
    "me", "even", "most", "made", "after", "also", "did", "many", "before", "must", "through", "back", "years",
    "where", "much", "your", "way", "well", "down", "should", "because", "each", "just", "those", "people", "how",
    "too", "little", "state", "good", "very", "make", "world", "still", "own", "see", "men", "work", "long", "get",
    "here", "between", "both", "life", "being", "under", "never", "day", "same", "another", "know", "while", "last",
    "might", "us", "great", "old", "year", "off", "come", "since", "against", "go", "came", "right", "used", "take",
    "three", "government", "information", "university", "development", "performance", "understanding", "tokenizer",
    "throughput", "benchmark", "continuous", "batching", "attention", "memory", "bandwidth", "don't", "it's",
    "we're", "they've", "I'm", "Hello", "However", "Therefore", "Meanwhile", "Python", "GPU", "HTTP", "JSON"};

static char *make_text(size_t bytes)
{
    char *s = malloc(bytes + 64);
    if (!s) return NULL;
    size_t n = 0;
    uint64_t x = 88172645463325252ull;
    int words_in_sentence = 0, sentences = 0;
    while (n < bytes) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        const char *w = WORDS[x % (sizeof WORDS / sizeof WORDS[0])];
        char tmp[64];
        int k;
        if ((x >> 20) % 29 == 0) k = snprintf(tmp, sizeof tmp, "%u", (unsigned)((x >> 24) % 100000));
        else k = snprintf(tmp, sizeof tmp, "%s", w);
        if (words_in_sentence == 0 && tmp[0] >= 'a' && tmp[0] <= 'z') tmp[0] = (char)(tmp[0] - 32);
        memcpy(s + n, tmp, (size_t)k);
        n += (size_t)k;
        words_in_sentence++;
        if (words_in_sentence > 6 && (x >> 40) % 9 == 0) {
            s[n++] = (x >> 50) % 5 == 0 ? '?' : '.';
            words_in_sentence = 0;
            if (++sentences % 6 == 0) {
                s[n++] = '\n';
                s[n++] = '\n';
                continue;
            }
        } else if ((x >> 33) % 13 == 0) {
            s[n++] = ',';
        }
        s[n++] = ' ';
    }
    s[n] = 0;
    return s;
}

int main(int argc, char **argv)
{
    const char *dir = NULL, *file = NULL, *dump = NULL;
    double mb = 8;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--mb") && i + 1 < argc) mb = atof(argv[++i]);
        else if (!strcmp(argv[i], "--dump") && i + 1 < argc) dump = argv[++i];
        else if (!dir) dir = argv[i];
        else if (!file) file = argv[i];
        else dir = NULL;
    }
    if (!dir || mb <= 0 || mb > 4096) {
        fprintf(stderr, "usage: kvserve-tokbench MODEL_DIR [TEXT_FILE] [--mb N] [--dump FILE]\n");
        return 2;
    }
    char err[512];
    struct kvs_tokenizer *t;
    double t0 = kvs_now();
    if (kvs_tokenizer_load(dir, &t, err, sizeof err) != 0) {
        fprintf(stderr, "kvserve-tokbench: %s\n", err);
        return 1;
    }
    double t_load = kvs_now() - t0;
    size_t len = 0;
    char *text = file ? kvs_read_file(file, &len, err, sizeof err) : make_text((size_t)(mb * 1e6));
    if (!text) {
        fprintf(stderr, "kvserve-tokbench: %s\n", file ? err : "out of memory");
        kvs_tokenizer_free(t);
        return 1;
    }
    if (!file) len = strlen(text);
    if (dump) {
        FILE *f = fopen(dump, "wb");
        if (!f || fwrite(text, 1, len, f) != len || fclose(f) != 0) {
            fprintf(stderr, "kvserve-tokbench: cannot write %s\n", dump);
            return 1;
        }
    }
    /* paragraphs: split at blank lines, like separate prompts */
    size_t cap = len / 2 + 1024, total = 0;
    int32_t *ids = malloc(cap * sizeof *ids);
    size_t *para_tok = malloc((len / 2 + 2) * sizeof *para_tok), *para_byte = malloc((len / 2 + 2) * sizeof *para_byte);
    size_t n_para = 0;
    if (!ids || !para_tok || !para_byte) return 1;
    t0 = kvs_now();
    size_t a = 0;
    while (a < len) {
        const char *e = strstr(text + a, "\n\n");
        size_t b = e ? (size_t)(e - text) + 2 : len;
        int k = kvs_tokenizer_encode(t, text + a, b - a, 0, 1, ids + total, (int)(cap - total));
        if (k < 0 || total + (size_t)k > cap) {
            fprintf(stderr, "kvserve-tokbench: encode failed (%d)\n", k);
            return 1;
        }
        para_tok[n_para] = total;
        para_byte[n_para++] = a;
        total += (size_t)k;
        a = b;
    }
    double t_enc = kvs_now() - t0;
    /* decode paragraph by paragraph, as encoded (SentencePiece adds "▁" to each) */
    para_tok[n_para] = total;
    para_byte[n_para] = len;
    int same = 1;
    t0 = kvs_now();
    for (size_t p = 0; p < n_para; p++) {
        char *dec = kvs_tokenizer_decode(t, ids + para_tok[p], (int)(para_tok[p + 1] - para_tok[p]), 0);
        size_t bl = para_byte[p + 1] - para_byte[p];
        same = same && dec && strlen(dec) == bl && memcmp(dec, text + para_byte[p], bl) == 0;
        free(dec);
    }
    double t_dec = kvs_now() - t0;
    printf("tokenizer %s  text %s (%.2f MB)  load %.2f s\n", dir, file ? file : "generated English", len / 1e6, t_load);
    printf("%-8s %10s %12s %12s %10s\n", "op", "MB/s", "tokens/s", "bytes/token", "seconds");
    printf("%-8s %10.2f %12.0f %12.2f %10.3f\n", "encode", len / 1e6 / t_enc, total / t_enc, (double)len / total, t_enc);
    printf("%-8s %10.2f %12.0f %12.2f %10.3f\n", "decode", len / 1e6 / t_dec, total / t_dec, (double)len / total, t_dec);
    printf("round trip %s\n", same ? "exact" : "DIFFERS");
    free(ids);
    free(para_tok);
    free(para_byte);
    free(text);
    kvs_tokenizer_free(t);
    return same ? 0 : 1;
}
