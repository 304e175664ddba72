/* wx_engine_word.c - the fence word (wx_engine_set_fence_word): the low 32 bits of the id of
 * the last fence task finished, which a CUDA stream waits for on the device before the
 * caller's in-place writes into the peers' memory (cuStreamWaitValue32, the begin stamps).
 *
 * A fence whose writes all landed releases the word as it finishes. One whose write to a
 * peer did not land (isolate: abandoned at the deadline, or completed with an error) holds it
 * at the value before: the writes queued behind the wait would reach that peer while its
 * begin stamp still equals its end stamp, and a reader would take the old step as complete
 * over new bytes. The word goes on once each such peer has been fenced (wx_fence returned 0:
 * on cuda_ipc its queued copies completed, so the late stamp landed and a reader reads
 * torn). A peer whose fence failed (its stamp may still land after the writes), or a fence
 * finished while the engine had its sticky error, keeps the word held until the engine stops
 * (the stream's later work then waits on the device, and the writes behind it miss their
 * deadlines: a failed push, not a torn step read as complete); the stop sets the word past
 * every task (wx_engine_stop), so no stream waits on a stopped engine. Later fences do not
 * move a held word (the wait is cyclic >=: a later id would release the earlier waits too).
 * Every function: mu held. */
#include "wx_engine_int.h"

void wx__word_store(wx_engine_t *e, uint32_t v)
{
    e->word_val = v;
    if (e->fence_word)
        __atomic_store_n(e->fence_word, v, __ATOMIC_RELEASE);
}

static void wx__word_hold(wx_engine_t *e, wx_peer_t *p)
{
    for (uint32_t i = 0; i < e->nhold; i++)
        if (e->hold[i] == p)
            return;
    if (e->nhold < WX__MAX_FAILED)
        e->hold[e->nhold++] = p;
    else
        e->hold_stuck = 1; /* (more failed peers than the engine names: it failed) */
}

void wx__word_release(wx_engine_t *e)
{
    if (e->hold_stuck)
        return;
    for (uint32_t i = 0; i < e->nhold; i++) {
        const wx__failed_t *fl = wx__failed_entry(e, e->hold[i]);
        if (fl && fl->state == WX_PEER_FAILING)
            return; /* its fence has not finished */
        if (!fl || !fl->fenced) {
            e->hold_stuck = 1; /* NOT fenced: its stamp may still land after the writes */
            return;
        }
    }
    e->nhold = 0;
    wx__word_store(e, (uint32_t)e->fence_done);
}

void wx__word_fence_done(wx_engine_t *e, const wx__task_t *t)
{
    if (e->err && !e->stop)
        e->hold_stuck = 1; /* its writes are not known to have landed */
    for (uint32_t i = 0; i < t->posted; i++) {
        const wx__eop_t *eo = &t->ops[i];
        if (eo->abandoned || eo->failed)
            wx__word_hold(e, t->dests[eo->dest].peer);
    }
    wx__word_release(e);
}
