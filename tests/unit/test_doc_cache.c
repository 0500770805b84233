/* test_doc_cache.c: the LazyAttention document cache (engine/kv/doc_cache.c) over the block
 * pool, without a model:
 *   - metadata packing: off + 1 = 65535 accepted, 65536 rejected (never wraps into the block
 *     id), the same limit for a request's document layout;
 *   - hits, misses, a pending entry shared by a second request (computed once), position-aware
 *     keys (one replica per offset);
 *   - LRU vs LFU victims; a document over the budget is served but not kept (transient);
 *   - a random stress under a tiny budget and a small pool (private blocks competing): every
 *     block a simulated running request holds keeps its document's contents (a tag per block
 *     stands for the KV), and the cache and pool invariants hold after every operation. */
#include "engine/kv/block_pool.h"
#include "engine/kv/doc_cache.h"
#include "base/util.h"
#include "tests/unit/test_util.h"

#include <stdio.h>
#include <string.h>

static uint64_t rng = 88172645463325252ULL;
static uint32_t rnd(void) { return kvs_test_xorshift(&rng); }

static void test_packing(void)
{
    uint64_t w;
    int32_t b, off, pad;
    REQUIRE(kvs_lazy_pack(123456, 65534, 15, &w) == 0, "off+1 = 65535 fits");
    kvs_lazy_unpack(w, &b, &off, &pad);
    REQUIRE(b == 123456 && off == 65534 && pad == 15, "round trip %d %d %d", b, off, pad);
    REQUIRE(kvs_lazy_pack(7, 65535, 0, &w) == -ERANGE, "off+1 = 65536 rejected");
    REQUIRE(kvs_lazy_pack(7, 1 << 20, 0, &w) == -ERANGE, "large offset rejected");
    REQUIRE(kvs_lazy_pack(-1, 0, 0, &w) == -ERANGE, "negative block rejected");
    REQUIRE(kvs_lazy_pack(7, 0, 65536, &w) == -ERANGE, "pad over 16 bits rejected");
    REQUIRE(kvs_lazy_pack(INT32_MAX, 0, 3, &w) == 0, "largest block id");
    kvs_lazy_unpack(w, &b, &off, &pad);
    REQUIRE(b == INT32_MAX && off == 0 && pad == 3, "round trip max block");
    REQUIRE(kvs_lazy_pack(5, -1, 0, &w) == 0, "private block");
    kvs_lazy_unpack(w, &b, &off, &pad);
    REQUIRE(b == 5 && off == -1 && pad == 0, "private round trip");

    /* layouts: with block_size 1 the last document may start at slot 65534, not 65535 */
    struct kvs_lazy_seq s;
    int ok[2] = {65534, 1}, bad[2] = {65535, 1};
    REQUIRE(kvs_lazy_seq_init(&s, ok, 2, 70000, 1) == 0, "last start 65534 accepted");
    REQUIRE(s.doc_slots == 65535 && s.docs[1].start == 65534, "layout");
    kvs_lazy_seq_free(&s);
    REQUIRE(kvs_lazy_seq_init(&s, bad, 2, 70000, 1) == -E2BIG, "last start 65535 rejected");
    int lens[3] = {17, 1, 32};
    REQUIRE(kvs_lazy_seq_init(&s, lens, 3, 8, 16) == 0, "16-token blocks");
    REQUIRE(s.docs[0].start == 0 && s.docs[1].start == 32 && s.docs[2].start == 48 && s.doc_slots == 80 &&
              s.doc_tokens == 50, "padded coordinates");
    kvs_lazy_seq_free(&s);
    REQUIRE(kvs_lazy_seq_init(&s, lens, 3, 4, 16) == -E2BIG, "table too small");
    int empty[1] = {0};
    REQUIRE(kvs_lazy_seq_init(&s, empty, 1, 4, 16) == -EINVAL, "empty document");
    printf("packing: off+1 65535 ok, 65536 -ERANGE; layouts at the limit; padded coordinates: ok\n");
}

static void fill(int32_t *t, int n, int seed)
{
    for (int i = 0; i < n; i++) t[i] = seed * 1000 + i;
}

static void test_hits_pending_position(void)
{
    struct kvs_block_pool p;
    struct kvs_doc_cache dc;
    REQUIRE(kvs_block_pool_init(&p, 32, 4) == 0, "pool");
    REQUIRE(kvs_doc_cache_init(&dc, &p, KVS_DOC_LRU, 0, 0, 0) == 0, "cache");
    int32_t doc[10], b1[3], b2[3], b3[3];
    fill(doc, 10, 1);
    int hit;
    int e1 = kvs_doc_cache_acquire(&dc, doc, 10, 0, b1, &hit);
    REQUIRE(e1 >= 0 && !hit && !kvs_doc_cache_ready(&dc, e1), "miss creates a pending entry");
    /* a second request for the same missing document shares the pending entry */
    int e2 = kvs_doc_cache_acquire(&dc, doc, 10, 32, b2, &hit);
    REQUIRE(e2 == e1 && hit && !memcmp(b1, b2, sizeof b1) && dc.ent[e1].users == 2, "shared while pending");
    REQUIRE(kvs_block_pool_refcount(&p, b1[0]) == 2, "both hold the blocks");
    kvs_doc_cache_commit(&dc, e1, 6);
    REQUIRE(!kvs_doc_cache_ready(&dc, e1), "partial");
    kvs_doc_cache_commit(&dc, e1, 4);
    REQUIRE(kvs_doc_cache_ready(&dc, e1) && dc.tokens_computed == 10, "computed once");
    /* a different document with the same length is a miss */
    int32_t other[10];
    fill(other, 10, 2);
    int e3 = kvs_doc_cache_acquire(&dc, other, 10, 0, b3, &hit);
    REQUIRE(e3 != e1 && !hit, "different content");
    for (int i = 0; i < 3; i++) kvs_block_pool_unref(&p, b1[i]), kvs_block_pool_unref(&p, b2[i]), kvs_block_pool_unref(&p, b3[i]);
    kvs_doc_cache_release(&dc, e1);
    kvs_doc_cache_release(&dc, e1);
    kvs_doc_cache_release(&dc, e3);
    kvs_doc_cache_check(&dc);
    kvs_block_pool_check(&p);
    REQUIRE(p.n_lru == 6 && dc.n_entries == 2, "unused documents stay cached (%d lru)", p.n_lru);
    /* reused after release: a hit on the same blocks */
    int e4 = kvs_doc_cache_acquire(&dc, doc, 10, 64, b2, &hit);
    REQUIRE(e4 == e1 && hit && !memcmp(b1, b2, sizeof b1), "hit after release");
    for (int i = 0; i < 3; i++) kvs_block_pool_unref(&p, b2[i]);
    kvs_doc_cache_release(&dc, e4);
    kvs_doc_cache_clear(&dc);
    REQUIRE(dc.n_entries == 0 && p.n_free == 32, "clear");
    kvs_doc_cache_free(&dc);

    /* position-aware: one replica per offset */
    REQUIRE(kvs_doc_cache_init(&dc, &p, KVS_DOC_LRU, 1, 0, 0) == 0, "cache");
    e1 = kvs_doc_cache_acquire(&dc, doc, 10, 0, b1, &hit);
    e2 = kvs_doc_cache_acquire(&dc, doc, 10, 16, b2, &hit);
    REQUIRE(e1 != e2 && !hit, "another offset is another replica");
    e3 = kvs_doc_cache_acquire(&dc, doc, 10, 16, b3, &hit);
    REQUIRE(e3 == e2 && hit, "same offset hits");
    kvs_doc_cache_check(&dc);
    kvs_doc_cache_free(&dc);
    kvs_block_pool_free(&p);
    printf("hit/miss, pending entry shared and computed once, position-aware replicas: ok\n");
}

/* acquire + immediately release (a finished request) */
static int use_doc(struct kvs_doc_cache *dc, struct kvs_block_pool *p, int seed, int n, int *hit)
{
    int32_t t[64], b[16];
    fill(t, n, seed);
    int e = kvs_doc_cache_acquire(dc, t, n, 0, b, hit);
    REQUIRE(e >= 0, "acquire");
    if (!kvs_doc_cache_ready(dc, e)) kvs_doc_cache_commit(dc, e, n - dc->ent[e].n_done);
    for (int i = 0; i < dc->ent[e].n_blocks; i++) kvs_block_pool_unref(p, b[i]);
    kvs_doc_cache_release(dc, e);
    return e;
}

static void test_policies(void)
{
    for (int pol = 0; pol < 2; pol++) {
        struct kvs_block_pool p;
        struct kvs_doc_cache dc;
        REQUIRE(kvs_block_pool_init(&p, 64, 4) == 0, "pool");
        /* budget: two 8-token documents (2 blocks each, 100 bytes a block) */
        REQUIRE(kvs_doc_cache_init(&dc, &p, pol ? KVS_DOC_LFU : KVS_DOC_LRU, 0, 400, 100) == 0, "cache");
        int hit;
        use_doc(&dc, &p, 1, 8, &hit);   /* A, used three times */
        use_doc(&dc, &p, 1, 8, &hit);
        use_doc(&dc, &p, 1, 8, &hit);
        REQUIRE(hit, "A hits");
        use_doc(&dc, &p, 2, 8, &hit);   /* B, once, most recent */
        use_doc(&dc, &p, 3, 8, &hit);   /* C needs room */
        REQUIRE(dc.evictions == 1 && dc.cached_blocks == 4, "one eviction, budget kept");
        use_doc(&dc, &p, 1, 8, &hit);
        int a_kept = hit;
        if (pol == KVS_DOC_LRU) REQUIRE(!a_kept, "lru evicts A (least recent)");
        else REQUIRE(a_kept, "lfu keeps A (most used) and evicts B");
        kvs_doc_cache_check(&dc);
        kvs_block_pool_check(&p);
        /* a document bigger than the whole budget is served but not kept */
        int32_t t[20], b[5];
        fill(t, 20, 9);
        int e = kvs_doc_cache_acquire(&dc, t, 20, 0, b, &hit);
        REQUIRE(e >= 0 && dc.ent[e].transient && dc.cached_blocks == 0, "transient (everything unused was evicted)");
        kvs_doc_cache_commit(&dc, e, 20);
        for (int i = 0; i < 5; i++) kvs_block_pool_unref(&p, b[i]);
        kvs_doc_cache_release(&dc, e);
        REQUIRE(dc.n_entries == 0 && p.n_free == 64, "transient dropped with its last user");
        kvs_doc_cache_check(&dc);
        kvs_doc_cache_free(&dc);
        kvs_block_pool_free(&p);
    }
    printf("lru evicts the least recent, lfu the least used; over-budget documents are transient: ok\n");
}

#define NREQ 6
#define MAXD 4

struct sim_req {
    int active;
    int n_docs;
    int seed[MAXD], len[MAXD], entry[MAXD];
    int32_t blocks[MAXD][16];
    int32_t priv[8];
    int n_priv;
};

static void test_stress(void)
{
    const int NB = 40, BSZ = 4;
    struct kvs_block_pool p;
    struct kvs_doc_cache dc;
    REQUIRE(kvs_block_pool_init(&p, NB, BSZ) == 0, "pool");
    REQUIRE(kvs_doc_cache_init(&dc, &p, KVS_DOC_LFU, 0, 6 * 64, 64) == 0, "cache");   /* budget: 6 blocks */
    int64_t *tag = calloc((size_t)NB, sizeof *tag);   /* stands for a block's KV contents */
    struct sim_req req[NREQ];
    memset(req, 0, sizeof req);
    int n_ops = 0, n_evict_seen = 0, n_wait = 0, n_hit = 0, n_miss = 0;
    for (int it = 0; it < 20000; it++) {
        struct sim_req *r = &req[rnd() % NREQ];
        if (!r->active) {
            /* admit: up to MAXD documents from a small skewed corpus, then private blocks */
            r->n_docs = 1 + (int)(rnd() % MAXD);
            int ok = 1, d;
            for (d = 0; d < r->n_docs; d++) {
                int x = (int)(rnd() % 64);
                r->seed[d] = 1 + (x < 32 ? x % 3 : x % 12);
                r->len[d] = 1 + (r->seed[d] * 7) % 13;
                int32_t t[16];
                fill(t, r->len[d], r->seed[d]);
                int hit;
                r->entry[d] = kvs_doc_cache_acquire(&dc, t, r->len[d], 0, r->blocks[d], &hit);
                if (r->entry[d] < 0) {
                    ok = 0;
                    break;
                }
                int nb = dc.ent[r->entry[d]].n_blocks;
                if (hit) n_hit++; else n_miss++;
                if (!hit)
                    for (int k = 0; k < nb; k++) tag[r->blocks[d][k]] = r->seed[d] * 100 + k;
                if (!kvs_doc_cache_ready(&dc, r->entry[d])) kvs_doc_cache_commit(&dc, r->entry[d], r->len[d] - dc.ent[r->entry[d]].n_done);
            }
            r->n_priv = 0;
            int want = ok ? (int)(rnd() % 8) : 0;
            for (int k = 0; k < want; k++) {
                int32_t b = kvs_block_pool_alloc(&p);   /* may evict unused documents */
                if (b < 0) break;
                tag[b] = -1000 - b;
                r->priv[r->n_priv++] = b;
            }
            if (!ok) {
                /* could not hold its documents: give back what it took and wait */
                for (int i = 0; i < d; i++) {
                    for (int k = 0; k < dc.ent[r->entry[i]].n_blocks; k++) kvs_block_pool_unref(&p, r->blocks[i][k]);
                    kvs_doc_cache_release(&dc, r->entry[i]);
                }
                n_wait++;
            } else {
                r->active = 1;
            }
        } else {
            /* finish: first check that nothing it holds was taken */
            for (int d = 0; d < r->n_docs; d++) {
                const struct kvs_doc_entry *e = &dc.ent[r->entry[d]];
                REQUIRE(e->live && e->users > 0, "entry of a running request gone");
                for (int k = 0; k < e->n_blocks; k++) {
                    int32_t b = r->blocks[d][k];
                    REQUIRE(kvs_block_pool_refcount(&p, b) > 0, "block in use has refcount 0");
                    REQUIRE(tag[b] == r->seed[d] * 100 + k, "block %d of a running request was reused", b);
                }
                for (int k = 0; k < e->n_blocks; k++) kvs_block_pool_unref(&p, r->blocks[d][k]);
                kvs_doc_cache_release(&dc, r->entry[d]);
            }
            for (int k = 0; k < r->n_priv; k++) {
                REQUIRE(tag[r->priv[k]] == -1000 - r->priv[k], "private block reused");
                kvs_block_pool_unref(&p, r->priv[k]);
            }
            r->active = 0;
        }
        kvs_doc_cache_check(&dc);
        kvs_block_pool_check(&p);
        n_ops++;
    }
    n_evict_seen = (int)dc.evictions;
    REQUIRE(n_evict_seen > 100 && n_hit > 1000 && n_miss > 100, "exercised (%d evictions, %d hits, %d misses)",
          n_evict_seen, n_hit, n_miss);
    for (int i = 0; i < NREQ; i++) {
        struct sim_req *r = &req[i];
        if (!r->active) continue;
        for (int d = 0; d < r->n_docs; d++) {
            for (int k = 0; k < dc.ent[r->entry[d]].n_blocks; k++) kvs_block_pool_unref(&p, r->blocks[d][k]);
            kvs_doc_cache_release(&dc, r->entry[d]);
        }
        for (int k = 0; k < r->n_priv; k++) kvs_block_pool_unref(&p, r->priv[k]);
    }
    kvs_doc_cache_clear(&dc);
    REQUIRE(p.n_free == NB && dc.n_entries == 0, "everything back");
    free(tag);
    kvs_doc_cache_free(&dc);
    kvs_block_pool_free(&p);
    printf("stress (%d ops, %d hits, %d misses, %d evictions, %d admissions had to wait): blocks of running "
           "requests never reused: ok\n", n_ops, n_hit, n_miss, n_evict_seen, n_wait);
}

int main(void)
{
    test_packing();
    test_hits_pending_position();
    test_policies();
    test_stress();
    return 0;
}
