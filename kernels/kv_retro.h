/* kv_retro.h: the CPU reference of RetroAttention's window bookkeeping (STRATEGIES.md §4), the
 * piece of kv.decode=retro (engine/kv/kv_decode_retro.c) that decides what a past query of the
 * window is supplemented with. The policy's host path (the CPU backend) runs it on the host after
 * downloading the step's selection; its device path runs the table below. What is here is also tested on its own (tests/unit/test_kv_retro.c):
 * over a sequence of page selections, supplements merged with attn_merge give every past query
 * exactly the attention over the union of the pages it was shown, never a key after it.
 *
 * Per (request, layer, KV head) Retro keeps A[page] = the last step that loaded the page (-1:
 * never). Step t (the decode step of the query at position pos_t) with the selection S_t (pages,
 * ascending, the current page among them):
 *   A[p_cur] = t - 1; for p in S_t: M[p] = A[p], A[p] = t            (kvs_retro_mask_step)
 * and a past query t' of the window (t - w < t' < t) is supplemented with the pages p of S_t
 * with M[p] < t' (not loaded since t' existed, so not seen by it), as spans clipped to positions
 * <= pos_t' (causal; kvs_retro_supplement). The paper's M is per page of S_t: here it is returned
 * in the order of S_t.
 *
 * Ownership: every array is the caller's. Errors: 0 / -EINVAL (a page out of range, S_t not
 * ascending) / -ENOSPC (more spans than max_spans).
 */
#ifndef KVS_KV_RETRO_H
#define KVS_KV_RETRO_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Updates A (n_pages entries) for step t with selection sel[0..n_sel) (ascending page indexes)
 * whose current page is cur; m_out[i] = A[sel[i]] before the update. */
int kvs_retro_mask_step(int32_t *A, int n_pages, const int32_t *sel, int n_sel, int cur, int t, int32_t *m_out);

/* The spans ([start, end) positions, ascending, adjacent pages merged) of the pages of sel with
 * m[i] < t_past, clipped to positions <= pos_past; returns how many (0: nothing to add). */
int kvs_retro_supplement(const int32_t *sel, const int32_t *m, int n_sel, int t_past, int pos_past, int page_size,
                         int32_t *spans, int max_spans);

/* The device form of the same bookkeeping (kv.decode=retro on a backend with a table: the step
 * issues only device work, no host round trip), one table per backend: the CPU one
 * (kernels/cpu/kv_retro.c, built on the two functions above; the policy runs it on the CPU only
 * when told to, kv_decode_retro.h) and the CUDA one (kernels/cuda/kv_retro.cu).
 *
 * Masks on the device: A I32 [slots][a_layers][n_kv_heads][max_pages], the values of the CPU
 * reference (-1: never loaded).
 * Requests: req I32 [n_req][5] = row0 (the request's first row in the step), rows (k + 1: the
 * window), pos (the newest row's position), t (its step index), slot.
 * Selection: sel_n / sel as Quest's select writes them for row q of n_req one-row sequences
 * (kernels/kv_quest.h: ascending disjoint spans, page-aligned but for the last one ending at
 * pos + 1, the current page among them). */
struct kvs_retro_kernels {
    const char *name;
    /* A[i] = -1 for i in [off, off + n) (a request slot's masks, at seq_init). */
    void (*reset)(struct kvs_backend *b, struct kvs_dbuf *A, size_t off, size_t n);
    /* For each request q and KV head g: kvs_retro_mask_step on A[slot][a_layer][g] with the pages
     * of the selection, the newest row (row0 + rows - 1) gets the selection's spans, past row
     * row0 + j (back = rows - 1 - j) gets kvs_retro_supplement(t - back, pos - back) (at most
     * max_spans spans). keys I32 [4], read as two little-endian uint64: += the selection's keys
     * (own) and the supplements' keys (supplement), for the policy's counters. m_out (or NULL):
     * I32 [n_req][n_kv_heads][max_pages], m_out[q][g][p] = M of selected page p (A before the
     * step; other entries untouched), what attend reads. */
    void (*spans)(struct kvs_backend *b, const struct kvs_dbuf *sel_n, const struct kvs_dbuf *sel,
                  const struct kvs_dbuf *req, int n_req, int n_kv_heads, int max_spans, int page_size,
                  struct kvs_dbuf *A, int a_layers, int a_layer, int max_pages, struct kvs_dbuf *n_spans,
                  struct kvs_dbuf *spans, struct kvs_dbuf *keys, struct kvs_dbuf *m_out);
    /* The fused attention (the paper's kernel; NULL or -ENOSYS for a shape it does not take: the
     * caller then runs attention_spans over the spans above): the step's first n_req sequences of
     * m (request q = sequence q, its rows the window, the newest last), each selected page read
     * once for all of them: the newest row attends its selection; past row j (back = rows - 1 -
     * j, step t - back, position pos - back) the selected keys of pages with m_out < t - back at
     * positions <= pos - back (its supplement). out / lse as attention_spans writes them (no key:
     * 0 and -inf). max_keys: an upper bound of any request's selected keys (launch planning). */
    int (*attend)(struct kvs_backend *b, const struct kvs_dbuf *q, const struct kvs_dbuf *kc,
                  const struct kvs_dbuf *vc, const struct kvs_attn_meta *m, const struct kvs_dbuf *sel_n,
                  const struct kvs_dbuf *sel, int max_spans, const struct kvs_dbuf *req, const struct kvs_dbuf *m_sel,
                  int max_pages, int page_size, int n_req, int n_heads, int n_kv_heads, int head_dim,
                  int block_size, float scale, long long max_keys, struct kvs_dbuf *out, struct kvs_dbuf *lse);
    /* Retro's merge and output cache, rows 0 .. n-1: row t with cidx[t] < prev_rows is merged
     * (backend.h attn_merge) with the cached (o_prev, l_prev)[cidx[t]] in place in (out, lse);
     * then (o_next, l_next)[t] = (out, lse)[t]. o: ACT [rows][n_heads * head_dim]; l: F32
     * [rows][n_heads]. o_prev / l_prev and o_next / l_next are distinct buffers. */
    void (*merge)(struct kvs_backend *b, struct kvs_dbuf *out, struct kvs_dbuf *lse, const struct kvs_dbuf *cidx,
                  int n, int n_heads, int head_dim, const struct kvs_dbuf *o_prev, const struct kvs_dbuf *l_prev,
                  int prev_rows, struct kvs_dbuf *o_next, struct kvs_dbuf *l_next);
    /* Optional (NULL; or -ENOSYS, before any work, for a shape attend does not take: the caller
     * then runs spans, attend and merge): a selecting layer's whole device step in fewer launches,
     * with the results of spans (A, m_out, keys; n_spans / spans are not written: attend reads the
     * selection and m_out), then attend (its arguments), then merge (cidx .. l_next) into out /
     * lse. On CUDA the mask step rides the attend's walk where one block reads each selected page
     * (else a mask kernel without the lists' scans runs first), and where attend splits the keys
     * the splits' merge and the cache merge are one kernel. m_out is required. */
    int (*step)(struct kvs_backend *b, const struct kvs_dbuf *q, const struct kvs_dbuf *kc, const struct kvs_dbuf *vc,
                const struct kvs_attn_meta *m, const struct kvs_dbuf *sel_n, const struct kvs_dbuf *sel, int max_spans,
                const struct kvs_dbuf *req, struct kvs_dbuf *A, int a_layers, int a_layer, struct kvs_dbuf *m_out,
                struct kvs_dbuf *keys, int max_pages, int page_size, int n_req, int n_heads, int n_kv_heads,
                int head_dim, int block_size, float scale, long long max_keys, const struct kvs_dbuf *cidx,
                const struct kvs_dbuf *o_prev, const struct kvs_dbuf *l_prev, int prev_rows, struct kvs_dbuf *o_next,
                struct kvs_dbuf *l_next, struct kvs_dbuf *out, struct kvs_dbuf *lse);
};

extern const struct kvs_retro_kernels kvs_retro_kernels_cpu;
extern const struct kvs_retro_kernels kvs_retro_kernels_cuda;

/* The table of backend o (NULL where it has none: the policy then keeps the host path). */
const struct kvs_retro_kernels *kvs_retro_kernels_for(const struct kvs_backend_ops *o);

#ifdef __cplusplus
}
#endif

#endif
