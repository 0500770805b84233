/* kv_lean.c: the CPU reference of LeanKV's kernels (kernels/kv_lean.h): the page writer (with the
 * format's quantizer, kernels/kv_lean_format.c), and attention over quantized pages, which dequantizes
 * each key and value on the fly and otherwise runs cpu_attn_span.c's online softmax (same
 * visiting order, same fixed-order dot product), so it equals that kernel run on the
 * dequantized tensors. Plain, readable C: the GPU kernels are tested against it. */
#include <math.h>
#include <string.h>

#include "base/util.h"
#include "kernels/cpu/cpu_internal.h"
#include "kernels/cpu/cpu_pool.h"
#include "kernels/kv_lean.h"

/* ---- page addressing ------------------------------------------------------------------------ */

static size_t code_bytes(int bits, int d) { return (size_t)d * (size_t)bits / 8; }

struct page_ref {
    uint8_t *k, *v;               /* the token's codes */
    uint8_t *ksz, *vsz;           /* its K and V (s, z) as fp16 pairs (NULL at 16 bits) */
};

/* token off of block `block`, head g: page = K codes [bs][kc], V codes [bs][vc], then K (s, z)
 * [bs][4 bytes] and V (s, z) [bs][4 bytes], each present only below 16 bits */
static struct page_ref token_ref(uint8_t *pool, struct kvs_lean_fmt f, int n_kv_heads, int hd, int bs, int block,
                                 int g, int off)
{
    const size_t kc = code_bytes(f.kbits, hd), vc = code_bytes(f.vbits, hd);
    uint8_t *page = pool + ((size_t)block * n_kv_heads + g) * kvs_lean_page_bytes(f, hd, bs);
    uint8_t *meta = page + (size_t)bs * (kc + vc);
    struct page_ref r = {page + (size_t)off * kc, page + (size_t)bs * kc + (size_t)off * vc, NULL, NULL};
    if (f.kbits < 16) r.ksz = meta + (size_t)off * 4, meta += (size_t)bs * 4;
    if (f.vbits < 16) r.vsz = meta + (size_t)off * 4;
    return r;
}

static void get_sz(const uint8_t *p, uint16_t sz[2])
{
    if (p) memcpy(sz, p, 4);
    else sz[0] = sz[1] = 0;
}

static void put_sz(uint8_t *p, const uint16_t sz[2])
{
    if (p) memcpy(p, sz, 4);
}

/* ---- write ---------------------------------------------------------------------------------- */

struct write_job {
    struct kvs_lean_fmt f;
    const float *k, *v;
    const int32_t *slots;
    uint8_t *pool;
    int n_kv_heads, head_dim, block_size;
};

static void write_task(void *c, int task)
{
    const struct write_job *j = c;
    const int t = task / j->n_kv_heads, g = task % j->n_kv_heads, hd = j->head_dim;
    const int32_t slot = j->slots[t];
    if (slot < 0) return;
    struct page_ref r = token_ref(j->pool, j->f, j->n_kv_heads, hd, j->block_size, slot / j->block_size, g,
                                  slot % j->block_size);
    const size_t row = ((size_t)t * j->n_kv_heads + g) * hd;
    uint16_t sz[2];
    kvs_lean_quantize(j->k + row, hd, j->f.kbits, r.k, sz);
    put_sz(r.ksz, sz);
    kvs_lean_quantize(j->v + row, hd, j->f.vbits, r.v, sz);
    put_sz(r.vsz, sz);
}

static void cpu_lean_write(struct kvs_backend *b, struct kvs_lean_fmt f, const struct kvs_dbuf *k,
                           const struct kvs_dbuf *v, const struct kvs_dbuf *slots, int n, int n_kv_heads, int head_dim,
                           int block_size, struct kvs_dbuf *pool)
{
    struct write_job j = {f, F(k), F(v), I(slots), pool->data, n_kv_heads, head_dim, block_size};
    kvs_cpu_pool_run(b->pool, n * n_kv_heads, write_task, &j);
}

/* ---- attention ------------------------------------------------------------------------------ */

struct attn_job {
    struct kvs_lean_fmt f;
    const float *q, *inv_freq;
    uint8_t *pool;
    float *out, *lse;             /* lse may be NULL (attention()) */
    const int32_t *q_start, *pos, *bt, *rot, *valid, *n_spans, *spans; /* spans NULL: [0, ctx) */
    int max_blocks, max_spans, n_heads, n_kv_heads, head_dim, block_size;
    float scale;
};

static void attn_task(void *c, int task)
{
    const struct attn_job *j = c;
    const int t = task / j->n_heads, h = task % j->n_heads;
    const int hd = j->head_dim, bs = j->block_size;
    int s = 0;
    while (j->q_start[s + 1] <= t) s++;
    const int ctx = j->pos[s] + (t - j->q_start[s]) + 1;   /* causal: positions < ctx */
    const int g = h / (j->n_heads / j->n_kv_heads);
    const float *q0 = j->q + ((size_t)t * j->n_heads + h) * hd;
    const int32_t *bt = j->bt + (size_t)s * j->max_blocks;
    const int32_t *rot = j->rot ? j->rot + (size_t)s * j->max_blocks : NULL;
    const int32_t *valid = j->valid ? j->valid + (size_t)s * j->max_blocks : NULL;
    int32_t whole[2] = {0, ctx};
    int ns = 1;
    const int32_t *sp = whole;
    if (j->spans) {
        const size_t sl = (size_t)t * j->n_kv_heads + g;
        ns = j->n_spans[sl];
        sp = j->spans + sl * j->max_spans * 2;
    }
    float qr[MAX_HEAD_DIM], acc[MAX_HEAD_DIM], kx[MAX_HEAD_DIM], vx[MAX_HEAD_DIM];
    const float *q = q0;
    int cur_rot = 0;
    for (int i = 0; i < hd; i++) acc[i] = 0.0f;
    float mx = -INFINITY, l = 0.0f;
    for (int k = 0; k < ns; k++) {
        const int p1 = sp[2 * k + 1] < ctx ? sp[2 * k + 1] : ctx;
        for (int p = sp[2 * k] > 0 ? sp[2 * k] : 0; p < p1; p++) {
            const int bi = p / bs, off = p % bs;
            if (valid && off >= valid[bi]) {
                p += bs - off - 1;   /* the rest of this block is padding */
                continue;
            }
            const int r = rot ? rot[bi] : 0;
            if (r != cur_rot) {
                cur_rot = r;
                if (r) kvs_cpu_rotate_back(q0, j->inv_freq, r, hd, qr);
                q = r ? qr : q0;
            }
            struct page_ref pr = token_ref(j->pool, j->f, j->n_kv_heads, hd, bs, bt[bi], g, off);
            uint16_t sz[2];
            get_sz(pr.ksz, sz);
            kvs_lean_dequantize(pr.k, sz, hd, j->f.kbits, kx);
            const float sc = dot_f32(q, kx, hd) * j->scale;
            get_sz(pr.vsz, sz);
            kvs_lean_dequantize(pr.v, sz, hd, j->f.vbits, vx);
            if (sc > mx) {
                const float corr = expf(mx - sc);   /* exp(-inf) = 0 on the first position */
                l *= corr;
                for (int i = 0; i < hd; i++) acc[i] *= corr;
                mx = sc;
            }
            const float w = expf(sc - mx);
            l += w;
            for (int i = 0; i < hd; i++) acc[i] += w * vx[i];
        }
    }
    float *o = j->out + ((size_t)t * j->n_heads + h) * hd;
    if (l == 0.0f) {   /* no key selected */
        for (int i = 0; i < hd; i++) o[i] = 0.0f;
        if (j->lse) j->lse[(size_t)t * j->n_heads + h] = -INFINITY;
        return;
    }
    const float inv = 1.0f / l;
    for (int i = 0; i < hd; i++) o[i] = acc[i] * inv;
    if (j->lse) j->lse[(size_t)t * j->n_heads + h] = mx + logf(l);
}

static void run_attention(struct kvs_backend *b, struct kvs_lean_fmt f, const struct kvs_dbuf *q,
                          const struct kvs_dbuf *pool, const struct kvs_attn_meta *m, const struct kvs_span_list *sp,
                          int n, int n_heads, int n_kv_heads, int head_dim, int block_size, float scale,
                          struct kvs_dbuf *out, struct kvs_dbuf *lse)
{
    KVS_ASSERT(head_dim <= MAX_HEAD_DIM && n_kv_heads > 0 && n_heads % n_kv_heads == 0);
    KVS_ASSERT(!m->rot_offsets || m->inv_freq);
    struct attn_job j = {
        .f = f, .q = F(q), .inv_freq = m->inv_freq ? F(m->inv_freq) : NULL, .pool = pool->data,
        .out = F(out), .lse = lse ? F(lse) : NULL,
        .q_start = I(m->q_start), .pos = I(m->pos), .bt = I(m->block_tables),
        .rot = m->rot_offsets ? I(m->rot_offsets) : NULL, .valid = m->block_valid ? I(m->block_valid) : NULL,
        .n_spans = sp ? I(sp->n_spans) : NULL, .spans = sp ? I(sp->spans) : NULL,
        .max_blocks = m->max_blocks, .max_spans = sp ? sp->max_spans : 0, .n_heads = n_heads,
        .n_kv_heads = n_kv_heads, .head_dim = head_dim, .block_size = block_size, .scale = scale,
    };
    KVS_ASSERT(j.q_start[0] == 0 && j.q_start[m->n_seqs] == n);
    kvs_cpu_pool_run(b->pool, n * n_heads, attn_task, &j);
}

static void cpu_lean_attention_spans(struct kvs_backend *b, struct kvs_lean_fmt f, const struct kvs_dbuf *q,
                                     const struct kvs_dbuf *pool, const struct kvs_attn_meta *m,
                                     const struct kvs_span_list *sp, int n, int n_heads, int n_kv_heads, int head_dim,
                                     int block_size, float scale, struct kvs_dbuf *out, struct kvs_dbuf *lse)
{
    run_attention(b, f, q, pool, m, sp, n, n_heads, n_kv_heads, head_dim, block_size, scale, out, lse);
}

static void cpu_lean_attention(struct kvs_backend *b, struct kvs_lean_fmt f, const struct kvs_dbuf *q,
                               const struct kvs_dbuf *pool, const struct kvs_attn_meta *m, int n, int n_heads,
                               int n_kv_heads, int head_dim, int block_size, float scale, struct kvs_dbuf *out)
{
    run_attention(b, f, q, pool, m, NULL, n, n_heads, n_kv_heads, head_dim, block_size, scale, out, NULL);
}

/* ---- pages ---------------------------------------------------------------------------------- */

static struct kvs_dbuf *cpu_lean_alloc_pages(struct kvs_backend *b, size_t n)
{
    /* an I32 buffer holds the bytes: the CPU backend's buffers are plain aligned memory */
    return kvs_cpu_backend.alloc(b, KVS_BUF_I32, (n + 3) / 4);
}

static void cpu_lean_copy_block(struct kvs_backend *b, struct kvs_dbuf *pool, int src, int dst, size_t block_bytes)
{
    (void)b;
    uint8_t *p = pool->data;
    if (src != dst) memcpy(p + (size_t)dst * block_bytes, p + (size_t)src * block_bytes, block_bytes);
}

static int cpu_lean_supports(struct kvs_lean_fmt f, int n_heads, int n_kv_heads, int head_dim)
{
    (void)f;
    return n_kv_heads > 0 && n_heads % n_kv_heads == 0 && head_dim % 4 == 0 && head_dim <= MAX_HEAD_DIM;
}

const struct kvs_lean_kernels kvs_lean_kernels_cpu = {
    .alloc_pages = cpu_lean_alloc_pages,
    .write = cpu_lean_write,
    .attention_spans = cpu_lean_attention_spans,
    .attention = cpu_lean_attention,
    .copy_block = cpu_lean_copy_block,
    .supports = cpu_lean_supports,
};
