/* kv_retro.h: the CPU reference of RetroAttention's window bookkeeping (STRATEGIES.md §4), the
 * piece of kv.decode=retro (engine/kv/kv_decode_retro.c) that decides what a past query of the
 * window is supplemented with. The policy runs it on the host after downloading the step's
 * selection (any backend: the supplements' attention and merge are the backend's
 * attention_spans and attn_merge). What is here is also tested on its own (tests/unit/test_kv_retro.c):
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

#include <stdint.h>

/* Updates A (n_pages entries) for step t with selection sel[0..n_sel) (ascending page indexes)
 * whose current page is cur; m_out[i] = A[sel[i]] before the update. */
int kvs_retro_mask_step(int32_t *A, int n_pages, const int32_t *sel, int n_sel, int cur, int t, int32_t *m_out);

/* The spans ([start, end) positions, ascending, adjacent pages merged) of the pages of sel with
 * m[i] < t_past, clipped to positions <= pos_past; returns how many (0: nothing to add). */
int kvs_retro_supplement(const int32_t *sel, const int32_t *m, int n_sel, int t_past, int pos_past, int page_size,
                         int32_t *spans, int max_spans);

#endif
