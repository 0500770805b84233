/* cpu_backend.c: the fp32 reference backend (kernels/backend.h) on host memory.
 *
 * Every buffer is plain host memory (fp32 for ACT/F32/KV, int32 for I32); weights are fp32
 * copies of the model's tensors, except bf16 matrices with the AVX2 kernels, which stay bf16
 * and are widened (exactly) inside the matmul and embed, and fp32 matrices that are exactly 4-bit
 * affine or 8-bit blocks (GGUF Q4_1 / Q8_0, dequantized by the loader), which stay as those blocks
 * and are rebuilt bitwise in the kernel (cpu_qblocks.c; reordered into 16-output panels for the
 * panel GEMM, which rebuilds them in its register tile). With the FMA set's default panel GEMM,
 * the other matrices are stored as 16-output panels (fp32, or bf16 for bf16 checkpoints;
 * cpu_gemm_panel.c) and embed reads its rows back from them. Ops are split into independent tasks on a small pthread pool
 * (cpu_pool.h); each output element is computed by one task with a fixed summation order, so
 * results do not depend on the thread count, on n, or on which other rows share the step
 * (batch invariance). The matmul and attention kernels live in cpu_gemm.c / cpu_attention.c
 * (cpu_kernels.h: the plain-C reference, AVX2 and FMA sets picked when the backend is created
 * and logged; OpenBLAS as an opt-in that gives up batch invariance).
 */
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "base/util.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_internal.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/cpu_pool.h"
#include "models/model.h"

/* ---- lifetime ------------------------------------------------------------------------- */

static struct kvs_backend *cpu_create(int n_threads, char *err, size_t errlen)
{
    struct kvs_backend *b = kvs_xcalloc(1, sizeof *b);
    if (kvs_cpu_kernels_from_env(&b->kern, err, errlen) < 0) {
        free(b);
        return NULL;
    }
    b->pool = kvs_cpu_pool_create(n_threads, err, errlen);
    if (!b->pool) {
        free(b);
        return NULL;
    }
    kvs_cpu_blas_init();
    b->fetch[0] = kvs_xmalloc(KVS_FETCH_MAX * sizeof(int32_t));
    b->fetch[1] = kvs_xmalloc(KVS_FETCH_MAX * sizeof(int32_t));
    kvs_log(KVS_LOG_INFO,
            "cpu backend: %d threads, %s kernels (best here: %s; avx512 = fma + 512-bit panel and attention tiles), matmul %s, bf16 matrices kept %s%s",
            kvs_cpu_pool_threads(b->pool), kvs_cpu_isa_name(b->kern.isa), kvs_cpu_isa_name(kvs_cpu_isa_best()),
            b->kern.gemm == KVS_CPU_GEMM_BLAS    ? kvs_cpu_blas_name()
            : b->kern.gemm == KVS_CPU_GEMM_PANEL ? "batch-invariant, 16-output panels"
                                                 : "batch-invariant, dot-product tiles",
            b->kern.bf16_weights ? "as bf16" : "as fp32 copies",
            b->kern.bf16_weights ? ", exact 4- / 8-bit blocks (GGUF Q4_1 / Q8_0) kept as blocks" : "");
    return b;
}

static void cpu_free(struct kvs_backend *b)
{
    if (!b) return;
    kvs_cpu_tp_leave(b);
    kvs_cpu_pool_free(b->pool);
    free(b->fetch[0]);
    free(b->fetch[1]);
    free(b);
}

static size_t cpu_mem_available(struct kvs_backend *b)
{
    (void)b;
    FILE *f = fopen("/proc/meminfo", "r");
    if (f) {
        char line[256];
        unsigned long long kb;
        while (fgets(line, sizeof line, f)) {
            if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1) {
                fclose(f);
                return (size_t)kb * 1024;
            }
        }
        fclose(f);
    }
    long pages = sysconf(_SC_AVPHYS_PAGES), psize = sysconf(_SC_PAGESIZE);
    return pages > 0 && psize > 0 ? (size_t)pages * (size_t)psize : 0;
}

static size_t cpu_elem_size(struct kvs_backend *b, enum kvs_buf_kind kind)
{
    (void)b;
    (void)kind;
    return 4;                     /* fp32 and int32 */
}

static void cpu_sync(struct kvs_backend *b) { (void)b; }

/* ---- memory --------------------------------------------------------------------------- */

static struct kvs_dbuf *cpu_alloc(struct kvs_backend *b, enum kvs_buf_kind kind, size_t n)
{
    (void)b;
    if (n > SIZE_MAX / 4 - 64) return NULL;
    struct kvs_dbuf *buf = calloc(1, sizeof *buf);
    if (!buf) return NULL;
    size_t bytes = (n * 4 + 63) / 64 * 64;
    if (posix_memalign(&buf->data, 64, bytes ? bytes : 64) != 0) {
        free(buf);
        return NULL;
    }
    buf->kind = kind;
    buf->n = n;
    return buf;
}

static void cpu_free_buf(struct kvs_backend *b, struct kvs_dbuf *buf)
{
    (void)b;
    if (!buf) return;
    free(buf->data);
    free(buf);
}

static void cpu_upload(struct kvs_backend *b, struct kvs_dbuf *dst, size_t off, const void *src, size_t n)
{
    (void)b;
    KVS_ASSERT(off + n <= dst->n);
    memcpy((char *)dst->data + off * 4, src, n * 4);
}

static void cpu_download(struct kvs_backend *b, void *dst, const struct kvs_dbuf *src, size_t off, size_t n)
{
    (void)b;
    KVS_ASSERT(off + n <= src->n);
    memcpy(dst, (const char *)src->data + off * 4, n * 4);
}

static void cpu_zero(struct kvs_backend *b, struct kvs_dbuf *buf, size_t off, size_t n)
{
    (void)b;
    KVS_ASSERT(off + n <= buf->n);
    memset((char *)buf->data + off * 4, 0, n * 4);
}

/* A matrix for the panel GEMM: exact 4- / 8-bit blocks stay blocks (packed per task in the
 * kernel), bf16 becomes bf16 panels (with kern.bf16_weights), anything else fp32 panels. 1: w
 * filled; 0: not taken (the caller continues); -ENOMEM + message. */
static int upload_panels(struct kvs_backend *b, const struct kvs_tensor_view *t, struct kvs_dweight *w, int64_t rows,
                         int64_t cols, char *err, size_t errlen)
{
    const size_t n = (size_t)rows * (size_t)cols, np = kvs_cpu_panels_elems(rows, cols);
    if (t->dtype == KVS_DTYPE_F32 && t->nbytes == n * 4 && b->kern.bf16_weights && cols % KVS_CPU_Q4_BLOCK == 0 &&
        cols <= KVS_CPU_Q4_MAX_COLS)
        return 0;   /* the block check below, then fp32 panels if the matrix is not blocks */
    if (b->kern.bf16_weights && t->dtype == KVS_DTYPE_BF16 && t->nbytes == n * 2) {
        uint16_t *pb = NULL;
        if (posix_memalign((void **)&pb, 64, np * sizeof(uint16_t)) != 0)
            return kvs_err(err, errlen, -ENOMEM, "cpu backend: out of memory for a %lld x %lld weight",
                           (long long)rows, (long long)cols);
        kvs_cpu_panels_pack_bf16(t->data, rows, cols, pb);
        w->pn.bf16 = pb;
    } else {
        float *tmp = NULL, *pf = NULL;
        if (posix_memalign((void **)&pf, 64, np * sizeof(float)) != 0 ||
            posix_memalign((void **)&tmp, 64, n * sizeof(float)) != 0) {
            free(pf);
            return kvs_err(err, errlen, -ENOMEM, "cpu backend: out of memory for a %lld x %lld weight",
                           (long long)rows, (long long)cols);
        }
        kvs_tensor_to_f32(t, tmp, 0, n);
        kvs_cpu_panels_pack_f32(tmp, rows, cols, pf);
        free(tmp);
        w->pn.f32 = pf;
    }
    w->rows = rows;
    w->cols = cols;
    return 1;
}

static struct kvs_dweight *cpu_upload_weight(struct kvs_backend *b, const struct kvs_tensor_view *t, char *err,
                                             size_t errlen)
{
    (void)b;
    if (t->ndim != 1 && t->ndim != 2) {
        kvs_err(err, errlen, -EINVAL, "cpu backend: tensor has %d dimensions (want 1 or 2)", t->ndim);
        return NULL;
    }
    int64_t rows = t->ndim == 2 ? t->shape[0] : 1, cols = t->ndim == 2 ? t->shape[1] : t->shape[0];
    if (rows <= 0 || cols <= 0) {
        kvs_err(err, errlen, -EINVAL, "cpu backend: empty tensor");
        return NULL;
    }
    struct kvs_dweight *w = calloc(1, sizeof *w);
    size_t n = (size_t)rows * (size_t)cols;
    if (w && b->kern.gemm == KVS_CPU_GEMM_PANEL && t->ndim == 2 && rows > 1) {
        int rc = upload_panels(b, t, w, rows, cols, err, errlen);
        if (rc < 0) {
            free(w);
            return NULL;
        }
        if (rc > 0) return w;
    }
    if (w && b->kern.bf16_weights && t->ndim == 2 && t->dtype == KVS_DTYPE_BF16 && t->nbytes == n * 2) {
        /* kept as bf16: the matmul widens it in registers (exact), embed row by row */
        if (posix_memalign((void **)&w->bf16, 64, n * sizeof(uint16_t)) != 0) {
            free(w);
            kvs_err(err, errlen, -ENOMEM, "cpu backend: out of memory for a %lld x %lld weight", (long long)rows,
                    (long long)cols);
            return NULL;
        }
        memcpy(w->bf16, t->data, n * sizeof(uint16_t));
        w->rows = rows;
        w->cols = cols;
        return w;
    }
    if (w && b->kern.bf16_weights && t->ndim == 2 && t->dtype == KVS_DTYPE_F32 && t->nbytes == n * 4 && rows > 1 &&
        cols % KVS_CPU_Q4_BLOCK == 0 && cols <= KVS_CPU_Q4_MAX_COLS) {
        /* a GGUF Q4_1 / Q8_0 matrix dequantized to fp32: kept as its blocks when every value is
         * bitwise rebuilt from them (cpu_qblocks.c), else the fp32 copy below */
        const size_t nb = n / KVS_CPU_Q4_BLOCK;
        uint8_t *q = NULL;
        float *dm = NULL;
        if (posix_memalign((void **)&q, 64, n / 2) == 0 && posix_memalign((void **)&dm, 64, nb * 8) == 0 &&
            kvs_cpu_q4_pack(t->data, rows, cols, q, dm)) {
            w->qb = (struct kvs_cpu_qblocks){.bits = 4, .q = q, .dm = dm};
        } else {
            free(q);
            free(dm);
            q = NULL;
            dm = NULL;
            if (posix_memalign((void **)&q, 64, n) == 0 && posix_memalign((void **)&dm, 64, nb * 4) == 0 &&
                kvs_cpu_q8_pack(t->data, rows, cols, (int8_t *)q, dm)) {
                w->qb = (struct kvs_cpu_qblocks){.bits = 8, .q = q, .dm = dm};
            } else {
                free(q);
                free(dm);
            }
        }
        if (w->qb.q && b->kern.gemm == KVS_CPU_GEMM_PANEL) {
            /* the panel GEMM reads blocks in panel order (cpu_kernels.h): same bytes, reordered */
            const int bits = w->qb.bits;
            uint8_t *pq = NULL;
            float *pdm = NULL;
            if (posix_memalign((void **)&pq, 64, kvs_cpu_qpanels_qbytes(bits, rows, cols)) != 0 ||
                posix_memalign((void **)&pdm, 64, kvs_cpu_qpanels_dmfloats(bits, rows, cols) * sizeof(float)) != 0) {
                free(pq);
                free((void *)w->qb.q);
                free((void *)w->qb.dm);
                free(w);
                kvs_err(err, errlen, -ENOMEM, "cpu backend: out of memory for a %lld x %lld weight", (long long)rows,
                        (long long)cols);
                return NULL;
            }
            kvs_cpu_qblocks_to_panels(&w->qb, rows, cols, pq, pdm);
            free((void *)w->qb.q);
            free((void *)w->qb.dm);
            w->qb = (struct kvs_cpu_qblocks){.bits = bits, .panel = 1, .q = pq, .dm = pdm};
        }
        if (w->qb.q) {
            w->rows = rows;
            w->cols = cols;
            return w;
        }
        if (b->kern.gemm == KVS_CPU_GEMM_PANEL) {
            /* not blocks: fp32 panels (bf16_weights off skips straight there) */
            float *pf = NULL;
            if (posix_memalign((void **)&pf, 64, kvs_cpu_panels_elems(rows, cols) * sizeof(float)) != 0) {
                free(w);
                kvs_err(err, errlen, -ENOMEM, "cpu backend: out of memory for a %lld x %lld weight", (long long)rows,
                        (long long)cols);
                return NULL;
            }
            kvs_cpu_panels_pack_f32(t->data, rows, cols, pf);
            w->pn.f32 = pf;
            w->rows = rows;
            w->cols = cols;
            return w;
        }
    }
    if (!w || posix_memalign((void **)&w->data, 64, n * sizeof(float)) != 0) {
        free(w);
        kvs_err(err, errlen, -ENOMEM, "cpu backend: out of memory for a %lld x %lld weight", (long long)rows,
                (long long)cols);
        return NULL;
    }
    w->rows = rows;
    w->cols = cols;
    kvs_tensor_to_f32(t, w->data, 0, n);
    return w;
}

static void cpu_free_weight(struct kvs_backend *b, struct kvs_dweight *w)
{
    (void)b;
    if (!w) return;
    free(w->data);
    free(w->bf16);
    free((void *)w->pn.f32);
    free((void *)w->pn.bf16);
    free((void *)w->qb.q);
    free((void *)w->qb.dm);
    free(w);
}

/* ---- ops ------------------------------------------------------------------------------ */

struct job {
    const float *x, *w, *bias;
    const uint16_t *wb;
    const float *x2;
    float *y, *y2;
    const int32_t *i0, *i1;
    int n, d0, d1, d2;
    float eps;
    const struct kvs_dweight *weight;
    int vec;                      /* FMA set: vector rows (cpu_act.c) */
};

static void embed_task(void *c, int t)
{
    struct job *j = c;
    float *y = j->y + (size_t)t * j->d0;
    if (j->weight && j->weight->qb.q) {
        kvs_cpu_qb_row(&j->weight->qb, j->d0, (size_t)j->i0[t], y);
    } else if (j->weight && (j->weight->pn.f32 || j->weight->pn.bf16)) {
        kvs_cpu_panels_row(&j->weight->pn, j->d0, j->i0[t], y);
    } else if (j->wb) {
        const uint16_t *row = j->wb + (size_t)j->i0[t] * j->d0;
        for (int i = 0; i < j->d0; i++) y[i] = kvs_cpu_bf16(row[i]);
    } else {
        memcpy(y, j->w + (size_t)j->i0[t] * j->d0, (size_t)j->d0 * sizeof(float));
    }
}

static void cpu_embed(struct kvs_backend *b, const struct kvs_dweight *emb, const struct kvs_dbuf *tokens, int n,
                      int dim, struct kvs_dbuf *out)
{
    KVS_ASSERT(emb->cols == dim);
    struct job j = {.w = emb->data, .wb = emb->bf16, .i0 = I(tokens), .y = F(out), .n = n, .d0 = dim, .weight = emb};
    for (int t = 0; t < n; t++) KVS_ASSERT(j.i0[t] >= 0 && j.i0[t] < emb->rows);
    kvs_cpu_pool_run_sized(b->pool, n, (double)n * dim, embed_task, &j);
}

static void rmsnorm_row(const float *x, const float *w, float eps, int dim, float *out)
{
    double ss = 0.0;
    for (int i = 0; i < dim; i++) ss += (double)x[i] * (double)x[i];
    float inv = (float)(1.0 / sqrt(ss / dim + (double)eps));
    for (int i = 0; i < dim; i++) out[i] = w[i] * (x[i] * inv);
}

/* the reference's serial row, or the FMA set's 16-lane sum of squares (within 1 ulp) */
static void norm_row(const struct job *j, const float *x, int dim, float *out)
{
    (j->vec ? kvs_cpu_rmsnorm_row : rmsnorm_row)(x, j->w, j->eps, dim, out);
}

static void rmsnorm_task(void *c, int t)
{
    struct job *j = c;
    size_t o = (size_t)t * j->d0;
    norm_row(j, j->x + o, j->d0, j->y + o);
}

static void cpu_rmsnorm(struct kvs_backend *b, const struct kvs_dbuf *x, const struct kvs_dweight *w, float eps, int n,
                        int dim, struct kvs_dbuf *out)
{
    KVS_ASSERT(w->data);   /* vectors are always fp32 */
    struct job j = {.x = F(x), .w = w->data, .y = F(out), .eps = eps, .d0 = dim, .vec = b->kern.isa >= KVS_CPU_ISA_FMA};
    kvs_cpu_pool_run_sized(b->pool, n, 2.0 * n * dim, rmsnorm_task, &j);
}

static void add_rmsnorm_task(void *c, int t)
{
    struct job *j = c;
    size_t o = (size_t)t * j->d0;
    float *res = j->y2 + o;
    const float *d = j->x + o;
    for (int i = 0; i < j->d0; i++) res[i] += d[i];
    norm_row(j, res, j->d0, j->y + o);
}

static void cpu_add_rmsnorm(struct kvs_backend *b, struct kvs_dbuf *res, const struct kvs_dbuf *delta,
                            const struct kvs_dweight *w, float eps, int n, int dim, struct kvs_dbuf *out)
{
    KVS_ASSERT(w->data);   /* vectors are always fp32 */
    struct job j = {.x = F(delta), .y2 = F(res), .w = w->data, .y = F(out), .eps = eps, .d0 = dim,
                    .vec = b->kern.isa >= KVS_CPU_ISA_FMA};
    kvs_cpu_pool_run_sized(b->pool, n, 3.0 * n * dim, add_rmsnorm_task, &j);
}

static void head_rmsnorm_task(void *c, int t)
{
    struct job *j = c;
    float *row = j->y + (size_t)t * j->d0 * j->d1;
    for (int h = 0; h < j->d0; h++) norm_row(j, row + (size_t)h * j->d1, j->d1, row + (size_t)h * j->d1);
}

static void cpu_head_rmsnorm(struct kvs_backend *b, struct kvs_dbuf *x, const struct kvs_dweight *w, float eps, int n,
                             int n_heads, int head_dim)
{
    KVS_ASSERT(w->data);   /* vectors are always fp32 */
    struct job j = {.y = F(x), .w = w->data, .eps = eps, .d0 = n_heads, .d1 = head_dim,
                    .vec = b->kern.isa >= KVS_CPU_ISA_FMA};
    kvs_cpu_pool_run_sized(b->pool, n, 2.0 * n * n_heads * head_dim, head_rmsnorm_task, &j);
}

static void cpu_matmul(struct kvs_backend *b, const struct kvs_dbuf *x, const struct kvs_dweight *w,
                       const struct kvs_dweight *bias, int n, int in, int out, struct kvs_dbuf *y)
{
    KVS_ASSERT(w->rows == out && w->cols == in);
    KVS_ASSERT(!bias || bias->rows * bias->cols == out);
    /* 4- / 8-bit blocks go to the panel GEMM in panel order (rebuilt in its tile), else to the
     * dot-product tiles */
    if (w->pn.f32 || w->pn.bf16)
        kvs_cpu_gemm_panel_isa(b->pool, b->kern.isa, F(x), &w->pn, NULL, bias ? bias->data : NULL, n, in, out, F(y));
    else if (w->qb.q && w->qb.panel)
        kvs_cpu_gemm_panel_isa(b->pool, b->kern.isa, F(x), NULL, &w->qb, bias ? bias->data : NULL, n, in, out, F(y));
    else if (w->qb.q)
        kvs_cpu_gemm_qb(b->pool, &b->kern, F(x), &w->qb, bias ? bias->data : NULL, n, in, out, F(y));
    else
        kvs_cpu_gemm(b->pool, &b->kern, F(x), w->data, w->bf16, bias ? bias->data : NULL, n, in, out, F(y));
}

struct rope_job {
    float *x;
    const int32_t *pos, *rot;
    const float *inv_freq;
    int n_heads, head_dim;
};

static void rope_task(void *c, int t)
{
    struct rope_job *j = c;
    int half = j->head_dim / 2;
    float cs[MAX_HEAD_DIM / 2], sn[MAX_HEAD_DIM / 2];
    float p = (float)(j->pos[t] + (j->rot ? j->rot[t] : 0));
    for (int i = 0; i < half; i++) {
        float a = p * j->inv_freq[i];
        cs[i] = cosf(a);
        sn[i] = sinf(a);
    }
    float *row = j->x + (size_t)t * j->n_heads * j->head_dim;
    for (int h = 0; h < j->n_heads; h++) {
        float *v = row + (size_t)h * j->head_dim;
        for (int i = 0; i < half; i++) {
            float a = v[i], c2 = v[i + half];
            v[i] = a * cs[i] - c2 * sn[i];
            v[i + half] = c2 * cs[i] + a * sn[i];
        }
    }
}

static void cpu_rope(struct kvs_backend *b, struct kvs_dbuf *x, const struct kvs_dbuf *pos, const struct kvs_dbuf *rot,
                     const struct kvs_dbuf *inv_freq, int n, int n_heads, int head_dim)
{
    KVS_ASSERT(head_dim % 2 == 0 && head_dim <= MAX_HEAD_DIM);
    struct rope_job j = {F(x), I(pos), rot ? I(rot) : NULL, F(inv_freq), n_heads, head_dim};
    /* cosf / sinf per position and frequency, then a rotation per element */
    kvs_cpu_pool_run_sized(b->pool, n, 20.0 * n * head_dim + 3.0 * n * n_heads * head_dim, rope_task, &j);
}

static void cpu_kv_write(struct kvs_backend *b, const struct kvs_dbuf *k, const struct kvs_dbuf *v,
                         const struct kvs_dbuf *slots, int n, int n_kv_heads, int head_dim, int block_size,
                         struct kvs_dbuf *kc, struct kvs_dbuf *vc)
{
    (void)b;
    const int32_t *s = I(slots);
    size_t hd = (size_t)head_dim;
    for (int t = 0; t < n; t++) {
        int blk = s[t] / block_size, off = s[t] % block_size;
        KVS_ASSERT(s[t] >= 0 && ((size_t)blk + 1) * n_kv_heads * block_size * hd <= kc->n);
        for (int h = 0; h < n_kv_heads; h++) {
            size_t dst = (((size_t)blk * n_kv_heads + h) * block_size + off) * hd;
            size_t src = ((size_t)t * n_kv_heads + h) * hd;
            memcpy(F(kc) + dst, F(k) + src, hd * sizeof(float));
            memcpy(F(vc) + dst, F(v) + src, hd * sizeof(float));
        }
    }
}

/* cpu_internal.h */
void kvs_cpu_rotate_back(const float *q, const float *inv_freq, int off, int head_dim, float *out)
{
    int half = head_dim / 2;
    for (int i = 0; i < half; i++) {
        float a = (float)off * inv_freq[i];
        float c = cosf(a), s = sinf(a);
        out[i] = q[i] * c + q[i + half] * s;
        out[i + half] = -q[i] * s + q[i + half] * c;
    }
}

static void cpu_attention(struct kvs_backend *b, const struct kvs_dbuf *q, const struct kvs_dbuf *kc,
                          const struct kvs_dbuf *vc, const struct kvs_attn_meta *m, int n, int n_heads, int n_kv_heads,
                          int head_dim, int block_size, float scale, struct kvs_dbuf *out)
{
    KVS_ASSERT(head_dim <= MAX_HEAD_DIM && n_kv_heads > 0 && n_heads % n_kv_heads == 0);
    KVS_ASSERT(!m->rot_offsets || m->inv_freq);
    /* skip_lead (backend.h): the sequences' tables start past the skipped ones; rows keep their
     * absolute indices (q_start's values), so rows [0, row0) are neither read nor written */
    const int sk = m->skip_lead > 0 && m->skip_lead < m->n_seqs ? m->skip_lead : 0;
    const size_t so = (size_t)sk * (size_t)m->max_blocks;
    struct kvs_cpu_attn_args a = {
        .q = F(q), .kc = F(kc), .vc = F(vc), .out = F(out), .inv_freq = m->inv_freq ? F(m->inv_freq) : NULL,
        .q_start = I(m->q_start) + sk, .pos = I(m->pos) + sk, .bt = I(m->block_tables) + so,
        .rot = m->rot_offsets ? I(m->rot_offsets) + so : NULL, .valid = m->block_valid ? I(m->block_valid) + so : NULL,
        .n = n, .n_seqs = m->n_seqs - sk, .max_blocks = m->max_blocks, .n_heads = n_heads, .n_kv_heads = n_kv_heads,
        .head_dim = head_dim, .block_size = block_size, .scale = scale,
    };
    a.row0 = a.q_start[0];
    KVS_ASSERT(I(m->q_start)[0] == 0 && a.q_start[a.n_seqs] == n);
    kvs_cpu_attention(b->pool, &b->kern, &a);
}

static void swiglu_task(void *c, int t)
{
    struct job *j = c;
    size_t o = (size_t)t * j->d0;
    for (int i = 0; i < j->d0; i++) {
        float g = j->x[o + i];
        j->y[o + i] = g / (1.0f + expf(-g)) * j->x2[o + i];
    }
}

static void swiglu_vec_task(void *c, int t)
{
    struct job *j = c;
    size_t o = (size_t)t * j->d0;
    kvs_cpu_swiglu_row(j->x + o, j->x2 + o, j->d0, j->y + o);
}

static void cpu_swiglu(struct kvs_backend *b, const struct kvs_dbuf *gate, const struct kvs_dbuf *up, int n, int ff,
                       struct kvs_dbuf *out)
{
    struct job j = {.x = F(gate), .x2 = F(up), .y = F(out), .d0 = ff};
    /* an exp per element: libm's in the reference set, a vector one (cpu_act.c) otherwise */
    kvs_cpu_pool_run_sized(b->pool, n, 20.0 * n * ff, b->kern.isa >= KVS_CPU_ISA_FMA ? swiglu_vec_task : swiglu_task, &j);
}

static void cpu_gather_rows(struct kvs_backend *b, const struct kvs_dbuf *x, const struct kvs_dbuf *rows, int m, int dim,
                            struct kvs_dbuf *out)
{
    (void)b;
    for (int i = 0; i < m; i++) {
        int r = I(rows)[i];
        KVS_ASSERT(r >= 0 && ((size_t)r + 1) * dim <= x->n);
        memmove(F(out) + (size_t)i * dim, F(x) + (size_t)r * dim, (size_t)dim * sizeof(float));
    }
}

static void cpu_kv_copy_block(struct kvs_backend *b, struct kvs_dbuf *kc, struct kvs_dbuf *vc, int src, int dst,
                              int n_kv_heads, int block_size, int head_dim)
{
    (void)b;
    size_t per = (size_t)n_kv_heads * block_size * head_dim;
    KVS_ASSERT(src >= 0 && dst >= 0 && ((size_t)src + 1) * per <= kc->n && ((size_t)dst + 1) * per <= kc->n);
    if (src == dst) return;
    memcpy(F(kc) + (size_t)dst * per, F(kc) + (size_t)src * per, per * sizeof(float));
    memcpy(F(vc) + (size_t)dst * per, F(vc) + (size_t)src * per, per * sizeof(float));
}

static void cpu_logits_to_host(struct kvs_backend *b, const struct kvs_dbuf *logits, int m, int vocab, float *host)
{
    (void)b;
    memcpy(host, F(logits), (size_t)m * vocab * sizeof(float));
}

struct argmax_job {
    const float *x;
    int vocab;
    int32_t *out;
};

static void argmax_task(void *c, int t)
{
    struct argmax_job *j = c;
    j->out[t] = kvs_argmax_row(j->x + (size_t)t * j->vocab, j->vocab);
}

static void cpu_argmax_rows(struct kvs_backend *b, const struct kvs_dbuf *logits, int m, int vocab,
                            struct kvs_dbuf *out, size_t out_off)
{
    if (m <= 0) return;
    KVS_ASSERT((size_t)m * vocab <= logits->n && out_off + (size_t)m <= out->n);
    struct argmax_job j = {.x = F(logits), .vocab = vocab, .out = I(out) + out_off};
    kvs_cpu_pool_run_sized(b->pool, m, (double)m * vocab, argmax_task, &j);
}

/* ---- asynchronous steps (backend.h): the CPU runs every op when it is called, so a step is
 * complete when begin returns; the same calls keep the runner's asynchronous path one path */

static void cpu_ids_to_tokens(struct kvs_backend *b, const struct kvs_dbuf *ids, const struct kvs_dbuf *pairs, int n,
                              struct kvs_dbuf *tokens)
{
    (void)b;
    const int32_t *p = I(pairs), *id = I(ids);
    int32_t *t = I(tokens);
    for (int i = 0; i < n; i++) {
        KVS_ASSERT((size_t)p[2 * i] < tokens->n && (size_t)p[2 * i + 1] < ids->n);
        const int32_t v = id[p[2 * i + 1]];
        t[p[2 * i]] = v < 0 ? 0 : v;
    }
}

static void cpu_fetch_begin(struct kvs_backend *b, const struct kvs_dbuf *src, size_t n, int slot)
{
    KVS_ASSERT(n <= KVS_FETCH_MAX && n <= src->n && (slot == 0 || slot == 1));
    memcpy(b->fetch[slot], I(src), n * sizeof(int32_t));
}

static void cpu_fetch_end(struct kvs_backend *b, int slot, int32_t *dst, size_t n)
{
    KVS_ASSERT(n <= KVS_FETCH_MAX && (slot == 0 || slot == 1));
    memcpy(dst, b->fetch[slot], n * sizeof(int32_t));
}

const struct kvs_backend_ops kvs_cpu_backend = {
    .name = "cpu",
    .create = cpu_create,
    .free = cpu_free,
    .mem_available = cpu_mem_available,
    .elem_size = cpu_elem_size,
    .sync = cpu_sync,
    .alloc = cpu_alloc,
    .free_buf = cpu_free_buf,
    .upload = cpu_upload,
    .download = cpu_download,
    .zero = cpu_zero,
    .upload_weight = cpu_upload_weight,
    .free_weight = cpu_free_weight,
    .embed = cpu_embed,
    .rmsnorm = cpu_rmsnorm,
    .add_rmsnorm = cpu_add_rmsnorm,
    .head_rmsnorm = cpu_head_rmsnorm,
    .matmul = cpu_matmul,
    .rope = cpu_rope,
    .kv_write = cpu_kv_write,
    .attention = cpu_attention,
    .swiglu = cpu_swiglu,
    .gather_rows = cpu_gather_rows,
    .kv_copy_block = cpu_kv_copy_block,
    .logits_to_host = cpu_logits_to_host,
    .argmax_rows = cpu_argmax_rows,
    .attention_spans = kvs_cpu_attention_spans,
    .attn_merge = kvs_cpu_attn_merge,
    .tp_group = kvs_cpu_tp_group,
    .allreduce_sum = kvs_cpu_allreduce_sum,
    .argmax_rows_val = kvs_cpu_argmax_rows_val,
    .ids_to_tokens = cpu_ids_to_tokens,
    .fetch_begin = cpu_fetch_begin,
    .fetch_end = cpu_fetch_end,
};
