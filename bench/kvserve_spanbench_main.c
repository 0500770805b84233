/* kvserve_spanbench_main.c: benchmark of the CUDA backend's attention_spans (kernels/cuda/kv_span.cu)
 * against its full attention() on the same data, -> build/kvserve-spanbench.
 *
 * One layer of the Llama-3.1-8B attention shape (32 query heads, 8 KV heads, head_dim 128, bf16
 * K/V in a paged pool of 16-slot blocks dealt at random), B decode rows (one per sequence, at the
 * context's last position). For each (batch, context, coverage) the spans of every (row, KV head)
 * are random whole blocks (pages, as a page-selecting sparse policy picks them) covering that
 * fraction of the context, the last block always included; 100% is one span [0, ctx). Each call
 * is timed alone with the L2 flushed before it (a 256 MB memset, which also keeps the host's
 * launch out of the timing), median of --reps. Printed per shape: spans per (row, KV head), the
 * K/V bytes the spans select, ms, GB/s of K/V read, the full attention() over the whole context
 * (ms, GB/s), and the time ratio spans / full (ideal: the coverage).
 *
 * Usage: kvserve-spanbench [--batches 1,8,32] [--contexts 32768,131072] [--coverage 1,10,100]
 *                          [--reps 20] [--markdown FILE]
 * A shape whose KV does not fit in free device memory is skipped with a note.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench/bench_util.h"
#include "base/util.h"
#include "kernels/backend.h"

#if defined(KVS_HAVE_CUDA) && KVS_HAVE_CUDA
#include "kernels/cuda/cuda_backend.h"
#include "bench/bench_cuda.h"

#define BS 16 /* KV block size (tokens) */

#define FLUSH_FLOATS ((size_t)64 << 20) /* 256 MB: several times the L2 */

static const struct kvs_backend_ops *O = &kvs_cuda_backend;
static uint64_t rng = 0x9e3779b97f4a7c15ull;

struct shape {
    struct kvs_dbuf *kc, *vc, *q, *out, *lse, *qs, *pos, *bt, *nsp, *sp;
    struct kvs_attn_meta m;
    int32_t *h_qs, *h_pos;
};

/* median ms of reps calls of op (0: attention_spans, 1: attention), each after an L2 flush */
static float time_op(struct kvs_backend *b, struct shape *S, struct kvs_span_list *sl, int B, int op, int reps,
                     struct kvs_dbuf *flush)
{
    const float scale = 0.08838834764831845f; /* 1 / sqrt(128) */
    float *t = kvs_xmalloc((size_t)reps * sizeof(float));
    for (int r = -2; r < reps; r++) { /* two warm-ups */
        O->zero(b, flush, 0, FLUSH_FLOATS);
        kvs_cuda_timer_start(b);
        if (op == 0)
            O->attention_spans(b, S->q, S->kc, S->vc, &S->m, sl, B, NH, NKV, HD, BS, scale, S->out, S->lse);
        else
            O->attention(b, S->q, S->kc, S->vc, &S->m, B, NH, NKV, HD, BS, scale, S->out);
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
    int batches[8] = {1, 8, 32}, nb = 3, contexts[8] = {32768, 131072}, nc = 2, cover[8] = {1, 10, 100}, ncov = 3;
    int reps = 20;
    const char *md = NULL;
    for (int i = 1; i < argc; i++) {
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(argv[i], "--batches") && v) nb = bench_parse_list(argv[++i], batches, 8);
        else if (!strcmp(argv[i], "--contexts") && v) nc = bench_parse_list(argv[++i], contexts, 8);
        else if (!strcmp(argv[i], "--coverage") && v) ncov = bench_parse_list(argv[++i], cover, 8);
        else if (!strcmp(argv[i], "--reps") && v) reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--markdown") && v) md = argv[++i];
        else {
            fprintf(stderr, "usage: %s [--batches 1,8,32] [--contexts 32768,131072] [--coverage 1,10,100] "
                            "[--reps 20] [--markdown FILE]\n", argv[0]);
            return 2;
        }
    }
    if (nb <= 0 || nc <= 0 || ncov <= 0 || reps <= 0) {
        fprintf(stderr, "%s: bad list or --reps\n", argv[0]);
        return 2;
    }
    for (int i = 0; i < ncov; i++)
        if (cover[i] > 100) {
            fprintf(stderr, "%s: coverage is a percentage (1..100)\n", argv[0]);
            return 2;
        }
    char desc[256];
    struct kvs_backend *b = bench_cuda_open();
    if (!b) return 1;
    kvs_cuda_device_desc(b, desc, sizeof desc);
    printf("device: %s\nshape: %d query heads, %d KV heads, head_dim %d, blocks of %d slots; one layer, decode rows\n",
           desc, NH, NKV, HD, BS);
    FILE *mf = md ? fopen(md, "w") : NULL;
    if (md && !mf) {
        fprintf(stderr, "%s: cannot write %s\n", argv[0], md);
        return 1;
    }
    if (mf)
        fprintf(mf, "| batch | context | coverage | spans/pair | KV MB read | spans ms | spans GB/s | full ms | full GB/s "
                    "| time spans / full |\n|---|---|---|---|---|---|---|---|---|---|\n");
    printf("%6s %8s %8s %10s %10s %9s %10s %9s %9s %10s\n", "batch", "context", "cover%", "spans/pr", "KV MB", "spans ms",
           "GB/s", "full ms", "GB/s", "spans/full");
    struct kvs_dbuf *flush = bench_dalloc(b, KVS_BUF_F32, FLUSH_FLOATS);
    for (int bi = 0; bi < nb; bi++)
        for (int ci = 0; ci < nc; ci++) {
            const int B = batches[bi], ctx = contexts[ci], nblk = (ctx + BS - 1) / BS;
            const size_t pool_blocks = (size_t)B * nblk, kv_elems = pool_blocks * NKV * BS * HD;
            if (2 * kv_elems * 2 + ((size_t)64 << 20) > O->mem_available(b)) {
                printf("%6d %8d   skipped: %.1f GB of K/V does not fit\n", B, ctx, 4.0 * kv_elems / 1e9);
                continue;
            }
            struct shape S;
            memset(&S, 0, sizeof S);
            S.kc = bench_dalloc(b, KVS_BUF_KV, kv_elems);
            S.vc = bench_dalloc(b, KVS_BUF_KV, kv_elems);
            kvs_cuda_fill_random(b, S.kc, 0, kv_elems, 1.0f, 11);
            kvs_cuda_fill_random(b, S.vc, 0, kv_elems, 1.0f, 12);
            S.q = bench_dalloc(b, KVS_BUF_ACT, (size_t)B * NH * HD);
            kvs_cuda_fill_random(b, S.q, 0, (size_t)B * NH * HD, 1.0f, 13);
            S.out = bench_dalloc(b, KVS_BUF_ACT, (size_t)B * NH * HD);
            S.lse = bench_dalloc(b, KVS_BUF_F32, (size_t)B * NH);
            /* block tables: the pool dealt at random */
            int32_t *perm = bench_shuffled_ids(pool_blocks, &rng);
            S.h_qs = kvs_xmalloc((size_t)(B + 1) * 4);
            S.h_pos = kvs_xmalloc((size_t)B * 4);
            for (int s = 0; s <= B; s++) S.h_qs[s] = s;
            for (int s = 0; s < B; s++) S.h_pos[s] = ctx - 1;
            S.qs = bench_dalloc(b, KVS_BUF_I32, (size_t)B + 1);
            S.pos = bench_dalloc(b, KVS_BUF_I32, (size_t)B);
            S.bt = bench_dalloc(b, KVS_BUF_I32, pool_blocks);
            O->upload(b, S.qs, 0, S.h_qs, (size_t)B + 1);
            O->upload(b, S.pos, 0, S.h_pos, (size_t)B);
            O->upload(b, S.bt, 0, perm, pool_blocks);
            S.m = (struct kvs_attn_meta){.n_seqs = B, .max_blocks = nblk, .q_start = S.qs, .pos = S.pos,
                                         .block_tables = S.bt, .h_q_start = S.h_qs, .h_pos = S.h_pos, .max_ctx = ctx};
            const float full_ms = time_op(b, &S, NULL, B, 1, reps, flush);
            const double full_bytes = 2.0 * B * NKV * (double)ctx * HD * 2;
            for (int vi = 0; vi < ncov; vi++) {
                /* pages covering cover% of the context (the last one always), sorted, one span each
                 * (adjacent pages merged into one span) */
                int want = (int)((long long)nblk * cover[vi] / 100);
                if (want < 1) want = 1;
                const int max_spans = cover[vi] == 100 ? 1 : want;
                const size_t pairs = (size_t)B * NKV;
                int32_t *h_n = kvs_xcalloc(pairs, 4), *h_sp = kvs_xcalloc(pairs * max_spans * 2, 4);
                char *pick = kvs_xmalloc((size_t)nblk);
                long long tokens = 0, spans = 0;
                for (size_t pr = 0; pr < pairs; pr++) {
                    int32_t *sp = h_sp + pr * max_spans * 2;
                    if (cover[vi] == 100) {
                        h_n[pr] = 1;
                        sp[0] = 0;
                        sp[1] = ctx;
                        tokens += ctx;
                        spans++;
                        continue;
                    }
                    memset(pick, 0, (size_t)nblk);
                    pick[nblk - 1] = 1;
                    for (int k = 1; k < want;) { /* want distinct pages */
                        const int p = (int)(bench_rnd(&rng) % (uint32_t)nblk);
                        if (!pick[p]) {
                            pick[p] = 1;
                            k++;
                        }
                    }
                    int k = 0;
                    for (int p = 0; p < nblk; p++) {
                        if (!pick[p]) continue;
                        const int lo = p * BS, hi = p * BS + BS < ctx ? p * BS + BS : ctx;
                        if (k > 0 && sp[2 * k - 1] == lo) sp[2 * k - 1] = hi;
                        else {
                            sp[2 * k] = lo;
                            sp[2 * k + 1] = hi;
                            k++;
                        }
                        tokens += hi - lo;
                    }
                    h_n[pr] = k;
                    spans += k;
                }
                S.nsp = bench_dalloc(b, KVS_BUF_I32, pairs);
                S.sp = bench_dalloc(b, KVS_BUF_I32, pairs * max_spans * 2);
                O->upload(b, S.nsp, 0, h_n, pairs);
                O->upload(b, S.sp, 0, h_sp, pairs * max_spans * 2);
                struct kvs_span_list sl = {max_spans, S.nsp, S.sp, h_n, h_sp};
                const float ms = time_op(b, &S, &sl, B, 0, reps, flush);
                const double bytes = 2.0 * (double)tokens * HD * 2; /* K and V, bf16 */
                const double per = (double)spans / (double)pairs;
                printf("%6d %8d %8d %10.1f %10.1f %9.3f %10.0f %9.3f %9.0f %10.3f\n", B, ctx, cover[vi], per,
                       bytes / 1e6, ms, bytes / (ms * 1e-3) / 1e9, full_ms, full_bytes / (full_ms * 1e-3) / 1e9,
                       ms / full_ms);
                fflush(stdout);
                if (mf)
                    fprintf(mf, "| %d | %d | %d%% | %.1f | %.1f | %.3f | %.0f | %.3f | %.0f | %.3f |\n", B, ctx, cover[vi],
                            per, bytes / 1e6, ms, bytes / (ms * 1e-3) / 1e9, full_ms,
                            full_bytes / (full_ms * 1e-3) / 1e9, ms / full_ms);
                O->free_buf(b, S.nsp);
                O->free_buf(b, S.sp);
                free(h_n);
                free(h_sp);
                free(pick);
            }
            O->free_buf(b, S.kc);
            O->free_buf(b, S.vc);
            O->free_buf(b, S.q);
            O->free_buf(b, S.out);
            O->free_buf(b, S.lse);
            O->free_buf(b, S.qs);
            O->free_buf(b, S.pos);
            O->free_buf(b, S.bt);
            free(perm);
            free(S.h_qs);
            free(S.h_pos);
        }
    if (mf) fclose(mf);
    O->free(b);
    return 0;
}

#else
int main(void)
{
    fprintf(stderr, "kvserve-spanbench: built without CUDA (nvcc not found)\n");
    return 1;
}
#endif
