/* tokenizer.h: Hugging Face tokenizer.json BPE tokenizers, encode and streaming decode.
 *
 * Supports byte-level BPE (GPT-2 style byte-to-unicode mapping; Llama-3, Qwen2/3: split regex
 * from the file, run with PCRE2 in UTF+UCP mode; NFC normalizer via utf8proc when the file asks;
 * a ByteLevel pre-tokenizer with use_regex and no pattern implies the GPT-2 regex) and
 * SentencePiece-style BPE with byte fallback (Llama-2/Mistral: Prepend/Replace "▁" normalizer,
 * <0xXX> byte tokens). Added tokens (special or not) are matched before the model.
 * BOS/EOS come from tokenizer_config.json / generation_config.json / config.json when present.
 *
 * Ownership: kvs_tokenizer_load allocates; kvs_tokenizer_free frees. Output arrays are the
 * caller's. A tokenizer is immutable after load and safe to use from several threads.
 * Errors: negative errno + message (file and field at fault); never aborts on bad input.
 */
#ifndef KVS_TOKENIZER_H
#define KVS_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

struct kvs_tokenizer;

/* Loads DIR/tokenizer.json (+ DIR/tokenizer_config.json, DIR/generation_config.json if present),
 * or the tokenizer of a GGUF model (dir a .gguf file, or a directory holding one and no config.json). */
int kvs_tokenizer_load(const char *dir, struct kvs_tokenizer **out, char *err, size_t errlen);
/* Loads from in-memory JSON texts (config_json may be NULL); for tests and fuzzing. */
int kvs_tokenizer_load_json(const char *tokenizer_json, size_t len, const char *config_json,
                            struct kvs_tokenizer **out, char *err, size_t errlen);
/* Builds the tokenizer from a GGUF file's tokenizer.ggml.* metadata (engine/text/tokenizer_gguf.c);
 * kvs_tokenizer_load calls it when dir is a .gguf file or a directory holding one. */
int kvs_tokenizer_load_gguf(const char *path, struct kvs_tokenizer **out, char *err, size_t errlen);
struct kvs_gguf;
/* The same from a parsed GGUF (models/gguf.h); for tests and fuzzing. */
int kvs_tokenizer_from_gguf(const struct kvs_gguf *g, struct kvs_tokenizer **out, char *err, size_t errlen);
void kvs_tokenizer_free(struct kvs_tokenizer *t);

int kvs_tokenizer_vocab_size(const struct kvs_tokenizer *t);   /* max id + 1 */
int kvs_tokenizer_bos(const struct kvs_tokenizer *t);          /* -1 if none */
/* EOS ids (eos_token plus e.g. <|eot_id|>, <|im_end|> from generation_config); returns count */
int kvs_tokenizer_eos(const struct kvs_tokenizer *t, const int32_t **ids);
int kvs_tokenizer_add_bos_default(const struct kvs_tokenizer *t); /* tokenizer_config add_bos_token */
/* Id of a token string (added or vocab), or -1. */
int32_t kvs_tokenizer_token_id(const struct kvs_tokenizer *t, const char *token);
/* 1 if id is a special added token (skipped when decoding with skip_special). */
int kvs_tokenizer_is_special(const struct kvs_tokenizer *t, int32_t id);

/* Encodes len bytes of text (need not be valid UTF-8: invalid bytes encode like HF does with
 * lossy replacement). add_special=1 prepends BOS when the tokenizer's post-processor does.
 * parse_special=1 matches special added tokens in the text (chat templates); 0 treats
 * them as plain text (user content). Writes at most cap ids; returns the total count
 * (may exceed cap: call again with a bigger buffer) or a negative errno. */
int kvs_tokenizer_encode(const struct kvs_tokenizer *t, const char *text, size_t len, int add_special,
                         int parse_special, int32_t *ids, int cap);
/* kvs_tokenizer_encode into an array it allocates (*out, freed by the caller): the token count,
 * or a negative errno (-E2BIG text too long, -ENOMEM, or the encoder's error). */
int kvs_tokenizer_encode_alloc(const struct kvs_tokenizer *t, const char *text, int add_special, int parse_special,
                               int32_t **out);

/* Decodes ids to text (malloc'ed, NUL-terminated, caller frees). skip_special drops special
 * added tokens. Returns NULL only on OOM. */
char *kvs_tokenizer_decode(const struct kvs_tokenizer *t, const int32_t *ids, int n, int skip_special);

/* Streaming decode: feed one id at a time; text is emitted only at complete UTF-8 boundaries
 * and the concatenation of all pieces (plus the final flush) equals kvs_tokenizer_decode of
 * the whole sequence. State is caller-owned (init/free pair). */
struct kvs_detok {
    const struct kvs_tokenizer *tok;
    int skip_special;
    int n_seen;                   /* tokens fed so far (SentencePiece strips the first space) */
    char pending[64];             /* bytes of an incomplete UTF-8 sequence */
    int n_pending;
};
void kvs_detok_init(struct kvs_detok *d, const struct kvs_tokenizer *t, int skip_special);
/* Writes the text completed by this token at out[0..] (cap bytes incl. NUL, NUL-terminated);
 * returns bytes written (>= 0) or -ENOSPC when cap is too small (state unchanged: retry with a
 * bigger buffer). Ids out of range are ignored, as HF does. For SentencePiece byte fallback, a
 * run of <0xXX> tokens that is not valid UTF-8 gives one U+FFFD per invalid byte while HF
 * replaces every byte of such a run; valid text decodes identically. */
int kvs_detok_feed(struct kvs_detok *d, int32_t id, char *out, size_t cap);
/* Emits whatever is pending (as U+FFFD replacement for a dangling partial sequence). */
int kvs_detok_flush(struct kvs_detok *d, char *out, size_t cap);

#endif
