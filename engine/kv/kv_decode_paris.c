/* kv_decode_paris.c: kv.decode=paris (ParisKV, drift-robust top-k KV retrieval; notes in
 * docs/STRATEGIES.md §2, kernels in kernels/kv_paris.h). A decode row attends exactly over
 * sink U top-k U local window U update buffer; the top-k comes from a compact index of the
 * retrieval zone.
 *
 * Zones, per request, layer and KV head (positions of the request):
 *   [0, sink)                     sink, always attended;
 *   [sink, sink + n_enc)          retrieval zone: encoded in the index, attended only at the
 *                                 top-k positions that the selection picks;
 *   [sink + n_enc, ctx)           local window + update buffer, always attended.
 * n_enc is per request (the arena slot), the same for every layer and head. A decode row of
 * context ctx >= max(dense_threshold, sink + local + 1) builds the index the first time
 * (n_enc = 0: the end of prefill, on the first decode step: encode [sink, ctx - local)), and
 * later encodes again when the tail holds local + update_interval positions (encode the ones
 * that slid out of the local window). Encoding is per request and per layer (each layer encodes
 * in its own attend(), right before it selects): never a flush of the batch, and no layer waits
 * for another. Below the threshold the row attends densely (bitwise full attention on the CPU).
 *
 * Index memory: kernels/kv_paris.h layout, per physical KV slot (so it is paged exactly like
 * the K/V it describes, and preemption, prefix sharing and block reuse need nothing: a request
 * (re)encodes all its own retrieval positions from n_enc = 0, and the encoding is a pure
 * function of the key), plus per-request-slot cluster counts. All allocated at create on the
 * backend, sized by the pool (n_pool_blocks) and max_slots, and shown in /metrics
 * (kvserve:kv_paris_index_bytes). seq_init zeroes its slot's counts and n_enc; seq_free marks
 * the slot dead: a cancelled request leaves nothing behind (its index slots belong to the
 * blocks, which go back to the pool with them).
 *
 * Rows: as Quest (kv_decode_quest.c), selection runs for the leading one-row sequences of the
 * step; a step that also holds other rows runs attention() over all rows first and the lead
 * rows' outputs are then replaced by attention_spans over the selected spans. A decode row
 * outside the lead attends densely and is counted (kvserve:kv_paris_dense_rows_total).
 *
 * Host offload (kv.paris.offload), the data path: a host page pool (kernels' host_alloc: pinned
 * and mapped on CUDA; kv.paris.host_bytes, 0: one page per pool block), per request a page table
 * (policy memory, not the arena: a re-initialised slot gives its pages back first); an encode job
 * also writes its positions' K/V of the layer out to the request's pages (write_out), and a
 * selecting step gathers each lead row's attended positions (sink, chosen top-k from the host
 * pages over UVA, tail from the pool) in order into a per-row staging area, whose attention over
 * one span [0, count) is then the row's output: the same keys in the same order, so at beta = 1
 * it is bitwise offload off (tests/unit/test_kv_paris.c). seq_init / seq_free give the pages
 * back (cancellation, preemption).
 * Releasing the pool (kv.h `offloaded`): after each step the scheduler asks which whole blocks
 * of a request's retrieval zone are in host pages ([rel_first, first block without a page or
 * past sink + n_enc)) and gives them back to the block pool; the table's entries then alias its
 * block 0. The index of a position lives at its host page's index slot when it has a page
 * (index slots = pool slots + page slots; the step's index tables map block j to its page, else
 * to n_pages + its pool block), so it outlives the pool block; encode and select address it
 * through those tables. From then on the request's rows must select or take the prefill path
 * below (plan fails the step, -EIO, otherwise); recall's exact top-k reads the zone from the host
 * pages (host_tables; a sampled step where some zone block found no page is not measured, counted
 * as skipped), and the live fidelity meter is refused with offload. A block whose earlier positions found no page
 * stays in the pool. With tensor parallelism nothing is released (the runner does not ask).
 * Chunked prefill (prefill_job, host_prefill_plan): a prefill chunk that ends at or past the dense
 * threshold writes out the zone it finished, whose whole blocks then leave the pool as above; a
 * later chunk of that request attends over a device staging copy of the step's contexts (staged_plan:
 * one gather a layer, the released blocks from the host pages, then attention(); the zone crosses
 * the bus once a layer instead of once a row), or, when that area passes its limit (half the free
 * memory, kv_decode_paris.h), over the pool's spans and over the host pages (kv_paris.h
 * host_view: attention_spans reads them as a KV buffer), merged with attn_merge; the first
 * selecting decode row catches the zone up to ctx - local (offload off's zone, so beta 1 stays
 * full attention's tokens). `footprint` tells the engine a request's peak in the pool, so the
 * context limit and admission count host pages (a prompt longer than the pool is served).
 *
 * Errors: create returns -EINVAL (head_dim not a power of two in [8, 1024], bad setting),
 * -ENOSYS (no kernels, no attention_spans, a storage format of its own), -ENOMEM,
 * each with a message.
 */
#include "engine/kv/kv.h"
#include "engine/kv/kv_decode_paris.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/util.h"
#include "engine/config.h"
#include "kernels/kv_paris.h"

struct paris_seq {
    int32_t live;                 /* 1 between seq_init and seq_free */
    int32_t n_enc;                /* retrieval-zone positions encoded: [sink, sink + n_enc) */
    int32_t rel_lo, rel_hi;       /* offload: logical blocks [rel_lo, rel_hi) reported to the
                                   * scheduler as off the pool (kv.h `offloaded`); equal: none */
    int32_t decoded;              /* a decode row of it has selected (offload: the first one
                                   * catches the zone up to ctx - local, as offload off does) */
};

struct paris {
    struct kvs_kv_decode_env env;
    const struct kvs_paris_kernels *k;
    int topk, sink, local, interval, threshold, recall_every;
    double beta, rho;             /* 0: adaptive */
    int B, W, rows, max_spans;
    struct paris_seq **seq;       /* [max_slots] arena slots (NULL: free) */
    struct kvs_dbuf **codes, **w, *counts, *signs;
    struct kvs_dbuf *d_rows, *d_jobs, *d_n_spans, *d_spans, *d_sel, *d_coarse, *d_exact;
    int32_t *h_rows, *h_jobs, *h_n_spans, *h_spans, *h_sel, *h_coarse, *h_exact, *zeros;
    size_t counts_per_slot;
    double index_bytes;
    int live;                     /* requests between seq_init and seq_free */
    /* this step */
    int n_lead, n_jobs, any_sel, skip, recall_now;
    uint64_t steps;
    /* counters */
    double bytes_read, sparse_rows, dense_rows, encoded, hits, coarse_hits, recall_total;
    double skipped_rows;   /* lead rows (x layers) the dense pass of a mixed step was told to skip */
    /* host offload (kv.paris.offload; NULL / 0 when off) */
    int offload;
    void *host_k, *host_v;        /* the host page pool (kernels/kv_paris.h layout) */
    size_t page_bytes;            /* one page, every layer, K + V */
    int n_pages, n_free_pages;
    int32_t *free_pages;          /* [n_pages] free stack */
    int32_t *h_pages;             /* [max_slots][max_blocks]: page of a request's block, -1 none */
    struct kvs_dbuf *d_pages;
    struct kvs_dbuf *d_idx;       /* the step's index tables, I32 [rows][step stride] (kv_paris.h encode) */
    int32_t *h_idx;
    int stage_blocks, stage_pos;  /* staging blocks / positions per lead row */
    struct kvs_dbuf *stage_k, *stage_v, *stage_bt, *d_stage_n, *d_stage_sp;
    int32_t *h_stage_n, *h_stage_sp;
    double host_fallback, host_read;
    double blocks_released;       /* blocks reported off the pool, all time */
    double recall_skipped;        /* sampled steps whose recall was not measured (offloaded rows) */
    int blocks_off;               /* of live requests, now */
    int rel_first;                /* first block that may leave the pool: after block 0 and the sink */
    /* offload, chunked prefill over a zone that left the pool: per layer, views of the host pages
     * as KV buffers (kv_paris.h host_view); per step row, spans over the pool (part A) and over
     * the host pages (part B), merged: every row of the step attends exactly */
    struct kvs_dbuf **hv_k, **hv_v;
    struct kvs_dbuf *pf_na, *pf_spa, *pf_nb, *pf_spb, *pf_hbt, *pf_out, *pf_lse;
    int32_t *h_pf_na, *h_pf_spa, *h_pf_nb, *h_pf_spb, *h_pf_hbt;
    int host_pf;                  /* this step has rows attending over host pages (part B) */
    double host_pf_rows;          /* rows that did, all time */
    /* ... or, when it fits (kvs_paris_set_stage_limit), over a device staging copy of every
     * sequence's context [0, end) (the released blocks from the host pages, the rest from the
     * pool), one gather a layer, then attention(): the zone crosses the bus once a layer, not once
     * a row. A leading row that selects gets a one-position stand-in (select overwrites it). */
    int sg_on, sg_stride, sg_max_ctx;
    size_t sg_cap;                /* elements of sg_k (and of sg_v) */
    struct kvs_dbuf *sg_k, *sg_v, *sg_rows, *sg_n, *sg_sp, *sg_bt, *sg_pos;
    int32_t *h_sg_rows, *h_sg_n, *h_sg_sp, *h_sg_bt, *h_sg_pos;
    double staged_steps, spans_steps;
    double prefill_written;       /* positions written out by prefill steps, all time */
};

/* ---- the host page pool (offload) ----------------------------------------------------------- */
static int page_alloc(struct paris *s) { return s->n_free_pages ? s->free_pages[--s->n_free_pages] : -1; }

/* gives back every page of the request slot (seq_init of a reused slot, seq_free) */
static void pages_release(struct paris *s, int slot)
{
    if (!s->offload) return;
    int32_t *pt = s->h_pages + (size_t)slot * s->env.max_blocks;
    for (int j = 0; j < s->env.max_blocks; j++)
        if (pt[j] >= 0) {
            s->free_pages[s->n_free_pages++] = pt[j];
            pt[j] = -1;
        }
}

static void paris_destroy(void *state)
{
    struct paris *s = state;
    if (!s) return;
    const struct kvs_backend_ops *o = s->env.o;
    struct kvs_backend *be = s->env.be;
    for (int l = 0; l < s->env.n_layers; l++) {
        if (s->codes) o->free_buf(be, s->codes[l]);
        if (s->w) o->free_buf(be, s->w[l]);
    }
    free(s->codes);
    free(s->w);
    /* every device buffer: selection, offload (host index, pages, staging), prefill over host pages */
    struct kvs_dbuf *bufs[] = {s->counts, s->signs, s->d_rows, s->d_jobs, s->d_n_spans, s->d_spans, s->d_sel,
                               s->d_coarse, s->d_exact, s->d_idx, s->d_pages, s->stage_k, s->stage_v, s->stage_bt,
                               s->d_stage_n, s->d_stage_sp, s->pf_na, s->pf_spa, s->pf_nb, s->pf_spb, s->pf_hbt,
                               s->pf_out, s->pf_lse, s->sg_k, s->sg_v, s->sg_rows, s->sg_n, s->sg_sp, s->sg_bt,
                               s->sg_pos};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) o->free_buf(be, bufs[i]);
    free(s->seq);
    free(s->h_rows);
    free(s->h_jobs);
    free(s->h_n_spans);
    free(s->h_spans);
    free(s->h_sel);
    free(s->h_coarse);
    free(s->h_exact);
    free(s->zeros);
    if (s->host_k) s->k->host_free(be, s->host_k);
    if (s->host_v) s->k->host_free(be, s->host_v);
    free(s->h_idx);
    free(s->free_pages);
    free(s->h_pages);
    free(s->h_stage_n);
    free(s->h_stage_sp);
    for (int l = 0; l < s->env.n_layers; l++) {
        if (s->hv_k && s->hv_k[l]) s->k->host_view_free(be, s->hv_k[l]);
        if (s->hv_v && s->hv_v[l]) s->k->host_view_free(be, s->hv_v[l]);
    }
    free(s->hv_k);
    free(s->hv_v);
    free(s->h_pf_na);
    free(s->h_pf_spa);
    free(s->h_pf_nb);
    free(s->h_pf_spb);
    free(s->h_pf_hbt);
    free(s->h_sg_rows);
    free(s->h_sg_n);
    free(s->h_sg_sp);
    free(s->h_sg_bt);
    free(s->h_sg_pos);
    free(s);
}

/* The host page pool (host_bytes, 0: one page per pool block: GPU first, the host mirrors what
 * leaves the GPU window), the page tables and the staging area (per lead row: sink + topk +
 * local + update interval, or the dense threshold when larger, at most a whole context). */
static int offload_create(struct paris *s, int64_t host_bytes, char *err, size_t errlen)
{
    const struct kvs_backend_ops *o = s->env.o;
    struct kvs_backend *be = s->env.be;
    const int bs = s->env.block_size, nkv = s->env.n_kv_heads, d = s->env.head_dim;
    if (!s->k->host_alloc || !s->k->write_out || !s->k->gather || !s->k->host_view || !s->k->host_view_free)
        return kvs_err(err, errlen, -ENOSYS, "config key 'kv.paris.offload': backend %s has no ParisKV gather", o->name);
    s->offload = 1;
    s->page_bytes = (size_t)s->env.n_layers * nkv * bs * d * (size_t)s->k->kv_elem_bytes * 2;
    const int64_t pages = host_bytes > 0 ? host_bytes / (int64_t)s->page_bytes : s->env.n_pool_blocks;
    if (pages < 1 || pages > INT32_MAX / 2)
        return kvs_err(err, errlen, -EINVAL, "config key 'kv.paris.host_bytes' = %lld holds no page of %zu bytes",
                       (long long)host_bytes, s->page_bytes);
    s->n_pages = s->n_free_pages = (int)pages;
    s->free_pages = kvs_xmalloc((size_t)pages * sizeof *s->free_pages);
    for (int i = 0; i < s->n_pages; i++) s->free_pages[i] = s->n_pages - 1 - i;
    const size_t half = (size_t)pages * (s->page_bytes / 2);
    if (!(s->host_k = s->k->host_alloc(be, half, err, errlen)) || !(s->host_v = s->k->host_alloc(be, half, err, errlen)))
        return -ENOMEM;
    const size_t pt = (size_t)s->env.max_slots * s->env.max_blocks;
    s->h_pages = kvs_xmalloc(pt * sizeof *s->h_pages);
    for (size_t i = 0; i < pt; i++) s->h_pages[i] = -1;
    long stage = (long)s->sink + s->topk + s->local + s->interval;
    if (stage < s->threshold) stage = s->threshold;
    if (stage > (long)s->env.max_blocks * bs) stage = (long)s->env.max_blocks * bs;
    s->stage_blocks = (int)((stage + bs - 1) / bs);
    s->stage_pos = s->stage_blocks * bs;
    const size_t rows = (size_t)s->rows, per = (size_t)s->stage_blocks * nkv * bs * d;
    s->d_pages = o->alloc(be, KVS_BUF_I32, pt);
    s->stage_k = o->alloc(be, KVS_BUF_KV, rows * per);
    s->stage_v = o->alloc(be, KVS_BUF_KV, rows * per);
    s->stage_bt = o->alloc(be, KVS_BUF_I32, rows * s->env.max_blocks);
    s->d_stage_n = o->alloc(be, KVS_BUF_I32, rows * nkv);
    s->d_stage_sp = o->alloc(be, KVS_BUF_I32, rows * nkv * 2);
    if (!s->d_pages || !s->stage_k || !s->stage_v || !s->stage_bt || !s->d_stage_n || !s->d_stage_sp)
        return kvs_err(err, errlen, -ENOMEM, "kv.paris.offload: no backend memory for the staging area (%d rows x %d "
                       "positions)", s->rows, s->stage_pos);
    o->upload(be, s->d_pages, 0, s->h_pages, pt);
    int32_t *bt = kvs_xcalloc(rows * s->env.max_blocks, sizeof *bt);
    for (size_t r = 0; r < rows; r++)
        for (int j = 0; j < s->stage_blocks; j++) bt[r * s->env.max_blocks + j] = (int32_t)(r * s->stage_blocks + j);
    o->upload(be, s->stage_bt, 0, bt, rows * s->env.max_blocks);
    free(bt);
    s->h_stage_n = kvs_xcalloc(rows * nkv, sizeof *s->h_stage_n);
    s->h_stage_sp = kvs_xcalloc(rows * nkv * 2, sizeof *s->h_stage_sp);
    /* chunked prefill over host pages: layer l's view starts at its rows of page 0, so page p is
     * view block p L (kv_paris.h host_view); spans per step row (max_rows: prefill rows too) */
    const size_t L = (size_t)s->env.n_layers, E = (size_t)nkv * bs * d, T = (size_t)s->env.max_rows;
    s->hv_k = kvs_xcalloc(L, sizeof *s->hv_k);
    s->hv_v = kvs_xcalloc(L, sizeof *s->hv_v);
    for (size_t l = 0; l < L; l++) {
        s->hv_k[l] = s->k->host_view(be, s->host_k, l * E, ((size_t)pages * L - l) * E);
        s->hv_v[l] = s->k->host_view(be, s->host_v, l * E, ((size_t)pages * L - l) * E);
    }
    s->pf_na = o->alloc(be, KVS_BUF_I32, T * nkv);
    s->pf_spa = o->alloc(be, KVS_BUF_I32, T * nkv * 4);
    s->pf_nb = o->alloc(be, KVS_BUF_I32, T * nkv);
    s->pf_spb = o->alloc(be, KVS_BUF_I32, T * nkv * 4);
    s->pf_hbt = o->alloc(be, KVS_BUF_I32, pt);
    s->pf_out = o->alloc(be, KVS_BUF_ACT, T * s->env.n_heads * d);
    s->pf_lse = o->alloc(be, KVS_BUF_F32, T * s->env.n_heads);
    if (!s->pf_na || !s->pf_spa || !s->pf_nb || !s->pf_spb || !s->pf_hbt || !s->pf_out || !s->pf_lse)
        return kvs_err(err, errlen, -ENOMEM, "kv.paris.offload: no backend memory for prefill over host pages (%zu "
                       "rows)", T);
    s->h_pf_na = kvs_xcalloc(T * nkv, sizeof *s->h_pf_na);
    s->h_pf_spa = kvs_xcalloc(T * nkv * 4, sizeof *s->h_pf_spa);
    s->h_pf_nb = kvs_xcalloc(T * nkv, sizeof *s->h_pf_nb);
    s->h_pf_spb = kvs_xcalloc(T * nkv * 4, sizeof *s->h_pf_spb);
    s->h_pf_hbt = kvs_xcalloc(pt, sizeof *s->h_pf_hbt);
    /* the staged path's per-sequence tables (its K/V grow when a step needs them) */
    const size_t S = (size_t)s->env.max_slots;
    s->sg_rows = o->alloc(be, KVS_BUF_I32, S * KVS_PARIS_ROW_N);
    s->sg_n = o->alloc(be, KVS_BUF_I32, S * nkv);
    s->sg_sp = o->alloc(be, KVS_BUF_I32, S * nkv * 2);
    s->sg_bt = o->alloc(be, KVS_BUF_I32, pt);
    s->sg_pos = o->alloc(be, KVS_BUF_I32, S);
    if (!s->sg_rows || !s->sg_n || !s->sg_sp || !s->sg_bt || !s->sg_pos)
        return kvs_err(err, errlen, -ENOMEM, "kv.paris.offload: no backend memory for the staged prefill tables");
    s->h_sg_rows = kvs_xcalloc(S * KVS_PARIS_ROW_N, sizeof *s->h_sg_rows);
    s->h_sg_n = kvs_xcalloc(S * nkv, sizeof *s->h_sg_n);
    s->h_sg_sp = kvs_xcalloc(S * nkv * 2, sizeof *s->h_sg_sp);
    s->h_sg_bt = kvs_xcalloc(pt, sizeof *s->h_sg_bt);
    s->h_sg_pos = kvs_xcalloc(S, sizeof *s->h_sg_pos);
    return 0;
}

static int paris_create(const struct kvs_kv_decode_env *env, void **state, char *err, size_t errlen)
{
    const struct kvs_config *c = env->cfg;
    const struct kvs_backend_ops *o = env->o;
    const int d = env->head_dim;
    if (env->storage_fmt)
        return kvs_err(err, errlen, -ENOSYS, "config keys 'kv.decode' = \"paris\" and 'kv.storage' = \"%s\": ParisKV's "
                       "encoder reads the plain K pool", env->storage_fmt);
    if (d < 8 || d > 1024 || (d & (d - 1)))
        return kvs_err(err, errlen, -EINVAL, "kv.decode \"paris\": head_dim %d is not a power of two in [8, 1024] (the "
                       "SRHT and the blocks of 8 need one)", d);
    if (env->n_heads % env->n_kv_heads)
        return kvs_err(err, errlen, -EINVAL, "kv.decode \"paris\": %d query heads are not a multiple of %d KV heads",
                       env->n_heads, env->n_kv_heads);
    if (!o->attention_spans)
        return kvs_err(err, errlen, -ENOSYS, "kv.decode \"paris\": backend %s has no attention_spans", o->name);
    const struct kvs_paris_kernels *k = kvs_paris_kernels_for(o, err, errlen);
    if (!k) return -ENOSYS;
    if (k->supports) {
        int rc = k->supports(d, err, errlen);
        if (rc) return rc;
    }

    struct paris *s = kvs_xcalloc(1, sizeof *s);
    s->env = *env;
    s->k = k;
    s->topk = c ? c->paris_topk : 100;
    s->sink = c ? c->paris_sink : 4;
    s->local = c ? c->paris_local : 64;
    s->interval = c ? c->paris_update_interval : 512;
    s->threshold = c ? c->paris_dense_threshold : 2000;
    s->recall_every = c ? c->paris_recall_every : 0;
    s->beta = c ? c->paris_beta : 0;
    s->rho = c ? c->paris_rho : 0;
    if (s->topk < 1 || s->sink < 0 || s->local < 0 || s->interval < 1 || s->beta < 0 || s->beta > 1 || s->rho < 0 ||
        s->rho > 1) {
        int rc = kvs_err(err, errlen, -EINVAL, "kv.paris: topk %d, sink %d, local %d, update_interval %d, beta %g, rho %g "
                       "out of range", s->topk, s->sink, s->local, s->interval, s->beta, s->rho);
        paris_destroy(s);
        return rc;
    }
    s->B = d / KVS_PARIS_M;
    s->W = kvs_paris_words(d);
    s->max_spans = s->topk + 2;
    s->rows = env->max_slots < env->max_rows ? env->max_slots : env->max_rows;
    if (c && c->paris_offload) {
        /* the live fidelity meter runs exact attention over the pool, which no longer holds a
         * written-out zone */
        int rc = c->kv_fidelity_sample_every > 0
                     ? kvs_err(err, errlen, -EINVAL, "config keys 'kv.paris.offload' and 'kv.fidelity.sample_every': the "
                               "meter's exact attention reads the retrieval zone from the KV pool, which offload releases")
                     : offload_create(s, c->paris_host_bytes, err, errlen);
        if (rc) {
            paris_destroy(s);
            return rc;
        }
        s->d_idx = env->o->alloc(env->be, KVS_BUF_I32, (size_t)s->rows * env->max_blocks);
        s->h_idx = kvs_xcalloc((size_t)s->rows * env->max_blocks, sizeof *s->h_idx);
        if (!s->d_idx) {
            paris_destroy(s);
            return kvs_err(err, errlen, -ENOMEM, "kv.paris.offload: no backend memory for the index tables");
        }
        s->rel_first = (s->sink + env->block_size - 1) / env->block_size;
        if (s->rel_first < 1) s->rel_first = 1;
    }
    const size_t L = (size_t)env->n_layers, nkv = (size_t)env->n_kv_heads, rows = (size_t)s->rows;
    /* index slots: one per pool slot, and with offload one per host page slot too (the index of
     * a written-out position lives at its page, so it outlives the pool block) */
    const size_t slots = ((size_t)env->n_pool_blocks + (size_t)s->n_pages) * (size_t)env->block_size;
    s->counts_per_slot = L * nkv * (size_t)s->B * KVS_PARIS_NC;
    int failed = slots == 0;
    s->codes = kvs_xcalloc(L, sizeof *s->codes);
    s->w = kvs_xcalloc(L, sizeof *s->w);
    for (size_t l = 0; l < L && !failed; l++) {
        s->codes[l] = o->alloc(env->be, KVS_BUF_I32, slots * nkv * (size_t)s->W);
        s->w[l] = o->alloc(env->be, KVS_BUF_F32, slots * nkv * (size_t)s->B);
        failed = !s->codes[l] || !s->w[l];
    }
    if (!failed) {
        s->counts = o->alloc(env->be, KVS_BUF_I32, (size_t)env->max_slots * s->counts_per_slot);
        s->signs = o->alloc(env->be, KVS_BUF_F32, (size_t)d);
        s->d_rows = o->alloc(env->be, KVS_BUF_I32, rows * KVS_PARIS_ROW_N);
        s->d_jobs = o->alloc(env->be, KVS_BUF_I32, rows * KVS_PARIS_JOB_N);
        s->d_n_spans = o->alloc(env->be, KVS_BUF_I32, rows * nkv);
        s->d_spans = o->alloc(env->be, KVS_BUF_I32, rows * nkv * (size_t)s->max_spans * 2);
        failed = !s->counts || !s->signs || !s->d_rows || !s->d_jobs || !s->d_n_spans || !s->d_spans;
        if (!failed && s->recall_every) {
            s->d_sel = o->alloc(env->be, KVS_BUF_I32, rows * nkv * (size_t)s->topk);
            s->d_coarse = o->alloc(env->be, KVS_BUF_I32, rows * nkv * (size_t)s->topk);
            s->d_exact = o->alloc(env->be, KVS_BUF_I32, rows * nkv * (size_t)s->topk);
            failed = !s->d_sel || !s->d_coarse || !s->d_exact;
        }
    }
    s->index_bytes = (double)L * (double)slots * (double)nkv * (double)(s->W + s->B) * 4.0 +
                     (double)env->max_slots * (double)s->counts_per_slot * 4.0;
    if (failed) {
        paris_destroy(s);
        return kvs_err(err, errlen, -ENOMEM, "kv.decode \"paris\": no backend memory for the index (%.1f MiB for %zu "
                       "KV slots x %zu layers) and selection buffers", s->index_bytes / 1048576.0, slots, L);
    }
    float sg[1024];
    kvs_paris_signs(KVS_PARIS_SEED, d, sg);
    o->upload(env->be, s->signs, 0, sg, (size_t)d);
    s->seq = kvs_xcalloc((size_t)env->max_slots, sizeof *s->seq);
    s->h_rows = kvs_xcalloc(rows * KVS_PARIS_ROW_N, sizeof *s->h_rows);
    s->h_jobs = kvs_xcalloc(rows * KVS_PARIS_JOB_N, sizeof *s->h_jobs);
    s->h_n_spans = kvs_xcalloc(rows * nkv, sizeof *s->h_n_spans);
    s->h_spans = kvs_xcalloc(rows * nkv * (size_t)s->max_spans * 2, sizeof *s->h_spans);
    s->zeros = kvs_xcalloc(s->counts_per_slot, sizeof *s->zeros);
    if (s->recall_every) {
        s->h_sel = kvs_xcalloc(rows * nkv * (size_t)s->topk, sizeof *s->h_sel);
        s->h_coarse = kvs_xcalloc(rows * nkv * (size_t)s->topk, sizeof *s->h_coarse);
        s->h_exact = kvs_xcalloc(rows * nkv * (size_t)s->topk, sizeof *s->h_exact);
    }
    *state = s;
    return 0;
}

static size_t paris_seq_bytes(void *state)
{
    (void)state;
    return sizeof(struct paris_seq);
}

static int paris_seq_init(void *state, int slot, void *mem)
{
    struct paris *s = state;
    if (slot < 0 || slot >= s->env.max_slots || !mem) return -EINVAL;
    struct paris_seq *q = mem;
    /* the runner zeroes the arena slot before seq_init, so whether the slot was live is kept here */
    if (!s->seq[slot]) s->live++;
    else s->blocks_off -= s->seq[slot]->rel_hi - s->seq[slot]->rel_lo;
    q->live = 1, q->n_enc = 0, q->decoded = 0;
    q->rel_lo = q->rel_hi = 0;
    if (s->offload) {
        pages_release(s, slot);
        s->env.o->upload(s->env.be, s->d_pages, (size_t)slot * s->env.max_blocks,
                         s->h_pages + (size_t)slot * s->env.max_blocks, (size_t)s->env.max_blocks);
    }
    s->seq[slot] = q;
    s->env.o->upload(s->env.be, s->counts, (size_t)slot * s->counts_per_slot, s->zeros, s->counts_per_slot);
    return 0;
}

static void paris_seq_free(void *state, int slot)
{
    struct paris *s = state;
    if (slot < 0 || slot >= s->env.max_slots || !s->seq[slot]) return;
    s->live--;
    pages_release(s, slot);
    s->blocks_off -= s->seq[slot]->rel_hi - s->seq[slot]->rel_lo;
    s->seq[slot]->live = 0;
    s->seq[slot]->n_enc = 0;
    s->seq[slot]->rel_lo = s->seq[slot]->rel_hi = 0;
    s->seq[slot] = NULL;
}

/* pages for a request's positions [from, to) as they are written out; a block that gets no page
 * (the pool is full: more requests hold pages than pool blocks, e.g. shared prefixes) keeps its
 * positions in the KV pool, where the gather reads them (counted) */
static void pages_for(struct paris *s, int slot, int from, int to)
{
    const int bs = s->env.block_size;
    if (to <= from) return;
    int32_t *pt = s->h_pages + (size_t)slot * s->env.max_blocks;
    const int j0 = from / bs, j1 = (to - 1) / bs;
    for (int j = j0; j <= j1; j++) {
        /* a block whose earlier retrieval positions found no page stays in the pool as a whole
         * (its page would lack them, and its index entries are at its pool slots) */
        const int first = j * bs > s->sink ? j * bs : s->sink;
        if (pt[j] < 0 && (first < from || (pt[j] = page_alloc(s)) < 0)) {
            const int a = j * bs > from ? j * bs : from, b = (j + 1) * bs < to ? (j + 1) * bs : to;
            s->host_fallback += b - a;
        }
    }
    s->env.o->upload(s->env.be, s->d_pages, (size_t)slot * s->env.max_blocks + (size_t)j0, pt + j0,
                     (size_t)(j1 - j0 + 1));
}

/* kv.h `offloaded`: the whole blocks of the retrieval zone whose K/V are in host pages (written
 * out by the step's encode jobs in every layer) leave the pool. Contiguous from rel_first up to
 * the first block without a page (host pool full: that block and the later ones stay). From then
 * on the request's rows must all select (plan checks), and the gather reads them from the host. */
static int paris_offloaded(void *state, int slot, int *lo, int *hi)
{
    struct paris *s = state;
    if (!s->offload || slot < 0 || slot >= s->env.max_slots || !s->seq[slot]) return 0;
    struct paris_seq *q = s->seq[slot];
    const int32_t *pt = s->h_pages + (size_t)slot * s->env.max_blocks;
    const int end = (s->sink + q->n_enc) / s->env.block_size;   /* blocks wholly encoded and written out */
    int from = q->rel_hi > q->rel_lo ? q->rel_hi : s->rel_first, to = from;
    while (to < end && pt[to] >= 0) to++;
    if (to <= from) return 0;
    if (q->rel_hi == q->rel_lo) q->rel_lo = from;
    q->rel_hi = to;
    *lo = from, *hi = to;
    s->blocks_released += to - from;
    s->blocks_off += to - from;
    return to - from;
}

/* offload, a prefill sequence q (rows that do not select): once its chunk ends at or past the
 * dense threshold (so every later decode row of the request selects), the retrieval zone it has
 * finished, [sink + n_enc, end - local), is encoded and written out to host pages in this step,
 * and paris_offloaded then gives its whole blocks back: a prompt longer than the pool streams
 * through it chunk by chunk */
static void prefill_job(struct paris *s, const struct kvs_kv_step *st, int q, int dense_min)
{
    const int slot = st->h_slot[q];
    struct paris_seq *sq = s->seq[slot];
    const int end = st->h_pos[q] + st->h_q_start[q + 1] - st->h_q_start[q];
    const int from = s->sink + sq->n_enc, to = end - s->local;
    if (end < dense_min || to <= from) return;
    int32_t *J = s->h_jobs + (size_t)s->n_jobs++ * KVS_PARIS_JOB_N;
    J[KVS_PARIS_JOB_SEQ] = q, J[KVS_PARIS_JOB_SLOT] = slot;
    J[KVS_PARIS_JOB_FROM] = from, J[KVS_PARIS_JOB_TO] = to;
    s->encoded += to - from;
    s->prefill_written += to - from;
    pages_for(s, slot, from, to);
    sq->n_enc = to - s->sink;
}

static size_t stage_limit;   /* kvs_paris_set_stage_limit */
void kvs_paris_set_stage_limit(size_t bytes) { stage_limit = bytes; }

/* offload, a step with rows over a released zone: the staged path's tables (see the state), or 0
 * when its staging area would pass the limit or cannot be allocated (attend then takes the spans
 * path below). Sequence q's staging blocks are q stride .. q stride + stride - 1; the gather reads
 * its released blocks [rel_lo, rel_hi) from the host pages (the gather's "zone", all paged) and
 * every other position from the pool. */
static int staged_plan(struct paris *s, const struct kvs_kv_step *st)
{
    const struct kvs_backend_ops *o = s->env.o;
    struct kvs_backend *be = s->env.be;
    const int nkv = s->env.n_kv_heads, bs = s->env.block_size, d = s->env.head_dim;
    int stride = 1, max_end = 1;
    for (int q = 0; q < st->n_seqs; q++) {
        const int end = st->h_pos[q] + st->h_q_start[q + 1] - st->h_q_start[q];
        const int stand_in = s->any_sel && q < s->n_lead;
        const int nb = stand_in ? 1 : (end + bs - 1) / bs;
        if (nb > stride) stride = nb;
        if (!stand_in && end > max_end) max_end = end;
    }
    /* the CUDA gather takes at most 65535 pieces of 32 positions a row (its grid's z) */
    if (stride > s->env.max_blocks || (long)stride * bs > 65535L * 32) return 0;
    const size_t need = (size_t)st->n_seqs * stride * nkv * bs * d;
    if (need > s->sg_cap) {
        const size_t bytes = 2 * need * (size_t)s->k->kv_elem_bytes;
        const size_t lim = stage_limit ? stage_limit : o->mem_available(be) / 2;
        if (bytes > lim) return 0;
        if (s->sg_k) o->free_buf(be, s->sg_k);
        if (s->sg_v) o->free_buf(be, s->sg_v);
        s->sg_cap = 0;
        s->sg_k = o->alloc(be, KVS_BUF_KV, need);
        s->sg_v = s->sg_k ? o->alloc(be, KVS_BUF_KV, need) : NULL;
        if (!s->sg_v) {
            if (s->sg_k) o->free_buf(be, s->sg_k);
            s->sg_k = NULL;
            return 0;
        }
        s->sg_cap = need;
    }
    for (int q = 0; q < st->n_seqs; q++) {
        const int slot = st->h_slot[q], end = st->h_pos[q] + st->h_q_start[q + 1] - st->h_q_start[q];
        const struct paris_seq *sq = slot >= 0 && slot < s->env.max_slots ? s->seq[slot] : NULL;
        const int stand_in = s->any_sel && q < s->n_lead, rel = !stand_in && sq && sq->rel_hi > sq->rel_lo;
        int32_t *R = s->h_sg_rows + (size_t)q * KVS_PARIS_ROW_N;
        memset(R, 0, KVS_PARIS_ROW_N * sizeof *R);
        R[KVS_PARIS_ROW_SLOT] = slot >= 0 ? slot : 0;
        R[KVS_PARIS_ROW_CTX] = stand_in ? 1 : end;
        R[KVS_PARIS_ROW_SINK] = rel ? sq->rel_lo * bs : 0;
        R[KVS_PARIS_ROW_NR] = rel ? (sq->rel_hi - sq->rel_lo) * bs : 0;
        R[KVS_PARIS_ROW_TOPK] = R[KVS_PARIS_ROW_NR];   /* the gather sizes a row by ctx - n_r + topk */
        for (int g = 0; g < nkv; g++) {
            s->h_sg_n[(size_t)q * nkv + g] = 1;
            s->h_sg_sp[((size_t)q * nkv + g) * 2] = 0;
            s->h_sg_sp[((size_t)q * nkv + g) * 2 + 1] = R[KVS_PARIS_ROW_CTX];
        }
        s->h_sg_pos[q] = stand_in ? 0 : st->h_pos[q];
        for (int j = 0; j < stride; j++) s->h_sg_bt[(size_t)q * stride + j] = q * stride + j;
    }
    const size_t n = (size_t)st->n_seqs;
    o->upload(be, s->sg_rows, 0, s->h_sg_rows, n * KVS_PARIS_ROW_N);
    o->upload(be, s->sg_n, 0, s->h_sg_n, n * nkv);
    o->upload(be, s->sg_sp, 0, s->h_sg_sp, n * nkv * 2);
    o->upload(be, s->sg_bt, 0, s->h_sg_bt, n * stride);
    o->upload(be, s->sg_pos, 0, s->h_sg_pos, n);
    s->sg_stride = stride;
    s->sg_max_ctx = max_end;
    return 1;
}

/* offload, rows of requests whose zone left the pool and that do not select (prefill chunks):
 * part A = spans over the pool ([0, rel_lo bs) and [rel_hi bs, ctx)), part B = the released
 * blocks [rel_lo bs, rel_hi bs) over the host pages (block tables: page p L, the host view's
 * block of page p); every other row: part A = [0, ctx) (attention()'s bits on the CPU), no B.
 * attend merges the two: exact attention over the whole context for every row. */
static void host_prefill_plan(struct paris *s, const struct kvs_kv_step *st)
{
    const int nkv = s->env.n_kv_heads, bs = s->env.block_size;
    for (int q = 0; q < st->n_seqs; q++) {
        const int slot = st->h_slot[q];
        const struct paris_seq *sq = slot >= 0 && slot < s->env.max_slots ? s->seq[slot] : NULL;
        const int rel = q >= s->n_lead && sq && sq->rel_hi > sq->rel_lo;
        const int lo = rel ? sq->rel_lo * bs : 0, hi = rel ? sq->rel_hi * bs : 0;
        for (int t = st->h_q_start[q]; t < st->h_q_start[q + 1]; t++) {
            const int ctx = st->h_pos[q] + (t - st->h_q_start[q]) + 1;
            for (int g = 0; g < nkv; g++) {
                const size_t i = (size_t)t * nkv + g;
                int32_t *a = s->h_pf_spa + i * 4, *b = s->h_pf_spb + i * 4;
                int na = 0;
                if (!rel) {
                    a[0] = 0, a[1] = ctx, na = 1;
                } else {
                    if (lo > 0) a[2 * na] = 0, a[2 * na + 1] = lo, na++;
                    if (ctx > hi) a[2 * na] = hi, a[2 * na + 1] = ctx, na++;
                    b[0] = lo, b[1] = hi;
                }
                s->h_pf_na[i] = na;
                s->h_pf_nb[i] = rel;
            }
        }
    }
    const struct kvs_backend_ops *o = s->env.o;
    const size_t n = (size_t)st->n_rows * nkv;
    o->upload(s->env.be, s->pf_na, 0, s->h_pf_na, n);
    o->upload(s->env.be, s->pf_spa, 0, s->h_pf_spa, n * 4);
    o->upload(s->env.be, s->pf_nb, 0, s->h_pf_nb, n);
    o->upload(s->env.be, s->pf_spb, 0, s->h_pf_spb, n * 4);
}

/* offload: the step's host block tables (view block page L of each block with a page, else 0),
 * read through the host views by the prefill path's part B and by recall's exact top-k */
static void host_tables(struct paris *s, const struct kvs_kv_step *st)
{
    const int stride = st->m->max_blocks;
    for (int q = 0; q < st->n_seqs; q++) {
        const int slot = st->h_slot[q];
        const int32_t *pt = slot >= 0 && slot < s->env.max_slots ? s->h_pages + (size_t)slot * s->env.max_blocks : NULL;
        int32_t *hb = s->h_pf_hbt + (size_t)q * stride;
        for (int j = 0; j < stride; j++) hb[j] = pt && pt[j] >= 0 ? pt[j] * s->env.n_layers : 0;
    }
    s->env.o->upload(s->env.be, s->pf_hbt, 0, s->h_pf_hbt, (size_t)st->n_seqs * stride);
}

/* offload: every lead row's retrieval zone is in host pages (no block fell back to the pool), so
 * recall's exact top-k can read it there through the host view */
static int zone_paged(const struct paris *s, const struct kvs_kv_step *st)
{
    const int bs = s->env.block_size;
    for (int q = 0; q < s->n_lead; q++) {
        const int32_t *R = s->h_rows + (size_t)q * KVS_PARIS_ROW_N;
        const int slot = st->h_slot[q], n_r = R[KVS_PARIS_ROW_NR], sink = R[KVS_PARIS_ROW_SINK];
        if (!n_r) continue;
        const int32_t *pt = s->h_pages + (size_t)slot * s->env.max_blocks;
        for (int j = sink / bs; j <= (sink + n_r - 1) / bs; j++)
            if (pt[j] < 0) return 0;
    }
    return 1;
}

/* the shortest context whose decode rows select (see paris_plan) */
static int dense_min_of(const struct paris *s)
{
    return s->threshold > s->sink + s->local + 1 ? s->threshold : s->sink + s->local + 1;
}

/* kv.h `footprint`: a request of n positions alone. Once a chunk ends at or past the dense
 * threshold, its finished zone goes to host pages (prefill_job) and whole blocks leave the pool,
 * so the pool holds block 0 .. rel_first, the window + update buffer or the chunk being prefilled
 * (plus partial blocks at both ends), or up to the chunk that crosses the threshold; the zone's
 * blocks that find no page (host_avail short) stay in the pool. */
static int paris_footprint(void *state, int n, int chunk, int host_avail, int *host_pages, int *host_free,
                           int *host_total)
{
    struct paris *s = state;
    if (!s->offload) return -ENOSYS;
    const long bs = s->env.block_size, blocks = (n + bs - 1) / bs, dmin = dense_min_of(s);
    *host_free = s->n_free_pages, *host_total = s->n_pages, *host_pages = 0;
    if (host_avail < 0) host_avail = s->n_free_pages;
    if (n < dmin || n - s->local <= s->sink) return (int)blocks;
    const long zone = (n - s->local + bs - 1) / bs - s->sink / bs;   /* pages the zone takes (pages_for) */
    const long pages = zone < host_avail ? zone : host_avail;
    const long run = chunk > s->interval + 1 ? chunk : s->interval + 1;
    long ws = s->rel_first + (s->local + run + bs - 1) / bs + 3;
    if ((dmin + chunk + bs - 1) / bs + 1 > ws) ws = (dmin + chunk + bs - 1) / bs + 1;
    long peak = ws + zone - pages;
    *host_pages = (int)pages;
    return (int)(peak < blocks ? peak : blocks);
}

static int paris_plan(void *state, const struct kvs_kv_step *st)
{
    struct paris *s = state;
    s->steps++;
    const int L = s->env.n_layers, nkv = s->env.n_kv_heads;
    const double per_layer = (double)s->env.kv_bytes_per_token / (double)L;
    const double idx_token = (double)nkv * (double)(s->W + s->B) * 4.0;   /* index bytes per token, one layer */
    /* the paper's code also asks for sink + local + 2 topk; that binds only for thresholds under
     * 2 topk + sink + local (not the defaults), and would keep k >= n_r (the exactness test) from
     * ever selecting, so the retrieval zone only has to be non-empty here */
    const int dense_min = dense_min_of(s);
    s->skip = st->m->rot_offsets != NULL || st->m->block_valid != NULL;
    s->n_lead = s->n_jobs = s->any_sel = 0;
    while (!s->skip && s->n_lead < st->n_seqs && s->n_lead < s->rows &&
           st->h_q_start[s->n_lead + 1] - st->h_q_start[s->n_lead] == 1)
        s->n_lead++;
    /* offload: a lead row that does not select gathers its whole context into the staging area,
     * so the lead ends before one whose context does not fit there (it attends densely) */
    for (int q = 0; s->offload && q < s->n_lead; q++) {
        const int ctx = st->h_pos[q] + 1, slot = st->h_slot[q];
        const struct paris_seq *sq = slot >= 0 && slot < s->env.max_slots ? s->seq[slot] : NULL;
        /* a request whose zone left the pool attends over the host pages from outside the lead
         * unless its row selects (attend's prefill path: the lead's dense gather would read the
         * pool's aliased entries) */
        if (!(st->h_decode[q] && sq && sq->live && ctx >= dense_min) &&
            (ctx > s->stage_pos || (sq && sq->rel_hi > sq->rel_lo)))
            s->n_lead = q;
    }
    for (int q = 0; q < st->n_seqs; q++) {
        const int ctx = st->h_pos[q] + 1, slot = st->h_slot[q];
        struct paris_seq *sq = slot >= 0 && slot < s->env.max_slots ? s->seq[slot] : NULL;
        const int sel = q < s->n_lead && st->h_decode[q] && sq && sq->live && ctx >= dense_min;
        int32_t *R = q < s->n_lead ? s->h_rows + (size_t)q * KVS_PARIS_ROW_N : NULL;
        if (R) {
            memset(R, 0, KVS_PARIS_ROW_N * sizeof *R);
            R[KVS_PARIS_ROW_CTX] = ctx;
            R[KVS_PARIS_ROW_SLOT] = slot;
        }
        if (!sel) {
            if (st->h_decode[q]) {
                s->dense_rows++;
                s->bytes_read += (double)ctx * per_layer * L;
            } else if (s->offload && !s->skip && sq && sq->live) {
                prefill_job(s, st, q, dense_min);
            }
            continue;
        }
        const int tail = ctx - (s->sink + sq->n_enc);
        /* the first selecting row encodes up to ctx - local (offload off's zone: a zone the prefill
         * wrote out ends up to one position earlier) */
        if (sq->n_enc == 0 || tail >= s->local + s->interval || (!sq->decoded && tail > s->local)) {
            int32_t *J = s->h_jobs + (size_t)s->n_jobs++ * KVS_PARIS_JOB_N;
            J[KVS_PARIS_JOB_SEQ] = q, J[KVS_PARIS_JOB_SLOT] = slot;
            J[KVS_PARIS_JOB_FROM] = s->sink + sq->n_enc, J[KVS_PARIS_JOB_TO] = ctx - s->local;
            s->encoded += J[KVS_PARIS_JOB_TO] - J[KVS_PARIS_JOB_FROM];
            if (s->offload) pages_for(s, slot, J[KVS_PARIS_JOB_FROM], J[KVS_PARIS_JOB_TO]);
            sq->n_enc = ctx - s->local - s->sink;
        }
        sq->decoded = 1;
        const int n_r = sq->n_enc;
        double beta = s->beta, rho = s->rho, ab, ar;
        kvs_paris_adaptive(n_r, &ab, &ar);
        if (beta <= 0) beta = ab;
        if (rho <= 0) rho = ar;
        int keep = (int)ceil(beta * n_r);
        if (keep < 1) keep = 1;
        if (keep > n_r) keep = n_r;
        const int topk = s->topk < keep ? s->topk : keep;
        R[KVS_PARIS_ROW_NR] = n_r;
        R[KVS_PARIS_ROW_SINK] = s->sink;
        R[KVS_PARIS_ROW_KEEP] = keep;
        R[KVS_PARIS_ROW_TOPK] = topk;
        for (int t = 0; t < KVS_PARIS_TIERS; t++)
            R[KVS_PARIS_ROW_T0 + t] = (int32_t)ceil((double)n_r * rho * KVS_PARIS_TIER_FRAC[t]);
        s->any_sel = 1;
        s->sparse_rows++;
        /* K/V of sink + top-k + tail, and the index scanned (all of it for the vote) */
        s->bytes_read += L * (per_layer * (double)(s->sink + topk + ctx - s->sink - n_r) + idx_token * n_r);
    }
    /* a request whose retrieval zone left the pool can only be attended from the host pages: its
     * row must be one that selected (the dense attention over all rows reads the aliased entries) */
    s->host_pf = 0;
    for (int q = 0; s->offload && q < st->n_seqs; q++) {
        const int slot = st->h_slot[q];
        const struct paris_seq *sq = slot >= 0 && slot < s->env.max_slots ? s->seq[slot] : NULL;
        if (!sq || sq->rel_hi == sq->rel_lo) continue;
        const int32_t *R = q < s->n_lead ? s->h_rows + (size_t)q * KVS_PARIS_ROW_N : NULL;
        if (R && R[KVS_PARIS_ROW_NR] && st->h_q_start[q + 1] - st->h_q_start[q] == 1) continue;   /* selects */
        if (R || s->skip) {
            kvs_log(KVS_LOG_ERROR, "kv.paris.offload: the request in slot %d has blocks %d..%d in host pages only, "
                    "but its row at position %d is %s (step of %d sequences, %d leading)", slot, sq->rel_lo,
                    sq->rel_hi - 1, st->h_pos[q], s->skip ? "in a step with per-block rotations or validity" :
                    "a leading row that does not select", st->n_seqs, s->n_lead);
            return -EIO;
        }
        s->host_pf = 1;   /* its rows attend over the pool and the host pages (attend) */
        s->host_pf_rows += st->h_q_start[q + 1] - st->h_q_start[q];
    }
    s->sg_on = s->host_pf && staged_plan(s, st);
    if (s->sg_on) s->staged_steps++;
    else if (s->host_pf) host_prefill_plan(s, st), s->spans_steps++;
    if (s->host_pf || (s->offload && s->recall_every > 0)) host_tables(s, st);
    if (!s->any_sel && !s->n_jobs) return 0;
    if (!s->any_sel) goto tables;
    /* recall reads the retrieval zone from the pool (exact_topk): not for a step with a row whose
     * zone left it */
    /* recall reads the retrieval zone: from the host pages with offload (where all of it is), else
     * from the pool */
    const int sampled = s->recall_every > 0 && s->steps % (uint64_t)s->recall_every == 0;
    const int readable = !s->offload || zone_paged(s, st);
    s->recall_now = sampled && readable;
    if (sampled && !readable) s->recall_skipped++;
    /* launch planning: one span per (row, head) with at least as many keys as selected */
    for (int q = 0; q < s->n_lead; q++) {
        const int32_t *R = s->h_rows + (size_t)q * KVS_PARIS_ROW_N;
        const int ctx = R[KVS_PARIS_ROW_CTX];
        const int bound = R[KVS_PARIS_ROW_NR] ? ctx - R[KVS_PARIS_ROW_NR] + R[KVS_PARIS_ROW_TOPK] : ctx;
        for (int g = 0; g < nkv; g++) {
            s->h_n_spans[q * nkv + g] = 1;
            int32_t *sp = s->h_spans + ((size_t)q * nkv + g) * s->max_spans * 2;
            sp[0] = 0, sp[1] = bound;
        }
    }
    /* offload: the staging area holds each lead row's attended positions in order, one span */
    for (int q = 0; s->offload && q < s->n_lead; q++) {
        const int32_t *R = s->h_rows + (size_t)q * KVS_PARIS_ROW_N;
        const int ctx = R[KVS_PARIS_ROW_CTX], n_r = R[KVS_PARIS_ROW_NR], sink = R[KVS_PARIS_ROW_SINK];
        const int cnt = n_r ? sink + R[KVS_PARIS_ROW_TOPK] + ctx - sink - n_r : ctx;
        for (int g = 0; g < nkv; g++) {
            s->h_stage_n[q * nkv + g] = 1;
            s->h_stage_sp[(q * nkv + g) * 2] = 0, s->h_stage_sp[(q * nkv + g) * 2 + 1] = cnt;
        }
        if (n_r)
            s->host_read += (double)R[KVS_PARIS_ROW_TOPK] * nkv * s->env.head_dim * s->k->kv_elem_bytes * 2.0 * L;
    }
tables:
    if (s->offload) {
        /* index tables: a position's index slot is at its host page, or at its pool block when it
         * has none (kv_paris.h encode), for every sequence of the step (prefill write-out jobs too) */
        const int stride = st->m->max_blocks, bs = s->env.block_size;
        if (!st->h_block_tables || stride > s->env.max_blocks) {
            kvs_log(KVS_LOG_ERROR, "kv.paris.offload: the step has no host block tables (stride %d)", stride);
            return -ENOSYS;
        }
        for (int q = 0; q < st->n_seqs; q++) {
            const int end = st->h_pos[q] + st->h_q_start[q + 1] - st->h_q_start[q];
            const int nb = (end + bs - 1) / bs;
            const int32_t *bt = st->h_block_tables + (size_t)q * stride;
            const int slot = st->h_slot[q];
            const int32_t *pt = slot >= 0 && slot < s->env.max_slots ? s->h_pages + (size_t)slot * s->env.max_blocks : NULL;
            int32_t *it = s->h_idx + (size_t)q * stride;
            for (int j = 0; j < stride; j++) it[j] = j < nb && pt && pt[j] >= 0 ? pt[j] : s->n_pages + (j < nb ? bt[j] : 0);
        }
        s->env.o->upload(s->env.be, s->d_idx, 0, s->h_idx, (size_t)st->n_seqs * stride);
        if (s->any_sel) {
            s->env.o->upload(s->env.be, s->d_stage_n, 0, s->h_stage_n, (size_t)s->n_lead * nkv);
            s->env.o->upload(s->env.be, s->d_stage_sp, 0, s->h_stage_sp, (size_t)s->n_lead * nkv * 2);
        }
    }
    if (s->any_sel) s->env.o->upload(s->env.be, s->d_rows, 0, s->h_rows, (size_t)s->n_lead * KVS_PARIS_ROW_N);
    if (s->n_jobs) s->env.o->upload(s->env.be, s->d_jobs, 0, s->h_jobs, (size_t)s->n_jobs * KVS_PARIS_JOB_N);
    return 0;
}

/* recall@k of the step's selecting rows against the exact top-k of qbar.k (sampled steps) */
static void count_recall(struct paris *s, int layer, const struct kvs_kv_attend *a, const struct kvs_attn_meta *sub)
{
    const struct kvs_backend_ops *o = s->env.o;
    const int nkv = a->n_kv_heads, K = s->topk;
    const size_t n = (size_t)s->n_lead * nkv * K;
    /* with offload the zone is read from the host pages (zone_paged held at plan) */
    struct kvs_attn_meta hm = *sub;
    if (s->offload) hm.block_tables = s->pf_hbt, hm.rot_offsets = hm.block_valid = hm.block_words = NULL;
    s->k->exact_topk(s->env.be, a->q, s->offload ? s->hv_k[layer] : a->kv.k, &hm, s->h_rows, s->n_lead, a->n_heads, nkv,
                     a->head_dim, a->block_size, K, s->d_exact);
    o->download(s->env.be, s->h_sel, s->d_sel, 0, n);
    o->download(s->env.be, s->h_coarse, s->d_coarse, 0, n);
    o->download(s->env.be, s->h_exact, s->d_exact, 0, n);
    for (size_t t = 0; t < (size_t)s->n_lead * nkv; t++) {
        const int32_t *ex = s->h_exact + t * K, *se = s->h_sel + t * K, *co = s->h_coarse + t * K;
        /* all three lists are ascending with -1 past their end */
        for (int i = 0; i < K && ex[i] >= 0; i++) {
            s->recall_total++;
            for (int j = 0; j < K && se[j] >= 0; j++) s->hits += se[j] == ex[i];
            for (int j = 0; j < K && co[j] >= 0; j++) s->coarse_hits += co[j] == ex[i];
        }
    }
}

static void paris_attend(void *state, int layer, const struct kvs_kv_attend *a)
{
    struct paris *s = state;
    const struct kvs_backend_ops *o = s->env.o;
    struct kvs_backend *be = s->env.be;
    const struct kvs_kv_step *st = a->step;
    if (s->sg_on) {
        /* staged_plan's copy of every context, then the dense attention over it */
        s->k->gather(be, a->kv.k, a->kv.v, st->m, s->sg_rows, s->h_sg_rows, st->n_seqs, layer, s->env.n_layers,
                     a->n_kv_heads, a->head_dim, a->block_size, s->sg_n, s->sg_sp, 1, s->d_pages, s->env.max_blocks,
                     s->host_k, s->host_v, s->sg_k, s->sg_v, s->sg_stride);
        struct kvs_attn_meta sm = *st->m;
        sm.block_tables = s->sg_bt, sm.max_blocks = s->sg_stride;
        sm.pos = s->sg_pos, sm.h_pos = s->h_sg_pos, sm.max_ctx = s->sg_max_ctx;
        sm.rot_offsets = sm.block_valid = sm.block_words = NULL;
        sm.plan_ctx = 0;
        o->attention(be, a->q, s->sg_k, s->sg_v, &sm, st->n_rows, a->n_heads, a->n_kv_heads, a->head_dim,
                     a->block_size, a->scale, a->out);
    } else if (s->host_pf) {
        /* host_prefill_plan's two parts and their merge, for every row */
        const struct kvs_span_list spa = {2, s->pf_na, s->pf_spa, s->h_pf_na, s->h_pf_spa};
        const struct kvs_span_list spb = {2, s->pf_nb, s->pf_spb, s->h_pf_nb, s->h_pf_spb};
        struct kvs_attn_meta hm = *st->m;
        hm.block_tables = s->pf_hbt;
        hm.rot_offsets = hm.block_valid = hm.block_words = NULL;
        hm.plan_ctx = 0;
        o->attention_spans(be, a->q, a->kv.k, a->kv.v, st->m, &spa, st->n_rows, a->n_heads, a->n_kv_heads,
                           a->head_dim, a->block_size, a->scale, a->out, a->lse);
        o->attention_spans(be, a->q, s->hv_k[layer], s->hv_v[layer], &hm, &spb, st->n_rows, a->n_heads, a->n_kv_heads,
                           a->head_dim, a->block_size, a->scale, s->pf_out, s->pf_lse);
        o->attn_merge(be, a->out, a->lse, s->pf_out, s->pf_lse, st->n_rows, a->n_heads, a->head_dim);
    } else if (!s->any_sel || st->n_rows > s->n_lead) {
        /* with a selection, the lead rows' output is overwritten below: the dense pass may skip
         * them (backend.h skip_lead) */
        struct kvs_attn_meta dm = *st->m;
        if (s->any_sel) {
            dm.skip_lead = s->n_lead;
            s->skipped_rows += s->n_lead;
        }
        o->attention(be, a->q, a->kv.k, a->kv.v, &dm, st->n_rows, a->n_heads, a->n_kv_heads, a->head_dim,
                     a->block_size, a->scale, a->out);
    }
    if (s->n_jobs) {
        /* jobs of lead rows and of prefill sequences (write-out during prefill): the whole step */
        s->k->encode(be, a->kv.k, st->m, s->offload ? s->d_idx : NULL, s->d_jobs, s->h_jobs, s->n_jobs, layer,
                     s->env.n_layers, a->n_kv_heads, a->head_dim, a->block_size, s->signs, s->codes[layer], s->w[layer],
                     s->counts);
        if (s->offload)
            s->k->write_out(be, a->kv.k, a->kv.v, st->m, s->d_jobs, s->h_jobs, s->n_jobs, layer, s->env.n_layers,
                            a->n_kv_heads, a->head_dim, a->block_size, s->d_pages, s->env.max_blocks, s->host_k,
                            s->host_v);
    }
    if (!s->any_sel) return;
    /* the lead rows as a step of their own: the same tables, the first n_lead sequences */
    struct kvs_attn_meta sub = *st->m;
    sub.n_seqs = s->n_lead;
    sub.max_ctx = 0;
    for (int q = 0; q < s->n_lead; q++)
        if (st->h_pos[q] + 1 > sub.max_ctx) sub.max_ctx = st->h_pos[q] + 1;
    struct kvs_attn_meta selm = sub;   /* select reads the index through the index tables */
    if (s->offload) selm.block_tables = s->d_idx;
    s->k->select(be, a->q, &selm, s->d_rows, s->h_rows, s->n_lead, layer, s->env.n_layers, a->n_heads, a->n_kv_heads,
                 a->head_dim, a->block_size, s->signs, s->codes[layer], s->w[layer], s->counts, s->max_spans,
                 s->topk, s->d_n_spans, s->d_spans, s->recall_now ? s->d_sel : NULL,
                 s->recall_now ? s->d_coarse : NULL);
    if (s->recall_now) count_recall(s, layer, a, &sub);
    if (s->offload) {
        /* the gather (host pages over UVA, the rest from the pool), then the exact attention over
         * the staging area: the same positions in the same order */
        s->k->gather(be, a->kv.k, a->kv.v, &sub, s->d_rows, s->h_rows, s->n_lead, layer, s->env.n_layers,
                     a->n_kv_heads, a->head_dim, a->block_size, s->d_n_spans, s->d_spans, s->max_spans, s->d_pages,
                     s->env.max_blocks, s->host_k, s->host_v, s->stage_k, s->stage_v, s->stage_blocks);
        struct kvs_attn_meta stm = sub;
        stm.block_tables = s->stage_bt;
        stm.max_blocks = s->env.max_blocks;   /* the staging tables' stride (the step's may be shorter) */
        stm.rot_offsets = stm.block_valid = stm.block_words = NULL;
        stm.plan_ctx = 0;
        const struct kvs_span_list ssp = {1, s->d_stage_n, s->d_stage_sp, s->h_stage_n, s->h_stage_sp};
        o->attention_spans(be, a->q, s->stage_k, s->stage_v, &stm, &ssp, s->n_lead, a->n_heads, a->n_kv_heads,
                           a->head_dim, a->block_size, a->scale, a->out, a->lse);
        return;
    }
    const struct kvs_span_list sp = {s->max_spans, s->d_n_spans, s->d_spans, s->h_n_spans, s->h_spans};
    o->attention_spans(be, a->q, a->kv.k, a->kv.v, &sub, &sp, s->n_lead, a->n_heads, a->n_kv_heads, a->head_dim,
                       a->block_size, a->scale, a->out, a->lse);
}

static int paris_counters(void *state, struct kvs_kv_counter *out, int cap)
{
    struct paris *s = state;
    const struct kvs_kv_counter c[] = {
        {"kvserve:kv_decode_bytes_read_total", "KV bytes the decode policy read for decode rows (ParisKV: the index "
         "scanned included).", 1, s->bytes_read, NULL, NULL},
        {"kvserve:kv_paris_sparse_rows_total", "Decode rows that attended sink + top-k + local + buffer.", 1,
         s->sparse_rows, NULL, NULL},
        {"kvserve:kv_paris_dense_skipped_rows_total", "Lead decode rows (x layers) of mixed steps that the dense "
         "attention pass skipped (attention meta skip_lead): the selection pass writes them.", 1, s->skipped_rows,
         NULL, NULL},
        {"kvserve:kv_paris_dense_rows_total", "Decode rows that attended densely (below the threshold, or not in the "
         "step's leading decode rows).", 1, s->dense_rows, NULL, NULL},
        {"kvserve:kv_paris_encoded_tokens_total", "Positions encoded into the index (per request; every layer and KV "
         "head).", 1, s->encoded, NULL, NULL},
        {"kvserve:kv_paris_index_bytes", "Bytes of the ParisKV index (codes, weights, cluster counts) on the backend.",
         0, s->index_bytes, NULL, NULL},
        {"kvserve:kv_paris_live_requests", "Requests holding ParisKV state (zones, cluster counts).", 0, s->live, NULL,
         NULL},
        {"kvserve:kv_paris_recall_total", "Exact top-k positions checked (kv.paris.recall_every steps, every layer and "
         "KV head).", 1, s->recall_total, NULL, NULL},
        {"kvserve:kv_paris_recall_hits_total", "Of those, positions the final top-k kept (recall@k end to end).", 1,
         s->hits, NULL, NULL},
        {"kvserve:kv_paris_recall_coarse_hits_total", "Of those, positions the top-k by vote alone kept (coarse "
         "recall@k).", 1, s->coarse_hits, NULL, NULL},
        {"kvserve:kv_paris_host_bytes", "Bytes of host KV pages that requests hold (kv.paris.offload: the retrieval "
         "zone's K/V written out).", 0, (double)(s->n_pages - s->n_free_pages) * (double)s->page_bytes, NULL, NULL},
        {"kvserve:kv_paris_host_pool_bytes", "Bytes of the host KV page pool (kv.paris.offload).", 0,
         (double)s->n_pages * (double)s->page_bytes, NULL, NULL},
        {"kvserve:kv_paris_host_read_bytes_total", "K/V bytes the gather read from host pages (the chosen top-k).", 1,
         s->host_read, NULL, NULL},
        {"kvserve:kv_paris_host_fallback_total", "Retrieval positions not written out for lack of host pages (read "
         "from the KV pool instead).", 1, s->host_fallback, NULL, NULL},
        {"kvserve:kv_paris_gpu_blocks_released_total", "KV pool blocks of written-out retrieval zones given back to the "
         "pool (kv.paris.offload).", 1, s->blocks_released, NULL, NULL},
        {"kvserve:kv_paris_gpu_blocks_offloaded", "KV pool blocks that live requests hold in host pages instead of the "
         "pool now (kv.paris.offload).", 0, s->blocks_off, NULL, NULL},
        {"kvserve:kv_paris_host_prefill_staged_steps_total", "Steps whose rows over a zone in host pages attended over a "
         "device staging copy of their contexts (one gather a layer).", 1, s->staged_steps, NULL, NULL},
        {"kvserve:kv_paris_host_prefill_spans_steps_total", "Steps whose rows over a zone in host pages attended over "
         "the pool's and the host pages' spans (the staging area did not fit: every row reads the zone).", 1,
         s->spans_steps, NULL, NULL},
        {"kvserve:kv_paris_host_prefill_rows_total", "Prefill rows that attended over a retrieval zone in host pages "
         "(kv.paris.offload: chunked prefill of a prompt whose earlier chunks were written out).", 1, s->host_pf_rows,
         NULL, NULL},
        {"kvserve:kv_paris_prefill_written_tokens_total", "Retrieval-zone positions written out to host pages by prefill "
         "steps (kv.paris.offload), per request.", 1, s->prefill_written, NULL, NULL},
        {"kvserve:kv_paris_recall_skipped_total", "Sampled steps (kv.paris.recall_every) whose recall was not measured "
         "(kv.paris.offload: a row's retrieval zone was not wholly in host pages).", 1, s->recall_skipped, NULL, NULL},
    };
    int n = 0;
    for (size_t i = 0; i < sizeof c / sizeof c[0] && n < cap; i++) out[n++] = c[i];
    return n;
}

const struct kvs_kv_decode_ops kvs_kv_decode_paris = {
    .name = "paris",
    .exact = 0,
    .needs = KVS_KV_NEEDS_LSE | KVS_KV_NO_GRAPHS,
    .rows_per_seq = 1,
    .create = paris_create,
    .destroy = paris_destroy,
    .seq_bytes = paris_seq_bytes,
    .seq_init = paris_seq_init,
    .seq_free = paris_seq_free,
    .plan = paris_plan,
    .attend = paris_attend,
    .counters = paris_counters,
    .offloaded = paris_offloaded,
    .footprint = paris_footprint,
};
