/* kv_decode_full.c: kv.decode=full: exact attention over every block, through the backend's
 * paged attention op (prefill and decode rows in one call). No per-request state, nothing to
 * plan, step graphs allowed. Every other policy must reduce to this one at its neutral
 * setting (tests/unit/test_kv_policies.c). */
#include "engine/kv/kv.h"

#include <errno.h>
#include <stdlib.h>

struct full {
    const struct kvs_backend_ops *o;
    struct kvs_backend *be;
};


static int full_create(const struct kvs_kv_decode_env *env, void **state, char *err, size_t errlen)
{
    (void)err, (void)errlen;
    struct full *f = calloc(1, sizeof *f);
    if (!f) return -ENOMEM;
    f->o = env->o;
    f->be = env->be;
    *state = f;
    return 0;
}

static void full_destroy(void *state) { free(state); }

static void full_attend(void *state, int layer, const struct kvs_kv_attend *a)
{
    (void)layer;
    const struct full *f = state;
    f->o->attention(f->be, a->q, a->kv.k, a->kv.v, a->step->m, a->step->n_rows, a->n_heads, a->n_kv_heads, a->head_dim,
                    a->block_size, a->scale, a->out);
}

const struct kvs_kv_decode_ops kvs_kv_decode_full = {
    .name = "full",
    .exact = 1,
    .rows_per_seq = 1,
    .create = full_create,
    .destroy = full_destroy,
    .attend = full_attend,
};
