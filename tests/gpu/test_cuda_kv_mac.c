/* test_cuda_kv_mac.c (GPU): MAC-Attention's CUDA kernels (kernels/cuda/kv_mac.cu) against the CPU
 * reference (kernels/cpu/kv_mac.c) on the same scenario (tests/unit/kv_mac_case.h): per head
 * shape (head_dim 64 / 128; 1, 2, 4 and 8 q heads per KV head) and per layout (plain; the
 * LazyAttention one with rotation offsets and padded blocks), four sequences append a 16-row
 * prefill chunk and then decode 40 steps through a ring of K = 16 (it wraps): sequence 0
 * repeats one query (every step hits, the lowest entry), 1 draws large random queries (every
 * step misses), 2 alternates two queries, 3 repeats its last prefill query. The matched
 * positions must be equal, outputs within the bf16 tolerance (rel-L2 <= 2e-2; the CUDA rings
 * hold bf16), log-sum-exps within 2e-2. The same at ~6K-token contexts (several splits of the
 * tiled span kernel, bands across tile boundaries, a ring of 40 entries). KVS_MAC_MATCH=0 /
 * KVS_MAC_SPAN=0 run the first kernels through the same checks. */
#include <stdio.h>

#include "kernels/cuda/cuda_backend.h"
#include "tests/unit/kv_mac_case.h"
#include "tests/unit/test_util.h"

static double rel_l2(const float *a, const float *b, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]), den += (double)b[i] * b[i];
    return sqrt(num / (den > 0 ? den : 1));
}

/* far > 0: contexts of ~6K tokens (400 blocks a sequence): the tiled span kernel's several
 * splits of many 32-key tiles, bands crossing tile and split boundaries, and the coalesced
 * match over a ring of K = 40 (several entry blocks) */
static void run_shape(struct kvs_backend *cpu, struct kvs_backend *gpu, int nh, int nkv, int hd, int use_rot,
                      double *worst, int far)
{
    struct mc c, g;
    const int S = 4, K = far ? 40 : 16, band = far ? 300 : 24, bs = 16, max_blocks = far ? 400 : 48;
    mc_rng = 0xabcdef12u + (uint64_t)(nh * 131 + hd + use_rot);
    mc_init(&c, &kvs_cpu_backend, cpu, S, nh, nkv, hd, bs, max_blocks, K, band, use_rot);
    mc_rng = 0xabcdef12u + (uint64_t)(nh * 131 + hd + use_rot);
    mc_init(&g, &kvs_cuda_backend, gpu, S, nh, nkv, hd, bs, max_blocks, K, band, use_rot);
    c.thresh2 = g.thresh2 = 2.0f * hd * 0.55f * 0.55f;   /* tau = 0.45 */
    const size_t qd = (size_t)nh * hd;
    float *fixed = malloc(3 * qd * 4), *q = malloc(16 * S * qd * 4);
    for (size_t i = 0; i < 3 * qd; i++) fixed[i] = 3.0f * mc_frand();   /* far from the small prefill queries */
    /* prefill: 16 rows per sequence, appended */
    int pos[4] = {300, 420, 511, 377}, nr[4] = {16, 16, 16, 16}, fl[4];
    for (int s = 0; far && s < S; s++) pos[s] += 5600 + 37 * s;
    for (int s = 0; s < S; s++) fl[s] = KVS_MAC_F_APPEND;
    for (size_t i = 0; i < 16 * S * qd; i++) q[i] = mc_frand();
    for (int s = 0; s < S; s++) memcpy(q + ((size_t)s * 16 + 15) * qd, s == 3 ? fixed + 2 * qd : q, qd * 4);
    mc_step(&c, pos, nr, fl, q, q);
    mc_step(&g, pos, nr, fl, q, q);
    int hits = 0, misses = 0, p_same = 1;
    for (int step = 0; step < 40; step++) {
        for (int s = 0; s < S; s++) pos[s]++, nr[s] = 1, fl[s] = KVS_MAC_F_MAC | KVS_MAC_F_MATCH | KVS_MAC_F_APPEND;
        for (int s = 0; s < S; s++) {
            float *qs = q + (size_t)s * qd;
            if (s == 0) memcpy(qs, fixed, qd * 4);
            else if (s == 1) for (size_t i = 0; i < qd; i++) qs[i] = 4.0f * mc_frand();
            else if (s == 2) memcpy(qs, fixed + (size_t)(step % 2) * qd, qd * 4);
            else memcpy(qs, fixed + 2 * qd, qd * 4);
        }
        mc_step(&c, pos, nr, fl, q, q);
        mc_step(&g, pos, nr, fl, q, q);
        for (int i = 0; i < S * nh; i++) {
            p_same &= c.o_p[i] == g.o_p[i];
            hits += c.o_p[i] >= 0, misses += c.o_p[i] < 0;
        }
        const double e = rel_l2(g.o_out, c.o_out, S * qd);
        double el = 0;
        for (int i = 0; i < S * nh; i++) el = fmax(el, fabs(g.o_lse[i] - c.o_lse[i]));
        if (e > *worst) *worst = e;
        CHECK(e <= 2e-2 && el <= 2e-2, "heads %d/%d hd %d rot %d step %d: rel-L2 %g, lse err %g", nh, nkv, hd, use_rot,
              step, e, el);
    }
    CHECK(p_same && hits > 0 && misses > 0, "heads %d/%d hd %d rot %d: matches equal %d (%d hits, %d misses)", nh,
          nkv, hd, use_rot, p_same, hits, misses);
    printf("ok cuda mac heads %d/%d head_dim %d %s%s: 40 steps x 4 sequences, %d hits / %d misses, matches equal, "
           "worst rel-L2 so far %.2e\n", nh, nkv, hd, use_rot ? "lazy layout" : "plain", far ? " at ~6K context" : "", hits, misses, *worst);
    free(fixed), free(q);
    mc_free(&c), mc_free(&g);
}

/* count() on the device equals the CPU reference's on the same inputs */
static void run_count(struct kvs_backend *cpu, struct kvs_backend *gpu)
{
    struct mc c, g;
    mc_init(&c, &kvs_cpu_backend, cpu, 4, 32, 8, 128, 16, 8, 16, 256, 0);
    mc_init(&g, &kvs_cuda_backend, gpu, 4, 32, 8, 128, 16, 8, 16, 256, 0);
    int32_t rows[5 * 4], p[3 * 5 * 32];
    uint64_t a[KVS_MAC_N_COUNTS], b[KVS_MAC_N_COUNTS];
    mc_count(&c, rows, p, a);
    mc_count(&g, rows, p, b);
    CHECK(!memcmp(a, b, sizeof a) && a[KVS_MAC_C_HITS] > 0, "count: cuda %llu %llu %llu %llu %llu vs cpu %llu %llu %llu %llu %llu",
          (unsigned long long)b[0], (unsigned long long)b[1], (unsigned long long)b[2], (unsigned long long)b[3],
          (unsigned long long)b[4], (unsigned long long)a[0], (unsigned long long)a[1], (unsigned long long)a[2],
          (unsigned long long)a[3], (unsigned long long)a[4]);
    printf("ok cuda mac count: counters equal the CPU reference's\n");
    mc_free(&c), mc_free(&g);
}

int main(void)
{
    char err[256];
    struct kvs_backend *gpu = kvs_cuda_backend.create(0, err, sizeof err);
    REQUIRE(gpu, "no CUDA backend: %s", err);
    struct kvs_backend *cpu = kvs_cpu_backend.create(4, err, sizeof err);
    REQUIRE(cpu, "%s", err);
    REQUIRE(kvs_mac_kernels_for(&kvs_cuda_backend, err, sizeof err), "%s", err);
    const int shapes[][3] = {{8, 2, 128}, {4, 1, 64}, {8, 8, 64}, {16, 2, 128}, {32, 8, 128}};
    double worst = 0;
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
        for (int rot = 0; rot < 2; rot++) run_shape(cpu, gpu, shapes[i][0], shapes[i][1], shapes[i][2], rot, &worst, 0);
    /* long contexts: the same checks where splits and many tiles matter */
    for (int rot = 0; rot < 2; rot++) run_shape(cpu, gpu, 8, 2, 128, rot, &worst, 1);
    run_shape(cpu, gpu, 8, 8, 64, 1, &worst, 1);
    run_count(cpu, gpu);
    kvs_cpu_backend.free(cpu);
    kvs_cuda_backend.free(gpu);
    return kvs_test_summary("test_cuda_kv_mac");
}
