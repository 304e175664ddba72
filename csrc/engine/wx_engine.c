/* wx_engine.c - per-stage FIFO queues, watermark, chunked posting, completions, trace.
 * See wx_engine.h for the flow. One mutex guards the engine's queues and counters; the
 * transport is called without it held. */
#include "wx_engine_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif

#define WX__IDLE_NS (100 * 1000 * 1000ull)      /* how long an idle stage thread sleeps */
#define WX__EAGAIN_MIN_NS (1000 * 1000ull)      /* retry after a transport's -EAGAIN ... */
#define WX__EAGAIN_MAX_NS (32 * 1000 * 1000ull) /* ... backing off up to this */

static void wx__q_push(wx__queue_t *q, wx__task_t *t)
{
    t->next = NULL;
    if (q->tail)
        q->tail->next = t;
    else
        q->head = t;
    q->tail = t;
}

wx__task_t *wx__q_pop(wx__queue_t *q)
{
    wx__task_t *t = q->head;
    if (t) {
        q->head = t->next;
        if (!q->head)
            q->tail = NULL;
        t->next = NULL;
    }
    return t;
}

static void wx__wait(pthread_cond_t *cv, pthread_mutex_t *mu, uint64_t ns)
{
    struct timespec ts;
    wx_deadline_after(&ts, ns);
    pthread_cond_timedwait(cv, mu, &ts);
}

static void wx__init_cond(pthread_cond_t *cv)
{
    pthread_condattr_t a;
    pthread_condattr_init(&a);
    pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
    pthread_cond_init(cv, &a);
    pthread_condattr_destroy(&a);
}

/* First error sticks. Called with mu held. */
void wx__set_error(wx_engine_t *e, const wx_engine_fail_t *f)
{
    if (e->err)
        return;
    e->err = f->err;
    e->fail = *f;
    pthread_cond_broadcast(&e->cv_ready);
    pthread_cond_broadcast(&e->cv_admit);
    pthread_cond_broadcast(&e->cv_done);
    pthread_cond_broadcast(&e->cv_post);
}


/* The sticky error, with its message in wx_last_error(). mu held. */
static int wx__errf_sticky(wx_engine_t *e)
{
    char msg[WX_ERRMSG_MAX + 256];
    wx_engine_fail_msg(&e->fail, msg, sizeof msg);
    return wx_errf(e->err, "%s", msg);
}

static void wx__free_engine(wx_engine_t *e)
{
    wx__task_t *t;
    while ((t = wx__q_pop(&e->done))) {
        free(t->ops);
        free(t->dests);
        free(t);
    }
    pthread_mutex_destroy(&e->mu);
    pthread_cond_destroy(&e->cv_admit);
    pthread_cond_destroy(&e->cv_ready);
    pthread_cond_destroy(&e->cv_post);
    pthread_cond_destroy(&e->cv_done);
    free(e->trace);
    free(e);
}

static void wx__active_remove(wx_engine_t *e, wx__task_t *t);

/* Called with mu held when a task will see no more completions. */
void wx__finish(wx_engine_t *e, wx__task_t *t, int status)
{
    if (t->finished)
        return;
    t->finished = 1;
    if (!t->status)
        t->status = status;
    t->rec.t_done = wx_now_ns();
    if (t->status || !t->rec.status) /* else: destinations skipped (isolate), said already */
        t->rec.status = t->status;
    t->rec.nwrites = t->completed;
    wx__active_remove(e, t);
    e->held -= t->spec.held_bytes;
    e->completed++;
    if (t->spec.fence && t->id > e->fence_done) {
        e->fence_done = t->id;
        wx__word_fence_done(e, t); /* the word: stored, or held for a peer not fenced yet */
    }
    wx__trace_add(e, &t->rec);
    if (t->completed == t->posted) { /* else: abandoned writes still out (isolate) */
        t->queued_done = 1;
        wx__q_push(&e->done, t);
    }
    pthread_cond_broadcast(&e->cv_done);
    pthread_cond_broadcast(&e->cv_admit);
}

/* isolate: peer p fails for task t's deadline. mu held. */
static void wx__fail_late(wx_engine_t *e, const wx__task_t *t, wx_peer_t *p, const char *what,
                          const char *why)
{
    wx_engine_fail_t f;
    wx__fail_fill(&f, -ETIMEDOUT, t, p, "deadline", "writes to %s %s %.1f s%s (is the peer alive?)",
                  p->name, what, (double)e->o.timeout_ns / 1e9, why);
    wx__fail_peer(e, p, &f);
}

/* Called with mu held: fail the engine if a posted task has outlived its deadline; with
 * isolate, fail only the peers whose writes are late. */
static void wx__check_deadlines(wx_engine_t *e)
{
    uint64_t now = wx_now_ns();
    wx_engine_fail_t f;
    for (wx__task_t *t = e->active; t; t = t->act_next) {
        if (now <= t->deadline || e->err)
            continue;
        if (e->o.isolate) {
            /* the transport keeps refusing the write at the cursor (-EAGAIN: e.g. a provider
             * reconnecting to a dead peer, which can also hold up the completions of the
             * writes already posted to live peers): blame the refused peer first, and give
             * the task's other writes half a timeout more to complete once it is skipped */
            if (t->in_post && t->refused && t->cur_dest < t->spec.ndests &&
                !wx__peer_failed(e, t->dests[t->cur_dest].peer)) {
                t->deadline = now + e->o.timeout_ns / 2; /* (t is in_post: not finished below) */
                wx__fail_late(e, t, t->dests[t->cur_dest].peer, "not accepted for",
                              ": the transport keeps refusing them");
                return;
            }
            for (uint32_t i = 0; i < t->posted; i++) {
                wx__eop_t *eo = &t->ops[i];
                wx_peer_t *p = t->dests[eo->dest].peer;
                if (eo->done || eo->abandoned || wx__peer_failed(e, p))
                    continue;
                wx__fail_late(e, t, p, "not complete after", "");
                return; /* the active list may have changed; the next check goes on */
            }
            /* nothing of it in flight, yet still posting: the transport keeps refusing the
             * write at the cursor (-EAGAIN, e.g. a provider reconnecting to a dead peer).
             * Blame that peer, or this task would hold up every other peer's writes. */
            if (t->in_post && t->cur_dest < t->spec.ndests &&
                !wx__peer_failed(e, t->dests[t->cur_dest].peer)) {
                wx__fail_late(e, t, t->dests[t->cur_dest].peer, "not accepted for",
                              ": the transport keeps refusing them");
                return;
            }
            continue;
        }
        {
            const wx_dest_t *d = &t->dests[t->cur_dest < t->spec.ndests ? t->cur_dest : 0];
            wx__fail_fill(&f, -ETIMEDOUT, t, d->peer, "deadline",
                          "%u of %u writes to %s not complete after %.1f s (is the peer alive?)",
                          t->posted - t->completed, t->nchunks, d->peer->name,
                          (double)e->o.timeout_ns / 1e9);
            wx__set_error(e, &f);
        }
    }
}

static void wx__op_done(wx_op_t *op, int status, const char *why)
{
    wx__eop_t *eo = (wx__eop_t *)op;
    wx__task_t *t = eo->task;
    wx_engine_t *e = (wx_engine_t *)op->user;
    int free_now;
    pthread_mutex_lock(&e->mu);
    t->completed++;
    eo->done = 1;
    if (!eo->abandoned) {
        e->inflight--;
        t->live--;
    } else {
        wx__word_abandoned_done(e, eo); /* its peer: none out, a held word may go on */
    }
    if (status == 0) {
        e->bytes_written += eo->len;
    } else if (!eo->abandoned) {
        wx_engine_fail_t f;
        const wx_dest_t *d = &t->dests[eo->dest];
        eo->failed = 1; /* (before its peer fails: a fence finished there holds the word) */
        wx__fail_fill(&f, status, t, d->peer, "write", "write to %s failed: %s (errno %d: %s)",
                      d->peer->name, why ? why : "no reason given", -status, strerror(-status));
        if (e->o.isolate) {
            wx__fail_peer(e, d->peer, &f);
        } else {
            if (!t->status)
                t->status = status;
            wx__set_error(e, &f);
        }
    }
    if (t->finished) {
        /* a late completion of an abandoned write: the task can go once all are back */
        if (!t->queued_done && t->completed == t->posted) {
            t->queued_done = 1;
            wx__q_push(&e->done, t);
            pthread_cond_broadcast(&e->cv_done);
        }
    } else if (!t->in_post && t->live == 0) {
        wx__finish(e, t, 0);
    }
    pthread_cond_broadcast(&e->cv_post);
    e->refs--;
    free_now = e->destroyed && e->refs == 0;
    pthread_mutex_unlock(&e->mu);
    if (free_now)
        wx__free_engine(e);
}

/* t is ready: onto the post queue (mu held) */
static void wx__to_post(wx_engine_t *e, wx__task_t *t)
{
    t->rec.t_ready = wx_now_ns();
    t->in_post = 1;
    wx__q_push(&e->post, t);
    pthread_cond_broadcast(&e->cv_post);
}

/* Whether a task just submitted skips the ready thread (its wake-up: 46-76 us on one H100
 * host, issue 37): nothing to wait for (a write with no CUDA event: the version stamps) and
 * nothing ahead of it in the ready stage, so the tasks' order is kept. mu held. */
static int wx__ready_skip(const wx_engine_t *e, const wx__task_t *t)
{
    return !t->spec.external && !t->spec.cuda_event && !e->ready.head && !e->ready_busy && !e->stop;
}

/* Stage: wait for the buffer to be produced. */
static void *wx__ready_main(void *arg)
{
    wx_engine_t *e = arg;
    wx_engine_fail_t f;
#ifdef __linux__
    /* its looks at CUDA events sleep 20 us (wx__wait_event, wx__ext_sleep): with the default
     * 50 us timer slack each took about 70 us, so the end stamps of a push followed its last
     * in-place write that much later (issue 37); the cuda_ipc poller does the same */
    prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);
#endif
    pthread_mutex_lock(&e->mu);
    while (!e->stop) {
        wx__task_t *t = wx__q_pop(&e->ready);
        if (!t) {
            wx__wait(&e->cv_ready, &e->mu, WX__IDLE_NS);
            continue;
        }
        e->ready_busy = 1; /* (a task submitted meanwhile queues behind t: wx__ready_skip) */
        if (t->spec.external) {
            wx__ext_ready(e, t);
        } else if (t->spec.cuda_event && !e->err) {
            int rc;
            pthread_mutex_unlock(&e->mu);
            rc = wx__wait_event(e, t, &f);
            pthread_mutex_lock(&e->mu);
            if (rc) {
                t->status = rc;
                wx__set_error(e, &f);
            }
        }
        e->ready_busy = 0;
        wx__to_post(e, t);
    }
    pthread_mutex_unlock(&e->mu);
    return NULL;
}

/* The active list: posted, unfinished tasks, which the deadline checks and a failing peer
 * walk. mu held. */
static void wx__active_add(wx_engine_t *e, wx__task_t *t)
{
    t->on_active = 1;
    t->act_prev = NULL;
    t->act_next = e->active;
    if (e->active)
        e->active->act_prev = t;
    e->active = t;
}

static void wx__active_remove(wx_engine_t *e, wx__task_t *t)
{
    if (!t->on_active)
        return;
    t->on_active = 0;
    if (t->act_prev)
        t->act_prev->act_next = t->act_next;
    else
        e->active = t->act_next;
    if (t->act_next)
        t->act_next->act_prev = t->act_prev;
    t->act_prev = t->act_next = NULL;
}

/* isolate: move t's cursor past the rest of every destination whose peer failed. mu held. */
static void wx__post_skip_failed(wx_engine_t *e, wx__task_t *t)
{
    while (e->o.isolate && t->cur_dest < t->spec.ndests &&
           wx__peer_failed(e, t->dests[t->cur_dest].peer)) {
        const wx_dest_t *d = &t->dests[t->cur_dest];
        t->skipped += (uint32_t)((d->len - t->cur_off + e->o.chunk - 1) / e->o.chunk);
        t->cur_dest++;
        t->cur_off = 0;
        if (!t->rec.status)
            t->rec.status = -EHOSTUNREACH;
    }
}

/* The head task t is done posting (all posted or skipped, or the engine failed): off the
 * post queue, and finished once nothing of it is in flight. mu held. */
static void wx__post_retire(wx_engine_t *e, wx__task_t *t)
{
    wx__q_pop(&e->post);
    t->in_post = 0;
    if (t->id > e->posted_done) {
        e->posted_done = t->id;
        if (e->posted_waiters) /* wx_engine_wait_posted (other waiters need not wake here) */
            pthread_cond_broadcast(&e->cv_done);
    }
    if (t->posted + t->skipped == t->nchunks && !t->status)
        t->rec.t_post_last = wx_now_ns();
    else if (!t->status)
        t->status = -ECANCELED; /* the engine failed elsewhere */
    if (t->live == 0)
        wx__finish(e, t, t->status);
}

/* Post the chunk of t at its cursor; mu held, released around the transport's call.
 * Returns 0 when posted (the cursor moved on), else the transport's error, with the write
 * undone and, for errors other than -EAGAIN, its failure in *f. */
static int wx__post_chunk(wx_engine_t *e, wx__task_t *t, wx_engine_fail_t *f)
{
    const wx_dest_t *d = &t->dests[t->cur_dest];
    uint64_t len = d->len - t->cur_off;
    wx__eop_t *eo = &t->ops[t->posted];
    wx_wr_t wr;
    int rc;
    if (len > e->o.chunk)
        len = e->o.chunk;
    wr.local = t->spec.src;
    wr.loff = d->loff + t->cur_off;
    wr.remote = &d->ri;
    wr.roff = d->roff + t->cur_off;
    wr.len = len;
    eo->op.done = wx__op_done;
    eo->op.user = e;
    eo->op.wr_id = (t->id << 20) | t->posted;
    eo->task = t;
    eo->len = len;
    eo->dest = t->cur_dest;
    if (!t->on_active) {
        t->rec.t_post_first = wx_now_ns();
        t->deadline = t->rec.t_post_first + e->o.timeout_ns;
        wx__active_add(e, t);
    }
    t->posted++;
    t->live++;
    e->inflight++;
    e->refs++;
    pthread_mutex_unlock(&e->mu);
    rc = wx_post_write(e->t, d->peer, &wr, &eo->op);
    if (rc && rc != -EAGAIN)
        wx__fail_fill(f, rc, t, d->peer, "post", "posting a write to %s failed: %s", d->peer->name,
                      wx_last_error());
    pthread_mutex_lock(&e->mu);
    if (rc) {
        t->posted--;
        if (!eo->abandoned) { /* else wx__fail_peer ran meanwhile and counted it */
            t->live--;
            e->inflight--;
        } else {
            wx__word_abandoned_done(e, eo); /* it will not complete: not out */
        }
        e->refs--;
        memset(eo, 0, sizeof *eo);
        return rc;
    }
    t->cur_off += len;
    if (t->cur_off == d->len) {
        t->cur_dest++;
        t->cur_off = 0;
    }
    return 0;
}

/* Move head task t of the post stage on `event` (wx_post_step.c's table); returns the
 * action. A move the table does not have is a bug: the engine fails naming the task, its
 * state and the event, and the task retires. mu held. */
static int wx__post_move(wx_engine_t *e, wx__task_t *t, int event)
{
    int next, action;
    if (wx_tpost_next(t->pstate, event, &next, &action)) {
        wx_engine_fail_t f;
        const char *sn = wx_tpost_state_name(t->pstate), *en = wx_tpost_event_name(event);
        wx__fail_fill(&f, -EPROTO, t, NULL, "post", "task %llu: no post-stage move from %s on %s",
                      (unsigned long long)t->id, sn ? sn : "?", en ? en : "?");
        if (!t->status)
            t->status = -EPROTO;
        wx__set_error(e, &f);
        t->pstate = WX_TP_RETIRED;
        return WX_TPA_RETIRE;
    }
    t->pstate = next;
    return action;
}

/* What the post thread sees of head task t (mu held). */
static int wx__post_look(wx_engine_t *e, wx__task_t *t)
{
    wx_tpost_view_t v = {
        .settled = e->err || t->status || t->posted + t->skipped == t->nchunks,
        .fence_pending = e->fence_pending,
        .is_fence = t->spec.fence,
        .posted = t->posted,
        .inflight = e->inflight,
        .depth = e->o.depth,
    };
    return wx_tpost_look(&v);
}

/* Stage: split into chunks and post them, keeping at most depth in flight; each head task
 * moves along wx_post_step.c's table (its pstate), the actions done here. */
static void *wx__post_main(void *arg)
{
    wx_engine_t *e = arg;
    wx_engine_fail_t f;
    uint64_t eagain_ns = WX__EAGAIN_MIN_NS;
    int rc, act;
    pthread_mutex_lock(&e->mu);
    while (!e->stop) {
        wx__task_t *t = e->post.head;
        if (e->fencing_peers) {
            wx__fence_failed_peers(e);
            continue;
        }
        if (!t) {
            wx__check_deadlines(e);
            wx__wait(&e->cv_post, &e->mu, WX__IDLE_NS);
            continue;
        }
        if (t->spec.external) {
            if (!wx__ext_post(e, t)) { /* waits for the fence before it */
                wx__check_deadlines(e);
                wx__wait(&e->cv_post, &e->mu, 10 * 1000 * 1000ull);
            }
            continue;
        }
        wx__post_skip_failed(e, t);
        act = wx__post_move(e, t, wx__post_look(e, t));
        if (act == WX_TPA_RETIRE) {
            if (t->spec.fence)
                e->fence_pending = 1; /* later tasks wait until its writes have completed */
            wx__post_retire(e, t);
            continue;
        }
        if (act == WX_TPA_WAIT) { /* a fence to keep, or depth writes in flight */
            wx__check_deadlines(e);
            wx__wait(&e->cv_post, &e->mu, 10 * 1000 * 1000ull);
            continue;
        }
        e->fence_pending = 0; /* (POST) nothing in flight behind the fence any more */
        rc = wx__post_chunk(e, t, &f);
        switch (wx__post_move(e, t, wx_tpost_result(rc, e->o.isolate))) {
        case WX_TPA_NONE:
            eagain_ns = WX__EAGAIN_MIN_NS;
            t->refused = 0;
            break;
        case WX_TPA_BACKOFF:
            t->refused = 1;
            /* woken by the next completion; else back off (1 ms doubling to 32 ms), so that
             * a peer the provider keeps refusing (reconnecting to a dead one) is not retried
             * 1000 times a second until its deadline */
            wx__check_deadlines(e);
            wx__wait(&e->cv_post, &e->mu, eagain_ns);
            if (eagain_ns < WX__EAGAIN_MAX_NS)
                eagain_ns *= 2;
            break;
        case WX_TPA_FAIL_PEER:
            wx__fail_peer(e, t->dests[t->cur_dest].peer, &f); /* the loop skips its writes */
            break;
        case WX_TPA_FAIL_ENGINE:
            t->status = rc;
            wx__set_error(e, &f);
            break;
        default: /* RETIRE: the table refused the move (the engine failed); looked at again */
            break;
        }
    }
    pthread_mutex_unlock(&e->mu);
    return NULL;
}

int wx_engine_create(wx_transport_t *t, const wx_engine_opts_t *o, wx_engine_t **out)
{
    wx_engine_t *e = calloc(1, sizeof *e);
    if (!e)
        return wx_errf(-ENOMEM, "engine: out of memory");
    e->t = t;
    e->o = *o;
    if (!e->o.chunk || e->o.chunk > t->max_write)
        e->o.chunk = t->max_write;
    if (!e->o.depth || e->o.depth > t->max_inflight)
        e->o.depth = t->max_inflight;
    if (!e->o.timeout_ns)
        e->o.timeout_ns = 30ull * 1000 * 1000 * 1000;
    pthread_mutex_init(&e->mu, NULL);
    wx__init_cond(&e->cv_admit);
    wx__init_cond(&e->cv_ready);
    wx__init_cond(&e->cv_post);
    wx__init_cond(&e->cv_done);
    e->refs = 1;
    e->next_id = 1;
    e->ready_dev = -1;
    /* Both stage threads are started here; each waits on its queue (no handshake: a task
     * submitted before a thread first runs waits in its queue until it does). */
    if (pthread_create(&e->th_ready, NULL, wx__ready_main, e)) {
        wx__free_engine(e);
        return wx_errf(-EAGAIN, "engine: cannot start the ready-stage thread");
    }
    if (pthread_create(&e->th_post, NULL, wx__post_main, e)) {
        pthread_mutex_lock(&e->mu);
        wx__set_stop(e);
        pthread_cond_broadcast(&e->cv_ready);
        pthread_mutex_unlock(&e->mu);
        pthread_join(e->th_ready, NULL);
        wx__free_engine(e);
        return wx_errf(-EAGAIN, "engine: cannot start the post-stage thread");
    }
    e->started = 1;
    *out = e;
    return 0;
}

void wx_engine_stop(wx_engine_t *e)
{
    wx__task_t *t;
    if (!e)
        return;
    pthread_mutex_lock(&e->mu);
    if (e->stopped) {
        pthread_mutex_unlock(&e->mu);
        return;
    }
    wx__set_stop(e);
    pthread_cond_broadcast(&e->cv_ready);
    pthread_cond_broadcast(&e->cv_post);
    pthread_mutex_unlock(&e->mu);
    pthread_join(e->th_ready, NULL);
    pthread_join(e->th_post, NULL);
    pthread_mutex_lock(&e->mu);
    /* Tasks that never reached the wire: finished as cancelled, their owners left for
     * the caller's wx_engine_reap. */
    while ((t = wx__q_pop(&e->ready)))
        wx__finish(e, t, -ECANCELED);
    while ((t = e->post.head)) {
        wx__q_pop(&e->post);
        t->in_post = 0;
        t->status = t->status ? t->status : -ECANCELED;
        if (t->live == 0)
            wx__finish(e, t, -ECANCELED);
    }
    e->stopped = 1;
    /* a fence whose writes are still out will not finish, a held word is not released: past
     * every task submitted (no stream waits on a stopped engine) */
    e->nhold = 0;
    e->hold_err = 0;
    wx__word_store(e, (uint32_t)e->next_id);
    pthread_mutex_unlock(&e->mu);
}

void wx_engine_set_fence_word(wx_engine_t *e, uint32_t *word)
{
    pthread_mutex_lock(&e->mu);
    /* a word replaced (or dropped) is set past every task first: no stream waits on it */
    if (e->fence_word && e->fence_word != word)
        __atomic_store_n(e->fence_word, (uint32_t)e->next_id, __ATOMIC_RELEASE);
    e->fence_word = word; /* it starts at the value the engine's word has now (held or not) */
    wx__word_store(e, e->stopped ? (uint32_t)e->next_id : e->word_val);
    pthread_mutex_unlock(&e->mu);
}

void wx_engine_destroy(wx_engine_t *e)
{
    int free_now;
    if (!e)
        return;
    wx_engine_stop(e);
    pthread_mutex_lock(&e->mu);
    e->destroyed = 1;
    e->refs--;
    free_now = e->refs == 0;
    pthread_mutex_unlock(&e->mu);
    if (free_now)
        wx__free_engine(e);
}

int wx_engine_admit(wx_engine_t *e, uint64_t held_bytes, uint64_t slice_ns, uint64_t *t_admit)
{
    uint64_t end = wx_now_ns() + slice_ns;
    int rc;
    pthread_mutex_lock(&e->mu);
    for (;;) {
        if (e->err) {
            rc = wx__errf_sticky(e);
            break;
        }
        if (!e->o.watermark || held_bytes == 0 || e->held == 0 ||
            e->held + held_bytes <= e->o.watermark) {
            e->held += held_bytes;
            if (e->held > e->held_peak)
                e->held_peak = e->held;
            *t_admit = wx_now_ns();
            rc = 0;
            break;
        }
        wx__check_deadlines(e);
        if (wx_now_ns() >= end) {
            rc = -EAGAIN;
            break;
        }
        wx__wait(&e->cv_admit, &e->mu,
                 end - wx_now_ns() < 50000000ull ? end - wx_now_ns() : 50000000ull);
    }
    pthread_mutex_unlock(&e->mu);
    return rc;
}

void wx_engine_unadmit(wx_engine_t *e, uint64_t held_bytes)
{
    pthread_mutex_lock(&e->mu);
    e->held -= held_bytes;
    pthread_cond_broadcast(&e->cv_admit);
    pthread_mutex_unlock(&e->mu);
}

int wx_engine_submit(wx_engine_t *e, const wx_task_spec_t *spec, uint64_t t_submit,
                     uint64_t t_admit, uint64_t *id)
{
    wx__task_t *t = calloc(1, sizeof *t);
    uint64_t nchunks = 0, chunk = e->o.chunk;
    if (!t)
        return wx_errf(-ENOMEM, "submit: out of memory");
    for (uint32_t i = 0; i < spec->ndests; i++) /* external: one signalled "write" per dest */
        nchunks += !spec->dests[i].len ? 0
                   : spec->external    ? 1
                                       : (spec->dests[i].len + chunk - 1) / chunk;
    if (nchunks >= (1u << 20)) {
        free(t);
        return wx_errf(-E2BIG, "submit: task needs %llu writes (at most %u per task)",
                       (unsigned long long)nchunks, 1u << 20);
    }
    t->dests = malloc((spec->ndests ? spec->ndests : 1) * sizeof *t->dests);
    t->ops = calloc(nchunks ? nchunks : 1, sizeof *t->ops);
    if (!t->dests || !t->ops) {
        free(t->dests);
        free(t->ops);
        free(t);
        return wx_errf(-ENOMEM, "submit: out of memory");
    }
    /* zero-length destinations are dropped so that the cursor never stalls on one */
    t->spec = *spec;
    t->spec.ndests = 0;
    for (uint32_t i = 0; i < spec->ndests; i++)
        if (spec->dests[i].len)
            t->dests[t->spec.ndests++] = spec->dests[i];
    t->spec.dests = t->dests;
    t->nchunks = (uint32_t)nchunks;
    t->rec.tag = spec->tag;
    t->rec.bytes = 0;
    for (uint32_t i = 0; i < spec->ndests; i++)
        t->rec.bytes += spec->dests[i].len;
    t->rec.held = spec->held_bytes;
    t->rec.kind = spec->external ? WX_TASK_EXTERNAL : WX_TASK_WRITE;
    t->rec.ndests = t->spec.ndests;
    t->rec.t_submit = t_submit;
    t->rec.t_admit = t_admit;
    pthread_mutex_lock(&e->mu);
    if (e->err) {
        int err = wx__errf_sticky(e);
        pthread_mutex_unlock(&e->mu);
        free(t->dests);
        free(t->ops);
        free(t);
        return err;
    }
    t->id = e->next_id++;
    t->rec.id = t->id;
    e->submitted++;
    *id = t->id;
    if (nchunks == 0) {
        t->rec.t_ready = t->rec.t_post_first = t->rec.t_post_last = wx_now_ns();
        wx__finish(e, t, 0);
    } else if (wx__ready_skip(e, t)) {
        wx__to_post(e, t);
    } else {
        wx__q_push(&e->ready, t);
        pthread_cond_broadcast(&e->cv_ready);
    }
    pthread_mutex_unlock(&e->mu);
    return 0;
}

/* What wx__wait_done waits for: every submitted task finished (a failed peer fenced first), fence
 * task `id` finished (or never submitted), or fence task `id` posted (its writes handed to the
 * transport; or finished, never submitted, or the engine stopped). */
enum { WX__UNTIL_ALL, WX__UNTIL_FENCE, WX__UNTIL_POSTED };

static int wx__reached(const wx_engine_t *e, int until, uint64_t id)
{
    if (until == WX__UNTIL_ALL) /* a failed peer is fenced before the engine says all done */
        return e->completed == e->submitted && (!e->fencing_peers || e->stop);
    if (until == WX__UNTIL_FENCE)
        return e->fence_done >= id || id >= e->next_id;
    return e->posted_done >= id || e->fence_done >= id || id >= e->next_id || e->stopped;
}

/* Wait up to slice_ns until the engine's sticky error (returned) or what `until` names (above).
 * -EAGAIN: the slice passed. A posted-waiter is counted (the post thread wakes those at each
 * retire; the others need not wake there). */
static int wx__wait_done(wx_engine_t *e, uint64_t slice_ns, int until, uint64_t id)
{
    uint64_t end = wx_now_ns() + slice_ns;
    int rc = 0;
    pthread_mutex_lock(&e->mu);
    for (;;) {
        wx__check_deadlines(e);
        if (e->err) {
            rc = wx__errf_sticky(e);
            break;
        }
        if (wx__reached(e, until, id))
            break;
        if (wx_now_ns() >= end) {
            rc = -EAGAIN;
            break;
        }
        e->posted_waiters += until == WX__UNTIL_POSTED;
        wx__wait(&e->cv_done, &e->mu,
                 end - wx_now_ns() < 50000000ull ? end - wx_now_ns() : 50000000ull);
        e->posted_waiters -= until == WX__UNTIL_POSTED;
    }
    pthread_mutex_unlock(&e->mu);
    return rc;
}

int wx_engine_wait(wx_engine_t *e, uint64_t slice_ns)
{
    return wx__wait_done(e, slice_ns, WX__UNTIL_ALL, 0);
}

int wx_engine_wait_posted(wx_engine_t *e, uint64_t slice_ns, uint64_t id)
{
    return wx__wait_done(e, slice_ns, WX__UNTIL_POSTED, id);
}

int wx_engine_wait_fence(wx_engine_t *e, uint64_t slice_ns, uint64_t id)
{
    return wx__wait_done(e, slice_ns, WX__UNTIL_FENCE, id);
}

int wx_engine_reap(wx_engine_t *e, void (*cb)(void *owner, void *arg), void *arg)
{
    wx__queue_t q;
    wx__task_t *t;
    int n = 0;
    pthread_mutex_lock(&e->mu);
    q = e->done;
    e->done.head = e->done.tail = NULL;
    pthread_mutex_unlock(&e->mu);
    while ((t = wx__q_pop(&q))) {
        if (cb)
            cb(t->spec.owner, arg);
        free(t->ops);
        free(t->dests);
        free(t);
        n++;
    }
    return n;
}
