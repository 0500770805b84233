/* cuda_backend.cu: the CUDA backend's core: the op table of kernels/backend.h (kvs_cuda_backend),
 * create / free, device memory, uploads and downloads, step graphs, and cuda_backend.h's extras
 * (random data, timers, switches). The ops themselves live by job: cuda_gemm.cu (matmuls),
 * cuda_ops.cu (the small ops and attention's entry), kv_span.cu (attention over spans, merges);
 * the attention kernels in cuda_attention.cu and its cuda_attn_*.cu; the shared objects in
 * cuda_internal.cuh.
 *
 * Formats (the choices backend.h leaves to each backend):
 *   KVS_BUF_ACT  fp32. The residual stream, norms, RoPE, softmax state and every activation stay
 *                in fp32, so the CUDA backend tracks the fp32 CPU reference closely; only GEMM
 *                inputs are rounded to bf16. The norms and SwiGLU write that bf16 copy as they
 *                produce their output (xh_src), and so does the attention: a GEMM input needs
 *                a conversion pass only when nothing mirrored it.
 *   KVS_BUF_F32  fp32;  KVS_BUF_I32 int32;  KVS_BUF_KV bf16.
 *   weights      2-D matrices bf16 (converted at upload from bf16/f16/f32); 1-D vectors (norm
 *                weights, biases) fp32, exact.
 * Results are deterministic but not bitwise batch invariant as backend.h asks: the GEMM path
 * depends on n (the GEMV at 1 row, the decode GEMM up to 8 or 32, cuBLAS above, each batch
 * invariant within its own range of n; cuBLAS picks its kernel by n), and the context split of
 * the attention depends on the batch (differences are at bf16 rounding level); GEMM picks are timed (cuda_gemm.cu), so across runs results are
 * reproducible only with KVS_CUDA_GEMM_TUNE=0.
 *
 * Memory: plain cudaMalloc, only in create, alloc, upload_weight and fuse_weights (the matmul's
 * bf16 copy of x and the attention workspace are carved at create / grown in alloc; fuse_weights
 * moves a group into one allocation shared by its weights (struct wstore, freed with the last)
 * and allocates the fuse_ws scratch once; alloc and fuse_weights also take a scratch for
 * timing the GEMMs of new weight shapes and free it), plus a scratch for timing
 * a new shape of the accumulate GEMM (once per shape, never inside a graph) and the L2-flush
 * buffer of each timing (twice the L2, freed when the shape is timed). One stream; ops
 * never synchronise, except a GEMM whose shape is timed on its first call (outside graph
 * captures, once per shape); download/logits_to_host/sync wait. Every CUDA/cuBLAS/cuBLASLt call
 * is checked: failures log file:line and abort (bugs, not client errors); the exceptions are
 * handled: a timed candidate that cuBLASLt rejects is skipped, a shape with no cuBLASLt
 * algorithm goes to cublasGemmEx.
 */
#include <climits>

#include "kernels/cuda/cuda_internal.cuh"

/* matmuls of at most this many rows may use the decode GEMM (cuda_skinny.h), larger ones cuBLAS:
 * on Hopper its wgmma kernel reads gate/up and the LM head faster than cuBLAS up to 64 rows (with
 * one-tile blocks from 33: decode6), and k_dgemm_n the q/k/v, o and down launches up to 64; at 128
 * rows gate/up on the wgmma kernel was 4% slower than cuBLAS (bench/RESULTS.md, decode5, decode6) */
#define SKINNY_MAX_DEFAULT 64

/* ---- fills (cuda_backend.h's random data) ------------------------------------------------- */

__global__ void k_bf16_fill_random(bf16 *y, size_t n, float scale, uint64_t seed)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint64_t z = seed + i * 0x9E3779B97F4A7C15ull; /* splitmix64 */
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        float u = (float)(z >> 40) * (1.0f / 16777216.0f);
        y[i] = __float2bfloat16((2.0f * u - 1.0f) * scale);
    }
}

__global__ void k_f32_fill_random(float *y, size_t n, float scale, uint64_t seed)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint64_t z = seed + i * 0x9E3779B97F4A7C15ull;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        float u = (float)(z >> 40) * (1.0f / 16777216.0f);
        y[i] = (2.0f * u - 1.0f) * scale;
    }
}

/* cuda_internal.cuh */
void kvs_cu_fill_bf16(struct kvs_backend *b, bf16 *y, size_t n, float scale, uint64_t seed)
{
    k_bf16_fill_random<<<grid_for(n, 256), 256, 0, b->stream>>>(y, n, scale, seed);
}

/* ---- lifetime ----------------------------------------------------------------------------- */

/* the backend on GPU `device`, which becomes the calling thread's current device (a tensor-parallel
 * rank: one backend per GPU, each driven from its own thread) */
static struct kvs_backend *cu_create_device(int device, int n_threads, char *err, size_t errlen)
{
    (void)n_threads;
    int ndev = 0;
    cudaError_t e = cudaGetDeviceCount(&ndev);
    if (e != cudaSuccess || ndev == 0) {
        kvs_err(err, errlen, -ENODEV, "no CUDA device (%s)", e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
        return NULL;
    }
    if (device < 0 || device >= ndev) {
        kvs_err(err, errlen, -ENODEV, "no CUDA device %d (%d visible)", device, ndev);
        return NULL;
    }
    struct kvs_backend *b = (struct kvs_backend *)kvs_xcalloc(1, sizeof *b);
    b->device = device;
    CUDA_CHECK(cudaSetDevice(b->device));
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, b->device));
    if (prop.major < 9) {
        kvs_err(err, errlen, -ENODEV, "CUDA device %s has compute capability %d.%d; this build targets sm_90",
                prop.name, prop.major, prop.minor);
        free(b);
        return NULL;
    }
    b->n_sms = prop.multiProcessorCount;
    CUDA_CHECK(cudaStreamCreateWithFlags(&b->stream, cudaStreamNonBlocking));
    CUBLAS_CHECK(cublasCreate(&b->blas));
    CUBLAS_CHECK(cublasSetStream(b->blas, b->stream));
    CUDA_CHECK(cudaMalloc(&b->blas_ws, BLAS_WS_BYTES));
    CUBLAS_CHECK(cublasSetWorkspace(b->blas, b->blas_ws, BLAS_WS_BYTES));
    CUBLAS_CHECK(cublasSetMathMode(b->blas, CUBLAS_DEFAULT_MATH));
    /* cuBLASLt shares blas_ws: both run on the one stream, so their uses never overlap */
    CUBLAS_CHECK(cublasLtCreate(&b->lt));
    CUDA_CHECK(cudaMalloc((void **)&b->attn_ws, ATTN_WS_BYTES));
    if (prop.major == 9) { /* the wgmma decode GEMM (sm_90a code) and its split-K scratch */
        b->dg.n_sms = b->n_sms;
        b->dg.floats = kvs_cu_dgemm_ws_floats(b->n_sms);
        b->dg.n_sems = 4 * b->n_sms;
        CUDA_CHECK(cudaMalloc((void **)&b->dg.ws, b->dg.floats * sizeof(float)));
        CUDA_CHECK(cudaMalloc((void **)&b->dg.sem, (size_t)b->dg.n_sems * sizeof(unsigned)));
        CUDA_CHECK(cudaMemset(b->dg.sem, 0, (size_t)b->dg.n_sems * sizeof(unsigned)));
        /* the memset runs on the legacy stream, which b->stream (non-blocking) does not wait for */
        CUDA_CHECK(cudaDeviceSynchronize());
    }
    CUDA_CHECK(cudaEventCreate(&b->ev0));
    CUDA_CHECK(cudaEventCreate(&b->ev1));
    b->tune = (struct gemm_tuning *)kvs_xcalloc(1, sizeof *b->tune);
    for (int i = 0; i < 2 * GEMM_TIMED; i++) CUDA_CHECK(cudaEventCreate(&b->tune->ev[i]));
    b->bounce = kvs_xmalloc(BOUNCE_ELEMS * 6); /* fp32 chunk + bf16 chunk */
    for (int i = 0; i < 2; i++) {
        CUDA_CHECK(cudaMallocHost((void **)&b->fetch[i], KVS_FETCH_MAX * sizeof(int32_t)));
        CUDA_CHECK(cudaEventCreateWithFlags(&b->fetch_ev[i], cudaEventDisableTiming));
    }
    {
        const char *e = getenv("KVS_CUDA_ATTN_SPLITS");
        b->attn_splits = e && atoi(e) > 0 ? atoi(e) : 0;
        b->dec_attn = -1; /* KVS_CUDA_DEC_ATTN is read by cuda_attn_decode.cu itself */
        e = getenv("KVS_CUDA_BATCH_INVARIANT");
        b->bi_env = e != NULL;
        b->batch_invariant = e && atoi(e) > 0;
        e = getenv("KVS_CUDA_SKINNY_MAX");
        b->skinny_max = b->skinny_default = e ? atoi(e) : SKINNY_MAX_DEFAULT;
        b->gemm_default = KVS_CUDA_GEMM_TUNED;
        e = getenv("KVS_CUDA_GEMM_TUNE");
        if (e && strcmp(e, "0") == 0) b->gemm_default = KVS_CUDA_GEMM_HEURISTIC;
        e = getenv("KVS_CUDA_GEMM");
        if (e && strcmp(e, "ex") == 0) b->gemm_default = KVS_CUDA_GEMM_EX;
        else if (e && *e && strcmp(e, "lt") != 0)
            kvs_log(KVS_LOG_WARN, "cuda: KVS_CUDA_GEMM=%s is neither \"ex\" nor \"lt\"; using cuBLASLt", e);
        b->gemm_mode = b->gemm_default;
        e = getenv("KVS_CUDA_GEMM_SPLITK");
        b->gemm_splitk = !(e && strcmp(e, "0") == 0);
    }
    kvs_log(KVS_LOG_INFO, "cuda: device %d: %s, %d SMs, %.1f GiB, compute %d.%d", device, prop.name,
            prop.multiProcessorCount, (double)prop.totalGlobalMem / (1u << 30), prop.major, prop.minor);
    return b;
}

static struct kvs_backend *cu_create(int n_threads, char *err, size_t errlen)
{
    return cu_create_device(0, n_threads, err, errlen);
}

/* unlinks and frees one weight: its own memory, or its share of a fused storage (the storage
 * goes with its last weight) */
static void weight_release(struct kvs_backend *b, struct kvs_dweight *w)
{
    list_del(&b->weights, w);
    CUDA_CHECK(cudaFree(w->f));
    if (!w->store) {
        CUDA_CHECK(cudaFree(w->h));
    } else if (--w->store->refs == 0) {
        CUDA_CHECK(cudaFree(w->store->base));
        free(w->store);
    }
    free(w);
}

static void cu_free(struct kvs_backend *b)
{
    if (!b) return;
    CUDA_CHECK(cudaStreamSynchronize(b->stream));
    kvs_cu_tp_release(b);
    kvs_cu_gemm_tune_report(b);
    while (b->bufs) {
        struct kvs_dbuf *x = b->bufs;
        list_del(&b->bufs, x);
        CUDA_CHECK(cudaFree(x->d));
        free(x);
    }
    while (b->weights) weight_release(b, b->weights);
    CUDA_CHECK(cudaFree(b->fuse_ws));
    CUDA_CHECK(cudaFree(b->xh_buf[0]));
    CUDA_CHECK(cudaFree(b->xh_buf[1]));
    CUDA_CHECK(cudaFree(b->attn_ws));
    CUDA_CHECK(cudaFree(b->dg.ws));
    CUDA_CHECK(cudaFree(b->dg.sem));
    CUDA_CHECK(cudaFree(b->blas_ws));
    CUBLAS_CHECK(cublasDestroy(b->blas));
    CUBLAS_CHECK(cublasLtDestroy(b->lt));
    CUDA_CHECK(cudaEventDestroy(b->ev0));
    CUDA_CHECK(cudaEventDestroy(b->ev1));
    for (int i = 0; i < 2 * GEMM_TIMED; i++) CUDA_CHECK(cudaEventDestroy(b->tune->ev[i]));
    free(b->tune);
    for (int i = 0; i < 2; i++) {
        CUDA_CHECK(cudaEventDestroy(b->fetch_ev[i]));
        CUDA_CHECK(cudaFreeHost(b->fetch[i]));
    }
    CUDA_CHECK(cudaStreamDestroy(b->stream));
    free(b->bounce);
    free(b);
}

static size_t cu_mem_available(struct kvs_backend *b)
{
    (void)b;
    size_t fr = 0, tot = 0;
    CUDA_CHECK(cudaMemGetInfo(&fr, &tot));
    return fr;
}

static size_t cu_elem_size(struct kvs_backend *b, enum kvs_buf_kind kind)
{
    (void)b;
    return kind_size(kind);
}

static void cu_sync(struct kvs_backend *b)
{
    CUDA_CHECK(cudaStreamSynchronize(b->stream));
}

/* ---- memory ------------------------------------------------------------------------------- */

/* cuda_internal.cuh */
void *kvs_cu_dev_alloc(size_t bytes)
{
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, bytes ? bytes : 16);
    if (e == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError(); /* clear the sticky-free error state of the runtime */
        return NULL;
    }
    CUDA_CHECK(e);
    return p;
}

static struct kvs_dbuf *cu_alloc(struct kvs_backend *b, enum kvs_buf_kind kind, size_t n)
{
    /* the runner allocates its workspaces once the weights are in (and fused): time the GEMM
     * shapes they left, then the pre-tuning is over */
    kvs_cu_gemm_pretune_pending(b);
    kvs_cu_gemm_tune_report(b);
    /* the matmul's bf16 copy of x is as large as the largest activation buffer */
    if (kind == KVS_BUF_ACT && n > b->xh_cap) {
        bf16 *nx = (bf16 *)kvs_cu_dev_alloc(n * sizeof(bf16)), *ny = nx ? (bf16 *)kvs_cu_dev_alloc(n * sizeof(bf16)) : NULL;
        if (!ny) {
            if (nx) CUDA_CHECK(cudaFree(nx));
            return NULL;
        }
        CUDA_CHECK(cudaStreamSynchronize(b->stream));
        CUDA_CHECK(cudaFree(b->xh_buf[0]));
        CUDA_CHECK(cudaFree(b->xh_buf[1]));
        b->xh_buf[0] = b->xh = nx;
        b->xh_buf[1] = ny;
        b->xh_cap = n;
        b->xh_src = NULL;
    }
    void *d = kvs_cu_dev_alloc(n * kind_size(kind));
    if (!d) return NULL;
    struct kvs_dbuf *buf = (struct kvs_dbuf *)kvs_xcalloc(1, sizeof *buf);
    buf->kind = kind;
    buf->n = n;
    buf->d = d;
    list_add(&b->bufs, buf);
    return buf;
}

static void cu_free_buf(struct kvs_backend *b, struct kvs_dbuf *buf)
{
    if (!buf) return;
    CUDA_CHECK(cudaStreamSynchronize(b->stream));
    list_del(&b->bufs, buf);
    xh_forget(b, buf->d); /* a later allocation may get the same address */
    CUDA_CHECK(cudaFree(buf->d));
    free(buf);
}

static void cu_upload(struct kvs_backend *b, struct kvs_dbuf *dst, size_t off, const void *src, size_t n)
{
    KVS_ASSERT(off + n <= dst->n);
    xh_forget(b, dst->d);
    if (dst->kind != KVS_BUF_KV) {
        /* pageable source: the call returns once src is staged, so the caller may reuse it */
        CUDA_CHECK(cudaMemcpyAsync((char *)dst->d + off * 4, src, n * 4, cudaMemcpyHostToDevice, b->stream));
        return;
    }
    const float *s = (const float *)src;
    bf16 *h = (bf16 *)b->bounce;
    for (size_t i = 0; i < n; i += BOUNCE_ELEMS) {
        size_t c = n - i < BOUNCE_ELEMS ? n - i : BOUNCE_ELEMS;
        CUDA_CHECK(cudaStreamSynchronize(b->stream)); /* the bounce buffer is free again */
        for (size_t j = 0; j < c; j++) h[j] = __float2bfloat16(s[i + j]);
        CUDA_CHECK(cudaMemcpyAsync((bf16 *)dst->d + off + i, h, c * sizeof(bf16), cudaMemcpyHostToDevice, b->stream));
    }
    CUDA_CHECK(cudaStreamSynchronize(b->stream));
}

static void cu_download(struct kvs_backend *b, void *dst, const struct kvs_dbuf *src, size_t off, size_t n)
{
    KVS_ASSERT(off + n <= src->n);
    if (src->kind != KVS_BUF_KV) {
        CUDA_CHECK(cudaMemcpyAsync(dst, (const char *)src->d + off * 4, n * 4, cudaMemcpyDeviceToHost, b->stream));
        CUDA_CHECK(cudaStreamSynchronize(b->stream));
        return;
    }
    float *o = (float *)dst;
    bf16 *h = (bf16 *)b->bounce;
    for (size_t i = 0; i < n; i += BOUNCE_ELEMS) {
        size_t c = n - i < BOUNCE_ELEMS ? n - i : BOUNCE_ELEMS;
        CUDA_CHECK(cudaMemcpyAsync(h, (const bf16 *)src->d + off + i, c * sizeof(bf16), cudaMemcpyDeviceToHost, b->stream));
        CUDA_CHECK(cudaStreamSynchronize(b->stream));
        for (size_t j = 0; j < c; j++) o[i + j] = __bfloat162float(h[j]);
    }
}

static void cu_zero(struct kvs_backend *b, struct kvs_dbuf *buf, size_t off, size_t n)
{
    KVS_ASSERT(off + n <= buf->n);
    size_t es = kind_size(buf->kind);
    xh_forget(b, buf->d);
    CUDA_CHECK(cudaMemsetAsync((char *)buf->d + off * es, 0, n * es, b->stream));
}

/* host conversion of a tensor chunk to bf16 (through fp32 scratch for f16/f32 sources) */
static void to_bf16_host(const struct kvs_tensor_view *t, size_t first, size_t n, float *scratch, bf16 *out)
{
    kvs_tensor_to_f32(t, scratch, first, n);
    for (size_t i = 0; i < n; i++) out[i] = __float2bfloat16(scratch[i]);
}

static struct kvs_dweight *cu_upload_weight(struct kvs_backend *b, const struct kvs_tensor_view *t, char *err,
                                            size_t errlen)
{
    if (t->ndim != 1 && t->ndim != 2) {
        kvs_err(err, errlen, -EINVAL, "cuda: weight with %d dims (want 1 or 2)", t->ndim);
        return NULL;
    }
    if (t->dtype != KVS_DTYPE_BF16 && t->dtype != KVS_DTYPE_F16 && t->dtype != KVS_DTYPE_F32) {
        kvs_err(err, errlen, -EINVAL, "cuda: unsupported weight dtype %d", (int)t->dtype);
        return NULL;
    }
    struct kvs_dweight *w = (struct kvs_dweight *)kvs_xcalloc(1, sizeof *w);
    w->is_vector = t->ndim == 1;
    w->rows = t->ndim == 1 ? 1 : t->shape[0];
    w->cols = t->ndim == 1 ? t->shape[0] : t->shape[1];
    size_t n = (size_t)(w->rows * w->cols);
    if (w->is_vector) {
        w->f = (float *)kvs_cu_dev_alloc(n * 4);
        if (!w->f) goto oom;
        float *h = (float *)b->bounce;
        for (size_t i = 0; i < n; i += BOUNCE_ELEMS) {
            size_t c = n - i < BOUNCE_ELEMS ? n - i : BOUNCE_ELEMS;
            CUDA_CHECK(cudaStreamSynchronize(b->stream));
            kvs_tensor_to_f32(t, h, i, c);
            CUDA_CHECK(cudaMemcpyAsync(w->f + i, h, c * 4, cudaMemcpyHostToDevice, b->stream));
        }
    } else {
        w->h = (bf16 *)kvs_cu_dev_alloc(n * sizeof(bf16));
        if (!w->h) goto oom;
        if (t->dtype == KVS_DTYPE_BF16) {
            CUDA_CHECK(cudaMemcpyAsync(w->h, t->data, n * 2, cudaMemcpyHostToDevice, b->stream));
        } else {
            float *f = (float *)b->bounce;
            bf16 *h = (bf16 *)(f + BOUNCE_ELEMS);
            for (size_t i = 0; i < n; i += BOUNCE_ELEMS) {
                size_t c = n - i < BOUNCE_ELEMS ? n - i : BOUNCE_ELEMS;
                CUDA_CHECK(cudaStreamSynchronize(b->stream));
                to_bf16_host(t, i, c, f, h);
                CUDA_CHECK(cudaMemcpyAsync(w->h + i, h, c * 2, cudaMemcpyHostToDevice, b->stream));
            }
        }
    }
    CUDA_CHECK(cudaStreamSynchronize(b->stream));
    list_add(&b->weights, w);
    /* decode graphs are captured on first use, where no GEMM can be timed: the shape is timed
     * before anything runs, at the next alloc (the runner fuses q/k/v and gate/up first, and
     * the shapes of weights that all went into fused groups need no timing of their own) */
    if (!w->is_vector && !shape_listed(b->tune->pretuned, b->tune->n_pretuned, w->rows, w->cols) &&
        !shape_listed(b->tune->pending, b->tune->n_pending, w->rows, w->cols) &&
        b->tune->n_pending < GEMM_PRETUNE_SHAPES) {
        b->tune->pending[b->tune->n_pending][0] = w->rows;
        b->tune->pending[b->tune->n_pending][1] = w->cols;
        b->tune->n_pending++;
    }
    return w;
oom:
    kvs_err(err, errlen, -ENOMEM, "cuda: out of device memory for a %lld x %lld weight (%s)", (long long)w->rows,
            (long long)w->cols, t->file ? t->file : "?");
    free(w);
    return NULL;
}

static void cu_free_weight(struct kvs_backend *b, struct kvs_dweight *w)
{
    if (!w) return;
    CUDA_CHECK(cudaStreamSynchronize(b->stream));
    weight_release(b, w);
}

static void cu_logits_to_host(struct kvs_backend *b, const struct kvs_dbuf *logits, int m, int vocab, float *host)
{
    if (m <= 0) return;
    cu_download(b, host, logits, 0, (size_t)m * vocab);
}

/* ---- step graphs ---------------------------------------------------------------------------- */

static void cu_graph_begin(struct kvs_backend *b)
{
    CUDA_CHECK(cudaStreamBeginCapture(b->stream, cudaStreamCaptureModeThreadLocal));
}

static struct kvs_graph *cu_graph_end(struct kvs_backend *b, char *err, size_t errlen)
{
    struct kvs_graph *g = (struct kvs_graph *)kvs_xcalloc(1, sizeof *g);
    CUDA_CHECK(cudaStreamEndCapture(b->stream, &g->graph));
    cudaError_t e = cudaGraphInstantiate(&g->exec, g->graph, 0);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        kvs_err(err, errlen, -ENOMEM, "cuda: graph instantiation failed (%s)", cudaGetErrorString(e));
        CUDA_CHECK(cudaGraphDestroy(g->graph));
        free(g);
        return NULL;
    }
    g->xh = b->xh;
    g->xh_src = b->xh_src;
    g->xh_n = b->xh_n;
    return g;
}

static void cu_graph_launch(struct kvs_backend *b, struct kvs_graph *g)
{
    CUDA_CHECK(cudaGraphLaunch(g->exec, b->stream));
    /* the replay rewrote the bf16 mirror exactly as the recorded ops did */
    b->xh = g->xh;
    b->xh_src = g->xh_src;
    b->xh_n = g->xh_n;
}

static void cu_graph_free(struct kvs_backend *b, struct kvs_graph *g)
{
    if (!g) return;
    CUDA_CHECK(cudaStreamSynchronize(b->stream));
    CUDA_CHECK(cudaGraphExecDestroy(g->exec));
    CUDA_CHECK(cudaGraphDestroy(g->graph));
    free(g);
}

/* backend.h fetch_begin / fetch_end: a device-to-host copy into pinned memory that the host
 * waits for by its event, so that steps queued behind it keep the device busy meanwhile */
static void cu_fetch_begin(struct kvs_backend *b, const struct kvs_dbuf *src, size_t n, int slot)
{
    KVS_ASSERT(n <= KVS_FETCH_MAX && n <= src->n && src->kind == KVS_BUF_I32 && (slot == 0 || slot == 1));
    CUDA_CHECK(cudaMemcpyAsync(b->fetch[slot], src->d, n * sizeof(int32_t), cudaMemcpyDeviceToHost, b->stream));
    CUDA_CHECK(cudaEventRecord(b->fetch_ev[slot], b->stream));
}

static void cu_fetch_end(struct kvs_backend *b, int slot, int32_t *dst, size_t n)
{
    KVS_ASSERT(n <= KVS_FETCH_MAX && (slot == 0 || slot == 1));
    CUDA_CHECK(cudaEventSynchronize(b->fetch_ev[slot]));
    memcpy(dst, b->fetch[slot], n * sizeof(int32_t));
}

extern "C" const struct kvs_backend_ops kvs_cuda_backend = {
    /* name */ "cuda",
    cu_create,
    cu_free,
    cu_mem_available,
    cu_elem_size,
    cu_sync,
    cu_alloc,
    cu_free_buf,
    cu_upload,
    cu_download,
    cu_zero,
    cu_upload_weight,
    cu_free_weight,
    kvs_cu_op_embed,
    kvs_cu_op_rmsnorm,
    kvs_cu_op_add_rmsnorm,
    kvs_cu_op_head_rmsnorm,
    kvs_cu_op_matmul,
    kvs_cu_op_rope,
    kvs_cu_op_kv_write,
    kvs_cu_op_attention,
    kvs_cu_op_swiglu,
    kvs_cu_op_gather_rows,
    kvs_cu_op_kv_copy_block,
    cu_logits_to_host,
    cu_graph_begin,
    cu_graph_end,
    cu_graph_launch,
    cu_graph_free,
    kvs_cu_op_matmul_multi,
    kvs_cu_op_matmul_swiglu,
    kvs_cu_op_rope_kv_write,
    kvs_cu_op_argmax_rows,
    kvs_cu_op_fuse_weights,
    kvs_cu_op_matmul_rope_kv_write,
    kvs_cu_op_matmul_swiglu_down,
    kvs_cu_op_attention_spans,
    kvs_cu_op_attn_merge,
    cu_create_device,
    kvs_cu_op_tp_group,
    kvs_cu_op_allreduce_sum,
    kvs_cu_op_argmax_rows_val,
    kvs_cu_op_ids_to_tokens,
    cu_fetch_begin,
    cu_fetch_end,
    kvs_cuda_set_batch_invariant,
};

/* ---- extras (cuda_backend.h) -------------------------------------------------------------- */

extern "C" struct kvs_dweight *kvs_cuda_random_weight(struct kvs_backend *b, int64_t rows, int64_t cols,
                                                      int is_vector, float scale, uint64_t seed)
{
    struct kvs_dweight *w = (struct kvs_dweight *)kvs_xcalloc(1, sizeof *w);
    w->rows = is_vector ? 1 : rows;
    w->cols = cols;
    w->is_vector = is_vector;
    size_t n = (size_t)(w->rows * w->cols);
    if (is_vector) {
        w->f = (float *)kvs_cu_dev_alloc(n * 4);
        if (!w->f) { free(w); return NULL; }
        k_f32_fill_random<<<grid_for(n, 256), 256, 0, b->stream>>>(w->f, n, scale, seed);
    } else {
        w->h = (bf16 *)kvs_cu_dev_alloc(n * 2);
        if (!w->h) { free(w); return NULL; }
        k_bf16_fill_random<<<grid_for(n, 256), 256, 0, b->stream>>>(w->h, n, scale, seed);
    }
    LAUNCH_CHECK();
    list_add(&b->weights, w);
    return w;
}

extern "C" void kvs_cuda_fill_random(struct kvs_backend *b, struct kvs_dbuf *buf, size_t off, size_t n, float scale,
                                     uint64_t seed)
{
    KVS_ASSERT(off + n <= buf->n && buf->kind != KVS_BUF_I32);
    xh_forget(b, buf->d);
    if (buf->kind == KVS_BUF_KV)
        k_bf16_fill_random<<<grid_for(n, 256), 256, 0, b->stream>>>((bf16 *)buf->d + off, n, scale, seed);
    else
        k_f32_fill_random<<<grid_for(n, 256), 256, 0, b->stream>>>((float *)buf->d + off, n, scale, seed);
    LAUNCH_CHECK();
}

extern "C" void kvs_cuda_timer_start(struct kvs_backend *b)
{
    CUDA_CHECK(cudaEventRecord(b->ev0, b->stream));
}

extern "C" float kvs_cuda_timer_stop_ms(struct kvs_backend *b)
{
    float ms = 0.0f;
    CUDA_CHECK(cudaEventRecord(b->ev1, b->stream));
    CUDA_CHECK(cudaEventSynchronize(b->ev1));
    CUDA_CHECK(cudaEventElapsedTime(&ms, b->ev0, b->ev1));
    return ms;
}

static int cmp_float(const void *x, const void *y)
{
    float a = *(const float *)x, c = *(const float *)y;
    return (a > c) - (a < c);
}

extern "C" double kvs_cuda_copy_bandwidth(struct kvs_backend *b, size_t bytes)
{
    void *src = kvs_cu_dev_alloc(bytes), *dst = kvs_cu_dev_alloc(bytes);
    if (!src || !dst) {
        if (src) CUDA_CHECK(cudaFree(src));
        if (dst) CUDA_CHECK(cudaFree(dst));
        return 0.0;
    }
    k_bf16_fill_random<<<grid_for(bytes / 2, 256), 256, 0, b->stream>>>((bf16 *)src, bytes / 2, 1.0f, 7);
    LAUNCH_CHECK();
    float t[15];
    for (int i = 0; i < 18; i++) {
        kvs_cuda_timer_start(b);
        CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, b->stream));
        float ms = kvs_cuda_timer_stop_ms(b);
        if (i >= 3) t[i - 3] = ms; /* 3 warm-ups */
    }
    qsort(t, 15, sizeof t[0], cmp_float);
    CUDA_CHECK(cudaFree(src));
    CUDA_CHECK(cudaFree(dst));
    return 2.0 * (double)bytes / (t[7] * 1e-3);
}

extern "C" void kvs_cuda_device_desc(struct kvs_backend *b, char *out, size_t outlen)
{
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, b->device));
    int drv = 0, rt = 0;
    CUDA_CHECK(cudaDriverGetVersion(&drv));
    CUDA_CHECK(cudaRuntimeGetVersion(&rt));
    snprintf(out, outlen, "%s, %d SMs, %.1f GiB, driver %d, runtime %d", prop.name, prop.multiProcessorCount,
             (double)prop.totalGlobalMem / (double)(1u << 30), drv, rt);
}

extern "C" void kvs_cuda_set_attn_splits(struct kvs_backend *b, int n_splits)
{
    b->attn_splits = n_splits > 0 ? n_splits : 0;
}

extern "C" void kvs_cuda_set_batch_invariant(struct kvs_backend *b, int on)
{
    if (b->bi_env) return; /* KVS_CUDA_BATCH_INVARIANT wins (the GEMM bit already follows it) */
    b->batch_invariant = on > 0;
    kvs_cu_skinny_set_invariant(on > 0 ? 1 : -1);
}

extern "C" void kvs_cuda_set_dec_attn(struct kvs_backend *b, int kind)
{
    b->dec_attn = kind == 0 || (kind >= 2 && kind <= 5) ? kind : -1;
}

extern "C" int kvs_cuda_supports_attention(int n_heads, int n_kv_heads, int head_dim)
{
    return kvs_cu_attention_supported(n_heads, n_kv_heads, head_dim);
}

extern "C" void kvs_cuda_set_skinny_max(struct kvs_backend *b, int max_n)
{
    b->skinny_max = max_n >= 0 ? max_n : b->skinny_default;
}

extern "C" void kvs_cuda_set_skinny_variant(struct kvs_backend *b, int v)
{
    (void)b;
    kvs_cu_skinny_set_variant(v);
}

extern "C" void kvs_cuda_set_pdl_early(struct kvs_backend *b, int on)
{
    (void)b;
    kvs_cu_set_pdl_early(on);
}

extern "C" void kvs_cuda_set_gemm(struct kvs_backend *b, int mode)
{
    KVS_ASSERT(mode >= -1 && mode <= KVS_CUDA_GEMM_EX);
    b->gemm_mode = mode >= 0 ? mode : b->gemm_default;
}
