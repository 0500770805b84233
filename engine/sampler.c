/* sampler.c: the per-request sampler (see sampler.h for the pipeline and its order). */
#include "base/rng.h"
#include "engine/sampler.h"

#include <math.h>
#include <string.h>

#include "base/util.h"
#include "kernels/backend.h"

#define SEEN_IN_PROMPT (1 << 30)   /* flag in count[]: token occurs in prompt or output */

/* ---- RNG: splitmix64 seeding, xoshiro256** ------------------------------------------------ */


static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static uint64_t xoshiro_next(uint64_t s[4])
{
    uint64_t result = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

double kvs_sampler_uniform(struct kvs_sampler *s) { return (double)(xoshiro_next(s->rng) >> 11) * 0x1.0p-53; }

/* ---- init / free -------------------------------------------------------------------------- */

int kvs_sampler_init(struct kvs_sampler *s, const struct kvs_sampling *params, uint64_t request_id, int vocab,
                     char *err, size_t errlen)
{
    memset(s, 0, sizeof *s);
    const struct kvs_sampling *p = params;
    if (vocab <= 0) return kvs_err(err, errlen, -EINVAL, "sampler: vocab size %d", vocab);
    if (!(p->temperature >= 0.0f) || !isfinite(p->temperature))
        return kvs_err(err, errlen, -EINVAL, "temperature must be >= 0 (got %g)", (double)p->temperature);
    if (!(p->top_p > 0.0f && p->top_p <= 1.0f))
        return kvs_err(err, errlen, -EINVAL, "top_p must be in (0, 1] (got %g)", (double)p->top_p);
    if (p->top_k < -1) return kvs_err(err, errlen, -EINVAL, "top_k must be >= 0, or -1 for off (got %d)", p->top_k);
    if (!(p->min_p >= 0.0f && p->min_p <= 1.0f))
        return kvs_err(err, errlen, -EINVAL, "min_p must be in [0, 1] (got %g)", (double)p->min_p);
    if (!(p->repetition_penalty > 0.0f) || !isfinite(p->repetition_penalty))
        return kvs_err(err, errlen, -EINVAL, "repetition_penalty must be > 0 (got %g)", (double)p->repetition_penalty);
    if (!isfinite(p->presence_penalty) || !isfinite(p->frequency_penalty))
        return kvs_err(err, errlen, -EINVAL, "presence_penalty / frequency_penalty must be finite");
    if (p->top_logprobs < 0 || p->top_logprobs > KVS_MAX_TOP_LOGPROBS)
        return kvs_err(err, errlen, -EINVAL, "top_logprobs must be in [0, %d] (got %d)", KVS_MAX_TOP_LOGPROBS,
                       p->top_logprobs);
    if (p->n_logit_bias < 0 || (p->n_logit_bias > 0 && (!p->logit_bias_ids || !p->logit_bias_values)))
        return kvs_err(err, errlen, -EINVAL, "logit_bias: bad arrays");
    for (int i = 0; i < p->n_logit_bias; i++) {
        if (p->logit_bias_ids[i] < 0 || p->logit_bias_ids[i] >= vocab)
            return kvs_err(err, errlen, -EINVAL, "logit_bias: token id %d is outside the vocabulary [0, %d)",
                           (int)p->logit_bias_ids[i], vocab);
        if (!isfinite(p->logit_bias_values[i]))
            return kvs_err(err, errlen, -EINVAL, "logit_bias: value for token %d is not finite",
                           (int)p->logit_bias_ids[i]);
    }
    s->p = *p;
    s->vocab = vocab;
    if (p->n_logit_bias > 0) {
        s->bias_ids = kvs_xmalloc((size_t)p->n_logit_bias * sizeof(int32_t));
        s->bias_values = kvs_xmalloc((size_t)p->n_logit_bias * sizeof(float));
        memcpy(s->bias_ids, p->logit_bias_ids, (size_t)p->n_logit_bias * sizeof(int32_t));
        memcpy(s->bias_values, p->logit_bias_values, (size_t)p->n_logit_bias * sizeof(float));
    }
    s->p.logit_bias_ids = s->bias_ids;
    s->p.logit_bias_values = s->bias_values;
    s->work = kvs_xmalloc((size_t)vocab * sizeof(float));
    s->idx = kvs_xmalloc((size_t)vocab * sizeof(int32_t));
    s->count = kvs_xcalloc((size_t)vocab, sizeof(int32_t));
    uint64_t x = p->has_seed ? p->seed : (request_id ^ 0x6B76736572766531ull);   /* "kvserve1" */
    for (int i = 0; i < 4; i++) s->rng[i] = kvs_splitmix64(&x);
    return 0;
}

void kvs_sampler_free(struct kvs_sampler *s)
{
    if (!s) return;
    free(s->bias_ids);
    free(s->bias_values);
    free(s->work);
    free(s->idx);
    free(s->count);
    memset(s, 0, sizeof *s);
}

/* ---- helpers ------------------------------------------------------------------------------ */

/* step 4 applies: temperature 0 or top_k 1 */
static int is_greedy(const struct kvs_sampling *p) { return p->temperature < 1e-5f || p->top_k == 1; }

/* steps 1-3 are all off: the logits are used as given */
static int is_plain(const struct kvs_sampling *p)
{
    return p->n_logit_bias == 0 && p->repetition_penalty == 1.0f && p->presence_penalty == 0.0f &&
           p->frequency_penalty == 0.0f;
}

static int wants_logprobs(const struct kvs_sampling *p) { return p->logprobs || p->top_logprobs > 0; }

int kvs_sampler_is_argmax(const struct kvs_sampler *s)
{
    return is_greedy(&s->p) && is_plain(&s->p) && !wants_logprobs(&s->p);
}

/* "a ranks before b": higher value, then lower id */
static inline int before(const float *v, int32_t a, int32_t b) { return v[a] > v[b] || (v[a] == v[b] && a < b); }

static int cmp_desc(const void *pa, const void *pb, void *ctx)
{
    const float *v = ctx;
    int32_t a = *(const int32_t *)pa, b = *(const int32_t *)pb;
    if (a == b) return 0;
    return before(v, a, b) ? -1 : 1;
}

/* heap of the k best ids under before(); the root is the worst of them */
static void sift_down(int32_t *h, int k, int i, const float *v)
{
    for (;;) {
        int l = 2 * i + 1, r = l + 1, w = i;
        if (l < k && before(v, h[w], h[l])) w = l;
        if (r < k && before(v, h[w], h[r])) w = r;
        if (w == i) return;
        int32_t t = h[i];
        h[i] = h[w];
        h[w] = t;
        i = w;
    }
}

/* ids of the k best entries of v[0..n) (NaN never selected), sorted best first; returns count */
static int top_k_ids(const float *v, int n, int k, int32_t *out)
{
    int m = 0;
    for (int32_t i = 0; i < n; i++) {
        if (isnan(v[i])) continue;
        if (m < k) {
            out[m++] = i;
            if (m == k)
                for (int j = k / 2 - 1; j >= 0; j--) sift_down(out, k, j, v);
        } else if (before(v, i, out[0])) {
            out[0] = i;
            sift_down(out, k, 0, v);
        }
    }
    qsort_r(out, (size_t)m, sizeof *out, cmp_desc, (void *)v);
    return m;
}

/* steps 1-3: bias and penalties, logits -> out */
static void process(struct kvs_sampler *s, const float *logits, const int32_t *history, int n_prompt, int n_hist,
                    float *w)
{
    const int V = s->vocab;
    const struct kvs_sampling *p = &s->p;
    /* 1. logit bias */
    if (w != logits) memcpy(w, logits, (size_t)V * sizeof(float));
    for (int i = 0; i < p->n_logit_bias; i++) w[p->logit_bias_ids[i]] += p->logit_bias_values[i];

    /* 2-3. penalties: count[] holds output counts plus a seen flag, and is zeroed again as
     * each distinct token is processed */
    int rep = p->repetition_penalty != 1.0f, pf = p->presence_penalty != 0.0f || p->frequency_penalty != 0.0f;
    if ((rep || pf) && history && n_hist > 0) {
        for (int i = 0; i < n_hist; i++) {
            int32_t t = history[i];
            if (t < 0 || t >= V) continue;
            if (i < n_prompt) s->count[t] |= SEEN_IN_PROMPT;
            else s->count[t] = (s->count[t] + 1) | SEEN_IN_PROMPT;
        }
        for (int i = 0; i < n_hist; i++) {
            int32_t t = history[i];
            if (t < 0 || t >= V || s->count[t] == 0) continue;
            int oc = s->count[t] & ~SEEN_IN_PROMPT;
            if (rep) w[t] = w[t] > 0.0f ? w[t] / p->repetition_penalty : w[t] * p->repetition_penalty;
            if (oc > 0) w[t] -= p->frequency_penalty * (float)oc + p->presence_penalty;
            s->count[t] = 0;
        }
    }
}

int kvs_sampler_processed_logits(struct kvs_sampler *s, const float *logits, const int32_t *history, int n_prompt,
                                 int n_hist, float *out)
{
    process(s, logits, history, n_prompt, n_hist, out);
    return 0;
}

/* The nucleus without sorting: reorders idx[0..n) so that its first k entries are the smallest
 * set of the heaviest tokens whose weight reaches target (every token tied with the lightest
 * kept one is kept too), and returns k. Three-way quickselect on weights, expected O(n). */
static int nucleus(const float *w, int32_t *idx, int n, double target)
{
    int lo = 0, hi = n;
    double acc = 0.0;             /* weight of idx[0..lo), all kept */
    while (lo < hi) {
        float pv = w[idx[lo + (hi - lo) / 2]];
        /* partition idx[lo..hi) into > pv | == pv | < pv */
        int gt = lo, i = lo, lt = hi;
        while (i < lt) {
            float v = w[idx[i]];
            int32_t t = idx[i];
            if (v > pv) {
                idx[i++] = idx[gt];
                idx[gt++] = t;
            } else if (v < pv) {
                idx[i] = idx[--lt];
                idx[lt] = t;
            } else {
                i++;
            }
        }
        double m_gt = 0.0, m_eq = 0.0;
        for (int k = lo; k < gt; k++) m_gt += w[idx[k]];
        for (int k = gt; k < lt; k++) m_eq += w[idx[k]];
        if (acc + m_gt >= target) {
            if (gt == lo) return lo;
            hi = gt;
        } else if (acc + m_gt + m_eq >= target) {
            return lt;
        } else {
            acc += m_gt + m_eq;
            lo = lt;
        }
    }
    return lo > 0 ? lo : n;
}

/* ---- sample ------------------------------------------------------------------------------- */

int kvs_sampler_sample(struct kvs_sampler *s, const float *logits, const int32_t *history, int n_prompt, int n_hist,
                       struct kvs_sample_result *out)
{
    const int V = s->vocab;
    const struct kvs_sampling *p = &s->p;
    float *w = s->work;
    int32_t *idx = s->idx;
    memset(out, 0, sizeof *out);

    /* raw log-softmax normaliser, for the reported logprobs: a pass of V exps, so only when the
     * request asked for logprobs (for a 128K vocabulary it was most of a greedy step's cost) */
    const int want_lp = wants_logprobs(p);
    float rmax = -INFINITY;
    if (want_lp)
        for (int i = 0; i < V; i++)
            if (logits[i] > rmax) rmax = logits[i];
    double rsum = 0.0;
    if (want_lp && rmax > -INFINITY)
        for (int i = 0; i < V; i++) rsum += expf(logits[i] - rmax);
    double rlse = want_lp && rmax > -INFINITY ? (double)rmax + log(rsum) : 0.0;
    if (p->top_logprobs > 0) {
        out->n_top = top_k_ids(logits, V, p->top_logprobs, out->top_ids);
        for (int i = 0; i < out->n_top; i++) out->top_logprobs[i] = (float)((double)logits[out->top_ids[i]] - rlse);
    }

    const int greedy = is_greedy(p), plain = is_plain(p);
    /* greedy without bias or penalties reads the logits as they are (no copy) */
    if (!(greedy && plain)) process(s, logits, history, n_prompt, n_hist, w);
    const float *wv = greedy && plain ? logits : w;

    int32_t tok = -1;
    if (greedy) {
        /* 4. greedy (top_k = 1 is the same thing): the first maximum, NaN skipped; the rule of
         * backend.h argmax_rows, which serves these requests on a device (kvs_sampler_is_argmax) */
        tok = kvs_argmax_row(wv, V);
        if (tok < 0) return -EINVAL;
    } else {
        /* 5. temperature + softmax (unnormalised exp, mass in double) */
        float inv_t = 1.0f / p->temperature, mx = -INFINITY;
        for (int i = 0; i < V; i++) {
            w[i] = isnan(w[i]) ? -INFINITY : w[i] * inv_t;
            if (w[i] > mx) mx = w[i];
        }
        if (mx == -INFINITY) return -EINVAL;
        /* min_p first, as vLLM does: relative to the top token, whose weight here is exp(0) = 1 */
        double z = 0.0;
        for (int i = 0; i < V; i++) {
            w[i] = expf(w[i] - mx);
            if (w[i] < p->min_p) w[i] = 0.0f;
            z += w[i];
        }
        /* 6. candidates */
        int n = 0, sorted = 0;
        double mass = z;
        if (p->top_k > 0 && p->top_k < V) {
            n = top_k_ids(w, V, p->top_k, idx);
            while (n > 0 && w[idx[n - 1]] <= 0.0f) n--;   /* sorted: zero weights at the end */
            sorted = 1;
            mass = 0.0;
            for (int i = 0; i < n; i++) mass += w[idx[i]];
        } else if (p->top_p < 1.0f) {
            /* tokens under this cut cannot reach the nucleus: together they hold < 1 - top_p */
            double cut = (1.0 - (double)p->top_p) / (V > 1 ? V - 1 : 1) * z;
            for (int32_t i = 0; i < V; i++)
                if (w[i] > 0.0f && (double)w[i] >= cut) idx[n++] = i;
            n = nucleus(w, idx, n, (double)p->top_p * z);
        } else {
            for (int32_t i = 0; i < V; i++)
                if (w[i] > 0.0f) idx[n++] = i;
        }
        if (sorted && p->top_p < 1.0f) {
            double cum = 0.0, target = (double)p->top_p * mass;
            int keep = n;
            for (int i = 0; i < n; i++) {
                cum += w[idx[i]];
                if (cum >= target) {
                    keep = i + 1;
                    break;
                }
            }
            n = keep;
        }
        if (n == 0) return -EINVAL;
        /* 7. draw */
        double total = 0.0;
        for (int i = 0; i < n; i++) total += w[idx[i]];
        double u = kvs_sampler_uniform(s) * total, cum = 0.0;
        tok = idx[n - 1];
        for (int i = 0; i < n; i++) {
            cum += w[idx[i]];
            if (u < cum) {
                tok = idx[i];
                break;
            }
        }
    }
    out->token = tok;
    out->logprob = !want_lp ? 0.0f : rmax > -INFINITY ? (float)((double)logits[tok] - rlse) : -INFINITY;
    return 0;
}
