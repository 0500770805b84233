/* fidelity.c: the live fidelity meter (fidelity.h). */
#include "engine/kv/fidelity.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/util.h"

int kvs_fidelity_init(struct kvs_fidelity *f, int every, const struct kvs_backend_ops *o, struct kvs_backend *be,
                      size_t max_rows, int qd, char *err, size_t errlen)
{
    memset(f, 0, sizeof *f);
    f->every = every > 0 ? every : 0;
    f->o = o, f->be = be, f->qd = qd;
    if (!f->every) return 0;
    f->ref = o->alloc(be, KVS_BUF_ACT, max_rows * (size_t)qd);
    f->h_pol = malloc((size_t)qd * sizeof *f->h_pol);
    f->h_ref = malloc((size_t)qd * sizeof *f->h_ref);
    f->pend = malloc(max_rows * 2 * sizeof *f->pend);
    if (!f->ref || !f->h_pol || !f->h_ref || !f->pend) {
        kvs_fidelity_free(f);
        return kvs_err(err, errlen, -ENOMEM, "kv.fidelity: out of memory for the reference attention");
    }
    return 0;
}

void kvs_fidelity_free(struct kvs_fidelity *f)
{
    if (f->ref) f->o->free_buf(f->be, f->ref);
    free(f->h_pol);
    free(f->h_ref);
    free(f->pend);
    f->ref = NULL, f->h_pol = f->h_ref = NULL;
    f->pend = NULL;
}

int kvs_fidelity_pick_layer(struct kvs_fidelity *f, int n_layers)
{
    if (!f->every) return -1;
    if (f->decode_steps++ % (uint64_t)f->every) return -1;
    int l = f->next_layer;
    f->next_layer = (l + 1) % n_layers;
    return l;
}

void kvs_fidelity_measure(struct kvs_fidelity *f, const struct kvs_kv_attend *a)
{
    const struct kvs_kv_step *st = a->step;
    kvs_kv_attention(f->o, f->be, a, f->ref);
    for (int s = 0; s < st->n_seqs; s++) {
        if (!st->h_decode[s]) continue;
        const size_t row = (size_t)st->h_q_start[s + 1] - 1;   /* the newest row (kv.h recompute) */
        f->o->download(f->be, f->h_pol, a->out, row * (size_t)f->qd, (size_t)f->qd);
        f->o->download(f->be, f->h_ref, f->ref, row * (size_t)f->qd, (size_t)f->qd);
        double num = 0, den = 0;
        for (int i = 0; i < f->qd; i++) {
            const double d = (double)f->h_pol[i] - (double)f->h_ref[i];
            num += d * d;
            den += (double)f->h_ref[i] * (double)f->h_ref[i];
        }
        if (f->defer) {
            f->pend[2 * f->n_pend] = num, f->pend[2 * f->n_pend + 1] = den;
            f->n_pend++;
        } else {
            kvs_fidelity_add(f, num, den);
        }
    }
}

void kvs_fidelity_add(struct kvs_fidelity *f, double num, double den)
{
    const double e = den > 0 ? sqrt(num / den) : sqrt(num);
    int b = 0;
    for (double ub = 1e-6; b < KVS_FID_BUCKETS - 1 && !(e <= ub); ub *= 10) b++;
    f->bucket[b]++;
    f->sum += e;
    f->samples++;
}

int kvs_fidelity_counters(const struct kvs_fidelity *f, double bytes_read, struct kvs_kv_counter *out, int cap)
{
    static const char *le[KVS_FID_BUCKETS] = {"1e-06", "1e-05", "0.0001", "0.001", "0.01", "0.1", "1", "+Inf"};
    int n = 0;
    if (bytes_read >= 0 && n < cap)
        out[n++] = (struct kvs_kv_counter){"kvserve:kv_decode_bytes_read_total",
                                           "KV bytes the decode policy read for decode rows.", 1, bytes_read, NULL, NULL};
    if (n < cap)
        out[n++] = (struct kvs_kv_counter){"kvserve:kv_decode_bytes_full_total",
                                           "KV bytes full attention would read for the same decode rows.", 1,
                                           f->full_bytes, NULL, NULL};
    if (!f->every || n + KVS_FID_BUCKETS + 2 > cap) return n;
    static const char *fam = "kvserve:kv_fidelity_rel_l2";
    static const char *help = "Relative L2 error of the decode policy's attention output against exact attention, "
                              "sampled rows (kv.fidelity.sample_every).";
    uint64_t cum = 0;
    for (int b = 0; b < KVS_FID_BUCKETS; b++) {
        cum += f->bucket[b];
        out[n++] = (struct kvs_kv_counter){"kvserve:kv_fidelity_rel_l2_bucket", help, 1, (double)cum, fam, le[b]};
    }
    out[n++] = (struct kvs_kv_counter){"kvserve:kv_fidelity_rel_l2_sum", help, 1, f->sum, fam, NULL};
    out[n++] = (struct kvs_kv_counter){"kvserve:kv_fidelity_rel_l2_count", help, 1, (double)f->samples, fam, NULL};
    return n;
}
