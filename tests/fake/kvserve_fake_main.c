/* kvserve_fake_main.c: build/kvserve-fake: the real HTTP server, engine, scheduler and tokenizer
 * over a deterministic fake model (tests/fake/fake_model.h) instead of weights, for the HTTP
 * tests (tests/py/test_http_*.py, whose helper tests/py/kvs_http.py predicts every output).
 * The only difference from build/kvserve is the executor: kvs_server_run_exec (server/server.h)
 * with make_fake_exec below, so no engine or tokenizer code is re-implemented here.
 *
 * The model directory (default tests/data/fake) holds only tokenizer files: a byte-level
 * tokenizer (ids 0..255 the bytes, 256 <|endoftext|> and 258 <|im_end|> EOS, 257 <|im_start|>,
 * 259 <|bos|> BOS, added with add_special) with a ChatML template.
 * The fake model (fake_model.h): completion token k of an n-token prompt is prompt[n-1 - (k mod n)]
 * (FAKE_PICK_REVERSE: logprob log(0.5), alternative i is token+i with log(0.5 / 2^i)); prompt
 * logprobs (echo) follow FAKE_LOGITS_NEXT_BYTE; a prompt containing "!fail!" ends with an ERROR
 * event ("sampling failed") after 2 tokens; its KV pool is KVS_FAKE_BLOCKS blocks of
 * kv.block_size tokens, its context the whole pool.
 * Environment: KVS_FAKE_STEP_MS (default 2) per forward pass, KVS_FAKE_PREFILL_MS (default 0)
 * more for a pass that holds a newly admitted request, KVS_FAKE_LOAD_MS (default 0) of loading,
 * KVS_FAKE_BLOCKS (default 512).
 * Flags set the config fields the server reads (tests/fake/daemon_opts.h):
 *   --model DIR --port N --host H --api-key K --max-body N --max-connections N
 *   --timeout S --grace S --keepalive S --max-waiting N --max-running N --max-model-len N
 *   --max-tokens-default N --documents-dir DIR --documents-max N --documents-max-tokens N
 *   --served-name NAME --quiet (no access log)
 *   --set key=value (any config key)
 * Defaults differ from kvserve's where tests need it (the fake model dir, a 256-token context).
 */
#include "server/server.h"

#include "engine/config.h"
#include "engine/engine_exec.h"
#include "engine/text/tokenizer.h"
#include "base/util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/fake/daemon_opts.h"
#include "tests/fake/fake_model.h"

static double env_ms(const char *name, double dflt)
{
    const char *v = getenv(name);
    return v && *v ? atof(v) : dflt;
}

static void fake_destroy(void *ctx)
{
    fake_model_free(ctx);
    free(ctx);
}

static const int32_t k_fail_pattern[] = {'!', 'f', 'a', 'i', 'l', '!'};

/* kvs_server_exec_factory: the fake model with the server's tokenizer for text and EOS */
static int make_fake_exec(const struct kvs_config *cfg, const struct kvs_tokenizer *tok, struct kvs_engine_exec *x,
                          char *err, size_t errlen)
{
    int n_blocks = (int)env_ms("KVS_FAKE_BLOCKS", 512), vocab = kvs_tokenizer_vocab_size(tok);
    if (n_blocks <= 0 || n_blocks > 1 << 20)
        return kvs_err(err, errlen, -EINVAL, "KVS_FAKE_BLOCKS must be 1..%d", 1 << 20);
    if (vocab < 256 || vocab > 1024)
        return kvs_err(err, errlen, -EINVAL, "the fake model needs a byte-level tokenizer of 256..1024 ids (got %d)", vocab);
    double load_ms = env_ms("KVS_FAKE_LOAD_MS", 0);
    if (load_ms > 0) usleep((useconds_t)(load_ms * 1000));
    struct fake_model *m = kvs_xmalloc(sizeof *m);
    fake_model_init(m, n_blocks, cfg->kv_block_size, vocab, n_blocks * cfg->kv_block_size);
    m->logits_rule = FAKE_LOGITS_NEXT_BYTE;
    m->pick_rule = FAKE_PICK_REVERSE;
    m->sleep_s = env_ms("KVS_FAKE_STEP_MS", 2) / 1000.0;
    m->fresh_sleep_s = env_ms("KVS_FAKE_PREFILL_MS", 0) / 1000.0;
    m->fail_pattern = k_fail_pattern;
    m->n_fail_pattern = (int)(sizeof k_fail_pattern / sizeof *k_fail_pattern);
    m->fail_at = 2;
    *x = fake_exec(m);
    x->tok = tok;
    x->detok_init = kvs_detok_init;
    x->detok_feed = kvs_detok_feed;
    x->detok_flush = kvs_detok_flush;
    x->n_eos = kvs_tokenizer_eos(tok, &x->eos_ids);
    x->destroy = fake_destroy;
    return 0;
}

int main(int argc, char **argv)
{
    struct kvs_config cfg;
    kvs_config_init(&cfg);
    /* test defaults: the fake model dir, a 256-token context, no request timeout */
    static const char *const defaults[] = {"model.path=tests/data/fake", "model.max_model_len=256",
                                           "server.request_timeout_s=0", "server.shutdown_grace_s=10",
                                           "documents.max_tokens=128"};
    int rc = daemon_opts_apply(&cfg, defaults, (int)(sizeof defaults / sizeof *defaults), argc, argv, "kvserve-fake");
    if (!rc) rc = kvs_server_run_exec(&cfg, make_fake_exec);
    kvs_config_free(&cfg);
    return rc;
}
