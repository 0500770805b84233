/* request_parse.h: parses and validates the JSON bodies of the API endpoints into plain structs.
 *
 * Pure functions: no tokenizer, engine or network; the fuzz target (tests/fuzz/fuzz_request.c)
 * drives them directly. Everything a client controls is bounded here (counts, lengths, ranges)
 * so the handlers can trust the result. Token ids are checked against vocab_size.
 *
 * Ownership: kvs_api_parse fills *out with malloc'ed members; kvs_api_request_free frees them
 * (safe on a zeroed or partially filled struct). The error struct is caller-owned storage.
 * Errors: kvs_api_parse returns 0, or -EINVAL with *err filled as the OpenAI error it becomes
 * (status 400, type, param = the offending field, code or NULL). Never aborts on client input.
 */
#ifndef KVS_REQUEST_PARSE_H
#define KVS_REQUEST_PARSE_H

#include <stddef.h>
#include <stdint.h>

/* Limits on client input (documented in the README's API section). */
#define KVS_API_MAX_PROMPTS 64        /* strings / token arrays in one completions "prompt" */
#define KVS_API_MAX_N 16              /* choices per prompt */
#define KVS_API_MAX_CHOICES 64        /* prompts x n */
#define KVS_API_MAX_STOP 16
#define KVS_API_MAX_STOP_LEN 256      /* bytes per stop string */
#define KVS_API_MAX_MESSAGES 1024
#define KVS_API_MAX_DOCS 64           /* documents cited by one request */
#define KVS_API_MAX_LOGIT_BIAS 1024
#define KVS_API_MAX_LOGPROBS 20
#define KVS_API_MAX_TOKEN_IDS (1 << 20)
#define KVS_API_MAX_ID_LEN 64         /* document ids */

enum kvs_api_kind {
    KVS_API_COMPLETIONS = 1,
    KVS_API_CHAT = 2,
    KVS_API_TOKENIZE = 3,
    KVS_API_DETOKENIZE = 4,
    KVS_API_DOC_CREATE = 5,
};

struct kvs_api_error {
    int status;                   /* HTTP status */
    char message[512];
    const char *type;             /* "invalid_request_error", ... (static string) */
    char param[64];               /* "" = null */
    const char *code;             /* NULL = null (static string) */
};

struct kvs_api_prompt {
    char *text;                   /* NULL when given as token ids */
    int32_t *ids;
    int n_ids;
};

struct kvs_api_message {
    char *role;                   /* system | developer | user | assistant | tool */
    char *content;                /* text parts joined; "" for a null assistant content */
};

struct kvs_api_request {
    enum kvs_api_kind kind;
    char *model;                  /* NULL when absent (allowed: the served model) */

    /* completions / tokenize: prompt(s) */
    struct kvs_api_prompt *prompts;
    int n_prompts;
    /* chat / tokenize: messages */
    struct kvs_api_message *messages;
    int n_messages;

    int max_tokens;               /* -1 = not given */
    int n;
    int best_of;                  /* candidates per prompt, >= n (default n); the n with the highest
                                   * cumulative logprob are returned (vLLM's best_of) */
    int stream;
    int include_usage;            /* stream_options.include_usage */
    int logprobs;                 /* chat: bool; completions: 1 when "logprobs" is an int */
    int top_logprobs;             /* alternatives per token */
    float temperature;            /* defaults: 1 */
    float top_p;                  /* 1 */
    int top_k;                    /* 0 = off (-1 accepted as off) */
    float min_p;                  /* 0 */
    float presence_penalty, frequency_penalty, repetition_penalty;
    int has_seed;
    uint64_t seed;
    char **stop;
    int n_stop;
    int32_t *bias_ids;
    float *bias_values;
    int n_bias;
    int ignore_eos;
    int skip_special_tokens;      /* default 1 */
    int add_special_tokens;       /* tokenize / completions: default 1; chat tokenize: 0 */
    int add_generation_prompt;    /* tokenize with messages: default 1 */
    int echo;                     /* not supported: rejected when true */
    int tokens_as_ids;            /* return_tokens_as_token_ids (vLLM): logprob tokens as "token_id:N" */
    char *user;
    char **documents;             /* cited document ids, in order */
    int n_documents;

    /* detokenize / documents: token ids; documents: text and optional id */
    int32_t *tokens;
    int n_tokens;
    char *text;
    char *doc_id;
};

/* Parses body[0..len) for the given endpoint. vocab_size > 0 bounds token ids. */
int kvs_api_parse(enum kvs_api_kind kind, const char *body, size_t len, int vocab_size,
                  struct kvs_api_request *out, struct kvs_api_error *err);
void kvs_api_request_free(struct kvs_api_request *r);

/* Fills err (status, type, code, param, formatted message) and returns -EINVAL. */
int kvs_api_error_set(struct kvs_api_error *err, int status, const char *type, const char *code,
                      const char *param, const char *fmt, ...) __attribute__((format(printf, 6, 7)));

/* 1 if s is a valid document id: [A-Za-z0-9_.-], 1..KVS_API_MAX_ID_LEN bytes, not starting with
 * '.' (the rule of engine/docstore.h, kept here so the parser stays free of other modules). */
int kvs_api_valid_doc_id(const char *s);

#endif
