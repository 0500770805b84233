/* kvs-tokenize: command-line access to the tokenizer (build/kvs-tokenize).
 *
 *   kvs-tokenize DIR [--add-special] [--no-parse-special]   each stdin line -> ids
 *   kvs-tokenize DIR --decode [--skip-special]             each stdin line of ids -> text
 *   kvs-tokenize DIR --info                                vocab size, BOS, EOS, add_bos
 *   kvs-tokenize DIR --batch                               the parity tests' protocol:
 *       "E <add_special> <parse_special> <hex utf-8>"  ->  "<id> <id> ..."
 *       "D <skip_special> <id> <id> ..."               ->  "<hex of decode> <1 if streaming
 *                                                          decode gave the same bytes, else 0>"
 * One process handles any number of lines, so tests do not pay a load per line.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/text/tokenizer.h"

static int hexval(int c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static int encode_print(const struct kvs_tokenizer *t, const char *s, size_t n, int add_special, int parse_special,
                        int32_t **ids, int *cap)
{
    int k = kvs_tokenizer_encode(t, s, n, add_special, parse_special, *ids, *cap);
    if (k > *cap) {
        int32_t *p = realloc(*ids, (size_t)k * sizeof *p);
        if (!p) return -ENOMEM;
        *ids = p;
        *cap = k;
        k = kvs_tokenizer_encode(t, s, n, add_special, parse_special, *ids, *cap);
    }
    if (k < 0) return k;
    for (int i = 0; i < k; i++) printf(i ? " %d" : "%d", (*ids)[i]);
    putchar('\n');
    return 0;
}

/* Parses space-separated ints from s into *ids; returns the count or -1. */
static int parse_ids(const char *s, int32_t **ids, int *cap)
{
    int n = 0;
    while (*s) {
        while (*s == ' ') s++;
        if (!*s) break;
        char *end;
        long v = strtol(s, &end, 10);
        if (end == s) return -1;
        if (n == *cap) {
            int c2 = *cap ? *cap * 2 : 256;
            int32_t *p = realloc(*ids, (size_t)c2 * sizeof *p);
            if (!p) return -1;
            *ids = p;
            *cap = c2;
        }
        (*ids)[n++] = (int32_t)v;
        s = end;
    }
    return n;
}

/* Decodes with kvs_tokenizer_decode and with the streaming decoder; 1 if they agree. */
static char *decode_both(const struct kvs_tokenizer *t, const int32_t *ids, int n, int skip, int *stream_ok)
{
    char *full = kvs_tokenizer_decode(t, ids, n, skip);
    if (!full) return NULL;
    size_t cap = strlen(full) + 64, len = 0;
    char *acc = malloc(cap), piece[1024];
    if (!acc) {
        free(full);
        return NULL;
    }
    struct kvs_detok d;
    kvs_detok_init(&d, t, skip);
    int ok = 1;
    for (int i = 0; i <= n && ok; i++) {
        int k = i < n ? kvs_detok_feed(&d, ids[i], piece, sizeof piece) : kvs_detok_flush(&d, piece, sizeof piece);
        if (k < 0 || len + (size_t)k >= cap) {
            ok = 0;
            break;
        }
        /* every piece must be complete UTF-8 on its own: checked by the caller re-decoding hex */
        memcpy(acc + len, piece, (size_t)k);
        len += (size_t)k;
    }
    *stream_ok = ok && len == strlen(full) && memcmp(acc, full, len) == 0;
    free(acc);
    return full;
}

int main(int argc, char **argv)
{
    const char *dir = NULL;
    int add_special = 0, parse_special = 1, decode = 0, skip_special = 0, batch = 0, info = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--add-special")) add_special = 1;
        else if (!strcmp(argv[i], "--no-parse-special")) parse_special = 0;
        else if (!strcmp(argv[i], "--decode")) decode = 1;
        else if (!strcmp(argv[i], "--skip-special")) skip_special = 1;
        else if (!strcmp(argv[i], "--batch")) batch = 1;
        else if (!strcmp(argv[i], "--info")) info = 1;
        else if (argv[i][0] != '-' && !dir) dir = argv[i];
        else {
            fprintf(stderr, "kvs-tokenize: unknown argument '%s'\n", argv[i]);
            dir = NULL;
            break;
        }
    }
    if (!dir) {
        fprintf(stderr, "usage: kvs-tokenize MODEL_DIR [--add-special] [--no-parse-special] [--decode [--skip-special]] "
                        "[--info] [--batch]\n");
        return 2;
    }
    char err[512];
    struct kvs_tokenizer *t;
    int rc = kvs_tokenizer_load(dir, &t, err, sizeof err);
    if (rc) {
        fprintf(stderr, "kvs-tokenize: %s\n", err);
        return 1;
    }
    if (info) {
        const int32_t *eos;
        int ne = kvs_tokenizer_eos(t, &eos);
        printf("vocab_size %d\nbos %d\nadd_bos_default %d\neos", kvs_tokenizer_vocab_size(t), kvs_tokenizer_bos(t),
               kvs_tokenizer_add_bos_default(t));
        for (int i = 0; i < ne; i++) printf(" %d", eos[i]);
        printf("\n");
        kvs_tokenizer_free(t);
        return 0;
    }
    char *line = NULL;
    size_t lcap = 0;
    ssize_t n;
    int32_t *ids = NULL;
    int icap = 0;
    char *bytes = NULL;
    size_t bcap = 0;
    rc = 0;
    while (rc == 0 && (n = getline(&line, &lcap, stdin)) >= 0) {
        if (n > 0 && line[n - 1] == '\n') line[--n] = 0;
        if (!batch) {
            if (decode) {
                int k = parse_ids(line, &ids, &icap);
                char *s = k < 0 ? NULL : kvs_tokenizer_decode(t, ids, k, skip_special);
                if (!s) {
                    fprintf(stderr, "kvs-tokenize: bad id list\n");
                    rc = 1;
                    break;
                }
                printf("%s\n", s);
                free(s);
            } else if ((rc = encode_print(t, line, (size_t)n, add_special, parse_special, &ids, &icap))) {
                fprintf(stderr, "kvs-tokenize: encode failed: %s\n", strerror(-rc));
            }
            continue;
        }
        if (line[0] == 'E' && n >= 6) {
            int as = line[2] == '1', ps = line[4] == '1';
            const char *h = line + 6;
            size_t hl = strlen(h);
            if (hl / 2 + 1 > bcap) {
                bcap = hl / 2 + 1;
                char *p = realloc(bytes, bcap);
                if (!p) {
                    rc = 1;
                    break;
                }
                bytes = p;
            }
            size_t bl = 0;
            for (size_t j = 0; j + 1 < hl; j += 2) {
                int a = hexval(h[j]), b = hexval(h[j + 1]);
                if (a < 0 || b < 0) break;
                bytes[bl++] = (char)(a * 16 + b);
            }
            if ((rc = encode_print(t, bytes ? bytes : "", bl, as, ps, &ids, &icap)))
                fprintf(stderr, "kvs-tokenize: encode failed: %s\n", strerror(-rc));
        } else if (line[0] == 'D' && n >= 3) {
            int skip = line[2] == '1';
            int k = parse_ids(line + 3, &ids, &icap), ok = 0;
            char *s = k < 0 ? NULL : decode_both(t, ids, k, skip, &ok);
            if (!s) {
                fprintf(stderr, "kvs-tokenize: bad decode line\n");
                rc = 1;
                break;
            }
            for (const char *p = s; *p; p++) printf("%02x", (unsigned char)*p);
            printf(" %d\n", ok);
            free(s);
        } else {
            fprintf(stderr, "kvs-tokenize: bad batch line (want E or D)\n");
            rc = 1;
        }
        fflush(stdout);
    }
    free(line);
    free(ids);
    free(bytes);
    kvs_tokenizer_free(t);
    return rc ? 1 : 0;
}
