/* kv_lean_dyn.c: LeanKV's dynamic mode on the CPU (kernels/kv_lean_dyn.h): page entries, the
 * per-token step of Algorithm 1 over mixed-precision pages, and one layer's batch of steps on
 * the CPU pool. Plain C: the decisions and scores equal kv_lean_alg1.c's bitwise, the output is
 * cpu_attention's online softmax over the dequantized tokens. */
#include "kernels/kv_lean_dyn.h"

#include <errno.h>
#include <math.h>
#include <string.h>

#include "base/util.h"
#include "kernels/cpu/cpu_internal.h"
#include "kernels/cpu/cpu_pool.h"

static size_t code_bytes(int bits, int d) { return (size_t)d * (size_t)bits / 8; }
static size_t entry_bytes(struct kvs_lean_fmt f, int d) { return 8 + kvs_lean_token_bytes(f, d); }

int kvs_lean_dyn_cfg_init(struct kvs_lean_dyn_cfg *c, struct kvs_lean_fmt high, struct kvs_lean_fmt low, int head_dim,
                          int group, int window, double alpha_h, double alpha_l, int tp_hi, int max_ctx)
{
    if (head_dim <= 0 || head_dim % 4 || head_dim > MAX_HEAD_DIM || group < 1 || window < 1 || tp_hi < 1 ||
        max_ctx < 1 || alpha_h < 0 || alpha_l < 0)
        return -EINVAL;
    *c = (struct kvs_lean_dyn_cfg){high, low, head_dim, group, window, alpha_h, alpha_l, tp_hi, 0, 0, 0, 0, max_ctx};
    c->entry_hi = entry_bytes(high, head_dim);
    c->entry_lo = entry_bytes(low, head_dim);
    c->page_bytes = (size_t)tp_hi * c->entry_hi;
    c->tp_lo = (int)(c->page_bytes / c->entry_lo);
    return c->tp_lo >= 1 ? 0 : -EINVAL;
}

size_t kvs_lean_dyn_head_mem(const struct kvs_lean_dyn_cfg *c)
{
    const size_t w = (size_t)c->window + 1;
    return w * (size_t)c->head_dim * 2 * sizeof(float) + w * (sizeof(int32_t) + sizeof(float));
}

void kvs_lean_dyn_head_init(const struct kvs_lean_dyn_cfg *c, struct kvs_lean_dyn_head *h, void *mem)
{
    const size_t w = (size_t)c->window + 1;
    memset(h, 0, sizeof *h);
    h->wk = mem;
    h->wv = h->wk + w * c->head_dim;
    h->wacc = h->wv + w * c->head_dim;
    h->wpos = (int32_t *)(h->wacc + w);
    h->last_pos = -1;
}

size_t kvs_lean_dyn_scratch_floats(const struct kvs_lean_dyn_cfg *c)
{
    /* a step's logits and probabilities [2][group][max_ctx + 1]; a prefill's token sums after them */
    return (2 * (size_t)c->group + 1) * ((size_t)c->max_ctx + 1);
}

static int pages_for(int n, int per) { return (n + per - 1) / per; }

void kvs_lean_dyn_head_need(const struct kvs_lean_dyn_cfg *c, const struct kvs_lean_dyn_head *h, int rows, int have_hi,
                            int have_lo, int32_t *need_hi, int32_t *need_lo)
{
    /* a section can never hold more than the request's tokens */
    int hi = h->n_high + rows, lo = h->n_low + rows;
    if (hi > c->max_ctx) hi = c->max_ctx;
    if (lo > c->max_ctx) lo = c->max_ctx;
    const int ph = pages_for(hi, c->tp_hi), pl = pages_for(lo, c->tp_lo);
    *need_hi = ph > have_hi ? ph - have_hi : 0;
    *need_lo = pl > have_lo ? pl - have_lo : 0;
}

void kvs_lean_dyn_head_keep(const struct kvs_lean_dyn_cfg *c, const struct kvs_lean_dyn_head *h, int *keep_hi,
                            int *keep_lo)
{
    *keep_hi = pages_for(h->max_high, c->tp_hi);
    *keep_lo = pages_for(h->max_low, c->tp_lo);
}

/* ---- entries -------------------------------------------------------------------------------- */
struct entry {
    uint8_t *p;                   /* [pos][acc][K codes][K sz][V codes][V sz] */
    struct kvs_lean_fmt f;
};

static struct entry entry_at(const struct kvs_lean_dyn_cfg *c, const struct kvs_lean_dyn_pages *pg, int tier, int j)
{
    if (tier == KVS_LEAN_HIGH) {
        KVS_ASSERT(j / c->tp_hi < pg->n_high_pages);
        return (struct entry){pg->base + (size_t)pg->table[j / c->tp_hi] * c->page_bytes +
                                  (size_t)(j % c->tp_hi) * c->entry_hi, c->high};
    }
    KVS_ASSERT(j / c->tp_lo < pg->n_low_pages);
    return (struct entry){pg->base + (size_t)pg->table[pg->table_len - 1 - j / c->tp_lo] * c->page_bytes +
                              (size_t)(j % c->tp_lo) * c->entry_lo, c->low};
}

static int32_t e_pos(struct entry e)
{
    int32_t p;
    memcpy(&p, e.p, 4);
    return p;
}

static float e_acc(struct entry e)
{
    float a;
    memcpy(&a, e.p + 4, 4);
    return a;
}

static void e_set(struct entry e, int32_t pos, float acc)
{
    memcpy(e.p, &pos, 4);
    memcpy(e.p + 4, &acc, 4);
}

/* K side at e.p + 8: codes then (s, z); V side after it */
static void e_dequant(struct entry e, int hd, float *k, float *v)
{
    const size_t kc = code_bytes(e.f.kbits, hd), vc = code_bytes(e.f.vbits, hd);
    const uint8_t *p = e.p + 8;
    uint16_t sz[2] = {0, 0};
    if (e.f.kbits < 16) memcpy(sz, p + kc, 4);
    if (k) kvs_lean_dequantize(p, sz, hd, e.f.kbits, k);
    p += kc + (e.f.kbits < 16 ? 4 : 0);
    sz[0] = sz[1] = 0;
    if (e.f.vbits < 16) memcpy(sz, p + vc, 4);
    if (v) kvs_lean_dequantize(p, sz, hd, e.f.vbits, v);
}

static void e_quant(struct entry e, int hd, const float *k, const float *v)
{
    const size_t kc = code_bytes(e.f.kbits, hd);
    uint8_t *p = e.p + 8;
    uint16_t sz[2];
    kvs_lean_quantize(k, hd, e.f.kbits, p, sz);
    if (e.f.kbits < 16) memcpy(p + kc, sz, 4);
    p += kc + (e.f.kbits < 16 ? 4 : 0);
    kvs_lean_quantize(v, hd, e.f.vbits, p, sz);
    if (e.f.vbits < 16) memcpy(p + code_bytes(e.f.vbits, hd), sz, 4);
}

/* a token's score: its sum over the queries since it arrived (kv_lean_alg1.c's acc / nq) */
static float score(float acc, int32_t pos, int32_t last) { return last >= pos ? acc / (float)(last - pos + 1) : 0.0f; }

/* ---- the step ------------------------------------------------------------------------------- */
int kvs_lean_dyn_head_tokens(const struct kvs_lean_dyn_head *h) { return h->n_high + h->n_low + h->w_n; }

static int wslot(const struct kvs_lean_dyn_cfg *c, const struct kvs_lean_dyn_head *h, int i)
{
    return (h->w_start + i) % (c->window + 1);
}

void kvs_lean_dyn_head_token(const struct kvs_lean_dyn_cfg *c, const struct kvs_lean_dyn_head *h,
                             const struct kvs_lean_dyn_pages *pg, int i, int32_t *pos, float *sc, int *tier, float *k,
                             float *v)
{
    if (i < h->n_high + h->n_low) {
        const int hi = i < h->n_high;
        struct entry e = entry_at(c, pg, hi ? KVS_LEAN_HIGH : KVS_LEAN_LOW, hi ? i : i - h->n_high);
        *pos = e_pos(e), *sc = score(e_acc(e), *pos, h->last_pos), *tier = hi ? KVS_LEAN_HIGH : KVS_LEAN_LOW;
        e_dequant(e, c->head_dim, k, v);
        return;
    }
    const int w = wslot(c, h, i - h->n_high - h->n_low);
    *pos = h->wpos[w], *sc = score(h->wacc[w], *pos, h->last_pos), *tier = KVS_LEAN_KEPT;
    if (k) memcpy(k, h->wk + (size_t)w * c->head_dim, (size_t)c->head_dim * sizeof(float));
    if (v) memcpy(v, h->wv + (size_t)w * c->head_dim, (size_t)c->head_dim * sizeof(float));
}

/* moves entry `from` of a section over entry `to` (the hole) */
static void e_move(struct entry to, struct entry from, size_t bytes)
{
    if (to.p != from.p) memcpy(to.p, from.p, bytes);
}

static int section_argmin(const struct kvs_lean_dyn_cfg *c, const struct kvs_lean_dyn_head *h,
                          const struct kvs_lean_dyn_pages *pg, int tier, int n, float *best_score)
{
    int best = -1;
    float bs = 0;
    for (int j = 0; j < n; j++) {
        struct entry e = entry_at(c, pg, tier, j);
        const float s = score(e_acc(e), e_pos(e), h->last_pos);
        if (best < 0 || s < bs) best = j, bs = s;
    }
    *best_score = bs;
    return best;
}

void kvs_lean_dyn_head_step(const struct kvs_lean_dyn_cfg *c, struct kvs_lean_dyn_head *h,
                            const struct kvs_lean_dyn_pages *pg, const float *q, const float *k, const float *v,
                            int32_t pos, float scale, float *out, float *scratch, struct kvs_lean_event *ev)
{
    kvs_lean_dyn_head_step_ext(c, h, pg, q, k, v, pos, scale, NULL, out, scratch, ev);
}

/* The normalized probabilities pr[g * n + i] of a row's logits lg (the scores need them), with the
 * other part's mass (ext: its lse, -inf or NULL for none) in the normalization, and a fresh
 * online_add state (mx, l, acc). */
static void probs_init(int G, int hd, int n, const float *lg, const float *ext, float *pr, float *mx, float *l,
                       float (*acc)[MAX_HEAD_DIM])
{
    for (int g = 0; g < G; g++) {
        const float *lgg = lg + (size_t)g * n;
        float *p = pr + (size_t)g * n, m = -INFINITY, sum = 0;
        for (int i = 0; i < n; i++)
            if (lgg[i] > m) m = lgg[i];
        const float e = ext ? ext[g] : -INFINITY;
        if (e > m) m = e;
        for (int i = 0; i < n; i++) sum += p[i] = expf(lgg[i] - m);
        if (e > -INFINITY) sum += expf(e - m);
        for (int i = 0; i < n; i++) p[i] /= sum;
        mx[g] = -INFINITY, l[g] = 0.0f;
        for (int d = 0; d < hd; d++) acc[g][d] = 0.0f;
    }
}

/* The online softmax of one stored token i for the group's G query heads: logits lg[g * n + i],
 * value row vp, running maxima mx, sums l and unnormalised outputs acc (the decode step's and the
 * prefill's rows share it, so both round alike). */
static void online_add(int G, int hd, const float *lg, int n, int i, const float *vp, float *mx, float *l,
                       float (*acc)[MAX_HEAD_DIM])
{
    for (int g = 0; g < G; g++) {
        const float s = lg[(size_t)g * n + i];
        if (s > mx[g]) {
            const float corr = expf(mx[g] - s);
            l[g] *= corr;
            for (int d = 0; d < hd; d++) acc[g][d] *= corr;
            mx[g] = s;
        }
        const float wt = expf(s - mx[g]);
        l[g] += wt;
        for (int d = 0; d < hd; d++) acc[g][d] += wt * vp[d];
    }
}

/* The row's outputs from online_add's state; with ext (the other part's lse, -inf or NULL for none,
 * its output already in out) the two are merged with weights exp(. - M) of both sums. */
static void online_finish(int G, int hd, const float *mx, const float *l, float (*acc)[MAX_HEAD_DIM],
                          const float *ext, float *out)
{
    for (int g = 0; g < G; g++) {
        const float e = ext ? ext[g] : -INFINITY;
        if (e > -INFINITY) {
            const float M = mx[g] > e ? mx[g] : e, a = expf(mx[g] - M), b = expf(e - M), inv = 1.0f / (l[g] * a + b);
            for (int d = 0; d < hd; d++)
                out[(size_t)g * hd + d] = (acc[g][d] * a + out[(size_t)g * hd + d] * b) * inv;
            continue;
        }
        const float inv = 1.0f / l[g];
        for (int d = 0; d < hd; d++) out[(size_t)g * hd + d] = acc[g][d] * inv;
    }
}

void kvs_lean_dyn_head_step_ext(const struct kvs_lean_dyn_cfg *c, struct kvs_lean_dyn_head *h,
                                const struct kvs_lean_dyn_pages *pg, const float *q, const float *k, const float *v,
                                int32_t pos, float scale, const float *ext_lse, float *out, float *scratch,
                                struct kvs_lean_event *ev)
{
    const int hd = c->head_dim, G = c->group;
    /* 1. the new token joins the window; a fresh head's N starts at the positions before it
     * (cached documents) */
    const int w = wslot(c, h, h->w_n++);
    memcpy(h->wk + (size_t)w * hd, k, (size_t)hd * sizeof(float));
    memcpy(h->wv + (size_t)w * hd, v, (size_t)hd * sizeof(float));
    h->wpos[w] = pos, h->wacc[w] = 0.0f;
    if (h->seen == 0) h->seen = pos;
    h->seen++;
    h->last_pos = pos;
    /* 2. logits of the group over every token (high, low, window), then per head the two-pass
     * probabilities of the reference (scores) and the online softmax of cpu_attention (out) */
    const int n = kvs_lean_dyn_head_tokens(h), nhl = h->n_high + h->n_low;
    float *lg = scratch, *pr = scratch + (size_t)G * n;
    float kx[MAX_HEAD_DIM], vx[MAX_HEAD_DIM], acc[8][MAX_HEAD_DIM], mx[8], l[8];
    KVS_ASSERT(G <= 8 && (size_t)2 * G * n <= kvs_lean_dyn_scratch_floats(c));
    for (int i = 0; i < n; i++) {
        const float *kp = kx;
        if (i < nhl) e_dequant(entry_at(c, pg, i < h->n_high ? KVS_LEAN_HIGH : KVS_LEAN_LOW,
                                        i < h->n_high ? i : i - h->n_high), hd, kx, NULL);
        else kp = h->wk + (size_t)wslot(c, h, i - nhl) * hd;
        for (int g = 0; g < G; g++) lg[(size_t)g * n + i] = dot_f32(q + (size_t)g * hd, kp, hd) * scale;
    }
    probs_init(G, hd, n, lg, ext_lse, pr, mx, l, acc);
    for (int i = 0; i < n; i++) {
        const float *vp = vx;
        float sc = pr[i];
        for (int g = 1; g < G; g++) sc = fmaxf(sc, pr[(size_t)g * n + i]);
        if (i < nhl) {
            struct entry en = entry_at(c, pg, i < h->n_high ? KVS_LEAN_HIGH : KVS_LEAN_LOW,
                                       i < h->n_high ? i : i - h->n_high);
            e_dequant(en, hd, NULL, vx);
            e_set(en, e_pos(en), e_acc(en) + sc);
        } else {
            const int ws = wslot(c, h, i - nhl);
            vp = h->wv + (size_t)ws * hd;
            h->wacc[ws] += sc;
        }
        online_add(G, hd, lg, n, i, vp, mx, l, acc);
    }
    online_finish(G, hd, mx, l, acc, ext_lse, out);
    kvs_lean_dyn_head_exit(c, h, pg, ev);
}

void kvs_lean_dyn_head_exit(const struct kvs_lean_dyn_cfg *c, struct kvs_lean_dyn_head *h,
                            const struct kvs_lean_dyn_pages *pg, struct kvs_lean_event *ev)
{
    const int hd = c->head_dim, W = c->window;
    struct kvs_lean_event e = {-1, -1, 0, -1, -1, 0, 0};
    /* 3. the oldest window token leaves: high, low or pruned; then the section's victim */
    if (h->w_n > W) {
        const int cw = h->w_start;
        const int32_t tpos = h->wpos[cw];
        const float *kc = h->wk + (size_t)cw * hd, *vc = h->wv + (size_t)cw * hd;
        const float s = score(h->wacc[cw], tpos, h->last_pos), tacc = h->wacc[cw];
        h->w_start = (h->w_start + 1) % (W + 1);
        h->w_n--;
        const double N = (double)h->seen, th = c->alpha_h / N, tl = c->alpha_l / N;
        e.tc_pos = tpos, e.tc_score = s, e.n_seen = N;
        int tier = 0;
        if (s >= th) tier = KVS_LEAN_HIGH, e.tc_dest = KVS_LEAN_HIGH;
        else if (s >= tl) tier = KVS_LEAN_LOW, e.tc_dest = KVS_LEAN_LOW;
        else h->pruned++, e.tc_dest = KVS_LEAN_PRUNED;
        if (tier) {
            int *n_sec = tier == KVS_LEAN_HIGH ? &h->n_high : &h->n_low;
            int *max_sec = tier == KVS_LEAN_HIGH ? &h->max_high : &h->max_low;
            struct entry ne = entry_at(c, pg, tier, (*n_sec)++);
            if (*n_sec > *max_sec) *max_sec = *n_sec;
            e_set(ne, tpos, tacc);
            e_quant(ne, hd, kc, vc);
            float sv;
            const int j = section_argmin(c, h, pg, tier, *n_sec, &sv);
            struct entry ve = entry_at(c, pg, tier, j);
            const int32_t vpos = e_pos(ve);
            const float vacc = e_acc(ve);
            const size_t eb = tier == KVS_LEAN_HIGH ? c->entry_hi : c->entry_lo;
            e.victim_pos = vpos, e.victim_score = sv, e.victim_action = KVS_LEAN_KEPT;
            if (sv < tl) {
                e_move(ve, entry_at(c, pg, tier, --*n_sec), eb);
                h->pruned++;
                e.victim_action = KVS_LEAN_PRUNED;
            } else if (tier == KVS_LEAN_HIGH && sv < th) {
                float dk[MAX_HEAD_DIM], dv[MAX_HEAD_DIM];
                e_dequant(ve, hd, dk, dv);
                e_move(ve, entry_at(c, pg, tier, --*n_sec), eb);
                struct entry le = entry_at(c, pg, KVS_LEAN_LOW, h->n_low++);
                if (h->n_low > h->max_low) h->max_low = h->n_low;
                e_set(le, vpos, vacc);
                e_quant(le, hd, dk, dv);
                e.victim_action = KVS_LEAN_DEMOTED;
            }
        }
    }
    if (ev) *ev = e;
}

/* ---- the prefill (kvs_lean_dyn_head_prefill) ----------------------------------------------- */
/* the ring slot of sequence index t, the old window's tokens first, then the chunk's: the slot a
 * token of the chunk keeps if it stays in the window (the CUDA prefill lays the ring the same) */
static int pslot(const struct kvs_lean_dyn_cfg *c, const struct kvs_lean_dyn_head *h, int t)
{
    return (h->w_start + t) % (c->window + 1);
}

void kvs_lean_dyn_head_prefill(const struct kvs_lean_dyn_cfg *c, struct kvs_lean_dyn_head *h,
                               const struct kvs_lean_dyn_pages *pg, const struct kvs_lean_dyn_rows *in, float scale,
                               float *scratch)
{
    const int hd = c->head_dim, G = c->group, W = c->window, R = in->rows;
    const int nhl = h->n_high + h->n_low, nw = h->w_n, nprev = nhl + nw, T = nw + R;
    float *lg = scratch, *pr = scratch + (size_t)G * (c->max_ctx + 1), *tsum = pr + (size_t)G * (c->max_ctx + 1);
    float kx[MAX_HEAD_DIM], vx[MAX_HEAD_DIM], acc[8][MAX_HEAD_DIM], mx[8], l[8];
    KVS_ASSERT(G <= 8 && R >= 1 && nprev + R <= c->max_ctx + 1);
    for (int t = 0; t < nprev + R; t++) tsum[t] = 0.0f;
    /* 1. every row attends over the head's tokens as stored (sections dequantized, the window)
     * and the chunk's rows up to its own, in that order; the probabilities (two-pass, as the
     * step's) are summed per token in row order, the output is the step's online softmax */
    for (int r = 0; r < R; r++) {
        const int n = nprev + r + 1;
        const float *q = in->q + (size_t)r * in->q_stride;
        const float *ext = in->ext_lse ? in->ext_lse + (size_t)r * in->ext_stride : NULL;
        float *out = in->out + (size_t)r * in->q_stride;
        for (int i = 0; i < n; i++) {
            const float *kp = kx;
            if (i < nhl) e_dequant(entry_at(c, pg, i < h->n_high ? KVS_LEAN_HIGH : KVS_LEAN_LOW,
                                            i < h->n_high ? i : i - h->n_high), hd, kx, NULL);
            else if (i < nprev) kp = h->wk + (size_t)wslot(c, h, i - nhl) * hd;
            else kp = in->k + (size_t)(i - nprev) * in->kv_stride;
            for (int g = 0; g < G; g++) lg[(size_t)g * n + i] = dot_f32(q + (size_t)g * hd, kp, hd) * scale;
        }
        probs_init(G, hd, n, lg, ext, pr, mx, l, acc);
        for (int i = 0; i < n; i++) {
            const float *vp = vx;
            float sc = pr[i];
            for (int g = 1; g < G; g++) sc = fmaxf(sc, pr[(size_t)g * n + i]);
            tsum[i] += sc;
            if (i < nhl) e_dequant(entry_at(c, pg, i < h->n_high ? KVS_LEAN_HIGH : KVS_LEAN_LOW,
                                            i < h->n_high ? i : i - h->n_high), hd, NULL, vx);
            else if (i < nprev) vp = h->wv + (size_t)wslot(c, h, i - nhl) * hd;
            else vp = in->v + (size_t)(i - nprev) * in->kv_stride;
            online_add(G, hd, lg, n, i, vp, mx, l, acc);
        }
        online_finish(G, hd, mx, l, acc, ext, out);
    }
    /* 2. the scores: each stored token's sum gets the chunk's, once (in row order above) */
    for (int i = 0; i < nhl; i++) {
        struct entry e = entry_at(c, pg, i < h->n_high ? KVS_LEAN_HIGH : KVS_LEAN_LOW, i < h->n_high ? i : i - h->n_high);
        e_set(e, e_pos(e), e_acc(e) + tsum[i]);
    }
    for (int i = 0; i < nw; i++) h->wacc[wslot(c, h, i)] += tsum[nhl + i];
    /* 3. the paper's prefill rule for every token that leaves the window at the chunk's end (the
     * oldest T - W of the old window's and the chunk's, in position order): token i (1-based
     * position pos + 1, cached documents counted) goes high if its score (its sum over the
     * queries since it arrived, to the chunk's last) >= alpha_h / i, low if >= alpha_l / i,
     * else it is pruned; no victim (the sections only grow) */
    const int32_t last = in->pos0 + R - 1;
    if (h->seen == 0) h->seen = in->pos0;
    h->seen += R;
    h->last_pos = last;
    const int leave = T > W ? T - W : 0;
    for (int t = 0; t < leave; t++) {
        int32_t pos;
        float a;
        const float *kp, *vp;
        if (t < nw) {
            const int ws = pslot(c, h, t);
            pos = h->wpos[ws], a = h->wacc[ws], kp = h->wk + (size_t)ws * hd, vp = h->wv + (size_t)ws * hd;
        } else {
            const int j = t - nw;
            pos = in->pos0 + j, a = tsum[nprev + j];
            kp = in->k + (size_t)j * in->kv_stride, vp = in->v + (size_t)j * in->kv_stride;
        }
        const float s = score(a, pos, last);
        const double i1 = (double)pos + 1.0, th = c->alpha_h / i1, tl = c->alpha_l / i1;
        const int tier = s >= th ? KVS_LEAN_HIGH : s >= tl ? KVS_LEAN_LOW : 0;
        if (!tier) {
            h->pruned++;
            continue;
        }
        int *n_sec = tier == KVS_LEAN_HIGH ? &h->n_high : &h->n_low;
        int *max_sec = tier == KVS_LEAN_HIGH ? &h->max_high : &h->max_low;
        struct entry ne = entry_at(c, pg, tier, (*n_sec)++);
        if (*n_sec > *max_sec) *max_sec = *n_sec;
        e_set(ne, pos, a);
        e_quant(ne, hd, kp, vp);
    }
    /* 4. the window: the newest min(T, W) tokens, each at its sequence slot (an old window token
     * that stays is where it was; the slots of the ones that left are free by now) */
    for (int t = leave > nw ? leave : nw; t < T; t++) {
        const int ws = pslot(c, h, t), j = t - nw;
        memcpy(h->wk + (size_t)ws * hd, in->k + (size_t)j * in->kv_stride, (size_t)hd * sizeof(float));
        memcpy(h->wv + (size_t)ws * hd, in->v + (size_t)j * in->kv_stride, (size_t)hd * sizeof(float));
        h->wpos[ws] = in->pos0 + j, h->wacc[ws] = tsum[nprev + j];
    }
    h->w_start = pslot(c, h, leave);
    h->w_n = T - leave;
}

static void section_shuffle(const struct kvs_lean_dyn_cfg *c, const struct kvs_lean_dyn_pages *pg, int tier, int n,
                            uint64_t *st)
{
    const size_t eb = tier == KVS_LEAN_HIGH ? c->entry_hi : c->entry_lo;
    uint8_t tmp[8 + 2 * (MAX_HEAD_DIM * 2 + 4)];
    for (int j = n - 1; j > 0; j--) {
        *st ^= *st << 13, *st ^= *st >> 7, *st ^= *st << 17;
        const int r = (int)(*st % (uint64_t)(j + 1));
        if (r == j) continue;
        struct entry a = entry_at(c, pg, tier, j), b = entry_at(c, pg, tier, r);
        memcpy(tmp, a.p, eb), memcpy(a.p, b.p, eb), memcpy(b.p, tmp, eb);
    }
}

void kvs_lean_dyn_head_shuffle(const struct kvs_lean_dyn_cfg *c, struct kvs_lean_dyn_head *h,
                               const struct kvs_lean_dyn_pages *pg, uint64_t seed)
{
    uint64_t st = seed | 1;
    section_shuffle(c, pg, KVS_LEAN_HIGH, h->n_high, &st);
    section_shuffle(c, pg, KVS_LEAN_LOW, h->n_low, &st);
}

/* ---- one layer's batch ---------------------------------------------------------------------- */
struct batch {
    const struct kvs_lean_dyn_job *j;
    int n_tasks;
};

/* task t runs pairs (sequence, KV head) t, t + n_tasks, ... with scratch t: a pair's rows
 * depend on each other (each step changes the head), pairs do not */
static void batch_task(void *ctx, int t)
{
    const struct batch *b = ctx;
    const struct kvs_lean_dyn_job *j = b->j;
    const struct kvs_lean_dyn_cfg *c = j->cfg;
    const int hd = c->head_dim, G = c->group;
    float *scratch = j->scratch + (size_t)t * kvs_lean_dyn_scratch_floats(c);
    const float *q = F(j->q);
    float *out = F(j->out);
    for (int pair = t; pair < j->n_seqs * j->n_kv_heads; pair += b->n_tasks) {
        const int s = pair / j->n_kv_heads, g = pair % j->n_kv_heads;
        struct kvs_lean_dyn_head *h = j->heads[pair];
        if (!h) continue;
        const int rows = j->q_start[s + 1] - j->q_start[s];
        if (rows > 1) {   /* a prompt chunk: the paper's prefill */
            const size_t qo = ((size_t)j->q_start[s] * j->n_heads + (size_t)g * G) * hd;
            const size_t ko = ((size_t)j->q_start[s] * j->n_kv_heads + g) * hd;
            const struct kvs_lean_dyn_rows in = {
                rows, j->pos[s], q + qo, out + qo, (size_t)j->n_heads * hd, j->k + ko, j->v + ko,
                (size_t)j->n_kv_heads * hd,
                j->ext_lse ? F(j->ext_lse) + (size_t)j->q_start[s] * j->n_heads + (size_t)g * G : NULL,
                (size_t)j->n_heads};
            kvs_lean_dyn_head_prefill(c, h, &j->pages[pair], &in, j->scale, scratch);
            continue;
        }
        for (int r = j->q_start[s]; r < j->q_start[s + 1]; r++) {
            const size_t qo = ((size_t)r * j->n_heads + (size_t)g * G) * hd, ko = ((size_t)r * j->n_kv_heads + g) * hd;
            const float *ext = j->ext_lse ? F(j->ext_lse) + (size_t)r * j->n_heads + (size_t)g * G : NULL;
            kvs_lean_dyn_head_step_ext(c, h, &j->pages[pair], q + qo, j->k + ko, j->v + ko,
                                       j->pos[s] + (r - j->q_start[s]), j->scale, ext, out + qo, scratch, NULL);
        }
    }
}

void kvs_lean_dyn_cpu_attend(struct kvs_backend *b, const struct kvs_lean_dyn_job *j)
{
    struct batch bt = {j, j->n_scratch};
    const int pairs = j->n_seqs * j->n_kv_heads;
    if (bt.n_tasks > pairs) bt.n_tasks = pairs;
    if (bt.n_tasks < 1) return;
    kvs_cpu_pool_run(b->pool, bt.n_tasks, batch_task, &bt);
}

int kvs_lean_dyn_cpu_threads(struct kvs_backend *b) { return kvs_cpu_pool_threads(b->pool); }
