/* wx_engine_info.c - what the engine reports: failed peers, writes still out, the sticky
 * error, counters, the trace. Each takes the engine's mutex briefly. */
#include "wx_engine_int.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void wx__fail_fill(wx_engine_fail_t *f, int err, const wx__task_t *t, const wx_peer_t *p,
                   const char *stage, const char *fmt, ...)
{
    va_list ap;
    f->err = err;
    f->task = t ? t->id : 0;
    f->tag = t ? t->spec.tag : 0;
    f->peer = p ? (int64_t)p->id : -1;
    f->stage = stage;
    int n;
    va_start(ap, fmt);
    n = vsnprintf(f->reason, sizeof f->reason, fmt, ap);
    va_end(ap);
    if (n >= (int)sizeof f->reason)
        memcpy(f->reason + sizeof f->reason - 4, "...", 4);
}

void wx_engine_fail_msg(const wx_engine_fail_t *f, char *buf, size_t len)
{
    char peer[32] = "";
    if (f->peer >= 0)
        snprintf(peer, sizeof peer, ", peer %lld", (long long)f->peer);
    if (f->task)
        snprintf(buf, len, "task %llu (tag %llu)%s, %s: %s", (unsigned long long)f->task,
                 (unsigned long long)f->tag, peer, f->stage ? f->stage : "?", f->reason);
    else
        snprintf(buf, len, "%s%s: %s", f->stage ? f->stage : "?", peer, f->reason);
}

uint32_t wx_engine_failed_peers(wx_engine_t *e, wx_engine_fail_t *out, uint32_t max)
{
    uint32_t n;
    pthread_mutex_lock(&e->mu);
    n = e->nfailed;
    for (uint32_t i = 0; i < n && i < max; i++)
        out[i] = e->failed[i].f;
    pthread_mutex_unlock(&e->mu);
    return n;
}

uint64_t wx_engine_writes_out(wx_engine_t *e)
{
    uint64_t n;
    pthread_mutex_lock(&e->mu);
    n = e->refs - (e->destroyed ? 0 : 1);
    pthread_mutex_unlock(&e->mu);
    return n;
}

int wx_engine_error(wx_engine_t *e, wx_engine_fail_t *f)
{
    int err;
    pthread_mutex_lock(&e->mu);
    err = e->err;
    if (f)
        *f = e->fail;
    pthread_mutex_unlock(&e->mu);
    return err;
}

void wx_engine_clear_error(wx_engine_t *e)
{
    pthread_mutex_lock(&e->mu);
    e->err = 0;
    memset(&e->fail, 0, sizeof e->fail);
    pthread_mutex_unlock(&e->mu);
}

void wx_engine_stats(wx_engine_t *e, wx_engine_stats_t *s)
{
    pthread_mutex_lock(&e->mu);
    s->submitted = e->submitted;
    s->completed = e->completed;
    s->bytes_written = e->bytes_written;
    s->held = e->held;
    s->held_peak = e->held_peak;
    s->inflight = e->inflight;
    s->trace_dropped = e->trace_dropped;
    s->bytes_external = e->bytes_external;
    pthread_mutex_unlock(&e->mu);
}

/* Keep rec in the trace ring (the oldest record makes room once it is full). mu held. */
void wx__trace_add(wx_engine_t *e, const wx_trace_rec_t *rec)
{
    if (e->ntrace == e->cap_trace && e->cap_trace < WX_ENGINE_TRACE_MAX) {
        size_t cap = e->cap_trace ? 2 * e->cap_trace : 256;
        wx_trace_rec_t *nt;
        if (cap > WX_ENGINE_TRACE_MAX)
            cap = WX_ENGINE_TRACE_MAX;
        nt = realloc(e->trace, cap * sizeof *nt);
        if (nt) {
            e->trace = nt;
            e->cap_trace = cap;
        }
    }
    if (e->ntrace < e->cap_trace) {
        e->trace[e->ntrace++] = *rec;
    } else if (e->cap_trace) { /* full (or out of memory to grow): overwrite the oldest */
        e->trace[e->trace_head] = *rec;
        e->trace_head = (e->trace_head + 1) % e->cap_trace;
        e->trace_dropped++;
    } else {
        e->trace_dropped++;
    }
}

int wx_engine_trace(wx_engine_t *e, wx_trace_rec_t **out, size_t *n, uint64_t *dropped)
{
    size_t first;
    pthread_mutex_lock(&e->mu);
    *out = malloc((e->ntrace ? e->ntrace : 1) * sizeof **out);
    if (!*out) {
        pthread_mutex_unlock(&e->mu);
        return wx_errf(-ENOMEM, "trace: out of memory");
    }
    first = e->ntrace - e->trace_head; /* records from the oldest to the ring's end */
    memcpy(*out, e->trace + e->trace_head, first * sizeof **out);
    memcpy(*out + first, e->trace, e->trace_head * sizeof **out);
    *n = e->ntrace;
    if (dropped)
        *dropped = e->trace_dropped;
    pthread_mutex_unlock(&e->mu);
    return 0;
}

void wx_engine_trace_clear(wx_engine_t *e)
{
    pthread_mutex_lock(&e->mu);
    e->ntrace = 0;
    e->trace_head = 0;
    e->trace_dropped = 0;
    pthread_mutex_unlock(&e->mu);
}
