/* wx_engine_peers.c - isolate (wx_engine_opts_t.isolate): a peer that fails is remembered
 * with its first failure, its writes in flight are abandoned (no longer waited for) and its
 * later ones skipped, and the post thread fences it before the engine reports all done. Its
 * state moves along wx_peer_state.c's table (the one wxfer/runtime/peerstate.py has): FAILING
 * on its first failure, DEAD once fenced. Each function is called with mu held
 * (wx__fence_failed_peers releases it around each fence). */
#include "wx_engine_int.h"

#include <stdio.h>
#include <string.h>

int wx__peer_failed(const wx_engine_t *e, const wx_peer_t *p)
{
    for (uint32_t i = 0; i < e->nfailed; i++)
        if (e->failed[i].peer == p)
            return 1;
    return 0;
}

/* isolate: finish every task left waiting only for abandoned writes. mu held. */
static void wx__finish_abandoned(wx_engine_t *e)
{
    int again = 1;
    while (again) {
        again = 0;
        for (wx__task_t *t = e->active; t; t = t->act_next) {
            if (!t->in_post && !t->finished && t->live == 0) {
                wx__finish(e, t, -EHOSTUNREACH);
                again = 1; /* the active list changed */
                break;
            }
        }
    }
}

/* the failed entry of peer p, or NULL (alive). mu held. */
wx__failed_t *wx__failed_entry(wx_engine_t *e, const wx_peer_t *p)
{
    for (uint32_t i = 0; i < e->nfailed; i++)
        if (e->failed[i].peer == p)
            return &e->failed[i];
    return NULL;
}

/* isolate: remember that peer p failed (ALIVE -> FAILING on WRITE_FAILED; again: no move),
 * and stop waiting for its writes in flight (they keep their task's memory and source until
 * they complete, e.g. when the transport closes). mu held. */
void wx__fail_peer(wx_engine_t *e, wx_peer_t *p, const wx_engine_fail_t *f)
{
    int err = f->err, next;
    wx__failed_t *had = wx__failed_entry(e, p);
    if (had) { /* FAILING or DEAD: the table keeps it there */
        if (wx_peer_next(had->state, WX_PEV_WRITE_FAILED, &next) == 0)
            had->state = next;
        return;
    }
    if (e->nfailed == WX__MAX_FAILED) { /* too many to name: the engine fails */
        wx__set_error(e, f);
        return;
    }
    if (wx_peer_next(WX_PEER_ALIVE, WX_PEV_WRITE_FAILED, &next)) /* (legal: FAILING) */
        next = WX_PEER_FAILING;
    had = &e->failed[e->nfailed];
    memset(had, 0, sizeof *had);
    had->peer = p;
    had->f = *f;
    had->state = next;
    e->nfailed++;
    e->fencing_peers++;
    for (wx__task_t *t = e->active; t; t = t->act_next) {
        int hit = 0;
        for (uint32_t i = 0; i < t->posted; i++) {
            wx__eop_t *eo = &t->ops[i];
            if (!eo->done && !eo->abandoned && t->dests[eo->dest].peer == p) {
                eo->abandoned = 1;
                had->out++; /* (wx__word_abandoned_done counts it back) */
                t->live--;
                e->inflight--;
                hit = 1;
                if (!t->status)
                    t->rec.status = err;
            }
        }
        /* the task's writes to its other peers were held up behind p's (the depth, the
         * fence) and may have been posted only now: half a timeout more for them, as for a
         * refused peer, else the task's past deadline would blame the next live peer too */
        if (hit && (t->live > 0 || t->in_post)) {
            uint64_t later = wx_now_ns() + e->o.timeout_ns / 2;
            if (t->deadline < later)
                t->deadline = later;
        }
    }
    wx__finish_abandoned(e);
    pthread_cond_broadcast(&e->cv_ready); /* an external task waiting for its signal */
    pthread_cond_broadcast(&e->cv_post);
    pthread_cond_broadcast(&e->cv_done);
    pthread_cond_broadcast(&e->cv_admit);
}

/* isolate: fence the failed peers (post thread; mu held, released around each fence, which
 * may wait up to half the write timeout and may complete their writes meanwhile). The outcome
 * ends the failure's reason, so that whoever reports the give-up says whether the writes
 * abandoned to that peer can still land. */
void wx__fence_failed_peers(wx_engine_t *e)
{
    for (uint32_t i = 0; i < e->nfailed; i++) {
        wx__failed_t *fl = &e->failed[i];
        char how[WX_ERRMSG_MAX / 2];
        size_t n;
        int rc;
        int next;
        if (fl->state != WX_PEER_FAILING || fl->fencing)
            continue;
        uint64_t t0 = wx_now_ns(), took;
        fl->fencing = 1;
        pthread_mutex_unlock(&e->mu);
        rc = wx_fence(e->t, fl->peer, e->o.timeout_ns / 2, how, sizeof how);
        pthread_mutex_lock(&e->mu);
        /* nothing was posted meanwhile: the fence's time does not count against the
         * deadlines of the tasks still being posted */
        took = wx_now_ns() - t0;
        for (wx__task_t *t = e->active; t; t = t->act_next)
            if (t->in_post)
                t->deadline += took;
        fl = &e->failed[i]; /* (the table only grows) */
        n = strlen(fl->f.reason);
        if (n < sizeof fl->f.reason - 1)
            snprintf(fl->f.reason + n, sizeof fl->f.reason - n, "; %s: %s",
                     rc == 0 ? "fenced before giving up" : "NOT fenced", how);
        fl->fencing = 0;
        fl->fenced = rc == 0;
        if (wx_peer_next(fl->state, WX_PEV_GIVE_UP, &next) == 0) /* FAILING -> DEAD */
            fl->state = next;
        e->fencing_peers--;
        wx__word_fence_failed(e, fl); /* a fence word held for this peer's stamp may go on */
        pthread_cond_broadcast(&e->cv_done);
    }
}
