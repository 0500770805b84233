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
struct kvs_engine_exec;

/* The model side of the engine from somewhere other than cfg->model_path's weights: fills *x
 * (engine/engine_exec.h) for cfg, with tok the tokenizer loaded from cfg->model_path (the
 * executor's detokenizer and EOS ids usually come from it). Called once, on the loader thread
 * (it may take its time: /health answers 503 meanwhile). 0, or negative errno + message in err.
 * Ownership: after a 0 return the server owns x->ctx through x->destroy (called when the engine
 * is freed, or at once when the engine cannot be created). */
typedef int (*kvs_server_exec_factory)(const struct kvs_config *cfg, const struct kvs_tokenizer *tok,
                                       struct kvs_engine_exec *x, char *err, size_t errlen);

/* kvs_server_run with the engine over make_exec's executor instead of the real model: only
 * cfg->model_path's tokenizer files are loaded (no config.json, no weights), the rest of the
 * server is the same code. For test daemons that serve a deterministic fake model
 * (build/kvserve-fake, tests/fake/). make_exec NULL is kvs_server_run. */
int kvs_server_run_exec(const struct kvs_config *cfg, kvs_server_exec_factory make_exec);

/* Loads and checks cfg->model_path's config, tensor table (safetensors headers, mmapped, not
 * read) and tokenizer: what kvs_server_run does before it listens, and kvserve --check-config.
 * 0 with *model and *tok owned by the caller, or negative errno with err naming the path. */
int kvs_server_load_model(const struct kvs_config *cfg, struct kvs_model **model, struct kvs_tokenizer **tok,
                          char *err, size_t errlen);

#endif
