/* cuda_pair.h: what the CUDA-against-CPU tests share (test_cuda_ops, test_cuda_span,
 * test_cuda_attn_prefill). Header-only (static); one copy per test program.
 *   C, G, bc, bg      the CPU (reference) and CUDA backends' ops and instances; the test's main
 *                     creates bc and bg with cuda_pair_open and frees them.
 *   rng, frand, irand fresh random inputs from a seed printed at start (cuda_pair_open: KVS_SEED
 *                     replays a run); frand is uniform in [-1, 1).
 *   (bf16 rounding: base/half.h kvs_bf16_round, so both backends hold the same values where CUDA
 *                     stores bf16: weights, KV)
 *   rel_l2            |a - ref| / |ref| over n floats (|a - ref| where ref is all zero; INFINITY
 *                     when a holds a NaN or an infinity, so an unwritten output fails any bound).
 *   batch_layout      rows, positions and a scattered block order for a test batch.
 *   struct pair       one buffer on each backend with the same elements (mk, drop); poison fills
 *                     the CUDA side with NaN so an output the kernel failed to write shows;
 *                     dl_c / dl_g download a side (the caller frees).
 *   kv_pools_make, rand_queries, rope_inv_freq   a paged attention case's pools, queries and
 *                     RoPE frequencies (test_cuda_attn_prefill, test_cuda_attn_cudnn).
 * Allocation failures panic (a test has nothing to recover). */
#ifndef KVS_TEST_CUDA_PAIR_H
#define KVS_TEST_CUDA_PAIR_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/util.h"
#include "base/half.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "tests/unit/test_util.h"

static const struct kvs_backend_ops *C = &kvs_cpu_backend, *G = &kvs_cuda_backend;
static struct kvs_backend *bc, *bg;
static uint64_t rng;

static inline float frand(void) { return (float)(kvs_test_xorshift(&rng) >> 8) * (1.0f / 8388608.0f) - 1.0f; }
static inline int irand(int n) { return (int)(kvs_test_xorshift(&rng) % (uint32_t)n); }

static inline double rel_l2(const float *a, const float *ref, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(a[i])) return INFINITY;
        const double d = (double)a[i] - ref[i];
        num += d * d;
        den += (double)ref[i] * ref[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

struct pair {
    struct kvs_dbuf *c, *g;
    enum kvs_buf_kind kind;
    size_t n;
};

static inline struct pair mk(enum kvs_buf_kind kind, size_t n, const void *host)
{
    struct pair p = {C->alloc(bc, kind, n ? n : 1), G->alloc(bg, kind, n ? n : 1), kind, n};
    if (!p.c || !p.g) kvs_panic(__FILE__, __LINE__, "alloc of %zu elements failed", n);
    if (host && n) {
        C->upload(bc, p.c, 0, host, n);
        G->upload(bg, p.g, 0, host, n);
    }
    return p;
}

static inline void drop(struct pair *p)
{
    C->free_buf(bc, p->c);
    G->free_buf(bg, p->g);
}

static inline void poison(struct pair *p)
{
    if (!p->n) return;
    float *nan = kvs_xmalloc(p->n * sizeof(float));
    memset(nan, 0xff, p->n * sizeof(float)); /* all-ones: a NaN as fp32, and as bf16 after conversion */
    G->upload(bg, p->g, 0, nan, p->n);
    free(nan);
}

static inline float *dl_c(struct pair *p)
{
    float *h = kvs_xmalloc((p->n ? p->n : 1) * sizeof(float));
    C->download(bc, h, p->c, 0, p->n);
    return h;
}

static inline float *dl_g(struct pair *p)
{
    float *h = kvs_xmalloc((p->n ? p->n : 1) * sizeof(float));
    G->download(bg, h, p->g, 0, p->n);
    return h;
}

/* A test batch of S (<= 4) sequences, sequence s with pos[s] cached tokens and ntok[s] new rows,
 * in blocks of bs slots: the rows' q_start, the positions, the longest block table (max_blocks),
 * the longest context, and perm, a random permutation of n_blocks = every block the batch uses
 * plus 2 spares; tables draw their blocks from perm in order, so they are scattered over the
 * cache and two blocks stay unread. perm is the caller's to free. */
struct batch_layout {
    int n, max_blocks, n_blocks, max_ctx;
    int32_t q_start[5], pos[4];
    int32_t *perm;
};

static inline void batch_layout_make(int S, int bs, const int *pos, const int *ntok, struct batch_layout *b)
{
    REQUIRE(S >= 1 && S <= 4, "batch_layout: %d sequences", S);
    int total_blocks = 0;
    b->n = b->max_blocks = b->max_ctx = 0;
    for (int s = 0; s < S; s++) {
        const int ctx = pos[s] + ntok[s], nb = (ctx + bs - 1) / bs;
        if (nb > b->max_blocks) b->max_blocks = nb;
        total_blocks += nb;
        if (ctx > b->max_ctx) b->max_ctx = ctx;
        b->q_start[s] = b->n;
        b->pos[s] = pos[s];
        b->n += ntok[s];
    }
    b->q_start[S] = b->n;
    b->n_blocks = total_blocks + 2;
    b->perm = kvs_xmalloc((size_t)b->n_blocks * sizeof *b->perm);
    for (int i = 0; i < b->n_blocks; i++) b->perm[i] = i;
    for (int i = b->n_blocks - 1; i > 0; i--) {
        const int j = irand(i + 1);
        const int32_t t = b->perm[i];
        b->perm[i] = b->perm[j];
        b->perm[j] = t;
    }
}

/* A paged case's K and V pools (cache_n elements each) on both backends: the CPU's uploaded from
 * kv / vv (every slot); the GPU's allocated only, for the caller to upload its own copy (whose
 * slots no query reads it fills its own way: NaN, large finite values). */
static inline void kv_pools_make(size_t cache_n, const float *kv, const float *vv, struct pair *kc, struct pair *vc)
{
    *kc = (struct pair){C->alloc(bc, KVS_BUF_KV, cache_n), G->alloc(bg, KVS_BUF_KV, cache_n), KVS_BUF_KV, cache_n};
    *vc = (struct pair){C->alloc(bc, KVS_BUF_KV, cache_n), G->alloc(bg, KVS_BUF_KV, cache_n), KVS_BUF_KV, cache_n};
    REQUIRE(kc->c && kc->g && vc->c && vc->g, ": KV allocation");
    C->upload(bc, kc->c, 0, kv, cache_n);
    C->upload(bc, vc->c, 0, vv, cache_n);
}

/* n random values of 3 x frand(): queries whose scores are peaked, so a wrong mask shows (the
 * caller frees) */
static inline float *rand_queries(size_t n)
{
    float *q = kvs_xmalloc(n * 4);
    for (size_t i = 0; i < n; i++) q[i] = 3.0f * frand();
    return q;
}

/* RoPE's hd / 2 inverse frequencies, base 10000 (the caller frees) */
static inline float *rope_inv_freq(int hd)
{
    float *inv = kvs_xmalloc((size_t)hd / 2 * 4);
    for (int i = 0; i < hd / 2; i++) inv[i] = (float)pow(10000.0, -2.0 * i / hd);
    return inv;
}

/* Seeds rng (KVS_SEED, else the clock; printed), then creates bc with cpu_threads threads and
 * bg; 0, or 1 after a message on stderr (no GPU: the test exits 1). */
static inline int cuda_pair_open(int cpu_threads)
{
    const char *es = getenv("KVS_SEED");
    uint64_t seed = es ? strtoull(es, NULL, 10) : (uint64_t)time(NULL) * 2654435761u + (uint64_t)clock();
    if (!seed) seed = 1;
    rng = seed;
    setvbuf(stdout, NULL, _IOLBF, 0);
    printf("seed %llu (replay with KVS_SEED=%llu)\n", (unsigned long long)seed, (unsigned long long)seed);
    char err[256];
    bc = C->create(cpu_threads, err, sizeof err);
    if (!bc) {
        fprintf(stderr, "cpu backend: %s\n", err);
        return 1;
    }
    bg = G->create(0, err, sizeof err);
    if (!bg) {
        fprintf(stderr, "cuda backend unavailable: %s\n", err);
        return 1;
    }
    return 0;
}

#endif
