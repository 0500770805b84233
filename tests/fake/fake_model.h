/* fake_model.h: a deterministic fake model behind the engine's executor table
 * (engine/engine_exec.h), for fast and exact tests of the real engine: the scheduler tests
 * (tests/unit/test_scheduler.c) and build/kvserve-fake, the real server over the real engine
 * for the HTTP tests (tests/fake/kvserve_fake_main.c). Included by those; not part of the
 * library.
 *
 * Its "KV cache" stores, per slot, the token and the absolute position written there. A
 * forward pass writes the new tokens into the slots named by the block table, then computes
 * each wanted logits row from what it READS BACK through the block table for positions
 * 0..row; a stored position that does not match means the scheduler handed out a wrong or
 * clobbered block, and the pass fails. Rows (logits_rule):
 *   FAKE_LOGITS_HASH       a hash of every token read back (the default): the next token is a
 *                          pure function of the previous tokens if and only if the paging is
 *                          right, and fake_reference() gives the expected greedy continuation.
 *   FAKE_LOGITS_NEXT_BYTE  a function of the row's own token u only, simple enough for tests to
 *                          predict (prompt logprobs): (u + 1 + i) mod 256 has probability
 *                          2^-(i+1) for i < FAKE_NB_TOP, every other id shares the remaining
 *                          2^-FAKE_NB_TOP equally (vocab >= 256). fake_next_byte_logprob() says it.
 * KVS_LOGITS_ALL gives one row per token of the chunk (prompt logprobs), LAST and ARGMAX one.
 * The token (pick_rule):
 *   FAKE_PICK_SAMPLER      the sampler below: greedy or seeded categorical over the row.
 *   FAKE_PICK_REVERSE      the prompt read backwards, cyclically: completion token k of an
 *                          n-token prompt is prompt[n-1 - (k mod n)], whatever the row says;
 *                          its logprob is log(0.5), alternative i (i >= 1) is (token + i) mod
 *                          vocab with log(0.5 / 2^i). Never the greedy fast path.
 * A request whose prompt contains fail_pattern fails its sample (-EIO) at completion token
 * fail_at (the engine then ends it with an ERROR event), to test how failures are reported.
 * Greedy requests without logprobs (FAKE_PICK_SAMPLER) take the engine's fast path
 * (sample_is_argmax): their rows come as KVS_LOGITS_ARGMAX and the fake answers with
 * fake_argmax of the row in batch.argmax, which is what its sampler would pick; n_argmax_rows
 * counts them. Detokenization (fake_exec's default) maps token t to a short ASCII piece;
 * callers with a real tokenizer put its kvs_detok_* in the table instead.
 * Time: each forward pass sleeps sleep_s, plus fresh_sleep_s when it holds a request's first
 * step after admission (a "prefill" cost).
 */
#ifndef KVS_FAKE_MODEL_H
#define KVS_FAKE_MODEL_H

#include "engine/engine_exec.h"
#include "base/util.h"

#include <math.h>
#include <pthread.h>
#include <string.h>
#include <unistd.h>

#define FAKE_EOS 0
#define FAKE_NB_TOP 24          /* FAKE_LOGITS_NEXT_BYTE: ids with probability 2^-(i+1) */

enum fake_logits_rule { FAKE_LOGITS_HASH = 0, FAKE_LOGITS_NEXT_BYTE = 1 };
enum fake_pick_rule { FAKE_PICK_SAMPLER = 0, FAKE_PICK_REVERSE = 1 };

struct fake_model {
    int n_blocks, block_size, vocab;
    int32_t *slot_tok, *slot_pos;   /* [n_blocks * block_size] */
    int max_context;
    /* optional gate: forward waits while gate_closed (for queue tests) */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int gate_closed;
    int in_forward;
    double sleep_s;                 /* per forward pass */
    double fresh_sleep_s;           /* more per pass holding a freshly admitted request */
    int logits_rule;                /* enum fake_logits_rule */
    int pick_rule;                  /* enum fake_pick_rule */
    const int32_t *fail_pattern;    /* NULL: no injected failures */
    int n_fail_pattern, fail_at;
    int n_forward;
    int n_entered;                  /* forward calls begun (counted before the gate) */
    int max_seqs_seen, max_tokens_seen;
    int n_argmax_rows;              /* KVS_LOGITS_ARGMAX rows answered */
    int errors;
};

static inline uint64_t fake_mix(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static inline uint64_t fake_hash_step(uint64_t h, int32_t tok, int pos)
{
    return fake_mix(h ^ ((uint64_t)(uint32_t)tok * 0x9e3779b97f4a7c15ULL) ^ ((uint64_t)pos << 40));
}

static inline void fake_logits_from_hash(uint64_t h, int vocab, float *out)
{
    for (int v = 0; v < vocab; v++) out[v] = (float)(fake_mix(h + (uint64_t)v * 0x632be59bd9b4e019ULL) >> 44) / 65536.0f;
    /* make EOS rare so that outputs have length, yet it still happens */
    out[FAKE_EOS] -= 0.5f;
}

/* FAKE_LOGITS_NEXT_BYTE: log-probability of id v in the row of token u */
static inline double fake_next_byte_logprob(int32_t u, int32_t v, int vocab)
{
    int i = ((v - (u + 1)) % 256 + 256) % 256;
    if (v < 256 && i < FAKE_NB_TOP) return -(i + 1) * log(2.0);
    return -FAKE_NB_TOP * log(2.0) - log((double)(vocab - FAKE_NB_TOP));
}

static inline void fake_next_byte_logits(int32_t u, int vocab, float *out)
{
    float rest = (float)fake_next_byte_logprob(u, u, vocab);   /* u itself is never a top id */
    for (int v = 0; v < vocab; v++) out[v] = rest;
    for (int i = 0; i < FAKE_NB_TOP; i++) out[(u + 1 + i) % 256] = (float)(-(i + 1) * log(2.0));
}

static inline int fake_argmax(const float *lg, int vocab)
{
    int best = 0;
    for (int v = 1; v < vocab; v++)
        if (lg[v] > lg[best]) best = v;
    return best;
}

static inline int fake_contains(const int32_t *hay, int n, const int32_t *needle, int m)
{
    for (int i = 0; m > 0 && i + m <= n; i++)
        if (!memcmp(hay + i, needle, (size_t)m * sizeof *needle)) return 1;
    return 0;
}

/* Rows as runner.h says: LAST one per seq, ALL one per token, both into logits (in order);
 * ARGMAX rows only to b->argmax, which gets every row's id when set. */
static inline int fake_forward(void *ctx, const struct kvs_batch *b, float *logits)
{
    struct fake_model *m = ctx;
    pthread_mutex_lock(&m->mu);
    m->n_entered++;
    while (m->gate_closed) pthread_cond_wait(&m->cv, &m->mu);
    m->in_forward = 1;
    m->n_forward++;
    pthread_mutex_unlock(&m->mu);
    double sleep_s = m->sleep_s;
    for (int s = 0; s < b->n_seqs; s++)
        if (b->seqs[s].slot >= 0 && b->seqs[s].slot_fresh) sleep_s += m->fresh_sleep_s;
    if (sleep_s > 0) usleep((useconds_t)(sleep_s * 1e6));
    int row = 0, host_row = 0, total = 0, rc = 0, n_argmax = 0;
    float scratch[1024];
    if (m->logits_rule == FAKE_LOGITS_NEXT_BYTE && m->vocab < 256) rc = -EINVAL;
    for (int s = 0; s < b->n_seqs && rc == 0; s++) {
        const struct kvs_batch_seq *q = &b->seqs[s];
        total += q->n_tokens;
        int end = q->pos + q->n_tokens;
        if (q->n_tokens <= 0 || q->pos < 0 || end > m->max_context || q->n_blocks * m->block_size < end ||
            q->n_blocks > (end + m->block_size - 1) / m->block_size) {
            rc = -EINVAL;
            break;
        }
        for (int i = 0; i < q->n_blocks; i++)
            if (q->block_table[i] < 0 || q->block_table[i] >= m->n_blocks) rc = -EINVAL;
        if (rc) break;
        for (int i = 0; i < q->n_tokens; i++) {
            int p = q->pos + i;
            size_t slot = (size_t)q->block_table[p / m->block_size] * m->block_size + p % m->block_size;
            m->slot_tok[slot] = q->tokens[i];
            m->slot_pos[slot] = p;
        }
        if (!q->want_logits) continue;
        int argmax_row = q->want_logits == KVS_LOGITS_ARGMAX;
        if ((argmax_row && (!b->argmax || m->vocab > 1024)) || (!argmax_row && !logits)) {
            rc = -EINVAL;
            break;
        }
        int first_row = q->want_logits == KVS_LOGITS_ALL ? q->pos : end - 1;
        uint64_t h = 0;
        for (int p = 0; p < end; p++) {
            size_t slot = (size_t)q->block_table[p / m->block_size] * m->block_size + p % m->block_size;
            if (m->slot_pos[slot] != p) {
                rc = -EIO;   /* the block table points at a slot holding another position */
                break;
            }
            h = fake_hash_step(h, m->slot_tok[slot], p);
            if (p < first_row) continue;
            float *lg = argmax_row ? scratch : logits + (size_t)host_row++ * m->vocab;
            if (m->logits_rule == FAKE_LOGITS_NEXT_BYTE) fake_next_byte_logits(m->slot_tok[slot], m->vocab, lg);
            else fake_logits_from_hash(h, m->vocab, lg);
            if (b->argmax) b->argmax[row] = fake_argmax(lg, m->vocab);
            row++;
        }
        n_argmax += argmax_row;
    }
    pthread_mutex_lock(&m->mu);
    if (b->n_seqs > m->max_seqs_seen) m->max_seqs_seen = b->n_seqs;
    if (total > m->max_tokens_seen) m->max_tokens_seen = total;
    if (rc) m->errors++;
    m->n_argmax_rows += n_argmax;
    m->in_forward = 0;
    pthread_mutex_unlock(&m->mu);
    return rc;
}

/* Sampler: greedy (temperature 0) or seeded categorical; logprobs from the log-softmax. */
struct fake_sampler {
    uint64_t rng;
    float temperature;
    int want_lp;                    /* logprobs or top_logprobs asked for */
};

static inline int fake_sampler_init(void *ctx, void *state, const struct kvs_sampling *p, uint64_t id)
{
    (void)ctx;
    struct fake_sampler *s = state;
    s->rng = fake_mix((p->has_seed ? p->seed : id) + 1);
    s->temperature = p->temperature;
    s->want_lp = p->logprobs || p->top_logprobs > 0;
    return p->temperature < 0 ? -EINVAL : 0;
}

/* fake_sample at temperature 0 is fake_argmax, what fake_forward puts in batch.argmax */
static inline int fake_sample_is_argmax(void *ctx, const void *state)
{
    const struct fake_model *m = ctx;
    const struct fake_sampler *s = state;
    return m->pick_rule == FAKE_PICK_SAMPLER && s->temperature == 0 && !s->want_lp;
}

static inline void fake_log_softmax(const float *lg, int vocab, float *out)
{
    float mx = lg[0];
    for (int v = 1; v < vocab; v++) mx = lg[v] > mx ? lg[v] : mx;
    double sum = 0;
    for (int v = 0; v < vocab; v++) sum += exp((double)lg[v] - mx);
    for (int v = 0; v < vocab; v++) out[v] = (float)((double)lg[v] - mx - log(sum));
}

static inline int fake_sample(void *ctx, void *state, float *logits, const int32_t *tokens, int n_prompt, int n_tokens,
                       int want_logprobs, int want_top, struct kvs_sample_out *out)
{
    struct fake_model *m = ctx;
    struct fake_sampler *s = state;
    int k = n_tokens - n_prompt;   /* completion tokens so far */
    if (m->fail_pattern && k == m->fail_at && fake_contains(tokens, n_prompt, m->fail_pattern, m->n_fail_pattern))
        return -EIO;
    if (m->pick_rule == FAKE_PICK_REVERSE) {
        if (n_prompt <= 0 || k < 0) return -EINVAL;
        out->token = tokens[n_prompt - 1 - k % n_prompt];
        out->logprob = logf(0.5f);
        out->n_top = want_top;
        for (int i = 0; i < want_top; i++) {
            out->top_ids[i] = (out->token + i) % m->vocab;
            out->top_logprobs[i] = logf(0.5f / (float)(1 << i));
        }
        return 0;
    }
    float lsm[1024];
    if (m->vocab > 1024) return -EINVAL;
    fake_log_softmax(logits, m->vocab, lsm);
    if (s->temperature == 0) {
        out->token = fake_argmax(logits, m->vocab);
    } else {
        s->rng = fake_mix(s->rng);
        double u = (double)(s->rng >> 11) / 9007199254740992.0, acc = 0;
        double w[1024], tot = 0;
        for (int v = 0; v < m->vocab; v++) tot += (w[v] = exp(lsm[v] / s->temperature));
        out->token = m->vocab - 1;
        for (int v = 0; v < m->vocab; v++) {
            acc += w[v] / tot;
            if (u < acc) {
                out->token = v;
                break;
            }
        }
    }
    if (want_logprobs) out->logprob = lsm[out->token];
    out->n_top = 0;
    for (int k = 0; k < want_top; k++) {   /* selection of the k largest, ties to the lower id */
        int best = -1;
        for (int v = 0; v < m->vocab; v++) {
            int used = 0;
            for (int j = 0; j < k; j++) used |= out->top_ids[j] == v;
            if (!used && (best < 0 || lsm[v] > lsm[best])) best = v;
        }
        out->top_ids[k] = best;
        out->top_logprobs[k] = lsm[best];
        out->n_top++;
    }
    return 0;
}

/* detokenizer: token t -> fake_piece(t); EOS is special (empty when skipping specials) */
static inline const char *fake_piece(int32_t t)
{
    static const char *pieces[] = {"<eos>", "a", "b", "c", "d", "e", "f", "g", " ", "h", "i", "j", "k",
                                   "l", "m", "n", "o", "p", "q", "r", "s", "t", "u", "v", "w", "x",
                                   "y", "z", "ab", "cd", "ef", "gh", " the", " a", ".", ",", "!", "?",
                                   "\n", "ing", "ed", "er", "st", "on", "an", "in", "re", "at", "ou",
                                   "it", "is", "or", "ti", "as", "te", "et", "ng", "of", "al", "de",
                                   "se", "le", "sa", "si"};
    return (t >= 0 && t < (int32_t)(sizeof pieces / sizeof *pieces)) ? pieces[t] : "?";
}

static inline void fake_detok_init(struct kvs_detok *d, const struct kvs_tokenizer *t, int skip_special)
{
    memset(d, 0, sizeof *d);
    d->tok = t;
    d->skip_special = skip_special;
}

static inline int fake_detok_feed(struct kvs_detok *d, int32_t id, char *out, size_t cap)
{
    const char *p = (id == FAKE_EOS && d->skip_special) ? "" : fake_piece(id);
    size_t n = strlen(p);
    if (n + 1 > cap) return -ENOSPC;
    memcpy(out, p, n + 1);
    d->n_seen++;
    return (int)n;
}

static inline int fake_detok_flush(struct kvs_detok *d, char *out, size_t cap)
{
    (void)d;
    if (cap < 1) return -ENOSPC;
    out[0] = 0;
    return 0;
}

static const int32_t fake_eos_ids[1] = {FAKE_EOS};

static inline void fake_model_init(struct fake_model *m, int n_blocks, int block_size, int vocab, int max_context)
{
    memset(m, 0, sizeof *m);
    m->n_blocks = n_blocks;
    m->block_size = block_size;
    m->vocab = vocab;
    m->max_context = max_context;
    m->slot_tok = kvs_xcalloc((size_t)n_blocks * block_size, sizeof(int32_t));
    m->slot_pos = kvs_xcalloc((size_t)n_blocks * block_size, sizeof(int32_t));
    for (size_t i = 0; i < (size_t)n_blocks * block_size; i++) m->slot_pos[i] = -1;
    pthread_mutex_init(&m->mu, NULL);
    pthread_cond_init(&m->cv, NULL);
}

static inline void fake_model_free(struct fake_model *m)
{
    free(m->slot_tok);
    free(m->slot_pos);
    pthread_mutex_destroy(&m->mu);
    pthread_cond_destroy(&m->cv);
}

static inline void fake_gate(struct fake_model *m, int closed)
{
    pthread_mutex_lock(&m->mu);
    m->gate_closed = closed;
    pthread_cond_broadcast(&m->cv);
    pthread_mutex_unlock(&m->mu);
}

static inline struct kvs_engine_exec fake_exec(struct fake_model *m)
{
    struct kvs_engine_exec x;
    memset(&x, 0, sizeof x);
    x.ctx = m;
    x.backend_name = "fake";
    x.n_blocks = m->n_blocks;
    x.block_size = m->block_size;
    x.vocab_size = m->vocab;
    x.max_context = m->max_context;
    x.forward = fake_forward;
    x.sampler_state_size = sizeof(struct fake_sampler);
    x.sampler_init = fake_sampler_init;
    x.sample = fake_sample;
    x.sample_is_argmax = fake_sample_is_argmax;
    x.detok_init = fake_detok_init;
    x.detok_feed = fake_detok_feed;
    x.detok_flush = fake_detok_flush;
    x.eos_ids = fake_eos_ids;
    x.n_eos = 1;
    return x;
}

/* Expected greedy continuation, computed without the engine. Writes up to max_tokens ids into
 * out (stopping after EOS unless ignore_eos) and returns the count. */
static inline int fake_reference(int vocab, const int32_t *prompt, int n_prompt, int max_tokens, int ignore_eos, int32_t *out)
{
    uint64_t h = 0;
    for (int p = 0; p < n_prompt; p++) h = fake_hash_step(h, prompt[p], p);
    float lg[1024];
    int n = 0;
    while (n < max_tokens) {
        fake_logits_from_hash(h, vocab, lg);
        int32_t t = fake_argmax(lg, vocab);
        out[n++] = t;
        if (t == FAKE_EOS && !ignore_eos) break;
        h = fake_hash_step(h, t, n_prompt + n - 1);
    }
    return n;
}

#endif
