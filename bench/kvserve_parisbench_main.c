/* kvserve_parisbench_main.c: ParisKV's decode attention phase (kv.decode=paris: kernels/kv_paris.h
 * on the CUDA backend plus attention_spans) against full attention() on the same data, ->
 * build/kvserve-parisbench.
 *
 * One layer of the Llama-3.1-8B attention shape (32 query heads, 8 KV heads, head_dim 128, bf16
 * K/V in a paged pool of 16-slot blocks dealt at random), B decode rows (one per sequence, at
 * the context's last position). Keys are uniform random with 100 needles per (sequence, KV
 * head) planted along the group's mean query; the index is built by the real encoder over the
 * retrieval zone (context - sink 4 - local 64 - a half-full update buffer of 256). ParisKV's
 * phase is what the policy runs per layer in a decode step: select (prep: qbar + SRHT + tiers;
 * vote; keep the top ceil(beta n) by vote; rerank by the 4-bit estimate; top-k + spans) and
 * attention_spans over sink + top-k + tail addressing the pool directly. "offload" is the same
 * step with kv.paris.offload's data path: select, then the gather of sink + top-k (from pinned
 * host pages over UVA: the retrieval zone written out by write_out, one page per pool block) +
 * tail (from the pool) into a per-row staging area, then attention_spans over it; "gather" is
 * that copy alone. Each call sequence is timed
 * alone with the L2 flushed before it, median of --reps; the phase split comes from events
 * inside select (one profiled run). Encode: the time to encode one update interval (512
 * positions per sequence), amortized over the 512 steps it covers. Recall@k of the selection
 * against the exact top-k of qbar.k is printed per shape. The last columns scale one layer to
 * 32 layers (attention phase only: weights and the rest of the step are not in it).
 *
 * Usage: kvserve-parisbench [--batches 1,8] [--contexts 131072,1048576] [--topk 100] [--reps 10]
 *                           [--max-tokens 1048576]
 * Shapes with more than --max-tokens positions in all, or whose K/V + index do not fit, are
 * skipped with a note.
 *
 * Fit (printed after the table, per context): the largest batch of the whole Llama-3.1-8B (32
 * layers, 16.06 GB of bf16 weights) that fits this GPU (its free memory at start, less 2 GiB for
 * activations and workspace) and this host (MemTotal less 8 GiB): full attention keeps all K/V on
 * the GPU (128 KiB a token); ParisKV with kv.paris.offload keeps the index (144 B a token, layer
 * and KV head, as kv_decode_paris.c allocates it) plus a working set of sink + local 64 + update
 * interval 512 + a 2048-token prefill chunk on the GPU and the retrieval zone's K/V in host pages.
 * For each measured batch at that context: step = 32 x the layer's time (full / offload column)
 * + the weights read at the rate full attention's largest measured row read its K/V (measured in
 * this run; a proxy for streaming the weights), and tokens/s = batch / step.
 */
#include <unistd.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/bench_util.h"
#include "base/util.h"
#include "kernels/backend.h"
#include "kernels/kv_paris.h"

#if defined(KVS_HAVE_CUDA) && KVS_HAVE_CUDA
#include "kernels/cuda/cuda_backend.h"
#include "bench/bench_cuda.h"

#define BS 16 /* KV block size (tokens) */

#define SINK 4
#define TAIL 320
#define NEEDLES 100
#define FLUSH_FLOATS ((size_t)64 << 20)

static const struct kvs_backend_ops *O = &kvs_cuda_backend;
static const struct kvs_paris_kernels *K;
static uint64_t rng = 0x9e3779b97f4a7c15ull;

struct shape {
    int B, ctx, topk;
    struct kvs_dbuf *kc, *vc, *q, *out, *lse, *signs, *codes, *w, *counts, *rows, *jobs, *nsp, *sp, *sel, *exact;
    /* offload: host pages, page table, staging area and its one-span list */
    void *hk, *hv;
    struct kvs_dbuf *pages, *stk, *stv, *stbt, *stn, *stsp;
    int stage_blocks, nblk;
    struct kvs_attn_meta stm;
    struct kvs_span_list stl;
    int32_t *h_rows, *h_jobs;
    struct kvs_attn_meta m;
    struct kvs_span_list sl;
};

enum { OP_FULL, OP_PARIS, OP_SELECT, OP_SPANS, OP_ENCODE, OP_OFFLOAD, OP_GATHER };

static void run_op(struct kvs_backend *b, struct shape *S, int op)
{
    const float scale = 0.08838834764831845f;
    if (op == OP_FULL) {
        O->attention(b, S->q, S->kc, S->vc, &S->m, S->B, NH, NKV, HD, BS, scale, S->out);
        return;
    }
    if (op == OP_ENCODE) {
        K->encode(b, S->kc, &S->m, NULL, S->jobs, S->h_jobs, S->B, 0, 1, NKV, HD, BS, S->signs, S->codes, S->w, S->counts);
        return;
    }
    if (op == OP_GATHER || op == OP_OFFLOAD) {
        if (op == OP_OFFLOAD)
            K->select(b, S->q, &S->m, S->rows, S->h_rows, S->B, 0, 1, NH, NKV, HD, BS, S->signs, S->codes, S->w,
                      S->counts, S->topk + 2, S->topk, S->nsp, S->sp, NULL, NULL);
        K->gather(b, S->kc, S->vc, &S->m, S->rows, S->h_rows, S->B, 0, 1, NKV, HD, BS, S->nsp, S->sp, S->topk + 2,
                  S->pages, S->nblk, S->hk, S->hv, S->stk, S->stv, S->stage_blocks);
        if (op == OP_OFFLOAD)
            O->attention_spans(b, S->q, S->stk, S->stv, &S->stm, &S->stl, S->B, NH, NKV, HD, BS, scale, S->out, S->lse);
        return;
    }
    if (op != OP_SPANS)
        K->select(b, S->q, &S->m, S->rows, S->h_rows, S->B, 0, 1, NH, NKV, HD, BS, S->signs, S->codes, S->w, S->counts,
                  S->topk + 2, S->topk, S->nsp, S->sp, NULL, NULL);
    if (op != OP_SELECT)
        O->attention_spans(b, S->q, S->kc, S->vc, &S->m, &S->sl, S->B, NH, NKV, HD, BS, scale, S->out, S->lse);
}

static float time_op(struct kvs_backend *b, struct shape *S, int op, int reps, struct kvs_dbuf *flush)
{
    float *t = kvs_xmalloc((size_t)reps * sizeof(float));
    for (int r = -2; r < reps; r++) {
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

static double urand(void) { return (double)bench_rnd(&rng) / 4294967296.0 * 2 - 1; }

/* 100 needles per (sequence, KV head): noise + s |noise| qbar / |qbar|, s in [0.3, 0.8) */
static void plant_needles(struct kvs_backend *b, struct shape *S, const int32_t *bt, int nblk)
{
    float *q = kvs_xmalloc((size_t)S->B * NH * HD * sizeof *q), row[HD];
    O->download(b, q, S->q, 0, (size_t)S->B * NH * HD);
    const int G = NH / NKV, n_r = S->ctx - SINK - TAIL;
    for (int s = 0; s < S->B; s++)
        for (int g = 0; g < NKV; g++) {
            double qb[HD], n2 = 0;
            for (int i = 0; i < HD; i++) {
                qb[i] = 0;
                for (int h = g * G; h < (g + 1) * G; h++) qb[i] += q[((size_t)s * NH + h) * HD + i] / G;
                n2 += qb[i] * qb[i];
            }
            for (int t = 0; t < NEEDLES; t++) {
                const int p = SINK + (int)(bench_rnd(&rng) % (uint32_t)n_r);
                double nn = 0;
                for (int i = 0; i < HD; i++) row[i] = (float)urand(), nn += (double)row[i] * row[i];
                const double st = 0.3 + 0.5 * t / NEEDLES;
                for (int i = 0; i < HD; i++) row[i] = (float)(row[i] + st * sqrt(nn) * qb[i] / sqrt(n2));
                const size_t off = (((size_t)bt[(size_t)s * nblk + p / BS] * NKV + g) * BS + p % BS) * HD;
                O->upload(b, S->kc, off, row, HD);
            }
        }
    free(q);
}

int main(int argc, char **argv)
{
    int batches[8] = {1, 8}, nb = 2, contexts[8] = {131072, 1048576}, nc = 2, reps = 10, topk = 100;
    long max_tokens = 1048576;
    for (int i = 1; i < argc; i++) {
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(argv[i], "--batches") && v) nb = bench_parse_list(argv[++i], batches, 8);
        else if (!strcmp(argv[i], "--contexts") && v) nc = bench_parse_list(argv[++i], contexts, 8);
        else if (!strcmp(argv[i], "--topk") && v) topk = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--reps") && v) reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--max-tokens") && v) max_tokens = atol(argv[++i]);
        else {
            fprintf(stderr, "usage: %s [--batches 1,8] [--contexts 131072,1048576] [--topk 100] [--reps 10] "
                            "[--max-tokens 1048576]\n", argv[0]);
            return 2;
        }
    }
    if (nb <= 0 || nc <= 0 || reps <= 0 || topk <= 0) {
        fprintf(stderr, "%s: bad list, --topk or --reps\n", argv[0]);
        return 2;
    }
    char err[256], desc[256];
    struct kvs_backend *b = bench_cuda_open();
    if (!b) return 1;
    if (!(K = kvs_paris_kernels_for(O, err, sizeof err)) || !O->attention_spans) {
        fprintf(stderr, "%s\n", K ? "the cuda backend has no attention_spans" : err);
        return 1;
    }
    kvs_cuda_device_desc(b, desc, sizeof desc);
    printf("device: %s\nshape: %d query heads, %d KV heads, head_dim %d, blocks of %d; one layer, decode rows; sink %d, "
           "tail %d, topk %d, adaptive beta/rho; %d needles per sequence and KV head\n",
           desc, NH, NKV, HD, BS, SINK, TAIL, topk, NEEDLES);
    printf("%6s %8s %9s %9s %9s %9s | %7s %7s %7s %7s %7s | %9s %8s %9s | %10s %10s | %9s %8s %10s %11s\n", "batch",
           "context", "full ms", "paris ms", "select", "spans", "prep", "vote", "keep", "rerank", "topk", "full/paris",
           "recall", "enc us/st", "32L full", "32L paris", "offload", "gather", "full/offl", "32L offload");
    struct kvs_dbuf *flush = bench_dalloc(b, KVS_BUF_F32, FLUSH_FLOATS);
    float sg[HD];
    kvs_paris_signs(KVS_PARIS_SEED, HD, sg);
    const int W = kvs_paris_words(HD), NB = HD / 8;
    const double gpu_free0 = (double)O->mem_available(b);
    double fit_full[64], fit_offl[64], read_rate = 0;   /* ms per (batch, context) row; bytes/ms */
    for (int i = 0; i < 64; i++) fit_full[i] = fit_offl[i] = -1;
    for (int bi = 0; bi < nb; bi++)
        for (int ci = 0; ci < nc; ci++) {
            struct shape S;
            memset(&S, 0, sizeof S);
            const int B = batches[bi], ctx = contexts[ci], nblk = (ctx + BS - 1) / BS, n_r = ctx - SINK - TAIL;
            S.B = B, S.ctx = ctx, S.topk = topk;
            const size_t pool_blocks = (size_t)B * nblk, slots = pool_blocks * BS, kv_elems = slots * NKV * HD;
            const size_t index_bytes = slots * NKV * (size_t)(W + NB) * 4, scratch = (size_t)B * NKV * ctx * 14;
            if ((long)B * ctx > max_tokens || n_r < 2 * topk) {
                printf("%6d %8d   skipped: over --max-tokens or too short\n", B, ctx);
                continue;
            }
            if (2 * kv_elems * 2 + index_bytes + scratch + ((size_t)1 << 30) > O->mem_available(b)) {
                printf("%6d %8d   skipped: %.1f GB of K/V + %.1f GB of index do not fit\n", B, ctx, 4.0 * kv_elems / 1e9,
                       index_bytes / 1e9);
                continue;
            }
            S.kc = bench_dalloc(b, KVS_BUF_KV, kv_elems);
            S.vc = bench_dalloc(b, KVS_BUF_KV, kv_elems);
            kvs_cuda_fill_random(b, S.kc, 0, kv_elems, 1.0f, 11);
            kvs_cuda_fill_random(b, S.vc, 0, kv_elems, 1.0f, 12);
            S.q = bench_dalloc(b, KVS_BUF_ACT, (size_t)B * NH * HD);
            kvs_cuda_fill_random(b, S.q, 0, (size_t)B * NH * HD, 1.0f, 13);
            S.out = bench_dalloc(b, KVS_BUF_ACT, (size_t)B * NH * HD);
            S.lse = bench_dalloc(b, KVS_BUF_F32, (size_t)B * NH);
            S.signs = bench_dalloc(b, KVS_BUF_F32, HD);
            O->upload(b, S.signs, 0, sg, HD);
            S.codes = bench_dalloc(b, KVS_BUF_I32, slots * NKV * W);
            S.w = bench_dalloc(b, KVS_BUF_F32, slots * NKV * NB);
            S.counts = bench_dalloc(b, KVS_BUF_I32, (size_t)B * NKV * NB * KVS_PARIS_NC);
            O->zero(b, S.counts, 0, (size_t)B * NKV * NB * KVS_PARIS_NC);
            S.rows = bench_dalloc(b, KVS_BUF_I32, (size_t)B * KVS_PARIS_ROW_N);
            S.jobs = bench_dalloc(b, KVS_BUF_I32, (size_t)B * KVS_PARIS_JOB_N);
            S.nsp = bench_dalloc(b, KVS_BUF_I32, (size_t)B * NKV);
            S.sp = bench_dalloc(b, KVS_BUF_I32, (size_t)B * NKV * (topk + 2) * 2);
            S.sel = bench_dalloc(b, KVS_BUF_I32, (size_t)B * NKV * topk);
            S.exact = bench_dalloc(b, KVS_BUF_I32, (size_t)B * NKV * topk);
            int32_t *perm = bench_shuffled_ids(pool_blocks, &rng);   /* a long-running pool's block order */
            plant_needles(b, &S, perm, nblk);
            int32_t *h_qs = kvs_xmalloc((size_t)(B + 1) * 4), *h_pos = kvs_xmalloc((size_t)B * 4);
            struct kvs_dbuf *qs = bench_dalloc(b, KVS_BUF_I32, (size_t)B + 1), *pos = bench_dalloc(b, KVS_BUF_I32, (size_t)B);
            struct kvs_dbuf *bt = bench_dalloc(b, KVS_BUF_I32, pool_blocks);
            O->upload(b, bt, 0, perm, pool_blocks);
            for (int s = 0; s <= B; s++) h_qs[s] = s;
            for (int s = 0; s < B; s++) h_pos[s] = ctx - 1;
            O->upload(b, qs, 0, h_qs, (size_t)B + 1);
            O->upload(b, pos, 0, h_pos, (size_t)B);
            S.m = (struct kvs_attn_meta){.n_seqs = B, .max_blocks = nblk, .q_start = qs, .pos = pos, .block_tables = bt,
                                         .h_q_start = h_qs, .h_pos = h_pos, .max_ctx = ctx};
            /* the index of the retrieval zone (untimed), then the selection rows */
            double beta, rho;
            kvs_paris_adaptive(n_r, &beta, &rho);
            S.h_rows = kvs_xcalloc((size_t)B * KVS_PARIS_ROW_N, 4);
            S.h_jobs = kvs_xcalloc((size_t)B * KVS_PARIS_JOB_N, 4);
            const int keep = (int)ceil(beta * n_r);
            for (int s = 0; s < B; s++) {
                int32_t *R = S.h_rows + s * KVS_PARIS_ROW_N, *J = S.h_jobs + s * KVS_PARIS_JOB_N;
                R[KVS_PARIS_ROW_SLOT] = s, R[KVS_PARIS_ROW_NR] = n_r, R[KVS_PARIS_ROW_SINK] = SINK;
                R[KVS_PARIS_ROW_CTX] = ctx, R[KVS_PARIS_ROW_KEEP] = keep, R[KVS_PARIS_ROW_TOPK] = topk < keep ? topk : keep;
                for (int t = 0; t < KVS_PARIS_TIERS; t++)
                    R[KVS_PARIS_ROW_T0 + t] = (int32_t)ceil(n_r * rho * KVS_PARIS_TIER_FRAC[t]);
                J[KVS_PARIS_JOB_SEQ] = s, J[KVS_PARIS_JOB_SLOT] = s, J[KVS_PARIS_JOB_FROM] = SINK;
                J[KVS_PARIS_JOB_TO] = SINK + n_r;
            }
            O->upload(b, S.rows, 0, S.h_rows, (size_t)B * KVS_PARIS_ROW_N);
            O->upload(b, S.jobs, 0, S.h_jobs, (size_t)B * KVS_PARIS_JOB_N);
            K->encode(b, S.kc, &S.m, NULL, S.jobs, S.h_jobs, B, 0, 1, NKV, HD, BS, S.signs, S.codes, S.w, S.counts);
            /* launch planning copies: one span with the kept keys' bound */
            int32_t *h_n = kvs_xmalloc((size_t)B * NKV * 4), *h_sp = kvs_xcalloc((size_t)B * NKV * (topk + 2) * 2, 4);
            for (int i = 0; i < B * NKV; i++) h_n[i] = 1, h_sp[(size_t)i * (topk + 2) * 2 + 1] = SINK + topk + TAIL;
            S.sl = (struct kvs_span_list){topk + 2, S.nsp, S.sp, h_n, h_sp};
            /* recall of one selection against the exact top-k */
            K->select(b, S.q, &S.m, S.rows, S.h_rows, B, 0, 1, NH, NKV, HD, BS, S.signs, S.codes, S.w, S.counts, topk + 2,
                      topk, S.nsp, S.sp, S.sel, NULL);
            K->exact_topk(b, S.q, S.kc, &S.m, S.h_rows, B, NH, NKV, HD, BS, topk, S.exact);
            int32_t *hs = kvs_xmalloc((size_t)B * NKV * topk * 4), *he = kvs_xmalloc((size_t)B * NKV * topk * 4);
            O->download(b, hs, S.sel, 0, (size_t)B * NKV * topk);
            O->download(b, he, S.exact, 0, (size_t)B * NKV * topk);
            double hits = 0, tot = 0;
            for (int t = 0; t < B * NKV; t++)
                for (int i = 0; i < topk && he[t * topk + i] >= 0; i++) {
                    tot++;
                    for (int j = 0; j < topk && hs[t * topk + j] >= 0; j++) hits += hs[t * topk + j] == he[t * topk + i];
                }
            const float full = time_op(b, &S, OP_FULL, reps, flush);
            const float paris = time_op(b, &S, OP_PARIS, reps, flush);
            const float sel = time_op(b, &S, OP_SELECT, reps, flush);
            const float spans = time_op(b, &S, OP_SPANS, reps, flush);
            float ph[5] = {0};
            kvs_paris_cuda_profile(1);
            O->zero(b, flush, 0, FLUSH_FLOATS);
            run_op(b, &S, OP_SELECT);
            kvs_paris_cuda_last_phases(ph);
            kvs_paris_cuda_profile(0);
            /* encode one update interval (512 positions per sequence), amortized over 512 steps */
            for (int s = 0; s < B; s++) {
                S.h_jobs[s * KVS_PARIS_JOB_N + KVS_PARIS_JOB_FROM] = SINK + n_r - 512;
                S.h_jobs[s * KVS_PARIS_JOB_N + KVS_PARIS_JOB_TO] = SINK + n_r;
            }
            O->upload(b, S.jobs, 0, S.h_jobs, (size_t)B * KVS_PARIS_JOB_N);
            const float enc = time_op(b, &S, OP_ENCODE, reps, flush);
            /* offload: one host page per pool block (page = block id), the zone written out */
            float offl = -1, gat = -1;
            const size_t half = pool_blocks * (size_t)NKV * BS * HD * 2;   /* bf16 */
            S.nblk = nblk;
            S.stage_blocks = (SINK + topk + TAIL + BS - 1) / BS;
            S.hk = K->host_alloc(b, half, err, sizeof err);
            S.hv = S.hk ? K->host_alloc(b, half, err, sizeof err) : NULL;
            if (S.hv) {
                S.pages = bench_dalloc(b, KVS_BUF_I32, pool_blocks);
                O->upload(b, S.pages, 0, perm, pool_blocks);
                for (int s = 0; s < B; s++) {
                    S.h_jobs[s * KVS_PARIS_JOB_N + KVS_PARIS_JOB_FROM] = SINK;
                    S.h_jobs[s * KVS_PARIS_JOB_N + KVS_PARIS_JOB_TO] = SINK + n_r;
                }
                O->upload(b, S.jobs, 0, S.h_jobs, (size_t)B * KVS_PARIS_JOB_N);
                K->write_out(b, S.kc, S.vc, &S.m, S.jobs, S.h_jobs, B, 0, 1, NKV, HD, BS, S.pages, nblk, S.hk, S.hv);
                const size_t st_elems = (size_t)B * S.stage_blocks * NKV * BS * HD;
                S.stk = bench_dalloc(b, KVS_BUF_KV, st_elems);
                S.stv = bench_dalloc(b, KVS_BUF_KV, st_elems);
                int32_t *sbt = kvs_xmalloc((size_t)B * S.stage_blocks * 4), *sn = kvs_xmalloc((size_t)B * NKV * 4);
                int32_t *ssp = kvs_xmalloc((size_t)B * NKV * 8);
                for (int i = 0; i < B * S.stage_blocks; i++) sbt[i] = i;
                for (int i = 0; i < B * NKV; i++) sn[i] = 1, ssp[2 * i] = 0, ssp[2 * i + 1] = SINK + topk + TAIL;
                S.stbt = bench_dalloc(b, KVS_BUF_I32, (size_t)B * S.stage_blocks);
                S.stn = bench_dalloc(b, KVS_BUF_I32, (size_t)B * NKV);
                S.stsp = bench_dalloc(b, KVS_BUF_I32, (size_t)B * NKV * 2);
                O->upload(b, S.stbt, 0, sbt, (size_t)B * S.stage_blocks);
                O->upload(b, S.stn, 0, sn, (size_t)B * NKV);
                O->upload(b, S.stsp, 0, ssp, (size_t)B * NKV * 2);
                S.stm = S.m;
                S.stm.block_tables = S.stbt, S.stm.max_blocks = S.stage_blocks;
                S.stl = (struct kvs_span_list){1, S.stn, S.stsp, sn, ssp};
                offl = time_op(b, &S, OP_OFFLOAD, reps, flush);
                gat = time_op(b, &S, OP_GATHER, reps, flush);
                struct kvs_dbuf *ob[] = {S.pages, S.stk, S.stv, S.stbt, S.stn, S.stsp};
                for (size_t i = 0; i < sizeof ob / sizeof ob[0]; i++) O->free_buf(b, ob[i]);
                free(sbt), free(sn), free(ssp);
            } else {
                fprintf(stderr, "offload column skipped: %s\n", err);
            }
            if (S.hk) K->host_free(b, S.hk);
            if (S.hv) K->host_free(b, S.hv);
            printf("%6d %8d %9.3f %9.3f %9.3f %9.3f | %7.3f %7.3f %7.3f %7.3f %7.3f | %9.2fx %7.1f%% %9.2f | %10.2f "
                   "%10.2f | %9.3f %8.3f %9.2fx %11.2f\n",
                   B, ctx, full, paris, sel, spans, ph[0], ph[1], ph[2], ph[3], ph[4], full / paris, 100 * hits / tot,
                   1000.0 * enc / 512, 32 * full, 32 * (paris + enc / 512), offl, gat, full / offl,
                   32 * (offl + enc / 512));
            fflush(stdout);
            fit_full[bi * 8 + ci] = full, fit_offl[bi * 8 + ci] = offl >= 0 ? offl + enc / 512 : -1;
            const double kv_read = (double)B * ctx * NKV * HD * 2 * 2;
            if (kv_read / full > read_rate) read_rate = kv_read / full;
            struct kvs_dbuf *all[] = {S.kc, S.vc, S.q, S.out, S.lse, S.signs, S.codes, S.w, S.counts, S.rows, S.jobs,
                                      S.nsp, S.sp, S.sel, S.exact, qs, pos, bt};
            for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) O->free_buf(b, all[i]);
            free(perm), free(h_qs), free(h_pos), free(h_n), free(h_sp), free(hs), free(he), free(S.h_rows), free(S.h_jobs);
        }
    O->free_buf(b, flush);
    O->free(b);
    /* the fit of the whole 8B model (see the header) */
    const double GiB = 1073741824.0, weights = 16.06e9, kv_tok = 32.0 * NKV * HD * 2 * 2;
    const double host = (double)sysconf(_SC_PHYS_PAGES) * (double)sysconf(_SC_PAGE_SIZE);
    const double gpu_room = gpu_free0 - 2 * GiB - weights, host_room = host - 8 * GiB;
    const double idx_tok = 32.0 * NKV * (kvs_paris_words(HD) + HD / 8) * 4;
    const double counts = 32.0 * NKV * (HD / 8) * KVS_PARIS_NC * 4;
    printf("\nfit of Llama-3.1-8B (32 layers, bf16 weights 16.06 GB): GPU %.1f GiB free at start - 2 GiB - weights; "
           "host %.1f GiB - 8 GiB; weights read at %.0f GB/s (full attention's best K/V read rate here)\n",
           gpu_free0 / GiB, host / GiB, read_rate / 1e6);
    printf("%8s %11s %9s | %14s %15s %9s %9s | %6s %10s %10s %12s %12s\n", "context", "full GB/seq", "full max",
           "paris GPU/seq", "paris host/seq", "GPU-bound", "paris max", "batch", "step full", "step offl",
           "tok/s full", "tok/s offl");
    for (int ci = 0; ci < nc; ci++) {
        const double ctx = contexts[ci], full_seq = ctx * kv_tok;
        const double par_gpu = ctx * idx_tok + (SINK + 64 + 512 + 2048) * kv_tok + counts;
        const double par_host = ceil((ctx - SINK - 64) / BS) * BS * kv_tok;
        const int full_max = gpu_room > 0 ? (int)(gpu_room / full_seq) : 0;
        const int gpu_max = gpu_room > 0 ? (int)(gpu_room / par_gpu) : 0, host_max = (int)(host_room / par_host);
        const int par_max = gpu_max < host_max ? gpu_max : host_max;
        const double wms = read_rate > 0 ? weights / read_rate : 0;
        int printed = 0;
        for (int bi = 0; bi < nb; bi++) {
            const double f = fit_full[bi * 8 + ci], o = fit_offl[bi * 8 + ci];
            if (f < 0) continue;
            const int B = batches[bi];
            const double sf = 32 * f + wms, so = o >= 0 ? 32 * o + wms : -1;
            printf("%8.0f %11.2f %9d | %14.2f %15.2f %9d %9d | %6d %10.2f %10.2f %12s %12s\n", ctx, full_seq / 1e9,
                   full_max, par_gpu / 1e9, par_host / 1e9, gpu_max, par_max, B, sf, so, "", "");
            /* tokens/s only where the batch fits that way */
            printf("%8s %11s %9s | %14s %15s %9s %9s | %6s %10s %10s %12.1f %12.1f\n", "", "", "", "", "", "", "", "",
                   B <= full_max ? "fits" : "no fit", so >= 0 && B <= par_max ? "fits" : "no fit",
                   B <= full_max ? 1000.0 * B / sf : 0.0, so >= 0 && B <= par_max ? 1000.0 * B / so : 0.0);
            printed = 1;
        }
        if (!printed)
            printf("%8.0f %11.2f %9d | %14.2f %15.2f %9d %9d | (no measured batch)\n", ctx, full_seq / 1e9, full_max,
                   par_gpu / 1e9, par_host / 1e9, gpu_max, par_max);
    }
    return 0;
}
#else
int main(void)
{
    fprintf(stderr, "kvserve-parisbench: built without CUDA (nvcc not found)\n");
    return 1;
}
#endif
