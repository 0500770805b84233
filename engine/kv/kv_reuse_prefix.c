/* kv_reuse_prefix.c: kv.reuse=prefix: automatic prefix caching (prefix_cache.h). At admission
 * the leading full blocks whose token chain is already in the table are shared; after each
 * step newly completed blocks are registered. */
#include "engine/kv/kv.h"

#include <stdlib.h>

#include "base/util.h"
#include "engine/kv/prefix_cache.h"

struct prefix_state {
    struct kvs_prefix_cache cache;
};

static int prefix_init(struct kvs_kv *kv, const struct kvs_config *cfg, size_t bytes_per_block, char *err, size_t errlen)
{
    (void)cfg, (void)bytes_per_block;
    struct prefix_state *s = calloc(1, sizeof *s);
    if (!s) return kvs_err(err, errlen, -ENOMEM, "kv.reuse=prefix: out of memory");
    int rc = kvs_prefix_cache_init(&s->cache, kv->pool);
    if (rc < 0) {
        free(s);
        return kvs_err(err, errlen, rc, "kv.reuse=prefix: cannot allocate the prefix table");
    }
    kv->reuse_state = s;
    return 0;
}

static void prefix_free(struct kvs_kv *kv)
{
    struct prefix_state *s = kv->reuse_state;
    if (!s) return;
    kvs_prefix_cache_free(&s->cache);
    free(s);
    kv->reuse_state = NULL;
}

static int prefix_admit(struct kvs_kv *kv, struct kvs_kv_req *rq, const int32_t *tokens, int n,
                        struct kvs_block_table *t, int *matched)
{
    struct prefix_state *s = kv->reuse_state;
    int bs = kv->pool->block_size;
    int max_blocks = (n - 1) / bs;   /* the last token is always computed (its logits are needed) */
    if (max_blocks > t->cap) max_blocks = t->cap;
    rq->last_hash = KVS_PREFIX_ROOT_HASH;
    int m = kvs_prefix_cache_match(&s->cache, tokens, max_blocks, t->ids, &rq->last_hash);
    t->n = m;
    rq->n_hashed = m;
    *matched = m * bs;
    return m * bs;
}

static void prefix_commit(struct kvs_kv *kv, struct kvs_kv_req *rq, const int32_t *tokens, int n_computed,
                          const struct kvs_block_table *t)
{
    struct prefix_state *s = kv->reuse_state;
    int bs = kv->pool->block_size;
    int full = n_computed / bs;
    if (full > t->n) full = t->n;
    for (int i = rq->n_hashed; i < full; i++)
        rq->last_hash = kvs_prefix_cache_insert(&s->cache, rq->last_hash, tokens + (size_t)i * bs, t->ids[i], NULL);
    if (full > rq->n_hashed) rq->n_hashed = full;
}

static void prefix_release(struct kvs_kv *kv, struct kvs_kv_req *rq)
{
    (void)kv;
    rq->last_hash = 0;
    rq->n_hashed = 0;   /* a re-admission matches again from the root */
}

const struct kvs_kv_reuse_ops kvs_kv_reuse_prefix = {
    .name = "prefix",
    .init = prefix_init,
    .free = prefix_free,
    .admit = prefix_admit,
    .caches = 1,
    .commit = prefix_commit,
    .release = prefix_release,
};
