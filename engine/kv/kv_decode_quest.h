/* kv_decode_quest.h: the test and benchmark hooks of kv.decode=quest (kv_decode_quest.c). With the check on,
 * every layer that selects first recomputes, on the host, the min/max of every candidate page of
 * its rows from the cache and counts pages whose digest differs
 * (kvserve:kv_quest_stale_digests_total): tests run preemption, prefix sharing and block reuse
 * with it and expect 0. Mode 2 also skips the digest refresh of every other step, the fault
 * the check exists to catch (its negative control). Slow (downloads the layer's cache): tests
 * only. Not thread-safe: set it before creating an engine. */
#ifndef KVS_KV_DECODE_QUEST_H
#define KVS_KV_DECODE_QUEST_H

/* 0 off (default), 1 check, 2 check and skip every other step's refresh, 3 check and skip every
 * other step's super-page refreshes (kv.quest.super_pages > 0: their negative control) */
void kvs_quest_set_check(int mode);
/* Tests: 0 turns off the dense pass's skip_lead hint in mixed steps (default 1), so that a test
 * can compare the outputs with and without it. Process-wide. */
void kvs_quest_set_skip_hint(int on);

struct kvs_dbuf;
struct kvs_attn_meta;

/* Benchmarks (kvserve-stepbench): the digests of every selecting layer refreshed for the pages
 * that m's rows cover (h_q_start / h_pos: positions pos .. pos + rows - 1 of each sequence)
 * from the cache kc, as if every layer had written kc there. state: a quest policy's. */
void kvs_quest_refresh_digests(void *state, const struct kvs_dbuf *kc, const struct kvs_attn_meta *m);

#endif
