/* test_cuda_attn_cudnn.c: prefill-attention kind 26, cuDNN's fused SDPA over the paged KV
 * (kernels/cuda/cuda_attn_cudnn.cu), against the fp32 CPU backend on fresh random inputs each run
 * (seed printed; replay with KVS_SEED=<seed>).
 *
 * Cases: prompts of 2 to 8,192 tokens, most not multiples of 64 or 128 (lengths move by a few
 * tokens each run); chunks over earlier pages (a prompt's tail after a cached prefix, chunked
 * prefill); several sequences in one launch with 1- and 2-token rows beside them (the one-row
 * sequences are the decode pass's: kind 26 must leave them to it); GQA groups 1, 2, 4, 7 and 8;
 * head_dim 64 and 128; blocks of 16 and 32 slots in a random order (and 5 / 8, which cuDNN may
 * or may not take: taken or not, the result must be right). Scores are peaked (q x 3) so a wrong
 * mask shows. Tolerance: relative L2 error under 1e-2, per sequence too (Q, K, V, P and O are
 * bf16 in cuDNN).
 * Slots of the pool no query may read hold large finite values (stale KV in the engine's pool):
 * cuDNN loads whole pages and masks the scores, so these must not leak. A second run of each case
 * with NaN there says whether cuDNN multiplies unread slots by a zero probability (printed, not a
 * criterion: the engine's pool holds finite values; kind 14 never reads them).
 * Kind 26 must actually be taken (kvs_cuda_cudnn_prefill_launches counts it) for blocks of 16 and
 * 32 slots without rotation offsets or block_valid; launches with rotation offsets or block_valid
 * must fall back to kind 14 (not counted) and still be right.
 * Exits 77 (skip) when cuDNN is not built in (make CUDNN=...) or libcudnn.so.9 (9.6+) cannot be
 * opened; 1 with a message when there is no GPU.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/util.h"
#include "kernels/backend.h"
#include "models/model.h"
#include "tests/unit/test_util.h"

#if defined(KVS_HAVE_CUDA) && KVS_HAVE_CUDA
#include "kernels/cuda/cuda_backend.h"

#include "tests/gpu/cuda_pair.h"

struct ccase {
    int n_heads, n_kv, hd, bs, n_seqs;
    int pos[4], ntok[4];
    int use_valid, rot; /* these launches must take kind 14 */
    int must_take;      /* kind 26 must compute it (blocks of 16 / 32, no rot / valid) */
};

static void run_case(const struct ccase *pc)
{
    const int nh = pc->n_heads, nkv = pc->n_kv, hd = pc->hd, bs = pc->bs, S = pc->n_seqs;
    struct batch_layout L;
    batch_layout_make(S, bs, pc->pos, pc->ntok, &L);
    const int n = L.n, mb = L.max_blocks, n_blocks = L.n_blocks;
    int32_t *q_start = L.q_start, *pos = L.pos, *perm = L.perm;
    int32_t *bt = kvs_xcalloc((size_t)S * mb, 4), *valid = kvs_xcalloc((size_t)S * mb, 4);
    int32_t *rot = kvs_xcalloc((size_t)S * mb, 4);
    const size_t per_block = (size_t)nkv * bs * hd, cache_n = (size_t)n_blocks * per_block;
    float *kv = kvs_xmalloc(cache_n * 4), *vv = kvs_xmalloc(cache_n * 4);
    for (size_t i = 0; i < cache_n; i++) {
        kv[i] = kvs_bf16_round(frand());
        vv[i] = kvs_bf16_round(frand());
    }
    /* the GPU pools: readable slots as the CPU's, the rest (the last page's tail, spare blocks)
     * finite garbage (or NaN, second run) */
    float *kg = kvs_xmalloc(cache_n * 4), *vg = kvs_xmalloc(cache_n * 4), *kn = kvs_xmalloc(cache_n * 4),
          *vn = kvs_xmalloc(cache_n * 4);
    for (size_t i = 0; i < cache_n; i++) {
        kg[i] = kvs_bf16_round(300.0f * frand());
        vg[i] = kvs_bf16_round(3000.0f * frand());
        kn[i] = vn[i] = NAN;
    }
    int used = 0;
    for (int s = 0; s < S; s++) {
        const int ctx = pc->pos[s] + pc->ntok[s], nb = (ctx + bs - 1) / bs;
        for (int j = 0; j < nb; j++) {
            const int blk = perm[used++];
            int v = bs;
            if (pc->use_valid && j % 3 == 1) v = 1 + irand(bs);
            if (v > ctx - j * bs) v = ctx - j * bs;
            bt[s * mb + j] = blk;
            valid[s * mb + j] = v;
            if (pc->rot) rot[s * mb + j] = irand(3) == 0 ? 0 : irand(20001) - 10000;
            for (int h = 0; h < nkv; h++) {
                const size_t off = ((size_t)blk * nkv + h) * bs * hd;
                memcpy(kg + off, kv + off, (size_t)v * hd * 4);
                memcpy(vg + off, vv + off, (size_t)v * hd * 4);
                memcpy(kn + off, kv + off, (size_t)v * hd * 4);
                memcpy(vn + off, vv + off, (size_t)v * hd * 4);
            }
        }
    }
    struct pair kc, vc;
    kv_pools_make(cache_n, kv, vv, &kc, &vc);

    const size_t qn = (size_t)n * nh * hd;
    float *qv = rand_queries(qn), *inv = rope_inv_freq(hd);
    struct pair q = mk(KVS_BUF_ACT, qn, qv), out = mk(KVS_BUF_ACT, qn, NULL);
    struct pair qs = mk(KVS_BUF_I32, S + 1, q_start), ps = mk(KVS_BUF_I32, S, pos);
    struct pair bts = mk(KVS_BUF_I32, (size_t)S * mb, bt), vts = mk(KVS_BUF_I32, (size_t)S * mb, valid);
    struct pair rts = mk(KVS_BUF_I32, (size_t)S * mb, rot), fq = mk(KVS_BUF_F32, (size_t)hd / 2, inv);
    struct kvs_attn_meta mc = {.n_seqs = S, .max_blocks = mb, .q_start = qs.c, .pos = ps.c, .block_tables = bts.c,
                               .rot_offsets = pc->rot ? rts.c : NULL, .block_valid = pc->use_valid ? vts.c : NULL,
                               .inv_freq = fq.c, .h_q_start = q_start, .h_pos = pos, .max_ctx = L.max_ctx};
    const float scale = 1.0f / sqrtf((float)hd);
    C->attention(bc, q.c, kc.c, vc.c, &mc, n, nh, nkv, hd, bs, scale, out.c);
    float *ref = kvs_xmalloc(qn * 4), *got = kvs_xmalloc(qn * 4), *nanv = kvs_xmalloc(qn * 4);
    C->download(bc, ref, out.c, 0, qn);
    for (size_t i = 0; i < qn; i++) nanv[i] = NAN;

    struct kvs_attn_meta mg = mc;
    mg.q_start = qs.g;
    mg.pos = ps.g;
    mg.block_tables = bts.g;
    mg.rot_offsets = pc->rot ? rts.g : NULL;
    mg.block_valid = pc->use_valid ? vts.g : NULL;
    mg.inv_freq = fq.g;
    kvs_cuda_set_pre_attn(26);
    for (int poison = 0; poison < 2; poison++) {
        G->upload(bg, kc.g, 0, poison ? kn : kg, cache_n);
        G->upload(bg, vc.g, 0, poison ? vn : vg, cache_n);
        G->upload(bg, out.g, 0, nanv, qn);
        const long long before = kvs_cuda_cudnn_prefill_launches();
        G->attention(bg, q.g, kc.g, vc.g, &mg, n, nh, nkv, hd, bs, scale, out.g);
        G->download(bg, got, out.g, 0, qn);
        const int taken = kvs_cuda_cudnn_prefill_launches() > before;
        double worst = 0;
        for (int s = 0; s < S; s++) {
            const double es = rel_l2(got + (size_t)q_start[s] * nh * hd, ref + (size_t)q_start[s] * nh * hd,
                                     (size_t)pc->ntok[s] * nh * hd);
            if (es > worst) worst = es;
        }
        const double e = rel_l2(got, ref, qn);
        const int ok = e < 1e-2 && worst < 1e-2;
        if (poison == 0) {
            CHECK(ok, ": heads %d/%d hd %d bs %d seqs %d rows %d ctx<=%d valid %d rot %d: rel_l2 %.3e (worst sequence %.3e)",
                  nh, nkv, hd, bs, S, n, L.max_ctx, pc->use_valid, pc->rot, e, worst);
            if (pc->must_take) CHECK(taken, ": heads %d/%d hd %d bs %d: kind 26 was not taken", nh, nkv, hd, bs);
            if (pc->rot || pc->use_valid) CHECK(!taken, ": kind 26 took a launch with rotation offsets or block_valid");
        }
        printf("%s heads %2d/%d hd %3d bs %2d seqs %d rows %5d ctx<=%5d valid %d rot %d | %s | %s | rel_l2 %.2e worst seq %.2e\n",
               poison ? "info" : ok && (taken || !pc->must_take) ? "ok  " : "FAIL", nh, nkv, hd, bs, S, n, L.max_ctx,
               pc->use_valid, pc->rot, taken ? "cuDNN" : "kind 14", poison ? "NaN in unread slots" : "finite unread slots", e,
               worst);
    }
    kvs_cuda_set_pre_attn(-1);

    drop(&kc); drop(&vc); drop(&q); drop(&out); drop(&qs); drop(&ps); drop(&bts); drop(&vts); drop(&rts); drop(&fq);
    free(perm); free(bt); free(valid); free(rot); free(kv); free(vv); free(kg); free(vg); free(kn); free(vn); free(qv);
    free(inv); free(ref); free(got); free(nanv);
}

int main(void)
{
    if (cuda_pair_open(16)) return 1;
    if (!kvs_cuda_cudnn_prefill_available()) {
        printf("test_cuda_attn_cudnn: SKIP: cuDNN not built in (make CUDNN=...) or libcudnn.so.9 (9.6+) not loadable\n");
        G->free(bg);
        C->free(bc);
        return 77;
    }
    kvs_cuda_set_pre_attn(26);
    const int sm90 = kvs_cuda_pre_attn_kind(128, 0) == 26;
    CHECK(kvs_cuda_pre_attn_kind(128, 1) != 26, ": rotation offsets must not take kind 26");
    CHECK(kvs_cuda_pre_attn_kind(256, 0) != 26, ": head_dim 256 must not take kind 26");
    kvs_cuda_set_pre_attn(-1);
    if (!sm90) {
        printf("test_cuda_attn_cudnn: SKIP: kind 26 runs on sm_90 only\n");
        G->free(bg);
        C->free(bc);
        return 77;
    }
    const int j1 = irand(9), j2 = irand(9), j3 = irand(9);
    const struct ccase cases[] = {
        /* Llama-3.1-8B shape, one prompt from position 0 (1K, not a multiple of 64) */
        {32, 8, 128, 16, 1, {0}, {1000 + j1}, 0, 0, 1},
        /* 8K prompts: exactly 8,192, and one not a multiple of 128 (GQA 8, fewer heads: the CPU
         * reference's time) */
        {8, 1, 128, 16, 1, {0}, {8192}, 0, 0, 1},
        {8, 2, 128, 32, 1, {0}, {4099 + j2}, 0, 0, 1},
        /* chunks over earlier pages: a 517-token chunk after 3,000 cached tokens, a 64-token one */
        {32, 8, 128, 16, 1, {3000 + j3}, {517}, 0, 0, 1},
        {16, 4, 128, 16, 2, {2048, 100 + j1}, {64, 2}, 0, 0, 1},
        /* several sequences in one launch, a 2-token prompt and a decode row beside them */
        {32, 8, 128, 16, 4, {0, 700 + j2, 2, 500}, {300 + j1, 129, 2, 1}, 0, 0, 1},
        {28, 4, 128, 16, 3, {0, 37 + j1, 9}, {200, 90, 1}, 0, 0, 1},
        /* head_dim 64: GQA 4, GQA 1 with a long and a short prompt */
        {16, 4, 64, 16, 2, {0, 41}, {257, 300 + j2}, 0, 0, 1},
        {8, 8, 64, 32, 2, {0, 100}, {513 + j2, 64}, 0, 0, 1},
        /* blocks of 5 and 8 slots: cuDNN's to take or give back */
        {32, 8, 128, 5, 2, {0, 333}, {130 + j3, 77}, 0, 0, 0},
        {16, 2, 64, 8, 1, {0}, {700 + j1}, 0, 0, 0},
        /* must stay on kind 14: block_valid (a cached document's tail), rotation offsets */
        {32, 8, 128, 16, 2, {0, 300}, {600 + j1, 77}, 1, 0, 0},
        {32, 8, 128, 16, 1, {0}, {500 + j2}, 0, 1, 0},
    };
    const long long l0 = kvs_cuda_cudnn_prefill_launches();
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) run_case(&cases[i]);
    printf("kind 26 took %lld launches\n", kvs_cuda_cudnn_prefill_launches() - l0);
    G->free(bg);
    C->free(bc);
    return kvs_test_summary("test_cuda_attn_cudnn");
}

#else
int main(void)
{
    fprintf(stderr, "test_cuda_attn_cudnn: built without CUDA (nvcc not found)\n");
    return 1;
}
#endif
