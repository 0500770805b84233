/* cpu_gemm_panel.c: the panel-packed matmul (cpu_kernels.h, KVS_CPU_GEMM_PANEL): weights packed
 * once at upload as [panel of 16 outputs][in][16], an outer-product register tile (up to 6 rows
 * x 16 outputs) of fused multiply-adds over k in increasing order. Each y element is one fma
 * chain from 0 (kvs_cpu_dot_seq) then + bias, whatever the tile, row block, k chunk or thread:
 * bitwise that plain-C mirror and batch invariant. Why panels: the dot-product tiles of
 * cpu_gemm.c keep 8 lanes per (row, output) and pay a horizontal sum per element; with in = 256
 * that is 1 tree per 32 multiply-adds, and they load 7 vectors per 12 multiply-adds. Here there
 * is no tree and 2 vector loads + 6 broadcasts feed 12 (bench/RESULTS.md has the rates).
 * GGUF Q4_1 / Q8_0 matrices come as blocks in panel order (cpu_kernels.h): the tile rebuilds one
 * k step's 16 weights in registers (widen, convert, multiply, and for 4 bits add: the row form's
 * own operations, so the same fp32 weights and bits) for one or two rows; for more rows a task
 * rebuilds a panel chunk once into fp32 panel order and runs the fp32 tiles over it.
 *
 * Ownership: the caller's arrays; nothing allocates (task scratch is on the worker's stack,
 * under 24 KiB). Errors: none (shapes are checked by the caller; bad ones are bugs). */
#include <stdint.h>
#include <string.h>

#include "base/util.h"
#include "kernels/cpu/cpu_internal.h"
#include "kernels/cpu/cpu_kernels.h"

#define NR KVS_CPU_PANEL
#define KC 256            /* k chunk: a 16-output panel chunk is 16 KiB of fp32, L1-resident */
#define MR 6              /* rows per register tile: 6 x 2 accumulators + 2 weights + 1 broadcast */
#define MC_MAX 120        /* rows per task block (a multiple of MR) */

size_t kvs_cpu_panels_elems(int64_t rows, int64_t cols)
{
    return (size_t)((rows + NR - 1) / NR) * NR * (size_t)cols;
}

void kvs_cpu_panels_pack_f32(const float *w, int64_t rows, int64_t cols, float *dst)
{
    const int64_t np = (rows + NR - 1) / NR;
    for (int64_t p = 0; p < np; p++)
        for (int64_t k = 0; k < cols; k++)
            for (int j = 0; j < NR; j++) {
                const int64_t r = p * NR + j;
                dst[(p * cols + k) * NR + j] = r < rows ? w[r * cols + k] : 0.0f;
            }
}

/* bf16 panels hold a k step's 16 outputs in the order 0-3, 8-11, 4-7, 12-15: one 256-bit load
 * and the two in-lane interleaves with zero (unpacklo / unpackhi_epi16) then give outputs 0-7
 * and 8-15 widened to fp32, 2 shuffles per 16 weights (zero-extend + shift: 4) */
static inline int bf16_slot(int j) { return (j & 3) | ((j & 4) << 1) | ((j & 8) >> 1); }

void kvs_cpu_panels_pack_bf16(const uint16_t *w, int64_t rows, int64_t cols, uint16_t *dst)
{
    const int64_t np = (rows + NR - 1) / NR;
    for (int64_t p = 0; p < np; p++)
        for (int64_t k = 0; k < cols; k++)
            for (int j = 0; j < NR; j++) {
                const int64_t r = p * NR + j;
                dst[(p * cols + k) * NR + bf16_slot(j)] = r < rows ? w[r * cols + k] : 0;
            }
}

void kvs_cpu_panels_row(const struct kvs_cpu_panels *pn, int64_t cols, int64_t row, float *out)
{
    const size_t base = (size_t)(row / NR) * (size_t)cols * NR;
    const int j = (int)(row % NR);
    for (int64_t k = 0; k < cols; k++)
        out[k] = pn->f32 ? pn->f32[base + (size_t)k * NR + j] : kvs_cpu_bf16(pn->bf16[base + (size_t)k * NR + bf16_slot(j)]);
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define FMA __attribute__((target("avx2,fma")))
#define ALWAYS __attribute__((always_inline))

struct pjob {
    const float *x, *bias;
    const struct kvs_cpu_panels *p;
    const struct kvs_cpu_qblocks *qb;
    float *y;
    int n, in, out;
    int mc, pg, n_rb, np;         /* rows per block, panels per task, row blocks, panels */
    int w5;                       /* avx512 set: the multi-row tiles of cpu_gemm_panel512.c (same bits) */
};

/* the 16 weights of one k step of a panel as two fp32 vectors (outputs 0-7, 8-15) */
FMA static inline ALWAYS void loadw16(const void *w, size_t k, const int bf, __m256 *lo, __m256 *hi)
{
    if (bf) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + k * NR)), z = _mm256_setzero_si256();
        *lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, v));
        *hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, v));
    } else {
        *lo = _mm256_loadu_ps((const float *)w + k * NR);
        *hi = _mm256_loadu_ps((const float *)w + k * NR + 8);
    }
}

/* M rows x NP panels (M * NP <= 6) over kc values of k. x: row 0 at k0 (rows ldx apart);
 * pan[q]: panel q at k0 (16 values per k); c: row 0, panel 0 (rows ldc apart, panel q at
 * 16 q). first: start from 0, else continue the sums stored in c (an fp32 store and reload
 * is exact, so chunking k changes no bit). bias: added after the last chunk (NULL otherwise). */
FMA static inline ALWAYS void tile(const int M, const int NP, const int bf, const float *x, size_t ldx,
                                   const void *const pan[4], int kc, float *c, size_t ldc, int first, const float *bias)
{
    __m256 acc[MR][8];
#pragma GCC unroll 6
    for (int r = 0; r < M; r++)
#pragma GCC unroll 8
        for (int v = 0; v < 2 * NP; v++)
            acc[r][v] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + (size_t)r * ldc + 8 * v);
    for (int k = 0; k < kc; k++) {
        __m256 w[8];
#pragma GCC unroll 4
        for (int q = 0; q < NP; q++) loadw16(pan[q], (size_t)k, bf, &w[2 * q], &w[2 * q + 1]);
#pragma GCC unroll 6
        for (int r = 0; r < M; r++) {
            const __m256 b = _mm256_broadcast_ss(x + (size_t)r * ldx + k);
#pragma GCC unroll 8
            for (int v = 0; v < 2 * NP; v++) acc[r][v] = _mm256_fmadd_ps(b, w[v], acc[r][v]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < M; r++)
#pragma GCC unroll 8
        for (int v = 0; v < 2 * NP; v++) {
            __m256 s = acc[r][v];
            if (bias) s = _mm256_add_ps(s, _mm256_loadu_ps(bias + 8 * v));
            _mm256_storeu_ps(c + (size_t)r * ldc + 8 * v, s);
        }
}

/* one panel (chunk) over rows [t0, t1) in tiles of MR, the last tile shorter */
FMA static inline ALWAYS void rows_one_panel(const int bf, const float *x, size_t ldx, const void *pan, int kc,
                                             float *c, size_t ldc, int rows, int first, const float *bias)
{
    const void *pp[4] = {pan, pan, pan, pan};
    int r = 0;
    for (; r + MR <= rows; r += MR)
        tile(MR, 1, bf, x + (size_t)r * ldx, ldx, pp, kc, c + (size_t)r * ldc, ldc, first, bias);
    const float *xr = x + (size_t)r * ldx;
    float *cr = c + (size_t)r * ldc;
    switch (rows - r) {
    case 5: tile(5, 1, bf, xr, ldx, pp, kc, cr, ldc, first, bias); break;
    case 4: tile(4, 1, bf, xr, ldx, pp, kc, cr, ldc, first, bias); break;
    case 3: tile(3, 1, bf, xr, ldx, pp, kc, cr, ldc, first, bias); break;
    case 2: tile(2, 1, bf, xr, ldx, pp, kc, cr, ldc, first, bias); break;
    case 1: tile(1, 1, bf, xr, ldx, pp, kc, cr, ldc, first, bias); break;
    default: break;
    }
}

FMA static void rows_one_panel_f32(const float *x, size_t ldx, const void *pan, int kc, float *c, size_t ldc, int rows,
                                   int first, const float *bias)
{
    rows_one_panel(0, x, ldx, pan, kc, c, ldc, rows, first, bias);
}

FMA static void rows_one_panel_bf16(const float *x, size_t ldx, const void *pan, int kc, float *c, size_t ldc, int rows,
                                    int first, const float *bias)
{
    rows_one_panel(1, x, ldx, pan, kc, c, ldc, rows, first, bias);
}

/* one row against four full panels at once (8 independent chains: a lone row with one panel
 * has 2 and waits on the fma latency) */
FMA static void row_four_panels(const int bf, const float *x, const void *const pan[4], int kc, float *c, int first,
                                const float *bias)
{
    if (bf)
        tile(1, 4, 1, x, 0, pan, kc, c, 0, first, bias);
    else
        tile(1, 4, 0, x, 0, pan, kc, c, 0, first, bias);
}

/* M rows x NP panels of 4- / 8-bit blocks in panel order over nblk blocks of 32 k (cpu_kernels.h
 * has the layout): as tile, with each k step's 16 weights rebuilt in registers by the row form's
 * own operations (fl(q * d), then + m for 4 bits), so every accumulator sees the fp32 panel's
 * weight and the chains are bitwise tile's. qp[q], dp[q]: panel q's first block of the chunk. */
FMA static inline ALWAYS void qtile(const int M, const int NP, const int bits, const float *x, size_t ldx,
                                    const uint8_t *const qp[4], const float *const dp[4], int nblk, float *c,
                                    size_t ldc, int first, const float *bias)
{
    __m256 acc[MR][8];
#pragma GCC unroll 6
    for (int r = 0; r < M; r++)
#pragma GCC unroll 8
        for (int v = 0; v < 2 * NP; v++)
            acc[r][v] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + (size_t)r * ldc + 8 * v);
    for (int b = 0; b < nblk; b++) {
        const float *xb = x + (size_t)b * KVS_CPU_Q4_BLOCK;
        if (bits == 8) {
            for (int k = 0; k < KVS_CPU_Q4_BLOCK; k++) {
#pragma GCC unroll 4
                for (int q = 0; q < NP; q++) {
                    const int8_t *qq = (const int8_t *)qp[q] + ((size_t)b * KVS_CPU_Q4_BLOCK + k) * NR;
                    const float *dd = dp[q] + (size_t)b * NR;
                    const __m256 w0 = _mm256_mul_ps(
                        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)qq))), _mm256_loadu_ps(dd));
                    const __m256 w1 = _mm256_mul_ps(
                        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qq + 8)))),
                        _mm256_loadu_ps(dd + 8));
#pragma GCC unroll 6
                    for (int r = 0; r < M; r++) {
                        const __m256 xv = _mm256_broadcast_ss(xb + (size_t)r * ldx + k);
                        acc[r][2 * q] = _mm256_fmadd_ps(xv, w0, acc[r][2 * q]);
                        acc[r][2 * q + 1] = _mm256_fmadd_ps(xv, w1, acc[r][2 * q + 1]);
                    }
                }
            }
        } else {
            const __m256i lo4 = _mm256_set1_epi32(15);
            for (int k = 0; k < KVS_CPU_Q4_BLOCK; k += 2) {
#pragma GCC unroll 4
                for (int q = 0; q < NP; q++) {
                    const uint8_t *qq = qp[q] + ((size_t)b * (KVS_CPU_Q4_BLOCK / 2) + (size_t)k / 2) * NR;
                    const float *dd = dp[q] + (size_t)b * 2 * NR;
                    const __m256i a0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)qq));
                    const __m256i a1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qq + 8)));
                    const __m256 d0 = _mm256_loadu_ps(dd), d1 = _mm256_loadu_ps(dd + 8);
                    const __m256 m0 = _mm256_loadu_ps(dd + 16), m1 = _mm256_loadu_ps(dd + 24);
                    /* step k: the low nibbles; step k + 1: the high ones */
                    const __m256 e0 = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(a0, lo4)), d0), m0);
                    const __m256 e1 = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(a1, lo4)), d1), m1);
#pragma GCC unroll 6
                    for (int r = 0; r < M; r++) {
                        const __m256 xv = _mm256_broadcast_ss(xb + (size_t)r * ldx + k);
                        acc[r][2 * q] = _mm256_fmadd_ps(xv, e0, acc[r][2 * q]);
                        acc[r][2 * q + 1] = _mm256_fmadd_ps(xv, e1, acc[r][2 * q + 1]);
                    }
                    const __m256 o0 = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(a0, 4)), d0), m0);
                    const __m256 o1 = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(a1, 4)), d1), m1);
#pragma GCC unroll 6
                    for (int r = 0; r < M; r++) {
                        const __m256 xv = _mm256_broadcast_ss(xb + (size_t)r * ldx + k + 1);
                        acc[r][2 * q] = _mm256_fmadd_ps(xv, o0, acc[r][2 * q]);
                        acc[r][2 * q + 1] = _mm256_fmadd_ps(xv, o1, acc[r][2 * q + 1]);
                    }
                }
            }
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < M; r++)
#pragma GCC unroll 8
        for (int v = 0; v < 2 * NP; v++) {
            __m256 s = acc[r][v];
            if (bias) s = _mm256_add_ps(s, _mm256_loadu_ps(bias + 8 * v));
            _mm256_storeu_ps(c + (size_t)r * ldc + 8 * v, s);
        }
}

/* one block-panel chunk over rows [0, rows) in tiles of MR, the last tile shorter */
FMA static inline ALWAYS void qrows_one_panel(const int bits, const float *x, size_t ldx, const uint8_t *qp,
                                              const float *dp, int nblk, float *c, size_t ldc, int rows, int first,
                                              const float *bias)
{
    const uint8_t *qq[4] = {qp, qp, qp, qp};
    const float *dd[4] = {dp, dp, dp, dp};
    int r = 0;
    for (; r + MR <= rows; r += MR)
        qtile(MR, 1, bits, x + (size_t)r * ldx, ldx, qq, dd, nblk, c + (size_t)r * ldc, ldc, first, bias);
    const float *xr = x + (size_t)r * ldx;
    float *cr = c + (size_t)r * ldc;
    switch (rows - r) {
    case 5: qtile(5, 1, bits, xr, ldx, qq, dd, nblk, cr, ldc, first, bias); break;
    case 4: qtile(4, 1, bits, xr, ldx, qq, dd, nblk, cr, ldc, first, bias); break;
    case 3: qtile(3, 1, bits, xr, ldx, qq, dd, nblk, cr, ldc, first, bias); break;
    case 2: qtile(2, 1, bits, xr, ldx, qq, dd, nblk, cr, ldc, first, bias); break;
    case 1: qtile(1, 1, bits, xr, ldx, qq, dd, nblk, cr, ldc, first, bias); break;
    default: break;
    }
}

FMA static void qrows_one_panel_q4(const float *x, size_t ldx, const uint8_t *qp, const float *dp, int nblk, float *c,
                                   size_t ldc, int rows, int first, const float *bias)
{
    qrows_one_panel(4, x, ldx, qp, dp, nblk, c, ldc, rows, first, bias);
}

FMA static void qrows_one_panel_q8(const float *x, size_t ldx, const uint8_t *qp, const float *dp, int nblk, float *c,
                                   size_t ldc, int rows, int first, const float *bias)
{
    qrows_one_panel(8, x, ldx, qp, dp, nblk, c, ldc, rows, first, bias);
}

/* a chunk of nblk blocks of one block panel rebuilt into fp32 panel order (wbuf [32 nblk][16]):
 * the same operations as qtile, stored once so that a row block's 6-row fp32 tiles reuse them
 * (12 accumulators leave too few registers to rebuild 4-bit weights inside the 6-row tile) */
FMA static inline ALWAYS void qpanel_widen(const int bits, const uint8_t *qp, const float *dp, int nblk, float *wbuf)
{
    const __m256i lo4 = _mm256_set1_epi32(15);
    for (int b = 0; b < nblk; b++) {
        float *wb = wbuf + (size_t)b * KVS_CPU_Q4_BLOCK * NR;
        if (bits == 8) {
            const int8_t *qq = (const int8_t *)qp + (size_t)b * KVS_CPU_Q4_BLOCK * NR;
            const __m256 d0 = _mm256_loadu_ps(dp + (size_t)b * NR), d1 = _mm256_loadu_ps(dp + (size_t)b * NR + 8);
            for (int k = 0; k < KVS_CPU_Q4_BLOCK; k++) {
                const __m128i *src = (const __m128i *)(qq + (size_t)k * NR);
                _mm256_store_ps(wb + k * NR, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(src))), d0));
                _mm256_store_ps(wb + k * NR + 8,
                                _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                                                  (const __m128i *)(qq + (size_t)k * NR + 8)))),
                                              d1));
            }
        } else {
            const uint8_t *qq = qp + (size_t)b * (KVS_CPU_Q4_BLOCK / 2) * NR;
            const float *dd = dp + (size_t)b * 2 * NR;
            const __m256 d0 = _mm256_loadu_ps(dd), d1 = _mm256_loadu_ps(dd + 8);
            const __m256 m0 = _mm256_loadu_ps(dd + 16), m1 = _mm256_loadu_ps(dd + 24);
            for (int k = 0; k < KVS_CPU_Q4_BLOCK; k += 2) {
                const __m256i a0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qq + (size_t)k / 2 * NR)));
                const __m256i a1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qq + (size_t)k / 2 * NR + 8)));
                _mm256_store_ps(wb + k * NR, _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(a0, lo4)), d0), m0));
                _mm256_store_ps(wb + k * NR + 8,
                                _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(a1, lo4)), d1), m1));
                _mm256_store_ps(wb + (k + 1) * NR,
                                _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(a0, 4)), d0), m0));
                _mm256_store_ps(wb + (k + 1) * NR + 8,
                                _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(a1, 4)), d1), m1));
            }
        }
    }
}

FMA static void qpanel_widen_q4(const uint8_t *qp, const float *dp, int nblk, float *wbuf)
{
    qpanel_widen(4, qp, dp, nblk, wbuf);
}

FMA static void qpanel_widen_q8(const uint8_t *qp, const float *dp, int nblk, float *wbuf)
{
    qpanel_widen(8, qp, dp, nblk, wbuf);
}

/* one row against four full block panels (8 chains, as row_four_panels) */
FMA static void qrow_four_panels(const int bits, const float *x, const uint8_t *const qp[4], const float *const dp[4],
                                 int nblk, float *c, int first, const float *bias)
{
    if (bits == 4)
        qtile(1, 4, 4, x, 0, qp, dp, nblk, c, 0, first, bias);
    else
        qtile(1, 4, 8, x, 0, qp, dp, nblk, c, 0, first, bias);
}

/* panel p's block b0 in a panel-order block matrix: its q and its d (m) */
static inline const uint8_t *qpan_q(const struct kvs_cpu_qblocks *qb, int in, int p, int b0)
{
    const size_t pb = (size_t)p * (size_t)(in / KVS_CPU_Q4_BLOCK) + (size_t)b0;
    return qb->q + pb * (size_t)(KVS_CPU_Q4_BLOCK * NR * qb->bits / 8);
}

static inline const float *qpan_dm(const struct kvs_cpu_qblocks *qb, int in, int p, int b0)
{
    const size_t pb = (size_t)p * (size_t)(in / KVS_CPU_Q4_BLOCK) + (size_t)b0;
    return qb->dm + pb * (size_t)(qb->bits == 4 ? 2 * NR : NR);
}

/* a task: row block rbi x panels [p0, p1) */
FMA static void panel_task(void *ctx, int task)
{
    const struct pjob *j = ctx;
    const int in = j->in, out = j->out;
    const int rbi = task % j->n_rb, pgi = task / j->n_rb;
    const int t0 = rbi * j->mc, t1 = t0 + j->mc < j->n ? t0 + j->mc : j->n, rows = t1 - t0;
    const int p0 = pgi * j->pg, p1 = p0 + j->pg < j->np ? p0 + j->pg : j->np;
    const float *x = j->x + (size_t)t0 * in;
    const int bf = j->p && !j->p->f32;
    const int bits = j->qb ? j->qb->bits : 0;
    float cbuf[MC_MAX * NR] __attribute__((aligned(32)));         /* sums of a partial last panel */
    float wbuf[KC * NR] __attribute__((aligned(32)));             /* blocks: one panel chunk rebuilt */
    int p = p0;
    if (rows <= 2)
        for (; p + 4 <= p1 && (p + 4) * NR <= out; p += 4) {
            for (int k0 = 0; k0 < in; k0 += KC) {
                const int kc = in - k0 < KC ? in - k0 : KC, last = k0 + kc >= in;
                const float *bias = last && j->bias ? j->bias + (size_t)p * NR : NULL;
                if (bits) {
                    const uint8_t *qp[4];
                    const float *dp[4];
                    for (int q = 0; q < 4; q++) {
                        qp[q] = qpan_q(j->qb, in, p + q, k0 / KVS_CPU_Q4_BLOCK);
                        dp[q] = qpan_dm(j->qb, in, p + q, k0 / KVS_CPU_Q4_BLOCK);
                    }
                    for (int r = 0; r < rows; r++)
                        qrow_four_panels(bits, x + (size_t)r * in + k0, qp, dp, kc / KVS_CPU_Q4_BLOCK,
                                         j->y + (size_t)(t0 + r) * out + (size_t)p * NR, k0 == 0, bias);
                    continue;
                }
                const void *pan[4];
                for (int q = 0; q < 4; q++)
                    pan[q] = bf ? (const void *)(j->p->bf16 + ((size_t)(p + q) * in + k0) * NR)
                                : (const void *)(j->p->f32 + ((size_t)(p + q) * in + k0) * NR);
                for (int r = 0; r < rows; r++)
                    row_four_panels(bf, x + (size_t)r * in + k0, pan, kc, j->y + (size_t)(t0 + r) * out + (size_t)p * NR,
                                    k0 == 0, bias);
            }
        }
    for (; p < p1; p++) {
        const int full = (p + 1) * NR <= out;
        float *c = full ? j->y + (size_t)t0 * out + (size_t)p * NR : cbuf;
        const size_t ldc = full ? (size_t)out : NR;
        for (int k0 = 0; k0 < in; k0 += KC) {
            const int kc = in - k0 < KC ? in - k0 : KC, last = k0 + kc >= in;
            const float *bias = last && full && j->bias ? j->bias + (size_t)p * NR : NULL;
            if (bits && rows > 2) {
                /* rebuilt once per chunk into fp32 panel order, then the fp32 tiles */
                const int b0 = k0 / KVS_CPU_Q4_BLOCK, nblk = kc / KVS_CPU_Q4_BLOCK;
                if (bits == 4)
                    qpanel_widen_q4(qpan_q(j->qb, in, p, b0), qpan_dm(j->qb, in, p, b0), nblk, wbuf);
                else
                    qpanel_widen_q8(qpan_q(j->qb, in, p, b0), qpan_dm(j->qb, in, p, b0), nblk, wbuf);
                if (j->w5)
                    kvs_cpu_panel512_rows(0, x + k0, (size_t)in, wbuf, kc, c, ldc, rows, k0 == 0, bias);
                else
                    rows_one_panel_f32(x + k0, (size_t)in, wbuf, kc, c, ldc, rows, k0 == 0, bias);
            } else if (bits) {
                /* one or two rows: rebuilt in the tile (no store and reload) */
                const int b0 = k0 / KVS_CPU_Q4_BLOCK, nblk = kc / KVS_CPU_Q4_BLOCK;
                if (bits == 4)
                    qrows_one_panel_q4(x + k0, (size_t)in, qpan_q(j->qb, in, p, b0), qpan_dm(j->qb, in, p, b0), nblk,
                                       c, ldc, rows, k0 == 0, bias);
                else
                    qrows_one_panel_q8(x + k0, (size_t)in, qpan_q(j->qb, in, p, b0), qpan_dm(j->qb, in, p, b0), nblk,
                                       c, ldc, rows, k0 == 0, bias);
            } else if (j->w5) {
                const void *pan = bf ? (const void *)(j->p->bf16 + ((size_t)p * in + k0) * NR)
                                     : (const void *)(j->p->f32 + ((size_t)p * in + k0) * NR);
                kvs_cpu_panel512_rows(bf, x + k0, (size_t)in, pan, kc, c, ldc, rows, k0 == 0, bias);
            } else if (bf) {
                rows_one_panel_bf16(x + k0, (size_t)in, j->p->bf16 + ((size_t)p * in + k0) * NR, kc, c, ldc, rows,
                                    k0 == 0, bias);
            } else {
                rows_one_panel_f32(x + k0, (size_t)in, j->p->f32 + ((size_t)p * in + k0) * NR, kc, c, ldc, rows,
                                   k0 == 0, bias);
            }
        }
        if (!full)
            for (int r = 0; r < rows; r++)
                for (int o = p * NR; o < out; o++) {
                    const float s = cbuf[(size_t)r * NR + (o - p * NR)];
                    j->y[(size_t)(t0 + r) * out + o] = j->bias ? s + j->bias[o] : s;
                }
    }
}

void kvs_cpu_gemm_panel(struct kvs_cpu_pool *pool, const float *x, const struct kvs_cpu_panels *p,
                        const struct kvs_cpu_qblocks *qb, const float *bias, int n, int in, int out, float *y)
{
    kvs_cpu_gemm_panel_isa(pool, KVS_CPU_ISA_FMA, x, p, qb, bias, n, in, out, y);
}

void kvs_cpu_gemm_panel_isa(struct kvs_cpu_pool *pool, enum kvs_cpu_isa isa, const float *x,
                            const struct kvs_cpu_panels *p, const struct kvs_cpu_qblocks *qb, const float *bias, int n,
                            int in, int out, float *y)
{
    if (n <= 0 || out <= 0) return;
    KVS_ASSERT(isa >= KVS_CPU_ISA_FMA);
    KVS_ASSERT((p != NULL) != (qb != NULL) && in > 0);
    KVS_ASSERT(!p || (p->f32 != NULL) != (p->bf16 != NULL));
    KVS_ASSERT(!qb || (qb->panel && (qb->bits == 4 || qb->bits == 8) && in % KVS_CPU_Q4_BLOCK == 0 &&
                       KC % KVS_CPU_Q4_BLOCK == 0));
    struct pjob j = {.x = x, .bias = bias, .p = p, .qb = qb, .y = y, .n = n, .in = in, .out = out,
                     .w5 = isa == KVS_CPU_ISA_AVX512};
    /* a row block's x (mc rows) about 64 KiB, so it stays in L2 while the task's panels pass */
    int mc = (int)((64 * 1024) / ((size_t)in * sizeof(float))) / MR * MR;
    j.mc = mc < MR ? MR : mc > MC_MAX ? MC_MAX : mc;
    /* blocks: a task rebuilds each panel chunk once for its whole row block, so bigger blocks
     * spread that over more rows (x of 120 rows still fits L2) */
    if (qb) j.mc = MC_MAX;
    j.n_rb = (n + j.mc - 1) / j.mc;
    j.np = (out + NR - 1) / NR;
    /* panels per task: 4 (the one-row kernel's group) unless that leaves fewer than ~8 tasks */
    int pg = 4;
    if (n > 2 && j.n_rb * ((j.np + 3) / 4) < 8) pg = j.np / 8 > 0 ? (j.np / 8 < 4 ? j.np / 8 : 4) : 1;
    j.pg = pg;
    const int tasks = j.n_rb * ((j.np + pg - 1) / pg);
    kvs_cpu_pool_run_sized(pool, tasks, (double)n * in * out, panel_task, &j);
}
#else
void kvs_cpu_gemm_panel(struct kvs_cpu_pool *pool, const float *x, const struct kvs_cpu_panels *p,
                        const struct kvs_cpu_qblocks *qb, const float *bias, int n, int in, int out, float *y)
{
    (void)pool, (void)x, (void)p, (void)qb, (void)bias, (void)n, (void)in, (void)out, (void)y;
    KVS_ASSERT(!"the panel GEMM needs x86-64 with AVX2 + FMA");
}
void kvs_cpu_gemm_panel_isa(struct kvs_cpu_pool *pool, enum kvs_cpu_isa isa, const float *x,
                            const struct kvs_cpu_panels *p, const struct kvs_cpu_qblocks *qb, const float *bias, int n,
                            int in, int out, float *y)
{
    (void)isa;
    kvs_cpu_gemm_panel(pool, x, p, qb, bias, n, in, out, y);
}
#endif
