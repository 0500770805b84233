/* strategy.c: the built-in KV strategies and name resolution (see strategy.h). */
#include "engine/kv/strategy.h"

#include "engine/config.h"
#include "engine/util.h"

#include <string.h>

static const struct kvs_kv_storage_ops storage_f32 = {"f32", KVS_KV_STORAGE_F32, 4};
static const struct kvs_kv_storage_ops storage_bf16 = {"bf16", KVS_KV_STORAGE_BF16, 2};

/* ---- reuse: none ------------------------------------------------------------------------ */
static int none_match(struct kvs_kv_strategy *s, const int32_t *tokens, int n, struct kvs_block_table *t,
                      struct kvs_kv_seq *seq)
{
    (void)s, (void)tokens, (void)n, (void)t;
    seq->last_hash = KVS_PREFIX_ROOT_HASH;
    seq->n_hashed = 0;
    return 0;
}

static void none_commit(struct kvs_kv_strategy *s, const int32_t *tokens, int n_computed,
                        const struct kvs_block_table *t, struct kvs_kv_seq *seq)
{
    (void)s, (void)tokens, (void)n_computed, (void)t, (void)seq;
}

static const struct kvs_kv_reuse_ops reuse_none = {"none", none_match, none_commit};
/* lazy: documents go through the doc cache (scheduler); the request's own tokens are private */
static const struct kvs_kv_reuse_ops reuse_lazy = {"lazy", none_match, none_commit};

/* ---- reuse: prefix ---------------------------------------------------------------------- */
static int prefix_match(struct kvs_kv_strategy *s, const int32_t *tokens, int n, struct kvs_block_table *t,
                        struct kvs_kv_seq *seq)
{
    int bs = s->pool->block_size;
    int max_blocks = (n - 1) / bs;   /* the last token is always computed (its logits are needed) */
    if (max_blocks > t->cap) max_blocks = t->cap;
    int m = kvs_prefix_cache_match(&s->prefix, tokens, max_blocks, t->ids, &seq->last_hash);
    t->n = m;
    seq->n_hashed = m;
    return m * bs;
}

static void prefix_commit(struct kvs_kv_strategy *s, const int32_t *tokens, int n_computed,
                          const struct kvs_block_table *t, struct kvs_kv_seq *seq)
{
    int bs = s->pool->block_size;
    int full = n_computed / bs;
    if (full > t->n) full = t->n;
    for (int i = seq->n_hashed; i < full; i++)
        seq->last_hash = kvs_prefix_cache_insert(&s->prefix, seq->last_hash, tokens + (size_t)i * bs, t->ids[i], NULL);
    if (full > seq->n_hashed) seq->n_hashed = full;
}

static const struct kvs_kv_reuse_ops reuse_prefix = {"prefix", prefix_match, prefix_commit};

/* ---- decode: full ----------------------------------------------------------------------- */
static const struct kvs_kv_decode_ops decode_full = {"full", 1, NULL};

int kvs_kv_strategy_init_names(struct kvs_kv_strategy *s, const char *storage, const char *reuse,
                               const char *decode, const char *backend_name, struct kvs_block_pool *pool,
                               char *err, size_t errlen)
{
    memset(s, 0, sizeof *s);
    s->pool = pool;
    int on_cuda = backend_name && strncmp(backend_name, "cuda", 4) == 0;

    if (!storage || !strcmp(storage, "auto")) s->storage = on_cuda ? &storage_bf16 : &storage_f32;
    else if (!strcmp(storage, "f32")) s->storage = &storage_f32;
    else if (!strcmp(storage, "bf16")) s->storage = &storage_bf16;
    else if (!strcmp(storage, "lean"))
        return kvs_err(err, errlen, -ENOSYS, "kv.storage \"lean\" is not built in this version (use auto, f32 or bf16)");
    else return kvs_err(err, errlen, -EINVAL, "kv.storage \"%s\" is unknown (auto, f32, bf16, lean)", storage);

    if (!reuse || !strcmp(reuse, "none")) s->reuse = &reuse_none;
    else if (!strcmp(reuse, "prefix")) s->reuse = &reuse_prefix;
    else if (!strcmp(reuse, "lazy")) s->reuse = &reuse_lazy, s->is_lazy = 1;
    else return kvs_err(err, errlen, -EINVAL, "kv.reuse \"%s\" is unknown (none, prefix, lazy)", reuse);

    if (!decode || !strcmp(decode, "full")) s->decode = &decode_full;
    else if (!strcmp(decode, "mac") || !strcmp(decode, "paris") || !strcmp(decode, "retro"))
        return kvs_err(err, errlen, -ENOSYS, "kv.decode \"%s\" is not built in this version (use full)", decode);
    else return kvs_err(err, errlen, -EINVAL, "kv.decode \"%s\" is unknown (full, mac, paris, retro)", decode);

    if (s->reuse == &reuse_prefix) {
        int rc = kvs_prefix_cache_init(&s->prefix, pool);
        if (rc < 0) return kvs_err(err, errlen, rc, "kv.reuse=prefix: cannot allocate the prefix table");
        s->has_prefix = 1;
    }
    return 0;
}

int kvs_kv_strategy_init(struct kvs_kv_strategy *s, const struct kvs_config *cfg, const char *backend_name,
                         struct kvs_block_pool *pool, char *err, size_t errlen)
{
    return kvs_kv_strategy_init_names(s, cfg->kv_storage, cfg->kv_reuse, cfg->kv_decode, backend_name, pool, err,
                                      errlen);
}

int kvs_kv_strategy_init_lazy(struct kvs_kv_strategy *s, const char *eviction, int position_aware,
                              int64_t budget_bytes, size_t bytes_per_block, char *err, size_t errlen)
{
    enum kvs_doc_policy pol;
    if (!eviction || !strcmp(eviction, "lru")) pol = KVS_DOC_LRU;
    else if (!strcmp(eviction, "lfu")) pol = KVS_DOC_LFU;
    else return kvs_err(err, errlen, -EINVAL, "kv.lazy.eviction \"%s\" is unknown (lru, lfu)", eviction);
    if (budget_bytes > 0 && bytes_per_block == 0)
        return kvs_err(err, errlen, -EINVAL, "kv.lazy.budget_bytes needs the executor's KV bytes per block");
    int rc = kvs_doc_cache_init(&s->docs, s->pool, pol, position_aware, budget_bytes, bytes_per_block);
    if (rc < 0) return kvs_err(err, errlen, rc, "kv.reuse=lazy: cannot set up the document cache");
    s->has_lazy = 1;
    return 0;
}

void kvs_kv_strategy_free(struct kvs_kv_strategy *s)
{
    if (s->has_lazy) kvs_doc_cache_free(&s->docs);
    if (s->has_prefix) kvs_prefix_cache_free(&s->prefix);
    memset(s, 0, sizeof *s);
}
