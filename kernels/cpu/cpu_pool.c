/* cpu_pool.c: fixed pthread pool (see cpu_pool.h). A job is published with a generation counter
 * so a worker never runs one twice. Between jobs a worker may spin on the counter for a while
 * (opt-in, see SPIN_ROUNDS_DEFAULT), then sleeps on a condition variable; the caller waits for
 * the workers the same way. */
#include "kernels/cpu/cpu_pool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

#include "base/util.h"

#define MAX_THREADS 256
/* pause instructions before sleeping: KVS_CPU_SPIN (default 0 = sleep at once). Spinning is a
 * loss on an oversubscribed machine: a spinning thread burns the time slice its descheduled
 * partner needs. Measured on the shared 2-core machine at load 10 (bench/RESULTS.md): 1,000
 * rounds doubled the decode step (8.6 -> 16.5 ms), 20,000 made it 15x slower. On cores of its
 * own a few thousand rounds save the futex wake-up and context switch per op (~15% of a
 * single-stream decode step in perf). */
#define SPIN_ROUNDS_DEFAULT 0

struct kvs_cpu_pool {
    int n_threads;                /* including the caller */
    int spin;                     /* pause rounds before sleeping */
    double min_work;              /* kvs_cpu_pool_run_sized runs smaller jobs inline */
    pthread_t threads[MAX_THREADS];
    int n_started;
    pthread_mutex_t lock;
    pthread_cond_t work_cv;       /* workers wait for a new generation */
    pthread_cond_t done_cv;       /* the caller waits for n_busy == 0 */
    atomic_ulong generation;      /* written under lock, read by spinning workers without it */
    atomic_int n_busy;            /* workers still running the current job */
    atomic_int stop;
    atomic_int next_task;         /* the next unclaimed task of the current job */
    /* current job */
    int n_tasks;
    kvs_cpu_task_fn fn;
    void *ctx;
};

/* Every thread claims the next task until none is left (an atomic counter), so a thread that
 * finishes early, or runs while its partner is descheduled by other processes, takes over the
 * rest: static halves waited for the slower thread, and split causal attention 1/4 : 3/4 (the
 * later query tiles read more keys; bench/RESULTS.md). Which thread runs a task never changes
 * a result (each task writes its own outputs). */
static void run_range(struct kvs_cpu_pool *p, int index)
{
    (void)index;
    for (;;) {
        const int t = atomic_fetch_add(&p->next_task, 1);
        if (t >= p->n_tasks) break;
        p->fn(p->ctx, t);
    }
}

struct worker_start {
    struct kvs_cpu_pool *pool;
    int index;                    /* 1 .. n_threads-1; the caller runs range 0 */
};

static void *worker_main(void *arg)
{
    struct worker_start *ws = arg;
    struct kvs_cpu_pool *p = ws->pool;
    int index = ws->index;
    free(ws);
    unsigned long seen = 0;
    for (;;) {
        for (int i = 0; i < p->spin && atomic_load(&p->generation) == seen && !atomic_load(&p->stop); i++)
            CPU_RELAX();
        if (atomic_load(&p->generation) == seen) {
            pthread_mutex_lock(&p->lock);
            while (!atomic_load(&p->stop) && atomic_load(&p->generation) == seen)
                pthread_cond_wait(&p->work_cv, &p->lock);
            pthread_mutex_unlock(&p->lock);
        }
        if (atomic_load(&p->stop)) break;
        seen = atomic_load(&p->generation);   /* the job fields were written before it (seq_cst) */
        run_range(p, index);
        if (atomic_fetch_sub(&p->n_busy, 1) == 1) {
            /* the last one: wake the caller should it be asleep (it checks n_busy under the lock) */
            pthread_mutex_lock(&p->lock);
            pthread_cond_signal(&p->done_cv);
            pthread_mutex_unlock(&p->lock);
        }
    }
    return NULL;
}

struct kvs_cpu_pool *kvs_cpu_pool_create(int n_threads, char *err, size_t errlen)
{
    if (n_threads <= 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = n > 0 ? (int)n : 1;
    }
    if (n_threads > MAX_THREADS) n_threads = MAX_THREADS;
    struct kvs_cpu_pool *p = kvs_xcalloc(1, sizeof *p);
    p->n_threads = n_threads;
    const char *e = getenv("KVS_CPU_SPIN");
    p->spin = e && *e ? atoi(e) : SPIN_ROUNDS_DEFAULT;
    if (p->spin < 0) p->spin = 0;
    e = getenv("KVS_CPU_MIN_WORK");
    p->min_work = e && *e ? atof(e) : KVS_CPU_MIN_WORK_DEFAULT;
    pthread_mutex_init(&p->lock, NULL);
    pthread_cond_init(&p->work_cv, NULL);
    pthread_cond_init(&p->done_cv, NULL);
    for (int i = 1; i < n_threads; i++) {
        struct worker_start *ws = kvs_xmalloc(sizeof *ws);
        ws->pool = p;
        ws->index = i;
        int rc = pthread_create(&p->threads[i], NULL, worker_main, ws);
        if (rc != 0) {
            free(ws);
            kvs_err(err, errlen, -rc, "cpu backend: cannot start worker thread %d: %s", i, strerror(rc));
            p->n_threads = p->n_started + 1;
            kvs_cpu_pool_free(p);
            return NULL;
        }
        p->n_started++;
    }
    return p;
}

void kvs_cpu_pool_free(struct kvs_cpu_pool *p)
{
    if (!p) return;
    pthread_mutex_lock(&p->lock);
    atomic_store(&p->stop, 1);
    pthread_cond_broadcast(&p->work_cv);
    pthread_mutex_unlock(&p->lock);
    for (int i = 1; i <= p->n_started; i++) pthread_join(p->threads[i], NULL);
    pthread_cond_destroy(&p->work_cv);
    pthread_cond_destroy(&p->done_cv);
    pthread_mutex_destroy(&p->lock);
    free(p);
}

int kvs_cpu_pool_threads(const struct kvs_cpu_pool *p) { return p->n_threads; }

void kvs_cpu_pool_run(struct kvs_cpu_pool *p, int n_tasks, kvs_cpu_task_fn fn, void *ctx)
{
    if (n_tasks <= 0) return;
    /* small jobs are not worth a wake-up */
    if (p->n_threads == 1 || n_tasks == 1) {
        for (int t = 0; t < n_tasks; t++) fn(ctx, t);
        return;
    }
    pthread_mutex_lock(&p->lock);
    p->n_tasks = n_tasks;
    p->fn = fn;
    p->ctx = ctx;
    atomic_store(&p->next_task, 0);
    atomic_store(&p->n_busy, p->n_threads - 1);
    atomic_fetch_add(&p->generation, 1);
    pthread_cond_broadcast(&p->work_cv);
    pthread_mutex_unlock(&p->lock);
    run_range(p, 0);
    for (int i = 0; i < p->spin && atomic_load(&p->n_busy) > 0; i++) CPU_RELAX();
    if (atomic_load(&p->n_busy) > 0) {
        pthread_mutex_lock(&p->lock);
        while (atomic_load(&p->n_busy) > 0) pthread_cond_wait(&p->done_cv, &p->lock);
        pthread_mutex_unlock(&p->lock);
    }
}

void kvs_cpu_pool_run_sized(struct kvs_cpu_pool *p, int n_tasks, double work, kvs_cpu_task_fn fn, void *ctx)
{
    if (work < p->min_work) {
        for (int t = 0; t < n_tasks; t++) fn(ctx, t);
        return;
    }
    kvs_cpu_pool_run(p, n_tasks, fn, ctx);
}
