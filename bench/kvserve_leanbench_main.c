/* kvserve_leanbench_main.c: LeanKV's static formats on the CUDA backend against bf16 K/V,
 * -> build/kvserve-leanbench.
 *
 * 1. Capacity: bytes per token of the Llama-3.1-8B shape (32 layers, 8 KV heads, head_dim 128)
 *    in bf16 and in each LeanKV format (fp16 scale / zero per vector included), and how many
 *    sequences of 8K tokens fit in this GPU's free memory after the model's 16.06 GB of bf16
 *    weights (no activations counted: an upper bound, the same for every format).
 * 2. Decode attention of one layer of that shape (32 query heads), B decode rows at context C
 *    in a paged pool of 16-slot blocks dealt at random: the backend's attention() over bf16 K/V
 *    against the LeanKV kernels (kernels/cuda/kv_lean.cu) over pages written from random K/V,
 *    in the same run on the same positions. Each call timed alone after an L2 flush, median of
 *    --reps; printed: ms, GB/s of K/V read, and the time ratio bf16 / lean (>1: lean faster;
 *    the byte ratio is the ideal).
 * 3. Chunked prefill over quantized history (--prefill P, 0: skipped): one sequence whose last P
 *    tokens are the query rows (a prefill chunk at context C), same comparison.
 *
 * --layouts rows,keys,dec times each format under each named layout of the attention kernel
 * (kvs_cuda_set_lean_layout: rows = query rows on the mma's M side, keys = keys on M with
 * one-warp blocks, dec = keys on M with the multi-warp decode kernel (kv_lean_decode.cu,
 * configured by KVS_LEAN_DEC); default auto, the kernels' own choice). The device-to-device copy bandwidth is printed first: the
 * yardstick for the GB/s columns.
 *
 * Usage: kvserve-leanbench [--batches 8,32] [--contexts 8192,32768] [--formats K8V8,K8V4,K4V4]
 *                          [--reps 20] [--prefill 512] [--layouts auto|rows|keys|dec,...]
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/bench_util.h"
#include "base/util.h"
#include "kernels/backend.h"
#include "kernels/kv_lean.h"

#if defined(KVS_HAVE_CUDA) && KVS_HAVE_CUDA
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/kv_lean_cuda.h"
#include "bench/bench_cuda.h"

#define BS 16 /* KV block size (tokens) */

#define NL 32
#define WEIGHT_BYTES 16060522496.0 /* Llama-3.1-8B in bf16 */
#define FLUSH_FLOATS ((size_t)64 << 20)
#define CHUNK 16384                 /* tokens per write launch when filling the pages */

static const struct kvs_backend_ops *O = &kvs_cuda_backend;
static uint64_t rng = 0x9e3779b97f4a7c15ull;

static struct kvs_dbuf *need(struct kvs_dbuf *d, size_t n)
{
    if (!d) kvs_panic(__FILE__, __LINE__, "out of device memory (%zu elements)", n);
    return d;
}

struct shape {
    struct kvs_dbuf *q, *out, *qs, *pos, *bt, *inv;
    struct kvs_attn_meta m;
    int32_t *h_qs, *h_pos, *h_bt;
};

/* median ms of reps calls (fmt NULL: attention() over kc / vc; else the lean kernels over pool), B
 * query rows */
static float time_op(struct kvs_backend *b, struct shape *S, int B, const struct kvs_lean_fmt *fmt,
                     struct kvs_dbuf *kc, struct kvs_dbuf *vc, struct kvs_dbuf *pool, int reps, struct kvs_dbuf *flush)
{
    const struct kvs_lean_kernels *kn = kvs_lean_kernels_for(O, NULL, 0);
    const float scale = 0.08838834764831845f;
    float *t = kvs_xmalloc((size_t)reps * sizeof(float));
    for (int r = -2; r < reps; r++) {
        O->zero(b, flush, 0, FLUSH_FLOATS);
        kvs_cuda_timer_start(b);
        if (fmt) kn->attention(b, *fmt, S->q, pool, &S->m, B, NH, NKV, HD, BS, scale, S->out);
        else O->attention(b, S->q, kc, vc, &S->m, B, NH, NKV, HD, BS, scale, S->out);
        const float ms = kvs_cuda_timer_stop_ms(b);
        if (r >= 0) t[r] = ms;
    }
    qsort(t, (size_t)reps, sizeof t[0], bench_cmp_float);
    const float med = t[reps / 2];
    free(t);
    return med;
}

int main(int argc, char **argv)
{
    int batches[8] = {8, 32}, nb = 2, contexts[8] = {8192, 32768}, nc = 2, reps = 20, prefill = 512;
    struct kvs_lean_fmt fmts[8] = {{8, 8}, {8, 4}, {4, 4}};
    int nf = 3, layouts[4] = {0}, nl = 1;
    static const char *const layout_name[4] = {"", "/rows", "/keys", "/dec"};
    for (int i = 1; i < argc; i++) {
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(argv[i], "--batches") && v) nb = bench_parse_list(argv[++i], batches, 8);
        else if (!strcmp(argv[i], "--contexts") && v) nc = bench_parse_list(argv[++i], contexts, 8);
        else if (!strcmp(argv[i], "--reps") && v) reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--prefill") && v) prefill = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--layouts") && v) {
            char buf[64];
            snprintf(buf, sizeof buf, "%s", argv[++i]);
            nl = 0;
            for (char *tok = strtok(buf, ","); tok && nl >= 0 && nl < 4; tok = strtok(NULL, ",")) {
                const int l = !strcmp(tok, "auto") ? 0 : !strcmp(tok, "rows") ? 1 : !strcmp(tok, "keys") ? 2
                              : !strcmp(tok, "dec") ? 3 : -1;
                if (l < 0) nl = -1; /* reported below */
                else layouts[nl++] = l;
            }
        }
        else if (!strcmp(argv[i], "--formats") && v) {
            char buf[128];
            snprintf(buf, sizeof buf, "%s", argv[++i]);
            nf = 0;
            for (char *tok = strtok(buf, ","); tok && nf < 8; tok = strtok(NULL, ","))
                if (kvs_lean_fmt_parse(tok, &fmts[nf++]) < 0) nf = -100;
        } else {
            fprintf(stderr, "usage: %s [--batches 8,32] [--contexts 8192,32768] [--formats K8V8,K8V4,K4V4] [--reps 20] [--prefill 512]\n",
                    argv[0]);
            return 2;
        }
    }
    if (nb <= 0 || nc <= 0 || nf <= 0 || nl <= 0 || reps <= 0 || prefill < 0) {
        fprintf(stderr, "%s: bad list, format, layout or --reps\n", argv[0]);
        return 2;
    }
    char desc[256];
    struct kvs_backend *b = bench_cuda_open();
    if (!b) return 1;
    const struct kvs_lean_kernels *kn = kvs_lean_kernels_for(O, NULL, 0);
    if (!kn) {
        fprintf(stderr, "the cuda backend has no LeanKV kernels\n");
        return 1;
    }
    kvs_cuda_device_desc(b, desc, sizeof desc);
    const double free_bytes = (double)O->mem_available(b);
    printf("device: %s, %.1f GB free\n", desc, free_bytes / 1e9);
    printf("device-to-device copy (bytes read + written / time): %.0f GB/s\n\n",
           kvs_cuda_copy_bandwidth(b, (size_t)1 << 30) / 1e9);

    /* 1. capacity */
    printf("capacity, Llama-3.1-8B shape (%d layers x %d KV heads x head_dim %d), after %.2f GB of weights:\n", NL, NKV,
           HD, WEIGHT_BYTES / 1e9);
    printf("%-8s %14s %10s %22s\n", "format", "bytes/token", "vs bf16", "8K-token sequences");
    const double bf16_bpt = (double)NL * NKV * HD * 2 * 2, avail = free_bytes - WEIGHT_BYTES;
    printf("%-8s %14.0f %9.2fx %22.0f\n", "bf16", bf16_bpt, 1.0, avail > 0 ? avail / (bf16_bpt * 8192) : 0);
    for (int f = 0; f < nf; f++) {
        const double bpt = (double)NL * NKV * kvs_lean_token_bytes(fmts[f], HD);
        char name[16];
        snprintf(name, sizeof name, "K%dV%d", fmts[f].kbits, fmts[f].vbits);
        printf("%-8s %14.0f %9.2fx %22.0f\n", name, bpt, bf16_bpt / bpt, avail > 0 ? avail / (bpt * 8192) : 0);
    }

    /* 2. decode attention, one layer */
    printf("\ndecode attention, one layer (%d query heads), median of %d calls after an L2 flush:\n", NH, reps);
    printf("%6s %8s %10s %9s", "batch", "context", "bf16 ms", "GB/s");
    for (int f = 0; f < nf; f++)
        for (int li = 0; li < nl; li++)
            printf("   K%dV%d%s ms    GB/s  bf16/lean", fmts[f].kbits, fmts[f].vbits, layout_name[layouts[li]]);
    printf("\n");
    struct kvs_dbuf *flush = need(O->alloc(b, KVS_BUF_F32, FLUSH_FLOATS), FLUSH_FLOATS);
    /* pass 0: decode rows of each batch; pass 1: one prefill chunk of `prefill` rows per context */
    int prefill_header = 0;
    for (int pass = 0; pass < 2; pass++)
    for (int bi = 0; bi < (pass ? 1 : nb); bi++)
        for (int ci = 0; ci < nc; ci++) {
            if (pass && (!prefill || prefill > contexts[ci])) continue;
            if (pass && !prefill_header) {
                prefill_header = 1;
                printf("\nchunked prefill over quantized history, one sequence, %d query rows at the end of the context:\n",
                       prefill);
                printf("%6s %8s %10s %9s", "rows", "context", "bf16 ms", "GB/s");
                for (int f = 0; f < nf; f++)
        for (int li = 0; li < nl; li++)
            printf("   K%dV%d%s ms    GB/s  bf16/lean", fmts[f].kbits, fmts[f].vbits, layout_name[layouts[li]]);
                printf("\n");
            }
            const int B = pass ? 1 : batches[bi], ctx = contexts[ci], nblk = (ctx + BS - 1) / BS;
            const int rows = pass ? prefill : B; /* query rows */
            const size_t blocks = (size_t)B * nblk, kv_elems = blocks * NKV * BS * HD;
            if (2.0 * kv_elems * 2 * 2 + 1e9 > (double)O->mem_available(b)) {
                printf("%6d %8d   skipped: %.1f GB of bf16 K/V does not fit beside the lean pages\n", B, ctx,
                       4.0 * kv_elems / 1e9);
                continue;
            }
            struct shape S;
            memset(&S, 0, sizeof S);
            struct kvs_dbuf *kc = need(O->alloc(b, KVS_BUF_KV, kv_elems), kv_elems);
            struct kvs_dbuf *vc = need(O->alloc(b, KVS_BUF_KV, kv_elems), kv_elems);
            kvs_cuda_fill_random(b, kc, 0, kv_elems, 1.0f, 11);
            kvs_cuda_fill_random(b, vc, 0, kv_elems, 1.0f, 12);
            S.q = need(O->alloc(b, KVS_BUF_ACT, (size_t)rows * NH * HD), 0);
            kvs_cuda_fill_random(b, S.q, 0, (size_t)rows * NH * HD, 1.0f, 13);
            S.out = need(O->alloc(b, KVS_BUF_ACT, (size_t)rows * NH * HD), 0);
            S.h_bt = bench_shuffled_ids(blocks, &rng);
            S.h_qs = kvs_xmalloc((size_t)(B + 1) * 4);
            S.h_pos = kvs_xmalloc((size_t)B * 4);
            for (int s = 0; s <= B; s++) S.h_qs[s] = pass ? s * rows : s;
            for (int s = 0; s < B; s++) S.h_pos[s] = ctx - rows;
            S.qs = need(O->alloc(b, KVS_BUF_I32, (size_t)B + 1), 0);
            S.pos = need(O->alloc(b, KVS_BUF_I32, (size_t)B), 0);
            S.bt = need(O->alloc(b, KVS_BUF_I32, blocks), 0);
            O->upload(b, S.qs, 0, S.h_qs, (size_t)B + 1);
            O->upload(b, S.pos, 0, S.h_pos, (size_t)B);
            O->upload(b, S.bt, 0, S.h_bt, blocks);
            S.m = (struct kvs_attn_meta){.n_seqs = B, .max_blocks = nblk, .q_start = S.qs, .pos = S.pos,
                                         .block_tables = S.bt, .h_q_start = S.h_qs, .h_pos = S.h_pos, .max_ctx = ctx};
            const float dense_ms = time_op(b, &S, rows, NULL, kc, vc, NULL, reps, flush);
            const double dense_bytes = 2.0 * B * NKV * (double)ctx * HD * 2;
            printf("%6d %8d %10.3f %9.0f", rows, ctx, dense_ms, dense_bytes / (dense_ms * 1e6));
            fflush(stdout);
            /* the lean pages: written from random K/V, CHUNK tokens a launch, every slot */
            struct kvs_dbuf *ck = need(O->alloc(b, KVS_BUF_ACT, (size_t)CHUNK * NKV * HD), 0);
            struct kvs_dbuf *cv = need(O->alloc(b, KVS_BUF_ACT, (size_t)CHUNK * NKV * HD), 0);
            struct kvs_dbuf *cs = need(O->alloc(b, KVS_BUF_I32, CHUNK), 0);
            kvs_cuda_fill_random(b, ck, 0, (size_t)CHUNK * NKV * HD, 1.0f, 21);
            kvs_cuda_fill_random(b, cv, 0, (size_t)CHUNK * NKV * HD, 1.0f, 22);
            int32_t *hs = kvs_xmalloc(CHUNK * 4);
            for (int f = 0; f < nf; f++) {
                const size_t bb = kvs_lean_page_bytes(fmts[f], HD, BS) * NKV;
                struct kvs_dbuf *pool = need(kn->alloc_pages(b, bb * blocks), bb * blocks);
                for (size_t t0 = 0; t0 < blocks * BS; t0 += CHUNK) {
                    const int n = blocks * BS - t0 < CHUNK ? (int)(blocks * BS - t0) : CHUNK;
                    for (int i = 0; i < n; i++) hs[i] = (int32_t)(t0 + i);
                    O->upload(b, cs, 0, hs, (size_t)n);
                    kn->write(b, fmts[f], ck, cv, cs, n, NKV, HD, BS, pool);
                }
                for (int li = 0; li < nl; li++) {
                    kvs_cuda_set_lean_layout(layouts[li]);
                    const float ms = time_op(b, &S, rows, &fmts[f], NULL, NULL, pool, reps, flush);
                    const double bytes = (double)B * NKV * ctx * kvs_lean_token_bytes(fmts[f], HD);
                    printf("   %9.3f %7.0f %9.2fx", ms, bytes / (ms * 1e6), dense_ms / ms);
                    fflush(stdout);
                }
                kvs_cuda_set_lean_layout(0);
                O->free_buf(b, pool);
            }
            printf("\n");
            free(hs);
            struct kvs_dbuf *bufs[] = {kc, vc, S.q, S.out, S.qs, S.pos, S.bt, ck, cv, cs};
            for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) O->free_buf(b, bufs[i]);
            free(S.h_bt), free(S.h_qs), free(S.h_pos);
        }
    O->free_buf(b, flush);
    O->free(b);
    return 0;
}
#else
int main(void)
{
    fprintf(stderr, "kvserve-leanbench: built without CUDA\n");
    return 1;
}
#endif
