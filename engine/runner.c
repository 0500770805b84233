/* runner.c: the model runner (engine/runner.h): weights on a backend, the KV pool, and one
 * forward pass over a mixed batch of prefill chunks and decode tokens.
 *
 * Per step: the batch is validated and flattened on the host into token ids, positions, KV slot
 * ids, per-sequence query ranges and a padded block-table matrix; these are uploaded once, then
 * the layer loop runs over the backend's op table:
 *   x = embed(tokens); xn = rmsnorm(x)
 *   per layer: q,k,v = xn W^T (+b); [qk-norm]; rope(q,k); kv_write; attention; o-proj
 *              x += o; xn = rmsnorm(x); mlp = down(silu(gate) * up); x += mlp; xn = rmsnorm(x)
 *   (each "x += ...; xn = rmsnorm(x)" is one fused add_rmsnorm with the next norm's weight;
 *   backends with the optional fused ops run q/k/v + rope + kv_write as one, and gate/up +
 *   SwiGLU + down as one, over weights laid out side by side at load: fuse_weights)
 * and the LM head runs only on the rows that want logits, in chunks of LOGIT_CHUNK rows so the
 * [rows][vocab] workspace stays small for 150k-token vocabularies. Rows whose logits go to the
 * host come first (so they land in the caller's array in order, chunk by chunk); greedy rows
 * (KVS_LOGITS_ARGMAX) follow and keep their logits on the backend: argmax_rows picks each one's
 * token there, and only the step's [rows] int32 ids are downloaded, once, at the end.
 * Capacities (tokens and sequences per step, blocks per sequence) come from the config at
 * create time; a batch over them is refused with -EINVAL (the scheduler never builds one).
 *
 * Step graphs (backends with graph_* ops: CUDA). A step in which every sequence decodes one
 * token runs its layer loop as a recorded graph: one per (sequences, context capacity, rot,
 * valid), kept in a small LRU cache. The block-table stride and the attention plan are sized for
 * the capacity (the longest context rounded up to GRAPH_CTX_STEP), so a recording stays valid
 * while the contexts grow; the sequences are padded with dummy ones up to a size bucket; a
 * replay only needs the step's inputs uploaded first (the graph reads its fixed buffers).
 * KVS_GRAPHS=0 turns them off. The LM head runs eagerly after it.
 *
 * Tensor parallelism (parallel.tensor = N > 1, engine/runner_tp.c drives it): this file is one
 * rank's runner. Its heads, FFN columns and vocabulary rows are its share (tp_shard.h); the
 * embedding lookup, o_proj and down_proj give partial sums that allreduce_sum adds up over the
 * ranks (three all-reduces of [n][dim] a layer loop: after the embedding, then two per layer),
 * and the LM head gives the rank's vocabulary columns, which runner_tp.c assembles.
 */
#include "engine/runner.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "base/util.h"
#include "engine/config.h"
#include "engine/kv/kv.h"
#include "engine/kv/fidelity.h"
#include "engine/runner_tp.h"
#include "engine/tp_shard.h"
#include "kernels/backend.h"
#include "models/model.h"

#define LOGIT_CHUNK 16
/* Greedy (ARGMAX) rows never leave the backend, so they go through the LM head in one pass of up
 * to this many rows (cap_seqs if smaller): each pass reads the whole [vocab][dim] weight (1 GB on
 * Llama-3.1-8B), and 16-row chunks read it 8 times at batch 128 (~2 ms of an 11.8 ms H100 step) */
#define ARGMAX_CHUNK_MAX 256
#define GRAPH_CTX_STEP 1024                  /* context capacities of recorded decode steps */
#define GRAPH_CACHE 8                        /* recorded decode steps kept (LRU) */
#define CPU_KV_CAP_BYTES ((size_t)4 << 30)   /* default CPU pool cap: 4 GiB */

/* per-step inputs uploaded by upload_changed (struct kvs_runner ups[]) */
enum { UP_TOKENS, UP_POS, UP_SLOTS, UP_QSTART, UP_SEQPOS, UP_LROWS, UP_PAIRS, UP_N };

struct layer_w {
    struct kvs_dweight *attn_norm, *wq, *wk, *wv, *wo, *bq, *bk, *bv, *bo, *q_norm, *k_norm;
    struct kvs_dweight *mlp_norm, *w_gate, *w_up, *w_down;
};

struct kvs_runner {
    const struct kvs_backend_ops *ops;
    struct kvs_backend *be;
    struct kvs_model_config mc;
    int dim, ff, nh, nkv, hd, vocab, n_layers;

    /* weights */
    struct kvs_dweight *embed, *lm_head, *final_norm;   /* lm_head may alias embed (tied) */
    struct layer_w *layers;                             /* [n_layers] */

    /* the KV seam (engine/kv/kv.h): the storage owns the pool, the decode policy attends */
    const struct kvs_kv_storage_ops *st;
    void *st_state;
    const struct kvs_kv_decode_ops *dp;
    void *dp_state;
    unsigned char *slot_mem;                            /* [cap_seqs][slot_bytes] policy arena */
    size_t slot_bytes;
    struct kvs_dbuf *d_lse;                             /* F32 [cap_tokens][nh] (KVS_KV_NEEDS_LSE) */
    struct kvs_dbuf *q_pre, *d_iota;                    /* ACT [cap_tokens][nh][hd], I32 [cap_tokens] 0, 1, ..
                                                         * (KVS_KV_NEEDS_PRE_ROPE_Q) */
    int32_t *h_slot, *h_decode;                         /* [cap_seqs] per step */
    /* multi-row decode (kv.h recompute): each slot's last hist_cap tokens, and the step's batch
     * with its decoding requests widened to their recomputed rows */
    int hist_cap;
    int32_t *h_hist, *h_hist_n;                         /* [cap_seqs][hist_cap], [cap_seqs] */
    struct kvs_batch_seq *x_seqs;                       /* [cap_seqs] */
    int32_t *x_tokens;                                  /* [cap_tokens] */
    struct kvs_fidelity fid;                            /* live fidelity meter (kv.fidelity) */
    int n_blocks, block_size;
    size_t kv_bytes_per_token;

    /* capacities (cap_tokens: rows per step, step_tokens of the scheduler's batch plus the
     * decode policy's recomputed rows) */
    int cap_tokens, cap_seqs, max_blocks, max_ctx, step_tokens;

    /* device workspaces */
    struct kvs_dbuf *x, *xn, *q, *k, *v, *att, *proj, *gate, *up;   /* [cap_tokens][...] */
    struct kvs_dbuf *lrows, *logits;                    /* [argmax_chunk][dim], [argmax_chunk][vocab] */
    struct kvs_dbuf *d_tokens, *d_pos, *d_slots;        /* I32 [cap_tokens] */
    struct kvs_dbuf *d_qstart, *d_seqpos;               /* I32 [cap_seqs + 1] */
    struct kvs_dbuf *d_bt, *d_rot, *d_valid;            /* I32 [cap_seqs * max_blocks] */
    struct kvs_dbuf *d_words;                           /* I32 [cap_seqs * max_blocks * 2] (backend.h) */
    struct kvs_dbuf *d_lrows;                           /* I32 [argmax_chunk] */
    struct kvs_dbuf *d_ids;                             /* I32 [cap_tokens] argmax ids of the step's logits rows */
    struct kvs_dbuf *d_inv_freq;                        /* F32 [hd / 2] */

    /* tensor parallelism: this rank's share (rank 0 of 1 without it); nh, nkv and ff above are
     * the rank's heads and FFN columns, vocab the whole vocabulary */
    int rank, n_ranks;
    int vocab_lo, vocab_n;                              /* LM-head rows [vocab_lo, vocab_lo + vocab_n) */
    struct kvs_tp *tp;                                  /* the group (every rank points to it) */
    size_t kv_bytes_total;                              /* all ranks' bytes per token */
    struct kvs_config cfg_rank;                         /* a group's rank: the config its decode policy
                                                         * sees (budgets / N); shallow */
    int n_picks;                                        /* argmax rows of the last step (h_ids, h_vals) */
    int argmax_chunk;                                   /* ARGMAX rows per LM head pass (>= LOGIT_CHUNK) */
    /* kvs_runner_forward_begin's step whose argmax ids are still on the backend (end fetches
     * them): the caller's batch.argmax (not the batch: a widened one is this call's local) and
     * rows; rc of a begun group step */
    int32_t *pend_argmax;
    int pend_rows, pend_rc, pend_on;
    /* Asynchronous steps (async_ok: the backend's ids_to_tokens / fetch ops, one rank, no
     * multi-row decode): up to two begun steps, oldest first in pq[pq_head]; each one's picks
     * travel to fetch area `area` behind its LM head, with a copy of its h_lout (the next step's
     * staging rewrites h_lout). slot_pick: per request slot, the d_ids row of its ARGMAX pick in
     * the last step run (-1: none), which a token_on_device sequence of the next step reads. */
    int async_ok;
    struct pend_step {
        int32_t *argmax, *lout;                         /* caller's batch.argmax; [cap_tokens] */
        int rows, rc, area, fetched;                    /* fetched: ids already in argmax (no area) */
    } pq[2];
    int pq_head, pq_n, fetch_next;
    int32_t *slot_pick, *slot_pick_next;                /* [cap_seqs] */
    int32_t *h_pairs;                                   /* [2 cap_seqs] (token row, d_ids row) */
    struct kvs_dbuf *d_pairs;                           /* I32 [2 cap_seqs] */
    int n_pairs;
    struct kvs_dbuf *d_vals;                            /* F32 [cap_tokens] argmax values (groups) */
    float *h_vals;                                      /* [cap_tokens] */
    float *h_chunk;                                     /* [LOGIT_CHUNK][vocab_n] host logits (groups) */

    /* recorded decode steps (graph_* ops; empty when the backend has none) */
    int use_graphs;
    struct step_graph {
        int n_seqs, cap, rot, valid;
        struct kvs_graph *g;
        uint64_t used;                                  /* LRU clock; 0 = empty slot */
    } graphs[GRAPH_CACHE];
    uint64_t graph_clock;
    int graph_ctx_step;                                 /* capacities: multiples of this (GRAPH_CTX_STEP) */

    /* host staging (same shapes) */
    int32_t *h_tokens, *h_pos, *h_slots, *h_qstart, *h_seqpos, *h_bt, *h_rot, *h_valid, *h_words;
    int32_t *h_lrows;                                   /* [cap_tokens] rows wanting logits: host rows first */
    int32_t *h_lout;                                    /* [cap_tokens] each one's logits row in batch order */
    int32_t *h_ids;                                     /* [cap_tokens] downloaded argmax ids */

    /* Incremental block tables: h_bt holds what d_bt holds in its first bt_synced entries (laid
     * out bt_stride entries a row); a step rewrites only the entries that changed and uploads
     * one span [bt_dirty_lo, bt_dirty_hi) instead of every row (a decode step of 128 sequences
     * at 1K context changes ~8 of its 8,192 entries: the blocks that sequences just entered).
     * The span survives a step that fails after staging, so the next upload still carries it. */
    int bt_stride;
    size_t bt_synced, bt_dirty_lo, bt_dirty_hi;
    /* The other per-step inputs go up the same way (upload_changed): shadow[i] holds what the
     * device buffer holds in its first `valid` entries, and a step sends the span that differs.
     * A steady decode step sends positions and slots only: its tokens are the last step's picks
     * (placeholders -1, written on the device), and query starts, logits rows and pick pairs
     * repeat. Nothing else writes these buffers but ids_to_tokens, into rows whose placeholder
     * -1 the shadow then still holds, so a row leaving the device's hands always differs. */
    struct up_shadow {
        int32_t *v;
        size_t valid;
    } ups[UP_N];
    size_t ups_sent;                                    /* entries upload_changed sent this step */
    struct kvs_runner_step_info info;                   /* the last step's (kvs_runner_step_info) */
    /* host time of the steps since the last report (span_log): stage, uploads, the decode
     * policy's hooks, the layers' launch (graph or eager), the LM head; rows, steps */
    double span_s[5], span_rows;
    int span_steps;
};

/* ---- weights ---------------------------------------------------------------------------- */

static int load_w(struct kvs_runner *r, const struct kvs_model *m, const char *name, int64_t rows, int64_t cols,
                  int optional, enum kvs_split split, struct kvs_dweight **out, char *err, size_t errlen)
{
    struct kvs_tensor_view t;
    char terr[256];
    *out = NULL;
    int rc = kvs_model_tensor(m, name, &t, terr, sizeof terr);
    if (rc != 0) {
        if (optional && rc == -ENOENT) return 0;
        return kvs_err(err, errlen, rc, "runner: %s", terr);
    }
    int64_t want_n = rows * cols, n = 1;
    for (int i = 0; i < t.ndim; i++) n *= t.shape[i];
    int ok = rows > 1 ? (t.ndim == 2 && t.shape[0] == rows && t.shape[1] == cols) : (n == want_n && t.ndim == 1);
    if (!ok)
        return kvs_err(err, errlen, -EINVAL, "runner: tensor %s has an unexpected shape (want [%lld x %lld])", name,
                       (long long)rows, (long long)cols);
    struct kvs_tensor_view part;
    void *owned;
    if ((rc = kvs_tp_shard(&t, split, r->rank, r->n_ranks, r->vocab, &part, &owned, err, errlen))) return rc;
    *out = r->ops->upload_weight(r->be, &part, err, errlen);
    free(owned);
    return *out ? 0 : -ENOMEM;
}

static int load_weights(struct kvs_runner *r, const struct kvs_model *m, char *err, size_t errlen)
{
    const struct kvs_model_config *c = &r->mc;
    char name[256];
    int rc;
    const int tp = r->n_ranks > 1;
    /* a rank's embedding has one zero row more than its LM head (tp_shard.h): tied weights are
     * two uploads there */
    if ((rc = load_w(r, m, "model.embed_tokens.weight", r->vocab, r->dim, 0, tp ? KVS_SPLIT_VOCAB_EMBED : KVS_SPLIT_WHOLE,
                     &r->embed, err, errlen)))
        return rc;
    if ((rc = load_w(r, m, "model.norm.weight", 1, r->dim, 0, KVS_SPLIT_WHOLE, &r->final_norm, err, errlen))) return rc;
    if (c->tie_word_embeddings && !tp) {
        r->lm_head = r->embed;
    } else if ((rc = load_w(r, m, c->tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight", r->vocab,
                            r->dim, 0, KVS_SPLIT_VOCAB, &r->lm_head, err, errlen))) {
        return rc;
    }
    r->layers = kvs_xcalloc((size_t)r->n_layers, sizeof *r->layers);
    /* full shapes (what the file holds); each rank uploads its slice */
    const int N = r->n_ranks, qd = r->nh * r->hd * N, kvd = r->nkv * r->hd * N, ff = r->ff * N;
    const enum kvs_split W = KVS_SPLIT_WHOLE, RO = KVS_SPLIT_ROWS, CO = KVS_SPLIT_COLS;
    for (int l = 0; l < r->n_layers; l++) {
        struct layer_w *L = &r->layers[l];
        struct {
            const char *suffix;
            int64_t rows, cols;
            int optional;
            enum kvs_split split;
            struct kvs_dweight **dst;
        } spec[] = {
            {"input_layernorm.weight", 1, r->dim, 0, W, &L->attn_norm},
            {"self_attn.q_proj.weight", qd, r->dim, 0, RO, &L->wq},
            {"self_attn.k_proj.weight", kvd, r->dim, 0, RO, &L->wk},
            {"self_attn.v_proj.weight", kvd, r->dim, 0, RO, &L->wv},
            {"self_attn.o_proj.weight", r->dim, qd, 0, CO, &L->wo},
            {"self_attn.q_proj.bias", 1, qd, !c->attention_bias, RO, &L->bq},
            {"self_attn.k_proj.bias", 1, kvd, !c->attention_bias, RO, &L->bk},
            {"self_attn.v_proj.bias", 1, kvd, !c->attention_bias, RO, &L->bv},
            /* added once, after the all-reduce would add it N times: rank 0 holds it */
            {"self_attn.o_proj.bias", 1, r->dim, 1, W, r->rank == 0 ? &L->bo : NULL},
            {"self_attn.q_norm.weight", 1, r->hd, !c->qk_norm, W, &L->q_norm},
            {"self_attn.k_norm.weight", 1, r->hd, !c->qk_norm, W, &L->k_norm},
            {"post_attention_layernorm.weight", 1, r->dim, 0, W, &L->mlp_norm},
            {"mlp.gate_proj.weight", ff, r->dim, 0, RO, &L->w_gate},
            {"mlp.up_proj.weight", ff, r->dim, 0, RO, &L->w_up},
            {"mlp.down_proj.weight", r->dim, ff, 0, CO, &L->w_down},
        };
        for (size_t i = 0; i < sizeof spec / sizeof spec[0]; i++) {
            if (!spec[i].dst) continue;
            snprintf(name, sizeof name, "model.layers.%d.%s", l, spec[i].suffix);
            if ((rc = load_w(r, m, name, spec[i].rows, spec[i].cols, spec[i].optional, spec[i].split, spec[i].dst, err,
                             errlen)))
                return rc;
        }
        if (c->qk_norm && (!L->q_norm || !L->k_norm))
            return kvs_err(err, errlen, -ENOENT, "runner: layer %d lacks q_norm/k_norm", l);
        /* q/k/v and gate/up side by side in memory, so a batch runs one GEMM for each group
         * (backend.h); an optimisation only: a backend that cannot keeps them apart */
        if (r->ops->fuse_weights) {
            struct kvs_dweight *qkv[3] = {L->wq, L->wk, L->wv}, *gu[2] = {L->w_gate, L->w_up};
            const int a = r->ops->fuse_weights(r->be, qkv, 3), g = r->ops->fuse_weights(r->be, gu, 2);
            if ((a || g) && l == 0)
                kvs_log(KVS_LOG_WARN, "runner: q/k/v %s, gate/up %s: their GEMMs run separately", a ? strerror(-a) : "fused",
                        g ? strerror(-g) : "fused");
        }
    }
    return 0;
}

/* ---- create / free ---------------------------------------------------------------------- */

static struct kvs_dbuf *xalloc(struct kvs_runner *r, enum kvs_buf_kind kind, size_t n, int *failed)
{
    struct kvs_dbuf *b = r->ops->alloc(r->be, kind, n ? n : 1);
    if (!b) *failed = 1;
    return b;
}

int kvs_runner_create(const struct kvs_config *cfg, const struct kvs_model *model, struct kvs_runner **out, char *err,
                      size_t errlen)
{
    *out = NULL;
    if (cfg->tensor_parallel > 1) return kvs_tp_create(cfg, model, out, err, errlen);
    struct kvs_runner *r;
    size_t nb;
    int rc = kvs_runner_rank_create(cfg, model, 0, 1, &r, &nb, err, errlen);
    if (rc) return rc;
    if ((rc = kvs_runner_rank_finish(r, cfg, nb, NULL, err, errlen))) {
        kvs_runner_free(r);
        return rc;
    }
    *out = r;
    return 0;
}

/* The backend of rank `rank` of n_ranks: create_device(rank) where the backend has it (one GPU
 * each), else create(); alone, device auto falls back to the CPU when the GPU backend cannot
 * start (a group does not: its ranks would differ). */
static struct kvs_backend *rank_backend(const struct kvs_config *cfg, const struct kvs_backend_ops **ops, int rank,
                                        int n_ranks, char *err, size_t errlen)
{
    struct kvs_backend *be = n_ranks > 1 && (*ops)->create_device
                                 ? (*ops)->create_device(rank, cfg->cpu_threads, err, errlen)
                                 : (*ops)->create(cfg->cpu_threads, err, errlen);
    int is_auto = !cfg->device || !*cfg->device || strcmp(cfg->device, "auto") == 0;
    if (!be && is_auto && n_ranks == 1 && *ops != &kvs_cpu_backend) {
        kvs_log(KVS_LOG_WARN, "runner: %s backend unavailable (%s); device auto falls back to cpu", (*ops)->name,
                err ? err : "");
        *ops = &kvs_cpu_backend;
        be = (*ops)->create(cfg->cpu_threads, err, errlen);
    }
    return be;
}

int kvs_runner_rank_create(const struct kvs_config *cfg, const struct kvs_model *model, int rank, int n_ranks,
                           struct kvs_runner **out, size_t *n_blocks, char *err, size_t errlen)
{
    *out = NULL;
    *n_blocks = 0;
    const struct kvs_backend_ops *ops = kvs_backend_pick(cfg->device, err, errlen);
    if (!ops) return strcmp(cfg->device ? cfg->device : "", "cuda") == 0 ? -ENOSYS : -EINVAL;
    const struct kvs_kv_storage_ops *st;
    const struct kvs_kv_reuse_ops *ru;
    const struct kvs_kv_decode_ops *dp;
    int rc = kvs_kv_resolve(cfg->kv_storage, cfg->kv_reuse, cfg->kv_decode, &st, &ru, &dp, err, errlen);
    if (rc < 0) return rc;

    const struct kvs_model_config *c = kvs_model_config(model);
    if (c->hidden_size <= 0 || c->n_heads <= 0 || c->n_kv_heads <= 0 || c->head_dim <= 0 || c->head_dim % 2 ||
        c->n_heads % c->n_kv_heads || c->vocab_size <= 0 || c->n_layers <= 0 || c->intermediate_size <= 0 ||
        c->head_dim > 1024)
        return kvs_err(err, errlen, -EINVAL, "runner: unsupported model shape (heads %d/%d, head_dim %d)", c->n_heads,
                       c->n_kv_heads, c->head_dim);
    if (c->n_kv_heads % n_ranks || c->intermediate_size % n_ranks || c->vocab_size < n_ranks)
        return kvs_err(err, errlen, -EINVAL, "config key 'parallel.tensor': %d does not divide the model's %d KV heads "
                       "and %d FFN columns", n_ranks, c->n_kv_heads, c->intermediate_size);
    if (cfg->kv_block_size <= 0 || cfg->kv_block_size > 1024)
        return kvs_err(err, errlen, -EINVAL, "runner: kv.block_size %d out of range [1, 1024]", cfg->kv_block_size);

    struct kvs_runner *r = kvs_xcalloc(1, sizeof *r);
    r->ops = ops;
    r->st = st;
    r->dp = dp;
    r->mc = *c;
    r->dim = c->hidden_size;
    r->rank = rank;
    r->n_ranks = n_ranks;
    r->nh = c->n_heads / n_ranks;
    r->nkv = c->n_kv_heads / n_ranks;
    r->ff = c->intermediate_size / n_ranks;
    r->hd = c->head_dim;
    r->vocab = c->vocab_size;
    r->vocab_lo = kvs_tp_vocab_lo(r->vocab, rank, n_ranks);
    r->vocab_n = kvs_tp_vocab_lo(r->vocab, rank + 1, n_ranks) - r->vocab_lo;
    r->n_layers = c->n_layers;
    r->block_size = cfg->kv_block_size;
    r->max_ctx = cfg->max_model_len > 0 ? cfg->max_model_len : c->max_position_embeddings;
    if (r->max_ctx <= 0) r->max_ctx = 4096;
    r->cap_tokens = cfg->max_batch_tokens > 0 ? cfg->max_batch_tokens : 2048;
    r->cap_seqs = cfg->max_running > 0 ? cfg->max_running : 256;
    if (r->cap_seqs > r->cap_tokens) r->cap_seqs = r->cap_tokens;
    r->max_blocks = (r->max_ctx + r->block_size - 1) / r->block_size;
    r->step_tokens = r->cap_tokens;
    if (dp->recompute && dp->max_recompute) {
        /* a decoding request may run max_recompute rows more than the scheduler counts */
        r->hist_cap = dp->max_recompute(cfg);
        if (r->hist_cap < 0 || r->hist_cap > 4096) r->hist_cap = 0;
        r->cap_tokens += r->cap_seqs * r->hist_cap;
        r->h_hist = kvs_xcalloc((size_t)r->cap_seqs * (size_t)(r->hist_cap ? r->hist_cap : 1), sizeof(int32_t));
        r->h_hist_n = kvs_xcalloc((size_t)r->cap_seqs, sizeof(int32_t));
        r->x_seqs = kvs_xcalloc((size_t)r->cap_seqs, sizeof *r->x_seqs);
        r->x_tokens = kvs_xcalloc((size_t)r->cap_tokens, sizeof(int32_t));
    }

    r->be = rank_backend(cfg, &ops, rank, n_ranks, err, errlen);
    r->ops = ops;
    if (!r->be) {
        free(r);
        return -ENOMEM;
    }
    if ((rc = kvs_backend_supports_model(ops, c->n_heads, c->n_kv_heads, c->head_dim, err, errlen))) goto fail;
    /* before any step is recorded: graphs capture the launches this plans */
    if (ops->set_batch_invariant) ops->set_batch_invariant(r->be, kvs_config_batch_invariant(cfg));
    {
        const char *e = getenv("KVS_GRAPHS");
        r->use_graphs = ops->graph_begin && ops->graph_end && ops->graph_launch && ops->graph_free &&
                        !(e && strcmp(e, "0") == 0) && !(dp->needs & KVS_KV_NO_GRAPHS);
        /* KVS_GRAPH_CTX_STEP: the capacity step (comparisons: a finer step plans the attention
         * nearer the real context, at the cost of a recording per step of context) */
        const char *cs = getenv("KVS_GRAPH_CTX_STEP");
        r->graph_ctx_step = cs && atoi(cs) >= 16 ? atoi(cs) : GRAPH_CTX_STEP;
    }
    if ((rc = load_weights(r, model, err, errlen))) goto fail;

    /* workspaces */
    int failed = 0;
    size_t T = (size_t)r->cap_tokens, S = (size_t)r->cap_seqs;
    size_t qd = (size_t)r->nh * r->hd, kvd = (size_t)r->nkv * r->hd;
    r->x = xalloc(r, KVS_BUF_ACT, T * r->dim, &failed);
    r->xn = xalloc(r, KVS_BUF_ACT, T * r->dim, &failed);
    r->proj = xalloc(r, KVS_BUF_ACT, T * r->dim, &failed);
    r->q = xalloc(r, KVS_BUF_ACT, T * qd, &failed);
    r->att = xalloc(r, KVS_BUF_ACT, T * qd, &failed);
    r->k = xalloc(r, KVS_BUF_ACT, T * kvd, &failed);
    r->v = xalloc(r, KVS_BUF_ACT, T * kvd, &failed);
    r->gate = xalloc(r, KVS_BUF_ACT, T * r->ff, &failed);
    r->up = xalloc(r, KVS_BUF_ACT, T * r->ff, &failed);
    r->argmax_chunk = r->cap_seqs < ARGMAX_CHUNK_MAX ? r->cap_seqs : ARGMAX_CHUNK_MAX;
    if (r->argmax_chunk < LOGIT_CHUNK) r->argmax_chunk = LOGIT_CHUNK;
    r->lrows = xalloc(r, KVS_BUF_ACT, (size_t)r->argmax_chunk * r->dim, &failed);
    r->logits = xalloc(r, KVS_BUF_ACT, (size_t)r->argmax_chunk * r->vocab_n, &failed);
    r->d_tokens = xalloc(r, KVS_BUF_I32, T, &failed);
    r->d_pos = xalloc(r, KVS_BUF_I32, T, &failed);
    r->d_slots = xalloc(r, KVS_BUF_I32, T, &failed);
    r->d_qstart = xalloc(r, KVS_BUF_I32, S + 1, &failed);
    r->d_seqpos = xalloc(r, KVS_BUF_I32, S + 1, &failed);
    r->d_bt = xalloc(r, KVS_BUF_I32, S * r->max_blocks, &failed);
    r->d_rot = xalloc(r, KVS_BUF_I32, S * r->max_blocks, &failed);
    r->d_valid = xalloc(r, KVS_BUF_I32, S * r->max_blocks, &failed);
    r->d_words = xalloc(r, KVS_BUF_I32, 2 * S * r->max_blocks, &failed);
    r->d_lrows = xalloc(r, KVS_BUF_I32, (size_t)r->argmax_chunk, &failed);
    r->d_ids = xalloc(r, KVS_BUF_I32, T, &failed);
    r->d_inv_freq = xalloc(r, KVS_BUF_F32, (size_t)r->hd / 2, &failed);
    /* a policy that gives pool blocks back after a step (offloaded) learns of them a step late
     * under async steps: not covered */
    r->async_ok = n_ranks == 1 && r->hist_cap == 0 && !dp->offloaded && ops->ids_to_tokens && ops->fetch_begin &&
                  ops->fetch_end;
    if (r->async_ok) {
        r->d_pairs = xalloc(r, KVS_BUF_I32, 2 * S, &failed);
        r->h_pairs = kvs_xmalloc(2 * S * sizeof(int32_t));
        r->slot_pick = kvs_xmalloc(S * sizeof(int32_t));
        r->slot_pick_next = kvs_xmalloc(S * sizeof(int32_t));
        for (size_t i = 0; i < S; i++) r->slot_pick[i] = r->slot_pick_next[i] = -1;
        for (int i = 0; i < 2; i++) r->pq[i].lout = kvs_xmalloc(T * sizeof(int32_t));
    }
    if (n_ranks > 1) {
        r->d_vals = xalloc(r, KVS_BUF_F32, T, &failed);
        r->h_vals = kvs_xmalloc(T * sizeof(float));
        r->h_chunk = kvs_xmalloc((size_t)LOGIT_CHUNK * r->vocab_n * sizeof(float));
    }
    if (failed) {
        rc = kvs_err(err, errlen, -ENOMEM, "runner: out of memory for workspaces (%d tokens per step)", r->cap_tokens);
        goto fail;
    }
    r->h_tokens = kvs_xmalloc(T * sizeof(int32_t));
    r->h_pos = kvs_xmalloc(T * sizeof(int32_t));
    r->h_slots = kvs_xmalloc(T * sizeof(int32_t));
    r->h_qstart = kvs_xmalloc((S + 1) * sizeof(int32_t));
    r->h_seqpos = kvs_xmalloc((S + 1) * sizeof(int32_t));
    r->h_bt = kvs_xmalloc(S * r->max_blocks * sizeof(int32_t));
    r->h_rot = kvs_xmalloc(S * r->max_blocks * sizeof(int32_t));
    r->h_valid = kvs_xmalloc(S * r->max_blocks * sizeof(int32_t));
    r->h_words = kvs_xmalloc(2 * S * r->max_blocks * sizeof(int32_t));
    r->h_lrows = kvs_xmalloc(T * sizeof(int32_t));
    r->h_lout = kvs_xmalloc(T * sizeof(int32_t));
    r->h_ids = kvs_xmalloc(T * sizeof(int32_t));
    const size_t up_n[UP_N] = {T, T, T, S + 1, S + 1, (size_t)r->argmax_chunk, 2 * S};
    for (int i = 0; i < UP_N; i++) r->ups[i] = (struct up_shadow){kvs_xmalloc(up_n[i] * sizeof(int32_t)), 0};
    float *inv = kvs_xmalloc((size_t)r->hd / 2 * sizeof(float));
    kvs_rope_inv_freq(c, inv);
    ops->upload(r->be, r->d_inv_freq, 0, inv, (size_t)r->hd / 2);
    free(inv);
    /* KV pool: sized after weights and workspaces so "free memory" means what is left; the
     * storage strategy says what a block costs and owns the bytes */
    const struct kvs_kv_shape shape = {r->n_layers, r->nkv, r->hd, r->block_size, cfg, r->nh,
                                       r->cap_seqs, r->cap_tokens, r->max_ctx};
    size_t kb = 0, vb = 0;
    st->block_bytes(&shape, ops, r->be, &kb, &vb);
    size_t block_bytes = kb + vb;
    r->kv_bytes_per_token = block_bytes / (size_t)r->block_size;
    size_t budget;
    if (cfg->kv_memory_bytes > 0) {
        /* the pool's bytes in all; each rank holds its heads' share of every block */
        budget = (size_t)cfg->kv_memory_bytes / (size_t)n_ranks;
    } else {
        double frac = cfg->kv_memory_fraction > 0 ? cfg->kv_memory_fraction : 0.5;
        budget = (size_t)((double)ops->mem_available(r->be) * frac);
        if (ops == &kvs_cpu_backend && budget > CPU_KV_CAP_BYTES) budget = CPU_KV_CAP_BYTES;
        /* on the CPU by need: every running request at the full context, in whole blocks (a
         * share of free RAM reserved GiBs for a 7M-parameter model; tokens rather than blocks
         * left the last request a block short when the context is not a multiple of the block
         * size); a GPU keeps its share for the prefix cache */
        if (ops == &kvs_cpu_backend && block_bytes > 0) {
            size_t need_blocks = kvs_runner_kv_need_blocks(
                r->max_ctx, r->block_size, cfg->max_running > 0 ? cfg->max_running : r->cap_seqs);
            if (need_blocks > 0 && budget / block_bytes > need_blocks) budget = need_blocks * block_bytes;
        }
    }
    size_t nb = block_bytes ? budget / block_bytes : 0;
    if (nb > INT32_MAX / 2) nb = INT32_MAX / 2;
    if (nb < 1) {
        rc = kvs_err(err, errlen, -ENOMEM, "runner: KV budget of %zu bytes holds no block (one block = %zu bytes)",
                     budget, block_bytes);
        goto fail;
    }
    r->kv_bytes_total = r->kv_bytes_per_token * (size_t)n_ranks;
    *n_blocks = nb;
    *out = r;
    return 0;
fail:
    kvs_runner_free(r);
    return rc;
}

int kvs_runner_rank_finish(struct kvs_runner *r, const struct kvs_config *cfg, size_t nb, struct kvs_tp *tp, char *err,
                           size_t errlen)
{
    const struct kvs_backend_ops *ops = r->ops;
    const struct kvs_kv_storage_ops *st = r->st;
    const struct kvs_kv_decode_ops *dp = r->dp;
    const struct kvs_kv_shape shape = {r->n_layers, r->nkv, r->hd, r->block_size, cfg, r->nh,
                                       r->cap_seqs, r->cap_tokens, r->max_ctx};
    const size_t T = (size_t)r->cap_tokens, S = (size_t)r->cap_seqs, qd = (size_t)r->nh * r->hd;
    const size_t block_bytes = r->kv_bytes_per_token * (size_t)r->block_size;
    int rc, failed = 0;
    r->tp = tp;
    r->n_blocks = (int)nb;
    if (r->n_ranks > 1) {
        /* kv.decode_state_bytes and kv.paris.host_bytes budget the group (as kv.memory_bytes
         * does): each rank holds its heads' share of every request's state and host page, so
         * each gets 1/N of the budget */
        r->cfg_rank = *cfg;
        if (cfg->paris_host_bytes > 0)
            r->cfg_rank.paris_host_bytes =
                cfg->paris_host_bytes / r->n_ranks > 0 ? cfg->paris_host_bytes / r->n_ranks : 1;
        if (cfg->kv_decode_state_bytes > 0)   /* 0 = no budget stays 0 */
            r->cfg_rank.kv_decode_state_bytes =
                cfg->kv_decode_state_bytes / r->n_ranks > 0 ? cfg->kv_decode_state_bytes / r->n_ranks : 1;
        cfg = &r->cfg_rank;
    }
    if ((rc = st->create(&shape, ops, r->be, r->n_blocks, &r->st_state, err, errlen))) return rc;
    if (r->rank == 0)
        kvs_log(KVS_LOG_INFO, "runner: %s backend%s, KV pool %d blocks x %d tokens = %d tokens, %.1f MiB%s (%zu "
                "bytes/token, storage %s)", ops->name, r->n_ranks > 1 ? " x tensor parallel ranks" : "", r->n_blocks,
                r->block_size, r->n_blocks * r->block_size, (double)(nb * block_bytes) / (1024.0 * 1024.0),
                r->n_ranks > 1 ? " a rank" : "", r->kv_bytes_per_token, st->name);

    /* the decode policy, its per-request arena and what it needs from the layer loop */
    if (dp->needs & KVS_KV_NEEDS_PRE_ROPE_Q) {
        /* the unfused q path keeps a copy of q before RoPE (run_layers) */
        r->q_pre = xalloc(r, KVS_BUF_ACT, T * qd, &failed);
        r->d_iota = xalloc(r, KVS_BUF_I32, T, &failed);
        if (failed) return kvs_err(err, errlen, -ENOMEM, "runner: out of memory for the pre-RoPE query copy");
        int32_t *iota = kvs_xmalloc(T * sizeof(int32_t));
        for (size_t i = 0; i < T; i++) iota[i] = (int32_t)i;
        ops->upload(r->be, r->d_iota, 0, iota, T);
        free(iota);
    }
    const struct kvs_kv_decode_env env = {ops, r->be, cfg, r->n_layers, r->nh, r->nkv, r->hd, r->block_size,
                                          r->cap_seqs, r->cap_tokens, r->max_blocks, r->kv_bytes_per_token,
                                          r->n_blocks, st->plain_view ? NULL : st->name};
    if ((rc = dp->create(&env, &r->dp_state, err, errlen))) return rc;
    r->slot_bytes = dp->seq_bytes ? dp->seq_bytes(r->dp_state) : 0;
    if (r->slot_bytes) {
        int64_t cap = cfg->kv_decode_state_bytes;
        if (cap > 0 && (int64_t)(r->slot_bytes * (size_t)r->cap_seqs) > cap)
            return kvs_err(err, errlen, -ENOMEM, "config key 'kv.decode_state_bytes': %s needs %zu bytes per request x "
                           "%d requests, over the budget of %lld bytes%s", dp->name, r->slot_bytes, r->cap_seqs,
                           (long long)cap, r->n_ranks > 1 ? " (a tensor-parallel rank's share)" : "");
        r->slot_mem = calloc((size_t)r->cap_seqs, r->slot_bytes);
        if (!r->slot_mem)
            return kvs_err(err, errlen, -ENOMEM, "runner: no memory for %d request states of %s", r->cap_seqs, dp->name);
    }
    if (dp->needs & KVS_KV_NEEDS_LSE) r->d_lse = xalloc(r, KVS_BUF_F32, T * (size_t)r->nh, &failed);
    r->h_slot = kvs_xmalloc((S + 1) * sizeof(int32_t));
    r->h_decode = kvs_xmalloc((S + 1) * sizeof(int32_t));
    if ((rc = kvs_fidelity_init(&r->fid, cfg->kv_fidelity_sample_every, ops, r->be, T, qd, err, errlen))) return rc;
    r->fid.defer = r->n_ranks > 1;   /* kvs_runner_rank_fidelity_merge buckets the group's rows */
    if (failed) return kvs_err(err, errlen, -ENOMEM, "runner: out of memory for the decode policy's workspaces");
    return 0;
}

void kvs_runner_free(struct kvs_runner *r)
{
    if (r && r->tp && r->rank == 0) kvs_tp_free(r->tp); /* every rank, this one last */
    else kvs_runner_rank_free(r);
}

void kvs_runner_rank_free(struct kvs_runner *r)
{
    if (!r) return;
    const struct kvs_backend_ops *o = r->ops;
    if (r->be) {
        if (r->layers) {
            for (int l = 0; l < r->n_layers; l++) {
                struct layer_w *L = &r->layers[l];
                struct kvs_dweight *ws[] = {L->attn_norm, L->wq,     L->wk,     L->wv,   L->wo,
                                            L->bq,        L->bk,     L->bv,     L->bo,   L->q_norm,
                                            L->k_norm,    L->mlp_norm, L->w_gate, L->w_up, L->w_down};
                for (size_t i = 0; i < sizeof ws / sizeof ws[0]; i++) o->free_weight(r->be, ws[i]);
            }
        }
        if (r->lm_head != r->embed) o->free_weight(r->be, r->lm_head);
        o->free_weight(r->be, r->embed);
        o->free_weight(r->be, r->final_norm);
        if (r->dp_state) r->dp->destroy(r->dp_state);
        if (r->st_state) r->st->destroy(r->st_state);
        kvs_fidelity_free(&r->fid);
        o->free_buf(r->be, r->d_lse);
        o->free_buf(r->be, r->q_pre);
        o->free_buf(r->be, r->d_iota);
        for (int i = 0; i < GRAPH_CACHE; i++)
            if (r->graphs[i].g) o->graph_free(r->be, r->graphs[i].g);
        struct kvs_dbuf *bs[] = {r->x,       r->xn,      r->proj,     r->q,      r->att,     r->k,
                                 r->v,       r->gate,    r->up,       r->lrows,  r->logits,  r->d_tokens,
                                 r->d_pos,   r->d_slots, r->d_qstart, r->d_seqpos, r->d_bt,  r->d_rot, r->d_valid, r->d_words,
                                 r->d_lrows, r->d_ids, r->d_inv_freq, r->d_vals, r->d_pairs};
        for (size_t i = 0; i < sizeof bs / sizeof bs[0]; i++) o->free_buf(r->be, bs[i]);
        o->free(r->be);
    }
    free(r->layers);
    free(r->slot_mem);
    free(r->h_slot);
    free(r->h_decode);
    free(r->h_tokens);
    free(r->h_pos);
    free(r->h_slots);
    free(r->h_qstart);
    free(r->h_seqpos);
    free(r->h_bt);
    free(r->h_rot);
    free(r->h_valid);
    free(r->h_words);
    free(r->h_lrows);
    free(r->h_lout);
    free(r->h_ids);
    for (int i = 0; i < UP_N; i++) free(r->ups[i].v);
    free(r->h_vals);
    free(r->h_chunk);
    free(r->h_hist);
    free(r->h_hist_n);
    free(r->x_seqs);
    free(r->x_tokens);
    free(r->h_pairs);
    free(r->slot_pick);
    free(r->slot_pick_next);
    free(r->pq[0].lout);
    free(r->pq[1].lout);
    free(r);
}

size_t kvs_runner_kv_need_blocks(int ctx, int block_size, int max_running)
{
    if (ctx <= 0 || block_size <= 0 || max_running <= 0) return 0;
    const size_t per_req = ((size_t)ctx + (size_t)block_size - 1) / (size_t)block_size;
    if (per_req > SIZE_MAX / (size_t)max_running) return 0;
    return per_req * (size_t)max_running;
}

int kvs_runner_num_blocks(const struct kvs_runner *r) { return r->n_blocks; }
int kvs_runner_block_size(const struct kvs_runner *r) { return r->block_size; }
int kvs_runner_vocab_size(const struct kvs_runner *r) { return r->vocab; }
const char *kvs_runner_backend_name(const struct kvs_runner *r) { return r->ops->name; }
size_t kvs_runner_kv_bytes_per_token(const struct kvs_runner *r) { return r->kv_bytes_total; }
int kvs_runner_max_tokens_per_step(const struct kvs_runner *r) { return r->step_tokens; }
int kvs_runner_max_seqs_per_step(const struct kvs_runner *r) { return r->cap_seqs; }
int kvs_runner_max_context(const struct kvs_runner *r) { return r->max_ctx; }

/* ---- forward ---------------------------------------------------------------------------- */

/* Logits rows a sequence asks for: all its tokens (ALL), its last one (LAST, ARGMAX) or none. */
static int seq_logit_rows(const struct kvs_batch_seq *q)
{
    return q->want_logits == KVS_LOGITS_ALL ? q->n_tokens : q->want_logits != KVS_LOGITS_NONE;
}

/* Writes row s of the step's block table (stride entries: table[0 .. need), then zeros) into
 * h_bt where it differs, widening the span to upload (bt_* fields). A new stride re-lays every
 * row, so nothing of d_bt counts as current then. */
static void bt_stage_row(struct kvs_runner *r, int s, int stride, const int32_t *table, int need)
{
    if (stride != r->bt_stride) {
        r->bt_stride = stride;
        r->bt_synced = 0;
        r->bt_dirty_lo = r->bt_dirty_hi = 0;
    }
    const size_t base = (size_t)s * stride;
    int32_t *bt = r->h_bt + base;
    size_t lo = SIZE_MAX, hi = 0;
    for (int j = 0; j < stride; j++) {
        const int32_t v = j < need ? table[j] : 0;
        /* entries past bt_synced were never uploaded at this stride: always part of the span */
        if (bt[j] != v || base + (size_t)j >= r->bt_synced) {
            bt[j] = v;
            if (lo == SIZE_MAX) lo = base + (size_t)j;
            hi = base + (size_t)j + 1;
        }
    }
    if (lo == SIZE_MAX) return;
    if (r->bt_dirty_hi == r->bt_dirty_lo) {
        r->bt_dirty_lo = lo;
        r->bt_dirty_hi = hi;
    } else {
        if (lo < r->bt_dirty_lo) r->bt_dirty_lo = lo;
        if (hi > r->bt_dirty_hi) r->bt_dirty_hi = hi;
    }
}

/* Uploads the changed span of the block table (bt_stage_row); the rows [0, n_entries) are then
 * current on the device. Returns the entries uploaded. */
static size_t bt_upload(struct kvs_runner *r, size_t n_entries)
{
    size_t lo = r->bt_dirty_lo, hi = r->bt_dirty_hi;
    if (hi > lo) r->ops->upload(r->be, r->d_bt, lo, r->h_bt + lo, hi - lo);
    r->bt_dirty_lo = r->bt_dirty_hi = 0;
    if (n_entries > r->bt_synced) r->bt_synced = n_entries;
    return hi - lo;
}

/* Uploads h[0 .. n) to d, only the span that differs from what d holds (up_shadow). */
static void upload_changed(struct kvs_runner *r, int which, struct kvs_dbuf *d, const int32_t *h, size_t n)
{
    struct up_shadow *sh = &r->ups[which];
    const size_t same = n < sh->valid ? n : sh->valid;
    size_t lo = 0, hi = n;
    while (lo < same && sh->v[lo] == h[lo]) lo++;
    if (lo == n) return;
    while (n <= sh->valid && hi > lo && sh->v[hi - 1] == h[hi - 1]) hi--;
    r->ops->upload(r->be, d, lo, h + lo, hi - lo);
    r->ups_sent += hi - lo;
    memcpy(sh->v + lo, h + lo, (hi - lo) * sizeof *h);
    if (n > sh->valid) sh->valid = n;
}

/* Validates the batch and fills the host staging arrays (block-table rows of at least
 * min_stride entries; padded with one-token dummy sequences up to pad_seqs sequences: token 0
 * at position 0 of block 0, no KV slot, no logits); returns the token count or -EINVAL.
 * The logits rows go to h_lrows (token row) and h_lout (logits row in batch order): the
 * *n_host rows whose logits go to the host first, then the ARGMAX rows, each part in batch
 * order; *n_logits counts both. */
static int stage_batch(struct kvs_runner *r, const struct kvs_batch *b, int min_stride, int pad_seqs, int *n_logits,
                       int *n_host, int *row_stride, int *any_rot, int *any_valid)
{
    if (!b || b->n_seqs <= 0 || b->n_seqs > r->cap_seqs || !b->seqs) return -EINVAL;
    int n = 0, stride = min_stride > 1 ? min_stride : 1, nl = 0, nh = 0, rot = 0, val = 0;
    for (int s = 0; s < b->n_seqs; s++) {
        const struct kvs_batch_seq *q = &b->seqs[s];
        if (q->n_tokens <= 0 || !q->tokens || q->pos < 0 || !q->block_table) return -EINVAL;
        if (q->want_logits < KVS_LOGITS_NONE || q->want_logits > KVS_LOGITS_ARGMAX) return -EINVAL;
        if (q->want_logits == KVS_LOGITS_ARGMAX && !b->argmax) return -EINVAL;
        if (q->n_tokens > r->cap_tokens - n || q->pos > r->max_ctx - q->n_tokens) return -EINVAL;
        int need = (q->pos + q->n_tokens + r->block_size - 1) / r->block_size;
        if (q->n_blocks < need || need > r->max_blocks) return -EINVAL;
        for (int j = 0; j < need; j++)
            if (q->block_table[j] < 0 || q->block_table[j] >= r->n_blocks) return -EINVAL;
        /* a token on the device (runner.h token_on_device): the slot's pick of the last step */
        if (q->token_on_device && (!r->async_ok || q->n_tokens != 1 || q->slot < 0 || q->slot >= r->cap_seqs ||
                                   r->slot_pick[q->slot] < 0))
            return -EINVAL;
        for (int i = q->token_on_device ? 1 : 0; i < q->n_tokens; i++)
            if (q->tokens[i] < 0 || q->tokens[i] >= r->vocab) return -EINVAL;
        if (need > stride) stride = need;
        if (q->block_rot_offset) rot = 1;
        if (q->block_valid) {
            val = 1;
            for (int j = 0; j < need; j++)
                if (q->block_valid[j] < 1 || q->block_valid[j] > r->block_size) return -EINVAL;
            /* the tokens being computed must land in valid slots */
            int last = q->pos + q->n_tokens - 1;
            if (last % r->block_size >= q->block_valid[last / r->block_size]) return -EINVAL;
        }
        n += q->n_tokens;
        if (q->want_logits != KVS_LOGITS_ARGMAX) nh += seq_logit_rows(q);
    }
    n = 0;
    int next_host = 0, next_argmax = nh;
    r->n_pairs = 0;
    for (int s = 0; r->async_ok && s < r->cap_seqs; s++) r->slot_pick_next[s] = -1;
    for (int s = 0; s < b->n_seqs; s++) {
        const struct kvs_batch_seq *q = &b->seqs[s];
        int need = (q->pos + q->n_tokens + r->block_size - 1) / r->block_size;
        r->h_qstart[s] = n;
        r->h_seqpos[s] = q->pos;
        int32_t *ro = r->h_rot + (size_t)s * stride;
        int32_t *va = r->h_valid + (size_t)s * stride;
        bt_stage_row(r, s, stride, q->block_table, need);
        /* the rotation and valid-slot tables only when some sequence has them (cached documents):
         * they are as big as the block table (S x stride, 1 MB at batch 128 x 32K context) */
        for (int j = 0; (rot || val) && j < stride; j++) {
            ro[j] = j < need && q->block_rot_offset ? q->block_rot_offset[j] : 0;
            va[j] = j < need && q->block_valid ? q->block_valid[j] : r->block_size;
        }
        for (int i = 0; i < q->n_tokens; i++) {
            int p = q->pos + i;
            r->h_tokens[n + i] = q->tokens[i];
            r->h_pos[n + i] = p;
            if (i == 0 && q->token_on_device) {
                r->h_tokens[n] = -1;   /* ids_to_tokens writes the pick there (upload_changed) */
                r->h_pairs[2 * r->n_pairs] = n;
                r->h_pairs[2 * r->n_pairs + 1] = r->slot_pick[q->slot];
                r->n_pairs++;
            }
            r->h_slots[n + i] = q->block_table[p / r->block_size] * r->block_size + p % r->block_size;
        }
        n += q->n_tokens;
        int rows = seq_logit_rows(q);
        for (int i = 0; i < rows; i++) {
            int k = q->want_logits == KVS_LOGITS_ARGMAX ? next_argmax++ : next_host++;
            r->h_lrows[k] = n - rows + i;
            r->h_lout[k] = nl++;
            if (r->async_ok && q->want_logits == KVS_LOGITS_ARGMAX && q->slot >= 0 && q->slot < r->cap_seqs)
                r->slot_pick_next[q->slot] = k;
        }
    }
    for (int s = b->n_seqs; s < pad_seqs; s++) {
        r->h_qstart[s] = n;
        r->h_seqpos[s] = 0;
        bt_stage_row(r, s, stride, NULL, 0);
        for (int j = 0; j < stride; j++) {
            if (!rot && !val) continue;
            r->h_rot[(size_t)s * stride + j] = 0;
            r->h_valid[(size_t)s * stride + j] = r->block_size;
        }
        r->h_tokens[n] = 0;
        r->h_pos[n] = 0;
        r->h_slots[n] = -1; /* kv_write skips it */
        n++;
    }
    r->h_qstart[pad_seqs > b->n_seqs ? pad_seqs : b->n_seqs] = n;
    *n_logits = nl;
    *n_host = nh;
    *row_stride = stride;
    *any_rot = rot;
    *any_valid = val;
    return n;
}

/* q/k/v projections of r->xn, the q/k norms (Qwen3), RoPE and the cache write of layer L from
 * the backend's separate ops */
static void qkv_rope_kv_write(struct kvs_runner *r, const struct layer_w *L, int n)
{
    const struct kvs_backend_ops *o = r->ops;
    struct kvs_backend *be = r->be;
    const int dim = r->dim, nh = r->nh, nkv = r->nkv, hd = r->hd, l = (int)(L - r->layers);
    const float eps = r->mc.rms_norm_eps;
    if (o->matmul_multi) {
        const struct kvs_dweight *w[3] = {L->wq, L->wk, L->wv}, *bias[3] = {L->bq, L->bk, L->bv};
        const int outs[3] = {nh * hd, nkv * hd, nkv * hd};
        struct kvs_dbuf *y[3] = {r->q, r->k, r->v};
        o->matmul_multi(be, r->xn, 3, w, bias, n, dim, outs, y);
    } else {
        o->matmul(be, r->xn, L->wq, L->bq, n, dim, nh * hd, r->q);
        o->matmul(be, r->xn, L->wk, L->bk, n, dim, nkv * hd, r->k);
        o->matmul(be, r->xn, L->wv, L->bv, n, dim, nkv * hd, r->v);
    }
    if (L->q_norm) {
        o->head_rmsnorm(be, r->q, L->q_norm, eps, n, nh, hd);
        o->head_rmsnorm(be, r->k, L->k_norm, eps, n, nkv, hd);
    }
    struct kvs_kv_view kv;
    r->st->view(r->st_state, l, &kv);
    /* a policy that matches on pre-RoPE queries gets a copy of q before the rotation (the
     * backend's row gather with rows 0 .. n-1: one op, no host round trip) */
    if (r->q_pre) o->gather_rows(be, r->q, r->d_iota, n, nh * hd, r->q_pre);
    if (o->rope_kv_write && r->st->plain_view && !r->q_pre) {
        o->rope_kv_write(be, r->q, r->k, r->v, r->d_pos, r->d_inv_freq, r->d_slots, n, nh, nkv, hd, r->block_size, kv.k,
                         kv.v);
    } else {
        o->rope(be, r->q, r->d_pos, NULL, r->d_inv_freq, n, nh, hd);
        o->rope(be, r->k, r->d_pos, NULL, r->d_inv_freq, n, nkv, hd);
        r->st->write(r->st_state, l, r->k, r->v, r->d_slots, n);
    }
}

/* r->proj = down(silu(gate) * up) of r->xn for layer L from the backend's separate ops */
static void mlp(struct kvs_runner *r, const struct layer_w *L, int n)
{
    const struct kvs_backend_ops *o = r->ops;
    struct kvs_backend *be = r->be;
    const int dim = r->dim, ff = r->ff;
    if (o->matmul_swiglu) {
        o->matmul_swiglu(be, r->xn, L->w_gate, L->w_up, n, dim, ff, r->gate, r->up);
    } else {
        o->matmul(be, r->xn, L->w_gate, NULL, n, dim, ff, r->gate);
        o->matmul(be, r->xn, L->w_up, NULL, n, dim, ff, r->up);
        o->swiglu(be, r->gate, r->up, n, ff, r->gate);
    }
    o->matmul(be, r->gate, L->w_down, NULL, n, ff, dim, r->proj);
}

/* the embedding and the layer loop (leaves the final-normed rows in r->xn); with fid_layer >= 0
 * the fidelity meter also runs exact attention at that layer (an eager step) */
static void run_layers(struct kvs_runner *r, int n, const struct kvs_kv_step *step, int fid_layer)
{
    const struct kvs_backend_ops *o = r->ops;
    struct kvs_backend *be = r->be;
    int dim = r->dim, nh = r->nh, nkv = r->nkv, hd = r->hd, ff = r->ff;
    float eps = r->mc.rms_norm_eps;
    float scale = 1.0f / sqrtf((float)hd);

    const size_t nd = (size_t)n * dim;
    const int tp = r->n_ranks > 1;
    o->embed(be, r->embed, r->d_tokens, n, dim, r->x);
    if (tp) o->allreduce_sum(be, r->x, nd); /* each rank looked up its vocabulary rows, zeros elsewhere */
    o->rmsnorm(be, r->x, r->layers[0].attn_norm, eps, n, dim, r->xn);
    for (int l = 0; l < r->n_layers; l++) {
        const struct layer_w *L = &r->layers[l];
        struct kvs_kv_view kv;
        r->st->view(r->st_state, l, &kv);
        if (o->matmul_rope_kv_write && !L->q_norm && r->st->plain_view && !r->q_pre) {
            /* q/k/v projections, RoPE and the cache write in one op (Qwen3's q/k norms come
             * between the projections and the RoPE: qkv_rope_kv_write composes them) */
            const struct kvs_dweight *w[3] = {L->wq, L->wk, L->wv}, *bias[3] = {L->bq, L->bk, L->bv};
            o->matmul_rope_kv_write(be, r->xn, w, bias, n, dim, r->q, r->k, r->v, r->d_pos, r->d_inv_freq, r->d_slots,
                                    nh, nkv, hd, r->block_size, kv.k, kv.v);
        } else {
            qkv_rope_kv_write(r, L, n);
        }
        /* attention through the decode policy (kv.h); full is the backend's attention() */
        const struct kvs_kv_attend a = {step, r->q, r->q_pre, kv, nh, nkv, hd, r->block_size, scale, r->att, r->d_lse};
        r->dp->attend(r->dp_state, l, &a);
        if (l == fid_layer) kvs_fidelity_measure(&r->fid, &a);
        if (r->dp->finish) r->dp->finish(r->dp_state, l, step);
        o->matmul(be, r->att, L->wo, L->bo, n, nh * hd, dim, r->proj);
        if (tp) o->allreduce_sum(be, r->proj, nd); /* the ranks' heads' shares of o_proj */
        o->add_rmsnorm(be, r->x, r->proj, L->mlp_norm, eps, n, dim, r->xn);
        if (o->matmul_swiglu_down) {
            o->matmul_swiglu_down(be, r->xn, L->w_gate, L->w_up, L->w_down, n, dim, ff, r->gate, r->up, r->proj);
        } else {
            mlp(r, L, n);
        }
        if (tp) o->allreduce_sum(be, r->proj, nd); /* the ranks' FFN columns' shares of down_proj */
        const struct kvs_dweight *next = l + 1 < r->n_layers ? r->layers[l + 1].attn_norm : r->final_norm;
        o->add_rmsnorm(be, r->x, r->proj, next, eps, n, dim, r->xn);
    }
}

/* Sequences of a recorded decode step: the batch's, rounded up to a bucket (dummy sequences
 * fill the rest), so that a batch shrinking one sequence at a time replays a few recordings
 * instead of recording one per size. */
static int graph_seqs(const struct kvs_runner *r, int n_seqs)
{
    for (int i = 0; i < KVS_N_GRAPH_BUCKETS; i++) {
        const int bk = kvs_graph_buckets[i];
        if (bk >= n_seqs) return bk <= r->cap_seqs && bk <= r->cap_tokens ? bk : n_seqs;
    }
    return n_seqs;
}

/* Capacity of a recorded step for this batch: 0 unless graphs are on and every sequence decodes
 * one token; else the longest context rounded up to graph_ctx_step (at most the model's). */
static int graph_capacity(const struct kvs_runner *r, const struct kvs_batch *b)
{
    if (!r->use_graphs || !b || b->n_seqs <= 0 || !b->seqs) return 0;
    int maxc = 0;
    for (int s = 0; s < b->n_seqs; s++) {
        if (b->seqs[s].n_tokens != 1) return 0;
        int c = b->seqs[s].pos + 1;
        if (c > maxc) maxc = c;
    }
    const int st = r->graph_ctx_step;
    int cap = (maxc + st - 1) / st * st;
    return cap < r->max_ctx ? cap : r->max_ctx;
}

/* Runs the layer loop of a decode step through its recording (made on first use). Returns 0, or
 * -1 when the backend could not record it (graphs are then turned off; the caller runs the
 * step eagerly). */
static int run_layers_graph(struct kvs_runner *r, int n, const struct kvs_kv_step *step, int cap, int rot, int valid)
{
    const struct kvs_attn_meta *m = step->m;
    struct step_graph *hit = NULL, *victim = &r->graphs[0];
    for (int i = 0; i < GRAPH_CACHE; i++) {
        struct step_graph *e = &r->graphs[i];
        if (e->g && e->n_seqs == m->n_seqs && e->cap == cap && e->rot == rot && e->valid == valid) hit = e;
        if (e->used < victim->used) victim = e;
    }
    if (!hit) {
        char err[200];
        if (victim->g) r->ops->graph_free(r->be, victim->g);
        victim->g = NULL;
        r->ops->graph_begin(r->be);
        run_layers(r, n, step, -1);
        victim->g = r->ops->graph_end(r->be, err, sizeof err);
        if (!victim->g) {
            kvs_log(KVS_LOG_WARN, "runner: step graphs off: %s", err);
            r->use_graphs = 0;
            victim->used = 0;
            return -1;
        }
        *victim = (struct step_graph){m->n_seqs, cap, rot, valid, victim->g, 0};
        hit = victim;
    }
    hit->used = ++r->graph_clock;
    r->ops->graph_launch(r->be, hit->g);
    return 0;
}

/* The LM head over staged logits rows [first, first + m) (m <= argmax_chunk) into r->logits
 * (the rank's vocabulary columns); with ids, also their argmax ids into d_ids[first ..) (and,
 * in a group, their values into d_vals, by which runner_tp.c merges the ranks' picks). */
static void lm_head_chunk(struct kvs_runner *r, int first, int m, int ids)
{
    const struct kvs_backend_ops *o = r->ops;
    upload_changed(r, UP_LROWS, r->d_lrows, r->h_lrows + first, (size_t)m);
    o->gather_rows(r->be, r->xn, r->d_lrows, m, r->dim, r->lrows);
    o->matmul(r->be, r->lrows, r->lm_head, NULL, m, r->dim, r->vocab_n, r->logits);
    if (!ids) return;
    if (r->n_ranks > 1) o->argmax_rows_val(r->be, r->logits, m, r->vocab_n, r->d_ids, r->d_vals, (size_t)first);
    else o->argmax_rows(r->be, r->logits, m, r->vocab, r->d_ids, (size_t)first);
}

/* The LM head of the step: host rows [0, n_host) to logits (in order, chunk by chunk; a rank of
 * a group fills its own columns of each row), then the ARGMAX rows, which stay on the backend;
 * with b->argmax, the ids of every row come back in one download at the end and are put back in
 * batch order (a group's ranks leave theirs in h_ids / h_vals for runner_tp.c). */
static void lm_head(struct kvs_runner *r, const struct kvs_batch *b, int n_logits, int n_host, float *logits)
{
    const int ids = b->argmax != NULL, tp = r->n_ranks > 1, V = r->vocab, vn = r->vocab_n;
    for (int i = 0; i < n_host; i += LOGIT_CHUNK) {
        int m = n_host - i < LOGIT_CHUNK ? n_host - i : LOGIT_CHUNK;
        lm_head_chunk(r, i, m, ids);
        r->ops->logits_to_host(r->be, r->logits, m, vn, tp ? r->h_chunk : logits + (size_t)i * V);
        for (int t = 0; tp && t < m; t++)
            memcpy(logits + (size_t)(i + t) * V + r->vocab_lo, r->h_chunk + (size_t)t * vn, (size_t)vn * sizeof(float));
    }
    for (int i = n_host; i < n_logits; i += r->argmax_chunk)
        lm_head_chunk(r, i, n_logits - i < r->argmax_chunk ? n_logits - i : r->argmax_chunk, 1);
    r->n_picks = ids ? n_logits : 0;
    if (!ids || n_logits == 0) return;
    if (r->async_ok && r->pend_on && n_logits <= KVS_FETCH_MAX) {
        /* kvs_runner_forward_begin: the picks go to a fetch area behind the step; end waits for
         * that copy only, so a step begun after this one keeps the device busy meanwhile */
        struct pend_step *p = &r->pq[(r->pq_head + r->pq_n - 1) % 2];
        p->argmax = b->argmax;
        p->rows = n_logits;
        p->area = r->fetch_next;
        r->fetch_next ^= 1;
        memcpy(p->lout, r->h_lout, (size_t)n_logits * sizeof(int32_t));
        r->ops->fetch_begin(r->be, r->d_ids, (size_t)n_logits, p->area);
        return;
    }
    if (r->n_ranks == 1 && r->pend_on && !r->async_ok) {   /* kvs_runner_forward_begin: end downloads them */
        r->pend_argmax = b->argmax;
        r->pend_rows = n_logits;
        return;
    }
    r->ops->download(r->be, r->h_ids, r->d_ids, 0, (size_t)n_logits);
    if (tp) {
        r->ops->download(r->be, r->h_vals, r->d_vals, 0, (size_t)n_logits);
        return;
    }
    for (int k = 0; k < n_logits; k++) b->argmax[r->h_lout[k]] = r->h_ids[k];
}

void kvs_runner_rank_picks(const struct kvs_runner *r, struct kvs_rank_picks *p)
{
    *p = (struct kvs_rank_picks){r->n_picks, r->vocab_lo, r->h_ids, r->h_vals, r->h_lout};
}

int kvs_runner_forward(struct kvs_runner *r, const struct kvs_batch *b, float *logits)
{
    return r->n_ranks > 1 ? kvs_tp_forward(r->tp, b, logits) : kvs_runner_rank_forward(r, b, logits);
}

/* The step is queued on the backend; only the argmax ids' download (the step's one wait for the
 * device on a greedy decode step) is left to end. A group (tensor parallel) runs the whole step
 * here and end only returns its result. */
int kvs_runner_forward_begin(struct kvs_runner *r, const struct kvs_batch *b, float *logits)
{
    if (r->async_ok) {   /* a queue of two begun steps (runner.h) */
        KVS_ASSERT(r->pq_n < 2);
        struct pend_step *p = &r->pq[(r->pq_head + r->pq_n++) % 2];
        p->argmax = NULL;
        p->rows = 0;
        p->fetched = 0;
        r->pend_on = 1;   /* lm_head: fill p */
        p->rc = kvs_runner_forward(r, b, logits);
        r->pend_on = 0;
        /* picks over the fetch area's size were downloaded at once (lm_head's synchronous path) */
        if (p->rc == 0 && !p->argmax) p->fetched = 1;
        return p->rc;
    }
    KVS_ASSERT(!r->pend_on);
    r->pend_on = 1;
    r->pend_argmax = NULL;
    r->pend_rows = 0;
    r->pend_rc = kvs_runner_forward(r, b, logits);
    return r->pend_rc;
}

int kvs_runner_forward_end(struct kvs_runner *r)
{
    if (r->async_ok) {
        KVS_ASSERT(r->pq_n > 0);
        struct pend_step *p = &r->pq[r->pq_head];
        r->pq_head = (r->pq_head + 1) % 2;
        r->pq_n--;
        if (p->rc < 0 || p->fetched || !p->argmax) return p->rc;
        r->ops->fetch_end(r->be, p->area, r->h_ids, (size_t)p->rows);
        for (int k = 0; k < p->rows; k++) p->argmax[p->lout[k]] = r->h_ids[k];
        return 0;
    }
    KVS_ASSERT(r->pend_on);
    r->pend_on = 0;
    if (r->pend_rc < 0 || !r->pend_argmax) return r->pend_rc;
    r->ops->download(r->be, r->h_ids, r->d_ids, 0, (size_t)r->pend_rows);
    for (int k = 0; k < r->pend_rows; k++) r->pend_argmax[r->h_lout[k]] = r->h_ids[k];
    r->pend_argmax = NULL;
    return 0;
}

int kvs_runner_async_ok(const struct kvs_runner *r) { return r->async_ok; }

/* a group's ranks either all run the step or all refuse it: no rank may wait in an all-reduce
 * that another never reaches */
static int agree(struct kvs_runner *r, int rc) { return r->n_ranks > 1 ? kvs_tp_agree(r->tp, rc) : rc; }

/* Multi-row decode (kv.h recompute): x gets b with every decoding request that the policy
 * widens turned into its k re-run tokens (from the slot's history) plus the new one, logits on
 * the last row only; then each slot's history takes the step's tokens. -EINVAL for a batch over
 * the capacities (stage_batch checks the rest). */
static int widen_batch(struct kvs_runner *r, const struct kvs_batch *b, struct kvs_batch *x)
{
    if (!b || b->n_seqs <= 0 || b->n_seqs > r->cap_seqs || !b->seqs) return -EINVAL;
    const int H = r->hist_cap;
    int off = 0;
    *x = *b;
    x->seqs = r->x_seqs;
    for (int s = 0; s < b->n_seqs; s++) {
        const struct kvs_batch_seq *q = &b->seqs[s];
        struct kvs_batch_seq *w = &r->x_seqs[s];
        *w = *q;
        const int slot = q->slot >= 0 && q->slot < r->cap_seqs ? q->slot : -1;
        if (slot < 0 || q->n_tokens <= 0 || !q->tokens) continue;
        if (q->slot_fresh) r->h_hist_n[slot] = 0;
        int32_t *h = r->h_hist + (size_t)slot * H;
        int k = 0;
        if (q->n_tokens == 1 && q->pos > 0) {
            k = r->dp->recompute(r->dp_state, slot);
            if (k > r->h_hist_n[slot]) k = r->h_hist_n[slot];
            if (k > q->pos) k = q->pos;
            if (k < 0) k = 0;
        }
        if (k > 0) {
            if (off + k + 1 > r->cap_tokens) return -EINVAL;
            memcpy(r->x_tokens + off, h + r->h_hist_n[slot] - k, (size_t)k * sizeof(int32_t));
            r->x_tokens[off + k] = q->tokens[0];
            w->tokens = r->x_tokens + off;
            w->n_tokens = k + 1;
            w->pos = q->pos - k;
            if (w->want_logits == KVS_LOGITS_ALL) w->want_logits = KVS_LOGITS_LAST; /* one token's logits */
            off += k + 1;
        }
        /* the history: the slot's last H tokens */
        const int m = q->n_tokens < H ? q->n_tokens : H, keep = H - m < r->h_hist_n[slot] ? H - m : r->h_hist_n[slot];
        memmove(h, h + r->h_hist_n[slot] - keep, (size_t)keep * sizeof(int32_t));
        memcpy(h + keep, q->tokens + q->n_tokens - m, (size_t)m * sizeof(int32_t));
        r->h_hist_n[slot] = keep + m;
    }
    return 0;
}

/* Host time per step, logged every SPAN_STEPS steps at info level: what the scheduler thread
 * spends in the runner before the device has the step (clock_gettime spans; a profile of the
 * serving daemon's step without perf). */
#define SPAN_STEPS 1024
static void span_log(struct kvs_runner *r, const double *t, int rows)
{
    for (int i = 0; i < 5; i++) r->span_s[i] += t[i + 1] - t[i];
    r->span_rows += rows;
    if (++r->span_steps < SPAN_STEPS) return;
    const double k = 1e6 / r->span_steps;
    if (r->rank == 0)
        kvs_log(KVS_LOG_INFO,
                "runner: host us per step over %d steps (%.1f rows): stage %.1f, uploads %.1f, policy %.1f, "
                "layers launch %.1f, LM head %.1f",
                r->span_steps, r->span_rows / r->span_steps, r->span_s[0] * k, r->span_s[1] * k, r->span_s[2] * k,
                r->span_s[3] * k, r->span_s[4] * k);
    memset(r->span_s, 0, sizeof r->span_s);
    r->span_rows = 0;
    r->span_steps = 0;
}

int kvs_runner_rank_forward(struct kvs_runner *r, const struct kvs_batch *b, float *logits)
{
    double ts[6];
    ts[0] = kvs_now();
    r->ups_sent = 0;
    /* fresh slots reset before anything asks the policy about them (host state only) */
    for (int s = 0; b && b->seqs && s < b->n_seqs && s < r->cap_seqs; s++) {
        const struct kvs_batch_seq *q = &b->seqs[s];
        if (q->slot >= 0 && q->slot < r->cap_seqs && q->slot_fresh && r->dp->seq_init) {
            void *mem = r->slot_bytes ? r->slot_mem + (size_t)q->slot * r->slot_bytes : NULL;
            if (mem) memset(mem, 0, r->slot_bytes);
            int rc = r->dp->seq_init(r->dp_state, q->slot, mem);
            if (rc < 0) return agree(r, rc);
        }
        if (q->slot >= 0 && q->slot < r->cap_seqs && q->slot_fresh && r->st->seq_init) {
            int rc = r->st->seq_init(r->st_state, q->slot);
            if (rc < 0) return agree(r, rc);
        }
    }
    const struct kvs_batch *b0 = b;
    struct kvs_batch wide;
    if (r->hist_cap > 0) {
        int rc = widen_batch(r, b, &wide);
        if (rc < 0) return agree(r, rc);
        b = &wide;
    }
    int n_logits, n_host, stride, any_rot, any_valid;
    const int cap = graph_capacity(r, b);
    const int S = cap ? graph_seqs(r, b->n_seqs) : b->n_seqs;
    int n = stage_batch(r, b, cap ? (cap + r->block_size - 1) / r->block_size : 0, S, &n_logits, &n_host, &stride,
                        &any_rot, &any_valid);
    if (n >= 0 && n_host > 0 && !logits) n = -EINVAL;
    if (n < 0) return agree(r, n);
    ts[1] = kvs_now();
    /* a rank's embedding rows are its vocabulary's, then one zero row for every other token */
    for (int i = 0; r->n_ranks > 1 && i < n; i++) {
        const int t = r->h_tokens[i] - r->vocab_lo;
        r->h_tokens[i] = t >= 0 && t < r->vocab_n ? t : r->vocab_n;
    }
    const struct kvs_backend_ops *o = r->ops;
    struct kvs_backend *be = r->be;
    upload_changed(r, UP_TOKENS, r->d_tokens, r->h_tokens, (size_t)n);
    if (r->n_pairs) {   /* tokens still on the device: the last step's picks (before its d_ids are rewritten) */
        upload_changed(r, UP_PAIRS, r->d_pairs, r->h_pairs, (size_t)r->n_pairs * 2);
        o->ids_to_tokens(be, r->d_ids, r->d_pairs, r->n_pairs, r->d_tokens);
    }
    if (r->async_ok) {   /* this step's picks are the ones the next step may read */
        int32_t *t = r->slot_pick;
        r->slot_pick = r->slot_pick_next;
        r->slot_pick_next = t;
    }
    upload_changed(r, UP_POS, r->d_pos, r->h_pos, (size_t)n);
    upload_changed(r, UP_SLOTS, r->d_slots, r->h_slots, (size_t)n);
    upload_changed(r, UP_QSTART, r->d_qstart, r->h_qstart, (size_t)S + 1);
    /* a recorded step's sequences are one token each (padding too: token 0 at position 0), so
     * their positions are the tokens' (d_pos): one upload fewer */
    if (!cap) upload_changed(r, UP_SEQPOS, r->d_seqpos, r->h_seqpos, (size_t)S);
    r->info = (struct kvs_runner_step_info){S, stride, bt_upload(r, (size_t)S * stride), 0};
    if (any_rot) o->upload(be, r->d_rot, 0, r->h_rot, (size_t)S * stride);
    if (any_valid) o->upload(be, r->d_valid, 0, r->h_valid, (size_t)S * stride);
    /* cached documents: the same tables packed one word per block as well (backend.h) */
    int words = (any_rot || any_valid) && kvs_pack_block_words(r->h_bt, r->h_rot, r->h_valid, (size_t)S * stride,
                                                               r->block_size, r->h_words) == 0;
    if (words) o->upload(be, r->d_words, 0, r->h_words, (size_t)S * stride * 2);

    ts[2] = kvs_now();
    int max_ctx = 0;
    for (int s = 0; s < S; s++) {
        int c = r->h_seqpos[s] + (r->h_qstart[s + 1] - r->h_qstart[s]);
        if (c > max_ctx) max_ctx = c;
    }
    struct kvs_attn_meta meta = {
        .n_seqs = S, .max_blocks = stride, .q_start = r->d_qstart, .pos = cap ? r->d_pos : r->d_seqpos, .block_tables = r->d_bt,
        .rot_offsets = any_rot ? r->d_rot : NULL,
        .block_valid = any_valid ? r->d_valid : NULL, .block_words = words ? r->d_words : NULL, .inv_freq = r->d_inv_freq, .h_q_start = r->h_qstart,
        .h_pos = r->h_seqpos, .max_ctx = max_ctx, .plan_ctx = cap,
    };
    /* the decode policy's view of the step: request slots, decode rows; fresh slots reset */
    int n_decode = 0;
    for (int s = 0; s < S; s++) {
        const struct kvs_batch_seq *q = s < b0->n_seqs ? &b0->seqs[s] : NULL;   /* as the scheduler made it */
        r->h_slot[s] = q ? q->slot : -1;
        r->h_decode[s] = q && q->n_tokens == 1 && q->pos > 0;
        n_decode += r->h_decode[s];
    }
    const struct kvs_kv_step step = {S, n, r->h_qstart, r->h_seqpos, r->h_slot, r->h_decode, &meta, r->h_bt,
                                     b0 == b ? cap : graph_capacity(r, b0)};
    int rc = r->st->step ? r->st->step(r->st_state, &step) : 0;
    if (rc == 0 && r->dp->plan) rc = r->dp->plan(r->dp_state, &step);
    /* a group also agrees on the step's rows: a policy's multi-row decode (recompute) decided
     * per rank must widen the batch alike everywhere, or the all-reduces would not match */
    rc = r->n_ranks > 1 ? kvs_tp_agree_rows(r->tp, r->rank, rc < 0 ? rc : 0, n) : rc;
    if (rc < 0) return rc;
    /* KV bytes full attention reads for the decode rows (the policy reports what it read) */
    for (int s = 0; s < S; s++)
        if (r->h_decode[s])   /* the newest row's context (a multi-row decode's last row) */
            r->fid.full_bytes += (double)(r->h_seqpos[s] + r->h_qstart[s + 1] - r->h_qstart[s]) *
                                 (double)r->kv_bytes_per_token;
    const int fid_layer = n_decode ? kvs_fidelity_pick_layer(&r->fid, r->n_layers) : -1;
    ts[3] = kvs_now();
    if (fid_layer >= 0 || !cap || run_layers_graph(r, n, &step, cap, any_rot, any_valid | words << 1) != 0)
        run_layers(r, n, &step, fid_layer);
    ts[4] = kvs_now();
    lm_head(r, b, n_logits, n_host, logits);
    r->info.in_uploaded = r->ups_sent;
    ts[5] = kvs_now();
    span_log(r, ts, n);
    return 0;
}

void kvs_runner_last_step(const struct kvs_runner *r, struct kvs_runner_step_info *out)
{
    *out = r->info;
}

int kvs_runner_block_tables(struct kvs_runner *r, int32_t *out, size_t cap)
{
    const size_t n = (size_t)r->info.n_seqs * (size_t)r->info.stride;
    if (n == 0) return 0;
    if (n > cap) return -ENOSPC;
    r->ops->download(r->be, out, r->d_bt, 0, n);
    return (int)n;
}

int kvs_runner_copy_block(struct kvs_runner *r, int32_t src, int32_t dst)
{
    if (src < 0 || dst < 0 || src >= r->n_blocks || dst >= r->n_blocks) return -EINVAL;
    if (r->n_ranks > 1) return kvs_tp_copy_block(r->tp, src, dst);
    kvs_runner_rank_copy_block(r, src, dst);
    return 0;
}

void kvs_runner_rank_copy_block(struct kvs_runner *r, int32_t src, int32_t dst)
{
    r->st->copy_block(r->st_state, src, dst);
}

void kvs_runner_seq_end(struct kvs_runner *r, int slot)
{
    if (slot < 0 || slot >= r->cap_seqs || (!r->dp->seq_free && !r->st->seq_free)) return;
    if (r->n_ranks > 1) kvs_tp_seq_end(r->tp, slot);
    else kvs_runner_rank_seq_end(r, slot);
}

int kvs_runner_kv_offloaded(struct kvs_runner *r, int slot, int *lo, int *hi)
{
    if (slot < 0 || slot >= r->cap_seqs || r->n_ranks > 1 || !r->dp->offloaded) return 0;
    return r->dp->offloaded(r->dp_state, slot, lo, hi);
}

int kvs_runner_kv_footprint(struct kvs_runner *r, int n_tokens, int chunk, int host_avail, int *host_pages,
                            int *host_free, int *host_total)
{
    if (r->n_ranks > 1 || !r->dp->footprint) return -ENOSYS;
    return r->dp->footprint(r->dp_state, n_tokens, chunk, host_avail, host_pages, host_free, host_total);
}

void kvs_runner_rank_seq_end(struct kvs_runner *r, int slot)
{
    if (r->dp->seq_free) r->dp->seq_free(r->dp_state, slot);
    if (r->st->seq_free) r->st->seq_free(r->st_state, slot);
}

void kvs_runner_rank_fidelity_merge(struct kvs_runner *const *ranks, int n)
{
    struct kvs_fidelity *f0 = &ranks[0]->fid;
    for (int k = 0; k < f0->n_pend; k++) {
        double num = 0, den = 0;
        for (int i = 0; i < n; i++) {
            const struct kvs_fidelity *f = &ranks[i]->fid;
            if (k < f->n_pend) num += f->pend[2 * k], den += f->pend[2 * k + 1];
        }
        kvs_fidelity_add(f0, num, den);
    }
    for (int i = 0; i < n; i++) ranks[i]->fid.n_pend = 0;
}

struct kvs_backend *kvs_runner_rank_backend(const struct kvs_runner *r, const struct kvs_backend_ops **ops)
{
    *ops = r->ops;
    return r->be;
}

size_t kvs_runner_rank_reduce_elems(const struct kvs_runner *r) { return (size_t)r->cap_tokens * (size_t)r->dim; }

void kvs_runner_rank_warm(struct kvs_runner *r)
{
    r->ops->zero(r->be, r->proj, 0, kvs_runner_rank_reduce_elems(r));
    r->ops->allreduce_sum(r->be, r->proj, kvs_runner_rank_reduce_elems(r));
    r->ops->sync(r->be);
}

int kvs_runner_kv_counters(struct kvs_runner *r, struct kvs_kv_counter *out, int cap)
{
    return r->n_ranks > 1 ? kvs_tp_kv_counters(r->tp, out, cap) : kvs_runner_rank_kv_counters(r, out, cap);
}

int kvs_runner_rank_kv_counters(struct kvs_runner *r, struct kvs_kv_counter *out, int cap)
{
    int n = r->dp->counters ? r->dp->counters(r->dp_state, out, cap) : 0;
    if (r->st->counters) n += r->st->counters(r->st_state, out + n, cap - n);
    /* an exact policy without counters reads what full attention reads */
    const double read = r->dp->counters ? -1.0 : r->fid.full_bytes;
    if (r->slot_bytes && n < cap)
        out[n++] = (struct kvs_kv_counter){"kvserve:kv_decode_state_bytes",
                                           "Bytes of the decode policy's per-request state (arena).", 0,
                                           (double)r->slot_bytes * (double)r->cap_seqs, NULL, NULL};
    return n + kvs_fidelity_counters(&r->fid, read, out + n, cap - n);
}
