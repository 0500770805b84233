/* chat.h: chat formats: turning OpenAI `messages` into the prompt text the model was trained on.
 *
 * Built in: ChatML (Qwen: <|im_start|>role\n...<|im_end|>\n) and the Llama-3 header format
 * (<|begin_of_text|><|start_header_id|>role<|end_header_id|>\n\n...<|eot_id|>). Each produces
 * exactly what transformers' apply_chat_template(..., add_generation_prompt=True) produces with
 * the model's own template for system/user/assistant conversations.
 * kvs_chat_detect() picks the format from tokenizer_config.json's chat_template (or
 * chat_template.jinja); an unknown template gives KVS_CHAT_UNKNOWN and the caller warns and
 * requires config model.chat_format.
 *
 * Ownership: kvs_chat_render returns a malloc'ed string the caller frees.
 * Errors: NULL + message for an invalid conversation (unknown role, ...).
 */
#ifndef KVS_CHAT_H
#define KVS_CHAT_H

#include <stddef.h>

enum kvs_chat_format { KVS_CHAT_UNKNOWN = 0, KVS_CHAT_CHATML = 1, KVS_CHAT_LLAMA3 = 2 };

struct kvs_chat_message {
    const char *role;      /* system | user | assistant (| developer, mapped to system) */
    const char *content;
};

/* Detects the format of a model directory from its tokenizer_config.json / chat_template.jinja. */
enum kvs_chat_format kvs_chat_detect(const char *model_dir);
/* Parses a config name: "chatml", "llama3"; KVS_CHAT_UNKNOWN for anything else ("auto"). */
enum kvs_chat_format kvs_chat_format_from_name(const char *name);
const char *kvs_chat_format_name(enum kvs_chat_format f);

/* Renders messages (with the generation prompt for the assistant appended).
 * documents: optional texts (n_docs >= 0) placed, in order, at the start of the system turn
 * (a system turn is created when the conversation has none). */
char *kvs_chat_render(enum kvs_chat_format f, const struct kvs_chat_message *msgs, int n_msgs,
                      const char *const *documents, int n_docs, char *err, size_t errlen);

#endif
