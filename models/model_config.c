/* model_config.c: config.json (+ generation_config.json) -> struct kvs_model_config, and the RoPE
 * inverse frequencies it implies.
 *
 * Follows transformers' LlamaConfig / Qwen2Config / Qwen3Config defaults. RoPE parameters come
 * either from transformers-5 `rope_parameters` {rope_theta, rope_type, factor, ...} or from the
 * classic top-level `rope_theta` + `rope_scaling` ({"rope_type" | "type": ...}). Anything the
 * runner cannot compute exactly (yarn/dynamic/longrope rope, partial rotary, sliding window,
 * activations other than SiLU, o_proj/MLP biases) is refused with -ENOTSUP naming the key. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* mmap, strdup, M_PI when built outside the Makefile (fuzzing) */
#endif
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "base/util.h"
#include "models/model.h"

#define MAX_DIM (1 << 24)

struct cfg_ctx {
    const char *path;
    const cJSON *root;
    char *err;
    size_t errlen;
};

static const cJSON *get(const cJSON *obj, const char *key)
{
    const cJSON *j = cJSON_GetObjectItemCaseSensitive(obj, key);
    return (j && !cJSON_IsNull(j)) ? j : NULL;
}

/* Integer key in [lo, hi]; absent/null -> def (or an error when required). */
static int get_int(struct cfg_ctx *c, const cJSON *obj, const char *key, int required, int def, int lo, int hi,
                   int *out)
{
    const cJSON *j = get(obj, key);
    if (!j) {
        if (required) return kvs_err(c->err, c->errlen, -EINVAL, "%s: missing required key \"%s\"", c->path, key);
        *out = def;
        return 0;
    }
    if (!cJSON_IsNumber(j) || floor(j->valuedouble) != j->valuedouble || j->valuedouble < lo || j->valuedouble > hi)
        return kvs_err(c->err, c->errlen, -EINVAL, "%s: \"%s\" must be an integer in [%d, %d]", c->path, key, lo, hi);
    *out = (int)j->valuedouble;
    return 0;
}

static int get_num(struct cfg_ctx *c, const cJSON *obj, const char *key, int required, double def, double *out)
{
    const cJSON *j = get(obj, key);
    if (!j) {
        if (required) return kvs_err(c->err, c->errlen, -EINVAL, "%s: missing required key \"%s\"", c->path, key);
        *out = def;
        return 0;
    }
    if (!cJSON_IsNumber(j) || !isfinite(j->valuedouble))
        return kvs_err(c->err, c->errlen, -EINVAL, "%s: \"%s\" must be a number", c->path, key);
    *out = j->valuedouble;
    return 0;
}

static int get_bool(struct cfg_ctx *c, const cJSON *obj, const char *key, int def, int *out)
{
    const cJSON *j = get(obj, key);
    if (!j) {
        *out = def;
        return 0;
    }
    if (!cJSON_IsBool(j)) return kvs_err(c->err, c->errlen, -EINVAL, "%s: \"%s\" must be true or false", c->path, key);
    *out = cJSON_IsTrue(j) ? 1 : 0;
    return 0;
}

/* eos_token_id: an int, a list of ints, or null. */
static int parse_eos(struct cfg_ctx *c, const cJSON *j, int *ids, int *n)
{
    *n = 0;
    if (!j) return 0;
    if (cJSON_IsNumber(j)) {
        if (floor(j->valuedouble) != j->valuedouble || j->valuedouble < 0 || j->valuedouble > MAX_DIM)
            return kvs_err(c->err, c->errlen, -EINVAL, "%s: \"eos_token_id\" must be a token id", c->path);
        ids[(*n)++] = (int)j->valuedouble;
        return 0;
    }
    if (!cJSON_IsArray(j))
        return kvs_err(c->err, c->errlen, -EINVAL, "%s: \"eos_token_id\" must be an integer or a list of integers",
                       c->path);
    if (cJSON_GetArraySize(j) > KVS_MAX_EOS)
        return kvs_err(c->err, c->errlen, -EINVAL, "%s: \"eos_token_id\" lists %d ids (at most %d supported)", c->path,
                       cJSON_GetArraySize(j), KVS_MAX_EOS);
    for (const cJSON *e = j->child; e; e = e->next) {
        if (!cJSON_IsNumber(e) || floor(e->valuedouble) != e->valuedouble || e->valuedouble < 0 ||
            e->valuedouble > MAX_DIM)
            return kvs_err(c->err, c->errlen, -EINVAL, "%s: \"eos_token_id\" entries must be token ids", c->path);
        ids[(*n)++] = (int)e->valuedouble;
    }
    return 0;
}

static int parse_bos(struct cfg_ctx *c, const cJSON *obj, int *bos)
{
    const cJSON *j = get(obj, "bos_token_id");
    if (!j) return 0;
    /* some configs carry a list here; the first id is the one prepended */
    if (cJSON_IsArray(j)) j = cJSON_GetArrayItem(j, 0);
    if (!j || !cJSON_IsNumber(j) || floor(j->valuedouble) != j->valuedouble || j->valuedouble < 0 ||
        j->valuedouble > MAX_DIM)
        return kvs_err(c->err, c->errlen, -EINVAL, "%s: \"bos_token_id\" must be a token id", c->path);
    *bos = (int)j->valuedouble;
    return 0;
}

/* RoPE: rope_parameters (transformers 5) or rope_theta + rope_scaling (classic). */
static int parse_rope(struct cfg_ctx *c, struct kvs_model_config *cfg)
{
    const cJSON *root = c->root;
    const cJSON *rp = get(root, "rope_parameters");
    const char *what = "rope_parameters";
    int rc;
    if (rp && !cJSON_IsObject(rp))
        return kvs_err(c->err, c->errlen, -EINVAL, "%s: \"rope_parameters\" must be an object", c->path);
    if (!rp) {
        rp = get(root, "rope_scaling");
        what = "rope_scaling";
        if (rp && !cJSON_IsObject(rp))
            return kvs_err(c->err, c->errlen, -EINVAL, "%s: \"rope_scaling\" must be an object or null", c->path);
    }
    /* theta: inside rope_parameters if there, else top level, else transformers' 10000 */
    double theta_top;
    if ((rc = get_num(c, root, "rope_theta", 0, 10000.0, &theta_top))) return rc;
    cfg->rope_theta = theta_top;
    if (rp && (rc = get_num(c, rp, "rope_theta", 0, theta_top, &cfg->rope_theta))) return rc;
    if (!(cfg->rope_theta > 1.0))
        return kvs_err(c->err, c->errlen, -EINVAL, "%s: rope_theta %g must be > 1", c->path, cfg->rope_theta);
    cfg->rope_type = KVS_ROPE_DEFAULT;
    cfg->rope_factor = 1.0;
    cfg->rope_low_freq_factor = 1.0;
    cfg->rope_high_freq_factor = 1.0;
    cfg->rope_original_max_pos = cfg->max_position_embeddings;
    double prf = 1.0;
    if ((rc = get_num(c, root, "partial_rotary_factor", 0, 1.0, &prf))) return rc;
    if (rp && (rc = get_num(c, rp, "partial_rotary_factor", 0, prf, &prf))) return rc;
    if (prf != 1.0)
        return kvs_err(c->err, c->errlen, -ENOTSUP, "%s: partial_rotary_factor %g is not supported (only 1.0)", c->path,
                       prf);
    if (!rp) return 0;
    const cJSON *type = get(rp, "rope_type");
    if (!type) type = get(rp, "type");
    if (!type) return 0; /* rope_parameters with only rope_theta */
    if (!cJSON_IsString(type))
        return kvs_err(c->err, c->errlen, -EINVAL, "%s: %s.rope_type must be a string", c->path, what);
    const char *t = type->valuestring;
    if (!strcmp(t, "default")) return 0;
    if (!strcmp(t, "linear")) {
        cfg->rope_type = KVS_ROPE_LINEAR;
        if ((rc = get_num(c, rp, "factor", 1, 1.0, &cfg->rope_factor))) return rc;
    } else if (!strcmp(t, "llama3")) {
        cfg->rope_type = KVS_ROPE_LLAMA3;
        if ((rc = get_num(c, rp, "factor", 1, 1.0, &cfg->rope_factor))) return rc;
        if ((rc = get_num(c, rp, "low_freq_factor", 1, 1.0, &cfg->rope_low_freq_factor))) return rc;
        if ((rc = get_num(c, rp, "high_freq_factor", 1, 1.0, &cfg->rope_high_freq_factor))) return rc;
        if ((rc = get_int(c, rp, "original_max_position_embeddings", 1, 0, 1, 1 << 30, &cfg->rope_original_max_pos)))
            return rc;
        if (!(cfg->rope_low_freq_factor > 0) || !(cfg->rope_high_freq_factor > cfg->rope_low_freq_factor))
            return kvs_err(c->err, c->errlen, -EINVAL,
                           "%s: %s: llama3 needs 0 < low_freq_factor < high_freq_factor (got %g, %g)", c->path, what,
                           cfg->rope_low_freq_factor, cfg->rope_high_freq_factor);
    } else {
        return kvs_err(c->err, c->errlen, -ENOTSUP,
                       "%s: %s.rope_type \"%.40s\" is not supported (default, linear, llama3)", c->path, what, t);
    }
    if (!(cfg->rope_factor >= 1.0))
        return kvs_err(c->err, c->errlen, -EINVAL, "%s: %s.factor %g must be >= 1", c->path, what, cfg->rope_factor);
    return 0;
}

static int parse_config(struct cfg_ctx *c, struct kvs_model_config *cfg)
{
    const cJSON *root = c->root;
    int rc;
    if (!cJSON_IsObject(root)) return kvs_err(c->err, c->errlen, -EINVAL, "%s: not a JSON object", c->path);
    memset(cfg, 0, sizeof *cfg);

    /* architecture: architectures[0], else model_type */
    const char *name = NULL;
    const cJSON *archs = get(root, "architectures");
    if (archs) {
        if (!cJSON_IsArray(archs) || !cJSON_IsString(cJSON_GetArrayItem(archs, 0)))
            return kvs_err(c->err, c->errlen, -EINVAL, "%s: \"architectures\" must be a list of strings", c->path);
        name = cJSON_GetArrayItem(archs, 0)->valuestring;
    } else {
        const cJSON *mt = get(root, "model_type");
        if (!mt || !cJSON_IsString(mt))
            return kvs_err(c->err, c->errlen, -EINVAL, "%s: neither \"architectures\" nor \"model_type\" is given",
                           c->path);
        if (!strcmp(mt->valuestring, "llama")) name = "LlamaForCausalLM";
        else if (!strcmp(mt->valuestring, "qwen2")) name = "Qwen2ForCausalLM";
        else if (!strcmp(mt->valuestring, "qwen3")) name = "Qwen3ForCausalLM";
        else name = mt->valuestring;
    }
    if (!strcmp(name, "LlamaForCausalLM")) cfg->arch = KVS_ARCH_LLAMA;
    else if (!strcmp(name, "Qwen2ForCausalLM")) cfg->arch = KVS_ARCH_QWEN2;
    else if (!strcmp(name, "Qwen3ForCausalLM")) cfg->arch = KVS_ARCH_QWEN3;
    else
        return kvs_err(c->err, c->errlen, -ENOTSUP,
                       "%s: unsupported architecture \"%.60s\" (supported: LlamaForCausalLM, Qwen2ForCausalLM, "
                       "Qwen3ForCausalLM)",
                       c->path, name);
    snprintf(cfg->arch_name, sizeof cfg->arch_name, "%s", name);

    if ((rc = get_int(c, root, "vocab_size", 1, 0, 1, MAX_DIM, &cfg->vocab_size))) return rc;
    if ((rc = get_int(c, root, "hidden_size", 1, 0, 1, MAX_DIM, &cfg->hidden_size))) return rc;
    if ((rc = get_int(c, root, "intermediate_size", 1, 0, 1, MAX_DIM, &cfg->intermediate_size))) return rc;
    if ((rc = get_int(c, root, "num_hidden_layers", 1, 0, 1, 4096, &cfg->n_layers))) return rc;
    if ((rc = get_int(c, root, "num_attention_heads", 1, 0, 1, 4096, &cfg->n_heads))) return rc;
    if ((rc = get_int(c, root, "num_key_value_heads", 0, cfg->n_heads, 1, 4096, &cfg->n_kv_heads))) return rc;
    if (cfg->n_heads % cfg->n_kv_heads)
        return kvs_err(c->err, c->errlen, -EINVAL, "%s: num_attention_heads %d is not a multiple of num_key_value_heads %d",
                       c->path, cfg->n_heads, cfg->n_kv_heads);
    if (!get(root, "head_dim") && cfg->hidden_size % cfg->n_heads)
        return kvs_err(c->err, c->errlen, -EINVAL, "%s: hidden_size %d is not a multiple of num_attention_heads %d",
                       c->path, cfg->hidden_size, cfg->n_heads);
    if ((rc = get_int(c, root, "head_dim", 0, cfg->hidden_size / cfg->n_heads, 2, 4096, &cfg->head_dim))) return rc;
    if (cfg->head_dim % 2)
        return kvs_err(c->err, c->errlen, -EINVAL, "%s: head_dim %d must be even for RoPE", c->path, cfg->head_dim);
    if ((int64_t)cfg->n_heads * cfg->head_dim > MAX_DIM)
        return kvs_err(c->err, c->errlen, -EINVAL, "%s: num_attention_heads * head_dim is too large", c->path);

    double eps;
    if ((rc = get_num(c, root, "rms_norm_eps", 0, 1e-6, &eps))) return rc;
    if (!(eps > 0 && eps < 1))
        return kvs_err(c->err, c->errlen, -EINVAL, "%s: rms_norm_eps %g must be in (0, 1)", c->path, eps);
    cfg->rms_norm_eps = (float)eps;
    int def_max_pos = cfg->arch == KVS_ARCH_LLAMA ? 2048 : 32768;
    if ((rc = get_int(c, root, "max_position_embeddings", 0, def_max_pos, 1, 1 << 30, &cfg->max_position_embeddings)))
        return rc;
    if ((rc = get_bool(c, root, "tie_word_embeddings", 0, &cfg->tie_word_embeddings))) return rc;

    /* Qwen2 always has q/k/v biases (its config has no switch); in Llama/Qwen3 attention_bias
     * would also add an o_proj bias, which the runner does not implement. */
    int bias = 0, mlp_bias = 0;
    if ((rc = get_bool(c, root, "attention_bias", 0, &bias))) return rc;
    if ((rc = get_bool(c, root, "mlp_bias", 0, &mlp_bias))) return rc;
    if (cfg->arch == KVS_ARCH_QWEN2) cfg->attention_bias = 1;
    else if (bias)
        return kvs_err(c->err, c->errlen, -ENOTSUP, "%s: attention_bias=true is not supported for %s", c->path, name);
    if (mlp_bias) return kvs_err(c->err, c->errlen, -ENOTSUP, "%s: mlp_bias=true is not supported", c->path);
    cfg->qk_norm = cfg->arch == KVS_ARCH_QWEN3;
    int sliding = 0;
    if ((rc = get_bool(c, root, "use_sliding_window", 0, &sliding))) return rc;
    if (sliding) return kvs_err(c->err, c->errlen, -ENOTSUP, "%s: use_sliding_window=true is not supported", c->path);
    const cJSON *act = get(root, "hidden_act");
    if (act && (!cJSON_IsString(act) || strcmp(act->valuestring, "silu")))
        return kvs_err(c->err, c->errlen, -ENOTSUP, "%s: hidden_act must be \"silu\"", c->path);

    if ((rc = parse_rope(c, cfg))) return rc;

    cfg->bos_token_id = -1;
    if ((rc = parse_bos(c, root, &cfg->bos_token_id))) return rc;
    if ((rc = parse_eos(c, get(root, "eos_token_id"), cfg->eos_token_ids, &cfg->n_eos))) return rc;
    for (int i = cfg->n_eos; i < KVS_MAX_EOS; i++) cfg->eos_token_ids[i] = -1;
    return 0;
}

static int load_json(const char *path, cJSON **out, char *err, size_t errlen)
{
    size_t len;
    char *text = kvs_read_file(path, &len, err, errlen);
    if (!text) return -ENOENT;
    if (strlen(text) != len) {
        free(text);
        return kvs_err(err, errlen, -EINVAL, "%s: contains a NUL byte", path);
    }
    *out = cJSON_Parse(text);
    free(text);
    if (!*out) return kvs_err(err, errlen, -EINVAL, "%s: not valid JSON", path);
    return 0;
}

int kvs_model_config_parse(const char *json, const char *label, struct kvs_model_config *c, char *err, size_t errlen)
{
    cJSON *root = cJSON_Parse(json);
    if (!root) return kvs_err(err, errlen, -EINVAL, "%s: not valid JSON", label);
    struct cfg_ctx ctx = {label, root, err, errlen};
    int rc = parse_config(&ctx, c);
    cJSON_Delete(root);
    return rc;
}

int kvs_model_config_load(const char *dir, struct kvs_model_config *c, char *err, size_t errlen)
{
    char path[4096];
    if (snprintf(path, sizeof path, "%s/config.json", dir) >= (int)sizeof path)
        return kvs_err(err, errlen, -ENAMETOOLONG, "%s: path too long", dir);
    cJSON *root = NULL;
    int rc = load_json(path, &root, err, errlen);
    if (rc == -ENOENT) return kvs_err(err, errlen, -ENOENT, "%s: cannot read config.json (is this a model directory?)", path);
    if (rc) return rc;
    struct cfg_ctx ctx = {path, root, err, errlen};
    rc = parse_config(&ctx, c);
    cJSON_Delete(root);
    if (rc) return rc;

    /* generation_config.json, when present, overrides bos/eos (Llama-3-Instruct adds <|eot_id|>) */
    snprintf(path, sizeof path, "%s/generation_config.json", dir);
    FILE *f = fopen(path, "rb");
    if (!f) return 0;
    fclose(f);
    if ((rc = load_json(path, &root, err, errlen))) return rc;
    ctx.path = path;
    ctx.root = root;
    if (!cJSON_IsObject(root)) rc = kvs_err(err, errlen, -EINVAL, "%s: not a JSON object", path);
    if (!rc) rc = parse_bos(&ctx, root, &c->bos_token_id);
    const cJSON *eos = rc ? NULL : get(root, "eos_token_id");
    if (eos) {
        int ids[KVS_MAX_EOS], n;
        rc = parse_eos(&ctx, eos, ids, &n);
        if (!rc) {
            for (int i = 0; i < KVS_MAX_EOS; i++) c->eos_token_ids[i] = i < n ? ids[i] : -1;
            c->n_eos = n;
        }
    }
    cJSON_Delete(root);
    return rc;
}

/* Mirrors transformers step by step in float32 (torch computes inv_freq in float32 and python
 * scalars are cast to the tensor's dtype), so the result matches to within pow's last bit; the
 * llama3 branch is _compute_llama3_parameters: keep high frequencies, divide low ones by factor,
 * interpolate smoothly in between. */
void kvs_rope_inv_freq(const struct kvs_model_config *c, float *inv_freq_out)
{
    const int half = c->head_dim / 2;
    const float factor = (float)c->rope_factor;
    const float old_ctx = (float)c->rope_original_max_pos;
    const float low = (float)c->rope_low_freq_factor;
    /* python evaluates these on doubles, then torch casts the scalar to float32 */
    const float low_wavelen = (float)((double)c->rope_original_max_pos / c->rope_low_freq_factor);
    const float high_wavelen = (float)((double)c->rope_original_max_pos / c->rope_high_freq_factor);
    const float two_pi = (float)(2.0 * M_PI);
    const float band = (float)(c->rope_high_freq_factor - c->rope_low_freq_factor);
    for (int i = 0; i < half; i++) {
        /* 1.0 / (base ** (arange(0, dim, 2).float() / dim)) */
        float e = (float)(2 * i) / (float)c->head_dim;
        float p = (float)pow((double)(float)c->rope_theta, (double)e);
        float f = 1.0f / p;
        switch (c->rope_type) {
        case KVS_ROPE_DEFAULT: break;
        case KVS_ROPE_LINEAR: f = f / factor; break;
        case KVS_ROPE_LLAMA3: {
            float wavelen = two_pi / f;
            float scaled = wavelen > low_wavelen ? f / factor : f;
            if (!(wavelen < high_wavelen) && !(wavelen > low_wavelen)) {
                float smooth = (old_ctx / wavelen - low) / band;
                scaled = (1.0f - smooth) * scaled / factor + smooth * scaled;
            }
            f = scaled;
            break;
        }
        }
        inv_freq_out[i] = f;
    }
}
