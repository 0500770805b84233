/* kv_test_policies.h: two decode policies that exist only for the tests of the KV seam
 * (engine/kv/kv.h), registered at run time with kvs_kv_register_decode, the way an out-of-tree
 * strategy would plug in:
 *   test_spans   exact: every row attends one span [0, ctx) through the backend's
 *                attention_spans (kernels/backend.h), which must give attention()'s bits;
 *                keeps a per-request step count in its arena slot, asks for the lse scratch,
 *                counts plans, inits and frees.
 *   test_window  approximate: decode rows attend the first test_window_sink positions and the
 *                last test_window_w ones (a sliding window with attention sinks); neutral when
 *                the window covers the context. Reports the KV bytes it read.
 * Header-only (static), one copy per test program. */
#ifndef KVS_TEST_KV_POLICIES_H
#define KVS_TEST_KV_POLICIES_H

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "engine/kv/kv.h"

static int test_window_w = 1 << 30, test_window_sink = 0;
static int tp_inits, tp_frees, tp_plans;

struct tp_state {
    struct kvs_kv_decode_env env;
    int window;                   /* 0: test_spans (one full span) */
    struct kvs_dbuf *d_n, *d_sp;  /* I32 [max_rows][nkv], [max_rows][nkv][2][2] */
    int32_t *h_n, *h_sp;
    double bytes_read;
    uint64_t steps;
};

static int tp_create_common(const struct kvs_kv_decode_env *env, int window, void **state, char *err, size_t errlen)
{
    if (!env->o->attention_spans) return kvs_err(err, errlen, -ENOSYS, "backend %s has no attention_spans", env->o->name);
    struct tp_state *s = calloc(1, sizeof *s);
    if (!s) return -ENOMEM;
    s->env = *env;
    s->window = window;
    size_t rows = (size_t)env->max_rows, nkv = (size_t)env->n_kv_heads;
    s->d_n = env->o->alloc(env->be, KVS_BUF_I32, rows * nkv);
    s->d_sp = env->o->alloc(env->be, KVS_BUF_I32, rows * nkv * 4);
    s->h_n = calloc(rows * nkv, sizeof *s->h_n);
    s->h_sp = calloc(rows * nkv * 4, sizeof *s->h_sp);
    if (!s->d_n || !s->d_sp || !s->h_n || !s->h_sp) return kvs_err(err, errlen, -ENOMEM, "test policy: no memory");
    *state = s;
    return 0;
}

static int tp_spans_create(const struct kvs_kv_decode_env *env, void **state, char *err, size_t errlen)
{
    return tp_create_common(env, 0, state, err, errlen);
}

static int tp_window_create(const struct kvs_kv_decode_env *env, void **state, char *err, size_t errlen)
{
    return tp_create_common(env, 1, state, err, errlen);
}

static void tp_destroy(void *state)
{
    struct tp_state *s = state;
    s->env.o->free_buf(s->env.be, s->d_n);
    s->env.o->free_buf(s->env.be, s->d_sp);
    free(s->h_n);
    free(s->h_sp);
    free(s);
}

static size_t tp_seq_bytes(void *state)
{
    (void)state;
    return sizeof(uint64_t);
}

static int tp_seq_init(void *state, int slot, void *mem)
{
    (void)state, (void)slot;
    if (!mem || *(uint64_t *)mem != 0) return -EINVAL;   /* the arena hands out zeroed slots */
    tp_inits++;
    return 0;
}

static void tp_seq_free(void *state, int slot)
{
    (void)state, (void)slot;
    tp_frees++;
}

/* the spans of every row, the same for each layer: built once per step */
static int tp_plan(void *state, const struct kvs_kv_step *st)
{
    struct tp_state *s = state;
    const int nkv = s->env.n_kv_heads;
    tp_plans++;
    s->steps++;
    for (int q = 0; q < st->n_seqs; q++)
        for (int t = st->h_q_start[q]; t < st->h_q_start[q + 1]; t++) {
            const int ctx = st->h_pos[q] + (t - st->h_q_start[q]) + 1;
            for (int g = 0; g < nkv; g++) {
                int32_t *sp = s->h_sp + ((size_t)t * nkv + g) * 4;
                int n = 1;
                sp[0] = 0, sp[1] = ctx;
                if (s->window && st->h_decode[q] && test_window_sink + test_window_w < ctx) {
                    sp[1] = test_window_sink;
                    sp[2] = ctx - test_window_w, sp[3] = ctx;
                    n = test_window_sink > 0 ? 2 : 1;
                    if (test_window_sink == 0) sp[0] = sp[2], sp[1] = sp[3];
                }
                s->h_n[(size_t)t * nkv + g] = n;
                if (st->h_decode[q] && g == 0) {
                    int read = 0;
                    for (int k = 0; k < n; k++) read += sp[2 * k + 1] - sp[2 * k];
                    s->bytes_read += (double)read * (double)s->env.kv_bytes_per_token;
                }
            }
        }
    s->env.o->upload(s->env.be, s->d_n, 0, s->h_n, (size_t)st->n_rows * nkv);
    s->env.o->upload(s->env.be, s->d_sp, 0, s->h_sp, (size_t)st->n_rows * nkv * 4);
    return 0;
}

static void tp_attend(void *state, int layer, const struct kvs_kv_attend *a)
{
    (void)layer;
    struct tp_state *s = state;
    const struct kvs_span_list sp = {2, s->d_n, s->d_sp, s->h_n, s->h_sp};
    s->env.o->attention_spans(s->env.be, a->q, a->kv.k, a->kv.v, a->step->m, &sp, a->step->n_rows, a->n_heads,
                              a->n_kv_heads, a->head_dim, a->block_size, a->scale, a->out, a->lse);
}

static int tp_counters(void *state, struct kvs_kv_counter *out, int cap)
{
    struct tp_state *s = state;
    if (cap < 2) return 0;
    out[0] = (struct kvs_kv_counter){"kvserve:kv_decode_bytes_read_total", "KV bytes the decode policy read.", 1,
                                     s->bytes_read, NULL, NULL};
    out[1] = (struct kvs_kv_counter){"kvserve:kv_test_policy_steps_total", "Steps the test policy planned.", 1,
                                     (double)s->steps, NULL, NULL};
    return 2;
}

static const struct kvs_kv_decode_ops tp_spans_ops = {
    .name = "test_spans", .exact = 1, .needs = KVS_KV_NEEDS_LSE | KVS_KV_NO_GRAPHS, .rows_per_seq = 1,
    .create = tp_spans_create, .destroy = tp_destroy, .seq_bytes = tp_seq_bytes, .seq_init = tp_seq_init,
    .seq_free = tp_seq_free, .plan = tp_plan, .attend = tp_attend, .counters = tp_counters,
};

static const struct kvs_kv_decode_ops tp_window_ops = {
    .name = "test_window", .exact = 0, .needs = KVS_KV_NEEDS_LSE | KVS_KV_NO_GRAPHS, .rows_per_seq = 1,
    .create = tp_window_create, .destroy = tp_destroy, .plan = tp_plan, .attend = tp_attend, .counters = tp_counters,
};

/* registers both (once per program) */
static inline void kvs_test_register_policies(void)
{
    static int done;
    if (done) return;
    done = 1;
    if (kvs_kv_register_decode(&tp_spans_ops) || kvs_kv_register_decode(&tp_window_ops)) abort();
}

#endif
