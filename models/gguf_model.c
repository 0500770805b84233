/* gguf_model.c: GGUF metadata -> model config, GGUF tensor names -> Hugging Face names, and
 * the fp32 tensors (dequantized, q/k rows un-permuted for Llama). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "models/gguf_model.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/util.h"
#include "models/gguf_quant.h"

/* Reads {arch}.suffix as an unsigned integer into the JSON config under json_key. */
static int put_u(const struct kvs_gguf *g, cJSON *cfg, const char *arch, const char *suffix, const char *json_key,
                 int required, uint64_t *val, char *err, size_t errlen)
{
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    const struct kvs_gguf_kv *kv = kvs_gguf_get(g, key);
    if (kv && kv->type == KVS_GGUF_ARRAY)
        return kvs_err(err, errlen, -ENOTSUP, "%s: metadata '%s' is a per-layer array; only one value for all "
                       "layers is supported", g->file, key);
    uint64_t v;
    int rc = kvs_gguf_get_u64(g, key, required, &v, err, errlen);
    if (rc == -ENOENT && !required) return 0;
    if (rc) return rc;
    if (v > (1u << 30)) return kvs_err(err, errlen, -EINVAL, "%s: metadata '%s' = %llu is too large", g->file, key,
                                       (unsigned long long)v);
    cJSON_AddNumberToObject(cfg, json_key, (double)v);
    if (val) *val = v;
    return 0;
}

static int build_config(const struct kvs_gguf *g, cJSON *cfg, char *err, size_t errlen)
{
    struct kvs_gguf_str a;
    int rc = kvs_gguf_get_str(g, "general.architecture", 1, &a, err, errlen);
    if (rc) return rc;
    char arch[32];
    static const char *const names[][2] = {
        {"llama", "LlamaForCausalLM"}, {"qwen2", "Qwen2ForCausalLM"}, {"qwen3", "Qwen3ForCausalLM"}};
    const char *hf = NULL;
    for (size_t i = 0; i < 3; i++)
        if (kvs_gguf_str_eq(a, names[i][0])) {
            hf = names[i][1];
            snprintf(arch, sizeof arch, "%s", names[i][0]);
        }
    if (!hf)
        return kvs_err(err, errlen, -ENOTSUP, "%s: general.architecture \"%.*s\" is not supported (llama, qwen2, qwen3)",
                       g->file, (int)(a.len < 40 ? a.len : 40), a.p);
    cJSON *archs = cJSON_AddArrayToObject(cfg, "architectures");
    cJSON_AddItemToArray(archs, cJSON_CreateString(hf));
    uint64_t embd = 0, heads = 0, head_dim = 0, rope_dim = 0, vdim = 0;
    if ((rc = put_u(g, cfg, arch, "block_count", "num_hidden_layers", 1, NULL, err, errlen))) return rc;
    if ((rc = put_u(g, cfg, arch, "embedding_length", "hidden_size", 1, &embd, err, errlen))) return rc;
    if ((rc = put_u(g, cfg, arch, "feed_forward_length", "intermediate_size", 1, NULL, err, errlen))) return rc;
    if ((rc = put_u(g, cfg, arch, "attention.head_count", "num_attention_heads", 1, &heads, err, errlen))) return rc;
    if ((rc = put_u(g, cfg, arch, "attention.head_count_kv", "num_key_value_heads", 0, NULL, err, errlen))) return rc;
    if ((rc = put_u(g, cfg, arch, "attention.key_length", "head_dim", 0, &head_dim, err, errlen))) return rc;
    if ((rc = put_u(g, cfg, arch, "context_length", "max_position_embeddings", 1, NULL, err, errlen))) return rc;
    char key[128];
    snprintf(key, sizeof key, "%s.attention.value_length", arch);
    if ((rc = kvs_gguf_get_u64(g, key, 0, &vdim, err, errlen)) && rc != -ENOENT) return rc;
    if (!head_dim && heads && embd % heads == 0) head_dim = embd / heads;
    if (vdim && vdim != head_dim)
        return kvs_err(err, errlen, -ENOTSUP, "%s: %s.attention.value_length %llu differs from the key length %llu",
                       g->file, arch, (unsigned long long)vdim, (unsigned long long)head_dim);
    snprintf(key, sizeof key, "%s.rope.dimension_count", arch);
    if ((rc = kvs_gguf_get_u64(g, key, 0, &rope_dim, err, errlen)) && rc != -ENOENT) return rc;
    if (rope_dim && rope_dim != head_dim)
        return kvs_err(err, errlen, -ENOTSUP, "%s: %s = %llu: partial rotary embeddings are not supported (head_dim "
                       "%llu)", g->file, key, (unsigned long long)rope_dim, (unsigned long long)head_dim);
    double v;
    snprintf(key, sizeof key, "%s.attention.layer_norm_rms_epsilon", arch);
    if ((rc = kvs_gguf_get_f64(g, key, 1, &v, err, errlen))) return rc;
    cJSON_AddNumberToObject(cfg, "rms_norm_eps", v);
    snprintf(key, sizeof key, "%s.rope.freq_base", arch);
    rc = kvs_gguf_get_f64(g, key, 0, &v, err, errlen);
    if (rc && rc != -ENOENT) return rc;
    cJSON_AddNumberToObject(cfg, "rope_theta", rc ? 10000.0 : v);
    struct kvs_gguf_str st;
    snprintf(key, sizeof key, "%s.rope.scaling.type", arch);
    rc = kvs_gguf_get_str(g, key, 0, &st, err, errlen);
    if (rc && rc != -ENOENT) return rc;
    if (!rc && !kvs_gguf_str_eq(st, "none")) {
        if (!kvs_gguf_str_eq(st, "linear"))
            return kvs_err(err, errlen, -ENOTSUP, "%s: %s \"%.*s\" is not supported (none, linear)", g->file, key,
                           (int)(st.len < 40 ? st.len : 40), st.p);
        snprintf(key, sizeof key, "%s.rope.scaling.factor", arch);
        if ((rc = kvs_gguf_get_f64(g, key, 1, &v, err, errlen))) return rc;
        cJSON *rs = cJSON_AddObjectToObject(cfg, "rope_scaling");
        cJSON_AddStringToObject(rs, "rope_type", "linear");
        cJSON_AddNumberToObject(rs, "factor", v);
    }
    const struct kvs_gguf_tensor *emb = kvs_gguf_tensor(g, "token_embd.weight");
    if (!emb) return kvs_err(err, errlen, -ENOENT, "%s: tensor 'token_embd.weight' is missing", g->file);
    if (emb->n_dims != 2)
        return kvs_err(err, errlen, -EINVAL, "%s: tensor 'token_embd.weight' has %d dimensions, expected 2", g->file,
                       emb->n_dims);
    cJSON_AddNumberToObject(cfg, "vocab_size", (double)emb->ne[1]);
    cJSON_AddBoolToObject(cfg, "tie_word_embeddings", kvs_gguf_tensor(g, "output.weight") == NULL);
    uint64_t id;
    if (!(rc = kvs_gguf_get_u64(g, "tokenizer.ggml.bos_token_id", 0, &id, err, errlen)))
        cJSON_AddNumberToObject(cfg, "bos_token_id", (double)id);
    else if (rc != -ENOENT) return rc;
    if (!(rc = kvs_gguf_get_u64(g, "tokenizer.ggml.eos_token_id", 0, &id, err, errlen)))
        cJSON_AddNumberToObject(cfg, "eos_token_id", (double)id);
    else if (rc != -ENOENT) return rc;
    return 0;
}

int kvs_gguf_model_config(const struct kvs_gguf *g, struct kvs_model_config *c, char *err, size_t errlen)
{
    cJSON *cfg = cJSON_CreateObject();
    if (!cfg) return kvs_err(err, errlen, -ENOMEM, "out of memory");
    int rc = build_config(g, cfg, err, errlen);
    char *text = rc ? NULL : cJSON_PrintUnformatted(cfg);
    cJSON_Delete(cfg);
    if (rc) return rc;
    if (!text) return kvs_err(err, errlen, -ENOMEM, "out of memory");
    char label[512];
    snprintf(label, sizeof label, "%s (metadata as config.json)", g->file);
    rc = kvs_model_config_parse(text, label, c, err, errlen);
    free(text);
    return rc;
}

int kvs_gguf_model_hf_name(const struct kvs_gguf *g, const struct kvs_model_config *c, const char *n, char *out,
                           size_t outlen, int *qk_heads, char *err, size_t errlen)
{
    static const char *const top[][2] = {
        {"token_embd.weight", "model.embed_tokens.weight"}, {"output_norm.weight", "model.norm.weight"},
        {"output.weight", "lm_head.weight"}};
    static const char *const layer[][2] = {
        {"attn_norm.weight", "input_layernorm.weight"},  {"ffn_norm.weight", "post_attention_layernorm.weight"},
        {"attn_q.weight", "self_attn.q_proj.weight"},    {"attn_k.weight", "self_attn.k_proj.weight"},
        {"attn_v.weight", "self_attn.v_proj.weight"},    {"attn_output.weight", "self_attn.o_proj.weight"},
        {"attn_q.bias", "self_attn.q_proj.bias"},        {"attn_k.bias", "self_attn.k_proj.bias"},
        {"attn_v.bias", "self_attn.v_proj.bias"},        {"attn_q_norm.weight", "self_attn.q_norm.weight"},
        {"attn_k_norm.weight", "self_attn.k_norm.weight"}, {"ffn_gate.weight", "mlp.gate_proj.weight"},
        {"ffn_up.weight", "mlp.up_proj.weight"},         {"ffn_down.weight", "mlp.down_proj.weight"}};
    *qk_heads = 0;
    for (size_t i = 0; i < sizeof top / sizeof top[0]; i++)
        if (!strcmp(n, top[i][0])) {
            snprintf(out, outlen, "%s", top[i][1]);
            return 0;
        }
    int l, used = 0;
    if (sscanf(n, "blk.%d.%n", &l, &used) == 1 && used > 0 && l >= 0 && l < c->n_layers) {
        for (size_t i = 0; i < sizeof layer / sizeof layer[0]; i++)
            if (!strcmp(n + used, layer[i][0])) {
                snprintf(out, outlen, "model.layers.%d.%s", l, layer[i][1]);
                /* llama.cpp's convert permutes Llama's q/k (weights and biases) by head */
                if (c->arch == KVS_ARCH_LLAMA && (i == 2 || i == 6)) *qk_heads = c->n_heads;
                if (c->arch == KVS_ARCH_LLAMA && (i == 3 || i == 7)) *qk_heads = c->n_kv_heads;
                return 0;
            }
    }
    return kvs_err(err, errlen, -ENOTSUP, "%s: tensor '%s' is not understood by kvserve (%s); refusing rather "
                   "than ignoring it", g->file, n,
                   !strcmp(n, "rope_freqs.weight") ? "per-frequency RoPE factors are not supported" : "unknown name");
}

int kvs_gguf_model_tensor(const struct kvs_gguf *g, const struct kvs_gguf_tensor *t, int qk_heads, float **out,
                          int *ndim, int64_t shape[4], char *err, size_t errlen)
{
    *out = NULL;
    const int nl = (int)(t->name.len < 80 ? t->name.len : 80);
    if (!kvs_ggml_type_supported(t->type))
        return kvs_err(err, errlen, -ENOTSUP, "%s: tensor '%.*s': ggml type %s is not supported (supported: %s)",
                       g->file, nl, t->name.p, kvs_ggml_type_name(t->type), kvs_ggml_supported_list());
    uint64_t n = 1;
    *ndim = t->n_dims;
    for (int d = 0; d < t->n_dims; d++) {
        shape[t->n_dims - 1 - d] = (int64_t)t->ne[d];
        n *= t->ne[d];
    }
    if (n > SIZE_MAX / sizeof(float) / 2)
        return kvs_err(err, errlen, -EFBIG, "%s: tensor '%.*s' is too large", g->file, nl, t->name.p);
    float *buf = malloc((size_t)n * sizeof *buf + 1);
    if (!buf) return kvs_err(err, errlen, -ENOMEM, "%s: tensor '%.*s': out of memory (%llu floats)", g->file, nl,
                             t->name.p, (unsigned long long)n);
    int rc = kvs_ggml_dequantize(t->type, t->data, buf, (size_t)n, err, errlen);
    if (rc) {
        free(buf);
        return rc;
    }
    if (qk_heads > 0) {
        /* rows = ne[1] (ne[1] = 1 for a bias): GGUF row h*hd + 2i + j holds HF row h*hd + j*hd/2 + i */
        const uint64_t rows = t->n_dims == 1 ? t->ne[0] : t->ne[1], cols = t->n_dims == 1 ? 1 : t->ne[0];
        if (rows % (uint64_t)qk_heads || (rows / (uint64_t)qk_heads) % 2) {
            free(buf);
            return kvs_err(err, errlen, -EINVAL, "%s: tensor '%.*s': %llu rows do not split into %d heads of even size",
                           g->file, nl, t->name.p, (unsigned long long)rows, qk_heads);
        }
        const uint64_t hd = rows / (uint64_t)qk_heads, half = hd / 2;
        float *dst = malloc((size_t)n * sizeof *dst + 1);
        if (!dst) {
            free(buf);
            return kvs_err(err, errlen, -ENOMEM, "%s: tensor '%.*s': out of memory", g->file, nl, t->name.p);
        }
        for (uint64_t h = 0; h < (uint64_t)qk_heads; h++)
            for (uint64_t i = 0; i < half; i++)
                for (uint64_t j = 0; j < 2; j++)
                    memcpy(dst + (h * hd + j * half + i) * cols, buf + (h * hd + 2 * i + j) * cols, cols * sizeof *dst);
        free(buf);
        buf = dst;
    }
    *out = buf;
    return 0;
}
