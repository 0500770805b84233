/* kvserve_parisstep_main.c: whole ParisKV decode steps at a 1M-token context (issue 19's first
 * benchmark) and the cost of a prefill chunk whose request's retrieval zone already left the
 * pool, on the CUDA backend, -> build/kvserve-parisstep.
 *
 * Step mode (default): the Llama-3.1-8B shape (32 layers, random bf16 weights made on the device
 * as kvserve-gpubench makes them, q/k/v and gate/up fused, GEMM shapes pretuned), batch --batch
 * (1), context --context (1048576). One decode step is the runner's layer loop written with the
 * backend's ops (embed; per layer rmsnorm, the fused q/k/v GEMM + RoPE + cache write, ParisKV's
 * attend with kv.paris.offload, o_proj, add+rmsnorm, gate/up + SwiGLU + down, add+rmsnorm; final
 * norm and the LM head), run eagerly as the runner runs the policy (it declares
 * KVS_KV_NO_GRAPHS) and timed with events from the embed to the logits: median of --reps steps.
 * ParisKV's attend per layer is what kv_decode_paris.c runs for a selecting decode row with
 * offload: select (prep: qbar + SRHT + tiers; vote; keep the top ceil(beta n) by vote; rerank by
 * the 4-bit estimate; top-k + spans) over the layer's own index, the gather of sink + top-k from
 * pinned host pages over UVA plus the tail from the pool into a staging area, then
 * attention_spans over it (the same calls as kvserve-parisbench's "offload" column).
 *
 * Memory: each layer has its own index (codes + weights + cluster counts, 144 B a token and KV
 * head, built by the real encoder over the retrieval zone: 1.2 GB a layer at 1M), so the 32
 * index scans read 38.6 GB as a real step does. The bf16 K/V (128 KiB a token for 32 layers:
 * 128 GiB at 1M) fits neither the GPU nor this host's memory, so one K/V pool (4 GiB at 1M)
 * serves every layer (its tail, the cache write and the encoder's input) and one set of pinned
 * host pages (the zone written out by write_out) serves every layer's gather: a layer's gather
 * reads only sink + top-k positions (~100 x 8 heads x 512 B), so sharing the pages changes what
 * it reads, not how much. The weights (16 GB) stream between layers, so nothing of a layer
 * survives in L2 for the next. Keys are uniform random (no needles: recall is
 * kvserve-parisbench's; the selection's work does not depend on the values).
 *
 * Where the time goes (each class alone over all layers, eager, median of --reps): weights (the
 * step with the attention op left out: every GEMM, norm, RoPE / cache write and the LM head),
 * select, gather, attention_spans, and select's phases (events inside one select of every
 * layer: index scan = prep + vote + keep + rerank, selection = top-k + spans). Encode + write-out
 * of one update interval (512 positions, every layer) is timed alone and amortized over the 512
 * steps it covers. For reference, full attention's step over the same shared pool is timed too
 * (it would need 128 GiB of K/V at 1M: not a fit, a bandwidth yardstick).
 *
 * Chunk mode (--chunk C --chunk-contexts N1,N2): one layer, one request at context N whose
 * retrieval zone [sink, N - C - 64) was written out to host pages, and a prefill chunk of its C
 * last positions. Three ways to attend: "prefill" = attention() (the prefill kernel) over the
 * pool holding the whole context (what a request whose zone stayed in the pool runs); "released"
 * = what kv_decode_paris.c runs today for such a step: attention_spans over the pool's spans
 * [0, lo) + [hi, N) and over the host pages' [lo, hi) through host_view (UVA), then attn_merge
 * (every row reads the whole zone over PCIe: time grows as C x N; timed once, and skipped at
 * larger shapes once one run passed 5 s); "staged" = gather the whole context (zone from the host
 * pages, the rest from the pool) into a device staging area of N positions, then attention()
 * over it (a candidate fix: one PCIe read of the zone per layer and chunk).
 *
 * Usage: kvserve-parisstep [--context 1048576] [--batch 1] [--topk 100] [--layers 32] [--reps 10]
 *        kvserve-parisstep --chunk 512 --chunk-contexts 16384,65536 [--reps 5]
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/util.h"
#include "bench/bench_util.h"
#include "kernels/backend.h"
#include "kernels/kv_paris.h"

#if defined(KVS_HAVE_CUDA) && KVS_HAVE_CUDA
#include "kernels/cuda/cuda_backend.h"
#include "bench/bench_cuda.h"

#define BS 16 /* KV block size (tokens) */

#define SINK 4
#define LOCAL 64
#define TAIL 320          /* local window 64 + a half-full update buffer of 256 */
#define INTERVAL 512      /* the update buffer: encode + write-out every 512 steps */

static const struct kvs_backend_ops *O = &kvs_cuda_backend;
static const struct kvs_paris_kernels *K;
static uint64_t rng = 0x2545f4914f6cdd1dull;

struct layer {
    struct kvs_dweight *wq, *wk, *wv, *wo, *wg, *wu, *wd, *n1, *n2;
    struct kvs_dbuf *codes, *w, *counts;   /* the layer's own ParisKV index */
};

struct bench {
    struct kvs_backend *b;
    int n_layers, B, ctx, topk, nblk, stage_blocks;
    struct layer *L;
    struct kvs_dweight *emb, *head, *fnorm;
    struct kvs_dbuf *x, *h, *q, *k, *v, *att, *lse, *o, *g, *u, *logits, *tok, *pos, *slots, *invf;
    struct kvs_dbuf *kc, *vc, *signs, *rows, *jobs, *nsp, *sp, *pages, *stk, *stv;
    void *hk, *hv;
    int32_t *h_rows, *h_jobs;
    struct kvs_attn_meta m, stm;
    struct kvs_span_list stl;
};

/* what one step (or one class of its ops) enqueues */
enum { RUN_STEP, RUN_WEIGHTS, RUN_FULL, RUN_SELECT, RUN_GATHER, RUN_SPANS, RUN_ENCODE };

static void paris_select(struct bench *B, int l)
{
    K->select(B->b, B->q, &B->m, B->rows, B->h_rows, B->B, 0, 1, NH, NKV, HD, BS, B->signs, B->L[l].codes, B->L[l].w,
              B->L[l].counts, B->topk + 2, B->topk, B->nsp, B->sp, NULL, NULL);
}
static void paris_gather(struct bench *B)
{
    K->gather(B->b, B->kc, B->vc, &B->m, B->rows, B->h_rows, B->B, 0, 1, NKV, HD, BS, B->nsp, B->sp, B->topk + 2,
              B->pages, B->nblk, B->hk, B->hv, B->stk, B->stv, B->stage_blocks);
}
static void paris_spans(struct bench *B)
{
    O->attention_spans(B->b, B->q, B->stk, B->stv, &B->stm, &B->stl, B->B, NH, NKV, HD, BS, 1.0f / sqrtf((float)HD),
                       B->att, B->lse);
}

static void enqueue(struct bench *B, int what)
{
    struct kvs_backend *b = B->b;
    const int nb = B->B;
    if (what == RUN_SELECT || what == RUN_GATHER || what == RUN_SPANS || what == RUN_ENCODE) {
        for (int l = 0; l < B->n_layers; l++) {
            if (what == RUN_SELECT) paris_select(B, l);
            else if (what == RUN_GATHER) paris_gather(B);
            else if (what == RUN_SPANS) paris_spans(B);
            else {
                K->encode(b, B->kc, &B->m, NULL, B->jobs, B->h_jobs, nb, 0, 1, NKV, HD, BS, B->signs, B->L[l].codes,
                          B->L[l].w, B->L[l].counts);
                K->write_out(b, B->kc, B->vc, &B->m, B->jobs, B->h_jobs, nb, 0, 1, NKV, HD, BS, B->pages, B->nblk,
                             B->hk, B->hv);
            }
        }
        return;
    }
    O->embed(b, B->emb, B->tok, nb, DIM, B->x);
    O->rmsnorm(b, B->x, B->L[0].n1, 1e-5f, nb, DIM, B->h);
    for (int l = 0; l < B->n_layers; l++) {
        struct layer *L = &B->L[l];
        const struct kvs_dweight *w[3] = {L->wq, L->wk, L->wv};
        O->matmul_rope_kv_write(b, B->h, w, NULL, nb, DIM, B->q, B->k, B->v, B->pos, B->invf, B->slots, NH, NKV, HD, BS,
                                B->kc, B->vc);
        if (what == RUN_STEP) {
            paris_select(B, l);
            paris_gather(B);
            paris_spans(B);
        } else if (what == RUN_FULL) {
            O->attention(b, B->q, B->kc, B->vc, &B->m, nb, NH, NKV, HD, BS, 1.0f / sqrtf((float)HD), B->att);
        }
        O->matmul(b, B->att, L->wo, NULL, nb, DIM, DIM, B->o);
        O->add_rmsnorm(b, B->x, B->o, L->n2, 1e-5f, nb, DIM, B->h);
        O->matmul_swiglu_down(b, B->h, L->wg, L->wu, L->wd, nb, DIM, FF, B->g, B->u, B->o);
        O->add_rmsnorm(b, B->x, B->o, l + 1 < B->n_layers ? B->L[l + 1].n1 : B->fnorm, 1e-5f, nb, DIM, B->h);
    }
    O->matmul(b, B->h, B->head, NULL, nb, DIM, VOCAB, B->logits);
}

static float time_it(struct bench *B, int what, int reps)
{
    float *t = kvs_xmalloc((size_t)reps * sizeof(float));
    for (int r = -2; r < reps; r++) {
        kvs_cuda_timer_start(B->b);
        enqueue(B, what);
        const float ms = kvs_cuda_timer_stop_ms(B->b);
        if (r >= 0) t[r] = ms;
    }
    qsort(t, (size_t)reps, sizeof t[0], bench_cmp_float);
    const float med = t[reps / 2];
    free(t);
    return med;
}

/* the logits must be finite: a broken kernel fails the benchmark rather than timing garbage */
static void check_logits(struct bench *B, const char *what)
{
    float *lg = kvs_xmalloc((size_t)B->B * VOCAB * 4);
    O->logits_to_host(B->b, B->logits, B->B, VOCAB, lg);
    for (size_t i = 0; i < (size_t)B->B * VOCAB; i++)
        if (!(lg[i] == lg[i]) || lg[i] > 1e30f || lg[i] < -1e30f)
            kvs_panic(__FILE__, __LINE__, "non-finite logit (%s)", what);
    free(lg);
}

/* the selection rows of B sequences at context ctx (adaptive beta / rho, as the policy plans) */
static void fill_rows(int32_t *h_rows, int32_t *h_jobs, int B, int ctx, int topk, int from, int to)
{
    const int n_r = ctx - SINK - TAIL;
    double beta, rho;
    kvs_paris_adaptive(n_r, &beta, &rho);
    const int keep = (int)ceil(beta * n_r);
    for (int s = 0; s < B; s++) {
        int32_t *R = h_rows + s * KVS_PARIS_ROW_N, *J = h_jobs + s * KVS_PARIS_JOB_N;
        R[KVS_PARIS_ROW_SLOT] = s, R[KVS_PARIS_ROW_NR] = n_r, R[KVS_PARIS_ROW_SINK] = SINK;
        R[KVS_PARIS_ROW_CTX] = ctx, R[KVS_PARIS_ROW_KEEP] = keep, R[KVS_PARIS_ROW_TOPK] = topk < keep ? topk : keep;
        for (int t = 0; t < KVS_PARIS_TIERS; t++)
            R[KVS_PARIS_ROW_T0 + t] = (int32_t)ceil(n_r * rho * KVS_PARIS_TIER_FRAC[t]);
        J[KVS_PARIS_JOB_SEQ] = s, J[KVS_PARIS_JOB_SLOT] = s, J[KVS_PARIS_JOB_FROM] = from;
        J[KVS_PARIS_JOB_TO] = to;
    }
}

static int step_mode(struct kvs_backend *b, int Bn, int ctx, int topk, int n_layers, int reps)
{
    struct bench S, *B = &S;
    memset(B, 0, sizeof S);
    B->b = b, B->n_layers = n_layers, B->B = Bn, B->ctx = ctx, B->topk = topk;
    const int nblk = B->nblk = (ctx + BS - 1) / BS, n_r = ctx - SINK - TAIL;
    const int W = kvs_paris_words(HD), NB = HD / 8;
    if (n_r < 2 * topk) {
        fprintf(stderr, "--context too short for --topk\n");
        return 2;
    }
    const double gpu0 = (double)O->mem_available(b);
    uint64_t seed = 1;
    B->emb = kvs_cuda_random_weight(b, VOCAB, DIM, 0, 0.02f, seed++);
    B->head = kvs_cuda_random_weight(b, VOCAB, DIM, 0, 0.02f, seed++);
    B->fnorm = kvs_cuda_random_weight(b, 1, DIM, 1, 1.0f, seed++);
    if (!B->emb || !B->head || !B->fnorm) kvs_panic(__FILE__, __LINE__, "out of device memory for the weights");
    struct layer *L = B->L = kvs_xcalloc((size_t)n_layers, sizeof *L);
    for (int l = 0; l < n_layers; l++) {
        bench_random_layer(b, &seed, &L[l].wq, &L[l].wk, &L[l].wv, &L[l].wo, &L[l].wg,
                           &L[l].wu, &L[l].wd, &L[l].n1, &L[l].n2);
        struct kvs_dweight *qkv[3] = {L[l].wq, L[l].wk, L[l].wv}, *gu[2] = {L[l].wg, L[l].wu};
        if (O->fuse_weights(b, qkv, 3) || O->fuse_weights(b, gu, 2))
            kvs_panic(__FILE__, __LINE__, "fuse_weights failed (out of device memory?)");
    }
    const struct kvs_dweight *shapes[] = {L[0].wo, L[0].wd, B->head};
    for (size_t i = 0; i < 3; i++) kvs_cuda_pretune(b, shapes[i]);
    const double w_bytes = (double)n_layers * 2.0 * ((double)DIM * DIM * 2 + 2.0 * NKV * HD * DIM + 3.0 * FF * DIM) +
                           2.0 * VOCAB * DIM;

    /* activations */
    B->x = bench_dalloc(b, KVS_BUF_ACT, (size_t)Bn * DIM), B->h = bench_dalloc(b, KVS_BUF_ACT, (size_t)Bn * DIM);
    B->q = bench_dalloc(b, KVS_BUF_ACT, (size_t)Bn * DIM), B->k = bench_dalloc(b, KVS_BUF_ACT, (size_t)Bn * NKV * HD);
    B->v = bench_dalloc(b, KVS_BUF_ACT, (size_t)Bn * NKV * HD), B->att = bench_dalloc(b, KVS_BUF_ACT, (size_t)Bn * DIM);
    B->lse = bench_dalloc(b, KVS_BUF_F32, (size_t)Bn * NH);
    B->o = bench_dalloc(b, KVS_BUF_ACT, (size_t)Bn * DIM), B->g = bench_dalloc(b, KVS_BUF_ACT, (size_t)Bn * FF);
    B->u = bench_dalloc(b, KVS_BUF_ACT, (size_t)Bn * FF), B->logits = bench_dalloc(b, KVS_BUF_ACT, (size_t)Bn * VOCAB);
    B->tok = bench_dalloc(b, KVS_BUF_I32, Bn), B->pos = bench_dalloc(b, KVS_BUF_I32, Bn), B->slots = bench_dalloc(b, KVS_BUF_I32, Bn);
    B->invf = bench_dalloc(b, KVS_BUF_F32, HD / 2);
    float inv[HD / 2];
    for (int i = 0; i < HD / 2; i++) inv[i] = (float)(1.0 / pow(500000.0, 2.0 * i / HD));
    O->upload(b, B->invf, 0, inv, HD / 2);

    /* the shared K/V pool, the step's metadata */
    const size_t pool_blocks = (size_t)Bn * nblk, slots = pool_blocks * BS, kv_elems = slots * NKV * HD;
    B->kc = bench_dalloc(b, KVS_BUF_KV, kv_elems), B->vc = bench_dalloc(b, KVS_BUF_KV, kv_elems);
    kvs_cuda_fill_random(b, B->kc, 0, kv_elems, 1.0f, seed++);
    kvs_cuda_fill_random(b, B->vc, 0, kv_elems, 1.0f, seed++);
    int32_t *perm = bench_shuffled_ids(pool_blocks, &rng);
    int32_t *h_qs = kvs_xmalloc((size_t)(Bn + 1) * 4), *h_pos = kvs_xmalloc((size_t)Bn * 4);
    int32_t *h_tok = kvs_xmalloc((size_t)Bn * 4), *h_slot = kvs_xmalloc((size_t)Bn * 4);
    for (int s = 0; s <= Bn; s++) h_qs[s] = s;
    for (int s = 0; s < Bn; s++) {
        h_pos[s] = ctx - 1, h_tok[s] = (s * 7919) % VOCAB;
        h_slot[s] = perm[(size_t)s * nblk + (ctx - 1) / BS] * BS + (ctx - 1) % BS;
    }
    struct kvs_dbuf *qs = bench_dalloc(b, KVS_BUF_I32, (size_t)Bn + 1), *ps = bench_dalloc(b, KVS_BUF_I32, Bn);
    struct kvs_dbuf *bt = bench_dalloc(b, KVS_BUF_I32, pool_blocks);
    O->upload(b, bt, 0, perm, pool_blocks);
    O->upload(b, qs, 0, h_qs, (size_t)Bn + 1);
    O->upload(b, ps, 0, h_pos, Bn);
    O->upload(b, B->pos, 0, h_pos, Bn);
    O->upload(b, B->tok, 0, h_tok, Bn);
    O->upload(b, B->slots, 0, h_slot, Bn);
    B->m = (struct kvs_attn_meta){.n_seqs = Bn, .max_blocks = nblk, .q_start = qs, .pos = ps, .block_tables = bt,
                                  .inv_freq = B->invf, .h_q_start = h_qs, .h_pos = h_pos, .max_ctx = ctx};

    /* every layer's index, by the real encoder over the zone */
    float sg[HD];
    kvs_paris_signs(KVS_PARIS_SEED, HD, sg);
    B->signs = bench_dalloc(b, KVS_BUF_F32, HD);
    O->upload(b, B->signs, 0, sg, HD);
    B->h_rows = kvs_xcalloc((size_t)Bn * KVS_PARIS_ROW_N, 4), B->h_jobs = kvs_xcalloc((size_t)Bn * KVS_PARIS_JOB_N, 4);
    fill_rows(B->h_rows, B->h_jobs, Bn, ctx, topk, SINK, SINK + n_r);
    B->rows = bench_dalloc(b, KVS_BUF_I32, (size_t)Bn * KVS_PARIS_ROW_N), B->jobs = bench_dalloc(b, KVS_BUF_I32, (size_t)Bn * KVS_PARIS_JOB_N);
    O->upload(b, B->rows, 0, B->h_rows, (size_t)Bn * KVS_PARIS_ROW_N);
    O->upload(b, B->jobs, 0, B->h_jobs, (size_t)Bn * KVS_PARIS_JOB_N);
    const size_t counts_n = (size_t)Bn * NKV * NB * KVS_PARIS_NC;
    for (int l = 0; l < n_layers; l++) {
        L[l].codes = O->alloc(b, KVS_BUF_I32, slots * NKV * W);
        L[l].w = L[l].codes ? O->alloc(b, KVS_BUF_F32, slots * NKV * NB) : NULL;
        L[l].counts = L[l].w ? O->alloc(b, KVS_BUF_I32, counts_n) : NULL;
        if (!L[l].counts) {
            printf("skipped: the index of layer %d does not fit (%.1f GB a layer, %.1f GB free)\n", l,
                   slots * NKV * (W + NB) * 4.0 / 1e9, O->mem_available(b) / 1e9);
            return 1;
        }
        O->zero(b, L[l].counts, 0, counts_n);
        K->encode(b, B->kc, &B->m, NULL, B->jobs, B->h_jobs, Bn, 0, 1, NKV, HD, BS, B->signs, L[l].codes, L[l].w,
                  L[l].counts);
    }
    B->nsp = bench_dalloc(b, KVS_BUF_I32, (size_t)Bn * NKV);
    B->sp = bench_dalloc(b, KVS_BUF_I32, (size_t)Bn * NKV * (topk + 2) * 2);

    /* offload: the zone written out to pinned host pages (page = pool block), the staging area */
    char err[256];
    const size_t half = pool_blocks * (size_t)NKV * BS * HD * 2;
    B->hk = K->host_alloc(b, half, err, sizeof err);
    B->hv = B->hk ? K->host_alloc(b, half, err, sizeof err) : NULL;
    if (!B->hv) {
        printf("skipped: host pages (%.1f GB): %s\n", 2.0 * half / 1e9, err);
        return 1;
    }
    B->pages = bench_dalloc(b, KVS_BUF_I32, pool_blocks);
    O->upload(b, B->pages, 0, perm, pool_blocks);
    K->write_out(b, B->kc, B->vc, &B->m, B->jobs, B->h_jobs, Bn, 0, 1, NKV, HD, BS, B->pages, nblk, B->hk, B->hv);
    B->stage_blocks = (SINK + topk + TAIL + BS - 1) / BS;
    const size_t st_elems = (size_t)Bn * B->stage_blocks * NKV * BS * HD;
    B->stk = bench_dalloc(b, KVS_BUF_KV, st_elems), B->stv = bench_dalloc(b, KVS_BUF_KV, st_elems);
    int32_t *sbt = kvs_xmalloc((size_t)Bn * B->stage_blocks * 4), *sn = kvs_xmalloc((size_t)Bn * NKV * 4);
    int32_t *ssp = kvs_xmalloc((size_t)Bn * NKV * 8);
    for (int i = 0; i < Bn * B->stage_blocks; i++) sbt[i] = i;
    for (int i = 0; i < Bn * NKV; i++) sn[i] = 1, ssp[2 * i] = 0, ssp[2 * i + 1] = SINK + topk + TAIL;
    struct kvs_dbuf *stbt = bench_dalloc(b, KVS_BUF_I32, (size_t)Bn * B->stage_blocks);
    struct kvs_dbuf *stn = bench_dalloc(b, KVS_BUF_I32, (size_t)Bn * NKV), *stsp = bench_dalloc(b, KVS_BUF_I32, (size_t)Bn * NKV * 2);
    O->upload(b, stbt, 0, sbt, (size_t)Bn * B->stage_blocks);
    O->upload(b, stn, 0, sn, (size_t)Bn * NKV);
    O->upload(b, stsp, 0, ssp, (size_t)Bn * NKV * 2);
    B->stm = B->m;
    B->stm.block_tables = stbt, B->stm.max_blocks = B->stage_blocks;
    B->stl = (struct kvs_span_list){1, stn, stsp, sn, ssp};
    O->sync(b);
    const double idx_gb = (double)n_layers * (slots * NKV * (W + NB) * 4.0 + counts_n * 4.0) / 1e9;
    printf("weights read a step %.2f GB (bf16, random: every layer's matrices and the LM head); index %.2f GB (%d layers, each its own); shared K/V pool %.2f GB; "
           "host pages %.2f GB pinned (shared by the layers); GPU free at start %.1f GB, now %.1f GB\n",
           w_bytes / 1e9, idx_gb, n_layers, 4.0 * kv_elems / 1e9, 2.0 * half / 1e9, gpu0 / 1e9,
           O->mem_available(b) / 1e9);

    /* the whole step, then each class alone */
    const float step = time_it(B, RUN_STEP, reps);
    check_logits(B, "paris step");
    const float weights = time_it(B, RUN_WEIGHTS, reps);
    const float full = time_it(B, RUN_FULL, reps);
    check_logits(B, "full step");
    const float sel = time_it(B, RUN_SELECT, reps);
    const float gat = time_it(B, RUN_GATHER, reps);
    const float spn = time_it(B, RUN_SPANS, reps);
    float ph[5] = {0}, sum_ph[5] = {0};
    kvs_paris_cuda_profile(1);
    for (int l = 0; l < n_layers; l++) {
        paris_select(B, l);
        kvs_paris_cuda_last_phases(ph);
        for (int i = 0; i < 5; i++) sum_ph[i] += ph[i];
    }
    kvs_paris_cuda_profile(0);
    /* one update interval: encode + write-out of 512 positions a sequence, every layer */
    fill_rows(B->h_rows, B->h_jobs, Bn, ctx, topk, SINK + n_r - INTERVAL, SINK + n_r);
    O->upload(b, B->jobs, 0, B->h_jobs, (size_t)Bn * KVS_PARIS_JOB_N);
    const float enc = time_it(B, RUN_ENCODE, reps);
    const float amort = enc / INTERVAL;
    printf("\nbatch %d, context %d, %d layers, topk %d (adaptive beta/rho), kv.paris.offload; eager steps, median of %d\n",
           Bn, ctx, n_layers, topk, reps);
    printf("| | ms/step | of the step |\n| --- | ---: | ---: |\n");
    printf("| **ParisKV + offload, whole step (measured)** | **%.2f** | 100%% |\n", step);
    printf("| + encode and write-out, amortized (%.2f ms every %d steps) | %.3f | |\n", enc, INTERVAL, amort);
    printf("| = per step with the amortized update | %.2f | |\n", step + amort);
    printf("| weights alone (every GEMM, norm, RoPE + cache write, LM head) | %.2f | %.0f%% |\n", weights,
           100.0 * weights / step);
    printf("| select alone (%d layers) | %.2f | %.0f%% |\n", n_layers, sel, 100.0 * sel / step);
    printf("| - index scan: prep (qbar, SRHT, tiers) | %.2f | |\n", sum_ph[0]);
    printf("| - index scan: vote | %.2f | |\n", sum_ph[1]);
    printf("| - index scan: keep top beta n | %.2f | |\n", sum_ph[2]);
    printf("| - index scan: rerank (4-bit estimate) | %.2f | |\n", sum_ph[3]);
    printf("| - selection: top-k + spans | %.2f | |\n", sum_ph[4]);
    printf("| gather alone (sink + top-k over UVA, tail from the pool) | %.2f | %.0f%% |\n", gat, 100.0 * gat / step);
    printf("| attention_spans alone (%d keys a row and head) | %.2f | %.0f%% |\n", SINK + topk + TAIL, spn,
           100.0 * spn / step);
    printf("| sum of the parts | %.2f | %.0f%% |\n", weights + sel + gat + spn, 100.0 * (weights + sel + gat + spn) / step);
    printf("| full attention's step over the same (shared) pool, for reference | %.2f | |\n", full);
    printf("weights read at %.0f GB/s in the weights-alone run; index read by the scans %.1f GB\n",
           w_bytes / weights / 1e6, idx_gb);
    free(perm), free(h_qs), free(h_pos), free(h_tok), free(h_slot), free(sbt), free(sn), free(ssp);
    return 0;
}

/* chunk mode: see the header */
static int chunk_mode(struct kvs_backend *b, int C, const int *ctxs, int nc, int reps)
{
    const float scale = 1.0f / sqrtf((float)HD);
    double slow_ms = 0;
    printf("\none layer, one request, a prefill chunk of its last %d positions; zone [%d, N - %d - %d) in host pages\n"
           "| context N | prefill ms (zone in the pool) | released ms (today: spans over host pages + merge) | "
           "released / prefill | staged ms (gather to device + prefill) | gather ms | staged / prefill | max |diff| "
           "released vs prefill | staged vs prefill |\n| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n",
           C, SINK, C, LOCAL);
    for (int ci = 0; ci < nc; ci++) {
        const int N = ctxs[ci], nblk = (N + BS - 1) / BS, p0 = N - C;
        const int lo = (SINK + BS - 1) / BS * BS, hi = (p0 - LOCAL) / BS * BS;
        if (hi <= lo || C <= 0) {
            printf("| %d | skipped: chunk too long |\n", N);
            continue;
        }
        const size_t E = (size_t)nblk * BS * NKV * HD;
        struct kvs_dbuf *kc = bench_dalloc(b, KVS_BUF_KV, E), *vc = bench_dalloc(b, KVS_BUF_KV, E);
        kvs_cuda_fill_random(b, kc, 0, E, 1.0f, 21 + ci);
        kvs_cuda_fill_random(b, vc, 0, E, 1.0f, 31 + ci);
        struct kvs_dbuf *q = bench_dalloc(b, KVS_BUF_ACT, (size_t)C * NH * HD);
        kvs_cuda_fill_random(b, q, 0, (size_t)C * NH * HD, 1.0f, 41 + ci);
        struct kvs_dbuf *o1 = bench_dalloc(b, KVS_BUF_ACT, (size_t)C * NH * HD), *o2 = bench_dalloc(b, KVS_BUF_ACT, (size_t)C * NH * HD);
        struct kvs_dbuf *o3 = bench_dalloc(b, KVS_BUF_ACT, (size_t)C * NH * HD);
        struct kvs_dbuf *l2 = bench_dalloc(b, KVS_BUF_F32, (size_t)C * NH), *lb = bench_dalloc(b, KVS_BUF_F32, (size_t)C * NH);
        struct kvs_dbuf *ob = bench_dalloc(b, KVS_BUF_ACT, (size_t)C * NH * HD);
        int32_t *perm = bench_shuffled_ids((size_t)nblk, &rng), hq[2] = {0, C}, hp[1] = {p0};
        struct kvs_dbuf *bt = bench_dalloc(b, KVS_BUF_I32, nblk), *qs = bench_dalloc(b, KVS_BUF_I32, 2), *ps = bench_dalloc(b, KVS_BUF_I32, 1);
        O->upload(b, bt, 0, perm, nblk);
        O->upload(b, qs, 0, hq, 2);
        O->upload(b, ps, 0, hp, 1);
        struct kvs_attn_meta m = {.n_seqs = 1, .max_blocks = nblk, .q_start = qs, .pos = ps, .block_tables = bt,
                                  .h_q_start = hq, .h_pos = hp, .max_ctx = N};
        /* the zone [lo, hi) written out: pages = pool block ids (the view's block p holds page p) */
        char err[256];
        const size_t bytes = E * 2;
        void *hk = K->host_alloc(b, bytes, err, sizeof err), *hv = hk ? K->host_alloc(b, bytes, err, sizeof err) : NULL;
        if (!hv) kvs_panic(__FILE__, __LINE__, "host pages: %s", err);
        int32_t hrow[KVS_PARIS_ROW_N] = {0}, hjob[KVS_PARIS_JOB_N] = {0, 0, lo, hi};
        hrow[KVS_PARIS_ROW_NR] = hi - SINK, hrow[KVS_PARIS_ROW_SINK] = SINK, hrow[KVS_PARIS_ROW_CTX] = N;
        hrow[KVS_PARIS_ROW_TOPK] = hi - SINK;   /* the gather sizes its grid by ctx - n_r + topk: all N */
        int32_t *hpg = kvs_xmalloc((size_t)nblk * 4);
        for (int j = 0; j < nblk; j++) hpg[j] = j >= lo / BS && j < hi / BS ? perm[j] : -1;
        struct kvs_dbuf *pages = bench_dalloc(b, KVS_BUF_I32, nblk), *rows = bench_dalloc(b, KVS_BUF_I32, KVS_PARIS_ROW_N);
        struct kvs_dbuf *jobs = bench_dalloc(b, KVS_BUF_I32, KVS_PARIS_JOB_N);
        O->upload(b, pages, 0, hpg, nblk);
        O->upload(b, rows, 0, hrow, KVS_PARIS_ROW_N);
        O->upload(b, jobs, 0, hjob, KVS_PARIS_JOB_N);
        K->write_out(b, kc, vc, &m, jobs, hjob, 1, 0, 1, NKV, HD, BS, pages, nblk, hk, hv);
        struct kvs_dbuf *vk = K->host_view(b, hk, 0, E), *vv = K->host_view(b, hv, 0, E);
        /* today's spans: A over the pool, B over the host view (its block table is the pool's) */
        int32_t *na = kvs_xmalloc((size_t)C * NKV * 4), *nb = kvs_xmalloc((size_t)C * NKV * 4);
        int32_t *sa = kvs_xcalloc((size_t)C * NKV * 4, 4), *sb = kvs_xcalloc((size_t)C * NKV * 4, 4);
        for (int t = 0; t < C; t++)
            for (int g = 0; g < NKV; g++) {
                const size_t i = (size_t)t * NKV + g;
                na[i] = 2, nb[i] = 1;
                sa[i * 4] = 0, sa[i * 4 + 1] = lo, sa[i * 4 + 2] = hi, sa[i * 4 + 3] = p0 + t + 1;
                sb[i * 4] = lo, sb[i * 4 + 1] = hi;
            }
        struct kvs_dbuf *dna = bench_dalloc(b, KVS_BUF_I32, (size_t)C * NKV), *dnb = bench_dalloc(b, KVS_BUF_I32, (size_t)C * NKV);
        struct kvs_dbuf *dsa = bench_dalloc(b, KVS_BUF_I32, (size_t)C * NKV * 4), *dsb = bench_dalloc(b, KVS_BUF_I32, (size_t)C * NKV * 4);
        O->upload(b, dna, 0, na, (size_t)C * NKV), O->upload(b, dnb, 0, nb, (size_t)C * NKV);
        O->upload(b, dsa, 0, sa, (size_t)C * NKV * 4), O->upload(b, dsb, 0, sb, (size_t)C * NKV * 4);
        const struct kvs_span_list spa = {2, dna, dsa, na, sa}, spb = {2, dnb, dsb, nb, sb};
        /* staged: one gather row with the span [0, N) into a staging area of N positions */
        struct kvs_dbuf *sk = bench_dalloc(b, KVS_BUF_KV, E), *sv = bench_dalloc(b, KVS_BUF_KV, E);
        int32_t *gn = kvs_xmalloc(NKV * 4), *gs = kvs_xmalloc(NKV * 8), *sbt = kvs_xmalloc((size_t)nblk * 4);
        for (int g = 0; g < NKV; g++) gn[g] = 1, gs[2 * g] = 0, gs[2 * g + 1] = N;
        for (int j = 0; j < nblk; j++) sbt[j] = j;
        struct kvs_dbuf *dgn = bench_dalloc(b, KVS_BUF_I32, NKV), *dgs = bench_dalloc(b, KVS_BUF_I32, NKV * 2);
        struct kvs_dbuf *dsbt = bench_dalloc(b, KVS_BUF_I32, nblk);
        O->upload(b, dgn, 0, gn, NKV), O->upload(b, dgs, 0, gs, NKV * 2), O->upload(b, dsbt, 0, sbt, nblk);
        struct kvs_attn_meta sm = m;
        sm.block_tables = dsbt;
        /* the gather's meta: one decode-like row of the sequence at N - 1 (its spans stop at N) */
        int32_t gq[2] = {0, 1}, gp[1] = {N - 1};
        struct kvs_dbuf *gqs = bench_dalloc(b, KVS_BUF_I32, 2), *gps = bench_dalloc(b, KVS_BUF_I32, 1);
        O->upload(b, gqs, 0, gq, 2), O->upload(b, gps, 0, gp, 1);
        struct kvs_attn_meta gm = m;
        gm.q_start = gqs, gm.pos = gps, gm.h_q_start = gq, gm.h_pos = gp;
        O->sync(b);
        float *t = kvs_xmalloc((size_t)reps * sizeof(float));
        float pre = 0, rel = -1, stg = 0, gat = 0;
        for (int which = 0; which < 4; which++) {
            const int n_rep = which == 1 ? 1 : reps;
            if (which == 1 && slow_ms > 5000) continue;
            for (int r = -1; r < n_rep; r++) {
                if (which == 1 && r < 0) continue;   /* no warm-up: one run can take seconds */
                kvs_cuda_timer_start(b);
                if (which == 0) {
                    O->attention(b, q, kc, vc, &m, C, NH, NKV, HD, BS, scale, o1);
                } else if (which == 1) {
                    O->attention_spans(b, q, kc, vc, &m, &spa, C, NH, NKV, HD, BS, scale, o2, l2);
                    O->attention_spans(b, q, vk, vv, &m, &spb, C, NH, NKV, HD, BS, scale, ob, lb);
                    O->attn_merge(b, o2, l2, ob, lb, C, NH, HD);
                } else {
                    K->gather(b, kc, vc, &gm, rows, hrow, 1, 0, 1, NKV, HD, BS, dgn, dgs, 1, pages, nblk, hk, hv, sk, sv,
                              nblk);
                    if (which == 2) O->attention(b, q, sk, sv, &sm, C, NH, NKV, HD, BS, scale, o3);
                }
                const float ms = kvs_cuda_timer_stop_ms(b);
                if (r >= 0) t[r] = ms;
            }
            qsort(t, (size_t)n_rep, sizeof t[0], bench_cmp_float);
            const float med = t[n_rep / 2];
            if (which == 0) pre = med;
            else if (which == 1) rel = med, slow_ms = med;
            else if (which == 2) stg = med;
            else gat = med;
        }
        /* both candidates against the prefill kernel's result */
        const size_t n_out = (size_t)C * NH * HD;
        float *a = kvs_xmalloc(n_out * 4), *c = kvs_xmalloc(n_out * 4);
        double d_rel = -1, d_stg = 0;
        O->download(b, a, o1, 0, n_out);
        if (rel >= 0) {
            O->download(b, c, o2, 0, n_out);
            d_rel = 0;
            for (size_t i = 0; i < n_out; i++) d_rel = fmax(d_rel, fabs((double)a[i] - c[i]));
        }
        O->download(b, c, o3, 0, n_out);
        for (size_t i = 0; i < n_out; i++) d_stg = fmax(d_stg, fabs((double)a[i] - c[i]));
        if (rel >= 0)
            printf("| %d | %.3f | %.1f | %.0fx | %.3f | %.3f | %.2fx | %.2g | %.2g |\n", N, pre, rel, rel / pre, stg, gat,
                   stg / pre, d_rel, d_stg);
        else
            printf("| %d | %.3f | skipped (the last one took %.1f s) | | %.3f | %.3f | %.2fx | | %.2g |\n", N, pre,
                   slow_ms / 1000, stg, gat, stg / pre, d_stg);
        fflush(stdout);
        free(a), free(c), free(t);
        K->host_view_free(b, vk), K->host_view_free(b, vv);
        K->host_free(b, hk), K->host_free(b, hv);
        struct kvs_dbuf *all[] = {kc, vc, q, o1, o2, o3, l2, lb, ob, bt, qs, ps, pages, rows, jobs, dna, dnb, dsa, dsb,
                                  sk, sv, dgn, dgs, dsbt, gqs, gps};
        for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) O->free_buf(b, all[i]);
        free(perm), free(hpg), free(na), free(nb), free(sa), free(sb), free(gn), free(gs), free(sbt);
    }
    return 0;
}

int main(int argc, char **argv)
{
    int ctx = 1048576, Bn = 1, topk = 100, n_layers = 32, reps = 10, chunk = 0, ctxs[8], nc = 0;
    for (int i = 1; i < argc; i++) {
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(argv[i], "--context") && v) ctx = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--batch") && v) Bn = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--topk") && v) topk = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--layers") && v) n_layers = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--reps") && v) reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--chunk") && v) chunk = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--chunk-contexts") && v) nc = bench_parse_list(argv[++i], ctxs, 8);
        else {
            fprintf(stderr, "usage: %s [--context 1048576] [--batch 1] [--topk 100] [--layers 32] [--reps 10]\n"
                            "       %s --chunk 512 --chunk-contexts 16384,65536 [--reps 5]\n", argv[0], argv[0]);
            return 2;
        }
    }
    if (ctx <= 0 || Bn <= 0 || topk <= 0 || n_layers <= 0 || reps <= 0 || nc < 0 || (chunk > 0 && nc <= 0)) {
        fprintf(stderr, "%s: bad option value\n", argv[0]);
        return 2;
    }
    char err[256], desc[256];
    struct kvs_backend *b = bench_cuda_open();
    if (!b) return 1;
    if (!(K = kvs_paris_kernels_for(O, err, sizeof err)) || !O->attention_spans || !K->host_view) {
        fprintf(stderr, "%s\n", K ? "the cuda backend has no attention_spans / host_view" : err);
        return 1;
    }
    kvs_cuda_device_desc(b, desc, sizeof desc);
    printf("device: %s\n", desc);
    const int rc = chunk > 0 ? chunk_mode(b, chunk, ctxs, nc, reps) : step_mode(b, Bn, ctx, topk, n_layers, reps);
    fflush(stdout);
    /* the step mode's buffers are the process's until exit (one shape a run) */
    if (chunk > 0) O->free(b);
    return rc;
}
#else
int main(void)
{
    fprintf(stderr, "kvserve-parisstep: built without CUDA (nvcc not found)\n");
    return 1;
}
#endif
