/* block_pool.h: bookkeeping for the paged KV cache: fixed-size blocks, a free list, reference
 * counts, per-block segment base positions, and an LRU list of unreferenced blocks that still
 * hold reusable KV (prefix or document cache), plus per-request block tables.
 *
 * The storage itself (K/V slots) belongs to the runner; this file only decides which block ids
 * are in use. A block is in exactly one of three states:
 *   free      refcount 0, on the free stack;
 *   used      refcount > 0 (shared blocks have refcount > 1);
 *   cached    refcount 0 but marked reusable (kvs_block_pool_set_cached): kept on an LRU list
 *             and only handed out again (evicted, through the evict callback) when the free
 *             stack is empty.
 * Segment bases (DESIGN: keys are rotated relative to their segment's base): every block
 * carries the base position of the segment its tokens belong to; ordinary prompts are one
 * segment with base 0, which is what kvs_block_pool_alloc sets.
 *
 * Ownership: kvs_block_pool_init allocates the arrays (once, at startup); kvs_block_pool_free
 * frees them. Block tables are allocated per request with a fixed capacity. Not thread-safe:
 * the scheduler thread owns the pool.
 * Errors: init returns 0 / -EINVAL / -ENOMEM; alloc returns a block id or -1 when no block is
 * free or evictable. Misuse (unref of a free block, bad id) is a bug: KVS_ASSERT.
 */
#ifndef KVS_BLOCK_POOL_H
#define KVS_BLOCK_POOL_H

#include <stdint.h>

/* Called when a cached block is taken from the LRU list for reuse (it is about to be
 * overwritten): the owner of the cache must forget it. */
typedef void (*kvs_block_evict_fn)(void *ctx, int32_t block);
/* Optional eviction policy: returns the cached block (refcount 0, on the LRU list) to evict
 * next, or -1 to take the LRU head. Lets a cache evict by its own policy (the doc cache: whole
 * documents, LRU or LFU) instead of by block release order. */
typedef int32_t (*kvs_block_victim_fn)(void *ctx);

struct kvs_block_pool {
    int n_blocks;
    int block_size;               /* token slots per block */
    int32_t *refcount;            /* [n_blocks] */
    int32_t *seg_base;            /* [n_blocks] segment base position of the block's tokens */
    uint8_t *cached;              /* [n_blocks] 1: holds reusable KV (goes to the LRU at refcount 0) */
    int32_t *free_stack;          /* [n_blocks] */
    int n_free;
    /* LRU of cached blocks with refcount 0: doubly linked through block ids, -1 terminated */
    int32_t *lru_prev, *lru_next; /* [n_blocks] */
    int32_t lru_head, lru_tail;   /* head = least recently released = evicted first */
    int n_lru;
    kvs_block_evict_fn on_evict;
    void *evict_ctx;
    kvs_block_victim_fn pick_victim;   /* NULL = LRU head */
    void *victim_ctx;
    uint64_t n_evictions;
};

int kvs_block_pool_init(struct kvs_block_pool *p, int n_blocks, int block_size);
void kvs_block_pool_free(struct kvs_block_pool *p);
void kvs_block_pool_set_evict(struct kvs_block_pool *p, kvs_block_evict_fn fn, void *ctx);
void kvs_block_pool_set_victim(struct kvs_block_pool *p, kvs_block_victim_fn fn, void *ctx);

/* Blocks that an allocation can still get (free + evictable cached). */
static inline int kvs_block_pool_available(const struct kvs_block_pool *p) { return p->n_free + p->n_lru; }
/* Blocks with refcount > 0. */
static inline int kvs_block_pool_used(const struct kvs_block_pool *p) { return p->n_blocks - p->n_free - p->n_lru; }

/* Takes a free block (or evicts the least recently used cached one); refcount 1, segment
 * base 0, not cached. Returns the id or -1 when nothing is available. */
int32_t kvs_block_pool_alloc(struct kvs_block_pool *p);
/* Adds a reference (a cached block with refcount 0 leaves the LRU list). */
void kvs_block_pool_ref(struct kvs_block_pool *p, int32_t b);
/* Drops a reference; at 0 the block goes to the LRU tail if cached, else to the free stack.
 * Returns the new refcount. */
int kvs_block_pool_unref(struct kvs_block_pool *p, int32_t b);
/* Marks a block as holding reusable KV (1) or not (0). */
void kvs_block_pool_set_cached(struct kvs_block_pool *p, int32_t b, int cached);
void kvs_block_pool_set_seg_base(struct kvs_block_pool *p, int32_t b, int32_t base);
static inline int32_t kvs_block_pool_seg_base(const struct kvs_block_pool *p, int32_t b) { return p->seg_base[b]; }
static inline int32_t kvs_block_pool_refcount(const struct kvs_block_pool *p, int32_t b) { return p->refcount[b]; }
/* Checks the internal invariants (counts, lists); KVS_ASSERT on violation. For tests. */
void kvs_block_pool_check(const struct kvs_block_pool *p);

/* A request's block table: block i holds positions [i*block_size, (i+1)*block_size). */
struct kvs_block_table {
    int32_t *ids;                 /* [cap] */
    int n;
    int cap;
    /* Offloaded range [off_lo, off_hi) (kvs_block_table_offload; empty when equal): those
     * blocks' K/V live elsewhere (a decode policy's host pages) and their references went back
     * to the pool; their entries alias ids[0] so that a kernel that reads the table stays inside
     * the pool (what it reads there is meaningless, and the policy that offloaded them never
     * uses it). Release skips them. */
    int off_lo, off_hi;
};

/* Allocates a table able to cover max_tokens positions. 0 or -ENOMEM. */
int kvs_block_table_init(struct kvs_block_table *t, int max_tokens, int block_size);
void kvs_block_table_free(struct kvs_block_table *t);
/* Grows t with fresh blocks until it covers n_tokens positions. Returns 0, or -ENOSPC when the
 * pool ran out (the blocks taken so far stay in t) or -E2BIG past the table's capacity. */
int kvs_block_table_reserve(struct kvs_block_table *t, struct kvs_block_pool *p, int n_tokens);
/* Blocks still needed to cover n_tokens positions. */
int kvs_block_table_blocks_needed(const struct kvs_block_table *t, int block_size, int n_tokens);
/* Gives the references of blocks [lo, hi) back to the pool (their K/V were moved off the pool
 * by the decode policy, kv.h `offloaded`) and makes the entries alias ids[0]. The range must
 * extend the offloaded one (lo == off_hi, or the first range) with 1 <= lo <= hi <= n (block 0
 * is never offloaded: it is the alias). Returns the blocks released. */
int kvs_block_table_offload(struct kvs_block_table *t, struct kvs_block_pool *p, int lo, int hi);
/* Blocks of the table that hold references (n minus the offloaded range). */
static inline int kvs_block_table_held(const struct kvs_block_table *t) { return t->n - (t->off_hi - t->off_lo); }
/* Unrefs every block it holds (not the offloaded range), last block first (so that a prefix's
 * tail is evicted before its head), and empties the table. */
void kvs_block_table_release(struct kvs_block_table *t, struct kvs_block_pool *p);

#endif
