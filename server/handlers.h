/* handlers.h: server-internal state shared by server.c (event loop, MHD glue), handlers.c
 * (routing, auth, errors, small endpoints), openai_gen.c (generation endpoints, engine requests,
 * response and SSE formatting) and documents_api.c (documents endpoints). Not a public
 * interface.
 *
 * Ownership: struct kvs_server is allocated and freed by kvs_server_run; struct call by
 * on_access / on_completed (kvs_call_free). Every function runs on the loop thread.
 * Handler functions return the MHD_Result to give back to libmicrohttpd (as int).
 */
#ifndef KVS_SERVER_HANDLERS_H
#define KVS_SERVER_HANDLERS_H

#include <pthread.h>
#include <stdint.h>
#include <sys/socket.h>
#include <uv.h>

#include "engine/text/chat.h"
#include "engine/engine.h"
#include "server/metrics.h"
#include "server/server.h"

/* A body over server.max_body_bytes is read and dropped up to this many bytes, so that a client
 * that sends it without waiting for 100 Continue still reads its 413; past it the connection
 * is closed. */
#define KVS_DISCARD_MAX_BYTES (16ll << 20)

struct MHD_Daemon;
struct MHD_Connection;
struct kvs_config;
struct kvs_model;
struct kvs_tokenizer;
struct kvs_docstore;
struct cJSON;

enum kvs_srv_state { KVS_SRV_LOADING = 0, KVS_SRV_SERVING = 1, KVS_SRV_DRAINING = 2 };

struct kvs_server {
    const struct kvs_config *cfg;
    enum kvs_srv_state state;
    char *model_name;
    int64_t created;
    int port;                    /* bound port (cfg->port, or the one picked for port 0) */
    /* filled by the loader thread, read by the loop after load_async */
    struct kvs_model *model;     /* NULL when make_exec replaces the model */
    struct kvs_tokenizer *tok;
    kvs_server_exec_factory make_exec;   /* server.h: NULL for the real model */
    struct kvs_engine *engine;
    enum kvs_chat_format chat_format;
    int vocab_size, max_context;
    int load_rc;
    char load_err[512];
    pthread_t loader;
    int loader_started, load_finished, loaded;
    /* loop */
    uv_loop_t *loop;
    uv_poll_t mhd_poll;
    uv_timer_t mhd_timer, tick_timer, grace_timer;
    uv_async_t wake_async, load_async;
    uv_signal_t sigterm, sigint;
    struct MHD_Daemon *mhd;
    void (*notify)(void *user);
    int need_run;
    int stopping;
    int stop_now;                /* second signal: no flushing of finished streams */
    double flush_until;          /* shutdown: streams' last bytes may flush until then */
    int exit_code;
    struct call *calls;          /* every open HTTP request */
    int n_gen_calls;             /* of those, with engine requests in flight */
    struct kvs_docstore *docs;
    struct kvs_metrics metrics;
};

struct choice {
    struct kvs_request *req;     /* our reference; NULL once released */
    int index;
    int done;
    enum kvs_finish finish;
    char *error;
    struct kvs_sbuf text;        /* non-streaming: the completion so far */
    struct cJSON *lp;            /* logprobs object being built (non-streaming) */
    int text_offset;             /* completions logprobs: bytes of text before this token */
    int sent_role;               /* chat streaming: first delta sent */
    int echo_pending;            /* streaming echo: the prompt chunk is still to be sent */
    double cum_logprob;          /* best_of: sum of the sampled tokens' logprobs */
    int dropped;                 /* best_of: not among the n returned */
    int n_prompt, n_completion, n_cached;
    double queue_s, ttft_s, e2e_s;
    double last_token_at;
    double first_token_at;       /* for the access log of requests that never finished */
};

struct call {
    struct kvs_server *srv;
    struct MHD_Connection *conn;
    struct call *prev, *next;
    char method[16];
    char *url;
    const char *allow;           /* methods of the matched route, "GET, POST" (static) */
    double t_start;
    struct kvs_sbuf body;
    int too_large;
    int64_t discarded;           /* body bytes read and dropped after too_large */
    int close_conn;              /* the response carries Connection: close */
    int suspended;
    int responded;               /* a response is queued */
    int status;                  /* HTTP status for the access log */
    int aborting;                /* shutting down: refuse further work */
    int client_gone;
    int cut;                     /* the server ended it (end of the shutdown grace) */
    /* generation */
    int chat, stream, include_usage, logprobs, top_logprobs, tokens_as_ids;
    char id[64];
    int64_t created;
    struct choice *choices;
    int n_choices, n_done;
    int n_per_prompt;            /* choices i*n .. i*n+n-1 share prompt i (n = best_of) */
    int n_return;                /* choices returned per prompt (n; < n_per_prompt with best_of) */
    int finished;                /* every choice done (and, streaming, [DONE] queued) */
    int counted;                 /* counted in srv->n_gen_calls */
    int stream_error;            /* an error chunk was sent */
    int headers_sent;
    struct kvs_sbuf out;         /* streaming: bytes not yet handed to MHD */
    size_t out_off;
    double last_write;
};

int kvs_call_dispatch(struct kvs_server *s, struct call *c);
/* Response helpers (handlers.c): j is consumed; parse_body as kvs_api_parse, then the model
 * check (0: parsed, the caller frees r; -1: the error is queued, r freed, *mhd_rc to return). */
enum kvs_api_kind;
struct kvs_api_request;
int kvs_call_respond_json(struct call *c, int status, struct cJSON *j);
struct cJSON *kvs_error_object(const char *message, const char *type, const char *param, const char *code);
int kvs_call_parse_body(struct kvs_server *s, struct call *c, enum kvs_api_kind kind, int check_model,
                        struct kvs_api_request *r, int *mhd_rc);
/* The endpoints of openai_gen.c and documents_api.c. */
int kvs_openai_generate(struct kvs_server *s, struct call *c);
int kvs_docs_create(struct kvs_server *s, struct call *c);
int kvs_docs_list(struct kvs_server *s, struct call *c);
int kvs_docs_one(struct kvs_server *s, struct call *c, const char *id);
int kvs_call_resumed(struct kvs_server *s, struct call *c);
/* Queues an OpenAI-shaped error response. */
/* The 400 for a text input (param) to a model served by token ids only (s->tok NULL). */
int kvs_call_no_tokenizer(struct call *c, const char *param);
int kvs_call_error(struct call *c, int status, const char *type, const char *code, const char *param,
                   const char *fmt, ...) __attribute__((format(printf, 6, 7)));
/* Drains engine events of a call into its output; resumes the connection when there is news. */
void kvs_call_pump(struct kvs_server *s, struct call *c);
/* Cancels the call's unfinished engine requests (idempotent). */
void kvs_call_cancel(struct call *c);
void kvs_call_log(struct kvs_server *s, struct call *c, int toe);
/* The server gives up on c (end of the shutdown grace): its engine requests are cancelled; a
 * stream gets an in-band error chunk and `data: [DONE]`, a waiting non-streaming request a
 * 503. The call no longer counts in srv->n_gen_calls. */
void kvs_call_cut(struct kvs_server *s, struct call *c, const char *msg);
void kvs_call_free(struct kvs_server *s, struct call *c);
void kvs_server_resume(struct kvs_server *s, struct call *c);
int kvs_server_resolve(const char *host, int port, struct sockaddr_storage *out, char *err, size_t errlen);

#endif
