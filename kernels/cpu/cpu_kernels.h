/* cpu_kernels.h: the CPU backend's compute kernels (matmul, attention) behind a runtime choice
 * of instruction set, shared by cpu_backend.c, cpu_gemm.c and cpu_attention.c. Plain pointers
 * only (no backend structs), so the kernels can be tested and benchmarked on bare arrays.
 *
 * Kernel sets (enum kvs_cpu_isa), picked at run time (__builtin_cpu_supports, target
 * attributes; the start-up log names the set in use and the best one here):
 *   - KVS_CPU_ISA_REF: the readable plain-C fp32 reference, the oracle of the tests (and the
 *     kernel on CPUs without AVX2). Matmul: kvs_cpu_dot per (row, output). Attention: one
 *     (row, head) pair at a time, an online softmax updated per key with libm expf.
 *   - KVS_CPU_ISA_AVX2: 256-bit multiplies and adds (no FMA). The matmul keeps the reference's
 *     summation order (kvs_cpu_dot's lanes and tree), so it is BITWISE the reference.
 *   - KVS_CPU_ISA_FMA (default where AVX2 + FMA exist): the same lanes and tree, each lane
 *     accumulated with fused multiply-adds: bitwise kvs_cpu_dot_fma (below), within fp32
 *     rounding of the reference (the tests bound it). On the 2-core EPYC of bench/RESULTS.md
 *     two threads of FMA run ~1.3-1.5x the mul + add rate.
 *   With AVX2 and FMA the attention is key-tiled (cpu_attn_tile.h): KVS_CPU_ATTN_KT keys at a
 *   time per (row, head) pair, one online-softmax step per key tile with a vector exp. It is
 *   within rounding of the reference (not bitwise), and batch invariant: key tiles sit at
 *   absolute multiples of KT and a pair only reads keys below its own context, so a row's bits
 *   do not depend on the other rows, on n or on the thread count. attention_spans() uses the
 *   same per-pair steps, so one full span still gives attention()'s bits exactly.
 *  - KVS_CPU_ISA_AVX512 (default where AVX-512F + AVX2 + FMA exist; KVS_CPU_KERNELS=avx512): the
 *     FMA set, except (a) the attention's three-query score tiles (two keys per vector), softmax
 *     and value halves (decode and prefill) run at 512 bits (cpu_attn_avx512.c) and (b) the panel GEMM's multi-row tiles are 12 rows x one
 *     512-bit panel (cpu_gemm_panel512.c). Both do the FMA set's operations per element, so they
 *     are BITWISE the FMA set's (hence batch invariant, and within the FMA set's tolerance of the
 *     reference; test_cpu_kernels and test_cpu_gemm_panel check it where the CPU has AVX-512 and
 *     print "SKIP: avx512" elsewhere). Scores of pairs outside a three-query tile stay the FMA
 *     set's 256-bit code (8 lanes + tree define the bits either way); the one- and two-row panel GEMM, the dot-product
 *     tiles, norms, SwiGLU and attention_spans are the FMA set's own code. Not built: AVX-512 BF16.
 *
 * GEMM modes (enum kvs_cpu_gemm_mode). KVS_CPU_GEMM_PANEL (default with FMA and AVX512): weights packed as
 * 16-output panels at upload, an outer-product FMA tile, one fma chain per element in k order
 * (kvs_cpu_dot_seq; see "Panel-packed weights" below); batch invariant, within rounding of the
 * reference. KVS_CPU_GEMM_INVARIANT (KVS_CPU_GEMM=invariant or dot; the default of the avx2 and
 * ref sets; 4- / 8-bit block matrices take it too unless the GEMM mode is panel, where they are
 * stored in panel order) runs the dot-product tiles above.
 * KVS_CPU_GEMM_BLAS sends matmuls of >= KVS_CPU_BLAS_MIN_ROWS rows to OpenBLAS (cblas_sgemm,
 * single-threaded inside the backend's own pool: no second set of threads). OpenBLAS is NOT
 * batch invariant: a row's result depends on n and on the row's place in OpenBLAS's register
 * tiles (measured; bench/RESULTS.md), so that mode gives up the backend contract's batch
 * invariance for speed. It stays deterministic for the same inputs, n and thread count, and
 * within fp32 rounding of the reference (test_blas in tests/unit/test_cpu_kernels.c checks both).
 *
 * bf16 weights. With the AVX2 or FMA kernels and the invariant GEMM, 2-D weights that the model stores
 * as bf16 stay bf16 in memory (half the bytes to hold and to stream per decode step) and the
 * matmul widens them in registers. Widening bf16 to fp32 is exact, so the results are bitwise
 * those of the fp32 copy: nothing changes but memory and speed. Likewise fp32 matrices that are
 * exactly 4-bit affine or 8-bit blocks (a GGUF Q4_1 / Q8_0 tensor after the loader's
 * dequantization) stay as those blocks (kvs_cpu_q4_pack below), rebuilt bitwise in the kernel. KVS_CPU_WEIGHTS=f32 forces
 * fp32 copies (for comparisons); the reference kernels and the BLAS mode always use fp32.
 *
 * Selection: kvs_cpu_kernels_from_env() reads KVS_CPU_KERNELS (auto | ref | avx2 | fma | avx512),
 * KVS_CPU_GEMM (auto | panel | invariant = dot | blas) and KVS_CPU_WEIGHTS (auto | f32) when a backend is created. Errors: it returns -EINVAL with
 * a message for an unknown value or an instruction set the CPU lacks. Nothing here allocates
 * except the BLAS path inside OpenBLAS. */
#ifndef KVS_CPU_KERNELS_H
#define KVS_CPU_KERNELS_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/cpu/cpu_pool.h"

/* ordered: each set runs where the one before it runs, and AVX512 is FMA plus wider parts */
enum kvs_cpu_isa { KVS_CPU_ISA_REF = 0, KVS_CPU_ISA_AVX2 = 1, KVS_CPU_ISA_FMA = 2, KVS_CPU_ISA_AVX512 = 3 };
enum kvs_cpu_gemm_mode { KVS_CPU_GEMM_INVARIANT = 0, KVS_CPU_GEMM_BLAS = 1, KVS_CPU_GEMM_PANEL = 2 };

#define KVS_CPU_BLAS_MIN_ROWS 8   /* below this the hand kernel wins even in BLAS mode */
#define KVS_CPU_MAX_HEAD_DIM 1024
#define KVS_CPU_ATTN_KT 16        /* keys per key tile of the AVX2 / FMA attention */

struct kvs_cpu_kernels {
    enum kvs_cpu_isa isa;
    enum kvs_cpu_gemm_mode gemm;
    int bf16_weights;             /* bf16 matrices may stay bf16 (AVX2 / FMA + invariant GEMM only) */
};

/* The best kernel set this CPU runs (AVX512, else FMA, else AVX2, else the reference). */
enum kvs_cpu_isa kvs_cpu_isa_best(void);
const char *kvs_cpu_isa_name(enum kvs_cpu_isa isa);
/* Fills k from the environment (see above); 0, or -EINVAL + message. */
int kvs_cpu_kernels_from_env(struct kvs_cpu_kernels *k, char *err, size_t errlen);
/* The BLAS library's own description ("OpenBLAS <core>"), for the start-up log. */
const char *kvs_cpu_blas_name(void);
/* Called once per backend: keeps OpenBLAS single-threaded (the pool supplies the threads). */
void kvs_cpu_blas_init(void);

/* The reference dot product: eight interleaved fp32 partial sums (lane j accumulates
 * elements i with i % 8 == j, in increasing i), combined as
 * ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)), then the tail added in order. ISO C mode compiles no
 * FMA contraction, so any vectorisation of it gives the same bits. */
static inline float kvs_cpu_dot(const float *a, const float *b, int n)
{
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += a[i + j] * b[i + j];
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* kvs_cpu_dot's lanes, tree and tail with every multiply-add fused (fmaf: one rounding): the
 * order of the FMA kernels, in plain C for the tests (slow where the CPU has no FMA). */
static inline float kvs_cpu_dot_fma(const float *a, const float *b, int n)
{
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] = fmaf(a[i + j], b[i + j], acc[j]);
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* y[t][o] = dot(x[t], w[o]) (+ bias[o]) for t < n, o < out: x [n][in], w [out][in], y [n][out]
 * (distinct from x), bias [out] or NULL. The weight is w (fp32), or wb (bf16 bits, w NULL; only
 * when k->bf16_weights). Runs on the pool. */
void kvs_cpu_gemm(struct kvs_cpu_pool *pool, const struct kvs_cpu_kernels *k, const float *x, const float *w,
                  const uint16_t *wb, const float *bias, int n, int in, int out, float *y);

/* Weight blocks found losslessly in fp32 matrices (cpu_qblocks.c): a matrix [rows][cols] whose
 * every block of KVS_CPU_Q4_BLOCK consecutive values of a row is bitwise fl(fl(q * d) + m), q in
 * 0..15 (a GGUF Q4_1 tensor dequantized to fp32; bits 4), or fl(q * d), q in -128..127 (Q8_0;
 * bits 8). Bits 4: q = nib [rows][cols / 2] (byte i of a block: q of element i in the low
 * nibble, of element i + 16 in the high one), dm = [rows][cols / 32][2] (d, m). Bits 8: q =
 * int8 [rows][cols], dm = d [rows][cols / 32]. The pack functions return 1 and fill the arrays
 * when every value matches, else 0 (cols a multiple of 32, at most KVS_CPU_Q4_MAX_COLS).
 * kvs_cpu_qb_row rebuilds one row's fp32 values bitwise. kvs_cpu_gemm_qb is kvs_cpu_gemm on such
 * a matrix (AVX2 / FMA sets, invariant GEMM): bitwise kvs_cpu_gemm on the fp32 values, so batch
 * invariant as that is. */
#define KVS_CPU_Q4_BLOCK 32
#define KVS_CPU_Q4_MAX_COLS 8192
struct kvs_cpu_qblocks {
    int bits;                     /* 4 or 8 */
    int panel;                    /* 0: the row form above; 1: panel order (kvs_cpu_qblocks_to_panels) */
    const uint8_t *q;
    const float *dm;
};
int kvs_cpu_q4_pack(const float *w, int64_t rows, int64_t cols, uint8_t *nib, float *dm);
int kvs_cpu_q8_pack(const float *w, int64_t rows, int64_t cols, int8_t *q, float *d);
void kvs_cpu_qb_row(const struct kvs_cpu_qblocks *w, int cols, size_t row, float *out);
void kvs_cpu_gemm_qb(struct kvs_cpu_pool *pool, const struct kvs_cpu_kernels *k, const float *x,
                     const struct kvs_cpu_qblocks *w, const float *bias, int n, int in, int out, float *y);

/* Panel-packed weights (cpu_gemm_panel.c; GEMM mode KVS_CPU_GEMM_PANEL, the default with FMA).
 * A matrix W [rows][cols] is stored as ceil(rows / 16) panels, panel p = [cols][16] holding
 * W[16p + j][k] at k * 16 + j, zero-padded past the last row; fp32 or bf16 bits (f32 or bf16
 * non-NULL). The GEMM broadcasts one x value against 16 outputs' weights (an outer-product
 * register tile of up to 6 rows x 16 outputs: 12 accumulators, 2 weight loads + 6 broadcasts per
 * 12 fused multiply-adds, no horizontal sums), so each y[t][o] is one chain of fused
 * multiply-adds over k in increasing order from 0, then + bias: kvs_cpu_dot_seq (below), for
 * every tile shape, row block, thread count and weight format (bf16 widens exactly; 4- / 8-bit
 * blocks in panel order are rebuilt bitwise in the tile). So it is bitwise kvs_cpu_dot_seq and batch
 * invariant; against the reference (8 lanes + tree) it differs by fp32 rounding (the tests bound
 * it). */
#define KVS_CPU_PANEL 16
struct kvs_cpu_panels {
    const float *f32;             /* [ceil(rows / 16)][cols][16] or NULL */
    const uint16_t *bf16;         /* the same layout, bf16 bits, or NULL */
};
/* elements of the packed array for a rows x cols matrix */
size_t kvs_cpu_panels_elems(int64_t rows, int64_t cols);
/* packs w [rows][cols] (fp32, or bf16 bits) into dst (kvs_cpu_panels_elems elements) */
void kvs_cpu_panels_pack_f32(const float *w, int64_t rows, int64_t cols, float *dst);
void kvs_cpu_panels_pack_bf16(const uint16_t *w, int64_t rows, int64_t cols, uint16_t *dst);
/* one row of the matrix back (exact), e.g. an embedding row */
void kvs_cpu_panels_row(const struct kvs_cpu_panels *p, int64_t cols, int64_t row, float *out);

/* the panel GEMM's order in plain C: one fused multiply-add chain over k from 0 */
static inline float kvs_cpu_dot_seq(const float *a, const float *b, int n)
{
    float s = 0.0f;
    for (int i = 0; i < n; i++) s = fmaf(a[i], b[i], s);
    return s;
}

/* Blocks in panel order, for the panel GEMM (qb->panel = 1). For panel p (outputs 16p..16p+15,
 * rows past the end q = d = m = 0) and block b (k in 32b..32b+31), pb = p * (cols / 32) + b:
 *   bits 8: q int8 at ((pb * 32 + i) * 16 + j) for element k = 32b + i of output 16p + j;
 *           dm = d at pb * 16 + j.
 *   bits 4: q byte ((pb * 16 + i / 2) * 16 + j), element i in its low nibble for even i, high
 *           for odd i; dm = d at (2 pb) * 16 + j, m at (2 pb + 1) * 16 + j.
 * One k step's 16 weights are 16 consecutive bytes (bits 8) or nibbles of 16 bytes shared with
 * the next step (bits 4): the tile widens them with two 8-byte loads and rebuilds fl(q * d)
 * (+ m) with the row form's multiply and add, so the values are bitwise the fp32 matrix's.
 * Sizes: kvs_cpu_qpanels_qbytes bytes of q, kvs_cpu_qpanels_dmfloats floats of dm. */
size_t kvs_cpu_qpanels_qbytes(int bits, int64_t rows, int64_t cols);
size_t kvs_cpu_qpanels_dmfloats(int bits, int64_t rows, int64_t cols);
/* src (row form) -> q, dm in panel order (the caller sets .panel = 1 on the result) */
void kvs_cpu_qblocks_to_panels(const struct kvs_cpu_qblocks *src, int64_t rows, int64_t cols, uint8_t *q, float *dm);

/* y = x @ W^T (+ bias) with W as panels (p; qb NULL) or as 4- / 8-bit blocks in panel order (qb;
 * p NULL, in a multiple of KVS_CPU_Q4_BLOCK; the tile rebuilds each k step's 16 weights in
 * registers): shapes as kvs_cpu_gemm. Needs the FMA set (or AVX512). Bitwise kvs_cpu_dot_seq (+ bias) per
 * element, whatever the weight format. Runs on the pool. */
void kvs_cpu_gemm_panel(struct kvs_cpu_pool *pool, const float *x, const struct kvs_cpu_panels *p,
                        const struct kvs_cpu_qblocks *qb, const float *bias, int n, int in, int out, float *y);
/* the same with the kernel set's tiles: isa FMA (= kvs_cpu_gemm_panel) or AVX512 (the multi-row
 * tiles at 512 bits, 12 rows x 16 outputs: the same fma chain per element, so bitwise FMA's) */
void kvs_cpu_gemm_panel_isa(struct kvs_cpu_pool *pool, enum kvs_cpu_isa isa, const float *x,
                            const struct kvs_cpu_panels *p, const struct kvs_cpu_qblocks *qb, const float *bias, int n,
                            int in, int out, float *y);

/* y[i] = g[i] / (1 + exp(-g[i])) * u[i] for i < n with a vector exp (cpu_act.c; AVX2 + FMA
 * sets): within a few ulp of the libm form the reference set uses. y may alias g or u. */
void kvs_cpu_swiglu_row(const float *g, const float *u, int n, float *y);

/* out[i] = w[i] * (x[i] * inv), inv = 1 / sqrt(sum x^2 / dim + eps), the sum of squares in
 * double in 16 lanes (cpu_act.c; AVX2 + FMA sets): within 1 ulp of the reference set's serial
 * double sum (the same roundings after the sum). out may alias x. */
void kvs_cpu_rmsnorm_row(const float *x, const float *w, float eps, int dim, float *out);

/* bf16 bits -> fp32 (exact) */
static inline float kvs_cpu_bf16(uint16_t h)
{
    union {
        uint32_t u;
        float f;
    } v = {.u = (uint32_t)h << 16};
    return v.f;
}

/* Paged causal attention as kernels/backend.h's attention op defines it, on plain arrays:
 * q [n][n_heads][head_dim]; kc, vc [n_blocks][n_kv_heads][block_size][head_dim]; q_start
 * [n_seqs + 1]; pos [n_seqs]; bt, rot (or NULL), valid (or NULL) [n_seqs][max_blocks];
 * inv_freq [head_dim / 2] (needed with rot); out [n][n_heads][head_dim]. Runs on the pool. */
struct kvs_cpu_attn_args {
    const float *q, *kc, *vc, *inv_freq;
    float *out;
    const int32_t *q_start, *pos, *bt, *rot, *valid;
    int n, n_seqs, max_blocks, n_heads, n_kv_heads, head_dim, block_size;
    float scale;
    int row0;                     /* q_start[0]: rows before it are skipped (backend.h skip_lead) */
};
void kvs_cpu_attention(struct kvs_cpu_pool *pool, const struct kvs_cpu_kernels *k, const struct kvs_cpu_attn_args *a);

#endif
