/* chat.h: chat formats: turning OpenAI `messages` into the prompt text the model was trained on.
 *
 * Built in: ChatML (Qwen: <|im_start|>role\n...<|im_end|>\n) and the Llama-3 header format
 * (<|begin_of_text|><|start_header_id|>role<|end_header_id|>\n\n...<|eot_id|>). Each produces
 * exactly what transformers' apply_chat_template(..., add_generation_prompt=True) produces with
 * the model's own template for system/user/assistant/tool conversations (developer: see Roles).
 * kvs_chat_detect() picks the format from tokenizer_config.json's chat_template (or
 * chat_template.jinja, or a GGUF file's tokenizer.chat_template); an unknown template gives KVS_CHAT_UNKNOWN and the caller warns and
 * requires config model.chat_format.
 *
 * The formats, and the template each one reproduces byte for byte (tests/unit/test_chat.c
 * against tests/data/chat_references.json, made by scripts/make-chat-references.py):
 *   KVS_CHAT_CHATML  plain ChatML (tests/data/chatml_template.jinja; the demo model):
 *                    "<|im_start|>{role}\n{content}<|im_end|>\n" per message, then
 *                    "<|im_start|>assistant\n". No default system prompt.
 *   KVS_CHAT_QWEN3   Qwen3's template with default arguments (enable_thinking unset, no tools):
 *                    ChatML plus its reasoning rules: an assistant message containing
 *                    "</think>" is split into reasoning (text between the last "<think>" before
 *                    the first "</think>" and that "</think>") and answer (text after the last
 *                    "</think>"); assistant turns after the last real user query (a user turn
 *                    not wrapped in <tool_response>...</tool_response>) are rendered as
 *                    "<think>\n{reasoning}\n</think>\n\n{answer}" when they are the last message
 *                    or have reasoning; earlier assistant turns keep only the answer. The
 *                    generation prompt is "<|im_start|>assistant\n" (thinking on: the model
 *                    opens <think> itself). A separate reasoning_content field is not taken.
 *   KVS_CHAT_SMOLLM  SmolLM2-Instruct's template: CHATML, preceded by
 *                    "<|im_start|>system\n" SMOLLM_SYSTEM "<|im_end|>\n" when the first message
 *                    (after documents made their system turn) is not a system message.
 *   KVS_CHAT_LLAMA3  Llama-3's template: content is stripped of leading/trailing whitespace
 *                    (Python str.strip(): Unicode whitespace), the text starts with
 *                    "<|begin_of_text|>" (see kvs_chat_has_bos).
 * Detection is by markers: "<|im_start|>" and SMOLLM_SYSTEM (no "</think>") -> SMOLLM; "<|im_start|>" -> QWEN3 when the template also mentions "</think>",
 * else CHATML; "<|start_header_id|>" -> LLAMA3. Variants with extras we do not reproduce
 * (Llama-3.1's "Cutting Knowledge Date" preamble, Qwen2.5's default system prompt) are still
 * detected by their markers, with a warning logged, and render without those extras.
 *
 * Roles: system, developer, user, assistant, tool (the OpenAI roles); any other is an error.
 * content NULL is allowed for assistant messages (rendered as ""), an error otherwise.
 * The rule for developer and tool: render what the format's own template renders for them (what
 * transformers' apply_chat_template gives), except where the template would drop the message:
 *   CHATML, LLAMA3  the templates print any role name as given: "<|im_start|>developer\n...",
 *                   "<|start_header_id|>tool<|end_header_id|>\n\n..." (content stripped, as for
 *                   every LLAMA3 turn).
 *   QWEN3           tool: a run of consecutive tool messages becomes one user turn,
 *                   "<|im_start|>user" + "\n<tool_response>\n{content}\n</tool_response>" per
 *                   message + "<|im_end|>\n"; tool turns do not count as the last user query.
 *                   developer: the template has no branch for it and drops the message
 *                   silently (checked with transformers); kvserve renders it as system instead,
 *                   so that the instructions reach the model (it is the OpenAI successor of
 *                   system). This is the one place kvserve deliberately differs from the
 *                   template; scripts/make-chat-references.py asserts the drop and applies the
 *                   mapping for qwen3 only.
 * A tool message's tool_call_id, and an assistant message's tool_calls, are not taken here: the
 * templates print no tool_call_id, and the server refuses tool_calls (tool calling is not
 * implemented, like the request's tools).
 *
 * Documents: the system turn's content becomes the document texts, in order, then the original
 * system content, joined by a blank line ("\n\n"); the system content is appended only when it
 * is non-empty. When messages[0] is not rendered as system (system, or developer under QWEN3), a
 * system message holding only the documents is inserted first (before a kept developer message).
 * E.g. docs {"A","B"} + system "S" -> system content "A\n\nB\n\nS".
 *
 * Ownership: kvs_chat_render returns a malloc'ed string the caller frees.
 * Errors: NULL + message for an invalid conversation (unknown role, ...).
 */
#ifndef KVS_CHAT_H
#define KVS_CHAT_H

#include <stddef.h>

enum kvs_chat_format {
    KVS_CHAT_UNKNOWN = 0, KVS_CHAT_CHATML = 1, KVS_CHAT_LLAMA3 = 2, KVS_CHAT_QWEN3 = 3, KVS_CHAT_SMOLLM = 4
};

/* SmolLM2-Instruct's default system prompt (its template inserts it when messages[0] is not system) */
#define SMOLLM_SYSTEM "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

struct kvs_chat_message {
    const char *role;      /* system | developer | user | assistant | tool (see Roles above) */
    const char *content;
};

/* Detects the format of a model directory from its tokenizer_config.json / chat_template.jinja.
 * chat_template.jinja wins when present (transformers 5 layout); in tokenizer_config.json
 * chat_template is a string or a list of {"name", "template"} from which "default" is taken.
 * Missing or unreadable files give KVS_CHAT_UNKNOWN (the reason is logged). */
enum kvs_chat_format kvs_chat_detect(const char *model_dir);
/* Detects the format from a template's text (what kvs_chat_detect applies to the file). */
enum kvs_chat_format kvs_chat_detect_template(const char *template_text);
/* Parses a config name: "chatml", "qwen3", "llama3", "smollm"; KVS_CHAT_UNKNOWN for anything else ("auto"). */
enum kvs_chat_format kvs_chat_format_from_name(const char *name);
const char *kvs_chat_format_name(enum kvs_chat_format f);

/* 1 when the rendered text already starts with the BOS token's text (LLAMA3:
 * "<|begin_of_text|>"), as transformers' template does; 0 for CHATML/QWEN3 (Qwen has no BOS).
 * Either way, encode the rendered text with add_special=0 and parse_special=1, as
 * apply_chat_template(tokenize=True) does (it passes add_special_tokens=False): adding BOS
 * again would give Llama-3 two <|begin_of_text|> tokens. Checked: Llama-3 "hi" starts
 * [128000, 128006, ...] in transformers, one BOS. */
int kvs_chat_has_bos(enum kvs_chat_format f);

/* The generation prompt kvs_chat_render appends (what apply_chat_template leaves out with
 * add_generation_prompt=False; the messages before it render the same either way); "" for
 * KVS_CHAT_UNKNOWN. A static string. */
const char *kvs_chat_generation_prompt(enum kvs_chat_format f);

/* Renders messages (with the generation prompt for the assistant appended).
 * documents: optional texts (n_docs >= 0) placed, in order, at the start of the system turn
 * (a system turn is created when the conversation has none). */
char *kvs_chat_render(enum kvs_chat_format f, const struct kvs_chat_message *msgs, int n_msgs,
                      const char *const *documents, int n_docs, char *err, size_t errlen);

/* Where document i's text landed in the rendered string: bytes [offset, offset + len). LLAMA3
 * strips the system content's outer whitespace, which can shorten the first/last document's span. */
struct kvs_chat_span {
    size_t offset;
    size_t len;
};

/* kvs_chat_render that also fills doc_spans[0..n_docs) (may be NULL), so that a caller caching
 * per-document KV can find each document inside the prompt. */
char *kvs_chat_render_spans(enum kvs_chat_format f, const struct kvs_chat_message *msgs, int n_msgs,
                            const char *const *documents, int n_docs, struct kvs_chat_span *doc_spans,
                            char *err, size_t errlen);

#endif
