/* kvserve_questbench_main.c: Quest's attention phase (kv.decode=quest: kernels/kv_quest.h on the
 * CUDA backend plus attention_spans) against full attention() on the same data, ->
 * build/kvserve-questbench.
 *
 * One layer of the Llama-3.1-8B attention shape (32 query heads, 8 KV heads, head_dim 128, bf16
 * K/V in a paged pool of 16-slot blocks dealt at random, random keys and queries), B decode rows
 * (one per sequence, at the context's last position). Quest's phase is what the policy runs in a
 * selecting layer: the digest refresh of the page each row wrote, the page scores, the top-k
 * select with its spans, and attention_spans over the kept pages, budget max(256, ratio x n)
 * tokens (ratio 0.15 unless --ratio). Each call sequence is timed alone with the L2 flushed
 * before it (the first kernel's launch waits for the flush, so launches stay out of the timing),
 * median of --reps. Printed per shape: pages kept per row, full ms, Quest ms, of which selection
 * (digest + score + select) ms (and digest + score alone), the attention over the spans alone, full / Quest, the selection's
 * share of Quest's time, and the layer mix of a 32-layer model with layers 0-1 dense; one row
 * per --digest-bits value (kv.quest.digest_bits: 16 bf16 digests, 8 / 4 quantized), and the K/V
 * bandwidth of full attention and of the attention over the kept pages (bytes of the keys and
 * values each reads, over its time).
 *
 * --paths runs each shape with score_select on each path (kvs_quest_cuda_select_path: 0 by shape,
 * 1 score then select, 2 fused, 3 fused at 512 threads; plus 4: the digest refresh passed to
 * score_select (the policy's call in a decode-only step) instead of its own launch, with path - 4)
 * in the same run, and says whether its spans equal the two kernels' bitwise (column "same").
 *
 * --span-kinds sweeps attention_spans' kind (kvs_cuda_set_span_kernel, kernels/cuda/kv_span.h): each
 * entry 100 x kind + the least tiles a split (104: kind 1 at 4 tiles, 302: kind 3 at 2; 0: the defaults), each
 * its own rows (column "spans"), the spans timed again under each; 1000 + an entry (1304)
 * runs it with the splits' merge of before (kvs_cuda_set_span_merge(1): serial loads).
 *
 * --score-shapes sweeps the score kernels' launch shape (kvs_quest_cuda_score_shape): each entry
 * d (the default rule), bN (pages per block sized for N blocks per SM) or pN (N pages per block)
 * gives its own row per digest width (column "shape"); a trailing s (ds, b8s) runs that row with
 * the Quest kernels' serial loads (kvs_quest_cuda_serial_loads: the loops of before the batched
 * loads), for their A/B in one run; tN (dt256, dst1024) runs it with N-thread select blocks
 * (kvs_quest_cuda_select_threads).
 *
 * --super NxF[,NxF...] adds, per shape and digest width, Quest's phase with the two-level selection
 * (kernels/kv_quest.h super_select; kv.quest.super_pages N, kv.quest.super_keep F) in the same run as
 * the one-level path 0 (the default) and path 4 (the refresh folded into the score launch, as the
 * policy's decode-only steps run it): one row each (column "super"), the selection being the digest
 * refresh plus super_select with each row's last super-page refreshed (as at a page boundary, the
 * steady state's most), in both forms (kvs_quest_cuda_super_path 1: one block a row and KV head; 2:
 * split over three launches, checked to give form 1's spans bitwise: "same spans"), "recall" the
 * share of the one-level selection's kept pages that the two-level one keeps too (random keys: a
 * worst case, nothing clusters).
 *
 * Usage: kvserve-questbench [--batches 1,8,32] [--contexts 8192,32768,131072] [--ratio 0.15]
 *                           [--reps 20] [--digest-bits 16,8,4] [--score-shapes d,b8,p128]
 *                           [--paths 0,1,2,3] [--span-kinds 0,104,204] [--markdown FILE]
 * A shape whose KV does not fit in free device memory is skipped with a note.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/bench_util.h"
#include "base/util.h"
#include "kernels/backend.h"
#include "kernels/kv_quest.h"

#if defined(KVS_HAVE_CUDA) && KVS_HAVE_CUDA
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/kv_span.h"
#include "bench/bench_cuda.h"

#define BS 16 /* KV block size (tokens) */

#define FLUSH_FLOATS ((size_t)64 << 20) /* 256 MB: several times the L2 */

static const struct kvs_backend_ops *O = &kvs_cuda_backend;
static const struct kvs_quest_kernels *K;
static uint64_t rng = 0x9e3779b97f4a7c15ull;

struct shape {
    int B, ctx, max_pages, max_spans, bits, fold, sup;   /* sup: use super_select with sa */
    struct kvs_quest_super_args sa;
    size_t n_pages;
    struct kvs_dbuf *kc, *vc, *dig, *qdig8, *qdig4, *q, *out, *lse, *keep, *scores, *nsp, *sp;
    struct kvs_attn_meta m;
    struct kvs_span_list sl;
};

enum { OP_FULL, OP_QUEST, OP_SELECT, OP_SPANS, OP_SCORE };

static void run_op(struct kvs_backend *b, struct shape *S, int op)
{
    const float scale = 0.08838834764831845f; /* 1 / sqrt(128) */
    if (op == OP_FULL) {
        O->attention(b, S->q, S->kc, S->vc, &S->m, S->B, NH, NKV, HD, BS, scale, S->out);
        return;
    }
    if (op != OP_SPANS && S->sup) {   /* the two-level selection (--super) */
        struct kvs_dbuf *qd = S->bits == 8 ? S->qdig8 : S->bits == 4 ? S->qdig4 : S->dig;
        if (S->bits < 16) K->qdigest_update(b, S->kc, &S->m, NKV, HD, BS, BS, S->bits, S->n_pages, qd);
        else K->digest_update(b, S->kc, &S->m, NKV, HD, BS, BS, S->dig);
        S->sa.dig = qd;
        S->sa.bits = S->bits;
        K->super_select(b, &S->sa);
        if (op == OP_SCORE) return;
    } else if (op != OP_SPANS) {
        if (S->bits < 16) {
            struct kvs_dbuf *qd = S->bits == 8 ? S->qdig8 : S->qdig4;
            if (!S->fold || op == OP_SCORE) K->qdigest_update(b, S->kc, &S->m, NKV, HD, BS, BS, S->bits, S->n_pages, qd);
            if (op == OP_SCORE)
                K->qscore(b, S->q, qd, &S->m, S->keep, S->B, NH, NKV, HD, BS, BS, S->bits, S->n_pages, S->max_pages,
                          S->scores);
            else   /* the policy's call: the scores and the select, fused or not (kvs_quest_cuda_select_path) */
                K->score_select(b, S->q, qd, &S->m, S->keep, S->B, NH, NKV, HD, BS, BS, S->bits, S->n_pages,
                                S->max_pages, S->max_spans, S->scores, 0, S->nsp, S->sp, S->fold ? S->kc : NULL,
                                S->fold ? &S->m : NULL);
        } else {
            if (!S->fold || op == OP_SCORE) K->digest_update(b, S->kc, &S->m, NKV, HD, BS, BS, S->dig);
            if (op == OP_SCORE)
                K->score(b, S->q, S->dig, &S->m, S->keep, S->B, NH, NKV, HD, BS, BS, S->max_pages, S->scores);
            else
                K->score_select(b, S->q, S->dig, &S->m, S->keep, S->B, NH, NKV, HD, BS, BS, 16, S->n_pages,
                                S->max_pages, S->max_spans, S->scores, 0, S->nsp, S->sp, S->fold ? S->kc : NULL,
                                S->fold ? &S->m : NULL);
        }
        if (op == OP_SCORE) return;
    }
    if (op != OP_SELECT)
        O->attention_spans(b, S->q, S->kc, S->vc, &S->m, &S->sl, S->B, NH, NKV, HD, BS, scale, S->out, S->lse);
}

/* median ms of reps runs of op, each after an L2 flush */
static float time_op(struct kvs_backend *b, struct shape *S, int op, int reps, struct kvs_dbuf *flush)
{
    float *t = kvs_xmalloc((size_t)reps * sizeof(float));
    for (int r = -2; r < reps; r++) { /* two warm-ups */
        O->zero(b, flush, 0, FLUSH_FLOATS);
        kvs_cuda_timer_start(b);
        run_op(b, S, op);
        const float ms = kvs_cuda_timer_stop_ms(b);
        if (r >= 0) t[r] = ms;
    }
    qsort(t, (size_t)reps, sizeof t[0], bench_cmp_float);
    const float med = t[reps / 2];
    free(t);
    return med;
}

/* --super: the one-level path 0 and each two-level setting, same shape, same run */
static void run_super(struct kvs_backend *b, struct shape *S, int keep, int nblk, float full, int reps,
                      struct kvs_dbuf *flush, const int *dbits, int nd, const int *supN, const double *supF, int nsup,
                      FILE *mf)
{
    const int B = S->B, ctx = S->ctx, cur = (ctx - 1) / BS;
    const size_t nsp_n = (size_t)B * NKV, sp_n = nsp_n * S->max_spans * 2;
    int32_t *rn = kvs_xmalloc(nsp_n * 4), *rsp = kvs_xmalloc(sp_n * 4), *gn = kvs_xmalloc(nsp_n * 4), *gsp = kvs_xmalloc(sp_n * 4);
    unsigned char *kr = kvs_xmalloc((size_t)nblk + 1), *kg = kvs_xmalloc((size_t)nblk + 1);
    for (int si = 0; si < nsup; si++) {
        const int N = supN[si], max_super = (nblk + N - 1) / N, nsupr = (cur + N - 1) / N;
        const double kk = ceil(supF[si] * (double)(keep - 1) / N) + 1;
        const int skeep = kk >= nsupr ? nsupr : (int)kk;
        struct kvs_dbuf *sdig = bench_dalloc(b, KVS_BUF_F32, (size_t)B * max_super * NKV * 2 * HD);
        struct kvs_dbuf *d_sk = bench_dalloc(b, KVS_BUF_I32, (size_t)B), *d_rs = bench_dalloc(b, KVS_BUF_I32, (size_t)B);
        struct kvs_dbuf *d_rn = bench_dalloc(b, KVS_BUF_I32, (size_t)B);
        struct kvs_dbuf *d_refs = bench_dalloc(b, KVS_BUF_I32, (size_t)B * max_super * (2 + N));
        int32_t *h = kvs_xcalloc((size_t)B * max_super * (2 + N), 4), *hv = kvs_xmalloc((size_t)B * 4);
        int32_t *bt = kvs_xmalloc((size_t)B * nblk * 4);
        O->download(b, bt, S->m.block_tables, 0, (size_t)B * nblk);
        for (int s = 0; s < B; s++)
            for (int j = 0; j < nsupr; j++) {
                int32_t *e = h + ((size_t)s * max_super + j) * (2 + N);
                e[0] = j, e[1] = cur - j * N < N ? cur - j * N : N;
                for (int t = 0; t < e[1]; t++) e[2 + t] = bt[(size_t)s * nblk + j * N + t];
            }
        O->upload(b, d_refs, 0, h, (size_t)B * max_super * (2 + N));
        for (int s = 0; s < B; s++) hv[s] = skeep;
        O->upload(b, d_sk, 0, hv, (size_t)B);
        for (int s = 0; s < B; s++) hv[s] = s;
        O->upload(b, d_rs, 0, hv, (size_t)B);
        S->sa = (struct kvs_quest_super_args){
            .q = S->q, .sdig = sdig, .m = &S->m, .keep = S->keep, .skeep = d_sk, .rslot = d_rs, .refs = d_refs,
            .ref_n = d_rn, .n = B, .n_heads = NH, .n_kv_heads = NKV, .head_dim = HD, .block_size = BS, .page_size = BS,
            .n_pages = S->n_pages, .max_pages = S->max_pages, .max_spans = S->max_spans, .super_pages = N,
            .max_super = max_super, .max_ref = max_super, .scores = S->scores, .n_spans = S->nsp, .spans = S->sp};
        for (int di = 0; di < nd; di++) {
            S->bits = dbits[di];
            /* the one-level path's spans and times (path 0, the default) */
            S->sup = 0, S->fold = 0;
            kvs_quest_cuda_select_path(0);
            run_op(b, S, OP_SELECT);
            O->download(b, rn, S->nsp, 0, nsp_n);
            O->download(b, rsp, S->sp, 0, sp_n);
            const float q1 = time_op(b, S, OP_QUEST, reps, flush), s1 = time_op(b, S, OP_SELECT, reps, flush);
            S->fold = 1;   /* the policy's decode-only step: the refresh in the score launch (path 4) */
            const float q1f = time_op(b, S, OP_QUEST, reps, flush), s1f = time_op(b, S, OP_SELECT, reps, flush);
            S->fold = 0;
            /* two-level: every super-page built once, then the steady state's one ref a row */
            S->sup = 1;
            for (int s = 0; s < B; s++) hv[s] = nsupr;
            O->upload(b, d_rn, 0, hv, (size_t)B);
            run_op(b, S, OP_SELECT);
            for (int s = 0; s < B; s++) {
                hv[s] = 1;
                int32_t *e = h + (size_t)s * max_super * (2 + N), *last = h + ((size_t)s * max_super + nsupr - 1) * (2 + N);
                memcpy(e, last, (size_t)(2 + N) * 4);   /* slot 0 of the row's refs: its last super-page */
            }
            O->upload(b, d_refs, 0, h, (size_t)B * max_super * (2 + N));
            O->upload(b, d_rn, 0, hv, (size_t)B);
            kvs_quest_cuda_super_path(1);   /* the one-block kernel (quest11) */
            const float q2 = time_op(b, S, OP_QUEST, reps, flush), s2 = time_op(b, S, OP_SELECT, reps, flush);
            run_op(b, S, OP_SELECT);
            O->download(b, gn, S->nsp, 0, nsp_n);
            O->download(b, gsp, S->sp, 0, sp_n);
            kvs_quest_cuda_super_path(2);   /* split over three launches (quest12, the default) */
            const float q3 = time_op(b, S, OP_QUEST, reps, flush), s3 = time_op(b, S, OP_SELECT, reps, flush);
            run_op(b, S, OP_SELECT);
            kvs_quest_cuda_super_path(0);
            int32_t *xn = kvs_xmalloc(nsp_n * 4), *xsp = kvs_xmalloc(sp_n * 4);
            O->download(b, xn, S->nsp, 0, nsp_n);
            O->download(b, xsp, S->sp, 0, sp_n);
            int same = !memcmp(xn, gn, nsp_n * 4);
            for (size_t p = 0; same && p < nsp_n; p++)
                same = !memcmp(xsp + p * S->max_spans * 2, gsp + p * S->max_spans * 2, (size_t)gn[p] * 2 * 4);
            free(xn), free(xsp);
            /* restore the refs of every super-page for the next width */
            for (int s = 0; s < B; s++)
                for (int t = 0; t < 2 + N; t++) h[(size_t)s * max_super * (2 + N) + t] = t == 0 ? 0 : t == 1 ? (cur < N ? cur : N) : bt[(size_t)s * nblk + t - 2];
            O->upload(b, d_refs, 0, h, (size_t)B * max_super * (2 + N));
            double both = 0, ref = 0;
            for (size_t p = 0; p < nsp_n; p++) {
                memset(kr, 0, (size_t)nblk + 1), memset(kg, 0, (size_t)nblk + 1);
                for (int i = 0; i < rn[p]; i++)
                    for (int x = rsp[p * S->max_spans * 2 + 2 * i] / BS; x * BS < rsp[p * S->max_spans * 2 + 2 * i + 1]; x++) kr[x] = 1;
                for (int i = 0; i < gn[p]; i++)
                    for (int x = gsp[p * S->max_spans * 2 + 2 * i] / BS; x * BS < gsp[p * S->max_spans * 2 + 2 * i + 1]; x++) kg[x] = 1;
                for (int x = 0; x < cur; x++) ref += kr[x], both += kr[x] && kg[x];
            }
            printf("super %6d %8d %4d N=%-3d F=%-4.2g keep %d/%d supers, %d candidates: full %.3f ms; one-level Quest %.3f "
                   "(selection %.3f, %.1f%%, full/Quest %.2f); one-level folded %.3f (selection %.3f, %.1f%%, full/Quest "
                   "%.2f); two-level one-block Quest %.3f (selection %.3f, %.1f%%, full/Quest %.2f); two-level split %.3f "
                   "(selection %.3f, %.1f%%, full/Quest %.2f, same spans %s); recall %.3f\n", B, ctx, S->bits, N, supF[si],
                   skeep, nsupr, skeep * N < cur ? skeep * N : cur, full, q1, s1, 100.0 * s1 / q1, full / q1, q1f, s1f,
                   100.0 * s1f / q1f, full / q1f, q2, s2, 100.0 * s2 / q2, full / q2, q3, s3, 100.0 * s3 / q3, full / q3,
                   same ? "yes" : "NO", ref > 0 ? both / ref : 1.0);
            fflush(stdout);
            if (mf)
                fprintf(mf, "| %d | %d | %d | super %dx%g | %d / %d | %.3f | %.3f | %.3f | %.1f%% | %.2f | %.3f | %.3f | %.1f%% | %.2f | "
                        "%.3f | %.3f | %.1f%% | %.2f | %.3f | %.3f | %.1f%% | %.2f | %s | %.3f |\n",
                        B, ctx, S->bits, N, supF[si], skeep, nsupr, full, q1, s1, 100.0 * s1 / q1, full / q1, q1f, s1f,
                        100.0 * s1f / q1f, full / q1f, q2, s2, 100.0 * s2 / q2, full / q2, q3, s3, 100.0 * s3 / q3, full / q3,
                        same ? "yes" : "NO", ref > 0 ? both / ref : 1.0);
        }
        S->sup = 0;
        O->free_buf(b, sdig), O->free_buf(b, d_sk), O->free_buf(b, d_rs), O->free_buf(b, d_rn), O->free_buf(b, d_refs);
        free(h), free(hv), free(bt);
    }
    free(rn), free(rsp), free(gn), free(gsp), free(kr), free(kg);
}

int main(int argc, char **argv)
{
    int batches[8] = {1, 8, 32}, nb = 3, contexts[8] = {8192, 32768, 131072}, nc = 3, reps = 20;
    double ratio = 0.15;
    int dbits[4] = {16, 8, 4}, nd = 3, paths[8] = {0}, np = 1, spk[8] = {0}, nsk = 1;
    const char *md = NULL;
    int supN[8], nsup = 0;
    double supF[8];
    char shapes[16][8] = {"d"};
    int nshape = 1;
    for (int i = 1; i < argc; i++) {
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(argv[i], "--batches") && v) nb = bench_parse_list(argv[++i], batches, 8);
        else if (!strcmp(argv[i], "--contexts") && v) nc = bench_parse_list(argv[++i], contexts, 8);
        else if (!strcmp(argv[i], "--ratio") && v) ratio = atof(argv[++i]);
        else if (!strcmp(argv[i], "--reps") && v) reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--markdown") && v) md = argv[++i];
        else if (!strcmp(argv[i], "--digest-bits") && v) nd = bench_parse_list(argv[++i], dbits, 4);
        else if (!strcmp(argv[i], "--paths") && v) np = bench_parse_list(argv[++i], paths, 8);
        else if (!strcmp(argv[i], "--span-kinds") && v) nsk = bench_parse_list(argv[++i], spk, 8);
        else if (!strcmp(argv[i], "--super") && v) {
            for (const char *t = argv[++i]; *t && nsup < 8;) {
                char *e;
                supN[nsup] = (int)strtol(t, &e, 10);
                supF[nsup] = *e == 'x' ? strtod(e + 1, &e) : 0;
                if (supN[nsup] <= 0 || !(supF[nsup] >= 1) || (*e && *e != ',')) {
                    nsup = -1;
                    break;
                }
                nsup++;
                t = *e ? e + 1 : e;
            }
        }
        else if (!strcmp(argv[i], "--score-shapes") && v) {
            nshape = 0;
            for (const char *t = argv[++i]; *t && nshape < 16;) {
                const size_t n = strcspn(t, ",");
                if (!n || n >= sizeof shapes[0] || (t[0] != 'd' && t[0] != 'b' && t[0] != 'p') ||
                    (t[0] != 'd' && atoi(t + 1) <= 0)) {
                    nshape = -1;
                    break;
                }
                memcpy(shapes[nshape], t, n);
                shapes[nshape++][n] = 0;
                t += n + (t[n] == ',');
            }
        } else {
            fprintf(stderr, "usage: %s [--batches 1,8,32] [--contexts 8192,32768,131072] [--ratio 0.15] [--reps 20] "
                            "[--digest-bits 16,8,4] [--score-shapes d,b8,p128] [--paths 0,1,2,3,4] [--span-kinds 0,104,204] [--markdown FILE]\n", argv[0]);
            return 2;
        }
    }
    for (int i = 0; i < nd; i++)
        if (dbits[i] != 16 && dbits[i] != 8 && dbits[i] != 4) nd = -1;
    for (int i = 0; i < np; i++)
        if (paths[i] < 0 || paths[i] > 7) np = -1;
    for (int i = 0; i < nsk; i++)
        if (spk[i] < 0 || spk[i] > 1399 || (spk[i] % 1000 && (spk[i] % 1000 / 100 < 1 || spk[i] % 100 < 1))) nsk = -1;
    if (nb <= 0 || nc <= 0 || nd <= 0 || np <= 0 || nsk <= 0 || nshape <= 0 || nsup < 0 || reps <= 0 ||
        !(ratio > 0 && ratio <= 1)) {
        fprintf(stderr, "%s: bad list, --ratio, --reps, --digest-bits (16, 8, 4), --paths (0-7), --span-kinds (0, 1NN, 2NN, 3NN) or --score-shapes (d, bN, pN)\n",
                argv[0]);
        return 2;
    }
    char err[256], desc[256];
    struct kvs_backend *b = bench_cuda_open();
    if (!b) return 1;
    if (!(K = kvs_quest_kernels_for(O, err, sizeof err)) || !O->attention_spans) {
        fprintf(stderr, "%s\n", K ? "the cuda backend has no attention_spans" : err);
        return 1;
    }
    kvs_cuda_device_desc(b, desc, sizeof desc);
    printf("device: %s\nshape: %d query heads, %d KV heads, head_dim %d, pages = blocks of %d; one layer, decode rows; "
           "budget max(256, %.2f n)\n", desc, NH, NKV, HD, BS, ratio);
    FILE *mf = md ? fopen(md, "w") : NULL;
    if (md && !mf) {
        fprintf(stderr, "%s: cannot write %s\n", argv[0], md);
        return 1;
    }
    if (mf)
        fprintf(mf, "| batch | context | digest bits | shape | path | spans | same spans | pages kept | full ms | Quest ms | selection ms | of which digests + "
                    "scores ms | spans ms | full / Quest | selection share | 32 layers, 0-1 dense: full / Quest | full "
                    "TB/s | spans TB/s |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    printf("%6s %8s %4s %5s %4s %5s %4s %11s %9s %9s %9s %9s %9s %10s %9s %10s %8s %8s\n", "batch", "context", "bits",
           "shape", "path", "spans", "same", "kept/pages",
           "full ms", "quest ms", "select ms", "scores ms", "spans ms", "full/quest", "select %", "32L ratio", "full TB/s",
           "span TB/s");
    struct kvs_dbuf *flush = bench_dalloc(b, KVS_BUF_F32, FLUSH_FLOATS);
    for (int bi = 0; bi < nb; bi++)
        for (int ci = 0; ci < nc; ci++) {
            struct shape S;
            memset(&S, 0, sizeof S);
            const int B = batches[bi], ctx = contexts[ci], nblk = (ctx + BS - 1) / BS;
            S.B = B, S.ctx = ctx, S.max_pages = nblk;
            const size_t pool_blocks = (size_t)B * nblk, kv_elems = pool_blocks * NKV * BS * HD;
            if (2 * kv_elems * 2 + kv_elems / BS * 2 * 2 * 2 + ((size_t)512 << 20) > O->mem_available(b)) {
                printf("%6d %8d   skipped: %.1f GB of K/V does not fit\n", B, ctx, 4.0 * kv_elems / 1e9);
                continue;
            }
            double budget = ceil(ratio * ctx);
            if (budget < 256) budget = 256;
            int keep = (int)ceil(budget / BS);
            if (keep > nblk) keep = nblk;
            S.max_spans = keep;
            S.kc = bench_dalloc(b, KVS_BUF_KV, kv_elems);
            S.vc = bench_dalloc(b, KVS_BUF_KV, kv_elems);
            S.n_pages = pool_blocks;
            S.dig = bench_dalloc(b, KVS_BUF_KV, pool_blocks * NKV * 2 * HD);
            S.qdig8 = bench_dalloc(b, KVS_BUF_I32, kvs_quest_qdig_words(pool_blocks, NKV, HD, 8));
            S.qdig4 = bench_dalloc(b, KVS_BUF_I32, kvs_quest_qdig_words(pool_blocks, NKV, HD, 4));
            kvs_cuda_fill_random(b, S.kc, 0, kv_elems, 1.0f, 11);
            kvs_cuda_fill_random(b, S.vc, 0, kv_elems, 1.0f, 12);
            S.q = bench_dalloc(b, KVS_BUF_ACT, (size_t)B * NH * HD);
            kvs_cuda_fill_random(b, S.q, 0, (size_t)B * NH * HD, 1.0f, 13);
            S.out = bench_dalloc(b, KVS_BUF_ACT, (size_t)B * NH * HD);
            S.lse = bench_dalloc(b, KVS_BUF_F32, (size_t)B * NH);
            S.keep = bench_dalloc(b, KVS_BUF_I32, (size_t)B);
            S.scores = bench_dalloc(b, KVS_BUF_F32, (size_t)B * NKV * nblk);
            S.nsp = bench_dalloc(b, KVS_BUF_I32, (size_t)B * NKV);
            S.sp = bench_dalloc(b, KVS_BUF_I32, (size_t)B * NKV * S.max_spans * 2);
            int32_t *perm = bench_shuffled_ids(pool_blocks, &rng);
            int32_t *h_qs = kvs_xmalloc((size_t)(B + 1) * 4), *h_pos = kvs_xmalloc((size_t)B * 4);
            int32_t *h_keep = kvs_xmalloc((size_t)B * 4);
            struct kvs_dbuf *qs = bench_dalloc(b, KVS_BUF_I32, (size_t)B + 1), *pos = bench_dalloc(b, KVS_BUF_I32, (size_t)B);
            struct kvs_dbuf *bt = bench_dalloc(b, KVS_BUF_I32, pool_blocks);
            O->upload(b, bt, 0, perm, pool_blocks);
            /* digests of the whole context: one prefill-shaped refresh (untimed) */
            for (int s = 0; s <= B; s++) h_qs[s] = s * ctx;
            for (int s = 0; s < B; s++) h_pos[s] = 0, h_keep[s] = keep;
            O->upload(b, qs, 0, h_qs, (size_t)B + 1);
            O->upload(b, pos, 0, h_pos, (size_t)B);
            O->upload(b, S.keep, 0, h_keep, (size_t)B);
            S.m = (struct kvs_attn_meta){.n_seqs = B, .max_blocks = nblk, .q_start = qs, .pos = pos, .block_tables = bt,
                                         .h_q_start = h_qs, .h_pos = h_pos, .max_ctx = ctx};
            K->digest_update(b, S.kc, &S.m, NKV, HD, BS, BS, S.dig);
            K->qdigest_update(b, S.kc, &S.m, NKV, HD, BS, BS, 8, S.n_pages, S.qdig8);
            K->qdigest_update(b, S.kc, &S.m, NKV, HD, BS, BS, 4, S.n_pages, S.qdig4);
            /* the decode step: one row per sequence at the last position */
            for (int s = 0; s <= B; s++) h_qs[s] = s;
            for (int s = 0; s < B; s++) h_pos[s] = ctx - 1;
            O->upload(b, qs, 0, h_qs, (size_t)B + 1);
            O->upload(b, pos, 0, h_pos, (size_t)B);
            /* launch planning copies, as the policy gives them: one span with the kept keys' bound */
            int32_t *h_n = kvs_xmalloc((size_t)B * NKV * 4), *h_sp = kvs_xcalloc((size_t)B * NKV * S.max_spans * 2, 4);
            for (int i = 0; i < B * NKV; i++) {
                h_n[i] = 1;
                h_sp[(size_t)i * S.max_spans * 2 + 1] = keep * BS < ctx ? keep * BS : ctx;
            }
            S.sl = (struct kvs_span_list){S.max_spans, S.nsp, S.sp, h_n, h_sp};
            const float full = time_op(b, &S, OP_FULL, reps, flush);
            for (int ki = 0; ki < nsk; ki++) {
                kvs_cuda_set_span_merge(spk[ki] >= 1000);
                kvs_cuda_set_span_kernel(spk[ki] % 1000 / 100, spk[ki] % 100);
                S.bits = 16;
                kvs_quest_cuda_select_path(1);
                S.fold = 0;
                run_op(b, &S, OP_SELECT);   /* the spans the attention below reads */
                const float spans = time_op(b, &S, OP_SPANS, reps, flush);
                /* K and V bytes: every position for full; the kept pages (the last one partial: ctx) */
                const double kvb = 2.0 * NKV * HD * 2, kept_pos = keep * BS < ctx ? (double)(keep - 1) * BS + (ctx - (nblk - 1) * BS) : ctx;
                const double full_tbs = (double)B * ctx * kvb / (full * 1e9), span_tbs = (double)B * kept_pos * kvb / (spans * 1e9);
                const size_t nsp_n = (size_t)B * NKV, sp_n = nsp_n * S.max_spans * 2;
                int32_t *ref_n = kvs_xmalloc(nsp_n * 4), *ref_sp = kvs_xmalloc(sp_n * 4);
                int32_t *got_n = kvs_xmalloc(nsp_n * 4), *got_sp = kvs_xmalloc(sp_n * 4);
                for (int di = 0; di < nd * nshape * np; di++) {
                    const char *sh = shapes[di / np % nshape];
                    const int path = paths[di % np];
                    kvs_quest_cuda_score_shape(sh[0] == 'p' ? atoi(sh + 1) : 0, sh[0] == 'b' ? atoi(sh + 1) : 0);
                    kvs_quest_cuda_serial_loads(strchr(sh, 's') != NULL);
                    kvs_quest_cuda_select_threads(strchr(sh, 't') ? atoi(strchr(sh, 't') + 1) : 0);
                    S.bits = dbits[di / (np * nshape)];
                    if (di % np == 0) {   /* the two kernels' spans: what every path must give */
                        kvs_quest_cuda_select_path(1);
                        S.fold = 0;
                        run_op(b, &S, OP_SELECT);
                        O->download(b, ref_n, S.nsp, 0, nsp_n);
                        O->download(b, ref_sp, S.sp, 0, sp_n);
                    }
                    kvs_quest_cuda_select_path(path & 3);
                    S.fold = path >= 4;
                    const float quest = time_op(b, &S, OP_QUEST, reps, flush);
                    const float sel = time_op(b, &S, OP_SELECT, reps, flush);
                    const float score = time_op(b, &S, OP_SCORE, reps, flush);
                    run_op(b, &S, OP_SELECT);
                    O->download(b, got_n, S.nsp, 0, nsp_n);
                    O->download(b, got_sp, S.sp, 0, sp_n);
                    int same = !memcmp(got_n, ref_n, nsp_n * 4);
                    for (size_t j = 0; same && j < nsp_n; j++)
                        same = !memcmp(got_sp + j * S.max_spans * 2, ref_sp + j * S.max_spans * 2, (size_t)ref_n[j] * 2 * 4);
                    const double model = (32.0 * full) / (2.0 * full + 30.0 * quest);
                    printf("%6d %8d %4d %5s %4d %5d %4s %5d/%-5d %9.3f %9.3f %9.3f %9.3f %9.3f %10.2f %8.1f%% %10.2f %8.2f %8.2f\n", B,
                           ctx, S.bits, sh, path, spk[ki], same ? "yes" : "NO", keep, nblk, full, quest, sel, score, spans, full / quest,
                           100.0 * sel / quest, model, full_tbs, span_tbs);
                    fflush(stdout);
                    if (mf)
                        fprintf(mf, "| %d | %d | %d | %s | %d | %d | %s | %d / %d | %.3f | %.3f | %.3f | %.3f | %.3f | %.2f | %.1f%% | %.2f | %.2f | "
                                "%.2f |\n", B, ctx, S.bits, sh, path, spk[ki], same ? "yes" : "NO", keep, nblk, full, quest, sel, score, spans,
                                full / quest, 100.0 * sel / quest, model, full_tbs, span_tbs);
                }
                kvs_quest_cuda_select_path(0);
                free(ref_n);
                free(ref_sp);
                free(got_n);
                free(got_sp);
            }
            kvs_cuda_set_span_kernel(0, 0);
            kvs_quest_cuda_score_shape(0, 0);
            if (nsup > 0) run_super(b, &S, keep, nblk, full, reps, flush, dbits, nd, supN, supF, nsup, mf);
            struct kvs_dbuf *bufs[] = {S.kc, S.vc, S.dig, S.qdig8, S.qdig4, S.q, S.out, S.lse, S.keep, S.scores, S.nsp, S.sp, qs, pos, bt};
            for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) O->free_buf(b, bufs[i]);
            free(perm);
            free(h_qs);
            free(h_pos);
            free(h_keep);
            free(h_n);
            free(h_sp);
        }
    if (mf) fclose(mf);
    O->free(b);
    return 0;
}

#else
int main(void)
{
    fprintf(stderr, "kvserve-questbench: built without CUDA (nvcc not found)\n");
    return 1;
}
#endif
