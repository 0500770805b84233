/* util.c: logging, error strings, checked allocation, clocks, file reading. */
#include "base/util.h"

#include <pthread.h>
#include <stdarg.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

static enum kvs_log_level g_log_level = KVS_LOG_INFO;
static pthread_mutex_t g_log_lock = PTHREAD_MUTEX_INITIALIZER;

void kvs_log_set_level(enum kvs_log_level level) { g_log_level = level; }

void kvs_log(enum kvs_log_level level, const char *fmt, ...)
{
    static const char *names[] = {"debug", "info", "warn", "error"};
    if (level < g_log_level) return;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    char line[4096];
    int n = snprintf(line, sizeof line, "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ %-5s ", tm.tm_year + 1900,
                     tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, ts.tv_nsec / 1000000,
                     names[level]);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
    va_end(ap);
    /* one write per line under a lock so lines from the loop and engine threads never interleave */
    pthread_mutex_lock(&g_log_lock);
    fprintf(stderr, "%s\n", line);
    fflush(stderr);
    pthread_mutex_unlock(&g_log_lock);
}

int kvs_err(char *err, size_t errlen, int code, const char *fmt, ...)
{
    if (err && errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return code;
}

_Noreturn void kvs_panic(const char *file, int line, const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fprintf(stderr, "FATAL %s:%d: %s\n", file, line, msg);
    fflush(stderr);
    abort();
}

void *kvs_xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p) kvs_panic(__FILE__, __LINE__, "out of memory allocating %zu bytes", n);
    return p;
}

void *kvs_xcalloc(size_t n, size_t size)
{
    void *p = calloc(n ? n : 1, size ? size : 1);
    if (!p) kvs_panic(__FILE__, __LINE__, "out of memory allocating %zu x %zu bytes", n, size);
    return p;
}

void *kvs_xrealloc(void *p, size_t n)
{
    void *q = realloc(p, n ? n : 1);
    if (!q) kvs_panic(__FILE__, __LINE__, "out of memory reallocating %zu bytes", n);
    return q;
}

char *kvs_xstrdup(const char *s)
{
    size_t n = strlen(s);
    char *d = kvs_xmalloc(n + 1);
    memcpy(d, s, n + 1);
    return d;
}

double kvs_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

double kvs_wall_time(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

char *kvs_read_file(const char *path, size_t *len_out, char *err, size_t errlen)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        kvs_err(err, errlen, -errno, "%s: %s", path, strerror(errno));
        return NULL;
    }
    struct stat st;
    if (fstat(fileno(f), &st) != 0 || !S_ISREG(st.st_mode)) {
        fclose(f);
        kvs_err(err, errlen, -EINVAL, "%s: not a regular file", path);
        return NULL;
    }
    size_t len = (size_t)st.st_size;
    char *buf = malloc(len + 1);
    if (!buf) {
        fclose(f);
        kvs_err(err, errlen, -ENOMEM, "%s: out of memory (%zu bytes)", path, len);
        return NULL;
    }
    if (len && fread(buf, 1, len, f) != len) {
        free(buf);
        fclose(f);
        kvs_err(err, errlen, -EIO, "%s: short read", path);
        return NULL;
    }
    fclose(f);
    buf[len] = 0;
    if (len_out) *len_out = len;
    return buf;
}
