/* kv_decode_retro.c: kv.decode=retro (RetroAttention on Quest; STRATEGIES.md §4): Quest's page
 * selection for the newest query, plus retrospective updates of the window's w - 1 past
 * queries, which are supplemented with the selected pages they had not seen.
 *
 *   window     kv.retro.window = w (1: Quest exactly, its code path). A decode step of a request
 *              runs k + 1 rows (kv.h recompute: the runner re-runs its last k tokens from the
 *              updated lower layers and rewrites their K/V; Quest's digests of the rewritten
 *              pages are refreshed by the layer's digest update, which covers every row; in a
 *              step of lead windows only, each inside its newest row's page, that refresh is a
 *              slice of the score launch, as Quest's: KVS_RETRO_FOLD=0 keeps it apart), with
 *              k = min(w - 1, cached past outputs). Prompt tokens never enter the window: a
 *              request's first decode step has k = 0. A request that missed a step (or attended
 *              densely in one) restarts its window. A re-run row is bitwise its first run where
 *              nothing was supplemented below it (on CUDA: where the step's GEMMs are
 *              row-invariant, the decode GEMM at <= 8 rows): in a layer where every window row
 *              keeps its whole context (the dense layers; a step where no newest row selects and
 *              no window row selected) the newest rows run full attention's one-row decode
 *              attention and the past rows keep their cached outputs (attend_kept). Re-running
 *              them through an extend-shaped attention rounded bf16 differently on CUDA, a noise
 *              floor that outweighed the supplements on near-lossless models (bench/RESULTS.md,
 *              quest5).
 *   selection  Quest's (kv_decode_quest.c, kernels/kv_quest.h, kv.quest.* keys, digest_bits
 *              16 / 8 / 4 included) for the newest row of each decoding request, in layers
 *              kv.quest.dense_layers and up; past rows never select. In the layers below the
 *              newest rows attend densely and the past rows keep their cached outputs.
 *   mask       per request, layer and KV head, A[page] = the last decode step (of this request)
 *              that loaded the page (kernels/kv_retro.h kvs_retro_mask_step).
 *   supplement past query t' is shown the selected pages with M[p] < t', clipped to its own
 *              position (kvs_retro_supplement). One attention_spans call runs every row of the
 *              leading decode sequences: the newest over its selection, each past row over its
 *              supplement (no span: lse -inf); attn_merge then merges each past row with its
 *              cached (o, lse); the newest rows merge with lse -inf and a zero row (unchanged).
 *   cache      per layer, the outputs and lse of the last step's rows of the leading
 *              decode sequences (device ACT [rows][n_heads * head_dim] + host F32), in the
 *              last step's row layout: the next step gathers each past row's entry by the row
 *              it had (gather_rows), so no scatter into per-request storage is needed. Sized by
 *              the request slots (min(slots, rows per step) x w rows), counted in
 *              kvserve:kv_retro_cache_bytes and against kv.decode_state_bytes with the arena.
 *   arena      per request (kv.h seq_bytes): the window bookkeeping and (host path) the masks A
 *              [sparse layers][n_kv_heads][max pages] int32.
 *
 * Two paths. Host path (the CPU backend: the reference): the selection is downloaded, masks and
 * supplements are made on the host (kvs_retro_mask_step / kvs_retro_supplement) and uploaded, the
 * merged lse is downloaded into a host cache. Device path (a backend with a Retro kernel table,
 * kernels/kv_retro.h: CUDA; the CPU with kv_decode_retro.h's hook): the masks live on the device
 * (A [slots][sparse layers][n_kv_heads][max pages]). Where the table has a step (CUDA; not in a
 * kept step, KVS_RETRO_STEP=0 turns it off) a selecting layer after Quest's selection is two
 * launches: the fused attend (the paper's kernel: each selected page read once for every row of
 * the request, a past row seeing only the keys of its supplement) with the mask step in its walk,
 * and one kernel for the splits' merge, the merge of the past rows with the cached (o, lse) and
 * the next cache. Otherwise: one kernel makes the mask step and every lead row's spans and M (the
 * page's last load before this step), then the fused attend (a shape it does not take, or
 * KVS_RETRO_FUSED=0: attention_spans over every lead row's spans, planned from the host bound of
 * plan()), then the merge (two caches per layer, alternating by step). Either way a selecting
 * layer issues device work only. Its keys counters accumulate on the device and are read by
 * counters() (one download).
 *
 * kvserve:kv_decode_bytes_read_total counts the supplements as a second read where they are one
 * (the host path, the unfused device path: as of its last layer), not under the fused kernel. Steps whose blocks carry
 * rotation offsets or partial blocks (cached documents) never select and restart every window.
 *
 * Prefix caching: the rewritten K/V of the last w - 1 positions of a request may sit in a full
 * block that kv.reuse=prefix registered; a request sharing it then reads the re-embedded K/V
 * (Retro's own, for the same tokens).
 *
 * Errors: create() returns -EINVAL (bad page size or window), -ENOSYS (no Quest kernels, no
 * attention_spans / attn_merge / gather_rows on the backend, or a storage with a format of its
 * own), -ENOMEM, with a message; plan() returns -EINVAL when a step's rows disagree with the
 * window it asked for (a runner bug).
 */
#include "engine/kv/kv.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/util.h"
#include "engine/config.h"
#include "engine/kv/kv_decode_retro.h"
#include "kernels/kv_quest.h"
#include "kernels/kv_retro.h"

static int table_on_cpu;   /* kv_decode_retro.h */

void kvs_retro_set_table_on_cpu(int on) { table_on_cpu = on; }

struct rseq {
    uint64_t last_step;   /* plan index of the last step whose cache holds this request's rows */
    int t;                /* decode steps so far: the index of the next newest query */
    int n_win;            /* past outputs cached (in the last step's layout) */
    int row0, rows;       /* its rows in the last step */
    int last_sparse;      /* the last step index t whose newest row selected (kept fewer pages than its context); -1 */
    int32_t A[];          /* [sparse layers][n_kv_heads][max_pages] */
};

struct retro {
    struct kvs_kv_decode_env env;
    const struct kvs_quest_kernels *k;
    const struct kvs_retro_kernels *rk;   /* the device path (NULL: the host path) */
    double ratio;
    int min_budget, dense_layers, ps, w;
    int bits;                         /* kv.quest.digest_bits: 16 (KV type) or 8 / 4 (kernels/kv_quest.h codes) */
    size_t n_pages;                   /* physical pages of the pool (the digests' extent) */
    int max_pages, max_spans;
    int rows;                         /* leading decode sequences a step can have */
    int lrows;                        /* their rows (window included) */
    size_t seq_bytes;
    struct rseq **slot;               /* [max_slots] arena pointers */
    /* device */
    struct kvs_dbuf **dig;            /* [n_layers] Quest digests (sparse layers) */
    struct kvs_dbuf **cache;          /* [n_layers] ACT [lrows + 1][n_heads * head_dim]; the last row stays 0 */
    float **h_lse;                    /* [n_layers] [lrows][n_heads] */
    struct kvs_dbuf *d_scores, *d_keep, *d_npos, *d_nqs, *d_nrows, *d_qn;
    struct kvs_dbuf *d_sel_n, *d_sel;             /* the newest rows' selection (Quest's select) */
    struct kvs_dbuf *d_n_spans, *d_spans;         /* every lead row's spans */
    struct kvs_dbuf *d_cidx, *d_iota, *d_ob, *d_lb;
    /* the kept-rows path (attend_kept): the newest rows' dense outputs [lrows + 1][qd] (the last
     * row stays 0), the two lse rows {0, -inf} [2][n_heads], and per lead row which d_on row and
     * which lse row it takes (d_pidx, d_lia) and which lse its cached side gets (d_lib) */
    struct kvs_dbuf *d_on, *d_lsrc, *d_pidx, *d_lia, *d_lib;
    int32_t *h_pidx, *h_lia, *h_lib;
    int32_t *h_keep, *h_npos, *h_nqs, *h_nrows, *h_cidx;
    int32_t *h_sel_n, *h_sel, *h_n_spans, *h_spans, *h_pages, *h_m, *h_plan_n, *h_plan_sp;
    float *h_lb;
    /* device path */
    struct kvs_dbuf *d_A, *d_req, *d_keys, *d_M;
    int fused;                          /* the table's attend (KVS_RETRO_FUSED=0: attention_spans) */
    int one_step;                       /* the table's step where it has one (KVS_RETRO_STEP=0: spans, attend
                                         * and merge apart, the benches' A/B) */
    long long bound_max;                /* this step: the most keys a newest row selects */
    int unfused;                        /* the last device-path layer ran attention_spans */
    struct kvs_dbuf **oc[2], **lc[2];   /* [n_layers] caches of o ACT [lrows][qd] and lse F32 [lrows][nh] */
    int32_t *h_req;
    size_t a_slot;                      /* entries of A per slot */
    /* this step (plan) */
    uint64_t steps;
    int n_lead, n_lrows, any_sparse, any_past, skip;
    int kept;                           /* sparse layers take attend_kept: no newest row selects, and no
                                         * window row selected in its own step (so none has a supplement) */
    int no_fold;                        /* KVS_RETRO_FOLD=0: never fold (below) */
    int gather_q;                       /* KVS_RETRO_GATHER=1: the newest rows' q gathered into d_qn before
                                         * the selection (main's launch until retro13, the benches' A/B) */
    int fold;                           /* the step's only sequences are the lead ones, each window in its
                                         * newest row's page: the selecting layers' digest refresh rides
                                         * score_select's launch (as Quest's one-row steps) */
    /* counters */
    double cache_bytes;
    double bytes_read, sparse_rows, dense_rows, past_rows, keys_own, keys_sup, windows_reset;
    double skipped_rows;   /* lead rows (x layers) the dense pass of a mixed step was told to skip (w = 1) */
    double keys_skipped;   /* keys past rows did not see in their own step (sparse layers, per KV head) */
};

static int sparse_layers(const struct retro *s)
{
    return s->env.n_layers > s->dense_layers ? s->env.n_layers - s->dense_layers : 0;
}

static void retro_destroy(void *state)
{
    struct retro *s = state;
    if (!s) return;
    const struct kvs_backend_ops *o = s->env.o;
    struct kvs_backend *be = s->env.be;
    for (int l = 0; l < s->env.n_layers; l++) {
        if (s->dig) o->free_buf(be, s->dig[l]);
        if (s->cache) o->free_buf(be, s->cache[l]);
        if (s->h_lse) free(s->h_lse[l]);
    }
    for (int i = 0; i < 2; i++)
        for (int l = 0; l < s->env.n_layers; l++) {
            if (s->oc[i]) o->free_buf(be, s->oc[i][l]);
            if (s->lc[i]) o->free_buf(be, s->lc[i][l]);
        }
    for (int i = 0; i < 2; i++) free(s->oc[i]), free(s->lc[i]);
    o->free_buf(be, s->d_A);
    o->free_buf(be, s->d_req);
    o->free_buf(be, s->d_keys);
    o->free_buf(be, s->d_M);
    free(s->h_req);
    free(s->dig);
    free(s->cache);
    free(s->h_lse);
    struct kvs_dbuf *bs[] = {s->d_scores, s->d_keep, s->d_npos,   s->d_nqs,  s->d_nrows, s->d_qn, s->d_sel_n,
                             s->d_sel,    s->d_n_spans, s->d_spans, s->d_cidx, s->d_iota,  s->d_ob, s->d_lb,
                             s->d_on,     s->d_lsrc, s->d_pidx, s->d_lia, s->d_lib};
    for (size_t i = 0; i < sizeof bs / sizeof bs[0]; i++) o->free_buf(be, bs[i]);
    void *hs[] = {s->h_keep, s->h_npos, s->h_nqs,     s->h_nrows,   s->h_cidx,  s->h_sel_n, s->h_sel, s->h_n_spans,
                  s->h_spans, s->h_pages, s->h_m, s->h_plan_n, s->h_plan_sp, s->h_lb,   s->slot,
                  s->h_pidx, s->h_lia, s->h_lib};
    for (size_t i = 0; i < sizeof hs / sizeof hs[0]; i++) free(hs[i]);
    free(s);
}

/* pages a newest row of context ctx keeps (kv_decode_quest.c's rule) */
static int keep_pages(const struct retro *s, int ctx)
{
    double b = ceil(s->ratio * (double)ctx);
    if (b < s->min_budget) b = s->min_budget;
    const double k = ceil(b / s->ps);
    return k > (double)(1 << 30) ? 1 << 30 : (int)k;
}

static int retro_max_recompute(const struct kvs_config *cfg)
{
    const int w = cfg && cfg->retro_window > 0 ? cfg->retro_window : 2;
    return w - 1;
}

static int retro_create(const struct kvs_kv_decode_env *env, void **state, char *err, size_t errlen)
{
    const struct kvs_config *c = env->cfg;
    const double ratio = c ? c->quest_budget_ratio : 0.15;
    const int min_budget = c ? c->quest_min_budget : 256, dense = c ? c->quest_dense_layers : 2;
    const int ps = c && c->quest_page_size > 0 ? c->quest_page_size : env->block_size;
    const int w = retro_max_recompute(c) + 1;
    const struct kvs_backend_ops *o = env->o;
    if (w < 1 || w > 64) return kvs_err(err, errlen, -EINVAL, "config key 'kv.retro.window': %d out of [1, 64]", w);
    if (ps <= 0 || env->block_size % ps)
        return kvs_err(err, errlen, -EINVAL, "config key 'kv.quest.page_size': %d does not divide kv.block_size %d", ps,
                       env->block_size);
    if (ratio <= 0 || min_budget < 0 || dense < 0)
        return kvs_err(err, errlen, -EINVAL, "kv.quest: budget_ratio %g, min_budget %d, dense_layers %d out of range",
                       ratio, min_budget, dense);
    const int bits = c && c->quest_digest_bits ? c->quest_digest_bits : KVS_QUEST_DIGEST_BITS_DEFAULT;
    if ((bits != 16 && bits != 8 && bits != 4) || (bits < 16 && env->head_dim * bits % 32))
        return kvs_err(err, errlen, -EINVAL, "config key 'kv.quest.digest_bits': %d (16, 8 or 4; 8 and 4 need "
                       "head_dim x bits a multiple of 32, head_dim is %d)", bits, env->head_dim);
    /* Retro selects with Quest's one-level kernels; the two-level selection is Quest's alone */
    if (c && c->quest_super_pages > 0)
        return kvs_err(err, errlen, -ENOSYS, "config key 'kv.quest.super_pages' %d: the two-level selection is not "
                       "implemented for kv.decode \"retro\" (set it to 0, or use kv.decode \"quest\")",
                       c->quest_super_pages);
    if (!o->attention_spans || !o->attn_merge || !o->gather_rows)
        return kvs_err(err, errlen, -ENOSYS, "kv.decode \"retro\": backend %s lacks attention_spans, attn_merge or "
                       "gather_rows", o->name);
    if (env->storage_fmt)
        return kvs_err(err, errlen, -ENOSYS, "kv.decode \"retro\": its Quest digests read the plain KV pool, not "
                       "kv.storage \"%s\"", env->storage_fmt);
    const struct kvs_quest_kernels *k = kvs_quest_kernels_for(o, err, errlen);
    if (!k) return -ENOSYS;
    if (bits < 16 && (!k->qdigest_update || !k->qscore))
        return kvs_err(err, errlen, -ENOSYS, "kv.quest.digest_bits %d: backend %s has no quantized digest kernels", bits,
                       o->name);

    struct retro *s = kvs_xcalloc(1, sizeof *s);
    s->env = *env;
    s->k = k;
    s->bits = bits;
    s->ratio = ratio, s->min_budget = min_budget, s->dense_layers = dense, s->ps = ps, s->w = w;
    s->max_pages = env->max_blocks * (env->block_size / ps);
    s->max_spans = keep_pages(s, env->max_blocks * env->block_size);
    if (s->max_spans > s->max_pages) s->max_spans = s->max_pages;
    if (s->max_spans < 1) s->max_spans = 1;
    s->rows = env->max_slots < env->max_rows ? env->max_slots : env->max_rows;
    s->lrows = s->rows * w < env->max_rows ? s->rows * w : env->max_rows;
    const int L = env->n_layers, nkv = env->n_kv_heads, qd = env->n_heads * env->head_dim;
    if (w > 1 && (strcmp(o->name, "cpu") || table_on_cpu)) s->rk = kvs_retro_kernels_for(o);
    s->a_slot = (size_t)sparse_layers(s) * nkv * s->max_pages;
    s->seq_bytes = sizeof(struct rseq) + (s->rk ? 0 : s->a_slot * sizeof(int32_t));
    const size_t rows = (size_t)s->rows, lrows = (size_t)s->lrows, ms = (size_t)s->max_spans;
    const size_t pages = (size_t)env->n_pool_blocks * (size_t)(env->block_size / ps);
    size_t cache_bytes = 0;
    int failed = pages == 0;
    s->n_pages = pages;
    s->dig = kvs_xcalloc((size_t)L, sizeof *s->dig);
    s->cache = kvs_xcalloc((size_t)L, sizeof *s->cache);
    s->h_lse = kvs_xcalloc((size_t)L, sizeof *s->h_lse);
    /* digests for the sparse layers; the output cache for every layer (a past row's dense-layer
     * output is its cached one, attend_kept) */
    for (int l = 0; l < L && !failed; l++) {
        if (l >= dense)
            failed = !(s->dig[l] = bits < 16 ? o->alloc(env->be, KVS_BUF_I32,
                                                        kvs_quest_qdig_words(pages, nkv, env->head_dim, bits))
                                             : o->alloc(env->be, KVS_BUF_KV, pages * nkv * 2 * (size_t)env->head_dim));
        if (w > 1 && !failed && s->rk) {
            for (int i = 0; i < 2 && !failed; i++) {
                if (!s->oc[i]) s->oc[i] = kvs_xcalloc((size_t)L, sizeof **s->oc), s->lc[i] = kvs_xcalloc((size_t)L, sizeof **s->lc);
                failed = !(s->oc[i][l] = o->alloc(env->be, KVS_BUF_ACT, lrows * qd)) ||
                         !(s->lc[i][l] = o->alloc(env->be, KVS_BUF_F32, lrows * env->n_heads));
                cache_bytes += lrows * qd * o->elem_size(env->be, KVS_BUF_ACT) + lrows * env->n_heads * sizeof(float);
            }
        } else if (w > 1 && !failed) {
            failed = !(s->cache[l] = o->alloc(env->be, KVS_BUF_ACT, (lrows + 1) * qd));
            if (!failed) o->zero(env->be, s->cache[l], 0, (lrows + 1) * qd);
            s->h_lse[l] = kvs_xcalloc(lrows * env->n_heads, sizeof(float));
            cache_bytes += (lrows + 1) * qd * o->elem_size(env->be, KVS_BUF_ACT) + lrows * env->n_heads * sizeof(float);
        }
    }
    if (!failed) {
        s->d_scores = o->alloc(env->be, KVS_BUF_F32, rows * nkv * (size_t)s->max_pages);
        s->d_keep = o->alloc(env->be, KVS_BUF_I32, rows);
        s->d_npos = o->alloc(env->be, KVS_BUF_I32, rows);
        s->d_nqs = o->alloc(env->be, KVS_BUF_I32, rows + 1);
        s->d_nrows = o->alloc(env->be, KVS_BUF_I32, rows);
        s->d_qn = o->alloc(env->be, KVS_BUF_ACT, rows * qd);
        s->d_sel_n = o->alloc(env->be, KVS_BUF_I32, rows * nkv);
        s->d_sel = o->alloc(env->be, KVS_BUF_I32, rows * nkv * ms * 2);
        s->d_n_spans = o->alloc(env->be, KVS_BUF_I32, lrows * nkv);
        s->d_spans = o->alloc(env->be, KVS_BUF_I32, lrows * nkv * ms * 2);
        s->d_cidx = o->alloc(env->be, KVS_BUF_I32, lrows);
        s->d_iota = o->alloc(env->be, KVS_BUF_I32, lrows);
        s->d_ob = o->alloc(env->be, KVS_BUF_ACT, lrows * qd);
        s->d_lb = o->alloc(env->be, KVS_BUF_F32, lrows * env->n_heads);
        s->d_on = o->alloc(env->be, KVS_BUF_ACT, (lrows + 1) * qd);
        s->d_lsrc = o->alloc(env->be, KVS_BUF_F32, 2 * (size_t)env->n_heads);
        s->d_pidx = o->alloc(env->be, KVS_BUF_I32, lrows);
        s->d_lia = o->alloc(env->be, KVS_BUF_I32, lrows);
        s->d_lib = o->alloc(env->be, KVS_BUF_I32, lrows);
        failed = !s->d_scores || !s->d_keep || !s->d_npos || !s->d_nqs || !s->d_nrows || !s->d_qn || !s->d_sel_n ||
                 !s->d_sel || !s->d_n_spans || !s->d_spans || !s->d_cidx || !s->d_iota || !s->d_ob || !s->d_lb ||
                 !s->d_on || !s->d_lsrc || !s->d_pidx || !s->d_lia || !s->d_lib;
        if (!failed) {
            o->zero(env->be, s->d_on, 0, (lrows + 1) * qd);
            float *ls = kvs_xcalloc(2 * (size_t)env->n_heads, sizeof *ls);
            for (int h = 0; h < env->n_heads; h++) ls[env->n_heads + h] = -INFINITY;
            o->upload(env->be, s->d_lsrc, 0, ls, 2 * (size_t)env->n_heads);
            free(ls);
        }
    }
    if (!failed && s->rk) {
        /* the masks count as request state (they replace the arena's) */
        s->d_A = o->alloc(env->be, KVS_BUF_I32, s->a_slot * (size_t)env->max_slots + 1);
        s->d_req = o->alloc(env->be, KVS_BUF_I32, rows * 5);
        s->d_keys = o->alloc(env->be, KVS_BUF_I32, 4);
        const char *fe = getenv("KVS_RETRO_FUSED");
        s->fused = s->rk->attend && !(fe && !strcmp(fe, "0"));
        fe = getenv("KVS_RETRO_STEP");
        s->one_step = !(fe && !strcmp(fe, "0"));
        fe = getenv("KVS_RETRO_FOLD");   /* "0": the refresh its own launch in every step (the benches' A/B) */
        s->no_fold = fe && !strcmp(fe, "0");
        fe = getenv("KVS_RETRO_GATHER");
        s->gather_q = fe && !strcmp(fe, "1");
        if (s->fused) s->d_M = o->alloc(env->be, KVS_BUF_I32, rows * nkv * (size_t)s->max_pages);
        failed = !s->d_A || !s->d_req || !s->d_keys || (s->fused && !s->d_M);
        if (!failed) o->zero(env->be, s->d_keys, 0, 4);
        cache_bytes += s->a_slot * (size_t)env->max_slots * sizeof(int32_t);
    }
    if (failed) {
        retro_destroy(s);
        return kvs_err(err, errlen, -ENOMEM, "kv.decode \"retro\": no backend memory for the page digests (%zu pages x "
                       "%d layers), the output cache (%d rows) and selection buffers", pages, L, s->lrows);
    }
    if (c && c->kv_decode_state_bytes > 0 &&
        (double)cache_bytes + (double)s->seq_bytes * env->max_slots > (double)c->kv_decode_state_bytes) {
        const double need = (double)cache_bytes + (double)s->seq_bytes * env->max_slots;
        retro_destroy(s);
        return kvs_err(err, errlen, -ENOMEM, "config key 'kv.decode_state_bytes': retro needs %.0f bytes (output cache "
                       "and %d request states), over the budget of %lld bytes", need, env->max_slots,
                       (long long)c->kv_decode_state_bytes);
    }
    s->h_keep = kvs_xcalloc(rows, sizeof(int32_t));
    s->h_npos = kvs_xcalloc(rows, sizeof(int32_t));
    s->h_nqs = kvs_xcalloc(rows + 1, sizeof(int32_t));
    s->h_nrows = kvs_xcalloc(rows, sizeof(int32_t));
    s->h_cidx = kvs_xcalloc(lrows, sizeof(int32_t));
    s->h_sel_n = kvs_xcalloc(rows * nkv, sizeof(int32_t));
    s->h_sel = kvs_xcalloc(rows * nkv * ms * 2, sizeof(int32_t));
    s->h_n_spans = kvs_xcalloc(lrows * nkv, sizeof(int32_t));
    s->h_spans = kvs_xcalloc(lrows * nkv * ms * 2, sizeof(int32_t));
    s->h_plan_n = kvs_xcalloc(lrows * nkv, sizeof(int32_t));
    s->h_plan_sp = kvs_xcalloc(lrows * nkv * ms * 2, sizeof(int32_t));
    s->h_pages = kvs_xcalloc((size_t)s->max_pages, sizeof(int32_t));
    s->h_m = kvs_xcalloc((size_t)s->max_pages, sizeof(int32_t));
    s->h_lb = kvs_xcalloc(lrows * env->n_heads, sizeof(float));
    s->h_pidx = kvs_xcalloc(lrows, sizeof(int32_t));
    s->h_lia = kvs_xcalloc(lrows, sizeof(int32_t));
    s->h_lib = kvs_xcalloc(lrows, sizeof(int32_t));
    s->h_req = kvs_xcalloc(rows * 5, sizeof(int32_t));
    s->slot = kvs_xcalloc((size_t)env->max_slots, sizeof *s->slot);
    int32_t *iota = kvs_xmalloc(lrows * sizeof *iota);
    for (size_t i = 0; i < lrows; i++) iota[i] = (int32_t)i;
    o->upload(env->be, s->d_iota, 0, iota, lrows);
    free(iota);
    s->cache_bytes = (double)cache_bytes;
    *state = s;
    return 0;
}

static size_t retro_seq_bytes(void *state) { return ((struct retro *)state)->seq_bytes; }

static int retro_seq_init(void *state, int slot, void *mem)
{
    struct retro *s = state;
    if (slot < 0 || slot >= s->env.max_slots || !mem) return -EINVAL;
    struct rseq *q = mem;
    if (s->rk) s->rk->reset(s->env.be, s->d_A, (size_t)slot * s->a_slot, s->a_slot);   /* never loaded */
    else
        for (size_t i = 0; i < s->a_slot; i++) q->A[i] = -1;
    q->last_step = 0, q->t = 0, q->n_win = 0, q->last_sparse = -1;
    s->slot[slot] = q;
    return 0;
}

static void retro_seq_free(void *state, int slot)
{
    struct retro *s = state;
    if (slot >= 0 && slot < s->env.max_slots) s->slot[slot] = NULL;
}

/* kv.h recompute: the past rows this request's next decode step re-runs */
static int retro_recompute(void *state, int slot)
{
    struct retro *s = state;
    const struct rseq *q = slot >= 0 && slot < s->env.max_slots ? s->slot[slot] : NULL;
    if (!q || q->last_step != s->steps || s->steps == 0) return 0;   /* missed the last step: restart */
    return q->n_win < s->w - 1 ? q->n_win : s->w - 1;
}

static int retro_plan(void *state, const struct kvs_kv_step *st)
{
    struct retro *s = state;
    const uint64_t prev = s->steps++;
    const int nkv = s->env.n_kv_heads, L = s->env.n_layers, ms = s->max_spans;
    const int dense_l = s->dense_layers < L ? s->dense_layers : L;
    const double per_layer = (double)s->env.kv_bytes_per_token / (double)L;
    s->skip = st->m->rot_offsets != NULL || st->m->block_valid != NULL;
    s->n_lead = 0;
    s->any_sparse = 0;
    s->any_past = 0;
    s->kept = 1;
    while (!s->skip && s->n_lead < st->n_seqs && s->n_lead < s->rows && st->h_decode[s->n_lead] &&
           st->h_slot[s->n_lead] >= 0 && st->h_slot[s->n_lead] < s->env.max_slots && s->slot[st->h_slot[s->n_lead]] &&
           st->h_q_start[s->n_lead + 1] <= s->lrows)
        s->n_lead++;
    s->n_lrows = st->h_q_start[s->n_lead];
    s->fold = s->n_lead == st->n_seqs && s->w > 1 && !s->no_fold;
    /* the window bookkeeping of every sequence; decode rows outside the lead attend densely */
    for (int q = 0; q < st->n_seqs; q++) {
        const int slot = st->h_slot[q];
        struct rseq *rs = slot >= 0 && slot < s->env.max_slots ? s->slot[slot] : NULL;
        const int rows = st->h_q_start[q + 1] - st->h_q_start[q];
        const int past = st->h_decode[q] ? rows - 1 : 0;
        if (rs && past > 0 && (q >= s->n_lead || rs->last_step != prev || past > rs->n_win)) {
            if (q < s->n_lead) return -EINVAL;   /* rows the policy did not ask for */
        }
        if (!st->h_decode[q]) {
            if (rs) rs->n_win = 0;
            continue;
        }
        const int pos = st->h_pos[q] + rows - 1, ctx = pos + 1, cur = pos / s->ps;
        const int keep = keep_pages(s, ctx);
        if (q >= s->n_lead) {
            if (rs) {
                rs->n_win = 0;
                rs->t++;
                s->windows_reset++;
            }
            if (keep <= cur && !s->skip) s->dense_rows++;
            s->bytes_read += (double)ctx * per_layer * L;   /* one read for all its rows */
            continue;
        }
        if (rs->last_step != prev) s->windows_reset += rs->n_win > 0;
        /* the newest row: Quest's cost; the past rows: in dense layers attention() reads the
         * sequence's K/V once for all its rows, in sparse layers their supplements are a second
         * read (counted in attend) */
        s->past_rows += past;
        s->any_past |= past > 0;
        if (past > 0) {
            /* the keys the window's newest past row (re-run for the first time) skipped in its own
             * step, for the supplement's share (keys_supplement / keys_skipped) */
            const int pctx = ctx - 1, pcur = (pctx - 1) / s->ps, pkeep = keep_pages(s, pctx);
            const int pown = pkeep > pcur ? pctx : (pkeep - 1) * s->ps + (pctx - pcur * s->ps);
            s->keys_skipped += (double)(pctx - pown) * s->env.n_kv_heads * sparse_layers(s);
        }
        if (keep > cur || dense_l == L) {
            s->bytes_read += (double)ctx * per_layer * L;
        } else {
            const int kept = (keep - 1) * s->ps + (ctx - cur * s->ps);
            s->sparse_rows++;
            s->bytes_read += per_layer * ((double)ctx * dense_l + (double)(kept + cur) * (L - dense_l));
        }
    }
    for (int q = 0; q < s->n_lead; q++) {
        const int rows = st->h_q_start[q + 1] - st->h_q_start[q];
        const int pos = st->h_pos[q] + rows - 1, ctx = pos + 1, cur = pos / s->ps;
        int keep = keep_pages(s, ctx);
        if (keep > cur + 1) keep = cur + 1;
        s->h_keep[q] = keep;
        s->h_npos[q] = pos;
        s->h_nqs[q] = q;
        s->h_nrows[q] = st->h_q_start[q + 1] - 1;
        s->fold &= st->h_pos[q] / s->ps == cur;   /* the window's first row in the newest row's page */
        s->h_req[5 * q] = st->h_q_start[q], s->h_req[5 * q + 1] = rows, s->h_req[5 * q + 2] = pos;
        s->h_req[5 * q + 3] = s->slot[st->h_slot[q]]->t, s->h_req[5 * q + 4] = st->h_slot[q];
        s->any_sparse |= keep <= cur;
        struct rseq *rs = s->slot[st->h_slot[q]];
        if (keep <= cur) rs->last_sparse = rs->t;
        if (rows > 1 && rs->last_sparse >= rs->t - (rows - 1)) s->kept = 0;
        /* where each past row's cached output sits in the last step's layout; the newest rows
         * read the zero row */
        for (int j = 0; j < rows; j++) {
            const int row = st->h_q_start[q] + j;
            s->h_cidx[row] = j < rows - 1 ? rs->row0 + rs->rows - (rows - 1) + j : s->lrows;
            /* attend_kept: the newest row takes its dense output (lse 0, cached side -inf), a
             * past row the zero row (lse -inf, cached side 0) */
            s->h_pidx[row] = j < rows - 1 ? s->lrows : q;
            s->h_lia[row] = j < rows - 1;
            s->h_lib[row] = j == rows - 1;
        }
        /* launch planning for the selection: one span bounding the kept keys */
        const int bound = keep * s->ps < ctx ? keep * s->ps : ctx;
        if (q == 0 || bound > s->bound_max) s->bound_max = bound;
        for (int j = 0; j < rows; j++)
            for (int g = 0; g < nkv; g++) {
                const size_t t = (size_t)(st->h_q_start[q] + j) * nkv + g;
                s->h_plan_n[t] = 1;
                s->h_plan_sp[t * ms * 2] = 0, s->h_plan_sp[t * ms * 2 + 1] = bound;
            }
    }
    s->kept &= !s->any_sparse;
    s->h_nqs[s->n_lead] = s->n_lead;
    /* what the cache will hold after this step */
    for (int q = 0; q < s->n_lead; q++) {
        struct rseq *rs = s->slot[st->h_slot[q]];
        const int rows = st->h_q_start[q + 1] - st->h_q_start[q];
        rs->row0 = st->h_q_start[q];
        rs->rows = rows;
        rs->last_step = s->steps;
        rs->n_win = s->w > 1 ? (rows < s->w - 1 ? rows : s->w - 1) : 0;
    }
    if (s->n_lead) {
        const struct kvs_backend_ops *o = s->env.o;
        struct kvs_backend *be = s->env.be;
        o->upload(be, s->d_keep, 0, s->h_keep, (size_t)s->n_lead);
        if (s->w > 1) {
            o->upload(be, s->d_npos, 0, s->h_npos, (size_t)s->n_lead);
            o->upload(be, s->d_nqs, 0, s->h_nqs, (size_t)s->n_lead + 1);
            o->upload(be, s->d_nrows, 0, s->h_nrows, (size_t)s->n_lead);
            o->upload(be, s->d_cidx, 0, s->h_cidx, (size_t)s->n_lrows);
            o->upload(be, s->d_pidx, 0, s->h_pidx, (size_t)s->n_lrows);
            o->upload(be, s->d_lia, 0, s->h_lia, (size_t)s->n_lrows);
            o->upload(be, s->d_lib, 0, s->h_lib, (size_t)s->n_lrows);
            if (s->rk) o->upload(be, s->d_req, 0, s->h_req, (size_t)s->n_lead * 5);
        }
    }
    return 0;
}

/* The step's t counters move on after the layers (finish of the last layer). */
static void retro_finish(void *state, int layer, const struct kvs_kv_step *st)
{
    struct retro *s = state;
    if (layer != s->env.n_layers - 1) return;
    for (int q = 0; q < s->n_lead; q++) s->slot[st->h_slot[q]]->t++;
}

/* Quest's digest refresh and scores at the digests' width (kv.quest.digest_bits) */
static void retro_digest_update(struct retro *s, const struct kvs_dbuf *kc, const struct kvs_attn_meta *m, int layer)
{
    const struct kvs_kv_decode_env *e = &s->env;
    if (s->bits < 16)
        s->k->qdigest_update(e->be, kc, m, e->n_kv_heads, e->head_dim, e->block_size, s->ps, s->bits, s->n_pages,
                             s->dig[layer]);
    else
        s->k->digest_update(e->be, kc, m, e->n_kv_heads, e->head_dim, e->block_size, s->ps, s->dig[layer]);
}

/* Quest's scores and selection of rows 0 .. n-1 into d_sel_n / d_sel: one kernel where the
 * backend fuses them (CUDA), else the scores then the select */
static void retro_select(struct retro *s, const struct kvs_dbuf *q, int layer, const struct kvs_attn_meta *m, int n,
                        int n_heads, const struct kvs_dbuf *kc, const struct kvs_attn_meta *wm)
{
    const struct kvs_kv_decode_env *e = &s->env;
    if (s->k->score_select) {   /* wm: the step's refresh too (s->fold) */
        s->k->score_select(e->be, q, s->dig[layer], m, s->d_keep, n, n_heads, e->n_kv_heads, e->head_dim,
                           e->block_size, s->ps, s->bits, s->n_pages, s->max_pages, s->max_spans, s->d_scores, 0,
                           s->d_sel_n, s->d_sel, kc, wm);
        return;
    }
    if (wm) retro_digest_update(s, kc, wm, layer);
    if (s->bits < 16)
        s->k->qscore(e->be, q, s->dig[layer], m, s->d_keep, n, n_heads, e->n_kv_heads, e->head_dim, e->block_size,
                     s->ps, s->bits, s->n_pages, s->max_pages, s->d_scores);
    else
        s->k->score(e->be, q, s->dig[layer], m, s->d_keep, n, n_heads, e->n_kv_heads, e->head_dim, e->block_size,
                    s->ps, s->max_pages, s->d_scores);
    s->k->select(e->be, s->d_scores, m, s->d_keep, n, e->n_kv_heads, s->ps, s->max_pages, s->max_spans, s->d_sel_n,
                 s->d_sel);
}

/* The w = 1 path: Quest's attend (kv_decode_quest.c), over the lead sequences. */
static void attend_quest(struct retro *s, int layer, const struct kvs_kv_attend *a)
{
    const struct kvs_backend_ops *o = s->env.o;
    struct kvs_backend *be = s->env.be;
    const struct kvs_kv_step *st = a->step;
    if (st->n_rows > s->n_lead) {
        /* the lead rows' output is overwritten below: the dense pass may skip them (backend.h
         * skip_lead) */
        struct kvs_attn_meta dm = *st->m;
        dm.skip_lead = s->n_lead;
        s->skipped_rows += s->n_lead;
        o->attention(be, a->q, a->kv.k, a->kv.v, &dm, st->n_rows, a->n_heads, a->n_kv_heads, a->head_dim,
                     a->block_size, a->scale, a->out);
    }
    struct kvs_attn_meta sub = *st->m;
    sub.n_seqs = s->n_lead;
    sub.max_ctx = 0;
    for (int q = 0; q < s->n_lead; q++)
        if (st->h_pos[q] + 1 > sub.max_ctx) sub.max_ctx = st->h_pos[q] + 1;
    retro_select(s, a->q, layer, &sub, s->n_lead, a->n_heads, NULL, NULL);
    const struct kvs_span_list sp = {s->max_spans, s->d_sel_n, s->d_sel, s->h_plan_n, s->h_plan_sp};
    o->attention_spans(be, a->q, a->kv.k, a->kv.v, &sub, &sp, s->n_lead, a->n_heads, a->n_kv_heads, a->head_dim,
                       a->block_size, a->scale, a->out, a->lse);
    /* counters: the keys each newest query saw */
    for (int q = 0; q < s->n_lead; q++) {
        const int ctx = st->h_pos[q] + 1, cur = st->h_pos[q] / s->ps;
        const int keep = s->h_keep[q];
        s->keys_own += (double)a->n_kv_heads * (keep > cur ? ctx : (keep - 1) * s->ps + (ctx - cur * s->ps));
    }
}

/* Pages of one row's spans (ascending). */
static int spans_to_pages(const int32_t *sp, int n, int ps, int32_t *pages)
{
    int np = 0;
    for (int i = 0; i < n; i++)
        for (int p = sp[2 * i] / ps; p * ps < sp[2 * i + 1]; p++) pages[np++] = p;
    return np;
}

void kvs_retro_refresh_digests(void *state, const struct kvs_dbuf *kc, const struct kvs_attn_meta *m)
{
    struct retro *s = state;
    for (int l = s->dense_layers; l < s->env.n_layers; l++) retro_digest_update(s, kc, m, l);
}

/* The lead sequences' newest rows as a step of one-row sequences (Quest's selection and the
 * kept-rows path run on it). */
static void newest_meta(const struct retro *s, const struct kvs_kv_step *st, struct kvs_attn_meta *nm)
{
    *nm = *st->m;
    nm->n_seqs = s->n_lead;
    nm->q_start = s->d_nqs, nm->pos = s->d_npos, nm->h_q_start = s->h_nqs, nm->h_pos = s->h_npos;
    nm->max_ctx = 0;
    for (int q = 0; q < s->n_lead; q++)
        if (s->h_npos[q] + 1 > nm->max_ctx) nm->max_ctx = s->h_npos[q] + 1;
}

/* The kept-rows path, for a layer where every newest row of the lead attends its whole context
 * (a dense layer, or a step where no newest row selects): the newest rows run attention() as the
 * one-row decode step that full attention runs (the same kernel and launch shape, so on CUDA the
 * same bits as kv.decode=full), and each past row takes its cached output unchanged (it saw its
 * whole context when it was newest: nothing can supplement it). Re-running a past row through
 * an extend-shaped attention instead rounds bf16 differently on CUDA (other kernels, other
 * splits), and that noise rivalled Quest's whole loss on near-lossless models (bench/RESULTS.md,
 * quest5); with this path a past row's re-run is bitwise its first run wherever nothing was
 * supplemented below it, on every backend whose GEMMs are row-invariant at the step's row count.
 * Both are merges with exact weights (1 and 0): the newest rows with lse 0 against a zero row at
 * -inf, the past rows at -inf against their cached row at 0. */
static void attend_kept(struct retro *s, int layer, const struct kvs_kv_attend *a, const struct kvs_attn_meta *nm)
{
    const struct kvs_backend_ops *o = s->env.o;
    struct kvs_backend *be = s->env.be;
    const int nh = a->n_heads, hd = a->head_dim, qd = nh * hd, nl = s->n_lead, nr = s->n_lrows;
    o->gather_rows(be, a->q, s->d_nrows, nl, qd, s->d_qn);
    struct kvs_attn_meta km = *nm;
    km.plan_ctx = a->step->decode_plan_ctx;   /* full attention's launch shape (a graph's, where it records) */
    o->attention(be, s->d_qn, a->kv.k, a->kv.v, &km, nl, nh, a->n_kv_heads, hd, a->block_size, a->scale, s->d_on);
    o->gather_rows(be, s->d_on, s->d_pidx, nr, qd, a->out);
    o->gather_rows(be, s->d_lsrc, s->d_lia, nr, nh, a->lse);
    if (s->rk) {
        const int cur = (int)(s->steps & 1);
        s->rk->merge(be, a->out, a->lse, s->d_cidx, nr, nh, hd, s->oc[cur ^ 1][layer], s->lc[cur ^ 1][layer], s->lrows,
                     s->oc[cur][layer], s->lc[cur][layer]);
        return;
    }
    o->gather_rows(be, s->cache[layer], s->d_cidx, nr, qd, s->d_ob);
    o->gather_rows(be, s->d_lsrc, s->d_lib, nr, nh, s->d_lb);
    o->attn_merge(be, a->out, a->lse, s->d_ob, s->d_lb, nr, nh, hd);
    o->gather_rows(be, a->out, s->d_iota, nr, qd, s->cache[layer]);
    o->download(be, s->h_lse[layer], a->lse, 0, (size_t)nr * nh);
}

static void retro_attend(void *state, int layer, const struct kvs_kv_attend *a)
{
    struct retro *s = state;
    const struct kvs_backend_ops *o = s->env.o;
    struct kvs_backend *be = s->env.be;
    const struct kvs_kv_step *st = a->step;
    /* a selecting layer of a step of lead windows only, each in its newest row's page: the
     * refresh of the pages they wrote (their current pages, which no selection reads) goes into
     * score_select's launch (retro_select below); else its own launch, every written page */
    const int fold = s->fold && layer >= s->dense_layers && !s->skip && s->n_lead && s->any_sparse && s->k->score_select;
    if (layer >= s->dense_layers && !s->skip && !fold)   /* every written page, prefill steps too */
        retro_digest_update(s, a->kv.k, st->m, layer);
    if (layer < s->dense_layers && s->w > 1 && !s->skip && s->n_lead) {
        if (st->n_rows > s->n_lrows)   /* rows past the lead (prefill chunks) */
            o->attention(be, a->q, a->kv.k, a->kv.v, st->m, st->n_rows, a->n_heads, a->n_kv_heads, a->head_dim,
                         a->block_size, a->scale, a->out);
        struct kvs_attn_meta nm;
        newest_meta(s, st, &nm);
        attend_kept(s, layer, a, &nm);
        return;
    }
    if (layer < s->dense_layers || s->skip || !s->n_lead || (s->w == 1 && !s->any_sparse)) {
        o->attention(be, a->q, a->kv.k, a->kv.v, st->m, st->n_rows, a->n_heads, a->n_kv_heads, a->head_dim,
                     a->block_size, a->scale, a->out);
        return;
    }
    if (s->w == 1) {
        attend_quest(s, layer, a);
        return;
    }
    const int nkv = a->n_kv_heads, nh = a->n_heads, qd = nh * a->head_dim, ms = s->max_spans, nl = s->n_lead;
    const int sl = layer - s->dense_layers, nr = s->n_lrows;
    if (st->n_rows > nr)   /* rows past the lead (prefill chunks) */
        o->attention(be, a->q, a->kv.k, a->kv.v, st->m, st->n_rows, nh, nkv, a->head_dim, a->block_size, a->scale,
                     a->out);
    /* 1. Quest's selection for the newest rows, as a step of one-row sequences at the newest
     * positions; the scores read each window's newest row of q in place (kv_quest.h score: the
     * last row of q_start's sequence), so no gather launch */
    struct kvs_attn_meta nm;
    newest_meta(s, st, &nm);
    if (s->gather_q) {
        o->gather_rows(be, a->q, s->d_nrows, nl, qd, s->d_qn);
        retro_select(s, s->d_qn, layer, &nm, nl, nh, fold ? a->kv.k : NULL, fold ? st->m : NULL);
    } else {
        struct kvs_attn_meta sm = nm;
        sm.q_start = st->m->q_start, sm.h_q_start = st->m->h_q_start;
        retro_select(s, a->q, layer, &sm, nl, nh, fold ? a->kv.k : NULL, fold ? st->m : NULL);
    }
    struct kvs_attn_meta sub = *st->m;
    sub.n_seqs = nl;
    sub.max_ctx = nm.max_ctx;
    if (s->rk) {
        /* device path: mask and spans, every lead row's attention, merge and next cache */
        const int cur = (int)(s->steps & 1);
        if (!s->kept && s->fused && s->one_step && s->rk->step) {   /* the three in fewer launches */
            const int rc = s->rk->step(be, a->q, a->kv.k, a->kv.v, &sub, s->d_sel_n, s->d_sel, ms, s->d_req, s->d_A,
                                       sparse_layers(s), sl, s->d_M, s->d_keys, s->max_pages, s->ps, nl, nh, nkv,
                                       a->head_dim, a->block_size, a->scale, s->bound_max, s->d_cidx,
                                       s->oc[cur ^ 1][layer], s->lc[cur ^ 1][layer], s->lrows, s->oc[cur][layer],
                                       s->lc[cur][layer], a->out, a->lse);
            if (!rc) {
                s->unfused = 0;
                return;
            }
        }
        s->rk->spans(be, s->d_sel_n, s->d_sel, s->d_req, nl, nkv, ms, s->ps, s->d_A, sparse_layers(s), sl,
                     s->max_pages, s->d_n_spans, s->d_spans, s->d_keys, s->fused ? s->d_M : NULL);
        if (s->kept) {   /* every window row keeps its whole context (the mask step is done) */
            attend_kept(s, layer, a, &nm);
            return;
        }
        int rc = -ENOSYS;
        if (s->fused)
            rc = s->rk->attend(be, a->q, a->kv.k, a->kv.v, &sub, s->d_sel_n, s->d_sel, ms, s->d_req, s->d_M, s->max_pages,
                               s->ps, nl, nh, nkv, a->head_dim, a->block_size, a->scale, s->bound_max, a->out, a->lse);
        s->unfused = rc != 0;
        if (rc) {
            const struct kvs_span_list sp = {ms, s->d_n_spans, s->d_spans, s->h_plan_n, s->h_plan_sp};
            o->attention_spans(be, a->q, a->kv.k, a->kv.v, &sub, &sp, nr, nh, nkv, a->head_dim, a->block_size,
                               a->scale, a->out, a->lse);
        }
        s->rk->merge(be, a->out, a->lse, s->d_cidx, nr, nh, a->head_dim, s->oc[cur ^ 1][layer], s->lc[cur ^ 1][layer],
                     s->lrows, s->oc[cur][layer], s->lc[cur][layer]);
        return;
    }
    o->download(be, s->h_sel_n, s->d_sel_n, 0, (size_t)nl * nkv);
    o->download(be, s->h_sel, s->d_sel, 0, (size_t)nl * nkv * ms * 2);
    /* 2. the mask and every lead row's spans: newest = selection, past = supplement */
    for (int q = 0; q < nl; q++) {
        struct rseq *rs = s->slot[st->h_slot[q]];
        const int r0 = st->h_q_start[q], rows = st->h_q_start[q + 1] - r0, pos = s->h_npos[q];
        for (int g = 0; g < nkv; g++) {
            const int32_t *sel = s->h_sel + ((size_t)q * nkv + g) * ms * 2;
            const int nsel = s->h_sel_n[q * nkv + g];
            int32_t *A = rs->A + ((size_t)sl * nkv + g) * s->max_pages;
            const int np = spans_to_pages(sel, nsel, s->ps, s->h_pages);
            int rc = kvs_retro_mask_step(A, s->max_pages, s->h_pages, np, pos / s->ps, rs->t, s->h_m);
            KVS_ASSERT(rc == 0);
            const size_t tn = (size_t)(r0 + rows - 1) * nkv + g;
            s->h_n_spans[tn] = nsel;
            memcpy(s->h_spans + tn * ms * 2, sel, (size_t)nsel * 2 * sizeof(int32_t));
            for (int i = 0; i < nsel; i++) s->keys_own += sel[2 * i + 1] - sel[2 * i];
            for (int j = 0; j < rows - 1; j++) {
                /* past query t' = t - (rows - 1 - j) at position pos - (rows - 1 - j) */
                const int back = rows - 1 - j;
                const size_t tp = (size_t)(r0 + j) * nkv + g;
                int32_t *sp = s->h_spans + tp * ms * 2;
                const int n = kvs_retro_supplement(s->h_pages, s->h_m, np, rs->t - back, pos - back, s->ps, sp, ms);
                KVS_ASSERT(n >= 0);
                s->h_n_spans[tp] = n;
                for (int i = 0; i < n; i++) {
                    KVS_ASSERT(sp[2 * i + 1] <= pos - back + 1);   /* no key after the past query */
                    s->keys_sup += sp[2 * i + 1] - sp[2 * i];
                    s->bytes_read += (double)(sp[2 * i + 1] - sp[2 * i]) * s->env.kv_bytes_per_token /
                                     (double)s->env.n_layers / nkv;
                }
            }
        }
    }
    if (s->kept) {   /* every window row keeps its whole context (the masks are stepped) */
        attend_kept(s, layer, a, &nm);
        return;
    }
    o->upload(be, s->d_n_spans, 0, s->h_n_spans, (size_t)nr * nkv);
    o->upload(be, s->d_spans, 0, s->h_spans, (size_t)nr * nkv * ms * 2);
    /* 3. one spans call for every lead row (the lead sequences as a step of their own) */
    const struct kvs_span_list sp = {ms, s->d_n_spans, s->d_spans, s->h_n_spans, s->h_spans};
    o->attention_spans(be, a->q, a->kv.k, a->kv.v, &sub, &sp, nr, nh, nkv, a->head_dim, a->block_size, a->scale,
                       a->out, a->lse);
    /* 4. merge the past rows with their cached (o, lse); newest rows merge with nothing */
    if (s->any_past) {
        float *lc = s->h_lse[layer];
        for (int row = 0; row < nr; row++)
            for (int h = 0; h < nh; h++)
                s->h_lb[(size_t)row * nh + h] = s->h_cidx[row] < s->lrows ? lc[(size_t)s->h_cidx[row] * nh + h] : -INFINITY;
        o->upload(be, s->d_lb, 0, s->h_lb, (size_t)nr * nh);
        o->gather_rows(be, s->cache[layer], s->d_cidx, nr, qd, s->d_ob);
        o->attn_merge(be, a->out, a->lse, s->d_ob, s->d_lb, nr, nh, a->head_dim);
    }
    /* 5. the cache of this step's lead rows */
    o->gather_rows(be, a->out, s->d_iota, nr, qd, s->cache[layer]);
    o->download(be, s->h_lse[layer], a->lse, 0, (size_t)nr * nh);
}

static int retro_counters(void *state, struct kvs_kv_counter *out, int cap)
{
    struct retro *s = state;
    int live = 0;
    for (int i = 0; i < s->env.max_slots; i++) live += s->slot[i] != NULL;
    /* the device path's keys: one download (counters are read between steps) */
    double own = s->keys_own, sup = s->keys_sup, read = s->bytes_read;
    if (s->rk) {
        uint64_t k[2];
        s->env.o->download(s->env.be, k, s->d_keys, 0, 4);
        own += (double)k[0], sup += (double)k[1];
        if (s->unfused)   /* the fused kernel reads the supplements with the selection */
            read += (double)k[1] * s->env.kv_bytes_per_token / (double)s->env.n_layers / s->env.n_kv_heads;
    }
    const struct kvs_kv_counter c[] = {
        {"kvserve:kv_decode_bytes_read_total", "KV bytes the decode policy read for decode rows (Retro: Quest's for "
         "the newest rows, the past rows' dense layers, and their supplements read a second time).", 1, read, NULL, NULL},
        {"kvserve:kv_retro_sparse_rows_total", "Newest decode rows that attended selected pages.", 1, s->sparse_rows,
         NULL, NULL},
        {"kvserve:kv_retro_dense_rows_total", "Decode rows over the budget that attended densely (not in the step's "
         "leading decode rows).", 1, s->dense_rows, NULL, NULL},
        {"kvserve:kv_retro_past_rows_total", "Past queries re-run in a window (recomputed rows).", 1, s->past_rows,
         NULL, NULL},
        {"kvserve:kv_retro_keys_own_total", "Keys the newest queries attended in their own step (sparse layers, per "
         "KV head).", 1, own, NULL, NULL},
        {"kvserve:kv_retro_keys_supplement_total", "Keys added to past queries by retrospective supplements (sparse "
         "layers, per KV head).", 1, sup, NULL, NULL},
        {"kvserve:kv_retro_keys_skipped_total", "Keys the re-run past queries did not see in their own step (their "
         "context minus Quest's keep; sparse layers, per KV head; each past query counted once): "
         "keys_supplement / keys_skipped is the share of what past queries skipped that later steps supplied.", 1,
         s->keys_skipped, NULL, NULL},
        {"kvserve:kv_retro_effective_budget", "Union of keys seen per query over keys of its own step: (own + "
         "supplement) / own (1 = Quest).", 0, own > 0 ? (own + sup) / own : 1.0, NULL,
         NULL},
        {"kvserve:kv_retro_dense_skipped_rows_total", "Lead decode rows (x layers) of mixed steps that the dense "
         "attention pass skipped (attention meta skip_lead; window 1): the selection pass writes them.", 1,
         s->skipped_rows, NULL, NULL},
        {"kvserve:kv_retro_window_resets_total", "Windows restarted because a request missed a step or attended "
         "densely.", 1, s->windows_reset, NULL, NULL},
        {"kvserve:kv_retro_live_states", "Request states held (seq_init without seq_free).", 0, (double)live, NULL,
         NULL},
        {"kvserve:kv_retro_cache_bytes", "Bytes of Retro's output cache (device outputs and host lse).", 0,
         s->cache_bytes, NULL, NULL},
    };
    int n = 0;
    for (size_t i = 0; i < sizeof c / sizeof c[0] && n < cap; i++) out[n++] = c[i];
    return n;
}

const struct kvs_kv_decode_ops kvs_kv_decode_retro = {
    .name = "retro",
    .exact = 0,
    .needs = KVS_KV_NEEDS_LSE | KVS_KV_NO_GRAPHS,
    .rows_per_seq = 1,
    .create = retro_create,
    .destroy = retro_destroy,
    .seq_bytes = retro_seq_bytes,
    .seq_init = retro_seq_init,
    .seq_free = retro_seq_free,
    .plan = retro_plan,
    .attend = retro_attend,
    .finish = retro_finish,
    .counters = retro_counters,
    .max_recompute = retro_max_recompute,
    .recompute = retro_recompute,
};
