/* server.h: the HTTP front end: OpenAI-compatible API, documents, /health, /metrics.
 *
 * kvs_server_run() owns the calling thread: it checks the model (kvs_server_load_model), binds
 * cfg->host:cfg->port, starts creating the engine (weights, KV pool) on a background thread
 * (GET /health answers 503 until it is ready), serves with libmicrohttpd driven from a libuv loop, and on SIGTERM/SIGINT drains:
 * new requests get 503, running ones continue for up to cfg->shutdown_grace_s, then the rest
 * are cancelled. A second signal stops at once.
 *
 * Ownership: cfg is borrowed for the duration of the call. Returns 0 after a clean shutdown,
 * 1 when the model cannot be loaded, the port cannot be bound or the engine fails (logged).
 */
#ifndef KVS_SERVER_H
#define KVS_SERVER_H

#include <stddef.h>

struct kvs_config;

#define KVS_VERSION "0.1.0"   /* kvserve --version, GET /version */

int kvs_server_run(const struct kvs_config *cfg);

struct kvs_model;
struct kvs_tokenizer;
/* Loads and checks cfg->model_path's config, tensor table (safetensors headers, mmapped, not
 * read) and tokenizer: what kvs_server_run does before it listens, and kvserve --check-config.
 * 0 with *model and *tok owned by the caller, or negative errno with err naming the path. */
int kvs_server_load_model(const struct kvs_config *cfg, struct kvs_model **model, struct kvs_tokenizer **tok,
                          char *err, size_t errlen);

#endif
