/* cpu_gemm_ref.h: the references the CPU GEMM tests compare against (test_cpu_kernels,
 * test_cpu_gemm_panel). Header-only (static); nothing allocated, no errors.
 *   gemm_mirror  y[t][o] = dot(x_t, w_o) + bias[o], with the dot product in a fast kernel's own
 *                summation order (kvs_cpu_dot_fma, kvs_cpu_dot_seq), so the kernel must match it
 *                bitwise;
 *   gemm_err     the worst |a - b| over the element's magnitude bound sum_k |x w| + |bias| (fp32
 *                rounding of a length-in sum stays far below 1e-5 of it). */
#ifndef KVS_TEST_CPU_GEMM_REF_H
#define KVS_TEST_CPU_GEMM_REF_H

#include <math.h>
#include <stddef.h>

static inline void gemm_mirror(float (*dot)(const float *, const float *, int), const float *x, const float *w,
                               const float *bias, int n, int in, int out, float *y)
{
    for (int t = 0; t < n; t++)
        for (int o = 0; o < out; o++) {
            const float s = dot(x + (size_t)t * in, w + (size_t)o * in, in);
            y[(size_t)t * out + o] = bias ? s + bias[o] : s;
        }
}

static inline double gemm_err(const float *x, const float *w, const float *bias, int n, int in, int out,
                              const float *a, const float *b)
{
    double worst = 0;
    for (int t = 0; t < n; t++)
        for (int o = 0; o < out; o++) {
            double mag = bias ? fabs(bias[o]) : 0.0;
            for (int k = 0; k < in; k++) mag += fabs((double)x[(size_t)t * in + k] * w[(size_t)o * in + k]);
            double e = fabs((double)a[(size_t)t * out + o] - b[(size_t)t * out + o]) / (mag > 0 ? mag : 1.0);
            if (!(e <= worst)) worst = e;
        }
    return worst;
}

#endif
