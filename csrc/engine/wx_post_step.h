/* wx_post_step.h - one write task's way through the engine's post stage (issue 37.4), as a
 * pure table: the post thread looks at the task at the head of its queue (wx_tpost_look),
 * moves the task's state on what it saw (wx_tpost_next) and does the action the table gives;
 * the outcome of a post (wx_tpost_result) is the next event. No engine, no threads, no locks:
 * tests/c/post_step_check.c checks every (state, event) pair. External tasks take their own
 * path (wx_engine_ext.c). */
#ifndef WX_POST_STEP_H
#define WX_POST_STEP_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    WX_TP_QUEUED = 0,     /* at the head of the post queue, nothing of it looked at yet */
    WX_TP_POSTING = 1,    /* posting its chunks */
    WX_TP_WAIT_FENCE = 2, /* waits for the writes in flight to complete (a fence before it, or
                           * it is one and nothing of it is posted) */
    WX_TP_WAIT_DEPTH = 3, /* waits for room: depth writes in flight */
    WX_TP_BACKOFF = 4,    /* the transport refused its last chunk for now (-EAGAIN) */
    WX_TP_RETIRED = 5,    /* off the post queue: every chunk posted or skipped, or it failed */
    WX_TP_NSTATES
} wx_tpost_state_t;

typedef enum {
    WX_TPE_SETTLED = 0,    /* every chunk posted or skipped (failed peers'), or it failed, or
                            * the engine did */
    WX_TPE_FENCE_BUSY = 1, /* a fence is to be kept and writes are in flight */
    WX_TPE_DEPTH_FULL = 2, /* depth writes in flight */
    WX_TPE_ROOM = 3,       /* a chunk may be posted */
    WX_TPE_POSTED = 4,     /* the chunk was posted */
    WX_TPE_AGAIN = 5,      /* the transport refused it for now (-EAGAIN) */
    WX_TPE_PEER_ERROR = 6, /* its post failed, isolate: that peer fails alone */
    WX_TPE_ERROR = 7,      /* its post failed, no isolate: the engine fails */
    WX_TPE_NEVENTS
} wx_tpost_event_t;

typedef enum {
    WX_TPA_NONE = 0,       /* nothing more: look again */
    WX_TPA_RETIRE = 1,     /* off the post queue (wx__post_retire) */
    WX_TPA_WAIT = 2,       /* check the deadlines, wait for a completion (bounded) */
    WX_TPA_POST = 3,       /* post the chunk at its cursor */
    WX_TPA_BACKOFF = 4,    /* wait, the back-off doubling */
    WX_TPA_FAIL_PEER = 5,  /* fail the peer at its cursor (wx__fail_peer) */
    WX_TPA_FAIL_ENGINE = 6 /* the engine's sticky error */
} wx_tpost_action_t;

/* What the post thread sees of its head task and the engine (read under the engine's mutex). */
typedef struct {
    int settled;       /* every chunk posted or skipped, or its status or the engine's error set */
    int fence_pending; /* a fence task was retired: later tasks wait for inflight == 0 */
    int is_fence;      /* the task is a fence */
    uint32_t posted;   /* its chunks posted */
    uint64_t inflight; /* the engine's writes in flight */
    uint64_t depth;    /* at most this many in flight */
} wx_tpost_view_t;

/* The event a look at the head task is: SETTLED, FENCE_BUSY, DEPTH_FULL or ROOM. */
int wx_tpost_look(const wx_tpost_view_t *v);
/* The event a post's return code `rc` is: POSTED (0), AGAIN (-EAGAIN), PEER_ERROR (isolate)
 * or ERROR. */
int wx_tpost_result(int rc, int isolate);
/* *next and *action after `event` in `state`: 0, or -EINVAL (an illegal pair or a value out of
 * range; nothing written). */
int wx_tpost_next(int state, int event, int *next, int *action);
const char *wx_tpost_state_name(int state);
const char *wx_tpost_event_name(int event);

#ifdef __cplusplus
}
#endif
#endif
