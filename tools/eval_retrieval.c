/* eval_retrieval.c: long-context retrieval probes for the quality harness (eval.h).
 *
 * Text probes (the model has a tokenizer): lines of filler text from a random starting line,
 * with lines of one of three plain-English formats spliced in, then a question:
 *   fact     "The secret code of <Name> is <NNNN>.\n" (the asked fact in the first quarter of
 *            the lines, two distractor facts anywhere), "Question: What is the secret code of
 *            <Name>?\nAnswer:"; names from the demo model's held-out evaluation names, never
 *            seen in its training facts;
 *   passkey  "The pass key is <NNNNN>. Remember it. <NNNNN> is the pass key.\n" at any depth,
 *            "Question: What is the pass key?\nAnswer:";
 *   kv       a block of 8 records "<word>-<NNN>: <NNNN>\n" at any depth, "Question: What is
 *            the value of <word>-<NNN>?\nAnswer:".
 * Greedy decoding must produce the value: the first number of the answer's first line (a bare
 * " 4821" or a sentence such as "The secret code of Alfred is 4821.") equals it.
 * Id probes (no tokenizer): random filler ids with a 3-id key followed by a 3-id value in the
 * first quarter, the key again at the end; the next 3 generated ids must equal the value.
 *
 * Every probe goes through the engine (kvs_engine_submit, greedy), so whatever the config
 * selects (reuse, decode strategy, storage) is what answers.
 */
#include "base/rng.h"
#include "tools/eval.h"

#include <ctype.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "engine/config.h"
#include "engine/engine.h"
#include "engine/text/tokenizer.h"
#include "base/util.h"

static const char *const NAMES[] = {"Alfred", "Bianca",  "Cyrus",   "Delia",  "Enzo",     "Freya", "Gideon",
                                    "Hilda",  "Ingrid",  "Jonah",   "Keira",  "Lionel",   "Mirabel", "Nestor",
                                    "Orla",   "Perry",   "Quentin", "Rosalind", "Silas",  "Thea",  "Ulric",
                                    "Vera",   "Wilbur",  "Yara",    "Zane"};
#define N_NAMES ((int)(sizeof NAMES / sizeof NAMES[0]))

static uint64_t rng_next(uint64_t *s)
{
    return kvs_splitmix64(s);
}

static int rng_int(uint64_t *s, int n) { return n <= 0 ? 0 : (int)(rng_next(s) % (uint64_t)n); }

void kvs_eval_probes_free(struct kvs_eval_probes *p)
{
    for (int i = 0; i < p->n; i++) {
        free(p->p[i].ids);
        free(p->p[i].answer_ids);
        free(p->p[i].answer_text);
    }
    free(p->p);
    memset(p, 0, sizeof *p);
}

struct line {
    const char *s;
    int len;                      /* bytes including the '\n' if present */
    int ntok;
};

struct sbuf {
    char *s;
    size_t n, cap;
};

static void sb_add(struct sbuf *b, const char *s, size_t n)
{
    if (b->n + n + 1 > b->cap) {
        b->cap = (b->n + n + 1) * 2;
        b->s = kvs_xrealloc(b->s, b->cap);
    }
    memcpy(b->s + b->n, s, n);
    b->n += n;
    b->s[b->n] = 0;
}

/* encodes text into *ids (grown as needed); returns the count or a negative errno */
static int encode(const struct kvs_tokenizer *tok, const char *s, size_t n, int add_special, int32_t **ids, int *cap)
{
    int m = kvs_tokenizer_encode(tok, s, n, add_special, 0, *ids, *cap);
    if (m > *cap) {
        *cap = m + 16;
        *ids = kvs_xrealloc(*ids, (size_t)*cap * sizeof **ids);
        m = kvs_tokenizer_encode(tok, s, n, add_special, 0, *ids, *cap);
    }
    return m;
}

/* Plain words for the keys of the key-value format ("river-482: 7391"). */
static const char *const KEY_WORDS[] = {"river", "lamp",  "garden", "window", "silver", "candle", "harbor", "meadow",
                                        "copper", "orchard", "lantern", "pepper", "marble", "thunder", "violet", "anchor"};
#define N_KEY_WORDS ((int)(sizeof KEY_WORDS / sizeof KEY_WORDS[0]))
#define N_KV 8                    /* records in the key-value block */
#define MAX_ITEMS 3               /* inserted pieces of one probe */

static const char *const FORMAT_NAMES[KVS_EVAL_N_FORMATS + 1] = {"fact", "passkey", "kv", "ids"};

const char *kvs_eval_format_name(int format)
{
    return format >= 0 && format <= KVS_EVAL_N_FORMATS ? FORMAT_NAMES[format] : NULL;
}

int kvs_eval_parse_formats(const char *list, unsigned *mask)
{
    *mask = 0;
    const char *p = list;
    while (p && *p) {
        const char *e = strchr(p, ',');
        size_t n = e ? (size_t)(e - p) : strlen(p);
        int f;
        for (f = 0; f < KVS_EVAL_N_FORMATS; f++)
            if (strlen(FORMAT_NAMES[f]) == n && !strncmp(p, FORMAT_NAMES[f], n)) break;
        if (f == KVS_EVAL_N_FORMATS) return -EINVAL;
        *mask |= 1u << f;
        p = e ? e + 1 : NULL;
    }
    return *mask ? 0 : -EINVAL;
}

/* One probe's pieces: the lines spliced into the filler (item), the line index each goes
 * before (slot; the first quarter or anywhere, decided once the filler's line count is known),
 * the question at the end and the expected answer. */
struct probe_spec {
    char item[MAX_ITEMS][N_KV * 24 + 8];
    int n_items;
    int early[MAX_ITEMS];         /* 1: slot in the first quarter of the lines */
    char question[160];
    char answer[16];
};

static void make_spec(int format, uint64_t *seed, struct probe_spec *sp)
{
    memset(sp, 0, sizeof *sp);
    if (format == KVS_EVAL_PASSKEY) {
        /* the classic passkey test (one value, anywhere, nothing like it in the filler) */
        snprintf(sp->answer, sizeof sp->answer, "%d", 10000 + rng_int(seed, 90000));
        snprintf(sp->item[0], sizeof sp->item[0], "The pass key is %s. Remember it. %s is the pass key.\n", sp->answer,
                 sp->answer);
        sp->n_items = 1;
        snprintf(sp->question, sizeof sp->question, "Question: What is the pass key?\nAnswer:");
    } else if (format == KVS_EVAL_KV) {
        /* a block of N_KV records with distinct keys at any depth; one of them is asked */
        char key[N_KV][32];
        size_t n = 0;
        int asked = rng_int(seed, N_KV);
        for (int i = 0; i < N_KV; i++) {
            int dup;
            do {
                snprintf(key[i], sizeof key[i], "%s-%d", KEY_WORDS[rng_int(seed, N_KEY_WORDS)], 10 + rng_int(seed, 990));
                dup = 0;
                for (int j = 0; j < i; j++) dup |= !strcmp(key[i], key[j]);
            } while (dup);
            char val[8];
            snprintf(val, sizeof val, "%d", 1000 + rng_int(seed, 9000));
            if (i == asked) snprintf(sp->answer, sizeof sp->answer, "%s", val);
            n += (size_t)snprintf(sp->item[0] + n, sizeof sp->item[0] - n, "%s: %s\n", key[i], val);
        }
        sp->n_items = 1;
        snprintf(sp->question, sizeof sp->question, "Question: What is the value of %s?\nAnswer:", key[asked]);
    } else {
        /* the asked fact early, two distractor facts about other names anywhere */
        int used[3];
        for (int f = 0; f < 3; f++) {
            int nm, dup;
            do {
                nm = rng_int(seed, N_NAMES);
                dup = 0;
                for (int g = 0; g < f; g++) dup |= used[g] == nm;
            } while (dup);
            used[f] = nm;
            char code[8];
            snprintf(code, sizeof code, "%d", 1000 + rng_int(seed, 9000));
            if (f == 0) snprintf(sp->answer, sizeof sp->answer, "%s", code);
            snprintf(sp->item[f], sizeof sp->item[f], "The secret code of %s is %s.\n", NAMES[nm], code);
        }
        sp->n_items = 3;
        sp->early[0] = 1;
        snprintf(sp->question, sizeof sp->question, "Question: What is the secret code of %s?\nAnswer:", NAMES[used[0]]);
    }
}

int kvs_eval_probes_text(const struct kvs_tokenizer *tok, const char *filler, size_t filler_len,
                         const int *lengths, int n_lengths, int per_length, uint64_t seed,
                         struct kvs_eval_probes *out, char *err, size_t errlen)
{
    return kvs_eval_probes_text_formats(tok, filler, filler_len, lengths, n_lengths, per_length, 1u << KVS_EVAL_FACT,
                                        seed, out, err, errlen);
}

int kvs_eval_probes_text_formats(const struct kvs_tokenizer *tok, const char *filler, size_t filler_len,
                                 const int *lengths, int n_lengths, int per_length, unsigned formats,
                                 uint64_t seed, struct kvs_eval_probes *out, char *err, size_t errlen)
{
    memset(out, 0, sizeof *out);
    out->text = 1;
    int fmt_list[KVS_EVAL_N_FORMATS], n_fmt = 0;
    for (int f = 0; f < KVS_EVAL_N_FORMATS; f++)
        if (formats & (1u << f)) fmt_list[n_fmt++] = f;
    if (!n_fmt || (formats & ~(unsigned)KVS_EVAL_ALL_FORMATS))
        return kvs_err(err, errlen, -EINVAL, "eval: bad probe format mask 0x%x", formats);
    /* filler lines (non-blank) */
    struct line *lines = NULL;
    int n_lines = 0, cap_lines = 0;
    for (size_t i = 0; i < filler_len;) {
        size_t j = i;
        while (j < filler_len && filler[j] != '\n') j++;
        size_t end = j < filler_len ? j + 1 : j;
        int blank = 1;
        for (size_t k = i; k < j; k++)
            if (!isspace((unsigned char)filler[k])) blank = 0;
        if (!blank && j > i) {
            if (n_lines == cap_lines) lines = kvs_xrealloc(lines, (size_t)(cap_lines = cap_lines * 2 + 64) * sizeof *lines);
            lines[n_lines++] = (struct line){filler + i, (int)(end - i), -1};
        }
        i = end;
    }
    int32_t *ids = NULL;
    int ids_cap = 0, rc = 0;
    struct sbuf sb = {0};
    if (n_lines < 4) {
        rc = kvs_err(err, errlen, -EINVAL, "eval: the filler text has %d non-blank lines (need at least 4)", n_lines);
        goto out;
    }
    int add_bos = kvs_tokenizer_add_bos_default(tok);
    out->p = kvs_xcalloc((size_t)n_lengths * per_length, sizeof *out->p);
    for (int li = 0; li < n_lengths; li++) {
        for (int k = 0; k < per_length; k++) {
            int L = lengths[li], format = fmt_list[k % n_fmt];
            struct probe_spec sp;
            make_spec(format, &seed, &sp);
            int fixed = encode(tok, sp.question, strlen(sp.question), add_bos, &ids, &ids_cap);
            for (int f = 0; f < sp.n_items && fixed >= 0; f++) {
                int m = encode(tok, sp.item[f], strlen(sp.item[f]), 0, &ids, &ids_cap);
                fixed = m < 0 ? m : fixed + m;
            }
            if (fixed < 0) {
                rc = kvs_err(err, errlen, fixed, "eval: tokenizer failed on a probe");
                goto out;
            }
            /* take filler lines until the budget is spent */
            int start = rng_int(&seed, n_lines), nl = 0, budget = L - fixed;
            for (int tot = 0;; nl++) {
                struct line *ln = &lines[(start + nl) % n_lines];
                if (ln->ntok < 0) {
                    int m = encode(tok, ln->s, (size_t)ln->len, 0, &ids, &ids_cap);
                    if (m < 0) {
                        rc = kvs_err(err, errlen, m, "eval: tokenizer failed on the filler");
                        goto out;
                    }
                    ln->ntok = m;
                }
                if (tot + ln->ntok > budget) break;
                tot += ln->ntok;
            }
            if (nl < 4) {
                rc = kvs_err(err, errlen, -EINVAL, "eval: probe length %d is too short for the filler lines", L);
                goto out;
            }
            int slot[MAX_ITEMS];
            for (int f = 0; f < sp.n_items; f++) slot[f] = rng_int(&seed, (sp.early[f] ? nl / 4 : nl) + 1);
            /* assemble; cut filler lines from the end while the encoding is over L */
            int n;
            for (;;) {
                sb.n = 0;
                for (int i = 0; i <= nl; i++) {
                    for (int f = 0; f < sp.n_items; f++)
                        if (slot[f] == i || (i == nl && slot[f] > nl)) sb_add(&sb, sp.item[f], strlen(sp.item[f]));
                    if (i < nl) {
                        struct line *ln = &lines[(start + i) % n_lines];
                        sb_add(&sb, ln->s, (size_t)ln->len);
                        if (ln->s[ln->len - 1] != '\n') sb_add(&sb, "\n", 1);
                    }
                }
                sb_add(&sb, sp.question, strlen(sp.question));
                n = encode(tok, sb.s, sb.n, add_bos, &ids, &ids_cap);
                if (n < 0) {
                    rc = kvs_err(err, errlen, n, "eval: tokenizer failed on a probe");
                    goto out;
                }
                if (n <= L || nl <= 4) break;
                nl--;
            }
            struct kvs_eval_probe *p = &out->p[out->n++];
            p->length = L;
            p->format = format;
            p->n = n;
            p->ids = kvs_xmalloc((size_t)n * sizeof *p->ids);
            memcpy(p->ids, ids, (size_t)n * sizeof *ids);
            p->answer_text = kvs_xstrdup(sp.answer);
        }
    }
out:
    free(lines);
    free(ids);
    free(sb.s);
    if (rc) kvs_eval_probes_free(out);
    return rc;
}

int kvs_eval_probes_ids(int vocab, const int *lengths, int n_lengths, int per_length, uint64_t seed,
                        struct kvs_eval_probes *out, char *err, size_t errlen)
{
    memset(out, 0, sizeof *out);
    if (vocab < 64) return kvs_err(err, errlen, -EINVAL, "eval: vocabulary of %d is too small for id probes", vocab);
    out->p = kvs_xcalloc((size_t)n_lengths * per_length, sizeof *out->p);
    int lo = vocab / 8;
    for (int li = 0; li < n_lengths; li++) {
        int L = lengths[li];
        if (L < 16) {
            kvs_eval_probes_free(out);
            return kvs_err(err, errlen, -EINVAL, "eval: probe length %d is too short", L);
        }
        for (int k = 0; k < per_length; k++) {
            struct kvs_eval_probe *p = &out->p[out->n++];
            p->length = L;
            p->format = KVS_EVAL_IDS;
            p->n = L;
            p->ids = kvs_xmalloc((size_t)L * sizeof *p->ids);
            p->answer_ids = kvs_xmalloc(3 * sizeof *p->answer_ids);
            p->n_answer = 3;
            int32_t key[3];
            for (int i = 0; i < 3; i++) key[i] = lo + rng_int(&seed, vocab - lo);
            for (int i = 0; i < 3; i++) p->answer_ids[i] = lo + rng_int(&seed, vocab - lo);
            for (int i = 0; i < L; i++) p->ids[i] = lo + rng_int(&seed, vocab - lo);
            int at = rng_int(&seed, (L - 3) / 4);
            memcpy(p->ids + at, key, sizeof key);
            memcpy(p->ids + at + 3, p->answer_ids, 3 * sizeof *p->answer_ids);
            memcpy(p->ids + L - 3, key, sizeof key);
        }
    }
    return 0;
}

/* A text probe is answered when the first number of the answer's first line is the value: a
 * bare "4821", or a sentence as instruction-tuned models give ("The secret code of Alfred is
 * 4821."). A number is a maximal run of digits; one right after '-' is part of a key
 * ("river-482") that the answer may repeat, not a number. */
static int text_matches(const char *gen, const char *want)
{
    size_t n = strlen(want);
    for (const char *p = gen; *p && *p != '\n'; p++) {
        if (!isdigit((unsigned char)*p)) continue;
        const char *e = p;
        while (isdigit((unsigned char)*e)) e++;
        if (p > gen && p[-1] == '-') {
            p = e - 1;
            continue;
        }
        return (size_t)(e - p) == n && !strncmp(p, want, n);
    }
    return 0;
}

/* room for a sentence answer with one token per digit ("The pass key is 83870.") */
#define TEXT_ANSWER_TOKENS 24

struct job {
    struct kvs_request *r;
    int done, ok, n_gen;
    int32_t gen[16];              /* id probes: the first ids (n_answer <= 16) */
    struct sbuf text;
    char error[256];
};

/* collects events until DONE/ERROR (or the timeout) */
static int collect(struct job *j, double timeout_s)
{
    struct kvs_event ev[16];
    double t_end = kvs_now() + timeout_s;
    while (!j->done) {
        double left = t_end - kvs_now();
        if (left <= 0) return -ETIMEDOUT;
        int n = kvs_request_wait(j->r, ev, 16, left);
        for (int i = 0; i < n; i++) {
            if (ev[i].type == KVS_EV_TOKEN) {
                if (j->n_gen < 16) j->gen[j->n_gen++] = ev[i].token;
                if (ev[i].text) sb_add(&j->text, ev[i].text, strlen(ev[i].text));
            } else {
                j->done = 1;
                if (ev[i].type == KVS_EV_ERROR) {
                    snprintf(j->error, sizeof j->error, "%s", ev[i].error ? ev[i].error : "error");
                    j->ok = -EIO;
                }
            }
            kvs_event_clear(&ev[i]);
        }
    }
    return j->ok;
}

int kvs_eval_retrieval(const struct kvs_config *cfg, const struct kvs_model *model, const struct kvs_tokenizer *tok,
                       const struct kvs_eval_probes *probes, int window, struct kvs_eval_retrieval_result *res,
                       char *err, size_t errlen)
{
    memset(res, 0, sizeof *res);
    for (int i = 0; i < probes->n; i++) {
        int L = probes->p[i].length, li;
        for (li = 0; li < res->n_lengths && res->lengths[li] != L; li++) {}
        if (li == res->n_lengths) {
            if (li == 16) return kvs_err(err, errlen, -EINVAL, "eval: at most 16 probe lengths");
            res->lengths[res->n_lengths++] = L;
        }
    }
    double t0 = kvs_now();
    struct kvs_engine *e = NULL;
    int rc = kvs_engine_create(cfg, model, probes->text ? tok : NULL, &e, err, errlen);
    if (rc) return rc;
    int batch = cfg->max_running < cfg->max_waiting ? cfg->max_running : cfg->max_waiting;
    if (batch < 1) batch = 1;
    struct job *jobs = kvs_xcalloc((size_t)batch, sizeof *jobs);
    for (int b0 = 0; b0 < probes->n && !rc; b0 += batch) {
        int nb = probes->n - b0 < batch ? probes->n - b0 : batch, submitted = 0;
        for (int j = 0; j < nb; j++) {
            const struct kvs_eval_probe *p = &probes->p[b0 + j];
            int n = p->n, off = 0;
            if (window > 0 && n > window) off = n - window, n = window;
            struct kvs_request_params rp;
            memset(&rp, 0, sizeof rp);
            rp.prompt = p->ids + off;
            rp.n_prompt = n;
            rp.max_tokens = probes->text ? TEXT_ANSWER_TOKENS : p->n_answer;
            rp.sampling.temperature = 0;
            rp.sampling.top_p = 1;
            rp.sampling.repetition_penalty = 1;
            rp.skip_special = 1;
            rp.ignore_eos = !probes->text;
            memset(&jobs[j], 0, sizeof jobs[j]);
            jobs[j].r = kvs_request_new(&rp, NULL, NULL);
            if (!jobs[j].r) {
                rc = kvs_err(err, errlen, -ENOMEM, "eval: cannot create a request");
                break;
            }
            submitted++;
            char serr[256] = "";
            if ((rc = kvs_engine_submit(e, jobs[j].r, serr, sizeof serr))) {
                kvs_err(err, errlen, rc, "eval: probe of %d tokens refused by the engine (%d): %s", n, rc, serr);
                break;
            }
        }
        for (int j = 0; j < submitted; j++) {
            if (!rc) {
                double tmo = probes->timeout_s > 0 ? probes->timeout_s : 600.0;
                int crc = collect(&jobs[j], tmo);
                if (crc == -ETIMEDOUT) {
                    rc = kvs_err(err, errlen, crc, "eval: probe failed: no answer within %.0f s (--probe-timeout; "
                                 "fewer at once: --set scheduler.max_running=N)", tmo);
                } else if (crc) {
                    rc = kvs_err(err, errlen, crc, "eval: probe failed: %s", jobs[j].error);
                } else {
                    const struct kvs_eval_probe *p = &probes->p[b0 + j];
                    int ok;
                    if (probes->text) {
                        ok = text_matches(jobs[j].text.s ? jobs[j].text.s : "", p->answer_text);
                    } else {
                        ok = jobs[j].n_gen >= p->n_answer &&
                             !memcmp(jobs[j].gen, p->answer_ids, (size_t)p->n_answer * sizeof(int32_t));
                    }
                    int li = 0;
                    while (res->lengths[li] != p->length) li++;
                    res->total[li]++;
                    res->correct[li] += ok;
                    res->fmt_total[li][p->format]++;
                    res->fmt_correct[li][p->format] += ok;
                    if (!res->example[0] && probes->text)
                        snprintf(res->example, sizeof res->example, "want \"%s\", got \"%s\"", p->answer_text,
                                 jobs[j].text.s ? jobs[j].text.s : "");
                }
            }
            if (rc) kvs_request_cancel(jobs[j].r);
            kvs_request_unref(jobs[j].r);
            free(jobs[j].text.s);
        }
    }
    struct kvs_engine_stats st;
    kvs_engine_stats(e, &st);
    kvs_eval_counters_init(&res->counters, 0);
    kvs_eval_counters_from_engine(&res->counters, &st);
    kvs_engine_free(e);
    free(jobs);
    res->seconds = kvs_now() - t0;
    return rc;
}
