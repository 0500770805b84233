/* kvserve_macbench_main.c: kvserve-macbench: the attention phase of MAC-Attention (kv.decode=mac,
 * kernels/kv_mac.h: ring match + band/tail attention + merges) against the backend's full
 * attention op on the same KV, one layer, decode rows (one per sequence), as a ratio measured
 * in the same run. Shapes default to Llama-3.1-8B (32 q heads, 8 KV heads, head_dim 128,
 * block 16), ring K = 1024, band r = 256.
 *
 * Workloads, with the hit rate pinned (a synthetic query stream, as in the paper's Fig. 6
 * setting of 99% skip): every ring entry holds a valid older position and a random query,
 * except one entry per (sequence, head) that equals the row's query exactly, so the match scans
 * all K entries and hits that entry on every head. Its position is chosen so that the row reads
 * --read-frac of its context (default 0.01, i.e. 99% skip; at least r + 1 positions, at most
 * what the ring can reach); "miss" runs the same kernels with every lookup missing (full
 * attention through MAC's own span kernel).
 *
 * --lean FMT (K8V4, K8V8, K4V4, K16V16): the pool is stored as LeanKV pages of that format
 * (kv.storage = lean, written by the backend's LeanKV writer from the same random K/V), MAC's
 * kernels dequantize them on read, and "full" is LeanKV's own attention over the pages.
 *
 *   build/kvserve-macbench --device cpu --ctx 4096 --batch 2
 *   build/kvserve-macbench --device cuda            (the table: 32K/64K/128K x batch 1/8/32, 256K x 1)
 *   build/kvserve-macbench --device cuda --lean K8V4
 */
#include "base/util.h"
#include "kernels/backend.h"
#include "kernels/kv_lean.h"
#include "kernels/kv_mac.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(KVS_HAVE_CUDA) && KVS_HAVE_CUDA && defined(__has_include)
#if __has_include("kernels/cuda/cuda_backend.h")
#include "kernels/cuda/cuda_backend.h"
#define MACBENCH_HAS_CUDA 1
#endif
#endif

struct bench {
    const struct kvs_backend_ops *o;
    struct kvs_backend *be;
    const struct kvs_mac_kernels *k;
    int nh, nkv, hd, bs, K, band, reps;
    struct kvs_dbuf *kc, *vc;     /* pool for max_tokens */
    size_t pool_blocks;
    struct kvs_lean_fmt lean;     /* kbits 0: the plain pool */
    const struct kvs_lean_kernels *kn;
    struct kvs_dbuf *pages;       /* the pool as LeanKV pages (--lean) */
};

static uint64_t rng = 88172645463325252ull;
static float frand(void)
{
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (float)((double)(rng >> 11) / (double)(1ull << 53)) * 2.0f - 1.0f;
}

static void fill(struct bench *b, struct kvs_dbuf *buf, size_t n, float scale)
{
#ifdef MACBENCH_HAS_CUDA
    if (b->o == &kvs_cuda_backend) {
        kvs_cuda_fill_random(b->be, buf, 0, n, scale, rng++);
        return;
    }
#endif
    float *h = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) h[i] = scale * frand();
    b->o->upload(b->be, buf, 0, h, n);
    free(h);
}

/* --lean: the pool's K/V (block j's slot i is token j bs + i) written as LeanKV pages, in chunks
 * through f32 staging buffers; 0, or -1 + message */
static int make_pages(struct bench *b, char *err, size_t errlen)
{
    const struct kvs_backend_ops *o = b->o;
    const int nkv = b->nkv, hd = b->hd, bs = b->bs;
    err[0] = 0;
    if (!(b->kn = kvs_lean_kernels_for(o, err, errlen))) return -1;
    if (!b->kn->supports(b->lean, b->nh, nkv, hd) ||
        b->k->supports_lean(b->lean, b->nh, nkv, hd, bs, err, errlen)) {
        if (!*err) snprintf(err, errlen, "LeanKV K%dV%d not supported for this shape", b->lean.kbits, b->lean.vbits);
        return -1;
    }
    const size_t n_tok = b->pool_blocks * bs, row = (size_t)nkv * hd, chunk = 16384;
    b->pages = b->kn->alloc_pages(b->be, b->pool_blocks * nkv * kvs_lean_page_bytes(b->lean, hd, bs));
    struct kvs_dbuf *k = o->alloc(b->be, KVS_BUF_ACT, chunk * row), *v = o->alloc(b->be, KVS_BUF_ACT, chunk * row);
    struct kvs_dbuf *sl = o->alloc(b->be, KVS_BUF_I32, chunk);
    int32_t *hs = malloc(chunk * sizeof(int32_t));
    if (!b->pages || !k || !v || !sl || !hs) {
        snprintf(err, errlen, "no memory for the LeanKV pages");
        return -1;
    }
    for (size_t t0 = 0; t0 < n_tok; t0 += chunk) {
        const size_t n = n_tok - t0 < chunk ? n_tok - t0 : chunk;
        for (size_t i = 0; i < n; i++) hs[i] = (int32_t)(t0 + i);
        o->upload(b->be, sl, 0, hs, n);
        fill(b, k, n * row, 1.0f);
        fill(b, v, n * row, 1.0f);
        b->kn->write(b->be, b->lean, k, v, sl, (int)n, nkv, hd, bs, b->pages);
    }
    o->sync(b->be);
    o->free_buf(b->be, k), o->free_buf(b->be, v), o->free_buf(b->be, sl);
    free(hs);
    return 0;
}

/* mean seconds per call of fn over reps calls (after one warm-up), the backend synced */
#define TIME(b, out, stmt)                                                                                           \
    do {                                                                                                             \
        stmt;                                                                                                        \
        (b)->o->sync((b)->be);                                                                                       \
        double t0_ = kvs_now();                                                                                      \
        for (int r_ = 0; r_ < (b)->reps; r_++) { stmt; }                                                             \
        (b)->o->sync((b)->be);                                                                                       \
        (out) = (kvs_now() - t0_) / (b)->reps;                                                                       \
    } while (0)

static int run_case(struct bench *b, int ctx, int batch, double read_frac)
{
    const struct kvs_backend_ops *o = b->o;
    struct kvs_backend *be = b->be;
    const int nh = b->nh, nkv = b->nkv, hd = b->hd, bs = b->bs, K = b->K;
    const int mb = (ctx + bs - 1) / bs;
    if ((size_t)mb * batch > b->pool_blocks) return -1;
    const size_t qd = (size_t)nh * hd, ent = (size_t)batch * K;
    int32_t *bt = malloc((size_t)batch * mb * 4), *qs = malloc((size_t)(batch + 1) * 4), *pos = malloc((size_t)batch * 4);
    int32_t *rows = malloc((size_t)batch * 16), *tags = malloc(ent * 4);
    for (int s = 0; s < batch; s++) {
        for (int j = 0; j < mb; j++) bt[(size_t)s * mb + j] = s * mb + j;
        qs[s] = s, pos[s] = ctx - 1;
        rows[s * 4] = s, rows[s * 4 + 1] = s, rows[s * 4 + 2] = ctx - 1;
        rows[s * 4 + 3] = KVS_MAC_F_MAC | KVS_MAC_F_MATCH;
    }
    qs[batch] = batch;
    const int m = ctx - 1;
    /* the hit position: reads read_frac of the context, within what the ring reaches */
    int read = (int)(read_frac * ctx);
    if (read < b->band + 1) read = b->band + 1;
    int p_hit = m + b->band - read;
    if (p_hit < m - K) p_hit = m - K;
    if (p_hit < 0) p_hit = 0;
    for (int s = 0; s < batch; s++)
        for (int j = 0; j < K; j++) {
            int pj = m - 1 - ((m - 1 - j) % K + K) % K;   /* the position in [m - K, m - 1] with pj mod K == j */
            tags[(size_t)s * K + j] = pj >= 0 ? pj + 1 : 0;
        }
    struct kvs_dbuf *d_bt = o->alloc(be, KVS_BUF_I32, (size_t)batch * mb), *d_qs = o->alloc(be, KVS_BUF_I32, batch + 1);
    struct kvs_dbuf *d_pos = o->alloc(be, KVS_BUF_I32, batch), *d_rows = o->alloc(be, KVS_BUF_I32, (size_t)batch * 4);
    struct kvs_dbuf *d_p = o->alloc(be, KVS_BUF_I32, (size_t)batch * nh), *d_tags = o->alloc(be, KVS_BUF_I32, ent);
    struct kvs_dbuf *q = o->alloc(be, KVS_BUF_ACT, batch * qd), *out = o->alloc(be, KVS_BUF_ACT, batch * qd);
    struct kvs_dbuf *lse = o->alloc(be, KVS_BUF_F32, (size_t)batch * nh);
    struct kvs_dbuf *rq = o->alloc(be, KVS_BUF_KV, ent * qd), *ro = o->alloc(be, KVS_BUF_KV, ent * qd);
    struct kvs_dbuf *rl = o->alloc(be, KVS_BUF_F32, ent * nh);
    const size_t work_n = b->k->work_elems(batch, nh, hd);
    struct kvs_dbuf *work = work_n ? o->alloc(be, KVS_BUF_F32, work_n) : NULL;
    if (!d_bt || !d_qs || !d_pos || !d_rows || !d_p || !d_tags || !q || !out || !lse || !rq || !ro || !rl ||
        (work_n && !work)) {
        fprintf(stderr, "macbench: out of memory at ctx %d batch %d\n", ctx, batch);
        exit(1);
    }
    o->upload(be, d_bt, 0, bt, (size_t)batch * mb);
    o->upload(be, d_qs, 0, qs, (size_t)batch + 1);
    o->upload(be, d_pos, 0, pos, (size_t)batch);
    o->upload(be, d_rows, 0, rows, (size_t)batch * 4);
    o->upload(be, d_tags, 0, tags, ent);
    fill(b, q, batch * qd, 1.0f);
    fill(b, rq, ent * qd, 4.0f);   /* far from every query: misses */
    fill(b, ro, ent * qd, 1.0f);
    fill(b, rl, ent * nh, 1.0f);
    /* the hit entry: the row's own query (rounded as the ring stores it) */
    float *hq = malloc(qd * sizeof(float));
    for (int s = 0; s < batch; s++) {
        o->download(be, hq, q, (size_t)s * qd, qd);
        o->upload(be, rq, ((size_t)s * K + (size_t)(p_hit % K)) * qd, hq, qd);
    }
    free(hq);
    struct kvs_attn_meta meta = {
        .n_seqs = batch, .max_blocks = mb, .q_start = d_qs, .pos = d_pos, .block_tables = d_bt, .h_q_start = qs,
        .h_pos = pos, .max_ctx = ctx,
    };
    const float scale = 1.0f / sqrtf((float)hd);
    struct kvs_mac_call c = {
        .layer = 0, .n_layers = 1, .K = K, .band = b->band, .n = batch, .n_heads = nh, .n_kv_heads = nkv,
        .head_dim = hd, .block_size = bs, .scale = scale, .thresh2 = 2.0f * hd * 0.55f * 0.55f, .q = q, .q_pre = q,
        .kc = b->kc, .vc = b->vc, .m = &meta, .rows = d_rows, .p = d_p, .p_off = 0, .ring_q = rq, .ring_o = ro,
        .ring_lse = rl, .ring_tag = d_tags, .out = out, .lse = lse, .work = work, .work_n = work_n,
    };
    double t_full, t_hit, t_match, t_miss;
    if (b->pages) {
        c.lean = b->lean, c.pages = b->pages;
        TIME(b, t_full, b->kn->attention(be, b->lean, q, b->pages, &meta, batch, nh, nkv, hd, bs, scale, out));
    } else {
        TIME(b, t_full, o->attention(be, q, b->kc, b->vc, &meta, batch, nh, nkv, hd, bs, scale, out));
    }
    /* appends are off (F_APPEND unset): every repetition sees the same ring */
    TIME(b, t_hit, (b->k->match(be, &c), b->k->attend(be, &c)));
    TIME(b, t_match, b->k->match(be, &c));
    int32_t *hp = malloc((size_t)batch * nh * 4);
    o->download(be, hp, d_p, 0, (size_t)batch * nh);
    int hits = 0;
    for (int i = 0; i < batch * nh; i++) hits += hp[i] == p_hit;
    c.thresh2 = 0.0f;   /* nothing is below 0: every lookup misses */
    TIME(b, t_miss, (b->k->match(be, &c), b->k->attend(be, &c)));
    const int s0 = p_hit - b->band + 1 > 0 ? p_hit - b->band + 1 : 0;
    printf("| %7d | %5d | %9.1f | %9.1f | %7.1f | %6.2fx | %5.1f%% | %5.1f%% | %9.1f | %5.2fx |\n", ctx, batch,
           t_full * 1e6, t_hit * 1e6, t_match * 1e6, t_full / t_hit, 100.0 * hits / (batch * nh),
           100.0 * (double)s0 / ctx, t_miss * 1e6, t_full / t_miss);
    fflush(stdout);
    free(hp), free(bt), free(qs), free(pos), free(rows), free(tags);
    struct kvs_dbuf *bs_[] = {d_bt, d_qs, d_pos, d_rows, d_p, d_tags, q, out, lse, rq, ro, rl, work};
    for (size_t i = 0; i < sizeof bs_ / sizeof bs_[0]; i++) o->free_buf(be, bs_[i]);
    return 0;
}

int main(int argc, char **argv)
{
    const char *device = "cuda";
    int ctx = 0, batch = 0;
    double read_frac = 0.01;
    struct bench b = {.nh = 32, .nkv = 8, .hd = 128, .bs = 16, .K = 1024, .band = 256, .reps = 20};
    for (int i = 1; i + 1 < argc; i += 2) {
        const char *a = argv[i], *v = argv[i + 1];
        if (!strcmp(a, "--device")) device = v;
        else if (!strcmp(a, "--ctx")) ctx = atoi(v);
        else if (!strcmp(a, "--batch")) batch = atoi(v);
        else if (!strcmp(a, "--heads")) b.nh = atoi(v);
        else if (!strcmp(a, "--kv-heads")) b.nkv = atoi(v);
        else if (!strcmp(a, "--head-dim")) b.hd = atoi(v);
        else if (!strcmp(a, "--ring")) b.K = atoi(v);
        else if (!strcmp(a, "--band")) b.band = atoi(v);
        else if (!strcmp(a, "--read-frac")) read_frac = atof(v);
        else if (!strcmp(a, "--reps")) b.reps = atoi(v);
        else if (!strcmp(a, "--lean")) {
            if (kvs_lean_fmt_parse(v, &b.lean) < 0) {
                fprintf(stderr, "macbench: --lean %s is not a LeanKV format\n", v);
                return 2;
            }
        } else {
            fprintf(stderr, "usage: %s [--device cpu|cuda] [--ctx N --batch B] [--ring K] [--band r] [--read-frac f] "
                    "[--heads H --kv-heads G --head-dim D] [--reps R] [--lean K8V4]\n", argv[0]);
            return 2;
        }
    }
    char err[256];
    b.o = kvs_backend_pick(device, err, sizeof err);
    if (!b.o || !(b.be = b.o->create(0, err, sizeof err))) {
        fprintf(stderr, "macbench: %s\n", err);
        return 1;
    }
    if (!(b.k = kvs_mac_kernels_for(b.o, err, sizeof err)) || b.k->supports(b.nh, b.nkv, b.hd, err, sizeof err)) {
        fprintf(stderr, "macbench: %s\n", err);
        return 1;
    }
    static const int def_ctx[] = {32768, 65536, 131072, 262144}, def_batch[] = {1, 8, 32};
    size_t max_tokens = 0;
    if (ctx > 0) max_tokens = (size_t)ctx * (batch > 0 ? batch : 1);
    else max_tokens = (size_t)131072 * 32;
    b.pool_blocks = (max_tokens + b.bs - 1) / b.bs;
    const size_t pool = b.pool_blocks * b.nkv * b.bs * b.hd;
    b.kc = b.o->alloc(b.be, KVS_BUF_KV, pool);
    b.vc = b.o->alloc(b.be, KVS_BUF_KV, pool);
    if (!b.kc || !b.vc) {
        fprintf(stderr, "macbench: no memory for a pool of %zu tokens\n", max_tokens);
        return 1;
    }
    fill(&b, b.kc, pool, 1.0f);
    fill(&b, b.vc, pool, 1.0f);
    if (b.lean.kbits && make_pages(&b, err, sizeof err)) {
        fprintf(stderr, "macbench: %s\n", err);
        return 1;
    }
    char desc[160] = "cpu";
#ifdef MACBENCH_HAS_CUDA
    if (b.o == &kvs_cuda_backend) kvs_cuda_device_desc(b.be, desc, sizeof desc);
#endif
    printf("kvserve-macbench on %s: heads %d/%d, head_dim %d, block %d, ring K %d, band r %d, hits read %.1f%% of the "
           "context; mean of %d calls (one layer, decode rows)", desc, b.nh, b.nkv, b.hd, b.bs, b.K, b.band,
           100.0 * read_frac, b.reps);
    if (b.pages) printf("; KV as LeanKV K%dV%d pages (full = LeanKV's own attention)", b.lean.kbits, b.lean.vbits);
    printf("\n\n");
    printf("| context | batch | full (us) | MAC hit (us) | match (us) | speed-up | hits | skip | MAC miss (us) | miss ratio |\n");
    printf("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    if (ctx > 0) {
        run_case(&b, ctx, batch > 0 ? batch : 1, read_frac);
    } else {
        for (int i = 0; i < 3; i++)
            for (int j = 0; j < 3; j++) run_case(&b, def_ctx[i], def_batch[j], read_frac);
        run_case(&b, def_ctx[3], 1, read_frac);
    }
    b.o->free_buf(b.be, b.kc);
    b.o->free_buf(b.be, b.vc);
    b.o->free_buf(b.be, b.pages);
    b.o->free(b.be);
    return 0;
}
