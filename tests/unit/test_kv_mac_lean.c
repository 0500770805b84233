/* test_kv_mac_lean.c: MAC-Attention (kv.decode = mac) over LeanKV's static pages (kv.storage =
 * lean, kv.lean.mode K16V16 / K8V8 / K8V4 / K4V4: "with MAC, quantize only"), CPU backend.
 * Kernels (kernels/kv_mac.h with lean set; the scenario of kv_mac_case.h):
 *   1. neutral: K16V16 pages of an fp16-exact pool give MAC over the plain f32 pool bitwise
 *      (outputs, log-sum-exps, matches and the rings), through prefill appends, hits and misses;
 *   2. every static mode, hits included: MAC over the pages equals MAC over a plain pool holding
 *      the dequantized K/V, bitwise (the CPU kernel dequantizes with the host dequantizer, in fp32,
 *      so it reads the very operands the plain pool holds);
 *   3. a miss whose band covers the context equals LeanKV's own attention over the pages
 *      (kernels/cpu/kv_lean.c) bitwise, in the plain and the LazyAttention layouts.
 * Through the engine (tiny Llama test model):
 *   4. lean K8V4 (and K16V16) + mac at tau = 1 (never hits; band 256 above every context) gives
 *      lean + full's greedy tokens; at tau = 0 it hits and every request finishes; dynamic + mac
 *      is refused at startup with the reason (quantization only). */
#include "base/util.h"
#include "engine/config.h"
#include "engine/engine.h"
#include "engine/kv/kv.h"
#include "models/model.h"
#include "tests/unit/kv_engine_run.h"
#include "tests/unit/kv_mac_case.h"
#include "tests/unit/test_util.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

static const struct kvs_backend_ops *O = &kvs_cpu_backend;

/* x rounded to fp16 and back (the pool K16V16 stores exactly) */
static float f16(float x)
{
    uint8_t c[2];
    uint16_t sz[2];
    float y;
    kvs_lean_quantize(&x, 1, 16, c, sz);
    kvs_lean_dequantize(c, sz, 1, 16, &y);
    return y;
}

static int ring_same(struct mc *a, struct mc *b)
{
    const size_t ent = (size_t)a->S * a->K, e = ent * a->nh * a->hd;
    float *x = malloc(e * 4), *y = malloc(e * 4);
    int32_t *tx = malloc(ent * 4), *ty = malloc(ent * 4);
    a->o->download(a->be, x, a->ro, 0, e), b->o->download(b->be, y, b->ro, 0, e);
    a->o->download(a->be, tx, a->rt, 0, ent), b->o->download(b->be, ty, b->rt, 0, ent);
    int same = !memcmp(x, y, e * 4) && !memcmp(tx, ty, ent * 4);
    a->o->download(a->be, x, a->rl, 0, ent * a->nh), b->o->download(b->be, y, b->rl, 0, ent * a->nh);
    same &= !memcmp(x, y, ent * a->nh * 4);
    free(x), free(y), free(tx), free(ty);
    return same;
}

/* Two copies of one scenario, a over the LeanKV pages of f, b over the plain pool (K16V16: the
 * fp16-exact pool as it is; else its dequantized round trip): a 16-row prefill chunk appended
 * per sequence, then 30 decode steps (sequence 0 repeats a query: hits; 1 draws random ones:
 * misses; 2 alternates two; 3 repeats its last prefill query). Every step's outputs, lse and
 * matches, and at the end the rings, must be equal bitwise. */
static void run_pair(struct kvs_backend *be, struct kvs_lean_fmt f, int use_rot)
{
    struct mc a, b;
    const int S = 4, nh = 8, nkv = 2, hd = 64, K = 16, band = 24;
    mc_rng = 0x1ea7u + (uint64_t)(f.kbits * 17 + f.vbits + use_rot);
    mc_init(&a, O, be, S, nh, nkv, hd, 16, 40, K, band, use_rot);
    mc_rng = 0x1ea7u + (uint64_t)(f.kbits * 17 + f.vbits + use_rot);
    mc_init(&b, O, be, S, nh, nkv, hd, 16, 40, K, band, use_rot);
    const size_t pool = (size_t)a.n_blocks * nkv * a.bs * hd;
    if (f.kbits == 16 && f.vbits == 16) {   /* fp16-exact values: the neutral setting */
        for (size_t i = 0; i < pool; i++) a.h_k[i] = b.h_k[i] = f16(a.h_k[i]), a.h_v[i] = b.h_v[i] = f16(a.h_v[i]);
        O->upload(be, b.kc, 0, b.h_k, pool), O->upload(be, b.vc, 0, b.h_v, pool);
    } else {
        mc_lean_plain(&b, f);
    }
    REQUIRE(mc_lean(&a, f) == 0, "no LeanKV kernels on the cpu");
    a.thresh2 = b.thresh2 = 2.0f * hd * 0.55f * 0.55f;   /* tau = 0.45 */
    const size_t qd = (size_t)nh * hd;
    float *fixed = malloc(3 * qd * 4), *q = malloc(16 * S * qd * 4);
    for (size_t i = 0; i < 3 * qd; i++) fixed[i] = 3.0f * mc_frand();
    int pos[4] = {300, 420, 511, 377}, nr[4] = {16, 16, 16, 16}, fl[4];
    for (int s = 0; s < S; s++) fl[s] = KVS_MAC_F_APPEND;
    mc_scene_prefill(q, fixed, S, qd);
    mc_step(&a, pos, nr, fl, q, q);
    mc_step(&b, pos, nr, fl, q, q);
    int same = 1, hits = 0, misses = 0;
    for (int step = 0; step < 30; step++) {
        for (int s = 0; s < S; s++) pos[s]++, nr[s] = 1, fl[s] = KVS_MAC_F_MAC | KVS_MAC_F_MATCH | KVS_MAC_F_APPEND;
        mc_scene_step(q, fixed, S, qd, step);
        mc_step(&a, pos, nr, fl, q, q);
        mc_step(&b, pos, nr, fl, q, q);
        same &= !memcmp(a.o_out, b.o_out, S * qd * 4) && !memcmp(a.o_lse, b.o_lse, (size_t)S * nh * 4) &&
                !memcmp(a.o_p, b.o_p, (size_t)S * nh * 4);
        for (int i = 0; i < S * nh; i++) hits += a.o_p[i] >= 0, misses += a.o_p[i] < 0;
    }
    const int rings = ring_same(&a, &b);
    CHECK(same && rings && hits > 0 && misses > 0, "K%dV%d %s: steps equal %d, rings equal %d, %d hits, %d misses",
          f.kbits, f.vbits, use_rot ? "lazy" : "plain", same, rings, hits, misses);
    printf("ok mac over lean K%dV%d pages (%s layout) = mac over the %s pool, bitwise: 30 steps, %d hits / %d misses\n",
           f.kbits, f.vbits, use_rot ? "LazyAttention" : "plain", f.kbits == 16 && f.vbits == 16 ? "fp16-exact f32" :
           "dequantized", hits, misses);
    free(fixed), free(q);
    mc_free(&a), mc_free(&b);
}

/* A miss with the band past the context: rest is empty, out is B = attention over [0, m],
 * which must be LeanKV's own attention over the same pages, bitwise. */
static void run_vs_lean(struct kvs_backend *be, struct kvs_lean_fmt f, int use_rot)
{
    struct mc c;
    const int S = 3, nh = 6, nkv = 2, hd = 32;
    mc_init(&c, O, be, S, nh, nkv, hd, 16, 30, 16, 1000, use_rot);
    REQUIRE(mc_lean(&c, f) == 0, "no LeanKV kernels on the cpu");
    c.thresh2 = 1e30f;
    const size_t qd = (size_t)nh * hd;
    float q[3 * 6 * 32], want[3 * 6 * 32];
    for (size_t i = 0; i < sizeof q / 4; i++) q[i] = mc_frand();
    const int pos[3] = {470, 133, 301}, nr[3] = {1, 1, 1};
    const int fl[3] = {KVS_MAC_F_MAC | KVS_MAC_F_APPEND, KVS_MAC_F_MAC | KVS_MAC_F_APPEND,
                       KVS_MAC_F_MAC | KVS_MAC_F_APPEND};
    mc_step(&c, pos, nr, fl, q, q);
    int32_t hq[MC_MAXS + 1], hp[MC_MAXS];
    struct kvs_attn_meta m = mc_meta(&c, pos, nr, hq, hp);
    O->upload(be, c.q, 0, q, S * qd);
    const struct kvs_lean_kernels *kn = kvs_lean_kernels_for(O, NULL, 0);
    kn->attention(be, f, c.q, c.pages, &m, S, nh, nkv, hd, 16, 1.0f / sqrtf((float)hd), c.out);
    O->download(be, want, c.out, 0, S * qd);
    CHECK(!memcmp(want, c.o_out, S * qd * 4), "K%dV%d %s: a miss differs from LeanKV's attention", f.kbits, f.vbits,
          use_rot ? "lazy" : "plain");
    printf("ok mac miss over lean K%dV%d (%s layout) = LeanKV's own attention, bitwise\n", f.kbits, f.vbits,
           use_rot ? "LazyAttention" : "plain");
    mc_free(&c);
}

/* ---- through the engine ------------------------------------------------------------------- */

#define NJ 5
#define GEN 20

static struct kvs_model *model;

static void cfg_of(struct kvs_config *c, const char *mode, const char *decode, double tau)
{
    kvs_config_init(c);
    free(c->device), c->device = kvs_xstrdup("cpu");
    free(c->kv_storage), c->kv_storage = kvs_xstrdup("lean");
    free(c->lean_mode), c->lean_mode = kvs_xstrdup(mode);
    free(c->kv_decode), c->kv_decode = kvs_xstrdup(decode);
    free(c->kv_reuse), c->kv_reuse = kvs_xstrdup("none");   /* lean dynamic refuses shared blocks first */
    c->cpu_threads = 2;
    c->kv_block_size = 16;
    c->kv_memory_bytes = 4 << 20;
    c->max_batch_tokens = 128;
    c->max_running = 4;
    c->max_waiting = 64;
    c->max_model_len = 256;
    c->mac_tau = tau, c->mac_gen_min = 0, c->mac_ring_size = 32;   /* band: its default (256) */
}

static int run(const struct kvs_config *cfg, int32_t (*got)[GEN], struct kvs_engine_stats *st)
{
    static int32_t prompt[NJ][64];
    struct kvs_test_job tj[NJ];
    uint64_t rng = 77;
    for (int i = 0; i < NJ; i++) {
        const int n = 30 + (int)(kvs_test_xorshift(&rng) % 30);
        for (int t = 0; t < n; t++) prompt[i][t] = 1 + (int32_t)(kvs_test_xorshift(&rng) % 200);
        tj[i] = (struct kvs_test_job){prompt[i], n, NULL, 0, got[i], 0, KVS_FINISH_NONE};
    }
    char err[256];
    const int rc = kvs_test_engine_run(cfg, model, tj, NJ, GEN, st, err, sizeof err);
    CHECK(rc == 0, "engine (lean %s, %s): %s", cfg->lean_mode, cfg->kv_decode, err);
    int ok = rc == 0;
    for (int i = 0; i < NJ; i++) ok &= tj[i].n_got == GEN;
    return ok;
}

static void test_engine(void)
{
    static int32_t ref[NJ][GEN], got[NJ][GEN], ref8[NJ][GEN];
    struct kvs_engine_stats st;
    struct kvs_config c;
    const char *modes[] = {"K16V16", "K8V4"};   /* K16V16 is the same bytes as bf16: ratio 1 */
    for (int i = 0; i < 2; i++) {
        cfg_of(&c, modes[i], "full", 1.0);
        const int okr = run(&c, ref, &st);
        kvs_config_free(&c);
        cfg_of(&c, modes[i], "mac", 1.0);
        const int okm = run(&c, got, &st);
        kvs_config_free(&c);
        const double look = kvs_engine_kv_counter(&st, "kvserve:kv_mac_lookups_total");
        const double ratio = kvs_engine_kv_counter(&st, "kvserve:kv_storage_compression_ratio");
        CHECK(okr && okm && !memcmp(ref, got, sizeof ref) && look == 0 && ratio >= (i ? 2.0 : 1.0),
              "lean %s: mac tau 1 tokens equal %d, lookups %g, compression %g", modes[i], !memcmp(ref, got, sizeof ref),
              look, ratio);
        printf("ok lean %s + mac at tau = 1: greedy tokens equal lean %s + full (compression %.2fx)\n", modes[i],
               modes[i], ratio);
    }
    memcpy(ref8, ref, sizeof ref);   /* lean K8V4 + full */
    cfg_of(&c, "K8V4", "mac", 0.0);
    c.mac_band = 4;
    const int ok = run(&c, got, &st);
    kvs_config_free(&c);
    const double look = kvs_engine_kv_counter(&st, "kvserve:kv_mac_lookups_total");
    const double hits = kvs_engine_kv_counter(&st, "kvserve:kv_mac_hits_total");
    CHECK(ok && look > 0 && hits > 0, "lean K8V4 + mac tau 0: lookups %g hits %g", look, hits);
    int same = 0;
    for (int i = 0; i < NJ; i++)
        for (int t = 0; t < GEN; t++) same += got[i][t] == ref8[i][t];
    printf("ok lean K8V4 + mac at tau = 0, band 4: %g hits of %g lookups, every request finishes (tokens agree with "
           "lean K8V4 + full %.0f%%, printed: the random tiny model diverges at the first flip)\n", hits, look, 100.0 * same / (NJ * GEN));

    cfg_of(&c, "dynamic", "mac", 1.0);
    struct kvs_engine *e = NULL;
    char err[256] = "";
    const int rc = kvs_engine_create(&c, model, NULL, &e, err, sizeof err);
    CHECK(rc == -EINVAL && strstr(err, "dynamic") && strstr(err, "mac"), "lean dynamic + mac: rc %d (%s)", rc, err);
    printf("ok lean dynamic + mac refused at startup: %s\n", err);
    if (e) kvs_engine_free(e);
    kvs_config_free(&c);
}

int main(void)
{
    kvs_log_set_level(KVS_LOG_WARN);
    char err[256];
    struct kvs_backend *b = O->create(2, err, sizeof err);
    REQUIRE(b, "%s", err);
    const struct kvs_lean_fmt fmts[] = {{16, 16}, {8, 8}, {8, 4}, {4, 4}};
    for (int i = 0; i < 4; i++)
        for (int rot = 0; rot < 2; rot++) run_pair(b, fmts[i], rot);
    for (int rot = 0; rot < 2; rot++) run_vs_lean(b, fmts[2], rot);
    run_vs_lean(b, fmts[3], 1);
    O->free(b);
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/tests/data/models/llama", kvs_test_root());
    REQUIRE(kvs_model_load(dir, &model, err, sizeof err) == 0, "%s", err);
    test_engine();
    kvs_model_free(model);
    return kvs_test_summary("test_kv_mac_lean");
}
