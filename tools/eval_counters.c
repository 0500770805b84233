/* eval_counters.c: the strategies' own counters as the quality harness reports them (eval.h).
 *
 * This is the one place where a KV strategy tells the harness what it did. Today only exact
 * strategies exist (decode "full", reuse "none"/"prefix"), so what a decode step reads is known
 * from the batch: every sequence reads the K and V of all its positions. A new decode strategy
 * (mac, paris, retro) that reads less adds a branch to decode_bytes_read() below with what it
 * actually read (selected pages, top-k tokens, reused summaries); extra numbers of its own
 * (recall@k, summary hit rate) go into kvs_eval_counters_finish as name/value extras. A
 * strategy not listed here that is not exact is reported as "not reported", never as full.
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

void kvs_eval_counters_finish(struct kvs_eval_counters *c, const struct kvs_kv *s)
{
    (void)c;
    (void)s;   /* no built-in strategy keeps extra counters yet; see the comment at the top */
}

void kvs_eval_counters_from_engine(struct kvs_eval_counters *c, const struct kvs_engine_stats *st)
{
    c->hit_queries = st->cache_queries;
    c->hits = st->cache_hits;
}
