/* kv_paris.c: the CPU reference of ParisKV's encoder and selection (kernels/kv_paris.h): the
 * math of one vector in plain loops, selection by stable counting sort (vote) and qsort
 * (estimate). Plain C that the CUDA kernels are to be tested against. */
#include "kernels/kv_paris.h"

#include <math.h>
#include <stdlib.h>

#include "base/util.h"
#include "kernels/cpu/cpu_internal.h"
#include "kernels/cpu/cpu_pool.h"
#include "kernels/cpu/kv_paris_host.h"

void kvs_paris_signs(uint32_t seed, int d, float *signs)
{
    uint64_t x = seed;
    for (int i = 0; i < d; i++) {
        uint64_t z = (x += 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        signs[i] = (z & 1) ? -1.0f : 1.0f;
    }
}

void kvs_paris_srht(float *x, const float *signs, int d)
{
    for (int i = 0; i < d; i++) x[i] *= signs[i];
    for (int h = 1; h < d; h *= 2)
        for (int i = 0; i < d; i += 2 * h)
            for (int j = i; j < i + h; j++) {
                const float a = x[j], b = x[j + h];
                x[j] = a + b, x[j + h] = a - b;
            }
    const float s = 1.0f / sqrtf((float)d);
    for (int i = 0; i < d; i++) x[i] *= s;
}

/* normalized, rotated copy of v into out[d]; returns |v| (0: out all zero) */
static float rotate_unit(const float *v, const float *signs, int d, float *out)
{
    double n2 = 0;
    for (int i = 0; i < d; i++) n2 += (double)v[i] * v[i];
    const float n = (float)sqrt(n2);
    for (int i = 0; i < d; i++) out[i] = n > 0 ? v[i] / n : 0.0f;
    if (n > 0) kvs_paris_srht(out, signs, d);
    return n;
}

static inline int lm_index(float a)
{
    int t = 0;
    while (t < 7 && a > KVS_PARIS_LM_THRESH[t]) t++;
    return t;
}

float kvs_paris_encode_key(const float *k, const float *signs, int d, uint8_t *cid, uint8_t *code, float *w)
{
    float kt[1024];
    const float kn = rotate_unit(k, signs, d, kt);
    for (int b = 0; b < d / KVS_PARIS_M; b++) {
        const float *x = kt + b * KVS_PARIS_M;
        double r2 = 0;
        unsigned c = 0;
        for (int j = 0; j < KVS_PARIS_M; j++) {
            r2 += (double)x[j] * x[j];
            c |= (unsigned)(x[j] < 0) << j;
        }
        const float r = (float)sqrt(r2);
        double alpha = 0;
        for (int j = 0; j < KVS_PARIS_M; j++) {
            const float u = r > 0 ? x[j] / r : 0.0f;
            const int t = lm_index(fabsf(u));
            code[b * KVS_PARIS_M + j] = (uint8_t)(((u < 0) << 3) | t);
            alpha += (double)KVS_PARIS_LM_CENTER[t] * fabsf(u);
        }
        cid[b] = (uint8_t)c;
        w[b] = r > 0 && alpha > 0 ? (float)((double)kn * r / alpha) : 0.0f;
    }
    return kn;
}

float kvs_paris_query(const float *qbar, const float *signs, int d, float *qt)
{
    return rotate_unit(qbar, signs, d, qt);
}

float kvs_paris_estimate(const uint8_t *code, const float *w, const float *qt, float qnorm, int d)
{
    float est = 0;
    for (int b = 0; b < d / KVS_PARIS_M; b++) {
        float dot = 0;
        for (int j = 0; j < KVS_PARIS_M; j++) {
            const uint8_t c = code[b * KVS_PARIS_M + j];
            const float v = (c & 8) ? -KVS_PARIS_LM_CENTER[c & 7] : KVS_PARIS_LM_CENTER[c & 7];
            dot += v * qt[b * KVS_PARIS_M + j];
        }
        est += w[b] * dot;
    }
    return qnorm * est;
}

double kvs_paris_estimate_u(const float *k, const float *signs, const float *qt, float qnorm, int d)
{
    float kt[1024];
    const float kn = rotate_unit(k, signs, d, kt);
    double est = 0;
    for (int b = 0; b < d / KVS_PARIS_M; b++) {
        const float *x = kt + b * KVS_PARIS_M;
        double r2 = 0, dot = 0;
        for (int j = 0; j < KVS_PARIS_M; j++) r2 += (double)x[j] * x[j];
        const double r = sqrt(r2);
        if (r == 0) continue;
        for (int j = 0; j < KVS_PARIS_M; j++) dot += x[j] / r * qt[b * KVS_PARIS_M + j];
        est += (double)kn * r * dot;   /* w_b = |k| r_b / alpha_b, alpha_b = <u, u> = 1 */
    }
    return qnorm * est;
}

void kvs_paris_tiers(const float *qt, const int32_t *counts, const int32_t *T, int d, uint8_t *tier)
{
    for (int b = 0; b < d / KVS_PARIS_M; b++) {
        float s[KVS_PARIS_NC];
        int ord[KVS_PARIS_NC];
        for (int c = 0; c < KVS_PARIS_NC; c++) {
            float acc = 0;
            for (int j = 0; j < KVS_PARIS_M; j++) acc += ((c >> j) & 1) ? -qt[b * KVS_PARIS_M + j] : qt[b * KVS_PARIS_M + j];
            s[c] = acc;   /* <q_b, sign_c> up to the common factor 1/sqrt(8), which keeps the order */
            ord[c] = c;
        }
        /* insertion sort, descending, ties to the lower id (stable from ascending ids) */
        for (int i = 1; i < KVS_PARIS_NC; i++) {
            const int c = ord[i];
            const uint32_t kc = kvs_paris_order_key(s[c]);
            int j = i - 1;
            while (j >= 0 && kvs_paris_order_key(s[ord[j]]) < kc) {
                ord[j + 1] = ord[j];
                j--;
            }
            ord[j + 1] = c;
        }
        int64_t cum = 0;
        for (int i = 0; i < KVS_PARIS_NC; i++) {
            const int c = ord[i];
            int n = 0;
            for (int t = 0; t < KVS_PARIS_TIERS; t++) n += cum < T[t];
            tier[b * KVS_PARIS_NC + c] = (uint8_t)n;
            cum += counts[b * KVS_PARIS_NC + c];
        }
    }
}

void kvs_paris_adaptive(int n_r, double *beta, double *rho)
{
    if (n_r < 5000) *beta = .5, *rho = .5;
    else if (n_r < 10000) *beta = .25, *rho = .3;
    else if (n_r < 30000) *beta = .2, *rho = .25;
    else *beta = .1, *rho = .2;
}

/* ---- pool-level ops ------------------------------------------------------------------------ */
static inline size_t pos_slot(const int32_t *bt, int p, int bs) { return (size_t)bt[p / bs] * bs + (size_t)(p % bs); }

static void cpu_encode(struct kvs_backend *be, const struct kvs_dbuf *kc, const struct kvs_attn_meta *m,
                       const struct kvs_dbuf *idx_tables, const struct kvs_dbuf *jobs, const int32_t *h_jobs, int n_jobs, int layer, int n_layers,
                       int n_kv_heads, int head_dim, int block_size, const struct kvs_dbuf *signs,
                       struct kvs_dbuf *codes, struct kvs_dbuf *w, struct kvs_dbuf *counts)
{
    (void)be, (void)h_jobs;
    const int d = head_dim, B = d / KVS_PARIS_M, W = kvs_paris_words(d), nkv = n_kv_heads;
    const float *k = F(kc), *sg = F(signs);
    const int32_t *jb = I(jobs), *bts = I(m->block_tables), *its = idx_tables ? I(idx_tables) : bts;
    uint8_t *cw = (uint8_t *)I(codes);
    float *wf = F(w);
    int32_t *cnt = I(counts);
    uint8_t code[1024];
    for (int j = 0; j < n_jobs; j++) {
        const int32_t *J = jb + (size_t)j * KVS_PARIS_JOB_N;
        const int32_t *bt = bts + (size_t)J[KVS_PARIS_JOB_SEQ] * m->max_blocks;
        const int32_t *it = its + (size_t)J[KVS_PARIS_JOB_SEQ] * m->max_blocks;
        for (int p = J[KVS_PARIS_JOB_FROM]; p < J[KVS_PARIS_JOB_TO]; p++) {
            const size_t slot = pos_slot(it, p, block_size);
            for (int g = 0; g < nkv; g++) {
                const float *kr = k + (((size_t)bt[p / block_size] * nkv + g) * block_size + p % block_size) * d;
                uint8_t *row = cw + (slot * nkv + g) * (size_t)W * 4;
                float *wr = wf + (slot * nkv + g) * (size_t)B;
                memset(row, 0, (size_t)W * 4);
                kvs_paris_encode_key(kr, sg, d, row, code, wr);
                for (int i = 0; i < d; i++) row[B + i / 2] |= (uint8_t)(code[i] << (4 * (i & 1)));
                int32_t *c = cnt + (((size_t)J[KVS_PARIS_JOB_SLOT] * n_layers + layer) * nkv + g) * B * KVS_PARIS_NC;
                for (int b = 0; b < B; b++) c[b * KVS_PARIS_NC + row[b]]++;
            }
        }
    }
}

/* qbar of row r, KV head g: the mean of the group's query heads in increasing h */
static void group_mean(const float *q, int r, int g, int n_heads, int n_kv_heads, int d, float *qbar)
{
    const int G = n_heads / n_kv_heads;
    for (int i = 0; i < d; i++) qbar[i] = 0;
    for (int h = g * G; h < (g + 1) * G; h++)
        for (int i = 0; i < d; i++) qbar[i] += q[((size_t)r * n_heads + h) * d + i];
    for (int i = 0; i < d; i++) qbar[i] /= (float)G;
}

struct cand {
    uint32_t key;
    int32_t pos;
};

static int cand_cmp(const void *a, const void *b)
{
    const struct cand *x = a, *y = b;
    if (x->key != y->key) return x->key > y->key ? -1 : 1;
    return (x->pos > y->pos) - (x->pos < y->pos);
}

static int pos_cmp(const void *a, const void *b)
{
    const int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

struct sel_job {
    const float *q, *sg, *w;
    const uint8_t *cw;
    const int32_t *rows, *bts, *cnt;
    int32_t *n_spans, *spans, *sel, *coarse;
    int max_blocks, layer, n_layers, nh, nkv, d, bs, max_spans, max_topk;
};

static void sel_task(void *ctx, int task)
{
    const struct sel_job *j = ctx;
    const int r = task / j->nkv, g = task % j->nkv, d = j->d, B = d / KVS_PARIS_M, W = kvs_paris_words(d);
    const int32_t *R = j->rows + (size_t)r * KVS_PARIS_ROW_N;
    const int n_r = R[KVS_PARIS_ROW_NR], sink = R[KVS_PARIS_ROW_SINK], ctxn = R[KVS_PARIS_ROW_CTX];
    int32_t *ns = j->n_spans + (size_t)task, *sp = j->spans + (size_t)task * j->max_spans * 2;
    int32_t *sel = j->sel ? j->sel + (size_t)task * j->max_topk : NULL;
    int32_t *co = j->coarse ? j->coarse + (size_t)task * j->max_topk : NULL;
    for (int i = 0; i < j->max_topk; i++) {
        if (sel) sel[i] = -1;
        if (co) co[i] = -1;
    }
    if (n_r <= 0) {
        *ns = 1, sp[0] = 0, sp[1] = ctxn;
        return;
    }
    const int32_t *bt = j->bts + (size_t)r * j->max_blocks;
    float qbar[1024], qt[1024];
    group_mean(j->q, r, g, j->nh, j->nkv, d, qbar);
    const float qn = kvs_paris_query(qbar, j->sg, d, qt);
    uint8_t *tier = kvs_xmalloc((size_t)B * KVS_PARIS_NC);
    const int32_t *cnt = j->cnt + (((size_t)R[KVS_PARIS_ROW_SLOT] * j->n_layers + j->layer) * j->nkv + g) * B * KVS_PARIS_NC;
    kvs_paris_tiers(qt, cnt, R + KVS_PARIS_ROW_T0, d, tier);
    /* vote, then a stable counting sort by vote descending (ties: lower position) */
    const int maxv = KVS_PARIS_TIERS * B;
    uint16_t *vote = kvs_xmalloc((size_t)n_r * sizeof *vote);
    int *hist = kvs_xcalloc((size_t)maxv + 2, sizeof *hist);
    for (int i = 0; i < n_r; i++) {
        const uint8_t *row = j->cw + (pos_slot(bt, sink + i, j->bs) * j->nkv + g) * (size_t)W * 4;
        int v = 0;
        for (int b = 0; b < B; b++) v += tier[b * KVS_PARIS_NC + row[b]];
        vote[i] = (uint16_t)v;
        hist[maxv - v + 1]++;
    }
    for (int v = 1; v <= maxv + 1; v++) hist[v] += hist[v - 1];   /* hist[maxv - v]: start of vote v */
    int32_t *order = kvs_xmalloc((size_t)n_r * sizeof *order);
    for (int i = 0; i < n_r; i++) order[hist[maxv - vote[i]]++] = sink + i;
    int keep = R[KVS_PARIS_ROW_KEEP], topk = R[KVS_PARIS_ROW_TOPK];
    if (keep > n_r) keep = n_r;
    if (topk > keep) topk = keep;
    if (co)
        for (int i = 0; i < topk && i < j->max_topk; i++) co[i] = order[i];
    /* rerank the kept candidates by the 4-bit estimate */
    struct cand *c = kvs_xmalloc((size_t)(keep > 0 ? keep : 1) * sizeof *c);
    uint8_t code[1024];
    for (int i = 0; i < keep; i++) {
        const size_t slot = pos_slot(bt, order[i], j->bs);
        const uint8_t *row = j->cw + (slot * j->nkv + g) * (size_t)W * 4;
        for (int t = 0; t < d; t++) code[t] = (uint8_t)((row[B + t / 2] >> (4 * (t & 1))) & 15);
        const float est = kvs_paris_estimate(code, j->w + (slot * j->nkv + g) * (size_t)B, qt, qn, d);
        c[i] = (struct cand){kvs_paris_order_key(est), order[i]};
    }
    qsort(c, (size_t)keep, sizeof *c, cand_cmp);
    int32_t *chosen = kvs_xmalloc((size_t)(topk > 0 ? topk : 1) * sizeof *chosen);
    for (int i = 0; i < topk; i++) chosen[i] = c[i].pos;
    qsort(chosen, (size_t)topk, sizeof *chosen, pos_cmp);
    if (co) qsort(co, (size_t)(topk < j->max_topk ? topk : j->max_topk), sizeof *co, pos_cmp);
    if (sel)
        for (int i = 0; i < topk && i < j->max_topk; i++) sel[i] = chosen[i];
    /* spans: sink, chosen positions, the tail after the retrieval zone; adjacent ones merged */
    int n = 0;
#define ADD(a, b)                                                             \
    do {                                                                      \
        if ((a) < (b)) {                                                      \
            if (n && sp[2 * n - 1] == (a)) sp[2 * n - 1] = (b);               \
            else sp[2 * n] = (a), sp[2 * n + 1] = (b), n++;                   \
        }                                                                     \
    } while (0)
    ADD(0, sink);
    for (int i = 0; i < topk; i++) ADD(chosen[i], chosen[i] + 1);
    ADD(sink + n_r, ctxn);
#undef ADD
    *ns = n;
    free(tier);
    free(vote);
    free(hist);
    free(order);
    free(c);
    free(chosen);
}

static void cpu_select(struct kvs_backend *be, const struct kvs_dbuf *q, const struct kvs_attn_meta *m,
                       const struct kvs_dbuf *rows, const int32_t *h_rows, int n, int layer, int n_layers, int n_heads,
                       int n_kv_heads, int head_dim, int block_size, const struct kvs_dbuf *signs,
                       const struct kvs_dbuf *codes, const struct kvs_dbuf *w, const struct kvs_dbuf *counts,
                       int max_spans, int max_topk, struct kvs_dbuf *n_spans, struct kvs_dbuf *spans,
                       struct kvs_dbuf *sel, struct kvs_dbuf *coarse)
{
    (void)h_rows;
    struct sel_job j = {F(q), F(signs), F(w), (const uint8_t *)I(codes), I(rows), I(m->block_tables), I(counts),
                        I(n_spans), I(spans), sel ? I(sel) : NULL, coarse ? I(coarse) : NULL, m->max_blocks, layer,
                        n_layers, n_heads, n_kv_heads, head_dim, block_size, max_spans, max_topk};
    kvs_cpu_pool_run(be->pool, n * n_kv_heads, sel_task, &j);
}

struct exact_job {
    const float *q, *k;
    const int32_t *rows, *bts;
    int32_t *out;
    int max_blocks, nh, nkv, d, bs, max_topk;
};

static void exact_task(void *ctx, int task)
{
    const struct exact_job *j = ctx;
    const int r = task / j->nkv, g = task % j->nkv, d = j->d;
    const int32_t *R = j->rows + (size_t)r * KVS_PARIS_ROW_N;
    const int n_r = R[KVS_PARIS_ROW_NR], sink = R[KVS_PARIS_ROW_SINK];
    int32_t *out = j->out + (size_t)task * j->max_topk;
    for (int i = 0; i < j->max_topk; i++) out[i] = -1;
    if (n_r <= 0) return;
    int topk = R[KVS_PARIS_ROW_TOPK] < n_r ? R[KVS_PARIS_ROW_TOPK] : n_r;
    if (topk > j->max_topk) topk = j->max_topk;
    const int32_t *bt = j->bts + (size_t)r * j->max_blocks;
    float qbar[1024];
    group_mean(j->q, r, g, j->nh, j->nkv, d, qbar);
    struct cand *c = kvs_xmalloc((size_t)n_r * sizeof *c);
    for (int i = 0; i < n_r; i++) {
        const int p = sink + i;
        const float *kr = j->k + (((size_t)bt[p / j->bs] * j->nkv + g) * j->bs + p % j->bs) * d;
        double dot = 0;
        for (int t = 0; t < d; t++) dot += (double)kr[t] * qbar[t];
        c[i] = (struct cand){kvs_paris_order_key((float)dot), p};
    }
    qsort(c, (size_t)n_r, sizeof *c, cand_cmp);
    for (int i = 0; i < topk; i++) out[i] = c[i].pos;
    qsort(out, (size_t)topk, sizeof *out, pos_cmp);
    free(c);
}

static void cpu_exact_topk(struct kvs_backend *be, const struct kvs_dbuf *q, const struct kvs_dbuf *kc,
                           const struct kvs_attn_meta *m, const int32_t *h_rows, int n, int n_heads, int n_kv_heads,
                           int head_dim, int block_size, int max_topk, struct kvs_dbuf *out)
{
    struct exact_job j = {F(q), F(kc), h_rows, I(m->block_tables), I(out), m->max_blocks, n_heads, n_kv_heads,
                          head_dim, block_size, max_topk};
    kvs_cpu_pool_run(be->pool, n * n_kv_heads, exact_task, &j);
}

const struct kvs_paris_kernels kvs_paris_kernels_cpu = {
    .name = "cpu",
    .supports = NULL,
    .encode = cpu_encode,
    .select = cpu_select,
    .exact_topk = cpu_exact_topk,
    .kv_elem_bytes = 4,
    .host_alloc = kvs_paris_cpu_host_alloc,
    .host_free = kvs_paris_cpu_host_free,
    .write_out = kvs_paris_cpu_write_out,
    .gather = kvs_paris_cpu_gather,
    .host_view = kvs_paris_cpu_host_view,
    .host_view_free = kvs_paris_cpu_host_view_free,
};
