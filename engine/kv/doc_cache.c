/* doc_cache.c: the LazyAttention document cache over the block pool (see doc_cache.h). */
#include "engine/kv/doc_cache.h"

#include "engine/kv/block_pool.h"
#include "engine/kv/prefix_cache.h"
#include "base/util.h"

#include <string.h>

int kvs_lazy_pack(int32_t block, int32_t off, int32_t pad, uint64_t *out)
{
    if (block < 0 || pad < 0 || pad > 0xffff) return -ERANGE;
    int64_t field = off < 0 ? 0 : (int64_t)off + 1;
    if (field > KVS_LAZY_OFF_FIELD_MAX) return -ERANGE;
    *out = (uint64_t)(uint32_t)block << 32 | (uint64_t)field << 16 | (uint64_t)pad;
    return 0;
}

void kvs_lazy_unpack(uint64_t w, int32_t *block, int32_t *off, int32_t *pad)
{
    *block = (int32_t)(w >> 32);
    *off = (int32_t)((w >> 16) & 0xffff) - 1;
    *pad = (int32_t)(w & 0xffff);
}

uint64_t kvs_doc_hash(const int32_t *tokens, int n)
{
    /* the prefix cache's chained mix with a different root: document and prefix hashes never
     * meet, and the hash covers the length */
    return kvs_prefix_hash(0x243f6a8885a308d3ULL, tokens, n);
}

static uint64_t key_hash(const struct kvs_doc_cache *dc, uint64_t h, int32_t off)
{
    if (!dc->position_aware) return h;
    uint64_t z = h ^ ((uint64_t)(uint32_t)off * 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 31)) * 0xbf58476d1ce4e5b9ULL;
    return z ^ (z >> 29);
}

static void on_evict(void *ctx, int32_t b);
static int32_t pick_victim(void *ctx);

int kvs_doc_cache_init(struct kvs_doc_cache *dc, struct kvs_block_pool *pool, enum kvs_doc_policy policy,
                       int position_aware, int64_t budget_bytes, size_t bytes_per_block)
{
    memset(dc, 0, sizeof *dc);
    if (budget_bytes < 0 || (budget_bytes > 0 && bytes_per_block == 0)) return -EINVAL;
    dc->pool = pool;
    dc->block_size = pool->block_size;
    dc->policy = policy;
    dc->position_aware = position_aware;
    dc->bytes_per_block = bytes_per_block;
    dc->budget_blocks = budget_bytes > 0 ? budget_bytes / (int64_t)bytes_per_block : 0;
    if (budget_bytes > 0 && dc->budget_blocks == 0) dc->budget_blocks = -1;   /* smaller than a block: keep nothing */
    size_t nb = (size_t)pool->n_blocks;
    uint32_t nbk = 16;
    while (nbk < (uint32_t)pool->n_blocks) nbk <<= 1;
    dc->n_buckets = nbk;
    dc->ent = calloc(nb, sizeof *dc->ent);
    dc->buckets = malloc(nbk * sizeof *dc->buckets);
    dc->next_block = malloc(nb * sizeof *dc->next_block);
    dc->block_ent = malloc(nb * sizeof *dc->block_ent);
    dc->tokens = malloc(nb * (size_t)dc->block_size * sizeof *dc->tokens);
    if (!dc->ent || !dc->buckets || !dc->next_block || !dc->block_ent || !dc->tokens) {
        kvs_doc_cache_free(dc);
        return -ENOMEM;
    }
    for (uint32_t i = 0; i < nbk; i++) dc->buckets[i] = -1;
    for (size_t i = 0; i < nb; i++) dc->next_block[i] = dc->block_ent[i] = -1;
    for (size_t i = 0; i < nb; i++) dc->ent[i].hnext = i + 1 < nb ? (int32_t)(i + 1) : -1;
    dc->free_ent = 0;
    kvs_block_pool_set_evict(pool, on_evict, dc);
    kvs_block_pool_set_victim(pool, pick_victim, dc);
    return 0;
}

void kvs_doc_cache_free(struct kvs_doc_cache *dc)
{
    if (dc->pool && dc->pool->evict_ctx == dc) kvs_block_pool_set_evict(dc->pool, NULL, NULL);
    if (dc->pool && dc->pool->victim_ctx == dc) kvs_block_pool_set_victim(dc->pool, NULL, NULL);
    free(dc->ent);
    free(dc->buckets);
    free(dc->next_block);
    free(dc->block_ent);
    free(dc->tokens);
    memset(dc, 0, sizeof *dc);
}

static uint32_t bucket_of(const struct kvs_doc_cache *dc, uint64_t h) { return (uint32_t)(h & (dc->n_buckets - 1)); }

static int same_tokens(const struct kvs_doc_cache *dc, const struct kvs_doc_entry *e, const int32_t *tokens)
{
    int bs = dc->block_size, left = e->n_tokens;
    for (int32_t b = e->first_block; b >= 0 && left > 0; b = dc->next_block[b]) {
        int k = left < bs ? left : bs;
        if (memcmp(dc->tokens + (size_t)b * bs, tokens, (size_t)k * sizeof *tokens)) return 0;
        tokens += k;
        left -= k;
    }
    return left == 0;
}

static int find(const struct kvs_doc_cache *dc, uint64_t h, int32_t off_key, const int32_t *tokens, int n)
{
    for (int32_t i = dc->buckets[bucket_of(dc, h)]; i >= 0; i = dc->ent[i].hnext) {
        const struct kvs_doc_entry *e = &dc->ent[i];
        if (e->hash == h && e->off_key == off_key && e->n_tokens == n && same_tokens(dc, e, tokens)) return i;
    }
    return -1;
}

static void unlink_entry(struct kvs_doc_cache *dc, int idx)
{
    struct kvs_doc_entry *e = &dc->ent[idx];
    int32_t *pp = &dc->buckets[bucket_of(dc, e->hash)];
    while (*pp != idx) {
        KVS_ASSERT(*pp >= 0);
        pp = &dc->ent[*pp].hnext;
    }
    *pp = e->hnext;
    for (int32_t b = e->first_block, nx; b >= 0; b = nx) {
        nx = dc->next_block[b];
        dc->next_block[b] = -1;
        dc->block_ent[b] = -1;
    }
    if (!e->transient) dc->cached_blocks -= e->n_blocks;
    dc->n_entries--;
    memset(e, 0, sizeof *e);
    e->hnext = dc->free_ent;
    dc->free_ent = idx;
}

/* Pool callback: block b (refcount 0) is being taken for reuse; the whole entry goes. */
static void on_evict(void *ctx, int32_t b)
{
    struct kvs_doc_cache *dc = ctx;
    int idx = dc->block_ent[b];
    if (idx < 0) return;
    struct kvs_doc_entry *e = &dc->ent[idx];
    KVS_ASSERT(e->users == 0);
    for (int32_t o = e->first_block; o >= 0; o = dc->next_block[o])
        if (o != b) kvs_block_pool_set_cached(dc->pool, o, 0);   /* unreferenced: back to the free stack */
    unlink_entry(dc, idx);
    dc->evictions++;
}

/* The unused entry to evict next, by policy; unfinished entries (nobody is computing them)
 * go first. -1 when none. */
static int victim_entry(const struct kvs_doc_cache *dc)
{
    int best = -1;
    for (int i = 0; i < dc->pool->n_blocks; i++) {
        const struct kvs_doc_entry *e = &dc->ent[i];
        if (!e->live || e->users > 0 || e->transient) continue;
        if (kvs_block_pool_refcount(dc->pool, e->first_block) != 0) continue;
        if (best < 0) {
            best = i;
            continue;
        }
        const struct kvs_doc_entry *c = &dc->ent[best];
        int ue = e->n_done < e->n_tokens, uc = c->n_done < c->n_tokens;
        if (ue != uc) {
            if (ue) best = i;
            continue;
        }
        if (dc->policy == KVS_DOC_LFU && e->uses != c->uses) {
            if (e->uses < c->uses) best = i;
            continue;
        }
        if (e->last_use < c->last_use) best = i;
    }
    return best;
}

static int32_t pick_victim(void *ctx)
{
    struct kvs_doc_cache *dc = ctx;
    int v = victim_entry(dc);
    return v < 0 ? -1 : dc->ent[v].first_block;
}

static void evict_entry(struct kvs_doc_cache *dc, int idx)
{
    struct kvs_doc_entry *e = &dc->ent[idx];
    KVS_ASSERT(e->users == 0);
    for (int32_t b = e->first_block; b >= 0; b = dc->next_block[b]) {
        KVS_ASSERT(kvs_block_pool_refcount(dc->pool, b) == 0);
        kvs_block_pool_set_cached(dc->pool, b, 0);
    }
    unlink_entry(dc, idx);
    dc->evictions++;
}

int kvs_doc_cache_acquire(struct kvs_doc_cache *dc, const int32_t *tokens, int n, int32_t off, int32_t *blocks,
                          int *hit)
{
    KVS_ASSERT(n > 0);
    int bs = dc->block_size;
    int32_t off_key = dc->position_aware ? off : -1;
    uint64_t h = key_hash(dc, kvs_doc_hash(tokens, n), off_key);
    int idx = find(dc, h, off_key, tokens, n);
    dc->clock++;
    if (idx >= 0) {
        struct kvs_doc_entry *e = &dc->ent[idx];
        int k = 0;
        for (int32_t b = e->first_block; b >= 0; b = dc->next_block[b]) {
            kvs_block_pool_ref(dc->pool, b);
            blocks[k++] = b;
        }
        KVS_ASSERT(k == e->n_blocks);
        e->users++;
        e->uses++;
        e->last_use = dc->clock;
        *hit = 1;
        return idx;
    }
    *hit = 0;
    int nb = (n + bs - 1) / bs;
    /* the budget first: evict unused documents until this one fits, else keep it transient */
    int transient = 0;
    if (dc->budget_blocks != 0) {
        while (dc->budget_blocks < 0 || dc->cached_blocks + nb > dc->budget_blocks) {
            int v = victim_entry(dc);
            if (v < 0) break;
            evict_entry(dc, v);
        }
        transient = dc->budget_blocks < 0 || dc->cached_blocks + nb > dc->budget_blocks;
    }
    if (kvs_block_pool_available(dc->pool) < nb) return -ENOSPC;
    for (int k = 0; k < nb; k++) {
        int32_t b = kvs_block_pool_alloc(dc->pool);   /* may evict other unused documents */
        KVS_ASSERT(b >= 0);
        blocks[k] = b;
    }
    KVS_ASSERT(dc->free_ent >= 0);
    idx = dc->free_ent;
    struct kvs_doc_entry *e = &dc->ent[idx];
    dc->free_ent = e->hnext;
    memset(e, 0, sizeof *e);
    e->live = 1;
    e->hash = h;
    e->off_key = off_key;
    e->n_tokens = n;
    e->n_blocks = nb;
    e->first_block = blocks[0];
    e->users = 1;
    e->uses = 1;
    e->last_use = dc->clock;
    e->transient = transient;
    for (int k = 0; k < nb; k++) {
        int32_t b = blocks[k];
        dc->next_block[b] = k + 1 < nb ? blocks[k + 1] : -1;
        dc->block_ent[b] = idx;
        int m = n - k * bs < bs ? n - k * bs : bs;
        memcpy(dc->tokens + (size_t)b * bs, tokens + (size_t)k * bs, (size_t)m * sizeof *tokens);
        if (!transient) kvs_block_pool_set_cached(dc->pool, b, 1);
    }
    uint32_t bk = bucket_of(dc, h);
    e->hnext = dc->buckets[bk];
    dc->buckets[bk] = idx;
    if (!transient) dc->cached_blocks += nb;
    dc->n_entries++;
    return idx;
}

void kvs_doc_cache_release(struct kvs_doc_cache *dc, int idx)
{
    struct kvs_doc_entry *e = &dc->ent[idx];
    KVS_ASSERT(e->live && e->users > 0);
    if (--e->users == 0 && e->transient) unlink_entry(dc, idx);   /* its blocks were never cached */
}

void kvs_doc_cache_commit(struct kvs_doc_cache *dc, int idx, int n)
{
    struct kvs_doc_entry *e = &dc->ent[idx];
    KVS_ASSERT(e->live && n >= 0 && e->n_done + n <= e->n_tokens);
    e->n_done += n;
    dc->tokens_computed += (uint64_t)n;
}

void kvs_doc_cache_clear(struct kvs_doc_cache *dc)
{
    for (int v; (v = victim_entry(dc)) >= 0;) evict_entry(dc, v);
}

void kvs_doc_cache_check(const struct kvs_doc_cache *dc)
{
    int64_t cached = 0;
    int live = 0;
    for (int i = 0; i < dc->pool->n_blocks; i++) {
        const struct kvs_doc_entry *e = &dc->ent[i];
        if (!e->live) continue;
        live++;
        KVS_ASSERT(e->users >= 0 && e->n_done >= 0 && e->n_done <= e->n_tokens);
        int k = 0;
        for (int32_t b = e->first_block; b >= 0; b = dc->next_block[b]) {
            KVS_ASSERT(dc->block_ent[b] == i);
            int rc = kvs_block_pool_refcount(dc->pool, b);
            /* a block some request uses is referenced, hence never on the LRU list */
            KVS_ASSERT(rc >= e->users);
            KVS_ASSERT(e->transient ? !dc->pool->cached[b] : dc->pool->cached[b]);
            KVS_ASSERT(++k <= e->n_blocks);
        }
        KVS_ASSERT(k == e->n_blocks);
        if (!e->transient) cached += e->n_blocks;
    }
    KVS_ASSERT(live == dc->n_entries);
    KVS_ASSERT(cached == dc->cached_blocks);
    if (dc->budget_blocks > 0) {
        /* over budget only through entries in use when the budget was reached */
        int64_t unused = 0;
        for (int i = 0; i < dc->pool->n_blocks; i++)
            if (dc->ent[i].live && !dc->ent[i].transient && dc->ent[i].users == 0) unused += dc->ent[i].n_blocks;
        KVS_ASSERT(dc->cached_blocks - unused <= dc->budget_blocks || unused == 0);
    }
}

/* ---- per request ------------------------------------------------------------------------ */

int kvs_lazy_seq_init(struct kvs_lazy_seq *s, const int *doc_len, int n_docs, int cap, int block_size)
{
    memset(s, 0, sizeof *s);
    if (n_docs <= 0 || cap <= 0 || block_size <= 0) return -EINVAL;
    int64_t slot = 0, toks = 0;
    for (int d = 0; d < n_docs; d++) {
        if (doc_len[d] <= 0) return -EINVAL;
        if (slot + 1 > KVS_LAZY_OFF_FIELD_MAX) return -E2BIG;   /* off + 1 must fit 16 bits */
        slot += (doc_len[d] + block_size - 1) / block_size * (int64_t)block_size;
        toks += doc_len[d];
    }
    if (slot / block_size > cap) return -E2BIG;
    s->docs = calloc((size_t)n_docs, sizeof *s->docs);
    s->meta = calloc((size_t)cap, sizeof *s->meta);
    s->rot = calloc((size_t)cap, sizeof *s->rot);
    s->valid = malloc((size_t)cap * sizeof *s->valid);
    if (!s->docs || !s->meta || !s->rot || !s->valid) {
        kvs_lazy_seq_free(s);
        return -ENOMEM;
    }
    s->n_docs = n_docs;
    s->cap = cap;
    int start = 0;
    for (int d = 0; d < n_docs; d++) {
        struct kvs_lazy_doc *ld = &s->docs[d];
        ld->start = start;
        ld->n_tokens = doc_len[d];
        ld->n_blocks = (doc_len[d] + block_size - 1) / block_size;
        ld->entry = -1;
        start += ld->n_blocks * block_size;
    }
    s->doc_slots = start;
    s->doc_tokens = (int)toks;
    for (int i = 0; i < cap; i++) s->valid[i] = block_size;
    return 0;
}

void kvs_lazy_seq_free(struct kvs_lazy_seq *s)
{
    free(s->docs);
    free(s->meta);
    free(s->rot);
    free(s->valid);
    memset(s, 0, sizeof *s);
}

void kvs_lazy_seq_release(struct kvs_doc_cache *dc, struct kvs_lazy_seq *s)
{
    for (int d = 0; d < s->n_docs; d++) {
        if (s->docs[d].entry >= 0) kvs_doc_cache_release(dc, s->docs[d].entry);
        s->docs[d].entry = -1;
    }
    s->held = 0;
    s->ready = 0;
}

int kvs_lazy_seq_acquire(struct kvs_doc_cache *dc, struct kvs_lazy_seq *s, const int32_t *tokens,
                         struct kvs_block_table *t, int *cached_tokens)
{
    KVS_ASSERT(t->n == 0 && s->held == 0);
    int bs = dc->block_size, cached = 0;
    for (int d = 0; d < s->n_docs; d++) {
        struct kvs_lazy_doc *ld = &s->docs[d];
        int32_t *blocks = t->ids + ld->start / bs;
        int hit = 0;
        int idx = kvs_doc_cache_acquire(dc, tokens + ld->start, ld->n_tokens, ld->start, blocks, &hit);
        if (idx < 0) {
            /* give back what this request took so far: it waits with nothing held */
            for (int i = 0; i < d; i++)
                for (int k = 0; k < s->docs[i].n_blocks; k++)
                    kvs_block_pool_unref(dc->pool, t->ids[s->docs[i].start / bs + k]);
            kvs_lazy_seq_release(dc, s);
            return idx;
        }
        ld->entry = idx;
        /* a document this request created in an earlier attempt (admission failed after the
         * lookup) is still its miss, not a hit on its own pending entry */
        if (!hit) ld->created = 1;
        ld->hit = hit && !ld->created;
        if (ld->hit) cached += ld->n_tokens;
        int pad = ld->n_blocks * bs - ld->n_tokens;
        for (int k = 0; k < ld->n_blocks; k++) {
            int j = ld->start / bs + k;
            int rc = kvs_lazy_pack(blocks[k], ld->start, k + 1 == ld->n_blocks ? pad : 0, &s->meta[j]);
            KVS_ASSERT(rc == 0);   /* offsets were checked by kvs_lazy_seq_init */
            int32_t blk, off, p;
            kvs_lazy_unpack(s->meta[j], &blk, &off, &p);
            s->rot[j] = off;
            s->valid[j] = bs - p;
        }
        s->held++;
    }
    t->n = s->doc_slots / bs;
    if (cached_tokens) *cached_tokens = cached;
    s->ready = 0;
    return s->doc_slots;
}

void kvs_lazy_seq_count(struct kvs_doc_cache *dc, const struct kvs_lazy_seq *s)
{
    for (int d = 0; d < s->n_docs; d++) {
        const struct kvs_lazy_doc *ld = &s->docs[d];
        if (ld->hit) {
            dc->hits++;
            dc->tokens_saved += (uint64_t)ld->n_tokens;
        } else {
            dc->misses++;
        }
    }
}

int kvs_lazy_seq_ready(const struct kvs_doc_cache *dc, struct kvs_lazy_seq *s)
{
    if (s->ready) return 1;
    if (s->held < s->n_docs) return 0;
    for (int d = 0; d < s->n_docs; d++)
        if (!kvs_doc_cache_ready(dc, s->docs[d].entry)) return 0;
    s->ready = 1;
    return 1;
}
