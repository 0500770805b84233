/* eval.h: the quality harness behind kvserve-eval (tools/kvserve_eval_main.c): a candidate
 * configuration compared with the reference setting (kv.decode=full, kv.storage=auto, i.e. the
 * backend's full precision: f32 on cpu, kv.reuse=none) on the same model and the same inputs.
 *
 *   eval_tf.c        teacher-forced perplexity, KL(p_ref || p_cfg) and top-1 agreement, on two
 *                    runners driven in lockstep over the same token sequences;
 *   eval_retrieval.c long-context retrieval probes (a fact stated early in filler text, asked
 *                    about at the end), greedy-decoded through the engine;
 *   eval_counters.c  the strategies' own counters (KV bytes read per decode step, compression,
 *                    hit rate): the one place a KV strategy reports to the harness.
 *
 * The eval-only lossy mode (window > 0) does not touch the engine: the candidate sees only the
 * last `window` tokens of each context (teacher-forced: the logits of position p come from
 * tokens p-window+1..p, re-encoded at positions 0..; retrieval: the prompt cut to its last
 * `window` tokens). It exists so that the harness can prove it sees losses.
 *
 * Ownership: results are plain structs filled by the callee; arrays inside (probe ids) are
 * malloc'ed by the creator and freed with the matching *_free. Errors: 0 / negative errno with
 * a message in err.
 */
#ifndef KVS_EVAL_H
#define KVS_EVAL_H

#include <stddef.h>
#include <stdint.h>

struct kvs_config;
struct kvs_model;
struct kvs_tokenizer;
struct kvs_kv;
struct kvs_batch;
struct kvs_engine_stats;

/* ---- strategy counters (eval_counters.c) -------------------------------------------------- */

/* What a KV strategy reports about its decode steps. Sums over decode steps (one token per
 * sequence); derived numbers are computed by kvs_eval_counters_finish. */
struct kvs_eval_counters {
    uint64_t decode_steps;        /* forward passes of decode tokens */
    uint64_t decode_tokens;       /* decode tokens in them */
    double kv_bytes_read;         /* KV bytes the strategy read (all layers, K+V) */
    double kv_bytes_full;         /* what full attention over the same contexts reads */
    int kv_read_known;            /* 0: the strategy does not report what it reads */
    size_t kv_bytes_per_token;    /* stored bytes per token (all layers, K+V) */
    /* reuse: lookups and hits (prefix blocks, cached documents); queries 0 = n/a */
    uint64_t hit_queries, hits;
    /* strategy-specific extras (recall@k, summary hit rate, ...): name/value pairs */
    int n_extra;
    const char *extra_name[8];
    double extra_value[8];
};

/* Starts counting for a strategy whose runner stores kv_bytes_per_token per token. */
void kvs_eval_counters_init(struct kvs_eval_counters *c, size_t kv_bytes_per_token);
/* Accounts one forward pass of batch b (decode tokens only count; prefill chunks do not).
 * window > 0: the eval-only lossy window (each sequence reads at most window tokens). s may be
 * NULL (no strategy: full attention). */
void kvs_eval_counters_step(struct kvs_eval_counters *c, const struct kvs_kv *s, const struct kvs_batch *b,
                            int window, int is_decode);
/* Pulls what the strategy keeps about itself (after the run): the decode policy's counters
 * through the runner (engine/kv/kv.h: KV bytes read, its own numbers as extras). */
struct kvs_runner;
void kvs_eval_counters_finish(struct kvs_eval_counters *c, const struct kvs_kv *s, struct kvs_runner *r);
/* Reuse counters of an engine run (prefix hits over prefix lookups). */
void kvs_eval_counters_from_engine(struct kvs_eval_counters *c, const struct kvs_engine_stats *st);

/* ---- teacher-forced comparison (eval_tf.c) ------------------------------------------------ */

struct kvs_eval_tf_opts {
    int seq_len;                  /* tokens per sequence (>= 2) */
    int n_seqs;                   /* sequences (cut from the input, no overlap) */
    int prefill;                  /* the first `prefill` tokens go in as one prefill (>= 1); the
                                   * rest are fed one decode step at a time */
    int window;                   /* > 0: candidate sees only the last `window` tokens */
};

struct kvs_eval_tf_result {
    int n_positions;              /* scored positions (all sequences) */
    double nll_ref, nll_cfg;      /* mean negative log-likelihood of the true next token (nats) */
    double ppl_ref, ppl_cfg;      /* exp(nll) */
    double kl_mean, kl_p95, kl_max;   /* KL(p_ref || p_cfg) per position, nats */
    double top1_agree;            /* fraction of positions with the same argmax */
    double seconds;
    struct kvs_eval_counters ref, cfg;
    char backend[32];
};

/* tokens: at least seq_len * n_seqs ids (sequence i = tokens[i*seq_len ..]). The runners are
 * created from ref_cfg and cfg (their kv memory is sized by the caller). */
int kvs_eval_teacher_forced(const struct kvs_config *ref_cfg, const struct kvs_config *cfg,
                            const struct kvs_model *model, const int32_t *tokens, int n_tokens,
                            const struct kvs_eval_tf_opts *o, struct kvs_eval_tf_result *res, char *err,
                            size_t errlen);

/* ---- retrieval probes (eval_retrieval.c) -------------------------------------------------- */

/* Text probe formats (plain English; the wording of each is in eval_retrieval.c). */
enum kvs_eval_format {
    KVS_EVAL_FACT = 0,            /* "The secret code of <Name> is <NNNN>." early, two distractors */
    KVS_EVAL_PASSKEY = 1,         /* "The pass key is <NNNNN>. Remember it. ..." at any depth */
    KVS_EVAL_KV = 2,              /* a block of "<word>-<NNN>: <NNNN>" records at any depth */
    KVS_EVAL_N_FORMATS = 3,
    KVS_EVAL_IDS = KVS_EVAL_N_FORMATS   /* id probes (no tokenizer) */
};
#define KVS_EVAL_ALL_FORMATS ((1u << KVS_EVAL_N_FORMATS) - 1)

/* "fact", "passkey", "kv" ("ids" for id probes); NULL when out of range */
const char *kvs_eval_format_name(int format);
/* Parses a comma-separated list of format names into a bit mask (1 << format); 0 or -EINVAL. */
int kvs_eval_parse_formats(const char *list, unsigned *mask);

struct kvs_eval_probe {
    int length;                   /* target context length (the bucket) */
    int format;                   /* enum kvs_eval_format */
    int32_t *ids;                 /* [n] prompt */
    int n;
    int32_t *answer_ids;          /* [n_answer] expected greedy continuation (id probes) */
    int n_answer;
    char *answer_text;            /* text probes: the value, e.g. "4821" */
};

struct kvs_eval_probes {
    struct kvs_eval_probe *p;
    int n;
    int text;                     /* 1: text probes (tokenizer), 0: token-id probes */
    double timeout_s;             /* per probe, from submission to its last token (0: 600 s) */
};

/* Text probes: facts ("The secret code of Alice is 4821.") stated early inside filler lines,
 * asked about at the end ("Question: What is the secret code of Alice?\nAnswer:"); the answer
 * must be the value. filler: text whose lines are used in order from a random start. Only the
 * fact format (what this function always made); kvs_eval_probes_text_formats picks formats. */
int kvs_eval_probes_text(const struct kvs_tokenizer *tok, const char *filler, size_t filler_len,
                         const int *lengths, int n_lengths, int per_length, uint64_t seed,
                         struct kvs_eval_probes *out, char *err, size_t errlen);
/* The same with the formats of `formats` (a mask of 1 << enum kvs_eval_format): probe k of a
 * length has the k-th format of the mask, round robin, so per_length stays the count per
 * length (each format gets per_length / n_formats, the first ones one more). */
int kvs_eval_probes_text_formats(const struct kvs_tokenizer *tok, const char *filler, size_t filler_len,
                                 const int *lengths, int n_lengths, int per_length, unsigned formats,
                                 uint64_t seed, struct kvs_eval_probes *out, char *err, size_t errlen);
/* Token-id probes for models without a tokenizer: random filler ids, a key -> value id
 * pattern stated early, the key repeated at the end; the answer is the value ids. */
int kvs_eval_probes_ids(int vocab, const int *lengths, int n_lengths, int per_length, uint64_t seed,
                        struct kvs_eval_probes *out, char *err, size_t errlen);
void kvs_eval_probes_free(struct kvs_eval_probes *p);

struct kvs_eval_retrieval_result {
    int n_lengths;
    int lengths[16];
    int total[16], correct[16];
    int fmt_total[16][KVS_EVAL_N_FORMATS + 1], fmt_correct[16][KVS_EVAL_N_FORMATS + 1];  /* by format */
    double seconds;
    struct kvs_eval_counters counters;   /* reuse hits from the engine */
    char example[160];            /* one generated answer (for the log) */
};

/* Greedy-decodes every probe through an engine made from cfg (window > 0: prompts cut to their
 * last window tokens) and counts exact matches per length. */
int kvs_eval_retrieval(const struct kvs_config *cfg, const struct kvs_model *model, const struct kvs_tokenizer *tok,
                       const struct kvs_eval_probes *probes, int window, struct kvs_eval_retrieval_result *res,
                       char *err, size_t errlen);

/* ---- every decode policy (eval_policies.c) ---------------------------------------------- */

/* Runs every decode policy the KV registry has built, with base's other settings, against
 * ref on the same inputs (teacher-forced with o, retrieval with probes) and prints one table
 * row each on stdout. 0 or a negative errno with a message. */
int kvs_eval_all_policies(const struct kvs_config *base, const struct kvs_config *ref, const struct kvs_model *model,
                          const struct kvs_tokenizer *tok, const int32_t *tokens, int n_tokens,
                          const struct kvs_eval_tf_opts *o, const struct kvs_eval_probes *probes, int do_tf,
                          int do_ret, char *err, size_t errlen);

#endif
