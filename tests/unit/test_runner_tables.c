/* test_runner_tables.c: the runner keeps the step's block table on the backend and patches it
 * (only the entries that changed since the step before go up; engine/runner.c bt_stage_row).
 * After every step of a scripted run on the CPU backend (the tiny Llama), the table read back
 * from the backend must equal one built from scratch from the batch (each row: the sequence's
 * blocks, then zeros), through:
 *   - appends (a decoding sequence enters a new block) and steps that change nothing (0 sent),
 *   - a sequence joining (new row), a cancelled one leaving (rows shift up),
 *   - the stride growing (every row laid out again),
 *   - preemption (a sequence leaves; its blocks go to another, which appends them),
 *   - copy-on-write (an entry of an existing row replaced in place),
 *   - a step refused after staging (host logits row without a logits buffer) followed by a good
 *     one: the refused step's change still reaches the backend,
 *   - a preempted sequence coming back (recompute) into a row that held other blocks before.
 * It also checks how many entries each step sent, so a full re-upload every step would fail,
 * and that the other per-step inputs (tokens, positions, slots, query starts, logits rows) go
 * up only where they changed too (engine/runner.c upload_changed).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/util.h"
#include "engine/config.h"
#include "engine/runner.h"
#include "models/model.h"
#include "tests/unit/test_util.h"

#define BS 16
#define POOL 64
#define MAXB 16

struct seq {
    int32_t table[MAXB];
    int n_blocks;
    int pos;
};

static struct kvs_runner *R;
static float *logits;
static int vocab;
static int32_t toks[64];
static size_t last_in;   /* the last good step's other inputs sent (step info in_uploaded) */

/* runs one step of the given sequences (n_tok[i] tokens each, at seq->pos) and checks the
 * backend's table against a from-scratch build; returns the entries the step sent, or -1 */
static long step(const char *what, struct seq **s, const int *n_tok, int n, int want_logits, float *lg, int expect_rc)
{
    struct kvs_batch_seq bs[8];
    memset(bs, 0, sizeof bs);
    for (int i = 0; i < n; i++) {
        bs[i].tokens = toks;
        bs[i].n_tokens = n_tok[i];
        bs[i].pos = s[i]->pos;
        bs[i].block_table = s[i]->table;
        bs[i].n_blocks = s[i]->n_blocks;
        bs[i].want_logits = want_logits;
        bs[i].slot = -1;
    }
    struct kvs_batch b = {bs, n, NULL};
    int rc = kvs_runner_forward(R, &b, lg);
    CHECK(rc == expect_rc, "%s: forward rc %d, want %d", what, rc, expect_rc);
    if (rc != 0) return -1;
    for (int i = 0; i < n; i++) s[i]->pos += n_tok[i];
    struct kvs_runner_step_info info;
    kvs_runner_last_step(R, &info);
    last_in = info.in_uploaded;
    CHECK(info.n_seqs >= n && info.stride >= 1, "%s: step info %d x %d", what, info.n_seqs, info.stride);
    int32_t got[8 * MAXB], want[8 * MAXB];
    int m = kvs_runner_block_tables(R, got, sizeof got / sizeof got[0]);
    CHECK(m == info.n_seqs * info.stride, "%s: read %d entries, want %d", what, m, info.n_seqs * info.stride);
    for (int r = 0; r < info.n_seqs; r++) {
        int need = r < n ? (s[r]->pos + BS - 1) / BS : 0;   /* pos already advanced: covers the step */
        for (int j = 0; j < info.stride; j++) want[r * info.stride + j] = j < need ? s[r]->table[j] : 0;
    }
    int bad = 0;
    for (int k = 0; k < m && k < 8 * MAXB; k++) bad += got[k] != want[k];
    CHECK(bad == 0, "%s: %d of %d block-table entries differ from a from-scratch build", what, bad, m);
    return (long)info.bt_uploaded;
}

int main(void)
{
    kvs_log_set_level(KVS_LOG_WARN);
    char dir[1024], err[512];
    snprintf(dir, sizeof dir, "%s/tests/data/models/llama", kvs_test_root());
    struct kvs_model *model;
    KVS_ASSERT(kvs_model_load(dir, &model, err, sizeof err) == 0);
    const struct kvs_model_config *mc = kvs_model_config(model);
    struct kvs_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.device = "cpu";
    cfg.cpu_threads = 1;
    cfg.kv_block_size = BS;
    cfg.max_batch_tokens = 64;
    cfg.max_running = 8;
    cfg.kv_memory_bytes = (int64_t)POOL * BS * mc->n_layers * 2 * mc->n_kv_heads * mc->head_dim * 4;
    if (kvs_runner_create(&cfg, model, &R, err, sizeof err) != 0) {
        printf("FAIL runner create: %s\n", err);
        return 1;
    }
    vocab = kvs_runner_vocab_size(R);
    logits = kvs_xmalloc((size_t)64 * vocab * sizeof(float));
    uint64_t rs = 7;
    for (int i = 0; i < 64; i++) toks[i] = (int32_t)(kvs_test_xorshift(&rs) % (uint64_t)vocab);

    /* blocks of 16; A: 17-token prompt (2 blocks, the longest row until D comes), B: 15 tokens
     * (1 block); blocks scattered over the pool */
    struct seq A = {{40, 7, 23}, 3, 0}, B = {{9, 31}, 2, 0}, C = {{60, 18}, 2, 0}, D = {{11, 12, 13}, 3, 0};
    struct seq *ab[2] = {&A, &B};
    long up;
    up = step("prefill A+B", ab, (int[]){17, 15}, 2, KVS_LOGITS_LAST, logits, 0);
    CHECK(up == 4, "first step sends the whole 2 x 2 table, sent %ld", up);
    up = step("decode, no new block", ab, (int[]){1, 1}, 2, KVS_LOGITS_LAST, logits, 0);
    CHECK(up == 0, "a step that changes no entry sends none, sent %ld", up);
    up = step("decode, B enters its block 2", ab, (int[]){1, 1}, 2, KVS_LOGITS_LAST, logits, 0);
    CHECK(up == 1, "an append sends one entry, sent %ld", up);

    struct seq *abc[3] = {&A, &B, &C};
    up = step("C joins", abc, (int[]){1, 1, 5}, 3, KVS_LOGITS_LAST, logits, 0);
    CHECK(up == 2, "a new row sends its 2 entries, sent %ld", up);

    /* B cancelled: C moves up into B's row */
    struct seq *ac[2] = {&A, &C};
    up = step("B cancelled", ac, (int[]){1, 1}, 2, KVS_LOGITS_LAST, logits, 0);
    CHECK(up == 2, "the row that changed hands sends its entries, sent %ld", up);

    /* C preempted: A alone */
    struct seq *a[1] = {&A};
    up = step("C preempted", a, (int[]){1}, 1, KVS_LOGITS_LAST, logits, 0);
    CHECK(up == 0, "fewer rows, same entries: nothing sent, sent %ld", up);

    /* copy-on-write: A's first block replaced in place (by one C freed) */
    A.table[0] = 18;
    up = step("copy-on-write of A's block 0", a, (int[]){1}, 1, KVS_LOGITS_LAST, logits, 0);
    CHECK(up == 1, "one replaced entry sends one, sent %ld", up);

    /* refused after staging (a host logits row, no buffer); its change must still arrive */
    A.table[1] = 60;
    step("refused step", a, (int[]){1}, 1, KVS_LOGITS_LAST, NULL, -EINVAL);
    up = step("after the refused step", a, (int[]){1}, 1, KVS_LOGITS_LAST, logits, 0);
    CHECK(up == 1, "the refused step's entry went up with the next, sent %ld", up);

    /* C back (recompute from its prompt) with other blocks, into the row that held its old ones */
    C = (struct seq){{33, 50}, 2, 0};
    up = step("C recomputed", ac, (int[]){1, 20}, 2, KVS_LOGITS_LAST, logits, 0);
    CHECK(up == 2, "the recomputed row's 2 entries, sent %ld", up);
    up = step("decode after the recompute", ac, (int[]){1, 1}, 2, KVS_LOGITS_LAST, logits, 0);
    CHECK(up == 0, "nothing new, sent %ld", up);

    /* D's 40-token prompt needs 3 blocks: every row is laid out at stride 3 */
    struct seq *acd[3] = {&A, &C, &D};
    up = step("D joins, stride 3", acd, (int[]){1, 1, 40}, 3, KVS_LOGITS_LAST, logits, 0);
    CHECK(up == 9, "a new stride sends every row (3 x 3), sent %ld", up);
    up = step("decode at stride 3", acd, (int[]){1, 1, 1}, 3, KVS_LOGITS_LAST, logits, 0);
    CHECK(up == 0, "nothing new, sent %ld", up);
    /* the same three rows again: their positions, KV slots and sequence positions move (3 x 3);
     * the tokens (toks[0] each), query starts and logits rows are what the backend holds */
    up = step("decode at stride 3, again", acd, (int[]){1, 1, 1}, 3, KVS_LOGITS_LAST, logits, 0);
    CHECK(up == 0 && last_in == 9, "a repeated decode step sends 0 table entries and 9 other entries, sent %ld and %zu",
          up, last_in);

    free(logits);
    kvs_runner_free(R);
    kvs_model_free(model);
    return kvs_test_summary("test_runner_tables");
}
