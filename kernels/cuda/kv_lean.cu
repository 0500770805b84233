/* kv_lean.cu: the CUDA backend's LeanKV kernels (kernels/kv_lean.h): the quantized page write
 * and attention over quantized pages (the static modes of kv.storage = lean).
 *
 * write: one warp per (row, KV head). The warp reduces min / max of the vector, derives fp16 z
 * and s exactly as the host quantizer does (kv_lean_quant.cuh, shared with the dynamic mode: the
 * host's IEEE operations, in the same order, with no contraction), so the codes are bitwise the CPU reference's; the codes
 * go through shared memory and are packed a byte per lane.
 *
 * attention: flash decoding over the pages (k_lean_fd, below): one warp a block owns a tile of
 * query rows (16 / G tokens of a sequence, or one row over its spans) x a KV head x a split of
 * the keys; the G query heads of the group share every K/V byte staged; 32 keys a step staged
 * with 16-byte cp.async (LEAN_ST stages, each one's K and V halves refilled as soon as they are
 * computed: LEAN_EARLY), dequantized from shared memory into tensor-core
 * fragments (fp16), QK and PV on mma.sync with fp32 accumulation, the online softmax in fp32;
 * splits merged by a second kernel. Deferred RoPE: q rotated backward by a block's offset at
 * document boundaries (rot_table, cuda_attn_device.cuh). Two layouts of the mma: query rows on
 * its 16-row M side (tiles of 16 / G tokens: prefill chunks), or keys on M with the rows as its
 * 8 columns (decode rows and spans of G <= 8: half the tensor-core work and accumulators per key,
 * so more warps resident; bench/RESULTS.md has the measurements); kvs_cuda_set_lean_layout
 * (cuda_backend.h) forces one for tests and benchmarks. Decode tiles of keys on M without spans
 * go to the multi-warp kernel with a copy warp (kv_lean_decode.cu) at every format but K2V2; the
 * device pieces both kernels share are in kv_lean_device.cuh.
 *
 * Shapes: head_dim 64 or 128, G <= 16, block sizes whose pages are a multiple of 16 bytes, the
 * formats K8V8, K8V4, K4V4, K4V2, K2V2 and K16V16 (supports() refuses the rest; the launch aborts
 * with a message if reached anyway).
 * Ownership: the caller's buffers. Errors: CUDA failures abort (CUDA_CHECK). */
#include "kernels/cuda/kv_lean_cuda.h"
#include "kernels/cuda/kv_lean_device.cuh"

/* ---- write ---------------------------------------------------------------------------------- */

/* quantizes x (hd floats, lane-strided reads) to bits into codes / sz, as kvs_lean_quantize */
__device__ void lean_quantize_warp(const float *x, int hd, int bits, uint8_t *codes, uint8_t *sz, uint8_t *stage)
{
    const int lane = threadIdx.x & 31;
    if (bits == 16) {
        /* one 16-bit store per value (codes is 2-byte aligned: even page and vector sizes). The
         * former two byte stores came out wrong on the H100 build: the low byte held the value
         * converted to an unsigned 8-bit integer (0 for 0.027 or -1.5, 1 for 1.09, 2 for 2.48;
         * the high byte right), as if the u8 store of the fp16 register converted it: the
         * K16V16 pages' mismatch (tests/gpu/test_cuda_kv_lean.c, bench/RESULTS.md) */
        uint16_t *out = reinterpret_cast<uint16_t *>(codes);
        for (int i = lane; i < hd; i += 32) out[i] = lean_f2h(lean_sat_half(x[i]));
        return;
    }
    float mn = INFINITY, mx = -INFINITY;
    for (int i = lane; i < hd; i += 32) mn = fminf(mn, x[i]), mx = fmaxf(mx, x[i]);
    for (int o = 16; o > 0; o >>= 1) {
        mn = fminf(mn, __shfl_xor_sync(LEAN_FULL, mn, o));
        mx = fmaxf(mx, __shfl_xor_sync(LEAN_FULL, mx, o));
    }
    const int top = (1 << bits) - 1;
    const struct lean_sz q = lean_scale_zero(mn, mx, bits); /* struct: lean_sz is also a function (kv_lean_device.cuh) */
    for (int i = lane; i < hd; i += 32) stage[i] = (uint8_t)lean_code(x[i], q, top);
    __syncwarp();
    const int per = 8 / bits, nb = hd * bits / 8;
    for (int b = lane; b < nb; b += 32) {
        unsigned byte = 0;
        for (int j = 0; j < per; j++) byte |= (unsigned)stage[b * per + j] << (bits * j);
        codes[b] = (uint8_t)byte;
    }
    if (lane == 0) lean_put_sz(sz, q);
    __syncwarp();
}

__global__ void k_lean_write(lean_geom g, int n, const float *k, const float *v, const int32_t *slots, uint8_t *pool)
{
    extern __shared__ uint8_t lean_stage[];   /* [hd] per warp */
    const int warp = threadIdx.x >> 5;
    const int task = blockIdx.x * (blockDim.x >> 5) + warp;
    const int t = task / g.n_kv, h = task % g.n_kv;
    if (t >= n) return;   /* whole warps leave together */
    const int32_t slot = slots[t];
    if (slot < 0) return;
    uint8_t *kc, *vc, *ksz, *vsz;
    lean_token(g, pool, slot / g.bs, h, slot % g.bs, &kc, &vc, &ksz, &vsz);
    const long long row = ((long long)t * g.n_kv + h) * g.hd;
    uint8_t *stage = lean_stage + warp * g.hd;
    lean_quantize_warp(k + row, g.hd, g.kbits, kc, ksz, stage);
    lean_quantize_warp(v + row, g.hd, g.vbits, vc, vsz, stage);
}

static void cu_lean_write(struct kvs_backend *b, struct kvs_lean_fmt f, const struct kvs_dbuf *k, const struct kvs_dbuf *v,
                          const struct kvs_dbuf *slots, int n, int n_kv_heads, int head_dim, int block_size,
                          struct kvs_dbuf *pool)
{
    if (n <= 0) return;
    const lean_geom g = make_geom(f, head_dim, block_size, n_kv_heads);
    const int warps = 4, tasks = n * n_kv_heads;
    k_lean_write<<<(tasks + warps - 1) / warps, warps * 32, warps * head_dim, b->stream>>>(g, n, (const float *)k->d,
                                                                                         (const float *)v->d,
                                                                    (const int32_t *)slots->d, (uint8_t *)pool->d);
    LAUNCH_CHECK();
}


/* Flash decoding over LeanKV pages, one warp a block: block (tile, KV head, split). A tile is
 * qt consecutive query tokens of one sequence (spans: one row); its rows are tokens x the G
 * query heads of the KV head (at most 16: one m-tile), so every K/V byte staged serves them
 * all. Keys come 32 a tile: each lane looks one key up (the tile after next: its page loads
 * overlap compute), the warp stages the tile's packed codes and (s, z) with 16-byte cp.async,
 * LEAN_ST stages; QK and PV run on tensor cores (mma m16n8k16, fp16 in, fp32
 * accumulate) with K and V dequantized from shared memory into fragments in registers (x^ =
 * s code - z as one fp16 fma: fp16 keeps 3 more mantissa bits than the bf16 K/V of the
 * dense kernel), q and p rounded to fp16; the softmax and every sum stay fp32. Splits cut the
 * key tiles over the grid's y; their partials are merged by k_lean_merge.
 * KT: the keys-on-M layout (above): tiles of at most 8 rows (qt = 8 / G tokens, G <= 8). */
/* __launch_bounds__ minimum blocks (one warp each) of the keys-on-M kernel of a format: 16 (128
 * registers: 4 warps a scheduler; ptxas spills 32-96 bytes) where shared memory lets more than 12
 * blocks stay resident (K8V4, K4V4 at head_dim 128), else 12 (168 registers, no spills: 3 warps a
 * scheduler, as many as the stages' shared memory admits anyway: K8V8 11, K16V16 6). A bound of 11
 * would let ptxas take 184 registers, i.e. 2 warps a scheduler. K8V8 at 16 spilled 96 bytes with
 * LEAN_EARLY and ran 6-15% slower than at 12 (bench/RESULTS.md, "part 9"). */
template <int HD, int KB, int VB>
__host__ __device__ constexpr int lean_kt_min_blocks()
{
#ifdef LEAN_KT_MIN_BLOCKS
    return LEAN_KT_MIN_BLOCKS;
#else
    return 233472 / (LEAN_ST * lean_stage<HD, KB, VB>::BYTES + HD * 4 + 1024) > 12 ? 16 : 12;
#endif
}

template <int HD, int KB, int VB, bool KT>
__global__ void __launch_bounds__(32, KT ? lean_kt_min_blocks<HD, KB, VB>() : LEAN_MIN_BLOCKS) k_lean_fd(const __grid_constant__ lean_fd_args a)
{
    using S = lean_stage<HD, KB, VB>;
    extern __shared__ __align__(16) uint8_t lean_smem[];
    float *cs_sn = reinterpret_cast<float *>(lean_smem + LEAN_ST * S::BYTES); /* [HD]: rotation table */
    const lean_geom &g = a.g;
    const int lane = threadIdx.x, gq = lane >> 2, t = lane & 3;
    const int tile = blockIdx.x / g.n_kv, kvh = blockIdx.x % g.n_kv, split = blockIdx.y;
    const bool spans = a.spans != nullptr;

    /* the tile's sequence s and first row r0 within it */
    int s = 0, r0 = 0;
    if (!lean_tile_seq(a, tile, lane, &s, &r0)) return; /* cannot happen: the grid has exactly the tiles */
    const int qs = a.q_start[s], rows_s = a.q_start[s + 1] - qs;
    const int nt = min(a.qt, rows_s - r0), nr = nt * a.G;
    const int first = a.pos[s] + r0, last = first + nt - 1; /* the tile's tokens' positions */
    const int32_t *bt = a.bt + (long long)s * a.max_blocks;
    const int32_t *vt = a.valid ? a.valid + (long long)s * a.max_blocks : nullptr;
    const int32_t *rt = a.rot ? a.rot + (long long)s * a.max_blocks : nullptr;
    int ns = 0;
    const int32_t *sp = nullptr;
    long long total;
    if (spans) {
        const long long pr = (long long)(qs + r0) * g.n_kv + kvh;
        ns = a.n_spans[pr];
        sp = a.spans + pr * a.max_spans * 2;
        long long sum = 0;
        for (int j = lane; j < ns; j += 32) {
            int lo;
            sum += lean_span_len(sp, j, last, &lo);
        }
        for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(FULL, sum, o);
        total = sum;
    } else {
        total = last + 1;
    }
    const long long n_tiles_all = (total + AT_TILE - 1) / AT_TILE;
    const long long w0 = (long long)split * a.chunk;
    const long long w1 = split == a.n_splits - 1 ? n_tiles_all : min(n_tiles_all, w0 + a.chunk);
    const int ntiles = w1 > w0 ? (int)(w1 - w0) : 0;

    /* the next tile's key cursor: position (no spans), or span j, offset o */
    int cj = 0, co = 0;
    long long cpos = w0 * AT_TILE;
    if (spans && ntiles > 0) {
        /* skip whole spans up to key w0 * AT_TILE (a split starts once per block) */
        long long k = w0 * AT_TILE;
        while (cj < ns) {
            int lo;
            const int len = lean_span_len(sp, cj, last, &lo);
            if (k < len) break;
            k -= len;
            cj++;
        }
        co = (int)k;
    }
    auto lookup = [&]() {
        int p;
        if (spans) {
            p = lean_key_after(sp, ns, last, cj, co + lane);
            lean_cursor_advance(sp, ns, last, cj, co, AT_TILE);
        } else {
            p = cpos + lane <= last ? (int)(cpos + lane) : -1;
            cpos += AT_TILE;
        }
        return lean_lookup<HD, KB, VB>(a, p, kvh, bt, vt, rt);
    };

    lean_key nxt = lookup();
#pragma unroll
    for (int st = 0; st < LEAN_ST - 1; st++) {
        if (st < ntiles) {
            lean_issue<HD, KB, VB>(a.pool, nxt, lean_smem + st * S::BYTES, lane);
            nxt = lookup();
        } else {
            lean_issue_none();
        }
    }
    if (LEAN_EARLY) { /* the last stage too: tiles come LEAN_ST ahead */
        if (LEAN_ST - 1 < ntiles) {
            lean_issue<HD, KB, VB>(a.pool, nxt, lean_smem + (LEAN_ST - 1) * S::BYTES, lane);
            nxt = lookup();
        } else {
            lean_issue_none();
        }
    }

    /* the rows: row r of the tile is token r / G, head r % G. Rows: the thread's q rows are g
     * and g + 8, its score rows the same; KT: its q row (B column) is g, its score columns 2t
     * and 2t + 1 */
    auto qrow = [&](int r) {
        return r < nr ? a.q + ((long long)(qs + r0 + r / a.G) * a.n_heads + (long long)kvh * a.G + r % a.G) * HD
                      : nullptr;
    };
    const float *qr[2];
    int lim[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int r = KT ? 2 * t + h : gq + 8 * h;
        qr[h] = KT ? (h ? nullptr : qrow(gq)) : qrow(r);
        lim[h] = r < nr ? (spans ? INT_MAX : first + r / a.G) : -1;
    }
    constexpr int QW = KT ? 2 : 4, NO = KT ? HD / 16 : HD / 8, NJ = KT ? 2 : 4;
    uint32_t qa[HD / 16][QW];
    float qsum[2];
    auto qfrags = [&](const float *cs) {
        if constexpr (KT) lean_qfrags_kt<HD, KB>(qr[0], a.scale, cs, lane, qa, qsum);
        else lean_qfrags<HD, KB>(qr, a.scale, cs, lane, qa, qsum);
    };
    auto qk = [&](const uint8_t *stg, float (*sc)[4]) {
        if constexpr (KT) lean_qk_kt<HD, KB, VB>(stg, qa, qsum, sc, lane);
        else lean_qk<HD, KB, VB>(stg, qa, qsum, sc, lane);
    };
    qfrags(nullptr);
    int cur_rot = 0;

    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}, corr[2] = {0.0f, 0.0f}, o[NO][4];
#pragma unroll
    for (int nd = 0; nd < NO; nd++) o[nd][0] = o[nd][1] = o[nd][2] = o[nd][3] = 0.0f;

    for (int it = 0; it < ntiles; it++) {
#if LEAN_EARLY
        static_assert(LEAN_DIAG == 0, "LEAN_EARLY: no diagnostic builds");
        /* pending after this tile's K group: its V group and the next LEAN_ST - 1 tiles' two */
        cp_async_wait<2 * LEAN_ST - 1>();
        __syncwarp();
        uint8_t *stg = lean_smem + (it % LEAN_ST) * S::BYTES;
        const bool more = it + LEAN_ST < ntiles; /* tile it + LEAN_ST goes into this stage */
#else
        if (it + LEAN_ST - 1 < ntiles && LEAN_DIAG != 2) {
            lean_issue<HD, KB, VB>(a.pool, nxt, lean_smem + ((it + LEAN_ST - 1) % LEAN_ST) * S::BYTES, lane);
            nxt = lookup(); /* its loads overlap this tile's wait and compute */
        } else {
            lean_issue_none();
        }
        /* pending: this tile's groups and the next LEAN_ST - 1 tiles'; K side first */
        cp_async_wait<LEAN_GPT * LEAN_ST - 1>();
        const uint8_t *stg = lean_smem + (it % LEAN_ST) * S::BYTES;
        __syncwarp();
#endif
        const int *ko = reinterpret_cast<const int *>(stg + S::KO_OFF);
        if (LEAN_DIAG == 1) { /* the copies alone */
            if (LEAN_KVSPLIT) cp_async_wait<LEAN_GPT * LEAN_ST - 2>();
            __syncwarp();
            continue;
        }
        float sc[NJ][4];
        const int myoff = ko[lane];
        if (!rt || __all_sync(FULL, myoff == cur_rot || myoff == KEY_PAD)) {
            qk(stg, sc);
        } else {
            /* a document boundary: one QK pass per rotation offset in the tile */
#pragma unroll
            for (int j = 0; j < NJ; j++) sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.0f;
            unsigned todo = __ballot_sync(FULL, myoff != KEY_PAD);
            while (todo) {
                const int ofs = __shfl_sync(FULL, myoff, __ffs((int)todo) - 1);
                if (ofs != cur_rot) {
                    if (ofs) rot_table(cs_sn, HD, ofs, a.inv_freq);
                    qfrags(ofs ? cs_sn : nullptr);
                    cur_rot = ofs;
                }
                float sr[NJ][4];
                qk(stg, sr);
#pragma unroll
                for (int j = 0; j < NJ; j++)
#pragma unroll
                    for (int e = 0; e < 4; e++)
                        if (ko[lean_sc_key<KT>(j, e, lane)] == ofs) sc[j][e] = sr[j][e];
                todo &= __ballot_sync(FULL, myoff != ofs);
            }
        }
#if LEAN_EARLY
        __syncwarp(); /* every lane is done with the stage's K codes */
        if (more) lean_issue_side<HD, KB, VB, 0>(a.pool, nxt, stg, lane);
        else cp_async_commit();
        cp_async_wait<2 * LEAN_ST - 1>(); /* this tile's V side */
        __syncwarp();
#endif
        const int kb = spans ? 0 : (int)((w0 + it) * AT_TILE);
        if constexpr (KT) {
            uint32_t pb[2][2];
            lean_softmax_kt<HD, KB, VB>(stg, sc, ko, kb, lim, m, l, corr, o, pb, lane);
            if (LEAN_KVSPLIT && !LEAN_EARLY) {
                cp_async_wait<LEAN_GPT * LEAN_ST - 2>(); /* the V codes */
                __syncwarp();
            }
            lean_pv_kt<HD, KB, VB>(stg, pb, o, lane);
        } else {
            uint32_t pa[2][4];
            float off[2];
            lean_softmax<HD, KB, VB>(stg, sc, ko, kb, lim, m, l, corr, o, pa, off, lane);
            if (LEAN_KVSPLIT && !LEAN_EARLY) {
                cp_async_wait<LEAN_GPT * LEAN_ST - 2>();
                __syncwarp();
            }
            lean_pv<HD, KB, VB>(stg, pa, o, lane);
            lean_pv_off<HD, VB>(off, o);
        }
        __syncwarp(); /* the stage is reloaded */
#if LEAN_EARLY
        if (more) {
            lean_issue_side<HD, KB, VB, 1>(a.pool, nxt, stg, lane);
            nxt = lookup();
        } else {
            cp_async_commit();
        }
#endif
    }
    cp_async_wait<0>();

    if constexpr (KT) {
        /* column e of the lane is row 2t + e; l and corr summed over the column's 8 lanes */
#pragma unroll
        for (int e = 0; e < 2; e++) {
            float ls = l[e], cr = corr[e];
#pragma unroll
            for (int x = 4; x < 32; x <<= 1) {
                ls += __shfl_xor_sync(FULL, ls, x);
                cr += __shfl_xor_sync(FULL, cr, x);
            }
            const int r = 2 * t + e;
            if (r >= nr) continue;
            const long long orow = (long long)(qs + r0 + r / a.G) * a.n_heads + (long long)kvh * a.G + r % a.G;
            /* o[x][e] is dim g HD/8 + 2x, o[x][2 + e] the next */
            if (a.n_splits == 1) {
                const float inv = ls > 0.0f ? 1.0f / ls : 0.0f;
                float2 *op = reinterpret_cast<float2 *>(a.out + orow * HD + gq * (HD / 8));
#pragma unroll
                for (int x = 0; x < HD / 16; x++) op[x] = make_float2((o[x][e] - cr) * inv, (o[x][2 + e] - cr) * inv);
                if (a.lse && gq == 0) a.lse[orow] = ls > 0.0f ? m[e] + logf(ls) : -INFINITY;
            } else {
                float *pp = a.part + (orow * a.n_splits + split) * (long long)(HD + 2);
#pragma unroll
                for (int x = 0; x < HD / 16; x++) {
                    pp[gq * (HD / 8) + 2 * x] = o[x][e] - cr;
                    pp[gq * (HD / 8) + 2 * x + 1] = o[x][2 + e] - cr;
                }
                if (gq == 0) {
                    pp[HD] = ls > 0.0f ? m[e] : -INFINITY;
                    pp[HD + 1] = ls;
                }
            }
        }
        return;
    } else {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float ls = l[h], cr = corr[h];
            ls += __shfl_xor_sync(FULL, ls, 1);
            ls += __shfl_xor_sync(FULL, ls, 2);
            cr += __shfl_xor_sync(FULL, cr, 1);
            cr += __shfl_xor_sync(FULL, cr, 2);
            const int r = gq + 8 * h;
            if (r >= nr) continue;
            const long long orow = (long long)(qs + r0 + r / a.G) * a.n_heads + (long long)kvh * a.G + r % a.G;
            /* o[nd][2h + c] is dim (2t + c) HD/8 + nd */
            if (a.n_splits == 1) {
                const float inv = ls > 0.0f ? 1.0f / ls : 0.0f; /* no key: out = 0, lse = -inf */
                float *op = a.out + orow * HD;
#pragma unroll
                for (int nd = 0; nd < HD / 8; nd++) {
                    op[(2 * t) * (HD / 8) + nd] = (o[nd][2 * h] - cr) * inv;
                    op[(2 * t + 1) * (HD / 8) + nd] = (o[nd][2 * h + 1] - cr) * inv;
                }
                if (a.lse && t == 0) a.lse[orow] = ls > 0.0f ? m[h] + logf(ls) : -INFINITY;
            } else {
                float *pp = a.part + (orow * a.n_splits + split) * (long long)(HD + 2);
#pragma unroll
                for (int nd = 0; nd < HD / 8; nd++) {
                    pp[(2 * t) * (HD / 8) + nd] = o[nd][2 * h] - cr;
                    pp[(2 * t + 1) * (HD / 8) + nd] = o[nd][2 * h + 1] - cr;
                }
                if (t == 0) {
                    pp[HD] = ls > 0.0f ? m[h] : -INFINITY;
                    pp[HD + 1] = ls;
                }
            }
        }
    }
}

/* the rows a merge takes (a mixed step's launches, run_attn): sel 0 every row; else only the rows
 * of the sequences that the attention launch of the same selection computed (lean_sel_rows), so
 * the other launch's rows, whose partials this launch did not write, are left alone */
struct lean_merge_sel {
    const int32_t *q_start;
    int n_seqs, n_heads, sel, sel_rows;
    long long rh0; /* the first row-head of the launch's sequences (block x is row-head rh0 + x) */
};

/* whether row-head rh is the merge's (block-uniform: every thread searches the same starts) */
__device__ __forceinline__ bool lean_merge_mine(const lean_merge_sel &ms, long long rh)
{
    if (!ms.sel) return true;
    const int tok = (int)(rh / ms.n_heads);
    int lo = 0, hi = ms.n_seqs - 1; /* the last sequence starting at or before tok: it holds tok */
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (ms.q_start[mid] <= tok) lo = mid;
        else hi = mid - 1;
    }
    return lean_sel_rows(ms.sel, ms.sel_rows, ms.q_start[lo + 1] - ms.q_start[lo]) > 0;
}

/* the splits' partials of each (row, head) (block) into out and lse (may be NULL), in split order:
 * the serial form (kvs_cuda_set_lean_merge / KVS_LEAN_MERGE=0): each thread walks the splits three
 * times, one dependent load a step */
__global__ void k_lean_merge(const float *part, int n_splits, int hd, float *out, float *lse, lean_merge_sel ms)
{
    grid_dep_wait(); /* cuda_launch.h: launched behind the attention kernel, its partials ready */
    const long long rh = ms.rh0 + blockIdx.x;
    if (!lean_merge_mine(ms, rh)) return;
    const float *pp = part + rh * n_splits * (long long)(hd + 2);
    float M = -INFINITY;
    for (int s = 0; s < n_splits; s++) M = fmaxf(M, pp[(long long)s * (hd + 2) + hd]);
    float L = 0.0f;
    if (M != -INFINITY)
        for (int s = 0; s < n_splits; s++) {
            const float *q = pp + (long long)s * (hd + 2);
            if (q[hd] != -INFINITY) L += q[hd + 1] * __expf(q[hd] - M);
        }
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float A = 0.0f;
        if (M != -INFINITY)
            for (int s = 0; s < n_splits; s++) {
                const float *q = pp + (long long)s * (hd + 2);
                if (q[hd] != -INFINITY) A += q[d] * __expf(q[hd] - M);
            }
        out[rh * hd + d] = M == -INFINITY ? 0.0f : A / L;
    }
    if (lse && threadIdx.x == 0) lse[rh] = M == -INFINITY ? -INFINITY : M + logf(L);
}

/* The staged form of k_lean_merge, the default: the same sums in the same split order with the
 * same operations (so the same bits: test_cuda_kv_lean), but the splits' maxima and sums are
 * loaded once by the block (a thread a split) into shared memory, each split's weight is made
 * once, and each output dimension's partials are loaded MERGE_ILP at a time before they are added
 * in order. The serial form's walks are chains of dependent loads (a few hundred cycles each): at
 * batch 8 x 8K k_lean_dec's 32 partials a row took the serial merge 14.4 us, the staged one 8.8
 * (ncu), the whole K8V8 attention 83 -> 77 us (bench/RESULTS.md, "part 12"). Shared memory: 2
 * n_splits floats. */
#define MERGE_ILP 8
__global__ void k_lean_merge_staged(const float *part, int n_splits, int hd, float *out, float *lse, lean_merge_sel ms)
{
    extern __shared__ float mg_sh[]; /* [n_splits] maxima, then weights; [n_splits] sums */
    float *mw = mg_sh, *ml = mg_sh + n_splits;
    grid_dep_wait();
    const long long rh = ms.rh0 + blockIdx.x;
    if (!lean_merge_mine(ms, rh)) return; /* block-uniform: before the first barrier */
    const long long st = hd + 2;
    const float *pp = part + rh * n_splits * st;
    for (int s = threadIdx.x; s < n_splits; s += blockDim.x) {
        mw[s] = pp[s * st + hd];
        ml[s] = pp[s * st + hd + 1];
    }
    __syncthreads();
    float M = -INFINITY;
    for (int s = 0; s < n_splits; s++) M = fmaxf(M, mw[s]);
    __syncthreads(); /* every thread has read the maxima before they become weights */
    /* weight 0 marks a split without keys (the serial form skips it: the same sums) */
    for (int s = threadIdx.x; s < n_splits; s += blockDim.x) mw[s] = mw[s] == -INFINITY ? 0.0f : __expf(mw[s] - M);
    __syncthreads();
    if (M == -INFINITY) {
        for (int d = threadIdx.x; d < hd; d += blockDim.x) out[rh * hd + d] = 0.0f;
        if (lse && threadIdx.x == 0) lse[rh] = -INFINITY;
        return;
    }
    float L = 0.0f;
    for (int s = 0; s < n_splits; s++)
        if (mw[s] != 0.0f) L += ml[s] * mw[s];
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float A = 0.0f;
        int s = 0;
        for (; s + MERGE_ILP <= n_splits; s += MERGE_ILP) {
            float v[MERGE_ILP];
#pragma unroll
            for (int j = 0; j < MERGE_ILP; j++) v[j] = pp[(s + j) * st + d];
#pragma unroll
            for (int j = 0; j < MERGE_ILP; j++)
                if (mw[s + j] != 0.0f) A += v[j] * mw[s + j];
        }
        for (; s < n_splits; s++)
            if (mw[s] != 0.0f) A += pp[s * st + d] * mw[s];
        out[rh * hd + d] = A / L;
    }
    if (lse && threadIdx.x == 0) lse[rh] = M + logf(L);
}

/* the merge's form (kvs_cuda_set_lean_merge, else KVS_LEAN_MERGE=STAGED[,EARLY]): 1 staged, 0
 * serial; early: k_lean_dec lets the merge's blocks start as its last blocks run (cuda_launch.h
 * grid_dep_launch); off by default: no faster on the H100 at any shape timed ("part 12") */
#ifndef LEAN_MERGE_EARLY
#define LEAN_MERGE_EARLY 0
#endif
static int merge_staged = -1, merge_early = LEAN_MERGE_EARLY;

extern "C" void kvs_cuda_set_lean_merge(int staged, int early)
{
    merge_staged = staged >= 0 ? staged != 0 : -1;
    merge_early = early >= 0 ? early != 0 : LEAN_MERGE_EARLY;
}

static void merge_cfg(int *staged, int *early)
{
    if (merge_staged < 0) {
        const char *e = getenv("KVS_LEAN_MERGE");
        int a = 1, b = LEAN_MERGE_EARLY;
        if (e && *e) sscanf(e, "%d,%d", &a, &b);
        merge_staged = a != 0, merge_early = b != 0;
    }
    *staged = merge_staged, *early = merge_early && kvs_cu_pdl_enabled();
}

/* 1 when k_lean_dec should trigger the merge's early launch (kv_lean_decode.cu) */
int lean_merge_early(void)
{
    int s, e;
    merge_cfg(&s, &e);
    return e;
}

/* kv_lean_prefill.cu too: the first launch of a kernel on a device raises its dynamic shared memory
 * to smem (and, carve >= 0, sets its carveout hint in percent), measures its resident blocks an SM
 * at `threads` a block (a kernel that fits none aborts: a build error, not a client's) and, with
 * KVS_LEAN_PLAN set (benchmarks: what the occupancy rests on), prints label, its shared memory,
 * registers, local memory and that count */
int lean_resident(const void *fn, int threads, size_t smem, int carve, const char *label)
{
    CUDA_CHECK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    if (carve >= 0) CUDA_CHECK(cudaFuncSetAttribute(fn, cudaFuncAttributePreferredSharedMemoryCarveout, carve));
    int nb = 0;
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&nb, fn, threads, smem));
    if (nb < 1) kvs_panic(__FILE__, __LINE__, "%s: kernel does not fit an SM (%zu bytes)", label, smem);
    if (getenv("KVS_LEAN_PLAN")) {
        cudaFuncAttributes fa;
        CUDA_CHECK(cudaFuncGetAttributes(&fa, fn));
        fprintf(stderr, "%s, %zu B shared, %d registers, %zu B local, %d blocks an SM\n", label, smem, fa.numRegs,
                (size_t)fa.localSizeBytes, nb);
    }
    return nb;
}

/* splits: the longest walk (w_max tiles) cut so the grid fills every SM with resident blocks
 * (one warp each), at least LEAN_MIN_TILES tiles a split, the partials within the workspace */
static void lean_plan(lean_fd_args &x, long long pairs, int resident, int n_sms, long long w_max, long long by_ws)
{
    long long ns = ((long long)resident * n_sms + pairs - 1) / pairs;
    const long long by_len = (w_max + LEAN_MIN_TILES - 1) / LEAN_MIN_TILES;
    if (ns > by_len) ns = by_len;
    if (ns > by_ws) ns = by_ws;
    if (ns > LEAN_MAX_SPLITS) ns = LEAN_MAX_SPLITS;
    if (ns < 1) ns = 1;
    x.chunk = (int)((w_max + ns - 1) / ns);
    if (x.chunk < 1) x.chunk = 1;
    x.n_splits = (int)((w_max + x.chunk - 1) / x.chunk);
    if (x.n_splits < 1) x.n_splits = 1;
}

template <int HD, int KB, int VB, bool KT>
static void lean_launch(lean_fd_args &x, long long n_tiles, long long w_max, long long by_ws, int n_sms, cudaStream_t st)
{
    static kvs_cu_resident resident_all;
    int &resident = *kvs_cu_resident_here(resident_all);
    const size_t smem = (size_t)LEAN_ST * lean_stage<HD, KB, VB>::BYTES + HD * sizeof(float);
    if (!resident) {
        /* KVS_LEAN_CARVE=P (0-100): the shared-memory carveout hint in percent (benchmarks: does
         * the driver's own choice hold the one-warp blocks below the occupancy computed here?) */
        const char *cv = getenv("KVS_LEAN_CARVE");
        char label[96];
        snprintf(label, sizeof label, "lean plan: HD %d K%dV%d %s", HD, KB, VB, KT ? "keys on M" : "rows on M");
        resident = lean_resident((const void *)k_lean_fd<HD, KB, VB, KT>, 32, smem, cv && *cv ? atoi(cv) : -1, label);
    }
    lean_plan(x, n_tiles * x.g.n_kv, resident, n_sms, w_max, by_ws);
    x.part -= x.prow0 * x.n_splits * (long long)(HD + 2); /* lean_fd_args.prow0 */
    const dim3 grid((unsigned)(n_tiles * x.g.n_kv), (unsigned)x.n_splits);
    k_lean_fd<HD, KB, VB, KT><<<grid, 32, smem, st>>>(x);
    LAUNCH_CHECK();
}


static bool lean_fmt_built(struct kvs_lean_fmt f)
{
#define LEAN_IS(K, V) if (f.kbits == K && f.vbits == V) return true;
    LEAN_FMTS(LEAN_IS)
#undef LEAN_IS
    return false;
}

template <int HD, bool KT>
static void lean_launch_hd(lean_fd_args &x, long long n_tiles, long long w_max, long long by_ws, int n_sms, cudaStream_t st)
{
#define LEAN_GO(K, V)                                                                                                  \
    if (x.g.kbits == K && x.g.vbits == V) return lean_launch<HD, K, V, KT>(x, n_tiles, w_max, by_ws, n_sms, st);
    LEAN_FMTS(LEAN_GO)
#undef LEAN_GO
    kvs_panic(__FILE__, __LINE__, "lean attention: format K%dV%d not built", x.g.kbits, x.g.vbits);
}

/* the attention layout forced for every launch of the process (kvs_cuda_set_lean_layout): 0 the
 * automatic choice, 1 rows on M, 2 keys on M (k_lean_fd, where G <= 8), 3 keys on M with the copy
 * warp's kernel (k_lean_dec, kv_lean_decode.cu) where it applies, else as 0 (cuda_backend.h's
 * comment predates 3: kv_lean_cuda.h has it) */
static int lean_layout;

extern "C" void kvs_cuda_set_lean_layout(int layout)
{
    lean_layout = layout >= 1 && layout <= 3 ? layout : 0;
}

/* kv_lean_prefill.cu: launches k_lean_pf for the rows-on-M launch x (sets x.qt, x.chunk and
 * x.n_splits; the partials, where n_splits > 1, for the merge below); false, with nothing
 * launched, where it does not apply (spans, rotation offsets, formats it is not built for,
 * kvs_cuda_set_lean_prefill(0)) */
bool lean_pf_launch(lean_fd_args &x, const int *h_q_start, const int *h_pos, long long by_ws, int n_sms, cudaStream_t st);
/* kv_lean_prefill.cu: whether lean_pf_launch would take x's rows-on-M launch */
bool lean_pf_takes(const lean_fd_args &x);
/* kv_lean_prefill.cu: the bf16 road's switch (0 off, 1 every chunk, 2 chunks of lean_dq_min_rows()
 * rows or more), and the road itself: the step's sequences [s0, s1) of launch a dequantized into the
 * bf16 scratch and attended by the dense attention; false, with nothing launched, where the scratch
 * cannot hold them */
int lean_dq_cfg(void);
int lean_dq_min_rows(void);
bool lean_dq_attention(struct kvs_backend *b, const lean_fd_args &a, const int *h_q_start, const int *h_pos, int s0,
                       int s1, float scale);

static long long lean_host_tiles(const int32_t *sp, int ns, int last)
{
    long long k = 0;
    for (int j = 0; j < ns; j++) {
        const int lo = sp[2 * j] > 0 ? sp[2 * j] : 0, hi = sp[2 * j + 1] < last + 1 ? sp[2 * j + 1] : last + 1;
        if (hi > lo) k += hi - lo;
    }
    return (k + AT_TILE - 1) / AT_TILE;
}

/* a mixed step in two launches: KVS_LEAN_MIXED=1 or kvs_cuda_set_lean_mixed(1) always, 0 never;
 * unset (the default), two launches only where the chunks go to k_lean_pf (kv_lean_prefill.cu) and
 * the step holds at least LEAN_MIXED_ROWS decode rows. On the H100 with k_lean_fd for the chunks,
 * two launches took as long or longer ("part 14": +5.5 ms at 1-63 decode rows, equal within 1 ms
 * at 64-255: the decode launch's merge walks every row-head of the step); with k_lean_pf taking
 * a one-launch step's decode rows too (measured at 4 warps a block: a row-tile a decode sequence,
 * one warp of it computing, 2 blocks an SM),
 * the 1,000-prompt workload's K8V4 mixed steps took 149.5 / 163.4 / 179.4 / 194.9 ms at 1-63 /
 * 64-127 / 128-191 / 192-255 decode rows against k_lean_fd's one launch 152.8 / 159.7 / 163.2 /
 * 168.2 ("part 15"): from 64 decode rows up the decode rows go back to k_lean_dec on their own
 * launch (part 14's two-launch form, the chunks now on k_lean_pf; its time with k_lean_pf not
 * measured: no device call was left). Read once, then as set. */
#define LEAN_MIXED_ROWS 64
static int lean_mixed = -2; /* -2 unread, -1 automatic, 0 / 1 forced */

extern "C" void kvs_cuda_set_lean_mixed(int on)
{
    lean_mixed = on >= 0 ? on != 0 : -2;
}

/* whether a mixed step of dec_rows decode rows takes two launches; pf: its chunks go to k_lean_pf */
static bool mixed_two(int dec_rows, bool pf)
{
    if (lean_mixed == -2) {
        const char *e = getenv("KVS_LEAN_MIXED");
        lean_mixed = e && *e ? atoi(e) != 0 : -1;
    }
    return lean_mixed == 1 || (lean_mixed == -1 && pf && dec_rows >= LEAN_MIXED_ROWS);
}

/* the host side of a launch's sequences: a's n_seqs sequences, whose device arrays a holds (an
 * engine step's, or a range of them: run_range) */
struct lean_hseqs {
    const int32_t *q_start, *pos; /* [n_seqs + 1], [n_seqs]: row indices are the step's */
};

/* one attention launch (and its merge) over the sequences of selection a.sel (lean_fd_args), in
 * layout kt (keys on M) or rows on M */
static void attn_launch(struct kvs_backend *b, struct kvs_lean_fmt f, lean_fd_args a, lean_hseqs m,
                        const struct kvs_span_list *sp, int n, int n_heads, int n_kv_heads, int head_dim, bool kt)
{
    /* spans: one row a tile; else 16 / G (KT: 8 / G) tokens of a sequence */
    a.qt = sp ? 1 : (kt ? 8 : 16) / a.G;
    /* the plan from the host copies: tiles, and the longest walk in key tiles */
    long long n_tiles = 0, w_max = 0;
    for (int s = 0; s < a.n_seqs; s++) {
        const int rows = lean_sel_rows(a.sel, a.sel_rows, m.q_start[s + 1] - m.q_start[s]);
        if (rows <= 0) continue;
        if (!sp) {
            n_tiles += (rows + a.qt - 1) / a.qt;
            const long long w = ((long long)m.pos[s] + rows + AT_TILE - 1) / AT_TILE;
            if (w > w_max) w_max = w;
            continue;
        }
        n_tiles += rows;
        for (int t = m.q_start[s]; t < m.q_start[s + 1]; t++) {
            const int last = m.pos[s] + t - m.q_start[s];
            for (int g = 0; g < n_kv_heads; g++) {
                const size_t pair = (size_t)t * n_kv_heads + g;
                const long long w = lean_host_tiles(sp->h_spans + pair * (size_t)sp->max_spans * 2, sp->h_n_spans[pair], last);
                if (w > w_max) w_max = w;
            }
        }
    }
    if (n_tiles == 0) return;
    /* the workspace holds the partials of this launch's rows only (lean_fd_args.prow0): a mixed
     * step's decode rows after a 4K-row chunk would otherwise find it full (by_ws 0: one split, and
     * k_lean_dec refused) */
    (void)n;
    const size_t rows_l = (size_t)(m.q_start[a.n_seqs] - m.q_start[0]);
    a.prow0 = (long long)m.q_start[0] * n_heads;
    long long by_ws = (long long)(ATTN_WS_BYTES / sizeof(float) / (rows_l * n_heads * (head_dim + 2)));
    /* keys on M without spans: k_lean_dec (kv_lean_decode.cu) for formats of 6 bits a key and
     * value or more (K4V2 up), k_lean_fd for K2V2 (layout 3 forces k_lean_dec, 2 k_lean_fd): on the
     * H100 k_lean_dec was the faster at K8V8 and K8V4 at every shape timed ("LeanKV kernels, part
     * 11"), and with its one-wave split plan at K4V4 and K4V2 too at three of the four shapes
     * (1-2% slower at batch 8 x 32K; bench/RESULTS.md, "part 12"); K2V2 was not timed */
    const bool dec = kt && (lean_layout == 3 || (lean_layout == 0 && f.kbits + f.vbits >= 6)) &&
                     lean_dec_launch(a, n_tiles, w_max, by_ws, b->n_sms, b->stream);
    /* rows on M at the automatic layout (a prompt chunk in the launch): the multi-warp prompt
     * kernel k_lean_pf (kv_lean_prefill.cu: K8V8 / K8V4 / K4V4 / K4V2 without spans or rotation
     * offsets; else k_lean_fd), which stages and dequantizes each key tile once for 128 query rows */
    const bool pf = !kt && !dec && !sp && lean_layout == 0 &&
                    lean_pf_launch(a, m.q_start, m.pos, by_ws, b->n_sms, b->stream);
    if (dec || pf) {
        /* launched: its partials (one a compute warp and split) are merged below, even a single one */
    } else if (head_dim == 64) {
        if (kt) lean_launch_hd<64, true>(a, n_tiles, w_max, by_ws, b->n_sms, b->stream);
        else lean_launch_hd<64, false>(a, n_tiles, w_max, by_ws, b->n_sms, b->stream);
    } else {
        if (kt) lean_launch_hd<128, true>(a, n_tiles, w_max, by_ws, b->n_sms, b->stream);
        else lean_launch_hd<128, false>(a, n_tiles, w_max, by_ws, b->n_sms, b->stream);
    }
    if (dec || a.n_splits > 1) {
        /* the grid covers every row-head; a selection's merge skips the other launch's rows. Both
         * launches of a step use the workspace from row 0 with their own split counts: in stream
         * order, so the second attention kernel starts after the first merge has read it */
        const lean_merge_sel ms = {a.q_start, a.n_seqs, n_heads, a.sel, a.sel_rows, (long long)m.q_start[0] * n_heads};
        const size_t rhs = (size_t)(m.q_start[a.n_seqs] - m.q_start[0]) * n_heads; /* the launch's row-heads */
        int staged, early;
        merge_cfg(&staged, &early);
        if (staged)
            CUDA_CHECK(kvs_cu_launch(k_lean_merge_staged, dim3((unsigned)rhs), dim3(head_dim),
                                     2 * (size_t)a.n_splits * sizeof(float), b->stream, (const float *)a.part, a.n_splits,
                                     head_dim, a.out, a.lse, ms));
        else
            CUDA_CHECK(kvs_cu_launch(k_lean_merge, dim3((unsigned)rhs), dim3(head_dim), 0, b->stream,
                                     (const float *)a.part, a.n_splits, head_dim, a.out, a.lse, ms));
        CUDA_CHECK(cudaGetLastError());
    }
}

static void run_range(struct kvs_backend *b, struct kvs_lean_fmt f, lean_fd_args a, lean_hseqs hs, int s0, int s1,
                      const struct kvs_span_list *sp, int n, int n_heads, int n_kv_heads, int head_dim);

static void run_attn(struct kvs_backend *b, struct kvs_lean_fmt f, const struct kvs_dbuf *q, const struct kvs_dbuf *pool,
                     const struct kvs_attn_meta *m, const struct kvs_span_list *sp, int n, int n_heads, int n_kv_heads,
                     int head_dim, int block_size, float scale, struct kvs_dbuf *out, struct kvs_dbuf *lse)
{
    if (n <= 0) return;
    const int G = n_heads / n_kv_heads;
    if (G < 1 || G > LEAN_MAXG || n_heads % n_kv_heads || (head_dim != 64 && head_dim != 128) || !lean_fmt_built(f))
        kvs_panic(__FILE__, __LINE__, "lean attention: K%dV%d, group %d x head_dim %d not supported", f.kbits, f.vbits, G,
                  head_dim);
    if (m->rot_offsets && !m->inv_freq) kvs_panic(__FILE__, __LINE__, "lean attention: rotation offsets without inv_freq");
    lean_fd_args a;
    memset(&a, 0, sizeof a);
    a.g = make_geom(f, head_dim, block_size, n_kv_heads);
    if (a.g.page % 16) kvs_panic(__FILE__, __LINE__, "lean attention: block size %d gives pages of %lld bytes, not a multiple of 16",
                                 block_size, a.g.page);
    a.q = (const float *)q->d;
    a.inv_freq = m->inv_freq ? (const float *)m->inv_freq->d : NULL;
    a.pool = (const uint8_t *)pool->d;
    a.out = (float *)out->d;
    a.lse = lse ? (float *)lse->d : NULL;
    a.part = b->attn_ws;
    a.q_start = (const int32_t *)m->q_start->d;
    a.pos = (const int32_t *)m->pos->d;
    a.bt = (const int32_t *)m->block_tables->d;
    a.rot = m->rot_offsets ? (const int32_t *)m->rot_offsets->d : NULL;
    a.valid = m->block_valid ? (const int32_t *)m->block_valid->d : NULL;
    a.n_spans = sp ? (const int32_t *)sp->n_spans->d : NULL;
    a.spans = sp ? (const int32_t *)sp->spans->d : NULL;
    a.n_seqs = m->n_seqs, a.max_blocks = m->max_blocks, a.max_spans = sp ? sp->max_spans : 0;
    a.n_heads = n_heads, a.G = G, a.scale = scale;
    const lean_hseqs hs = {m->h_q_start, m->h_pos};
    /* the bf16 road (kv_lean_prefill.cu lean_dq_attention): the prompt chunks' context dequantized
     * into a bf16 scratch and the dense prefill attention run over it. A chunk: a sequence of more
     * rows than a keys-on-M tile takes (8 / G, at least 1). The range from the first chunk to the
     * last goes there (one-row sequences inside it too, on the dense decode kernel); the sequences
     * before and after it, after it, on the lean kernels (decode rows on k_lean_dec). Not taken
     * (k_lean_pf / k_lean_fd as before): spans and the lse output (the span list's callers),
     * deferred-RoPE offsets (cached documents), K16V16, layouts forced by kvs_cuda_set_lean_layout,
     * ranges of more than 64 sequences, and steps the scratch cannot hold */
    const int dq = lean_dq_cfg();
    if (dq && !sp && !a.lse && !a.rot && lean_layout == 0 && f.kbits < 16 && f.vbits < 16) {
        const int thr = G <= 8 && 8 / G > 1 ? 8 / G : 1;
        int s0 = -1, s1 = -1, longest = 0;
        for (int s = 0; s < m->n_seqs; s++) {
            const int rows = m->h_q_start[s + 1] - m->h_q_start[s];
            if (rows <= thr) continue;
            if (s0 < 0) s0 = s;
            s1 = s + 1;
            if (rows > longest) longest = rows;
        }
        if (s0 >= 0 && (dq == 1 || longest >= lean_dq_min_rows()) &&
            lean_dq_attention(b, a, m->h_q_start, m->h_pos, s0, s1, scale)) {
            /* after it: its merge may write rows before s0 (lean_dq_attention) */
            if (s0 > 0) run_range(b, f, a, hs, 0, s0, NULL, n, n_heads, n_kv_heads, head_dim);
            if (s1 < m->n_seqs) run_range(b, f, a, hs, s1, m->n_seqs, NULL, n, n_heads, n_kv_heads, head_dim);
            return;
        }
    }
    run_range(b, f, a, hs, 0, m->n_seqs, sp, n, n_heads, n_kv_heads, head_dim);
}

/* the lean kernels over the step's sequences [s0, s1) (sp: only all of them): a's device arrays
 * and the host copies hs offset to the range (rows keep the step's indices) */
static void run_range(struct kvs_backend *b, struct kvs_lean_fmt f, lean_fd_args a, lean_hseqs hs, int s0, int s1,
                      const struct kvs_span_list *sp, int n, int n_heads, int n_kv_heads, int head_dim)
{
    if (s1 <= s0) return;
    KVS_ASSERT(!sp || (s0 == 0 && s1 == a.n_seqs));
    const long long so = (long long)s0 * a.max_blocks;
    a.q_start += s0, a.pos += s0, a.bt += so;
    if (a.rot) a.rot += so;
    if (a.valid) a.valid += so;
    a.n_seqs = s1 - s0;
    hs.q_start += s0, hs.pos += s0;
    /* lean_tile_seq's one-row fast path reads a tile as the step's row: a range not starting at row
     * 0 takes the prefix sum of a selection of every sequence instead */
    if (hs.q_start[0] != 0) a.sel = 1, a.sel_rows = INT_MAX;
    const int G = a.G;
    /* the layout: keys on M (KT) where every tile fits 8 rows (decode rows and spans of G <= 8),
     * rows on M where a sequence has more (a prefill chunk shares each K/V tile among 16 rows);
     * kvs_cuda_set_lean_layout forces either (KT only where G <= 8; layout 3 as 2, then k_lean_dec) */
    int max_rows = 0, min_rows = INT_MAX;
    for (int s = 0; s < a.n_seqs; s++) {
        const int rows = hs.q_start[s + 1] - hs.q_start[s];
        if (rows > max_rows) max_rows = rows;
        if (rows > 0 && rows < min_rows) min_rows = rows;
    }
    /* a mixed step (decode rows beside prompt chunks, in the engine's scheduling order), where
     * mixed_two(): two launches over the same metadata, each taking its own sequences
     * (lean_fd_args.sel), so the decode rows keep the keys-on-M kernels (k_lean_dec) instead of
     * riding in the chunks' tiles of the one-warp kernel (16 / G tokens a tile, "part 12").
     * Decode-only steps (the ones the engine captures in graphs) take the single launch */
    const int kt_rows = 8 / G;
    int dec_rows = 0;
    for (int s = 0; s < a.n_seqs; s++) {
        const int rows = hs.q_start[s + 1] - hs.q_start[s];
        if (rows <= kt_rows) dec_rows += rows;
    }
    if (!sp && G <= 8 && lean_layout == 0 && max_rows > kt_rows && min_rows <= kt_rows &&
        mixed_two(dec_rows, lean_pf_takes(a))) {
        a.sel_rows = kt_rows;
        a.sel = 2;
        attn_launch(b, f, a, hs, sp, n, n_heads, n_kv_heads, head_dim, false);
        a.sel = 1;
        attn_launch(b, f, a, hs, sp, n, n_heads, n_kv_heads, head_dim, true);
        return;
    }
    const bool kt = G <= 8 && (lean_layout >= 2 || (lean_layout == 0 && (sp || max_rows * G <= 8)));
    attn_launch(b, f, a, hs, sp, n, n_heads, n_kv_heads, head_dim, kt);
}

static void cu_lean_attention_spans(struct kvs_backend *b, struct kvs_lean_fmt f, const struct kvs_dbuf *q,
                                    const struct kvs_dbuf *pool, const struct kvs_attn_meta *m,
                                    const struct kvs_span_list *sp, int n, int n_heads, int n_kv_heads, int head_dim,
                                    int block_size, float scale, struct kvs_dbuf *out, struct kvs_dbuf *lse)
{
    xh_forget(b, out->d);
    xh_forget(b, lse->d);
    run_attn(b, f, q, pool, m, sp, n, n_heads, n_kv_heads, head_dim, block_size, scale, out, lse);
}

static void cu_lean_attention(struct kvs_backend *b, struct kvs_lean_fmt f, const struct kvs_dbuf *q,
                              const struct kvs_dbuf *pool, const struct kvs_attn_meta *m, int n, int n_heads,
                              int n_kv_heads, int head_dim, int block_size, float scale, struct kvs_dbuf *out)
{
    xh_forget(b, out->d);
    run_attn(b, f, q, pool, m, NULL, n, n_heads, n_kv_heads, head_dim, block_size, scale, out, NULL);
}

/* ---- pages ---------------------------------------------------------------------------------- */

static struct kvs_dbuf *cu_lean_alloc_pages(struct kvs_backend *b, size_t n)
{
    return kvs_cuda_backend.alloc(b, KVS_BUF_I32, (n + 3) / 4);
}

static void cu_lean_copy_block(struct kvs_backend *b, struct kvs_dbuf *pool, int src, int dst, size_t block_bytes)
{
    if (src == dst) return;
    uint8_t *p = (uint8_t *)pool->d;
    CUDA_CHECK(cudaMemcpyAsync(p + (size_t)dst * block_bytes, p + (size_t)src * block_bytes, block_bytes,
                               cudaMemcpyDeviceToDevice, b->stream));
}

/* the attention kernel's shapes: head_dim 64 or 128, groups of up to 16 query heads, the formats
 * of LEAN_FMTS (the write kernel takes any); 16 bits only as K16V16 (LeanKV's neutral setting),
 * whose pages match the CPU's since k_lean_write's 16-bit store (test_cuda_kv_lean) */
static int cu_lean_supports(struct kvs_lean_fmt f, int n_heads, int n_kv_heads, int head_dim)
{
    return n_kv_heads > 0 && n_heads % n_kv_heads == 0 && n_heads / n_kv_heads <= LEAN_MAXG &&
           (head_dim == 64 || head_dim == 128) && lean_fmt_built(f) &&
           ((f.kbits < 16 && f.vbits < 16) || (f.kbits == 16 && f.vbits == 16));
}

extern "C" const struct kvs_lean_kernels kvs_lean_kernels_cuda = {
    cu_lean_alloc_pages, cu_lean_write, cu_lean_attention_spans, cu_lean_attention, cu_lean_copy_block,
    cu_lean_supports,
};
