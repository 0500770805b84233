/* tp_test_model.h: a random-weight model written to disk for the tensor-parallel tests
 * (test_tp.c, test_tp_kv.c): 2 layers, 24 query heads over 12 KV heads of head_dim 8 (so TP 2,
 * 3 and 4 divide it), hidden 96, FFN 192, a vocabulary of 1001 (uneven vocabulary shares);
 * qwen3 = 0: Qwen2 (q/k/v biases, an o_proj bias, untied LM head), 1: Qwen3 (q/k norms, tied
 * embeddings). Weights uniform in base +- scale from the seed. Header-only (static), one copy per
 * test program. Returns 0, or -1 when a file cannot be written.
 */
#ifndef KVS_TEST_TP_TEST_MODEL_H
#define KVS_TEST_TP_TEST_MODEL_H

#include <cjson/cJSON.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/unit/test_util.h"

struct wt {
    char name[96];
    int64_t rows, cols;           /* rows = 0: a vector of cols */
    float scale, base;
};

static int kvs_test_write_tp_model(const char *dir, int qwen3, uint64_t seed)
{
    const int dim = 96, nh = 24, nkv = 12, hd = 8, ff = 192, vocab = 1001, layers = 2;
    char path[1200];
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *f = fopen(path, "w");
    if (!f) return -1;
    fprintf(f,
            "{\"architectures\": [\"%s\"], \"model_type\": \"%s\", \"hidden_size\": %d, \"num_attention_heads\": %d,"
            " \"num_key_value_heads\": %d, \"head_dim\": %d, \"intermediate_size\": %d, \"vocab_size\": %d,"
            " \"num_hidden_layers\": %d, \"max_position_embeddings\": 512, \"rms_norm_eps\": 1e-6,"
            " \"rope_theta\": 10000.0, \"tie_word_embeddings\": %s, \"eos_token_id\": 2, \"torch_dtype\": \"float32\"}\n",
            qwen3 ? "Qwen3ForCausalLM" : "Qwen2ForCausalLM", qwen3 ? "qwen3" : "qwen2", dim, nh, nkv, hd, ff, vocab,
            layers, qwen3 ? "true" : "false");
    fclose(f);
    struct wt ws[64];
    int n = 0;
    ws[n++] = (struct wt){"model.embed_tokens.weight", vocab, dim, 1.0f, 0};
    ws[n++] = (struct wt){"model.norm.weight", 0, dim, 0.1f, 1.0f};
    if (!qwen3) ws[n++] = (struct wt){"lm_head.weight", vocab, dim, 0.2f, 0};
    for (int l = 0; l < layers; l++) {
        const struct {
            const char *s;
            int64_t r, c;
            float sc, b;
            int when; /* 0 always, 1 qwen2, 2 qwen3 */
        } L[] = {
            {"input_layernorm.weight", 0, dim, 0.1f, 1.0f, 0},   {"self_attn.q_proj.weight", nh * hd, dim, 0.2f, 0, 0},
            {"self_attn.k_proj.weight", nkv * hd, dim, 0.2f, 0, 0}, {"self_attn.v_proj.weight", nkv * hd, dim, 0.2f, 0, 0},
            {"self_attn.o_proj.weight", dim, nh * hd, 0.1f, 0, 0}, {"self_attn.q_proj.bias", 0, nh * hd, 0.1f, 0, 1},
            {"self_attn.k_proj.bias", 0, nkv * hd, 0.1f, 0, 1},   {"self_attn.v_proj.bias", 0, nkv * hd, 0.1f, 0, 1},
            {"self_attn.o_proj.bias", 0, dim, 0.1f, 0, 1},        {"self_attn.q_norm.weight", 0, hd, 0.1f, 1.0f, 2},
            {"self_attn.k_norm.weight", 0, hd, 0.1f, 1.0f, 2},    {"post_attention_layernorm.weight", 0, dim, 0.1f, 1.0f, 0},
            {"mlp.gate_proj.weight", ff, dim, 0.2f, 0, 0},        {"mlp.up_proj.weight", ff, dim, 0.2f, 0, 0},
            {"mlp.down_proj.weight", dim, ff, 0.1f, 0, 0},
        };
        for (size_t i = 0; i < sizeof L / sizeof L[0]; i++) {
            if (L[i].when == 1 && qwen3) continue;
            if (L[i].when == 2 && !qwen3) continue;
            ws[n] = (struct wt){"", L[i].r, L[i].c, L[i].sc, L[i].b};
            snprintf(ws[n].name, sizeof ws[n].name, "model.layers.%d.%s", l, L[i].s);
            n++;
        }
    }
    /* safetensors: u64 header length, the JSON header, then the f32 data */
    cJSON *h = cJSON_CreateObject();
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        cJSON *t = cJSON_AddObjectToObject(h, ws[i].name);
        cJSON_AddStringToObject(t, "dtype", "F32");
        cJSON *shape = cJSON_AddArrayToObject(t, "shape");
        if (ws[i].rows) cJSON_AddItemToArray(shape, cJSON_CreateNumber((double)ws[i].rows));
        cJSON_AddItemToArray(shape, cJSON_CreateNumber((double)ws[i].cols));
        size_t bytes = (size_t)(ws[i].rows ? ws[i].rows : 1) * (size_t)ws[i].cols * 4;
        cJSON *o = cJSON_AddArrayToObject(t, "data_offsets");
        cJSON_AddItemToArray(o, cJSON_CreateNumber((double)off));
        cJSON_AddItemToArray(o, cJSON_CreateNumber((double)(off + bytes)));
        off += bytes;
    }
    char *js = cJSON_PrintUnformatted(h);
    cJSON_Delete(h);
    size_t hl = strlen(js), pad = (8 - hl % 8) % 8;
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    f = fopen(path, "wb");
    if (!f) return -1;
    uint64_t hlen = hl + pad;
    fwrite(&hlen, 8, 1, f);
    fwrite(js, 1, hl, f);
    for (size_t i = 0; i < pad; i++) fputc(' ', f);
    free(js);
    uint64_t s = seed;
    for (int i = 0; i < n; i++) {
        size_t cnt = (size_t)(ws[i].rows ? ws[i].rows : 1) * (size_t)ws[i].cols;
        for (size_t j = 0; j < cnt; j++) {
            float u = (float)((uint64_t)kvs_test_xorshift(&s) % 16777216u) / 16777216.0f * 2.0f - 1.0f;
            float v = ws[i].base + ws[i].scale * u;
            fwrite(&v, 4, 1, f);
        }
    }
    return fclose(f);
}

#endif
