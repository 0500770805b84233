/* kvserve_e2e_main.c: build/kvserve-e2e: kvs_server_run over the real model, tokenizer and
 * engine, with the test daemons' flags (tests/fake/daemon_opts.h). It exists so the HTTP layer's
 * end-to-end tests (tests/py/test_http_e2e.py) run against the real stack; build/kvserve is the
 * product binary (server/kvserve_main.c). */
#include "engine/config.h"
#include "server/server.h"
#include "tests/fake/daemon_opts.h"

int main(int argc, char **argv)
{
    struct kvs_config cfg;
    kvs_config_init(&cfg);
    static const char *const defaults[] = {"device=cpu", "server.shutdown_grace_s=10"};
    int rc = daemon_opts_apply(&cfg, defaults, (int)(sizeof defaults / sizeof *defaults), argc, argv, "kvserve-e2e");
    if (!rc) rc = kvs_server_run(&cfg);
    kvs_config_free(&cfg);
    return rc;
}
