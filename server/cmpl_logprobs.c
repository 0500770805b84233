/* cmpl_logprobs.c: completions logprobs JSON and echo (see cmpl_logprobs.h). */
#include "server/cmpl_logprobs.h"

#include "engine/text/tokenizer.h"
#include "base/util.h"
#include "server/handlers.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <string.h>

char *kvs_token_str(struct kvs_server *s, int as_ids, int32_t id)
{
    if (as_ids || !s->tok) {   /* a token-id-only model has no token strings */
        char buf[32];
        snprintf(buf, sizeof buf, "token_id:%d", (int)id);
        return kvs_xstrdup(buf);
    }
    char *t = kvs_tokenizer_decode(s->tok, &id, 1, 0);
    return t ? t : kvs_xstrdup("");
}

cJSON *kvs_cmpl_lp_new(void)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddArrayToObject(o, "tokens");
    cJSON_AddArrayToObject(o, "token_logprobs");
    cJSON_AddArrayToObject(o, "top_logprobs");
    cJSON_AddArrayToObject(o, "text_offset");
    return o;
}

void kvs_cmpl_lp_add(struct kvs_server *s, const struct call *c, cJSON *o, const struct kvs_event *ev, int offset)
{
    char *t = kvs_token_str(s, c->tokens_as_ids, ev->token);
    cJSON_AddItemToArray(cJSON_GetObjectItem(o, "tokens"), cJSON_CreateString(t));
    cJSON_AddItemToArray(cJSON_GetObjectItem(o, "token_logprobs"), cJSON_CreateNumber(ev->logprob));
    cJSON *tops = cJSON_CreateObject();
    for (int i = 0; i < ev->n_top; i++) {
        char *ts = kvs_token_str(s, c->tokens_as_ids, ev->top_ids[i]);
        if (!cJSON_GetObjectItemCaseSensitive(tops, ts)) cJSON_AddNumberToObject(tops, ts, ev->top_logprobs[i]);
        free(ts);
    }
    /* the token itself even when it is not among the top N (lm-eval's greedy check compares
     * its logprob with the dict's maximum) */
    if (!cJSON_GetObjectItemCaseSensitive(tops, t)) cJSON_AddNumberToObject(tops, t, ev->logprob);
    free(t);
    cJSON_AddItemToArray(cJSON_GetObjectItem(o, "top_logprobs"), tops);
    cJSON_AddItemToArray(cJSON_GetObjectItem(o, "text_offset"), cJSON_CreateNumber(offset));
}

void kvs_echo_begin(struct kvs_server *s, struct call *c, struct choice *ch, const char *text, const int32_t *ids,
                    int n)
{
    char *t = text ? kvs_xstrdup(text) : s->tok ? kvs_tokenizer_decode(s->tok, ids, n, 0) : NULL;
    if (!t) t = kvs_xstrdup("");
    kvs_sbuf_append(&ch->text, t, strlen(t));
    free(t);
    ch->text_offset = 0;
    if (!c->logprobs || n <= 0) return;
    ch->lp = kvs_cmpl_lp_new();
    char *ts = kvs_token_str(s, c->tokens_as_ids, ids[0]);
    cJSON_AddItemToArray(cJSON_GetObjectItem(ch->lp, "tokens"), cJSON_CreateString(ts));
    cJSON_AddItemToArray(cJSON_GetObjectItem(ch->lp, "token_logprobs"), cJSON_CreateNull());
    cJSON_AddItemToArray(cJSON_GetObjectItem(ch->lp, "top_logprobs"), cJSON_CreateNull());
    cJSON_AddItemToArray(cJSON_GetObjectItem(ch->lp, "text_offset"), cJSON_CreateNumber(0));
    ch->text_offset = (int)strlen(ts);
    free(ts);
}

void kvs_echo_prompt_token(struct kvs_server *s, struct call *c, struct choice *ch, const struct kvs_event *ev)
{
    if (!c->logprobs || !ch->lp) return;   /* echo without logprobs: scored only to allow max_tokens 0 */
    kvs_cmpl_lp_add(s, c, ch->lp, ev, ch->text_offset);
    char *ts = kvs_token_str(s, c->tokens_as_ids, ev->token);
    ch->text_offset += (int)strlen(ts);
    free(ts);
}
