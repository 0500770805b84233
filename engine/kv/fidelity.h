/* fidelity.h: the live fidelity meter of the KV seam (kv.fidelity.sample_every = N). Every N-th
 * decode step, one layer (round robin) runs exact attention on the same q beside the decode
 * policy's, and the relative L2 error of the policy's output over the step's decode rows goes
 * into a histogram; /metrics exports it with the KV bytes the policy read per decode token
 * against what full attention reads. With the policy "full" the error is 0 by construction:
 * the meter itself is tested with an approximate policy (tests/unit/test_kv_policies.c).
 *
 * Ownership: init allocates a reference output buffer on the backend and host copies; free
 * releases them. Runner thread only. Errors: init returns 0 or -ENOMEM with a message.
 */
#ifndef KVS_KV_FIDELITY_H
#define KVS_KV_FIDELITY_H

#include <stddef.h>
#include <stdint.h>

#include "engine/kv/kv.h"

#define KVS_FID_BUCKETS 8         /* rel-L2 upper bounds 1e-6, 1e-5, ... 1e0, +inf */

struct kvs_fidelity {
    int every;                    /* 0 = off */
    const struct kvs_backend_ops *o;
    struct kvs_backend *be;
    struct kvs_dbuf *ref;         /* ACT [max_rows][qd]: exact attention of a sampled layer */
    float *h_pol, *h_ref;         /* [qd] host copies of one row */
    int qd;
    uint64_t decode_steps;        /* steps with decode rows seen */
    int next_layer;
    uint64_t samples;             /* rows measured */
    uint64_t bucket[KVS_FID_BUCKETS];
    double sum;                   /* of rel-L2 */
    double full_bytes;            /* KV bytes full attention reads for the decode rows (runner) */
    /* tensor parallelism: a rank sees only its heads, so with defer set measure() keeps each
     * row's squared error and squared norm in pend (n_pend rows) and the runner sums them over
     * the ranks before kvs_fidelity_add buckets the row (rank 0's meter) */
    int defer;
    double *pend;                 /* [max_rows][2] */
    int n_pend;
};

int kvs_fidelity_init(struct kvs_fidelity *f, int every, const struct kvs_backend_ops *o, struct kvs_backend *be,
                      size_t max_rows, int qd, char *err, size_t errlen);
void kvs_fidelity_free(struct kvs_fidelity *f);
/* Called once per step with decode rows: the layer to sample in it, or -1. */
int kvs_fidelity_pick_layer(struct kvs_fidelity *f, int n_layers);
/* After the policy's attend a->out: exact attention into the reference and the comparison of
 * the decode rows (waits for the backend). */
void kvs_fidelity_measure(struct kvs_fidelity *f, const struct kvs_kv_attend *a);
/* Counters: the histogram, its sum and count, and bytes read (bytes_read < 0: the policy
 * reports its own) against full_bytes. Returns how many were written. */
/* One measured row: its squared error num and squared reference norm den, into the histogram. */
void kvs_fidelity_add(struct kvs_fidelity *f, double num, double den);
int kvs_fidelity_counters(const struct kvs_fidelity *f, double bytes_read, struct kvs_kv_counter *out, int cap);

#endif
