/* eval_tf.c: teacher-forced comparison of a candidate config with the reference (eval.h).
 *
 * Two runners (reference and candidate) walk the same token sequences in lockstep, so no
 * [positions][vocab] table is ever stored: at every scored position both give a row of logits
 * and the row pair is reduced at once (log-softmax in double, KL(p_ref || p_cfg), argmax, NLL
 * of the true next token). Sequence s is x[0..L): its first `prefill` tokens go in as one
 * prefill (split at the runner's per-step token cap), which yields the prediction of x[prefill];
 * then x[p] is fed as a decode step at position p for p = prefill..L-2, the way the scheduler
 * runs decode, so decode strategies see decode steps (their begin_step hook is called before
 * every forward, as the scheduler does). Sequences run side by side in groups of at most the
 * runner's sequences per step.
 *
 * Window mode (o->window = N > 0, candidate only): the prediction at position p comes from a
 * fresh sequence holding x[max(0, p-N+1) .. p] at positions 0.. (RoPE is relative, so this is
 * sliding-window attention of width N), all windows of a group in one forward.
 *
 * When both sides run the same config, their computations are identical op for op (the CPU
 * backend is deterministic), so full vs full gives KL exactly 0; that is the harness's first
 * test.
 */
#include "tools/eval.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine/config.h"
#include "engine/kv/block_pool.h"
#include "engine/kv/kv.h"
#include "engine/runner.h"
#include "base/util.h"
#include "models/model.h"

struct side {
    struct kvs_runner *r;
    struct kvs_block_pool pool;
    int pool_ready;
    struct kvs_kv kv;
    int kv_ready;
    struct kvs_block_table *bt;   /* [group] */
    int n_bt;
    struct kvs_batch_seq *seqs;   /* [group] */
    float *logits;                /* [group][vocab] */
    int window;
    struct kvs_eval_counters *cnt;
};

static void side_free(struct side *s)
{
    if (s->bt) {
        for (int i = 0; i < s->n_bt; i++) {
            if (s->pool_ready) kvs_block_table_release(&s->bt[i], &s->pool);
            kvs_block_table_free(&s->bt[i]);
        }
        free(s->bt);
    }
    if (s->kv_ready) kvs_kv_free(&s->kv);
    if (s->pool_ready) kvs_block_pool_free(&s->pool);
    kvs_runner_free(s->r);
    free(s->seqs);
    free(s->logits);
    memset(s, 0, sizeof *s);
}

static int side_init(struct side *s, const struct kvs_config *cfg, const struct kvs_model *m, int window, int group,
                     int seq_len, struct kvs_eval_counters *cnt, char *err, size_t errlen)
{
    memset(s, 0, sizeof *s);
    s->window = window;
    s->cnt = cnt;
    int rc = kvs_runner_create(cfg, m, &s->r, err, errlen);
    if (rc) return rc;
    if ((rc = kvs_block_pool_init(&s->pool, kvs_runner_num_blocks(s->r), kvs_runner_block_size(s->r))))
        return kvs_err(err, errlen, rc, "eval: cannot set up the block pool");
    s->pool_ready = 1;
    if ((rc = kvs_kv_init(&s->kv, cfg, &s->pool, 0, err, errlen))) return rc;
    s->kv_ready = 1;
    int vocab = kvs_runner_vocab_size(s->r);
    s->bt = kvs_xcalloc((size_t)group, sizeof *s->bt);
    s->n_bt = group;
    s->seqs = kvs_xcalloc((size_t)group, sizeof *s->seqs);
    s->logits = kvs_xmalloc((size_t)group * vocab * sizeof(float));
    int per_seq = window > 0 ? window : seq_len;
    for (int i = 0; i < group; i++) {
        if ((rc = kvs_block_table_init(&s->bt[i], per_seq, kvs_runner_block_size(s->r))))
            return kvs_err(err, errlen, rc, "eval: out of memory for block tables");
        if ((rc = kvs_block_table_reserve(&s->bt[i], &s->pool, per_seq)))
            return kvs_err(err, errlen, rc,
                           "eval: the KV pool (%d blocks of %d) cannot hold %d sequences of %d tokens; raise "
                           "kv.memory_bytes",
                           kvs_runner_num_blocks(s->r), kvs_runner_block_size(s->r), group, per_seq);
    }
    kvs_eval_counters_init(cnt, kvs_runner_kv_bytes_per_token(s->r));
    return 0;
}

static int side_forward(struct side *s, int n_seqs, int is_decode, float *logits)
{
    struct kvs_batch b = {s->seqs, n_seqs, NULL};
    int rc = kvs_runner_forward(s->r, &b, logits);
    if (rc) return rc;
    kvs_eval_counters_step(s->cnt, &s->kv, &b, s->window, is_decode);
    return 0;
}

/* Logits of position p (predicting x[p+1]) for every sequence of the group into s->logits.
 * Non-window sides must be called with p = prefill-1 first, then p+1, p+2, ... */
static int side_logits_at(struct side *s, const int32_t *const *x, int g, int p, int prefill)
{
    int cap = kvs_runner_max_tokens_per_step(s->r);
    if (s->window > 0) {
        for (int i = 0; i < g; i++) {
            int w = p + 1 < s->window ? p + 1 : s->window;
            /* each window is a fresh sequence: a fresh slot for the decode policy */
            s->seqs[i] = (struct kvs_batch_seq){x[i] + p + 1 - w, w, 0, s->bt[i].ids, s->bt[i].n, NULL,
                                                KVS_LOGITS_LAST, NULL, i, 1, 0};
        }
        return side_forward(s, g, p >= prefill, s->logits);
    }
    if (p == prefill - 1) {
        /* prefill each sequence alone, in chunks of at most cap tokens */
        for (int i = 0; i < g; i++) {
            for (int c = 0; c < prefill; c += cap) {
                int n = prefill - c < cap ? prefill - c : cap;
                int last = c + n == prefill;
                s->seqs[0] = (struct kvs_batch_seq){x[i] + c, n, c, s->bt[i].ids, s->bt[i].n, NULL,
                                                    last ? KVS_LOGITS_LAST : KVS_LOGITS_NONE, NULL, i, c == 0, 0};
                int rc = side_forward(s, 1, 0, s->logits + (size_t)i * kvs_runner_vocab_size(s->r));
                if (rc) return rc;
            }
        }
        return 0;
    }
    for (int i = 0; i < g; i++)
        s->seqs[i] = (struct kvs_batch_seq){x[i] + p, 1, p, s->bt[i].ids, s->bt[i].n, NULL, KVS_LOGITS_LAST, NULL, i, 0, 0};
    return side_forward(s, g, 1, s->logits);
}

/* log-softmax of row into out (double); returns the argmax */
static int log_softmax(const float *row, int n, double *out)
{
    int am = 0;
    double mx = row[0];
    for (int i = 1; i < n; i++)
        if (row[i] > mx) mx = row[i], am = i;
    double sum = 0;
    for (int i = 0; i < n; i++) sum += exp((double)row[i] - mx);
    double lse = mx + log(sum);
    for (int i = 0; i < n; i++) out[i] = (double)row[i] - lse;
    return am;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int kvs_eval_teacher_forced(const struct kvs_config *ref_cfg, const struct kvs_config *cfg,
                            const struct kvs_model *model, const int32_t *tokens, int n_tokens,
                            const struct kvs_eval_tf_opts *o, struct kvs_eval_tf_result *res, char *err,
                            size_t errlen)
{
    memset(res, 0, sizeof *res);
    int L = o->seq_len, S = o->n_seqs, P = o->prefill;
    if (L < 2 || S < 1 || P < 1 || P >= L || o->window < 0)
        return kvs_err(err, errlen, -EINVAL, "eval: bad teacher-forced shape (seq_len %d, n_seqs %d, prefill %d)", L,
                       S, P);
    if ((int64_t)L * S > n_tokens)
        return kvs_err(err, errlen, -EINVAL, "eval: %d sequences of %d tokens need %lld tokens, the input has %d", S,
                       L, (long long)L * S, n_tokens);
    int vocab = kvs_model_config(model)->vocab_size;
    for (int64_t i = 0; i < (int64_t)L * S; i++)
        if (tokens[i] < 0 || tokens[i] >= vocab)
            return kvs_err(err, errlen, -EINVAL, "eval: token id %d at index %lld is outside the vocabulary (%d)",
                           tokens[i], (long long)i, vocab);

    /* group size: sequences per step, and for windows tokens per step */
    int g_max = cfg->max_running > 0 ? cfg->max_running : 1;
    if (ref_cfg->max_running < g_max) g_max = ref_cfg->max_running;
    if (g_max > cfg->max_batch_tokens) g_max = cfg->max_batch_tokens;
    if (o->window > 0 && g_max > cfg->max_batch_tokens / o->window) g_max = cfg->max_batch_tokens / o->window;
    if (g_max < 1)
        return kvs_err(err, errlen, -EINVAL, "eval: window %d exceeds scheduler.max_batch_tokens %d", o->window,
                       cfg->max_batch_tokens);
    if (g_max > S) g_max = S;

    double t0 = kvs_now();
    struct side ref, cand;
    memset(&ref, 0, sizeof ref);
    memset(&cand, 0, sizeof cand);
    int npos = S * (L - P);
    double *kl = kvs_xmalloc((size_t)npos * sizeof *kl);
    double *lr = kvs_xmalloc((size_t)vocab * sizeof *lr), *lc = kvs_xmalloc((size_t)vocab * sizeof *lc);
    const int32_t **x = kvs_xcalloc((size_t)g_max, sizeof *x);
    double nll_r = 0, nll_c = 0;
    int agree = 0, k = 0;
    int rc = side_init(&ref, ref_cfg, model, 0, g_max, L, &res->ref, err, errlen);
    if (!rc) rc = side_init(&cand, cfg, model, o->window, g_max, L, &res->cfg, err, errlen);
    if (rc) goto out;
    snprintf(res->backend, sizeof res->backend, "%s", kvs_runner_backend_name(cand.r));
    if (kvs_runner_vocab_size(ref.r) != vocab || kvs_runner_vocab_size(cand.r) != vocab) {
        rc = kvs_err(err, errlen, -EINVAL, "eval: runner vocabulary differs from the model's");
        goto out;
    }
    if (kvs_runner_max_context(ref.r) < L || kvs_runner_max_context(cand.r) < L) {
        rc = kvs_err(err, errlen, -E2BIG, "eval: seq_len %d exceeds the model context (%d)", L,
                     kvs_runner_max_context(ref.r));
        goto out;
    }

    for (int s0 = 0; s0 < S; s0 += g_max) {
        int g = S - s0 < g_max ? S - s0 : g_max;
        for (int i = 0; i < g; i++) x[i] = tokens + (size_t)(s0 + i) * L;
        for (int p = P - 1; p <= L - 2; p++) {
            if ((rc = side_logits_at(&ref, x, g, p, P))) {
                kvs_err(err, errlen, rc, "eval: reference forward failed at position %d (%d)", p, rc);
                goto out;
            }
            if ((rc = side_logits_at(&cand, x, g, p, P))) {
                kvs_err(err, errlen, rc, "eval: candidate forward failed at position %d (%d)", p, rc);
                goto out;
            }
            for (int i = 0; i < g; i++) {
                int am_r = log_softmax(ref.logits + (size_t)i * vocab, vocab, lr);
                int am_c = log_softmax(cand.logits + (size_t)i * vocab, vocab, lc);
                double d = 0;
                for (int v = 0; v < vocab; v++) d += exp(lr[v]) * (lr[v] - lc[v]);
                if (d < 0) d = 0;   /* rounding: KL is never negative */
                kl[k++] = d;
                agree += am_r == am_c;
                int32_t next = x[i][p + 1];
                nll_r -= lr[next];
                nll_c -= lc[next];
                if (p >= P) {
                    res->ref.kv_bytes_full += (double)(p + 1) * (double)res->ref.kv_bytes_per_token;
                    res->cfg.kv_bytes_full += (double)(p + 1) * (double)res->cfg.kv_bytes_per_token;
                }
            }
        }
    }
    KVS_ASSERT(k == npos);
    kvs_eval_counters_finish(&res->ref, &ref.kv, ref.r);
    kvs_eval_counters_finish(&res->cfg, &cand.kv, cand.r);
    res->n_positions = npos;
    res->nll_ref = nll_r / npos;
    res->nll_cfg = nll_c / npos;
    res->ppl_ref = exp(res->nll_ref);
    res->ppl_cfg = exp(res->nll_cfg);
    res->top1_agree = (double)agree / npos;
    double sum = 0;
    for (int i = 0; i < npos; i++) sum += kl[i];
    res->kl_mean = sum / npos;
    qsort(kl, (size_t)npos, sizeof *kl, cmp_double);
    res->kl_max = kl[npos - 1];
    int i95 = (int)ceil(0.95 * npos) - 1;
    res->kl_p95 = kl[i95 < 0 ? 0 : i95];
    res->seconds = kvs_now() - t0;
out:
    side_free(&ref);
    side_free(&cand);
    free(kl);
    free(lr);
    free(lc);
    free(x);
    return rc;
}
