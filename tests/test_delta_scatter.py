"""The delta writer's scatter (issue 36, item 2; wxfer.runtime.delta_scatter) on CPU: the option
checked naming it, the scatter table's validation, the chooser with the scatter cost, and a
Sender whose tasks are scattered into the receivers' memory (fabric tcp, receivers in threads of
this process; the kernels emulated as in test_delta_kernels.py and the receivers' regions
"mapped" at their host addresses, which cuda_ipc's Transport.map gives on a GPU): every push
leaves a dense push's bytes, the receivers run nothing, and a dropped receiver is not written.
The kernel itself, on cuda_ipc between two processes of one GPU: tests/test_delta_scatter_gpu.py."""

import array

import pytest
import torch

from wxfer import _wxfer
from wxfer.runtime import delta_gpu, delta_scatter
from wxfer.runtime.sender import _delta_option

from test_delta_kernels import emulated  # noqa: F401 -- the fixture, used by name


def test_the_scatter_option_is_checked_naming_it():
    assert _delta_option({"scatter": "force"}) == {"scatter": "force"}
    for bad in ("always", 1, True, ""):
        with pytest.raises(ValueError, match=r"delta\['scatter'\] must be 'auto', 'force' or 'off'"):
            _delta_option({"scatter": bad})
    with pytest.raises(ValueError, match="unknown .*scatter"):
        _delta_option({"scater": "force"})
    from wxfer.runtime.sender import Sender

    # refused before anything is set up (no store, no model needed)
    with pytest.raises(ValueError, match=r"delta\['scatter'\]"):
        Sender(None, None, delta={"scatter": "sometimes"})


def test_the_scatter_table_check_names_the_bad_entry():
    ok = (0x1000, 5, 100, 0)
    assert _wxfer.delta_check(3, array.array("Q", ok), 64, 105) == 1
    with pytest.raises(_wxfer.Error, match="scatter range 0: its range \\[5, 105\\) is not inside the 104-byte"):
        _wxfer.delta_check(3, array.array("Q", ok), 64, 104)
    with pytest.raises(_wxfer.Error, match="scatter range 0: null destination"):
        _wxfer.delta_check(3, array.array("Q", (0,) + ok[1:]), 64, 105)
    with pytest.raises(_wxfer.Error, match="scatter range 1: seg0 0, expected 1"):
        _wxfer.delta_check(3, array.array("Q", ok + ok), 64, 105)
    with pytest.raises(_wxfer.Error, match="scatter range 0.*bitmask"):
        _wxfer.delta_check(3, array.array("Q", ok), 8, 105)


@pytest.mark.parametrize("rate", [0.0, 0.004, 0.5, 1.0])
def test_the_emulated_scatter_stores_the_changed_bytes_and_nothing_else(emulated, rate):  # noqa: F811
    g = torch.Generator().manual_seed(int(rate * 1000) + 11)
    n, so = 20_011, 7
    old = torch.randint(0, 256, (n + 20,), dtype=torch.uint8, generator=g)
    new = old.clone()
    m = torch.rand(n + 20, generator=g) < rate
    new[m] = new[m] ^ torch.randint(1, 256, (int(m.sum()),), dtype=torch.uint8, generator=g)
    shadow = old.clone()
    cs, st = delta_gpu.compare_count(shadow, new, [(so, n, so)])
    # the destination holds the old bytes but for a marker where nothing changed: a store
    # outside the changed bytes would show
    dst = torch.full((n + 3,), 0xEE, dtype=torch.uint8)
    changed = (new[so : so + n] != old[so : so + n]).nonzero().view(-1)
    assert cs[0] == changed.numel()
    delta_gpu.scatter(shadow, st["bits"], [(dst.data_ptr() + 3, so, n)])
    want = torch.full_like(dst, 0xEE)
    want[3 + changed] = new[so + changed]
    assert torch.equal(dst, want)


class _W:
    """What a Scatter reads of its delta writer."""

    def __init__(self, costs, gpu=True):
        self.costs, self.gpu, self.encoder_why = costs, gpu, None
        self.runner = type("R", (), {"inplace": object()})()


class _Op:
    task, dests = 3, [(b"r", 0, 0, 100)]


@pytest.mark.parametrize(
    "mode,costs,t_dense,t_rec,want",
    [
        ("auto", {"scatter_Bps": 1e9}, 1.0, 1.0, True),  # 1000 bytes in 1 us: cheapest
        ("auto", {"scatter_Bps": 1e3}, 0.5, 2.0, False),  # 1 s: dense is cheaper
        ("auto", {"scatter_Bps": 1e3}, 2.0, 0.5, False),  # 1 s: records are cheaper
        ("auto", {}, 1.0, 1.0, False),  # no measured rate: not by cost
        ("force", {}, 1.0, 1.0, True),
        ("force", {"scatter_Bps": 1e3}, 1e-6, 1e-6, True),
        ("off", {"scatter_Bps": 1e12}, 1.0, 1.0, False),
    ],
)
def test_the_chooser_takes_the_scatter_where_it_costs_least(monkeypatch, mode, costs, t_dense, t_rec, want):
    sc = delta_scatter.Scatter(mode, _W(costs))
    monkeypatch.setattr(sc, "address", lambda rdesc, off, n: 0x1000 + off)
    assert sc.chosen(_Op(), 1000, t_dense, t_rec) is want
    assert sc.forced(_Op()) is (mode == "force")
    assert sc.stats()["mode"] == mode and ("why_not" in sc.stats()) is (mode == "off")


def test_no_scatter_without_the_kernels_or_a_mapped_destination(monkeypatch):
    sc = delta_scatter.Scatter("force", _W({"scatter_Bps": 1e12}, gpu=False))
    assert sc.targets(_Op()) is None and not sc.forced(_Op()) and "kernels" in sc.stats()["why_not"]

    def refuse(rdesc, off, n):
        raise ValueError("not mapped here")

    sc = delta_scatter.Scatter("force", _W({"scatter_Bps": 1e12}))
    monkeypatch.setattr(sc, "address", refuse)
    assert sc.targets(_Op()) is None and not sc.chosen(_Op(), 10, 1.0, 1.0)


def test_a_shadow_range_longer_than_its_mapped_destination_is_refused_before_anything_runs(monkeypatch):
    """The scatter's store length is the shadow range's; the launcher knows only addresses, so the
    writer refuses a destination whose shadow range (by source offset) is not its own length
    (two destinations of one source offset, different lengths: the shadow keeps one of them),
    naming the task and the destination, before the begin-stamp wait and any launch."""
    import types

    launched, begun = [], []
    monkeypatch.setattr(delta_gpu, "scatter", lambda *a: launched.append(a))
    ip = types.SimpleNamespace(external_begin=lambda: begun.append(1) or set(), external_done=lambda *a: None)
    w = types.SimpleNamespace(gpu=True, runner=types.SimpleNamespace(inplace=ip), step={})
    w.step.update(tasks_scatter=0, scatter_bytes=0, scatter_skipped=0)
    sc = delta_scatter.Scatter("force", w)
    monkeypatch.setattr(sc, "address", lambda rdesc, off, n: 4096 + off)
    dests = [(b"r0", 0, 64, 32), (b"r1", 0, 64, 16)]  # one source offset, 32 then 16 bytes
    op = types.SimpleNamespace(task=7, prep=types.SimpleNamespace(dests=dests))
    sh = ([(64, 16, 0), (64, 32, 16)], torch.zeros(48, dtype=torch.uint8))  # sorted: by soff, n
    with pytest.raises(ValueError, match=r"task 7: destination 1 \(offset 0, 16 bytes, source offset 64\) has a "
                       r"shadow range of 32 bytes"):  # fmt: skip
        sc.write(op, dests, [0, 1], sh, {"bits": None}, {64: (0, 5)})
    assert launched == [] and begun == [] and sc.total["tasks"] == 0


def _sender_run(store, monkeypatch, name, mode, costs, tp=2, quant="fp8", **kw):
    """A Sender with delta (scatter `mode`, `costs` and the link pinned) on the emulated kernel
    path, every destination "mapped" at its receiver's host address, and `tp` receivers:
    (test_delta, the model, each receiver's params, the sender, the receivers)."""
    import test_delta as td

    if not td.FABRIC:
        pytest.skip("fabric transport not built")
    from wxfer.runtime import delta_send

    monkeypatch.setattr(delta_send, "_kernels", lambda device: (True, None))
    _, addr = store
    delta = dict(td.SLOW, costs=dict(td.SLOW["costs"], **costs), scatter=mode)
    model, params, sender, recvs = td._delta_run(addr, name, tp, quant, delta, **kw)
    base = {}
    for r in recvs:
        for d, t in r.region_base.items():
            base[d] = t.data_ptr()
    monkeypatch.setattr(delta_scatter.Scatter, "address", lambda self, rdesc, off, n: base[bytes(rdesc)] + off)
    return td, model, params, sender, recvs


@pytest.mark.parametrize("quant", [None, "fp8"])
def test_a_forced_scatter_push_is_bit_identical_to_dense_and_sends_no_records(store, emulated, monkeypatch, quant):  # noqa: F811
    td, model, params, sender, recvs = _sender_run(store, monkeypatch, "dscat" + str(quant), "force", {}, 2, quant)
    gen = torch.Generator().manual_seed(8)
    try:
        lasts = []
        for step in range(1, 4):
            if step > 1:
                td._touch(model, 0.01, gen)
            applied = td._push_equal(model, params, sender, recvs, 2, quant, f"step {step}")
            lasts.append((sender.stats()["delta"]["last"], applied))
        (l1, _), (l2, a2), (l3, a3) = lasts
        assert l1["tasks_scatter"] == 0 and l1["dense_why"].get("first", 0) > 0  # dense by rule
        for last, applied in ((l2, a2), (l3, a3)):
            assert last["tasks_scatter"] > 0 and last["tasks_delta"] == 0, last
            assert 0 < last["scatter_bytes"] < 0.2 * last["delta_bytes"], last
            # each receiver got its staging header only: no records to apply
            assert all(a["records"] == 0 for a in applied), applied
        st = sender.stats()["delta"]
        assert st["scatter"]["mode"] == "force" and st["scatter"]["total"]["tasks"] > 0
        assert sender.engine.stats()["bytes_external"] > 0
    finally:
        sender.close()
        for r in recvs:
            r.close()


def test_auto_scatters_where_cheapest_and_a_dropped_receiver_is_not_written(store, emulated, monkeypatch):  # noqa: F811
    td, model, params, sender, recvs = _sender_run(store, monkeypatch, "dscatauto", "auto", {"scatter_Bps": 1e12})
    gen = torch.Generator().manual_seed(9)
    try:
        for step in range(1, 3):
            if step > 1:
                td._touch(model, 0.01, gen)
            td._push_equal(model, params, sender, recvs, 2, "fp8")
        last = sender.stats()["delta"]["last"]
        assert last["tasks_scatter"] > 0 and last["tasks_delta"] == 0, last
        # the scatter as slow as the link: records again
        sender.delta.costs["scatter_Bps"] = 1.0
        td._touch(model, 0.01, gen)
        td._push_equal(model, params, sender, recvs, 2, "fp8")
        last = sender.stats()["delta"]["last"]
        assert last["tasks_scatter"] == 0 and last["tasks_delta"] > 0, last
        # worker gpu 1 given up on (dropped): the scatter skips it, gpu 0 gets the new bytes
        sender.delta.costs["scatter_Bps"] = 1e12
        before = {n: t.clone() for n, t in params[1].items()}
        from wxfer.runtime.peerstate import Event

        sender.links.states.apply(1, Event.WRITE_FAILED, "a test's failed write")  # as _take_failed
        assert sender.links.drop({1}) == {1}
        td._touch(model, 0.01, gen)
        try:
            sender.push()
        except RuntimeError:
            pass  # a push may name the worker it skipped; its bytes are what is checked here
        last = sender.stats()["delta"]["last"]
        assert last["tasks_scatter"] > 0 and last["scatter_skipped"] > 0, last
        assert all(torch.equal(before[n], t) for n, t in params[1].items()), "the dropped receiver was written"
        recvs[0].apply()
        for rank, dst, off, b in td.expected_shards(model, td.TINY, 2, "fp8"):
            if rank == 0:  # gpu 0 as a dense push leaves it
                assert torch.equal(params[0][dst].view(-1).view(torch.uint8)[off : off + b.numel()], b), dst
    finally:
        sender.close()
        for r in recvs:
            r.close()


def _shards_equal(td, model, params, rank) -> bool:
    """Receiver `rank` holds what a dense push of `model` writes there (no quantization)."""
    for rk, dst, off, b in td.expected_shards(model, td.TINY, 2, None):
        if rk == rank and not torch.equal(params[rk][dst].view(-1).view(torch.uint8)[off : off + b.numel()], b):
            return False
    return True


def test_a_scattered_step_after_missed_records_is_refused_and_a_missed_empty_one_is_not(store, emulated, monkeypatch):  # noqa: E501,F811
    """The scatter stores only the changed bytes: over a receiver that did not apply the records
    before, the step it completes is wrong. Its apply() refuses it (DeltaError, resync asked)
    though the step has no records of its own; a step without records that a receiver did not
    apply (dense or scattered) is no reason to refuse the next."""
    from wxfer.runtime import delta

    td, model, params, sender, recvs = _sender_run(store, monkeypatch, "dmiss", "auto", {"scatter_Bps": 1.0}, 2, None)
    gen = torch.Generator().manual_seed(8)
    sc = sender.delta.scatter

    def push(mode):
        sc.mode = mode
        td._touch(model, 0.01, gen)
        sender.push()
        return sender.stats()["delta"]["last"]

    try:
        sender.push()  # 1: dense (the first); receiver 1 does not apply it (no records in it)
        recvs[0].apply()
        last = push("force")  # 2: scattered over the dense bytes
        assert last["tasks_scatter"] > 0 and last["tasks_delta"] == 0, last
        assert [r.apply()["records"] for r in recvs] == [0, 0]
        assert td._dense_equal(model, params, 2, None)
        last = push("auto")  # 3: records (the scatter costed as slow as the link)
        assert last["tasks_delta"] > 0 and last["tasks_scatter"] == 0, last
        for r in recvs:
            r.apply()
        push("force")  # 4: scattered; receiver 1 does not apply it: nothing of it is missed
        recvs[0].apply()
        push("force")  # 5: scattered over step 3's applied records
        assert [r.apply()["records"] for r in recvs] == [0, 0]
        assert td._dense_equal(model, params, 2, None)
        last = push("auto")  # 6: records; receiver 1 misses them
        assert last["tasks_delta"] > 0, last
        recvs[0].apply()
        last = push("force")  # 7: every task scattered, no records: receiver 1's bytes are wrong
        assert last["tasks_scatter"] > 0 and last["tasks_delta"] == 0, last
        recvs[0].apply()
        assert _shards_equal(td, model, params, 0)
        assert recvs[1].version() == 7  # the stamps say complete: only apply() can tell
        assert not _shards_equal(td, model, params, 1)
        with pytest.raises(delta.DeltaError, match="records of step 6, which this worker did not apply"):
            recvs[1].apply()
        assert sender.delta.ctl.check("delta/resync/1")
        last = push("force")  # 8: dense to receiver 1 (it asked), scattered to receiver 0
        assert last["dense_why"].get("not_in_step", 0) > 0, last
        for r in recvs:
            r.apply()
        assert td._dense_equal(model, params, 2, None)
    finally:
        sender.close()
        for r in recvs:
            r.close()


def test_the_demo_flags_make_the_scatter_option():
    from argparse import Namespace as ns

    from wxfer.tools.demo import _delta_arg

    assert _delta_arg(ns(delta=False, delta_scatter="force", delta_link_gbps=None)) is False
    assert _delta_arg(ns(delta=True, delta_scatter=None, delta_link_gbps=None)) is True
    assert _delta_arg(ns(delta=True, delta_scatter=None, delta_link_gbps=1.0)) == 1.0
    assert _delta_arg(ns(delta=True, delta_scatter="force", delta_link_gbps=None)) == {"scatter": "force"}
    got = _delta_arg(ns(delta=True, delta_scatter="auto", delta_link_gbps=8.0))
    assert got == {"scatter": "auto", "link_Bps": 1e9, "measure_link": False}
    assert _delta_option(got) == got


@pytest.mark.parametrize("rate", [0.01, 0.5])
def test_the_bench_scatter_kernel_row_is_bit_exact_on_the_emulation(emulated, rate):  # noqa: F811
    """benchmarks/bench_delta.py --parts scatter's kernel row (the GPU's: test_delta_scatter_gpu.py)
    on host memory with the kernels emulated: the destination ends equal to the new bytes."""
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks.bench_delta import bench_scatter_kernel

    r = bench_scatter_kernel(torch.device("cpu"), 20_000, rate, 1)
    assert r["bitexact"] and r["changed"] == r["expected_changed"] > 0, r


def test_verify_checks_the_whole_destination_of_a_scatter_push(store, emulated, monkeypatch):  # noqa: F811
    """push(verify=True) with every task scattered: the trainer's checksums (of its fresh bytes,
    every destination range) match what each receiver holds."""
    td, model, params, sender, recvs = _sender_run(store, monkeypatch, "dscatverify", "force", {}, 1, None, verify=True)
    gen = torch.Generator().manual_seed(12)
    try:
        for step in range(1, 4):
            if step > 1:
                td._touch(model, 0.01, gen)
            sender.push(verify=True)
            rep = sender.last_verify[0]
            assert rep["bytes"] == sender.bytes_per_step and not rep["mismatch"] and not rep["errors"], rep
            assert td._dense_equal(model, params, 1, None)
        assert sender.stats()["delta"]["last"]["tasks_scatter"] > 0
    finally:
        sender.close()
        for r in recvs:
            r.close()
