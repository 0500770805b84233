/* safetensors.c: bounds-checked safetensors header parser and mmap loader. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* mmap, strdup, M_PI when built outside the Makefile (fuzzing) */
#endif
#include "models/safetensors.h"

#include <cjson/cJSON.h>
#include <fcntl.h>
#include <math.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/util.h"

/* The reference implementation refuses headers above 100 MB; a real 8B model's is ~30 KB. */
#define ST_MAX_HEADER (100u * 1000u * 1000u)

size_t kvs_dtype_size(enum kvs_dtype dt)
{
    switch (dt) {
    case KVS_DTYPE_F32: return 4;
    case KVS_DTYPE_F16: return 2;
    case KVS_DTYPE_BF16: return 2;
    }
    return 0;
}

const char *kvs_dtype_name(enum kvs_dtype dt)
{
    switch (dt) {
    case KVS_DTYPE_F32: return "F32";
    case KVS_DTYPE_F16: return "F16";
    case KVS_DTYPE_BF16: return "BF16";
    }
    return "?";
}

/* A JSON number that is a non-negative integer exactly representable (< 2^53). */
static int json_u64(const cJSON *j, uint64_t *out)
{
    if (!cJSON_IsNumber(j)) return -1;
    double d = j->valuedouble;
    if (!(d >= 0.0) || d > 9007199254740992.0 || floor(d) != d) return -1;
    *out = (uint64_t)d;
    return 0;
}

static int cmp_tensor_name(const void *a, const void *b)
{
    return strcmp(((const struct kvs_st_tensor *)a)->name, ((const struct kvs_st_tensor *)b)->name);
}

static int cmp_tensor_begin(const void *a, const void *b)
{
    const struct kvs_st_tensor *x = *(const struct kvs_st_tensor *const *)a;
    const struct kvs_st_tensor *y = *(const struct kvs_st_tensor *const *)b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return 0;
}

void kvs_safetensors_header_free(struct kvs_st_header *h)
{
    if (!h) return;
    for (int i = 0; i < h->n_tensors; i++) free(h->tensors[i].name);
    free(h->tensors);
    h->tensors = NULL;
    h->n_tensors = 0;
}

/* Parses one entry {"dtype", "shape", "data_offsets"} into t (name already set). */
static int parse_entry(const cJSON *e, const char *file, struct kvs_st_tensor *t, uint64_t data_len,
                       char *err, size_t errlen)
{
    if (!cJSON_IsObject(e))
        return kvs_err(err, errlen, -EINVAL, "%s: tensor '%s': header entry is not an object", file, t->name);
    const cJSON *dt = cJSON_GetObjectItemCaseSensitive(e, "dtype");
    const cJSON *shape = cJSON_GetObjectItemCaseSensitive(e, "shape");
    const cJSON *offs = cJSON_GetObjectItemCaseSensitive(e, "data_offsets");
    if (!cJSON_IsString(dt))
        return kvs_err(err, errlen, -EINVAL, "%s: tensor '%s': missing or non-string \"dtype\"", file, t->name);
    /* every dtype of the format is parsed and size-checked; only F32/F16/BF16 can be read, the
     * others are flagged so that a checkpoint with extra integer buffers still loads */
    static const struct {
        const char *name;
        int size, kvs; /* kvs: enum kvs_dtype, or -1 */
    } dtypes[] = {{"F32", 4, KVS_DTYPE_F32}, {"F16", 2, KVS_DTYPE_F16}, {"BF16", 2, KVS_DTYPE_BF16},
                  {"F64", 8, -1},  {"I64", 8, -1},  {"U64", 8, -1},  {"I32", 4, -1},     {"U32", 4, -1},
                  {"I16", 2, -1},  {"U16", 2, -1},  {"I8", 1, -1},   {"U8", 1, -1},      {"BOOL", 1, -1},
                  {"F8_E4M3", 1, -1}, {"F8_E5M2", 1, -1}};
    int found = -1;
    for (size_t i = 0; i < sizeof dtypes / sizeof dtypes[0] && found < 0; i++)
        if (!strcmp(dt->valuestring, dtypes[i].name)) found = (int)i;
    if (found < 0)
        return kvs_err(err, errlen, -ENOTSUP, "%s: tensor '%s': unknown dtype \"%.32s\"", file, t->name,
                       dt->valuestring);
    snprintf(t->dtype_name, sizeof t->dtype_name, "%s", dtypes[found].name);
    t->supported = dtypes[found].kvs >= 0;
    t->dtype = t->supported ? (enum kvs_dtype)dtypes[found].kvs : KVS_DTYPE_F32;
    const uint64_t elsize = (uint64_t)dtypes[found].size;
    if (!cJSON_IsArray(shape))
        return kvs_err(err, errlen, -EINVAL, "%s: tensor '%s': missing or non-array \"shape\"", file, t->name);
    int nd = cJSON_GetArraySize(shape);
    if (nd > 4)
        return kvs_err(err, errlen, -ENOTSUP, "%s: tensor '%s': %d dimensions (at most 4 supported)", file, t->name, nd);
    t->ndim = nd;
    /* element count with overflow checks: each dim < 2^53 and the product must fit in the data */
    int zero = 0;
    for (int d = 0; d < 4; d++) t->shape[d] = 0;
    for (int d = 0; d < nd; d++) {
        uint64_t v;
        if (json_u64(cJSON_GetArrayItem(shape, d), &v))
            return kvs_err(err, errlen, -EINVAL, "%s: tensor '%s': shape[%d] is not a non-negative integer", file,
                           t->name, d);
        t->shape[d] = (int64_t)v;
        if (v == 0) zero = 1;
    }
    uint64_t numel = zero ? 0 : 1;
    for (int d = 0; d < nd && !zero; d++) {
        uint64_t v = (uint64_t)t->shape[d];
        if (numel > data_len / v)
            return kvs_err(err, errlen, -EINVAL, "%s: tensor '%s': shape is larger than the file's data section",
                           file, t->name);
        numel *= v;
    }
    uint64_t nbytes = numel * elsize; /* numel <= data_len, elsize <= 8: no overflow */
    if (!cJSON_IsArray(offs) || cJSON_GetArraySize(offs) != 2)
        return kvs_err(err, errlen, -EINVAL, "%s: tensor '%s': \"data_offsets\" must be [begin, end]", file, t->name);
    if (json_u64(cJSON_GetArrayItem(offs, 0), &t->begin) || json_u64(cJSON_GetArrayItem(offs, 1), &t->end))
        return kvs_err(err, errlen, -EINVAL, "%s: tensor '%s': data_offsets are not non-negative integers", file,
                       t->name);
    if (t->begin > t->end)
        return kvs_err(err, errlen, -EINVAL, "%s: tensor '%s': data_offsets [%llu, %llu] end before begin", file,
                       t->name, (unsigned long long)t->begin, (unsigned long long)t->end);
    if (t->end > data_len)
        return kvs_err(err, errlen, -EINVAL,
                       "%s: tensor '%s': data_offsets [%llu, %llu] out of bounds (data section is %llu bytes; "
                       "file truncated?)",
                       file, t->name, (unsigned long long)t->begin, (unsigned long long)t->end,
                       (unsigned long long)data_len);
    if (t->end - t->begin != nbytes)
        return kvs_err(err, errlen, -EINVAL,
                       "%s: tensor '%s': data_offsets span %llu bytes but shape x %s needs %llu", file, t->name,
                       (unsigned long long)(t->end - t->begin), t->dtype_name,
                       (unsigned long long)nbytes);
    return 0;
}

int kvs_safetensors_parse_header(const void *buf, size_t len, const char *file, struct kvs_st_header *out,
                                 char *err, size_t errlen)
{
    memset(out, 0, sizeof *out);
    if (!file) file = "<memory>";
    const uint8_t *p = buf;
    if (len < 8)
        return kvs_err(err, errlen, -EINVAL, "%s: not a safetensors file (%zu bytes, shorter than the 8-byte header length)",
                       file, len);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | p[i];
    if (hlen > len - 8)
        return kvs_err(err, errlen, -EINVAL, "%s: header length %llu is larger than the file (%zu bytes)", file,
                       (unsigned long long)hlen, len);
    if (hlen > ST_MAX_HEADER)
        return kvs_err(err, errlen, -EINVAL, "%s: header length %llu exceeds the %u-byte limit", file,
                       (unsigned long long)hlen, ST_MAX_HEADER);
    if (hlen < 2) return kvs_err(err, errlen, -EINVAL, "%s: header is not a JSON object", file);
    /* parse a NUL-terminated copy: the header need not be terminated in the file */
    char *json = malloc(hlen + 1);
    if (!json) return kvs_err(err, errlen, -ENOMEM, "%s: out of memory for a %llu-byte header", file, (unsigned long long)hlen);
    memcpy(json, p + 8, hlen);
    json[hlen] = 0;
    if (strlen(json) != hlen) {
        free(json);
        return kvs_err(err, errlen, -EINVAL, "%s: header contains a NUL byte", file);
    }
    cJSON *root = cJSON_Parse(json);
    free(json);
    if (!root) return kvs_err(err, errlen, -EINVAL, "%s: header is not valid JSON", file);
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return kvs_err(err, errlen, -EINVAL, "%s: header is not a JSON object", file);
    }
    uint64_t data_len = (uint64_t)len - 8 - hlen;
    int n = 0;
    for (const cJSON *e = root->child; e; e = e->next) n++;
    struct kvs_st_tensor *ts = calloc((size_t)n + 1, sizeof *ts);
    struct kvs_st_tensor **by_off = calloc((size_t)n + 1, sizeof *by_off);
    if (!ts || !by_off) {
        free(ts);
        free(by_off);
        cJSON_Delete(root);
        return kvs_err(err, errlen, -ENOMEM, "%s: out of memory for %d tensors", file, n);
    }
    out->tensors = ts;
    int rc = 0, k = 0;
    for (const cJSON *e = root->child; e; e = e->next) {
        if (!e->string) {
            rc = kvs_err(err, errlen, -EINVAL, "%s: header entry without a name", file);
            break;
        }
        if (!strcmp(e->string, "__metadata__")) continue;
        ts[k].name = strdup(e->string);
        if (!ts[k].name) {
            rc = kvs_err(err, errlen, -ENOMEM, "%s: out of memory", file);
            break;
        }
        out->n_tensors = ++k;
        rc = parse_entry(e, file, &ts[k - 1], data_len, err, errlen);
        if (rc) break;
    }
    cJSON_Delete(root);
    if (!rc) {
        qsort(ts, (size_t)k, sizeof *ts, cmp_tensor_name);
        for (int i = 1; i < k && !rc; i++)
            if (!strcmp(ts[i - 1].name, ts[i].name))
                rc = kvs_err(err, errlen, -EINVAL, "%s: tensor '%s' appears twice in the header", file, ts[i].name);
    }
    if (!rc) {
        for (int i = 0; i < k; i++) by_off[i] = &ts[i];
        qsort(by_off, (size_t)k, sizeof *by_off, cmp_tensor_begin);
        for (int i = 1; i < k && !rc; i++) {
            const struct kvs_st_tensor *a = by_off[i - 1], *b = by_off[i];
            if (b->begin < a->end)
                rc = kvs_err(err, errlen, -EINVAL, "%s: tensor '%s' [%llu, %llu] overlaps tensor '%s' [%llu, %llu]",
                             file, b->name, (unsigned long long)b->begin, (unsigned long long)b->end, a->name,
                             (unsigned long long)a->begin, (unsigned long long)a->end);
        }
    }
    free(by_off);
    if (rc) {
        kvs_safetensors_header_free(out);
        return rc;
    }
    out->data_start = 8 + hlen;
    return 0;
}

int kvs_safetensors_find(const struct kvs_st_header *h, const char *name)
{
    int lo = 0, hi = h->n_tensors - 1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2;
        int c = strcmp(h->tensors[mid].name, name);
        if (!c) return mid;
        if (c < 0) lo = mid + 1;
        else hi = mid - 1;
    }
    return -1;
}

int kvs_safetensors_open(const char *path, struct kvs_st_file **out, char *err, size_t errlen)
{
    *out = NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return kvs_err(err, errlen, -errno, "%s: cannot open: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st)) {
        int e = errno;
        close(fd);
        return kvs_err(err, errlen, -e, "%s: cannot stat: %s", path, strerror(e));
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return kvs_err(err, errlen, -EINVAL, "%s: not a regular file", path);
    }
    size_t size = (size_t)st.st_size;
    if (size < 8) {
        close(fd);
        return kvs_err(err, errlen, -EINVAL, "%s: not a safetensors file (%zu bytes, shorter than the 8-byte header length)",
                       path, size);
    }
    void *map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd); /* the mapping keeps the file alive */
    if (map == MAP_FAILED) return kvs_err(err, errlen, -e, "%s: mmap failed: %s", path, strerror(e));
    struct kvs_st_file *f = kvs_xcalloc(1, sizeof *f);
    f->path = kvs_xstrdup(path);
    f->map = map;
    f->size = size;
    int rc = kvs_safetensors_parse_header(map, size, path, &f->h, err, errlen);
    if (rc) {
        kvs_safetensors_close(f);
        return rc;
    }
    *out = f;
    return 0;
}

void kvs_safetensors_close(struct kvs_st_file *f)
{
    if (!f) return;
    if (f->map) munmap((void *)f->map, f->size);
    kvs_safetensors_header_free(&f->h);
    free(f->path);
    free(f);
}

void kvs_safetensors_view(const struct kvs_st_file *f, int i, struct kvs_tensor_view *out)
{
    KVS_ASSERT(i >= 0 && i < f->h.n_tensors && f->h.tensors[i].supported);
    const struct kvs_st_tensor *t = &f->h.tensors[i];
    memset(out, 0, sizeof *out);
    out->dtype = t->dtype;
    out->ndim = t->ndim;
    for (int d = 0; d < 4; d++) out->shape[d] = t->shape[d];
    out->data = f->map + f->h.data_start + t->begin;
    out->nbytes = (size_t)(t->end - t->begin);
    out->file = f->path;
}
