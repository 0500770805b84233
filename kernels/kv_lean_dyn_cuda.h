/* kv_lean_dyn_cuda.h: LeanKV's dynamic mode on the GPU (kernels/cuda/kv_lean_dyn.cu): the page
 * manager, Algorithm 1's step and its attention for a batch of (request, layer, KV head) heads,
 * all in device memory, with no host round trip in a step.
 *
 * It keeps the CPU's state layout (kernels/kv_lean_dyn.h) so the two compare token for token:
 * page entries [int32 position][fp32 score sum][K codes][K (s, z)][V codes][V (s, z)], a high /
 * low bidirectional table per head, the circular free list of kernels/kv_lean_pages.h. The
 * window is kept in bf16 (the GPU's KV precision; the CPU keeps fp32, so the two agree on
 * bf16-exact inputs). One step of a batch (kvs_lean_dyn_cuda_step) is three launches on the
 * backend's stream (jobs of more than one row, prompt chunks, take the prefill instead of 2,
 * kvs_lean_dyn_cuda_reserve_rows):
 *   1. the allocation round: each job's head asks for the pages its rows could need (as
 *      kvs_lean_dyn_head_need), one exclusive block scan over the jobs gives each its offset
 *      into the ring, and each takes its pages (all or nothing; a short ring sets a sticky
 *      error that kvs_lean_dyn_cuda_error reads, and the step then leaves every job untouched);
 *   2. one block per job runs its rows in order (a decode step, every job one row, splits a
 *      head's tokens over several blocks instead, then merges them: kvs_lean_dyn_cuda_set_split):
 *      the row's K/V join the window; logits of the
 *      group's q heads over high, low and window tokens (dequantized on the fly); two-pass
 *      softmax; each token's score sum gets its probability (max over the group); the output
 *      is sum_i p_i v^_i; then the oldest window token leaves by Algorithm 1 (kvs_lean_dyn_head_exit:
 *      high / low / pruned, the section's victim demoted or pruned, holes filled by the
 *      section's last entry). The quantizer and dequantizer are the host's IEEE operations, so
 *      given the same scores the policy's decisions and bytes equal the CPU's bitwise; the
 *      scores themselves differ from the CPU's by fp32 summation order (~1e-7 relative), so a
 *      token whose score lies within that of a threshold may go the other way (the test pins
 *      this: tests/gpu/test_cuda_kv_lean_dyn.c);
 *   3. the trim: what the sections did not reach goes back to the ring's tail, in job order
 *      (a second scan), as kvs_lean_pm_trim.
 * Jobs must name distinct heads; jobs in ascending head order give the host page manager's
 * page ids exactly.
 *
 * Ownership: create allocates what free releases (device memory on b). Errors: 0 / negative
 * errno with a message where noted; kernels do not validate their jobs. Builds with nvcc only. */
#ifndef KVS_KV_LEAN_DYN_CUDA_H
#define KVS_KV_LEAN_DYN_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/backend.h"
#include "kernels/kv_lean_dyn.h"

struct kvs_lean_dyn_cuda;

/* One job: state `head` + layer * layer_stride (create) of KV head g runs rows [row0, row0 + rows)
 * of the step's q / k / v / out at positions pos0 ..; head < 0: nothing (a padded sequence). */
struct kvs_lean_dyn_cuda_job {
    int32_t head, g, row0, rows, pos0;
};

/* Phases of a step (tests run them apart): the page round and trim, join + attention + scores,
 * the window exit. */
enum { KVS_LEAN_DYN_PAGES = 1, KVS_LEAN_DYN_ATTEND = 2, KVS_LEAN_DYN_EXIT = 4, KVS_LEAN_DYN_ALL = 7 };

/* n_states head states (requests x layers x KV heads), n_q_heads / n_kv_heads of the step's
 * rows, n_pages pages of c->page_bytes, tables of table_len, at most max_jobs jobs a step; a
 * job's state in layer l is its head + l * layer_stride. c->group <= 8, c->head_dim <= 256 (-EINVAL). */
int kvs_lean_dyn_cuda_create(struct kvs_backend *b, const struct kvs_lean_dyn_cfg *c, int n_states, int n_q_heads,
                             int n_kv_heads, int n_pages, int table_len, int max_jobs, int layer_stride,
                             struct kvs_lean_dyn_cuda **out, char *err, size_t errlen);
void kvs_lean_dyn_cuda_free(struct kvs_lean_dyn_cuda *d);

/* The prefill's buffers for steps of up to max_rows rows (each row's max logit and sum per q head,
 * the chunk tokens' score sums). With them, kvs_lean_dyn_cuda_step runs the jobs of more than
 * one row (prompt chunks) by the paper's prefill, as kvs_lean_dyn_head_prefill: one pass of
 * exact attention over the head's stored tokens and the chunk's rows (a warp per row), an extra
 * pass for the probabilities (a warp per token over the chunk's rows), then one placement of
 * the tokens that leave the window (a block per head). Without them (or for a step of more rows)
 * every row runs Algorithm 1's step in order. 0, or -ENOMEM with a message. */
int kvs_lean_dyn_cuda_reserve_rows(struct kvs_lean_dyn_cuda *d, int max_rows, char *err, size_t errlen);

/* The split path of decode steps (every job of set_jobs one row, phases attend and exit
 * together): a head's tokens over up to max_splits blocks (at most 16; 0: the sequential
 * one-block kernel for every step), each split taking min_tokens tokens at least (>= 1). The
 * default is 16 / 64, or KVS_LEAN_DYN_SPLIT / KVS_LEAN_DYN_SPLIT_MIN from the environment at
 * create. Tests and benchmarks set it before a step (a recorded step keeps the path it was
 * recorded with). */
void kvs_lean_dyn_cuda_set_split(struct kvs_lean_dyn_cuda *d, int max_splits, int min_tokens);

/* The step's jobs (uploaded once per step, outside any recorded graph: the launches of
 * kvs_lean_dyn_cuda_step read them from device memory). -E2BIG when n_jobs > max_jobs. */
int kvs_lean_dyn_cuda_set_jobs(struct kvs_lean_dyn_cuda *d, const struct kvs_lean_dyn_cuda_job *jobs, int n_jobs);

/* One layer of the step (asynchronous on b's stream; recordable into a graph): the first n_jobs
 * jobs of set_jobs; q, out ACT [rows][n_q_heads][hd]; k, v ACT [rows][n_kv_heads][hd].
 * ext_lse (NULL: none), F32 [rows][n_q_heads]: the rows' other part of the context (a request's
 * cached documents, attended by the static kernels), whose output out holds on entry; as
 * kvs_lean_dyn_head_step_ext, its mass joins the probabilities' normalization and its output
 * the row's (-INFINITY: nothing there, the same bits as without). */
void kvs_lean_dyn_cuda_step(struct kvs_lean_dyn_cuda *d, int n_jobs, int layer, const struct kvs_dbuf *q,
                            const struct kvs_dbuf *k, const struct kvs_dbuf *v, const struct kvs_dbuf *ext_lse,
                            float scale, struct kvs_dbuf *out, int phases);

/* out[r] = keep[r] ? slots[r] : -1 for r < n (I32 device buffers; asynchronous on b's stream,
 * recordable): the dynamic store's static write keeps a document's side-prefill rows only. */
void kvs_lean_dyn_cuda_mask_slots(struct kvs_backend *b, const struct kvs_dbuf *slots, const struct kvs_dbuf *keep,
                                  struct kvs_dbuf *out, int n);

/* Heads [first, first + n)'s usage, summed (waits for the stream): pages held, section tokens,
 * window tokens, pruned tokens; and the tokens seen by head `first`. */
void kvs_lean_dyn_cuda_usage(struct kvs_lean_dyn_cuda *d, int first, int n, double *pages, double *high, double *low,
                             double *window, double *pruned, double *seen_first);

/* The same sums over every live request at once, for the counters: n_groups consecutive groups
 * of group_len heads (a request's heads), live[i] != 0 to count group i; one stream wait and
 * three copies in all (per-group calls cost one wait and three copies each). seen_sum adds each
 * live group's first head's seen. free_pages: the ring's free pages from the same wait. */
void kvs_lean_dyn_cuda_usage_groups(struct kvs_lean_dyn_cuda *d, int group_len, int n_groups,
                                    const unsigned char *live, double *pages, double *high, double *low,
                                    double *window, double *pruned, double *seen_sum, int *free_pages);

/* The same sums without a wait on the host's hot path (the counters under scheduler.async):
 * snapshot queues a sum of n_groups groups of group_len heads on the stream, behind its work,
 * and a copy of it to pinned host memory (-EBUSY, nothing queued: the stream is being recorded
 * into a graph, or the two snapshots before are both still queued and wait is 0; wait != 0 waits
 * for the older one instead; -EINVAL: more heads than states). snapshot_read gives the newest snapshot of that grouping that has landed (wait != 0:
 * the newest queued, waited for) as usage_groups gives it for the state it saw: 1, or 0 (none
 * landed; the outputs untouched). idle: 1 when the stream has nothing queued. */
int kvs_lean_dyn_cuda_snapshot(struct kvs_lean_dyn_cuda *d, int group_len, int n_groups, int wait);
int kvs_lean_dyn_cuda_snapshot_read(struct kvs_lean_dyn_cuda *d, int wait, int group_len, int n_groups,
                                    const unsigned char *live, double *pages, double *high, double *low,
                                    double *window, double *pruned, double *seen_sum, int *free_pages);
int kvs_lean_dyn_cuda_idle(struct kvs_lean_dyn_cuda *d);

/* Request end (or preemption, cancellation): heads [first, first + n) give their pages back
 * (as kvs_lean_pm_release) and start empty. */
void kvs_lean_dyn_cuda_release(struct kvs_lean_dyn_cuda *d, int first, int n);

/* Waits for the stream; the sticky error of the rounds so far (0, -ENOSPC: the ring was short,
 * -E2BIG: a table overflowed), cleared. */
int kvs_lean_dyn_cuda_error(struct kvs_lean_dyn_cuda *d);
int kvs_lean_dyn_cuda_n_free(struct kvs_lean_dyn_cuda *d);

/* Tests: copies head `head`'s state out of / into the device. h's window memory is laid by
 * kvs_lean_dyn_head_init; pages is the whole page buffer (n_pages x page_bytes; NULL: left
 * alone); table [table_len]; ev (get only, may be NULL): the event of the head's last row. */
void kvs_lean_dyn_cuda_get(struct kvs_lean_dyn_cuda *d, int head, struct kvs_lean_dyn_head *h, uint8_t *pages,
                           int32_t *table, int *n_high_pages, int *n_low_pages, struct kvs_lean_event *ev);
void kvs_lean_dyn_cuda_set(struct kvs_lean_dyn_cuda *d, int head, const struct kvs_lean_dyn_head *h,
                           const uint8_t *pages, const int32_t *table, int n_high_pages, int n_low_pages);

#endif
