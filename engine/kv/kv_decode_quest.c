/* kv_decode_quest.c: kv.decode=quest (Quest, ICML 2024; notes in STRATEGIES.md §4): a decode
 * row attends only the pages whose keys can matter for its query.
 *
 *   digests    per physical page (page_size slots of a block) and KV head, the element-wise min
 *              and max of the post-RoPE keys (kernels/kv_quest.h), refreshed in every layer
 *              that selects, for every page the step's rows wrote (prefill and decode alike),
 *              right after the cache write and before the layer's attention. They belong to the
 *              block, so prefix sharing, paging, copy-on-write and preemption need nothing more:
 *              any rewrite of a block comes through a step, which refreshes it.
 *   budget     per decode row of context n: max(min_budget, ceil(budget_ratio * n)) tokens, kept as
 *              keep = ceil(budget / page_size) pages, the current page (the one holding the row's
 *              own position) among them; keep >= the row's page count: every page (one span
 *              [0, n), which is full attention bitwise on the CPU).
 *   selection  scores sum over the group's query heads of sum_i max(q_i kmin_i, q_i kmax_i); the
 *              top keep - 1 full pages plus the current one (kernels/kv_quest.h), in layers
 *              dense_layers and up; layers below attend densely.
 *   attention  exact attention over the kept pages: the backend's attention_spans.
 *   digest_bits kv.quest.digest_bits (default 8) 16 keeps the min/max as stored (KV type); 8 or 4 keeps them
 *              as codes on a per-(page, KV head) fp16 grid, rounded outward (kernels/kv_quest.h):
 *              still an upper bound, read at 2x / 4x fewer bytes, refreshed by the same step
 *              (from the page's slots in the cache: no running min/max is kept).
 *
 * Rows. The scheduler puts decode rows first (one row per sequence): selection runs for the
 * leading one-row sequences of the step ("lead"), the spans kernel on just those rows. A step
 * that also holds prefill chunks runs attention() over all rows first (prefill rows need it),
 * and the lead rows' outputs are then replaced. A decode row after a prefill chunk (no current
 * scheduler makes one) attends densely and is counted (kvserve:kv_quest_dense_rows_total).
 * Steps whose blocks carry rotation offsets or partial blocks (cached documents) never select:
 * the digests do not bound q.k there (the composition matrix refuses lazy + quest anyway).
 *
 * Launch planning (backend.h kvs_span_list): the spans are made on the device, so the host copy
 * is one span per (row, head) with at least as many keys as the selection keeps; the CUDA
 * attention_spans only sizes its splits from it.
 *
 * Step graphs (engine/runner.c: a step of one-token sequences, padded with dummy sequences to a
 * size bucket, recorded once per (sequences, context capacity m->plan_ctx) and replayed while the
 * contexts grow). Everything a layer reads that changes between replays is device data that
 * plan() uploads before the replay (keep counts, the digest refresh's row starts); every launch
 * shape comes from the capacity, never from this step's positions: the score grid, the span
 * plan (one span of keep(capacity) pages, the rows' positions taken as capacity - 1) and the
 * sparse-or-dense choice (sparse when a row at the capacity would select; a row that keeps every
 * page then attends over one span [0, ctx), exact up to rounding on CUDA). The runner's dummy
 * sequences (no request slot, position 0 of block 0, no KV write) get no rows in the digest
 * refresh, which would otherwise recompute block 0's first page from its slot 0 alone (with
 * Quest, no step has a slot-less sequence of its own: those are cached-document jobs, which
 * the composition matrix refuses). The digest check (kv_decode_quest.h) runs in eager steps only.
 *
 * No per-request state. Errors: create()
 * returns -EINVAL (bad page size), -ENOSYS (no Quest kernels or no attention_spans on the
 * backend), -ENOMEM, with a message.
 */
#include "engine/kv/kv.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/util.h"
#include "engine/config.h"
#include "engine/kv/kv_decode_quest.h"
#include "kernels/kv_quest.h"

static int check_mode;   /* kv_decode_quest.h */

void kvs_quest_set_check(int mode) { check_mode = mode; }
static int skip_hint = 1;
void kvs_quest_set_skip_hint(int on) { skip_hint = on; }

struct quest {
    struct kvs_kv_decode_env env;
    const struct kvs_quest_kernels *k;
    double ratio;
    int min_budget, dense_layers, ps, bits;   /* bits: kv.quest.digest_bits */
    size_t n_pages;                           /* physical pages of the pool */
    int max_pages, max_spans, rows;   /* rows: selection rows a step can have (request slots) */
    struct kvs_dbuf **dig;            /* [n_layers] KV [n_pages][nkv][2][hd], or I32 codes (bits < 16) */
    struct kvs_dbuf *d_scores, *d_keep, *d_n_spans, *d_spans;
    int32_t *h_keep, *h_n_spans, *h_spans;
    struct kvs_dbuf *d_wqs;           /* I32 [max_rows + 1]: the digest refresh's row starts (graph steps) */
    int32_t *h_wqs, *h_cap_pos;       /* [max_rows + 1]; [rows]: capacity - 1 (graph steps' launch plans) */
    /* this step (plan) */
    int n_lead, any_sparse, skip, graph;
    uint64_t steps;
    /* counters */
    double stale_pages, bytes_read, dense_rows, sparse_rows, pages_kept, pages_total;
    double skipped_rows;   /* lead rows (x layers) the dense pass of a mixed step was told to skip */
};

static void quest_destroy(void *state)
{
    struct quest *s = state;
    if (!s) return;
    const struct kvs_backend_ops *o = s->env.o;
    if (s->dig)
        for (int l = 0; l < s->env.n_layers; l++) o->free_buf(s->env.be, s->dig[l]);
    free(s->dig);
    o->free_buf(s->env.be, s->d_scores);
    o->free_buf(s->env.be, s->d_keep);
    o->free_buf(s->env.be, s->d_n_spans);
    o->free_buf(s->env.be, s->d_spans);
    o->free_buf(s->env.be, s->d_wqs);
    free(s->h_wqs);
    free(s->h_cap_pos);
    free(s->h_keep);
    free(s->h_n_spans);
    free(s->h_spans);
    free(s);
}

/* pages a decode row with context ctx keeps (the current one included) */
static int keep_pages(const struct quest *s, int ctx)
{
    double b = ceil(s->ratio * (double)ctx);
    if (b < s->min_budget) b = s->min_budget;
    const double k = ceil(b / s->ps);
    return k > (double)(1 << 30) ? 1 << 30 : (int)k;
}

static int quest_create(const struct kvs_kv_decode_env *env, void **state, char *err, size_t errlen)
{
    const struct kvs_config *c = env->cfg;
    const double ratio = c ? c->quest_budget_ratio : 0.15;
    const int min_budget = c ? c->quest_min_budget : 256, dense = c ? c->quest_dense_layers : 2;
    const int ps = c && c->quest_page_size > 0 ? c->quest_page_size : env->block_size;
    const int bits = c && c->quest_digest_bits ? c->quest_digest_bits : KVS_QUEST_DIGEST_BITS_DEFAULT;
    if (ps <= 0 || env->block_size % ps)
        return kvs_err(err, errlen, -EINVAL, "config key 'kv.quest.page_size': %d does not divide kv.block_size %d", ps,
                       env->block_size);
    if ((bits != 16 && bits != 8 && bits != 4) || (bits < 16 && env->head_dim * bits % 32))
        return kvs_err(err, errlen, -EINVAL, "config key 'kv.quest.digest_bits': %d (16, 8 or 4; 8 and 4 need "
                       "head_dim x bits a multiple of 32, head_dim is %d)", bits, env->head_dim);
    if (!env->o->attention_spans)
        return kvs_err(err, errlen, -ENOSYS, "kv.decode \"quest\": backend %s has no attention_spans", env->o->name);
    const struct kvs_quest_kernels *k = kvs_quest_kernels_for(env->o, err, errlen);
    if (!k) return -ENOSYS;
    if (bits < 16 && (!k->qdigest_update || !k->qscore))
        return kvs_err(err, errlen, -ENOSYS, "kv.quest.digest_bits %d: backend %s has no quantized digest kernels", bits,
                       env->o->name);
    if (ratio <= 0 || min_budget < 0 || dense < 0)
        return kvs_err(err, errlen, -EINVAL, "kv.quest: budget_ratio %g, min_budget %d, dense_layers %d out of range",
                       ratio, min_budget, dense);

    struct quest *s = kvs_xcalloc(1, sizeof *s);
    s->env = *env;
    s->k = k;
    s->ratio = ratio, s->min_budget = min_budget, s->dense_layers = dense, s->ps = ps, s->bits = bits;
    s->max_pages = env->max_blocks * (env->block_size / ps);
    s->max_spans = keep_pages(s, env->max_blocks * env->block_size);
    if (s->max_spans > s->max_pages) s->max_spans = s->max_pages;
    if (s->max_spans < 1) s->max_spans = 1;
    s->rows = env->max_slots < env->max_rows ? env->max_slots : env->max_rows;
    const struct kvs_backend_ops *o = env->o;
    const size_t nkv = (size_t)env->n_kv_heads, rows = (size_t)s->rows;
    const size_t pages = (size_t)env->n_pool_blocks * (size_t)(env->block_size / ps);
    int failed = pages == 0;
    s->n_pages = pages;
    s->dig = kvs_xcalloc((size_t)env->n_layers, sizeof *s->dig);
    /* dense layers never select: their digests are never kept */
    for (int l = dense; l < env->n_layers && !failed; l++)
        failed = !(s->dig[l] = bits < 16 ? o->alloc(env->be, KVS_BUF_I32,
                                                    kvs_quest_qdig_words(pages, env->n_kv_heads, env->head_dim, bits))
                                         : o->alloc(env->be, KVS_BUF_KV, pages * nkv * 2 * (size_t)env->head_dim));
    if (!failed) {
        s->d_scores = o->alloc(env->be, KVS_BUF_F32, rows * nkv * (size_t)s->max_pages);
        s->d_keep = o->alloc(env->be, KVS_BUF_I32, rows);
        s->d_n_spans = o->alloc(env->be, KVS_BUF_I32, rows * nkv);
        s->d_spans = o->alloc(env->be, KVS_BUF_I32, rows * nkv * (size_t)s->max_spans * 2);
        s->d_wqs = o->alloc(env->be, KVS_BUF_I32, (size_t)env->max_rows + 1);
        failed = !s->d_scores || !s->d_keep || !s->d_n_spans || !s->d_spans || !s->d_wqs;
    }
    if (failed) {
        quest_destroy(s);
        return kvs_err(err, errlen, -ENOMEM, "kv.decode \"quest\": no backend memory for the page digests (%zu pages x "
                       "%d layers) and selection buffers", pages, env->n_layers);
    }
    s->h_keep = kvs_xcalloc(rows, sizeof *s->h_keep);
    s->h_n_spans = kvs_xcalloc(rows * nkv, sizeof *s->h_n_spans);
    s->h_spans = kvs_xcalloc(rows * nkv * (size_t)s->max_spans * 2, sizeof *s->h_spans);
    s->h_wqs = kvs_xcalloc((size_t)env->max_rows + 1, sizeof *s->h_wqs);
    s->h_cap_pos = kvs_xcalloc(rows, sizeof *s->h_cap_pos);
    *state = s;
    return 0;
}

static int quest_plan(void *state, const struct kvs_kv_step *st)
{
    struct quest *s = state;
    s->steps++;
    const int nkv = s->env.n_kv_heads, L = s->env.n_layers;
    const int dense_l = s->dense_layers < L ? s->dense_layers : L;
    const double per_layer = (double)s->env.kv_bytes_per_token / (double)L;
    s->skip = st->m->rot_offsets != NULL || st->m->block_valid != NULL;
    s->n_lead = 0;
    s->any_sparse = 0;
    /* a step the runner may record (module comment): launch shapes from the capacity */
    const int cap = st->m->plan_ctx;
    s->graph = cap > 0 && st->n_seqs <= s->env.max_rows;
    while (!s->skip && s->n_lead < st->n_seqs && s->n_lead < s->rows &&
           st->h_q_start[s->n_lead + 1] - st->h_q_start[s->n_lead] == 1)
        s->n_lead++;
    for (int q = 0; q < st->n_seqs; q++) {
        if (!st->h_decode[q]) continue;
        const int ctx = st->h_pos[q] + 1, cur = st->h_pos[q] / s->ps;
        const int keep = keep_pages(s, ctx);
        if (q >= s->n_lead || keep > cur || dense_l == L) {
            if (q >= s->n_lead && keep <= cur) s->dense_rows++;
            s->bytes_read += (double)ctx * per_layer * L;
            continue;
        }
        const int kept = (keep - 1) * s->ps + (ctx - cur * s->ps);   /* keys attended in a sparse layer */
        s->sparse_rows++;
        s->pages_kept += keep;
        s->pages_total += cur + 1;
        /* a bf16 digest (min and max rows of K) costs what one position's K and V cost; a
         * quantized one bits / 16 of it (the params word left out) */
        s->bytes_read += per_layer * ((double)ctx * dense_l + ((double)kept + cur * s->bits / 16.0) * (L - dense_l));
    }
    for (int q = 0; q < s->n_lead; q++) {
        const int ctx = st->h_pos[q] + 1, cur = st->h_pos[q] / s->ps;
        int keep = st->h_decode[q] ? keep_pages(s, ctx) : cur + 1;
        if (keep > cur + 1) keep = cur + 1;
        s->h_keep[q] = keep;
        s->any_sparse |= keep <= cur;
        /* launch planning: one span with at least the kept keys (kernels/kv_quest.h); in a graph
         * step, as many as a row at the capacity keeps (keep_pages grows with the context) */
        int bound = keep * s->ps < ctx ? keep * s->ps : ctx;
        if (s->graph) {
            const int kc = keep_pages(s, cap);
            bound = kc * s->ps < cap ? kc * s->ps : cap;
            s->h_cap_pos[q] = cap - 1;
        }
        for (int g = 0; g < nkv; g++) {
            s->h_n_spans[q * nkv + g] = 1;
            int32_t *sp = s->h_spans + ((size_t)q * nkv + g) * s->max_spans * 2;
            sp[0] = 0, sp[1] = bound;
        }
    }
    if (s->graph) {
        /* the same path for every replay of a recording: sparse when a row at the capacity selects */
        s->any_sparse = s->n_lead > 0 && keep_pages(s, cap) <= (cap - 1) / s->ps;
        /* the digest refresh skips the runner's dummy sequences (no slot): zero rows */
        s->h_wqs[0] = 0;
        for (int q = 0; q < st->n_seqs; q++)
            s->h_wqs[q + 1] = s->h_wqs[q] + (st->h_slot[q] < 0 ? 0 : st->h_q_start[q + 1] - st->h_q_start[q]);
        s->env.o->upload(s->env.be, s->d_wqs, 0, s->h_wqs, (size_t)st->n_seqs + 1);
    }
    if (s->any_sparse) s->env.o->upload(s->env.be, s->d_keep, 0, s->h_keep, (size_t)s->n_lead);
    return 0;
}

/* kv_decode_quest.h: counts the candidate pages of the sparse lead rows whose digest is not the
 * min/max of the page's keys in the cache */
static void check_digests(struct quest *s, int layer, const struct kvs_kv_attend *a, const struct kvs_attn_meta *m)
{
    const struct kvs_backend_ops *o = s->env.o;
    const int nkv = a->n_kv_heads, hd = a->head_dim, bs = a->block_size, ps = s->ps;
    const size_t nk = (size_t)s->env.n_pool_blocks * nkv * bs * hd, nd = nk / ps * 2;
    const size_t vw = s->bits < 16 ? kvs_quest_qdig_vec_words(hd, s->bits) : 0;
    const size_t nq = s->bits < 16 ? kvs_quest_qdig_words(s->n_pages, nkv, hd, s->bits) : 0;
    float *k = kvs_xmalloc(nk * sizeof *k), *d = s->bits < 16 ? NULL : kvs_xmalloc(nd * sizeof *d);
    float *mm = kvs_xmalloc(2 * (size_t)hd * sizeof *mm);
    uint32_t *qd = s->bits < 16 ? kvs_xmalloc(nq * sizeof *qd) : NULL, *want = kvs_xmalloc((2 * vw + 1) * sizeof *want);
    int32_t *bt = kvs_xmalloc((size_t)m->n_seqs * m->max_blocks * sizeof *bt);
    o->download(s->env.be, k, a->kv.k, 0, nk);
    if (qd) o->download(s->env.be, qd, s->dig[layer], 0, nq);
    else o->download(s->env.be, d, s->dig[layer], 0, nd);
    o->download(s->env.be, bt, m->block_tables, 0, (size_t)m->n_seqs * m->max_blocks);
    for (int q = 0; q < m->n_seqs; q++) {
        const int cur = m->h_pos[q] / ps;
        if (s->h_keep[q] > cur) continue;
        for (int pg = 0; pg < cur; pg++) {
            const int32_t blk = bt[(size_t)q * m->max_blocks + pg * ps / bs];
            const size_t pp = (size_t)blk * (bs / ps) + (size_t)(pg * ps % bs) / ps;
            int stale = 0;
            for (int g = 0; g < nkv && !stale; g++) {
                for (int i = 0; i < hd; i++) {
                    float mn = INFINITY, mx = -INFINITY;
                    for (int p = pg * ps; p < (pg + 1) * ps; p++) {
                        const float x = k[(((size_t)blk * nkv + g) * bs + p % bs) * hd + i];
                        mn = x < mn ? x : mn;
                        mx = x > mx ? x : mx;
                    }
                    mm[i] = mn, mm[hd + i] = mx;
                }
                if (qd) {   /* the codes must be the encoding of the keys' min/max, bitwise */
                    want[2 * vw] = kvs_qd_encode(mm, mm + hd, hd, s->bits, want, want + vw);
                    stale = memcmp(want, qd + (pp * nkv + g) * 2 * vw, 2 * vw * sizeof *want) ||
                            want[2 * vw] != qd[s->n_pages * nkv * 2 * vw + pp * nkv + g];
                } else {
                    stale = memcmp(d + (pp * nkv + g) * 2 * hd, mm, 2 * (size_t)hd * sizeof *mm) != 0;
                }
            }
            s->stale_pages += stale;
        }
    }
    free(k);
    free(d);
    free(mm);
    free(qd);
    free(want);
    free(bt);
}

/* refreshes one layer's digests (either kind) for the pages m's rows wrote */
static void refresh(struct quest *s, const struct kvs_dbuf *kc, const struct kvs_attn_meta *m, struct kvs_dbuf *dig)
{
    const struct kvs_kv_decode_env *e = &s->env;
    if (s->bits < 16)
        s->k->qdigest_update(e->be, kc, m, e->n_kv_heads, e->head_dim, e->block_size, s->ps, s->bits, s->n_pages, dig);
    else
        s->k->digest_update(e->be, kc, m, e->n_kv_heads, e->head_dim, e->block_size, s->ps, dig);
}

void kvs_quest_refresh_digests(void *state, const struct kvs_dbuf *kc, const struct kvs_attn_meta *m)
{
    struct quest *s = state;
    for (int l = s->dense_layers; l < s->env.n_layers; l++) refresh(s, kc, m, s->dig[l]);
}

static void quest_attend(void *state, int layer, const struct kvs_kv_attend *a)
{
    struct quest *s = state;
    const struct kvs_backend_ops *o = s->env.o;
    struct kvs_backend *be = s->env.be;
    const struct kvs_kv_step *st = a->step;
    struct kvs_attn_meta wm = *st->m;   /* graph steps: without the dummy sequences' rows */
    if (s->graph) wm.q_start = s->d_wqs, wm.h_q_start = s->h_wqs;
    /* a step of lead rows only (one row each) selecting in this layer: the refresh of the pages
     * they wrote (their current pages, which no selection reads) goes into score_select's launch */
    const int fold = s->k->score_select && layer >= s->dense_layers && !s->skip && s->any_sparse && !check_mode &&
                     s->n_lead == st->n_seqs;
    if (layer >= s->dense_layers && !s->skip && !fold && !(check_mode == 2 && s->steps % 2 == 0))
        refresh(s, a->kv.k, &wm, s->dig[layer]);
    if (layer < s->dense_layers || !s->any_sparse) {
        o->attention(be, a->q, a->kv.k, a->kv.v, st->m, st->n_rows, a->n_heads, a->n_kv_heads, a->head_dim,
                     a->block_size, a->scale, a->out);
        return;
    }
    if (st->n_rows > s->n_lead) {
        /* the lead rows' output is overwritten below: the dense pass may skip them (backend.h
         * skip_lead; not in a recorded step, whose launch shapes must not depend on the lead) */
        struct kvs_attn_meta dm = *st->m;
        if (!s->graph && skip_hint) {
            dm.skip_lead = s->n_lead;
            s->skipped_rows += s->n_lead;
        }
        o->attention(be, a->q, a->kv.k, a->kv.v, &dm, st->n_rows, a->n_heads, a->n_kv_heads, a->head_dim,
                     a->block_size, a->scale, a->out);
    }
    /* the lead rows as a step of their own: the same tables, the first n_lead sequences */
    struct kvs_attn_meta sub = *st->m;
    sub.n_seqs = s->n_lead;
    sub.max_ctx = 0;
    for (int q = 0; q < s->n_lead; q++)
        if (st->h_pos[q] + 1 > sub.max_ctx) sub.max_ctx = st->h_pos[q] + 1;
    if (check_mode && !s->graph) check_digests(s, layer, a, &sub);
    if (s->graph) sub.h_pos = s->h_cap_pos, sub.max_ctx = st->m->plan_ctx;   /* launch shapes (module comment) */
    if (s->k->score_select)   /* one kernel where the backend fuses them (CUDA) */
        s->k->score_select(be, a->q, s->dig[layer], &sub, s->d_keep, s->n_lead, a->n_heads, a->n_kv_heads,
                           a->head_dim, a->block_size, s->ps, s->bits, s->n_pages, s->max_pages, s->max_spans,
                           s->d_scores, 0, s->d_n_spans, s->d_spans, fold ? a->kv.k : NULL, fold ? &wm : NULL);
    else {
        if (s->bits < 16)
            s->k->qscore(be, a->q, s->dig[layer], &sub, s->d_keep, s->n_lead, a->n_heads, a->n_kv_heads,
                         a->head_dim, a->block_size, s->ps, s->bits, s->n_pages, s->max_pages, s->d_scores);
        else
            s->k->score(be, a->q, s->dig[layer], &sub, s->d_keep, s->n_lead, a->n_heads, a->n_kv_heads, a->head_dim,
                        a->block_size, s->ps, s->max_pages, s->d_scores);
        s->k->select(be, s->d_scores, &sub, s->d_keep, s->n_lead, a->n_kv_heads, s->ps, s->max_pages, s->max_spans,
                     s->d_n_spans, s->d_spans);
    }
    const struct kvs_span_list sp = {s->max_spans, s->d_n_spans, s->d_spans, s->h_n_spans, s->h_spans};
    o->attention_spans(be, a->q, a->kv.k, a->kv.v, &sub, &sp, s->n_lead, a->n_heads, a->n_kv_heads, a->head_dim,
                       a->block_size, a->scale, a->out, a->lse);
}

static int quest_counters(void *state, struct kvs_kv_counter *out, int cap)
{
    struct quest *s = state;
    const struct kvs_kv_counter c[] = {
        {"kvserve:kv_decode_bytes_read_total", "KV bytes the decode policy read for decode rows (Quest: page digests "
         "included).", 1, s->bytes_read, NULL, NULL},
        {"kvserve:kv_quest_sparse_rows_total", "Decode rows that attended selected pages.", 1, s->sparse_rows, NULL,
         NULL},
        {"kvserve:kv_quest_dense_rows_total", "Decode rows over the budget that attended densely (not in the step's "
         "leading decode rows).", 1, s->dense_rows, NULL, NULL},
        {"kvserve:kv_quest_pages_kept_total", "Pages the sparse decode rows kept (per layer and KV head).", 1,
         s->pages_kept, NULL, NULL},
        {"kvserve:kv_quest_pages_total", "Pages the sparse decode rows had.", 1, s->pages_total, NULL, NULL},
        {"kvserve:kv_quest_dense_skipped_rows_total", "Lead decode rows (x layers) of mixed steps that the dense "
         "attention pass skipped (attention meta skip_lead): the sparse pass writes them.", 1, s->skipped_rows, NULL,
         NULL},
        {"kvserve:kv_quest_stale_digests_total", "Candidate pages whose digest differed from their keys (counted only "
         "under the test check, kv_decode_quest.h).", 1, s->stale_pages, NULL, NULL},
    };
    int n = 0;
    for (size_t i = 0; i < sizeof c / sizeof c[0] && n < cap; i++) out[n++] = c[i];
    return n;
}

const struct kvs_kv_decode_ops kvs_kv_decode_quest = {
    .name = "quest",
    .exact = 0,
    .needs = KVS_KV_NEEDS_LSE,
    .rows_per_seq = 1,
    .create = quest_create,
    .destroy = quest_destroy,
    .plan = quest_plan,
    .attend = quest_attend,
    .counters = quest_counters,
};
