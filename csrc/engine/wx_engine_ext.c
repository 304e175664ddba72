/* wx_engine_ext.c - external tasks (wx_task_spec_t.external): destinations whose bytes the
 * caller writes itself (an in-place kernel into a peer's memory mapped here), so nothing is
 * posted. The ready stage waits for the task's signal -- its CUDA event, looked at every
 * 20 us and never blocked on, or the host's wx_engine_external_done -- until the engine's
 * timeout; the post stage finishes it once the fence before it has (as it would post a write
 * task's first write), so a fence after it, wx_engine_wait(_fence) and the trace count it. */
#include "wx_engine_int.h"

#include <stdio.h>
#include <string.h>

#define WX__EXT_EVENT_NS (20 * 1000ull)       /* between looks at a CUDA event */
#define WX__EXT_HOST_NS (10 * 1000 * 1000ull) /* a host signal wakes the wait; else this */

/* The first destination of t whose peer has not failed, or NULL when all have. mu held. */
static const wx_dest_t *wx__ext_live(const wx_engine_t *e, const wx__task_t *t)
{
    for (uint32_t i = 0; i < t->spec.ndests; i++)
        if (!wx__peer_failed(e, t->dests[i].peer))
            return &t->dests[i];
    return NULL;
}

/* t's writes failed (err, at stage): with isolate each of its live peers fails alone (the
 * post stage then skips them), else the engine fails naming its first live peer. The
 * reason: "in-place writes to <peer> <what>". mu held. */
static void wx__ext_fail(wx_engine_t *e, wx__task_t *t, int err, const char *stage,
                         const char *what)
{
    wx_engine_fail_t f;
    for (uint32_t i = 0; i < t->spec.ndests; i++) {
        wx_peer_t *p = t->dests[i].peer;
        if (wx__peer_failed(e, p))
            continue;
        wx__fail_fill(&f, err, t, p, stage, "in-place writes to %s %s", p->name, what);
        if (!e->o.isolate) {
            t->status = err;
            wx__set_error(e, &f);
            return;
        }
        wx__fail_peer(e, p, &f); /* (its other destinations now count as failed) */
    }
}

static void wx__ext_sleep(wx_engine_t *e, uint64_t ns)
{
    struct timespec ts;
    wx_deadline_after(&ts, ns);
    pthread_cond_timedwait(&e->cv_ready, &e->mu, &ts);
}

/* t's CUDA event looked at once (mu released meanwhile): 1 done, 0 not yet, -1 failed (the
 * engine's error set). mu held. */
static int wx__ext_event(wx_engine_t *e, wx__task_t *t)
{
    wx_engine_fail_t f;
    const wx_dest_t *d;
    int rc;
    pthread_mutex_unlock(&e->mu);
    rc = wx__query_event(e, t, &f);
    pthread_mutex_lock(&e->mu);
    if (rc >= 0)
        return rc;
    /* the device failed (not a peer): the engine fails, naming the writes it leaves unknown */
    d = wx__ext_live(e, t);
    if (d) {
        char why[sizeof f.reason];
        memcpy(why, f.reason, sizeof why);
        wx__fail_fill(&f, rc, t, d->peer, "ready", "in-place writes to %s: %s", d->peer->name, why);
    }
    t->status = rc;
    wx__set_error(e, &f);
    return -1;
}

void wx__ext_ready(wx_engine_t *e, wx__task_t *t)
{
    uint64_t deadline = wx_now_ns() + e->o.timeout_ns;
    char what[WX_ERRMSG_MAX];
    e->ready_cur = t;
    /* the engine failed or stops, or every peer of t failed: the post stage cancels or skips */
    while (!e->err && !e->stop && wx__ext_live(e, t)) {
        if (t->ext_signal) {
            int st = t->ext_status;
            if (st) {
                snprintf(what, sizeof what, "failed: %s (errno %d: %s)",
                         t->ext_why[0] ? t->ext_why : "no reason given", -st, strerror(-st));
                wx__ext_fail(e, t, st, "write", what);
            }
            break;
        }
        if (t->spec.cuda_event && wx__ext_event(e, t))
            break; /* done, or the engine failed */
        if (wx_now_ns() > deadline)
            deadline = wx__word_ready_deadline(e, deadline); /* behind a held fence word */
        if (wx_now_ns() > deadline) {
            snprintf(what, sizeof what,
                     "(%llu bytes) not signalled complete after %.1f s (%s; is the writer "
                     "alive?)",
                     (unsigned long long)t->rec.bytes, (double)e->o.timeout_ns / 1e9,
                     t->spec.cuda_event ? "its CUDA event did not complete"
                                        : "nothing signalled its completion");
            wx__ext_fail(e, t, -ETIMEDOUT, "deadline", what);
            break;
        }
        wx__ext_sleep(e, t->spec.cuda_event ? WX__EXT_EVENT_NS : WX__EXT_HOST_NS);
    }
    e->ready_cur = NULL;
}

int wx__ext_post(wx_engine_t *e, wx__task_t *t)
{
    uint32_t done = 0, skipped = 0;
    uint64_t bytes = 0;
    int status = t->status;
    /* as a write task's first post: after the writes of the fence before it (and, a fence
     * itself, after every earlier write) have completed */
    if (!e->err && !status && (e->fence_pending || t->spec.fence) && e->inflight > 0)
        return 0;
    if (e->err || status) {
        status = status ? status : -ECANCELED;
    } else {
        e->fence_pending = 0;
        for (uint32_t i = 0; i < t->spec.ndests; i++) {
            if (wx__peer_failed(e, t->dests[i].peer)) {
                skipped++;
            } else {
                done++;
                bytes += t->dests[i].len;
            }
        }
        status = skipped ? -EHOSTUNREACH : 0;
        e->bytes_external += bytes;
        t->rec.t_post_first = t->rec.t_post_last = wx_now_ns();
    }
    wx__q_pop(&e->post);
    t->in_post = 0;
    t->posted = t->completed = done; /* its signalled destinations: the trace's nwrites */
    t->skipped = skipped;
    wx__finish(e, t, status);
    return 1;
}

static wx__task_t *wx__ext_find(wx__queue_t *q, uint64_t id)
{
    for (wx__task_t *t = q->head; t; t = t->next)
        if (t->id == id)
            return t;
    return NULL;
}

int wx_engine_external_done(wx_engine_t *e, uint64_t id, int status, const char *reason)
{
    wx__task_t *t;
    int rc = 0;
    if (status > 0)
        return wx_errf(-EINVAL, "external task %llu: status %d: 0 or a negative errno",
                       (unsigned long long)id, status);
    pthread_mutex_lock(&e->mu);
    t = e->ready_cur && e->ready_cur->id == id ? e->ready_cur : wx__ext_find(&e->ready, id);
    if (!t) {
        wx__task_t *p = wx__ext_find(&e->post, id); /* past its wait: signalled, or skipped */
        rc = p && p->spec.external && p->ext_signal ? -EALREADY : -ENOENT;
    } else if (!t->spec.external) {
        rc = -ENOENT;
    } else if (t->spec.cuda_event) {
        rc = -EINVAL;
    } else if (t->ext_signal) {
        rc = -EALREADY;
    } else {
        t->ext_signal = 1;
        t->ext_status = status;
        snprintf(t->ext_why, sizeof t->ext_why, "%s", reason ? reason : "");
        pthread_cond_broadcast(&e->cv_ready);
    }
    pthread_mutex_unlock(&e->mu);
    if (rc == -ENOENT)
        return wx_errf(rc, "task %llu is not an external task waiting for its signal",
                       (unsigned long long)id);
    if (rc == -EALREADY)
        return wx_errf(rc, "external task %llu was signalled already", (unsigned long long)id);
    if (rc == -EINVAL)
        return wx_errf(rc, "external task %llu waits for its CUDA event, not a host signal",
                       (unsigned long long)id);
    return 0;
}
