/* test_kv_lean_dyn.c: LeanKV's dynamic mode as the engine runs it (kernels/kv_lean_dyn.h over
 * the page manager, engine/kv/kv_storage_lean_dyn.c through the lean storage's ops).
 *   1. the policy equals the CPU reference of Algorithm 1 (kernels/kv_lean_alg1.h) step by step:
 *      every event (where the leaving token went, the victim and what happened to it) and every
 *      token's position, tier, score and dequantized K/V bitwise, the output within fp32
 *      rounding; for the default tiers K8V4 + K4V2 (mixed pages) at the default alphas on
 *      peaked attention, the extremes (all pruned, all low) and other tier pairs;
 *   2. K16V16 tiers with alpha_h = alpha_l = 0 on fp16-exact inputs: every step's output equals
 *      the dense CPU attention kernel over the same tokens, bitwise;
 *   3. attention is invariant to permuting the tokens within a section (fp32 rounding);
 *   4. allocator fuzz through the storage: random requests (prefill bursts, decode steps) start,
 *      end, are preempted or cancelled (seq_free) at random; after every step every page id is
 *      exactly once across the free list and the tables, each live head holds exactly the pages
 *      its sections reached, and when all requests are gone no page is held;
 *   5. refusals: the dynamic mode on a backend without its kernels (neither cpu nor cuda), with kv.reuse prefix,
 *      kv.decode mac, the fidelity meter. */
#include "base/util.h"
#include "engine/config.h"
#include "engine/kv/kv.h"
#include "engine/kv/kv_storage_lean_dyn.h"
#include "kernels/backend.h"
#include "kernels/kv_lean.h"
#include "kernels/kv_lean_alg1.h"
#include "kernels/kv_lean_dyn.h"
#include "kernels/kv_lean_pages.h"
#include "tests/unit/kv_lean_case.h"
#include "tests/unit/test_util.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern const struct kvs_backend_ops kvs_cpu_backend;
static const struct kvs_backend_ops *o = &kvs_cpu_backend;

#define HD 32
#define G 2
#define W 8
#define STEPS 160
#define TP 4                      /* entries per high page: small, so that pages fill and wrap */

static uint64_t rng = 0x5EED1EA4ull;
static float frand(void) { return (float)((double)kvs_test_xorshift(&rng) / 4294967296.0) * 2.0f - 1.0f; }

struct stream {
    float q[STEPS][G][HD], k[STEPS][HD], v[STEPS][HD];
};

/* as test_kv_lean_dynamic.c: peaked keys (a liked direction, queries turning away halfway) */
static void make_stream(struct stream *s, int peaked, int fp16_exact)
{
    float dir[HD];
    for (int e = 0; e < HD; e++) dir[e] = frand();
    for (int t = 0; t < STEPS; t++) {
        const float boost = peaked ? (t % 13 == 0 ? 1.2f : 0.8f * frand()) : 0.0f;
        for (int e = 0; e < HD; e++) {
            s->k[t][e] = frand() + boost * dir[e];
            s->v[t][e] = frand();
            const float lean = peaked ? (t < STEPS / 2 ? 0.8f : -0.8f) : 0.0f;
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

static const float SCALE = 0.17677669529663687f;

static void dhead_init(struct dhead *d, struct kvs_lean_fmt hi, struct kvs_lean_fmt lo, double ah, double al)
{
    REQUIRE(kvs_lean_dyn_cfg_init(&d->c, hi, lo, HD, G, W, ah, al, TP, STEPS + 1) == 0, "cfg");
    dhead_alloc(d, STEPS);
}

/* one step as the storage runs it: a round for the worst case, the step, the trim */
static void dhead_step(struct dhead *d, const struct stream *s, int t, float *out, struct kvs_lean_event *ev)
{
    struct kvs_lean_dyn_pages pg = dhead_pages(d);
    int32_t nh, nl;
    kvs_lean_dyn_head_need(&d->c, &d->h, 1, pg.n_high_pages, pg.n_low_pages, &nh, &nl);
    REQUIRE(kvs_lean_pm_alloc(d->pm, &nh, &nl) == 0, "page round");
    pg = dhead_pages(d);
    kvs_lean_dyn_head_step(&d->c, &d->h, &pg, &s->q[t][0][0], s->k[t], s->v[t], t, SCALE, out, d->scratch, ev);
    int kh, kl;
    kvs_lean_dyn_head_keep(&d->c, &d->h, &kh, &kl);
    kvs_lean_pm_trim(d->pm, 0, kh, kl);
}

/* ---- 1. step by step against Algorithm 1's reference ---------------------------------------- */
static void test_alg1(const char *name, struct kvs_lean_fmt hi, struct kvs_lean_fmt lo, double ah, double al,
                      int peaked)
{
    struct stream *s = malloc(sizeof *s);
    REQUIRE(s, "alloc");
    make_stream(s, peaked, 0);
    struct kvs_lean_head_cfg rc = {hi, lo, W, ah, al, HD, G, STEPS + 1};
    struct kvs_lean_head *ref;
    REQUIRE(kvs_lean_head_create(&rc, &ref) == 0, "reference head");
    struct dhead d;
    dhead_init(&d, hi, lo, ah, al);
    int bad = 0, demoted = 0, pruned = 0, low = 0;
    double worst = 0;
    for (int t = 0; t < STEPS && !bad; t++) {
        float o1[G][HD], o2[G][HD];
        struct kvs_lean_event e1, e2;
        REQUIRE(kvs_lean_head_step(ref, &s->q[t][0][0], s->k[t], s->v[t], t, SCALE, &o1[0][0], &e1) == 0, "ref step");
        dhead_step(&d, s, t, &o2[0][0], &e2);
        if (e1.tc_pos != e2.tc_pos || e1.tc_dest != e2.tc_dest || e1.victim_pos != e2.victim_pos ||
            e1.victim_action != e2.victim_action || memcmp(&e1.tc_score, &e2.tc_score, 4) ||
            memcmp(&e1.victim_score, &e2.victim_score, 4) || e1.n_seen != e2.n_seen) {
            CHECK(0, "%s step %d: event differs: ref (tc %d -> %d, %g; victim %d -> %d) ours (tc %d -> %d, %g; victim "
                  "%d -> %d)", name, t, e1.tc_pos, e1.tc_dest, e1.tc_score, e1.victim_pos, e1.victim_action, e2.tc_pos,
                  e2.tc_dest, e2.tc_score, e2.victim_pos, e2.victim_action);
            bad = 1;
        }
        demoted += e2.victim_action == KVS_LEAN_DEMOTED;
        pruned += (e2.tc_dest == KVS_LEAN_PRUNED) + (e2.victim_action == KVS_LEAN_PRUNED);
        low += e2.tc_dest == KVS_LEAN_LOW;
        for (int g = 0; g < G; g++)
            for (int e = 0; e < HD; e++) worst = fmax(worst, fabs((double)o1[g][e] - o2[g][e]));
        int nh, nl, nw, np;
        kvs_lean_head_counts(ref, &nh, &nl, &nw, &np);
        if (nh != d.h.n_high || nl != d.h.n_low || nw != d.h.w_n || np != d.h.pruned) {
            CHECK(0, "%s step %d: counts ref %d/%d/%d/%d ours %d/%d/%d/%d", name, t, nh, nl, nw, np, d.h.n_high,
                  d.h.n_low, d.h.w_n, d.h.pruned);
            bad = 1;
        }
        const struct kvs_lean_dyn_pages pg = dhead_pages(&d);
        for (int i = 0; i < nh + nl + nw && !bad; i++) {
            int32_t p1, p2;
            float s1, s2, k1[HD], v1[HD], k2[HD], v2[HD];
            int t1, t2;
            kvs_lean_head_token(ref, i, &p1, &s1, &t1, k1, v1);
            kvs_lean_dyn_head_token(&d.c, &d.h, &pg, i, &p2, &s2, &t2, k2, v2);
            if (p1 != p2 || t1 != t2 || memcmp(&s1, &s2, 4) || memcmp(k1, k2, sizeof k1) || memcmp(v1, v2, sizeof v1)) {
                CHECK(0, "%s step %d token %d: ref pos %d tier %d score %g, ours pos %d tier %d score %g", name, t, i, p1,
                      t1, s1, p2, t2, s2);
                bad = 1;
            }
        }
    }
    CHECK(worst < 1e-5, "%s: output %g from the reference", name, worst);
    char msg[256];
    CHECK(kvs_lean_pm_check(d.pm, msg, sizeof msg) == 0, "%s: %s", name, msg);
    if (!bad)
        printf("ok %s: %d steps = Algorithm 1's reference (events, tiers, scores, K/V bitwise; output within %.1e); "
               "%d low, %d demoted, %d pruned\n", name, STEPS, worst, low, demoted, pruned);
    kvs_lean_head_free(ref);
    dhead_free(&d);
    free(s);
}

/* ---- 2. neutral: bitwise dense --------------------------------------------------------------- */
static void test_neutral_dense(void)
{
    char err[256];
    /* the plain-C reference kernels: the dynamic step reproduces their attention, not the
     * AVX2 / FMA tiled ones (within 1e-5 of it) that `auto` may pick on this CPU */
    setenv("KVS_CPU_KERNELS", "ref", 1);
    struct kvs_backend *be = o->create(1, err, sizeof err);
    unsetenv("KVS_CPU_KERNELS");
    REQUIRE(be, "%s", err);
    struct stream *s = malloc(sizeof *s);
    REQUIRE(s, "alloc");
    make_stream(s, 1, 1);
    struct kvs_lean_fmt k16 = {16, 16};
    struct dhead d;
    dhead_init(&d, k16, k16, 0, 0);
    /* the dense cache: one KV head, blocks of BS in order */
    enum { BS = 16, NB = (STEPS + BS - 1) / BS };
    float *kc = calloc((size_t)NB * BS * HD, sizeof(float)), *vc = calloc((size_t)NB * BS * HD, sizeof(float));
    int32_t bt[NB], qs[2] = {0, 1}, pos[1];
    for (int b = 0; b < NB; b++) bt[b] = b;
    struct kvs_dbuf *dk = o->alloc(be, KVS_BUF_KV, (size_t)NB * BS * HD), *dv = o->alloc(be, KVS_BUF_KV, (size_t)NB * BS * HD);
    struct kvs_dbuf *dq = o->alloc(be, KVS_BUF_ACT, G * HD), *dout = o->alloc(be, KVS_BUF_ACT, G * HD);
    struct kvs_dbuf *dqs = o->alloc(be, KVS_BUF_I32, 2), *dpos = o->alloc(be, KVS_BUF_I32, 1);
    struct kvs_dbuf *dbt = o->alloc(be, KVS_BUF_I32, NB);
    REQUIRE(kc && vc && dk && dv && dq && dout && dqs && dpos && dbt, "alloc");
    o->upload(be, dbt, 0, bt, NB);
    o->upload(be, dqs, 0, qs, 2);
    int same = 1, first_bad = -1;
    for (int t = 0; t < STEPS; t++) {
        float ours[G][HD], dense[G][HD];
        dhead_step(&d, s, t, &ours[0][0], NULL);
        memcpy(kc + (size_t)t * HD, s->k[t], sizeof s->k[t]);
        memcpy(vc + (size_t)t * HD, s->v[t], sizeof s->v[t]);
        o->upload(be, dk, 0, kc, (size_t)NB * BS * HD);
        o->upload(be, dv, 0, vc, (size_t)NB * BS * HD);
        o->upload(be, dq, 0, &s->q[t][0][0], G * HD);
        pos[0] = t;
        o->upload(be, dpos, 0, pos, 1);
        struct kvs_attn_meta m = {.n_seqs = 1, .max_blocks = NB, .q_start = dqs, .pos = dpos, .block_tables = dbt,
                                  .h_q_start = qs, .h_pos = pos, .max_ctx = t + 1};
        o->attention(be, dq, dk, dv, &m, 1, G, 1, HD, BS, SCALE, dout);
        o->download(be, &dense[0][0], dout, 0, G * HD);
        if (memcmp(ours, dense, sizeof ours) && same) same = 0, first_bad = t;
    }
    CHECK(same, "K16V16 alpha 0: step %d differs from dense attention", first_bad);
    CHECK(d.h.n_high == STEPS - W && d.h.n_low == 0 && d.h.pruned == 0, "K16V16 alpha 0: %d high %d low %d pruned",
          d.h.n_high, d.h.n_low, d.h.pruned);
    if (same) printf("ok K16V16 with alpha_h = alpha_l = 0: %d steps equal dense CPU attention bitwise\n", STEPS);
    o->free_buf(be, dk), o->free_buf(be, dv), o->free_buf(be, dq), o->free_buf(be, dout);
    o->free_buf(be, dqs), o->free_buf(be, dpos), o->free_buf(be, dbt);
    free(kc), free(vc), free(s);
    dhead_free(&d);
    o->free(be);
}

/* ---- 3. permutation within sections ------------------------------------------------------------ */
static void test_permutation(void)
{
    struct stream *s = malloc(sizeof *s);
    REQUIRE(s, "alloc");
    make_stream(s, 1, 0);
    struct dhead a, b;
    const struct kvs_lean_fmt hi = {8, 4}, lo = {4, 2};
    dhead_init(&a, hi, lo, 1, 0.02);
    dhead_init(&b, hi, lo, 1, 0.02);
    double worst = 0;
    int checked = 0;
    for (int t = 0; t < STEPS; t++) {
        float oa[G][HD], ob[G][HD];
        if (t % 20 == 19) {   /* shuffle b's sections, then both take the same step */
            const struct kvs_lean_dyn_pages pg = dhead_pages(&b);
            kvs_lean_dyn_head_shuffle(&b.c, &b.h, &pg, (uint64_t)t * 7919u);
        }
        dhead_step(&a, s, t, &oa[0][0], NULL);
        dhead_step(&b, s, t, &ob[0][0], NULL);
        if (t % 20 == 19) {
            for (int g = 0; g < G; g++)
                for (int e = 0; e < HD; e++) worst = fmax(worst, fabs((double)oa[g][e] - ob[g][e]));
            checked++;
            /* resynchronise: b continues from a's order */
            dhead_free(&b);
            dhead_init(&b, hi, lo, 1, 0.02);
            for (int u = 0; u <= t; u++) dhead_step(&b, s, u, &ob[0][0], NULL);
        }
    }
    CHECK(worst < 1e-5, "permuted sections change the output by %g", worst);
    printf("ok attention invariant to permuting tokens within a section (%d shuffles, %.1e)\n", checked, worst);
    dhead_free(&a), dhead_free(&b);
    free(s);
}

/* ---- 4. allocator fuzz through the storage ---------------------------------------------------- */
static void set_str(char **dst, const char *s)
{
    free(*dst);
    *dst = strdup(s);
}

static void fuzz_cfg(struct kvs_config *c)
{
    kvs_config_init(c);
    set_str(&c->device, "cpu");
    set_str(&c->kv_storage, "lean");
    set_str(&c->kv_reuse, "none");
    set_str(&c->lean_mode, "dynamic");
    c->lean_window = 8;
    c->lean_alpha_h = 1;
    c->lean_alpha_l = 0.05;
}

static void test_fuzz(void)
{
    char err[256], msg[256];
    struct kvs_backend *be = o->create(2, err, sizeof err);
    REQUIRE(be, "%s", err);
    struct kvs_config c;
    fuzz_cfg(&c);
    enum { L = 2, NKV = 2, NH = 4, HDIM = 16, BSZ = 4, SLOTS = 4, ROWS = 48, CTX = 160 };
    const struct kvs_kv_shape sh = {L, NKV, HDIM, BSZ, &c, NH, SLOTS, ROWS, CTX};
    const struct kvs_kv_storage_ops *st = kvs_kv_find_storage("lean");
    void *state = NULL;
    REQUIRE(st->create(&sh, o, be, 64, &state, err, sizeof err) == 0, "%s", err);
    struct kvs_dbuf *dq = o->alloc(be, KVS_BUF_ACT, (size_t)ROWS * NH * HDIM);
    struct kvs_dbuf *dk = o->alloc(be, KVS_BUF_ACT, (size_t)ROWS * NKV * HDIM);
    struct kvs_dbuf *dv = o->alloc(be, KVS_BUF_ACT, (size_t)ROWS * NKV * HDIM);
    struct kvs_dbuf *dout = o->alloc(be, KVS_BUF_ACT, (size_t)ROWS * NH * HDIM);
    float *hq = malloc(sizeof(float) * ROWS * NH * HDIM), *hk = malloc(sizeof(float) * ROWS * NKV * HDIM);
    float *hv = malloc(sizeof(float) * ROWS * NKV * HDIM);
    REQUIRE(dq && dk && dv && dout && hq && hk && hv, "alloc");
    int live[SLOTS] = {0}, len[SLOTS] = {0}, ends = 0, steps = 0, bad = 0;
    for (int it = 0; it < 400 && !bad; it++) {
        /* requests come and go: end / preemption / cancellation are all seq_free to the storage */
        for (int sl = 0; sl < SLOTS; sl++) {
            const uint32_t r = kvs_test_xorshift(&rng) % 100;
            if (live[sl] && (r < 6 || len[sl] > CTX - ROWS)) st->seq_free(state, sl), live[sl] = 0, ends++;
            else if (!live[sl] && r < 40) {
                REQUIRE(st->seq_init(state, sl) == 0, "seq_init");
                live[sl] = 1, len[sl] = 0;
            }
        }
        int32_t qs[SLOTS + 1], pos[SLOTS], slot[SLOTS], dec[SLOTS], n = 0, S = 0;
        for (int sl = 0; sl < SLOTS; sl++) {
            if (!live[sl]) continue;
            int rows = len[sl] == 0 || kvs_test_xorshift(&rng) % 4 == 0 ? 1 + (int)(kvs_test_xorshift(&rng) % 12) : 1;
            if (n + rows > ROWS) break;
            qs[S] = n, pos[S] = len[sl], slot[S] = sl, dec[S] = rows == 1 && len[sl] > 0;
            len[sl] += rows, n += rows, S++;
        }
        if (!S) continue;
        qs[S] = n;
        for (int i = 0; i < n * NH * HDIM; i++) hq[i] = frand();
        for (int i = 0; i < n * NKV * HDIM; i++) hk[i] = frand(), hv[i] = frand();
        o->upload(be, dq, 0, hq, (size_t)n * NH * HDIM);
        o->upload(be, dk, 0, hk, (size_t)n * NKV * HDIM);
        o->upload(be, dv, 0, hv, (size_t)n * NKV * HDIM);
        struct kvs_attn_meta m = {.n_seqs = S, .h_q_start = qs, .h_pos = pos, .max_ctx = CTX};
        const struct kvs_kv_step step = {S, n, qs, pos, slot, dec, &m, NULL, 0};
        REQUIRE(st->step(state, &step) == 0, "step");
        for (int l = 0; l < L; l++) {
            st->write(state, l, dk, dv, NULL, n);
            st->attention(state, l, dq, &m, n, NH, NKV, HDIM, BSZ, 0.25f, dout);
        }
        steps++;
        int held;
        const struct kvs_lean_dyn_store *d = kvs_kv_storage_lean_dyn_of(state);
        if (kvs_lean_dyn_check(d, &held, msg, sizeof msg)) {
            CHECK(0, "fuzz step %d: %s", steps, msg);
            bad = 1;
        }
    }
    for (int sl = 0; sl < SLOTS; sl++)
        if (live[sl]) st->seq_free(state, sl), ends++;
    int held = -1;
    const struct kvs_lean_dyn_store *d = kvs_kv_storage_lean_dyn_of(state);
    CHECK(kvs_lean_dyn_check(d, &held, msg, sizeof msg) == 0 && held == 0, "after every request ended: %d pages held "
          "(%s)", held, msg);
    struct kvs_kv_counter cn[8];
    const int nc = st->counters(state, cn, 8);
    CHECK(nc == 8 && cn[6].value == 0 && cn[2].value > 1.0, "counters: %d, compression %g", nc, nc > 2 ? cn[2].value : 0);
    if (!bad)
        printf("ok allocator fuzz: %d steps, %d request ends (end, preemption, cancellation alike): every page once, "
               "live heads hold their sections' pages, none held at the end; %.2fx less than bf16\n", steps, ends,
               cn[2].value);
    st->destroy(state);
    o->free_buf(be, dq), o->free_buf(be, dk), o->free_buf(be, dv), o->free_buf(be, dout);
    free(hq), free(hk), free(hv);
    kvs_config_free(&c);
    o->free(be);
}

/* ---- 5. refusals -------------------------------------------------------------------------------- */
static void test_refusals(void)
{
    char err[256];
    struct kvs_backend *be = o->create(1, err, sizeof err);
    REQUIRE(be, "%s", err);
    const struct kvs_kv_storage_ops *st = kvs_kv_find_storage("lean");
    struct {
        const char *key, *value, *expect;
        int rc;
    } cases[] = {
        {"kv.reuse", "prefix", "kv.reuse = prefix", -EINVAL},
        {"kv.decode", "mac", "kv.decode = mac", -EINVAL},
        {"kv.fidelity.sample_every", "4", "kv.fidelity.sample_every", -EINVAL},
        {"device", "bare", "cpu and cuda backends only", -ENOSYS},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct kvs_config c;
        fuzz_cfg(&c);
        struct kvs_backend_ops bare = kvs_cpu_backend;
        if (!strcmp(cases[i].key, "kv.reuse")) set_str(&c.kv_reuse, cases[i].value);
        if (!strcmp(cases[i].key, "kv.decode")) set_str(&c.kv_decode, cases[i].value);
        if (!strcmp(cases[i].key, "kv.fidelity.sample_every")) c.kv_fidelity_sample_every = 4;
        if (!strcmp(cases[i].key, "device")) bare.name = "metal";   /* a backend without the kernels */
        const struct kvs_kv_shape sh = {2, 2, 16, 4, &c, 4, 4, 32, 64};
        void *state = NULL;
        err[0] = 0;
        const int rc = st->create(&sh, &bare, be, 16, &state, err, sizeof err);
        CHECK(rc == cases[i].rc && strstr(err, cases[i].expect) && strstr(err, "dynamic"), "%s = %s: rc %d (%s)",
              cases[i].key, cases[i].value, rc, err);
        if (state) st->destroy(state);
        kvs_config_free(&c);
    }
    printf("ok dynamic mode refused with a reason: on a backend without its kernels, with kv.reuse prefix (lazy "
           "composes: test_kv_lean_docs), kv.decode mac, the fidelity meter\n");
    o->free(be);
}

int main(void)
{
    kvs_log_set_level(KVS_LOG_WARN);
    const struct kvs_lean_fmt k8v4 = {8, 4}, k4v2 = {4, 2}, k8v8 = {8, 8}, k4v4 = {4, 4};
    test_alg1("K8V4 + K4V2 default alphas (peaked)", k8v4, k4v2, 1, 0.02, 1);
    test_alg1("K8V4 + K4V2 alpha_h 2, alpha_l 0.3 (peaked)", k8v4, k4v2, 2, 0.3, 1);
    test_alg1("K8V4 + K4V2 all pruned (alpha_l huge)", k8v4, k4v2, 0, 1e12, 0);
    test_alg1("K8V4 + K4V2 all low (alpha_h huge)", k8v4, k4v2, 1e12, 0, 0);
    test_alg1("K8V8 + K4V4 default alphas (flat)", k8v8, k4v4, 1, 0.02, 0);
    test_neutral_dense();
    test_permutation();
    test_fuzz();
    test_refusals();
    return kvs_test_summary("test_kv_lean_dyn");
}
