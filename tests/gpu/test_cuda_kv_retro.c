/* test_cuda_kv_retro.c: kv.decode=retro (engine/kv/kv_decode_retro.c) on the CUDA backend, against
 * the CPU reference, on fresh random inputs each run (seed from the clock, printed; replay with
 * KVS_SEED=<seed>).
 *   step      one Retro step of several requests with windows of w = 1..8 rows over a random
 *             paged cache: the newest row over a random page selection, each past row over its
 *             supplement (kernels/kv_retro.h: the mask after a few earlier random selections;
 *             empty supplements included), one attention_spans call for every row, then
 *             attn_merge with random cached (o, lse) (newest rows: a zero row and lse -inf),
 *             as the policy runs it: CUDA out / lse against the CPU's (relative L2 < 1e-2, lse
 *             within 1e-2: bf16 K/V and q); rows with an empty supplement keep their cached
 *             output (within bf16 rounding);
 *   score     Quest's scores of the windows' newest rows read in place (q_start's last row of each
 *             sequence) equal those of the rows gathered (CUDA and CPU, bitwise; 16 and 8 bits;
 *             the fused select asked for too), CUDA within 1e-5 of the CPU;
 *   engine    the tiny Llama on device cuda: retro w = 1 gives quest's greedy tokens; retro at
 *             budget >= context (w = 2, 4) gives full attention's for most requests (bf16
 *             rounding of the re-run rows may flip a near-tie); at a small budget (w = 2) every
 *             request is served, supplements happen and the effective budget is > 1;
 *   exact     the demo model one request at a time: retro at budget >= context (w = 2, 4;
 *             dense layers 0 and 2) gives full attention's tokens for all requests but at most
 *             one (full's one-row GEMMs take another kernel than Retro's w-row ones).
 * Needs a GPU: exits 1 with a message when none. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/half.h"
#include "base/util.h"
#include "kernels/backend.h"
#include "kernels/kv_quest.h"
#include "kernels/kv_retro.h"
#include "tests/unit/test_util.h"

#if defined(KVS_HAVE_CUDA) && KVS_HAVE_CUDA
#include "engine/config.h"
#include "engine/engine.h"
#include "kernels/cuda/cuda_backend.h"
#include "models/model.h"

static const struct kvs_backend_ops *C = &kvs_cpu_backend, *G = &kvs_cuda_backend;
static struct kvs_backend *bc, *bg;

#define NH 8
#define NKV 2
#define HD 64
#define BS 16
#define NS 6
#define MAXW 8
#define MAXCTX 4096
#define MB (MAXCTX / BS)
#define MS MB

static uint64_t rng;
static float frand(void) { return (float)((double)kvs_test_xorshift(&rng) / 4294967296.0 * 2.0 - 1.0); }

static double rel_l2(const float *a, const float *b, size_t n)
{
    double d = 0, r = 0;
    for (size_t i = 0; i < n; i++) d += ((double)a[i] - b[i]) * ((double)a[i] - b[i]), r += (double)b[i] * b[i];
    return r > 0 ? sqrt(d / r) : sqrt(d);
}

/* one backend's run of the step: uploads, spans, merge, downloads */
struct step_in {
    int n_rows;
    int32_t qs[NS + 1], pos[NS], bt[NS * MB];
    float *q, *k, *v, *oc, *lc;              /* q [n][NH][HD], cache, cached o / lse [n] */
    int32_t *n_sp, *sp;                      /* [n][NKV], [n][NKV][MS][2] */
    size_t n_kv;
};

static void run_step(const struct kvs_backend_ops *o, struct kvs_backend *b, const struct step_in *x, float *out,
                     float *lse)
{
    const size_t n = (size_t)x->n_rows, qd = NH * HD;
    struct kvs_dbuf *q = o->alloc(b, KVS_BUF_ACT, n * qd), *kc = o->alloc(b, KVS_BUF_KV, x->n_kv);
    struct kvs_dbuf *vc = o->alloc(b, KVS_BUF_KV, x->n_kv), *ob = o->alloc(b, KVS_BUF_ACT, n * qd);
    struct kvs_dbuf *lb = o->alloc(b, KVS_BUF_F32, n * NH), *d_out = o->alloc(b, KVS_BUF_ACT, n * qd);
    struct kvs_dbuf *d_lse = o->alloc(b, KVS_BUF_F32, n * NH), *qs = o->alloc(b, KVS_BUF_I32, NS + 1);
    struct kvs_dbuf *pos = o->alloc(b, KVS_BUF_I32, NS), *bt = o->alloc(b, KVS_BUF_I32, NS * MB);
    struct kvs_dbuf *nsp = o->alloc(b, KVS_BUF_I32, n * NKV), *sp = o->alloc(b, KVS_BUF_I32, n * NKV * MS * 2);
    REQUIRE(q && kc && vc && ob && lb && d_out && d_lse && qs && pos && bt && nsp && sp, "alloc");
    o->upload(b, q, 0, x->q, n * qd);
    o->upload(b, kc, 0, x->k, x->n_kv);
    o->upload(b, vc, 0, x->v, x->n_kv);
    o->upload(b, ob, 0, x->oc, n * qd);
    o->upload(b, lb, 0, x->lc, n * NH);
    o->upload(b, qs, 0, x->qs, NS + 1);
    o->upload(b, pos, 0, x->pos, NS);
    o->upload(b, bt, 0, x->bt, NS * MB);
    o->upload(b, nsp, 0, x->n_sp, n * NKV);
    o->upload(b, sp, 0, x->sp, n * NKV * MS * 2);
    int max_ctx = 0;
    for (int s = 0; s < NS; s++) max_ctx = x->pos[s] + x->qs[s + 1] - x->qs[s] > max_ctx ? x->pos[s] + x->qs[s + 1] - x->qs[s] : max_ctx;
    const struct kvs_attn_meta m = {.n_seqs = NS, .max_blocks = MB, .q_start = qs, .pos = pos, .block_tables = bt,
                                    .h_q_start = x->qs, .h_pos = x->pos, .max_ctx = max_ctx};
    const struct kvs_span_list sl = {MS, nsp, sp, x->n_sp, x->sp};
    o->attention_spans(b, q, kc, vc, &m, &sl, (int)n, NH, NKV, HD, BS, 1.0f / sqrtf((float)HD), d_out, d_lse);
    o->attn_merge(b, d_out, d_lse, ob, lb, (int)n, NH, HD);
    o->download(b, out, d_out, 0, n * qd);
    o->download(b, lse, d_lse, 0, n * NH);
    struct kvs_dbuf *bs[] = {q, kc, vc, ob, lb, d_out, d_lse, qs, pos, bt, nsp, sp};
    for (size_t i = 0; i < sizeof bs / sizeof bs[0]; i++) o->free_buf(b, bs[i]);
}

static void test_step(int round)
{
    struct step_in x;
    memset(&x, 0, sizeof x);
    const int n_blocks = NS * MB;
    x.n_kv = (size_t)n_blocks * NKV * BS * HD;
    x.k = kvs_xmalloc(x.n_kv * sizeof(float));
    x.v = kvs_xmalloc(x.n_kv * sizeof(float));
    for (size_t i = 0; i < x.n_kv; i++) x.k[i] = frand(), x.v[i] = frand();
    int perm[NS * MB];
    for (int i = 0; i < n_blocks; i++) perm[i] = i;
    for (int i = n_blocks - 1; i > 0; i--) {
        const int j = (int)(kvs_test_xorshift(&rng) % (uint32_t)(i + 1)), t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }
    int w[NS], newest[NS];
    x.qs[0] = 0;
    for (int s = 0; s < NS; s++) {
        w[s] = 1 + (int)(kvs_test_xorshift(&rng) % MAXW);
        newest[s] = 300 + (int)(kvs_test_xorshift(&rng) % (MAXCTX - 301));
        x.pos[s] = newest[s] - (w[s] - 1);
        x.qs[s + 1] = x.qs[s] + w[s];
        for (int j = 0; j < MB; j++) x.bt[s * MB + j] = perm[s * MB + j];
    }
    const int n = x.qs[NS];
    x.n_rows = n;
    x.q = kvs_xmalloc((size_t)n * NH * HD * sizeof(float));
    x.oc = kvs_xcalloc((size_t)n * NH * HD, sizeof(float));
    x.lc = kvs_xmalloc((size_t)n * NH * sizeof(float));
    x.n_sp = kvs_xcalloc((size_t)n * NKV, sizeof(int32_t));
    x.sp = kvs_xcalloc((size_t)n * NKV * MS * 2, sizeof(int32_t));
    for (int i = 0; i < n * NH * HD; i++) x.q[i] = 2 * frand();
    int empty_rows = 0, sup_rows = 0;
    static int32_t A[MB], M[MB], sel[MB];
    for (int s = 0; s < NS; s++) {
        const int t = 20, cur = newest[s] / BS;   /* the newest query is step t of its request */
        for (int g = 0; g < NKV; g++) {
            /* earlier steps' random selections build the mask */
            for (int p = 0; p < MB; p++) A[p] = -1;
            for (int tp = 0; tp <= t; tp++) {
                const int c = (newest[s] - (t - tp)) / BS;
                int ns = 0;
                for (int p = 0; p < c; p++)
                    if (kvs_test_xorshift(&rng) % 8 == 0) sel[ns++] = p;
                sel[ns++] = c;
                REQUIRE(kvs_retro_mask_step(A, MB, sel, ns, c, tp, M) == 0, "mask");
                if (tp < t) continue;
                /* the newest row: its selection as spans */
                const size_t tn = (size_t)(x.qs[s] + w[s] - 1) * NKV + g;
                int32_t *sp = x.sp + tn * MS * 2;
                int k = 0;
                for (int i = 0; i < ns; i++) {
                    const int lo = sel[i] * BS, hi = lo + BS < newest[s] + 1 ? lo + BS : newest[s] + 1;
                    if (k && sp[2 * k - 1] == lo) sp[2 * k - 1] = hi;
                    else sp[2 * k] = lo, sp[2 * k + 1] = hi, k++;
                }
                x.n_sp[tn] = k;
                (void)cur;
                for (int j = 0; j < w[s] - 1; j++) {
                    const int back = w[s] - 1 - j;
                    const size_t tpr = (size_t)(x.qs[s] + j) * NKV + g;
                    const int m = kvs_retro_supplement(sel, M, ns, t - back, newest[s] - back, BS,
                                                       x.sp + tpr * MS * 2, MS);
                    REQUIRE(m >= 0, "supplement");
                    x.n_sp[tpr] = m;
                }
            }
        }
        for (int j = 0; j < w[s]; j++) {
            const int row = x.qs[s] + j, past = j < w[s] - 1;
            int any = 0;
            for (int g = 0; g < NKV; g++) any |= x.n_sp[(size_t)row * NKV + g] > 0;
            if (past) {
                empty_rows += !any;
                sup_rows += any;
                for (int i = 0; i < NH * HD; i++) x.oc[(size_t)row * NH * HD + i] = frand();
                for (int h = 0; h < NH; h++) x.lc[row * NH + h] = 3 * frand() + 2;
            } else {
                for (int h = 0; h < NH; h++) x.lc[row * NH + h] = -INFINITY;
            }
        }
    }
    float *oc = kvs_xmalloc((size_t)n * NH * HD * sizeof(float)), *og = kvs_xmalloc((size_t)n * NH * HD * sizeof(float));
    float *lcp = kvs_xmalloc((size_t)n * NH * sizeof(float)), *lg = kvs_xmalloc((size_t)n * NH * sizeof(float));
    run_step(C, bc, &x, oc, lcp);
    run_step(G, bg, &x, og, lg);
    double worst = 0, worst_lse = 0, worst_keep = 0;
    for (int r = 0; r < n; r++) {
        const double e = rel_l2(og + (size_t)r * NH * HD, oc + (size_t)r * NH * HD, NH * HD);
        worst = e > worst || e != e ? e : worst;
        for (int h = 0; h < NH; h++) {
            const double a = lcp[r * NH + h], b = lg[r * NH + h];
            const double d = fabs(a - b) / (fabs(a) > 1 ? fabs(a) : 1);
            worst_lse = d > worst_lse || d != d ? d : worst_lse;
        }
        int any = 0;
        for (int g = 0; g < NKV; g++) any |= x.n_sp[(size_t)r * NKV + g] > 0;
        if (!any) {   /* an empty supplement: the cached output comes back */
            const double k = rel_l2(og + (size_t)r * NH * HD, x.oc + (size_t)r * NH * HD, NH * HD);
            worst_keep = k > worst_keep || k != k ? k : worst_keep;
        }
    }
    CHECK(worst < 1e-2 && worst_lse < 1e-2 && worst_keep < 1e-2,
          "round %d: cuda vs cpu out rel-L2 %.3g, lse %.3g, kept cache %.3g", round, worst, worst_lse, worst_keep);
    printf("ok retro step %d on cuda (%d rows, %d supplemented past rows, %d empty): out rel-L2 %.2e, lse %.2e, "
           "kept cache %.2e vs cpu\n", round, n, sup_rows, empty_rows, worst, worst_lse, worst_keep);
    free(x.k), free(x.v), free(x.q), free(x.oc), free(x.lc), free(x.n_sp), free(x.sp);
    free(oc), free(og), free(lcp), free(lg);
}

/* ---- the device table (kernels/kv_retro.h): CUDA against the CPU's ----------------------------- */

#define TQ 5        /* requests a step */
#define TSLOTS 7
#define TLAYERS 2
#define TPS 16
#define TPAGES 512  /* max pages: contexts up to 8192 */
#define TMS TPAGES

/* a Quest-format selection for a row at pos: random full pages (density 1/dens) plus the current
 * one, as merged spans, the last ending at pos + 1 */
static int rand_selection(int pos, int dens, int32_t *sp)
{
    const int cur = pos / TPS;
    int n = 0;
    for (int p = 0; p <= cur; p++) {
        if (p < cur && kvs_test_xorshift(&rng) % (uint32_t)dens) continue;
        const int lo = p * TPS, hi = p == cur ? pos + 1 : lo + TPS;
        if (n && sp[2 * n - 1] == lo) sp[2 * n - 1] = hi;
        else sp[2 * n] = lo, sp[2 * n + 1] = hi, n++;
    }
    return n;
}

static void test_table(void)
{
    const struct kvs_retro_kernels *kc = kvs_retro_kernels_for(C), *kg = kvs_retro_kernels_for(G);
    REQUIRE(kc && kg && kg != kc, "no retro tables");
    const size_t a_n = (size_t)TSLOTS * TLAYERS * NKV * TPAGES, nsp = (size_t)TQ * MAXW * NKV;
    const size_t nspans = nsp * TMS * 2, nsel = (size_t)TQ * NKV * TMS * 2;
    struct kvs_dbuf *cA = C->alloc(bc, KVS_BUF_I32, a_n), *gA = G->alloc(bg, KVS_BUF_I32, a_n);
    struct kvs_dbuf *cn = C->alloc(bc, KVS_BUF_I32, nsp), *gn = G->alloc(bg, KVS_BUF_I32, nsp);
    struct kvs_dbuf *cs = C->alloc(bc, KVS_BUF_I32, nspans), *gs = G->alloc(bg, KVS_BUF_I32, nspans);
    struct kvs_dbuf *csn = C->alloc(bc, KVS_BUF_I32, TQ * NKV), *gsn = G->alloc(bg, KVS_BUF_I32, TQ * NKV);
    struct kvs_dbuf *csel = C->alloc(bc, KVS_BUF_I32, nsel), *gsel = G->alloc(bg, KVS_BUF_I32, nsel);
    struct kvs_dbuf *creq = C->alloc(bc, KVS_BUF_I32, TQ * 5), *greq = G->alloc(bg, KVS_BUF_I32, TQ * 5);
    struct kvs_dbuf *ck = C->alloc(bc, KVS_BUF_I32, 4), *gk = G->alloc(bg, KVS_BUF_I32, 4);
    REQUIRE(cA && gA && cn && gn && cs && gs && csn && gsn && csel && gsel && creq && greq && ck && gk, "alloc");
    kc->reset(bc, cA, 0, a_n);
    kg->reset(bg, gA, 0, a_n);
    C->zero(bc, ck, 0, 4);
    G->zero(bg, gk, 0, 4);
    int32_t *hsn = kvs_xcalloc(TQ * NKV, 4), *hsel = kvs_xcalloc(nsel, 4), req[TQ * 5];
    int32_t *n1 = kvs_xmalloc(nsp * 4), *n2 = kvs_xmalloc(nsp * 4), *s1 = kvs_xmalloc(nspans * 4);
    int32_t *s2 = kvs_xmalloc(nspans * 4), *A1 = kvs_xmalloc(a_n * 4), *A2 = kvs_xmalloc(a_n * 4);
    int pos[TSLOTS], t[TSLOTS];
    for (int i = 0; i < TSLOTS; i++) pos[i] = 64 + (int)(kvs_test_xorshift(&rng) % 6000), t[i] = 0;
    int bad = 0, sup_rows = 0, rows_all = 0;
    for (int step = 0; step < 40 && !bad; step++) {
        /* TQ distinct slots; a slot sometimes restarts (reset), sometimes jumps ahead */
        int used[TSLOTS] = {0}, row0 = 0;
        for (int q = 0; q < TQ; q++) {
            int slot;
            do slot = (int)(kvs_test_xorshift(&rng) % TSLOTS); while (used[slot]);
            used[slot] = 1;
            if (kvs_test_xorshift(&rng) % 16 == 0) {
                kc->reset(bc, cA, (size_t)slot * TLAYERS * NKV * TPAGES, (size_t)TLAYERS * NKV * TPAGES);
                kg->reset(bg, gA, (size_t)slot * TLAYERS * NKV * TPAGES, (size_t)TLAYERS * NKV * TPAGES);
                t[slot] = 0;
            }
            pos[slot] += 1 + (kvs_test_xorshift(&rng) % 8 == 0 ? (int)(kvs_test_xorshift(&rng) % 40) : 0);
            if (pos[slot] >= TPAGES * TPS - 1) pos[slot] = 64 + (int)(kvs_test_xorshift(&rng) % 64);
            const int rows = 1 + (int)(kvs_test_xorshift(&rng) % (uint32_t)(t[slot] < MAXW - 1 ? t[slot] + 1 : MAXW));
            req[5 * q] = row0, req[5 * q + 1] = rows, req[5 * q + 2] = pos[slot], req[5 * q + 3] = t[slot]++;
            req[5 * q + 4] = slot;
            row0 += rows;
            const int dens = 2 + (int)(kvs_test_xorshift(&rng) % 8);
            for (int g = 0; g < NKV; g++)
                hsn[q * NKV + g] = rand_selection(pos[slot], dens, hsel + ((size_t)q * NKV + g) * TMS * 2);
        }
        const int layer = (int)(kvs_test_xorshift(&rng) % TLAYERS);
        C->upload(bc, csn, 0, hsn, TQ * NKV), G->upload(bg, gsn, 0, hsn, TQ * NKV);
        C->upload(bc, csel, 0, hsel, nsel), G->upload(bg, gsel, 0, hsel, nsel);
        C->upload(bc, creq, 0, req, TQ * 5), G->upload(bg, greq, 0, req, TQ * 5);
        kc->spans(bc, csn, csel, creq, TQ, NKV, TMS, TPS, cA, TLAYERS, layer, TPAGES, cn, cs, ck, NULL);
        kg->spans(bg, gsn, gsel, greq, TQ, NKV, TMS, TPS, gA, TLAYERS, layer, TPAGES, gn, gs, gk, NULL);
        C->download(bc, n1, cn, 0, (size_t)row0 * NKV), G->download(bg, n2, gn, 0, (size_t)row0 * NKV);
        C->download(bc, s1, cs, 0, nspans), G->download(bg, s2, gs, 0, nspans);
        for (int r = 0; r < row0 * NKV && !bad; r++) {
            bad |= n1[r] != n2[r] || memcmp(s1 + (size_t)r * TMS * 2, s2 + (size_t)r * TMS * 2, (size_t)n1[r] * 8);
            sup_rows += n1[r] > 0;
            if (bad) fprintf(stderr, "step %d pair %d: %d spans (cpu) vs %d (cuda)\n", step, r, n1[r], n2[r]);
        }
        rows_all += row0 * NKV;
    }
    C->download(bc, A1, cA, 0, a_n), G->download(bg, A2, gA, 0, a_n);
    uint64_t k1[2], k2[2];
    C->download(bc, k1, ck, 0, 4), G->download(bg, k2, gk, 0, 4);
    CHECK(!bad && !memcmp(A1, A2, a_n * 4) && k1[0] == k2[0] && k1[1] == k2[1] && k1[1] > 0,
          "retro spans table: cuda differs from cpu (spans %d, masks %d, keys %llu/%llu vs %llu/%llu)", bad,
          memcmp(A1, A2, a_n * 4) != 0, (unsigned long long)k2[0], (unsigned long long)k2[1],
          (unsigned long long)k1[0], (unsigned long long)k1[1]);
    printf("ok retro spans table on cuda = cpu over 40 random steps (%d (row, head) span lists, %d non-empty; masks "
           "and keys %llu own / %llu supplement equal)\n", rows_all, sup_rows, (unsigned long long)k1[0],
           (unsigned long long)k1[1]);

    /* merge: random partials, some rows without a cached entry, against the CPU table */
    const int n = 23, prev = 19, qd = NH * HD;
    float *o = kvs_xmalloc((size_t)n * qd * 4), *l = kvs_xmalloc((size_t)n * NH * 4);
    float *op = kvs_xmalloc((size_t)prev * qd * 4), *lp = kvs_xmalloc((size_t)prev * NH * 4);
    int32_t ci[23];
    for (int i = 0; i < n * qd; i++) o[i] = frand();
    for (int i = 0; i < prev * qd; i++) op[i] = frand();
    for (int i = 0; i < n * NH; i++) l[i] = i % 7 == 0 ? -INFINITY : 4 * frand();
    for (int i = 0; i < prev * NH; i++) lp[i] = i % 5 == 0 ? -INFINITY : 4 * frand();
    for (int i = 0; i < n; i++) ci[i] = i % 4 == 3 ? prev : (int)(kvs_test_xorshift(&rng) % prev);
    float *ro[2], *rl[2], *rn[2], *rln[2];
    for (int k = 0; k < 2; k++) {
        const struct kvs_backend_ops *B = k ? G : C;
        struct kvs_backend *bb = k ? bg : bc;
        const struct kvs_retro_kernels *T = k ? kg : kc;
        struct kvs_dbuf *d_o = B->alloc(bb, KVS_BUF_ACT, (size_t)n * qd), *d_l = B->alloc(bb, KVS_BUF_F32, (size_t)n * NH);
        struct kvs_dbuf *d_op = B->alloc(bb, KVS_BUF_ACT, (size_t)prev * qd);
        struct kvs_dbuf *d_lp = B->alloc(bb, KVS_BUF_F32, (size_t)prev * NH), *d_ci = B->alloc(bb, KVS_BUF_I32, n);
        struct kvs_dbuf *d_on = B->alloc(bb, KVS_BUF_ACT, (size_t)n * qd), *d_ln = B->alloc(bb, KVS_BUF_F32, (size_t)n * NH);
        REQUIRE(d_o && d_l && d_op && d_lp && d_ci && d_on && d_ln, "alloc");
        B->upload(bb, d_o, 0, o, (size_t)n * qd), B->upload(bb, d_l, 0, l, (size_t)n * NH);
        B->upload(bb, d_op, 0, op, (size_t)prev * qd), B->upload(bb, d_lp, 0, lp, (size_t)prev * NH);
        B->upload(bb, d_ci, 0, ci, n);
        T->merge(bb, d_o, d_l, d_ci, n, NH, HD, d_op, d_lp, prev, d_on, d_ln);
        ro[k] = kvs_xmalloc((size_t)n * qd * 4), rn[k] = kvs_xmalloc((size_t)n * qd * 4);
        rl[k] = kvs_xmalloc((size_t)n * NH * 4), rln[k] = kvs_xmalloc((size_t)n * NH * 4);
        B->download(bb, ro[k], d_o, 0, (size_t)n * qd), B->download(bb, rn[k], d_on, 0, (size_t)n * qd);
        B->download(bb, rl[k], d_l, 0, (size_t)n * NH), B->download(bb, rln[k], d_ln, 0, (size_t)n * NH);
        struct kvs_dbuf *bs[] = {d_o, d_l, d_op, d_lp, d_ci, d_on, d_ln};
        for (size_t i = 0; i < sizeof bs / sizeof bs[0]; i++) B->free_buf(bb, bs[i]);
    }
    double eo = 0, el = 0;
    int same_next = !memcmp(ro[1], rn[1], (size_t)n * qd * 4) && !memcmp(rl[1], rln[1], (size_t)n * NH * 4);
    for (int i = 0; i < n * qd; i++) eo = fmax(eo, fabs((double)ro[0][i] - ro[1][i]));
    for (int i = 0; i < n * NH; i++)
        el = isinf(rl[0][i]) || isinf(rl[1][i]) ? (rl[0][i] == rl[1][i] ? el : INFINITY)
                                                : fmax(el, fabs((double)rl[0][i] - rl[1][i]));
    CHECK(eo < 1e-5 && el < 1e-5 && same_next, "retro merge table: cuda vs cpu out %.3g, lse %.3g, next cache %s", eo,
          el, same_next ? "ok" : "differs");
    printf("ok retro merge table on cuda (%d rows, %d without a cached entry): out within %.2e, lse within %.2e of the "
           "cpu; next cache = merged rows\n", n, n / 4, eo, el);
    for (int k = 0; k < 2; k++) free(ro[k]), free(rl[k]), free(rn[k]), free(rln[k]);
    free(o), free(l), free(op), free(lp);
    free(hsn), free(hsel), free(n1), free(n2), free(s1), free(s2), free(A1), free(A2);
    struct kvs_dbuf *cb[] = {cA, cn, cs, csn, csel, creq, ck}, *gb[] = {gA, gn, gs, gsn, gsel, greq, gk};
    for (int i = 0; i < 7; i++) C->free_buf(bc, cb[i]), G->free_buf(bg, gb[i]);
}

/* The fused attention (the table's attend) against the CPU: the CPU table's spans (selection for
 * the newest row, supplements for the past rows, after a few earlier random steps built the
 * masks) through the CPU attention_spans, vs the CUDA table's spans (its M) and attend. */
/* Quest's scores of Retro's windows (kv_quest.h score: sequence s is scored with q's row
 * q_start[s + 1] - 1, so the policy needs no gather of the newest rows): with the windows' meta
 * (several rows a sequence, pos = the newest row's position) CUDA's score_select gives bitwise
 * the scores and spans that it gives on the newest rows gathered into one-row sequences, on the
 * default path and with the fused kernel asked for (which a window meta must route to the score
 * kernels), and the CPU's scores on the window meta are bitwise its own on the gathered rows and
 * within 1e-5 (of the bound's magnitude) of CUDA's. bits: 16 (bf16 digests) or 8. */
static void test_score_rows(int bits)
{
    const int n_pages = NS * MB, qd = NH * HD;
    const size_t n_kv = (size_t)NS * MB * NKV * BS * HD;
    const size_t ndig = bits < 16 ? kvs_quest_qdig_words((size_t)n_pages, NKV, HD, bits) : (size_t)n_pages * NKV * 2 * HD;
    const enum kvs_buf_kind dk = bits < 16 ? KVS_BUF_I32 : KVS_BUF_KV;
    const struct kvs_quest_kernels *K[2] = {&kvs_quest_kernels_cpu, &kvs_quest_kernels_cuda};
    const struct kvs_backend_ops *O[2] = {C, G};
    struct kvs_backend *B[2] = {bc, bg};
    int32_t qs[NS + 1], newest[NS], keep[NS], one[NS + 1], bt[NS * MB];
    qs[0] = 0, one[0] = 0;
    for (int s = 0; s < NS; s++) {
        const int w = 1 + (int)(kvs_test_xorshift(&rng) % MAXW);
        newest[s] = 64 + (int)(kvs_test_xorshift(&rng) % (MAXCTX - 65));
        qs[s + 1] = qs[s] + w;
        one[s + 1] = s + 1;
        const int cur = newest[s] / BS, kp = (int)ceil(fmax(48.0, ceil(0.15 * (newest[s] + 1))) / BS);
        keep[s] = s == 2 ? cur + 1 : kp > cur + 1 ? cur + 1 : kp;   /* one row keeps every page */
    }
    for (int i = 0; i < NS * MB; i++) bt[i] = i;
    for (int i = NS * MB - 1; i > 0; i--) {
        const int j = (int)(kvs_test_xorshift(&rng) % (uint32_t)(i + 1)), x = bt[i];
        bt[i] = bt[j], bt[j] = x;
    }
    const int n = qs[NS];
    float *k = kvs_xmalloc(n_kv * 4), *q = kvs_xmalloc((size_t)n * qd * 4), *qn = kvs_xmalloc((size_t)NS * qd * 4);
    for (size_t i = 0; i < n_kv; i++) k[i] = kvs_bf16_round(frand());
    for (int i = 0; i < n * qd; i++) q[i] = kvs_bf16_round(2 * frand());
    for (int s = 0; s < NS; s++) memcpy(qn + (size_t)s * qd, q + (size_t)(qs[s + 1] - 1) * qd, (size_t)qd * 4);
    /* every position written: one prefill of each sequence's context */
    int32_t wq[NS + 1], wpos[NS];
    wq[0] = 0;
    for (int s = 0; s < NS; s++) wq[s + 1] = wq[s] + newest[s] + 1, wpos[s] = 0;
    const size_t nsc = (size_t)NS * NKV * MB, nsp = (size_t)NS * NKV * MS * 2;
    float *sc[2][3];
    int32_t *sn[3], *sp[3];
    for (int bi = 0; bi < 2; bi++) {
        const struct kvs_backend_ops *o = O[bi];
        struct kvs_backend *b = B[bi];
        struct kvs_dbuf *d_k = o->alloc(b, KVS_BUF_KV, n_kv), *d_dig = o->alloc(b, dk, ndig);
        struct kvs_dbuf *d_q = o->alloc(b, KVS_BUF_ACT, (size_t)n * qd), *d_qn = o->alloc(b, KVS_BUF_ACT, (size_t)NS * qd);
        struct kvs_dbuf *d_bt = o->alloc(b, KVS_BUF_I32, NS * MB), *d_wq = o->alloc(b, KVS_BUF_I32, NS + 1);
        struct kvs_dbuf *d_wpos = o->alloc(b, KVS_BUF_I32, NS), *d_qs = o->alloc(b, KVS_BUF_I32, NS + 1);
        struct kvs_dbuf *d_one = o->alloc(b, KVS_BUF_I32, NS + 1), *d_pos = o->alloc(b, KVS_BUF_I32, NS);
        struct kvs_dbuf *d_keep = o->alloc(b, KVS_BUF_I32, NS), *d_sc = o->alloc(b, KVS_BUF_F32, nsc);
        struct kvs_dbuf *d_sn = o->alloc(b, KVS_BUF_I32, NS * NKV), *d_sp = o->alloc(b, KVS_BUF_I32, nsp);
        REQUIRE(d_k && d_dig && d_q && d_qn && d_bt && d_wq && d_wpos && d_qs && d_one && d_pos && d_keep && d_sc &&
                d_sn && d_sp, "alloc");
        o->upload(b, d_k, 0, k, n_kv);
        o->upload(b, d_q, 0, q, (size_t)n * qd);
        o->upload(b, d_qn, 0, qn, (size_t)NS * qd);
        o->upload(b, d_bt, 0, bt, NS * MB);
        o->upload(b, d_wq, 0, wq, NS + 1);
        o->upload(b, d_wpos, 0, wpos, NS);
        o->upload(b, d_qs, 0, qs, NS + 1);
        o->upload(b, d_one, 0, one, NS + 1);
        o->upload(b, d_pos, 0, newest, NS);
        o->upload(b, d_keep, 0, keep, NS);
        const struct kvs_attn_meta wm = {.n_seqs = NS, .max_blocks = MB, .q_start = d_wq, .pos = d_wpos,
                                         .block_tables = d_bt, .h_q_start = wq, .h_pos = wpos, .max_ctx = MAXCTX};
        if (bits < 16) K[bi]->qdigest_update(b, d_k, &wm, NKV, HD, BS, BS, bits, (size_t)n_pages, d_dig);
        else K[bi]->digest_update(b, d_k, &wm, NKV, HD, BS, BS, d_dig);
        /* 0: the windows' meta on q; 1: the gathered rows, one a sequence; 2 (CUDA): 0 with the fused kernel asked for */
        for (int v = 0; v < (bi ? 3 : 2); v++) {
            const struct kvs_attn_meta m = {.n_seqs = NS, .max_blocks = MB, .q_start = v == 1 ? d_one : d_qs,
                                            .pos = d_pos, .block_tables = d_bt, .h_q_start = v == 1 ? one : qs,
                                            .h_pos = newest, .max_ctx = MAXCTX};
            const struct kvs_dbuf *qq = v == 1 ? d_qn : d_q;
            o->zero(b, d_sc, 0, nsc);
            if (bi) {
                kvs_quest_cuda_select_path(v == 2 ? 2 : 0);
                K[bi]->score_select(b, qq, d_dig, &m, d_keep, NS, NH, NKV, HD, BS, BS, bits, (size_t)n_pages, MB, MS,
                                    d_sc, 1, d_sn, d_sp, NULL, NULL);
                kvs_quest_cuda_select_path(0);
                sn[v] = kvs_xmalloc(NS * NKV * 4), sp[v] = kvs_xmalloc(nsp * 4);
                o->download(b, sn[v], d_sn, 0, NS * NKV);
                o->download(b, sp[v], d_sp, 0, nsp);
            } else if (bits < 16)
                K[bi]->qscore(b, qq, d_dig, &m, d_keep, NS, NH, NKV, HD, BS, BS, bits, (size_t)n_pages, MB, d_sc);
            else
                K[bi]->score(b, qq, d_dig, &m, d_keep, NS, NH, NKV, HD, BS, BS, MB, d_sc);
            sc[bi][v] = kvs_xmalloc(nsc * 4);
            o->download(b, sc[bi][v], d_sc, 0, nsc);
        }
        struct kvs_dbuf *all[] = {d_k, d_dig, d_q, d_qn, d_bt, d_wq, d_wpos, d_qs, d_one, d_pos, d_keep, d_sc, d_sn, d_sp};
        for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) o->free_buf(b, all[i]);
    }
    int cpu_same = 1, cuda_same = 1, fused_same = 1, scored = 0;
    double err = 0;
    for (int s = 0; s < NS; s++) {
        const int cur = newest[s] / BS;
        if (keep[s] > cur) continue;   /* keeps every page: no scores */
        for (int g = 0; g < NKV; g++) {
            const float *c0 = sc[0][0] + ((size_t)s * NKV + g) * MB;
            double mag = 0;   /* relative to the row's largest score (test_cuda_kv_quest's measure) */
            for (int p = 0; p < cur; p++)
                if (isfinite(c0[p]) && fabs(c0[p]) > mag) mag = fabs(c0[p]);
            for (int p = 0; p < cur; p++) {
                const size_t i = ((size_t)s * NKV + g) * MB + p;
                cpu_same &= !memcmp(&sc[0][0][i], &sc[0][1][i], 4);
                cuda_same &= !memcmp(&sc[1][0][i], &sc[1][1][i], 4);
                fused_same &= !memcmp(&sc[1][2][i], &sc[1][1][i], 4);
                if (isfinite(c0[p])) {
                    const double e = fabs((double)sc[1][0][i] - c0[p]) / (mag > 0 ? mag : 1);
                    err = e > err ? e : err;
                }
                scored++;
            }
        }
    }
    int spans_same = 1, spans_fused = 1;
    for (int t = 0; t < NS * NKV; t++) {
        spans_same &= sn[0][t] == sn[1][t] && !memcmp(sp[0] + (size_t)t * MS * 2, sp[1] + (size_t)t * MS * 2, (size_t)sn[1][t] * 8);
        spans_fused &= sn[2][t] == sn[1][t] && !memcmp(sp[2] + (size_t)t * MS * 2, sp[1] + (size_t)t * MS * 2, (size_t)sn[1][t] * 8);
    }
    CHECK(scored > 0, "no page scored");
    CHECK(cpu_same, "bits %d: CPU scores of the windows' meta differ from the gathered rows'", bits);
    CHECK(cuda_same && spans_same, "bits %d: CUDA scores %d / spans %d of the windows' meta differ from the gathered rows'",
          bits, cuda_same, spans_same);
    CHECK(fused_same && spans_fused, "bits %d: with the fused kernel asked for: scores %d spans %d", bits, fused_same,
          spans_fused);
    CHECK(err < 1e-5, "bits %d: CUDA scores vs CPU: %.3g", bits, err);
    printf("score rows (bits %d): %d pages scored, %d window rows of %d sequences, CUDA vs CPU %.2g\n", bits, scored,
           n, NS, err);
    for (int v = 0; v < 3; v++) {
        if (v < 2) free(sc[0][v]);
        free(sc[1][v]), free(sn[v]), free(sp[v]);
    }
    free(k), free(q), free(qn);
}

static void test_fused(int nh, int nkv, int hd, int maxctx, int dens_max, int mask_kernel)
{
    /* the step's mask: in the attend's walk where it fits (the default), or k_retro_mask */
    if (mask_kernel) setenv("KVS_CUDA_RETRO_MASK", "kernel", 1);
    else unsetenv("KVS_CUDA_RETRO_MASK");
    enum { NR = 5, STEPS = 6 };
    const int bs = 16, mb = maxctx / bs, mp = mb, ms = mp, qd = nh * hd;
    const struct kvs_retro_kernels *kc = kvs_retro_kernels_for(C), *kg = kvs_retro_kernels_for(G);
    REQUIRE(kg->attend, "the CUDA table has no fused attend");
    const size_t n_kv = (size_t)NR * mb * nkv * bs * hd;
    float *k = kvs_xmalloc(n_kv * 4), *v = kvs_xmalloc(n_kv * 4);
    for (size_t i = 0; i < n_kv; i++) k[i] = frand(), v[i] = frand();
    int32_t *bt = kvs_xmalloc((size_t)NR * mb * 4), *perm = kvs_xmalloc((size_t)NR * mb * 4);
    for (int i = 0; i < NR * mb; i++) perm[i] = i;
    for (int i = NR * mb - 1; i > 0; i--) {
        const int j = (int)(kvs_test_xorshift(&rng) % (uint32_t)(i + 1)), x = perm[i];
        perm[i] = perm[j], perm[j] = x;
    }
    memcpy(bt, perm, (size_t)NR * mb * 4);
    int32_t qs[NR + 1], pos[NR], req[NR * 5], newest[NR];
    qs[0] = 0;
    for (int r = 0; r < NR; r++) {
        const int w = 1 + (int)(kvs_test_xorshift(&rng) % MAXW);
        newest[r] = 40 + (int)(kvs_test_xorshift(&rng) % (uint32_t)(maxctx - 41 - STEPS));
        qs[r + 1] = qs[r] + w;
    }
    const int n = qs[NR];
    const size_t a_n = (size_t)NR * nkv * mp, nsel = (size_t)NR * nkv * ms * 2;
    struct kvs_dbuf *cA = C->alloc(bc, KVS_BUF_I32, a_n), *gA = G->alloc(bg, KVS_BUF_I32, a_n);
    struct kvs_dbuf *csn = C->alloc(bc, KVS_BUF_I32, NR * nkv), *gsn = G->alloc(bg, KVS_BUF_I32, NR * nkv);
    struct kvs_dbuf *csel = C->alloc(bc, KVS_BUF_I32, nsel), *gsel = G->alloc(bg, KVS_BUF_I32, nsel);
    struct kvs_dbuf *creq = C->alloc(bc, KVS_BUF_I32, NR * 5), *greq = G->alloc(bg, KVS_BUF_I32, NR * 5);
    struct kvs_dbuf *cn = C->alloc(bc, KVS_BUF_I32, (size_t)n * nkv), *gn = G->alloc(bg, KVS_BUF_I32, (size_t)n * nkv);
    struct kvs_dbuf *cs = C->alloc(bc, KVS_BUF_I32, (size_t)n * nkv * ms * 2);
    struct kvs_dbuf *gs = G->alloc(bg, KVS_BUF_I32, (size_t)n * nkv * ms * 2);
    struct kvs_dbuf *ck = C->alloc(bc, KVS_BUF_I32, 4), *gk = G->alloc(bg, KVS_BUF_I32, 4);
    struct kvs_dbuf *gm = G->alloc(bg, KVS_BUF_I32, a_n);
    /* the table's step (mask + attend + merge) runs on its own masks, keys and M, which see the
     * same earlier steps through spans */
    struct kvs_dbuf *gA2 = G->alloc(bg, KVS_BUF_I32, a_n), *gk2 = G->alloc(bg, KVS_BUF_I32, 4);
    struct kvs_dbuf *gm2 = G->alloc(bg, KVS_BUF_I32, a_n);
    REQUIRE(cA && gA && csn && gsn && csel && gsel && creq && greq && cn && gn && cs && gs && ck && gk && gm, "alloc");
    REQUIRE(gA2 && gk2 && gm2, "alloc");
    kc->reset(bc, cA, 0, a_n), kg->reset(bg, gA, 0, a_n), kg->reset(bg, gA2, 0, a_n);
    C->zero(bc, ck, 0, 4), G->zero(bg, gk, 0, 4), G->zero(bg, gk2, 0, 4);
    G->zero(bg, gm, 0, a_n), G->zero(bg, gm2, 0, a_n);
    int32_t *hsn = kvs_xcalloc((size_t)NR * nkv, 4), *hsel = kvs_xcalloc(nsel, 4);
    long long max_keys = 0;
    /* earlier one-row steps build the masks (t = 0 .. STEPS - 1; the window's rows are the last) */
    for (int step = 0; step <= STEPS; step++) {
        int row0 = 0;
        for (int r = 0; r < NR; r++) {
            const int w = qs[r + 1] - qs[r], rows = step == STEPS ? w : 1;
            const int p = newest[r] - STEPS + step;
            req[5 * r] = step == STEPS ? qs[r] : row0, req[5 * r + 1] = rows, req[5 * r + 2] = p;
            req[5 * r + 3] = step, req[5 * r + 4] = r;
            row0 += rows;
            const int dens = 1 + (int)(kvs_test_xorshift(&rng) % (uint32_t)dens_max);
            for (int g = 0; g < nkv; g++) {
                int32_t *sp = hsel + ((size_t)r * nkv + g) * ms * 2;
                const int cur = p / bs;
                int ns = 0;
                for (int pg = 0; pg <= cur; pg++) {
                    if (pg < cur && kvs_test_xorshift(&rng) % (uint32_t)dens) continue;
                    const int lo = pg * bs, hi = pg == cur ? p + 1 : lo + bs;
                    if (ns && sp[2 * ns - 1] == lo) sp[2 * ns - 1] = hi;
                    else sp[2 * ns] = lo, sp[2 * ns + 1] = hi, ns++;
                }
                hsn[r * nkv + g] = ns;
                long long keys = 0;
                for (int i = 0; i < ns; i++) keys += sp[2 * i + 1] - sp[2 * i];
                if (step == STEPS && keys > max_keys) max_keys = keys;
            }
        }
        C->upload(bc, csn, 0, hsn, (size_t)NR * nkv), G->upload(bg, gsn, 0, hsn, (size_t)NR * nkv);
        C->upload(bc, csel, 0, hsel, nsel), G->upload(bg, gsel, 0, hsel, nsel);
        C->upload(bc, creq, 0, req, NR * 5), G->upload(bg, greq, 0, req, NR * 5);
        kc->spans(bc, csn, csel, creq, NR, nkv, ms, bs, cA, 1, 0, mp, cn, cs, ck, NULL);
        kg->spans(bg, gsn, gsel, greq, NR, nkv, ms, bs, gA, 1, 0, mp, gn, gs, gk, gm);
        if (step < STEPS) kg->spans(bg, gsn, gsel, greq, NR, nkv, ms, bs, gA2, 1, 0, mp, gn, gs, gk2, gm2);
    }
    for (int r = 0; r < NR; r++) pos[r] = newest[r] - (qs[r + 1] - qs[r] - 1);
    /* the output cache the step merges with: prev rows (some lse -inf), each row's cached index
     * (some past prev: no merge) */
    const int prev = n + 3;
    float *op = kvs_xmalloc((size_t)prev * qd * 4), *lp = kvs_xmalloc((size_t)prev * nh * 4);
    int32_t *cix = kvs_xmalloc((size_t)n * 4);
    for (int i = 0; i < prev * qd; i++) op[i] = frand();
    for (int i = 0; i < prev * nh; i++) lp[i] = kvs_test_xorshift(&rng) % 7 ? 4 * frand() : -INFINITY;
    for (int i = 0; i < n; i++) cix[i] = (int32_t)(kvs_test_xorshift(&rng) % (uint32_t)(prev + 4));
    float *ocm = kvs_xmalloc((size_t)n * qd * 4), *ogm = kvs_xmalloc((size_t)n * qd * 4);
    float *lcm = kvs_xmalloc((size_t)n * nh * 4), *lgm = kvs_xmalloc((size_t)n * nh * 4);
    float *ogn = kvs_xmalloc((size_t)n * qd * 4), *lgn = kvs_xmalloc((size_t)n * nh * 4);
    float *q = kvs_xmalloc((size_t)n * qd * 4);
    for (int i = 0; i < n * qd; i++) q[i] = 2 * frand();
    float *oc = kvs_xmalloc((size_t)n * qd * 4), *og = kvs_xmalloc((size_t)n * qd * 4);
    float *lc = kvs_xmalloc((size_t)n * nh * 4), *lg = kvs_xmalloc((size_t)n * nh * 4);
    int32_t *h_n = kvs_xmalloc((size_t)n * nkv * 4), *h_s = kvs_xmalloc((size_t)n * nkv * ms * 2 * 4);
    C->download(bc, h_n, cn, 0, (size_t)n * nkv), C->download(bc, h_s, cs, 0, (size_t)n * nkv * ms * 2);
    for (int k2 = 0; k2 < 2; k2++) {
        const struct kvs_backend_ops *B = k2 ? G : C;
        struct kvs_backend *bb = k2 ? bg : bc;
        struct kvs_dbuf *d_q = B->alloc(bb, KVS_BUF_ACT, (size_t)n * qd), *d_k = B->alloc(bb, KVS_BUF_KV, n_kv);
        struct kvs_dbuf *d_v = B->alloc(bb, KVS_BUF_KV, n_kv), *d_o = B->alloc(bb, KVS_BUF_ACT, (size_t)n * qd);
        struct kvs_dbuf *d_l = B->alloc(bb, KVS_BUF_F32, (size_t)n * nh), *d_qs = B->alloc(bb, KVS_BUF_I32, NR + 1);
        struct kvs_dbuf *d_pos = B->alloc(bb, KVS_BUF_I32, NR), *d_bt = B->alloc(bb, KVS_BUF_I32, (size_t)NR * mb);
        REQUIRE(d_q && d_k && d_v && d_o && d_l && d_qs && d_pos && d_bt, "alloc");
        B->upload(bb, d_q, 0, q, (size_t)n * qd), B->upload(bb, d_k, 0, k, n_kv), B->upload(bb, d_v, 0, v, n_kv);
        B->upload(bb, d_qs, 0, qs, NR + 1), B->upload(bb, d_pos, 0, pos, NR), B->upload(bb, d_bt, 0, bt, (size_t)NR * mb);
        const struct kvs_attn_meta m = {.n_seqs = NR, .max_blocks = mb, .q_start = d_qs, .pos = d_pos,
                                        .block_tables = d_bt, .h_q_start = qs, .h_pos = pos, .max_ctx = maxctx};
        const float scale = 1.0f / sqrtf((float)hd);
        if (!k2) {
            const struct kvs_span_list sl = {ms, cn, cs, h_n, h_s};
            C->attention_spans(bc, d_q, d_k, d_v, &m, &sl, n, nh, nkv, hd, bs, scale, d_o, d_l);
        } else {
            const int rc = kg->attend(bg, d_q, d_k, d_v, &m, gsn, gsel, ms, greq, gm, mp, bs, NR, nh, nkv, hd, bs, scale,
                                      max_keys, d_o, d_l);
            REQUIRE(rc == 0, "cuda retro attend: %d", rc);
        }
        B->download(bb, k2 ? og : oc, d_o, 0, (size_t)n * qd), B->download(bb, k2 ? lg : lc, d_l, 0, (size_t)n * nh);
        /* the merged outputs: CPU attention_spans + the CPU table's merge, vs the CUDA table's step */
        struct kvs_dbuf *d_op = B->alloc(bb, KVS_BUF_ACT, (size_t)prev * qd), *d_lp = B->alloc(bb, KVS_BUF_F32, (size_t)prev * nh);
        struct kvs_dbuf *d_ci = B->alloc(bb, KVS_BUF_I32, (size_t)n), *d_on = B->alloc(bb, KVS_BUF_ACT, (size_t)n * qd);
        struct kvs_dbuf *d_ln = B->alloc(bb, KVS_BUF_F32, (size_t)n * nh);
        REQUIRE(d_op && d_lp && d_ci && d_on && d_ln, "alloc");
        B->upload(bb, d_op, 0, op, (size_t)prev * qd), B->upload(bb, d_lp, 0, lp, (size_t)prev * nh);
        B->upload(bb, d_ci, 0, cix, (size_t)n);
        if (!k2) {
            kc->merge(bc, d_o, d_l, d_ci, n, nh, hd, d_op, d_lp, prev, d_on, d_ln);
        } else {
            REQUIRE(kg->step, "the CUDA table has no step");
            const int rc = kg->step(bg, d_q, d_k, d_v, &m, gsn, gsel, ms, greq, gA2, 1, 0, gm2, gk2, mp, bs, NR, nh, nkv,
                                    hd, bs, scale, max_keys, d_ci, d_op, d_lp, prev, d_on, d_ln, d_o, d_l);
            REQUIRE(rc == 0, "cuda retro step: %d", rc);
            B->download(bb, ogn, d_on, 0, (size_t)n * qd), B->download(bb, lgn, d_ln, 0, (size_t)n * nh);
        }
        B->download(bb, k2 ? ogm : ocm, d_o, 0, (size_t)n * qd), B->download(bb, k2 ? lgm : lcm, d_l, 0, (size_t)n * nh);
        struct kvs_dbuf *bs2[] = {d_q, d_k, d_v, d_o, d_l, d_qs, d_pos, d_bt, d_op, d_lp, d_ci, d_on, d_ln};
        for (size_t i = 0; i < sizeof bs2 / sizeof bs2[0]; i++) B->free_buf(bb, bs2[i]);
    }
    {
        /* the step's masks, M and key counts equal spans' (exactly); its outputs the CPU's merge */
        int32_t *a1 = kvs_xmalloc(a_n * 4), *a2 = kvs_xmalloc(a_n * 4), *m1 = kvs_xmalloc(a_n * 4), *m2 = kvs_xmalloc(a_n * 4);
        uint64_t k1[2], k2v[2];
        G->download(bg, a1, gA, 0, a_n), G->download(bg, a2, gA2, 0, a_n);
        G->download(bg, m1, gm, 0, a_n), G->download(bg, m2, gm2, 0, a_n);
        G->download(bg, k1, gk, 0, 4), G->download(bg, k2v, gk2, 0, 4);
        CHECK(!memcmp(a1, a2, a_n * 4) && !memcmp(m1, m2, a_n * 4) && k1[0] == k2v[0] && k1[1] == k2v[1],
              "retro step %d/%d hd %d ctx %d: masks / M / keys differ from spans' (keys %llu / %llu vs %llu / %llu)",
              nh, nkv, hd, maxctx, (unsigned long long)k2v[0], (unsigned long long)k2v[1],
              (unsigned long long)k1[0], (unsigned long long)k1[1]);
        double we = 0, wl = 0;
        int bad_inf = 0, next_diff = 0;
        for (int r = 0; r < n; r++) {
            const double e = rel_l2(ogm + (size_t)r * qd, ocm + (size_t)r * qd, qd);
            we = e > we || e != e ? e : we;
            for (int h = 0; h < nh; h++) {
                const double a = lcm[r * nh + h], b = lgm[r * nh + h];
                if (isinf(a) || isinf(b)) {
                    bad_inf += a != b;
                    continue;
                }
                const double d = fabs(a - b) / (fabs(a) > 1 ? fabs(a) : 1);
                wl = d > wl || d != d ? d : wl;
            }
        }
        next_diff = memcmp(ogn, ogm, (size_t)n * qd * 4) != 0 || memcmp(lgn, lgm, (size_t)n * nh * 4) != 0;
        CHECK(we < 1e-2 && wl < 1e-2 && !bad_inf && !next_diff, "retro step %d/%d hd %d ctx %d: merged out rel-L2 %.3g, "
              "lse %.3g, %d -inf mismatches, next cache %s the outputs", nh, nkv, hd, maxctx, we, wl, bad_inf,
              next_diff ? "differs from" : "equals");
        int rmax = 0;
        for (int r = 0; r < NR; r++) rmax = qs[r + 1] - qs[r] > rmax ? qs[r + 1] - qs[r] : rmax;
        printf("ok retro step on cuda (mask %s + attend + merge), %d q / %d kv heads, head_dim %d, contexts < %d: "
               "masks, M and keys equal spans', merged out rel-L2 %.2e, lse %.2e vs cpu\n",
               mask_kernel || rmax * (nh / nkv) > 32 ? "kernel" : "in the walk", nh, nkv, hd, maxctx, we, wl);
        free(a1), free(a2), free(m1), free(m2);
    }
    free(op), free(lp), free(cix), free(ocm), free(ogm), free(lcm), free(lgm), free(ogn), free(lgn);
    G->free_buf(bg, gA2), G->free_buf(bg, gk2), G->free_buf(bg, gm2);
    double worst = 0, worst_lse = 0;
    int empty = 0, inf_bad = 0;
    for (int r = 0; r < n; r++) {
        int any = 0;
        for (int g = 0; g < nkv; g++) any |= h_n[(size_t)r * nkv + g] > 0;
        empty += !any;
        const double e = rel_l2(og + (size_t)r * qd, oc + (size_t)r * qd, qd);
        worst = e > worst || e != e ? e : worst;
        for (int h = 0; h < nh; h++) {
            const double a = lc[r * nh + h], b = lg[r * nh + h];
            if (isinf(a) || isinf(b)) {
                inf_bad += a != b;
                continue;
            }
            const double d = fabs(a - b) / (fabs(a) > 1 ? fabs(a) : 1);
            worst_lse = d > worst_lse || d != d ? d : worst_lse;
        }
    }
    CHECK(worst < 1e-2 && worst_lse < 1e-2 && !inf_bad, "fused attend %d/%d heads hd %d ctx %d: out rel-L2 %.3g, lse "
          "%.3g, %d -inf mismatches", nh, nkv, hd, maxctx, worst, worst_lse, inf_bad);
    printf("ok retro fused attend on cuda, %d q / %d kv heads, head_dim %d, contexts < %d (%d rows, %d without a "
           "supplement, max %lld keys): out rel-L2 %.2e, lse %.2e vs cpu spans\n", nh, nkv, hd, maxctx, n, empty,
           max_keys, worst, worst_lse);
    struct kvs_dbuf *cb[] = {cA, csn, csel, creq, cn, cs, ck}, *gb[] = {gA, gsn, gsel, greq, gn, gs, gk, gm};
    for (size_t i = 0; i < 7; i++) C->free_buf(bc, cb[i]);
    for (size_t i = 0; i < 8; i++) G->free_buf(bg, gb[i]);
    free(k), free(v), free(bt), free(perm), free(hsn), free(hsel), free(q), free(oc), free(og), free(lc), free(lg);
    free(h_n), free(h_s);
}

#define NJ 6
#define GEN 16

static void run_engine_at(struct kvs_model *model, const char *decode, double ratio, int min_budget, int w,
                          int max_running, int dense_layers, int32_t out[NJ][GEN], struct kvs_engine_stats *st)
{
    struct kvs_config c;
    kvs_config_init(&c);
    free(c.device), c.device = kvs_xstrdup("cuda");
    free(c.kv_reuse), c.kv_reuse = kvs_xstrdup("none");
    free(c.kv_decode), c.kv_decode = kvs_xstrdup(decode);
    c.kv_block_size = 16;
    c.kv_memory_bytes = 16 << 20;
    c.max_batch_tokens = 256;
    c.max_running = max_running;
    c.max_model_len = 512;
    c.quest_dense_layers = dense_layers;
    c.quest_budget_ratio = ratio;
    c.quest_min_budget = min_budget;
    c.retro_window = w;
    /* batch-invariant numerics for every run, full's too (auto turns them on for retro only) */
    free(c.batch_invariant), c.batch_invariant = kvs_xstrdup("true");
    char err[256];
    struct kvs_engine *e;
    REQUIRE(kvs_engine_create(&c, model, NULL, &e, err, sizeof err) == 0, "%s", err);
    uint64_t r2 = 4242;
    struct kvs_request *r[NJ];
    static int32_t prompt[NJ][300];
    for (int i = 0; i < NJ; i++) {
        struct kvs_request_params p;
        memset(&p, 0, sizeof p);
        const int n = 150 + (int)(kvs_test_xorshift(&r2) % 140);
        for (int t = 0; t < n; t++) prompt[i][t] = 1 + (int32_t)(kvs_test_xorshift(&r2) % 1000);
        p.prompt = prompt[i];
        p.n_prompt = n;
        p.max_tokens = GEN;
        p.sampling.top_p = 1;
        p.sampling.repetition_penalty = 1;
        p.ignore_eos = 1;
        r[i] = kvs_request_new(&p, NULL, NULL);
        REQUIRE(r[i] && kvs_engine_submit(e, r[i], err, sizeof err) == 0, "submit: %s", err);
    }
    for (int i = 0; i < NJ; i++) {
        int n = 0, done = 0;
        struct kvs_event ev[16];
        while (!done) {
            int k = kvs_request_wait(r[i], ev, 16, 60.0);
            REQUIRE(k > 0, "no event for 60 s");
            for (int q = 0; q < k; q++) {
                if (ev[q].type == KVS_EV_TOKEN && n < GEN) out[i][n++] = ev[q].token;
                if (ev[q].type == KVS_EV_ERROR) fprintf(stderr, "error: %s\n", ev[q].error);
                if (ev[q].type != KVS_EV_TOKEN) done = 1;
                kvs_event_clear(&ev[q]);
            }
        }
        CHECK(n == GEN, "%s w=%d: request %d got %d tokens", decode, w, i, n);
        kvs_request_unref(r[i]);
    }
    kvs_engine_stats(e, st);
    kvs_engine_free(e);
    kvs_config_free(&c);
}

static void run_engine(struct kvs_model *model, const char *decode, double ratio, int min_budget, int w,
                       int32_t out[NJ][GEN], struct kvs_engine_stats *st)
{
    run_engine_at(model, decode, ratio, min_budget, w, 4, 0, out, st);
}

static int n_same(int32_t a[NJ][GEN], int32_t b[NJ][GEN])
{
    int same = 0;
    for (int i = 0; i < NJ; i++) same += !memcmp(a[i], b[i], sizeof a[i]);
    return same;
}

static void test_engine(void)
{
    char dir[1024], err[256];
    struct kvs_model *model;
    snprintf(dir, sizeof dir, "%s/tests/data/models/llama", kvs_test_root());
    REQUIRE(kvs_model_load(dir, &model, err, sizeof err) == 0, "%s", err);
    static int32_t full[NJ][GEN], quest[NJ][GEN], x[NJ][GEN];
    struct kvs_engine_stats st;
    run_engine(model, "full", 0.15, 256, 2, full, &st);
    run_engine(model, "quest", 0.15, 32, 1, quest, &st);
    run_engine(model, "retro", 0.15, 32, 1, x, &st);
    CHECK(n_same(quest, x) == NJ, "retro w=1 on cuda: %d of %d requests equal to quest", n_same(quest, x), NJ);
    printf("ok engine on cuda: retro w=1 gives quest's tokens (%d/%d requests)\n", n_same(quest, x), NJ);
    for (int w = 2; w <= 4; w += 2) {
        run_engine(model, "retro", 1.0, 0, w, x, &st);
        const double past = kvs_engine_kv_counter(&st, "kvserve:kv_retro_past_rows_total");
        CHECK(n_same(full, x) >= NJ - 1 && past > 0, "retro w=%d every page on cuda: %d of %d equal to full, %g past "
              "rows", w, n_same(full, x), NJ, past);
        printf("ok engine on cuda: retro w=%d with every page equals full for %d/%d requests (%g past rows)\n", w,
               n_same(full, x), NJ, past);
    }
    run_engine(model, "retro", 0.15, 32, 2, x, &st);
    const double sup = kvs_engine_kv_counter(&st, "kvserve:kv_retro_keys_supplement_total");
    const double eff = kvs_engine_kv_counter(&st, "kvserve:kv_retro_effective_budget");
    CHECK(sup > 0 && eff > 1.0, "retro w=2 at min budget 32 on cuda: %g supplement keys, effective budget %g", sup, eff);
    printf("ok engine on cuda: retro w=2 at 15%% (min 32): effective budget %.3fx quest's, %d/%d requests equal to "
           "quest's tokens\n", eff, n_same(quest, x), NJ);
    kvs_model_free(model);
}

/* The demo model (its GEMM shapes take the decode GEMM, cuda_skinny.cu) one request at a time (a
 * decode step is that request's window, no prefill rows beside it): with every page kept, a Retro
 * step's newest row runs full attention's one-row decode attention and each past row keeps its
 * cached outputs (kv_decode_retro.c attend_kept), for w = 2 and 4, with the dense layers (0-1)
 * and without (every layer selecting). Every request must equal full's, token for token: both
 * run with batch-invariant numerics (config key batch_invariant), under which full's one-row
 * steps and Retro's w-row steps give a row the same bits: the decode GEMM picks its kernel by
 * shape, not by row count, and the decode attention splits a row's context by its own length,
 * not by the launch's rows or a recorded graph's capacity (test_cuda_batch_invariance). With the
 * default numerics the two round differently (bench/RESULTS.md: 4/6 equal at the default GEMM
 * variant, 3/6 with the invariant GEMM alone: the attention's split plan under graphs). */
static void test_engine_exact(void)
{
    char dir[1024], err[256];
    struct kvs_model *model;
    snprintf(dir, sizeof dir, "%s/models/demo", kvs_test_root());
    REQUIRE(kvs_model_load(dir, &model, err, sizeof err) == 0, "%s", err);
    static int32_t full[NJ][GEN], x[NJ][GEN];
    struct kvs_engine_stats st;
    run_engine_at(model, "full", 0.15, 256, 2, 1, 2, full, &st);
    for (int dense = 0; dense <= 2; dense += 2)
        for (int w = 2; w <= 4; w += 2) {
            run_engine_at(model, "retro", 1.0, 0, w, 1, dense, x, &st);
            const double past = kvs_engine_kv_counter(&st, "kvserve:kv_retro_past_rows_total");
            CHECK(n_same(full, x) == NJ && past > 0, "retro w=%d every page on cuda, demo model, dense layers %d: %d of %d "
                  "equal to full, %g past rows", w, dense, n_same(full, x), NJ, past);
            printf("ok engine on cuda (demo model, one request at a time, dense layers %d): retro w=%d with every page "
                   "equals full for %d/%d requests (%g past rows)\n", dense, w, n_same(full, x), NJ, past);
        }
    kvs_model_free(model);
}

int main(void)
{
    const char *es = getenv("KVS_SEED");
    uint64_t seed = es ? strtoull(es, NULL, 10) : (uint64_t)time(NULL) * 2654435761u + (uint64_t)clock();
    if (!seed) seed = 1;
    rng = seed;
    setvbuf(stdout, NULL, _IOLBF, 0);
    printf("seed %llu (replay with KVS_SEED=%llu)\n", (unsigned long long)seed, (unsigned long long)seed);
    kvs_log_set_level(KVS_LOG_WARN);
    char err[256];
    bc = C->create(2, err, sizeof err);
    if (!bc) { fprintf(stderr, "cpu backend: %s\n", err); return 1; }
    bg = G->create(0, err, sizeof err);
    if (!bg) { fprintf(stderr, "cuda backend unavailable: %s\n", err); return 1; }
    REQUIRE(G->attention_spans && G->attn_merge && G->gather_rows, "the CUDA backend lacks a Retro primitive");
    for (int i = 0; i < 4; i++) test_step(i);
    test_score_rows(16);
    test_score_rows(8);
    test_table();
    static const int SH[][3] = {{8, 8, 64}, {8, 2, 128}, {32, 4, 128}, {16, 2, 64}, {8, 1, 128}, {32, 8, 128}, {4, 2, 16}};
    for (size_t i = 0; i < sizeof SH / sizeof SH[0]; i++) {
        test_fused(SH[i][0], SH[i][1], SH[i][2], 4096, 8, 0);   /* splits */
        test_fused(SH[i][0], SH[i][1], SH[i][2], 256, 3, 0);    /* short: one split */
        test_fused(SH[i][0], SH[i][1], SH[i][2], 4096, 8, 1);   /* the step's mask kernel */
    }
    unsetenv("KVS_CUDA_RETRO_MASK");
    setenv("KVS_CUDA_RETRO_SPLITS", "up", 1);   /* main's split plan (the benches' A/B) */
    for (size_t i = 0; i < 3; i++) test_fused(SH[i][0], SH[i][1], SH[i][2], 4096, 8, 0);
    unsetenv("KVS_CUDA_RETRO_SPLITS");
    C->free(bc);
    G->free(bg);
    test_engine();
    test_engine_exact();
    return kvs_test_summary("test_cuda_kv_retro");
}
#else
int main(void)
{
    fprintf(stderr, "test_cuda_kv_retro: built without CUDA (nvcc not found)\n");
    return 1;
}
#endif
