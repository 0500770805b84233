/* kv_quest.h: the kernels of Quest's page selection (kv.decode=quest, engine/kv/kv_decode_quest.c),
 * one table of function pointers per backend: the CPU reference (kernels/cpu/kv_quest.c, plain C)
 * and the CUDA kernels (kernels/cuda/kv_quest.cu). The sparse attention itself is the backend's
 * attention_spans (backend.h); these only produce the spans.
 *
 * Page digests. A page is page_size consecutive slots of one KV block (page_size divides the
 * block size), so page p of a sequence is physical page bt[p * ps / bs] * (bs / ps) + (p * ps %
 * bs) / ps, and a digest belongs to the physical block, never to a request: prefix-shared blocks
 * share it, and whatever rewrites a block (a preempted request's recompute, a reused block, a
 * copied-on-write block) rewrites it through a step that refreshes it. Layout per layer: a
 * KVS_BUF_KV buffer [n_pool_blocks * bs / ps][n_kv_heads][2][head_dim], the element-wise min
 * (index 0) and max (index 1) of the page's post-RoPE keys over its written slots. Min and max
 * of stored keys are stored keys' values, so the KV type holds them exactly.
 *
 * Selection rows. The rows selected for are rows 0 .. n-1 of the step, sequence s = row s (each
 * of those sequences has one row: the scheduler puts decode rows first; the policy passes the
 * leading one-row sequences). Row s is at position pos[s]: its context is ctx = pos[s] + 1
 * positions, its current page c = pos[s] / ps (always kept), its candidates the full pages
 * 0 .. c-1. keep[s] (I32) is how many pages it keeps, the current one included.
 *
 * Scores (F32 [n][n_kv_heads][max_pages]): for candidate page j of row s, KV head g,
 *   score = sum over the group's query heads h (h / (n_heads / n_kv_heads) == g, in increasing h)
 *           of sum over i < head_dim of max(q[h][i] * kmin[i], q[h][i] * kmax[i])
 * (Quest's upper bound of q.k per head, summed over the group: the group shares one selection
 * because it shares the K/V that is read). Entries past c-1 are undefined.
 *
 * Selection: the keep[s] - 1 candidates with the highest scores, ties to the lower page index,
 * where scores compare as kvs_quest_order_key (a total order: -0 below +0); plus page c. The
 * kept pages become spans (backend.h kvs_span_list) in increasing position, adjacent pages
 * merged: [first * ps, (last + 1) * ps), the last span ending at ctx. keep[s] > c (every page)
 * gives the single span [0, ctx), which attention_spans computes as attention() does (bitwise
 * on the CPU). At most max_spans spans per (row, KV head): the caller sizes it >= max keep.
 *
 * Quantized digests (kv.quest.digest_bits 8 or 4: bits = 8 or 4 below). The same exact min and
 * max of each page and KV head, coded on one grid per (page, KV head): value(c) = fmaf(c, scale,
 * lo) in fp32, c in 0 .. levels = 2^bits - 1, lo = the smallest kmin rounded down to fp16,
 * scale = (largest kmax - lo) / levels rounded up to fp16 (and raised until value(levels) >= the
 * largest kmax). Rounded outward: a kmin's code is the floor, a kmax's the ceiling, each then
 * corrected in value()'s own arithmetic, so value(code of kmin[i]) <= kmin[i] and
 * value(code of kmax[i]) >= kmax[i] hold exactly for every coordinate i. The coding functions
 * below are shared by both backends (IEEE division, floor, ceil and fmaf only): the codes are
 * bitwise the same on CPU and CUDA. A page whose range fp16 cannot hold (a key beyond +-65504,
 * or NaN) gets the parameters KVS_QD_UNBOUNDED and scores +inf (an upper bound that keeps it a
 * candidate). State: none beyond the codes; digest_update recomputes a written page's exact
 * min/max from its slots in the cache (as for bf16 digests), so a partial page's codes follow
 * its keys, and a full page's never change again.
 * Layout (KVS_BUF_I32, kvs_quest_qdig_words): codes [n_pages][n_kv_heads][2][hd * bits / 32]
 * words (min vector, then max vector; dimension j in word j / (32 / bits), at bit
 * (j % (32 / bits)) * bits), then params [n_pages][n_kv_heads] words (lo's fp16 bits in the low
 * half, scale's in the high half). head_dim * bits must be a multiple of 32.
 * Quantized scores are the formula above over the decoded values. What holds: (1) every decoded
 * min <= the page's kmin and every decoded max >= its kmax; (2) so each product term
 * max(q dmin, q dmax) >= max(q kmin, q kmax) (rounding to nearest is monotone), and the CPU
 * reference, which sums both in the same order, gives quantized score >= exact-digest score in
 * fp32 exactly (the CUDA kernel sums in another order: equal up to rounding); (3) both bound
 * sum_h q_h . k for every key k of the page (in exact arithmetic). Looser bounds rank pages
 * differently: the selection is not the exact digests' selection.
 *
 * Ownership: the tables are static; the buffers are the caller's. Errors: ops return void (bad
 * arguments are bugs); kvs_quest_kernels_for returns NULL with a message (-ENOSYS: the backend
 * has no Quest kernels).
 */
#ifndef KVS_KV_QUEST_H
#define KVS_KV_QUEST_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kernels/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Two-level (super-page) selection: an approximation of the selection above, behind
 * kv.quest.super_pages = N > 0 (engine/kv/kv_decode_quest.c). Super-page j of a row is its
 * candidate pages j N .. min(j N + N, c) - 1. Its digest (F32 [n_kv_heads][2][head_dim] per
 * super-page, kept per request slot: a row's pages are its own sequence's, so unlike a page
 * digest it cannot belong to a block) is the element-wise min of its pages' kmin and max of
 * their kmax as the page digests hold them (bits 16: the stored values; 8 / 4: the decoded
 * values value(code)), so it bounds every page's bound: score(super) >= score(page) in exact
 * arithmetic. A super-page with an unbounded page (KVS_QD_UNBOUNDED) holds -inf / +inf
 * everywhere and scores +inf. Rows: skeep[s] = how many super-pages row s keeps: the last
 * one (the pages just before the current page, always kept as Quest keeps the current page: a
 * partial super-page has a narrow box, so its bound ranks low, while the recent keys are the ones
 * attention weighs most; without it the long-context model's KL grew 100-400x, bench/RESULTS.md
 * quest11) and the skeep[s] - 1 highest super-page scores among the others (same formula, same
 * order key, ties to the lower index); the candidates become the pages of the kept super-pages, each scored as score / qscore would
 * (the same formula in the same order), and the top keep[s] - 1 of them (ties to the lower page)
 * plus page c are kept. Pages outside the kept super-pages take order key 0 (below every score),
 * so keep[s] - 1 > the candidates (the caller sizes skeep to avoid it) fills with the lowest such
 * pages. skeep[s] >= the row's super-page count gives exactly select's selection.
 * Both backends compute every score in the CPU reference's order (fp32, no fused multiply-add),
 * so the selected pages are bitwise the same on CPU and CUDA.
 * Refs (maintenance, before any score): row s lists ref_n[s] entries at refs + s * max_ref *
 * (2 + N): {super-page index j, page count cnt, the cnt physical pages} (N slots); each
 * recomputes super-page j of slot rslot[s] (sdig + ((rslot * max_super + j) * n_kv_heads + g) *
 * 2 * head_dim) from those pages' digests. Rows that keep every page (keep[s] > c) read and
 * refresh nothing (one span [0, ctx)). scores (F32 [n][n_kv_heads][max_pages], may be NULL):
 * scratch the backend may use (CUDA's split form needs it: kvs_quest_cuda_super_path); after the
 * call each candidate page's entry holds its score and every other entry below c a NaN (the tests
 * compare them; entries from c on undefined). */
struct kvs_quest_super_args {
    const struct kvs_dbuf *q, *dig;          /* as score / qscore (bits 16: bf16 digests, else codes) */
    struct kvs_dbuf *sdig;                   /* F32 [slots][max_super][n_kv_heads][2][head_dim] */
    const struct kvs_attn_meta *m;
    const struct kvs_dbuf *keep, *skeep, *rslot, *refs, *ref_n;   /* I32 [n], [n], [n], above, [n] */
    int n, n_heads, n_kv_heads, head_dim, block_size, page_size, bits;
    size_t n_pages;
    int max_pages, max_spans, super_pages, max_super, max_ref;
    struct kvs_dbuf *scores, *n_spans, *spans;
};

struct kvs_quest_kernels {
    const char *name;
    /* Refreshes the digests of every page that the step's rows wrote: for each sequence s of m,
     * the pages holding positions pos[s] .. pos[s] + n_s - 1, each recomputed from its slots
     * 0 .. (the last position written in it) of kc. dig: one layer's digests. */
    void (*digest_update)(struct kvs_backend *b, const struct kvs_dbuf *kc, const struct kvs_attn_meta *m,
                          int n_kv_heads, int head_dim, int block_size, int page_size, struct kvs_dbuf *dig);
    /* Scores of the candidate pages of rows 0 .. n-1 (m's first n sequences); rows that keep
     * every page (keep[s] > c) are skipped. Sequence s is scored with the query of q's row
     * q_start[s + 1] - 1 (its last row: row s where each has one row; a Retro window's newest
     * row, read in place of a gather) at position pos[s]; the same for qscore and score_select. */
    void (*score)(struct kvs_backend *b, const struct kvs_dbuf *q, const struct kvs_dbuf *dig,
                  const struct kvs_attn_meta *m, const struct kvs_dbuf *keep, int n, int n_heads, int n_kv_heads, int head_dim, int block_size,
                  int page_size, int max_pages, struct kvs_dbuf *scores);
    /* Top-k of the scores and the spans of rows 0 .. n-1: n_spans I32 [n][n_kv_heads], spans I32
     * [n][n_kv_heads][max_spans][2] (backend.h kvs_span_list). */
    void (*select)(struct kvs_backend *b, const struct kvs_dbuf *scores, const struct kvs_attn_meta *m,
                   const struct kvs_dbuf *keep, int n, int n_kv_heads, int page_size, int max_pages, int max_spans,
                   struct kvs_dbuf *n_spans, struct kvs_dbuf *spans);
    /* digest_update and score on quantized digests (bits 8 or 4; qdig: one layer's
     * kvs_quest_qdig_words I32 words, over n_pages pages) */
    void (*qdigest_update)(struct kvs_backend *b, const struct kvs_dbuf *kc, const struct kvs_attn_meta *m,
                           int n_kv_heads, int head_dim, int block_size, int page_size, int bits, size_t n_pages,
                           struct kvs_dbuf *qdig);
    void (*qscore)(struct kvs_backend *b, const struct kvs_dbuf *q, const struct kvs_dbuf *qdig,
                   const struct kvs_attn_meta *m, const struct kvs_dbuf *keep, int n, int n_heads, int n_kv_heads,
                   int head_dim, int block_size, int page_size, int bits, size_t n_pages, int max_pages,
                   struct kvs_dbuf *scores);
    /* Optional (NULL: call score or qscore, then select). Scores and selection in one: the same
     * n_spans / spans as score (bits 16: dig holds bf16 digests) or qscore (bits 8 / 4: quantized,
     * n_pages) followed by select, since both paths compute each page's score with the same
     * code. scores: scratch where the backend takes the unfused path for the shape (it may);
     * want_scores != 0 also leaves the scores there on the fused path (the tests compare them).
     * wm (may be NULL): first the refresh of the pages wm's rows wrote, as digest_update (or
     * qdigest_update) of kc over wm, for a step whose only writes are the selecting rows': wm's
     * sequence s is row s of m (the same block tables), with no rows or rows that all lie in
     * row s's current page and end at m's pos[s] (one row for Quest; a Retro window's w rows
     * when they share that page), and wm has n sequences. The refreshed page of a row is its current page, never a candidate,
     * so the refresh may run alongside the scores. */
    void (*score_select)(struct kvs_backend *b, const struct kvs_dbuf *q, const struct kvs_dbuf *dig,
                         const struct kvs_attn_meta *m, const struct kvs_dbuf *keep, int n, int n_heads,
                         int n_kv_heads, int head_dim, int block_size, int page_size, int bits, size_t n_pages,
                         int max_pages, int max_spans, struct kvs_dbuf *scores, int want_scores,
                         struct kvs_dbuf *n_spans, struct kvs_dbuf *spans, const struct kvs_dbuf *kc,
                         const struct kvs_attn_meta *wm);
    /* Two-level selection (kv.quest.super_pages; kvs_quest_super_args below): first the super-page
     * digests the step's refs name are recomputed from the page digests, then, for rows 0 .. n-1,
     * the super-pages are scored, the top ones kept, their pages scored and the top keep - 1 of
     * those plus the current page become spans, as select does. */
    void (*super_select)(struct kvs_backend *b, const struct kvs_quest_super_args *a);
};

/* ---- quantized digests: sizes and the coding shared by both backends ---- */

/* kv.quest.digest_bits when no config says otherwise (engine/config.c's default too): 8-bit
 * codes read half of bf16 digests' bytes per step at the same fidelity (bench/RESULTS.md, quest4
 * and quest5); 4 bits cost SmolLM2 clearly. */
#define KVS_QUEST_DIGEST_BITS_DEFAULT 8

#ifdef __CUDACC__
#define KVS_QD_FN static __host__ __device__ __forceinline__
#else
#define KVS_QD_FN static inline
#endif

#define KVS_QD_UNBOUNDED 0x7C00FC00u   /* lo = -inf, scale = +inf: the page scores +inf */

/* words of one (page, KV head)'s min (or max) code vector; of a layer's buffer */
KVS_QD_FN size_t kvs_quest_qdig_vec_words(int head_dim, int bits) { return (size_t)head_dim * (size_t)bits / 32; }
KVS_QD_FN size_t kvs_quest_qdig_words(size_t n_pages, int n_kv_heads, int head_dim, int bits)
{
    return n_pages * (size_t)n_kv_heads * (2 * kvs_quest_qdig_vec_words(head_dim, bits) + 1);
}

KVS_QD_FN float kvs_qd_f16_to_f32(uint32_t h)
{
    const uint32_t s = (h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    if (e == 0) {   /* zero or subnormal: m x 2^-24, exact */
        const float f = (float)m * 5.9604644775390625e-8f;
        return s ? -f : f;
    }
    const uint32_t u = s | (e == 31 ? 0x7F800000u | (m << 13) : ((e + 112) << 23) | (m << 13));
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* fp16 bits of x rounded toward zero (beyond 65504: 65504; inf and NaN kept) */
KVS_QD_FN uint32_t kvs_qd_f16_rz(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    const uint32_t s = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu, e = a >> 23;
    if (a > 0x7F800000u) return s | 0x7E00u;
    if (a == 0x7F800000u) return s | 0x7C00u;
    if (a >= 0x47800000u) return s | 0x7BFFu;
    if (e >= 113) return s | ((e - 112) << 10) | ((a >> 13) & 0x3FFu);
    if (e <= 102) return s;
    return s | (((a & 0x7FFFFFu) | 0x800000u) >> (126 - e));
}

/* fp16 bits of x rounded down / up (toward -inf / +inf) */
KVS_QD_FN uint32_t kvs_qd_f16_down(float x)
{
    const uint32_t h = kvs_qd_f16_rz(x);
    return x < 0 && kvs_qd_f16_to_f32(h) != x ? h + 1 : h;
}
KVS_QD_FN uint32_t kvs_qd_f16_up(float x)
{
    const uint32_t h = kvs_qd_f16_rz(x);
    return x > 0 && kvs_qd_f16_to_f32(h) != x ? h + 1 : h;
}

/* the decoded value of code c */
KVS_QD_FN float kvs_qd_value(uint32_t c, float lo, float scale) { return fmaf((float)c, scale, lo); }

/* the params word of a page whose smallest kmin is lo and largest kmax is hi */
KVS_QD_FN uint32_t kvs_qd_params(float lo, float hi, int levels)
{
    if (!(lo >= -65504.0f && hi <= 65504.0f && lo <= hi)) return KVS_QD_UNBOUNDED;
    lo = lo + 0.0f;   /* -0 as +0: both backends' reductions may pick either zero */
    const uint32_t l16 = kvs_qd_f16_down(lo);
    const float l = kvs_qd_f16_to_f32(l16);
    uint32_t s16 = kvs_qd_f16_up((hi - l) / (float)levels);
    while (s16 < 0x7C00u && kvs_qd_value((uint32_t)levels, l, kvs_qd_f16_to_f32(s16)) < hi) s16++;
    return s16 >= 0x7C00u ? KVS_QD_UNBOUNDED : l16 | s16 << 16;
}

/* the largest code whose value is <= x (the smallest whose value is >= x), for lo <= x <= the
 * page's hi; scale 0 means every value of the page is lo */
KVS_QD_FN uint32_t kvs_qd_code_down(float x, float lo, float scale, int levels)
{
    if (!(scale > 0)) return 0;
    const float t = floorf((x - lo) / scale);
    uint32_t c = t <= 0 ? 0u : t >= (float)levels ? (uint32_t)levels : (uint32_t)t;
    while (c > 0 && kvs_qd_value(c, lo, scale) > x) c--;
    return c;
}
KVS_QD_FN uint32_t kvs_qd_code_up(float x, float lo, float scale, int levels)
{
    if (!(scale > 0)) return 0;
    const float t = ceilf((x - lo) / scale);
    uint32_t c = t <= 0 ? 0u : t >= (float)levels ? (uint32_t)levels : (uint32_t)t;
    while (c < (uint32_t)levels && kvs_qd_value(c, lo, scale) < x) c++;
    return c;
}

/* codes (vec_words each) and the returned params word of one (page, KV head) whose exact
 * element-wise min and max are mn, mx [hd] (the host's encoder: the CPU kernel and checks) */
KVS_QD_FN uint32_t kvs_qd_encode(const float *mn, const float *mx, int hd, int bits, uint32_t *cmin, uint32_t *cmax)
{
    const int levels = (1 << bits) - 1, per = 32 / bits;
    float lo = mn[0], hi = mx[0];
    for (int i = 1; i < hd; i++) {
        lo = mn[i] < lo ? mn[i] : lo;
        hi = mx[i] > hi ? mx[i] : hi;
    }
    const uint32_t par = kvs_qd_params(lo, hi, levels);
    const float l = kvs_qd_f16_to_f32(par & 0xFFFFu), sc = kvs_qd_f16_to_f32(par >> 16);
    for (int w = 0; w < hd / per; w++) cmin[w] = cmax[w] = 0;
    if (par != KVS_QD_UNBOUNDED)
        for (int i = 0; i < hd; i++) {
            cmin[i / per] |= kvs_qd_code_down(mn[i], l, sc, levels) << (i % per * bits);
            cmax[i / per] |= kvs_qd_code_up(mx[i], l, sc, levels) << (i % per * bits);
        }
    return par;
}

/* The total order of scores that selection uses: the float's bits mapped so that unsigned
 * comparison orders them as numbers (-0 just below +0; NaN, which scores never are, above +inf
 * or below -inf by sign). */
static inline uint32_t kvs_quest_order_key(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/* The CPU reference (always built) and the CUDA kernels (KVS_HAVE_CUDA builds). */
extern const struct kvs_quest_kernels kvs_quest_kernels_cpu;
extern const struct kvs_quest_kernels kvs_quest_kernels_cuda;

/* CUDA builds only (kernels/cuda/kv_quest.cu), for the benchmark's sweep (kvserve-questbench
 * --score-shapes): the score kernels' pages per block, fixed (pages_per_block > 0, rounded up to
 * a multiple of 64) or sized for blocks_per_sm blocks per SM (pages_per_block 0; blocks_per_sm
 * <= 0: the default). Process-wide; the daemon never calls it. */
void kvs_quest_cuda_score_shape(int pages_per_block, int blocks_per_sm);

/* CUDA builds only: which path score_select takes: 0 by shape (the default: today always score
 * then select, with a refresh passed in as a slice of the score launch; the fused kernel lost the
 * A/B, bench/RESULTS.md quest7), 1 never fused (score then select), 2 fused wherever it fits (head_dim 64 / 128 / 256 and the keys in shared memory), 3 as 2
 * with 512-thread blocks at every shape (2 takes 1024 where the pairs are fewer than SMs). For
 * the benchmark's A/B and the tests; process-wide; the daemon never calls it. */
void kvs_quest_cuda_select_path(int mode);

/* CUDA builds only: nonzero makes the Quest kernels load a page's key slots, the group's queries
 * and the select's keys one dependent load at a time, as before the batched loads (same bits
 * either way); 0, the default, issues them several at a time. Also set, once, by
 * KVS_QUEST_SERIAL_LOADS=1 in the environment. For the benches' A/B in one run; process-wide,
 * the current device only; the daemon never calls it. */
void kvs_quest_cuda_serial_loads(int on);

/* CUDA builds only: the select kernel's threads a (row, KV head): 256 or 1024 at every shape, 0
 * (the default) by shape. For the benches' A/B and the tests; process-wide. */
void kvs_quest_cuda_select_threads(int threads);

/* CUDA builds only: the two-level selection's form. 1: one block a (row, KV head) does every
 * phase (k_quest_ssel); 2: split into three launches, the super-pages by one block a (row, KV
 * head), the candidates' page scores over the score kernels' grid, then select's launch (needs
 * the caller's scores scratch; without it, form 1); 0, the default: 2 where the (row, KV head)
 * pairs are at most an eighth of the SMs and scores are given, else 1. Both give the same spans
 * bitwise. Also set, once, by KVS_QUEST_SUPER_PATH=1 / 2 in the environment. For the benches' A/B
 * and the tests; process-wide. */
void kvs_quest_cuda_super_path(int mode);

/* The table for backend o, or NULL with a message (-ENOSYS). */
const struct kvs_quest_kernels *kvs_quest_kernels_for(const struct kvs_backend_ops *o, char *err, size_t errlen);

#ifdef __cplusplus
}
#endif

#endif
