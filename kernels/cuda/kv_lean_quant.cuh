/* kv_lean_quant.cuh: LeanKV's quantizer arithmetic on the device, shared by the static modes'
 * write (kv_lean.cu) and the dynamic mode's exit (kv_lean_dyn.cu), so that both stay bitwise
 * the host quantizer's (kernels/kv_lean_format.c: kvs_lean_quantize) from one copy.
 *
 * Every operation is the host's, in the host's order, with explicit rounding (__f*_rn) so nvcc
 * cannot contract a multiply-add into an fma: the same vector gives the same codes and the same
 * fp16 scale / zero on both sides. The inverse (lean_dequant) is the host's kvs_lean_dequantize
 * likewise, for the bf16 scratch of the prompt-chunk path (kv_lean_prefill.cu k_lean_dq). Header-only (device inline functions); no state, no errors. */
#ifndef KVS_KV_LEAN_QUANT_CUH
#define KVS_KV_LEAN_QUANT_CUH

#include <cuda_fp16.h>
#include <stdint.h>

__device__ __forceinline__ float lean_h2f(uint16_t u) { return __half2float(__ushort_as_half(u)); }
__device__ __forceinline__ uint16_t lean_f2h(float x) { return __half_as_ushort(__float2half_rn(x)); }

/* the host's sat_half: clamps to the finite fp16 range (a NaN stays NaN, as on the host) */
__device__ __forceinline__ float lean_sat_half(float x)
{
    return x > 65504.0f ? 65504.0f : x < -65504.0f ? -65504.0f : x;
}

/* the smallest fp16 >= x (x >= 0, finite; saturates at the largest finite fp16), as half_ceil */
__device__ __forceinline__ uint16_t lean_half_ceil(float x)
{
    if (x > 65504.0f) return 0x7bff;
    uint16_t u = lean_f2h(x);
    if (lean_h2f(u) < x) u++;
    return u;
}

/* a vector's fp16 scale and zero from its min and max at `bits` (< 16): z = fp16(-mn), then the
 * smallest fp16 s with (mx + z) / s <= top and -2 (mn + z) <= s (so codes round to [0, top] and
 * |x - x^| <= s / 2); the stored halves (sh, zh) and their float values (s, z) */
struct lean_sz {
    uint16_t sh, zh;
    float s, z;
};

__device__ __forceinline__ lean_sz lean_scale_zero(float mn, float mx, int bits)
{
    lean_sz r;
    const int top = (1 << bits) - 1;
    r.zh = lean_f2h(lean_sat_half(-mn));
    r.z = lean_h2f(r.zh);
    const float lo = __fadd_rn(mn, r.z), hi = __fadd_rn(mx, r.z);
    float need = __fdiv_rn(hi, (float)top);
    if (__fmul_rn(-2.0f, lo) > need) need = __fmul_rn(-2.0f, lo);
    if (need < 5.9604645e-08f) need = 5.9604645e-08f;   /* the smallest fp16 subnormal */
    r.sh = lean_half_ceil(need);
    r.s = lean_h2f(r.sh);
    return r;
}

/* the code of x under (s, z): round((x + z) / s) clamped to [0, top] */
__device__ __forceinline__ int lean_code(float x, const lean_sz &q, int top)
{
    const float c = floorf(__fadd_rn(__fdiv_rn(__fadd_rn(x, q.z), q.s), 0.5f));
    return c < 0.0f ? 0 : c > (float)top ? top : (int)c;
}

/* (s, z) as stored after a vector's codes: s then z, little-endian fp16 */
__device__ __forceinline__ void lean_put_sz(uint8_t *sz, const lean_sz &q)
{
    sz[0] = (uint8_t)(q.sh & 0xff), sz[1] = (uint8_t)(q.sh >> 8), sz[2] = (uint8_t)(q.zh & 0xff), sz[3] = (uint8_t)(q.zh >> 8);
}

/* x^ = s c - z as the host's kvs_lean_dequantize computes it: fp32, the product rounded, then the
 * difference (no fma), so the same code and (s, z) give the same float on both sides */
__device__ __forceinline__ float lean_dequant(float s, float z, int c)
{
    return __fsub_rn(__fmul_rn(s, (float)c), z);
}

#endif
