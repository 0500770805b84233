/* test_lazy_engine.c: kv.reuse=lazy end to end (engine + scheduler + runner + doc cache) on the
 * tiny test models, greedy, against an independent reference written here: a naive dense
 * forward pass in double precision straight from the safetensors weights (no paging, no
 * deferred rotation), with explicit position ids and an explicit Block-Attention mask:
 *   document d, token j:  position start_d + j (padded coordinates, doc_cache.h), attends to
 *                         tokens 0..j of document d only;
 *   prompt / generated:   position doc_slots + i, attend to every document token and to the
 *                         prompt / generated tokens before them.
 * Checked:
 *   - cold cache (every document computed), warm cache (every document a hit), documents
 *     reused at other offsets and in other orders, all equal to the reference;
 *   - one document whose length is a multiple of the block size, with no cache, equals the
 *     ordinary path (the same tokens as plain prompt text, kv.reuse=none);
 *   - two requests citing the same missing documents, submitted together: each document is
 *     computed once (prefill tokens computed = document lengths), both outputs correct;
 *   - a tiny byte budget (documents evicted between requests) still gives the reference output;
 *   - the position-aware baseline mode gives the same output with fewer hits;
 *   - usage: prompt tokens count real tokens, cached tokens count the hit documents;
 *   - bad input: an empty document, a document token outside the vocabulary.
 * Models: llama (plain RoPE, GQA) and llama31 (llama3 RoPE scaling). */
#include "engine/config.h"
#include "engine/engine.h"
#include "base/util.h"
#include "models/model.h"
#include "tests/unit/test_util.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#define GEN 8
#define BS 16
#define MAXT 512

static uint64_t rng = 0x1234567887654321ULL;
static uint32_t rnd(void) { return kvs_test_xorshift(&rng); }

/* ---- the reference model ---------------------------------------------------------------- */
struct ref_layer {
    float *attn_norm, *wq, *wk, *wv, *wo, *bq, *bk, *bv, *q_norm, *k_norm, *mlp_norm, *wg, *wu, *wd;
};
struct ref_model {
    struct kvs_model_config c;
    float *embed, *lm_head, *norm;
    struct ref_layer *L;
    float inv[512];
};

static float *get(const struct kvs_model *m, const char *name, int optional)
{
    struct kvs_tensor_view t;
    char err[256];
    if (kvs_model_tensor(m, name, &t, err, sizeof err) != 0) {
        REQUIRE(optional, "%s", err);
        return NULL;
    }
    size_t n = 1;
    for (int i = 0; i < t.ndim; i++) n *= (size_t)t.shape[i];
    float *f = malloc(n * sizeof *f);
    kvs_tensor_to_f32(&t, f, 0, n);
    return f;
}

static void ref_load(struct ref_model *r, const struct kvs_model *m)
{
    r->c = *kvs_model_config(m);
    r->embed = get(m, "model.embed_tokens.weight", 0);
    r->norm = get(m, "model.norm.weight", 0);
    r->lm_head = r->c.tie_word_embeddings ? r->embed : get(m, "lm_head.weight", 0);
    r->L = calloc((size_t)r->c.n_layers, sizeof *r->L);
    char n[256];
    for (int l = 0; l < r->c.n_layers; l++) {
        struct ref_layer *L = &r->L[l];
#define G(field, suffix, opt)                                   \
    snprintf(n, sizeof n, "model.layers.%d.%s", l, suffix);   \
    L->field = get(m, n, opt)
        G(attn_norm, "input_layernorm.weight", 0);
        G(wq, "self_attn.q_proj.weight", 0);
        G(wk, "self_attn.k_proj.weight", 0);
        G(wv, "self_attn.v_proj.weight", 0);
        G(wo, "self_attn.o_proj.weight", 0);
        G(bq, "self_attn.q_proj.bias", 1);
        G(bk, "self_attn.k_proj.bias", 1);
        G(bv, "self_attn.v_proj.bias", 1);
        G(q_norm, "self_attn.q_norm.weight", 1);
        G(k_norm, "self_attn.k_norm.weight", 1);
        G(mlp_norm, "post_attention_layernorm.weight", 0);
        G(wg, "mlp.gate_proj.weight", 0);
        G(wu, "mlp.up_proj.weight", 0);
        G(wd, "mlp.down_proj.weight", 0);
#undef G
    }
    kvs_rope_inv_freq(&r->c, r->inv);
}

static void ref_free(struct ref_model *r)
{
    for (int l = 0; l < r->c.n_layers; l++) {
        struct ref_layer *L = &r->L[l];
        float *ws[] = {L->attn_norm, L->wq, L->wk, L->wv, L->wo, L->bq, L->bk, L->bv, L->q_norm, L->k_norm,
                       L->mlp_norm, L->wg, L->wu, L->wd};
        for (size_t i = 0; i < sizeof ws / sizeof ws[0]; i++) free(ws[i]);
    }
    free(r->L);
    if (r->lm_head != r->embed) free(r->lm_head);
    free(r->embed);
    free(r->norm);
}

static void rmsnorm(const double *x, const float *w, int n, double eps, double *out)
{
    double ss = 0;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    double s = 1.0 / sqrt(ss / n + eps);
    for (int i = 0; i < n; i++) out[i] = x[i] * s * w[i];
}

static void linear(const double *x, const float *w, const float *b, int in, int out, double *y)
{
    for (int o = 0; o < out; o++) {
        double s = b ? b[o] : 0;
        for (int i = 0; i < in; i++) s += x[i] * w[(size_t)o * in + i];
        y[o] = s;
    }
}

static void rope(double *x, int pos, const float *inv, int hd)
{
    for (int i = 0; i < hd / 2; i++) {
        float a = (float)pos * inv[i];   /* the angle as transformers computes it (fp32) */
        double c = cos((double)a), s = sin((double)a);
        double x1 = x[i], x2 = x[i + hd / 2];
        x[i] = x1 * c - x2 * s;
        x[i + hd / 2] = x2 * c + x1 * s;
    }
}

/* seg[t]: document index of token t, or -1 for prompt/generated tokens. Returns the argmax
 * of the last token's logits. */
static int ref_forward(const struct ref_model *r, const int32_t *tok, const int *pos, const int *seg, int T)
{
    const struct kvs_model_config *c = &r->c;
    int D = c->hidden_size, nh = c->n_heads, nkv = c->n_kv_heads, hd = c->head_dim, F = c->intermediate_size;
    int G = nh / nkv;
    double *x = calloc((size_t)T * D, sizeof *x), *xn = malloc((size_t)D * sizeof *xn);
    double *q = malloc((size_t)T * nh * hd * sizeof *q), *k = malloc((size_t)T * nkv * hd * sizeof *k);
    double *v = malloc((size_t)T * nkv * hd * sizeof *v), *att = malloc((size_t)nh * hd * sizeof *att);
    double *o = malloc((size_t)D * sizeof *o), *g = malloc((size_t)F * sizeof *g), *u = malloc((size_t)F * sizeof *u);
    double *sc = malloc((size_t)T * sizeof *sc);
    for (int t = 0; t < T; t++)
        for (int i = 0; i < D; i++) x[(size_t)t * D + i] = r->embed[(size_t)tok[t] * D + i];
    for (int l = 0; l < c->n_layers; l++) {
        const struct ref_layer *L = &r->L[l];
        for (int t = 0; t < T; t++) {
            rmsnorm(x + (size_t)t * D, L->attn_norm, D, c->rms_norm_eps, xn);
            double *qt = q + (size_t)t * nh * hd, *kt = k + (size_t)t * nkv * hd;
            linear(xn, L->wq, L->bq, D, nh * hd, qt);
            linear(xn, L->wk, L->bk, D, nkv * hd, kt);
            linear(xn, L->wv, L->bv, D, nkv * hd, v + (size_t)t * nkv * hd);
            double tmp[1024];
            for (int h = 0; h < nh; h++) {
                if (L->q_norm) {
                    rmsnorm(qt + h * hd, L->q_norm, hd, c->rms_norm_eps, tmp);
                    memcpy(qt + h * hd, tmp, (size_t)hd * sizeof *tmp);
                }
                rope(qt + h * hd, pos[t], r->inv, hd);
            }
            for (int h = 0; h < nkv; h++) {
                if (L->k_norm) {
                    rmsnorm(kt + h * hd, L->k_norm, hd, c->rms_norm_eps, tmp);
                    memcpy(kt + h * hd, tmp, (size_t)hd * sizeof *tmp);
                }
                rope(kt + h * hd, pos[t], r->inv, hd);
            }
        }
        for (int t = 0; t < T; t++) {
            for (int h = 0; h < nh; h++) {
                int kh = h / G;
                double mx = -INFINITY;
                for (int s = 0; s <= t; s++) {
                    int allowed = seg[t] < 0 || seg[s] == seg[t];   /* Block-Attention mask */
                    sc[s] = -INFINITY;
                    if (!allowed) continue;
                    double d = 0;
                    for (int i = 0; i < hd; i++) d += q[((size_t)t * nh + h) * hd + i] * k[((size_t)s * nkv + kh) * hd + i];
                    sc[s] = d / sqrt((double)hd);
                    if (sc[s] > mx) mx = sc[s];
                }
                double z = 0;
                for (int i = 0; i < hd; i++) att[h * hd + i] = 0;
                for (int s = 0; s <= t; s++) {
                    if (sc[s] == -INFINITY) continue;
                    double w = exp(sc[s] - mx);
                    z += w;
                    for (int i = 0; i < hd; i++) att[h * hd + i] += w * v[((size_t)s * nkv + kh) * hd + i];
                }
                for (int i = 0; i < hd; i++) att[h * hd + i] /= z;
            }
            linear(att, L->wo, NULL, nh * hd, D, o);
            double *xt = x + (size_t)t * D;
            for (int i = 0; i < D; i++) xt[i] += o[i];
        }
        for (int t = 0; t < T; t++) {
            double *xt = x + (size_t)t * D;
            rmsnorm(xt, L->mlp_norm, D, c->rms_norm_eps, xn);
            linear(xn, L->wg, NULL, D, F, g);
            linear(xn, L->wu, NULL, D, F, u);
            for (int i = 0; i < F; i++) g[i] = g[i] / (1 + exp(-g[i])) * u[i];
            linear(g, L->wd, NULL, F, D, o);
            for (int i = 0; i < D; i++) xt[i] += o[i];
        }
    }
    rmsnorm(x + (size_t)(T - 1) * D, r->norm, D, c->rms_norm_eps, xn);
    int best = 0;
    double bv = -INFINITY;
    for (int w = 0; w < c->vocab_size; w++) {
        double s = 0;
        for (int i = 0; i < D; i++) s += xn[i] * r->lm_head[(size_t)w * D + i];
        if (s > bv) bv = s, best = w;
    }
    free(x), free(xn), free(q), free(k), free(v), free(att), free(o), free(g), free(u), free(sc);
    return best;
}

/* ---- requests ---------------------------------------------------------------------------- */
#define MAXD 6
struct rag {
    int n_docs;
    const int32_t *doc[MAXD];
    int len[MAXD];
    int32_t prompt[32];
    int n_prompt;
    int32_t want[GEN], got[GEN];
    int n_got, n_cached, n_prompt_tokens;
    enum kvs_finish finish;
    struct kvs_request *r;
};

static void reference(const struct ref_model *m, struct rag *q)
{
    int32_t tok[MAXT];
    int pos[MAXT], seg[MAXT], T = 0, slot = 0;
    for (int d = 0; d < q->n_docs; d++) {
        for (int j = 0; j < q->len[d]; j++) tok[T] = q->doc[d][j], pos[T] = slot + j, seg[T++] = d;
        slot += (q->len[d] + BS - 1) / BS * BS;
    }
    for (int i = 0; i < q->n_prompt; i++) tok[T] = q->prompt[i], pos[T] = slot++, seg[T++] = -1;
    for (int g = 0; g < GEN; g++) {
        REQUIRE(T < MAXT, "reference too long");
        int nx = ref_forward(m, tok, pos, seg, T);
        q->want[g] = nx;
        tok[T] = nx, pos[T] = slot++, seg[T++] = -1;
    }
}

static void submit(struct kvs_engine *e, struct rag *q, int as_docs)
{
    struct kvs_request_params p;
    memset(&p, 0, sizeof p);
    struct kvs_doc_segment segs[MAXD];
    int32_t flat[MAXT];
    if (as_docs) {
        for (int d = 0; d < q->n_docs; d++) segs[d] = (struct kvs_doc_segment){(uint64_t)d, q->doc[d], q->len[d]};
        p.docs = segs;
        p.n_docs = q->n_docs;
        p.prompt = q->prompt;
        p.n_prompt = q->n_prompt;
    } else {
        int n = 0;
        for (int d = 0; d < q->n_docs; d++)
            for (int j = 0; j < q->len[d]; j++) flat[n++] = q->doc[d][j];
        for (int i = 0; i < q->n_prompt; i++) flat[n++] = q->prompt[i];
        p.prompt = flat;
        p.n_prompt = n;
    }
    p.max_tokens = GEN;
    p.sampling.top_p = 1;
    p.sampling.repetition_penalty = 1;
    p.ignore_eos = 1;
    p.skip_special = 1;
    q->r = kvs_request_new(&p, NULL, NULL);
    REQUIRE(q->r, "request_new");
    char err[256];
    int rc = kvs_engine_submit(e, q->r, err, sizeof err);
    REQUIRE(rc == 0, "submit: %s", err);
    q->n_got = 0;
    q->finish = KVS_FINISH_NONE;
}

static void collect(struct rag *q)
{
    struct kvs_event ev[16];
    while (q->finish == KVS_FINISH_NONE) {
        int k = kvs_request_wait(q->r, ev, 16, 60.0);
        REQUIRE(k > 0, "no event for 60 s");
        for (int i = 0; i < k; i++) {
            if (ev[i].type == KVS_EV_TOKEN) {
                REQUIRE(q->n_got < GEN, "too many tokens");
                q->got[q->n_got++] = ev[i].token;
            } else {
                if (ev[i].type == KVS_EV_ERROR) fprintf(stderr, "error: %s\n", ev[i].error);
                q->finish = ev[i].finish;
                q->n_cached = ev[i].n_cached_tokens;
                q->n_prompt_tokens = ev[i].n_prompt_tokens;
            }
            kvs_event_clear(&ev[i]);
        }
    }
    kvs_request_unref(q->r);
    q->r = NULL;
}

static void expect(const char *what, const struct rag *q, const int32_t *want)
{
    int ok = q->finish == KVS_FINISH_LENGTH && q->n_got == GEN && !memcmp(q->got, want, sizeof q->got);
    if (!ok) {
        fprintf(stderr, "%s: finish %d, %d tokens\n", what, q->finish, q->n_got);
        for (int t = 0; t < GEN; t++) fprintf(stderr, "  %d: got %d want %d\n", t, q->got[t], want[t]);
        exit(1);
    }
}

static void base_cfg(struct kvs_config *c, const char *reuse)
{
    kvs_config_init(c);
    free(c->device);
    c->device = kvs_xstrdup("cpu");
    free(c->kv_reuse);
    c->kv_reuse = kvs_xstrdup(reuse);
    c->cpu_threads = 2;
    c->kv_block_size = BS;
    c->kv_memory_bytes = 4 << 20;
    c->max_batch_tokens = 64;   /* documents and prompts are prefilled in several chunks */
    c->max_running = 8;
    c->max_waiting = 64;
    c->max_model_len = 512;
}

static struct kvs_engine *make_engine(const struct kvs_config *c, const struct kvs_model *m)
{
    struct kvs_engine *e;
    char err[256];
    int rc = kvs_engine_create(c, m, NULL, &e, err, sizeof err);
    REQUIRE(rc == 0, "%s", err);
    return e;
}

static void finish_engine(struct kvs_engine *e, struct kvs_engine_stats *st)
{
    kvs_engine_stats(e, st);
    REQUIRE(st->kv_blocks_used == 0, "blocks still used: %d", st->kv_blocks_used);
    kvs_engine_free(e);
}

static void test_model(const char *name)
{
    char dir[1024], err[256];
    snprintf(dir, sizeof dir, "%s/tests/data/models/%s", kvs_test_root(), name);
    struct kvs_model *m;
    REQUIRE(kvs_model_load(dir, &m, err, sizeof err) == 0, "%s", err);
    struct ref_model ref;
    ref_load(&ref, m);

    /* a corpus of documents with awkward lengths */
    enum { ND = 5 };
    static int32_t corpus[ND][80];
    int clen[ND] = {23, 16, 1, 40, 17};
    for (int d = 0; d < ND; d++)
        for (int j = 0; j < clen[d]; j++) corpus[d][j] = (int32_t)(rnd() % 1000);
    /* requests: document lists (orders and offsets differ) + a question */
    static const int lists[][4] = {{0, 1, 2, -1}, {3, 0, -1, -1}, {2, 4, 0, 1}, {1, -1, -1, -1}, {4, 3, -1, -1}};
    enum { NQ = 5 };
    static struct rag q[NQ];
    for (int i = 0; i < NQ; i++) {
        memset(&q[i], 0, sizeof q[i]);
        for (int k = 0; k < 4 && lists[i][k] >= 0; k++) {
            q[i].doc[q[i].n_docs] = corpus[lists[i][k]];
            q[i].len[q[i].n_docs++] = clen[lists[i][k]];
        }
        q[i].n_prompt = 3 + (int)(rnd() % 8);
        for (int t = 0; t < q[i].n_prompt; t++) q[i].prompt[t] = (int32_t)(rnd() % 1000);
        reference(&ref, &q[i]);
    }

    struct kvs_config c;
    struct kvs_engine_stats st;
    /* cold then warm, one request at a time */
    base_cfg(&c, "lazy");
    struct kvs_engine *e = make_engine(&c, m);
    int doc_tokens_total = 0;
    for (int round = 0; round < 2; round++)
        for (int i = 0; i < NQ; i++) {
            submit(e, &q[i], 1);
            collect(&q[i]);
            char what[64];
            snprintf(what, sizeof what, "%s round %d request %d", name, round, i);
            expect(what, &q[i], q[i].want);
            int real = q[i].n_prompt;
            for (int d = 0; d < q[i].n_docs; d++) real += q[i].len[d];
            REQUIRE(q[i].n_prompt_tokens == real, "usage counts real tokens: %d vs %d", q[i].n_prompt_tokens, real);
            if (round == 1) REQUIRE(q[i].n_cached == real - q[i].n_prompt, "warm: every document cached");
            if (round == 0) doc_tokens_total += real - q[i].n_prompt;
        }
    finish_engine(e, &st);
    int uniq = 0;
    for (int d = 0; d < ND; d++) uniq += clen[d];
    REQUIRE((uint64_t)kvs_engine_kv_counter(&st, "kvserve:doc_cache_prefill_tokens_total") == (uint64_t)uniq, "each document computed once: %llu vs %d",
          (unsigned long long)kvs_engine_kv_counter(&st, "kvserve:doc_cache_prefill_tokens_total"), uniq);
    int lookups = 0;
    for (int i = 0; i < NQ; i++) lookups += q[i].n_docs;
    REQUIRE((uint64_t)kvs_engine_kv_counter(&st, "kvserve:doc_cache_misses_total") == ND && (uint64_t)kvs_engine_kv_counter(&st, "kvserve:doc_cache_hits_total") == (uint64_t)(2 * lookups - ND), "hits %llu misses %llu", (unsigned long long)kvs_engine_kv_counter(&st, "kvserve:doc_cache_hits_total"),
          (unsigned long long)kvs_engine_kv_counter(&st, "kvserve:doc_cache_misses_total"));
    REQUIRE((uint64_t)kvs_engine_kv_counter(&st, "kvserve:doc_cache_prefill_tokens_saved_total") == (uint64_t)(2 * doc_tokens_total - uniq), "tokens saved");
    REQUIRE(kvs_engine_kv_counter(&st, "kvserve:doc_cache_documents") == ND && (uint64_t)kvs_engine_kv_counter(&st, "kvserve:doc_cache_bytes") > 0 && kvs_engine_kv_counter(&st, "kvserve:doc_cache_hit_ratio") > 0.6, "gauges");
    printf("%s: cold + warm cache, documents at other offsets/orders == Block-Attention reference; "
           "each document computed once (%d tokens), hit ratio %.2f: ok\n",
           name, uniq, kvs_engine_kv_counter(&st, "kvserve:doc_cache_hit_ratio"));

    /* concurrency: all five at once; documents shared by several requests are computed once */
    e = make_engine(&c, m);
    for (int i = 0; i < NQ; i++) submit(e, &q[i], 1);
    for (int i = 0; i < NQ; i++) {
        collect(&q[i]);
        expect("concurrent", &q[i], q[i].want);
    }
    finish_engine(e, &st);
    REQUIRE((uint64_t)kvs_engine_kv_counter(&st, "kvserve:doc_cache_prefill_tokens_total") == (uint64_t)uniq, "concurrent: computed once: %llu vs %d",
          (unsigned long long)kvs_engine_kv_counter(&st, "kvserve:doc_cache_prefill_tokens_total"), uniq);
    REQUIRE((uint64_t)kvs_engine_kv_counter(&st, "kvserve:doc_cache_misses_total") == ND, "concurrent: %llu misses", (unsigned long long)kvs_engine_kv_counter(&st, "kvserve:doc_cache_misses_total"));
    printf("%s: 5 concurrent requests sharing missing documents: each computed once: ok\n", name);

    /* tight KV pools (10..14 blocks of 16): requests wait for blocks, get preempted and
     * recomputed, documents are evicted under pool pressure while others are in use */
    for (int nb = 10; nb <= 14; nb += 2) {
        c.kv_memory_bytes = nb * 8192;
        e = make_engine(&c, m);
        for (int i = 0; i < NQ; i++) submit(e, &q[i], 1);
        for (int i = 0; i < NQ; i++) {
            collect(&q[i]);
            expect("tight pool", &q[i], q[i].want);
        }
        finish_engine(e, &st);
        printf("%s: tight pool (%d blocks, %llu preemptions, %llu document evictions): reference output: ok\n", name,
               nb, (unsigned long long)st.num_preemptions, (unsigned long long)kvs_engine_kv_counter(&st, "kvserve:doc_cache_evictions_total"));
    }
    c.kv_memory_bytes = 4 << 20;

    /* a tiny budget: about one document's worth, so documents are evicted between requests */
    c.lazy_budget_bytes = 3 * 8192;   /* three blocks of the tiny models (512 KV bytes a token) */
    e = make_engine(&c, m);
    for (int round = 0; round < 2; round++)
        for (int i = 0; i < NQ; i++) {
            submit(e, &q[i], 1);
            collect(&q[i]);
            expect("tiny budget", &q[i], q[i].want);
        }
    finish_engine(e, &st);
    REQUIRE((uint64_t)kvs_engine_kv_counter(&st, "kvserve:doc_cache_evictions_total") > 0 && (uint64_t)kvs_engine_kv_counter(&st, "kvserve:doc_cache_prefill_tokens_total") > (uint64_t)uniq, "evictions under the budget");
    printf("%s: tiny budget (%llu evictions): reference output: ok\n", name, (unsigned long long)kvs_engine_kv_counter(&st, "kvserve:doc_cache_evictions_total"));
    c.lazy_budget_bytes = 0;

    /* the position-aware baseline: same output, a replica per offset (fewer hits) */
    c.lazy_position_aware = 1;
    e = make_engine(&c, m);
    for (int round = 0; round < 2; round++)
        for (int i = 0; i < NQ; i++) {
            submit(e, &q[i], 1);
            collect(&q[i]);
            expect("position-aware", &q[i], q[i].want);
        }
    finish_engine(e, &st);
    /* distinct (document, offset) pairs are the misses */
    int pairs = 0, seen_doc[64], seen_off[64];
    for (int i = 0; i < NQ; i++) {
        int off = 0;
        for (int d = 0; d < q[i].n_docs; d++) {
            int k = 0;
            while (k < pairs && !(seen_doc[k] == (int)(q[i].doc[d] - corpus[0]) && seen_off[k] == off)) k++;
            if (k == pairs) seen_doc[pairs] = (int)(q[i].doc[d] - corpus[0]), seen_off[pairs++] = off;
            off += (q[i].len[d] + BS - 1) / BS * BS;
        }
    }
    REQUIRE((uint64_t)kvs_engine_kv_counter(&st, "kvserve:doc_cache_misses_total") == (uint64_t)pairs && (uint64_t)kvs_engine_kv_counter(&st, "kvserve:doc_cache_hits_total") == (uint64_t)(2 * lookups - pairs),
          "position-aware: %llu hits / %llu misses, want %d misses", (unsigned long long)kvs_engine_kv_counter(&st, "kvserve:doc_cache_hits_total"),
          (unsigned long long)kvs_engine_kv_counter(&st, "kvserve:doc_cache_misses_total"), pairs);
    REQUIRE(pairs > ND, "the workload reuses documents at new offsets");
    c.lazy_position_aware = 0;
    printf("%s: position-aware baseline: same output, %llu hits / %llu misses: ok\n", name,
           (unsigned long long)kvs_engine_kv_counter(&st, "kvserve:doc_cache_hits_total"), (unsigned long long)kvs_engine_kv_counter(&st, "kvserve:doc_cache_misses_total"));

    /* one document of a whole number of blocks, no cache == the ordinary path */
    struct rag one;
    memset(&one, 0, sizeof one);
    static int32_t d32[32];
    for (int j = 0; j < 32; j++) d32[j] = (int32_t)(rnd() % 1000);
    one.n_docs = 1;
    one.doc[0] = d32;
    one.len[0] = 32;
    one.n_prompt = 5;
    for (int t = 0; t < 5; t++) one.prompt[t] = (int32_t)(rnd() % 1000);
    struct kvs_config cn;
    base_cfg(&cn, "none");
    e = make_engine(&cn, m);
    submit(e, &one, 1);   /* documents without lazy are plain prompt text */
    collect(&one);
    int32_t plain[GEN];
    memcpy(plain, one.got, sizeof plain);
    REQUIRE(one.finish == KVS_FINISH_LENGTH && one.n_prompt_tokens == 37 && one.n_cached == 0, "ordinary path");
    finish_engine(e, &st);
    e = make_engine(&c, m);
    submit(e, &one, 1);
    collect(&one);
    expect("one document, lazy, cold", &one, plain);
    finish_engine(e, &st);
    printf("%s: one document (32 tokens) through the doc cache == ordinary path: ok\n", name);

    /* bad input */
    e = make_engine(&c, m);
    struct kvs_request_params p;
    memset(&p, 0, sizeof p);
    int32_t bad[2] = {5, 99999}, pr[1] = {3};
    struct kvs_doc_segment s1 = {1, bad, 2}, s0 = {2, bad, 0};
    p.prompt = pr;
    p.n_prompt = 1;
    p.max_tokens = 2;
    p.docs = &s1;
    p.n_docs = 1;
    struct kvs_request *r = kvs_request_new(&p, NULL, NULL);
    REQUIRE(kvs_engine_submit(e, r, err, sizeof err) == -EINVAL && strstr(err, "vocabulary"), "bad token: %s", err);
    kvs_request_unref(r);
    p.docs = &s0;
    r = kvs_request_new(&p, NULL, NULL);
    REQUIRE(kvs_engine_submit(e, r, err, sizeof err) == -EINVAL && strstr(err, "empty"), "empty doc: %s", err);
    kvs_request_unref(r);
    finish_engine(e, &st);
    printf("%s: bad documents refused with -EINVAL: ok\n", name);

    ref_free(&ref);
    kvs_model_free(m);
    kvs_config_free(&c);
    kvs_config_free(&cn);
}

int main(void)
{
    kvs_log_set_level(KVS_LOG_WARN);
    test_model("llama");
    test_model("llama31");
    return 0;
}
