/* test_generate.c: `kvserve generate` (kvs_generate_main) end to end on the tiny Llama: greedy
 * output equals transformers' greedy continuation (stopping at the model's EOS ids, or all 32
 * with --ignore-eos), seeded sampling repeats, and bad usage exits 2 with a message. stdout is
 * captured through a temp file. */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "engine/generate.h"
#include "base/util.h"
#include "models/model.h"
#include "tests/unit/test_util.h"


/* runs generate with argv, returns its exit code and its stdout in out */
static int run(char **argv, char *out, size_t cap)
{
    int argc = 0;
    while (argv[argc]) argc++;
    char path[] = "/tmp/kvs_test_generate_XXXXXX";
    int fd = mkstemp(path);
    KVS_ASSERT(fd >= 0);
    fflush(stdout);
    int saved = dup(1);
    KVS_ASSERT(saved >= 0 && dup2(fd, 1) == 1);
    int rc = kvs_generate_main(argc, argv);
    fflush(stdout);
    KVS_ASSERT(dup2(saved, 1) == 1);
    close(saved);
    ssize_t n = pread(fd, out, cap - 1, 0);
    out[n > 0 ? n : 0] = 0;
    close(fd);
    unlink(path);
    return rc;
}

int main(void)
{
    const char *root = kvs_test_root();
    kvs_log_set_level(KVS_LOG_WARN);
    char dir[1024], refp[1100], err[256];
    snprintf(dir, sizeof dir, "%s/tests/data/models/llama", root);
    snprintf(refp, sizeof refp, "%s/reference.json", dir);
    char *js = kvs_read_file(refp, NULL, err, sizeof err);
    if (!js) {
        printf("cannot read %s: %s\n", refp, err);
        return 1;
    }
    cJSON *ref = cJSON_Parse(js);
    free(js);
    KVS_ASSERT(ref);
    struct kvs_model_config mc;
    KVS_ASSERT(kvs_model_config_load(dir, &mc, err, sizeof err) == 0);

    cJSON *p;
    int checked = 0;
    cJSON_ArrayForEach(p, cJSON_GetObjectItem(ref, "prompts"))
    {
        char ids[4096] = "", want_eos[4096] = "", want_all[4096] = "", out[8192];
        cJSON *t;
        cJSON_ArrayForEach(t, cJSON_GetObjectItem(p, "prompt"))
        {
            size_t l = strlen(ids);
            snprintf(ids + l, sizeof ids - l, "%s%d", l ? "," : "", t->valueint);
        }
        int stopped = 0;
        cJSON_ArrayForEach(t, cJSON_GetObjectItem(p, "greedy"))
        {
            for (int i = 0; i < mc.n_eos; i++) stopped |= t->valueint == mc.eos_token_ids[i];
            size_t l = strlen(want_all);
            snprintf(want_all + l, sizeof want_all - l, "%s%d", l ? " " : "", t->valueint);
            if (!stopped) {
                l = strlen(want_eos);
                snprintf(want_eos + l, sizeof want_eos - l, "%s%d", l ? " " : "", t->valueint);
            }
        }
        strcat(want_eos, "\n");
        strcat(want_all, "\n");
        char *a1[] = {"generate", "--model", dir, "--prompt-ids", ids, "-n", "32", "--temperature", "0",
                      "--threads", "2", "--prefill-chunk", "5", NULL};
        int rc = run(a1, out, sizeof out);
        CHECK(rc == 0 && strcmp(out, want_eos) == 0, "greedy (stop at eos): rc %d\n got  %s want %s", rc, out,
              want_eos);
        char *a2[] = {"generate", "--model", dir, "--prompt-ids", ids, "-n", "32", "--temperature", "0",
                      "--ignore-eos", NULL};
        rc = run(a2, out, sizeof out);
        CHECK(rc == 0 && strcmp(out, want_all) == 0, "greedy --ignore-eos: rc %d\n got  %s want %s", rc, out,
              want_all);
        checked++;
    }
    printf("ok greedy CLI output = transformers for %d prompts (eos stop and --ignore-eos)\n", checked);

    char o1[8192], o2[8192], o3[8192];
    char *s1[] = {"generate", "--model", dir, "--prompt-ids", "5,6,7", "-n", "24", "--seed", "7",
                  "--top-p", "0.9", "--ignore-eos", NULL};
    char *s2[] = {"generate", "--model", dir, "--prompt-ids", "5,6,7", "-n", "24", "--seed", "8",
                  "--top-p", "0.9", "--ignore-eos", NULL};
    CHECK(run(s1, o1, sizeof o1) == 0 && run(s1, o2, sizeof o2) == 0 && run(s2, o3, sizeof o3) == 0, "sampling runs");
    CHECK(strcmp(o1, o2) == 0, "same seed, different output:\n%s%s", o1, o2);
    CHECK(strcmp(o1, o3) != 0, "different seeds, same output: %s", o1);
    printf("ok seeded sampling repeats\n");

    /* the model, device, threads and block size can come from config overrides */
    char setm[1200];
    snprintf(setm, sizeof setm, "model.path=%s", dir);
    char *c1[] = {"generate", "--set", setm, "--set", "kv.block_size=4", "--set", "cpu_threads=3", "--prompt-ids",
                  "5,6,7", "-n", "24", "--seed", "7", "--top-p", "0.9", "--ignore-eos", NULL};
    CHECK(run(c1, o3, sizeof o3) == 0 && strcmp(o1, o3) == 0, "config overrides changed the output:\n%s%s", o1, o3);
    printf("ok model/threads/block size from --set, same tokens\n");

    char *bad[][12] = {
        {"generate", "--model", dir, "--prompt-ids", "1", "--prompt", "hi", NULL},
        {"generate", "--model", dir, NULL},
        {"generate", "--model", dir, "--prompt-ids", "1,x", NULL},
        {"generate", "--model", dir, "--prompt-ids", "1", "-n", "0", NULL},
        {"generate", "--model", dir, "--prompt-ids", "1", "--bogus", "1", NULL},
        {"generate", "--model", dir, "--prompt-ids", "1024", NULL},
        {"generate", "--model", dir, "--prompt-ids", "1", "--top-p", "0", NULL},
        {"generate", "--model", dir, "--prompt-ids", "1", "-n", NULL},
        {"generate", "--model", dir, "--prompt-ids", "1", "--set", "no.such.key=1", NULL},
        {"generate", "--model", dir, "--prompt-ids", "1", "--config", "/nonexistent.json", NULL},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char out[1024];
        int rc = run(bad[i], out, sizeof out);
        CHECK(rc == 2, "bad usage case %zu exited %d, want 2", i, rc);
    }
    char *nodir[] = {"generate", "--model", "/nonexistent", "--prompt-ids", "1", NULL};
    CHECK(run(nodir, o1, sizeof o1) == 1, "missing model dir should exit 1");
    printf("ok bad usage exits 2, runtime errors 1\n");
    cJSON_Delete(ref);
    return kvs_test_summary("test_generate");
}
