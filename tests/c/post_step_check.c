/* post_step_check.c - the post stage's table of one write task (csrc/engine/wx_post_step.c,
 * issue 37.4), with no engine, thread or lock: every (state, event) pair against the grid
 * below, legal or not; the looks and a post's outcomes as events; and walks of a task through
 * the table as the post loop drives it. Prints "post_step_check: ok N" (N pairs). Built and
 * run by tests/test_post_step.py. */
#include <errno.h>
#include <string.h>

#include "check.h"
#include "wx_post_step.h"
#include "wx_post_step_letters.h" /* Q P F D B R: the states */

/* clang-format off */
#define NO {-1, -1}
/* rows: states; columns: SETTLED FENCE_BUSY DEPTH_FULL ROOM POSTED AGAIN PEER_ERROR ERROR */
static const int grid[WX_TP_NSTATES][WX_TPE_NEVENTS][2] = {
    [Q] = {{R, WX_TPA_RETIRE}, {F, WX_TPA_WAIT}, {D, WX_TPA_WAIT}, {P, WX_TPA_POST}, NO, NO, NO, NO},
    [P] = {{R, WX_TPA_RETIRE}, {F, WX_TPA_WAIT}, {D, WX_TPA_WAIT}, {P, WX_TPA_POST},
           {P, WX_TPA_NONE}, {B, WX_TPA_BACKOFF}, {P, WX_TPA_FAIL_PEER}, {P, WX_TPA_FAIL_ENGINE}},
    [F] = {{R, WX_TPA_RETIRE}, {F, WX_TPA_WAIT}, {D, WX_TPA_WAIT}, {P, WX_TPA_POST}, NO, NO, NO, NO},
    [D] = {{R, WX_TPA_RETIRE}, {F, WX_TPA_WAIT}, {D, WX_TPA_WAIT}, {P, WX_TPA_POST}, NO, NO, NO, NO},
    [B] = {{R, WX_TPA_RETIRE}, {F, WX_TPA_WAIT}, {D, WX_TPA_WAIT}, {P, WX_TPA_POST}, NO, NO, NO, NO},
    [R] = {NO, NO, NO, NO, NO, NO, NO, NO},
};
/* clang-format on */

static int step(int *state, int event)
{
    int next = -7, action = -7, rc = wx_tpost_next(*state, event, &next, &action);
    CHECK(rc == 0, "walk: no move from %s on %s", wx_tpost_state_name(*state),
          wx_tpost_event_name(event));
    *state = next;
    return action;
}

int main(void)
{
    int pairs = 0;
    for (int s = 0; s < WX_TP_NSTATES; s++) {
        for (int e = 0; e < WX_TPE_NEVENTS; e++, pairs++) {
            int next = -7, action = -7, rc = wx_tpost_next(s, e, &next, &action);
            const char *sn = wx_tpost_state_name(s), *en = wx_tpost_event_name(e);
            CHECK(sn && en, "no name for state %d or event %d", s, e);
            if (grid[s][e][0] < 0)
                CHECK(rc == -EINVAL && next == -7 && action == -7, "%s on %s: legal (rc %d)", sn,
                      en, rc);
            else
                CHECK(rc == 0 && next == grid[s][e][0] && action == grid[s][e][1],
                      "%s on %s: rc %d -> %d/%d, want %d/%d", sn, en, rc, next, action,
                      grid[s][e][0], grid[s][e][1]);
        }
    }
    int n, a;
    CHECK(wx_tpost_next(-1, 0, &n, &a) == -EINVAL &&
              wx_tpost_next(WX_TP_NSTATES, 0, &n, &a) == -EINVAL &&
              wx_tpost_next(0, WX_TPE_NEVENTS, &n, &a) == -EINVAL,
          "out of range accepted");
    CHECK(!wx_tpost_state_name(WX_TP_NSTATES) && !wx_tpost_event_name(-1), "names out of range");
    CHECK(!strcmp(wx_tpost_state_name(WX_TP_WAIT_FENCE), "WAIT_FENCE"), "state names");

    /* the looks: settled first; a fence kept while writes are in flight; then depth */
    wx_tpost_view_t v = {.settled = 1, .fence_pending = 1, .inflight = 9, .depth = 1};
    CHECK(wx_tpost_look(&v) == WX_TPE_SETTLED, "settled");
    v.settled = 0;
    CHECK(wx_tpost_look(&v) == WX_TPE_FENCE_BUSY, "a fence pending, writes in flight");
    v.inflight = 0;
    CHECK(wx_tpost_look(&v) == WX_TPE_ROOM, "a fence pending, nothing in flight");
    v = (wx_tpost_view_t){.is_fence = 1, .posted = 0, .inflight = 2, .depth = 8};
    CHECK(wx_tpost_look(&v) == WX_TPE_FENCE_BUSY, "a fence task waits for the writes before it");
    v.posted = 1;
    CHECK(wx_tpost_look(&v) == WX_TPE_ROOM, "a fence task once posting does not wait for itself");
    v = (wx_tpost_view_t){.inflight = 8, .depth = 8};
    CHECK(wx_tpost_look(&v) == WX_TPE_DEPTH_FULL, "depth");
    v.inflight = 7;
    CHECK(wx_tpost_look(&v) == WX_TPE_ROOM, "room");
    CHECK(wx_tpost_result(0, 1) == WX_TPE_POSTED && wx_tpost_result(-EAGAIN, 0) == WX_TPE_AGAIN &&
              wx_tpost_result(-EIO, 1) == WX_TPE_PEER_ERROR &&
              wx_tpost_result(-EIO, 0) == WX_TPE_ERROR,
          "results");

    /* walks: the post loop's sequences */
    int s = WX_TP_QUEUED; /* a task behind a fence, then two chunks, one refused once */
    CHECK(step(&s, WX_TPE_FENCE_BUSY) == WX_TPA_WAIT && s == F, "walk 1a");
    CHECK(step(&s, WX_TPE_ROOM) == WX_TPA_POST && step(&s, WX_TPE_POSTED) == WX_TPA_NONE, "1b");
    CHECK(step(&s, WX_TPE_DEPTH_FULL) == WX_TPA_WAIT && s == D, "walk 1c");
    CHECK(step(&s, WX_TPE_ROOM) == WX_TPA_POST && step(&s, WX_TPE_AGAIN) == WX_TPA_BACKOFF, "1d");
    CHECK(s == B && step(&s, WX_TPE_ROOM) == WX_TPA_POST, "walk 1e");
    CHECK(step(&s, WX_TPE_POSTED) == WX_TPA_NONE && step(&s, WX_TPE_SETTLED) == WX_TPA_RETIRE,
          "1f");
    CHECK(s == R && wx_tpost_next(s, WX_TPE_ROOM, &n, &a) == -EINVAL, "a retired task is gone");
    s = WX_TP_QUEUED; /* isolate: its peer fails, the rest skipped: settled */
    CHECK(step(&s, WX_TPE_ROOM) == WX_TPA_POST && step(&s, WX_TPE_PEER_ERROR) == WX_TPA_FAIL_PEER,
          "walk 2a");
    CHECK(step(&s, WX_TPE_SETTLED) == WX_TPA_RETIRE, "walk 2b");
    s = WX_TP_QUEUED; /* no isolate: the engine fails */
    CHECK(step(&s, WX_TPE_ROOM) == WX_TPA_POST && step(&s, WX_TPE_ERROR) == WX_TPA_FAIL_ENGINE &&
              step(&s, WX_TPE_SETTLED) == WX_TPA_RETIRE,
          "walk 3");
    s = WX_TP_QUEUED; /* a post's outcome without a post is not a move */
    CHECK(wx_tpost_next(s, WX_TPE_POSTED, &n, &a) == -EINVAL, "QUEUED on POSTED");
    printf("post_step_check: ok %d\n", pairs);
    return 0;
}
