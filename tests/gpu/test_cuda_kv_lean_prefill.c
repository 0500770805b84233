/* test_cuda_kv_lean_prefill.c: LeanKV's prompt-chunk attention: the bf16 road (the chunks' context
 * dequantized by k_lean_dq into a bf16 scratch, then the dense prefill attention; kv_lean_prefill.cu
 * lean_dq_attention) and the tensor-core kernel over quantized tiles (k_lean_pf, same file), against
 * the CPU reference (kernels/cpu/kv_lean.c) and against the one-warp kernel (k_lean_fd rows on M,
 * forced by kvs_cuda_set_lean_layout(1)), on fresh random inputs each run (seed printed; KVS_SEED
 * replays).
 *
 * Each case: a format (K8V8, K8V4, K4V4, K4V2), a GQA group (1-8, and 16), head_dim 64 or 128, a
 * block size of 8, 16 or 32 slots, and a batch of one prompt chunk of 1-4,096 rows (tile
 * multiples and not: the kernel's tiles are 64 / G or 128 / G tokens) at the end of a context
 * with earlier pages (0-3,000 cached tokens), beside 0-2 other sequences (short chunks or decode
 * rows: the launch then holds both, as a mixed step's does); blocks dealt at random, some
 * cached blocks with partial valid counts. The pages are written by the CUDA kernel and copied to
 * the CPU's pool, so both sides read the same bytes. Checks:
 *   - k_lean_pf at 4 and 8 warps a block: every output row written (the buffer is poisoned with
 *     NaN first) and rel-L2 < 1e-2 against the CPU reference over windows of each sequence's rows
 *     (all rows up to 192; else the first 64, 64 in the middle and the last 64: the CPU's
 *     attention of a 4,096-row chunk over 7K keys would take minutes; the window's rows see the
 *     same keys as in the chunk, so the reference is exact for them);
 *   - 8 warps against 4 over every row: rel-L2 < 1e-3 (the same arithmetic a row);
 *   - k_lean_fd (rows on M) against the CPU as k_lean_pf, and k_lean_pf against it over every
 *     row: rel-L2 < 1e-2 (before each tile's 1024 sum p' was taken out of its accumulators,
 *     lean_softmax in kv_lean_device.cuh, it was 0.06-0.27 off over 3-7K keys in one split);
 *   - the bf16 road (kvs_cuda_set_lean_dq(1)) against the CPU and k_lean_fd as k_lean_pf (rel-L2 <
 *     1e-2: bf16 K / V / P against the reference's fp32), taken exactly where some sequence has more
 *     rows than a keys-on-M tile (its counter), with the main chunk first or last among the
 *     sequences (the range it takes then starts at row 0 or after the others' rows); the other
 *     variants run with it off;
 *   - k_lean_dq bitwise against kvs_lean_dequantize rounded to bf16, every slot of every block of
 *     every sequence and KV head, and its scratch block table.
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

struct pcase {
    struct kvs_lean_fmt f;
    int nkv, grp, hd, bs;
    int chunk, hist; /* the main sequence: chunk rows after hist cached tokens */
};

#define MAXS 3
#define WIN 64

static void run_case(const struct pcase *c)
{
    const struct kvs_lean_kernels *kc = kvs_lean_kernels_for(C, NULL, 0), *kg = kvs_lean_kernels_for(G, NULL, 0);
    const int nkv = c->nkv, nh = nkv * c->grp, hd = c->hd, bs = c->bs;
    /* the main chunk, then 0-2 others: a short chunk (2-40 rows) or a decode row, 0-1,200 cached */
    int ns = 1 + irand(MAXS);
    int pos[MAXS], rows[MAXS];
    pos[0] = c->hist, rows[0] = c->chunk;
    for (int s = 1; s < ns; s++) pos[s] = irand(1200), rows[s] = irand(2) ? 1 : 2 + irand(39);
    /* a launch takes rows on M (so k_lean_pf) only where some sequence has more than 8 / G rows:
     * a chunk that short gets a second one that long */
    if (c->grp <= 8 && c->chunk * c->grp <= 8) {
        if (ns < 2) ns = 2, pos[1] = irand(1200);
        rows[1] = 8 / c->grp + 1 + irand(32);
    }
    /* half the cases put the main chunk last: the bf16 road's range of chunk sequences then starts
     * after row 0, with the other sequences before it (and, with a chunk among them, decode rows
     * inside it) */
    if (ns > 1 && irand(2)) {
        const int p0 = pos[0], r0 = rows[0];
        for (int s = 0; s + 1 < ns; s++) pos[s] = pos[s + 1], rows[s] = rows[s + 1];
        pos[ns - 1] = p0, rows[ns - 1] = r0;
    }
    int max_blocks = 0, n_rows = 0, n_tok = 0, q_start[MAXS + 1];
    for (int s = 0; s < ns; s++) {
        const int nb = (pos[s] + rows[s] + bs - 1) / bs;
        if (nb > max_blocks) max_blocks = nb;
        q_start[s] = n_rows;
        n_rows += rows[s], n_tok += pos[s] + rows[s];
    }
    q_start[ns] = n_rows;
    const int nblocks = ns * max_blocks;
    int32_t *bt = kvs_xmalloc((size_t)nblocks * 4), *valid = kvs_xmalloc((size_t)nblocks * 4);
    int32_t *slots = kvs_xmalloc((size_t)n_tok * 4);
    for (int i = 0; i < nblocks; i++) bt[i] = i;
    for (int i = nblocks - 1; i > 0; i--) {
        const int j = irand(i + 1), t = bt[i];
        bt[i] = bt[j], bt[j] = t;
    }
    const int use_valid = irand(3) == 0;
    int t0 = 0;
    for (int s = 0; s < ns; s++) {
        for (int j = 0; j < max_blocks; j++) {
            /* a cached block (wholly before the rows) may hold fewer valid slots; the rows' own are valid */
            const int cached = (j + 1) * bs <= pos[s];
            valid[s * max_blocks + j] = cached && irand(4) == 0 ? 1 + irand(bs) : bs;
        }
        for (int p = 0; p < pos[s] + rows[s]; p++) slots[t0++] = bt[s * max_blocks + p / bs] * bs + p % bs;
    }
    const size_t kvn = (size_t)n_tok * nkv * hd, qn = (size_t)n_rows * nh * hd;
    float *hk = kvs_xmalloc(kvn * 4), *hv = kvs_xmalloc(kvn * 4), *hq = kvs_xmalloc(qn * 4);
    for (size_t i = 0; i < kvn; i++) hk[i] = 2.0f * frand() + 0.5f, hv[i] = frand();
    for (size_t i = 0; i < qn; i++) hq[i] = 2.0f * frand();

    /* the pages: written on the GPU, the same bytes uploaded to the CPU's pool */
    const size_t blockb = kvs_lean_page_bytes(c->f, hd, bs) * nkv, words = (blockb * nblocks + 3) / 4;
    struct kvs_dbuf *pg = kg->alloc_pages(bg, blockb * nblocks), *pc = kc->alloc_pages(bc, blockb * nblocks);
    REQUIRE(pg && pc, "pages of %zu bytes", blockb * nblocks);
    int32_t *zero = kvs_xcalloc(words, 4);
    G->upload(bg, pg, 0, zero, words);
    struct pair dk = mk(KVS_BUF_ACT, kvn, hk), dv = mk(KVS_BUF_ACT, kvn, hv), ds = mk(KVS_BUF_I32, (size_t)n_tok, slots);
    kg->write(bg, c->f, dk.g, dv.g, ds.g, n_tok, nkv, hd, bs, pg);
    G->download(bg, zero, pg, 0, words);
    C->upload(bc, pc, 0, zero, words);

    /* the GPU batch */
    struct pair dq = mk(KVS_BUF_ACT, qn, hq), dqs = mk(KVS_BUF_I32, (size_t)ns + 1, q_start);
    struct pair dpos = mk(KVS_BUF_I32, (size_t)ns, pos), dbt = mk(KVS_BUF_I32, (size_t)nblocks, bt);
    struct pair dval = mk(KVS_BUF_I32, (size_t)nblocks, valid);
    struct kvs_attn_meta mg = {.n_seqs = ns, .max_blocks = max_blocks, .q_start = dqs.g, .pos = dpos.g,
                               .block_tables = dbt.g, .block_valid = use_valid ? dval.g : NULL,
                               .h_q_start = q_start, .h_pos = pos, .max_ctx = 0};
    for (int s = 0; s < ns; s++)
        if (pos[s] + rows[s] > mg.max_ctx) mg.max_ctx = pos[s] + rows[s];
    struct pair out = mk(KVS_BUF_ACT, qn, NULL);
    const float scale = 1.0f / sqrtf((float)hd);
    float *o4 = kvs_xmalloc(qn * 4), *o8 = kvs_xmalloc(qn * 4), *ofd = kvs_xmalloc(qn * 4), *odq = kvs_xmalloc(qn * 4);
    float *outs[4] = {o4, o8, ofd, odq};
    /* the bf16 road takes the launch where some sequence has more rows than a keys-on-M tile */
    const int thr = c->grp <= 8 && 8 / c->grp > 1 ? 8 / c->grp : 1;
    int dq_expect = 0;
    for (int s = 0; s < ns; s++) dq_expect |= rows[s] > thr;
    long long taken0, fb0, taken1, fb1;
    for (int v = 0; v < 4; v++) {
        /* 0: k_lean_pf, 4 warps; 1: 8 warps; 2: k_lean_fd rows on M; 3: the bf16 road (every chunk) */
        kvs_cuda_set_lean_layout(v == 2 ? 1 : 0);
        kvs_cuda_set_lean_prefill(v == 1 ? 8 : 4);
        kvs_cuda_set_lean_dq(v == 3 ? 1 : 0);
        poison(&out);
        kvs_cuda_lean_dq_counts(&taken0, &fb0);
        kg->attention(bg, c->f, dq.g, pg, &mg, n_rows, nh, nkv, hd, bs, scale, out.g);
        G->download(bg, outs[v], out.g, 0, qn);
        kvs_cuda_lean_dq_counts(&taken1, &fb1);
        CHECK(taken1 - taken0 == (v == 3 ? dq_expect : 0) && fb1 == fb0,
              "variant %d: the bf16 road taken %lld times (expected %d), %lld fallbacks", v, taken1 - taken0,
              v == 3 ? dq_expect : 0, fb1 - fb0);
    }
    kvs_cuda_set_lean_layout(0);
    kvs_cuda_set_lean_prefill(-1);
    kvs_cuda_set_lean_dq(-1);

    /* k_lean_dq bitwise against the host: each sequence's blocks (pos + rows tokens, whole blocks)
     * dequantized by kvs_lean_dequantize (the CPU reference's x^) and rounded to bf16 */
    {
        int base[MAXS + 1];
        base[0] = 0;
        for (int s = 0; s < ns; s++) base[s + 1] = base[s] + (pos[s] + rows[s] + bs - 1) / bs;
        const size_t per = (size_t)nkv * bs * hd, de = (size_t)base[ns] * per;
        struct pair sk = mk(KVS_BUF_KV, de, NULL), sv = mk(KVS_BUF_KV, de, NULL);
        struct pair sbt = mk(KVS_BUF_I32, (size_t)ns * max_blocks, NULL);
        kvs_cuda_lean_dequant(bg, c->f, pg, &mg, nkv, hd, bs, sk.g, sv.g, sbt.g);
        float *gk = kvs_xmalloc(de * 4), *gv = kvs_xmalloc(de * 4), *x = kvs_xmalloc((size_t)hd * 4);
        int32_t *gbt = kvs_xmalloc((size_t)ns * max_blocks * 4);
        G->download(bg, gk, sk.g, 0, de);
        G->download(bg, gv, sv.g, 0, de);
        G->download(bg, gbt, sbt.g, 0, (size_t)ns * max_blocks);
        const uint8_t *bytes = (const uint8_t *)zero;
        const size_t pageb = kvs_lean_page_bytes(c->f, hd, bs), kcb = (size_t)hd * c->f.kbits / 8,
                     vcb = (size_t)hd * c->f.vbits / 8;
        long long bad = 0, bad_bt = 0;
        for (int s = 0; s < ns; s++)
            for (int j = 0; j < max_blocks; j++) {
                const int nb = base[s + 1] - base[s];
                if (gbt[s * max_blocks + j] != (j < nb ? base[s] + j : 0)) bad_bt++;
                if (j >= nb) continue;
                for (int h = 0; h < nkv; h++) {
                    const uint8_t *page = bytes + ((size_t)bt[s * max_blocks + j] * nkv + h) * pageb;
                    const uint8_t *meta = page + (size_t)bs * (kcb + vcb);
                    for (int t = 0; t < bs; t++)
                        for (int side = 0; side < 2; side++) {
                            uint16_t sz[2];
                            memcpy(sz, meta + (size_t)side * bs * 4 + (size_t)t * 4, 4);
                            const uint8_t *codes = side ? page + (size_t)bs * kcb + t * vcb : page + t * kcb;
                            kvs_lean_dequantize(codes, sz, hd, side ? c->f.vbits : c->f.kbits, x);
                            const float *got = (side ? gv : gk) + ((size_t)(base[s] + j) * nkv + h) * bs * hd + (size_t)t * hd;
                            for (int d = 0; d < hd; d++) {
                                const float want = kvs_bf16_round(x[d]);
                                if (memcmp(&want, &got[d], 4) != 0) bad++;
                            }
                        }
                }
            }
        CHECK(bad == 0 && bad_bt == 0, "K%dV%d hd %d bs %d: k_lean_dq: %lld values not bitwise the host's, %lld table "
              "entries wrong", c->f.kbits, c->f.vbits, hd, bs, bad, bad_bt);
        struct pair dd[] = {sk, sv, sbt};
        for (size_t i = 0; i < 3; i++) drop(&dd[i]);
        free(gk), free(gv), free(x), free(gbt);
    }

    /* the CPU reference over windows of each sequence's rows: one CPU sequence a window, with
     * its sequence's block table and the window's first position */
    int wpos[3 * MAXS], wq[3 * MAXS + 1], wsrc[3 * MAXS], nw = 0, wrows = 0;
    for (int s = 0; s < ns; s++) {
        int starts[3], lens[3], k = 0;
        if (rows[s] <= 3 * WIN) {
            starts[k] = 0, lens[k++] = rows[s];
        } else {
            starts[k] = 0, lens[k++] = WIN;
            starts[k] = WIN + irand(rows[s] - 3 * WIN), lens[k++] = WIN;
            starts[k] = rows[s] - WIN, lens[k++] = WIN;
        }
        for (int i = 0; i < k; i++) {
            wpos[nw] = pos[s] + starts[i];
            wq[nw] = wrows;
            wsrc[nw] = q_start[s] + starts[i];
            wrows += lens[i];
            nw++;
        }
    }
    wq[nw] = wrows;
    const size_t wn = (size_t)wrows * nh * hd;
    float *wqh = kvs_xmalloc(wn * 4), *wref = kvs_xmalloc(wn * 4);
    int32_t *wbt = kvs_xmalloc((size_t)nw * max_blocks * 4), *wval = kvs_xmalloc((size_t)nw * max_blocks * 4);
    {
        int w = 0;
        for (int s = 0; s < ns; s++) {
            const int nws = rows[s] <= 3 * WIN ? 1 : 3;
            for (int i = 0; i < nws; i++, w++) {
                memcpy(wbt + (size_t)w * max_blocks, bt + (size_t)s * max_blocks, (size_t)max_blocks * 4);
                memcpy(wval + (size_t)w * max_blocks, valid + (size_t)s * max_blocks, (size_t)max_blocks * 4);
                const int len = wq[w + 1] - wq[w];
                memcpy(wqh + (size_t)wq[w] * nh * hd, hq + (size_t)wsrc[w] * nh * hd, (size_t)len * nh * hd * 4);
            }
        }
    }
    struct kvs_dbuf *cq = C->alloc(bc, KVS_BUF_ACT, wn), *cout = C->alloc(bc, KVS_BUF_ACT, wn);
    struct kvs_dbuf *cqs = C->alloc(bc, KVS_BUF_I32, (size_t)nw + 1), *cpos = C->alloc(bc, KVS_BUF_I32, (size_t)nw);
    struct kvs_dbuf *cbt = C->alloc(bc, KVS_BUF_I32, (size_t)nw * max_blocks);
    struct kvs_dbuf *cval = C->alloc(bc, KVS_BUF_I32, (size_t)nw * max_blocks);
    REQUIRE(cq && cout && cqs && cpos && cbt && cval, "cpu buffers");
    C->upload(bc, cq, 0, wqh, wn);
    C->upload(bc, cqs, 0, wq, (size_t)nw + 1);
    C->upload(bc, cpos, 0, wpos, (size_t)nw);
    C->upload(bc, cbt, 0, wbt, (size_t)nw * max_blocks);
    C->upload(bc, cval, 0, wval, (size_t)nw * max_blocks);
    struct kvs_attn_meta mc = {.n_seqs = nw, .max_blocks = max_blocks, .q_start = cqs, .pos = cpos, .block_tables = cbt,
                               .block_valid = use_valid ? cval : NULL, .h_q_start = wq, .h_pos = wpos,
                               .max_ctx = mg.max_ctx};
    kc->attention(bc, c->f, cq, pc, &mc, wrows, nh, nkv, hd, bs, scale, cout);
    C->download(bc, wref, cout, 0, wn);

    double e_cpu[4], e_fd[4], e_48 = rel_l2(o8, o4, qn);
    float *wg = kvs_xmalloc(wn * 4);
    for (int v = 0; v < 4; v++) {
        int bad_row = -1;
        for (size_t i = 0; i < qn && bad_row < 0; i++)
            if (!isfinite(outs[v][i])) bad_row = (int)(i / ((size_t)nh * hd));
        for (int w = 0; w < nw; w++)
            memcpy(wg + (size_t)wq[w] * nh * hd, outs[v] + (size_t)wsrc[w] * nh * hd,
                   (size_t)(wq[w + 1] - wq[w]) * nh * hd * 4);
        e_cpu[v] = rel_l2(wg, wref, wn);
        e_fd[v] = rel_l2(outs[v], ofd, qn);
        CHECK(bad_row < 0 && e_cpu[v] < 1e-2 && (v == 2 || e_fd[v] < 1e-2),
              "K%dV%d G %d nkv %d hd %d bs %d chunk %d after %d (%d seqs, valid %d) %s: rel-L2 %g vs cpu, %g vs "
              "k_lean_fd, first unwritten row %d",
              c->f.kbits, c->f.vbits, c->grp, nkv, hd, bs, c->chunk, c->hist, ns, use_valid,
              v == 0 ? "k_lean_pf 4 warps" : v == 1 ? "k_lean_pf 8 warps" : v == 2 ? "k_lean_fd" : "bf16 road",
              e_cpu[v], v != 2 ? e_fd[v] : 0.0,
              bad_row);
    }
    /* 4 and 8 warps: the same arithmetic per row; only the split plans can differ */
    CHECK(e_48 < 1e-3, "K%dV%d G %d hd %d chunk %d after %d: k_lean_pf 8 warps vs 4 warps rel-L2 %g", c->f.kbits,
          c->f.vbits, c->grp, hd, c->chunk, c->hist, e_48);
    printf("ok K%dV%d G %d nkv %d hd %d bs %d chunk %4d after %4d (%d seqs, %d rows, valid %d): rel-L2 vs cpu "
           "pf4 %.1e pf8 %.1e fd %.1e bf16-road%s %.1e; pf4 / pf8 / road vs fd %.1e / %.1e / %.1e; pf8 vs pf4 %.1e\n",
           c->f.kbits, c->f.vbits, c->grp, nkv, hd, bs, c->chunk, c->hist, ns, n_rows, use_valid, e_cpu[0], e_cpu[1],
           e_cpu[2], dq_expect ? "" : "(not taken)", e_cpu[3], e_fd[0], e_fd[1], e_fd[3], e_48);

    struct kvs_dbuf *cb[] = {cq, cout, cqs, cpos, cbt, cval, pc};
    for (size_t i = 0; i < sizeof cb / sizeof cb[0]; i++) C->free_buf(bc, cb[i]);
    G->free_buf(bg, pg);
    struct pair all[] = {dk, dv, ds, dq, dqs, dpos, dbt, dval, out};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) drop(&all[i]);
    free(bt), free(valid), free(slots), free(hk), free(hv), free(hq), free(zero), free(o4), free(o8), free(ofd), free(odq);
    free(wqh), free(wref), free(wbt), free(wval), free(wg);
}

int main(void)
{
    if (cuda_pair_open(8)) return 1;
    REQUIRE(kvs_lean_kernels_for(G, NULL, 0), "the cuda backend has LeanKV kernels");
    static const struct kvs_lean_fmt fmts[] = {{8, 8}, {8, 4}, {4, 4}, {4, 2}};
    /* chunk sizes: 1 (a lone row of a group of 16: rows on M), tile multiples (16, 32, 64, 128)
     * and not, up to 4,096; cached history 0 to 3,000 */
    static const int chunks[] = {1, 2, 7, 16, 31, 33, 64, 100, 128, 129, 255, 513, 1000, 2047, 4096};
    static const int hists[] = {0, 5, 37, 300, 1000, 3000};
    static const int grps[] = {1, 2, 3, 4, 5, 8, 16}, hds[] = {64, 128}, bss[] = {8, 16, 32};
    int n = 0;
    /* every chunk size in every format (48 cases plus the largest), groups, head_dims, block sizes
     * and histories drawn in turn; the 4,096-row chunks at small groups and KV head counts (the CPU
     * reference's windows are cheap, k_lean_fd over 4K rows is not) */
    for (size_t ci = 0; ci < sizeof chunks / sizeof chunks[0]; ci++)
        for (size_t fi = 0; fi < sizeof fmts / sizeof fmts[0]; fi++) {
            struct pcase c;
            c.f = fmts[fi];
            c.chunk = chunks[ci];
            c.grp = grps[irand((int)(sizeof grps / sizeof grps[0]))];
            if (c.chunk == 1) c.grp = 16; /* else a lone row takes the keys-on-M kernels */
            c.nkv = c.chunk >= 2047 ? 1 + irand(2) : 1 + irand(3);
            c.hd = hds[irand(2)];
            c.bs = bss[irand(3)];
            c.hist = hists[irand((int)(sizeof hists / sizeof hists[0]))];
            run_case(&c);
            n++;
        }
    /* Llama's shape at the workload's chunk: G 4, 8 KV heads, head_dim 128, 16-slot blocks, a 4K
     * chunk after 3,000 cached tokens, K8V4 and K4V4 */
    struct pcase llama[] = {{{8, 4}, 8, 4, 128, 16, 4096, 3000}, {{4, 4}, 8, 4, 128, 16, 4096, 3000},
                            {{8, 8}, 2, 8, 64, 16, 4096, 1000}, {{4, 2}, 2, 8, 128, 32, 700, 2500}};
    for (size_t i = 0; i < sizeof llama / sizeof llama[0]; i++, n++) run_case(&llama[i]);
    printf("%d cases\n", n);
    C->free(bc);
    G->free(bg);
    return kvs_test_summary("test_cuda_kv_lean_prefill");
}
#else
int main(void)
{
    fprintf(stderr, "test_cuda_kv_lean_prefill: built without CUDA\n");
    return 1;
}
#endif
