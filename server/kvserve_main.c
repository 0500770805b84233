/* kvserve_main.c: the kvserve command line.
 *
 *   kvserve [--config FILE] [--set key=value]... [--model DIR] [--host H] [--port N] [--device D]
 *       serve the OpenAI API (the default command)
 *   kvserve --check-config FILE [--set key=value]...
 *       validate a config and print the effective config (exit 1 on any error)
 *   kvserve --help | --help-config [--markdown] | --version
 *
 * Config precedence: built-in defaults < --config FILE < named flags and --set, in order given.
 * Exit codes: 0 success, 1 bad config or runtime failure, 2 bad usage.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/config.h"
#include "engine/generate.h"
#include "base/util.h"
#include "engine/text/tokenizer.h"
#include "models/model.h"
#include "server/server.h"


static void usage(FILE *f)
{
    fprintf(f,
            "usage: kvserve [--config FILE] [--set key=value]... [--model DIR] [--host HOST] [--port N]\n"
            "               [--device auto|cpu|cuda]           serve the OpenAI API\n"
            "       kvserve --check-config FILE [--set ...]    validate the config and the model, print the config\n"
            "       kvserve generate --model DIR --prompt TEXT -n N [sampling flags]\n"
            "                                                  one prompt, no server (see kvserve generate --help)\n"
            "       kvserve --help-config [--markdown]         list every config key\n"
            "       kvserve --version\n");
}

/* Maps a named flag to its config key; NULL if flag is not one. */
static const char *named_flag_key(const char *flag)
{
    static const char *const map[][2] = {
        {"--model", "model.path"}, {"--host", "server.host"},  {"--port", "server.port"},
        {"--device", "device"},    {"--threads", "cpu_threads"}, {"--api-key", "server.api_key"},
    };
    for (size_t i = 0; i < sizeof map / sizeof map[0]; i++)
        if (!strcmp(flag, map[i][0])) return map[i][1];
    return NULL;
}

int main(int argc, char **argv)
{
    struct kvs_config cfg;
    char err[512];
    const char *check_file = NULL;
    int rc = 0;

    if (argc > 1 && !strcmp(argv[1], "generate")) return kvs_generate_main(argc - 1, argv + 1);
    if (argc > 1 && (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h"))) {
        usage(stdout);
        return 0;
    }
    if (argc > 1 && !strcmp(argv[1], "--version")) {
        printf("kvserve %s (cuda %s)\n", KVS_VERSION, KVS_HAVE_CUDA ? "built in" : "not built");
        return 0;
    }
    if (argc > 1 && !strcmp(argv[1], "--help-config")) {
        kvs_config_print_reference(stdout, argc > 2 && !strcmp(argv[2], "--markdown"));
        return 0;
    }

    kvs_config_init(&cfg);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *key;
        if (i + 1 >= argc && (!strcmp(a, "--config") || !strcmp(a, "--check-config") || !strcmp(a, "--set") ||
                              named_flag_key(a))) {
            fprintf(stderr, "kvserve: %s needs a value\n", a);
            usage(stderr);
            rc = 2;
            goto out;
        }
        if (!strcmp(a, "--config") || !strcmp(a, "--check-config")) {
            if (!strcmp(a, "--check-config")) check_file = argv[i + 1];
            rc = kvs_config_load_file(&cfg, argv[++i], err, sizeof err);
        } else if (!strcmp(a, "--set")) {
            rc = kvs_config_set(&cfg, argv[++i], err, sizeof err);
        } else if ((key = named_flag_key(a))) {
            char assign[1024];
            snprintf(assign, sizeof assign, "%s=%s", key, argv[++i]);
            rc = kvs_config_set(&cfg, assign, err, sizeof err);
        } else {
            fprintf(stderr, "kvserve: unknown argument '%s'\n", a);
            usage(stderr);
            rc = 2;
            goto out;
        }
        if (rc) {
            fprintf(stderr, "kvserve: %s\n", err);
            rc = 1;
            goto out;
        }
    }
    if (kvs_config_validate(&cfg, err, sizeof err)) {
        fprintf(stderr, "kvserve: %s\n", err);
        rc = 1;
        goto out;
    }
    if (check_file) {
        struct kvs_model *m = NULL;
        struct kvs_tokenizer *t = NULL;
        if (kvs_server_load_model(&cfg, &m, &t, err, sizeof err)) {
            fprintf(stderr, "kvserve: %s\n", err);
            rc = 1;
            goto out;
        }
        kvs_tokenizer_free(t);
        kvs_model_free(m);
        char *dump = kvs_config_dump_json(&cfg);
        printf("%s\n", dump);
        free(dump);
        fprintf(stderr, "kvserve: %s: config OK\n", check_file);
        goto out;
    }
    rc = kvs_server_run(&cfg) == 0 ? 0 : 1;
out:
    kvs_config_free(&cfg);
    return rc;
}
