/* kv_decode_retro.h: the test and benchmark hooks of kv.decode=retro (kv_decode_retro.c). On a backend with a
 * Retro kernel table (kernels/kv_retro.h) other than the CPU, the policy keeps masks, supplement
 * spans and the output cache on the device; on the CPU it runs the host reference path. With the
 * hook on, the CPU runs the table path too, so that the unit tests check it against the host path
 * bitwise. Not thread-safe: set it before creating an engine. */
#ifndef KVS_KV_DECODE_RETRO_H
#define KVS_KV_DECODE_RETRO_H

/* 0: the CPU keeps the host path (default); 1: the CPU backend uses its table too */
void kvs_retro_set_table_on_cpu(int on);

struct kvs_dbuf;
struct kvs_attn_meta;

/* Benchmarks: refreshes the page digests of every selecting layer from kc for the positions of
 * m's sequences (a prefill-shaped meta: q_start / pos as if every position were written), as
 * the policy's steps would have done while the context was written; state is the policy's
 * (kvs_kv_decode_ops create). No attention runs. */
void kvs_retro_refresh_digests(void *state, const struct kvs_dbuf *kc, const struct kvs_attn_meta *m);

#endif
