/* runner_tp.c: the tensor-parallel group (engine/runner_tp.h): rank threads, the calls handed
 * to every rank, and the assembly of the LM head's vocabulary shares.
 *
 * A call is one job: rank 0's thread (the caller) posts it under the lock (a generation count
 * wakes the rank threads), runs rank 0's share itself, then waits until every rank has reported
 * back. Jobs carry pointers to the caller's arguments (the batch, the logits array), which stay
 * valid because the caller waits; every rank reads the batch, none writes it, and each writes
 * only its own columns of the logits rows.
 */
#include "engine/runner_tp.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "base/util.h"
#include "engine/config.h"
#include "engine/engine.h"
#include "engine/runner.h"
#include "kernels/backend.h"

enum job_kind {
    JOB_CREATE = 1, JOB_WARM, JOB_FINISH, JOB_FORWARD, JOB_COPY_BLOCK, JOB_SEQ_END, JOB_FREE, JOB_COUNTERS
};

struct rank_slot {
    struct kvs_tp *tp;
    int rank;
    pthread_t thread;
    int started;
    struct kvs_runner *r;
    size_t n_blocks;              /* phase 1: the blocks this rank's budget holds */
    int rc;
    char err[256];
    int rows;                     /* kvs_tp_agree_rows: this rank's rows of the step */
    struct kvs_kv_counter cnt[2 * KVS_KV_MAX_COUNTERS]; /* JOB_COUNTERS: this rank's (the engine's room, scheduler.c publish_stats) */
    int n_cnt;
};

struct kvs_tp {
    int n;
    struct rank_slot *slots;      /* [n] */
    pthread_mutex_t mu;
    pthread_cond_t go, done;
    uint64_t gen;                 /* bumped per job (under mu) */
    int pending;                  /* rank threads still on the job */
    /* the job (written by rank 0's thread under mu before gen moves; read-only while it runs) */
    enum job_kind kind;
    const struct kvs_config *cfg; /* JOB_CREATE / JOB_FINISH only */
    const struct kvs_model *model;
    size_t n_blocks;
    const struct kvs_batch *batch;
    float *logits;
    int32_t a, b;
    /* kvs_tp_agree */
    pthread_barrier_t barrier;
    pthread_mutex_t agree_mu;
    int agree_rc;                 /* reset by rank 0's thread before each job */
};

static void run_job(struct kvs_tp *tp, struct rank_slot *s)
{
    s->rc = 0;
    switch (tp->kind) {
    case JOB_CREATE:
        s->rc = kvs_runner_rank_create(tp->cfg, tp->model, s->rank, tp->n, &s->r, &s->n_blocks, s->err, sizeof s->err);
        break;
    case JOB_WARM:
        kvs_runner_rank_warm(s->r);
        break;
    case JOB_FINISH:
        s->rc = kvs_runner_rank_finish(s->r, tp->cfg, tp->n_blocks, tp, s->err, sizeof s->err);
        break;
    case JOB_FORWARD:
        s->rc = kvs_runner_rank_forward(s->r, tp->batch, tp->logits);
        break;
    case JOB_COPY_BLOCK:
        kvs_runner_rank_copy_block(s->r, tp->a, tp->b);
        break;
    case JOB_SEQ_END:
        kvs_runner_rank_seq_end(s->r, tp->a);
        break;
    case JOB_FREE:
        kvs_runner_rank_free(s->r);
        s->r = NULL;
        break;
    case JOB_COUNTERS:
        /* on the rank's thread: a policy may download its counters from the rank's device */
        s->n_cnt = kvs_runner_rank_kv_counters(s->r, s->cnt, tp->a);
        break;
    }
}

static void *rank_main(void *arg)
{
    struct rank_slot *s = arg;
    struct kvs_tp *tp = s->tp;
    uint64_t seen = 0;
    for (;;) {
        pthread_mutex_lock(&tp->mu);
        while (tp->gen == seen) pthread_cond_wait(&tp->go, &tp->mu);
        seen = tp->gen;
        const enum job_kind kind = tp->kind;
        pthread_mutex_unlock(&tp->mu);
        run_job(tp, s);
        pthread_mutex_lock(&tp->mu);
        if (--tp->pending == 0) pthread_cond_signal(&tp->done);
        pthread_mutex_unlock(&tp->mu);
        if (kind == JOB_FREE) return NULL;
    }
}

/* posts the job to the rank threads, runs rank 0's share, waits for all; returns the first
 * rank's negative status (its message in *failed_rank's err) or 0 */
static int run_all(struct kvs_tp *tp, enum job_kind kind, int *failed_rank)
{
    pthread_mutex_lock(&tp->mu);
    tp->kind = kind;
    tp->agree_rc = 0;
    tp->pending = 0;
    for (int i = 1; i < tp->n; i++) tp->pending += tp->slots[i].started;
    tp->gen++;
    pthread_cond_broadcast(&tp->go);
    pthread_mutex_unlock(&tp->mu);
    run_job(tp, &tp->slots[0]);
    pthread_mutex_lock(&tp->mu);
    while (tp->pending > 0) pthread_cond_wait(&tp->done, &tp->mu);
    pthread_mutex_unlock(&tp->mu);
    for (int i = 0; i < tp->n; i++)
        if (tp->slots[i].rc < 0) {
            if (failed_rank) *failed_rank = i;
            return tp->slots[i].rc;
        }
    return 0;
}

int kvs_tp_agree(struct kvs_tp *tp, int rc)
{
    if (rc < 0) {
        pthread_mutex_lock(&tp->agree_mu);
        if (tp->agree_rc == 0) tp->agree_rc = rc;
        pthread_mutex_unlock(&tp->agree_mu);
    }
    pthread_barrier_wait(&tp->barrier);
    /* written only before the barrier and reset only before the next job: a stable read */
    pthread_mutex_lock(&tp->agree_mu);
    rc = tp->agree_rc;
    pthread_mutex_unlock(&tp->agree_mu);
    return rc;
}

int kvs_tp_agree_rows(struct kvs_tp *tp, int rank, int rc, int n_rows)
{
    /* written before the barrier, read after it; the next write is a later step's, after
     * every rank has reported this job done */
    tp->slots[rank].rows = n_rows;
    if ((rc = kvs_tp_agree(tp, rc)) < 0) return rc;
    for (int i = 1; i < tp->n; i++)
        if (tp->slots[i].rows != tp->slots[0].rows) {
            if (rank == 0)
                kvs_log(KVS_LOG_ERROR, "runner: tensor-parallel ranks disagree on the step's rows (rank 0: %d, "
                        "rank %d: %d): the decode policy's recompute() differs between ranks; step refused",
                        tp->slots[0].rows, i, tp->slots[i].rows);
            return -EPROTO;
        }
    return 0;
}

/* frees every rank (each on its own thread), joins the threads, frees the group */
void kvs_tp_free(struct kvs_tp *tp)
{
    if (!tp) return;
    run_all(tp, JOB_FREE, NULL);
    for (int i = 1; i < tp->n; i++)
        if (tp->slots[i].started) pthread_join(tp->slots[i].thread, NULL);
    pthread_barrier_destroy(&tp->barrier);
    pthread_mutex_destroy(&tp->agree_mu);
    pthread_cond_destroy(&tp->go);
    pthread_cond_destroy(&tp->done);
    pthread_mutex_destroy(&tp->mu);
    free(tp->slots);
    free(tp);
}

int kvs_tp_create(const struct kvs_config *cfg, const struct kvs_model *model, struct kvs_runner **out, char *err,
                  size_t errlen)
{
    *out = NULL;
    const int n = cfg->tensor_parallel;
    const struct kvs_backend_ops *ops = kvs_backend_pick(cfg->device, err, errlen);
    if (!ops) return -EINVAL;
    if (!ops->tp_group || !ops->allreduce_sum || !ops->argmax_rows_val)
        return kvs_err(err, errlen, -ENOSYS, "config key 'parallel.tensor': %d needs a backend with collectives; "
                       "the %s backend of this build has none (parallel.tensor must be 1)", n, ops->name);
    struct kvs_tp *tp = kvs_xcalloc(1, sizeof *tp);
    tp->n = n;
    tp->slots = kvs_xcalloc((size_t)n, sizeof *tp->slots);
    pthread_mutex_init(&tp->mu, NULL);
    pthread_cond_init(&tp->go, NULL);
    pthread_cond_init(&tp->done, NULL);
    pthread_mutex_init(&tp->agree_mu, NULL);
    if (pthread_barrier_init(&tp->barrier, NULL, (unsigned)n) != 0) {
        free(tp->slots);
        free(tp);
        return kvs_err(err, errlen, -ENOMEM, "parallel.tensor: pthread_barrier_init failed");
    }
    tp->cfg = cfg;
    tp->model = model;
    int rc = 0, bad = 0;
    for (int i = 0; i < n; i++) {
        tp->slots[i] = (struct rank_slot){.tp = tp, .rank = i};
        if (i > 0 && pthread_create(&tp->slots[i].thread, NULL, rank_main, &tp->slots[i]) != 0) {
            rc = kvs_err(err, errlen, -EAGAIN, "parallel.tensor: cannot start the thread of rank %d", i);
            goto fail;
        }
        tp->slots[i].started = i > 0;
    }
    /* phase 1 on every rank at once (each loads its slices), then the group's KV pool size:
     * the smallest of the ranks' (block tables are shared, so every rank has every block) */
    if ((rc = run_all(tp, JOB_CREATE, &bad)) < 0) {
        kvs_err(err, errlen, rc, "rank %d: %s", bad, tp->slots[bad].err);
        goto fail;
    }
    tp->n_blocks = tp->slots[0].n_blocks;
    for (int i = 1; i < n; i++)
        if (tp->slots[i].n_blocks < tp->n_blocks) tp->n_blocks = tp->slots[i].n_blocks;
    {
        struct kvs_backend **bs = kvs_xcalloc((size_t)n, sizeof *bs);
        const struct kvs_backend_ops *o = NULL;
        for (int i = 0; i < n; i++) bs[i] = kvs_runner_rank_backend(tp->slots[i].r, &o);
        rc = o->tp_group(bs, n, kvs_runner_rank_reduce_elems(tp->slots[0].r), err, errlen);
        free(bs);
        if (rc < 0) goto fail;
    }
    /* the first collective connects the ranks (NCCL); it must not happen inside a recorded
     * step graph, so one all-reduce of the largest size runs now, eagerly, on every rank */
    run_all(tp, JOB_WARM, NULL);
    if ((rc = run_all(tp, JOB_FINISH, &bad)) < 0) {
        kvs_err(err, errlen, rc, "rank %d: %s", bad, tp->slots[bad].err);
        goto fail;
    }
    tp->cfg = NULL;
    tp->model = NULL;
    kvs_log(KVS_LOG_INFO, "runner: tensor parallel over %d ranks (%s backend), %zu KV blocks", n, ops->name,
            tp->n_blocks);
    *out = tp->slots[0].r;
    return 0;
fail:
    kvs_tp_free(tp);
    return rc;
}

int kvs_tp_forward(struct kvs_tp *tp, const struct kvs_batch *b, float *logits)
{
    tp->batch = b;
    tp->logits = logits;
    int rc = run_all(tp, JOB_FORWARD, NULL);
    tp->batch = NULL;
    tp->logits = NULL;
    {   /* the rows the fidelity meter sampled (none when the step failed before its layers) */
        struct kvs_runner *ranks[16], **rs = tp->n <= 16 ? ranks : kvs_xcalloc((size_t)tp->n, sizeof *rs);
        for (int i = 0; i < tp->n; i++) rs[i] = tp->slots[i].r;
        kvs_runner_rank_fidelity_merge(rs, tp->n);
        if (rs != ranks) free(rs);
    }
    if (rc < 0 || !b->argmax) return rc;
    /* greedy rows: the largest of the ranks' picks; a lower rank (lower ids) wins a tie */
    struct kvs_rank_picks p0;
    kvs_runner_rank_picks(tp->slots[0].r, &p0);
    for (int k = 0; k < p0.n; k++) {
        int32_t best = -1;
        float bv = 0.0f;
        for (int i = 0; i < tp->n; i++) {
            struct kvs_rank_picks p;
            kvs_runner_rank_picks(tp->slots[i].r, &p);
            if (p.ids[k] < 0) continue;
            if (best < 0 || p.vals[k] > bv) {
                best = p.ids[k] + p.vocab_lo;
                bv = p.vals[k];
            }
        }
        b->argmax[p0.lout[k]] = best;
    }
    return 0;
}

int kvs_tp_copy_block(struct kvs_tp *tp, int32_t src, int32_t dst)
{
    tp->a = src;
    tp->b = dst;
    return run_all(tp, JOB_COPY_BLOCK, NULL);
}

void kvs_tp_seq_end(struct kvs_tp *tp, int slot)
{
    tp->a = slot;
    run_all(tp, JOB_SEQ_END, NULL);
}

/* How a counter of the ranks merges into the group's (kvs_tp_kv_counters):
 *   MERGE_SUM   it covers only the rank's heads, so the group's is the sum: every byte count
 *               (read, held or per token: each rank reads and holds its heads' share), per-head
 *               tallies and pages (each rank has its own page manager: LeanKV dynamic);
 *   MERGE_MEAN  a fraction over (token, layer, KV head): every rank has the same number of
 *               heads, so the group's is the mean of the ranks';
 *   MERGE_RANK0 the same on every rank (rows, requests, page counts per row): rank 0's;
 * and the ratios of summed counters are recomputed from the sums (RATIOS). The fidelity
 * histogram is merged per row before it is counted (runner_tp.h). A strategy adding a per-head
 * tally or fraction names it here; tests/unit/test_tp_kv.c checks every counter at TP N against
 * TP 1's. */
enum { MERGE_RANK0 = 0, MERGE_SUM, MERGE_MEAN };

static int merge_kind(const struct kvs_kv_counter *c)
{
    static const char *const sums[] = {
        "kvserve:kv_mac_lookups_total",          "kvserve:kv_mac_hits_total",
        "kvserve:kv_mac_skip_sum",               "kvserve:kv_mac_skip_count",
        "kvserve:kv_retro_keys_own_total",       "kvserve:kv_retro_keys_supplement_total",
        "kvserve:kv_retro_keys_skipped_total",
        "kvserve:kv_paris_recall_total",         "kvserve:kv_paris_recall_hits_total",
        "kvserve:kv_paris_recall_coarse_hits_total", "kvserve:kv_quest_stale_digests_total",
        "kvserve:kv_storage_pages_used",         "kvserve:kv_storage_pages_total",
    };
    static const char *const means[] = {
        "kvserve:kv_storage_high_fraction", "kvserve:kv_storage_low_fraction", "kvserve:kv_storage_pruned_fraction",
    };
    if (c->family) return MERGE_RANK0;
    if (strstr(c->name, "bytes")) return MERGE_SUM;
    for (size_t i = 0; i < sizeof sums / sizeof sums[0]; i++)
        if (!strcmp(c->name, sums[i])) return MERGE_SUM;
    for (size_t i = 0; i < sizeof means / sizeof means[0]; i++)
        if (!strcmp(c->name, means[i])) return MERGE_MEAN;
    return MERGE_RANK0;
}

/* ratio = (num + add) / den of the group's sums (add: -1 when none) */
static const struct {
    const char *ratio, *num, *add, *den;
} RATIOS[] = {
    {"kvserve:kv_retro_effective_budget", "kvserve:kv_retro_keys_own_total", "kvserve:kv_retro_keys_supplement_total",
     "kvserve:kv_retro_keys_own_total"},
    {"kvserve:kv_storage_compression_ratio", "kvserve:kv_storage_bf16_bytes_per_token", NULL,
     "kvserve:kv_storage_bytes_per_token"},
};

static int find_counter(const struct kvs_kv_counter *c, int n, const char *name)
{
    for (int k = 0; name && k < n; k++)
        if (!strcmp(c[k].name, name) && !c[k].le) return k;
    return -1;
}

int kvs_tp_kv_counters(struct kvs_tp *tp, struct kvs_kv_counter *out, int cap)
{
    tp->a = cap < 2 * KVS_KV_MAX_COUNTERS ? cap : 2 * KVS_KV_MAX_COUNTERS;
    if (tp->a <= 0) return 0;
    run_all(tp, JOB_COUNTERS, NULL);
    /* every rank runs the same policy and storage with the same settings, so their lists name
     * the same counters in the same order */
    const struct rank_slot *s0 = &tp->slots[0];
    const int n = s0->n_cnt;
    memcpy(out, s0->cnt, (size_t)n * sizeof *out);
    for (int k = 0; k < n; k++) {
        const int kind = merge_kind(&out[k]);
        if (kind == MERGE_RANK0) continue;
        for (int i = 1; i < tp->n; i++) {
            const struct rank_slot *s = &tp->slots[i];
            if (k >= s->n_cnt || strcmp(s->cnt[k].name, out[k].name)) {
                kvs_log(KVS_LOG_WARN, "runner: rank %d reports other KV counters than rank 0 (%s)", i, out[k].name);
                continue;
            }
            out[k].value += s->cnt[k].value;
        }
        if (kind == MERGE_MEAN) out[k].value /= tp->n;
    }
    for (size_t i = 0; i < sizeof RATIOS / sizeof RATIOS[0]; i++) {
        const int r = find_counter(out, n, RATIOS[i].ratio), a = find_counter(out, n, RATIOS[i].num);
        const int b = find_counter(out, n, RATIOS[i].add), d = find_counter(out, n, RATIOS[i].den);
        if (r >= 0 && a >= 0 && d >= 0 && (b >= 0 || !RATIOS[i].add) && out[d].value > 0)
            out[r].value = (out[a].value + (b >= 0 ? out[b].value : 0)) / out[d].value;
    }
    return n;
}
