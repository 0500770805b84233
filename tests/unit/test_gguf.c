/* test_gguf.c: the GGUF parser, dequantizers and model loader against independent references.
 *
 *   - dequantization of F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K on random
 *     blocks equals gguf-py's gguf.quants.dequantize (tests/data/gguf/quant_ref.bin, made by
 *     scripts/make-gguf-references.py); other types are refused by name;
 *   - tiny one-layer llama / qwen2 / qwen3 GGUF files written by gguf-py's GGUFWriter with every
 *     supported type load with the right config, and every tensor's sampled values (HF layout,
 *     Llama q/k un-permuted by numpy from the converter's own permute) match;
 *   - malformed files (bad magic, truncation at every byte of the header, counts that overflow,
 *     a tensor past the end, overlapping tensors, unknown types) give errors naming the problem,
 *     never a crash (the fuzz target tests/fuzz/fuzz_gguf.c goes further);
 *   - --model resolution: a .gguf file, a directory holding one, a directory with two.
 */
#include <cjson/cJSON.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/util.h"
#include "engine/text/tokenizer.h"
#include "models/gguf.h"
#include "models/gguf_quant.h"
#include "models/model.h"
#include "tests/unit/test_util.h"

static char g_dir[1024];

static void *read_all(const char *path, size_t *len)
{
    char err[256];
    void *p = kvs_read_file(path, len, err, sizeof err);
    REQUIRE(p != NULL, "%s", err);
    return p;
}

static void test_quant(void)
{
    char path[1200], err[512];
    snprintf(path, sizeof path, "%s/quant_ref.bin", g_dir);
    size_t len;
    uint8_t *buf = read_all(path, &len);
    REQUIRE(len >= 12 && !memcmp(buf, "KVSGQR01", 8), "%s: bad header", path);
    uint32_t n;
    memcpy(&n, buf + 8, 4);
    size_t off = 12;
    int types_seen = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t h[3];
        REQUIRE(off + 12 <= len, "truncated");
        memcpy(h, buf + off, 12);
        off += 12;
        REQUIRE(off + h[2] + (size_t)h[1] * 4 <= len, "truncated");
        const uint8_t *raw = buf + off;
        float *ref = kvs_xmalloc((size_t)h[1] * 4), *got = kvs_xmalloc((size_t)h[1] * 4);
        memcpy(ref, buf + off + h[2], (size_t)h[1] * 4);
        off += h[2] + (size_t)h[1] * 4;
        uint32_t be, bb;
        CHECK(kvs_ggml_type_block(h[0], &be, &bb) == 0 && (size_t)h[1] / be * bb == h[2], "%s block size",
              kvs_ggml_type_name(h[0]));
        CHECK(kvs_ggml_type_supported(h[0]), "%s supported", kvs_ggml_type_name(h[0]));
        int rc = kvs_ggml_dequantize(h[0], raw, got, h[1], err, sizeof err);
        CHECK(rc == 0, "%s: %s", kvs_ggml_type_name(h[0]), err);
        /* the same float operations in the same order: equal, or within one ulp where numpy's
         * evaluation order differs */
        double worst = 0;
        for (uint32_t k = 0; k < h[1] && !rc; k++) {
            double d = fabs((double)got[k] - ref[k]), tol = fabs((double)ref[k]) * 2.4e-7;
            if (d > tol && d > worst) worst = d;
        }
        CHECK(worst == 0, "%s: dequantized values differ from gguf.quants by up to %g", kvs_ggml_type_name(h[0]),
              worst);
        printf("dequantize %-5s: %u values equal gguf.quants.dequantize\n", kvs_ggml_type_name(h[0]), h[1]);
        types_seen++;
        free(ref);
        free(got);
    }
    CHECK(types_seen == 11, "11 types in the reference, got %d", types_seen);
    free(buf);
    /* refused by name */
    static const uint32_t refused[] = {KVS_GGML_Q2_K, KVS_GGML_Q3_K, KVS_GGML_Q8_1, KVS_GGML_Q8_K, 16, 20, 23, 28, 39};
    float out[256];
    uint8_t zero[512] = {0};
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
        err[0] = 0;
        int rc = kvs_ggml_dequantize(refused[i], zero, out, 256 / 256, err, sizeof err);
        CHECK(rc == -ENOTSUP && strstr(err, kvs_ggml_type_name(refused[i])), "type %u refused by name: %s",
              refused[i], err);
    }
}

static void check_tiny(const char *arch, enum kvs_arch want_arch, int bias, int qk_norm)
{
    char path[1200], err[512];
    snprintf(path, sizeof path, "%s/tiny-%s.gguf", g_dir, arch);
    struct kvs_model *m = NULL;
    int rc = kvs_model_load(path, &m, err, sizeof err);
    CHECK(rc == 0, "%s: %s", path, err);
    if (rc) return;
    const struct kvs_model_config *c = kvs_model_config(m);
    CHECK(c->arch == want_arch && c->n_layers == 1 && c->hidden_size == 256 && c->intermediate_size == 64 &&
              c->n_heads == 2 && c->n_kv_heads == 1 && c->head_dim == 32 && c->vocab_size == 96 &&
              c->max_position_embeddings == 512 && c->rope_theta == 50000.0 && fabsf(c->rms_norm_eps - 1e-6f) < 1e-12f &&
              !c->tie_word_embeddings && c->attention_bias == bias && c->qk_norm == qk_norm && c->bos_token_id == 1 &&
              c->n_eos == 1 && c->eos_token_ids[0] == 2,
          "%s: config from metadata", arch);
    snprintf(path, sizeof path, "%s/tiny-%s.samples.json", g_dir, arch);
    char *text = read_all(path, NULL);
    cJSON *root = cJSON_Parse(text);
    free(text);
    REQUIRE(root, "%s: not JSON", path);
    int n_tensors = 0, n_values = 0, bad = 0;
    for (const cJSON *t = root->child; t; t = t->next) {
        struct kvs_tensor_view v;
        rc = kvs_model_tensor(m, t->string, &v, err, sizeof err);
        CHECK(rc == 0, "%s: %s", arch, err);
        if (rc) continue;
        const cJSON *shape = cJSON_GetObjectItem(t, "shape");
        int nd = cJSON_GetArraySize(shape);
        CHECK(v.ndim == nd && v.dtype == KVS_DTYPE_F32, "%s %s: ndim %d", arch, t->string, v.ndim);
        for (int d = 0; d < nd && d < v.ndim; d++)
            CHECK(v.shape[d] == (int64_t)cJSON_GetArrayItem(shape, d)->valuedouble, "%s %s dim %d", arch, t->string, d);
        const cJSON *p;
        cJSON_ArrayForEach(p, cJSON_GetObjectItem(t, "samples"))
        {
            const cJSON *ix = cJSON_GetArrayItem(p, 0);
            size_t flat = 0;
            for (int d = 0; d < nd; d++) flat = flat * (size_t)v.shape[d] + (size_t)cJSON_GetArrayItem(ix, d)->valuedouble;
            float want = (float)cJSON_GetArrayItem(p, 1)->valuedouble, got;
            kvs_tensor_to_f32(&v, &got, flat, 1);
            if (got != want && bad++ < 5)
                printf("  %s %s[%zu]: got %.9g want %.9g\n", arch, t->string, flat, got, want);
            n_values++;
        }
        n_tensors++;
    }
    CHECK(bad == 0, "%s: %d sampled values differ", arch, bad);
    CHECK(n_tensors >= 12, "%s: %d tensors checked", arch, n_tensors);
    printf("tiny %s: config and %d sampled values of %d tensors match gguf-py%s\n", arch, n_values, n_tensors,
           want_arch == KVS_ARCH_LLAMA ? " (q/k un-permuted)" : "");
    cJSON_Delete(root);
    kvs_model_free(m);
}

/* parse errors on edited copies of a real (small) file */
static void test_malformed(void)
{
    char path[1200], err[512];
    snprintf(path, sizeof path, "%s/tiny-llama.gguf", g_dir);
    size_t len;
    uint8_t *good = read_all(path, &len);
    struct kvs_gguf g;
    REQUIRE(kvs_gguf_parse(good, len, "t", &g, err, sizeof err) == 0, "%s", err);
    const uint64_t data_start = g.data_start, n_tensors = g.n_tensors;
    kvs_gguf_free(&g);
    uint8_t *b = kvs_xmalloc(len);
    /* every truncation inside the header and tensor table fails cleanly */
    int trunc_ok = 1;
    for (size_t cut = 0; cut < data_start; cut += 1 + cut / 64) {
        memcpy(b, good, cut);
        if (kvs_gguf_parse(b, cut, "t", &g, err, sizeof err) == 0) {
            trunc_ok = 0;
            kvs_gguf_free(&g);
        }
    }
    CHECK(trunc_ok, "a truncated header parsed");
    /* truncating the data section: the last tensor runs past the end */
    CHECK(kvs_gguf_parse(good, len - 1, "t", &g, err, sizeof err) == -EINVAL && strstr(err, "past the end"), "%s", err);
    memcpy(b, good, len);
    b[0] = 'X';
    CHECK(kvs_gguf_parse(b, len, "t", &g, err, sizeof err) == -EINVAL && strstr(err, "magic"), "%s", err);
    memcpy(b, good, len);
    b[4] = 9;
    CHECK(kvs_gguf_parse(b, len, "t", &g, err, sizeof err) == -ENOTSUP && strstr(err, "version 9"), "%s", err);
    memcpy(b, good, len);
    uint64_t huge = UINT64_MAX / 2;
    memcpy(b + 16, &huge, 8); /* metadata count */
    CHECK(kvs_gguf_parse(b, len, "t", &g, err, sizeof err) == -EINVAL && strstr(err, "cannot fit"), "%s", err);
    /* find the first tensor info: its name "token_embd.weight" after its u64 length */
    const char *nm = "token_embd.weight";
    size_t at = 0;
    for (size_t i = 0; i + strlen(nm) < data_start; i++)
        if (!memcmp(good + i, nm, strlen(nm)) && good[i - 8] == strlen(nm)) at = i + strlen(nm);
    REQUIRE(at, "first tensor info not found");
    /* n_dims(u32) ne[2](u64) type(u32) offset(u64) */
    memcpy(b, good, len);
    uint32_t t = 17; /* IQ2_XS: known, parsed, refused only when read */
    memcpy(b + at + 4 + 16, &t, 4);
    int rc = kvs_gguf_parse(b, len, "t", &g, err, sizeof err);
    CHECK(rc != 0 || g.tensors[0].type == 17, "IQ2_XS tensor parses or is refused for its size: %s", err);
    if (!rc) kvs_gguf_free(&g);
    t = 200;
    memcpy(b + at + 4 + 16, &t, 4);
    CHECK(kvs_gguf_parse(b, len, "t", &g, err, sizeof err) == -EINVAL && strstr(err, "unknown ggml type 200"), "%s",
          err);
    memcpy(b, good, len);
    uint64_t off = 32; /* the second tensor's offset moved onto the first: overlap */
    REQUIRE(n_tensors > 1, "tiny file has tensors");
    memcpy(b + at + 4 + 16 + 4, &off, 8);
    CHECK(kvs_gguf_parse(b, len, "t", &g, err, sizeof err) == -EINVAL && strstr(err, "overlaps"), "%s", err);
    memcpy(b, good, len);
    off = 3;
    memcpy(b + at + 4 + 16 + 4, &off, 8);
    CHECK(kvs_gguf_parse(b, len, "t", &g, err, sizeof err) == -EINVAL && strstr(err, "alignment"), "%s", err);
    memcpy(b, good, len);
    uint64_t dim = 1ull << 39;
    memcpy(b + at + 4, &dim, 8);
    CHECK(kvs_gguf_parse(b, len, "t", &g, err, sizeof err) == -EINVAL, "huge dim: %s", err);
    /* a file on disk that is not GGUF, and a missing one */
    char tmp[1024];
    REQUIRE(kvs_test_mkdtemp(tmp, sizeof tmp, "kvs-gguf") == 0, "mkdtemp");
    snprintf(path, sizeof path, "%s/bad.gguf", tmp);
    FILE *f = fopen(path, "wb");
    REQUIRE(f, "create %s", path);
    fwrite(good, 1, data_start + 10, f); /* cut inside the data */
    fclose(f);
    struct kvs_model *m = NULL;
    rc = kvs_model_load(path, &m, err, sizeof err);
    CHECK(rc < 0 && strstr(err, "bad.gguf") && strstr(err, "past the end"), "truncated model file: %s", err);
    rc = kvs_model_load(tmp, &m, err, sizeof err); /* the directory holding it */
    CHECK(rc < 0 && strstr(err, "bad.gguf"), "directory with a truncated GGUF: %s", err);
    snprintf(path, sizeof path, "%s/second.gguf", tmp);
    f = fopen(path, "wb");
    REQUIRE(f, "create %s", path);
    fclose(f);
    rc = kvs_model_load(tmp, &m, err, sizeof err);
    CHECK(rc == -EINVAL && strstr(err, "several .gguf"), "two GGUF files: %s", err);
    snprintf(path, sizeof path, "%s/missing.gguf", tmp);
    rc = kvs_model_load(path, &m, err, sizeof err);
    CHECK(rc == -ENOENT && strstr(err, "missing.gguf"), "missing file: %s", err);
    kvs_test_rmtree(tmp);
    /* a directory holding the tiny model loads it */
    REQUIRE(kvs_test_mkdtemp(tmp, sizeof tmp, "kvs-gguf") == 0, "mkdtemp");
    snprintf(path, sizeof path, "%s/m.gguf", tmp);
    f = fopen(path, "wb");
    REQUIRE(f && fwrite(good, 1, len, f) == len, "write %s", path);
    fclose(f);
    rc = kvs_model_load(tmp, &m, err, sizeof err);
    CHECK(rc == 0, "directory with one GGUF: %s", err);
    if (!rc) kvs_model_free(m);
    kvs_test_rmtree(tmp);
    printf("malformed files: truncations, bad magic/version, overflowing counts, unknown type, overlap, "
           "misalignment, huge dims, missing/ambiguous paths give errors\n");
    free(b);
    free(good);
}

/* tokenizers from the fuzz seeds (scripts/make-gguf-references.py fuzz): the smollm digit split,
 * a split-regex pre-tokenizer (qwen2) and SentencePiece with byte fallback */
static void test_seed_tokenizers(void)
{
    static const struct {
        const char *file, *text;
        int n;
        int32_t want[8];
    } cases[] = {
        /* vocabulary: 0 <|endoftext|>, 1 <|im_start|>, 2.. the printable ASCII, then Ġ, ĠH, He */
        {"valid_gpt2_smollm.gguf", "He He1", 4, {98, 97, 70, 18}},
        {"valid_gpt2_smollm.gguf", "<|im_start|>x", 2, {1, 89}},
        {"valid_gpt2_qwen2.gguf", "He He12", 5, {98, 97, 70, 18, 19}},
        /* 0 <unk>, 1 <s>, 2 </s>, 3.. <0x00>..<0xFF>, 259 ▁, 260 ▁H, 261 H, 262 e; BOS added */
        {"valid_llama_default.gguf", "He He1", 6, {1, 260, 262, 260, 262, 52}},
    };
    char path[1200], err[512];
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        snprintf(path, sizeof path, "%s/tests/fuzz/corpus/gguf/%s", kvs_test_root(), cases[i].file);
        struct kvs_tokenizer *t = NULL;
        int rc = kvs_tokenizer_load(path, &t, err, sizeof err);
        CHECK(rc == 0, "%s: %s", cases[i].file, err);
        if (rc) continue;
        int32_t ids[16];
        int n = kvs_tokenizer_encode(t, cases[i].text, strlen(cases[i].text), 1, 1, ids, 16);
        CHECK(n == cases[i].n && !memcmp(ids, cases[i].want, (size_t)n * 4), "%s \"%s\": %d ids [%d %d %d ...]",
              cases[i].file, cases[i].text, n, ids[0], ids[1], ids[2]);
        kvs_tokenizer_free(t);
    }
    printf("tokenizers from GGUF metadata: smollm digits, qwen2 split regex, SentencePiece byte fallback + BOS\n");
}

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    snprintf(g_dir, sizeof g_dir, "%s/tests/data/gguf", kvs_test_root());
    test_quant();
    check_tiny("llama", KVS_ARCH_LLAMA, 0, 0);
    check_tiny("qwen2", KVS_ARCH_QWEN2, 1, 0);
    check_tiny("qwen3", KVS_ARCH_QWEN3, 0, 1);
    test_malformed();
    test_seed_tokenizers();
    return kvs_test_summary("test_gguf");
}
