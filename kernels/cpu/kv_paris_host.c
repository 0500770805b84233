/* kv_paris_host.c: the CPU reference of ParisKV's host offload ops (kernels/kv_paris.h: host
 * pages, write_out, gather). On the CPU the host pages and the KV pool are the same kind of
 * memory, so these are plain copies; they exist so that the policy's bookkeeping (which page
 * holds which positions, what the staging area holds) runs and is tested on every backend, and
 * so that the CUDA gather (kernels/cuda/kv_paris_host.cu) has a reference: an index-select.
 */
#include "kernels/kv_paris.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "base/util.h"
#include "kernels/cpu/cpu_internal.h"
#include "kernels/cpu/kv_paris_host.h"

void *kvs_paris_cpu_host_alloc(struct kvs_backend *b, size_t bytes, char *err, size_t errlen)
{
    (void)b;
    void *p = bytes ? calloc(1, bytes) : NULL;
    if (!p) kvs_err(err, errlen, -ENOMEM, "kv.paris.offload: no host memory for %zu bytes of pages", bytes);
    return p;
}

void kvs_paris_cpu_host_free(struct kvs_backend *b, void *p)
{
    (void)b;
    free(p);
}

/* element offset of (page, layer, head, offset) in the host pages */
static inline size_t host_at(int page, int layer, int n_layers, int g, int nkv, int off, int bs, int d)
{
    return ((((size_t)page * n_layers + layer) * nkv + g) * bs + off) * (size_t)d;
}

void kvs_paris_cpu_write_out(struct kvs_backend *b, const struct kvs_dbuf *kc, const struct kvs_dbuf *vc,
                             const struct kvs_attn_meta *m, const struct kvs_dbuf *jobs, const int32_t *h_jobs,
                             int n_jobs, int layer, int n_layers, int n_kv_heads, int head_dim, int block_size,
                             const struct kvs_dbuf *pages, int page_stride, void *host_k, void *host_v)
{
    (void)b, (void)jobs;
    const int d = head_dim, bs = block_size, nkv = n_kv_heads;
    const float *k = F(kc), *v = F(vc);
    const int32_t *bts = I(m->block_tables), *pg = I(pages);
    float *hk = host_k, *hv = host_v;
    for (int j = 0; j < n_jobs; j++) {
        const int32_t *J = h_jobs + (size_t)j * KVS_PARIS_JOB_N;
        const int32_t *bt = bts + (size_t)J[KVS_PARIS_JOB_SEQ] * m->max_blocks;
        const int32_t *pt = pg + (size_t)J[KVS_PARIS_JOB_SLOT] * page_stride;
        for (int p = J[KVS_PARIS_JOB_FROM]; p < J[KVS_PARIS_JOB_TO]; p++) {
            const int page = pt[p / bs];
            if (page < 0) continue;
            for (int g = 0; g < nkv; g++) {
                const size_t src = (((size_t)bt[p / bs] * nkv + g) * bs + p % bs) * d;
                const size_t dst = host_at(page, layer, n_layers, g, nkv, p % bs, bs, d);
                memcpy(hk + dst, k + src, (size_t)d * sizeof *hk);
                memcpy(hv + dst, v + src, (size_t)d * sizeof *hv);
            }
        }
    }
}

void kvs_paris_cpu_gather(struct kvs_backend *b, const struct kvs_dbuf *kc, const struct kvs_dbuf *vc,
                          const struct kvs_attn_meta *m, const struct kvs_dbuf *rows, const int32_t *h_rows, int n,
                          int layer, int n_layers, int n_kv_heads, int head_dim, int block_size,
                          const struct kvs_dbuf *n_spans, const struct kvs_dbuf *spans, int max_spans,
                          const struct kvs_dbuf *pages, int page_stride, const void *host_k, const void *host_v,
                          struct kvs_dbuf *stage_k, struct kvs_dbuf *stage_v, int stage_blocks)
{
    (void)b, (void)rows;
    const int d = head_dim, bs = block_size, nkv = n_kv_heads;
    const float *k = F(kc), *v = F(vc), *hk = host_k, *hv = host_v;
    const int32_t *bts = I(m->block_tables), *pg = I(pages), *ns = I(n_spans), *sp = I(spans);
    float *sk = F(stage_k), *sv = F(stage_v);
    for (int r = 0; r < n; r++) {
        const int32_t *R = h_rows + (size_t)r * KVS_PARIS_ROW_N;
        const int sink = R[KVS_PARIS_ROW_SINK], n_r = R[KVS_PARIS_ROW_NR], ctx = R[KVS_PARIS_ROW_CTX];
        const int32_t *bt = bts + (size_t)r * m->max_blocks;
        const int32_t *pt = pg + (size_t)R[KVS_PARIS_ROW_SLOT] * page_stride;
        for (int g = 0; g < nkv; g++) {
            const size_t sl = (size_t)r * nkv + g;
            const int32_t *s = sp + sl * max_spans * 2;
            int at = 0;
            for (int i = 0; i < ns[sl]; i++)
                for (int p = s[2 * i]; p < s[2 * i + 1] && p < ctx; p++, at++) {
                    const int page = p >= sink && p < sink + n_r ? pt[p / bs] : -1;
                    const float *ks, *vs;
                    if (page >= 0) {
                        const size_t h = host_at(page, layer, n_layers, g, nkv, p % bs, bs, d);
                        ks = hk + h, vs = hv + h;
                    } else {
                        const size_t o = (((size_t)bt[p / bs] * nkv + g) * bs + p % bs) * d;
                        ks = k + o, vs = v + o;
                    }
                    KVS_ASSERT(at < stage_blocks * bs);
                    const size_t dst = ((((size_t)r * stage_blocks + at / bs) * nkv + g) * bs + at % bs) * d;
                    memcpy(sk + dst, ks, (size_t)d * sizeof *sk);
                    memcpy(sv + dst, vs, (size_t)d * sizeof *sv);
                }
        }
    }
}

/* kernels/kv_paris.h host_view: on the CPU a KV buffer is fp32 memory, so the view is a pointer */
struct kvs_dbuf *kvs_paris_cpu_host_view(struct kvs_backend *b, void *host, size_t off, size_t n)
{
    (void)b;
    struct kvs_dbuf *v = kvs_xcalloc(1, sizeof *v);
    v->kind = KVS_BUF_KV;
    v->n = n;
    v->data = (float *)host + off;
    return v;
}

void kvs_paris_cpu_host_view_free(struct kvs_backend *b, struct kvs_dbuf *view)
{
    (void)b;
    free(view);
}
