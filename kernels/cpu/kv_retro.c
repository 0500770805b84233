/* kv_retro.c: the CPU reference of Retro's page mask and supplements (kernels/kv_retro.h). */
#include "kernels/kv_retro.h"

#include <errno.h>

int kvs_retro_mask_step(int32_t *A, int n_pages, const int32_t *sel, int n_sel, int cur, int t, int32_t *m_out)
{
    if (cur < 0 || cur >= n_pages) return -EINVAL;
    for (int i = 0; i < n_sel; i++)
        if (sel[i] < 0 || sel[i] >= n_pages || (i > 0 && sel[i] <= sel[i - 1])) return -EINVAL;
    /* the current page was loaded by the previous step's query (always kept), so no past query
     * needs it again: what it holds past them is causally out of their reach */
    A[cur] = t - 1;
    for (int i = 0; i < n_sel; i++) {
        m_out[i] = A[sel[i]];
        A[sel[i]] = t;
    }
    return 0;
}

int kvs_retro_supplement(const int32_t *sel, const int32_t *m, int n_sel, int t_past, int pos_past, int page_size,
                         int32_t *spans, int max_spans)
{
    int n = 0;
    for (int i = 0; i < n_sel; i++) {
        if (m[i] >= t_past) continue;   /* loaded at a step the past query took part in */
        const int lo = sel[i] * page_size;
        if (lo > pos_past) break;       /* ascending: every later page is past it too */
        int hi = lo + page_size;
        if (hi > pos_past + 1) hi = pos_past + 1;
        if (n > 0 && spans[2 * n - 1] == lo) {
            spans[2 * n - 1] = hi;
            continue;
        }
        if (n == max_spans) return -ENOSPC;
        spans[2 * n] = lo, spans[2 * n + 1] = hi;
        n++;
    }
    return n;
}
