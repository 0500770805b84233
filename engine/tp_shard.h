/* tp_shard.h: one rank's share of a model tensor under tensor parallelism (Megatron layout):
 * the slices engine/runner.c uploads on each rank of a parallel.tensor group.
 *
 *   KVS_SPLIT_WHOLE   the tensor itself (norms, q/k norms: replicated);
 *   KVS_SPLIT_ROWS    rows [r R/n, (r+1) R/n): q/k/v (by heads), gate/up and their biases (a 1-D
 *                     tensor is split by elements); a view into the mmap, nothing copied;
 *   KVS_SPLIT_COLS    columns [r C/n, (r+1) C/n) of every row: o_proj and down_proj, whose
 *                     partial products the runner sums over the ranks (all-reduce); a copy;
 *   KVS_SPLIT_VOCAB   rows [kvs_tp_vocab_lo(r), kvs_tp_vocab_lo(r+1)) (uneven when n does not
 *                     divide the vocabulary): the LM head; a view;
 *   KVS_SPLIT_VOCAB_EMBED  the same rows plus one zero row at the end: the embedding, where a
 *                     token another rank owns reads the zero row, so the all-reduce of the
 *                     ranks' lookups is the full lookup; a copy.
 *
 * Ownership: *owned is NULL for a view, else the malloc'd copy that out->data points into; the
 * caller frees it once the backend has uploaded the tensor. Errors: 0 / -EINVAL (a shape that
 * does not split evenly) / -ENOMEM, with a message.
 */
#ifndef KVS_TP_SHARD_H
#define KVS_TP_SHARD_H

#include <stddef.h>

#include "models/model.h"

enum kvs_split { KVS_SPLIT_WHOLE = 0, KVS_SPLIT_ROWS, KVS_SPLIT_COLS, KVS_SPLIT_VOCAB, KVS_SPLIT_VOCAB_EMBED };

/* first vocabulary row of rank r of n (r = n gives the vocabulary size) */
static inline int kvs_tp_vocab_lo(int vocab, int r, int n) { return (int)((long long)vocab * r / n); }

int kvs_tp_shard(const struct kvs_tensor_view *t, enum kvs_split split, int rank, int n_ranks, int vocab,
                 struct kvs_tensor_view *out, void **owned, char *err, size_t errlen);

#endif
