/* test_cuda_kv_mac.c (GPU): MAC-Attention's CUDA kernels (kernels/cuda/kv_mac.cu) against the CPU
 * reference (kernels/cpu/kv_mac.c) on the same scenario (tests/unit/kv_mac_case.h): per head
 * shape (head_dim 64 / 128; 1, 2, 4 and 8 q heads per KV head, and the odd or wide groups 3 (SmolLM2's
 * 9/3), 5, 12 and 16, where the span kernel's m-tile rows do not fill evenly or take two m-tiles) and
 * per layout (plain; the
 * LazyAttention one with rotation offsets and padded blocks), four sequences append a 16-row
 * prefill chunk and then decode 40 steps through a ring of K = 16 (it wraps): sequence 0
 * repeats one query (every step hits, the lowest entry), 1 draws large random queries (every
 * step misses), 2 alternates two queries, 3 repeats its last prefill query. The matched
 * positions must be equal, outputs within the bf16 tolerance (rel-L2 <= 2e-2; the CUDA rings
 * hold bf16), log-sum-exps within 2e-2. The same at ~6K-token contexts (several splits of the
 * tiled span kernel, bands across tile boundaries, a ring of 40 entries). KVS_MAC_MATCH=0 /
 * KVS_MAC_SPAN=0 run the first kernels through the same checks.
 * Over LeanKV pages (kv.storage = lean, static modes K16V16 / K8V8 / K8V4 / K4V4; kernels/kv_mac.h
 * lean): the same scenario with the pool written as pages by each backend's LeanKV writer: CUDA
 * against the CPU reference (matches equal, the same tolerances), and CUDA over the pages equal,
 * bitwise, to CUDA over a bf16 pool holding the dequantized K/V (the lean stage fills the tiles
 * the plain path copies). Through the engine: lean K8V4 + mac at tau 0 with graphs and eagerly. */
#include <stdio.h>

#include "base/util.h"
#include "engine/config.h"
#include "kernels/cuda/cuda_backend.h"
#include "models/model.h"
#include "tests/unit/kv_engine_run.h"
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
    mc_scene_prefill(q, fixed, S, qd);
    mc_step(&c, pos, nr, fl, q, q);
    mc_step(&g, pos, nr, fl, q, q);
    int hits = 0, misses = 0, p_same = 1;
    for (int step = 0; step < 40; step++) {
        for (int s = 0; s < S; s++) pos[s]++, nr[s] = 1, fl[s] = KVS_MAC_F_MAC | KVS_MAC_F_MATCH | KVS_MAC_F_APPEND;
        mc_scene_step(q, fixed, S, qd, step);
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

/* MAC over LeanKV pages of format f: c = the CPU reference over the pages, g = CUDA over the pages,
 * h = CUDA over a bf16 pool of the dequantized K/V (mc_lean_plain); run_shape's steps */
static void run_lean(struct kvs_backend *cpu, struct kvs_backend *gpu, int nh, int nkv, int hd, int use_rot,
                     struct kvs_lean_fmt f, double *worst, int far)
{
    struct mc c, g, h;
    const int S = 4, K = far ? 40 : 16, band = far ? 300 : 24, bs = 16, max_blocks = far ? 400 : 48;
    const uint64_t seed = 0x1ea75eedu + (uint64_t)(nh * 131 + hd + use_rot + f.kbits * 7 + f.vbits);
    mc_rng = seed;
    mc_init(&c, &kvs_cpu_backend, cpu, S, nh, nkv, hd, bs, max_blocks, K, band, use_rot);
    mc_rng = seed;
    mc_init(&g, &kvs_cuda_backend, gpu, S, nh, nkv, hd, bs, max_blocks, K, band, use_rot);
    mc_rng = seed;
    mc_init(&h, &kvs_cuda_backend, gpu, S, nh, nkv, hd, bs, max_blocks, K, band, use_rot);
    REQUIRE(mc_lean(&c, f) == 0 && mc_lean(&g, f) == 0, "LeanKV kernels missing");
    mc_lean_plain(&h, f);
    c.thresh2 = g.thresh2 = h.thresh2 = 2.0f * hd * 0.55f * 0.55f;   /* tau = 0.45 */
    const size_t qd = (size_t)nh * hd;
    float *fixed = malloc(3 * qd * 4), *q = malloc(16 * S * qd * 4);
    for (size_t i = 0; i < 3 * qd; i++) fixed[i] = 3.0f * mc_frand();
    int pos[4] = {300, 420, 511, 377}, nr[4] = {16, 16, 16, 16}, fl[4];
    for (int s = 0; far && s < S; s++) pos[s] += 5600 + 37 * s;
    for (int s = 0; s < S; s++) fl[s] = KVS_MAC_F_APPEND;
    mc_scene_prefill(q, fixed, S, qd);
    mc_step(&c, pos, nr, fl, q, q);
    mc_step(&g, pos, nr, fl, q, q);
    mc_step(&h, pos, nr, fl, q, q);
    int hits = 0, misses = 0, p_same = 1, bitwise = 1;
    for (int step = 0; step < 30; step++) {
        for (int s = 0; s < S; s++) pos[s]++, nr[s] = 1, fl[s] = KVS_MAC_F_MAC | KVS_MAC_F_MATCH | KVS_MAC_F_APPEND;
        mc_scene_step(q, fixed, S, qd, step);
        mc_step(&c, pos, nr, fl, q, q);
        mc_step(&g, pos, nr, fl, q, q);
        mc_step(&h, pos, nr, fl, q, q);
        for (int i = 0; i < S * nh; i++) {
            p_same &= c.o_p[i] == g.o_p[i];
            hits += c.o_p[i] >= 0, misses += c.o_p[i] < 0;
        }
        bitwise &= !memcmp(g.o_out, h.o_out, S * qd * 4) && !memcmp(g.o_lse, h.o_lse, (size_t)S * nh * 4) &&
                   !memcmp(g.o_p, h.o_p, (size_t)S * nh * 4);
        const double e = rel_l2(g.o_out, c.o_out, S * qd);
        double el = 0;
        for (int i = 0; i < S * nh; i++) el = fmax(el, fabs(g.o_lse[i] - c.o_lse[i]));
        if (e > *worst) *worst = e;
        CHECK(e <= 2e-2 && el <= 2e-2, "lean K%dV%d heads %d/%d hd %d rot %d step %d: rel-L2 %g, lse err %g", f.kbits,
              f.vbits, nh, nkv, hd, use_rot, step, e, el);
    }
    CHECK(p_same && bitwise && hits > 0 && misses > 0,
          "lean K%dV%d heads %d/%d hd %d rot %d: matches equal %d, = dequantized bf16 pool bitwise %d (%d hits, %d "
          "misses)", f.kbits, f.vbits, nh, nkv, hd, use_rot, p_same, bitwise, hits, misses);
    printf("ok cuda mac over lean K%dV%d heads %d/%d head_dim %d %s%s: %d hits / %d misses, matches equal the cpu's, "
           "= mac over the dequantized bf16 pool bitwise, worst rel-L2 so far %.2e\n", f.kbits, f.vbits, nh, nkv, hd,
           use_rot ? "lazy layout" : "plain", far ? " at ~6K context" : "", hits, misses, *worst);
    free(fixed), free(q);
    mc_free(&c), mc_free(&g), mc_free(&h);
}

/* count() on the device equals the CPU reference's on the same inputs (heads nh / nkv, nh <= 32) */
static void run_count(struct kvs_backend *cpu, struct kvs_backend *gpu, int nh, int nkv, int hd)
{
    struct mc c, g;
    mc_init(&c, &kvs_cpu_backend, cpu, 4, nh, nkv, hd, 16, 8, 16, 256, 0);
    mc_init(&g, &kvs_cuda_backend, gpu, 4, nh, nkv, hd, 16, 8, 16, 256, 0);
    int32_t rows[5 * 4], p[3 * 5 * 32];
    uint64_t a[KVS_MAC_N_COUNTS], b[KVS_MAC_N_COUNTS];
    mc_count(&c, rows, p, a);
    mc_count(&g, rows, p, b);
    CHECK(!memcmp(a, b, sizeof a) && a[KVS_MAC_C_HITS] > 0, "count: cuda %llu %llu %llu %llu %llu vs cpu %llu %llu %llu %llu %llu",
          (unsigned long long)b[0], (unsigned long long)b[1], (unsigned long long)b[2], (unsigned long long)b[3],
          (unsigned long long)b[4], (unsigned long long)a[0], (unsigned long long)a[1], (unsigned long long)a[2],
          (unsigned long long)a[3], (unsigned long long)a[4]);
    printf("ok cuda mac count (heads %d/%d): counters equal the CPU reference's\n", nh, nkv);
    mc_free(&c), mc_free(&g);
}

/* Through the engine on CUDA (the demo model: head_dim 64, 4/1 heads): MAC at tau = 0 (hits from
 * the first lookups) with the runner's recorded decode graphs (its default) and eagerly
 * (KVS_GRAPHS=0): both must finish every request and count lookups and hits (in the graph run
 * the count kernel is part of the replayed step: nothing is downloaded per step). The token
 * agreement of the two runs, and of MAC at tau = 1 against full attention (both with graphs), is
 * printed, not checked: the graphs pad the batch and plan for a larger context, which changes
 * the span kernel's split count and so the summation order (not bitwise), and at tau = 0 a match
 * near the threshold can then flip and the sequences diverge. */
#define EJ 5
#define EGEN 24
static int engine_run(const char *decode, double tau, int graphs, int32_t (*got)[EGEN], struct kvs_engine_stats *st,
                      const struct kvs_model *model, const char *lean_mode)
{
    static int32_t prompt[EJ][64];
    struct kvs_test_job tj[EJ];
    uint64_t rng = 99;
    for (int i = 0; i < EJ; i++) {
        const int n = 30 + (int)(kvs_test_xorshift(&rng) % 30);
        for (int t = 0; t < n; t++) prompt[i][t] = 1 + (int32_t)(kvs_test_xorshift(&rng) % 200);
        tj[i] = (struct kvs_test_job){prompt[i], n, NULL, 0, got[i], 0, KVS_FINISH_NONE};
    }
    memset(st, 0, sizeof *st);
    struct kvs_config c;
    kvs_config_init(&c);
    free(c.device), c.device = kvs_xstrdup("cuda");
    free(c.kv_decode), c.kv_decode = kvs_xstrdup(decode);
    c.kv_block_size = 16, c.kv_memory_bytes = 8 << 20, c.max_batch_tokens = 128, c.max_running = 4;
    c.max_waiting = 64, c.max_model_len = 256;
    c.mac_tau = tau, c.mac_gen_min = 16, c.mac_ring_size = 32, c.mac_band = 4;
    if (lean_mode) {   /* kv.storage = lean in that static mode */
        free(c.kv_storage), c.kv_storage = kvs_xstrdup("lean");
        free(c.lean_mode), c.lean_mode = kvs_xstrdup(lean_mode);
    }
    if (graphs) unsetenv("KVS_GRAPHS");
    else setenv("KVS_GRAPHS", "0", 1);
    char err[256];
    int rc = kvs_test_engine_run(&c, model, tj, EJ, EGEN, st, err, sizeof err);
    unsetenv("KVS_GRAPHS");
    kvs_config_free(&c);
    CHECK(rc == 0, "engine %s: %s", decode, err);
    int ok = rc == 0;
    for (int i = 0; i < EJ; i++) ok &= tj[i].n_got == EGEN;
    return ok;
}

static double agree(int32_t (*a)[EGEN], int32_t (*b)[EGEN])
{
    int same = 0;
    for (int i = 0; i < EJ; i++)
        for (int t = 0; t < EGEN; t++) same += a[i][t] == b[i][t];
    return (double)same / (EJ * EGEN);
}

static void run_engine(void)
{
    char dir[1024], err[256];
    snprintf(dir, sizeof dir, "%s/models/demo", kvs_test_root());
    struct kvs_model *model = NULL;
    REQUIRE(kvs_model_load(dir, &model, err, sizeof err) == 0, "%s", err);
    static int32_t g0[EJ][EGEN], e0[EJ][EGEN], g1[EJ][EGEN], f1[EJ][EGEN];
    struct kvs_engine_stats sg, se, s1, sf;
    const int okg = engine_run("mac", 0.0, 1, g0, &sg, model, NULL), oke = engine_run("mac", 0.0, 0, e0, &se, model, NULL);
    const int ok1 = engine_run("mac", 1.0, 1, g1, &s1, model, NULL), okf = engine_run("full", 1.0, 1, f1, &sf, model, NULL);
    const double lg = okg ? kvs_engine_kv_counter(&sg, "kvserve:kv_mac_lookups_total") : 0;
    const double hg = okg ? kvs_engine_kv_counter(&sg, "kvserve:kv_mac_hits_total") : 0;
    const double le = oke ? kvs_engine_kv_counter(&se, "kvserve:kv_mac_lookups_total") : 0;
    const double he = oke ? kvs_engine_kv_counter(&se, "kvserve:kv_mac_hits_total") : 0;
    const double l1 = ok1 ? kvs_engine_kv_counter(&s1, "kvserve:kv_mac_lookups_total") : -1;
    CHECK(okg && oke && ok1 && okf && lg > 0 && hg > 0 && le > 0 && he > 0 && l1 == 0,
          "engine: runs ok %d %d %d %d, graphs lookups %g hits %g, eager lookups %g hits %g, tau 1 lookups %g", okg, oke,
          ok1, okf, lg, hg, le, he, l1);
    printf("ok cuda mac through the engine (demo model): graphs %g/%g hits/lookups, eager %g/%g; tokens agree "
           "graphs/eager %.0f%%, tau 1 vs full %.0f%% (printed, not checked)\n", hg, lg, he, le, 100 * agree(g0, e0),
           100 * agree(g1, f1));

    /* over LeanKV K8V4 pages: the same four runs, full over the same pages as the reference */
    const int lg_ok = engine_run("mac", 0.0, 1, g0, &sg, model, "K8V4");
    const int le_ok = engine_run("mac", 0.0, 0, e0, &se, model, "K8V4");
    const int l1_ok = engine_run("mac", 1.0, 1, g1, &s1, model, "K8V4");
    const int lf_ok = engine_run("full", 1.0, 1, f1, &sf, model, "K8V4");
    const double Lg = lg_ok ? kvs_engine_kv_counter(&sg, "kvserve:kv_mac_lookups_total") : 0;
    const double Hg = lg_ok ? kvs_engine_kv_counter(&sg, "kvserve:kv_mac_hits_total") : 0;
    const double Le = le_ok ? kvs_engine_kv_counter(&se, "kvserve:kv_mac_lookups_total") : 0;
    const double He = le_ok ? kvs_engine_kv_counter(&se, "kvserve:kv_mac_hits_total") : 0;
    const double L1 = l1_ok ? kvs_engine_kv_counter(&s1, "kvserve:kv_mac_lookups_total") : -1;
    const double cr = lg_ok ? kvs_engine_kv_counter(&sg, "kvserve:kv_storage_compression_ratio") : 0;
    CHECK(lg_ok && le_ok && l1_ok && lf_ok && Lg > 0 && Hg > 0 && Le > 0 && He > 0 && L1 == 0 && cr > 2.0,
          "engine lean K8V4: runs ok %d %d %d %d, graphs lookups %g hits %g, eager lookups %g hits %g, tau 1 lookups "
          "%g, compression %g", lg_ok, le_ok, l1_ok, lf_ok, Lg, Hg, Le, He, L1, cr);
    printf("ok cuda mac over lean K8V4 through the engine (demo model, compression %.2fx): graphs %g/%g hits/lookups, "
           "eager %g/%g; tokens agree graphs/eager %.0f%%, tau 1 vs lean full %.0f%% (printed, not checked)\n", cr, Hg,
           Lg, He, Le, 100 * agree(g0, e0), 100 * agree(g1, f1));
    kvs_model_free(model);
}

int main(void)
{
    char err[256];
    struct kvs_backend *gpu = kvs_cuda_backend.create(0, err, sizeof err);
    REQUIRE(gpu, "no CUDA backend: %s", err);
    struct kvs_backend *cpu = kvs_cpu_backend.create(4, err, sizeof err);
    REQUIRE(cpu, "%s", err);
    REQUIRE(kvs_mac_kernels_for(&kvs_cuda_backend, err, sizeof err), "%s", err);
    const int shapes[][3] = {{8, 2, 128}, {4, 1, 64}, {8, 8, 64}, {16, 2, 128}, {32, 8, 128},
                             {9, 3, 64}, {6, 2, 128}, {15, 3, 128}, {12, 1, 64}, {16, 1, 128}};
    double worst = 0;
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
        for (int rot = 0; rot < 2; rot++) run_shape(cpu, gpu, shapes[i][0], shapes[i][1], shapes[i][2], rot, &worst, 0);
    /* long contexts: the same checks where splits and many tiles matter */
    for (int rot = 0; rot < 2; rot++) run_shape(cpu, gpu, 8, 2, 128, rot, &worst, 1);
    run_shape(cpu, gpu, 8, 8, 64, 1, &worst, 1);
    for (int rot = 0; rot < 2; rot++) run_shape(cpu, gpu, 9, 3, 64, rot, &worst, 1);   /* SmolLM2's 9/3 */
    run_shape(cpu, gpu, 16, 1, 128, 1, &worst, 1);
    /* over LeanKV pages: every static mode, both layouts, and long contexts */
    const struct kvs_lean_fmt lf[] = {{8, 4}, {16, 16}, {8, 8}, {4, 4}};
    double worst_lean = 0;
    for (int i = 0; i < 4; i++)
        for (int rot = 0; rot < 2; rot++) {
            run_lean(cpu, gpu, 8, 2, 128, rot, lf[i], &worst_lean, 0);
            run_lean(cpu, gpu, 9, 3, 64, rot, lf[i], &worst_lean, 0);
        }
    run_lean(cpu, gpu, 4, 1, 64, 0, lf[0], &worst_lean, 0);
    run_lean(cpu, gpu, 16, 1, 128, 1, lf[0], &worst_lean, 0);
    for (int rot = 0; rot < 2; rot++) run_lean(cpu, gpu, 8, 2, 128, rot, lf[0], &worst_lean, 1);
    run_lean(cpu, gpu, 9, 3, 64, 1, lf[3], &worst_lean, 1);
    run_count(cpu, gpu, 32, 8, 128);
    run_count(cpu, gpu, 9, 3, 64);
    run_engine();
    kvs_cpu_backend.free(cpu);
    kvs_cuda_backend.free(gpu);
    return kvs_test_summary("test_cuda_kv_mac");
}
