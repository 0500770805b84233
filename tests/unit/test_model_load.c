/* test_model_load: loads every committed tiny model and checks its config, tensor values
 * (against tensor_samples.json written from transformers) and RoPE frequencies (against
 * transformers' rotary embedding), then breaks copies of the models on purpose and checks that
 * each break fails with a message naming the file (and tensor) instead of crashing. */
#include <cjson/cJSON.h>
#include <dirent.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/util.h"
#include "models/model.h"
#include "models/safetensors.h"
#include "tests/unit/test_util.h"

static char g_models[4096], g_tmp[4096];

static cJSON *read_json(const char *path)
{
    char err[512];
    size_t len;
    char *s = kvs_read_file(path, &len, err, sizeof err);
    if (!s) {
        fprintf(stderr, "cannot read %s: %s\n", path, err);
        exit(2);
    }
    cJSON *j = cJSON_Parse(s);
    free(s);
    if (!j) {
        fprintf(stderr, "%s: bad JSON\n", path);
        exit(2);
    }
    return j;
}

static struct kvs_model *load_ok(const char *name)
{
    char dir[4600], err[1024];
    snprintf(dir, sizeof dir, "%s/%s", g_models, name);
    struct kvs_model *m = NULL;
    int rc = kvs_model_load(dir, &m, err, sizeof err);
    CHECK(rc == 0 && m, "loading %s: rc=%d %s", name, rc, err);
    return rc ? NULL : m;
}

/* Compares a model's tensors with the values transformers reported for them. */
static void check_samples(const struct kvs_model *m, const char *sample_model, enum kvs_dtype want_dtype)
{
    char path[4600], err[512];
    snprintf(path, sizeof path, "%s/%s/tensor_samples.json", g_models, sample_model);
    cJSON *root = read_json(path);
    int n = 0;
    for (const cJSON *t = root->child; t; t = t->next) {
        struct kvs_tensor_view v;
        int rc = kvs_model_tensor(m, t->string, &v, err, sizeof err);
        CHECK(rc == 0, "%s: %s", t->string, err);
        if (rc) continue;
        const cJSON *shape = cJSON_GetObjectItem(t, "shape");
        CHECK(v.ndim == cJSON_GetArraySize(shape), "%s ndim %d", t->string, v.ndim);
        for (int d = 0; d < v.ndim && d < cJSON_GetArraySize(shape); d++)
            CHECK(v.shape[d] == (int64_t)cJSON_GetArrayItem(shape, d)->valuedouble, "%s dim %d", t->string, d);
        CHECK(v.dtype == want_dtype, "%s dtype %d", t->string, v.dtype);
        for (const cJSON *p = cJSON_GetObjectItem(t, "values")->child; p; p = p->next) {
            size_t idx = (size_t)cJSON_GetArrayItem(p, 0)->valuedouble;
            float want = (float)cJSON_GetArrayItem(p, 1)->valuedouble, got;
            kvs_tensor_to_f32(&v, &got, idx, 1);
            CHECK(got == want, "%s[%zu] = %.9g, transformers says %.9g", t->string, idx, got, want);
            n++;
        }
    }
    CHECK(n >= 20, "only %d sampled values", n);
    cJSON_Delete(root);
}

/* kvs_rope_inv_freq vs transformers' inv_freq: within 2 float32 ulps (pow may differ in its last bit). */
static void check_inv_freq(const struct kvs_model_config *c, const cJSON *ref, const char *what)
{
    int half = c->head_dim / 2;
    CHECK(cJSON_GetArraySize(ref) == half, "%s: %d reference values, head_dim/2 = %d", what, cJSON_GetArraySize(ref),
          half);
    if (cJSON_GetArraySize(ref) != half) return;
    float *f = kvs_xmalloc(sizeof(float) * (size_t)half);
    kvs_rope_inv_freq(c, f);
    double worst = 0;
    for (int i = 0; i < half; i++) {
        double want = cJSON_GetArrayItem(ref, i)->valuedouble;
        double rel = fabs(f[i] - want) / fabs(want);
        if (rel > worst) worst = rel;
        CHECK(rel < 2.5e-7, "%s: inv_freq[%d] = %.9g, transformers %.9g", what, i, f[i], want);
    }
    printf("  rope %-18s head_dim %3d: max rel err vs transformers %.2e\n", what, c->head_dim, worst);
    free(f);
}

static void check_model_rope(const struct kvs_model *m, const char *name)
{
    char path[4600];
    snprintf(path, sizeof path, "%s/%s/reference.json", g_models, name);
    cJSON *root = read_json(path);
    check_inv_freq(kvs_model_config(m), cJSON_GetObjectItem(root, "rope_inv_freq"), name);
    cJSON_Delete(root);
}

static void check_eos(const struct kvs_model_config *c, int n, const int *ids, const char *name)
{
    CHECK(c->n_eos == n, "%s: n_eos %d, want %d", name, c->n_eos, n);
    for (int i = 0; i < n && i < c->n_eos; i++) CHECK(c->eos_token_ids[i] == ids[i], "%s: eos[%d]", name, i);
}

static void test_tiny_models(void)
{
    struct kvs_model *m;
    const struct kvs_model_config *c;

    if ((m = load_ok("llama"))) {
        c = kvs_model_config(m);
        CHECK(c->arch == KVS_ARCH_LLAMA && !strcmp(c->arch_name, "LlamaForCausalLM"), "arch");
        CHECK(c->vocab_size == 1024 && c->hidden_size == 64 && c->intermediate_size == 176, "dims");
        CHECK(c->n_layers == 2 && c->n_heads == 4 && c->n_kv_heads == 2 && c->head_dim == 16, "heads");
        CHECK(c->rms_norm_eps == 1e-5f && c->max_position_embeddings == 512, "eps/max_pos");
        CHECK(!c->tie_word_embeddings && !c->attention_bias && !c->qk_norm, "flags");
        CHECK(c->rope_theta == 500000.0 && c->rope_type == KVS_ROPE_DEFAULT, "rope (rope_parameters)");
        CHECK(c->bos_token_id == 1, "bos %d", c->bos_token_id);
        check_eos(c, 2, (int[]){2, 7}, "llama (generation_config override)");
        check_samples(m, "llama", KVS_DTYPE_F32);
        check_model_rope(m, "llama");
        struct kvs_tensor_view a, b;
        char err[256];
        CHECK(!kvs_model_tensor(m, "lm_head.weight", &a, err, sizeof err) &&
                  !kvs_model_tensor(m, "model.embed_tokens.weight", &b, err, sizeof err) && a.data != b.data,
              "untied lm_head must be its own tensor");
        CHECK(kvs_model_tensor(m, "model.layers.9.mlp.up_proj.weight", &a, err, sizeof err) == -ENOENT &&
                  strstr(err, "model.layers.9.mlp.up_proj.weight"),
              "unknown tensor: %s", err);
        kvs_model_free(m);
    }
    if ((m = load_ok("llama-bf16"))) {
        check_samples(m, "llama-bf16", KVS_DTYPE_BF16);
        check_eos(kvs_model_config(m), 2, (int[]){2, 7}, "llama-bf16");
        kvs_model_free(m);
    }
    if ((m = load_ok("llama31"))) {
        c = kvs_model_config(m);
        CHECK(c->arch == KVS_ARCH_LLAMA && c->tie_word_embeddings, "tied");
        CHECK(c->rope_type == KVS_ROPE_LLAMA3 && c->rope_factor == 8.0 && c->rope_low_freq_factor == 1.0 &&
                  c->rope_high_freq_factor == 4.0 && c->rope_original_max_pos == 64 && c->rope_theta == 500000.0,
              "llama3 rope_scaling");
        CHECK(c->max_position_embeddings == 256, "max_pos");
        check_eos(c, 3, (int[]){2, 5, 9}, "llama31 (eos list)");
        check_samples(m, "llama31", KVS_DTYPE_F32);
        check_model_rope(m, "llama31");
        struct kvs_tensor_view a, b;
        char err[256];
        CHECK(!kvs_model_tensor(m, "lm_head.weight", &a, err, sizeof err) &&
                  !kvs_model_tensor(m, "model.embed_tokens.weight", &b, err, sizeof err) && a.data == b.data,
              "tied lm_head must be embed_tokens");
        kvs_model_free(m);
    }
    if ((m = load_ok("qwen2"))) {
        c = kvs_model_config(m);
        CHECK(c->arch == KVS_ARCH_QWEN2 && c->attention_bias && !c->qk_norm && c->tie_word_embeddings, "qwen2 flags");
        CHECK(c->rope_theta == 1000000.0 && c->rope_type == KVS_ROPE_DEFAULT, "qwen2 rope (top-level rope_theta)");
        CHECK(c->rms_norm_eps == 1e-6f && c->bos_token_id == -1, "qwen2 eps/bos");
        check_eos(c, 1, (int[]){3}, "qwen2");
        check_samples(m, "qwen2", KVS_DTYPE_F32);
        check_model_rope(m, "qwen2");
        kvs_model_free(m);
    }
    const char *q3[] = {"qwen3", "qwen3-sharded"};
    struct kvs_model *q3m[2] = {NULL, NULL};
    for (int i = 0; i < 2; i++) {
        if (!(m = q3m[i] = load_ok(q3[i]))) continue;
        c = kvs_model_config(m);
        CHECK(c->arch == KVS_ARCH_QWEN3 && c->qk_norm && !c->attention_bias && c->tie_word_embeddings, "%s flags",
              q3[i]);
        CHECK(c->head_dim == 32 && c->hidden_size == 64 && c->n_heads == 4, "%s head_dim", q3[i]);
        check_eos(c, 1, (int[]){4}, q3[i]);
        check_samples(m, "qwen3", KVS_DTYPE_F32);
        check_model_rope(m, "qwen3");
    }
    if (q3m[0] && q3m[1]) {
        /* the sharded copy must expose exactly the same tensors, byte for byte */
        char path[4600];
        snprintf(path, sizeof path, "%s/qwen3-sharded/model.safetensors.index.json", g_models);
        cJSON *idx = read_json(path);
        int n = 0;
        const char *shard_seen[2] = {NULL, NULL};
        for (const cJSON *e = cJSON_GetObjectItem(idx, "weight_map")->child; e; e = e->next, n++) {
            struct kvs_tensor_view a, b;
            char err[256];
            int ra = kvs_model_tensor(q3m[0], e->string, &a, err, sizeof err);
            int rb = kvs_model_tensor(q3m[1], e->string, &b, err, sizeof err);
            CHECK(!ra && !rb && a.nbytes == b.nbytes && !memcmp(a.data, b.data, a.nbytes), "sharded %s", e->string);
            if (!rb) {
                if (!shard_seen[0] || !strcmp(shard_seen[0], b.file)) shard_seen[0] = b.file;
                else shard_seen[1] = b.file;
            }
        }
        CHECK(n >= 20 && shard_seen[1], "sharded: %d tensors, second shard used: %s", n,
              shard_seen[1] ? "yes" : "no");
        printf("  qwen3-sharded: %d tensors identical to qwen3 across 2 shards\n", n);
        cJSON_Delete(idx);
    }
    kvs_model_free(q3m[0]);
    kvs_model_free(q3m[1]);
}

/* RoPE for real-size configs (Llama-2/3/3.1/3.2, linear, Qwen3) from rope_reference.json. */
static void test_rope_reference(void)
{
    char path[4600];
    snprintf(path, sizeof path, "%s/rope_reference.json", g_models);
    cJSON *root = read_json(path);
    int n = 0;
    for (const cJSON *cs = cJSON_GetObjectItem(root, "cases")->child; cs; cs = cs->next, n++) {
        struct kvs_model_config c;
        memset(&c, 0, sizeof c);
        const cJSON *rp = cJSON_GetObjectItem(cs, "rope_parameters");
        c.head_dim = cJSON_GetObjectItem(cs, "head_dim")->valueint;
        c.rope_theta = cJSON_GetObjectItem(rp, "rope_theta")->valuedouble;
        const char *t = cJSON_GetObjectItem(rp, "rope_type")->valuestring;
        c.rope_type = !strcmp(t, "llama3") ? KVS_ROPE_LLAMA3 : !strcmp(t, "linear") ? KVS_ROPE_LINEAR : KVS_ROPE_DEFAULT;
        CHECK(!strcmp(t, "llama3") || !strcmp(t, "linear") || !strcmp(t, "default"), "rope type %s", t);
        if (c.rope_type != KVS_ROPE_DEFAULT) c.rope_factor = cJSON_GetObjectItem(rp, "factor")->valuedouble;
        if (c.rope_type == KVS_ROPE_LLAMA3) {
            c.rope_low_freq_factor = cJSON_GetObjectItem(rp, "low_freq_factor")->valuedouble;
            c.rope_high_freq_factor = cJSON_GetObjectItem(rp, "high_freq_factor")->valuedouble;
            c.rope_original_max_pos = cJSON_GetObjectItem(rp, "original_max_position_embeddings")->valueint;
        }
        check_inv_freq(&c, cJSON_GetObjectItem(cs, "inv_freq"), cJSON_GetObjectItem(cs, "name")->valuestring);
    }
    CHECK(n >= 6, "rope cases %d", n);
    cJSON_Delete(root);
}

static void test_f16(void)
{
    static const struct {
        uint16_t h;
        float f;
    } cases[] = {{0x3c00, 1.0f},          {0xc000, -2.0f},         {0x7bff, 65504.0f},  {0x0001, 0x1p-24f},
                 {0x03ff, 1023 * 0x1p-24f}, {0x0400, 0x1p-14f},    {0x8000, -0.0f},     {0x3555, 0.333251953125f},
                 {0x7c00, INFINITY},       {0xfc00, -INFINITY}};
    size_t n = sizeof cases / sizeof cases[0];
    uint16_t raw[16];
    float out[16];
    for (size_t i = 0; i < n; i++) raw[i] = cases[i].h;
    struct kvs_tensor_view v = {.dtype = KVS_DTYPE_F16, .ndim = 1, .shape = {(int64_t)n}, .data = raw, .nbytes = 2 * n};
    kvs_tensor_to_f32(&v, out, 0, n);
    for (size_t i = 0; i < n; i++)
        CHECK(out[i] == cases[i].f && signbit(out[i]) == signbit(cases[i].f), "f16 0x%04x -> %g, want %g", cases[i].h,
              out[i], cases[i].f);
    raw[0] = 0x7e00; /* nan */
    kvs_tensor_to_f32(&v, out, 0, 1);
    CHECK(isnan(out[0]), "f16 nan");
    uint16_t bf[2] = {0x3f80, 0xc0a0}; /* 1.0, -5.0 */
    struct kvs_tensor_view vb = {.dtype = KVS_DTYPE_BF16, .ndim = 1, .shape = {2}, .data = bf, .nbytes = 4};
    kvs_tensor_to_f32(&vb, out, 0, 2);
    CHECK(out[0] == 1.0f && out[1] == -5.0f, "bf16 %g %g", out[0], out[1]);
}

/* ---- config.json variants as real checkpoints ship them --------------------------------- */

static int load_cfg_text(const char *json, const char *gen_json, struct kvs_model_config *c, char *err, size_t errlen);

static void test_configs(void)
{
    struct kvs_model_config c;
    char err[512];
    int rc;
    /* Llama-2-7b: no head_dim, rope_scaling null, default theta */
    rc = load_cfg_text("{\"architectures\":[\"LlamaForCausalLM\"],\"bos_token_id\":1,\"eos_token_id\":2,"
                       "\"hidden_act\":\"silu\",\"hidden_size\":4096,\"intermediate_size\":11008,"
                       "\"max_position_embeddings\":4096,\"model_type\":\"llama\",\"num_attention_heads\":32,"
                       "\"num_hidden_layers\":32,\"num_key_value_heads\":32,\"pretraining_tp\":1,"
                       "\"rms_norm_eps\":1e-05,\"rope_scaling\":null,\"tie_word_embeddings\":false,"
                       "\"torch_dtype\":\"float16\",\"vocab_size\":32000}",
                       NULL, &c, err, sizeof err);
    CHECK(rc == 0 && c.head_dim == 128 && c.n_kv_heads == 32 && c.rope_theta == 10000.0 &&
              c.rope_type == KVS_ROPE_DEFAULT && c.n_eos == 1 && c.eos_token_ids[0] == 2 && c.bos_token_id == 1 &&
              c.max_position_embeddings == 4096 && c.rms_norm_eps == 1e-5f,
          "llama-2: rc=%d %s", rc, err);
    /* Llama-3.2-1B: llama3 scaling, tied, eos list; generation_config overrides eos with an int */
    rc = load_cfg_text("{\"architectures\":[\"LlamaForCausalLM\"],\"bos_token_id\":128000,"
                       "\"eos_token_id\":[128001,128008,128009],\"head_dim\":64,\"hidden_size\":2048,"
                       "\"intermediate_size\":8192,\"max_position_embeddings\":131072,\"num_attention_heads\":32,"
                       "\"num_hidden_layers\":16,\"num_key_value_heads\":8,\"rms_norm_eps\":1e-05,"
                       "\"rope_scaling\":{\"factor\":32.0,\"high_freq_factor\":4.0,\"low_freq_factor\":1.0,"
                       "\"original_max_position_embeddings\":8192,\"rope_type\":\"llama3\"},"
                       "\"rope_theta\":500000.0,\"tie_word_embeddings\":true,\"vocab_size\":128256}",
                       "{\"bos_token_id\":128000,\"eos_token_id\":128009}", &c, err, sizeof err);
    CHECK(rc == 0 && c.rope_type == KVS_ROPE_LLAMA3 && c.rope_factor == 32.0 && c.rope_original_max_pos == 8192 &&
              c.tie_word_embeddings && c.n_kv_heads == 8 && c.n_eos == 1 && c.eos_token_ids[0] == 128009 &&
              c.eos_token_ids[1] == -1,
          "llama-3.2: rc=%d %s", rc, err);
    /* Qwen2.5-0.5B: head_dim implied (896/14), sliding window present but off, bias implied */
    rc = load_cfg_text("{\"architectures\":[\"Qwen2ForCausalLM\"],\"bos_token_id\":151643,\"eos_token_id\":151645,"
                       "\"hidden_act\":\"silu\",\"hidden_size\":896,\"intermediate_size\":4864,"
                       "\"max_position_embeddings\":32768,\"max_window_layers\":21,\"num_attention_heads\":14,"
                       "\"num_hidden_layers\":24,\"num_key_value_heads\":2,\"rms_norm_eps\":1e-06,"
                       "\"rope_theta\":1000000.0,\"sliding_window\":32768,\"tie_word_embeddings\":true,"
                       "\"use_sliding_window\":false,\"vocab_size\":151936}",
                       NULL, &c, err, sizeof err);
    CHECK(rc == 0 && c.arch == KVS_ARCH_QWEN2 && c.head_dim == 64 && c.attention_bias && !c.qk_norm &&
              c.rope_theta == 1e6 && c.eos_token_ids[0] == 151645,
          "qwen2.5: rc=%d %s", rc, err);
    /* Qwen3-8B */
    rc = load_cfg_text("{\"architectures\":[\"Qwen3ForCausalLM\"],\"attention_bias\":false,\"head_dim\":128,"
                       "\"hidden_size\":4096,\"intermediate_size\":12288,\"max_position_embeddings\":40960,"
                       "\"num_attention_heads\":32,\"num_hidden_layers\":36,\"num_key_value_heads\":8,"
                       "\"rms_norm_eps\":1e-06,\"rope_scaling\":null,\"rope_theta\":1000000,"
                       "\"tie_word_embeddings\":false,\"vocab_size\":151936,\"eos_token_id\":151645}",
                       NULL, &c, err, sizeof err);
    CHECK(rc == 0 && c.arch == KVS_ARCH_QWEN3 && c.qk_norm && c.head_dim == 128 && c.max_position_embeddings == 40960 &&
              c.bos_token_id == -1,
          "qwen3-8b: rc=%d %s", rc, err);
    /* transformers 5: rope_parameters carries theta and llama3 scaling; no architectures key */
    rc = load_cfg_text("{\"model_type\":\"llama\",\"hidden_size\":64,\"intermediate_size\":128,\"num_attention_heads\":4,"
                       "\"num_hidden_layers\":1,\"vocab_size\":100,\"eos_token_id\":null,\"rope_parameters\":"
                       "{\"rope_theta\":500000.0,\"rope_type\":\"llama3\",\"factor\":8.0,\"low_freq_factor\":1.0,"
                       "\"high_freq_factor\":4.0,\"original_max_position_embeddings\":8192}}",
                       NULL, &c, err, sizeof err);
    CHECK(rc == 0 && c.arch == KVS_ARCH_LLAMA && c.rope_theta == 500000.0 && c.rope_type == KVS_ROPE_LLAMA3 &&
              c.rope_high_freq_factor == 4.0 && c.n_eos == 0 && c.max_position_embeddings == 2048,
          "rope_parameters: rc=%d %s", rc, err);
    /* old-style linear scaling with "type" */
    rc = load_cfg_text("{\"architectures\":[\"LlamaForCausalLM\"],\"hidden_size\":64,\"intermediate_size\":128,"
                       "\"num_attention_heads\":4,\"num_hidden_layers\":1,\"vocab_size\":100,"
                       "\"rope_scaling\":{\"type\":\"linear\",\"factor\":2.0}}",
                       NULL, &c, err, sizeof err);
    CHECK(rc == 0 && c.rope_type == KVS_ROPE_LINEAR && c.rope_factor == 2.0 && c.rope_theta == 10000.0,
          "linear: rc=%d %s", rc, err);
    static const struct {
        const char *extra, *needle;
    } bad[] = {
        {"\"architectures\":[\"Qwen3ForCausalLM\"],\"attention_bias\":true", "attention_bias"},
        {"\"architectures\":[\"LlamaForCausalLM\"],\"rope_scaling\":{\"rope_type\":\"dynamic\",\"factor\":2.0}", "dynamic"},
        {"\"architectures\":[\"LlamaForCausalLM\"],\"hidden_act\":\"gelu\"", "hidden_act"},
        {"\"architectures\":[\"LlamaForCausalLM\"],\"mlp_bias\":true", "mlp_bias"},
        {"\"architectures\":[\"Qwen2ForCausalLM\"],\"use_sliding_window\":true", "use_sliding_window"},
        {"\"architectures\":[\"LlamaForCausalLM\"],\"partial_rotary_factor\":0.5", "partial_rotary_factor"},
        {"\"architectures\":[\"LlamaForCausalLM\"],\"head_dim\":15", "head_dim"},
        {"\"architectures\":[\"LlamaForCausalLM\"],\"rms_norm_eps\":-1", "rms_norm_eps"},
        {"\"architectures\":[\"LlamaForCausalLM\"],\"eos_token_id\":[1,\"x\"]", "eos_token_id"},
        {"\"architectures\":[\"LlamaForCausalLM\"],\"rope_theta\":\"big\"", "rope_theta"},
        {"\"architectures\":[\"LlamaForCausalLM\"],\"rope_scaling\":{\"rope_type\":\"llama3\",\"factor\":8,"
         "\"low_freq_factor\":4,\"high_freq_factor\":1,\"original_max_position_embeddings\":8192}", "low_freq_factor"},
        {"\"architectures\":\"LlamaForCausalLM\"", "architectures"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char json[1024];
        snprintf(json, sizeof json,
                 "{%s,\"hidden_size\":64,\"intermediate_size\":128,\"num_attention_heads\":4,"
                 "\"num_hidden_layers\":1,\"vocab_size\":100}",
                 bad[i].extra);
        err[0] = 0;
        rc = load_cfg_text(json, NULL, &c, err, sizeof err);
        CHECK(rc < 0 && strstr(err, bad[i].needle) && strstr(err, "config.json"), "bad config %zu: rc=%d %s", i, rc, err);
        printf("  %-32s -> %s\n", bad[i].needle, err);
    }
}

/* ---- corruption suite ------------------------------------------------------------------ */

/* removes what an earlier case left there; a missing directory is fine */
static void rm_rf(const char *dir) { (void)kvs_test_rmtree(dir); }

static void copy_file(const char *from, const char *to)
{
    char err[512];
    size_t len;
    char *s = kvs_read_file(from, &len, err, sizeof err);
    if (!s) {
        fprintf(stderr, "copy: %s\n", err);
        exit(2);
    }
    FILE *f = fopen(to, "wb");
    if (!f || fwrite(s, 1, len, f) != len || fclose(f)) {
        fprintf(stderr, "copy: cannot write %s\n", to);
        exit(2);
    }
    free(s);
}

/* Fresh copy of tests/data/models/<name> (model files only) as g_tmp/case; returns its path. */
static const char *fresh_copy(const char *name)
{
    static char dst[4700];
    snprintf(dst, sizeof dst, "%s/case", g_tmp);
    rm_rf(dst);
    if (mkdir(dst, 0700)) {
        perror(dst);
        exit(2);
    }
    char src[4600];
    snprintf(src, sizeof src, "%s/%s", g_models, name);
    DIR *d = opendir(src);
    if (!d) {
        perror(src);
        exit(2);
    }
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.' || strstr(e->d_name, "reference") || strstr(e->d_name, "samples")) continue;
        char a[5000], b[5000];
        snprintf(a, sizeof a, "%s/%s", src, e->d_name);
        snprintf(b, sizeof b, "%s/%s", dst, e->d_name);
        copy_file(a, b);
    }
    closedir(d);
    return dst;
}

static void write_text(const char *dir, const char *file, const char *text)
{
    char p[4900];
    snprintf(p, sizeof p, "%s/%s", dir, file);
    FILE *f = fopen(p, "wb");
    if (!f || fputs(text, f) < 0 || fclose(f)) {
        fprintf(stderr, "cannot write %s\n", p);
        exit(2);
    }
}

/* Edits config.json: a JSON object's key set to raw JSON (NULL value = delete the key). */
static void edit_config(const char *dir, const char *key, const char *json_value)
{
    char p[4900];
    snprintf(p, sizeof p, "%s/config.json", dir);
    cJSON *root = read_json(p);
    cJSON_DeleteItemFromObjectCaseSensitive(root, key);
    if (json_value) {
        cJSON *v = cJSON_Parse(json_value);
        if (!v) {
            fprintf(stderr, "edit_config: bad JSON %s\n", json_value);
            exit(2);
        }
        cJSON_AddItemToObject(root, key, v);
    }
    char *s = cJSON_Print(root);
    write_text(dir, "config.json", s);
    free(s);
    cJSON_Delete(root);
}

/* Rewrites the safetensors header of dir/file through fn(root), keeping the data section. */
static void edit_header(const char *dir, const char *file, void (*fn)(cJSON *root, void *arg), void *arg)
{
    char p[4900], err[512];
    snprintf(p, sizeof p, "%s/%s", dir, file);
    size_t len;
    char *s = kvs_read_file(p, &len, err, sizeof err);
    if (!s) {
        fprintf(stderr, "edit_header: %s\n", err);
        exit(2);
    }
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | (uint8_t)s[i];
    char *hjson = strndup(s + 8, hlen);
    cJSON *root = cJSON_Parse(hjson);
    free(hjson);
    if (!root) {
        fprintf(stderr, "edit_header: %s header unparsable\n", p);
        exit(2);
    }
    fn(root, arg);
    char *nh = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    uint64_t nl = strlen(nh);
    uint8_t lb[8];
    for (int i = 0; i < 8; i++) lb[i] = (uint8_t)(nl >> (8 * i));
    FILE *f = fopen(p, "wb");
    if (!f || fwrite(lb, 1, 8, f) != 8 || fwrite(nh, 1, nl, f) != nl ||
        fwrite(s + 8 + hlen, 1, len - 8 - hlen, f) != len - 8 - hlen || fclose(f)) {
        fprintf(stderr, "edit_header: cannot write %s\n", p);
        exit(2);
    }
    free(nh);
    free(s);
}

static void set_offsets_arr(cJSON *t, double b, double e)
{
    cJSON_DeleteItemFromObject(t, "data_offsets");
    cJSON *a = cJSON_CreateArray();
    cJSON_AddItemToArray(a, cJSON_CreateNumber(b));
    cJSON_AddItemToArray(a, cJSON_CreateNumber(e));
    cJSON_AddItemToObject(t, "data_offsets", a);
}

static void hdr_oob(cJSON *root, void *arg)
{
    (void)arg;
    cJSON *t = cJSON_GetObjectItem(root, "model.layers.1.mlp.down_proj.weight");
    double b = cJSON_GetArrayItem(cJSON_GetObjectItem(t, "data_offsets"), 0)->valuedouble;
    set_offsets_arr(t, b + 1e9, b + 1e9 + 64 * 176 * 4);
}

static void hdr_overlap(cJSON *root, void *arg)
{
    (void)arg;
    /* two tensors of the same size: make the second point into the first */
    cJSON *a = cJSON_GetObjectItem(root, "model.layers.0.input_layernorm.weight");
    cJSON *b = cJSON_GetObjectItem(root, "model.layers.1.input_layernorm.weight");
    double ab = cJSON_GetArrayItem(cJSON_GetObjectItem(a, "data_offsets"), 0)->valuedouble;
    set_offsets_arr(b, ab + 4, ab + 4 + 64 * 4);
}

static void hdr_size_mismatch(cJSON *root, void *arg)
{
    (void)arg;
    cJSON *t = cJSON_GetObjectItem(root, "model.norm.weight");
    cJSON_ReplaceItemInObject(t, "shape", cJSON_Parse("[65]"));
}

static void hdr_transposed(cJSON *root, void *arg)
{
    (void)arg;
    cJSON *t = cJSON_GetObjectItem(root, "model.layers.1.mlp.gate_proj.weight");
    cJSON_ReplaceItemInObject(t, "shape", cJSON_Parse("[64, 176]"));
}

static void hdr_i64(cJSON *root, void *arg)
{
    (void)arg;
    cJSON *t = cJSON_GetObjectItem(root, "model.layers.0.post_attention_layernorm.weight");
    cJSON_ReplaceItemInObject(t, "dtype", cJSON_CreateString("I64"));
    cJSON_ReplaceItemInObject(t, "shape", cJSON_Parse("[32]"));
}

static void hdr_extra_i64(cJSON *root, void *arg)
{
    (void)arg;
    cJSON_AddItemToObject(root, "model.position_ids",
                          cJSON_Parse("{\"dtype\": \"I64\", \"shape\": [0], \"data_offsets\": [0, 0]}"));
}

static void hdr_unknown_dtype(cJSON *root, void *arg)
{
    (void)arg;
    cJSON *t = cJSON_GetObjectItem(root, "model.norm.weight");
    cJSON_ReplaceItemInObject(t, "dtype", cJSON_CreateString("Q4_K"));
}

static void hdr_rename(cJSON *root, void *arg)
{
    const char *name = arg;
    cJSON *t = cJSON_DetachItemFromObject(root, name);
    cJSON_AddItemToObject(root, "something.else", t);
}

static void hdr_duplicate(cJSON *root, void *arg)
{
    (void)arg;
    cJSON *t = cJSON_GetObjectItem(root, "model.norm.weight");
    cJSON_AddItemToObject(root, "model.norm.weight", cJSON_Duplicate(t, 1));
}

static void hdr_5d(cJSON *root, void *arg)
{
    (void)arg;
    cJSON *t = cJSON_GetObjectItem(root, "model.norm.weight");
    cJSON_ReplaceItemInObject(t, "shape", cJSON_Parse("[1, 1, 1, 1, 64]"));
}

static void hdr_metadata_odd(cJSON *root, void *arg)
{
    (void)arg;
    cJSON_DeleteItemFromObject(root, "__metadata__");
    cJSON_AddItemToObject(root, "__metadata__", cJSON_Parse("[1, {\"x\": null}]"));
}

static int load_cfg_text(const char *json, const char *gen_json, struct kvs_model_config *c, char *err, size_t errlen)
{
    char dir[4700];
    snprintf(dir, sizeof dir, "%s/cfg", g_tmp);
    rm_rf(dir);
    if (mkdir(dir, 0700)) {
        perror(dir);
        exit(2);
    }
    write_text(dir, "config.json", json);
    if (gen_json) write_text(dir, "generation_config.json", gen_json);
    return kvs_model_config_load(dir, c, err, errlen);
}

/* Loads dir, expects failure with every needle in the message. */
static void expect_fail(const char *what, const char *dir, const char *n1, const char *n2)
{
    char err[1024] = "";
    struct kvs_model *m = NULL;
    int rc = kvs_model_load(dir, &m, err, sizeof err);
    CHECK(rc < 0 && !m, "%s: expected failure, got rc=%d", what, rc);
    CHECK(err[0] && (!n1 || strstr(err, n1)) && (!n2 || strstr(err, n2)), "%s: message \"%s\" lacks \"%s\" / \"%s\"",
          what, err, n1 ? n1 : "", n2 ? n2 : "");
    printf("  %-32s -> %s\n", what, err);
    kvs_model_free(m);
}

static void truncate_file(const char *dir, const char *file, long keep)
{
    char p[4900];
    snprintf(p, sizeof p, "%s/%s", dir, file);
    if (truncate(p, keep)) {
        perror(p);
        exit(2);
    }
}

static void write_bytes(const char *dir, const char *file, long at, const void *b, size_t n)
{
    char p[4900];
    snprintf(p, sizeof p, "%s/%s", dir, file);
    int fd = open(p, O_WRONLY);
    if (fd < 0 || pwrite(fd, b, n, at) != (ssize_t)n || close(fd)) {
        perror(p);
        exit(2);
    }
}

static void test_corruption(void)
{
    const char *d;
    const char *ST = "model.safetensors";

    d = fresh_copy("llama31");
    { /* sanity: the untouched copy loads, and an odd __metadata__ is ignored */
        edit_header(d, ST, hdr_metadata_odd, NULL);
        char err[512];
        struct kvs_model *m;
        int rc = kvs_model_load(d, &m, err, sizeof err);
        CHECK(rc == 0, "pristine copy: %s", err);
        if (!rc) kvs_model_free(m);
    }

    d = fresh_copy("llama31");
    truncate_file(d, "config.json", 0);
    char cfgp[4900];
    snprintf(cfgp, sizeof cfgp, "%s/config.json", d);
    remove(cfgp);
    expect_fail("missing config.json", d, "config.json", NULL);

    d = fresh_copy("llama31");
    write_text(d, "config.json", "{\"architectures\": [\"LlamaForCausalLM\"], \"vocab_size\": ");
    expect_fail("config.json not JSON", d, "config.json", "JSON");

    d = fresh_copy("llama31");
    edit_config(d, "hidden_size", NULL);
    expect_fail("config missing hidden_size", d, "config.json", "hidden_size");

    d = fresh_copy("llama31");
    edit_config(d, "num_key_value_heads", "3");
    expect_fail("heads not multiple of kv heads", d, "config.json", "num_key_value_heads");

    d = fresh_copy("llama31");
    edit_config(d, "vocab_size", "\"1024\"");
    expect_fail("vocab_size a string", d, "config.json", "vocab_size");

    d = fresh_copy("llama31");
    edit_config(d, "architectures", "[\"MistralForCausalLM\"]");
    expect_fail("unsupported architecture", d, "config.json", "MistralForCausalLM");

    d = fresh_copy("llama31");
    edit_config(d, "rope_scaling", "{\"rope_type\": \"yarn\", \"factor\": 4.0}");
    expect_fail("unsupported rope type", d, "config.json", "yarn");

    d = fresh_copy("llama31");
    edit_config(d, "rope_scaling", "{\"rope_type\": \"llama3\", \"factor\": 8.0}");
    expect_fail("llama3 rope missing keys", d, "config.json", "low_freq_factor");

    d = fresh_copy("llama31");
    edit_config(d, "eos_token_id", "[1,2,3,4,5,6,7,8,9]");
    expect_fail("too many eos ids", d, "config.json", "eos_token_id");

    d = fresh_copy("llama31");
    write_text(d, "generation_config.json", "{\"eos_token_id\": \"x\"}");
    expect_fail("bad generation_config.json", d, "generation_config.json", "eos_token_id");

    d = fresh_copy("llama31");
    edit_config(d, "tie_word_embeddings", "false");
    expect_fail("untied without lm_head", d, "lm_head.weight", NULL);

    d = fresh_copy("llama31");
    char stp[4900];
    snprintf(stp, sizeof stp, "%s/%s", d, ST);
    remove(stp);
    expect_fail("missing safetensors", d, "model.safetensors", NULL);

    d = fresh_copy("llama31");
    truncate_file(d, ST, 400000);
    expect_fail("truncated file", d, "model.safetensors", "model.layers.");

    d = fresh_copy("llama31");
    truncate_file(d, ST, 5);
    expect_fail("file shorter than 8 bytes", d, "model.safetensors", "8-byte");

    d = fresh_copy("llama31");
    {
        uint8_t big[8] = {0, 0, 0, 0, 1, 0, 0, 0};
        write_bytes(d, ST, 0, big, 8);
    }
    expect_fail("header length > file", d, "model.safetensors", "header length");

    d = fresh_copy("llama31");
    write_bytes(d, ST, 8, "xxxxxxxxxxxx", 12);
    expect_fail("header not JSON", d, "model.safetensors", "JSON");

    d = fresh_copy("llama31");
    write_bytes(d, ST, 8, "[", 1);
    expect_fail("header not an object", d, "model.safetensors", NULL);

    d = fresh_copy("llama31");
    edit_header(d, ST, hdr_oob, NULL);
    expect_fail("offsets out of bounds", d, "model.safetensors", "model.layers.1.mlp.down_proj.weight");

    d = fresh_copy("llama31");
    edit_header(d, ST, hdr_overlap, NULL);
    expect_fail("overlapping tensors", d, "model.safetensors", "overlaps");

    d = fresh_copy("llama31");
    edit_header(d, ST, hdr_size_mismatch, NULL);
    expect_fail("offsets != shape*dtype", d, "model.safetensors", "model.norm.weight");

    d = fresh_copy("llama31");
    edit_header(d, ST, hdr_transposed, NULL);
    expect_fail("wrong shape", d, "model.layers.1.mlp.gate_proj.weight", "expected [176, 64]");

    d = fresh_copy("llama31");
    edit_header(d, ST, hdr_i64, NULL);
    expect_fail("unsupported dtype I64", d, "model.layers.0.post_attention_layernorm.weight", "I64");

    d = fresh_copy("llama31");
    edit_header(d, ST, hdr_unknown_dtype, NULL);
    expect_fail("unknown dtype", d, "model.norm.weight", "Q4_K");

    d = fresh_copy("llama31");
    edit_header(d, ST, hdr_extra_i64, NULL);
    { /* an unused integer buffer is fine; reading it is not */
        char err[512];
        struct kvs_model *m;
        struct kvs_tensor_view v;
        int rc = kvs_model_load(d, &m, err, sizeof err);
        CHECK(rc == 0, "extra I64 tensor: %s", err);
        if (!rc) {
            rc = kvs_model_tensor(m, "model.position_ids", &v, err, sizeof err);
            CHECK(rc == -ENOTSUP && strstr(err, "I64") && strstr(err, "model.position_ids"), "rc=%d %s", rc, err);
            printf("  %-32s -> loads; reading it: %s\n", "unused I64 tensor", err);
            kvs_model_free(m);
        }
    }

    d = fresh_copy("llama31");
    edit_header(d, ST, hdr_5d, NULL);
    expect_fail("5-d tensor", d, "model.norm.weight", "dimensions");

    d = fresh_copy("llama31");
    edit_header(d, ST, hdr_duplicate, NULL);
    expect_fail("duplicate tensor name", d, "model.norm.weight", "twice");

    d = fresh_copy("llama31");
    edit_header(d, ST, hdr_rename, "model.layers.1.mlp.up_proj.weight");
    expect_fail("missing tensor", d, "model.layers.1.mlp.up_proj.weight", "missing");

    d = fresh_copy("qwen2");
    edit_header(d, ST, hdr_rename, "model.layers.0.self_attn.k_proj.bias");
    expect_fail("missing qwen2 bias", d, "model.layers.0.self_attn.k_proj.bias", NULL);

    d = fresh_copy("qwen3");
    edit_header(d, ST, hdr_rename, "model.layers.1.self_attn.q_norm.weight");
    expect_fail("missing qwen3 q_norm", d, "model.layers.1.self_attn.q_norm.weight", NULL);

    d = fresh_copy("qwen3-sharded");
    {
        char p[4900];
        snprintf(p, sizeof p, "%s/model-00002-of-00002.safetensors", d);
        remove(p);
    }
    expect_fail("index names a missing shard", d, "model-00002-of-00002.safetensors", "does not exist");

    d = fresh_copy("qwen3-sharded");
    edit_header(d, "model-00002-of-00002.safetensors", hdr_rename, "model.layers.1.mlp.up_proj.weight");
    expect_fail("tensor not in its shard", d, "model-00002-of-00002.safetensors", "model.layers.1.mlp.up_proj.weight");

    d = fresh_copy("qwen3-sharded");
    write_text(d, "model.safetensors.index.json", "{\"weight_map\": {\"model.norm.weight\": \"../../etc/passwd\"}}");
    expect_fail("index path traversal", d, "model.safetensors.index.json", "plain file name");

    d = fresh_copy("qwen3-sharded");
    write_text(d, "model.safetensors.index.json", "{\"weight_map\": {\"model.norm.weight\": ");
    expect_fail("index not JSON", d, "model.safetensors.index.json", NULL);

    d = fresh_copy("qwen3-sharded");
    truncate_file(d, "model-00001-of-00002.safetensors", 1000);
    expect_fail("truncated shard", d, "model-00001-of-00002.safetensors", NULL);
}

/* In-memory parser: every strict prefix of a real file must fail cleanly, never crash. */
static void test_prefixes(void)
{
    char p[4600], err[512];
    snprintf(p, sizeof p, "%s/qwen2/model.safetensors", g_models);
    size_t len;
    char *s = kvs_read_file(p, &len, err, sizeof err);
    CHECK(s != NULL, "%s", err);
    if (!s) return;
    struct kvs_st_header h;
    int rc = kvs_safetensors_parse_header(s, len, "qwen2", &h, err, sizeof err);
    CHECK(rc == 0 && h.n_tensors == 26, "full file: rc=%d n=%d %s", rc, h.n_tensors, err);
    if (!rc) kvs_safetensors_header_free(&h);
    int bad = 0;
    for (size_t n = 0; n < len; n += (n < 4096 ? 1 : 997)) {
        char *copy = kvs_xmalloc(n ? n : 1); /* exact-size buffer so ASan sees over-reads */
        memcpy(copy, s, n);
        if (kvs_safetensors_parse_header(copy, n, "prefix", &h, err, sizeof err) == 0) {
            kvs_safetensors_header_free(&h);
            bad++;
        }
        free(copy);
    }
    CHECK(bad == 0, "%d truncated prefixes parsed as valid", bad);
    free(s);
}

/* The fuzz seed corpus doubles as parser cases: valid_* must parse, bad_* and real_* must not. */
static void test_corpus(void)
{
    char dir[4600], p[4900], err[512];
    snprintf(dir, sizeof dir, "%s/../../fuzz/corpus/safetensors", g_models);
    DIR *d = opendir(dir);
    CHECK(d != NULL, "cannot open %s", dir);
    if (!d) return;
    struct dirent *e;
    int n = 0;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        size_t len;
        char *s = kvs_read_file(p, &len, err, sizeof err);
        CHECK(s != NULL, "%s", err);
        if (!s) continue;
        struct kvs_st_header h;
        err[0] = 0;
        int rc = kvs_safetensors_parse_header(s, len, e->d_name, &h, err, sizeof err);
        int want_ok = !strncmp(e->d_name, "valid_", 6);
        CHECK(want_ok ? rc == 0 : (rc < 0 && strstr(err, e->d_name)), "%s: rc=%d %s", e->d_name, rc, err);
        if (!rc) {
            if (!strcmp(e->d_name, "valid_three_dtypes.safetensors")) {
                CHECK(h.n_tensors == 3 && h.tensors[1].dtype == KVS_DTYPE_BF16 && h.tensors[2].ndim == 4,
                      "three dtypes parsed wrong");
            }
            kvs_safetensors_header_free(&h);
        }
        free(s);
        n++;
    }
    closedir(d);
    CHECK(n >= 10, "only %d corpus files", n);
    printf("  %d fuzz seed files parsed as their names say\n", n);
}

int main(void)
{
    snprintf(g_models, sizeof g_models, "%s/tests/data/models", kvs_test_root());
    if (kvs_test_mkdtemp(g_tmp, sizeof g_tmp, "kvs_model_load") != 0) return 2;
    printf("tiny models:\n");
    test_tiny_models();
    printf("rope vs transformers (real-size configs):\n");
    test_rope_reference();
    test_f16();
    printf("config.json variants:\n");
    test_configs();
    printf("corruption suite:\n");
    test_corruption();
    test_prefixes();
    test_corpus();
    rm_rf(g_tmp);
    return kvs_test_summary("test_model_load");
}
