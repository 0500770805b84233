/* kv_paris_host.cu: the CUDA side of ParisKV's host offload (kernels/kv_paris.h: host pages,
 * write_out, gather), tested against the CPU reference (kernels/cpu/kv_paris_host.c, an
 * index-select) by tests/gpu/test_cuda_kv_paris.c.
 *
 * Host pages are cudaHostAlloc'd mapped and portable: with unified addressing (every 64-bit
 * CUDA platform) the host pointer is valid in kernels, so write_out stores to host memory and
 * the gather loads from it over the bus (UVA), with no copy engine and no host work.
 * write_out  a thread per 16-byte chunk of a (position, KV head) row, grid-stride over each job.
 * gather     a block per (row x KV head, group of 8 spans, piece of 32 positions), a warp per
 *            span: the span's offset in the staging area is the sum of the lengths of the spans
 *            before it (summed by the block, then by the warp), and the warp's lanes copy 16-byte
 *            chunks of its piece of the span from the host page (retrieval zone, page present) or
 *            the pool. Pieces, because the tail span (local window + buffer, hundreds of
 *            positions) copied by one warp was the whole gather's latency at batch 1.
 */
#include "kernels/cuda/cuda_internal.cuh"
#include "kernels/kv_paris.h"

#define GATHER_WARPS 8
#define GATHER_PIECE 32

static void *cu_host_alloc(struct kvs_backend *b, size_t bytes, char *err, size_t errlen)
{
    (void)b;
    void *p = NULL;
    cudaError_t e = cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        kvs_err(err, errlen, -ENOMEM, "kv.paris.offload: cudaHostAlloc of %zu bytes of pinned host pages failed: %s",
                bytes, cudaGetErrorString(e));
        return NULL;
    }
    void *dp = NULL;
    CUDA_CHECK(cudaHostGetDevicePointer(&dp, p, 0));
    if (dp != p) {
        cudaFreeHost(p);
        kvs_err(err, errlen, -ENOSYS, "kv.paris.offload: this platform has no unified addressing for pinned memory");
        return NULL;
    }
    return p;
}

static void cu_host_free(struct kvs_backend *b, void *p)
{
    if (!p) return;
    CUDA_CHECK(cudaStreamSynchronize(b->stream));
    CUDA_CHECK(cudaFreeHost(p));
}

__device__ __forceinline__ size_t h_at(int page, int layer, int n_layers, int g, int nkv, int off, int bs, int D)
{
    return ((((size_t)page * n_layers + layer) * nkv + g) * bs + off) * (size_t)D;
}

__global__ void k_paris_write_out(const bf16 *__restrict__ kc, const bf16 *__restrict__ vc,
                                  const int32_t *__restrict__ bts, int max_blocks, const int32_t *__restrict__ jobs,
                                  int layer, int n_layers, int nkv, int bs, int D, const int32_t *__restrict__ pages,
                                  int page_stride, bf16 *hk, bf16 *hv)
{
    const int32_t *J = jobs + (size_t)blockIdx.y * KVS_PARIS_JOB_N;
    const int from = J[KVS_PARIS_JOB_FROM], to = J[KVS_PARIS_JOB_TO], C = D / 8;
    const int32_t *bt = bts + (size_t)J[KVS_PARIS_JOB_SEQ] * max_blocks;
    const int32_t *pt = pages + (size_t)J[KVS_PARIS_JOB_SLOT] * page_stride;
    const long n = (long)(to - from) * nkv * C;
    for (long t = (long)blockIdx.x * blockDim.x + threadIdx.x; t < n; t += (long)gridDim.x * blockDim.x) {
        const int p = from + (int)(t / ((long)nkv * C)), g = (int)((t / C) % nkv), c = (int)(t % C);
        const int page = pt[p / bs];
        if (page < 0) continue;
        const size_t src = (((size_t)bt[p / bs] * nkv + g) * bs + p % bs) * D + (size_t)c * 8;
        const size_t dst = h_at(page, layer, n_layers, g, nkv, p % bs, bs, D) + (size_t)c * 8;
        *(uint4 *)(hk + dst) = *(const uint4 *)(kc + src);
        *(uint4 *)(hv + dst) = *(const uint4 *)(vc + src);
    }
}

static void cu_write_out(struct kvs_backend *b, const struct kvs_dbuf *kc, const struct kvs_dbuf *vc,
                         const struct kvs_attn_meta *m, const struct kvs_dbuf *jobs, const int32_t *h_jobs, int n_jobs,
                         int layer, int n_layers, int n_kv_heads, int head_dim, int block_size,
                         const struct kvs_dbuf *pages, int page_stride, void *host_k, void *host_v)
{
    long most = 0;
    for (int j = 0; j < n_jobs; j++) {
        const long n = h_jobs[j * KVS_PARIS_JOB_N + KVS_PARIS_JOB_TO] - h_jobs[j * KVS_PARIS_JOB_N + KVS_PARIS_JOB_FROM];
        most = n > most ? n : most;
    }
    if (most <= 0) return;
    long blocks = (most * n_kv_heads * (head_dim / 8) + 255) / 256;
    if (blocks > 2048) blocks = 2048;
    k_paris_write_out<<<dim3((unsigned)blocks, (unsigned)n_jobs), 256, 0, b->stream>>>(
        (const bf16 *)kc->d, (const bf16 *)vc->d, (const int32_t *)m->block_tables->d, m->max_blocks,
        (const int32_t *)jobs->d, layer, n_layers, n_kv_heads, block_size, head_dim, (const int32_t *)pages->d,
        page_stride, (bf16 *)host_k, (bf16 *)host_v);
    CUDA_CHECK(cudaGetLastError());
}

__device__ __forceinline__ int span_len(const int32_t *sp, int i, int ctx)
{
    const int e = sp[2 * i + 1] < ctx ? sp[2 * i + 1] : ctx;
    return e > sp[2 * i] ? e - sp[2 * i] : 0;
}

__global__ void __launch_bounds__(GATHER_WARPS * 32)
k_paris_gather(const bf16 *__restrict__ kc, const bf16 *__restrict__ vc, const int32_t *__restrict__ bts,
               int max_blocks, const int32_t *__restrict__ rows, int layer, int n_layers, int nkv, int bs, int D,
               const int32_t *__restrict__ n_spans, const int32_t *__restrict__ spans, int max_spans,
               const int32_t *__restrict__ pages, int page_stride, const bf16 *hk, const bf16 *hv, bf16 *sk, bf16 *sv,
               int stage_blocks)
{
    const int rg = blockIdx.x, r = rg / nkv, g = rg % nkv;
    const int ns = n_spans[rg], first = blockIdx.y * GATHER_WARPS;
    if (first >= ns) return;
    const int32_t *R = rows + (size_t)r * KVS_PARIS_ROW_N;
    const int sink = R[KVS_PARIS_ROW_SINK], n_r = R[KVS_PARIS_ROW_NR], ctx = R[KVS_PARIS_ROW_CTX];
    const int32_t *pt = pages + (size_t)R[KVS_PARIS_ROW_SLOT] * page_stride;
    const int32_t *bt = bts + (size_t)r * max_blocks;
    const int32_t *sp = spans + (size_t)rg * max_spans * 2;
    __shared__ int base;
    if (threadIdx.x == 0) base = 0;
    __syncthreads();
    int part = 0;
    for (int i = threadIdx.x; i < first; i += blockDim.x) part += span_len(sp, i, ctx);
    if (part) atomicAdd(&base, part);
    __syncthreads();
    const int w = threadIdx.x / 32, lane = threadIdx.x % 32, i = first + w;
    if (i >= ns) return;
    int off = base;
    for (int j = first; j < i; j++) off += span_len(sp, j, ctx);
    const int z0 = (int)blockIdx.z * GATHER_PIECE, n = span_len(sp, i, ctx) - z0, C = D / 8;
    if (n <= 0) return;
    const int p0 = sp[2 * i] + z0, mpos = n < GATHER_PIECE ? n : GATHER_PIECE;
    off += z0;
    for (int t = lane; t < mpos * C; t += 32) {
        const int p = p0 + t / C, c = t % C, at = off + t / C;
        const int page = p >= sink && p < sink + n_r ? pt[p / bs] : -1;
        const bf16 *ks, *vs;
        if (page >= 0) {
            const size_t h = h_at(page, layer, n_layers, g, nkv, p % bs, bs, D) + (size_t)c * 8;
            ks = hk + h, vs = hv + h;
        } else {
            const size_t o = (((size_t)bt[p / bs] * nkv + g) * bs + p % bs) * D + (size_t)c * 8;
            ks = kc + o, vs = vc + o;
        }
        const size_t dst = ((((size_t)r * stage_blocks + at / bs) * nkv + g) * bs + at % bs) * D + (size_t)c * 8;
        *(uint4 *)(sk + dst) = *(const uint4 *)ks;
        *(uint4 *)(sv + dst) = *(const uint4 *)vs;
    }
}

static void cu_gather(struct kvs_backend *b, const struct kvs_dbuf *kc, const struct kvs_dbuf *vc,
                      const struct kvs_attn_meta *m, const struct kvs_dbuf *rows, const int32_t *h_rows, int n,
                      int layer, int n_layers, int n_kv_heads, int head_dim, int block_size,
                      const struct kvs_dbuf *n_spans, const struct kvs_dbuf *spans, int max_spans,
                      const struct kvs_dbuf *pages, int page_stride, const void *host_k, const void *host_v,
                      struct kvs_dbuf *stage_k, struct kvs_dbuf *stage_v, int stage_blocks)
{
    if (n <= 0) return;
    /* a span holds at most the row's attended positions (sink + top-k + tail, or the context) */
    int most = 1;
    for (int r = 0; r < n; r++) {
        const int32_t *R = h_rows + (size_t)r * KVS_PARIS_ROW_N;
        const int cnt = R[KVS_PARIS_ROW_NR] ? R[KVS_PARIS_ROW_CTX] - R[KVS_PARIS_ROW_NR] + R[KVS_PARIS_ROW_TOPK]
                                            : R[KVS_PARIS_ROW_CTX];
        most = cnt > most ? cnt : most;
    }
    const dim3 grid((unsigned)(n * n_kv_heads), (unsigned)((max_spans + GATHER_WARPS - 1) / GATHER_WARPS),
                    (unsigned)((most + GATHER_PIECE - 1) / GATHER_PIECE));
    k_paris_gather<<<grid, GATHER_WARPS * 32, 0, b->stream>>>(
        (const bf16 *)kc->d, (const bf16 *)vc->d, (const int32_t *)m->block_tables->d, m->max_blocks,
        (const int32_t *)rows->d, layer, n_layers, n_kv_heads, block_size, head_dim, (const int32_t *)n_spans->d,
        (const int32_t *)spans->d, max_spans, (const int32_t *)pages->d, page_stride, (const bf16 *)host_k,
        (const bf16 *)host_v, (bf16 *)stage_k->d, (bf16 *)stage_v->d, stage_blocks);
    CUDA_CHECK(cudaGetLastError());
}

extern "C" void *kvs_paris_cuda_host_alloc(struct kvs_backend *b, size_t bytes, char *err, size_t errlen)
{
    return cu_host_alloc(b, bytes, err, errlen);
}
extern "C" void kvs_paris_cuda_host_free(struct kvs_backend *b, void *p) { cu_host_free(b, p); }
extern "C" void kvs_paris_cuda_write_out(struct kvs_backend *b, const struct kvs_dbuf *kc, const struct kvs_dbuf *vc,
                                         const struct kvs_attn_meta *m, const struct kvs_dbuf *jobs,
                                         const int32_t *h_jobs, int n_jobs, int layer, int n_layers, int n_kv_heads,
                                         int head_dim, int block_size, const struct kvs_dbuf *pages, int page_stride,
                                         void *host_k, void *host_v)
{
    cu_write_out(b, kc, vc, m, jobs, h_jobs, n_jobs, layer, n_layers, n_kv_heads, head_dim, block_size, pages,
                 page_stride, host_k, host_v);
}
extern "C" void kvs_paris_cuda_gather(struct kvs_backend *b, const struct kvs_dbuf *kc, const struct kvs_dbuf *vc,
                                      const struct kvs_attn_meta *m, const struct kvs_dbuf *rows,
                                      const int32_t *h_rows, int n, int layer, int n_layers, int n_kv_heads,
                                      int head_dim, int block_size, const struct kvs_dbuf *n_spans,
                                      const struct kvs_dbuf *spans, int max_spans, const struct kvs_dbuf *pages,
                                      int page_stride, const void *host_k, const void *host_v,
                                      struct kvs_dbuf *stage_k, struct kvs_dbuf *stage_v, int stage_blocks)
{
    cu_gather(b, kc, vc, m, rows, h_rows, n, layer, n_layers, n_kv_heads, head_dim, block_size, n_spans, spans,
              max_spans, pages, page_stride, host_k, host_v, stage_k, stage_v, stage_blocks);
}

/* kernels/kv_paris.h host_view: the mapped pinned pages' host pointer is their device pointer
 * (checked at host_alloc), so the view is a buffer that is not on the backend's list (its
 * free_buf must never see it: host_view_free frees the struct only) */
extern "C" struct kvs_dbuf *kvs_paris_cuda_host_view(struct kvs_backend *b, void *host, size_t off, size_t n)
{
    (void)b;
    struct kvs_dbuf *v = (struct kvs_dbuf *)kvs_xcalloc(1, sizeof *v);
    v->kind = KVS_BUF_KV;
    v->n = n;
    v->d = (bf16 *)host + off;
    return v;
}
extern "C" void kvs_paris_cuda_host_view_free(struct kvs_backend *b, struct kvs_dbuf *view)
{
    (void)b;
    free(view);
}
