/* kv_decode_paris.h: the test hook of kv.decode=paris (kv_decode_paris.c). A prefill chunk of a
 * request whose retrieval zone left the pool (kv.paris.offload) attends over a device staging
 * copy of the step's contexts (one gather from the host pages and the pool a layer, then
 * attention()) when the staging area fits the limit set here, else over the pool's and the host
 * pages' spans merged (attention_spans: correct, but every row reads the whole zone over the
 * bus). Tests set a limit of 1 byte to run the second path. Not thread-safe: set it before
 * creating an engine. */
#ifndef KVS_KV_DECODE_PARIS_H
#define KVS_KV_DECODE_PARIS_H

#include <stddef.h>

/* bytes the staging area (K + V) may take; 0 (default): at most half the backend's free memory
 * when it grows */
void kvs_paris_set_stage_limit(size_t bytes);

#endif
