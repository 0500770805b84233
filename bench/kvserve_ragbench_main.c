/* kvserve_ragbench_main.c: kvserve-ragbench: a RAG workload against the engine (no HTTP), to
 * compare KV reuse strategies on the same request trace and print a markdown table.
 *
 * Workload: a corpus of --corpus documents with random token ids and lengths uniform in
 * --doc-len MIN:MAX; each request cites K documents (K uniform in --docs MIN:MAX, distinct,
 * drawn by Zipf rank with exponent alpha: P(rank i) ~ i^-alpha) followed by a random question
 * (--question-len MIN:MAX tokens); Poisson arrivals at --rate per second; outputs of
 * --output-len tokens (ignore_eos). The trace depends only on --seed and alpha, so every mode and
 * budget sees the same requests.
 *
 * Modes (one engine each, same model, fresh cache):
 *   lazy      kv.reuse=lazy: documents as doc segments, position-agnostic doc cache;
 *   posaware  kv.reuse=lazy with kv.lazy.position_aware: one replica per (document, offset),
 *             the Block-Attention/TurboRAG-style baseline (same outputs, fewer hits);
 *   prefix    kv.reuse=prefix: documents as plain prompt text, automatic prefix caching;
 *   none      kv.reuse=none.
 * Budgets: --budgets B1,B2,... KV pool sizes in MiB (kv.memory_bytes), tight to ample; the
 * doc cache may use the whole pool (kv.lazy.budget_bytes 0).
 * Reported per (alpha, budget, mode): document hit ratio (doc caches), share of prompt tokens
 * served from a cache, TTFT p50/p99, output tokens/s over the run, requests done/refused.
 *
 *   build/kvserve-ragbench --model tests/data/models/llama --set device=cpu --corpus 40 \
 *       --doc-len 16:64 --docs 3:6 --question-len 8:16 --output-len 8 --num 48 --rate 20 \
 *       --alpha 1.1,2.1 --budgets 1,4
 */
#include "base/rng.h"
#include "engine/config.h"
#include "engine/engine.h"
#include "base/util.h"
#include "models/model.h"

#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MAX_LIST 16
#define MAX_DOCS_PER_REQ 64

struct rjob {
    int n_docs;
    int doc[MAX_DOCS_PER_REQ];
    int32_t *question;
    int n_question;
    double t_arrival;
    struct kvs_request *r;
    atomic_int done;
    int refused;
    int n_gen, n_cached, n_prompt;
    double ttft;
    double t_done;
};

static uint64_t g_rng;
static uint64_t rnd64(void)
{
    return kvs_splitmix64(&g_rng);
}
static double urand(void) { return (double)(rnd64() >> 11) / 9007199254740992.0; }
static int irange(int lo, int hi) { return lo + (int)(rnd64() % (uint64_t)(hi - lo + 1)); }

static void on_events(void *user)
{
    struct rjob *j = user;
    struct kvs_event ev[32];
    int n;
    while ((n = kvs_request_poll(j->r, ev, 32)) > 0) {
        for (int i = 0; i < n; i++) {
            if (ev[i].type != KVS_EV_TOKEN) {
                j->n_gen = ev[i].n_completion_tokens;
                j->n_cached = ev[i].n_cached_tokens;
                j->n_prompt = ev[i].n_prompt_tokens;
                j->ttft = ev[i].ttft_s;
                j->t_done = kvs_now();
                if (ev[i].type == KVS_EV_ERROR) fprintf(stderr, "request error: %s\n", ev[i].error);
                atomic_store(&j->done, 1);
            }
            kvs_event_clear(&ev[i]);
        }
    }
}

static int parse_range(const char *s, int *lo, int *hi)
{
    char *end;
    long a = strtol(s, &end, 10), b = a;
    if (*end == ':') b = strtol(end + 1, &end, 10);
    if (*end || a < 1 || b < a || b > 1000000) return -1;
    *lo = (int)a;
    *hi = (int)b;
    return 0;
}

static int parse_list(const char *s, double *out, int max)
{
    int n = 0;
    while (*s && n < max) {
        char *end;
        double v = strtod(s, &end);
        if (end == s || !(v > 0)) return -1;
        out[n++] = v;
        s = *end == ',' ? end + 1 : end;
        if (*end && *end != ',') return -1;
    }
    return n;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double pct(const double *sorted, int n, double p)
{
    if (n == 0) return 0;
    int i = (int)ceil(p / 100.0 * n) - 1;
    if (i < 0) i = 0;
    if (i >= n) i = n - 1;
    return sorted[i];
}

static void usage(void)
{
    fprintf(stderr,
            "usage: kvserve-ragbench --model DIR [--set key=value ...] [--corpus N] [--doc-len MIN:MAX]\n"
            "       [--docs MIN:MAX] [--question-len MIN:MAX] [--output-len N] [--num N] [--rate R]\n"
            "       [--alpha A1,A2,...] [--budgets MiB1,MiB2,...] [--modes lazy,posaware,prefix,none] [--seed S]\n");
}

int main(int argc, char **argv)
{
    const char *model_dir = NULL, *modes_arg = "lazy,posaware,prefix,none";
    int corpus = 200, dlo = 512, dhi = 4096, klo = 5, khi = 20, qlo = 16, qhi = 64, n_out = 32, num = 64;
    double rate = 1.0, alphas[MAX_LIST] = {1.1, 1.5, 2.1}, budgets[MAX_LIST] = {1024, 4096, 16384};
    int n_alpha = 3, n_budget = 3;
    uint64_t seed = 1;
    struct kvs_config cfg;
    kvs_config_init(&cfg);
    char err[512];
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int bad = 0;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage();
            return 0;
        }
        if (!v) bad = 1;
        else if (!strcmp(a, "--model")) model_dir = v;
        else if (!strcmp(a, "--set")) {
            if (kvs_config_set(&cfg, v, err, sizeof err) < 0) {
                fprintf(stderr, "kvserve-ragbench: %s\n", err);
                return 2;
            }
        } else if (!strcmp(a, "--corpus")) bad = (corpus = atoi(v)) < 1;
        else if (!strcmp(a, "--doc-len")) bad = parse_range(v, &dlo, &dhi);
        else if (!strcmp(a, "--docs")) bad = parse_range(v, &klo, &khi) || khi > MAX_DOCS_PER_REQ;
        else if (!strcmp(a, "--question-len")) bad = parse_range(v, &qlo, &qhi);
        else if (!strcmp(a, "--output-len")) bad = (n_out = atoi(v)) < 1;
        else if (!strcmp(a, "--num")) bad = (num = atoi(v)) < 1;
        else if (!strcmp(a, "--rate")) bad = !((rate = atof(v)) >= 0);
        else if (!strcmp(a, "--alpha")) bad = (n_alpha = parse_list(v, alphas, MAX_LIST)) < 1;
        else if (!strcmp(a, "--budgets")) bad = (n_budget = parse_list(v, budgets, MAX_LIST)) < 1;
        else if (!strcmp(a, "--modes")) modes_arg = v;
        else if (!strcmp(a, "--seed")) seed = strtoull(v, NULL, 10);
        else bad = 1;
        if (bad) {
            fprintf(stderr, "kvserve-ragbench: bad argument %s %s\n", a, v ? v : "");
            usage();
            return 2;
        }
        i++;
    }
    if (!model_dir) {
        usage();
        return 2;
    }
    if (khi > corpus) {
        fprintf(stderr, "kvserve-ragbench: --docs max %d exceeds --corpus %d\n", khi, corpus);
        return 2;
    }
    kvs_log_set_level(KVS_LOG_WARN);
    struct kvs_model *model;
    if (kvs_model_load(model_dir, &model, err, sizeof err) < 0) {
        fprintf(stderr, "kvserve-ragbench: %s\n", err);
        return 1;
    }
    int vocab = kvs_model_config(model)->vocab_size;

    /* the corpus */
    g_rng = seed;
    int32_t **doc = kvs_xcalloc((size_t)corpus, sizeof *doc);
    int *dlen = kvs_xcalloc((size_t)corpus, sizeof *dlen);
    for (int d = 0; d < corpus; d++) {
        dlen[d] = irange(dlo, dhi);
        doc[d] = kvs_xmalloc((size_t)dlen[d] * sizeof **doc);
        for (int i = 0; i < dlen[d]; i++) doc[d][i] = (int32_t)(rnd64() % (uint64_t)vocab);
    }
    struct rjob *jobs = kvs_xcalloc((size_t)num, sizeof *jobs);
    double *cdf = kvs_xmalloc((size_t)corpus * sizeof *cdf);
    double *ttft = kvs_xmalloc((size_t)num * sizeof *ttft);
    char modes[4][16];
    int n_modes = 0;
    for (const char *p = modes_arg; *p && n_modes < 4;) {
        size_t l = strcspn(p, ",");
        snprintf(modes[n_modes++], sizeof modes[0], "%.*s", (int)l, p);
        p += l + (p[l] == ',');
    }
    for (int m = 0; m < n_modes; m++)
        if (strcmp(modes[m], "lazy") && strcmp(modes[m], "posaware") && strcmp(modes[m], "prefix") &&
            strcmp(modes[m], "none")) {
            fprintf(stderr, "kvserve-ragbench: unknown mode %s\n", modes[m]);
            return 2;
        }

    printf("corpus %d documents of %d..%d tokens; %d..%d documents per request (Zipf), questions %d..%d tokens, "
           "%d output tokens; %d requests, Poisson %.2f req/s; seed %llu\n\n",
           corpus, dlo, dhi, klo, khi, qlo, qhi, n_out, num, rate, (unsigned long long)seed);
    printf("| alpha | KV pool MiB | mode | doc hit %% | prompt tokens cached %% | TTFT p50 ms | TTFT p99 ms | "
           "output tok/s | done | refused |\n");
    printf("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
    fflush(stdout);

    for (int ai = 0; ai < n_alpha; ai++) {
        /* the trace for this alpha */
        g_rng = seed * 1000003ULL + (uint64_t)ai;
        double z = 0;
        for (int i = 0; i < corpus; i++) z += pow(i + 1, -alphas[ai]), cdf[i] = z;
        double t = 0;
        int n_redrawn = 0;
        for (int j = 0; j < num; j++) {
            struct rjob *jb = &jobs[j];
            free(jb->question);
            memset(jb, 0, sizeof *jb);
        redraw:
            jb->n_docs = irange(klo, khi);
            for (int k = 0; k < jb->n_docs; k++) {
                int d, dup, tries = 0;
                do {
                    double u = urand() * z;
                    int lo = 0, hi = corpus - 1;
                    while (lo < hi) {
                        int mid = (lo + hi) / 2;
                        if (cdf[mid] < u) lo = mid + 1; else hi = mid;
                    }
                    d = lo;
                    if (++tries > 100000) d = (int)(rnd64() % (uint64_t)corpus);
                    dup = 0;
                    for (int q = 0; q < k; q++) dup |= jb->doc[q] == d;
                } while (dup);
                jb->doc[k] = d;
            }
            {
                /* the doc cache's 16-bit offset field: the last document must start before slot
                 * 65535 (doc_cache.h); such requests are redrawn for every mode alike */
                int bs = cfg.kv_block_size > 0 ? cfg.kv_block_size : 16, start = 0;
                for (int k = 0; k + 1 < jb->n_docs; k++) start += (dlen[jb->doc[k]] + bs - 1) / bs * bs;
                if (start + 1 > 65535) {
                    n_redrawn++;
                    goto redraw;
                }
            }
            jb->n_question = irange(qlo, qhi);
            jb->question = kvs_xmalloc((size_t)jb->n_question * sizeof *jb->question);
            for (int i = 0; i < jb->n_question; i++) jb->question[i] = (int32_t)(rnd64() % (uint64_t)vocab);
            if (rate > 0) t += -log(1.0 - urand()) / rate;
            jb->t_arrival = t;
        }
        if (n_redrawn)
            fprintf(stderr, "alpha %g: %d document lists redrawn (offsets past the 16-bit field)\n", alphas[ai], n_redrawn);
        for (int bi = 0; bi < n_budget; bi++)
            for (int mi = 0; mi < n_modes; mi++) {
                char set[128];
                struct kvs_config run;
                kvs_config_init(&run);
                char *dump = kvs_config_dump_json(&cfg);   /* a deep copy of the base config */
                int rc = kvs_config_load_json(&run, dump, "ragbench", err, sizeof err);
                free(dump);
                const char *reuse = !strcmp(modes[mi], "posaware") ? "lazy" : modes[mi];
                snprintf(set, sizeof set, "kv.memory_bytes=%lld", (long long)(budgets[bi] * 1048576.0));
                if (rc == 0) rc = kvs_config_set(&run, set, err, sizeof err);
                snprintf(set, sizeof set, "kv.reuse=%s", reuse);
                if (rc == 0) rc = kvs_config_set(&run, set, err, sizeof err);
                snprintf(set, sizeof set, "kv.lazy.position_aware=%s", !strcmp(modes[mi], "posaware") ? "true" : "false");
                if (rc == 0) rc = kvs_config_set(&run, set, err, sizeof err);
                if (rc == 0) rc = kvs_config_validate(&run, err, sizeof err);
                struct kvs_engine *e = NULL;
                if (rc == 0) rc = kvs_engine_create(&run, model, NULL, &e, err, sizeof err);
                if (rc < 0) {
                    fprintf(stderr, "kvserve-ragbench: %s\n", err);
                    return 1;
                }
                double t0 = kvs_now();
                struct kvs_doc_segment segs[MAX_DOCS_PER_REQ];
                for (int j = 0; j < num; j++) {
                    struct rjob *jb = &jobs[j];
                    atomic_store(&jb->done, 0);
                    jb->refused = 0;
                    double wait = t0 + jb->t_arrival - kvs_now();
                    if (wait > 0) {
                        struct timespec ts = {(time_t)wait, (long)((wait - floor(wait)) * 1e9)};
                        nanosleep(&ts, NULL);
                    }
                    struct kvs_request_params p;
                    memset(&p, 0, sizeof p);
                    for (int k = 0; k < jb->n_docs; k++)
                        segs[k] = (struct kvs_doc_segment){(uint64_t)jb->doc[k], doc[jb->doc[k]], dlen[jb->doc[k]]};
                    p.docs = segs;
                    p.n_docs = jb->n_docs;
                    p.prompt = jb->question;
                    p.n_prompt = jb->n_question;
                    p.max_tokens = n_out;
                    p.sampling.top_p = 1;
                    p.sampling.repetition_penalty = 1;
                    p.ignore_eos = 1;
                    p.skip_special = 1;
                    jb->r = kvs_request_new(&p, on_events, jb);
                    if (!jb->r) {
                        fprintf(stderr, "kvserve-ragbench: out of memory\n");
                        return 1;
                    }
                    if (kvs_engine_submit(e, jb->r, err, sizeof err) < 0) {
                        fprintf(stderr, "request %d refused: %s\n", j, err);
                        jb->refused = 1;
                        atomic_store(&jb->done, 1);
                    }
                }
                for (int j = 0; j < num; j++)
                    while (!atomic_load(&jobs[j].done)) usleep(1000);
                double t_end = t0;
                long long out_tok = 0, cached = 0, prompt = 0;
                int n_ok = 0, n_refused = 0;
                for (int j = 0; j < num; j++) {
                    struct rjob *jb = &jobs[j];
                    if (jb->refused) {
                        n_refused++;
                    } else {
                        ttft[n_ok++] = jb->ttft;
                        out_tok += jb->n_gen;
                        cached += jb->n_cached;
                        prompt += jb->n_prompt;
                        if (jb->t_done > t_end) t_end = jb->t_done;
                    }
                    kvs_request_unref(jb->r);
                    jb->r = NULL;
                }
                struct kvs_engine_stats st;
                kvs_engine_stats(e, &st);
                kvs_engine_free(e);
                kvs_config_free(&run);
                qsort(ttft, (size_t)n_ok, sizeof *ttft, cmp_double);
                char hit[32] = "-";
                if (!strcmp(reuse, "lazy")) snprintf(hit, sizeof hit, "%.1f", 100.0 * kvs_engine_kv_counter(&st, "kvserve:doc_cache_hit_ratio"));
                printf("| %.2g | %g | %s | %s | %.1f | %.1f | %.1f | %.1f | %d | %d |\n", alphas[ai], budgets[bi],
                       modes[mi], hit, prompt ? 100.0 * (double)cached / (double)prompt : 0.0,
                       1e3 * pct(ttft, n_ok, 50), 1e3 * pct(ttft, n_ok, 99),
                       t_end > t0 ? (double)out_tok / (t_end - t0) : 0.0, n_ok, n_refused);
                fflush(stdout);
            }
    }
    for (int j = 0; j < num; j++) free(jobs[j].question);
    free(jobs);
    for (int d = 0; d < corpus; d++) free(doc[d]);
    free(doc);
    free(dlen);
    free(cdf);
    free(ttft);
    kvs_model_free(model);
    kvs_config_free(&cfg);
    return 0;
}
