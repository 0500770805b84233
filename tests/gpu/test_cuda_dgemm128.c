/* test_cuda_dgemm128.c: the decode GEMM's kernel for 65-128 token rows, k_dgemm_n2
 * (kernels/cuda/cuda_dgemm128.cu; variant bits 1024: gate/up + SwiGLU, 2048: the launches k_dgemm
 * would split, i.e. q/k/v, o, down; 4096: wider tiles), against the fp32 CPU backend on fresh random
 * inputs (seed printed; KVS_SEED replays), at the decode GEMM's row limit 128.
 *
 * For each shape: the CUDA op with the new bits (238 | 1024 | 2048 = 3310, 7406 = 3310 | 4096, 11502 =
 * 3310 | 8192)
 * must match the CPU within a relative L2 error of 1e-2 (bf16 weights and inputs, fp32 sums) with
 * no NaN (outputs are poisoned first), must have run k_dgemm_n2 (its launch counter moved: the
 * routing could otherwise leave the shape to cuBLAS, which is as close to the CPU), and must agree
 * with the existing n-row kernels (variant 750: k_dgemm_n in launches of 64 rows, k_dgemm for
 * gate/up) to fp32 rounding. Shapes: Llama-3.1-8B's q/k/v (3 parts, bias), o, down (K 14336),
 * gate/up + SwiGLU (ff 14336, 224-row tiles) and the down projection that reads its bf16 copy;
 * SmolLM2-like q/k/v and gate/up (K 576: 9 atoms, fewer than the weight ring); a part whose rows
 * end inside a tile (1040, and ff 1000 / 9000); a launch of more tiles than SMs (out 16384). Rows
 * are independent of n (tokens 0..69 at n = 70 give the n = 128 launch's bits), and at 64 rows
 * the new bits change nothing (k_dgemm_n2 does not run).
 * k_dgemm_n3 (x shared by a cluster, variants 19694 = 3310 | 16384 and 36078 = 3310 | 32768): the
 * same shapes and checks, that it ran (its own launch counter) except where no cluster plan fits
 * one wave (out 16384: k_dgemm_n2 must run instead), and a sweep of every row count 65..128 (q/k/v-
 * like three parts and SwiGLU ff 1000, partial tiles): n = 128 against the CPU, each smaller n's
 * rows bitwise equal to the n = 128 launch's.
 * Needs a GPU with the wgmma kernels (sm_90a): exits 1 with a message when there is no GPU.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/half.h"
#include "base/util.h"
#include "kernels/backend.h"
#include "models/model.h"
#include "tests/unit/test_util.h"

#if defined(KVS_HAVE_CUDA) && KVS_HAVE_CUDA
#include "kernels/cuda/cuda_backend.h"

#include "tests/gpu/cuda_pair.h"

/* kernels/cuda/cuda_dgemm128.cu (cuda_skinny.h, which C cannot include): k_dgemm_n2's launches
 * (k_dgemm_n3's included) and k_dgemm_n3's */
unsigned long kvs_cu_dgemm_n2_launches(void);
unsigned long kvs_cu_dgemm_n3_launches(void);

#define V_BASE 238            /* the default without the new bits */
#define V_INV 750             /* 238 | 512: k_dgemm_n in launches of 64 rows (the existing n-row kernels) */
/* 3310; 7406 = 3310 | 4096 (wider plain tiles); 11502 = 3310 | 8192 (the deeper x ring); 19694 =
 * 3310 | 16384 and 36078 = 3310 | 32768: k_dgemm_n3, x shared by clusters of 4 / 2 blocks */
#define NV 5
static const int v_new[NV] = {238 | 1024 | 2048, 238 | 1024 | 2048 | 4096, 238 | 1024 | 2048 | 8192,
                              238 | 1024 | 2048 | 16384, 238 | 1024 | 2048 | 32768};
/* k_dgemm_n3 is expected at the cluster variants (v_new[3], [4]) where the case says so: a launch
 * whose clusters cannot fit one wave at any tile size runs k_dgemm_n2 */
static int cl_variant(int v)
{
    return (v & (16384 | 32768)) != 0;
}

static float *rand_vec(size_t n, float scale)
{
    float *v = kvs_xmalloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) v[i] = frand() * scale;
    return v;
}

struct wpair {
    struct kvs_dweight *c, *g;
};

/* a bf16 weight [rows][cols] (or an fp32 vector of cols: bias) on both backends */
static struct wpair mkw(const float *v, int rows, int cols, int is_vec)
{
    const size_t n = (size_t)rows * cols, es = is_vec ? 4 : 2;
    void *raw = kvs_xmalloc(n * es);
    for (size_t i = 0; i < n; i++) {
        if (is_vec) {
            ((float *)raw)[i] = v[i];
        } else {
            ((uint16_t *)raw)[i] = kvs_f32_to_bf16(v[i]);
        }
    }
    struct kvs_tensor_view t = {.dtype = is_vec ? KVS_DTYPE_F32 : KVS_DTYPE_BF16, .ndim = is_vec ? 1 : 2,
                                .data = raw, .nbytes = n * es, .file = "test"};
    if (is_vec) t.shape[0] = cols;
    else {
        t.shape[0] = rows;
        t.shape[1] = cols;
    }
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

static void expect_rel(const char *what, const float *a, const float *r, size_t n, double tol)
{
    const double e = rel_l2(a, r, n);
    kvs_test_checks++;
    const int ok = e < tol;
    if (!ok) kvs_test_fails++;
    printf("%s %-72s rel_l2 %.3e (tol %.0e)\n", ok ? "ok  " : "FAIL", what, e, tol);
}

static void expect_true(const char *what, int cond, const char *why)
{
    kvs_test_checks++;
    if (!cond) kvs_test_fails++;
    printf("%s %s%s%s\n", cond ? "ok  " : "FAIL", what, cond ? "" : ": ", cond ? "" : why);
}

/* q/k/v-like (1 or 3 parts, matmul_multi for 3) at n rows: the CPU's result, then each new variant
 * and the existing kernels (V_INV) on the GPU */
static void plain_case(const char *name, int n, int in, int n_parts, const int *outs, int bias, int want_n3)
{
    char what[200];
    float *xv = rand_vec((size_t)n * in, 1.0f);
    struct pair x = mk(KVS_BUF_ACT, (size_t)n * in, xv);
    struct wpair w[3], b[3];
    struct pair y[3];
    float *ref[3], *inv[3];
    for (int p = 0; p < n_parts; p++) {
        float *wv = rand_vec((size_t)outs[p] * in, 0.05f), *bv = rand_vec((size_t)outs[p], 0.5f);
        w[p] = mkw(wv, outs[p], in, 0);
        b[p] = mkw(bv, 1, outs[p], 1);
        free(wv);
        free(bv);
        y[p] = mk(KVS_BUF_ACT, (size_t)n * outs[p], NULL);
        C->matmul(bc, x.c, w[p].c, bias ? b[p].c : NULL, n, in, outs[p], y[p].c);
        ref[p] = dl_c(&y[p]);
    }
    const struct kvs_dweight *wg[3] = {w[0].g, n_parts > 1 ? w[1].g : NULL, n_parts > 2 ? w[2].g : NULL};
    const struct kvs_dweight *bg3[3] = {b[0].g, n_parts > 1 ? b[1].g : NULL, n_parts > 2 ? b[2].g : NULL};
    struct kvs_dbuf *yg[3] = {y[0].g, n_parts > 1 ? y[1].g : NULL, n_parts > 2 ? y[2].g : NULL};
#define RUN_OP()                                                                                      \
    do {                                                                                              \
        for (int p = 0; p < n_parts; p++) poison(&y[p]);                                              \
        if (n_parts == 1) G->matmul(bg, x.g, w[0].g, bias ? b[0].g : NULL, n, in, outs[0], y[0].g);  \
        else G->matmul_multi(bg, x.g, n_parts, wg, bias ? bg3 : NULL, n, in, outs, yg);               \
    } while (0)
    kvs_cuda_set_skinny_max(bg, 128);
    kvs_cuda_set_skinny_variant(bg, V_INV);
    RUN_OP();
    for (int p = 0; p < n_parts; p++) inv[p] = dl_g(&y[p]);
    for (int vi = 0; vi < NV; vi++) {
        kvs_cuda_set_skinny_variant(bg, v_new[vi]);
        const unsigned long l0 = kvs_cu_dgemm_n2_launches(), m0 = kvs_cu_dgemm_n3_launches();
        RUN_OP();
        const unsigned long dl = kvs_cu_dgemm_n2_launches() - l0, dm = kvs_cu_dgemm_n3_launches() - m0;
        snprintf(what, sizeof what, "%s n=%d in=%d variant %d: one k_dgemm_n2 launch", name, n, in, v_new[vi]);
        expect_true(what, dl == 1, n > 64 ? "the routing did not take k_dgemm_n2" : "k_dgemm_n2 ran at <= 64 rows");
        snprintf(what, sizeof what, "%s n=%d variant %d: k_dgemm_n3 %s", name, n, v_new[vi],
                 cl_variant(v_new[vi]) && want_n3 ? "ran" : "did not run");
        expect_true(what, dm == (unsigned long)(cl_variant(v_new[vi]) && want_n3), "the cluster routing differs");
        for (int p = 0; p < n_parts; p++) {
            float *got = dl_g(&y[p]);
            snprintf(what, sizeof what, "%s part %d n=%d in=%d out=%d bias=%d variant %d vs CPU", name, p, n, in,
                     outs[p], bias, v_new[vi]);
            expect_rel(what, got, ref[p], (size_t)n * outs[p], 1e-2);
            snprintf(what, sizeof what, "%s part %d n=%d variant %d vs %d (k_dgemm_n x 64 rows)", name, p, n, v_new[vi],
                     V_INV);
            expect_rel(what, got, inv[p], (size_t)n * outs[p], 1e-5);
            free(got);
        }
    }
    /* rows do not depend on n: the first 70 tokens alone give the same bits (the tile size N is a
     * function of the shapes; a row of the wgmma's D depends on its row of x alone) */
    for (int vi = 0; n > 70 && vi < NV; vi += vi ? 1 : 3) {
        kvs_cuda_set_skinny_variant(bg, v_new[vi]);
        RUN_OP();
        float *all = dl_g(&y[0]);
        const int n0 = n;
        n = 70;
        RUN_OP();
        n = n0;
        float *part = dl_g(&y[0]);
        snprintf(what, sizeof what, "%s n=70 rows equal the n=%d launch's (bitwise), variant %d", name, n, v_new[vi]);
        expect_true(what, memcmp(all, part, (size_t)70 * outs[0] * 4) == 0, "bits differ");
        free(all);
        free(part);
    }
#undef RUN_OP
    kvs_cuda_set_skinny_variant(bg, -1);
    kvs_cuda_set_skinny_max(bg, -1);
    for (int p = 0; p < n_parts; p++) {
        dropw(&w[p]);
        dropw(&b[p]);
        drop(&y[p]);
        free(ref[p]);
        free(inv[p]);
    }
    drop(&x);
    free(xv);
}

/* gate/up + SwiGLU at n rows (and, with down_out > 0, the down projection of its result: it reads
 * the bf16 copy the epilogue writes) */
static void swiglu_case(const char *name, int n, int in, int ff, int down)
{
    char what[200];
    float *xv = rand_vec((size_t)n * in, 1.0f), *gv = rand_vec((size_t)ff * in, 0.05f);
    float *uv = rand_vec((size_t)ff * in, 0.05f);
    struct pair x = mk(KVS_BUF_ACT, (size_t)n * in, xv);
    struct wpair gw = mkw(gv, ff, in, 0), uw = mkw(uv, ff, in, 0);
    free(gv);
    free(uv);
    struct pair gt = mk(KVS_BUF_ACT, (size_t)n * ff, NULL), up = mk(KVS_BUF_ACT, (size_t)n * ff, NULL);
    C->matmul(bc, x.c, gw.c, NULL, n, in, ff, gt.c);
    C->matmul(bc, x.c, uw.c, NULL, n, in, ff, up.c);
    C->swiglu(bc, gt.c, up.c, n, ff, gt.c);
    float *ref = dl_c(&gt), *dref = NULL;
    struct wpair dw = {0};
    struct pair dy = {0};
    if (down) {
        float *dv = rand_vec((size_t)in * ff, 0.05f);
        dw = mkw(dv, in, ff, 0);
        free(dv);
        dy = mk(KVS_BUF_ACT, (size_t)n * in, NULL);
        C->matmul(bc, gt.c, dw.c, NULL, n, ff, in, dy.c);
        dref = dl_c(&dy);
    }
    kvs_cuda_set_skinny_max(bg, 128);
    kvs_cuda_set_skinny_variant(bg, V_INV);
    poison(&gt);
    G->matmul_swiglu(bg, x.g, gw.g, uw.g, n, in, ff, gt.g, up.g);
    float *inv = dl_g(&gt);
    for (int vi = 0; vi < NV; vi++) {
        kvs_cuda_set_skinny_variant(bg, v_new[vi]);
        poison(&gt);
        const unsigned long l0 = kvs_cu_dgemm_n2_launches(), m0 = kvs_cu_dgemm_n3_launches();
        G->matmul_swiglu(bg, x.g, gw.g, uw.g, n, in, ff, gt.g, up.g);
        snprintf(what, sizeof what, "%s n=%d in=%d ff=%d variant %d: one k_dgemm_n2 launch", name, n, in, ff, v_new[vi]);
        expect_true(what, kvs_cu_dgemm_n2_launches() - l0 == 1, "the routing did not take k_dgemm_n2");
        snprintf(what, sizeof what, "%s n=%d variant %d: k_dgemm_n3 %s", name, n, v_new[vi],
                 cl_variant(v_new[vi]) ? "ran" : "did not run");
        expect_true(what, kvs_cu_dgemm_n3_launches() - m0 == (unsigned long)cl_variant(v_new[vi]),
                    "the cluster routing differs");
        float *got = dl_g(&gt);
        snprintf(what, sizeof what, "%s n=%d in=%d ff=%d variant %d vs CPU", name, n, in, ff, v_new[vi]);
        expect_rel(what, got, ref, (size_t)n * ff, 1e-2);
        snprintf(what, sizeof what, "%s n=%d ff=%d variant %d vs %d (k_dgemm)", name, n, ff, v_new[vi], V_INV);
        expect_rel(what, got, inv, (size_t)n * ff, 1e-4);
        free(got);
        if (down) {
            poison(&dy);
            const unsigned long l1 = kvs_cu_dgemm_n2_launches();
            G->matmul(bg, gt.g, dw.g, NULL, n, ff, in, dy.g);
            snprintf(what, sizeof what, "%s down n=%d in=%d out=%d variant %d: one k_dgemm_n2 launch", name, n, ff, in,
                     v_new[vi]);
            expect_true(what, kvs_cu_dgemm_n2_launches() - l1 == 1, "the routing did not take k_dgemm_n2");
            float *dgot = dl_g(&dy);
            snprintf(what, sizeof what, "%s down (reads the bf16 copy) n=%d variant %d vs CPU", name, n, v_new[vi]);
            expect_rel(what, dgot, dref, (size_t)n * in, 1e-2);
            free(dgot);
        }
    }
    kvs_cuda_set_skinny_variant(bg, -1);
    kvs_cuda_set_skinny_max(bg, -1);
    if (down) {
        dropw(&dw);
        drop(&dy);
        free(dref);
    }
    dropw(&gw);
    dropw(&uw);
    drop(&gt);
    drop(&up);
    drop(&x);
    free(xv);
    free(ref);
    free(inv);
}

/* every row count 65..128 at the cluster variants: the n = 128 launch against the CPU, and each
 * smaller n's rows bitwise equal to the n = 128 launch's first n rows (its tile rows and cluster
 * size are the shapes', so a row's sum is the same), with k_dgemm_n3 run at each n. Plain: three
 * parts with a partial tile (q/k/v-like, bias); SwiGLU: ff 1000 (a partial tile). */
static void rows_sweep(int swiglu)
{
    const int nmax = 128, in = 512, ff = 1000;
    static const int outs[3] = {1040, 256, 256};
    const int n_parts = swiglu ? 1 : 3;
    char what[200];
    float *xv = rand_vec((size_t)nmax * in, 1.0f);
    struct pair x = mk(KVS_BUF_ACT, (size_t)nmax * in, xv);
    struct wpair w[3], b[3];
    struct pair y[3], up = {0};
    float *ref[3];
    for (int p = 0; p < 3; p++) {
        const int rows = swiglu ? ff : outs[p];
        if (swiglu && p == 2) break;
        float *wv = rand_vec((size_t)rows * in, 0.05f), *bv = rand_vec((size_t)rows, 0.5f);
        w[p] = mkw(wv, rows, in, 0);
        b[p] = mkw(bv, 1, rows, 1);
        free(wv);
        free(bv);
    }
    for (int p = 0; p < n_parts; p++) y[p] = mk(KVS_BUF_ACT, (size_t)nmax * (swiglu ? ff : outs[p]), NULL);
    if (swiglu) {
        up = mk(KVS_BUF_ACT, (size_t)nmax * ff, NULL);
        C->matmul(bc, x.c, w[0].c, NULL, nmax, in, ff, y[0].c);
        C->matmul(bc, x.c, w[1].c, NULL, nmax, in, ff, up.c);
        C->swiglu(bc, y[0].c, up.c, nmax, ff, y[0].c);
        ref[0] = dl_c(&y[0]);
    } else {
        for (int p = 0; p < 3; p++) {
            C->matmul(bc, x.c, w[p].c, b[p].c, nmax, in, outs[p], y[p].c);
            ref[p] = dl_c(&y[p]);
        }
    }
    const struct kvs_dweight *wg[3] = {w[0].g, w[1].g, swiglu ? NULL : w[2].g};
    const struct kvs_dweight *bg3[3] = {b[0].g, b[1].g, swiglu ? NULL : b[2].g};
    struct kvs_dbuf *yg[3] = {y[0].g, swiglu ? NULL : y[1].g, swiglu ? NULL : y[2].g};
    kvs_cuda_set_skinny_max(bg, 128);
    for (int vi = 3; vi < NV; vi++) {
        kvs_cuda_set_skinny_variant(bg, v_new[vi]);
        float *full[3] = {0};
        int bad_n = 0, bad_l = 0;
        for (int n = nmax; n >= 65; n--) {
            for (int p = 0; p < n_parts; p++) poison(&y[p]);
            const unsigned long m0 = kvs_cu_dgemm_n3_launches();
            if (swiglu) G->matmul_swiglu(bg, x.g, w[0].g, w[1].g, n, in, ff, y[0].g, up.g);
            else G->matmul_multi(bg, x.g, 3, wg, bg3, n, in, outs, yg);
            if (kvs_cu_dgemm_n3_launches() - m0 != 1 && !bad_l) bad_l = n;
            for (int p = 0; p < n_parts; p++) {
                const int o = swiglu ? ff : outs[p];
                float *got = dl_g(&y[p]);
                if (n == nmax) {
                    snprintf(what, sizeof what, "%s part %d n=128 in=%d variant %d vs CPU",
                             swiglu ? "row sweep gate/up + SwiGLU ff 1000" : "row sweep q/k/v 1040+256+256", p, in,
                             v_new[vi]);
                    expect_rel(what, got, ref[p], (size_t)nmax * o, 1e-2);
                    full[p] = got;
                    continue;
                }
                if (memcmp(got, full[p], (size_t)n * o * 4) != 0 && !bad_n) bad_n = n;
                free(got);
            }
        }
        char why[64];
        snprintf(why, sizeof why, "first differing n = %d", bad_n);
        snprintf(what, sizeof what, "%s variant %d: n = 65..127 rows bitwise equal the n = 128 launch's",
                 swiglu ? "row sweep SwiGLU" : "row sweep q/k/v", v_new[vi]);
        expect_true(what, bad_n == 0, why);
        snprintf(why, sizeof why, "no k_dgemm_n3 launch at n = %d", bad_l);
        snprintf(what, sizeof what, "%s variant %d: k_dgemm_n3 ran at every n", swiglu ? "row sweep SwiGLU" : "row sweep q/k/v",
                 v_new[vi]);
        expect_true(what, bad_l == 0, why);
        for (int p = 0; p < n_parts; p++) free(full[p]);
    }
    kvs_cuda_set_skinny_variant(bg, -1);
    kvs_cuda_set_skinny_max(bg, -1);
    for (int p = 0; p < (swiglu ? 2 : 3); p++) {
        dropw(&w[p]);
        dropw(&b[p]);
    }
    for (int p = 0; p < n_parts; p++) {
        drop(&y[p]);
        free(ref[p]);
    }
    if (swiglu) drop(&up);
    drop(&x);
    free(xv);
}

/* at 64 rows (k_dgemm_n's) the new bits must not route anything to k_dgemm_n2, and the result stays
 * the default's bits */
static void at_64(void)
{
    const int n = 64, in = 1024, out = 1024;
    char what[160];
    float *xv = rand_vec((size_t)n * in, 1.0f), *wv = rand_vec((size_t)out * in, 0.05f);
    struct pair x = mk(KVS_BUF_ACT, (size_t)n * in, xv), y = mk(KVS_BUF_ACT, (size_t)n * out, NULL);
    struct wpair w = mkw(wv, out, in, 0);
    kvs_cuda_set_skinny_max(bg, 128);
    kvs_cuda_set_skinny_variant(bg, V_BASE);
    poison(&y);
    G->matmul(bg, x.g, w.g, NULL, n, in, out, y.g);
    float *base = dl_g(&y);
    kvs_cuda_set_skinny_variant(bg, v_new[1]);
    poison(&y);
    const unsigned long l0 = kvs_cu_dgemm_n2_launches();
    G->matmul(bg, x.g, w.g, NULL, n, in, out, y.g);
    float *got = dl_g(&y);
    snprintf(what, sizeof what, "n=64 in=%d out=%d variant %d: no k_dgemm_n2 launch, variant %d's bits", in, out, v_new[1],
             V_BASE);
    expect_true(what, kvs_cu_dgemm_n2_launches() == l0 && memcmp(base, got, (size_t)n * out * 4) == 0,
                "k_dgemm_n2 ran or the bits changed");
    kvs_cuda_set_skinny_variant(bg, -1);
    kvs_cuda_set_skinny_max(bg, -1);
    free(base);
    free(got);
    dropw(&w);
    drop(&x);
    drop(&y);
    free(xv);
    free(wv);
}

int main(void)
{
    if (cuda_pair_open(8)) return 1;
    static const int qkv[3] = {4096, 1024, 1024}, smol[3] = {576, 192, 192}, o[1] = {4096}, odd[1] = {1040},
                     wide[1] = {16384};
    plain_case("q/k/v (Llama-3.1-8B)", 128, 4096, 3, qkv, 1, 1);
    plain_case("o (Llama-3.1-8B)", 100, 4096, 1, o, 0, 1);
    plain_case("down (Llama-3.1-8B)", 65, 14336, 1, o, 0, 1);
    plain_case("q/k/v (K 576)", 97, 576, 3, smol, 1, 1);
    plain_case("rows ending inside a tile", 72, 1024, 1, odd, 1, 1);
    /* 16384 rows: no cluster plan fits one wave (171 tiles of 96 rows > 132 SMs): k_dgemm_n2 runs */
    plain_case("more tiles than SMs", 80, 256, 1, wide, 0, 0);
    swiglu_case("gate/up + SwiGLU (Llama-3.1-8B)", 128, 4096, 14336, 1);
    swiglu_case("gate/up + SwiGLU (K 576)", 97, 576, 1536, 0);
    swiglu_case("gate/up + SwiGLU, ff 9000", 66, 256, 9000, 0);
    swiglu_case("gate/up + SwiGLU, ff 1000", 100, 1024, 1000, 0);
    rows_sweep(0);
    rows_sweep(1);
    at_64();
    G->free(bg);
    C->free(bc);
    return kvs_test_summary("test_cuda_dgemm128");
}

#else
int main(void)
{
    fprintf(stderr, "test_cuda_dgemm128: built without CUDA (nvcc not found)\n");
    return 1;
}
#endif
