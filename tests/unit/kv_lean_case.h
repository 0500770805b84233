/* kv_lean_case.h: what the LeanKV tests share (test_kv_lean, test_kv_lean_dyn, test_kv_lean_docs):
 * one dynamic head over a one-head page manager, and the teacher-forced logits comparison.
 * Header-only (static inline functions), like test_util.h. Ownership: dhead_alloc allocates the head's
 * page manager and buffers, dhead_free releases them. Errors: allocation failures fail the test
 * (REQUIRE). */
#pragma once

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels/backend.h"
#include "kernels/kv_lean_dyn.h"
#include "kernels/kv_lean_pages.h"
#include "tests/unit/test_util.h"

/* one dynamic head (its config, state, page manager, pages and scratch) */
struct dhead {
    struct kvs_lean_dyn_cfg c;
    struct kvs_lean_dyn_head h;
    struct kvs_lean_pm *pm;
    uint8_t *base;
    void *mem;
    float *scratch;
    int n_pages, table_len;
};

/* After kvs_lean_dyn_cfg_init(&d->c, ...): a page table for `steps` own tokens in either tier (high
 * pages of tp_hi tokens from one end, low pages of tp_lo from the other, 2 spare), 4 pages beyond it
 * in the pool, the head's memory and scratch, and the head initialized. */
static inline void dhead_alloc(struct dhead *d, int steps)
{
    d->table_len = (steps + d->c.tp_hi) / d->c.tp_hi + (steps + d->c.tp_lo) / d->c.tp_lo + 2;
    d->n_pages = d->table_len + 4;
    REQUIRE(kvs_lean_pm_create(d->n_pages, 1, d->table_len, &d->pm) == 0, "pm");
    d->base = malloc((size_t)d->n_pages * d->c.page_bytes);
    d->mem = malloc(kvs_lean_dyn_head_mem(&d->c));
    d->scratch = malloc(kvs_lean_dyn_scratch_floats(&d->c) * sizeof(float));
    REQUIRE(d->base && d->mem && d->scratch, "alloc");
    kvs_lean_dyn_head_init(&d->c, &d->h, d->mem);
}

static inline void dhead_free(struct dhead *d)
{
    kvs_lean_pm_free(d->pm);
    free(d->base), free(d->mem), free(d->scratch);
}

/* the head's pages as the step functions take them */
static inline struct kvs_lean_dyn_pages dhead_pages(const struct dhead *d)
{
    struct kvs_lean_dyn_pages pg = {d->base, NULL, d->table_len, 0, 0};
    pg.table = kvs_lean_pm_table(d->pm, 0, &pg.n_high_pages, &pg.n_low_pages);
    return pg;
}

/* max |a - ref| over max |ref| across rows x vocab logits, and the rows whose top-1 agree */
static inline double tf_compare(const float *a, const float *ref, int rows, int vocab, int *agree)
{
    double num = 0, den = 0;
    *agree = 0;
    for (int i = 0; i < rows; i++) {
        const float *x = a + (size_t)i * vocab, *y = ref + (size_t)i * vocab;
        for (int j = 0; j < vocab; j++) num = fmax(num, fabs((double)x[j] - y[j])), den = fmax(den, fabs((double)y[j]));
        *agree += kvs_argmax_row(x, vocab) == kvs_argmax_row(y, vocab);
    }
    return num / den;
}
