/* tokenizer_alloc.c: kvs_tokenizer_encode_alloc (tokenizer.h), on top of kvs_tokenizer_encode
 * only (the public entry point, nothing of the tokenizer's internals). */
#include "engine/text/tokenizer.h"

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int kvs_tokenizer_encode_alloc(const struct kvs_tokenizer *t, const char *text, int add_special, int parse_special,
                               int32_t **out)
{
    size_t len = strlen(text);
    if (len > (size_t)INT32_MAX / 2) return -E2BIG;
    int cap = (int)len + 8;
    int32_t *ids = malloc(sizeof *ids * (size_t)cap);
    if (!ids) return -ENOMEM;
    int n = kvs_tokenizer_encode(t, text, len, add_special, parse_special, ids, cap);
    if (n > cap) {
        int32_t *bigger = realloc(ids, sizeof *ids * (size_t)n);
        if (!bigger) {
            free(ids);
            return -ENOMEM;
        }
        ids = bigger;
        cap = n;
        n = kvs_tokenizer_encode(t, text, len, add_special, parse_special, ids, cap);
    }
    if (n < 0 || n > cap) {
        free(ids);
        return n < 0 ? n : -EIO;
    }
    *out = ids;
    return n;
}
