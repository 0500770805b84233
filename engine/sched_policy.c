/* sched_policy.c: the adaptive prefill budget (sched_policy.h). */
#include "engine/sched_policy.h"

#include <math.h>

/* starting budget before any mixed step was measured: a few hundred tokens ride along with a
 * decode step almost free on a GPU; the controller corrects it within a few steps elsewhere */
#define START_BUDGET 256

void kvs_prefill_ctl_init(struct kvs_prefill_ctl *c, double ratio, int min, int max)
{
    c->ratio = ratio;
    c->max = max > 1 ? max : 1;
    c->min = min < 1 ? 1 : min > c->max ? c->max : min;
    c->t_dec = 0;
    c->w = c->sd = c->st = c->sdd = c->sdt = 0;
    c->d_seen = 0;
    c->budget = START_BUDGET < c->min ? c->min : START_BUDGET > c->max ? c->max : START_BUDGET;
}

/* a decode batch this much larger than any decode-only one measured gets a probe (header) */
#define PROBE_GROWTH 1.5

int kvs_prefill_ctl_budget(struct kvs_prefill_ctl *c, int n_decode)
{
    if (c->ratio <= 0 || n_decode == 0) return c->max;
    if (c->d_seen == 0 || n_decode > PROBE_GROWTH * c->d_seen) {
        c->d_seen = n_decode;   /* probed: its step is decode-only (observe keeps the largest) */
        return 0;
    }
    return c->budget;
}

/* weight kept per decode-only step: ~16 steps of memory */
#define FIT_DECAY (15.0 / 16.0)

double kvs_prefill_ctl_decode_time(const struct kvs_prefill_ctl *c, int n_decode)
{
    if (c->w <= 0) return 0;
    const double md = c->sd / c->w, mt = c->st / c->w, var = c->sdd / c->w - md * md;
    /* one batch size seen (var ~ 0), or a line that would fall: the plain average */
    if (var < 0.25) return mt;
    double b = (c->sdt / c->w - md * mt) / var;
    if (b <= 0) return mt;
    double t = mt + b * (n_decode - md);
    /* a step is never cheaper than half the average (the line extrapolated far below the
     * batches seen) */
    return t > mt / 2 ? t : mt / 2;
}

void kvs_prefill_ctl_observe(struct kvs_prefill_ctl *c, int n_decode, int n_prefill, double step_s)
{
    if (c->ratio <= 0 || n_decode == 0 || step_s <= 0) return;
    if (n_prefill == 0) {   /* decode-only: the reference, averaged over the last ~8 */
        c->t_dec = c->t_dec > 0 ? c->t_dec + (step_s - c->t_dec) / 8 : step_s;
        const double d = n_decode;
        c->w = c->w * FIT_DECAY + 1;
        c->sd = c->sd * FIT_DECAY + d;
        c->st = c->st * FIT_DECAY + step_s;
        c->sdd = c->sdd * FIT_DECAY + d * d;
        c->sdt = c->sdt * FIT_DECAY + d * step_s;
        if (n_decode > c->d_seen) c->d_seen = n_decode;
        return;
    }
    if (c->t_dec <= 0) return;   /* nothing to compare with yet */
    /* against a decode-only step of this step's decode batch */
    const double t_ref = kvs_prefill_ctl_decode_time(c, n_decode);
    double excess = step_s / (t_ref > 0 ? t_ref : c->t_dec) - 1, want = c->ratio - 1;
    /* too slow: shrink whatever the step carried; fast enough: grow only when the step used
     * most of the budget (fewer prompts than budget say nothing about a bigger one) */
    if (excess <= want && n_prefill < c->budget / 2) return;
    /* the square root damps it: a full correction overshoots where the cost bends */
    double f = excess > 0 ? sqrt(want / excess) : 2;
    if (f > 1.25) f = 1.25;
    if (f < 0.5) f = 0.5;
    double b = c->budget * f;
    c->budget = b < c->min ? c->min : b > c->max ? c->max : (int)b;
}
