/* doc_cache.h: kv.reuse=lazy: the LazyAttention document cache (position-agnostic document KV,
 * shared across requests, reused at any offset through deferred RoPE).
 *
 * What is cached. A document's KV computed with Block-Attention semantics: the document is
 * prefilled as its own sequence at local positions 0..len-1 (it attends only to itself) into
 * blocks of its own, starting on a block boundary; the unused tail of its last block is
 * never shared and never attended (masked through the runner's block_valid). Entries are keyed
 * by the content hash of the token ids (64-bit, verified against a stored copy of the ids, so
 * a collision is a miss, never wrong KV); the document id plays no part, so two ids with the
 * same text share one entry. In position-aware mode (the Block-Attention/TurboRAG baseline the
 * benchmark compares against) the key also includes the document's offset in the request, so
 * each (document, offset) pair is its own replica; its KV is numerically the same.
 *
 * Positions (our choice; STRATEGIES.md section 1 lets us state it): a request's layout is
 * [doc_1 | pad][doc_2 | pad]...[prompt][generated] in PADDED coordinates: document d occupies
 * slots [start_d, start_d + len_d) with start_d = sum over i<d of round_up(len_i, block_size),
 * the request's own tokens start at the first slot after the last document, and a key's
 * effective RoPE position is its slot index. So a document's rotation offset is off_d =
 * start_d (keys stored at local positions j are attended as if at start_d + j), queries are
 * rotated at their slot index, and pads are holes in the position axis. This differs from the
 * reference code's off_d = sum_all pad + sum_{i<d} len_i (documents packed against the
 * prompt, pads all in front); both are Block-Attention with shifted positions. Ours keeps one
 * coordinate system for the causal mask, the block table and RoPE, so no kernel needs a second
 * position map.
 *
 * Metadata. Per block of a request the cache keeps one 64-bit word, as the paper does:
 * block id << 32 | (off + 1) << 16 | pad, with (off + 1) = 0 for private blocks (no rotation).
 * The 16-bit field caps off + 1 at 65535: a request whose last document starts at slot 65535
 * or later is rejected (-E2BIG) at submit, never wrapped. The words are unpacked into the
 * runner's per-block arrays (block table, rot offsets, valid counts) when a step is built.
 *
 * Lifetime of an entry. Created on a miss (its blocks taken from the pool and marked cached),
 * PENDING until every token is computed (concurrent requests for the same missing document
 * find the pending entry and wait for it: it is computed once), then READY. Requests hold
 * references to its blocks (pool refcounts) and count as its users; a block a request uses
 * has refcount > 0 and is never evicted. With no users the blocks sit on the pool's LRU list
 * and are evicted whole (all blocks of the entry) either when the byte budget needs room for a
 * new document or when the pool runs out of free blocks; the victim is chosen by the policy
 * (lru: least recently used; lfu: fewest uses, ties least recent; unfinished entries first).
 * A document that does not fit the budget even after evicting every unused entry is computed
 * anyway but not kept (transient: freed with its last user).
 *
 * Ownership: init allocates everything once (entries, hash buckets, block chains, a token copy
 * per block: n_blocks x block_size int32); free releases it. The pool is borrowed. Per-request
 * state (struct kvs_lazy_seq) is allocated by kvs_lazy_seq_init and freed by
 * kvs_lazy_seq_free. Scheduler thread only. Errors: 0 / negative errno.
 */
#ifndef KVS_DOC_CACHE_H
#define KVS_DOC_CACHE_H

#include <stddef.h>
#include <stdint.h>

struct kvs_block_pool;
struct kvs_block_table;

#define KVS_LAZY_OFF_FIELD_MAX 65535   /* off + 1 must fit 16 bits */

enum kvs_doc_policy { KVS_DOC_LRU = 0, KVS_DOC_LFU = 1 };

/* Packs one block's metadata; off < 0 means a private block (no rotation). Returns 0, or
 * -ERANGE when block, off + 1 or pad do not fit their fields. */
int kvs_lazy_pack(int32_t block, int32_t off, int32_t pad, uint64_t *out);
/* Unpacks; *off = -1 for a private block. */
void kvs_lazy_unpack(uint64_t w, int32_t *block, int32_t *off, int32_t *pad);

struct kvs_doc_entry {
    uint64_t hash;
    int32_t off_key;              /* -1 (position-agnostic) or the offset (position-aware) */
    int n_tokens, n_blocks;
    int32_t first_block;          /* blocks chained through kvs_doc_cache.next_block */
    int n_done;                   /* leading tokens whose KV is computed */
    int sched;                    /* tokens being computed in the current step */
    int users;                    /* requests holding it */
    int transient;                /* over budget: dropped with its last user */
    uint64_t last_use, uses;
    int32_t hnext;                /* hash chain / free list (entry index, -1 terminated) */
    int live;
};

struct kvs_doc_cache {
    struct kvs_block_pool *pool;
    int block_size;
    int position_aware;
    enum kvs_doc_policy policy;
    int64_t budget_blocks;        /* 0 = bounded by the pool only */
    size_t bytes_per_block;
    struct kvs_doc_entry *ent;    /* [n_blocks] (every live entry holds >= 1 block) */
    int32_t free_ent;
    int32_t *buckets;             /* [n_buckets] entry index or -1 */
    uint32_t n_buckets;           /* power of two */
    int32_t *next_block;          /* [n_blocks] chain of an entry's blocks */
    int32_t *block_ent;           /* [n_blocks] owning entry or -1 */
    int32_t *tokens;              /* [n_blocks][block_size] copy of each block's token ids */
    int64_t cached_blocks;        /* blocks of live, non-transient entries */
    int n_entries;
    uint64_t clock;
    /* counters */
    uint64_t hits, misses, evictions, tokens_saved, tokens_computed;
};

int kvs_doc_cache_init(struct kvs_doc_cache *dc, struct kvs_block_pool *pool, enum kvs_doc_policy policy,
                       int position_aware, int64_t budget_bytes, size_t bytes_per_block);
void kvs_doc_cache_free(struct kvs_doc_cache *dc);

uint64_t kvs_doc_hash(const int32_t *tokens, int n);

/* Finds or creates the entry for tokens[0..n) (at offset off, used as key only in
 * position-aware mode), references its blocks (written to blocks[0..n_blocks)) and counts the
 * caller as a user. *hit = 1 when the entry already existed (ready or being computed).
 * Returns the entry index, or -ENOSPC when the pool cannot hold a new entry now. */
int kvs_doc_cache_acquire(struct kvs_doc_cache *dc, const int32_t *tokens, int n, int32_t off, int32_t *blocks,
                          int *hit);
/* Drops one user (the caller has released, or is about to release, its block references). */
void kvs_doc_cache_release(struct kvs_doc_cache *dc, int entry);
static inline int kvs_doc_cache_ready(const struct kvs_doc_cache *dc, int entry)
{
    return dc->ent[entry].n_done == dc->ent[entry].n_tokens;
}
/* n more tokens of the entry were computed. */
void kvs_doc_cache_commit(struct kvs_doc_cache *dc, int entry, int n);
/* Evicts every unused entry (tests, model swap). */
void kvs_doc_cache_clear(struct kvs_doc_cache *dc);
/* Checks internal invariants against the pool; KVS_ASSERT on violation. For tests. */
void kvs_doc_cache_check(const struct kvs_doc_cache *dc);

/* ---- per request ------------------------------------------------------------------------ */
struct kvs_lazy_doc {
    int start;                    /* first slot (multiple of block_size) */
    int n_tokens;
    int n_blocks;
    int entry;                    /* -1 when not held */
    int hit;                      /* last acquire found it cached (and not created by us) */
    int created;                  /* an acquire of this request created the entry */
};

struct kvs_lazy_seq {
    int n_docs;
    struct kvs_lazy_doc *docs;    /* [n_docs] */
    int doc_slots;                /* padded length of the document region */
    int doc_tokens;               /* its real tokens */
    int cap;                      /* block table capacity */
    uint64_t *meta;               /* [cap] packed words (valid for the held document blocks) */
    int32_t *rot, *valid;         /* [cap] unpacked for the runner (private blocks: 0, block_size) */
    int held;                     /* documents acquired */
    int ready;                    /* every held document is computed */
};

/* Lays out n_docs documents of the given lengths for a block table of cap blocks.
 * -EINVAL (empty document), -E2BIG (offset past the 16-bit field or the table), -ENOMEM. */
int kvs_lazy_seq_init(struct kvs_lazy_seq *s, const int *doc_len, int n_docs, int cap, int block_size);
void kvs_lazy_seq_free(struct kvs_lazy_seq *s);

/* Acquires every document of s (tokens = the request's padded token array) into the start of
 * table t (t->n must be 0). Returns the number of slots covered (s->doc_slots), or -ENOSPC
 * with nothing held. *cached_tokens = tokens of the documents that were hits (found in the
 * cache and not created by this request in an earlier, failed admission attempt). */
int kvs_lazy_seq_acquire(struct kvs_doc_cache *dc, struct kvs_lazy_seq *s, const int32_t *tokens,
                         struct kvs_block_table *t, int *cached_tokens);
/* Adds s's last lookups to the hit/miss counters: once per request, at its first successful
 * admission (not for attempts that had to wait, nor re-admissions after preemption). */
void kvs_lazy_seq_count(struct kvs_doc_cache *dc, const struct kvs_lazy_seq *s);
/* Drops s's users (the block table is released separately by the caller). */
void kvs_lazy_seq_release(struct kvs_doc_cache *dc, struct kvs_lazy_seq *s);
/* 1 when every document of s is computed (refreshes s->ready). */
int kvs_lazy_seq_ready(const struct kvs_doc_cache *dc, struct kvs_lazy_seq *s);

#endif
