/* test_kv_lean_dyn_prefill.c: LeanKV's dynamic mode, the paper's prefill (kernels/kv_lean_dyn.h
 * kvs_lean_dyn_head_prefill) on fresh random inputs:
 *   1. placement against a straightforward reference of the paper's prompt rule, chunk by chunk:
 *      the reference keeps its own token list (sections as dequantized values of the same
 *      quantizer, the window and the chunk in fp32), attends each row in double over the stored
 *      tokens and the chunk's rows up to its own, sums each token's probabilities (max over the
 *      group), and places every token that leaves the window at the chunk's end: high if score
 *      >= alpha_h / (pos + 1), low if >= alpha_l / (pos + 1), else pruned. The prefill must
 *      agree on every tier (a token whose reference score lies within 1e-4 of a threshold may
 *      go either way: the reference then follows the prefill, and such cases are counted),
 *      the scores (1e-4 relative), the stored values (bitwise) and the outputs (2e-4); the page
 *      manager's invariant holds after every chunk and the pages kept are the sections' peaks;
 *      decode steps (Algorithm 1) then continue from the prefilled state, tokens conserved;
 *   2. neutral: K16V16 tiers with alpha_h = alpha_l = 0 keep every token and every prefill row
 *      equals dense CPU attention (the reference kernels) bitwise. */
#include "kernels/backend.h"
#include "kernels/kv_lean.h"
#include "kernels/kv_lean_dyn.h"
#include "kernels/kv_lean_pages.h"
#include "tests/unit/kv_lean_case.h"
#include "tests/unit/test_util.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern const struct kvs_backend_ops kvs_cpu_backend;
static const struct kvs_backend_ops *o = &kvs_cpu_backend;

#define HD 32
#define G 2
#define W 8
#define STEPS 120                 /* prompt + decode tokens */
#define PROMPT 100
#define TP 4

static const int chunks[] = {3, 29, 32, 5, 2, 29};   /* below, at and above the window; sums to PROMPT */
static uint64_t rng = 0x9E3779B97F4A7C15ull;
static float frand(void) { return (float)((double)kvs_test_xorshift(&rng) / 4294967296.0) * 2.0f - 1.0f; }
static const float SCALE = 0.17677669529663687f;

struct stream {
    float q[STEPS][G][HD], k[STEPS][HD], v[STEPS][HD];
};

/* peaked keys (a liked direction; queries turn away at 60%) so that scores spread; fp16-exact
 * values when asked (the neutral test's K16V16 tiers then store them exactly) */
static void make_stream(struct stream *s, int fp16_exact)
{
    float dir[HD];
    for (int e = 0; e < HD; e++) dir[e] = frand();
    for (int t = 0; t < STEPS; t++) {
        const float boost = t % 11 == 0 ? 1.5f : 0.9f * frand();
        const float lean = t < STEPS * 6 / 10 ? 0.9f : -0.6f;
        for (int e = 0; e < HD; e++) {
            s->k[t][e] = frand() + boost * dir[e];
            s->v[t][e] = frand();
            for (int g = 0; g < G; g++) s->q[t][g][e] = frand() + lean * dir[e];
        }
        if (fp16_exact) {
            uint8_t codes[2 * HD];
            uint16_t sz[2];
            kvs_lean_quantize(s->k[t], HD, 16, codes, sz);
            kvs_lean_dequantize(codes, sz, HD, 16, s->k[t]);
            kvs_lean_quantize(s->v[t], HD, 16, codes, sz);
            kvs_lean_dequantize(codes, sz, HD, 16, s->v[t]);
        }
    }
}

/* a prompt chunk as the storage runs it: a round for the worst case, the prefill, the trim */
static void dhead_chunk(struct dhead *d, const struct stream *s, int t0, int rows, float *out)
{
    struct kvs_lean_dyn_pages pg = dhead_pages(d);
    int32_t nh, nl;
    kvs_lean_dyn_head_need(&d->c, &d->h, rows, pg.n_high_pages, pg.n_low_pages, &nh, &nl);
    REQUIRE(kvs_lean_pm_alloc(d->pm, &nh, &nl) == 0, "page round");
    pg = dhead_pages(d);
    const struct kvs_lean_dyn_rows in = {rows, t0, &s->q[t0][0][0], out, (size_t)G * HD, s->k[t0], s->v[t0], HD,
                                         NULL, 0};
    kvs_lean_dyn_head_prefill(&d->c, &d->h, &pg, &in, SCALE, d->scratch);
    int kh, kl;
    kvs_lean_dyn_head_keep(&d->c, &d->h, &kh, &kl);
    kvs_lean_pm_trim(d->pm, 0, kh, kl);
}

static void dhead_decode(struct dhead *d, const struct stream *s, int t, float *out)
{
    struct kvs_lean_dyn_pages pg = dhead_pages(d);
    int32_t nh, nl;
    kvs_lean_dyn_head_need(&d->c, &d->h, 1, pg.n_high_pages, pg.n_low_pages, &nh, &nl);
    REQUIRE(kvs_lean_pm_alloc(d->pm, &nh, &nl) == 0, "page round");
    pg = dhead_pages(d);
    kvs_lean_dyn_head_step(&d->c, &d->h, &pg, &s->q[t][0][0], s->k[t], s->v[t], t, SCALE, out, d->scratch, NULL);
    int kh, kl;
    kvs_lean_dyn_head_keep(&d->c, &d->h, &kh, &kl);
    kvs_lean_pm_trim(d->pm, 0, kh, kl);
}

/* ---- 1. the reference of the prompt rule ---------------------------------------------------- */
struct rtok {
    int32_t pos;
    int tier;                     /* KVS_LEAN_HIGH, KVS_LEAN_LOW, KVS_LEAN_KEPT (window); 0: pruned */
    double acc;
    float k[HD], v[HD];           /* as stored: dequantized in a section, raw in the window */
};

static void store_as(struct rtok *t, struct kvs_lean_fmt f)
{
    uint8_t codes[2 * HD];
    uint16_t sz[2];
    kvs_lean_quantize(t->k, HD, f.kbits, codes, sz);
    kvs_lean_dequantize(codes, sz, HD, f.kbits, t->k);
    kvs_lean_quantize(t->v, HD, f.vbits, codes, sz);
    kvs_lean_dequantize(codes, sz, HD, f.vbits, t->v);
}

/* the prefill's view of position p: tier (0 when absent, i.e. pruned), score, K, V */
static int impl_token(const struct dhead *d, int32_t p, float *score, float *k, float *v)
{
    const struct kvs_lean_dyn_pages pg = dhead_pages(d);
    for (int i = 0; i < kvs_lean_dyn_head_tokens(&d->h); i++) {
        int32_t pos;
        int tier;
        float sc, kk[HD], vv[HD];
        kvs_lean_dyn_head_token(&d->c, &d->h, &pg, i, &pos, &sc, &tier, kk, vv);
        if (pos != p) continue;
        *score = sc;
        if (k) memcpy(k, kk, sizeof kk), memcpy(v, vv, sizeof vv);
        return tier;
    }
    return 0;
}

static void test_rule(const char *name, struct kvs_lean_fmt hi, struct kvs_lean_fmt lo, double ah, double al,
                      int want_mix)
{
    struct stream *s = malloc(sizeof *s);
    struct rtok *rt = calloc(STEPS, sizeof *rt);
    REQUIRE(s && rt, "alloc");
    make_stream(s, 0);
    struct dhead d;
    REQUIRE(kvs_lean_dyn_cfg_init(&d.c, hi, lo, HD, G, W, ah, al, TP, STEPS + 1) == 0, "cfg");
    dhead_alloc(&d, STEPS);
    int n_hi = 0, n_lo = 0, n_pr = 0, ambiguous = 0, bad_tier = 0, bad_val = 0, placed = 0;
    double max_out = 0, max_sc = 0;
    char msg[256];
    int t0 = 0;
    for (size_t ci = 0; ci < sizeof chunks / sizeof *chunks; ci++) {
        const int R = chunks[ci];
        float out[32][G][HD];
        dhead_chunk(&d, s, t0, R, &out[0][0][0]);
        REQUIRE(kvs_lean_pm_check(d.pm, msg, sizeof msg) == 0, "%s: chunk %zu: %s", name, ci, msg);
        /* the reference: rows in double over the stored tokens and the chunk's rows so far */
        for (int j = 0; j < R; j++) {
            struct rtok *t = &rt[t0 + j];
            *t = (struct rtok){t0 + j, KVS_LEAN_KEPT, 0.0, {0}, {0}};
            memcpy(t->k, s->k[t0 + j], sizeof t->k), memcpy(t->v, s->v[t0 + j], sizeof t->v);
        }
        for (int r = 0; r < R; r++) {
            const int row = t0 + r;
            double lg[G][STEPS], pmax[STEPS];
            for (int i = 0; i <= row; i++) pmax[i] = 0;
            for (int g = 0; g < G; g++) {
                double m = -INFINITY, sum = 0, ref[HD] = {0};
                for (int i = 0; i <= row; i++) {
                    if (!rt[i].tier) continue;
                    double x = 0;
                    for (int e = 0; e < HD; e++) x += (double)s->q[row][g][e] * rt[i].k[e];
                    lg[g][i] = x * SCALE;
                    m = fmax(m, lg[g][i]);
                }
                for (int i = 0; i <= row; i++)
                    if (rt[i].tier) sum += lg[g][i] = exp(lg[g][i] - m);
                for (int i = 0; i <= row; i++) {
                    if (!rt[i].tier) continue;
                    const double p = lg[g][i] / sum;
                    pmax[i] = fmax(pmax[i], p);
                    for (int e = 0; e < HD; e++) ref[e] += p * rt[i].v[e];
                }
                for (int e = 0; e < HD; e++) max_out = fmax(max_out, fabs(ref[e] - out[r][g][e]));
            }
            for (int i = 0; i <= row; i++)
                if (rt[i].tier) rt[i].acc += pmax[i];
        }
        /* the tokens that leave the window: all but the newest W, in position order */
        const int32_t last = t0 + R - 1;
        for (int p = 0; p <= last - W; p++) {
            struct rtok *t = &rt[p];
            if (t->tier != KVS_LEAN_KEPT) continue;
            const double sc = t->acc / (double)(last - p + 1), th = ah / (p + 1.0), tl = al / (p + 1.0);
            int tier = sc >= th ? KVS_LEAN_HIGH : sc >= tl ? KVS_LEAN_LOW : 0;
            float isc, ik[HD], iv[HD];
            const int got = impl_token(&d, p, &isc, ik, iv);
            const int near = (th > 0 && fabs(sc - th) <= 1e-4 * th) || (tl > 0 && fabs(sc - tl) <= 1e-4 * tl);
            if (got != tier) {
                if (near) ambiguous++, tier = got;
                else if (bad_tier++ < 3) printf("  %s: pos %d: reference tier %d (score %.9g, th %.9g tl %.9g), "
                                                "prefill %d\n", name, p, tier, sc, th, tl, got);
            }
            placed++;
            t->tier = tier;
            if (tier == KVS_LEAN_HIGH) n_hi++, store_as(t, hi);
            else if (tier == KVS_LEAN_LOW) n_lo++, store_as(t, lo);
            else n_pr++;
            if (tier && got == tier && (memcmp(ik, t->k, sizeof ik) || memcmp(iv, t->v, sizeof iv))) bad_val++;
        }
        /* every kept token's score */
        for (int p = 0; p <= last; p++) {
            if (!rt[p].tier) continue;
            float isc;
            if (!impl_token(&d, p, &isc, NULL, NULL)) continue;
            const double sc = rt[p].acc / (double)(last - p + 1);
            max_sc = fmax(max_sc, fabs(sc - isc) / fmax(sc, 1e-3));
        }
        int kh, kl, nh, nl;
        kvs_lean_dyn_head_keep(&d.c, &d.h, &kh, &kl);
        kvs_lean_pm_table(d.pm, 0, &nh, &nl);
        CHECK(kh == nh && kl == nl, "%s: chunk %zu: %d + %d pages held, the sections reached %d + %d", name, ci, nh, nl,
              kh, kl);
        CHECK(d.h.w_n == (last + 1 < W ? last + 1 : W), "%s: chunk %zu: window %d", name, ci, d.h.w_n);
        t0 += R;
    }
    REQUIRE(t0 == PROMPT, "chunks");
    CHECK(!bad_tier, "%s: %d of %d placements differ from the prompt rule", name, bad_tier, placed);
    CHECK(!bad_val, "%s: %d placed tokens store other values than the quantizer's", name, bad_val);
    CHECK(ambiguous <= placed / 20, "%s: %d placements within 1e-4 of a threshold", name, ambiguous);
    CHECK(max_out < 2e-4, "%s: prefill output differs from the reference by %.3g", name, max_out);
    CHECK(max_sc < 1e-4, "%s: scores differ from the reference by %.3g (relative)", name, max_sc);
    CHECK(d.h.n_high == n_hi && d.h.n_low == n_lo && d.h.pruned == n_pr, "%s: counts %d/%d/%d, reference %d/%d/%d",
          name, d.h.n_high, d.h.n_low, d.h.pruned, n_hi, n_lo, n_pr);
    if (want_mix) CHECK(n_hi > 0 && n_lo > 0 && n_pr > 0, "%s: want every tier: %d high %d low %d pruned", name, n_hi,
                        n_lo, n_pr);
    /* decode continues with Algorithm 1 from the prefilled state */
    for (int t = PROMPT; t < STEPS; t++) {
        float out[G][HD];
        dhead_decode(&d, s, t, &out[0][0]);
        REQUIRE(kvs_lean_pm_check(d.pm, msg, sizeof msg) == 0, "%s: decode %d: %s", name, t, msg);
    }
    CHECK(d.h.n_high + d.h.n_low + d.h.w_n + d.h.pruned == STEPS && d.h.seen == STEPS && d.h.w_n == W,
          "%s: after decode: %d + %d + %d + %d pruned tokens of %d, seen %lld", name, d.h.n_high, d.h.n_low, d.h.w_n,
          d.h.pruned, STEPS, (long long)d.h.seen);
    printf("ok %s: %d placements by the prompt rule (%d high %d low %d pruned, %d near a threshold), output within "
           "%.2g, scores within %.2g; %d decode steps after\n", name, placed, n_hi, n_lo, n_pr, ambiguous, max_out,
           max_sc, STEPS - PROMPT);
    dhead_free(&d);
    free(s), free(rt);
}

/* ---- 2. neutral: bitwise dense ---------------------------------------------------------------- */
static void test_neutral_dense(void)
{
    char err[256];
    setenv("KVS_CPU_KERNELS", "ref", 1);   /* the plain-C kernels, whose arithmetic the prefill keeps */
    struct kvs_backend *be = o->create(1, err, sizeof err);
    unsetenv("KVS_CPU_KERNELS");
    REQUIRE(be, "%s", err);
    struct stream *s = malloc(sizeof *s);
    REQUIRE(s, "alloc");
    make_stream(s, 1);
    const struct kvs_lean_fmt k16 = {16, 16};
    struct dhead d;
    REQUIRE(kvs_lean_dyn_cfg_init(&d.c, k16, k16, HD, G, W, 0, 0, TP, STEPS + 1) == 0, "cfg");
    dhead_alloc(&d, STEPS);
    enum { BS = 16, NB = (STEPS + BS - 1) / BS };
    float *kc = calloc((size_t)NB * BS * HD, sizeof(float)), *vc = calloc((size_t)NB * BS * HD, sizeof(float));
    int32_t bt[NB], qs[2] = {0, 1}, pos[1];
    for (int b = 0; b < NB; b++) bt[b] = b;
    for (int t = 0; t < STEPS; t++) memcpy(kc + (size_t)t * HD, s->k[t], sizeof s->k[t]), memcpy(vc + (size_t)t * HD, s->v[t], sizeof s->v[t]);
    struct kvs_dbuf *dk = o->alloc(be, KVS_BUF_KV, (size_t)NB * BS * HD), *dv = o->alloc(be, KVS_BUF_KV, (size_t)NB * BS * HD);
    struct kvs_dbuf *dq = o->alloc(be, KVS_BUF_ACT, G * HD), *dout = o->alloc(be, KVS_BUF_ACT, G * HD);
    struct kvs_dbuf *dqs = o->alloc(be, KVS_BUF_I32, 2), *dpos = o->alloc(be, KVS_BUF_I32, 1);
    struct kvs_dbuf *dbt = o->alloc(be, KVS_BUF_I32, NB);
    REQUIRE(kc && vc && dk && dv && dq && dout && dqs && dpos && dbt, "alloc");
    o->upload(be, dbt, 0, bt, NB);
    o->upload(be, dqs, 0, qs, 2);
    o->upload(be, dk, 0, kc, (size_t)NB * BS * HD);
    o->upload(be, dv, 0, vc, (size_t)NB * BS * HD);
    int same = 1, first_bad = -1, t0 = 0;
    for (size_t ci = 0; ci < sizeof chunks / sizeof *chunks; ci++) {
        const int R = chunks[ci];
        float ours[32][G][HD];
        dhead_chunk(&d, s, t0, R, &ours[0][0][0]);
        for (int r = 0; r < R; r++) {
            float dense[G][HD];
            o->upload(be, dq, 0, &s->q[t0 + r][0][0], G * HD);
            pos[0] = t0 + r;
            o->upload(be, dpos, 0, pos, 1);
            struct kvs_attn_meta m = {.n_seqs = 1, .max_blocks = NB, .q_start = dqs, .pos = dpos, .block_tables = dbt,
                                      .h_q_start = qs, .h_pos = pos, .max_ctx = t0 + r + 1};
            o->attention(be, dq, dk, dv, &m, 1, G, 1, HD, BS, SCALE, dout);
            o->download(be, &dense[0][0], dout, 0, G * HD);
            if (memcmp(ours[r], dense, sizeof dense) && same) same = 0, first_bad = t0 + r;
        }
        t0 += R;
    }
    CHECK(same, "K16V16 alpha 0: prefill row %d differs from dense attention", first_bad);
    CHECK(d.h.n_high == PROMPT - W && d.h.n_low == 0 && d.h.pruned == 0, "K16V16 alpha 0: %d high %d low %d pruned",
          d.h.n_high, d.h.n_low, d.h.pruned);
    if (same) printf("ok K16V16 with alpha_h = alpha_l = 0: %d prefill rows in %zu chunks equal dense CPU attention "
                     "bitwise\n", PROMPT, sizeof chunks / sizeof *chunks);
    o->free_buf(be, dk), o->free_buf(be, dv), o->free_buf(be, dq), o->free_buf(be, dout);
    o->free_buf(be, dqs), o->free_buf(be, dpos), o->free_buf(be, dbt);
    free(kc), free(vc), free(s);
    dhead_free(&d);
    o->free(be);
}

int main(void)
{
    const struct kvs_lean_fmt k8v4 = {8, 4}, k4v2 = {4, 2}, k8v8 = {8, 8}, k4v4 = {4, 4};
    test_rule("K8V4 + K4V2 default alphas", k8v4, k4v2, 1, 0.02, 0);
    test_rule("K8V4 + K4V2 alpha_h 2, alpha_l 0.5", k8v4, k4v2, 2, 0.5, 1);
    test_rule("K8V8 + K4V4 alpha_h 5, alpha_l 0", k8v8, k4v4, 5, 0, 0);
    test_rule("K8V4 + K4V2 all pruned (alphas huge)", k8v4, k4v2, 1e12, 1e12, 0);
    test_neutral_dense();
    return kvs_test_summary("test_kv_lean_dyn_prefill");
}
