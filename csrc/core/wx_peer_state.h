/* wx_peer_state.h - one peer's failure state and its legal moves, the same table as
 * wxfer/runtime/peerstate.py (the same numbers; tests/test_peerstate.py compares every pair
 * through _wxfer.peer_next). Pure: no engine, no locks. */
#ifndef WX_PEER_STATE_H
#define WX_PEER_STATE_H

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    WX_PEER_ALIVE = 0,     /* written; its writes land */
    WX_PEER_SUSPECT = 1,   /* its lease read behind its bound once (still written) */
    WX_PEER_FAILING = 2,   /* a failure known, not yet acted on (the engine: fence to do) */
    WX_PEER_DEAD = 3,      /* given up on (the engine: fenced), skipped until restarted */
    WX_PEER_REJOINING = 4, /* its restart being adopted */
    WX_PEER_NSTATES
} wx_peer_state_t;

typedef enum {
    WX_PEV_RENEWED = 0,
    WX_PEV_LATE = 1,
    WX_PEV_EXPIRED = 2,
    WX_PEV_EXITED = 3,
    WX_PEV_WRITE_FAILED = 4,
    WX_PEV_GIVE_UP = 5,
    WX_PEV_REJOIN = 6,
    WX_PEV_ADOPTED = 7,
    WX_PEV_NEVENTS
} wx_peer_event_t;

/* *next = the state after `event` in `state`: 0, or -EINVAL (an illegal pair, or a value out
 * of range; *next untouched). */
int wx_peer_next(int state, int event, int *next);
/* The names, as in peerstate.py (NULL out of range). */
const char *wx_peer_state_name(int state);
const char *wx_peer_event_name(int event);

#ifdef __cplusplus
}
#endif
#endif
