/* kvserve_gpubench_main.c: decode-step benchmark of the CUDA backend on the Llama-3.1-8B shape
 * with random bf16 weights generated on the device (no files), -> build/kvserve-gpubench.
 *
 * One decode step is the runner's layer loop written with the backend's ops (embed; per layer
 * rmsnorm, the q/k/v matmuls in one op, RoPE + kv_write in one op, paged attention, o matmul, add+rmsnorm,
 * gate/up matmuls with SwiGLU in one op, down matmul; final norm and LM head), captured once per shape in a CUDA
 * graph and replayed. For each (batch, context) it prints ms/step (median of the replays),
 * tokens/s, the bytes the step must move (every weight matrix once + the K and V it attends
 * to; the embedding table contributes only its B rows), the floor = bytes / measured
 * device-to-device copy bandwidth (read + write bytes per second, same run), and floor / time.
 *
 * Prefill: one sequence of P prompt tokens in one step (the prefill attention launch), logits
 * for its last row; prints ms, tokens/s and TFLOP/s.
 *
 * Usage: kvserve-gpubench [--batches 1,8,32,128] [--contexts 1024,8192,32768] [--prefill 1024,8192|none]
 *                         [--iters 20] [--layers 32] [--block-size 16] [--no-fuse] [--breakdown] [--attn-variants]
 *                         [--gemm-sweep 1,8,16] [--markdown FILE]
 * --block-size sets the KV block size in tokens (kv.block_size; 16 by default); --verbose logs at
 * debug level (the CUDA backend's timing of each GEMM shape's cuBLASLt candidates). The runner
 * lays each layer's q/k/v and gate/up side by side (fuse_weights), and so does the benchmark;
 * --no-fuse keeps them apart (one GEMM per projection above the decode GEMM's rows).
 * --breakdown also times the GEMMs, the attention and all other ops of a step, each class alone.
 * --gemm-sweep times the GEMMs of a step alone at each row count (at most 512): the former
 * cublasGemmEx path, cuBLASLt with its heuristic's first pick, cuBLASLt with the timed pick (the
 * default), and the decode GEMM (at most 128 rows) at variants 2, 6, 7, 14, 22, 46 (or the list in
 * KVS_BENCH_SWEEP_VARIANTS, at most 8); then each weight shape alone (q/k/v, o, gate/up + down,
 * LM head) with its GB/s on cuBLASLt and at each of those variants. KVS_BENCH_STEP_VARIANTS (and
 * KVS_BENCH_STEP_SKMAX, the decode GEMM's row limit for each) repeats the step table once per
 * decode-GEMM variant in the same process (A/B in one run).
 * The random weights bypass upload_weight, so the benchmark has their GEMM shapes timed as
 * upload_weight would (kvs_cuda_pretune).
 * --attn-variants also times the attention of all layers alone at forced context-split counts, with
 * the automatic decode kernel and with kinds 3, 4 and 5 forced (kvs_cuda_set_dec_attn).
 * --pre-attn-variants also times each prefill's attention (all layers, median of 3) with each
 * prefill kernel forced (kvs_cuda_set_pre_attn: 1 mma.sync, 2 / 3 wgmma with 128- / 64-key tiles,
 * 4 / 5 the same overlapped, 6 64-key tiles with two blocks an SM, 7 to 18 k_attn_fa3: copy-engine
 * staging, producer / consumer warpgroups, diagnostic forms, ping-pong, persistent, K / V producers, 192-row blocks,
 * FlashAttention-3's issue order; 14 the default on sm_90; 19 kind 14 persistent, 20 / 21 kinds 14 / 19
 * skipping O's rescale where no row's max grew, 22 to 25 kind 14 with the Q reads in flight at once,
 * 22, 23 and 25 also with the softmax in shorter chains ahead of the P . V wait, 23 with ping-pong,
 * 25 with persistent blocks taking their items in snake order; 26 cuDNN's fused SDPA where built in
 * and loadable (make CUDNN=...), its line then saying how many of the launches cuDNN took);
 * --pre-attn-kinds 14,22 times only those kinds (in that order), --pre-attn-reps N the median of N
 * timed runs (default 3, after a warm-up).
 * A shape whose KV does not fit the pool (sized from free memory) is skipped with a note.
 * --lean FMT (K8V8, K8V4, K4V4, K16V16: kv.storage = lean's static modes) keeps the KV in LeanKV
 * pages instead of bf16 (kernels/kv_lean.h): per layer the q/k/v GEMM, RoPE, the quantized page
 * write and the LeanKV attention (the runner's ops for that storage); the pool, bytes and
 * floor count the format's bytes per token. --max-batch runs, at each context, the largest
 * batch whose KV fits the pool (sized from all free memory but a reserve for activations), the
 * "largest batch that fits" of a memory-bound throughput comparison (issue 20).
 * --mac K [--mac-thresh X] [--mac-band r]: each decode shape is also timed with MAC-Attention's
 * kernels (kernels/kv_mac.h: match + band/tail attention, rings of K entries per sequence and
 * layer allocated before the pool) in place of the attention op, in the same graph, and the
 * ratio printed. The rings hold random queries at the K positions before the row's (so a hit
 * reads at most K + r positions); the match runs on the post-RoPE q (the bench has no pre-RoPE
 * copy: the same bytes and work). X is the squared-distance threshold: 2 d (1 - tau)^2 by
 * default with tau 0.45 (random weights: the hit rate is what the queries give, printed), "inf"
 * pins every lookup to a hit on its nearest entry. --mac-parts also times the match alone and
 * attend (span + combine) alone, all layers each in its own graph. --share-kv: every layer uses
 * layer 0's K/V pool (the same bytes read per layer, see main), so batch 8 at 128K fits with 32
 * layers.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/util.h"
#include "kernels/backend.h"
#include "kernels/kv_lean.h"
#include "kernels/kv_mac.h"

#if defined(KVS_HAVE_CUDA) && KVS_HAVE_CUDA
#include "kernels/cuda/cuda_backend.h"
#include "bench/bench_cuda.h"

/* KV block size (tokens): --block-size, 16 by default (config/default.json's kv.block_size) */
static int BS = 16;
/* --lean FMT: LeanKV pages (lean_on) of this format instead of bf16 K/V */
static int lean_on;
static struct kvs_lean_fmt lean_fmt;
static const struct kvs_lean_kernels *LK;

static const struct kvs_backend_ops *O = &kvs_cuda_backend;

struct layer {
    struct kvs_dweight *wq, *wk, *wv, *wo, *wg, *wu, *wd, *n1, *n2;
    struct kvs_dbuf *kc, *vc;     /* bf16 K/V, or (--lean) NULL */
    struct kvs_dbuf *pages;       /* --lean: the layer's LeanKV pages */
};

static int parse_list(const char *s, int *out, int max)
{
    int n = 0;
    while (*s && n < max) {
        char *end;
        long v = strtol(s, &end, 10);
        if (end == s || v <= 0) return -1;
        out[n++] = (int)v;
        s = *end == ',' ? end + 1 : end;
    }
    return n;
}

static int cmp_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* the model and the step's buffers */
struct bench {
    struct kvs_backend *b;
    int n_layers;
    struct layer *L;
    struct kvs_dweight *emb, *head, *fnorm;
    struct kvs_dbuf *x, *h, *q, *k, *v, *att, *o, *g, *u, *logits, *last, *tok, *pos, *slots, *invf, *lastrow;
};

/* --mac: MAC-Attention's state (one ring slot per sequence, every layer) */
static struct {
    int K, band, on, max_nb;
    float thresh2;
    const struct kvs_mac_kernels *k;
    struct kvs_dbuf *rq, *ro, *rl, *rt, *rows, *p, *lse, *work;
    size_t work_n;
} MAC;

static void mac_attention(struct bench *B, int l, int nb, const struct kvs_attn_meta *m)
{
    const struct kvs_mac_call c = {
        .layer = l, .n_layers = B->n_layers, .K = MAC.K, .band = MAC.band, .n = nb, .n_heads = NH, .n_kv_heads = NKV,
        .head_dim = HD, .block_size = BS, .scale = 1.0f / sqrtf((float)HD), .thresh2 = MAC.thresh2, .q = B->q,
        .q_pre = B->q, .kc = B->L[l].kc, .vc = B->L[l].vc, .m = m, .rows = MAC.rows, .p = MAC.p,
        .p_off = (size_t)l * nb * NH, .ring_q = MAC.rq, .ring_o = MAC.ro, .ring_lse = MAC.rl, .ring_tag = MAC.rt,
        .out = B->att, .lse = MAC.lse, .work = MAC.work, .work_n = MAC.work_n,
    };
    if (MAC.on != 3) MAC.k->match(B->b, &c);    /* --mac-parts: 2 = the match alone, 3 = attend alone */
    if (MAC.on != 2) MAC.k->attend(B->b, &c);
}

/* which ops a timed graph holds: the whole step, or one class of ops alone (for the breakdown) */
enum { OPS_ALL, OPS_GEMM, OPS_ATTN, OPS_OTHER };
/* --gemm-sweep's per-shape columns: with OPS_GEMM, only this weight shape's GEMMs (0: all) */
enum { SHAPE_ALL, SHAPE_QKV, SHAPE_O, SHAPE_FFN, SHAPE_HEAD, SHAPE_COUNT };
static int gemm_only = SHAPE_ALL;
#define GEMM_OF(k) (gemm && (gemm_only == SHAPE_ALL || gemm_only == (k)))

/* Enqueues one forward step of nb rows (the runner's layer loop written with the backend's ops);
 * logits for every row (decode) or only the last (prefill). */
static void enqueue_step(struct bench *B, int nb, const struct kvs_attn_meta *m, int which, int last_only)
{
    struct kvs_backend *b = B->b;
    const int gemm = which == OPS_ALL || which == OPS_GEMM, attn = which == OPS_ALL || which == OPS_ATTN;
    const int other = which == OPS_ALL || which == OPS_OTHER;
    const float scale = 1.0f / sqrtf((float)HD);
    if (other) O->embed(b, B->emb, B->tok, nb, DIM, B->x);
    if (other) O->rmsnorm(b, B->x, B->L[0].n1, 1e-5f, nb, DIM, B->h);
    for (int l = 0; l < B->n_layers; l++) {
        struct layer *L = &B->L[l];
        const struct kvs_dweight *w[3] = {L->wq, L->wk, L->wv};
        if (lean_on) {
            /* kv.storage = lean: the q/k/v GEMM, RoPE of q and k, the quantized page write */
            const int outs[3] = {DIM, NKV * HD, NKV * HD};
            struct kvs_dbuf *y[3] = {B->q, B->k, B->v};
            if (GEMM_OF(SHAPE_QKV)) O->matmul_multi(b, B->h, 3, w, NULL, nb, DIM, outs, y);
            if (other) {
                O->rope(b, B->q, B->pos, NULL, B->invf, nb, NH, HD);
                O->rope(b, B->k, B->pos, NULL, B->invf, nb, NKV, HD);
                LK->write(b, lean_fmt, B->k, B->v, B->slots, nb, NKV, HD, BS, L->pages);
            }
        } else if (which == OPS_ALL) {
            /* the runner's op: the q/k/v GEMM straight into the RoPE and the cache write */
            O->matmul_rope_kv_write(b, B->h, w, NULL, nb, DIM, B->q, B->k, B->v, B->pos, B->invf, B->slots, NH, NKV, HD,
                                    BS, L->kc, L->vc);
        } else {
            /* the breakdown times the two halves apart: q/k/v with the GEMMs, the RoPE and cache
             * write with the other ops (their sum exceeds the fused op by the split of q/k/v) */
            const int outs[3] = {DIM, NKV * HD, NKV * HD};
            struct kvs_dbuf *y[3] = {B->q, B->k, B->v};
            if (GEMM_OF(SHAPE_QKV)) O->matmul_multi(b, B->h, 3, w, NULL, nb, DIM, outs, y);
            if (other) O->rope_kv_write(b, B->q, B->k, B->v, B->pos, B->invf, B->slots, nb, NH, NKV, HD, BS, L->kc, L->vc);
        }
        if (attn && lean_on) LK->attention(b, lean_fmt, B->q, L->pages, m, nb, NH, NKV, HD, BS, scale, B->att);
        else if (attn && MAC.on) mac_attention(B, l, nb, m);
        else if (attn) O->attention(b, B->q, L->kc, L->vc, m, nb, NH, NKV, HD, BS, scale, B->att);
        if (GEMM_OF(SHAPE_O)) O->matmul(b, B->att, L->wo, NULL, nb, DIM, DIM, B->o);
        if (other) O->add_rmsnorm(b, B->x, B->o, L->n2, 1e-5f, nb, DIM, B->h);
        if (GEMM_OF(SHAPE_FFN)) O->matmul_swiglu_down(b, B->h, L->wg, L->wu, L->wd, nb, DIM, FF, B->g, B->u, B->o);
        if (other) O->add_rmsnorm(b, B->x, B->o, l + 1 < B->n_layers ? B->L[l + 1].n1 : B->fnorm, 1e-5f, nb, DIM, B->h);
    }
    if (last_only) {
        if (other) O->gather_rows(b, B->h, B->lastrow, 1, DIM, B->last);
        if (GEMM_OF(SHAPE_HEAD)) O->matmul(b, B->last, B->head, NULL, 1, DIM, VOCAB, B->logits);
    } else if (GEMM_OF(SHAPE_HEAD)) {
        O->matmul(b, B->h, B->head, NULL, nb, DIM, VOCAB, B->logits);
    }
}

/* median ms of iters replays of a graph of the ops selected by `which` */
static float time_graph(struct bench *B, int nb, const struct kvs_attn_meta *m, int which, int iters)
{
    char err[160];
    O->graph_begin(B->b);
    enqueue_step(B, nb, m, which, 0);
    struct kvs_graph *gr = O->graph_end(B->b, err, sizeof err);
    if (!gr) kvs_panic(__FILE__, __LINE__, "%s", err);
    for (int w = 0; w < 3; w++) O->graph_launch(B->b, gr);
    float *t = kvs_xmalloc((size_t)iters * sizeof(float));
    for (int it = 0; it < iters; it++) {
        kvs_cuda_timer_start(B->b);
        O->graph_launch(B->b, gr);
        t[it] = kvs_cuda_timer_stop_ms(B->b);
    }
    qsort(t, (size_t)iters, sizeof(float), cmp_float);
    float ms = t[iters / 2];
    free(t);
    O->graph_free(B->b, gr);
    return ms;
}

/* the logits must be finite: a broken kernel fails the benchmark rather than timing garbage */
static void check_logits(struct bench *B, int rows, const char *what)
{
    float *lg = kvs_xmalloc((size_t)rows * VOCAB * 4);
    O->logits_to_host(B->b, B->logits, rows, VOCAB, lg);
    for (size_t i = 0; i < (size_t)rows * VOCAB; i++)
        if (!(lg[i] == lg[i]) || lg[i] > 1e30f || lg[i] < -1e30f)
            kvs_panic(__FILE__, __LINE__, "non-finite logit (%s)", what);
    free(lg);
}

static uint64_t rs = 88172645463325252ull;

/* nb sequences whose block tables are dealt at random from the pool; row s decodes (or
 * prefills) n_rows[s] tokens from position pos0[s]. Uploads everything; fills m. */
struct shape {
    int32_t *bt, *hq, *hp, *hs, *ht;
    struct kvs_dbuf *btd, *qs, *ps;
};
static void make_shape(struct bench *B, int n_blocks, int nb, int bps, int rows_each, int pos0, struct shape *S,
                       struct kvs_attn_meta *m)
{
    struct kvs_backend *b = B->b;
    int n = nb * rows_each;
    int32_t *perm = kvs_xmalloc((size_t)n_blocks * 4);
    S->bt = kvs_xmalloc((size_t)nb * bps * 4);
    S->hq = kvs_xmalloc((size_t)(nb + 1) * 4);
    S->hp = kvs_xmalloc((size_t)nb * 4);
    S->hs = kvs_xmalloc((size_t)n * 4);
    S->ht = kvs_xmalloc((size_t)n * 4);
    int32_t *rowpos = kvs_xmalloc((size_t)n * 4);
    for (int i = 0; i < n_blocks; i++) perm[i] = i;
    /* blocks in random order, as a long-running pool hands them out; KVS_BENCH_CONTIGUOUS=1 keeps
     * each sequence's blocks consecutive (to measure what the scattering costs the attention) */
    const char *contig = getenv("KVS_BENCH_CONTIGUOUS");
    for (int i = n_blocks - 1; i > 0 && !(contig && atoi(contig)); i--) {
        rs ^= rs << 13; rs ^= rs >> 7; rs ^= rs << 17;
        int j = (int)(rs % (uint64_t)(i + 1));
        int32_t t = perm[i]; perm[i] = perm[j]; perm[j] = t;
    }
    for (int s = 0; s < nb; s++) {
        for (int j = 0; j < bps; j++) S->bt[s * bps + j] = perm[s * bps + j];
        S->hq[s] = s * rows_each;
        S->hp[s] = pos0;
        for (int i = 0; i < rows_each; i++) {
            int p = pos0 + i, r = s * rows_each + i;
            rowpos[r] = p;
            S->hs[r] = S->bt[s * bps + p / BS] * BS + p % BS;
            S->ht[r] = (r * 7919) % VOCAB;
        }
    }
    S->hq[nb] = n;
    S->btd = bench_dalloc(b, KVS_BUF_I32, (size_t)nb * bps);
    S->qs = bench_dalloc(b, KVS_BUF_I32, (size_t)nb + 1);
    S->ps = bench_dalloc(b, KVS_BUF_I32, (size_t)nb);
    O->upload(b, S->btd, 0, S->bt, (size_t)nb * bps);
    O->upload(b, S->qs, 0, S->hq, (size_t)nb + 1);
    O->upload(b, S->ps, 0, S->hp, (size_t)nb);
    O->upload(b, B->pos, 0, rowpos, (size_t)n);
    O->upload(b, B->slots, 0, S->hs, (size_t)n);
    O->upload(b, B->tok, 0, S->ht, (size_t)n);
    int32_t last = n - 1;
    O->upload(b, B->lastrow, 0, &last, 1);
    *m = (struct kvs_attn_meta){.n_seqs = nb, .max_blocks = bps, .q_start = S->qs, .pos = S->ps, .block_tables = S->btd,
                                .rot_offsets = NULL, .inv_freq = B->invf, .h_q_start = S->hq, .h_pos = S->hp,
                                .max_ctx = pos0 + rows_each};
    O->sync(b);
    free(perm);
    free(rowpos);
}
static void free_shape(struct bench *B, struct shape *S)
{
    O->free_buf(B->b, S->btd);
    O->free_buf(B->b, S->qs);
    O->free_buf(B->b, S->ps);
    free(S->bt); free(S->hq); free(S->hp); free(S->hs); free(S->ht);
}

int main(int argc, char **argv)
{
    int batches[16] = {1, 8, 32, 128}, nbatch = 4, ctxs[16] = {1024, 8192, 32768}, nctx = 3, iters = 20;
    int prefills[8] = {1024, 8192}, npre = 2, sweep[16], nsweep = 0;
    int n_layers = 32, attn_variants = 0, breakdown = 0, fuse = 1, max_batch = 0, pre_variants = 0, share_kv = 0;
    int mac_parts = 0;
    int pre_kinds[32], n_pre_kinds = 0, pre_reps = 3;
    const char *md = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--batches") && i + 1 < argc) nbatch = parse_list(argv[++i], batches, 16);
        else if (!strcmp(argv[i], "--contexts") && i + 1 < argc) nctx = parse_list(argv[++i], ctxs, 16);
        else if (!strcmp(argv[i], "--prefill") && i + 1 < argc) npre = !strcmp(argv[i + 1], "none") ? (i++, 0) : parse_list(argv[++i], prefills, 8);
        else if (!strcmp(argv[i], "--iters") && i + 1 < argc) iters = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--layers") && i + 1 < argc) n_layers = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--markdown") && i + 1 < argc) md = argv[++i];
        else if (!strcmp(argv[i], "--attn-variants")) attn_variants = 1;
        else if (!strcmp(argv[i], "--pre-attn-variants")) pre_variants = 1;
        else if (!strcmp(argv[i], "--pre-attn-kinds") && i + 1 < argc) {
            pre_variants = 1;
            n_pre_kinds = parse_list(argv[++i], pre_kinds, 32);
        } else if (!strcmp(argv[i], "--pre-attn-reps") && i + 1 < argc) {
            pre_reps = atoi(argv[++i]);
            if (pre_reps < 1 || pre_reps > 15) pre_reps = 3;
        }
        else if (!strcmp(argv[i], "--breakdown")) breakdown = 1;
        else if (!strcmp(argv[i], "--block-size") && i + 1 < argc) BS = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--verbose")) kvs_log_set_level(KVS_LOG_DEBUG);
        else if (!strcmp(argv[i], "--no-fuse")) fuse = 0;
        else if (!strcmp(argv[i], "--max-batch")) max_batch = 1;
        else if (!strcmp(argv[i], "--share-kv")) share_kv = 1;
        else if (!strcmp(argv[i], "--mac-parts")) mac_parts = 1;
        else if (!strcmp(argv[i], "--lean") && i + 1 < argc) {
            if (kvs_lean_fmt_parse(argv[++i], &lean_fmt) < 0) {
                fprintf(stderr, "--lean: K8V8, K8V4, K4V4 or K16V16\n");
                return 2;
            }
            lean_on = 1;
        }
        else if (!strcmp(argv[i], "--mac") && i + 1 < argc) MAC.K = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--mac-band") && i + 1 < argc) MAC.band = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--mac-thresh") && i + 1 < argc) MAC.thresh2 = (float)atof(argv[++i]);
        else if (!strcmp(argv[i], "--gemm-sweep") && i + 1 < argc) nsweep = parse_list(argv[++i], sweep, 16);
        else {
            fprintf(stderr, "usage: %s [--batches 1,8,32] [--contexts 1024,8192] [--prefill 1024,8192|none] [--iters N] "
                            "[--layers N] [--block-size 16] [--verbose] [--no-fuse] [--breakdown] [--attn-variants] [--pre-attn-variants] [--pre-attn-kinds 14,22] [--pre-attn-reps 3] [--gemm-sweep 1,8,16,32] "
                            "[--lean K8V4] [--max-batch] [--markdown FILE] [--mac K [--mac-band r] [--mac-thresh X|inf] [--mac-parts]] "
                            "[--share-kv]\n", argv[0]);
            return 2;
        }
    }
    for (int i = 0; i < nsweep; i++)
        if (sweep[i] > 512) nsweep = -1;
    if (nbatch <= 0 || nctx <= 0 || npre < 0 || nsweep < 0 || iters <= 0 || iters > 1000 || n_layers <= 0 || n_layers > 256 ||
        BS < 1 || BS > 2048) {
        fprintf(stderr, "bad arguments\n");
        return 2;
    }
    char err[256], desc[256];
    struct bench Bn = {0}, *B = &Bn;
    struct kvs_backend *b = B->b = O->create(0, err, sizeof err);
    if (!b) {
        fprintf(stderr, "cuda backend: %s\n", err);
        return 1;
    }
    B->n_layers = n_layers;
    if (lean_on) {
        LK = kvs_lean_kernels_for(O, err, sizeof err);
        if (!LK || !LK->supports(lean_fmt, NH, NKV, HD)) {
            fprintf(stderr, "--lean: the cuda backend does not take K%dV%d here (%s)\n", lean_fmt.kbits, lean_fmt.vbits,
                    LK ? "supports()" : err);
            return 1;
        }
        if (attn_variants || nsweep || MAC.K > 0) {
            fprintf(stderr, "--lean: not with --attn-variants, --gemm-sweep or --mac (bf16 K/V only)\n");
            return 2;
        }
    }
    if (max_batch && MAC.K > 0) {
        fprintf(stderr, "--max-batch: not with --mac\n");
        return 2;
    }
    kvs_cuda_device_desc(b, desc, sizeof desc);
    double bw = kvs_cuda_copy_bandwidth(b, (size_t)2 << 30);
    printf("device: %s\ncopy bandwidth (read+write, 2 GiB cudaMemcpy D2D, median of 15): %.0f GB/s\n", desc, bw / 1e9);

    /* --max-batch: the rows the activations are sized for (the batches come from the pool) */
    const int max_batch_rows = 512;
    if (max_batch) batches[0] = max_batch_rows, nbatch = 1;
    int max_rows = 0;
    for (int i = 0; i < nbatch; i++) if (batches[i] > max_rows) max_rows = batches[i];
    for (int i = 0; i < npre; i++) if (prefills[i] > max_rows) max_rows = prefills[i];
    for (int i = 0; i < nsweep; i++) if (sweep[i] > max_rows) max_rows = sweep[i];

    /* weights, random on the device (uniform, small scale so activations stay finite) */
    uint64_t seed = 1;
    B->emb = kvs_cuda_random_weight(b, VOCAB, DIM, 0, 0.02f, seed++);
    B->head = kvs_cuda_random_weight(b, VOCAB, DIM, 0, 0.02f, seed++);
    B->fnorm = kvs_cuda_random_weight(b, 1, DIM, 1, 1.0f, seed++);
    struct layer *L = B->L = kvs_xcalloc((size_t)n_layers, sizeof *L);
    for (int l = 0; l < n_layers; l++) {
        bench_random_layer(b, &seed, &L[l].wq, &L[l].wk, &L[l].wv, &L[l].wo, &L[l].wg,
                           &L[l].wu, &L[l].wd, &L[l].n1, &L[l].n2);
    }
    if (!B->emb || !B->head || !B->fnorm) kvs_panic(__FILE__, __LINE__, "out of device memory for the weights");
    /* what the runner does after a layer's uploads: q/k/v and gate/up side by side (which times
     * the joint shapes) */
    for (int l = 0; l < n_layers && fuse; l++) {
        struct kvs_dweight *qkv[3] = {L[l].wq, L[l].wk, L[l].wv}, *gu[2] = {L[l].wg, L[l].wu};
        if (O->fuse_weights(b, qkv, 3) || O->fuse_weights(b, gu, 2))
            kvs_panic(__FILE__, __LINE__, "fuse_weights failed (out of device memory?)");
    }
    /* and what upload_weight does for the shapes left: time their GEMMs at the decode graphs'
     * row counts (every layer has layer 0's shapes; the o projection has q's) */
    const struct kvs_dweight *shapes[] = {L[0].wo, L[0].wd, B->head, L[0].wk, L[0].wg};
    for (size_t i = 0; i < (fuse ? 3 : 5); i++) kvs_cuda_pretune(b, shapes[i]);
    double w_bytes = (double)n_layers * 2.0 * ((double)DIM * DIM * 2 + 2.0 * NKV * HD * DIM + 3.0 * FF * DIM) +
                     2.0 * VOCAB * DIM + 4.0 * DIM * (2 * n_layers + 1);
    double gemm_bytes = w_bytes - 4.0 * DIM * (2 * n_layers + 1); /* the matrices the GEMMs read */
    double params = gemm_bytes / 2.0;

    /* --mac: rings for the largest decode batch, before the pool takes the free memory */
    if (MAC.K > 0) {
        if (!MAC.band) MAC.band = 256;
        if (!MAC.thresh2) MAC.thresh2 = 2.0f * HD * 0.55f * 0.55f;
        if (!(MAC.k = kvs_mac_kernels_for(O, err, sizeof err))) kvs_panic(__FILE__, __LINE__, "%s", err);
        for (int i = 0; i < nbatch; i++) if (batches[i] > MAC.max_nb) MAC.max_nb = batches[i];
        const size_t ent = (size_t)MAC.max_nb * n_layers * MAC.K;
        MAC.rq = bench_dalloc(b, KVS_BUF_KV, ent * NH * HD);
        MAC.ro = bench_dalloc(b, KVS_BUF_KV, ent * NH * HD);
        MAC.rl = bench_dalloc(b, KVS_BUF_F32, ent * NH);
        MAC.rt = bench_dalloc(b, KVS_BUF_I32, ent);
        MAC.rows = bench_dalloc(b, KVS_BUF_I32, (size_t)MAC.max_nb * 4);
        MAC.p = bench_dalloc(b, KVS_BUF_I32, (size_t)n_layers * MAC.max_nb * NH);
        MAC.lse = bench_dalloc(b, KVS_BUF_F32, (size_t)MAC.max_nb * NH);
        MAC.work_n = MAC.k->work_elems(MAC.max_nb, NH, HD);
        MAC.work = bench_dalloc(b, KVS_BUF_F32, MAC.work_n);
        kvs_cuda_fill_random(b, MAC.rq, 0, ent * NH * HD, 1.0f, seed++);
        kvs_cuda_fill_random(b, MAC.ro, 0, ent * NH * HD, 0.05f, seed++);
        kvs_cuda_fill_random(b, MAC.rl, 0, ent * NH, 1.0f, seed++);
        printf("mac: K %d, band %d, threshold %g, rings %.2f GB\n", MAC.K, MAC.band, MAC.thresh2,
               (double)ent * (NH * HD * 4.0 + NH * 4.0 + 4.0) / 1e9);
    }

    /* activations for the largest step */
    size_t R = (size_t)max_rows;
    B->x = bench_dalloc(b, KVS_BUF_ACT, R * DIM); B->h = bench_dalloc(b, KVS_BUF_ACT, R * DIM);
    B->q = bench_dalloc(b, KVS_BUF_ACT, R * DIM); B->k = bench_dalloc(b, KVS_BUF_ACT, R * NKV * HD);
    B->v = bench_dalloc(b, KVS_BUF_ACT, R * NKV * HD); B->att = bench_dalloc(b, KVS_BUF_ACT, R * DIM);
    B->o = bench_dalloc(b, KVS_BUF_ACT, R * DIM); B->g = bench_dalloc(b, KVS_BUF_ACT, R * FF);
    B->u = bench_dalloc(b, KVS_BUF_ACT, R * FF);
    size_t max_b = 0;
    for (int i = 0; i < nbatch; i++) if ((size_t)batches[i] > max_b) max_b = (size_t)batches[i];
    for (int i = 0; i < nsweep; i++) if ((size_t)sweep[i] > max_b) max_b = (size_t)sweep[i];
    B->logits = bench_dalloc(b, KVS_BUF_ACT, (max_b ? max_b : 1) * VOCAB);
    B->last = bench_dalloc(b, KVS_BUF_ACT, DIM);
    B->tok = bench_dalloc(b, KVS_BUF_I32, R); B->pos = bench_dalloc(b, KVS_BUF_I32, R);
    B->slots = bench_dalloc(b, KVS_BUF_I32, R); B->invf = bench_dalloc(b, KVS_BUF_F32, HD / 2);
    B->lastrow = bench_dalloc(b, KVS_BUF_I32, 1);

    /* KV pool: what free memory allows (keeping 1 GiB), at most what the largest shape needs */
    size_t need_tokens = 0;
    for (int i = 0; i < nbatch; i++)
        for (int j = 0; j < nctx; j++) {
            size_t t = (size_t)batches[i] * (size_t)((ctxs[j] + BS - 1) / BS * BS);
            if (t > need_tokens) need_tokens = t;
        }
    for (int i = 0; i < npre; i++)
        if ((size_t)prefills[i] + BS > need_tokens) need_tokens = (size_t)prefills[i] + BS;
    for (int i = 0; i < nsweep; i++) /* a sweep's step: one block per sequence */
        if ((size_t)sweep[i] * BS > need_tokens) need_tokens = (size_t)sweep[i] * BS;
    size_t per_token = (size_t)n_layers * 2 * NKV * HD * 2;
    if (lean_on) per_token = (size_t)n_layers * NKV * kvs_lean_token_bytes(lean_fmt, HD);
    /* --share-kv: every layer reads and writes layer 0's K/V pool, so that long contexts at batch > 1
     * fit with all layers (batch 8 x 128K x 32 layers is 137 GB). The traffic is the same: each
     * layer's attention reads its whole context from memory (GBs against a 50 MB L2), only the
     * values are shared. */
    const size_t pool_per_token = share_kv ? per_token / (size_t)n_layers : per_token;
    if (share_kv && lean_on) {
        fprintf(stderr, "--share-kv: not with --lean\n");
        return 2;
    }
    size_t avail = O->mem_available(b);
    /* the reserve: 1 GiB (--max-batch: 2 GiB, for the graphs and workspaces of large batches) */
    const size_t reserve = (size_t)(max_batch ? 2 : 1) << 30;
    size_t cap_tokens = avail > reserve ? (avail - reserve) / pool_per_token : 0;
    if (cap_tokens > need_tokens && !max_batch) cap_tokens = need_tokens;
    int n_blocks = (int)(cap_tokens / BS);
    printf("weights %.2f GB (bf16), KV %s: %zu bytes/token, pool %d blocks of %d tokens = %.2f GB%s\n", w_bytes / 1e9,
           lean_on ? "LeanKV pages" : "bf16", per_token, n_blocks, BS, (double)n_blocks * BS * pool_per_token / 1e9,
           share_kv ? " (--share-kv: one pool for all layers)" : "");
    if (lean_on) {
        /* pages quantized from random K/V (uniform [-1, 1)), CHUNK tokens a write */
        enum { CHUNK = 16384 };
        const size_t page_bytes = kvs_lean_page_bytes(lean_fmt, HD, BS) * NKV * (size_t)n_blocks;
        struct kvs_dbuf *ck = bench_dalloc(b, KVS_BUF_ACT, (size_t)CHUNK * NKV * HD), *cv = bench_dalloc(b, KVS_BUF_ACT, (size_t)CHUNK * NKV * HD);
        struct kvs_dbuf *cs = bench_dalloc(b, KVS_BUF_I32, CHUNK);
        int32_t *hs = kvs_xmalloc(CHUNK * 4);
        kvs_cuda_fill_random(b, ck, 0, (size_t)CHUNK * NKV * HD, 1.0f, seed++);
        kvs_cuda_fill_random(b, cv, 0, (size_t)CHUNK * NKV * HD, 1.0f, seed++);
        for (int l = 0; l < n_layers; l++) {
            L[l].pages = LK->alloc_pages(b, page_bytes);
            if (!L[l].pages) kvs_panic(__FILE__, __LINE__, "out of device memory for the LeanKV pages");
            for (size_t t0 = 0; t0 < (size_t)n_blocks * BS; t0 += CHUNK) {
                const int n = (size_t)n_blocks * BS - t0 < CHUNK ? (int)((size_t)n_blocks * BS - t0) : CHUNK;
                for (int i = 0; i < n; i++) hs[i] = (int32_t)(t0 + i);
                O->upload(b, cs, 0, hs, (size_t)n);
                LK->write(b, lean_fmt, ck, cv, cs, n, NKV, HD, BS, L[l].pages);
            }
        }
        O->sync(b);
        O->free_buf(b, ck), O->free_buf(b, cv), O->free_buf(b, cs);
        free(hs);
    } else {
        for (int l = 0; l < n_layers; l++) {
            if (share_kv && l > 0) {
                L[l].kc = L[0].kc, L[l].vc = L[0].vc;
                continue;
            }
            L[l].kc = bench_dalloc(b, KVS_BUF_KV, (size_t)n_blocks * NKV * BS * HD);
            L[l].vc = bench_dalloc(b, KVS_BUF_KV, (size_t)n_blocks * NKV * BS * HD);
            kvs_cuda_fill_random(b, L[l].kc, 0, (size_t)n_blocks * NKV * BS * HD, 1.0f, seed++);
            kvs_cuda_fill_random(b, L[l].vc, 0, (size_t)n_blocks * NKV * BS * HD, 1.0f, seed++);
        }
    }
    float inv[HD / 2];
    for (int i = 0; i < HD / 2; i++) inv[i] = (float)(1.0 / pow(500000.0, 2.0 * i / HD));
    O->upload(b, B->invf, 0, inv, HD / 2);

    FILE *mf = md ? fopen(md, "w") : NULL;
    if (md && !mf) {
        fprintf(stderr, "cannot write %s\n", md);
        return 1;
    }
    /* the GEMMs of a decode step alone: cublasGemmEx, cuBLASLt's first pick, cuBLASLt's timed pick,
     * the decode GEMM (cuda_skinny.h; it takes at most 128 rows) */
    if (nsweep > 0) {
        printf("\nGEMMs of one decode step (every weight matrix once):\n%6s %18s %18s %18s %18s %8s %9s %9s\n", "rows",
               "GemmEx ms (GB/s)", "Lt first ms (GB/s)", "Lt tuned ms (GB/s)", "decode ms (GB/s)", "Ex/tuned",
               "1st/tuned", "tuned/dec");
        if (mf)
            fprintf(mf, "| rows | cublasGemmEx ms (GB/s) | cuBLASLt first pick ms (GB/s) | cuBLASLt tuned ms (GB/s) | "
                        "decode GEMM ms (GB/s) | GemmEx / tuned | first pick / tuned | tuned / decode GEMM |\n"
                        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
        for (int i = 0; i < nsweep; i++) {
            const int rows = sweep[i];
            struct shape S;
            struct kvs_attn_meta m;
            if (rows > n_blocks) {
                printf("%6d   skipped: the KV pool has %d blocks\n", rows, n_blocks);
                continue;
            }
            make_shape(B, n_blocks, rows, 1, 1, 0, &S, &m);
            kvs_cuda_set_skinny_max(b, 0);
            kvs_cuda_set_gemm(b, KVS_CUDA_GEMM_EX);
            float te = time_graph(B, rows, &m, OPS_GEMM, iters);
            kvs_cuda_set_gemm(b, KVS_CUDA_GEMM_HEURISTIC);
            float th = time_graph(B, rows, &m, OPS_GEMM, iters);
            /* a graph capture cannot time a GEMM shape: row counts that were not timed up front (not
             * a decode graph size) get timed by one step outside a graph first, as the runner's
             * eager steps would */
            kvs_cuda_set_gemm(b, KVS_CUDA_GEMM_TUNED);
            enqueue_step(B, rows, &m, OPS_GEMM, 0);
            O->sync(b);
            float tt = time_graph(B, rows, &m, OPS_GEMM, iters);
            /* the decode GEMM at each variant (cuda_skinny.cu; same results, other speeds) */
            /* KVS_BENCH_SWEEP_VARIANTS=46,110,...: other variants to compare (at most 8) */
            int dvar[8] = {2, 6, 7, 14, 22, 46}, ndv = 6;
            const char *sv = getenv("KVS_BENCH_SWEEP_VARIANTS");
            if (sv) {
                const int k = parse_list(sv, dvar, 8);
                if (k > 0) ndv = k;
            }
            float tsv[8] = {0};
            for (int v = 0; v < ndv && rows <= 128; v++) {
                kvs_cuda_set_skinny_max(b, 128);
                kvs_cuda_set_skinny_variant(b, dvar[v]);
                tsv[v] = time_graph(B, rows, &m, OPS_GEMM, iters);
            }
            float ts = tsv[0];
            for (int v = 1; v < ndv; v++) if (tsv[v] > 0 && tsv[v] < ts) ts = tsv[v];
            char dec[48] = "-", ratio[24] = "-";
            if (ts > 0.0f) {
                snprintf(dec, sizeof dec, "%.3f (%.0f)", ts, gemm_bytes / (ts * 1e-3) / 1e9);
                snprintf(ratio, sizeof ratio, "%.3f", tt / ts);
            }
            printf("%6d %9.3f (%6.0f) %9.3f (%6.0f) %9.3f (%6.0f) %18s %8.3f %9.3f %9s\n", rows, te,
                   gemm_bytes / (te * 1e-3) / 1e9, th, gemm_bytes / (th * 1e-3) / 1e9, tt,
                   gemm_bytes / (tt * 1e-3) / 1e9, dec, te / tt, th / tt, ratio);
            if (mf)
                fprintf(mf, "| %d | %.3f (%.0f) | %.3f (%.0f) | %.3f (%.0f) | %s | %.3f | %.3f | %s |\n", rows, te,
                        gemm_bytes / (te * 1e-3) / 1e9, th, gemm_bytes / (th * 1e-3) / 1e9, tt,
                        gemm_bytes / (tt * 1e-3) / 1e9, dec, te / tt, th / tt, ratio);
            if (rows <= 128) {
                printf("%6s decode GEMM by variant (2: k_skinny; 6: wgmma, 7: wgmma split for one block per SM, 14: "
                       "wgmma where unsplit, 22: 6 reduced in a cluster, 46: 14 + k_dgemm_n for split launches), GB/s:", "");
                for (int v = 0; v < ndv; v++) printf(" v%d %.0f", dvar[v], gemm_bytes / (tsv[v] * 1e-3) / 1e9);
                printf("\n");
                if (mf) {
                    fprintf(mf, "|  | all GEMMs GB/s by decode variant:");
                    for (int v = 0; v < ndv; v++) fprintf(mf, " v%d %.0f", dvar[v], gemm_bytes / (tsv[v] * 1e-3) / 1e9);
                    fprintf(mf, " | | | | | | |\n");
                }
            }
            /* each weight shape alone: cuBLASLt tuned, then the decode GEMM at each variant, so
             * the GB/s of a slow shape shows and the switch-over can be set per shape */
            const double sbytes[SHAPE_COUNT] = {
                gemm_bytes, (double)n_layers * 2.0 * ((double)DIM * DIM + 2.0 * NKV * HD * DIM),
                (double)n_layers * 2.0 * DIM * DIM, (double)n_layers * 2.0 * 3.0 * FF * DIM, 2.0 * VOCAB * DIM};
            const char *sname[SHAPE_COUNT] = {"all", "qkv", "o", "gate/up+down", "lm head"};
            for (int k = 1; k < SHAPE_COUNT; k++) {
                char line[400];
                gemm_only = k;
                kvs_cuda_set_skinny_max(b, 0);
                float tk = time_graph(B, rows, &m, OPS_GEMM, iters);
                int off = snprintf(line, sizeof line, "%6d %-13s GB/s: cuBLASLt %.0f", rows, sname[k],
                                   sbytes[k] / (tk * 1e-3) / 1e9);
                for (int v = 0; v < ndv && rows <= 128; v++) {
                    kvs_cuda_set_skinny_max(b, 128);
                    kvs_cuda_set_skinny_variant(b, dvar[v]);
                    float tv = time_graph(B, rows, &m, OPS_GEMM, iters);
                    off += snprintf(line + off, sizeof line - (size_t)off, " | decode v%d %.0f", dvar[v],
                                    sbytes[k] / (tv * 1e-3) / 1e9);
                }
                printf("%s\n", line);
                if (mf) fprintf(mf, "|  | %s | | | | | | |\n", line);
            }
            gemm_only = SHAPE_ALL;
            kvs_cuda_set_skinny_variant(b, -1);
            kvs_cuda_set_skinny_max(b, -1);
            kvs_cuda_set_gemm(b, -1);
            fflush(stdout);
            free_shape(B, &S);
        }
        kvs_cuda_set_skinny_max(b, -1);
        kvs_cuda_set_gemm(b, -1);
        printf("\n");
        if (mf) fprintf(mf, "\n");
    }

    if (mf) {
        fprintf(mf, "| batch | context | ms/step | tokens/s | weights GB | KV read GB | floor ms | achieved |%s\n",
                breakdown ? " GEMMs ms (GB/s) | attention ms (GB/s) | other ms |" : "");
        fprintf(mf, "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |%s\n", breakdown ? " ---: | ---: | ---: |" : "");
    }
    printf("%6s %8s %9s %10s %10s %10s %9s %9s%s\n", "batch", "context", "ms/step", "tokens/s", "weights GB", "KV GB",
           "floor ms", "achieved", breakdown ? "   gemm ms (GB/s)   attn ms (GB/s)   other ms" : "");

    float *t = kvs_xmalloc((size_t)iters * sizeof(float));
    /* KVS_BENCH_STEP_VARIANTS=46,238 (with KVS_BENCH_STEP_SKMAX=64,128: the decode GEMM's row limit
     * for each): the whole table once per decode-GEMM variant, in this process (an A/B in the same
     * run, same weights and copy bandwidth); unset: once, at the defaults */
    int stepv[8] = {-1}, stepk[8] = {-1, -1, -1, -1, -1, -1, -1, -1}, nstepv = 1;
    if (getenv("KVS_BENCH_STEP_VARIANTS")) {
        nstepv = parse_list(getenv("KVS_BENCH_STEP_VARIANTS"), stepv, 8);
        if (nstepv <= 0) nstepv = 1, stepv[0] = -1;
        if (getenv("KVS_BENCH_STEP_SKMAX")) parse_list(getenv("KVS_BENCH_STEP_SKMAX"), stepk, 8);
    }
    for (int svi = 0; svi < nstepv; svi++) {
        if (nstepv > 1 || stepv[0] >= 0) {
            kvs_cuda_set_skinny_variant(b, stepv[svi]);
            kvs_cuda_set_skinny_max(b, stepk[svi]);
            printf("decode GEMM variant %d, skinny_max %d (-1: default)\n", stepv[svi], stepk[svi]);
            if (mf) fprintf(mf, "| variant %d, skinny_max %d | | | | | | | |%s\n", stepv[svi], stepk[svi], breakdown ? " | | |" : "");
        }
        for (int bi = 0; bi < nbatch; bi++)
            for (int ci = 0; ci < nctx; ci++) {
                int nb = batches[bi], ctx = ctxs[ci];
                int bps = (ctx + BS - 1) / BS;
                if (max_batch) {
                    /* the largest batch whose KV fits the pool (at most the rows the activations take) */
                    nb = n_blocks / bps < max_batch_rows ? n_blocks / bps : max_batch_rows;
                    if (nb < 1) nb = 1;
                }
                if ((size_t)nb * bps > (size_t)n_blocks) {
                    printf("%6d %8d   skipped: KV of %.1f GB does not fit the pool\n", nb, ctx,
                           (double)nb * bps * BS * per_token / 1e9);
                    if (mf) fprintf(mf, "| %d | %d | skipped (KV does not fit) | | | | | |%s\n", nb, ctx, breakdown ? " | | |" : "");
                    continue;
                }
                /* each sequence decodes its token at position ctx-1 over blocks dealt at random */
                struct shape S;
                struct kvs_attn_meta m;
                make_shape(B, n_blocks, nb, bps, 1, ctx - 1, &S, &m);
                float ms = time_graph(B, nb, &m, OPS_ALL, iters);
                check_logits(B, nb, "decode");
                double kv_bytes = (double)nb * ctx * per_token; /* every layer's K and V of every position */
                double bytes = w_bytes + kv_bytes;
                double floor_ms = bytes / bw * 1e3;
                char extra[160] = "", mextra[160] = "";
                if (breakdown) {
                    float tg = time_graph(B, nb, &m, OPS_GEMM, iters), ta = time_graph(B, nb, &m, OPS_ATTN, iters);
                    float to = time_graph(B, nb, &m, OPS_OTHER, iters);
                    snprintf(extra, sizeof extra, "  %7.3f (%4.0f)  %7.3f (%4.0f)  %7.3f", tg, gemm_bytes / (tg * 1e-3) / 1e9,
                             ta, kv_bytes / (ta * 1e-3) / 1e9, to);
                    snprintf(mextra, sizeof mextra, " %.3f (%.0f) | %.3f (%.0f) | %.3f |", tg, gemm_bytes / (tg * 1e-3) / 1e9,
                             ta, kv_bytes / (ta * 1e-3) / 1e9, to);
                }
                printf("%6d %8d %9.3f %10.0f %10.2f %10.2f %9.3f %8.1f%%%s\n", nb, ctx, ms, nb / (ms * 1e-3), w_bytes / 1e9,
                       kv_bytes / 1e9, floor_ms, 100.0 * floor_ms / ms, extra);
                if (MAC.K > 0 && nb <= MAC.max_nb) {
                    /* rows: sequence s in ring slot s; entries hold the K positions before ctx - 1 */
                    const int mpos = ctx - 1;
                    int32_t *rows = kvs_xmalloc((size_t)nb * 16), *tags = kvs_xmalloc((size_t)n_layers * nb * MAC.K * 4);
                    for (int s = 0; s < nb; s++) {
                        rows[4 * s] = s, rows[4 * s + 1] = s, rows[4 * s + 2] = mpos;
                        rows[4 * s + 3] = KVS_MAC_F_MAC | KVS_MAC_F_MATCH;
                    }
                    for (size_t e = 0; e < (size_t)n_layers * nb; e++)
                        for (int j = 0; j < MAC.K; j++) {
                            const int pj = mpos - 1 - ((mpos - 1 - j) % MAC.K + MAC.K) % MAC.K;
                            tags[e * MAC.K + j] = pj >= 0 ? pj + 1 : 0;
                        }
                    O->upload(b, MAC.rows, 0, rows, (size_t)nb * 4);
                    O->upload(b, MAC.rt, 0, tags, (size_t)n_layers * nb * MAC.K);   /* slots s < nb: [s][layer][K] */
                    MAC.on = 1;
                    const float ms_mac = time_graph(B, nb, &m, OPS_ALL, iters);
                    const float ta_mac = time_graph(B, nb, &m, OPS_ATTN, iters);
                    float ta_match = 0, ta_attend = 0;
                    if (mac_parts) {
                        MAC.on = 2;
                        ta_match = time_graph(B, nb, &m, OPS_ATTN, iters);
                        MAC.on = 3;
                        ta_attend = time_graph(B, nb, &m, OPS_ATTN, iters);
                    }
                    MAC.on = 0;
                    const float ta_full = time_graph(B, nb, &m, OPS_ATTN, iters);
                    int32_t *hp = kvs_xmalloc((size_t)n_layers * nb * NH * 4);
                    O->download(b, hp, MAC.p, 0, (size_t)n_layers * nb * NH);
                    double hits = 0, read = 0;
                    for (size_t i = 0; i < (size_t)n_layers * nb * NH; i++) {
                        hits += hp[i] >= 0;
                        const int s0 = hp[i] >= 0 ? (hp[i] - MAC.band + 1 > 0 ? hp[i] - MAC.band + 1 : 0) : 0;
                        read += (double)(mpos + 1 - s0) / (mpos + 1);
                    }
                    const double nq = (double)n_layers * nb * NH;
                    printf("%6s %8s   mac: %9.3f ms/step (%.2fx), TPOT %.3f ms; attention of all layers %.3f ms vs full %.3f ms "
                           "(%.2fx); hits %.1f%%, q heads read %.2f%% of the context\n", "", "", ms_mac, ms / ms_mac,
                           ms_mac, ta_mac, ta_full, ta_full / ta_mac, 100.0 * hits / nq, 100.0 * read / nq);
                    if (mac_parts)
                        printf("%6s %8s   mac parts (all layers, each its own graph): match %.3f ms, attend (span + combine) "
                               "%.3f ms, sum %.3f ms vs together %.3f ms; non-attention work %.3f ms\n", "", "", ta_match,
                               ta_attend, ta_match + ta_attend, ta_mac, ms_mac - ta_mac);
                    if (mf)
                        fprintf(mf, "| %d | %d | mac %.3f (full %.3f, %.2fx) | attention %.3f vs %.3f (%.2fx) | hits %.1f%% | read %.2f%% |\n",
                                nb, ctx, ms_mac, ms, ms / ms_mac, ta_mac, ta_full, ta_full / ta_mac, 100.0 * hits / nq,
                                100.0 * read / nq);
                    fflush(stdout);
                    free(rows), free(tags), free(hp);
                }
                fflush(stdout);
                if (mf)
                    fprintf(mf, "| %d | %d | %.3f | %.0f | %.2f | %.2f | %.3f | %.1f%% |%s\n", nb, ctx, ms, nb / (ms * 1e-3),
                            w_bytes / 1e9, kv_bytes / 1e9, floor_ms, 100.0 * floor_ms / ms, mextra);
                /* attention alone (all layers) at forced split counts vs the automatic choice: with the
                 * automatic decode kernel, then with kinds 3 (one-warp tensor-core blocks, 3 tiles in
                 * flight), 4 (the FlashAttention-2-style 4-warp blocks, the copy engine staging the KV)
                 * and 5 (the same with cp.async staging) forced */
                if (attn_variants) {
                    static const int var[] = {0, 1, 2, 3, 4, 6, 8, 16}, kinds[] = {-1, 3, 4, 5};
                    for (int ki = 0; ki < (int)(sizeof kinds / sizeof kinds[0]); ki++) {
                        kvs_cuda_set_dec_attn(b, kinds[ki]);
                        if (kinds[ki] < 0) printf("%6s %8s   attention only, kernel auto, splits:", "", "");
                        else printf("%6s %8s   attention only, kernel %d,    splits:", "", "", kinds[ki]);
                        for (int vi = 0; vi < 8; vi++) {
                            kvs_cuda_set_attn_splits(b, var[vi]);
                            float ta = time_graph(B, nb, &m, OPS_ATTN, iters);
                            if (var[vi]) printf("  %d: %.3f ms", var[vi], ta);
                            else printf("  auto: %.3f ms (%.0f GB/s)", ta, kv_bytes / (ta * 1e-3) / 1e9);
                        }
                        printf("\n");
                        fflush(stdout);
                    }
                    kvs_cuda_set_attn_splits(b, 0);
                    kvs_cuda_set_dec_attn(b, -1);
                }
                free_shape(B, &S);
            }
    }
    kvs_cuda_set_skinny_variant(b, -1);
    kvs_cuda_set_skinny_max(b, -1);
    /* prefill: one sequence, the whole prompt in one step, logits for its last row */
    if (npre > 0) {
        printf("\n%8s %9s %10s %9s %12s %14s\n", "prompt", "ms", "tokens/s", "TFLOP/s", "attention ms",
               "attn TFLOP/s");
        if (mf) {
            fprintf(mf, "\nPrefill (one sequence, the whole prompt in one step; FLOPs = 2 x parameters x tokens + "
                        "causal attention 4 x layers x heads x head_dim x tokens^2 / 2; attention TFLOP/s counts the "
                        "causal attention FLOPs over the attention alone):\n\n");
            fprintf(mf, "| prompt tokens | ms | tokens/s | TFLOP/s | attention ms | attention TFLOP/s |\n"
                        "| ---: | ---: | ---: | ---: | ---: | ---: |\n");
        }
    }
    for (int pi = 0; pi < npre; pi++) {
        int P = prefills[pi], bps = (P + BS - 1) / BS;
        if ((size_t)bps > (size_t)n_blocks) {
            printf("%8d   skipped: does not fit the pool\n", P);
            continue;
        }
        struct shape S;
        struct kvs_attn_meta m;
        make_shape(B, n_blocks, 1, bps, P, 0, &S, &m);
        int pit = iters < 5 ? iters : 5;
        for (int it = 0; it <= pit; it++) {
            kvs_cuda_timer_start(b);
            enqueue_step(B, P, &m, OPS_ALL, 1);
            float ms = kvs_cuda_timer_stop_ms(b);
            if (it) t[it - 1] = ms; /* the first is a warm-up */
        }
        qsort(t, (size_t)pit, sizeof(float), cmp_float);
        float ms = t[pit / 2];
        check_logits(B, 1, "prefill");
        kvs_cuda_timer_start(b);
        enqueue_step(B, P, &m, OPS_ATTN, 1);
        float ta = kvs_cuda_timer_stop_ms(b);
        const double aflops = 4.0 * n_layers * NH * HD * (double)P * P / 2.0;
        double flops = 2.0 * params * P + aflops;
        printf("%8d %9.2f %10.0f %9.1f %12.2f %14.1f\n", P, ms, P / (ms * 1e-3), flops / (ms * 1e-3) / 1e12, ta,
               aflops / (ta * 1e-3) / 1e12);
        if (mf) fprintf(mf, "| %d | %.2f | %.0f | %.1f | %.2f | %.1f |\n", P, ms, P / (ms * 1e-3),
                        flops / (ms * 1e-3) / 1e12, ta, aflops / (ta * 1e-3) / 1e12);
        if (pre_variants) {
            /* the attention alone with each prefill kernel forced: median of 3 after a warm-up */
            static const char *const names[] = {"", "1 mma.sync (k_attn_tc)", "2 wgmma, 128-key tiles",
                                                "3 wgmma, 64-key tiles", "4 wgmma, 128-key, overlapped",
                                                "5 wgmma, 64-key, overlapped", "6 wgmma, 64-key, 2 blocks/SM",
                                                "7 fa3, TMA, 2 stages", "8 fa3, cp.async only",
                                                "9 fa3, TMA, serial consumer", "10 fa3, cp.async, serial",
                                                "11 fa3, TMA, ping-pong", "12 fa3, TMA, pp, persistent",
                                                "13 fa3, TMA, K/V producers", "14 fa3, K/V producers, 3 st",
                                                "15 fa3, K/V producers, pp", "16 fa3, 192 rows, 64-key",
                                                "17 fa3, kind 14, FA3 order", "18 fa3, kind 16, FA3 order",
                                                "19 fa3, kind 14, persistent", "20 fa3, kind 14, rescale skip",
                                                "21 fa3, kind 19, rescale skip", "22 fa3, 14 + Q reads, softmax",
                                                "23 fa3, kind 22, ping-pong", "24 fa3, kind 14 + Q reads",
                                                "25 fa3, kind 22, persistent, snake", "26 cuDNN fused SDPA"};
            const int n_names = (int)(sizeof names / sizeof names[0]);
            const int nk = n_pre_kinds > 0 ? n_pre_kinds : n_names - 1;
            for (int ki = 0; ki < nk; ki++) {
                const int kind = n_pre_kinds > 0 ? pre_kinds[ki] : ki + 1;
                if (kind < 1 || kind >= n_names) continue;
                kvs_cuda_set_pre_attn(kind);
                float tv[16];
                const long long cdn0 = kvs_cuda_cudnn_prefill_launches();
                for (int it = 0; it <= pre_reps; it++) { /* a warm-up, then pre_reps timed */
                    kvs_cuda_timer_start(b);
                    enqueue_step(B, P, &m, OPS_ATTN, 1);
                    tv[it] = kvs_cuda_timer_stop_ms(b);
                }
                qsort(tv + 1, (size_t)pre_reps, sizeof(float), cmp_float);
                const float med = tv[1 + pre_reps / 2];
                printf("%8d   prefill attention, kind %-28s (took %d): %8.2f ms %8.1f TFLOP/s\n", P, names[kind],
                       kvs_cuda_pre_attn_kind(HD, 0), med, aflops / (med * 1e-3) / 1e12);
                if (kind == 26) /* a launch cuDNN gives back runs kind 14 (one log line): say how many it took */
                    printf("%8d   (cuDNN took %lld of %d launches)\n", P, kvs_cuda_cudnn_prefill_launches() - cdn0,
                           (pre_reps + 1) * n_layers);
                if (mf) fprintf(mf, "| %d | attention only, kind %s (took %d) | | | %.2f | %.1f |\n", P, names[kind],
                                kvs_cuda_pre_attn_kind(HD, 0), med, aflops / (med * 1e-3) / 1e12);
            }
            kvs_cuda_set_pre_attn(-1);
        }
        free_shape(B, &S);
    }
    free(t);
    if (mf) {
        fprintf(mf, "\nDevice: %s. Copy bandwidth %.0f GB/s (read+write). Floor = (weights + KV read) / copy "
                    "bandwidth; achieved = floor / measured. Each decode step is a CUDA graph replay (median of %d)%s.\n",
                desc, bw / 1e9, iters,
                breakdown ? "; the breakdown times graphs of the GEMMs alone (weight bytes / time), the attention "
                            "alone (KV bytes / time) and every other op alone" : "");
        fclose(mf);
    }
    O->free(b);
    free(L);
    return 0;
}

#else
int main(void)
{
    fprintf(stderr, "kvserve-gpubench: built without CUDA (nvcc was not found at build time)\n");
    return 1;
}
#endif
