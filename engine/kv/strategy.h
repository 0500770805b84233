/* strategy.h: the three KV-cache strategy slots of DESIGN.md as dispatch tables, so that the
 * scheduler talks to "the reuse strategy" and "the decode strategy" and never to a particular
 * one. New strategies (lean storage, lazy document reuse, mac/paris/retro decode) add an ops
 * table and a row in strategy.c; the scheduler does not change.
 *
 *   kv.storage  how a block stores K and V: f32 (CPU reference), bf16 (CUDA); auto picks by
 *               backend. The runner owns the bytes; this slot only names the format and its
 *               element size (pool sizing, bandwidth accounting).
 *   kv.reuse    KV shared across requests: none, prefix (prefix_cache.h), lazy (doc_cache.h: the
 *               scheduler acquires a request's documents itself; its match/commit are none's
 *               for the request's own tokens). Hooks: match at
 *               admission (fills the start of the block table with shared blocks), commit after
 *               each step (registers newly completed blocks).
 *   kv.decode   how a decode step reads the cache: full (exact attention over every block).
 *               Hook: begin_step before each forward (selection, summaries, ...).
 *
 * Ownership: kvs_kv_strategy_init allocates the strategies' state (the prefix table, once);
 * kvs_kv_strategy_free frees it. The block pool is borrowed. Scheduler thread only.
 * Errors: init returns 0, -EINVAL (unknown name) or -ENOSYS (a strategy not built in this
 * version), with a message naming the config key.
 */
#ifndef KVS_KV_STRATEGY_H
#define KVS_KV_STRATEGY_H

#include <stddef.h>
#include <stdint.h>

#include "engine/kv/block_pool.h"
#include "engine/kv/doc_cache.h"
#include "engine/kv/prefix_cache.h"

struct kvs_config;
struct kvs_batch;

/* Per-sequence state a reuse strategy keeps between steps (lives in the request). */
struct kvs_kv_seq {
    uint64_t last_hash;           /* prefix: hash of the last registered/matched full block */
    int n_hashed;                 /* prefix: leading full blocks already hashed */
};

enum kvs_kv_storage_kind { KVS_KV_STORAGE_F32 = 0, KVS_KV_STORAGE_BF16 = 1 };

struct kvs_kv_storage_ops {
    const char *name;
    enum kvs_kv_storage_kind kind;
    int elem_bytes;               /* bytes per stored K or V element */
};

struct kvs_kv_strategy;

struct kvs_kv_reuse_ops {
    const char *name;
    /* Admission: puts reusable blocks for the leading tokens into t (t->n starts at 0; the
     * blocks are referenced) and returns how many tokens they cover (always < n, so the last
     * token is computed and yields logits). */
    int (*match)(struct kvs_kv_strategy *s, const int32_t *tokens, int n, struct kvs_block_table *t,
                 struct kvs_kv_seq *seq);
    /* After a step: tokens[0..n_computed) have their KV in t's blocks. */
    void (*commit)(struct kvs_kv_strategy *s, const int32_t *tokens, int n_computed, const struct kvs_block_table *t,
                   struct kvs_kv_seq *seq);
};

struct kvs_kv_decode_ops {
    const char *name;
    int exact;                    /* 1: equals full attention (no fidelity report needed) */
    /* Before each forward; NULL = nothing to prepare. Returns 0 or a negative errno. */
    int (*begin_step)(struct kvs_kv_strategy *s, const struct kvs_batch *b);
};

struct kvs_kv_strategy {
    const struct kvs_kv_storage_ops *storage;
    const struct kvs_kv_reuse_ops *reuse;
    const struct kvs_kv_decode_ops *decode;
    struct kvs_block_pool *pool;
    struct kvs_prefix_cache prefix;   /* used when reuse = prefix */
    int has_prefix;
    struct kvs_doc_cache docs;        /* used when reuse = lazy (kvs_kv_strategy_init_lazy) */
    int has_lazy;
    int is_lazy;                      /* reuse = lazy: requests' documents become doc segments */
};

/* Resolves cfg->kv_storage / kv_reuse / kv_decode ("auto" storage: f32 on the cpu backend,
 * bf16 on cuda) and sets up the reuse state over pool. */
int kvs_kv_strategy_init(struct kvs_kv_strategy *s, const struct kvs_config *cfg, const char *backend_name,
                         struct kvs_block_pool *pool, char *err, size_t errlen);
void kvs_kv_strategy_free(struct kvs_kv_strategy *s);

/* reuse = lazy: sets up the document cache (doc_cache.h); the caller knows the KV bytes per
 * block (the runner's), which sizing the byte budget needs. Requests without documents use
 * no reuse. 0 or a negative errno with a message. */
int kvs_kv_strategy_init_lazy(struct kvs_kv_strategy *s, const char *eviction, int position_aware,
                              int64_t budget_bytes, size_t bytes_per_block, char *err, size_t errlen);

/* Same resolution from explicit names (for tools and tests that have no kvs_config). */
int kvs_kv_strategy_init_names(struct kvs_kv_strategy *s, const char *storage, const char *reuse,
                               const char *decode, const char *backend_name, struct kvs_block_pool *pool,
                               char *err, size_t errlen);

#endif
