/* kvserve_stepbench_main.c: whole decode steps (every layer, the LM head) of the Llama-3.1-8B
 * shape with random bf16 weights under the decode policies full, quest and retro (w = 2, 4, 8),
 * on the CUDA backend, -> build/kvserve-stepbench. The per-layer benchmarks (kvserve-questbench,
 * kvserve-retrobench) time the attention phase alone; this one times what a step costs the
 * daemon, where Retro's re-run rows also pay every GEMM of every layer.
 *
 * A step is the runner's layer loop written with the backend's ops, as kvserve-gpubench does it
 * (embed; per layer rmsnorm, the fused q/k/v GEMM + RoPE + cache write, the policy's attend and
 * finish, o_proj, add+rmsnorm, gate/up GEMM with SwiGLU and down_proj, add+rmsnorm; final norm,
 * the LM head over each request's newest row), with the policy's plan before the layers, run
 * eagerly as the runner runs policies that declare KVS_KV_NO_GRAPHS (quest, retro). B requests
 * decode from context n on, one position a step; every step asks the policy how many past rows
 * each request re-runs (kv.h recompute: Retro's window) and runs k + 1 rows per request at its
 * last positions, rewriting their K/V. Timed: host wall clock from plan to a device sync after
 * the LM head, mean of --steps steps after the warm-up (max(3, w + 1) steps, so Retro's windows
 * are full). Full attention and Quest are timed eagerly (the same method) and also as a recorded
 * graph of the step replayed after each step's plan (how the runner runs one-token steps: the
 * attention meta carries the context capacity, plan_ctx = the context rounded up to 1024; the
 * eager runs leave it 0, as a policy that declares KVS_KV_NO_GRAPHS sees it). Retro's steps
 * have k + 1 rows per request, which the runner never records.
 *
 * Data: random K/V (uniform [-1, 1)) for the whole context, made on the device; the decode
 * policies' page digests of it made before the steps (kvs_quest_refresh_digests,
 * kvs_retro_refresh_digests). Memory: one K/V pool serves every layer (32 layers of 32 x 32K
 * would need 137 GB): each layer reads and writes the same bytes a real layer would, and a
 * layer's K/V (at least 33 MB here) do not survive in L2 across the 436 MB of weights streamed
 * between layers. The digests (6.25% of a layer's K/V) are the policies' own, one set per
 * selecting layer. Quest / Retro at kv.quest defaults: budget max(256, 0.15 n), layers 0-1 dense.
 * Effective budget: Retro's counter (union of keys seen per query / keys of its own step, sparse
 * layers; random weights: near-random picks, an upper-end figure).
 *
 * --digest-bits 8,4 adds, per value, Quest with kv.quest.digest_bits = that value (graphed and
 * eager); the other Quest / Retro columns use 16, or --base-bits (8: the policies' default).
 * --windows 0: no Retro columns.
 * --step-ab adds, per window, Retro on main's path before retro13 (KVS_RETRO_GATHER=1: the newest
 * rows' q gathered in a launch of its own before the scores; KVS_CUDA_RETRO_SPLITS=up: the fused
 * attend's splits rounded up) and with the gather alone (KVS_RETRO_GATHER=1) in the same process,
 * after the default.
 *
 * Usage: kvserve-stepbench [--batches 1,8,32] [--contexts 8192,32768,131072] [--windows 2,4,8]
 *                          [--layers 32] [--ratio 0.15] [--steps 6] [--digest-bits 8,4] [--base-bits 16]
 *                          [--markdown FILE]
 * A shape whose K/V, digests and weights do not fit in device memory is skipped with a note.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/util.h"
#include "bench/bench_util.h"
#include "engine/config.h"
#include "engine/kv/kv.h"
#include "engine/kv/kv_decode_quest.h"
#include "engine/kv/kv_decode_retro.h"
#include "kernels/backend.h"

#if defined(KVS_HAVE_CUDA) && KVS_HAVE_CUDA
#include "kernels/cuda/cuda_backend.h"
#include "bench/bench_cuda.h"

#define BS 16 /* KV block size (tokens) */

#define MAXW 8

static const struct kvs_backend_ops *O = &kvs_cuda_backend;

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

struct layer {
    struct kvs_dweight *wq, *wk, *wv, *wo, *wg, *wu, *wd, *n1, *n2;
};

/* the model, the step's buffers and the shape's K/V */
struct model {
    struct kvs_backend *b;
    int n_layers;
    struct layer *L;
    struct kvs_dweight *emb, *head, *fnorm;
    struct kvs_dbuf *x, *h, *q, *k, *v, *att, *lse, *o, *g, *u, *last, *logits;
    struct kvs_dbuf *tok, *pos, *slots, *invf, *newest, *qs, *sp, *bt, *kc, *vc;
};

/* One step of policy dp (state st) over the step; the LM head over the newest rows (B of them,
 * their row indices already in M->newest). */
static void run_step(struct model *M, const struct kvs_kv_decode_ops *dp, void *st, const struct kvs_kv_step *step,
                     int nb)
{
    struct kvs_backend *b = M->b;
    const int n = step->n_rows;
    const float scale = 1.0f / sqrtf((float)HD);
    O->embed(b, M->emb, M->tok, n, DIM, M->x);
    O->rmsnorm(b, M->x, M->L[0].n1, 1e-5f, n, DIM, M->h);
    for (int l = 0; l < M->n_layers; l++) {
        struct layer *L = &M->L[l];
        const struct kvs_dweight *w[3] = {L->wq, L->wk, L->wv};
        O->matmul_rope_kv_write(b, M->h, w, NULL, n, DIM, M->q, M->k, M->v, M->pos, M->invf, M->slots, NH, NKV, HD, BS,
                                M->kc, M->vc);
        const struct kvs_kv_attend a = {step, M->q, NULL, {M->kc, M->vc, NULL, NULL, l}, NH, NKV, HD, BS, scale,
                                        M->att, M->lse};
        dp->attend(st, l, &a);
        if (dp->finish) dp->finish(st, l, step);
        O->matmul(b, M->att, L->wo, NULL, n, DIM, DIM, M->o);
        O->add_rmsnorm(b, M->x, M->o, L->n2, 1e-5f, n, DIM, M->h);
        O->matmul_swiglu_down(b, M->h, L->wg, L->wu, L->wd, n, DIM, FF, M->g, M->u, M->o);
        O->add_rmsnorm(b, M->x, M->o, l + 1 < M->n_layers ? M->L[l + 1].n1 : M->fnorm, 1e-5f, n, DIM, M->h);
    }
    O->gather_rows(b, M->h, M->newest, nb, DIM, M->last);
    O->matmul(b, M->last, M->head, NULL, nb, DIM, VOCAB, M->logits);
}

struct result {
    double ms, graph_ms, eff;
};

/* ms per step of `decode` with window w over nb requests at context ctx (mb blocks each) */
static int base_bits = 16;     /* --base-bits: kv.quest.digest_bits of the main Quest / Retro columns */
static int digest_bits = 16;   /* kv.quest.digest_bits of the next run_policy */

static struct result run_policy(struct model *M, const char *decode, int w, double ratio, int nb, int ctx, int mb,
                                int steps)
{
    struct kvs_backend *b = M->b;
    const struct kvs_kv_decode_ops *dp = kvs_kv_find_decode(decode);
    if (!dp) kvs_panic(__FILE__, __LINE__, "no decode policy %s", decode);
    struct kvs_config cfg;
    kvs_config_init(&cfg);
    cfg.quest_budget_ratio = ratio;
    cfg.retro_window = w;
    cfg.quest_digest_bits = digest_bits;
    const int n_blocks = nb * mb;
    const struct kvs_kv_decode_env env = {O, b, &cfg, M->n_layers, NH, NKV, HD, BS, nb, nb * MAXW, mb,
                                          (size_t)M->n_layers * 2 * NKV * HD * 2, n_blocks, NULL};
    void *st;
    char err[256];
    if (dp->create(&env, &st, err, sizeof err)) kvs_panic(__FILE__, __LINE__, "%s: %s", decode, err);
    const size_t sb = dp->seq_bytes ? dp->seq_bytes(st) : 0;
    unsigned char *arena = sb ? kvs_xcalloc((size_t)nb, sb) : NULL;
    for (int s = 0; s < nb && dp->seq_init; s++)
        if (dp->seq_init(st, s, arena + (size_t)s * sb)) kvs_panic(__FILE__, __LINE__, "%s: seq_init", decode);
    const int warm = w + 1 > 3 ? w + 1 : 3;
    int32_t *qs = kvs_xmalloc(((size_t)nb + 1) * sizeof *qs), *sp = kvs_xmalloc((size_t)nb * sizeof *sp);
    int32_t *slot = kvs_xmalloc((size_t)nb * sizeof *slot), *dec = kvs_xmalloc((size_t)nb * sizeof *dec);
    const size_t rows = (size_t)nb * MAXW;
    int32_t *rpos = kvs_xmalloc(rows * sizeof *rpos), *rslot = kvs_xmalloc(rows * sizeof *rslot);
    int32_t *rtok = kvs_xmalloc(rows * sizeof *rtok), *newest = kvs_xmalloc((size_t)nb * sizeof *newest);
    int32_t *h_bt = kvs_xmalloc((size_t)n_blocks * sizeof *h_bt);
    O->download(b, h_bt, M->bt, 0, (size_t)n_blocks);
    if (strcmp(decode, "full")) {
        /* the digests of the whole context, as its writing would have left them (untimed) */
        for (int s = 0; s <= nb; s++) qs[s] = s * ctx;
        memset(sp, 0, (size_t)nb * sizeof *sp);
        O->upload(b, M->qs, 0, qs, (size_t)nb + 1);
        O->upload(b, M->sp, 0, sp, (size_t)nb);
        const struct kvs_attn_meta pm = {.n_seqs = nb, .max_blocks = mb, .q_start = M->qs, .pos = M->sp,
                                         .block_tables = M->bt, .h_q_start = qs, .h_pos = sp, .max_ctx = ctx};
        if (!strcmp(decode, "quest")) kvs_quest_refresh_digests(st, M->kc, &pm);
        else kvs_retro_refresh_digests(st, M->kc, &pm);
        O->sync(b);
    }
    double total = 0, graph = 0;
    const int graphed = !strcmp(decode, "full") || !strcmp(decode, "quest");
    for (int it = 0; it < warm + steps + graphed; it++) {
        const int pnew = ctx - 1 - (warm + steps) + (it < warm + steps ? it : warm + steps - 1);
        qs[0] = 0;
        for (int s = 0; s < nb; s++) {
            const int k = dp->recompute ? dp->recompute(st, s) : 0;
            sp[s] = pnew - k;
            qs[s + 1] = qs[s] + k + 1;
            slot[s] = s, dec[s] = 1;
            for (int j = 0; j <= k; j++) {
                const int r = qs[s] + j, p = pnew - k + j;
                rpos[r] = p;
                rslot[r] = h_bt[(size_t)s * mb + p / BS] * BS + p % BS;
                rtok[r] = (int32_t)(((uint32_t)p * 2654435761u + (uint32_t)s * 40503u) % VOCAB);
            }
            newest[s] = qs[s + 1] - 1;
        }
        const int n = qs[nb];
        O->upload(b, M->qs, 0, qs, (size_t)nb + 1);
        O->upload(b, M->sp, 0, sp, (size_t)nb);
        O->upload(b, M->pos, 0, rpos, (size_t)n);
        O->upload(b, M->slots, 0, rslot, (size_t)n);
        O->upload(b, M->tok, 0, rtok, (size_t)n);
        O->upload(b, M->newest, 0, newest, (size_t)nb);
        const int cap = (pnew + 1 + 1023) / 1024 * 1024;
        const struct kvs_attn_meta m = {.n_seqs = nb, .max_blocks = mb, .q_start = M->qs, .pos = M->sp,
                                        .block_tables = M->bt, .inv_freq = M->invf, .h_q_start = qs, .h_pos = sp,
                                        .max_ctx = pnew + 1, .plan_ctx = it == warm + steps ? cap : 0};
        const struct kvs_kv_step step = {nb, n, qs, sp, slot, dec, &m, NULL, 0};
        O->sync(b);
        if (it == warm + steps) {
            /* the same step recorded once and replayed after its plan (the runner's graphs) */
            if (dp->plan && dp->plan(st, &step)) kvs_panic(__FILE__, __LINE__, "%s: plan", decode);
            O->graph_begin(b);
            run_step(M, dp, st, &step, nb);
            struct kvs_graph *gr = O->graph_end(b, err, sizeof err);
            if (!gr) kvs_panic(__FILE__, __LINE__, "graph: %s", err);
            O->graph_launch(b, gr);
            O->sync(b);
            const double t0 = now_ms();
            for (int r = 0; r < steps; r++) {
                if (dp->plan && dp->plan(st, &step)) kvs_panic(__FILE__, __LINE__, "%s: plan", decode);
                O->graph_launch(b, gr);
            }
            O->sync(b);
            graph = (now_ms() - t0) / steps;
            O->graph_free(b, gr);
            break;
        }
        const double t0 = now_ms();
        if (dp->plan && dp->plan(st, &step)) kvs_panic(__FILE__, __LINE__, "%s: plan", decode);
        run_step(M, dp, st, &step, nb);
        O->sync(b);
        if (it >= warm) total += now_ms() - t0;
    }
    struct result res = {total / steps, graph, 1.0};
    struct kvs_kv_counter c[32];
    const int nc = dp->counters ? dp->counters(st, c, 32) : 0;
    for (int i = 0; i < nc; i++)
        if (!strcmp(c[i].name, "kvserve:kv_retro_effective_budget")) res.eff = c[i].value;
    for (int s = 0; s < nb && dp->seq_free; s++) dp->seq_free(st, s);
    dp->destroy(st);
    free(arena), free(qs), free(sp), free(slot), free(dec), free(rpos), free(rslot), free(rtok), free(newest), free(h_bt);
    kvs_config_free(&cfg);
    return res;
}

int main(int argc, char **argv)
{
    int batches[8] = {1, 8, 32}, n_b = 3, contexts[8] = {8192, 32768, 131072}, n_c = 3, windows[8] = {2, 4, 8}, n_w = 3;
    int dbits[4] = {0}, n_d = 0;
    int steps = 6, n_layers = 32, step_ab = 0;
    double ratio = 0.15;
    const char *md = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--batches") && i + 1 < argc) n_b = bench_parse_list(argv[++i], batches, 8);
        else if (!strcmp(argv[i], "--contexts") && i + 1 < argc) n_c = bench_parse_list(argv[++i], contexts, 8);
        else if (!strcmp(argv[i], "--windows") && i + 1 < argc)
            n_w = !strcmp(argv[i + 1], "0") ? (i++, 0) : bench_parse_list(argv[++i], windows, 8);
        else if (!strcmp(argv[i], "--layers") && i + 1 < argc) n_layers = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--ratio") && i + 1 < argc) ratio = atof(argv[++i]);
        else if (!strcmp(argv[i], "--steps") && i + 1 < argc) steps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--markdown") && i + 1 < argc) md = argv[++i];
        else if (!strcmp(argv[i], "--step-ab")) step_ab = 1;
        else if (!strcmp(argv[i], "--digest-bits") && i + 1 < argc) n_d = bench_parse_list(argv[++i], dbits, 4);
        else if (!strcmp(argv[i], "--base-bits") && i + 1 < argc) base_bits = digest_bits = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: %s [--batches 1,8,32] [--contexts 8192,32768,131072] [--windows 2,4,8] "
                    "[--layers 32] [--ratio 0.15] [--steps 6] [--digest-bits 8,4] [--base-bits 16] [--step-ab] [--markdown FILE]\n", argv[0]);
            return 2;
        }
    }
    for (int i = 0; i < n_d; i++)
        if (dbits[i] != 16 && dbits[i] != 8 && dbits[i] != 4) {
            fprintf(stderr, "digest bits are 16, 8 or 4\n");
            return 2;
        }
    for (int i = 0; i < n_w; i++)
        if (windows[i] < 1 || windows[i] > MAXW) {
            fprintf(stderr, "windows are 1..%d\n", MAXW);
            return 2;
        }
    if (base_bits != 16 && base_bits != 8 && base_bits != 4) {
        fprintf(stderr, "--base-bits: 16, 8 or 4\n");
        return 2;
    }
    if (steps < 1 || n_b <= 0 || n_c <= 0 || n_w < 0 || n_d < 0 || n_layers < 3 || n_layers > 256 || !(ratio > 0)) {
        fprintf(stderr, "bad arguments\n");
        return 2;
    }
    kvs_log_set_level(KVS_LOG_WARN);
    char desc[256];
    struct model Mm = {0}, *M = &Mm;
    struct kvs_backend *b = M->b = bench_cuda_open();
    if (!b) return 1;
    kvs_cuda_device_desc(b, desc, sizeof desc);
    printf("device: %s\n", desc);
    M->n_layers = n_layers;
    uint64_t seed = 1;
    M->emb = kvs_cuda_random_weight(b, VOCAB, DIM, 0, 0.02f, seed++);
    M->head = kvs_cuda_random_weight(b, VOCAB, DIM, 0, 0.02f, seed++);
    M->fnorm = kvs_cuda_random_weight(b, 1, DIM, 1, 1.0f, seed++);
    if (!M->emb || !M->head || !M->fnorm) kvs_panic(__FILE__, __LINE__, "out of device memory for the weights");
    M->L = kvs_xcalloc((size_t)n_layers, sizeof *M->L);
    for (int l = 0; l < n_layers; l++) {
        struct layer *L = &M->L[l];
        bench_random_layer(b, &seed, &L->wq, &L->wk, &L->wv, &L->wo, &L->wg, &L->wu, &L->wd, &L->n1, &L->n2);
        struct kvs_dweight *qkv[3] = {L->wq, L->wk, L->wv}, *gu[2] = {L->wg, L->wu};
        if (O->fuse_weights(b, qkv, 3) || O->fuse_weights(b, gu, 2))
            kvs_panic(__FILE__, __LINE__, "fuse_weights failed (out of device memory?)");
    }
    const struct kvs_dweight *shapes[] = {M->L[0].wo, M->L[0].wd, M->head};
    for (size_t i = 0; i < 3; i++) kvs_cuda_pretune(b, shapes[i]);
    int max_b = 0;
    for (int i = 0; i < n_b; i++) max_b = batches[i] > max_b ? batches[i] : max_b;
    const size_t R = (size_t)max_b * MAXW;
    M->x = bench_dalloc(b, KVS_BUF_ACT, R * DIM), M->h = bench_dalloc(b, KVS_BUF_ACT, R * DIM);
    M->q = bench_dalloc(b, KVS_BUF_ACT, R * DIM), M->k = bench_dalloc(b, KVS_BUF_ACT, R * NKV * HD);
    M->v = bench_dalloc(b, KVS_BUF_ACT, R * NKV * HD), M->att = bench_dalloc(b, KVS_BUF_ACT, R * DIM);
    M->lse = bench_dalloc(b, KVS_BUF_F32, R * NH), M->o = bench_dalloc(b, KVS_BUF_ACT, R * DIM);
    M->g = bench_dalloc(b, KVS_BUF_ACT, R * FF), M->u = bench_dalloc(b, KVS_BUF_ACT, R * FF);
    M->last = bench_dalloc(b, KVS_BUF_ACT, (size_t)max_b * DIM), M->logits = bench_dalloc(b, KVS_BUF_ACT, (size_t)max_b * VOCAB);
    M->tok = bench_dalloc(b, KVS_BUF_I32, R), M->pos = bench_dalloc(b, KVS_BUF_I32, R), M->slots = bench_dalloc(b, KVS_BUF_I32, R);
    M->newest = bench_dalloc(b, KVS_BUF_I32, (size_t)max_b), M->invf = bench_dalloc(b, KVS_BUF_F32, HD / 2);
    M->qs = bench_dalloc(b, KVS_BUF_I32, (size_t)max_b + 1), M->sp = bench_dalloc(b, KVS_BUF_I32, (size_t)max_b);
    float invf[HD / 2];
    for (int i = 0; i < HD / 2; i++) invf[i] = (float)pow(500000.0, -2.0 * i / HD);
    O->upload(b, M->invf, 0, invf, HD / 2);

    FILE *mf = md ? fopen(md, "w") : NULL;
    printf("decode step, %d layers (0-1 dense), ms (host wall clock: plan + layers + LM head + sync); budget "
           "max(256, %.2f n); Quest / Retro columns at %d-bit digests\n", n_layers, ratio, base_bits);
    char head[2048];
    int hl = snprintf(head, sizeof head, "| batch | context | full graph ms | full ms | Quest graph ms | Quest ms | "
                      "full / Quest, graphs | full / Quest, eager |");
    for (int i = 0; i < n_d; i++)
        hl += snprintf(head + hl, sizeof head - hl, " Quest %d-bit graph ms | Quest %d-bit ms | full / Quest %d-bit, "
                       "graphs |", dbits[i], dbits[i], dbits[i]);
    for (int i = 0; i < n_w; i++) {
        hl += snprintf(head + hl, sizeof head - hl, " w=%d ms | w=%d / Quest eager | w=%d eff. budget |", windows[i],
                       windows[i], windows[i]);
        if (step_ab)
            hl += snprintf(head + hl, sizeof head - hl, " w=%d main ms | w=%d main / Quest eager | w=%d GATHER=1 "
                           "ms | w=%d GATHER=1 / Quest eager |", windows[i], windows[i], windows[i], windows[i]);
    }
    printf("%s\n", head);
    if (mf) {
        fprintf(mf, "%s\n|---|---|---|---|---|---|---|---|", head);
        for (int i = 0; i < n_w + n_d; i++) fprintf(mf, "---|---|---|");
        for (int i = 0; i < (step_ab ? n_w : 0); i++) fprintf(mf, "---|---|---|---|");
        fprintf(mf, "\n");
    }
    uint64_t rng = 0x9e3779b97f4a7c15ull;
    for (int bi = 0; bi < n_b; bi++)
        for (int ci = 0; ci < n_c; ci++) {
            const int nb = batches[bi], ctx = contexts[ci], mb = (ctx + BS - 1) / BS, n_blocks = nb * mb;
            const size_t kv = (size_t)n_blocks * NKV * BS * HD;
            /* K and V, the digests of n_layers - 2 layers, Retro's masks, 1 GiB spare */
            const double need = (double)kv * 2 * 2 + (double)kv / BS * 2 * 2 * (n_layers - 2) +
                                (double)nb * (n_layers - 2) * NKV * (mb + 1) * 4 * 2 + (double)(1u << 30);
            if (need > (double)O->mem_available(b)) {
                printf("| %d | %d | (skipped: %.1f GB of K/V and digests do not fit) |\n", nb, ctx, need / 1e9);
                if (mf) fprintf(mf, "| %d | %d | (skipped: %.1f GB of K/V and digests do not fit) |\n", nb, ctx, need / 1e9);
                continue;
            }
            M->kc = bench_dalloc(b, KVS_BUF_KV, kv);
            M->vc = bench_dalloc(b, KVS_BUF_KV, kv);
            kvs_cuda_fill_random(b, M->kc, 0, kv, 1.0f, 11);
            kvs_cuda_fill_random(b, M->vc, 0, kv, 1.0f, 12);
            M->bt = bench_dalloc(b, KVS_BUF_I32, (size_t)n_blocks);
            int32_t *bt = kvs_xmalloc((size_t)n_blocks * sizeof *bt);
            for (int i = 0; i < n_blocks; i++) bt[i] = i;
            for (int i = n_blocks - 1; i > 0; i--) {   /* blocks dealt at random, as a long-running pool does */
                const int j = (int)(bench_rnd(&rng) % (uint32_t)(i + 1)), t = bt[i];
                bt[i] = bt[j], bt[j] = t;
            }
            O->upload(b, M->bt, 0, bt, (size_t)n_blocks);
            free(bt);
            const struct result full = run_policy(M, "full", 1, ratio, nb, ctx, mb, steps);
            const struct result quest = run_policy(M, "quest", 1, ratio, nb, ctx, mb, steps);
            char line[2048];
            int ll = snprintf(line, sizeof line, "| %d | %d | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f |", nb, ctx,
                              full.graph_ms, full.ms, quest.graph_ms, quest.ms, full.graph_ms / quest.graph_ms,
                              full.ms / quest.ms);
            for (int i = 0; i < n_d; i++) {
                digest_bits = dbits[i];
                const struct result r = run_policy(M, "quest", 1, ratio, nb, ctx, mb, steps);
                digest_bits = base_bits;
                ll += snprintf(line + ll, sizeof line - ll, " %.2f | %.2f | %.2f |", r.graph_ms, r.ms,
                               full.graph_ms / r.graph_ms);
            }
            for (int i = 0; i < n_w; i++) {
                const struct result r = run_policy(M, "retro", windows[i], ratio, nb, ctx, mb, steps);
                ll += snprintf(line + ll, sizeof line - ll, " %.2f | %.3f | %.3f |", r.ms, r.ms / quest.ms, r.eff);
                if (step_ab) {   /* the policy reads KVS_RETRO_GATHER at create, the kernels the other at every step */
                    setenv("KVS_RETRO_GATHER", "1", 1);
                    setenv("KVS_CUDA_RETRO_SPLITS", "up", 1);
                    const struct result r0 = run_policy(M, "retro", windows[i], ratio, nb, ctx, mb, steps);
                    unsetenv("KVS_CUDA_RETRO_SPLITS");
                    const struct result r1 = run_policy(M, "retro", windows[i], ratio, nb, ctx, mb, steps);
                    unsetenv("KVS_RETRO_GATHER");
                    ll += snprintf(line + ll, sizeof line - ll, " %.2f | %.3f | %.2f | %.3f |", r0.ms, r0.ms / quest.ms,
                                   r1.ms, r1.ms / quest.ms);
                }
            }
            printf("%s\n", line);
            fflush(stdout);
            if (mf) fprintf(mf, "%s\n", line);
            O->free_buf(b, M->kc), O->free_buf(b, M->vc), O->free_buf(b, M->bt);
        }
    if (mf) fclose(mf);
    O->free(b);
    return 0;
}
#else
int main(void)
{
    fprintf(stderr, "kvserve-stepbench: built without CUDA (nvcc not found)\n");
    return 1;
}
#endif
