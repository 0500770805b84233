/* server.c: the daemon's event loop: libmicrohttpd in external-select epoll mode driven by libuv.
 *
 * Threads: the libuv loop owns this thread and every struct call. The loader thread builds the
 * model/tokenizer/engine once and reports through an async handle. The engine thread only
 * calls engine_notify (uv_async_send); the loop then drains every active request's events,
 * formats SSE chunks or the final JSON, and resumes suspended connections. Nothing here waits
 * on the engine.
 *
 * Connection lifecycle (struct call, one per HTTP request): created on the first access-handler
 * call, body accumulated (bounded), then dispatched. Generation requests are submitted to the
 * engine and the connection is suspended: non-streaming until every choice is done, streaming
 * whenever the SSE buffer runs dry (the content reader suspends itself). The call is freed in
 * the request-completed callback, which also cancels unfinished engine requests (client gone).
 * Suspended connections do not see disconnects, so a 250 ms tick peeks their sockets.
 */
#include "server/server.h"

#include "engine/text/chat.h"
#include "engine/config.h"
#include "engine/engine.h"
#include "engine/engine_exec.h"
#include "engine/text/tokenizer.h"
#include "base/util.h"
#include "models/model.h"
#include "engine/docstore.h"
#include "server/conn_limits.h"
#include "server/handlers.h"
#include "server/metrics.h"
#include "server/request_parse.h"

#include <microhttpd.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <errno.h>
#include <uv.h>

static void run_mhd(struct kvs_server *s);

/* ------------------------------------------------------------------------------------------ */
/* loading                                                                                     */

/* A model directory without tokenizer.json (random-weight benchmark models from
 * scripts/make-random-model.py, the tiny test models) is served by token ids: *tok stays NULL,
 * prompts must be token-id arrays, and every text input is refused with a 400 that says so
 * (kvs_server_no_tokenizer). A tokenizer.json that exists but does not load is still an error. */
static int load_tokenizer(const struct kvs_config *cfg, struct kvs_tokenizer **tok, char *err, size_t errlen)
{
    char why[480];
    int rc = kvs_tokenizer_load(cfg->model_path, tok, why, sizeof why);
    if (rc == -ENOENT) {
        char path[4096];
        struct stat st;
        int n = snprintf(path, sizeof path, "%s/tokenizer.json", cfg->model_path);
        if (n > 0 && n < (int)sizeof path && stat(cfg->model_path, &st) == 0 && S_ISDIR(st.st_mode) &&
            stat(path, &st) != 0 && errno == ENOENT) {
            kvs_log(KVS_LOG_INFO, "model.path '%s' has no tokenizer.json: serving token ids only "
                                  "(prompts must be arrays of token ids; text is refused)", cfg->model_path);
            *tok = NULL;
            return 0;
        }
    }
    return rc ? kvs_err(err, errlen, rc, "model.path '%s': %s", cfg->model_path, why) : 0;
}


int kvs_server_load_model(const struct kvs_config *cfg, struct kvs_model **model, struct kvs_tokenizer **tok,
                           char *err, size_t errlen)
{
    char why[480];
    int rc = kvs_model_load(cfg->model_path, model, why, sizeof why);
    if (rc) return kvs_err(err, errlen, rc, "model.path '%s': %s", cfg->model_path, why);
    rc = load_tokenizer(cfg, tok, err, errlen);
    if (rc) {
        kvs_model_free(*model);
        *model = NULL;
    }
    return rc;
}

/* The engine (weights to the device, KV pool): the slow part, after the port is open. The
 * model's files were already checked (kvs_server_load_model) before listening. */
static void *loader_main(void *arg)
{
    struct kvs_server *s = arg;
    const struct kvs_config *cfg = s->cfg;
    double t0 = kvs_now();
    int rc;
    if (s->make_exec) {
        struct kvs_engine_exec x;
        memset(&x, 0, sizeof x);
        rc = s->make_exec(cfg, s->tok, &x, s->load_err, sizeof s->load_err);
        if (!rc) {
            s->vocab_size = x.vocab_size;
            rc = kvs_engine_create_exec(cfg, &x, &s->engine, s->load_err, sizeof s->load_err);
            if (rc && x.destroy) x.destroy(x.ctx);   /* server.h: ours once make_exec succeeded */
        }
    } else {
        rc = kvs_engine_create(cfg, s->model, s->tok, &s->engine, s->load_err, sizeof s->load_err);
    }
    if (!rc) {
        if (s->tok) s->vocab_size = kvs_tokenizer_vocab_size(s->tok);
        else if (s->model) s->vocab_size = kvs_model_config(s->model)->vocab_size;
        s->max_context = kvs_engine_max_context(s->engine);
        kvs_log(KVS_LOG_INFO, "loaded %s in %.2fs (max context %d tokens, vocab %d)", s->model_name,
                kvs_now() - t0, s->max_context, s->vocab_size);
    }
    s->load_rc = rc;
    uv_async_send(&s->load_async);
    return NULL;
}

static void begin_shutdown(struct kvs_server *s);
static void finish_shutdown(struct kvs_server *s);

static void on_loaded(uv_async_t *h)
{
    struct kvs_server *s = h->data;
    s->load_finished = 1;
    if (s->load_rc) {
        kvs_log(KVS_LOG_ERROR, "loading failed: %s", s->load_err);
        s->exit_code = 1;
        s->state = KVS_SRV_DRAINING;
        finish_shutdown(s);
        return;
    }
    s->loaded = 1;
    if (s->state == KVS_SRV_LOADING) {
        s->state = KVS_SRV_SERVING;
        kvs_log(KVS_LOG_INFO, "serving on http://%s:%d", s->cfg->host, s->port);
        return;
    }
    /* a signal arrived while loading: nothing was admitted, so stop now */
    kvs_engine_drain(s->engine);
    finish_shutdown(s);
}

/* ------------------------------------------------------------------------------------------ */
/* libmicrohttpd <-> libuv                                                                     */

static void on_mhd_timer(uv_timer_t *t)
{
    run_mhd(t->data);
}

static void on_mhd_poll(uv_poll_t *p, int status, int events)
{
    (void)status;
    (void)events;
    run_mhd(p->data);
}

/* Runs MHD once, then re-arms the timer with MHD's own timeout. */
static void run_mhd(struct kvs_server *s)
{
    if (!s->mhd) return;
    MHD_run(s->mhd);
    if (!s->mhd) return;
    /* MHD's own timeout, capped: when connections close below the connection limit MHD re-arms
     * its listening socket only inside MHD_run, and no epoll event announces that moment */
    MHD_UNSIGNED_LONG_LONG ms = 0;
    if (MHD_get_timeout(s->mhd, &ms) != MHD_YES || ms > 200) ms = 200;
    uv_timer_start(&s->mhd_timer, on_mhd_timer, ms, 0);
}

static void engine_notify(void *user)
{
    struct kvs_server *s = user;
    uv_async_send(&s->wake_async);
}

void kvs_server_resume(struct kvs_server *s, struct call *c)
{
    if (c->suspended) {
        c->suspended = 0;
        MHD_resume_connection(c->conn);
        s->need_run = 1;
    }
}

static void pump_all(struct kvs_server *s)
{
    for (struct call *c = s->calls; c; c = c->next) kvs_call_pump(s, c);
    if (s->need_run) {
        s->need_run = 0;
        run_mhd(s);
    }
    if (s->state == KVS_SRV_DRAINING && s->n_gen_calls == 0 && s->load_finished) finish_shutdown(s);
}

static void on_wake(uv_async_t *h)
{
    pump_all(h->data);
}

/* Peeks a suspended connection's socket: 1 when the client closed it. */
static int client_gone(struct call *c)
{
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c->conn, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (!ci) return 0;
    char b;
    ssize_t n = recv(ci->connect_fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n == 0) return 1;
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return 1;
    return 0;
}

static void on_tick(uv_timer_t *t)
{
    struct kvs_server *s = t->data;
    double now = kvs_now();
    for (struct call *c = s->calls; c; c = c->next) {
        if (!c->n_choices || c->finished) continue;
        if (c->suspended && !c->client_gone && client_gone(c)) {
            c->client_gone = 1;
            kvs_log(KVS_LOG_DEBUG, "client of %s went away; cancelling", c->id);
            kvs_call_cancel(c);
            /* resumed, MHD notices the closed socket and completes the request (aborted) */
            kvs_server_resume(s, c);
        }
        if (c->stream && c->headers_sent && s->cfg->sse_keepalive_s > 0 &&
            now - c->last_write >= s->cfg->sse_keepalive_s) {
            kvs_sbuf_printf(&c->out, ": keep-alive\n\n");
            c->last_write = now;
            kvs_server_resume(s, c);
        }
    }
    pump_all(s);
}

/* ------------------------------------------------------------------------------------------ */
/* shutdown                                                                                    */

static void on_signal(uv_signal_t *h, int signum)
{
    struct kvs_server *s = h->data;
    if (s->state == KVS_SRV_DRAINING) {
        kvs_log(KVS_LOG_WARN, "second signal %d: stopping now", signum);
        s->stop_now = 1;
        finish_shutdown(s);
        return;
    }
    kvs_log(KVS_LOG_INFO, "signal %d: draining (grace %.1fs)", signum, s->cfg->shutdown_grace_s);
    begin_shutdown(s);
}

static void on_grace(uv_timer_t *t)
{
    struct kvs_server *s = t->data;
    if (s->n_gen_calls > 0) kvs_log(KVS_LOG_WARN, "grace period over: cancelling %d requests", s->n_gen_calls);
    /* cut streams still end like streams (error chunk, [DONE]); finish_shutdown lets them flush */
    for (struct call *c = s->calls; c; c = c->next)
        kvs_call_cut(s, c, "the server is shutting down: the stream was cut at the end of the grace period");
    pump_all(s);
    finish_shutdown(s);
}

static void on_flush_wait(uv_timer_t *t)
{
    run_mhd(t->data);
    finish_shutdown(t->data);
}

/* 1 while a finished or cut stream still has bytes for its client, for at most
 * KVS_SHUTDOWN_FLUSH_S: the last chunks and data: [DONE] must reach the client before the
 * daemon closes the sockets. */
#define KVS_SHUTDOWN_FLUSH_S 2.0
static int streams_flushing(struct kvs_server *s)
{
    double now = kvs_now();
    if (s->flush_until == 0) s->flush_until = now + KVS_SHUTDOWN_FLUSH_S;
    if (now >= s->flush_until) return 0;
    for (struct call *c = s->calls; c; c = c->next)
        if (((c->stream && c->headers_sent) || c->cut) && !c->client_gone && !c->aborting) return 1;
    return 0;
}

static void begin_shutdown(struct kvs_server *s)
{
    int was_loading = s->state == KVS_SRV_LOADING;
    s->state = KVS_SRV_DRAINING;
    if (s->engine) kvs_engine_drain(s->engine);
    uv_timer_start(&s->grace_timer, on_grace, (uint64_t)(s->cfg->shutdown_grace_s * 1000.0), 0);
    if (!was_loading && s->n_gen_calls == 0) finish_shutdown(s);
}

static void close_cb(uv_handle_t *h)
{
    (void)h;
}

static void finish_shutdown(struct kvs_server *s)
{
    if (s->stopping) return;
    /* while the loader runs the engine may still appear: on_loaded calls us again */
    if (s->loader_started && !s->load_finished) return;
    if (!s->stop_now && streams_flushing(s)) {
        uv_timer_start(&s->grace_timer, on_flush_wait, 20, 0);
        return;
    }
    s->stopping = 1;
    /* cancel and release every suspended connection so MHD can close them */
    for (struct call *c = s->calls; c; c = c->next) {
        kvs_call_cancel(c);
        c->aborting = 1;
        if (c->suspended) {
            c->suspended = 0;
            MHD_resume_connection(c->conn);
        }
    }
    if (s->mhd) {
        MHD_run(s->mhd);
        MHD_stop_daemon(s->mhd);   /* runs the completion callback for every open request */
        s->mhd = NULL;
    }
    uv_stop(s->loop);
}

/* ------------------------------------------------------------------------------------------ */
/* MHD callbacks                                                                               */

static struct MHD_Daemon *conn_daemon(struct MHD_Connection *conn)
{
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(conn, MHD_CONNECTION_INFO_DAEMON);
    return ci ? ci->daemon : NULL;
}

/* 413, and the connection closes after it (the rest of the body is not read). */
static enum MHD_Result too_large(struct kvs_server *s, struct call *c)
{
    c->close_conn = 1;
    return kvs_call_error(c, 413, "invalid_request_error", NULL, NULL,
                          "request body is larger than the limit of %lld bytes", (long long)s->cfg->max_body_bytes);
}

static enum MHD_Result on_access(void *cls, struct MHD_Connection *conn, const char *url, const char *method,
                                 const char *version, const char *upload_data, size_t *upload_data_size,
                                 void **con_cls)
{
    (void)version;
    struct kvs_server *s = cls;
    struct call *c = *con_cls;
    if (s->stopping) return MHD_NO;
    if (!c) {
        c = kvs_xcalloc(1, sizeof *c);
        c->srv = s;
        c->conn = conn;
        c->t_start = kvs_now();
        snprintf(c->method, sizeof c->method, "%s", method);
        c->url = kvs_xstrdup(url);
        c->next = s->calls;
        if (s->calls) s->calls->prev = c;
        s->calls = c;
        *con_cls = c;
        if (!kvs_conn_is_probe(url) && kvs_conn_over_limit(conn_daemon(conn), s->cfg)) {
            c->close_conn = 1;   /* the slot goes back at once */
            return kvs_call_error(c, 503, "unavailable_error", "too_many_connections", NULL,
                                  "too many open connections (server.max_connections = %d); retry later",
                                  s->cfg->max_connections);
        }
        const char *cl = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
        if (cl && strtoll(cl, NULL, 10) > s->cfg->max_body_bytes) {
            c->too_large = 1;
            /* a client waiting for 100 Continue gets the 413 instead; one that sends the body
             * at once would see its connection reset under the 413, so that body is read and
             * discarded (bounded below) and the 413 follows it */
            const char *ex = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_EXPECT);
            if (ex && !strcasecmp(ex, "100-continue")) return too_large(s, c);
        }
        return MHD_YES;
    }
    if (c->aborting) return MHD_NO;
    if (*upload_data_size) {
        if (!c->too_large && (int64_t)(c->body.len + *upload_data_size) > s->cfg->max_body_bytes) {
            c->too_large = 1;
            kvs_sbuf_free(&c->body);
        }
        if (c->too_large) {
            c->discarded += *upload_data_size;
            *upload_data_size = 0;
            if (!c->responded && c->discarded > KVS_DISCARD_MAX_BYTES) return too_large(s, c);
            return MHD_YES;
        }
        kvs_sbuf_append(&c->body, upload_data, *upload_data_size);
        *upload_data_size = 0;
        return MHD_YES;
    }
    if (c->responded) return MHD_YES;
    if (c->too_large) return too_large(s, c);
    if (c->n_choices) return kvs_call_resumed(s, c);
    return kvs_call_dispatch(s, c);
}

static void on_completed(void *cls, struct MHD_Connection *conn, void **con_cls, enum MHD_RequestTerminationCode toe)
{
    (void)conn;
    struct kvs_server *s = cls;
    struct call *c = *con_cls;
    if (!c) return;
    *con_cls = NULL;
    if (toe != MHD_REQUEST_TERMINATED_COMPLETED_OK && c->n_choices && !c->finished) {
        c->client_gone = 1;
        kvs_call_cancel(c);
    }
    kvs_call_log(s, c, toe);
    if (c->prev) c->prev->next = c->next;
    else s->calls = c->next;
    if (c->next) c->next->prev = c->prev;
    kvs_call_free(s, c);
}

/* libmicrohttpd's own messages (mostly clients that hung up mid-response) at debug level */
static void mhd_logger(void *cls, const char *fmt, va_list ap)
{
    (void)cls;
    char line[512];
    vsnprintf(line, sizeof line, fmt, ap);
    size_t n = strlen(line);
    while (n && (line[n - 1] == '\n' || line[n - 1] == '\r')) line[--n] = 0;
    kvs_log(KVS_LOG_DEBUG, "mhd: %s", line);
}

/* ------------------------------------------------------------------------------------------ */

int kvs_server_run(const struct kvs_config *cfg) { return kvs_server_run_exec(cfg, NULL); }

int kvs_server_run_exec(const struct kvs_config *cfg, kvs_server_exec_factory make_exec)
{
    struct kvs_server *s = kvs_xcalloc(1, sizeof *s);
    s->cfg = cfg;
    s->make_exec = make_exec;
    s->state = KVS_SRV_LOADING;
    if (cfg->log_level) {
        static const char *const levels[] = {"debug", "info", "warn", "error"};
        for (int i = 0; i < 4; i++)
            if (!strcmp(cfg->log_level, levels[i])) kvs_log_set_level((enum kvs_log_level)i);
    }
    kvs_metrics_init(&s->metrics);
    s->created = (int64_t)kvs_wall_time();
    if (cfg->model_name && cfg->model_name[0]) {
        s->model_name = kvs_xstrdup(cfg->model_name);
    } else {
        const char *p = cfg->model_path ? cfg->model_path : "model";
        size_t n = strlen(p);
        while (n > 1 && p[n - 1] == '/') n--;
        size_t b = n;
        while (b > 0 && p[b - 1] != '/') b--;
        s->model_name = kvs_xmalloc(n - b + 1);
        memcpy(s->model_name, p + b, n - b);
        s->model_name[n - b] = 0;
    }
    char err[512];
    /* config, tensor table and tokenizer are checked before the port opens: a bad model.path
     * fails here, not after clients were told to connect (with make_exec: the tokenizer only) */
    int load_rc = make_exec ? load_tokenizer(cfg, &s->tok, err, sizeof err)
                            : kvs_server_load_model(cfg, &s->model, &s->tok, err, sizeof err);
    if (load_rc) {
        kvs_log(KVS_LOG_ERROR, "%s", err);
        free(s->model_name);
        free(s);
        return 1;
    }
    s->chat_format = kvs_chat_format_from_name(cfg->chat_format ? cfg->chat_format : "auto");
    if (s->chat_format == KVS_CHAT_UNKNOWN) s->chat_format = kvs_chat_detect(cfg->model_path);
    if (s->chat_format == KVS_CHAT_UNKNOWN)
        kvs_log(KVS_LOG_WARN, "chat format of %s not recognised; set model.chat_format to serve "
                              "/v1/chat/completions", cfg->model_path);
    if (kvs_docstore_open_config(cfg, &s->docs, err, sizeof err)) {
        kvs_log(KVS_LOG_ERROR, "%s", err);
        kvs_tokenizer_free(s->tok);
        kvs_model_free(s->model);
        free(s->model_name);
        free(s);
        return 1;
    }
    /* a client that closes its socket must not kill the daemon */
    signal(SIGPIPE, SIG_IGN);

    struct sockaddr_storage addr;
    memset(&addr, 0, sizeof addr);
    if (kvs_server_resolve(cfg->host, cfg->port, &addr, err, sizeof err)) {
        kvs_log(KVS_LOG_ERROR, "%s", err);
        kvs_docstore_free(s->docs);
        kvs_tokenizer_free(s->tok);
        kvs_model_free(s->model);
        free(s->model_name);
        free(s);
        return 1;
    }
    unsigned flags = MHD_USE_EPOLL | MHD_ALLOW_SUSPEND_RESUME | MHD_USE_ERROR_LOG;
    if (addr.ss_family == AF_INET6) flags |= MHD_USE_IPv6;
    struct MHD_OptionItem limits[5];
    kvs_conn_options(cfg, limits);
    s->mhd = MHD_start_daemon(flags, (uint16_t)cfg->port, NULL, NULL, on_access, s, MHD_OPTION_SOCK_ADDR, &addr,
                              MHD_OPTION_ARRAY, limits, MHD_OPTION_NOTIFY_COMPLETED, on_completed,
                              s, MHD_OPTION_EXTERNAL_LOGGER, mhd_logger, NULL, MHD_OPTION_END);
    if (!s->mhd) {
        kvs_log(KVS_LOG_ERROR, "cannot listen on %s:%d (port in use or bad address)", cfg->host, cfg->port);
        kvs_docstore_free(s->docs);
        kvs_tokenizer_free(s->tok);
        kvs_model_free(s->model);
        free(s->model_name);
        free(s);
        return 1;
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(s->mhd, MHD_DAEMON_INFO_EPOLL_FD);
    KVS_ASSERT(di != NULL);
    int epoll_fd = di->epoll_fd;
    /* port 0 picks a free port: log the one we got */
    const union MHD_DaemonInfo *pi = MHD_get_daemon_info(s->mhd, MHD_DAEMON_INFO_BIND_PORT);
    s->port = pi ? (int)pi->port : cfg->port;

    s->loop = kvs_xmalloc(sizeof *s->loop);
    KVS_ASSERT(uv_loop_init(s->loop) == 0);
    uv_poll_init(s->loop, &s->mhd_poll, epoll_fd);
    uv_timer_init(s->loop, &s->mhd_timer);
    uv_timer_init(s->loop, &s->tick_timer);
    uv_timer_init(s->loop, &s->grace_timer);
    uv_async_init(s->loop, &s->wake_async, on_wake);
    uv_async_init(s->loop, &s->load_async, on_loaded);
    uv_signal_init(s->loop, &s->sigterm);
    uv_signal_init(s->loop, &s->sigint);
    s->mhd_poll.data = s->mhd_timer.data = s->tick_timer.data = s->grace_timer.data = s;
    s->wake_async.data = s->load_async.data = s->sigterm.data = s->sigint.data = s;
    uv_poll_start(&s->mhd_poll, UV_READABLE, on_mhd_poll);
    uv_timer_start(&s->tick_timer, on_tick, 250, 250);
    uv_signal_start(&s->sigterm, on_signal, SIGTERM);
    uv_signal_start(&s->sigint, on_signal, SIGINT);
    s->notify = engine_notify;
    kvs_log(KVS_LOG_INFO, "listening on %s:%d; loading %s", cfg->host, s->port, cfg->model_path);

    if (pthread_create(&s->loader, NULL, loader_main, s) != 0) {
        kvs_log(KVS_LOG_ERROR, "cannot start the loader thread");
        s->exit_code = 1;
        s->load_finished = 1;
        s->state = KVS_SRV_DRAINING;
        finish_shutdown(s);
    } else {
        s->loader_started = 1;
        run_mhd(s);
        uv_run(s->loop, UV_RUN_DEFAULT);
    }

    if (s->loader_started) pthread_join(s->loader, NULL);
    if (s->mhd) {
        MHD_stop_daemon(s->mhd);
        s->mhd = NULL;
    }
    if (s->engine) kvs_engine_free(s->engine);
    uv_handle_t *handles[] = {(uv_handle_t *)&s->mhd_poll,   (uv_handle_t *)&s->mhd_timer, (uv_handle_t *)&s->tick_timer,
                              (uv_handle_t *)&s->grace_timer, (uv_handle_t *)&s->wake_async,
                              (uv_handle_t *)&s->load_async, (uv_handle_t *)&s->sigterm,   (uv_handle_t *)&s->sigint};
    for (size_t i = 0; i < sizeof handles / sizeof *handles; i++) uv_close(handles[i], close_cb);
    uv_run(s->loop, UV_RUN_DEFAULT);
    KVS_ASSERT(uv_loop_close(s->loop) == 0);
    free(s->loop);
    if (s->tok) kvs_tokenizer_free(s->tok);
    if (s->model) kvs_model_free(s->model);
    kvs_docstore_free(s->docs);
    int rc = s->exit_code;
    kvs_log(KVS_LOG_INFO, "stopped (exit %d)", rc);
    free(s->model_name);
    free(s);
    return rc;
}
