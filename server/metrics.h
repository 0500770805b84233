/* metrics.h: request-level counters and latency histograms for GET /metrics (Prometheus text,
 * vLLM metric names), fed by the event-loop thread from engine events; gauges come from a
 * kvs_engine_stats snapshot at scrape time.
 *
 * Ownership: struct kvs_metrics is caller storage (zero it, or kvs_metrics_init). Rendering
 * appends to a caller-provided growable buffer. Not thread-safe: loop thread only.
 */
#ifndef KVS_SERVER_METRICS_H
#define KVS_SERVER_METRICS_H

#include <stddef.h>
#include <stdint.h>

#include "engine/engine.h"

#define KVS_HIST_MAX_BUCKETS 24

struct kvs_hist {
    int n_buckets;
    const double *bounds;
    uint64_t counts[KVS_HIST_MAX_BUCKETS + 1];   /* last = +Inf */
    uint64_t count;
    double sum;
};

enum kvs_metric_reason { KVS_REASON_STOP = 0, KVS_REASON_LENGTH, KVS_REASON_ABORT, KVS_REASON_ERROR,
                         KVS_REASON_TIMEOUT, KVS_REASON_COUNT };

struct kvs_metrics {
    struct kvs_hist ttft, itl, e2e, queue;
    uint64_t success[KVS_REASON_COUNT];
    uint64_t rejected;            /* 429/503 at admission, answered by the server */
    uint64_t http_requests;
};

void kvs_metrics_init(struct kvs_metrics *m);
void kvs_hist_observe(struct kvs_hist *h, double v);

struct kvs_sbuf {
    char *s;
    size_t len, cap;
};
void kvs_sbuf_append(struct kvs_sbuf *b, const char *data, size_t n);
void kvs_sbuf_printf(struct kvs_sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void kvs_sbuf_free(struct kvs_sbuf *b);

/* Appends the whole exposition. es may be NULL (still loading). */
void kvs_metrics_render(const struct kvs_metrics *m, const struct kvs_engine_stats *es, const char *model_name,
                        int n_documents, struct kvs_sbuf *out);

#endif
