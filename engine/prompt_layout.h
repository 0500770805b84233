/* prompt_layout.h: a request's prompt token ids from its API parts (text or token-id prompts,
 * or chat messages, and the documents it cites), laid out the way the engine's KV reuse
 * strategy wants them (engine/kv/kv.h doc_segments):
 *   inline     documents go after a leading BOS, in the order given, before the prompt;
 *   segments   documents become segments of their own (cached by content, reused at any
 *              offset, each padded to a KV block): the Block-Attention layout. A completion's
 *              leading BOS is a one-token segment, so it stays first; a chat conversation is
 *              rendered and cut at the documents' spans: every piece up to the end of the last
 *              document (template text before and between documents, and the documents) is a
 *              segment, what follows (the question, later turns, the generation prompt) is
 *              the request's own prompt. A document whose span is its whole text keeps the
 *              docstore's ids; one the template trimmed is tokenized from its span.
 * The server asks the engine which layout applies (kvs_engine_doc_layout) and never knows
 * which strategy runs.
 *
 * Ownership: kvs_prompt_build fills *out with allocated copies that kvs_prompt_set_free
 * releases (also after a failed build). Errors: 0, or -EINVAL with a message and the request
 * field it concerns (*param: "messages" or "prompt"), -ENOMEM.
 */
#ifndef KVS_PROMPT_LAYOUT_H
#define KVS_PROMPT_LAYOUT_H

#include <stddef.h>
#include <stdint.h>

#include "engine/engine.h"
#include "engine/text/chat.h"
#include "engine/text/tokenizer.h"

struct kvs_prompt_doc {
    const char *text;
    size_t text_len;
    const int32_t *tokens;
    int n_tokens;
};

struct kvs_prompt_in {
    const struct kvs_tokenizer *tok;
    enum kvs_chat_format chat_format;
    int doc_segments;             /* kvs_engine_doc_layout */
    int segment_align;            /* slots a segment is padded to (the KV block size) */
    /* a chat request (n_messages > 0 or chat set) or n_prompts completion prompts, each either
     * text (prompt_text[i] != NULL) or ids */
    int chat;
    const struct kvs_chat_message *messages;
    int n_messages;
    int n_prompts;
    const char *const *prompt_text;
    const int32_t *const *prompt_ids;
    const int *prompt_n_ids;
    int add_special_tokens;
    const struct kvs_prompt_doc *docs;
    int n_docs;
};

struct kvs_prompt_set {
    int n;                        /* prompts */
    int32_t **ids;                /* [n][len[i]] */
    int *len;
    int n_segs;                   /* segments every prompt starts with (segments layout) */
    struct kvs_doc_segment *segs;
    int seg_tokens;               /* their tokens (unpadded) */
    int segment_align;
};

int kvs_prompt_build(const struct kvs_prompt_in *in, struct kvs_prompt_set *out, const char **param, char *err,
                     size_t errlen);
void kvs_prompt_set_free(struct kvs_prompt_set *p);
/* Slots prompt i occupies in the KV cache: its tokens plus its segments, each padded. */
int64_t kvs_prompt_slots(const struct kvs_prompt_set *p, int i);

#endif
