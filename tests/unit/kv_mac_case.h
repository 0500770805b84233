/* kv_mac_case.h: a MAC-Attention kernel scenario (kernels/kv_mac.h) on any backend, shared by
 * tests/unit/test_kv_mac.c (CPU reference against double math) and tests/gpu/test_cuda_kv_mac.c
 * (CUDA against the CPU reference on the same inputs): a paged KV pool of random keys and values
 * with a shuffled block table per sequence, one ring slot per sequence, one layer, optional
 * deferred-RoPE offsets and padded blocks (the LazyAttention layout). mc_step runs match +
 * attend for one step whose sequences each run rows_per_seq[s] rows ending at position pos_end[s].
 * mc_lean stores the pool as LeanKV pages too (kernels/kv_lean.h, the backend's own writer) and
 * makes the steps read those (kv.storage = lean under MAC); mc_lean_plain instead replaces the
 * plain pool by its dequantized values (the reference MAC over lean must equal).
 * Header-only (static), one copy per test program. Ownership: mc_free releases everything. */
#ifndef KVS_TEST_KV_MAC_CASE_H
#define KVS_TEST_KV_MAC_CASE_H

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/half.h"
#include "kernels/backend.h"
#include "kernels/kv_lean.h"
#include "kernels/kv_mac.h"

#define MC_MAXS 8

struct mc {
    const struct kvs_backend_ops *o;
    struct kvs_backend *be;
    const struct kvs_mac_kernels *k;
    int S, nh, nkv, hd, bs, max_blocks, n_blocks, K, band, max_rows;
    float thresh2;
    float *h_k, *h_v, *inv_freq;         /* pool [n_blocks][nkv][bs][hd] */
    int32_t *h_bt, *h_rot, *h_valid;     /* [S][max_blocks] */
    struct kvs_dbuf *work;
    size_t work_n;
    struct kvs_dbuf *kc, *vc, *bt, *rot, *valid, *inv, *qs, *pos, *rows, *p, *rq, *ro, *rl, *rt, *q, *qp, *out, *lse;
    int use_rot;
    struct kvs_lean_fmt lean;            /* kbits 0: steps read the plain pool */
    struct kvs_dbuf *pages;              /* LeanKV pages of the pool (mc_lean) */
    /* last step, downloaded */
    int n;
    float *o_out, *o_lse;
    int32_t *o_p;
    int32_t h_rows[64 * 4];
};

static uint64_t mc_rng = 0x51ed2701ull;
static inline float mc_frand(void)
{
    mc_rng ^= mc_rng << 13, mc_rng ^= mc_rng >> 7, mc_rng ^= mc_rng << 17;
    return (float)((double)(mc_rng >> 11) / (double)(1ull << 53)) * 2.0f - 1.0f;
}

/* Random pool, shuffled block tables; use_rot: random rotation offsets on some blocks and a
 * short valid count on others (their padding holds garbage that must never be read). */
static inline void mc_init(struct mc *c, const struct kvs_backend_ops *o, struct kvs_backend *be, int S, int nh, int nkv,
                    int hd, int bs, int max_blocks, int K, int band, int use_rot)
{
    memset(c, 0, sizeof *c);
    c->o = o, c->be = be, c->S = S, c->nh = nh, c->nkv = nkv, c->hd = hd, c->bs = bs, c->max_blocks = max_blocks;
    c->K = K, c->band = band, c->use_rot = use_rot, c->max_rows = 64;
    c->k = kvs_mac_kernels_for(o, NULL, 0);
    c->n_blocks = S * max_blocks;
    const size_t pool = (size_t)c->n_blocks * nkv * bs * hd, tab = (size_t)S * max_blocks;
    c->h_k = malloc(pool * 4), c->h_v = malloc(pool * 4), c->inv_freq = malloc((size_t)hd / 2 * 4);
    c->h_bt = malloc(tab * 4), c->h_rot = calloc(tab, 4), c->h_valid = malloc(tab * 4);
    for (size_t i = 0; i < pool; i++) c->h_k[i] = kvs_bf16_round(mc_frand()), c->h_v[i] = kvs_bf16_round(mc_frand());
    for (int i = 0; i < hd / 2; i++) c->inv_freq[i] = powf(10000.0f, -2.0f * (float)i / (float)hd);
    int32_t *perm = malloc((size_t)c->n_blocks * 4);
    for (int i = 0; i < c->n_blocks; i++) perm[i] = i;
    for (int i = c->n_blocks - 1; i > 0; i--) {
        int j = (int)((mc_frand() * 0.5f + 0.5f) * (float)i);
        if (j > i) j = i;
        int32_t t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }
    for (size_t i = 0; i < tab; i++) {
        c->h_bt[i] = perm[i];
        c->h_valid[i] = bs;
        if (use_rot && i % 3 == 1) c->h_rot[i] = (int32_t)(i * 7 % 41) - 20;
        if (use_rot && i % 5 == 2) c->h_valid[i] = bs / 2;   /* a padded document tail */
    }
    free(perm);
    c->kc = o->alloc(be, KVS_BUF_KV, pool), c->vc = o->alloc(be, KVS_BUF_KV, pool);
    o->upload(be, c->kc, 0, c->h_k, pool), o->upload(be, c->vc, 0, c->h_v, pool);
    c->bt = o->alloc(be, KVS_BUF_I32, tab), c->rot = o->alloc(be, KVS_BUF_I32, tab);
    c->valid = o->alloc(be, KVS_BUF_I32, tab);
    o->upload(be, c->bt, 0, c->h_bt, tab), o->upload(be, c->rot, 0, c->h_rot, tab);
    o->upload(be, c->valid, 0, c->h_valid, tab);
    c->inv = o->alloc(be, KVS_BUF_F32, (size_t)hd / 2);
    o->upload(be, c->inv, 0, c->inv_freq, (size_t)hd / 2);
    c->qs = o->alloc(be, KVS_BUF_I32, MC_MAXS + 1), c->pos = o->alloc(be, KVS_BUF_I32, MC_MAXS);
    const size_t R = (size_t)c->max_rows, ent = (size_t)S * K;
    c->rows = o->alloc(be, KVS_BUF_I32, R * 4), c->p = o->alloc(be, KVS_BUF_I32, R * nh);
    c->rq = o->alloc(be, KVS_BUF_KV, ent * nh * hd), c->ro = o->alloc(be, KVS_BUF_KV, ent * nh * hd);
    c->rl = o->alloc(be, KVS_BUF_F32, ent * nh), c->rt = o->alloc(be, KVS_BUF_I32, ent);
    o->zero(be, c->rt, 0, ent);
    c->q = o->alloc(be, KVS_BUF_ACT, R * nh * hd), c->qp = o->alloc(be, KVS_BUF_ACT, R * nh * hd);
    c->out = o->alloc(be, KVS_BUF_ACT, R * nh * hd), c->lse = o->alloc(be, KVS_BUF_F32, R * nh);
    c->work_n = c->k->work_elems(c->max_rows, nh, hd);
    c->work = c->work_n ? o->alloc(be, KVS_BUF_F32, c->work_n) : NULL;
    c->o_out = malloc(R * nh * hd * 4), c->o_lse = malloc(R * nh * 4), c->o_p = malloc(R * nh * 4);
}

/* The hit-and-miss scenario of the tests that compare two MAC paths step by step. fixed holds 3
 * far-off query rows ([3][nh * hd]). mc_scene_prefill fills the prefill queries q ([S][16][qd]):
 * small random rows, each sequence's last one a copy of sequence 0's first row, or fixed[2] for
 * sequence 3. mc_scene_step fills one decode row per sequence (q [S][qd]): 0 repeats fixed[0]
 * (hits), 1 draws far random rows (misses), 2 alternates fixed[0] / fixed[1], 3 repeats fixed[2]. */
static inline void mc_scene_prefill(float *q, const float *fixed, int S, size_t qd)
{
    for (size_t i = 0; i < 16 * (size_t)S * qd; i++) q[i] = mc_frand();
    for (int s = 0; s < S; s++) memcpy(q + ((size_t)s * 16 + 15) * qd, s == 3 ? fixed + 2 * qd : q, qd * 4);
}

static inline void mc_scene_step(float *q, const float *fixed, int S, size_t qd, int step)
{
    for (int s = 0; s < S; s++) {
        float *qs = q + (size_t)s * qd;
        if (s == 0) memcpy(qs, fixed, qd * 4);
        else if (s == 1) for (size_t i = 0; i < qd; i++) qs[i] = 4.0f * mc_frand();
        else if (s == 2) memcpy(qs, fixed + (size_t)(step % 2) * qd, qd * 4);
        else memcpy(qs, fixed + 2 * qd, qd * 4);
    }
}

static inline void mc_free(struct mc *c)
{
    struct kvs_dbuf *b[] = {c->kc, c->vc, c->bt, c->rot, c->valid, c->inv, c->qs, c->pos, c->rows,
                            c->p, c->rq, c->ro, c->rl, c->rt, c->q, c->qp, c->out, c->lse, c->work, c->pages};
    for (size_t i = 0; i < sizeof b / sizeof b[0]; i++) c->o->free_buf(c->be, b[i]);
    free(c->h_k), free(c->h_v), free(c->inv_freq), free(c->h_bt), free(c->h_rot), free(c->h_valid);
    free(c->o_out), free(c->o_lse), free(c->o_p);
}

/* The meta of a step: sequence s runs nrows[s] rows ending at position pos_end[s]. */
static inline struct kvs_attn_meta mc_meta(struct mc *c, const int *pos_end, const int *nrows, int32_t *hq, int32_t *hp)
{
    hq[0] = 0;
    int mx = 0;
    for (int s = 0; s < c->S; s++) {
        hq[s + 1] = hq[s] + nrows[s];
        hp[s] = pos_end[s] - nrows[s] + 1;
        if (pos_end[s] + 1 > mx) mx = pos_end[s] + 1;
    }
    c->o->upload(c->be, c->qs, 0, hq, (size_t)c->S + 1);
    c->o->upload(c->be, c->pos, 0, hp, (size_t)c->S);
    struct kvs_attn_meta m = {
        .n_seqs = c->S, .max_blocks = c->max_blocks, .q_start = c->qs, .pos = c->pos, .block_tables = c->bt,
        .rot_offsets = c->use_rot ? c->rot : NULL, .block_valid = c->use_rot ? c->valid : NULL, .inv_freq = c->inv,
        .h_q_start = hq, .h_pos = hp, .max_ctx = mx,
    };
    return m;
}

/* One step: q / q_pre host [n][nh][hd]; flags per sequence (its rows: F_APPEND on every row,
 * F_MAC / F_MATCH only for a one-row sequence). Downloads out, lse and p. */
static inline void mc_step(struct mc *c, const int *pos_end, const int *nrows, const int *flags, const float *q,
                    const float *q_pre)
{
    int32_t hq[MC_MAXS + 1], hp[MC_MAXS];
    struct kvs_attn_meta m = mc_meta(c, pos_end, nrows, hq, hp);
    int n = 0;
    for (int s = 0; s < c->S; s++)
        for (int i = 0; i < nrows[s]; i++, n++) {
            int32_t *r = c->h_rows + (size_t)n * 4;
            r[0] = s, r[1] = s, r[2] = hp[s] + i, r[3] = flags[s];
        }
    c->n = n;
    const size_t qd = (size_t)c->nh * c->hd;
    c->o->upload(c->be, c->rows, 0, c->h_rows, (size_t)n * 4);
    c->o->upload(c->be, c->q, 0, q, n * qd);
    c->o->upload(c->be, c->qp, 0, q_pre, n * qd);
    c->o->zero(c->be, c->out, 0, n * qd);
    const struct kvs_mac_call call = {
        .layer = 0, .n_layers = 1, .K = c->K, .band = c->band, .n = n, .n_heads = c->nh, .n_kv_heads = c->nkv,
        .head_dim = c->hd, .block_size = c->bs, .scale = 1.0f / sqrtf((float)c->hd), .thresh2 = c->thresh2,
        .q = c->q, .q_pre = c->qp, .kc = c->kc, .vc = c->vc, .m = &m, .rows = c->rows, .p = c->p, .p_off = 0,
        .ring_q = c->rq, .ring_o = c->ro, .ring_lse = c->rl, .ring_tag = c->rt, .out = c->out, .lse = c->lse,
        .work = c->work, .work_n = c->work_n, .lean = c->lean, .pages = c->pages,
    };
    c->k->match(c->be, &call);
    c->k->attend(c->be, &call);
    c->o->download(c->be, c->o_out, c->out, 0, n * qd);
    c->o->download(c->be, c->o_lse, c->lse, 0, (size_t)n * c->nh);
    c->o->download(c->be, c->o_p, c->p, 0, (size_t)n * c->nh);
}

/* The pool as LeanKV pages of format f, written by the backend's own LeanKV writer from the host
 * pool (physical slot b bs + off of block b holds the pool's token there), and the steps from now
 * on read them (mc_step passes them to attend()). 0, or -1 when the backend has no LeanKV kernels. */
static inline int mc_lean(struct mc *c, struct kvs_lean_fmt f)
{
    const struct kvs_lean_kernels *kn = kvs_lean_kernels_for(c->o, NULL, 0);
    if (!kn) return -1;
    const int n = c->n_blocks * c->bs, hd = c->hd, nkv = c->nkv;
    const size_t row = (size_t)nkv * hd;
    float *k = malloc((size_t)n * row * 4), *v = malloc((size_t)n * row * 4);
    int32_t *slots = malloc((size_t)n * 4);
    for (int t = 0; t < n; t++) {
        const int b = t / c->bs, off = t % c->bs;
        slots[t] = t;
        for (int g = 0; g < nkv; g++) {
            const size_t src = (((size_t)b * nkv + g) * c->bs + off) * hd;
            memcpy(k + (size_t)t * row + (size_t)g * hd, c->h_k + src, (size_t)hd * 4);
            memcpy(v + (size_t)t * row + (size_t)g * hd, c->h_v + src, (size_t)hd * 4);
        }
    }
    struct kvs_dbuf *dk = c->o->alloc(c->be, KVS_BUF_ACT, (size_t)n * row);
    struct kvs_dbuf *dv = c->o->alloc(c->be, KVS_BUF_ACT, (size_t)n * row);
    struct kvs_dbuf *ds = c->o->alloc(c->be, KVS_BUF_I32, (size_t)n);
    c->o->upload(c->be, dk, 0, k, (size_t)n * row), c->o->upload(c->be, dv, 0, v, (size_t)n * row);
    c->o->upload(c->be, ds, 0, slots, (size_t)n);
    c->pages = kn->alloc_pages(c->be, (size_t)c->n_blocks * nkv * kvs_lean_page_bytes(f, hd, c->bs));
    kn->write(c->be, f, dk, dv, ds, n, nkv, hd, c->bs, c->pages);
    c->lean = f;
    c->o->free_buf(c->be, dk), c->o->free_buf(c->be, dv), c->o->free_buf(c->be, ds);
    free(k), free(v), free(slots);
    return 0;
}

/* The plain pool (host copy and backend) replaced by its round trip through format f (the host
 * quantizer, which the backends' writers equal bitwise): what MAC over lean pages must read. */
static inline void mc_lean_plain(struct mc *c, struct kvs_lean_fmt f)
{
    const size_t pool = (size_t)c->n_blocks * c->nkv * c->bs * c->hd;
    uint8_t codes[512];
    uint16_t sz[2];
    for (size_t i = 0; i < pool; i += (size_t)c->hd) {
        kvs_lean_quantize(c->h_k + i, c->hd, f.kbits, codes, sz);
        kvs_lean_dequantize(codes, sz, c->hd, f.kbits, c->h_k + i);
        kvs_lean_quantize(c->h_v + i, c->hd, f.vbits, codes, sz);
        kvs_lean_dequantize(codes, sz, c->hd, f.vbits, c->h_v + i);
    }
    c->o->upload(c->be, c->kc, 0, c->h_k, pool), c->o->upload(c->be, c->vc, 0, c->h_v, pool);
}

/* count() on a fixed scenario: n = 5 rows x L = 3 layers of matches (rows 0, 2, 3 counted, rows 0
 * and 3 matching; hits and misses mixed within KV groups), run twice (the counters accumulate).
 * h_rows [n][4] and h_p [L][n][nh] receive the inputs; out [KVS_MAC_N_COUNTS] the counters. */
static inline void mc_count(struct mc *c, int32_t *h_rows, int32_t *h_p, uint64_t *out)
{
    const int n = 5, L = 3, nh = c->nh;
    for (int t = 0; t < n; t++) {
        int32_t *r = h_rows + 4 * t;
        r[0] = t % c->S, r[1] = t % c->S, r[2] = 500 + 97 * t;
        r[3] = (t == 0 || t == 2 || t == 3 ? KVS_MAC_F_COUNT | KVS_MAC_F_MAC : KVS_MAC_F_MAC) |
               (t == 0 || t == 3 ? KVS_MAC_F_MATCH : 0);
    }
    for (int l = 0; l < L; l++)
        for (int t = 0; t < n; t++)
            for (int h = 0; h < nh; h++) {
                const int v = (l * 31 + t * 7 + h * 3) % 5;
                h_p[((size_t)l * n + t) * nh + h] = v == 0 ? -1 : h_rows[4 * t + 2] - 10 - 60 * v * (h + 1);
            }
    c->o->upload(c->be, c->rows, 0, h_rows, (size_t)n * 4);
    c->o->upload(c->be, c->p, 0, h_p, (size_t)L * n * nh);
    struct kvs_dbuf *acc = c->o->alloc(c->be, KVS_BUF_I32, 2 * KVS_MAC_N_COUNTS);
    c->o->zero(c->be, acc, 0, 2 * KVS_MAC_N_COUNTS);
    const struct kvs_mac_call call = {
        .n_layers = L, .K = c->K, .band = c->band, .n = n, .n_heads = nh, .n_kv_heads = c->nkv, .head_dim = c->hd,
        .rows = c->rows, .p = c->p,
    };
    c->k->count(c->be, &call, acc);
    c->k->count(c->be, &call, acc);
    int32_t raw[2 * KVS_MAC_N_COUNTS];
    c->o->download(c->be, raw, acc, 0, 2 * KVS_MAC_N_COUNTS);
    memcpy(out, raw, sizeof raw);
    c->o->free_buf(c->be, acc);
}

/* Reads ring entry j of sequence slot s, head h: (o [hd], lse); returns its tag. */
static inline int32_t mc_ring(struct mc *c, int s, int j, int h, float *o, float *lse)
{
    const size_t e = (size_t)s * c->K + j;
    int32_t tag;
    c->o->download(c->be, &tag, c->rt, e, 1);
    c->o->download(c->be, o, c->ro, (e * c->nh + h) * c->hd, (size_t)c->hd);
    c->o->download(c->be, lse, c->rl, e * c->nh + h, 1);
    return tag;
}

/* Double reference (no rotation offsets, every slot valid): attention of q [hd] over positions
 * [lo, hi) of sequence s, kv head g; returns lse (-inf when empty), o [hd]. */
static inline double mc_ref(const struct mc *c, int s, int g, const float *q, int lo, int hi, double *o)
{
    const double scale = 1.0 / sqrt((double)c->hd);
    double mx = -INFINITY, l = 0;
    for (int i = 0; i < c->hd; i++) o[i] = 0;
    for (int pass = 0; pass < 2; pass++)
        for (int p = lo; p < hi; p++) {
            const int32_t b = c->h_bt[(size_t)s * c->max_blocks + p / c->bs];
            const size_t base = (((size_t)b * c->nkv + g) * c->bs + p % c->bs) * c->hd;
            double sc = 0;
            for (int i = 0; i < c->hd; i++) sc += (double)q[i] * c->h_k[base + i];
            sc *= scale;
            if (pass == 0) {
                if (sc > mx) mx = sc;
                continue;
            }
            const double w = exp(sc - mx);
            l += w;
            for (int i = 0; i < c->hd; i++) o[i] += w * c->h_v[base + i];
        }
    if (l == 0) return -INFINITY;
    for (int i = 0; i < c->hd; i++) o[i] /= l;
    return mx + log(l);
}

#endif
