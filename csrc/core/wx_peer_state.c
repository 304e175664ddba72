/* wx_peer_state.c - the peer failure state table (see wx_peer_state.h). */
#include "wx_peer_state.h"

#include <errno.h>

#define A WX_PEER_ALIVE
#define S WX_PEER_SUSPECT
#define F WX_PEER_FAILING
#define D WX_PEER_DEAD
#define R WX_PEER_REJOINING
#define X (-1) /* illegal */

/* rows: states; columns: RENEWED LATE EXPIRED EXITED WRITE_FAILED GIVE_UP REJOIN ADOPTED */
/* clang-format off */
static const signed char wx__peer_table[WX_PEER_NSTATES][WX_PEV_NEVENTS] = {
    [A] = {A, S, X, F, F, X, R, X},
    [S] = {A, S, F, F, F, X, R, X},
    [F] = {X, X, X, F, F, D, R, X},
    [D] = {A, X, X, D, D, D, R, X},
    [R] = {X, X, X, R, R, R, R, A},
};
/* clang-format on */

int wx_peer_next(int state, int event, int *next)
{
    if (state < 0 || state >= WX_PEER_NSTATES || event < 0 || event >= WX_PEV_NEVENTS)
        return -EINVAL;
    if (wx__peer_table[state][event] == X)
        return -EINVAL;
    *next = wx__peer_table[state][event];
    return 0;
}

const char *wx_peer_state_name(int state)
{
    static const char *const n[WX_PEER_NSTATES] = {"ALIVE", "SUSPECT", "FAILING", "DEAD",
                                                   "REJOINING"};
    return state >= 0 && state < WX_PEER_NSTATES ? n[state] : 0;
}

const char *wx_peer_event_name(int event)
{
    static const char *const n[WX_PEV_NEVENTS] = {"RENEWED",      "LATE",    "EXPIRED", "EXITED",
                                                  "WRITE_FAILED", "GIVE_UP", "REJOIN",  "ADOPTED"};
    return event >= 0 && event < WX_PEV_NEVENTS ? n[event] : 0;
}
