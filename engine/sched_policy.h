/* sched_policy.h: the chunked-prefill budget that keeps decoders' inter-token latency even while
 * prompts arrive (scheduler.itl_ratio, scheduler.prefill_min; engine/scheduler.c uses it).
 *
 * Decode first: every step carries one token of every decoding request, then prefill tokens
 * (chunks of running prompts, admissions, side prefills) up to a budget. With no request
 * decoding the budget is the whole step (scheduler.max_batch_tokens): nobody waits. While
 * requests decode, the budget adapts to what the steps cost, measured: the controller keeps
 * (time of a step that carries prefill) / (time of a decode-only step) near itl_ratio, so a
 * decoder's worst inter-token gap stays within that factor of its typical one. The cost of
 * prefill tokens is not linear on a GPU (a few hundred ride along almost free; beyond that the
 * GEMMs turn compute-bound), so the budget follows the measured ratio multiplicatively (a damped
 * step, at most x1.25 or /2) instead of fitting a line; it never drops below prefill_min, so prompts
 * always progress (TTFT), and the decode-only step time it compares with is an average over
 * recent decode-only steps.
 *
 * Plain struct, no allocation, no errors; one scheduler thread owns it.
 */
#ifndef KVS_SCHED_POLICY_H
#define KVS_SCHED_POLICY_H

struct kvs_prefill_ctl {
    double ratio;      /* target mixed / decode-only step time; 0: off (budget = max always) */
    int min, max;      /* budget bounds: scheduler.prefill_min, scheduler.max_batch_tokens */
    double t_dec;      /* moving average of decode-only step seconds (0: none seen yet) */
    int budget;        /* prefill tokens a step with decoders may carry now */
};

void kvs_prefill_ctl_init(struct kvs_prefill_ctl *c, double ratio, int min, int max);
/* Prefill tokens the next step may carry when n_decode requests decode in it. */
int kvs_prefill_ctl_budget(const struct kvs_prefill_ctl *c, int n_decode);
/* A step ran: n_decode decode rows, n_prefill other tokens, step_s seconds of forward pass. */
void kvs_prefill_ctl_observe(struct kvs_prefill_ctl *c, int n_decode, int n_prefill, double step_s);

#endif
