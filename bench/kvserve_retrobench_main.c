/* kvserve_retrobench_main.c: the per-layer attention cost of kv.decode=retro (RetroAttention,
 * engine/kv/kv_decode_retro.c) at windows w = 2, 4, 8 against Quest (w = 1, the same policy's
 * Quest path) and full attention() on the same data, on the CUDA backend, ->
 * build/kvserve-retrobench.
 *
 * One selecting layer of the Llama-3.1-8B attention shape (32 query heads, 8 KV heads, head_dim
 * 128, bf16 K/V in a paged pool of 16-slot blocks dealt at random, random keys and queries), B
 * requests decoding from context n on: every step asks the policy how many past rows each
 * request re-runs (kv.h recompute), builds the step (k + 1 rows per request at the context's
 * last positions) with fresh random queries (untimed), and runs the policy's plan, the layer's
 * attend and finish, as the runner does; the K/V are not rewritten (random data); the page
 * digests of the whole context are made once before the steps (kvs_retro_refresh_digests). Timed: the host wall clock of plan + attend +
 * finish + a device sync, mean over --steps steps after --warm steps (so windows are full);
 * this includes the policy's host work (plan's uploads; the device path has no sync inside
 * attend). Not included: the GEMMs of the re-run rows (o_proj, MLP, the next layer's q/k/v),
 * which a w-row step also pays. Plan (once a step) and attend + finish (once a layer) are timed
 * apart; the last columns give w=2's plan and attend, its attend over Quest's, and the ratio for a
 * 32-layer model with layers 0-1 dense (1 plan + 30 selecting layers). Printed per shape: full ms (attention() of the newest rows),
 * Quest ms, Retro ms for each w, Retro / Quest, and the effective budget (union of keys seen per
 * query / keys of its own step; random queries pick near-random pages, so this is an upper-end
 * figure, not the paper's trained-model measurement).
 *
 * --spans adds a column: w=2 with the fused kernel off (KVS_RETRO_FUSED=0: the device path's
 * attention_spans over the selection and the supplements, each page read once per row).
 *
 * Usage: kvserve-retrobench [--batches 1,8,32] [--contexts 8192,32768] [--windows 2,4,8]
 *                           [--ratio 0.15] [--steps 20] [--warm 10] [--spans] [--markdown FILE]
 * A shape whose KV does not fit in free device memory is skipped with a note.
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
#include "engine/kv/kv_decode_retro.h"
#include "kernels/backend.h"

#if defined(KVS_HAVE_CUDA) && KVS_HAVE_CUDA
#include "kernels/cuda/cuda_backend.h"

#define NH 32
#define NKV 8
#define HD 128
#define BS 16
#define MAXW 8

static const struct kvs_backend_ops *O = &kvs_cuda_backend;
static uint64_t rng = 0x9e3779b97f4a7c15ull;

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static struct kvs_dbuf *alloc_or_die(struct kvs_backend *b, enum kvs_buf_kind kind, size_t n)
{
    struct kvs_dbuf *d = O->alloc(b, kind, n);
    if (!d) kvs_panic(__FILE__, __LINE__, "out of device memory (%zu elements)", n);
    return d;
}

static void fill_random(struct kvs_backend *b, struct kvs_dbuf *d, size_t n, float amp)
{
    const size_t chunk = (size_t)1 << 22;
    float *h = kvs_xmalloc(chunk * sizeof *h);
    for (size_t off = 0; off < n; off += chunk) {
        const size_t m = n - off < chunk ? n - off : chunk;
        for (size_t i = 0; i < m; i++) h[i] = amp * (float)((double)bench_rnd(&rng) / 4294967296.0 * 2 - 1);
        O->upload(b, d, off, h, m);
    }
    free(h);
}

struct world {
    int B, ctx, mb, n_blocks;
    struct kvs_dbuf *kc, *vc, *q, *out, *lse, *qs, *pos, *bt;
    int32_t *h_bt;
};

/* ms per step of policy `decode` with window w (1 for quest / full); *eff its effective budget */
static double run_policy(struct kvs_backend *b, struct world *W, const char *decode, int w, double ratio, int warm,
                         int steps, double *eff, double *plan_ms)
{
    const struct kvs_kv_decode_ops *dp = kvs_kv_find_decode(decode);
    if (!dp) kvs_panic(__FILE__, __LINE__, "no decode policy %s", decode);
    struct kvs_config cfg;
    kvs_config_init(&cfg);
    cfg.quest_budget_ratio = ratio;
    cfg.quest_min_budget = 256;
    cfg.quest_dense_layers = 0;
    cfg.retro_window = w;
    const int max_rows = W->B * MAXW;
    const struct kvs_kv_decode_env env = {O, b, &cfg, 1, NH, NKV, HD, BS, W->B, max_rows, W->mb,
                                          (size_t)2 * NKV * HD * 2, W->n_blocks, NULL};
    void *st;
    char err[256];
    if (dp->create(&env, &st, err, sizeof err)) kvs_panic(__FILE__, __LINE__, "%s: %s", decode, err);
    const size_t sb = dp->seq_bytes ? dp->seq_bytes(st) : 0;
    unsigned char *arena = sb ? kvs_xcalloc((size_t)W->B, sb) : NULL;
    for (int s = 0; s < W->B && dp->seq_init; s++) dp->seq_init(st, s, arena + (size_t)s * sb);
    if (!strcmp(decode, "retro")) {
        /* the page digests of the whole context, as its writing would have left them (untimed;
         * without them every score ties and the selection never changes: no supplements) */
        int32_t *hq = kvs_xmalloc(((size_t)W->B + 1) * sizeof *hq), *hp = kvs_xcalloc((size_t)W->B, sizeof *hp);
        for (int s = 0; s <= W->B; s++) hq[s] = s * W->ctx;
        O->upload(b, W->qs, 0, hq, (size_t)W->B + 1);
        O->upload(b, W->pos, 0, hp, (size_t)W->B);
        const struct kvs_attn_meta pm = {.n_seqs = W->B, .max_blocks = W->mb, .q_start = W->qs, .pos = W->pos,
                                         .block_tables = W->bt, .h_q_start = hq, .h_pos = hp, .max_ctx = W->ctx};
        kvs_retro_refresh_digests(st, W->kc, &pm);
        O->sync(b);
        free(hq), free(hp);
    }
    int32_t *qs = kvs_xmalloc(((size_t)W->B + 1) * sizeof *qs), *pos = kvs_xmalloc((size_t)W->B * sizeof *pos);
    int32_t *slot = kvs_xmalloc((size_t)W->B * sizeof *slot), *dec = kvs_xmalloc((size_t)W->B * sizeof *dec);
    double total = 0, plan = 0;
    for (int it = 0; it < warm + steps; it++) {
        const int newest = W->ctx - 1 - (warm + steps) + it;   /* contexts grow by one a step */
        qs[0] = 0;
        int max_ctx = 0;
        for (int s = 0; s < W->B; s++) {
            const int k = dp->recompute ? dp->recompute(st, s) : 0;
            pos[s] = newest - k;
            qs[s + 1] = qs[s] + k + 1;
            slot[s] = s, dec[s] = 1;
            max_ctx = newest + 1;
        }
        fill_random(b, W->q, (size_t)qs[W->B] * NH * HD, 2.0f);   /* a new query every step (untimed) */
        O->upload(b, W->qs, 0, qs, (size_t)W->B + 1);
        O->upload(b, W->pos, 0, pos, (size_t)W->B);
        const struct kvs_attn_meta m = {.n_seqs = W->B, .max_blocks = W->mb, .q_start = W->qs, .pos = W->pos,
                                        .block_tables = W->bt, .h_q_start = qs, .h_pos = pos, .max_ctx = max_ctx};
        const struct kvs_kv_step step = {W->B, qs[W->B], qs, pos, slot, dec, &m, NULL, 0};
        const struct kvs_kv_attend a = {&step, W->q, NULL, {W->kc, W->vc, NULL, NULL, 0}, NH, NKV, HD, BS,
                                        0.08838834764831845f, W->out, W->lse};
        O->sync(b);
        const double t0 = now_ms();
        if (dp->plan && dp->plan(st, &step)) kvs_panic(__FILE__, __LINE__, "plan");
        O->sync(b);   /* plan is once a step, attend once a layer: timed apart */
        const double t1 = now_ms();
        dp->attend(st, 0, &a);
        if (dp->finish) dp->finish(st, 0, &step);
        O->sync(b);
        if (it >= warm) total += now_ms() - t0, plan += t1 - t0;
    }
    *eff = 1.0;
    struct kvs_kv_counter c[32];
    const int n = dp->counters ? dp->counters(st, c, 32) : 0;
    for (int i = 0; i < n; i++)
        if (!strcmp(c[i].name, "kvserve:kv_retro_effective_budget")) *eff = c[i].value;
    for (int s = 0; s < W->B && dp->seq_free; s++) dp->seq_free(st, s);
    dp->destroy(st);
    free(arena), free(qs), free(pos), free(slot), free(dec);
    kvs_config_free(&cfg);
    if (plan_ms) *plan_ms = plan / steps;
    return total / steps;
}

int main(int argc, char **argv)
{
    int batches[8] = {1, 8, 32}, n_b = 3, contexts[8] = {8192, 32768}, n_c = 2, windows[8] = {2, 4, 8}, n_w = 3;
    int steps = 20, warm = 10;
    double ratio = 0.15;
    const char *md = NULL;
    int spans_col = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--batches") && i + 1 < argc) n_b = bench_parse_list(argv[++i], batches, 8);
        else if (!strcmp(argv[i], "--contexts") && i + 1 < argc) n_c = bench_parse_list(argv[++i], contexts, 8);
        else if (!strcmp(argv[i], "--windows") && i + 1 < argc) n_w = bench_parse_list(argv[++i], windows, 8);
        else if (!strcmp(argv[i], "--ratio") && i + 1 < argc) ratio = atof(argv[++i]);
        else if (!strcmp(argv[i], "--steps") && i + 1 < argc) steps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--warm") && i + 1 < argc) warm = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--markdown") && i + 1 < argc) md = argv[++i];
        else if (!strcmp(argv[i], "--spans")) spans_col = 1;
        else {
            fprintf(stderr, "usage: %s [--batches 1,8,32] [--contexts 8192,32768] [--windows 2,4,8] [--ratio 0.15] "
                    "[--steps 20] [--warm 10] [--spans] [--markdown FILE]\n", argv[0]);
            return 2;
        }
    }
    for (int i = 0; i < n_w; i++)
        if (windows[i] < 1 || windows[i] > MAXW) {
            fprintf(stderr, "windows are 1..%d\n", MAXW);
            return 2;
        }
    if (steps < 1 || warm < 0 || n_b <= 0 || n_c <= 0 || n_w <= 0) return 2;
    kvs_log_set_level(KVS_LOG_WARN);
    char err[256];
    struct kvs_backend *b = O->create(0, err, sizeof err);
    if (!b) {
        fprintf(stderr, "cuda backend unavailable: %s\n", err);
        return 1;
    }
    FILE *mf = md ? fopen(md, "w") : NULL;
    printf("retro per-layer attention step (plan + attend + finish + sync), ms; budget max(256, %.2f n)\n", ratio);
    char head[1024];
    int hl = snprintf(head, sizeof head, "| batch | context | full ms | Quest ms |");
    for (int i = 0; i < n_w; i++) hl += snprintf(head + hl, sizeof head - hl, " w=%d ms | w=%d / Quest | w=%d eff. budget |",
                                                 windows[i], windows[i], windows[i]);
    if (spans_col) hl += snprintf(head + hl, sizeof head - hl, " w=2 unfused ms | w=2 unfused / Quest |");
    int w2col = 0;
    for (int i = 0; i < n_w; i++) w2col |= windows[i] == 2;
    if (w2col)
        hl += snprintf(head + hl, sizeof head - hl, " w=2 plan / attend ms | w=2 / Quest attend | w=2 / Quest, 1 plan + 30 "
                       "layers |");
    printf("%s\n", head);
    if (mf) {
        fprintf(mf, "%s\n|---|---|---|---|", head);
        for (int i = 0; i < n_w; i++) fprintf(mf, "---|---|---|");
        if (spans_col) fprintf(mf, "---|---|");
        if (w2col) fprintf(mf, "---|---|---|");
        fprintf(mf, "\n");
    }
    for (int bi = 0; bi < n_b; bi++)
        for (int ci = 0; ci < n_c; ci++) {
            struct world W = {.B = batches[bi], .ctx = contexts[ci]};
            W.mb = (W.ctx + BS - 1) / BS;
            W.n_blocks = W.B * W.mb;
            const size_t kv = (size_t)W.n_blocks * NKV * BS * HD;
            if (kv * 2 * 2 * 1.3 > (double)O->mem_available(b)) {
                printf("| %d | %d | (skipped: %zu MB of K/V do not fit) |\n", W.B, W.ctx, kv * 4 >> 20);
                continue;
            }
            W.kc = alloc_or_die(b, KVS_BUF_KV, kv);
            W.vc = alloc_or_die(b, KVS_BUF_KV, kv);
            kvs_cuda_fill_random(b, W.kc, 0, kv, 1.0f, 11);   /* on the device: 128K contexts fill in ms */
            kvs_cuda_fill_random(b, W.vc, 0, kv, 1.0f, 12);
            const size_t rows = (size_t)W.B * MAXW;
            W.q = alloc_or_die(b, KVS_BUF_ACT, rows * NH * HD);
            fill_random(b, W.q, rows * NH * HD, 2.0f);
            W.out = alloc_or_die(b, KVS_BUF_ACT, rows * NH * HD);
            W.lse = alloc_or_die(b, KVS_BUF_F32, rows * NH);
            W.qs = alloc_or_die(b, KVS_BUF_I32, (size_t)W.B + 1);
            W.pos = alloc_or_die(b, KVS_BUF_I32, (size_t)W.B);
            W.bt = alloc_or_die(b, KVS_BUF_I32, (size_t)W.B * W.mb);
            W.h_bt = kvs_xmalloc((size_t)W.n_blocks * sizeof *W.h_bt);
            for (int i = 0; i < W.n_blocks; i++) W.h_bt[i] = i;
            for (int i = W.n_blocks - 1; i > 0; i--) {
                const int j = (int)(bench_rnd(&rng) % (uint32_t)(i + 1)), t = W.h_bt[i];
                W.h_bt[i] = W.h_bt[j], W.h_bt[j] = t;
            }
            O->upload(b, W.bt, 0, W.h_bt, (size_t)W.n_blocks);
            double eff, qplan, wplan = 0, w2 = 0;
            const double full = run_policy(b, &W, "full", 1, ratio, warm, steps, &eff, NULL);
            const double quest = run_policy(b, &W, "retro", 1, ratio, warm, steps, &eff, &qplan);
            char line[1024];
            int ll = snprintf(line, sizeof line, "| %d | %d | %.3f | %.3f |", W.B, W.ctx, full, quest);
            for (int i = 0; i < n_w; i++) {
                double pl;
                const double t = run_policy(b, &W, "retro", windows[i], ratio, warm, steps, &eff, &pl);
                if (windows[i] == 2) w2 = t, wplan = pl;
                ll += snprintf(line + ll, sizeof line - ll, " %.3f | %.2f | %.3f |", t, t / quest, eff);
            }
            if (spans_col) {
                setenv("KVS_RETRO_FUSED", "0", 1);
                const double t = run_policy(b, &W, "retro", 2, ratio, warm, steps, &eff, NULL);
                unsetenv("KVS_RETRO_FUSED");
                ll += snprintf(line + ll, sizeof line - ll, " %.3f | %.2f |", t, t / quest);
            }
            if (w2 > 0) {
                /* a 32-layer model, layers 0-1 dense: one plan and 30 selecting layers */
                const double qa = quest - qplan, wa = w2 - wplan;
                ll += snprintf(line + ll, sizeof line - ll, " %.3f / %.3f | %.2f | %.2f |", wplan, wa, wa / qa,
                               (wplan + 30 * wa) / (qplan + 30 * qa));
            }
            printf("%s\n", line);
            if (mf) fprintf(mf, "%s\n", line);
            struct kvs_dbuf *bs[] = {W.kc, W.vc, W.q, W.out, W.lse, W.qs, W.pos, W.bt};
            for (size_t i = 0; i < sizeof bs / sizeof bs[0]; i++) O->free_buf(b, bs[i]);
            free(W.h_bt);
        }
    if (mf) fclose(mf);
    O->free(b);
    return 0;
}
#else
int main(void)
{
    fprintf(stderr, "kvserve-retrobench: built without CUDA (nvcc not found)\n");
    return 1;
}
#endif
