/* test_kv_mac.c: MAC-Attention (kv.decode=mac; kernels/kv_mac.h, engine/kv/kv_decode_mac.c) on
 * the CPU backend.
 * Kernels against double math (kv_mac_case.h):
 *   1. a miss equals dense attention over [0, m]; the appended (rectified) summary equals dense
 *      attention over the complement of the band, [0, m - r] (the downdate unit test);
 *   2. NoPE exactness: the same query at every step, no RoPE: every step after the first hits
 *      on every head, skips > 0, and the output and the chained summaries equal dense attention;
 *   3. r >= m: every step hits (threshold wide open), the output still equals full attention;
 *   4. the match: nearest entry, ties to the lower entry, strict threshold, entries not older
 *      than m ignored, rows without F_MATCH never hit;
 *   5. LazyAttention layout (rotation offsets, padded blocks): a miss equals the backend's
 *      attention(), the summary equals attention_spans over [0, m - r];
 *   6. prefill rows append the summaries of their positions.
 * Through the runner and the engine (tiny Llama test model):
 *   7. KVS_KV_NEEDS_PRE_ROPE_Q: a test policy sees q_pre with RoPE(q_pre) == q bitwise;
 *   8. tau >= 1, or gen_min above the context: greedy tokens equal full attention's; an
 *      approximate setting counts lookups, hits, skip and bytes read; preemption; the rings'
 *      budget is refused at startup naming kv.decode_state_bytes;
 *   9. 500 requests at an approximate setting with shared prefixes, random cancellations and a
 *      pool that preempts: every request ends, every block comes back, MAC still hits. */
#include "base/util.h"
#include "engine/config.h"
#include "engine/engine.h"
#include "engine/kv/kv.h"
#include "models/model.h"
#include "tests/unit/kv_engine_run.h"
#include "tests/unit/kv_mac_case.h"
#include "tests/unit/test_util.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

static const struct kvs_backend_ops *O = &kvs_cpu_backend;

static double rel(const float *got, const double *ref, int n)
{
    double num = 0, den = 0;
    for (int i = 0; i < n; i++) num += (got[i] - ref[i]) * (got[i] - ref[i]), den += ref[i] * ref[i];
    return sqrt(num / (den > 0 ? den : 1));
}

static void rand_q(float *q, size_t n)
{
    for (size_t i = 0; i < n; i++) q[i] = mc_frand();
}

/* max over rows of one-row seqs and heads: rel err of out vs dense [0, m], lse err */
static void check_full(struct mc *c, const int *pos_end, const float *q, const char *what)
{
    double worst = 0, worst_l = 0, ref[256];
    for (int s = 0; s < c->S; s++)
        for (int h = 0; h < c->nh; h++) {
            const int g = h / (c->nh / c->nkv);
            const float *qh = q + ((size_t)s * c->nh + h) * c->hd;
            double l = mc_ref(c, s, g, qh, 0, pos_end[s] + 1, ref);
            double e = rel(c->o_out + ((size_t)s * c->nh + h) * c->hd, ref, c->hd);
            double el = fabs(c->o_lse[s * c->nh + h] - l);
            if (e > worst) worst = e;
            if (el > worst_l) worst_l = el;
        }
    CHECK(worst < 1e-5 && worst_l < 1e-5, "%s: rel err %g, lse err %g", what, worst, worst_l);
}

/* the ring entry of position m (sequence s) against dense attention over [0, m - r] */
static double check_summary(struct mc *c, int s, int m, const float *q_row, int *tag_ok)
{
    double worst = 0, ref[256];
    float o[256], l;
    for (int h = 0; h < c->nh; h++) {
        const int g = h / (c->nh / c->nkv);
        int32_t tag = mc_ring(c, s, m % c->K, h, o, &l);
        *tag_ok &= tag == m + 1;
        const int hi = m - c->band + 1;
        double rl = mc_ref(c, s, g, q_row + (size_t)h * c->hd, 0, hi > 0 ? hi : 0, ref);
        if (hi <= 0) {
            *tag_ok &= l == -INFINITY;
            continue;
        }
        double e = rel(o, ref, c->hd) + fabs(l - rl);
        if (e > worst) worst = e;
    }
    return worst;
}

static void test_miss_and_rectify(struct kvs_backend *b)
{
    struct mc c;
    mc_init(&c, O, b, 2, 4, 2, 32, 16, 20, 16, 8, 0);
    c.thresh2 = 1e30f;
    float q[2 * 4 * 32];
    rand_q(q, sizeof q / 4);
    const int pos[2] = {200, 150}, nr[2] = {1, 1};
    const int fl[2] = {KVS_MAC_F_MAC | KVS_MAC_F_APPEND, KVS_MAC_F_MAC | KVS_MAC_F_APPEND};   /* no F_MATCH */
    mc_step(&c, pos, nr, fl, q, q);
    int nohit = 1, tag_ok = 1;
    for (int i = 0; i < 2 * 4; i++) nohit &= c.o_p[i] == -1;
    CHECK(nohit, "rows without F_MATCH never hit, even with the threshold wide open");
    check_full(&c, pos, q, "miss");
    double e = 0;
    for (int s = 0; s < 2; s++) {
        double es = check_summary(&c, s, pos[s], q + (size_t)s * 4 * 32, &tag_ok);
        if (es > e) e = es;
    }
    CHECK(e < 1e-5 && tag_ok, "rectified summary vs dense over [0, m - r]: err %g, tags %d", e, tag_ok);
    printf("ok a miss equals dense attention; the stored summary equals dense over the complement of the band (%.1e)\n",
           e);
    mc_free(&c);
}

static void test_nope(struct kvs_backend *b)
{
    struct mc c;
    mc_init(&c, O, b, 1, 4, 2, 32, 16, 20, 16, 8, 0);
    c.thresh2 = 2.0f * 32 * 0.55f * 0.55f;   /* tau = 0.45 */
    float q[4 * 32];
    rand_q(q, sizeof q / 4);
    const int nr[1] = {1}, fl[1] = {KVS_MAC_F_MAC | KVS_MAC_F_MATCH | KVS_MAC_F_APPEND};
    int hit_steps = 0, all_hit = 1, skip = 0, tag_ok = 1;
    double worst_sum = 0;
    for (int m = 100; m < 140; m++) {
        const int pos[1] = {m};
        mc_step(&c, pos, nr, fl, q, q);   /* RoPE off: q == q_pre, the same vector every step */
        check_full(&c, pos, q, "NoPE step");
        int hits = 0;
        for (int h = 0; h < 4; h++) {
            hits += c.o_p[h] >= 0;
            if (c.o_p[h] >= 0 && c.o_p[h] - c.band + 1 > 0) skip = 1;
        }
        if (m > 100) all_hit &= hits == 4, hit_steps += hits == 4;
        else CHECK(hits == 0, "the first step has an empty ring");
        double e = check_summary(&c, 0, m, q, &tag_ok);
        if (e > worst_sum) worst_sum = e;
    }
    CHECK(all_hit && skip && tag_ok && worst_sum < 1e-5, "NoPE: %d hit steps, skip %d, tags %d, summary err %g",
          hit_steps, skip, tag_ok, worst_sum);
    printf("ok NoPE exactness: %d steps hit on every head with skip > 0; outputs and chained summaries equal dense "
           "(%.1e)\n", hit_steps, worst_sum);
    mc_free(&c);
}

static void test_band_covers(struct kvs_backend *b)
{
    struct mc c;
    mc_init(&c, O, b, 1, 4, 1, 32, 16, 20, 16, 400, 0);   /* r = 400 > every position */
    c.thresh2 = 1e30f;                                     /* every lookup hits */
    const int nr[1] = {1}, fl[1] = {KVS_MAC_F_MAC | KVS_MAC_F_MATCH | KVS_MAC_F_APPEND};
    int hits = 0;
    for (int m = 100; m < 120; m++) {
        float q[4 * 32];
        rand_q(q, sizeof q / 4);
        const int pos[1] = {m};
        mc_step(&c, pos, nr, fl, q, q);
        check_full(&c, pos, q, "r >= m");
        for (int h = 0; h < 4; h++) hits += c.o_p[h] >= 0;
    }
    CHECK(hits == 19 * 4, "r >= m: %d hits", hits);
    printf("ok r >= m: %d hits (different random queries), every output equals full attention\n", hits);
    mc_free(&c);
}

static void test_match(struct kvs_backend *b)
{
    struct mc c;
    const int K = 8, nh = 2, hd = 16;
    mc_init(&c, O, b, 1, nh, 1, hd, 16, 4, K, 4, 0);
    float q[2 * 16], ring[8 * 2 * 16];
    rand_q(q, sizeof q / 4);
    for (int i = 0; i < nh * hd; i++) q[i] = roundf(q[i] * 1024.0f) / 1024.0f;   /* q +- 1 exact */
    int32_t tags[8] = {0};
    /* head 0: entries 2 and 5 equal q (ties: the lower), entry 3 near; entry 6 equals q but holds
     * a position not older than m. head 1: every entry at squared distance exactly 4 */
    for (int j = 0; j < K; j++)
        for (int i = 0; i < hd; i++) {
            float d0 = j == 2 || j == 5 || j == 6 ? 0.0f : j == 3 ? 0.01f : 1.0f;
            ring[(j * nh + 0) * hd + i] = q[i] + d0;
            ring[(j * nh + 1) * hd + i] = q[hd + i] + (i < 4 ? (j % 2 ? 1.0f : -1.0f) : 0.0f);
        }
    const int m = 40;
    for (int j = 0; j < K; j++) tags[j] = j == 6 ? m + 1 : 30 + j + 1;
    O->upload(b, c.rq, 0, ring, sizeof ring / 4);
    O->upload(b, c.rt, 0, tags, (size_t)K);
    const int pos[1] = {m}, nr[1] = {1}, fl[1] = {KVS_MAC_F_MAC | KVS_MAC_F_MATCH};
    c.thresh2 = 4.0f;
    mc_step(&c, pos, nr, fl, q, q);
    CHECK(c.o_p[0] == 32 && c.o_p[1] == -1, "ties to the lower entry, strict threshold: p = %d, %d", c.o_p[0], c.o_p[1]);
    c.thresh2 = 4.01f;
    mc_step(&c, pos, nr, fl, q, q);
    CHECK(c.o_p[1] == 30, "all at distance 4: the lowest entry: p = %d", c.o_p[1]);
    printf("ok match: nearest entry, ties to the lower, strict threshold, entries not older than m ignored\n");
    mc_free(&c);
}

static void test_lazy_layout(struct kvs_backend *b)
{
    struct mc c;
    const int nh = 4, nkv = 2, hd = 32, S = 2, r = 8;
    mc_init(&c, O, b, S, nh, nkv, hd, 16, 20, 16, r, 1);
    float q[2 * 4 * 32], want[2 * 4 * 32], wl[8], sl[8], so[2 * 4 * 32];
    rand_q(q, sizeof q / 4);
    const int pos[2] = {250, 180}, nr[2] = {1, 1};
    const int fl[2] = {KVS_MAC_F_MAC | KVS_MAC_F_APPEND, KVS_MAC_F_MAC | KVS_MAC_F_APPEND};
    mc_step(&c, pos, nr, fl, q, q);
    int32_t hq[MC_MAXS + 1], hp[MC_MAXS];
    struct kvs_attn_meta m = mc_meta(&c, pos, nr, hq, hp);
    const size_t qd = (size_t)nh * hd;
    O->upload(b, c.q, 0, q, 2 * qd);
    O->attention(b, c.q, c.kc, c.vc, &m, 2, nh, nkv, hd, 16, 1.0f / sqrtf((float)hd), c.out);
    O->download(b, want, c.out, 0, 2 * qd);
    double e = 0;
    for (size_t i = 0; i < 2 * qd; i++) e = fmax(e, fabs(want[i] - c.o_out[i]));
    /* the summaries: attention_spans over [0, m - r] with the same layout */
    int32_t ns[4], sp[8];
    for (int s = 0; s < 2; s++)
        for (int g = 0; g < nkv; g++) ns[s * nkv + g] = 1, sp[(s * nkv + g) * 2] = 0, sp[(s * nkv + g) * 2 + 1] = pos[s] - r + 1;
    struct kvs_dbuf *dn = O->alloc(b, KVS_BUF_I32, 4), *dsp = O->alloc(b, KVS_BUF_I32, 8), *dl = O->alloc(b, KVS_BUF_F32, 8);
    O->upload(b, dn, 0, ns, 4);
    O->upload(b, dsp, 0, sp, 8);
    const struct kvs_span_list L = {1, dn, dsp, ns, sp};
    O->attention_spans(b, c.q, c.kc, c.vc, &m, &L, 2, nh, nkv, hd, 16, 1.0f / sqrtf((float)hd), c.out, dl);
    O->download(b, so, c.out, 0, 2 * qd);
    O->download(b, sl, dl, 0, 8);
    double es = 0;
    int tags = 1;
    for (int s = 0; s < 2; s++)
        for (int h = 0; h < nh; h++) {
            float o[32], l;
            tags &= mc_ring(&c, s, pos[s] % c.K, h, o, &l) == pos[s] + 1;
            for (int i = 0; i < hd; i++) es = fmax(es, fabs(o[i] - so[(s * nh + h) * hd + i]));
            es = fmax(es, fabs(l - sl[s * nh + h]));
            wl[s * nh + h] = l;
        }
    (void)wl;
    CHECK(e < 1e-5 && es < 1e-5 && tags, "lazy layout: out err %g, summary err %g, tags %d", e, es, tags);
    printf("ok LazyAttention layout (rotation offsets, padded blocks): miss = attention() (%.1e), summary = "
           "attention_spans over [0, m - r] (%.1e)\n", e, es);
    O->free_buf(b, dn), O->free_buf(b, dsp), O->free_buf(b, dl);
    mc_free(&c);
}

static void test_prefill_append(struct kvs_backend *b)
{
    struct mc c;
    const int nh = 2, hd = 16, K = 16;
    mc_init(&c, O, b, 1, nh, 1, hd, 16, 8, K, 8, 0);
    float q[16 * 2 * 16];
    rand_q(q, sizeof q / 4);
    const int pos[1] = {99}, nr[1] = {K}, fl[1] = {KVS_MAC_F_APPEND};
    mc_step(&c, pos, nr, fl, q, q);
    int tag_ok = 1;
    double e = 0;
    for (int i = 0; i < K; i++) {
        double ei = check_summary(&c, 0, 99 - K + 1 + i, q + (size_t)i * nh * hd, &tag_ok);
        if (ei > e) e = ei;
    }
    float zero = 0;
    for (int i = 0; i < K * nh * hd; i++) zero = fmaxf(zero, fabsf(c.o_out[i]));
    CHECK(tag_ok && e < 1e-5 && zero == 0, "prefill append: tags %d, summary err %g, out touched %g", tag_ok, e, zero);
    printf("ok prefill rows append the summaries of their %d positions (%.1e) and leave out alone\n", K, e);
    mc_free(&c);
}

/* ---- through the runner and the engine ------------------------------------------------ */

static struct kvs_model *model;
static int pr_rows, pr_bad, pr_rotated;

struct pr_state {
    const struct kvs_backend_ops *o;
    struct kvs_backend *be;
    struct kvs_dbuf *scratch, *pos, *iota;
    int cap, qd, nh, hd;
};

static int pr_create(const struct kvs_kv_decode_env *env, void **state, char *err, size_t errlen)
{
    struct pr_state *s = calloc(1, sizeof *s);
    if (!s) return kvs_err(err, errlen, -ENOMEM, "no memory");
    s->o = env->o, s->be = env->be, s->cap = env->max_rows, s->nh = env->n_heads, s->hd = env->head_dim;
    s->qd = env->n_heads * env->head_dim;
    s->scratch = env->o->alloc(env->be, KVS_BUF_ACT, (size_t)s->cap * s->qd);
    s->pos = env->o->alloc(env->be, KVS_BUF_I32, (size_t)s->cap);
    s->iota = env->o->alloc(env->be, KVS_BUF_I32, (size_t)s->cap);
    int32_t *io = malloc((size_t)s->cap * 4);
    for (int i = 0; i < s->cap; i++) io[i] = i;
    env->o->upload(env->be, s->iota, 0, io, (size_t)s->cap);
    free(io);
    *state = s;
    return 0;
}

static void pr_destroy(void *state)
{
    struct pr_state *s = state;
    s->o->free_buf(s->be, s->scratch), s->o->free_buf(s->be, s->pos), s->o->free_buf(s->be, s->iota);
    free(s);
}

/* RoPE(q_pre) at the rows' positions must be q, bitwise (same op on the same input) */
static void pr_attend(void *state, int layer, const struct kvs_kv_attend *a)
{
    (void)layer;
    struct pr_state *s = state;
    const struct kvs_kv_step *st = a->step;
    const int n = st->n_rows;
    if (!a->q_pre) {
        pr_bad++;
    } else {
        int32_t *pos = malloc((size_t)n * 4);
        for (int q = 0; q < st->n_seqs; q++)
            for (int t = st->h_q_start[q]; t < st->h_q_start[q + 1]; t++) pos[t] = st->h_pos[q] + t - st->h_q_start[q];
        s->o->upload(s->be, s->pos, 0, pos, (size_t)n);
        s->o->gather_rows(s->be, a->q_pre, s->iota, n, s->qd, s->scratch);
        float *pre = malloc((size_t)n * s->qd * 4), *want = malloc((size_t)n * s->qd * 4);
        s->o->download(s->be, pre, s->scratch, 0, (size_t)n * s->qd);
        s->o->rope(s->be, s->scratch, s->pos, NULL, st->m->inv_freq, n, s->nh, s->hd);
        float *got = malloc((size_t)n * s->qd * 4);
        s->o->download(s->be, got, s->scratch, 0, (size_t)n * s->qd);
        s->o->download(s->be, want, a->q, 0, (size_t)n * s->qd);
        if (memcmp(got, want, (size_t)n * s->qd * 4)) pr_bad++;
        for (int t = 0; t < n; t++)
            if (pos[t] > 0 && memcmp(pre + (size_t)t * s->qd, want + (size_t)t * s->qd, (size_t)s->qd * 4)) pr_rotated++;
        pr_rows += n;
        free(pos), free(pre), free(want), free(got);
    }
    s->o->attention(s->be, a->q, a->kv.k, a->kv.v, st->m, n, a->n_heads, a->n_kv_heads, a->head_dim, a->block_size,
                    a->scale, a->out);
}

static const struct kvs_kv_decode_ops pr_ops = {
    .name = "test_prerope", .exact = 1, .needs = KVS_KV_NEEDS_PRE_ROPE_Q, .rows_per_seq = 1,
    .create = pr_create, .destroy = pr_destroy, .attend = pr_attend,
};

#define NJ 5
#define GEN 20

struct job {
    int32_t prompt[64], got[GEN];
    int n_prompt, n_got;
};

/* count(): the counters against a recount in double from the same inputs */
static void test_count(struct kvs_backend *b)
{
    struct mc c;
    mc_init(&c, O, b, 4, 8, 2, 64, 16, 48, 16, 100, 0);
    int32_t rows[5 * 4], p[3 * 5 * 8];
    uint64_t got[KVS_MAC_N_COUNTS];
    mc_count(&c, rows, p, got);
    double want[KVS_MAC_N_COUNTS] = {0};
    for (int t = 0; t < 5; t++) {
        const int32_t *r = rows + 4 * t;
        if (!(r[3] & KVS_MAC_F_COUNT)) continue;
        for (int l = 0; l < 3; l++)
            for (int g = 0; g < 2; g++) {
                double lo = r[2] + 1;
                for (int h = g * 4; h < g * 4 + 4; h++) {
                    const int ph = p[(l * 5 + t) * 8 + h];
                    const double s0 = ph >= 0 ? fmax(ph - 100 + 1, 0) : 0;
                    lo = fmin(lo, s0);
                    want[KVS_MAC_C_LOOKUPS] += (r[3] & KVS_MAC_F_MATCH) ? 1 : 0;
                    want[KVS_MAC_C_HITS] += ph >= 0;
                    want[KVS_MAC_C_HEADS] += 1;
                    want[KVS_MAC_C_SKIP] += s0 / (r[2] + 1);
                }
                want[KVS_MAC_C_READ] += r[2] + 1 - lo;
            }
    }
    int ok = 1;
    for (int k = 0; k < KVS_MAC_N_COUNTS; k++) {
        const double g = k == KVS_MAC_C_SKIP ? (double)got[k] / KVS_MAC_SKIP_ONE : (double)got[k];
        ok &= fabs(g - 2 * want[k]) <= (k == KVS_MAC_C_SKIP ? 1e-5 * (1 + want[k]) : 0);
    }
    CHECK(ok && want[KVS_MAC_C_HITS] > 0 && want[KVS_MAC_C_LOOKUPS] > 0, "count: lookups %llu (%g) hits %llu (%g) heads %llu "
          "(%g) skip %g (%g) read %llu (%g)", (unsigned long long)got[0], 2 * want[0], (unsigned long long)got[1],
          2 * want[1], (unsigned long long)got[2], 2 * want[2], (double)got[3] / KVS_MAC_SKIP_ONE, 2 * want[3],
          (unsigned long long)got[4], 2 * want[4]);
    printf("ok count: two calls accumulate lookups, hits, heads, skip and the groups' read spans on the backend\n");
    mc_free(&c);
}

static void base_cfg(struct kvs_config *c, const char *decode)
{
    kvs_config_init(c);
    free(c->device), c->device = kvs_xstrdup("cpu");
    free(c->kv_decode), c->kv_decode = kvs_xstrdup(decode);
    c->cpu_threads = 2;
    c->kv_block_size = 16;
    c->kv_memory_bytes = 4 << 20;
    c->max_batch_tokens = 128;
    c->max_running = 4;
    c->max_waiting = 64;
    c->max_model_len = 256;
}

static int run(const struct kvs_config *cfg, struct job *jobs, struct kvs_engine_stats *st, char *err, size_t errlen)
{
    struct kvs_test_job tj[NJ];
    for (int i = 0; i < NJ; i++)
        tj[i] = (struct kvs_test_job){jobs[i].prompt, jobs[i].n_prompt, NULL, 0, jobs[i].got, 0, KVS_FINISH_NONE};
    int rc = kvs_test_engine_run(cfg, model, tj, NJ, GEN, st, err, errlen);
    for (int i = 0; i < NJ; i++) {
        jobs[i].n_got = tj[i].n_got;
    }
    return rc;
}

static int same(const struct job *a, const struct job *b)
{
    for (int i = 0; i < NJ; i++)
        if (a[i].n_got != GEN || b[i].n_got != GEN || memcmp(a[i].got, b[i].got, sizeof a[i].got)) return 0;
    return 1;
}

static void test_engine(void)
{
    static struct job ref[NJ], got[NJ];
    uint64_t rng = 77;
    for (int i = 0; i < NJ; i++) {
        ref[i].n_prompt = 30 + (int)(kvs_test_xorshift(&rng) % 30);
        for (int t = 0; t < ref[i].n_prompt; t++) ref[i].prompt[t] = 1 + (int32_t)(kvs_test_xorshift(&rng) % 200);
    }
    char err[256];
    struct kvs_engine_stats st;
    struct kvs_config c;
    base_cfg(&c, "full");
    REQUIRE(run(&c, ref, &st, err, sizeof err) == 0, "%s", err);
    kvs_config_free(&c);

    /* the runner's pre-RoPE queries */
    REQUIRE(kvs_kv_register_decode(&pr_ops) == 0, "register test_prerope");
    memcpy(got, ref, sizeof got);
    base_cfg(&c, "test_prerope");
    REQUIRE(run(&c, got, &st, err, sizeof err) == 0, "%s", err);
    kvs_config_free(&c);
    CHECK(pr_rows > 0 && pr_bad == 0 && pr_rotated > 0 && same(ref, got),
          "pre-RoPE q: %d rows, %d mismatches, %d rotated rows, tokens equal %d", pr_rows, pr_bad, pr_rotated,
          same(ref, got));
    printf("ok runner pre-RoPE queries: %d rows, RoPE(q_pre) == q bitwise, greedy tokens equal full\n", pr_rows);

    /* neutral settings */
    struct {
        double tau;
        int gen_min;
        int64_t kv_mem;
        const char *what;
    } neutral[] = {{1.0, 0, 4 << 20, "tau = 1"}, {0.0, 100000, 4 << 20, "gen_min above the context"},
                   {1.0, 0, 40 * 1024, "tau = 1 with preemption"}};
    for (size_t i = 0; i < sizeof neutral / sizeof neutral[0]; i++) {
        memcpy(got, ref, sizeof got);
        base_cfg(&c, "mac");
        c.mac_tau = neutral[i].tau, c.mac_gen_min = neutral[i].gen_min, c.mac_ring_size = 32, c.mac_band = 4;
        c.kv_memory_bytes = neutral[i].kv_mem;
        REQUIRE(run(&c, got, &st, err, sizeof err) == 0, "%s", err);
        kvs_config_free(&c);
        double look = kvs_engine_kv_counter(&st, "kvserve:kv_mac_lookups_total");
        double ring = kvs_engine_kv_counter(&st, "kvserve:kv_mac_ring_bytes");
        CHECK(same(ref, got) && look == 0 && ring > 0, "mac %s: tokens equal %d, lookups %g, ring bytes %g",
              neutral[i].what, same(ref, got), look, ring);
        printf("ok mac %s: greedy tokens equal full attention (%llu preemptions)\n", neutral[i].what,
               (unsigned long long)st.num_preemptions);
    }

    /* an approximate setting: lookups, hits, skip and bytes read are counted */
    memcpy(got, ref, sizeof got);
    base_cfg(&c, "mac");
    c.mac_tau = 0.0, c.mac_gen_min = 16, c.mac_ring_size = 32, c.mac_band = 4;
    c.kv_fidelity_sample_every = 1;
    REQUIRE(run(&c, got, &st, err, sizeof err) == 0, "%s", err);
    kvs_config_free(&c);
    double look = kvs_engine_kv_counter(&st, "kvserve:kv_mac_lookups_total");
    double hits = kvs_engine_kv_counter(&st, "kvserve:kv_mac_hits_total");
    double ss = kvs_engine_kv_counter(&st, "kvserve:kv_mac_skip_sum");
    double sc = kvs_engine_kv_counter(&st, "kvserve:kv_mac_skip_count");
    double rd = kvs_engine_kv_counter(&st, "kvserve:kv_decode_bytes_read_total");
    double full = kvs_engine_kv_counter(&st, "kvserve:kv_decode_bytes_full_total");
    double fs = kvs_engine_kv_counter(&st, "kvserve:kv_fidelity_rel_l2_sum");
    double fc = kvs_engine_kv_counter(&st, "kvserve:kv_fidelity_rel_l2_count");
    int n_ok = 1;
    for (int i = 0; i < NJ; i++) n_ok &= got[i].n_got == GEN;
    CHECK(n_ok && look > 0 && hits > 0 && hits <= look && sc > 0 && rd > 0 && rd <= full && fc > 0,
          "mac tau 0: lookups %g hits %g skip %g/%g read %g of %g, fidelity %g samples", look, hits, ss, sc, rd, full,
          fc);
    printf("ok mac tau 0, K 32, r 4: hit rate %.3f, mean skip %.3f, KV read %.1f%% of full, mean rel-L2 %.3g\n",
           hits / look, ss / sc, 100.0 * rd / full, fs / (fc > 0 ? fc : 1));

    /* the rings' budget */
    base_cfg(&c, "mac");
    c.kv_decode_state_bytes = 1000;
    struct kvs_engine *e = NULL;
    int rc = kvs_engine_create(&c, model, NULL, &e, err, sizeof err);
    CHECK(rc == -ENOMEM && strstr(err, "kv.decode_state_bytes") && strstr(err, "mac"), "ring budget: rc %d (%s)", rc,
          err);
    if (e) kvs_engine_free(e);
    kvs_config_free(&c);
}

static void test_stress(void)
{
    struct kvs_config c;
    base_cfg(&c, "mac");
    free(c.kv_reuse), c.kv_reuse = kvs_xstrdup("prefix");
    c.mac_tau = 0.0, c.mac_gen_min = 16, c.mac_ring_size = 32, c.mac_band = 4;
    c.kv_memory_bytes = 20 * 8192;
    c.max_waiting = 500;
    char err[256];
    struct kvs_engine *e;
    REQUIRE(kvs_engine_create(&c, model, NULL, &e, err, sizeof err) == 0, "%s", err);
    struct kvs_test_stress sr;
    kvs_test_engine_stress(e, 500, 12, 40, 150, 0xC0FFEEull, &sr);
    const double look = kvs_engine_kv_counter(&sr.st, "kvserve:kv_mac_lookups_total");
    const double hits = kvs_engine_kv_counter(&sr.st, "kvserve:kv_mac_hits_total");
    CHECK(sr.finished + sr.cancelled == 500 && sr.cancelled <= sr.n_cancel && sr.finished >= 500 - sr.n_cancel,
          "%d finished, %d cancelled", sr.finished, sr.cancelled);
    CHECK(sr.st.kv_blocks_used == 0 && sr.st.num_running == 0 && sr.st.num_waiting == 0,
          "blocks used %d, running %d, waiting %d", sr.st.kv_blocks_used, sr.st.num_running, sr.st.num_waiting);
    CHECK(sr.st.num_preemptions > 0 && look > 0 && hits > 0, "preemptions %llu, lookups %g, hits %g",
          (unsigned long long)sr.st.num_preemptions, look, hits);
    printf("ok stress mac: 500 requests (%d cancelled), %llu preemptions, %g hits of %g lookups, all blocks free\n",
           sr.cancelled, (unsigned long long)sr.st.num_preemptions, hits, look);
    kvs_engine_free(e);
    kvs_config_free(&c);
}

int main(void)
{
    kvs_log_set_level(KVS_LOG_WARN);
    char err[256];
    struct kvs_backend *b = O->create(2, err, sizeof err);
    REQUIRE(b, "%s", err);
    test_miss_and_rectify(b);
    test_nope(b);
    test_band_covers(b);
    test_match(b);
    test_lazy_layout(b);
    test_prefill_append(b);
    test_count(b);
    O->free(b);
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/tests/data/models/llama", kvs_test_root());
    REQUIRE(kvs_model_load(dir, &model, err, sizeof err) == 0, "%s", err);
    test_engine();
    test_stress();
    kvs_model_free(model);
    return kvs_test_summary("test_kv_mac");
}
