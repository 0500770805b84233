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
 * Super-pages (kv.quest.super_pages = N > 0, kernels/kv_quest.h's two-level selection; an
 * approximation of the selection above, off by default). A super-page is N consecutive pages of a
 * request; its digest (F32, per layer, request slot and KV head: a row's pages are its own
 * sequence's blocks, so it cannot belong to a block as a page digest does) is the union of its
 * full pages' digests. Each step scores the super-pages, keeps skeep = min(all, ceil(super_keep x
 * (keep - 1) / N) + 1) of them (the last one, holding the pages just before the current page,
 * always: kernels/kv_quest.h says why) and ranks only their pages: reading n/N super digests and about
 * super_keep x the kept pages' digests instead of every page's. Maintenance, on the host in plan:
 * a slot's tag of each super-page (the physical pages it was made from, their count) is compared
 * with the row's block table; a super-page whose pages differ (a page filled since, a prefix
 * block shared in, a copied-on-write block, a fresh request in the slot: seq_init clears the
 * slot's tags) is listed as a ref and recomputed by the selection launch of every selecting layer
 * from the page digests before it scores. Full pages do not change while a request holds them
 * (Quest never rewrites a written position; preemption recomputes into a fresh slot), so a
 * matching tag means a current digest. The digest check (kv_decode_quest.h) also recomputes every
 * super-page the selection read from the page digests and counts the ones that differ.
 *
 * Per-request state: only the super-pages' (their tags on the host, digests on the backend).
 * Errors: create()
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
    /* super-pages (module comment); sup = 0: off */
    int sup, max_super, slots;
    double sup_keep;
    struct kvs_dbuf **sdig;           /* [n_layers] F32 [slots][max_super][nkv][2][hd] (selecting layers) */
    struct kvs_dbuf *d_skeep, *d_rslot, *d_refs, *d_refn;
    int32_t *h_skeep, *h_rslot, *h_refs, *h_refn;   /* [rows], [rows], [rows][max_super][2 + sup], [rows] */
    int32_t *tags;                    /* [slots][max_super][1 + sup]: page count (-1: none), the pages */
    double sup_refs, sup_read;        /* super-pages refreshed (x layers); super-pages scored */
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
    if (s->sdig)
        for (int l = 0; l < s->env.n_layers; l++) o->free_buf(s->env.be, s->sdig[l]);
    free(s->sdig);
    o->free_buf(s->env.be, s->d_skeep);
    o->free_buf(s->env.be, s->d_rslot);
    o->free_buf(s->env.be, s->d_refs);
    o->free_buf(s->env.be, s->d_refn);
    free(s->h_skeep);
    free(s->h_rslot);
    free(s->h_refs);
    free(s->h_refn);
    free(s->tags);
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
    const int sup = c ? c->quest_super_pages : 0;
    const double sup_keep = c ? c->quest_super_keep : 2.0;
    if (sup < 0 || (sup > 0 && !(sup_keep >= 1.0)))
        return kvs_err(err, errlen, -EINVAL, "config keys 'kv.quest.super_pages' %d / 'kv.quest.super_keep' %g: pages "
                       "per super-page >= 0 (0: off), super_keep >= 1", sup, sup_keep);
    if (sup > 0 && !k->super_select)
        return kvs_err(err, errlen, -ENOSYS, "kv.quest.super_pages %d: backend %s has no two-level selection", sup,
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
    if (sup > 0) {
        s->sup = sup, s->sup_keep = sup_keep;
        s->max_super = (s->max_pages + sup - 1) / sup;
        s->slots = env->max_slots > 0 ? env->max_slots : 1;
        const size_t per_slot = (size_t)s->max_super * nkv * 2 * (size_t)env->head_dim, refw = (size_t)(2 + sup);
        s->sdig = kvs_xcalloc((size_t)env->n_layers, sizeof *s->sdig);
        for (int l = dense; l < env->n_layers && !failed; l++)
            failed = !(s->sdig[l] = o->alloc(env->be, KVS_BUF_F32, (size_t)s->slots * per_slot));
        if (!failed) {
            s->d_skeep = o->alloc(env->be, KVS_BUF_I32, rows);
            s->d_rslot = o->alloc(env->be, KVS_BUF_I32, rows);
            s->d_refn = o->alloc(env->be, KVS_BUF_I32, rows);
            s->d_refs = o->alloc(env->be, KVS_BUF_I32, rows * (size_t)s->max_super * refw);
            failed = !s->d_skeep || !s->d_rslot || !s->d_refn || !s->d_refs;
        }
        if (failed) {
            quest_destroy(s);
            return kvs_err(err, errlen, -ENOMEM, "kv.quest.super_pages %d: no backend memory for the super-page digests "
                           "(%d slots x %d super-pages x %d layers)", sup, env->max_slots, (s->max_pages + sup - 1) / sup,
                           env->n_layers);
        }
        s->h_skeep = kvs_xcalloc(rows, sizeof *s->h_skeep);
        s->h_rslot = kvs_xcalloc(rows, sizeof *s->h_rslot);
        s->h_refn = kvs_xcalloc(rows, sizeof *s->h_refn);
        s->h_refs = kvs_xcalloc(rows * (size_t)s->max_super * refw, sizeof *s->h_refs);
        s->tags = kvs_xmalloc((size_t)s->slots * s->max_super * (1 + sup) * sizeof *s->tags);
        for (size_t i = 0; i < (size_t)s->slots * s->max_super; i++) s->tags[i * (1 + sup)] = -1;
    }
    *state = s;
    return 0;
}

/* a fresh request in the slot (or the end of one): none of its super-page digests is current */
static void clear_tags(struct quest *s, int slot)
{
    if (!s->sup || slot < 0 || slot >= s->slots) return;
    for (int j = 0; j < s->max_super; j++) s->tags[((size_t)slot * s->max_super + j) * (1 + s->sup)] = -1;
}

static int quest_seq_init(void *state, int slot, void *mem)
{
    (void)mem;
    clear_tags(state, slot);
    return 0;
}

static void quest_seq_free(void *state, int slot) { clear_tags(state, slot); }

/* super-pages a row with `keep` pages (the current one included) and cur candidates keeps */
static int super_keep(const struct quest *s, int keep, int cur)
{
    const int nsup = (cur + s->sup - 1) / s->sup;
    const double k = ceil(s->sup_keep * (double)(keep - 1) / s->sup) + 1;
    return k >= nsup ? nsup : (int)k;
}

/* plan: the super-page refs of the sparse lead rows (module comment); -EINVAL without the host
 * block tables */
static int plan_super(struct quest *s, const struct kvs_kv_step *st)
{
    const int N = s->sup, bs = s->env.block_size, ps = s->ps, ppb = bs / ps, w = 2 + N;
    if (!st->h_block_tables) {
        kvs_log(KVS_LOG_ERROR, "kv.quest.super_pages: the step has no host block tables");
        return -EINVAL;
    }
    for (int q = 0; q < s->n_lead; q++) {
        const int cur = st->h_pos[q] / ps, slot = st->h_slot[q];
        s->h_refn[q] = 0;
        s->h_rslot[q] = slot < 0 ? 0 : slot;
        s->h_skeep[q] = 0;
        if (s->h_keep[q] > cur) continue;
        if (slot < 0 || slot >= s->slots) {   /* no request state (no current scheduler makes one): dense */
            s->h_keep[q] = cur + 1;
            continue;
        }
        const int32_t *bt = st->h_block_tables + (size_t)q * st->m->max_blocks;
        const int nsup = (cur + N - 1) / N;
        s->h_skeep[q] = super_keep(s, s->h_keep[q], cur);
        s->sup_read += nsup;
        int32_t *refs = s->h_refs + (size_t)q * s->max_super * w;
        for (int j = 0; j < nsup; j++) {
            const int cnt = cur - j * N < N ? cur - j * N : N;
            int32_t *tag = s->tags + ((size_t)slot * s->max_super + j) * (1 + N);
            int same = tag[0] == cnt;
            for (int t = 0; t < cnt && same; t++) {
                const int pg = j * N + t;
                same = tag[1 + t] == bt[pg / ppb] * ppb + pg % ppb;
            }
            if (same) continue;
            tag[0] = cnt;
            for (int t = 0; t < cnt; t++) {
                const int pg = j * N + t;
                tag[1 + t] = bt[pg / ppb] * ppb + pg % ppb;
            }
            if (check_mode == 3 && s->steps % 2 == 0) continue;   /* the check's negative control */
            int32_t *e = refs + (size_t)s->h_refn[q]++ * w;
            e[0] = j, e[1] = cnt;
            memcpy(e + 2, tag + 1, (size_t)cnt * sizeof *e);
        }
        s->sup_refs += s->h_refn[q];
    }
    const struct kvs_backend_ops *o = s->env.o;
    o->upload(s->env.be, s->d_skeep, 0, s->h_skeep, (size_t)s->n_lead);
    o->upload(s->env.be, s->d_rslot, 0, s->h_rslot, (size_t)s->n_lead);
    o->upload(s->env.be, s->d_refn, 0, s->h_refn, (size_t)s->n_lead);
    for (int q = 0; q < s->n_lead; q++)
        if (s->h_refn[q])
            o->upload(s->env.be, s->d_refs, (size_t)q * s->max_super * w, s->h_refs + (size_t)q * s->max_super * w,
                      (size_t)s->h_refn[q] * w);
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
        double dig = cur * s->bits / 16.0;
        if (s->sup) {   /* F32 super digests (twice a bf16 digest), then the kept super-pages' pages */
            const int ns = super_keep(s, keep, cur), cand = ns * s->sup < cur ? ns * s->sup : cur;
            dig = 2.0 * ((cur + s->sup - 1) / s->sup) + cand * s->bits / 16.0;
        }
        s->bytes_read += per_layer * ((double)ctx * dense_l + ((double)kept + dig) * (L - dense_l));
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
    if (s->sup && s->any_sparse) {
        const int rc = plan_super(s, st);
        if (rc < 0) return rc;
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

/* kv_decode_quest.h, after a two-level selection: every super-page digest that the sparse lead
 * rows' selection read, recomputed from the layer's page digests (as kernels/kv_quest.h defines
 * it); the ones that differ bitwise count as stale */
static void check_super(struct quest *s, int layer, const struct kvs_attn_meta *m)
{
    const struct kvs_backend_ops *o = s->env.o;
    const int nkv = s->env.n_kv_heads, hd = s->env.head_dim, N = s->sup, ps = s->ps, ppb = s->env.block_size / ps;
    const size_t nd = s->bits < 16 ? kvs_quest_qdig_words(s->n_pages, nkv, hd, s->bits) : s->n_pages * nkv * 2 * hd;
    const size_t ns = (size_t)s->slots * s->max_super * nkv * 2 * hd, vw = kvs_quest_qdig_vec_words(hd, s->bits);
    void *d = kvs_xmalloc(nd * 4);
    float *sd = kvs_xmalloc(ns * sizeof *sd), *want = kvs_xmalloc(4 * (size_t)hd * sizeof *want), *v = want + 2 * hd;
    int32_t *bt = kvs_xmalloc((size_t)m->n_seqs * m->max_blocks * sizeof *bt);
    if (s->bits < 16) o->download(s->env.be, (int32_t *)d, s->dig[layer], 0, nd);
    else o->download(s->env.be, (float *)d, s->dig[layer], 0, nd);
    o->download(s->env.be, sd, s->sdig[layer], 0, ns);
    o->download(s->env.be, bt, m->block_tables, 0, (size_t)m->n_seqs * m->max_blocks);
    const uint32_t *codes = d;
    for (int q = 0; q < s->n_lead; q++) {
        const int cur = m->h_pos[q] / ps;
        if (s->h_keep[q] > cur) continue;
        for (int j = 0; j < (cur + N - 1) / N; j++)
            for (int g = 0; g < nkv; g++) {
                int unb = 0;
                for (int t = 0; t < N && j * N + t < cur && !unb; t++) {
                    const int pg = j * N + t;
                    const size_t pp = (size_t)bt[(size_t)q * m->max_blocks + pg / ppb] * ppb + pg % ppb;
                    if (s->bits < 16) {
                        const uint32_t par = codes[s->n_pages * nkv * 2 * vw + pp * nkv + g], per = 32 / s->bits;
                        const uint32_t *cm = codes + (pp * nkv + g) * 2 * vw, mask = (1u << s->bits) - 1;
                        unb = par == KVS_QD_UNBOUNDED;
                        const float l = kvs_qd_f16_to_f32(par & 0xFFFFu), sc = kvs_qd_f16_to_f32(par >> 16);
                        for (int i = 0; i < hd && !unb; i++) {
                            v[i] = kvs_qd_value(cm[i / per] >> (i % per * s->bits) & mask, l, sc);
                            v[hd + i] = kvs_qd_value(cm[vw + i / per] >> (i % per * s->bits) & mask, l, sc);
                        }
                    } else {
                        memcpy(v, (const float *)d + (pp * nkv + g) * 2 * hd, 2 * (size_t)hd * sizeof *v);
                    }
                    for (int i = 0; i < hd && !unb; i++) {
                        if (t == 0 || v[i] < want[i]) want[i] = v[i];
                        if (t == 0 || v[hd + i] > want[hd + i]) want[hd + i] = v[hd + i];
                    }
                }
                if (unb)
                    for (int i = 0; i < hd; i++) want[i] = -INFINITY, want[hd + i] = INFINITY;
                const float *got = sd + (((size_t)s->h_rslot[q] * s->max_super + j) * nkv + g) * 2 * hd;
                s->stale_pages += memcmp(got, want, 2 * (size_t)hd * sizeof *want) != 0;
            }
    }
    free(d);
    free(sd);
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
    const int fold = !s->sup && s->k->score_select && layer >= s->dense_layers && !s->skip && s->any_sparse && !check_mode &&
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
    if (s->sup) {   /* two-level selection (module comment) */
        const struct kvs_quest_super_args sa = {
            .q = a->q, .dig = s->dig[layer], .sdig = s->sdig[layer], .m = &sub, .keep = s->d_keep, .skeep = s->d_skeep,
            .rslot = s->d_rslot, .refs = s->d_refs, .ref_n = s->d_refn, .n = s->n_lead, .n_heads = a->n_heads,
            .n_kv_heads = a->n_kv_heads, .head_dim = a->head_dim, .block_size = a->block_size, .page_size = s->ps,
            .bits = s->bits, .n_pages = s->n_pages, .max_pages = s->max_pages, .max_spans = s->max_spans,
            .super_pages = s->sup, .max_super = s->max_super, .max_ref = s->max_super, .scores = s->d_scores,
            .n_spans = s->d_n_spans, .spans = s->d_spans};
        s->k->super_select(be, &sa);
        if (check_mode && !s->graph) check_super(s, layer, &sub);
    } else if (s->k->score_select)   /* one kernel where the backend fuses them (CUDA) */
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
        {"kvserve:kv_quest_super_refreshed_total", "Super-page digests recomputed (x selecting layers: once per "
         "layer), kv.quest.super_pages > 0.", 1, s->sup_refs * (s->env.n_layers - s->dense_layers), NULL, NULL},
        {"kvserve:kv_quest_super_scored_total", "Super-pages the sparse decode rows scored (per layer and KV head).", 1,
         s->sup_read, NULL, NULL},
        {"kvserve:kv_quest_stale_digests_total", "Candidate pages (and super-pages) whose digest differed from their keys (counted only "
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
    .seq_init = quest_seq_init,
    .seq_free = quest_seq_free,
    .plan = quest_plan,
    .attend = quest_attend,
    .counters = quest_counters,
};
