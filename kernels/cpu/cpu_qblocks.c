/* cpu_qblocks.c: 4-bit affine and 8-bit weight blocks, found losslessly in fp32 matrices
 * (cpu_kernels.h).
 *
 * A GGUF Q4_1 tensor reaches the backend dequantized to fp32 (models/gguf_model.c): every
 * block of 32 consecutive values of a row is fl(fl(q * d) + m) for 4-bit q, with d, m the
 * block's fp16 scale and minimum; a Q8_0 tensor's are fl(q * d), q 8-bit signed. Held as fp32
 * that is 4 bytes per weight, which a decode step streams in full. The pack functions find d, m
 * and q back from the fp32 values and check every value bitwise against the formula; only when
 * all match does the backend keep the compact form (Q4: 24 bytes per 32 weights, 0.75 bytes per
 * weight, 5.3x less; Q8: 36 bytes, 1.125 per weight, 3.6x less). The matmul then rebuilds the
 * same fp32 values in the kernel (kvs_cpu_qb_row: the same multiply and add), so
 * its results are bitwise those of the fp32 copy: greedy parity and the batch invariance of
 * the fp32 kernels hold unchanged, with no tolerance to state. Any matrix that is not such
 * blocks (bf16 / fp32 checkpoints, other GGUF types) fails the check and stays as it was.
 *
 * Ownership: the caller's arrays. Errors: none (pack returns 0 when the matrix does not fit). */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "base/util.h"
#include "kernels/cpu/cpu_kernels.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define KVS_CPU_X86 1
#else
#define KVS_CPU_X86 0
#endif

static inline uint32_t bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* the value the kernel rebuilds (ISO C: no contraction, so a multiply then an add) */
static inline float q4_value(int q, float d, float m) { return (float)q * d + m; }

/* d rounded to 11 significant bits (an fp16's precision) moved by k steps at that precision */
static float round11(double d, int k)
{
    int e;
    double f = frexp(d, &e);   /* d = f * 2^e, f in [0.5, 1) */
    return (float)ldexp(rint(f * 2048.0) + k, e - 11);
}

/* one block of 32: finds d, m, q with every value bitwise fl(fl(q * d) + m); 1 or 0 */
static int pack_block(const float *x, uint8_t *nib, float *d_out, float *m_out)
{
    float mn = x[0], mx = x[0];
    for (int i = 1; i < KVS_CPU_Q4_BLOCK; i++) {
        if (!(x[i] == x[i])) return 0;   /* NaN */
        mn = x[i] < mn ? x[i] : mn;
        mx = x[i] > mx ? x[i] : mx;
    }
    if (!isfinite(mn) || !isfinite(mx)) return 0;
    float cand[4];
    int nc = 0;
    if (mx == mn) {
        cand[nc++] = 0.0f;
    } else {
        const double d0 = ((double)mx - (double)mn) / 15.0;
        cand[nc++] = round11(d0, 0);
        cand[nc++] = round11(d0, -1);
        cand[nc++] = round11(d0, 1);
        cand[nc++] = (float)d0;
    }
    for (int c = 0; c < nc; c++) {
        const float d = cand[c];
        if (!(d >= 0.0f) || !isfinite(d)) continue;
        uint8_t q[KVS_CPU_Q4_BLOCK];
        int ok = 1;
        for (int i = 0; i < KVS_CPU_Q4_BLOCK && ok; i++) {
            const long qi = d == 0.0f ? 0 : lrint(((double)x[i] - (double)mn) / (double)d);
            ok = qi >= 0 && qi <= 15 && bits(q4_value((int)qi, d, mn)) == bits(x[i]);
            q[i] = (uint8_t)qi;
        }
        if (!ok) continue;
        for (int i = 0; i < KVS_CPU_Q4_BLOCK / 2; i++) nib[i] = (uint8_t)(q[i] | q[i + KVS_CPU_Q4_BLOCK / 2] << 4);
        *d_out = d;
        *m_out = mn;
        return 1;
    }
    return 0;
}

/* one Q8_0-like block: every value bitwise fl(q * d), q in -128..127; 1 or 0 */
static int pack_block8(const float *x, int8_t *q_out, float *d_out)
{
    double amax = 0.0;
    for (int i = 0; i < KVS_CPU_Q4_BLOCK; i++) {
        if (!isfinite(x[i])) return 0;
        amax = fabs((double)x[i]) > amax ? fabs((double)x[i]) : amax;
    }
    float cand[5];
    int nc = 0;
    if (amax == 0.0) {
        cand[nc++] = 0.0f;
    } else {
        const double d0 = amax / 127.0;   /* ggml's quantizer: the largest |value| is q = +-127 */
        cand[nc++] = round11(d0, 0);
        cand[nc++] = round11(d0, -1);
        cand[nc++] = round11(d0, 1);
        cand[nc++] = (float)d0;
        cand[nc++] = round11(amax / 128.0, 0);   /* or q = -128 */
    }
    for (int c = 0; c < nc; c++) {
        const float d = cand[c];
        if (!(d >= 0.0f) || !isfinite(d)) continue;
        int8_t q[KVS_CPU_Q4_BLOCK];
        int ok = 1;
        for (int i = 0; i < KVS_CPU_Q4_BLOCK && ok; i++) {
            const long qi = d == 0.0f ? 0 : lrint((double)x[i] / (double)d);
            ok = qi >= -128 && qi <= 127 && bits((float)qi * d) == bits(x[i]);
            q[i] = (int8_t)qi;
        }
        if (!ok) continue;
        memcpy(q_out, q, sizeof q);
        *d_out = d;
        return 1;
    }
    return 0;
}

int kvs_cpu_q8_pack(const float *w, int64_t rows, int64_t cols, int8_t *q, float *d)
{
    if (cols % KVS_CPU_Q4_BLOCK || cols > KVS_CPU_Q4_MAX_COLS) return 0;
    const int64_t nb = rows * (cols / KVS_CPU_Q4_BLOCK);
    for (int64_t b = 0; b < nb; b++)
        if (!pack_block8(w + b * KVS_CPU_Q4_BLOCK, q + b * KVS_CPU_Q4_BLOCK, d + b)) return 0;
    return 1;
}

int kvs_cpu_q4_pack(const float *w, int64_t rows, int64_t cols, uint8_t *nib, float *dm)
{
    if (cols % KVS_CPU_Q4_BLOCK || cols > KVS_CPU_Q4_MAX_COLS) return 0;
    const int64_t nb = rows * (cols / KVS_CPU_Q4_BLOCK);
    for (int64_t b = 0; b < nb; b++)
        if (!pack_block(w + b * KVS_CPU_Q4_BLOCK, nib + b * (KVS_CPU_Q4_BLOCK / 2), dm + 2 * b, dm + 2 * b + 1))
            return 0;
    return 1;
}

#if KVS_CPU_X86
/* the same multiply as pack_block8, eight lanes at a time */
__attribute__((target("avx2"))) static void q8_row_avx2(const int8_t *q, const float *d, int cols, float *out)
{
    for (int b = 0; b < cols / KVS_CPU_Q4_BLOCK; b++) {
        const __m256 db = _mm256_set1_ps(d[b]);
        for (int k = 0; k < 4; k++) {
            const __m128i v = _mm_loadl_epi64((const __m128i *)(q + (size_t)b * KVS_CPU_Q4_BLOCK + 8 * k));
            _mm256_storeu_ps(out + (size_t)b * KVS_CPU_Q4_BLOCK + 8 * k,
                             _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), db));
        }
    }
}

/* the same multiply and add as q4_value, eight lanes at a time */
__attribute__((target("avx2"))) static void q4_row_avx2(const uint8_t *nib, const float *dm, int cols, float *out)
{
    const __m128i lo4 = _mm_set1_epi8(0x0F);
    for (int b = 0; b < cols / KVS_CPU_Q4_BLOCK; b++) {
        const __m128i v = _mm_loadu_si128((const __m128i *)(nib + (size_t)b * 16));
        const __m128i lo = _mm_and_si128(v, lo4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), lo4);
        const __m256 d = _mm256_set1_ps(dm[2 * b]), m = _mm256_set1_ps(dm[2 * b + 1]);
        float *y = out + (size_t)b * KVS_CPU_Q4_BLOCK;
        const __m128i part[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
        for (int k = 0; k < 4; k++) {
            const __m256 qf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(part[k]));
            _mm256_storeu_ps(y + 8 * k, _mm256_add_ps(_mm256_mul_ps(qf, d), m));
        }
    }
}
#endif

static void q8_row(const int8_t *q, const float *d, int cols, float *out)
{
#if KVS_CPU_X86
    if (__builtin_cpu_supports("avx2")) {
        q8_row_avx2(q, d, cols, out);
        return;
    }
#endif
    for (int i = 0; i < cols; i++) out[i] = (float)q[i] * d[i / KVS_CPU_Q4_BLOCK];
}

static void q4_row(const uint8_t *nib, const float *dm, int cols, float *out)
{
#if KVS_CPU_X86
    if (__builtin_cpu_supports("avx2")) {
        q4_row_avx2(nib, dm, cols, out);
        return;
    }
#endif
    for (int b = 0; b < cols / KVS_CPU_Q4_BLOCK; b++) {
        const uint8_t *q = nib + (size_t)b * (KVS_CPU_Q4_BLOCK / 2);
        for (int i = 0; i < KVS_CPU_Q4_BLOCK / 2; i++) {
            out[b * KVS_CPU_Q4_BLOCK + i] = q4_value(q[i] & 15, dm[2 * b], dm[2 * b + 1]);
            out[b * KVS_CPU_Q4_BLOCK + i + KVS_CPU_Q4_BLOCK / 2] = q4_value(q[i] >> 4, dm[2 * b], dm[2 * b + 1]);
        }
    }
}

void kvs_cpu_qb_row(const struct kvs_cpu_qblocks *w, int cols, size_t row, float *out)
{
    const size_t nb = (size_t)cols / KVS_CPU_Q4_BLOCK;
    if (w->bits == 4)
        q4_row(w->q + row * (size_t)cols / 2, w->dm + row * nb * 2, cols, out);
    else
        q8_row((const int8_t *)w->q + row * (size_t)cols, w->dm + row * nb, cols, out);
}

void kvs_cpu_qb_row_range(const struct kvs_cpu_qblocks *w, int cols, size_t row, int c0, int c1, float *out)
{
    KVS_ASSERT(c0 % KVS_CPU_Q4_BLOCK == 0 && c1 % KVS_CPU_Q4_BLOCK == 0 && 0 <= c0 && c0 <= c1 && c1 <= cols);
    const size_t nb = (size_t)cols / KVS_CPU_Q4_BLOCK, b0 = (size_t)c0 / KVS_CPU_Q4_BLOCK;
    if (w->bits == 4)
        q4_row(w->q + (row * (size_t)cols + (size_t)c0) / 2, w->dm + (row * nb + b0) * 2, c1 - c0, out);
    else
        q8_row((const int8_t *)w->q + row * (size_t)cols + (size_t)c0, w->dm + row * nb + b0, c1 - c0, out);
}
