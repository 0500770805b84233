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
 * always progress (TTFT). The decode-only step time it compares a mixed step with is that of a
 * decode-only step at the mixed step's decode batch: a line t(D) = a + b D fitted (exponentially
 * weighted least squares, ~the last 16 decode-only steps) to recent decode-only steps, so a
 * mixed step of 128 decoders is not judged against decode-only steps of 8 (on a GPU those take
 * ~5.7 vs ~9 ms at the Llama-3.1-8B shape); with one batch size seen, their average.
 * Probes: while prompts keep arriving every step may carry prefill, so no decode-only step would
 * ever be measured (a burst of prompts: the budget stayed at its start value, blind). A step
 * with decoders therefore carries no prefill when no decode-only step was seen yet, or when its
 * decode batch is over 1.5x the largest decode-only batch measured (or probed) so far: one
 * step's delay for the prompts, a reference for the decoders.
 *
 * Plain struct, no allocation, no errors; one scheduler thread owns it.
 */
#ifndef KVS_SCHED_POLICY_H
#define KVS_SCHED_POLICY_H

struct kvs_prefill_ctl {
    double ratio;      /* target mixed / decode-only step time; 0: off (budget = max always) */
    int min, max;      /* budget bounds: scheduler.prefill_min, scheduler.max_batch_tokens */
    double t_dec;      /* moving average of decode-only step seconds (0: none seen yet) */
    /* exponentially weighted sums over decode-only steps (D = decode rows, t = seconds): weight,
     * D, t, D^2, D t; for t(D) = a + b D */
    double w, sd, st, sdd, sdt;
    int budget;        /* prefill tokens a step with decoders may carry now */
    int d_seen;        /* largest decode batch of a decode-only step measured or probed (0: none) */
};

void kvs_prefill_ctl_init(struct kvs_prefill_ctl *c, double ratio, int min, int max);
/* Seconds a decode-only step of n_decode rows takes, from the recent ones (0: none seen yet). */
double kvs_prefill_ctl_decode_time(const struct kvs_prefill_ctl *c, int n_decode);
/* Prefill tokens the next step may carry when n_decode requests decode in it; 0 for a probe
 * (a decode-only step as the reference; counted as probed, so the next call does not probe again). */
int kvs_prefill_ctl_budget(struct kvs_prefill_ctl *c, int n_decode);
/* A step ran: n_decode decode rows, n_prefill other tokens, step_s seconds of forward pass. */
void kvs_prefill_ctl_observe(struct kvs_prefill_ctl *c, int n_decode, int n_prefill, double step_s);

#endif
