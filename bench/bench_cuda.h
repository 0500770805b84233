/* bench_cuda.h: what the CUDA benchmark programs (bench/kvserve_{gpubench,stepbench,parisstep,
 * parisbench,questbench,spanbench,leanbench}_main.c) share: the Llama-3.1-8B shapes they time,
 * opening the CUDA backend, device buffers that must exist, and a decoder layer of random
 * weights. Header-only (static inline), no state of its own; include it inside the programs'
 * KVS_HAVE_CUDA block.
 * Ownership: buffers and weights belong to the backend b (freed by its free / free_weight).
 * Errors: a benchmark cannot go on without its buffers, so bench_dalloc and bench_random_layer
 * panic (kvs_panic) when the device memory runs out; bench_cuda_open prints the backend's error
 * to stderr and returns NULL. */
#ifndef KVS_BENCH_CUDA_H
#define KVS_BENCH_CUDA_H

#include <stdint.h>
#include <stdio.h>

#include "base/util.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"

/* Llama-3.1-8B: the model whose shapes the GPU benchmarks time */
#define DIM 4096
#define NH 32
#define NKV 8
#define HD 128
#define FF 14336
#define VOCAB 128256

/* the CUDA backend on device 0, or NULL after "cuda backend unavailable: <why>" on stderr */
static inline struct kvs_backend *bench_cuda_open(void)
{
    char err[256];
    struct kvs_backend *b = kvs_cuda_backend.create(0, err, sizeof err);
    if (!b) fprintf(stderr, "cuda backend unavailable: %s\n", err);
    return b;
}

/* n elements of kind on the device; panics when they do not fit */
static inline struct kvs_dbuf *bench_dalloc(struct kvs_backend *b, enum kvs_buf_kind kind, size_t n)
{
    struct kvs_dbuf *d = kvs_cuda_backend.alloc(b, kind, n);
    if (!d) kvs_panic(__FILE__, __LINE__, "out of device memory (%zu elements)", n);
    return d;
}

/* one decoder layer's random weights (uniform, scale 0.02; norms around 1) in the order of
 * seeds *seed, *seed + 1, ... (advances *seed by 9): q, k, v, o, gate, up, down, attention norm,
 * MLP norm; panics when the device memory runs out */
static inline void bench_random_layer(struct kvs_backend *b, uint64_t *seed, struct kvs_dweight **wq,
                                      struct kvs_dweight **wk, struct kvs_dweight **wv, struct kvs_dweight **wo,
                                      struct kvs_dweight **wg, struct kvs_dweight **wu, struct kvs_dweight **wd,
                                      struct kvs_dweight **n1, struct kvs_dweight **n2)
{
    *wq = kvs_cuda_random_weight(b, DIM, DIM, 0, 0.02f, (*seed)++);
    *wk = kvs_cuda_random_weight(b, NKV * HD, DIM, 0, 0.02f, (*seed)++);
    *wv = kvs_cuda_random_weight(b, NKV * HD, DIM, 0, 0.02f, (*seed)++);
    *wo = kvs_cuda_random_weight(b, DIM, DIM, 0, 0.02f, (*seed)++);
    *wg = kvs_cuda_random_weight(b, FF, DIM, 0, 0.02f, (*seed)++);
    *wu = kvs_cuda_random_weight(b, FF, DIM, 0, 0.02f, (*seed)++);
    *wd = kvs_cuda_random_weight(b, DIM, FF, 0, 0.02f, (*seed)++);
    *n1 = kvs_cuda_random_weight(b, 1, DIM, 1, 1.0f, (*seed)++);
    *n2 = kvs_cuda_random_weight(b, 1, DIM, 1, 1.0f, (*seed)++);
    if (!*wq || !*wk || !*wv || !*wo || !*wg || !*wu || !*wd || !*n1 || !*n2)
        kvs_panic(__FILE__, __LINE__, "out of device memory for the weights");
}

#endif
