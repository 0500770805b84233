/* kv_lean_dyn_prefill.cu: LeanKV's dynamic mode on the GPU, the paper's prefill for prompt chunks
 * (kernels/kv_lean_dyn_cuda.h kvs_lean_dyn_cuda_reserve_rows; the CPU's kvs_lean_dyn_head_prefill
 * in kernels/kv_lean_dyn.h is the reference it is held to).
 *
 * Row by row through Algorithm 1 (k_dyn_step), a chunk's rows ran one after another in one block
 * per head, each reading every stored token: an 8K prompt took minutes (bench/RESULTS.md, fid6).
 * Here a chunk is three launches after the page round, none sequential over rows:
 *   1. k_pf_attend: a warp per (head, row): the row's q heads attend over the head's stored tokens
 *      (sections dequantized on the fly, the bf16 window) and the chunk's rows up to its own (as
 *      bf16, what the window keeps), online softmax; the output (merged with the documents' part
 *      when there is one) and the row's (M, L) per q head: its max logit and sum, documents
 *      included, from which any token's probability is exp(logit - M) / L;
 *   2. k_pf_score: a warp per 4 tokens: every row that sees them again (the same logits, the same
 *      operations as 1), their probabilities, max over the group, summed in row order; a stored
 *      token's sum is added to its score sum once, a chunk token's kept for 3 (the paper's extra
 *      pass);
 *   3. k_pf_place: a block per head: the tokens that leave the window (the oldest T - W of the old
 *      window's and the chunk's) are decided by the prompt rule (alpha / (pos + 1), the host's
 *      comparison in double), their section indices come from one block scan, and a warp each
 *      quantizes them (the host's quantizer: the same bytes as the CPU for the same scores); the
 *      window keeps the newest min(T, W) at their sequence slots.
 * The logits are fp32 dot products in lane order then a warp butterfly; the CPU sums in index
 * order, so scores and outputs agree to fp32 rounding (the tests hold them to 1e-5) and a token
 * whose score sits on a threshold within that may be placed differently. */
#include <cub/block/block_scan.cuh>
#include <cuda_bf16.h>
#include <errno.h>
#include <math.h>

#include "kernels/cuda/kv_lean_dyn_device.cuh"

#define PF_TPW 4                  /* tokens a warp of k_pf_score holds */
#define PF_TPB (PF_TPW * DYN_WARPS)

/* token t of a job as the prefill reads it: stored (t < nprev: sections, window) or the chunk's
 * row t - nprev (fp32 in the step's buffer, read as bf16: what the window keeps of it) */
struct pf_ref {
    dyn_tv tv;
    const float *c;
};

__device__ __forceinline__ float bf16r(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

__device__ __forceinline__ pf_ref pf_tok(const dyn_dev &D, int st, const dyn_head &h, int nprev, int t, int v,
                                         const float *kv, const struct kvs_lean_dyn_cuda_job &J)
{
    pf_ref r;
    r.c = NULL;
    if (t < nprev) r.tv = tok_ref(D, st, h, t, v);
    else r.c = kv + ((long long)(J.row0 + t - nprev) * D.nkv + J.g) * D.hd;
    return r;
}

__device__ __forceinline__ float pf_elem(const pf_ref &r, int i) { return r.c ? bf16r(r.c[i]) : tv_elem(r.tv, i); }

/* the G logits of a row's q heads (qr: the lane's dims) with token r's K, in every lane */
template <int GM, int KM>
__device__ __forceinline__ void pf_dot(const pf_ref &kr, const float (&qr)[GM][KM], int G, int hd, float scale,
                                       float (&lg)[GM])
{
    const int lane = threadIdx.x & 31;
    float x[KM];
#pragma unroll
    for (int kk = 0; kk < KM; kk++) x[kk] = lane + 32 * kk < hd ? pf_elem(kr, lane + 32 * kk) : 0.0f;
#pragma unroll
    for (int g = 0; g < GM; g++) {
        float a = 0.0f;
        if (g < G) {
#pragma unroll
            for (int kk = 0; kk < KM; kk++) a = fmaf(qr[g][kk], x[kk], a);
            for (int o = 16; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
        }
        lg[g] = a * scale;
    }
}

template <int GM, int KM>
__device__ __forceinline__ void pf_load_q(const dyn_dev &D, const float *q, int row, int g0, float (&qr)[GM][KM])
{
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int g = 0; g < GM; g++)
#pragma unroll
        for (int kk = 0; kk < KM; kk++) {
            const int i = lane + 32 * kk;
            qr[g][kk] = g < D.G && i < D.hd ? q[((long long)row * D.nq + g0 + g) * D.hd + i] : 0.0f;
        }
}

/* 1. a warp per (job, row): attention, output, (M, L) */
template <int GM, int KM>
__global__ void __launch_bounds__(DYN_THREADS) k_pf_attend(dyn_dev D, const float *q, const float *k, const float *v,
                                                          const float *ext, float scale, float *out, int layer)
{
    if (D.pm->err) return;   /* the round failed: no job has its pages */
    const struct kvs_lean_dyn_cuda_job J = D.jobs[blockIdx.x];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, r = blockIdx.y * DYN_WARPS + warp;
    if (J.head < 0 || J.rows < 2 || r >= J.rows) return;
    const int st = J.head + layer * D.layer_stride, G = D.G, hd = D.hd, row = J.row0 + r, g0 = J.g * G;
    const dyn_head h = D.heads[st];
    const int nprev = h.n_high + h.n_low + h.w_n, n = nprev + r + 1;
    float qr[GM][KM], o[GM][KM], m[GM], l[GM];
    pf_load_q<GM, KM>(D, q, row, g0, qr);
#pragma unroll
    for (int g = 0; g < GM; g++) {
        m[g] = -INFINITY, l[g] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < KM; kk++) o[g][kk] = 0.0f;
    }
    for (int t = 0; t < n; t++) {
        float lg[GM], x[KM];
        pf_dot<GM, KM>(pf_tok(D, st, h, nprev, t, 0, k, J), qr, G, hd, scale, lg);
        const pf_ref vr = pf_tok(D, st, h, nprev, t, 1, v, J);
#pragma unroll
        for (int kk = 0; kk < KM; kk++) x[kk] = lane + 32 * kk < hd ? pf_elem(vr, lane + 32 * kk) : 0.0f;
#pragma unroll
        for (int g = 0; g < GM; g++) {
            if (g >= G) break;
            const float s = lg[g];
            if (s > m[g]) {
                const float corr = expf(m[g] - s);
                l[g] *= corr;
#pragma unroll
                for (int kk = 0; kk < KM; kk++) o[g][kk] *= corr;
                m[g] = s;
            }
            const float wt = expf(s - m[g]);
            l[g] += wt;
#pragma unroll
            for (int kk = 0; kk < KM; kk++) o[g][kk] = fmaf(wt, x[kk], o[g][kk]);
        }
    }
#pragma unroll
    for (int g = 0; g < GM; g++) {
        if (g >= G) break;
        const long long qh = (long long)row * D.nq + g0 + g;
        const float e = ext ? ext[qh] : -INFINITY;
        float M = m[g], L = l[g], a = 1.0f, b = 0.0f;
        if (e > -INFINITY) {
            /* the documents' (o, lse) joins: weights exp(. - M) of both sums */
            M = m[g] > e ? m[g] : e, a = expf(m[g] - M), b = expf(e - M), L = l[g] * a + b;
        }
        const float inv = 1.0f / L;
#pragma unroll
        for (int kk = 0; kk < KM; kk++) {
            const int i = lane + 32 * kk;
            if (i >= hd) continue;
            float *op = out + qh * hd + i;
            *op = e > -INFINITY ? (o[g][kk] * a + *op * b) * inv : o[g][kk] * inv;
        }
        if (lane == 0) D.pf_ml[2 * qh] = M, D.pf_ml[2 * qh + 1] = L;
    }
}

/* 2. a warp per PF_TPW tokens of a job: their probabilities over the rows that see them, max over
 * the group, summed in row order (blocks stride over the job's tokens) */
template <int GM, int KM>
__global__ void __launch_bounds__(DYN_THREADS) k_pf_score(dyn_dev D, const float *q, const float *k, float scale,
                                                         int layer)
{
    if (D.pm->err) return;
    const struct kvs_lean_dyn_cuda_job J = D.jobs[blockIdx.x];
    if (J.head < 0 || J.rows < 2) return;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int st = J.head + layer * D.layer_stride, G = D.G, hd = D.hd, W = D.W, g0 = J.g * G;
    const dyn_head h = D.heads[st];
    const int nhl = h.n_high + h.n_low, nprev = nhl + h.w_n, ntot = nprev + J.rows;
    for (int base = blockIdx.y * PF_TPB + warp * PF_TPW; base < ntot; base += gridDim.y * PF_TPB) {
        /* the tokens' K (the lane's dims), and the first row that sees each */
        float kx[PF_TPW][KM], sum[PF_TPW];
        int r0[PF_TPW];
#pragma unroll
        for (int u = 0; u < PF_TPW; u++) {
            const int t = base + u;
            sum[u] = 0.0f;
            r0[u] = t < nprev ? 0 : t < ntot ? t - nprev : J.rows;
            const pf_ref kr = t < ntot ? pf_tok(D, st, h, nprev, t, 0, k, J) : pf_ref{};
#pragma unroll
            for (int kk = 0; kk < KM; kk++) kx[u][kk] = t < ntot && lane + 32 * kk < hd ? pf_elem(kr, lane + 32 * kk) : 0.0f;
        }
        for (int r = r0[0]; r < J.rows; r++) {
            const int row = J.row0 + r;
            float qr[GM][KM];
            pf_load_q<GM, KM>(D, q, row, g0, qr);
#pragma unroll
            for (int u = 0; u < PF_TPW; u++) {
                if (r < r0[u]) continue;
                /* pf_dot's operations on the held K: the logits of k_pf_attend to the bit */
                float sc = 0.0f;
#pragma unroll
                for (int g = 0; g < GM; g++) {
                    if (g >= G) break;
                    float a = 0.0f;
#pragma unroll
                    for (int kk = 0; kk < KM; kk++) a = fmaf(qr[g][kk], kx[u][kk], a);
                    for (int o = 16; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
                    const long long qh = (long long)row * D.nq + g0 + g;
                    const float p = expf(a * scale - D.pf_ml[2 * qh]) / D.pf_ml[2 * qh + 1];
                    sc = g ? fmaxf(sc, p) : p;
                }
                sum[u] += sc;
            }
        }
#pragma unroll
        for (int u = 0; u < PF_TPW; u++) {
            const int t = base + u;
            if (lane != 0 || t >= ntot) continue;
            if (t < nhl) {
                const int hi = t < h.n_high;
                uint8_t *e = entry_at(D, st, hi, hi ? t : t - h.n_high);
                e_set(e, e_pos(e), e_acc(e) + sum[u]);
            } else if (t < nprev) {
                D.wacc[(long long)st * (W + 1) + (h.w_start + t - nhl) % (W + 1)] += sum[u];
            } else {
                D.pf_tsum[(long long)(J.row0 + t - nprev) * D.nkv + J.g] = sum[u];
            }
        }
    }
}

/* 3. a block per job: the prompt rule for the tokens leaving the window, then the window */
__global__ void __launch_bounds__(DYN_THREADS) k_pf_place(dyn_dev D, const float *k, const float *v, int layer)
{
    typedef cub::BlockScan<long long, DYN_THREADS> pf_scan;
    __shared__ typename pf_scan::TempStorage tmp;
    __shared__ dyn_head h;
    __shared__ int tier_s[DYN_THREADS], idx_s[DYN_THREADS], pos_s[DYN_THREADS];
    __shared__ float acc_s[DYN_THREADS];
    __shared__ float xs[DYN_WARPS][2][DYN_MAXHD];
    __shared__ long long carry_hi, carry_lo;
    if (D.pm->err) return;
    const struct kvs_lean_dyn_cuda_job J = D.jobs[blockIdx.x];
    if (J.head < 0 || J.rows < 2) return;
    const int st = J.head + layer * D.layer_stride, hd = D.hd, W = D.W, tid = threadIdx.x;
    const int warp = tid >> 5, lane = tid & 31;
    if (tid == 0) h = D.heads[st], carry_hi = 0, carry_lo = 0;
    __syncthreads();
    const int nw = h.w_n, T = nw + J.rows, leave = T > W ? T - W : 0, ws0 = h.w_start;
    const int32_t last = J.pos0 + J.rows - 1;
    const long long wb = (long long)st * (W + 1);
    for (int base = 0; base < leave; base += DYN_THREADS) {
        const int t = base + tid;
        int tier = 0, pos = 0;
        float acc = 0.0f;
        if (t < leave) {
            if (t < nw) {
                const int ws = (ws0 + t) % (W + 1);
                pos = D.wpos[wb + ws], acc = D.wacc[wb + ws];
            } else {
                pos = J.pos0 + t - nw, acc = D.pf_tsum[(long long)(J.row0 + t - nw) * D.nkv + J.g];
            }
            const float s = dyn_score(acc, pos, last);
            const double i1 = (double)pos + 1.0, th = D.alpha_h / i1, tl = D.alpha_l / i1;
            tier = s >= th ? KVS_LEAN_HIGH : s >= tl ? KVS_LEAN_LOW : 0;
        }
        const long long mine = (tier == KVS_LEAN_HIGH ? 1ll : 0ll) + (tier == KVS_LEAN_LOW ? 1ll << 32 : 0ll);
        long long excl, tot;
        pf_scan(tmp).ExclusiveSum(mine, excl, tot);
        tier_s[tid] = tier, pos_s[tid] = pos, acc_s[tid] = acc;
        idx_s[tid] = tier == KVS_LEAN_HIGH ? h.n_high + (int)(carry_hi + (excl & 0xffffffffll))
                                           : h.n_low + (int)(carry_lo + (excl >> 32));
        __syncthreads();
        /* a warp per placed token: its K and V (bf16 values, as the window holds them), quantized */
        const int nb = min(DYN_THREADS, leave - base);
        for (int j = warp; j < nb; j += DYN_WARPS) {
            if (!tier_s[j]) continue;
            const int tt = base + j, hi = tier_s[j] == KVS_LEAN_HIGH;
            if (tt < nw) {
                const long long wo = (wb + (ws0 + tt) % (W + 1)) * hd;
                for (int i = lane; i < hd; i += 32)
                    xs[warp][0][i] = __bfloat162float(D.wk[wo + i]), xs[warp][1][i] = __bfloat162float(D.wv[wo + i]);
            } else {
                const long long ko = ((long long)(J.row0 + tt - nw) * D.nkv + J.g) * hd;
                for (int i = lane; i < hd; i += 32) xs[warp][0][i] = bf16r(k[ko + i]), xs[warp][1][i] = bf16r(v[ko + i]);
            }
            __syncwarp();
            const dyn_fmt f = fmt_of(D, hi);
            uint8_t *e = entry_at(D, st, hi, idx_s[j]);
            if (lane == 0) e_set(e, pos_s[j], acc_s[j]);
            warp_quant(xs[warp][0], hd, f.kbits, e + 8);
            warp_quant(xs[warp][1], hd, f.vbits, e + 8 + f.kc + (f.kbits < 16 ? 4 : 0));
            __syncwarp();
        }
        __syncthreads();
        if (tid == 0) {
            const long long nh = tot & 0xffffffffll, nl = tot >> 32;
            carry_hi += nh, carry_lo += nl;
            h.pruned += nb - (int)(nh + nl);
        }
        __syncthreads();
    }
    /* the window: the newest min(T, W) at their sequence slots (the old window's that stay are
     * there already; the slots of the ones that left were read above) */
    const int t0 = leave > nw ? leave : nw;
    for (long long e = tid; e < (long long)(T - t0) * hd; e += DYN_THREADS) {
        const int t = t0 + (int)(e / hd), i = (int)(e % hd), c = t - nw;
        const long long ws = wb + (ws0 + t) % (W + 1), ko = ((long long)(J.row0 + c) * D.nkv + J.g) * hd;
        D.wk[ws * hd + i] = __float2bfloat16_rn(k[ko + i]), D.wv[ws * hd + i] = __float2bfloat16_rn(v[ko + i]);
        if (i == 0) D.wpos[ws] = J.pos0 + c, D.wacc[ws] = D.pf_tsum[(long long)(J.row0 + c) * D.nkv + J.g];
    }
    if (tid == 0) {
        h.n_high += (int)carry_hi, h.n_low += (int)carry_lo;
        if (h.n_high > h.max_high) h.max_high = h.n_high;
        if (h.n_low > h.max_low) h.max_low = h.n_low;
        h.seen = (h.seen ? h.seen : (long long)J.pos0) + J.rows;
        h.last_pos = last;
        h.w_start = (ws0 + leave) % (W + 1), h.w_n = T - leave;
        D.heads[st] = h;
        D.ev[st] = kvs_lean_event{-1, -1, 0, -1, -1, 0, 0};   /* no Algorithm 1 event */
    }
}

void dyn_prefill_launch(struct kvs_lean_dyn_cuda *x, int n_jobs, int layer, const float *q, const float *k,
                        const float *v, const float *ext, float scale, float *out)
{
    cudaStream_t s = x->b->stream;
    const dyn_dev &D = x->d;
    const int GM = D.G <= 2 ? 2 : D.G <= 4 ? 4 : 8, KM = D.hd <= 64 ? 2 : D.hd <= 128 ? 4 : 8;
    const dim3 ga((unsigned)n_jobs, (unsigned)((x->max_rows_job + DYN_WARPS - 1) / DYN_WARPS));
    /* the score pass: enough blocks to fill the GPU, each striding over its job's tokens */
    int ys = (x->target * 4) / n_jobs;
    const int most = (D.max_ctx + PF_TPB) / PF_TPB;
    if (ys > most) ys = most;
    if (ys < 1) ys = 1;
    const dim3 gs((unsigned)n_jobs, (unsigned)ys);
#define PF_ATTEND(gm, km)                                                                                           \
    if (GM == gm && KM == km) k_pf_attend<gm, km><<<ga, DYN_THREADS, 0, s>>>(D, q, k, v, ext, scale, out, layer)
    PF_ATTEND(2, 2); PF_ATTEND(2, 4); PF_ATTEND(2, 8);
    PF_ATTEND(4, 2); PF_ATTEND(4, 4); PF_ATTEND(4, 8);
    PF_ATTEND(8, 2); PF_ATTEND(8, 4); PF_ATTEND(8, 8);
#undef PF_ATTEND
    LAUNCH_CHECK();
#define PF_SCORE(gm, km)                                                                                            \
    if (GM == gm && KM == km) k_pf_score<gm, km><<<gs, DYN_THREADS, 0, s>>>(D, q, k, scale, layer)
    PF_SCORE(2, 2); PF_SCORE(2, 4); PF_SCORE(2, 8);
    PF_SCORE(4, 2); PF_SCORE(4, 4); PF_SCORE(4, 8);
    PF_SCORE(8, 2); PF_SCORE(8, 4); PF_SCORE(8, 8);
#undef PF_SCORE
    LAUNCH_CHECK();
    k_pf_place<<<n_jobs, DYN_THREADS, 0, s>>>(D, k, v, layer);
    LAUNCH_CHECK();
}

extern "C" int kvs_lean_dyn_cuda_reserve_rows(struct kvs_lean_dyn_cuda *x, int max_rows, char *err, size_t errlen)
{
    dyn_dev &D = x->d;
    if (max_rows <= D.pf_rows) return 0;
    float *ml = NULL, *ts = NULL;
    if (cudaMalloc((void **)&ml, (size_t)max_rows * D.nq * 2 * sizeof(float)) != cudaSuccess ||
        cudaMalloc((void **)&ts, (size_t)max_rows * D.nkv * sizeof(float)) != cudaSuccess) {
        cudaGetLastError();
        if (ml) cudaFree(ml);
        return kvs_err(err, errlen, -ENOMEM, "lean dynamic (cuda): cannot allocate the prefill's buffers for %d rows",
                       max_rows);
    }
    /* the previous buffers may still be read by queued launches */
    CUDA_CHECK(cudaStreamSynchronize(x->b->stream));
    if (D.pf_ml) cudaFree(D.pf_ml);
    if (D.pf_tsum) cudaFree(D.pf_tsum);
    D.pf_ml = ml, D.pf_tsum = ts, D.pf_rows = max_rows;
    return 0;
}
