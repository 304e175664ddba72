/* wx_fabric_data.c - the data path of the libfabric backend: posting writes, the progress
 * thread that reads the CQ, completions and errors, per-op deadlines.
 *
 * Every write is posted with FI_DELIVERY_COMPLETE, so its completion means the bytes are
 * in the target's memory (over tcp;ofi_rxm a plain completion can come earlier).
 *
 * Slots: one per outstanding write (depth of them), holding the provider's fi_context2
 * and the caller's op. A slot is FREE, POSTED (the provider owns it, done() pending) or
 * ABANDONED (its deadline passed: done(-ETIMEDOUT) was called, but the provider still owns
 * the context, so the slot is reused only after the provider completes it or the endpoint
 * is closed).
 */
#include "wx_fabric.h"

#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define WX_FAB_WAIT_MS 50 /* longest blocking CQ wait: bounds how long close() waits */
#define WX_FAB_SCAN_NS (100 * 1000000ull)
#define WX_FAB_BATCH 32
#define WX_FAB_EAGAIN_MAX_NS                                                                       \
    (30 * 1000000000ull) /* -FI_EAGAIN run that fails a peer when
                                                    * the op timeout is off */

int wx__fab_slots_init(wx_fab_t *f)
{
    f->slots = calloc(f->depth, sizeof *f->slots);
    if (!f->slots)
        return wx_errf(-ENOMEM, "fabric: out of memory for %u write slots", f->depth);
    for (uint32_t i = f->depth; i-- > 0;) {
        f->slots[i].next_free = f->free_slots;
        f->free_slots = &f->slots[i];
    }
    return 0;
}

static wx_fab_slot_t *wx__fab_slot_of(wx_fab_t *f, void *ctx)
{
    wx_fab_slot_t *s = ctx;
    if (!f->slots || s < f->slots || s >= f->slots + f->depth)
        return NULL;
    return s;
}

/* Release a slot (slot_lock held); returns its previous state. */
static int wx__fab_slot_put(wx_fab_t *f, wx_fab_slot_t *s)
{
    int state = s->state;
    if (state == WX_FAB_POSTED)
        f->posted--;
    else if (state == WX_FAB_ABANDONED)
        f->abandoned--;
    if (state != WX_FAB_FREE) {
        s->state = WX_FAB_FREE;
        s->op = NULL;
        s->next_free = f->free_slots;
        f->free_slots = s;
    }
    return state;
}

static int wx__fab_is_conn_error(int err)
{
    switch (err) {
    case ECONNREFUSED:
    case ECONNRESET:
    case ECONNABORTED:
    case ENOTCONN:
    case EPIPE:
    case EHOSTUNREACH:
    case ENETUNREACH:
    case ETIMEDOUT:
    case EHOSTDOWN:
    case ESHUTDOWN:
        return 1;
    default:
        return 0;
    }
}

static void wx__fab_peer_fail(wx_fab_peer_t *fp, int err, const char *why)
{
    if (!fp || fp->failed)
        return;
    snprintf(fp->why, sizeof fp->why, "%s", why);
    fp->failed = err;
}

/* A completion for ctx: free the slot, then (outside every lock) tell the caller. */
static void wx__fab_finish(wx_fab_t *f, void *ctx, int status, const char *msg)
{
    wx_fab_slot_t *s = wx__fab_slot_of(f, ctx);
    wx_op_t *op;
    wx_fab_peer_t *fp;
    int state;
    if (!s) {
        wx_debugf("fabric: completion with unknown context %p (status %d)", ctx, status);
        return;
    }
    pthread_mutex_lock(&f->slot_lock);
    op = s->op;
    fp = s->fp;
    state = wx__fab_slot_put(f, s);
    pthread_mutex_unlock(&f->slot_lock);
    if (state == WX_FAB_FREE)
        return;
    if (fp)
        atomic_fetch_sub(&fp->inflight, 1);
    if (state == WX_FAB_POSTED && op)
        op->done(op, status, msg);
}

static void wx__fab_readerr(wx_fab_t *f)
{
    struct fi_cq_err_entry e;
    char pbuf[512], msg[WX_ERRMSG_MAX];
    const char *pe = "";
    wx_fab_slot_t *s;
    ssize_t rc;
    int err;

    memset(&e, 0, sizeof e);
    if (f->serialize)
        pthread_mutex_lock(&f->dlock);
    rc = fi_cq_readerr(f->cq, &e, 0);
    if (rc == 1 && e.prov_errno)
        pe = fi_cq_strerror(f->cq, e.prov_errno, e.err_data, pbuf, sizeof pbuf);
    if (f->serialize)
        pthread_mutex_unlock(&f->dlock);
    if (rc != 1) {
        wx_debugf("fabric: fi_cq_readerr returned %zd", rc);
        return;
    }
    err = e.err ? e.err : FI_EIO;
    s = wx__fab_slot_of(f, e.op_context);
    if (!s || s->state == WX_FAB_FREE) {
        wx_debugf("fabric: error completion without a write: %s (%d; provider: %s)",
                  wx_fi_strerror(err), err, pe ? pe : "");
        return;
    }
    atomic_fetch_add(&f->n_errors, 1);
    snprintf(msg, sizeof msg,
             "fabric: write to %s (wr_id %llu, %llu bytes) failed: %s (%d; provider %s: %s)",
             s->fp ? s->fp->name : "?", s->op ? (unsigned long long)s->op->wr_id : 0ull,
             (unsigned long long)s->len, wx_fi_strerror(err), err, f->prov,
             pe && *pe ? pe : "no details");
    if (wx__fab_is_conn_error(err))
        wx__fab_peer_fail(s->fp, -err, msg);
    wx__fab_finish(f, s, err < FI_ERRNO_OFFSET ? -err : -EIO, msg);
}

/* shm: mark peers whose process is gone (slot_lock held). */
static void wx__fab_check_gone(wx_fab_t *f)
{
    for (wx_fab_peer_t *fp = f->fpeers; fp; fp = fp->next)
        if (fp->pid && !fp->gone && atomic_load(&fp->inflight) && kill((pid_t)fp->pid, 0) == -1 &&
            errno == ESRCH)
            fp->gone = 1;
}

/* Writes past their deadline, or to a process that is gone: done() with an error now; the
 * slot is kept until the provider lets go of it. */
static void wx__fab_scan_deadlines(wx_fab_t *f, uint64_t now)
{
    char msg[WX_ERRMSG_MAX];
    for (;;) {
        wx_fab_slot_t *late = NULL;
        wx_op_t *op;
        int status;
        pthread_mutex_lock(&f->slot_lock);
        if (f->posted) {
            wx__fab_check_gone(f);
            for (uint32_t i = 0; i < f->depth; i++) {
                wx_fab_slot_t *s = &f->slots[i];
                if (s->state == WX_FAB_POSTED && now > s->posted_ns &&
                    ((s->fp && s->fp->gone) || (f->op_timeout_ns && now > s->posted_ns &&
                                                now - s->posted_ns > f->op_timeout_ns))) {
                    late = s;
                    break;
                }
            }
        }
        if (!late) {
            pthread_mutex_unlock(&f->slot_lock);
            return;
        }
        op = late->op;
        late->state = WX_FAB_ABANDONED;
        late->op = NULL;
        f->posted--;
        f->abandoned++;
        if (late->fp && late->fp->gone) {
            status = -EPIPE;
            snprintf(msg, sizeof msg,
                     "fabric: write to %s (wr_id %llu, %llu bytes) cannot complete: the peer "
                     "process (pid %ld) has exited (provider %s)",
                     late->fp->name, op ? (unsigned long long)op->wr_id : 0ull,
                     (unsigned long long)late->len, late->fp->pid, f->prov);
        } else {
            status = -ETIMEDOUT;
            snprintf(msg, sizeof msg,
                     "fabric: write to %s (wr_id %llu, %llu bytes) not completed after %.1f s "
                     "(provider %s): is the peer process still alive and progressing?",
                     late->fp ? late->fp->name : "?", op ? (unsigned long long)op->wr_id : 0ull,
                     (unsigned long long)late->len, (double)f->op_timeout_ns / 1e9, f->prov);
        }
        wx__fab_peer_fail(late->fp, status, msg);
        pthread_mutex_unlock(&f->slot_lock);
        atomic_fetch_add(&f->n_timeouts, 1);
        if (op)
            op->done(op, status, msg);
    }
}

/* Poll mode (no CQ wait object that drives the provider, e.g. shm): spin while our own
 * writes are in flight; 50 us naps for a while after the last sign of traffic (a
 * completion, or the remote-write counter moving on a target); 1 ms naps when idle. A
 * target without the counter cannot tell busy from idle and keeps the 50 us naps. */
#define WX_FAB_HOT_NS (200 * 1000000ull)
/* Writes in flight: f->posted is changed by the writers' threads under slot_lock, so the
 * progress thread reads it under the lock too (an unlocked read was a data race, TSan). */
static uint32_t wx__fab_posted(wx_fab_t *f)
{
    uint32_t n;
    pthread_mutex_lock(&f->slot_lock);
    n = f->posted;
    pthread_mutex_unlock(&f->slot_lock);
    return n;
}

static void wx__fab_nap(wx_fab_t *f, unsigned idle, uint64_t since_activity)
{
    struct timespec ts = {0, 50000};
    uint32_t posted = wx__fab_posted(f);
    if (posted > 0 && idle < 64) {
        sched_yield();
        return;
    }
    if (f->rcntr && posted == 0 && since_activity > WX_FAB_HOT_NS)
        ts.tv_nsec = 1000000;
    nanosleep(&ts, NULL);
}

static void *wx__fab_progress(void *arg)
{
    wx_fab_t *f = arg;
    struct fi_cq_entry ent[WX_FAB_BATCH];
    uint64_t last_scan = wx_now_ns(), last_activity = last_scan, landed = 0;
    unsigned idle = 0;
    while (!atomic_load(&f->stop)) {
        ssize_t n;
        uint64_t now;
        if (f->cq_wait) {
            n = fi_cq_sread(f->cq, ent, WX_FAB_BATCH, NULL, WX_FAB_WAIT_MS);
        } else {
            if (f->serialize)
                pthread_mutex_lock(&f->dlock);
            n = fi_cq_read(f->cq, ent, WX_FAB_BATCH);
            if (f->serialize)
                pthread_mutex_unlock(&f->dlock);
        }
        now = wx_now_ns();
        if (n > 0) {
            idle = 0;
            last_activity = now;
            for (ssize_t i = 0; i < n; i++)
                wx__fab_finish(f, ent[i].op_context, 0, NULL);
        } else if (n == -FI_EAVAIL) {
            idle = 0;
            last_activity = now;
            wx__fab_readerr(f);
        } else if (n == -FI_EAGAIN) {
            if (!f->cq_wait) {
                if (f->rcntr) {
                    uint64_t c = fi_cntr_read(f->rcntr);
                    if (c != landed) {
                        landed = c;
                        last_activity = now;
                    }
                }
                if (wx__fab_posted(f))
                    last_activity = now;
                wx__fab_nap(f, idle++, now - last_activity);
            }
        } else {
            wx_debugf("fabric: CQ read failed: %s (%zd)", wx_fi_strerror((int)n), n);
            nanosleep(&(struct timespec){0, 1000000}, NULL);
        }
        if (now - last_scan > WX_FAB_SCAN_NS) {
            last_scan = now;
            wx__fab_scan_deadlines(f, now);
        }
    }
    return NULL;
}

int wx__fab_thread_start(wx_fab_t *f)
{
    int rc;
    atomic_store(&f->stop, 0);
    rc = pthread_create(&f->thread, NULL, wx__fab_progress, f);
    if (rc)
        return wx_errf(-rc, "fabric: pthread_create(progress thread) failed: %s", strerror(rc));
    f->thread_started = 1;
    return 0;
}

void wx__fab_thread_stop(wx_fab_t *f)
{
    if (!f->thread_started)
        return;
    atomic_store(&f->stop, 1);
    pthread_join(f->thread, NULL);
    f->thread_started = 0;
}

void wx__fab_cancel_peer(wx_fab_t *f, wx_fab_peer_t *fp, const char *why)
{
    if (!f->slots)
        return;
    for (;;) {
        wx_op_t *op = NULL;
        pthread_mutex_lock(&f->slot_lock);
        for (uint32_t i = 0; i < f->depth && !op; i++) {
            wx_fab_slot_t *s = &f->slots[i];
            if (s->state == WX_FAB_POSTED && s->fp == fp) {
                op = s->op;
                s->op = NULL;
                s->state = WX_FAB_ABANDONED;
                f->posted--;
                f->abandoned++;
            }
        }
        pthread_mutex_unlock(&f->slot_lock);
        if (!op)
            return;
        op->done(op, -ECANCELED, why);
    }
}

void wx__fab_cancel_all(wx_fab_t *f)
{
    if (!f->slots)
        return;
    for (uint32_t i = 0; i < f->depth; i++) {
        wx_fab_slot_t *s = &f->slots[i];
        wx_op_t *op = s->op;
        int state = s->state;
        s->state = WX_FAB_FREE;
        s->op = NULL;
        if (state == WX_FAB_POSTED && op)
            op->done(op, -ECANCELED, "fabric: transport closed");
    }
    free(f->slots);
    f->slots = NULL;
    f->free_slots = NULL;
    f->posted = f->abandoned = 0;
}

/* One fi_writemsg. -FI_EAGAIN becomes -EAGAIN (the caller retries after a completion or a
 * short wait): tcp;ofi_rxm answers it while the connection to a new peer is being set up,
 * shm when its queues are full. It is also how tcp;ofi_rxm at times answers for a peer that
 * died, forever, so an unbroken run of -FI_EAGAIN longer than the op timeout fails the peer
 * (-ETIMEDOUT), and for shm a peer whose process is gone fails at once (-EPIPE). */
static ssize_t wx__fab_post(wx_fab_t *f, wx_fab_peer_t *fp, const struct fi_msg_rma *msg, char *why,
                            size_t why_len)
{
    uint64_t now, bound = f->op_timeout_ns ? f->op_timeout_ns : WX_FAB_EAGAIN_MAX_NS;
    ssize_t rc;
    if (f->serialize)
        pthread_mutex_lock(&f->dlock);
    rc = fi_writemsg(f->ep, msg, f->write_flags);
    if (f->serialize)
        pthread_mutex_unlock(&f->dlock);
    if (rc != -FI_EAGAIN) {
        if (rc == 0)
            fp->eagain_since = 0;
        return rc;
    }
    now = wx_now_ns();
    if (!fp->eagain_since) {
        fp->eagain_since = now;
        fp->eagain_check = now;
    }
    if (fp->pid && now >= fp->eagain_check) {
        fp->eagain_check = now + WX_FAB_SCAN_NS;
        if (kill((pid_t)fp->pid, 0) == -1 && errno == ESRCH) {
            snprintf(why, why_len,
                     "fabric: cannot write to %s: the peer process (pid %ld) "
                     "has exited (provider %s)",
                     fp->name, fp->pid, f->prov);
            return -EPIPE;
        }
    }
    if (now - fp->eagain_since > bound) {
        snprintf(why, why_len,
                 "fabric: provider %s refused every write to %s for %.1f s (-FI_EAGAIN): is "
                 "the peer process still alive?",
                 f->prov, fp->name, (double)(now - fp->eagain_since) / 1e9);
        return -ETIMEDOUT;
    }
    return -FI_EAGAIN;
}

/* Whether peer p can take write wr now: connected, not failed, its source registered where
 * the provider needs it; 0 or the error naming why not. */
static int wx__fab_write_check(wx_fab_t *f, wx_peer_t *p, const wx_wr_t *wr)
{
    wx_fab_peer_t *fp = p->priv;
    if (!fp || !fp->in_av)
        return wx_errf(-ENOTCONN, "fabric: %s is not connected", p->name);
    if (fp->failed)
        return wx_errf(fp->failed, "fabric: refusing write to %s, an earlier one failed: %s",
                       fp->name, fp->why);
#ifdef WX_TESTING
    if (p->id == f->test_refuse_peer)
        return wx_errf(-EAGAIN,
                       "fabric: TEST ONLY: refusing every write to %s "
                       "(option _test_refuse_peer)",
                       p->name);
#endif
    if (!wr->local)
        return wx_errf(-EINVAL, "fabric: write to %s needs a registered source region", p->name);
    if (!wr->local->ldesc && ((f->mr_mode & FI_MR_LOCAL) ||
                              (wr->local->mem == WX_MEM_CUDA && (f->mr_mode & FI_MR_HMEM))))
        return wx_errf(-EINVAL, "fabric: source region %u is not registered with provider %s",
                       wr->local->id, f->prov);
    return 0;
}

int wx__fab_write(wx_transport_t *t, wx_peer_t *p, const wx_wr_t *wr, wx_op_t *op)
{
    wx_fab_t *f = WX_FAB(t);
    wx_fab_peer_t *fp = p->priv;
    wx_fab_slot_t *s;
    struct iovec iov;
    struct fi_rma_iov rma;
    struct fi_msg_rma msg;
    char why[WX_ERRMSG_MAX] = "";
    void *desc;
    ssize_t rc;

    if ((rc = wx__fab_write_check(f, p, wr)))
        return (int)rc;
    desc = wr->local->ldesc;

    pthread_mutex_lock(&f->slot_lock);
    s = f->free_slots;
    if (!s) {
        uint32_t posted = f->posted; /* read under the lock (TSan) */
        pthread_mutex_unlock(&f->slot_lock);
        return wx_errf(-EAGAIN, "fabric: %u writes in flight (depth %u); retry after a completion",
                       posted, f->depth);
    }
    f->free_slots = s->next_free;
    s->state = WX_FAB_POSTED;
    s->op = op;
    s->fp = fp;
    s->len = wr->len;
    s->posted_ns = UINT64_MAX; /* not subject to deadlines until the provider took it */
    f->posted++;
    pthread_mutex_unlock(&f->slot_lock);
    atomic_fetch_add(&fp->inflight, 1);

    iov.iov_base = (uint8_t *)wr->local->addr + wr->loff;
    iov.iov_len = wr->len;
    rma.addr = wr->remote->rbase + wr->roff;
    rma.len = wr->len;
    rma.key = wr->remote->key;
    memset(&msg, 0, sizeof msg);
    msg.msg_iov = &iov;
    msg.desc = &desc;
    msg.iov_count = 1;
    msg.addr = fp->fa;
    msg.rma_iov = &rma;
    msg.rma_iov_count = 1;
    msg.context = &s->ctx;

    rc = wx__fab_post(f, fp, &msg, why, sizeof why);
    if (rc == 0) {
        uint64_t now = wx_now_ns();
        pthread_mutex_lock(&f->slot_lock);
        if (s->op == op && s->state == WX_FAB_POSTED && s->posted_ns == UINT64_MAX)
            s->posted_ns = now;
        pthread_mutex_unlock(&f->slot_lock);
        atomic_fetch_add(&f->n_writes, 1);
        atomic_fetch_add(&f->n_bytes, wr->len);
        return 0;
    }
    pthread_mutex_lock(&f->slot_lock);
    wx__fab_slot_put(f, s);
    if (why[0] && (rc == -ETIMEDOUT || rc == -EPIPE))
        wx__fab_peer_fail(fp, (int)rc, why);
    pthread_mutex_unlock(&f->slot_lock);
    atomic_fetch_sub(&fp->inflight, 1);
    if (why[0])
        return wx_errf((int)rc, "%s", why);
    if (rc == -FI_EAGAIN)
        return wx_errf(-EAGAIN,
                       "fabric: provider %s cannot take another write to %s now; "
                       "retry after a completion",
                       f->prov, fp->name);
    return wx__fab_err((int)rc,
                       "fabric: fi_writemsg(%s, wr_id %llu, %llu bytes -> key 0x%llx + %llu)",
                       fp->name, (unsigned long long)op->wr_id, (unsigned long long)wr->len,
                       (unsigned long long)wr->remote->key, (unsigned long long)wr->roff);
}
