/* conn_limits.c: connection caps and timeouts (see conn_limits.h for the policy). */
#include "server/conn_limits.h"

#include "engine/config.h"

#include <string.h>

void kvs_conn_options(const struct kvs_config *cfg, struct MHD_OptionItem *out)
{
    int n = 0;
    /* whole seconds (MHD's unit); never 0, which would mean "no timeout" */
    unsigned idle = cfg->idle_timeout_s >= 1 ? (unsigned)(cfg->idle_timeout_s + 0.5) : 1;
    out[n++] = (struct MHD_OptionItem){MHD_OPTION_CONNECTION_TIMEOUT, (intptr_t)idle, NULL};
    out[n++] = (struct MHD_OptionItem){MHD_OPTION_CONNECTION_LIMIT,
                                       (intptr_t)((unsigned)cfg->max_connections + (unsigned)cfg->reserved_connections),
                                       NULL};
    if (cfg->max_connections_per_client > 0)
        out[n++] = (struct MHD_OptionItem){MHD_OPTION_PER_IP_CONNECTION_LIMIT,
                                           (intptr_t)(unsigned)cfg->max_connections_per_client, NULL};
    out[n] = (struct MHD_OptionItem){MHD_OPTION_END, 0, NULL};
}

int kvs_conn_is_probe(const char *url)
{
    return !strcmp(url, "/health") || !strcmp(url, "/metrics") || !strcmp(url, "/ping") || !strcmp(url, "/version");
}

int kvs_conn_over_limit(struct MHD_Daemon *d, const struct kvs_config *cfg)
{
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(d, MHD_DAEMON_INFO_CURRENT_CONNECTIONS);
    return di && di->num_connections > (unsigned)cfg->max_connections;
}
