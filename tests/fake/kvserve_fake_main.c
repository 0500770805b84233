/* kvserve_fake_main.c: build/kvserve-fake: the real HTTP server (kvs_server_run) over the test
 * doubles in fake_backend.c, for the HTTP tests. Flags set the config fields the server reads:
 *   --model DIR --port N --host H --api-key K --max-body N --max-connections N
 *   --timeout S --grace S --keepalive S --max-waiting N --max-running N --max-model-len N
 *   --max-tokens-default N --documents-dir DIR --documents-max N --documents-max-tokens N
 *   --served-name NAME --quiet (no access log)
 *   --set key=value (any config key)
 * Defaults differ from kvserve's where tests need it (fake model dir, chatml, 256-token context).
 * The real daemon is build/kvserve (server/kvserve_main.c).
 */
#include "server/server.h"

#include "engine/config.h"
#include "engine/util.h"

#include <stdio.h>
#include <string.h>

#include "tests/fake/fake_backend.c"

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

int main(int argc, char **argv)
{
    struct kvs_config cfg;
    char err[512], assign[4096];
    kvs_config_init(&cfg);
    /* test defaults: the fake model dir, ChatML, a 256-token context, no request timeout */
    const char *defaults[] = {"model.path=tests/fake", "model.chat_format=chatml", "model.max_model_len=256",
                              "server.request_timeout_s=0", "server.shutdown_grace_s=10",
                              "documents.max_tokens=128"};
    for (size_t i = 0; i < sizeof defaults / sizeof *defaults; i++)
        if (kvs_config_set(&cfg, defaults[i], err, sizeof err)) {
            fprintf(stderr, "kvserve-fake: %s\n", err);
            return 2;
        }
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *key = NULL;
        if (!strcmp(a, "--quiet")) {
            if (kvs_config_set(&cfg, "server.access_log=false", err, sizeof err)) return 2;
            continue;
        }
        for (size_t k = 0; k < sizeof k_flags / sizeof *k_flags; k++)
            if (!strcmp(a, k_flags[k][0])) key = k_flags[k][1];
        if (!strcmp(a, "--set") && i + 1 < argc) {
            snprintf(assign, sizeof assign, "%s", argv[++i]);
        } else if (key && i + 1 < argc) {
            snprintf(assign, sizeof assign, "%s=%s", key, argv[++i]);
        } else {
            fprintf(stderr, "kvserve-fake: unknown or incomplete option '%s'\n", a);
            kvs_config_free(&cfg);
            return 2;
        }
        if (kvs_config_set(&cfg, assign, err, sizeof err)) {
            fprintf(stderr, "kvserve-fake: %s\n", err);
            kvs_config_free(&cfg);
            return 2;
        }
    }
    int rc = kvs_server_run(&cfg);
    kvs_config_free(&cfg);
    return rc;
}
