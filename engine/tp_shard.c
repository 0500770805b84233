/* tp_shard.c: one rank's slice of a model tensor (engine/tp_shard.h). */
#include "engine/tp_shard.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "base/util.h"

static size_t dtype_bytes(enum kvs_dtype d) { return d == KVS_DTYPE_F32 ? 4 : 2; }

int kvs_tp_shard(const struct kvs_tensor_view *t, enum kvs_split split, int rank, int n_ranks, int vocab,
                 struct kvs_tensor_view *out, void **owned, char *err, size_t errlen)
{
    *out = *t;
    *owned = NULL;
    if (split == KVS_SPLIT_WHOLE || n_ranks == 1) return 0;
    const size_t es = dtype_bytes(t->dtype);
    const int64_t rows = t->ndim == 2 ? t->shape[0] : 1, cols = t->ndim == 2 ? t->shape[1] : t->shape[0];
    const unsigned char *src = t->data;
    if (t->ndim != 1 && t->ndim != 2) return kvs_err(err, errlen, -EINVAL, "tp: tensor of %d dims", t->ndim);
    if (split == KVS_SPLIT_ROWS && t->ndim == 1) {
        if (cols % n_ranks) goto uneven;
        const int64_t part = cols / n_ranks;
        out->shape[0] = part;
        out->data = src + (size_t)(rank * part) * es;
        out->nbytes = (size_t)part * es;
        return 0;
    }
    if (t->ndim != 2) return kvs_err(err, errlen, -EINVAL, "tp: split of a vector other than by rows");
    if (split == KVS_SPLIT_ROWS || split == KVS_SPLIT_VOCAB) {
        int64_t lo, hi;
        if (split == KVS_SPLIT_ROWS) {
            if (rows % n_ranks) goto uneven;
            lo = rows / n_ranks * rank;
            hi = lo + rows / n_ranks;
        } else {
            if (rows != vocab) goto uneven;
            lo = kvs_tp_vocab_lo(vocab, rank, n_ranks);
            hi = kvs_tp_vocab_lo(vocab, rank + 1, n_ranks);
        }
        out->shape[0] = hi - lo;
        out->data = src + (size_t)(lo * cols) * es;
        out->nbytes = (size_t)((hi - lo) * cols) * es;
        return 0;
    }
    if (split == KVS_SPLIT_COLS) {
        if (cols % n_ranks) goto uneven;
        const int64_t part = cols / n_ranks;
        unsigned char *dst = malloc((size_t)(rows * part) * es);
        if (!dst) return kvs_err(err, errlen, -ENOMEM, "tp: no host memory for a column slice");
        for (int64_t i = 0; i < rows; i++)
            memcpy(dst + (size_t)(i * part) * es, src + (size_t)(i * cols + rank * part) * es, (size_t)part * es);
        out->shape[1] = part;
        out->data = dst;
        out->nbytes = (size_t)(rows * part) * es;
        *owned = dst;
        return 0;
    }
    /* KVS_SPLIT_VOCAB_EMBED */
    if (rows != vocab) goto uneven;
    const int64_t lo = kvs_tp_vocab_lo(vocab, rank, n_ranks), hi = kvs_tp_vocab_lo(vocab, rank + 1, n_ranks);
    const size_t body = (size_t)((hi - lo) * cols) * es;
    unsigned char *dst = malloc(body + (size_t)cols * es);
    if (!dst) return kvs_err(err, errlen, -ENOMEM, "tp: no host memory for the embedding slice");
    memcpy(dst, src + (size_t)(lo * cols) * es, body);
    memset(dst + body, 0, (size_t)cols * es); /* +0.0 in f32, f16 and bf16 alike */
    out->shape[0] = hi - lo + 1;
    out->data = dst;
    out->nbytes = body + (size_t)cols * es;
    *owned = dst;
    return 0;
uneven:
    return kvs_err(err, errlen, -EINVAL, "tp: a [%lld x %lld] tensor does not split over %d ranks", (long long)rows,
                   (long long)cols, n_ranks);
}
