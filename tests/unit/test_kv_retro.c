/* test_kv_retro.c: Retro's window bookkeeping (kernels/kv_retro.h) with the CPU backend's
 * attention_spans and attn_merge, the exactness test of STRATEGIES.md §4: one layer, frozen
 * queries, no re-embedding. A sequence decodes T steps; step t attends a random page selection
 * S_t (the current page always in it) and every past query of its window (t - w < t' < t) is
 * supplemented with the pages of S_t that the mask says it has not seen, merged into its cached
 * (o, lse). Checks, for w = 1, 2, 4, 8 and per KV head:
 *   - every supplement span ends at or before the past query's own position + 1 (no later key);
 *   - once its window has passed, each query's merged output and lse equal attention over the
 *     union of the pages it was shown (clipped to its position), within fp32 merge rounding;
 *   - w = 1 supplements nothing: each output is its own step's sparse attention, bitwise;
 *   - the mask rejects malformed selections (-EINVAL).
 * Prints the effective budget (union of keys seen per query / keys of its own step) per w.
 * Then the same exactness through the policy itself (kv.decode=retro, engine/kv/kv_decode_retro.c,
 * driven as the runner drives it: plan, attend, finish): one selecting layer, two requests
 * decoding side by side, frozen queries and no re-embedding (each re-run row gets its query's
 * own q; the cache is not rewritten). Once a query leaves the window, its merged output and lse
 * equal attention over the union of the pages Quest selected for it and for the w - 1 later
 * queries (recomputed here with Quest's CPU kernels over the same digests), clipped to its own
 * position, for w = 2, 4, 8; with w = 1 every output is that of its own selection, bitwise; each
 * w with 16- and 8-bit digests (kv.quest.digest_bits), w = 2 also with 4-bit ones. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/util.h"
#include "engine/config.h"
#include "engine/kv/kv.h"
#include "kernels/backend.h"
#include "kernels/kv_quest.h"
#include "kernels/kv_retro.h"
#include "tests/unit/test_util.h"

#define NH 4
#define NKV 2
#define HD 32
#define PS 16
#define P0 300           /* position of the first decode step */
#define T 48             /* decode steps */
#define NPOS (P0 + T)
#define NPAGES ((NPOS + PS - 1) / PS)
#define PICK 5           /* random pages per step besides the current one */

static const struct kvs_backend_ops *O = &kvs_cpu_backend;
static struct kvs_backend *be;
static uint64_t rng = 0xBADC0DEull;

static float frand(void) { return (float)((double)kvs_test_xorshift(&rng) / 4294967296.0 * 2.0 - 1.0); }

/* one decode row of the sequence at position pos, its spans for every KV head */
struct one {
    struct kvs_dbuf *q, *out, *lse, *qs, *pos, *bt, *n_sp, *sp;
    struct kvs_attn_meta m;
    int32_t h_qs[2], h_pos[1];
};

static struct kvs_dbuf *kc, *vc;

static void one_init(struct one *x)
{
    memset(x, 0, sizeof *x);
    x->q = O->alloc(be, KVS_BUF_ACT, NH * HD);
    x->out = O->alloc(be, KVS_BUF_ACT, NH * HD);
    x->lse = O->alloc(be, KVS_BUF_F32, NH);
    x->qs = O->alloc(be, KVS_BUF_I32, 2);
    x->pos = O->alloc(be, KVS_BUF_I32, 1);
    x->bt = O->alloc(be, KVS_BUF_I32, NPAGES);
    x->n_sp = O->alloc(be, KVS_BUF_I32, NKV);
    x->sp = O->alloc(be, KVS_BUF_I32, NKV * NPAGES * 2);
    REQUIRE(x->q && x->out && x->lse && x->qs && x->pos && x->bt && x->n_sp && x->sp, "alloc");
    int32_t bt[NPAGES];
    for (int i = 0; i < NPAGES; i++) bt[i] = NPAGES - 1 - i;   /* blocks in reverse order */
    O->upload(be, x->bt, 0, bt, NPAGES);
    x->h_qs[0] = 0, x->h_qs[1] = 1;
    O->upload(be, x->qs, 0, x->h_qs, 2);
    x->m = (struct kvs_attn_meta){.n_seqs = 1, .max_blocks = NPAGES, .q_start = x->qs, .pos = x->pos,
                                  .block_tables = x->bt, .h_q_start = x->h_qs, .h_pos = x->h_pos};
}

/* attention of query q (frozen, [NH][HD]) at position pos over spans[g] (n[g] spans per head) */
static void attend(struct one *x, const float *q, int pos, const int32_t *n, const int32_t *spans, float *o, float *l)
{
    x->h_pos[0] = pos;
    x->m.max_ctx = pos + 1;
    O->upload(be, x->pos, 0, x->h_pos, 1);
    O->upload(be, x->q, 0, q, NH * HD);
    O->upload(be, x->n_sp, 0, n, NKV);
    O->upload(be, x->sp, 0, spans, NKV * NPAGES * 2);
    const struct kvs_span_list sl = {NPAGES, x->n_sp, x->sp, n, spans};
    O->attention_spans(be, x->q, kc, vc, &x->m, &sl, 1, NH, NKV, HD, PS, 1.0f / sqrtf((float)HD), x->out, x->lse);
    O->download(be, o, x->out, 0, NH * HD);
    O->download(be, l, x->lse, 0, NH);
}

/* spans of a page flag set, clipped to pos */
static int flags_to_spans(const unsigned char *f, int pos, int32_t *sp)
{
    int n = 0;
    for (int p = 0; p * PS <= pos; p++) {
        if (!f[p]) continue;
        const int lo = p * PS, hi = lo + PS < pos + 1 ? lo + PS : pos + 1;
        if (n > 0 && sp[2 * n - 1] == lo) sp[2 * n - 1] = hi;
        else sp[2 * n] = lo, sp[2 * n + 1] = hi, n++;
    }
    return n;
}

static void run_window(int w)
{
    static float q[T][NH * HD], o[T][NH * HD], l[T][NH];
    static unsigned char seen[T][NKV][NPAGES];        /* union of pages shown to each query */
    static int32_t sel[T][NKV][NPAGES];
    int n_sel[T][NKV];
    int32_t A[NKV][NPAGES], M[NPAGES];
    struct one x;
    one_init(&x);
    for (int t = 0; t < T; t++)
        for (int i = 0; i < NH * HD; i++) q[t][i] = frand();
    memset(seen, 0, sizeof seen);
    for (int g = 0; g < NKV; g++)
        for (int p = 0; p < NPAGES; p++) A[g][p] = -1;
    int bad_causal = 0, merges = 0, bitwise = 1;
    double err = 0, union_keys = 0, own_keys = 0;
    float *o_sup = kvs_xmalloc(NH * HD * sizeof(float)), l_sup[NH];
    struct kvs_dbuf *oa = O->alloc(be, KVS_BUF_ACT, NH * HD), *la = O->alloc(be, KVS_BUF_F32, NH);
    struct kvs_dbuf *ob = O->alloc(be, KVS_BUF_ACT, NH * HD), *lb = O->alloc(be, KVS_BUF_F32, NH);
    REQUIRE(oa && la && ob && lb, "alloc");
    for (int t = 0; t < T; t++) {
        const int pos = P0 + t, cur = pos / PS;
        int32_t n[NKV], sp[NKV * NPAGES * 2];
        unsigned char f[NPAGES];
        for (int g = 0; g < NKV; g++) {
            memset(f, 0, sizeof f);
            f[cur] = 1;
            for (int k = 0; k < PICK; k++) f[kvs_test_xorshift(&rng) % (uint32_t)cur] = 1;
            n_sel[t][g] = 0;
            for (int p = 0; p <= cur; p++)
                if (f[p]) sel[t][g][n_sel[t][g]++] = p, seen[t][g][p] = 1;
            n[g] = flags_to_spans(f, pos, sp + g * NPAGES * 2);
        }
        attend(&x, q[t], pos, n, sp, o[t], l[t]);
        /* the mask, then each past query of the window gets what it has not seen */
        for (int g = 0; g < NKV; g++) {
            REQUIRE(kvs_retro_mask_step(A[g], NPAGES, sel[t][g], n_sel[t][g], cur, t, M) == 0, "mask");
            for (int tp = t - 1; tp > t - w && tp >= 0; tp--) {
                int32_t ns[NKV] = {0}, ssp[NKV * NPAGES * 2];
                const int k = kvs_retro_supplement(sel[t][g], M, n_sel[t][g], tp, P0 + tp, PS, ssp + g * NPAGES * 2,
                                                   NPAGES);
                REQUIRE(k >= 0, "supplement: %d", k);
                for (int s = 0; s < k; s++) bad_causal += ssp[g * NPAGES * 2 + 2 * s + 1] > P0 + tp + 1;
                for (int i = 0; i < n_sel[t][g]; i++)
                    if (sel[t][g][i] * PS <= P0 + tp) seen[tp][g][sel[t][g][i]] = 1;
                if (!k) continue;
                ns[g] = k;
                /* supplement for head g only: the other head's spans are empty (lse -inf, merged as nothing) */
                attend(&x, q[tp], P0 + tp, ns, ssp, o_sup, l_sup);
                O->upload(be, oa, 0, o[tp], NH * HD);
                O->upload(be, la, 0, l[tp], NH);
                O->upload(be, ob, 0, o_sup, NH * HD);
                O->upload(be, lb, 0, l_sup, NH);
                O->attn_merge(be, oa, la, ob, lb, 1, NH, HD);
                O->download(be, o[tp], oa, 0, NH * HD);
                O->download(be, l[tp], la, 0, NH);
                merges++;
            }
        }
    }
    /* every query against attention over the union of what it was shown */
    float ref_o[NH * HD], ref_l[NH];
    for (int t = 0; t < T; t++) {
        int32_t n[NKV], sp[NKV * NPAGES * 2];
        for (int g = 0; g < NKV; g++) n[g] = flags_to_spans(seen[t][g], P0 + t, sp + g * NPAGES * 2);
        attend(&x, q[t], P0 + t, n, sp, ref_o, ref_l);
        for (int i = 0; i < NH * HD; i++) {
            const double e = fabs((double)o[t][i] - ref_o[i]);
            err = e > err ? e : err;
            bitwise &= o[t][i] == ref_o[i];
        }
        for (int h = 0; h < NH; h++) err = fabs((double)l[t][h] - ref_l[h]) > err ? fabs((double)l[t][h] - ref_l[h]) : err;
        for (int g = 0; g < NKV; g++) {
            for (int p = 0; p * PS <= P0 + t; p++) {
                const int lo = p * PS, hi = lo + PS < P0 + t + 1 ? lo + PS : P0 + t + 1;
                union_keys += seen[t][g][p] ? hi - lo : 0;
            }
            for (int i = 0; i < n_sel[t][g]; i++) {
                const int lo = sel[t][g][i] * PS, hi = lo + PS < P0 + t + 1 ? lo + PS : P0 + t + 1;
                own_keys += hi - lo;
            }
        }
    }
    CHECK(bad_causal == 0, "w=%d: %d supplement spans reach past their query", w, bad_causal);
    CHECK(err < 2e-6, "w=%d: merged outputs differ from attention over the union by %g", w, err);
    if (w == 1) CHECK(merges == 0 && bitwise, "w=1: %d merges, bitwise %d", merges, bitwise);
    printf("ok retro w=%d: %d merges, merged = attention over the union (max err %.1e), no later key, effective "
           "budget %.3fx the step's own\n",
           w, merges, err, union_keys / own_keys);
    free(o_sup);
    struct kvs_dbuf *bufs[] = {oa, la, ob, lb, x.q, x.out, x.lse, x.qs, x.pos, x.bt, x.n_sp, x.sp};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) O->free_buf(be, bufs[i]);
}

/* ---- through the policy ---------------------------------------------------------------------- */
#define PS2 2                /* requests */
#define PT 40                /* decode steps */
#define PMB ((P0 + PT + PS - 1) / PS)
#define PMAXW 8

/* bits: kv.quest.digest_bits of the policy, and of the test's own digests that recompute its
 * selection (the same CPU kernels on the same keys: the same selection) */
static void run_policy(int w, int bits)
{
    const struct kvs_kv_decode_ops *dp = kvs_kv_find_decode("retro");
    REQUIRE(dp, "retro is not registered");
    struct kvs_config cfg;
    kvs_config_init(&cfg);
    cfg.quest_budget_ratio = 0.15;
    cfg.quest_min_budget = 48;
    cfg.quest_dense_layers = 0;
    cfg.retro_window = w;
    cfg.quest_digest_bits = bits;
    const int nb = PS2 * PMB, max_rows = PS2 * P0;
    const size_t nkv_el = (size_t)nb * NKV * PS * HD;
    const struct kvs_kv_decode_env env = {O, be, &cfg, 1, NH, NKV, HD, PS, PS2, max_rows, PMB, 2 * NKV * HD * 4, nb, NULL};
    void *st;
    char err[256];
    REQUIRE(dp->create(&env, &st, err, sizeof err) == 0, "create: %s", err);
    const size_t sb = dp->seq_bytes(st);
    unsigned char *arena = kvs_xcalloc(PS2, sb);
    for (int s = 0; s < PS2; s++) REQUIRE(dp->seq_init(st, s, arena + (size_t)s * sb) == 0, "seq_init");
    /* the cache, block tables (interleaved), frozen queries */
    struct kvs_dbuf *k2 = O->alloc(be, KVS_BUF_KV, nkv_el), *v2 = O->alloc(be, KVS_BUF_KV, nkv_el);
    struct kvs_dbuf *q = O->alloc(be, KVS_BUF_ACT, (size_t)max_rows * NH * HD);
    struct kvs_dbuf *out = O->alloc(be, KVS_BUF_ACT, (size_t)max_rows * NH * HD);
    struct kvs_dbuf *lse = O->alloc(be, KVS_BUF_F32, (size_t)max_rows * NH);
    struct kvs_dbuf *d_qs = O->alloc(be, KVS_BUF_I32, PS2 + 1), *d_pos = O->alloc(be, KVS_BUF_I32, PS2);
    struct kvs_dbuf *d_bt = O->alloc(be, KVS_BUF_I32, PS2 * PMB), *dig = bits < 16 ? O->alloc(be, KVS_BUF_I32, kvs_quest_qdig_words((size_t)nb, NKV, HD, bits))
                                                        : O->alloc(be, KVS_BUF_KV, (size_t)nb * NKV * 2 * HD);
    struct kvs_dbuf *d_keep = O->alloc(be, KVS_BUF_I32, PS2), *d_sc = O->alloc(be, KVS_BUF_F32, PS2 * NKV * PMB);
    struct kvs_dbuf *d_nsel = O->alloc(be, KVS_BUF_I32, PS2 * NKV), *d_sel = O->alloc(be, KVS_BUF_I32, PS2 * NKV * PMB * 2);
    struct kvs_dbuf *d_nq = O->alloc(be, KVS_BUF_I32, PS2 + 1), *d_np = O->alloc(be, KVS_BUF_I32, PS2);
    struct kvs_dbuf *qn = O->alloc(be, KVS_BUF_ACT, PS2 * NH * HD), *d_sc2 = O->alloc(be, KVS_BUF_F32, PS2 * NKV * PMB);
    REQUIRE(k2 && v2 && q && out && lse && d_qs && d_pos && d_bt && dig && d_keep && d_sc && d_nsel && d_sel && d_nq &&
            d_np && qn && d_sc2, "alloc");
    float *h = kvs_xmalloc(nkv_el * sizeof *h);
    for (size_t i = 0; i < nkv_el; i++) h[i] = frand();
    O->upload(be, k2, 0, h, nkv_el);
    for (size_t i = 0; i < nkv_el; i++) h[i] = frand();
    O->upload(be, v2, 0, h, nkv_el);
    free(h);
    int32_t bt[PS2 * PMB];
    for (int s = 0; s < PS2; s++)
        for (int j = 0; j < PMB; j++) bt[s * PMB + j] = j * PS2 + (PS2 - 1 - s);
    O->upload(be, d_bt, 0, bt, PS2 * PMB);
    static float qf[PS2][P0 + PT][NH * HD];          /* the frozen query of each position */
    for (int s = 0; s < PS2; s++)
        for (int t = 0; t < P0 + PT; t++)
            for (int i = 0; i < NH * HD; i++) qf[s][t][i] = 2 * frand();
    static unsigned char seen[PS2][PT][NKV][PMB];
    static float fo[PS2][PT][NH * HD], fl[PS2][PT][NH];
    memset(seen, 0, sizeof seen);
    const struct kvs_quest_kernels *K = &kvs_quest_kernels_cpu;
    static float rows_q[PS2 * P0 * NH * HD];
    int32_t qs[PS2 + 1], pos[PS2], slot[PS2] = {0, 1}, dec[PS2];
    for (int step = 0; step <= PT; step++) {
        /* step 0: both prompts (positions 0 .. P0 - 1) as prefill; then decode steps */
        qs[0] = 0;
        for (int s = 0; s < PS2; s++) {
            const int k = step ? dp->recompute(st, s) : 0;
            const int newest = step ? P0 + step - 1 : P0 - 1;
            REQUIRE(k <= w - 1 && k <= step - 1 + (step == 0), "recompute %d at step %d", k, step);
            pos[s] = step ? newest - k : 0;
            qs[s + 1] = qs[s] + (step ? k + 1 : P0);
            dec[s] = step > 0;
            for (int r = 0; r < qs[s + 1] - qs[s]; r++)
                memcpy(rows_q + (size_t)(qs[s] + r) * NH * HD, qf[s][pos[s] + r], sizeof qf[s][0]);
        }
        const int n = qs[PS2];
        O->upload(be, q, 0, rows_q, (size_t)n * NH * HD);
        O->upload(be, d_qs, 0, qs, PS2 + 1);
        O->upload(be, d_pos, 0, pos, PS2);
        const struct kvs_attn_meta m = {.n_seqs = PS2, .max_blocks = PMB, .q_start = d_qs, .pos = d_pos,
                                        .block_tables = d_bt, .h_q_start = qs, .h_pos = pos,
                                        .max_ctx = pos[PS2 - 1] + qs[PS2] - qs[PS2 - 1]};
        const struct kvs_kv_step sp = {PS2, n, qs, pos, slot, dec, &m, NULL, 0};
        const struct kvs_kv_attend a = {&sp, q, NULL, {k2, v2, NULL, NULL, 0}, NH, NKV, HD, PS,
                                        1.0f / sqrtf((float)HD), out, lse};
        REQUIRE(dp->plan(st, &sp) == 0, "plan at step %d", step);
        dp->attend(st, 0, &a);
        dp->finish(st, 0, &sp);
        if (bits < 16)   /* the test's own digests, same updates */
            K->qdigest_update(be, k2, &m, NKV, HD, PS, PS, bits, (size_t)nb, dig);
        else
            K->digest_update(be, k2, &m, NKV, HD, PS, PS, dig);
        if (!step) continue;
        /* Quest's selection of each newest query, recomputed: what every query of the window saw */
        int32_t keep[PS2], nq[PS2 + 1] = {0, 1, 2}, np[PS2];
        for (int s = 0; s < PS2; s++) {
            np[s] = P0 + step - 1;
            const int ctx = np[s] + 1, cur = np[s] / PS;
            int kp = (int)ceil(fmax(48.0, ceil(0.15 * ctx)) / PS);
            keep[s] = kp > cur + 1 ? cur + 1 : kp;
            O->upload(be, qn, (size_t)s * NH * HD, qf[s][np[s]], NH * HD);
        }
        O->upload(be, d_keep, 0, keep, PS2);
        O->upload(be, d_nq, 0, nq, PS2 + 1);
        O->upload(be, d_np, 0, np, PS2);
        struct kvs_attn_meta nm = m;
        nm.q_start = d_nq, nm.pos = d_np, nm.h_q_start = nq, nm.h_pos = np;
        if (bits < 16)
            K->qscore(be, qn, dig, &nm, d_keep, PS2, NH, NKV, HD, PS, PS, bits, (size_t)nb, PMB, d_sc);
        else
            K->score(be, qn, dig, &nm, d_keep, PS2, NH, NKV, HD, PS, PS, PMB, d_sc);
        K->select(be, d_sc, &nm, d_keep, PS2, NKV, PS, PMB, PMB, d_nsel, d_sel);
        /* the same scores from the step's rows in place (kv_quest.h score: the last row of each
         * sequence of q_start), as the policy asks for them: bitwise the gathered rows' */
        struct kvs_attn_meta wm = nm;
        wm.q_start = d_qs, wm.h_q_start = qs;
        if (bits < 16)
            K->qscore(be, q, dig, &wm, d_keep, PS2, NH, NKV, HD, PS, PS, bits, (size_t)nb, PMB, d_sc2);
        else
            K->score(be, q, dig, &wm, d_keep, PS2, NH, NKV, HD, PS, PS, PMB, d_sc2);
        {
            static float s1[PS2 * NKV * PMB], s2[PS2 * NKV * PMB];
            O->download(be, s1, d_sc, 0, PS2 * NKV * PMB);
            O->download(be, s2, d_sc2, 0, PS2 * NKV * PMB);
            int same = 1;
            for (int s = 0; s < PS2; s++)
                if (keep[s] <= np[s] / PS)
                    for (int g = 0; g < NKV; g++)
                        same &= !memcmp(s1 + ((size_t)s * NKV + g) * PMB, s2 + ((size_t)s * NKV + g) * PMB,
                                        (size_t)(np[s] / PS) * sizeof(float));
            CHECK(same, "step %d: the scores of the rows in place differ from the gathered rows'", step);
        }
        int32_t nsel[PS2 * NKV], sel[PS2 * NKV * PMB * 2];
        O->download(be, nsel, d_nsel, 0, PS2 * NKV);
        O->download(be, sel, d_sel, 0, PS2 * NKV * PMB * 2);
        const int t = step - 1;
        for (int s = 0; s < PS2; s++) {
            for (int g = 0; g < NKV; g++) {
                const int32_t *spn = sel + ((size_t)s * NKV + g) * PMB * 2;
                for (int i = 0; i < nsel[s * NKV + g]; i++)
                    for (int p = spn[2 * i] / PS; p * PS < spn[2 * i + 1]; p++)
                        for (int tp = t; tp > t - w && tp >= 0; tp--)
                            if (p * PS <= P0 + tp) seen[s][tp][g][p] = 1;
            }
            /* the outputs of this step's rows: query t - back for row k - back */
            const int rows = qs[s + 1] - qs[s];
            for (int r = 0; r < rows; r++) {
                const int tq = t - (rows - 1 - r);
                O->download(be, fo[s][tq], out, (size_t)(qs[s] + r) * NH * HD, NH * HD);
                O->download(be, fl[s][tq], lse, (size_t)(qs[s] + r) * NH, NH);
            }
        }
    }
    /* queries whose window has passed (their last supplement is in) against the union */
    double err_max = 0;
    int bitwise = 1, checked = 0;
    for (int s = 0; s < PS2; s++)
        for (int t = 0; t + w - 1 < PT; t++) {
            int32_t n[NKV], sp[NKV * NPAGES * 2];
            unsigned char f[NPAGES];
            for (int g = 0; g < NKV; g++) {
                memset(f, 0, sizeof f);
                for (int p = 0; p < PMB && p < NPAGES; p++) f[p] = seen[s][t][g][p];
                n[g] = flags_to_spans(f, P0 + t, sp + g * NPAGES * 2);
            }
            /* the reference over the test's own single-sequence view: blocks of request s */
            int32_t bts[NPAGES];
            for (int j = 0; j < NPAGES; j++) bts[j] = j < PMB ? bt[s * PMB + j] : 0;
            struct one x;
            one_init(&x);
            O->upload(be, x.bt, 0, bts, NPAGES);
            float ro[NH * HD], rl[NH];
            struct kvs_dbuf *sk = kc, *sv = vc;
            kc = k2, vc = v2;
            attend(&x, qf[s][P0 + t], P0 + t, n, sp, ro, rl);
            kc = sk, vc = sv;
            for (int i = 0; i < NH * HD; i++) {
                const double e = fabs((double)fo[s][t][i] - ro[i]);
                err_max = e > err_max || e != e ? e : err_max;
                bitwise &= fo[s][t][i] == ro[i];
            }
            for (int hh = 0; hh < NH; hh++) {
                const double e = fabs((double)fl[s][t][hh] - rl[hh]);
                err_max = e > err_max || e != e ? e : err_max;
            }
            checked++;
            struct kvs_dbuf *bufs[] = {x.q, x.out, x.lse, x.qs, x.pos, x.bt, x.n_sp, x.sp};
            for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) O->free_buf(be, bufs[i]);
        }
    struct kvs_kv_counter c[32];
    const int nc = dp->counters(st, c, 32);
    double eff = 0;
    for (int i = 0; i < nc; i++)
        if (!strcmp(c[i].name, "kvserve:kv_retro_effective_budget")) eff = c[i].value;
    CHECK(checked > 0 && err_max < 2e-6, "policy w=%d, %d-bit digests: merged outputs differ from attention over the "
          "union by %g", w, bits, err_max);
    if (w == 1) CHECK(bitwise, "policy w=1, %d-bit digests: outputs are not their own selection's, bitwise", bits);
    if (w > 1) CHECK(eff > 1.0, "policy w=%d, %d-bit digests: effective budget %g", w, bits, eff);
    printf("ok policy retro w=%d, %d-bit digests, one layer, frozen q: %d queries = attention over the union of their "
           "window's selections (max err %.1e), effective budget %.3fx\n", w, bits, checked, err_max, eff);
    for (int s = 0; s < PS2; s++) dp->seq_free(st, s);
    dp->destroy(st);
    free(arena);
    struct kvs_dbuf *bufs[] = {k2, v2, q, out, lse, d_qs, d_pos, d_bt, dig, d_keep, d_sc, d_nsel, d_sel, d_nq, d_np, qn, d_sc2};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) O->free_buf(be, bufs[i]);
    kvs_config_free(&cfg);
}

int main(void)
{
    char err[256];
    be = O->create(1, err, sizeof err);
    REQUIRE(be, "%s", err);
    const size_t n = (size_t)NPAGES * NKV * PS * HD;
    float *h = kvs_xmalloc(n * sizeof *h);
    kc = O->alloc(be, KVS_BUF_KV, n);
    vc = O->alloc(be, KVS_BUF_KV, n);
    REQUIRE(kc && vc, "alloc");
    for (size_t i = 0; i < n; i++) h[i] = frand();
    O->upload(be, kc, 0, h, n);
    for (size_t i = 0; i < n; i++) h[i] = frand();
    O->upload(be, vc, 0, h, n);
    free(h);
    static const int W[] = {1, 2, 4, 8};
    for (size_t i = 0; i < sizeof W / sizeof W[0]; i++) run_window(W[i]);
    for (size_t i = 0; i < sizeof W / sizeof W[0]; i++) {
        run_policy(W[i], 16);
        run_policy(W[i], 8);
    }
    run_policy(2, 4);
    /* malformed selections */
    int32_t A[8] = {-1, -1, -1, -1, -1, -1, -1, -1}, M[8], bad1[2] = {3, 2}, bad2[1] = {9};
    CHECK(kvs_retro_mask_step(A, 8, bad1, 2, 3, 0, M) == -EINVAL, "unsorted selection accepted");
    CHECK(kvs_retro_mask_step(A, 8, bad2, 1, 3, 0, M) == -EINVAL, "page out of range accepted");
    O->free_buf(be, kc);
    O->free_buf(be, vc);
    O->free(be);
    return kvs_test_summary("test_kv_retro");
}
