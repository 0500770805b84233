/* kv_lean_dyn.cu: LeanKV's dynamic mode on the GPU (kernels/kv_lean_dyn_cuda.h): the page
 * manager's rounds, Algorithm 1's step with its attention, the window exit (prompt chunks take
 * the paper's prefill instead once its buffers are reserved: kv_lean_dyn_prefill.cu).
 *
 * One 256-thread block per head runs its rows in order (each row's window exit changes what the
 * next row reads); within a row every part is spread over the block: a thread per token for the
 * logits (codes read a 32-bit word at a time) and the scores, a warp per token with a lane per
 * dimension for the output (coalesced code reads, the chunk's token lookups and probabilities
 * staged in shared memory, the warps' sums added in warp order), and for the exit two warps
 * quantizing the leaving token's K and V at once (the host's min / max scan merged lane by lane,
 * whole code bytes stored: no read-modify-write of device memory), a block argmin over the
 * section, a demoted victim dequantized by all threads and its hole filled by the other warps
 * while warps 0 / 1 requantize it. Thread 0 keeps only the decisions (a few comparisons). The
 * arithmetic that decides bytes (quantize, dequantize, the score acc / queries, the thresholds
 * alpha / N in double) is the host's, operation for operation (__f*_rn: no contraction into fma),
 * so the same scores give the CPU's bytes. The first version ran the exit's vector work on
 * thread 0 and the output a thread per dimension; its TPOT was ~10x bf16's (bench/RESULTS.md). */
#include <cub/block/block_scan.cuh>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_internal.cuh"
#include "kernels/cuda/kv_lean_quant.cuh"
#include "kernels/cuda/kv_lean_dyn_device.cuh"

extern "C" {
#include "kernels/kv_lean_dyn_cuda.h"
}

/* ---- the page round and the trim ------------------------------------------------------------ */
/* the bodies take the block's size NT (the round's own launches: DYN_SCAN threads; folded into a
 * split decode step's launches: DYN_THREADS); every thread of the block calls them */

__device__ __forceinline__ int pages_for(int n, int per) { return (n + per - 1) / per; }

template <int NT> __device__ void dyn_alloc_body(const dyn_dev &D, int n_jobs, int layer)
{
    typedef cub::BlockScan<long long, NT> dyn_scan;
    __shared__ typename dyn_scan::TempStorage tmp;
    __shared__ long long carry;
    __shared__ int bad;
    if (threadIdx.x == 0) carry = 0, bad = 0;
    __syncthreads();
    if (D.pm->err) return;
    for (int base = 0; base < n_jobs; base += NT) {
        const int i = base + threadIdx.x;
        long long need = 0;
        if (i < n_jobs && D.jobs[i].head >= 0) {
            const int st = D.jobs[i].head + layer * D.layer_stride, rows = D.jobs[i].rows;
            const dyn_head h = D.heads[st];
            const int hi = min(h.n_high + rows, D.max_ctx), lo = min(h.n_low + rows, D.max_ctx);
            const int nh = max(pages_for(hi, D.tp_hi) - D.nhp[st], 0), nl = max(pages_for(lo, D.tp_lo) - D.nlp[st], 0);
            if (D.nhp[st] + D.nlp[st] + nh + nl > D.table_len) atomicExch(&bad, 1);
            D.need_hi[i] = nh, D.need_lo[i] = nl;
            need = nh + nl;
        }
        long long excl, tot;
        dyn_scan(tmp).ExclusiveSum(need, excl, tot);
        if (i < n_jobs) D.off[i] = carry + excl;
        if (i < n_jobs && D.jobs[i].head < 0) D.need_hi[i] = D.need_lo[i] = 0;
        __syncthreads();
        if (threadIdx.x == 0) carry += tot;
        __syncthreads();
    }
    if (bad || carry > D.pm->tail - D.pm->head) {
        if (threadIdx.x == 0) D.pm->err = bad ? 2 : 1;
        return;
    }
    const long long head = D.pm->head;
    for (int i = threadIdx.x; i < n_jobs; i += NT) {
        if (D.jobs[i].head < 0) continue;
        const int st = D.jobs[i].head + layer * D.layer_stride;
        int32_t *t = D.tables + (long long)st * D.table_len;
        long long at = head + D.off[i];
        for (int k = 0; k < D.need_hi[i]; k++) t[D.nhp[st]++] = D.ring[at++ % D.n_pages];
        for (int k = 0; k < D.need_lo[i]; k++) t[D.table_len - 1 - D.nlp[st]++] = D.ring[at++ % D.n_pages];
    }
    __syncthreads();
    if (threadIdx.x == 0) D.pm->head = head + carry;
}

template <int NT> __device__ void dyn_trim_body(const dyn_dev &D, int n_jobs, int layer)
{
    typedef cub::BlockScan<long long, NT> dyn_scan;
    __shared__ typename dyn_scan::TempStorage tmp;
    __shared__ long long carry;
    if (threadIdx.x == 0) carry = 0;
    __syncthreads();
    if (__ldcg(&D.pm->err)) return;
    const long long tail = D.pm->tail;
    for (int base = 0; base < n_jobs; base += NT) {
        const int i = base + threadIdx.x;
        int kh = 0, kl = 0, st = -1;
        long long rel = 0;
        if (i < n_jobs && D.jobs[i].head >= 0) {
            st = D.jobs[i].head + layer * D.layer_stride;
            /* L2 reads: in a split step the trim runs in the merge's last block, right after the other
             * blocks wrote these, the round's block the page counts and tables in the one-launch
             * form (an SM's L1 could hold an older copy of the line) */
            kh = pages_for(__ldcg(&D.heads[st].max_high), D.tp_hi), kl = pages_for(__ldcg(&D.heads[st].max_low), D.tp_lo);
            rel = max(__ldcg(&D.nhp[st]) - kh, 0) + max(__ldcg(&D.nlp[st]) - kl, 0);
        }
        long long excl, tot;
        dyn_scan(tmp).ExclusiveSum(rel, excl, tot);
        if (st >= 0) {
            /* as kvs_lean_pm_trim: high pages last first, then low pages innermost first */
            const int32_t *t = D.tables + (long long)st * D.table_len;
            long long at = tail + carry + excl;
            const int nh0 = __ldcg(&D.nhp[st]), nl0 = __ldcg(&D.nlp[st]);
            int nh = nh0, nl = nl0;
            while (nh > kh && nh > 0) D.ring[at++ % D.n_pages] = __ldcg(&t[--nh]);
            while (nl > kl && nl > 0) D.ring[at++ % D.n_pages] = __ldcg(&t[D.table_len - nl--]);
            if (nh != nh0) D.nhp[st] = nh;
            if (nl != nl0) D.nlp[st] = nl;
        }
        __syncthreads();
        if (threadIdx.x == 0) carry += tot;
        __syncthreads();
    }
    if (threadIdx.x == 0) D.pm->tail = tail + carry;
}

__global__ void __launch_bounds__(DYN_SCAN) k_dyn_alloc(dyn_dev D, int n_jobs, int layer)
{
    dyn_alloc_body<DYN_SCAN>(D, n_jobs, layer);
}

__global__ void __launch_bounds__(DYN_SCAN) k_dyn_trim(dyn_dev D, int n_jobs, int layer)
{
    dyn_trim_body<DYN_SCAN>(D, n_jobs, layer);
}

/* heads [first, first + n) give back their pages in order (kvs_lean_pm_release) and restart */
__global__ void k_dyn_release(dyn_dev D, int first, int n)
{
    long long tail = D.pm->tail;
    for (int st = first; st < first + n; st++) {
        const int32_t *t = D.tables + (long long)st * D.table_len;
        for (int k = 0; k < D.nhp[st]; k++) D.ring[tail++ % D.n_pages] = t[k];
        for (int k = 0; k < D.nlp[st]; k++) D.ring[tail++ % D.n_pages] = t[D.table_len - 1 - k];
        D.nhp[st] = D.nlp[st] = 0;
        D.heads[st] = dyn_head{0, 0, 0, 0, 0, 0, 0, -1, 0};
    }
    D.pm->tail = tail;
}

/* ---- the step ------------------------------------------------------------------------------- */
/* block-wide reduction of v[0..G) (max or sum); every thread gets the result */
template <bool MAX, int GM> __device__ void block_reduce(float *v, int G, float *red)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int g = 0; g < GM; g++) {
        if (g >= G) break;
        float x = v[g];
        for (int o = 16; o > 0; o >>= 1) {
            const float y = __shfl_xor_sync(0xffffffffu, x, o);
            x = MAX ? fmaxf(x, y) : x + y;
        }
        if (lane == 0) red[g * DYN_WARPS + warp] = x;
    }
    __syncthreads();
#pragma unroll
    for (int g = 0; g < GM; g++) {
        if (g >= G) break;
        float x = red[g * DYN_WARPS];
        for (int w = 1; w < DYN_WARPS; w++) x = MAX ? fmaxf(x, red[g * DYN_WARPS + w]) : x + red[g * DYN_WARPS + w];
        v[g] = x;
    }
    __syncthreads();
}

/* (score, index) pairs: the lower score, the lower index on ties (any order gives the same) */
__device__ __forceinline__ bool sc_less(float s2, int j2, float s1, int j1)
{
    return j2 >= 0 && (j1 < 0 || s2 < s1 || (s2 == s1 && j2 < j1));
}

/* argmin of the section's scores, first index on ties (kv_lean_dyn.c's section_argmin): a
 * thread per entry, then the warps' shuffles and one pass over the warps' winners; the winner's
 * header (position, score sum) comes along (*bpos, *bacc: the exit needs no second read of it).
 * rs, ri, rp, ra: [warps] each */
__device__ int section_argmin(const dyn_dev &D, const dyn_tab &T, int high, int n, int32_t last, float *best,
                              int32_t *bpos, float *bacc, float *rs, int *ri, int32_t *rp, float *ra)
{
    float bs = 0, ba = 0;
    int bj = -1;
    int32_t bp = 0;
    for (int j = threadIdx.x; j < n; j += DYN_THREADS) {
        const uint8_t *e = entry_tab(D, T, high, j);
        const float a = e_acc(e);
        const int32_t p = e_pos(e);
        const float s = dyn_score(a, p, last);
        if (bj < 0 || s < bs) bs = s, bj = j, bp = p, ba = a;
    }
    for (int o = 16; o > 0; o >>= 1) {
        const float s2 = __shfl_xor_sync(0xffffffffu, bs, o);
        const int j2 = __shfl_xor_sync(0xffffffffu, bj, o);
        const int32_t p2 = __shfl_xor_sync(0xffffffffu, bp, o);
        const float a2 = __shfl_xor_sync(0xffffffffu, ba, o);
        if (sc_less(s2, j2, bs, bj)) bs = s2, bj = j2, bp = p2, ba = a2;
    }
    if ((threadIdx.x & 31) == 0) {
        const int w = threadIdx.x >> 5;
        rs[w] = bs, ri[w] = bj, rp[w] = bp, ra[w] = ba;
    }
    __syncthreads();
    bs = rs[0], bj = ri[0], bp = rp[0], ba = ra[0];
    for (int w = 1; w < DYN_WARPS; w++)
        if (sc_less(rs[w], ri[w], bs, bj)) bs = rs[w], bj = ri[w], bp = rp[w], ba = ra[w];
    *best = bs, *bpos = bp, *bacc = ba;
    __syncthreads();
    return bj;
}

/* every thread of the block: dequantize entry e (format f) into k, v */
__device__ void e_dequant(const uint8_t *e, const dyn_fmt &f, int hd, float *k, float *v)
{
    for (int i = threadIdx.x; i < hd; i += DYN_THREADS)
        k[i] = dyn_deq(e_k(e), f.kc, f.kbits, i), v[i] = dyn_deq(e_v(e, f), f.vc, f.vbits, i);
}

/* warps 0 and 1: quantize k (warp 0), v (warp 1) into entry e */
__device__ void e_quant(uint8_t *e, const dyn_fmt &f, int hd, const float *k, const float *v)
{
    const int warp = threadIdx.x >> 5;
    if (warp == 0) warp_quant(k, hd, f.kbits, e + 8);
    else if (warp == 1) warp_quant(v, hd, f.vbits, e + 8 + f.kc + (f.kbits < 16 ? 4 : 0));
}

/* threads [t0, DYN_THREADS): copy an entry (distinct entries of one section never overlap) */
__device__ void e_move(uint8_t *to, const uint8_t *from, long long bytes, int t0)
{
    if (to == from) return;
    const int t = threadIdx.x - t0, nt = DYN_THREADS - t0;
    if (t < 0) return;
    if (!(((uintptr_t)to | (uintptr_t)from | (uintptr_t)bytes) & 3)) {
        for (long long b = t; b < bytes / 4; b += nt)
            reinterpret_cast<uint32_t *>(to)[b] = reinterpret_cast<const uint32_t *>(from)[b];
        return;
    }
    for (long long b = t; b < bytes; b += nt) to[b] = from[b];
}

/* Algorithm 1's exit (kvs_lean_dyn_head_exit). Thread 0 makes the decisions and moves the
 * counts (serial by nature: a few comparisons); the vectors are the block's: the leaving
 * token's K and V are read by all threads and quantized by warps 0 and 1 at once, the
 * section's argmin is a block reduction, a demoted victim is dequantized by all threads, then
 * re-quantized by warps 0 / 1 while the other warps fill its hole. Every thread calls it.
 * T: the head's page table (dyn_tab). pre: the caller read the oldest window token ahead (its K
 * and V in kx / vx, its position and score sum in ppos / pacc: the split decode step's merge
 * reads them beside its other loads, not after them); rs: 4 x [warps] words of scratch, ri = rs + warps. */
__device__ void dyn_exit(const dyn_dev &D, int st, dyn_head *h, struct kvs_lean_event *ev, float *kx, float *vx, float *rs,
                         int *ri, int *sh, const dyn_tab &T, int pre, int32_t ppos, float pacc)
{
    const int hd = D.hd, W = D.W;
    /* sh: [0] tier, [1] window slot, [2] the new entry's index in its section; [3] the victim's
     * action (0 kept, 1 pruned, 2 demoted), [4] victim index, [5] last index, [6] new low index */
    if (threadIdx.x == 0) {
        struct kvs_lean_event e = {-1, -1, 0, -1, -1, 0, 0};
        sh[0] = 0;
        if (h->w_n > W) {
            const int cw = h->w_start;
            const int32_t tpos = pre ? ppos : D.wpos[(long long)st * (W + 1) + cw];
            const float tacc = pre ? pacc : D.wacc[(long long)st * (W + 1) + cw];
            const float s = dyn_score(tacc, tpos, h->last_pos);
            h->w_start = (h->w_start + 1) % (W + 1);
            h->w_n--;
            const double N = (double)h->seen, th = D.alpha_h / N, tl = D.alpha_l / N;
            e.tc_pos = tpos, e.tc_score = s, e.n_seen = N;
            int tier = 0;
            if (s >= th) tier = KVS_LEAN_HIGH, e.tc_dest = KVS_LEAN_HIGH;
            else if (s >= tl) tier = KVS_LEAN_LOW, e.tc_dest = KVS_LEAN_LOW;
            else h->pruned++, e.tc_dest = KVS_LEAN_PRUNED;
            if (tier) {
                const int hi = tier == KVS_LEAN_HIGH;
                int *n_sec = hi ? &h->n_high : &h->n_low, *max_sec = hi ? &h->max_high : &h->max_low;
                sh[2] = (*n_sec)++;
                if (*n_sec > *max_sec) *max_sec = *n_sec;
                e_set(entry_tab(D, T, hi, sh[2]), tpos, tacc);
            }
            sh[0] = tier, sh[1] = cw;
        }
        *ev = e;
    }
    __syncthreads();
    const int tier = sh[0];
    if (!tier) return;
    const int hi = tier == KVS_LEAN_HIGH;
    {
        if (!pre) {
            const long long wo = ((long long)st * (W + 1) + sh[1]) * hd;
            for (int i = threadIdx.x; i < hd; i += DYN_THREADS)
                kx[i] = __bfloat162float(D.wk[wo + i]), vx[i] = __bfloat162float(D.wv[wo + i]);
            __syncthreads();
        }
        e_quant(entry_tab(D, T, hi, sh[2]), fmt_of(D, hi), hd, kx, vx);
    }
    /* the argmin reads the entries' headers only (thread 0 set the new one's above) */
    float sv, vacc;
    int32_t vpos;
    const int j = section_argmin(D, T, hi, hi ? h->n_high : h->n_low, h->last_pos, &sv, &vpos, &vacc, rs, ri,
                                 ri + DYN_WARPS, rs + 3 * DYN_WARPS);
    if (threadIdx.x == 0) {
        const double N = (double)h->seen, th = D.alpha_h / N, tl = D.alpha_l / N;
        int *n_sec = hi ? &h->n_high : &h->n_low;
        ev->victim_pos = vpos, ev->victim_score = sv, ev->victim_action = KVS_LEAN_KEPT;
        sh[3] = 0, sh[4] = j;
        if (sv < tl) {
            sh[5] = --*n_sec;
            h->pruned++;
            ev->victim_action = KVS_LEAN_PRUNED;
            sh[3] = 1;
        } else if (hi && sv < th) {
            sh[5] = --*n_sec;
            sh[6] = h->n_low++;
            if (h->n_low > h->max_low) h->max_low = h->n_low;
            e_set(entry_tab(D, T, 0, sh[6]), vpos, vacc);
            ev->victim_action = KVS_LEAN_DEMOTED;
            sh[3] = 2;
        }
    }
    __syncthreads();
    const int act = sh[3];
    if (act) {
        const dyn_fmt f = fmt_of(D, hi);
        uint8_t *ve = entry_tab(D, T, hi, sh[4]);
        const uint8_t *last = entry_tab(D, T, hi, sh[5]);
        if (act == 2) {
            /* the victim's vectors first (it is overwritten next), then the low entry (warps 0
             * and 1) and the hole (the other warps) at once: three distinct entries */
            e_dequant(ve, f, hd, kx, vx);
            __syncthreads();
            e_quant(entry_tab(D, T, 0, sh[6]), fmt_of(D, 0), hd, kx, vx);
            e_move(ve, last, f.bytes, 64);
        } else {
            e_move(ve, last, f.bytes, 0);
        }
    }
    __syncthreads();
}

/* f(i, x) for every element of r's vector in order, x = tv_elem(r, i) to the bit, read a 32-bit
 * word at a time (a word holds 32 / bits codes, or two 16-bit values) where the codes are
 * 4-byte aligned and fill whole words; else one element at a time. The words come in groups of
 * TV_BURST, all loads of a group issued before any use: a loop of load-then-use exposed one L2
 * round trip per word (16 for a 64-dim K8 key), the split decode step's longest chain
 * (bench/RESULTS.md, part 18); f still sees the elements in order, so the sums are the same. */
#define TV_BURST 8
template <int BITS, typename F> __device__ __forceinline__ void tv_words(const dyn_tv &r, const uint32_t *w, int nw, F f)
{
    for (int c0 = 0; c0 < nw; c0 += TV_BURST) {
        uint32_t u[TV_BURST];
#pragma unroll
        for (int e = 0; e < TV_BURST; e++) u[e] = c0 + e < nw ? w[c0 + e] : 0u;
#pragma unroll
        for (int e = 0; e < TV_BURST; e++) {
            if (c0 + e >= nw) break;
            const int c = c0 + e;
            if (BITS == 0) {
                f(2 * c, __uint_as_float(u[e] << 16)), f(2 * c + 1, __uint_as_float(u[e] & 0xffff0000u));
            } else if (BITS == 16) {
                f(2 * c, lean_h2f((uint16_t)(u[e] & 0xffffu))), f(2 * c + 1, lean_h2f((uint16_t)(u[e] >> 16)));
            } else {
                constexpr int per = BITS ? 32 / BITS : 1, mask = (1 << BITS) - 1;
#pragma unroll
                for (int k = 0; k < per; k++) f(per * c + k, tv_code(r, u[e] >> (BITS * k) & mask));
            }
        }
    }
}

template <typename F> __device__ __forceinline__ void tv_each(const dyn_tv &r, int hd, F f)
{
    const int bits = r.bits ? r.bits : 16;
    if (((uintptr_t)r.p & 3) || (hd * bits) & 31) {
        for (int i = 0; i < hd; i++) f(i, tv_elem(r, i));
        return;
    }
    const uint32_t *w = reinterpret_cast<const uint32_t *>(r.p);
    const int nw = hd * bits / 32;
    if (r.bits == 0) tv_words<0>(r, w, nw, f);
    else if (r.bits == 16) tv_words<16>(r, w, nw, f);
    else if (r.bits == 8) tv_words<8>(r, w, nw, f);
    else if (r.bits == 4) tv_words<4>(r, w, nw, f);
    else tv_words<2>(r, w, nw, f);
}

/* The logits of tokens [t0, t1) of a head for the G q heads of its group (queries qs, [G][hd]): a
 * thread per token, codes read a word at a time; lg[g * n + t] = q_g . k_t * scale, and m[g] takes
 * the thread's running maximum (the caller reduces it over the block). Shared by the one-block
 * step and the split step, so both compute every logit with the same operations in the same order. */
template <int GM>
__device__ __forceinline__ void dyn_logits(const dyn_dev &D, int st, const dyn_head &h, int t0, int t1, int n,
                                           const float *qs, float scale, float *lg, float *m)
{
    const int hd = D.hd, G = D.G;
    for (int t = t0 + threadIdx.x; t < t1; t += DYN_THREADS) {
        float a[GM];
#pragma unroll
        for (int g = 0; g < GM; g++) a[g] = 0.0f;
        tv_each(tok_ref(D, st, h, t, 0), hd, [&](int i, float x) {
#pragma unroll
            for (int g = 0; g < GM; g++)
                if (g < G) a[g] = fmaf(qs[g * hd + i], x, a[g]);
        });
#pragma unroll
        for (int g = 0; g < GM; g++)
            if (g < G) {
                lg[(long long)g * n + t] = a[g] * scale;
                m[g] = fmaxf(m[g], a[g] * scale);
            }
    }
}

/* One block per job (its rows in order: each row's exit changes what the next row reads); within
 * a row the block's DYN_THREADS threads share the work: a thread per token for the logits
 * (codes a word at a time) and the scores; for the output a warp per token with a lane per
 * dimension (coalesced reads of the token's codes), the token lookups and probabilities of a
 * chunk of DYN_THREADS tokens staged in shared memory, and the warps' partial sums added in warp
 * order (fixed, so runs repeat bitwise). GM >= G (the group's q heads) and KM >= hd / 32 bound
 * the register arrays. */
template <int GM, int KM>
__global__ void __launch_bounds__(DYN_THREADS) k_dyn_step(dyn_dev D, const float *q, const float *k, const float *v,
                                                         const float *ext, float scale, float *out, int phases,
                                                         int layer)
{
    extern __shared__ float sm[];
    const int hd = D.hd, G = D.G, W = D.W;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float *qs = sm;                                    /* [G][hd] */
    float *acc = qs + G * hd;                          /* [G][hd]: the output's sums */
    float *ps = acc + G * hd;                          /* [GM][DYN_THREADS]: a chunk's probabilities */
    float *kx = ps + GM * DYN_THREADS, *vx = kx + hd;  /* [hd] x 2: the exit's vectors */
    float *red = vx + hd;                              /* [GM][warps] */
    float *rs = red + GM * DYN_WARPS;                  /* [warps] */
    int *ri = (int *)(rs + DYN_WARPS);                 /* [warps] (+ 2 x [warps]: the exit's argmin) */
    __shared__ dyn_head h;
    __shared__ int sh[8];
    __shared__ dyn_tv tv[DYN_THREADS];
    if (D.pm->err) return;   /* the round failed: no job has its pages */
    const struct kvs_lean_dyn_cuda_job J = D.jobs[blockIdx.x];
    if (J.head < 0) return;   /* a padded sequence */
    if ((phases & DYN_ONLY_SINGLE) && J.rows != 1) return;   /* a prompt chunk: the prefill's */
    const int st = J.head + layer * D.layer_stride;
    float *lg = D.scratch + (long long)blockIdx.x * G * (D.max_ctx + 1);
    if (threadIdx.x == 0) h = D.heads[st];
    __syncthreads();
    for (int r = 0; r < J.rows; r++) {
        const int row = J.row0 + r;
        if (phases & KVS_LEAN_DYN_ATTEND) {
            /* 1. the row's K/V join the window (bf16) */
            const int w = (h.w_start + h.w_n) % (W + 1);
            const long long wo = ((long long)st * (W + 1) + w) * hd, ko = ((long long)row * D.nkv + J.g) * hd;
            for (int i = threadIdx.x; i < hd; i += DYN_THREADS)
                D.wk[wo + i] = __float2bfloat16_rn(k[ko + i]), D.wv[wo + i] = __float2bfloat16_rn(v[ko + i]);
            const long long qo = ((long long)row * D.nq + (long long)J.g * G) * hd;
            for (int i = threadIdx.x; i < G * hd; i += DYN_THREADS) qs[i] = q[qo + i];
            __syncthreads();
            if (threadIdx.x == 0) {
                D.wpos[(long long)st * (W + 1) + w] = J.pos0 + r, D.wacc[(long long)st * (W + 1) + w] = 0.0f;
                /* a fresh head's N starts at the positions before it (cached documents), as the host's */
                h.w_n++, h.seen = (h.seen ? h.seen : (long long)(J.pos0 + r)) + 1, h.last_pos = J.pos0 + r;
            }
            __syncthreads();
            /* 2. logits (a thread per token), two-pass softmax, scores */
            const int n = h.n_high + h.n_low + h.w_n, nhl = h.n_high + h.n_low;
            float m[GM], sum[GM];
#pragma unroll
            for (int g = 0; g < GM; g++) m[g] = -INFINITY, sum[g] = 0.0f;
            dyn_logits<GM>(D, st, h, 0, n, n, qs, scale, lg, m);
            block_reduce<true, GM>(m, G, red);
            /* ext: the row's other part (cached documents: lse per q head, its output in out) joins
             * the normalization; -inf (none) changes no bit */
            float e[GM];
#pragma unroll
            for (int g = 0; g < GM; g++) {
                e[g] = ext && g < G ? ext[(long long)row * D.nq + (long long)J.g * G + g] : -INFINITY;
                if (e[g] > m[g]) m[g] = e[g];
            }
            for (int t = threadIdx.x; t < n; t += DYN_THREADS)
#pragma unroll
                for (int g = 0; g < GM; g++)
                    if (g < G) {
                        const float p = expf(lg[(long long)g * n + t] - m[g]);
                        lg[(long long)g * n + t] = p;
                        sum[g] += p;
                    }
            block_reduce<false, GM>(sum, G, red);
#pragma unroll
            for (int g = 0; g < GM; g++)
                if (e[g] > -INFINITY) sum[g] += expf(e[g] - m[g]);
            for (int t = threadIdx.x; t < n; t += DYN_THREADS) {
                float sc = 0.0f;
#pragma unroll
                for (int g = 0; g < GM; g++)
                    if (g < G) {
                        const float p = lg[(long long)g * n + t] / sum[g];
                        lg[(long long)g * n + t] = p;
                        sc = g ? fmaxf(sc, p) : p;
                    }
                if (t < nhl) {
                    const int hi = t < h.n_high;
                    uint8_t *e = entry_at(D, st, hi, hi ? t : t - h.n_high);
                    e_set(e, e_pos(e), e_acc(e) + sc);
                } else {
                    D.wacc[(long long)st * (W + 1) + (h.w_start + t - nhl) % (W + 1)] += sc;
                }
            }
            /* the output: chunks of DYN_THREADS tokens, a warp per token, lane + 32 kk per dim */
            float o[GM][KM];
#pragma unroll
            for (int g = 0; g < GM; g++)
#pragma unroll
                for (int kk = 0; kk < KM; kk++) o[g][kk] = 0.0f;
            for (int t0 = 0; t0 < n; t0 += DYN_THREADS) {
                const int tn = min(DYN_THREADS, n - t0);
                __syncthreads();   /* the previous chunk's tv / ps are read (and lg written, first time) */
                if (threadIdx.x < tn) {
                    tv[threadIdx.x] = tok_ref(D, st, h, t0 + threadIdx.x, 1);
#pragma unroll
                    for (int g = 0; g < GM; g++)
                        if (g < G) ps[g * DYN_THREADS + threadIdx.x] = lg[(long long)g * n + t0 + threadIdx.x];
                }
                __syncthreads();
#pragma unroll 2
                for (int j = warp; j < tn; j += DYN_WARPS) {
                    const dyn_tv rv = tv[j];
                    float x[KM];
#pragma unroll
                    for (int kk = 0; kk < KM; kk++) x[kk] = lane + 32 * kk < hd ? tv_elem(rv, lane + 32 * kk) : 0.0f;
#pragma unroll
                    for (int g = 0; g < GM; g++)
                        if (g < G) {
                            const float p = ps[g * DYN_THREADS + j];
#pragma unroll
                            for (int kk = 0; kk < KM; kk++) o[g][kk] = fmaf(p, x[kk], o[g][kk]);
                        }
                }
            }
            /* the warps' sums in warp order */
            for (int wi = 0; wi < DYN_WARPS; wi++) {
                if (warp == wi)
#pragma unroll
                    for (int g = 0; g < GM; g++)
#pragma unroll
                        for (int kk = 0; kk < KM; kk++) {
                            const int i = lane + 32 * kk;
                            if (g < G && i < hd) acc[g * hd + i] = wi ? acc[g * hd + i] + o[g][kk] : o[g][kk];
                        }
                __syncthreads();
            }
            const long long oo = ((long long)row * D.nq + (long long)J.g * G) * hd;
            for (int i = threadIdx.x; i < G * hd; i += DYN_THREADS) {
                float x = acc[i];
#pragma unroll
                for (int g = 0; g < GM; g++)   /* + the other part's output at its weight */
                    if (g == i / hd && e[g] > -INFINITY) x = fmaf(expf(e[g] - m[g]) / sum[g], out[oo + i], x);
                out[oo + i] = x;
            }
            __syncthreads();
        }
        /* 3. the oldest window token leaves */
        if (phases & KVS_LEAN_DYN_EXIT)
            dyn_exit(D, st, &h, &D.ev[st], kx, vx, rs, ri, sh, dyn_tab{D.tables + (long long)st * D.table_len, 1}, 0, 0, 0.0f);
        __syncthreads();
    }
    if (threadIdx.x == 0) D.heads[st] = h;
}

/* ---- decode steps split over blocks (flash-decoding) ------------------------------------------
 * A step where every job runs one row (decode; a recorded step's padding jobs too) splits each
 * head's tokens over up to `splits` blocks: split y (dyn_split_body) takes tokens [y c, (y + 1) c)
 * (c = max(ceil(n / splits), min_tokens)) and writes its logits to the job's scratch (as
 * k_dyn_step does), its max m_y, sum l_y = sum exp(logit - m_y) and unnormalized output
 * o_y = sum exp(logit - m_y) v per q head; then the merge (dyn_merge_body, once per job) joins them with
 * the documents' part: M = max(m_y, ext), L = sum_y l_y exp(m_y - M) (+ exp(ext - M)), the
 * output sum_y exp(m_y - M) o_y / L; each token's probability exp(logit - M) / L feeds its score
 * (max over the group, as before), and Algorithm 1's exit runs as in k_dyn_step (sequential by
 * nature: it reads every score). The row's K/V join the window in the split that holds the
 * newest token (no other block reads that slot); the head's counts move in the merge, after
 * every split has read them. The probabilities equal k_dyn_step's up to fp32 rounding of the
 * split sums (the tests hold both to the CPU at the same tolerances). The page round runs in
 * one more block of the launch (the splits read only entries that exist already; the round
 * appends pages) and the trim in the last merge's block; k_dyn_decode runs it all in one launch
 * a layer (before: two, and four before that). */
struct dyn_part {
    float m, l;                   /* per q head: the split's max and sum */
};

/* split y of job `job` (every thread of the block; returns with nothing written where the split
 * holds no token, the job is padding or the pool is in error) */
template <int GM, int KM>
__device__ void dyn_split_body(const dyn_dev &D, const float *q, const float *k, const float *v, float scale, int layer,
                               int splits, int min_tokens, int job, int y)
{
    extern __shared__ float sm[];
    const int hd = D.hd, G = D.G, W = D.W;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float *qs = sm;                                    /* [G][hd] */
    float *acc = qs + G * hd;                          /* [G][hd] */
    float *ps = acc + G * hd;                          /* [GM][DYN_THREADS] */
    float *red = ps + GM * DYN_THREADS;                /* [GM][warps] */
    __shared__ dyn_head h;
    __shared__ dyn_tv tv[DYN_THREADS];
    if (D.pm->err) return;
    const struct kvs_lean_dyn_cuda_job J = D.jobs[job];
    if (J.head < 0 || J.rows != 1) return;
    const int st = J.head + layer * D.layer_stride, row = J.row0;
    if (threadIdx.x == 0) {
        h = D.heads[st];
        h.w_n++;   /* the row's token, the newest of the window, as the merge will count it */
    }
    __syncthreads();
    const int nhl = h.n_high + h.n_low, n = nhl + h.w_n;
    const int c = max((n + splits - 1) / splits, min_tokens), t0 = y * c, t1 = min(n, t0 + c);
    if (t0 >= n) return;
    dyn_part *part = reinterpret_cast<dyn_part *>(D.part) + ((long long)job * splits + y) * G;
    float *po = D.part_o + ((long long)job * splits + y) * G * hd;
    if (t1 == n) {   /* the newest token's split writes it into its window slot (bf16) */
        const int w = (h.w_start + h.w_n - 1) % (W + 1);
        const long long wo = ((long long)st * (W + 1) + w) * hd, ko = ((long long)row * D.nkv + J.g) * hd;
        for (int i = threadIdx.x; i < hd; i += DYN_THREADS)
            D.wk[wo + i] = __float2bfloat16_rn(k[ko + i]), D.wv[wo + i] = __float2bfloat16_rn(v[ko + i]);
    }
    const long long qo = ((long long)row * D.nq + (long long)J.g * G) * hd;
    for (int i = threadIdx.x; i < G * hd; i += DYN_THREADS) qs[i] = q[qo + i];
    __syncthreads();
    float *lg = D.scratch + (long long)job * G * (D.max_ctx + 1);
    float m[GM], sum[GM];
#pragma unroll
    for (int g = 0; g < GM; g++) m[g] = -INFINITY, sum[g] = 0.0f;
    dyn_logits<GM>(D, st, h, t0, t1, n, qs, scale, lg, m);
    block_reduce<true, GM>(m, G, red);
    float o[GM][KM];
#pragma unroll
    for (int g = 0; g < GM; g++)
#pragma unroll
        for (int kk = 0; kk < KM; kk++) o[g][kk] = 0.0f;
    for (int c0 = t0; c0 < t1; c0 += DYN_THREADS) {
        const int tn = min(DYN_THREADS, t1 - c0);
        __syncthreads();   /* the previous chunk's tv / ps are read */
        if (threadIdx.x < tn) {
            tv[threadIdx.x] = tok_ref(D, st, h, c0 + threadIdx.x, 1);
#pragma unroll
            for (int g = 0; g < GM; g++)
                if (g < G) {
                    const float p = expf(lg[(long long)g * n + c0 + threadIdx.x] - m[g]);
                    ps[g * DYN_THREADS + threadIdx.x] = p;
                    sum[g] += p;
                }
        }
        __syncthreads();
#pragma unroll 4   /* four tokens' codes in flight per warp (was 2: a round trip per two tokens) */
        for (int j = warp; j < tn; j += DYN_WARPS) {
            const dyn_tv rv = tv[j];
            float x[KM];
#pragma unroll
            for (int kk = 0; kk < KM; kk++) x[kk] = lane + 32 * kk < hd ? tv_elem(rv, lane + 32 * kk) : 0.0f;
#pragma unroll
            for (int g = 0; g < GM; g++)
                if (g < G) {
                    const float p = ps[g * DYN_THREADS + j];
#pragma unroll
                    for (int kk = 0; kk < KM; kk++) o[g][kk] = fmaf(p, x[kk], o[g][kk]);
                }
        }
    }
    block_reduce<false, GM>(sum, G, red);
    for (int wi = 0; wi < DYN_WARPS; wi++) {   /* the warps' sums in warp order */
        if (warp == wi)
#pragma unroll
            for (int g = 0; g < GM; g++)
#pragma unroll
                for (int kk = 0; kk < KM; kk++) {
                    const int i = lane + 32 * kk;
                    if (g < G && i < hd) acc[g * hd + i] = wi ? acc[g * hd + i] + o[g][kk] : o[g][kk];
                }
        __syncthreads();
    }
    for (int i = threadIdx.x; i < G * hd; i += DYN_THREADS) po[i] = acc[i];
    if (threadIdx.x < G) {
#pragma unroll
        for (int g = 0; g < GM; g++)
            if (g == (int)threadIdx.x) part[g] = dyn_part{m[g], sum[g]};
    }
}

/* the merge of job `job` (every thread of the block). tab: the head's page table is copied to
 * shared memory first (after rs / ri: table_len words), so the scores' and the exit's lookups
 * cost no global round trip (0: read from L2 where used, KVS_LEAN_DYN_TAB=0: A/B) */
template <int GM>
__device__ void dyn_merge_body(const dyn_dev &D, const float *ext, float *out, int layer, int splits, int min_tokens,
                               int job, int tab)
{
    extern __shared__ float sm[];
    const int hd = D.hd, G = D.G, W = D.W;
    float *kx = sm, *vx = kx + hd;                     /* [hd] x 2: the exit's vectors */
    float *rs = vx + hd;                               /* [warps] x 4: the argmin's */
    int *ri = (int *)(rs + DYN_WARPS);
    int32_t *ts = (int32_t *)(rs + 4 * DYN_WARPS);     /* [table_len] (tab) */
    __shared__ dyn_head h;
    __shared__ int sh[8];
    __shared__ int32_t ex_pos;
    __shared__ float ex_acc;
    if (__ldcg(&D.pm->err)) return;   /* L2: in one launch a layer the round ran beside this block */
    const struct kvs_lean_dyn_cuda_job J = D.jobs[job];
    if (J.head < 0 || J.rows != 1) return;
    const int st = J.head + layer * D.layer_stride, row = J.row0;
    if (threadIdx.x == 0) {
        h = D.heads[st];
        /* the join's bookkeeping (k_dyn_step's step 1; the split wrote the vectors) */
        const int w = (h.w_start + h.w_n) % (W + 1);
        D.wpos[(long long)st * (W + 1) + w] = J.pos0, D.wacc[(long long)st * (W + 1) + w] = 0.0f;
        h.w_n++, h.seen = (h.seen ? h.seen : (long long)J.pos0) + 1, h.last_pos = J.pos0;
    }
    __syncthreads();
    const int nhl = h.n_high + h.n_low, n = nhl + h.w_n;
    /* issued together, ahead of the merge (none depends on another): the head's page table, and
     * when a token leaves the window (W > 0: not the slot just joined) its K, V and position; L2
     * reads (the round's block appended to the table in this launch) */
    const int32_t *trow = D.tables + (long long)st * D.table_len;
    if (tab)
        for (int i = threadIdx.x; i < D.table_len; i += DYN_THREADS) ts[i] = __ldcg(trow + i);
    const int pre = W > 0 && h.w_n > W;
    if (pre) {
        const long long wo = ((long long)st * (W + 1) + h.w_start) * hd;
        for (int i = threadIdx.x; i < hd; i += DYN_THREADS)
            kx[i] = __bfloat162float(__ldcg(D.wk + wo + i)), vx[i] = __bfloat162float(__ldcg(D.wv + wo + i));
        if (threadIdx.x == 0) ex_pos = __ldcg(D.wpos + (long long)st * (W + 1) + h.w_start);
    }
    const dyn_tab T = tab ? dyn_tab{ts, 0} : dyn_tab{trow, 1};
    const int c = max((n + splits - 1) / splits, min_tokens), ns = (n + c - 1) / c;
    const dyn_part *part = reinterpret_cast<const dyn_part *>(D.part) + (long long)job * splits * G;
    const float *po = D.part_o + (long long)job * splits * G * hd;
    float M[GM], L[GM], e[GM];
#pragma unroll
    for (int g = 0; g < GM; g++) {
        M[g] = -INFINITY, L[g] = 0.0f;
        e[g] = ext && g < G ? ext[(long long)row * D.nq + (long long)J.g * G + g] : -INFINITY;
        if (g >= G) continue;
        for (int y = 0; y < ns; y++) M[g] = fmaxf(M[g], __ldcg(&part[y * G + g].m));
        M[g] = fmaxf(M[g], e[g]);
        for (int y = 0; y < ns; y++) L[g] += __ldcg(&part[y * G + g].l) * expf(__ldcg(&part[y * G + g].m) - M[g]);
        if (e[g] > -INFINITY) L[g] += expf(e[g] - M[g]);
    }
    /* the output: the splits' sums at their weights, in split order, + the documents' part */
    const long long oo = ((long long)row * D.nq + (long long)J.g * G) * hd;
    for (int i = threadIdx.x; i < G * hd; i += DYN_THREADS) {
        const int gi = i / hd;
        float x = 0.0f, mg = 0.0f, lgs = 1.0f, eg = -INFINITY;
#pragma unroll
        for (int g = 0; g < GM; g++)
            if (g == gi) mg = M[g], lgs = L[g], eg = e[g];
        for (int y = 0; y < ns; y++) x = fmaf(expf(__ldcg(&part[y * G + gi].m) - mg), __ldcg(&po[(long long)y * G * hd + i]), x);
        x /= lgs;
        if (eg > -INFINITY) x = fmaf(expf(eg - mg) / lgs, out[oo + i], x);
        out[oo + i] = x;
    }
    /* scores: every token's probability (max over the group) */
    const float *lg = D.scratch + (long long)job * G * (D.max_ctx + 1);
    __syncthreads();   /* the table's copy */
    for (int t = threadIdx.x; t < n; t += DYN_THREADS) {
        float sc = 0.0f;
#pragma unroll
        for (int g = 0; g < GM; g++)
            if (g < G) {
                const float p = expf(__ldcg(&lg[(long long)g * n + t]) - M[g]) / L[g];
                sc = g ? fmaxf(sc, p) : p;
            }
        if (t < nhl) {
            const int hi = t < h.n_high;
            uint8_t *en = entry_tab(D, T, hi, hi ? t : t - h.n_high);
            e_set(en, e_pos(en), e_acc(en) + sc);
        } else {
            float *wa = D.wacc + (long long)st * (W + 1) + (h.w_start + t - nhl) % (W + 1);
            const float a = *wa + sc;
            *wa = a;
            if (t == nhl) ex_acc = a;   /* the oldest window token's: the exit's */
        }
    }
    __syncthreads();
    dyn_exit(D, st, &h, &D.ev[st], kx, vx, rs, ri, sh, T, pre, ex_pos, ex_acc);
    __syncthreads();
    if (threadIdx.x == 0) D.heads[st] = h;
}

/* The decode step's launch(es). Block (0, 0) runs the page round (blocks (0, y > 0) nothing);
 * block (1 + j, y) takes split y of job j. form DYN_ONE (one launch a layer): each block, its
 * split done, counts itself on its job's counter (its writes made visible first: CUDA's
 * threadfence reduction), and the job's last block to finish runs the job's merge, scores and
 * exit at once (no second launch, no block waiting for the slowest head of the whole step); a
 * merge waits for the round's flag first (its exit may write into a page the round appends; the
 * round, block 0, is dispatched first and waits for nothing, so the wait ends), and the last
 * merge to finish runs the trim and clears the counters for the next launch (a recorded step
 * replays it). DYN_TWO_SPLIT / DYN_TWO_MERGE: the form before (bench/RESULTS.md, part 16): the
 * splits and the round in one launch, then a block per job (y = 0) for the merges, the last one
 * to finish running the trim; kept for A/B (KVS_LEAN_DYN_ONE=0). done: [0] the merges finished,
 * [1] the round's flag, [2 + j] job j's splits finished. */
#define DYN_ONE 0
#define DYN_TWO_SPLIT 1
#define DYN_TWO_MERGE 2

template <int GM, int KM>
__global__ void __launch_bounds__(DYN_THREADS) k_dyn_decode(dyn_dev D, const float *q, const float *k, const float *v,
                                                           const float *ext, float *out, float scale, int layer,
                                                           int splits, int min_tokens, int round, int form, int tab)
{
    __shared__ int last;
    const int n_jobs = (int)gridDim.x - 1, job = (int)blockIdx.x - 1;
    if (job < 0) {
        if (form == DYN_TWO_MERGE || blockIdx.y != 0 || !round) return;
        dyn_alloc_body<DYN_THREADS>(D, n_jobs, layer);
        if (form == DYN_TWO_SPLIT) return;
        __threadfence();   /* the tables, page counts and error before the flag */
        __syncthreads();
        if (threadIdx.x == 0) atomicExch(D.done + 1, 1);
        return;
    }
    if (form != DYN_TWO_MERGE) dyn_split_body<GM, KM>(D, q, k, v, scale, layer, splits, min_tokens, job, blockIdx.y);
    if (form == DYN_TWO_SPLIT) return;
    if (form == DYN_ONE) {
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) {
            last = atomicAdd(D.done + 2 + job, 1) == (int)gridDim.y - 1;
            if (last) {
                D.done[2 + job] = 0;
                if (round)
                    while (atomicAdd(D.done + 1, 0) == 0) __nanosleep(64);
            }
        }
        __syncthreads();
        if (!last) return;
        __threadfence();
    }
    dyn_merge_body<GM>(D, ext, out, layer, splits, min_tokens, job, tab);
    if (!round) return;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(D.done, 1) == n_jobs - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    dyn_trim_body<DYN_THREADS>(D, n_jobs, layer);
    if (threadIdx.x == 0) D.done[0] = 0, D.done[1] = 0;
}

/* ---- host ----------------------------------------------------------------------------------- */
extern "C" void kvs_lean_dyn_cuda_free(struct kvs_lean_dyn_cuda *x)
{
    if (!x) return;
    void *ps[] = {x->d.heads, x->d.wk, x->d.wv, x->d.wpos, x->d.wacc, x->d.pages, x->d.ring, x->d.tables, x->d.nhp,
                  x->d.nlp, x->d.pm, x->d.ev, x->d.jobs, x->d.need_hi, x->d.need_lo, x->d.off, x->d.scratch,
                  x->d.part, x->d.part_o, x->d.done, x->d.pf_ml, x->d.pf_tsum};
    for (size_t i = 0; i < sizeof ps / sizeof *ps; i++)
        if (ps[i]) cudaFree(ps[i]);
    if (x->snap_d) cudaFree(x->snap_d);
    for (int i = 0; i < 2; i++) {
        if (x->snap_h[i]) cudaFreeHost(x->snap_h[i]);
        if (x->snap_ev[i]) cudaEventDestroy(x->snap_ev[i]);
    }
    free(x);
}

extern "C" int kvs_lean_dyn_cuda_create(struct kvs_backend *b, const struct kvs_lean_dyn_cfg *c, int n_states,
                                        int n_q_heads, int n_kv_heads, int n_pages, int table_len, int max_jobs,
                                        int layer_stride, struct kvs_lean_dyn_cuda **out, char *err, size_t errlen)
{
    *out = NULL;
    if (c->group > DYN_MAXG || c->head_dim > DYN_MAXHD || c->group * n_kv_heads != n_q_heads || n_states < 1 ||
        n_pages < 1 || table_len < 1 || max_jobs < 1)
        return kvs_err(err, errlen, -EINVAL, "lean dynamic (cuda): %d query heads per KV head (at most %d), head_dim %d "
                       "(at most %d), %d states, %d pages", c->group, DYN_MAXG, c->head_dim, DYN_MAXHD, n_states, n_pages);
    struct kvs_lean_dyn_cuda *x = (struct kvs_lean_dyn_cuda *)calloc(1, sizeof *x);
    if (!x) return kvs_err(err, errlen, -ENOMEM, "lean dynamic (cuda): out of memory");
    x->b = b, x->c = *c, x->n_states = n_states, x->max_jobs = max_jobs;
    dyn_dev &D = x->d;
    D.layer_stride = layer_stride;
    D.hd = c->head_dim, D.G = c->group, D.W = c->window, D.kbits = c->high.kbits, D.vbits = c->high.vbits;
    D.lkbits = c->low.kbits, D.lvbits = c->low.vbits, D.tp_hi = c->tp_hi, D.tp_lo = c->tp_lo, D.max_ctx = c->max_ctx;
    D.table_len = table_len, D.n_pages = n_pages, D.nq = n_q_heads, D.nkv = n_kv_heads;
    D.kc = c->head_dim * c->high.kbits / 8, D.vc = c->head_dim * c->high.vbits / 8;
    D.lkc = c->head_dim * c->low.kbits / 8, D.lvc = c->head_dim * c->low.vbits / 8;
    D.entry_hi = (long long)c->entry_hi, D.entry_lo = (long long)c->entry_lo, D.page_bytes = (long long)c->page_bytes;
    D.alpha_h = c->alpha_h, D.alpha_l = c->alpha_l;
    const size_t W1 = (size_t)c->window + 1, S = (size_t)n_states;
    int bad = 0;
#define DALLOC(p, bytes) bad |= cudaMalloc((void **)&(p), (bytes)) != cudaSuccess
    DALLOC(D.heads, S * sizeof(dyn_head));
    DALLOC(D.wk, S * W1 * c->head_dim * sizeof(bf16));
    DALLOC(D.wv, S * W1 * c->head_dim * sizeof(bf16));
    DALLOC(D.wpos, S * W1 * sizeof(int32_t));
    DALLOC(D.wacc, S * W1 * sizeof(float));
    DALLOC(D.pages, (size_t)n_pages * c->page_bytes);
    DALLOC(D.ring, (size_t)n_pages * sizeof(int32_t));
    DALLOC(D.tables, S * table_len * sizeof(int32_t));
    DALLOC(D.nhp, S * sizeof(int32_t));
    DALLOC(D.nlp, S * sizeof(int32_t));
    DALLOC(D.pm, sizeof(dyn_pm));
    DALLOC(D.ev, S * sizeof(struct kvs_lean_event));
    DALLOC(D.jobs, (size_t)max_jobs * sizeof(struct kvs_lean_dyn_cuda_job));
    DALLOC(D.need_hi, (size_t)max_jobs * sizeof(int32_t));
    DALLOC(D.need_lo, (size_t)max_jobs * sizeof(int32_t));
    DALLOC(D.off, (size_t)max_jobs * sizeof(long long));
    DALLOC(D.scratch, (size_t)max_jobs * c->group * ((size_t)c->max_ctx + 1) * sizeof(float));
    /* the split path: 2 blocks per SM; KVS_LEAN_DYN_SPLIT (splits per head at most, 0: the
     * sequential kernel) and KVS_LEAN_DYN_SPLIT_MIN (tokens a split takes at least) tune it */
    int dev = 0, sms = 132;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
        cudaGetLastError(), sms = 132;
    const char *es = getenv("KVS_LEAN_DYN_SPLIT"), *em = getenv("KVS_LEAN_DYN_SPLIT_MIN");
    x->target = 2 * sms;
    x->splits = es && *es ? atoi(es) : DYN_MAXSPLIT;
    x->min_tokens = em && *em ? atoi(em) : DYN_SPLIT_MIN;
    if (x->splits < 0) x->splits = 0;
    if (x->splits > DYN_MAXSPLIT) x->splits = DYN_MAXSPLIT;
    if (x->min_tokens < 1) x->min_tokens = 1;
    const char *eo = getenv("KVS_LEAN_DYN_ONE");   /* 0: the two launches a layer (A/B) */
    x->one = !(eo && *eo && atoi(eo) == 0);
    const char *et = getenv("KVS_LEAN_DYN_TAB");   /* 0: the merge reads the page table from L2 (A/B) */
    x->tab = !(et && *et && atoi(et) == 0);
    x->max_parts = max_jobs > x->target ? max_jobs : x->target;
    DALLOC(D.part, (size_t)x->max_parts * c->group * 2 * sizeof(float));
    DALLOC(D.part_o, (size_t)x->max_parts * c->group * c->head_dim * sizeof(float));
    DALLOC(D.done, ((size_t)max_jobs + 2) * sizeof(int));
#undef DALLOC
    if (bad) {
        cudaGetLastError();
        kvs_lean_dyn_cuda_free(x);
        return kvs_err(err, errlen, -ENOMEM, "lean dynamic (cuda): cannot allocate %d pages of %zu bytes", n_pages,
                       c->page_bytes);
    }
    /* the ring holds every page in id order; heads start empty (last_pos -1) */
    int32_t *ring = (int32_t *)malloc((size_t)n_pages * sizeof(int32_t));
    dyn_head *hs = (dyn_head *)malloc(S * sizeof(dyn_head));
    if (!ring || !hs) {
        free(ring), free(hs);
        kvs_lean_dyn_cuda_free(x);
        return kvs_err(err, errlen, -ENOMEM, "lean dynamic (cuda): out of memory");
    }
    for (int i = 0; i < n_pages; i++) ring[i] = i;
    for (size_t i = 0; i < S; i++) hs[i] = dyn_head{0, 0, 0, 0, 0, 0, 0, -1, 0};
    const dyn_pm pm = {0, n_pages, 0};
    CUDA_CHECK(cudaMemcpy(D.ring, ring, (size_t)n_pages * sizeof(int32_t), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(D.heads, hs, S * sizeof(dyn_head), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(D.pm, &pm, sizeof pm, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemset(D.nhp, 0, S * sizeof(int32_t)));
    CUDA_CHECK(cudaMemset(D.nlp, 0, S * sizeof(int32_t)));
    CUDA_CHECK(cudaMemset(D.wacc, 0, S * W1 * sizeof(float)));
    CUDA_CHECK(cudaMemset(D.done, 0, ((size_t)max_jobs + 2) * sizeof(int)));
    /* these copies and memsets run on the legacy default stream, which the backend's non-blocking
     * stream does not wait for (and a pageable cudaMemcpy may return before its DMA lands): without
     * this wait the first step's page round can read the pool's fresh memory before its state */
    CUDA_CHECK(cudaDeviceSynchronize());
    free(ring), free(hs);
    *out = x;
    return 0;
}

extern "C" void kvs_lean_dyn_cuda_set_split(struct kvs_lean_dyn_cuda *x, int max_splits, int min_tokens)
{
    x->splits = max_splits < 0 ? 0 : max_splits > DYN_MAXSPLIT ? DYN_MAXSPLIT : max_splits;
    x->min_tokens = min_tokens < 1 ? 1 : min_tokens;
}

extern "C" int kvs_lean_dyn_cuda_set_jobs(struct kvs_lean_dyn_cuda *x, const struct kvs_lean_dyn_cuda_job *jobs,
                                          int n_jobs)
{
    if (n_jobs > x->max_jobs) return -E2BIG;
    x->all_single = 1, x->max_rows_job = 0, x->rows_total = 0;
    for (int i = 0; i < n_jobs; i++) {
        x->all_single &= jobs[i].head < 0 || jobs[i].rows == 1;
        if (jobs[i].head < 0) continue;
        if (jobs[i].rows > x->max_rows_job) x->max_rows_job = jobs[i].rows;
        if (jobs[i].row0 + jobs[i].rows > x->rows_total) x->rows_total = jobs[i].row0 + jobs[i].rows;
    }
    if (n_jobs > 0)
        CUDA_CHECK(cudaMemcpyAsync(x->d.jobs, jobs, (size_t)n_jobs * sizeof *jobs, cudaMemcpyHostToDevice, x->b->stream));
    return 0;
}

extern "C" void kvs_lean_dyn_cuda_step(struct kvs_lean_dyn_cuda *x, int n_jobs, int layer, const struct kvs_dbuf *q,
                                       const struct kvs_dbuf *k, const struct kvs_dbuf *v,
                                       const struct kvs_dbuf *ext_lse, float scale, struct kvs_dbuf *out, int phases)
{
    if (n_jobs <= 0) return;
    cudaStream_t s = x->b->stream;
    const dyn_dev &D = x->d;
    const int GM = D.G <= 2 ? 2 : D.G <= 4 ? 4 : 8, KM = D.hd <= 64 ? 2 : D.hd <= 128 ? 4 : 8;
    const size_t smem = (size_t)(2 * D.G * D.hd + GM * DYN_THREADS + 2 * D.hd + GM * DYN_WARPS + DYN_WARPS) *
                            sizeof(float) + 3 * DYN_WARPS * sizeof(int);
    const float *qd = q ? (const float *)q->d : NULL, *kd = k ? (const float *)k->d : NULL;
    const float *vd = v ? (const float *)v->d : NULL;
    float *od = out ? (float *)out->d : NULL;
    const float *ed = ext_lse ? (const float *)ext_lse->d : NULL;
    const int att = KVS_LEAN_DYN_ATTEND | KVS_LEAN_DYN_EXIT, round = (phases & KVS_LEAN_DYN_PAGES) != 0;
    if (x->splits > 0 && x->all_single && (phases & att) == att) {
        /* decode: each head's tokens over several blocks, then the merge, scores and exit */
        int S = x->target / n_jobs;
        if (S > x->splits) S = x->splits;
        if (S > x->max_parts / n_jobs) S = x->max_parts / n_jobs;
        if (S < 1) S = 1;
        const size_t ssm = (size_t)(2 * D.G * D.hd + GM * DYN_THREADS + GM * DYN_WARPS) * sizeof(float);
        size_t msm = (size_t)(2 * D.hd + 4 * DYN_WARPS) * sizeof(float);
        /* the merge's copy of the page table where it fits the default 48 KiB */
        const int tab = x->tab && msm + (size_t)D.table_len * sizeof(int32_t) <= 48 * 1024 &&
                        ssm <= 48 * 1024;
        if (tab) msm += (size_t)D.table_len * sizeof(int32_t);
        const size_t dsm = ssm > msm ? ssm : msm;
        /* + the page round's block, first (x = 0): one launch a layer waits for it */
        const dim3 grid((unsigned)n_jobs + 1, (unsigned)S), mgrid((unsigned)n_jobs + 1, 1);
        const int n_launch = x->one ? 1 : 2;
        for (int li = 0; li < n_launch; li++) {
            const int form = x->one ? DYN_ONE : li == 0 ? DYN_TWO_SPLIT : DYN_TWO_MERGE;
            const dim3 gr = form == DYN_TWO_MERGE ? mgrid : grid;
#define DYN_DECODE(gm, km)                                                                                          \
    if (GM == gm && KM == km)                                                                                       \
        k_dyn_decode<gm, km><<<gr, DYN_THREADS, dsm, s>>>(D, qd, kd, vd, ed, od, scale, layer, S, x->min_tokens, round, form, tab)
            DYN_DECODE(2, 2); DYN_DECODE(2, 4); DYN_DECODE(2, 8);
            DYN_DECODE(4, 2); DYN_DECODE(4, 4); DYN_DECODE(4, 8);
            DYN_DECODE(8, 2); DYN_DECODE(8, 4); DYN_DECODE(8, 8);
#undef DYN_DECODE
            LAUNCH_CHECK();
        }
        return;
    }
    /* prompt chunks (jobs of more than one row) take the paper's prefill once its buffers are
     * reserved for the step's rows; jobs of one row (decode) keep Algorithm 1's step, here */
    const int prefill = !x->all_single && (phases & att) == att && D.pf_rows >= x->rows_total;
    if (phases & KVS_LEAN_DYN_PAGES) {
        k_dyn_alloc<<<1, DYN_SCAN, 0, s>>>(x->d, n_jobs, layer);
        LAUNCH_CHECK();
    }
    if (prefill) dyn_prefill_launch(x, n_jobs, layer, qd, kd, vd, ed, scale, od);
    const int sp = phases | (prefill ? DYN_ONLY_SINGLE : 0);
#define DYN_STEP(gm, km)                                                                                            \
    if (GM == gm && KM == km) k_dyn_step<gm, km><<<n_jobs, DYN_THREADS, smem, s>>>(D, qd, kd, vd, ed, scale, od, sp, layer)
    DYN_STEP(2, 2); DYN_STEP(2, 4); DYN_STEP(2, 8);
    DYN_STEP(4, 2); DYN_STEP(4, 4); DYN_STEP(4, 8);
    DYN_STEP(8, 2); DYN_STEP(8, 4); DYN_STEP(8, 8);
#undef DYN_STEP
    LAUNCH_CHECK();
    if (phases & KVS_LEAN_DYN_PAGES) {
        k_dyn_trim<<<1, DYN_SCAN, 0, s>>>(x->d, n_jobs, layer);
        LAUNCH_CHECK();
    }
}

__global__ void k_dyn_mask_slots(const int32_t *slots, const int32_t *keep, int32_t *out, int n)
{
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r < n) out[r] = keep[r] ? slots[r] : -1;
}

extern "C" void kvs_lean_dyn_cuda_mask_slots(struct kvs_backend *b, const struct kvs_dbuf *slots,
                                             const struct kvs_dbuf *keep, struct kvs_dbuf *out, int n)
{
    if (n <= 0) return;
    k_dyn_mask_slots<<<(n + 255) / 256, 256, 0, b->stream>>>((const int32_t *)slots->d, (const int32_t *)keep->d,
                                                             (int32_t *)out->d, n);
    LAUNCH_CHECK();
}

/* Copies heads [first, first + n) (state, high and low page counts) and the page manager out of
 * the device after waiting for the stream; the caller frees *hs and *np ([2n]: high, then low). */
static void usage_copy(struct kvs_lean_dyn_cuda *x, int first, int n, dyn_head **hs, int32_t **np, dyn_pm *pm)
{
    *hs = (dyn_head *)malloc((size_t)n * sizeof **hs);
    *np = (int32_t *)malloc(2 * (size_t)n * sizeof **np);
    if (!*hs || !*np) kvs_panic(__FILE__, __LINE__, "out of memory");
    CUDA_CHECK(cudaStreamSynchronize(x->b->stream));
    CUDA_CHECK(cudaMemcpy(*hs, x->d.heads + first, (size_t)n * sizeof **hs, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(*np, x->d.nhp + first, (size_t)n * sizeof **np, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(*np + n, x->d.nlp + first, (size_t)n * sizeof **np, cudaMemcpyDeviceToHost));
    if (pm) CUDA_CHECK(cudaMemcpy(pm, x->d.pm, sizeof *pm, cudaMemcpyDeviceToHost));
}

/* adds heads [i0, i1) of a usage_copy of n heads to the sums */
static void usage_add(const dyn_head *hs, const int32_t *np, int n, int i0, int i1, double *pages, double *high,
                      double *low, double *window, double *pruned)
{
    for (int i = i0; i < i1; i++) {
        *pages += np[i] + np[n + i];
        *high += hs[i].n_high, *low += hs[i].n_low, *window += hs[i].w_n, *pruned += hs[i].pruned;
    }
}

extern "C" void kvs_lean_dyn_cuda_usage(struct kvs_lean_dyn_cuda *x, int first, int n, double *pages, double *high,
                                        double *low, double *window, double *pruned, double *seen_first)
{
    *pages = *high = *low = *window = *pruned = *seen_first = 0;
    if (first < 0 || n <= 0 || first + n > x->n_states) return;
    dyn_head *hs;
    int32_t *np;
    usage_copy(x, first, n, &hs, &np, NULL);
    usage_add(hs, np, n, 0, n, pages, high, low, window, pruned);
    *seen_first = (double)hs[0].seen;
    free(hs), free(np);
}

extern "C" void kvs_lean_dyn_cuda_usage_groups(struct kvs_lean_dyn_cuda *x, int group_len, int n_groups,
                                               const unsigned char *live, double *pages, double *high, double *low,
                                               double *window, double *pruned, double *seen_sum, int *free_pages)
{
    *pages = *high = *low = *window = *pruned = *seen_sum = 0;
    *free_pages = 0;
    const int n = group_len * n_groups;
    if (group_len <= 0 || n_groups <= 0 || n > x->n_states) return;
    dyn_head *hs;
    int32_t *np;
    dyn_pm pm;
    usage_copy(x, 0, n, &hs, &np, &pm);
    for (int g = 0; g < n_groups; g++) {
        if (!live[g]) continue;
        usage_add(hs, np, n, g * group_len, (g + 1) * group_len, pages, high, low, window, pruned);
        *seen_sum += (double)hs[g * group_len].seen;
    }
    *free_pages = (int)(pm.tail - pm.head);
    free(hs), free(np);
}

/* ---- the counters' snapshots ---------------------------------------------------------------
 * The counters (kv_storage_lean_dyn.c) once read the heads with a stream wait and four copies
 * each time a step had changed them: under scheduler.async that wait held the host until the
 * step it had just queued was done, so the host's preparation of the next step no longer
 * overlapped the device's work (every step paid host + device time). A snapshot is summed on the
 * device and copied to pinned memory behind the stream's work instead; the host reads the newest
 * one that has landed (an event query), and waits only when asked to (an idle stream). */
#define SNAP_F 6   /* per group: pages, high, low, window, pruned, first head's seen */

__global__ void __launch_bounds__(128) k_dyn_usage(dyn_dev D, int group_len, long long *out)
{
    __shared__ unsigned long long sum[SNAP_F - 1];
    if (threadIdx.x < SNAP_F - 1) sum[threadIdx.x] = 0;
    __syncthreads();
    unsigned long long a[SNAP_F - 1] = {0, 0, 0, 0, 0};
    for (int i = threadIdx.x; i < group_len; i += blockDim.x) {
        const int st = blockIdx.x * group_len + i;
        const dyn_head h = D.heads[st];
        a[0] += (unsigned long long)(D.nhp[st] + D.nlp[st]), a[1] += (unsigned long long)h.n_high;
        a[2] += (unsigned long long)h.n_low, a[3] += (unsigned long long)h.w_n, a[4] += (unsigned long long)h.pruned;
    }
    for (int f = 0; f < SNAP_F - 1; f++)
        if (a[f]) atomicAdd(&sum[f], a[f]);   /* integers: any order gives the same sums */
    __syncthreads();
    long long *o = out + (long long)blockIdx.x * SNAP_F;
    if (threadIdx.x < SNAP_F - 1) o[threadIdx.x] = (long long)sum[threadIdx.x];
    if (threadIdx.x == 0) o[SNAP_F - 1] = D.heads[(long long)blockIdx.x * group_len].seen;
    if (blockIdx.x == 0 && threadIdx.x == 0) out[(long long)gridDim.x * SNAP_F] = D.pm->tail - D.pm->head;
}

extern "C" int kvs_lean_dyn_cuda_snapshot(struct kvs_lean_dyn_cuda *x, int group_len, int n_groups, int wait)
{
    if (group_len <= 0 || n_groups <= 0 || (long long)group_len * n_groups > x->n_states) return -EINVAL;
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    CUDA_CHECK(cudaStreamIsCapturing(x->b->stream, &cs));
    if (cs != cudaStreamCaptureStatusNone) return -EBUSY;   /* never inside a recording */
    const int cap = n_groups * SNAP_F + 1;
    if (cap > x->snap_cap) {   /* first use (or a larger grouping): allocated outside the hot path's recordings */
        CUDA_CHECK(cudaStreamSynchronize(x->b->stream));
        if (x->snap_d) CUDA_CHECK(cudaFree(x->snap_d));
        CUDA_CHECK(cudaMalloc((void **)&x->snap_d, (size_t)cap * sizeof(long long)));
        for (int i = 0; i < 2; i++) {
            if (x->snap_h[i]) CUDA_CHECK(cudaFreeHost(x->snap_h[i]));
            CUDA_CHECK(cudaMallocHost((void **)&x->snap_h[i], (size_t)cap * sizeof(long long)));
            if (!x->snap_ev[i]) CUDA_CHECK(cudaEventCreateWithFlags(&x->snap_ev[i], cudaEventDisableTiming));
            x->snap_seq[i] = 0;
        }
        x->snap_cap = cap;
    }
    /* the buffer after the newest; one whose copy is still queued is not overwritten */
    const int b = x->snap_seq[0] > x->snap_seq[1] ? 1 : 0;
    if (x->snap_seq[b]) {
        const cudaError_t q = wait ? cudaEventSynchronize(x->snap_ev[b]) : cudaEventQuery(x->snap_ev[b]);
        if (q == cudaErrorNotReady) return -EBUSY;
        CUDA_CHECK(q);
    }
    k_dyn_usage<<<n_groups, 128, 0, x->b->stream>>>(x->d, group_len, x->snap_d);
    LAUNCH_CHECK();
    CUDA_CHECK(cudaMemcpyAsync(x->snap_h[b], x->snap_d, (size_t)cap * sizeof(long long), cudaMemcpyDeviceToHost,
                               x->b->stream));
    CUDA_CHECK(cudaEventRecord(x->snap_ev[b], x->b->stream));
    x->snap_seq[b] = ++x->snap_count;
    x->snap_groups = n_groups, x->snap_len = group_len;
    return 0;
}

extern "C" int kvs_lean_dyn_cuda_snapshot_read(struct kvs_lean_dyn_cuda *x, int wait, int group_len, int n_groups,
                                               const unsigned char *live, double *pages, double *high, double *low,
                                               double *window, double *pruned, double *seen_sum, int *free_pages)
{
    /* the newest snapshot of this grouping that has landed (wait: the newest, waited for) */
    int best = -1;
    for (int i = 0; i < 2; i++) {
        if (!x->snap_seq[i] || (best >= 0 && x->snap_seq[i] < x->snap_seq[best])) continue;
        best = i;
    }
    if (best >= 0 && wait) CUDA_CHECK(cudaEventSynchronize(x->snap_ev[best]));
    if (best >= 0 && !wait) {
        cudaError_t q = cudaEventQuery(x->snap_ev[best]);
        if (q == cudaErrorNotReady) {   /* the older one, if it has landed */
            best = 1 - best;
            q = x->snap_seq[best] ? cudaEventQuery(x->snap_ev[best]) : cudaErrorNotReady;
            if (q == cudaErrorNotReady) best = -1;
            else CUDA_CHECK(q);
        } else {
            CUDA_CHECK(q);
        }
    }
    if (best < 0 || x->snap_groups != n_groups || x->snap_len != group_len) return 0;
    const long long *h = x->snap_h[best];
    *pages = *high = *low = *window = *pruned = *seen_sum = 0;
    for (int g = 0; g < n_groups; g++) {
        if (!live[g]) continue;
        const long long *o = h + (long long)g * SNAP_F;
        *pages += (double)o[0], *high += (double)o[1], *low += (double)o[2], *window += (double)o[3];
        *pruned += (double)o[4], *seen_sum += (double)o[5];
    }
    *free_pages = (int)h[(long long)n_groups * SNAP_F];
    return 1;
}

extern "C" int kvs_lean_dyn_cuda_idle(struct kvs_lean_dyn_cuda *x)
{
    const cudaError_t q = cudaStreamQuery(x->b->stream);
    if (q == cudaErrorNotReady) return 0;
    CUDA_CHECK(q);
    return 1;
}

extern "C" void kvs_lean_dyn_cuda_release(struct kvs_lean_dyn_cuda *x, int first, int n)
{
    if (first < 0 || n <= 0 || first + n > x->n_states) return;
    k_dyn_release<<<1, 1, 0, x->b->stream>>>(x->d, first, n);
    LAUNCH_CHECK();
}

extern "C" int kvs_lean_dyn_cuda_error(struct kvs_lean_dyn_cuda *x)
{
    dyn_pm pm;
    CUDA_CHECK(cudaStreamSynchronize(x->b->stream));
    CUDA_CHECK(cudaMemcpy(&pm, x->d.pm, sizeof pm, cudaMemcpyDeviceToHost));
    if (!pm.err) return 0;
    const int e = pm.err;
    pm.err = 0;
    CUDA_CHECK(cudaMemcpy(x->d.pm, &pm, sizeof pm, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaDeviceSynchronize()); /* landed before the stream's next kernel (see create) */
    return e == 1 ? -ENOSPC : -E2BIG;
}

extern "C" int kvs_lean_dyn_cuda_n_free(struct kvs_lean_dyn_cuda *x)
{
    dyn_pm pm;
    CUDA_CHECK(cudaStreamSynchronize(x->b->stream));
    CUDA_CHECK(cudaMemcpy(&pm, x->d.pm, sizeof pm, cudaMemcpyDeviceToHost));
    return (int)(pm.tail - pm.head);
}

extern "C" void kvs_lean_dyn_cuda_get(struct kvs_lean_dyn_cuda *x, int st, struct kvs_lean_dyn_head *h, uint8_t *pages,
                                      int32_t *table, int *n_high_pages, int *n_low_pages, struct kvs_lean_event *ev)
{
    const dyn_dev &D = x->d;
    const size_t W1 = (size_t)D.W + 1, hd = (size_t)D.hd;
    CUDA_CHECK(cudaStreamSynchronize(x->b->stream));
    dyn_head dh;
    CUDA_CHECK(cudaMemcpy(&dh, D.heads + st, sizeof dh, cudaMemcpyDeviceToHost));
    h->n_high = dh.n_high, h->n_low = dh.n_low, h->max_high = dh.max_high, h->max_low = dh.max_low;
    h->w_start = dh.w_start, h->w_n = dh.w_n, h->pruned = dh.pruned, h->last_pos = dh.last_pos, h->seen = dh.seen;
    bf16 *w = (bf16 *)malloc(2 * W1 * hd * sizeof(bf16));
    if (!w) kvs_panic(__FILE__, __LINE__, "out of memory");
    CUDA_CHECK(cudaMemcpy(w, D.wk + st * W1 * hd, W1 * hd * sizeof(bf16), cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(w + W1 * hd, D.wv + st * W1 * hd, W1 * hd * sizeof(bf16), cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < W1 * hd; i++) h->wk[i] = __bfloat162float(w[i]), h->wv[i] = __bfloat162float(w[W1 * hd + i]);
    free(w);
    CUDA_CHECK(cudaMemcpy(h->wpos, D.wpos + st * W1, W1 * sizeof(int32_t), cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(h->wacc, D.wacc + st * W1, W1 * sizeof(float), cudaMemcpyDeviceToHost));
    if (pages) CUDA_CHECK(cudaMemcpy(pages, D.pages, (size_t)D.n_pages * D.page_bytes, cudaMemcpyDeviceToHost));
    if (table)
        CUDA_CHECK(cudaMemcpy(table, D.tables + (size_t)st * D.table_len, (size_t)D.table_len * sizeof(int32_t),
                              cudaMemcpyDeviceToHost));
    if (n_high_pages) CUDA_CHECK(cudaMemcpy(n_high_pages, D.nhp + st, sizeof(int32_t), cudaMemcpyDeviceToHost));
    if (n_low_pages) CUDA_CHECK(cudaMemcpy(n_low_pages, D.nlp + st, sizeof(int32_t), cudaMemcpyDeviceToHost));
    if (ev) CUDA_CHECK(cudaMemcpy(ev, D.ev + st, sizeof *ev, cudaMemcpyDeviceToHost));
}

extern "C" void kvs_lean_dyn_cuda_set(struct kvs_lean_dyn_cuda *x, int st, const struct kvs_lean_dyn_head *h,
                                      const uint8_t *pages, const int32_t *table, int n_high_pages, int n_low_pages)
{
    const dyn_dev &D = x->d;
    const size_t W1 = (size_t)D.W + 1, hd = (size_t)D.hd;
    CUDA_CHECK(cudaStreamSynchronize(x->b->stream));
    const dyn_head dh = {h->n_high, h->n_low, h->max_high, h->max_low, h->w_start, h->w_n, h->pruned, h->last_pos,
                         (long long)h->seen};
    CUDA_CHECK(cudaMemcpy(D.heads + st, &dh, sizeof dh, cudaMemcpyHostToDevice));
    bf16 *w = (bf16 *)malloc(2 * W1 * hd * sizeof(bf16));
    if (!w) kvs_panic(__FILE__, __LINE__, "out of memory");
    for (size_t i = 0; i < W1 * hd; i++) w[i] = __float2bfloat16_rn(h->wk[i]), w[W1 * hd + i] = __float2bfloat16_rn(h->wv[i]);
    CUDA_CHECK(cudaMemcpy(D.wk + st * W1 * hd, w, W1 * hd * sizeof(bf16), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(D.wv + st * W1 * hd, w + W1 * hd, W1 * hd * sizeof(bf16), cudaMemcpyHostToDevice));
    free(w);
    CUDA_CHECK(cudaMemcpy(D.wpos + st * W1, h->wpos, W1 * sizeof(int32_t), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(D.wacc + st * W1, h->wacc, W1 * sizeof(float), cudaMemcpyHostToDevice));
    if (pages) CUDA_CHECK(cudaMemcpy(D.pages, pages, (size_t)D.n_pages * D.page_bytes, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(D.tables + (size_t)st * D.table_len, table, (size_t)D.table_len * sizeof(int32_t),
                          cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(D.nhp + st, &n_high_pages, sizeof(int32_t), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(D.nlp + st, &n_low_pages, sizeof(int32_t), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaDeviceSynchronize()); /* landed before the stream's next kernel (see create) */
}
