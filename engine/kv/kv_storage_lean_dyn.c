/* kv_storage_lean_dyn.c: LeanKV's dynamic mode, storage side (kv_storage_lean_dyn.h). */
#include "engine/kv/kv_storage_lean_dyn.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/util.h"
#include "engine/config.h"
#include "kernels/kv_lean_dyn.h"
#include "kernels/kv_lean_dyn_cuda.h"
#include "kernels/kv_lean_pages.h"

/* the CUDA side exists only in builds with nvcc (kernels/cuda/kv_lean_dyn.cu) */
#if defined(KVS_HAVE_CUDA) && KVS_HAVE_CUDA
#define DYN_CUDA 1
#else
#define DYN_CUDA 0
#endif

struct slot {
    int live;
    int started;                  /* it has run a step since seq_init */
    int32_t doc_end;              /* positions before its first own token: its cached documents
                                   * (kv.reuse = lazy; 0 without) */
    int32_t next_pos;             /* the position the request's next row must have */
    void *mem;                    /* the heads' windows */
    struct kvs_lean_dyn_head *heads; /* [n_layers][n_kv_heads] */
};

struct kvs_lean_dyn_store {
    const struct kvs_backend_ops *o;
    struct kvs_backend *be;
    struct kvs_lean_dyn_cfg c;
    int n_layers, n_kv_heads, n_heads, max_slots, max_rows;
    struct kvs_lean_pm *pm;
    int n_pages, table_len;
    uint8_t *pages;               /* [n_pages][page_bytes] */
    struct slot *slots;           /* [max_slots] */
    int n_seqs;                   /* the step's */
    int32_t *seq_slot;            /* [max_slots + 1] */
    float *sk, *sv;               /* the step's K/V rows [max_rows][n_kv_heads][head_dim] */
    struct kvs_lean_dyn_head **job_heads; /* [max_slots + 1][n_kv_heads] */
    struct kvs_lean_dyn_pages *job_pages;
    int32_t *need_hi, *need_lo;   /* [max_slots * n_layers * n_kv_heads], zero between rounds */
    float *scratch;
    int n_scratch;
    /* device = cuda: the heads, pages and page manager live on the GPU (kernels/kv_lean_dyn_cuda.h);
     * the host keeps the slots' positions and the step's jobs only */
    struct kvs_lean_dyn_cuda *gpu;
    struct kvs_lean_dyn_cuda_job *jobs; /* [(max_slots + 1) * n_kv_heads] */
    int n_jobs;
    const struct kvs_dbuf *gk, *gv;    /* the step's K/V rows (write) for attention */
    /* requests that ended: their bytes and tokens at the end, tier counts */
    double end_bytes, end_tokens, end_high, end_low, end_pruned;
    /* cuda: the live requests' sums as the counters last read them, kept until the next step,
     * request start or end (gen) changes them: the scheduler reads the counters several times a
     * step, and a wait per live request per read stalled the engine (RESULTS, LeanKV part 5).
     * While the stream is busy they come from the newest snapshot that has landed (queued by
     * each step, kvs_lean_dyn_cuda_snapshot: at most a step or two old), not from a wait: under
     * scheduler.async a wait there held the host until the step it had just queued was done
     * (RESULTS, LeanKV dynamic mode part 16); with the stream idle, from a snapshot waited for
     * (exact). KVS_LEAN_DYN_COUNTERS_WAIT=1 brings the old wait back (measurements). */
    int counters_wait;
    unsigned long gen, counted_gen;
    double c_bytes, c_tokens, c_high, c_low, c_pruned;
    int c_free_pages;
    unsigned char *live_tmp;      /* cuda: [max_slots] */
    /* kv.reuse = lazy: cached documents in the high tier's static format at their block-table
     * slots (kernels/kv_lean.h pages, one buffer per layer over every pool block), read with the
     * static kernels' attention_spans; the rows' (o, lse) over [0, doc_end) then join the
     * dynamic step (kvs_lean_dyn_head_step_ext / the cuda step's ext) */
    int docs, block_size;
    const struct kvs_lean_kernels *kn;
    struct kvs_lean_fmt doc_fmt;
    size_t doc_block_bytes;       /* one block of one layer: n_kv_heads pages */
    struct kvs_dbuf **doc_pages;  /* [n_layers] */
    struct kvs_dbuf *d_nsp, *d_sp, *d_lse; /* spans [max_rows][H] (1 each), [max_rows][H][2]; lse [max_rows][n_heads] */
    int32_t *h_nsp, *h_sp;
    struct kvs_span_list spl;
    /* the static write's rows: only a document's side prefill is stored in the static pages (a
     * request's own rows live in its tiers; writing them there cost a quantization per row and
     * layer that no attention read): keep [max_rows] (1: a row of a sequence with no request
     * slot), set by step(); the write's slots with the rest at -1 (the write skips those) */
    int32_t *h_keep, *h_wslots;   /* h_wslots: cpu only (the slots staged through the host) */
    struct kvs_dbuf *d_keep, *d_wslots;
};

/* kv.reuse = lazy with the dynamic mode (documents static, the request's own tokens dynamic) */
static int docs_of(const struct kvs_config *cfg) { return cfg && cfg->kv_reuse && !strcmp(cfg->kv_reuse, "lazy"); }

static int head_id(const struct kvs_lean_dyn_store *d, int slot, int layer, int g)
{
    return (slot * d->n_layers + layer) * d->n_kv_heads + g;
}

static void cfg_fmts(const struct kvs_config *cfg, struct kvs_lean_fmt *hi, struct kvs_lean_fmt *lo)
{
    *hi = (struct kvs_lean_fmt){8, 4}, *lo = (struct kvs_lean_fmt){4, 2};
    if (cfg && cfg->lean_high && kvs_lean_fmt_parse(cfg->lean_high, hi) < 0) *hi = (struct kvs_lean_fmt){8, 4};
    if (cfg && cfg->lean_low && kvs_lean_fmt_parse(cfg->lean_low, lo) < 0) *lo = (struct kvs_lean_fmt){4, 2};
}

void kvs_lean_dyn_block_bytes(const struct kvs_kv_shape *sh, size_t *k_bytes, size_t *v_bytes)
{
    struct kvs_lean_fmt hi, lo;
    cfg_fmts(sh->cfg, &hi, &lo);
    const size_t per = (size_t)sh->n_layers * sh->n_kv_heads * sh->block_size;
    /* a page entry carries the token's position and score (8 bytes), counted on the K side */
    *k_bytes = per * (kvs_lean_vec_bytes(hi.kbits, sh->head_dim) + 8);
    *v_bytes = per * kvs_lean_vec_bytes(hi.vbits, sh->head_dim);
    /* with cached documents a block also has its static pages (documents live there) */
    if (docs_of(sh->cfg))
        *k_bytes += per * kvs_lean_vec_bytes(hi.kbits, sh->head_dim), *v_bytes += per * kvs_lean_vec_bytes(hi.vbits, sh->head_dim);
}

void kvs_lean_dyn_destroy(struct kvs_lean_dyn_store *d)
{
    if (!d) return;
    for (int s = 0; d->slots && s < d->max_slots; s++) free(d->slots[s].mem), free(d->slots[s].heads);
#if DYN_CUDA
    kvs_lean_dyn_cuda_free(d->gpu);
#endif
    free(d->jobs);
    kvs_lean_pm_free(d->pm);
    free(d->pages), free(d->slots), free(d->seq_slot), free(d->sk), free(d->sv), free(d->job_heads);
    free(d->job_pages), free(d->need_hi), free(d->need_lo), free(d->scratch), free(d->live_tmp);
    for (int l = 0; d->doc_pages && l < d->n_layers; l++)
        if (d->doc_pages[l]) d->o->free_buf(d->be, d->doc_pages[l]);
    free(d->doc_pages);
    if (d->d_nsp) d->o->free_buf(d->be, d->d_nsp);
    if (d->d_sp) d->o->free_buf(d->be, d->d_sp);
    if (d->d_lse) d->o->free_buf(d->be, d->d_lse);
    if (d->d_keep) d->o->free_buf(d->be, d->d_keep);
    if (d->d_wslots) d->o->free_buf(d->be, d->d_wslots);
    free(d->h_nsp), free(d->h_sp), free(d->h_keep), free(d->h_wslots);
    free(d);
}

/* kv.reuse = lazy: the documents' static pages (the high tier's format) and the step's spans */
static int docs_create(struct kvs_lean_dyn_store *d, const struct kvs_kv_shape *sh, struct kvs_lean_fmt f, int n_blocks,
                       char *err, size_t errlen)
{
    const struct kvs_lean_kernels *kn = kvs_lean_kernels_for(d->o, err, errlen);
    if (!kn) return -ENOSYS;
    if (!kn->supports(f, sh->n_heads, sh->n_kv_heads, sh->head_dim))
        return kvs_err(err, errlen, -ENOSYS,
                       "kv.lean.mode = dynamic with kv.reuse = lazy stores cached documents in the high tier's format "
                       "(kv.lean.high = K%dV%d), which the %s backend's static kernels do not take for %d query heads "
                       "over %d KV heads of dimension %d", f.kbits, f.vbits, d->o->name, sh->n_heads, sh->n_kv_heads,
                       sh->head_dim);
    const int H = sh->n_kv_heads, R = sh->max_rows;
    d->docs = 1, d->kn = kn, d->doc_fmt = f;
    d->doc_block_bytes = (size_t)H * kvs_lean_page_bytes(f, sh->head_dim, sh->block_size);
    d->doc_pages = calloc((size_t)sh->n_layers, sizeof *d->doc_pages);
    int ok = d->doc_pages != NULL;
    for (int l = 0; ok && l < sh->n_layers; l++)
        ok = (d->doc_pages[l] = kn->alloc_pages(d->be, d->doc_block_bytes * (size_t)n_blocks)) != NULL;
    ok = ok && (d->d_nsp = d->o->alloc(d->be, KVS_BUF_I32, (size_t)R * H)) &&
         (d->d_sp = d->o->alloc(d->be, KVS_BUF_I32, (size_t)R * H * 2)) &&
         (d->d_lse = d->o->alloc(d->be, KVS_BUF_F32, (size_t)R * sh->n_heads)) &&
         (d->d_keep = d->o->alloc(d->be, KVS_BUF_I32, (size_t)R)) &&
         (d->d_wslots = d->o->alloc(d->be, KVS_BUF_I32, (size_t)R));
    d->h_nsp = calloc((size_t)R * H, sizeof(int32_t)), d->h_sp = calloc((size_t)R * H * 2, sizeof(int32_t));
    d->h_keep = calloc((size_t)R, sizeof(int32_t)), d->h_wslots = calloc((size_t)R, sizeof(int32_t));
    if (!ok || !d->h_nsp || !d->h_sp || !d->h_keep || !d->h_wslots)
        return kvs_err(err, errlen, -ENOMEM, "kv storage lean (dynamic): cannot allocate the documents' pages (%d "
                       "blocks x %zu bytes x %d layers)", n_blocks, d->doc_block_bytes, sh->n_layers);
    d->spl = (struct kvs_span_list){1, d->d_nsp, d->d_sp, d->h_nsp, d->h_sp};
    return 0;
}

int kvs_lean_dyn_create(const struct kvs_kv_shape *sh, const struct kvs_backend_ops *o, struct kvs_backend *be,
                        int n_blocks, struct kvs_lean_dyn_store **out, char *err, size_t errlen)
{
    *out = NULL;
    const struct kvs_config *cfg = sh->cfg;
    const int on_cuda = !strcmp(o->name, "cuda");
    if (strcmp(o->name, "cpu") && (!on_cuda || !DYN_CUDA))
        return kvs_err(err, errlen, -ENOSYS,
                       "config key 'kv.lean.mode': \"dynamic\" (importance tiers, pruning, the full-precision window) "
                       "runs on the cpu and cuda backends only (cuda in builds with nvcc); %s has no kernels for it: "
                       "use a static mode (K8V8, K8V4, K4V4)", o->name);
    if (cfg && cfg->kv_reuse && strcmp(cfg->kv_reuse, "none") && !docs_of(cfg))
        return kvs_err(err, errlen, -EINVAL,
                       "config key 'kv.lean.mode': \"dynamic\" does not compose with kv.reuse = %s: shared prefix "
                       "blocks hold a request's own tokens, which the dynamic mode keeps in per-request tiers; use "
                       "kv.reuse = lazy (cached documents stored in the high tier's static format and shared), none, "
                       "or a static mode", cfg->kv_reuse);
    if (cfg && cfg->kv_decode && strcmp(cfg->kv_decode, "full"))
        return kvs_err(err, errlen, -EINVAL,
                       "config key 'kv.lean.mode': \"dynamic\" does not compose with kv.decode = %s: the policy's "
                       "scores and pruning need every decode query to attend over every kept token; use a static mode "
                       "(quantization only) with %s", cfg->kv_decode, cfg->kv_decode);
    if (cfg && cfg->kv_fidelity_sample_every > 0)
        return kvs_err(err, errlen, -EINVAL,
                       "config key 'kv.fidelity.sample_every': the fidelity meter re-runs a layer's attention, which "
                       "in kv.lean.mode = dynamic also updates scores and evicts; measure it with kvserve-eval instead");
    /* parallel.tensor > 1: each rank's store holds its KV heads, with a page manager of its own
     * (tests/unit/test_tp_kv.c: the same tokens as one rank) */
    if (sh->max_slots <= 0 || sh->max_rows <= 0 || sh->max_ctx <= 0)
        return kvs_err(err, errlen, -EINVAL, "kv.lean.mode = dynamic needs the runner's limits (slots, rows, context)");
    struct kvs_lean_fmt hi, lo;
    cfg_fmts(cfg, &hi, &lo);
    const int window = cfg && cfg->lean_window > 0 ? cfg->lean_window : 64;
    const double ah = cfg ? cfg->lean_alpha_h : 1.0, al = cfg ? cfg->lean_alpha_l : 0.02;
    struct kvs_lean_dyn_store *d = calloc(1, sizeof *d);
    if (!d) return kvs_err(err, errlen, -ENOMEM, "kv storage lean: out of memory");
    if (kvs_lean_dyn_cfg_init(&d->c, hi, lo, sh->head_dim, sh->n_heads / sh->n_kv_heads, window, ah, al,
                              sh->block_size, sh->max_ctx) < 0 ||
        d->c.group > 8) {
        free(d);
        return kvs_err(err, errlen, -ENOSYS, "kv.lean.mode = dynamic: head_dim %d with %d query heads per KV head is "
                       "not supported (head_dim %% 4 == 0, at most 8 per group)", sh->head_dim,
                       sh->n_heads / sh->n_kv_heads);
    }
    d->o = o, d->be = be;
    d->n_layers = sh->n_layers, d->n_kv_heads = sh->n_kv_heads, d->n_heads = sh->n_heads;
    d->max_slots = sh->max_slots, d->max_rows = sh->max_rows;
    const int H = sh->n_kv_heads, LH = sh->n_layers * H;
    /* pages: the pool's blocks at the high tier (a high page is one block of one head and
     * layer), doubled because a demoted token is counted by both sections' peaks, plus one
     * partial page per section and head of every request, plus one layer's transient worst
     * case of a step (every row of every request could land in either section) */
    const int64_t np = 2 * (int64_t)n_blocks * LH + 2 * (int64_t)sh->max_slots * LH +
                       2 * (int64_t)H * ((int64_t)sh->max_rows / d->c.tp_hi + 2 * sh->max_slots + 1);
    if (np > INT32_MAX / 2) {
        free(d);
        return kvs_err(err, errlen, -E2BIG, "kv.lean.mode = dynamic: %lld pages are too many", (long long)np);
    }
    d->n_pages = (int)np;
    d->table_len = (sh->max_ctx + d->c.tp_hi - 1) / d->c.tp_hi + (sh->max_ctx + d->c.tp_lo - 1) / d->c.tp_lo;
    d->block_size = sh->block_size;
    if (docs_of(cfg)) {
        int rc = docs_create(d, sh, hi, n_blocks, err, errlen);
        if (rc) {
            kvs_lean_dyn_destroy(d);
            return rc;
        }
    }
    if (on_cuda) {
        /* the same pages and tables, on the GPU; a job per (sequence, KV head) of a step */
        d->slots = calloc((size_t)sh->max_slots, sizeof *d->slots);
        d->seq_slot = calloc((size_t)sh->max_slots + 1, sizeof *d->seq_slot);
        d->jobs = calloc(((size_t)sh->max_slots + 1) * H, sizeof *d->jobs);
        d->live_tmp = calloc((size_t)sh->max_slots, 1);
        int rc = d->slots && d->seq_slot && d->jobs && d->live_tmp ? 0
                                                    : kvs_err(err, errlen, -ENOMEM, "kv storage lean: out of memory");
#if DYN_CUDA
        if (!rc)
            rc = kvs_lean_dyn_cuda_create(be, &d->c, sh->max_slots * LH, sh->n_heads, H, d->n_pages, d->table_len,
                                          (sh->max_slots + 1) * H, H, &d->gpu, err, errlen);
        /* prompt chunks by the paper's prefill (a step's rows at most) */
        if (!rc) rc = kvs_lean_dyn_cuda_reserve_rows(d->gpu, sh->max_rows, err, errlen);
#endif
        const char *cw = getenv("KVS_LEAN_DYN_COUNTERS_WAIT");
        d->counters_wait = cw && *cw == '1';
        if (rc) {
            kvs_lean_dyn_destroy(d);
            return rc;
        }
        *out = d;
        return 0;
    }
    int rc = kvs_lean_pm_create(d->n_pages, sh->max_slots * LH, d->table_len, &d->pm);
    d->n_scratch = kvs_lean_dyn_cpu_threads(be);
    if (d->n_scratch < 1) d->n_scratch = 1;
    d->pages = malloc((size_t)d->n_pages * d->c.page_bytes);
    d->slots = calloc((size_t)sh->max_slots, sizeof *d->slots);
    d->seq_slot = calloc((size_t)sh->max_slots + 1, sizeof *d->seq_slot);
    d->sk = malloc((size_t)sh->max_rows * H * sh->head_dim * sizeof(float));
    d->sv = malloc((size_t)sh->max_rows * H * sh->head_dim * sizeof(float));
    d->job_heads = calloc(((size_t)sh->max_slots + 1) * H, sizeof *d->job_heads);
    d->job_pages = calloc(((size_t)sh->max_slots + 1) * H, sizeof *d->job_pages);
    d->need_hi = calloc((size_t)sh->max_slots * LH, sizeof *d->need_hi);
    d->need_lo = calloc((size_t)sh->max_slots * LH, sizeof *d->need_lo);
    d->scratch = malloc((size_t)d->n_scratch * kvs_lean_dyn_scratch_floats(&d->c) * sizeof(float));
    if (rc || !d->pages || !d->slots || !d->seq_slot || !d->sk || !d->sv || !d->job_heads || !d->job_pages ||
        !d->need_hi || !d->need_lo || !d->scratch) {
        kvs_lean_dyn_destroy(d);
        return kvs_err(err, errlen, -ENOMEM, "kv storage lean (dynamic): cannot allocate %d pages of %zu bytes", (int)np,
                       d->c.page_bytes);
    }
    *out = d;
    return 0;
}

/* the request's tokens and the bytes its heads hold now: pages, the window at bf16 */
static void slot_usage(const struct kvs_lean_dyn_store *d, int s, double *bytes, double *tokens, double *high,
                       double *low, double *pruned)
{
    const struct slot *sl = &d->slots[s];
    *bytes = *tokens = *high = *low = *pruned = 0;
    if (!sl->live) return;
#if DYN_CUDA
    if (d->gpu) {
        double pages, window;
        kvs_lean_dyn_cuda_usage(d->gpu, head_id(d, s, 0, 0), d->n_layers * d->n_kv_heads, &pages, high, low, &window,
                                pruned, tokens);
        *bytes = pages * (double)d->c.page_bytes + window * 4.0 * d->c.head_dim;
        if (*tokens > 0) *tokens -= sl->doc_end;   /* N counts the documents' positions too */
        return;
    }
#endif
    for (int l = 0; l < d->n_layers; l++)
        for (int g = 0; g < d->n_kv_heads; g++) {
            int nh, nl;
            kvs_lean_pm_table(d->pm, head_id(d, s, l, g), &nh, &nl);
            const struct kvs_lean_dyn_head *h = &sl->heads[l * d->n_kv_heads + g];
            *bytes += (double)(nh + nl) * (double)d->c.page_bytes + (double)h->w_n * 4.0 * d->c.head_dim;
            *high += h->n_high, *low += h->n_low, *pruned += h->pruned;
        }
    /* the request's own tokens (N of the thresholds counts its documents' positions too; their
     * bytes are the document cache's, shared) */
    *tokens = sl->heads[0].seen > 0 ? (double)(sl->heads[0].seen - sl->doc_end) : 0;
}

void kvs_lean_dyn_seq_free(struct kvs_lean_dyn_store *d, int slot)
{
    if (slot < 0 || slot >= d->max_slots || !d->slots[slot].live) return;
    d->gen++;
    double b, t, h, l, p;
    slot_usage(d, slot, &b, &t, &h, &l, &p);
    d->end_bytes += b, d->end_tokens += t, d->end_high += h, d->end_low += l, d->end_pruned += p;
    struct slot *sl = &d->slots[slot];
#if DYN_CUDA
    if (d->gpu) {
        /* the pool holds every request's worst case (create), so a round cannot fail; say so if it did */
        const int rc = kvs_lean_dyn_cuda_error(d->gpu);
        if (rc) kvs_log(KVS_LOG_ERROR, "kv storage lean (dynamic, cuda): a page round failed (%d)", rc);
        kvs_lean_dyn_cuda_release(d->gpu, head_id(d, slot, 0, 0), d->n_layers * d->n_kv_heads);
        *sl = (struct slot){0};
        return;
    }
#endif
    kvs_lean_pm_release(d->pm, head_id(d, slot, 0, 0), d->n_layers * d->n_kv_heads);
    free(sl->mem), free(sl->heads);
    *sl = (struct slot){0};
}

int kvs_lean_dyn_seq_init(struct kvs_lean_dyn_store *d, int slot)
{
    if (slot < 0 || slot >= d->max_slots) return -EINVAL;
    kvs_lean_dyn_seq_free(d, slot);   /* a slot reused without an end (never in the engine) */
    const int LH = d->n_layers * d->n_kv_heads;
    d->gen++;
    if (d->gpu) {   /* heads start empty: created so, and released so */
        d->slots[slot] = (struct slot){.live = 1};
        return 0;
    }
    const size_t hm = kvs_lean_dyn_head_mem(&d->c);
    struct slot *sl = &d->slots[slot];
    sl->mem = malloc(hm * LH);
    sl->heads = calloc((size_t)LH, sizeof *sl->heads);
    if (!sl->mem || !sl->heads) {
        free(sl->mem), free(sl->heads);
        *sl = (struct slot){0};
        return -ENOMEM;
    }
    for (int i = 0; i < LH; i++) kvs_lean_dyn_head_init(&d->c, &sl->heads[i], (uint8_t *)sl->mem + hm * i);
    sl->live = 1, sl->started = 0, sl->doc_end = 0, sl->next_pos = 0;
    return 0;
}

int kvs_lean_dyn_step(struct kvs_lean_dyn_store *d, const struct kvs_kv_step *st)
{
    if (st->n_seqs > d->max_slots + 1 || st->n_rows > d->max_rows) return -E2BIG;
    d->n_seqs = st->n_seqs;
    d->gen++;
    const int H = d->n_kv_heads;
    for (int s = 0; s < st->n_seqs; s++) {
        const int slot = st->h_slot[s], rows = st->h_q_start[s + 1] - st->h_q_start[s];
        d->seq_slot[s] = slot;
        /* a sequence with no request slot (a side prefill, a runner driven by hand) has no
         * tiers to keep its tokens in (the CPU records no padded steps); with documents it is a
         * document's side prefill (or a recorded step's padding): static pages only, its rows
         * attending over its own positions */
        struct slot *sl = slot >= 0 && slot < d->max_slots ? &d->slots[slot] : NULL;
        for (int r = st->h_q_start[s]; d->docs && r < st->h_q_start[s + 1]; r++) d->h_keep[r] = slot < 0;
        if (d->docs && slot < 0) {
            d->seq_slot[s] = -1;
            for (int r = st->h_q_start[s]; r < st->h_q_start[s + 1]; r++)
                for (int g = 0; g < H; g++) {
                    const size_t i = (size_t)r * H + g;
                    d->h_nsp[i] = 1, d->h_sp[2 * i] = 0, d->h_sp[2 * i + 1] = st->h_pos[s] + (r - st->h_q_start[s]) + 1;
                }
        }
        /* on cuda, the dummy sequences that pad a recorded step to its size are jobs that do nothing */
        if ((d->gpu || d->docs) && slot < 0) {
            for (int g = 0; d->gpu && g < H; g++)
                d->jobs[s * H + g] = (struct kvs_lean_dyn_cuda_job){-1, g, 0, 0, 0};
            continue;
        }
        /* a request's first step: with documents its own tokens start after them (the lazy
         * layout: documents at [0, doc_end), padded to blocks, then the prompt) */
        if (sl && sl->live && !sl->started) {
            sl->started = 1;
            sl->doc_end = d->docs ? st->h_pos[s] : 0;
            sl->next_pos = sl->doc_end;
        }
        if (d->docs && sl)
            for (int r = st->h_q_start[s]; r < st->h_q_start[s + 1]; r++)
                for (int g = 0; g < H; g++) {
                    const size_t i = (size_t)r * H + g;
                    d->h_nsp[i] = sl->doc_end > 0, d->h_sp[2 * i] = 0, d->h_sp[2 * i + 1] = sl->doc_end;
                }
        /* rows must continue the request: the tiers hold every earlier token exactly once */
        if (!sl || !sl->live || st->h_pos[s] != sl->next_pos) {
            kvs_log(KVS_LOG_ERROR, "kv storage lean (dynamic): slot %d runs position %d, expected %d", slot,
                    st->h_pos[s], sl ? sl->next_pos : -1);
            return -EINVAL;
        }
        sl->next_pos += rows;
        for (int g = 0; d->gpu && g < d->n_kv_heads; g++)
            d->jobs[s * d->n_kv_heads + g] =
                (struct kvs_lean_dyn_cuda_job){head_id(d, slot, 0, g), g, st->h_q_start[s], rows, st->h_pos[s]};
    }
    if (d->docs && st->n_rows > 0) {
        const size_t e = (size_t)st->n_rows * H;
        d->o->upload(d->be, d->d_nsp, 0, d->h_nsp, e);
        d->o->upload(d->be, d->d_sp, 0, d->h_sp, 2 * e);
        d->o->upload(d->be, d->d_keep, 0, d->h_keep, (size_t)st->n_rows);
        /* a recorded step replays its recording's plan with other requests' spans: the static
         * kernel's last split walks whatever is left of a row's span (kv_lean.cu), so a longer
         * span is still attended whole */
    }
#if DYN_CUDA
    if (d->gpu) {
        d->n_jobs = st->n_seqs * d->n_kv_heads;
        /* the counters' snapshot of the state the steps before left (-EBUSY: two still queued,
         * the counters keep the newest landed one; never an error of the step) */
        if (!d->counters_wait) (void)kvs_lean_dyn_cuda_snapshot(d->gpu, d->n_layers * d->n_kv_heads, d->max_slots, 0);
        return kvs_lean_dyn_cuda_set_jobs(d->gpu, d->jobs, d->n_jobs);
    }
#endif
    return 0;
}

void kvs_lean_dyn_write(struct kvs_lean_dyn_store *d, int layer, const struct kvs_dbuf *k, const struct kvs_dbuf *v,
                        const struct kvs_dbuf *slots, int n)
{
    /* documents: a side prefill's rows at their block-table slots in the static pages (the
     * runner's slots skip a recorded step's padding); a request's own rows (position >= its
     * doc_end: every row of a sequence with a slot) get slot -1, so the static write skips them.
     * The mask is applied on every step, recorded ones included (whether a step holds a side
     * prefill is the host's to know, a recording's replays are not) */
    if (d->docs) {
        KVS_ASSERT(slots);
#if DYN_CUDA
        if (d->gpu) kvs_lean_dyn_cuda_mask_slots(d->be, slots, d->d_keep, d->d_wslots, n);
#endif
        if (!d->gpu) {   /* cpu: the buffers are host memory, staging is a copy */
            d->o->download(d->be, d->h_wslots, slots, 0, (size_t)n);
            for (int r = 0; r < n; r++) d->h_wslots[r] = d->h_keep[r] ? d->h_wslots[r] : -1;
            d->o->upload(d->be, d->d_wslots, 0, d->h_wslots, (size_t)n);
        }
        d->kn->write(d->be, d->doc_fmt, k, v, d->d_wslots, n, d->n_kv_heads, d->c.head_dim, d->block_size,
                     d->doc_pages[layer]);
    }
    if (d->gpu) {   /* attention reads them where they are */
        d->gk = k, d->gv = v;
        return;
    }
    const size_t e = (size_t)n * d->n_kv_heads * d->c.head_dim;
    d->o->download(d->be, d->sk, k, 0, e);
    d->o->download(d->be, d->sv, v, 0, e);
}

void kvs_lean_dyn_attention(struct kvs_lean_dyn_store *d, int layer, const struct kvs_dbuf *q,
                            const struct kvs_attn_meta *m, int n, float scale, struct kvs_dbuf *out)
{
    const int H = d->n_kv_heads;
    KVS_ASSERT(m->n_seqs == d->n_seqs && m->h_q_start[m->n_seqs] == n);
    /* documents first: side prefills' rows over their own positions (their final output), the
     * requests' rows over [0, doc_end) (o and lse, merged into their dynamic step below) */
    if (d->docs)
        d->kn->attention_spans(d->be, d->doc_fmt, q, d->doc_pages[layer], m, &d->spl, n, d->n_heads, H, d->c.head_dim,
                               d->block_size, scale, out, d->d_lse);
#if DYN_CUDA
    if (d->gpu) {   /* the page round, the rows' steps and the trim: three launches, no host round trip */
        kvs_lean_dyn_cuda_step(d->gpu, d->n_jobs, layer, q, d->gk, d->gv, d->docs ? d->d_lse : NULL, scale, out,
                               KVS_LEAN_DYN_ALL);
        return;
    }
#endif
    /* one allocation round: every head of the step's requests, the worst case of its rows */
    for (int s = 0; s < m->n_seqs; s++) {
        const int slot = d->seq_slot[s];
        if (slot < 0) continue;
        for (int g = 0; g < H; g++) {
            const int id = head_id(d, slot, layer, g);
            int nh, nl;
            kvs_lean_pm_table(d->pm, id, &nh, &nl);
            kvs_lean_dyn_head_need(&d->c, &d->slots[slot].heads[layer * H + g], m->h_q_start[s + 1] - m->h_q_start[s],
                                   nh, nl, &d->need_hi[id], &d->need_lo[id]);
        }
    }
    /* the pool holds a layer's worst case beyond every request's kept pages (create) */
    const int rc = kvs_lean_pm_alloc(d->pm, d->need_hi, d->need_lo);
    KVS_ASSERT(rc == 0);
    for (int s = 0; s < m->n_seqs; s++) {
        const int slot = d->seq_slot[s];
        for (int g = 0; g < H; g++) {
            const int pair = s * H + g;
            d->job_heads[pair] = NULL;
            if (slot < 0) continue;
            const int id = head_id(d, slot, layer, g);
            d->need_hi[id] = d->need_lo[id] = 0;
            struct kvs_lean_dyn_pages *pg = &d->job_pages[pair];
            pg->base = d->pages, pg->table_len = d->table_len;
            pg->table = kvs_lean_pm_table(d->pm, id, &pg->n_high_pages, &pg->n_low_pages);
            d->job_heads[pair] = &d->slots[slot].heads[layer * H + g];
        }
    }
    const struct kvs_lean_dyn_job j = {&d->c, m->n_seqs, d->n_heads, H, m->h_q_start, m->h_pos, d->job_heads,
                                       d->job_pages, d->sk, d->sv, q, out, scale, d->scratch, d->n_scratch,
                                       d->docs ? d->d_lse : NULL};
    kvs_lean_dyn_cpu_attend(d->be, &j);
    /* what the sections did not reach goes back */
    for (int s = 0; s < m->n_seqs; s++)
        for (int g = 0; g < H && d->seq_slot[s] >= 0; g++) {
            int kh, kl;
            kvs_lean_dyn_head_keep(&d->c, d->job_heads[s * H + g], &kh, &kl);
            kvs_lean_pm_trim(d->pm, head_id(d, d->seq_slot[s], layer, g), kh, kl);
        }
}

int kvs_lean_dyn_counters(struct kvs_lean_dyn_store *d, struct kvs_kv_counter *out, int cap)
{
    if (cap < 8) return 0;
    double bytes = 0, tokens = 0, high = 0, low = 0, pruned = 0;
    int free_pages = d->pm ? kvs_lean_pm_n_free(d->pm) : 0;
#if DYN_CUDA
    if (d->gpu) {
        if (d->counted_gen != d->gen || d->gen == 0) {
            double pages, window;
            const int gl = d->n_layers * d->n_kv_heads;
            int any_live = 0;
            for (int s = 0; s < d->max_slots; s++) any_live |= d->live_tmp[s] = (unsigned char)d->slots[s].live;
            if (d->counters_wait) {
                kvs_lean_dyn_cuda_usage_groups(d->gpu, gl, d->max_slots, d->live_tmp, &pages, &d->c_high, &d->c_low,
                                               &window, &d->c_pruned, &d->c_tokens, &d->c_free_pages);
                d->c_bytes = pages * (double)d->c.page_bytes + window * 4.0 * d->c.head_dim;
                d->counted_gen = d->gen;
            } else {
                /* no request live (only releases can be queued: nothing to overlap) or the stream
                 * idle: a fresh snapshot, waited for (exact; gen is then counted); busy: the newest
                 * landed, if any (not counted: the next read looks again) */
                const int idle = !any_live || kvs_lean_dyn_cuda_idle(d->gpu);
                const int fresh = idle && kvs_lean_dyn_cuda_snapshot(d->gpu, gl, d->max_slots, 1) == 0;
                if (kvs_lean_dyn_cuda_snapshot_read(d->gpu, fresh, gl, d->max_slots, d->live_tmp, &pages, &d->c_high,
                                                    &d->c_low, &window, &d->c_pruned, &d->c_tokens,
                                                    &d->c_free_pages)) {
                    d->c_bytes = pages * (double)d->c.page_bytes + window * 4.0 * d->c.head_dim;
                    if (fresh) d->counted_gen = d->gen;
                }
            }
        }
        bytes = d->c_bytes, tokens = d->c_tokens, high = d->c_high, low = d->c_low, pruned = d->c_pruned;
        free_pages = d->c_free_pages;
    }
#endif
    for (int s = 0; !d->gpu && s < d->max_slots; s++) {
        double b, t, h, l, p;
        slot_usage(d, s, &b, &t, &h, &l, &p);
        bytes += b, tokens += t, high += h, low += l, pruned += p;
    }
    if (tokens == 0) bytes = d->end_bytes, tokens = d->end_tokens, high = d->end_high, low = d->end_low,
                     pruned = d->end_pruned;
    const double heads = (double)d->n_layers * d->n_kv_heads, bf16 = heads * 4.0 * d->c.head_dim;
    const double bpt = tokens > 0 ? bytes / tokens : 0, ht = tokens > 0 ? tokens * heads : 1;
    out[0] = (struct kvs_kv_counter){"kvserve:kv_storage_bytes_per_token",
                                     "KV bytes per token the requests hold now (when none: the ended requests at their "
                                     "end): pages (quantization metadata, position and score included) and the "
                                     "full-precision window at bf16; all layers, K and V.", 0, bpt, NULL, NULL};
    out[1] = (struct kvs_kv_counter){"kvserve:kv_storage_bf16_bytes_per_token",
                                     "KV bytes one token would take in bf16 (all layers, K and V).", 0, bf16, NULL, NULL};
    out[2] = (struct kvs_kv_counter){"kvserve:kv_storage_compression_ratio",
                                     "bf16 KV bytes per token over the storage's (same requests as bytes_per_token).", 0,
                                     bpt > 0 ? bf16 / bpt : 0, NULL, NULL};
    out[3] = (struct kvs_kv_counter){"kvserve:kv_storage_high_fraction",
                                     "Fraction of (token, layer, KV head) in LeanKV's high tier.", 0, high / ht, NULL,
                                     NULL};
    out[4] = (struct kvs_kv_counter){"kvserve:kv_storage_low_fraction",
                                     "Fraction of (token, layer, KV head) in LeanKV's low tier.", 0, low / ht, NULL, NULL};
    out[5] = (struct kvs_kv_counter){"kvserve:kv_storage_pruned_fraction",
                                     "Fraction of (token, layer, KV head) LeanKV pruned.", 0, pruned / ht, NULL, NULL};
    out[6] = (struct kvs_kv_counter){"kvserve:kv_storage_pages_used",
                                     "LeanKV pages (mixed precision) held by requests now.", 0,
                                     (double)(d->n_pages - free_pages), NULL, NULL};
    out[7] = (struct kvs_kv_counter){"kvserve:kv_storage_pages_total", "LeanKV pages in the pool.", 0,
                                     (double)d->n_pages, NULL, NULL};
    return 8;
}

int kvs_lean_dyn_check(const struct kvs_lean_dyn_store *d, int *pages_held, char *msg, size_t msglen)
{
    if (d->gpu) {
        snprintf(msg, msglen, "the cuda page manager is checked by tests/gpu/test_cuda_kv_lean_dyn.c, not here");
        return -ENOSYS;
    }
    int rc = kvs_lean_pm_check(d->pm, msg, msglen);
    if (rc) return rc;
    *pages_held = d->n_pages - kvs_lean_pm_n_free(d->pm);
    for (int s = 0; s < d->max_slots; s++)
        for (int l = 0; l < d->n_layers; l++)
            for (int g = 0; g < d->n_kv_heads; g++) {
                int nh, nl;
                kvs_lean_pm_table(d->pm, head_id(d, s, l, g), &nh, &nl);
                if (!d->slots[s].live) {
                    if (nh || nl) {
                        snprintf(msg, msglen, "slot %d (ended) still holds %d + %d pages", s, nh, nl);
                        return -EFAULT;
                    }
                    continue;
                }
                int kh, kl;
                kvs_lean_dyn_head_keep(&d->c, &d->slots[s].heads[l * d->n_kv_heads + g], &kh, &kl);
                if (nh != kh || nl != kl) {
                    snprintf(msg, msglen, "slot %d layer %d head %d holds %d + %d pages, its sections reached %d + %d",
                             s, l, g, nh, nl, kh, kl);
                    return -EFAULT;
                }
            }
    return 0;
}

const struct kvs_dbuf *kvs_lean_dyn_doc_pages(const struct kvs_lean_dyn_store *d, int layer, size_t *block_bytes)
{
    if (!d->docs || layer < 0 || layer >= d->n_layers) return NULL;
    *block_bytes = d->doc_block_bytes;
    return d->doc_pages[layer];
}
