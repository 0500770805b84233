/* cpu_internal.h: what the CPU backend's files share (kernels/cpu/): the buffer, weight and
 * backend structs behind the opaque handles of kernels/backend.h, the fixed-order dot product
 * and the deferred-RoPE query rotation, and the ops defined outside cpu_backend.c.
 * Ownership and errors: as kernels/backend.h (ops return void; bad arguments are bugs). */
#ifndef KVS_CPU_INTERNAL_H
#define KVS_CPU_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/backend.h"
#include "kernels/cpu/cpu_kernels.h"

#define MAX_HEAD_DIM KVS_CPU_MAX_HEAD_DIM

struct kvs_dbuf {
    enum kvs_buf_kind kind;
    size_t n;
    void *data;                   /* 64-byte aligned, n elements */
};

struct kvs_dweight {
    int64_t rows, cols;           /* vectors: rows = 1 */
    float *data;                  /* [rows][cols] fp32, or NULL when bf16 holds the matrix */
    uint16_t *bf16;               /* [rows][cols] bf16 bits (bf16 matrices, kern.bf16_weights), or NULL */
    struct kvs_cpu_qblocks qb;    /* qb.q != NULL: 4- or 8-bit blocks (kvs_cpu_q4_pack / q8_pack: fp32
                                   * matrices that are exactly such blocks, kern.bf16_weights); data NULL */
    struct kvs_cpu_panels pn;     /* pn.f32 or pn.bf16 != NULL: the matrix as 16-output panels (GEMM mode
                                   * KVS_CPU_GEMM_PANEL; cpu_gemm_panel.c); data and bf16 NULL */
};

struct kvs_backend {
    struct kvs_cpu_pool *pool;
    struct kvs_cpu_kernels kern;  /* kernel set, GEMM mode and weight format, fixed at create */
    struct kvs_cpu_tp_group *tp;  /* tensor-parallel group (cpu_tp.c) or NULL; shared, refcounted */
    int tp_rank;
    int32_t *fetch[2];            /* backend.h fetch areas [KVS_FETCH_MAX] (ops run at once here) */
};

static inline float *F(const struct kvs_dbuf *b) { return (float *)b->data; }
static inline int32_t *I(const struct kvs_dbuf *b) { return (int32_t *)b->data; }

/* ---- the dot product with a fixed order: kvs_cpu_dot (cpu_kernels.h) */
static inline float dot_f32(const float *a, const float *b, int n) { return kvs_cpu_dot(a, b, n); }

/* Rotates q backward by off positions (neox half-split): the deferred-RoPE query for keys
 * stored off positions short of their true rotation (cpu_backend.c). */
void kvs_cpu_rotate_back(const float *q, const float *inv_freq, int off, int head_dim, float *out);

/* backend.h attention_spans and attn_merge (cpu_attn_span.c) */
void kvs_cpu_attention_spans(struct kvs_backend *b, const struct kvs_dbuf *q, const struct kvs_dbuf *kc,
                             const struct kvs_dbuf *vc, const struct kvs_attn_meta *m, const struct kvs_span_list *sp,
                             int n, int n_heads, int n_kv_heads, int head_dim, int block_size, float scale,
                             struct kvs_dbuf *out, struct kvs_dbuf *lse);
void kvs_cpu_attn_merge(struct kvs_backend *b, struct kvs_dbuf *o_a, struct kvs_dbuf *lse_a, const struct kvs_dbuf *o_b,
                        const struct kvs_dbuf *lse_b, int n, int n_heads, int head_dim);

/* tensor parallelism (cpu_tp.c): the ops of kernels/backend.h's tensor-parallel section, and
 * the group's release when a rank's backend is freed */
int kvs_cpu_tp_group(struct kvs_backend *const *bs, int n, size_t max_elems, char *err, size_t errlen);
void kvs_cpu_allreduce_sum(struct kvs_backend *b, struct kvs_dbuf *buf, size_t n);
void kvs_cpu_tp_leave(struct kvs_backend *b);
void kvs_cpu_argmax_rows_val(struct kvs_backend *b, const struct kvs_dbuf *logits, int m, int vocab,
                             struct kvs_dbuf *out, struct kvs_dbuf *vals, size_t out_off);

/* the avx512 set's multi-row tiles of the panel GEMM over one panel chunk (cpu_gemm_panel512.c;
 * arguments as cpu_gemm_panel.c's rows_one_panel, bf: bf16 panel): bitwise the FMA tiles.
 * Only where the CPU has AVX-512F. */
void kvs_cpu_panel512_rows(int bf, const float *x, size_t ldx, const void *pan, int kc, float *c, size_t ldc,
                           int rows, int first, const float *bias);

#endif
