/* kv_lean_dyn.h: LeanKV's dynamic mode (kv.lean.mode = dynamic; STRATEGIES.md §5) as the engine
 * runs it: one (request, layer, KV head)'s tokens in mixed-precision pages of the page manager
 * (kernels/kv_lean_pages.h), the per-token step of Algorithm 1 over them (decode), the paper's
 * prefill of a prompt chunk (kvs_lean_dyn_head_prefill), and the CPU backend's batch of those for
 * one layer (kernels/cpu/kv_lean_dyn.c). It reproduces the CPU
 * reference of Algorithm 1 (kernels/kv_lean_alg1.h) decision for decision, score for score
 * (bitwise: same fixed-order dot product, same two-pass softmax for the probabilities), and
 * its attention output is cpu_attention's online softmax over the dequantized tokens in section
 * order (high, low, window oldest first), so with every token kept in arrival order it equals
 * the dense reference kernel (KVS_CPU_KERNELS=ref) bitwise (tests/unit/test_kv_lean_dyn.c).
 *
 * Per token of a section, a page entry holds [int32 position][fp32 score sum][K codes][K (s, z)
 * fp16 pair][V codes][V (s, z)] ((s, z) absent at 16 bits): a token's score is its sum over the
 * number of queries since it arrived (its position to the latest query's, inclusive: a
 * request's positions are contiguous). A high page holds tp_hi entries of the high format; a
 * low page the same bytes, so page_bytes / entry_lo entries of the low one. The window (the
 * newest `window` tokens and the one arriving) is kept at the backend's activation precision
 * (fp32 on the CPU; counted at bf16, what a GPU keeps, in kvs_lean_dyn_head_bytes).
 *
 * Ownership: the caller's memory throughout (kvs_lean_dyn_head_init lays a head's window over
 * memory of kvs_lean_dyn_head_mem bytes). Errors: 0 / negative errno; kernel ops do not
 * validate (pages must have been allocated with kvs_lean_dyn_head_need first). */
#ifndef KVS_KV_LEAN_DYN_H
#define KVS_KV_LEAN_DYN_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/backend.h"
#include "kernels/kv_lean.h"
#include "kernels/kv_lean_alg1.h"  /* struct kvs_lean_event, KVS_LEAN_HIGH ... */

struct kvs_lean_dyn_cfg {
    struct kvs_lean_fmt high, low;
    int head_dim, group, window;
    double alpha_h, alpha_l;
    int tp_hi, tp_lo;             /* entries per high / low page */
    size_t entry_hi, entry_lo, page_bytes;
    int max_ctx;                  /* tokens a request may hold (scratch sizes) */
};

/* -EINVAL when a format or size is out of range (head_dim % 4, window >= 1, tp_hi >= 1). */
int kvs_lean_dyn_cfg_init(struct kvs_lean_dyn_cfg *c, struct kvs_lean_fmt high, struct kvs_lean_fmt low, int head_dim,
                          int group, int window, double alpha_h, double alpha_l, int tp_hi, int max_ctx);

/* One (request, layer, KV head). */
struct kvs_lean_dyn_head {
    int n_high, n_low, max_high, max_low; /* section sizes now and at their peak */
    int w_start, w_n, pruned;
    int64_t seen;                 /* N of the thresholds: tokens seen, pruned ones included */
    int32_t last_pos;             /* the latest query's position */
    float *wk, *wv;               /* [window + 1][head_dim] ring */
    int32_t *wpos;                /* [window + 1] */
    float *wacc;                  /* [window + 1] score sums */
};

/* Where a head's pages are: the page manager's table (high pages from index 0 up, low pages
 * from table_len - 1 down) over the page buffer base. */
struct kvs_lean_dyn_pages {
    uint8_t *base;
    const int32_t *table;
    int table_len, n_high_pages, n_low_pages;
};

size_t kvs_lean_dyn_head_mem(const struct kvs_lean_dyn_cfg *c);
void kvs_lean_dyn_head_init(const struct kvs_lean_dyn_cfg *c, struct kvs_lean_dyn_head *h, void *mem);

/* Scratch floats one step or prefill needs (logits and probabilities of the group over every
 * token; a prefill's per-token sums). */
size_t kvs_lean_dyn_scratch_floats(const struct kvs_lean_dyn_cfg *c);

/* Pages head h must hold (beyond have_hi / have_lo) so that `rows` more steps cannot overflow a
 * section (each step adds at most one token to each); and the pages it keeps once they are
 * done (its sections' peaks, rounded up: nothing is recycled before the request ends). */
void kvs_lean_dyn_head_need(const struct kvs_lean_dyn_cfg *c, const struct kvs_lean_dyn_head *h, int rows, int have_hi,
                            int have_lo, int32_t *need_hi, int32_t *need_lo);
void kvs_lean_dyn_head_keep(const struct kvs_lean_dyn_cfg *c, const struct kvs_lean_dyn_head *h, int *keep_hi,
                            int *keep_lo);

/* One step of Algorithm 1 (kv_lean_alg1.h): k, v [head_dim] join the window at pos; q [group]
 * [head_dim] attends over every token (out [group][head_dim]) and adds its probabilities (max
 * over the group) to the scores; the oldest window token then leaves by the rule. scratch:
 * kvs_lean_dyn_scratch_floats floats. ev may be NULL.
 * N of the thresholds counts the positions before the head's first token too (a fresh head,
 * seen 0, starts it at pos): a request's cached documents (kv.reuse = lazy, their padded slots
 * included), which share the query's probability mass with its own tokens. */
void kvs_lean_dyn_head_step(const struct kvs_lean_dyn_cfg *c, struct kvs_lean_dyn_head *h,
                            const struct kvs_lean_dyn_pages *pg, const float *q, const float *k, const float *v,
                            int32_t pos, float scale, float *out, float *scratch, struct kvs_lean_event *ev);

/* The same step with a part of the context held elsewhere (a request's cached documents, read
 * by the static format's attention): ext_lse [group] is that part's log-sum-exp of the scaled
 * logits per query head (-INFINITY: nothing there) and out [group][head_dim] holds its
 * normalized output on entry. The probabilities that feed the scores are normalized over both
 * parts (p_i = exp(l_i - M) / (sum_j exp(l_j - M) + exp(ext_lse - M)), M the larger maximum),
 * and out leaves as the merge of the two (the head's online softmax, then (o, lse) weights).
 * A query head whose ext_lse is -INFINITY computes exactly kvs_lean_dyn_head_step's bits;
 * ext_lse NULL is that step. */
void kvs_lean_dyn_head_step_ext(const struct kvs_lean_dyn_cfg *c, struct kvs_lean_dyn_head *h,
                                const struct kvs_lean_dyn_pages *pg, const float *q, const float *k, const float *v,
                                int32_t pos, float scale, const float *ext_lse, float *out, float *scratch,
                                struct kvs_lean_event *ev);

/* Step 3 of kvs_lean_dyn_head_step alone (it ends with this call): when the window holds more
 * than `window` tokens, its oldest leaves by the rule (high / low / pruned, then the section's
 * victim), from the scores as they stand. The CUDA policy (kernels/kv_lean_dyn_cuda.h) is held
 * to it bitwise on the same state (tests/gpu/test_cuda_kv_lean_dyn.c). ev may be NULL. */
void kvs_lean_dyn_head_exit(const struct kvs_lean_dyn_cfg *c, struct kvs_lean_dyn_head *h,
                            const struct kvs_lean_dyn_pages *pg, struct kvs_lean_event *ev);

/* A prompt chunk of `rows` (> 1) rows of one head at positions pos0 ..: q / out [rows] x q_stride
 * floats ([group][head_dim] each), k / v [rows] x kv_stride ([head_dim] each), ext_lse NULL or
 * [rows] x ext_stride ([group] each; kvs_lean_dyn_head_step_ext's other part, out holding its
 * output on entry). */
struct kvs_lean_dyn_rows {
    int rows;
    int32_t pos0;
    const float *q;
    float *out;
    size_t q_stride;
    const float *k, *v;
    size_t kv_stride;
    const float *ext_lse;
    size_t ext_stride;
};

/* The paper's prefill for one chunk (STRATEGIES.md §5, "Prompt phase"): every row attends
 * exactly over the head's tokens as they are stored (sections dequantized, the window) and the
 * chunk's rows up to its own (causal), with the step's arithmetic (two-pass probabilities for
 * the scores, the online softmax for out, the ext merge); each token's score sum gets the
 * chunk's probabilities (max over the group; summed over the rows in row order, then added
 * once). Then every token that leaves the window at the chunk's end (the oldest T - window of
 * the old window's w_n and the chunk's rows, T = w_n + rows) is placed by the prefill rule, in
 * position order: with i = pos + 1 (the token's 1-based position; cached documents' positions
 * count, as in N), high if its score (sum / queries since it arrived) >= alpha_h / i, low if
 * >= alpha_l / i, else pruned. No victim is chosen (Algorithm 1's decode rule, kept for rows of
 * one, compares with alpha / N and demotes or prunes a section's victim). The window keeps the
 * newest min(T, window), token t of the sequence at ring slot (w_start + t) % (window + 1).
 * Pages: kvs_lean_dyn_head_need(rows) (each section may grow by every leaving token: the
 * all-high worst case) must have been taken; keep then trims what was not reached. */
void kvs_lean_dyn_head_prefill(const struct kvs_lean_dyn_cfg *c, struct kvs_lean_dyn_head *h,
                               const struct kvs_lean_dyn_pages *pg, const struct kvs_lean_dyn_rows *in, float scale,
                               float *scratch);

/* Token i of the head in attention order (high, low, window oldest first): position, score,
 * tier (KVS_LEAN_HIGH, KVS_LEAN_LOW, KVS_LEAN_KEPT) and dequantized k, v [head_dim]. */
int kvs_lean_dyn_head_tokens(const struct kvs_lean_dyn_head *h);
void kvs_lean_dyn_head_token(const struct kvs_lean_dyn_cfg *c, const struct kvs_lean_dyn_head *h,
                             const struct kvs_lean_dyn_pages *pg, int i, int32_t *pos, float *score, int *tier,
                             float *k, float *v);

/* Tests: permutes the entries within each section (seeded); attention must not change. */
void kvs_lean_dyn_head_shuffle(const struct kvs_lean_dyn_cfg *c, struct kvs_lean_dyn_head *h,
                               const struct kvs_lean_dyn_pages *pg, uint64_t seed);

/* One layer's steps for every (sequence, KV head) of a batch: sequence s's rows
 * [q_start[s], q_start[s + 1]) run in order at positions pos[s] .. (one row: Algorithm 1's
 * step; more: a prompt chunk, kvs_lean_dyn_head_prefill); sequences and heads in
 * parallel (the CPU pool). heads / pages [n_seqs][n_kv_heads]; q, out ACT [n][n_heads][hd];
 * k, v [n][n_kv_heads][hd]; scratch n_scratch x kvs_lean_dyn_scratch_floats. */
struct kvs_lean_dyn_job {
    const struct kvs_lean_dyn_cfg *cfg;
    int n_seqs, n_heads, n_kv_heads;
    const int32_t *q_start, *pos;
    struct kvs_lean_dyn_head **heads;
    const struct kvs_lean_dyn_pages *pages;
    const float *k, *v;
    const struct kvs_dbuf *q;
    struct kvs_dbuf *out;
    float scale;
    float *scratch;
    int n_scratch;
    const struct kvs_dbuf *ext_lse; /* NULL, or F32 [n][n_heads]: the rows' other part (documents), whose
                                   * output out holds on entry (kvs_lean_dyn_head_step_ext) */
};
void kvs_lean_dyn_cpu_attend(struct kvs_backend *b, const struct kvs_lean_dyn_job *j);
/* Worker threads of the CPU backend b (how much scratch kvs_lean_dyn_cpu_attend wants). */
int kvs_lean_dyn_cpu_threads(struct kvs_backend *b);

#endif
