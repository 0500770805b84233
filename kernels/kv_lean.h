/* kv_lean.h: LeanKV's quantized KV format (STRATEGIES.md §5) and the per-backend kernels that
 * write it and attend over it (kv.storage = lean, engine/kv/kv_storage_lean.c).
 *
 * Format. A token's K (or V) vector of one KV head is quantized per vector, asymmetrically, to b
 * bits (b = 2, 4, 8): s = (max - min) / (2^b - 1), z = -min, code = round((x + z) / s), clamped
 * to [0, 2^b - 1], x^ = s * code - z, with s and z stored as IEEE fp16 (K and V apart). s and z
 * are rounded to fp16 BEFORE the codes are computed (s rounded up far enough to cover the
 * range with the rounded z), so the round trip keeps |x - x^| <= s / 2 for the s actually
 * stored (plus fp32 rounding of the dequantization). b = 16 stores fp16 values, no s / z.
 * Codes are packed little-end first: element i of a 4-bit vector is nibble i % 2 of byte i / 2,
 * of a 2-bit vector bits 2 (i % 4) .. of byte i / 4.
 *
 * Page layout. One page per (block, layer, KV head) holds the block_size tokens of that block
 * at one format, structure of arrays: K codes [block_size][kbytes], V codes
 * [block_size][vbytes], then K (s, z) as fp16 pairs [block_size][2] and V (s, z) likewise, each
 * absent when its side has 16 bits.
 * A layer's pages lie [n_blocks][n_kv_heads] in one byte buffer. kvs_lean_page_bytes says how
 * long one is.
 *
 * Kernels. Each backend that stores LeanKV pages provides the table below; the storage takes
 * it with kvs_lean_kernels_for(o), NULL when the backend has none (the storage then refuses
 * the config with -ENOSYS). The CPU reference (kernels/cpu/kv_lean.c) and CUDA
 * (kernels/cuda/kv_lean.cu, tested against it: tests/gpu/test_cuda_kv_lean.c). The attention ops keep the backend's attention() / attention_spans() contracts
 * (backend.h), reading the keys and values as the dequantized x^ in fp32.
 * Ownership: the caller's buffers; errors: none (ops do not validate, as backend ops). */
#ifndef KVS_KV_LEAN_H
#define KVS_KV_LEAN_H

#include <stddef.h>
#include <stdint.h>

#include "kernels/backend.h"

/* One format: bits of K and of V (2, 4, 8 or 16). */
struct kvs_lean_fmt {
    int kbits, vbits;
};

/* Parses "K8V4" style names; 0, or -EINVAL for anything else (bits outside 2/4/8/16). */
int kvs_lean_fmt_parse(const char *name, struct kvs_lean_fmt *f);

/* Bytes of one vector of head_dim elements at b bits, with its (s, z) metadata. */
static inline size_t kvs_lean_vec_bytes(int bits, int head_dim)
{
    return bits == 16 ? (size_t)head_dim * 2 : (size_t)head_dim * (size_t)bits / 8 + 4;
}

/* Bytes of one token of one head (K and V, metadata included). */
static inline size_t kvs_lean_token_bytes(struct kvs_lean_fmt f, int head_dim)
{
    return kvs_lean_vec_bytes(f.kbits, head_dim) + kvs_lean_vec_bytes(f.vbits, head_dim);
}

/* Bytes of one page: block_size tokens of one head of one layer. */
static inline size_t kvs_lean_page_bytes(struct kvs_lean_fmt f, int head_dim, int block_size)
{
    return kvs_lean_token_bytes(f, head_dim) * (size_t)block_size;
}

/* Host reference of one vector's round trip (tests, the CPU kernels): quantizes x[0..d) to
 * bits into codes (d * bits / 8 bytes; fp16 values at 16 bits) and sz[2] = fp16 (s, z), and
 * dequantizes them back into out[0..d). d * bits must be a multiple of 8. */
void kvs_lean_quantize(const float *x, int d, int bits, uint8_t *codes, uint16_t sz[2]);
void kvs_lean_dequantize(const uint8_t *codes, const uint16_t sz[2], int d, int bits, float *out);
float kvs_lean_half_to_float(uint16_t h);

/* The kernels of one backend. `pool` is a layer's page buffer as allocated by alloc_pages. */
struct kvs_lean_kernels {
    /* A byte buffer of n bytes on the backend (NULL: out of memory); freed with free_buf. */
    struct kvs_dbuf *(*alloc_pages)(struct kvs_backend *b, size_t n);
    /* Quantizes rows' K/V ([n][n_kv_heads][head_dim] ACT) into their slots' pages (I32 [n],
     * block * block_size + offset; -1 skips). */
    void (*write)(struct kvs_backend *b, struct kvs_lean_fmt f, const struct kvs_dbuf *k, const struct kvs_dbuf *v,
                  const struct kvs_dbuf *slots, int n, int n_kv_heads, int head_dim, int block_size,
                  struct kvs_dbuf *pool);
    /* attention_spans (backend.h) over the pages of pool. */
    void (*attention_spans)(struct kvs_backend *b, struct kvs_lean_fmt f, const struct kvs_dbuf *q,
                            const struct kvs_dbuf *pool, const struct kvs_attn_meta *m, const struct kvs_span_list *sp,
                            int n, int n_heads, int n_kv_heads, int head_dim, int block_size, float scale,
                            struct kvs_dbuf *out, struct kvs_dbuf *lse);
    /* attention() (backend.h) over the pages of pool. */
    void (*attention)(struct kvs_backend *b, struct kvs_lean_fmt f, const struct kvs_dbuf *q,
                      const struct kvs_dbuf *pool, const struct kvs_attn_meta *m, int n, int n_heads, int n_kv_heads,
                      int head_dim, int block_size, float scale, struct kvs_dbuf *out);
    /* Copies the page bytes of block src to dst (page_bytes per head, n_kv_heads heads). */
    void (*copy_block)(struct kvs_backend *b, struct kvs_dbuf *pool, int src, int dst, size_t block_bytes);
    /* 1 when the kernels take this format and head shape (the storage refuses the config
     * otherwise). */
    int (*supports)(struct kvs_lean_fmt f, int n_heads, int n_kv_heads, int head_dim);
};

/* The table for backend o (by name, as kv_quest.h's: kernels/kv_lean_pick.c), or NULL with a
 * message (-ENOSYS) when o cannot store LeanKV pages. */
const struct kvs_lean_kernels *kvs_lean_kernels_for(const struct kvs_backend_ops *o, char *err, size_t errlen);

/* The CPU backend's (kernels/cpu/kv_lean.c) and the CUDA backend's (kernels/cuda/kv_lean.cu,
 * builds with nvcc only). */
extern const struct kvs_lean_kernels kvs_lean_kernels_cpu, kvs_lean_kernels_cuda;

#endif
