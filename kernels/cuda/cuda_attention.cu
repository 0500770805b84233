/* cuda_attention.cu: paged causal attention (cuda_attention.h), built around memory bandwidth.
 *
 * Two launches per step, each over "tiles" of query rows x KV heads x context splits:
 *   - prefill (sequences with more rows): k_attn_tc, tensor cores (mma.sync, FlashAttention-2
 *     style). A block (4 warps) owns up to 64 / G consecutive tokens of one sequence: 64
 *     (token, head) rows that share every staged K/V tile.
 *   - decode (sequences with one query row): k_attn_fd (its own section below), 4 warps a block
 *     that owns one sequence, one KV head and one split, 128-key tiles (a 32-key sub-tile per
 *     warp), K and V staged separately; its 16 rows hold the G query heads of the group (GQA:
 *     every K/V byte read serves all of them; the other rows are padding that costs tensor-core
 *     slots, not memory), with or without rotation offsets (cached documents). Groups of more
 *     than 16 heads (or head_dim 16 / 32) take the same tensor-core kernel as prefill with one
 *     warp a block instead.
 *     k_attn, on CUDA cores (4 warps a block, one lane per
 *     key in QK, an online softmax per row held by its warp, then PV with each lane owning
 *     head_dim / 32 output dims), is kept for comparisons (KVS_CUDA_DEC_ATTN=0).
 * Measured on H100 (bench/RESULTS.md): the tensor-core kernel is 7x faster for an 8K prefill;
 * for decode it reads the KV at 2733 GB/s at batch 32 x 8K (the CUDA-core kernel: 2552), where
 * the CUDA-core kernel was bound by its shared-memory reads (each warp re-reads the whole tile).
 * k_attn_fd reads the KV at 2.99 TB/s at batch 32 x 8K (2026-11-23T05:59Z; the one-warp kernel:
 * 2.82). KVS_CUDA_DEC_ATTN=0 / 2 / 3 forces the decode kernel (CUDA cores / one-warp tensor-core
 * blocks with 2 or 3 tiles in flight), for comparisons; 4 (the default where it applies)
 * k_attn_fd, its KV staged by the copy engine (TMA) without rotation offsets; 5 k_attn_fd with
 * cp.async staging always.
 * kvs_cuda_set_dec_attn() forces the same per backend.
 *
 * Both kernels stream K/V in tiles of 32 keys from the paged cache into shared memory with
 * cp.async (k_attn_fd: or the TMA, its own section), two tiles in flight. Slots past the visible range or in the unused tail of a cached
 * document's block (block_valid) are zero-filled by the copy and never read from memory; the
 * loader also records each key's rotation offset (or KEY_PAD) in shared memory, so masks and
 * rotation runs never wait on a global load in the compute loop.
 * Deferred RoPE (LazyAttention, ROT): keys of a cached block are attended as if rotated by the
 * block's offset o; the block's copy of q is rotated backward instead, <q, R(o)k> = <R(-o)q, k>.
 * The rotated copy is recomputed only when a tile holds keys of another offset, i.e. at document
 * boundaries (hd/2 sincos per boundary, shared by all rows): in shared memory for the CUDA-core
 * kernel, straight into the q fragments (registers, from q in global memory) for the tensor-core
 * one, whose shared memory then holds only the K/V stages (more resident blocks for decode);
 * k_attn_fd does it per warp (a cos / sin table per warp, the unrotated fragments in shared
 * memory).
 * Long contexts are split over blocks (grid z); a second kernel merges the per-split partials
 * (acc, max, sum) in split order. Everything is deterministic for a given launch shape.
 */
#include <climits>
#include <cuda.h> /* CUtensorMap (types only: the encoder is reached through the runtime) */
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define _Noreturn [[noreturn]]
extern "C" {
#include "base/util.h"
}
#include "kernels/cuda/cuda_attention.h"
#include "kernels/cuda/cuda_launch.h"


typedef __nv_bfloat16 bf16;

#define AT_WARPS 4
#define AT_THREADS (AT_WARPS * 32)
#define AT_TILE 32                /* keys per shared-memory tile: one per lane in QK */
#define AT_STAGES 2               /* CUDA-core kernel: tiles in flight (H100, batch 32 x 8K: 2 stages 14.95 ms,
                                   * 3 stages 16.2, 4 stages 17.0: fewer stages, more resident blocks) */
#define KEY_PAD INT_MIN           /* per-key info of a key that is not attended (past the range, padding) */
#define AT_WIDE_RPW 8             /* rows per warp of the decode kernel for groups of more than 4 heads */
#define FULL 0xffffffffu
#define PRE_WARPS 4               /* prefill blocks: 4 warps x 16 rows share each K/V tile (H100, 8K
                                   * prompt, attention of all layers: 112 ms; 8 warps, which read the
                                   * causal prefix half as often, 130 ms) */

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
};

__device__ __forceinline__ void cp_async16(void *smem, const void *gmem, int src_bytes)
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
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ float warp_max(float v)
{
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL, v, o));
    return v;
}
__device__ __forceinline__ float warp_sum(float v)
{
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    return v;
}

/* Tiles enumerate, in sequence order, the sequences of this launch's kind, ceil(rows / qt) tiles
 * each. Finds tile `tile`: its sequence and first row within the sequence. Every warp computes
 * the same answer (warp scans over 32 sequences at a time), so no block barrier is needed. */
__device__ bool find_tile(const at_args &a, int tile, int *s_out, int *r0_out)
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

template <int HD> struct at_smem {
    static constexpr int KST = HD + 8;   /* K/V row stride in bf16: +16 bytes keeps lane-per-row reads conflict-free */
    static constexpr size_t kv_elems = (size_t)AT_STAGES * AT_TILE * KST;
    static constexpr size_t bytes(int rows, bool rot)
    {
        return 2 * kv_elems * sizeof(bf16) +
               ((size_t)rows * HD * (rot ? 3 : 1) + (rot ? HD : 0) + (size_t)rows * AT_TILE) * sizeof(float) +
               (size_t)AT_STAGES * AT_TILE * sizeof(int);
    }
};

/* s[r] = <q row r of this warp, key row `key` of the tile> for the warp's RPW rows */
template <int HD, int RPW>
__device__ __forceinline__ void qk_rows(const bf16 *tk, const float *qw, int key, float *s)
{
    constexpr int KST = at_smem<HD>::KST;
#pragma unroll
    for (int r = 0; r < RPW; r++) s[r] = 0.0f;
    const bf16 *kr = tk + key * KST;
#pragma unroll 4
    for (int c = 0; c < HD / 8; c++) {
        uint4 u = *(const uint4 *)(kr + c * 8);
        const __nv_bfloat162 *p2 = (const __nv_bfloat162 *)&u;
        float kf[8];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float2 f = __bfloat1622float2(p2[i]);
            kf[2 * i] = f.x;
            kf[2 * i + 1] = f.y;
        }
#pragma unroll
        for (int r = 0; r < RPW; r++) {
            const float4 *qq = (const float4 *)(qw + r * HD + c * 8);
            float4 a = qq[0], b = qq[1];
            s[r] += a.x * kf[0] + a.y * kf[1] + a.z * kf[2] + a.w * kf[3] + b.x * kf[4] + b.y * kf[5] + b.z * kf[6] +
                    b.w * kf[7];
        }
    }
}

/* What the copies of the tile of 32 keys starting at kb need, from the block table (global
 * loads): lane l's key kb + l (its row, or -1 when it is not read: past k1 or in a padding slot;
 * its info for ko: the block's rotation offset, 0 without rot, or KEY_PAD), and the rows of keys
 * kb and kb + 16 (each tile half's first slot, read or not) for the two-pointer copies. Kept
 * apart from the copies so that a decode block looks up the tile after next while it computes:
 * done just before the copies, the block-table load stalled the warp once a tile (ncu, H100:
 * a third of the decode kernel's stall cycles waited on such loads). */
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

/* Looks the tile up and stages it (the CUDA-core kernel and prefill blocks) */
template <int HD, int NT>
__device__ __forceinline__ void stage_tile(const at_args &a, int kb, int k1, int kvh, const int32_t *bt,
                                           const int32_t *vt, const int32_t *rt, const int2 *wt, bf16 *dk, bf16 *dv,
                                           int kst, int *ko)
{
    tile_issue<HD, NT>(a, tile_lookup<HD>(a, kb, k1, kvh, bt, vt, rt, wt), dk, dv, kst, ko);
}

/* cos and sin of the backward rotation by o into cs_sn (shared by the block) */
__device__ __noinline__ void rot_table(float *cs_sn, int hd, int o, const float *inv_freq)
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

/* sqr = sq rotated backward by offset o (the first n_rows rows), between block barriers. The
 * angles depend only on the frequency, so the hd/2 sincos are computed once into cs_sn (shared,
 * hd floats) and applied to every row. Kept out of line: sincosf's range reduction needs local
 * memory and registers that the main loop should not pay for. */
__device__ __noinline__ void rotate_q(const float *sq, float *sqr, float *cs_sn, int n_rows, int hd, int o,
                                      const float *inv_freq)
{
    const int half = hd / 2;
    rot_table(cs_sn, hd, o, inv_freq);
    for (int idx = threadIdx.x; idx < n_rows * half; idx += blockDim.x) {
        int r = idx / half, i = idx % half;
        float cs = cs_sn[i], sn = cs_sn[half + i];
        float x0 = sq[r * hd + i], x1 = sq[r * hd + i + half];
        sqr[r * hd + i] = x0 * cs + x1 * sn;
        sqr[r * hd + i + half] = x1 * cs - x0 * sn;
    }
    __syncthreads();
}

template <int HD, int RPW, bool ROT>
__global__ void __launch_bounds__(AT_THREADS) k_attn(at_args a)
{
    grid_dep_wait(); /* cuda_launch.h: q (and the K/V just written) are ready */
    constexpr int R = AT_WARPS * RPW;
    constexpr int KST = at_smem<HD>::KST;
    constexpr int DPL = HD >= 32 ? HD / 32 : 1;   /* output dims per lane in PV */
    extern __shared__ __align__(16) unsigned char smraw[];
    bf16 *sk = (bf16 *)smraw;
    bf16 *sv = sk + at_smem<HD>::kv_elems;
    float *sq = (float *)(sv + at_smem<HD>::kv_elems); /* [R][HD] q * scale */
    float *sp = sq + R * HD;                           /* [R][AT_TILE] probabilities of the tile */
    float *sqr = sp + R * AT_TILE;                     /* ROT: [2][R][HD] q rotated backward by rot_of[0], [1] */
    float *rtab = sqr + (ROT ? 2 * R * HD : 0);        /* ROT: [HD] cos, sin of the last rotation */
    int *soff = (int *)(rtab + (ROT ? HD : 0));        /* [AT_STAGES][AT_TILE] per key: rotation offset or KEY_PAD */

    int s, r0;
    if (!find_tile(a, blockIdx.x, &s, &r0)) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = blockIdx.y, split = blockIdx.z;
    const int qs = a.q_start[s], ntok = min(a.qt, a.q_start[s + 1] - qs - r0);
    const int pos0 = a.pos[s] + r0;               /* position of the tile's first token */
    const int nr = ntok * a.G;                    /* live rows: row = token * G + head */
    const int k0 = split * a.chunk;
    const int k1 = min(pos0 + ntok, k0 + a.chunk); /* keys [k0, k1) are visible to some row */
    const int32_t *bt = a.bt + (size_t)s * a.max_blocks;
    const int32_t *vt = a.valid ? a.valid + (size_t)s * a.max_blocks : nullptr;
    const int32_t *rt = ROT ? a.rot + (size_t)s * a.max_blocks : nullptr;
    const int2 *wt = a.words ? a.words + (size_t)s * a.max_blocks : nullptr;

    for (int idx = threadIdx.x; idx < R * HD; idx += AT_THREADS) {
        int r = idx / HD, d = idx % HD;
        float v = 0.0f;
        if (r < nr) {
            size_t t = (size_t)qs + r0 + r / a.G;
            v = a.q[(t * a.n_heads + (size_t)g * a.G + r % a.G) * HD + d] * a.scale;
        }
        sq[idx] = v;
        if (ROT) sqr[idx] = sqr[R * HD + idx] = 0.0f; /* rotate_q writes only the live rows */
    }

    auto load = [=](int it) {
        const size_t so = (size_t)(it % AT_STAGES) * AT_TILE;
        stage_tile<HD, AT_THREADS>(a, k0 + it * AT_TILE, k1, g, bt, vt, rt, wt, sk + so * KST, sv + so * KST, KST, soff + so);
    };

    const int ntiles = k1 > k0 ? (k1 - k0 + AT_TILE - 1) / AT_TILE : 0;
#pragma unroll
    for (int st = 0; st < AT_STAGES - 1; st++) {
        if (st < ntiles) load(st);
        cp_async_commit();
    }

    float m[RPW], l[RPW], acc[RPW][DPL];
#pragma unroll
    for (int r = 0; r < RPW; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
#pragma unroll
        for (int i = 0; i < DPL; i++) acc[r][i] = 0.0f;
    }
    int rot_of0 = KEY_PAD, rot_of1 = KEY_PAD;     /* ROT: the offsets the two rotated copies hold */
    const float *qw = sq + warp * RPW * HD;       /* this warp's rows */
    const float *qwr0 = sqr + warp * RPW * HD, *qwr1 = qwr0 + R * HD;

    for (int it = 0; it < ntiles; it++) {
        if (it + AT_STAGES - 1 < ntiles) load(it + AT_STAGES - 1);
        cp_async_commit();
        cp_async_wait<AT_STAGES - 1>();
        __syncthreads();
        const bf16 *tk = sk + (size_t)(it % AT_STAGES) * AT_TILE * KST;
        const bf16 *tv = sv + (size_t)(it % AT_STAGES) * AT_TILE * KST;
        const int kb = k0 + it * AT_TILE, p = kb + lane;
        const int myoff = soff[(it % AT_STAGES) * AT_TILE + lane]; /* this lane's key */
        const bool key_ok = myoff != KEY_PAD;
        float sc[RPW];
        if constexpr (!ROT) {
            qk_rows<HD, RPW>(tk, qw, lane, sc);
        } else {
            /* Two rotated copies of q: inside a document every key has the offset of one of them;
             * at a document boundary the tile holds the old document's keys and the new one's,
             * so only the new offset is rotated (into the copy the tile does not use) and QK
             * still runs once, each lane reading the copy of its key's offset. The per-key
             * offsets come from shared memory, so every warp takes the same branches (rotate_q's
             * barriers are block-uniform). */
            const bool live = myoff != KEY_PAD;
            /* inside a document: one vote finds the copy every key uses */
            int uniform_copy = -1;
            if (__all_sync(FULL, myoff == rot_of0 || !live)) uniform_copy = 0;
            else if (__all_sync(FULL, myoff == rot_of1 || !live)) uniform_copy = 1;
            bool one_pass = true;
            const unsigned fresh = uniform_copy >= 0 ? 0u : __ballot_sync(FULL, live && myoff != rot_of0 && myoff != rot_of1);
            if (fresh) {
                const int o = __shfl_sync(FULL, myoff, __ffs((int)fresh) - 1);
                const bool more = __any_sync(FULL, live && myoff != rot_of0 && myoff != rot_of1 && myoff != o);
                const bool used0 = __any_sync(FULL, live && myoff == rot_of0);
                const bool used1 = __any_sync(FULL, live && myoff == rot_of1);
                if (!more && !(used0 && used1)) {
                    if (used0) {
                        rotate_q(sq, sqr + R * HD, rtab, nr, HD, o, a.inv_freq);
                        rot_of1 = o;
                    } else {
                        rotate_q(sq, sqr, rtab, nr, HD, o, a.inv_freq);
                        rot_of0 = o;
                    }
                } else {
                    one_pass = false;
                }
            }
            if (uniform_copy >= 0) {
                qk_rows<HD, RPW>(tk, uniform_copy ? qwr1 : qwr0, lane, sc); /* as in the ordinary kernel */
            } else if (one_pass) {
                qk_rows<HD, RPW>(tk, myoff == rot_of1 ? qwr1 : qwr0, lane, sc); /* per lane at a boundary */
            } else {
                /* more than two offsets in one tile (blocks shorter than the tile): one pass per
                 * offset through copy 0 */
#pragma unroll
                for (int r = 0; r < RPW; r++) sc[r] = 0.0f;
                unsigned todo = __ballot_sync(FULL, live);
                while (todo) {
                    const int o = __shfl_sync(FULL, myoff, __ffs((int)todo) - 1);
                    if (o != rot_of0) {
                        rotate_q(sq, sqr, rtab, nr, HD, o, a.inv_freq);
                        rot_of0 = o;
                    }
                    if (myoff == o) qk_rows<HD, RPW>(tk, qwr0, lane, sc);
                    todo &= __ballot_sync(FULL, myoff != o);
                }
            }
        }
        /* masks: past the range or a padding slot (key_ok), beyond the row's own position (causal) */
        float alpha[RPW];
#pragma unroll
        for (int r = 0; r < RPW; r++) {
            const int row = warp * RPW + r;
            const bool ok = key_ok && row < nr && p <= pos0 + row / a.G;
            const float x = ok ? sc[r] : -INFINITY;
            const float mn = fmaxf(m[r], warp_max(x));
            alpha[r] = m[r] == -INFINITY ? 0.0f : __expf(m[r] - mn);
            const float pr = x == -INFINITY ? 0.0f : __expf(x - mn);
            m[r] = mn;
            l[r] = l[r] * alpha[r] + pr;
            sp[row * AT_TILE + lane] = pr;
        }
        __syncwarp();
        /* PV over the tile's keys (masked ones carry probability 0 and zero-filled V) */
        const int nk = min(AT_TILE, k1 - kb);
        const int d0 = lane * DPL;
#pragma unroll
        for (int r = 0; r < RPW; r++)
#pragma unroll
            for (int i = 0; i < DPL; i++) acc[r][i] *= alpha[r];
        if (d0 < HD) {
#pragma unroll 4
            for (int j = 0; j < nk; j++) {
                float vf[DPL];
                const bf16 *vr = tv + j * KST + d0;
                if constexpr (DPL == 1) {
                    vf[0] = __bfloat162float(vr[0]);
                } else {
                    /* one 4-, 8- or 16-byte shared load (rows and lane offsets are aligned to it) */
                    __align__(16) __nv_bfloat162 h2[DPL / 2];
                    if constexpr (DPL == 2) *(uint32_t *)h2 = *(const uint32_t *)vr;
                    else if constexpr (DPL == 4) *(uint2 *)h2 = *(const uint2 *)vr;
                    else *(uint4 *)h2 = *(const uint4 *)vr;
#pragma unroll
                    for (int i = 0; i < DPL / 2; i++) {
                        float2 f = __bfloat1622float2(h2[i]);
                        vf[2 * i] = f.x;
                        vf[2 * i + 1] = f.y;
                    }
                }
#pragma unroll
                for (int r = 0; r < RPW; r++) {
                    const float pj = sp[(warp * RPW + r) * AT_TILE + j];
#pragma unroll
                    for (int i = 0; i < DPL; i++) acc[r][i] += pj * vf[i];
                }
            }
        }
        __syncthreads(); /* the stage buffer and sp are rewritten next iteration */
    }
    cp_async_wait<0>();

#pragma unroll
    for (int r = 0; r < RPW; r++) {
        const float lsum = warp_sum(l[r]);
        const int row = warp * RPW + r;
        if (row >= nr) continue;
        const size_t t = (size_t)qs + r0 + row / a.G;
        const size_t orow = t * a.n_heads + (size_t)g * a.G + row % a.G;
        const int d0 = lane * DPL;
        if (d0 >= HD) continue;
        if (a.n_splits == 1) {
#pragma unroll
            for (int i = 0; i < DPL; i++) {
                const float v = acc[r][i] / lsum;
                a.out[orow * HD + d0 + i] = v;
                if (a.outh) a.outh[orow * HD + d0 + i] = __float2bfloat16(v);
            }
        } else {
            float *pp = a.part + (orow * a.n_splits + split) * (size_t)(HD + 2);
#pragma unroll
            for (int i = 0; i < DPL; i++) pp[d0 + i] = acc[r][i];
            if (lane == 0) {
                pp[HD] = m[r];
                pp[HD + 1] = lsum;
            }
        }
    }
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
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi)
{
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *(uint32_t *)&h;
}

__device__ __forceinline__ void mma_bf16(float *c, const uint32_t *a, uint32_t b0, uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ldsm_x4_trans(uint32_t *r, const void *smem)
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
 * max m and sum l (row statistics shared by the 4 lanes of a quad), rescales o, and returns the
 * probabilities as A fragments pa[k-step of 16 keys][4]. VOTE: o is rescaled only when a row's
 * max moved after it had keys (before, o is zero), which past the first tiles is rare, so the
 * warp mostly skips the HD / 4 multiplies (decode; prefill blocks measured slower with the vote).
 * Shared by k_attn_tc and k_attn_fd. */
template <int HD, bool VOTE>
__device__ __forceinline__ void softmax_tile(float (*sc)[4], const int *ko, int kb, const int *lim, float *m, float *l,
                                             float (*o)[4], uint32_t (*pa)[4], int lane)
{
    const int t = lane & 3;
    float alpha[2];
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

template <int HD, int NW, int MT, int ST, bool ROT>
struct tc_cfg {
    static constexpr int ROWS = NW * 16 * MT;
    static constexpr int KST = HD + 8;
    static constexpr size_t kv_elems = (size_t)ST * AT_TILE * KST;
    static constexpr size_t smem =
        2 * kv_elems * sizeof(bf16) + (ROT ? HD : 0) * sizeof(float) + (size_t)ST * AT_TILE * sizeof(int);
};

template <int HD, int NW, int MT, int ST, bool ROT>
__global__ void __launch_bounds__(NW * 32) k_attn_tc(at_args a)
{
    grid_dep_wait(); /* cuda_launch.h: q (and the K/V just written) are ready */
    typedef tc_cfg<HD, NW, MT, ST, ROT> C;
    constexpr int KST = C::KST, NT = NW * 32;
    extern __shared__ __align__(16) unsigned char smraw[];
    bf16 *sk = (bf16 *)smraw;
    bf16 *sv = sk + C::kv_elems;
    float *rtab = (float *)(sv + C::kv_elems); /* ROT: [HD] cos, sin of the current rotation */
    int *soff = (int *)(rtab + (ROT ? HD : 0)); /* [ST][AT_TILE] per key: rotation offset or KEY_PAD */

    int s, r0;
    if (!find_tile(a, blockIdx.x, &s, &r0)) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int kvh = blockIdx.y, split = blockIdx.z;
    const int qs = a.q_start[s], ntok = min(a.qt, a.q_start[s + 1] - qs - r0);
    const int pos0 = a.pos[s] + r0;
    const int nr = ntok * a.G;
    const int k0 = split * a.chunk;
    const int k1 = min(pos0 + ntok, k0 + a.chunk);
    const int32_t *bt = a.bt + (size_t)s * a.max_blocks;
    const int32_t *vt = a.valid ? a.valid + (size_t)s * a.max_blocks : nullptr;
    const int32_t *rt = ROT ? a.rot + (size_t)s * a.max_blocks : nullptr;
    const int2 *wt = a.words ? a.words + (size_t)s * a.max_blocks : nullptr;

    auto lookup = [=](int it) { return tile_lookup<HD>(a, k0 + it * AT_TILE, k1, kvh, bt, vt, rt, wt); };
    auto issue = [=](const tile_meta &tm, int it) {
        const size_t so = (size_t)(it % ST) * AT_TILE;
        tile_issue<HD, NT>(a, tm, sk + so * KST, sv + so * KST, KST, soff + so);
    };

    const int ntiles = k1 > k0 ? (k1 - k0 + AT_TILE - 1) / AT_TILE : 0;
#pragma unroll
    for (int st = 0; st < ST - 1; st++) {
        if (st < ntiles) issue(lookup(st), st);
        cp_async_commit();
    }
    /* decode blocks: the metadata of the next tile to stage, looked up one iteration early */
    tile_meta next = {};
    if (NW == 1) next = lookup(ST - 1);

    const int wrow = warp * 16 * MT; /* the warp's first row */
    uint32_t qa[MT][HD / 16][4];
    q_frags<HD, MT>(a, qs, r0, kvh, nr, wrow, lane, nullptr, qa);
    int cur_rot = 0;                 /* the offset qa is rotated by */
    uint32_t q0[ROT ? MT : 1][HD / 16][4]; /* ROT: the unrotated fragments */
    if (ROT) {
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int ks = 0; ks < HD / 16; ks++)
#pragma unroll
                for (int j = 0; j < 4; j++) q0[mt][ks][j] = qa[mt][ks][j];
    }

    float m[MT][2], l[MT][2], o[MT][HD / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            m[mt][h] = -INFINITY;
            l[mt][h] = 0.0f;
        }
#pragma unroll
        for (int nd = 0; nd < HD / 8; nd++)
#pragma unroll
            for (int e = 0; e < 4; e++) o[mt][nd][e] = 0.0f;
    }
    /* the token index (within the tile) of this thread's two rows per m-tile, for the causal mask */
    int rtok[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int r = wrow + mt * 16 + g + 8 * h;
            rtok[mt][h] = r < nr ? r / a.G : -1 - pos0; /* padding rows see nothing */
        }

    for (int it = 0; it < ntiles; it++) {
        if (NW == 1) {
            if (it + ST - 1 < ntiles) issue(next, it + ST - 1);
            cp_async_commit();
            next = lookup(it + ST); /* its loads overlap this tile's wait and compute; past k1 none */
        } else {
            if (it + ST - 1 < ntiles) issue(lookup(it + ST - 1), it + ST - 1);
            cp_async_commit();
        }
        cp_async_wait<ST - 1>();
        __syncthreads();
        const bf16 *tk = sk + (size_t)(it % ST) * AT_TILE * KST;
        const bf16 *tv = sv + (size_t)(it % ST) * AT_TILE * KST;
        const int kb = k0 + it * AT_TILE;
        const int *ko = soff + (it % ST) * AT_TILE;
        float sc[MT][4][4];
        if constexpr (!ROT) {
            qk_tc<HD, MT>(tk, qa, sc, lane);
        } else {
            /* inside a document every key has the offset qa is rotated by; lane l tests key l (the
             * offsets come from shared memory: every warp takes the same branches) */
            const int myoff = ko[lane];
            if (__all_sync(FULL, myoff == cur_rot || myoff == KEY_PAD)) {
                qk_tc<HD, MT>(tk, qa, sc, lane);
            } else {
                /* one pass per distinct offset in the tile: S for the whole tile, kept for its keys */
                qk_by_offset<HD, MT>(tk, ko, myoff, cur_rot, [&](int ofs) {
                    rot_table(rtab, HD, ofs, a.inv_freq);
                    rotate_frags<HD, MT>(q0, rtab, lane, qa);
                }, qa, sc, lane);
            }
        }
        /* masks and the online softmax, then O += P . V */
        uint32_t pa[MT][2][4]; /* P as A fragments: [m-tile][k-step of 16 keys][4] */
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            const int lim[2] = {pos0 + rtok[mt][0], pos0 + rtok[mt][1]}; /* last visible key of each row */
            softmax_tile<HD, NW == 1>(sc[mt], ko, kb, lim, m[mt], l[mt], o[mt], pa[mt], lane);
        }
        pv_tile<HD, MT>(tv, KST, pa, o, lane);
        __syncthreads(); /* the stage buffer is reloaded next iteration */
    }
    cp_async_wait<0>();

#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float ls = l[mt][h];
            ls += __shfl_xor_sync(FULL, ls, 1);
            ls += __shfl_xor_sync(FULL, ls, 2);
            const int row = wrow + mt * 16 + g + 8 * h;
            if (row >= nr) continue;
            const size_t tq = (size_t)qs + r0 + row / a.G;
            const size_t orow = tq * a.n_heads + (size_t)kvh * a.G + row % a.G;
            if (a.n_splits == 1) {
                float *op = a.out + orow * HD + 2 * t;
                bf16 *oh = a.outh ? a.outh + orow * HD + 2 * t : nullptr;
#pragma unroll
                for (int nd = 0; nd < HD / 8; nd++) {
                    const float v0 = o[mt][nd][2 * h] / ls, v1 = o[mt][nd][2 * h + 1] / ls;
                    op[nd * 8] = v0;
                    op[nd * 8 + 1] = v1;
                    if (oh) *(__nv_bfloat162 *)(oh + nd * 8) = __floats2bfloat162_rn(v0, v1);
                }
            } else {
                float *pp = a.part + (orow * a.n_splits + split) * (size_t)(HD + 2);
#pragma unroll
                for (int nd = 0; nd < HD / 8; nd++) {
                    pp[nd * 8 + 2 * t] = o[mt][nd][2 * h];
                    pp[nd * 8 + 2 * t + 1] = o[mt][nd][2 * h + 1];
                }
                if (t == 0) {
                    pp[HD] = m[mt][h];
                    pp[HD + 1] = ls;
                }
            }
        }
}

/* block per (row, head) of this launch's kind; threads over dims; splits merged in order */
__global__ void k_attn_merge(const float *part, const int32_t *q_start, int n_seqs, int prefill, int n_heads,
                             int n_splits, int hd, float *out, bf16 *outh)
{
    grid_dep_wait(); /* cuda_launch.h: the previous kernel's output is ready */
    const int t = blockIdx.x / n_heads;
    int lo = 0, hi = n_seqs - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (q_start[mid] <= t) lo = mid; else hi = mid - 1;
    }
    const int ns = q_start[lo + 1] - q_start[lo];
    if ((prefill ? ns > 1 : ns == 1) == false) return;
    const size_t row = blockIdx.x;
    const float *pp = part + row * n_splits * (size_t)(hd + 2);
    float M = -INFINITY;
    for (int s = 0; s < n_splits; s++) M = fmaxf(M, pp[(size_t)s * (hd + 2) + hd]);
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float Ls = 0.0f, A = 0.0f;
        for (int s = 0; s < n_splits; s++) {
            const float *q = pp + (size_t)s * (hd + 2);
            if (q[hd] == -INFINITY) continue;
            float e = __expf(q[hd] - M);
            Ls += q[hd + 1] * e;
            A += q[d] * e;
        }
        out[row * hd + d] = A / Ls;
        if (outh) outh[row * hd + d] = __float2bfloat16(A / Ls);
    }
}

/* ---- FlashAttention-2-style decode kernel (KVS_CUDA_DEC_ATTN=4) ----------------------------
 *
 * k_attn_fd: decode rows only (one query token per sequence). The work split of
 * cuDNN's SDPA decode kernel: a block of FD_WARPS warps owns (sequence, KV head, context split);
 * the block walks its keys in tiles of FD_TILE = 128 keys, and warp w computes the 32-key
 * sub-tile w of every tile with its own online-softmax state (m, l, o) over the same 16 rows
 * (the G query heads of the group, the rest padding, as in k_attn_tc's decode blocks). At the
 * end the warps' states are merged through shared memory in warp order (deterministic).
 *
 * Why: the one-warp decode blocks of k_attn_tc are limited to 4 a SM by their shared memory
 * (3 stages of K and V), i.e. one warp per SM sub-partition, so every stall of that warp
 * (a cp.async wait, the MMA and ldmatrix latencies of a tile) leaves its scheduler idle. Here K and
 * V are staged separately, FlashAttention-2 style, each warp holding one K and one V buffer of 32
 * keys:
 *     issue V_i; wait K_i; S = Q K_i^T, softmax; issue K_{i+1} (into the buffer S just freed);
 *     wait V_i; O += P V_i
 * so a warp always has about one 32-key half (K or V) in flight while it computes on the other,
 * and a block needs 2 x 4 x 32 keys of shared memory (HD 128: 68 KB, vs 52 KB for one warp of
 * k_attn_tc with 3 stages): two or three blocks (8 to 12 warps) per SM.
 * Each warp stages the sub-tile it computes itself (tile_lookup's lane-per-key lookup and
 * tile_issue's copies, per pool), so a warp's buffers are private until the final merge: the
 * pipeline needs only warp barriers (__syncwarp orders the cp.async results and the shared
 * loads among the warp's lanes), no block barrier that would make all four warps wait for the
 * slowest copy. Consecutive warps read consecutive 32-key sub-tiles, so the block streams
 * 128-key ranges as cuDNN's kernel does.
 * Splits are planned by launch_kernel; a chunk is a multiple of 32 keys, the last tile of a
 * split may be partial (warps whose sub-tile starts past the range do nothing for it).
 * Deferred RoPE (ROT) as in k_attn_tc, per warp: each warp holds the q fragments rotated backward
 * by cur_rot and, at the first sub-tile with keys of another offset (the vote reads the key
 * offsets that the warp's lookup left in registers), rotates them afresh from the unrotated
 * fragments (in shared memory, one copy for the block: no registers to spare) with its own
 * cos / sin table (shared memory, HD floats a warp, warp barriers only); a sub-tile that holds a
 * document boundary takes one QK pass per offset. Each warp meets a document's first keys itself,
 * so a block computes a rotation per warp and document (k_attn_tc's one-warp blocks: one).
 */
#define FD_WARPS 4
#define FD_TILE (FD_WARPS * AT_TILE) /* keys per block tile: warp w computes keys 32w .. 32w + 31 */

template <int HD, bool ROT, bool TMA = false> struct fd_cfg {
    static constexpr int KST = TMA ? HD : HD + 8;             /* K/V row stride (bf16): k_attn_tc's padded
                                                               * rows, or the TMA's dense swizzled boxes */
    static constexpr int OST = HD + 8;                        /* merge rows (floats): +8 banks a row keeps
                                                               * the float2 stores conflict-free */
    static constexpr size_t sub_elems = (size_t)AT_TILE * KST; /* one warp's K (or V) buffer */
    static constexpr size_t stage_bytes = 2 * FD_WARPS * sub_elems * sizeof(bf16);
    static constexpr size_t merge_bytes = (size_t)FD_WARPS * 16 * (OST + 2) * sizeof(float);
    static constexpr size_t ko_off = stage_bytes > merge_bytes ? stage_bytes : merge_bytes;
    /* ROT: each warp's own table of cos, sin (HD floats) of its current rotation, then the block's
     * unrotated q fragments (the same in every warp: HD / 16 x 4 words a lane) */
    static constexpr size_t rt_off = ko_off + (size_t)FD_WARPS * AT_TILE * sizeof(int);
    static constexpr size_t q0_off = rt_off + (ROT ? (size_t)FD_WARPS * HD * sizeof(float) : 0);
    /* TMA: a K and a V mbarrier per warp */
    static constexpr size_t mb_off = q0_off + (ROT ? (size_t)HD / 16 * 4 * 32 * sizeof(uint32_t) : 0);
    /* TMA: + 1 KB so that the buffers can start on a 1 KB boundary (the 128-byte swizzle's period) */
    static constexpr size_t smem = mb_off + (TMA ? (size_t)FD_WARPS * 2 * sizeof(uint64_t) + 1024 : 0);
};

/* cos and sin of the backward rotation by o into cs_sn (hd floats: [hd/2] cos, then [hd/2] sin),
 * rot_table's arithmetic, but computed and read by one warp alone (k_attn_fd's warps run
 * independently, so its tables are per warp, between warp barriers). Inline: out of line (as
 * rot_table), the registers live across the call spilled in k_attn_fd<128, true>. */
__device__ __forceinline__ void rot_table_warp(float *cs_sn, int hd, int o, const float *inv_freq)
{
    const int half = hd / 2;
    __syncwarp(); /* every lane is done with the previous table */
    for (int i = threadIdx.x & 31; i < half; i += 32) {
        float sn, cs;
        sincosf((float)((double)o * (double)inv_freq[i]), &sn, &cs);
        cs_sn[i] = cs;
        cs_sn[half + i] = sn;
    }
    __syncwarp();
}

/* rotate_frags with the unrotated fragments in shared memory (sq0: word j of k-step ks of lane l
 * at [(ks * 4 + j) * 32 + l], conflict-free): k_attn_fd has no registers to spare for them (q0
 * in registers took k_attn_fd<128> from 168 registers to 251, i.e. from 3 blocks a SM to 2, and
 * spilled at head_dim 256). The same arithmetic as rotate_frags, a pair of partner words at a time
 * (head_dim >= 32: the partner of k-step ks < hd/32 is k-step ks + hd/32, same word), so each
 * word and table entry is loaded once and few registers are live besides the fragments. */
template <int HD>
__device__ __forceinline__ void rotate_frags_sm(const uint32_t *sq0, const float *cs_sn, int lane,
                                                uint32_t (*qa)[HD / 16][4])
{
    static_assert(HD >= 32, "rotate_frags_sm: partners in other k-steps");
    constexpr int HALF = HD / 2, PKS = HD / 32;
    const int t = lane & 3;
#pragma unroll
    for (int ks = 0; ks < PKS; ks++)
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const uint32_t xw = sq0[(ks * 4 + j) * 32 + lane], pw = sq0[((ks + PKS) * 4 + j) * 32 + lane];
            const float2 x = __bfloat1622float2(*(const __nv_bfloat162 *)&xw); /* dims i, i + 1 */
            const float2 p = __bfloat1622float2(*(const __nv_bfloat162 *)&pw); /* dims HALF + i, + 1 */
            const int i = ks * 16 + 8 * (j >> 1) + 2 * t;
            const float c0 = cs_sn[i], c1 = cs_sn[i + 1], s0 = cs_sn[HALF + i], s1 = cs_sn[HALF + i + 1];
            qa[0][ks][j] = pack_bf16(x.x * c0 + p.x * s0, x.y * c1 + p.y * s1);
            qa[0][ks + PKS][j] = pack_bf16(p.x * c0 - x.x * s0, p.y * c1 - x.y * s1);
        }
}

/* One pool's rows (K or V) of the 32-key sub-tile that m describes, staged into dst (rows of
 * HD + 8 elements) by one warp with cp.async: tile_issue's copies (the same fast path for blocks
 * of a multiple of 16 slots, the same zero fill for keys that are not read), for a single pool
 * and indexed by lane, so that any warp of the block can stage its own sub-tile. */
template <int HD>
__device__ __forceinline__ void fd_issue(const at_args &a, const bf16 *pool, const tile_meta &m, bf16 *dst)
{
    constexpr int CH = HD / 8, KST = HD + 8;
    constexpr int S = 32 / CH; /* keys covered by one pass of the warp */
    static_assert(S >= 1 && S <= 16, "fd_issue: head_dim 16 .. 256");
    const int lane = threadIdx.x & 31;
    if (a.bs % 16 == 0) {
        /* the sub-tile starts on a 16-key boundary (chunks and sub-tiles are multiples of 32 keys):
         * keys 16h .. 16h + 15 are consecutive slots of one block */
        const unsigned vmask = __ballot_sync(FULL, m.row >= 0); /* bit j: key j of the sub-tile is read */
        const int j0 = lane / CH, c = lane % CH;
        const long long base[2] = {m.base0 + j0 * HD + c * 8, m.base1 + j0 * HD + c * 8};
        bf16 *d = dst + j0 * KST + c * 8;
#pragma unroll
        for (int i = 0; i < AT_TILE / S; i++) {
            const int h = i * S / 16, off = (i * S) % 16; /* compile-time */
            const int bytes = (vmask >> (j0 + i * S)) & 1u ? 16 : 0;
            cp_async16(d + i * S * KST, pool + base[h] + off * HD, bytes);
        }
        return;
    }
#pragma unroll
    for (int idx = lane; idx < AT_TILE * CH; idx += 32) {
        const int j = idx / CH, c = idx % CH;
        const long long r = __shfl_sync(FULL, m.row, j);
        const bool ok = r >= 0;
        cp_async16(dst + j * KST + c * 8, ok ? pool + r + c * 8 : pool, ok ? 16 : 0);
    }
}

/* ---- k_attn_fd's TMA staging (head_dim 64 / 128 / 256, blocks of a multiple of 16 slots, with or
 * without rotation offsets) ----
 * The copy engine moves each 16-slot half of a warp's 32-key sub-tile as HD / 64 boxes of 16 rows x
 * 64 columns (2 KB), completing on the buffer's mbarrier: 4 requests of 2 KB for a K sub-tile at
 * head_dim 128 instead of 512 16-byte cp.async. Dense rows of 256 bytes would put the 8 rows of an
 * ldmatrix phase in the same banks, so the boxes are written with the 128-byte swizzle: 16-byte
 * chunk c of row r sits at chunk c ^ (r & 7) of its 128-byte row, and qk_tc / pv_tile read
 * through the same permutation (tile_at, SW) (conflict-free). The buffers start on a 1 KB boundary, so the
 * hardware's swizzle (address bits 4-6 ^ 7-9) is that of the row index. Keys that are not read
 * are still copied (whole boxes): their scores are masked, and their V rows zeroed after the copy
 * lands (0 x garbage could be NaN).
 * Measured (H100, attention of all layers, same call, 2026-11-23T05:35Z and 05:50Z): this build of
 * k_attn_fd reads the KV at 2.99 TB/s at batch 32 x 8K (11.49 ms; the previous commit's 11.88, A/B
 * in one call), 128 x 1K 6.00 ms (6.28), 8 x 32K 11.56 (11.98), with the TMA staging (kind 4)
 * and with cp.async (kind 5) alike: the gain is this build's, not the copy engine's. What in it
 * makes the cp.async path faster is not isolated: not __grid_constant__ alone, not the larger
 * parameter block alone, not the order of the commit and the next lookup (each measured as slow as
 * before), and the PTX of k_attn_fd<128, false, false> is that of the previous commit but for two
 * parameter loads. Loads alone (no QK / PV), 16-byte cp.async read 2.93 TB/s, 4 KB bulk copies
 * 3.03. Launches with rotation offsets (cached documents) take the TMA staging too (their QK passes
 * read the swizzled tile: qk_by_offset<..., SW>): with cp.async they had not become faster (0.74 ms
 * at `kvserve-attnbench --device cuda --ctx 32768 --batch 16 --rows 128 --reps 50`, +3.7..+4.6%
 * over the ordinary kernel); with it 0.713-0.722 ms, -0.07..+0.44% (06:16Z). */
__device__ __forceinline__ unsigned smem_u32(const void *p) { return (unsigned)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(uint64_t *mb)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_u32(mb)) : "memory");
}

/* waits for the phase of parity `parity` of mb to complete */
__device__ __forceinline__ void mbar_wait(uint64_t *mb, unsigned parity)
{
    unsigned done = 0;
    while (!done)
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     " selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(smem_u32(mb)), "r"(parity)
                     : "memory");
}

/* The sub-tile that m describes (both 16-slot halves, rows base0 / HD and base1 / HD of the pool
 * tensor), one warp: lane 0 arms mb with the bytes and issues the boxes. Every lane first orders its
 * earlier accesses to dst (ldmatrix reads, zero fills) before the copy engine's writes. */
template <int HD>
__device__ __forceinline__ void fd_issue_tma(const CUtensorMap *map, const tile_meta &m, bf16 *dst, uint64_t *mb)
{
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncwarp();
    if ((threadIdx.x & 31) == 0) {
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(mb)),
                     "r"((unsigned)(AT_TILE * HD * sizeof(bf16)))
                     : "memory");
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int row = (int)((h ? m.base1 : m.base0) / HD);
#pragma unroll
            for (int b = 0; b < HD / 64; b++)
                asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
                                 smem_u32(dst + (h * (HD / 64) + b) * 16 * 64)),
                             "l"(map), "r"(b * 64), "r"(row), "r"(smem_u32(mb))
                             : "memory");
        }
    }
}

/* k_attn_fd<128, true>'s resident blocks the compiler must plan registers for (0: none, its own
 * choice). ptxas -v, sm_90a: k_attn_fd<128, false> 168 registers (3 blocks a SM, as its shared
 * memory allows); <128, true> on its own 174 registers, no spills (2 blocks a SM), or at 3: 168
 * registers and 20 bytes of spills (3 blocks a SM; its shared memory, 76 KB, allows 3).
 * <64, true>: 127 registers, no spills. <256, true>: 255 registers, 88 bytes of spills (<256, false>
 * needs 254 already; the one-warp kernel it replaces, k_attn_tc<256, 1, 1, 3, true>, spills 2 KB). */
#ifndef FD_ROT_MIN_BLOCKS
#define FD_ROT_MIN_BLOCKS 0
#endif

template <int HD, bool ROT, bool TMA>
__global__ void __launch_bounds__(FD_WARPS * 32, ROT && HD == 128 ? FD_ROT_MIN_BLOCKS : 0)
    k_attn_fd(const __grid_constant__ at_args a)
{
    typedef fd_cfg<HD, ROT, TMA> C;
    constexpr int KST = C::KST, OST = C::OST;
    extern __shared__ __align__(16) unsigned char smdyn[];
    /* TMA: everything from a 1 KB boundary (the swizzle's period; C::smem has the slack) */
    unsigned char *smraw = TMA ? smdyn + ((1024u - (smem_u32(smdyn) & 1023u)) & 1023u) : smdyn;

    /* Blocks in launch order (x fastest, then y) take the KV heads of one sequence, then the next
     * sequence: the grid is (tiles, KV heads, splits) as for every attention launch, renumbered so
     * that blocks that start together read the same KV blocks of the pool (a block's heads are
     * adjacent there). H100, attention of all layers (2026-11-23T04:30-04:40Z, 3 runs): batch 128 x 1K
     * 6.31 -> 6.21 / 6.26 / 6.29 ms, the other shapes unchanged. */
    const int lin = blockIdx.x + gridDim.x * blockIdx.y;
    const int kvh = lin % a.n_kv;
    int s, r0;
    if (!find_tile(a, lin / a.n_kv, &s, &r0)) return; /* decode tiles: one row each, r0 = 0 */
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    bf16 *wk = (bf16 *)smraw + (size_t)warp * C::sub_elems;              /* this warp's K buffer */
    bf16 *wv = (bf16 *)smraw + (size_t)(FD_WARPS + warp) * C::sub_elems; /* and its V buffer */
    int *ko = (int *)(smraw + C::ko_off) + warp * AT_TILE; /* per key of the staged K: offset (0 without
                                                            * ROT) or KEY_PAD */
    float *rtab = (float *)(smraw + C::rt_off) + warp * HD; /* ROT: this warp's cos, sin table */
    uint32_t *sq0 = (uint32_t *)(smraw + C::q0_off);        /* ROT: the unrotated q fragments */
    uint64_t *mbk = (uint64_t *)(smraw + C::mb_off) + warp * 2, *mbv = mbk + 1; /* TMA: K and V copies */
    if constexpr (TMA) {
        if (lane == 0) {
            mbar_init(mbk);
            mbar_init(mbv);
            asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        }
        __syncwarp();
    }
    const int split = blockIdx.z;
    const int qs = a.q_start[s];
    const int pos0 = a.pos[s];  /* the row's position: keys 0 .. pos0 are visible */
    const int nr = a.G;         /* live rows: the group's heads */
    const int k0 = split * a.chunk;
    const int k1 = min(pos0 + 1, k0 + a.chunk);
    const int32_t *bt = a.bt + (size_t)s * a.max_blocks;
    const int32_t *vt = a.valid ? a.valid + (size_t)s * a.max_blocks : nullptr;
    const int2 *wt = a.words ? a.words + (size_t)s * a.max_blocks : nullptr;
    const int32_t *rt = ROT ? a.rot + (size_t)s * a.max_blocks : nullptr;

    /* this warp's sub-tiles: keys kw + i * FD_TILE .. + 31, i < nsub */
    const int kw = k0 + warp * AT_TILE;
    const int nsub = k1 > kw ? (k1 - kw + FD_TILE - 1) / FD_TILE : 0;
    auto lookup = [=](int i) { return tile_lookup<HD>(a, kw + i * FD_TILE, k1, kvh, bt, vt, rt, wt); };

    /* K_0 in flight first; the metadata of sub-tile i + 1 is looked up an iteration before its K is
     * issued (past k1 a lookup does no load), so the copies never wait on a block-table load */
    tile_meta cur = lookup(0); /* the sub-tile whose K is staged and whose V is issued next */
    tile_meta nxt = lookup(1);
    /* Everything above reads only the step's metadata (sequence starts, positions, block tables),
     * which the host uploaded before the step's first kernel: with programmatic dependent launch
     * it overlaps the end of the previous kernel (RoPE + KV write). From here on, q and the K/V
     * just written are read (cuda_launch.h). */
    grid_dep_wait();
    if (nsub > 0) {
        ko[lane] = cur.info;
        if constexpr (TMA) fd_issue_tma<HD>(&a.tm_k, cur, wk, mbk);
        else fd_issue<HD>(a, a.kc, cur, wk);
    }
    cp_async_commit();

    uint32_t qa[1][HD / 16][4]; /* the same 16 rows in every warp */
    q_frags<HD, 1>(a, qs, 0, kvh, nr, 0, lane, nullptr, qa);
    int cur_rot = 0; /* ROT: the offset qa is rotated by */
    if constexpr (ROT) {
        /* the unrotated fragments into shared memory, a quarter by each warp (they are the same in
         * every warp); the one block barrier before the tile loop */
#pragma unroll
        for (int ks = 0; ks < HD / 16; ks++)
#pragma unroll
            for (int j = 0; j < 4; j++)
                if ((ks * 4 + j) % FD_WARPS == warp) sq0[(ks * 4 + j) * 32 + lane] = qa[0][ks][j];
        __syncthreads();
    }

    float m[2], l[2], o[1][HD / 8][4]; /* one m-tile: the 16 rows */
    int lim[2]; /* last visible key of this thread's rows g, g + 8: padding rows see nothing */
#pragma unroll
    for (int h = 0; h < 2; h++) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
        lim[h] = g + 8 * h < nr ? pos0 : -1;
    }
#pragma unroll
    for (int nd = 0; nd < HD / 8; nd++)
#pragma unroll
        for (int e = 0; e < 4; e++) o[0][nd][e] = 0.0f;

    for (int i = 0; i < nsub; i++) {
        const int kb = kw + i * FD_TILE;
        const bool vzero = TMA && cur.info == KEY_PAD; /* TMA: lane's V row of this sub-tile is zeroed */
        if constexpr (TMA) {
            fd_issue_tma<HD>(&a.tm_v, cur, wv, mbv); /* V_i */
            mbar_wait(mbk, i & 1);                  /* K_i has landed */
        } else {
            fd_issue<HD>(a, a.vc, cur, wv); /* V_i: its buffer was freed by the end of iteration i - 1 */
            cp_async_commit();
            cp_async_wait<1>(); /* K_i has landed (V_i may still be in flight) */
        }
        __syncwarp();
        float sc[1][4][4]; /* QK on the staged K: swizzled boxes (TMA) or padded rows (cp.async) */
        if constexpr (!ROT) {
            qk_tc<HD, 1, TMA>(wk, qa, sc, lane);
        } else {
            /* k_attn_tc's design, per warp: inside a document every read key of the sub-tile has
             * the offset qa is rotated by. Lane l's key info is still in cur (the lookup of this
             * sub-tile), so the check is one vote on a register. */
            const int myoff = cur.info;
            if (__all_sync(FULL, myoff == cur_rot || myoff == KEY_PAD)) {
                qk_tc<HD, 1, TMA>(wk, qa, sc, lane);
            } else {
                const int first = __shfl_sync(FULL, myoff, __ffs((int)__ballot_sync(FULL, myoff != KEY_PAD)) - 1);
                if (__all_sync(FULL, myoff == first || myoff == KEY_PAD)) {
                    /* a new document from this sub-tile on: rotate once, QK as usual */
                    rot_table_warp(rtab, HD, first, a.inv_freq);
                    rotate_frags_sm<HD>(sq0, rtab, lane, qa);
                    cur_rot = first;
                    qk_tc<HD, 1, TMA>(wk, qa, sc, lane);
                } else {
                    /* a document boundary inside the sub-tile (blocks or documents not a multiple
                     * of 32 keys): one pass per distinct offset */
                    qk_by_offset<HD, 1, TMA>(wk, ko, myoff, cur_rot, [&](int ofs) {
                        rot_table_warp(rtab, HD, ofs, a.inv_freq);
                        rotate_frags_sm<HD>(sq0, rtab, lane, qa);
                    }, qa, sc, lane);
                }
            }
        }
        /* masks and the online softmax, as k_attn_tc's decode blocks */
        uint32_t pa[1][2][4]; /* P as A fragments: [m-tile][k-step of 16 keys][4] */
        softmax_tile<HD, true>(sc[0], ko, kb, lim, m, l, o[0], pa[0], lane);
        __syncwarp(); /* every lane is done with K_i and its key info */
        if (i + 1 < nsub) {
            ko[lane] = nxt.info;
            /* K_{i+1} flies while this warp waits for V_i and does PV */
            if constexpr (TMA) fd_issue_tma<HD>(&a.tm_k, nxt, wk, mbk);
            else fd_issue<HD>(a, a.kc, nxt, wk);
        }
        cur = nxt;
        nxt = lookup(i + 2);
        if constexpr (TMA) {
            mbar_wait(mbv, i & 1); /* V_i has landed */
            if (vzero) {
                /* a key that is not read: its V row (whatever the pool holds there) becomes zeros */
#pragma unroll
                for (int b = 0; b < HD / 64; b++) {
                    uint4 *row = (uint4 *)(wv + (((lane >> 4) * (HD / 64) + b) * 16 + (lane & 15)) * 64);
#pragma unroll
                    for (int c = 0; c < 8; c++) row[c] = make_uint4(0, 0, 0, 0);
                }
            }
        } else {
            cp_async_commit();
            cp_async_wait<1>(); /* V_i has landed (K_{i+1} may still be in flight) */
        }
        __syncwarp();
        pv_tile<HD, 1, TMA>(wv, KST, pa, o, lane); /* O += P . V_i */
        __syncwarp(); /* every lane is done with V_i before V_{i+1} is issued into its buffer */
    }
    cp_async_wait<0>(); /* only empty groups are left; none may write into the merge area */

    /* merge of the warps' states through shared memory (the stage buffers: every warp must be
     * done with its own first), then the same outputs as k_attn_tc: out (+ outh) for one split,
     * else the partial (acc..., max, sum) that k_attn_merge combines */
    __syncthreads();
    float *so = (float *)smraw;              /* [FD_WARPS][16][OST] each warp's o */
    float *sml = so + FD_WARPS * 16 * OST;   /* [FD_WARPS][16][2] each warp's m, l */
#pragma unroll
    for (int h = 0; h < 2; h++) {
        float ls = l[h];
        ls += __shfl_xor_sync(FULL, ls, 1);
        ls += __shfl_xor_sync(FULL, ls, 2);
        const int row = g + 8 * h;
        if (row >= nr) continue;
        float *orow = so + (size_t)(warp * 16 + row) * OST + 2 * t;
#pragma unroll
        for (int nd = 0; nd < HD / 8; nd++) *(float2 *)(orow + nd * 8) = make_float2(o[0][nd][2 * h], o[0][nd][2 * h + 1]);
        if (t == 0) {
            sml[(warp * 16 + row) * 2] = m[h];
            sml[(warp * 16 + row) * 2 + 1] = ls;
        }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < nr * HD; idx += FD_WARPS * 32) {
        const int row = idx / HD, d = idx % HD;
        float M = -INFINITY;
#pragma unroll
        for (int w = 0; w < FD_WARPS; w++) M = fmaxf(M, sml[(w * 16 + row) * 2]);
        float L = 0.0f, A = 0.0f;
#pragma unroll
        for (int w = 0; w < FD_WARPS; w++) {
            const float mw = sml[(w * 16 + row) * 2];
            if (mw == -INFINITY) continue; /* a warp that saw no key: l = 0, o = 0 */
            const float e = __expf(mw - M);
            L += sml[(w * 16 + row) * 2 + 1] * e;
            A += so[(size_t)(w * 16 + row) * OST + d] * e;
        }
        const size_t orow = (size_t)qs * a.n_heads + (size_t)kvh * a.G + row;
        if (a.n_splits == 1) {
            const float v = A / L;
            a.out[orow * HD + d] = v;
            if (a.outh) a.outh[orow * HD + d] = __float2bfloat16(v);
        } else {
            float *pp = a.part + (orow * a.n_splits + split) * (size_t)(HD + 2);
            pp[d] = A;
            if (d == 0) {
                pp[HD] = M;
                pp[HD + 1] = L;
            }
        }
    }
}

/* ---- host side ------------------------------------------------------------------------------ */

int kvs_cu_attention_supported(int n_heads, int n_kv, int head_dim)
{
    if (n_kv <= 0 || n_heads % n_kv != 0 || n_heads / n_kv > AT_WARPS * AT_WIDE_RPW) return 0;
    return head_dim == 16 || head_dim == 32 || head_dim == 64 || head_dim == 128 || head_dim == 256;
}

/* Number of context splits: enough blocks to fill the GPU, whole waves where possible (blocks of
 * one launch do equal work, so a half-empty last wave costs as much as a full one), at least
 * min_keys keys per split (two tiles; k_attn_fd: one 128-key tile, a sub-tile per warp), and the
 * partials within the workspace. */
static int choose_splits(long long base_blocks, int resident, int n_sms, int max_ctx, long long by_ws, int min_keys)
{
    long long cap = (long long)resident * n_sms;
    long long by_len = (max_ctx + min_keys - 1) / min_keys;
    long long lim = by_len < by_ws ? by_len : by_ws;
    if (lim > 256) lim = 256;
    if (lim < 1) lim = 1;
    int best = 1;
    double best_fill = 0.0;
    for (long long ns = 1; ns <= lim; ns++) {
        long long blocks = base_blocks * ns;
        long long waves = (blocks + cap - 1) / cap;
        double fill = (double)blocks / (double)(waves * cap);
        if (fill > best_fill + 0.05) {
            best_fill = fill;
            best = (int)ns;
        }
        if (blocks >= cap && fill >= 0.85) return (int)ns;
    }
    return best;
}

/* A kernel's resident blocks per SM, one entry per GPU: the shared-memory limit that the first
 * launch raises (cudaFuncSetAttribute) holds for the current device only, and each rank of a
 * tensor-parallel group launches on its own device from its own thread. */
#define AT_MAX_DEVICES 64
struct at_resident {
    int on[AT_MAX_DEVICES];
};

static int *resident_here(at_resident &r)
{
    int dev = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    KVS_ASSERT(dev >= 0 && dev < AT_MAX_DEVICES);
    return &r.on[dev];
}

/* One launch of kernel `kern` (threads per block, dynamic shared memory smem) over n_tiles tiles
 * x KV heads x context splits, then the merge of the splits. *resident caches the kernel's
 * resident blocks per SM (0 = not yet known; the first call also raises its shared-memory
 * limit). min_keys: the fewest keys a split is planned with (chunks stay multiples of AT_TILE). */
static void launch_kernel(void (*kern)(at_args), int threads, size_t smem, int *resident, at_args &x, int n_tiles,
                          int max_ctx, cudaStream_t st, int n_sms, size_t ws_floats, int n, int hd, int force,
                          int min_keys = 2 * AT_TILE)
{
    if (!*resident) {
        int nb = 0;
        CUDA_CHECK(cudaFuncSetAttribute((const void *)kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&nb, kern, threads, smem));
        if (nb < 1) kvs_panic(__FILE__, __LINE__, "cuda attention: kernel does not fit an SM (%zu bytes)", smem);
        *resident = nb;
    }
    const long long base = (long long)n_tiles * x.n_kv;
    /* Launches of 32 to 256 (tile, KV head) pairs plan for 2 blocks per SM, not all that fit:
     * fewer, longer splits read the KV faster there (H100, attention of all layers, batch 8 x 1K
     * / 8K / 32K: 0.64 / 3.40 / 12.51 ms vs 0.70 / 3.63 / 12.83 planning for full residency;
     * batch 32 x 1K 1.85 vs 1.98). Small launches (batch 1) need the splits for parallelism
     * (batch 1 x 32K: 2.35 vs 2.07 ms), and batch 128 x 1K runs faster in 2 splits (6.93 ms)
     * than in the 1 this would give (7.24). */
    const int res_plan = base >= 32 && base <= 256 && *resident > 2 ? 2 : *resident;
    const long long by_ws = (long long)(ws_floats / ((size_t)n * x.n_heads * (hd + 2)));
    int ns = force > 0 ? force : choose_splits(base, res_plan, n_sms, max_ctx, by_ws, min_keys);
    if (ns > by_ws) ns = (int)(by_ws > 0 ? by_ws : 1);
    int chunk = (max_ctx + ns - 1) / ns;
    chunk = (chunk + AT_TILE - 1) / AT_TILE * AT_TILE;
    x.chunk = chunk;
    x.n_splits = (max_ctx + chunk - 1) / chunk;
    dim3 grid((unsigned)n_tiles, (unsigned)x.n_kv, (unsigned)x.n_splits);
    CUDA_CHECK(kvs_cu_launch(kern, grid, threads, smem, st, x));
    CUDA_CHECK(cudaGetLastError());
    if (x.n_splits > 1) {
        CUDA_CHECK(kvs_cu_launch(k_attn_merge, (unsigned)((size_t)n * x.n_heads), hd < 128 ? hd : 128, 0, st, 
            x.part, x.q_start, x.n_seqs, x.prefill, x.n_heads, x.n_splits, hd, x.out, x.outh));
        CUDA_CHECK(cudaGetLastError());
    }
}

/* the tensor-core kernel (prefill tiles): PRE_WARPS warps of 16 rows, 2 K/V tiles in flight */
template <int HD, int NW, int MT, int ST, bool ROT>
static void launch_tc(at_args &x, int n_tiles, int max_ctx, cudaStream_t st, int n_sms, size_t ws_floats, int n,
                      int force)
{
    static at_resident resident;
    /* Causal prefill tiles do unequal work (a tile's keys grow with its position), so splitting
     * contexts to fill whole waves does not pay once the tiles alone cover the SMs: H100,
     * Llama-3.1-8B shape, attention of all layers for 512 / 1024 / 2048 / 8192-token prompts,
     * 1 split 1.53 / 3.69 / 10.67 / 114.8 ms, the wave-filling plan 2.21 / 5.20 / 10.82 / 110.0
     * (8192: the same plan, 1 split, run to run noise). Fewer tiles than SMs (a short suffix
     * over a long cached context) still split. */
    if (force <= 0 && (long long)n_tiles * x.n_kv >= n_sms) force = 1;
    launch_kernel(k_attn_tc<HD, NW, MT, ST, ROT>, NW * 32, tc_cfg<HD, NW, MT, ST, ROT>::smem, resident_here(resident), x, n_tiles,
                  max_ctx, st, n_sms, ws_floats, n, HD, force);
}

template <int HD>
static void launch_tc_hd(at_args &x, int n_tiles, int max_ctx, cudaStream_t st, int n_sms, size_t ws_floats, int n,
                         int force)
{
    if (x.rot) launch_tc<HD, PRE_WARPS, 1, 2, true>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force);
    else launch_tc<HD, PRE_WARPS, 1, 2, false>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force);
}

/* the CUDA-core kernel (decode rows) */
template <int HD, int RPW, bool ROT>
static void launch_simt(at_args &x, int n_tiles, int max_ctx, cudaStream_t st, int n_sms, size_t ws_floats, int n,
                        int force)
{
    static at_resident resident;
    launch_kernel(k_attn<HD, RPW, ROT>, AT_THREADS, at_smem<HD>::bytes(AT_WARPS * RPW, ROT), resident_here(resident), x, n_tiles,
                  max_ctx, st, n_sms, ws_floats, n, HD, force);
}

template <int HD>
static void launch_simt_hd(at_args &x, int n_tiles, int max_ctx, cudaStream_t st, int n_sms, size_t ws_floats, int n,
                           int force)
{
    const bool rot = x.rot != nullptr;
    if (x.G <= AT_WARPS) {
        if (rot) launch_simt<HD, 1, true>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force);
        else launch_simt<HD, 1, false>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force);
    } else {
        if (rot) launch_simt<HD, AT_WIDE_RPW, true>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force);
        else launch_simt<HD, AT_WIDE_RPW, false>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force);
    }
}

/* the tensor-core kernel for decode rows: one warp a block, 16 (G <= 16) or 32 rows of which G are
 * live, ST K/V tiles in flight */
template <int HD, int ST>
static void launch_tc_dec(at_args &x, int n_tiles, int max_ctx, cudaStream_t st, int n_sms, size_t ws_floats, int n,
                          int force)
{
    if (x.G <= 16) {
        if (x.rot) launch_tc<HD, 1, 1, ST, true>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force);
        else launch_tc<HD, 1, 1, ST, false>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force);
    } else {
        if (x.rot) launch_tc<HD, 1, 2, ST, true>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force);
        else launch_tc<HD, 1, 2, ST, false>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force);
    }
}

/* cuTensorMapEncodeTiled, reached through the runtime (no link against the driver library);
 * NULL where the driver has none */
static PFN_cuTensorMapEncodeTiled_v12000 tma_encoder(void)
{
    static int done = 0;
    static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
    if (!done) {
        done = 1;
        void *p = nullptr;
        cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) == cudaSuccess &&
            q == cudaDriverEntryPointSuccess)
            fn = (PFN_cuTensorMapEncodeTiled_v12000)p;
        else
            (void)cudaGetLastError();
        if (!fn) kvs_log(KVS_LOG_WARN, "cuda attention: no cuTensorMapEncodeTiled in the driver; decode KV staged with cp.async");
    }
    return fn;
}

/* the K and V pools of x as TMA tensors [kv_rows][hd] (boxes of 16 rows x 64 columns, 128-byte
 * swizzle); false when the driver cannot encode them (the caller stages with cp.async) */
/* Encoded maps, remembered per thread by (pool, rows, hd): a map holds nothing else, so an entry
 * stays right even after its pool is freed and another takes the address (then it is that
 * pool's map). Encoding costs about 1 us of host time, twice a layer: eager steps (prefill,
 * mixed batches) would pay it 64 times a step on an 8B model; recorded graphs only at capture. */
#define TMA_MAP_CACHE 512 /* two pools x layers of the models in use */
struct tma_map_entry {
    const void *pool;
    long long rows;
    int hd;
    CUtensorMap map;
};

static bool tma_map(const bf16 *pool, long long rows, int hd, CUtensorMap *out)
{
    static thread_local tma_map_entry cache[TMA_MAP_CACHE];
    static thread_local int n_cached, next;
    for (int i = 0; i < n_cached; i++)
        if (cache[i].pool == pool && cache[i].rows == rows && cache[i].hd == hd) {
            *out = cache[i].map;
            return true;
        }
    PFN_cuTensorMapEncodeTiled_v12000 enc = tma_encoder();
    if (!enc || rows <= 0 || rows > 0xffffffffLL) return false;
    const cuuint64_t dims[2] = {(cuuint64_t)hd, (cuuint64_t)rows};
    const cuuint64_t strides[1] = {(cuuint64_t)hd * sizeof(bf16)};
    const cuuint32_t box[2] = {64, 16}, es[2] = {1, 1};
    if (enc(out, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, (void *)pool, dims, strides, box, es,
            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
        return false;
    tma_map_entry *e = &cache[next]; /* full: the oldest entry goes */
    next = (next + 1) % TMA_MAP_CACHE;
    if (n_cached < TMA_MAP_CACHE) n_cached++;
    e->pool = pool;
    e->rows = rows;
    e->hd = hd;
    e->map = *out;
    return true;
}

static bool fd_tma_maps(at_args &x, int hd)
{
    return tma_map(x.kc, x.kv_rows, hd, &x.tm_k) && tma_map(x.vc, x.kv_rows, hd, &x.tm_v);
}

/* the FlashAttention-2-style decode kernel: 4 warps a block, K and V pipelined separately; TMA:
 * staged by the copy engine (k_attn_fd's TMA section), which the caller asks for only with
 * blocks of a multiple of 16 slots */
template <int HD, bool ROT, bool TMA>
static void launch_fd(at_args &x, int n_tiles, int max_ctx, cudaStream_t st, int n_sms, size_t ws_floats, int n,
                      int force)
{
    static at_resident resident;
    /* Splits: about two blocks per SM in all, at least one 128-key tile each. H100, Llama-3.1-8B
     * shape, attention of all layers at forced split counts (--attn-variants, 02:45Z; at most 16): batch 1 x
     * 1K best at 8 splits (0.278 ms), 1 x 8K at 16 (0.678), 8 x 1K at 4 (0.633), 8 x 8K at 2
     * (3.260), 32 x 1K / 32 x 8K / 128 x 1K at 1 (1.709 / 11.903 / 6.315); the occupancy-filling
     * plan of the one-warp kernel (choose_splits) gave 2 splits at 32 x 8K (12.84 ms). */
    if (force <= 0) {
        const long long pairs = (long long)n_tiles * x.n_kv;
        long long ns = 2LL * n_sms / pairs;
        const long long by_len = max_ctx / FD_TILE;
        if (ns > by_len) ns = by_len;
        if (ns > 16) ns = 16; /* batch 1 x 8K / 32K: 16 splits 0.68 / 1.79 ms, 32: 0.73 / 1.85 */
        force = ns < 1 ? 1 : (int)ns;
    }
    launch_kernel(k_attn_fd<HD, ROT, TMA>, FD_WARPS * 32, fd_cfg<HD, ROT, TMA>::smem, resident_here(resident), x, n_tiles, max_ctx,
                  st, n_sms, ws_floats, n, HD, force, FD_TILE);
}

static int valid_dec_kind(int k) { return k == 0 || (k >= 2 && k <= 5); }

/* which kernel takes decode rows: `forced` (kvs_cuda_set_dec_attn) if it is a kind, else
 * KVS_CUDA_DEC_ATTN = 0 (CUDA cores), 2 or 3 (tensor cores, one warp a block, that many tiles in
 * flight), 4 (k_attn_fd). Unset: 4, k_attn_fd, which on H100 at its own split plan beat the
 * one-warp kernel at every measured shape (attention of all layers, --attn-variants, 02:45Z:
 * batch 1 x 8K 0.68 vs 0.83 ms, 32 x 8K 11.90 vs 12.18, 128 x 1K 6.32 vs 6.37). Kind 4 is only a
 * request: launch_hd takes the one-warp kernel with three tiles in flight (as fast or faster than
 * two at every shape since its staging was trimmed: 128 x 1K 6.37 vs 6.68 ms, 8 x 1K 0.61 vs
 * 0.63) for launches k_attn_fd does not take. */
static int dec_kind(int forced)
{
    static int k = -2;
    if (k == -2) {
        const char *e = getenv("KVS_CUDA_DEC_ATTN");
        k = e ? atoi(e) : -1;
        if (!valid_dec_kind(k)) k = -1;
    }
    if (valid_dec_kind(forced)) return forced;
    return k >= 0 ? k : 4;
}

template <int HD>
static void launch_hd(at_args &x, bool prefill, int n_tiles, int max_ctx, cudaStream_t st, int n_sms,
                      size_t ws_floats, int n, int force, int kind_forced)
{
    if (prefill) launch_tc_hd<HD>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force);
    else {
        int k = dec_kind(kind_forced);
        /* k_attn_fd: groups of up to 16 heads (one m-tile), head_dim 64 / 128 / 256 */
        constexpr bool fd_hd = HD == 64 || HD == 128 || HD == 256;
        if ((k == 4 || k == 5) && (!fd_hd || x.G > 16)) k = 3;
        if constexpr (fd_hd) {
            if (k == 4 || k == 5) {
                /* kind 4: the copy engine stages the KV where it can (blocks of a multiple of 16
                 * slots); kind 5: cp.async always (comparisons, tests) */
                const bool tma = k == 4 && x.bs % 16 == 0 && fd_tma_maps(x, HD);
                if (x.rot && tma) launch_fd<HD, true, true>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force);
                else if (x.rot) launch_fd<HD, true, false>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force);
                else if (tma) launch_fd<HD, false, true>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force);
                else launch_fd<HD, false, false>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force);
                return;
            }
        }
        if (k == 2) launch_tc_dec<HD, 2>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force);
        else if (k == 3) launch_tc_dec<HD, 3>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force);
        else launch_simt_hd<HD>(x, n_tiles, max_ctx, st, n_sms, ws_floats, n, force);
    }
}

void kvs_cu_attention(const struct kvs_cu_attn *a, cudaStream_t stream, int n_sms, float *ws, size_t ws_bytes,
                      int n_splits_force, int dec_kind_force)
{
    if (a->n <= 0) return;
    if (!kvs_cu_attention_supported(a->n_heads, a->n_kv, a->hd))
        kvs_panic(__FILE__, __LINE__, "cuda attention: unsupported shape: %d query heads, %d KV heads, head_dim %d",
                  a->n_heads, a->n_kv, a->hd);
    if (a->rot && !a->inv_freq) kvs_panic(__FILE__, __LINE__, "cuda attention: rotation offsets without inv_freq");
    const int G = a->n_heads / a->n_kv;
    /* plan both launches from the host copies: decode sequences (one row) and prefill tiles */
    int n_dec = 0, n_pre_tiles = 0, ctx_dec = 1, ctx_pre = 1;
    const int qt_pre = PRE_WARPS * 16 / G; /* prefill tokens per tile: the tensor-core kernel's rows */
    for (int s = 0; s < a->n_seqs; s++) {
        int ns = a->h_q_start[s + 1] - a->h_q_start[s], ctx = a->h_pos[s] + ns;
        if (ns == 1) {
            n_dec++;
            if (ctx > ctx_dec) ctx_dec = ctx;
        } else if (ns > 1) {
            n_pre_tiles += (ns + qt_pre - 1) / qt_pre;
            if (ctx > ctx_pre) ctx_pre = ctx;
        }
    }
    at_args x;
    if (a->plan_ctx > ctx_dec) ctx_dec = a->plan_ctx;
    x.q = a->q;
    x.kc = a->kc;
    x.vc = a->vc;
    x.q_start = a->q_start;
    x.pos = a->pos;
    x.bt = a->bt;
    x.rot = a->rot;
    x.valid = a->valid;
    x.inv_freq = a->inv_freq;
    x.words = (const int2 *)a->words;
    x.n_seqs = a->n_seqs;
    x.max_blocks = a->max_blocks;
    x.n_heads = a->n_heads;
    x.n_kv = a->n_kv;
    x.bs = a->bs;
    x.G = G;
    x.scale = a->scale;
    x.out = a->out;
    x.outh = a->outh;
    x.kv_rows = (long long)(a->kv_elems / (size_t)a->hd);
    x.part = ws;
    const size_t ws_floats = ws_bytes / sizeof(float);
    for (int pass = 0; pass < 2; pass++) {
        const int tiles = pass == 0 ? n_dec : n_pre_tiles;
        if (tiles == 0) continue;
        x.prefill = pass;
        x.qt = pass == 0 ? 1 : qt_pre;
        const int max_ctx = pass == 0 ? ctx_dec : ctx_pre;
        const bool pre = pass == 1;
        switch (a->hd) {
        case 16: launch_hd<16>(x, pre, tiles, max_ctx, stream, n_sms, ws_floats, a->n, n_splits_force, dec_kind_force); break;
        case 32: launch_hd<32>(x, pre, tiles, max_ctx, stream, n_sms, ws_floats, a->n, n_splits_force, dec_kind_force); break;
        case 64: launch_hd<64>(x, pre, tiles, max_ctx, stream, n_sms, ws_floats, a->n, n_splits_force, dec_kind_force); break;
        case 128: launch_hd<128>(x, pre, tiles, max_ctx, stream, n_sms, ws_floats, a->n, n_splits_force, dec_kind_force); break;
        default: launch_hd<256>(x, pre, tiles, max_ctx, stream, n_sms, ws_floats, a->n, n_splits_force, dec_kind_force); break;
        }
    }
}
