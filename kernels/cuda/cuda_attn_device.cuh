/* cuda_attn_device.cuh: what the attention kernels of kernels/cuda/ share (internal; included by
 * cuda_attention.cu, cuda_attn_prefill.cu, cuda_attn_decode.cu, kv_span.cu and
 * dev/cuda_attn_simt.cu): the launch arguments (struct at_args), the paged K/V tile lookup and
 * cp.async staging, the backward rotation table of deferred RoPE, and the tensor-core pieces
 * (q fragments, QK, the online softmax of a tile, PV) built on mma.sync m16n8k16 (bf16 in, fp32
 * accumulate), plus the host-side launchers each kernel file exports to the dispatcher
 * (cuda_attention.cu).
 *
 * Everything here is a template, static or inline: each .cu compiles its own copy (no relocatable
 * device code), so a kernel's code and registers are those of one translation unit, as before
 * the split. Ownership: nothing is allocated here. Errors: CUDA failures abort (CUDA_CHECK,
 * cuda_launch.h).
 */
#ifndef KVS_CUDA_ATTN_DEVICE_CUH
#define KVS_CUDA_ATTN_DEVICE_CUH

#include <climits>
#include <cuda.h> /* CUtensorMap (types only: the encoder is reached through the runtime) */
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#ifndef _Noreturn
#define _Noreturn [[noreturn]]
#endif
extern "C" {
#include "base/util.h"
}
#include "kernels/cuda/cuda_launch.h"

typedef __nv_bfloat16 bf16;

#define AT_WARPS 4
#define AT_THREADS (AT_WARPS * 32)
#define AT_TILE 32                /* keys per shared-memory tile: one per lane in QK */
#define KEY_PAD INT_MIN           /* per-key info of a key that is not attended (past the range, padding) */
#define AT_WIDE_RPW 8             /* rows per warp of the CUDA-core decode kernel for groups of more than 4 heads */
#define FULL 0xffffffffu
#define PRE_WARPS 4               /* prefill blocks: 4 warps x 16 rows share each K/V tile (8 warps, which
                                   * read the causal prefix half as often, measured slower: bench/RESULTS.md) */

struct at_args {
    const float *q;
    const bf16 *kc, *vc;
    const int32_t *q_start, *pos, *bt, *rot, *valid;
    const int2 *words;            /* NULL, or packed per-block (block, offset << 11 | valid) */
    const float *inv_freq;
    int n_seqs, max_blocks, n_heads, n_kv, bs;
    int G;                        /* query heads per KV head */
    int qt;                       /* query tokens per tile */
    int prefill;                  /* 0: tiles are the sequences with one row; 1: those with more */
    int chunk, n_splits;          /* keys per split (a multiple of AT_TILE), splits */
    float scale;
    float *out, *part;            /* part: [n][n_heads][n_splits][hd + 2] (acc..., max, sum) */
    bf16 *outh;                   /* NULL, or the bf16 copy of out (the o projection's input) */
    /* k_attn_fd<HD, false, true> only: the K and V pools as 2D tensors [rows][hd] for the TMA
     * (16 rows x 64 columns a box, 128-byte swizzle); a __grid_constant__ parameter there */
    CUtensorMap tm_k, tm_v;
    long long kv_rows;            /* host side: rows of hd elements in each of kc, vc (the maps' extent) */
    int trig;                     /* kvs_cu_pdl_early(): k_attn_fd calls grid_dep_launch after its wait */
    /* the batch-invariant split plan (at_split_keys below; decode launches only): 0, or the
     * fewest keys of a split and the most splits of a row; tile0: the first tile of this launch
     * (that plan launches the decode tiles in groups that fit the workspace) */
    int bi_keys, bi_splits, tile0;
};

/* Batch-invariant split plan (kvs_cu_attn.batch_invariant): a row whose keys end at `end` (its
 * context) is cut from key 0 into splits of at_bi_chunk(end) keys, at most max_splits of them, so
 * where its splits start, the order in which each walks its keys and the merge of its partials
 * (k_attn_merge_bi, in split order, also for a single split) depend on its own context alone:
 * not on the other rows of the launch, the graph bucket's capacity (what a recorded launch is
 * planned for), the workspace or the SM count, which is what the automatic plan reads. Computed
 * on the device from the row's position, so a recorded graph replays it as the context grows. */
__host__ __device__ __forceinline__ int at_bi_chunk(int end, int keys, int max_splits)
{
    const int units = (end + keys - 1) / keys;
    return (units + max_splits - 1) / max_splits * keys;
}

/* keys [k0, k1) of split `split` of a tile whose visible keys end at `end`: the launch's chunk,
 * or the batch-invariant plan's */
static __device__ __forceinline__ void at_split_keys(const at_args &a, int split, int end, int *k0, int *k1)
{
    const int chunk = a.bi_keys > 0 ? at_bi_chunk(end, a.bi_keys, a.bi_splits) : a.chunk;
    *k0 = split * chunk;
    *k1 = min(end, *k0 + chunk);
}

/* whether a block writes its rows' final output (one split, automatic plan) rather than a
 * partial that a merge kernel combines */
static __device__ __forceinline__ bool at_direct(const at_args &a) { return a.n_splits == 1 && a.bi_keys == 0; }

/* the partial's row for output row orow (head `head` of decode tile `tile`): orow itself, or
 * under the batch-invariant plan the row within this launch's group of tiles (one row a decode
 * tile), so the workspace holds a group, not the step */
static __device__ __forceinline__ size_t at_part_row(const at_args &a, int tile, int head, size_t orow)
{
    return a.bi_keys > 0 ? (size_t)(tile - a.tile0) * a.n_heads + head : orow;
}

static __device__ __forceinline__ void cp_async16(void *smem, const void *gmem, int src_bytes)
{
    unsigned sa = (unsigned)__cvta_generic_to_shared(smem);
    /* src_bytes 0: nothing is read, the 16 bytes are zero-filled */
#ifdef KVS_ATTN_NO_L2_HINT
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(sa), "l"(gmem), "r"(src_bytes));
#else
    /* L2::256B: the L2 fetches the whole 256-byte segment (a K/V row of head_dim 128) at once */
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(sa), "l"(gmem), "r"(src_bytes));
#endif
}
static __device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

/* Tiles enumerate, in sequence order, the sequences of this launch's kind, ceil(rows / qt) tiles
 * each. Finds tile `tile`: its sequence and first row within the sequence. Every warp computes
 * the same answer (warp scans over 32 sequences at a time), so no block barrier is needed. */
static __device__ bool find_tile(const at_args &a, int tile, int *s_out, int *r0_out)
{
    const int lane = threadIdx.x & 31;
    int base = 0;
    for (int c = 0; c < a.n_seqs; c += 32) {
        int s = c + lane, cnt = 0;
        if (s < a.n_seqs) {
            int ns = a.q_start[s + 1] - a.q_start[s];
            bool mine = a.prefill ? ns > 1 : ns == 1;
            cnt = mine ? (ns + a.qt - 1) / a.qt : 0;
        }
        int inc = cnt;
        for (int o = 1; o < 32; o <<= 1) {
            int v = __shfl_up_sync(FULL, inc, o);
            if (lane >= o) inc += v;
        }
        int total = __shfl_sync(FULL, inc, 31);
        if (tile < base + total) {
            unsigned m = __ballot_sync(FULL, cnt > 0 && tile >= base + inc - cnt && tile < base + inc);
            int src = __ffs((int)m) - 1;
            int excl = __shfl_sync(FULL, inc - cnt, src);
            *s_out = c + src;
            *r0_out = (tile - base - excl) * a.qt;
            return true;
        }
        base += total;
    }
    return false;
}

/* What the copies of the tile of 32 keys starting at kb need, from the block table (global
 * loads): lane l's key kb + l (its row, or -1 when it is not read: past k1 or in a padding slot;
 * its info for ko: the block's rotation offset, 0 without rot, or KEY_PAD), and the rows of keys
 * kb and kb + 16 (each tile half's first slot, read or not) for the two-pointer copies. Kept
 * apart from the copies so that a decode block looks up the tile after next while it computes:
 * done just before the copies, the block-table load stalled the warp once a tile (ncu: a large
 * share of the decode kernel's stall cycles waited on such loads). */
struct tile_meta {
    long long row, base0, base1;
    int info;
};

template <int HD>
__device__ __forceinline__ tile_meta tile_lookup(const at_args &a, int kb, int k1, int kvh, const int32_t *bt,
                                                 const int32_t *vt, const int32_t *rt, const int2 *wt)
{
    const int p = kb + (threadIdx.x & 31);
    tile_meta m;
    m.row = -1;
    m.info = KEY_PAD;
    long long brow = 0; /* the slot's row whether or not it is read (0 past k1: never read) */
    if (p < k1) {
        const int pb = p / a.bs, sl = p - pb * a.bs;
        if (wt) {
            /* one 8-byte load: block, offset and valid count (backend.h kvs_pack_block_words) */
            const int2 w = wt[pb];
            brow = (((long long)w.x * a.n_kv + kvh) * a.bs + sl) * HD;
            if (sl < (w.y & 2047)) {
                m.row = brow;
                m.info = rt ? (w.y >> 11) : 0;
            }
        } else {
            brow = (((long long)bt[pb] * a.n_kv + kvh) * a.bs + sl) * HD;
            if (!vt || sl < vt[pb]) {
                m.row = brow;
                m.info = rt ? rt[pb] : 0;
            }
        }
    }
    m.base0 = __shfl_sync(FULL, brow, 0);
    m.base1 = __shfl_sync(FULL, brow, 16);
    return m;
}

/* Stages the tile that m describes into shared memory (dk, dv: rows of kst elements) with
 * cp.async, and each key's info into ko (warp 0 writes it); keys that are not read get
 * zero-filled rows without touching memory. The general loop gets each copy's row from the lane
 * that looked its key up, by shuffle. */
template <int HD, int NT>
__device__ __forceinline__ void tile_issue(const at_args &a, const tile_meta &m, bf16 *dk, bf16 *dv, int kst, int *ko)
{
    constexpr int CH = HD / 8;
    if (threadIdx.x < 32) ko[threadIdx.x] = m.info;
    /* Fast path, for blocks of a multiple of 16 slots (the tile starts on a 16-key boundary: split
     * chunks are multiples of AT_TILE): keys 16h .. 16h + 15 of the tile are consecutive slots of
     * one block, so a thread's rows are two base pointers plus compile-time offsets. The general
     * loop below spends ~45 instructions of 64-bit address arithmetic and shuffles per pair of
     * copies, about half of a decode tile's instructions (SASS, H100 build). */
    constexpr int S = NT / CH; /* keys covered by one pass of the block's threads */
    if constexpr (NT == 32 && S <= 16) { /* decode blocks (prefill's 4-warp blocks measured slower with it) */
        if (a.bs % 16 == 0) {
            const unsigned vmask = __ballot_sync(FULL, m.row >= 0); /* bit j: key kb + j is read */
            const int j0 = threadIdx.x / CH, c = threadIdx.x % CH;
            const long long base[2] = {m.base0 + j0 * HD + c * 8, m.base1 + j0 * HD + c * 8};
            bf16 *sk = dk + j0 * kst + c * 8, *sv = dv + j0 * kst + c * 8;
#pragma unroll
            for (int i = 0; i < AT_TILE / S; i++) {
                const int h = i * S / 16, off = (i * S) % 16; /* compile-time */
                const int bytes = (vmask >> (j0 + i * S)) & 1u ? 16 : 0;
                cp_async16(sk + i * S * kst, a.kc + base[h] + off * HD, bytes);
                cp_async16(sv + i * S * kst, a.vc + base[h] + off * HD, bytes);
            }
            return;
        }
    }
#pragma unroll
    for (int idx = threadIdx.x; idx < AT_TILE * CH; idx += NT) {
        const int j = idx / CH, c = idx % CH;
        const long long r = __shfl_sync(FULL, m.row, j);
        const bool ok = r >= 0;
        cp_async16(dk + j * kst + c * 8, ok ? a.kc + r + c * 8 : a.kc, ok ? 16 : 0);
        cp_async16(dv + j * kst + c * 8, ok ? a.vc + r + c * 8 : a.vc, ok ? 16 : 0);
    }
}

/* cos and sin of the backward rotation by o into cs_sn (shared by the block) */
static __device__ __noinline__ void rot_table(float *cs_sn, int hd, int o, const float *inv_freq)
{
    const int half = hd / 2;
    __syncthreads(); /* every warp is done with the previous table */
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float sn, cs;
        sincosf((float)((double)o * (double)inv_freq[i]), &sn, &cs);
        cs_sn[i] = cs;
        cs_sn[half + i] = sn;
    }
    __syncthreads();
}

/* ---- tensor-core kernel (mma.sync m16n8k16, bf16 in, fp32 accumulate) ------------------------
 *
 * The prefill kernel: the work split of k_attn, with the products on tensor cores:
 *   S^T[rows x keys] = Q[rows x hd] . K^T   (A = Q fragments held in registers for the whole
 *                                            block, B = K read from the shared tile),
 *   O[rows x hd]   += P[rows x keys] . V    (A = P built in registers straight from the S
 *                                            accumulators, B = V through ldmatrix.trans).
 * Rows are (token, head) pairs as in k_attn; each of the NW warps owns MT m-tiles of 16 rows
 * (prefill: 4 warps x 1 m-tile = 64 rows sharing each K/V tile). Q and P are rounded to bf16
 * for the products (K and V are bf16 already); the softmax statistics and every accumulation
 * stay fp32.
 */
static __device__ __forceinline__ uint32_t pack_bf16(float lo, float hi)
{
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *(uint32_t *)&h;
}

static __device__ __forceinline__ void mma_bf16(float *c, const uint32_t *a, uint32_t b0, uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

static __device__ __forceinline__ void ldsm_x4_trans(uint32_t *r, const void *smem)
{
    unsigned sa = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(sa));
}

/* dim d of a q row, scaled, and with cs_sn ([hd/2] cos, then [hd/2] sin) rotated backward as
 * rotate_q() does: x0 cos + x1 sin for the first half, x1 cos - x0 sin for the second */
template <int HD>
__device__ __forceinline__ float q_dim(const float *qr, int d, float scale, const float *cs_sn)
{
    constexpr int HALF = HD / 2;
    const float x = __ldg(qr + d) * scale;
    if (!cs_sn) return x;
    const int i = d < HALF ? d : d - HALF;
    const float other = __ldg(qr + (d < HALF ? d + HALF : i)) * scale, cs = cs_sn[i], sn = cs_sn[HALF + i];
    return d < HALF ? x * cs + other * sn : x * cs - other * sn;
}

/* A fragments of the warp's MT m-tiles of q, straight from global memory (the rows are a few KB,
 * read once per block and per document boundary): rows past nr are zero; cs_sn (or nullptr)
 * rotates them backward. No shared memory: a decode block's footprint is its K/V stages only. */
template <int HD, int MT>
__device__ __forceinline__ void q_frags(const at_args &a, int qs, int r0, int kvh, int nr, int wrow, int lane,
                                        const float *cs_sn, uint32_t (*qa)[HD / 16][4])
{
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int r = wrow + mt * 16 + g + 8 * h;
            const float *qr = nullptr;
            if (r < nr) {
                const size_t tq = (size_t)qs + r0 + r / a.G;
                qr = a.q + (tq * a.n_heads + (size_t)kvh * a.G + r % a.G) * HD;
            }
#pragma unroll
            for (int ks = 0; ks < HD / 16; ks++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int d = ks * 16 + 2 * t + 8 * e;
                    float v0 = 0.0f, v1 = 0.0f;
                    if (qr) {
                        v0 = q_dim<HD>(qr, d, a.scale, cs_sn);
                        v1 = q_dim<HD>(qr, d + 1, a.scale, cs_sn);
                    }
                    qa[mt][ks][h + 2 * e] = pack_bf16(v0, v1);
                }
        }
}

/* The q fragments rotated backward by the table cs_sn, from the unrotated fragments q0 (scaled,
 * bf16) in registers: the partner of dim d (d +- hd/2) sits in the same lane, in k-step
 * ks +- hd/32 (or, for hd = 16, in the other column group of the same k-step), so a document
 * boundary costs hd/2 sincos and register arithmetic, no memory traffic. The rotation works on
 * the bf16-rounded q (one more bf16 rounding than rotating fp32 q: the deferred-RoPE tests'
 * error stays at bf16 level). */
template <int HD, int MT>
__device__ __forceinline__ void rotate_frags(const uint32_t (*q0)[HD / 16][4], const float *cs_sn, int lane,
                                             uint32_t (*qa)[HD / 16][4])
{
    constexpr int HALF = HD / 2;
    const int t = lane & 3;
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int ks = 0; ks < HD / 16; ks++)
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int base = ks * 16 + 8 * (j >> 1); /* dims base + 2t, base + 2t + 1 */
                const bool lo = base < HALF;
                const int pbase = lo ? base + HALF : base - HALF;
                const int pks = pbase / 16, pj = (j & 1) | ((pbase % 16) >= 8 ? 2 : 0);
                const float2 x = __bfloat1622float2(*(const __nv_bfloat162 *)&q0[mt][ks][j]);
                const float2 p = __bfloat1622float2(*(const __nv_bfloat162 *)&q0[mt][pks][pj]);
                const int i = (lo ? base : base - HALF) + 2 * t;
                const float c0 = cs_sn[i], c1 = cs_sn[i + 1], s0 = cs_sn[HALF + i], s1 = cs_sn[HALF + i + 1];
                const float r0 = lo ? x.x * c0 + p.x * s0 : x.x * c0 - p.x * s0;
                const float r1 = lo ? x.y * c1 + p.y * s1 : x.y * c1 - p.y * s1;
                qa[mt][ks][j] = pack_bf16(r0, r1);
            }
}

template <int MT>
__device__ __forceinline__ void zero_scores(float (*s)[4][4])
{
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) s[mt][j][e] = 0.0f;
}

/* element offset of (row r < 32, column d) in a swizzled sub-tile buffer of k_attn_fd's TMA
 * staging (its section below): 16-row x 64-column boxes, 16-byte chunk c of row r at c ^ (r & 7) */
template <int HD>
__device__ __forceinline__ int sw_off(int r, int d)
{
    return (((r >> 4) * (HD / 64) + (d >> 6)) * 16 + (r & 15)) * 64 + ((((d & 63) >> 3) ^ (r & 7)) << 3) + (d & 7);
}

/* element (row r, column d) of a staged 32-row K or V tile: padded rows of kst elements, or (SW)
 * the TMA's swizzled boxes */
template <int HD, bool SW>
__device__ __forceinline__ const bf16 *tile_at(const bf16 *tile, int kst, int r, int d)
{
    return SW ? tile + sw_off<HD>(r, d) : tile + r * kst + d;
}

/* S^T for the warp's rows against the 32 keys of a tile: s[mt][n-tile of 8 keys][4]; SW: the tile
 * is swizzled (tile_at) */
template <int HD, int MT, bool SW = false>
__device__ __forceinline__ void qk_tc(const bf16 *tk, const uint32_t (*qa)[HD / 16][4], float (*s)[4][4], int lane)
{
    constexpr int KST = HD + 8;
    const int g = lane >> 2, t = lane & 3;
    zero_scores<MT>(s);
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const int r = j * 8 + g; /* B[k = dim][n = key]: key r, dims 2t, 2t + 1 of each 8-dim chunk */
#pragma unroll
        for (int ks = 0; ks < HD / 16; ks++) {
            const uint32_t b0 = *(const uint32_t *)tile_at<HD, SW>(tk, KST, r, ks * 16 + 2 * t);
            const uint32_t b1 = *(const uint32_t *)tile_at<HD, SW>(tk, KST, r, ks * 16 + 8 + 2 * t);
#pragma unroll
            for (int mt = 0; mt < MT; mt++) mma_bf16(s[mt][j], qa[mt][ks], b0, b1);
        }
    }
}

/* S for a tile whose read keys carry several rotation offsets (a document boundary inside it): one
 * QK pass per distinct offset, each key keeping the scores of its own offset's pass. myoff: lane
 * l's key offset (KEY_PAD: not read), ko: every key's; rotate(o) rotates qa backward by o (the
 * kernels keep the unrotated fragments in different places); SW: a swizzled tile (tile_at). Shared
 * by k_attn_tc and k_attn_fd. */
template <int HD, int MT, bool SW = false, typename Rotate>
__device__ __forceinline__ void qk_by_offset(const bf16 *tk, const int *ko, int myoff, int &cur_rot, Rotate rotate,
                                             uint32_t (*qa)[HD / 16][4], float (*sc)[4][4], int lane)
{
    const int t = lane & 3;
    zero_scores<MT>(sc);
    unsigned todo = __ballot_sync(FULL, myoff != KEY_PAD);
    while (todo) {
        const int ofs = __shfl_sync(FULL, myoff, __ffs((int)todo) - 1);
        if (ofs != cur_rot) {
            rotate(ofs);
            cur_rot = ofs;
        }
        float sr[MT][4][4];
        qk_tc<HD, MT, SW>(tk, qa, sr, lane);
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int j = 0; j < 4; j++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    if (ko[j * 8 + 2 * t + (e & 1)] == ofs) sc[mt][j][e] = sr[mt][j][e];
        todo &= __ballot_sync(FULL, myoff != ofs);
    }
}

/* One online-softmax step for one m-tile of 16 rows against a 32-key tile starting at key kb:
 * masks keys that are not read (ko[key] == KEY_PAD) or past the row's last visible key (lim[h]
 * for the thread's rows g and g + 8; -1: a padding row, which sees nothing), updates the running
 * max m and sum l (row statistics shared by the 4 lanes of a quad), rescales o, and leaves the
 * probabilities (fp32) in sc and each row's rescale factor in alpha[h] (0 before the row had a
 * key), for a caller that forms its own P fragments (kv_lean.cu: P scaled by the keys' V scales,
 * and its dequantization correction rescaled by alpha). VOTE: o is rescaled only when a row's
 * max moved after it had keys (before, o is zero), which past the first tiles is rare, so the
 * warp mostly skips the HD / 4 multiplies (decode; prefill blocks measured slower with the vote). */
template <int HD, bool VOTE>
__device__ __forceinline__ void softmax_stats(float (*sc)[4], const int *ko, int kb, const int *lim, float *m, float *l,
                                              float (*o)[4], float *alpha, int lane)
{
    const int t = lane & 3;
    bool moved = false;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        float mx = -INFINITY;
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int key = kb + j * 8 + 2 * t + e;
                const bool ok = ko[j * 8 + 2 * t + e] != KEY_PAD && key <= lim[h];
                const float v = ok ? sc[j][2 * h + e] : -INFINITY;
                sc[j][2 * h + e] = v;
                mx = fmaxf(mx, v);
            }
        mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 2));
        const float mn = fmaxf(m[h], mx);
        alpha[h] = m[h] == -INFINITY ? 0.0f : __expf(m[h] - mn);
        moved |= m[h] != -INFINITY && mn != m[h];
        m[h] = mn;
        float ps = 0.0f;
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const float v = sc[j][2 * h + e];
                const float pr = v == -INFINITY ? 0.0f : __expf(v - mn);
                sc[j][2 * h + e] = pr;
                ps += pr;
            }
        l[h] = l[h] * alpha[h] + ps;
    }
    if (!VOTE || __any_sync(FULL, moved)) {
#pragma unroll
        for (int nd = 0; nd < HD / 8; nd++) {
            o[nd][0] *= alpha[0];
            o[nd][1] *= alpha[0];
            o[nd][2] *= alpha[1];
            o[nd][3] *= alpha[1];
        }
    }
}

/* softmax_stats, then the probabilities as bf16 A fragments pa[k-step of 16 keys][4].
 * Shared by k_attn_tc and k_attn_fd (and the span kernels). */
template <int HD, bool VOTE>
__device__ __forceinline__ void softmax_tile(float (*sc)[4], const int *ko, int kb, const int *lim, float *m, float *l,
                                             float (*o)[4], uint32_t (*pa)[4], int lane)
{
    float alpha[2];
    softmax_stats<HD, VOTE>(sc, ko, kb, lim, m, l, o, alpha, lane);
#pragma unroll
    for (int kk = 0; kk < 2; kk++) {
        pa[kk][0] = pack_bf16(sc[2 * kk][0], sc[2 * kk][1]);
        pa[kk][1] = pack_bf16(sc[2 * kk][2], sc[2 * kk][3]);
        pa[kk][2] = pack_bf16(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
        pa[kk][3] = pack_bf16(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
    }
}

/* O += P . V for MT m-tiles against the 32 staged V rows of tv (row stride kst, or SW: swizzled,
 * tile_at): V fragments through ldmatrix.trans, two 8-dim n-tiles per load; masked keys carry
 * probability 0 and zero-filled V. Shared by k_attn_tc and k_attn_fd. */
template <int HD, int MT, bool SW = false>
__device__ __forceinline__ void pv_tile(const bf16 *tv, int kst, const uint32_t (*pa)[2][4], float (*o)[HD / 8][4],
                                        int lane)
{
    const int mi = lane >> 3, ri = lane & 7;
#pragma unroll
    for (int kk = 0; kk < 2; kk++)
#pragma unroll
        for (int nd = 0; nd < HD / 8; nd += 2) {
            uint32_t b[4];
            ldsm_x4_trans(b, tile_at<HD, SW>(tv, kst, kk * 16 + ri + (mi & 1) * 8, (nd + (mi >> 1)) * 8));
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                mma_bf16(o[mt][nd], pa[mt][kk], b[0], b[1]);
                mma_bf16(o[mt][nd + 1], pa[mt][kk], b[2], b[3]);
            }
        }
}

/* ---- host side: the launchers of each kernel file (planned and called by cuda_attention.cu) ---- */

/* A kernel's resident blocks per SM (0: not known yet), one entry per GPU: the first launch on a
 * device raises the kernel's shared-memory limit there (cudaFuncSetAttribute holds for the
 * current device only), and each rank of a tensor-parallel group launches on its own device
 * from its own thread. Launchers keep one `static kvs_cu_resident` and pass
 * kvs_cu_resident_here() of it. */
#define KVS_CU_MAX_DEVICES 64
struct kvs_cu_resident {
    int on[KVS_CU_MAX_DEVICES];
};

static inline int *kvs_cu_resident_here(kvs_cu_resident &r)
{
    int dev = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    KVS_ASSERT(dev >= 0 && dev < KVS_CU_MAX_DEVICES);
    return &r.on[dev];
}

/* One launch of kernel `kern` (threads per block, dynamic shared memory smem) over n_tiles tiles
 * x KV heads x context splits, then the merge of the splits (cuda_attention.cu). *resident caches
 * the kernel's resident blocks per SM (0 = not yet known; the first call also raises its
 * shared-memory limit). force > 0: that many splits; min_keys: the fewest keys a split is planned
 * with (chunks stay multiples of AT_TILE). */
void kvs_cu_attn_launch(void (*kern)(at_args), int threads, size_t smem, int *resident, at_args &x, int n_tiles,
                        int max_ctx, cudaStream_t st, int n_sms, size_t ws_floats, int n, int hd, int force,
                        int min_keys = 2 * AT_TILE);

/* cuda_attn_prefill.cu: the tensor-core kernel over prefill tiles (x.prefill = 1, x.qt tokens) */
void kvs_cu_attn_prefill(at_args &x, int hd, int n_tiles, int max_ctx, cudaStream_t st, int n_sms, size_t ws_floats,
                         int n, int force);
/* cuda_attn_prefill.cu: the same kernel for decode rows, one warp a block, `stages` (2 or 3) K/V
 * tiles in flight */
void kvs_cu_attn_tc_decode(at_args &x, int hd, int stages, int n_tiles, int max_ctx, cudaStream_t st, int n_sms,
                           size_t ws_floats, int n, int force);
/* cuda_attn_decode.cu: decode rows (x.prefill = 0), the kernel picked by kind_forced /
 * KVS_CUDA_DEC_ATTN (cuda_attention.h) */
void kvs_cu_attn_decode(at_args &x, int hd, int n_tiles, int max_ctx, cudaStream_t st, int n_sms, size_t ws_floats,
                        int n, int force, int kind_forced);
/* dev/cuda_attn_simt.cu: the CUDA-core decode kernel (KVS_CUDA_DEC_ATTN=0, comparisons only) */
void kvs_cu_attn_simt(at_args &x, int hd, int n_tiles, int max_ctx, cudaStream_t st, int n_sms, size_t ws_floats,
                      int n, int force);

#endif
