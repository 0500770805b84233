/* prefix_cache.c: content-hashed full blocks over the block pool (see prefix_cache.h). */
#include "base/rng.h"
#include "engine/kv/prefix_cache.h"

#include "engine/kv/block_pool.h"
#include "base/util.h"

#include <string.h>


uint64_t kvs_prefix_hash(uint64_t parent, const int32_t *tokens, int n)
{
    uint64_t h = kvs_mix64(parent ^ 0x3c6ef372fe94f82bULL);
    for (int i = 0; i < n; i++) h = kvs_mix64(h + 0x9e3779b97f4a7c15ULL + (uint64_t)(uint32_t)tokens[i]);
    return kvs_mix64(h ^ (uint64_t)n);
}

static void on_evict(void *ctx, int32_t b);

int kvs_prefix_cache_init(struct kvs_prefix_cache *pc, struct kvs_block_pool *pool)
{
    memset(pc, 0, sizeof *pc);
    pc->pool = pool;
    pc->block_size = pool->block_size;
    uint32_t cap = 16;
    while (cap < 2u * (uint32_t)pool->n_blocks) cap <<= 1;
    pc->cap = cap;
    size_t nb = (size_t)pool->n_blocks;
    pc->table = malloc(cap * sizeof *pc->table);
    pc->hash = calloc(nb, sizeof *pc->hash);
    pc->parent = calloc(nb, sizeof *pc->parent);
    pc->tokens = calloc(nb * (size_t)pc->block_size, sizeof *pc->tokens);
    pc->registered = calloc(nb, sizeof *pc->registered);
    if (!pc->table || !pc->hash || !pc->parent || !pc->tokens || !pc->registered) {
        kvs_prefix_cache_free(pc);
        return -ENOMEM;
    }
    for (uint32_t i = 0; i < cap; i++) pc->table[i] = -1;
    kvs_block_pool_set_evict(pool, on_evict, pc);
    return 0;
}

void kvs_prefix_cache_free(struct kvs_prefix_cache *pc)
{
    if (pc->pool && pc->pool->evict_ctx == pc) kvs_block_pool_set_evict(pc->pool, NULL, NULL);
    free(pc->table);
    free(pc->hash);
    free(pc->parent);
    free(pc->tokens);
    free(pc->registered);
    memset(pc, 0, sizeof *pc);
}

static uint32_t slot_of(const struct kvs_prefix_cache *pc, uint64_t h) { return (uint32_t)(h & (pc->cap - 1)); }

static int32_t find(const struct kvs_prefix_cache *pc, uint64_t h, uint64_t parent, const int32_t *tokens)
{
    for (uint32_t i = slot_of(pc, h);; i = (i + 1) & (pc->cap - 1)) {
        int32_t b = pc->table[i];
        if (b < 0) return -1;
        if (pc->hash[b] != h) continue;
        if (pc->parent[b] == parent &&
            memcmp(pc->tokens + (size_t)b * pc->block_size, tokens, (size_t)pc->block_size * sizeof *tokens) == 0)
            return b;
        /* same 64-bit hash, different content: a true collision; keep probing */
        ((struct kvs_prefix_cache *)pc)->n_collisions++;
    }
}

static void table_remove(struct kvs_prefix_cache *pc, int32_t b)
{
    uint32_t mask = pc->cap - 1, i = slot_of(pc, pc->hash[b]);
    while (pc->table[i] != b) {
        KVS_ASSERT(pc->table[i] >= 0);
        i = (i + 1) & mask;
    }
    /* backward-shift deletion keeps probe chains intact without tombstones */
    uint32_t j = i;
    for (;;) {
        j = (j + 1) & mask;
        int32_t e = pc->table[j];
        if (e < 0) break;
        uint32_t home = slot_of(pc, pc->hash[e]);
        /* e may move into the hole i if its home is not in (i, j] cyclically */
        int movable = (i <= j) ? (home <= i || home > j) : (home <= i && home > j);
        if (movable) {
            pc->table[i] = e;
            i = j;
        }
    }
    pc->table[i] = -1;
    pc->registered[b] = 0;
    pc->n_entries--;
}

static void on_evict(void *ctx, int32_t b)
{
    struct kvs_prefix_cache *pc = ctx;
    if (!pc->registered[b]) return;
    table_remove(pc, b);
    pc->n_evicted++;
}

int kvs_prefix_cache_match(struct kvs_prefix_cache *pc, const int32_t *tokens, int max_blocks, int32_t *out,
                           uint64_t *last_hash)
{
    uint64_t h = KVS_PREFIX_ROOT_HASH;
    int n = 0;
    for (; n < max_blocks; n++) {
        const int32_t *bt = tokens + (size_t)n * pc->block_size;
        uint64_t hb = kvs_prefix_hash(h, bt, pc->block_size);
        int32_t b = find(pc, hb, h, bt);
        if (b < 0) break;
        kvs_block_pool_ref(pc->pool, b);
        out[n] = b;
        h = hb;
    }
    if (last_hash) *last_hash = h;
    return n;
}

uint64_t kvs_prefix_cache_insert(struct kvs_prefix_cache *pc, uint64_t parent, const int32_t *tokens, int32_t b,
                                 int *inserted)
{
    KVS_ASSERT(b >= 0 && b < pc->pool->n_blocks);
    uint64_t h = kvs_prefix_hash(parent, tokens, pc->block_size);
    if (inserted) *inserted = 0;
    if (pc->registered[b]) return h;   /* already registered (the block was matched, not computed) */
    if (kvs_block_pool_seg_base(pc->pool, b) != 0) return h;
    if (find(pc, h, parent, tokens) >= 0) return h;
    KVS_ASSERT(kvs_block_pool_refcount(pc->pool, b) > 0);
    pc->hash[b] = h;
    pc->parent[b] = parent;
    memcpy(pc->tokens + (size_t)b * pc->block_size, tokens, (size_t)pc->block_size * sizeof *tokens);
    uint32_t i = slot_of(pc, h);
    while (pc->table[i] >= 0) i = (i + 1) & (pc->cap - 1);
    pc->table[i] = b;
    pc->registered[b] = 1;
    pc->n_entries++;
    pc->n_inserts++;
    kvs_block_pool_set_cached(pc->pool, b, 1);
    if (inserted) *inserted = 1;
    return h;
}

void kvs_prefix_cache_clear(struct kvs_prefix_cache *pc)
{
    for (int b = 0; b < pc->pool->n_blocks; b++) {
        if (!pc->registered[b] || kvs_block_pool_refcount(pc->pool, b) > 0) continue;
        table_remove(pc, b);
        kvs_block_pool_set_cached(pc->pool, b, 0);
    }
}
