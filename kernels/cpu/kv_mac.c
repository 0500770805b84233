/* kv_mac.c: the CPU reference of MAC-Attention's kernels (kernels/kv_mac.h): the ring match and
 * the amend + complete + rectify-append attention, in plain fp32 C. The span attention follows
 * cpu_attn_span.c (online softmax over positions in increasing order, deferred-RoPE blocks,
 * padding slots skipped), so one span [0, m] gives attention_spans' result. Over LeanKV pages
 * (kv.storage = lean, a static mode) each key and value is dequantized on read with the format's
 * host dequantizer (kernels/kv_lean_format.c), in kernels/cpu/kv_lean.c's order: the same fp32
 * operands, so the same arithmetic follows; over the plain pool nothing changes.
 */
#include <errno.h>
#include <math.h>
#include <string.h>

#include "base/util.h"
#include "kernels/cpu/cpu_internal.h"
#include "kernels/cpu/cpu_pool.h"
#include "kernels/kv_mac.h"

/* cpu_backend.c's kvs_cpu_rotate_back, the same arithmetic: a copy, so that the registry's
 * reference to this table (kv.c -> kv_decode_mac.c) does not link the whole CPU backend into
 * programs that never run a model (build/kvserve-fake). */
static void rotate_back(const float *q, const float *inv_freq, int off, int head_dim, float *out)
{
    const int half = head_dim / 2;
    for (int i = 0; i < half; i++) {
        const float a = (float)off * inv_freq[i];
        const float c = cosf(a), s = sinf(a);
        out[i] = q[i] * c + q[i + half] * s;
        out[i + half] = -q[i] * s + q[i + half] * c;
    }
}

/* ring element offsets: entry j of (slot, layer) */
static size_t ring_entry(const struct kvs_mac_call *c, int slot, int j)
{
    return ((size_t)slot * c->n_layers + c->layer) * c->K + j;
}

static void match_task(void *arg, int task)
{
    const struct kvs_mac_call *c = arg;
    const int t = task / c->n_heads, h = task % c->n_heads, d = c->head_dim;
    const int32_t *row = I(c->rows) + (size_t)t * 4;
    int32_t *p = I(c->p) + c->p_off + (size_t)t * c->n_heads + h;
    *p = -1;
    if (!(row[3] & KVS_MAC_F_MATCH) || row[1] < 0) return;
    const int m = row[2];
    const float *q = F(c->q_pre) + ((size_t)t * c->n_heads + h) * d;
    const int32_t *tag = I(c->ring_tag) + ring_entry(c, row[1], 0);
    float best = INFINITY;
    int best_pos = -1;
    for (int j = 0; j < c->K; j++) {
        if (tag[j] <= 0 || tag[j] - 1 >= m) continue;   /* empty, or not older than m */
        const float *e = F(c->ring_q) + (ring_entry(c, row[1], j) * c->n_heads + h) * d;
        float s = 0.0f;
        for (int i = 0; i < d; i++) {
            const float x = q[i] - e[i];
            s += x * x;
        }
        if (s < best) {   /* strict: ties keep the lower entry */
            best = s;
            best_pos = tag[j] - 1;
        }
    }
    if (best_pos >= 0 && best < c->thresh2) *p = best_pos;
}

/* LeanKV page addressing (kernels/kv_lean.h): the page of (block, KV head g) holds K codes
 * [bs][kc], V codes [bs][vc], then K (s, z) [bs][4 bytes] and V (s, z) [bs][4 bytes], each (s, z)
 * side present only below 16 bits. Dequantizes token off's key into kx and value into vx. */
static void lean_load(const struct kvs_mac_call *c, int block, int g, int off, float *kx, float *vx)
{
    const struct kvs_lean_fmt f = c->lean;
    const int hd = c->head_dim, bs = c->block_size;
    const size_t kc = (size_t)hd * f.kbits / 8, vc = (size_t)hd * f.vbits / 8;
    const uint8_t *page = (const uint8_t *)c->pages->data +
                          ((size_t)block * c->n_kv_heads + g) * kvs_lean_page_bytes(f, hd, bs);
    const uint8_t *meta = page + (size_t)bs * (kc + vc);
    uint16_t sz[2] = {0, 0};
    if (f.kbits < 16) {
        memcpy(sz, meta + (size_t)off * 4, 4);
        meta += (size_t)bs * 4;
    }
    kvs_lean_dequantize(page + (size_t)off * kc, sz, hd, f.kbits, kx);
    sz[0] = sz[1] = 0;
    if (f.vbits < 16) memcpy(sz, meta + (size_t)off * 4, 4);
    kvs_lean_dequantize(page + (size_t)bs * kc + (size_t)off * vc, sz, hd, f.vbits, vx);
}

/* Attention of q0 (post-RoPE) over positions [lo, hi) of sequence seq, KV head g: (o, lse),
 * o = 0 and lse = -inf when nothing is selected. */
static void span_partial(const struct kvs_mac_call *c, int seq, int g, const float *q0, int lo, int hi, float *o,
                         float *lse)
{
    const struct kvs_attn_meta *m = c->m;
    const int hd = c->head_dim, bs = c->block_size;
    const int32_t *bt = I(m->block_tables) + (size_t)seq * m->max_blocks;
    const int32_t *rot = m->rot_offsets ? I(m->rot_offsets) + (size_t)seq * m->max_blocks : NULL;
    const int32_t *valid = m->block_valid ? I(m->block_valid) + (size_t)seq * m->max_blocks : NULL;
    const int lean = c->lean.kbits > 0;
    const float *kc = lean ? NULL : F(c->kc), *vc = lean ? NULL : F(c->vc);
    float qr[MAX_HEAD_DIM], kx[MAX_HEAD_DIM], vx[MAX_HEAD_DIM];
    const float *q = q0;
    int cur_rot = 0;
    float mx = -INFINITY, l = 0.0f;
    for (int i = 0; i < hd; i++) o[i] = 0.0f;
    for (int p = lo > 0 ? lo : 0; p < hi; p++) {
        const int bi = p / bs, off = p % bs;
        if (valid && off >= valid[bi]) {
            p += bs - off - 1;   /* the rest of this block is padding */
            continue;
        }
        const int r = rot ? rot[bi] : 0;
        if (r != cur_rot) {
            cur_rot = r;
            if (r) rotate_back(q0, F(m->inv_freq), r, hd, qr);
            q = r ? qr : q0;
        }
        const float *k, *v;
        if (lean) {
            lean_load(c, bt[bi], g, off, kx, vx);
            k = kx, v = vx;
        } else {
            const size_t base = (((size_t)bt[bi] * c->n_kv_heads + g) * bs + off) * hd;
            k = kc + base, v = vc + base;
        }
        const float sc = dot_f32(q, k, hd) * c->scale;
        if (sc > mx) {
            const float corr = expf(mx - sc);
            l *= corr;
            for (int i = 0; i < hd; i++) o[i] *= corr;
            mx = sc;
        }
        const float w = expf(sc - mx);
        l += w;
        for (int i = 0; i < hd; i++) o[i] += w * v[i];
    }
    if (l == 0.0f) {
        *lse = -INFINITY;
        return;
    }
    const float inv = 1.0f / l;
    for (int i = 0; i < hd; i++) o[i] *= inv;
    *lse = mx + logf(l);
}

static void attend_task(void *arg, int task)
{
    const struct kvs_mac_call *c = arg;
    const int t = task / c->n_heads, h = task % c->n_heads, d = c->head_dim;
    const int32_t *row = I(c->rows) + (size_t)t * 4;
    const int flags = row[3], slot = row[1], m = row[2], seq = row[0];
    if (!(flags & (KVS_MAC_F_MAC | KVS_MAC_F_APPEND))) return;
    if ((flags & KVS_MAC_F_APPEND) && slot < 0) return;
    const int g = h / (c->n_heads / c->n_kv_heads);
    const size_t th = (size_t)t * c->n_heads + h;
    const float *q = F(c->q) + th * d;
    const int p = (flags & KVS_MAC_F_MAC) ? I(c->p)[c->p_off + th] : -1;
    const int s = p >= 0 ? (p - c->band + 1 > 0 ? p - c->band + 1 : 0) : 0;
    const int split = m - c->band + 1 > s ? m - c->band + 1 : s;
    float rest[MAX_HEAD_DIM], part[MAX_HEAD_DIM], rest_lse = -INFINITY, part_lse;
    if (p >= 0) {   /* the cached summary of [0, p - r] */
        const size_t e = ring_entry(c, slot, p % c->K) * c->n_heads + h;
        memcpy(rest, F(c->ring_o) + e * d, (size_t)d * sizeof(float));
        rest_lse = F(c->ring_lse)[e];
    } else {
        for (int i = 0; i < d; i++) rest[i] = 0.0f;
    }
    span_partial(c, seq, g, q, s, split, part, &part_lse);        /* A = [s, m - r] */
    kvs_mac_merge(rest, &rest_lse, part, part_lse, d);              /* rest = cached + A */
    if (flags & KVS_MAC_F_MAC) {
        span_partial(c, seq, g, q, split, m + 1, part, &part_lse);  /* B = the last r (and the band) */
        float *o = F(c->out) + th * d;
        float lse = rest_lse;
        memcpy(o, rest, (size_t)d * sizeof(float));
        kvs_mac_merge(o, &lse, part, part_lse, d);
        F(c->lse)[th] = lse;
    }
    if (flags & KVS_MAC_F_APPEND) {
        const int j = m % c->K;
        const size_t e = ring_entry(c, slot, j) * c->n_heads + h;
        memcpy(F(c->ring_q) + e * d, F(c->q_pre) + th * d, (size_t)d * sizeof(float));
        memcpy(F(c->ring_o) + e * d, rest, (size_t)d * sizeof(float));
        F(c->ring_lse)[e] = rest_lse;
        if (h == 0) I(c->ring_tag)[ring_entry(c, slot, j)] = m + 1;
    }
}

static void cpu_match(struct kvs_backend *b, const struct kvs_mac_call *c)
{
    KVS_ASSERT(c->head_dim <= MAX_HEAD_DIM);
    kvs_cpu_pool_run(b->pool, c->n * c->n_heads, match_task, (void *)c);
}

static void cpu_attend(struct kvs_backend *b, const struct kvs_mac_call *c)
{
    KVS_ASSERT(c->head_dim <= MAX_HEAD_DIM && c->n_kv_heads > 0 && c->n_heads % c->n_kv_heads == 0);
    KVS_ASSERT(!c->m->rot_offsets || c->m->inv_freq);
    KVS_ASSERT(!c->lean.kbits || c->pages);
    kvs_cpu_pool_run(b->pool, c->n * c->n_heads, attend_task, (void *)c);
}

static void cpu_count(struct kvs_backend *b, const struct kvs_mac_call *c, struct kvs_dbuf *acc)
{
    (void)b;
    uint64_t v[KVS_MAC_N_COUNTS];
    memcpy(v, I(acc), sizeof v);
    const int G = c->n_heads / c->n_kv_heads;
    for (int t = 0; t < c->n; t++) {
        const int32_t *r = I(c->rows) + (size_t)t * 4;
        if (!(r[3] & KVS_MAC_F_COUNT)) continue;
        const int m = r[2];
        for (int l = 0; l < c->n_layers; l++)
            for (int g = 0; g < c->n_kv_heads; g++) {
                const int32_t *p = I(c->p) + ((size_t)l * c->n + t) * c->n_heads + (size_t)g * G;
                int min_s = m + 1;
                for (int h = 0; h < G; h++) {
                    const int s0 = p[h] >= 0 ? (p[h] - c->band + 1 > 0 ? p[h] - c->band + 1 : 0) : 0;
                    if (s0 < min_s) min_s = s0;
                    v[KVS_MAC_C_LOOKUPS] += (r[3] & KVS_MAC_F_MATCH) != 0;
                    v[KVS_MAC_C_HITS] += p[h] >= 0;
                    v[KVS_MAC_C_HEADS] += 1;
                    v[KVS_MAC_C_SKIP] += (uint64_t)((double)s0 * KVS_MAC_SKIP_ONE / (double)(m + 1) + 0.5);
                }
                v[KVS_MAC_C_READ] += (uint64_t)(m + 1 - min_s);
            }
    }
    memcpy(I(acc), v, sizeof v);
}

static int cpu_supports(int n_heads, int n_kv_heads, int head_dim, char *err, size_t errlen)
{
    if (head_dim > MAX_HEAD_DIM || n_kv_heads <= 0 || n_heads % n_kv_heads)
        return kvs_err(err, errlen, -ENOSYS, "mac: heads %d/%d, head_dim %d not supported on the cpu", n_heads,
                       n_kv_heads, head_dim);
    return 0;
}

static size_t cpu_work_elems(int max_rows, int n_heads, int head_dim)
{
    (void)max_rows, (void)n_heads, (void)head_dim;
    return 0;
}

/* every format the host dequantizer takes (2, 4, 8, 16 bits), vectors of whole bytes */
static int cpu_supports_lean(struct kvs_lean_fmt f, int n_heads, int n_kv_heads, int head_dim, int block_size,
                             char *err, size_t errlen)
{
    int rc = cpu_supports(n_heads, n_kv_heads, head_dim, err, errlen);
    if (rc) return rc;
    if (f.kbits < 2 || f.kbits > 16 || f.vbits < 2 || f.vbits > 16 || head_dim % 4 || block_size < 1)
        return kvs_err(err, errlen, -ENOSYS, "mac: LeanKV pages K%dV%d with head_dim %d not supported on the cpu",
                       f.kbits, f.vbits, head_dim);
    return 0;
}

const struct kvs_mac_kernels kvs_mac_kernels_cpu = {cpu_supports, cpu_work_elems, cpu_match, cpu_attend,
                                                    cpu_count, cpu_supports_lean};
