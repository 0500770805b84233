/* kv_paris_fixture.h: ParisKV's kernel test cases (kernels/kv_paris.h), shared by the CPU test
 * (test_kv_paris.c) and the CUDA test (tests/gpu/test_cuda_kv_paris.c): a paged K pool with
 * shuffled block tables, random keys with optional planted needles, one selection row per
 * sequence; pool_run encodes the retrieval zones and selects on any backend's kernels and
 * downloads everything. Header-only (static); the random state is the includer's pf_rng. */
#ifndef KVS_TEST_KV_PARIS_FIXTURE_H
#define KVS_TEST_KV_PARIS_FIXTURE_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "base/half.h"
#include "base/util.h"
#include "kernels/backend.h"
#include "kernels/kv_paris.h"
#include "tests/unit/test_util.h"

static uint64_t pf_rng = 0xBADC0FFEEull;

static double gauss(void)
{
    /* kvs_test_xorshift draws 32 bits */
    const double u = ((double)kvs_test_xorshift(&pf_rng) + 0.5) / 4294967296.0;
    const double v = ((double)kvs_test_xorshift(&pf_rng) + 0.5) / 4294967296.0;
    return sqrt(-2 * log(u)) * cos(6.283185307179586 * v);
}

/* ---- 1. one vector -------------------------------------------------------------------------- */



struct pool_case {
    int S, nh, nkv, d, bs, sink, tail, max_blocks, n_blocks;
    int ctx[8], n_r[8];
    float *k, *q;                 /* K pool [blocks][nkv][bs][d], q [S][nh][d] */
    int32_t *bt;
};

/* S (<= 8) sequences of about ctx positions, nh query heads over nkv KV heads of head_dim d;
 * needles > 0: that many keys per (seq, KV head) planted along the group's mean query with
 * growing strength; bf16: keys rounded to bf16 (what a CUDA pool holds), so that a CPU run sees
 * the same keys */
static void pool_make(struct pool_case *c, int S, int ctx, int needles, int nh, int nkv, int d, int bf16)
{
    memset(c, 0, sizeof *c);
    c->S = S, c->nh = nh, c->nkv = nkv, c->d = d, c->bs = 16, c->sink = 4, c->tail = 164;
    int nb = 0;
    for (int s = 0; s < S; s++) {
        c->ctx[s] = ctx + s * 37;
        c->n_r[s] = c->ctx[s] - c->sink - c->tail;
        const int b = (c->ctx[s] + c->bs - 1) / c->bs;
        nb += b;
        if (b > c->max_blocks) c->max_blocks = b;
    }
    c->n_blocks = nb;
    const size_t kn = (size_t)nb * c->nkv * c->bs * c->d;
    c->k = kvs_xmalloc(kn * sizeof *c->k);
    for (size_t i = 0; i < kn; i++) c->k[i] = (float)gauss();
    c->q = kvs_xmalloc((size_t)S * c->nh * c->d * sizeof *c->q);
    for (size_t i = 0; i < (size_t)S * c->nh * c->d; i++) c->q[i] = (float)(gauss() + 0.3);
    /* shuffled block tables */
    int32_t *perm = kvs_xmalloc((size_t)nb * sizeof *perm);
    for (int i = 0; i < nb; i++) perm[i] = i;
    for (int i = nb - 1; i > 0; i--) {
        const int j = (int)(kvs_test_xorshift(&pf_rng) % (unsigned)(i + 1));
        const int32_t t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }
    c->bt = kvs_xcalloc((size_t)S * c->max_blocks, sizeof *c->bt);
    int used = 0;
    for (int s = 0; s < S; s++)
        for (int j = 0; j < (c->ctx[s] + c->bs - 1) / c->bs; j++) c->bt[s * c->max_blocks + j] = perm[used++];
    free(perm);
    const int G = c->nh / c->nkv;
    for (int s = 0; s < S && needles; s++)
        for (int g = 0; g < c->nkv; g++) {
            double qb[1024], n2 = 0;
            for (int i = 0; i < c->d; i++) {
                qb[i] = 0;
                for (int h = g * G; h < (g + 1) * G; h++) qb[i] += c->q[((size_t)s * c->nh + h) * c->d + i] / G;
                n2 += qb[i] * qb[i];
            }
            for (int t = 0; t < needles; t++) {
                const int p = c->sink + (int)(kvs_test_xorshift(&pf_rng) % (unsigned)c->n_r[s]);
                float *kr = c->k + (((size_t)c->bt[s * c->max_blocks + p / c->bs] * c->nkv + g) * c->bs + p % c->bs) * c->d;
                const double strength = 2.5 + 3.0 * t / needles;   /* along qbar, in units of |noise| / sqrt(d) */
                for (int i = 0; i < c->d; i++) kr[i] = (float)(kr[i] + strength * qb[i] / sqrt(n2) * sqrt((double)c->d) / 4);
            }
        }
    if (bf16)
        for (size_t i = 0; i < kn; i++) c->k[i] = kvs_bf16_round(c->k[i]);
}

static void pool_free(struct pool_case *c)
{
    free(c->k);
    free(c->q);
    free(c->bt);
}

struct pool_out {
    int32_t *n_spans, *spans, *sel, *coarse, *exact;
    uint8_t *codes;
    float *w;
};

static struct kvs_dbuf *up(const struct kvs_backend_ops *o, struct kvs_backend *be, enum kvs_buf_kind kind, size_t n,
                          const void *src)
{
    struct kvs_dbuf *b = o->alloc(be, kind, n);
    REQUIRE(b, "alloc of %zu", n);
    if (src) o->upload(be, b, 0, src, n);
    return b;
}

/* encodes the retrieval zones and selects with (beta, rho) (0: adaptive) and topk */
static void pool_run(const struct kvs_backend_ops *o, struct kvs_backend *be, const struct kvs_paris_kernels *k,
                     const struct pool_case *c, double beta, double rho, int topk, struct pool_out *r)
{
    const int S = c->S, nkv = c->nkv, d = c->d, B = d / 8, W = kvs_paris_words(d), max_spans = topk + 2;
    const size_t slots = (size_t)c->n_blocks * c->bs;
    int32_t qs[9], pos[8], rows[8 * KVS_PARIS_ROW_N], jobs[8 * KVS_PARIS_JOB_N];
    int max_ctx = 0;
    for (int s = 0; s <= S; s++) qs[s] = s;
    for (int s = 0; s < S; s++) {
        pos[s] = c->ctx[s] - 1;
        max_ctx = c->ctx[s] > max_ctx ? c->ctx[s] : max_ctx;
        const int n_r = c->n_r[s];
        double b = beta, rh = rho, ab, ar;
        kvs_paris_adaptive(n_r, &ab, &ar);
        if (b <= 0) b = ab;
        if (rh <= 0) rh = ar;
        int32_t *R = rows + s * KVS_PARIS_ROW_N;
        R[KVS_PARIS_ROW_SLOT] = s, R[KVS_PARIS_ROW_NR] = n_r, R[KVS_PARIS_ROW_SINK] = c->sink;
        R[KVS_PARIS_ROW_CTX] = c->ctx[s];
        R[KVS_PARIS_ROW_KEEP] = (int)ceil(b * n_r);
        R[KVS_PARIS_ROW_TOPK] = topk < R[KVS_PARIS_ROW_KEEP] ? topk : R[KVS_PARIS_ROW_KEEP];
        for (int t = 0; t < KVS_PARIS_TIERS; t++) R[KVS_PARIS_ROW_T0 + t] = (int32_t)ceil(n_r * rh * KVS_PARIS_TIER_FRAC[t]);
        int32_t *J = jobs + s * KVS_PARIS_JOB_N;
        J[KVS_PARIS_JOB_SEQ] = s, J[KVS_PARIS_JOB_SLOT] = s, J[KVS_PARIS_JOB_FROM] = c->sink;
        J[KVS_PARIS_JOB_TO] = c->sink + n_r;
    }
    struct kvs_dbuf *kc = up(o, be, KVS_BUF_KV, slots * nkv * d, c->k), *q = up(o, be, KVS_BUF_ACT, (size_t)S * c->nh * d, c->q);
    struct kvs_dbuf *d_qs = up(o, be, KVS_BUF_I32, S + 1, qs), *d_pos = up(o, be, KVS_BUF_I32, S, pos);
    struct kvs_dbuf *d_bt = up(o, be, KVS_BUF_I32, (size_t)S * c->max_blocks, c->bt);
    struct kvs_dbuf *d_rows = up(o, be, KVS_BUF_I32, S * KVS_PARIS_ROW_N, rows), *d_jobs = up(o, be, KVS_BUF_I32, S * KVS_PARIS_JOB_N, jobs);
    float sg[1024];
    kvs_paris_signs(KVS_PARIS_SEED, d, sg);
    struct kvs_dbuf *signs = up(o, be, KVS_BUF_F32, d, sg);
    struct kvs_dbuf *codes = up(o, be, KVS_BUF_I32, slots * nkv * W, NULL), *w = up(o, be, KVS_BUF_F32, slots * nkv * B, NULL);
    int32_t *zeros = kvs_xcalloc((size_t)S * nkv * B * 256, sizeof *zeros);
    struct kvs_dbuf *counts = up(o, be, KVS_BUF_I32, (size_t)S * nkv * B * 256, zeros);
    free(zeros);
    struct kvs_dbuf *ns = up(o, be, KVS_BUF_I32, S * nkv, NULL), *sp = up(o, be, KVS_BUF_I32, (size_t)S * nkv * max_spans * 2, NULL);
    struct kvs_dbuf *sel = up(o, be, KVS_BUF_I32, (size_t)S * nkv * topk, NULL), *co = up(o, be, KVS_BUF_I32, (size_t)S * nkv * topk, NULL);
    struct kvs_dbuf *ex = up(o, be, KVS_BUF_I32, (size_t)S * nkv * topk, NULL);
    struct kvs_attn_meta m = {.n_seqs = S, .max_blocks = c->max_blocks, .q_start = d_qs, .pos = d_pos,
                              .block_tables = d_bt, .h_q_start = qs, .h_pos = pos, .max_ctx = max_ctx};
    k->encode(be, kc, &m, NULL, d_jobs, jobs, S, 0, 1, nkv, d, c->bs, signs, codes, w, counts);
    k->select(be, q, &m, d_rows, rows, S, 0, 1, c->nh, nkv, d, c->bs, signs, codes, w, counts, max_spans, topk, ns, sp,
              sel, co);
    k->exact_topk(be, q, kc, &m, rows, S, c->nh, nkv, d, c->bs, topk, ex);
    r->n_spans = kvs_xmalloc((size_t)S * nkv * sizeof(int32_t));
    r->spans = kvs_xmalloc((size_t)S * nkv * max_spans * 2 * sizeof(int32_t));
    r->sel = kvs_xmalloc((size_t)S * nkv * topk * sizeof(int32_t));
    r->coarse = kvs_xmalloc((size_t)S * nkv * topk * sizeof(int32_t));
    r->exact = kvs_xmalloc((size_t)S * nkv * topk * sizeof(int32_t));
    r->codes = kvs_xmalloc(slots * nkv * W * 4);
    r->w = kvs_xmalloc(slots * nkv * B * sizeof(float));
    o->download(be, r->n_spans, ns, 0, (size_t)S * nkv);
    o->download(be, r->spans, sp, 0, (size_t)S * nkv * max_spans * 2);
    o->download(be, r->sel, sel, 0, (size_t)S * nkv * topk);
    o->download(be, r->coarse, co, 0, (size_t)S * nkv * topk);
    o->download(be, r->exact, ex, 0, (size_t)S * nkv * topk);
    o->download(be, r->codes, codes, 0, slots * nkv * W);
    o->download(be, r->w, w, 0, slots * nkv * B);
    struct kvs_dbuf *all[] = {kc, q, d_qs, d_pos, d_bt, d_rows, d_jobs, signs, codes, w, counts, ns, sp, sel, co, ex};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) o->free_buf(be, all[i]);
}

static void pool_out_free(struct pool_out *r)
{
    free(r->n_spans), free(r->spans), free(r->sel), free(r->coarse), free(r->exact), free(r->codes), free(r->w);
}

/* |a & b| of two ascending lists of n entries (-1 past the end) */
static int overlap(const int32_t *a, const int32_t *b, int n)
{
    int hits = 0;
    for (int i = 0; i < n && a[i] >= 0; i++)
        for (int j = 0; j < n && b[j] >= 0; j++) hits += a[i] == b[j];
    return hits;
}


#endif

/* The offload path of one layer (of n_layers 2, layer 1): the retrieval zones written out to
 * host pages (write_out; one block of each zone gets no page and stays in the pool), then the
 * gather of spans [0, sink) + every 5th zone position + [sink + n_r, ctx) per (seq, KV head)
 * into the staging area. stage_k / stage_v (fp32 [S][stage_blocks][nkv][bs][d]) come back, and
 * the number of positions each (seq, head) holds; v is the V pool (same layout as c->k). */
static void gather_run(const struct kvs_backend_ops *o, struct kvs_backend *be, const struct kvs_paris_kernels *k,
                       const struct pool_case *c, const float *v, int stage_blocks, float *stage_k, float *stage_v,
                       int32_t *count)
{
    const int S = c->S, nkv = c->nkv, d = c->d, bs = c->bs, L = 2, layer = 1;
    const size_t slots = (size_t)c->n_blocks * bs;
    int max_spans = 0;
    for (int s = 0; s < S; s++) max_spans = c->n_r[s] / 5 + 3 > max_spans ? c->n_r[s] / 5 + 3 : max_spans;
    int32_t qs[9], pos[8], rows[8 * KVS_PARIS_ROW_N], jobs[8 * KVS_PARIS_JOB_N];
    int32_t *pages = kvs_xmalloc((size_t)S * c->max_blocks * sizeof *pages);
    int32_t *ns = kvs_xcalloc((size_t)S * nkv, sizeof *ns), *sp = kvs_xcalloc((size_t)S * nkv * max_spans * 2, sizeof *sp);
    int n_pages = 0;
    for (int s = 0; s <= S; s++) qs[s] = s;
    for (int s = 0; s < S; s++) {
        pos[s] = c->ctx[s] - 1;
        int32_t *R = rows + s * KVS_PARIS_ROW_N;
        memset(R, 0, KVS_PARIS_ROW_N * sizeof *R);
        R[KVS_PARIS_ROW_SLOT] = s, R[KVS_PARIS_ROW_NR] = c->n_r[s], R[KVS_PARIS_ROW_SINK] = c->sink;
        R[KVS_PARIS_ROW_CTX] = c->ctx[s];
        int32_t *J = jobs + s * KVS_PARIS_JOB_N;
        J[KVS_PARIS_JOB_SEQ] = s, J[KVS_PARIS_JOB_SLOT] = s, J[KVS_PARIS_JOB_FROM] = c->sink;
        J[KVS_PARIS_JOB_TO] = c->sink + c->n_r[s];
        const int skip = (c->sink + c->n_r[s] / 2) / bs;   /* this zone block stays in the pool */
        for (int j = 0; j < c->max_blocks; j++) {
            const int in_zone = j * bs < c->sink + c->n_r[s] && (j + 1) * bs > c->sink;
            /* pages in reverse block order: the page ids are not the block ids */
            pages[s * c->max_blocks + j] = in_zone && j != skip ? 1000 - n_pages++ : -1;
        }
        for (int g = 0; g < nkv; g++) {
            int32_t *o2 = sp + ((size_t)s * nkv + g) * max_spans * 2;
            int n = 0;
            o2[2 * n] = 0, o2[2 * n + 1] = c->sink, n++;
            for (int p = c->sink + g; p < c->sink + c->n_r[s]; p += 5) o2[2 * n] = p, o2[2 * n + 1] = p + 1, n++;
            o2[2 * n] = c->sink + c->n_r[s], o2[2 * n + 1] = c->ctx[s], n++;
            ns[s * nkv + g] = n;
            int cnt = 0;
            for (int i = 0; i < n; i++) cnt += o2[2 * i + 1] - o2[2 * i];
            count[s * nkv + g] = cnt;
        }
    }
    char err[256];
    const size_t page_elems = (size_t)L * nkv * bs * d;
    void *hk = k->host_alloc(be, 1001 * page_elems * k->kv_elem_bytes, err, sizeof err);
    void *hv = k->host_alloc(be, 1001 * page_elems * k->kv_elem_bytes, err, sizeof err);
    REQUIRE(hk && hv, "%s", err);
    struct kvs_dbuf *kc = up(o, be, KVS_BUF_KV, slots * nkv * d, c->k), *vc = up(o, be, KVS_BUF_KV, slots * nkv * d, v);
    struct kvs_dbuf *d_qs = up(o, be, KVS_BUF_I32, S + 1, qs), *d_pos = up(o, be, KVS_BUF_I32, S, pos);
    struct kvs_dbuf *d_bt = up(o, be, KVS_BUF_I32, (size_t)S * c->max_blocks, c->bt);
    struct kvs_dbuf *d_rows = up(o, be, KVS_BUF_I32, S * KVS_PARIS_ROW_N, rows), *d_jobs = up(o, be, KVS_BUF_I32, S * KVS_PARIS_JOB_N, jobs);
    struct kvs_dbuf *d_pages = up(o, be, KVS_BUF_I32, (size_t)S * c->max_blocks, pages);
    struct kvs_dbuf *d_ns = up(o, be, KVS_BUF_I32, (size_t)S * nkv, ns), *d_sp = up(o, be, KVS_BUF_I32, (size_t)S * nkv * max_spans * 2, sp);
    const size_t st = (size_t)S * stage_blocks * nkv * bs * d;
    float *zeros = kvs_xcalloc(st, sizeof *zeros);
    struct kvs_dbuf *sk = up(o, be, KVS_BUF_KV, st, zeros), *sv = up(o, be, KVS_BUF_KV, st, zeros);
    free(zeros);
    struct kvs_attn_meta m = {.n_seqs = S, .max_blocks = c->max_blocks, .q_start = d_qs, .pos = d_pos,
                              .block_tables = d_bt, .h_q_start = qs, .h_pos = pos, .max_ctx = c->ctx[S - 1]};
    k->write_out(be, kc, vc, &m, d_jobs, jobs, S, layer, L, nkv, d, bs, d_pages, c->max_blocks, hk, hv);
    /* the pool's zone positions are overwritten: what the gather reads from a paged block must
     * come from the host page (the unpaged block keeps its keys) */
    float *junk = kvs_xmalloc(slots * nkv * d * sizeof *junk);
    memcpy(junk, c->k, slots * nkv * d * sizeof *junk);
    for (int s = 0; s < S; s++)
        for (int j = 0; j < c->max_blocks; j++)
            if (pages[s * c->max_blocks + j] >= 0)
                for (size_t i = 0; i < (size_t)nkv * bs * d; i++) {
                    const size_t at = (size_t)c->bt[s * c->max_blocks + j] * nkv * bs * d + i;
                    const size_t p = j * bs + (i / d) % bs;
                    if (p >= (size_t)c->sink && p < (size_t)(c->sink + c->n_r[s])) junk[at] = 7.0f;
                }
    o->upload(be, kc, 0, junk, slots * nkv * d);
    free(junk);
    k->gather(be, kc, vc, &m, d_rows, rows, S, layer, L, nkv, d, bs, d_ns, d_sp, max_spans, d_pages, c->max_blocks, hk,
              hv, sk, sv, stage_blocks);
    o->download(be, stage_k, sk, 0, st);
    o->download(be, stage_v, sv, 0, st);
    struct kvs_dbuf *all[] = {kc, vc, d_qs, d_pos, d_bt, d_rows, d_jobs, d_pages, d_ns, d_sp, sk, sv};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) o->free_buf(be, all[i]);
    k->host_free(be, hk);
    k->host_free(be, hv);
    free(pages), free(ns), free(sp);
}

/* The index-select reference of gather_run: the same positions straight from the pools. Returns
 * the number of staged values that differ (bitwise). */
static size_t gather_check(const struct pool_case *c, const float *v, int stage_blocks, const float *stage_k,
                           const float *stage_v)
{
    const int nkv = c->nkv, d = c->d, bs = c->bs;
    size_t bad = 0;
    for (int s = 0; s < c->S; s++)
        for (int g = 0; g < nkv; g++) {
            int at = 0;
            for (int p = 0; p < c->ctx[s]; p++) {
                const int zone = p >= c->sink && p < c->sink + c->n_r[s];
                if (zone && (p - c->sink - g) % 5 != 0) continue;
                if (zone && p - c->sink < g) continue;
                const size_t src = (((size_t)c->bt[s * c->max_blocks + p / bs] * nkv + g) * bs + p % bs) * d;
                const size_t dst = ((((size_t)s * stage_blocks + at / bs) * nkv + g) * bs + at % bs) * d;
                for (int i = 0; i < d; i++)
                    bad += memcmp(&stage_k[dst + i], &c->k[src + i], sizeof(float)) != 0 ||
                           memcmp(&stage_v[dst + i], &v[src + i], sizeof(float)) != 0;
                at++;
            }
        }
    return bad;
}
