/* kv_lean_pages.c: LeanKV's page manager, host reference (kernels/kv_lean_pages.h). Plain C,
 * written as the GPU does it: a scan over the heads' needs, then independent takes. */
#include "kernels/kv_lean_pages.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct kvs_lean_pm {
    int n_pages, n_heads, table_len;
    int32_t *ring;                /* [n_pages] the circular free list */
    int64_t head, tail;           /* allocation / free pointers (monotonic; mod n_pages) */
    int32_t *tables;              /* [n_heads][table_len] */
    int32_t *n_high, *n_low;      /* [n_heads] */
    int64_t *off;                 /* [n_heads] scan scratch */
    int32_t *need;                /* [n_heads] scan input */
};

int kvs_lean_pm_create(int n_pages, int n_heads, int table_len, struct kvs_lean_pm **out)
{
    *out = NULL;
    if (n_pages <= 0 || n_heads <= 0 || table_len <= 0) return -EINVAL;
    struct kvs_lean_pm *pm = calloc(1, sizeof *pm);
    if (!pm) return -ENOMEM;
    pm->n_pages = n_pages, pm->n_heads = n_heads, pm->table_len = table_len;
    pm->ring = malloc((size_t)n_pages * sizeof *pm->ring);
    pm->tables = malloc((size_t)n_heads * table_len * sizeof *pm->tables);
    pm->n_high = calloc((size_t)n_heads, sizeof *pm->n_high);
    pm->n_low = calloc((size_t)n_heads, sizeof *pm->n_low);
    pm->off = malloc((size_t)n_heads * sizeof *pm->off);
    pm->need = malloc((size_t)n_heads * sizeof *pm->need);
    if (!pm->ring || !pm->tables || !pm->n_high || !pm->n_low || !pm->off || !pm->need) {
        kvs_lean_pm_free(pm);
        return -ENOMEM;
    }
    for (int i = 0; i < n_pages; i++) pm->ring[i] = i;
    pm->head = 0, pm->tail = n_pages;
    *out = pm;
    return 0;
}

void kvs_lean_pm_free(struct kvs_lean_pm *pm)
{
    if (!pm) return;
    free(pm->ring), free(pm->tables), free(pm->n_high), free(pm->n_low), free(pm->off), free(pm->need);
    free(pm);
}

int64_t kvs_lean_exclusive_scan(const int32_t *in, int n, int64_t *out)
{
    int64_t s = 0;
    for (int i = 0; i < n; i++) {
        out[i] = s;
        s += in[i];
    }
    return s;
}

int kvs_lean_pm_n_free(const struct kvs_lean_pm *pm) { return (int)(pm->tail - pm->head); }

int kvs_lean_pm_alloc(struct kvs_lean_pm *pm, const int32_t *need_high, const int32_t *need_low)
{
    for (int i = 0; i < pm->n_heads; i++) {
        if (need_high[i] < 0 || need_low[i] < 0) return -EINVAL;
        if ((int64_t)pm->n_high[i] + pm->n_low[i] + need_high[i] + need_low[i] > pm->table_len) return -E2BIG;
        pm->need[i] = need_high[i] + need_low[i];
    }
    const int64_t total = kvs_lean_exclusive_scan(pm->need, pm->n_heads, pm->off);
    if (total > pm->tail - pm->head) return -ENOSPC;
    /* each head's take is independent of the others' (one GPU thread per head) */
    for (int i = 0; i < pm->n_heads; i++) {
        int32_t *t = pm->tables + (size_t)i * pm->table_len;
        int64_t at = pm->head + pm->off[i];
        for (int k = 0; k < need_high[i]; k++) t[pm->n_high[i]++] = pm->ring[at++ % pm->n_pages];
        for (int k = 0; k < need_low[i]; k++) t[pm->table_len - 1 - pm->n_low[i]++] = pm->ring[at++ % pm->n_pages];
    }
    pm->head += total;
    return 0;
}

void kvs_lean_pm_release(struct kvs_lean_pm *pm, int first, int n)
{
    for (int i = first; i < first + n && i < pm->n_heads; i++) {
        if (i < 0) continue;
        const int32_t *t = pm->tables + (size_t)i * pm->table_len;
        for (int k = 0; k < pm->n_high[i]; k++) pm->ring[pm->tail++ % pm->n_pages] = t[k];
        for (int k = 0; k < pm->n_low[i]; k++) pm->ring[pm->tail++ % pm->n_pages] = t[pm->table_len - 1 - k];
        pm->n_high[i] = pm->n_low[i] = 0;
    }
}

void kvs_lean_pm_trim(struct kvs_lean_pm *pm, int head, int keep_high, int keep_low)
{
    if (head < 0 || head >= pm->n_heads) return;
    const int32_t *t = pm->tables + (size_t)head * pm->table_len;
    while (pm->n_high[head] > keep_high && pm->n_high[head] > 0)
        pm->ring[pm->tail++ % pm->n_pages] = t[--pm->n_high[head]];
    while (pm->n_low[head] > keep_low && pm->n_low[head] > 0)
        pm->ring[pm->tail++ % pm->n_pages] = t[pm->table_len - pm->n_low[head]--];
}

const int32_t *kvs_lean_pm_table(const struct kvs_lean_pm *pm, int head, int *n_high, int *n_low)
{
    *n_high = pm->n_high[head];
    *n_low = pm->n_low[head];
    return pm->tables + (size_t)head * pm->table_len;
}

int kvs_lean_pm_check(const struct kvs_lean_pm *pm, char *msg, size_t msglen)
{
    int rc = 0;
    unsigned char *seen = calloc((size_t)pm->n_pages, 1);
    if (!seen) return -ENOMEM;
#define BAD(...)                                                                                                       \
    do {                                                                                                               \
        snprintf(msg, msglen, __VA_ARGS__);                                                                            \
        rc = -EFAULT;                                                                                                  \
        goto out;                                                                                                      \
    } while (0)
    if (pm->tail - pm->head < 0 || pm->tail - pm->head > pm->n_pages)
        BAD("free count %lld outside [0, %d]", (long long)(pm->tail - pm->head), pm->n_pages);
    for (int64_t p = pm->head; p < pm->tail; p++) {
        const int32_t id = pm->ring[p % pm->n_pages];
        if (id < 0 || id >= pm->n_pages) BAD("free list holds page id %d", id);
        if (seen[id]++) BAD("page %d twice on the free list", id);
    }
    int64_t used = 0;
    for (int i = 0; i < pm->n_heads; i++) {
        if (pm->n_high[i] < 0 || pm->n_low[i] < 0 || pm->n_high[i] + pm->n_low[i] > pm->table_len)
            BAD("head %d: %d high + %d low pages in a table of %d", i, pm->n_high[i], pm->n_low[i], pm->table_len);
        const int32_t *t = pm->tables + (size_t)i * pm->table_len;
        for (int k = 0; k < pm->n_high[i] + pm->n_low[i]; k++) {
            const int32_t id = k < pm->n_high[i] ? t[k] : t[pm->table_len - 1 - (k - pm->n_high[i])];
            if (id < 0 || id >= pm->n_pages) BAD("head %d holds page id %d", i, id);
            if (seen[id]++) BAD("page %d held twice (head %d)", id, i);
            used++;
        }
    }
    if (used + (pm->tail - pm->head) != pm->n_pages)
        BAD("%lld pages in tables + %lld free != %d", (long long)used, (long long)(pm->tail - pm->head), pm->n_pages);
out:
#undef BAD
    free(seen);
    return rc;
}
