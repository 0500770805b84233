/* test_engine_text.c: text deltas and stop strings through the full engine with a real
 * tokenizer: the tiny Qwen3 test model generates ids below 1024, which the real Qwen3 tokenizer
 * (qwen3.tar.xz, committed under tests/data/tokenizers, unpacked into a temp dir) maps to byte-level pieces,
 * including partial UTF-8 sequences. Checks, for several concurrent requests:
 *   - the concatenated TOKEN text deltas equal kvs_tokenizer_decode of the generated ids;
 *   - with a stop string taken from that text, the output is the text before its first
 *     occurrence, never contains it, and ends with finish STOP at the right token. */
#include "engine/config.h"
#include "engine/engine.h"
#include "engine/text/tokenizer.h"
#include "base/util.h"
#include "models/model.h"
#include "tests/unit/test_util.h"

#include <stdio.h>
#include <string.h>
#include <unistd.h>

#define N 6
#define GEN 48

struct out {
    int32_t ids[GEN];
    int n;
    char text[8192];
    size_t len;
    enum kvs_finish finish;
};

static void run(struct kvs_engine *e, int32_t prompts[N][24], const char *const *stops, struct out *o)
{
    struct kvs_request *r[N];
    char err[256];
    for (int i = 0; i < N; i++) {
        struct kvs_request_params p;
        memset(&p, 0, sizeof p);
        p.prompt = prompts[i];
        p.n_prompt = 24;
        p.max_tokens = GEN;
        p.sampling.top_p = 1;
        p.sampling.repetition_penalty = 1;
        p.ignore_eos = 1;
        p.skip_special = 1;
        if (stops && stops[i]) {
            p.stop_strings = &stops[i];
            p.n_stop_strings = 1;
        }
        r[i] = kvs_request_new(&p, NULL, NULL);
        REQUIRE(r[i], "request_new");
        REQUIRE(kvs_engine_submit(e, r[i], err, sizeof err) == 0, "%s", err);
        memset(&o[i], 0, sizeof o[i]);
    }
    for (int i = 0; i < N; i++) {
        struct kvs_event ev[16];
        while (o[i].finish == KVS_FINISH_NONE) {
            int k = kvs_request_wait(r[i], ev, 16, 60.0);
            REQUIRE(k > 0, "no event for 60 s");
            for (int q = 0; q < k; q++) {
                if (ev[q].type == KVS_EV_TOKEN) {
                    o[i].ids[o[i].n++] = ev[q].token;
                    size_t l = strlen(ev[q].text);
                    REQUIRE(o[i].len + l < sizeof o[i].text, "text too long");
                    memcpy(o[i].text + o[i].len, ev[q].text, l + 1);
                    o[i].len += l;
                } else {
                    REQUIRE(ev[q].type == KVS_EV_DONE, "error event: %s", ev[q].error ? ev[q].error : "");
                    o[i].finish = ev[q].finish;
                }
                kvs_event_clear(&ev[q]);
            }
        }
        kvs_request_unref(r[i]);
    }
}

int main(void)
{
    kvs_log_set_level(KVS_LOG_WARN);
    const char *root = kvs_test_root();
    char tmp[512];
    REQUIRE(kvs_test_mkdtemp(tmp, sizeof tmp, "kvs-engine-text") == 0, "mkdtemp");
    char dir[1100], err[256];
    REQUIRE(kvs_test_unpack_tokenizer("qwen3", tmp, NULL) == 0, "cannot unpack qwen3.tar.xz from %s", kvs_test_tokenizer_places);
    snprintf(dir, sizeof dir, "%s/qwen3", tmp);
    struct kvs_tokenizer *tok;
    REQUIRE(kvs_tokenizer_load(dir, &tok, err, sizeof err) == 0, "%s", err);
    REQUIRE(kvs_test_rmtree(tmp) == 0, "cleanup");

    snprintf(dir, sizeof dir, "%s/tests/data/models/qwen3", root);
    struct kvs_model *m;
    REQUIRE(kvs_model_load(dir, &m, err, sizeof err) == 0, "%s", err);
    struct kvs_config c;
    kvs_config_init(&c);
    free(c.device);
    c.device = kvs_xstrdup("cpu");
    c.cpu_threads = 2;
    c.kv_memory_bytes = 2 << 20;
    c.max_model_len = 256;
    c.prefill_chunk = 8;
    struct kvs_engine *e;
    REQUIRE(kvs_engine_create(&c, m, tok, &e, err, sizeof err) == 0, "%s", err);

    /* prompts of ids whose pieces include non-ASCII bytes (ids 128..255 are byte tokens) */
    int32_t prompts[N][24];
    uint64_t s = 12345;
    for (int i = 0; i < N; i++)
        for (int t = 0; t < 24; t++) {
            s = s * 6364136223846793005ULL + 1442695040888963407ULL;
            prompts[i][t] = (int32_t)((s >> 33) % 1000);
        }
    static struct out full[N], stopped[N];
    run(e, prompts, NULL, full);
    int partial_utf8 = 0;
    for (int i = 0; i < N; i++) {
        REQUIRE(full[i].n == GEN && full[i].finish == KVS_FINISH_LENGTH, "request %d: %d tokens", i, full[i].n);
        /* the engine drops NUL bytes (C-string deltas): decode around the byte-0 token */
        char ref[8192] = "";
        int32_t nul = kvs_tokenizer_token_id(tok, "\xc4\x80");   /* byte-level "Ā" = byte 0x00 */
        for (int a = 0, b; a < full[i].n; a = b + 1) {
            for (b = a; b < full[i].n && full[i].ids[b] != nul; b++) {}
            char *seg = kvs_tokenizer_decode(tok, full[i].ids + a, b - a, 1);
            REQUIRE(seg && strlen(ref) + strlen(seg) < sizeof ref, "decode");
            strcat(ref, seg);
            free(seg);
        }
        REQUIRE(strcmp(ref, full[i].text) == 0, "request %d: deltas \"%s\" != decode \"%s\"", i, full[i].text, ref);
        for (size_t k = 0; ref[k]; k++) partial_utf8 |= (unsigned char)ref[k] >= 0x80;
    }
    printf("text deltas == kvs_tokenizer_decode for %d requests (non-ASCII output: %s)\n", N,
           partial_utf8 ? "yes" : "no");

    /* stop strings: 3 ASCII bytes from the second half of each text */
    static char stop_buf[N][4];
    const char *stops[N];
    int n_stops = 0;
    for (int i = 0; i < N; i++) {
        stops[i] = NULL;
        for (size_t k = full[i].len / 2; k + 3 <= full[i].len; k++) {
            const unsigned char *p = (const unsigned char *)full[i].text + k;
            if (p[0] >= 0x21 && p[0] < 0x7f && p[1] >= 0x20 && p[1] < 0x7f && p[2] >= 0x20 && p[2] < 0x7f) {
                memcpy(stop_buf[i], p, 3);
                stop_buf[i][3] = 0;
                stops[i] = stop_buf[i];
                n_stops++;
                break;
            }
        }
    }
    REQUIRE(n_stops >= 3, "too few ASCII stop candidates (%d)", n_stops);
    run(e, prompts, stops, stopped);
    for (int i = 0; i < N; i++) {
        if (!stops[i]) continue;
        const char *at = strstr(full[i].text, stops[i]);
        size_t pos = (size_t)(at - full[i].text);
        REQUIRE(stopped[i].finish == KVS_FINISH_STOP, "request %d: finish %d", i, stopped[i].finish);
        REQUIRE(stopped[i].len == pos && memcmp(stopped[i].text, full[i].text, pos) == 0,
              "request %d: got \"%s\", want the first %zu bytes of \"%s\" (stop \"%s\")", i, stopped[i].text, pos,
              full[i].text, stops[i]);
        REQUIRE(!strstr(stopped[i].text, stops[i]), "stop string emitted");
        /* it stopped at the first token whose text completes the stop string */
        REQUIRE(stopped[i].n <= full[i].n && memcmp(stopped[i].ids, full[i].ids, (size_t)stopped[i].n * 4) == 0, "ids");
        char *upto = kvs_tokenizer_decode(tok, full[i].ids, stopped[i].n, 1);
        char *before = kvs_tokenizer_decode(tok, full[i].ids, stopped[i].n - 1, 1);
        REQUIRE(strstr(upto, stops[i]) && !strstr(before, stops[i]), "request %d stopped at the wrong token", i);
        free(upto);
        free(before);
    }
    printf("stop strings: %d requests stop at the right token, text before the stop string only\n", n_stops);
    kvs_engine_free(e);
    kvs_config_free(&c);
    kvs_model_free(m);
    kvs_tokenizer_free(tok);
    return kvs_test_summary("test_engine_text");
}
