/* daemon_opts.h: the command line of the test daemons (build/kvserve-fake, build/kvserve-e2e):
 * named flags mapped onto config keys, --set key=value, --quiet; applied with the config table
 * (engine/config.c) so values are validated exactly as kvserve validates them. Included by the
 * two *_main.c files only. */
#ifndef KVS_TESTS_DAEMON_OPTS_H
#define KVS_TESTS_DAEMON_OPTS_H

#include <stdio.h>
#include <string.h>

#include "engine/config.h"

static const char *const k_flags[][2] = {
    {"--model", "model.path"},
    {"--port", "server.port"},
    {"--host", "server.host"},
    {"--api-key", "server.api_key"},
    {"--max-body", "server.max_body_bytes"},
    {"--max-connections", "server.max_connections"},
    {"--timeout", "server.request_timeout_s"},
    {"--grace", "server.shutdown_grace_s"},
    {"--keepalive", "server.sse_keepalive_s"},
    {"--max-waiting", "scheduler.max_waiting"},
    {"--max-running", "scheduler.max_running"},
    {"--max-model-len", "model.max_model_len"},
    {"--max-tokens-default", "scheduler.max_tokens_default"},
    {"--documents-dir", "documents.dir"},
    {"--documents-max", "documents.max_count"},
    {"--documents-max-tokens", "documents.max_tokens"},
    {"--served-name", "model.name"},
};

/* Applies defaults (key=value strings) then argv. Returns 0, or 2 (usage error, message printed). */
static int daemon_opts_apply(struct kvs_config *cfg, const char *const *defaults, int n_defaults, int argc,
                             char **argv, const char *prog)
{
    char err[512], assign[4096];
    for (int i = 0; i < n_defaults; i++)
        if (kvs_config_set(cfg, defaults[i], err, sizeof err)) {
            fprintf(stderr, "%s: %s\n", prog, err);
            return 2;
        }
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *key = NULL;
        if (!strcmp(a, "--quiet")) {
            if (kvs_config_set(cfg, "server.access_log=false", err, sizeof err)) return 2;
            continue;
        }
        for (size_t k = 0; k < sizeof k_flags / sizeof *k_flags; k++)
            if (!strcmp(a, k_flags[k][0])) key = k_flags[k][1];
        if (!strcmp(a, "--set") && i + 1 < argc) {
            snprintf(assign, sizeof assign, "%s", argv[++i]);
        } else if (key && i + 1 < argc) {
            snprintf(assign, sizeof assign, "%s=%s", key, argv[++i]);
        } else {
            fprintf(stderr, "%s: unknown or incomplete option '%s'\n", prog, a);
            return 2;
        }
        if (kvs_config_set(cfg, assign, err, sizeof err)) {
            fprintf(stderr, "%s: %s\n", prog, err);
            return 2;
        }
    }
    return 0;
}

#endif
