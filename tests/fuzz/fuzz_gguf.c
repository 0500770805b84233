/* fuzz_gguf: libFuzzer target for the GGUF parser, its metadata accessors, the config and
 * tokenizer built from the metadata, and the dequantizers.
 * Build: scripts/fuzz (clang -fsanitize=fuzzer,address,undefined, the library sources).
 * Seeds: tests/fuzz/corpus/gguf/ (small valid files from scripts/make-gguf-references.py fuzz,
 * edge cases). Any input must either parse into tensors that lie inside the buffer, or fail
 * with a message; never crash. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "engine/text/tokenizer.h"
#include "base/util.h"
#include "models/gguf.h"
#include "models/gguf_model.h"
#include "models/gguf_quant.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct kvs_gguf g;
    char err[512];
    err[0] = 0;
    if (kvs_gguf_parse(data, size, "fuzz", &g, err, sizeof err) != 0) {
        if (!err[0]) __builtin_trap(); /* every failure must say why */
        return 0;
    }
    for (uint64_t i = 0; i < g.n_tensors; i++) {
        const struct kvs_gguf_tensor *t = &g.tensors[i];
        if (t->data < data || t->offset > size || t->data + t->nbytes > data + size) __builtin_trap();
        uint32_t be, bb;
        if (kvs_ggml_type_block(t->type, &be, &bb)) __builtin_trap();
        /* dequantize the first row when it is small: every supported type's decoder runs */
        if (kvs_ggml_type_supported(t->type) && t->ne[0] && t->ne[0] <= 4096 && t->nbytes >= t->ne[0] / be * bb) {
            float *row = malloc(t->ne[0] * sizeof *row);
            if (!row) return 0;
            if (kvs_ggml_dequantize(t->type, t->data, row, (size_t)t->ne[0], err, sizeof err)) __builtin_trap();
            free(row);
        }
    }
    for (uint64_t i = 0; i < g.n_kv; i++) {
        const struct kvs_gguf_kv *kv = &g.kvs[i];
        if (kv->type == KVS_GGUF_ARRAY && kv->elem_type == KVS_GGUF_STRING && kv->n < (1u << 20)) {
            struct kvs_gguf_str *s = malloc((kv->n + 1) * sizeof *s);
            if (!s) break;
            kvs_gguf_arr_strs(kv, s);
            for (uint64_t k = 0; k < kv->n; k++)
                if ((const uint8_t *)s[k].p < data || (const uint8_t *)s[k].p + s[k].len > data + size) __builtin_trap();
            free(s);
        }
    }
    struct kvs_model_config c;
    err[0] = 0;
    if (kvs_gguf_model_config(&g, &c, err, sizeof err) != 0 && !err[0]) __builtin_trap();
    struct kvs_tokenizer *tok = NULL;
    err[0] = 0;
    if (kvs_tokenizer_from_gguf(&g, &tok, err, sizeof err) != 0) {
        if (!err[0]) __builtin_trap();
    } else {
        int32_t ids[64];
        kvs_tokenizer_encode(tok, "Hello, world 123!", 17, 1, 1, ids, 64);
        kvs_tokenizer_free(tok);
    }
    kvs_gguf_free(&g);
    return 0;
}
