/* test_cuda_lazy.c (GPU): the CUDA attention op with deferred RoPE (per-block rotation offsets)
 * and per-block valid-slot masks against eager RoPE attention, with the cases of
 * tests/unit/test_lazy_attn.c (documents {1,15,16,17,300} at random offsets behind a random
 * leading document, NaN in every padding slot, GQA 1/2/4/7, plain and llama3 RoPE, a 7-row
 * suffix prefill and a decode row). K/V are stored in bf16 on the GPU, so the tolerance is the
 * bf16 one of STRATEGIES.md: rel-L2 <= 1e-2. */
#define LAZY_ATTN_NO_MAIN
#include "tests/unit/test_lazy_attn.c"

#include "kernels/cuda/cuda_backend.h"

int main(void)
{
    const struct kvs_backend_ops *o = &kvs_cuda_backend;
    char err[256];
    struct kvs_backend *be = o->create(0, err, sizeof err);
    REQUIRE(be, "no CUDA backend: %s", err);
    struct kvs_model_config mc;
    memset(&mc, 0, sizeof mc);
    mc.head_dim = HD;
    double worst = 0;
    static const int groups[] = {1, 2, 4, 7};
    for (int rope = 0; rope < 2; rope++) {
        mc.rope_theta = 500000.0;
        mc.rope_type = rope ? KVS_ROPE_LLAMA3 : KVS_ROPE_DEFAULT;
        mc.rope_factor = 8;
        mc.rope_low_freq_factor = 1;
        mc.rope_high_freq_factor = 4;
        mc.rope_original_max_pos = 64;
        float inv[HD / 2];
        kvs_rope_inv_freq(&mc, inv);
        for (int gi = 0; gi < 4; gi++)
            for (int nq = 1; nq <= 7; nq += 6)
                for (int trial = 0; trial < 3; trial++) {
                    double e = run_case(o, be, inv, groups[gi], nq);
                    REQUIRE(e <= 1e-2, "rope %s G=%d rows=%d: rel-L2 %.3g > 1e-2", rope ? "llama3" : "plain",
                          groups[gi], nq, e);
                    if (e > worst) worst = e;
                }
    }
    o->free(be);
    printf("cuda: deferred RoPE + masked padding == eager RoPE attention (bf16 KV), GQA 1/2/4/7, plain + llama3, "
           "prefill + decode; worst rel-L2 %.2e: ok\n", worst);
    return 0;
}
