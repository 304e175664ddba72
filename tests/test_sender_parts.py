"""The Sender's collaborators, each constructed alone (no Sender, no store, no receiver):
Links (the workers written, the failed set, restarts adopted or refused), FailureExchange (torn
records, the roll call, the failure flag), InPlaceWriter (its switch and the begin-stamp wait),
TaskRunner (the version stamps as fence tasks, an engine failure's words) and StepLoop (the
task loop's order and batching, a failure inside it, the end of a push).  The fakes stand for
what each is given; the logic under test is the collaborator's own."""

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from wxfer import _wxfer  # noqa: E402
from wxfer.runtime import control  # noqa: E402
from wxfer.runtime.failures import FailureExchange  # noqa: E402
from wxfer.runtime.inplace import COPIES_TAG, InPlaceWriter, options  # noqa: E402
from wxfer.runtime.links import Links  # noqa: E402
from wxfer.runtime.steps import StepLoop  # noqa: E402
from wxfer.zerocopy import ZERO_COPY_BATCH as FAST_BATCH  # noqa: E402
from wxfer.runtime.tasks import STAMP_TAG, TaskRunner  # noqa: E402
from helpers import StoreCtl, held_word_engine  # noqa: E402 -- tests/helpers.py

CPU = torch.device("cpu")


def _worker(g, **kw):
    w = dict(gpu=g, transport="fabric", options={}, mapping="tiny", replicas=1, tp=2, replica=0, rank=g, ep=1)
    w.update(host="h", pid=100 + g, params={"w": [[4, 4], "bfloat16"]}, desc={}, stamp_slots=1, stamp_begin=8)
    w.update(export="ZXhw", stamp="c3RhbXA=")  # base64 of b"exp", b"stamp"
    w.update(kw)
    return w


def _links(ctl=None, gpus=(0, 1)):
    ln = Links(ctl or StoreCtl(), None, 0, None, None, {g: _worker(g) for g in gpus}, 1.0)
    for g in gpus:  # as connect() leaves them
        ln.peers[g] = 10 + g
        ln.gpu_of_peer[10 + g] = g
        ln.gpu_of_region[b"region%d" % g] = g
        ln.stamp_dest[g] = (b"stamp%d" % g, 0, 0, 8)
        ln.begin_dest[g] = (b"stamp%d" % g, 8, 0, 8)
    return ln


class _Err(Exception):
    def __init__(self, peer, tag=None, errno=110):
        super().__init__(f"write to peer {peer} timed out")
        self.peer, self.tag, self.errno = peer, tag, errno


# ------------------------------------------------------------------ Links
def test_links_drop_skip_and_name_the_failed_workers():
    ln = _links()
    assert ln.live() == {0, 1}
    engine = SimpleNamespace(failed_peers=lambda: [_Err(11), _Err(99)])  # 99: a peer since replaced
    failed = ln.failed(engine, lambda e: f"<{e}>")
    assert failed == {1: "<write to peer 11 timed out> (errno 110)"}
    assert ln.skipped(engine) == frozenset({1})  # failed in the engine, not dropped yet
    assert ln.drop(failed) == {1} and ln.drop([1]) == set()  # new only once
    assert ln.live() == {0} and ln.skipped(SimpleNamespace(failed_peers=list)) == frozenset({1})
    assert ln.worker_name(1) == "inference worker gpu 1 (replica 0 rank 1, h pid 101)"
    assert ln.peer_name(10) == ln.worker_name(0) and ln.peer_name(99) is None


def test_links_refuse_a_restart_that_does_not_match_and_report_it_once():
    ctl = StoreCtl()
    ln = _links(ctl)
    ctl.kv["infer/0"] = _worker(0)
    assert ln.adopt_rejoins() is None and ctl.calls == [("counters", ("infer/rejoins",))]  # none: one round trip
    ctl.kv.update({"infer/rejoins": 1, "infer/epoch/0": 1})
    ctl.kv["infer/0/e1/meta"] = _worker(0, tp=4, params={"w": [[8, 4], "bfloat16"]})
    ln.adopt_rejoins()
    assert ln.epoch == {0: 1, 1: 0} and ln.rejoined == 0 and ln.rejoins_seen == 1
    why = ln.take_refused()
    assert list(why) == [0] and "its restart (epoch 1) was refused" in why[0]
    assert "tp 4, before 2" in why[0] and "w: shape/dtype [[8, 4], 'bfloat16'], the plan has" in why[0]
    assert "trainer rank 0: SetupError" in ctl.kv["rejoin/refused/0/e1"]
    assert ln.take_refused() == {}  # reported once
    assert ln.peers[0] == 10 and ln.workers[0]["tp"] == 2  # the one in place is kept
    n = len(ctl.calls)
    ln.adopt_rejoins()  # nothing new since: one round trip again
    assert ctl.calls[n:] == [("counters", ("infer/rejoins",))]


# ------------------------------------------------------------------ FailureExchange
@pytest.mark.parametrize(
    "broken, named",
    [
        (dict(stamp=None), "stamp missing"),  # None: the field left out
        (dict(stamp_begin="8"), "stamp_begin is a str, not a int"),
        (dict(desc={"w": "AAAA"}), "desc of w: wxfer: parameter descriptor too short (3 bytes)"),
    ],
)
def test_links_refuse_a_malformed_restart_record_by_name_before_changing_anything(monkeypatch, broken, named):
    """A restart record that matches the worker it replaces but is malformed (a field missing,
    of another type, a descriptor that does not decode) is refused naming the field, before
    the connection and before any state moves: the worker stays FAILING (not REJOINING for
    ever), and the push's end still gives it up (DEAD)."""
    from wxfer.runtime.peerstate import Event, State

    connects = []
    monkeypatch.setattr(control, "writer_connect", lambda *a, **k: connects.append(a) or 77)
    ctl = StoreCtl()
    ln = _links(ctl)
    ln.plan = SimpleNamespace(descriptors={(0, "w"): b"old"})
    ln.program = SimpleNamespace(retarget=lambda plan, g: None)
    ln.states.apply(0, Event.EXITED, "its process exited")
    ctl.kv["infer/0"] = _worker(0)
    rec = _worker(0)
    for k, v in broken.items():
        rec[k] = v
        if v is None:
            del rec[k]
    ctl.kv.update({"infer/rejoins": 1, "infer/epoch/0": 1, "infer/0/e1/meta": rec})
    ln.adopt_rejoins()
    why = ln.take_refused()
    assert list(why) == [0] and "its record (infer/0/e1/meta) is malformed" in why[0], why
    assert named in why[0], why
    assert "trainer rank 0: SetupError" in ctl.kv["rejoin/refused/0/e1"]
    assert connects == [] and ln.peers[0] == 10 and ln.plan.descriptors == {(0, "w"): b"old"}
    assert ln.states.get(0) is State.FAILING and ln.stamp_dest[0] == (b"stamp0", 0, 0, 8)
    assert ln.drop([0]) == {0} and ln.states.get(0) is State.DEAD


def test_links_say_the_watchers_trouble_once_when_the_watcher_and_the_push_both_look(caplog):
    """say_watch runs on the watcher thread and on the push thread: both see the trouble begin
    at the same moment (a barrier), the log is slow (a handler that sleeps): it is said once."""
    import logging
    import threading
    import time

    ln = _links()
    ln.watch_error = "ConnectionError: the store is gone"
    both = threading.Barrier(2)
    trouble = ln.watch_trouble

    def seen_by_both():
        t = trouble()
        both.wait(5)
        return t

    class _Slow(logging.Handler):
        def emit(self, record):
            time.sleep(0.05)

    slow = _Slow()
    logging.getLogger("wxfer.runtime.links").addHandler(slow)
    ln.watch_trouble = seen_by_both
    try:
        with caplog.at_level(logging.WARNING, logger="wxfer.runtime.links"):
            ts = [threading.Thread(target=ln.say_watch) for _ in range(2)]
            for t in ts:
                t.start()
            for t in ts:
                t.join(10)
    finally:
        logging.getLogger("wxfer.runtime.links").removeHandler(slow)
    said = [r.getMessage() for r in caplog.records if "is blind" in r.getMessage()]
    assert len(said) == 1, said
    ln.watch_error = None
    ln.watch_trouble = trouble
    ln.say_watch()
    assert "reads the store again (its last store look failed: ConnectionError" in caplog.records[-1].getMessage()


def test_failures_mark_torn_records_once_per_worker_epoch_writer_and_step():
    ctl = StoreCtl()
    ln = _links(ctl)
    ln.epoch[1] = 3
    ln.failed(SimpleNamespace(failed_peers=lambda: [_Err(10)]), str)  # gpu 0's writes failed
    ln.drop([0])
    fx = FailureExchange(ctl, None, 0, 1, 1.0, 1.0, True, ln, [0, 1, 2])
    fx.mark_live(7, "gave up", final=False)  # gpu 0 is dropped: only gpu 1
    assert ctl.kv["torn/1/e3"] == 1 and "torn/0/e0" not in ctl.kv
    assert ctl.kv["torn/1/e3/1"] == dict(step=7, writer=0, by=0, why="gave up", final=False, dropped=False)
    fx.mark_live(7, "again")  # the same (gpu, epoch, writer, step): not recorded twice
    assert ctl.kv["torn/1/e3"] == 1
    fx.mark([2], 7, "some rank", writer=None)  # not this rank's worker: its epoch from the store
    assert ctl.kv["torn/2/e0/1"]["writer"] is None and ("add", "infer/epoch/2") in ctl.calls
    ctl.down = True
    fx.mark([1], 8, "best effort")  # a store that cannot be reached: nothing raised
    assert fx.agree("own failure", 8) == (False, [])  # one rank: nothing to exchange


def test_failures_name_a_gone_rank_and_mark_every_worker_of_the_plan(monkeypatch):
    ctl = StoreCtl()
    fx = FailureExchange(ctl, object(), 1, 2, 1.0, 1.0, False, _links(ctl), [0, 1, 2])
    monkeypatch.setattr(control, "roll_call", lambda *a: ["trainer rank 0 (pid 5, host h)"])
    assert fx.mark_other_rank_gone(4, "closed") == "trainer rank 0 (pid 5, host h) died or hung"
    assert {k for k in ctl.kv if k.count("/") == 3} == {"torn/0/e0/1", "torn/1/e0/1", "torn/2/e0/1"}
    assert all(ctl.kv[f"torn/{g}/e0/1"]["writer"] is None for g in range(3))

    def unreachable(*a):
        raise ConnectionError("gone")

    monkeypatch.setattr(control, "roll_call", unreachable)
    assert "the store it hosted cannot be reached" in fx.mark_other_rank_gone(5, "closed")
    assert ctl.kv["torn/0/e0/2"]["step"] == 5


# ------------------------------------------------------------------ InPlaceWriter
def test_inplace_options_are_checked_first_and_the_writer_says_why_it_is_off(monkeypatch):
    monkeypatch.delenv("WXFER_DIRECT", raising=False)
    monkeypatch.delenv("WXFER_DIRECT_COPY_MAX", raising=False)
    assert options(None, None) == (True, 32 << 20) and options(False, "1MiB") == (False, 1 << 20)
    with pytest.raises(TypeError, match="direct must be True, False or None"):
        options("yes", None)
    with pytest.raises(ValueError, match="copy_max must be"):
        options(True, "lots")
    w = InPlaceWriter(True, 1 << 20, CPU, None, None, "fabric", None, _links())
    assert "only cuda_ipc" in w.off() and w.stats()["why_not"] == w.off()
    w = InPlaceWriter(True, 1 << 20, CPU, None, None, "cuda_ipc", None, _links())
    assert "not a CUDA device" in w.off()
    w.enabled = False
    assert w.off().startswith("off") and w.stats()["enabled"] is False and w.stats()["copy_max"] == 1 << 20


def test_inplace_waits_for_the_begin_stamps_once_per_push():
    waits = []
    w = InPlaceWriter(True, 1 << 20, CPU, None, None, "cuda_ipc", None, _links())
    for step in (1, 2):
        w.start(step, False, lambda s=step: waits.append(s))
        w._begin()
        w._begin()
    assert waits == [1, 2]


def test_a_failing_push_waits_for_its_inplace_writes_with_a_bound_naming_the_held_word(caplog):
    """abandon(): a stream that does not finish (behind a begin-stamp device wait whose fence
    word the engine holds) is waited for at most the bound -- no unbounded synchronize -- and
    the log names the held word's receiver; a stream that finishes is waited for."""
    import logging
    import time

    polls = []
    never = SimpleNamespace(record_event=lambda: SimpleNamespace(query=lambda: polls.append(1) and False))
    eng = SimpleNamespace(word_state=lambda: (1, "peer 1 (fi_sockaddr_in://127.0.0.1:9)", 3.5))
    w = InPlaceWriter(True, 1 << 20, CPU, never, None, "cuda_ipc", eng, _links())
    w.launched = True
    caplog.set_level(logging.WARNING, logger="wxfer")
    t0 = time.monotonic()
    assert w.abandon(bound=0.2) is False
    assert 0.2 <= time.monotonic() - t0 < 5 and len(polls) > 1 and w.launched is False
    assert "did not finish within 0.2 s" in caplog.text and "held for peer 1 (peer 1 (fi_sockaddr" in caplog.text
    done = SimpleNamespace(record_event=lambda: SimpleNamespace(query=lambda: True))
    w = InPlaceWriter(True, 1 << 20, CPU, done, None, "cuda_ipc", eng, _links())
    w.launched = True
    assert w.abandon(bound=0.2) is True


# ------------------------------------------------------------------ TaskRunner
class _Engine:
    def __init__(self, refuse=False, fail_wait=None):
        self.submits, self.waits, self.cleared, self.refuse, self.fail_wait = [], [], 0, refuse, fail_wait

    def submit(self, src, dests, **kw):
        if self.refuse:
            raise ValueError(f"bad descriptor (tag {STAMP_TAG})")
        self.submits.append((int(src.item()), list(dests), kw))
        return len(self.submits)

    def wait(self, timeout=None, fence=None):
        self.waits.append(fence)
        if self.fail_wait is not None:
            raise self.fail_wait

    def clear_error(self):
        self.cleared += 1

    def failed_peers(self):
        return []


class _Started:
    def __init__(self):
        self.starts = []

    def start(self, version, verify, wait_begin):
        self.starts.append((version, verify, wait_begin))


def _program(n_groups=1, per_group=2):
    groups = [
        [
            SimpleNamespace(task=g * per_group + i, name=f"p{g}.{i}", sources=[("a", None)], prep=None)
            for i in range(per_group)
        ]
        for g in range(n_groups)
    ]
    return SimpleNamespace(groups=groups, bytes_per_step=123)


def test_runner_writes_the_stamps_as_fence_tasks_and_the_inplace_writes_wait_for_the_begin_ones():
    eng, ip, ln = _Engine(), _Started(), _links()
    r = TaskRunner(eng, None, CPU, None, 0, _program(), ln, ip, 2.0)
    assert r.task_names == {0: "p0.0", 1: "p0.1"} and r.task_params == {0: 1, 1: 1}
    r.start(5, verify=True)
    assert r.sums == {}
    r.write_begin()
    val, dests, kw = eng.submits[0]
    assert val == 5 and dests == list(ln.begin_dest.values()) and kw == dict(tag=STAMP_TAG, fence=True)
    version, verify, wait_begin = ip.starts[-1]
    assert (version, verify) == (5, True) and eng.waits == []  # nothing waited for yet
    wait_begin()
    assert eng.waits == [1]  # that fence task alone
    r.write_end()
    assert eng.submits[1][0] == 5 and eng.submits[1][1] == list(ln.stamp_dest.values())
    assert eng.submits[1][2] == dict(tag=STAMP_TAG, fence=True)  # a plain fence: no event, no host wait
    r.drop_sums()
    r.verify_landed(None, 1.0)  # nothing to verify once dropped
    assert r.last_sums is None and r.last_verify is None


def test_runner_names_refused_stamps_and_the_task_and_worker_of_an_engine_failure():
    r = TaskRunner(_Engine(refuse=True), None, CPU, None, 3, _program(), _links(), _Started(), 1.0)
    r.start(9, verify=False)
    with pytest.raises(RuntimeError) as e:
        r.write_begin()
    assert "trainer rank 3, step 9: the begin version stamps to inference workers [0, 1] were refused" in str(e.value)
    assert "(the version stamps)" in str(e.value)
    eng = _Engine(fail_wait=_Err(11, tag=1))
    r = TaskRunner(eng, None, CPU, None, 3, _program(), _links(), _Started(), 1.0)
    r.start(9, verify=False)
    with pytest.raises(RuntimeError) as e:
        r.wait_engine(1.0, "waiting for the writes")
    msg = str(e.value)
    assert msg.startswith("wxfer: trainer rank 3, step 9: waiting for the writes: write to peer 11 timed out")
    assert "[plan task 1: p0.1]" in msg and "[peer 11 is inference worker gpu 1 (replica 0 rank 1" in msg
    assert eng.cleared == 1
    assert r.describe(_Err(12, tag=STAMP_TAG)).endswith("[the version stamps]")  # peer 12: not one of ours
    assert "[a batched copy of small tasks straight into the receivers' memory]" in r.describe(_Err(12, tag=COPIES_TAG))


# ------------------------------------------------------------------ StepLoop
class _Seen:
    """Runner, in-place writer and failure exchange as the step loop drives them: each call
    recorded in order; `copy`: tasks the in-place writer copies; `fast`: zero-copy tasks."""

    def __init__(self, copy=(), fast=(), fail_at=None):
        self.log, self.copy, self.fast, self.fail_at = [], set(copy), set(fast), fail_at
        self.sums = None

    def __getattr__(self, name):  # anything else: recorded, returns None
        return lambda *a, **k: self.log.append((name,) + a)

    def queue_run(self, ops, i):  # (no run queued at once: each task through queue_copy)
        return i

    def queue_copy(self, op):
        if op.task in self.copy:
            self.log.append(("copy", op.task))
            return True
        return False

    def fast_task(self, op):
        return op.task if op.task in self.fast else None

    def submit_fast(self, batch, ev):
        self.log.append(("batch", list(batch)))

    def run_task(self, op, ev):
        if op.task == self.fail_at:
            raise ValueError(f"task {op.task} failed")
        self.log.append(("run", op.task))

    def agree(self, own, step, broken=False):
        return bool(broken), []


def _loop(seen, program, links=None, engine=None):
    links = links or _links()
    engine = engine or _Engine()
    return StepLoop(None, None, 0, 1, 1.0, 1.0, CPU, None, engine, program, links, seen, seen, seen)


def test_the_step_loop_runs_copies_batches_and_tasks_in_order_group_by_group():
    import threading

    n = FAST_BATCH + 3
    prog = SimpleNamespace(
        groups=[
            [SimpleNamespace(task=i, nbytes=1, prep=None) for i in range(n + 2)],
            [SimpleNamespace(task=100, nbytes=1, prep=None)],
        ],
        bytes_per_step=1,
    )
    seen = _Seen(copy={0}, fast=set(range(1, n + 1)))
    loop = _loop(seen, prog)
    h = loop.push(4, False, seen.run_task, threading.RLock())
    kinds = [e[0] for e in seen.log]
    assert kinds[:2] == ["start", "write_begin"]
    body = [e for e in seen.log if e[0] in ("copy", "batch", "run", "end_group")]
    assert body[0] == ("copy", 0)
    assert body[1] == ("batch", list(range(1, FAST_BATCH + 1)))  # a full batch goes at once
    assert body[2] == ("batch", list(range(FAST_BATCH + 1, n + 1)))  # the rest before the next packed task
    assert body[3:] == [("run", n + 1), ("end_group",), ("run", 100), ("end_group",)]
    ph = loop.last_phases
    assert set(ph) == {"rejoin_check", "begin_stamps", "streams", "groups", "submit"} and loop.pending is h
    assert ph["rejoin_check"] <= ph["begin_stamps"] <= ph["streams"] <= ph["groups"] <= ph["submit"]
    assert h.wait() == loop.last_phases["done"] and h.done()
    assert ("write_end",) in seen.log and ("verify_landed", None, 2.5) in seen.log
    # the in-place writes are engine tasks: the engine's wait is theirs, nothing waited for beside it
    assert not any(e[0] in ("wait", "abandon") for e in seen.log), seen.log


class _Runs(_Seen):
    """_Seen whose in-place writer queues runs of consecutive copy tasks (``queue_run``): those in
    `copy` from the task it is asked at on, logged as one ("qrun", first, end)."""

    copy_live = True  # (a push that copies: the step loop asks queue_run)

    def queue_run(self, ops, i):
        j = i
        while j < len(ops) and ops[j].task in self.copy:
            j += 1
        if j > i:
            self.log.append(("qrun", ops[i].task, j))
        return j


def test_the_step_loop_hands_runs_of_copy_tasks_to_queue_run_and_the_rest_as_before():
    """The step loop asks queue_run at each task not in a run already; the tasks of a run go to
    neither queue_copy nor the engine; the others as before, in order (a zero-copy batch is not
    cut by a run)."""
    import threading

    ops = [SimpleNamespace(task=i, nbytes=1, prep=None, sends=True) for i in range(8)]
    prog = SimpleNamespace(groups=[ops], bytes_per_step=1)
    seen = _Runs(copy={0, 1, 3, 4, 5}, fast={2, 6})
    loop = _loop(seen, prog)
    loop.push(1, False, seen.run_task, threading.RLock()).wait()
    body = [e for e in seen.log if e[0] in ("copy", "batch", "run", "qrun", "end_group")]
    assert body == [("qrun", 0, 2), ("qrun", 3, 6), ("batch", [2, 6]), ("run", 7), ("end_group",)]
    assert loop.last_phases["submit"] > 0


def test_a_failure_inside_the_loop_lands_the_inplace_writes_and_marks_the_live_workers_torn():
    import threading

    seen = _Seen(fail_at=1)
    eng = _Engine()
    loop = _loop(seen, _program(1, 3), engine=eng)
    with pytest.raises(ValueError, match="task 1 failed"):
        loop.push(2, False, seen.run_task, threading.RLock())
    names = [e[0] for e in seen.log]
    assert names.index("abandon") < names.index("mark_live")
    _, step, why = next(e for e in seen.log if e[0] == "mark_live")
    assert step == 2 and "trainer rank 0 gave up on step 2 half written: ValueError: task 1 failed" in why
    assert ("run", 2) not in seen.log and eng.waits == [None]  # one rank: nothing drained, the engine waited for


def test_the_end_of_a_push_drops_and_marks_the_failed_workers_and_reports_them():
    import threading

    class Failing(_Engine):
        def failed_peers(self):
            return [_Err(11)]

    seen = _Seen()
    ln = _links()
    loop = _loop(seen, _program(), links=ln, engine=Failing())
    h = loop.push(3, False, seen.run_task, threading.RLock())
    with pytest.raises(RuntimeError) as e:
        h.wait()
    msg = str(e.value)
    assert "step 3: the writes to 1 inference worker(s) failed" in msg and "inference worker gpu 1 (" in msg
    assert "the other workers ([0]) received every byte of step 3" in msg
    assert ln.dropped == {1} and ("drop_sums",) in seen.log
    marks = [e for e in seen.log if e[0] == "mark"]
    assert [m[1] for m in marks] == [[1]] and "skips this worker from now on" in marks[0][3]
    assert not any(e[0] == "verify_landed" for e in seen.log)


def test_a_report_with_no_other_worker_says_so_instead_of_an_empty_list():
    """Issue 35.8: "the other workers ([]) received every byte" when this rank's only worker failed."""
    import threading

    class Failing(_Engine):
        def failed_peers(self):
            return [_Err(10)]

    seen = _Seen()
    loop = _loop(seen, _program(), links=_links(gpus=(0,)), engine=Failing())
    h = loop.push(3, False, seen.run_task, threading.RLock())
    with pytest.raises(RuntimeError) as e:
        h.wait()
    msg = str(e.value)
    assert "the writes to 1 inference worker(s) failed" in msg and "[]" not in msg, msg
    assert "no other inference worker is written by this trainer rank in step 3" in msg, msg


class _Agreeing(_Seen):
    """The failure exchange of two trainer ranks: `others` is what the other rank flags."""

    def __init__(self, others):
        super().__init__()
        self.others = others

    def agree(self, own, step, broken=False):
        self.log.append(("agree", own, step, broken))
        return broken or any(b for _, _, b in self.others), [(r, o) for r, o, _ in self.others]


def _two_ranks(seen):
    links = _links()
    return StepLoop(None, object(), 0, 2, 1.0, 1.0, CPU, None, _Engine(), _program(), links, seen, seen, seen)


def test_with_two_ranks_the_end_stamps_follow_the_agreement_and_none_when_another_rank_broke_the_step(monkeypatch):
    import threading

    from wxfer.runtime import control

    class Barrier:  # the mesh groups' barriers of a two-rank gloo group, passed at once
        def __init__(self, group, what):
            pass

        def wait(self, timeout):
            pass

    monkeypatch.setattr(control, "Barrier", Barrier)

    seen = _Agreeing([])  # the other rank's step went well
    loop = _two_ranks(seen)
    loop.push(5, False, seen.run_task, threading.RLock()).wait()
    names = [e[0] for e in seen.log]
    assert names.index("agree") < names.index("write_end"), names  # stamped only once both agreed
    assert names.count("wait_engine") == 2 and "stamps" in loop.last_phases

    seen = _Agreeing([(1, "RuntimeError: injected on rank 1", True)])  # rank 1 broke step 6
    loop = _two_ranks(seen)
    with pytest.raises(RuntimeError) as e:
        loop.push(6, False, seen.run_task, threading.RLock()).wait()
    assert "trainer rank 1 reports: RuntimeError: injected on rank 1" in str(e.value)
    assert ("write_end",) not in seen.log, seen.log  # no end stamp of a broken step, anywhere
    _, step, why = next(e for e in seen.log if e[0] == "mark_live")
    assert step == 6 and "did not stamp step 6 complete: another trainer rank broke it" in why

    seen = _Agreeing([(1, "the writes to 1 inference worker(s) failed", False)])  # a report, not broken
    loop = _two_ranks(seen)
    with pytest.raises(RuntimeError, match="trainer rank 1 reports: the writes to 1"):
        loop.push(7, False, seen.run_task, threading.RLock()).wait()
    assert ("write_end",) in seen.log  # the others' workers get their stamp


@pytest.mark.skipif(not _wxfer.backends()["fabric"][0], reason="fabric transport not built")
@pytest.mark.timeout(60)
def test_inplace_on_a_transport_that_cannot_map_sends_the_task_the_staging_way_saying_why():
    """On a real fabric tcp connection: Transport.map refuses (only cuda_ipc maps), so the
    writer's binding of a destination fails with the transport's words and nothing is cached
    as a view; a range outside the region is refused by the transport's own check."""
    from wxfer.runtime.inplace import _NotInPlace
    from wxfer.testing import connected_fabric

    with connected_fabric("tcp", [4096]) as (t, tgt):
        d = bytes(tgt.descriptors[0])
        w = InPlaceWriter(True, 1 << 20, CPU, None, t, "fabric", None, _links())
        with pytest.raises(_NotInPlace, match="only cuda_ipc maps"):
            w._view(d)
        assert w.views == {}
        with pytest.raises(_NotInPlace, match="outside the 4096-byte region"):
            w._map(d, 4000, 200)  # the generic layer's range check, as for a write


def test_a_push_after_a_held_fence_word_waits_on_the_host_naming_the_worker(monkeypatch, caplog):
    """The begin stamps' device wait: a receiver stopped mid-push (SIGSTOP) has its begin stamp
    abandoned and NOT fenced (fabric), so the engine holds the fence word. The next push must
    not queue a device wait that cannot pass before the word is released (a hang of the
    stream and of every host wait on it): it waits for its begin stamps on the host, bounded,
    and the log names the worker. Once the receiver resumes and its abandoned writes
    complete, the word goes on and the device wait is used again. A real engine over fabric
    tcp; the CPU stands in for the device (stream_wait recorded, not run)."""
    import logging
    import time

    from wxfer.testing import pattern as rand

    with held_word_engine() as h:
        good, bad, eng, word = h.good, h.bad, h.eng, h.word
        ln = _links()
        ln.peers, ln.gpu_of_peer = {0: 0, 1: 1}, {0: 0, 1: 1}
        ln.begin_dest = {0: (good.descriptors[0], 0, 0, 8), 1: (bad.descriptors[0], 0, 0, 8)}
        ip = _Started()
        r = TaskRunner(eng, h.t, torch.device("cpu", 0), None, 0, _program(), ln, ip, 20.0)
        r.begin_word_dev = 0xDE00  # as begin_wait_word leaves it on a GPU
        waits = []
        monkeypatch.setattr(_wxfer, "stream_wait", lambda *a: waits.append(a[-1]), raising=False)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: SimpleNamespace(cuda_stream=7))
        r.start(1, verify=False)
        r.write_begin()
        ip.starts[-1][2]()  # no word held: the device wait
        assert waits == [r.begin_fence & 0xFFFFFFFF]
        h.stop()
        n = 4 << 20  # a fence task whose write to the stopped receiver is abandoned at 1 s
        f = eng.submit(rand(n, 1), h.both(n), fence=True)
        eng.wait(timeout=20)  # the stopped receiver failed at its deadline, NOT fenced
        assert word.value < f and eng.word_state()[0] == 1
        r.start(2, verify=False)
        r.write_begin()
        caplog.set_level(logging.WARNING, logger="wxfer")
        t0 = time.monotonic()
        ip.starts[-1][2]()
        assert time.monotonic() - t0 < 10  # the host wait for the live receiver's stamp
        assert len(waits) == 1 and r.word_held_pushes == 1  # no device wait queued
        msg = caplog.text
        assert "fence word is held" in msg and "peer 1" in msg and "inference worker gpu 1" in msg, msg
        h.resume()
        assert h.released() and word.value == r.begin_fence
        r.start(3, verify=False)
        r.write_begin()
        ip.starts[-1][2]()
        assert waits[-1] == r.begin_fence & 0xFFFFFFFF and r.word_held_pushes == 1  # the device again
        eng.close()


class _Stamping(_Started):
    """An in-place writer that records the begin stamps it is asked to write on the stream."""

    def __init__(self, why=None):
        super().__init__()
        self.stamped, self.why = [], why

    def off(self):
        return None

    def stamp_begin(self, dests, version):
        self.stamped.append((dict(dests), version))
        return self.why


def test_stream_order_neither_waits_nor_reads_a_fence_word_the_engines_error_holds(monkeypatch):
    """WXFER_BEGIN_WAIT=stream (opt-in): the begin stamps are written on the side stream
    ahead of the in-place writes (InPlaceWriter.stamp_begin), so nothing waits on the fence
    word.  A real engine over fabric tcp whose sticky error cancelled a fence (the word held
    until close, Engine.word_state): the next push's _wait_begin returns at once, queues no
    device wait and no host wait, and the stamps asked for are this push's, to every receiver.
    A stamp that cannot be written there (stamp_begin says why) falls back to the host wait,
    bounded, for good."""
    import ctypes
    import time

    from wxfer.testing import TargetProcess
    from wxfer.testing import pattern as rand

    monkeypatch.setenv("WXFER_BEGIN_WAIT", "stream")  # (opt-in)
    opts = {"provider": "tcp"}
    with TargetProcess("fabric", opts, [4 << 20, 4096]) as tgt:
        t = _wxfer.Transport("fabric", opts)
        assert tgt.connect(t) == 0
        eng = _wxfer.Engine(t, timeout=0.5)  # (no isolate: a missed deadline is the engine's error)
        word = ctypes.c_uint32(0)
        eng.fence_word(ctypes.addressof(word), word)  # (as the device mode would have it)
        eng.submit_external([(tgt.descriptors[0], 0, 0, 64)], tag=5)  # no signal: its deadline fails the engine
        f = eng.submit(rand(8, 2), [(tgt.descriptors[1], 0, 0, 8)], fence=True)
        with pytest.raises(Exception, match="deadline"):
            eng.wait(timeout=20, fence=f)
        end = time.monotonic() + 10
        while eng.word_state() is None and time.monotonic() < end:
            time.sleep(0.01)
        assert eng.word_state()[0] is None  # held for the engine's error, until close
        eng.clear_error()
        ln = _links(gpus=(0,))
        ln.peers, ln.gpu_of_peer = {0: 0}, {0: 0}
        ln.begin_dest = {0: (tgt.descriptors[1], 8, 0, 8)}
        ip = _Stamping()
        r = TaskRunner(eng, t, torch.device("cpu", 0), None, 0, _program(), ln, ip, 20.0)
        assert r.begin_on_stream and r.begin_word is None and r.why_host_wait is None
        queued = []
        monkeypatch.setattr(_wxfer, "stream_wait", lambda *a: queued.append(a), raising=False)
        calls = []
        real_wait = eng.wait
        eng_wait = lambda *a, **kw: calls.append(kw) or real_wait(*a, **kw)  # noqa: E731
        monkeypatch.setattr(r, "engine", SimpleNamespace(wait=eng_wait, submit=eng.submit, word_state=eng.word_state))
        for step in (1, 2):
            r.start(step, verify=False)
            r.write_begin()
            t0 = time.monotonic()
            ip.starts[-1][2]()
            assert time.monotonic() - t0 < 0.5
            assert ip.stamped[-1] == ({0: ln.begin_dest[0]}, step)
        assert queued == [] and calls == [] and r.word_held_pushes == 0 and eng.word_state()[0] is None
        # a stamp that cannot be written on the stream: the host wait (bounded), from then on
        ip.why = "the begin stamp of inference worker gpu 0: not mapped"
        r.start(3, verify=False)
        r.write_begin()
        ip.starts[-1][2]()
        assert calls and calls[-1]["fence"] == r.begin_fence and not r.begin_on_stream
        assert "not mapped" in r.why_host_wait and len(ip.stamped) == 3
        r.start(4, verify=False)
        r.write_begin()
        ip.starts[-1][2]()
        assert len(ip.stamped) == 3 and len(calls) == 2  # not asked again
        eng.close()
        t.close()


def test_stream_stamps_fill_the_receivers_mapped_here_and_keep_the_others_from_in_place_writes(monkeypatch):
    """InPlaceWriter.stamp_begin (the stream order): the begin stamp of each receiver mapped
    here is filled with the push's version; one the transport refuses (another GPU) is not,
    and then no region of that receiver is mapped for in-place writes (its tasks go the
    engine's way); one whose memory is mapped already but whose stamp cannot be sends the push
    to the host wait (a reason naming it); a receiver failed in the engine is neither filled
    nor written for the rest of the push."""
    from wxfer.runtime import inplace as ipm
    from wxfer.runtime.inplace import _NotInPlace

    mem = {r: torch.zeros(64, dtype=torch.uint8) for r in (b"stamp0", b"stamp1", b"region0", b"region1")}
    monkeypatch.setattr(ipm, "region_nbytes", lambda r: mem[bytes(r)].numel())
    failed = []
    eng = SimpleNamespace(failed_peers=lambda: list(failed))

    def writer(refuse):
        w = InPlaceWriter(True, 1 << 20, CPU, None, None, "cuda_ipc", eng, _links())

        def fake_map(r, off, nb):
            if r in refuse:
                raise _NotInPlace("the memory is not on the writer GPU cpu")
            return mem[r].data_ptr() + off, None

        w._map = fake_map
        w._tensor = lambda addr, n: next(t for t in mem.values() if t.data_ptr() == addr)
        return w

    def stamp(g):
        return int(mem[b"stamp%d" % g][8:16].view(torch.int64))

    w = writer({b"stamp1", b"region1"})  # receiver 1 on another GPU
    dests = w.links.begin_dest
    assert w.stamp_begin(dests, 5) is None
    assert (stamp(0), stamp(1)) == (5, 0) and w.stamp_views[1][1] is None and w.unstamped == frozenset()
    w._view(b"region0")
    with pytest.raises(_NotInPlace, match="begin stamp is not mapped here"):
        w._view(b"region1")
    failed.append(SimpleNamespace(peer=10))  # receiver 0 failed in the engine (its peer 10)
    assert w.stamp_begin(dests, 6) is None
    assert stamp(0) == 5 and w.unstamped == {0} and 0 in w._skip()
    failed.clear()
    w2 = writer(set())
    w2.links.begin_dest[1] = (b"stamp1", 12, 0, 8)  # receiver 1's stamp not one aligned int64
    w2._view(b"region1")  # its memory mapped first (the push's first task)
    why = w2.stamp_begin(w2.links.begin_dest, 7)
    assert why is not None and "gpu 1" in why and "mapped here" in why


class _InPlace(_Agreeing):
    """_Seen as a push that writes in place (``copy_live``): every task bound (``plan_of``)."""

    copy_live = True

    def __init__(self, fail_at=None):
        super().__init__([])
        self.fail_at = fail_at

    def plan_of(self, op):
        return object(), None


def _prep(path, collective=False):
    """A TaskPrep as StepLoop._ordered reads it: its best path and whether it has collectives."""
    from wxfer import taskpath

    facts = {
        "copy": taskpath.Facts(True, taskpath.ROWS),
        "direct": taskpath.Facts(True, taskpath.ROWS, held=False),
    }[path]
    best = taskpath.best(facts)
    assert best.path == path, best
    return SimpleNamespace(best=best, gathers=[1] if collective else [], generic=[], done=0)


def test_the_first_task_written_in_place_goes_before_the_tasks_without_collectives_and_a_failure_drains_that_order(
    monkeypatch,
):
    """Issue 37: a push that writes in place runs a group's first direct tasks (steps.LEAD: their
    quantizer launches, the SMs' first work) before the tasks that hold their sources here (zero copy,
    copies queued for later launches, packed from whole tensors), never ahead of a collective
    (this rank's collectives keep their order: the ranks still pair); the plan's order without
    in-place writes, or where a collective comes first.  A failure's drain follows the order
    run: it does not drain the task already run again."""
    import threading

    class Barrier:
        def __init__(self, group, what):
            pass

        def wait(self, timeout):
            pass

    monkeypatch.setattr(control, "Barrier", Barrier)

    def op(t, prep, sends=True):
        return SimpleNamespace(task=t, nbytes=1, prep=prep, sends=sends)

    cp, packed = _prep("copy"), _prep("direct")
    g0 = [op(0, cp), op(1, cp), op(2, _prep("direct", collective=True)), op(3, packed), op(4, cp)]
    g1 = [op(10, cp), op(11, _prep("direct", collective=True)), op(12, _prep("direct", collective=True))]
    g1[0].prep = SimpleNamespace(best=cp.best, gathers=[1], generic=[], done=0)  # a collective first
    prog = SimpleNamespace(groups=[g0, g1], bytes_per_step=1)
    seen = _InPlace()
    seen.copy = {0, 4}
    loop = StepLoop(None, object(), 0, 2, 1.0, 1.0, CPU, None, _Engine(), prog, _links(), seen, seen, seen)
    loop.push(1, False, seen.run_task, threading.RLock()).wait()
    body = [e for e in seen.log if e[0] in ("copy", "run", "end_group")]
    assert body == [
        ("run", 2), ("run", 3), ("copy", 0), ("run", 1), ("copy", 4), ("end_group",),
        ("run", 10), ("run", 11), ("run", 12), ("end_group",),
    ], body  # fmt: skip
    # (2 and the next one written in place first: steps.LEAD)
    assert loop.task_order() == [[2, 3, 0, 1, 4], [10, 11, 12]]
    # a prep made again (memory moved, a restarted worker): decided again -- here with a collective
    g0[1].prep = SimpleNamespace(best=cp.best, gathers=[1], generic=[], done=0)
    assert loop.task_order()[0] == [0, 1, 2, 3, 4]
    g0[1].prep = cp
    # no in-place writes this push: the plan's order
    seen.copy_live = False
    assert loop.task_order()[0] == [0, 1, 2, 3, 4]
    seen.copy_live = True
    # a failure in task 1 (run fourth): its collectives and those after it in the order run,
    # not those of tasks 2 and 3 again
    seen = _InPlace(fail_at=1)
    seen.copy = {0, 4}
    loop = StepLoop(None, object(), 0, 2, 1.0, 1.0, CPU, None, _Engine(), prog, _links(), seen, seen, seen)
    drained = []
    monkeypatch.setattr(loop, "_drain", lambda ops, resume=False: drained.append(([o.task for o in ops], resume)))
    with pytest.raises(ValueError, match="task 1 failed"):
        loop.push(2, False, seen.run_task, threading.RLock())
    assert drained == [([1], True), ([4], False), ([10, 11, 12], False)], drained
    # a failure while the next group's order is decided (after group 0's barrier): group 1 is
    # drained whole, in its order -- not group 0's tasks again
    seen = _InPlace()
    seen.copy = {0, 4}
    loop = StepLoop(None, object(), 0, 2, 1.0, 1.0, CPU, None, _Engine(), prog, _links(), seen, seen, seen)
    drained = []
    monkeypatch.setattr(loop, "_drain", lambda ops, resume=False: drained.append(([o.task for o in ops], resume)))
    real = loop._ordered

    def ordered(gi, ops):
        if gi == 1:
            raise ValueError("group 1's order failed")
        return real(gi, ops)

    monkeypatch.setattr(loop, "_ordered", ordered)
    with pytest.raises(ValueError, match="group 1's order failed"):
        loop.push(3, False, seen.run_task, threading.RLock())
    assert drained == [([10, 11, 12], False)], drained


@pytest.mark.parametrize("setting", ["", "0"])
def test_the_collector_is_paused_while_a_push_submits_and_resumed_after(monkeypatch, setting):
    """WXFER_GC_PAUSE (on by default): gc is off while push() submits its tasks, back on when it
    returns and when it raises; 0: left as it was; a collector the user turned off stays off."""
    import gc
    import threading

    monkeypatch.setenv("WXFER_GC_PAUSE", setting)
    prog = SimpleNamespace(groups=[[SimpleNamespace(task=0, nbytes=1, prep=None)]], bytes_per_step=1)
    states = []

    class Probe(_Seen):
        def run_task(self, op, ev):
            states.append(gc.isenabled())
            return super().run_task(op, ev)

    assert gc.isenabled()
    seen = Probe()
    _loop(seen, prog).push(1, False, seen.run_task, threading.RLock()).wait()
    assert states == [setting == "0"] and gc.isenabled()
    seen = Probe()
    seen.fail_at = 0
    with pytest.raises(ValueError, match="task 0 failed"):
        _loop(seen, prog).push(2, False, seen.run_task, threading.RLock())
    assert states[-1] == (setting == "0") and gc.isenabled()
    gc.disable()
    try:
        seen = Probe()
        _loop(seen, prog).push(3, False, seen.run_task, threading.RLock()).wait()
        assert states[-1] is False and not gc.isenabled()
    finally:
        gc.enable()
