/* test_attn_skip.c: the CPU backend's asynchronous-step ops and attention's skip_lead hint
 * (kernels/backend.h).
 *   - attention() of a mixed step (one-row decode sequences first, then prefill chunks) with
 *     skip_lead = the decode sequences: every other row is bitwise the row of the pass without
 *     the hint, and the skipped rows are left as they were (a sentinel survives: their work was
 *     not done), for each CPU kernel set (reference, AVX2, FMA where this CPU has them);
 *   - ids_to_tokens writes the picks named by its pairs (0 for a negative pick), fetch_begin /
 *     fetch_end return the values of the two areas independently. */
#include "kernels/backend.h"
#include "base/util.h"
#include "tests/unit/test_util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NH 4
#define NKV 2
#define HD 32
#define BS 8
#define NB 64
#define MAXB 8

static const struct kvs_backend_ops *O = &kvs_cpu_backend;

static float frand(uint64_t *s) { return (float)(kvs_test_xorshift(s) % 2001) / 1000.0f - 1.0f; }

static struct kvs_dbuf *buf(struct kvs_backend *b, enum kvs_buf_kind k, size_t n, const void *src)
{
    struct kvs_dbuf *d = O->alloc(b, k, n);
    REQUIRE(d, "alloc %zu", n);
    if (src) O->upload(b, d, 0, src, n);
    return d;
}

static void attn_case(const char *kernels)
{
    setenv("KVS_CPU_KERNELS", kernels, 1);
    char err[256];
    struct kvs_backend *b = O->create(2, err, sizeof err);
    if (!b) {
        printf("SKIP: KVS_CPU_KERNELS=%s: %s\n", kernels, err);
        return;
    }
    /* 3 decode sequences (one row), then prefill chunks of 5 and 9 rows */
    enum { S = 5 };
    const int rows[S] = {1, 1, 1, 5, 9}, pos[S] = {17, 40, 3, 12, 0};
    int32_t qs[S + 1], ps[S], bt[S * MAXB];
    qs[0] = 0;
    for (int s = 0; s < S; s++) {
        qs[s + 1] = qs[s] + rows[s];
        ps[s] = pos[s];
        for (int j = 0; j < MAXB; j++) bt[s * MAXB + j] = (s * MAXB + j * 3) % NB;
    }
    const int n = qs[S];
    uint64_t rng = 0x5EEDULL;
    const size_t kvn = (size_t)NB * NKV * BS * HD, qn = (size_t)n * NH * HD;
    float *kc = malloc(kvn * sizeof *kc), *vc = malloc(kvn * sizeof *vc), *q = malloc(qn * sizeof *q);
    float *o0 = malloc(qn * sizeof *o0), *o1 = malloc(qn * sizeof *o1), *sentinel = malloc(qn * sizeof *sentinel);
    for (size_t i = 0; i < kvn; i++) kc[i] = frand(&rng), vc[i] = frand(&rng);
    for (size_t i = 0; i < qn; i++) q[i] = frand(&rng), sentinel[i] = 12345.0f;
    struct kvs_dbuf *Kc = buf(b, KVS_BUF_KV, kvn, kc), *Vc = buf(b, KVS_BUF_KV, kvn, vc), *Q = buf(b, KVS_BUF_ACT, qn, q);
    struct kvs_dbuf *Out = buf(b, KVS_BUF_ACT, qn, sentinel);
    struct kvs_dbuf *Qs = buf(b, KVS_BUF_I32, S + 1, qs), *Ps = buf(b, KVS_BUF_I32, S, ps);
    struct kvs_dbuf *Bt = buf(b, KVS_BUF_I32, S * MAXB, bt);
    struct kvs_attn_meta m = {.n_seqs = S, .max_blocks = MAXB, .q_start = Qs, .pos = Ps, .block_tables = Bt,
                              .h_q_start = qs, .h_pos = ps, .max_ctx = 0};
    for (int s = 0; s < S; s++)
        if (ps[s] + rows[s] > m.max_ctx) m.max_ctx = ps[s] + rows[s];
    O->attention(b, Q, Kc, Vc, &m, n, NH, NKV, HD, BS, 0.17f, Out);
    O->download(b, o0, Out, 0, qn);
    for (int skip = 1; skip <= 3; skip++) {
        O->upload(b, Out, 0, sentinel, qn);
        m.skip_lead = skip;
        O->attention(b, Q, Kc, Vc, &m, n, NH, NKV, HD, BS, 0.17f, Out);
        O->download(b, o1, Out, 0, qn);
        const size_t cut = (size_t)qs[skip] * NH * HD;
        int left = 1;
        for (size_t i = 0; i < cut; i++) left &= o1[i] == 12345.0f;
        CHECK(left, "%s, skip_lead %d: a skipped row was written", kernels, skip);
        CHECK(memcmp(o1 + cut, o0 + cut, (qn - cut) * sizeof *o0) == 0,
              "%s, skip_lead %d: rows past the skipped ones differ from the pass without the hint", kernels, skip);
    }
    printf("ok KVS_CPU_KERNELS=%s: skip_lead 1-3 leaves the skipped decode rows untouched, other rows bitwise equal\n",
           kernels);
    free(kc), free(vc), free(q), free(o0), free(o1), free(sentinel);
    struct kvs_dbuf *bufs[] = {Kc, Vc, Q, Out, Qs, Ps, Bt};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) O->free_buf(b, bufs[i]);
    O->free(b);
}

static void async_ops(void)
{
    char err[256];
    struct kvs_backend *b = O->create(1, err, sizeof err);
    REQUIRE(b, "%s", err);
    const int32_t ids[6] = {7, -1, 42, 3, 9, 11}, pairs[6] = {4, 2, 0, 1, 2, 5};
    int32_t tok[6] = {100, 101, 102, 103, 104, 105}, got[6];
    struct kvs_dbuf *I = buf(b, KVS_BUF_I32, 6, ids), *P = buf(b, KVS_BUF_I32, 6, pairs), *T = buf(b, KVS_BUF_I32, 6, tok);
    O->ids_to_tokens(b, I, P, 3, T);
    O->download(b, got, T, 0, 6);
    const int32_t want[6] = {0, 101, 11, 103, 42, 105};   /* tokens[4] = ids[2], [0] = 0 (ids[1] < 0), [2] = ids[5] */
    CHECK(memcmp(got, want, sizeof want) == 0, "ids_to_tokens: %d %d %d %d %d %d", got[0], got[1], got[2], got[3],
          got[4], got[5]);
    O->fetch_begin(b, I, 6, 0);
    O->fetch_begin(b, T, 6, 1);
    int32_t a0[6], a1[6];
    O->fetch_end(b, 1, a1, 6);
    O->fetch_end(b, 0, a0, 6);
    CHECK(memcmp(a0, ids, sizeof ids) == 0 && memcmp(a1, want, sizeof want) == 0, "fetch areas mixed up");
    printf("ok ids_to_tokens (negative picks become 0), two fetch areas\n");
    O->free_buf(b, I);
    O->free_buf(b, P);
    O->free_buf(b, T);
    O->free(b);
}

int main(void)
{
    kvs_log_set_level(KVS_LOG_WARN);
    attn_case("ref");
    attn_case("avx2");
    attn_case("fma");
    async_ops();
    return kvs_test_summary("test_attn_skip");
}
