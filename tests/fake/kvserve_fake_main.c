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
#include "base/util.h"

#include <stdio.h>
#include <string.h>

#include "tests/fake/daemon_opts.h"
#include "tests/fake/fake_backend.c"

int main(int argc, char **argv)
{
    struct kvs_config cfg;
    kvs_config_init(&cfg);
    /* test defaults: the fake model dir, ChatML, a 256-token context, no request timeout */
    static const char *const defaults[] = {"model.path=tests/fake", "model.chat_format=chatml",
                                           "model.max_model_len=256", "server.request_timeout_s=0",
                                           "server.shutdown_grace_s=10", "documents.max_tokens=128"};
    int rc = daemon_opts_apply(&cfg, defaults, (int)(sizeof defaults / sizeof *defaults), argc, argv, "kvserve-fake");
    if (!rc) rc = kvs_server_run(&cfg);
    kvs_config_free(&cfg);
    return rc;
}
