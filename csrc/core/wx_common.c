/* wx_common.c - error messages, clock, options. */
#include "wx_common.h"
#include "wx_param.h"

#include <ctype.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static _Thread_local char wx__errbuf[WX_ERRMSG_MAX];

int wx_errf(int err, const char *fmt, ...)
{
    va_list ap;
    int n;
    va_start(ap, fmt);
    n = vsnprintf(wx__errbuf, sizeof wx__errbuf, fmt, ap);
    va_end(ap);
    if (n >= (int)sizeof wx__errbuf) /* too long: say so rather than cut a word in two */
        memcpy(wx__errbuf + sizeof wx__errbuf - 4, "...", 4);
    return err;
}

const char *wx_last_error(void) { return wx__errbuf; }

void wx_clear_error(void) { wx__errbuf[0] = '\0'; }

uint64_t wx_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

void wx_deadline_after(struct timespec *ts, uint64_t ns)
{
    clock_gettime(CLOCK_MONOTONIC, ts);
    ts->tv_sec += (time_t)(ns / 1000000000ull);
    ts->tv_nsec += (long)(ns % 1000000000ull);
    if (ts->tv_nsec >= 1000000000L) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000L;
    }
}

void wx_debugf(const char *fmt, ...)
{
    static int enabled = -1;
    va_list ap;
    if (enabled < 0)
        enabled = wx_param_flag(WX_P_DEBUG);
    if (!enabled)
        return;
    fprintf(stderr, "[wxfer %llu] ", (unsigned long long)(wx_now_ns() / 1000));
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
}

const char *wx_opt_str(const wx_opts_t *o, const char *key, const char *dflt)
{
    if (o)
        for (int i = 0; i < o->n; i++)
            if (strcmp(o->keys[i], key) == 0)
                return o->vals[i];
    return dflt;
}

int wx_parse_size(const char *s, uint64_t *out)
{
    char *end;
    unsigned long long v;
    uint64_t mul = 1;
    if (!s || !*s)
        return -EINVAL;
    errno = 0;
    v = strtoull(s, &end, 10);
    if (errno || end == s || *s == '-')
        return -EINVAL;
    while (*end == ' ')
        end++;
    if (*end) {
        char u = (char)toupper((unsigned char)*end);
        const char *rest = end + 1;
        if (u == 'K')
            mul = 1ull << 10;
        else if (u == 'M')
            mul = 1ull << 20;
        else if (u == 'G')
            mul = 1ull << 30;
        else if (u == 'T')
            mul = 1ull << 40;
        else if (u == 'B' && !*rest)
            mul = 1;
        else
            return -EINVAL;
        if (u != 'B') {
            if (*rest == 'i' || *rest == 'I')
                rest++;
            if (*rest == 'B' || *rest == 'b')
                rest++;
            if (*rest)
                return -EINVAL;
        }
    }
    if (v && mul > UINT64_MAX / v)
        return -ERANGE;
    *out = (uint64_t)v * mul;
    return 0;
}

int wx_opt_u64(const wx_opts_t *o, const char *key, uint64_t dflt, uint64_t *out)
{
    const char *s = wx_opt_str(o, key, NULL);
    if (!s) {
        *out = dflt;
        return 0;
    }
    if (wx_parse_size(s, out))
        return wx_errf(-EINVAL, "option %s=%s: expected a number or size like 64MiB", key, s);
    return 0;
}

int wx_opt_check(const wx_opts_t *o, const char *transport, const char *const *known)
{
    if (!o)
        return 0;
    for (int i = 0; i < o->n; i++) {
        int ok = 0;
        for (const char *const *k = known; *k; k++)
            if (strcmp(*k, o->keys[i]) == 0)
                ok = 1;
        if (!ok) {
            char list[1024] = "";
            for (const char *const *k = known; *k; k++) {
                strncat(list, *k, sizeof list - strlen(list) - 1);
                if (k[1])
                    strncat(list, ", ", sizeof list - strlen(list) - 1);
            }
            return wx_errf(-EINVAL, "transport %s: unknown option '%s' (known: %s)", transport,
                           o->keys[i], list);
        }
    }
    return 0;
}
