/* bench_util.h: what the kernel benchmark programs share (bench/kvserve_*bench_main.c): a small
 * seedable generator for random inputs, the comma-separated list parser of their options, and
 * the float comparison for medians, and a random order of KV blocks. Header-only, no state of its
 * own. Ownership: bench_shuffled_ids's array is the caller's (free). Errors: parse_list returns -1 on
 * a malformed list; bench_shuffled_ids panics when out of memory (kvs_xmalloc). */
#ifndef KVS_BENCH_UTIL_H
#define KVS_BENCH_UTIL_H

#include <stdint.h>
#include <stdlib.h>

#include "base/util.h"

/* xorshift64: the next 32 random bits of the state *s (advances it) */
static inline uint32_t bench_rnd(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return (uint32_t)(*s >> 11);
}

/* "a,b,c" of positive integers into out[0..cap); the count, or -1 */
static inline int bench_parse_list(const char *s, int *out, int cap)
{
    int n = 0;
    while (*s && n < cap) {
        char *end;
        long v = strtol(s, &end, 10);
        if (end == s || v <= 0) return -1;
        out[n++] = (int)v;
        s = *end == ',' ? end + 1 : end;
        if (*end && *end != ',') return -1;
    }
    return n;
}

/* qsort comparator of floats, ascending */
static inline int bench_cmp_float(const void *a, const void *b)
{
    const float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* 0..n-1 in a random order (Fisher-Yates, drawing from *s): where a benchmark's blocks lie in the
 * pool, so that a sequence's blocks are scattered as in a long-running server */
static inline int32_t *bench_shuffled_ids(size_t n, uint64_t *s)
{
    int32_t *perm = kvs_xmalloc((n ? n : 1) * sizeof *perm);
    for (size_t i = 0; i < n; i++) perm[i] = (int32_t)i;
    for (size_t k = n; k > 1; k--) {
        const size_t j = bench_rnd(s) % k;
        const int32_t t = perm[k - 1];
        perm[k - 1] = perm[j], perm[j] = t;
    }
    return perm;
}

#endif
