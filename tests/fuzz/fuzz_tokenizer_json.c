/* fuzz_tokenizer_json: libFuzzer target. The input bytes are a tokenizer.json; when it loads,
 * a few strings (and the input itself) are encoded, decoded and stream-decoded.
 * Built and run by scripts/fuzz (clang -fsanitize=fuzzer,address,undefined).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "engine/text/tokenizer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct kvs_tokenizer *t = NULL;
    char err[256];
    if (kvs_tokenizer_load_json((const char *)data, size, "{\"bos_token\":\"a\",\"eos_token\":{\"content\":\"b\"}}", &t,
                                err, sizeof err) != 0)
        return 0;
    const char *texts[] = {"Hello world", "  a\tb\r\n<s>é😀", "\xff\xfe bad \xe2\x82", "<|im_start|>x"};
    int32_t ids[512];
    for (int i = 0; i < 5; i++) {
        const char *s = i < 4 ? texts[i] : (const char *)data;
        size_t n = i < 4 ? strlen(s) : (size < 256 ? size : 256);
        int k = kvs_tokenizer_encode(t, s, n, i & 1, (i >> 1) & 1, ids, 512);
        if (k < 0) continue;
        if (k > 512) k = 512;
        for (int j = 0; j < k; j++)
            if (ids[j] < 0 || ids[j] >= kvs_tokenizer_vocab_size(t)) abort();
        char *full = kvs_tokenizer_decode(t, ids, k, i & 1);
        struct kvs_detok d;
        char piece[4096];
        kvs_detok_init(&d, t, i & 1);
        for (int j = 0; j < k; j++) kvs_detok_feed(&d, ids[j], piece, sizeof piece);
        kvs_detok_flush(&d, piece, sizeof piece);
        free(full);
    }
    kvs_tokenizer_free(t);
    return 0;
}
