/* kv_storage_lean.c: kv.storage = lean: LeanKV's quantized KV pages (kernels/kv_lean.h), read by
 * the format's own attention (kv.h: the view carries fmt, so every policy's attention goes
 * through attention / attention_spans below).
 *
 * Built: the static modes (kv.lean.mode = K16V16, K8V8, K8V4, K4V4): every token of every
 * layer and head is quantized in that one format when it is written, nothing is pruned, and a
 * block costs a fixed number of bytes, so the block pool, admission and preemption count
 * blocks as they do for the dense storage. K16V16 stores fp16 (the neutral setting: equal to
 * dense attention within fp16 rounding). Because nothing is quantized twice and nothing
 * changes tier, the static modes have no full-precision window (kv.lean.window applies to the
 * dynamic mode). Cached documents (kv.reuse = lazy) are stored in the same static format and
 * shared, as the composition matrix allows; with kv.decode = mac the static modes are the
 * "quantization only" the matrix asks for.
 *
 * kv.lean.mode = dynamic (or adaptive): the high / low tiers by importance score, pruning and
 * the full-precision window, in per-head pages of the page manager: kv_storage_lean_dyn.c,
 * which the ops below call when the mode is dynamic (cpu and cuda backends; it refuses the rest).
 * With kv.reuse = lazy it keeps cached documents static (the high tier's format) and shared, and
 * runs the policy on each request's own tokens only.
 *
 * Refused at startup with -ENOSYS and a message: a backend without LeanKV kernels, head shapes
 * a backend's kernels do not take, and the dynamic mode on a backend other than cpu and cuda.
 *
 * Ownership: the storage owns its page buffers (one per layer); errors as kv.h. */
#include "engine/kv/kv.h"

#include <stdlib.h>
#include <string.h>

#include "base/util.h"
#include "engine/config.h"
#include "engine/kv/kv_storage_lean.h"
#include "engine/kv/kv_storage_lean_dyn.h"
#include "kernels/kv_lean.h"
#if defined(KVS_HAVE_CUDA) && KVS_HAVE_CUDA
#include "kernels/cuda/kv_lean_cuda.h"
#endif

extern const struct kvs_kv_storage_ops kvs_kv_storage_lean;

struct lean {
    const struct kvs_backend_ops *o;
    struct kvs_backend *be;
    const struct kvs_lean_kernels *kn;
    struct kvs_lean_fmt fmt;
    struct kvs_kv_shape sh;
    size_t layer_block_bytes;     /* one block of one layer: n_kv_heads pages */
    struct kvs_dbuf **pages;      /* [n_layers] */
    struct kvs_lean_dyn_store *dyn; /* kv.lean.mode = dynamic (then none of the above but sh) */
    size_t scratch_bytes;         /* the CUDA prompt-chunk path's bf16 scratch reserved at create (0: none) */
};

#if defined(KVS_HAVE_CUDA) && KVS_HAVE_CUDA
/* The CUDA backend's prompt chunks read their context through a bf16 scratch (kv_lean_cuda.h
 * kvs_cuda_lean_dq_reserve; one layer at a time, so one layer's worth): reserved here at create,
 * after the pool, from the memory the KV budget leaves (as the attention workspace is), never
 * grown, and shown in the log line and in /metrics (kvserve:kv_storage_scratch_bytes). Sized for a
 * step whose chunk sequences' contexts add up to max_ctx + max_rows tokens (one sequence's whole
 * context plus the step's other rows), in whole blocks, up to 64 sequences; a step that needs more
 * (several long chunks at once) takes the quantized prefill kernel for that step. At Llama-3.1-8B's
 * shape (8 KV heads x 128) and 16-token blocks: 8K + 4K tokens ~ 51 MB, 32K + 4K ~ 152 MB. */
static size_t dq_scratch_bytes(const struct kvs_kv_shape *sh)
{
    if (sh->max_ctx <= 0 || sh->max_rows <= 0 || sh->max_slots <= 0) return 0; /* tools: grown on demand */
    const size_t bs = (size_t)sh->block_size, seqs = sh->max_slots < 64 ? (size_t)sh->max_slots : 64;
    const size_t blocks = ((size_t)sh->max_ctx + (size_t)sh->max_rows + bs - 1) / bs + seqs;
    const size_t side = (blocks * sh->n_kv_heads * bs * sh->head_dim * 2 + 15) / 16 * 16;
    return 2 * side + seqs * (((size_t)sh->max_ctx + bs - 1) / bs) * sizeof(int32_t);
}
#endif

static const char *mode_of(const struct kvs_kv_shape *sh)
{
    return sh->cfg && sh->cfg->lean_mode && *sh->cfg->lean_mode ? sh->cfg->lean_mode : "K8V4";
}

static int is_dynamic(const char *mode) { return !strcmp(mode, "dynamic") || !strcmp(mode, "adaptive"); }

/* the format a block is sized for: the static mode's, or the high tier's for dynamic */
static int block_fmt(const struct kvs_kv_shape *sh, struct kvs_lean_fmt *f)
{
    const char *mode = mode_of(sh);
    if (is_dynamic(mode))
        return kvs_lean_fmt_parse(sh->cfg && sh->cfg->lean_high ? sh->cfg->lean_high : "K8V4", f);
    return kvs_lean_fmt_parse(mode, f);
}

static void lean_block_bytes(const struct kvs_kv_shape *sh, const struct kvs_backend_ops *o, struct kvs_backend *be,
                             size_t *k_bytes, size_t *v_bytes)
{
    (void)o, (void)be;
    if (is_dynamic(mode_of(sh))) {
        kvs_lean_dyn_block_bytes(sh, k_bytes, v_bytes);
        return;
    }
    struct kvs_lean_fmt f = {8, 4};
    if (block_fmt(sh, &f) < 0) f = (struct kvs_lean_fmt){8, 4};   /* create() refuses it */
    const size_t per = (size_t)sh->n_layers * sh->n_kv_heads * sh->block_size;
    *k_bytes = per * kvs_lean_vec_bytes(f.kbits, sh->head_dim);
    *v_bytes = per * kvs_lean_vec_bytes(f.vbits, sh->head_dim);
}

static void lean_destroy(void *state)
{
    struct lean *s = state;
    if (!s) return;
    kvs_lean_dyn_destroy(s->dyn);
    for (int l = 0; s->pages && l < s->sh.n_layers; l++) s->o->free_buf(s->be, s->pages[l]);
    free(s->pages);
    free(s);
}

static int lean_create(const struct kvs_kv_shape *sh, const struct kvs_backend_ops *o, struct kvs_backend *be,
                       int n_blocks, void **state, char *err, size_t errlen)
{
    const char *mode = mode_of(sh);
    if (is_dynamic(mode)) {
        struct lean *s = calloc(1, sizeof *s);
        if (!s) return kvs_err(err, errlen, -ENOMEM, "kv storage lean: out of memory");
        s->o = o, s->be = be, s->sh = *sh;
        s->sh.cfg = NULL;
        int rc = kvs_lean_dyn_create(sh, o, be, n_blocks, &s->dyn, err, errlen);
        if (rc) {
            free(s);
            return rc;
        }
        *state = s;
        return 0;
    }
    struct kvs_lean_fmt f;
    if (kvs_lean_fmt_parse(mode, &f) < 0)
        return kvs_err(err, errlen, -EINVAL, "config key 'kv.lean.mode': \"%s\" is not a LeanKV format", mode);
    const struct kvs_lean_kernels *kn = kvs_lean_kernels_for(o, err, errlen);
    if (!kn) return -ENOSYS;
    if (!kn->supports(f, sh->n_heads, sh->n_kv_heads, sh->head_dim))
        return kvs_err(err, errlen, -ENOSYS,
                       "config key 'kv.storage': \"lean\" (mode %s) on the %s backend is not available for %d query "
                       "heads over %d KV heads of dimension %d", mode, o->name, sh->n_heads, sh->n_kv_heads,
                       sh->head_dim);
    struct lean *s = calloc(1, sizeof *s);
    if (!s) return kvs_err(err, errlen, -ENOMEM, "kv storage lean: out of memory");
    s->o = o, s->be = be, s->kn = kn, s->fmt = f, s->sh = *sh;
    s->sh.cfg = NULL;             /* not kept: the config may not outlive create() */
    s->layer_block_bytes = (size_t)sh->n_kv_heads * kvs_lean_page_bytes(f, sh->head_dim, sh->block_size);
    s->pages = calloc((size_t)sh->n_layers, sizeof *s->pages);
    int ok = s->pages != NULL;
    for (int l = 0; ok && l < sh->n_layers; l++) ok = (s->pages[l] = kn->alloc_pages(be, s->layer_block_bytes * n_blocks)) != NULL;
    if (!ok) {
        lean_destroy(s);
        return kvs_err(err, errlen, -ENOMEM, "kv storage lean: cannot allocate the pages (%d blocks, %zu bytes)",
                       n_blocks, s->layer_block_bytes * (size_t)n_blocks * (size_t)sh->n_layers);
    }
#if defined(KVS_HAVE_CUDA) && KVS_HAVE_CUDA
    if (kn == &kvs_lean_kernels_cuda && f.kbits < 16 && f.vbits < 16) {
        const size_t want = dq_scratch_bytes(sh);
        if (want && kvs_cuda_lean_dq_reserve(want) < 0)
            kvs_log(KVS_LOG_WARN, "kv storage lean: no %zu bytes for the prompt chunks' bf16 scratch; prompt chunks "
                    "take the quantized prefill kernel", want);
        else s->scratch_bytes = want;
        if (s->scratch_bytes)
            kvs_log(KVS_LOG_INFO, "kv storage lean: %.1f MiB bf16 scratch for prompt chunks' attention, beside the pool",
                    (double)s->scratch_bytes / (1024.0 * 1024.0));
    }
#endif
    *state = s;
    return 0;
}

static void lean_write(void *state, int layer, const struct kvs_dbuf *k, const struct kvs_dbuf *v,
                       const struct kvs_dbuf *slots, int n)
{
    struct lean *s = state;
    if (s->dyn) {
        kvs_lean_dyn_write(s->dyn, layer, k, v, slots, n);
        return;
    }
    s->kn->write(s->be, s->fmt, k, v, slots, n, s->sh.n_kv_heads, s->sh.head_dim, s->sh.block_size, s->pages[layer]);
}

static void lean_view(void *state, int layer, struct kvs_kv_view *out)
{
    *out = (struct kvs_kv_view){NULL, NULL, &kvs_kv_storage_lean, state, layer};
}

static void lean_copy_block(void *state, int32_t src, int32_t dst)
{
    struct lean *s = state;
    KVS_ASSERT(!s->dyn);   /* copies serve shared prefixes: dynamic refuses kv.reuse = prefix */
    for (int l = 0; l < s->sh.n_layers; l++) s->kn->copy_block(s->be, s->pages[l], src, dst, s->layer_block_bytes);
}

static void lean_attention(void *state, int layer, const struct kvs_dbuf *q, const struct kvs_attn_meta *m, int n,
                           int n_heads, int n_kv_heads, int head_dim, int block_size, float scale, struct kvs_dbuf *out)
{
    struct lean *s = state;
    if (s->dyn) {
        (void)n_heads, (void)n_kv_heads, (void)head_dim, (void)block_size;
        kvs_lean_dyn_attention(s->dyn, layer, q, m, n, scale, out);
        return;
    }
    s->kn->attention(s->be, s->fmt, q, s->pages[layer], m, n, n_heads, n_kv_heads, head_dim, block_size, scale, out);
}

static void lean_attention_spans(void *state, int layer, const struct kvs_dbuf *q, const struct kvs_attn_meta *m,
                                 const struct kvs_span_list *sp, int n, int n_heads, int n_kv_heads, int head_dim,
                                 int block_size, float scale, struct kvs_dbuf *out, struct kvs_dbuf *lse)
{
    struct lean *s = state;
    /* spans come from decode policies other than full and from the fidelity meter, which the
     * dynamic mode refuses at create */
    KVS_ASSERT(!s->dyn);
    s->kn->attention_spans(s->be, s->fmt, q, s->pages[layer], m, sp, n, n_heads, n_kv_heads, head_dim, block_size,
                           scale, out, lse);
}

/* Memory per token, all layers and heads, K and V, metadata (fp16 scale and zero) included,
 * against bf16 K and V. */
static int lean_counters(void *state, struct kvs_kv_counter *out, int cap)
{
    struct lean *s = state;
    if (s->dyn) return kvs_lean_dyn_counters(s->dyn, out, cap);
    if (cap < 4) return 0;
    const double heads = (double)s->sh.n_layers * s->sh.n_kv_heads;
    const double bytes = heads * (double)kvs_lean_token_bytes(s->fmt, s->sh.head_dim);
    const double bf16 = heads * 4.0 * s->sh.head_dim;
    out[0] = (struct kvs_kv_counter){"kvserve:kv_storage_bytes_per_token",
                                     "KV bytes one token takes in the storage format (all layers, K and V, "
                                     "quantization metadata included).", 0, bytes, NULL, NULL};
    out[1] = (struct kvs_kv_counter){"kvserve:kv_storage_bf16_bytes_per_token",
                                     "KV bytes one token would take in bf16 (all layers, K and V).", 0, bf16, NULL, NULL};
    out[2] = (struct kvs_kv_counter){"kvserve:kv_storage_compression_ratio",
                                     "bf16 KV bytes per token over the storage format's.", 0, bf16 / bytes, NULL, NULL};
    out[3] = (struct kvs_kv_counter){"kvserve:kv_storage_scratch_bytes",
                                     "Device bytes reserved beside the KV pool for prompt chunks' attention (the CUDA "
                                     "backend's bf16 scratch of one layer's chunk context; 0: none).",
                                     0, (double)s->scratch_bytes, NULL, NULL};
    return 4;
}

struct kvs_lean_dyn_store *kvs_kv_storage_lean_dyn_of(void *state) { return ((struct lean *)state)->dyn; }

/* MAC's kernels read the static pages themselves (kv_storage_lean.h) */
const struct kvs_dbuf *kvs_kv_lean_static_pages(const struct kvs_kv_view *v, struct kvs_lean_fmt *f)
{
    if (!v || v->fmt != &kvs_kv_storage_lean || !v->fmt_state) return NULL;
    const struct lean *s = v->fmt_state;
    if (s->dyn || v->layer < 0 || v->layer >= s->sh.n_layers) return NULL;
    *f = s->fmt;
    return s->pages[v->layer];
}

/* per-request state: the dynamic mode's only (static modes store at block-table slots) */
static int lean_seq_init(void *state, int slot)
{
    struct lean *s = state;
    return s->dyn ? kvs_lean_dyn_seq_init(s->dyn, slot) : 0;
}

static int lean_step(void *state, const struct kvs_kv_step *step)
{
    struct lean *s = state;
    return s->dyn ? kvs_lean_dyn_step(s->dyn, step) : 0;
}

static void lean_seq_free(void *state, int slot)
{
    struct lean *s = state;
    if (s->dyn) kvs_lean_dyn_seq_free(s->dyn, slot);
}

const struct kvs_kv_storage_ops kvs_kv_storage_lean = {
    .name = "lean",
    .block_bytes = lean_block_bytes,
    .create = lean_create,
    .destroy = lean_destroy,
    .plain_view = 0,
    .write = lean_write,
    .view = lean_view,
    .copy_block = lean_copy_block,
    .attention = lean_attention,
    .attention_spans = lean_attention_spans,
    .counters = lean_counters,
    .seq_init = lean_seq_init,
    .step = lean_step,
    .seq_free = lean_seq_free,
};
