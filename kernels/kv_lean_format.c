/* kv_lean_format.c: LeanKV's per-vector quantizer and its inverse on the host (kernels/kv_lean.h),
 * independent of any backend: the CPU kernels use it, and it is the reference the tests hold
 * every kernel to. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "base/half.h"
#include "kernels/kv_lean.h"

/* fp16 round to nearest even, bit-exact (base/half.h: no compiler half type needed) */
static uint16_t float_to_half(float x) { return kvs_f32_to_f16(x); }

float kvs_lean_half_to_float(uint16_t u) { return kvs_f16_to_f32(u); }

/* the smallest fp16 >= x (x >= 0, finite; saturates at the largest finite fp16) */
static uint16_t half_ceil(float x)
{
    if (x > 65504.0f) return 0x7bff;
    uint16_t u = float_to_half(x);
    if (kvs_lean_half_to_float(u) < x) u++;   /* positive halves are ordered like their bits */
    return u;
}

static float sat_half(float x) { return x > 65504.0f ? 65504.0f : x < -65504.0f ? -65504.0f : x; }

int kvs_lean_fmt_parse(const char *name, struct kvs_lean_fmt *f)
{
    int kb = 0, vb = 0, used = 0;
    if (!name || sscanf(name, "K%dV%d%n", &kb, &vb, &used) != 2 || name[used]) return -EINVAL;
    for (int i = 0; i < 2; i++) {
        int b = i ? vb : kb;
        if (b != 2 && b != 4 && b != 8 && b != 16) return -EINVAL;
    }
    f->kbits = kb, f->vbits = vb;
    return 0;
}

void kvs_lean_quantize(const float *x, int d, int bits, uint8_t *codes, uint16_t sz[2])
{
    if (bits == 16) {
        for (int i = 0; i < d; i++) {
            uint16_t h = float_to_half(sat_half(x[i]));
            codes[2 * i] = (uint8_t)h, codes[2 * i + 1] = (uint8_t)(h >> 8);
        }
        sz[0] = sz[1] = 0;
        return;
    }
    float mn = x[0], mx = x[0];
    for (int i = 1; i < d; i++) {
        if (x[i] < mn) mn = x[i];
        if (x[i] > mx) mx = x[i];
    }
    const int top = (1 << bits) - 1;
    /* z first, rounded to fp16; then s wide enough that every x lands within half a step of a
     * code with that z: (mx + z) / s <= top, and (mn + z) / s >= -1/2 */
    const uint16_t zh = float_to_half(sat_half(-mn));
    const float z = kvs_lean_half_to_float(zh);
    const float lo = mn + z, hi = mx + z;
    float need = hi / (float)top;
    if (-2.0f * lo > need) need = -2.0f * lo;
    if (need < 5.9604645e-08f) need = 5.9604645e-08f;   /* the smallest fp16 subnormal */
    const uint16_t sh = half_ceil(need);
    const float s = kvs_lean_half_to_float(sh);
    memset(codes, 0, (size_t)d * bits / 8);
    for (int i = 0; i < d; i++) {
        float c = floorf((x[i] + z) / s + 0.5f);
        int q = c < 0.0f ? 0 : c > (float)top ? top : (int)c;
        int per = 8 / bits;
        codes[i / per] |= (uint8_t)(q << (bits * (i % per)));
    }
    sz[0] = sh, sz[1] = zh;
}

void kvs_lean_dequantize(const uint8_t *codes, const uint16_t sz[2], int d, int bits, float *out)
{
    if (bits == 16) {
        for (int i = 0; i < d; i++) out[i] = kvs_lean_half_to_float((uint16_t)(codes[2 * i] | codes[2 * i + 1] << 8));
        return;
    }
    const float s = kvs_lean_half_to_float(sz[0]), z = kvs_lean_half_to_float(sz[1]);
    const int per = 8 / bits, mask = (1 << bits) - 1;
    for (int i = 0; i < d; i++) out[i] = s * (float)(codes[i / per] >> (bits * (i % per)) & mask) - z;
}
