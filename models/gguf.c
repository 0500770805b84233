/* gguf.c: bounds-checked GGUF parser, mmap loader and metadata accessors. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* mmap, strdup when built outside the Makefile (fuzzing) */
#endif
#include "models/gguf.h"

#include <dirent.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/util.h"

#define GGUF_MAX_DIMS 4
#define GGUF_MAX_KEY 65536u       /* llama.cpp's limit for key and name lengths is far lower */

/* A reader over buf[pos..len): every get checks the remaining length first. */
struct rd {
    const uint8_t *buf;
    size_t len, pos;
};

static int rd_bytes(struct rd *r, void *dst, size_t n)
{
    if (n > r->len - r->pos) return -1;
    if (dst) memcpy(dst, r->buf + r->pos, n);
    r->pos += n;
    return 0;
}
static int rd_u32(struct rd *r, uint32_t *v) { return rd_bytes(r, v, 4); }
static int rd_u64(struct rd *r, uint64_t *v) { return rd_bytes(r, v, 8); }

static int rd_str(struct rd *r, struct kvs_gguf_str *s)
{
    uint64_t n;
    if (rd_u64(r, &n) || n > r->len - r->pos) return -1;
    s->p = (const char *)r->buf + r->pos;
    s->len = n;
    r->pos += (size_t)n;
    return 0;
}

static size_t scalar_size(uint32_t t)
{
    switch (t) {
    case KVS_GGUF_U8: case KVS_GGUF_I8: case KVS_GGUF_BOOL: return 1;
    case KVS_GGUF_U16: case KVS_GGUF_I16: return 2;
    case KVS_GGUF_U32: case KVS_GGUF_I32: case KVS_GGUF_F32: return 4;
    case KVS_GGUF_U64: case KVS_GGUF_I64: case KVS_GGUF_F64: return 8;
    }
    return 0;
}

const char *kvs_gguf_vtype_name(uint32_t t)
{
    static const char *names[] = {"uint8", "int8", "uint16", "int16", "uint32", "int32", "float32",
                                  "bool", "string", "array", "uint64", "int64", "float64"};
    return t < sizeof names / sizeof names[0] ? names[t] : "?";
}

/* ggml types: name, block elements, block bytes (from ggml.c's type_traits). */
static const struct {
    const char *name;
    uint32_t blck, bytes;
} ggml_types[] = {
    [0] = {"F32", 1, 4},        [1] = {"F16", 1, 2},        [2] = {"Q4_0", 32, 18},
    [3] = {"Q4_1", 32, 20},     [6] = {"Q5_0", 32, 22},     [7] = {"Q5_1", 32, 24},
    [8] = {"Q8_0", 32, 34},     [9] = {"Q8_1", 32, 36},     [10] = {"Q2_K", 256, 84},
    [11] = {"Q3_K", 256, 110},  [12] = {"Q4_K", 256, 144},  [13] = {"Q5_K", 256, 176},
    [14] = {"Q6_K", 256, 210},  [15] = {"Q8_K", 256, 292},  [16] = {"IQ2_XXS", 256, 66},
    [17] = {"IQ2_XS", 256, 74}, [18] = {"IQ3_XXS", 256, 98}, [19] = {"IQ1_S", 256, 50},
    [20] = {"IQ4_NL", 32, 18},  [21] = {"IQ3_S", 256, 110}, [22] = {"IQ2_S", 256, 82},
    [23] = {"IQ4_XS", 256, 136}, [24] = {"I8", 1, 1},       [25] = {"I16", 1, 2},
    [26] = {"I32", 1, 4},       [27] = {"I64", 1, 8},       [28] = {"F64", 1, 8},
    [29] = {"IQ1_M", 256, 56},  [30] = {"BF16", 1, 2},      [34] = {"TQ1_0", 256, 54},
    [35] = {"TQ2_0", 256, 66},  [39] = {"MXFP4", 32, 17},
};

const char *kvs_ggml_type_name(uint32_t t)
{
    return t < sizeof ggml_types / sizeof ggml_types[0] && ggml_types[t].name ? ggml_types[t].name : "?";
}

int kvs_ggml_type_block(uint32_t t, uint32_t *elems, uint32_t *bytes)
{
    if (t >= sizeof ggml_types / sizeof ggml_types[0] || !ggml_types[t].name) {
        *elems = *bytes = 0;
        return -1;
    }
    *elems = ggml_types[t].blck;
    *bytes = ggml_types[t].bytes;
    return 0;
}

int kvs_gguf_str_eq(struct kvs_gguf_str s, const char *c)
{
    size_t n = strlen(c);
    return s.len == n && !memcmp(s.p, c, n);
}

void kvs_gguf_free(struct kvs_gguf *g)
{
    if (!g) return;
    free(g->kvs);
    free(g->tensors);
    g->kvs = NULL;
    g->tensors = NULL;
    g->n_kv = g->n_tensors = 0;
}

/* Skips the value of one metadata entry, recording where it is. */
static int parse_value(struct rd *r, struct kvs_gguf_kv *kv, const char *file, char *err, size_t errlen)
{
    char key[96];
    snprintf(key, sizeof key, "%.*s", (int)(kv->key.len < 80 ? kv->key.len : 80), kv->key.p);
    if (rd_u32(r, &kv->type)) return kvs_err(err, errlen, -EINVAL, "%s: metadata '%s': truncated type", file, key);
    kv->n = 1;
    kv->elem_type = kv->type;
    if (kv->type == KVS_GGUF_ARRAY) {
        if (rd_u32(r, &kv->elem_type) || rd_u64(r, &kv->n))
            return kvs_err(err, errlen, -EINVAL, "%s: metadata '%s': truncated array header", file, key);
        if (kv->elem_type == KVS_GGUF_ARRAY)
            return kvs_err(err, errlen, -ENOTSUP, "%s: metadata '%s': nested arrays are not supported", file, key);
    }
    kv->data = r->buf + r->pos;
    if (kv->elem_type == KVS_GGUF_STRING) {
        /* each string needs at least its 8-byte length: bounds the loop by the file size */
        if (kv->n > (r->len - r->pos) / 8)
            return kvs_err(err, errlen, -EINVAL, "%s: metadata '%s': %llu strings do not fit in the file", file, key,
                           (unsigned long long)kv->n);
        for (uint64_t i = 0; i < kv->n; i++) {
            struct kvs_gguf_str s;
            if (rd_str(r, &s))
                return kvs_err(err, errlen, -EINVAL, "%s: metadata '%s': string %llu runs past the end of the file",
                               file, key, (unsigned long long)i);
        }
        return 0;
    }
    size_t es = scalar_size(kv->elem_type);
    if (!es)
        return kvs_err(err, errlen, -EINVAL, "%s: metadata '%s': unknown value type %u", file, key, kv->elem_type);
    if (kv->n > (r->len - r->pos) / es)
        return kvs_err(err, errlen, -EINVAL, "%s: metadata '%s': %llu values of %s run past the end of the file", file,
                       key, (unsigned long long)kv->n, kvs_gguf_vtype_name(kv->elem_type));
    r->pos += (size_t)(kv->n * es);
    return 0;
}

static int cmp_tensor_offset(const void *a, const void *b)
{
    const struct kvs_gguf_tensor *x = *(const struct kvs_gguf_tensor *const *)a;
    const struct kvs_gguf_tensor *y = *(const struct kvs_gguf_tensor *const *)b;
    return x->offset < y->offset ? -1 : x->offset > y->offset;
}

static int parse_tensor(struct rd *r, uint64_t idx, struct kvs_gguf_tensor *t, const char *file, char *err,
                        size_t errlen)
{
    uint32_t nd;
    if (rd_str(r, &t->name) || t->name.len > GGUF_MAX_KEY)
        return kvs_err(err, errlen, -EINVAL, "%s: tensor #%llu: truncated or overlong name", file,
                       (unsigned long long)idx);
    const int nl = (int)(t->name.len < 80 ? t->name.len : 80);
    if (rd_u32(r, &nd)) return kvs_err(err, errlen, -EINVAL, "%s: tensor '%.*s': truncated", file, nl, t->name.p);
    if (nd < 1 || nd > GGUF_MAX_DIMS)
        return kvs_err(err, errlen, -EINVAL, "%s: tensor '%.*s': %u dimensions (expected 1..4)", file, nl, t->name.p,
                       nd);
    t->n_dims = (int)nd;
    uint64_t nel = 1;
    for (int d = 0; d < GGUF_MAX_DIMS; d++) {
        t->ne[d] = 1;
        if (d < t->n_dims && rd_u64(r, &t->ne[d]))
            return kvs_err(err, errlen, -EINVAL, "%s: tensor '%.*s': truncated shape", file, nl, t->name.p);
        /* each dimension below 2^40 and the product below 2^60: no overflow below */
        if (t->ne[d] > (1ull << 40) || (t->ne[d] && nel > (1ull << 60) / t->ne[d]))
            return kvs_err(err, errlen, -EINVAL, "%s: tensor '%.*s': shape too large", file, nl, t->name.p);
        nel *= t->ne[d];
    }
    if (rd_u32(r, &t->type) || rd_u64(r, &t->offset))
        return kvs_err(err, errlen, -EINVAL, "%s: tensor '%.*s': truncated", file, nl, t->name.p);
    uint32_t be, bb;
    if (kvs_ggml_type_block(t->type, &be, &bb))
        return kvs_err(err, errlen, -EINVAL, "%s: tensor '%.*s': unknown ggml type %u", file, nl, t->name.p, t->type);
    if (t->ne[0] % be)
        return kvs_err(err, errlen, -EINVAL, "%s: tensor '%.*s': row of %llu elements is not a whole number of %s "
                       "blocks (%u)", file, nl, t->name.p, (unsigned long long)t->ne[0], kvs_ggml_type_name(t->type), be);
    t->nbytes = nel / be * bb;
    return 0;
}

int kvs_gguf_parse(const void *buf, size_t len, const char *file, struct kvs_gguf *out, char *err, size_t errlen)
{
    memset(out, 0, sizeof *out);
    out->file = file;
    struct rd r = {buf, len, 0};
    char magic[4];
    uint64_t n_tensors, n_kv;
    if (rd_bytes(&r, magic, 4) || memcmp(magic, "GGUF", 4))
        return kvs_err(err, errlen, -EINVAL, "%s: not a GGUF file (no \"GGUF\" magic)", file);
    if (rd_u32(&r, &out->version) || rd_u64(&r, &n_tensors) || rd_u64(&r, &n_kv))
        return kvs_err(err, errlen, -EINVAL, "%s: truncated GGUF header", file);
    if (out->version != 2 && out->version != 3)
        return kvs_err(err, errlen, -ENOTSUP, "%s: GGUF version %u is not supported (expected 2 or 3)", file,
                       out->version);
    /* a metadata entry takes at least 8 + 4 bytes, a tensor info at least 8 + 4 + 8 + 4 + 8 */
    if (n_kv > len / 12 || n_tensors > len / 32)
        return kvs_err(err, errlen, -EINVAL, "%s: %llu metadata entries / %llu tensors cannot fit in %zu bytes", file,
                       (unsigned long long)n_kv, (unsigned long long)n_tensors, len);
    int rc = 0;
    out->kvs = kvs_xcalloc((size_t)n_kv + 1, sizeof *out->kvs);
    for (uint64_t i = 0; i < n_kv && !rc; i++) {
        struct kvs_gguf_kv *kv = &out->kvs[i];
        if (rd_str(&r, &kv->key) || kv->key.len > GGUF_MAX_KEY)
            rc = kvs_err(err, errlen, -EINVAL, "%s: metadata entry #%llu: truncated or overlong key", file,
                         (unsigned long long)i);
        else
            rc = parse_value(&r, kv, file, err, errlen);
        out->n_kv = i + 1;
    }
    if (rc) goto fail;
    out->alignment = 32;
    const struct kvs_gguf_kv *al = kvs_gguf_get(out, "general.alignment");
    if (al) {
        uint64_t a;
        if ((rc = kvs_gguf_get_u64(out, "general.alignment", 1, &a, err, errlen))) goto fail;
        if (!a || (a & (a - 1)) || a > 65536) {
            rc = kvs_err(err, errlen, -EINVAL, "%s: general.alignment %llu is not a power of two <= 65536", file,
                         (unsigned long long)a);
            goto fail;
        }
        out->alignment = a;
    }
    out->tensors = kvs_xcalloc((size_t)n_tensors + 1, sizeof *out->tensors);
    for (uint64_t i = 0; i < n_tensors && !rc; i++) {
        rc = parse_tensor(&r, i, &out->tensors[i], file, err, errlen);
        out->n_tensors = i + 1;
    }
    if (rc) goto fail;
    for (uint64_t i = 0; i < n_tensors && !rc; i++)
        for (uint64_t j = 0; j < i && !rc; j++)
            if (out->tensors[i].name.len == out->tensors[j].name.len &&
                !memcmp(out->tensors[i].name.p, out->tensors[j].name.p, out->tensors[i].name.len))
                rc = kvs_err(err, errlen, -EINVAL, "%s: tensor '%.*s' appears twice", file,
                             (int)(out->tensors[i].name.len < 80 ? out->tensors[i].name.len : 80),
                             out->tensors[i].name.p);
    if (rc) goto fail;
    uint64_t ds = (r.pos + out->alignment - 1) / out->alignment * out->alignment;
    if (n_tensors && ds > len) {
        rc = kvs_err(err, errlen, -EINVAL, "%s: data section starts past the end of the file", file);
        goto fail;
    }
    out->data_start = ds;
    const uint64_t data_len = n_tensors ? len - ds : 0;
    struct kvs_gguf_tensor **order = kvs_xcalloc((size_t)n_tensors + 1, sizeof *order);
    for (uint64_t i = 0; i < n_tensors; i++) order[i] = &out->tensors[i];
    qsort(order, (size_t)n_tensors, sizeof *order, cmp_tensor_offset);
    uint64_t prev_end = 0;
    for (uint64_t i = 0; i < n_tensors && !rc; i++) {
        struct kvs_gguf_tensor *t = order[i];
        const int nl = (int)(t->name.len < 80 ? t->name.len : 80);
        if (t->offset % out->alignment)
            rc = kvs_err(err, errlen, -EINVAL, "%s: tensor '%.*s': offset %llu is not a multiple of the alignment %llu",
                         file, nl, t->name.p, (unsigned long long)t->offset, (unsigned long long)out->alignment);
        else if (t->offset > data_len || t->nbytes > data_len - t->offset)
            rc = kvs_err(err, errlen, -EINVAL, "%s: tensor '%.*s': bytes [%llu, +%llu) run past the end of the file",
                         file, nl, t->name.p, (unsigned long long)t->offset, (unsigned long long)t->nbytes);
        else if (i && t->offset < prev_end)
            rc = kvs_err(err, errlen, -EINVAL, "%s: tensor '%.*s' overlaps the previous tensor", file, nl, t->name.p);
        else {
            prev_end = t->offset + t->nbytes;
            t->data = (const uint8_t *)buf + ds + t->offset;
        }
    }
    free(order);
    if (rc) goto fail;
    return 0;
fail:
    kvs_gguf_free(out);
    return rc;
}

int kvs_gguf_open(const char *path, struct kvs_gguf **out, char *err, size_t errlen)
{
    *out = NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return kvs_err(err, errlen, -errno, "%s: cannot open: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) || !S_ISREG(st.st_mode)) {
        close(fd);
        return kvs_err(err, errlen, -EINVAL, "%s: not a regular file", path);
    }
    if (st.st_size < 24) {
        close(fd);
        return kvs_err(err, errlen, -EINVAL, "%s: %lld bytes is too short for a GGUF file", path,
                       (long long)st.st_size);
    }
    void *map = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd);
    if (map == MAP_FAILED) return kvs_err(err, errlen, -e, "%s: mmap failed: %s", path, strerror(e));
    struct kvs_gguf *g = kvs_xcalloc(1, sizeof *g);
    char *name = kvs_xstrdup(path);
    int rc = kvs_gguf_parse(map, (size_t)st.st_size, name, g, err, errlen); /* parse clears *g */
    g->path = name;
    g->file = name;
    g->map = map;
    g->map_size = (size_t)st.st_size;
    if (rc) {
        kvs_gguf_close(g);
        return rc;
    }
    *out = g;
    return 0;
}

void kvs_gguf_close(struct kvs_gguf *g)
{
    if (!g) return;
    kvs_gguf_free(g);
    if (g->map) munmap((void *)g->map, g->map_size);
    free(g->path);
    free(g);
}

int kvs_gguf_is_gguf_name(const char *path)
{
    size_t n = strlen(path);
    return n > 5 && !strcmp(path + n - 5, ".gguf");
}

int kvs_gguf_find(const char *path, char *out, size_t outlen, char *err, size_t errlen)
{
    struct stat st;
    if (kvs_gguf_is_gguf_name(path) && !(stat(path, &st) == 0 && S_ISDIR(st.st_mode))) {
        if (snprintf(out, outlen, "%s", path) >= (int)outlen)
            return kvs_err(err, errlen, -ENAMETOOLONG, "%s: path too long", path);
        return 1;
    }
    if (stat(path, &st) || !S_ISDIR(st.st_mode)) return 0;
    char cfg[4096];
    if (snprintf(cfg, sizeof cfg, "%s/config.json", path) >= (int)sizeof cfg)
        return kvs_err(err, errlen, -ENAMETOOLONG, "%s: path too long", path);
    if (!access(cfg, F_OK)) return 0; /* a Hugging Face directory, even with a .gguf beside it */
    DIR *d = opendir(path);
    if (!d) return 0;
    int found = 0, rc = 0;
    struct dirent *e;
    while ((e = readdir(d)) && rc >= 0) {
        if (!kvs_gguf_is_gguf_name(e->d_name) || e->d_name[0] == '.') continue;
        if (found) {
            rc = kvs_err(err, errlen, -EINVAL, "%s: holds several .gguf files (%s, %s...); pass one with --model FILE",
                         path, strrchr(out, '/') + 1, e->d_name);
            break;
        }
        if (snprintf(out, outlen, "%s/%s", path, e->d_name) >= (int)outlen)
            rc = kvs_err(err, errlen, -ENAMETOOLONG, "%s/%s: path too long", path, e->d_name);
        found = 1;
    }
    closedir(d);
    return rc < 0 ? rc : found;
}

/* ---- metadata ---- */

const struct kvs_gguf_kv *kvs_gguf_get(const struct kvs_gguf *g, const char *key)
{
    for (uint64_t i = 0; i < g->n_kv; i++)
        if (kvs_gguf_str_eq(g->kvs[i].key, key)) return &g->kvs[i];
    return NULL;
}

static int is_int_type(uint32_t t)
{
    return t <= KVS_GGUF_I32 || t == KVS_GGUF_U64 || t == KVS_GGUF_I64;
}

static int64_t read_int(uint32_t t, const uint8_t *p, int *neg_u64)
{
    *neg_u64 = 0;
    switch (t) {
    case KVS_GGUF_U8: return *p;
    case KVS_GGUF_I8: return (int8_t)*p;
    case KVS_GGUF_U16: { uint16_t v; memcpy(&v, p, 2); return v; }
    case KVS_GGUF_I16: { int16_t v; memcpy(&v, p, 2); return v; }
    case KVS_GGUF_U32: { uint32_t v; memcpy(&v, p, 4); return v; }
    case KVS_GGUF_I32: { int32_t v; memcpy(&v, p, 4); return v; }
    case KVS_GGUF_U64: { uint64_t v; memcpy(&v, p, 8); if (v > INT64_MAX) *neg_u64 = 1; return (int64_t)v; }
    case KVS_GGUF_I64: { int64_t v; memcpy(&v, p, 8); return v; }
    case KVS_GGUF_BOOL: return *p;
    case KVS_GGUF_F32: { float v; memcpy(&v, p, 4); return (int64_t)v; }
    case KVS_GGUF_F64: { double v; memcpy(&v, p, 8); return (int64_t)v; }
    }
    return 0;
}

static int lookup(const struct kvs_gguf *g, const char *key, int required, const struct kvs_gguf_kv **kv, char *err,
                  size_t errlen)
{
    *kv = kvs_gguf_get(g, key);
    if (*kv) return 0;
    if (required) return kvs_err(err, errlen, -ENOENT, "%s: missing metadata key '%s'", g->file, key);
    return -ENOENT;
}

int kvs_gguf_get_u64(const struct kvs_gguf *g, const char *key, int required, uint64_t *out, char *err, size_t errlen)
{
    const struct kvs_gguf_kv *kv;
    int rc = lookup(g, key, required, &kv, err, errlen), big;
    if (rc) return rc;
    if (kv->type == KVS_GGUF_ARRAY || !is_int_type(kv->type))
        return kvs_err(err, errlen, -EINVAL, "%s: metadata '%s' is %s, expected an unsigned integer", g->file, key,
                       kvs_gguf_vtype_name(kv->type));
    int64_t v = read_int(kv->type, kv->data, &big);
    if (v < 0 && !big)
        return kvs_err(err, errlen, -EINVAL, "%s: metadata '%s' is negative (%lld)", g->file, key, (long long)v);
    *out = (uint64_t)v;
    return 0;
}

int kvs_gguf_get_f64(const struct kvs_gguf *g, const char *key, int required, double *out, char *err, size_t errlen)
{
    const struct kvs_gguf_kv *kv;
    int rc = lookup(g, key, required, &kv, err, errlen);
    if (rc) return rc;
    if (kv->type == KVS_GGUF_F32) {
        float v;
        memcpy(&v, kv->data, 4);
        *out = v;
    } else if (kv->type == KVS_GGUF_F64) {
        memcpy(out, kv->data, 8);
    } else if (kv->type != KVS_GGUF_ARRAY && is_int_type(kv->type)) {
        int big;
        *out = (double)read_int(kv->type, kv->data, &big);
    } else {
        return kvs_err(err, errlen, -EINVAL, "%s: metadata '%s' is %s, expected a number", g->file, key,
                       kvs_gguf_vtype_name(kv->type));
    }
    if (!isfinite(*out)) return kvs_err(err, errlen, -EINVAL, "%s: metadata '%s' is not finite", g->file, key);
    return 0;
}

int kvs_gguf_get_bool(const struct kvs_gguf *g, const char *key, int required, int *out, char *err, size_t errlen)
{
    const struct kvs_gguf_kv *kv;
    int rc = lookup(g, key, required, &kv, err, errlen);
    if (rc) return rc;
    if (kv->type != KVS_GGUF_BOOL)
        return kvs_err(err, errlen, -EINVAL, "%s: metadata '%s' is %s, expected bool", g->file, key,
                       kvs_gguf_vtype_name(kv->type));
    *out = kv->data[0] != 0;
    return 0;
}

int kvs_gguf_get_str(const struct kvs_gguf *g, const char *key, int required, struct kvs_gguf_str *out, char *err,
                     size_t errlen)
{
    const struct kvs_gguf_kv *kv;
    int rc = lookup(g, key, required, &kv, err, errlen);
    if (rc) return rc;
    if (kv->type != KVS_GGUF_STRING)
        return kvs_err(err, errlen, -EINVAL, "%s: metadata '%s' is %s, expected string", g->file, key,
                       kvs_gguf_vtype_name(kv->type));
    uint64_t n;
    memcpy(&n, kv->data, 8);
    out->p = (const char *)kv->data + 8;
    out->len = n;
    return 0;
}

void kvs_gguf_arr_strs(const struct kvs_gguf_kv *kv, struct kvs_gguf_str *out)
{
    const uint8_t *p = kv->data;
    for (uint64_t i = 0; i < kv->n; i++) {
        uint64_t n;
        memcpy(&n, p, 8);
        out[i].p = (const char *)p + 8;
        out[i].len = n;
        p += 8 + n;
    }
}

int64_t kvs_gguf_arr_i64(const struct kvs_gguf_kv *kv, uint64_t i)
{
    int big;
    KVS_ASSERT(i < kv->n && scalar_size(kv->elem_type));
    return read_int(kv->elem_type, kv->data + i * scalar_size(kv->elem_type), &big);
}

double kvs_gguf_arr_f64(const struct kvs_gguf_kv *kv, uint64_t i)
{
    KVS_ASSERT(i < kv->n && scalar_size(kv->elem_type));
    const uint8_t *p = kv->data + i * scalar_size(kv->elem_type);
    if (kv->elem_type == KVS_GGUF_F32) {
        float v;
        memcpy(&v, p, 4);
        return v;
    }
    if (kv->elem_type == KVS_GGUF_F64) {
        double v;
        memcpy(&v, p, 8);
        return v;
    }
    int big;
    return (double)read_int(kv->elem_type, p, &big);
}

/* ---- tensors ---- */

const struct kvs_gguf_tensor *kvs_gguf_tensor(const struct kvs_gguf *g, const char *name)
{
    for (uint64_t i = 0; i < g->n_tensors; i++)
        if (kvs_gguf_str_eq(g->tensors[i].name, name)) return &g->tensors[i];
    return NULL;
}
