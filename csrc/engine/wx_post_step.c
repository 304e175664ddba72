/* wx_post_step.c - the post stage's table of one write task (see wx_post_step.h). */
#include "wx_post_step.h"
#include "wx_post_step_letters.h" /* Q P F D B R: the states */

#include <errno.h>

int wx_tpost_look(const wx_tpost_view_t *v)
{
    if (v->settled)
        return WX_TPE_SETTLED;
    /* a fence: before a fence task, and after one, nothing more is posted until every write
     * in flight has completed (failed peers' writes are abandoned, not counted) */
    if ((v->fence_pending || (v->is_fence && v->posted == 0)) && v->inflight > 0)
        return WX_TPE_FENCE_BUSY;
    if (v->inflight >= v->depth)
        return WX_TPE_DEPTH_FULL;
    return WX_TPE_ROOM;
}

int wx_tpost_result(int rc, int isolate)
{
    if (rc == 0)
        return WX_TPE_POSTED;
    if (rc == -EAGAIN)
        return WX_TPE_AGAIN;
    return isolate ? WX_TPE_PEER_ERROR : WX_TPE_ERROR;
}

/* clang-format off */
#define M(s, a) {(signed char)(s), (signed char)(a)}
#define X {-1, -1} /* illegal */
/* the looks (SETTLED FENCE_BUSY DEPTH_FULL ROOM) move any task still on the queue; a post's
 * outcome (POSTED AGAIN PEER_ERROR ERROR) comes only while posting; a retired task is gone */
#define LOOKS M(R, WX_TPA_RETIRE), M(F, WX_TPA_WAIT), M(D, WX_TPA_WAIT), M(P, WX_TPA_POST)
static const signed char wx__tpost_table[WX_TP_NSTATES][WX_TPE_NEVENTS][2] = {
    [Q] = {LOOKS, X, X, X, X},
    [P] = {LOOKS, M(P, WX_TPA_NONE), M(B, WX_TPA_BACKOFF), M(P, WX_TPA_FAIL_PEER), M(P, WX_TPA_FAIL_ENGINE)},
    [F] = {LOOKS, X, X, X, X},
    [D] = {LOOKS, X, X, X, X},
    [B] = {LOOKS, X, X, X, X},
    [R] = {X, X, X, X, X, X, X, X},
};
/* clang-format on */

int wx_tpost_next(int state, int event, int *next, int *action)
{
    if (state < 0 || state >= WX_TP_NSTATES || event < 0 || event >= WX_TPE_NEVENTS)
        return -EINVAL;
    if (wx__tpost_table[state][event][0] < 0)
        return -EINVAL;
    *next = wx__tpost_table[state][event][0];
    *action = wx__tpost_table[state][event][1];
    return 0;
}

const char *wx_tpost_state_name(int state)
{
    static const char *const n[WX_TP_NSTATES] = {"QUEUED",     "POSTING", "WAIT_FENCE",
                                                 "WAIT_DEPTH", "BACKOFF", "RETIRED"};
    return state >= 0 && state < WX_TP_NSTATES ? n[state] : 0;
}

const char *wx_tpost_event_name(int event)
{
    static const char *const n[WX_TPE_NEVENTS] = {"SETTLED", "FENCE_BUSY", "DEPTH_FULL", "ROOM",
                                                  "POSTED",  "AGAIN",      "PEER_ERROR", "ERROR"};
    return event >= 0 && event < WX_TPE_NEVENTS ? n[event] : 0;
}
