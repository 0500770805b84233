/* kv_storage_dense.c: kv.storage = auto / f32 / bf16: K and V stored as they are computed, in the
 * backend's native KV element type (backend.h KVS_BUF_KV: fp32 on the cpu backend, bf16 on
 * cuda), one buffer per layer for K and one for V, [n_blocks][n_kv_heads][block_size][head_dim].
 * "f32" and "bf16" name the element type they require and refuse a backend that stores another
 * (the bytes would not be what the config says); "auto" takes the backend's. */
#include "engine/kv/kv.h"

#include <stdlib.h>

#include "base/util.h"

struct dense {
    const struct kvs_backend_ops *o;
    struct kvs_backend *be;
    struct kvs_kv_shape sh;
    struct kvs_dbuf **k, **v;     /* [n_layers] */
};

static void dense_block_bytes(const struct kvs_kv_shape *sh, const struct kvs_backend_ops *o, struct kvs_backend *be,
                              size_t *k_bytes, size_t *v_bytes)
{
    size_t per = (size_t)sh->n_kv_heads * sh->block_size * sh->head_dim * o->elem_size(be, KVS_BUF_KV);
    *k_bytes = *v_bytes = per * (size_t)sh->n_layers;
}

static void dense_destroy(void *state)
{
    struct dense *d = state;
    if (!d) return;
    for (int l = 0; l < d->sh.n_layers; l++) {
        if (d->k) d->o->free_buf(d->be, d->k[l]);
        if (d->v) d->o->free_buf(d->be, d->v[l]);
    }
    free(d->k);
    free(d->v);
    free(d);
}

static int create_typed(size_t want_elem, const char *name, const struct kvs_kv_shape *sh, const struct kvs_backend_ops *o,
                        struct kvs_backend *be, int n_blocks, void **state, char *err, size_t errlen)
{
    size_t elem = o->elem_size(be, KVS_BUF_KV);
    if (want_elem && elem != want_elem)
        return kvs_err(err, errlen, -ENOSYS,
                       "config key 'kv.storage': \"%s\" is not what the %s backend stores (%zu-byte elements; use auto)",
                       name, o->name, elem);
    struct dense *d = calloc(1, sizeof *d);
    if (!d) return kvs_err(err, errlen, -ENOMEM, "kv storage: out of memory");
    d->o = o, d->be = be, d->sh = *sh;
    d->k = calloc((size_t)sh->n_layers, sizeof *d->k);
    d->v = calloc((size_t)sh->n_layers, sizeof *d->v);
    size_t n = (size_t)n_blocks * sh->n_kv_heads * sh->block_size * sh->head_dim;
    for (int l = 0; d->k && d->v && l < sh->n_layers; l++) {
        d->k[l] = o->alloc(be, KVS_BUF_KV, n);
        d->v[l] = o->alloc(be, KVS_BUF_KV, n);
        if (!d->k[l] || !d->v[l]) break;
    }
    if (!d->k || !d->v || !d->k[sh->n_layers - 1] || !d->v[sh->n_layers - 1]) {
        dense_destroy(d);
        return kvs_err(err, errlen, -ENOMEM, "kv storage: cannot allocate the KV pool (%d blocks, %zu bytes)", n_blocks,
                       2 * n * elem * (size_t)sh->n_layers);
    }
    *state = d;
    return 0;
}

static int create_auto(const struct kvs_kv_shape *sh, const struct kvs_backend_ops *o, struct kvs_backend *be,
                       int n_blocks, void **state, char *err, size_t errlen)
{
    return create_typed(0, "auto", sh, o, be, n_blocks, state, err, errlen);
}

static int create_f32(const struct kvs_kv_shape *sh, const struct kvs_backend_ops *o, struct kvs_backend *be,
                      int n_blocks, void **state, char *err, size_t errlen)
{
    return create_typed(4, "f32", sh, o, be, n_blocks, state, err, errlen);
}

static int create_bf16(const struct kvs_kv_shape *sh, const struct kvs_backend_ops *o, struct kvs_backend *be,
                       int n_blocks, void **state, char *err, size_t errlen)
{
    return create_typed(2, "bf16", sh, o, be, n_blocks, state, err, errlen);
}

static void dense_write(void *state, int layer, const struct kvs_dbuf *k, const struct kvs_dbuf *v,
                        const struct kvs_dbuf *slots, int n)
{
    struct dense *d = state;
    d->o->kv_write(d->be, k, v, slots, n, d->sh.n_kv_heads, d->sh.head_dim, d->sh.block_size, d->k[layer], d->v[layer]);
}

static void dense_view(void *state, int layer, struct kvs_kv_view *out)
{
    struct dense *d = state;
    out->k = d->k[layer];
    out->v = d->v[layer];
}

static void dense_copy_block(void *state, int32_t src, int32_t dst)
{
    struct dense *d = state;
    for (int l = 0; l < d->sh.n_layers; l++)
        d->o->kv_copy_block(d->be, d->k[l], d->v[l], src, dst, d->sh.n_kv_heads, d->sh.block_size, d->sh.head_dim);
}

#define DENSE_OPS(NAME, CREATE)                                                                                        \
    {                                                                                                                  \
        .name = NAME, .block_bytes = dense_block_bytes, .create = CREATE, .destroy = dense_destroy, .plain_view = 1,   \
        .write = dense_write, .view = dense_view, .copy_block = dense_copy_block,                                      \
    }
const struct kvs_kv_storage_ops kvs_kv_storage_auto = DENSE_OPS("auto", create_auto);
const struct kvs_kv_storage_ops kvs_kv_storage_f32 = DENSE_OPS("f32", create_f32);
const struct kvs_kv_storage_ops kvs_kv_storage_bf16 = DENSE_OPS("bf16", create_bf16);
