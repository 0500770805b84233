/* test_sampler.c: the sampler against hand-computed expectations: seeded determinism, greedy =
 * argmax, top_k = 1 = greedy, penalties on exactly the right logits, logit_bias bans, top_k /
 * top_p / min_p keep the right set with the right (renormalised) frequencies, temperature
 * reshapes the distribution, raw logprobs; kvs_sampler_is_argmax holds for exactly the plain
 * greedy settings, and for those the sampler's pick is the CPU backend's argmax_rows id on rows
 * with ties, NaN and infinities (failing exactly where that op reports -1). */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "engine/sampler.h"
#include "base/util.h"
#include "kernels/backend.h"
#include "tests/unit/test_util.h"


static struct kvs_sampling defaults(void)
{
    struct kvs_sampling p;
    memset(&p, 0, sizeof p);
    p.temperature = 1.0f;
    p.top_p = 1.0f;
    p.repetition_penalty = 1.0f;
    return p;
}

static uint64_t lcg = 12345;
static float frand(void)
{
    lcg = lcg * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((lcg >> 40) & 0xFFFFFF) / (float)0x1000000;
}

static void sample_n(const struct kvs_sampling *p, uint64_t rid, const float *logits, int V, int n, int *hist,
                     int32_t *seq)
{
    struct kvs_sampler s;
    char err[256];
    int rc = kvs_sampler_init(&s, p, rid, V, err, sizeof err);
    KVS_ASSERT(rc == 0);
    if (hist) memset(hist, 0, (size_t)V * sizeof(int));
    for (int i = 0; i < n; i++) {
        struct kvs_sample_result r;
        rc = kvs_sampler_sample(&s, logits, NULL, 0, 0, &r);
        KVS_ASSERT(rc == 0 && r.token >= 0 && r.token < V);
        if (hist) hist[r.token]++;
        if (seq) seq[i] = r.token;
    }
    kvs_sampler_free(&s);
}

static void test_determinism(void)
{
    enum { V = 300, N = 400 };
    float logits[V];
    for (int i = 0; i < V; i++) logits[i] = 3.0f * frand();
    struct kvs_sampling p = defaults();
    p.seed = 42;
    p.has_seed = 1;
    p.top_p = 0.9f;
    p.top_k = 50;
    int32_t a[N], b[N], c[N], d[N];
    sample_n(&p, 1, logits, V, N, NULL, a);
    sample_n(&p, 999, logits, V, N, NULL, b);   /* request id ignored when seeded */
    p.seed = 43;
    sample_n(&p, 1, logits, V, N, NULL, c);
    CHECK(memcmp(a, b, sizeof a) == 0, "same seed gave different tokens");
    CHECK(memcmp(a, c, sizeof a) != 0, "different seeds gave the same %d tokens", N);
    p.has_seed = 0;
    sample_n(&p, 7, logits, V, N, NULL, c);
    sample_n(&p, 7, logits, V, N, NULL, d);
    CHECK(memcmp(c, d, sizeof c) == 0, "unseeded: same request id gave different tokens");
    sample_n(&p, 8, logits, V, N, NULL, d);
    CHECK(memcmp(c, d, sizeof c) != 0, "unseeded: different request ids gave the same tokens");
    printf("ok determinism (seeded / request-id streams, %d draws)\n", N);
}

static void test_greedy(void)
{
    enum { V = 1000 };
    float logits[V];
    for (int trial = 0; trial < 20; trial++) {
        int best = 0;
        for (int i = 0; i < V; i++) {
            logits[i] = 10.0f * frand() - 5.0f;
            if (logits[i] > logits[best]) best = i;
        }
        struct kvs_sampling p = defaults();
        p.temperature = 0.0f;
        int32_t t[4];
        sample_n(&p, (uint64_t)trial, logits, V, 4, NULL, t);
        for (int i = 0; i < 4; i++) CHECK(t[i] == best, "greedy %d != argmax %d", t[i], best);
        p = defaults();
        p.top_k = 1;
        p.temperature = 1.3f;
        sample_n(&p, (uint64_t)trial, logits, V, 4, NULL, t);
        for (int i = 0; i < 4; i++) CHECK(t[i] == best, "top_k=1 gave %d, argmax %d", t[i], best);
    }
    /* ties go to the lowest id */
    float tie[5] = {1, 3, 2, 3, 0};
    struct kvs_sampling p = defaults();
    p.temperature = 0.0f;
    int32_t t;
    sample_n(&p, 1, tie, 5, 1, NULL, &t);
    CHECK(t == 1, "greedy tie broke to %d, want 1", t);
    printf("ok greedy = argmax, top_k=1 = greedy, ties to lowest id\n");
}

static void test_penalties(void)
{
    enum { V = 8 };
    const float logits[V] = {2.0f, -1.0f, 0.5f, 3.0f, -2.0f, 1.0f, 0.0f, 4.0f};
    /* prompt: 0, 1, 1; generated: 2, 3, 3, 3, 1 */
    const int32_t hist[] = {0, 1, 1, 2, 3, 3, 3, 1};
    struct kvs_sampling p = defaults();
    p.repetition_penalty = 2.0f;
    p.presence_penalty = 0.5f;
    p.frequency_penalty = 0.25f;
    struct kvs_sampler s;
    char err[256];
    KVS_ASSERT(kvs_sampler_init(&s, &p, 1, V, err, sizeof err) == 0);
    float out[V];
    kvs_sampler_processed_logits(&s, logits, hist, 3, 8, out);
    float want[V];
    memcpy(want, logits, sizeof want);
    want[0] = 2.0f / 2;                              /* prompt only: repetition */
    want[1] = -1.0f * 2 - (0.25f * 1 + 0.5f);        /* prompt + once generated */
    want[2] = 0.5f / 2 - (0.25f * 1 + 0.5f);
    want[3] = 3.0f / 2 - (0.25f * 3 + 0.5f);
    for (int i = 0; i < V; i++) CHECK(fabsf(out[i] - want[i]) < 1e-6f, "token %d: %g, want %g", i, out[i], want[i]);
    /* count scratch is clean again: a second call gives the same */
    float again[V];
    kvs_sampler_processed_logits(&s, logits, hist, 3, 8, again);
    CHECK(memcmp(out, again, sizeof out) == 0, "second call differs (count scratch not reset)");
    kvs_sampler_free(&s);
    /* presence/frequency alone ignore the prompt */
    p = defaults();
    p.presence_penalty = 1.0f;
    KVS_ASSERT(kvs_sampler_init(&s, &p, 1, V, err, sizeof err) == 0);
    kvs_sampler_processed_logits(&s, logits, hist, 3, 8, out);
    CHECK(out[0] == logits[0] && out[1] == logits[1] - 1.0f && out[3] == logits[3] - 1.0f && out[7] == logits[7],
          "presence penalty touched the wrong tokens");
    kvs_sampler_free(&s);
    printf("ok penalties (repetition over prompt+output, presence/frequency over output)\n");
}

static void test_logit_bias(void)
{
    enum { V = 50 };
    float logits[V];
    for (int i = 0; i < V; i++) logits[i] = frand();
    logits[17] = 5.0f;
    int32_t ids[2] = {17, 3};
    float vals[2] = {-100.0f, 2.5f};
    struct kvs_sampling p = defaults();
    p.n_logit_bias = 2;
    p.logit_bias_ids = ids;
    p.logit_bias_values = vals;
    int hist[V];
    sample_n(&p, 3, logits, V, 5000, hist, NULL);
    CHECK(hist[17] == 0, "banned token sampled %d times", hist[17]);
    p.temperature = 0.0f;
    int32_t t;
    sample_n(&p, 3, logits, V, 1, NULL, &t);
    CHECK(t == 3, "greedy with bias picked %d, want 3", t);
    /* bad ids are refused */
    ids[0] = V;
    struct kvs_sampler s;
    char err[256] = "";
    CHECK(kvs_sampler_init(&s, &p, 1, V, err, sizeof err) == -EINVAL && strstr(err, "logit_bias"),
          "out-of-vocab bias id accepted (%s)", err);
    printf("ok logit_bias (-100 bans; +2.5 wins greedy; bad id refused)\n");
}

/* frequencies of each token over N draws vs expected probabilities */
static void check_freq(const char *what, const struct kvs_sampling *p, const float *logits, int V,
                       const double *expect)
{
    enum { N = 40000 };
    int hist[64];
    sample_n(p, 11, logits, V, N, hist, NULL);
    for (int i = 0; i < V; i++) {
        double f = (double)hist[i] / N, sd = sqrt(expect[i] * (1 - expect[i]) / N);
        if (expect[i] == 0.0) CHECK(hist[i] == 0, "%s: token %d sampled %d times, want never", what, i, hist[i]);
        else CHECK(fabs(f - expect[i]) < 5 * sd + 1e-9, "%s: token %d freq %.4f want %.4f", what, i, f, expect[i]);
    }
    printf("ok %s\n", what);
}

static void test_filters(void)
{
    /* p = 1/2, 1/4, 1/8, 1/16, 1/32, 1/32 */
    enum { V = 6 };
    const double pr[V] = {0.5, 0.25, 0.125, 0.0625, 0.03125, 0.03125};
    float logits[V];
    for (int i = 0; i < V; i++) logits[i] = (float)log(pr[i]) + 0.7f;   /* offset must not matter */
    struct kvs_sampling p = defaults();
    check_freq("temperature 1 matches softmax", &p, logits, V, pr);
    p.temperature = 0.5f;   /* p^2 renormalised */
    double sq[V], z = 0;
    for (int i = 0; i < V; i++) z += pr[i] * pr[i];
    for (int i = 0; i < V; i++) sq[i] = pr[i] * pr[i] / z;
    check_freq("temperature 0.5 squares the distribution", &p, logits, V, sq);
    p = defaults();
    p.top_p = 0.7f;   /* 0.5 < 0.7 <= 0.75: keep {0, 1} */
    const double tp[V] = {2.0 / 3, 1.0 / 3, 0, 0, 0, 0};
    check_freq("top_p 0.7 keeps the 0.75 nucleus", &p, logits, V, tp);
    p.top_p = 0.75f;  /* exactly reached by {0, 1} */
    check_freq("top_p 0.75 boundary", &p, logits, V, tp);
    p = defaults();
    p.min_p = 0.2f;   /* keep p >= 0.1: {0, 1, 2} */
    const double mp[V] = {4.0 / 7, 2.0 / 7, 1.0 / 7, 0, 0, 0};
    check_freq("min_p 0.2 keeps p >= 0.1", &p, logits, V, mp);
    p.top_p = 0.55f;  /* min_p first (vLLM order): 0.5 / 0.875 = 0.571 >= 0.55 -> {0} alone */
    const double mp_tp[V] = {1, 0, 0, 0, 0, 0};
    check_freq("min_p 0.2 then top_p 0.55 (renormalised after min_p)", &p, logits, V, mp_tp);
    p = defaults();
    p.top_k = 3;
    check_freq("top_k 3", &p, logits, V, mp);
    p.top_p = 0.8f;   /* within top-3 (mass 7/8): 0.5/0.875=0.571, +0.286=0.857 >= 0.8 -> {0,1} */
    check_freq("top_k 3 then top_p 0.8 (renormalised in the top-k)", &p, logits, V, tp);
}

/* top_p on a large shuffled vocabulary: the nucleus is found without sorting, so check the
 * kept set and the frequencies against the closed form. p(rank r) ~ q^r, q = e^-0.05. */
static void test_top_p_large(void)
{
    enum { V = 2000, N = 12000 };
    static float logits[V];
    static int rank_of[V], hist[V];
    for (int i = 0; i < V; i++) rank_of[i] = i;
    for (int i = V - 1; i > 0; i--) {
        int j = (int)(frand() * (float)(i + 1));
        if (j > i) j = i;
        int t = rank_of[i];
        rank_of[i] = rank_of[j];
        rank_of[j] = t;
    }
    for (int i = 0; i < V; i++) logits[i] = -0.05f * (float)rank_of[i];
    const float tops[] = {0.5f, 0.9f, 0.99f};
    for (int ti = 0; ti < 3; ti++) {
        double q = exp(-0.05), z = (1 - pow(q, V)) / (1 - q), cum = 0;
        int k = 0;
        while (cum < tops[ti] * z) cum += pow(q, k++);
        struct kvs_sampling p = defaults();
        p.top_p = tops[ti];
        sample_n(&p, 21, logits, V, N, hist, NULL);
        int outside = 0, bad = 0;
        for (int i = 0; i < V; i++) {
            int r = rank_of[i];
            if (r >= k) {
                outside += hist[i];
                continue;
            }
            double e = pow(q, r) / cum, f = (double)hist[i] / N, sd = sqrt(e * (1 - e) / N);
            if (fabs(f - e) > 5 * sd + 1e-9) bad++;
        }
        CHECK(outside == 0, "top_p %.2f: %d draws outside the %d-token nucleus", tops[ti], outside, k);
        CHECK(bad == 0, "top_p %.2f: %d nucleus tokens off their expected frequency", tops[ti], bad);
        printf("ok top_p %.2f on a shuffled %d-token vocabulary: nucleus of %d tokens\n", tops[ti], V, k);
    }
}

static void test_logprobs(void)
{
    enum { V = 16 };
    float logits[V];
    for (int i = 0; i < V; i++) logits[i] = 4.0f * frand() - 2.0f;
    double mx = -1e30, z = 0;
    for (int i = 0; i < V; i++) mx = logits[i] > mx ? logits[i] : mx;
    for (int i = 0; i < V; i++) z += exp(logits[i] - mx);
    struct kvs_sampling p = defaults();
    p.logprobs = 1;
    p.top_logprobs = KVS_MAX_TOP_LOGPROBS;
    p.temperature = 0.3f;          /* raw logprobs ignore temperature and penalties */
    p.presence_penalty = 1.5f;
    struct kvs_sampler s;
    char err[256];
    KVS_ASSERT(kvs_sampler_init(&s, &p, 5, V, err, sizeof err) == 0);
    int32_t hist[3] = {1, 2, 3};
    for (int it = 0; it < 50; it++) {
        struct kvs_sample_result r;
        KVS_ASSERT(kvs_sampler_sample(&s, logits, hist, 1, 3, &r) == 0);
        double want = logits[r.token] - mx - log(z);
        CHECK(fabs(r.logprob - want) < 1e-5, "logprob %g want %g", r.logprob, want);
        CHECK(r.n_top == V, "n_top %d want %d (all of a %d-token vocabulary)", r.n_top, V, V);
        double sum = 0;
        int found = 0;
        for (int i = 0; i < r.n_top; i++) {
            sum += exp(r.top_logprobs[i]);
            if (i) CHECK(r.top_logprobs[i] <= r.top_logprobs[i - 1], "top_logprobs not sorted");
            CHECK(fabs(r.top_logprobs[i] - (logits[r.top_ids[i]] - mx - log(z))) < 1e-5, "top logprob mismatch");
            if (r.top_ids[i] == r.token) {
                found = 1;
                CHECK(r.top_logprobs[i] == r.logprob, "sampled token's logprob differs from its top entry");
            }
        }
        CHECK(fabs(sum - 1.0) < 1e-5, "top logprobs over the whole vocab sum to %g", sum);
        CHECK(found, "sampled token missing from the full top list");
    }
    kvs_sampler_free(&s);
    printf("ok logprobs (raw log-softmax, sorted top list, sums to 1)\n");
}

static void test_bad_params(void)
{
    struct kvs_sampler s;
    char err[256];
    struct kvs_sampling p = defaults();
    p.temperature = -1;
    CHECK(kvs_sampler_init(&s, &p, 1, 10, err, sizeof err) == -EINVAL, "negative temperature accepted");
    p = defaults();
    p.top_p = 0;
    CHECK(kvs_sampler_init(&s, &p, 1, 10, err, sizeof err) == -EINVAL, "top_p 0 accepted");
    p = defaults();
    p.top_logprobs = KVS_MAX_TOP_LOGPROBS + 1;
    CHECK(kvs_sampler_init(&s, &p, 1, 10, err, sizeof err) == -EINVAL, "top_logprobs 21 accepted");
    p = defaults();
    p.repetition_penalty = 0;
    CHECK(kvs_sampler_init(&s, &p, 1, 10, err, sizeof err) == -EINVAL, "repetition_penalty 0 accepted");
    /* all -inf logits: an error, not a crash */
    p = defaults();
    KVS_ASSERT(kvs_sampler_init(&s, &p, 1, 4, err, sizeof err) == 0);
    float bad[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
    struct kvs_sample_result r;
    CHECK(kvs_sampler_sample(&s, bad, NULL, 0, 0, &r) == -EINVAL, "all -inf logits sampled");
    kvs_sampler_free(&s);
    printf("ok bad parameters refused\n");
}

static int is_argmax(const struct kvs_sampling *p)
{
    struct kvs_sampler s;
    char err[256];
    int32_t id = 3;
    float bias = 1.0f;
    struct kvs_sampling q = *p;
    if (q.n_logit_bias) {
        q.logit_bias_ids = &id;
        q.logit_bias_values = &bias;
    }
    KVS_ASSERT(kvs_sampler_init(&s, &q, 1, 10, err, sizeof err) == 0);
    int r = kvs_sampler_is_argmax(&s);
    kvs_sampler_free(&s);
    return r;
}

static void test_argmax_fast_path(void)
{
    /* the predicate: plain greedy only */
    struct kvs_sampling p = defaults();
    p.temperature = 0.0f;
    CHECK(is_argmax(&p), "temperature 0");
    p.temperature = 0.7f;
    CHECK(!is_argmax(&p), "temperature 0.7");
    p.top_k = 1;
    CHECK(is_argmax(&p), "top_k 1 is greedy at any temperature");
    p.top_p = 0.5f;
    p.min_p = 0.2f;
    CHECK(is_argmax(&p), "top_p / min_p do not matter to greedy");
    struct kvs_sampling base = p;
    p.logprobs = 1;
    CHECK(!is_argmax(&p), "logprobs need the host row");
    p = base;
    p.top_logprobs = 2;
    CHECK(!is_argmax(&p), "top_logprobs need the host row");
    p = base;
    p.n_logit_bias = 1;
    CHECK(!is_argmax(&p), "logit_bias");
    p = base;
    p.repetition_penalty = 1.1f;
    CHECK(!is_argmax(&p), "repetition_penalty");
    p = base;
    p.presence_penalty = 0.5f;
    CHECK(!is_argmax(&p), "presence_penalty");
    p = base;
    p.frequency_penalty = -0.5f;
    CHECK(!is_argmax(&p), "frequency_penalty");

    /* the pick: the CPU backend's argmax_rows on the same rows */
    enum { V = 97, M = 64 };
    static float rows[M * V];
    for (int r = 0; r < M; r++) {
        float *x = rows + (size_t)r * V;
        for (int i = 0; i < V; i++) x[i] = (float)(int)(frand() * 6.0f);   /* many ties */
        int a = (int)(frand() * V), kind = r % 6;
        for (int i = 0; i < V; i++) {
            if (kind == 1 && i % 2 == 0) x[i] = NAN;                          /* NaN among ties */
            if (kind == 3) x[i] = NAN;                                        /* all NaN: no pick */
            if (kind == 4) x[i] = i % 3 ? -INFINITY : NAN;                    /* nothing above -inf: no pick */
            if (kind == 5) x[i] = frand() < 0.5f ? 0.0f : -0.0f;              /* +0 == -0 */
        }
        if (kind == 2) x[a] = INFINITY;
    }
    char err[256];
    struct kvs_backend *be = kvs_cpu_backend.create(1, err, sizeof err);
    REQUIRE(be, "%s", err);
    struct kvs_dbuf *L = kvs_cpu_backend.alloc(be, KVS_BUF_ACT, (size_t)M * V), *O = kvs_cpu_backend.alloc(be, KVS_BUF_I32, M);
    kvs_cpu_backend.upload(be, L, 0, rows, (size_t)M * V);
    kvs_cpu_backend.argmax_rows(be, L, M, V, O, 0);
    int32_t ids[M];
    kvs_cpu_backend.download(be, ids, O, 0, M);
    struct kvs_sampler s;
    p = defaults();
    p.temperature = 0.0f;
    KVS_ASSERT(kvs_sampler_init(&s, &p, 1, V, err, sizeof err) == 0 && kvs_sampler_is_argmax(&s));
    int agree = 1, n_fail = 0;
    for (int r = 0; r < M; r++) {
        struct kvs_sample_result res;
        int rc = kvs_sampler_sample(&s, rows + (size_t)r * V, NULL, 0, 0, &res);
        n_fail += rc < 0;
        if (rc < 0 ? ids[r] != -1 : ids[r] != res.token) {
            printf("row %d (kind %d): sampler rc %d token %d, argmax_rows %d\n", r, r % 6, rc, res.token, ids[r]);
            agree = 0;
        }
    }
    CHECK(agree, "the greedy sampler and argmax_rows disagree");
    CHECK(n_fail > 0, "no row exercised the failing case");
    kvs_sampler_free(&s);
    kvs_cpu_backend.free_buf(be, L);
    kvs_cpu_backend.free_buf(be, O);
    kvs_cpu_backend.free(be);
    printf("ok greedy fast path: predicate, and sampler pick == argmax_rows on %d rows (%d without a pick)\n", M,
           n_fail);
}

int main(void)
{
    test_determinism();
    test_greedy();
    test_penalties();
    test_logit_bias();
    test_filters();
    test_top_p_large();
    test_logprobs();
    test_bad_params();
    test_argmax_fast_path();
    return kvs_test_summary("test_sampler");
}
