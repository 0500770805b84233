/* test_lazy_attn.c: deferred RoPE in the CPU attention op (kernels/cpu) against eager RoPE.
 *
 * Documents of lengths {1, 15, 16, 17, 300} (shuffled, behind a random-length leading
 * document, so each lands at a random offset) are stored as the doc cache stores them: keys
 * rotated at LOCAL positions 0..len-1, each document starting on a block boundary, the unused
 * tail of its last block filled with NaN (must be masked, never read), physical blocks in
 * random order. The op gets per-block rotation offsets (the document's first slot) and valid
 * counts. The reference is computed here in double precision with every key rotated eagerly at
 * its absolute (padded) position and the pads dropped: plain dense causal attention.
 * Cases: prefill of a 7-token suffix and a single decode row, GQA group 1/2/4/7, plain theta
 * (500000) and llama3 scaling. Tolerance: fp32 rel-L2 <= 1e-5.
 * Every case also runs with eager keys: each key stored rotated at its absolute slot, no rotation
 * offsets (rot_offsets NULL), only the valid counts masking the padding slots (kernels that do
 * not implement deferred RoPE take these launches). */
#include "base/util.h"
#include "kernels/backend.h"
#include "models/model.h"
#include "tests/unit/test_util.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#define HD 64
#define BS 16
#define NKV 2

static uint64_t rng = 0x9E3779B97F4A7C15ULL;
static uint32_t rnd(void) { return kvs_test_xorshift(&rng); }
static float frand(void) { return (float)((rnd() % 2000001) / 1000000.0 - 1.0); }

/* RoPE with the backend contract's angle: one fp32 multiply (as transformers computes it),
 * then cos/sin of that angle (here in double) */
static void rope_ref(const float *x, int pos, const float *inv, double *out)
{
    for (int i = 0; i < HD / 2; i++) {
        float a = (float)pos * inv[i];
        double c = cos((double)a), s = sin((double)a);
        out[i] = x[i] * c - x[i + HD / 2] * s;
        out[i + HD / 2] = x[i + HD / 2] * c + x[i] * s;
    }
}

static int eager_keys; /* 1: keys stored at their absolute slots, no rotation offsets (valid masks only) */

static double run_case(const struct kvs_backend_ops *o, struct kvs_backend *be, const float *inv, int G, int n_q)
{
    int nh = NKV * G;
    int lens[6] = {1 + (int)(rnd() % 200), 1, 15, 16, 17, 300};
    for (int i = 5; i > 1; i--) {   /* shuffle the five documents behind the leading one */
        int j = 1 + (int)(rnd() % (unsigned)i);
        int t = lens[i];
        lens[i] = lens[j];
        lens[j] = t;
    }
    int nd = 6, start[6], slots = 0;
    for (int d = 0; d < nd; d++) {
        start[d] = slots;
        slots += (lens[d] + BS - 1) / BS * BS;
    }
    int ctx = slots + n_q;
    int nblk = (ctx + BS - 1) / BS;
    /* physical ids: a random permutation of 0..nblk-1 */
    int32_t *bt = malloc((size_t)nblk * sizeof *bt), *rot = calloc((size_t)nblk, sizeof *rot);
    int32_t *valid = malloc((size_t)nblk * sizeof *valid);
    for (int i = 0; i < nblk; i++) bt[i] = i, valid[i] = BS;
    for (int i = nblk - 1; i > 0; i--) {
        int j = (int)(rnd() % (unsigned)(i + 1));
        int32_t t = bt[i];
        bt[i] = bt[j];
        bt[j] = t;
    }
    for (int d = 0; d < nd; d++) {
        int nb = (lens[d] + BS - 1) / BS;
        for (int k = 0; k < nb && !eager_keys; k++) rot[start[d] / BS + k] = start[d];
        valid[start[d] / BS + nb - 1] = lens[d] - (nb - 1) * BS;
    }
    size_t per_block = (size_t)NKV * BS * HD;
    float *kc = malloc(nblk * per_block * sizeof(float)), *vc = malloc(nblk * per_block * sizeof(float));
    for (size_t i = 0; i < nblk * per_block; i++) kc[i] = vc[i] = NAN;   /* pads must never be read */
    /* raw keys/values per slot (NaN for pads), queries per row */
    float *kraw = malloc((size_t)ctx * NKV * HD * sizeof(float)), *vraw = malloc((size_t)ctx * NKV * HD * sizeof(float));
    int *isdoc = calloc((size_t)ctx, sizeof *isdoc), *local = calloc((size_t)ctx, sizeof *local);
    int *live = calloc((size_t)ctx, sizeof *live);
    for (int d = 0; d < nd; d++)
        for (int j = 0; j < lens[d]; j++) isdoc[start[d] + j] = 1, local[start[d] + j] = j, live[start[d] + j] = 1;
    for (int p = slots; p < ctx; p++) live[p] = 1;
    for (int p = 0; p < ctx; p++) {
        if (!live[p]) continue;
        for (int h = 0; h < NKV; h++) {
            float *kr = kraw + ((size_t)p * NKV + h) * HD, *vr = vraw + ((size_t)p * NKV + h) * HD;
            double kr_rot[HD];
            for (int i = 0; i < HD; i++) kr[i] = frand(), vr[i] = frand();
            /* stored as the runner stores it: documents at local positions, the rest at p */
            rope_ref(kr, isdoc[p] && !eager_keys ? local[p] : p, inv, kr_rot);
            size_t base = (((size_t)bt[p / BS] * NKV + h) * BS + p % BS) * HD;
            for (int i = 0; i < HD; i++) kc[base + i] = (float)kr_rot[i], vc[base + i] = vr[i];
        }
    }
    float *qraw = malloc((size_t)n_q * nh * HD * sizeof(float)), *q = malloc((size_t)n_q * nh * HD * sizeof(float));
    for (int t = 0; t < n_q; t++)
        for (int h = 0; h < nh; h++) {
            float *qr = qraw + ((size_t)t * nh + h) * HD;
            double qd[HD];
            for (int i = 0; i < HD; i++) qr[i] = 2.0f * frand();
            rope_ref(qr, slots + t, inv, qd);
            for (int i = 0; i < HD; i++) q[((size_t)t * nh + h) * HD + i] = (float)qd[i];
        }

    /* the op */
    int32_t qs[2] = {0, n_q}, pos0 = slots;
    struct kvs_dbuf *dq = o->alloc(be, KVS_BUF_ACT, (size_t)n_q * nh * HD), *dout = o->alloc(be, KVS_BUF_ACT, (size_t)n_q * nh * HD);
    struct kvs_dbuf *dk = o->alloc(be, KVS_BUF_KV, nblk * per_block), *dv = o->alloc(be, KVS_BUF_KV, nblk * per_block);
    struct kvs_dbuf *dqs = o->alloc(be, KVS_BUF_I32, 2), *dpos = o->alloc(be, KVS_BUF_I32, 1);
    struct kvs_dbuf *dbt = o->alloc(be, KVS_BUF_I32, (size_t)nblk), *drot = o->alloc(be, KVS_BUF_I32, (size_t)nblk);
    struct kvs_dbuf *dval = o->alloc(be, KVS_BUF_I32, (size_t)nblk), *dinv = o->alloc(be, KVS_BUF_F32, HD / 2);
    REQUIRE(dq && dout && dk && dv && dqs && dpos && dbt && drot && dval && dinv, "alloc");
    o->upload(be, dq, 0, q, (size_t)n_q * nh * HD);
    o->upload(be, dk, 0, kc, nblk * per_block);
    o->upload(be, dv, 0, vc, nblk * per_block);
    o->upload(be, dqs, 0, qs, 2);
    o->upload(be, dpos, 0, &pos0, 1);
    o->upload(be, dbt, 0, bt, (size_t)nblk);
    o->upload(be, drot, 0, rot, (size_t)nblk);
    o->upload(be, dval, 0, valid, (size_t)nblk);
    o->upload(be, dinv, 0, inv, HD / 2);
    /* every other case also passes the packed per-block words (kvs_pack_block_words): a backend
     * may read either form, and both must give the same attention */
    int32_t *words = malloc((size_t)nblk * 2 * sizeof(int32_t));
    struct kvs_dbuf *dwords = o->alloc(be, KVS_BUF_I32, (size_t)nblk * 2);
    REQUIRE(words && dwords && kvs_pack_block_words(bt, rot, valid, (size_t)nblk, BS, words) == 0, "pack words");
    o->upload(be, dwords, 0, words, (size_t)nblk * 2);
    static int use_words = 0;
    use_words ^= 1;
    struct kvs_attn_meta m = {.n_seqs = 1, .max_blocks = nblk, .q_start = dqs, .pos = dpos, .block_tables = dbt,
                              .rot_offsets = eager_keys ? NULL : drot, .block_valid = dval, .block_words = use_words ? dwords : NULL,
                              .inv_freq = dinv, .h_q_start = qs, .h_pos = &pos0, .max_ctx = ctx};
    float scale = 1.0f / sqrtf((float)HD);
    o->attention(be, dq, dk, dv, &m, n_q, nh, NKV, HD, BS, scale, dout);
    float *out = malloc((size_t)n_q * nh * HD * sizeof(float));
    o->download(be, out, dout, 0, (size_t)n_q * nh * HD);
    o->free_buf(be, dwords);
    free(words);

    /* eager reference: every key rotated at its absolute slot, pads dropped */
    double num = 0, den = 0;
    double *sc = malloc((size_t)ctx * sizeof *sc);
    for (int t = 0; t < n_q; t++)
        for (int h = 0; h < nh; h++) {
            int g = h / G;
            double qd[HD];
            rope_ref(qraw + ((size_t)t * nh + h) * HD, slots + t, inv, qd);
            double mx = -INFINITY;
            for (int p = 0; p <= slots + t; p++) {
                sc[p] = -INFINITY;
                if (!live[p]) continue;
                double kd[HD], s = 0;
                rope_ref(kraw + ((size_t)p * NKV + g) * HD, p, inv, kd);
                for (int i = 0; i < HD; i++) s += qd[i] * kd[i];
                sc[p] = s * (double)scale;
                if (sc[p] > mx) mx = sc[p];
            }
            double l = 0, acc[HD] = {0};
            for (int p = 0; p <= slots + t; p++) {
                if (!live[p]) continue;
                double w = exp(sc[p] - mx);
                l += w;
                for (int i = 0; i < HD; i++) acc[i] += w * vraw[((size_t)p * NKV + g) * HD + i];
            }
            for (int i = 0; i < HD; i++) {
                double ref = acc[i] / l, got = out[((size_t)t * nh + h) * HD + i];
                REQUIRE(isfinite(got), "non-finite output: a padding slot was read");
                num += (got - ref) * (got - ref);
                den += ref * ref;
            }
        }
    struct kvs_dbuf *bufs[] = {dq, dout, dk, dv, dqs, dpos, dbt, drot, dval, dinv};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) o->free_buf(be, bufs[i]);
    free(bt), free(rot), free(valid), free(kc), free(vc), free(kraw), free(vraw), free(isdoc), free(local), free(live);
    free(qraw), free(q), free(out), free(sc);
    return sqrt(num / den);
}

/* Every case of this test on one backend: deferred and eager keys, plain and llama3 RoPE, GQA
 * 1/2/4/7, a 7-row prefill and a decode row, 3 random layouts each; each rel-L2 must be <= tol.
 * Returns the worst. Shared with tests/gpu/test_cuda_lazy.c, which runs it on the CUDA backend
 * with the bf16 tolerance. */
static double run_all_cases(const struct kvs_backend_ops *o, struct kvs_backend *be, double tol)
{
    struct kvs_model_config mc;
    memset(&mc, 0, sizeof mc);
    mc.head_dim = HD;
    double worst = 0;
    for (int mode = 0; mode < 4; mode++) {
        const int rope = mode & 1;
        eager_keys = mode >> 1;
        mc.rope_theta = 500000.0;
        mc.rope_type = rope ? KVS_ROPE_LLAMA3 : KVS_ROPE_DEFAULT;
        mc.rope_factor = 8;
        mc.rope_low_freq_factor = 1;
        mc.rope_high_freq_factor = 4;
        mc.rope_original_max_pos = 64;   /* all three llama3 bands occur at these positions */
        float inv[HD / 2];
        kvs_rope_inv_freq(&mc, inv);
        static const int groups[] = {1, 2, 4, 7};
        for (int gi = 0; gi < 4; gi++)
            for (int nq = 1, G = groups[gi]; nq <= 7; nq += 6)
                for (int trial = 0; trial < 3; trial++) {
                    double e = run_case(o, be, inv, G, nq);
                    REQUIRE(e <= tol, "rope %s G=%d rows=%d%s: rel-L2 %.3g > %g", rope ? "llama3" : "plain", G, nq,
                            eager_keys ? " (eager keys, valid masks only)" : "", e, tol);
                    if (e > worst) worst = e;
                }
    }
    eager_keys = 0;
    return worst;
}

#ifndef LAZY_ATTN_NO_MAIN   /* tests/gpu/test_cuda_lazy.c reuses run_all_cases on the CUDA backend */
int main(void)
{
    const struct kvs_backend_ops *o = &kvs_cpu_backend;
    char err[256];
    struct kvs_backend *be = o->create(2, err, sizeof err);
    REQUIRE(be, "%s", err);
    double worst = run_all_cases(o, be, 1e-5);
    o->free(be);
    printf("deferred RoPE (per-block q back-rotation, masked pads) and eager keys with masked pads == eager RoPE "
           "attention: docs {1,15,16,17,300} at random offsets, GQA 1/2/4/7, plain + llama3, prefill 7 rows + decode; "
           "worst rel-L2 %.2e: ok\n", worst);
    return 0;
}
#endif
