/* test_request_parse: the request-body parser (server/request_parse.c) on valid bodies (every
 * field lands where it should, defaults are OpenAI's) and on invalid ones (400 + param). */
#include <stdio.h>
#include <string.h>

#include "server/request_parse.h"
#include "tests/unit/test_util.h"


static int parse(enum kvs_api_kind k, const char *body, struct kvs_api_request *r, struct kvs_api_error *e)
{
    return kvs_api_parse(k, body, strlen(body), 1000, r, e);
}

static void expect_bad(enum kvs_api_kind k, const char *body, const char *param)
{
    struct kvs_api_request r;
    struct kvs_api_error e;
    int rc = parse(k, body, &r, &e);
    CHECK(rc != 0 && e.status == 400, "accepted: %s", body);
    if (rc) CHECK(!strcmp(e.param, param), "%s: param '%s' != '%s' (%s)", body, e.param, param, e.message);
    kvs_api_request_free(&r);
}

int main(void)
{
    struct kvs_api_request r;
    struct kvs_api_error e;

    CHECK(parse(KVS_API_COMPLETIONS, "{\"prompt\":\"hi\"}", &r, &e) == 0, "minimal: %s", e.message);
    CHECK(r.n_prompts == 1 && !strcmp(r.prompts[0].text, "hi") && r.max_tokens == -1 && r.n == 1 &&
              r.temperature == 1.0f && r.top_p == 1.0f && r.repetition_penalty == 1.0f && r.top_k == 0 &&
              !r.stream && r.skip_special_tokens == 1 && r.add_special_tokens == 1 && !r.model,
          "defaults");
    kvs_api_request_free(&r);

    const char *full = "{\"model\":\"m\",\"prompt\":[[1,2,3],\"x\"],\"max_tokens\":7,\"temperature\":0.5,"
                       "\"top_p\":0.9,\"top_k\":-1,\"min_p\":0.1,\"stop\":[\"a\",\"bb\"],\"seed\":-3,"
                       "\"presence_penalty\":1,\"frequency_penalty\":-1,\"repetition_penalty\":1.2,"
                       "\"logit_bias\":{\"5\":-100,\"7\":2.5},\"logprobs\":3,\"n\":2,\"stream\":true,"
                       "\"stream_options\":{\"include_usage\":true},\"user\":\"u\",\"documents\":[\"d1\",\"d.2\"],"
                       "\"ignore_eos\":true,\"unknown_field\":{\"deep\":[1]}}";
    CHECK(parse(KVS_API_COMPLETIONS, full, &r, &e) == 0, "full: %s", e.message);
    CHECK(!strcmp(r.model, "m") && r.n_prompts == 2 && r.prompts[0].n_ids == 3 && r.prompts[0].ids[2] == 3 &&
              !strcmp(r.prompts[1].text, "x"),
          "prompts");
    CHECK(r.max_tokens == 7 && r.temperature == 0.5f && r.top_k == 0 && r.n == 2 && r.stream && r.include_usage,
          "numbers");
    CHECK(r.n_stop == 2 && !strcmp(r.stop[1], "bb") && r.has_seed && (int64_t)r.seed == -3, "stop/seed");
    CHECK(r.n_bias == 2 && r.bias_ids[1] == 7 && r.bias_values[1] == 2.5f, "logit_bias");
    CHECK(r.logprobs == 1 && r.top_logprobs == 3 && r.n_documents == 2 && !strcmp(r.documents[1], "d.2") &&
              r.ignore_eos && !strcmp(r.user, "u"),
          "logprobs/documents");
    kvs_api_request_free(&r);

    CHECK(parse(KVS_API_CHAT,
                "{\"messages\":[{\"role\":\"system\",\"content\":\"s\"},{\"role\":\"user\",\"content\":"
                "[{\"type\":\"text\",\"text\":\"a\"},{\"type\":\"text\",\"text\":\"b\"}]},"
                "{\"role\":\"assistant\",\"content\":null}],\"max_completion_tokens\":4,\"max_tokens\":9,"
                "\"logprobs\":true,\"top_logprobs\":2}",
                &r, &e) == 0,
          "chat: %s", e.message);
    CHECK(r.n_messages == 3 && !strcmp(r.messages[1].content, "ab") && !strcmp(r.messages[2].content, "") &&
              r.max_tokens == 4 && r.logprobs && r.top_logprobs == 2,
          "chat fields");
    kvs_api_request_free(&r);

    CHECK(parse(KVS_API_TOKENIZE, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}]}", &r, &e) == 0 &&
              r.add_special_tokens == 0 && r.n_messages == 1,
          "tokenize messages defaults to add_special_tokens=false");
    kvs_api_request_free(&r);
    CHECK(parse(KVS_API_DETOKENIZE, "{\"tokens\":[]}", &r, &e) == 0 && r.n_tokens == 0, "detokenize empty");
    kvs_api_request_free(&r);
    CHECK(parse(KVS_API_DOC_CREATE, "{\"tokens\":[1,999],\"id\":\"abc-1\"}", &r, &e) == 0 && r.n_tokens == 2 &&
              !strcmp(r.doc_id, "abc-1"),
          "document tokens");
    kvs_api_request_free(&r);

    expect_bad(KVS_API_COMPLETIONS, "{\"prompt\":[1000]}", "prompt"); /* vocab is 1000 */
    expect_bad(KVS_API_COMPLETIONS, "{\"prompt\":\"x\",\"n\":17}", "n");
    expect_bad(KVS_API_COMPLETIONS, "{\"prompt\":\"x\",\"stop\":[\"1\",\"2\",\"3\",\"4\",\"5\",\"6\",\"7\",\"8\","
                                    "\"9\",\"10\",\"11\",\"12\",\"13\",\"14\",\"15\",\"16\",\"17\"]}",
               "stop");
    expect_bad(KVS_API_COMPLETIONS, "{\"prompt\":\"x\",\"temperature\":1e999}", "temperature");
    expect_bad(KVS_API_COMPLETIONS, "{\"prompt\":\"x\",\"logit_bias\":{\"01x\":1}}", "logit_bias");
    expect_bad(KVS_API_COMPLETIONS, "{\"prompt\":\"x\",\"seed\":0.5}", "seed");
    expect_bad(KVS_API_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"logprobs\":1}", "logprobs");
    expect_bad(KVS_API_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":null}]}", "messages");
    /* role tool (issue 23): accepted with its tool_call_id; the id is required and tool_calls refused */
    CHECK(parse(KVS_API_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":\"q\"},{\"role\":\"assistant\","
                              "\"content\":\"\",\"tool_calls\":[]},{\"role\":\"tool\",\"tool_call_id\":\"c1\","
                              "\"content\":\"r\"},{\"role\":\"developer\",\"content\":\"d\"}]}", &r, &e) == 0 &&
              r.n_messages == 4 && !strcmp(r.messages[2].role, "tool") && !strcmp(r.messages[2].content, "r") &&
              !strcmp(r.messages[3].role, "developer"),
          "tool and developer messages: %s", e.message);
    kvs_api_request_free(&r);
    expect_bad(KVS_API_CHAT, "{\"messages\":[{\"role\":\"tool\",\"content\":\"r\"}]}", "messages");
    expect_bad(KVS_API_CHAT, "{\"messages\":[{\"role\":\"tool\",\"tool_call_id\":null,\"content\":\"r\"}]}", "messages");
    expect_bad(KVS_API_CHAT, "{\"messages\":[{\"role\":\"tool\",\"tool_call_id\":\"c\"}]}", "messages");
    expect_bad(KVS_API_CHAT, "{\"messages\":[{\"role\":\"user\",\"tool_call_id\":\"c\",\"content\":\"r\"}]}", "messages");
    expect_bad(KVS_API_CHAT, "{\"messages\":[{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":\"c\"}]}]}",
               "messages");
    CHECK(parse(KVS_API_CHAT, "{\"messages\":[{\"role\":\"assistant\",\"content\":null,\"function_call\":{\"name\":\"f\"}}]}",
                &r, &e) != 0 && e.status == 400 && e.code && !strcmp(e.code, "unsupported_parameter"),
          "function_call in a message: unsupported_parameter");
    kvs_api_request_free(&r);
    expect_bad(KVS_API_DOC_CREATE, "{\"text\":\"a\",\"id\":\"\"}", "id");
    expect_bad(KVS_API_DOC_CREATE, "{\"text\":\"a\",\"id\":\"x\\u0000y\"}", ""); /* cJSON would cut it */
    CHECK(parse(KVS_API_COMPLETIONS, "{\"prompt\":\"a\\\\u0000\"}", &r, &e) == 0 && !strcmp(r.prompts[0].text, "a\\u0000"), "escaped backslash before u0000");
    kvs_api_request_free(&r);
    expect_bad(KVS_API_COMPLETIONS, "{\"prompt\":\"x\"", "");
    expect_bad(KVS_API_COMPLETIONS, "", "");

    /* a body with an embedded NUL is not valid JSON */
    CHECK(kvs_api_parse(KVS_API_COMPLETIONS, "{\"prompt\":\"a\"}\0junk", 19, 1000, &r, &e) != 0, "trailing NUL");
    kvs_api_request_free(&r);

    if (!kvs_test_fails) printf("request_parse: defaults, every field, chat parts, tokenize/detokenize/documents, 13 rejections: ok\n");
    return kvs_test_summary("test_request_parse");
}
