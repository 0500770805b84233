/* test_cuda_ops.c: every op of the CUDA backend against the fp32 CPU backend (the reference),
 * on fresh random inputs each run (seed from the clock, printed so a failure can be replayed
 * with KVS_SEED=<seed>).
 *
 * CUDA outputs are poisoned with NaN before each op; a NaN anywhere fails. Tolerances: relative
 * L2 error (||cuda - cpu|| / ||cpu||) under 1e-2 where bf16 enters (weights, KV, GEMM inputs),
 * 1e-5 for ops that are fp32 on both sides. Attention runs over random block tables, GQA
 * ratios 1/2/4/8/16, head dims 16..128, contexts up to a few thousand positions, decode rows
 * mixed with prefill chunks, block sizes that do and do not divide the kernel's tile, and
 * non-zero rot_offsets (deferred RoPE). argmax_rows must give exactly the CPU op's ids on rows
 * with planted ties, NaN, infinities and signed zeros (both its float4 and scalar paths).
 * Matmuls above the decode GEMM's rows run on each cuBLAS path (cuBLASLt timed / first pick,
 * cublasGemmEx), in and out of a graph capture, and in the accumulate form.
 * Needs a GPU: exits 1 with a message when none.
 */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/half.h"
#include "base/util.h"
#include "kernels/backend.h"
#include "models/model.h"
#include "tests/unit/test_util.h"

#if defined(KVS_HAVE_CUDA) && KVS_HAVE_CUDA
#include "kernels/cuda/cuda_backend.h"

#include "tests/gpu/cuda_pair.h"

static float *rand_vec(size_t n, float scale, int round_bf16)
{
    float *v = kvs_xmalloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) v[i] = round_bf16 ? kvs_bf16_round(frand() * scale) : frand() * scale;
    return v;
}

/* relative L2 error of the CUDA result against the CPU one over [off, off+n) */
static void check_range(const char *what, struct pair *p, size_t off, size_t n, double tol)
{
    float *a = kvs_xmalloc(n * sizeof(float)), *r = kvs_xmalloc(n * sizeof(float));
    G->download(bg, a, p->g, off, n);
    C->download(bc, r, p->c, off, n);
    double num = 0, den = 0;
    size_t nans = 0;
    for (size_t i = 0; i < n; i++) {
        if (isnan(a[i]) || isinf(a[i])) { nans++; continue; }
        double d = (double)a[i] - r[i];
        num += d * d;
        den += (double)r[i] * r[i];
    }
    double e = den > 0 ? sqrt(num / den) : sqrt(num);
    kvs_test_checks++;
    int ok = nans == 0 && e < tol;
    if (!ok) kvs_test_fails++;
    printf("%s %-58s rel_l2 %.3e (tol %.0e)%s\n", ok ? "ok  " : "FAIL", what, e, tol,
           nans ? "  NON-FINITE OUTPUT" : "");
    free(a);
    free(r);
}
static void check(const char *what, struct pair *p, double tol) { check_range(what, p, 0, p->n, tol); }

struct wpair {
    struct kvs_dweight *c, *g;
};

/* a weight from host fp32 values, presented to both backends as a tensor of dtype dt */
static struct wpair mkw(const float *v, int64_t rows, int64_t cols, int is_vec, enum kvs_dtype dt)
{
    size_t n = (size_t)(rows * cols);
    size_t es = dt == KVS_DTYPE_F32 ? 4 : 2;
    void *raw = kvs_xmalloc(n * es);
    for (size_t i = 0; i < n; i++) {
        if (dt == KVS_DTYPE_F32) ((float *)raw)[i] = v[i];
        else if (dt == KVS_DTYPE_BF16) ((uint16_t *)raw)[i] = kvs_f32_to_bf16(v[i]);
        else ((uint16_t *)raw)[i] = kvs_f32_to_f16(v[i]);
    }
    struct kvs_tensor_view t = {.dtype = dt, .ndim = is_vec ? 1 : 2, .data = raw, .nbytes = n * es, .file = "test"};
    if (is_vec) t.shape[0] = cols;
    else { t.shape[0] = rows; t.shape[1] = cols; }
    char err[256];
    struct wpair w = {C->upload_weight(bc, &t, err, sizeof err), G->upload_weight(bg, &t, err, sizeof err)};
    if (!w.c || !w.g) kvs_panic(__FILE__, __LINE__, "upload_weight: %s", err);
    free(raw);
    return w;
}
static void dropw(struct wpair *w)
{
    C->free_weight(bc, w->c);
    G->free_weight(bg, w->g);
}

/* ---- element-wise and row ops ------------------------------------------------------------ */

static void test_rows(void)
{
    char what[160];
    int ns[] = {1, 5, 64};
    for (int k = 0; k < 3; k++) {
        int n = ns[k], dim = k == 2 ? 4096 : 64 + 8 * k;
        float *xv = rand_vec((size_t)n * dim, 2.0f, 0), *dv = rand_vec((size_t)n * dim, 1.0f, 0);
        float *wv = rand_vec(dim, 1.0f, 0);
        struct wpair w = mkw(wv, 1, dim, 1, KVS_DTYPE_F32);
        struct pair x = mk(KVS_BUF_ACT, (size_t)n * dim, xv), d = mk(KVS_BUF_ACT, (size_t)n * dim, dv);
        struct pair o = mk(KVS_BUF_ACT, (size_t)n * dim, NULL);
        poison(&o);
        C->rmsnorm(bc, x.c, w.c, 1e-5f, n, dim, o.c);
        G->rmsnorm(bg, x.g, w.g, 1e-5f, n, dim, o.g);
        snprintf(what, sizeof what, "rmsnorm n=%d dim=%d", n, dim);
        check(what, &o, 1e-5);
        poison(&o);
        C->add_rmsnorm(bc, x.c, d.c, w.c, 1e-6f, n, dim, o.c);
        G->add_rmsnorm(bg, x.g, d.g, w.g, 1e-6f, n, dim, o.g);
        snprintf(what, sizeof what, "add_rmsnorm out n=%d dim=%d", n, dim);
        check(what, &o, 1e-5);
        snprintf(what, sizeof what, "add_rmsnorm residual n=%d dim=%d", n, dim);
        check(what, &x, 1e-6);
        /* swiglu, out distinct and out == gate */
        poison(&o);
        C->swiglu(bc, x.c, d.c, n, dim, o.c);
        G->swiglu(bg, x.g, d.g, n, dim, o.g);
        snprintf(what, sizeof what, "swiglu n=%d ff=%d", n, dim);
        check(what, &o, 1e-5);
        C->swiglu(bc, x.c, d.c, n, dim, x.c);
        G->swiglu(bg, x.g, d.g, n, dim, x.g);
        snprintf(what, sizeof what, "swiglu in place n=%d ff=%d", n, dim);
        check(what, &x, 1e-5);
        /* gather_rows (repeats allowed) */
        int m = 1 + irand(n + 2);
        int32_t *rows = kvs_xmalloc((size_t)m * sizeof(int32_t));
        for (int i = 0; i < m; i++) rows[i] = irand(n);
        struct pair r = mk(KVS_BUF_I32, (size_t)m, rows);
        struct pair go = mk(KVS_BUF_ACT, (size_t)m * dim, NULL);
        poison(&go);
        C->gather_rows(bc, d.c, r.c, m, dim, go.c);
        G->gather_rows(bg, d.g, r.g, m, dim, go.g);
        snprintf(what, sizeof what, "gather_rows m=%d of n=%d dim=%d", m, n, dim);
        check(what, &go, 1e-7);
        /* logits_to_host */
        float *hc = kvs_xmalloc((size_t)n * dim * 4), *hg = kvs_xmalloc((size_t)n * dim * 4);
        memset(hg, 0xff, (size_t)n * dim * 4);
        C->logits_to_host(bc, d.c, n, dim, hc);
        G->logits_to_host(bg, d.g, n, dim, hg);
        kvs_test_checks++;
        if (memcmp(hc, hg, (size_t)n * dim * 4)) { kvs_test_fails++; printf("FAIL logits_to_host n=%d\n", n); }
        else printf("ok   logits_to_host n=%d vocab=%d (exact)\n", n, dim);
        free(hc); free(hg); free(rows);
        drop(&r); drop(&go); drop(&x); drop(&d); drop(&o); dropw(&w);
        free(xv); free(dv); free(wv);
    }
}

/* ---- argmax_rows ------------------------------------------------------------------------- */

/* row r of a greedy-pick test: random values with a planted case (kind), positions drawn fresh */
static void argmax_row_case(float *x, int n, int kind)
{
    for (int i = 0; i < n; i++) x[i] = frand() * 8.0f;
    int a = irand(n), c = irand(n), lo = a < c ? a : c;
    switch (kind % 10) {
    case 0: break;                                                   /* plain random */
    case 1: x[a] = x[c] = 20.0f; break;                              /* a two-way tie anywhere */
    case 2: x[n - 1] = x[lo % 33] = 20.0f; break;                    /* a tie: low index vs the last one */
    case 3: for (int i = 0; i < n; i++) x[i] = 0.5f; break;          /* all equal: 0 */
    case 4:                                                          /* NaNs, one where the max may be */
        for (int i = 0; i < n; i++)
            if (irand(3) == 0) x[i] = NAN;
        x[a] = NAN;
        break;
    case 5: for (int i = 0; i < n; i++) x[i] = NAN; break;           /* all NaN: -1 */
    case 6: for (int i = 0; i < n; i++) x[i] = irand(2) ? NAN : -INFINITY; break;   /* nothing above -inf: -1 */
    case 7: for (int i = 0; i < n; i++) x[i] = irand(2) ? -1.0f : (irand(2) ? 0.0f : -0.0f); break;   /* +0 == -0 */
    case 8: x[a] = INFINITY; x[c] = INFINITY; x[irand(n)] = NAN; break;   /* +inf ties */
    case 9: for (int i = 0; i < n; i++) x[i] = (float)irand(4); break;    /* many-way ties */
    }
}

static void test_argmax(void)
{
    /* vocabularies: odd (scalar path), multiples of 4 (float4 path), Llama-3 and Qwen sizes */
    const int vocabs[] = {1, 7, 1000, 1001, 4099, 32000, 128256, 151936};
    const int ms[] = {1, 16, 5, 64};
    char what[160];
    for (size_t vi = 0; vi < sizeof vocabs / sizeof vocabs[0]; vi++) {
        int V = vocabs[vi], m = ms[vi % 4], off = irand(4);
        float *x = kvs_xmalloc((size_t)m * V * sizeof(float));
        for (int r = 0; r < m; r++) argmax_row_case(x + (size_t)r * V, V, r + irand(10));
        /* the logits buffer holds more rows than the op reads */
        struct pair L = mk(KVS_BUF_ACT, (size_t)(m + 1) * V, NULL);
        C->upload(bc, L.c, 0, x, (size_t)m * V);
        G->upload(bg, L.g, 0, x, (size_t)m * V);
        size_t n_out = (size_t)m + off + 2;
        int32_t *sent = kvs_xmalloc(n_out * sizeof(int32_t)), *hc = kvs_xmalloc(n_out * 4), *hg = kvs_xmalloc(n_out * 4);
        for (size_t i = 0; i < n_out; i++) sent[i] = -7;
        struct pair o = mk(KVS_BUF_I32, n_out, sent);
        C->argmax_rows(bc, L.c, m, V, o.c, (size_t)off);
        G->argmax_rows(bg, L.g, m, V, o.g, (size_t)off);
        C->download(bc, hc, o.c, 0, n_out);
        G->download(bg, hg, o.g, 0, n_out);
        int bad = 0, n_none = 0;
        for (size_t i = 0; i < n_out; i++) {
            if (hc[i] != hg[i]) {
                if (bad < 4) printf("     row %d: cuda %d cpu %d\n", (int)i - off, hg[i], hc[i]);
                bad++;
            }
            n_none += (int)i >= off && (int)i < off + m && hc[i] == -1;
        }
        kvs_test_checks++;
        if (bad) kvs_test_fails++;
        snprintf(what, sizeof what, "argmax_rows m=%d vocab=%d off=%d (%d rows with no pick)", m, V, off, n_none);
        printf("%s %-58s %s\n", bad ? "FAIL" : "ok  ", what, bad ? "ids differ from the CPU op" : "(exact)");
        drop(&L);
        drop(&o);
        free(x);
        free(sent);
        free(hc);
        free(hg);
    }
}

static float *dl(struct pair *y, size_t n);
static void expect_same(const char *what, const float *a, const float *b, size_t n);

static void test_embed_matmul(void)
{
    char what[160];
    const enum kvs_dtype dts[] = {KVS_DTYPE_F32, KVS_DTYPE_BF16, KVS_DTYPE_F16};
    const char *dtn[] = {"f32", "bf16", "f16"};
    /* n = 1 .. 128: the decode GEMM (in % 32 == 0, out % 16 == 0) or its fallback; n > 128: cuBLAS */
    struct { int n, in, out, bias; } cases[] = {{100, 512, 256, 1}, {128, 4096, 512, 0}, {57, 1024, 1024, 1},
                                                 {200, 256, 128, 0}, {1, 256, 384, 0}, {7, 512, 96, 1}, {64, 1024, 2048, 0}, {3, 4096, 1024, 1},
                                                 {8, 512, 100, 1}, {9, 264, 64, 0}, {2, 260, 72, 1}, {33, 64, 1024, 1},
                                                 {5, 14336, 200, 0}, {1, 14336, 304, 1}, {1, 4104, 33, 0},
                                                 {16, 4096, 1024, 0}, {17, 1024, 512, 1}, {32, 2048, 256, 0},
                                                 {31, 96, 48, 1}, {12, 32, 16, 0}, {128, 128, 4096, 1}, {72, 192, 1040, 0}};
    for (int c = 0; c < (int)(sizeof cases / sizeof cases[0]); c++) {
        int n = cases[c].n, in = cases[c].in, out = cases[c].out;
        enum kvs_dtype dt = dts[c % 3];
        float *wv = rand_vec((size_t)out * in, 0.05f, 0), *xv = rand_vec((size_t)n * in, 1.0f, 0);
        float *bv = rand_vec(out, 0.5f, 0);
        struct wpair w = mkw(wv, out, in, 0, dt), b = mkw(bv, 1, out, 1, dt);
        struct pair x = mk(KVS_BUF_ACT, (size_t)n * in, xv), y = mk(KVS_BUF_ACT, (size_t)n * out, NULL);
        C->matmul(bc, x.c, w.c, cases[c].bias ? b.c : NULL, n, in, out, y.c);
        /* both CUDA paths: cuBLAS (skinny_max 0) and the decode GEMM where it takes the shape */
        for (int sk = 0; sk < 2; sk++) {
            kvs_cuda_set_skinny_max(bg, sk ? 128 : 0);
            poison(&y);
            G->matmul(bg, x.g, w.g, cases[c].bias ? b.g : NULL, n, in, out, y.g);
            snprintf(what, sizeof what, "matmul %s n=%d in=%d out=%d bias=%d %s", dtn[c % 3], n, in, out,
                     cases[c].bias, sk ? "skinny_max=128" : "cublas");
            check(what, &y, 1e-2);
        }
        /* k_skinny's variants (two K groups in flight, the L2::256B hint) change no bit; the wgmma
         * kernel (variant bit 4: K split for two blocks per SM, or one with bit 1; bit 16: the split
         * reduced in a cluster's shared memory) against the CPU */
        if (n <= 128) {
            kvs_cuda_set_skinny_max(bg, 128);
            /* 238 = 46 | 64 (k_dgemm's one-tile blocks at 33-128 rows) | 128 (k_dgemm_n's 16-row x
             * tiles at 2-16 rows); 494 = 238 | 256 (its 32-row x tiles at 17-32 rows); 750 = 238 | 512
             * (batch invariance: the kernel by shape, from one row up, k_dgemm_n in launches of 64 rows) */
            static const int dgv[] = {4, 5, 14, 22, 46, 238, 494, 750};
            for (int vi = 0; vi < 8; vi++) {
                const int v = dgv[vi];
                kvs_cuda_set_skinny_variant(bg, v);
                poison(&y);
                G->matmul(bg, x.g, w.g, cases[c].bias ? b.g : NULL, n, in, out, y.g);
                snprintf(what, sizeof what, "matmul %s n=%d in=%d out=%d bias=%d skinny variant %d", dtn[c % 3], n,
                         in, out, cases[c].bias, v);
                check(what, &y, 1e-2);
            }
            /* the cluster's reduction adds the partials in the workspace's order: bitwise the same */
            for (int v = 6; v <= 7; v++) {
                kvs_cuda_set_skinny_variant(bg, v);
                poison(&y);
                G->matmul(bg, x.g, w.g, cases[c].bias ? b.g : NULL, n, in, out, y.g);
                float *ws_y = dl(&y, (size_t)n * out);
                kvs_cuda_set_skinny_variant(bg, v | 16);
                poison(&y);
                G->matmul(bg, x.g, w.g, cases[c].bias ? b.g : NULL, n, in, out, y.g);
                float *cl_y = dl(&y, (size_t)n * out);
                snprintf(what, sizeof what, "matmul n=%d in=%d out=%d skinny variant %d vs %d", n, in, out, v | 16, v);
                expect_same(what, cl_y, ws_y, (size_t)n * out);
                free(ws_y);
                free(cl_y);
            }
            kvs_cuda_set_skinny_variant(bg, 0);
            poison(&y);
            G->matmul(bg, x.g, w.g, cases[c].bias ? b.g : NULL, n, in, out, y.g);
            float *ref = dl(&y, (size_t)n * out);
            for (int v = 1; v < 4; v++) {
                kvs_cuda_set_skinny_variant(bg, v);
                poison(&y);
                G->matmul(bg, x.g, w.g, cases[c].bias ? b.g : NULL, n, in, out, y.g);
                float *got = dl(&y, (size_t)n * out);
                snprintf(what, sizeof what, "matmul n=%d in=%d out=%d skinny variant %d vs 0", n, in, out, v);
                expect_same(what, got, ref, (size_t)n * out);
                free(got);
            }
            kvs_cuda_set_skinny_variant(bg, -1);
            free(ref);
        }
        kvs_cuda_set_skinny_max(bg, 128);
        /* embed: the weight as a [vocab=out][dim=in] table */
        int32_t *tok = kvs_xmalloc((size_t)n * 4);
        for (int i = 0; i < n; i++) tok[i] = irand(out);
        struct pair tk = mk(KVS_BUF_I32, (size_t)n, tok), e = mk(KVS_BUF_ACT, (size_t)n * in, NULL);
        poison(&e);
        C->embed(bc, w.c, tk.c, n, in, e.c);
        G->embed(bg, w.g, tk.g, n, in, e.g);
        snprintf(what, sizeof what, "embed %s n=%d vocab=%d dim=%d", dtn[c % 3], n, out, in);
        check(what, &e, 1e-2);
        free(tok); drop(&tk); drop(&e);
        drop(&x); drop(&y); dropw(&w); dropw(&b);
        free(wv); free(xv); free(bv);
    }
}

/* rows [0, n) of y downloaded from the CUDA side */
static float *dl(struct pair *y, size_t n)
{
    float *h = kvs_xmalloc(n * sizeof(float));
    G->download(bg, h, y->g, 0, n);
    return h;
}

static void expect_same(const char *what, const float *a, const float *b, size_t n)
{
    kvs_test_checks++;
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) bad += memcmp(&a[i], &b[i], 4) != 0;
    if (bad) {
        kvs_test_fails++;
        printf("FAIL %s: %zu of %zu values differ\n", what, bad, n);
    } else {
        printf("ok   %s (bitwise)\n", what);
    }
}

static void expect_close(const char *what, const float *a, const float *r, size_t n, double tol);

/* The fused GEMMs (matmul_multi: q/k/v in one launch; matmul_swiglu: gate/up + SwiGLU) against
 * the CPU composition, and bitwise against the CUDA backend's own matmul / swiglu; and the
 * decode GEMM's batch invariance: a row's result does not depend on how many rows share it. */
/* With the wgmma kernel (variant bit 4) the K split is planned per launch (cuda_skinny.h), so a
 * part of q/k/v, or gate inside gate/up, may add its K ranges in another order than the same
 * weight alone: there the fused ops agree with the composition to fp32 rounding (1e-5), and are
 * bitwise equal with k_skinny; batch invariance is bitwise with both. */
static void expect_same_op(int variant, const char *what, const float *a, const float *b, size_t n)
{
    if (variant & 4) expect_close(what, a, b, n, 1e-5);
    else expect_same(what, a, b, n);
}

static void test_fused_gemm_at(int variant)
{
    char what[200];
    kvs_cuda_set_skinny_max(bg, 128);
    kvs_cuda_set_skinny_variant(bg, variant);
    printf("# decode GEMM variant %d\n", variant);
    /* Llama-3.1-8B's shapes at 100 rows; a 16-way K split (in 14336, 4 tiles); SmolLM2's (576: half
     * a 128-row tile, 9 K atoms) */
    struct { int n, in, q, kv, ff, bias; } cases[] = {{1, 4096, 4096, 1024, 14336, 0}, {8, 512, 512, 128, 1376, 1},
                                                       {13, 256, 256, 64, 688, 1}, {32, 1024, 2048, 256, 2816, 0},
                                                       {40, 256, 256, 64, 512, 1}, {3, 96, 96, 48, 200, 0},
                                                       {128, 512, 512, 128, 1408, 0}, {35, 128, 128, 32, 300, 0},
                                                       {100, 4096, 4096, 1024, 14336, 1}, {48, 14336, 256, 64, 512, 0},
                                                       {128, 576, 576, 192, 1536, 1}, {5, 576, 576, 192, 1536, 0}};
    for (int c = 0; c < (int)(sizeof cases / sizeof cases[0]); c++) {
        const int n = cases[c].n, in = cases[c].in, ff = cases[c].ff;
        const int outs[3] = {cases[c].q, cases[c].kv, cases[c].kv};
        float *xv = rand_vec((size_t)n * in, 1.0f, 0);
        struct pair x = mk(KVS_BUF_ACT, (size_t)n * in, xv);
        struct wpair w[3], bs[3];
        struct pair y[3], y1[3];
        float *wv[3], *bv[3];
        for (int p = 0; p < 3; p++) {
            wv[p] = rand_vec((size_t)outs[p] * in, 0.05f, 0);
            bv[p] = rand_vec((size_t)outs[p], 0.5f, 0);
            w[p] = mkw(wv[p], outs[p], in, 0, KVS_DTYPE_BF16);
            bs[p] = mkw(bv[p], 1, outs[p], 1, KVS_DTYPE_F32);
            y[p] = mk(KVS_BUF_ACT, (size_t)n * outs[p], NULL);
            y1[p] = mk(KVS_BUF_ACT, (size_t)n * outs[p], NULL);
            C->matmul(bc, x.c, w[p].c, cases[c].bias ? bs[p].c : NULL, n, in, outs[p], y[p].c);
            poison(&y[p]);
        }
        const struct kvs_dweight *wg[3] = {w[0].g, w[1].g, w[2].g}, *bg3[3] = {bs[0].g, bs[1].g, bs[2].g};
        struct kvs_dbuf *yg[3] = {y[0].g, y[1].g, y[2].g};
        G->matmul_multi(bg, x.g, 3, wg, cases[c].bias ? bg3 : NULL, n, in, outs, yg);
        if (variant & 16) { /* the cluster's reduction: the workspace's bits (same split, same order) */
            struct kvs_dbuf *yw[3] = {y1[0].g, y1[1].g, y1[2].g};
            kvs_cuda_set_skinny_variant(bg, variant & ~16);
            G->matmul_multi(bg, x.g, 3, wg, cases[c].bias ? bg3 : NULL, n, in, outs, yw);
            kvs_cuda_set_skinny_variant(bg, variant);
            for (int p = 0; p < 3; p++) {
                float *a = dl(&y[p], (size_t)n * outs[p]), *b = dl(&y1[p], (size_t)n * outs[p]);
                snprintf(what, sizeof what, "matmul_multi part %d n=%d in=%d variant %d vs %d", p, n, in, variant,
                         variant & ~16);
                expect_same(what, a, b, (size_t)n * outs[p]);
                free(a);
                free(b);
            }
        }
        for (int p = 0; p < 3; p++) {
            snprintf(what, sizeof what, "matmul_multi part %d n=%d in=%d out=%d bias=%d", p, n, in, outs[p], cases[c].bias);
            check(what, &y[p], 1e-2);
            G->matmul(bg, x.g, w[p].g, cases[c].bias ? bs[p].g : NULL, n, in, outs[p], y1[p].g);
            float *a = dl(&y[p], (size_t)n * outs[p]), *b = dl(&y1[p], (size_t)n * outs[p]);
            snprintf(what, sizeof what, "matmul_multi part %d n=%d equals matmul", p, n);
            expect_same_op(variant, what, a, b, (size_t)n * outs[p]);
            free(a);
            free(b);
        }
        /* batch invariance of the decode GEMM: each row in a batch of two (with its neighbour) gives
         * the same bits as in the whole batch (n = 1 takes the single-row kernel, another order) */
        /* (variant bit 8 takes k_skinny up to 8 rows and cuBLAS above for split launches: invariant
         * within each, not across; with bit 32 k_dgemm_n takes them, and up to 32 rows k_dgemm the
         * others) */
        if (n > 2 && n <= 128 && (!(variant & 8) || n <= 8 || ((variant & 32) && n <= 32))) {
            float *all = dl(&y1[0], (size_t)n * outs[0]); /* matmul's, as below (not matmul_multi's split plan) */
            struct pair x1 = mk(KVS_BUF_ACT, (size_t)2 * in, NULL), o1 = mk(KVS_BUF_ACT, (size_t)2 * outs[0], NULL);
            int bad = 0;
            for (int t = 0; t < n; t++) {
                G->upload(bg, x1.g, 0, xv + (size_t)t * in, (size_t)in);
                G->upload(bg, x1.g, (size_t)in, xv + (size_t)((t + 1) % n) * in, (size_t)in);
                G->matmul(bg, x1.g, w[0].g, cases[c].bias ? bs[0].g : NULL, 2, in, outs[0], o1.g);
                float *one = dl(&o1, (size_t)outs[0]);
                bad += memcmp(one, all + (size_t)t * outs[0], (size_t)outs[0] * 4) != 0;
                free(one);
            }
            kvs_test_checks++;
            if (bad) { kvs_test_fails++; printf("FAIL decode GEMM batch invariance n=%d: %d rows differ\n", n, bad); }
            else printf("ok   decode GEMM batch invariance n=%d in=%d (each row in a batch of 2, bitwise)\n", n, in);
            free(all);
            drop(&x1);
            drop(&o1);
        }
        /* gate/up + SwiGLU */
        float *gv = rand_vec((size_t)ff * in, 0.05f, 0), *uv = rand_vec((size_t)ff * in, 0.05f, 0);
        struct wpair gw = mkw(gv, ff, in, 0, KVS_DTYPE_BF16), uw = mkw(uv, ff, in, 0, KVS_DTYPE_BF16);
        struct pair gt = mk(KVS_BUF_ACT, (size_t)n * ff, NULL), up = mk(KVS_BUF_ACT, (size_t)n * ff, NULL);
        struct pair g2 = mk(KVS_BUF_ACT, (size_t)n * ff, NULL), u2 = mk(KVS_BUF_ACT, (size_t)n * ff, NULL);
        struct pair dw = mk(KVS_BUF_ACT, (size_t)n * in, NULL);
        C->matmul(bc, x.c, gw.c, NULL, n, in, ff, gt.c);
        C->matmul(bc, x.c, uw.c, NULL, n, in, ff, up.c);
        C->swiglu(bc, gt.c, up.c, n, ff, gt.c);
        poison(&gt);
        G->matmul_swiglu(bg, x.g, gw.g, uw.g, n, in, ff, gt.g, up.g);
        snprintf(what, sizeof what, "matmul_swiglu n=%d in=%d ff=%d", n, in, ff);
        check(what, &gt, 1e-2);
        /* variant bit 64: gate/up at 33-128 rows on k_dgemm's one-tile blocks, K unsplit (ff >= 14336:
         * more 128-row tiles than SMs), the same order of additions as at 2 rows: each row in a
         * batch of two (with its neighbour) gives the whole batch's bits */
        if ((variant & 64) && n > 32 && n <= 128 && ff >= 14336) {
            float *all = dl(&gt, (size_t)n * ff);
            struct pair x1 = mk(KVS_BUF_ACT, (size_t)2 * in, NULL), g1 = mk(KVS_BUF_ACT, (size_t)2 * ff, NULL),
                        u1 = mk(KVS_BUF_ACT, (size_t)2 * ff, NULL);
            int bad = 0;
            for (int t = 0; t < n; t++) {
                G->upload(bg, x1.g, 0, xv + (size_t)t * in, (size_t)in);
                G->upload(bg, x1.g, (size_t)in, xv + (size_t)((t + 1) % n) * in, (size_t)in);
                G->matmul_swiglu(bg, x1.g, gw.g, uw.g, 2, in, ff, g1.g, u1.g);
                float *one = dl(&g1, (size_t)ff);
                bad += memcmp(one, all + (size_t)t * ff, (size_t)ff * 4) != 0;
                free(one);
            }
            kvs_test_checks++;
            if (bad) { kvs_test_fails++; printf("FAIL decode GEMM SwiGLU batch invariance n=%d: %d rows differ\n", n, bad); }
            else printf("ok   decode GEMM SwiGLU batch invariance n=%d in=%d ff=%d (each row in a batch of 2, bitwise)\n", n, in, ff);
            free(all);
            drop(&x1);
            drop(&g1);
            drop(&u1);
        }
        if (variant & 16) { /* the cluster's reduction: the workspace's bits */
            kvs_cuda_set_skinny_variant(bg, variant & ~16);
            G->matmul_swiglu(bg, x.g, gw.g, uw.g, n, in, ff, g2.g, u2.g);
            kvs_cuda_set_skinny_variant(bg, variant);
            float *a = dl(&gt, (size_t)n * ff), *b = dl(&g2, (size_t)n * ff);
            snprintf(what, sizeof what, "matmul_swiglu n=%d in=%d ff=%d variant %d vs %d", n, in, ff, variant,
                     variant & ~16);
            expect_same(what, a, b, (size_t)n * ff);
            free(a);
            free(b);
        }
        /* the next GEMM reads the bf16 copy that the fused epilogue wrote: the down projection of
         * the fused result must equal the one of the composed result (bitwise on CUDA) */
        float *dv = rand_vec((size_t)in * ff, 0.05f, 0);
        struct wpair dwt = mkw(dv, in, ff, 0, KVS_DTYPE_BF16);
        G->matmul(bg, gt.g, dwt.g, NULL, n, ff, in, dw.g);
        float *down_fused = dl(&dw, (size_t)n * in);
        G->matmul(bg, x.g, gw.g, NULL, n, in, ff, g2.g);
        G->matmul(bg, x.g, uw.g, NULL, n, in, ff, u2.g);
        G->swiglu(bg, g2.g, u2.g, n, ff, g2.g);
        float *a = dl(&gt, (size_t)n * ff), *b = dl(&g2, (size_t)n * ff);
        /* bitwise where matmul takes the decode GEMM too (ff % 16 == 0) or where both run the
         * fp32-output cuBLAS GEMMs (more rows than the decode GEMM takes, ff not a multiple of 8);
         * with more rows and ff a multiple of 8, the fused op's cuBLAS GEMMs write gate and up in
         * bf16 (backend.h): close to the composition, not equal */
        G->matmul(bg, g2.g, dwt.g, NULL, n, ff, in, dw.g);
        float *down_comp = dl(&dw, (size_t)n * in);
        /* cuBLAS runs the fused gate/up (bf16 outputs) above 32 rows, and from 9 rows where variant
         * bit 8 leaves a split launch to it (with bit 64 k_dgemm may run it and gate alone another
         * kernel: close too) */
        if ((n > 32 || ((variant & 8) && n > 8)) && ff % 8 == 0) {
            snprintf(what, sizeof what, "matmul_swiglu n=%d (bf16 gate / up) ~ composed", n);
            expect_close(what, a, b, (size_t)n * ff, 1e-2);
            snprintf(what, sizeof what, "down proj. after matmul_swiglu n=%d (bf16 gate / up) ~ composed", n);
            expect_close(what, down_fused, down_comp, (size_t)n * in, 1e-2);
        } else if (ff % 16 == 0 || n > 32) {
            snprintf(what, sizeof what, "matmul_swiglu n=%d equals matmul + matmul + swiglu", n);
            expect_same_op(variant, what, a, b, (size_t)n * ff);
            snprintf(what, sizeof what, "down projection after matmul_swiglu n=%d (its bf16 copy)", n);
            /* a gate value one fp32 ulp off may round to another bf16: 1e-3 */
            if (variant & 4) expect_close(what, down_fused, down_comp, (size_t)n * in, 1e-3);
            else expect_same(what, down_fused, down_comp, (size_t)n * in);
        }
        free(a); free(b); free(down_fused); free(down_comp); free(gv); free(uv); free(dv);
        dropw(&gw); dropw(&uw); dropw(&dwt);
        drop(&gt); drop(&up); drop(&g2); drop(&u2); drop(&dw);
        for (int p = 0; p < 3; p++) {
            dropw(&w[p]); dropw(&bs[p]); drop(&y[p]); drop(&y1[p]);
            free(wv[p]); free(bv[p]);
        }
        drop(&x);
        free(xv);
    }
    kvs_cuda_set_skinny_variant(bg, -1);
}

/* k_skinny (variant 2) and the wgmma kernel (6: everywhere; 7: split for one block per SM; 14:
 * only where it does not split K; 22: 6 with the splits reduced in a cluster; 46: 14 with the
 * launches it would split on k_dgemm_n, the weights on the N side; 238: 46 with one-tile blocks
 * for the unsplit launches up to 128 rows and k_dgemm_n's 16-row x tiles at 2-16 rows; 494: 238
 * with its 32-row x tiles at 17-32 rows; 750: 238 with the kernel chosen by shape from one row
 * up, batch invariance) */
static void test_fused_gemm(void)
{
    test_fused_gemm_at(2);
    test_fused_gemm_at(6);
    test_fused_gemm_at(7);
    test_fused_gemm_at(14);
    test_fused_gemm_at(22);
    test_fused_gemm_at(46);
    test_fused_gemm_at(238);
    test_fused_gemm_at(494);
    test_fused_gemm_at(750);
}

/* The decode GEMM's batch invariance (variant 750 = the default 238 | 512, row limit 64), for
 * every GEMM a decode step runs: each row of a launch of n = 1, 2, 3, 7, 16, 33, 64 rows, in two
 * orders (rows (s + 7 i) % 128 at position i, s = 0 and 45), has the bits of the same row alone
 * (n = 1); with the row limit at 128 also n = 100 and 128 (k_dgemm_n in launches of 64 rows).
 * Shapes: Llama-3.1-8B's (q/k/v, o, gate/up + SwiGLU, down; an LM head of 32768 rows, which takes
 * the unsplit wgmma kernel as 128256 rows do), the demo model's (every launch split: k_dgemm_n,
 * and k_dgemm with K split for gate/up) and one only k_skinny takes (in 96). Random bf16 weights
 * on the GPU alone (the CPU reference is test_embed_matmul's and test_fused_gemm's). */
struct bi_shape {
    const char *name;
    int in, n_parts, swiglu, out[3];
};

static void bi_launch(const struct bi_shape *s, struct kvs_dweight *const *w, struct kvs_dbuf *x, int n,
                      struct kvs_dbuf *const *y)
{
    if (s->swiglu) G->matmul_swiglu(bg, x, w[0], w[1], n, s->in, s->out[0], y[0], y[1]);
    else G->matmul_multi(bg, x, s->n_parts, (const struct kvs_dweight *const *)w, NULL, n, s->in, s->out, y);
}

static void test_batch_invariance(void)
{
    static const struct bi_shape shapes[] = {
        {"8B q/k/v", 4096, 3, 0, {4096, 1024, 1024}}, {"8B o", 4096, 1, 0, {4096}},
        {"8B gate/up+SwiGLU", 4096, 2, 1, {14336, 14336}}, {"8B down", 14336, 1, 0, {4096}},
        {"8B LM head (32768 rows)", 4096, 1, 0, {32768}}, {"demo q/k/v", 256, 3, 0, {256, 64, 64}},
        {"demo o", 256, 1, 0, {256}}, {"demo gate/up+SwiGLU", 256, 2, 1, {640, 640}},
        {"demo down", 640, 1, 0, {256}}, {"demo LM head", 256, 1, 0, {8192}},
        {"k_skinny q/k/v", 96, 3, 0, {96, 48, 48}}, {"k_skinny gate/up+SwiGLU", 96, 2, 1, {208, 208}}};
    static const int ns[] = {1, 2, 3, 7, 16, 33, 64, 100, 128};
    enum { RMAX = 128 };
    for (int si = 0; si < (int)(sizeof shapes / sizeof shapes[0]); si++) {
        const struct bi_shape *s = &shapes[si];
        const int np = s->swiglu ? 1 : s->n_parts, in = s->in;
        struct kvs_dweight *w[3];
        for (int p = 0; p < s->n_parts; p++) {
            const size_t ne = (size_t)s->out[p] * in;
            uint16_t *raw = kvs_xmalloc(ne * 2);
            for (size_t i = 0; i < ne; i++) {
                const float v = kvs_bf16_round(frand() * 0.05f);
                uint32_t u;
                memcpy(&u, &v, 4);
                raw[i] = (uint16_t)(u >> 16);
            }
            struct kvs_tensor_view t = {.dtype = KVS_DTYPE_BF16, .ndim = 2, .data = raw, .nbytes = ne * 2, .file = "test"};
            t.shape[0] = s->out[p];
            t.shape[1] = in;
            char err[256];
            w[p] = G->upload_weight(bg, &t, err, sizeof err);
            REQUIRE(w[p], "upload_weight: %s", err);
            free(raw);
        }
        float *xv = rand_vec((size_t)RMAX * in, 1.0f, 0), *ref[3], *got = NULL;
        struct kvs_dbuf *x = G->alloc(bg, KVS_BUF_ACT, (size_t)RMAX * in), *y[3];
        for (int p = 0; p < s->n_parts; p++) y[p] = G->alloc(bg, KVS_BUF_ACT, (size_t)RMAX * s->out[p]);
        kvs_cuda_set_skinny_variant(bg, 750);
        kvs_cuda_set_skinny_max(bg, -1);
        /* the reference: every row alone */
        for (int p = 0; p < np; p++) ref[p] = kvs_xmalloc((size_t)RMAX * s->out[p] * sizeof(float));
        for (int r = 0; r < RMAX; r++) {
            G->upload(bg, x, 0, xv + (size_t)r * in, (size_t)in);
            bi_launch(s, w, x, 1, y);
            for (int p = 0; p < np; p++) G->download(bg, ref[p] + (size_t)r * s->out[p], y[p], 0, (size_t)s->out[p]);
        }
        for (int k = 0; k < (int)(sizeof ns / sizeof ns[0]); k++) {
            const int n = ns[k];
            kvs_cuda_set_skinny_max(bg, n > 64 ? 128 : -1);
            int bad = 0;
            for (int s0 = 0; s0 <= 45; s0 += 45) {
                for (int i = 0; i < n; i++) G->upload(bg, x, (size_t)i * in, xv + (size_t)((s0 + 7 * i) % RMAX) * in, (size_t)in);
                bi_launch(s, w, x, n, y);
                for (int p = 0; p < np; p++) {
                    const size_t o = (size_t)s->out[p];
                    got = kvs_xrealloc(got, (size_t)n * o * sizeof(float));
                    G->download(bg, got, y[p], 0, (size_t)n * o);
                    for (int i = 0; i < n; i++)
                        bad += memcmp(got + (size_t)i * o, ref[p] + (size_t)((s0 + 7 * i) % RMAX) * o, o * 4) != 0;
                }
            }
            kvs_test_checks++;
            if (bad) kvs_test_fails++;
            printf("%s decode GEMM batch invariance, %s (in %d), n=%d: %d of %d rows differ from the row alone\n",
                   bad ? "FAIL" : "ok  ", s->name, in, n, bad, 2 * n * np);
        }
        kvs_cuda_set_skinny_max(bg, -1);
        kvs_cuda_set_skinny_variant(bg, -1);
        free(got);
        got = NULL;
        free(xv);
        for (int p = 0; p < np; p++) free(ref[p]);
        G->free_buf(bg, x);
        for (int p = 0; p < s->n_parts; p++) {
            G->free_buf(bg, y[p]);
            G->free_weight(bg, w[p]);
        }
    }
}

static void expect_close(const char *what, const float *a, const float *r, size_t n, double tol)
{
    double e = rel_l2(a, r, n);
    kvs_test_checks++;
    int ok = e < tol; /* false for NaN too */
    if (!ok) kvs_test_fails++;
    printf("%s %-58s rel_l2 %.3e (tol %.0e)\n", ok ? "ok  " : "FAIL", what, e, tol);
}

/* Random q/k/v projections [outs[p]][in] (bf16) and biases [outs[p]] on both backends, their
 * outputs y[p] [n][outs[p]], and the CPU's reference in y[p].c: x W^T (+ bias when `bias`) */
static void mk_qkv(struct pair *x, int n, int in, const int *outs, int bias, struct wpair *w, struct wpair *bs,
                   struct pair *y)
{
    for (int p = 0; p < 3; p++) {
        float *wv = rand_vec((size_t)outs[p] * in, 0.05f, 0), *bv = rand_vec((size_t)outs[p], 0.5f, 0);
        w[p] = mkw(wv, outs[p], in, 0, KVS_DTYPE_BF16);
        bs[p] = mkw(bv, 1, outs[p], 1, KVS_DTYPE_F32);
        free(wv);
        free(bv);
        y[p] = mk(KVS_BUF_ACT, (size_t)n * outs[p], NULL);
        C->matmul(bc, x->c, w[p].c, bias ? bs[p].c : NULL, n, in, outs[p], y[p].c);
    }
}

/* Weights laid out back to back (fuse_weights): matmul_multi over q/k/v and matmul_swiglu over
 * gate/up run one GEMM for the group from 9 to 256 rows (the separate GEMMs above 256, the decode
 * GEMM at most 8). Against the CPU composition, and close to the same ops before the fusion (the
 * joint GEMM may take another cuBLAS kernel); each part alone is still a weight for matmul; the
 * op refuses what it cannot lay out; freeing the parts one by one releases the storage. */
static void test_fuse_weights(void)
{
    char what[200];
    kvs_cuda_set_skinny_max(bg, 8); /* k_skinny up to 8 rows, the joint cuBLAS GEMMs above */
    struct { int n, in, q, kv, ff, bias; } cases[] = {{40, 512, 512, 128, 1408, 1}, {128, 1024, 1024, 256, 2816, 0},
                                                       {256, 256, 256, 64, 688, 0}, {300, 256, 256, 64, 512, 1},
                                                       {4, 256, 256, 64, 512, 0}, {64, 128, 128, 32, 300, 0}};
    for (int c = 0; c < (int)(sizeof cases / sizeof cases[0]); c++) {
        const int n = cases[c].n, in = cases[c].in, ff = cases[c].ff, bias = cases[c].bias;
        const int outs[3] = {cases[c].q, cases[c].kv, cases[c].kv};
        float *xv = rand_vec((size_t)n * in, 1.0f, 0);
        struct pair x = mk(KVS_BUF_ACT, (size_t)n * in, xv);
        struct wpair w[3], bs[3];
        struct pair y[3];
        float *sep[3];
        mk_qkv(&x, n, in, outs, bias, w, bs, y);
        const struct kvs_dweight *wg[3] = {w[0].g, w[1].g, w[2].g}, *bg3[3] = {bs[0].g, bs[1].g, bs[2].g};
        struct kvs_dbuf *yg[3] = {y[0].g, y[1].g, y[2].g};
        G->matmul_multi(bg, x.g, 3, wg, bias ? bg3 : NULL, n, in, outs, yg);
        for (int p = 0; p < 3; p++) sep[p] = dl(&y[p], (size_t)n * outs[p]);
        struct kvs_dweight *qkv[3] = {w[0].g, w[1].g, w[2].g};
        int rc = G->fuse_weights(bg, qkv, 3);
        kvs_test_checks++;
        if (rc != 0) { kvs_test_fails++; printf("FAIL fuse_weights q/k/v n=%d: %d\n", n, rc); }
        rc = G->fuse_weights(bg, qkv, 3); /* already fused: refused, nothing changes */
        kvs_test_checks++;
        if (rc != -EINVAL) { kvs_test_fails++; printf("FAIL fuse_weights twice: %d (want -EINVAL)\n", rc); }
        for (int p = 0; p < 3; p++) poison(&y[p]);
        G->matmul_multi(bg, x.g, 3, wg, bias ? bg3 : NULL, n, in, outs, yg);
        for (int p = 0; p < 3; p++) {
            snprintf(what, sizeof what, "fused matmul_multi part %d n=%d in=%d out=%d bias=%d", p, n, in, outs[p], bias);
            check(what, &y[p], 1e-2);
            float *a = dl(&y[p], (size_t)n * outs[p]);
            snprintf(what, sizeof what, "fused matmul_multi part %d n=%d ~ before fusing", p, n);
            expect_close(what, a, sep[p], (size_t)n * outs[p], 1e-5);
            free(a);
            free(sep[p]);
        }
        /* a part alone (k) after the fusion */
        poison(&y[1]);
        G->matmul(bg, x.g, w[1].g, bias ? bs[1].g : NULL, n, in, outs[1], y[1].g);
        snprintf(what, sizeof what, "matmul of a fused part n=%d out=%d", n, outs[1]);
        check(what, &y[1], 1e-2);

        /* gate/up */
        float *gv = rand_vec((size_t)ff * in, 0.05f, 0), *uv = rand_vec((size_t)ff * in, 0.05f, 0);
        struct wpair gw = mkw(gv, ff, in, 0, KVS_DTYPE_BF16), uw = mkw(uv, ff, in, 0, KVS_DTYPE_BF16);
        free(gv);
        free(uv);
        struct pair gt = mk(KVS_BUF_ACT, (size_t)n * ff, NULL), up = mk(KVS_BUF_ACT, (size_t)n * ff, NULL);
        C->matmul(bc, x.c, gw.c, NULL, n, in, ff, gt.c);
        C->matmul(bc, x.c, uw.c, NULL, n, in, ff, up.c);
        C->swiglu(bc, gt.c, up.c, n, ff, gt.c);
        G->matmul_swiglu(bg, x.g, gw.g, uw.g, n, in, ff, gt.g, up.g);
        float *before = dl(&gt, (size_t)n * ff);
        float *ov = rand_vec((size_t)16 * (in + 8), 0.05f, 0);
        struct wpair ow = mkw(ov, 16, in + 8, 0, KVS_DTYPE_BF16);
        free(ov);
        struct kvs_dweight *gu[2] = {gw.g, uw.g}, *odd[2] = {gw.g, ow.g};
        rc = G->fuse_weights(bg, odd, 2); /* columns differ: refused */
        kvs_test_checks++;
        if (rc != -EINVAL) { kvs_test_fails++; printf("FAIL fuse_weights of unequal widths: %d (want -EINVAL)\n", rc); }
        dropw(&ow);
        rc = G->fuse_weights(bg, gu, 2);
        kvs_test_checks++;
        if (rc != 0) { kvs_test_fails++; printf("FAIL fuse_weights gate/up n=%d: %d\n", n, rc); }
        poison(&gt);
        G->matmul_swiglu(bg, x.g, gw.g, uw.g, n, in, ff, gt.g, up.g);
        snprintf(what, sizeof what, "fused matmul_swiglu n=%d in=%d ff=%d", n, in, ff);
        check(what, &gt, 1e-2);
        float *after = dl(&gt, (size_t)n * ff);
        snprintf(what, sizeof what, "fused matmul_swiglu n=%d ~ before fusing", n);
        expect_close(what, after, before, (size_t)n * ff, 5e-3);
        free(before);
        free(after);
        /* matmul_swiglu_down: the down projection of the same SwiGLU (gate now scratch), against
         * the CPU and bitwise against matmul_swiglu + matmul on the GPU */
        float *dv = rand_vec((size_t)in * ff, 0.05f, 0);
        struct wpair dw = mkw(dv, in, ff, 0, KVS_DTYPE_BF16);
        free(dv);
        struct pair yd = mk(KVS_BUF_ACT, (size_t)n * in, NULL), yd2 = mk(KVS_BUF_ACT, (size_t)n * in, NULL);
        C->matmul(bc, gt.c, dw.c, NULL, n, ff, in, yd.c);
        G->matmul(bg, gt.g, dw.g, NULL, n, ff, in, yd2.g);
        poison(&yd);
        G->matmul_swiglu_down(bg, x.g, gw.g, uw.g, dw.g, n, in, ff, gt.g, up.g, yd.g);
        snprintf(what, sizeof what, "matmul_swiglu_down n=%d in=%d ff=%d", n, in, ff);
        check(what, &yd, 1e-2);
        float *da = dl(&yd, (size_t)n * in), *db = dl(&yd2, (size_t)n * in);
        snprintf(what, sizeof what, "matmul_swiglu_down n=%d equals matmul_swiglu + matmul", n);
        expect_same(what, da, db, (size_t)n * in);
        free(da);
        free(db);
        dropw(&dw);
        drop(&yd);
        drop(&yd2);
        /* the parts freed one by one, the storage with the last */
        dropw(&gw);
        dropw(&uw);
        drop(&gt);
        drop(&up);
        for (int p = 0; p < 3; p++) {
            dropw(&w[p]);
            dropw(&bs[p]);
            drop(&y[p]);
        }
        drop(&x);
        free(xv);
    }
    kvs_cuda_set_skinny_max(bg, -1);
}

/* Matmuls of more rows than the decode GEMM takes (skinny_max at its default, 8) through each
 * cuBLAS path: cuBLASLt with the timed pick (the default), cuBLASLt with its heuristic's first
 * pick (KVS_CUDA_GEMM_TUNE=0) and cublasGemmEx (KVS_CUDA_GEMM=ex), each against the CPU. Row
 * counts that upload_weight timed up front (12, 16, 64) and ones that no decode graph has, which
 * take the next larger count's pick untimed (9, 17, 33, 100), odd leading dimensions, and rows
 * past the timed range (300). The timed and first
 * picks differ only in the order of fp32 sums, far below bf16 rounding: they must agree to 1e-3.
 * A timed pick is kept: a second call gives the same bits. */
static void test_gemm_paths(void)
{
    char what[200];
    static const char *mode_name[] = {"cuBLASLt timed", "cuBLASLt first pick", "cublasGemmEx"};
    kvs_cuda_set_skinny_max(bg, 8); /* the cuBLAS paths above 8 rows (the wgmma decode GEMM would take them) */
    struct { int n, in, out, bias; } cases[] = {{9, 4096, 1024, 1},  {12, 4096, 1024, 0}, {16, 1024, 2816, 1},
                                                 {33, 1024, 4096, 1}, {64, 2048, 512, 0},  {100, 1024, 2816, 1},
                                                 {12, 264, 200, 1},   {17, 260, 72, 0},    {300, 512, 384, 1}};
    for (int c = 0; c < (int)(sizeof cases / sizeof cases[0]); c++) {
        const int n = cases[c].n, in = cases[c].in, out = cases[c].out;
        const size_t ny = (size_t)n * out;
        float *wv = rand_vec((size_t)out * in, 0.05f, 0), *xv = rand_vec((size_t)n * in, 1.0f, 0);
        float *bv = rand_vec(out, 0.5f, 0);
        struct wpair w = mkw(wv, out, in, 0, KVS_DTYPE_BF16), b = mkw(bv, 1, out, 1, KVS_DTYPE_F32);
        struct pair x = mk(KVS_BUF_ACT, (size_t)n * in, xv), y = mk(KVS_BUF_ACT, ny, NULL);
        C->matmul(bc, x.c, w.c, cases[c].bias ? b.c : NULL, n, in, out, y.c);
        float *res[3];
        for (int mode = 0; mode < 3; mode++) {
            kvs_cuda_set_gemm(bg, mode);
            poison(&y);
            G->matmul(bg, x.g, w.g, cases[c].bias ? b.g : NULL, n, in, out, y.g);
            snprintf(what, sizeof what, "matmul n=%d in=%d out=%d bias=%d %s", n, in, out, cases[c].bias,
                     mode_name[mode]);
            check(what, &y, 1e-2);
            res[mode] = dl(&y, ny);
        }
        snprintf(what, sizeof what, "matmul n=%d in=%d out=%d: timed pick vs first pick", n, in, out);
        expect_close(what, res[0], res[1], ny, 1e-3);
        kvs_cuda_set_gemm(bg, KVS_CUDA_GEMM_TUNED);
        poison(&y);
        G->matmul(bg, x.g, w.g, cases[c].bias ? b.g : NULL, n, in, out, y.g);
        float *again = dl(&y, ny);
        snprintf(what, sizeof what, "matmul n=%d in=%d out=%d: the timed pick is kept", n, in, out);
        expect_same(what, res[0], again, ny);
        free(again);
        for (int mode = 0; mode < 3; mode++) free(res[mode]);
        drop(&x); drop(&y); dropw(&w); dropw(&b);
        free(wv); free(xv); free(bv);
    }
    kvs_cuda_set_gemm(bg, -1);
}

/* A matmul recorded in a step graph at a shape nobody timed (nothing can be timed while the
 * stream is captured: it takes the heuristic's first pick), replayed, against the CPU; then the
 * same matmul outside the graph, which times the shape. */
static void test_gemm_graph(void)
{
    char what[200];
    kvs_cuda_set_skinny_max(bg, 8); /* cuBLAS at 37 rows */
    kvs_cuda_set_gemm(bg, KVS_CUDA_GEMM_TUNED);
    const int n = 37, in = 1536, out = 640; /* 37 rows: no decode graph size, so not timed at upload */
    float *wv = rand_vec((size_t)out * in, 0.05f, 0), *xv = rand_vec((size_t)n * in, 1.0f, 0);
    float *bv = rand_vec(out, 0.5f, 0);
    struct wpair w = mkw(wv, out, in, 0, KVS_DTYPE_BF16), b = mkw(bv, 1, out, 1, KVS_DTYPE_F32);
    struct pair x = mk(KVS_BUF_ACT, (size_t)n * in, xv), y = mk(KVS_BUF_ACT, (size_t)n * out, NULL);
    C->matmul(bc, x.c, w.c, b.c, n, in, out, y.c);
    poison(&y);
    G->graph_begin(bg);
    G->matmul(bg, x.g, w.g, b.g, n, in, out, y.g);
    char err[256];
    struct kvs_graph *gr = G->graph_end(bg, err, sizeof err);
    if (!gr) kvs_panic(__FILE__, __LINE__, "graph_end: %s", err);
    G->graph_launch(bg, gr);
    snprintf(what, sizeof what, "matmul n=%d in=%d out=%d in a graph (first pick)", n, in, out);
    check(what, &y, 1e-2);
    G->graph_free(bg, gr);
    poison(&y);
    G->matmul(bg, x.g, w.g, b.g, n, in, out, y.g);
    snprintf(what, sizeof what, "matmul n=%d in=%d out=%d after the graph (timed now)", n, in, out);
    check(what, &y, 1e-2);
    drop(&x); drop(&y); dropw(&w); dropw(&b);
    free(wv); free(xv); free(bv);
    kvs_cuda_set_gemm(bg, -1);
}

/* The accumulate form y += x W^T (no op uses it yet; kvs_cuda_matmul_accumulate reaches it) on
 * each cuBLAS path, at row counts the decode GEMM would otherwise take too: the timing of a new
 * accumulate shape must leave y alone (it times into a scratch). */
static void test_gemm_accumulate(void)
{
    char what[200];
    static const char *mode_name[] = {"cuBLASLt timed", "cuBLASLt first pick", "cublasGemmEx"};
    struct { int n, in, out; } cases[] = {{5, 1024, 512}, {40, 2048, 1024}, {128, 512, 2816}};
    for (int c = 0; c < 3; c++) {
        const int n = cases[c].n, in = cases[c].in, out = cases[c].out;
        const size_t ny = (size_t)n * out;
        float *wv = rand_vec((size_t)out * in, 0.05f, 0), *xv = rand_vec((size_t)n * in, 1.0f, 0);
        float *y0 = rand_vec(ny, 2.0f, 0), *prod = kvs_xmalloc(ny * sizeof(float));
        struct wpair w = mkw(wv, out, in, 0, KVS_DTYPE_BF16);
        struct pair x = mk(KVS_BUF_ACT, (size_t)n * in, xv), t = mk(KVS_BUF_ACT, ny, NULL);
        C->matmul(bc, x.c, w.c, NULL, n, in, out, t.c);
        C->download(bc, prod, t.c, 0, ny);
        for (size_t i = 0; i < ny; i++) prod[i] += y0[i];
        struct pair y = mk(KVS_BUF_ACT, ny, prod); /* the CPU side holds the expected sum */
        for (int mode = 0; mode < 3; mode++) {
            kvs_cuda_set_gemm(bg, mode);
            for (int rep = 0; rep < 2; rep++) { /* the first timed call times the shape, the second reuses it */
                G->upload(bg, y.g, 0, y0, ny);
                kvs_cuda_matmul_accumulate(bg, x.g, w.g, n, in, out, y.g);
                snprintf(what, sizeof what, "matmul accumulate n=%d in=%d out=%d %s%s", n, in, out, mode_name[mode],
                         rep ? " (again)" : "");
                check(what, &y, 1e-2);
            }
        }
        kvs_cuda_set_gemm(bg, -1);
        drop(&x); drop(&y); drop(&t); dropw(&w);
        free(wv); free(xv); free(y0); free(prod);
    }
}

static void make_inv_freq(float *f, int hd, double theta)
{
    for (int i = 0; i < hd / 2; i++) f[i] = (float)pow(theta, -2.0 * i / hd);
}

static void test_rope_headnorm(void)
{
    char what[160];
    struct { int n, heads, hd; } cases[] = {{1, 32, 128}, {9, 4, 16}, {40, 8, 64}};
    for (int c = 0; c < 3; c++) {
        int n = cases[c].n, nh = cases[c].heads, hd = cases[c].hd;
        size_t sz = (size_t)n * nh * hd;
        float *xv = rand_vec(sz, 1.0f, 0), *wv = rand_vec(hd, 1.0f, 0);
        float *inv = kvs_xmalloc((size_t)hd / 2 * 4);
        make_inv_freq(inv, hd, c == 0 ? 500000.0 : 10000.0);
        int32_t *pos = kvs_xmalloc((size_t)n * 4), *rot = kvs_xmalloc((size_t)n * 4);
        for (int i = 0; i < n; i++) { pos[i] = irand(32768); rot[i] = irand(2001) - 1000; }
        struct pair x = mk(KVS_BUF_ACT, sz, xv), p = mk(KVS_BUF_I32, n, pos), r = mk(KVS_BUF_I32, n, rot);
        struct pair f = mk(KVS_BUF_F32, (size_t)hd / 2, inv);
        struct wpair w = mkw(wv, 1, hd, 1, KVS_DTYPE_F32);
        C->rope(bc, x.c, p.c, NULL, f.c, n, nh, hd);
        G->rope(bg, x.g, p.g, NULL, f.g, n, nh, hd);
        snprintf(what, sizeof what, "rope n=%d heads=%d hd=%d", n, nh, hd);
        check(what, &x, 1e-5);
        C->rope(bc, x.c, p.c, r.c, f.c, n, nh, hd);
        G->rope(bg, x.g, p.g, r.g, f.g, n, nh, hd);
        snprintf(what, sizeof what, "rope with rot n=%d heads=%d hd=%d", n, nh, hd);
        check(what, &x, 1e-5);
        C->head_rmsnorm(bc, x.c, w.c, 1e-6f, n, nh, hd);
        G->head_rmsnorm(bg, x.g, w.g, 1e-6f, n, nh, hd);
        snprintf(what, sizeof what, "head_rmsnorm n=%d heads=%d hd=%d", n, nh, hd);
        check(what, &x, 1e-5);
        drop(&x); drop(&p); drop(&r); drop(&f); dropw(&w);
        free(xv); free(wv); free(inv); free(pos); free(rot);
    }
}

/* rope_kv_write (RoPE of q and k + the cache write in one op) against the CPU composition, and
 * bitwise against the CUDA backend's own rope, rope, kv_write; a padding row (slot -1) writes
 * nothing */
static void test_rope_kv_write(void)
{
    char what[200];
    struct { int n, nh, nkv, hd, bs; } cases[] = {{1, 32, 8, 128, 16}, {7, 8, 2, 64, 16}, {20, 4, 4, 32, 5}};
    for (int c = 0; c < 3; c++) {
        const int n = cases[c].n, nh = cases[c].nh, nkv = cases[c].nkv, hd = cases[c].hd, bs = cases[c].bs;
        const int n_blocks = n + 2;
        const size_t qn = (size_t)n * nh * hd, kn = (size_t)n * nkv * hd, cn = (size_t)n_blocks * nkv * bs * hd;
        float *qv = rand_vec(qn, 1.0f, 0), *kv = rand_vec(kn, 1.0f, 0), *vv = rand_vec(kn, 1.0f, 0);
        float *c0 = rand_vec(cn, 1.0f, 1), *inv = kvs_xmalloc((size_t)hd / 2 * 4);
        make_inv_freq(inv, hd, 500000.0);
        int32_t *pos = kvs_xmalloc((size_t)n * 4), *slots = kvs_xmalloc((size_t)n * 4);
        for (int i = 0; i < n; i++) {
            pos[i] = irand(100000);
            slots[i] = irand(n_blocks * bs);
        }
        /* distinct slots (a step never writes one slot twice) */
        for (int i = 0; i < n; i++)
            for (int j = 0; j < i; j++)
                if (slots[i] >= 0 && slots[i] == slots[j]) { slots[i] = (slots[i] + 1) % (n_blocks * bs); j = -1; }
        struct pair q = mk(KVS_BUF_ACT, qn, qv), k = mk(KVS_BUF_ACT, kn, kv), v = mk(KVS_BUF_ACT, kn, vv);
        struct pair q2 = mk(KVS_BUF_ACT, qn, qv), k2 = mk(KVS_BUF_ACT, kn, kv);
        struct pair kc = mk(KVS_BUF_KV, cn, c0), vc = mk(KVS_BUF_KV, cn, c0), kc2 = mk(KVS_BUF_KV, cn, c0),
                    vc2 = mk(KVS_BUF_KV, cn, c0);
        struct pair ps = mk(KVS_BUF_I32, (size_t)n, pos), sl = mk(KVS_BUF_I32, (size_t)n, slots);
        struct pair f = mk(KVS_BUF_F32, (size_t)hd / 2, inv);
        C->rope(bc, q.c, ps.c, NULL, f.c, n, nh, hd);
        C->rope(bc, k.c, ps.c, NULL, f.c, n, nkv, hd);
        C->kv_write(bc, k.c, v.c, sl.c, n, nkv, hd, bs, kc.c, vc.c);
        G->rope_kv_write(bg, q.g, k.g, v.g, ps.g, f.g, sl.g, n, nh, nkv, hd, bs, kc.g, vc.g);
        snprintf(what, sizeof what, "rope_kv_write n=%d heads=%d/%d hd=%d bs=%d: q", n, nh, nkv, hd, bs);
        check(what, &q, 1e-5);
        snprintf(what, sizeof what, "rope_kv_write n=%d: k", n);
        check(what, &k, 1e-5);
        snprintf(what, sizeof what, "rope_kv_write n=%d: K cache", n);
        check(what, &kc, 1e-2);
        snprintf(what, sizeof what, "rope_kv_write n=%d: V cache", n);
        check(what, &vc, 1e-2);
        /* bitwise against the CUDA composition, with a padding row (slot -1: the runner's dummy
         * sequences; the CPU backend never sees one) in both */
        if (n > 1) slots[n / 2] = -1;
        struct pair sl2 = mk(KVS_BUF_I32, (size_t)n, slots);
        G->upload(bg, q.g, 0, qv, qn);
        G->upload(bg, k.g, 0, kv, kn);
        G->upload(bg, kc.g, 0, c0, cn);
        G->upload(bg, vc.g, 0, c0, cn);
        G->rope_kv_write(bg, q.g, k.g, v.g, ps.g, f.g, sl2.g, n, nh, nkv, hd, bs, kc.g, vc.g);
        G->rope(bg, q2.g, ps.g, NULL, f.g, n, nh, hd);
        G->rope(bg, k2.g, ps.g, NULL, f.g, n, nkv, hd);
        G->kv_write(bg, k2.g, v.g, sl2.g, n, nkv, hd, bs, kc2.g, vc2.g);
        drop(&sl2);
        struct pair *fused[4] = {&q, &k, &kc, &vc}, *sep[4] = {&q2, &k2, &kc2, &vc2};
        const char *nm[4] = {"q", "k", "K cache", "V cache"};
        for (int i = 0; i < 4; i++) {
            float *a = dl(fused[i], fused[i]->n), *b = dl(sep[i], sep[i]->n);
            snprintf(what, sizeof what, "rope_kv_write n=%d equals rope + rope + kv_write: %s", n, nm[i]);
            expect_same(what, a, b, fused[i]->n);
            free(a);
            free(b);
        }
        drop(&q); drop(&k); drop(&v); drop(&q2); drop(&k2); drop(&kc); drop(&vc); drop(&kc2); drop(&vc2);
        drop(&ps); drop(&sl); drop(&f);
        free(qv); free(kv); free(vv); free(c0); free(inv); free(pos); free(slots);
    }
}

/* matmul_rope_kv_write (q/k/v GEMMs + RoPE + cache write in one op): against the CPU
 * composition, with q/k/v apart (the op composes) and fused (the joint GEMM feeds the RoPE:
 * 9-256 rows), and bitwise against the CUDA composition matmul_multi + rope_kv_write, a padding
 * row (slot -1) included */
static void test_matmul_rope_kv_write(void)
{
    char what[200];
    const int nh = 8, nkv = 2, hd = 64, in = 256, bs = 16;
    const int outs[3] = {nh * hd, nkv * hd, nkv * hd};
    struct { int n, bias; } cases[] = {{4, 0}, {40, 1}, {128, 0}, {300, 1}};
    for (int c = 0; c < (int)(sizeof cases / sizeof cases[0]); c++) {
        const int n = cases[c].n, bias = cases[c].bias, n_blocks = n / bs + 3;
        const size_t cn = (size_t)n_blocks * nkv * bs * hd;
        float *xv = rand_vec((size_t)n * in, 1.0f, 0), *c0 = rand_vec(cn, 1.0f, 1), *inv = kvs_xmalloc((size_t)hd / 2 * 4);
        make_inv_freq(inv, hd, 500000.0);
        int32_t *pos = kvs_xmalloc((size_t)n * 4), *slots = kvs_xmalloc((size_t)n * 4);
        for (int i = 0; i < n; i++) {
            pos[i] = irand(100000);
            slots[i] = i + bs; /* distinct, past the first block */
        }
        struct pair x = mk(KVS_BUF_ACT, (size_t)n * in, xv);
        struct wpair w[3], bw[3];
        struct pair y[3], y2[3];
        mk_qkv(&x, n, in, outs, bias, w, bw, y);
        for (int p = 0; p < 3; p++) y2[p] = mk(KVS_BUF_ACT, (size_t)n * outs[p], NULL);
        struct pair kc = mk(KVS_BUF_KV, cn, c0), vc = mk(KVS_BUF_KV, cn, c0), kc2 = mk(KVS_BUF_KV, cn, c0),
                    vc2 = mk(KVS_BUF_KV, cn, c0);
        struct pair ps = mk(KVS_BUF_I32, (size_t)n, pos), sl = mk(KVS_BUF_I32, (size_t)n, slots);
        struct pair f = mk(KVS_BUF_F32, (size_t)hd / 2, inv);
        C->rope(bc, y[0].c, ps.c, NULL, f.c, n, nh, hd);
        C->rope(bc, y[1].c, ps.c, NULL, f.c, n, nkv, hd);
        C->kv_write(bc, y[1].c, y[2].c, sl.c, n, nkv, hd, bs, kc.c, vc.c);
        const struct kvs_dweight *wg[3] = {w[0].g, w[1].g, w[2].g}, *bg3[3] = {bw[0].g, bw[1].g, bw[2].g};
        struct kvs_dweight *qkv[3] = {w[0].g, w[1].g, w[2].g};
        const char *nm[5] = {"q", "k", "v", "K cache", "V cache"};
        for (int fused = 0; fused < 2; fused++) {
            if (fused && G->fuse_weights(bg, qkv, 3) != 0) {
                kvs_test_checks++;
                kvs_test_fails++;
                printf("FAIL fuse_weights q/k/v (n=%d)\n", n);
            }
            for (int p = 0; p < 3; p++) poison(&y[p]);
            G->upload(bg, kc.g, 0, c0, cn);
            G->upload(bg, vc.g, 0, c0, cn);
            G->matmul_rope_kv_write(bg, x.g, wg, bias ? bg3 : NULL, n, in, y[0].g, y[1].g, y[2].g, ps.g, f.g, sl.g, nh,
                                    nkv, hd, bs, kc.g, vc.g);
            struct pair *out[5] = {&y[0], &y[1], &y[2], &kc, &vc};
            for (int i = 0; i < 5; i++) {
                snprintf(what, sizeof what, "matmul_rope_kv_write n=%d bias=%d %s: %s", n, bias, fused ? "fused" : "apart", nm[i]);
                check(what, out[i], 1e-2);
            }
        }
        /* bitwise against the composition on the GPU, with a padding row */
        slots[n / 2] = -1;
        struct pair sl2 = mk(KVS_BUF_I32, (size_t)n, slots);
        for (int i = 0; i < 2; i++) {
            G->upload(bg, i ? kc2.g : kc.g, 0, c0, cn);
            G->upload(bg, i ? vc2.g : vc.g, 0, c0, cn);
        }
        G->matmul_rope_kv_write(bg, x.g, wg, bias ? bg3 : NULL, n, in, y[0].g, y[1].g, y[2].g, ps.g, f.g, sl2.g, nh, nkv,
                                hd, bs, kc.g, vc.g);
        struct kvs_dbuf *yg2[3] = {y2[0].g, y2[1].g, y2[2].g};
        G->matmul_multi(bg, x.g, 3, wg, bias ? bg3 : NULL, n, in, outs, yg2);
        G->rope_kv_write(bg, y2[0].g, y2[1].g, y2[2].g, ps.g, f.g, sl2.g, n, nh, nkv, hd, bs, kc2.g, vc2.g);
        struct pair *one[5] = {&y[0], &y[1], &y[2], &kc, &vc}, *two[5] = {&y2[0], &y2[1], &y2[2], &kc2, &vc2};
        for (int i = 0; i < 5; i++) {
            float *a = dl(one[i], one[i]->n), *b = dl(two[i], two[i]->n);
            snprintf(what, sizeof what, "matmul_rope_kv_write n=%d equals matmul_multi + rope_kv_write: %s", n, nm[i]);
            expect_same(what, a, b, one[i]->n);
            free(a);
            free(b);
        }
        drop(&sl2);
        for (int p = 0; p < 3; p++) {
            dropw(&w[p]);
            dropw(&bw[p]);
            drop(&y[p]);
            drop(&y2[p]);
        }
        drop(&x); drop(&kc); drop(&vc); drop(&kc2); drop(&vc2); drop(&ps); drop(&sl); drop(&f);
        free(xv); free(c0); free(inv); free(pos); free(slots);
    }
}

/* ---- KV cache: kv_write, kv_copy_block, attention ------------------------------------------ */

struct attn_case {
    int n_heads, n_kv, hd, bs;
    int n_seqs;
    int pos[6], ntok[6];
    int use_rot;
};

/* Uploads into the GPU caches kc, vc the slots no query of case ac reads: the tails of each
 * sequence's last block (block table bt, row stride max_blocks) and the n_spare blocks spare[].
 * The values come from k, v: at the slot's own offset (indexed 1: whole caches), or from their
 * start (indexed 0: one block's worth, e.g. all NaN). */
static void upload_unread_slots(const struct attn_case *ac, const int32_t *bt, int max_blocks, const int32_t *spare,
                                int n_spare, struct pair *kc, struct pair *vc, const float *k, const float *v,
                                int indexed)
{
    const int nkv = ac->n_kv, bs = ac->bs, hd = ac->hd;
    for (int s = 0; s < ac->n_seqs; s++) {
        const int ctx = ac->pos[s] + ac->ntok[s], nb = (ctx + bs - 1) / bs, tail = ctx % bs;
        if (tail == 0) continue;
        const int blk = bt[s * max_blocks + nb - 1];
        for (int h = 0; h < nkv; h++) {
            const size_t off = (((size_t)blk * nkv + h) * bs + tail) * hd, cnt = (size_t)(bs - tail) * hd;
            G->upload(bg, kc->g, off, indexed ? k + off : k, cnt);
            G->upload(bg, vc->g, off, indexed ? v + off : v, cnt);
        }
    }
    for (int i = 0; i < n_spare; i++) {
        const size_t off = (size_t)spare[i] * nkv * bs * hd, cnt = (size_t)nkv * bs * hd;
        G->upload(bg, kc->g, off, indexed ? k + off : k, cnt);
        G->upload(bg, vc->g, off, indexed ? v + off : v, cnt);
    }
}

static void test_attention_case(const struct attn_case *ac)
{
    char what[200];
    int nh = ac->n_heads, nkv = ac->n_kv, hd = ac->hd, bs = ac->bs, S = ac->n_seqs;
    int max_blocks = 0, total_blocks = 0, n = 0, max_ctx = 0;
    int32_t q_start[7], pos[6];
    for (int s = 0; s < S; s++) {
        int ctx = ac->pos[s] + ac->ntok[s];
        int nb = (ctx + bs - 1) / bs;
        if (nb > max_blocks) max_blocks = nb;
        total_blocks += nb;
        if (ctx > max_ctx) max_ctx = ctx;
        q_start[s] = n;
        pos[s] = ac->pos[s];
        n += ac->ntok[s];
    }
    q_start[S] = n;
    int n_blocks = total_blocks + 3; /* spare blocks stay unused */
    /* random block tables: a random permutation of the pool, dealt to the sequences */
    int32_t *perm = kvs_xmalloc((size_t)n_blocks * 4);
    for (int i = 0; i < n_blocks; i++) perm[i] = i;
    for (int i = n_blocks - 1; i > 0; i--) { int j = irand(i + 1); int32_t t = perm[i]; perm[i] = perm[j]; perm[j] = t; }
    int32_t *bt = kvs_xcalloc((size_t)S * max_blocks, 4), *rot = kvs_xcalloc((size_t)S * max_blocks, 4);
    int used = 0;
    for (int s = 0; s < S; s++) {
        int nb = (ac->pos[s] + ac->ntok[s] + bs - 1) / bs;
        for (int j = 0; j < nb; j++) {
            bt[s * max_blocks + j] = perm[used++];
            /* deferred RoPE: some blocks of some sequences carry an offset (may be negative) */
            if (ac->use_rot && (s + j) % 3 != 0) rot[s * max_blocks + j] = irand(4001) - 2000;
        }
    }
    size_t cache_n = (size_t)n_blocks * nkv * bs * hd;
    float *kv0 = rand_vec(cache_n, 1.0f, 1), *vv0 = rand_vec(cache_n, 1.0f, 1);
    struct pair kc = mk(KVS_BUF_KV, cache_n, kv0), vc = mk(KVS_BUF_KV, cache_n, vv0);

    /* the step's own K/V go through kv_write, as the runner does */
    size_t kn = (size_t)n * nkv * hd;
    float *kn_v = rand_vec(kn, 1.0f, 1), *vn_v = rand_vec(kn, 1.0f, 1);
    int32_t *slots = kvs_xmalloc((size_t)n * 4);
    for (int s = 0; s < S; s++)
        for (int i = 0; i < ac->ntok[s]; i++) {
            int p = ac->pos[s] + i;
            slots[q_start[s] + i] = bt[s * max_blocks + p / bs] * bs + p % bs;
        }
    struct pair kk = mk(KVS_BUF_ACT, kn, kn_v), vv = mk(KVS_BUF_ACT, kn, vn_v), sl = mk(KVS_BUF_I32, n, slots);
    C->kv_write(bc, kk.c, vv.c, sl.c, n, nkv, hd, bs, kc.c, vc.c);
    G->kv_write(bg, kk.g, vv.g, sl.g, n, nkv, hd, bs, kc.g, vc.g);
    snprintf(what, sizeof what, "kv_write n=%d kv_heads=%d hd=%d bs=%d (K cache)", n, nkv, hd, bs);
    check(what, &kc, 1e-2);
    snprintf(what, sizeof what, "kv_write n=%d kv_heads=%d hd=%d bs=%d (V cache)", n, nkv, hd, bs);
    check(what, &vc, 1e-2);
    /* Slots no query may read hold NaN on the GPU while the attention runs: the tails of the
     * sequences' last blocks and the spare blocks (a kernel that read one, or multiplied its V by a
     * zero probability, would give NaN); restored after (kv_copy_block checks the whole cache). */
    float *nanv = kvs_xmalloc((size_t)nkv * bs * hd * sizeof(float));
    for (size_t i = 0; i < (size_t)nkv * bs * hd; i++) nanv[i] = NAN;
    upload_unread_slots(ac, bt, max_blocks, perm + used, n_blocks - used, &kc, &vc, nanv, nanv, 0);

    float *qv = rand_vec((size_t)n * nh * hd, 1.0f, 0);
    float *inv = kvs_xmalloc((size_t)hd / 2 * 4);
    make_inv_freq(inv, hd, 10000.0);
    struct pair q = mk(KVS_BUF_ACT, (size_t)n * nh * hd, qv), out = mk(KVS_BUF_ACT, (size_t)n * nh * hd, NULL);
    struct pair qs = mk(KVS_BUF_I32, S + 1, q_start), ps = mk(KVS_BUF_I32, S, pos);
    struct pair bts = mk(KVS_BUF_I32, (size_t)S * max_blocks, bt), rts = mk(KVS_BUF_I32, (size_t)S * max_blocks, rot);
    struct pair fq = mk(KVS_BUF_F32, (size_t)hd / 2, inv);
    struct kvs_attn_meta mc = {.n_seqs = S, .max_blocks = max_blocks, .q_start = qs.c, .pos = ps.c,
                               .block_tables = bts.c, .rot_offsets = ac->use_rot ? rts.c : NULL, .inv_freq = fq.c,
                               .h_q_start = q_start, .h_pos = pos, .max_ctx = max_ctx};
    struct kvs_attn_meta mg = mc;
    mg.q_start = qs.g; mg.pos = ps.g; mg.block_tables = bts.g; mg.rot_offsets = ac->use_rot ? rts.g : NULL;
    mg.inv_freq = fq.g;
    float scale = 1.0f / sqrtf((float)hd);
    poison(&out);
    C->attention(bc, q.c, kc.c, vc.c, &mc, n, nh, nkv, hd, bs, scale, out.c);
    G->attention(bg, q.g, kc.g, vc.g, &mg, n, nh, nkv, hd, bs, scale, out.g);
    snprintf(what, sizeof what, "attention heads=%d/%d hd=%d bs=%d seqs=%d rows=%d ctx<=%d rot=%d", nh, nkv, hd, bs,
             S, n, max_ctx, ac->use_rot);
    check(what, &out, 1e-2);
    /* each sequence alone (rows of decode sequences are the ones that split) */
    for (int s = 0; s < S; s++) {
        snprintf(what, sizeof what, "  seq %d: pos=%d tokens=%d", s, ac->pos[s], ac->ntok[s]);
        check_range(what, &out, (size_t)q_start[s] * nh * hd, (size_t)ac->ntok[s] * nh * hd, 1e-2);
    }
    /* the attention writes the bf16 copy of its output for the o projection: a matmul of out (which
     * reads that copy) equals one of the same values uploaded afresh (converted by the matmul) */
    {
        const int od = 48;
        const size_t on = (size_t)n * nh * hd;
        float *ov = rand_vec((size_t)od * nh * hd, 0.05f, 0), *host = kvs_xmalloc(on * 4);
        struct wpair ow = mkw(ov, od, nh * hd, 0, KVS_DTYPE_BF16);
        struct pair y1 = mk(KVS_BUF_ACT, (size_t)n * od, NULL), y2 = mk(KVS_BUF_ACT, (size_t)n * od, NULL);
        struct pair out2 = mk(KVS_BUF_ACT, on, NULL);
        G->attention(bg, q.g, kc.g, vc.g, &mg, n, nh, nkv, hd, bs, scale, out.g);
        G->matmul(bg, out.g, ow.g, NULL, n, nh * hd, od, y1.g);
        G->download(bg, host, out.g, 0, on);
        G->upload(bg, out2.g, 0, host, on);
        G->matmul(bg, out2.g, ow.g, NULL, n, nh * hd, od, y2.g);
        float *a1 = dl(&y1, (size_t)n * od), *a2 = dl(&y2, (size_t)n * od);
        snprintf(what, sizeof what, "o projection of the attention output (its bf16 copy) rows=%d", n);
        expect_same(what, a1, a2, (size_t)n * od);
        free(a1); free(a2); free(ov); free(host);
        dropw(&ow); drop(&y1); drop(&y2); drop(&out2);
    }

    /* the poisoned slots back to their values (never written since: no step token lands there) */
    upload_unread_slots(ac, bt, max_blocks, perm + used, n_blocks - used, &kc, &vc, kv0, vv0, 1);
    free(nanv);

    /* kv_copy_block: copy a used block over a spare one, both caches compared whole */
    int src = bt[0], dst = perm[n_blocks - 1];
    C->kv_copy_block(bc, kc.c, vc.c, src, dst, nkv, bs, hd);
    G->kv_copy_block(bg, kc.g, vc.g, src, dst, nkv, bs, hd);
    snprintf(what, sizeof what, "kv_copy_block %d -> %d (K cache)", src, dst);
    check(what, &kc, 1e-2);
    size_t per = (size_t)nkv * bs * hd;
    float *a = kvs_xmalloc(per * 4), *b2 = kvs_xmalloc(per * 4);
    G->download(bg, a, vc.g, (size_t)src * per, per);
    G->download(bg, b2, vc.g, (size_t)dst * per, per);
    kvs_test_checks++;
    if (memcmp(a, b2, per * 4)) { kvs_test_fails++; printf("FAIL kv_copy_block: CUDA V block differs from its source\n"); }
    else printf("ok   kv_copy_block (CUDA V block %d == block %d)\n", dst, src);
    free(a); free(b2);

    drop(&kc); drop(&vc); drop(&kk); drop(&vv); drop(&sl); drop(&q); drop(&out); drop(&qs); drop(&ps);
    drop(&bts); drop(&rts); drop(&fq);
    free(perm); free(bt); free(rot); free(kv0); free(vv0); free(kn_v); free(vn_v); free(slots); free(qv); free(inv);
}

static void test_attention(void)
{
    const struct attn_case cases[] = {
        /* tiny-model shape: GQA 2, head_dim 16 and 32 */
        {4, 2, 16, 16, 3, {0, 5, 40}, {7, 1, 1}, 0},
        {4, 2, 32, 16, 2, {100, 0}, {1, 33}, 1},
        /* GQA 1, head_dim 64, mixed prefill + decode, long decode context */
        {8, 8, 64, 16, 4, {3000, 0, 100, 1}, {1, 40, 17, 1}, 0},
        /* GQA 4 (Llama-3-8B), head_dim 128, rot offsets, block size not a multiple of the tile */
        {32, 8, 128, 5, 3, {2047, 0, 999}, {1, 23, 1}, 1},
        {32, 8, 128, 16, 5, {4000, 1, 2500, 0, 63}, {1, 1, 1, 64, 2}, 0},
        /* GQA 8, head_dim 128 and 64 */
        {32, 4, 128, 32, 3, {1500, 0, 3100}, {1, 12, 1}, 1},
        {16, 2, 64, 16, 2, {0, 2200}, {50, 1}, 0},
        /* GQA 16 (two head chunks per KV head) and GQA 3 (padded group) */
        {16, 1, 128, 16, 2, {700, 10}, {1, 9}, 1},
        {12, 4, 64, 8, 2, {333, 0}, {1, 21}, 0},
        /* GQA 7 (Qwen2.5-7B) with rot offsets, prefill tiles of 4 tokens after a cached prefix */
        {28, 4, 128, 16, 3, {0, 500, 37}, {70, 1, 33}, 1},
        /* GQA 32 (the widest group supported), head_dim 256 */
        {32, 1, 64, 16, 2, {10, 0}, {1, 40}, 0},
        {8, 2, 256, 16, 2, {300, 5}, {1, 20}, 1},
        /* without rot offsets (k_attn_fd<HD, false> takes their decode rows): GQA 16, head_dim 256, and
         * head_dim 128 with blocks of 8 slots (the copies' general path) */
        {16, 1, 128, 16, 2, {700, 10}, {1, 9}, 0},
        {8, 2, 256, 16, 2, {300, 5}, {1, 20}, 0},
        {32, 8, 128, 8, 3, {1029, 0, 77}, {1, 7, 1}, 0},
        /* rot offsets on the decode kernel of kind 4 (k_attn_fd<HD, true>): every block has its own
         * offset, so with blocks of 8 or 24 slots the offset changes inside a warp's 32-key sub-tile
         * (one QK pass per offset) and inside a 128-key tile; blocks of 24 take the copies' general
         * path at head_dim 64 */
        {32, 8, 128, 8, 3, {1029, 0, 77}, {1, 7, 1}, 1},
        {16, 2, 64, 24, 3, {2200, 0, 130}, {1, 50, 1}, 1},
    };
    /* the automatic context split, and forced 1 and 3 splits (the merge of partials); first with the
     * automatic decode kernel, then with the FlashAttention-2-style one forced (kind 4, also the
     * automatic choice where it applies: the decode rows of cases with G <= 16 and head_dim 64 / 128
     * / 256, staged by the copy engine with blocks of 16 slots, with or without rot offsets; the
     * others fall back), then with its cp.async staging forced (kind 5) */
    static const int splits[] = {0, 1, 3}, kinds[] = {-1, 4, 5};
    for (int ki = 0; ki < 3; ki++) {
        kvs_cuda_set_dec_attn(bg, kinds[ki]);
        for (int si = 0; si < 3; si++) {
            kvs_cuda_set_attn_splits(bg, splits[si]);
            printf("attention, decode kernel: %s, context splits: %s\n",
                   kinds[ki] < 0 ? "auto" : kinds[ki] == 4 ? "4 (forced; TMA staging where it applies)" : "5 (forced; cp.async)",
                   splits[si] ? (splits[si] == 1 ? "1" : "3") : "auto");
            for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) test_attention_case(&cases[i]);
        }
    }
    kvs_cuda_set_attn_splits(bg, 0);
    kvs_cuda_set_dec_attn(bg, -1);
}

/* Early launch of the next kernel (kvs_cuda_set_pdl_early, cuda_launch.h's grid_dep_launch): a
 * chain of a decode layer's ops that read what the one before wrote (residual add + RMSNorm,
 * q/k/v, SwiGLU + down, o), captured in a graph as a decode step is, at the row counts of each
 * decode-GEMM path (GEMV, k_skinny / wgmma, cuBLAS for split launches). With the early launch the
 * next kernel's blocks run beside this one's last blocks, so a kernel that touched its inputs
 * before its grid dependency wait would read stale data: every replay must give the bits of the
 * chain without it, which itself must match the CPU. Fresh random inputs each case. */
static void test_pdl_early(void)
{
    char what[200];
    const int in = 1024, qo = 1024, kvo = 256, ff = 2816, reps = 6;
    const int ns[] = {1, 8, 24, 64};
    const float eps = 1e-5f;
    for (size_t c = 0; c < sizeof ns / sizeof ns[0]; c++) {
        const int n = ns[c];
        const int outs[3] = {qo, kvo, kvo};
        float *rv = rand_vec((size_t)n * in, 1.0f, 0), *dv = rand_vec((size_t)n * in, 1.0f, 0);
        float *n1 = rand_vec(in, 1.0f, 0), *n2 = rand_vec(in, 1.0f, 0);
        struct wpair wn1 = mkw(n1, 1, in, 1, KVS_DTYPE_F32), wn2 = mkw(n2, 1, in, 1, KVS_DTYPE_F32);
        struct wpair w[3], wg, wu, wd, wo;
        for (int p = 0; p < 3; p++) {
            float *v = rand_vec((size_t)outs[p] * in, 0.05f, 0);
            w[p] = mkw(v, outs[p], in, 0, KVS_DTYPE_BF16);
            free(v);
        }
        float *v = rand_vec((size_t)ff * in, 0.05f, 0);
        wg = mkw(v, ff, in, 0, KVS_DTYPE_BF16);
        free(v);
        v = rand_vec((size_t)ff * in, 0.05f, 0);
        wu = mkw(v, ff, in, 0, KVS_DTYPE_BF16);
        free(v);
        v = rand_vec((size_t)in * ff, 0.05f, 0);
        wd = mkw(v, in, ff, 0, KVS_DTYPE_BF16);
        free(v);
        v = rand_vec((size_t)in * in, 0.05f, 0);
        wo = mkw(v, in, in, 0, KVS_DTYPE_BF16);
        free(v);
        struct pair res = mk(KVS_BUF_ACT, (size_t)n * in, rv), d0 = mk(KVS_BUF_ACT, (size_t)n * in, dv);
        struct pair h = mk(KVS_BUF_ACT, (size_t)n * in, NULL), q = mk(KVS_BUF_ACT, (size_t)n * qo, NULL);
        struct pair k = mk(KVS_BUF_ACT, (size_t)n * kvo, NULL), vv = mk(KVS_BUF_ACT, (size_t)n * kvo, NULL);
        struct pair gt = mk(KVS_BUF_ACT, (size_t)n * ff, NULL), up = mk(KVS_BUF_ACT, (size_t)n * ff, NULL);
        struct pair y = mk(KVS_BUF_ACT, (size_t)n * in, NULL), d1 = mk(KVS_BUF_ACT, (size_t)n * in, NULL);
        /* the chain on the GPU, with the fused ops a decode step runs */
#define PDL_CHAIN(O, B, S)                                                                           \
    do {                                                                                             \
        const struct kvs_dweight *ws_[3] = {w[0].S, w[1].S, w[2].S};                                 \
        struct kvs_dbuf *ys_[3] = {q.S, k.S, vv.S};                                                  \
        O->add_rmsnorm(B, res.S, d0.S, wn1.S, eps, n, in, h.S);                                      \
        O->matmul_multi(B, h.S, 3, ws_, NULL, n, in, outs, ys_);                                     \
        O->add_rmsnorm(B, res.S, q.S, wn2.S, eps, n, in, h.S);                                       \
        O->matmul_swiglu_down(B, h.S, wg.S, wu.S, wd.S, n, in, ff, gt.S, up.S, y.S);                 \
        O->add_rmsnorm(B, res.S, y.S, wn1.S, eps, n, in, h.S);                                       \
        O->matmul(B, h.S, wo.S, NULL, n, in, in, d1.S);                                              \
        O->add_rmsnorm(B, res.S, d1.S, wn2.S, eps, n, in, h.S);                                      \
    } while (0)
        /* the same on the CPU, whose backend has only the plain ops (the fused ones are optional) */
        C->add_rmsnorm(bc, res.c, d0.c, wn1.c, eps, n, in, h.c);
        C->matmul(bc, h.c, w[0].c, NULL, n, in, qo, q.c);
        C->matmul(bc, h.c, w[1].c, NULL, n, in, kvo, k.c);
        C->matmul(bc, h.c, w[2].c, NULL, n, in, kvo, vv.c);
        C->add_rmsnorm(bc, res.c, q.c, wn2.c, eps, n, in, h.c);
        C->matmul(bc, h.c, wg.c, NULL, n, in, ff, gt.c);
        C->matmul(bc, h.c, wu.c, NULL, n, in, ff, up.c);
        C->swiglu(bc, gt.c, up.c, n, ff, gt.c);
        C->matmul(bc, gt.c, wd.c, NULL, n, ff, in, y.c);
        C->add_rmsnorm(bc, res.c, y.c, wn1.c, eps, n, in, h.c);
        C->matmul(bc, h.c, wo.c, NULL, n, in, in, d1.c);
        C->add_rmsnorm(bc, res.c, d1.c, wn2.c, eps, n, in, h.c);
        /* once outside a graph with each setting: the cuBLAS shapes are timed before the captures */
        for (int e = 0; e < 2; e++) {
            kvs_cuda_set_pdl_early(bg, e ? 7 : 0);
            G->upload(bg, res.g, 0, rv, (size_t)n * in);
            PDL_CHAIN(G, bg, g);
        }
        G->sync(bg);
        float *base[4] = {NULL, NULL, NULL, NULL};
        struct pair *outp[4] = {&h, &res, &k, &vv};
        const char *names[4] = {"out", "residual", "k", "v"};
        for (int e = 0; e < 2; e++) {
            kvs_cuda_set_pdl_early(bg, e ? 7 : 0); /* every class */
            G->graph_begin(bg);
            PDL_CHAIN(G, bg, g);
            char err[256];
            struct kvs_graph *gr = G->graph_end(bg, err, sizeof err);
            if (!gr) kvs_panic(__FILE__, __LINE__, "graph_end: %s", err);
            for (int r = 0; r < (e ? reps : 1); r++) {
                struct pair *outs_[] = {&h, &q, &k, &vv, &gt, &y, &d1};
                for (size_t o = 0; o < sizeof outs_ / sizeof outs_[0]; o++) poison(outs_[o]);
                G->upload(bg, res.g, 0, rv, (size_t)n * in);
                G->graph_launch(bg, gr);
                G->sync(bg);
                for (int o = 0; o < 4; o++) {
                    float *got = dl(outp[o], outp[o]->n);
                    if (!base[o]) {
                        snprintf(what, sizeof what, "decode chain n=%d %s, graph, no early launch", n, names[o]);
                        check(what, outp[o], 2e-2);
                        base[o] = got;
                        continue;
                    }
                    snprintf(what, sizeof what, "decode chain n=%d %s, early launch, replay %d", n, names[o], r);
                    expect_same(what, got, base[o], outp[o]->n);
                    free(got);
                }
            }
            G->graph_free(bg, gr);
        }
#undef PDL_CHAIN
        for (int o = 0; o < 4; o++) free(base[o]);
        kvs_cuda_set_pdl_early(bg, -1);
        struct pair *bufs[] = {&res, &d0, &h, &q, &k, &vv, &gt, &up, &y, &d1};
        for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) drop(bufs[i]);
        struct wpair *wts[] = {&wn1, &wn2, &w[0], &w[1], &w[2], &wg, &wu, &wd, &wo};
        for (size_t i = 0; i < sizeof wts / sizeof wts[0]; i++) dropw(wts[i]);
        free(rv);
        free(dv);
        free(n1);
        free(n2);
    }
}

int main(void)
{
    if (cuda_pair_open(2)) return 1;
    test_rows();
    test_argmax();
    test_embed_matmul();
    test_fused_gemm();
    test_batch_invariance();
    test_fuse_weights();
    test_gemm_paths();
    test_gemm_graph();
    test_gemm_accumulate();
    test_rope_headnorm();
    test_rope_kv_write();
    test_matmul_rope_kv_write();
    test_attention();
    test_pdl_early();
    G->free(bg);
    C->free(bc);
    return kvs_test_summary("test_cuda_ops");
}

#else
int main(void)
{
    fprintf(stderr, "test_cuda_ops: built without CUDA (nvcc not found)\n");
    return 1;
}
#endif
