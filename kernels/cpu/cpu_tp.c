/* cpu_tp.c: the CPU backend as ranks of a tensor-parallel group (kernels/backend.h's tensor-
 * parallel section; engine/runner_tp.c drives it): a host all-reduce between threads, so CI runs
 * the same sharding and reductions as the NCCL path does on GPUs.
 *
 * allreduce_sum: each rank copies its buffer into its slot of the group's scratch, waits for all
 * (barrier), then sums the slots in rank order 0 .. n-1 into its own buffer, and waits again
 * (so that no rank's next all-reduce overwrites a slot another is still reading). Every rank
 * sums the same values in the same order: all end bitwise equal, and a run is deterministic.
 * The group is shared by its ranks' backends and freed with the last of them.
 */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "base/util.h"
#include "kernels/cpu/cpu_internal.h"
#include "kernels/cpu/cpu_pool.h"

struct kvs_cpu_tp_group {
    int n_ranks;
    int refs;                     /* backends still in the group (under lock) */
    pthread_mutex_t lock;
    pthread_barrier_t barrier;
    size_t max_elems;
    float *slots;                 /* [n_ranks][max_elems] */
};

int kvs_cpu_tp_group(struct kvs_backend *const *bs, int n, size_t max_elems, char *err, size_t errlen)
{
    if (n < 2 || !max_elems) return kvs_err(err, errlen, -EINVAL, "cpu tp: a group needs 2+ ranks and a size");
    for (int i = 0; i < n; i++)
        if (bs[i]->tp) return kvs_err(err, errlen, -EINVAL, "cpu tp: rank %d is already in a group", i);
    struct kvs_cpu_tp_group *g = kvs_xcalloc(1, sizeof *g);
    g->slots = malloc((size_t)n * max_elems * sizeof(float));
    if (!g->slots) {
        free(g);
        return kvs_err(err, errlen, -ENOMEM, "cpu tp: no memory for the all-reduce scratch (%d x %zu floats)", n,
                       max_elems);
    }
    if (pthread_barrier_init(&g->barrier, NULL, (unsigned)n) != 0) {
        free(g->slots);
        free(g);
        return kvs_err(err, errlen, -ENOMEM, "cpu tp: pthread_barrier_init failed");
    }
    pthread_mutex_init(&g->lock, NULL);
    g->n_ranks = n;
    g->refs = n;
    g->max_elems = max_elems;
    for (int i = 0; i < n; i++) {
        bs[i]->tp = g;
        bs[i]->tp_rank = i;
    }
    return 0;
}

void kvs_cpu_tp_leave(struct kvs_backend *b)
{
    struct kvs_cpu_tp_group *g = b->tp;
    if (!g) return;
    b->tp = NULL;
    pthread_mutex_lock(&g->lock);
    const int last = --g->refs == 0;
    pthread_mutex_unlock(&g->lock);
    if (!last) return;
    pthread_barrier_destroy(&g->barrier);
    pthread_mutex_destroy(&g->lock);
    free(g->slots);
    free(g);
}

struct sum_job {
    const float *slots;
    size_t stride, n, per_task;
    int n_ranks;
    float *out;
};

static void sum_task(void *c, int t)
{
    const struct sum_job *j = c;
    const size_t lo = (size_t)t * j->per_task, hi = lo + j->per_task < j->n ? lo + j->per_task : j->n;
    for (size_t i = lo; i < hi; i++) {
        float s = j->slots[i];
        for (int r = 1; r < j->n_ranks; r++) s += j->slots[(size_t)r * j->stride + i];
        j->out[i] = s;
    }
}

void kvs_cpu_allreduce_sum(struct kvs_backend *b, struct kvs_dbuf *buf, size_t n)
{
    struct kvs_cpu_tp_group *g = b->tp;
    KVS_ASSERT(g && n <= g->max_elems && n <= buf->n);
    memcpy(g->slots + (size_t)b->tp_rank * g->max_elems, buf->data, n * sizeof(float));
    pthread_barrier_wait(&g->barrier);
    const size_t per = 4096, tasks = (n + per - 1) / per;
    struct sum_job j = {g->slots, g->max_elems, n, per, g->n_ranks, F(buf)};
    if (tasks) kvs_cpu_pool_run(b->pool, (int)tasks, sum_task, &j);
    pthread_barrier_wait(&g->barrier);
}

struct argmax_val_job {
    const float *x;
    int vocab;
    int32_t *out;
    float *vals;
};

static void argmax_val_task(void *c, int t)
{
    const struct argmax_val_job *j = c;
    const float *row = j->x + (size_t)t * j->vocab;
    const int32_t id = kvs_argmax_row(row, j->vocab);
    j->out[t] = id;
    j->vals[t] = id >= 0 ? row[id] : -INFINITY;
}

void kvs_cpu_argmax_rows_val(struct kvs_backend *b, const struct kvs_dbuf *logits, int m, int vocab,
                             struct kvs_dbuf *out, struct kvs_dbuf *vals, size_t out_off)
{
    if (m <= 0) return;
    KVS_ASSERT((size_t)m * vocab <= logits->n && out_off + (size_t)m <= out->n && out_off + (size_t)m <= vals->n);
    struct argmax_val_job j = {F(logits), vocab, I(out) + out_off, F(vals) + out_off};
    kvs_cpu_pool_run(b->pool, m, argmax_val_task, &j);
}
