/* safetensors.h: a bounds-checked parser for the safetensors format, in memory and over mmap.
 *
 * File layout: 8-byte little-endian header length N, N bytes of JSON
 * {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {..}},
 * then the data; offsets are relative to the first byte after the header. Every offset is
 * checked against the buffer size, every size against shape * element size, and tensors must not
 * overlap. Every safetensors dtype is parsed and size-checked, but only F32 / F16 / BF16 are
 * `supported` (readable); others (I64, U8, F8_*...) are flagged so that the model loader can
 * reject them only where a needed tensor has one. Unknown dtype strings and tensors of more than
 * 4 dimensions are errors. __metadata__ is ignored.
 *
 * Ownership: kvs_safetensors_parse_header fills a kvs_st_header that owns its tensor array and
 * names (free with kvs_safetensors_header_free). kvs_safetensors_open mmaps a file and returns a
 * kvs_st_file that owns the mapping and the header (kvs_safetensors_close). Tensor data pointers
 * point into the caller's buffer / the mapping and may be unaligned (read with memcpy, e.g. via
 * kvs_tensor_to_f32).
 * Errors: negative errno and a message naming the file and, where relevant, the tensor.
 */
#ifndef KVS_SAFETENSORS_H
#define KVS_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "models/model.h"

struct kvs_st_tensor {
    char *name;
    enum kvs_dtype dtype;    /* meaningful only when supported */
    int supported;           /* F32 / F16 / BF16 */
    char dtype_name[12];     /* as in the file: "BF16", "I64", ... */
    int ndim;
    int64_t shape[4];
    uint64_t begin, end;     /* byte offsets relative to the data section, begin <= end */
};

struct kvs_st_header {
    struct kvs_st_tensor *tensors;  /* sorted by name (strcmp) */
    int n_tensors;
    uint64_t data_start;            /* 8 + header length: where offset 0 is in the file */
};

/* Parses and validates the header of a whole safetensors image buf[0..len) (the data section
 * must be part of buf: offsets are checked against it). `file` only names the source in
 * messages. Returns 0, or -EINVAL / -ENOTSUP / -ENOMEM with a message. */
int kvs_safetensors_parse_header(const void *buf, size_t len, const char *file,
                                 struct kvs_st_header *out, char *err, size_t errlen);
void kvs_safetensors_header_free(struct kvs_st_header *h);

/* Index of the tensor called name in h, or -1. */
int kvs_safetensors_find(const struct kvs_st_header *h, const char *name);

/* Element size in bytes of a dtype; its safetensors name ("F32", "F16", "BF16"). */
size_t kvs_dtype_size(enum kvs_dtype dt);
const char *kvs_dtype_name(enum kvs_dtype dt);

struct kvs_st_file {
    char *path;
    const uint8_t *map;      /* whole file, read-only mapping */
    size_t size;
    struct kvs_st_header h;
};

/* mmaps and parses path. Returns 0 and *out, or negative errno with a message naming path. */
int kvs_safetensors_open(const char *path, struct kvs_st_file **out, char *err, size_t errlen);
void kvs_safetensors_close(struct kvs_st_file *f);

/* Fills a tensor view for tensor index i of f (file = f->path); the tensor must be supported. */
void kvs_safetensors_view(const struct kvs_st_file *f, int i, struct kvs_tensor_view *out);

#endif
