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
 * Prints the effective budget (union of keys seen per query / keys of its own step) per w. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/util.h"
#include "kernels/backend.h"
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
    /* malformed selections */
    int32_t A[8] = {-1, -1, -1, -1, -1, -1, -1, -1}, M[8], bad1[2] = {3, 2}, bad2[1] = {9};
    CHECK(kvs_retro_mask_step(A, 8, bad1, 2, 3, 0, M) == -EINVAL, "unsorted selection accepted");
    CHECK(kvs_retro_mask_step(A, 8, bad2, 1, 3, 0, M) == -EINVAL, "page out of range accepted");
    O->free_buf(be, kc);
    O->free_buf(be, vc);
    O->free(be);
    return kvs_test_summary("test_kv_retro");
}
