/* gguf_quant.c: ggml block formats -> fp32, following ggml-quants.c's dequantize_row_* (the
 * formulas, the order of the float operations and the fp16 conversions are ggml's, so that the
 * results equal gguf-py's numpy dequantizers bit for bit or within an ulp). */
#include "base/half.h"
#include "models/gguf_quant.h"

#include <string.h>

#include "base/util.h"
#include "models/gguf.h"

static float h2f(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, 2);
    return kvs_f16_to_f32(h);
}

static float bf2f(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, 2);
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static void q4_0(const uint8_t *b, float *y)
{
    const float d = h2f(b);
    const uint8_t *qs = b + 2;
    for (int j = 0; j < 16; j++) {
        y[j] = (float)((qs[j] & 0xF) - 8) * d;
        y[j + 16] = (float)((qs[j] >> 4) - 8) * d;
    }
}

static void q4_1(const uint8_t *b, float *y)
{
    const float d = h2f(b), m = h2f(b + 2);
    const uint8_t *qs = b + 4;
    for (int j = 0; j < 16; j++) {
        y[j] = (float)(qs[j] & 0xF) * d + m;
        y[j + 16] = (float)(qs[j] >> 4) * d + m;
    }
}

static void q5_0(const uint8_t *b, float *y)
{
    const float d = h2f(b);
    uint32_t qh;
    memcpy(&qh, b + 2, 4);
    const uint8_t *qs = b + 6;
    for (int j = 0; j < 16; j++) {
        const int xh0 = (int)(((qh >> j) << 4) & 0x10), xh1 = (int)((qh >> (j + 12)) & 0x10);
        y[j] = (float)(((qs[j] & 0xF) | xh0) - 16) * d;
        y[j + 16] = (float)(((qs[j] >> 4) | xh1) - 16) * d;
    }
}

static void q5_1(const uint8_t *b, float *y)
{
    const float d = h2f(b), m = h2f(b + 2);
    uint32_t qh;
    memcpy(&qh, b + 4, 4);
    const uint8_t *qs = b + 8;
    for (int j = 0; j < 16; j++) {
        const int xh0 = (int)(((qh >> j) << 4) & 0x10), xh1 = (int)((qh >> (j + 12)) & 0x10);
        y[j] = (float)((qs[j] & 0xF) | xh0) * d + m;
        y[j + 16] = (float)((qs[j] >> 4) | xh1) * d + m;
    }
}

static void q8_0(const uint8_t *b, float *y)
{
    const float d = h2f(b);
    for (int j = 0; j < 32; j++) y[j] = (float)(int8_t)b[2 + j] * d;
}

/* The 6-bit scale and min of sub-block j of a Q4_K / Q5_K super-block (12 packed bytes). */
static void scale_min_k4(int j, const uint8_t *q, uint8_t *d, uint8_t *m)
{
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *m = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

/* Q4_K: f16 d, f16 dmin, 12 bytes of scales/mins, 128 bytes of 4-bit quants. */
static void q4_k(const uint8_t *b, float *y)
{
    const float d = h2f(b), min = h2f(b + 2);
    const uint8_t *scales = b + 4, *q = b + 16;
    int is = 0;
    for (int j = 0; j < 256; j += 64) {
        uint8_t sc, m;
        scale_min_k4(is, scales, &sc, &m);
        const float d1 = d * sc, m1 = min * m;
        scale_min_k4(is + 1, scales, &sc, &m);
        const float d2 = d * sc, m2 = min * m;
        for (int l = 0; l < 32; l++) *y++ = d1 * (float)(q[l] & 0xF) - m1;
        for (int l = 0; l < 32; l++) *y++ = d2 * (float)(q[l] >> 4) - m2;
        q += 32;
        is += 2;
    }
}

/* Q5_K: f16 d, f16 dmin, 12 bytes of scales/mins, 32 bytes of high bits, 128 bytes of low nibbles. */
static void q5_k(const uint8_t *b, float *y)
{
    const float d = h2f(b), min = h2f(b + 2);
    const uint8_t *scales = b + 4, *qh = b + 16, *ql = b + 48;
    int is = 0;
    unsigned u1 = 1, u2 = 2;
    for (int j = 0; j < 256; j += 64) {
        uint8_t sc, m;
        scale_min_k4(is, scales, &sc, &m);
        const float d1 = d * sc, m1 = min * m;
        scale_min_k4(is + 1, scales, &sc, &m);
        const float d2 = d * sc, m2 = min * m;
        for (int l = 0; l < 32; l++) *y++ = d1 * (float)((ql[l] & 0xF) + (qh[l] & u1 ? 16 : 0)) - m1;
        for (int l = 0; l < 32; l++) *y++ = d2 * (float)((ql[l] >> 4) + (qh[l] & u2 ? 16 : 0)) - m2;
        ql += 32;
        is += 2;
        u1 <<= 2;
        u2 <<= 2;
    }
}

/* Q6_K: 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, 16 int8 scales, f16 d. */
static void q6_k(const uint8_t *b, float *y)
{
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = h2f(b + 208);
    for (int n = 0; n < 256; n += 128) {
        for (int l = 0; l < 32; l++) {
            const int is = l / 16;
            const int q1 = (int)((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
            const int q2 = (int)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
            const int q3 = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            const int q4 = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            y[l] = d * (float)sc[is] * (float)q1;
            y[l + 32] = d * (float)sc[is + 2] * (float)q2;
            y[l + 64] = d * (float)sc[is + 4] * (float)q3;
            y[l + 96] = d * (float)sc[is + 6] * (float)q4;
        }
        y += 128;
        ql += 64;
        qh += 32;
        sc += 8;
    }
}

typedef void (*block_fn)(const uint8_t *b, float *y);

static block_fn block_of(uint32_t type)
{
    switch (type) {
    case KVS_GGML_Q4_0: return q4_0;
    case KVS_GGML_Q4_1: return q4_1;
    case KVS_GGML_Q5_0: return q5_0;
    case KVS_GGML_Q5_1: return q5_1;
    case KVS_GGML_Q8_0: return q8_0;
    case KVS_GGML_Q4_K: return q4_k;
    case KVS_GGML_Q5_K: return q5_k;
    case KVS_GGML_Q6_K: return q6_k;
    }
    return NULL;
}

int kvs_ggml_type_supported(uint32_t type)
{
    return type == KVS_GGML_F32 || type == KVS_GGML_F16 || type == KVS_GGML_BF16 || block_of(type) != NULL;
}

const char *kvs_ggml_supported_list(void)
{
    return "F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K";
}

int kvs_ggml_dequantize(uint32_t type, const void *src, float *dst, size_t n, char *err, size_t errlen)
{
    const uint8_t *s = src;
    uint32_t be, bb;
    if (!kvs_ggml_type_supported(type) || kvs_ggml_type_block(type, &be, &bb))
        return kvs_err(err, errlen, -ENOTSUP, "ggml type %s (%u) is not supported (supported: %s)",
                       kvs_ggml_type_name(type), type, kvs_ggml_supported_list());
    KVS_ASSERT(n % be == 0);
    switch (type) {
    case KVS_GGML_F32: memcpy(dst, s, n * 4); return 0;
    case KVS_GGML_F16:
        for (size_t i = 0; i < n; i++) dst[i] = h2f(s + 2 * i);
        return 0;
    case KVS_GGML_BF16:
        for (size_t i = 0; i < n; i++) dst[i] = bf2f(s + 2 * i);
        return 0;
    }
    block_fn f = block_of(type);
    for (size_t i = 0; i < n / be; i++) f(s + i * bb, dst + i * be);
    return 0;
}
