/* test_cuda_attn_prefill.c: the prefill attention kernels of the CUDA backend (kind 0: the default
 * choice, kind 14 on sm_90; 1: k_attn_tc, mma.sync; 2 to 6: k_attn_wg, the Hopper wgmma kernel's
 * variants; 7 to 25: k_attn_fa3, the FlashAttention-3-style kernel with copy-engine staging,
 * producer / consumer warpgroups and mbarriers, 8 to 10 its diagnostic forms, 12, 19 and 21 with
 * persistent blocks, 13 to 21 with K and V staged by two producer warps, 16 and 18 with 192 rows a
 * block in three consumer warpgroups, 17 and 18 in FlashAttention-3's issue order, 20 and 21
 * skipping O's rescale where no max grew, 22 to 25 with every Q read in flight at once, 22, 23 and
 * 25 with the softmax in split chains ahead of the P . V wait, 23 with ping-pong (kind 15's turns)
 * on top, 25 with persistent blocks taking their items in snake order; it takes blocks of 16 and 32 slots and hands blocks of 5
 * and 8 to kind 6) against the fp32 CPU backend, on fresh random inputs each run (seed printed;
 * replay with KVS_SEED=<seed>).
 * Deferred rotation (rot cases: LazyAttention's cached documents, keys stored at document-local
 * positions and attended as if rotated by their block's offset): documents of 1 to 9 blocks with
 * random offsets (some 0), so that 128-key tiles hold up to 8 offsets, boundaries on every 16-key
 * group, and tiles of one document whose offset is not the previous tile's; kinds 0, 1 and
 * k_attn_fa3's rotating kinds (14, 19 to 25) are run (the other kinds' rotated launches take kind 1);
 * blocks of 8 slots take kind 1 from the plan.
 *
 * Cases: prompts of up to 2,000 tokens whose lengths are not multiples of any tile, prompts after
 * a cached prefix, several sequences in one launch (with a decode row beside them), GQA 1 / 2 / 4
 * / 7 (a group that leaves padding rows) / 16, head_dim 64 and 128, random block tables with
 * blocks of 5, 8, 16 and 32 slots, partially valid blocks (block_valid, as a cached document's
 * tail), the block table passed as separate arrays and as packed words, automatic and forced 3
 * context splits (the merge of partials). Slots no query may read hold NaN on the GPU. Scores
 * are made peaked (q x 3) so that a wrong mask or running max shows. Tolerance: relative L2 error
 * under 1e-2 (Q, K, V and P enter the products as bf16). On an sm_90 GPU the wgmma kinds must
 * actually be taken (kvs_cuda_pre_attn_kind). Needs a GPU: exits 1 with a message when none.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/util.h"
#include "kernels/backend.h"
#include "models/model.h"
#include "tests/unit/test_util.h"

#if defined(KVS_HAVE_CUDA) && KVS_HAVE_CUDA
#include "kernels/cuda/cuda_backend.h"

#include "tests/gpu/cuda_pair.h"

struct pcase {
    int n_heads, n_kv, hd, bs, n_seqs;
    int pos[4], ntok[4];
    int use_valid; /* some blocks before a sequence's last hold fewer valid slots */
    int rot;       /* documents: per-block rotation offsets (deferred RoPE) */
};

/* relative L2 error of the GPU output against the CPU one over rows [r0, r0 + nrows) */
static double rel_err(const float *a, const float *r, size_t off, size_t n, size_t *nonfinite)
{
    double num = 0, den = 0;
    for (size_t i = off; i < off + n; i++) {
        if (!isfinite(a[i])) {
            (*nonfinite)++;
            continue;
        }
        const double d = (double)a[i] - r[i];
        num += d * d;
        den += (double)r[i] * r[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

static void run_case(const struct pcase *pc)
{
    const int nh = pc->n_heads, nkv = pc->n_kv, hd = pc->hd, bs = pc->bs, S = pc->n_seqs;
    struct batch_layout L;
    batch_layout_make(S, bs, pc->pos, pc->ntok, &L); /* two spare blocks: they stay unused (NaN) */
    const int n = L.n, max_blocks = L.max_blocks, n_blocks = L.n_blocks, max_ctx = L.max_ctx;
    int32_t *q_start = L.q_start, *pos = L.pos, *perm = L.perm;
    const int mb = max_blocks;
    int32_t *bt = kvs_xcalloc((size_t)S * mb, 4), *valid = kvs_xcalloc((size_t)S * mb, 4);
    int32_t *rot = kvs_xcalloc((size_t)S * mb, 4);
    const size_t per_block = (size_t)nkv * bs * hd, cache_n = (size_t)n_blocks * per_block;
    float *kv = kvs_xmalloc(cache_n * 4), *vv = kvs_xmalloc(cache_n * 4);
    for (size_t i = 0; i < cache_n; i++) {
        kv[i] = kvs_bf16_round(frand());
        vv[i] = kvs_bf16_round(frand());
    }
    /* the GPU copies: every slot no query reads is NaN (a kernel that read one, or multiplied its V
     * by a zero probability, would give NaN) */
    float *kg = kvs_xmalloc(cache_n * 4), *vg = kvs_xmalloc(cache_n * 4);
    for (size_t i = 0; i < cache_n; i++) kg[i] = vg[i] = NAN;
    int used = 0;
    for (int s = 0; s < S; s++) {
        const int ctx = pc->pos[s] + pc->ntok[s], nb = (ctx + bs - 1) / bs;
        /* rot: documents of 1 to 9 blocks, each one offset (a quarter of them 0, the rest up to
         * +-100000: the angles wrap many times) */
        for (int j = 0, left = 0, o = 0; pc->rot && j < nb; j++, left--) {
            if (left == 0) {
                left = 1 + irand(9);
                o = irand(4) == 0 ? 0 : irand(200001) - 100000;
            }
            rot[s * mb + j] = o;
        }
        for (int j = 0; j < nb; j++) {
            /* keys keep their positions (block j holds j x bs ...); a short block's tail is skipped */
            const int blk = perm[used++];
            int v = bs;
            if (pc->use_valid && j % 3 == 1) v = 1 + irand(bs); /* a cached document's short tail */
            if (v > ctx - j * bs) v = ctx - j * bs;
            bt[s * mb + j] = blk;
            valid[s * mb + j] = pc->use_valid ? v : bs;
            for (int h = 0; h < nkv; h++) {
                const size_t off = ((size_t)blk * nkv + h) * bs * hd;
                memcpy(kg + off, kv + off, (size_t)v * hd * 4);
                memcpy(vg + off, vv + off, (size_t)v * hd * 4);
            }
        }
    }
    struct pair kc, vc;
    kv_pools_make(cache_n, kv, vv, &kc, &vc);
    G->upload(bg, kc.g, 0, kg, cache_n);
    G->upload(bg, vc.g, 0, vg, cache_n);

    const size_t qn = (size_t)n * nh * hd;
    float *qv = rand_queries(qn), *inv = rope_inv_freq(hd); /* inv: the rot cases' RoPE */
    int32_t *words = kvs_xmalloc((size_t)S * mb * 2 * 4);
    REQUIRE(kvs_pack_block_words(bt, pc->rot ? rot : NULL, valid, (size_t)S * mb, bs, words) == 0,
            ": pack block words");
    struct pair q = mk(KVS_BUF_ACT, qn, qv), out = mk(KVS_BUF_ACT, qn, NULL);
    struct pair qs = mk(KVS_BUF_I32, S + 1, q_start), ps = mk(KVS_BUF_I32, S, pos);
    struct pair bts = mk(KVS_BUF_I32, (size_t)S * mb, bt), vts = mk(KVS_BUF_I32, (size_t)S * mb, valid);
    struct pair wds = mk(KVS_BUF_I32, (size_t)S * mb * 2, words), fq = mk(KVS_BUF_F32, (size_t)hd / 2, inv);
    struct pair rts = mk(KVS_BUF_I32, (size_t)S * mb, rot);
    struct kvs_attn_meta mc = {.n_seqs = S, .max_blocks = mb, .q_start = qs.c, .pos = ps.c, .block_tables = bts.c,
                               .rot_offsets = pc->rot ? rts.c : NULL, .block_valid = pc->use_valid ? vts.c : NULL,
                               .inv_freq = fq.c, .h_q_start = q_start, .h_pos = pos, .max_ctx = max_ctx};
    const float scale = 1.0f / sqrtf((float)hd);
    C->attention(bc, q.c, kc.c, vc.c, &mc, n, nh, nkv, hd, bs, scale, out.c);
    float *ref = kvs_xmalloc(qn * 4), *got = kvs_xmalloc(qn * 4), *nanv = kvs_xmalloc(qn * 4);
    C->download(bc, ref, out.c, 0, qn);
    for (size_t i = 0; i < qn; i++) nanv[i] = NAN;

    static const int kinds[] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22,
                                23, 24, 25},
                     splits[] = {0, 3};
    for (int ki = 0; ki < (int)(sizeof kinds / sizeof kinds[0]); ki++)
        for (int si = 0; si < 2; si++)
            for (int packed = 0; packed < 2; packed++) {
                kvs_cuda_set_pre_attn(kinds[ki]);
                /* kind 0: the default choice; k_attn_fa3 (7 to 18) is sm_90 only: elsewhere a request
                 * takes kind 1, tested above */
                if (kinds[ki] >= 7 && kvs_cuda_pre_attn_kind(hd, 0) != kinds[ki]) continue;
                /* rot: the kinds without the rotation take kind 1, run above */
                if (pc->rot && kinds[ki] >= 2 && kvs_cuda_pre_attn_kind(hd, 1) != kinds[ki]) continue;
                kvs_cuda_set_attn_splits(bg, splits[si]);
                struct kvs_attn_meta mg = mc;
                mg.q_start = qs.g;
                mg.pos = ps.g;
                mg.block_tables = bts.g;
                mg.rot_offsets = pc->rot ? rts.g : NULL;
                mg.block_valid = pc->use_valid ? vts.g : NULL;
                mg.inv_freq = fq.g;
                mg.block_words = packed ? wds.g : NULL;
                G->upload(bg, out.g, 0, nanv, qn);
                G->attention(bg, q.g, kc.g, vc.g, &mg, n, nh, nkv, hd, bs, scale, out.g);
                G->download(bg, got, out.g, 0, qn);
                size_t nf = 0;
                const double e = rel_err(got, ref, 0, qn, &nf);
                double worst = 0;
                for (int s = 0; s < S; s++) {
                    size_t nf2 = 0;
                    const double es = rel_err(got, ref, (size_t)q_start[s] * nh * hd, (size_t)pc->ntok[s] * nh * hd, &nf2);
                    if (es > worst) worst = es;
                }
                const int taken = kvs_cuda_pre_attn_kind(hd, pc->rot);
                CHECK(nf == 0 && e < 1e-2 && worst < 1e-2,
                      ": heads %d/%d hd %d bs %d seqs %d rows %d ctx<=%d valid %d rot %d: kind %d splits %d packed %d: "
                      "rel_l2 %.3e (worst sequence %.3e), %zu non-finite",
                      nh, nkv, hd, bs, S, n, max_ctx, pc->use_valid, pc->rot, kinds[ki], splits[si], packed, e, worst,
                      nf);
                printf("%s heads %2d/%d hd %3d bs %2d seqs %d rows %4d ctx<=%4d valid %d rot %d | kind %d (took %d) "
                       "splits %s words %d | rel_l2 %.2e worst seq %.2e\n",
                       nf == 0 && e < 1e-2 && worst < 1e-2 ? "ok  " : "FAIL", nh, nkv, hd, bs, S, n, max_ctx,
                       pc->use_valid, pc->rot, kinds[ki], taken, splits[si] ? "3" : "auto", packed, e, worst);
            }
    kvs_cuda_set_pre_attn(-1);
    kvs_cuda_set_attn_splits(bg, 0);

    drop(&kc); drop(&vc); drop(&q); drop(&out); drop(&qs); drop(&ps); drop(&bts); drop(&vts); drop(&wds); drop(&fq);
    drop(&rts);
    free(perm); free(bt); free(valid); free(rot); free(kv); free(vv); free(kg); free(vg); free(qv); free(inv); free(words);
    free(ref); free(got); free(nanv);
}

int main(void)
{
    if (cuda_pair_open(4)) return 1;

    /* on Hopper the wgmma kinds are taken where they apply; rot offsets keep k_attn_tc except in
     * k_attn_fa3's rotating kinds */
    kvs_cuda_set_pre_attn(4);
    const int sm90 = kvs_cuda_pre_attn_kind(128, 0) == 4;
    printf("wgmma prefill kernel %s on this GPU\n", sm90 ? "available" : "NOT available (not sm_90): kind 1 only");
    CHECK(kvs_cuda_pre_attn_kind(128, 1) == 1, ": rot offsets take k_attn_tc with kind 4");
    CHECK(kvs_cuda_pre_attn_kind(256, 0) == 1, ": head_dim 256 takes k_attn_tc");
    kvs_cuda_set_pre_attn(14);
    CHECK(kvs_cuda_pre_attn_kind(128, 1) == (sm90 ? 14 : 1), ": rot offsets stay on kind 14 (sm_90)");
    CHECK(kvs_cuda_pre_attn_kind(256, 1) == 1, ": head_dim 256 with rot offsets takes k_attn_tc");

    kvs_cuda_set_pre_attn(-1);
    if (sm90 && !getenv("KVS_CUDA_PRE_ATTN"))
        CHECK(kvs_cuda_pre_attn_kind(128, 0) == 14, ": the default prefill kernel on sm_90 is k_attn_fa3's kind 14");

    /* lengths vary by a few tokens each run around the listed ones (tile edges move) */
    const int j1 = irand(9), j2 = irand(9);
    const struct pcase cases[] = {
        /* Llama-3.1-8B shape: one prompt from position 0, and a longer one */
        {32, 8, 128, 16, 1, {0}, {1000 + j1}, 0, 0},
        {32, 8, 128, 16, 1, {0}, {2000 - j2}, 0, 0},
        /* several sequences, blocks of 5 slots: a prompt, one after a cached prefix, a 2-token one,
         * and a decode row beside them */
        {32, 8, 128, 5, 4, {0, 700 + j2, 2, 500}, {300 + j1, 129, 2, 1}, 0, 0},
        /* partially valid blocks (cached documents' tails), blocks of 16 and 8 */
        {32, 8, 128, 16, 2, {0, 300}, {600 + j1, 77}, 1, 0},
        {16, 4, 64, 8, 2, {0, 41}, {257, 300 + j2}, 1, 0},
        /* GQA 1 and 2 at head_dim 64 (the long cached prefix with few tokens takes context splits) */
        {8, 8, 64, 16, 2, {0, 100}, {513 + j2, 64}, 0, 0},
        {8, 4, 64, 32, 1, {1500 + j1, 0}, {40, 0}, 0, 0},
        /* GQA 7 (padding rows in every tile) and GQA 16 */
        {28, 4, 128, 16, 2, {0, 37 + j1}, {200, 90}, 0, 0},
        {16, 1, 128, 32, 1, {0}, {257 + j2}, 0, 0},
        /* deferred rotation: a long prompt over documents; a prompt and a suffix after a cached
         * prefix with partially valid blocks of 32; GQA 2 at head_dim 64 with a short suffix over a
         * long context (context splits); GQA 7; blocks of 8 (kind 1 from the plan) */
        {32, 8, 128, 16, 1, {0}, {1500 + j1}, 0, 1},
        {32, 8, 128, 32, 2, {0, 700 + j2}, {600 + j1, 129}, 1, 1},
        {8, 4, 64, 16, 2, {1500 + j1, 0}, {40, 300 + j2}, 0, 1},
        {28, 4, 128, 16, 1, {37 + j2}, {200}, 0, 1},
        {16, 4, 64, 8, 2, {0, 41}, {257, 300 + j2}, 1, 1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) run_case(&cases[i]);
    G->free(bg);
    C->free(bc);
    return kvs_test_summary("test_cuda_attn_prefill");
}

#else
int main(void)
{
    fprintf(stderr, "test_cuda_attn_prefill: built without CUDA (nvcc not found)\n");
    return 1;
}
#endif
