/* eval_policies.c: kvserve-eval --all-policies: every decode policy the registry has built
 * (engine/kv/kv.c) against full attention on the same inputs, one row each: teacher-forced
 * perplexity, KL and top-1 agreement, retrieval accuracy per length, and the KV bytes each
 * read per decode step against full. A policy the config's other slots do not compose with is
 * listed with the registry's reason instead. full itself is the first row: KL 0, top-1 100%. */
#include "tools/eval.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/util.h"
#include "engine/config.h"
#include "engine/kv/kv.h"

int kvs_eval_all_policies(const struct kvs_config *base, const struct kvs_config *ref, const struct kvs_model *model,
                          const struct kvs_tokenizer *tok, const int32_t *tokens, int n_tokens,
                          const struct kvs_eval_tf_opts *o, const struct kvs_eval_probes *probes, int do_tf,
                          int do_ret, char *err, size_t errlen)
{
    const char *names[32];
    int n_failed = 0;
    int n = kvs_kv_names("decode", names, 32);
    if (n > 32) n = 32;
    struct kvs_eval_retrieval_result rr_ref;
    memset(&rr_ref, 0, sizeof rr_ref);
    if (do_ret) {
        int rc = kvs_eval_retrieval(ref, model, tok, probes, 0, &rr_ref, err, errlen);
        if (rc) return rc;
    }
    printf("kvserve-eval --all-policies: model %s; reference storage=auto reuse=none decode=full\n\n", base->model_path);
    printf("  %-12s %10s %12s %9s %14s", "decode", "ppl", "KL mean", "top-1", "KV read/full");
    for (int l = 0; do_ret && l < rr_ref.n_lengths; l++) printf("  ret@%-6d", rr_ref.lengths[l]);
    printf("\n");
    if (do_tf) printf("  %-12s %10s %12s %9s %14s", "(reference)", "", "", "", "");
    for (int l = 0; do_ret && l < rr_ref.n_lengths; l++)
        printf("  %9.1f%%", 100.0 * rr_ref.correct[l] / (rr_ref.total[l] ? rr_ref.total[l] : 1));
    printf("\n");
    for (int i = 0; i < n; i++) {
        if (!kvs_kv_find_decode(names[i])) {
            printf("  %-12s not built in this version\n", names[i]);
            continue;
        }
        struct kvs_config c;
        kvs_config_init(&c);
        char set[96], why[256] = "";
        /* a copy of the candidate's config through its JSON dump, with this policy */
        char *json = kvs_config_dump_json(base);
        int rc = json ? kvs_config_load_json(&c, json, "candidate", why, sizeof why) : -ENOMEM;
        free(json);
        snprintf(set, sizeof set, "kv.decode=%s", names[i]);
        if (!rc) rc = kvs_config_set(&c, set, why, sizeof why);
        if (!rc) rc = kvs_config_validate(&c, why, sizeof why);
        if (rc) {
            printf("  %-12s refused: %s\n", names[i], why[0] ? why : err);
            kvs_config_free(&c);
            continue;
        }
        struct kvs_eval_tf_result tf;
        struct kvs_eval_retrieval_result rr;
        memset(&tf, 0, sizeof tf);
        memset(&rr, 0, sizeof rr);
        if (do_tf) rc = kvs_eval_teacher_forced(ref, &c, model, tokens, n_tokens, o, &tf, err, errlen);
        if (!rc && do_ret) rc = kvs_eval_retrieval(&c, model, tok, probes, 0, &rr, err, errlen);
        if (rc) {
            /* the engine refused or failed this policy for this model or backend (a head layout
             * its kernels do not take, a state budget): its row says why, the other policies
             * still run, and the call fails at the end */
            printf("  %-12s failed: %s\n", names[i], err);
            fflush(stdout);
            kvs_config_free(&c);
            n_failed++;
            continue;
        }
        kvs_config_free(&c);
        char rd[32] = "-";
        if (do_tf && tf.cfg.kv_read_known && tf.cfg.kv_bytes_full > 0)
            snprintf(rd, sizeof rd, "%.3f", tf.cfg.kv_bytes_read / tf.cfg.kv_bytes_full);
        else if (do_tf) snprintf(rd, sizeof rd, "not reported");
        if (do_tf) printf("  %-12s %10.4f %12.6f %8.2f%% %14s", names[i], tf.ppl_cfg, tf.kl_mean, 100 * tf.top1_agree, rd);
        else printf("  %-12s %10s %12s %9s %14s", names[i], "", "", "", "");
        for (int l = 0; do_ret && l < rr.n_lengths; l++)
            printf("  %9.1f%%", 100.0 * rr.correct[l] / (rr.total[l] ? rr.total[l] : 1));
        printf("\n");
        fflush(stdout);
    }
    if (n_failed) return kvs_err(err, errlen, -EIO, "%d of the policies failed (their rows say why)", n_failed);
    return 0;
}
