/* block_pool.c: free stack + refcounts + LRU of reusable blocks (see block_pool.h). */
#include "engine/kv/block_pool.h"

#include "base/util.h"

#include <string.h>

int kvs_block_pool_init(struct kvs_block_pool *p, int n_blocks, int block_size)
{
    memset(p, 0, sizeof *p);
    if (n_blocks <= 0 || block_size <= 0) return -EINVAL;
    size_t n = (size_t)n_blocks;
    p->refcount = calloc(n, sizeof *p->refcount);
    p->seg_base = calloc(n, sizeof *p->seg_base);
    p->cached = calloc(n, sizeof *p->cached);
    p->free_stack = calloc(n, sizeof *p->free_stack);
    p->lru_prev = calloc(n, sizeof *p->lru_prev);
    p->lru_next = calloc(n, sizeof *p->lru_next);
    if (!p->refcount || !p->seg_base || !p->cached || !p->free_stack || !p->lru_prev || !p->lru_next) {
        kvs_block_pool_free(p);
        return -ENOMEM;
    }
    p->n_blocks = n_blocks;
    p->block_size = block_size;
    /* stack top = block 0, so a fresh pool hands out 0, 1, 2, ... (readable logs and tests) */
    for (int i = 0; i < n_blocks; i++) p->free_stack[i] = n_blocks - 1 - i;
    p->n_free = n_blocks;
    for (int i = 0; i < n_blocks; i++) p->lru_prev[i] = p->lru_next[i] = -1;
    p->lru_head = p->lru_tail = -1;
    return 0;
}

void kvs_block_pool_free(struct kvs_block_pool *p)
{
    free(p->refcount);
    free(p->seg_base);
    free(p->cached);
    free(p->free_stack);
    free(p->lru_prev);
    free(p->lru_next);
    memset(p, 0, sizeof *p);
}

void kvs_block_pool_set_evict(struct kvs_block_pool *p, kvs_block_evict_fn fn, void *ctx)
{
    p->on_evict = fn;
    p->evict_ctx = ctx;
}

void kvs_block_pool_set_victim(struct kvs_block_pool *p, kvs_block_victim_fn fn, void *ctx)
{
    p->pick_victim = fn;
    p->victim_ctx = ctx;
}

static void lru_remove(struct kvs_block_pool *p, int32_t b)
{
    int32_t pr = p->lru_prev[b], nx = p->lru_next[b];
    if (pr >= 0) p->lru_next[pr] = nx; else p->lru_head = nx;
    if (nx >= 0) p->lru_prev[nx] = pr; else p->lru_tail = pr;
    p->lru_prev[b] = p->lru_next[b] = -1;
    p->n_lru--;
}

static void lru_push_tail(struct kvs_block_pool *p, int32_t b)
{
    p->lru_prev[b] = p->lru_tail;
    p->lru_next[b] = -1;
    if (p->lru_tail >= 0) p->lru_next[p->lru_tail] = b; else p->lru_head = b;
    p->lru_tail = b;
    p->n_lru++;
}

int32_t kvs_block_pool_alloc(struct kvs_block_pool *p)
{
    int32_t b;
    if (p->n_free > 0) {
        b = p->free_stack[--p->n_free];
    } else if (p->lru_head >= 0) {
        b = p->pick_victim ? p->pick_victim(p->victim_ctx) : -1;
        if (b < 0) b = p->lru_head;
        KVS_ASSERT(b >= 0 && b < p->n_blocks && p->refcount[b] == 0 && p->cached[b]);
        lru_remove(p, b);
        p->cached[b] = 0;
        p->n_evictions++;
        if (p->on_evict) p->on_evict(p->evict_ctx, b);
    } else {
        return -1;
    }
    KVS_ASSERT(p->refcount[b] == 0);
    p->refcount[b] = 1;
    p->seg_base[b] = 0;
    p->cached[b] = 0;
    return b;
}

void kvs_block_pool_ref(struct kvs_block_pool *p, int32_t b)
{
    KVS_ASSERT(b >= 0 && b < p->n_blocks);
    if (p->refcount[b] == 0) {
        /* only a cached block can be revived; a free one has no content worth sharing */
        KVS_ASSERT(p->cached[b]);
        lru_remove(p, b);
    }
    p->refcount[b]++;
}

int kvs_block_pool_unref(struct kvs_block_pool *p, int32_t b)
{
    KVS_ASSERT(b >= 0 && b < p->n_blocks);
    KVS_ASSERT(p->refcount[b] > 0);
    if (--p->refcount[b] == 0) {
        if (p->cached[b]) lru_push_tail(p, b);
        else p->free_stack[p->n_free++] = b;
    }
    return p->refcount[b];
}

void kvs_block_pool_set_cached(struct kvs_block_pool *p, int32_t b, int cached)
{
    KVS_ASSERT(b >= 0 && b < p->n_blocks);
    if (p->refcount[b] == 0 && p->cached[b] && !cached) {
        /* an unreferenced cached block that is no longer reusable becomes plainly free */
        lru_remove(p, b);
        p->cached[b] = 0;
        p->free_stack[p->n_free++] = b;
        return;
    }
    KVS_ASSERT(p->refcount[b] > 0 || !cached);
    p->cached[b] = (uint8_t)(cached != 0);
}

void kvs_block_pool_set_seg_base(struct kvs_block_pool *p, int32_t b, int32_t base)
{
    KVS_ASSERT(b >= 0 && b < p->n_blocks);
    p->seg_base[b] = base;
}

void kvs_block_pool_check(const struct kvs_block_pool *p)
{
    int n_zero = 0, n_cached_zero = 0;
    for (int i = 0; i < p->n_blocks; i++) {
        KVS_ASSERT(p->refcount[i] >= 0);
        if (p->refcount[i] == 0) {
            n_zero++;
            if (p->cached[i]) n_cached_zero++;
        }
    }
    KVS_ASSERT(n_zero == p->n_free + p->n_lru);
    KVS_ASSERT(n_cached_zero == p->n_lru);
    int n = 0;
    int32_t prev = -1;
    for (int32_t b = p->lru_head; b >= 0; b = p->lru_next[b]) {
        KVS_ASSERT(p->refcount[b] == 0 && p->cached[b]);
        KVS_ASSERT(p->lru_prev[b] == prev);
        prev = b;
        KVS_ASSERT(++n <= p->n_blocks);
    }
    KVS_ASSERT(prev == p->lru_tail);
    KVS_ASSERT(n == p->n_lru);
    for (int i = 0; i < p->n_free; i++) {
        int32_t b = p->free_stack[i];
        KVS_ASSERT(b >= 0 && b < p->n_blocks && p->refcount[b] == 0 && !p->cached[b]);
    }
}

int kvs_block_table_init(struct kvs_block_table *t, int max_tokens, int block_size)
{
    memset(t, 0, sizeof *t);
    if (max_tokens < 0 || block_size <= 0) return -EINVAL;
    t->cap = (max_tokens + block_size - 1) / block_size;
    if (t->cap == 0) t->cap = 1;
    t->ids = malloc((size_t)t->cap * sizeof *t->ids);
    if (!t->ids) return -ENOMEM;
    return 0;
}

void kvs_block_table_free(struct kvs_block_table *t)
{
    free(t->ids);
    memset(t, 0, sizeof *t);
}

int kvs_block_table_blocks_needed(const struct kvs_block_table *t, int block_size, int n_tokens)
{
    int need = (n_tokens + block_size - 1) / block_size - t->n;
    return need > 0 ? need : 0;
}

int kvs_block_table_reserve(struct kvs_block_table *t, struct kvs_block_pool *p, int n_tokens)
{
    int want = (n_tokens + p->block_size - 1) / p->block_size;
    if (want > t->cap) return -E2BIG;
    while (t->n < want) {
        int32_t b = kvs_block_pool_alloc(p);
        if (b < 0) return -ENOSPC;
        t->ids[t->n++] = b;
    }
    return 0;
}

int kvs_block_table_offload(struct kvs_block_table *t, struct kvs_block_pool *p, int lo, int hi)
{
    KVS_ASSERT(lo >= 1 && lo <= hi && hi <= t->n);
    KVS_ASSERT(t->off_lo == t->off_hi || lo == t->off_hi);
    if (t->off_lo == t->off_hi) t->off_lo = t->off_hi = lo;
    for (int i = lo; i < hi; i++) {
        kvs_block_pool_unref(p, t->ids[i]);
        t->ids[i] = t->ids[0];
    }
    t->off_hi = hi;
    return hi - lo;
}

void kvs_block_table_release(struct kvs_block_table *t, struct kvs_block_pool *p)
{
    for (int i = t->n - 1; i >= 0; i--)
        if (i < t->off_lo || i >= t->off_hi) kvs_block_pool_unref(p, t->ids[i]);
    t->n = 0;
    t->off_lo = t->off_hi = 0;
}
