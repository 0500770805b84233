/* kv_retro.c: the CPU reference of Retro's page mask and supplements, and the CPU table of its
 * device form (kernels/kv_retro.h). */
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

/* ---- the CPU table (kernels/kv_retro.h struct kvs_retro_kernels) ------------------------------ */

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/util.h"
#include "kernels/cpu/cpu_internal.h"

static void cpu_retro_reset(struct kvs_backend *b, struct kvs_dbuf *A, size_t off, size_t n)
{
    (void)b;
    KVS_ASSERT(off + n <= A->n);
    int32_t *a = (int32_t *)A->data + off;
    for (size_t i = 0; i < n; i++) a[i] = -1;
}

static void cpu_retro_spans(struct kvs_backend *b, const struct kvs_dbuf *sel_n, const struct kvs_dbuf *sel,
                            const struct kvs_dbuf *req, int n_req, int n_kv_heads, int max_spans, int page_size,
                            struct kvs_dbuf *A, int a_layers, int a_layer, int max_pages, struct kvs_dbuf *n_spans,
                            struct kvs_dbuf *spans, struct kvs_dbuf *keys, struct kvs_dbuf *m_out)
{
    (void)b;
    const int32_t *sn = sel_n->data, *sp = sel->data, *rq = req->data;
    int32_t *ns = n_spans->data, *out = spans->data, *a = A->data;
    int32_t *pages = kvs_xmalloc((size_t)max_pages * sizeof *pages), *m = kvs_xmalloc((size_t)max_pages * sizeof *m);
    uint64_t k[2];
    memcpy(k, keys->data, sizeof k);
    const size_t ms2 = (size_t)max_spans * 2;
    for (int q = 0; q < n_req; q++) {
        const int row0 = rq[5 * q], rows = rq[5 * q + 1], pos = rq[5 * q + 2], t = rq[5 * q + 3], slot = rq[5 * q + 4];
        for (int g = 0; g < n_kv_heads; g++) {
            const int32_t *s = sp + ((size_t)q * n_kv_heads + g) * ms2;
            const int nsel = sn[q * n_kv_heads + g];
            int np = 0;
            for (int i = 0; i < nsel; i++) {
                for (int p = s[2 * i] / page_size; p * page_size < s[2 * i + 1]; p++) pages[np++] = p;
                k[0] += (uint64_t)(s[2 * i + 1] - s[2 * i]);
            }
            int32_t *ag = a + (((size_t)slot * a_layers + a_layer) * n_kv_heads + g) * max_pages;
            const int rc = kvs_retro_mask_step(ag, max_pages, pages, np, pos / page_size, t, m);
            KVS_ASSERT(rc == 0);
            if (m_out) {
                int32_t *mo = (int32_t *)m_out->data + ((size_t)q * n_kv_heads + g) * max_pages;
                for (int i = 0; i < np; i++) mo[pages[i]] = m[i];
            }
            const size_t tn = (size_t)(row0 + rows - 1) * n_kv_heads + g;
            ns[tn] = nsel;
            memcpy(out + tn * ms2, s, (size_t)nsel * 2 * sizeof(int32_t));
            for (int j = 0; j < rows - 1; j++) {
                const int back = rows - 1 - j;
                const size_t tp = (size_t)(row0 + j) * n_kv_heads + g;
                const int n = kvs_retro_supplement(pages, m, np, t - back, pos - back, page_size, out + tp * ms2,
                                                   max_spans);
                KVS_ASSERT(n >= 0);
                ns[tp] = n;
                for (int i = 0; i < n; i++) k[1] += (uint64_t)(out[tp * ms2 + 2 * i + 1] - out[tp * ms2 + 2 * i]);
            }
        }
    }
    memcpy(keys->data, k, sizeof k);
    free(pages);
    free(m);
}

/* backend.h attn_merge's CPU arithmetic (cpu_attn_span.c), so that the table's path gives the
 * host path's results bitwise; rows without a cached entry stay as they are (what a merge with
 * lse -inf leaves, bitwise) */
static void cpu_retro_merge(struct kvs_backend *b, struct kvs_dbuf *out, struct kvs_dbuf *lse,
                            const struct kvs_dbuf *cidx, int n, int n_heads, int head_dim, const struct kvs_dbuf *o_prev,
                            const struct kvs_dbuf *l_prev, int prev_rows, struct kvs_dbuf *o_next,
                            struct kvs_dbuf *l_next)
{
    (void)b;
    const int32_t *ci = cidx->data;
    float *o = out->data, *l = lse->data, *on = o_next->data, *ln = l_next->data;
    const float *op = o_prev->data, *lp = l_prev->data;
    const size_t qd = (size_t)n_heads * head_dim;
    for (int t = 0; t < n; t++) {
        for (int h = 0; h < n_heads && ci[t] >= 0 && ci[t] < prev_rows; h++) {
            float *oa = o + t * qd + (size_t)h * head_dim;
            const float *ob = op + (size_t)ci[t] * qd + (size_t)h * head_dim;
            const float la = l[(size_t)t * n_heads + h], lb = lp[(size_t)ci[t] * n_heads + h];
            if (la == -INFINITY && lb == -INFINITY) {
                for (int i = 0; i < head_dim; i++) oa[i] = 0.0f;
                continue;
            }
            const float mx = la > lb ? la : lb;
            const float ea = expf(la - mx), eb = expf(lb - mx), inv = 1.0f / (ea + eb);
            const float wa = ea * inv, wb = eb * inv;
            for (int i = 0; i < head_dim; i++) oa[i] = wa * oa[i] + wb * ob[i];
            l[(size_t)t * n_heads + h] = mx + logf(ea + eb);
        }
        memcpy(on + t * qd, o + t * qd, qd * sizeof(float));
        memcpy(ln + (size_t)t * n_heads, l + (size_t)t * n_heads, (size_t)n_heads * sizeof(float));
    }
}

/* no fused attend, so no step: the policy runs spans, attention_spans and merge on the CPU */
const struct kvs_retro_kernels kvs_retro_kernels_cpu = {"cpu", cpu_retro_reset, cpu_retro_spans, NULL,
                                                          cpu_retro_merge, NULL};
