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
 * Ownership: the tables are static; the buffers are the caller's. Errors: ops return void (bad
 * arguments are bugs); kvs_quest_kernels_for returns NULL with a message (-ENOSYS: the backend
 * has no Quest kernels).
 */
#ifndef KVS_KV_QUEST_H
#define KVS_KV_QUEST_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kernels/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

struct kvs_quest_kernels {
    const char *name;
    /* Refreshes the digests of every page that the step's rows wrote: for each sequence s of m,
     * the pages holding positions pos[s] .. pos[s] + n_s - 1, each recomputed from its slots
     * 0 .. (the last position written in it) of kc. dig: one layer's digests. */
    void (*digest_update)(struct kvs_backend *b, const struct kvs_dbuf *kc, const struct kvs_attn_meta *m,
                          int n_kv_heads, int head_dim, int block_size, int page_size, struct kvs_dbuf *dig);
    /* Scores of the candidate pages of rows 0 .. n-1 (m's first n sequences, one row each); rows
     * that keep every page (keep[s] > c) are skipped. */
    void (*score)(struct kvs_backend *b, const struct kvs_dbuf *q, const struct kvs_dbuf *dig,
                  const struct kvs_attn_meta *m, const struct kvs_dbuf *keep, int n, int n_heads, int n_kv_heads, int head_dim, int block_size,
                  int page_size, int max_pages, struct kvs_dbuf *scores);
    /* Top-k of the scores and the spans of rows 0 .. n-1: n_spans I32 [n][n_kv_heads], spans I32
     * [n][n_kv_heads][max_spans][2] (backend.h kvs_span_list). */
    void (*select)(struct kvs_backend *b, const struct kvs_dbuf *scores, const struct kvs_attn_meta *m,
                   const struct kvs_dbuf *keep, int n, int n_kv_heads, int page_size, int max_pages, int max_spans,
                   struct kvs_dbuf *n_spans, struct kvs_dbuf *spans);
};

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

/* The table for backend o, or NULL with a message (-ENOSYS). */
const struct kvs_quest_kernels *kvs_quest_kernels_for(const struct kvs_backend_ops *o, char *err, size_t errlen);

#ifdef __cplusplus
}
#endif

#endif
