/* cuda_gemm.cu: the matmuls of the CUDA backend (matmul, matmul_multi, the SwiGLU fusions,
 * matmul_rope_kv_write, fuse_weights) and how each picks its GEMM.
 *
 * Decode-sized batches (n <= skinny_max) use the decode GEMM of cuda_skinny.cu (tensor cores,
 * weights streamed once; q/k/v in one launch, gate/up with SwiGLU in its epilogue); larger ones
 * cuBLASLt (cublasLtMatmul), bf16 x bf16 -> fp32 output, CUBLAS_COMPUTE_32F, with the algorithm
 * picked per shape by timing cuBLASLt's heuristic candidates (up to 256 rows; timed when a new
 * weight shape is uploaded, at the decode graphs' row counts, else on the shape's first call
 * outside a graph capture; row counts that are no graph's take the pick of the next larger one,
 * untimed, so mixed steps never stall; the timing also tries split-K variants of the first
 * candidates, KVS_CUDA_GEMM_SPLITK=0: not; KVS_CUDA_GEMM_TUNE=0: the heuristic's first pick
 * always). KVS_CUDA_GEMM=ex keeps the former cublasGemmEx path for comparisons.
 * Fused weights (fuse_weights; the runner lays out each layer's q/k/v and gate/up so at load):
 * above the decode GEMM's rows, q/k/v run as one GEMM (up to GEMM_TUNE_MAX_N rows, into the
 * fuse_ws scratch, whose rows go straight to the RoPE and cache write in matmul_rope_kv_write
 * or are split into q, k, v in matmul_multi) and gate/up as one bf16-output GEMM; alone, a
 * k or v projection at 32-128 rows covers 8-16 tiles of an H100's 132 SMs.
 * A timed pick may differ between two runs of the server (timing noise), so GEMM results are
 * reproducible within one backend's life (but a graph recorded before its shape was timed keeps
 * the first pick), and across runs only with KVS_CUDA_GEMM_TUNE=0.
 */
#include <climits>

#include "kernels/cuda/cuda_internal.cuh"

/* ---- kernels of the GEMM paths -------------------------------------------------------------- */

__global__ void k_f32_to_bf16(const float *x, bf16 *y, size_t n)
{
    grid_dep_wait(); /* cuda_launch.h: the previous kernel's output is ready */
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        y[i] = __float2bfloat16(x[i]);
}

/* SwiGLU of bf16 gate and up (matmul_swiglu's cuBLAS path), 8 elements a thread: out (fp32) and
 * outh (the bf16 copy the down projection reads). n8 = elements / 8; g, u, out, outh 16-byte
 * aligned. */
__global__ void k_swiglu_h(const uint4 *g, const uint4 *u, size_t n8, int ff8, int ld8, float4 *out, uint4 *outh)
{
    grid_dep_wait(); /* cuda_launch.h: the previous kernel's output is ready */
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n8; i += (size_t)gridDim.x * blockDim.x) {
        const size_t at = i / (size_t)ff8 * (size_t)ld8 + i % (size_t)ff8; /* row i / ff8 of g and u */
        const uint4 gw = g[at], uw = u[at];
        const uint32_t gv[4] = {gw.x, gw.y, gw.z, gw.w}, uv[4] = {uw.x, uw.y, uw.z, uw.w};
        float y[8];
        uint32_t h[4];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const float2 a = __bfloat1622float2(*(const __nv_bfloat162 *)&gv[j]);
            const float2 c = __bfloat1622float2(*(const __nv_bfloat162 *)&uv[j]);
            y[2 * j] = a.x / (1.0f + expf(-a.x)) * c.x;
            y[2 * j + 1] = a.y / (1.0f + expf(-a.y)) * c.y;
            const __nv_bfloat162 p = __floats2bfloat162_rn(y[2 * j], y[2 * j + 1]);
            h[j] = *(const uint32_t *)&p;
        }
        if (out) { /* NULL: only the bf16 copy is wanted (matmul_swiglu_down) */
            out[2 * i] = make_float4(y[0], y[1], y[2], y[3]);
            out[2 * i + 1] = make_float4(y[4], y[5], y[6], y[7]);
        }
        outh[i] = make_uint4(h[0], h[1], h[2], h[3]);
    }
}

/* matmul_multi over fused weights: the parts of a joint GEMM output src [n][total] (part p: the
 * columns after those of parts < p) into their own buffers y[p] [n][out[p]], + bias[p] where
 * given. One block a row and part; every out[p] is a multiple of 4 (float4 copies). */
struct split_args {
    const float *src;
    int total, n_parts;
    int out[KVS_SKINNY_MAX_PARTS];
    float *y[KVS_SKINNY_MAX_PARTS];
    const float *bias[KVS_SKINNY_MAX_PARTS];
};

__global__ void k_split_cols(struct split_args a)
{
    grid_dep_wait(); /* cuda_launch.h: the GEMM's output is ready */
    const size_t t = blockIdx.x;
    const int p = blockIdx.y;
    int c0 = 0;
    for (int i = 0; i < p; i++) c0 += a.out[i];
    const float4 *src = (const float4 *)(a.src + t * (size_t)a.total + c0);
    const int o4 = a.out[p] / 4;
    float4 *y = (float4 *)(a.y[p] + t * (size_t)a.out[p]);
    const float4 *bias = (const float4 *)a.bias[p];
    for (int i = threadIdx.x; i < o4; i += blockDim.x) {
        float4 v = src[i];
        if (bias) {
            const float4 c = bias[i];
            v.x += c.x;
            v.y += c.y;
            v.z += c.z;
            v.w += c.w;
        }
        y[i] = v;
    }
}

/* reads n16 x 16 bytes (nothing is written: the L2 is left holding clean lines of p) */
__global__ void k_l2_flush(const uint4 *p, size_t n16, unsigned *sink)
{
    unsigned acc = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n16; i += (size_t)gridDim.x * blockDim.x) {
        const uint4 v = __ldcg(p + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9e3779b9u) *sink = acc; /* keeps the loads; practically never taken */
}

/* holds the stream for ns nanoseconds (one thread): the GEMM timing queues its runs behind it, so
 * the events time the GPU's back-to-back runs, not the host's launch rate (a k/v projection
 * takes about as long on the GPU as cublasLtMatmul takes to enqueue it) */
__global__ void k_spin(uint64_t ns)
{
    uint64_t t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
}

__global__ void k_add_bias(float *y, const float *bias, size_t n, int out)
{
    grid_dep_wait(); /* cuda_launch.h: the previous kernel's output is ready */
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        y[i] += bias[i % out];
}

/* the output kinds a weight's GEMMs run with (bits 1 << enum gemm_out): fp32, and bf16 too for
 * more rows than columns (the gate and up projections in matmul_swiglu) */
static unsigned weight_kinds(int64_t rows, int64_t cols)
{
    return 1u << GEMM_F32 | (rows > cols ? 1u << GEMM_BF16 : 0u);
}

/* The bf16 copy of x [n][in] that a GEMM reads: the mirror when it is x's, else converted now. */
const bf16 *kvs_cu_gemm_input(struct kvs_backend *b, const struct kvs_dbuf *x, size_t nx)
{
    if (b->xh_src != x->d || b->xh_n != nx) {
        bf16 *h = xh_claim(b, x->d, nx);
        KVS_ASSERT(h);
        CUDA_CHECK(kvs_cu_launch(k_f32_to_bf16, grid_for(nx, 256), 256, 0, b->stream, (const float *)x->d, h, nx));
        LAUNCH_CHECK();
    }
    return b->xh;
}

/* ---- cuBLAS / cuBLASLt GEMMs ---------------------------------------------------------------- */

/* The former path (KVS_CUDA_GEMM=ex), kept for A/B comparisons: y = xh W^T (+ y). Column-major
 * view: y^T[out][n] = W[out][in] (stored column-major as in x out, so op T) * x^T[in][n]. */
static void gemm_ex(struct kvs_backend *b, const bf16 *xh, const bf16 *w, int n, int in, int out, void *y,
                    enum gemm_out kind)
{
    const float one = 1.0f, beta = kind == GEMM_F32_ACC ? 1.0f : 0.0f;
    CUBLAS_CHECK(cublasGemmEx(b->blas, CUBLAS_OP_T, CUBLAS_OP_N, out, n, in, &one, w, CUDA_R_16BF, in, xh,
                              CUDA_R_16BF, in, &beta, y, kind == GEMM_BF16 ? CUDA_R_16BF : CUDA_R_32F, out,
                              CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

/* The cuBLASLt description of the same product (the column-major view of gemm_ex): A = W with op
 * T, B = x, C = D = y (fp32, or bf16 for GEMM_BF16), fp32 accumulation and scale. Initialised in
 * place (no allocation), so it can be rebuilt on every call. */
struct gemm_lt_desc {
    cublasLtMatmulDescOpaque_t op;
    cublasLtMatrixLayoutOpaque_t a, b, c;
};

static void gemm_lt_describe(struct gemm_lt_desc *d, int n, int in, int out, enum gemm_out kind)
{
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    CUBLAS_CHECK(cublasLtMatmulDescInit(&d->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(&d->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(&d->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    CUBLAS_CHECK(cublasLtMatrixLayoutInit(&d->a, CUDA_R_16BF, (uint64_t)in, (uint64_t)out, in));
    CUBLAS_CHECK(cublasLtMatrixLayoutInit(&d->b, CUDA_R_16BF, (uint64_t)in, (uint64_t)n, in));
    CUBLAS_CHECK(cublasLtMatrixLayoutInit(&d->c, kind == GEMM_BF16 ? CUDA_R_16BF : CUDA_R_32F, (uint64_t)out,
                                          (uint64_t)n, out));
}

/* the largest power of two up to 256 dividing every pointer: cuBLASLt's heuristic assumes
 * 256-byte aligned operands unless told otherwise, and a pick is only valid for the alignment it
 * was chosen for (so the alignment is part of a pick's key) */
static int gemm_align(const void *p0, const void *p1, const void *p2)
{
    uintptr_t bits = (uintptr_t)p0 | (uintptr_t)p1 | (uintptr_t)p2;
    int align = 256;
    while (align > 1 && bits % (uintptr_t)align) align /= 2;
    return align;
}

/* Up to max heuristic candidates for d (best estimate first) that fit the fixed workspace;
 * returns how many (0: cuBLASLt has no algorithm for this shape and alignment). */
static int gemm_lt_candidates(struct kvs_backend *b, struct gemm_lt_desc *d, int align,
                              cublasLtMatmulHeuristicResult_t *res, int max)
{
    cublasLtMatmulPreferenceOpaque_t pref;
    const uint64_t ws = BLAS_WS_BYTES;
    const uint32_t al = (uint32_t)align;
    CUBLAS_CHECK(cublasLtMatmulPreferenceInit(&pref));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(&pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(&pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al, sizeof al));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(&pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al, sizeof al));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(&pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al, sizeof al));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(&pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al, sizeof al));
    int count = 0;
    cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(b->lt, &d->op, &d->a, &d->b, &d->c, &d->c, &pref, max, res, &count);
    if (s == CUBLAS_STATUS_NOT_SUPPORTED) return 0; /* no algorithm at all: the caller falls back */
    CUBLAS_CHECK(s);
    /* keep the usable ones, in order */
    int k = 0;
    for (int i = 0; i < count; i++)
        if (res[i].state == CUBLAS_STATUS_SUCCESS && res[i].workspaceSize <= BLAS_WS_BYTES) res[k++] = res[i];
    return k;
}

/* Split-K variants of the first GEMM_SPLITK_BASES candidates in res[0..count) that run unsplit
 * and support it, appended to res up to max; returns the new count. At 16-256 rows a projection
 * with few output columns covers few tiles (k/v of the 8B models: 1024 columns, 8-16 tiles of an
 * H100's 132 SMs), so one weight read is spread over few SMs; splitting the inner dimension
 * gives each SM a share (PyTorch's cuBLAS runs the k/v GEMM with split-K, faster than the
 * unsplit picks: bench/RESULTS.md). The heuristic rarely proposes splits itself, so they are timed as
 * extra candidates. fp32 outputs are reduced in place (the parts added in a fixed order:
 * deterministic, no extra pass) or through an fp32 workspace; bf16 outputs only through the
 * fp32 workspace, so the sum is rounded once. */
static int gemm_splitk_variants(struct kvs_backend *b, struct gemm_lt_desc *d, enum gemm_out kind,
                                cublasLtMatmulHeuristicResult_t *res, int count, int max)
{
    static const uint32_t splits[] = {2, 4, 8, 16};
    const uint32_t schemes[2] = {CUBLASLT_REDUCTION_SCHEME_INPLACE, CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE};
    const int base = count;
    int bases = 0;
    for (int i = 0; i < base && bases < GEMM_SPLITK_BASES; i++) {
        size_t sz = 0;
        int32_t support = 0;
        uint32_t cur = 1, mask = 0;
        if (cublasLtMatmulAlgoCapGetAttribute(&res[i].algo, CUBLASLT_ALGO_CAP_SPLITK_SUPPORT, &support, sizeof support,
                                              &sz) != CUBLAS_STATUS_SUCCESS || !support)
            continue;
        if (cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &cur, sizeof cur,
                                                 &sz) != CUBLAS_STATUS_SUCCESS || cur > 1)
            continue;
        if (cublasLtMatmulAlgoCapGetAttribute(&res[i].algo, CUBLASLT_ALGO_CAP_REDUCTION_SCHEME_MASK, &mask,
                                              sizeof mask, &sz) != CUBLAS_STATUS_SUCCESS)
            continue;
        bases++;
        for (int si = 0; si < 2; si++) {
            const uint32_t scheme = schemes[si];
            if (!(mask & scheme) || (scheme == CUBLASLT_REDUCTION_SCHEME_INPLACE && kind == GEMM_BF16)) continue;
            for (size_t k = 0; k < sizeof splits / sizeof splits[0]; k++) {
                if (count == max) return count;
                cublasLtMatmulHeuristicResult_t v = res[i];
                if (cublasLtMatmulAlgoConfigSetAttribute(&v.algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splits[k],
                                                         sizeof splits[k]) != CUBLAS_STATUS_SUCCESS ||
                    cublasLtMatmulAlgoConfigSetAttribute(&v.algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &scheme,
                                                         sizeof scheme) != CUBLAS_STATUS_SUCCESS)
                    continue;
                /* the check fills in the workspace the variant needs (and leaves v.algo alone) */
                if (cublasLtMatmulAlgoCheck(b->lt, &d->op, &d->a, &d->b, &d->c, &d->c, &v.algo, &v) !=
                        CUBLAS_STATUS_SUCCESS ||
                    v.workspaceSize > BLAS_WS_BYTES)
                    continue;
                v.state = CUBLAS_STATUS_SUCCESS;
                res[count++] = v;
            }
        }
    }
    return count;
}

/* the split count of an algorithm (1: unsplit), for the log */
static unsigned gemm_algo_splits(const cublasLtMatmulAlgo_t *algo)
{
    uint32_t k = 1;
    size_t sz = 0;
    if (cublasLtMatmulAlgoConfigGetAttribute(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &k, sizeof k, &sz) !=
        CUBLAS_STATUS_SUCCESS)
        return 1;
    return k ? k : 1;
}

/* one cuBLASLt GEMM: y = xh W^T (+ y for GEMM_F32_ACC); returns cuBLASLt's status */
static cublasStatus_t gemm_lt_run(struct kvs_backend *b, struct gemm_lt_desc *d, const cublasLtMatmulAlgo_t *algo,
                                  const bf16 *xh, const bf16 *w, void *y, enum gemm_out kind)
{
    const float one = 1.0f, beta = kind == GEMM_F32_ACC ? 1.0f : 0.0f;
    return cublasLtMatmul(b->lt, &d->op, &one, w, &d->a, xh, &d->b, &beta, y, &d->c, y, &d->c, algo, b->blas_ws,
                          BLAS_WS_BYTES, b->stream);
}

static int gemm_capturing(struct kvs_backend *b)
{
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    CUDA_CHECK(cudaStreamIsCapturing(b->stream, &cs));
    return cs != cudaStreamCaptureStatusNone;
}

static unsigned gemm_hash(int n, int in, int out, int kind, int align)
{
    uint64_t h = (uint64_t)(uint32_t)n * 0x9E3779B97F4A7C15ull;
    h ^= ((uint64_t)(uint32_t)in << 32 | (uint32_t)out) * 0xBF58476D1CE4E5B9ull;
    h ^= (uint64_t)(kind * 512 + align) * 0x94D049BB133111EBull;
    h ^= h >> 29;
    return (unsigned)(h % GEMM_PLAN_SLOTS);
}

/* The slot of the pick for this key: the one holding it (n != 0), else the free slot where it
 * would go (n == 0); NULL when it is not there and the table is full. */
static struct gemm_plan *gemm_plan_slot(struct kvs_backend *b, int n, int in, int out, int kind, int align)
{
    struct gemm_tuning *t = b->tune;
    for (unsigned i = gemm_hash(n, in, out, kind, align);; i = (i + 1) % GEMM_PLAN_SLOTS) {
        struct gemm_plan *p = &t->plans[i];
        if (p->n == 0) break;
        if (p->n == n && p->in == in && p->out == out && p->kind == kind && p->align == align) return p;
    }
    if (t->n_plans >= GEMM_PLAN_MAX) {
        if (!t->full_warned)
            kvs_log(KVS_LOG_WARN, "cuda: %d GEMM shapes timed; further ones take cuBLASLt's first pick", t->n_plans);
        t->full_warned = 1;
        return NULL;
    }
    unsigned i = gemm_hash(n, in, out, kind, align);
    while (t->plans[i].n != 0) i = (i + 1) % GEMM_PLAN_SLOTS;
    return &t->plans[i];
}

/* Times the candidates of d on the given operands, writing y (which the caller may overwrite:
 * its own output, or a scratch), and stores the pick in the free slot p under the key. Keeps the
 * heuristic's first pick unless another takes at most GEMM_MIN_GAIN of its time; a candidate's
 * time is its median run. Each timed run starts with the weight out of the L2 (a read of twice
 * the L2's size before it), as in a decode step, which streams every weight from memory once:
 * timed back to back, a weight that fits the L2 (k/v projections, 8 MB in the 8B models) would be
 * read from there, and the pick would suit a GEMM that never happens (without device memory for
 * the flush, the runs follow each other). Synchronises the stream: never while it is being
 * captured. Returns 0, or -ENOENT when cuBLASLt has no algorithm for the shape (p stays free). */
static int gemm_tune(struct kvs_backend *b, struct gemm_lt_desc *d, struct gemm_plan *p, int n, int in, int out,
                     enum gemm_out kind, int align, const bf16 *xh, const bf16 *w, void *y)
{
    cublasLtMatmulHeuristicResult_t res[GEMM_CANDIDATES];
    int count = gemm_lt_candidates(b, d, align, res, GEMM_HEURISTIC);
    if (count == 0) return -ENOENT;
    const int heuristic = count;
    if (b->gemm_splitk) count = gemm_splitk_variants(b, d, kind, res, count, GEMM_CANDIDATES);
    int l2 = 0;
    CUDA_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, b->device));
    const size_t flush_bytes = (size_t)2 * (size_t)l2 / 16 * 16;
    uint4 *flush = flush_bytes ? (uint4 *)kvs_cu_dev_alloc(flush_bytes + 16) : NULL;
    if (flush) CUDA_CHECK(cudaMemsetAsync(flush, 0, flush_bytes + 16, b->stream));
    cudaEvent_t *ev = b->tune->ev;
    float ms[GEMM_CANDIDATES] = {0};
    int best = -1;
    for (int i = 0; i < count; i++) {
        ms[i] = -1.0f; /* a candidate the launch rejects (heuristics may list some) is skipped */
        cublasStatus_t s = CUBLAS_STATUS_SUCCESS;
        for (int r = 0; r < GEMM_WARMUP && s == CUBLAS_STATUS_SUCCESS; r++)
            s = gemm_lt_run(b, d, &res[i].algo, xh, w, y, kind);
        k_spin<<<1, 1, 0, b->stream>>>(GEMM_SPIN_NS);
        LAUNCH_CHECK();
        int runs = 0;
        for (int r = 0; r < GEMM_TIMED && s == CUBLAS_STATUS_SUCCESS; r++) {
            if (flush) {
                k_l2_flush<<<b->n_sms * 4, 512, 0, b->stream>>>(flush, flush_bytes / 16, (unsigned *)(flush + flush_bytes / 16));
                LAUNCH_CHECK();
            }
            CUDA_CHECK(cudaEventRecord(ev[2 * r], b->stream));
            s = gemm_lt_run(b, d, &res[i].algo, xh, w, y, kind);
            CUDA_CHECK(cudaEventRecord(ev[2 * r + 1], b->stream));
            runs++;
        }
        if (runs > 0) CUDA_CHECK(cudaEventSynchronize(ev[2 * runs - 1]));
        if (s != CUBLAS_STATUS_SUCCESS) {
            kvs_log(KVS_LOG_DEBUG, "cuda: GEMM %d x %d x %d: candidate %d failed (%s), skipped", n, in, out, i,
                    cublasGetStatusString(s));
            continue;
        }
        /* the median run: a run now and then takes 2-3x as long (H100), which would decide a mean */
        float e[GEMM_TIMED];
        for (int r = 0; r < runs; r++) CUDA_CHECK(cudaEventElapsedTime(&e[r], ev[2 * r], ev[2 * r + 1]));
        for (int r = 1; r < runs; r++)
            for (int q = r; q > 0 && e[q] < e[q - 1]; q--) {
                const float tmp = e[q];
                e[q] = e[q - 1];
                e[q - 1] = tmp;
            }
        ms[i] = e[runs / 2];
        if (best < 0 || ms[i] < ms[best]) best = i;
    }
    if (flush) {
        CUDA_CHECK(cudaStreamSynchronize(b->stream));
        CUDA_CHECK(cudaFree(flush));
    }
    /* the first pick stays unless another is clearly faster (timing noise is about 1%) */
    int pick = 0;
    if (best > 0 && (ms[0] < 0.0f || ms[best] <= GEMM_MIN_GAIN * ms[0])) pick = best;
    p->n = n;
    p->in = in;
    p->out = out;
    p->kind = kind;
    p->align = align;
    p->differs = pick != 0;
    p->algo = res[pick].algo;
    b->tune->n_plans++;
    kvs_log(KVS_LOG_DEBUG, "cuda: GEMM %d x %d x %d%s: %d candidates (%d split-K), first %.1f us, pick #%d %.1f us (split %u)",
            n, in, out, kind == GEMM_F32_ACC ? " (accumulate)" : kind == GEMM_BF16 ? " (bf16 out)" : "", count,
            count - heuristic, ms[0] * 1e3f, pick, ms[pick] * 1e3f, gemm_algo_splits(&res[pick].algo));
    return 0;
}

static int gemm_is_bucket(int n)
{
    for (int i = 0; i < KVS_N_GRAPH_BUCKETS; i++)
        if (kvs_graph_buckets[i] == n) return 1;
    return 0;
}

/* Fills the free slot p (key n, in, out, kind, align) with the timed pick of the next larger
 * graph row count of the same shape, when there is one and cuBLASLt accepts it for n rows, else
 * with the heuristic's first pick; returns 1, or 0 when cuBLASLt has no algorithm at all. */
static int gemm_borrow(struct kvs_backend *b, struct gemm_lt_desc *d, struct gemm_plan *p, int n, int in, int out,
                       enum gemm_out kind, int align)
{
    const struct gemm_plan *from = NULL;
    for (int i = 0; i < KVS_N_GRAPH_BUCKETS && !from; i++) {
        const int nb = kvs_graph_buckets[i];
        if (nb <= n || nb > GEMM_TUNE_MAX_N) continue;
        const struct gemm_plan *q = gemm_plan_slot(b, nb, in, out, kind, align);
        if (q && q->n) from = q;
    }
    cublasLtMatmulHeuristicResult_t r;
    if (from && cublasLtMatmulAlgoCheck(b->lt, &d->op, &d->a, &d->b, &d->c, &d->c, &from->algo, &r) ==
                    CUBLAS_STATUS_SUCCESS &&
        r.workspaceSize <= BLAS_WS_BYTES) {
        p->algo = from->algo;
        p->differs = from->differs;
    } else if (gemm_lt_candidates(b, d, align, &r, 1) == 1) {
        p->algo = r.algo;
        p->differs = 0;
    } else {
        return 0;
    }
    p->n = n;
    p->in = in;
    p->out = out;
    p->kind = kind;
    p->align = align;
    b->tune->n_plans++;
    return 1;
}

/* y = xh W^T (+ y) through cuBLASLt with the timed pick for the shape (timing it now when it is
 * new, its row count is a decode graph's, and the stream is not being captured; other row counts
 * borrow the next larger one's pick: gemm_borrow), or the heuristic's first pick */
static void gemm_lt(struct kvs_backend *b, const bf16 *xh, const bf16 *w, int n, int in, int out, void *y,
                    enum gemm_out kind)
{
    struct gemm_lt_desc d;
    gemm_lt_describe(&d, n, in, out, kind);
    const int align = gemm_align(xh, w, y);
    const cublasLtMatmulAlgo_t *algo = NULL;
    if (b->gemm_mode == KVS_CUDA_GEMM_TUNED && n <= GEMM_TUNE_MAX_N) {
        struct gemm_plan *p = gemm_plan_slot(b, n, in, out, kind, align);
        if (p && p->n) {
            algo = &p->algo;
        } else if (p && !gemm_is_bucket(n)) {
            /* a row count no decode graph has (mixed steps: a few decodes and a short prompt):
             * never timed, so such a step does not stall */
            if (gemm_borrow(b, &d, p, n, in, out, kind, align)) algo = &p->algo;
        } else if (p && !gemm_capturing(b)) {
            /* the timing overwrites its output: y itself, unless y must be added to */
            const int acc = kind == GEMM_F32_ACC;
            void *yt = acc ? kvs_cu_dev_alloc((size_t)n * out * sizeof(float)) : y;
            if (yt) {
                if (acc) CUDA_CHECK(cudaMemsetAsync(yt, 0, (size_t)n * out * sizeof(float), b->stream));
                if (gemm_tune(b, &d, p, n, in, out, kind, align, xh, w, yt) == 0) algo = &p->algo;
                if (acc) {
                    CUDA_CHECK(cudaStreamSynchronize(b->stream));
                    CUDA_CHECK(cudaFree(yt));
                }
            }
        }
        /* while capturing, nothing can be timed: the first pick, not kept, so a later call
         * outside a capture times the shape */
    }
    cublasLtMatmulHeuristicResult_t first;
    if (!algo) {
        if (gemm_lt_candidates(b, &d, align, &first, 1) == 0) {
            /* no cuBLASLt algorithm for this shape and alignment: cublasGemmEx has its own fallbacks */
            gemm_ex(b, xh, w, n, in, out, y, kind);
            return;
        }
        algo = &first.algo;
    }
    CUBLAS_CHECK(gemm_lt_run(b, &d, algo, xh, w, y, kind));
}

/* y = xh W^T (+ y for GEMM_F32_ACC) (+ bias: fp32 outputs only) through cuBLAS(Lt) */
/* y = xh W^T (+ y for GEMM_F32_ACC) on the backend's cuBLAS path (gemm_mode), W [out][in] bf16 */
static void gemm_run(struct kvs_backend *b, const bf16 *xh, const bf16 *w, int n, int in, int out, void *y,
                     enum gemm_out kind)
{
    if (b->gemm_mode == KVS_CUDA_GEMM_EX) gemm_ex(b, xh, w, n, in, out, y, kind);
    else gemm_lt(b, xh, w, n, in, out, y, kind);
}

static void gemm_blas(struct kvs_backend *b, const bf16 *xh, const struct kvs_dweight *w,
                      const struct kvs_dweight *bias, int n, int in, int out, void *y, enum gemm_out kind)
{
    gemm_run(b, xh, w->h, n, in, out, y, kind);
    if (bias) {
        KVS_ASSERT(bias->is_vector && bias->cols == out && kind != GEMM_BF16);
        size_t ny = (size_t)n * out;
        CUDA_CHECK(kvs_cu_launch(k_add_bias, grid_for(ny, 256), 256, 0, b->stream, (float *)y, (const float *)bias->f, ny, out));
        LAUNCH_CHECK();
    }
}

/* Times the picks of a new weight shape at the decode graphs' row counts (kvs_graph_buckets) up to
 * GEMM_TUNE_MAX_N on the weight itself and a random x (the
 * real x is not known yet), outside any graph. Row counts the decode GEMM takes for every shape
 * (up to KVS_SKINNY_ALWAYS_N) are skipped (above, it leaves the launches its wgmma kernel would
 * split to cuBLAS: cuda_skinny.h), and so are those whose scratch would pass GEMM_PRETUNE_SCRATCH (the LM
 * head of a large vocabulary). kinds: a bit (1 << enum gemm_out) per output kind to time: fp32
 * for every weight, bf16 too for weights with more rows than columns (the [ff][dim] gate and up
 * projections, which matmul_swiglu runs with bf16 outputs; also some models' q projection).
 * w [rows][cols] bf16. Load time: allocates, synchronises. */
static void gemm_pretune(struct kvs_backend *b, const bf16 *w, int64_t rows, int64_t cols, unsigned kinds)
{
    struct gemm_tuning *t = b->tune;
    if (b->gemm_mode != KVS_CUDA_GEMM_TUNED || gemm_capturing(b)) return;
    if (shape_listed(t->pretuned, t->n_pretuned, rows, cols)) return;
    if (t->n_pretuned == GEMM_PRETUNE_SHAPES || rows > INT_MAX || cols > INT_MAX) return;
    t->pretuned[t->n_pretuned][0] = rows;
    t->pretuned[t->n_pretuned][1] = cols;
    t->n_pretuned++;
    const int in = (int)cols, out = (int)rows;
    const size_t row_bytes = (size_t)in * sizeof(bf16) + (size_t)out * sizeof(float);
    int max_n = 0;
    for (int i = 0; i < KVS_N_GRAPH_BUCKETS; i++) {
        const int n = kvs_graph_buckets[i];
        if (n <= GEMM_TUNE_MAX_N && (size_t)n * row_bytes <= GEMM_PRETUNE_SCRATCH) max_n = n;
    }
    if (max_n <= KVS_SKINNY_ALWAYS_N) return;
    double t0 = kvs_now();
    bf16 *x = (bf16 *)kvs_cu_dev_alloc((size_t)max_n * in * sizeof(bf16));
    float *y = x ? (float *)kvs_cu_dev_alloc((size_t)max_n * out * sizeof(float)) : NULL;
    if (!y) {
        kvs_log(KVS_LOG_WARN, "cuda: no device memory to time the GEMMs of a %d x %d weight; they take cuBLASLt's "
                              "first pick", out, in);
        if (x) CUDA_CHECK(cudaFree(x));
        return;
    }
    /* non-zero values: some kernels may take shortcuts on zeros */
    kvs_cu_fill_bf16(b, x, (size_t)max_n * in, 1.0f, 12345);
    LAUNCH_CHECK();
    int tuned = 0;
    static const enum gemm_out order[2] = {GEMM_F32, GEMM_BF16};
    for (int ki = 0; ki < 2; ki++) {
        const enum gemm_out kind = order[ki];
        if (!(kinds & (1u << kind))) continue;
        for (int i = 0; i < KVS_N_GRAPH_BUCKETS; i++) {
            const int n = kvs_graph_buckets[i];
            if (n <= KVS_SKINNY_ALWAYS_N || n > max_n) continue;
            const int align = gemm_align(x, w, y);
            struct gemm_plan *p = gemm_plan_slot(b, n, in, out, kind, align);
            if (!p || p->n) continue;
            struct gemm_lt_desc d;
            gemm_lt_describe(&d, n, in, out, kind);
            if (gemm_tune(b, &d, p, n, in, out, kind, align, x, w, y) != 0) continue;
            tuned++;
            t->log_differ += p->differs;
        }
    }
    CUDA_CHECK(cudaStreamSynchronize(b->stream));
    CUDA_CHECK(cudaFree(x));
    CUDA_CHECK(cudaFree(y));
    t->log_mats++;
    t->log_gemms += tuned;
    t->log_s += kvs_now() - t0;
}

/* gemm_pretune for each shape uploaded since the last alloc that some live unfused weight still
 * has (timed on that weight) */
void kvs_cu_gemm_pretune_pending(struct kvs_backend *b)
{
    struct gemm_tuning *t = b->tune;
    for (int i = 0; i < t->n_pending; i++) {
        const int64_t rows = t->pending[i][0], cols = t->pending[i][1];
        for (const struct kvs_dweight *w = b->weights; w; w = w->next)
            if (!w->is_vector && !w->store && w->rows == rows && w->cols == cols) {
                gemm_pretune(b, w->h, rows, cols, weight_kinds(rows, cols));
                break;
            }
    }
    t->n_pending = 0;
}

/* one line for the pre-tuning of a model load: called when something other than weight uploads
 * follows them (the runner's workspace allocation), and at free */
void kvs_cu_gemm_tune_report(struct kvs_backend *b)
{
    struct gemm_tuning *t = b->tune;
    if (t->log_mats == 0) return;
    kvs_log(KVS_LOG_INFO, "cuda: timed the cuBLASLt algorithms of %d GEMM shapes (%d weight shapes, the decode "
                          "graphs' row counts up to %d) in %.2f s; %d picks differ from the heuristic's first",
            t->log_gemms, t->log_mats, GEMM_TUNE_MAX_N, t->log_s, t->log_differ);
    t->log_mats = t->log_gemms = t->log_differ = 0;
    t->log_s = 0.0;
}

/* 1 when w[0..n) lie back to back, in order, in one storage of fuse_weights */
static int weights_adjacent(const struct kvs_dweight *const *w, int n)
{
    if (n < 2 || !w[0]->store) return 0;
    for (int p = 1; p < n; p++)
        if (w[p]->store != w[0]->store || w[p]->h != w[p - 1]->h + (size_t)(w[p - 1]->rows * w[p - 1]->cols))
            return 0;
    return 1;
}

/* backend.h. The joint copy is made before the parts' own memory is freed (a load-time peak of
 * one group's size). The joint shape is timed as the ops will run it: fp32 output when
 * matmul_multi's scratch can hold GEMM_TUNE_MAX_N rows of it (q/k/v), bf16 when it has more
 * rows than columns (gate/up in matmul_swiglu). */
int kvs_cu_op_fuse_weights(struct kvs_backend *b, struct kvs_dweight *const *w, int n)
{
    if (n < 2 || n > KVS_SKINNY_MAX_PARTS || gemm_capturing(b)) return -EINVAL;
    int64_t rows = 0;
    for (int p = 0; p < n; p++) {
        if (!w[p] || w[p]->is_vector || w[p]->store || w[p]->cols != w[0]->cols) return -EINVAL;
        for (int q = 0; q < p; q++)
            if (w[q] == w[p]) return -EINVAL;
        rows += w[p]->rows;
    }
    const int64_t cols = w[0]->cols;
    if (rows > INT_MAX || cols > INT_MAX) return -EINVAL;
    /* the scratch is allocated once, at its full size: a recorded graph may hold its address */
    const int for_multi = (size_t)GEMM_TUNE_MAX_N * (size_t)rows * sizeof(float) <= FUSE_WS_MAX;
    if (for_multi && !b->fuse_ws) {
        b->fuse_ws = (float *)kvs_cu_dev_alloc(FUSE_WS_MAX);
        if (!b->fuse_ws) return -ENOMEM;
        b->fuse_cap = FUSE_WS_MAX / sizeof(float);
    }
    bf16 *base = (bf16 *)kvs_cu_dev_alloc((size_t)rows * (size_t)cols * sizeof(bf16));
    if (!base) return -ENOMEM;
    struct wstore *st = (struct wstore *)kvs_xcalloc(1, sizeof *st);
    st->base = base;
    st->refs = n;
    CUDA_CHECK(cudaStreamSynchronize(b->stream)); /* the parts are not in use */
    bf16 *at = base;
    for (int p = 0; p < n; p++) {
        const size_t elems = (size_t)(w[p]->rows * cols);
        CUDA_CHECK(cudaMemcpyAsync(at, w[p]->h, elems * sizeof(bf16), cudaMemcpyDeviceToDevice, b->stream));
        CUDA_CHECK(cudaStreamSynchronize(b->stream));
        CUDA_CHECK(cudaFree(w[p]->h));
        w[p]->h = at;
        w[p]->store = st;
        at += elems;
    }
    gemm_pretune(b, base, rows, cols, (for_multi ? 1u << GEMM_F32 : 0u) | (rows > cols ? 1u << GEMM_BF16 : 0u));
    return 0;
}

/* Decode-sized batches (n <= skinny_max) go to the decode GEMM, which covers every part in one
 * launch; larger ones to cuBLAS, one call per part. Either way each part's result is what
 * matmul() alone gives. */
/* matmul_multi's set-up, shared with matmul_rope_kv_write: checks the shapes, forgets the
 * outputs' mirrors and returns the bf16 x that the GEMMs read */
static const bf16 *multi_begin(struct kvs_backend *b, const struct kvs_dbuf *x, int n_parts,
                               const struct kvs_dweight *const *w, const struct kvs_dweight *const *bias, int n,
                               int in, const int *out, struct kvs_dbuf *const *y)
{
    KVS_ASSERT(n_parts >= 1 && n_parts <= KVS_SKINNY_MAX_PARTS);
    KVS_ASSERT((size_t)n * in <= b->xh_cap);
    const bf16 *xh = kvs_cu_gemm_input(b, x, (size_t)n * in);
    for (int p = 0; p < n_parts; p++) {
        KVS_ASSERT(!w[p]->is_vector && w[p]->rows == out[p] && w[p]->cols == in);
        if (bias && bias[p]) KVS_ASSERT(bias[p]->is_vector && bias[p]->cols == out[p]);
        xh_forget(b, y[p]->d);
    }
    return xh;
}

/* 1 when the decode GEMM takes these parts (decode-sized batches) */
static int multi_skinny(struct kvs_backend *b, int n_parts, int n, int in, const int *out)
{
    return n <= b->skinny_max && kvs_cu_skinny_takes(n, in, out, n_parts, 0, b->dg.ws ? b->n_sms : 0);
}

/* 1 when parts laid out back to back (fuse_weights) run as one GEMM into the fuse_ws scratch,
 * [n][*total], every part's columns a multiple of 4: decode-sized batches only (the scratch holds
 * GEMM_TUNE_MAX_N rows); larger ones are compute bound, where separate GEMMs lose nothing */
static int multi_joint(struct kvs_backend *b, const struct kvs_dweight *const *w, int n_parts, int n,
                       const int *out, int *total)
{
    int quads = 1;
    *total = 0;
    for (int p = 0; p < n_parts; p++) {
        *total += out[p];
        quads &= out[p] % 4 == 0;
    }
    return n_parts > 1 && quads && weights_adjacent(w, n_parts) && (size_t)n * *total <= b->fuse_cap;
}

void kvs_cu_op_matmul_multi(struct kvs_backend *b, const struct kvs_dbuf *x, int n_parts,
                            const struct kvs_dweight *const *w, const struct kvs_dweight *const *bias, int n, int in,
                            const int *out, struct kvs_dbuf *const *y)
{
    if (n <= 0) return;
    const bf16 *xh = multi_begin(b, x, n_parts, w, bias, n, in, out, y);
    int total = 0;
    if (multi_skinny(b, n_parts, n, in, out)) {
        struct kvs_cu_skinny a = {};
        a.ws = b->dg.ws ? &b->dg : NULL;
        a.x = xh;
        a.n = n;
        a.in = in;
        a.n_parts = n_parts;
        for (int p = 0; p < n_parts; p++) {
            a.w[p] = w[p]->h;
            a.bias[p] = bias && bias[p] ? bias[p]->f : NULL;
            a.out[p] = out[p];
            a.y[p] = (float *)y[p]->d;
        }
        CUDA_CHECK(kvs_cu_skinny(&a, b->stream));
    } else if (multi_joint(b, w, n_parts, n, out, &total)) {
        /* one GEMM into the scratch, then each part's columns to its buffer */
        gemm_run(b, xh, w[0]->h, n, in, total, b->fuse_ws, GEMM_F32);
        struct split_args a = {};
        a.src = b->fuse_ws;
        a.total = total;
        a.n_parts = n_parts;
        for (int p = 0; p < n_parts; p++) {
            a.out[p] = out[p];
            a.y[p] = (float *)y[p]->d;
            a.bias[p] = bias && bias[p] ? bias[p]->f : NULL;
        }
        CUDA_CHECK(kvs_cu_launch(k_split_cols, dim3((unsigned)n, (unsigned)n_parts), 256, 0, b->stream, a));
        LAUNCH_CHECK();
    } else {
        for (int p = 0; p < n_parts; p++)
            gemm_blas(b, xh, w[p], bias ? bias[p] : NULL, n, in, out[p], y[p]->d, GEMM_F32);
    }
}

void kvs_cu_op_matmul(struct kvs_backend *b, const struct kvs_dbuf *x, const struct kvs_dweight *w,
                      const struct kvs_dweight *bias, int n, int in, int out, struct kvs_dbuf *y)
{
    kvs_cu_op_matmul_multi(b, x, 1, &w, &bias, n, in, &out, &y);
}

void kvs_cu_op_swiglu(struct kvs_backend *b, const struct kvs_dbuf *gate, const struct kvs_dbuf *up, int n, int ff,
                      struct kvs_dbuf *out);

/* gate = silu(x Wg^T) * (x Wu^T): one decode-GEMM launch with SwiGLU in its epilogue (which also
 * writes the bf16 copy for the down projection), or two cuBLAS GEMMs and the SwiGLU kernel. The
 * cuBLAS GEMMs write bf16 (into up's storage, which holds both: up is scratch), so SwiGLU reads
 * half the bytes that fp32 outputs would take (bench/RESULTS.md); where ff is not a multiple of 8 they write fp32 as matmul. */
/* matmul_swiglu; f32 = 0: the fp32 result may be left unwritten where only its bf16 copy (the
 * mirror, for the down projection) is needed (matmul_swiglu_down) */
static void swiglu_gemms(struct kvs_backend *b, const struct kvs_dbuf *x, const struct kvs_dweight *wg,
                         const struct kvs_dweight *wu, int n, int in, int ff, struct kvs_dbuf *gate,
                         struct kvs_dbuf *up, int f32)
{
    if (n <= 0) return;
    const int outs[2] = {ff, ff};
    KVS_ASSERT(!wg->is_vector && wg->rows == ff && wg->cols == in && !wu->is_vector && wu->rows == ff && wu->cols == in);
    if (n <= b->skinny_max && kvs_cu_skinny_takes(n, in, outs, 2, 1, b->dg.ws ? b->n_sms : 0)) {
        KVS_ASSERT((size_t)n * in <= b->xh_cap);
        const bf16 *xh = kvs_cu_gemm_input(b, x, (size_t)n * in);
        xh_forget(b, up->d);
        struct kvs_cu_skinny a = {};
        a.ws = b->dg.ws ? &b->dg : NULL;
        a.x = xh;
        a.n = n;
        a.in = in;
        a.swiglu = 1;
        a.n_parts = 2;
        a.w[0] = wg->h;
        a.w[1] = wu->h;
        a.out[0] = a.out[1] = ff;
        a.y[0] = (float *)gate->d;
        a.yh = xh_claim(b, gate->d, (size_t)n * ff); /* the other mirror buffer than xh */
        CUDA_CHECK(kvs_cu_skinny(&a, b->stream));
        return;
    }
    if (ff % 8 != 0) {
        kvs_cu_op_matmul(b, x, wg, NULL, n, in, ff, gate);
        kvs_cu_op_matmul(b, x, wu, NULL, n, in, ff, up);
        kvs_cu_op_swiglu(b, gate, up, n, ff, gate);
        return;
    }
    const size_t nn = (size_t)n * ff;
    KVS_ASSERT((size_t)n * in <= b->xh_cap && up->n >= nn && gate->n >= nn);
    const bf16 *xh = kvs_cu_gemm_input(b, x, (size_t)n * in);
    xh_forget(b, up->d);
    /* gate and up in bf16 in the scratch `up` (2 n ff bf16 fit its n ff floats): [n][ff] each, or
     * with the weights laid out back to back (fuse_weights) one GEMM writes [n][gate ff | up ff] */
    const struct kvs_dweight *wgu[2] = {wg, wu};
    const int fused = weights_adjacent(wgu, 2);
    bf16 *gh = (bf16 *)up->d, *uh = fused ? gh + ff : gh + nn; /* 16-byte aligned: ff is a multiple of 8 */
    if (fused) {
        gemm_run(b, xh, wg->h, n, in, 2 * ff, gh, GEMM_BF16);
    } else {
        gemm_blas(b, xh, wg, NULL, n, in, ff, gh, GEMM_BF16);
        gemm_blas(b, xh, wu, NULL, n, in, ff, uh, GEMM_BF16);
    }
    bf16 *outh = xh_claim(b, gate->d, nn);
    KVS_ASSERT(outh); /* the mirrors are as large as the largest ACT buffer (alloc), gate included */
    CUDA_CHECK(kvs_cu_launch(k_swiglu_h, grid_for(nn / 8, 256), 256, 0, b->stream, (const uint4 *)gh, (const uint4 *)uh,
                             nn / 8, ff / 8, fused ? ff / 4 : ff / 8, f32 ? (float4 *)gate->d : nullptr, (uint4 *)outh));
    LAUNCH_CHECK();
}

void kvs_cu_op_matmul_swiglu(struct kvs_backend *b, const struct kvs_dbuf *x, const struct kvs_dweight *wg,
                             const struct kvs_dweight *wu, int n, int in, int ff, struct kvs_dbuf *gate,
                             struct kvs_dbuf *up)
{
    swiglu_gemms(b, x, wg, wu, n, in, ff, gate, up, 1);
}

/* backend.h: matmul_swiglu, then the down projection from the bf16 copy of its result; above the
 * decode GEMM's rows the fp32 result is not written (half the bytes of the SwiGLU pass) */
void kvs_cu_op_matmul_swiglu_down(struct kvs_backend *b, const struct kvs_dbuf *x, const struct kvs_dweight *wg,
                                  const struct kvs_dweight *wu, const struct kvs_dweight *wd, int n, int in, int ff,
                                  struct kvs_dbuf *gate, struct kvs_dbuf *up, struct kvs_dbuf *y)
{
    if (n <= 0) return;
    /* every path that skips the fp32 result writes the bf16 copy (the mirror), which the down
     * projection reads; the others write both or the fp32 alone (converted for the GEMM) */
    swiglu_gemms(b, x, wg, wu, n, in, ff, gate, up, 0);
    kvs_cu_op_matmul(b, gate, wd, NULL, n, ff, in, y);
    xh_forget(b, gate->d); /* gate's fp32 may be stale: scratch from here on */
}

/* backend.h: matmul_multi + rope_kv_write. With q/k/v laid out back to back (fuse_weights) and
 * 9-256 rows, the joint GEMM's output goes straight to the RoPE and cache write (no pass that
 * splits it into q, k, v first); else the two ops. */
void kvs_cu_op_matmul_rope_kv_write(struct kvs_backend *b, const struct kvs_dbuf *x,
                                    const struct kvs_dweight *const *w, const struct kvs_dweight *const *bias, int n,
                                    int in, struct kvs_dbuf *q, struct kvs_dbuf *k, struct kvs_dbuf *v,
                                    const struct kvs_dbuf *pos, const struct kvs_dbuf *inv_freq,
                                    const struct kvs_dbuf *slots, int n_heads, int n_kv_heads, int head_dim,
                                    int block_size, struct kvs_dbuf *kc, struct kvs_dbuf *vc)
{
    if (n <= 0) return;
    const int outs[3] = {n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim};
    struct kvs_dbuf *y[3] = {q, k, v};
    int total = 0;
    if (multi_skinny(b, 3, n, in, outs) || !multi_joint(b, w, 3, n, outs, &total)) {
        kvs_cu_op_matmul_multi(b, x, 3, w, bias, n, in, outs, y);
        kvs_cu_op_rope_kv_write(b, q, k, v, pos, inv_freq, slots, n, n_heads, n_kv_heads, head_dim, block_size, kc, vc);
        return;
    }
    const bf16 *xh = multi_begin(b, x, 3, w, bias, n, in, outs, y);
    gemm_run(b, xh, w[0]->h, n, in, total, b->fuse_ws, GEMM_F32);
    struct rkv_args a = {};
    a.qs = b->fuse_ws;
    a.ks = b->fuse_ws + outs[0];
    a.vs = b->fuse_ws + outs[0] + outs[1];
    a.ldq = a.ldk = a.ldv = total;
    a.bq = bias && bias[0] ? bias[0]->f : NULL;
    a.bk = bias && bias[1] ? bias[1]->f : NULL;
    a.bv = bias && bias[2] ? bias[2]->f : NULL;
    a.q = (float *)q->d;
    a.k = (float *)k->d;
    a.v = (float *)v->d;
    kvs_cu_rkv_common(&a, pos, inv_freq, slots, n_heads, n_kv_heads, head_dim, block_size, kc, vc);
    kvs_cu_launch_rope_kv_write(b, &a, n);
}

extern "C" void kvs_cuda_pretune(struct kvs_backend *b, const struct kvs_dweight *w)
{
    if (!w->is_vector) gemm_pretune(b, w->h, w->rows, w->cols, weight_kinds(w->rows, w->cols));
}

extern "C" void kvs_cuda_matmul_accumulate(struct kvs_backend *b, const struct kvs_dbuf *x, const struct kvs_dweight *w,
                                           int n, int in, int out, struct kvs_dbuf *y)
{
    if (n <= 0) return;
    KVS_ASSERT(!w->is_vector && w->rows == out && w->cols == in);
    KVS_ASSERT((size_t)n * in <= b->xh_cap && (size_t)n * out <= y->n && x->d != y->d);
    const bf16 *xh = kvs_cu_gemm_input(b, x, (size_t)n * in);
    xh_forget(b, y->d);
    gemm_blas(b, xh, w, NULL, n, in, out, y->d, GEMM_F32_ACC);
}
