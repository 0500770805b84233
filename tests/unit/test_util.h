/* test_util.h: the pieces every C test program (tests/unit/test_*.c, tests/gpu/test_*.c) repeated.
 * Header-only (static functions) so each test stays one self-contained program; include it
 * once, from the test's .c file.
 *   CHECK(cond, fmt, ...)    counts a check; on failure prints "FAIL file:line: cond: message"
 *                            to stderr, counts the failure and goes on. The message is optional.
 *   REQUIRE(cond, fmt, ...)  the same, then exits 1: for checks later steps depend on.
 *   kvs_test_summary(name)   prints the tally, returns the process exit code (0 = all passed).
 *   kvs_test_root()          the repo root ($KVS_ROOT, default "."); not owned by the caller.
 *   kvs_test_xorshift(&s)    the xorshift64 generator the tests draw reproducible inputs from.
 *   kvs_test_mkdtemp(buf, cap, tag)  makes a fresh directory /tmp/<tag>-XXXXXX (under $TMPDIR
 *                            when set) into buf; kvs_test_rmtree(dir) removes it again.
 *   kvs_test_unpack_tokenizer(name, dst, member)  unpacks one of the tokenizer tarballs into dst.
 * Nothing here allocates; the counters are per program (static). */
#ifndef KVS_TEST_UTIL_H
#define KVS_TEST_UTIL_H

#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

static int kvs_test_checks, kvs_test_fails;

__attribute__((format(printf, 4, 5))) static inline void kvs_test_fail_(const char *file, int line, const char *expr,
                                                                  const char *fmt, ...)
{
    fflush(stdout); /* keep progress lines and failures in order when both go to one file */
    kvs_test_fails++;
    fprintf(stderr, "FAIL %s:%d: %s", file, line, expr);
    if (fmt[2]) { /* fmt is ": " followed by the caller's message, when there is one */
        va_list ap;
        va_start(ap, fmt);
        vfprintf(stderr, fmt, ap);
        va_end(ap);
    }
    fputc('\n', stderr);
}

/* The message is pasted after ": " so that CHECK(cond) with no message still has a format. */
#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        kvs_test_checks++;                                                                         \
        if (!(cond)) kvs_test_fail_(__FILE__, __LINE__, #cond, ": " __VA_ARGS__);                    \
    } while (0)

#define REQUIRE(cond, ...)                                                                         \
    do {                                                                                           \
        kvs_test_checks++;                                                                         \
        if (!(cond)) {                                                                             \
            kvs_test_fail_(__FILE__, __LINE__, #cond, ": " __VA_ARGS__);                             \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

/* Prints "<name>: all N checks passed" or "<name>: F of N checks failed"; returns the exit code. */
static inline int kvs_test_summary(const char *name)
{
    if (kvs_test_fails) {
        fflush(stdout);
        fprintf(stderr, "%s: %d of %d checks failed\n", name, kvs_test_fails, kvs_test_checks);
        return 1;
    }
    printf("%s: all %d checks passed\n", name, kvs_test_checks);
    return 0;
}

/* index of the maximum of x[0 .. n) (first on ties) and its margin over the runner-up */
static inline int kvs_test_argmax(const float *x, int n, float *margin)
{
    int best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    float second = -INFINITY;
    for (int i = 0; i < n; i++)
        if (i != best && x[i] > second) second = x[i];
    *margin = x[best] - second;
    return best;
}

static inline const char *kvs_test_root(void)
{
    const char *r = getenv("KVS_ROOT");
    return r && *r ? r : ".";
}

static inline uint32_t kvs_test_xorshift(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return (uint32_t)(*s >> 11);
}

/* 0, or -1 with a message on stderr (the path did not fit, or mkdtemp failed). */
static inline int kvs_test_mkdtemp(char *buf, size_t cap, const char *tag)
{
    const char *t = getenv("TMPDIR");
    int n = snprintf(buf, cap, "%s/%s-XXXXXX", t && *t ? t : "/tmp", tag);
    if (n < 0 || (size_t)n >= cap) {
        fprintf(stderr, "temp dir path for %s too long\n", tag);
        return -1;
    }
    if (!mkdtemp(buf)) {
        perror("mkdtemp");
        return -1;
    }
    return 0;
}

static inline int kvs_test_rm_cb_(const char *p, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb, (void)flag, (void)ftw;
    return remove(p);
}

/* Removes a directory tree (depth first, links not followed); 0, or -1 when any part of it
 * could not be removed or it did not exist. */
static inline int kvs_test_rmtree(const char *dir)
{
    return nftw(dir, kvs_test_rm_cb_, 16, FTW_DEPTH | FTW_PHYS) == 0 ? 0 : -1;
}

/* The real tokenizer tarballs (qwen3/llama3/llama2.tar.xz, CONTRIBUTING.md), each looked for in
 * $KVS_TOKENIZERS, then shared/tokenizers beside the checkout (where CI keeps them), then
 * tests/data/tokenizers (Qwen3's, Apache-2.0, is committed; Meta's licences keep the Llama files
 * out). The path of <name>.tar.xz in a static buffer, or NULL when none has it. */
static inline const char *kvs_test_tokenizer_tarball(const char *name)
{
    static char path[4096];
    const char *env = getenv("KVS_TOKENIZERS");
    char dirs[3][4096];
    int nd = 0;
    if (env && *env) snprintf(dirs[nd++], sizeof dirs[0], "%s", env);
    snprintf(dirs[nd++], sizeof dirs[0], "%s/../shared/tokenizers", kvs_test_root());
    snprintf(dirs[nd++], sizeof dirs[0], "%s/tests/data/tokenizers", kvs_test_root());
    for (int i = 0; i < nd; i++) {
        int n = snprintf(path, sizeof path, "%s/%s.tar.xz", dirs[i], name);
        if (n > 0 && (size_t)n < sizeof path && access(path, R_OK) == 0) return path;
    }
    return NULL;
}

/* Where the tokenizer tarballs are looked for, for messages. */
static const char kvs_test_tokenizer_places[] =
    "$KVS_TOKENIZERS, ../shared/tokenizers or tests/data/tokenizers (CONTRIBUTING.md)";

/* A tokenizer tarball that is not there: 1 (the caller skips its cases) after printing a
 * "SKIP:" line that tests/run shows, or, when KVS_REQUIRE_TOKENIZERS=1 (CI), 0 after counting a
 * failure (the caller then goes on as if it were there and its unpack fails too). Returns 0
 * without a word when the tarball exists. */
static inline int kvs_test_tokenizer_skip(const char *name)
{
    if (kvs_test_tokenizer_tarball(name)) return 0;
    const char *req = getenv("KVS_REQUIRE_TOKENIZERS");
    if (req && !strcmp(req, "1")) {
        CHECK(0, "%s.tar.xz not found in %s, and KVS_REQUIRE_TOKENIZERS=1", name, kvs_test_tokenizer_places);
        return 0;
    }
    printf("SKIP: the %s tokenizer cases: %s.tar.xz not found in %s\n", name, name, kvs_test_tokenizer_places);
    return 1;
}

/* Unpacks <name>.tar.xz (kvs_test_tokenizer_tarball) into dst (only `member` when not NULL);
 * the exit status of tar, 0 on success, -1 when the tarball is not found. */
static inline int kvs_test_unpack_tokenizer(const char *name, const char *dst, const char *member)
{
    char cmd[8192];
    const char *tb = kvs_test_tokenizer_tarball(name);
    if (!tb) return -1;
    int n = snprintf(cmd, sizeof cmd, "tar xJf '%s' -C '%s' %s", tb, dst, member ? member : "");
    if (n < 0 || (size_t)n >= sizeof cmd) return -1;
    return system(cmd);
}

#endif
