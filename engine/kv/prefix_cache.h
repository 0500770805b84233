/* prefix_cache.h: kv.reuse=prefix: automatic prefix caching over the paged KV pool.
 *
 * A full block is identified by the content hash of (parent block's hash, its block_size token
 * ids), so a block's hash names the whole prefix up to its end. The hash is a 64-bit chained
 * mix (splitmix64 finaliser per token, seeded by the parent); because 64 bits can collide,
 * a hit also compares the stored token ids and the stored parent hash.
 *
 * A new request walks its prompt block by block and takes every matching block copy-free
 * (refcount + 1). When a request finishes a block (all block_size slots computed) the
 * scheduler inserts it; if an equal block is already registered the new one stays private.
 * Registered blocks are marked cached in the block pool: when their last user lets go they
 * sit on the pool's LRU list, still matchable, and are evicted (and forgotten here, through
 * the pool's evict callback) only when the free list is empty.
 *
 * Only segment-base-0 blocks (ordinary prompts) are registered: the hash does not include
 * positions, and a block is only reusable at the same absolute positions.
 *
 * Ownership: init allocates the table and per-block token copies once (n_blocks x block_size
 * int32); free releases them. The pool is borrowed and must outlive the cache. Scheduler
 * thread only. Errors: init returns 0 / -ENOMEM.
 */
#ifndef KVS_PREFIX_CACHE_H
#define KVS_PREFIX_CACHE_H

#include <stdint.h>

struct kvs_block_pool;

#define KVS_PREFIX_ROOT_HASH 0x6a09e667f3bcc909ULL

struct kvs_prefix_cache {
    struct kvs_block_pool *pool;
    int block_size;
    /* open addressing, linear probing, backward-shift deletion; slot = block id or -1 */
    int32_t *table;               /* [cap] */
    uint32_t cap;                 /* power of two, >= 2 * n_blocks */
    uint64_t *hash;               /* [n_blocks] hash of a registered block */
    uint64_t *parent;             /* [n_blocks] its parent's hash */
    int32_t *tokens;              /* [n_blocks][block_size] its token ids */
    uint8_t *registered;          /* [n_blocks] */
    int n_entries;
    uint64_t n_inserts, n_evicted, n_collisions;
};

int kvs_prefix_cache_init(struct kvs_prefix_cache *pc, struct kvs_block_pool *pool);
void kvs_prefix_cache_free(struct kvs_prefix_cache *pc);

/* Hash of a block given its parent's hash (KVS_PREFIX_ROOT_HASH for the first block). */
uint64_t kvs_prefix_hash(uint64_t parent, const int32_t *tokens, int n);

/* Matches up to max_blocks leading full blocks of tokens (tokens must hold
 * max_blocks * block_size ids). Each matched block gets a reference and its id is written to
 * out[]; *last_hash receives the hash of the last matched block (root hash when none).
 * Returns the number of matched blocks. */
int kvs_prefix_cache_match(struct kvs_prefix_cache *pc, const int32_t *tokens, int max_blocks, int32_t *out,
                           uint64_t *last_hash);

/* Registers block b (owned by the caller, refcount > 0, fully computed with these block_size
 * tokens at segment base 0). Returns the block's hash for chaining; *inserted (may be NULL) is 1
 * if b was registered, 0 if an equal block already was (b then stays private). */
uint64_t kvs_prefix_cache_insert(struct kvs_prefix_cache *pc, uint64_t parent, const int32_t *tokens, int32_t b,
                                 int *inserted);

/* Forgets every registered block that nobody references (e.g. on a model swap); cached
 * blocks return to the free list. */
void kvs_prefix_cache_clear(struct kvs_prefix_cache *pc);

#endif
