/* model.h: a Hugging Face model directory, loaded and validated.
 *
 * kvs_model_load() parses config.json (Llama / Qwen2 / Qwen3, incl. llama3 rope scaling and
 * transformers-5 `rope_parameters`), mmaps the safetensors file(s) (single or sharded through
 * model.safetensors.index.json), and checks that every tensor the architecture needs exists
 * with the right shape and a supported dtype (bf16, f16, f32) before anything uses it.
 * Backends read weights through kvs_model_tensor() and convert to their own format.
 *
 * Ownership: kvs_model_load allocates the model; kvs_model_free unmaps and frees it. Tensor
 * views point into the mmap and live as long as the model.
 * Errors: negative errno + a message naming the file and tensor; never aborts on bad files.
 */
#ifndef KVS_MODEL_H
#define KVS_MODEL_H

#include <stddef.h>
#include <stdint.h>

enum kvs_arch { KVS_ARCH_LLAMA = 0, KVS_ARCH_QWEN2 = 1, KVS_ARCH_QWEN3 = 2 };
enum kvs_dtype { KVS_DTYPE_F32 = 0, KVS_DTYPE_F16 = 1, KVS_DTYPE_BF16 = 2 };
enum kvs_rope_type { KVS_ROPE_DEFAULT = 0, KVS_ROPE_LLAMA3 = 1, KVS_ROPE_LINEAR = 2 };

#define KVS_MAX_EOS 8

struct kvs_model_config {
    enum kvs_arch arch;
    char arch_name[64];           /* e.g. "LlamaForCausalLM" */
    int vocab_size;
    int hidden_size;              /* d_model */
    int intermediate_size;        /* MLP width */
    int n_layers;
    int n_heads;                  /* query heads */
    int n_kv_heads;               /* key/value heads (GQA when < n_heads) */
    int head_dim;                 /* may differ from hidden_size / n_heads (Qwen3) */
    float rms_norm_eps;
    int max_position_embeddings;
    int tie_word_embeddings;      /* lm_head shares embed_tokens */
    int attention_bias;           /* q/k/v projections have biases (Qwen2) */
    int qk_norm;                  /* per-head RMSNorm on q and k before RoPE (Qwen3) */
    /* RoPE: neox half-split rotation; inv_freq[i] = theta^(-2i/head_dim), then scaled */
    double rope_theta;
    enum kvs_rope_type rope_type;
    double rope_factor;           /* llama3 / linear */
    double rope_low_freq_factor;  /* llama3 */
    double rope_high_freq_factor; /* llama3 */
    int rope_original_max_pos;    /* llama3 */
    /* token ids from config.json / generation_config.json (-1 = none) */
    int bos_token_id;
    int eos_token_ids[KVS_MAX_EOS];
    int n_eos;
};

struct kvs_tensor_view {
    enum kvs_dtype dtype;
    int ndim;
    int64_t shape[4];
    const void *data;             /* into the mmap */
    size_t nbytes;
    const char *file;             /* shard file name, for messages */
};

struct kvs_model;                 /* opaque */

int kvs_model_load(const char *dir, struct kvs_model **out, char *err, size_t errlen);
void kvs_model_free(struct kvs_model *m);

const struct kvs_model_config *kvs_model_config(const struct kvs_model *m);
const char *kvs_model_dir(const struct kvs_model *m);

/* Looks up a tensor by its Hugging Face name ("model.layers.3.self_attn.q_proj.weight").
 * Returns 0, or -ENOENT with a message. */
int kvs_model_tensor(const struct kvs_model *m, const char *name, struct kvs_tensor_view *out,
                     char *err, size_t errlen);

/* Converts n elements of a tensor (any supported dtype) to fp32. */
void kvs_tensor_to_f32(const struct kvs_tensor_view *t, float *dst, size_t first, size_t n);

/* The RoPE inverse frequencies for this config (head_dim/2 values, scaling applied). */
void kvs_rope_inv_freq(const struct kvs_model_config *c, float *inv_freq_out);

/* Parses only config.json (+ generation_config.json if present) into c. */
int kvs_model_config_load(const char *dir, struct kvs_model_config *c, char *err, size_t errlen);

/* Parses a config.json text (label names it in messages); the GGUF loader builds one from the
 * file's metadata so that both formats share one validation. */
int kvs_model_config_parse(const char *json, const char *label, struct kvs_model_config *c, char *err, size_t errlen);

#endif
