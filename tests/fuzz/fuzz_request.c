/* fuzz_request: kvs_api_parse (server/request_parse.c) on arbitrary bodies. Byte 0 picks the
 * endpoint kind; the rest is the body. Checks: no crash or leak, and on success every bound the
 * handlers rely on holds (counts, token id range, stop lengths, sampling ranges); on failure a
 * 4xx/5xx status and a message. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "server/request_parse.h"

#define VOCAB 5000

static void check(int cond)
{
    if (!cond) abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    enum kvs_api_kind kind = (enum kvs_api_kind)(1 + data[0] % 5);
    struct kvs_api_request r;
    struct kvs_api_error e;
    int rc = kvs_api_parse(kind, (const char *)data + 1, size - 1, VOCAB, &r, &e);
    if (rc) {
        check(e.status >= 400 && e.status < 600 && e.message[0] && e.type);
    } else {
        check(r.n_prompts <= KVS_API_MAX_PROMPTS && r.n >= 1 && r.n <= KVS_API_MAX_N);
        check(r.n_prompts * r.n <= KVS_API_MAX_CHOICES || kind != KVS_API_COMPLETIONS);
        for (int i = 0; i < r.n_prompts; i++) {
            check(r.prompts[i].text || r.prompts[i].n_ids > 0);
            for (int k = 0; k < r.prompts[i].n_ids; k++) check(r.prompts[i].ids[k] >= 0 && r.prompts[i].ids[k] < VOCAB);
        }
        for (int i = 0; i < r.n_tokens; i++) check(r.tokens[i] >= 0 && r.tokens[i] < VOCAB);
        check(r.n_stop <= KVS_API_MAX_STOP);
        for (int i = 0; i < r.n_stop; i++) check(strlen(r.stop[i]) >= 1 && strlen(r.stop[i]) <= KVS_API_MAX_STOP_LEN);
        check(r.temperature >= 0 && r.temperature <= 2 && r.top_p > 0 && r.top_p <= 1 && r.top_k >= 0);
        check(r.max_tokens == -1 || r.max_tokens >= 1);
        check(r.top_logprobs >= 0 && r.top_logprobs <= KVS_API_MAX_LOGPROBS);
        check(r.n_bias <= KVS_API_MAX_LOGIT_BIAS && r.n_documents <= KVS_API_MAX_DOCS);
        for (int i = 0; i < r.n_bias; i++) check(r.bias_ids[i] >= 0 && r.bias_ids[i] < VOCAB);
        for (int i = 0; i < r.n_documents; i++) check(kvs_api_valid_doc_id(r.documents[i]));
        for (int i = 0; i < r.n_messages; i++) check(r.messages[i].role && r.messages[i].content);
        if (r.doc_id) check(kvs_api_valid_doc_id(r.doc_id));
    }
    kvs_api_request_free(&r);
    return 0;
}
