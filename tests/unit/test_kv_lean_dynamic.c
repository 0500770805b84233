/* test_kv_lean_dynamic.c: the CPU references of LeanKV's dynamic mode (the engine's version,
 * kernels/kv_lean_dyn.h, is checked against them in test_kv_lean_dyn.c): Algorithm 1 for one head (kernels/kv_lean_alg1.h) and the page manager
 * (kernels/kv_lean_pages.h).
 *   1. neutral: K16V16 tiers with alpha_h = alpha_l = 0 keep every token (all high) and equal
 *      dense attention within fp16 rounding;
 *   2. the extremes against independent double references: alpha_l huge prunes every token
 *      that leaves the window (= sliding-window attention); alpha_h huge and alpha_l = 0 send
 *      every token low (= attention over K4V2-quantized history plus the fp32 window);
 *   3. the default alphas on peaked attention: every step's decision matches the rule applied
 *      to scores the test tracks itself from its own double attention; tokens are conserved;
 *      demotions and prunes both happen; the output is attention over the head's current set;
 *   4. attention is invariant to permuting the tokens within a section;
 *   5. the page manager under fuzz: random requests (prefill bursts, one page per section per
 *      decode step), preemption when the free list runs short, cancellations: every page id is
 *      exactly once across the free list and the tables after every round, nothing leaks. */
#include "kernels/kv_lean.h"
#include "kernels/kv_lean_alg1.h"
#include "kernels/kv_lean_pages.h"
#include "tests/unit/test_util.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#define HD 32
#define G 2
#define W 8
#define STEPS 160

static uint64_t rng = 0xC0FFEE1234567ull;

/* uniform in [-1, 1) (kvs_test_xorshift gives 32 bits) */
static float frand(void) { return (float)((double)kvs_test_xorshift(&rng) / 4294967296.0) * 2.0f - 1.0f; }

struct stream {
    float q[STEPS][G][HD], k[STEPS][HD], v[STEPS][HD];
};

/* random tokens; with peaked, keys lean more or less towards a direction every query likes, so
 * the scores spread as in real attention (sinks and salient tokens against the rest) */
static void make_stream(struct stream *s, int peaked)
{
    float dir[HD];
    for (int e = 0; e < HD; e++) dir[e] = frand();
    for (int t = 0; t < STEPS; t++) {
        const float boost = peaked ? (t % 13 == 0 ? 1.2f : 0.8f * frand()) : 0.0f;
        for (int e = 0; e < HD; e++) {
            s->k[t][e] = frand() + boost * dir[e];
            s->v[t][e] = frand();
            /* halfway the queries turn away: formerly liked tokens lose score (demotions) */
            const float lean = peaked ? (t < STEPS / 2 ? 0.8f : -0.8f) : 0.0f;
            for (int g = 0; g < G; g++) s->q[t][g][e] = frand() + lean * dir[e];
        }
    }
}

/* double attention of q over n keys/values (rows of k, v); probs [n] of query head g if asked */
static void ref_attend(const float *q, const float (*k)[HD], const float (*v)[HD], int n, double scale, double *out,
                       double *probs)
{
    double mx = -1e300, l = 0, w[STEPS + 1];
    for (int i = 0; i < n; i++) {
        double d = 0;
        for (int e = 0; e < HD; e++) d += (double)q[e] * k[i][e];
        w[i] = d * scale;
        if (w[i] > mx) mx = w[i];
    }
    for (int e = 0; e < HD; e++) out[e] = 0;
    for (int i = 0; i < n; i++) l += w[i] = exp(w[i] - mx);
    for (int i = 0; i < n; i++) {
        if (probs) probs[i] = w[i] / l;
        for (int e = 0; e < HD; e++) out[e] += w[i] / l * v[i][e];
    }
}

static double max_diff(const float *a, const double *b, int n)
{
    double m = 0;
    for (int i = 0; i < n; i++) m = fmax(m, fabs((double)a[i] - b[i]));
    return m;
}

static struct kvs_lean_head *make_head(struct kvs_lean_fmt hi, struct kvs_lean_fmt lo, double ah, double al)
{
    struct kvs_lean_head_cfg c = {hi, lo, W, ah, al, HD, G, STEPS + 1};
    struct kvs_lean_head *h;
    REQUIRE(kvs_lean_head_create(&c, &h) == 0, "head");
    return h;
}

static const double SCALE = 0.17677669529663687;   /* 1/sqrt(32) */

/* ---- 1. + 2. neutral and the extremes ------------------------------------------------------- */

static void test_extremes(void)
{
    static struct stream s;
    make_stream(&s, 0);
    static float kq[STEPS][HD], vq[STEPS][HD];
    const struct kvs_lean_fmt k16 = {16, 16}, k8v4 = {8, 4}, k4v2 = {4, 2};
    struct kvs_lean_head *neutral = make_head(k16, k16, 0, 0);
    struct kvs_lean_head *prune = make_head(k8v4, k4v2, 0, 1e12);
    struct kvs_lean_head *low = make_head(k8v4, k4v2, 1e12, 0);
    double w16 = 0, wpr = 0, wlo = 0;
    float out[G][HD];
    double ref[HD];
    for (int t = 0; t < STEPS; t++) {
        /* low history: the K4V2 round trip of the original vectors */
        uint8_t codes[2 * HD];
        uint16_t sz[2];
        kvs_lean_quantize(s.k[t], HD, 4, codes, sz);
        kvs_lean_dequantize(codes, sz, HD, 4, kq[t]);
        kvs_lean_quantize(s.v[t], HD, 2, codes, sz);
        kvs_lean_dequantize(codes, sz, HD, 2, vq[t]);

        REQUIRE(kvs_lean_head_step(neutral, &s.q[t][0][0], s.k[t], s.v[t], t, (float)SCALE, &out[0][0], NULL) == 0, "step");
        for (int g = 0; g < G; g++) {
            ref_attend(s.q[t][g], s.k, s.v, t + 1, SCALE, ref, NULL);
            w16 = fmax(w16, max_diff(out[g], ref, HD));
        }
        REQUIRE(kvs_lean_head_step(prune, &s.q[t][0][0], s.k[t], s.v[t], t, (float)SCALE, &out[0][0], NULL) == 0, "step");
        /* the step's query sees the window's W tokens and the new one (it leaves after) */
        const int first = t > W ? t - W : 0;
        for (int g = 0; g < G; g++) {
            ref_attend(s.q[t][g], s.k + first, s.v + first, t + 1 - first, SCALE, ref, NULL);
            wpr = fmax(wpr, max_diff(out[g], ref, HD));
        }
        REQUIRE(kvs_lean_head_step(low, &s.q[t][0][0], s.k[t], s.v[t], t, (float)SCALE, &out[0][0], NULL) == 0, "step");
        static float mk[STEPS][HD], mv[STEPS][HD];
        for (int i = 0; i <= t; i++) {
            memcpy(mk[i], i < first ? kq[i] : s.k[i], sizeof mk[i]);
            memcpy(mv[i], i < first ? vq[i] : s.v[i], sizeof mv[i]);
        }
        for (int g = 0; g < G; g++) {
            /* the head's low section is in hole-filled order, the reference in position
             * order: equal up to fp32 summation order */
            ref_attend(s.q[t][g], mk, mv, t + 1, SCALE, ref, NULL);
            wlo = fmax(wlo, max_diff(out[g], ref, HD));
        }
    }
    int nh, nl, nw, np;
    kvs_lean_head_counts(neutral, &nh, &nl, &nw, &np);
    CHECK(nh == STEPS - W && nl == 0 && nw == W && np == 0, "neutral: %d high %d low %d window %d pruned", nh, nl, nw, np);
    CHECK(w16 < 2e-3, "neutral K16V16: %g from dense attention", w16);
    kvs_lean_head_counts(prune, &nh, &nl, &nw, &np);
    CHECK(nh == 0 && nl == 0 && nw == W && np == STEPS - W, "prune all: %d high %d low %d window %d pruned", nh, nl, nw, np);
    CHECK(wpr < 1e-5, "prune all: %g from sliding-window attention", wpr);
    kvs_lean_head_counts(low, &nh, &nl, &nw, &np);
    CHECK(nh == 0 && nl == STEPS - W && np == 0, "all low: %d high %d low %d pruned", nh, nl, np);
    CHECK(wlo < 1e-5, "all low: %g from the K4V2 reference", wlo);
    printf("ok Alg. 1 extremes: K16V16 alpha 0 keeps all (%.1e from dense), alpha_l huge = window %d (%.1e), "
           "alpha_h huge = all K4V2 (%.1e)\n", w16, W, wpr, wlo);
    kvs_lean_head_free(neutral), kvs_lean_head_free(prune), kvs_lean_head_free(low);
}

/* ---- 3. + 4. the rule step by step, conservation, permutation ------------------------------- */

static void test_rule(void)
{
    static struct stream s;
    make_stream(&s, 1);
    const double ah = 1.0, al = 0.5;   /* al well above the paper's 0.02: a 160-token stream prunes */
    struct kvs_lean_head *h = make_head((struct kvs_lean_fmt){8, 4}, (struct kvs_lean_fmt){4, 2}, ah, al);
    /* the test's own scores, from its own double attention over the head's current tokens */
    static double acc[STEPS];
    static int nq[STEPS], gone[STEPS];
    int n_demoted = 0, n_pruned = 0, n_high = 0, n_low = 0, decided = 0, skipped = 0;
    double worst = 0, perm = 0;
    float out[G][HD], out2[G][HD];
    static float ck[STEPS + 1][HD], cv[STEPS + 1][HD];
    int32_t cpos[STEPS + 1];
    for (int t = 0; t < STEPS; t++) {
        /* the set the step's query sees: the current tokens plus the new one */
        int nh, nl, nw, np;
        kvs_lean_head_counts(h, &nh, &nl, &nw, &np);
        const int n = nh + nl + nw;
        for (int i = 0; i < n; i++) {
            float sc;
            int tier;
            kvs_lean_head_token(h, i, &cpos[i], &sc, &tier, ck[i], cv[i]);
        }
        memcpy(ck[n], s.k[t], sizeof ck[n]);
        memcpy(cv[n], s.v[t], sizeof cv[n]);
        cpos[n] = t;
        double ref[G][HD], pr[G][STEPS + 1];
        for (int g = 0; g < G; g++) ref_attend(s.q[t][g], ck, cv, n + 1, SCALE, ref[g], pr[g]);
        for (int i = 0; i <= n; i++) {
            double m = pr[0][i];
            for (int g = 1; g < G; g++) m = fmax(m, pr[g][i]);
            acc[cpos[i]] += m;
            nq[cpos[i]]++;
        }
        struct kvs_lean_event ev;
        REQUIRE(kvs_lean_head_step(h, &s.q[t][0][0], s.k[t], s.v[t], t, (float)SCALE, &out[0][0], &ev) == 0, "step");
        for (int g = 0; g < G; g++) worst = fmax(worst, max_diff(out[g], ref[g], HD));
        if (ev.tc_pos < 0) continue;
        /* the decision for t_c, and for the victim, from the test's own scores */
        const double N = t + 1, th = ah / N, tl = al / N;
        CHECK(ev.n_seen == N, "N %g at step %d", ev.n_seen, t);
        const double sc = acc[ev.tc_pos] / nq[ev.tc_pos];
        const double margin = 1e-5 * fmax(th, 1e-9);
        if (fabs(sc - th) < margin || fabs(sc - tl) < margin) {
            skipped++;
        } else {
            const int want = sc >= th ? KVS_LEAN_HIGH : sc >= tl ? KVS_LEAN_LOW : KVS_LEAN_PRUNED;
            CHECK(ev.tc_dest == want, "step %d: token %d (score %g, thresholds %g / %g) went %d, want %d", t, ev.tc_pos,
                  sc, th, tl, ev.tc_dest, want);
            decided++;
        }
        if (ev.tc_dest == KVS_LEAN_PRUNED) gone[ev.tc_pos] = 1, n_pruned++;
        if (ev.tc_dest == KVS_LEAN_HIGH) n_high++;
        if (ev.tc_dest == KVS_LEAN_LOW) n_low++;
        if (ev.victim_pos >= 0) {
            const double sv = acc[ev.victim_pos] / nq[ev.victim_pos];
            if (fabs(sv - th) >= margin && fabs(sv - tl) >= margin) {
                const int want = sv < tl ? KVS_LEAN_PRUNED
                                 : (ev.tc_dest == KVS_LEAN_HIGH && sv < th) ? KVS_LEAN_DEMOTED : KVS_LEAN_KEPT;
                CHECK(ev.victim_action == want, "step %d: victim %d (score %g) action %d, want %d", t, ev.victim_pos,
                      sv, ev.victim_action, want);
            }
            if (ev.victim_action == KVS_LEAN_PRUNED) gone[ev.victim_pos] = 1, n_pruned++;
            if (ev.victim_action == KVS_LEAN_DEMOTED) n_demoted++;
        }
        /* conservation: every token seen is in exactly one place */
        kvs_lean_head_counts(h, &nh, &nl, &nw, &np);
        int seen[STEPS] = {0}, dup = 0, lost = 0;
        for (int i = 0; i < nh + nl + nw; i++) {
            float scf;
            int tier;
            float kk[HD], vv[HD];
            int32_t p;
            kvs_lean_head_token(h, i, &p, &scf, &tier, kk, vv);
            if (seen[p]++ || gone[p]) dup++;
        }
        for (int p = 0; p <= t; p++) lost += !seen[p] && !gone[p];
        CHECK(nh + nl + nw + np == t + 1 && np == n_pruned && !dup && !lost,
              "step %d: %d + %d + %d + %d pruned != %d (dup %d, lost %d)", t, nh, nl, nw, np, t + 1, dup, lost);
        /* 4. permuting each section's tokens leaves attention unchanged (up to fp32 order) */
        if (t % 16 == 15) {
            kvs_lean_head_attend(h, &s.q[t][0][0], (float)SCALE, &out[0][0]);
            kvs_lean_head_shuffle(h, (uint64_t)t * 7919u);
            kvs_lean_head_attend(h, &s.q[t][0][0], (float)SCALE, &out2[0][0]);
            for (int g = 0; g < G; g++)
                for (int e = 0; e < HD; e++) perm = fmax(perm, fabs(out[g][e] - out2[g][e]));
        }
    }
    CHECK(worst < 1e-5, "attention over the current set: %g from double", worst);
    CHECK(perm < 1e-6, "section permutation changed attention by %g", perm);
    CHECK(n_demoted > 0 && n_pruned > 0 && n_high > 0 && n_low > 0 && decided > (STEPS - W) / 2,
          "%d high, %d low, %d demoted, %d pruned, %d decisions checked", n_high, n_low, n_demoted, n_pruned, decided);
    int hp, lp;
    kvs_lean_head_pages(h, 1024, &hp, &lp);
    printf("ok Alg. 1 step by step (alpha_h %g, alpha_l %g): %d decisions as the rule says (%d at a threshold "
           "skipped), %d high, %d low, %d demoted, %d pruned; conserved; permutation %.1e; %.1e from double; "
           "%d + %d pages of 1 KiB\n", ah, al, decided, skipped, n_high, n_low, n_demoted, n_pruned, perm, worst, hp, lp);
    kvs_lean_head_free(h);
}

/* ---- 5. the page manager -------------------------------------------------------------------- */

#define NREQ 6
#define NL 3
#define NKVH 2
#define HEADS (NREQ * NL * NKVH)
#define PAGES 300
#define TLEN 40

static void test_pages_fuzz(void)
{
    struct kvs_lean_pm *pm;
    REQUIRE(kvs_lean_pm_create(PAGES, HEADS, TLEN, &pm) == 0, "pm");
    int32_t nh[HEADS], nl[HEADS];
    int live[NREQ] = {0}, steps[NREQ] = {0};
    int rounds = 0, enospc = 0, preempt = 0, cancels = 0, ends = 0, e2big = 0, allocated = 0;
    char msg[200];
    for (int it = 0; it < 4000; it++) {
        memset(nh, 0, sizeof nh), memset(nl, 0, sizeof nl);
        int victim = -1;
        for (int r = 0; r < NREQ; r++) {
            if (!live[r]) {
                if (kvs_test_xorshift(&rng) % 4 == 0) live[r] = 1, steps[r] = 0;   /* admitted: prefill */
                else continue;
            }
            for (int hh = 0; hh < NL * NKVH; hh++) {
                const int i = r * NL * NKVH + hh;
                if (steps[r] == 0) {   /* prefill: a burst, conservatively high */
                    nh[i] = (int32_t)(kvs_test_xorshift(&rng) % 6);
                    nl[i] = (int32_t)(kvs_test_xorshift(&rng) % 3);
                } else {               /* decode: at most one page per section */
                    nh[i] = kvs_test_xorshift(&rng) % 5 == 0;
                    nl[i] = kvs_test_xorshift(&rng) % 7 == 0;
                }
            }
            if (victim < 0 || kvs_test_xorshift(&rng) % 2) victim = r;
        }
        int rc = kvs_lean_pm_alloc(pm, nh, nl);
        rounds++;
        if (rc == -ENOSPC || rc == -E2BIG) {
            /* nothing was taken; the scheduler preempts a request and retries next round */
            enospc += rc == -ENOSPC;
            e2big += rc == -E2BIG;
            if (victim >= 0) {
                kvs_lean_pm_release(pm, victim * NL * NKVH, NL * NKVH);
                live[victim] = 0;
                preempt++;
            }
        } else {
            REQUIRE(rc == 0, "alloc rc %d", rc);
            for (int i = 0; i < HEADS; i++) allocated += nh[i] + nl[i];
            for (int r = 0; r < NREQ; r++)
                if (live[r]) steps[r]++;
        }
        /* requests end or are cancelled at random */
        for (int r = 0; r < NREQ; r++)
            if (live[r] && kvs_test_xorshift(&rng) % 40 == 0) {
                kvs_lean_pm_release(pm, r * NL * NKVH, NL * NKVH);
                live[r] = 0;
                if (kvs_test_xorshift(&rng) % 2) cancels++;
                else ends++;
            }
        int bad = kvs_lean_pm_check(pm, msg, sizeof msg);
        CHECK(bad == 0, "round %d: %s", it, msg);
        if (bad) break;
    }
    for (int r = 0; r < NREQ; r++)
        if (live[r]) kvs_lean_pm_release(pm, r * NL * NKVH, NL * NKVH);
    CHECK(kvs_lean_pm_check(pm, msg, sizeof msg) == 0, "%s", msg);
    CHECK(kvs_lean_pm_n_free(pm) == PAGES, "%d of %d pages free at the end", kvs_lean_pm_n_free(pm), PAGES);
    CHECK(enospc > 0 && preempt > 0 && allocated > 10 * PAGES, "%d short rounds, %d preemptions, %d pages handed out",
          enospc, preempt, allocated);
    /* the bidirectional table: high pages from the left, low from the right */
    kvs_lean_pm_release(pm, 0, HEADS);
    memset(nh, 0, sizeof nh), memset(nl, 0, sizeof nl);
    nh[0] = 3, nl[0] = 2;
    REQUIRE(kvs_lean_pm_alloc(pm, nh, nl) == 0, "alloc");
    int a, b;
    const int32_t *t = kvs_lean_pm_table(pm, 0, &a, &b);
    CHECK(a == 3 && b == 2 && t[0] != t[TLEN - 1] && t[1] != t[TLEN - 2], "table ends");
    nh[0] = TLEN, nl[0] = 0;
    CHECK(kvs_lean_pm_alloc(pm, nh, nl) == -E2BIG && kvs_lean_pm_check(pm, msg, sizeof msg) == 0, "full table refused");
    int64_t off[4];
    const int32_t in[4] = {3, 0, 2, 5};
    CHECK(kvs_lean_exclusive_scan(in, 4, off) == 10 && off[0] == 0 && off[1] == 3 && off[2] == 3 && off[3] == 5, "scan");
    printf("ok page manager fuzz: %d rounds, %d pages handed out, %d short rounds (+%d table-full), %d preemptions, "
           "%d cancellations, %d ends; every page once after each round, none leaked\n", rounds, allocated, enospc,
           e2big, preempt, cancels, ends);
    kvs_lean_pm_free(pm);
}

int main(void)
{
    test_extremes();
    test_rule();
    test_pages_fuzz();
    return kvs_test_summary("test_kv_lean_dynamic");
}
