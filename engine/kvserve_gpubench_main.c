/* kvserve_gpubench_main.c: decode-step benchmark of the CUDA backend on the Llama-3.1-8B shape
 * with random bf16 weights generated on the device (no files), -> build/kvserve-gpubench.
 *
 * One decode step is the runner's layer loop written with the backend's ops (embed; per layer
 * rmsnorm, q/k/v matmuls, RoPE, kv_write, paged attention, o matmul, add+rmsnorm, gate/up
 * matmuls, SwiGLU, down matmul; final norm and LM head), captured once per shape in a CUDA
 * graph and replayed. For each (batch, context) it prints ms/step (median of the replays),
 * tokens/s, the bytes the step must move (every weight matrix once + the K and V it attends
 * to; the embedding table contributes only its B rows), the floor = bytes / measured
 * device-to-device copy bandwidth (read + write bytes per second, same run), and floor / time.
 *
 * Usage: kvserve-gpubench [--batches 1,8,32,128] [--contexts 1024,8192,32768] [--iters 20]
 *                         [--layers 32] [--markdown FILE] [--attn-variants]
 * --attn-variants also times the attention of all layers alone for each kernel variant.
 * A shape whose KV does not fit the pool (sized from free memory) is skipped with a note.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/util.h"
#include "kernels/backend.h"

#if defined(KVS_HAVE_CUDA) && KVS_HAVE_CUDA
#include "kernels/cuda/cuda_backend.h"

/* Llama-3.1-8B */
#define DIM 4096
#define NH 32
#define NKV 8
#define HD 128
#define FF 14336
#define VOCAB 128256
#define BS 16

static const struct kvs_backend_ops *O = &kvs_cuda_backend;

struct layer {
    struct kvs_dweight *wq, *wk, *wv, *wo, *wg, *wu, *wd, *n1, *n2;
    struct kvs_dbuf *kc, *vc;
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

static struct kvs_dbuf *xalloc(struct kvs_backend *b, enum kvs_buf_kind k, size_t n)
{
    struct kvs_dbuf *d = O->alloc(b, k, n);
    if (!d) kvs_panic(__FILE__, __LINE__, "out of device memory (%zu elements)", n);
    return d;
}

int main(int argc, char **argv)
{
    int batches[16] = {1, 8, 32, 128}, nbatch = 4, ctxs[16] = {1024, 8192, 32768}, nctx = 3, iters = 20;
    int n_layers = 32, attn_variants = 0;
    const char *md = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--batches") && i + 1 < argc) nbatch = parse_list(argv[++i], batches, 16);
        else if (!strcmp(argv[i], "--contexts") && i + 1 < argc) nctx = parse_list(argv[++i], ctxs, 16);
        else if (!strcmp(argv[i], "--iters") && i + 1 < argc) iters = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--layers") && i + 1 < argc) n_layers = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--markdown") && i + 1 < argc) md = argv[++i];
        else if (!strcmp(argv[i], "--attn-variants")) attn_variants = 1;
        else {
            fprintf(stderr, "usage: %s [--batches 1,8,32] [--contexts 1024,8192] [--iters N] [--layers N] "
                            "[--markdown FILE]\n", argv[0]);
            return 2;
        }
    }
    if (nbatch <= 0 || nctx <= 0 || iters <= 0 || iters > 1000 || n_layers <= 0 || n_layers > 256) {
        fprintf(stderr, "bad arguments\n");
        return 2;
    }
    char err[256], desc[256];
    struct kvs_backend *b = O->create(0, err, sizeof err);
    if (!b) {
        fprintf(stderr, "cuda backend: %s\n", err);
        return 1;
    }
    kvs_cuda_device_desc(b, desc, sizeof desc);
    double bw = kvs_cuda_copy_bandwidth(b, (size_t)2 << 30);
    printf("device: %s\ncopy bandwidth (read+write, 2 GiB cudaMemcpy D2D, median of 15): %.0f GB/s\n", desc, bw / 1e9);

    int max_b = 0;
    for (int i = 0; i < nbatch; i++) if (batches[i] > max_b) max_b = batches[i];

    /* weights, random on the device (uniform, small scale so activations stay finite) */
    uint64_t seed = 1;
    struct kvs_dweight *emb = kvs_cuda_random_weight(b, VOCAB, DIM, 0, 0.02f, seed++);
    struct kvs_dweight *head = kvs_cuda_random_weight(b, VOCAB, DIM, 0, 0.02f, seed++);
    struct kvs_dweight *fnorm = kvs_cuda_random_weight(b, 1, DIM, 1, 1.0f, seed++);
    struct layer *L = kvs_xcalloc((size_t)n_layers, sizeof *L);
    for (int l = 0; l < n_layers; l++) {
        L[l].wq = kvs_cuda_random_weight(b, DIM, DIM, 0, 0.02f, seed++);
        L[l].wk = kvs_cuda_random_weight(b, NKV * HD, DIM, 0, 0.02f, seed++);
        L[l].wv = kvs_cuda_random_weight(b, NKV * HD, DIM, 0, 0.02f, seed++);
        L[l].wo = kvs_cuda_random_weight(b, DIM, DIM, 0, 0.02f, seed++);
        L[l].wg = kvs_cuda_random_weight(b, FF, DIM, 0, 0.02f, seed++);
        L[l].wu = kvs_cuda_random_weight(b, FF, DIM, 0, 0.02f, seed++);
        L[l].wd = kvs_cuda_random_weight(b, DIM, FF, 0, 0.02f, seed++);
        L[l].n1 = kvs_cuda_random_weight(b, 1, DIM, 1, 1.0f, seed++);
        L[l].n2 = kvs_cuda_random_weight(b, 1, DIM, 1, 1.0f, seed++);
        if (!L[l].wq || !L[l].wk || !L[l].wv || !L[l].wo || !L[l].wg || !L[l].wu || !L[l].wd || !L[l].n1 || !L[l].n2)
            kvs_panic(__FILE__, __LINE__, "out of device memory for the weights");
    }
    if (!emb || !head || !fnorm) kvs_panic(__FILE__, __LINE__, "out of device memory for the weights");
    double w_bytes = (double)n_layers * 2.0 * ((double)DIM * DIM * 2 + 2.0 * NKV * HD * DIM + 3.0 * FF * DIM) +
                     2.0 * VOCAB * DIM + 4.0 * DIM * (2 * n_layers + 1);

    /* activations for the largest batch */
    size_t B = (size_t)max_b;
    struct kvs_dbuf *x = xalloc(b, KVS_BUF_ACT, B * DIM), *h = xalloc(b, KVS_BUF_ACT, B * DIM);
    struct kvs_dbuf *q = xalloc(b, KVS_BUF_ACT, B * DIM), *k = xalloc(b, KVS_BUF_ACT, B * NKV * HD);
    struct kvs_dbuf *v = xalloc(b, KVS_BUF_ACT, B * NKV * HD), *att = xalloc(b, KVS_BUF_ACT, B * DIM);
    struct kvs_dbuf *o = xalloc(b, KVS_BUF_ACT, B * DIM), *g = xalloc(b, KVS_BUF_ACT, B * FF);
    struct kvs_dbuf *u = xalloc(b, KVS_BUF_ACT, B * FF), *logits = xalloc(b, KVS_BUF_ACT, B * VOCAB);
    struct kvs_dbuf *tok = xalloc(b, KVS_BUF_I32, B), *pos = xalloc(b, KVS_BUF_I32, B);
    struct kvs_dbuf *slots = xalloc(b, KVS_BUF_I32, B), *qs = xalloc(b, KVS_BUF_I32, B + 1);
    struct kvs_dbuf *psq = xalloc(b, KVS_BUF_I32, B), *invf = xalloc(b, KVS_BUF_F32, HD / 2);

    /* KV pool: what free memory allows (keeping 1 GiB), at most what the largest shape needs */
    size_t need_tokens = 0;
    for (int i = 0; i < nbatch; i++)
        for (int j = 0; j < nctx; j++) {
            size_t t = (size_t)batches[i] * (size_t)((ctxs[j] + BS - 1) / BS * BS);
            if (t > need_tokens) need_tokens = t;
        }
    size_t per_token = (size_t)n_layers * 2 * NKV * HD * 2;
    size_t avail = O->mem_available(b);
    size_t cap_tokens = avail > ((size_t)1 << 30) ? (avail - ((size_t)1 << 30)) / per_token : 0;
    if (cap_tokens > need_tokens) cap_tokens = need_tokens;
    int n_blocks = (int)(cap_tokens / BS);
    printf("weights %.2f GB (bf16), KV pool %d blocks of %d tokens = %.2f GB\n", w_bytes / 1e9, n_blocks, BS,
           (double)n_blocks * BS * per_token / 1e9);
    for (int l = 0; l < n_layers; l++) {
        L[l].kc = xalloc(b, KVS_BUF_KV, (size_t)n_blocks * NKV * BS * HD);
        L[l].vc = xalloc(b, KVS_BUF_KV, (size_t)n_blocks * NKV * BS * HD);
        kvs_cuda_fill_random(b, L[l].kc, 0, (size_t)n_blocks * NKV * BS * HD, 1.0f, seed++);
        kvs_cuda_fill_random(b, L[l].vc, 0, (size_t)n_blocks * NKV * BS * HD, 1.0f, seed++);
    }
    float inv[HD / 2];
    for (int i = 0; i < HD / 2; i++) inv[i] = (float)(1.0 / pow(500000.0, 2.0 * i / HD));
    O->upload(b, invf, 0, inv, HD / 2);

    FILE *mf = md ? fopen(md, "w") : NULL;
    if (md && !mf) {
        fprintf(stderr, "cannot write %s\n", md);
        return 1;
    }
    if (mf) {
        fprintf(mf, "| batch | context | ms/step | tokens/s | weights GB | KV read GB | floor ms | achieved |\n");
        fprintf(mf, "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
    }
    printf("%6s %8s %9s %10s %10s %10s %9s %9s\n", "batch", "context", "ms/step", "tokens/s", "weights GB",
           "KV GB", "floor ms", "achieved");

    float scale = 1.0f / sqrtf((float)HD);
    uint64_t rs = 88172645463325252ull;
    for (int bi = 0; bi < nbatch; bi++)
        for (int ci = 0; ci < nctx; ci++) {
            int nb = batches[bi], ctx = ctxs[ci];
            int bps = (ctx + BS - 1) / BS;
            if ((size_t)nb * bps > (size_t)n_blocks) {
                printf("%6d %8d   skipped: KV of %.1f GB does not fit the pool\n", nb, ctx,
                       (double)nb * bps * BS * per_token / 1e9);
                if (mf) fprintf(mf, "| %d | %d | skipped (KV does not fit) | | | | | |\n", nb, ctx);
                continue;
            }
            /* each sequence decodes its token at position ctx-1 over blocks dealt at random */
            int32_t *perm = kvs_xmalloc((size_t)n_blocks * 4), *bt = kvs_xmalloc((size_t)nb * bps * 4);
            int32_t *hq = kvs_xmalloc((size_t)(nb + 1) * 4), *hp = kvs_xmalloc((size_t)nb * 4);
            int32_t *hs = kvs_xmalloc((size_t)nb * 4), *ht = kvs_xmalloc((size_t)nb * 4);
            for (int i = 0; i < n_blocks; i++) perm[i] = i;
            for (int i = n_blocks - 1; i > 0; i--) {
                rs ^= rs << 13; rs ^= rs >> 7; rs ^= rs << 17;
                int j = (int)(rs % (uint64_t)(i + 1));
                int32_t t = perm[i]; perm[i] = perm[j]; perm[j] = t;
            }
            for (int s = 0; s < nb; s++) {
                for (int j = 0; j < bps; j++) bt[s * bps + j] = perm[s * bps + j];
                hq[s] = s;
                hp[s] = ctx - 1;
                hs[s] = bt[s * bps + (ctx - 1) / BS] * BS + (ctx - 1) % BS;
                ht[s] = (s * 7919) % VOCAB;
            }
            hq[nb] = nb;
            struct kvs_dbuf *btd = xalloc(b, KVS_BUF_I32, (size_t)nb * bps);
            O->upload(b, btd, 0, bt, (size_t)nb * bps);
            O->upload(b, qs, 0, hq, (size_t)nb + 1);
            O->upload(b, psq, 0, hp, (size_t)nb);
            O->upload(b, pos, 0, hp, (size_t)nb);
            O->upload(b, slots, 0, hs, (size_t)nb);
            O->upload(b, tok, 0, ht, (size_t)nb);
            struct kvs_attn_meta m = {.n_seqs = nb, .max_blocks = bps, .q_start = qs, .pos = psq, .block_tables = btd,
                                      .rot_offsets = NULL, .inv_freq = invf, .h_q_start = hq, .h_pos = hp,
                                      .max_ctx = ctx};
            O->sync(b);

            kvs_cuda_graph_begin(b);
            O->embed(b, emb, tok, nb, DIM, x);
            O->rmsnorm(b, x, L[0].n1, 1e-5f, nb, DIM, h);
            for (int l = 0; l < n_layers; l++) {
                O->matmul(b, h, L[l].wq, NULL, nb, DIM, DIM, q);
                O->matmul(b, h, L[l].wk, NULL, nb, DIM, NKV * HD, k);
                O->matmul(b, h, L[l].wv, NULL, nb, DIM, NKV * HD, v);
                O->rope(b, q, pos, NULL, invf, nb, NH, HD);
                O->rope(b, k, pos, NULL, invf, nb, NKV, HD);
                O->kv_write(b, k, v, slots, nb, NKV, HD, BS, L[l].kc, L[l].vc);
                O->attention(b, q, L[l].kc, L[l].vc, &m, nb, NH, NKV, HD, BS, scale, att);
                O->matmul(b, att, L[l].wo, NULL, nb, DIM, DIM, o);
                O->add_rmsnorm(b, x, o, L[l].n2, 1e-5f, nb, DIM, h);
                O->matmul(b, h, L[l].wg, NULL, nb, DIM, FF, g);
                O->matmul(b, h, L[l].wu, NULL, nb, DIM, FF, u);
                O->swiglu(b, g, u, nb, FF, g);
                O->matmul(b, g, L[l].wd, NULL, nb, FF, DIM, o);
                O->add_rmsnorm(b, x, o, l + 1 < n_layers ? L[l + 1].n1 : fnorm, 1e-5f, nb, DIM, h);
            }
            O->matmul(b, h, head, NULL, nb, DIM, VOCAB, logits);
            struct kvs_cuda_graph *gr = kvs_cuda_graph_end(b);

            for (int w = 0; w < 3; w++) kvs_cuda_graph_launch(b, gr);
            O->sync(b);
            float *t = kvs_xmalloc((size_t)iters * sizeof(float));
            for (int it = 0; it < iters; it++) {
                kvs_cuda_timer_start(b);
                kvs_cuda_graph_launch(b, gr);
                t[it] = kvs_cuda_timer_stop_ms(b);
            }
            qsort(t, (size_t)iters, sizeof(float), cmp_float);
            float ms = t[iters / 2];
            /* the logits must be finite: a broken kernel fails the benchmark rather than timing garbage */
            float *lg = kvs_xmalloc((size_t)nb * VOCAB * 4);
            O->logits_to_host(b, logits, nb, VOCAB, lg);
            for (size_t i = 0; i < (size_t)nb * VOCAB; i++)
                if (!(lg[i] == lg[i]) || lg[i] > 1e30f || lg[i] < -1e30f)
                    kvs_panic(__FILE__, __LINE__, "non-finite logit at batch %d ctx %d", nb, ctx);
            double kv_bytes = (double)nb * ctx * per_token; /* every layer's K and V of every position */
            double bytes = w_bytes + kv_bytes;
            double floor_ms = bytes / bw * 1e3;
            printf("%6d %8d %9.3f %10.0f %10.2f %10.2f %9.3f %8.1f%%\n", nb, ctx, ms, nb / (ms * 1e-3), w_bytes / 1e9,
                   kv_bytes / 1e9, floor_ms, 100.0 * floor_ms / ms);
            fflush(stdout);
            if (mf)
                fprintf(mf, "| %d | %d | %.3f | %.0f | %.2f | %.2f | %.3f | %.1f%% |\n", nb, ctx, ms, nb / (ms * 1e-3),
                        w_bytes / 1e9, kv_bytes / 1e9, floor_ms, 100.0 * floor_ms / ms);
            /* attention alone (all layers), for each kernel variant: where the KV time goes */
            if (attn_variants) {
                static const int var[][2] = {{1, 0}, {1, 4}, {1, 8}, {0, 0}};
                printf("%6s %8s   attention only:", "", "");
                for (int vi = 0; vi < 4; vi++) {
                    kvs_cuda_set_attn_variant(b, var[vi][0], var[vi][1]);
                    kvs_cuda_graph_begin(b);
                    for (int l = 0; l < n_layers; l++)
                        O->attention(b, q, L[l].kc, L[l].vc, &m, nb, NH, NKV, HD, BS, scale, att);
                    struct kvs_cuda_graph *ga = kvs_cuda_graph_end(b);
                    kvs_cuda_graph_launch(b, ga);
                    for (int it = 0; it < iters; it++) {
                        kvs_cuda_timer_start(b);
                        kvs_cuda_graph_launch(b, ga);
                        t[it] = kvs_cuda_timer_stop_ms(b);
                    }
                    qsort(t, (size_t)iters, sizeof(float), cmp_float);
                    printf("  occ%d/%-4s %.3f ms %4.0f GB/s", var[vi][0], var[vi][1] ? (var[vi][1] == 4 ? "4" : "8") : "auto", t[iters / 2],
                           kv_bytes / (t[iters / 2] * 1e-3) / 1e9);
                    kvs_cuda_graph_free(ga);
                }
                printf("\n");
                kvs_cuda_set_attn_variant(b, 1, 0);
            }
            free(lg);
            free(t);
            kvs_cuda_graph_free(gr);
            O->free_buf(b, btd);
            free(perm); free(bt); free(hq); free(hp); free(hs); free(ht);
        }
    if (mf) {
        fprintf(mf, "\nDevice: %s. Copy bandwidth %.0f GB/s (read+write). Floor = (weights + KV read) / copy "
                    "bandwidth; achieved = floor / measured. Each step is a CUDA graph replay (median of %d).\n",
                desc, bw / 1e9, iters);
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
