/* test_cuda_span.c: the CUDA backend's KV-strategy primitives (backend.h attention_spans and
 * attn_merge, kernels/cuda/kv_span.cu) against the fp32 CPU backend's ops (the reference), on
 * fresh random inputs each run (seed from the clock, printed; replay with KVS_SEED=<seed>).
 *
 * Spans per (row, KV head) are drawn from: none, one token, one span that crosses blocks, many
 * disjoint spans (some past the row: the causal clip), one span wholly past the row (no key: out 0,
 * lse -inf), the full context [0, pos + 1), and Quest's runs of whole 16-slot pages. Cases cover GQA groups 1 / 4 / 8, head_dim 64 / 128,
 * block sizes that do (16) and do not (8, 24) hold the kernel's 16-key halves, rotation offsets
 * (deferred RoPE), blocks with a partial valid count, decode rows mixed with prefill rows, and
 * one long context (a single row whose spans are split over many blocks and merged); every case
 * under each kind of the CUDA kernel (kvs_cuda_set_span_kernel), kinds 3 and 4 also at one tile a
 * split; the mixed spans again under the splits' merge of before (kvs_cuda_set_span_merge) and,
 * under kind 3, under kind 4 (the same staged bytes), bitwise.
 * Slots no
 * query may read (invalid tails, spare blocks) hold NaN on both backends, and the CUDA outputs
 * are poisoned with NaN before each op. Checks: out by relative L2 error < 1e-2 (bf16 K/V and
 * q products), lse finite values within 1e-2 absolute (scores are O(1)) and -inf exactly where the
 * reference has it; full spans also against attention() on both backends; attention_spans over two
 * halves of a span set merged by attn_merge against the whole set; attn_merge alone against the
 * CPU op on random partials with -inf on either or both sides.
 * Needs a GPU: exits 1 with a message when none.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/util.h"
#include "kernels/backend.h"
#include "tests/unit/test_util.h"

#if defined(KVS_HAVE_CUDA) && KVS_HAVE_CUDA
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/kv_span.h"

#include "tests/gpu/cuda_pair.h"

/* relative L2 error of got against ref; any non-finite value in got fails */
static void check_out(const char *what, const float *got, const float *ref, size_t n)
{
    double num = 0, den = 0;
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(got[i])) { bad++; continue; }
        const double d = (double)got[i] - ref[i];
        num += d * d;
        den += (double)ref[i] * ref[i];
    }
    const double e = den > 0 ? sqrt(num / den) : sqrt(num);
    const int ok = bad == 0 && e < 1e-2;
    kvs_test_checks++;
    if (!ok) kvs_test_fails++;
    printf("%s %-66s rel_l2 %.3e%s\n", ok ? "ok  " : "FAIL", what, e, bad ? "  NON-FINITE OUTPUT" : "");
}

/* lse: -inf exactly where ref is -inf, else within 1e-2 (NaN fails) */
static void check_lse(const char *what, const float *got, const float *ref, size_t n)
{
    size_t bad = 0, n_inf = 0;
    double worst = 0;
    for (size_t i = 0; i < n; i++) {
        if (ref[i] == -INFINITY) {
            n_inf++;
            if (got[i] != -INFINITY) bad++;
            continue;
        }
        if (!isfinite(got[i])) { bad++; continue; }
        const double d = fabs((double)got[i] - ref[i]);
        if (d > worst) worst = d;
    }
    const int ok = bad == 0 && worst < 1e-2;
    kvs_test_checks++;
    if (!ok) kvs_test_fails++;
    printf("%s %-66s max |d| %.2e, %zu of %zu -inf, %zu mismatched\n", ok ? "ok  " : "FAIL", what, worst, n_inf, n,
           bad);
}

static void make_inv_freq(float *f, int hd, double theta)
{
    for (int i = 0; i < hd / 2; i++) f[i] = (float)pow(theta, -2.0 * i / hd);
}

/* the kind and least tiles a split that the case loop set (kvs_cuda_set_span_kernel) */
static int cur_kind, cur_min_tiles;

struct span_case {
    const char *name;
    int n_heads, n_kv, hd, bs;
    int n_seqs;
    int pos[4], ntok[4];
    int use_rot, use_valid;
    int max_spans;
};

enum { SP_EMPTY, SP_ONE, SP_CROSS, SP_MANY, SP_PAST, SP_FULL, SP_PAGES, SP_KINDS };

/* spans [start, end) sorted and disjoint for a row at position last (n_spans returned) */
static int draw_spans(int kind, int last, int bs, int max_spans, int32_t *sp)
{
    switch (kind) {
    case SP_EMPTY: return 0;
    case SP_ONE: {
        const int p = irand(last + 1);
        sp[0] = p;
        sp[1] = p + 1;
        return 1;
    }
    case SP_CROSS: { /* from inside one block to inside a later one (or the row) */
        const int a = irand(last + 1), b = a + 1 + irand(3 * bs + 1);
        sp[0] = a;
        sp[1] = b; /* may pass the row: clipped */
        return 1;
    }
    case SP_MANY: { /* up to max_spans runs of random lengths and gaps, the last may pass the row */
        int k = 0, p = irand(bs + 1);
        while (k < max_spans && p <= last + bs) {
            const int len = 1 + irand(k % 3 == 0 ? 2 * bs : 5);
            sp[2 * k] = p;
            sp[2 * k + 1] = p + len;
            k++;
            p += len + 1 + irand(k % 2 ? 3 : 3 * bs);
        }
        return k;
    }
    case SP_PAGES: { /* Quest's spans: runs of 1-3 whole 16-slot pages with gaps of 1-3 pages (the
                      * last may pass the row: clipped) */
        int k = 0, p = 16 * irand(3);
        while (k < max_spans && p <= last) {
            const int len = 16 * (1 + irand(3));
            sp[2 * k] = p;
            sp[2 * k + 1] = p + len;
            k++;
            p += len + 16 * (1 + irand(3));
        }
        return k;
    }
    case SP_PAST:
        sp[0] = last + 1;
        sp[1] = last + 1 + bs;
        return 1;
    default:
        sp[0] = 0;
        sp[1] = last + 1;
        return 1;
    }
}

/* the device and host sides of a span list (n rows x n_kv) */
struct spans {
    int max_spans;
    int32_t *h_n, *h_sp;
    struct pair n_sp, sp;
    struct kvs_span_list lc, lg;
};

static void spans_upload(struct spans *s, size_t pairs)
{
    s->n_sp = mk(KVS_BUF_I32, pairs, s->h_n);
    s->sp = mk(KVS_BUF_I32, pairs * s->max_spans * 2, s->h_sp);
    s->lc = (struct kvs_span_list){s->max_spans, s->n_sp.c, s->sp.c, s->h_n, s->h_sp};
    s->lg = (struct kvs_span_list){s->max_spans, s->n_sp.g, s->sp.g, s->h_n, s->h_sp};
}

static void spans_free(struct spans *s)
{
    drop(&s->n_sp);
    drop(&s->sp);
    free(s->h_n);
    free(s->h_sp);
}

static void test_case(const struct span_case *sc)
{
    char what[256];
    const int nh = sc->n_heads, nkv = sc->n_kv, hd = sc->hd, bs = sc->bs, S = sc->n_seqs;
    struct batch_layout L;
    batch_layout_make(S, bs, sc->pos, sc->ntok, &L); /* two spare blocks: never read */
    const int n = L.n, max_blocks = L.max_blocks, n_blocks = L.n_blocks, max_ctx = L.max_ctx;
    int32_t *q_start = L.q_start, *pos = L.pos, *perm = L.perm;
    int32_t *bt = kvs_xcalloc((size_t)S * max_blocks, 4), *rot = kvs_xcalloc((size_t)S * max_blocks, 4);
    int32_t *valid = kvs_xmalloc((size_t)S * max_blocks * 4);
    char *readable = kvs_xcalloc((size_t)n_blocks * bs, 1); /* slot may be read by some query */
    int used = 0;
    for (int s = 0; s < S; s++) {
        const int ctx = sc->pos[s] + sc->ntok[s], nb = (ctx + bs - 1) / bs;
        for (int j = 0; j < max_blocks; j++) valid[s * max_blocks + j] = bs;
        for (int j = 0; j < nb; j++) {
            const int blk = perm[used++];
            bt[s * max_blocks + j] = blk;
            if (sc->use_rot && (s + j) % 3 != 0) rot[s * max_blocks + j] = irand(4001) - 2000;
            /* cached blocks wholly before the step's rows: some hold fewer valid slots */
            if (sc->use_valid && (j + 1) * bs <= sc->pos[s] && irand(3) == 0) valid[s * max_blocks + j] = 1 + irand(bs);
            const int v = valid[s * max_blocks + j];
            for (int o = 0; o < bs && o < v && j * bs + o < ctx; o++) readable[(size_t)blk * bs + o] = 1;
        }
    }
    /* K/V: bf16 values where a query may read, NaN elsewhere (both backends must skip those) */
    const size_t per_slot = (size_t)hd, cache_n = (size_t)n_blocks * nkv * bs * hd;
    float *kv = kvs_xmalloc(cache_n * 4), *vv = kvs_xmalloc(cache_n * 4);
    for (int blk = 0; blk < n_blocks; blk++)
        for (int g = 0; g < nkv; g++)
            for (int o = 0; o < bs; o++) {
                const size_t base = (((size_t)blk * nkv + g) * bs + o) * per_slot;
                const int ok = readable[(size_t)blk * bs + o];
                for (int d = 0; d < hd; d++) {
                    kv[base + d] = ok ? kvs_bf16_round(frand()) : NAN;
                    vv[base + d] = ok ? kvs_bf16_round(frand()) : NAN;
                }
            }
    struct pair kc = mk(KVS_BUF_KV, cache_n, kv), vc = mk(KVS_BUF_KV, cache_n, vv);
    float *qv = kvs_xmalloc((size_t)n * nh * hd * 4), *inv = kvs_xmalloc((size_t)hd / 2 * 4);
    for (size_t i = 0; i < (size_t)n * nh * hd; i++) qv[i] = frand();
    make_inv_freq(inv, hd, 500000.0);
    struct pair q = mk(KVS_BUF_ACT, (size_t)n * nh * hd, qv);
    struct pair qs = mk(KVS_BUF_I32, S + 1, q_start), ps = mk(KVS_BUF_I32, S, pos);
    struct pair bts = mk(KVS_BUF_I32, (size_t)S * max_blocks, bt), rts = mk(KVS_BUF_I32, (size_t)S * max_blocks, rot);
    struct pair vts = mk(KVS_BUF_I32, (size_t)S * max_blocks, valid), fq = mk(KVS_BUF_F32, (size_t)hd / 2, inv);
    struct kvs_attn_meta mc = {.n_seqs = S, .max_blocks = max_blocks, .q_start = qs.c, .pos = ps.c,
                               .block_tables = bts.c, .rot_offsets = sc->use_rot ? rts.c : NULL,
                               .block_valid = sc->use_valid ? vts.c : NULL, .inv_freq = fq.c,
                               .h_q_start = q_start, .h_pos = pos, .max_ctx = max_ctx};
    struct kvs_attn_meta mg = mc;
    mg.q_start = qs.g;
    mg.pos = ps.g;
    mg.block_tables = bts.g;
    mg.rot_offsets = sc->use_rot ? rts.g : NULL;
    mg.block_valid = sc->use_valid ? vts.g : NULL;
    mg.inv_freq = fq.g;
    const float scale = 1.0f / sqrtf((float)hd);
    const size_t pairs = (size_t)n * nkv, on = (size_t)n * nh * hd, ln = (size_t)n * nh;
    struct pair out = mk(KVS_BUF_ACT, on, NULL), lse = mk(KVS_BUF_F32, ln, NULL);

    /* 1. mixed span kinds: each (row, KV head) its own */
    struct spans mix = {.max_spans = sc->max_spans};
    mix.h_n = kvs_xcalloc(pairs, 4);
    mix.h_sp = kvs_xcalloc(pairs * mix.max_spans * 2, 4);
    int kinds_seen[SP_KINDS] = {0};
    for (int s = 0; s < S; s++)
        for (int t = q_start[s]; t < q_start[s + 1]; t++) {
            const int last = pos[s] + t - q_start[s];
            for (int g = 0; g < nkv; g++) {
                const size_t pr = (size_t)t * nkv + g;
                const int kind = (int)((pr + (size_t)irand(2)) % SP_KINDS);
                kinds_seen[kind]++;
                mix.h_n[pr] = draw_spans(kind, last, bs, mix.max_spans, mix.h_sp + pr * mix.max_spans * 2);
            }
        }
    spans_upload(&mix, pairs);
    poison(&out);
    poison(&lse);
    C->attention_spans(bc, q.c, kc.c, vc.c, &mc, &mix.lc, n, nh, nkv, hd, bs, scale, out.c, lse.c);
    G->attention_spans(bg, q.g, kc.g, vc.g, &mg, &mix.lg, n, nh, nkv, hd, bs, scale, out.g, lse.g);
    float *oc = dl_c(&out), *og = dl_g(&out), *lc = dl_c(&lse), *lg = dl_g(&lse);
    snprintf(what, sizeof what, "%s: spans mixed (empty %d one %d cross %d many %d past %d full %d pages %d) out",
             sc->name, kinds_seen[SP_EMPTY], kinds_seen[SP_ONE], kinds_seen[SP_CROSS], kinds_seen[SP_MANY],
             kinds_seen[SP_PAST], kinds_seen[SP_FULL], kinds_seen[SP_PAGES]);
    check_out(what, og, oc, on);
    snprintf(what, sizeof what, "%s: spans mixed lse", sc->name);
    check_lse(what, lg, lc, ln);
    /* rows with no key: out exactly 0 */
    {
        size_t bad = 0;
        for (size_t i = 0; i < ln; i++)
            if (lc[i] == -INFINITY)
                for (int d = 0; d < hd; d++) bad += og[i * hd + d] != 0.0f;
        snprintf(what, sizeof what, "%s: heads with no key give out = 0", sc->name);
        CHECK(bad == 0, "%s: %zu nonzero values", what, bad);
        printf("%s %s\n", bad ? "FAIL" : "ok  ", what);
    }
    /* the splits' merge of before (kvs_cuda_set_span_merge(1): serial loads) gives the staged
     * merge's bits */
    {
        poison(&out);
        poison(&lse);
        kvs_cuda_set_span_merge(1);
        G->attention_spans(bg, q.g, kc.g, vc.g, &mg, &mix.lg, n, nh, nkv, hd, bs, scale, out.g, lse.g);
        kvs_cuda_set_span_merge(0);
        float *os = dl_g(&out), *ls = dl_g(&lse);
        const int same = !memcmp(os, og, on * sizeof *os) && !memcmp(ls, lg, ln * sizeof *ls);
        snprintf(what, sizeof what, "%s: serial merge = staged merge, bitwise", sc->name);
        CHECK(same, "%s: differ", what);
        printf("%s %s\n", same ? "ok  " : "FAIL", what);
        free(os); free(ls);
    }
    /* kind 4 (two-pointer copies for tiles of two 16-key halves) gives kind 3's bits */
    if (cur_kind == 3) {
        poison(&out);
        poison(&lse);
        kvs_cuda_set_span_kernel(4, cur_min_tiles);
        G->attention_spans(bg, q.g, kc.g, vc.g, &mg, &mix.lg, n, nh, nkv, hd, bs, scale, out.g, lse.g);
        kvs_cuda_set_span_kernel(3, cur_min_tiles);
        float *os = dl_g(&out), *ls = dl_g(&lse);
        const int same = !memcmp(os, og, on * sizeof *os) && !memcmp(ls, lg, ln * sizeof *ls);
        snprintf(what, sizeof what, "%s: kind 4 = kind 3, bitwise", sc->name);
        CHECK(same, "%s: differ", what);
        printf("%s %s\n", same ? "ok  " : "FAIL", what);
        free(os); free(ls);
    }
    free(oc); free(og); free(lc); free(lg);

    /* 2. the halves of the mixed set (even and odd spans), merged, equal the whole set */
    {
        struct spans ha = {.max_spans = mix.max_spans}, hb = {.max_spans = mix.max_spans};
        ha.h_n = kvs_xcalloc(pairs, 4);
        hb.h_n = kvs_xcalloc(pairs, 4);
        ha.h_sp = kvs_xcalloc(pairs * mix.max_spans * 2, 4);
        hb.h_sp = kvs_xcalloc(pairs * mix.max_spans * 2, 4);
        for (size_t pr = 0; pr < pairs; pr++)
            for (int j = 0; j < mix.h_n[pr]; j++) {
                struct spans *h = j % 2 ? &hb : &ha;
                int32_t *dst = h->h_sp + (pr * mix.max_spans + (size_t)h->h_n[pr]++) * 2;
                dst[0] = mix.h_sp[(pr * mix.max_spans + j) * 2];
                dst[1] = mix.h_sp[(pr * mix.max_spans + j) * 2 + 1];
            }
        spans_upload(&ha, pairs);
        spans_upload(&hb, pairs);
        struct pair ob = mk(KVS_BUF_ACT, on, NULL), lb = mk(KVS_BUF_F32, ln, NULL);
        poison(&out);
        poison(&lse);
        G->attention_spans(bg, q.g, kc.g, vc.g, &mg, &ha.lg, n, nh, nkv, hd, bs, scale, out.g, lse.g);
        G->attention_spans(bg, q.g, kc.g, vc.g, &mg, &hb.lg, n, nh, nkv, hd, bs, scale, ob.g, lb.g);
        G->attn_merge(bg, out.g, lse.g, ob.g, lb.g, n, nh, hd);
        C->attention_spans(bc, q.c, kc.c, vc.c, &mc, &mix.lc, n, nh, nkv, hd, bs, scale, out.c, lse.c);
        float *o1 = dl_c(&out), *o2 = dl_g(&out), *l1 = dl_c(&lse), *l2 = dl_g(&lse);
        snprintf(what, sizeof what, "%s: even + odd spans merged (cuda) vs whole (cpu) out", sc->name);
        check_out(what, o2, o1, on);
        snprintf(what, sizeof what, "%s: even + odd spans merged (cuda) vs whole (cpu) lse", sc->name);
        check_lse(what, l2, l1, ln);
        free(o1); free(o2); free(l1); free(l2);
        drop(&ob);
        drop(&lb);
        spans_free(&ha);
        spans_free(&hb);
    }
    spans_free(&mix);

    /* 3. one full span per (row, KV head) = attention() (both backends), plus its lse */
    {
        struct spans full = {.max_spans = 1};
        full.h_n = kvs_xmalloc(pairs * 4);
        full.h_sp = kvs_xmalloc(pairs * 2 * 4);
        for (int s = 0; s < S; s++)
            for (int t = q_start[s]; t < q_start[s + 1]; t++)
                for (int g = 0; g < nkv; g++) {
                    const size_t pr = (size_t)t * nkv + g;
                    full.h_n[pr] = 1;
                    full.h_sp[2 * pr] = 0;
                    full.h_sp[2 * pr + 1] = pos[s] + t - q_start[s] + 1;
                }
        spans_upload(&full, pairs);
        struct pair att = mk(KVS_BUF_ACT, on, NULL);
        poison(&out);
        poison(&lse);
        C->attention_spans(bc, q.c, kc.c, vc.c, &mc, &full.lc, n, nh, nkv, hd, bs, scale, out.c, lse.c);
        G->attention_spans(bg, q.g, kc.g, vc.g, &mg, &full.lg, n, nh, nkv, hd, bs, scale, out.g, lse.g);
        C->attention(bc, q.c, kc.c, vc.c, &mc, n, nh, nkv, hd, bs, scale, att.c);
        G->attention(bg, q.g, kc.g, vc.g, &mg, n, nh, nkv, hd, bs, scale, att.g);
        float *oc2 = dl_c(&out), *og2 = dl_g(&out), *lc2 = dl_c(&lse), *lg2 = dl_g(&lse);
        float *ac = dl_c(&att), *ag = dl_g(&att);
        snprintf(what, sizeof what, "%s: full span vs cpu attention_spans out", sc->name);
        check_out(what, og2, oc2, on);
        snprintf(what, sizeof what, "%s: full span vs cpu attention_spans lse", sc->name);
        check_lse(what, lg2, lc2, ln);
        snprintf(what, sizeof what, "%s: full span vs cpu attention()", sc->name);
        check_out(what, og2, ac, on);
        snprintf(what, sizeof what, "%s: full span vs cuda attention()", sc->name);
        check_out(what, og2, ag, on);
        free(oc2); free(og2); free(lc2); free(lg2); free(ac); free(ag);
        drop(&att);
        spans_free(&full);
    }

    drop(&out); drop(&lse); drop(&q); drop(&qs); drop(&ps); drop(&bts); drop(&rts); drop(&vts); drop(&fq);
    drop(&kc); drop(&vc);
    free(perm); free(bt); free(rot); free(valid); free(readable); free(kv); free(vv); free(qv); free(inv);
}

/* attn_merge alone on random partials: finite on both sides, -inf on one side (its o holds
 * garbage: a zero weight must not multiply it), -inf on both (out 0, lse -inf) */
static void test_merge(int n, int nh, int hd)
{
    char what[160];
    const size_t on = (size_t)n * nh * hd, ln = (size_t)n * nh;
    float *oa = kvs_xmalloc(on * 4), *ob = kvs_xmalloc(on * 4), *la = kvs_xmalloc(ln * 4), *lb = kvs_xmalloc(ln * 4);
    int cases[4] = {0};
    for (size_t i = 0; i < ln; i++) {
        const int k = irand(4);
        cases[k]++;
        la[i] = k == 1 || k == 3 ? -INFINITY : 4.0f * frand();
        lb[i] = k == 2 || k == 3 ? -INFINITY : 4.0f * frand() + (irand(4) == 0 ? 30.0f : 0.0f);
        for (int d = 0; d < hd; d++) {
            oa[i * hd + d] = la[i] == -INFINITY ? 0.0f : frand();
            ob[i * hd + d] = lb[i] == -INFINITY ? 0.0f : frand();
        }
    }
    struct pair pa = mk(KVS_BUF_ACT, on, oa), pb = mk(KVS_BUF_ACT, on, ob);
    struct pair qa = mk(KVS_BUF_F32, ln, la), qb = mk(KVS_BUF_F32, ln, lb);
    C->attn_merge(bc, pa.c, qa.c, pb.c, qb.c, n, nh, hd);
    G->attn_merge(bg, pa.g, qa.g, pb.g, qb.g, n, nh, hd);
    float *o1 = dl_c(&pa), *o2 = dl_g(&pa), *l1 = dl_c(&qa), *l2 = dl_g(&qa);
    snprintf(what, sizeof what, "attn_merge rows=%d heads=%d hd=%d (both %d, a -inf %d, b -inf %d, both -inf %d) out",
             n, nh, hd, cases[0], cases[1], cases[2], cases[3]);
    check_out(what, o2, o1, on);
    snprintf(what, sizeof what, "attn_merge rows=%d heads=%d hd=%d lse", n, nh, hd);
    check_lse(what, l2, l1, ln);
    free(o1); free(o2); free(l1); free(l2); free(oa); free(ob); free(la); free(lb);
    drop(&pa); drop(&pb); drop(&qa); drop(&qb);
}

int main(void)
{
    if (cuda_pair_open(2)) return 1;
    REQUIRE(C->attention_spans && C->attn_merge, "the CPU backend has no attention_spans / attn_merge (the reference)");
    REQUIRE(G->attention_spans && G->attn_merge, "the CUDA backend has no attention_spans / attn_merge");
    static const struct span_case cases[] = {
        /* name, heads, kv heads, hd, bs, seqs, pos, ntok, rot, valid, max_spans */
        {"G1 hd64 bs16", 8, 8, 64, 16, 2, {300, 40}, {1, 1}, 0, 0, 24},
        {"G4 hd128 bs16 rot", 32, 8, 128, 16, 3, {1000, 0, 77}, {1, 5, 1}, 1, 0, 40},
        {"G8 hd128 bs16 rot valid", 32, 4, 128, 16, 2, {2100, 513}, {1, 3}, 1, 1, 64},
        {"G4 hd64 bs8 valid", 16, 4, 64, 8, 3, {700, 33, 0}, {1, 1, 9}, 0, 1, 32},
        {"G8 hd64 bs24 rot valid", 16, 2, 64, 24, 2, {1500, 90}, {2, 1}, 1, 1, 48},
        {"G1 hd128 bs16 rot valid", 4, 4, 128, 16, 2, {900, 0}, {1, 33}, 1, 1, 16},
        /* one decode row over a long context: many splits, merged */
        {"G8 hd128 bs16 long 40K", 32, 4, 128, 16, 1, {40000}, {1}, 0, 0, 256},
        {"G4 hd128 bs16 rot long 20K", 32, 8, 128, 16, 1, {20000}, {1}, 1, 1, 128},
    };
    /* every kind of attention_spans (kvs_cuda_set_span_kernel), the third and fourth also at one
     * tile a split (the most splits a walk is cut into: every split's start found by the indexed
     * seek); kind 4 also bitwise against kind 3 under each of kind 3's entries (test_case) */
    static const int kinds[][2] = {{1, 0}, {2, 0}, {3, 0}, {3, 1}, {4, 0}, {4, 1}};
    for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++) {
        kvs_cuda_set_span_kernel(kinds[k][0], kinds[k][1]);
        cur_kind = kinds[k][0];
        cur_min_tiles = kinds[k][1];
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
            struct span_case c = cases[i];
            char name[96];
            snprintf(name, sizeof name, "%s [kind %d, min tiles %d]", c.name, kinds[k][0], kinds[k][1]);
            c.name = name;
            test_case(&c);
        }
    }
    kvs_cuda_set_span_kernel(0, 0);
    test_merge(37, 8, 64);
    test_merge(5, 32, 128);
    G->free(bg);
    C->free(bc);
    return kvs_test_summary("test_cuda_span");
}

#else
int main(void)
{
    fprintf(stderr, "test_cuda_span: built without CUDA (nvcc not found)\n");
    return 1;
}
#endif
