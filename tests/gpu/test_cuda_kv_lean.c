/* test_cuda_kv_lean.c: the CUDA backend's LeanKV kernels (kernels/cuda/kv_lean.cu) against the CPU
 * reference (kernels/cpu/kv_lean.c), on fresh random inputs each run (seed from the clock,
 * printed; replay with KVS_SEED=<seed>).
 *   - write: the pages the CUDA kernel writes are byte for byte the CPU kernel's (same codes,
 *     same fp16 scale / zero), for K8V4, K4V2, K8V8, K4V4, K2V2, K16V16 (a mismatch prints its
 *     first byte: page, token, side);
 *   - attention and attention_spans over the same pages (the flash-decoding kernel: tensor cores
 *     with fp16 q / x^ / p, fp32 sums; each case in three layouts, kvs_cuda_set_lean_layout: query
 *     rows on the mma's M side, keys on M with 8-row tiles, and keys on M by the multi-warp decode
 *     kernel of kv_lean_decode.cu, its compute warps / ring stages / splits varied case by case,
 *     kvs_cuda_set_lean_dec): relative L2 error < 1e-2 against the CPU (lse within
 *     1e-2, -inf where the CPU has it), with GQA groups 1 / 4 / 8 / 16, head_dim 64 / 128, block
 *     sizes 8, 16 and 32, odd groups and KV head counts, decode rows mixed with a prefill chunk
 *     (tiles of 16 / G tokens), 1,500- and 5,000-token sequences (context splits and their
 *     merge), deferred-RoPE offsets or none, partial valid counts, spans (some empty);
 *   - K16V16 equals dense attention (issue 20's exactness test, CUDA bf16 tolerance): the
 *     LeanKV pages at 16 bits against the backend's attention() over bf16 K/V and the CPU's over
 *     fp32 K/V, rel-L2 < 1e-2 (a first 2026-11-24 run failed them on the pages' low bytes; they
 *     pass since kv_lean.cu's 16-bit store);
 *   - the merge of the splits' partials: the serial form gives the same bits as the staged default
 *     (attention and spans, lse included), the early start behind the multi-warp kernel every
 *     other case;
 *   - mixed steps at the automatic layout (decode rows and prompt chunks in a random order, the
 *     decode rows on their own launch: run_mixed below), K8V8 / K8V4 / K4V4 / K4V2 and more;
 *   - copy_block copies a block's pages.
 * Needs a GPU: exits 1 with a message when none. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kv_lean.h"
#include "tests/unit/test_util.h"

#if defined(KVS_HAVE_CUDA) && KVS_HAVE_CUDA
#include "tests/gpu/cuda_pair.h"
#include "kernels/cuda/kv_lean_cuda.h"

struct cfg {
    struct kvs_lean_fmt f;
    int nkv, grp, hd, bs;
    int norot; /* 1: no rotation offsets (the engine's pages without cached documents) */
};

/* layout 3's configurations of the multi-warp decode kernel, one a case in turn: compute warps,
 * stages, splits (0: its own choice), combine (the warps' states folded in the block: 1, or -1 the
 * default; 0 a partial a warp); forced splits of 1-3 walk each block's ring round many times over
 * the 5,000-token sequence, stages of 2 per compute warp wrap every other tile */
static const int dec_cfgs[][4] = {{0, 0, 0, -1}, {1, 2, 1, 1}, {2, 4, 2, 0}, {3, 6, 1, 1}, {5, 10, 3, 1}, {4, 8, 0, 0},
                                  {1, 3, 0, 0},  {5, 0, 1, 0}, {3, 0, 0, 1},  {4, 8, 2, 1}, {2, 0, 0, 0}};
static int dec_case;

static void run_case(const struct cfg *c, int layout)
{
    kvs_cuda_set_lean_layout(layout);
    const int *dc = dec_cfgs[dec_case % (int)(sizeof dec_cfgs / sizeof dec_cfgs[0])];
    /* the staged merge of the splits (the default), its early start behind k_lean_dec every other
     * case of layout 3 */
    const int early = layout == 3 && dec_case % 2;
    kvs_cuda_set_lean_merge(1, early);
    if (layout == 3) {
        kvs_cuda_set_lean_dec(dc[0], dc[1], dc[2], dc[3]);
        dec_case++;
    }
    const struct kvs_lean_kernels *kc = kvs_lean_kernels_for(C, NULL, 0), *kg = kvs_lean_kernels_for(G, NULL, 0);
    const int nkv = c->nkv, nh = nkv * c->grp, hd = c->hd, bs = c->bs;
    /* sequences: a prefill chunk of 7 rows at 37, decode rows at 100, 5, 250, 1500 and 5000 (splits) */
    enum { NS = 6 };
    const int pos[NS] = {37, 100, 5, 250, 1500, 5000}, rows[NS] = {7, 1, 1, 1, 1, 1};
    int max_blocks = 0, n_rows = 0, n_tok = 0;
    for (int s = 0; s < NS; s++) {
        const int nb = (pos[s] + rows[s] + bs - 1) / bs;
        if (nb > max_blocks) max_blocks = nb;
        n_rows += rows[s], n_tok += pos[s] + rows[s];
    }
    const int nblocks = NS * max_blocks + 2;   /* the last one stays free: copy target */
    int32_t q_start[NS + 1], *bt = kvs_xcalloc((size_t)NS * max_blocks, 4), *rot = kvs_xcalloc((size_t)NS * max_blocks, 4);
    int32_t *valid = kvs_xcalloc((size_t)NS * max_blocks, 4), *slots = kvs_xmalloc((size_t)n_tok * 4);
    int32_t *perm = kvs_xmalloc((size_t)(nblocks - 1) * 4);
    for (int i = 0; i < nblocks - 1; i++) perm[i] = i;
    for (int i = nblocks - 2; i > 0; i--) {
        int j = irand(i + 1), t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }
    int used = 0, r0 = 0, t0 = 0;
    for (int s = 0; s < NS; s++) {
        q_start[s] = r0;
        r0 += rows[s];
        for (int j = 0; j < max_blocks; j++) {
            bt[s * max_blocks + j] = perm[used++];
            rot[s * max_blocks + j] = irand(3) == 0 ? irand(400) - 100 : 0;
            valid[s * max_blocks + j] = irand(4) == 0 ? 1 + irand(bs) : bs;
        }
        for (int p = 0; p < pos[s] + rows[s]; p++) slots[t0++] = bt[s * max_blocks + p / bs] * bs + p % bs;
        /* the rows being computed land in valid slots */
        const int last = pos[s] + rows[s] - 1;
        if (valid[s * max_blocks + last / bs] <= last % bs) valid[s * max_blocks + last / bs] = bs;
    }
    q_start[NS] = r0;
    const size_t kvn = (size_t)n_tok * nkv * hd, qn = (size_t)n_rows * nh * hd;
    float *hk = kvs_xmalloc(kvn * 4), *hv = kvs_xmalloc(kvn * 4), *hq = kvs_xmalloc(qn * 4);
    for (size_t i = 0; i < kvn; i++) hk[i] = 2.0f * frand() + 0.5f, hv[i] = frand();
    for (size_t i = 0; i < qn; i++) hq[i] = 2.0f * frand();
    float inv[256];
    for (int i = 0; i < hd / 2; i++) inv[i] = powf(10000.0f, -2.0f * i / hd);

    const size_t page = kvs_lean_page_bytes(c->f, hd, bs), blockb = page * nkv, pool_words = (blockb * nblocks + 3) / 4;
    struct pair pool = {.c = kc->alloc_pages(bc, blockb * nblocks), .g = kg->alloc_pages(bg, blockb * nblocks)};
    int32_t *zero = kvs_xcalloc(pool_words, 4);
    C->upload(bc, pool.c, 0, zero, pool_words);
    G->upload(bg, pool.g, 0, zero, pool_words);
    struct pair dk = mk(KVS_BUF_ACT, kvn, hk), dv = mk(KVS_BUF_ACT, kvn, hv), ds = mk(KVS_BUF_I32, (size_t)n_tok, slots);
    kc->write(bc, c->f, dk.c, dv.c, ds.c, n_tok, nkv, hd, bs, pool.c);
    kg->write(bg, c->f, dk.g, dv.g, ds.g, n_tok, nkv, hd, bs, pool.g);
    /* copy-on-write: sequence 1's first block to the spare one */
    const int spare = nblocks - 1;
    kc->copy_block(bc, pool.c, bt[max_blocks], spare, blockb);
    kg->copy_block(bg, pool.g, bt[max_blocks], spare, blockb);
    int32_t *pc = kvs_xmalloc(pool_words * 4), *pg = kvs_xmalloc(pool_words * 4);
    C->download(bc, pc, pool.c, 0, pool_words);
    G->download(bg, pg, pool.g, 0, pool_words);
    if (memcmp(pc, pg, blockb * nblocks) != 0) {
        size_t i = 0;
        while (((uint8_t *)pc)[i] == ((uint8_t *)pg)[i]) i++;
        const size_t in_page = i % page, kc_b = (size_t)hd * c->f.kbits / 8, vc_b = (size_t)hd * c->f.vbits / 8;
        const char *side = in_page < bs * kc_b ? "K codes" : in_page < bs * (kc_b + vc_b) ? "V codes" : "(s, z)";
        CHECK(0, "K%dV%d hd %d: CUDA pages differ from the CPU's: first at byte %zu (block %zu, head %zu, %s, byte %zu "
                 "of the page): cpu 0x%02x cuda 0x%02x", c->f.kbits, c->f.vbits, hd, i, i / blockb, (i % blockb) / page,
              side, in_page, ((uint8_t *)pc)[i], ((uint8_t *)pg)[i]);
        /* the page's first slot: which token was written there, its first K values, both pages' first bytes */
        const size_t blk = i / blockb, hh = (i % blockb) / page;
        int tok = -1;
        for (int t = 0; t < n_tok; t++)
            if ((size_t)slots[t] == blk * bs) tok = t;
        printf("  diag: block %zu head %zu slot 0 <- token %d; K[0..3] =", blk, hh, tok);
        for (int d = 0; d < 4 && tok >= 0; d++) printf(" %g", hk[((size_t)tok * nkv + hh) * hd + d]);
        printf("\n  diag: cpu bytes");
        for (int d = 0; d < 16; d++) printf(" %02x", ((uint8_t *)pc)[blk * blockb + hh * page + d]);
        printf("\n  diag: gpu bytes");
        for (int d = 0; d < 16; d++) printf(" %02x", ((uint8_t *)pg)[blk * blockb + hh * page + d]);
        size_t nd = 0;
        for (size_t b2 = 0; b2 < blockb * nblocks; b2++) nd += ((uint8_t *)pc)[b2] != ((uint8_t *)pg)[b2];
        printf("\n  diag: %zu of %zu bytes differ\n", nd, blockb * nblocks);
    }
    CHECK(memcmp((uint8_t *)pg + (size_t)spare * blockb, (uint8_t *)pg + (size_t)bt[max_blocks] * blockb, blockb) == 0,
          "copy_block");
    const int spare_src = bt[max_blocks];
    bt[max_blocks] = spare;

    struct pair dq = mk(KVS_BUF_ACT, qn, hq), dqs = mk(KVS_BUF_I32, NS + 1, q_start), dpos = mk(KVS_BUF_I32, NS, pos);
    struct pair dbt = mk(KVS_BUF_I32, (size_t)NS * max_blocks, bt), drot = mk(KVS_BUF_I32, (size_t)NS * max_blocks, rot);
    struct pair dval = mk(KVS_BUF_I32, (size_t)NS * max_blocks, valid), dinv = mk(KVS_BUF_F32, (size_t)hd / 2, inv);
    struct kvs_attn_meta mc = {.n_seqs = NS, .max_blocks = max_blocks, .q_start = dqs.c, .pos = dpos.c,
                               .block_tables = dbt.c, .rot_offsets = drot.c, .block_valid = dval.c, .inv_freq = dinv.c,
                               .h_q_start = q_start, .h_pos = pos, .max_ctx = 5001};
    struct kvs_attn_meta mg = mc;
    mg.q_start = dqs.g, mg.pos = dpos.g, mg.block_tables = dbt.g, mg.rot_offsets = drot.g, mg.block_valid = dval.g;
    mg.inv_freq = dinv.g;
    if (c->norot) mc.rot_offsets = mg.rot_offsets = NULL, mc.inv_freq = mg.inv_freq = NULL;
    struct pair out = mk(KVS_BUF_ACT, qn, NULL), lse = mk(KVS_BUF_F32, (size_t)n_rows * nh, NULL);
    float *oc = kvs_xmalloc(qn * 4), *og = kvs_xmalloc(qn * 4), *lc = kvs_xmalloc((size_t)n_rows * nh * 4), *lg = kvs_xmalloc((size_t)n_rows * nh * 4);
    const float scale = 1.0f / sqrtf((float)hd);

    kc->attention(bc, c->f, dq.c, pool.c, &mc, n_rows, nh, nkv, hd, bs, scale, out.c);
    kg->attention(bg, c->f, dq.g, pool.g, &mg, n_rows, nh, nkv, hd, bs, scale, out.g);
    C->download(bc, oc, out.c, 0, qn);
    G->download(bg, og, out.g, 0, qn);
    const double e1 = rel_l2(og, oc, qn);
    CHECK(e1 < 1e-2, "K%dV%d G %d hd %d bs %d layout %d: attention rel-L2 %g", c->f.kbits, c->f.vbits, c->grp, hd, bs,
          layout, e1);
    /* the serial merge (kv_lean.cu k_lean_merge) adds the same terms in the same order: the same bits */
    float *os = kvs_xmalloc(qn * 4), *ls2 = kvs_xmalloc((size_t)n_rows * nh * 4);
    kvs_cuda_set_lean_merge(0, 0);
    kg->attention(bg, c->f, dq.g, pool.g, &mg, n_rows, nh, nkv, hd, bs, scale, out.g);
    G->download(bg, os, out.g, 0, qn);
    kvs_cuda_set_lean_merge(1, early);
    CHECK(memcmp(os, og, qn * 4) == 0, "K%dV%d G %d hd %d bs %d layout %d: the serial merge's attention differs from the "
          "staged one's", c->f.kbits, c->f.vbits, c->grp, hd, bs, layout);
    double ed_g = -1, ed_c = -1;
    if (c->f.kbits == 16 && c->f.vbits == 16) {
        /* dense attention over the same K/V: bf16 K/V on the GPU, fp32 on the CPU */
        const size_t kve = (size_t)nblocks * nkv * bs * hd;
        struct pair kcd = mk(KVS_BUF_KV, kve, NULL), vcd = mk(KVS_BUF_KV, kve, NULL), dout = mk(KVS_BUF_ACT, qn, NULL);
        float *dz = kvs_xcalloc(kve, 4), *od = kvs_xmalloc(qn * 4);
        C->upload(bc, kcd.c, 0, dz, kve), C->upload(bc, vcd.c, 0, dz, kve);
        G->upload(bg, kcd.g, 0, dz, kve), G->upload(bg, vcd.g, 0, dz, kve);
        /* the slots of sequence 1's first block were written before its copy to the spare block */
        int32_t *sl2 = kvs_xmalloc((size_t)n_tok * 4);
        for (int i = 0; i < n_tok; i++) sl2[i] = slots[i] / bs == spare_src ? spare * bs + slots[i] % bs : slots[i];
        struct pair ds2 = mk(KVS_BUF_I32, (size_t)n_tok, sl2);
        C->kv_write(bc, dk.c, dv.c, ds2.c, n_tok, nkv, hd, bs, kcd.c, vcd.c);
        G->kv_write(bg, dk.g, dv.g, ds2.g, n_tok, nkv, hd, bs, kcd.g, vcd.g);
        G->attention(bg, dq.g, kcd.g, vcd.g, &mg, n_rows, nh, nkv, hd, bs, scale, dout.g);
        G->download(bg, od, dout.g, 0, qn);
        ed_g = rel_l2(og, od, qn);
        C->attention(bc, dq.c, kcd.c, vcd.c, &mc, n_rows, nh, nkv, hd, bs, scale, dout.c);
        C->download(bc, od, dout.c, 0, qn);
        ed_c = rel_l2(og, od, qn);
        CHECK(ed_g < 1e-2 && ed_c < 1e-2, "K16V16 G %d hd %d bs %d: vs dense attention rel-L2 %g (cuda bf16), %g (cpu f32)",
              c->grp, hd, bs, ed_g, ed_c);
        struct pair dd[] = {kcd, vcd, dout, ds2};
        for (size_t i = 0; i < sizeof dd / sizeof dd[0]; i++) drop(&dd[i]);
        free(dz), free(od), free(sl2);
    }

    /* spans: up to 3 per (row, KV head), some empty or past the row */
    const int ms = 3;
    int32_t *hn = kvs_xmalloc((size_t)n_rows * nkv * 4), *hsp = kvs_xmalloc((size_t)n_rows * nkv * ms * 2 * 4);
    for (int t = 0; t < n_rows * nkv; t++) {
        int a = irand(20), k = 0, want = irand(ms + 1);
        for (; k < want; k++) {
            hsp[(t * ms + k) * 2] = a, hsp[(t * ms + k) * 2 + 1] = a + irand(60);
            a = hsp[(t * ms + k) * 2 + 1] + 1 + irand(30);
        }
        hn[t] = k;
    }
    struct pair dn = mk(KVS_BUF_I32, (size_t)n_rows * nkv, hn), dsp = mk(KVS_BUF_I32, (size_t)n_rows * nkv * ms * 2, hsp);
    struct kvs_span_list sc = {ms, dn.c, dsp.c, hn, hsp}, sg = {ms, dn.g, dsp.g, hn, hsp};
    kc->attention_spans(bc, c->f, dq.c, pool.c, &mc, &sc, n_rows, nh, nkv, hd, bs, scale, out.c, lse.c);
    kg->attention_spans(bg, c->f, dq.g, pool.g, &mg, &sg, n_rows, nh, nkv, hd, bs, scale, out.g, lse.g);
    C->download(bc, oc, out.c, 0, qn);
    G->download(bg, og, out.g, 0, qn);
    C->download(bc, lc, lse.c, 0, (size_t)n_rows * nh);
    G->download(bg, lg, lse.g, 0, (size_t)n_rows * nh);
    kvs_cuda_set_lean_merge(0, 0);
    kg->attention_spans(bg, c->f, dq.g, pool.g, &mg, &sg, n_rows, nh, nkv, hd, bs, scale, out.g, lse.g);
    G->download(bg, os, out.g, 0, qn);
    G->download(bg, ls2, lse.g, 0, (size_t)n_rows * nh);
    kvs_cuda_set_lean_merge(1, early);
    CHECK(memcmp(os, og, qn * 4) == 0 && memcmp(ls2, lg, (size_t)n_rows * nh * 4) == 0,
          "K%dV%d G %d hd %d bs %d layout %d: the serial merge's spans differ from the staged one's", c->f.kbits,
          c->f.vbits, c->grp, hd, bs, layout);
    free(os), free(ls2);
    const double e2 = rel_l2(og, oc, qn);
    int lse_bad = 0;
    for (int i = 0; i < n_rows * nh; i++)
        lse_bad += isinf(lc[i]) ? !(isinf(lg[i]) && lg[i] < 0) : !(fabsf(lc[i] - lg[i]) < 1e-2f);
    CHECK(e2 < 1e-2 && lse_bad == 0, "K%dV%d G %d hd %d bs %d: spans rel-L2 %g, %d lse off", c->f.kbits, c->f.vbits,
          c->grp, hd, bs, e2, lse_bad);
    char lay[64];
    if (layout == 3 && c->grp <= 8)
        snprintf(lay, sizeof lay, "keys on M, multi-warp (%d, %d, %d, %d)", dc[0], dc[1], dc[2], dc[3]);
    else snprintf(lay, sizeof lay, "%s", layout >= 2 && c->grp <= 8 ? "keys on M" : "rows on M");
    printf("ok K%dV%d G %d hd %d bs %d%s %s: pages bytewise equal, attention rel-L2 %.1e, spans %.1e", c->f.kbits,
           c->f.vbits, c->grp, hd, bs, c->norot ? " no rotation" : "", lay, e1, e2);
    if (ed_g >= 0) printf(", vs dense %.1e (cuda bf16) %.1e (cpu f32)", ed_g, ed_c);
    printf("\n");

    struct pair all[] = {pool, dk, dv, ds, dq, dqs, dpos, dbt, drot, dval, dinv, out, lse, dn, dsp};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) drop(&all[i]);
    free(bt), free(rot), free(valid), free(slots), free(perm), free(hk), free(hv), free(hq), free(zero), free(pc);
    free(pg), free(oc), free(og), free(lc), free(lg), free(hn), free(hsp);
}

/* A mixed step (issue 20, part 14): decode rows (1 to 8 / G rows) and prompt chunks (more) in a
 * random order, at the automatic layout, where run_attn gives the decode rows their own launch on
 * the keys-on-M kernels (k_lean_dec from K4V2 up, k_lean_fd's at K2V2) and the chunks theirs on
 * rows on M, each launch and its merge taking only its own rows; the out buffer is poisoned (NaN)
 * first, so a row that neither launch wrote fails. Against the CPU reference over the same pages;
 * and the one-launch form (kvs_cuda_set_lean_mixed(0)) on the same inputs. One sequence of
 * 2,500-3,000 tokens makes the decode launch split its keys (the merge over the selection). */
static void run_mixed(const struct cfg *c)
{
    kvs_cuda_set_lean_layout(0);
    kvs_cuda_set_lean_merge(1, 0);
    const struct kvs_lean_kernels *kc = kvs_lean_kernels_for(C, NULL, 0), *kg = kvs_lean_kernels_for(G, NULL, 0);
    const int nkv = c->nkv, nh = nkv * c->grp, hd = c->hd, bs = c->bs, ktr = 8 / c->grp;
    const int ns = 8 + irand(12), chunk_at = irand(ns), dec_at = (chunk_at + 1 + irand(ns - 1)) % ns, long_at = irand(ns);
    int *pos = kvs_xmalloc((size_t)ns * 4), *rows = kvs_xmalloc((size_t)ns * 4), n_chunks = 0;
    int max_blocks = 0, n_rows = 0, n_tok = 0;
    for (int s = 0; s < ns; s++) {
        const int chunk = s == chunk_at || (s != dec_at && irand(3) == 0);
        n_chunks += chunk;
        rows[s] = chunk ? ktr + 1 + irand(40) : 1 + irand(ktr);
        pos[s] = s == long_at ? 2500 + irand(500) : irand(700);
        const int nb = (pos[s] + rows[s] + bs - 1) / bs;
        if (nb > max_blocks) max_blocks = nb;
        n_rows += rows[s], n_tok += pos[s] + rows[s];
    }
    const int nblocks = ns * max_blocks;
    int32_t *q_start = kvs_xmalloc((size_t)(ns + 1) * 4), *bt = kvs_xmalloc((size_t)nblocks * 4);
    int32_t *rot = kvs_xmalloc((size_t)nblocks * 4), *slots = kvs_xmalloc((size_t)n_tok * 4);
    for (int i = 0; i < nblocks; i++) bt[i] = i;
    for (int i = nblocks - 1; i > 0; i--) {
        int j = irand(i + 1), t = bt[i];
        bt[i] = bt[j], bt[j] = t;
    }
    int r0 = 0, t0 = 0;
    for (int s = 0; s < ns; s++) {
        q_start[s] = r0;
        r0 += rows[s];
        for (int j = 0; j < max_blocks; j++) rot[s * max_blocks + j] = irand(3) == 0 ? irand(400) - 100 : 0;
        for (int p = 0; p < pos[s] + rows[s]; p++) slots[t0++] = bt[s * max_blocks + p / bs] * bs + p % bs;
    }
    q_start[ns] = r0;
    const size_t kvn = (size_t)n_tok * nkv * hd, qn = (size_t)n_rows * nh * hd;
    float *hk = kvs_xmalloc(kvn * 4), *hv = kvs_xmalloc(kvn * 4), *hq = kvs_xmalloc(qn * 4);
    for (size_t i = 0; i < kvn; i++) hk[i] = 2.0f * frand() + 0.5f, hv[i] = frand();
    for (size_t i = 0; i < qn; i++) hq[i] = 2.0f * frand();
    float inv[256];
    for (int i = 0; i < hd / 2; i++) inv[i] = powf(10000.0f, -2.0f * i / hd);
    const size_t blockb = kvs_lean_page_bytes(c->f, hd, bs) * nkv;
    struct pair pool = {.c = kc->alloc_pages(bc, blockb * nblocks), .g = kg->alloc_pages(bg, blockb * nblocks)};
    struct pair dk = mk(KVS_BUF_ACT, kvn, hk), dv = mk(KVS_BUF_ACT, kvn, hv), ds = mk(KVS_BUF_I32, (size_t)n_tok, slots);
    kc->write(bc, c->f, dk.c, dv.c, ds.c, n_tok, nkv, hd, bs, pool.c);
    kg->write(bg, c->f, dk.g, dv.g, ds.g, n_tok, nkv, hd, bs, pool.g);
    struct pair dq = mk(KVS_BUF_ACT, qn, hq), dqs = mk(KVS_BUF_I32, (size_t)ns + 1, q_start);
    struct pair dpos = mk(KVS_BUF_I32, (size_t)ns, pos), dbt = mk(KVS_BUF_I32, (size_t)nblocks, bt);
    struct pair drot = mk(KVS_BUF_I32, (size_t)nblocks, rot), dinv = mk(KVS_BUF_F32, (size_t)hd / 2, inv);
    struct kvs_attn_meta mc = {.n_seqs = ns, .max_blocks = max_blocks, .q_start = dqs.c, .pos = dpos.c,
                               .block_tables = dbt.c, .rot_offsets = drot.c, .inv_freq = dinv.c,
                               .h_q_start = q_start, .h_pos = pos, .max_ctx = 3100};
    struct kvs_attn_meta mg = mc;
    mg.q_start = dqs.g, mg.pos = dpos.g, mg.block_tables = dbt.g, mg.rot_offsets = drot.g, mg.inv_freq = dinv.g;
    if (c->norot) mc.rot_offsets = mg.rot_offsets = NULL, mc.inv_freq = mg.inv_freq = NULL;
    struct pair out = mk(KVS_BUF_ACT, qn, NULL);
    float *oc = kvs_xmalloc(qn * 4), *og = kvs_xmalloc(qn * 4);
    const float scale = 1.0f / sqrtf((float)hd);
    kc->attention(bc, c->f, dq.c, pool.c, &mc, n_rows, nh, nkv, hd, bs, scale, out.c);
    C->download(bc, oc, out.c, 0, qn);
    double e[2];
    for (int one = 0; one < 2; one++) { /* two launches (the default), then one */
        kvs_cuda_set_lean_mixed(!one);
        poison(&out);
        kg->attention(bg, c->f, dq.g, pool.g, &mg, n_rows, nh, nkv, hd, bs, scale, out.g);
        G->download(bg, og, out.g, 0, qn);
        e[one] = rel_l2(og, oc, qn);
        int bad_row = -1; /* a row the launches left unwritten (NaN); rows' errors vary (K4V2's one-launch
                           * form had rows at 2e-2 on the H100), so the bound is the whole batch's */
        for (size_t i = 0; i < qn && bad_row < 0; i++)
            if (!isfinite(og[i])) bad_row = (int)(i / ((size_t)nh * hd));
        CHECK(e[one] < 1e-2 && bad_row < 0, "mixed K%dV%d G %d hd %d bs %d %s: %d seqs (%d chunks), rel-L2 %g, first bad "
              "row %d", c->f.kbits, c->f.vbits, c->grp, hd, bs, one ? "one launch" : "two launches", ns, n_chunks, e[one],
              bad_row);
    }
    kvs_cuda_set_lean_mixed(-1);
    printf("ok mixed K%dV%d G %d hd %d bs %d%s: %d seqs (%d chunks, %d rows), rel-L2 %.1e two launches, %.1e one\n",
           c->f.kbits, c->f.vbits, c->grp, hd, bs, c->norot ? " no rotation" : "", ns, n_chunks, n_rows, e[0], e[1]);
    struct pair all[] = {pool, dk, dv, ds, dq, dqs, dpos, dbt, drot, dinv, out};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) drop(&all[i]);
    free(pos), free(rows), free(q_start), free(bt), free(rot), free(slots), free(hk), free(hv), free(hq), free(oc);
    free(og);
}

int main(void)
{
    if (cuda_pair_open(4)) return 1;
    REQUIRE(kvs_lean_kernels_for(G, NULL, 0), "the cuda backend has LeanKV kernels");
    static const struct kvs_lean_fmt fmts[] = {{8, 4}, {4, 2}, {8, 8}, {4, 4}, {2, 2}, {16, 16}};
    const struct kvs_lean_kernels *kg = kvs_lean_kernels_for(G, NULL, 0);
    /* K16V16 (the neutral setting) is taken since its pages matched the CPU's on the H100
     * (2026-11-24T11:18Z); the cases below keep checking them */
    CHECK(kg->supports((struct kvs_lean_fmt){16, 16}, 32, 8, 128) && kg->supports((struct kvs_lean_fmt){8, 4}, 16, 1, 64),
          "K16V16 taken on cuda; G 16 taken");
    CHECK(!kg->supports((struct kvs_lean_fmt){8, 16}, 32, 8, 128) && !kg->supports((struct kvs_lean_fmt){8, 4}, 32, 8, 96) &&
              !kg->supports((struct kvs_lean_fmt){8, 4}, 64, 2, 128),
          "cuda refuses formats, head_dims and groups its attention kernel is not built for");
    /* each case in the three layouts of the attention kernel: 1 rows on the mma's M side, 2 keys on
     * M (k_lean_fd), 3 keys on M with the multi-warp decode kernel (k_lean_dec, kv_lean_decode.cu:
     * attention(); attention_spans takes k_lean_fd); a group of 16 takes rows every time */
    for (int layout = 1; layout <= 3; layout++)
        for (size_t i = 0; i < sizeof fmts / sizeof fmts[0]; i++) {
            struct cfg c = {fmts[i], 2, 4, 128, 16, 0};
            run_case(&c, layout);
        }
    struct cfg more[] = {{{8, 4}, 4, 1, 64, 16, 0},  {{8, 4}, 1, 8, 128, 8, 0},  {{4, 2}, 2, 8, 64, 16, 0},
                         {{8, 8}, 8, 4, 128, 16, 0}, {{16, 16}, 2, 1, 64, 8, 0}, {{16, 16}, 1, 8, 128, 16, 0},
                         {{4, 4}, 1, 16, 64, 16, 0}, {{2, 2}, 2, 1, 64, 8, 0},  {{8, 4}, 2, 16, 128, 8, 0},
                         /* the multi-warp kernel's shapes: no rotation offsets (its plain QK path), odd
                          * groups and KV head counts (tiles of 2 tokens x 3 heads, 8 / 5 = 1 x 5 heads),
                          * groups of 2 and 8, blocks of 8 and 32 slots (two pages a tile, or half one) */
                         {{8, 8}, 8, 4, 128, 16, 1}, {{8, 4}, 3, 3, 128, 16, 1}, {{4, 4}, 5, 5, 64, 32, 0},
                         {{8, 8}, 3, 2, 128, 8, 1},  {{4, 2}, 1, 8, 128, 32, 1}, {{8, 4}, 7, 3, 64, 8, 0},
                         {{16, 16}, 3, 3, 128, 16, 1}};
    for (int layout = 1; layout <= 3; layout++)
        for (size_t i = 0; i < sizeof more / sizeof more[0]; i++) run_case(&more[i], layout);
    kvs_cuda_set_lean_layout(0);
    kvs_cuda_set_lean_dec(0, 0, 0, -1);
    kvs_cuda_set_lean_merge(-1, -1);
    /* mixed steps at the automatic layout: the four formats of the issue at Llama's group of 4,
     * then K2V2 (keys on M by k_lean_fd), a group of 8 (1-row tiles), 1 and 2 */
    struct cfg mixed[] = {{{8, 8}, 2, 4, 128, 16, 0}, {{8, 4}, 2, 4, 128, 16, 0}, {{4, 4}, 2, 4, 128, 16, 0},
                          {{4, 2}, 2, 4, 128, 16, 0}, {{8, 4}, 2, 4, 128, 16, 1}, {{8, 8}, 2, 4, 64, 8, 1},
                          {{2, 2}, 2, 4, 64, 16, 0},  {{8, 4}, 1, 8, 128, 16, 0}, {{4, 4}, 4, 1, 64, 32, 0},
                          {{8, 8}, 3, 2, 128, 16, 1}};
    for (int rep = 0; rep < 2; rep++)
        for (size_t i = 0; i < sizeof mixed / sizeof mixed[0]; i++) run_mixed(&mixed[i]);
    kvs_cuda_set_lean_layout(0);
    kvs_cuda_set_lean_merge(-1, -1);
    C->free(bc);
    G->free(bg);
    return kvs_test_summary("test_cuda_kv_lean");
}
#else
int main(void)
{
    fprintf(stderr, "test_cuda_kv_lean: built without CUDA\n");
    return 1;
}
#endif
