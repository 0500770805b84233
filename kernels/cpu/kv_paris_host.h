/* kv_paris_host.h: ParisKV's host offload ops on the CPU backend (kernels/cpu/kv_paris_host.c),
 * as kernels/kv_paris.h's table declares them (ownership and errors there: host_alloc returns
 * NULL with a message; the rest cannot fail). Internal to the CPU backend: kv_paris.c puts them
 * in kvs_paris_kernels_cpu. */
#ifndef KVS_CPU_KV_PARIS_HOST_H
#define KVS_CPU_KV_PARIS_HOST_H

#include <stddef.h>

#include "kernels/backend.h"

void *kvs_paris_cpu_host_alloc(struct kvs_backend *b, size_t bytes, char *err, size_t errlen);
void kvs_paris_cpu_host_free(struct kvs_backend *b, void *p);
void kvs_paris_cpu_write_out(struct kvs_backend *b, const struct kvs_dbuf *kc, const struct kvs_dbuf *vc,
                             const struct kvs_attn_meta *m, const struct kvs_dbuf *jobs, const int32_t *h_jobs,
                             int n_jobs, int layer, int n_layers, int n_kv_heads, int head_dim, int block_size,
                             const struct kvs_dbuf *pages, int page_stride, void *host_k, void *host_v);
void kvs_paris_cpu_gather(struct kvs_backend *b, const struct kvs_dbuf *kc, const struct kvs_dbuf *vc,
                          const struct kvs_attn_meta *m, const struct kvs_dbuf *rows, const int32_t *h_rows, int n,
                          int layer, int n_layers, int n_kv_heads, int head_dim, int block_size,
                          const struct kvs_dbuf *n_spans, const struct kvs_dbuf *spans, int max_spans,
                          const struct kvs_dbuf *pages, int page_stride, const void *host_k, const void *host_v,
                          struct kvs_dbuf *stage_k, struct kvs_dbuf *stage_v, int stage_blocks);
struct kvs_dbuf *kvs_paris_cpu_host_view(struct kvs_backend *b, void *host, size_t off, size_t n);
void kvs_paris_cpu_host_view_free(struct kvs_backend *b, struct kvs_dbuf *view);

#endif
