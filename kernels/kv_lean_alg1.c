/* kv_lean_alg1.c: the CPU reference of LeanKV's Algorithm 1 for one head (kernels/kv_lean_alg1.h).
 * Plain C over host arrays; the quantizer is the format's (kernels/kv_lean_format.c). */
#include "kernels/kv_lean_alg1.h"

#include "kernels/cpu/cpu_kernels.h"  /* kvs_cpu_dot: the engine's dynamic mode uses the same dot, so its scores equal these bitwise */

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

struct tok {
    int32_t pos, nq;              /* position; queries that attended to it */
    float acc;                    /* sum of its (max over the group) attention probabilities */
};

struct section {
    struct kvs_lean_fmt f;
    size_t kc, vc;                /* code bytes of one K / V vector */
    int n, max_n;
    struct tok *t;                /* [capacity] */
    uint8_t *k, *v;               /* [capacity][kc], [capacity][vc] */
    uint16_t *ksz, *vsz;          /* [capacity][2] */
};

struct kvs_lean_head {
    struct kvs_lean_head_cfg c;
    struct section hi, lo;
    float *wk, *wv;               /* window ring [window + 1][head_dim] */
    struct tok *wt;               /* [window + 1] */
    int w_start, w_n;
    int pruned;
    double seen;                  /* N: tokens seen */
    float *sk, *sv, *logit;       /* scratch: [capacity][head_dim] x 2, [group][capacity] */
};

static float score_of(const struct tok *t) { return t->nq ? t->acc / (float)t->nq : 0.0f; }

static int section_init(struct section *s, struct kvs_lean_fmt f, int hd, int cap)
{
    s->f = f;
    s->kc = (size_t)hd * f.kbits / 8, s->vc = (size_t)hd * f.vbits / 8;
    s->t = calloc((size_t)cap, sizeof *s->t);
    s->k = malloc((size_t)cap * s->kc);
    s->v = malloc((size_t)cap * s->vc);
    s->ksz = malloc((size_t)cap * 2 * sizeof *s->ksz);
    s->vsz = malloc((size_t)cap * 2 * sizeof *s->vsz);
    return s->t && s->k && s->v && s->ksz && s->vsz ? 0 : -ENOMEM;
}

static void section_free(struct section *s)
{
    free(s->t), free(s->k), free(s->v), free(s->ksz), free(s->vsz);
}

void kvs_lean_head_free(struct kvs_lean_head *h)
{
    if (!h) return;
    section_free(&h->hi), section_free(&h->lo);
    free(h->wk), free(h->wv), free(h->wt), free(h->sk), free(h->sv), free(h->logit);
    free(h);
}

int kvs_lean_head_create(const struct kvs_lean_head_cfg *cfg, struct kvs_lean_head **out)
{
    *out = NULL;
    const int hd = cfg->head_dim, W = cfg->window, cap = cfg->capacity;
    if (hd <= 0 || hd % 4 || W < 1 || cap < W + 1 || cfg->group < 1 || cfg->alpha_h < 0 || cfg->alpha_l < 0)
        return -EINVAL;
    struct kvs_lean_head *h = calloc(1, sizeof *h);
    if (!h) return -ENOMEM;
    h->c = *cfg;
    int rc = section_init(&h->hi, cfg->high, hd, cap);
    if (!rc) rc = section_init(&h->lo, cfg->low, hd, cap);
    h->wk = malloc((size_t)(W + 1) * hd * sizeof(float));
    h->wv = malloc((size_t)(W + 1) * hd * sizeof(float));
    h->wt = calloc((size_t)(W + 1), sizeof *h->wt);
    h->sk = malloc((size_t)cap * hd * sizeof(float));
    h->sv = malloc((size_t)cap * hd * sizeof(float));
    h->logit = malloc((size_t)cfg->group * cap * sizeof(float));
    if (rc || !h->wk || !h->wv || !h->wt || !h->sk || !h->sv || !h->logit) {
        kvs_lean_head_free(h);
        return -ENOMEM;
    }
    *out = h;
    return 0;
}

void kvs_lean_head_counts(const struct kvs_lean_head *h, int *n_high, int *n_low, int *n_window, int *n_pruned)
{
    *n_high = h->hi.n, *n_low = h->lo.n, *n_window = h->w_n, *n_pruned = h->pruned;
}

/* slot of the window's i-th oldest token */
static int wslot(const struct kvs_lean_head *h, int i) { return (h->w_start + i) % (h->c.window + 1); }

static struct tok *token_meta(struct kvs_lean_head *h, int i)
{
    if (i < h->hi.n) return &h->hi.t[i];
    i -= h->hi.n;
    if (i < h->lo.n) return &h->lo.t[i];
    return &h->wt[wslot(h, i - h->lo.n)];
}

void kvs_lean_head_token(const struct kvs_lean_head *h, int i, int32_t *pos, float *score, int *tier, float *k,
                         float *v)
{
    const int hd = h->c.head_dim;
    const struct section *s = i < h->hi.n ? &h->hi : i < h->hi.n + h->lo.n ? &h->lo : NULL;
    if (s) {
        const int j = s == &h->hi ? i : i - h->hi.n;
        *pos = s->t[j].pos, *score = score_of(&s->t[j]), *tier = s == &h->hi ? KVS_LEAN_HIGH : KVS_LEAN_LOW;
        kvs_lean_dequantize(s->k + (size_t)j * s->kc, s->ksz + 2 * j, hd, s->f.kbits, k);
        kvs_lean_dequantize(s->v + (size_t)j * s->vc, s->vsz + 2 * j, hd, s->f.vbits, v);
        return;
    }
    const int w = wslot(h, i - h->hi.n - h->lo.n);
    *pos = h->wt[w].pos, *score = score_of(&h->wt[w]), *tier = KVS_LEAN_KEPT;
    memcpy(k, h->wk + (size_t)w * hd, hd * sizeof(float));
    memcpy(v, h->wv + (size_t)w * hd, hd * sizeof(float));
}

/* attention over every current token; probs (if not NULL) gets [group][n] probabilities */
static void attend(const struct kvs_lean_head *hc, const float *q, float scale, float *out, float *probs)
{
    struct kvs_lean_head *h = (struct kvs_lean_head *)hc;   /* scratch only */
    const int hd = h->c.head_dim, G = h->c.group, n = h->hi.n + h->lo.n + h->w_n;
    for (int i = 0; i < n; i++) {
        int32_t pos;
        int tier;
        float sc;
        kvs_lean_head_token(h, i, &pos, &sc, &tier, h->sk + (size_t)i * hd, h->sv + (size_t)i * hd);
    }
    for (int g = 0; g < G; g++) {
        const float *qg = q + (size_t)g * hd;
        float *lg = probs ? probs + (size_t)g * n : h->logit + (size_t)g * n, mx = -INFINITY, sum = 0;
        for (int i = 0; i < n; i++) {
            lg[i] = kvs_cpu_dot(qg, h->sk + (size_t)i * hd, hd) * scale;
            if (lg[i] > mx) mx = lg[i];
        }
        for (int i = 0; i < n; i++) sum += lg[i] = expf(lg[i] - mx);
        float *o = out + (size_t)g * hd;
        for (int e = 0; e < hd; e++) o[e] = 0;
        for (int i = 0; i < n; i++) {
            lg[i] /= sum;
            for (int e = 0; e < hd; e++) o[e] += lg[i] * h->sv[(size_t)i * hd + e];
        }
    }
}

void kvs_lean_head_attend(const struct kvs_lean_head *h, const float *q, float scale, float *out)
{
    attend(h, q, scale, out, NULL);
}

static void section_add(struct section *s, const float *k, const float *v, struct tok t, int hd)
{
    const int j = s->n++;
    if (s->n > s->max_n) s->max_n = s->n;
    s->t[j] = t;
    kvs_lean_quantize(k, hd, s->f.kbits, s->k + (size_t)j * s->kc, s->ksz + 2 * j);
    kvs_lean_quantize(v, hd, s->f.vbits, s->v + (size_t)j * s->vc, s->vsz + 2 * j);
}

/* removes token j, filling the hole with the section's last token */
static void section_remove(struct section *s, int j)
{
    const int last = --s->n;
    if (j == last) return;
    s->t[j] = s->t[last];
    memcpy(s->k + (size_t)j * s->kc, s->k + (size_t)last * s->kc, s->kc);
    memcpy(s->v + (size_t)j * s->vc, s->v + (size_t)last * s->vc, s->vc);
    memcpy(s->ksz + 2 * j, s->ksz + 2 * last, 2 * sizeof *s->ksz);
    memcpy(s->vsz + 2 * j, s->vsz + 2 * last, 2 * sizeof *s->vsz);
}

static int section_argmin(const struct section *s)
{
    int best = -1;
    for (int j = 0; j < s->n; j++)
        if (best < 0 || score_of(&s->t[j]) < score_of(&s->t[best])) best = j;
    return best;
}

int kvs_lean_head_step(struct kvs_lean_head *h, const float *q, const float *k, const float *v, int32_t pos,
                       float scale, float *out, struct kvs_lean_event *ev)
{
    const int hd = h->c.head_dim, G = h->c.group, W = h->c.window;
    if (h->hi.n + h->lo.n + h->w_n + 1 > h->c.capacity) return -ENOSPC;
    struct kvs_lean_event e = {-1, -1, 0, -1, -1, 0, 0};
    /* 1. the new token joins the window */
    const int w = wslot(h, h->w_n++);
    memcpy(h->wk + (size_t)w * hd, k, hd * sizeof(float));
    memcpy(h->wv + (size_t)w * hd, v, hd * sizeof(float));
    h->wt[w] = (struct tok){pos, 0, 0.0f};
    h->seen += 1;
    /* 2. attention; each token's score gets the max over the group of its probability */
    const int n = h->hi.n + h->lo.n + h->w_n;
    float *p = malloc((size_t)G * n * sizeof *p);
    if (!p) return -ENOMEM;
    attend(h, q, scale, out, p);
    for (int i = 0; i < n; i++) {
        float m = p[i];
        for (int g = 1; g < G; g++) m = fmaxf(m, p[(size_t)g * n + i]);
        struct tok *t = token_meta(h, i);
        t->acc += m;
        t->nq++;
    }
    free(p);
    /* 3. the oldest window token leaves: high, low or pruned; then the section's victim */
    if (h->w_n > W) {
        const int c = h->w_start;
        const struct tok tc = h->wt[c];
        const float *kc = h->wk + (size_t)c * hd, *vc = h->wv + (size_t)c * hd;
        h->w_start = (h->w_start + 1) % (W + 1);
        h->w_n--;
        const double N = h->seen, th = h->c.alpha_h / N, tl = h->c.alpha_l / N;
        const float s = score_of(&tc);
        e.tc_pos = tc.pos, e.tc_score = s, e.n_seen = N;
        struct section *to = NULL;
        if (s >= th) to = &h->hi, e.tc_dest = KVS_LEAN_HIGH;
        else if (s >= tl) to = &h->lo, e.tc_dest = KVS_LEAN_LOW;
        else h->pruned++, e.tc_dest = KVS_LEAN_PRUNED;
        if (to) {
            section_add(to, kc, vc, tc, hd);
            const int j = section_argmin(to);
            const struct tok vt = to->t[j];
            const float sv = score_of(&vt);
            e.victim_pos = vt.pos, e.victim_score = sv, e.victim_action = KVS_LEAN_KEPT;
            if (sv < tl) {
                section_remove(to, j);
                h->pruned++;
                e.victim_action = KVS_LEAN_PRUNED;
            } else if (to == &h->hi && sv < th) {
                float dk[1024], dv[1024];   /* head_dim <= 1024 (backend.h) */
                kvs_lean_dequantize(to->k + (size_t)j * to->kc, to->ksz + 2 * j, hd, to->f.kbits, dk);
                kvs_lean_dequantize(to->v + (size_t)j * to->vc, to->vsz + 2 * j, hd, to->f.vbits, dv);
                section_remove(to, j);
                section_add(&h->lo, dk, dv, vt, hd);
                e.victim_action = KVS_LEAN_DEMOTED;
            }
        }
    }
    if (ev) *ev = e;
    return 0;
}

void kvs_lean_head_pages(const struct kvs_lean_head *h, size_t page_bytes, int *high_pages, int *low_pages)
{
    const size_t th = page_bytes / kvs_lean_token_bytes(h->c.high, h->c.head_dim);
    const size_t tl = page_bytes / kvs_lean_token_bytes(h->c.low, h->c.head_dim);
    *high_pages = th ? (int)(((size_t)h->hi.max_n + th - 1) / th) : -1;
    *low_pages = tl ? (int)(((size_t)h->lo.max_n + tl - 1) / tl) : -1;
}

size_t kvs_lean_head_bytes(const struct kvs_lean_head *h, size_t page_bytes)
{
    int hp, lp;
    kvs_lean_head_pages(h, page_bytes, &hp, &lp);
    return (size_t)(hp + lp) * page_bytes + (size_t)h->c.window * 4 * h->c.head_dim +
           (size_t)(h->hi.max_n + h->lo.max_n) * 8;
}

static void section_shuffle(struct section *s, uint64_t *st)
{
    for (int j = s->n - 1; j > 0; j--) {
        *st ^= *st << 13, *st ^= *st >> 7, *st ^= *st << 17;
        const int r = (int)(*st % (uint64_t)(j + 1));
        /* Fisher-Yates: swap tokens j and r, codes and (s, z) with them */
        if (r == j) continue;
        struct tok t = s->t[r];
        s->t[r] = s->t[j], s->t[j] = t;
        for (size_t b = 0; b < s->kc; b++) {
            uint8_t x = s->k[(size_t)r * s->kc + b];
            s->k[(size_t)r * s->kc + b] = s->k[(size_t)j * s->kc + b], s->k[(size_t)j * s->kc + b] = x;
        }
        for (size_t b = 0; b < s->vc; b++) {
            uint8_t x = s->v[(size_t)r * s->vc + b];
            s->v[(size_t)r * s->vc + b] = s->v[(size_t)j * s->vc + b], s->v[(size_t)j * s->vc + b] = x;
        }
        for (int b = 0; b < 2; b++) {
            uint16_t x = s->ksz[2 * r + b];
            s->ksz[2 * r + b] = s->ksz[2 * j + b], s->ksz[2 * j + b] = x;
            x = s->vsz[2 * r + b];
            s->vsz[2 * r + b] = s->vsz[2 * j + b], s->vsz[2 * j + b] = x;
        }
    }
}

void kvs_lean_head_shuffle(struct kvs_lean_head *h, uint64_t seed)
{
    uint64_t st = seed | 1;
    section_shuffle(&h->hi, &st);
    section_shuffle(&h->lo, &st);
}
