/* fuzz_safetensors: libFuzzer target for the safetensors header parser.
 * Build: clang -fsanitize=fuzzer,address -I. tests/fuzz/fuzz_safetensors.c models/\*.c base/util.c -lcjson -lm
 * Seeds: tests/fuzz/corpus/safetensors/ (small valid files, edge cases). Any input must either
 * parse into tensors that lie inside the buffer, or fail with a message; never crash. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "base/util.h"
#include "models/safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct kvs_st_header h;
    char err[256];
    if (kvs_safetensors_parse_header(data, size, "fuzz", &h, err, sizeof err) != 0) {
        if (!err[0]) __builtin_trap(); /* every failure must say why */
        return 0;
    }
    for (int i = 0; i < h.n_tensors; i++) {
        const struct kvs_st_tensor *t = &h.tensors[i];
        /* invariants the loader relies on: inside the buffer, size = shape x dtype */
        if (t->begin > t->end || h.data_start + t->end > size) __builtin_trap();
        uint64_t numel = 1;
        for (int d = 0; d < t->ndim; d++) numel *= (uint64_t)t->shape[d];
        if (t->supported && numel * kvs_dtype_size(t->dtype) != t->end - t->begin) __builtin_trap();
        if (kvs_safetensors_find(&h, t->name) != i) __builtin_trap();
        /* touch the data, converting the first and last elements */
        struct kvs_tensor_view v = {.dtype = t->dtype, .ndim = t->ndim, .data = data + h.data_start + t->begin,
                                    .nbytes = (size_t)(t->end - t->begin), .file = "fuzz"};
        if (numel && t->supported) {
            float f[2];
            kvs_tensor_to_f32(&v, &f[0], 0, 1);
            kvs_tensor_to_f32(&v, &f[1], numel - 1, 1);
        }
    }
    kvs_safetensors_header_free(&h);
    return 0;
}
