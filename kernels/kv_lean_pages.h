/* kv_lean_pages.h: LeanKV's page manager (STRATEGIES.md §5), host reference: the algorithm a
 * GPU version must reproduce page id for page id.
 *
 * Pages are unified: n_pages pages of fixed bytes, each holding tokens of one precision (a high
 * page holds page_bytes / high-token bytes tokens, a low page page_bytes / low-token bytes).
 * Every (request, layer, KV head) has a bidirectional page table of `table_len` entries: its
 * high pages grow from the left end (index 0 up), its low pages from the right end (index
 * table_len - 1 down); the two meet when the head is full.
 *
 * Free pages sit on a circular free list: ring[n_pages] with an allocation pointer (head) and
 * a free pointer (tail); n_free = pages between them. One allocation round per step serves
 * every head of every request and layer at once: each head asks for need[i] high and low pages
 * (at most one of each per decode step; any number in prefill), the counts go through one
 * exclusive prefix sum that gives each head its offset into the ring, and head i takes ring
 * slots head + off_i .. in order, high pages first. No head waits on another (on a GPU: one
 * thread per head, no atomics, no host round trip). A round that needs more than n_free pages
 * takes none and fails with -ENOSPC (the scheduler then preempts). Pages come back only when
 * their request ends (or is preempted / cancelled): appended at the tail in table order.
 *
 * Ownership: kvs_lean_pm_create allocates what kvs_lean_pm_free releases; the caller owns the
 * head ids (a request's heads are ids [first, first + n) that it registers).
 * Errors: 0 / negative errno (-ENOSPC, -EINVAL, -ENOMEM). Not thread-safe. */
#ifndef KVS_KV_LEAN_PAGES_H
#define KVS_KV_LEAN_PAGES_H

#include <stddef.h>
#include <stdint.h>

struct kvs_lean_pm;

/* n_pages pages; n_heads head tables (all requests x layers x KV heads the manager serves) of
 * table_len entries each. */
int kvs_lean_pm_create(int n_pages, int n_heads, int table_len, struct kvs_lean_pm **out);
void kvs_lean_pm_free(struct kvs_lean_pm *pm);

/* One allocation round: need_high[i], need_low[i] pages for head i (i < n_heads; zeros for idle
 * heads). All or nothing: -ENOSPC when the free list is short, -E2BIG when a head's table
 * would overflow (nothing taken in either case). */
int kvs_lean_pm_alloc(struct kvs_lean_pm *pm, const int32_t *need_high, const int32_t *need_low);

/* Gives back every page of heads [first, first + n) (a request ending, preempted or
 * cancelled): high pages then low pages of each head, in table order, to the tail. */
void kvs_lean_pm_release(struct kvs_lean_pm *pm, int first, int n);

/* Gives back head i's pages beyond its first keep_high high and keep_low low ones (the last
 * taken, innermost first) to the tail: what a round took for a worst case that did not happen
 * (a prefill allocates as if every token could land in either section, then keeps what its
 * sections reached). */
void kvs_lean_pm_trim(struct kvs_lean_pm *pm, int head, int keep_high, int keep_low);

/* Head i's tables: *n_high high pages at table[0 ..), *n_low low pages at table[table_len - 1]
 * downward. The pointer is the manager's (valid until the next call). */
const int32_t *kvs_lean_pm_table(const struct kvs_lean_pm *pm, int head, int *n_high, int *n_low);
int kvs_lean_pm_n_free(const struct kvs_lean_pm *pm);

/* The invariant: every page id appears exactly once across the free list and all tables, and
 * the counts agree. 0, or -EFAULT with what broke in msg. */
int kvs_lean_pm_check(const struct kvs_lean_pm *pm, char *msg, size_t msglen);

/* Exclusive prefix sum: out[i] = sum of in[0 .. i), returns the total (the step's scan). */
int64_t kvs_lean_exclusive_scan(const int32_t *in, int n, int64_t *out);

#endif
