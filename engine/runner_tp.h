/* runner_tp.h: tensor parallelism inside one process (config key parallel.tensor = N > 1):
 * N ranks, each a runner (engine/runner.c) over its own backend instance (one GPU each: CUDA
 * device r for rank r) with its share of the weights (Megatron: q/k/v and gate/up by heads and
 * columns, o_proj and down_proj by rows, embedding and LM head by vocabulary; tp_shard.h) and
 * of the KV pool (its KV heads of every block: block tables are the same on every rank).
 *
 * Threads: rank 0 runs on the caller's thread (the scheduler's); ranks 1 .. N-1 each on a
 * thread of their own that this group starts, creates its backend (so a GPU rank's device is
 * current there for good) and runs every call for that rank. The scheduler runs once, on rank
 * 0's side: each call (forward, copy_block, seq_end) hands the same arguments (the step's batch)
 * to every rank and returns when all are done; the ranks' all-reduces (backend.h
 * allreduce_sum) keep their layer loops in step. The LM head's vocabulary columns are
 * assembled here: host logits rows are filled by every rank's columns; greedy (ARGMAX) rows take
 * the largest of the ranks' picks (ties: the lower rank, so the lowest id, as argmax_rows).
 *
 * The decode policy, the storage and their per-request state are per rank, over that rank's
 * heads (kv.decode_state_bytes is the group's: each rank gets 1/N of it). Counters
 * (kvs_runner_kv_counters) are reported once: one over the rank's heads (bytes, per-head
 * tallies: runner_tp.c per_rank) is the sum over the ranks, any other (rows, requests, ratios)
 * rank 0's. The
 * fidelity meter's per-row errors are summed over the ranks' heads before they are bucketed
 * (kvs_runner_rank_fidelity_merge).
 *
 * Ownership: kvs_tp_create returns rank 0's runner, which owns the group; kvs_runner_free on it
 * frees every rank (each on its own thread) and joins the threads. Errors: 0 / negative errno,
 * with a message on create. Internal to engine/runner*.c; everything else uses runner.h.
 */
#ifndef KVS_RUNNER_TP_H
#define KVS_RUNNER_TP_H

#include <stddef.h>
#include <stdint.h>

struct kvs_config;
struct kvs_model;
struct kvs_runner;
struct kvs_batch;
struct kvs_backend;
struct kvs_backend_ops;
struct kvs_tp;
struct kvs_kv_counter;

/* ---- the group (runner_tp.c) ---------------------------------------------------------- */
int kvs_tp_create(const struct kvs_config *cfg, const struct kvs_model *model, struct kvs_runner **out, char *err,
                  size_t errlen);
int kvs_tp_forward(struct kvs_tp *tp, const struct kvs_batch *b, float *logits);
int kvs_tp_copy_block(struct kvs_tp *tp, int32_t src, int32_t dst);
void kvs_tp_seq_end(struct kvs_tp *tp, int slot);
void kvs_tp_free(struct kvs_tp *tp);
/* The ranks' KV counters merged (runner_tp.h above); returns how many. */
int kvs_tp_kv_counters(struct kvs_tp *tp, struct kvs_kv_counter *out, int cap);
/* Called by every rank at the same point of a step with its own status: returns the first
 * rank's negative one, or 0 when all are 0 (a barrier). */
int kvs_tp_agree(struct kvs_tp *tp, int rc);
/* kvs_tp_agree, and then every rank must have the same n_rows (the step's rows after a decode
 * policy's recompute widened it): -EPROTO on every rank when they differ (logged). */
int kvs_tp_agree_rows(struct kvs_tp *tp, int rank, int rc, int n_rows);

/* ---- one rank (runner.c) ---------------------------------------------------------------- */
/* Phase 1: backend, this rank's weights, workspaces; *n_blocks: the KV blocks its share of the
 * budget holds. Phase 2 (finish): the KV pool of n_blocks blocks (the group's smallest) and the
 * decode policy; tp: the group (NULL alone). On failure, free the runner with kvs_runner_rank_free. */
int kvs_runner_rank_create(const struct kvs_config *cfg, const struct kvs_model *model, int rank, int n_ranks,
                           struct kvs_runner **out, size_t *n_blocks, char *err, size_t errlen);
int kvs_runner_rank_finish(struct kvs_runner *r, const struct kvs_config *cfg, size_t n_blocks, struct kvs_tp *tp,
                           char *err, size_t errlen);
void kvs_runner_rank_free(struct kvs_runner *r);
/* The step on this rank (host logits: its vocabulary columns of each row). */
int kvs_runner_rank_forward(struct kvs_runner *r, const struct kvs_batch *b, float *logits);
void kvs_runner_rank_copy_block(struct kvs_runner *r, int32_t src, int32_t dst);
void kvs_runner_rank_seq_end(struct kvs_runner *r, int slot);
/* After a step of the group: the fidelity meter's sampled rows, their errors summed over the
 * ranks' heads, into rank 0's histogram (ranks[0 .. n): every rank's runner, rank 0 first). */
void kvs_runner_rank_fidelity_merge(struct kvs_runner *const *ranks, int n);
/* This rank's KV counters (its heads' share; kvs_runner_kv_counters merges the ranks'). */
int kvs_runner_rank_kv_counters(struct kvs_runner *r, struct kvs_kv_counter *out, int cap);
struct kvs_backend *kvs_runner_rank_backend(const struct kvs_runner *r, const struct kvs_backend_ops **ops);
/* One all-reduce of the largest size (eager, then waits): connects the ranks before any step
 * graph is recorded. */
void kvs_runner_rank_warm(struct kvs_runner *r);
/* elements of the largest all-reduce (tokens per step x hidden size) */
size_t kvs_runner_rank_reduce_elems(const struct kvs_runner *r);

/* The last step's greedy picks of a rank: n rows, row k's id (in the rank's vocabulary, -1:
 * none) and value, and its logits row in batch order. */
struct kvs_rank_picks {
    int n, vocab_lo;
    const int32_t *ids;
    const float *vals;
    const int32_t *lout;
};
void kvs_runner_rank_picks(const struct kvs_runner *r, struct kvs_rank_picks *p);

#endif
