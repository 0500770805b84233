/* gguf.h: a bounds-checked parser for GGUF files (llama.cpp's model format), in memory and over mmap.
 *
 * File layout (versions 2 and 3, little-endian): "GGUF", u32 version, u64 tensor count, u64
 * metadata count; metadata entries (string key, u32 type, value; arrays are u32 element type,
 * u64 count, elements; strings are u64 length + bytes); tensor infos (string name, u32 n_dims,
 * u64 ne[n_dims] innermost first, u32 ggml type, u64 offset); padding to general.alignment
 * (default 32); the data section. Every length is checked against the buffer before it is read,
 * every tensor's byte range against the data section (rows must be whole quant blocks, ranges
 * must not overlap, offsets must be aligned), counts against what the remaining bytes can hold.
 * Nested arrays and unknown value / tensor types are errors; tensors of a known but unsupported
 * ggml type (IQ*, Q2_K, ...) parse (their sizes are known) and are refused only by whoever reads
 * them (kvs_gguf_type_supported, models/gguf_quant.h).
 *
 * Ownership: kvs_gguf_parse fills a kvs_gguf whose arrays it owns (kvs_gguf_free); key, string
 * and tensor-data pointers point into the caller's buffer, which must outlive it. kvs_gguf_open
 * mmaps a file and owns the mapping as well (kvs_gguf_close). Pointers into the buffer may be
 * unaligned: read through memcpy (the accessors below do).
 * Errors: negative errno and a message naming the file and the key or tensor at fault.
 */
#ifndef KVS_GGUF_H
#define KVS_GGUF_H

#include <stddef.h>
#include <stdint.h>

enum kvs_gguf_vtype {
    KVS_GGUF_U8 = 0, KVS_GGUF_I8 = 1, KVS_GGUF_U16 = 2, KVS_GGUF_I16 = 3, KVS_GGUF_U32 = 4,
    KVS_GGUF_I32 = 5, KVS_GGUF_F32 = 6, KVS_GGUF_BOOL = 7, KVS_GGUF_STRING = 8, KVS_GGUF_ARRAY = 9,
    KVS_GGUF_U64 = 10, KVS_GGUF_I64 = 11, KVS_GGUF_F64 = 12
};

/* ggml tensor types (the numbers are the file format's) */
enum kvs_ggml_type {
    KVS_GGML_F32 = 0, KVS_GGML_F16 = 1, KVS_GGML_Q4_0 = 2, KVS_GGML_Q4_1 = 3, KVS_GGML_Q5_0 = 6,
    KVS_GGML_Q5_1 = 7, KVS_GGML_Q8_0 = 8, KVS_GGML_Q8_1 = 9, KVS_GGML_Q2_K = 10, KVS_GGML_Q3_K = 11,
    KVS_GGML_Q4_K = 12, KVS_GGML_Q5_K = 13, KVS_GGML_Q6_K = 14, KVS_GGML_Q8_K = 15, KVS_GGML_BF16 = 30
};

struct kvs_gguf_str {
    const char *p;          /* into the buffer, not NUL-terminated */
    uint64_t len;
};

struct kvs_gguf_kv {
    struct kvs_gguf_str key;
    uint32_t type;          /* enum kvs_gguf_vtype */
    uint32_t elem_type;     /* arrays: the element type */
    uint64_t n;             /* arrays: element count; scalars 1 */
    const uint8_t *data;    /* the value (arrays: the first element) */
};

struct kvs_gguf_tensor {
    struct kvs_gguf_str name;
    uint32_t type;          /* enum kvs_ggml_type (or another known ggml type) */
    int n_dims;             /* 1..4 */
    uint64_t ne[4];         /* ne[0] innermost (a row), unused dims 1 */
    uint64_t offset;        /* relative to the data section */
    uint64_t nbytes;
    const uint8_t *data;
};

struct kvs_gguf {
    const char *file;       /* for messages (owned by the caller, or by kvs_gguf_open) */
    uint32_t version;
    struct kvs_gguf_kv *kvs;
    uint64_t n_kv;
    struct kvs_gguf_tensor *tensors;
    uint64_t n_tensors;
    uint64_t alignment;
    uint64_t data_start;
    /* kvs_gguf_open only */
    char *path;
    const uint8_t *map;
    size_t map_size;
};

/* Parses buf[0..len); `file` only names the source in messages. 0, or -EINVAL / -ENOTSUP. */
int kvs_gguf_parse(const void *buf, size_t len, const char *file, struct kvs_gguf *out, char *err, size_t errlen);
void kvs_gguf_free(struct kvs_gguf *g);

/* mmaps and parses path. */
int kvs_gguf_open(const char *path, struct kvs_gguf **out, char *err, size_t errlen);
void kvs_gguf_close(struct kvs_gguf *g);

/* 1 when path ends in ".gguf". */
int kvs_gguf_is_gguf_name(const char *path);
/* Resolves a --model argument to a GGUF file: path itself when it names a .gguf file, else the
 * one *.gguf file in directory path that holds no config.json. Returns 1 and the file in out,
 * 0 when path is not a GGUF model (a Hugging Face directory), or -ENAMETOOLONG / -EINVAL (a
 * directory holding several .gguf files) with a message. */
int kvs_gguf_find(const char *path, char *out, size_t outlen, char *err, size_t errlen);

/* ---- metadata ---- */
const struct kvs_gguf_kv *kvs_gguf_get(const struct kvs_gguf *g, const char *key);
const char *kvs_gguf_vtype_name(uint32_t type);
/* Typed reads: 0, -ENOENT when absent (message only when required), -EINVAL on a wrong type or
 * a value out of range (message names key and expected type). Integers accept any integer
 * type; floats accept F32/F64. */
int kvs_gguf_get_u64(const struct kvs_gguf *g, const char *key, int required, uint64_t *out, char *err, size_t errlen);
int kvs_gguf_get_f64(const struct kvs_gguf *g, const char *key, int required, double *out, char *err, size_t errlen);
int kvs_gguf_get_bool(const struct kvs_gguf *g, const char *key, int required, int *out, char *err, size_t errlen);
int kvs_gguf_get_str(const struct kvs_gguf *g, const char *key, int required, struct kvs_gguf_str *out, char *err,
                     size_t errlen);
/* Array of strings: fills out[0..kv->n) (caller-allocated). The array was validated at parse. */
void kvs_gguf_arr_strs(const struct kvs_gguf_kv *kv, struct kvs_gguf_str *out);
/* Element i of a numeric array, as int64 / double (the element type must be numeric). */
int64_t kvs_gguf_arr_i64(const struct kvs_gguf_kv *kv, uint64_t i);
double kvs_gguf_arr_f64(const struct kvs_gguf_kv *kv, uint64_t i);
int kvs_gguf_str_eq(struct kvs_gguf_str s, const char *c);

/* ---- tensors ---- */
const struct kvs_gguf_tensor *kvs_gguf_tensor(const struct kvs_gguf *g, const char *name);
/* Name of a ggml type ("Q4_K"), "?" if unknown; block size in elements and bytes (0 if unknown). */
const char *kvs_ggml_type_name(uint32_t type);
int kvs_ggml_type_block(uint32_t type, uint32_t *elems, uint32_t *bytes);

#endif
