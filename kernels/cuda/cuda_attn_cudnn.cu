/* cuda_attn_cudnn.cu: prefill-attention kind 26, cuDNN's fused SDPA (cuda_attn_cudnn.h) through the
 * cuDNN frontend's graph API (header-only C++; the PyPI wheel nvidia-cudnn-frontend), with the
 * frontend's dynamic loading: every cuDNN entry point is looked up in the handle this file opens
 * with dlopen("libcudnn.so.9"), so nothing links against cuDNN. Compiled only with `make CUDA=1
 * CUDNN=/dir` (the Makefile: KVS_HAVE_CUDNN=1, cuDNN's and the frontend's headers).
 *
 * Why a library: hand-tuning k_attn_fa3 stopped well short of cuDNN's SDPA measured in the same
 * calls (bench/RESULTS.md, "Hopper prefill attention", parts 3-5).
 *
 * One launch = one cuDNN graph over the launch's prefill sequences (more than one query row):
 *   Q    [B, H, Sq, hd] bf16, ragged (rows packed, offsets per sequence): a copy of the launch's q
 *        (fp32) converted to bf16, the prefill rows only, packed (k_cdn_q);
 *   K, V [B, n_kv, Skv, hd] bf16, padded: the launch's keys gathered from the paged pool into
 *        a scratch of this file (k_cdn_kv). cuDNN can also read the pool in place through page
 *        tables (KVS_CUDA_CUDNN_PAGED=1: containers [n_blocks, n_kv, bs, hd], a page table
 *        [B, 1, pages, 1] per sequence), but that engine measured slower than the gathered copy
 *        (bench/RESULTS.md, "Hopper prefill attention, part 5"), and it reads
 *        whole pages: slots past a sequence's keys must hold finite values (a NaN there leaks
 *        through the zero probability; the gather copies only the keys and zero-fills the rest);
 *   mask causal, bottom-right aligned, with per-sequence lengths (padding mask): query i of a
 *        sequence of n rows at position pos attends keys 0 .. pos + i, as kvs_attn_meta says;
 *   O    ragged like Q, bf16; k_cdn_o writes it to out (fp32) and outh (bf16) at the launch's rows
 *        (where every sequence of the launch has more than one row, the packed rows are the
 *        launch's: cuDNN writes outh itself and k_cdn_o only widens it to out).
 * GQA is the SDPA's own (H a multiple of n_kv). The graph's dimensions are bucketed (Sq and the
 * key length to powers of two, at least 64) so prompts of similar lengths share a built graph;
 * the per-sequence lengths give the exact masks. Built graphs are cached per device by shape
 * (building one runs cuDNN's heuristics and compiles a plan). The small metadata (lengths, offsets, page tables) is made on
 * the device by k_cdn_prep from the launch's device arrays, so a launch uploads nothing.
 * Launches it does not take (rotation offsets of cached documents, block_valid, other head dims)
 * are never given to it (the plan in cuda_attention.cu).
 */
#include <dlfcn.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#define NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING
#define CUDNN_FRONTEND_SKIP_JSON_LIB
#include <cudnn_frontend.h>

#include "kernels/cuda/cuda_attn_cudnn.h"
#include "kernels/cuda/cuda_internal.cuh"

namespace fe = cudnn_frontend;
/* the frontend's dynamic loading resolves every entry point in this handle */
namespace cudnn_frontend {
void *cudnn_dlhandle = nullptr;
}

/* cuDNN 9.6: bottom-right causal masks with padding masks and any Sq / Skv, ragged Q with GQA */
#define CDN_MIN_VERSION 90600
#define CDN_MAX_SEQS 4096      /* k_cdn_prep maps sequences in shared memory */
#define CDN_MAX_GRAPHS 64      /* built graphs kept per device (then the cache starts over) */
#define CDN_MAX_DEVICES 64

enum { UID_Q = 1, UID_K, UID_V, UID_O, UID_RQ, UID_RO, UID_SQ, UID_SKV, UID_PTK, UID_PTV };

/* KVS_CUDA_CUDNN_PAGED=1: cuDNN reads K/V in place from the paged pool (comparisons; read once) */
static bool cdn_paged()
{
    static int v = -1;
    if (v < 0) {
        const char *e = getenv("KVS_CUDA_CUDNN_PAGED");
        v = e && atoi(e) == 1;
    }
    return v == 1;
}

static std::mutex g_load_mu;
static int g_load_state; /* 0 not tried, 1 loaded, 2 failed */
static std::atomic<int> g_logged{0};
static std::atomic<long long> g_taken{0};

long long kvs_cu_attn_cudnn_count(void) { return g_taken.load(); }

/* the one line a process logs when kind 26 gives a launch back to kind 14 (later ones: DEBUG) */
static void cdn_fail(const std::string &why)
{
    const int first = g_logged.exchange(1) == 0;
    kvs_log(first ? KVS_LOG_WARN : KVS_LOG_DEBUG, "cuda: cuDNN prefill attention (kind 26) not used: %s; kind 14 runs instead",
            why.c_str());
}

int kvs_cu_attn_cudnn_available(void)
{
    std::lock_guard<std::mutex> lk(g_load_mu);
    if (g_load_state) return g_load_state == 1;
    g_load_state = 2;
    dlerror();
    void *h = dlopen("libcudnn.so.9", RTLD_NOW | RTLD_GLOBAL);
    if (!h) {
        const char *e = dlerror();
        cdn_fail(std::string("cannot open libcudnn.so.9 (") + (e ? e : "?") + "; LD_LIBRARY_PATH names its directory)");
        return 0;
    }
    size_t (*ver)(void) = (size_t(*)(void))dlsym(h, "cudnnGetVersion");
    if (!ver) {
        cdn_fail("libcudnn.so.9 has no cudnnGetVersion");
        return 0;
    }
    const size_t v = ver();
    if (v < CDN_MIN_VERSION) {
        cdn_fail("libcudnn " + std::to_string(v) + " is older than 9.6 (" + std::to_string(CDN_MIN_VERSION) + ")");
        return 0;
    }
    fe::cudnn_dlhandle = h;
    g_load_state = 1;
    kvs_log(KVS_LOG_INFO, "cuda: cuDNN %zu.%zu.%zu opened for the prefill attention (kind 26; built against %d)", v / 10000,
            v / 100 % 100, v % 100, (int)CUDNN_VERSION);
    return 1;
}

/* ---- device kernels: metadata, Q in, O out ---- */

/* One block. Sequence s of more than one row gets the packed index b (order of s) and its first
 * packed row cstart[s] (-1 for the others); for each b: its lengths, Q/O's ragged offset in
 * elements, and its page-table row (pages entries: block table entries past max_blocks are 0, a
 * valid block the masks never let the kernel read). */
__global__ void k_cdn_prep(const int32_t *q_start, const int32_t *pos, const int32_t *bt, int n_seqs, int max_blocks,
                           int pages, int row_elems, int32_t *cstart, int32_t *seq_q, int32_t *seq_kv, int32_t *rag,
                           int32_t *bmap, int32_t *pt)
{
    extern __shared__ int32_t map[]; /* b -> s */
    __shared__ int n_b, rows;
    if (threadIdx.x == 0) {
        int b = 0, r = 0;
        for (int s = 0; s < n_seqs; s++) {
            const int ns = q_start[s + 1] - q_start[s];
            if (ns > 1) {
                map[b++] = s;
                cstart[s] = r;
                r += ns;
            } else cstart[s] = -1;
        }
        n_b = b;
        rows = r;
    }
    __syncthreads();
    const int B = n_b;
    for (int b = threadIdx.x; b < B; b += blockDim.x) {
        const int s = map[b], ns = q_start[s + 1] - q_start[s];
        seq_q[b] = ns;
        seq_kv[b] = pos[s] + ns;
        rag[b] = cstart[s] * row_elems;
        bmap[b] = s;
    }
    if (threadIdx.x == 0) rag[B] = rows * row_elems;
    for (long long i = threadIdx.x; pt && i < (long long)B * pages; i += blockDim.x) {
        const int b = (int)(i / pages), j = (int)(i % pages);
        pt[i] = j < max_blocks ? bt[(size_t)map[b] * max_blocks + j] : 0;
    }
}

/* grid (page j, packed sequence b, KV head h): the keys of page j of sequence bmap[b] into the
 * padded K / V scratch [B][n_kv][Skv][hd]; slots past the sequence's keys are written as zeros
 * (the pool's may hold anything). 16-byte copies: hd a multiple of 8. */
__global__ void k_cdn_kv(const bf16 *kc, const bf16 *vc, const int32_t *bt, const int32_t *bmap, const int32_t *seq_kv,
                         int max_blocks, int n_kv, int bs, int hd, int skv, bf16 *kd, bf16 *vd)
{
    const int j = blockIdx.x, b = blockIdx.y, h = blockIdx.z;
    const int len = seq_kv[b];
    if (j * bs >= len) return;
    const size_t blk = (size_t)bt[(size_t)bmap[b] * max_blocks + j];
    const int vec = hd / 8; /* uint4 per key */
    const uint4 *ks = (const uint4 *)(kc + (blk * n_kv + h) * (size_t)bs * hd);
    const uint4 *vs = (const uint4 *)(vc + (blk * n_kv + h) * (size_t)bs * hd);
    uint4 *kt = (uint4 *)(kd + (((size_t)b * n_kv + h) * skv + (size_t)j * bs) * hd);
    uint4 *vt = (uint4 *)(vd + (((size_t)b * n_kv + h) * skv + (size_t)j * bs) * hd);
    const int n = bs * vec;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const bool in = j * bs + i / vec < len;
        const uint4 z = make_uint4(0, 0, 0, 0);
        kt[i] = in ? ks[i] : z;
        vt[i] = in ? vs[i] : z;
    }
}

/* the packed row of launch row t, or -1 where t's sequence has one row */
__device__ __forceinline__ int cdn_row(const int32_t *q_start, const int32_t *cstart, int n_seqs, int t)
{
    int lo = 0, hi = n_seqs - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (q_start[mid] <= t) lo = mid; else hi = mid - 1;
    }
    const int c = cstart[lo];
    return c < 0 ? -1 : c + t - q_start[lo];
}

/* a block per launch row: q (fp32) -> the packed bf16 Q; row_elems a multiple of 4 */
__global__ void k_cdn_q(const float *q, const int32_t *q_start, const int32_t *cstart, int n_seqs, int row_elems, bf16 *qh)
{
    const int r = cdn_row(q_start, cstart, n_seqs, blockIdx.x);
    if (r < 0) return;
    const float4 *src = (const float4 *)(q + (size_t)blockIdx.x * row_elems);
    __nv_bfloat162 *dst = (__nv_bfloat162 *)(qh + (size_t)r * row_elems);
    for (int i = threadIdx.x; i < row_elems / 4; i += blockDim.x) {
        const float4 v = src[i];
        dst[2 * i] = __floats2bfloat162_rn(v.x, v.y);
        dst[2 * i + 1] = __floats2bfloat162_rn(v.z, v.w);
    }
}

/* a block per launch row: the packed bf16 O -> out (fp32) and outh (bf16, may be NULL) */
__global__ void k_cdn_o(const bf16 *oh, const int32_t *q_start, const int32_t *cstart, int n_seqs, int row_elems, float *out,
                        bf16 *outh)
{
    const int r = cdn_row(q_start, cstart, n_seqs, blockIdx.x);
    if (r < 0) return;
    const __nv_bfloat162 *src = (const __nv_bfloat162 *)(oh + (size_t)r * row_elems);
    float2 *dst = (float2 *)(out + (size_t)blockIdx.x * row_elems);
    __nv_bfloat162 *dh = outh ? (__nv_bfloat162 *)(outh + (size_t)blockIdx.x * row_elems) : nullptr;
    for (int i = threadIdx.x; i < row_elems / 2; i += blockDim.x) {
        const __nv_bfloat162 v = src[i];
        dst[i] = __bfloat1622float2(v);
        if (dh) dh[i] = v;
    }
}

/* ---- per-device state: handle, graphs, scratch ---- */

struct cdn_key {
    long long nblk;
    int B, sq, pages, H, Hkv, hd, bs, skv, paged;
    float scale;
    bool operator==(const cdn_key &o) const
    {
        return nblk == o.nblk && B == o.B && sq == o.sq && pages == o.pages && H == o.H && Hkv == o.Hkv && hd == o.hd &&
               bs == o.bs && skv == o.skv && paged == o.paged && scale == o.scale;
    }
};
struct cdn_key_hash {
    size_t operator()(const cdn_key &k) const
    {
        size_t h = (size_t)k.nblk;
        const int v[9] = {k.B, k.sq, k.pages, k.H, k.Hkv, k.hd, k.bs, k.skv, k.paged};
        for (int x : v) h = h * 1000003u ^ (size_t)x;
        return h;
    }
};
struct cdn_graph {
    std::shared_ptr<fe::graph::Graph> g; /* null: this shape failed (not retried) */
    int64_t ws = 0;
};
struct cdn_dev {
    std::mutex mu;
    cudnnHandle_t h = nullptr;
    bool h_failed = false;
    std::unordered_map<cdn_key, cdn_graph, cdn_key_hash> graphs;
    bf16 *qh = nullptr, *oh = nullptr;
    size_t q_cap = 0, o_cap = 0; /* elements */
    int32_t *meta = nullptr;
    size_t meta_cap = 0; /* ints */
    bf16 *kk = nullptr, *vv = nullptr; /* the gathered K / V */
    size_t k_cap = 0, v_cap = 0;
    void *ws = nullptr;
    size_t ws_cap = 0;
};
static cdn_dev g_dev[CDN_MAX_DEVICES];

static std::string fe_why(fe::error_t &e) { return e.get_message(); }

/* builds the graph of one shape; on failure returns a null graph and says why */
static cdn_graph cdn_build(cudnnHandle_t h, const cdn_key &k, std::string &why)
{
    cdn_graph r;
    try {
        auto g = std::make_shared<fe::graph::Graph>();
        g->set_io_data_type(fe::DataType_t::BFLOAT16)
            .set_intermediate_data_type(fe::DataType_t::FLOAT)
            .set_compute_data_type(fe::DataType_t::FLOAT);
        const int64_t B = k.B, H = k.H, S = k.sq, D = k.hd, HK = k.Hkv, BS = k.bs, P = k.pages, SK = k.skv;
        auto i32 = [&](const char *name, int64_t uid, std::vector<int64_t> dim, std::vector<int64_t> stride) {
            return g->tensor(fe::graph::Tensor_attributes()
                                 .set_name(name)
                                 .set_uid(uid)
                                 .set_dim(dim)
                                 .set_stride(stride)
                                 .set_data_type(fe::DataType_t::INT32));
        };
        auto rq = i32("ragged_q", UID_RQ, {B + 1, 1, 1, 1}, {1, 1, 1, 1});
        auto ro = i32("ragged_o", UID_RO, {B + 1, 1, 1, 1}, {1, 1, 1, 1});
        auto sq = i32("seq_q", UID_SQ, {B, 1, 1, 1}, {1, 1, 1, 1});
        auto skv = i32("seq_kv", UID_SKV, {B, 1, 1, 1}, {1, 1, 1, 1});
        /* rows packed token-major: [token][head][dim] */
        auto Q = g->tensor(fe::graph::Tensor_attributes()
                               .set_name("Q")
                               .set_uid(UID_Q)
                               .set_dim({B, H, S, D})
                               .set_stride({S * H * D, D, H * D, 1})
                               .set_ragged_offset(rq));
        /* paged: the pool's blocks; else the gathered [B][n_kv][Skv][hd] */
        const std::vector<int64_t> kdim = k.paged ? std::vector<int64_t>{k.nblk, HK, BS, D} : std::vector<int64_t>{B, HK, SK, D};
        const std::vector<int64_t> kstr = k.paged ? std::vector<int64_t>{HK * BS * D, BS * D, D, 1}
                                                  : std::vector<int64_t>{HK * SK * D, SK * D, D, 1};
        auto K = g->tensor(fe::graph::Tensor_attributes().set_name("K").set_uid(UID_K).set_dim(kdim).set_stride(kstr));
        auto V = g->tensor(fe::graph::Tensor_attributes().set_name("V").set_uid(UID_V).set_dim(kdim).set_stride(kstr));
        auto opt = fe::graph::SDPA_attributes()
                       .set_name("prefill_sdpa")
                       .set_generate_stats(false)
                       .set_attn_scale(k.scale)
                       .set_causal_mask_bottom_right(true)
                       .set_padding_mask(true)
                       .set_seq_len_q(sq)
                       .set_seq_len_kv(skv);
        if (k.paged)
            opt.set_paged_attention_k_table(i32("page_table_k", UID_PTK, {B, 1, P, 1}, {P, 1, 1, 1}))
                .set_paged_attention_v_table(i32("page_table_v", UID_PTV, {B, 1, P, 1}, {P, 1, 1, 1}))
                .set_paged_attention_max_seq_len_kv((int)(P * BS));
        auto outs = g->sdpa(Q, K, V, opt);
        outs[0]->set_output(true).set_uid(UID_O).set_dim({B, H, S, D}).set_stride({S * H * D, D, H * D, 1}).set_ragged_offset(ro);
        fe::error_t e;
        if (!(e = g->validate()).is_good()) { why = "validate: " + fe_why(e); return r; }
        if (!(e = g->build_operation_graph(h)).is_good()) { why = "operation graph: " + fe_why(e); return r; }
        if (!(e = g->create_execution_plans({fe::HeurMode_t::A})).is_good()) { why = "plans: " + fe_why(e); return r; }
        if (!(e = g->check_support(h)).is_good()) { why = "support: " + fe_why(e); return r; }
        if (!(e = g->build_plans(h)).is_good()) { why = "build: " + fe_why(e); return r; }
        int64_t ws = 0;
        if (!(e = g->get_workspace_size(ws)).is_good()) { why = "workspace: " + fe_why(e); return r; }
        r.g = g;
        r.ws = ws;
    } catch (const std::exception &ex) {
        why = std::string("exception: ") + ex.what();
        r.g.reset();
    }
    return r;
}

/* next power of two >= x, at least 64 */
static int cdn_bucket(int x)
{
    int b = 64;
    while (b < x) b <<= 1;
    return b;
}

/* grows a device buffer; false where it would have to allocate inside a stream capture */
template <typename T> static bool cdn_grow(T **p, size_t *cap, size_t need, bool capturing)
{
    if (need <= *cap) return true;
    if (capturing) return false;
    if (*p) CUDA_CHECK(cudaFree(*p));
    *p = nullptr;
    *cap = 0;
    size_t n = need + need / 4;
    if (cudaMalloc((void **)p, n * sizeof(T)) != cudaSuccess) {
        cudaGetLastError(); /* out of memory: give the launch back */
        *p = nullptr;
        return false;
    }
    *cap = n;
    return true;
}

int kvs_cu_attn_cudnn(const struct kvs_cu_attn *a, cudaStream_t st)
{
    if (a->rot || a->valid || (a->hd != 64 && a->hd != 128) || a->n_heads % a->n_kv != 0) return 0;
    if (a->n_seqs > CDN_MAX_SEQS) {
        cdn_fail("more than " + std::to_string(CDN_MAX_SEQS) + " sequences in one launch");
        return 0;
    }
    if (!kvs_cu_attn_cudnn_available()) return 0;
    int B = 0, max_q = 1, max_kv = 1;
    for (int s = 0; s < a->n_seqs; s++) {
        const int ns = a->h_q_start[s + 1] - a->h_q_start[s];
        if (ns <= 1) continue;
        B++;
        if (ns > max_q) max_q = ns;
        if (a->h_pos[s] + ns > max_kv) max_kv = a->h_pos[s] + ns;
    }
    if (B == 0) return 1; /* no prefill rows: nothing to do */
    int dev = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    KVS_ASSERT(dev >= 0 && dev < CDN_MAX_DEVICES);
    cdn_dev &d = g_dev[dev];
    std::lock_guard<std::mutex> lk(d.mu);
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    CUDA_CHECK(cudaStreamIsCapturing(st, &cs));
    const bool capturing = cs != cudaStreamCaptureStatusNone;
    if (!d.h) {
        if (d.h_failed || capturing) return 0;
        cudnnStatus_t s = fe::detail::create_handle(&d.h);
        if (s != CUDNN_STATUS_SUCCESS) {
            d.h_failed = true;
            d.h = nullptr;
            cdn_fail(std::string("cudnnCreate: ") + fe::detail::get_error_string(s));
            return 0;
        }
    }
    cdn_key k;
    k.nblk = (long long)(a->kv_elems / ((size_t)a->n_kv * a->bs * a->hd));
    k.B = B;
    k.sq = cdn_bucket(max_q);
    k.skv = cdn_bucket(max_kv > k.sq ? max_kv : k.sq);
    k.paged = cdn_paged();
    k.pages = k.paged ? (k.skv + a->bs - 1) / a->bs : 0;
    k.H = a->n_heads;
    k.Hkv = a->n_kv;
    k.hd = a->hd;
    k.bs = a->bs;
    k.scale = a->scale;
    auto it = d.graphs.find(k);
    if (it == d.graphs.end()) {
        if (capturing) return 0; /* building may allocate: not inside a capture */
        if (d.graphs.size() >= CDN_MAX_GRAPHS) d.graphs.clear();
        std::string why;
        cdn_graph g = cdn_build(d.h, k, why);
        if (!g.g)
            cdn_fail("graph for " + std::to_string(B) + " sequences, Sq " + std::to_string(k.sq) + ", Skv " +
                     std::to_string(k.skv) + (k.paged ? " (paged)" : "") + ", head_dim " + std::to_string(a->hd) + ": " + why);
        it = d.graphs.emplace(k, g).first;
    }
    if (!it->second.g) return 0;
    const int row_elems = a->n_heads * a->hd;
    const size_t qo = (size_t)a->n * row_elems;
    const size_t meta = (size_t)a->n_seqs + 4 * (size_t)B + 1 + (size_t)B * k.pages;
    const size_t kvn = k.paged ? 0 : (size_t)B * a->n_kv * k.skv * a->hd;
    /* the gathered K / V: zeroed when (re)allocated, later only ever holding keys or zeros, so
     * the padding cuDNN may read past a sequence's keys is finite */
    const bool k_new = kvn > d.k_cap, v_new = kvn > d.v_cap;
    if (!cdn_grow(&d.qh, &d.q_cap, qo, capturing) || !cdn_grow(&d.oh, &d.o_cap, qo, capturing) ||
        !cdn_grow(&d.meta, &d.meta_cap, meta, capturing) || !cdn_grow(&d.kk, &d.k_cap, kvn, capturing) ||
        !cdn_grow(&d.vv, &d.v_cap, kvn, capturing) ||
        !cdn_grow((char **)&d.ws, &d.ws_cap, (size_t)it->second.ws, capturing)) {
        cdn_fail(capturing ? "scratch would grow inside a stream capture" : "out of device memory for its scratch");
        return 0;
    }
    if (k_new && kvn) CUDA_CHECK(cudaMemsetAsync(d.kk, 0, d.k_cap * sizeof(bf16), st));
    if (v_new && kvn) CUDA_CHECK(cudaMemsetAsync(d.vv, 0, d.v_cap * sizeof(bf16), st));
    int32_t *cstart = d.meta, *seq_q = cstart + a->n_seqs, *seq_kv = seq_q + B, *rag = seq_kv + B, *bmap = rag + B + 1;
    int32_t *pt = k.paged ? bmap + B : nullptr;
    /* every sequence of more than one row: the packed rows are the launch's, O goes to outh */
    bool all_pre = a->outh != nullptr;
    for (int s = 0; s < a->n_seqs && all_pre; s++) all_pre = a->h_q_start[s + 1] - a->h_q_start[s] != 1;
    /* plain launches (no PDL, cuda_launch.h): each starts once the previous kernel has finished */
    k_cdn_prep<<<1, 256, (size_t)a->n_seqs * sizeof(int32_t), st>>>(a->q_start, a->pos, a->bt, a->n_seqs, a->max_blocks,
                                                                     k.pages, row_elems, cstart, seq_q, seq_kv, rag, bmap, pt);
    LAUNCH_CHECK();
    if (!k.paged) {
        dim3 grid((unsigned)((max_kv + a->bs - 1) / a->bs), (unsigned)B, (unsigned)a->n_kv);
        k_cdn_kv<<<grid, 128, 0, st>>>(a->kc, a->vc, a->bt, bmap, seq_kv, a->max_blocks, a->n_kv, a->bs, a->hd, k.skv, d.kk,
                                       d.vv);
        LAUNCH_CHECK();
    }
    k_cdn_q<<<(unsigned)a->n, 256, 0, st>>>(a->q, a->q_start, cstart, a->n_seqs, row_elems, d.qh);
    LAUNCH_CHECK();
    cudnnStatus_t ss = fe::detail::set_stream(d.h, st);
    if (ss != CUDNN_STATUS_SUCCESS) {
        cdn_fail(std::string("cudnnSetStream: ") + fe::detail::get_error_string(ss));
        return 0; /* what was enqueued so far wrote only this file's scratch */
    }
    std::unordered_map<int64_t, void *> pack = {
        {UID_Q, d.qh}, {UID_O, all_pre ? (void *)a->outh : (void *)d.oh}, {UID_RQ, rag}, {UID_RO, rag}, {UID_SQ, seq_q},
        {UID_SKV, seq_kv},
    };
    if (k.paged) {
        pack[UID_K] = (void *)a->kc;
        pack[UID_V] = (void *)a->vc;
        pack[UID_PTK] = pt;
        pack[UID_PTV] = pt;
    } else {
        pack[UID_K] = d.kk;
        pack[UID_V] = d.vv;
    }
    fe::error_t e = [&]() -> fe::error_t {
        try {
            return it->second.g->execute(d.h, pack, d.ws);
        } catch (const std::exception &ex) {
            return fe::error_t{fe::error_code_t::GRAPH_EXECUTION_FAILED, ex.what()};
        }
    }();
    if (!e.is_good()) {
        cudaGetLastError();
        cdn_fail("execute: " + fe_why(e));
        it->second.g.reset(); /* this shape stays on kind 14 */
        return 0;
    }
    if (all_pre) k_cdn_o<<<(unsigned)a->n, 256, 0, st>>>(a->outh, a->q_start, cstart, a->n_seqs, row_elems, a->out, nullptr);
    else k_cdn_o<<<(unsigned)a->n, 256, 0, st>>>(d.oh, a->q_start, cstart, a->n_seqs, row_elems, a->out, a->outh);
    LAUNCH_CHECK();
    g_taken++;
    return 1;
}
