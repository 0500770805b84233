/* fuzz_chat: kvs_chat_render_spans on arbitrary conversations. Input: byte 0 picks the format,
 * byte 1 the number of documents; the rest is fields separated by 0x1e: documents first, then
 * alternating role, content. Checks: no crash, and every document span lies inside the text. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "engine/text/chat.h"
#include "base/util.h"

#define MAX_FIELDS 64

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 2) return 0;
    enum kvs_chat_format f = (enum kvs_chat_format)(data[0] % 5); /* includes invalid values */
    int want_docs = data[1] % 8;
    char *buf = malloc(size - 1);
    if (!buf) return 0;
    memcpy(buf, data + 2, size - 2);
    buf[size - 2] = 0;
    char *fields[MAX_FIELDS];
    int nf = 0;
    char *p = buf;
    while (nf < MAX_FIELDS) {
        fields[nf++] = p;
        char *sep = memchr(p, 0x1e, strlen(p));
        if (!sep) break;
        *sep = 0;
        p = sep + 1;
    }
    int n_docs = want_docs < nf ? want_docs : nf;
    int n_msgs = (nf - n_docs) / 2;
    struct kvs_chat_message msgs[MAX_FIELDS / 2];
    for (int i = 0; i < n_msgs; i++) {
        msgs[i].role = fields[n_docs + 2 * i];
        msgs[i].content = fields[n_docs + 2 * i + 1];
    }
    struct kvs_chat_span spans[8];
    char err[256];
    char *out = kvs_chat_render_spans(f, msgs, n_msgs, (const char *const *)fields, n_docs, spans, err, sizeof err);
    if (out) {
        size_t len = strlen(out);
        for (int d = 0; d < n_docs; d++) KVS_ASSERT(spans[d].offset + spans[d].len <= len);
        free(out);
    }
    free(buf);
    return 0;
}
