/* eval_counters.c: the strategies' own counters as the quality harness reports them (eval.h).
 *
 * An exact decode policy reads the K and V of every position, known from the batch. An
 * approximate one reports what it read through the seam (engine/kv/kv.h counters, pulled from
 * the runner at the end: "kvserve:kv_decode_bytes_read_total"), and its other counters
 * (recall@k, hit rate, ...) become name/value extras; one that reports nothing is shown as
 * "not reported", never as full.
 */
#include "tools/eval.h"

#include <string.h>

#include "engine/engine.h"
#include "engine/kv/kv.h"
#include "engine/runner.h"

void kvs_eval_counters_init(struct kvs_eval_counters *c, size_t kv_bytes_per_token)
{
    memset(c, 0, sizeof *c);
    c->kv_read_known = 1;
    c->kv_bytes_per_token = kv_bytes_per_token;
}

/* Bytes the strategy read for one decode sequence with ctx tokens of context; < 0: unknown. */
static double decode_bytes_read(const struct kvs_kv *s, int ctx, size_t bpt)
{
    if (!s || !s->decode || s->decode->exact) return (double)ctx * (double)bpt;
    return -1.0;
}

void kvs_eval_counters_step(struct kvs_eval_counters *c, const struct kvs_kv *s, const struct kvs_batch *b,
                            int window, int is_decode)
{
    if (!is_decode) return;
    c->decode_steps++;
    for (int i = 0; i < b->n_seqs; i++) {
        const struct kvs_batch_seq *q = &b->seqs[i];
        int ctx = q->pos + q->n_tokens;
        c->decode_tokens += (uint64_t)q->n_tokens;
        /* the window run re-encodes each window as a fresh sequence: it reads exactly that */
        double rd = window > 0 ? (double)ctx * (double)c->kv_bytes_per_token
                               : decode_bytes_read(s, ctx, c->kv_bytes_per_token);
        if (rd < 0) c->kv_read_known = 0;
        else c->kv_bytes_read += rd;
    }
}

void kvs_eval_counters_finish(struct kvs_eval_counters *c, const struct kvs_kv *s, struct kvs_runner *r)
{
    if (!r || !s || !s->decode || s->decode->exact) return;
    /* an approximate policy reports what it read; its other counters become extras */
    struct kvs_kv_counter k[KVS_KV_MAX_COUNTERS];
    int n = kvs_runner_kv_counters(r, k, KVS_KV_MAX_COUNTERS);
    for (int i = 0; i < n; i++) {
        if (k[i].family) continue;   /* the fidelity histogram */
        if (!strcmp(k[i].name, "kvserve:kv_decode_bytes_read_total")) {
            c->kv_bytes_read = k[i].value;
            c->kv_read_known = 1;
        } else if (strcmp(k[i].name, "kvserve:kv_decode_bytes_full_total") && c->n_extra < 8) {
            c->extra_name[c->n_extra] = k[i].name;
            c->extra_value[c->n_extra++] = k[i].value;
        }
    }
}

void kvs_eval_counters_from_engine(struct kvs_eval_counters *c, const struct kvs_engine_stats *st)
{
    c->hit_queries = st->cache_queries;
    c->hits = st->cache_hits;
}
