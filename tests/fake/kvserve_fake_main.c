/* kvserve_fake_main.c: build/kvserve-fake: the real HTTP server (kvs_server_run) over the test
 * doubles in fake_backend.c, for the HTTP tests. Flags set the config fields the server reads:
 *   --model DIR --port N --host H --api-key K --max-body N --max-connections N
 *   --timeout S --grace S --keepalive S --max-waiting N --max-running N --max-model-len N
 *   --max-tokens-default N --documents-dir DIR --documents-max N --documents-max-tokens N
 *   --served-name NAME --quiet (no access log)
 * The real daemon is build/kvserve (server/kvserve_main.c + config.c).
 */
#include "server/server.h"

#include "engine/config.h"
#include "engine/util.h"

#include <stdio.h>
#include <string.h>

#include "tests/fake/fake_backend.c"

int main(int argc, char **argv)
{
    struct kvs_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.model_path = "tests/fake";
    cfg.model_name = "";
    cfg.chat_format = "auto";
    cfg.host = "127.0.0.1";
    cfg.port = 8000;
    cfg.api_key = "";
    cfg.max_body_bytes = 1 << 20;
    cfg.max_connections = 256;
    cfg.request_timeout_s = 0;
    cfg.shutdown_grace_s = 10;
    cfg.sse_keepalive_s = 15;
    cfg.access_log = 1;
    cfg.max_waiting = 256;
    cfg.max_running = 64;
    cfg.max_model_len = 256;
    cfg.documents_dir = "";
    cfg.documents_max_count = 64;
    cfg.documents_max_tokens = 128;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
#define OPT(name) (!strcmp(a, name) && v && ++i)
        if (OPT("--model")) cfg.model_path = (char *)v;
        else if (OPT("--port")) cfg.port = atoi(v);
        else if (OPT("--host")) cfg.host = (char *)v;
        else if (OPT("--api-key")) cfg.api_key = (char *)v;
        else if (OPT("--max-body")) cfg.max_body_bytes = atoll(v);
        else if (OPT("--max-connections")) cfg.max_connections = atoi(v);
        else if (OPT("--timeout")) cfg.request_timeout_s = atof(v);
        else if (OPT("--grace")) cfg.shutdown_grace_s = atof(v);
        else if (OPT("--keepalive")) cfg.sse_keepalive_s = atof(v);
        else if (OPT("--max-waiting")) cfg.max_waiting = atoi(v);
        else if (OPT("--max-running")) cfg.max_running = atoi(v);
        else if (OPT("--max-model-len")) cfg.max_model_len = atoi(v);
        else if (OPT("--max-tokens-default")) cfg.max_tokens_default = atoi(v);
        else if (OPT("--documents-dir")) cfg.documents_dir = (char *)v;
        else if (OPT("--documents-max")) cfg.documents_max_count = atoi(v);
        else if (OPT("--documents-max-tokens")) cfg.documents_max_tokens = atoi(v);
        else if (OPT("--served-name")) cfg.model_name = (char *)v;
        else if (!strcmp(a, "--quiet")) cfg.access_log = 0;
        else {
            fprintf(stderr, "kvserve-fake: unknown or incomplete option '%s'\n", a);
            return 2;
        }
#undef OPT
    }
    return kvs_server_run(&cfg);
}
