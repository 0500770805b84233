/* test_cpu_gemm_panel.c: the panel-packed matmul (kernels/cpu/cpu_gemm_panel.c, the default
 * GEMM with FMA) on fresh random inputs:
 *   - fp32 panels: BITWISE equal to its plain-C mirror (kvs_cpu_dot_seq: one fmaf chain over k,
 *     then + bias) for every shape: k around and past the 256-value chunk, outputs around the
 *     16-wide panel (partial last panel), row counts around the 6-row tile and the row block,
 *     the one-row four-panel kernel; with and without bias; 1 and 3 threads bitwise; each row
 *     computed alone equals the row inside the batch (batch invariance); within 1e-5 of the
 *     reference's magnitude bound (fp32 rounding: another summation order);
 *   - bf16 panels (random bits): bitwise the mirror on the widened fp32 copy, on both paths
 *     (rows widened in the tile, and chunks widened once per task);
 *   - GGUF Q4_1 / Q8_0 blocks (the loader's dequantization) reordered into panel order (the
 *     backend's form): every row rebuilds to the fp32 row bitwise, and the panel GEMM on them
 *     (weights rebuilt in its tile; the one-row four-panel kernel, 6-row tiles, short tiles,
 *     partial panels, k chunks) is bitwise the fp32 panels of the same values, 1 and 3 threads;
 *   - kvs_cpu_panels_row gives every row back exactly (embedding lookups). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/util.h"
#include "kernels/cpu/cpu_kernels.h"
#include "models/gguf.h"
#include "models/gguf_quant.h"
#include "tests/unit/cpu_gemm_ref.h"
#include "tests/unit/test_util.h"

static uint64_t g_rng = 0x243f6a8885a308d3ull;
static float frand(void) { return (float)kvs_test_xorshift(&g_rng) / 4294967296.0f * 2.0f - 1.0f; }
static float *rnd(size_t n, float scale)
{
    float *a = kvs_xmalloc(n * sizeof(float) + 4);
    for (size_t i = 0; i < n; i++) a[i] = frand() * scale;
    return a;
}

static const struct kvs_cpu_kernels K_REF = {KVS_CPU_ISA_REF, KVS_CPU_GEMM_INVARIANT, 0};
static int g_avx512;              /* the CPU runs the avx512 set: its 512-bit tiles are checked too */
static int g_avx512_cases;        /* GEMMs of the avx512 tiles found bitwise */

/* the avx512 set's tiles (n x in x out, 3 threads) bitwise want [n][out] */
static void check_avx512(struct kvs_cpu_pool *p3, const float *x, const struct kvs_cpu_panels *pn,
                         const struct kvs_cpu_qblocks *qb, const float *bias, int n, int in, int out, const float *want,
                         const char *what)
{
    if (!g_avx512) return;
    float *y = kvs_xmalloc((size_t)n * out * 4);
    kvs_cpu_gemm_panel_isa(p3, KVS_CPU_ISA_AVX512, x, pn, qb, bias, n, in, out, y);
    CHECK(memcmp(y, want, (size_t)n * out * 4) == 0, "panel %s %dx%dx%d bias=%d: avx512 tiles not bitwise fma's", what,
          n, in, out, bias != NULL);
    g_avx512_cases++;
    free(y);
}

static void test_panels(struct kvs_cpu_pool *p1, struct kvs_cpu_pool *p3)
{
    const int ins[] = {1, 7, 64, 256, 259, 600};
    const int outs[] = {1, 16, 17, 64, 70, 130};
    const int ns[] = {1, 2, 3, 6, 7, 8, 13, 16, 33, 130};
    int cases = 0;
    double worst = 0;
    for (size_t ii = 0; ii < sizeof ins / sizeof *ins; ii++)
        for (size_t oi = 0; oi < sizeof outs / sizeof *outs; oi++)
            for (size_t ni = 0; ni < sizeof ns / sizeof *ns; ni++) {
                const int in = ins[ii], out = outs[oi], n = ns[ni];
                const size_t ne = kvs_cpu_panels_elems(out, in);
                float *x = rnd((size_t)n * in, 1.0f), *w = rnd((size_t)out * in, 0.5f), *bias = rnd(out, 1.0f);
                float *ym = kvs_xmalloc((size_t)n * out * 4), *ya = kvs_xmalloc((size_t)n * out * 4);
                float *yb = kvs_xmalloc((size_t)n * out * 4), *y1 = kvs_xmalloc((size_t)out * 4);
                float *pf = kvs_xmalloc(ne * 4), *wf = kvs_xmalloc((size_t)out * in * 4), *row = kvs_xmalloc((size_t)in * 4);
                uint16_t *wb = kvs_xmalloc((size_t)out * in * 2), *pb = kvs_xmalloc(ne * 2);
                for (size_t i = 0; i < (size_t)out * in; i++) {
                    wb[i] = (uint16_t)(kvs_test_xorshift(&g_rng) >> 16);
                    if ((wb[i] & 0x7f80) == 0x7f80) wb[i] &= 0xbfff;   /* no inf / NaN */
                    wf[i] = kvs_cpu_bf16(wb[i]);
                }
                kvs_cpu_panels_pack_f32(w, out, in, pf);
                kvs_cpu_panels_pack_bf16(wb, out, in, pb);
                const struct kvs_cpu_panels pnf = {.f32 = pf}, pnb = {.bf16 = pb};
                for (int o = 0; o < out; o++) {
                    kvs_cpu_panels_row(&pnf, in, o, row);
                    CHECK(memcmp(row, w + (size_t)o * in, (size_t)in * 4) == 0, "panels_row f32 %d x %d row %d", out, in, o);
                    kvs_cpu_panels_row(&pnb, in, o, row);
                    CHECK(memcmp(row, wf + (size_t)o * in, (size_t)in * 4) == 0, "panels_row bf16 %d x %d row %d", out, in,
                          o);
                }
                for (int with_bias = 0; with_bias < 2; with_bias++) {
                    const float *bb = with_bias ? bias : NULL;
                    gemm_mirror(kvs_cpu_dot_seq, x, w, bb, n, in, out, ym);
                    kvs_cpu_gemm_panel(p3, x, &pnf, NULL, bb, n, in, out, ya);
                    CHECK(memcmp(ym, ya, (size_t)n * out * 4) == 0, "panel %dx%dx%d bias=%d: != its mirror", n, in, out,
                          with_bias);
                    check_avx512(p3, x, &pnf, NULL, bb, n, in, out, ym, "f32");
                    kvs_cpu_gemm_panel(p1, x, &pnf, NULL, bb, n, in, out, yb);
                    CHECK(memcmp(yb, ya, (size_t)n * out * 4) == 0, "panel %dx%dx%d: 1 vs 3 threads", n, in, out);
                    const int t = (int)(kvs_test_xorshift(&g_rng) % (uint32_t)n);
                    kvs_cpu_gemm_panel(p3, x + (size_t)t * in, &pnf, NULL, bb, 1, in, out, y1);
                    CHECK(memcmp(y1, ya + (size_t)t * out, (size_t)out * 4) == 0,
                          "panel %dx%dx%d: row %d alone != in the batch", n, in, out, t);
                    kvs_cpu_gemm(p1, &K_REF, x, w, NULL, bb, n, in, out, yb);
                    const double e = gemm_err(x, w, bb, n, in, out, ya, yb);
                    if (e > worst) worst = e;
                    CHECK(e < 1e-5, "panel %dx%dx%d: vs ref %g of the magnitude bound", n, in, out, e);
                    /* bf16 panels: the mirror on the widened copy */
                    gemm_mirror(kvs_cpu_dot_seq, x, wf, bb, n, in, out, ym);
                    kvs_cpu_gemm_panel(p3, x, &pnb, NULL, bb, n, in, out, ya);
                    CHECK(memcmp(ym, ya, (size_t)n * out * 4) == 0, "panel bf16 %dx%dx%d bias=%d: != its mirror", n, in,
                          out, with_bias);
                    check_avx512(p3, x, &pnb, NULL, bb, n, in, out, ym, "bf16");
                    kvs_cpu_gemm_panel(p1, x + (size_t)t * in, &pnb, NULL, bb, 1, in, out, y1);
                    CHECK(memcmp(y1, ya + (size_t)t * out, (size_t)out * 4) == 0,
                          "panel bf16 %dx%dx%d: row %d alone != in the batch", n, in, out, t);
                    cases++;
                }
                free(x), free(w), free(bias), free(ym), free(ya), free(yb), free(y1), free(pf), free(wf), free(row);
                free(wb), free(pb);
            }
    printf("ok panel gemm: fp32 and bf16 panels bitwise == the fmaf-chain mirror, 1 = 3 threads, batch invariant, "
           "within %.1e of the reference's magnitude bound (%d cases)\n",
           worst, cases);
}

/* one Q4_1 block as llama.cpp writes it (as test_cpu_kernels.c) */
static void q4_1_block(uint8_t *b)
{
    const uint16_t d = (uint16_t)(0x1400 + kvs_test_xorshift(&g_rng) % 0x1400);
    const uint16_t m = (uint16_t)(0x9400 + kvs_test_xorshift(&g_rng) % 0x1800);
    memcpy(b, &d, 2);
    memcpy(b + 2, &m, 2);
    for (int i = 0; i < 16; i++) b[4 + i] = (uint8_t)(kvs_test_xorshift(&g_rng) & 0xFF);
    b[4] &= 0xF0;   /* q = 0 and q = 15 both present */
    b[5] |= 0x0F;
}

static void test_blocks(struct kvs_cpu_pool *p1, struct kvs_cpu_pool *p3)
{
    char err[256];
    int cases = 0;
    const int ins[] = {32, 576, 1536}, outs[] = {7, 33, 64}, ns[] = {1, 2, 5, 16, 40};
    for (int bits = 4; bits <= 8; bits += 4)
        for (size_t ii = 0; ii < sizeof ins / sizeof *ins; ii++)
            for (size_t oi = 0; oi < sizeof outs / sizeof *outs; oi++) {
                const int in = ins[ii], out = outs[oi];
                const size_t nw = (size_t)in * out, nb = nw / 32;
                const size_t bsz = bits == 4 ? 20 : 34;
                uint8_t *raw = kvs_xmalloc(nb * bsz), *q = kvs_xmalloc(nw);
                float *w = kvs_xmalloc(nw * 4), *dm = kvs_xmalloc(nb * 8), *pf = kvs_xmalloc(kvs_cpu_panels_elems(out, in) * 4);
                for (size_t b = 0; b < nb; b++) {
                    if (bits == 4) {
                        q4_1_block(raw + bsz * b);
                    } else {
                        const uint16_t d = (uint16_t)(0x1400 + kvs_test_xorshift(&g_rng) % 0x1400);
                        memcpy(raw + bsz * b, &d, 2);
                        for (int i = 0; i < 32; i++) raw[bsz * b + 2 + i] = (uint8_t)(kvs_test_xorshift(&g_rng) & 0xFF);
                        raw[bsz * b + 2] = 127;
                    }
                }
                REQUIRE(kvs_ggml_dequantize(bits == 4 ? KVS_GGML_Q4_1 : KVS_GGML_Q8_0, raw, w, nw, err, sizeof err) == 0,
                        "dequantize: %s", err);
                const int packed = bits == 4 ? kvs_cpu_q4_pack(w, out, in, q, dm) : kvs_cpu_q8_pack(w, out, in, (int8_t *)q, dm);
                REQUIRE(packed == 1, "%d-bit pack %d x %d failed", bits, out, in);
                /* the backend's form: the blocks reordered into panels (rows past out zero) */
                const struct kvs_cpu_qblocks qr = {.bits = bits, .q = q, .dm = dm};
                uint8_t *pq = kvs_xmalloc(kvs_cpu_qpanels_qbytes(bits, out, in));
                float *pdm = kvs_xmalloc(kvs_cpu_qpanels_dmfloats(bits, out, in) * 4), *row = kvs_xmalloc((size_t)in * 4);
                kvs_cpu_qblocks_to_panels(&qr, out, in, pq, pdm);
                const struct kvs_cpu_qblocks qb = {.bits = bits, .panel = 1, .q = pq, .dm = pdm};
                for (int o = 0; o < out; o++) {
                    kvs_cpu_qb_row(&qb, in, (size_t)o, row);
                    CHECK(memcmp(row, w + (size_t)o * in, (size_t)in * 4) == 0, "%d-bit panel-order row %d of %d x %d: not the fp32 row",
                          bits, o, out, in);
                }
                free(row);
                kvs_cpu_panels_pack_f32(w, out, in, pf);
                const struct kvs_cpu_panels pnf = {.f32 = pf};
                float *bias = rnd((size_t)out, 0.5f);
                for (size_t ni = 0; ni < sizeof ns / sizeof *ns; ni++) {
                    const int n = ns[ni];
                    float *x = rnd((size_t)n * in, 1.0f), *y0 = kvs_xmalloc((size_t)n * out * 4),
                          *y1 = kvs_xmalloc((size_t)n * out * 4);
                    for (int bi = 0; bi < 2; bi++) {
                        const float *bb = bi ? bias : NULL;
                        kvs_cpu_gemm_panel(p1, x, &pnf, NULL, bb, n, in, out, y0);
                        kvs_cpu_gemm_panel(p3, x, NULL, &qb, bb, n, in, out, y1);
                        CHECK(memcmp(y0, y1, (size_t)n * out * 4) == 0, "panel %d-bit %d x %d x %d bias %d: not bitwise fp32",
                              bits, n, in, out, bi);
                        check_avx512(p3, x, NULL, &qb, bb, n, in, out, y0, bits == 4 ? "q4" : "q8");
                        cases++;
                    }
                    free(x), free(y0), free(y1);
                }
                free(raw), free(q), free(w), free(dm), free(pf), free(bias), free(pq), free(pdm);
            }
    printf("ok panel gemm on Q4_1 / Q8_0 blocks in panel order: rows rebuild bitwise, gemm bitwise the fp32 panels (%d cases, 1 and 3 threads)\n", cases);
}

int main(void)
{
    setenv("KVS_CPU_MIN_WORK", "0", 1);   /* every job through the workers (real splits) */
    char err[256];
    struct kvs_cpu_pool *p1 = kvs_cpu_pool_create(1, err, sizeof err), *p3 = kvs_cpu_pool_create(3, err, sizeof err);
    REQUIRE(p1 && p3, "pool: %s", err);
    REQUIRE(kvs_cpu_isa_best() >= KVS_CPU_ISA_FMA, "this CPU has no AVX2 + FMA: the panel GEMM cannot be checked here");
    g_avx512 = kvs_cpu_isa_best() >= KVS_CPU_ISA_AVX512;
    if (!g_avx512) printf("SKIP: avx512 (this CPU has no AVX-512): the 512-bit panel tiles not checked\n");
    test_panels(p1, p3);
    test_blocks(p1, p3);
    if (g_avx512)
        printf("ok avx512 panel tiles (12 rows x 16 outputs): bitwise the fma tiles / fmaf-chain mirror in %d GEMMs "
               "(fp32, bf16, Q4_1, Q8_0 panels, 3 threads)\n", g_avx512_cases);
    kvs_cpu_pool_free(p1);
    kvs_cpu_pool_free(p3);
    return kvs_test_summary("test_cpu_gemm_panel");
}
