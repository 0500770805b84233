/* json_strict.c: strict JSON byte rules and last-wins duplicate keys (see json_strict.h). */
#include "server/json_strict.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Length of the valid UTF-8 sequence at s[0..n), or 0. */
static size_t utf8_seq(const unsigned char *s, size_t n)
{
    unsigned c = s[0];
    if (c < 0x80) return 1;
    size_t len;
    uint32_t cp, min;
    if (c >= 0xC2 && c <= 0xDF) len = 2, cp = c & 0x1F, min = 0x80;
    else if (c >= 0xE0 && c <= 0xEF) len = 3, cp = c & 0x0F, min = 0x800;
    else if (c >= 0xF0 && c <= 0xF4) len = 4, cp = c & 0x07, min = 0x10000;
    else return 0;
    if (n < len) return 0;
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xC0) != 0x80) return 0;
        cp = cp << 6 | (s[i] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
    return len;
}

int kvs_json_check_bytes(const char *body, size_t len, char *msg, size_t msglen)
{
    const unsigned char *b = (const unsigned char *)body;
    int in_str = 0;
    for (size_t i = 0; i < len;) {
        unsigned c = b[i];
        if (c == 0) {
            snprintf(msg, msglen, "request body contains a NUL byte at offset %zu (not allowed in JSON)", i);
            return -EINVAL;
        }
        if (c < 0x20 && (in_str || (c != '\t' && c != '\n' && c != '\r'))) {
            snprintf(msg, msglen, "request body contains the raw control character 0x%02x at offset %zu "
                                  "(escape it in strings, e.g. \\n or \\u%04x)", c, i, c);
            return -EINVAL;
        }
        if (c >= 0x80) {
            size_t k = utf8_seq(b + i, len - i);
            if (!k) {
                snprintf(msg, msglen, "request body is not valid UTF-8 (byte 0x%02x at offset %zu)", c, i);
                return -EINVAL;
            }
            i += k;
            continue;
        }
        if (c == '"') in_str = !in_str;
        else if (c == '\\' && in_str) i++;   /* the escaped character never ends or starts a string */
        i++;
    }
    return 0;
}

struct key_at {
    const char *key;
    size_t index;
};

static int by_key_then_index(const void *a, const void *b)
{
    const struct key_at *x = a, *y = b;
    int c = strcmp(x->key, y->key);
    if (c) return c;
    return x->index < y->index ? -1 : x->index > y->index;
}

/* Drops every member of object o whose key appears again later. Sorting keeps this
 * O(n log n): an object of 100k keys in a 4 MiB body must not cost n^2 comparisons. */
static void dedupe_object(cJSON *o)
{
    size_t n = 0;
    for (cJSON *it = o->child; it; it = it->next) n++;
    if (n < 2) return;
    struct key_at *keys = malloc(n * sizeof *keys);
    cJSON **items = malloc(n * sizeof *items);
    if (!keys || !items) {   /* out of memory: first-wins lookups, as before */
        free(keys);
        free(items);
        return;
    }
    size_t i = 0;
    for (cJSON *it = o->child; it; it = it->next, i++) {
        keys[i] = (struct key_at){it->string ? it->string : "", i};
        items[i] = it;
    }
    qsort(keys, n, sizeof *keys, by_key_then_index);
    for (i = 0; i + 1 < n; i++)
        if (!strcmp(keys[i].key, keys[i + 1].key)) {
            cJSON_Delete(cJSON_DetachItemViaPointer(o, items[keys[i].index]));
            items[keys[i].index] = NULL;
        }
    free(keys);
    free(items);
}

void kvs_json_dedupe_keys(cJSON *root)
{
    if (!root) return;
    if (cJSON_IsObject(root)) dedupe_object(root);
    for (cJSON *it = root->child; it; it = it->next) kvs_json_dedupe_keys(it);
}
