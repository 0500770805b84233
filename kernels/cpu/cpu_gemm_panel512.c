/* cpu_gemm_panel512.c: the avx512 kernel set's register tile of the panel GEMM (cpu_gemm_panel.c,
 * cpu_kernels.h): several rows against one 16-output panel, one 512-bit accumulator per row
 * where the FMA tile spends two 256-bit ones, up to 12 rows per tile (the FMA tile: 6). Each
 * accumulator lane is the same single fused multiply-add chain over k in increasing order, from
 * 0 or from the stored partial sum, then + bias: exactly the FMA tile's operations per element,
 * so the GEMM stays bitwise kvs_cpu_dot_seq (+ bias) and batch invariant.
 *
 * bf16 panels are stored in the FMA tile's slot order (kvs_cpu_panels_pack_bf16: outputs 4-7
 * and 8-11 swapped, an involution); widening 16 of them in memory order leaves lane i holding
 * output slot(i), so the tile permutes its partial sums in and out by the same index vector (a
 * permutation moves values, it rounds nothing).
 *
 * Compiled with target attributes for any x86-64; call only where the CPU has AVX-512F (the
 * avx512 set). Ownership: the caller's arrays; nothing allocates. Errors: none. */
#include <stddef.h>
#include <stdint.h>

#include "kernels/cpu/cpu_internal.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define AVX512 __attribute__((target("avx512f,avx2,fma")))
#define ALWAYS __attribute__((always_inline))
#define NR KVS_CPU_PANEL
#define MR5 12            /* rows per tile: 12 accumulators + 1 weight + 1 broadcast of 32 registers */

/* lane i of a bf16 k step widened in memory order holds output slot(i) (cpu_gemm_panel.c) */
AVX512 static inline __m512i slot_index(void)
{
    return _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15);
}

AVX512 static inline ALWAYS __m512 loadw(const void *w, size_t k, const int bf)
{
    if (bf)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w + k * NR))), 16));
    return _mm512_loadu_ps((const float *)w + k * NR);
}

/* M rows x one panel over kc values of k; as cpu_gemm_panel.c's tile (x: row 0 at k0, rows ldx
 * apart; c: row 0, rows ldc apart; first: start from 0, else continue c's sums; bias: after the
 * last chunk, or NULL) */
AVX512 static inline ALWAYS void tile512(const int M, const int bf, const float *x, size_t ldx, const void *pan, int kc,
                                         float *c, size_t ldc, int first, const float *bias)
{
    const __m512i idx = slot_index();
    __m512 acc[MR5];
#pragma GCC unroll 12
    for (int r = 0; r < M; r++) {
        acc[r] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + (size_t)r * ldc);
        if (bf && !first) acc[r] = _mm512_permutexvar_ps(idx, acc[r]);   /* natural -> slot order */
    }
    for (int k = 0; k < kc; k++) {
        const __m512 w = loadw(pan, (size_t)k, bf);
#pragma GCC unroll 12
        for (int r = 0; r < M; r++) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[(size_t)r * ldx + k]), w, acc[r]);
    }
#pragma GCC unroll 12
    for (int r = 0; r < M; r++) {
        __m512 s = bf ? _mm512_permutexvar_ps(idx, acc[r]) : acc[r];   /* slot -> natural order */
        if (bias) s = _mm512_add_ps(s, _mm512_loadu_ps(bias));
        _mm512_storeu_ps(c + (size_t)r * ldc, s);
    }
}

AVX512 static inline ALWAYS void rows512(const int bf, const float *x, size_t ldx, const void *pan, int kc, float *c,
                                         size_t ldc, int rows, int first, const float *bias)
{
    int r = 0;
    for (; r + MR5 <= rows; r += MR5) tile512(MR5, bf, x + (size_t)r * ldx, ldx, pan, kc, c + (size_t)r * ldc, ldc, first, bias);
    const float *xr = x + (size_t)r * ldx;
    float *cr = c + (size_t)r * ldc;
    switch (rows - r) {
    case 11: tile512(11, bf, xr, ldx, pan, kc, cr, ldc, first, bias); break;
    case 10: tile512(10, bf, xr, ldx, pan, kc, cr, ldc, first, bias); break;
    case 9: tile512(9, bf, xr, ldx, pan, kc, cr, ldc, first, bias); break;
    case 8: tile512(8, bf, xr, ldx, pan, kc, cr, ldc, first, bias); break;
    case 7: tile512(7, bf, xr, ldx, pan, kc, cr, ldc, first, bias); break;
    case 6: tile512(6, bf, xr, ldx, pan, kc, cr, ldc, first, bias); break;
    case 5: tile512(5, bf, xr, ldx, pan, kc, cr, ldc, first, bias); break;
    case 4: tile512(4, bf, xr, ldx, pan, kc, cr, ldc, first, bias); break;
    case 3: tile512(3, bf, xr, ldx, pan, kc, cr, ldc, first, bias); break;
    case 2: tile512(2, bf, xr, ldx, pan, kc, cr, ldc, first, bias); break;
    case 1: tile512(1, bf, xr, ldx, pan, kc, cr, ldc, first, bias); break;
    default: break;
    }
}

AVX512 void kvs_cpu_panel512_rows(int bf, const float *x, size_t ldx, const void *pan, int kc, float *c, size_t ldc,
                                  int rows, int first, const float *bias)
{
    if (bf)
        rows512(1, x, ldx, pan, kc, c, ldc, rows, first, bias);
    else
        rows512(0, x, ldx, pan, kc, c, ldc, rows, first, bias);
}
#endif
