/* kv_decode_mac.c: kv.decode=mac, MAC-Attention (match, amend, complete; STRATEGIES.md §3).
 *
 * Per request slot and layer a ring of the last K pre-RoPE queries with their rectified
 * attention summaries (kernels/kv_mac.h). A decode row whose pre-RoPE query is close to a ring
 * entry's (per q head, squared L2 < 2 d (1 - tau)^2, once the context is at least gen_min)
 * reuses that entry's summary of [0, p - r] and attends only [max(p - r + 1, 0), m]; a miss
 * attends [0, m] through the same kernel. The row's own summary of [0, m - r] is appended in the
 * split-tail form (cached + [s, m - r], no subtraction). Prefill rows run the backend's
 * attention() and append the summaries of their last K positions.
 *
 * State: the rings live on the backend, one per request slot (max_slots), allocated at create
 * and checked against kv.decode_state_bytes; the runner's host arena slot holds the request's
 * flag, and seq_init (admission, preemption included) empties the slot's rings. The bytes of
 * both show in /metrics. The counters accumulate on the backend (the kernels' count(), once a
 * step after the last layer) and come back only when /metrics or the eval reads them (at most
 * one download per step that ran), so decode steps keep the runner's recorded graphs: in a
 * decode-only step every row (padding rows too) runs MAC's kernels, the host decisions of
 * attend() are the same for every such step, and everything per step is in the uploaded rows.
 * Storage: the plain pool, or kv.storage = lean in a static mode (K16V16, K8V8, K8V4, K4V4: the
 * composition matrix's "with MAC, quantize only"): MAC's kernels then read the layer's LeanKV
 * pages and dequantize each key and value on read (kernels/kv_mac.h), and prefill rows go
 * through the format's attention (kvs_kv_attention). LeanKV's dynamic mode (importance tiers,
 * pruning) is refused: its storage refuses any decode but full, and so does create below.
 * Errors: create returns -ENOSYS (no kernels on the backend, or none over that storage's
 * format), -EINVAL (lean dynamic), -ENOMEM with a message.
 */
#include "engine/kv/kv.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/util.h"
#include "engine/config.h"
#include "engine/kv/kv_storage_lean.h"
#include "kernels/kv_mac.h"

struct mac_seq {
    int32_t live;                 /* 1 between seq_init and seq_free */
};

struct mac {
    struct kvs_kv_decode_env env;
    const struct kvs_mac_kernels *k;
    int K, band, gen_min, matching;
    float thresh2;
    struct kvs_dbuf *ring_q, *ring_o, *ring_lse, *ring_tag;
    double ring_bytes;
    struct kvs_dbuf *d_rows, *d_p, *d_lse, *work;
    size_t work_n;   /* I32 [max_rows][4], I32 [L][max_rows][nh], F32 [max_rows][nh] */
    int32_t *h_rows;
    /* this step */
    int n_rows, n_work, any_full;
    /* counters: accumulated on the backend (I32 [2 * KVS_MAC_N_COUNTS], kernels/kv_mac.h), the
     * host copy refreshed when read after a step ran */
    struct kvs_dbuf *d_count;
    uint64_t counts[KVS_MAC_N_COUNTS];
    int count_dirty;
};

static int mac_create(const struct kvs_kv_decode_env *env, void **state, char *err, size_t errlen)
{
    const struct kvs_config *cfg = env->cfg;
    const struct kvs_backend_ops *o = env->o;
    /* MAC's kernels read the plain K/V pool, or LeanKV's static pages (dequantized on read) */
    if (env->storage_fmt && strcmp(env->storage_fmt, "lean"))
        return kvs_err(err, errlen, -ENOSYS,
                       "config keys 'kv.decode' = \"mac\" and 'kv.storage' = \"%s\": MAC's kernels over that "
                       "storage's format are not built", env->storage_fmt);
    const struct kvs_mac_kernels *k = kvs_mac_kernels_for(o, err, errlen);
    if (!k) return -ENOSYS;
    int rc = k->supports(env->n_heads, env->n_kv_heads, env->head_dim, err, errlen);
    if (rc) return rc;
    if (env->storage_fmt) {
        const char *mode = cfg && cfg->lean_mode && *cfg->lean_mode ? cfg->lean_mode : "K8V4";
        struct kvs_lean_fmt f;
        if (!strcmp(mode, "dynamic") || !strcmp(mode, "adaptive"))   /* the storage refuses it first */
            return kvs_err(err, errlen, -EINVAL,
                           "config keys 'kv.decode' = \"mac\" and 'kv.lean.mode' = \"%s\": with MAC, LeanKV "
                           "quantizes only (no importance tiers, no pruning): use a static mode (K8V8, K8V4, K4V4)",
                           mode);
        if (kvs_lean_fmt_parse(mode, &f) < 0)
            return kvs_err(err, errlen, -EINVAL, "config key 'kv.lean.mode': \"%s\" is not a LeanKV format", mode);
        if (!k->supports_lean)
            return kvs_err(err, errlen, -ENOSYS,
                           "config keys 'kv.decode' = \"mac\" and 'kv.storage' = \"lean\": MAC's kernels on "
                           "backend %s do not read LeanKV pages", o->name);
        rc = k->supports_lean(f, env->n_heads, env->n_kv_heads, env->head_dim, env->block_size, err, errlen);
        if (rc) return rc;
    }
    /* 0.75, not the paper's 0.45: at 0.45 every model measured here (SmolLM2, the long-context and
     * demo models) lost KL 0.09-0.71 nats and 6-15% top-1; 0.75 (the paper's LongGenBench setting)
     * keeps KL <= 0.01 at 34-46% hits (bench/RESULTS.md, the tau table; tau's meaning depends on
     * the model's query scale) */
    const double tau = cfg ? cfg->mac_tau : 0.75;
    struct mac *s = calloc(1, sizeof *s);
    if (!s) return kvs_err(err, errlen, -ENOMEM, "mac: no memory");
    s->env = *env;
    s->k = k;
    s->K = cfg ? cfg->mac_ring_size : 1024;
    s->band = cfg ? cfg->mac_band : 256;
    s->gen_min = cfg ? cfg->mac_gen_min : 2048;
    s->matching = tau < 1.0;   /* tau >= 1 never hits (the threshold alone would grow again above 1) */
    s->thresh2 = (float)(2.0 * env->head_dim * (1.0 - tau) * (1.0 - tau));
    if (s->K < 1 || s->band < 1) {
        free(s);
        return kvs_err(err, errlen, -EINVAL, "config key 'kv.mac.ring_size' / 'kv.mac.band' must be >= 1");
    }
    const size_t slots = (size_t)env->max_slots, L = (size_t)env->n_layers, nh = (size_t)env->n_heads;
    const size_t hd = (size_t)env->head_dim, entries = slots * L * (size_t)s->K;
    const size_t act = o->elem_size(env->be, KVS_BUF_KV), f32 = o->elem_size(env->be, KVS_BUF_F32);
    const size_t i32 = o->elem_size(env->be, KVS_BUF_I32);
    s->ring_bytes = (double)entries * ((double)nh * (2.0 * (double)hd * (double)act + (double)f32) + (double)i32);
    const int64_t cap = cfg ? cfg->kv_decode_state_bytes : 0;
    if (cap > 0 && s->ring_bytes > (double)cap) {
        kvs_err(err, errlen, -ENOMEM,
                "config key 'kv.decode_state_bytes': mac rings need %.0f bytes (%zu requests x %zu layers x K=%d "
                "entries x %zu heads), over the budget of %lld bytes; lower kv.mac.ring_size or "
                "scheduler.max_running",
                s->ring_bytes, slots, L, s->K, nh, (long long)cap);
        free(s);
        return -ENOMEM;
    }
    const size_t rows = (size_t)env->max_rows;
    s->ring_q = o->alloc(env->be, KVS_BUF_KV, entries * nh * hd);
    s->ring_o = o->alloc(env->be, KVS_BUF_KV, entries * nh * hd);
    s->ring_lse = o->alloc(env->be, KVS_BUF_F32, entries * nh);
    s->ring_tag = o->alloc(env->be, KVS_BUF_I32, entries);
    s->d_rows = o->alloc(env->be, KVS_BUF_I32, rows * 4);
    s->d_p = o->alloc(env->be, KVS_BUF_I32, L * rows * nh);
    s->d_lse = o->alloc(env->be, KVS_BUF_F32, rows * nh);
    s->work_n = k->work_elems(env->max_rows, env->n_heads, env->head_dim);
    if (s->work_n) s->work = o->alloc(env->be, KVS_BUF_F32, s->work_n);
    s->h_rows = calloc(rows * 4, sizeof *s->h_rows);
    s->d_count = o->alloc(env->be, KVS_BUF_I32, 2 * KVS_MAC_N_COUNTS);
    *state = s;   /* destroy() frees a partial state */
    if (!s->ring_q || !s->ring_o || !s->ring_lse || !s->ring_tag || !s->d_rows || !s->d_p || !s->d_lse || (s->work_n && !s->work) || !s->h_rows ||
        !s->d_count)
        return kvs_err(err, errlen, -ENOMEM, "mac: no memory for rings of %.0f bytes (%zu request slots)", s->ring_bytes,
                       slots);
    o->zero(env->be, s->ring_tag, 0, entries);
    o->zero(env->be, s->d_count, 0, 2 * KVS_MAC_N_COUNTS);
    return 0;
}

static void mac_destroy(void *state)
{
    struct mac *s = state;
    const struct kvs_backend_ops *o = s->env.o;
    struct kvs_dbuf *bs[] = {s->ring_q, s->ring_o, s->ring_lse, s->ring_tag, s->d_rows, s->d_p, s->d_lse, s->work,
                             s->d_count};
    for (size_t i = 0; i < sizeof bs / sizeof bs[0]; i++) o->free_buf(s->env.be, bs[i]);
    free(s->h_rows);
    free(s);
}

static size_t mac_seq_bytes(void *state)
{
    (void)state;
    return sizeof(struct mac_seq);
}

/* admission (or re-admission after preemption): the slot's rings start empty */
static int mac_seq_init(void *state, int slot, void *mem)
{
    struct mac *s = state;
    if (slot < 0 || slot >= s->env.max_slots || !mem) return -EINVAL;
    const size_t per = (size_t)s->env.n_layers * s->K;
    s->env.o->zero(s->env.be, s->ring_tag, (size_t)slot * per, per);
    ((struct mac_seq *)mem)->live = 1;
    return 0;
}

static int mac_plan(void *state, const struct kvs_kv_step *st)
{
    struct mac *s = state;
    s->n_rows = st->n_rows;
    s->n_work = s->any_full = 0;
    for (int q = 0; q < st->n_seqs; q++) {
        const int q0 = st->h_q_start[q], q1 = st->h_q_start[q + 1];
        const int slot = st->h_slot[q] >= 0 && st->h_slot[q] < s->env.max_slots ? st->h_slot[q] : -1;
        for (int t = q0; t < q1; t++) {
            const int m = st->h_pos[q] + (t - q0);
            int flags = 0;
            if (slot >= 0) {
                if (st->h_decode[q]) flags |= KVS_MAC_F_MAC | KVS_MAC_F_COUNT;
                if (st->h_decode[q] && s->matching && m + 1 >= s->gen_min) flags |= KVS_MAC_F_MATCH;
                if (t >= q1 - s->K) flags |= KVS_MAC_F_APPEND;   /* the last K rows: the ring keeps those */
            }
            /* any other one-row sequence (a one-token prompt, a graph's padding row): attention
             * over [0, m] through the same kernel (no match: p = -1), so that a decode-only step
             * never needs the backend's attention() and every such step issues the same work */
            if (q1 - q0 == 1) flags |= KVS_MAC_F_MAC;
            int32_t *r = s->h_rows + (size_t)t * 4;
            r[0] = q, r[1] = slot, r[2] = m, r[3] = flags;
            s->n_work += (flags & (KVS_MAC_F_MAC | KVS_MAC_F_APPEND)) != 0;
            s->any_full |= !(flags & KVS_MAC_F_MAC);
        }
    }
    if (s->n_work) s->env.o->upload(s->env.be, s->d_rows, 0, s->h_rows, (size_t)st->n_rows * 4);
    return 0;
}

static void mac_attend(void *state, int layer, const struct kvs_kv_attend *a)
{
    struct mac *s = state;
    const struct kvs_backend_ops *o = s->env.o;
    const int n = a->step->n_rows;
    /* prefill rows (and rows of side prefills): exact attention; decode rows are overwritten */
    if (s->any_full) kvs_kv_attention(o, s->env.be, a, a->out);   /* the format's own over LeanKV pages */
    if (!s->n_work) return;
    struct kvs_lean_fmt lf = {0, 0};
    const struct kvs_dbuf *pages = NULL;
    if (a->kv.fmt) {   /* create let only lean's static modes through */
        pages = kvs_kv_lean_static_pages(&a->kv, &lf);
        KVS_ASSERT(pages);
    }
    const struct kvs_mac_call c = {
        .layer = layer, .n_layers = s->env.n_layers, .K = s->K, .band = s->band,
        .n = n, .n_heads = a->n_heads, .n_kv_heads = a->n_kv_heads, .head_dim = a->head_dim,
        .block_size = a->block_size, .scale = a->scale, .thresh2 = s->thresh2,
        .q = a->q, .q_pre = a->q_pre, .kc = a->kv.k, .vc = a->kv.v, .m = a->step->m, .rows = s->d_rows,
        .p = s->d_p, .p_off = (size_t)layer * n * a->n_heads,
        .ring_q = s->ring_q, .ring_o = s->ring_o, .ring_lse = s->ring_lse, .ring_tag = s->ring_tag,
        .out = a->out, .lse = a->lse ? a->lse : s->d_lse, .work = s->work, .work_n = s->work_n,
        .lean = lf, .pages = pages,
    };
    s->k->match(s->env.be, &c);
    s->k->attend(s->env.be, &c);
}

/* After the last layer: every layer's matches added to the backend's counters (no download). */
static void mac_finish(void *state, int layer, const struct kvs_kv_step *st)
{
    struct mac *s = state;
    if (layer != s->env.n_layers - 1 || !s->n_work) return;
    const struct kvs_mac_call c = {
        .n_layers = s->env.n_layers, .K = s->K, .band = s->band, .n = st->n_rows, .n_heads = s->env.n_heads,
        .n_kv_heads = s->env.n_kv_heads, .head_dim = s->env.head_dim, .rows = s->d_rows, .p = s->d_p,
    };
    s->k->count(s->env.be, &c, s->d_count);
    s->count_dirty = 1;
}

static int mac_counters(void *state, struct kvs_kv_counter *out, int cap)
{
    struct mac *s = state;
    if (s->count_dirty) {   /* one download per step that ran, only when someone reads */
        int32_t raw[2 * KVS_MAC_N_COUNTS];
        s->env.o->download(s->env.be, raw, s->d_count, 0, 2 * KVS_MAC_N_COUNTS);
        memcpy(s->counts, raw, sizeof s->counts);
        s->count_dirty = 0;
    }
    const uint64_t *v = s->counts;
    const double per_pos = (double)s->env.kv_bytes_per_token / ((double)s->env.n_layers * s->env.n_kv_heads);
    const struct kvs_kv_counter c[] = {
        {"kvserve:kv_decode_bytes_read_total", "KV bytes the decode policy read.", 1,
         (double)v[KVS_MAC_C_READ] * per_pos, NULL, NULL},
        {"kvserve:kv_mac_lookups_total", "MAC ring lookups (decode rows x layers x q heads past gen_min).", 1,
         (double)v[KVS_MAC_C_LOOKUPS], NULL, NULL},
        {"kvserve:kv_mac_hits_total", "MAC ring hits (q heads that reused a cached summary).", 1,
         (double)v[KVS_MAC_C_HITS], NULL, NULL},
        {"kvserve:kv_mac_skip_sum", "Sum over decode q-head attends of the fraction of the context skipped.", 1,
         (double)v[KVS_MAC_C_SKIP] / KVS_MAC_SKIP_ONE, NULL, NULL},
        {"kvserve:kv_mac_skip_count", "Decode q-head attends (the skip fraction's count).", 1,
         (double)v[KVS_MAC_C_HEADS], NULL, NULL},
        {"kvserve:kv_mac_ring_bytes", "Bytes of the MAC rings on the backend (all request slots).", 0, s->ring_bytes,
         NULL, NULL},
    };
    int k = 0;
    for (; k < (int)(sizeof c / sizeof c[0]) && k < cap; k++) out[k] = c[k];
    return k;
}

const struct kvs_kv_decode_ops kvs_kv_decode_mac = {
    .name = "mac",
    .exact = 0,
    .needs = KVS_KV_NEEDS_PRE_ROPE_Q,
    .rows_per_seq = 1,
    .create = mac_create,
    .destroy = mac_destroy,
    .seq_bytes = mac_seq_bytes,
    .seq_init = mac_seq_init,
    .plan = mac_plan,
    .attend = mac_attend,
    .finish = mac_finish,
    .counters = mac_counters,
};
