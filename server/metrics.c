/* metrics.c: histograms and the Prometheus text exposition (format 0.0.4). */
#include "server/metrics.h"

#include "base/util.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* Bucket bounds follow vLLM's so dashboards built for it read ours unchanged. */
static const double k_ttft_bounds[] = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                                       1.0,   2.5,   5.0,  7.5,  10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0};
static const double k_itl_bounds[] = {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                                      1.0,  2.5,   5.0,  7.5,   10.0, 20.0, 40.0, 80.0};
static const double k_e2e_bounds[] = {0.3,  0.5,  0.8,  1.0,   1.5,   2.0,   2.5,   5.0,   10.0, 15.0,
                                      20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};

static void hist_init(struct kvs_hist *h, const double *b, int n)
{
    memset(h, 0, sizeof *h);
    KVS_ASSERT(n <= KVS_HIST_MAX_BUCKETS);
    h->bounds = b;
    h->n_buckets = n;
}

void kvs_metrics_init(struct kvs_metrics *m)
{
    memset(m, 0, sizeof *m);
    hist_init(&m->ttft, k_ttft_bounds, (int)(sizeof k_ttft_bounds / sizeof *k_ttft_bounds));
    hist_init(&m->itl, k_itl_bounds, (int)(sizeof k_itl_bounds / sizeof *k_itl_bounds));
    hist_init(&m->e2e, k_e2e_bounds, (int)(sizeof k_e2e_bounds / sizeof *k_e2e_bounds));
    hist_init(&m->queue, k_e2e_bounds, (int)(sizeof k_e2e_bounds / sizeof *k_e2e_bounds));
}

void kvs_hist_observe(struct kvs_hist *h, double v)
{
    if (v < 0) v = 0;
    int i = 0;
    while (i < h->n_buckets && v > h->bounds[i]) i++;
    h->counts[i]++;
    h->count++;
    h->sum += v;
}

void kvs_sbuf_append(struct kvs_sbuf *b, const char *data, size_t n)
{
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n + 1) cap *= 2;
        b->s = kvs_xrealloc(b->s, cap);
        b->cap = cap;
    }
    memcpy(b->s + b->len, data, n);
    b->len += n;
    b->s[b->len] = 0;
}

void kvs_sbuf_printf(struct kvs_sbuf *b, const char *fmt, ...)
{
    char tmp[1024];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if ((size_t)n < sizeof tmp) {
        kvs_sbuf_append(b, tmp, (size_t)n);
        return;
    }
    char *big = kvs_xmalloc((size_t)n + 1);
    va_start(ap, fmt);
    vsnprintf(big, (size_t)n + 1, fmt, ap);
    va_end(ap);
    kvs_sbuf_append(b, big, (size_t)n);
    free(big);
}

void kvs_sbuf_free(struct kvs_sbuf *b)
{
    free(b->s);
    memset(b, 0, sizeof *b);
}

static void head(struct kvs_sbuf *o, const char *name, const char *type, const char *help)
{
    kvs_sbuf_printf(o, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void gauge(struct kvs_sbuf *o, const char *name, const char *help, const char *model, double v)
{
    head(o, name, "gauge", help);
    kvs_sbuf_printf(o, "%s{model_name=\"%s\"} %.17g\n", name, model, v);
}

static void counter(struct kvs_sbuf *o, const char *name, const char *help, const char *model, double v)
{
    head(o, name, "counter", help);
    kvs_sbuf_printf(o, "%s{model_name=\"%s\"} %.17g\n", name, model, v);
}

static void hist(struct kvs_sbuf *o, const char *name, const char *help, const char *model, const struct kvs_hist *h)
{
    head(o, name, "histogram", help);
    uint64_t cum = 0;
    for (int i = 0; i < h->n_buckets; i++) {
        cum += h->counts[i];
        kvs_sbuf_printf(o, "%s_bucket{le=\"%g\",model_name=\"%s\"} %llu\n", name, h->bounds[i], model,
                        (unsigned long long)cum);
    }
    cum += h->counts[h->n_buckets];
    kvs_sbuf_printf(o, "%s_bucket{le=\"+Inf\",model_name=\"%s\"} %llu\n", name, model, (unsigned long long)cum);
    kvs_sbuf_printf(o, "%s_sum{model_name=\"%s\"} %.17g\n", name, model, h->sum);
    kvs_sbuf_printf(o, "%s_count{model_name=\"%s\"} %llu\n", name, model, (unsigned long long)h->count);
}

void kvs_metrics_render(const struct kvs_metrics *m, const struct kvs_engine_stats *es, const char *model,
                        int n_documents, struct kvs_sbuf *o)
{
    struct kvs_engine_stats z;
    if (!es) {
        memset(&z, 0, sizeof z);
        es = &z;
    }
    double usage = es->kv_blocks_total > 0 ? (double)es->kv_blocks_used / es->kv_blocks_total : 0.0;
    gauge(o, "vllm:num_requests_running", "Number of requests in model execution batches.", model, es->num_running);
    gauge(o, "vllm:num_requests_waiting", "Number of requests waiting to be processed.", model, es->num_waiting);
    gauge(o, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", model, usage);
    counter(o, "vllm:num_preemptions_total", "Cumulative number of preemptions from the engine.", model,
            (double)es->num_preemptions);
    counter(o, "vllm:prompt_tokens_total", "Number of prefill tokens processed.", model, (double)es->prompt_tokens);
    counter(o, "vllm:generation_tokens_total", "Number of generation tokens processed.", model,
            (double)es->generation_tokens);
    counter(o, "vllm:prefix_cache_queries_total", "Prefix cache queries, in terms of number of queried tokens.",
            model, (double)es->cache_queries);
    counter(o, "vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens.", model,
            (double)es->cache_hits);
    static const char *reasons[KVS_REASON_COUNT] = {"stop", "length", "abort", "error", "timeout"};
    head(o, "vllm:request_success_total", "counter", "Count of successfully processed requests.");
    for (int i = 0; i < KVS_REASON_COUNT; i++)
        kvs_sbuf_printf(o, "vllm:request_success_total{finished_reason=\"%s\",model_name=\"%s\"} %llu\n", reasons[i],
                        model, (unsigned long long)m->success[i]);
    hist(o, "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", model, &m->ttft);
    hist(o, "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", model, &m->itl);
    hist(o, "vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.", model, &m->e2e);
    hist(o, "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", model,
         &m->queue);
    gauge(o, "kvserve:kv_blocks_total", "KV-cache blocks in the pool.", model, es->kv_blocks_total);
    gauge(o, "kvserve:kv_blocks_used", "KV-cache blocks referenced by running requests.", model, es->kv_blocks_used);
    gauge(o, "kvserve:kv_blocks_free", "KV-cache blocks not referenced by a running request.", model,
          es->kv_blocks_total - es->kv_blocks_used);
    gauge(o, "kvserve:kv_blocks_cached", "Free KV-cache blocks holding reusable prefix or document KV.", model,
          es->kv_blocks_cached);
    gauge(o, "kvserve:documents", "Documents in the document store.", model, n_documents);
    counter(o, "kvserve:argmax_tokens_total",
            "Generation tokens of plain greedy requests picked on the device (no logits download, no sampler).", model,
            (double)es->argmax_tokens);
    counter(o, "kvserve:engine_steps_total", "Scheduler steps that ran a forward pass.", model, (double)es->steps);
    counter(o, "kvserve:engine_forward_seconds_total", "Time in forward passes (the device's share of a step).", model,
            es->busy_s);
    counter(o, "kvserve:engine_step_seconds_total", "Wall time of steps: forward plus the scheduler's host work.",
            model, es->step_s);
    counter(o, "kvserve:engine_schedule_seconds_total",
            "Of the step wall time, the host work before the forward pass (reap, schedule, batch).", model, es->sched_s);
    counter(o, "kvserve:engine_launch_seconds_total",
            "Of the forward time, until the step was queued on the device (the runner's host work).", model,
            es->launch_s);
    counter(o, "kvserve:engine_decode_steps_total", "Steps in which every sequence decoded one token.", model,
            (double)es->decode_steps);
    counter(o, "kvserve:engine_decode_rows_total", "Sequences of those decode-only steps.", model,
            (double)es->decode_rows);
    counter(o, "kvserve:engine_decode_forward_seconds_total", "Forward time of those decode-only steps.", model,
            es->decode_busy_s);
    /* the KV strategies' own counters, under the names they give (engine/kv/kv.h) */
    for (int i = 0; i < es->n_kv_counters; i++) {
        const struct kvs_kv_counter *k = &es->kv_counters[i];
        if (k->family) {
            if (i == 0 || !es->kv_counters[i - 1].family || strcmp(es->kv_counters[i - 1].family, k->family))
                head(o, k->family, "histogram", k->help);
            if (k->le) kvs_sbuf_printf(o, "%s{le=\"%s\",model_name=\"%s\"} %.17g\n", k->name, k->le, model, k->value);
            else kvs_sbuf_printf(o, "%s{model_name=\"%s\"} %.17g\n", k->name, model, k->value);
        } else if (k->is_counter) {
            counter(o, k->name, k->help, model, k->value);
        } else {
            gauge(o, k->name, k->help, model, k->value);
        }
    }
    gauge(o, "kvserve:kv_counters_dropped",
          "KV strategy counters left out of this page for want of room (KVS_KV_MAX_COUNTERS; logged once); 0.", model,
          es->kv_counters_dropped);
    counter(o, "kvserve:requests_rejected_total", "Requests refused at admission (queue full, draining).", model,
            (double)(m->rejected + es->requests_rejected));
    counter(o, "kvserve:http_requests_total", "HTTP requests answered.", model, (double)m->http_requests);
}
