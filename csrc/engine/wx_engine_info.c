/* wx_engine_info.c - what the engine reports: failed peers, writes still out, the sticky
 * error, counters, the trace. Each takes the engine's mutex briefly. */
#include "wx_engine_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

uint32_t wx_engine_failed_peers(wx_engine_t *e, uint32_t *ids, int *errs, char (*msgs)[WX_ERRMSG_MAX / 2],
                                uint32_t max)
{
    uint32_t n;
    pthread_mutex_lock(&e->mu);
    n = e->nfailed;
    for (uint32_t i = 0; i < n && i < max; i++) {
        ids[i] = e->failed[i].peer->id;
        errs[i] = e->failed[i].err;
        memcpy(msgs[i], e->failed[i].msg, sizeof msgs[i]);
    }
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

int wx_engine_error(wx_engine_t *e, char *msg, size_t len)
{
    int err;
    pthread_mutex_lock(&e->mu);
    err = e->err;
    if (msg && len)
        snprintf(msg, len, "%s", e->errmsg);
    pthread_mutex_unlock(&e->mu);
    return err;
}

void wx_engine_clear_error(wx_engine_t *e)
{
    pthread_mutex_lock(&e->mu);
    e->err = 0;
    e->errmsg[0] = '\0';
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
    pthread_mutex_unlock(&e->mu);
}

int wx_engine_trace(wx_engine_t *e, wx_trace_rec_t **out, size_t *n)
{
    pthread_mutex_lock(&e->mu);
    *out = malloc((e->ntrace ? e->ntrace : 1) * sizeof **out);
    if (!*out) {
        pthread_mutex_unlock(&e->mu);
        return wx_errf(-ENOMEM, "trace: out of memory");
    }
    memcpy(*out, e->trace, e->ntrace * sizeof **out);
    *n = e->ntrace;
    pthread_mutex_unlock(&e->mu);
    return 0;
}

void wx_engine_trace_clear(wx_engine_t *e)
{
    pthread_mutex_lock(&e->mu);
    e->ntrace = 0;
    pthread_mutex_unlock(&e->mu);
}
