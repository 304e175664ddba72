/* wx_cuda_ipc_data.c - the cuda_ipc data path: posting copies on the backend's own streams,
 * and the progress thread that polls their events and completes the ops.
 *
 * A write is one cuMemcpyAsync (or up to WX_CI_SPLIT_MAX pieces over several streams when
 * the `split` option asks for it) from the source to the mapped target allocation, followed
 * by an event per piece. The copy engines of the writer's GPU do the work; the target
 * process runs nothing. The progress thread holds the writer's context current, polls the
 * oldest write's events with cuEventQuery, and calls op->done() outside the lock. While writes are in
 * flight it polls (yield, then sleeps of a few microseconds with the timer slack lowered);
 * when none are, it looks for a new one for WX_CI_LINGER_NS, then sleeps on a condition
 * variable. Every wait is bounded.
 */
#include "wx_cuda_ipc.h"

#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>


static void wx__ci_slot_free(wx__ci_t *c, wx__ci_slot_t *s)
{
    s->busy = 0;
    s->to = NULL;
    s->op = NULL;
    s->nev = 0;
    s->fail = 0;
    s->next_free = c->free_head;
    c->free_head = (int)(s - c->slots);
    c->ninflight--;
}

/* 1: finished (status in *st, message in msg), 0: still running. Needs no lock: a busy
 * slot's events and fields change only when it is freed, which only this thread does. */
static int wx__ci_slot_poll(wx__ci_t *c, wx__ci_slot_t *s, int *st, char *msg, size_t len)
{
#ifdef WX_TESTING
    if (s->to->id == c->test_late_peer && wx_now_ns() < s->t_post + c->test_late_ns)
        return 0; /* TEST ONLY: reported late (the copy itself runs as queued) */
#endif
    for (uint32_t i = 0; i < s->nev; i++) {
        CUresult r = c->cu->cuEventQuery(s->ev[i]);
        if (r == CUDA_ERROR_NOT_READY)
            return 0;
        if (r != CUDA_SUCCESS) {
            *st = -EIO;
            snprintf(msg, len, "cuda_ipc: copy of %llu bytes to %s failed on cuda:%d: %s",
                     (unsigned long long)s->len, s->peer, c->dev, wx__ci_errname(c, r));
            return 1;
        }
    }
    *st = s->fail;
    if (s->fail)
        snprintf(msg, len, "%s", s->fail_msg);
    else
        msg[0] = '\0';
    return 1;
}

/* The progress thread polls the OLDEST write only (writes finish about in posting order:
 * they share the copy engines), without holding the lock, so posting never waits behind
 * event queries. A later write that finished first is completed right after the older one. */
static void *wx__ci_progress(void *arg)
{
    wx__ci_t *c = arg;
    unsigned idle = 0;
    uint64_t linger_until = 0; /* looking for a new write until then (WX_CI_LINGER_NS) */
    wx__ci_comp_t k;
    prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0); /* short sleeps really short */
    c->cu->cuCtxSetCurrent(c->ctx);
    pthread_mutex_lock(&c->mu);
    while (!c->stop) {
        wx__ci_slot_t *s;
        int fin;
        if (c->fcount == 0) {
            struct timespec ts;
            if (linger_until && wx_now_ns() < linger_until) {
                pthread_mutex_unlock(&c->mu);
                sched_yield();
                pthread_mutex_lock(&c->mu);
                continue;
            }
            linger_until = 0;
            wx_deadline_after(&ts, 50 * 1000000ull);
            pthread_cond_timedwait(&c->cv, &c->mu, &ts);
            idle = 0;
            continue;
        }
        s = &c->slots[c->fifo[c->fhead]];
        pthread_mutex_unlock(&c->mu);
        fin = wx__ci_slot_poll(c, s, &k.status, k.msg, sizeof k.msg);
        if (!fin) {
            if (c->poll_us && s->len <= WX_CI_SPIN_BYTES && idle < 200) {
                idle++;
                sched_yield(); /* a stamp: lands within microseconds */
            } else if (c->poll_us) {
                struct timespec ts = {0, (long)c->poll_us * 1000};
                nanosleep(&ts, NULL);
            } else if (idle++ < 200) {
                sched_yield();
            } else {
                struct timespec ts = {0, 4000};
                nanosleep(&ts, NULL);
            }
            pthread_mutex_lock(&c->mu);
            continue;
        }
        pthread_mutex_lock(&c->mu);
        for (uint32_t i = 0; i < s->nev; i++)
            c->squeued[s->sidx[i]] -= s->plen[i];
        c->fhead = (c->fhead + 1) % c->nslots;
        c->fcount--;
        k.op = s->op;
        if (k.status == 0) {
            c->nwrites++;
            c->nbytes += s->len;
        } else {
            c->nerrors++;
        }
        wx__ci_slot_free(c, s);
        pthread_cond_broadcast(&c->cv); /* close() may be draining */
        pthread_mutex_unlock(&c->mu);
        k.op->done(k.op, k.status, k.status ? k.msg : NULL);
        idle = 0;
        linger_until = wx_now_ns() + WX_CI_LINGER_NS;
        pthread_mutex_lock(&c->mu);
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

/* Streams, slots and the thread; caller holds c->mu and c->ctx is retained. */
int wx__ci_io_start(wx__ci_t *c)
{
    CUcontext saved;
    CUresult r;
    uint32_t i;
    int rc = wx__ci_push(c, c->ctx, &saved);
    if (rc)
        return rc;
    for (i = 0; i < c->nstreams; i++) {
        r = c->cu->cuStreamCreate(&c->streams[i], CU_STREAM_NON_BLOCKING);
        if (r != CUDA_SUCCESS) {
            rc = wx_errf(-EIO, "cuda_ipc: cuStreamCreate on cuda:%d failed: %s", c->dev,
                         wx__ci_errname(c, r));
            goto fail_streams;
        }
    }
    c->nslots = c->base.max_inflight;
    memset(c->squeued, 0, sizeof c->squeued);
    c->slots = calloc(c->nslots, sizeof *c->slots);
    c->fifo = calloc(c->nslots, sizeof *c->fifo);
    if (!c->slots || !c->fifo) {
        rc = wx_errf(-ENOMEM, "cuda_ipc: out of memory");
        goto fail_slots;
    }
    c->free_head = -1;
    for (int k = (int)c->nslots - 1; k >= 0; k--) {
        c->slots[k].next_free = c->free_head;
        c->free_head = k;
    }
    c->ninflight = 0;
    c->fhead = c->fcount = 0;
    c->stop = 0;
    if (pthread_create(&c->thr, NULL, wx__ci_progress, c) != 0) {
        rc = wx_errf(-EAGAIN, "cuda_ipc: cannot start the progress thread");
        goto fail_slots;
    }
    c->thr_started = 1;
    wx__ci_pop(c, saved);
    return 0;
fail_slots:
    free(c->slots);
    free(c->fifo);
    c->slots = NULL;
    c->fifo = NULL;
    c->nslots = 0;
fail_streams:
    while (i-- > 0)
        c->cu->cuStreamDestroy(c->streams[i]);
    wx__ci_pop(c, saved);
    return rc;
}

/* Drain (10 s at most), stop the thread, cancel what is left, free streams and events. */
void wx__ci_io_stop(wx__ci_t *c)
{
    struct timespec ts;
    CUcontext saved;
    pthread_mutex_lock(&c->mu);
    c->closing = 1;
    if (!c->started) {
        pthread_mutex_unlock(&c->mu);
        return;
    }
    wx_deadline_after(&ts, 10ull * 1000000000ull);
    while (c->ninflight > 0)
        if (pthread_cond_timedwait(&c->cv, &c->mu, &ts) == ETIMEDOUT)
            break;
    c->stop = 1;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    if (c->thr_started)
        pthread_join(c->thr, NULL);
    c->thr_started = 0;
    for (uint32_t i = 0; i < c->nslots; i++) {
        wx__ci_slot_t *s = &c->slots[i];
        if (s->busy) {
            wx_op_t *op = s->op;
            s->busy = 0;
            op->done(op, -ECANCELED, "transport closed");
        }
    }
    if (wx__ci_push(c, c->ctx, &saved) == 0) {
        for (uint32_t i = 0; i < c->nslots; i++)
            for (uint32_t k = 0; k < c->slots[i].nmade; k++)
                c->cu->cuEventDestroy(c->slots[i].ev[k]);
        for (uint32_t i = 0; i < c->nstreams; i++)
            c->cu->cuStreamDestroy(c->streams[i]);
        wx__ci_pop(c, saved);
    }
    free(c->slots);
    free(c->fifo);
    c->slots = NULL;
    c->fifo = NULL;
    c->nslots = 0;
    c->started = 0;
}

static CUresult wx__ci_copy(wx__ci_t *c, const wx__ci_map_t *m, const wx_mr_t *src, CUdeviceptr dst,
                            CUdeviceptr from, size_t n, CUstream st)
{
    if (src->mem == WX_MEM_CUDA && !m->self && m->ctx != c->ctx)
        return c->cu->cuMemcpyPeerAsync(dst, m->ctx, from, c->ctx, n, st);
    return c->cu->cuMemcpyAsync(dst, from, n, st);
}

/* The stream of the next piece: round robin, or (pick=least) the one with the fewest bytes
 * queued, so that a small write does not wait behind a large one. Caller holds c->mu. */
static uint32_t wx__ci_pick(wx__ci_t *c)
{
    uint32_t best = c->rr++ % c->nstreams;
    if (c->pick_least)
        for (uint32_t k = 1; k < c->nstreams; k++) {
            uint32_t i = (best + k) % c->nstreams;
            if (c->squeued[i] < c->squeued[best])
                best = i;
        }
    return best;
}

/* Whether write wr to p can be posted now (c->mu held): the transport open, the peer's
 * allocation mapped (*m, the region at *off in it) and the range inside it, the source on
 * this transport's GPU, a free slot, a length; 0 or the error naming why not. */
static int wx__ci_write_check(wx__ci_t *c, wx_peer_t *p, const wx_wr_t *wr, wx__ci_map_t **m,
                              uint64_t *off)
{
    uint64_t len = wr->len;
    int rc;
    if (c->closing) {
        rc = wx_errf(-ESHUTDOWN, "cuda_ipc: write to %s after close", p->name);
        return rc;
    }
    if ((rc = wx__ci_start(c)) != 0 || (rc = wx__ci_map_get(c, p, wr->remote, m, off)) != 0)
        return rc;
    if (*off + wr->roff + len > (*m)->size) {
        rc = wx_errf(-ERANGE,
                     "cuda_ipc: write to %s at %llu +%llu passes the end of its "
                     "%llu-byte allocation",
                     p->name, (unsigned long long)(*off + wr->roff), (unsigned long long)len,
                     (unsigned long long)(*m)->size);
        return rc;
    }
    if (wr->local->mem == WX_MEM_CUDA && wr->local->device != c->dev) {
        rc = wx_errf(-EINVAL,
                     "cuda_ipc: the source is on cuda:%d but this transport writes "
                     "from cuda:%d; open one transport per GPU (option device=%d)",
                     wr->local->device, c->dev, wr->local->device);
        return rc;
    }
#ifdef WX_TESTING
    if (p->id == c->test_refuse_peer) {
        rc = wx_errf(-EAGAIN,
                     "cuda_ipc: TEST ONLY: refusing every write to %s (option "
                     "_test_refuse_peer)",
                     p->name);
        return rc;
    }
#endif
    if (c->free_head < 0)
        return -EAGAIN;
    if (len == 0) {
        rc = wx_errf(-EINVAL, "cuda_ipc: zero-length write");
        return rc;
    }
    return 0;
}

/* How many pieces a write of len bytes is split into: one per c->split bytes, at most
 * WX_CI_SPLIT_MAX and the transport's streams (1 when splitting is off). */
static uint32_t wx__ci_pieces(const wx__ci_t *c, uint64_t len)
{
    uint32_t pieces = 1;
    if (c->split && len > c->split) {
        uint64_t k = (len + c->split - 1) / c->split;
        pieces = (uint32_t)(k < WX_CI_SPLIT_MAX ? k : WX_CI_SPLIT_MAX);
        if (pieces > c->nstreams)
            pieces = c->nstreams;
    }
    return pieces;
}

int wx__ci_write(wx_transport_t *t, wx_peer_t *p, const wx_wr_t *wr, wx_op_t *op)
{
    wx__ci_t *c = (wx__ci_t *)t;
    wx__ci_map_t *m;
    wx__ci_slot_t *s;
    CUcontext saved;
    CUdeviceptr dst, from;
    uint64_t off, piece, len = wr->len;
    uint32_t pieces;
    int rc;

    pthread_mutex_lock(&c->mu);
    if ((rc = wx__ci_write_check(c, p, wr, &m, &off)) != 0)
        goto out;
    s = &c->slots[c->free_head];
    dst = m->dptr + off + wr->roff;
    from = (CUdeviceptr)(uintptr_t)wr->local->addr + wr->loff;
    pieces = wx__ci_pieces(c, len);
    piece = ((len + pieces - 1) / pieces + 4095) & ~4095ull;
    if ((rc = wx__ci_push(c, c->ctx, &saved)) != 0)
        goto out;
    s->nev = 0;
    s->fail = 0;
    for (uint32_t i = 0; i < pieces && (uint64_t)i * piece < len; i++) {
        uint64_t o = (uint64_t)i * piece, n = len - o < piece ? len - o : piece;
        uint32_t si = wx__ci_pick(c);
        CUstream st = c->streams[si];
        CUresult r = wx__ci_copy(c, m, wr->local, dst + o, from + o, n, st);
        if (r == CUDA_SUCCESS && s->nev == s->nmade) {
            r = c->cu->cuEventCreate(&s->ev[s->nmade], CU_EVENT_DISABLE_TIMING);
            if (r == CUDA_SUCCESS)
                s->nmade++;
        }
        if (r == CUDA_SUCCESS)
            r = c->cu->cuEventRecord(s->ev[s->nev], st);
        if (r != CUDA_SUCCESS) {
            if (s->nev == 0) { /* nothing posted: fail the call, done() will not follow */
                rc = wx_errf(-EIO,
                             "cuda_ipc: posting a copy of %llu bytes to %s (0x%llx <- "
                             "0x%llx) on cuda:%d failed: %s",
                             (unsigned long long)n, p->name, (unsigned long long)(dst + o),
                             (unsigned long long)(from + o), c->dev, wx__ci_errname(c, r));
                wx__ci_pop(c, saved);
                goto out;
            }
            /* Earlier pieces are in flight: let them finish, then report the failure. */
            s->fail = -EIO;
            snprintf(s->fail_msg, sizeof s->fail_msg,
                     "cuda_ipc: posting piece %u of a %llu-byte "
                     "write to %s failed: %s",
                     i, (unsigned long long)len, p->name, wx__ci_errname(c, r));
            break;
        }
        s->sidx[s->nev] = (uint8_t)si;
        s->plen[s->nev] = n;
        c->squeued[si] += n;
        s->nev++;
    }
    wx__ci_pop(c, saved);
    c->free_head = s->next_free;
    s->busy = 1;
    s->op = op;
    s->len = len;
    snprintf(s->peer, sizeof s->peer, "%s", p->name);
    s->to = p;
#ifdef WX_TESTING
    s->t_post = wx_now_ns(); /* (_test_late_peer) */
#endif
    c->fifo[(c->fhead + c->fcount) % c->nslots] = (uint32_t)(s - c->slots);
    c->fcount++;
    c->ninflight++;
    pthread_cond_broadcast(&c->cv);
    rc = 0;
out:
    pthread_mutex_unlock(&c->mu);
    return rc;
}
/* Copies to p still queued or running on this transport's streams. Caller holds c->mu. */
static uint32_t wx__ci_pending(const wx__ci_t *c, const wx_peer_t *p)
{
    uint32_t n = 0;
    for (uint32_t i = 0; i < c->nslots; i++)
        n += c->slots[i].busy && c->slots[i].to == p;
    return n;
}

/* Fence p: the copies to p are this process's own, on its own streams, and CUDA cannot
 * cancel a queued copy, so wait (bounded) until each has completed: after that nothing of
 * them changes p's memory. Copies still queued at the bound land when the copy engines
 * reach them. */
int wx__ci_fence(wx_transport_t *t, wx_peer_t *p, uint64_t timeout_ns, char *how, size_t len)
{
    wx__ci_t *c = (wx__ci_t *)t;
    struct timespec ts;
    uint32_t n0, n;
    uint64_t t0 = wx_now_ns();
    wx_deadline_after(&ts, timeout_ns);
    pthread_mutex_lock(&c->mu);
    n0 = n = wx__ci_pending(c, p);
    while (n > 0 && !c->stop) {
        if (pthread_cond_timedwait(&c->cv, &c->mu, &ts) == ETIMEDOUT) {
            n = wx__ci_pending(c, p);
            break;
        }
        n = wx__ci_pending(c, p);
    }
    pthread_mutex_unlock(&c->mu);
    if (n) {
        snprintf(how, len,
                 "cuda_ipc: %u copies to %s are still queued on cuda:%d's streams after %.1f s; "
                 "CUDA cannot cancel them: they land when the copy engines reach them",
                 n, p->name, c->dev, (double)timeout_ns / 1e9);
        return -ETIMEDOUT;
    }
    snprintf(how, len,
             "cuda_ipc: waited %.3f s for the %u copies to %s still on cuda:%d's streams: all "
             "completed, nothing more of them lands",
             (double)(wx_now_ns() - t0) / 1e9, n0, p->name, c->dev);
    return 0;
}
