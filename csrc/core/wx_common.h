/* wx_common.h - shared helpers of the plain-C core.
 *
 * Conventions (the project's rules for native code):
 *   - every fallible function returns 0 (or a count) on success and a negative errno on failure;
 *   - the human-readable reason of the most recent failure on this thread is kept in a
 *     thread-local buffer (wx_errf / wx_last_error); the Python layer turns the pair
 *     (errno, message) into an exception;
 *   - nothing here includes Python.h.
 */
#ifndef WX_COMMON_H
#define WX_COMMON_H

#include <errno.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define WX_UNUSED(x) ((void)(x))
/* Room for one error text: a native message nests the messages of the calls below it
 * (provider error, peer name, task), so it is generous; a text that would not fit ends in
 * "..." instead of being cut silently. */
#define WX_ERRMSG_MAX 4096
#define WX_NAME_MAX 192 /* a peer's name in messages: "peer 3 (fabric fi_sockaddr_in6://...)" */

#if defined(__GNUC__)
#define WX_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define WX_PRINTF(a, b)
#endif

/* Record the reason for a failure on this thread; returns `err` (a negative errno) so that
 * callers can write `return wx_errf(-EINVAL, "offset %llu past end", off);`. */
int wx_errf(int err, const char *fmt, ...) WX_PRINTF(2, 3);
/* The message recorded by the last wx_errf on this thread ("" if none). */
const char *wx_last_error(void);
void wx_clear_error(void);

/* Monotonic clock in nanoseconds. */
uint64_t wx_now_ns(void);
/* The CLOCK_MONOTONIC time `ns` from now, for pthread_cond_timedwait on a condition
 * variable created with pthread_condattr_setclock(CLOCK_MONOTONIC). */
struct timespec;
void wx_deadline_after(struct timespec *ts, uint64_t ns);

/* Debug logging to stderr, enabled by WXFER_DEBUG=1. */
void wx_debugf(const char *fmt, ...) WX_PRINTF(1, 2);

/* Options handed to a transport: a flat list of key=value strings, parsed by the backend. */
typedef struct wx_opts {
    int n;
    const char *const *keys;
    const char *const *vals;
} wx_opts_t;

/* Value for `key`, or `dflt` when absent. */
const char *wx_opt_str(const wx_opts_t *o, const char *key, const char *dflt);
/* Integer (accepts K/M/G/Ki/Mi/Gi suffixes); returns -EINVAL via wx_errf on bad text. */
int wx_opt_u64(const wx_opts_t *o, const char *key, uint64_t dflt, uint64_t *out);
/* Every key in `o` must be one of `known` (NULL-terminated); otherwise -EINVAL naming it. */
int wx_opt_check(const wx_opts_t *o, const char *transport, const char *const *known);

/* Parse "64MiB", "2GiB", "1000", "4k" into bytes. */
int wx_parse_size(const char *s, uint64_t *out);

#ifdef __cplusplus
}
#endif
#endif
