/* kv_reuse_lazy.c: kv.reuse=lazy: the LazyAttention document cache (doc_cache.h) behind the
 * reuse seam. A request's documents become segments of their own, each padded to a block
 * boundary (the Block-Attention layout); at admission every document is acquired from the
 * cache (hits are shared blocks, misses are created and become side prefills: each missing
 * document computed once, as its own sequence at local positions, however many requests
 * wait for it); the request runs once all its documents are in, its document blocks attended
 * with rotation offsets (deferred RoPE) and valid-slot counts. Requests without documents use
 * no reuse. */
#include "engine/kv/kv.h"

#include <stdlib.h>
#include <string.h>

#include "base/util.h"
#include "engine/config.h"
#include "engine/kv/doc_cache.h"

static int lazy_init(struct kvs_kv *kv, const struct kvs_config *cfg, size_t bytes_per_block, char *err, size_t errlen)
{
    const char *eviction = cfg ? cfg->lazy_eviction : "lru";
    int position_aware = cfg ? cfg->lazy_position_aware : 0;
    int64_t budget = cfg ? cfg->lazy_budget_bytes : 0;
    enum kvs_doc_policy pol;
    if (!eviction || !strcmp(eviction, "lru")) pol = KVS_DOC_LRU;
    else if (!strcmp(eviction, "lfu")) pol = KVS_DOC_LFU;
    else return kvs_err(err, errlen, -EINVAL, "config key 'kv.lazy.eviction': \"%s\" is unknown (lru, lfu)", eviction);
    if (budget > 0 && bytes_per_block == 0)
        return kvs_err(err, errlen, -EINVAL, "config key 'kv.lazy.budget_bytes' needs the executor's KV bytes per block");
    struct kvs_doc_cache *dc = calloc(1, sizeof *dc);
    if (!dc) return kvs_err(err, errlen, -ENOMEM, "kv.reuse=lazy: out of memory");
    int rc = kvs_doc_cache_init(dc, kv->pool, pol, position_aware, budget, bytes_per_block);
    if (rc < 0) {
        free(dc);
        return kvs_err(err, errlen, rc, "kv.reuse=lazy: cannot set up the document cache");
    }
    kv->reuse_state = dc;
    return 0;
}

static void lazy_free(struct kvs_kv *kv)
{
    struct kvs_doc_cache *dc = kv->reuse_state;
    if (!dc) return;
    kvs_doc_cache_free(dc);
    free(dc);
    kv->reuse_state = NULL;
}

static int lazy_seq_init(struct kvs_kv *kv, struct kvs_kv_req *rq, const int *doc_len, int n_docs, int table_cap,
                         char *err, size_t errlen)
{
    if (n_docs <= 0) return 0;
    struct kvs_lazy_seq *ls = calloc(1, sizeof *ls);
    int rc = ls ? kvs_lazy_seq_init(ls, doc_len, n_docs, table_cap, kv->pool->block_size) : -ENOMEM;
    if (rc < 0) {
        free(ls);
        return kvs_err(err, errlen, rc,
                       rc == -E2BIG ? "the documents do not fit the 16-bit offset field of the document cache (padded "
                                      "document region over 65535 slots)"
                                    : "out of memory for the request");
    }
    rq->priv = ls;
    return 0;
}

static void lazy_seq_free(struct kvs_kv_req *rq)
{
    if (!rq->priv) return;
    kvs_lazy_seq_free(rq->priv);
    free(rq->priv);
    rq->priv = NULL;
}

static int lazy_admit(struct kvs_kv *kv, struct kvs_kv_req *rq, const int32_t *tokens, int n, struct kvs_block_table *t,
                      int *matched)
{
    (void)n;
    *matched = 0;
    if (!rq->priv) return 0;
    return kvs_lazy_seq_acquire(kv->reuse_state, rq->priv, tokens, t, matched);
}

static void lazy_count(struct kvs_kv *kv, struct kvs_kv_req *rq)
{
    if (rq->priv) kvs_lazy_seq_count(kv->reuse_state, rq->priv);
}

static int lazy_ready(struct kvs_kv *kv, struct kvs_kv_req *rq)
{
    return !rq->priv || kvs_lazy_seq_ready(kv->reuse_state, rq->priv);
}

static int lazy_jobs(struct kvs_kv *kv, struct kvs_kv_req *rq, const int32_t *tokens, const struct kvs_block_table *t,
                     int chunk, int *budget, struct kvs_kv_job *out, int max)
{
    struct kvs_doc_cache *dc = kv->reuse_state;
    struct kvs_lazy_seq *ls = rq->priv;
    if (!ls || !ls->held || kvs_lazy_seq_ready(dc, ls)) return 0;
    int n = 0;
    for (int d = 0; d < ls->n_docs && *budget > 0 && n < max; d++) {
        const struct kvs_lazy_doc *ld = &ls->docs[d];
        struct kvs_doc_entry *de = &dc->ent[ld->entry];
        if (kvs_doc_cache_ready(dc, ld->entry) || de->sched) continue;
        int c = de->n_tokens - de->n_done;
        if (c > chunk) c = chunk;
        if (c > *budget) c = *budget;
        de->sched = c;
        out[n++] = (struct kvs_kv_job){ld->entry, tokens + ld->start + de->n_done, c, de->n_done,
                                       t->ids + ld->start / kv->pool->block_size, ld->n_blocks};
        *budget -= c;
    }
    return n;
}

static void lazy_job_done(struct kvs_kv *kv, int handle, int n_tokens, int ok)
{
    struct kvs_doc_cache *dc = kv->reuse_state;
    dc->ent[handle].sched = 0;
    if (ok) kvs_doc_cache_commit(dc, handle, n_tokens);
}

static void lazy_release(struct kvs_kv *kv, struct kvs_kv_req *rq)
{
    struct kvs_lazy_seq *ls = rq->priv;
    if (ls && ls->held) kvs_lazy_seq_release(kv->reuse_state, ls);
}

static void lazy_block_meta(struct kvs_kv *kv, struct kvs_kv_req *rq, const int32_t **rot, const int32_t **valid)
{
    (void)kv;
    const struct kvs_lazy_seq *ls = rq->priv;
    int docs = ls && ls->held;
    *rot = docs ? ls->rot : NULL;
    *valid = docs ? ls->valid : NULL;
}

static int lazy_counters(struct kvs_kv *kv, struct kvs_kv_counter *out, int cap)
{
    const struct kvs_doc_cache *dc = kv->reuse_state;
    const double look = (double)(dc->hits + dc->misses);
    const struct kvs_kv_counter c[] = {
        {"kvserve:doc_cache_hits_total", "Document lookups served from the LazyAttention doc cache.", 1, (double)dc->hits, NULL, NULL},
        {"kvserve:doc_cache_misses_total", "Document lookups that had to prefill the document.", 1, (double)dc->misses, NULL, NULL},
        {"kvserve:doc_cache_hit_ratio", "Doc cache hits / lookups.", 0, look > 0 ? (double)dc->hits / look : 0.0, NULL, NULL},
        {"kvserve:doc_cache_bytes", "KV bytes held by cached documents.", 0,
         (double)dc->cached_blocks * (double)dc->bytes_per_block, NULL, NULL},
        {"kvserve:doc_cache_documents", "Documents in the doc cache.", 0, (double)dc->n_entries, NULL, NULL},
        {"kvserve:doc_cache_evictions_total", "Documents evicted from the doc cache.", 1, (double)dc->evictions, NULL, NULL},
        {"kvserve:doc_cache_prefill_tokens_saved_total", "Document tokens served from the doc cache.", 1,
         (double)dc->tokens_saved, NULL, NULL},
        {"kvserve:doc_cache_prefill_tokens_total", "Document tokens prefilled into the doc cache.", 1,
         (double)dc->tokens_computed, NULL, NULL},
    };
    int n = (int)(sizeof c / sizeof c[0]);
    if (n > cap) n = cap;
    memcpy(out, c, (size_t)n * sizeof *out);
    return n;
}

const struct kvs_kv_reuse_ops kvs_kv_reuse_lazy = {
    .name = "lazy",
    .doc_segments = 1,
    .caches = 1,
    .init = lazy_init,
    .free = lazy_free,
    .seq_init = lazy_seq_init,
    .seq_free = lazy_seq_free,
    .admit = lazy_admit,
    .count = lazy_count,
    .ready = lazy_ready,
    .jobs = lazy_jobs,
    .job_done = lazy_job_done,
    .release = lazy_release,
    .block_meta = lazy_block_meta,
    .counters = lazy_counters,
};
