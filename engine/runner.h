/* runner.h: one forward pass of the model over a mixed batch, on a backend (CPU or CUDA).
 *
 * The runner owns the backend, the weights in the backend's format and its workspaces, and
 * creates the KV seam's runner-side parts (engine/kv/kv.h): the storage strategy, which owns
 * the KV pool (n_blocks blocks of block_size token slots, every layer, K and V), and the decode
 * policy, which does each layer's attention; all of it is allocated once in kvs_runner_create,
 * never on the per-step path.
 * The KV *bookkeeping* (which request owns which block, refcounts, prefix hashes) lives in
 * engine/kv/; the runner only reads and writes the slots the batch's block tables name.
 *
 * Ownership: create/free pair. The batch and its arrays belong to the caller and are only read
 * during the call. Errors: 0 / negative errno (+ message in err on create).
 * Thread-safety: one thread (the scheduler's) calls forward.
 */
#ifndef KVS_RUNNER_H
#define KVS_RUNNER_H

#include <stddef.h>
#include <stdint.h>

struct kvs_config;
struct kvs_model;
struct kvs_runner;

/* One sequence's share of a step: n_tokens new tokens (1 for a decode step, a chunk for prefill)
 * at positions pos .. pos+n_tokens-1. Their K/V are written into the slots of the block table
 * (slot of position p = block_table[p / block_size], offset p % block_size) and they attend,
 * causally, to positions 0 .. their own. */
struct kvs_batch_seq {
    const int32_t *tokens;
    int n_tokens;
    int pos;                      /* tokens already in the KV cache for this sequence */
    const int32_t *block_table;   /* physical block ids covering positions [0, pos + n_tokens) */
    int n_blocks;
    /* Segment bases (DESIGN: keys are stored rotated relative to their segment's base).
     * NULL means one segment with base 0 (ordinary prompts). Otherwise, per block, the
     * rotation offset the attention kernel must add to keys of that block. */
    const int32_t *block_rot_offset;
    int want_logits;              /* KVS_LOGITS_LAST (1): logits for the last of these tokens;
                                   * KVS_LOGITS_ALL (2): for every one of them (prompt logprobs,
                                   * perplexity, tests); KVS_LOGITS_ARGMAX (3): only the argmax
                                   * id of the last token's logits (greedy decoding: picked on
                                   * the backend, the row never leaves it; needs batch.argmax);
                                   * 0: none */
    /* NULL means every slot of every block holds a key. Otherwise, per block, how many leading
     * slots do (a cached document's last block is partial; its tail is never attended). */
    const int32_t *block_valid;
    /* The request's slot for the decode policy's per-request state (engine/kv/kv.h), or -1 for
     * a sequence without one (a side prefill); slot_fresh: first step in this slot (the policy
     * resets the slot's state). */
    int slot;
    int slot_fresh;
    /* 1: tokens[0] is a placeholder; the token is this slot's greedy (KVS_LOGITS_ARGMAX) pick of
     * the step run just before this one, which is still on the backend (the host learns it from
     * that step's forward_end, possibly after this step was begun). One-token sequences with a
     * slot only, on a runner where kvs_runner_async_ok holds; -EINVAL otherwise. */
    int token_on_device;
};

enum { KVS_LOGITS_NONE = 0, KVS_LOGITS_LAST = 1, KVS_LOGITS_ALL = 2, KVS_LOGITS_ARGMAX = 3 };

struct kvs_batch {
    const struct kvs_batch_seq *seqs;
    int n_seqs;
    /* NULL, or [logits rows] filled by kvs_runner_forward: the argmax id of every logits row of
     * the step (LAST, ALL and ARGMAX rows alike, in batch order), with backend.h argmax_rows'
     * rule: lowest id among equal maxima, NaN never, -1 when no entry is above -inf (the
     * sampler's greedy pick, which fails on such a row). Required when a seq wants ARGMAX. */
    int32_t *argmax;
};

/* Creates the backend named by cfg->device (auto/cpu/cuda), uploads weights, sizes the KV pool
 * from cfg (kv_memory_bytes, or kv_memory_fraction of free memory) and logs the pool size. */
int kvs_runner_create(const struct kvs_config *cfg, const struct kvs_model *model,
                      struct kvs_runner **out, char *err, size_t errlen);
void kvs_runner_free(struct kvs_runner *r);

/* The CPU KV pool's need in blocks: max_running requests, each at the full context ctx in
 * whole blocks of block_size tokens (ceil(ctx / block_size) each); 0 when an argument is not
 * positive or the count overflows. With kv.memory_bytes 0 the CPU pool is the smaller of this,
 * kv.memory_fraction of available memory and 4 GiB. */
size_t kvs_runner_kv_need_blocks(int ctx, int block_size, int max_running);

int kvs_runner_num_blocks(const struct kvs_runner *r);
int kvs_runner_block_size(const struct kvs_runner *r);
int kvs_runner_vocab_size(const struct kvs_runner *r);
const char *kvs_runner_backend_name(const struct kvs_runner *r);
/* bytes of KV storage per token (all layers, K+V) */
size_t kvs_runner_kv_bytes_per_token(const struct kvs_runner *r);

/* Capacities fixed at create time (from cfg max_batch_tokens, max_running, max_model_len):
 * a batch with more tokens or sequences, or a sequence past the context, is refused. */
int kvs_runner_max_tokens_per_step(const struct kvs_runner *r);
int kvs_runner_max_seqs_per_step(const struct kvs_runner *r);
int kvs_runner_max_context(const struct kvs_runner *r);

/* Runs the batch. logits (host, fp32; may be NULL when no row needs it) receives one [vocab]
 * row per requested token in batch order: one per seq with KVS_LOGITS_LAST, n_tokens per seq
 * with KVS_LOGITS_ALL, none for KVS_LOGITS_ARGMAX (those rows stay on the backend; only their
 * ids come back, in b->argmax). Returns 0 or a negative errno (e.g. -EINVAL for a malformed
 * batch, or for ARGMAX rows without b->argmax). */
int kvs_runner_forward(struct kvs_runner *r, const struct kvs_batch *b, float *logits);

/* kvs_runner_forward in two halves, so that the caller's host work overlaps the device's:
 * begin validates, stages and queues the whole step (host logits rows, when any, are already
 * in logits when it returns); end waits for the device and fills b->argmax. Between the two
 * the caller must leave b and its arrays unchanged and call nothing else on the runner.
 * begin's error is end's too; end must follow every begin. */
int kvs_runner_forward_begin(struct kvs_runner *r, const struct kvs_batch *b, float *logits);
int kvs_runner_forward_end(struct kvs_runner *r);
/* 1 when this runner takes asynchronous steps (the backend's ids_to_tokens and fetch ops, one
 * rank, a decode policy without multi-row decode): then up to TWO begun steps may be in flight
 * (begin, begin, end, begin, end, ...; each end finishes the oldest and waits for that step only,
 * not for the one queued behind it), and the later step's sequences may take their token from
 * the earlier one's picks (kvs_batch_seq.token_on_device). The batch of each begun step must
 * stay unchanged until its end. */
int kvs_runner_async_ok(const struct kvs_runner *r);

/* The last step's layout and what it sent: n_seqs rows (padding included) of stride block-table
 * entries each; bt_uploaded of them went to the backend (only the entries that changed since
 * the step before: the runner keeps the table on the backend and patches it). in_uploaded: the
 * entries of the other per-step inputs (tokens, positions, KV slots, query starts, sequence
 * positions, logits rows, device-token pairs) that went up, likewise only those that changed. */
struct kvs_runner_step_info {
    int n_seqs, stride;
    size_t bt_uploaded, in_uploaded;
};
void kvs_runner_last_step(const struct kvs_runner *r, struct kvs_runner_step_info *out);
/* Reads the block table the last step ran with back from the backend into out (n_seqs x
 * stride, row-major, zeros past each sequence's blocks); returns the entries, or -ENOSPC when
 * cap is smaller. For tests: the patched table must equal one built from scratch. */
int kvs_runner_block_tables(struct kvs_runner *r, int32_t *out, size_t cap);

/* Copies block src to block dst in every layer (copy-on-write for shared prefix blocks). */
int kvs_runner_copy_block(struct kvs_runner *r, int32_t src, int32_t dst);

/* The request in slot ended: the decode policy frees its state (engine/kv/kv.h seq_free). */
void kvs_runner_seq_end(struct kvs_runner *r, int slot);
/* The decode policy's counters, the per-request arena and the fidelity meter (kv.fidelity)
 * into out[0..cap); returns how many. */
struct kvs_kv_counter;
int kvs_runner_kv_counters(struct kvs_runner *r, struct kvs_kv_counter *out, int cap);
/* The decode policy's `offloaded` (engine/kv/kv.h) for the request in slot: logical blocks
 * [*lo, *hi) it moved off the pool since the last call; returns hi - lo (0: none; always 0 with
 * tensor parallelism, whose ranks keep their blocks). */
int kvs_runner_kv_offloaded(struct kvs_runner *r, int slot, int *lo, int *hi);
/* The decode policy's `footprint` (engine/kv/kv.h); -ENOSYS without one (and with tensor
 * parallelism, which releases nothing). */
int kvs_runner_kv_footprint(struct kvs_runner *r, int n_tokens, int chunk, int host_avail, int *host_pages,
                            int *host_free, int *host_total);

#endif
