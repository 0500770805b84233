/* test_config.c: the config table: defaults, JSON parsing, strict validation, --set, dump. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/config.h"
#include "engine/kv/kv.h"
#include "tests/unit/test_util.h"


/* Loads json on top of defaults; returns rc and leaves the message in err. */
static int load(const char *json, char *err, size_t errlen)
{
    struct kvs_config c;
    kvs_config_init(&c);
    err[0] = 0;
    int rc = kvs_config_load_json(&c, json, "test.json", err, errlen);
    if (!rc) rc = kvs_config_validate(&c, err, errlen);
    kvs_config_free(&c);
    return rc;
}

static void expect_error(const char *json, const char *must_contain)
{
    char err[512];
    int rc = load(json, err, sizeof err);
    CHECK(rc < 0, "expected an error for %s", json);
    CHECK(strstr(err, must_contain) != NULL, "error for %s should mention '%s', got '%s'", json, must_contain, err);
}

int main(void)
{
    struct kvs_config c;
    char err[512];

    kvs_config_init(&c);
    CHECK(c.port == 8000, "default port %d", c.port);
    CHECK(!strcmp(c.host, "127.0.0.1"), "default host %s", c.host);
    CHECK(!strcmp(c.kv_decode, "full"), "default decode %s", c.kv_decode);
    CHECK(c.kv_block_size == 16, "default block size");
    CHECK(kvs_config_validate(&c, err, sizeof err) == 0, "defaults validate: %s", err);

    /* nested JSON overrides */
    CHECK(kvs_config_load_json(&c, "{\"server\":{\"port\":9001,\"host\":\"0.0.0.0\"},\"kv\":{\"reuse\":\"none\","
                                   "\"memory_bytes\":1048576,\"memory_fraction\":0.25},\"server\":{\"access_log\":false}}",
                               "t", err, sizeof err) == 0,
          "load: %s", err);
    CHECK(c.port == 9001 && !strcmp(c.host, "0.0.0.0") && !strcmp(c.kv_reuse, "none"), "values applied");
    CHECK(c.kv_memory_bytes == 1048576 && c.kv_memory_fraction == 0.25 && c.access_log == 0, "typed values applied");
    /* scheduler.async: auto by default; a JSON bool still sets it (it was a bool key), a string too */
    CHECK(!strcmp(c.sched_async, "auto"), "default scheduler.async %s", c.sched_async);
    CHECK(kvs_config_load_json(&c, "{\"scheduler\":{\"async\":true}}", "t", err, sizeof err) == 0 &&
              !strcmp(c.sched_async, "true"),
          "scheduler.async from a JSON bool: %s", err);
    CHECK(kvs_config_load_json(&c, "{\"scheduler\":{\"async\":\"auto\"}}", "t", err, sizeof err) == 0 &&
              !strcmp(c.sched_async, "auto"),
          "scheduler.async from a string: %s", err);
    expect_error("{\"scheduler\":{\"async\":1}}", "scheduler.async");
    expect_error("{\"scheduler\":{\"overlap\":\"auto\"}}", "scheduler.overlap");
    /* batch_invariant: auto (on for kv.decode=retro only), true / false from a JSON bool or --set */
    CHECK(!strcmp(c.batch_invariant, "auto") && kvs_config_batch_invariant(&c) == 0,
          "default batch_invariant %s is off for kv.decode=%s", c.batch_invariant, c.kv_decode);
    CHECK(kvs_config_set(&c, "kv.decode=retro", err, sizeof err) == 0 && kvs_config_batch_invariant(&c) == 1,
          "batch_invariant auto is on for retro: %s", err);
    CHECK(kvs_config_load_json(&c, "{\"batch_invariant\":false}", "t", err, sizeof err) == 0 &&
              kvs_config_batch_invariant(&c) == 0,
          "batch_invariant false from a JSON bool turns it off for retro: %s", err);
    CHECK(kvs_config_set(&c, "kv.decode=quest", err, sizeof err) == 0 &&
              kvs_config_set(&c, "batch_invariant=true", err, sizeof err) == 0 && kvs_config_batch_invariant(&c) == 1,
          "--set batch_invariant=true: %s", err);
    CHECK(kvs_config_set(&c, "batch_invariant=auto", err, sizeof err) == 0 &&
              kvs_config_set(&c, "kv.decode=full", err, sizeof err) == 0 && kvs_config_batch_invariant(&c) == 0,
          "batch_invariant back to auto: %s", err);
    expect_error("{\"batch_invariant\":1}", "batch_invariant");

    /* --set */
    CHECK(kvs_config_set(&c, "kv.block_size=32", err, sizeof err) == 0, "set: %s", err);
    CHECK(c.kv_block_size == 32, "set applied");
    CHECK(kvs_config_set(&c, "kv.block_size=abc", err, sizeof err) < 0 && strstr(err, "kv.block_size"),
          "set non-integer fails naming the key: %s", err);
    CHECK(kvs_config_set(&c, "kv.bogus=1", err, sizeof err) < 0 && strstr(err, "kv.bogus"), "set unknown key: %s", err);
    CHECK(kvs_config_set(&c, "nokey", err, sizeof err) < 0, "set without '='");

    /* dump round-trips through the parser */
    char *dump = kvs_config_dump_json(&c);
    struct kvs_config d;
    kvs_config_init(&d);
    CHECK(kvs_config_load_json(&d, dump, "dump", err, sizeof err) == 0, "dump reloads: %s", err);
    CHECK(d.port == 9001 && d.kv_block_size == 32 && !strcmp(d.kv_reuse, "none"), "dump round-trip");
    free(dump);
    kvs_config_free(&d);
    kvs_config_free(&c);

    /* strict validation, each error naming the key and what is allowed */
    expect_error("{\"kv\":{\"resue\":\"prefix\"}}", "unknown config key 'kv.resue'");
    expect_error("{\"kv\":{\"resue\":\"prefix\"}}", "did you mean 'kv.reuse'");
    expect_error("{\"sever\":{\"port\":1}}", "sever");
    expect_error("{\"server\":{\"port\":\"80\"}}", "server.port");
    expect_error("{\"server\":{\"port\":70000}}", "out of range");
    expect_error("{\"server\":{\"port\":1.5}}", "not an integer");
    expect_error("{\"server\":{\"access_log\":1}}", "expected a bool");
    expect_error("{\"kv\":{\"decode\":\"magic\"}}", "full|quest|retro|mac|paris");
    {
        /* a planned decode policy that is not built yet (whichever the registry still lacks) */
        const char *names[32];
        int n = kvs_kv_names("decode", names, 32);
        for (int i = 0; i < n; i++)
            if (!kvs_kv_find_decode(names[i])) {
                char json[128];
                snprintf(json, sizeof json, "{\"kv\":{\"decode\":\"%s\"}}", names[i]);
                expect_error(json, "is not built in this version");
                break;
            }
    }
    expect_error("{\"kv\":{\"reuse\":\"lazy\",\"decode\":\"paris\"}}", "do not compose");
    expect_error("{\"kv\":\"prefix\"}", "expected an object");
    expect_error("[1,2]", "must be a JSON object");
    expect_error("{\"server\":{\"port\":80,}", "invalid JSON");
    expect_error("{\"scheduler\":{\"max_batch_tokens\":16,\"prefill_chunk\":64}}", "prefill_chunk");
    expect_error("{\"kv\":{\"mac\":{\"tau\":-1}}}", "kv.mac.tau");
    expect_error("{\"device\":\"cpu\",\"kv\":{\"storage\":\"bf16\"}}", "kv.storage");

    return kvs_test_summary("test_config");
}
