/* util.h: small shared helpers: error strings, logging, checked allocation, clocks.
 *
 * Error convention used across kvserve:
 *   - functions return 0 on success or a negative errno-style code (-EINVAL, -ENOMEM, -ENOENT,
 *     -EIO, -ENOSPC, -EAGAIN ...); functions returning pointers return NULL on failure;
 *   - when a function takes (char *err, size_t errlen) it writes a one-line, human-readable
 *     message there on failure (naming the file / key / tensor at fault); err may be NULL.
 *   - bugs (broken invariants) and CUDA failures are not return codes: KVS_ASSERT / CUDA_CHECK
 *     log file:line and abort.
 * Ownership: kvs_xmalloc/kvs_xcalloc/kvs_xstrdup abort on OOM (only for small bookkeeping
 * allocations at startup or per request; never for sizes a client controls). Free with free().
 */
#ifndef KVS_UTIL_H
#define KVS_UTIL_H

#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

enum kvs_log_level { KVS_LOG_DEBUG = 0, KVS_LOG_INFO = 1, KVS_LOG_WARN = 2, KVS_LOG_ERROR = 3 };

/* Sets the minimum level printed (default INFO). Thread-safe to call at startup. */
void kvs_log_set_level(enum kvs_log_level level);
/* Logs one line to stderr with a timestamp and level. Thread-safe. */
void kvs_log(enum kvs_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Writes a formatted message into err[0..errlen) when err is non-NULL; returns code unchanged,
 * so callers can `return kvs_err(err, errlen, -EINVAL, "bad %s", key);`. */
int kvs_err(char *err, size_t errlen, int code, const char *fmt, ...) __attribute__((format(printf, 4, 5)));

void *kvs_xmalloc(size_t n);
void *kvs_xcalloc(size_t n, size_t size);
void *kvs_xrealloc(void *p, size_t n);
char *kvs_xstrdup(const char *s);

/* Monotonic time in seconds. */
double kvs_now(void);
/* Wall-clock time in seconds since the epoch (for "created" fields). */
double kvs_wall_time(void);

/* Reads a whole file into a NUL-terminated malloc'ed buffer (caller frees). NULL + err on failure. */
char *kvs_read_file(const char *path, size_t *len_out, char *err, size_t errlen);

/* Aborts with file:line when cond is false: for invariants, never for client input. */
#define KVS_ASSERT(cond)                                                                   \
    do {                                                                                   \
        if (!(cond)) kvs_panic(__FILE__, __LINE__, "assertion failed: %s", #cond);         \
    } while (0)
_Noreturn void kvs_panic(const char *file, int line, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

#endif
