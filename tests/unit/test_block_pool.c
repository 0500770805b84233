/* test_block_pool.c: free list, refcounts, LRU of cached blocks, eviction callback, block
 * tables, checked against a simple model of the expected state after random operations. */
#include "engine/kv/block_pool.h"
#include "base/util.h"
#include "tests/unit/test_util.h"

#include <stdio.h>
#include <string.h>

static int n_evicted;
static int32_t last_evicted = -1;
static void evict_cb(void *ctx, int32_t b)
{
    (void)ctx;
    n_evicted++;
    last_evicted = b;
}

static uint64_t rng = 88172645463325252ULL;
static uint32_t rnd(void) { return kvs_test_xorshift(&rng); }

int main(void)
{
    struct kvs_block_pool p;
    REQUIRE(kvs_block_pool_init(&p, 0, 16) == -EINVAL);
    REQUIRE(kvs_block_pool_init(&p, 8, 0) == -EINVAL);
    REQUIRE(kvs_block_pool_init(&p, 4, 16) == 0);
    kvs_block_pool_set_evict(&p, evict_cb, NULL);

    /* basic alloc until empty */
    int32_t b[4];
    for (int i = 0; i < 4; i++) {
        b[i] = kvs_block_pool_alloc(&p);
        REQUIRE(b[i] == i);
        REQUIRE(kvs_block_pool_refcount(&p, b[i]) == 1);
        REQUIRE(kvs_block_pool_seg_base(&p, b[i]) == 0);
    }
    REQUIRE(kvs_block_pool_alloc(&p) == -1);
    REQUIRE(kvs_block_pool_available(&p) == 0 && kvs_block_pool_used(&p) == 4);
    kvs_block_pool_check(&p);

    /* shared block: two refs, freed only at the second unref */
    kvs_block_pool_ref(&p, b[1]);
    REQUIRE(kvs_block_pool_unref(&p, b[1]) == 1);
    REQUIRE(kvs_block_pool_available(&p) == 0);
    REQUIRE(kvs_block_pool_unref(&p, b[1]) == 0);
    REQUIRE(kvs_block_pool_available(&p) == 1 && p.n_free == 1);
    REQUIRE(kvs_block_pool_alloc(&p) == b[1]);

    /* cached blocks go to the LRU; eviction only when the free list is empty, oldest first */
    kvs_block_pool_set_cached(&p, b[2], 1);
    kvs_block_pool_set_cached(&p, b[3], 1);
    kvs_block_pool_set_seg_base(&p, b[3], 100);
    REQUIRE(kvs_block_pool_seg_base(&p, b[3]) == 100);
    REQUIRE(kvs_block_pool_unref(&p, b[3]) == 0);
    REQUIRE(kvs_block_pool_unref(&p, b[2]) == 0);
    REQUIRE(p.n_lru == 2 && p.n_free == 0 && kvs_block_pool_available(&p) == 2);
    kvs_block_pool_unref(&p, b[0]);          /* plain free block */
    kvs_block_pool_check(&p);
    REQUIRE(kvs_block_pool_alloc(&p) == b[0]); /* free list first: no eviction */
    REQUIRE(n_evicted == 0);
    /* revive b[3] from the LRU: it is not evicted */
    kvs_block_pool_ref(&p, b[3]);
    REQUIRE(p.n_lru == 1);
    int32_t e = kvs_block_pool_alloc(&p);
    REQUIRE(e == b[2] && n_evicted == 1 && last_evicted == b[2]);
    REQUIRE(kvs_block_pool_seg_base(&p, e) == 0 && !p.cached[e]);
    REQUIRE(kvs_block_pool_alloc(&p) == -1);
    kvs_block_pool_check(&p);
    /* un-caching an unreferenced cached block frees it */
    kvs_block_pool_unref(&p, b[3]);
    REQUIRE(p.n_lru == 1);
    kvs_block_pool_set_cached(&p, b[3], 0);
    REQUIRE(p.n_lru == 0 && p.n_free == 1);
    kvs_block_pool_check(&p);
    kvs_block_pool_free(&p);
    printf("basic free list / refcount / LRU / eviction: ok\n");

    /* LRU order: released 5,3,7 -> evicted 5,3,7 */
    REQUIRE(kvs_block_pool_init(&p, 10, 4) == 0);
    n_evicted = 0;
    kvs_block_pool_set_evict(&p, evict_cb, NULL);
    int32_t all[10];
    for (int i = 0; i < 10; i++) all[i] = kvs_block_pool_alloc(&p);
    int order[3] = {5, 3, 7};
    for (int i = 0; i < 3; i++) {
        kvs_block_pool_set_cached(&p, all[order[i]], 1);
        kvs_block_pool_unref(&p, all[order[i]]);
    }
    for (int i = 0; i < 3; i++) REQUIRE(kvs_block_pool_alloc(&p) == all[order[i]]);
    REQUIRE(n_evicted == 3);
    kvs_block_pool_free(&p);
    printf("LRU eviction order: ok\n");

    /* block tables: reserve, capacity, release in reverse order */
    REQUIRE(kvs_block_pool_init(&p, 6, 4) == 0);
    struct kvs_block_table t;
    REQUIRE(kvs_block_table_init(&t, 17, 4) == 0);
    REQUIRE(t.cap == 5);
    REQUIRE(kvs_block_table_blocks_needed(&t, 4, 9) == 3);
    REQUIRE(kvs_block_table_reserve(&t, &p, 9) == 0 && t.n == 3);
    REQUIRE(kvs_block_table_reserve(&t, &p, 12) == 0 && t.n == 3);
    REQUIRE(kvs_block_table_reserve(&t, &p, 13) == 0 && t.n == 4);
    REQUIRE(kvs_block_table_reserve(&t, &p, 21) == -E2BIG);
    struct kvs_block_table t2;
    REQUIRE(kvs_block_table_init(&t2, 40, 4) == 0);
    REQUIRE(kvs_block_table_reserve(&t2, &p, 16) == -ENOSPC && t2.n == 2);
    for (int i = 0; i < t.n; i++) kvs_block_pool_set_cached(&p, t.ids[i], 1);
    int32_t first = t.ids[0], lastb = t.ids[3];
    kvs_block_table_release(&t, &p);
    REQUIRE(t.n == 0 && p.n_lru == 4);
    REQUIRE(p.lru_head == lastb && p.lru_tail == first); /* tail of the prefix is evicted first */
    kvs_block_table_release(&t2, &p);
    REQUIRE(kvs_block_pool_used(&p) == 0);
    kvs_block_pool_check(&p);
    kvs_block_table_free(&t);
    kvs_block_table_free(&t2);
    kvs_block_pool_free(&p);
    printf("block tables: ok\n");

    /* offloaded ranges (kv.paris.offload): references go back, entries alias block 0, the table
     * keeps growing, release frees only what it holds */
    REQUIRE(kvs_block_pool_init(&p, 8, 4) == 0);
    REQUIRE(kvs_block_table_init(&t, 40, 4) == 0);
    REQUIRE(kvs_block_table_reserve(&t, &p, 24) == 0 && t.n == 6 && kvs_block_pool_available(&p) == 2);
    REQUIRE(kvs_block_table_offload(&t, &p, 1, 3) == 2 && kvs_block_pool_available(&p) == 4);
    REQUIRE(t.ids[1] == t.ids[0] && t.ids[2] == t.ids[0] && kvs_block_table_held(&t) == 4);
    REQUIRE(kvs_block_table_offload(&t, &p, 3, 4) == 1 && kvs_block_pool_available(&p) == 5);
    REQUIRE(t.off_lo == 1 && t.off_hi == 4 && kvs_block_table_blocks_needed(&t, 4, 25) == 1);
    REQUIRE(kvs_block_table_reserve(&t, &p, 36) == 0 && t.n == 9 && kvs_block_pool_available(&p) == 2);
    kvs_block_pool_check(&p);
    kvs_block_table_release(&t, &p);
    REQUIRE(t.n == 0 && t.off_lo == 0 && t.off_hi == 0 && kvs_block_pool_used(&p) == 0 && p.n_free == 8);
    kvs_block_pool_check(&p);
    kvs_block_table_free(&t);
    kvs_block_pool_free(&p);
    printf("offloaded block ranges: ok\n");

    /* random operations against a model (refcount per block, cached flag) */
    enum { NB = 64 };
    REQUIRE(kvs_block_pool_init(&p, NB, 8) == 0);
    n_evicted = 0;
    kvs_block_pool_set_evict(&p, evict_cb, NULL);
    int model_ref[NB] = {0}, model_cached[NB] = {0};
    for (int it = 0; it < 200000; it++) {
        uint32_t op = rnd() % 4;
        int32_t x = (int32_t)(rnd() % NB);
        if (op == 0) {
            int avail = 0;
            for (int i = 0; i < NB; i++) avail += model_ref[i] == 0;
            int32_t a = kvs_block_pool_alloc(&p);
            if (avail == 0) {
                REQUIRE(a == -1);
            } else {
                REQUIRE(a >= 0 && model_ref[a] == 0);
                model_ref[a] = 1;
                model_cached[a] = 0;
            }
        } else if (op == 1 && (model_ref[x] > 0 || model_cached[x])) {
            kvs_block_pool_ref(&p, x);
            model_ref[x]++;
        } else if (op == 2 && model_ref[x] > 0) {
            REQUIRE(kvs_block_pool_unref(&p, x) == --model_ref[x]);
        } else if (op == 3 && model_ref[x] > 0) {
            kvs_block_pool_set_cached(&p, x, 1);
            model_cached[x] = 1;
        }
        for (int i = 0; i < NB && (it % 997) == 0; i++) REQUIRE(p.refcount[i] == model_ref[i]);
        if (it % 9973 == 0) kvs_block_pool_check(&p);
    }
    kvs_block_pool_check(&p);
    kvs_block_pool_free(&p);
    printf("random operations vs model: ok (%d evictions)\n", n_evicted);
    return kvs_test_summary("test_block_pool");
}
