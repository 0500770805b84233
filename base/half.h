/* half.h: IEEE binary16 (fp16) and bfloat16 conversions on the host, bit-exact and portable (no
 * compiler half type: clang on x86 without F16C has none). f32 -> f16 and f32 -> bf16 round to
 * nearest even, overflow to infinity and keep NaNs quiet. Header-only; no errors. */
#ifndef KVS_BASE_HALF_H
#define KVS_BASE_HALF_H

#include <stdint.h>
#include <string.h>

static inline float kvs_bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* f32 -> bf16, rounded to nearest even; a NaN stays a quiet NaN */
static inline uint16_t kvs_f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* f32 -> the nearest bf16 value (ties to even), as f32: a value both an f32 and a bf16 store hold exactly */
static inline float kvs_bf16_round(float f) { return kvs_bf16_to_f32(kvs_f32_to_bf16(f)); }

static inline float kvs_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13); /* inf / nan */
    } else if (exp) {
        u = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man) { /* subnormal: normalise */
        int e = -1;
        do {
            e++;
            man <<= 1;
        } while (!(man & 0x400));
        u = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
    } else {
        u = sign;
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t kvs_f32_to_f16(float f)
{
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000, exp = (x >> 23) & 0xff;
    uint32_t man = x & 0x7fffff;
    if (exp == 0xff) return (uint16_t)(sign | 0x7c00 | (man ? 0x200 | (man >> 13) : 0));
    const int32_t e = (int32_t)exp - 112;   /* the fp16 exponent field */
    if (e >= 0x1f) return (uint16_t)(sign | 0x7c00);
    if (e <= 0) {   /* fp16 subnormal (or zero): count units of 2^-24 */
        if (e < -10) return (uint16_t)sign;
        man |= 0x800000;
        const uint32_t shift = (uint32_t)(14 - e), rem = man & ((1u << shift) - 1), mid = 1u << (shift - 1);
        uint32_t h = man >> shift;
        if (rem > mid || (rem == mid && (h & 1))) h++;
        return (uint16_t)(sign | h);
    }
    uint32_t h = sign | ((uint32_t)e << 10) | (man >> 13);
    const uint32_t rem = man & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) h++;   /* a carry into the exponent is right */
    return (uint16_t)h;
}

#endif
