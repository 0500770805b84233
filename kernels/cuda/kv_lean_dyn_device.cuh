/* kv_lean_dyn_device.cuh: what the dynamic mode's CUDA files share (kv_lean_dyn.cu: the page
 * rounds, Algorithm 1's step, the split decode; kv_lean_dyn_prefill.cu: the paper's prefill):
 * the device state (struct kvs_lean_dyn_cuda, dyn_dev), the page entries' layout and the host's
 * arithmetic for them (dequantize, quantize one vector per warp, the score), and the token
 * lookups of the attention. Header-only device code, included by those two files only.
 * Ownership: kvs_lean_dyn_cuda_create / _free (kv_lean_dyn.cu) own every pointer of dyn_dev.
 * Errors: none here (the kernels do not validate). */
#ifndef KVS_KV_LEAN_DYN_DEVICE_CUH
#define KVS_KV_LEAN_DYN_DEVICE_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#include <string.h>

#include "kernels/cuda/cuda_internal.cuh"
#include "kernels/cuda/kv_lean_quant.cuh"

extern "C" {
#include "kernels/kv_lean_dyn_cuda.h"
}

#define DYN_THREADS 256
#define DYN_WARPS (DYN_THREADS / 32)
#define DYN_SCAN 1024
#define DYN_MAXG 8
#define DYN_MAXHD 256   /* the output keeps hd / 32 sums per lane and q head */
#define DYN_MAXSPLIT 16 /* a decode step's blocks per head at most (the split path) */
#define DYN_SPLIT_MIN 64 /* tokens per split at least: fewer splits for short heads */
#define DYN_ONLY_SINGLE 64 /* k_dyn_step's phases bit: jobs of one row only (the prefill takes the others) */

struct dyn_head {
    int n_high, n_low, max_high, max_low, w_start, w_n, pruned, last_pos;
    long long seen;
};

struct dyn_pm {
    long long head, tail;         /* the ring's allocation / free pointers (monotonic) */
    int err;                      /* sticky: 1 = -ENOSPC, 2 = -E2BIG */
};

/* what the kernels read: sizes and device arrays */
struct dyn_dev {
    int layer_stride;
    int hd, G, W, kbits, vbits, lkbits, lvbits, tp_hi, tp_lo, max_ctx, table_len, n_pages, nq, nkv;
    int kc, vc, lkc, lvc;         /* code bytes of the high / low K and V vectors */
    long long entry_hi, entry_lo, page_bytes;
    double alpha_h, alpha_l;
    dyn_head *heads;
    bf16 *wk, *wv;                /* [state][W + 1][hd] */
    int32_t *wpos;                /* [state][W + 1] */
    float *wacc;
    uint8_t *pages;
    int32_t *ring, *tables, *nhp, *nlp; /* ring [n_pages]; tables [state][table_len]; page counts [state] */
    dyn_pm *pm;
    struct kvs_lean_event *ev;    /* [state] */
    struct kvs_lean_dyn_cuda_job *jobs;
    int32_t *need_hi, *need_lo;   /* [max_jobs] */
    long long *off;               /* [max_jobs] */
    float *scratch;               /* [max_jobs][G][max_ctx + 1] */
    int *done;                    /* split decode steps: [0] merges finished, [1] the page round's flag,
                                   * [2 + job] the job's splits finished (all 0 between launches) */
    float *part, *part_o;         /* split decode steps: [max_parts][G] (m, l) pairs, [max_parts][G][hd] */
    /* the prefill (kvs_lean_dyn_cuda_reserve_rows): each row's (M, L) per q head [pf_rows][nq][2]
     * (its max logit and sum, the documents' part included) and the chunk tokens' score sums
     * [pf_rows][nkv]; NULL / 0 until reserved (a chunk then runs row by row) */
    float *pf_ml, *pf_tsum;
    int pf_rows;
};

struct kvs_lean_dyn_cuda {
    struct kvs_backend *b;
    struct kvs_lean_dyn_cfg c;
    int n_states, max_jobs;
    int max_parts;                /* (job, split) partials the split path has room for */
    int splits, min_tokens;       /* a decode step's splits per head at most (0: the sequential path), and
                                   * the fewest tokens a split takes */
    int target;                   /* blocks a split launch aims at (2 per SM) */
    int one;                      /* a decode step's layer in one launch (k_dyn_decode's DYN_ONE; 0: the
                                   * split and merge launches before it, KVS_LEAN_DYN_ONE=0) */
    int tab;                      /* the merge copies the head's page table to shared memory (0:
                                   * KVS_LEAN_DYN_TAB=0, the lookups read it from L2) */
    int all_single;               /* the jobs of set_jobs each run one row (or none: padding) */
    int max_rows_job, rows_total; /* set_jobs: a job's most rows, and the rows of every job of one KV head */
    /* the counters' snapshots (kvs_lean_dyn_cuda_snapshot): per group [pages, high, low, window,
     * pruned, first head's seen], then the free pages, summed on the device (snap_d) and copied
     * to one of two pinned host buffers behind the stream's work; snap_seq[i]: the snapshot
     * buffer i holds (0: none), snap_ev[i] records its copy */
    long long *snap_d, *snap_h[2];
    cudaEvent_t snap_ev[2];
    unsigned long long snap_seq[2], snap_count;
    int snap_groups, snap_len, snap_cap;
    dyn_dev d;
};

/* ---- the host's arithmetic (kernels/kv_lean_format.c) ------------------------------------- */
__device__ __forceinline__ uint16_t ld16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }

/* element i of a vector of `bits` (codes, then (s, z) at codes + code bytes below 16 bits) */
__device__ __forceinline__ float dyn_deq(const uint8_t *codes, int cbytes, int bits, int i)
{
    if (bits == 16) return lean_h2f(ld16(codes + 2 * i));
    const float s = lean_h2f(ld16(codes + cbytes)), z = lean_h2f(ld16(codes + cbytes + 2));
    const int per = 8 / bits, mask = (1 << bits) - 1;
    const int c = codes[i / per] >> (bits * (i % per)) & mask;
    return __fsub_rn(__fmul_rn(s, (float)c), z);
}

/* ---- entries (kernels/cpu/kv_lean_dyn.c's layout) ------------------------------------------- */
struct dyn_fmt {
    int kbits, vbits, kc, vc;
    long long bytes;
};

__device__ __forceinline__ dyn_fmt fmt_of(const dyn_dev &D, int high)
{
    return high ? dyn_fmt{D.kbits, D.vbits, D.kc, D.vc, D.entry_hi} : dyn_fmt{D.lkbits, D.lvbits, D.lkc, D.lvc, D.entry_lo};
}

__device__ __forceinline__ uint8_t *entry_at(const dyn_dev &D, int st, int high, int j)
{
    const int32_t *t = D.tables + (long long)st * D.table_len;
    if (high) return D.pages + (long long)t[j / D.tp_hi] * D.page_bytes + (long long)(j % D.tp_hi) * D.entry_hi;
    return D.pages + (long long)t[D.table_len - 1 - j / D.tp_lo] * D.page_bytes + (long long)(j % D.tp_lo) * D.entry_lo;
}

/* a head's page table row for Algorithm 1's exit: a copy in shared memory (the merge of a split
 * decode step: one coalesced read, then the exit's lookups cost no global round trip), or the
 * row in global memory read from L2 (cg: in the one-launch decode step the page round's block
 * appends to the table in the same launch, and this SM's L1 may hold the line from before) */
struct dyn_tab {
    const int32_t *t;
    int cg;
};

__device__ __forceinline__ uint8_t *entry_tab(const dyn_dev &D, const dyn_tab &T, int high, int j)
{
    const int i = high ? j / D.tp_hi : D.table_len - 1 - j / D.tp_lo;
    const long long pg = T.cg ? __ldcg(T.t + i) : T.t[i];
    return D.pages + pg * D.page_bytes + (long long)(high ? j % D.tp_hi : j % D.tp_lo) * (high ? D.entry_hi : D.entry_lo);
}

__device__ __forceinline__ int32_t e_pos(const uint8_t *e) { int32_t p; memcpy(&p, e, 4); return p; }
__device__ __forceinline__ float e_acc(const uint8_t *e) { float a; memcpy(&a, e + 4, 4); return a; }
__device__ __forceinline__ void e_set(uint8_t *e, int32_t pos, float acc) { memcpy(e, &pos, 4), memcpy(e + 4, &acc, 4); }
__device__ __forceinline__ const uint8_t *e_k(const uint8_t *e) { return e + 8; }
__device__ __forceinline__ const uint8_t *e_v(const uint8_t *e, const dyn_fmt &f)
{
    return e + 8 + f.kc + (f.kbits < 16 ? 4 : 0);
}

/* kv_lean_dyn.c's score: the sum over the queries since the token arrived */
__device__ __forceinline__ float dyn_score(float acc, int32_t pos, int32_t last)
{
    return last >= pos ? __fdiv_rn(acc, (float)(last - pos + 1)) : 0.0f;
}

/* One warp quantizes x[0..d) (kvs_lean_quantize, bitwise): codes, then (s, z) below 16 bits.
 * The host's min / max loop (mn = x[0], then `if (x[i] < mn)`) is a first-wins scan that skips
 * NaNs after x[0] and keeps x[0] if it is one; each lane scans a contiguous slice the same way
 * and the lanes merge lower slice first, so the result is the host's to the bit (-0 / +0 ties
 * included, which decide z's sign). Each lane then packs whole code bytes: no read-modify-write
 * of global memory (a thread's serial |= into device memory was a round trip per element). */
static __device__ void warp_quant(const float *x, int d, int bits, uint8_t *codes)
{
    const int lane = threadIdx.x & 31;
    if (bits == 16) {
        /* one 16-bit store per value: byte stores of the fp16 bits came out as the value
         * converted to an integer in the H100 build (2026-11-24: test_cuda_kv_lean_dyn's K16V16
         * tier, as kv_lean.cu's write before it); codes is 2-byte aligned whenever 16-bit
         * entries are (even entry and page sizes), else the bits go through an opaque move */
        for (int i = lane; i < d; i += 32) {
            unsigned h = lean_f2h(lean_sat_half(x[i]));
            if (!((uintptr_t)codes & 1)) {
                reinterpret_cast<uint16_t *>(codes)[i] = (uint16_t)h;
                continue;
            }
            asm volatile("mov.b32 %0, %0;" : "+r"(h));
            codes[2 * i] = (uint8_t)(h & 0xffu), codes[2 * i + 1] = (uint8_t)(h >> 8);
        }
        return;
    }
    const int per_lane = (d + 31) / 32, i0 = lane * per_lane, i1 = min(i0 + per_lane, d);
    float mn = 0.0f, mx = 0.0f;
    int any = 0;
    for (int i = i0; i < i1; i++) {
        const float v = x[i];
        if (i > 0 && v != v) continue;
        if (!any) {
            mn = mx = v, any = 1;
            continue;
        }
        if (v < mn) mn = v;
        if (v > mx) mx = v;
    }
    for (int o = 1; o < 32; o <<= 1) {
        const float pmn = __shfl_xor_sync(0xffffffffu, mn, o), pmx = __shfl_xor_sync(0xffffffffu, mx, o);
        const int pany = __shfl_xor_sync(0xffffffffu, any, o);
        const int upper = lane & o;   /* the partner holds the lower slice */
        const float amn = upper ? pmn : mn, bmn = upper ? mn : pmn;
        const float amx = upper ? pmx : mx, bmx = upper ? mx : pmx;
        const int aany = upper ? pany : any, bany = upper ? any : pany;
        /* a NaN can only be x[0], in the lower part: it stays */
        if (!aany) mn = bmn, mx = bmx;
        else if (!bany || amn != amn) mn = amn, mx = amx;
        else mn = bmn < amn ? bmn : amn, mx = bmx > amx ? bmx : amx;
        any = aany | bany;
    }
    const int top = (1 << bits) - 1, per = 8 / bits, nb = d * bits / 8;
    const lean_sz q = lean_scale_zero(mn, mx, bits);
    for (int b = lane; b < nb; b += 32) {
        unsigned byte = 0;
        for (int e = 0; e < per; e++) byte |= (unsigned)lean_code(x[b * per + e], q, top) << (bits * e);
        codes[b] = (uint8_t)byte;
    }
    if (lane == 0) lean_put_sz(codes + nb, q);
}

/* token t's K (v = 0) or V (v = 1) vector, looked up once: the high / low entry's codes and
 * their (s, z), or the window's bf16 row (bits 0). tv_elem(tv, i) is dyn_deq's arithmetic for
 * element i (the same operations, so the same floats); the lookup (page table, entry, s and z)
 * is what made a thread-per-element walk slow (bench/RESULTS.md, 2026-11-24 lean5) */
struct dyn_tv {
    const uint8_t *p;
    float s, z;
    int bits;
};

__device__ __forceinline__ dyn_tv tok_ref(const dyn_dev &D, int st, const dyn_head &h, int t, int v)
{
    const int nhl = h.n_high + h.n_low;
    dyn_tv r;
    if (t < nhl) {
        const int hi = t < h.n_high;
        const dyn_fmt f = fmt_of(D, hi);
        const uint8_t *e = entry_at(D, st, hi, hi ? t : t - h.n_high);
        const int cb = v ? f.vc : f.kc;
        r.p = v ? e_v(e, f) : e_k(e), r.bits = v ? f.vbits : f.kbits;
        r.s = r.z = 0.0f;
        if (r.bits < 16) r.s = lean_h2f(ld16(r.p + cb)), r.z = lean_h2f(ld16(r.p + cb + 2));
        return r;
    }
    const int w = (h.w_start + t - nhl) % (D.W + 1);
    const long long o = ((long long)st * (D.W + 1) + w) * D.hd;
    r.p = reinterpret_cast<const uint8_t *>((v ? D.wv : D.wk) + o), r.bits = 0, r.s = r.z = 0.0f;
    return r;
}

__device__ __forceinline__ float tv_code(const dyn_tv &r, unsigned c) { return __fsub_rn(__fmul_rn(r.s, (float)c), r.z); }

__device__ __forceinline__ float tv_elem(const dyn_tv &r, int i)
{
    if (r.bits == 0) return __bfloat162float(reinterpret_cast<const bf16 *>(r.p)[i]);
    if (r.bits == 16) return lean_h2f(ld16(r.p + 2 * i));
    const int per = 8 / r.bits, mask = (1 << r.bits) - 1;
    return tv_code(r, r.p[i / per] >> (r.bits * (i % per)) & mask);
}

/* the prefill (kv_lean_dyn_prefill.cu), launched by kvs_lean_dyn_cuda_step for the jobs of more
 * than one row; the step runs the page round before and the trim after */
void dyn_prefill_launch(struct kvs_lean_dyn_cuda *x, int n_jobs, int layer, const float *q, const float *k,
                        const float *v, const float *ext, float scale, float *out);

#endif
