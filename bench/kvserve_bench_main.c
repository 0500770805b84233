/* kvserve_bench_main.c: kvserve-bench: drives the engine without HTTP and prints a table.
 *
 * Requests arrive as a Poisson process (--rate per second; 0 = all at once) with random token
 * ids as prompts (no tokenizer needed), prompt and output lengths uniform in MIN:MAX or read
 * from a file (one "prompt_len output_len" pair per line, # comments). --prefix-len P makes
 * every prompt start with one of --prefix-groups shared prefixes of P tokens (prefix caching).
 * Outputs run to their length (ignore_eos), as serving benchmarks do for fixed output lengths.
 * TTFT/TPOT come from the engine's per-request timings (TPOT excludes the first token).
 * --max-seconds T stops the run after T seconds (a workload too long for the time at hand: the
 * issue-sized long-generation runs of bench/RESULTS.md); it then also reports the generated tokens
 * per second between --warmup-seconds W and T from the engine's counters (every sequence's new
 * tokens, finished or not: the steady state once the pool has filled), and ends the requests
 * still in flight.
 *
 *   build/kvserve-bench --model tests/data/models/llama --num 64 --rate 20 \
 *       --prompt-len 16:128 --output-len 16:64 --set kv.memory_bytes=4194304
 */
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

struct bjob {
    int n_prompt, n_out;
    double t_arrival;             /* seconds after start */
    struct kvs_request *r;
    int submitted, rejected, done;
    enum kvs_finish finish;
    int n_gen, n_cached;
    double ttft, e2e, queue;
};

static atomic_int g_done;

static void on_events(void *user)
{
    struct bjob *j = user;
    struct kvs_event ev[32];
    int n;
    while ((n = kvs_request_poll(j->r, ev, 32)) > 0) {
        for (int i = 0; i < n; i++) {
            if (ev[i].type != KVS_EV_TOKEN) {
                j->finish = ev[i].finish;
                j->n_gen = ev[i].n_completion_tokens;
                j->n_cached = ev[i].n_cached_tokens;
                j->ttft = ev[i].ttft_s;
                j->e2e = ev[i].e2e_s;
                j->queue = ev[i].queue_time_s;
                if (ev[i].type == KVS_EV_ERROR) fprintf(stderr, "request error: %s\n", ev[i].error);
                j->done = 1;
                atomic_fetch_add(&g_done, 1);
            }
            kvs_event_clear(&ev[i]);
        }
    }
}

static uint64_t g_rng = 0x853c49e6748fea9bULL;
static double urand(void)
{
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (double)(g_rng >> 11) / 9007199254740992.0;
}

static int parse_range(const char *s, int *lo, int *hi)
{
    char *end;
    long a = strtol(s, &end, 10), b = a;
    if (end == s) return -1;
    if (*end == ':') {
        const char *t = end + 1;
        b = strtol(t, &end, 10);
        if (end == t) return -1;
    }
    if (*end || a < 1 || b < a || b > 1000000) return -1;
    *lo = (int)a;
    *hi = (int)b;
    return 0;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double pct(double *v, int n, double p)
{
    if (n == 0) return NAN;
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    int i = (int)ceil(p / 100.0 * n) - 1;
    if (i < 0) i = 0;
    if (i >= n) i = n - 1;
    return v[i];
}

static void usage(void)
{
    fprintf(stderr,
            "usage: kvserve-bench --model DIR [options]\n"
            "  --config FILE         JSON config (then --set overrides)\n"
            "  --set key=value       config override (repeatable), e.g. kv.reuse=none\n"
            "  --num N               requests (default 64)\n"
            "  --rate R              Poisson arrivals per second; 0 = all at once (default 0)\n"
            "  --prompt-len MIN:MAX  uniform prompt lengths (default 32:128)\n"
            "  --output-len MIN:MAX  uniform output lengths (default 32:64)\n"
            "  --file PATH           per-request \"prompt_len output_len\" lines instead\n"
            "  --prefix-len P        shared prefix tokens at the start of every prompt (default 0)\n"
            "  --prefix-groups G     distinct shared prefixes (default 1)\n"
            "  --seed S              workload seed (default 1)\n"
            "  --concurrency C       at most C requests in flight, the next sent as one finishes\n"
            "                        (as `vllm bench serve --max-concurrency`; default 0: no limit)\n"
            "  --max-seconds T       stop after T seconds; report the steady-state tok/s (default 0: run to the end)\n"
            "  --warmup-seconds W    with --max-seconds: the steady state is measured from W (default T / 3)\n");
}

int main(int argc, char **argv)
{
    struct kvs_config cfg;
    kvs_config_init(&cfg);
    char err[512];
    const char *model_dir = NULL, *file = NULL;
    int num = 64, plo = 32, phi = 128, olo = 32, ohi = 64, prefix_len = 0, groups = 1;
    int concurrency = 0;          /* > 0: at most this many requests in flight (closed loop) */
    double rate = 0, max_s = 0, warm_s = -1;
    uint64_t seed = 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int rc = 0;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage();
            return 0;
        }
        if (!v) {
            fprintf(stderr, "kvserve-bench: %s needs a value\n", a);
            usage();
            return 2;
        }
        i++;
        if (!strcmp(a, "--model")) model_dir = v;
        else if (!strcmp(a, "--config")) rc = kvs_config_load_file(&cfg, v, err, sizeof err);
        else if (!strcmp(a, "--set")) rc = kvs_config_set(&cfg, v, err, sizeof err);
        else if (!strcmp(a, "--num")) num = atoi(v), rc = num > 0 ? 0 : kvs_err(err, sizeof err, -EINVAL, "--num must be > 0");
        else if (!strcmp(a, "--rate")) rate = atof(v), rc = rate >= 0 ? 0 : kvs_err(err, sizeof err, -EINVAL, "--rate must be >= 0");
        else if (!strcmp(a, "--prompt-len")) rc = parse_range(v, &plo, &phi) ? kvs_err(err, sizeof err, -EINVAL, "bad --prompt-len %s", v) : 0;
        else if (!strcmp(a, "--output-len")) rc = parse_range(v, &olo, &ohi) ? kvs_err(err, sizeof err, -EINVAL, "bad --output-len %s", v) : 0;
        else if (!strcmp(a, "--file")) file = v;
        else if (!strcmp(a, "--prefix-len")) prefix_len = atoi(v), rc = prefix_len >= 0 ? 0 : kvs_err(err, sizeof err, -EINVAL, "--prefix-len must be >= 0");
        else if (!strcmp(a, "--prefix-groups")) groups = atoi(v), rc = groups > 0 ? 0 : kvs_err(err, sizeof err, -EINVAL, "--prefix-groups must be > 0");
        else if (!strcmp(a, "--concurrency")) concurrency = atoi(v), rc = concurrency >= 0 ? 0 : kvs_err(err, sizeof err, -EINVAL, "--concurrency must be >= 0");
        else if (!strcmp(a, "--seed")) seed = strtoull(v, NULL, 10);
        else if (!strcmp(a, "--max-seconds")) max_s = atof(v), rc = max_s >= 0 ? 0 : kvs_err(err, sizeof err, -EINVAL, "--max-seconds must be >= 0");
        else if (!strcmp(a, "--warmup-seconds")) warm_s = atof(v), rc = warm_s >= 0 ? 0 : kvs_err(err, sizeof err, -EINVAL, "--warmup-seconds must be >= 0");
        else rc = kvs_err(err, sizeof err, -EINVAL, "unknown option %s", a);
        if (rc < 0) {
            fprintf(stderr, "kvserve-bench: %s\n", err);
            return 2;
        }
    }
    if (model_dir) {
        free(cfg.model_path);
        cfg.model_path = kvs_xstrdup(model_dir);
    }
    if (!cfg.model_path || !*cfg.model_path) {
        fprintf(stderr, "kvserve-bench: no model (--model DIR or model.path in --config)\n");
        usage();
        return 2;
    }
    if (kvs_config_validate(&cfg, err, sizeof err) < 0) {
        fprintf(stderr, "kvserve-bench: %s\n", err);
        return 2;
    }
    g_rng ^= seed * 0x9e3779b97f4a7c15ULL;

    /* workload */
    struct bjob *jobs = NULL;
    if (file) {
        FILE *f = fopen(file, "r");
        if (!f) {
            fprintf(stderr, "kvserve-bench: cannot open %s\n", file);
            return 2;
        }
        char line[256];
        int cap = 0, ln = 0;
        num = 0;
        while (fgets(line, sizeof line, f)) {
            ln++;
            char *s = line;
            while (*s == ' ' || *s == '\t') s++;
            if (*s == '#' || *s == '\n' || !*s) continue;
            int p, o;
            if (sscanf(s, "%d %d", &p, &o) != 2 || p < 1 || o < 1) {
                fprintf(stderr, "kvserve-bench: %s:%d: expected \"prompt_len output_len\"\n", file, ln);
                fclose(f);
                return 2;
            }
            if (num == cap) jobs = kvs_xrealloc(jobs, (size_t)(cap = cap ? 2 * cap : 64) * sizeof *jobs);
            memset(&jobs[num], 0, sizeof jobs[num]);
            jobs[num].n_prompt = p;
            jobs[num].n_out = o;
            num++;
        }
        fclose(f);
        if (num == 0) {
            fprintf(stderr, "kvserve-bench: %s holds no requests\n", file);
            return 2;
        }
    } else {
        jobs = kvs_xcalloc((size_t)num, sizeof *jobs);
        for (int i = 0; i < num; i++) {
            jobs[i].n_prompt = plo + (int)(urand() * (phi - plo + 1));
            jobs[i].n_out = olo + (int)(urand() * (ohi - olo + 1));
        }
    }
    double t = 0;
    for (int i = 0; i < num; i++) {
        if (rate > 0) t += -log(1.0 - urand()) / rate;
        jobs[i].t_arrival = t;
    }

    struct kvs_model *model;
    if (kvs_model_load(cfg.model_path, &model, err, sizeof err) < 0) {
        fprintf(stderr, "kvserve-bench: %s\n", err);
        return 1;
    }
    int vocab = kvs_model_config(model)->vocab_size;
    struct kvs_engine *e;
    if (kvs_engine_create(&cfg, model, NULL, &e, err, sizeof err) < 0) {
        fprintf(stderr, "kvserve-bench: %s\n", err);
        kvs_model_free(model);
        return 1;
    }
    int maxctx = kvs_engine_max_context(e);
    int32_t *prefixes = kvs_xcalloc((size_t)groups * (size_t)(prefix_len + 1), sizeof *prefixes);
    for (int i = 0; i < groups * prefix_len; i++) prefixes[i] = (int32_t)(urand() * vocab);
    int32_t *prompt = kvs_xmalloc((size_t)maxctx * sizeof *prompt);

    if (max_s > 0 && (warm_s < 0 || warm_s >= max_s)) warm_s = max_s / 3;
    struct kvs_engine_stats st_warm;
    memset(&st_warm, 0, sizeof st_warm);
    double t_warm = -1;
    int capped = 0;
    double t0 = kvs_now();
    int next = 0, n_rejected = 0, n_skipped = 0;
    while (atomic_load(&g_done) + n_rejected + n_skipped < num) {
        double now = kvs_now() - t0;
        if (max_s > 0 && t_warm < 0 && now >= warm_s) {
            kvs_engine_stats(e, &st_warm);
            t_warm = kvs_now() - t0;
        }
        if (max_s > 0 && now >= max_s) {
            capped = 1;
            break;
        }
        while (next < num && jobs[next].t_arrival <= now &&
               (concurrency == 0 || next - atomic_load(&g_done) - n_rejected - n_skipped < concurrency)) {
            struct bjob *j = &jobs[next++];
            if (j->n_prompt + j->n_out > maxctx) {
                n_skipped++;
                continue;
            }
            int g = (int)(urand() * groups);
            for (int k = 0; k < j->n_prompt; k++)
                prompt[k] = k < prefix_len ? prefixes[g * prefix_len + k] : (int32_t)(urand() * vocab);
            struct kvs_request_params p;
            memset(&p, 0, sizeof p);
            p.prompt = prompt;
            p.n_prompt = j->n_prompt;
            p.max_tokens = j->n_out;
            p.sampling.top_p = 1;
            p.sampling.repetition_penalty = 1;
            p.ignore_eos = 1;
            p.skip_special = 1;
            j->r = kvs_request_new(&p, on_events, j);
            if (!j->r) {
                fprintf(stderr, "kvserve-bench: out of memory\n");
                return 1;
            }
            int rc = kvs_engine_submit(e, j->r, err, sizeof err);
            if (rc == -EAGAIN) {
                j->rejected = 1;
                n_rejected++;
            } else if (rc < 0) {
                fprintf(stderr, "kvserve-bench: submit: %s\n", err);
                return 1;
            }
            j->submitted = rc == 0;
        }
        usleep(500);
    }
    double t_end = kvs_now() - t0;
    struct kvs_engine_stats st;
    kvs_engine_stats(e, &st);
    if (capped) {
        /* the requests in flight end (CANCELLED) before their handles are dropped below */
        kvs_engine_free(e);
        e = NULL;
    }

    double *ttft = kvs_xcalloc((size_t)num, sizeof *ttft), *tpot = kvs_xcalloc((size_t)num, sizeof *tpot),
           *e2e = kvs_xcalloc((size_t)num, sizeof *e2e), *queue = kvs_xcalloc((size_t)num, sizeof *queue);
    int n_ok = 0, n_tpot = 0;
    long long out_tok = 0, in_tok = 0;
    for (int i = 0; i < num; i++) {
        struct bjob *j = &jobs[i];
        if (!j->submitted) continue;
        if (j->done && (j->finish == KVS_FINISH_LENGTH || j->finish == KVS_FINISH_STOP)) {
            ttft[n_ok] = j->ttft;
            e2e[n_ok] = j->e2e;
            queue[n_ok] = j->queue;
            n_ok++;
            if (j->n_gen > 1) tpot[n_tpot++] = (j->e2e - j->ttft) / (j->n_gen - 1);
            out_tok += j->n_gen;
            in_tok += j->n_prompt;
        }
        kvs_request_unref(j->r);
    }
    printf("kvserve-bench: %s, %s, %d requests, rate %s, prompt %s, output %s, prefix %d x %d groups\n",
           cfg.model_path, cfg.device, num, rate > 0 ? "poisson" : "inf", file ? file : "uniform",
           file ? "file" : "uniform", prefix_len, groups);
    printf("  config: max_running %d, max_batch_tokens %d, prefill_chunk %d, kv.block_size %d, kv.reuse %s, "
           "%d KV blocks\n", cfg.max_running, cfg.max_batch_tokens, cfg.prefill_chunk, cfg.kv_block_size,
           cfg.kv_reuse, st.kv_blocks_total);
    if (rate > 0) printf("  arrival rate: %.2f req/s\n", rate);
    if (concurrency > 0) printf("  concurrency: at most %d requests in flight\n", concurrency);
    printf("| metric | value |\n| --- | --- |\n");
    printf("| requests completed / rejected / too long | %d / %d / %d |\n", n_ok, n_rejected, n_skipped);
    printf("| duration (s) | %.3f%s |\n", t_end, capped ? " (stopped at --max-seconds)" : "");
    if (capped) {
        const double dt = t_end - t_warm;
        const unsigned long long dg = (unsigned long long)(st.generation_tokens - st_warm.generation_tokens);
        printf("| steady state %.1f-%.1f s: generated tok/s (all sequences) | %.1f (%llu tokens) |\n", t_warm, t_end,
               dt > 0 ? (double)dg / dt : 0.0, dg);
        printf("| steady state: engine steps, preemptions, running at the end | %llu, %llu, %d |\n",
               (unsigned long long)(st.steps - st_warm.steps),
               (unsigned long long)(st.num_preemptions - st_warm.num_preemptions), st.num_running);
        printf("| generated tok/s over the whole run (all sequences) | %.1f |\n", (double)st.generation_tokens / t_end);
    }
    printf("| request throughput (req/s) | %.2f |\n", n_ok / t_end);
    printf("| output throughput (tok/s) | %.1f |\n", out_tok / t_end);
    printf("| total throughput (tok/s) | %.1f |\n", (out_tok + in_tok) / t_end);
    double q50 = pct(queue, n_ok, 50);
    printf("| TTFT p50 / p99 (ms) | %.2f / %.2f |\n", 1e3 * pct(ttft, n_ok, 50), 1e3 * pct(ttft, n_ok, 99));
    printf("| TPOT p50 / p99 (ms) | %.2f / %.2f |\n", 1e3 * pct(tpot, n_tpot, 50), 1e3 * pct(tpot, n_tpot, 99));
    printf("| e2e latency p50 / p99 (ms) | %.2f / %.2f |\n", 1e3 * pct(e2e, n_ok, 50), 1e3 * pct(e2e, n_ok, 99));
    printf("| queue time p50 (ms) | %.2f |\n", 1e3 * q50);
    printf("| preemptions | %llu |\n", (unsigned long long)st.num_preemptions);
    if (st.cache_queries)
        printf("| prefix hit rate | %.1f%% (%llu / %llu prompt tokens) |\n",
               100.0 * (double)st.cache_hits / (double)st.cache_queries, (unsigned long long)st.cache_hits,
               (unsigned long long)st.cache_queries);
    else
        printf("| prefix hit rate | n/a (kv.reuse=%s) |\n", cfg.kv_reuse);
    printf("| engine steps / busy (s) | %llu / %.3f |\n", (unsigned long long)st.steps, st.busy_s);
    printf("| new tokens per step (mean, excl. recompute) | %.1f |\n",
           st.steps ? (double)(st.generation_tokens + st.prompt_tokens - st.cache_hits) / (double)st.steps : 0.0);

    kvs_engine_free(e);
    kvs_model_free(model);
    kvs_config_free(&cfg);
    free(prefixes);
    free(prompt);
    free(jobs);
    free(ttft);
    free(tpot);
    free(e2e);
    free(queue);
    return capped || n_ok == num - n_rejected - n_skipped ? 0 : 1;
}
