/* kv_lean_device.cuh: the device pieces of LeanKV's attention over quantized pages, shared by the
 * one-warp flash-decoding kernel (kv_lean.cu: k_lean_fd, every layout, spans) and the multi-warp
 * decode kernel (kv_lean_decode.cu: k_lean_dec, a copy warp feeding a ring of stages to compute
 * warps): page addressing, the stage layout and its cp.async staging, the tensor-core QK / softmax
 * / PV of both mma layouts, the span walk, and the host's view of a launch (lean_fd_args).
 * Internal (included by those two files only). Ownership: nothing is allocated. Errors: device code
 * has none; the launchers check every CUDA call (CUDA_CHECK / LAUNCH_CHECK). */
#ifndef KVS_KV_LEAN_DEVICE_CUH
#define KVS_KV_LEAN_DEVICE_CUH

#include "kernels/cuda/cuda_attn_device.cuh"
#include "kernels/cuda/cuda_internal.cuh"
#include "kernels/cuda/kv_lean_quant.cuh"

extern "C" {
#include "kernels/kv_lean.h"
}

#define LEAN_FULL 0xffffffffu
#define LEAN_MAXG 16

/* page addressing (kernels/kv_lean.h): K codes [bs][kc], V codes [bs][vc], K (s, z) [bs][4 bytes]
 * below 16 bits, V (s, z) likewise */
struct lean_geom {
    int kbits, vbits, hd, bs, n_kv;
    int kc, vc;                   /* code bytes of a vector */
    long long page;               /* bytes of a page */
};

static lean_geom make_geom(struct kvs_lean_fmt f, int hd, int bs, int n_kv)
{
    lean_geom g;
    g.kbits = f.kbits, g.vbits = f.vbits, g.hd = hd, g.bs = bs, g.n_kv = n_kv;
    g.kc = hd * f.kbits / 8, g.vc = hd * f.vbits / 8;
    g.page = (long long)kvs_lean_page_bytes(f, hd, bs);
    return g;
}

__device__ __forceinline__ void lean_token(const lean_geom &g, uint8_t *pool, int block, int kvh, int off, uint8_t **k,
                                           uint8_t **v, uint8_t **ksz, uint8_t **vsz)
{
    uint8_t *page = pool + ((long long)block * g.n_kv + kvh) * g.page;
    uint8_t *meta = page + (long long)g.bs * (g.kc + g.vc);
    *k = page + (long long)off * g.kc;
    *v = page + (long long)g.bs * g.kc + (long long)off * g.vc;
    *ksz = *vsz = NULL;
    if (g.kbits < 16) {
        *ksz = meta + off * 4;
        meta += g.bs * 4;
    }
    if (g.vbits < 16) *vsz = meta + off * 4;
}
/* ---- attention ------------------------------------------------------------------------------ */

#ifndef LEAN_ST
/* stages: tiles in flight + the one computed. 2, not 3: a block's shared memory (3 stages: 23 KB
 * at K8V4, 29 KB at K8V8) held it to 7-9 resident warps an SM, below what the registers allow;
 * with 2, K8V8 at 32K went from 1.20-1.25x to 1.38-1.50x bf16 (bench/RESULTS.md, 2026-11-24) */
#define LEAN_ST 2
#endif
#ifndef LEAN_MIN_BLOCKS
#define LEAN_MIN_BLOCKS 1         /* __launch_bounds__ minimum blocks per SM (occupancy experiments) */
#endif
/* LEAN_KT_MIN_BLOCKS (-D, occupancy experiments): the same minimum for the keys-on-M layout, all
 * formats. Unset: lean_kt_min_blocks below, per format. */
#ifndef LEAN_EARLY
/* 1: each stage's K and V halves are reissued as soon as they are free: the K codes of tile
 * it + LEAN_ST right after QK of tile it, its V codes (and key infos) after PV, so a tile's copies
 * are in flight for about LEAN_ST iterations at the shared memory of LEAN_ST tiles (the whole-tile
 * issue at the top of an iteration gives them LEAN_ST - 1: while a tile was computed only the next
 * one was in flight, and the copies and the compute overlapped poorly). A/B on the H100
 * (bench/RESULTS.md, "part 9"): against the whole-tile issue, K8V4 0-3.5% and K4V4 0-3% faster,
 * K8V8 1-5% with 168 registers (lean_kt_min_blocks). 0: the whole tile at the top of an iteration. */
#define LEAN_EARLY 1
#endif
#if LEAN_EARLY
#undef LEAN_KVSPLIT
#define LEAN_KVSPLIT 1
#endif
#ifndef LEAN_DIAG
/* benchmarks only (wrong results): 1 = the copies without QK / softmax / PV, 2 = the compute over
 * the prologue's stages without the loop's copies; 0 = the kernel */
#define LEAN_DIAG 0
#endif
#define LEAN_MIN_TILES 4          /* tiles (of AT_TILE keys) a split is planned with at least */
#define LEAN_MAX_SPLITS 256

struct lean_fd_args {
    lean_geom g;
    const float *q, *inv_freq;
    const uint8_t *pool;
    float *out, *lse, *part;      /* lse may be NULL; part: [n][n_heads][n_splits][hd + 2] */
    const int32_t *q_start, *pos, *bt, *rot, *valid, *n_spans, *spans; /* spans NULL: [0, ctx) */
    int n_seqs, max_blocks, max_spans, n_heads, G;
    int qt;                       /* tokens of a sequence per tile (spans: 1) */
    int chunk, n_splits;          /* tiles per split, splits */
    float scale;
    /* a mixed step's launches (kv_lean.cu run_attn): sel 0 every sequence; 1 only the sequences
     * of at most sel_rows rows (the decode rows), 2 only those of more (the prompt chunks); the
     * others have no tiles in the launch (their rows are left to the other launch) */
    int sel, sel_rows;
    /* the first row-head of the launch's sequences (a range of the step's: kv_lean.cu run_range):
     * the partials hold the launch's row-heads only, so the launchers point part prow0 row-heads'
     * partials before the workspace (host arithmetic; every address the kernels form is inside it),
     * and the split plan counts the workspace for the launch's rows, not the step's */
    long long prow0;
};

/* the rows of sequence s that the launch computes (0: another launch's) */
__host__ __device__ __forceinline__ int lean_sel_rows(int sel, int sel_rows, int rows)
{
    return sel == 0 || (sel == 1) == (rows <= sel_rows) ? rows : 0;
}

/* the sequence s of query tile `tile` and its first row r0 in it (a tile: qt consecutive rows of
 * one sequence; qt 1: the rows themselves, by a warp-wide search of q_start; else a warp-wide prefix
 * sum of the sequences' tile counts, 32 sequences a pass). Warp-uniform; every lane must call it.
 * false: no such tile (cannot happen where the grid has exactly the tiles). */
__device__ __forceinline__ bool lean_tile_seq(const lean_fd_args &a, int tile, int lane, int *s_out, int *r0_out)
{
    int s = 0, r0 = 0;
    if (a.qt == 1 && !a.sel) { /* a selection skips sequences: the prefix sum below */
        /* the last sequence starting at or before the tile, 32 starts a load (a binary search
         * would be a chain of dependent loads at every block's start) */
        for (int c = 0; c < a.n_seqs; c += 32) {
            const int qv = c + lane < a.n_seqs ? a.q_start[c + lane] : INT_MAX;
            const unsigned mk = __ballot_sync(FULL, qv <= tile);
            if (mk) s = c + 31 - __clz((int)mk);
            if (mk != FULL) break;
        }
        r0 = tile - a.q_start[s];
    } else {
        int base = 0;
        bool found = false;
        for (int c = 0; c < a.n_seqs && !found; c += 32) {
            const int sc = c + lane;
            const int cnt =
                sc < a.n_seqs ? (lean_sel_rows(a.sel, a.sel_rows, a.q_start[sc + 1] - a.q_start[sc]) + a.qt - 1) / a.qt : 0;
            int inc = cnt;
            for (int o = 1; o < 32; o <<= 1) {
                const int v = __shfl_up_sync(FULL, inc, o);
                if (lane >= o) inc += v;
            }
            const int total = __shfl_sync(FULL, inc, 31);
            if (tile < base + total) {
                const unsigned mk = __ballot_sync(FULL, cnt > 0 && tile >= base + inc - cnt && tile < base + inc);
                const int src = __ffs((int)mk) - 1;
                s = c + src;
                r0 = (tile - base - __shfl_sync(FULL, inc - cnt, src)) * a.qt;
                found = true;
            }
            base += total;
        }
        if (!found) return false;
    }
    *s_out = s, *r0_out = r0;
    return true;
}

__device__ __forceinline__ void lean_cp16(void *dst, const void *src, int bytes)
{
    const unsigned sa = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(sa), "l"(src), "r"(bytes));
}

__device__ __forceinline__ void lean_cp4(void *dst, const void *src, int bytes)
{
    const unsigned sa = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(sa), "l"(src), "r"(bytes));
}

__device__ __forceinline__ __half2 lean_u2h(uint32_t u) { return *reinterpret_cast<__half2 *>(&u); }
__device__ __forceinline__ uint32_t lean_h2u(__half2 h) { return *reinterpret_cast<uint32_t *>(&h); }

__device__ __forceinline__ uint32_t lean_pack_f16(float lo, float hi)
{
    return lean_h2u(__floats2half2_rn(lo, hi));
}

__device__ __forceinline__ void lean_mma(float *c, const uint32_t *a, uint32_t b0, uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* The codes are fed to the tensor cores raw, as fp16 1024 + code (exact: a byte permute puts
 * the code under the exponent of 1024), and the scale and zero are applied per key outside the
 * products: q . k^ = s (q . (1024 + c)) - (1024 s + z) sum(q), and sum_k p_k v^_k =
 * sum_k (p_k s_k) (1024 + c_k) - sum_k (1024 p_k s_k + p_k z_k) (the second sum per row, fp32).
 * So dequantizing costs a permute per two elements (plus a mask at 4 and 2 bits); at 16 bits
 * the word is two fp16 values, taken as they are.
 * A word of packed K codes at B bits gives NPW half2: output m holds the word's elements e0(m)
 * and e0(m) + STEP. */
template <int B> struct lean_w {
    static constexpr int EPW = B == 16 ? 2 : 32 / B;   /* elements per word */
    static constexpr int NPW = EPW / 2;                /* half2 outputs per word */
    static constexpr int STEP = B == 16 ? 1 : 8 / B;   /* second element of an output: first + STEP */
    static __host__ __device__ constexpr int e0(int m) { return B == 16 ? 0 : (8 / B) * 2 * (m % 2) + m / 2; }
};

template <int B>
__device__ __forceinline__ void lean_raw(uint32_t x, uint32_t *out)
{
    if constexpr (B == 16) {
        out[0] = x;
    } else {
        constexpr int per = 8 / B;
#pragma unroll
        for (int j = 0; j < per; j++) {
            const uint32_t y = B == 8 ? x : (x >> (B * j)) & (B == 4 ? 0x0f0f0f0fu : 0x03030303u);
            out[2 * j] = __byte_perm(y, 0x64646464u, 0x4140);
            out[2 * j + 1] = __byte_perm(y, 0x64646464u, 0x4342);
        }
    }
}

/* NB bytes of shared memory (NB a power of two, aligned to min(NB, 16)) into w[max(1, NB / 4)] */
template <int NB>
__device__ __forceinline__ void lean_lds(const uint8_t *p, uint32_t *w)
{
    if constexpr (NB >= 16) {
#pragma unroll
        for (int i = 0; i < NB / 16; i++) {
            const uint4 v = reinterpret_cast<const uint4 *>(p)[i];
            w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
        }
    } else if constexpr (NB == 8) {
        const uint2 v = *reinterpret_cast<const uint2 *>(p);
        w[0] = v.x, w[1] = v.y;
    } else if constexpr (NB == 4) {
        w[0] = *reinterpret_cast<const uint32_t *>(p);
    } else {
        static_assert(NB == 2, "lean_lds: 2, 4, 8 or a multiple of 16 bytes");
        w[0] = *reinterpret_cast<const uint16_t *>(p);
    }
}

/* Which dimension of the head each fragment element holds. QK contracts over dimensions, so
 * they may be dealt in any order that q and K share: lane quad t owns dims [t HD/4, (t+1) HD/4)
 * of every key (its K codes are contiguous bytes: vector loads), k-step ks of the mma takes
 * the lane's decode outputs 2 ks (slots 2t, 2t+1) and 2 ks + 1 (slots 2t+8, 2t+9). */
template <int HD, int KB>
__host__ __device__ constexpr int lean_kdim(int t, int qi, int c)
{
    using W = lean_w<KB>;
    return t * (HD / 4) + (qi / W::NPW) * W::EPW + W::e0(qi % W::NPW) + c * W::STEP;
}

/* the q fragments of the warp's 16 rows (qr[h]: row g + 8h's q, or NULL for a padding row),
 * scaled, rotated backward by cs_sn (or not: NULL) and rounded to fp16 (saturated) */
template <int HD, int KB>
__device__ __forceinline__ void lean_qfrags(const float *const *qr, float scale, const float *cs_sn, int lane,
                                            uint32_t (*qa)[4], float *qsum)
{
    const int t = lane & 3;
    qsum[0] = qsum[1] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < HD / 16; ks++)
#pragma unroll
        for (int e = 0; e < 2; e++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                float v0 = 0.0f, v1 = 0.0f;
                if (qr[h]) {
                    v0 = q_dim<HD>(qr[h], lean_kdim<HD, KB>(t, 2 * ks + e, 0), scale, cs_sn);
                    v1 = q_dim<HD>(qr[h], lean_kdim<HD, KB>(t, 2 * ks + e, 1), scale, cs_sn);
                }
                qa[ks][h + 2 * e] = lean_pack_f16(fminf(fmaxf(v0, -65504.0f), 65504.0f),
                                                  fminf(fmaxf(v1, -65504.0f), 65504.0f));
                const float2 qf = __half22float2(lean_u2h(qa[ks][h + 2 * e]));
                qsum[h] += qf.x + qf.y;
            }
    /* the quad's lanes hold a row's dims between them */
#pragma unroll
    for (int h = 0; h < 2; h++) {
        qsum[h] += __shfl_xor_sync(FULL, qsum[h], 1);
        qsum[h] += __shfl_xor_sync(FULL, qsum[h], 2);
    }
}

/* staged tile of AT_TILE keys: K codes [32][KS], V codes [32][VS] (rows padded by 16 bytes
 * against bank conflicts), K (s, z) [32][4], V (s, z) [32][4], key info [32] */
template <int HD, int KB, int VB>
struct lean_stage {
    static constexpr int KC = HD * KB / 8, VC = HD * VB / 8, KS = KC + 16, VS = VC + 16;
    static constexpr int K_OFF = 0, V_OFF = AT_TILE * KS, KSZ_OFF = V_OFF + AT_TILE * VS, VSZ_OFF = KSZ_OFF + 128,
                         KO_OFF = VSZ_OFF + 128, BYTES = KO_OFF + 128;
};

/* one key of a tile, looked up by its lane: byte offsets in the pool (-1: not read) */
struct lean_key {
    long long k, v, ksz, vsz;
    int info;
};

template <int HD, int KB, int VB>
__device__ __forceinline__ lean_key lean_lookup(const lean_fd_args &a, int p, int kvh, const int32_t *bt,
                                                const int32_t *vt, const int32_t *rt)
{
    const lean_geom &g = a.g;
    lean_key k;
    k.k = k.v = k.ksz = k.vsz = -1;
    k.info = KEY_PAD;
    if (p >= 0) {
        const int pb = p / g.bs, sl = p - pb * g.bs;
        if (!vt || sl < vt[pb]) {
            const long long page = ((long long)bt[pb] * g.n_kv + kvh) * g.page;
            const long long meta = page + (long long)g.bs * (g.kc + g.vc);
            k.k = page + (long long)sl * g.kc;
            k.v = page + (long long)g.bs * g.kc + (long long)sl * g.vc;
            if (KB < 16) k.ksz = meta + sl * 4;
            if (VB < 16) k.vsz = meta + (KB < 16 ? g.bs * 4 : 0) + sl * 4;
            k.info = rt ? rt[pb] : 0;
        }
    }
    return k;
}

#ifndef LEAN_KVSPLIT
/* (LEAN_EARLY 0 only) 1: a tile's copies are two cp.async groups, first the K codes with both
 * (s, z), then the V codes, and the loop waits for the K group before QK and for the V group only
 * before PV; measured no faster than one group (bench/RESULTS.md, "part 9"), so 0 */
#define LEAN_KVSPLIT 0
#endif
/* cp.async groups a tile takes */
#define LEAN_GPT (LEAN_KVSPLIT ? 2 : 1)

/* cp.async of the tile that lane l's key describes (key l) into stage stg; keys not read get
 * zero-filled codes and (s, z), so they dequantize to 0 (their probability is 0 as well). Commits
 * LEAN_GPT groups (the K side first). */
template <int HD, int KB, int VB>
__device__ __forceinline__ void lean_issue(const uint8_t *pool, const lean_key &k, uint8_t *stg, int lane)
{
    using S = lean_stage<HD, KB, VB>;
    constexpr int CHK = S::KC / 16, CHV = S::VC / 16;
    reinterpret_cast<int *>(stg + S::KO_OFF)[lane] = k.info;
#pragma unroll
    for (int idx = lane; idx < AT_TILE * CHK; idx += 32) {
        const int j = idx / CHK, c = idx % CHK;
        const long long o = __shfl_sync(FULL, k.k, j);
        lean_cp16(stg + S::K_OFF + j * S::KS + c * 16, o >= 0 ? pool + o + c * 16 : pool, o >= 0 ? 16 : 0);
    }
    if (KB < 16) lean_cp4(stg + S::KSZ_OFF + lane * 4, k.ksz >= 0 ? pool + k.ksz : pool, k.ksz >= 0 ? 4 : 0);
    if (VB < 16) lean_cp4(stg + S::VSZ_OFF + lane * 4, k.vsz >= 0 ? pool + k.vsz : pool, k.vsz >= 0 ? 4 : 0);
    if (LEAN_KVSPLIT) cp_async_commit();
#pragma unroll
    for (int idx = lane; idx < AT_TILE * CHV; idx += 32) {
        const int j = idx / CHV, c = idx % CHV;
        const long long o = __shfl_sync(FULL, k.v, j);
        lean_cp16(stg + S::V_OFF + j * S::VS + c * 16, o >= 0 ? pool + o + c * 16 : pool, o >= 0 ? 16 : 0);
    }
    cp_async_commit();
}

/* LEAN_EARLY's halves of lean_issue, one cp.async group each: side 0 the K codes and K (s, z),
 * side 1 the key infos, V codes and V (s, z) */
template <int HD, int KB, int VB, int SIDE>
__device__ __forceinline__ void lean_issue_side(const uint8_t *pool, const lean_key &k, uint8_t *stg, int lane)
{
    using S = lean_stage<HD, KB, VB>;
    constexpr int CH = (SIDE ? S::VC : S::KC) / 16, RS = SIDE ? S::VS : S::KS, OFF = SIDE ? S::V_OFF : S::K_OFF;
    constexpr bool Q = (SIDE ? VB : KB) < 16;
    if (SIDE) reinterpret_cast<int *>(stg + S::KO_OFF)[lane] = k.info;
    const long long base = SIDE ? k.v : k.k, sz = SIDE ? k.vsz : k.ksz;
#pragma unroll
    for (int idx = lane; idx < AT_TILE * CH; idx += 32) {
        const int j = idx / CH, c = idx % CH;
        const long long o = __shfl_sync(FULL, base, j);
        lean_cp16(stg + OFF + j * RS + c * 16, o >= 0 ? pool + o + c * 16 : pool, o >= 0 ? 16 : 0);
    }
    if (Q) lean_cp4(stg + (SIDE ? S::VSZ_OFF : S::KSZ_OFF) + lane * 4, sz >= 0 ? pool + sz : pool, sz >= 0 ? 4 : 0);
    cp_async_commit();
}

/* the groups of a tile not issued (past the split's last tile): empty, so that the waits' counts hold */
__device__ __forceinline__ void lean_issue_none()
{
    if (LEAN_KVSPLIT) cp_async_commit();
    cp_async_commit();
}

/* (s, z) of key r at side offset OFF of the stage, as floats */
__device__ __forceinline__ float2 lean_sz(const uint8_t *stg, int off, int r)
{
    return __half22float2(lean_u2h(*reinterpret_cast<const uint32_t *>(stg + off + r * 4)));
}

/* key r's staged codes as lane quad t's tensor-core words (lean_kdim's order): hk[2 ks] and
 * hk[2 ks + 1] are k-step ks's slots (2t, 2t + 1) and (2t + 8, 2t + 9) */
template <int HD, int KB, int VB>
__device__ __forceinline__ void lean_kwords(const uint8_t *stg, int r, int t, uint32_t *hk)
{
    using S = lean_stage<HD, KB, VB>;
    using W = lean_w<KB>;
    constexpr int NB = HD * KB / 32, NW = NB >= 4 ? NB / 4 : 1;
    static_assert(NW * W::NPW == HD / 8, "lean_kwords: HD / 8 words a key");
    uint32_t w[NW];
    lean_lds<NB>(stg + S::K_OFF + r * S::KS + t * NB, w);
#pragma unroll
    for (int i = 0; i < NW; i++) lean_raw<KB>(w[i], hk + i * W::NPW);
}

/* S^T of the warp's 16 rows against the staged 32 keys: s[n-tile of 8 keys][4] (row g + 8h, key
 * j 8 + 2t + e in s[j][2h + e]); qsum[h]: sum of row g + 8h's fp16 q */
template <int HD, int KB, int VB>
__device__ __forceinline__ void lean_qk(const uint8_t *stg, const uint32_t (*qa)[4], const float *qsum, float (*s)[4],
                                        int lane)
{
    using S = lean_stage<HD, KB, VB>;
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
        uint32_t hk[HD / 8];
        lean_kwords<HD, KB, VB>(stg, j * 8 + g, t, hk);
#pragma unroll
        for (int ks = 0; ks < HD / 16; ks++) lean_mma(s[j], qa[ks], hk[2 * ks], hk[2 * ks + 1]);
    }
    if constexpr (KB < 16) {
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const float2 sz = lean_sz(stg, S::KSZ_OFF, j * 8 + 2 * t + e);
                const float off = fmaf(1024.0f, sz.x, sz.y);
#pragma unroll
                for (int h = 0; h < 2; h++) s[j][2 * h + e] = fmaf(sz.x, s[j][2 * h + e], -off * qsum[h]);
            }
    }
}

/* The V codes of k-step kk (keys 16 kk .. 16 kk + 15) as tensor-core words: b[hh][L] pairs keys
 * 16 kk + 8 hh + 2t and the next (low half, high half) at dim g HD/8 + L (the lane's own
 * contiguous codes): the two keys' code bytes are interleaved by a permute, then each pair gets
 * the 1024 exponent by another. lean_pv takes them as B fragments (O += P' . (1024 + C), n-tile
 * nd = dims g HD/8 + nd), lean_pv_kt as A fragments of V^T. */
template <int HD, int KB, int VB>
__device__ __forceinline__ void lean_vwords(const uint8_t *stg, int kk, int lane, uint32_t (*b)[HD / 8])
{
    using S = lean_stage<HD, KB, VB>;
    constexpr int NB = HD * VB / 64, NW = NB >= 4 ? NB / 4 : 1, ND = HD / 8;
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            const int r = kk * 16 + hh * 8 + 2 * t;
            uint32_t wa[NW], wb[NW];
            lean_lds<NB>(stg + S::V_OFF + r * S::VS + g * NB, wa);
            lean_lds<NB>(stg + S::V_OFF + (r + 1) * S::VS + g * NB, wb);
#pragma unroll
            for (int i = 0; i < NW; i++) {
                if constexpr (VB == 16) {
                    b[hh][2 * i] = __byte_perm(wa[i], wb[i], 0x5410);
                    b[hh][2 * i + 1] = __byte_perm(wa[i], wb[i], 0x7632);
                } else {
                    constexpr int per = 8 / VB;
#pragma unroll
                    for (int x = 0; x < 2; x++) {
                        /* bytes 2x, 2x + 1 of both keys: [a, b, a', b'] */
                        const uint32_t xb = __byte_perm(wa[i], wb[i], x ? 0x7362 : 0x5140);
#pragma unroll
                        for (int j = 0; j < per; j++) {
                            const uint32_t y = VB == 8 ? xb : (xb >> (VB * j)) & (VB == 4 ? 0x0f0f0f0fu : 0x03030303u);
                            const int L = i * 4 * per + x * 2 * per + j;
                            if (L < ND) b[hh][L] = __byte_perm(y, 0x64646464u, 0x4140);
                            if (L + per < ND) b[hh][L + per] = __byte_perm(y, 0x64646464u, 0x4342);
                        }
                    }
                }
            }
        }
}

template <int HD, int KB, int VB>
__device__ __forceinline__ void lean_pv(const uint8_t *stg, const uint32_t (*pa)[4], float (*o)[4], int lane)
{
#pragma unroll
    for (int kk = 0; kk < 2; kk++) {
        uint32_t b[2][HD / 8];
        lean_vwords<HD, KB, VB>(stg, kk, lane, b);
#pragma unroll
        for (int nd = 0; nd < HD / 8; nd++) lean_mma(o[nd], pa[kk], b[0][nd], b[1][nd]);
    }
}

/* softmax_stats (cuda_attn_device.cuh, the dense kernels' online softmax) on fp32 scores, then the
 * A fragments of P' = p s_v (fp16), the rows' correction corr += p z_v (rescaled with o) and
 * off[h] = 1024 sum p' over the lane's keys of this tile: the V side of lean_raw's identity.
 * The caller takes the tile's 1024 sum p' (off summed over the quad) out of o right after the
 * tile's PV (lean_pv_off), so o never holds the ~1024 l it would sum to over a long walk: with
 * that term kept to the end (in corr), o - corr cancelled two fp32 sums ~1024x the result, and
 * the tensor cores' accumulation lost the difference over thousands of keys (rel-L2 up to 0.2
 * against the CPU at 3-7K keys in one split: bench/RESULTS.md, LeanKV part 15). */
template <int HD, int KB, int VB>
__device__ __forceinline__ void lean_softmax(const uint8_t *stg, float (*sc)[4], const int *ko, int kb, const int *lim,
                                             float *m, float *l, float *corr, float (*o)[4], uint32_t (*pa)[4],
                                             float *off, int lane)
{
    using S = lean_stage<HD, KB, VB>;
    const int t = lane & 3;
    float alpha[2];
    softmax_stats<HD, true>(sc, ko, kb, lim, m, l, o, alpha, lane);
    corr[0] *= alpha[0];
    corr[1] *= alpha[1];
    off[0] = off[1] = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        float2 sz0 = make_float2(1.0f, 0.0f), sz1 = sz0;
        if constexpr (VB < 16) {
            sz0 = lean_sz(stg, S::VSZ_OFF, j * 8 + 2 * t);
            sz1 = lean_sz(stg, S::VSZ_OFF, j * 8 + 2 * t + 1);
        }
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const float p0 = sc[j][2 * h], p1 = sc[j][2 * h + 1];
            const __half2 ph = __floats2half2_rn(p0 * sz0.x, p1 * sz1.x);
            pa[j / 2][(j & 1) * 2 + h] = lean_h2u(ph);
            if constexpr (VB < 16) {
                const float2 pf = __half22float2(ph);
                off[h] += 1024.0f * (pf.x + pf.y);
                corr[h] += p0 * sz0.y + p1 * sz1.y;
            }
        }
    }
}

/* o -= the tile's 1024 sum p' per row (lean_softmax's off, summed over the quad that shares a
 * row); no-op at 16-bit V (codes taken as they are: off is 0) */
template <int HD, int VB>
__device__ __forceinline__ void lean_pv_off(const float *off, float (*o)[4])
{
    if constexpr (VB < 16) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float x = off[h];
            x += __shfl_xor_sync(LEAN_FULL, x, 1);
            x += __shfl_xor_sync(LEAN_FULL, x, 2);
#pragma unroll
            for (int nd = 0; nd < HD / 8; nd++) {
                o[nd][2 * h] -= x;
                o[nd][2 * h + 1] -= x;
            }
        }
    }
}

/* ---- keys on the mma's M side (KT): tiles of at most 8 query rows (decode, G <= 8) ----------
 * S^T = K q^T and O^T = V^T P^T: keys (then dims) fill the mma's 16-row side and the tile's
 * query rows its 8 columns, so a decode tile of G <= 8 heads pads to 8 rows instead of 16. Half
 * the mma of the row layout per key, half its accumulator registers (o^T: HD/16 x 4 floats),
 * half the exponentials; P^T's B fragments come from the S^T accumulators by movmatrix (an 8x8
 * transpose in registers). Lane (g, t) holds S^T for keys 16 mt + g (+ 8) x rows 2t, 2t + 1,
 * o^T for dims g HD/8 + 2x (+ 1) x rows 2t, 2t + 1; the softmax sums l and corr are the lane's
 * partials (its keys), summed over the 8 lanes of a column at the end. */
__device__ __forceinline__ uint32_t lean_movt(uint32_t x)
{
    uint32_t y;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
    return y;
}

/* q of the lane's column row g (qrow, or NULL: a padding row) as B fragments qb[ks][2] (scaled,
 * rotated backward by cs_sn or not, fp16), and the fp16 sums of rows 2t and 2t + 1 in qcol */
template <int HD, int KB>
__device__ __forceinline__ void lean_qfrags_kt(const float *qrow, float scale, const float *cs_sn, int lane,
                                               uint32_t (*qb)[2], float *qcol)
{
    const int t = lane & 3;
    float qs = 0.0f;
#pragma unroll
    for (int ks = 0; ks < HD / 16; ks++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
            float v0 = 0.0f, v1 = 0.0f;
            if (qrow) {
                v0 = q_dim<HD>(qrow, lean_kdim<HD, KB>(t, 2 * ks + e, 0), scale, cs_sn);
                v1 = q_dim<HD>(qrow, lean_kdim<HD, KB>(t, 2 * ks + e, 1), scale, cs_sn);
            }
            qb[ks][e] = lean_pack_f16(fminf(fmaxf(v0, -65504.0f), 65504.0f), fminf(fmaxf(v1, -65504.0f), 65504.0f));
            const float2 qf = __half22float2(lean_u2h(qb[ks][e]));
            qs += qf.x + qf.y;
        }
    qs += __shfl_xor_sync(FULL, qs, 1);
    qs += __shfl_xor_sync(FULL, qs, 2);
    /* row r's sum is in quad r */
    qcol[0] = __shfl_sync(FULL, qs, 8 * t);
    qcol[1] = __shfl_sync(FULL, qs, 8 * t + 4);
}

/* S^T of the 32 staged keys against the tile's rows: s[mt][2 hh + e] is key 16 mt + 8 hh + g,
 * row 2t + e */
template <int HD, int KB, int VB>
__device__ __forceinline__ void lean_qk_kt(const uint8_t *stg, const uint32_t (*qb)[2], const float *qcol,
                                           float (*s)[4], int lane)
{
    using S = lean_stage<HD, KB, VB>;
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mt = 0; mt < 2; mt++) {
        s[mt][0] = s[mt][1] = s[mt][2] = s[mt][3] = 0.0f;
        uint32_t ha[HD / 8], hb[HD / 8];
        lean_kwords<HD, KB, VB>(stg, mt * 16 + g, t, ha);
        lean_kwords<HD, KB, VB>(stg, mt * 16 + 8 + g, t, hb);
#pragma unroll
        for (int ks = 0; ks < HD / 16; ks++) {
            const uint32_t a[4] = {ha[2 * ks], hb[2 * ks], ha[2 * ks + 1], hb[2 * ks + 1]};
            lean_mma(s[mt], a, qb[ks][0], qb[ks][1]);
        }
    }
    if constexpr (KB < 16) {
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int hh = 0; hh < 2; hh++) {
                const float2 sz = lean_sz(stg, S::KSZ_OFF, mt * 16 + 8 * hh + g);
                const float off = fmaf(1024.0f, sz.x, sz.y);
#pragma unroll
                for (int e = 0; e < 2; e++) s[mt][2 * hh + e] = fmaf(sz.x, s[mt][2 * hh + e], -off * qcol[e]);
            }
    }
}

/* the online softmax over S^T (columns: rows 2t + e; lim[e] their last visible key, -1 padding):
 * m is the column's max (reduced over its 8 lanes), l and corr the lane's partials; then P'^T =
 * (p s_v)^T as B fragments pb[k-step][2] and corr += 1024 p' + p z_v, as lean_softmax */
template <int HD, int KB, int VB>
__device__ __forceinline__ void lean_softmax_kt(const uint8_t *stg, float (*sc)[4], const int *ko, int kb,
                                                const int *lim, float *m, float *l, float *corr, float (*o)[4],
                                                uint32_t (*pb)[2], int lane)
{
    using S = lean_stage<HD, KB, VB>;
    const int g = lane >> 2;
    float alpha[2];
    bool moved = false;
#pragma unroll
    for (int e = 0; e < 2; e++) {
        float mx = -INFINITY;
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int hh = 0; hh < 2; hh++) {
                const int r = mt * 16 + 8 * hh + g;
                const bool ok = ko[r] != KEY_PAD && kb + r <= lim[e];
                const float v = ok ? sc[mt][2 * hh + e] : -INFINITY;
                sc[mt][2 * hh + e] = v;
                mx = fmaxf(mx, v);
            }
        mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 4));
        mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 8));
        mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, 16));
        const float mn = fmaxf(m[e], mx);
        alpha[e] = m[e] == -INFINITY ? 0.0f : __expf(m[e] - mn);
        moved |= m[e] != -INFINITY && mn != m[e];
        m[e] = mn;
        float ps = 0.0f;
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int hh = 0; hh < 2; hh++) {
                const float v = sc[mt][2 * hh + e];
                const float pr = v == -INFINITY ? 0.0f : __expf(v - mn);
                sc[mt][2 * hh + e] = pr;
                ps += pr;
            }
        l[e] = l[e] * alpha[e] + ps;
        corr[e] *= alpha[e];
    }
    if (__any_sync(FULL, moved)) {
#pragma unroll
        for (int x = 0; x < HD / 16; x++) {
            o[x][0] *= alpha[0];
            o[x][1] *= alpha[1];
            o[x][2] *= alpha[0];
            o[x][3] *= alpha[1];
        }
    }
#pragma unroll
    for (int mt = 0; mt < 2; mt++) {
        float2 v0 = make_float2(1.0f, 0.0f), v1 = v0;
        if constexpr (VB < 16) {
            v0 = lean_sz(stg, S::VSZ_OFF, mt * 16 + g);
            v1 = lean_sz(stg, S::VSZ_OFF, mt * 16 + 8 + g);
        }
        /* rows of the 8x8 blocks: keys 16 mt + g and 16 mt + 8 + g; columns: rows 2t, 2t + 1 */
        const __half2 h0 = __floats2half2_rn(sc[mt][0] * v0.x, sc[mt][1] * v0.x);
        const __half2 h1 = __floats2half2_rn(sc[mt][2] * v1.x, sc[mt][3] * v1.x);
        if constexpr (VB < 16) {
            const float2 f0 = __half22float2(h0), f1 = __half22float2(h1);
            corr[0] += 1024.0f * (f0.x + f1.x) + sc[mt][0] * v0.y + sc[mt][2] * v1.y;
            corr[1] += 1024.0f * (f0.y + f1.y) + sc[mt][1] * v0.y + sc[mt][3] * v1.y;
        }
        pb[mt][0] = lean_movt(lean_h2u(h0));
        pb[mt][1] = lean_movt(lean_h2u(h1));
    }
}

/* O^T += V'^T . P'^T: m-tile x holds dims g HD/8 + 2x (row g) and g HD/8 + 2x + 1 (row g + 8) */
template <int HD, int KB, int VB>
__device__ __forceinline__ void lean_pv_kt(const uint8_t *stg, const uint32_t (*pb)[2], float (*o)[4], int lane)
{
#pragma unroll
    for (int kk = 0; kk < 2; kk++) {
        uint32_t b[2][HD / 8];
        lean_vwords<HD, KB, VB>(stg, kk, lane, b);
#pragma unroll
        for (int x = 0; x < HD / 16; x++) {
            const uint32_t a[4] = {b[0][2 * x], b[0][2 * x + 1], b[1][2 * x], b[1][2 * x + 1]};
            lean_mma(o[x], a, pb[kk][0], pb[kk][1]);
        }
    }
}

/* the key (of the staged 32) that score slot sc[j][e] of the lane holds, in either layout */
template <bool KT> __device__ __forceinline__ int lean_sc_key(int j, int e, int lane)
{
    return KT ? j * 16 + 8 * (e >> 1) + (lane >> 2) : j * 8 + 2 * (lane & 3) + (e & 1);
}

/* the span walk of kv_span.cu: span j clipped to the row, [lo, lo + len) */
__device__ __forceinline__ int lean_span_len(const int32_t *sp, int j, int last, int *lo)
{
    const int a = max(sp[2 * j], 0), b = min(sp[2 * j + 1], last + 1);
    *lo = a;
    return b > a ? b - a : 0;
}

/* the position of the key k keys after cursor (j, o), or -1 past the last span */
__device__ __forceinline__ int lean_key_after(const int32_t *sp, int ns, int last, int j, int o)
{
    while (j < ns) {
        int lo;
        const int len = lean_span_len(sp, j, last, &lo);
        if (o < len) return lo + o;
        o -= len;
        j++;
    }
    return -1;
}

__device__ __forceinline__ void lean_cursor_advance(const int32_t *sp, int ns, int last, int &j, int &o, int k)
{
    o += k;
    while (j < ns) {
        int lo;
        const int len = lean_span_len(sp, j, last, &lo);
        if (o < len) break;
        o -= len;
        j++;
    }
}

/* the formats the kernels are built for (a K/V bit pair: static modes, LeanKV's tiers, K16V16) */
#define LEAN_FMTS(X) X(8, 8) X(8, 4) X(4, 4) X(4, 2) X(2, 2) X(16, 16)

/* kv_lean_decode.cu: launches k_lean_dec for x (the keys-on-M tiles of run_attn, kv_lean.cu: qt
 * tokens of G <= 8 heads, at most 8 rows a tile) and sets x.chunk and x.n_splits (the partials for
 * k_lean_merge, which run_attn always launches after it); false, with nothing launched, where it does not apply
 * (spans, tiles of more than 8 rows, a workspace too small for its partials) */
bool lean_dec_launch(lean_fd_args &x, long long n_tiles, long long w_max, long long by_ws, int n_sms, cudaStream_t st);
/* kv_lean.cu: 1 when the merge launched after k_lean_dec may start early (kvs_cuda_set_lean_merge) */
int lean_merge_early(void);

#endif
