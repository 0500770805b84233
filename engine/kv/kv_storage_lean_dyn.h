/* kv_storage_lean_dyn.h: kv.storage = lean with kv.lean.mode = dynamic (the storage side of
 * kernels/kv_lean_dyn.h), called by kv_storage_lean.c's ops when the mode is dynamic: per
 * request, per layer and KV head, the recent window, the high and low sections in pages of the
 * page manager (kernels/kv_lean_pages.h), and the policy run inside attention: a sequence's
 * step of one row (decode) is Algorithm 1's step, one of more rows (a prompt chunk of at most
 * scheduler.max_batch_tokens) the paper's prefill (kernels/kv_lean_dyn.h kvs_lean_dyn_head_prefill:
 * exact attention over the stored tokens and the chunk, then one placement by alpha / i).
 *
 * The block pool still hands out block-table slots (positions of a request), but the dynamic
 * storage does not store tokens at them: write() stages the step's K/V and attention() appends
 * the rows to their request's heads, attends and applies the policy. Pages come from
 * the page manager in one round per layer and step (every head of the step's requests asks
 * for the worst case of its rows; what the sections did not reach goes back at once); a
 * request's pages go back when it ends, is preempted or cancelled (seq_free).
 *
 * On the cuda backend the heads, pages and page manager live on the GPU (kernels/kv_lean_dyn_cuda.h):
 * write() keeps the step's K/V buffers, attention() launches the page round, the rows' steps
 * (attention with in-kernel scores, the window exit) and the trim; the jobs are uploaded once
 * per step (step()), so a recorded decode step replays it; usage is read back only for the
 * counters and at a request's end.
 *
 * With kv.reuse = lazy (the LazyAttention document cache) cached documents are stored static, in
 * the high tier's format (K8V4 by default), at their block-table slots in pages of their own
 * (kernels/kv_lean.h, one buffer per layer over every pool block, counted in the block's bytes),
 * and shared: the document cache refcounts their blocks, the policy never demotes, prunes or
 * moves them. A document's side prefill (a sequence with no request slot) is written and
 * attended there only. A request's own tokens (prompt after its documents, generated) go through
 * the dynamic policy; each of its rows first attends over its documents with the static
 * kernels' attention_spans ([0, doc_end) of its block table, deferred rotation and valid slots
 * as the static mode reads them), and that (o, lse) joins its dynamic step: the probabilities
 * that feed the scores are normalized over documents and own tokens, and N of the thresholds
 * counts the documents' positions (kernels/kv_lean_dyn.h kvs_lean_dyn_head_step_ext).
 *
 * Refused at create (-ENOSYS / -EINVAL with a message): a backend other than cpu and cuda, kv.reuse
 * = prefix (shared prefix blocks hold a request's own tokens, which the tiers keep per request), a
 * decode policy other than full, the fidelity meter (it would run the policy's attention twice),
 * and with documents a high tier the static kernels do not take. Under tensor parallelism each
 * rank's store holds its KV heads and has a page manager of its own.
 *
 * Ownership: create allocates what destroy releases. Errors: 0 / negative errno + message. */
#ifndef KVS_KV_STORAGE_LEAN_DYN_H
#define KVS_KV_STORAGE_LEAN_DYN_H

#include "engine/kv/kv.h"

struct kvs_lean_dyn_store;

/* Block bytes for the pool's sizing: every token counted at the high tier (the paper's
 * conservative admission), K and V apart. */
void kvs_lean_dyn_block_bytes(const struct kvs_kv_shape *sh, size_t *k_bytes, size_t *v_bytes);
int kvs_lean_dyn_create(const struct kvs_kv_shape *sh, const struct kvs_backend_ops *o, struct kvs_backend *be,
                        int n_blocks, struct kvs_lean_dyn_store **out, char *err, size_t errlen);
void kvs_lean_dyn_destroy(struct kvs_lean_dyn_store *d);
int kvs_lean_dyn_seq_init(struct kvs_lean_dyn_store *d, int slot);
void kvs_lean_dyn_seq_free(struct kvs_lean_dyn_store *d, int slot);
int kvs_lean_dyn_step(struct kvs_lean_dyn_store *d, const struct kvs_kv_step *step);
void kvs_lean_dyn_write(struct kvs_lean_dyn_store *d, int layer, const struct kvs_dbuf *k, const struct kvs_dbuf *v,
                        const struct kvs_dbuf *slots, int n);
void kvs_lean_dyn_attention(struct kvs_lean_dyn_store *d, int layer, const struct kvs_dbuf *q,
                            const struct kvs_attn_meta *m, int n, float scale, struct kvs_dbuf *out);
int kvs_lean_dyn_counters(struct kvs_lean_dyn_store *d, struct kvs_kv_counter *out, int cap);

/* Tests: the page manager's invariant (every page id once across free list and tables) plus
 * each live head's pages covering its sections, and the pages held now. 0 or -EFAULT + msg. */
/* The dynamic store of a lean storage state (kv_storage_lean.c), NULL in a static mode. */
struct kvs_lean_dyn_store *kvs_kv_storage_lean_dyn_of(void *lean_state);
int kvs_lean_dyn_check(const struct kvs_lean_dyn_store *d, int *pages_held, char *msg, size_t msglen);
/* Tests: with kv.reuse = lazy, layer l's static page buffer (the documents' pages, kernels/kv_lean.h
 * layout over every pool block) and the bytes of one block in it; NULL without documents. */
const struct kvs_dbuf *kvs_lean_dyn_doc_pages(const struct kvs_lean_dyn_store *d, int layer, size_t *block_bytes);

#endif
