/* cuda_internal.cuh: what the CUDA backend's files share (internal to kernels/cuda/, CUDA C++ only):
 * the objects behind backend.h's opaque types (struct kvs_backend, kvs_dbuf, kvs_dweight,
 * kvs_graph), the GEMM-pick state, the bf16 mirror of a matmul input (xh_claim / xh_forget), and
 * the functions one file gives another. The op table (kvs_cuda_backend) is assembled in
 * cuda_backend.cu from the kvs_cu_op_* functions of:
 *   cuda_backend.cu  create/free, memory, uploads, step graphs, the table and cuda_backend.h's extras;
 *   cuda_gemm.cu     the matmuls: decode GEMM / cuBLASLt picks, fused weights, SwiGLU fusions;
 *   cuda_ops.cu      the small ops: embedding, norms, RoPE, KV writes, attention's entry, argmax...;
 *   kv_span.cu       the KV-strategy primitives attention_spans and attn_merge;
 *   cuda_tp.cu       tensor parallelism: the NCCL group and its all-reduce;
 *   kv_lean.cu       LeanKV's quantized KV pages (kernels/kv_lean.h, kvs_lean_kernels_for).
 * Ownership: everything allocated is owned by the struct kvs_backend (freed by its free op).
 * Errors: CUDA / cuBLAS failures abort with file:line (CUDA_CHECK, CUBLAS_CHECK: bugs, not client
 * errors); allocation functions return NULL on out-of-memory.
 */
#ifndef KVS_CUDA_INTERNAL_CUH
#define KVS_CUDA_INTERNAL_CUH

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef _Noreturn
#define _Noreturn [[noreturn]]
#endif
extern "C" {
#include "base/util.h"
#include "kernels/backend.h"
#include "models/model.h"
}
#include "kernels/cuda/cuda_attention.h"
#include "kernels/cuda/cuda_launch.h"
#include "kernels/cuda/cuda_skinny.h"

/* nvcc builds only this side: see cuda_backend.h's declarations (the C files get the flag from the Makefile) */
#ifndef KVS_HAVE_CUDA
#define KVS_HAVE_CUDA 1
#endif
#include "kernels/cuda/cuda_backend.h"

/* for cuBLAS and cuBLASLt calls alike (both return cublasStatus_t) */
#define CUBLAS_CHECK(call)                                                                   \
    do {                                                                                     \
        cublasStatus_t s_ = (call);                                                          \
        if (s_ != CUBLAS_STATUS_SUCCESS)                                                     \
            kvs_panic(__FILE__, __LINE__, "cuBLAS error %d (%s) in %s", (int)s_,              \
                      cublasGetStatusString(s_), #call);                                     \
    } while (0)
/* after every kernel launch: launch-configuration errors surface here, with the caller's line */
#define LAUNCH_CHECK() CUDA_CHECK(cudaGetLastError())

typedef __nv_bfloat16 bf16;

/* ---- objects ------------------------------------------------------------------------------ */

struct kvs_dbuf {
    struct kvs_dbuf *prev, *next; /* the backend's list of live buffers (freed by free()) */
    enum kvs_buf_kind kind;
    size_t n;                     /* elements */
    void *d;                      /* device memory: float (ACT, F32), int32 (I32), bf16 (KV) */
};

/* The device storage of matrices laid out back to back by fuse_weights: each of them points into
 * it, and the last one freed frees it. */
struct wstore {
    bf16 *base;
    int refs;
};

struct kvs_dweight {
    struct kvs_dweight *prev, *next; /* the backend's list of live weights */
    int64_t rows, cols;           /* a vector has rows = 1 */
    int is_vector;                /* 1: fp32 vector in f; 0: bf16 matrix [rows][cols] in h */
    float *f;
    bf16 *h;                      /* its own cudaMalloc, or (store != NULL) a slice of store->base */
    struct wstore *store;         /* fused storage shared with its neighbours (fuse_weights), or NULL */
};

struct kvs_graph {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    bf16 *xh;                     /* the bf16 mirror's state after the recorded ops (restored at replay) */
    const void *xh_src;
    size_t xh_n;
};

#define ATTN_WS_BYTES ((size_t)64 << 20)   /* split-attention partials */
#define BLAS_WS_BYTES ((size_t)32 << 20)   /* cuBLAS / cuBLASLt workspace (fixed, so graphs can capture) */
#define BOUNCE_ELEMS ((size_t)1 << 20)     /* host conversion chunk */

/* cuBLASLt algorithm choice. cublasLtMatmulAlgoGetHeuristic ranks its candidates by an estimate;
 * the fastest at 32-128 rows is often not its first (bench/RESULTS.md, "GEMM and decode-GEMM
 * design measurements"), so the first time a shape runs outside a graph capture
 * its candidates are timed on the call's operands and the pick is kept for the backend's life.
 * Decode steps are graph-captured on first use, where nothing can be timed: each new weight shape
 * is timed at the graphs' row counts up front (gemm_pretune), at the first alloc after its
 * upload, by when the runner has fused q/k/v and gate/up (fuse_weights times the joint shapes). */
#define GEMM_PLAN_SLOTS 2048                 /* hash table of timed picks (open addressing) */
#define GEMM_PLAN_MAX 1536                   /* picks kept at most, so probe chains stay short */
#define GEMM_TUNE_MAX_N 256                  /* rows up to which a shape is timed: the decode graphs'
                                              * sizes; prefill chunks and mixed steps vary their row
                                              * count every step, are compute bound (the first pick
                                              * does well there), and timing each would stall them */
#define GEMM_HEURISTIC 16                    /* heuristic results asked for */
#define GEMM_SPLITK_BASES 4                  /* unsplit candidates given split-K variants (the first
                                              * ones in the heuristic's order that support it) */
#define GEMM_CANDIDATES 64                   /* candidates timed at most: the heuristic's and the
                                              * split-K variants (gemm_splitk_variants) */
#define GEMM_WARMUP 2
#define GEMM_TIMED 5
#define GEMM_SPIN_NS 100000                  /* the stream waits while the timed runs are queued */
#define GEMM_MIN_GAIN 0.98f                  /* another pick must take <= 98% of the first's time */
#define GEMM_PRETUNE_SHAPES 256              /* weight shapes remembered as pre-tuned */
#define GEMM_PRETUNE_SCRATCH ((size_t)256 << 20) /* x + y scratch of one pre-tuned row count, at most */
#define FUSE_WS_MAX ((size_t)16 << 20)       /* matmul_multi's fp32 output scratch for weights fused by
                                              * fuse_weights: groups of which GEMM_TUNE_MAX_N rows fit
                                              * run as one GEMM (q/k/v of the 8B models: 6 MB) */

/* What a cuBLAS(Lt) GEMM writes: y = x W^T in fp32 (ACT), y += x W^T in fp32 (the accumulate
 * GEMM), or y = x W^T rounded to bf16 (matmul_swiglu's gate and up, which SwiGLU reads back:
 * half the bytes written and read, as PyTorch's bf16 Linear layers have it) */
enum gemm_out { GEMM_F32 = 0, GEMM_F32_ACC = 1, GEMM_BF16 = 2 };

/* one timed pick: y[n][out] (+)= x[n][in] W[out][in]^T with pointers aligned to `align` bytes */
struct gemm_plan {
    int n, in, out, kind, align; /* the key (kind: enum gemm_out); n == 0: a free slot */
    int differs;                       /* 1: the pick is not the heuristic's first */
    cublasLtMatmulAlgo_t algo;
};

struct gemm_tuning {
    struct gemm_plan plans[GEMM_PLAN_SLOTS];
    int n_plans;
    int full_warned;                   /* the table-full warning was logged */
    cudaEvent_t ev[2 * GEMM_TIMED];    /* the timing's own events, a pair per timed run
                                        * (kvs_cuda_timer_* may be running) */
    int64_t pretuned[GEMM_PRETUNE_SHAPES][2]; /* weight shapes (rows, cols) done by gemm_pretune */
    int n_pretuned;
    int64_t pending[GEMM_PRETUNE_SHAPES][2]; /* shapes uploaded since, timed at the next alloc
                                              * (gemm_pretune_pending) */
    int n_pending;
    /* pre-tuning since the last summary line (logged when the model load is over: gemm_tune_report) */
    int log_mats, log_gemms, log_differ;
    double log_s;
};

struct kvs_backend {
    int device;
    int n_sms;
    cudaStream_t stream;
    cublasHandle_t blas;
    void *blas_ws;
    bf16 *xh_buf[2];              /* two bf16 mirror buffers [xh_cap]: an op that reads one mirror (the fused
                                   * gate/up GEMM) writes its output's into the other */
    bf16 *xh;                     /* the current mirror: xh_buf[0] or [1] */
    size_t xh_cap;
    const void *xh_src;           /* the fp32 buffer xh currently mirrors (NULL: none), xh_n elements of it.
                                   * The norms and SwiGLU write the bf16 copy of their output as they go, so
                                   * the GEMMs that read it (q/k/v, gate/up, down) skip the conversion pass;
                                   * every op that writes a buffer calls xh_forget() on it. */
    size_t xh_n;
    float *attn_ws;               /* ATTN_WS_BYTES */
    float *fuse_ws;               /* matmul_multi's joint output of fused weights, fuse_cap floats
                                   * (FUSE_WS_MAX bytes, allocated by the first fuse_weights) */
    size_t fuse_cap;
    void *bounce;                 /* host: BOUNCE_ELEMS fp32, then BOUNCE_ELEMS bf16 */
    cudaEvent_t ev0, ev1;
    cublasLtHandle_t lt;
    int gemm_mode;                /* enum kvs_cuda_gemm: how matmuls that skip the decode GEMM run */
    int gemm_default;             /* gemm_mode at create (KVS_CUDA_GEMM, KVS_CUDA_GEMM_TUNE) */
    int gemm_splitk;              /* 1: the timing also tries split-K variants (KVS_CUDA_GEMM_SPLITK=0: no) */
    struct gemm_tuning *tune;     /* the timed cuBLASLt picks (see the GEMM section) */
    int skinny_max;               /* matmuls of n <= skinny_max rows use the decode GEMM (cuda_skinny.h),
                                   * larger ones cuBLAS; KVS_CUDA_SKINNY_MAX (0: cuBLAS always) */
    int skinny_default;           /* skinny_max at create */
    struct kvs_cu_dgemm_ws dg;    /* the wgmma decode GEMM's split-K scratch (allocated at create on
                                   * compute 9.x devices; dg.ws NULL elsewhere: that kernel is not used) */
    int attn_splits;              /* context splits forced on the attention (benchmark comparisons,
                                   * KVS_CUDA_ATTN_SPLITS); 0 = automatic (cuda_attention.cu) */
    int batch_invariant;          /* the decode attention's batch-invariant split plan (and, process-
                                   * wide, the decode GEMM's bit 512): kvs_cuda_set_batch_invariant */
    int bi_env;                   /* KVS_CUDA_BATCH_INVARIANT was set: it overrides the config */
    int dec_attn;                 /* decode attention kernel forced (kvs_cuda_set_dec_attn); -1 =
                                   * KVS_CUDA_DEC_ATTN or automatic (cuda_attn_decode.cu) */
    struct kvs_dbuf *bufs;        /* live buffers and weights, released by cu_free */
    struct kvs_dweight *weights;
    void *tp_comm;                /* tensor parallelism: this rank's NCCL communicator (cuda_tp.cu) or NULL */
    int32_t *fetch[2];            /* pinned host fetch areas [KVS_FETCH_MAX] (backend.h fetch_begin) */
    cudaEvent_t fetch_ev[2];      /* recorded behind each area's copy */
};
template <typename T> static inline void list_add(T **head, T *x)
{
    x->prev = NULL;
    x->next = *head;
    if (*head) (*head)->prev = x;
    *head = x;
}
template <typename T> static inline void list_del(T **head, T *x)
{
    if (x->prev) x->prev->next = x->next; else *head = x->next;
    if (x->next) x->next->prev = x->prev;
}

/* the bf16 mirror of a matmul input (see xh_src): forget it when its buffer is written */
static inline void xh_forget(struct kvs_backend *b, const void *d)
{
    if (b->xh_src == d) b->xh_src = NULL;
}

/* an op about to write n elements of fp32 output to d: returns where to put their bf16 copy
 * (NULL when it does not fit) and records it as the mirror of d. The two buffers alternate, so
 * the mirror an op reads (claimed before) is never the one it writes. */
static inline bf16 *xh_claim(struct kvs_backend *b, const void *d, size_t n)
{
    if (n > b->xh_cap) {
        xh_forget(b, d);
        return NULL;
    }
    b->xh = b->xh == b->xh_buf[0] ? b->xh_buf[1] : b->xh_buf[0];
    b->xh_src = d;
    b->xh_n = n;
    return b->xh;
}

static inline size_t kind_size(enum kvs_buf_kind k)
{
    return k == KVS_BUF_KV ? sizeof(bf16) : 4;
}

/* blocks for a grid-stride loop over n elements */
static inline int grid_for(size_t n, int threads)
{
    size_t g = (n + (size_t)threads - 1) / (size_t)threads;
    return (int)(g > 65535u * 16u ? 65535u * 16u : (g ? g : 1));
}

/* static inline: 1 when (rows, cols) is among the count shapes of list */
static inline int shape_listed(const int64_t (*list)[2], int count, int64_t rows, int64_t cols)
{
    for (int i = 0; i < count; i++)
        if (list[i][0] == rows && list[i][1] == cols) return 1;
    return 0;
}

/* RoPE of q and k and the K/V cache write of each row (k_rope_kv_write, cuda_ops.cu), reading q,
 * k and v from their own buffers (rope_kv_write: in place) or from the joint output of a fused
 * q/k/v GEMM (matmul_rope_kv_write: + bias, and v copied to its buffer too) */
struct rkv_args {
    const float *qs, *ks, *vs;    /* sources of row t: qs + t * ldq etc. (qs == q: in place) */
    int ldq, ldk, ldv;
    const float *bq, *bk, *bv;    /* biases added before the rotation, or NULL */
    float *q, *k, *v;             /* rotated q, k; v (NULL: left alone) */
    const int32_t *pos, *slots;
    const float *inv_freq;
    int nh, nkv, hd, bs;
    bf16 *kc, *vc;
    int trig;                     /* kvs_cu_pdl_early() (set by kvs_cu_launch_rope_kv_write) */
};

/* ---- cuda_backend.cu ---- */
/* cudaMalloc of bytes (16 for 0); NULL on out-of-memory (the runtime's error cleared) */
void *kvs_cu_dev_alloc(size_t bytes);
/* n uniform values in [-scale, scale) from seed into y (device), on the backend's stream */
void kvs_cu_fill_bf16(struct kvs_backend *b, bf16 *y, size_t n, float scale, uint64_t seed);

/* ---- cuda_gemm.cu ---- */
/* times the GEMM shapes of the weights uploaded since the last call (first alloc after a load) */
void kvs_cu_gemm_pretune_pending(struct kvs_backend *b);
/* one log line for the pre-tuning of a model load (at the first alloc after it, and at free) */
void kvs_cu_gemm_tune_report(struct kvs_backend *b);
/* the bf16 copy of x [nx] that a GEMM reads: the mirror when it is x's, else converted now */
const bf16 *kvs_cu_gemm_input(struct kvs_backend *b, const struct kvs_dbuf *x, size_t nx);
int kvs_cu_op_fuse_weights(struct kvs_backend *b, struct kvs_dweight *const *w, int n);
void kvs_cu_op_matmul(struct kvs_backend *b, const struct kvs_dbuf *x, const struct kvs_dweight *w,
                      const struct kvs_dweight *bias, int n, int in, int out, struct kvs_dbuf *y);
void kvs_cu_op_matmul_multi(struct kvs_backend *b, const struct kvs_dbuf *x, int n_parts,
                            const struct kvs_dweight *const *w, const struct kvs_dweight *const *bias, int n, int in,
                            const int *out, struct kvs_dbuf *const *y);
void kvs_cu_op_matmul_swiglu(struct kvs_backend *b, const struct kvs_dbuf *x, const struct kvs_dweight *wg,
                             const struct kvs_dweight *wu, int n, int in, int ff, struct kvs_dbuf *gate,
                             struct kvs_dbuf *up);
void kvs_cu_op_matmul_swiglu_down(struct kvs_backend *b, const struct kvs_dbuf *x, const struct kvs_dweight *wg,
                                  const struct kvs_dweight *wu, const struct kvs_dweight *wd, int n, int in, int ff,
                                  struct kvs_dbuf *gate, struct kvs_dbuf *up, struct kvs_dbuf *y);
void kvs_cu_op_matmul_rope_kv_write(struct kvs_backend *b, const struct kvs_dbuf *x,
                                    const struct kvs_dweight *const *w, const struct kvs_dweight *const *bias, int n,
                                    int in, struct kvs_dbuf *q, struct kvs_dbuf *k, struct kvs_dbuf *v,
                                    const struct kvs_dbuf *pos, const struct kvs_dbuf *inv_freq,
                                    const struct kvs_dbuf *slots, int n_heads, int n_kv_heads, int head_dim,
                                    int block_size, struct kvs_dbuf *kc, struct kvs_dbuf *vc);

/* ---- cuda_ops.cu ---- */
/* launches k_rope_kv_write for n rows; kvs_cu_rkv_common fills a's fields shared by both callers */
void kvs_cu_launch_rope_kv_write(struct kvs_backend *b, struct rkv_args *a, int n);
void kvs_cu_rkv_common(struct rkv_args *a, const struct kvs_dbuf *pos, const struct kvs_dbuf *inv_freq,
                       const struct kvs_dbuf *slots, int n_heads, int n_kv_heads, int head_dim, int block_size,
                       struct kvs_dbuf *kc, struct kvs_dbuf *vc);
void kvs_cu_op_embed(struct kvs_backend *b, const struct kvs_dweight *emb, const struct kvs_dbuf *tokens, int n,
                     int dim, struct kvs_dbuf *out);
void kvs_cu_op_rmsnorm(struct kvs_backend *b, const struct kvs_dbuf *x, const struct kvs_dweight *w, float eps, int n,
                       int dim, struct kvs_dbuf *out);
void kvs_cu_op_add_rmsnorm(struct kvs_backend *b, struct kvs_dbuf *res, const struct kvs_dbuf *delta,
                           const struct kvs_dweight *w, float eps, int n, int dim, struct kvs_dbuf *out);
void kvs_cu_op_head_rmsnorm(struct kvs_backend *b, struct kvs_dbuf *x, const struct kvs_dweight *w, float eps, int n,
                            int n_heads, int head_dim);
void kvs_cu_op_rope(struct kvs_backend *b, struct kvs_dbuf *x, const struct kvs_dbuf *pos, const struct kvs_dbuf *rot,
                    const struct kvs_dbuf *inv_freq, int n, int n_heads, int head_dim);
void kvs_cu_op_kv_write(struct kvs_backend *b, const struct kvs_dbuf *k, const struct kvs_dbuf *v,
                        const struct kvs_dbuf *slots, int n, int n_kv_heads, int head_dim, int block_size,
                        struct kvs_dbuf *kc, struct kvs_dbuf *vc);
void kvs_cu_op_rope_kv_write(struct kvs_backend *b, struct kvs_dbuf *q, struct kvs_dbuf *k, const struct kvs_dbuf *v,
                             const struct kvs_dbuf *pos, const struct kvs_dbuf *inv_freq, const struct kvs_dbuf *slots,
                             int n, int n_heads, int n_kv_heads, int head_dim, int block_size, struct kvs_dbuf *kc,
                             struct kvs_dbuf *vc);
void kvs_cu_op_attention(struct kvs_backend *b, const struct kvs_dbuf *q, const struct kvs_dbuf *kc,
                         const struct kvs_dbuf *vc, const struct kvs_attn_meta *m, int n, int n_heads, int n_kv_heads,
                         int head_dim, int block_size, float scale, struct kvs_dbuf *out);
void kvs_cu_op_swiglu(struct kvs_backend *b, const struct kvs_dbuf *gate, const struct kvs_dbuf *up, int n, int ff,
                      struct kvs_dbuf *out);
void kvs_cu_op_gather_rows(struct kvs_backend *b, const struct kvs_dbuf *x, const struct kvs_dbuf *rows, int m,
                           int dim, struct kvs_dbuf *out);
void kvs_cu_op_kv_copy_block(struct kvs_backend *b, struct kvs_dbuf *kc, struct kvs_dbuf *vc, int src, int dst,
                             int n_kv_heads, int block_size, int head_dim);
void kvs_cu_op_argmax_rows(struct kvs_backend *b, const struct kvs_dbuf *logits, int m, int vocab,
                           struct kvs_dbuf *out, size_t out_off);
void kvs_cu_op_argmax_rows_val(struct kvs_backend *b, const struct kvs_dbuf *logits, int m, int vocab,
                               struct kvs_dbuf *out, struct kvs_dbuf *vals, size_t out_off);
void kvs_cu_op_ids_to_tokens(struct kvs_backend *b, const struct kvs_dbuf *ids, const struct kvs_dbuf *pairs, int n,
                             struct kvs_dbuf *tokens);

/* ---- kv_span.cu (backend.h's KV-strategy primitives) ---- */
void kvs_cu_op_attention_spans(struct kvs_backend *b, const struct kvs_dbuf *q, const struct kvs_dbuf *kc,
                               const struct kvs_dbuf *vc, const struct kvs_attn_meta *m,
                               const struct kvs_span_list *sp, int n, int n_heads, int n_kv_heads, int head_dim,
                               int block_size, float scale, struct kvs_dbuf *out, struct kvs_dbuf *lse);
void kvs_cu_op_attn_merge(struct kvs_backend *b, struct kvs_dbuf *o_a, struct kvs_dbuf *lse_a,
                          const struct kvs_dbuf *o_b, const struct kvs_dbuf *lse_b, int n, int n_heads, int head_dim);

/* ---- cuda_tp.cu (backend.h's tensor-parallel ops; NCCL opened at run time) ---- */
int kvs_cu_op_tp_group(struct kvs_backend *const *bs, int n, size_t max_elems, char *err, size_t errlen);
void kvs_cu_op_allreduce_sum(struct kvs_backend *b, struct kvs_dbuf *buf, size_t n);
/* releases b's communicator (free op) */
void kvs_cu_tp_release(struct kvs_backend *b);

#endif
