/* cpu_pool.h: a small fixed pthread pool for the CPU backend's parallel loops.
 *
 * kvs_cpu_pool_run(pool, n_tasks, fn, ctx) calls fn(ctx, task) once for every task in
 * [0, n_tasks) spread over the workers and the calling thread, and returns when all are done.
 * Threads claim tasks in increasing order, one at a time, from a shared counter (so uneven tasks
 * and a descheduled thread balance out), but nothing may depend on which thread runs a task:
 * every op computes each task's output independently, so results never depend on the thread
 * count or the schedule.
 *
 * Ownership: create/free pair; the pool is used by one caller thread at a time (the runner's).
 * Errors: create returns NULL + message when a thread cannot be started.
 */
#ifndef KVS_CPU_POOL_H
#define KVS_CPU_POOL_H

#include <stddef.h>

struct kvs_cpu_pool;

typedef void (*kvs_cpu_task_fn)(void *ctx, int task);

/* n_threads total including the caller (0 = number of online cores). */
struct kvs_cpu_pool *kvs_cpu_pool_create(int n_threads, char *err, size_t errlen);
void kvs_cpu_pool_free(struct kvs_cpu_pool *p);
int kvs_cpu_pool_threads(const struct kvs_cpu_pool *p);
void kvs_cpu_pool_run(struct kvs_cpu_pool *p, int n_tasks, kvs_cpu_task_fn fn, void *ctx);
/* The same, but a job of less than the pool's minimum work (KVS_CPU_MIN_WORK, default
 * KVS_CPU_MIN_WORK_DEFAULT; work in multiply-adds or element steps, the caller's estimate) runs
 * on the calling thread alone: waking a sleeping worker (a futex wake and a context switch,
 * longer when other processes hold the cores) costs more than such a job. Results are the
 * same either way (no op's bits depend on the thread count). */
#define KVS_CPU_MIN_WORK_DEFAULT 524288.0
void kvs_cpu_pool_run_sized(struct kvs_cpu_pool *p, int n_tasks, double work, kvs_cpu_task_fn fn, void *ctx);

#endif
