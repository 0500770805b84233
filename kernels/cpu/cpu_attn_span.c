/* cpu_attn_span.c: the CPU reference of the two KV-strategy primitives of kernels/backend.h:
 * attention over explicit token spans returning the output and its log-sum-exp, and the merge
 * of two (o, lse) partials. Sparse and reuse decode policies (engine/kv/) are built from them.
 *
 * With the reference kernels the online softmax visits the selected positions in increasing
 * order with the reference attention's arithmetic (cpu_attention.c); with the AVX2 / FMA sets
 * it runs the key-tiled steps of cpu_attn_tile.h over the selected positions. Either way one
 * span [0, ctx) gives attention()'s bits exactly: the neutral-setting tests of every policy
 * compare bitwise on this backend.
 */
#include <math.h>

#include "base/util.h"
#include "kernels/cpu/cpu_internal.h"
#include "kernels/cpu/cpu_pool.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include "kernels/cpu/cpu_attn_tile.h"
#define KVS_CPU_X86 1
#else
#define KVS_CPU_X86 0
#endif

struct span_job {
    const float *q, *kc, *vc, *inv_freq;
    float *out, *lse;
    const int32_t *q_start, *pos, *bt, *rot, *valid, *n_spans, *spans;
    int max_blocks, max_spans, n_heads, n_kv_heads, head_dim, block_size;
    float scale;
    int fm;                       /* key-tiled kernel: FMA set */
};

static void span_task(void *c, int task)
{
    const struct span_job *j = c;
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
    const size_t sl = (size_t)t * j->n_kv_heads + g;
    const int ns = j->n_spans[sl];
    const int32_t *sp = j->spans + sl * j->max_spans * 2;
    float qr[MAX_HEAD_DIM], acc[MAX_HEAD_DIM];
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
            const size_t base = (((size_t)bt[bi] * j->n_kv_heads + g) * bs + off) * hd;
            const float sc = dot_f32(q, j->kc + base, hd) * j->scale;
            const float *v = j->vc + base;
            if (sc > mx) {
                const float corr = expf(mx - sc);   /* exp(-inf) = 0 on the first position */
                l *= corr;
                for (int i = 0; i < hd; i++) acc[i] *= corr;
                mx = sc;
            }
            const float w = expf(sc - mx);
            l += w;
            for (int i = 0; i < hd; i++) acc[i] += w * v[i];
        }
    }
    float *o = j->out + ((size_t)t * j->n_heads + h) * hd;
    if (l == 0.0f) {   /* no key selected */
        for (int i = 0; i < hd; i++) o[i] = 0.0f;
        j->lse[(size_t)t * j->n_heads + h] = -INFINITY;
        return;
    }
    const float inv = 1.0f / l;
    for (int i = 0; i < hd; i++) o[i] = acc[i] * inv;
    j->lse[(size_t)t * j->n_heads + h] = mx + logf(l);
}

#if KVS_CPU_X86
/* the key-tiled kernel: the key tiles of attention() that hold selected positions, each key
 * outside the spans scored -inf (skipped) */
ATT_AVX2 ATT_INLINE void span_tiled(const struct span_job *j, int task, const int fm)
{
    const int t = task / j->n_heads, h = task % j->n_heads;
    const int hd = j->head_dim, bs = j->block_size;
    int s = 0;
    while (j->q_start[s + 1] <= t) s++;
    const int ctx = j->pos[s] + (t - j->q_start[s]) + 1;
    const int g = h / (j->n_heads / j->n_kv_heads);
    const int32_t *bt = j->bt + (size_t)s * j->max_blocks;
    const int32_t *rot = j->rot ? j->rot + (size_t)s * j->max_blocks : NULL;
    const int32_t *valid = j->valid ? j->valid + (size_t)s * j->max_blocks : NULL;
    const size_t sl = (size_t)t * j->n_kv_heads + g;
    const int ns = j->n_spans[sl];
    const int32_t *sp = j->spans + sl * j->max_spans * 2;
    float qr[MAX_HEAD_DIM], acc[MAX_HEAD_DIM], sc[KT];
    unsigned char sel[KT];
    struct kt_pair pr;
    struct kt_keys keys;
    kt_pair_init(&pr, j->q + ((size_t)t * j->n_heads + h) * hd, qr, acc, hd);
    int k = 0;   /* the first span that may reach the current tile */
    for (int p0 = ns > 0 && sp[0] > 0 ? sp[0] / KT * KT : 0; p0 < ctx && k < ns; p0 += KT) {
        while (k < ns && sp[2 * k + 1] <= p0) k++;
        if (k == ns) break;
        if (sp[2 * k] >= p0 + KT) {   /* jump to the next span's tile */
            p0 = sp[2 * k] / KT * KT - KT;
            continue;
        }
        const int nk = ctx - p0 < KT ? ctx - p0 : KT;
        int any = 0;
        for (int i = 0, kk = k; i < nk; i++) {
            const int p = p0 + i;
            while (kk < ns && sp[2 * kk + 1] <= p) kk++;
            sel[i] = kk < ns && sp[2 * kk] <= p;
            any |= sel[i];
        }
        if (!any) continue;
        kt_fill(&keys, j->kc, j->vc, bt, rot, valid, j->n_kv_heads, g, bs, hd, p0, nk);
        kt_scores(&pr, &keys, nk, sel, j->inv_freq, hd, j->scale, sc, fm);
        kt_update(&pr, &keys, sc, hd, fm);
    }
    float *o = j->out + ((size_t)t * j->n_heads + h) * hd;
    if (pr.l == 0.0f) {   /* no key selected */
        for (int i = 0; i < hd; i++) o[i] = 0.0f;
        j->lse[(size_t)t * j->n_heads + h] = -INFINITY;
        return;
    }
    const float inv = 1.0f / pr.l;
    for (int i = 0; i < hd; i++) o[i] = acc[i] * inv;
    j->lse[(size_t)t * j->n_heads + h] = pr.mx + logf(pr.l);
}

ATT_AVX2 static void span_avx2_task(void *c, int task) { span_tiled(c, task, 0); }
ATT_AVX2 static void span_fma_task(void *c, int task) { span_tiled(c, task, 1); }
#endif

void kvs_cpu_attention_spans(struct kvs_backend *b, const struct kvs_dbuf *q, const struct kvs_dbuf *kc,
                             const struct kvs_dbuf *vc, const struct kvs_attn_meta *m, const struct kvs_span_list *sp,
                             int n, int n_heads, int n_kv_heads, int head_dim, int block_size, float scale,
                             struct kvs_dbuf *out, struct kvs_dbuf *lse)
{
    KVS_ASSERT(head_dim <= MAX_HEAD_DIM && n_kv_heads > 0 && n_heads % n_kv_heads == 0);
    KVS_ASSERT(!m->rot_offsets || m->inv_freq);
    struct span_job j = {
        .q = F(q), .kc = F(kc), .vc = F(vc), .inv_freq = m->inv_freq ? F(m->inv_freq) : NULL,
        .out = F(out), .lse = F(lse),
        .q_start = I(m->q_start), .pos = I(m->pos), .bt = I(m->block_tables),
        .rot = m->rot_offsets ? I(m->rot_offsets) : NULL, .valid = m->block_valid ? I(m->block_valid) : NULL,
        .n_spans = I(sp->n_spans), .spans = I(sp->spans),
        .max_blocks = m->max_blocks, .max_spans = sp->max_spans, .n_heads = n_heads, .n_kv_heads = n_kv_heads,
        .head_dim = head_dim, .block_size = block_size, .scale = scale,
    };
    KVS_ASSERT(j.q_start[0] == 0 && j.q_start[m->n_seqs] == n);
#if KVS_CPU_X86
    if (b->kern.isa != KVS_CPU_ISA_REF) {
        kvs_cpu_pool_run(b->pool, n * n_heads, b->kern.isa >= KVS_CPU_ISA_FMA ? span_fma_task : span_avx2_task, &j);
        return;
    }
#endif
    kvs_cpu_pool_run(b->pool, n * n_heads, span_task, &j);
}

struct merge_job {
    float *oa, *la;
    const float *ob, *lb;
    int head_dim;
};

static void merge_task(void *c, int task)
{
    const struct merge_job *j = c;
    const float la = j->la[task], lb = j->lb[task];
    float *oa = j->oa + (size_t)task * j->head_dim;
    const float *ob = j->ob + (size_t)task * j->head_dim;
    if (la == -INFINITY && lb == -INFINITY) {
        for (int i = 0; i < j->head_dim; i++) oa[i] = 0.0f;
        return;
    }
    const float mx = la > lb ? la : lb;
    const float ea = expf(la - mx), eb = expf(lb - mx), inv = 1.0f / (ea + eb);
    const float wa = ea * inv, wb = eb * inv;
    for (int i = 0; i < j->head_dim; i++) oa[i] = wa * oa[i] + wb * ob[i];
    j->la[task] = mx + logf(ea + eb);
}

void kvs_cpu_attn_merge(struct kvs_backend *b, struct kvs_dbuf *o_a, struct kvs_dbuf *lse_a, const struct kvs_dbuf *o_b,
                        const struct kvs_dbuf *lse_b, int n, int n_heads, int head_dim)
{
    struct merge_job j = {F(o_a), F(lse_a), F(o_b), F(lse_b), head_dim};
    kvs_cpu_pool_run(b->pool, n * n_heads, merge_task, &j);
}
