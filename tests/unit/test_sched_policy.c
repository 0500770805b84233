/* test_sched_policy.c: chunked prefill that does not hurt decoders (engine/sched_policy.h and
 * its use in engine/scheduler.c).
 *   1. The controller alone, on modelled step times (deterministic): no budget limit without
 *      decoders or with scheduler.itl_ratio 0; on a GPU-like cost (the first 256 prefill tokens
 *      nearly free, then linear) it settles where a mixed step takes ~itl_ratio x a decode-only
 *      step; on a steep cost it stops at prefill_min (prompts still progress); steps that carried
 *      fewer prompts than the budget do not grow it.
 *   2. Step composition in the engine (fake model whose forward pass "takes" 2 ms + 0.05 ms per
 *      prefill token beyond 32): 8 requests decode while 8 long prompts arrive. Every step puts
 *      the decode rows first; with itl_ratio 1.5 the steps that carry prefill next to decodes
 *      take (median) at most 1.6x and (p90) 2x a decode-only step, while with itl_ratio 0 the
 *      same traffic puts whole 256-token chunks next to the decodes (>4x). The same with all 16
 *      requests at once (no decode-only step unless the controller probes for one). The pass times are
 *      modelled (engine_exec.h step_seconds), not slept, so the decisions are deterministic.
 */
#include "engine/config.h"
#include "engine/engine.h"
#include "engine/sched_policy.h"
#include "base/util.h"
#include "tests/fake/fake_model.h"
#include "tests/unit/test_util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- 1. the controller on modelled times ---------------------------------------------------- */

static double gpu_like(int n_prefill) { return 0.010 + (n_prefill > 256 ? (n_prefill - 256) * 50e-6 : 0); }

static void test_controller(void)
{
    struct kvs_prefill_ctl c;
    kvs_prefill_ctl_init(&c, 1.5, 32, 8192);
    REQUIRE(kvs_prefill_ctl_budget(&c, 0) == 8192, "no decoders: the whole step");
    /* probes: decoders but no decode-only step measured yet, or a decode batch over 1.5x the
     * largest measured or probed one: a decode-only step first */
    const int b_probe = kvs_prefill_ctl_budget(&c, 5), b_start = kvs_prefill_ctl_budget(&c, 5);
    REQUIRE(b_probe == 0 && b_start == 256, "first step with decoders: %d (want a probe, 0), then %d (want 256)",
            b_probe, b_start);
    const int b_grown = kvs_prefill_ctl_budget(&c, 8), b_near = kvs_prefill_ctl_budget(&c, 12);
    REQUIRE(b_grown == 0 && b_near == 256, "decode batch 8 after 5: %d (want a probe), then 12: %d (want 256)", b_grown,
            b_near);
    struct kvs_prefill_ctl off;
    kvs_prefill_ctl_init(&off, 0, 32, 8192);
    kvs_prefill_ctl_observe(&off, 8, 0, 0.01);
    kvs_prefill_ctl_observe(&off, 8, 8192, 1.0);
    REQUIRE(kvs_prefill_ctl_budget(&off, 8) == 8192, "itl_ratio 0: no limit");

    /* plenty of prompts: every mixed step uses its whole budget */
    double worst = 0;
    for (int it = 0; it < 60; it++) {
        kvs_prefill_ctl_observe(&c, 64, 0, gpu_like(0));
        int b = kvs_prefill_ctl_budget(&c, 64);
        REQUIRE(b >= 32 && b <= 8192, "budget %d out of bounds", b);
        double t = gpu_like(b);
        kvs_prefill_ctl_observe(&c, 64, b, t);
        if (it >= 20 && t / gpu_like(0) > worst) worst = t / gpu_like(0);
    }
    int settled = kvs_prefill_ctl_budget(&c, 64);
    /* ratio 1.5 on this cost: 256 + 0.5 x 10 ms / 50 us = 356 tokens */
    REQUIRE(settled >= 300 && settled <= 420, "settled budget %d, want ~356", settled);
    REQUIRE(worst <= 2.0, "a mixed step took %.2fx a decode-only one after settling", worst);
    printf("controller: GPU-like cost settles at %d prefill tokens per mixed step, worst mixed/decode %.2fx\n",
           settled, worst);

    /* steep cost: 1 ms per prefill token; the budget stops at prefill_min */
    struct kvs_prefill_ctl s;
    kvs_prefill_ctl_init(&s, 1.5, 32, 8192);
    for (int it = 0; it < 30; it++) {
        kvs_prefill_ctl_observe(&s, 8, 0, 0.01);
        int b = kvs_prefill_ctl_budget(&s, 8);
        kvs_prefill_ctl_observe(&s, 8, b, 0.01 + b * 1e-3);
    }
    REQUIRE(kvs_prefill_ctl_budget(&s, 8) == 32, "steep cost: budget %d, want prefill_min", kvs_prefill_ctl_budget(&s, 8));

    /* fast steps that carried few prompts do not grow the budget; a slow one shrinks it */
    struct kvs_prefill_ctl u;
    kvs_prefill_ctl_init(&u, 1.5, 32, 8192);
    kvs_prefill_ctl_observe(&u, 8, 0, 0.01);
    for (int it = 0; it < 10; it++) kvs_prefill_ctl_observe(&u, 8, 40, 0.0101);
    REQUIRE(kvs_prefill_ctl_budget(&u, 8) == 256, "under-used steps grew the budget to %d", kvs_prefill_ctl_budget(&u, 8));
    kvs_prefill_ctl_observe(&u, 8, 40, 0.05);
    REQUIRE(kvs_prefill_ctl_budget(&u, 8) == 128, "a slow step: budget %d, want halved", kvs_prefill_ctl_budget(&u, 8));
    printf("controller: no limit without decoders or with itl_ratio 0; steep cost stops at prefill_min; "
           "under-used steps do not grow it\n");

    /* the decode-only reference follows the decode batch: decode-only steps alternate between 8
     * rows (6 ms) and 128 rows (9 ms); mixed steps at 128 rows must settle at ratio x 9 ms, not
     * at ratio x the 7.5 ms average (which would keep them at 1.25x instead of 1.5x) */
    struct kvs_prefill_ctl f;
    kvs_prefill_ctl_init(&f, 1.5, 32, 8192);
    for (int it = 0; it < 40; it++) {
        kvs_prefill_ctl_observe(&f, 8, 0, 0.006);
        kvs_prefill_ctl_observe(&f, 128, 0, 0.009);
    }
    double t8 = kvs_prefill_ctl_decode_time(&f, 8), t128 = kvs_prefill_ctl_decode_time(&f, 128);
    REQUIRE(t8 > 0.0059 && t8 < 0.0061 && t128 > 0.0089 && t128 < 0.0091, "fitted decode-only steps %.4f / %.4f s",
            t8, t128);
    double mixed = 0;
    for (int it = 0; it < 60; it++) {
        kvs_prefill_ctl_observe(&f, it % 2 ? 128 : 8, 0, it % 2 ? 0.009 : 0.006);
        int b = kvs_prefill_ctl_budget(&f, 128);
        mixed = 0.009 + b * 20e-6;   /* 20 us per prefill token */
        kvs_prefill_ctl_observe(&f, 128, b, mixed);
    }
    /* 1.5 x 9 ms = 13.5 ms: 225 tokens at 20 us */
    REQUIRE(mixed / 0.009 > 1.35 && mixed / 0.009 < 1.6, "mixed steps at 128 decoders settle at %.2fx their decode-only "
            "step (budget %d)", mixed / 0.009, kvs_prefill_ctl_budget(&f, 128));
    printf("controller: decode-only reference fitted to the decode batch (8 rows %.1f ms, 128 rows %.1f ms); mixed "
           "steps at 128 settle at %.2fx\n", t8 * 1e3, t128 * 1e3, mixed / 0.009);
}

/* ---- 2. step composition in the engine -------------------------------------------------------- */

#define MAXSTEPS 4096
struct step_rec {
    int n_dec, n_pre, decode_first;
    double t;
};
static struct step_rec steps[MAXSTEPS];
static int n_steps;

static double last_step_s;
static double modelled_seconds(void *ctx)
{
    (void)ctx;
    return last_step_s;
}

/* the fake model's pass, with a modelled duration (engine_exec.h step_seconds: no sleeping, so
 * the policy's decisions are deterministic): 2 ms + 50 us per prefill token beyond 32 */
static int timed_forward(void *ctx, const struct kvs_batch *b, float *logits)
{
    int rc = fake_forward(ctx, b, logits);
    int n_dec = 0, n_pre = 0, first = 1, seen_pre = 0;
    for (int s = 0; s < b->n_seqs; s++) {
        int dec = b->seqs[s].n_tokens == 1 && b->seqs[s].pos > 0;
        if (dec) {
            n_dec++;
            if (seen_pre) first = 0;
        } else {
            n_pre += b->seqs[s].n_tokens;
            seen_pre = 1;
        }
    }
    last_step_s = 0.002 + (n_pre > 32 ? (n_pre - 32) * 50e-6 : 0);
    if (n_steps < MAXSTEPS) steps[n_steps++] = (struct step_rec){n_dec, n_pre, first, last_step_s};
    return rc;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* runs the traffic; returns the largest prefill next to decodes, *ratio the p90 and *med the
 * median mixed step time over the median decode-only one */
static int run_traffic(double itl_ratio, int burst, double *ratio, double *med)
{
    struct fake_model m;
    fake_model_init(&m, 1024, 16, 512, 4096);
    struct kvs_engine_exec x = fake_exec(&m);
    x.forward = timed_forward;
    x.step_seconds = modelled_seconds;
    struct kvs_config c;
    memset(&c, 0, sizeof c);
    c.max_batch_tokens = 512;
    c.max_running = 32;
    c.max_waiting = 100;
    c.prefill_chunk = 256;
    c.kv_storage = (char *)"auto";
    c.kv_reuse = (char *)"none";
    c.kv_decode = (char *)"full";
    c.itl_ratio = itl_ratio;
    c.prefill_min = 16;
    c.sched_overlap = 1;
    struct kvs_engine *e;
    char err[256];
    REQUIRE(kvs_engine_create_exec(&c, &x, &e, err, sizeof err) == 0, "%s", err);
    n_steps = 0;
    struct kvs_request *r[16];
    static int32_t prompts[16][1024];
    for (int i = 0; i < 16; i++) {
        for (int t = 0; t < 1024; t++) prompts[i][t] = 1 + (i * 131 + t * 7) % 500;
        struct kvs_request_params p;
        memset(&p, 0, sizeof p);
        p.prompt = prompts[i];
        p.n_prompt = i < 8 ? 8 : 1024;   /* 8 decoders first, then 8 long prompts */
        p.max_tokens = i < 8 ? 600 : 4;   /* decoders outlast the prompts' prefill */
        p.sampling.top_p = 1;
        p.sampling.repetition_penalty = 1;
        p.ignore_eos = 1;
        r[i] = kvs_request_new(&p, NULL, NULL);
        REQUIRE(r[i], "request_new");
        REQUIRE(kvs_engine_submit(e, r[i], err, sizeof err) == 0, "%s", err);
        if (i == 7 && !burst) {   /* the decoders are decoding (a few decode-only steps) when the prompts arrive */
            for (int got = 0; got < 3;) {
                struct kvs_event ev[16];
                int k = kvs_request_wait(r[7], ev, 16, 60.0);
                REQUIRE(k > 0, "no event for 60 s");
                for (int q = 0; q < k; q++) {
                    REQUIRE(ev[q].type == KVS_EV_TOKEN, "decoder 7 ended early");
                    got++;
                    kvs_event_clear(&ev[q]);
                }
            }
        }
    }
    for (int i = 0; i < 16; i++) {
        int done = 0;
        while (!done) {
            struct kvs_event ev[16];
            int k = kvs_request_wait(r[i], ev, 16, 60.0);
            REQUIRE(k > 0, "no event for 60 s");
            for (int q = 0; q < k; q++) {
                REQUIRE(ev[q].type != KVS_EV_ERROR, "error: %s", ev[q].error ? ev[q].error : "");
                if (ev[q].type == KVS_EV_DONE) done = 1;
                kvs_event_clear(&ev[q]);
            }
        }
        kvs_request_unref(r[i]);
    }
    kvs_engine_free(e);
    fake_model_free(&m);

    static double dec[MAXSTEPS], mix[MAXSTEPS];
    int nd = 0, nm = 0, max_pre = 0;
    for (int s = 0; s < n_steps; s++) {
        REQUIRE(steps[s].decode_first, "step %d: a decode row after a prefill chunk", s);
        if (steps[s].n_dec && !steps[s].n_pre) dec[nd++] = steps[s].t;
        if (steps[s].n_dec && steps[s].n_pre) {
            mix[nm++] = steps[s].t;
            if (steps[s].n_pre > max_pre) max_pre = steps[s].n_pre;
        }
    }
    REQUIRE(nd > 10 && nm > 3, "%d decode-only and %d mixed steps", nd, nm);
    qsort(dec, (size_t)nd, sizeof *dec, cmp_d);
    qsort(mix, (size_t)nm, sizeof *mix, cmp_d);
    *ratio = mix[(nm * 9) / 10] / dec[nd / 2];
    *med = mix[nm / 2] / dec[nd / 2];
    printf("itl_ratio %.1f%s: %d steps, %d mixed (largest prefill next to decodes %d tokens), mixed / median "
           "decode-only step: median %.2fx, p90 %.2fx\n", itl_ratio, burst ? ", all at once" : "", n_steps, nm, max_pre,
           *med, *ratio);
    return max_pre;
}

int main(void)
{
    kvs_log_set_level(KVS_LOG_WARN);
    test_controller();
    double r_on, r_off, m_on, m_off;
    int pre_on = run_traffic(1.5, 0, &r_on, &m_on);
    int pre_off = run_traffic(0, 0, &r_off, &m_off);
    /* 1.5 on this cost: 32 + 0.5 x 2 ms / 50 us = 52 tokens; the first mixed steps start from the
     * controller's 256 and halve (a few of the mixed steps), so p90 is the bound */
    REQUIRE(pre_off >= 256, "itl_ratio 0 should fill steps with whole chunks (largest %d)", pre_off);
    REQUIRE(m_off > 4, "itl_ratio 0: mixed steps only %.2fx a decode step (the test cannot tell)", m_off);
    REQUIRE(m_on <= 1.6 && r_on <= 2.0, "itl_ratio 1.5: mixed step median %.2fx, p90 %.2fx a decode-only one", m_on,
            r_on);
    REQUIRE(pre_on < pre_off, "prefill next to decodes not limited");
    /* all 16 at once: every step after the first could carry prefill, so only the probes give the
     * controller its decode-only reference (without them the budget stayed at its start, 256
     * tokens: mixed steps ~6x a decode-only one) */
    double r_b, m_b;
    run_traffic(1.5, 1, &r_b, &m_b);
    REQUIRE(m_b <= 1.6 && r_b <= 2.0, "itl_ratio 1.5, all at once: mixed step median %.2fx, p90 %.2fx a decode-only one",
            m_b, r_b);
    return kvs_test_summary("test_sched_policy");
}
