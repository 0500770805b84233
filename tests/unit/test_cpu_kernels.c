/* test_cpu_kernels.c: the CPU backend's fast kernels (kernels/cpu/cpu_kernels.h) against the
 * plain-C reference on fresh random inputs.
 *   - AVX2 matmul: BITWISE equal to the reference for every shape (k tails, odd outputs, row
 *     counts around the 4-row tile, one-row decode), with and without bias, 1 and 3 threads;
 *     each row computed alone equals the row inside the batch (batch invariance); with bf16
 *     weights (random bits, exponents near the top included) bitwise equal to the reference on
 *     the widened fp32 copy.
 *   - FMA matmul: BITWISE equal to a plain-C mirror of its order (kvs_cpu_dot_fma: fmaf per
 *     lane, the reference tree), within 1e-5 of the reference's magnitude bound, the same row
 *     alone and in the batch, 1 = 3 threads, bf16 weights as their widening.
 *   - Key-tiled attention (AVX2 and FMA sets): within 1e-5 of the reference (absolute; values
 *     in [-1, 1]; the vector exp and the per-tile rescale reorder the rounding) on paged caches
 *     mixing prefill chunks (longer than a query tile and several key tiles), decode rows and
 *     1-token prompts; GQA 1/2/4/8; block sizes 4, 5 and 16; deferred-RoPE offsets and partially
 *     valid blocks; 1 and 3 threads bitwise. Batch invariance checked directly: every row
 *     computed alone, as a decode row of its sequence, gives the bits it had in the batch.
 *   - OpenBLAS matmul (KVS_CPU_GEMM=blas): within fp32 rounding of the reference (relative error
 *     below 1e-5 of the row's magnitude sum bound), deterministic (same call twice, 1 vs 3
 *     threads: same bits); how many rows lose batch invariance is printed (measured, not
 *     asserted: it depends on OpenBLAS's kernel for this CPU).
 *   - Weight blocks (kvs_cpu_q4_pack / q8_pack): GGUF Q4_1 / Q8_0 blocks (random fp16 scales)
 *     dequantized by the loader's own code pack, each row rebuilds bitwise, and kvs_cpu_gemm_qb
 *     (avx2 and fma, 1 and 3 threads, row counts 1-17, bias or not) is BITWISE kvs_cpu_gemm on
 *     the fp32 values; plain random fp32 matrices and widths not a multiple of 32 do not pack.
 * Where the CPU has no AVX2 the AVX2 checks cannot run: the program says so and fails. */
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

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static float frand(void) { return (float)kvs_test_xorshift(&g_rng) / 4294967296.0f * 2.0f - 1.0f; }
static float *rnd(size_t n, float scale)
{
    float *a = kvs_xmalloc(n * sizeof(float) + 4);
    for (size_t i = 0; i < n; i++) a[i] = frand() * scale;
    return a;
}

static const struct kvs_cpu_kernels K_REF = {KVS_CPU_ISA_REF, KVS_CPU_GEMM_INVARIANT, 0};
static const struct kvs_cpu_kernels K_AVX2 = {KVS_CPU_ISA_AVX2, KVS_CPU_GEMM_INVARIANT, 1};
static const struct kvs_cpu_kernels K_FMA = {KVS_CPU_ISA_FMA, KVS_CPU_GEMM_INVARIANT, 1};
static const struct kvs_cpu_kernels K_BLAS = {KVS_CPU_ISA_FMA, KVS_CPU_GEMM_BLAS, 0};
static const struct kvs_cpu_kernels K_AVX512 = {KVS_CPU_ISA_AVX512, KVS_CPU_GEMM_INVARIANT, 1};

static void test_gemm(struct kvs_cpu_pool *p1, struct kvs_cpu_pool *p3)
{
    const int ins[] = {1, 7, 8, 64, 256, 259, 640};
    const int outs[] = {1, 3, 17, 64, 130};
    const int ns[] = {1, 2, 3, 4, 5, 9, 16, 33, 70};
    int cases = 0;
    double fma_worst = 0;
    for (int ii = 0; ii < 7; ii++)
        for (int oi = 0; oi < 5; oi++)
            for (int ni = 0; ni < 9; ni++) {
                int in = ins[ii], out = outs[oi], n = ns[ni];
                float *x = rnd((size_t)n * in, 1.0f), *w = rnd((size_t)out * in, 0.5f), *bias = rnd(out, 1.0f);
                float *yr = kvs_xmalloc((size_t)n * out * 4), *ya = kvs_xmalloc((size_t)n * out * 4);
                float *y1 = kvs_xmalloc((size_t)out * 4), *wf = kvs_xmalloc((size_t)out * in * 4);
                float *y2 = kvs_xmalloc((size_t)n * out * 4);
                uint16_t *wb = kvs_xmalloc((size_t)out * in * 2);
                for (size_t i = 0; i < (size_t)out * in; i++) {
                    wb[i] = (uint16_t)(kvs_test_xorshift(&g_rng) >> 16);
                    if ((wb[i] & 0x7f80) == 0x7f80) wb[i] &= 0xbfff;   /* no inf / NaN */
                    wf[i] = kvs_cpu_bf16(wb[i]);
                }
                for (int with_bias = 0; with_bias < 2; with_bias++) {
                    const float *bb = with_bias ? bias : NULL;
                    kvs_cpu_gemm(p1, &K_REF, x, w, NULL, bb, n, in, out, yr);
                    kvs_cpu_gemm(p3, &K_AVX2, x, w, NULL, bb, n, in, out, ya);
                    CHECK(memcmp(yr, ya, (size_t)n * out * 4) == 0, "gemm %dx%dx%d bias=%d: avx2 (3 threads) != ref", n,
                          in, out, with_bias);
                    kvs_cpu_gemm(p1, &K_AVX2, x, w, NULL, bb, n, in, out, ya);
                    CHECK(memcmp(yr, ya, (size_t)n * out * 4) == 0, "gemm %dx%dx%d bias=%d: avx2 (1 thread) != ref", n,
                          in, out, with_bias);
                    int t = (int)(kvs_test_xorshift(&g_rng) % (uint32_t)n);
                    kvs_cpu_gemm(p3, &K_AVX2, x + (size_t)t * in, w, NULL, bb, 1, in, out, y1);
                    CHECK(memcmp(y1, ya + (size_t)t * out, (size_t)out * 4) == 0,
                          "gemm %dx%dx%d: row %d alone != in the batch", n, in, out, t);
                    /* bf16 weights: the reference on the widened copy, bitwise */
                    kvs_cpu_gemm(p1, &K_REF, x, wf, NULL, bb, n, in, out, yr);
                    kvs_cpu_gemm(p3, &K_AVX2, x, NULL, wb, bb, n, in, out, ya);
                    CHECK(memcmp(yr, ya, (size_t)n * out * 4) == 0, "gemm %dx%dx%d bias=%d: avx2 bf16 != ref", n, in,
                          out, with_bias);
                    kvs_cpu_gemm(p1, &K_AVX2, x + (size_t)t * in, NULL, wb, bb, 1, in, out, y1);
                    CHECK(memcmp(y1, ya + (size_t)t * out, (size_t)out * 4) == 0,
                          "gemm %dx%dx%d: bf16, row %d alone != in the batch", n, in, out, t);
                    /* FMA: bitwise the plain-C fmaf mirror, within rounding of the reference,
                     * thread-count and batch invariant, bf16 weights as their fp32 widening */
                    gemm_mirror(kvs_cpu_dot_fma, x, w, bb, n, in, out, yr);
                    kvs_cpu_gemm(p3, &K_FMA, x, w, NULL, bb, n, in, out, ya);
                    CHECK(memcmp(yr, ya, (size_t)n * out * 4) == 0, "gemm %dx%dx%d bias=%d: fma != its mirror", n, in,
                          out, with_bias);
                    kvs_cpu_gemm(p1, &K_FMA, x, w, NULL, bb, n, in, out, y2);
                    CHECK(memcmp(y2, ya, (size_t)n * out * 4) == 0, "gemm %dx%dx%d: fma 1 vs 3 threads", n, in, out);
                    kvs_cpu_gemm(p1, &K_REF, x, w, NULL, bb, n, in, out, y2);
                    double e = gemm_err(x, w, bb, n, in, out, ya, y2);
                    if (e > fma_worst) fma_worst = e;
                    CHECK(e < 1e-5, "gemm %dx%dx%d: fma vs ref %g of the magnitude bound", n, in, out, e);
                    kvs_cpu_gemm(p3, &K_FMA, x + (size_t)t * in, w, NULL, bb, 1, in, out, y1);
                    CHECK(memcmp(y1, ya + (size_t)t * out, (size_t)out * 4) == 0,
                          "gemm %dx%dx%d: fma, row %d alone != in the batch", n, in, out, t);
                    gemm_mirror(kvs_cpu_dot_fma, x, wf, bb, n, in, out, yr);
                    kvs_cpu_gemm(p3, &K_FMA, x, NULL, wb, bb, n, in, out, ya);
                    CHECK(memcmp(yr, ya, (size_t)n * out * 4) == 0, "gemm %dx%dx%d bias=%d: fma bf16 != its mirror", n,
                          in, out, with_bias);
                    cases++;
                }
                free(x), free(w), free(bias), free(yr), free(ya), free(y1), free(y2), free(wf), free(wb);
            }
    printf("ok gemm: avx2 (fp32 and bf16 weights) bitwise == reference, fma bitwise == its fmaf mirror and within "
           "%.1e of the reference's magnitude bound, both batch invariant (%d shape cases, 1 and 3 threads)\n",
           fma_worst, cases);
}

static void test_blas(struct kvs_cpu_pool *p1, struct kvs_cpu_pool *p3)
{
    const int shapes[][3] = {{8, 256, 640}, {70, 256, 640}, {300, 640, 256}, {33, 256, 1000}, {9, 7, 3}};
    long rows_total = 0, rows_variant = 0;
    for (int si = 0; si < 5; si++) {
        int n = shapes[si][0], in = shapes[si][1], out = shapes[si][2];
        float *x = rnd((size_t)n * in, 1.0f), *w = rnd((size_t)out * in, 0.5f), *bias = rnd(out, 1.0f);
        float *yr = kvs_xmalloc((size_t)n * out * 4), *yb = kvs_xmalloc((size_t)n * out * 4);
        float *y2 = kvs_xmalloc((size_t)n * out * 4);
        kvs_cpu_gemm(p1, &K_REF, x, w, NULL, bias, n, in, out, yr);
        kvs_cpu_gemm(p3, &K_BLAS, x, w, NULL, bias, n, in, out, yb);
        /* error bound per element: fp32 rounding of a length-in sum of |x||w| terms */
        double worst = 0;
        for (int t = 0; t < n; t++)
            for (int o = 0; o < out; o++) {
                double mag = fabs(bias[o]);
                for (int k = 0; k < in; k++) mag += fabs((double)x[(size_t)t * in + k] * w[(size_t)o * in + k]);
                double e = fabs((double)yb[(size_t)t * out + o] - yr[(size_t)t * out + o]) / mag;
                if (!(e <= worst)) worst = e;
            }
        CHECK(worst < 1e-5, "blas %dx%dx%d: error %g of the magnitude bound", n, in, out, worst);
        kvs_cpu_gemm(p3, &K_BLAS, x, w, NULL, bias, n, in, out, y2);
        CHECK(memcmp(yb, y2, (size_t)n * out * 4) == 0, "blas %dx%dx%d: two runs differ", n, in, out);
        kvs_cpu_gemm(p1, &K_BLAS, x, w, NULL, bias, n, in, out, y2);
        CHECK(memcmp(yb, y2, (size_t)n * out * 4) == 0, "blas %dx%dx%d: 1 vs 3 threads differ", n, in, out);
        /* batch invariance, measured: the first rows again as a smaller batch */
        if (n >= 2 * KVS_CPU_BLAS_MIN_ROWS) {
            int m = n / 2 + 1;
            kvs_cpu_gemm(p3, &K_BLAS, x, w, NULL, bias, m, in, out, y2);
            for (int t = 0; t < m; t++) {
                rows_total++;
                rows_variant += memcmp(y2 + (size_t)t * out, yb + (size_t)t * out, (size_t)out * 4) != 0;
            }
        }
        free(x), free(w), free(bias), free(yr), free(yb), free(y2);
    }
    printf("ok blas (%s): within 1e-5 of the magnitude bound, deterministic across runs and thread counts; "
           "NOT batch invariant: %ld of %ld rows changed bits when the batch shrank\n",
           kvs_cpu_blas_name(), rows_variant, rows_total);
}

struct seq {
    int pos, rows;
};

static double g_attn_worst[4];   /* per kernel set: worst |tiled - ref| (values in [-1, 1]) */

static void attention_case(struct kvs_cpu_pool *p1, struct kvs_cpu_pool *p3, const struct kvs_cpu_kernels *kk,
                           const struct seq *seqs, int n_seqs, int n_heads, int n_kv, int hd, int bs, int deferred,
                           const char *what)
{
    int n = 0, max_ctx = 0;
    int32_t q_start[16], pos[16];
    for (int s = 0; s < n_seqs; s++) {
        q_start[s] = n;
        pos[s] = seqs[s].pos;
        n += seqs[s].rows;
        if (seqs[s].pos + seqs[s].rows > max_ctx) max_ctx = seqs[s].pos + seqs[s].rows;
    }
    q_start[n_seqs] = n;
    int max_blocks = (max_ctx + bs - 1) / bs, n_blocks = n_seqs * max_blocks;
    /* shuffled physical blocks */
    int32_t *bt = kvs_xmalloc((size_t)n_blocks * 4), *rot = kvs_xmalloc((size_t)n_blocks * 4);
    int32_t *valid = kvs_xmalloc((size_t)n_blocks * 4);
    for (int i = 0; i < n_blocks; i++) bt[i] = i;
    for (int i = n_blocks - 1; i > 0; i--) {
        int k = (int)(kvs_test_xorshift(&g_rng) % (uint32_t)(i + 1)), t = bt[i];
        bt[i] = bt[k], bt[k] = t;
    }
    for (int i = 0; i < n_blocks; i++) {
        rot[i] = deferred ? (int)(kvs_test_xorshift(&g_rng) % 200) - 100 : 0;
        /* the last valid block of a sequence must keep its slot 0 */
        valid[i] = deferred ? 1 + (int)(kvs_test_xorshift(&g_rng) % (uint32_t)bs) : bs;
    }
    size_t kv_n = (size_t)n_blocks * n_kv * bs * hd;
    float *kc = rnd(kv_n, 1.0f), *vc = rnd(kv_n, 1.0f), *q = rnd((size_t)n * n_heads * hd, 1.0f);
    float *inv_freq = kvs_xmalloc((size_t)hd / 2 * 4);
    for (int i = 0; i < hd / 2; i++) inv_freq[i] = powf(10000.0f, -2.0f * i / hd);
    float *o_ref = kvs_xmalloc((size_t)n * n_heads * hd * 4), *o_avx = kvs_xmalloc((size_t)n * n_heads * hd * 4);
    struct kvs_cpu_attn_args a = {
        .q = q, .kc = kc, .vc = vc, .inv_freq = inv_freq, .out = o_ref, .q_start = q_start, .pos = pos, .bt = bt,
        .rot = deferred ? rot : NULL, .valid = deferred ? valid : NULL, .n = n, .n_seqs = n_seqs,
        .max_blocks = max_blocks, .n_heads = n_heads, .n_kv_heads = n_kv, .head_dim = hd, .block_size = bs,
        .scale = 1.0f / sqrtf((float)hd),
    };
    kvs_cpu_attention(p1, &K_REF, &a);
    int finite = 1;
    for (size_t i = 0; i < (size_t)n * n_heads * hd; i++) finite &= isfinite(o_ref[i]);
    CHECK(finite, "attention %s: reference output not finite", what);
    a.out = o_avx;
    kvs_cpu_attention(p3, kk, &a);
    /* the tiled kernels differ from the reference by rounding only (vector exp, per-tile
     * rescale): each output is a convex combination of values in [-1, 1] */
    double worst = 0;
    for (size_t i = 0; i < (size_t)n * n_heads * hd; i++) {
        double e = fabs((double)o_ref[i] - o_avx[i]);
        if (!(e <= worst)) worst = e;
    }
    if (worst > g_attn_worst[kk->isa]) g_attn_worst[kk->isa] = worst;
    CHECK(worst < 1e-5, "attention %s h=%d/%d hd=%d bs=%d: %s differs from ref by %g", what, n_heads, n_kv, hd, bs,
          kvs_cpu_isa_name(kk->isa), worst);
    float *o_1t = kvs_xmalloc((size_t)n * n_heads * hd * 4);
    if (kk->isa == KVS_CPU_ISA_AVX512) {
        /* the avx512 set does the FMA set's operations per element at 16 lanes: same bits */
        a.out = o_1t;
        kvs_cpu_attention(p1, &K_FMA, &a);
        size_t diff = 0;
        for (size_t i = 0; i < (size_t)n * n_heads * hd; i++) diff += memcmp(&o_1t[i], &o_avx[i], 4) != 0;
        CHECK(diff == 0, "attention %s h=%d/%d hd=%d bs=%d: avx512 differs from fma in %zu of %zu outputs", what, n_heads,
              n_kv, hd, bs, diff, (size_t)n * n_heads * hd);
    }
    a.out = o_1t;
    kvs_cpu_attention(p1, kk, &a);
    CHECK(memcmp(o_1t, o_avx, (size_t)n * n_heads * hd * 4) == 0, "attention %s h=%d/%d hd=%d bs=%d: 1 vs 3 threads",
          what, n_heads, n_kv, hd, bs);
    /* batch invariance: every row again on its own, as a decode row of its sequence */
    int same = 1;
    for (int s = 0; s < n_seqs; s++)
        for (int r = q_start[s]; r < q_start[s + 1]; r++) {
            int32_t qs1[2] = {0, 1}, pos1 = pos[s] + (r - q_start[s]);
            struct kvs_cpu_attn_args b1 = a;
            b1.q = q + (size_t)r * n_heads * hd;
            b1.out = o_1t;
            b1.q_start = qs1;
            b1.pos = &pos1;
            b1.bt = bt + (size_t)s * max_blocks;
            b1.rot = a.rot ? rot + (size_t)s * max_blocks : NULL;
            b1.valid = a.valid ? valid + (size_t)s * max_blocks : NULL;
            b1.n = 1;
            b1.n_seqs = 1;
            kvs_cpu_attention(p3, kk, &b1);
            same &= memcmp(o_1t, o_avx + (size_t)r * n_heads * hd, (size_t)n_heads * hd * 4) == 0;
        }
    CHECK(same, "attention %s h=%d/%d hd=%d bs=%d: a row alone differs from the row in the batch", what, n_heads, n_kv,
          hd, bs);
    free(o_1t);
    free(bt), free(rot), free(valid), free(kc), free(vc), free(q), free(inv_freq), free(o_ref), free(o_avx);
}

static void test_attention(struct kvs_cpu_pool *p1, struct kvs_cpu_pool *p3)
{
    /* a prefill longer than a tile, a chunk on top of a cache, decode rows, a 1-token prompt */
    const struct seq mix[] = {{0, 37}, {40, 7}, {65, 1}, {0, 1}, {16, 1}};
    const struct seq decode1[] = {{90, 1}};
    const int gqa[][2] = {{4, 4}, {4, 2}, {8, 2}, {8, 1}};
    const struct seq longp[] = {{0, 70}, {100, 40}};   /* several key tiles, rows crossing them */
    int sets = 2;
    if (kvs_cpu_isa_best() >= KVS_CPU_ISA_AVX512)
        sets = 3;
    else
        printf("SKIP: avx512 (this CPU has no AVX-512): attention avx512 vs fma / ref not checked\n");
    for (int ki = 0; ki < sets; ki++) {
        const struct kvs_cpu_kernels *kk = ki == 2 ? &K_AVX512 : ki ? &K_FMA : &K_AVX2;
        for (int gi = 0; gi < 4; gi++) {
            attention_case(p1, p3, kk, mix, 5, gqa[gi][0], gqa[gi][1], 32, 16, 0, "mixed batch");
            attention_case(p1, p3, kk, mix, 5, gqa[gi][0], gqa[gi][1], 64, 5, 0, "mixed batch");
            attention_case(p1, p3, kk, decode1, 1, gqa[gi][0], gqa[gi][1], 64, 16, 0, "one decode row");
        }
        attention_case(p1, p3, kk, longp, 2, 4, 1, 64, 16, 0, "long prefill chunks");
        attention_case(p1, p3, kk, mix, 5, 8, 2, 32, 16, 1, "deferred RoPE + partly valid blocks");
        attention_case(p1, p3, kk, longp, 2, 8, 2, 32, 5, 1, "deferred RoPE + partly valid blocks, long");
        attention_case(p1, p3, kk, mix, 5, 4, 1, 20, 4, 1, "deferred RoPE, head_dim 20");
        attention_case(p1, p3, kk, mix, 5, 2, 1, 1024, 16, 0, "head_dim 1024");
        if (ki == 2) {   /* head_dims off the 16 / 32 / 64 steps: the masked tails */
            attention_case(p1, p3, kk, mix, 5, 4, 2, 24, 16, 0, "head_dim 24");
            attention_case(p1, p3, kk, mix, 5, 8, 2, 96, 16, 0, "head_dim 96");
            attention_case(p1, p3, kk, longp, 2, 8, 1, 48, 16, 0, "head_dim 48, 8 heads per kv head");
        }
    }
    printf("ok attention: key-tiled avx2 / fma within %.1e / %.1e of the reference (bound 1e-5), every row alone "
           "bitwise as in the batch, 1 = 3 threads (GQA 1-8, block sizes 4/5/16, deferred RoPE, partial blocks)\n",
           g_attn_worst[KVS_CPU_ISA_AVX2], g_attn_worst[KVS_CPU_ISA_FMA]);
    if (sets == 3)
        printf("ok attention avx512: bitwise the fma set in every case above (+ head_dim 24 / 48 / 96), within %.1e of "
               "the reference\n", g_attn_worst[KVS_CPU_ISA_AVX512]);
}

/* one Q4_1 block as llama.cpp writes it: fp16 d > 0, fp16 m, q 0 and 15 both present (the
 * quantizer maps the block's min to 0 and its max to 15) */
static void q4_1_block(uint8_t *b)
{
    const uint16_t d = (uint16_t)(0x1400 + kvs_test_xorshift(&g_rng) % 0x1400);    /* ~1e-3 .. 0.03 */
    const uint16_t m = (uint16_t)(0x9400 + kvs_test_xorshift(&g_rng) % 0x1800);    /* ~-1e-3 .. -0.1 */
    memcpy(b, &d, 2);
    memcpy(b + 2, &m, 2);
    for (int i = 0; i < 16; i++) b[4 + i] = (uint8_t)(kvs_test_xorshift(&g_rng) & 0xFF);
    const int i0 = (int)(kvs_test_xorshift(&g_rng) % 32), i1 = (i0 + 1 + (int)(kvs_test_xorshift(&g_rng) % 31)) % 32;
    b[4 + i0 % 16] = (uint8_t)(i0 < 16 ? b[4 + i0 % 16] & 0xF0 : b[4 + i0 % 16] & 0x0F);   /* q = 0 */
    b[4 + i1 % 16] = (uint8_t)(i1 < 16 ? b[4 + i1 % 16] | 0x0F : b[4 + i1 % 16] | 0xF0);   /* q = 15 */
}

static void test_q4(struct kvs_cpu_pool *p1, struct kvs_cpu_pool *p3)
{
    const int ins[] = {32, 96, 576}, outs[] = {1, 7, 33, 64}, ns[] = {1, 3, 4, 5, 17};
    char err[256];
    int cases = 0;
    for (size_t ii = 0; ii < sizeof ins / sizeof *ins; ii++)
        for (size_t oi = 0; oi < sizeof outs / sizeof *outs; oi++) {
            const int in = ins[ii], out = outs[oi];
            const size_t nw = (size_t)in * out, nb = nw / 32;
            uint8_t *raw = kvs_xmalloc(nb * 20);
            for (size_t b = 0; b < nb; b++) q4_1_block(raw + 20 * b);
            float *w = kvs_xmalloc(nw * 4), *row = kvs_xmalloc((size_t)in * 4);
            REQUIRE(kvs_ggml_dequantize(KVS_GGML_Q4_1, raw, w, nw, err, sizeof err) == 0, "dequantize: %s", err);
            uint8_t *nib = kvs_xmalloc(nw / 2);
            float *dm = kvs_xmalloc(nb * 8);
            REQUIRE(kvs_cpu_q4_pack(w, out, in, nib, dm) == 1, "q4 pack %d x %d: Q4_1 values did not pack", out, in);
            const struct kvs_cpu_qblocks qb = {.bits = 4, .q = nib, .dm = dm};
            int same = 1;
            for (int o = 0; o < out; o++) {
                kvs_cpu_qb_row(&qb, in, (size_t)o, row);
                same &= memcmp(row, w + (size_t)o * in, (size_t)in * 4) == 0;
            }
            CHECK(same, "q4 %d x %d: a rebuilt row differs from the loader's fp32 values", out, in);
            float *bias = rnd((size_t)out, 0.5f);
            for (size_t ni = 0; ni < sizeof ns / sizeof *ns; ni++) {
                const int n = ns[ni];
                float *x = rnd((size_t)n * in, 1.0f), *y0 = kvs_xmalloc((size_t)n * out * 4), *y1 = kvs_xmalloc((size_t)n * out * 4);
                const struct kvs_cpu_kernels *ks[2] = {&K_AVX2, &K_FMA};
                for (int ki = 0; ki < 2; ki++)
                    for (int bi = 0; bi < 2; bi++) {
                        const float *bb = bi ? bias : NULL;
                        kvs_cpu_gemm(p1, ks[ki], x, w, NULL, bb, n, in, out, y0);
                        kvs_cpu_gemm_qb(p3, ks[ki], x, &qb, bb, n, in, out, y1);
                        CHECK(memcmp(y0, y1, (size_t)n * out * 4) == 0, "gemm_q4 %s %d x %d x %d bias %d: not bitwise fp32",
                              kvs_cpu_isa_name(ks[ki]->isa), n, in, out, bi);
                        kvs_cpu_gemm_qb(p1, ks[ki], x, &qb, bb, n, in, out, y1);
                        CHECK(memcmp(y0, y1, (size_t)n * out * 4) == 0, "gemm_q4 %s %d x %d x %d: 1 thread differs",
                              kvs_cpu_isa_name(ks[ki]->isa), n, in, out);
                        cases++;
                    }
                free(x), free(y0), free(y1);
            }
            free(bias), free(raw), free(w), free(row), free(nib), free(dm);
        }
    /* Q8_0 blocks (the loader's code): pack as 8-bit, rebuild bitwise, gemm bitwise */
    {
        const int in = 576, out = 45, n = 5;
        const size_t nw = (size_t)in * out, nb = nw / 32;
        uint8_t *raw = kvs_xmalloc(nb * 34);
        for (size_t b = 0; b < nb; b++) {
            const uint16_t d = (uint16_t)(0x1400 + kvs_test_xorshift(&g_rng) % 0x1400);
            memcpy(raw + 34 * b, &d, 2);
            for (int i = 0; i < 32; i++) raw[34 * b + 2 + i] = (uint8_t)(kvs_test_xorshift(&g_rng) & 0xFF);
            raw[34 * b + 2 + kvs_test_xorshift(&g_rng) % 32] = (uint8_t)(kvs_test_xorshift(&g_rng) & 1 ? 127 : 0x81); /* |q| = 127 */
        }
        float *w = kvs_xmalloc(nw * 4), *x = rnd((size_t)n * in, 1.0f), *y0 = kvs_xmalloc((size_t)n * out * 4),
              *y1 = kvs_xmalloc((size_t)n * out * 4), *d = kvs_xmalloc(nb * 4);
        int8_t *q = kvs_xmalloc(nw);
        REQUIRE(kvs_ggml_dequantize(KVS_GGML_Q8_0, raw, w, nw, err, sizeof err) == 0, "dequantize: %s", err);
        CHECK(kvs_cpu_q4_pack(w, out, in, (uint8_t *)q, d) == 0, "q8 values packed as 4-bit blocks");
        REQUIRE(kvs_cpu_q8_pack(w, out, in, q, d) == 1, "q8 pack: Q8_0 values did not pack");
        const struct kvs_cpu_qblocks qb = {.bits = 8, .q = (const uint8_t *)q, .dm = d};
        for (int nn = 1; nn <= n; nn += 4) {
            kvs_cpu_gemm(p1, &K_FMA, x, w, NULL, NULL, nn, in, out, y0);
            kvs_cpu_gemm_qb(p3, &K_FMA, x, &qb, NULL, nn, in, out, y1);
            CHECK(memcmp(y0, y1, (size_t)nn * out * 4) == 0, "gemm_qb 8-bit %d rows: not bitwise fp32", nn);
            cases++;
        }
        free(raw), free(w), free(x), free(y0), free(y1), free(d), free(q);
    }
    /* matrices that are not such blocks stay fp32 */
    float *r = rnd(64 * 96, 1.0f);
    uint8_t nib[64 * 96 / 2];
    float dm[64 * 96 / 32 * 2];
    CHECK(kvs_cpu_q4_pack(r, 64, 96, nib, dm) == 0, "q4 pack: random fp32 values packed");
    CHECK(kvs_cpu_q8_pack(r, 16, 96, (int8_t *)nib, dm) == 0, "q8 pack: random fp32 values packed");
    CHECK(kvs_cpu_q4_pack(r, 96, 64 - 8, nib, dm) == 0, "q4 pack: a width not a multiple of 32 packed");
    free(r);
    printf("ok weight blocks: Q4_1 / Q8_0 values pack, rows rebuild bitwise, gemm_qb avx2 / fma bitwise the fp32 gemm "
           "(%d cases, 1 and 3 threads); random fp32 does not pack\n", cases);
}

/* the vector SwiGLU (cpu_act.c) against the libm form in double, over the whole fp32 range of
 * a gate: relative 1e-6, or an absolute 1e-30 where the true value underflows (g < -87) */
static void test_swiglu(void)
{
    enum { N = 4099 };
    float *g = kvs_xmalloc(N * 4), *u = kvs_xmalloc(N * 4), *y = kvs_xmalloc(N * 4);
    for (int i = 0; i < N; i++) {
        g[i] = i < 64 ? (float)(i - 32) * 4.0f : frand() * (i % 3 == 0 ? 120.0f : 8.0f);
        u[i] = frand() * 2.0f;
    }
    g[0] = 0.0f, g[1] = -0.0f, g[2] = 1e-30f, g[3] = -1e-30f, g[4] = 88.7f, g[5] = -88.7f, g[6] = 3e38f, g[7] = -3e38f;
    kvs_cpu_swiglu_row(g, u, N, y);
    double worst = 0;
    for (int i = 0; i < N; i++) {
        const double ref = (double)g[i] / (1.0 + exp(-(double)g[i])) * u[i];
        const double e = fabs(y[i] - ref) / (fabs(ref) + 1e-30 / 1e-6);
        CHECK(isfinite(y[i]) && e < 1e-6, "swiglu g=%g u=%g: %g vs %g", g[i], u[i], y[i], ref);
        if (e > worst) worst = e;
    }
    free(g), free(u), free(y);
    printf("ok swiglu (vector exp): within %.1e relative of the libm form in double (gates over +-3e38)\n", worst);
}

/* The FMA set's RMSNorm row (16 double lanes) against the reference's serial double sum,
 * same roundings after it: within 1 ulp per element; dims with and without tails, aliasing */
static float ulp_of(float v) { return nextafterf(fabsf(v), INFINITY) - fabsf(v); }

static void test_rmsnorm_row(void)
{
    if (kvs_cpu_isa_best() < KVS_CPU_ISA_FMA) {
        printf("SKIP: rmsnorm row: no FMA on this CPU (the vector row is not used)\n");
        return;
    }
    static const int dims[] = {1, 13, 16, 64, 72, 256, 576, 2048, 4099};
    int rows = 0, equal = 0;
    for (size_t di = 0; di < sizeof dims / sizeof dims[0]; di++) {
        const int d = dims[di];
        float *x = malloc(d * sizeof *x), *w = malloc(d * sizeof *w), *y = malloc(d * sizeof *y);
        float *r = malloc(d * sizeof *r), *xa = malloc(d * sizeof *xa);
        for (int rep = 0; rep < 20; rep++) {
            const float scale = rep % 4 == 0 ? 1e-3f : rep % 4 == 1 ? 1e3f : 1.0f;
            for (int i = 0; i < d; i++) x[i] = scale * frand(), w[i] = 1.0f + 0.5f * frand();
            double ss = 0.0;
            for (int i = 0; i < d; i++) ss += (double)x[i] * (double)x[i];
            const float inv = (float)(1.0 / sqrt(ss / d + 1e-6));
            for (int i = 0; i < d; i++) r[i] = w[i] * (x[i] * inv);
            kvs_cpu_rmsnorm_row(x, w, 1e-6f, d, y);
            memcpy(xa, x, d * sizeof *x);
            kvs_cpu_rmsnorm_row(xa, w, 1e-6f, d, xa);   /* in place, as head_rmsnorm runs it */
            int same = 1;
            for (int i = 0; i < d; i++) {
                CHECK(fabsf(y[i] - r[i]) <= ulp_of(r[i]), "rmsnorm d=%d i=%d: %.9g vs %.9g", d, i, y[i], r[i]);
                CHECK(xa[i] == y[i], "rmsnorm in place differs at d=%d i=%d", d, i);
                same &= y[i] == r[i];
            }
            rows++, equal += same;
        }
        free(x), free(w), free(y), free(r), free(xa);
    }
    printf("ok rmsnorm row (16 double lanes): within 1 ulp of the serial sum; %d of %d rows bitwise equal\n", equal,
           rows);
}

int main(void)
{
    /* every job through the workers, however small (cpu_pool.h runs small ones inline by
     * default), so the thread-count checks below compare real splits */
    setenv("KVS_CPU_MIN_WORK", "0", 1);
    char err[256];
    struct kvs_cpu_pool *p1 = kvs_cpu_pool_create(1, err, sizeof err), *p3 = kvs_cpu_pool_create(3, err, sizeof err);
    REQUIRE(p1 && p3, "pool: %s", err);
    kvs_cpu_blas_init();
    REQUIRE(kvs_cpu_isa_best() >= KVS_CPU_ISA_FMA, "this CPU has no AVX2 + FMA: the fast kernels cannot be checked here");
    test_gemm(p1, p3);
    test_attention(p1, p3);
    test_blas(p1, p3);
    test_q4(p1, p3);
    test_swiglu();
    test_rmsnorm_row();
    kvs_cpu_pool_free(p1);
    kvs_cpu_pool_free(p3);
    return kvs_test_summary("test_cpu_kernels");
}
