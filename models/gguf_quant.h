/* gguf_quant.h: dequantization of ggml tensor types to fp32 (what the backends take in).
 *
 * Supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, with the block
 * layouts and formulas of ggml's reference dequantize_row_* (ggml-quants.c); checked against
 * gguf-py's gguf.quants.dequantize (tests/unit/test_gguf_quant.c, tests/data/gguf_quant_ref.bin).
 * Every other ggml type (Q2_K, Q3_K, Q8_1, Q8_K, the IQ* and TQ* families, MXFP4, I8..I64, F64)
 * is refused by name.
 *
 * Ownership: the caller owns both buffers. Errors: -ENOTSUP with a message naming the type.
 */
#ifndef KVS_GGUF_QUANT_H
#define KVS_GGUF_QUANT_H

#include <stddef.h>
#include <stdint.h>

/* 1 when kvs_ggml_dequantize handles the type. */
int kvs_ggml_type_supported(uint32_t type);
/* The supported type names, comma-separated, for messages. */
const char *kvs_ggml_supported_list(void);

/* Dequantizes n elements (a whole number of blocks of the type) from src into dst.
 * src must hold n / block_elems * block_bytes bytes (the caller checked it: see gguf.h). */
int kvs_ggml_dequantize(uint32_t type, const void *src, float *dst, size_t n, char *err, size_t errlen);

#endif
