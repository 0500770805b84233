/* cmpl_logprobs.h: the /v1/completions logprobs object ({tokens, token_logprobs, top_logprobs,
 * text_offset}, OpenAI's legacy shape as vLLM returns it) and echo (the prompt repeated at the
 * start of the text and, with logprobs, of the logprobs: the first prompt token's logprob and
 * top_logprobs are null, as there is nothing before it to predict it from).
 *
 * Ownership: kvs_token_str returns a malloc'ed string (caller frees); kvs_cmpl_lp_new returns a
 * cJSON object owned by the caller; the other calls append to objects they are given. Every call
 * runs on the loop thread; none fails (out of memory aborts, as kvs_x* do).
 */
#ifndef KVS_SERVER_CMPL_LOGPROBS_H
#define KVS_SERVER_CMPL_LOGPROBS_H

#include <stdint.h>

struct kvs_server;
struct call;
struct choice;
struct kvs_event;
struct cJSON;

/* The token's text, or "token_id:N" with return_tokens_as_token_ids. */
char *kvs_token_str(struct kvs_server *s, int as_ids, int32_t id);
struct cJSON *kvs_cmpl_lp_new(void);
/* Appends ev's token (TOKEN or PROMPT event) at text offset `offset`. top_logprobs holds the
 * top alternatives and, like vLLM, always the token itself (also with logprobs 0). */
void kvs_cmpl_lp_add(struct kvs_server *s, const struct call *c, struct cJSON *o, const struct kvs_event *ev,
                     int offset);
/* Echo: starts ch's text with the prompt (text, or ids[0..n) decoded when the prompt was token
 * ids) and, with logprobs, its logprobs with the first prompt token. */
void kvs_echo_begin(struct kvs_server *s, struct call *c, struct choice *ch, const char *text, const int32_t *ids,
                    int n);
/* Echo: one scored prompt token (KVS_EV_PROMPT) into ch's logprobs. */
void kvs_echo_prompt_token(struct kvs_server *s, struct call *c, struct choice *ch, const struct kvs_event *ev);

#endif
