/* gguf_model.h: a GGUF file as a kvserve model: config from the metadata, tensors under their
 * Hugging Face names, dequantized to fp32.
 *
 * Architectures: general.architecture "llama", "qwen2", "qwen3". The config is built from
 * {arch}.block_count, .embedding_length, .feed_forward_length, .attention.head_count(_kv),
 * .attention.key_length, .attention.layer_norm_rms_epsilon, .context_length, .rope.freq_base,
 * .rope.dimension_count (must equal head_dim), .rope.scaling.type (none / linear), the
 * tokenizer.ggml.bos/eos ids, and is validated like a config.json (models/model_config.c).
 * Tensor names: token_embd -> model.embed_tokens, output_norm -> model.norm, output ->
 * lm_head (absent: tied), blk.N.{attn_norm, attn_q, attn_k, attn_v, attn_output, attn_q_norm,
 * attn_k_norm, ffn_norm, ffn_gate, ffn_up, ffn_down} -> model.layers.N.*. GGUF shapes are
 * innermost first, so a GGUF [in, out] matrix is the HF [out, in] one with the same bytes.
 * llama.cpp's converter permutes the rows of Llama's q and k projections (each head's rotary
 * pairs interleaved instead of split in halves, for ggml's RoPE); kvs_gguf_model_tensor undoes
 * that, as transformers' GGUF loader does. Qwen2/Qwen3 files are not permuted.
 * Any other tensor (e.g. rope_freqs of Llama-3.1 files) is refused by name.
 *
 * Ownership: the caller frees *out (malloc'ed) of kvs_gguf_model_tensor.
 * Errors: negative errno + a message naming the file and the key or tensor.
 */
#ifndef KVS_GGUF_MODEL_H
#define KVS_GGUF_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "models/gguf.h"
#include "models/model.h"

int kvs_gguf_model_config(const struct kvs_gguf *g, struct kvs_model_config *c, char *err, size_t errlen);

/* Hugging Face name of GGUF tensor gguf_name, written to out; 0, or -ENOTSUP for a tensor the
 * runner does not know. *qk_heads is set to the head count to un-permute by (0: none). */
int kvs_gguf_model_hf_name(const struct kvs_gguf *g, const struct kvs_model_config *c, const char *gguf_name,
                           char *out, size_t outlen, int *qk_heads, char *err, size_t errlen);

/* Dequantizes tensor t to fp32 in HF layout (rows un-permuted by qk_heads when > 0); shape
 * gets the HF shape (outermost first) and *ndim its rank. */
int kvs_gguf_model_tensor(const struct kvs_gguf *g, const struct kvs_gguf_tensor *t, int qk_heads, float **out,
                          int *ndim, int64_t shape[4], char *err, size_t errlen);

#endif
