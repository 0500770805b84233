/* server.h: the HTTP front end: OpenAI-compatible API, documents, /health, /metrics.
 *
 * kvs_server_run() owns the calling thread: it binds cfg->host:cfg->port, starts loading the
 * model, tokenizer and engine on a background thread (GET /health answers 503 until they are
 * ready), serves with libmicrohttpd driven from a libuv loop, and on SIGTERM/SIGINT drains:
 * new requests get 503, running ones continue for up to cfg->shutdown_grace_s, then the rest
 * are cancelled. A second signal stops at once.
 *
 * Ownership: cfg is borrowed for the duration of the call. Returns 0 after a clean shutdown,
 * 1 when the port cannot be bound or loading fails (the message is logged).
 */
#ifndef KVS_SERVER_H
#define KVS_SERVER_H

struct kvs_config;

#define KVS_VERSION "0.1.0"   /* kvserve --version, GET /version */

int kvs_server_run(const struct kvs_config *cfg);

#endif
