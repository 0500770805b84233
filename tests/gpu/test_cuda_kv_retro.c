/* test_cuda_kv_retro.c: kv.decode=retro (engine/kv/kv_decode_retro.c) on the CUDA backend, against
 * the CPU reference, on fresh random inputs each run (seed from the clock, printed; replay with
 * KVS_SEED=<seed>).
 *   step      one Retro step of several requests with windows of w = 1..8 rows over a random
 *             paged cache: the newest row over a random page selection, each past row over its
 *             supplement (kernels/kv_retro.h: the mask after a few earlier random selections;
 *             empty supplements included), one attention_spans call for every row, then
 *             attn_merge with random cached (o, lse) (newest rows: a zero row and lse -inf),
 *             as the policy runs it: CUDA out / lse against the CPU's (relative L2 < 1e-2, lse
 *             within 1e-2: bf16 K/V and q); rows with an empty supplement keep their cached
 *             output (within bf16 rounding);
 *   engine    the tiny Llama on device cuda: retro w = 1 gives quest's greedy tokens; retro at
 *             budget >= context (w = 2, 4) gives full attention's for most requests (bf16
 *             rounding of the re-run rows may flip a near-tie); at a small budget (w = 2) every
 *             request is served, supplements happen and the effective budget is > 1.
 * Needs a GPU: exits 1 with a message when none. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/util.h"
#include "kernels/backend.h"
#include "kernels/kv_retro.h"
#include "tests/unit/test_util.h"

#if defined(KVS_HAVE_CUDA) && KVS_HAVE_CUDA
#include "engine/config.h"
#include "engine/engine.h"
#include "kernels/cuda/cuda_backend.h"
#include "models/model.h"

static const struct kvs_backend_ops *C = &kvs_cpu_backend, *G = &kvs_cuda_backend;
static struct kvs_backend *bc, *bg;

#define NH 8
#define NKV 2
#define HD 64
#define BS 16
#define NS 6
#define MAXW 8
#define MAXCTX 4096
#define MB (MAXCTX / BS)
#define MS MB

static uint64_t rng;
static float frand(void) { return (float)((double)kvs_test_xorshift(&rng) / 4294967296.0 * 2.0 - 1.0); }

static double rel_l2(const float *a, const float *b, size_t n)
{
    double d = 0, r = 0;
    for (size_t i = 0; i < n; i++) d += ((double)a[i] - b[i]) * ((double)a[i] - b[i]), r += (double)b[i] * b[i];
    return r > 0 ? sqrt(d / r) : sqrt(d);
}

/* one backend's run of the step: uploads, spans, merge, downloads */
struct step_in {
    int n_rows;
    int32_t qs[NS + 1], pos[NS], bt[NS * MB];
    float *q, *k, *v, *oc, *lc;              /* q [n][NH][HD], cache, cached o / lse [n] */
    int32_t *n_sp, *sp;                      /* [n][NKV], [n][NKV][MS][2] */
    size_t n_kv;
};

static void run_step(const struct kvs_backend_ops *o, struct kvs_backend *b, const struct step_in *x, float *out,
                     float *lse)
{
    const size_t n = (size_t)x->n_rows, qd = NH * HD;
    struct kvs_dbuf *q = o->alloc(b, KVS_BUF_ACT, n * qd), *kc = o->alloc(b, KVS_BUF_KV, x->n_kv);
    struct kvs_dbuf *vc = o->alloc(b, KVS_BUF_KV, x->n_kv), *ob = o->alloc(b, KVS_BUF_ACT, n * qd);
    struct kvs_dbuf *lb = o->alloc(b, KVS_BUF_F32, n * NH), *d_out = o->alloc(b, KVS_BUF_ACT, n * qd);
    struct kvs_dbuf *d_lse = o->alloc(b, KVS_BUF_F32, n * NH), *qs = o->alloc(b, KVS_BUF_I32, NS + 1);
    struct kvs_dbuf *pos = o->alloc(b, KVS_BUF_I32, NS), *bt = o->alloc(b, KVS_BUF_I32, NS * MB);
    struct kvs_dbuf *nsp = o->alloc(b, KVS_BUF_I32, n * NKV), *sp = o->alloc(b, KVS_BUF_I32, n * NKV * MS * 2);
    REQUIRE(q && kc && vc && ob && lb && d_out && d_lse && qs && pos && bt && nsp && sp, "alloc");
    o->upload(b, q, 0, x->q, n * qd);
    o->upload(b, kc, 0, x->k, x->n_kv);
    o->upload(b, vc, 0, x->v, x->n_kv);
    o->upload(b, ob, 0, x->oc, n * qd);
    o->upload(b, lb, 0, x->lc, n * NH);
    o->upload(b, qs, 0, x->qs, NS + 1);
    o->upload(b, pos, 0, x->pos, NS);
    o->upload(b, bt, 0, x->bt, NS * MB);
    o->upload(b, nsp, 0, x->n_sp, n * NKV);
    o->upload(b, sp, 0, x->sp, n * NKV * MS * 2);
    int max_ctx = 0;
    for (int s = 0; s < NS; s++) max_ctx = x->pos[s] + x->qs[s + 1] - x->qs[s] > max_ctx ? x->pos[s] + x->qs[s + 1] - x->qs[s] : max_ctx;
    const struct kvs_attn_meta m = {.n_seqs = NS, .max_blocks = MB, .q_start = qs, .pos = pos, .block_tables = bt,
                                    .h_q_start = x->qs, .h_pos = x->pos, .max_ctx = max_ctx};
    const struct kvs_span_list sl = {MS, nsp, sp, x->n_sp, x->sp};
    o->attention_spans(b, q, kc, vc, &m, &sl, (int)n, NH, NKV, HD, BS, 1.0f / sqrtf((float)HD), d_out, d_lse);
    o->attn_merge(b, d_out, d_lse, ob, lb, (int)n, NH, HD);
    o->download(b, out, d_out, 0, n * qd);
    o->download(b, lse, d_lse, 0, n * NH);
    struct kvs_dbuf *bs[] = {q, kc, vc, ob, lb, d_out, d_lse, qs, pos, bt, nsp, sp};
    for (size_t i = 0; i < sizeof bs / sizeof bs[0]; i++) o->free_buf(b, bs[i]);
}

static void test_step(int round)
{
    struct step_in x;
    memset(&x, 0, sizeof x);
    const int n_blocks = NS * MB;
    x.n_kv = (size_t)n_blocks * NKV * BS * HD;
    x.k = kvs_xmalloc(x.n_kv * sizeof(float));
    x.v = kvs_xmalloc(x.n_kv * sizeof(float));
    for (size_t i = 0; i < x.n_kv; i++) x.k[i] = frand(), x.v[i] = frand();
    int perm[NS * MB];
    for (int i = 0; i < n_blocks; i++) perm[i] = i;
    for (int i = n_blocks - 1; i > 0; i--) {
        const int j = (int)(kvs_test_xorshift(&rng) % (uint32_t)(i + 1)), t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }
    int w[NS], newest[NS];
    x.qs[0] = 0;
    for (int s = 0; s < NS; s++) {
        w[s] = 1 + (int)(kvs_test_xorshift(&rng) % MAXW);
        newest[s] = 300 + (int)(kvs_test_xorshift(&rng) % (MAXCTX - 301));
        x.pos[s] = newest[s] - (w[s] - 1);
        x.qs[s + 1] = x.qs[s] + w[s];
        for (int j = 0; j < MB; j++) x.bt[s * MB + j] = perm[s * MB + j];
    }
    const int n = x.qs[NS];
    x.n_rows = n;
    x.q = kvs_xmalloc((size_t)n * NH * HD * sizeof(float));
    x.oc = kvs_xcalloc((size_t)n * NH * HD, sizeof(float));
    x.lc = kvs_xmalloc((size_t)n * NH * sizeof(float));
    x.n_sp = kvs_xcalloc((size_t)n * NKV, sizeof(int32_t));
    x.sp = kvs_xcalloc((size_t)n * NKV * MS * 2, sizeof(int32_t));
    for (int i = 0; i < n * NH * HD; i++) x.q[i] = 2 * frand();
    int empty_rows = 0, sup_rows = 0;
    static int32_t A[MB], M[MB], sel[MB];
    for (int s = 0; s < NS; s++) {
        const int t = 20, cur = newest[s] / BS;   /* the newest query is step t of its request */
        for (int g = 0; g < NKV; g++) {
            /* earlier steps' random selections build the mask */
            for (int p = 0; p < MB; p++) A[p] = -1;
            for (int tp = 0; tp <= t; tp++) {
                const int c = (newest[s] - (t - tp)) / BS;
                int ns = 0;
                for (int p = 0; p < c; p++)
                    if (kvs_test_xorshift(&rng) % 8 == 0) sel[ns++] = p;
                sel[ns++] = c;
                REQUIRE(kvs_retro_mask_step(A, MB, sel, ns, c, tp, M) == 0, "mask");
                if (tp < t) continue;
                /* the newest row: its selection as spans */
                const size_t tn = (size_t)(x.qs[s] + w[s] - 1) * NKV + g;
                int32_t *sp = x.sp + tn * MS * 2;
                int k = 0;
                for (int i = 0; i < ns; i++) {
                    const int lo = sel[i] * BS, hi = lo + BS < newest[s] + 1 ? lo + BS : newest[s] + 1;
                    if (k && sp[2 * k - 1] == lo) sp[2 * k - 1] = hi;
                    else sp[2 * k] = lo, sp[2 * k + 1] = hi, k++;
                }
                x.n_sp[tn] = k;
                (void)cur;
                for (int j = 0; j < w[s] - 1; j++) {
                    const int back = w[s] - 1 - j;
                    const size_t tpr = (size_t)(x.qs[s] + j) * NKV + g;
                    const int m = kvs_retro_supplement(sel, M, ns, t - back, newest[s] - back, BS,
                                                       x.sp + tpr * MS * 2, MS);
                    REQUIRE(m >= 0, "supplement");
                    x.n_sp[tpr] = m;
                }
            }
        }
        for (int j = 0; j < w[s]; j++) {
            const int row = x.qs[s] + j, past = j < w[s] - 1;
            int any = 0;
            for (int g = 0; g < NKV; g++) any |= x.n_sp[(size_t)row * NKV + g] > 0;
            if (past) {
                empty_rows += !any;
                sup_rows += any;
                for (int i = 0; i < NH * HD; i++) x.oc[(size_t)row * NH * HD + i] = frand();
                for (int h = 0; h < NH; h++) x.lc[row * NH + h] = 3 * frand() + 2;
            } else {
                for (int h = 0; h < NH; h++) x.lc[row * NH + h] = -INFINITY;
            }
        }
    }
    float *oc = kvs_xmalloc((size_t)n * NH * HD * sizeof(float)), *og = kvs_xmalloc((size_t)n * NH * HD * sizeof(float));
    float *lcp = kvs_xmalloc((size_t)n * NH * sizeof(float)), *lg = kvs_xmalloc((size_t)n * NH * sizeof(float));
    run_step(C, bc, &x, oc, lcp);
    run_step(G, bg, &x, og, lg);
    double worst = 0, worst_lse = 0, worst_keep = 0;
    for (int r = 0; r < n; r++) {
        const double e = rel_l2(og + (size_t)r * NH * HD, oc + (size_t)r * NH * HD, NH * HD);
        worst = e > worst || e != e ? e : worst;
        for (int h = 0; h < NH; h++) {
            const double a = lcp[r * NH + h], b = lg[r * NH + h];
            const double d = fabs(a - b) / (fabs(a) > 1 ? fabs(a) : 1);
            worst_lse = d > worst_lse || d != d ? d : worst_lse;
        }
        int any = 0;
        for (int g = 0; g < NKV; g++) any |= x.n_sp[(size_t)r * NKV + g] > 0;
        if (!any) {   /* an empty supplement: the cached output comes back */
            const double k = rel_l2(og + (size_t)r * NH * HD, x.oc + (size_t)r * NH * HD, NH * HD);
            worst_keep = k > worst_keep || k != k ? k : worst_keep;
        }
    }
    CHECK(worst < 1e-2 && worst_lse < 1e-2 && worst_keep < 1e-2,
          "round %d: cuda vs cpu out rel-L2 %.3g, lse %.3g, kept cache %.3g", round, worst, worst_lse, worst_keep);
    printf("ok retro step %d on cuda (%d rows, %d supplemented past rows, %d empty): out rel-L2 %.2e, lse %.2e, "
           "kept cache %.2e vs cpu\n", round, n, sup_rows, empty_rows, worst, worst_lse, worst_keep);
    free(x.k), free(x.v), free(x.q), free(x.oc), free(x.lc), free(x.n_sp), free(x.sp);
    free(oc), free(og), free(lcp), free(lg);
}

#define NJ 6
#define GEN 16

static void run_engine(struct kvs_model *model, const char *decode, double ratio, int min_budget, int w,
                       int32_t out[NJ][GEN], struct kvs_engine_stats *st)
{
    struct kvs_config c;
    kvs_config_init(&c);
    free(c.device), c.device = kvs_xstrdup("cuda");
    free(c.kv_reuse), c.kv_reuse = kvs_xstrdup("none");
    free(c.kv_decode), c.kv_decode = kvs_xstrdup(decode);
    c.kv_block_size = 16;
    c.kv_memory_bytes = 16 << 20;
    c.max_batch_tokens = 256;
    c.max_running = 4;
    c.max_model_len = 512;
    c.quest_dense_layers = 0;
    c.quest_budget_ratio = ratio;
    c.quest_min_budget = min_budget;
    c.retro_window = w;
    char err[256];
    struct kvs_engine *e;
    REQUIRE(kvs_engine_create(&c, model, NULL, &e, err, sizeof err) == 0, "%s", err);
    uint64_t r2 = 4242;
    struct kvs_request *r[NJ];
    static int32_t prompt[NJ][300];
    for (int i = 0; i < NJ; i++) {
        struct kvs_request_params p;
        memset(&p, 0, sizeof p);
        const int n = 150 + (int)(kvs_test_xorshift(&r2) % 140);
        for (int t = 0; t < n; t++) prompt[i][t] = 1 + (int32_t)(kvs_test_xorshift(&r2) % 1000);
        p.prompt = prompt[i];
        p.n_prompt = n;
        p.max_tokens = GEN;
        p.sampling.top_p = 1;
        p.sampling.repetition_penalty = 1;
        p.ignore_eos = 1;
        r[i] = kvs_request_new(&p, NULL, NULL);
        REQUIRE(r[i] && kvs_engine_submit(e, r[i], err, sizeof err) == 0, "submit: %s", err);
    }
    for (int i = 0; i < NJ; i++) {
        int n = 0, done = 0;
        struct kvs_event ev[16];
        while (!done) {
            int k = kvs_request_wait(r[i], ev, 16, 60.0);
            REQUIRE(k > 0, "no event for 60 s");
            for (int q = 0; q < k; q++) {
                if (ev[q].type == KVS_EV_TOKEN && n < GEN) out[i][n++] = ev[q].token;
                if (ev[q].type == KVS_EV_ERROR) fprintf(stderr, "error: %s\n", ev[q].error);
                if (ev[q].type != KVS_EV_TOKEN) done = 1;
                kvs_event_clear(&ev[q]);
            }
        }
        CHECK(n == GEN, "%s w=%d: request %d got %d tokens", decode, w, i, n);
        kvs_request_unref(r[i]);
    }
    kvs_engine_stats(e, st);
    kvs_engine_free(e);
    kvs_config_free(&c);
}

static int n_same(int32_t a[NJ][GEN], int32_t b[NJ][GEN])
{
    int same = 0;
    for (int i = 0; i < NJ; i++) same += !memcmp(a[i], b[i], sizeof a[i]);
    return same;
}

static void test_engine(void)
{
    char dir[1024], err[256];
    struct kvs_model *model;
    snprintf(dir, sizeof dir, "%s/tests/data/models/llama", kvs_test_root());
    REQUIRE(kvs_model_load(dir, &model, err, sizeof err) == 0, "%s", err);
    static int32_t full[NJ][GEN], quest[NJ][GEN], x[NJ][GEN];
    struct kvs_engine_stats st;
    run_engine(model, "full", 0.15, 256, 2, full, &st);
    run_engine(model, "quest", 0.15, 32, 1, quest, &st);
    run_engine(model, "retro", 0.15, 32, 1, x, &st);
    CHECK(n_same(quest, x) == NJ, "retro w=1 on cuda: %d of %d requests equal to quest", n_same(quest, x), NJ);
    printf("ok engine on cuda: retro w=1 gives quest's tokens (%d/%d requests)\n", n_same(quest, x), NJ);
    for (int w = 2; w <= 4; w += 2) {
        run_engine(model, "retro", 1.0, 0, w, x, &st);
        const double past = kvs_engine_kv_counter(&st, "kvserve:kv_retro_past_rows_total");
        CHECK(n_same(full, x) >= NJ - 1 && past > 0, "retro w=%d every page on cuda: %d of %d equal to full, %g past "
              "rows", w, n_same(full, x), NJ, past);
        printf("ok engine on cuda: retro w=%d with every page equals full for %d/%d requests (%g past rows)\n", w,
               n_same(full, x), NJ, past);
    }
    run_engine(model, "retro", 0.15, 32, 2, x, &st);
    const double sup = kvs_engine_kv_counter(&st, "kvserve:kv_retro_keys_supplement_total");
    const double eff = kvs_engine_kv_counter(&st, "kvserve:kv_retro_effective_budget");
    CHECK(sup > 0 && eff > 1.0, "retro w=2 at min budget 32 on cuda: %g supplement keys, effective budget %g", sup, eff);
    printf("ok engine on cuda: retro w=2 at 15%% (min 32): effective budget %.3fx quest's, %d/%d requests equal to "
           "quest's tokens\n", eff, n_same(quest, x), NJ);
    kvs_model_free(model);
}

int main(void)
{
    const char *es = getenv("KVS_SEED");
    uint64_t seed = es ? strtoull(es, NULL, 10) : (uint64_t)time(NULL) * 2654435761u + (uint64_t)clock();
    if (!seed) seed = 1;
    rng = seed;
    setvbuf(stdout, NULL, _IOLBF, 0);
    printf("seed %llu (replay with KVS_SEED=%llu)\n", (unsigned long long)seed, (unsigned long long)seed);
    kvs_log_set_level(KVS_LOG_WARN);
    char err[256];
    bc = C->create(2, err, sizeof err);
    if (!bc) { fprintf(stderr, "cpu backend: %s\n", err); return 1; }
    bg = G->create(0, err, sizeof err);
    if (!bg) { fprintf(stderr, "cuda backend unavailable: %s\n", err); return 1; }
    REQUIRE(G->attention_spans && G->attn_merge && G->gather_rows, "the CUDA backend lacks a Retro primitive");
    for (int i = 0; i < 4; i++) test_step(i);
    C->free(bc);
    G->free(bg);
    test_engine();
    return kvs_test_summary("test_cuda_kv_retro");
}
#else
int main(void)
{
    fprintf(stderr, "test_cuda_kv_retro: built without CUDA (nvcc not found)\n");
    return 1;
}
#endif
