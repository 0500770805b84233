/* kvserve_attnbench_main.c: kvserve-attnbench: the cost of deferred RoPE in the attention op.
 *
 * Times the backend's paged attention for a decode step (B sequences x 1 query row, context N)
 * and for a suffix prefill (1 sequence, Q rows after N cached positions) three ways over the
 * same KV: ordinary (no rotation offsets, no masks), lazy (every block a document block with a
 * nonzero rotation offset, documents of --doc-len tokens so each last block is partial and
 * masked when --doc-len is not a multiple of the block size; the default 512 keeps every
 * key, so both runs read the same keys), and reports the overhead of lazy against ordinary. Shapes default to Llama-3.1-8B
 * (32 q heads, 8 kv heads, head_dim 128, block 16). The issue-8 target on the GPU: decode
 * overhead under 1%.
 *
 *   build/kvserve-attnbench --device cpu --ctx 2048 --batch 4
 *   build/kvserve-attnbench --device cuda --ctx 32768 --batch 16
 */
#include "base/util.h"
#include "kernels/backend.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#if defined(KVS_HAVE_CUDA) && KVS_HAVE_CUDA && defined(__has_include)
#if __has_include("kernels/cuda/cuda_backend.h")
#include "kernels/cuda/cuda_backend.h"
#define ATTNBENCH_HAS_CUDA 1
#endif
#endif

static double time_op(const struct kvs_backend_ops *o, struct kvs_backend *be, int reps, const struct kvs_dbuf *q,
                      struct kvs_dbuf *kc, struct kvs_dbuf *vc, const struct kvs_attn_meta *m, int n, int nh, int nkv,
                      int hd, int bs, struct kvs_dbuf *out)
{
    float scale = 1.0f / sqrtf((float)hd);
    o->attention(be, q, kc, vc, m, n, nh, nkv, hd, bs, scale, out);   /* warm-up */
    o->sync(be);
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        double t0 = kvs_now();
        o->attention(be, q, kc, vc, m, n, nh, nkv, hd, bs, scale, out);
        o->sync(be);
        double t = kvs_now() - t0;
        if (t < best) best = t;
    }
    return best;
}

int main(int argc, char **argv)
{
    const char *device = "cpu";
    int ctx = 2048, batch = 4, nh = 32, nkv = 8, hd = 128, bs = 16, doc_len = 512, q_rows = 64, reps = 10;
    for (int i = 1; i + 1 < argc; i += 2) {
        const char *a = argv[i], *v = argv[i + 1];
        if (!strcmp(a, "--device")) device = v;
        else if (!strcmp(a, "--ctx")) ctx = atoi(v);
        else if (!strcmp(a, "--batch")) batch = atoi(v);
        else if (!strcmp(a, "--heads")) nh = atoi(v);
        else if (!strcmp(a, "--kv-heads")) nkv = atoi(v);
        else if (!strcmp(a, "--head-dim")) hd = atoi(v);
        else if (!strcmp(a, "--doc-len")) doc_len = atoi(v);
        else if (!strcmp(a, "--rows")) q_rows = atoi(v);
        else if (!strcmp(a, "--reps")) reps = atoi(v);
        else {
            fprintf(stderr, "kvserve-attnbench: unknown option %s\n", a);
            return 2;
        }
    }
    if (ctx < 1 || batch < 1 || nkv < 1 || nh % nkv || hd < 2 || hd % 2 || doc_len < 1 || q_rows < 1 || reps < 1) {
        fprintf(stderr, "kvserve-attnbench: bad shape\n");
        return 2;
    }
    const struct kvs_backend_ops *o = &kvs_cpu_backend;
    if (!strcmp(device, "cuda")) {
#ifdef ATTNBENCH_HAS_CUDA
        o = &kvs_cuda_backend;
#else
        fprintf(stderr, "kvserve-attnbench: this build has no CUDA backend\n");
        return 1;
#endif
    } else if (strcmp(device, "cpu")) {
        fprintf(stderr, "kvserve-attnbench: unknown device %s\n", device);
        return 2;
    }
    kvs_log_set_level(KVS_LOG_WARN);
    char err[256];
    struct kvs_backend *be = o->create(0, err, sizeof err);
    if (!be) {
        fprintf(stderr, "kvserve-attnbench: %s\n", err);
        return 1;
    }
    int total = ctx + q_rows;
    int mb = (total + bs - 1) / bs;               /* blocks per sequence */
    int S = batch;
    size_t per_block = (size_t)nkv * bs * hd;
    size_t nblocks = (size_t)S * mb;
    struct kvs_dbuf *kc = o->alloc(be, KVS_BUF_KV, nblocks * per_block), *vc = o->alloc(be, KVS_BUF_KV, nblocks * per_block);
    int maxn = S > q_rows ? S : q_rows;
    struct kvs_dbuf *q = o->alloc(be, KVS_BUF_ACT, (size_t)maxn * nh * hd), *out = o->alloc(be, KVS_BUF_ACT, (size_t)maxn * nh * hd);
    struct kvs_dbuf *dqs = o->alloc(be, KVS_BUF_I32, (size_t)S + 1), *dpos = o->alloc(be, KVS_BUF_I32, (size_t)S);
    struct kvs_dbuf *dbt = o->alloc(be, KVS_BUF_I32, nblocks), *drot = o->alloc(be, KVS_BUF_I32, nblocks);
    struct kvs_dbuf *dval = o->alloc(be, KVS_BUF_I32, nblocks), *dinv = o->alloc(be, KVS_BUF_F32, (size_t)hd / 2);
    if (!kc || !vc || !q || !out || !dqs || !dpos || !dbt || !drot || !dval || !dinv) {
        fprintf(stderr, "kvserve-attnbench: out of memory\n");
        return 1;
    }
    /* random K/V/q, uploaded in slices to keep host memory small */
    size_t chunk = per_block * 64;
    /* the same buffer then holds q: room for the larger of the two (--rows 2048 overran it) */
    const size_t qn = (size_t)maxn * nh * hd;
    float *h = kvs_xmalloc((chunk > qn ? chunk : qn) * sizeof *h);
    uint64_t st = 12345;
    for (size_t off = 0; off < nblocks * per_block; off += chunk) {
        size_t n = nblocks * per_block - off < chunk ? nblocks * per_block - off : chunk;
        for (size_t i = 0; i < n; i++) {
            st = st * 6364136223846793005ULL + 1442695040888963407ULL;
            h[i] = (float)((st >> 40) & 0xffff) / 32768.0f - 1.0f;
        }
        o->upload(be, kc, off, h, n);
        o->upload(be, vc, off, h, n);
    }
    for (size_t i = 0; i < (size_t)maxn * nh * hd; i++) h[i] = (float)((i * 2654435761u) % 1000) / 500.0f - 1.0f;
    o->upload(be, q, 0, h, (size_t)maxn * nh * hd);
    free(h);
    int32_t *bt = kvs_xmalloc(nblocks * sizeof *bt), *rot = kvs_xmalloc(nblocks * sizeof *rot);
    int32_t *val = kvs_xmalloc(nblocks * sizeof *val);
    for (int s = 0; s < S; s++)
        for (int j = 0; j < mb; j++) {
            size_t k = (size_t)s * mb + j;
            bt[k] = (int32_t)k;
            /* document layout: documents of doc_len tokens, each padded to a block boundary */
            int dblocks = (doc_len + bs - 1) / bs;
            int d = j / dblocks, jb = j % dblocks;
            rot[k] = d * dblocks * bs;
            val[k] = jb + 1 == dblocks && doc_len % bs ? doc_len % bs : bs;
            if (rot[k] == 0) rot[k] = 1;   /* every block pays for a rotation in the lazy run */
        }
    o->upload(be, dbt, 0, bt, nblocks);
    o->upload(be, drot, 0, rot, nblocks);
    o->upload(be, dval, 0, val, nblocks);
    struct kvs_dbuf *dwords = o->alloc(be, KVS_BUF_I32, 2 * nblocks);
    int32_t *words = kvs_xmalloc(2 * nblocks * sizeof *words);
    if (!dwords || kvs_pack_block_words(bt, rot, val, nblocks, bs, words) != 0) {
        fprintf(stderr, "attnbench: packing the block words failed\n");
        return 1;
    }
    o->upload(be, dwords, 0, words, 2 * nblocks);
    free(words);
    float *inv = kvs_xmalloc((size_t)hd / 2 * sizeof *inv);
    for (int i = 0; i < hd / 2; i++) inv[i] = powf(500000.0f, -2.0f * i / hd);
    o->upload(be, dinv, 0, inv, (size_t)hd / 2);
    free(inv);

    printf("| device | case | seqs x rows | context | ordinary ms | lazy ms (rotation + masks) | overhead |\n");
    printf("| --- | --- | --- | --- | --- | --- | --- |\n");
    for (int c = 0; c < 2; c++) {
        int decode = c == 0;
        int ns = decode ? S : 1, n = decode ? S : q_rows;
        int32_t qs[1025], pos[1024];
        if (ns > 1024) ns = n = 1024;
        for (int s = 0; s <= ns; s++) qs[s] = decode ? s : (s ? q_rows : 0);
        for (int s = 0; s < ns; s++) pos[s] = decode ? ctx + q_rows - 1 : ctx;
        o->upload(be, dqs, 0, qs, (size_t)ns + 1);
        o->upload(be, dpos, 0, pos, (size_t)ns);
        struct kvs_attn_meta m = {.n_seqs = ns, .max_blocks = mb, .q_start = dqs, .pos = dpos, .block_tables = dbt,
                                  .inv_freq = dinv, .h_q_start = qs, .h_pos = pos, .max_ctx = ctx + q_rows};
        double t_plain = time_op(o, be, reps, q, kc, vc, &m, n, nh, nkv, hd, bs, out);
        m.rot_offsets = drot;
        m.block_valid = dval;
        m.block_words = dwords; /* the packed form, as the runner passes it */
        double t_lazy = time_op(o, be, reps, q, kc, vc, &m, n, nh, nkv, hd, bs, out);
        printf("| %s | %s | %d x %d | %d | %.3f | %.3f | %+.2f%% |\n", o->name, decode ? "decode" : "suffix prefill",
               ns, decode ? 1 : q_rows, ctx + q_rows, 1e3 * t_plain, 1e3 * t_lazy, 100.0 * (t_lazy / t_plain - 1.0));
    }
    struct kvs_dbuf *bufs[] = {kc, vc, q, out, dqs, dpos, dbt, drot, dval, dinv, dwords};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) o->free_buf(be, bufs[i]);
    o->free(be);
    free(bt), free(rot), free(val);
    return 0;
}
