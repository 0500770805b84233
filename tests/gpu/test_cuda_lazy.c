/* test_cuda_lazy.c (GPU): the CUDA attention op with deferred RoPE (per-block rotation offsets)
 * and per-block valid-slot masks against eager RoPE attention, with the cases of
 * tests/unit/test_lazy_attn.c (documents {1,15,16,17,300} at random offsets behind a random
 * leading document, NaN in every padding slot, GQA 1/2/4/7, plain and llama3 RoPE, a 7-row
 * suffix prefill and a decode row). K/V are stored in bf16 on the GPU, so the tolerance is the
 * bf16 one of STRATEGIES.md: rel-L2 <= 1e-2. Run twice: with the automatic decode kernel, then
 * with the FlashAttention-2-style one forced (kvs_cuda_set_dec_attn 4; it is also the automatic
 * choice): it takes the decode rows, k_attn_fd<64, true, TMA> those with rotation offsets (documents of
 * 1, 15, 16, 17 and 300 keys in blocks of 16: offsets that change inside its 32-key sub-tiles and
 * 128-key tiles, valid masks) and k_attn_fd<64, false, TMA> the eager-key ones (both with the
 * copy engine's staging, then, kind 5, with cp.async); prefill rows take the prefill kernel.
 * Then the prefill kernel forced (kvs_cuda_set_pre_attn): kind 1 (k_attn_tc, which rotates q
 * fragments in registers) and k_attn_fa3's rotating kinds 14 (the default on sm_90) and 19 to 25
 * (Q rewritten in shared memory at each change of offset, tiles with a document boundary scored
 * 16 keys at a time); each must report the kind it was asked for on an sm_90 GPU. */
#define LAZY_ATTN_NO_MAIN
#include "tests/unit/test_lazy_attn.c"

#include "kernels/cuda/cuda_backend.h"

int main(void)
{
    const struct kvs_backend_ops *o = &kvs_cuda_backend;
    char err[256];
    struct kvs_backend *be = o->create(0, err, sizeof err);
    REQUIRE(be, "no CUDA backend: %s", err);
    double worst = run_all_cases(o, be, 1e-2);
    printf("cuda: deferred RoPE + masked padding == eager RoPE attention (bf16 KV), GQA 1/2/4/7, plain + llama3, "
           "prefill + decode; worst rel-L2 %.2e: ok\n", worst);
    kvs_cuda_set_dec_attn(be, 4);
    worst = run_all_cases(o, be, 1e-2);
    printf("cuda, decode kernel 4 forced (decode rows staged by the copy engine): the same cases; worst rel-L2 "
           "%.2e: ok\n", worst);
    kvs_cuda_set_dec_attn(be, 5);
    worst = run_all_cases(o, be, 1e-2);
    printf("cuda, decode kernel 5 forced (cp.async staging): the same cases; worst rel-L2 %.2e: ok\n", worst);
    kvs_cuda_set_dec_attn(be, -1);
    static const int pre_kinds[] = {1, 14, 19, 20, 21, 22, 23, 24, 25};
    kvs_cuda_set_pre_attn(14);
    const int sm90 = kvs_cuda_pre_attn_kind(HD, 1) == 14;
    for (size_t i = 0; i < sizeof pre_kinds / sizeof pre_kinds[0]; i++) {
        kvs_cuda_set_pre_attn(pre_kinds[i]);
        const int took = kvs_cuda_pre_attn_kind(HD, 1);
        REQUIRE(took == (sm90 ? pre_kinds[i] : 1), "prefill kind %d with rotation offsets took %d", pre_kinds[i], took);
        worst = run_all_cases(o, be, 1e-2);
        printf("cuda, prefill kind %d forced (took %d): the same cases; worst rel-L2 %.2e: ok\n", pre_kinds[i], took,
               worst);
    }
    kvs_cuda_set_pre_attn(-1);
    o->free(be);
    return 0;
}
