/* kv.h: the KV-cache seam. Three slots, each an op table with its own state, chosen by the
 * config (kv.storage, kv.reuse, kv.decode), the way redis's ae.c takes one ae_<poller>.c:
 *
 *   storage  how a block stores K and V (kv_storage_dense.c: the backend's native f32 / bf16;
 *            kv_storage_lean.c: LeanKV's quantized pages, which also attend over their bytes). Runner side: it owns the cache bytes on the backend, sizes a block,
 *            writes the step's K/V and gives the kernels a view. The runner never allocates or
 *            addresses the cache itself.
 *   reuse    KV shared across requests (kv_reuse_none.c, kv_reuse_prefix.c, kv_reuse_lazy.c).
 *            Scheduler side: the prompt layout of a request (documents as cached segments or
 *            inline), admission (shared blocks at the start of the block table), side prefills
 *            (work the step runs for the strategy, e.g. documents), commit and release, and
 *            the per-block attention metadata of a sequence (rotation offsets, valid slots).
 *   decode   how a decode row reads the cache (kv_decode_full.c, kv_decode_quest.c,
 *            kv_decode_mac.c, kv_decode_retro.c, kv_decode_paris.c). Runner side: `needs`, per-request state (seq_init / seq_free, from a
 *            budgeted arena), plan once per step, attend per layer (replaces the attention
 *            call), finish after the layer, counters.
 *
 * A registry (kv.c) names every implementation in one table, and the composition matrix of
 * STRATEGIES.md is a second table: kvs_kv_check refuses a combination that does not compose,
 * naming both keys and the reason. Adding a strategy touches its own file(s), one registry
 * row, one config section and one test-case file; never the scheduler, the server or another
 * strategy. Tests and tools may add implementations at run time (kvs_kv_register_decode).
 *
 * Kernel side: every policy builds on the backend's attention_spans and attn_merge
 * (kernels/backend.h), reading the cache through kvs_kv_attention / kvs_kv_attention_spans
 * (below): a storage with a format of its own (not plain_view) supplies both over its bytes, so
 * a policy runs unchanged on a quantized cache; a strategy's own kernels live in kernels/cpu/kv_<name>.c and
 * kernels/cuda/kv_<name>.cu. A backend that lacks what a strategy needs makes its create()
 * fail with -ENOSYS and a message; the daemon then refuses the config at startup.
 *
 * Tensor parallelism (parallel.tensor, engine/runner_tp.h): every rank creates its own storage
 * and decode policy over its heads (n_kv_heads / n_heads in the env and shape are the rank's),
 * with the same steps. A strategy's decisions must therefore be per head or per KV group
 * (never a statistic over all heads), and recompute() must give every rank the same k (the
 * runner refuses a step whose ranks disagree, -EPROTO). Counters are merged over the ranks by
 * name (runner_tp.c merge_kind: bytes and per-head tallies summed, fractions averaged, the rest
 * rank 0's); tests/unit/test_tp_kv.c runs every strategy at TP 2 / 3 / 4 against TP 1.
 *
 * Ownership: kvs_kv_init allocates the engine-side state (the reuse strategy's tables) that
 * kvs_kv_free releases; the block pool is borrowed. Runner-side states (storage, decode) are
 * created and destroyed by the runner through the ops. Threads: the scheduler thread only.
 * Errors: 0 / negative errno with a message in (err, errlen); -EINVAL unknown name or bad
 * combination, -ENOSYS not available on this backend or build.
 */
#ifndef KVS_KV_H
#define KVS_KV_H

#include <stddef.h>
#include <stdint.h>

#include "engine/engine.h"   /* struct kvs_kv_counter */
#include "engine/kv/block_pool.h"
#include "kernels/backend.h"

struct kvs_config;

/* ---- storage (runner side) --------------------------------------------------------------- */
struct kvs_kv_shape {
    int n_layers, n_kv_heads, head_dim, block_size;
    const struct kvs_config *cfg; /* the storage's config section (kv.lean.*); NULL = its defaults */
    int n_heads;                  /* query heads (a format's attention may depend on the group) */
    /* the runner's limits (0 = unknown: tools and tests that build a storage by hand): request
     * slots, rows per step, tokens per request; a storage with per-request state sizes it by them */
    int max_slots, max_rows, max_ctx;
};

struct kvs_kv_storage_ops;
struct kvs_kv_step;

/* What the kernels read: one layer's K and V.
 * - A storage whose bytes are the backend's plain KV pool (plain_view = 1) sets k and v to that
 *   pool (backend.h layout) and fmt = NULL: every policy reads it with the backend's attention()
 *   and attention_spans().
 * - A storage with a format of its own (LeanKV's quantized pages) sets fmt to its ops table,
 *   which then has attention and attention_spans over its own bytes, and fmt_state / layer for
 *   them (k and v may be NULL): only the format knows how to read its bytes.
 * A policy that the composition matrix lets run over a storage with a format of its own (full,
 * mac with lean) must not call the backend's attention ops on a view directly: it goes through
 * kvs_kv_attention() / kvs_kv_attention_spans() below, which pick the format's op when there is
 * one (full, the fidelity meter and the test policies do; quest, refused with lean, reads k / v
 * directly, e.g. for its digests). */
struct kvs_kv_view {
    struct kvs_dbuf *k, *v;
    const struct kvs_kv_storage_ops *fmt;
    void *fmt_state;
    int layer;
};

struct kvs_kv_storage_ops {
    const char *name;
    /* Bytes of one block, all layers, K and V apart, on backend o (0: not available there). */
    void (*block_bytes)(const struct kvs_kv_shape *sh, const struct kvs_backend_ops *o, struct kvs_backend *be,
                        size_t *k_bytes, size_t *v_bytes);
    /* Allocates n_blocks blocks on the backend; -ENOMEM, or -ENOSYS + message when the backend
     * cannot store this format. */
    int (*create)(const struct kvs_kv_shape *sh, const struct kvs_backend_ops *o, struct kvs_backend *be, int n_blocks,
                  void **state, char *err, size_t errlen);
    void (*destroy)(void *state);
    /* 1 when the view is the backend's plain KV pool, so that fused ops (rope_kv_write,
     * matmul_rope_kv_write) may write it directly instead of calling write(). */
    int plain_view;
    /* Writes rows' K/V ([n][n_kv_heads][head_dim] ACT) into their slots (I32 [n]; -1 skips). */
    void (*write)(void *state, int layer, const struct kvs_dbuf *k, const struct kvs_dbuf *v, const struct kvs_dbuf *slots,
                  int n);
    void (*view)(void *state, int layer, struct kvs_kv_view *out);
    /* Copies block src to dst in every layer (copy-on-write). */
    void (*copy_block)(void *state, int32_t src, int32_t dst);
    /* Optional (NULL when plain_view: the backend's ops read the pool). The backend's attention()
     * and attention_spans() (backend.h, same arguments and contracts) over this format's bytes
     * of one layer, for a view with fmt set: the format supplies the attention over its own
     * bytes. A storage that is not plain_view must have both. */
    void (*attention)(void *state, int layer, const struct kvs_dbuf *q, const struct kvs_attn_meta *m, int n,
                      int n_heads, int n_kv_heads, int head_dim, int block_size, float scale, struct kvs_dbuf *out);
    void (*attention_spans)(void *state, int layer, const struct kvs_dbuf *q, const struct kvs_attn_meta *m,
                            const struct kvs_span_list *sp, int n, int n_heads, int n_kv_heads, int head_dim,
                            int block_size, float scale, struct kvs_dbuf *out, struct kvs_dbuf *lse);
    /* Optional: the storage's own counters and gauges (bytes per token against bf16, ...), or 0. */
    int (*counters)(void *state, struct kvs_kv_counter *out, int cap);
    /* Optional (NULL: the storage keeps nothing per request; all three or none): per-request
     * state of a storage whose contents depend on the request (LeanKV's dynamic mode keeps each
     * request's tokens in tiers of its own pages, not at its block-table slots). seq_init when
     * a request (re)starts on a slot (before its first step, after a preemption too); step once
     * per step before the layers, with the step's sequences and their request slots (the same
     * meta that write / attention then get); seq_free when the request ends, is preempted or
     * cancelled. Errors: 0 / negative errno (the step fails). */
    int (*seq_init)(void *state, int slot);
    int (*step)(void *state, const struct kvs_kv_step *step);
    void (*seq_free)(void *state, int slot);
};

/* ---- decode policy (runner side) --------------------------------------------------------- */
enum {
    KVS_KV_NEEDS_PRE_ROPE_Q = 1,  /* attend() gets q before RoPE too (a->q_pre: the runner copies q
                                   * after the projection and the q norm, before RoPE, and then runs
                                   * the unfused RoPE + cache write: no fused matmul_rope_kv_write) */
    KVS_KV_NEEDS_LSE = 2,         /* the runner provides an lse scratch [rows][n_heads] */
    KVS_KV_NO_GRAPHS = 4,         /* steps must run eagerly (host work between layers) */
};

/* What a policy is created with. */
struct kvs_kv_decode_env {
    const struct kvs_backend_ops *o;
    struct kvs_backend *be;
    const struct kvs_config *cfg; /* its own config section; NULL = the policy's defaults */
    int n_layers, n_heads, n_kv_heads, head_dim, block_size;
    int max_slots;                /* request slots (scheduler.max_running) */
    int max_rows;                 /* rows per step */
    int max_blocks;               /* blocks per sequence */
    size_t kv_bytes_per_token;    /* what reading one position costs (all layers, K+V) */
    int n_pool_blocks;            /* blocks in the KV pool: a policy that keeps data per physical
                                   * block (Quest's page digests) sizes it by this */
    const char *storage_fmt;      /* NULL: views are the backend's plain pool; else the storage's name
                                   * (its bytes are read only through kvs_kv_attention[_spans]): a
                                   * policy whose own kernels read the pool refuses it (-ENOSYS) */
};

/* One step, as attend() sees it: seq s owns rows [h_q_start[s], h_q_start[s+1]); h_slot[s] is
 * its request slot (-1: a side prefill with no request state), h_decode[s] 1 when it is a
 * decode row (one token on top of its cache; with recompute below, the request's re-run
 * tokens come first and the new token is the sequence's last row). */
struct kvs_kv_step {
    int n_seqs, n_rows;
    const int32_t *h_q_start, *h_pos, *h_slot, *h_decode;
    const struct kvs_attn_meta *m;
    const int32_t *h_block_tables;  /* host copy of m->block_tables (stride m->max_blocks), or NULL
                                     * where the caller has none (a policy that needs it fails) */
    int decode_plan_ctx;            /* the m->plan_ctx of the scheduler's step (every decoding
                                     * sequence one row, before recompute rows widened it): a policy
                                     * that attends its newest rows as such a step (retro) plans
                                     * with it, so that its launches and bits are full attention's
                                     * (0 where the caller does not know: plan as m says) */
};

struct kvs_kv_attend {
    const struct kvs_kv_step *step;
    const struct kvs_dbuf *q;     /* ACT [n][n_heads][head_dim], after RoPE */
    const struct kvs_dbuf *q_pre; /* ACT [n][n_heads][head_dim] before RoPE (KVS_KV_NEEDS_PRE_ROPE_Q)
                                   * or NULL */
    struct kvs_kv_view kv;
    int n_heads, n_kv_heads, head_dim, block_size;
    float scale;
    struct kvs_dbuf *out;         /* ACT [n][n_heads][head_dim] */
    struct kvs_dbuf *lse;         /* F32 [n][n_heads] (KVS_KV_NEEDS_LSE) or NULL */
};

struct kvs_kv_decode_ops {
    const char *name;
    int exact;                    /* 1: equals full attention (nothing to report) */
    unsigned needs;               /* KVS_KV_NEEDS_* */
    int rows_per_seq;             /* rows a decoding request runs per step (Retro's window); 1 */
    int (*create)(const struct kvs_kv_decode_env *env, void **state, char *err, size_t errlen);
    void (*destroy)(void *state);
    /* Per-request state: bytes a slot needs (from the runner's arena, zeroed before seq_init). */
    size_t (*seq_bytes)(void *state);
    int (*seq_init)(void *state, int slot, void *mem);
    void (*seq_free)(void *state, int slot);
    /* Once per step before the layers (selection budgets, host planning). */
    int (*plan)(void *state, const struct kvs_kv_step *step);
    /* Layer l's attention for every row of the step (prefill rows included: a policy that
     * only changes decode rows runs the backend's attention() for the rest). */
    void (*attend)(void *state, int layer, const struct kvs_kv_attend *a);
    /* After layer l's attention (ring appends, flushes); NULL = nothing. */
    void (*finish)(void *state, int layer, const struct kvs_kv_step *step);
    /* The policy's counters (KV bytes read per decode token included), or 0. */
    int (*counters)(void *state, struct kvs_kv_counter *out, int cap);
    /* Optional, both or neither (NULL: a decoding request runs one row). Multi-row decode
     * (Retro's window): a decode step of request `slot` re-runs its last k tokens before the new
     * one, k = recompute(state, slot) (called once per step for each decoding request, after
     * seq_init and before plan), at most max_recompute(cfg) (the config the runner is created
     * with: it sizes the workspaces for max_recompute more rows per request slot). The runner
     * keeps each slot's last max_recompute tokens (history restarts with slot_fresh) and turns
     * the sequence into k + 1 rows at positions pos - k .. pos: their K/V are recomputed
     * through every layer from the updated lower layers and rewritten in the cache, only the
     * newest row gets logits, and kvs_kv_step shows the k + 1 rows (h_decode = 1, the newest
     * row last). k is clamped to the history the runner holds and to pos; the policy reads the
     * rows it got from h_q_start. */
    int (*max_recompute)(const struct kvs_config *cfg);
    int (*recompute)(void *state, int slot);
    /* Optional (NULL: the policy reads every block of its requests from the pool). Releasing
     * GPU memory (ParisKV's host offload): after each successful step the scheduler asks, for
     * every request of the step, whether the policy has moved logical blocks [*lo, *hi) of the
     * request in `slot` off the pool (their K/V are in memory of its own) and will never read
     * them from the pool again; returns hi - lo (0: nothing new). The ranges a request reports
     * are contiguous and ascending (lo is the previous hi after the first), 1 <= lo, and only
     * cover blocks of positions the step had computed. The scheduler then gives those blocks
     * back to the block pool (kvs_block_table_offload: the entries alias block 0 of the table,
     * so a kernel that reads them stays in bounds; the policy must not use what it reads there:
     * from then on every row of that request must be one the policy attends from its own
     * memory, and plan() fails the step, -EIO, when that cannot hold). The request's own
     * memory is freed by seq_free (end, cancellation, preemption: a preempted request recomputes
     * its whole context into fresh blocks). A tensor-parallel runner does not release (it does
     * not ask). */
    int (*offloaded)(void *state, int slot, int *lo, int *hi);
    /* Optional, with offloaded (NULL: the pool bounds a request). What one request of n_tokens
     * positions (prompt + generated), prefilled in chunks of at most `chunk` tokens, needs when
     * host_avail of the policy's own pages are free for it (< 0: as many as are free now): returns
     * the pool blocks it holds at its peak (<= its blocks without offload) and sets *host_pages to
     * the pages it then takes (<= host_avail); *host_free / *host_total: the policy's pages free
     * now / in all. -ENOSYS when the policy keeps nothing outside the pool (offload off). The
     * engine bounds a request's context by it and counts it at admission (scheduler.c). */
    int (*footprint)(void *state, int n_tokens, int chunk, int host_avail, int *host_pages, int *host_free,
                     int *host_total);
};

/* Attention of the step's rows over a's view (every row, the backend's attention() contract),
 * through the storage format's op when the view has one: what full attention is on any storage. */
static inline void kvs_kv_attention(const struct kvs_backend_ops *o, struct kvs_backend *be,
                                    const struct kvs_kv_attend *a, struct kvs_dbuf *out)
{
    const struct kvs_kv_view *v = &a->kv;
    if (v->fmt)
        v->fmt->attention(v->fmt_state, v->layer, a->q, a->step->m, a->step->n_rows, a->n_heads, a->n_kv_heads,
                          a->head_dim, a->block_size, a->scale, out);
    else
        o->attention(be, a->q, v->k, v->v, a->step->m, a->step->n_rows, a->n_heads, a->n_kv_heads, a->head_dim,
                     a->block_size, a->scale, out);
}

/* attention_spans (backend.h) of the step's rows over a's view, through the format's op when
 * the view has one. */
static inline void kvs_kv_attention_spans(const struct kvs_backend_ops *o, struct kvs_backend *be,
                                          const struct kvs_kv_attend *a, const struct kvs_span_list *sp,
                                          struct kvs_dbuf *out, struct kvs_dbuf *lse)
{
    const struct kvs_kv_view *v = &a->kv;
    if (v->fmt)
        v->fmt->attention_spans(v->fmt_state, v->layer, a->q, a->step->m, sp, a->step->n_rows, a->n_heads,
                                a->n_kv_heads, a->head_dim, a->block_size, a->scale, out, lse);
    else
        o->attention_spans(be, a->q, v->k, v->v, a->step->m, sp, a->step->n_rows, a->n_heads, a->n_kv_heads,
                           a->head_dim, a->block_size, a->scale, out, lse);
}

/* ---- reuse (scheduler side) --------------------------------------------------------------- */
struct kvs_kv;

/* Per request: what the reuse strategy keeps (zeroed by the scheduler; priv is the strategy's,
 * freed by its seq_free). */
struct kvs_kv_req {
    uint64_t last_hash;           /* prefix: hash of the last registered / matched full block */
    int n_hashed;                 /* prefix: leading full blocks already hashed */
    void *priv;
};

/* A side prefill the strategy wants in this step (e.g. a missing document): n_tokens tokens at
 * positions pos.. of a sequence of its own, in the given blocks; handle is the strategy's. */
struct kvs_kv_job {
    int handle;
    const int32_t *tokens;
    int n_tokens, pos;
    const int32_t *block_table;
    int n_blocks;
};

struct kvs_kv_reuse_ops {
    const char *name;
    /* 1: documents become segments of their own (cached, reused at any offset), each padded to
     * a block boundary; 0: documents are prompt text like any other. */
    int doc_segments;
    int (*init)(struct kvs_kv *kv, const struct kvs_config *cfg, size_t bytes_per_block, char *err, size_t errlen);
    void (*free)(struct kvs_kv *kv);
    /* Request layout once tokens[] holds the documents (padded when doc_segments) and the prompt;
     * NULL = nothing to lay out. -E2BIG / -ENOMEM with a message. */
    int (*seq_init)(struct kvs_kv *kv, struct kvs_kv_req *rq, const int *doc_len, int n_docs, int table_cap,
                    char *err, size_t errlen);
    /* Frees rq->priv (needs no strategy state: a request may outlive the engine). */
    void (*seq_free)(struct kvs_kv_req *rq);
    /* Admission: puts reusable blocks for the leading tokens into t (t->n is 0) and returns how
     * many tokens they cover (< n), or -ENOSPC when the request must wait. *matched = tokens
     * served from the cache. */
    int (*admit)(struct kvs_kv *kv, struct kvs_kv_req *rq, const int32_t *tokens, int n, struct kvs_block_table *t,
                 int *matched);
    /* 1: admit() looks the prompt up in a cache, so the engine counts its prompt tokens as cache
     * queries and the matched ones as hits (vllm:prefix_cache_*) */
    int caches;
    /* Once per request, at its first successful admission (NULL: nothing to count). */
    void (*count)(struct kvs_kv *kv, struct kvs_kv_req *rq);
    /* 1 when the request can run (its side prefills are done). */
    int (*ready)(struct kvs_kv *kv, struct kvs_kv_req *rq);
    /* Side prefills for a running request: appends up to max jobs within *budget tokens. */
    int (*jobs)(struct kvs_kv *kv, struct kvs_kv_req *rq, const int32_t *tokens, const struct kvs_block_table *t,
                int chunk, int *budget, struct kvs_kv_job *out, int max);
    /* After the step: job handle done (ok = the forward pass succeeded). */
    void (*job_done)(struct kvs_kv *kv, int handle, int n_tokens, int ok);
    /* After a step: tokens[0..n_computed) have their KV in t's blocks. */
    void (*commit)(struct kvs_kv *kv, struct kvs_kv_req *rq, const int32_t *tokens, int n_computed,
                   const struct kvs_block_table *t);
    /* Gives back what the request holds beyond its block table (after the table's release). */
    void (*release)(struct kvs_kv *kv, struct kvs_kv_req *rq);
    /* Per-block attention metadata for the runner (NULL: one segment, every slot valid). */
    void (*block_meta)(struct kvs_kv *kv, struct kvs_kv_req *rq, const int32_t **rot, const int32_t **valid);
    int (*counters)(struct kvs_kv *kv, struct kvs_kv_counter *out, int cap);
};

/* ---- the engine-side instance ------------------------------------------------------------- */
struct kvs_kv {
    const struct kvs_kv_storage_ops *storage;
    const struct kvs_kv_reuse_ops *reuse;
    const struct kvs_kv_decode_ops *decode;
    struct kvs_block_pool *pool;
    void *reuse_state;            /* the reuse strategy's own */
};

/* Resolves names ("auto" storage: the backend's native format) through the registry and checks
 * the combination against the composition matrix. */
int kvs_kv_resolve(const char *storage, const char *reuse, const char *decode, const struct kvs_kv_storage_ops **st,
                   const struct kvs_kv_reuse_ops **ru, const struct kvs_kv_decode_ops **dc, char *err, size_t errlen);
/* kvs_kv_resolve + the reuse strategy's init over pool (bytes_per_block: KV bytes of a block,
 * all layers; 0 = unknown). */
int kvs_kv_init(struct kvs_kv *kv, const struct kvs_config *cfg, struct kvs_block_pool *pool, size_t bytes_per_block,
                char *err, size_t errlen);
/* Same from explicit names, with no config (tools, tests): the strategies' defaults. */
int kvs_kv_init_names(struct kvs_kv *kv, const char *storage, const char *reuse, const char *decode,
                      struct kvs_block_pool *pool, size_t bytes_per_block, char *err, size_t errlen);
void kvs_kv_free(struct kvs_kv *kv);

/* Registry lookups (NULL: unknown). */
const struct kvs_kv_storage_ops *kvs_kv_find_storage(const char *name);
const struct kvs_kv_reuse_ops *kvs_kv_find_reuse(const char *name);
const struct kvs_kv_decode_ops *kvs_kv_find_decode(const char *name);
/* Adds a decode policy at run time (tests, out-of-tree experiments); -EEXIST, -ENOSPC. */
int kvs_kv_register_decode(const struct kvs_kv_decode_ops *ops);
/* Every name of a slot ("storage", "reuse", "decode"), for tables and tests; returns the count. */
int kvs_kv_names(const char *slot, const char **out, int cap);

/* Row i of the composition matrix (tests, docs): 0, or -ENOENT past the last row. */
int kvs_kv_matrix_row(int i, const char **slot_a, const char **a, const char **slot_b, const char **b, int *allowed,
                      const char **why);
/* The composition matrix: 0 when (a of slot_a, b of slot_b) compose, else -EINVAL with the
 * reason naming both keys. */
int kvs_kv_check_pair(const char *slot_a, const char *a, const char *slot_b, const char *b, char *err, size_t errlen);

#endif
