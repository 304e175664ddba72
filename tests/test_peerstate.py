"""Issue 37.3: one failure state machine per peer (wxfer.runtime.peerstate), tested as a table
(every (state, event) pair, legal or not) with no thread or process, and the C engine's copy of
it (csrc/core/wx_peer_state.c, through _wxfer.peer_next) checked pair by pair against it."""

import logging

import pytest

from wxfer.runtime import peerstate
from wxfer.runtime.peerstate import Event, IllegalTransition, Peers, State, next_state

A, S, F, D, R = State.ALIVE, State.SUSPECT, State.FAILING, State.DEAD, State.REJOINING
_ = None  # illegal
# rows: states; columns: RENEWED LATE EXPIRED EXITED WRITE_FAILED GIVE_UP REJOIN ADOPTED
EXPECTED = {
    A: [A, S, _, F, F, _, R, _],
    S: [A, S, F, F, F, _, R, _],
    F: [_, _, _, F, F, D, R, _],
    D: [A, _, _, D, D, D, R, _],
    R: [_, _, _, R, R, R, R, A],
}


@pytest.mark.parametrize("state", list(State), ids=lambda s: s.name)
@pytest.mark.parametrize("event", list(Event), ids=lambda e: e.name)
def test_every_pair_moves_as_the_table_says_or_raises_naming_peer_state_and_event(state, event):
    want = EXPECTED[state][event]
    if want is None:
        with pytest.raises(IllegalTransition) as ei:
            next_state(state, event, "inference worker gpu 3")
        msg = str(ei.value)
        assert "inference worker gpu 3" in msg and state.name in msg and event.name in msg, msg
    else:
        assert next_state(state, event, "w") is want


def test_the_table_has_the_pairs_of_the_expected_grid_and_no_other():
    assert len(EXPECTED) == len(State) and all(len(r) == len(Event) for r in EXPECTED.values())
    legal = {(s, e) for s in State for e in Event if EXPECTED[s][e] is not None}
    assert set(peerstate.TABLE) == legal


def test_the_c_engine_has_the_same_table():
    from wxfer import _wxfer

    assert list(_wxfer.PEER_STATES) == [s.name for s in State]
    assert list(_wxfer.PEER_EVENTS) == [e.name for e in Event]
    for s in State:
        for e in Event:
            want = peerstate.TABLE.get((s, e))
            if want is None:
                with pytest.raises(ValueError) as ei:
                    _wxfer.peer_next(int(s), int(e))
                assert s.name in str(ei.value) and e.name in str(ei.value), str(ei.value)
            else:
                assert _wxfer.peer_next(int(s), int(e)) == int(want), (s, e)
    for bad in ((len(State), 0), (0, len(Event)), (-1, 0)):
        with pytest.raises(ValueError):
            _wxfer.peer_next(*bad)


def test_a_lease_late_once_is_suspect_dead_only_if_still_late_a_period_on_and_revived_when_renewed(caplog):
    p = Peers(lambda g: f"worker {g}", confirm=1.0)
    assert p.on_lease(0, None, now=0.0) is A
    assert p.on_lease(0, "behind 4.1 s", now=10.0) is S  # a store stall looks the same: suspect
    assert p.on_lease(0, None, now=10.1) is A  # renewed: alive, no verdict was given
    assert p.on_lease(0, "behind 3.5 s", now=20.0) is S
    assert p.on_lease(0, "behind 3.9 s", now=20.5) is S  # not a period on yet
    assert p.on_lease(0, "behind 4.5 s", now=21.0) is F and p.cause[0] is Event.EXPIRED
    assert p.apply(0, Event.GIVE_UP) is D and p.why[0] == "behind 4.5 s"
    assert p.lease_judged(0) and p.on_lease(0, "behind 9 s", now=30.0) is D  # still behind: stands
    with caplog.at_level(logging.WARNING, logger="wxfer.runtime.peerstate"):
        assert p.on_lease(0, None, now=31.0) is A  # renewed after the verdict: withdrawn, logged
    assert "worker 0: DEAD -> ALIVE on RENEWED" in caplog.text and 0 not in p.why and 0 not in p.cause
    # a process that exited is never revived by its lease
    p.apply(1, Event.EXITED, "its process (pid 7) has exited")
    p.apply(1, Event.GIVE_UP)
    assert not p.lease_judged(1) and p.in_state(D) == {1}
    # dead by its lease, then seen exited: no longer revivable
    p.on_lease(2, "late", now=0.0), p.on_lease(2, "late", now=2.0), p.apply(2, Event.GIVE_UP)
    assert p.lease_judged(2)
    p.apply(2, Event.EXITED, "gone")
    assert not p.lease_judged(2) and p.why[2] == "gone" and p.get(2) is D


def test_a_restart_goes_through_rejoining_to_alive():
    p = Peers(str)
    p.apply(5, Event.WRITE_FAILED, "write timed out")
    p.apply(5, Event.GIVE_UP)
    assert p.apply(5, Event.REJOIN) is R and p.apply(5, Event.GIVE_UP) is R  # the old peer, given up again
    assert p.apply(5, Event.ADOPTED) is A and 5 not in p.cause and 5 not in p.why
    with pytest.raises(IllegalTransition, match="6: no transition from state DEAD on event ADOPTED"):
        p.apply(6, Event.WRITE_FAILED), p.apply(6, Event.GIVE_UP), p.apply(6, Event.ADOPTED)
