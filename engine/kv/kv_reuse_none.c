/* kv_reuse_none.c: kv.reuse=none: nothing is shared; every request computes all its tokens. */
#include "engine/kv/kv.h"

static int none_admit(struct kvs_kv *kv, struct kvs_kv_req *rq, const int32_t *tokens, int n, struct kvs_block_table *t,
                      int *matched)
{
    (void)kv, (void)rq, (void)tokens, (void)n, (void)t;
    *matched = 0;
    return 0;
}

const struct kvs_kv_reuse_ops kvs_kv_reuse_none = {
    .name = "none",
    .admit = none_admit,
};
