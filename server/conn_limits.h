/* conn_limits.h: how many connections the daemon holds, for how long, and for whom.
 *
 * Policy (server/API.md "Connections"): libmicrohttpd enforces what it can on its own, before a
 * request is parsed: an inactivity timeout per connection (server.idle_timeout_s:
 * MHD_OPTION_CONNECTION_TIMEOUT; a connection suspended while it waits on the engine is not
 * timed out), a cap per client address (server.max_connections_per_client:
 * MHD_OPTION_PER_IP_CONNECTION_LIMIT; the connection is closed at accept) and a total
 * (MHD_OPTION_CONNECTION_LIMIT = server.max_connections + server.reserved_connections). The
 * reserve is ours: once more than server.max_connections are open, only the probe routes
 * (/health, /metrics, /ping, /version) are served; anything else gets 503 and the connection
 * is closed, so a flood of idle clients cannot lock the probes out.
 *
 * Ownership: no state of its own. kvs_conn_options fills caller storage. All calls run on the
 * libuv loop thread. Errors: none (pure functions over the config and MHD's counters).
 */
#ifndef KVS_SERVER_CONN_LIMITS_H
#define KVS_SERVER_CONN_LIMITS_H

#include <microhttpd.h>

struct kvs_config;

/* MHD options for the limits above, ending with MHD_OPTION_END; out needs 5 entries. */
void kvs_conn_options(const struct kvs_config *cfg, struct MHD_OptionItem *out);
/* 1 for the routes served from the reserve (health checks and scrapes). */
int kvs_conn_is_probe(const char *url);
/* 1 when more than server.max_connections connections are open on d. */
int kvs_conn_over_limit(struct MHD_Daemon *d, const struct kvs_config *cfg);

#endif
