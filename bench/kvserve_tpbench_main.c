/* kvserve_tpbench_main.c: decode-step time of the runner at tensor-parallel sizes (parallel.tensor)
 * on one model directory, -> build/kvserve-tpbench.
 *
 * For each TP size and each (batch, context): batch sequences, each at position `context` of a
 * KV cache of its own blocks (contents as the pool holds them: a timing run needs the bytes read,
 * not their values), decode one token a step with greedy (ARGMAX) rows, as the engine's greedy
 * fast path does; the first steps record the step graph, then `iters` steps are timed on the host
 * clock (each step ends with the ids' download, so the clock sees the whole step) and the median
 * is printed. The table gives ms/step at each TP size and the ratio to TP 1, all in one run.
 * Then, for each TP size above 1 and each batch, the all-reduces alone: N backends of the same
 * kind (one thread each) run a step's worth of them (2 x layers + 1 of [batch][hidden] fp32),
 * eagerly, and the median time of such a step's all-reduces is printed with its share of the
 * measured step (an upper bound: in a recorded step graph they launch without host overhead).
 *
 * Usage: kvserve-tpbench MODEL_DIR [--tp 1,2] [--batches 1,32] [--contexts 1024] [--iters 30]
 *                        [--device cuda] [--markdown FILE]
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/util.h"
#include "engine/config.h"
#include "engine/runner.h"
#include "kernels/backend.h"
#include "models/model.h"

#define MAXL 16
#define BS 16

static int parse_list(const char *s, int *out, int cap)
{
    int n = 0;
    while (*s && n < cap) {
        out[n++] = atoi(s);
        const char *c = strchr(s, ',');
        if (!c) break;
        s = c + 1;
    }
    return n;
}

static double now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* median ms/step of batch x context on r; <0 on error */
static double time_steps(struct kvs_runner *r, int batch, int ctx, int iters)
{
    const int nb = ctx / BS + 1;
    if ((long long)batch * nb > kvs_runner_num_blocks(r)) return -ENOSPC;
    int32_t *bt = kvs_xmalloc((size_t)batch * nb * sizeof(int32_t)), tok[512], ids[512];
    struct kvs_batch_seq *qs = kvs_xcalloc((size_t)batch, sizeof *qs);
    for (int s = 0; s < batch; s++) {
        for (int j = 0; j < nb; j++) bt[(size_t)s * nb + j] = s * nb + j;
        tok[s] = 1 + s;
        qs[s] = (struct kvs_batch_seq){.tokens = &tok[s], .n_tokens = 1, .pos = ctx, .block_table = bt + (size_t)s * nb,
                                       .n_blocks = nb, .want_logits = KVS_LOGITS_ARGMAX, .slot = -1};
    }
    struct kvs_batch b = {qs, batch, ids};
    double *t = kvs_xmalloc((size_t)iters * sizeof(double)), med = 0;
    int rc = 0;
    for (int i = 0; i < 3 && !rc; i++) rc = kvs_runner_forward(r, &b, NULL);
    for (int i = 0; i < iters && !rc; i++) {
        double t0 = now_ms();
        rc = kvs_runner_forward(r, &b, NULL);
        t[i] = now_ms() - t0;
    }
    if (!rc) {
        qsort(t, (size_t)iters, sizeof *t, cmp_d);
        med = t[iters / 2];
    }
    free(t);
    free(qs);
    free(bt);
    return rc ? rc : med;
}

/* ---- the all-reduces alone ---------------------------------------------------------------- */

struct ar_rank {
    const struct kvs_backend_ops *o;
    struct kvs_backend *be;
    struct kvs_dbuf *buf;
    int rank, n_per_step, iters;
    size_t n;
    double *ms;                   /* [iters] */
    pthread_barrier_t *bar;
    char err[256];
    int ok;
};

static void *ar_main(void *arg)
{
    struct ar_rank *a = arg;
    a->be = a->o->create_device ? a->o->create_device(a->rank, 0, a->err, sizeof a->err) : a->o->create(1, a->err, sizeof a->err);
    pthread_barrier_wait(a->bar); /* all created (or not) */
    pthread_barrier_wait(a->bar); /* rank 0's thread joined them into a group */
    if (!a->ok) return NULL;
    a->buf = a->o->alloc(a->be, KVS_BUF_ACT, a->n);
    a->o->zero(a->be, a->buf, 0, a->n);
    for (int w = 0; w < 2; w++) a->o->allreduce_sum(a->be, a->buf, a->n);
    a->o->sync(a->be);
    for (int i = 0; i < a->iters; i++) {
        pthread_barrier_wait(a->bar);
        double t0 = now_ms();
        for (int k = 0; k < a->n_per_step; k++) a->o->allreduce_sum(a->be, a->buf, a->n);
        a->o->sync(a->be);
        a->ms[i] = now_ms() - t0;
    }
    a->o->free_buf(a->be, a->buf);
    return NULL;
}

/* median ms of n_per_step all-reduces of n elements over tp ranks (the slowest rank's); <0 on error */
static double time_allreduce(const char *device, int tp, size_t n, int n_per_step, int iters)
{
    char err[256];
    const struct kvs_backend_ops *o = kvs_backend_pick(device, err, sizeof err);
    if (!o || !o->tp_group) return -ENOSYS;
    struct ar_rank a[MAXL];
    pthread_t th[MAXL];
    pthread_barrier_t bar;
    pthread_barrier_init(&bar, NULL, (unsigned)tp);
    for (int i = 0; i < tp; i++) {
        a[i] = (struct ar_rank){.o = o, .rank = i, .n_per_step = n_per_step, .iters = iters, .n = n, .bar = &bar};
        a[i].ms = kvs_xcalloc((size_t)iters, sizeof(double));
        if (i && pthread_create(&th[i], NULL, ar_main, &a[i])) return -EAGAIN;
    }
    a[0].be = o->create_device ? o->create_device(0, 0, a[0].err, sizeof a[0].err) : o->create(1, a[0].err, sizeof a[0].err);
    pthread_barrier_wait(&bar);
    struct kvs_backend *bs[MAXL];
    int ok = 1;
    for (int i = 0; i < tp; i++) ok &= (bs[i] = a[i].be) != NULL;
    ok = ok && o->tp_group(bs, tp, n, err, sizeof err) == 0;
    if (!ok) fprintf(stderr, "all-reduce timing: %s\n", err);
    for (int i = 0; i < tp; i++) a[i].ok = ok;
    pthread_barrier_wait(&bar);
    if (ok) {
        a[0].buf = o->alloc(a[0].be, KVS_BUF_ACT, n);
        o->zero(a[0].be, a[0].buf, 0, n);
        for (int w = 0; w < 2; w++) o->allreduce_sum(a[0].be, a[0].buf, n);
        o->sync(a[0].be);
        for (int i = 0; i < iters; i++) {
            pthread_barrier_wait(&bar);
            double t0 = now_ms();
            for (int k = 0; k < n_per_step; k++) o->allreduce_sum(a[0].be, a[0].buf, n);
            o->sync(a[0].be);
            a[0].ms[i] = now_ms() - t0;
        }
        o->free_buf(a[0].be, a[0].buf);
    }
    for (int i = 1; i < tp; i++) pthread_join(th[i], NULL);
    double *worst = kvs_xcalloc((size_t)iters, sizeof(double)), med;
    for (int it = 0; it < iters; it++)
        for (int i = 0; i < tp; i++)
            if (a[i].ms[it] > worst[it]) worst[it] = a[i].ms[it];
    qsort(worst, (size_t)iters, sizeof *worst, cmp_d);
    med = worst[iters / 2];
    for (int i = 0; i < tp; i++) {
        if (a[i].be) o->free(a[i].be);
        free(a[i].ms);
    }
    free(worst);
    pthread_barrier_destroy(&bar);
    return ok ? med : -EIO;
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    int tps[MAXL] = {1, 2}, batches[MAXL] = {1, 32}, ctxs[MAXL] = {1024};
    int ntp = 2, nbatch = 2, nctx = 1, iters = 30;
    const char *dir = NULL, *md = NULL, *device = "cuda";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--tp") && i + 1 < argc) ntp = parse_list(argv[++i], tps, MAXL);
        else if (!strcmp(argv[i], "--batches") && i + 1 < argc) nbatch = parse_list(argv[++i], batches, MAXL);
        else if (!strcmp(argv[i], "--contexts") && i + 1 < argc) nctx = parse_list(argv[++i], ctxs, MAXL);
        else if (!strcmp(argv[i], "--iters") && i + 1 < argc) iters = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--device") && i + 1 < argc) device = argv[++i];
        else if (!strcmp(argv[i], "--markdown") && i + 1 < argc) md = argv[++i];
        else if (argv[i][0] != '-' && !dir) dir = argv[i];
        else {
            fprintf(stderr, "usage: %s MODEL_DIR [--tp 1,2] [--batches 1,32] [--contexts 1024] [--iters 30] "
                            "[--device cuda] [--markdown FILE]\n", argv[0]);
            return 2;
        }
    }
    if (!dir || iters < 1) {
        fprintf(stderr, "%s: a model directory is required\n", argv[0]);
        return 2;
    }
    char err[512];
    struct kvs_model *m = NULL;
    if (kvs_model_load(dir, &m, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    int maxb = 1, maxc = 1;
    for (int i = 0; i < nbatch; i++) maxb = batches[i] > maxb ? batches[i] : maxb;
    for (int i = 0; i < nctx; i++) maxc = ctxs[i] > maxc ? ctxs[i] : maxc;
    double ms[MAXL][MAXL][MAXL] = {{{0}}};
    for (int k = 0; k < ntp; k++) {
        struct kvs_config cfg;
        kvs_config_init(&cfg);
        char set[4][96];
        snprintf(set[0], sizeof set[0], "device=%s", device);
        snprintf(set[1], sizeof set[1], "parallel.tensor=%d", tps[k]);
        snprintf(set[2], sizeof set[2], "model.max_model_len=%d", maxc + BS);
        snprintf(set[3], sizeof set[3], "scheduler.max_running=%d", maxb);
        for (int i = 0; i < 4; i++)
            if (kvs_config_set(&cfg, set[i], err, sizeof err)) {
                fprintf(stderr, "%s\n", err);
                return 1;
            }
        cfg.kv_block_size = BS;
        cfg.max_batch_tokens = maxb > 64 ? maxb : 64;
        /* enough blocks for the largest shape and no more (the pool is split over the ranks) */
        const struct kvs_model_config *mc = kvs_model_config(m);
        const int es = strcmp(device, "cpu") == 0 ? 4 : 2; /* f32 / bf16 KV */
        cfg.kv_memory_bytes = (int64_t)maxb * (maxc / BS + 2) * BS * mc->n_layers * 2 * mc->n_kv_heads * mc->head_dim * es;
        struct kvs_runner *r = NULL;
        int rc = kvs_runner_create(&cfg, m, &r, err, sizeof err);
        kvs_config_free(&cfg);
        if (rc) {
            fprintf(stderr, "tp %d: %s\n", tps[k], err);
            return 1;
        }
        for (int bi = 0; bi < nbatch; bi++)
            for (int ci = 0; ci < nctx; ci++) {
                ms[k][bi][ci] = time_steps(r, batches[bi], ctxs[ci], iters);
                printf("tp %d batch %d context %d: %.3f ms/step\n", tps[k], batches[bi], ctxs[ci], ms[k][bi][ci]);
            }
        kvs_runner_free(r);
    }
    FILE *mf = md ? fopen(md, "w") : NULL;
    FILE *outs[2] = {stdout, mf};
    for (int o = 0; o < 2; o++) {
        FILE *f = outs[o];
        if (!f) continue;
        fprintf(f, "\n| batch | context |");
        for (int k = 0; k < ntp; k++) fprintf(f, " TP %d ms/step |", tps[k]);
        for (int k = 1; k < ntp; k++) fprintf(f, " TP %d / TP %d |", tps[k], tps[0]);
        fprintf(f, "\n| ---: | ---: |");
        for (int k = 0; k < 2 * ntp - 1; k++) fprintf(f, " ---: |");
        fprintf(f, "\n");
        for (int bi = 0; bi < nbatch; bi++)
            for (int ci = 0; ci < nctx; ci++) {
                fprintf(f, "| %d | %d |", batches[bi], ctxs[ci]);
                for (int k = 0; k < ntp; k++)
                    if (ms[k][bi][ci] > 0) fprintf(f, " %.3f |", ms[k][bi][ci]);
                    else fprintf(f, " failed (%s) |", strerror((int)-ms[k][bi][ci]));
                for (int k = 1; k < ntp; k++)
                    if (ms[k][bi][ci] > 0 && ms[0][bi][ci] > 0) fprintf(f, " %.3f |", ms[k][bi][ci] / ms[0][bi][ci]);
                    else fprintf(f, " - |");
                fprintf(f, "\n");
            }
    }
    /* the all-reduces of a step alone */
    const struct kvs_model_config *mc = kvs_model_config(m);
    for (int k = 0; k < ntp; k++) {
        if (tps[k] < 2) continue;
        for (int o = 0; o < 2; o++)
            if (outs[o])
                fprintf(outs[o], "\n| TP | batch | all-reduces a step | their ms (eager) | share of the step at context %d |\n"
                                 "| ---: | ---: | ---: | ---: | ---: |\n", ctxs[0]);
        for (int bi = 0; bi < nbatch; bi++) {
            const int per = 2 * mc->n_layers + 1;
            double t = time_allreduce(device, tps[k], (size_t)batches[bi] * mc->hidden_size, per, iters);
            for (int o = 0; o < 2; o++)
                if (outs[o])
                    fprintf(outs[o], "| %d | %d | %d x [%d][%d] fp32 | %.3f | %.1f%% |\n", tps[k], batches[bi], per,
                            batches[bi], mc->hidden_size, t, 100.0 * t / ms[k][bi][0]);
        }
    }
    if (mf) fclose(mf);
    kvs_model_free(m);
    return 0;
}
