/* model.c: loads a Hugging Face model directory (config, safetensors shard(s), tensor table) or
 * a GGUF file (models/gguf_model.h: config from the metadata, tensors dequantized to fp32 and
 * renamed), then validates the shape/dtype of every tensor the architecture needs. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* mmap, strdup, M_PI when built outside the Makefile (fuzzing) */
#endif
#include "base/half.h"
#include "models/model.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "base/util.h"
#include "models/gguf_model.h"
#include "models/safetensors.h"

struct tensor_ref {
    const char *name;        /* owned by the shard's header */
    int file, index;         /* shard, tensor index in it */
};

/* A GGUF tensor, dequantized: the model owns data. */
struct owned_tensor {
    char *name;              /* Hugging Face name */
    struct kvs_tensor_view v;
};

struct kvs_model {
    char *dir;
    struct owned_tensor *own; /* GGUF models: sorted by name */
    int n_own;
    struct kvs_model_config cfg;
    struct kvs_st_file **files;
    int n_files;
    struct tensor_ref *refs; /* sorted by name */
    int n_refs;
};

static int cmp_ref(const void *a, const void *b)
{
    return strcmp(((const struct tensor_ref *)a)->name, ((const struct tensor_ref *)b)->name);
}

static const struct tensor_ref *find_ref(const struct kvs_model *m, const char *name)
{
    struct tensor_ref key = {name, 0, 0};
    return bsearch(&key, m->refs, (size_t)m->n_refs, sizeof key, cmp_ref);
}

void kvs_model_free(struct kvs_model *m)
{
    if (!m) return;
    for (int i = 0; i < m->n_own; i++) {
        free(m->own[i].name);
        free((void *)m->own[i].v.data);
    }
    free(m->own);
    for (int i = 0; i < m->n_files; i++) kvs_safetensors_close(m->files[i]);
    free(m->files);
    free(m->refs);
    free(m->dir);
    free(m);
}

const struct kvs_model_config *kvs_model_config(const struct kvs_model *m) { return &m->cfg; }
const char *kvs_model_dir(const struct kvs_model *m) { return m->dir; }

static int path_join(char *out, size_t n, const char *dir, const char *name, char *err, size_t errlen)
{
    if (snprintf(out, n, "%s/%s", dir, name) >= (int)n)
        return kvs_err(err, errlen, -ENAMETOOLONG, "%s/%s: path too long", dir, name);
    return 0;
}

static int add_file(struct kvs_model *m, const char *path, char *err, size_t errlen)
{
    struct kvs_st_file *f;
    int rc = kvs_safetensors_open(path, &f, err, errlen);
    if (rc) return rc;
    m->files = kvs_xrealloc(m->files, sizeof *m->files * (size_t)(m->n_files + 1));
    m->files[m->n_files++] = f;
    return 0;
}

static int load_single(struct kvs_model *m, const char *path, char *err, size_t errlen)
{
    int rc = add_file(m, path, err, errlen);
    if (rc) return rc;
    const struct kvs_st_file *f = m->files[0];
    m->refs = kvs_xcalloc((size_t)f->h.n_tensors + 1, sizeof *m->refs);
    for (int i = 0; i < f->h.n_tensors; i++) m->refs[i] = (struct tensor_ref){f->h.tensors[i].name, 0, i};
    m->n_refs = f->h.n_tensors; /* already sorted by name */
    return 0;
}

/* A shard name from the index must be a plain file name inside the model directory. */
static int valid_shard_name(const char *s)
{
    return s[0] && !strchr(s, '/') && strcmp(s, ".") && strcmp(s, "..") && strlen(s) < 1024;
}

static int load_sharded(struct kvs_model *m, const char *index_path, char *err, size_t errlen)
{
    size_t len;
    char *text = kvs_read_file(index_path, &len, err, errlen);
    if (!text) return -EIO;
    cJSON *root = strlen(text) == len ? cJSON_Parse(text) : NULL;
    free(text);
    if (!root) return kvs_err(err, errlen, -EINVAL, "%s: not valid JSON", index_path);
    int rc = 0;
    const cJSON *wm = cJSON_GetObjectItemCaseSensitive(root, "weight_map");
    if (!cJSON_IsObject(wm)) {
        cJSON_Delete(root);
        return kvs_err(err, errlen, -EINVAL, "%s: missing \"weight_map\" object", index_path);
    }
    int n = cJSON_GetArraySize(wm);
    m->refs = kvs_xcalloc((size_t)n + 1, sizeof *m->refs);
    char path[4096];
    for (const cJSON *e = wm->child; e && !rc; e = e->next) {
        if (!cJSON_IsString(e) || !e->string || !valid_shard_name(e->valuestring)) {
            rc = kvs_err(err, errlen, -EINVAL, "%s: weight_map entry for tensor '%s' is not a plain file name",
                         index_path, e->string ? e->string : "?");
            break;
        }
        /* open each shard once (shards are few: linear search is fine) */
        int fi = -1;
        for (int i = 0; i < m->n_files && fi < 0; i++) {
            const char *base = strrchr(m->files[i]->path, '/');
            if (!strcmp(base ? base + 1 : m->files[i]->path, e->valuestring)) fi = i;
        }
        if (fi < 0) {
            if ((rc = path_join(path, sizeof path, m->dir, e->valuestring, err, errlen))) break;
            if (access(path, F_OK)) {
                rc = kvs_err(err, errlen, -ENOENT, "%s: shard %s (holding tensor '%s') does not exist", index_path,
                             path, e->string);
                break;
            }
            if ((rc = add_file(m, path, err, errlen))) break;
            fi = m->n_files - 1;
        }
        const struct kvs_st_file *f = m->files[fi];
        int ti = kvs_safetensors_find(&f->h, e->string);
        if (ti < 0) {
            rc = kvs_err(err, errlen, -ENOENT, "%s: tensor '%s' is not in shard %s named by %s", f->path, e->string,
                         f->path, index_path);
            break;
        }
        m->refs[m->n_refs++] = (struct tensor_ref){f->h.tensors[ti].name, fi, ti};
    }
    cJSON_Delete(root);
    if (rc) return rc;
    qsort(m->refs, (size_t)m->n_refs, sizeof *m->refs, cmp_ref);
    return 0;
}

static int check_dtype(const struct kvs_model *m, const struct tensor_ref *r, char *err, size_t errlen)
{
    const struct kvs_st_file *f = m->files[r->file];
    const struct kvs_st_tensor *t = &f->h.tensors[r->index];
    if (t->supported) return 0;
    return kvs_err(err, errlen, -ENOTSUP, "%s: tensor '%s': unsupported dtype \"%s\" (supported: F32, F16, BF16)",
                   f->path, t->name, t->dtype_name);
}

static int cmp_own(const void *a, const void *b)
{
    return strcmp(((const struct owned_tensor *)a)->name, ((const struct owned_tensor *)b)->name);
}

/* The view of tensor `name` (no tying applied): 0, -ENOENT without a message, or a dtype error. */
static int find_view(const struct kvs_model *m, const char *name, struct kvs_tensor_view *out, char *err,
                     size_t errlen)
{
    if (m->own) {
        struct owned_tensor key = {(char *)name, {0}};
        const struct owned_tensor *o = bsearch(&key, m->own, (size_t)m->n_own, sizeof key, cmp_own);
        if (!o) return -ENOENT;
        *out = o->v;
        return 0;
    }
    const struct tensor_ref *r = find_ref(m, name);
    if (!r) return -ENOENT;
    int rc = check_dtype(m, r, err, errlen);
    if (rc) return rc;
    kvs_safetensors_view(m->files[r->file], r->index, out);
    return 0;
}

int kvs_model_tensor(const struct kvs_model *m, const char *name, struct kvs_tensor_view *out, char *err,
                     size_t errlen)
{
    /* tied embeddings: the LM head is embed_tokens (transformers ties them even when a checkpoint
     * also carries an lm_head.weight) */
    if (m->cfg.tie_word_embeddings && !strcmp(name, "lm_head.weight")) name = "model.embed_tokens.weight";
    int rc = find_view(m, name, out, err, errlen);
    if (rc == -ENOENT)
        return kvs_err(err, errlen, -ENOENT, "%s: tensor '%s' not found in the model's %s", m->dir, name,
                       m->own ? "GGUF file" : "safetensors");
    return rc;
}

static int expect(const struct kvs_model *m, const char *name, int ndim, int64_t d0, int64_t d1, char *err,
                  size_t errlen)
{
    struct kvs_tensor_view v;
    const char *lookup = name;
    if (m->cfg.tie_word_embeddings && !strcmp(name, "lm_head.weight")) lookup = "model.embed_tokens.weight";
    int rc = find_view(m, lookup, &v, err, errlen);
    if (rc == -ENOENT) {
        if (!strcmp(name, "lm_head.weight"))
            return kvs_err(err, errlen, -ENOENT,
                           "%s: tensor 'lm_head.weight' is missing and tie_word_embeddings is false", m->dir);
        return kvs_err(err, errlen, -ENOENT, "%s: required tensor '%s' is missing from the %s", m->dir, name,
                       m->own ? "GGUF file" : "safetensors");
    }
    if (rc) return rc;
    int64_t want[2] = {d0, d1};
    int ok = v.ndim == ndim;
    for (int d = 0; ok && d < ndim; d++) ok = v.shape[d] == want[d];
    if (!ok) {
        char got[96] = "[", exp[64];
        for (int d = 0; d < v.ndim; d++) {
            size_t l = strlen(got);
            snprintf(got + l, sizeof got - l, "%s%lld", d ? ", " : "", (long long)v.shape[d]);
        }
        strncat(got, "]", sizeof got - strlen(got) - 1);
        if (ndim == 1) snprintf(exp, sizeof exp, "[%lld]", (long long)d0);
        else snprintf(exp, sizeof exp, "[%lld, %lld]", (long long)d0, (long long)d1);
        return kvs_err(err, errlen, -EINVAL, "%s: tensor '%s' has shape %s, expected %s", v.file, name, got, exp);
    }
    return 0;
}

static int validate(const struct kvs_model *m, char *err, size_t errlen)
{
    const struct kvs_model_config *c = &m->cfg;
    const int64_t H = c->hidden_size, V = c->vocab_size, I = c->intermediate_size;
    const int64_t q = (int64_t)c->n_heads * c->head_dim, kv = (int64_t)c->n_kv_heads * c->head_dim;
    int rc;
    if ((rc = expect(m, "model.embed_tokens.weight", 2, V, H, err, errlen))) return rc;
    if ((rc = expect(m, "model.norm.weight", 1, H, 0, err, errlen))) return rc;
    if ((rc = expect(m, "lm_head.weight", 2, V, H, err, errlen))) return rc;
    char name[160];
    for (int l = 0; l < c->n_layers; l++) {
        static const struct {
            const char *suffix;
            int what; /* 0 always, 1 attention_bias, 2 qk_norm */
            int ndim;
            char d0, d1; /* H hidden, I inter, Q q-dim, K kv-dim, D head_dim */
        } spec[] = {
            {"input_layernorm.weight", 0, 1, 'H', 0},    {"post_attention_layernorm.weight", 0, 1, 'H', 0},
            {"self_attn.q_proj.weight", 0, 2, 'Q', 'H'}, {"self_attn.k_proj.weight", 0, 2, 'K', 'H'},
            {"self_attn.v_proj.weight", 0, 2, 'K', 'H'}, {"self_attn.o_proj.weight", 0, 2, 'H', 'Q'},
            {"mlp.gate_proj.weight", 0, 2, 'I', 'H'},    {"mlp.up_proj.weight", 0, 2, 'I', 'H'},
            {"mlp.down_proj.weight", 0, 2, 'H', 'I'},    {"self_attn.q_proj.bias", 1, 1, 'Q', 0},
            {"self_attn.k_proj.bias", 1, 1, 'K', 0},     {"self_attn.v_proj.bias", 1, 1, 'K', 0},
            {"self_attn.q_norm.weight", 2, 1, 'D', 0},   {"self_attn.k_norm.weight", 2, 1, 'D', 0},
        };
        for (size_t s = 0; s < sizeof spec / sizeof spec[0]; s++) {
            if (spec[s].what == 1 && !c->attention_bias) continue;
            if (spec[s].what == 2 && !c->qk_norm) continue;
            int64_t dims[2];
            for (int d = 0; d < 2; d++) {
                char k = d ? spec[s].d1 : spec[s].d0;
                dims[d] = k == 'H' ? H : k == 'I' ? I : k == 'Q' ? q : k == 'K' ? kv : k == 'D' ? c->head_dim : 0;
            }
            snprintf(name, sizeof name, "model.layers.%d.%s", l, spec[s].suffix);
            if ((rc = expect(m, name, spec[s].ndim, dims[0], dims[1], err, errlen))) return rc;
        }
    }
    return 0;
}

/* Reads the config and every tensor of a GGUF file; the mapping is closed afterwards (every
 * tensor the runner reads has been dequantized into memory the model owns). */
static int load_gguf(struct kvs_model *m, const char *path, char *err, size_t errlen)
{
    struct kvs_gguf *g;
    int rc = kvs_gguf_open(path, &g, err, errlen);
    if (rc) return rc;
    rc = kvs_gguf_model_config(g, &m->cfg, err, errlen);
    m->own = kvs_xcalloc((size_t)g->n_tensors + 1, sizeof *m->own);
    for (uint64_t i = 0; i < g->n_tensors && !rc; i++) {
        const struct kvs_gguf_tensor *t = &g->tensors[i];
        char gname[256], hf[256];
        int heads;
        if (t->name.len >= sizeof gname) {
            rc = kvs_err(err, errlen, -ENOTSUP, "%s: tensor '%.80s...' has an overlong name", path, t->name.p);
            break;
        }
        memcpy(gname, t->name.p, t->name.len);
        gname[t->name.len] = 0;
        if ((rc = kvs_gguf_model_hf_name(g, &m->cfg, gname, hf, sizeof hf, &heads, err, errlen))) break;
        if ((strstr(hf, ".bias") && !m->cfg.attention_bias) || (strstr(hf, "_norm.weight") && strstr(hf, "self_attn") &&
                                                                  !m->cfg.qk_norm)) {
            rc = kvs_err(err, errlen, -ENOTSUP, "%s: tensor '%s' is not used by the %s architecture; refusing rather "
                         "than ignoring it", path, gname, m->cfg.arch_name);
            break;
        }
        struct owned_tensor *o = &m->own[m->n_own];
        float *data;
        if ((rc = kvs_gguf_model_tensor(g, t, heads, &data, &o->v.ndim, o->v.shape, err, errlen))) break;
        o->name = kvs_xstrdup(hf);
        o->v.dtype = KVS_DTYPE_F32;
        o->v.data = data;
        o->v.nbytes = 4;
        for (int d = 0; d < o->v.ndim; d++) o->v.nbytes *= (size_t)o->v.shape[d];
        o->v.file = m->dir;
        m->n_own++;
    }
    kvs_gguf_close(g);
    if (rc) return rc;
    qsort(m->own, (size_t)m->n_own, sizeof *m->own, cmp_own);
    return 0;
}

int kvs_model_load(const char *dir, struct kvs_model **out, char *err, size_t errlen)
{
    *out = NULL;
    char gguf[4096];
    int is_gguf = kvs_gguf_find(dir, gguf, sizeof gguf, err, errlen);
    if (is_gguf < 0) return is_gguf;
    struct kvs_model *m = kvs_xcalloc(1, sizeof *m);
    m->dir = kvs_xstrdup(is_gguf ? gguf : dir);
    if (is_gguf) {
        int rc = load_gguf(m, gguf, err, errlen);
        if (!rc) rc = validate(m, err, errlen);
        if (rc) {
            kvs_model_free(m);
            return rc;
        }
        *out = m;
        return 0;
    }
    int rc = kvs_model_config_load(dir, &m->cfg, err, errlen);
    char single[4096], index[4096];
    if (!rc) rc = path_join(single, sizeof single, dir, "model.safetensors", err, errlen);
    if (!rc) rc = path_join(index, sizeof index, dir, "model.safetensors.index.json", err, errlen);
    if (!rc) {
        if (!access(single, F_OK)) rc = load_single(m, single, err, errlen);
        else if (!access(index, F_OK)) rc = load_sharded(m, index, err, errlen);
        else
            rc = kvs_err(err, errlen, -ENOENT, "%s: no model.safetensors or model.safetensors.index.json", dir);
    }
    if (!rc) rc = validate(m, err, errlen);
    if (rc) {
        kvs_model_free(m);
        return rc;
    }
    *out = m;
    return 0;
}

void kvs_tensor_to_f32(const struct kvs_tensor_view *t, float *dst, size_t first, size_t n)
{
    const size_t es = kvs_dtype_size(t->dtype);
    KVS_ASSERT(es && first <= t->nbytes / es && n <= t->nbytes / es - first);
    const uint8_t *src = (const uint8_t *)t->data + first * es;
    switch (t->dtype) {
    case KVS_DTYPE_F32: memcpy(dst, src, n * 4); break;
    case KVS_DTYPE_BF16:
        for (size_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, src + 2 * i, 2);
            dst[i] = kvs_bf16_to_f32(h);
        }
        break;
    case KVS_DTYPE_F16:
        for (size_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, src + 2 * i, 2);
            dst[i] = kvs_f16_to_f32(h);
        }
        break;
    }
}
