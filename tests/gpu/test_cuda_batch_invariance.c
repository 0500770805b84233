/* test_cuda_batch_invariance.c: the decode attention under batch-invariant numerics
 * (kvs_cuda_set_batch_invariant, config key batch_invariant): a decode row's output must be
 * bitwise the same alone as inside any batch, whatever the other rows' contexts, whether the
 * launch is recorded in a graph planned for a larger capacity (plan_ctx) and replayed as the
 * contexts grow, and with a prefill chunk in the same step. bf16 KV (the CUDA cache), random
 * queries, keys and block tables (fresh each run; KVS_SEED replays one). Each alone row is also
 * checked against the CPU backend (relative L2 under 1e-2), so the plan computes attention, not
 * merely the same thing twice.
 * Shapes: Llama-3.1-8B's attention (32 / 8 heads, head_dim 128: k_attn_fd, TMA staging), the demo
 * model's (4 / 1 heads, head_dim 64: the engine tests' model), a group of 32 query heads
 * (k_attn_tc's one-warp decode blocks), head_dim 256 with 64 heads (the plan's workspace
 * groups: more rows than one group's partials fit), and k_attn_fd with cp.async staging (kind 5,
 * blocks of 24 slots).
 * Informational: how many rows differ with the invariant plan off (the automatic plan), which is
 * why the option exists.
 * Needs a GPU: exits 1 with a message when none. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/util.h"
#include "kernels/backend.h"
#include "tests/unit/test_util.h"

#if defined(KVS_HAVE_CUDA) && KVS_HAVE_CUDA
#include "kernels/cuda/cuda_backend.h"

#include "tests/gpu/cuda_pair.h"

#define NROWS 64 /* decode rows of a shape, each with its own context */

struct shape {
    const char *name;
    int nh, nkv, hd, bs, max_ctx, kind; /* kind: decode kernel forced (-1: automatic) */
};

struct world {
    const struct shape *sh;
    int pool_blocks, max_blocks;
    struct pair kc, vc, q, fq;
    int32_t *bt;        /* [NROWS][max_blocks]: each row's blocks, drawn from the pool with repeats */
    int ctx[NROWS];     /* each row's context (pos + 1) */
    float **alone;      /* [NROWS]: the row's output alone, [nh * hd] */
};

static float *rand_vec(size_t n, float scale, int round_bf16)
{
    float *v = kvs_xmalloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) v[i] = round_bf16 ? kvs_bf16_round(frand() * scale) : frand() * scale;
    return v;
}

/* Attention of `n_rows` decode rows (rows[i]: a row of the world; contexts ctx[]) plus, when
 * pre > 0, a prefill chunk of `pre` tokens (a sequence of its own, positions 0 .. pre-1, over the
 * first row's blocks) at position `pre_at` of the batch, on the GPU (or the CPU: cpu = 1).
 * plan_ctx as the runner's graphs set it (0: none). graph: record the launch, replay it, then
 * (graph == 2) grow every row's context by grow[i] and replay the same recording. Returns the
 * outputs of the decode rows [n_rows][nh * hd] (the caller frees). */
struct batch {
    int n_rows, pre, pre_at, plan_ctx, graph, cpu;
    const int *rows;
    const int *grow;   /* graph == 2 */
};

static float *run_batch(struct world *w, const struct batch *b)
{
    const struct shape *sh = w->sh;
    const int nh = sh->nh, nkv = sh->nkv, hd = sh->hd, bs = sh->bs, mb = w->max_blocks;
    const int S = b->n_rows + (b->pre > 0);
    int32_t *q_start = kvs_xmalloc((size_t)(S + 1) * 4), *pos = kvs_xmalloc((size_t)S * 4);
    int32_t *bt = kvs_xcalloc((size_t)S * mb, 4);
    int *src = kvs_xmalloc((size_t)S * sizeof(int)); /* the world row of each sequence, -1: the prefill chunk */
    int n = 0, max_ctx = 1;
    for (int s = 0, r = 0; s < S; s++) {
        const int is_pre = b->pre > 0 && s == b->pre_at;
        src[s] = is_pre ? -1 : b->rows[r++];
        const int row = is_pre ? b->rows[0] : src[s];
        memcpy(bt + (size_t)s * mb, w->bt + (size_t)row * mb, (size_t)mb * 4);
        q_start[s] = n;
        pos[s] = is_pre ? 0 : w->ctx[row] - 1;
        n += is_pre ? b->pre : 1;
        const int c = is_pre ? b->pre : w->ctx[row];
        if (c > max_ctx) max_ctx = c;
    }
    q_start[S] = n;
    /* the queries: each decode row's own, the prefill chunk's from row 0 onwards (any values) */
    const size_t qd = (size_t)nh * hd;
    float *qh = kvs_xmalloc((size_t)n * qd * sizeof(float)), *all = kvs_xmalloc((size_t)NROWS * qd * sizeof(float));
    C->download(bc, all, w->q.c, 0, (size_t)NROWS * qd);
    for (int s = 0; s < S; s++) {
        if (src[s] >= 0) memcpy(qh + (size_t)q_start[s] * qd, all + (size_t)src[s] * qd, qd * sizeof(float));
        else for (int i = 0; i < b->pre; i++) memcpy(qh + (size_t)(q_start[s] + i) * qd, all + (size_t)(i % NROWS) * qd, qd * sizeof(float));
    }
    const struct kvs_backend_ops *o = b->cpu ? C : G;
    struct kvs_backend *be = b->cpu ? bc : bg;
    struct kvs_dbuf *q = o->alloc(be, KVS_BUF_ACT, (size_t)n * qd), *out = o->alloc(be, KVS_BUF_ACT, (size_t)n * qd);
    struct kvs_dbuf *qs = o->alloc(be, KVS_BUF_I32, (size_t)S + 1), *ps = o->alloc(be, KVS_BUF_I32, (size_t)S);
    struct kvs_dbuf *bts = o->alloc(be, KVS_BUF_I32, (size_t)S * mb);
    if (!q || !out || !qs || !ps || !bts) kvs_panic(__FILE__, __LINE__, "alloc failed");
    o->upload(be, q, 0, qh, (size_t)n * qd);
    o->upload(be, qs, 0, q_start, (size_t)S + 1);
    o->upload(be, ps, 0, pos, (size_t)S);
    o->upload(be, bts, 0, bt, (size_t)S * mb);
    {
        float *nan = kvs_xmalloc((size_t)n * qd * sizeof(float));
        memset(nan, 0xff, (size_t)n * qd * sizeof(float));
        o->upload(be, out, 0, nan, (size_t)n * qd);
        free(nan);
    }
    struct kvs_attn_meta m = {.n_seqs = S, .max_blocks = mb, .q_start = qs, .pos = ps, .block_tables = bts,
                              .h_q_start = q_start, .h_pos = pos, .max_ctx = max_ctx, .plan_ctx = b->plan_ctx};
    const float scale = 1.0f / sqrtf((float)hd);
    struct kvs_dbuf *kc = b->cpu ? w->kc.c : w->kc.g, *vc = b->cpu ? w->vc.c : w->vc.g;
    if (b->graph && !b->cpu) {
        G->graph_begin(bg);
        G->attention(bg, q, kc, vc, &m, n, nh, nkv, hd, bs, scale, out);
        char err[256];
        struct kvs_graph *gr = G->graph_end(bg, err, sizeof err);
        if (!gr) kvs_panic(__FILE__, __LINE__, "graph_end: %s", err);
        G->graph_launch(bg, gr);
        if (b->graph == 2) { /* contexts grow under the same recording (the runner's replays) */
            G->sync(bg);
            for (int s = 0; s < S; s++)
                if (src[s] >= 0) pos[s] += b->grow[s - (b->pre > 0 && s > b->pre_at)];
            G->upload(bg, ps, 0, pos, (size_t)S);
            G->graph_launch(bg, gr);
        }
        G->sync(bg);
        G->graph_free(bg, gr);
    } else {
        o->attention(be, q, kc, vc, &m, n, nh, nkv, hd, bs, scale, out);
    }
    float *res = kvs_xmalloc((size_t)b->n_rows * qd * sizeof(float));
    for (int s = 0, r = 0; s < S; s++)
        if (src[s] >= 0) o->download(be, res + (size_t)(r++) * qd, out, (size_t)q_start[s] * qd, qd);
    o->free_buf(be, q); o->free_buf(be, out); o->free_buf(be, qs); o->free_buf(be, ps); o->free_buf(be, bts);
    free(q_start); free(pos); free(bt); free(src); free(qh); free(all);
    return res;
}

/* rows of res (batch rows rows[]) that differ bitwise from their alone output (ctx as in w) */
static int n_differ(struct world *w, const float *res, const int *rows, int n_rows)
{
    const size_t qd = (size_t)w->sh->nh * w->sh->hd;
    int d = 0;
    for (int i = 0; i < n_rows; i++) d += memcmp(res + i * qd, w->alone[rows[i]], qd * sizeof(float)) != 0;
    return d;
}

static void alone_all(struct world *w, int check_cpu)
{
    const size_t qd = (size_t)w->sh->nh * w->sh->hd;
    double worst = 0;
    for (int r = 0; r < NROWS; r++) {
        free(w->alone[r]);
        struct batch b = {.n_rows = 1, .rows = &r};
        w->alone[r] = run_batch(w, &b);
        if (check_cpu) {
            b.cpu = 1;
            float *ref = run_batch(w, &b);
            const double e = rel_l2(w->alone[r], ref, qd);
            if (e > worst) worst = e;
            free(ref);
        }
    }
    if (check_cpu) {
        CHECK(worst < 1e-2, "%s: every row alone against the CPU backend: worst rel_l2 %.3e", w->sh->name, worst);
        printf("ok   %s: %d rows alone (contexts 1..%d) match the CPU backend, worst rel_l2 %.3e\n", w->sh->name, NROWS,
               w->sh->max_ctx, worst);
    }
}

static void test_shape(const struct shape *sh)
{
    struct world w = {.sh = sh};
    const int nkv = sh->nkv, hd = sh->hd, bs = sh->bs;
    /* room for the contexts to grow under a replayed graph (graph == 2), and a capacity above */
    const int cap = sh->max_ctx + 512;
    w.max_blocks = (cap + bs - 1) / bs;
    w.pool_blocks = 160;
    const size_t cache_n = (size_t)w.pool_blocks * nkv * bs * hd;
    float *kv0 = rand_vec(cache_n, 1.0f, 1), *vv0 = rand_vec(cache_n, 1.0f, 1);
    w.kc = mk(KVS_BUF_KV, cache_n, kv0);
    w.vc = mk(KVS_BUF_KV, cache_n, vv0);
    float *qv = rand_vec((size_t)NROWS * sh->nh * hd, 1.0f, 0);
    w.q = mk(KVS_BUF_ACT, (size_t)NROWS * sh->nh * hd, qv);
    w.bt = kvs_xmalloc((size_t)NROWS * w.max_blocks * 4);
    for (size_t i = 0; i < (size_t)NROWS * w.max_blocks; i++) w.bt[i] = irand(w.pool_blocks);
    /* contexts: the edges of the plan's units (1, 127..129, 2048 / 2049: the chunk doubles) and random */
    static const int edge[] = {1, 2, 127, 128, 129, 255, 256, 257, 2048, 2049, 4096, 4097};
    for (int r = 0; r < NROWS; r++) {
        const int c = r < (int)(sizeof edge / sizeof edge[0]) ? edge[r] : 1 + irand(sh->max_ctx);
        w.ctx[r] = c < sh->max_ctx ? c : sh->max_ctx;
    }
    w.alone = kvs_xcalloc(NROWS, sizeof *w.alone);
    if (sh->kind >= 0) kvs_cuda_set_dec_attn(bg, sh->kind);
    kvs_cuda_set_batch_invariant(bg, 1);
    alone_all(&w, 1);

    /* batches of 2..64 rows, two orders each, eager and recorded (planned at the capacity) */
    static const int sizes[] = {2, 3, 7, 16, 33, 64};
    int rows[NROWS];
    int bad_total = 0, checks = 0;
    for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++)
        for (int order = 0; order < 2; order++)
            for (int mode = 0; mode < 3; mode++) {
                const int nr = sizes[si], s0 = order ? irand(NROWS) : 0;
                for (int i = 0; i < nr; i++) rows[i] = (s0 + 7 * i) % NROWS;
                struct batch b = {.n_rows = nr, .rows = rows};
                if (mode == 1) b.graph = 1, b.plan_ctx = cap;      /* a graph bucket's capacity */
                if (mode == 2) b.pre = 40, b.pre_at = nr / 2;      /* a prefill chunk in the step */
                float *res = run_batch(&w, &b);
                const int d = n_differ(&w, res, rows, nr);
                CHECK(d == 0, "%s: batch of %d rows (order %d, %s): %d rows differ from alone", sh->name, nr, order,
                      mode == 1 ? "graph" : mode == 2 ? "with a prefill chunk" : "eager", d);
                bad_total += d;
                checks++;
                free(res);
            }
    printf("ok   %s: %d batches of 2..64 rows (eager, graph at capacity %d, with a prefill chunk): %d rows differ "
           "from alone\n", sh->name, checks, cap, bad_total);

    /* a recorded launch replayed as the contexts grow: the plan follows each row's new context */
    {
        const int nr = 33;
        int grow[NROWS];
        for (int i = 0; i < nr; i++) {
            rows[i] = (5 + 3 * i) % NROWS;
            grow[i] = 1 + irand(400);
        }
        struct batch b = {.n_rows = nr, .rows = rows, .graph = 2, .plan_ctx = cap, .grow = grow};
        float *res = run_batch(&w, &b);
        int saved[NROWS];
        memcpy(saved, w.ctx, sizeof saved);
        for (int i = 0; i < nr; i++) w.ctx[rows[i]] += grow[i]; /* rows[] are distinct (3 is prime to 64) */
        alone_all(&w, 0);
        const int d = n_differ(&w, res, rows, nr);
        CHECK(d == 0, "%s: graph replayed after the contexts grew: %d of %d rows differ from alone", sh->name, d, nr);
        printf("ok   %s: a graph recorded at capacity %d, replayed after the contexts grew by 1..400: %d of %d rows "
               "differ from alone\n", sh->name, cap, d, nr);
        free(res);
        memcpy(w.ctx, saved, sizeof saved);
        alone_all(&w, 0);
    }

    /* informational: the automatic plan (invariance off) on the full batch, eager and at the capacity */
    kvs_cuda_set_batch_invariant(bg, 0);
    {
        for (int i = 0; i < NROWS; i++) rows[i] = i;
        float *al[NROWS];
        for (int r = 0; r < NROWS; r++) {
            struct batch b1 = {.n_rows = 1, .rows = &r};
            al[r] = run_batch(&w, &b1);
        }
        struct batch b = {.n_rows = NROWS, .rows = rows, .graph = 1, .plan_ctx = cap};
        float *res = run_batch(&w, &b);
        const size_t qd = (size_t)sh->nh * hd;
        int d = 0;
        for (int i = 0; i < NROWS; i++) d += memcmp(res + i * qd, al[i], qd * sizeof(float)) != 0;
        printf("note %s: without batch invariance, %d of %d rows of a graphed batch differ from alone\n", sh->name, d,
               NROWS);
        for (int r = 0; r < NROWS; r++) free(al[r]);
        free(res);
    }
    kvs_cuda_set_dec_attn(bg, -1);
    for (int r = 0; r < NROWS; r++) free(w.alone[r]);
    free(w.alone);
    drop(&w.kc); drop(&w.vc); drop(&w.q);
    free(w.bt); free(kv0); free(vv0); free(qv);
}

int main(void)
{
    if (cuda_pair_open(4)) return 1;
    const char *e = getenv("KVS_CUDA_BATCH_INVARIANT");
    if (e) printf("note: KVS_CUDA_BATCH_INVARIANT=%s overrides kvs_cuda_set_batch_invariant\n", e);
    static const struct shape shapes[] = {
        {"llama-8b 32/8 hd128 (k_attn_fd, TMA)", 32, 8, 128, 16, 9000, -1},
        {"demo 4/1 hd64 (k_attn_fd)", 4, 1, 64, 16, 5000, -1},
        {"32/1 hd64 (k_attn_tc decode)", 32, 1, 64, 16, 3000, -1},
        {"64/8 hd256 (k_attn_fd, workspace groups)", 64, 8, 256, 16, 2500, -1},
        {"32/8 hd128 bs 24 (k_attn_fd, cp.async)", 32, 8, 128, 24, 3000, 5},
    };
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) test_shape(&shapes[i]);
    G->free(bg);
    C->free(bc);
    return kvs_test_summary("test_cuda_batch_invariance");
}

#else
int main(void)
{
    fprintf(stderr, "test_cuda_batch_invariance: built without CUDA (nvcc not found)\n");
    return 1;
}
#endif
