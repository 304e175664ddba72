/* wx_engine_word.c - the fence word (wx_engine_set_fence_word): the low 32 bits of the id of
 * the last fence task finished, which a CUDA stream waits for on the device before the
 * caller's in-place writes into the peers' memory (cuStreamWaitValue32, the begin stamps).
 *
 * A fence whose writes all landed releases the word as it finishes. One whose write to a
 * peer did not land (isolate: abandoned at the deadline, or completed with an error) holds it
 * at the value before: the writes queued behind the wait would reach that peer while its
 * begin stamp may still equal its end stamp, and a reader would take the old step as complete
 * over new bytes. The word goes on once each such peer has either been fenced (wx_fence
 * returned 0: on cuda_ipc its queued copies completed, so the late stamp landed and a reader
 * reads torn) or, NOT fenced, had every write abandoned to it complete since (the transport
 * reported each: none lands later). A write that completed with an error is final too: the
 * word goes on for its peer although that stamp may never have landed (the peer failed on a
 * write error; the caller's writes queued behind the wait reach it as they would have
 * with the host wait). While held, wx_engine_word_state names the peer and since when, so the
 * caller waits on the host for a later push instead of queueing a device wait behind it.
 * A fence finished with writes not posted (the engine's sticky error cancelled them) or failed
 * with no failed peer to wait for (no isolate), or more failed peers than the engine names,
 * hold the word until the engine stops: its writes are not known to have landed (a fence that
 * finishes while the engine has its error but whose writes all landed releases it as usual);
 * wx_engine_word_state says so, and the caller's pushes wait on the host. The stop sets the word past
 * every task (wx_engine_stop), so no stream waits on a stopped engine, and nothing moves it
 * after that. Later fences do not move a held word (the wait is cyclic >=: a later id would
 * release the earlier waits too). Every function: mu held. */
#include "wx_engine_int.h"

#include <stdio.h>
#include <string.h>

void wx__word_store(wx_engine_t *e, uint32_t v)
{
    e->word_val = v;
    if (e->fence_word)
        __atomic_store_n(e->fence_word, v, __ATOMIC_RELEASE);
}

static void wx__word_hold(wx_engine_t *e, wx_peer_t *p)
{
    if (!e->nhold && !e->hold_err)
        e->hold_since = wx_now_ns();
    for (uint32_t i = 0; i < e->nhold; i++)
        if (e->hold[i] == p)
            return;
    if (e->nhold < WX__MAX_FAILED)
        e->hold[e->nhold++] = p;
    else
        e->hold_err = 1; /* (more failed peers than the engine names: it failed) */
}

/* the peer held peer p waits for: 1 while it holds the word (failing, or NOT fenced with
 * abandoned writes out) */
static int wx__word_holds(wx_engine_t *e, const wx_peer_t *p)
{
    const wx__failed_t *fl = wx__failed_entry(e, p);
    if (!fl)
        return 1; /* (a peer held is one that failed: not reached) */
    if (fl->state == WX_PEER_FAILING)
        return 1; /* its fence has not finished */
    return !fl->fenced && !fl->drained;
}

void wx__word_release(wx_engine_t *e)
{
    if (e->stopped || e->hold_err)
        return; /* stopped: set past every task already; error: held until the stop */
    for (uint32_t i = 0; i < e->nhold; i++)
        if (wx__word_holds(e, e->hold[i]))
            return;
    if (e->nhold)
        e->word_released = wx_now_ns();
    e->nhold = 0;
    e->hold_since = 0;
    wx__word_store(e, (uint32_t)e->fence_done);
}

uint64_t wx__word_ready_deadline(wx_engine_t *e, uint64_t deadline)
{
    uint64_t later;
    if (!e->fence_word || e->stopped || e->hold_err)
        return deadline; /* no device wait, or held until the stop: the limit stands */
    if (e->nhold)
        return wx_now_ns() + e->o.timeout_ns;
    later = e->word_released ? e->word_released + e->o.timeout_ns : 0;
    return later > deadline ? later : deadline;
}

void wx__word_fence_done(wx_engine_t *e, const wx__task_t *t)
{
    /* writes of it not posted (the engine failed: cancelled), or failed with no failed
     * peer to wait for (no isolate): not known to have landed, held until the stop */
    int unknown = t->posted + t->skipped < t->nchunks;
    if (e->stopped)
        return;
    for (uint32_t i = 0; i < t->posted; i++) {
        const wx__eop_t *eo = &t->ops[i];
        if (eo->abandoned || eo->failed) {
            if (wx__failed_entry(e, t->dests[eo->dest].peer))
                wx__word_hold(e, t->dests[eo->dest].peer);
            else
                unknown = 1;
        } else if (!eo->done) {
            unknown = 1; /* (a finished task's live writes have completed: not reached) */
        }
    }
    if (unknown && !e->stop) {
        if (!e->nhold && !e->hold_err)
            e->hold_since = wx_now_ns();
        e->hold_err = 1;
    }
    wx__word_release(e);
}

/* peer fl, NOT fenced, has no abandoned write out any more: nothing of it lands later */
static void wx__word_drained(wx_engine_t *e, wx__failed_t *fl)
{
    size_t n = strlen(fl->f.reason);
    if (fl->state == WX_PEER_FAILING || fl->fenced || fl->drained || fl->out)
        return;
    fl->drained = 1;
    if (n < sizeof fl->f.reason - 1)
        snprintf(fl->f.reason + n, sizeof fl->f.reason - n,
                 "; its abandoned writes have all completed since");
    wx__word_release(e);
}

void wx__word_abandoned_done(wx_engine_t *e, const wx__eop_t *eo)
{
    wx__failed_t *fl = wx__failed_entry(e, eo->task->dests[eo->dest].peer);
    if (!fl || !fl->out)
        return;
    if (--fl->out == 0)
        wx__word_drained(e, fl);
}

/* the fence of failed peer fl finished (NOT fenced: its writes may be out yet) */
void wx__word_fence_failed(wx_engine_t *e, wx__failed_t *fl)
{
    if (fl->fenced)
        wx__word_release(e);
    else
        wx__word_drained(e, fl);
}

int wx_engine_word_state(wx_engine_t *e, uint64_t *since_ns, int64_t *peer_id, char *peer,
                         size_t len)
{
    int held = 0;
    pthread_mutex_lock(&e->mu);
    if (peer && len)
        peer[0] = '\0';
    if (peer_id)
        *peer_id = -1;
    if (!e->stopped && (e->hold_err || e->nhold)) {
        held = e->hold_err ? 2 : 1;
        if (since_ns)
            *since_ns = e->hold_since;
        for (uint32_t i = 0; peer && i < e->nhold; i++)
            if (wx__word_holds(e, e->hold[i])) {
                snprintf(peer, len, "%s", e->hold[i]->name);
                if (peer_id)
                    *peer_id = e->hold[i]->id;
                break;
            }
    }
    pthread_mutex_unlock(&e->mu);
    return held;
}
