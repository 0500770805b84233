/* kv_lean_alg1.h: a CPU reference of LeanKV's Algorithm 1 (STRATEGIES.md §5) for one
 * (request, layer, KV head): the token tiers by importance, pruning and demotion. The dynamic
 * mode as the engine runs it (kernels/kv_lean_dyn.h, CPU) matches it step by step, bitwise
 * (tests/unit/test_kv_lean_dyn.c); it uses the CPU kernels' fixed-order dot product for that.
 *
 * State. A high section (format `high`, K8V4 by default), a low section (`low`, K4V2) and a
 * recent window of `window` tokens at full precision (fp32 here; the engine would keep the
 * backend's bf16). Every token carries its position and its score: the mean over the queries
 * that attended to it of the attention probability it got, each probability the max over the
 * G query heads that share this KV head.
 *
 * One step (kvs_lean_head_step; a prompt is fed token by token through the same step, so each
 * token's score when it leaves the window counts the queries of the `window` tokens after it:
 * the reference's choice where the paper's prefill scores a token over the whole prompt and
 * compares with alpha / i):
 *   1. the new token's K/V join the window;
 *   2. its G queries attend over high, low and window tokens (dequantized: x^ of
 *      kernels/kv_lean.h), two-pass softmax in fp32; the probabilities update the scores;
 *   3. if the window holds more than `window` tokens, its oldest token t_c leaves it. With N
 *      the tokens seen so far (pruned ones included): t_c goes high if score >= alpha_h / N,
 *      else low if >= alpha_l / N, else it is pruned. After an addition to a section, that
 *      section's victim (argmin score, first in section order on ties) is handled by the same
 *      rule: a high victim below alpha_h / N is demoted (requantized to `low` from its
 *      dequantized high values) or pruned below alpha_l / N; a low victim below alpha_l / N is
 *      pruned. A hole is filled by moving the section's last token into it.
 * At most one token enters each section per step, so a head needs at most one new page per
 * section per step (kvs_lean_head_pages); pages are not recycled before the request ends.
 *
 * Ownership: create allocates what free releases. Errors: 0 / negative errno. */
#ifndef KVS_KV_LEAN_ALG1_H
#define KVS_KV_LEAN_ALG1_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/kv_lean.h"

struct kvs_lean_head;

struct kvs_lean_head_cfg {
    struct kvs_lean_fmt high, low;
    int window;                   /* >= 1 */
    double alpha_h, alpha_l;
    int head_dim, group;          /* group: query heads per KV head (G) */
    int capacity;                 /* tokens the head may hold at most (sections + window) */
};

/* What the step did with the token leaving the window (dest -1: nothing left it). */
enum { KVS_LEAN_PRUNED = 0, KVS_LEAN_HIGH = 1, KVS_LEAN_LOW = 2, KVS_LEAN_DEMOTED = 3, KVS_LEAN_KEPT = 4 };
struct kvs_lean_event {
    int32_t tc_pos, tc_dest;      /* the token that left the window and where it went */
    float tc_score;
    int32_t victim_pos, victim_action; /* the section's victim (-1: none) and what happened */
    float victim_score;
    double n_seen;                /* N of the thresholds */
};

int kvs_lean_head_create(const struct kvs_lean_head_cfg *cfg, struct kvs_lean_head **out);
void kvs_lean_head_free(struct kvs_lean_head *h);

/* One step: q [group][head_dim] (already rotated), k, v [head_dim], pos; out [group][head_dim].
 * ev may be NULL. -ENOSPC when the head is full (capacity). */
int kvs_lean_head_step(struct kvs_lean_head *h, const float *q, const float *k, const float *v, int32_t pos,
                       float scale, float *out, struct kvs_lean_event *ev);

/* Attention of q [group][head_dim] over the current tokens, without changing any state. */
void kvs_lean_head_attend(const struct kvs_lean_head *h, const float *q, float scale, float *out);

/* Counts: tokens in the high and low sections, in the window, pruned so far. */
void kvs_lean_head_counts(const struct kvs_lean_head *h, int *n_high, int *n_low, int *n_window, int *n_pruned);

/* Token i of the current set in attention order (high, then low, then window, oldest first):
 * its position, score and dequantized K and V (k, v [head_dim]); i < n_high + n_low + n_window.
 * *tier is KVS_LEAN_HIGH, KVS_LEAN_LOW or KVS_LEAN_KEPT (window). */
void kvs_lean_head_token(const struct kvs_lean_head *h, int i, int32_t *pos, float *score, int *tier, float *k,
                         float *v);

/* Pages a head holds for its sections at page_bytes per page (each section's most tokens ever
 * rounded up to whole pages: nothing is recycled before the request ends), and the bytes it
 * takes in all: pages, the window at bf16, and 8 bytes per section token (fp32 score, int32
 * position). */
void kvs_lean_head_pages(const struct kvs_lean_head *h, size_t page_bytes, int *high_pages, int *low_pages);
size_t kvs_lean_head_bytes(const struct kvs_lean_head *h, size_t page_bytes);

/* Tests: permutes the tokens within each section (seeded); attention must not change. */
void kvs_lean_head_shuffle(struct kvs_lean_head *h, uint64_t seed);

#endif
