/* kv.c: the registry of KV strategies and the composition matrix (kv.h), both as data.
 *
 * Each row of the registry names one implementation (its ops table lives in its own file) or
 * one that the design plans but this version does not build (ops NULL): choosing that one is
 * refused with -ENOSYS naming the key, instead of being accepted and ignored. */
#include "engine/kv/kv.h"

#include <string.h>

#include "base/util.h"
#include "engine/config.h"

extern const struct kvs_kv_storage_ops kvs_kv_storage_auto, kvs_kv_storage_f32, kvs_kv_storage_bf16, kvs_kv_storage_lean;
extern const struct kvs_kv_reuse_ops kvs_kv_reuse_none, kvs_kv_reuse_prefix, kvs_kv_reuse_lazy;
extern const struct kvs_kv_decode_ops kvs_kv_decode_full, kvs_kv_decode_quest, kvs_kv_decode_mac,
    kvs_kv_decode_paris;
extern const struct kvs_kv_decode_ops kvs_kv_decode_retro;

struct row {
    const char *slot, *name;
    const void *ops;              /* NULL: planned, not built */
    const char *what;
};

/* The registry: one row per implementation. */
static const struct row REGISTRY[] = {
    {"storage", "auto", &kvs_kv_storage_auto, "the backend's native format (f32 on cpu, bf16 on cuda)"},
    {"storage", "f32", &kvs_kv_storage_f32, "fp32 K and V (the cpu backend's)"},
    {"storage", "bf16", &kvs_kv_storage_bf16, "bf16 K and V (the cuda backend's)"},
    {"storage", "lean", &kvs_kv_storage_lean,
     "LeanKV quantized pages (K above V; static modes, and dynamic tiers with pruning)"},
    {"reuse", "none", &kvs_kv_reuse_none, "no sharing"},
    {"reuse", "prefix", &kvs_kv_reuse_prefix, "automatic prefix caching of full blocks"},
    {"reuse", "lazy", &kvs_kv_reuse_lazy, "LazyAttention document cache (position-agnostic, deferred RoPE)"},
    {"decode", "full", &kvs_kv_decode_full, "exact attention over every block"},
    {"decode", "quest", &kvs_kv_decode_quest, "Quest: top pages by min/max key digests"},
    {"decode", "retro", &kvs_kv_decode_retro, "RetroAttention: Quest plus retrospective updates"},
    {"decode", "mac", &kvs_kv_decode_mac, "MAC: reuse of attention summaries of similar recent queries"},
    {"decode", "paris", &kvs_kv_decode_paris,
     "ParisKV: top-k retrieval from a 4-bit key index, optional host offload of the retrieval zone"},
};
#define N_REGISTRY ((int)(sizeof REGISTRY / sizeof REGISTRY[0]))

/* Decode policies added at run time (kvs_kv_register_decode). */
#define MAX_EXTRA 8
static const struct kvs_kv_decode_ops *extra_decode[MAX_EXTRA];
static int n_extra_decode;

/* The composition matrix of STRATEGIES.md: pairs that do not compose, and pairs that compose
 * only under a condition their strategy enforces itself (allowed here, with the condition
 * written down). Pairs not listed compose. Decode policies are one slot, so MAC / ParisKV /
 * Retro are exclusive by construction. */
struct pair {
    const char *slot_a, *a, *slot_b, *b;
    int allowed;
    const char *why;
};
static const struct pair MATRIX[] = {
    {"reuse", "lazy", "decode", "paris", 0,
     "cached documents keep their keys at local positions, so one query cannot score them against a "
     "ParisKV index without a rotation per document"},
    {"reuse", "lazy", "decode", "retro", 0,
     "cached documents keep their keys at local positions, so Quest's min/max page digests do not bound "
     "q.k for them"},
    {"reuse", "lazy", "decode", "quest", 0,
     "cached documents keep their keys at local positions, so Quest's min/max page digests do not bound "
     "q.k for them"},
    {"storage", "lean", "decode", "paris", 0,
     "LeanKV prunes and moves tokens, which breaks ParisKV's per-token index"},
    {"storage", "lean", "decode", "retro", 0,
     "Retro overwrites recent K/V and Quest digests over permuted, quantized pages go stale"},
    {"storage", "lean", "decode", "quest", 0,
     "Quest digests over permuted, quantized pages go stale when LeanKV moves or prunes tokens"},
    {"storage", "lean", "reuse", "lazy", 1,
     "only static quantization of shared document blocks (the static mode's format, or with mode dynamic "
     "the high tier's): score-based demotion and pruning stay on a request's own tokens (LeanKV enforces it)"},
    {"storage", "lean", "decode", "mac", 1,
     "MAC hits skip the prefix, so token scores freeze: quantization only, no pruning (alpha_l = 0)"},
};
#define N_MATRIX ((int)(sizeof MATRIX / sizeof MATRIX[0]))

static const struct row *find_row(const char *slot, const char *name)
{
    for (int i = 0; i < N_REGISTRY; i++)
        if (!strcmp(REGISTRY[i].slot, slot) && !strcmp(REGISTRY[i].name, name)) return &REGISTRY[i];
    return NULL;
}

const struct kvs_kv_storage_ops *kvs_kv_find_storage(const char *name)
{
    const struct row *r = find_row("storage", name);
    return r ? r->ops : NULL;
}

const struct kvs_kv_reuse_ops *kvs_kv_find_reuse(const char *name)
{
    const struct row *r = find_row("reuse", name);
    return r ? r->ops : NULL;
}

const struct kvs_kv_decode_ops *kvs_kv_find_decode(const char *name)
{
    for (int i = 0; i < n_extra_decode; i++)
        if (!strcmp(extra_decode[i]->name, name)) return extra_decode[i];
    const struct row *r = find_row("decode", name);
    return r ? r->ops : NULL;
}

int kvs_kv_register_decode(const struct kvs_kv_decode_ops *ops)
{
    if (!ops || !ops->name || !ops->attend) return -EINVAL;
    if (kvs_kv_find_decode(ops->name) || find_row("decode", ops->name)) return -EEXIST;
    if (n_extra_decode == MAX_EXTRA) return -ENOSPC;
    extra_decode[n_extra_decode++] = ops;
    return 0;
}

int kvs_kv_names(const char *slot, const char **out, int cap)
{
    int n = 0;
    for (int i = 0; i < N_REGISTRY; i++)
        if (!strcmp(REGISTRY[i].slot, slot)) {
            if (n < cap) out[n] = REGISTRY[i].name;
            n++;
        }
    if (!strcmp(slot, "decode"))
        for (int i = 0; i < n_extra_decode; i++) {
            if (n < cap) out[n] = extra_decode[i]->name;
            n++;
        }
    return n;
}

int kvs_kv_matrix_row(int i, const char **slot_a, const char **a, const char **slot_b, const char **b, int *allowed,
                      const char **why)
{
    if (i < 0 || i >= N_MATRIX) return -ENOENT;
    const struct pair *p = &MATRIX[i];
    *slot_a = p->slot_a, *a = p->a, *slot_b = p->slot_b, *b = p->b, *allowed = p->allowed, *why = p->why;
    return 0;
}

int kvs_kv_check_pair(const char *slot_a, const char *a, const char *slot_b, const char *b, char *err, size_t errlen)
{
    for (int i = 0; i < N_MATRIX; i++) {
        const struct pair *p = &MATRIX[i];
        int fwd = !strcmp(p->slot_a, slot_a) && !strcmp(p->a, a) && !strcmp(p->slot_b, slot_b) && !strcmp(p->b, b);
        int rev = !strcmp(p->slot_a, slot_b) && !strcmp(p->a, b) && !strcmp(p->slot_b, slot_a) && !strcmp(p->b, a);
        if ((fwd || rev) && !p->allowed)
            return kvs_err(err, errlen, -EINVAL, "config keys 'kv.%s' = \"%s\" and 'kv.%s' = \"%s\" do not compose: %s",
                           p->slot_a, p->a, p->slot_b, p->b, p->why);
    }
    return 0;
}

static int unknown(const char *slot, const char *name, char *err, size_t errlen)
{
    char list[256] = "";
    for (int i = 0; i < N_REGISTRY; i++)
        if (!strcmp(REGISTRY[i].slot, slot)) {
            size_t l = strlen(list);
            snprintf(list + l, sizeof list - l, "%s%s", l ? ", " : "", REGISTRY[i].name);
        }
    return kvs_err(err, errlen, -EINVAL, "config key 'kv.%s': \"%s\" is unknown (%s)", slot, name, list);
}

int kvs_kv_resolve(const char *storage, const char *reuse, const char *decode, const struct kvs_kv_storage_ops **st,
                   const struct kvs_kv_reuse_ops **ru, const struct kvs_kv_decode_ops **dc, char *err, size_t errlen)
{
    const char *names[3] = {storage && *storage ? storage : "auto", reuse && *reuse ? reuse : "none",
                            decode && *decode ? decode : "full"};
    static const char *slots[3] = {"storage", "reuse", "decode"};
    for (int i = 0; i < 3; i++) {
        int extra = i == 2 && kvs_kv_find_decode(names[i]);
        if (!find_row(slots[i], names[i]) && !extra) return unknown(slots[i], names[i], err, errlen);
    }
    /* the matrix first: a combination that cannot work is said so even for unbuilt strategies */
    for (int i = 0; i < 3; i++)
        for (int j = i + 1; j < 3; j++) {
            int rc = kvs_kv_check_pair(slots[i], names[i], slots[j], names[j], err, errlen);
            if (rc < 0) return rc;
        }
    for (int i = 0; i < 3; i++) {
        const struct row *r = find_row(slots[i], names[i]);
        if (r && !r->ops)
            return kvs_err(err, errlen, -ENOSYS, "config key 'kv.%s': \"%s\" (%s) is not built in this version", slots[i],
                           names[i], r->what);
    }
    *st = kvs_kv_find_storage(names[0]);
    *ru = kvs_kv_find_reuse(names[1]);
    *dc = kvs_kv_find_decode(names[2]);
    return 0;
}

static int init_common(struct kvs_kv *kv, const char *storage, const char *reuse, const char *decode,
                       const struct kvs_config *cfg, struct kvs_block_pool *pool, size_t bytes_per_block, char *err,
                       size_t errlen)
{
    memset(kv, 0, sizeof *kv);
    int rc = kvs_kv_resolve(storage, reuse, decode, &kv->storage, &kv->reuse, &kv->decode, err, errlen);
    if (rc < 0) return rc;
    kv->pool = pool;
    if (kv->reuse->init && (rc = kv->reuse->init(kv, cfg, bytes_per_block, err, errlen)) < 0) {
        memset(kv, 0, sizeof *kv);
        return rc;
    }
    return 0;
}

int kvs_kv_init(struct kvs_kv *kv, const struct kvs_config *cfg, struct kvs_block_pool *pool, size_t bytes_per_block,
                char *err, size_t errlen)
{
    return init_common(kv, cfg->kv_storage, cfg->kv_reuse, cfg->kv_decode, cfg, pool, bytes_per_block, err, errlen);
}

int kvs_kv_init_names(struct kvs_kv *kv, const char *storage, const char *reuse, const char *decode,
                      struct kvs_block_pool *pool, size_t bytes_per_block, char *err, size_t errlen)
{
    return init_common(kv, storage, reuse, decode, NULL, pool, bytes_per_block, err, errlen);
}

void kvs_kv_free(struct kvs_kv *kv)
{
    if (kv->reuse && kv->reuse->free) kv->reuse->free(kv);
    memset(kv, 0, sizeof *kv);
}
