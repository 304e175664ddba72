"""The in-place path's CPU-testable parts (wxfer.runtime.inplace; the GPU pushes are in
tests/test_direct_gpu.py): Transport.map's validation (the generic layer's, as for writes)
and its refusal on a transport that cannot map; the decomposition of a packed task into
what each destination range receives; and the fallbacks (pieces straddling a destination
boundary, destinations not mapped)."""

import pytest

from wxfer import _wxfer

FABRIC = _wxfer.backends()["fabric"][0]
needs_fabric = pytest.mark.skipif(not FABRIC, reason="fabric transport not built")


@needs_fabric
@pytest.mark.timeout(60)
def test_map_validates_like_a_write_and_fabric_cannot_map():
    from wxfer.testing import connected_fabric

    with connected_fabric("tcp", [4096]) as (t, tgt):
        d = tgt.descriptors[0]
        # a valid range: validated, then refused by a backend without map(), naming the key
        with pytest.raises(_wxfer.Error) as e:
            t.map(d, 0, 4096)
        assert "only cuda_ipc maps" in str(e.value) and "key 0x" in str(e.value)
        # outside the region: the generic layer's range check, as for a write
        with pytest.raises(_wxfer.Error) as e:
            t.map(d, 4000, 200)
        assert "outside the 4096-byte region" in str(e.value)
        # a key the peer never exported (wx_desc.h: the key follows the header and address)
        bad = bytearray(d)
        at = 12 + int.from_bytes(bad[8:12], "little")
        bad[at : at + 8] = (int.from_bytes(bad[at : at + 8], "little") ^ 0x5A5A).to_bytes(8, "little")
        with pytest.raises(_wxfer.Error) as e:
            t.map(bytes(bad), 0, 8)
        assert "is not a region" in str(e.value) and "exported" in str(e.value)
        with pytest.raises(_wxfer.Error):
            t.map(bytes(d[:-1]), 0, 8)  # truncated descriptor
        # another transport's descriptor
        other = bytearray(d)
        other[4] = 3 if other[4] != 3 else 1
        with pytest.raises(ValueError) as e:
            t.map(bytes(other), 0, 8)
        assert "is for transport" in str(e.value)


torch = pytest.importorskip("torch")
from wxfer.mapping.reference import pack_task  # noqa: E402
from wxfer.mapping.rules import Piece  # noqa: E402
from wxfer.runtime import inplace as direct  # noqa: E402
from helpers import random_fulls, shard as _shard  # noqa: E402 -- tests/helpers.py
from wxfer.runtime.inplace import COPIES_TAG  # noqa: E402
from wxfer.zerocopy import COPY_BATCH  # noqa: E402
from wxfer import taskpath  # noqa: E402


def _fulls():
    return random_fulls(11, e=(4, 96, 130))  # 3-D experts


def _task():
    """Shards of a packed task: casts, an FP8 piece with its scales in another shard, an
    unaligned raw piece after the FP8 bytes, a 1-D piece, two experts of a 3-D source."""
    return [
        _shard("raw", "bfloat16", Piece("a", 0, 300, 0, 260)),
        _shard("fp8", "float8_e4m3fn", Piece("b", 0, 200, 0, 131)),
        _shard("raw", "bfloat16", Piece("b", 10, 20, 3, 250), Piece("n", 1, 4)),
        _shard("scale", "float32", Piece("b", 0, 200, 0, 131)),
        _shard("raw", "bfloat16", Piece("n", 5, 200)),
        _shard("fp8", "float8_e4m3fn", Piece("e", 96, 192, 0, 130), Piece("e", 288, 384, 0, 130)),
        _shard("scale", "float32", Piece("e", 96, 192, 0, 130), Piece("e", 288, 384, 0, 130)),
    ]


class _Links:
    """What the in-place writer reads of wxfer.runtime.links.Links: whose region is which, and
    whom to skip (`failed`: the engine's failed peers, as SimpleNamespace(peer=...))."""

    def __init__(self, gpu_of_region):
        self.gpu_of_region = gpu_of_region
        self.gpu_of_peer = {10 + g: g for g in set(gpu_of_region.values())}
        self.failed = []
        self.on_adopt = []  # what Links runs when a restart replaces a worker

    def skipped(self, engine):
        return frozenset(self.gpu_of_peer[e.peer] for e in self.failed if e.peer in self.gpu_of_peer)


def _FakeSender(gpu_of_region, transport_name="cuda_ipc"):
    """An InPlaceWriter alone (no Sender), with CPU tensors as the receivers' regions."""
    return direct.InPlaceWriter(
        True, direct.copy_max(None), torch.device("cpu"), None, None, transport_name, None, _Links(gpu_of_region)
    )


def _dests(shards, replicas):
    """One destination per shard per replica: replica k's shard i goes to region
    f"r{k}s{i % 2}" (two regions per replica) at a region offset of its own."""
    dests, off, sizes = [], 0, {}
    for i, sh in enumerate(shards):
        for k in range(replicas):
            r = f"r{k}s{i % 2}".encode()
            doff = sizes.get(r, 3)  # an odd start: offsets in the region are not the packed ones
            dests.append((r, doff, off, sh.nbytes))
            sizes[r] = doff + sh.nbytes + 5
        off += sh.nbytes
    return dests, sizes


def _run(shards, dests, sizes, skip=frozenset(), gpu_of=None):
    lay = direct.decompose(shards, dests)
    assert not isinstance(lay, str), lay
    regions = {r: torch.full((n,), 0xEE, dtype=torch.uint8) for r, n in sizes.items()}
    s = _FakeSender(gpu_of or {r: int(r[1:2]) for r in regions})
    plan = direct._Plan(lay[0], lay[1], regions)
    s._write(None, plan, _fulls(), frozenset(skip))
    return regions, s


@pytest.mark.parametrize("replicas", [1, 2])
def test_direct_writes_give_the_reference_bytes_at_every_destination(replicas):
    shards = _task()
    dests, sizes = _dests(shards, replicas)
    ref = pack_task(shards, _fulls())
    regions, s = _run(shards, dests, sizes)
    covered = {r: torch.zeros(n, dtype=torch.bool) for r, n in sizes.items()}
    for r, doff, soff, n in dests:
        assert torch.equal(regions[r][doff : doff + n], ref[soff : soff + n]), (r, doff, soff, n)
        covered[r][doff : doff + n] = True
    for r, c in covered.items():  # nothing outside the destination ranges was touched
        assert bool((regions[r][~c] == 0xEE).all()), r
    assert s.n["skipped_writes"] == 0


def test_a_skipped_receiver_is_not_written_and_the_others_are():
    shards = _task()
    dests, sizes = _dests(shards, 2)
    ref = pack_task(shards, _fulls())
    regions, s = _run(shards, dests, sizes, skip={1})
    for r, doff, soff, n in dests:
        if r.startswith(b"r1"):
            assert bool((regions[r] == 0xEE).all()), r
        else:
            assert torch.equal(regions[r][doff : doff + n], ref[soff : soff + n]), r
    assert s.n["skipped_writes"] > 0


def test_forget_drops_the_replaced_workers_views_and_bindings_only():
    """A restart adopted (Links.on_adopt): the old worker's mapped views and every binding that
    wrote there are dropped (bound again to the new memory), the other worker's are kept."""
    s = _FakeSender({b"r0s0": 0, b"r1s0": 1})
    assert s.forget in s.links.on_adopt
    views = {r: (torch.zeros(8, dtype=torch.uint8), 100 + i) for i, r in enumerate((b"r0s0", b"r1s0"))}
    s.views.update(views)
    s.plans.update(
        {
            "t0": ([], direct._Plan([], [], {b"r0s0": views[b"r0s0"][0]}), None),
            "t1": ([], direct._Plan([], [], {b"r1s0": views[b"r1s0"][0]}), None),
            "t2": ([], None, "staged"),
        }
    )
    s.copy_plans.update({"c0": (None, 0, 0, [(0, None)], None), "c1": (None, 0, 0, [(1, None)], None)})
    s.forget(1, [b"r1s0"])
    assert list(s.views) == [b"r0s0"] and sorted(s.plans) == ["t0", "t2"] and list(s.copy_plans) == ["c0"]


def test_a_destination_boundary_through_a_piece_sends_the_task_the_staging_way():
    shards = _task()
    total = sum(sh.nbytes for sh in shards)
    cut = shards[0].nbytes // 2 + 1  # inside the first (raw) piece
    why = direct.decompose(shards, [(b"A", 0, 0, cut), (b"A", cut, cut, total - cut)])
    assert isinstance(why, str) and "straddle" in why
    # inside an FP8 piece's e4m3 bytes
    q0 = shards[0].nbytes + 7
    why = direct.decompose(shards, [(b"A", 0, 0, q0), (b"B", 0, q0, total - q0)])
    assert isinstance(why, str) and "straddle" in why
    # a boundary between pieces of one shard is fine; an uncovered part is left out
    a = shards[0].nbytes + shards[1].nbytes
    b = shards[2].pieces[0].numel() * 2
    lay = direct.decompose(shards, [(b"A", 0, a, b)])
    assert not isinstance(lay, str)
    raw, fp8 = lay
    assert [(pc, t) for pc, _, t in raw] == [(shards[2].pieces[0], [(b"A", 0)])] and fp8 == []


def test_region_nbytes_reads_the_descriptor_and_the_switch():
    if not FABRIC:
        pytest.skip("fabric transport not built")
    t = _wxfer.Transport("fabric", {"provider": "tcp"})
    try:
        buf = torch.zeros(12345, dtype=torch.uint8)
        reg = t.register(buf, export=True)
        assert direct.region_nbytes(reg.descriptor) == 12345
        reg.close()
    finally:
        t.close()
    with pytest.raises(ValueError):
        direct.region_nbytes(b"WXE" + bytes(40))


def test_direct_switch(monkeypatch):
    monkeypatch.delenv("WXFER_DIRECT", raising=False)
    assert direct.enabled(None) is True and direct.enabled(False) is False
    monkeypatch.setenv("WXFER_DIRECT", "0")
    assert direct.enabled(None) is False and direct.enabled(True) is True
    with pytest.raises(TypeError):
        direct.enabled("yes")
    s = _FakeSender({}, transport_name="fabric")
    assert "only cuda_ipc" in s.stats()["why_not"]


# ------------------------------------------------------------ the Sender's hooks, emulated on CPU
# cuda_ipc needs a GPU; here the receivers live in this process (fabric tcp carries the version
# stamps and any staged task), and the two seams of the in-place writer that need CUDA are emulated:
# Transport.map (the address of the receiver's region, found by its descriptor) and the tensor
# over that address (the receiver's own region tensor).  Everything else is the real path.


def _emulate(monkeypatch, recvs):
    from wxfer.runtime.inplace import InPlaceWriter

    by_desc = {d: t for r in recvs for d, t in r.region_base.items()}
    # the stamps too (WXFER_BEGIN_WAIT=stream writes the begin stamps in place)
    by_desc.update((bytes(r.stamp_region.descriptor), r.stamps.view(torch.uint8)) for r in recvs)
    by_addr = {t.data_ptr(): t for t in by_desc.values()}

    def fake_map(self, rdesc, off, nb):
        t = by_desc[bytes(rdesc)]
        assert 0 <= off and off + nb <= t.numel(), (off, nb)
        return t.data_ptr() + off, self.device.index

    monkeypatch.setattr(InPlaceWriter, "off", lambda self: None if self.enabled else "off")
    monkeypatch.setattr(InPlaceWriter, "_map", fake_map)
    monkeypatch.setattr(InPlaceWriter, "_tensor", lambda self, addr, n: by_addr[addr])


def _receivers(addr, name, tp, quant, verify=False):
    from wxfer.models import TINY
    from helpers import receivers_in_threads

    return receivers_in_threads(TINY, addr, name, tp, quant, timeout=30, verify=verify)


def _joined(ths):
    from helpers import joined

    return joined(ths, 30)


def _direct_sender(monkeypatch, addr, name, model, tp=1, quant=None, verify=False, **kw):
    """(Sender, the receivers' params, the receivers): receivers in threads, the Sender of
    `model` for them (Sender keywords `kw`) with the direct seams emulated, joined."""
    from wxfer.models import preset_for
    from wxfer.runtime.sender import Sender

    params, ths = _receivers(addr, name, tp, quant, verify=verify)
    _emulate(monkeypatch, [])
    s = Sender(model, mapping=preset_for(_tiny()), store=addr, name=name, timeout=30, **kw)
    recvs = _joined(ths)
    _emulate(monkeypatch, recvs)
    return s, params, recvs


def _closed(s, recvs) -> None:
    s.close()
    for r in recvs:
        r.close()


def _model():
    from wxfer.models import TINY, train_model

    m = train_model(TINY)  # float32: every task casts or quantizes, so every task is packed
    for p in m.parameters():
        p.requires_grad_(False)
    return m


def _check(model, params, tp, quant, skip=()):
    from wxfer.models import TINY
    from helpers import expected_shards

    for rank, dst, off, b in expected_shards(model, TINY, tp, quant):
        if rank in skip:
            continue
        got = params[rank][dst].view(-1).view(torch.uint8)
        assert torch.equal(got[off : off + b.numel()], b), f"{dst} on rank {rank} differs at {off}"


@needs_fabric
@pytest.mark.timeout(120)
@pytest.mark.parametrize("quant", [None, "fp8"])
def test_sender_writes_every_packed_task_direct_and_the_engine_only_the_stamps(store, monkeypatch, quant):

    _, addr = store
    tp, name = 2, "dir" + str(quant)
    model = _model()
    s, params, recvs = _direct_sender(monkeypatch, addr, name, model, tp, quant, verify=True, watermark="1MiB")
    n = sum(1 for g in s.program.groups for op in g if op.sends)
    for step in (1, 2):
        if step == 2:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(-1.5)
        moved, ext = s.engine.stats()["bytes_written"], s.engine.stats()["bytes_external"]
        s.engine.trace(clear=True)
        s.push()
        assert [r.version() for r in recvs] == [step, step]
        _check(model, params, tp, quant)
        assert s.engine.stats()["bytes_written"] - moved == 2 * 8 * tp  # the begin + end stamps only
        assert s.engine.stats()["bytes_external"] - ext == s.bytes_per_step  # the in-place writes
        d = s.stats()["direct"]
        assert d["tasks"] == n and d["staged"] == 0 and d["total"] == n * step, d
        _check_trace(s, {op.task for g in s.program.groups for op in g if op.sends})
    # off: the same bytes through send buffers and the engine
    s.direct = False
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    moved = s.engine.stats()["bytes_written"]
    s.push()
    _check(model, params, tp, quant)
    assert s.engine.stats()["bytes_written"] - moved == s.bytes_per_step + 2 * 8 * tp
    d = s.stats()["direct"]
    assert d["tasks"] == 0 and d["staged"] == n and d["why_not"] == "off", d
    # verify mode goes the staging way: a checksum of the receiver's own memory proves nothing
    s.direct = True
    s.push(verify=True)
    assert s.stats()["direct"]["staged_why"] == {"verify is on": n}
    assert s.last_verify is not None
    _closed(s, recvs)


def _check_trace(s, tags) -> None:
    """The push's trace: one external task per in-place write, each with tag in `tags`, landed,
    finished after the begin stamps and before the end stamps were posted (the engine's fences)."""
    from wxfer.runtime.tasks import STAMP_TAG

    recs = sorted(s.engine.trace(), key=lambda r: r["id"])
    stamps = [r for r in recs if r["tag"] == STAMP_TAG]
    ext = [r for r in recs if r["kind"] == "external"]
    assert len(stamps) == 2 and ext, [(r["kind"], r["tag"]) for r in recs]
    begin, end = stamps
    assert {r["tag"] for r in ext} <= tags and all(r["status"] == 0 for r in ext), ext
    assert all(begin["id"] < r["id"] < end["id"] for r in ext)
    assert all(begin["t_done"] <= r["t_done"] <= end["t_post_first"] for r in ext)


def _tiny():
    from wxfer.models import TINY

    return TINY


@needs_fabric
@pytest.mark.timeout(120)
@pytest.mark.skipif(not _wxfer.TESTING, reason="needs a test build (WXFER_TESTING=1) for _test_refuse_peer")
@pytest.mark.parametrize("wait", ["host", "stream"])
def test_a_receiver_that_failed_before_the_data_is_not_written_direct(store, monkeypatch, wait):
    """Receiver 1's every engine write is refused (TEST-ONLY), so its begin stamp fails at the
    write deadline.  The host wait (WXFER_BEGIN_WAIT=host) sees that before the first in-place
    launch: receiver 1 keeps its bytes from before.  The stream order (the default) launches
    without waiting: receiver 1 gets its begin stamp from the side stream ahead of the writes,
    so it reads torn (version -1), never the old step over new bytes.  Either way the push
    fails within its bound naming the worker, and receiver 0 holds the step."""
    import time

    from wxfer.models import preset_for
    from wxfer.runtime.sender import Sender

    monkeypatch.setenv("WXFER_BEGIN_WAIT", wait)
    _, addr = store
    tp, quant, name = 2, "fp8", "dirfail" + wait
    params, ths = _receivers(addr, name, tp, quant)
    before = [{k: v.clone() for k, v in p.items()} for p in params]
    _emulate(monkeypatch, [])
    model = _model()
    s = Sender(
        model,
        mapping=preset_for(_tiny()),
        store=addr,
        name=name,
        timeout=30,
        write_timeout=1.5,
        transport_options={"provider": "tcp", "_test_refuse_peer": 1},
    )
    recvs = _joined(ths)
    _emulate(monkeypatch, recvs)
    assert s.peers == {0: 0, 1: 1}
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="failed") as e:
        s.push()  # rank 1's begin stamp is never accepted: it fails
    assert time.monotonic() - t0 < 15  # its deadline (1.5 s), not close()
    assert "gpu 1" in str(e.value), e.value
    d = s.stats()["direct"]
    assert d["tasks"] > 0 and d["staged"] == 0, d
    _check(model, params, tp, quant, skip={1})
    assert recvs[0].version() == 1
    unchanged = all(torch.equal(before[1][k].view(torch.uint8), params[1][k].view(torch.uint8)) for k in params[1])
    if wait == "host":
        assert d["skipped_writes"] > 0 and unchanged and d["begin"].startswith("host: "), d
    else:
        r1 = recvs[1]
        begin, end = int(r1.stamps[r1.stamp_slots]), int(r1.stamps[0])
        assert not unchanged and (begin, end) == (1, -1)  # written, after its begin stamp: torn
        assert r1.version() == -1
        assert s.runner.begin_on_stream and s.runner.why_host_wait is None and d["begin"] == "stream"
    _closed(s, recvs)


@needs_fabric
@pytest.mark.timeout(120)
def test_small_zero_copy_tasks_are_copied_in_batches_and_large_ones_by_the_engine(store, monkeypatch):
    """Zero-copy tasks of fewer bytes than WXFER_DIRECT_COPY_MAX go out as batched copies
    straight into the receivers' memory (torch._foreach_copy_), the others as engine writes;
    both give the mapping's reference bytes, step after step; 0 turns the copies off."""
    _, addr = store
    tp, name = 1, "dircopy"
    model = _model().to(torch.bfloat16)  # BF16 into BF16 at TP1: every task is zero copy
    cut = 4096
    monkeypatch.setenv("WXFER_DIRECT_COPY_MAX", str(cut))
    s, params, recvs = _direct_sender(monkeypatch, addr, name, model, tp)
    ops = [op for g in s.program.groups for op in g if op.sends]
    small = [op for op in ops if op.nbytes < cut]
    assert small and len(small) < len(ops)  # both paths are taken
    calls = []
    real = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda d, src: (calls.append(len(d)), real(d, src)))
    for step in (1, 2):
        if step == 2:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(-1.5)
        moved = s.engine.stats()["bytes_written"]
        s.push()
        assert recvs[0].version() == step
        _check(model, params, tp, None)
        engine_bytes = sum(op.nbytes for op in ops if op.nbytes >= cut)
        assert s.engine.stats()["bytes_written"] - moved == engine_bytes + 2 * 8  # + the stamps
        d = s.stats()["direct"]
        assert d["copies"] == len(small) and d["staged"] == 0, d
        _check_trace(s, {COPIES_TAG})
        s.engine.trace(clear=True)
    assert calls and sum(calls) == 2 * len(small) and max(calls) <= COPY_BATCH
    # off: every task an engine write again (a fresh Sender reads the variable)
    _closed(s, recvs)
    monkeypatch.setenv("WXFER_DIRECT_COPY_MAX", "0")
    s, params, recvs = _direct_sender(monkeypatch, addr, name + "0", model, tp)
    moved = s.engine.stats()["bytes_written"]
    s.push()
    _check(model, params, tp, None)
    assert s.engine.stats()["bytes_written"] - moved == s.bytes_per_step + 2 * 8
    assert s.stats()["direct"]["copies"] == 0
    _closed(s, recvs)


@needs_fabric
@pytest.mark.timeout(120)
def test_the_senders_copy_max_overrides_the_variable_and_all_copies_every_zero_copy_task(store, monkeypatch):
    """Sender(copy_max=...) over $WXFER_DIRECT_COPY_MAX: a cut copies the tasks below it with
    the variable at 0; "all" copies every zero-copy task (those above the variable's cut too),
    the engine writing only the stamps; stats() and task_kinds() say the bound and the kinds
    as the plan's task_kinds does with it (-1: no bound); the bytes are the reference's."""
    from wxfer.plan.kinds import task_kinds

    _, addr = store
    model = _model().to(torch.bfloat16)  # every task zero copy
    cut = 4096
    for name, env, arg in (("cmaxcut", "0", cut), ("cmaxall", str(cut), "all")):
        monkeypatch.setenv("WXFER_DIRECT_COPY_MAX", env)
        s, params, recvs = _direct_sender(monkeypatch, addr, name, model, copy_max=arg)
        ops = [op for g in s.program.groups for op in g if op.sends]
        small = [op for op in ops if op.nbytes < cut]
        assert small and len(small) < len(ops)
        copied = small if arg == cut else ops
        bound = cut if arg == cut else -1
        k = s.task_kinds()
        assert {t for t, v in k.items() if v == "copy"} == {op.task for op in copied}
        assert task_kinds(s.plan, s.plan.train_params, direct=True, copy_max=bound) == k
        moved = s.engine.stats()["bytes_written"]
        s.push()
        _check(model, params, 1, None)
        d = s.stats()["direct"]
        assert d["copies"] == len(copied) and d["copy_max"] == bound, d
        engine_bytes = sum(op.nbytes for op in ops if op not in copied)
        assert s.engine.stats()["bytes_written"] - moved == engine_bytes + 2 * 8  # + the stamps
        _closed(s, recvs)


def test_a_bad_copy_max_raises_naming_it_before_anything_is_set_up(monkeypatch):
    from wxfer.runtime import control
    from wxfer.runtime.sender import Sender

    def no_store(*a, **k):
        raise AssertionError("the store was reached")

    monkeypatch.setattr(control, "resolve_store", no_store)
    for bad in ("lots", -5, 2.5):
        with pytest.raises((ValueError, TypeError), match="wxfer.Sender: copy_max must be"):
            Sender(_model(), mapping="tiny", store="127.0.0.1:1", name="bad", copy_max=bad)


@needs_fabric
@pytest.mark.timeout(120)
@pytest.mark.parametrize("wait", ["host", "stream"])
def test_the_first_copy_launch_comes_after_the_begin_stamps_landed(store, monkeypatch, wait):
    """The batched copies write the receivers' memory outside the engine: each push's first
    launch comes after the begin stamps.  host: it waits for them (Engine.wait(fence=...), that
    fence task alone), so at every launch this push's begin stamps have finished.  stream (the
    default): the launch does not wait; the begin stamps were written ahead of it on its stream
    (here the CPU: at once), so at every launch each receiver's begin stamp reads this push.
    The bytes are the reference's."""
    import time

    from wxfer.runtime import copies
    from wxfer.runtime.tasks import STAMP_TAG

    monkeypatch.setenv("WXFER_BEGIN_WAIT", wait)
    _, addr = store
    name = "dirbegin" + wait
    model = _model().to(torch.bfloat16)
    monkeypatch.setenv("WXFER_DIRECT_COPY_MAX", "all")
    s, params, recvs = _direct_sender(monkeypatch, addr, name, model)
    real, seen = copies.copy_ranges, []
    pushed = [0, 0]  # the push's start, its version

    def spy(device, items, **kw):
        if wait == "host":
            begun = [r for r in s.engine.trace() if r["tag"] == STAMP_TAG and r["t_submit"] >= pushed[0]]
            seen.append(bool(begun) and all(r["status"] == 0 for r in begun))
        else:  # the begin stamps in the receivers' own memory (slot stamp_slots + rank 0)
            seen.append(all(int(r.stamps[r.stamp_slots]) == pushed[1] for r in recvs))
        return real(device, items, **kw)

    monkeypatch.setattr(copies, "copy_ranges", spy)
    for step in (1, 2):
        pushed[:] = [time.monotonic_ns(), step]
        s.push()
        assert recvs[0].version() == step
        _check(model, params, 1, None)
    assert seen and all(seen), seen
    assert s.stats()["direct"]["copies"] == len([op for g in s.program.groups for op in g if op.sends])
    _closed(s, recvs)


@needs_fabric
@pytest.mark.timeout(120)
def test_task_kinds_says_copy_as_the_push_decides_it(store, monkeypatch):
    """Sender.task_kinds() reports "copy" for exactly the zero-copy tasks a push copies into the
    receivers' memory (fewer bytes than copy_max(), direct possible, every destination mapped),
    on the Sender's own cached binding (the push reuses it); the plan's decision agrees; a task
    whose destination the transport refuses, verify on, direct off: the engine's zero copy."""
    from wxfer.plan.kinds import task_kinds
    from wxfer.runtime.inplace import InPlaceWriter, _NotInPlace

    _, addr = store
    name, cut = "dirkinds", 4096
    model = _model().to(torch.bfloat16)
    monkeypatch.setenv("WXFER_DIRECT_COPY_MAX", str(cut))
    s, params, recvs = _direct_sender(monkeypatch, addr, name, model)
    ops = {op.task: op for g in s.program.groups for op in g if op.sends}
    k = s.task_kinds()
    small = {t for t, op in ops.items() if op.nbytes < cut}
    assert small and {t for t, v in k.items() if v == "copy"} == small
    assert all(k[t] == "zero_copy" for t in ops if t not in small)
    assert task_kinds(s.plan, s.plan.train_params, direct=True, copy_max=cut) == k  # the plan's decision
    bound = {t: s.inplace.copy_plans[t] for t in small}
    s.push()
    _check(model, params, 1, None)
    assert s.stats()["direct"]["copies"] == len(small)
    assert all(s.inplace.copy_plans[t] is bound[t] for t in small)  # the push used the same binding
    # a destination the transport refuses: not copied, and task_kinds says so
    victim = min(small)
    refused = {bytes(d[0]) for d in ops[victim].dests}
    fake = InPlaceWriter._map

    def refuse(self, rdesc, off, nb):
        if bytes(rdesc) in refused:  # (its view is made already: the range check refuses)
            raise _NotInPlace("refused here")
        return fake(self, rdesc, off, nb)

    monkeypatch.setattr(InPlaceWriter, "_map", refuse)
    s.inplace.copy_plans.pop(victim)
    assert s.task_kinds()[victim] == "zero_copy"
    moved = s.engine.stats()["bytes_written"]
    s.push()
    _check(model, params, 1, None)
    assert s.stats()["direct"]["copies"] == len(small) - 1
    assert s.engine.stats()["bytes_written"] - moved >= ops[victim].nbytes + 2 * 8
    s.inplace.verify = True  # (as a push with verify on sets it): every task the engine's way
    assert "copy" not in s.task_kinds().values()
    s.inplace.verify, s.direct = False, False
    assert "copy" not in s.task_kinds().values()
    _closed(s, recvs)


class _Tasks:
    """What the in-place writer hands the engine, recorded: its external tasks (destinations,
    tag) and their host signals (no stream: the copies ran on the host)."""

    def __init__(self):
        self.tasks, self.signalled, self.prepared = [], [], []

    def prepare_external(self, dests, tag=0):  # (the batched copies' destinations, made once)
        self.prepared.append((list(dests), tag))
        return self.prepared[-1]

    def submit_external(self, dests, tag=0):
        if isinstance(dests, tuple):  # a prepare_external's: its own tag
            (dests, tag2), tag = dests, tag or dests[1]
            assert tag == tag2
        self.tasks.append((list(dests), tag))
        return len(self.tasks)

    def complete_external(self, task):
        self.signalled.append(task)
        return True


class _CopySender(direct.InPlaceWriter):
    """An InPlaceWriter alone with what queue_copy needs: the receivers' regions as CPU
    tensors, links whose engine-failed peers the test sets, nothing waited for, its engine
    tasks recorded (_Tasks)."""

    def __init__(self, regions, gpu_of_region, wait=lambda: None):
        cpu, links = torch.device("cpu"), _Links(gpu_of_region)
        super().__init__(True, direct.copy_max(None), cpu, None, None, "cuda_ipc", _Tasks(), links)
        self.regions = regions
        self.start(1, False, wait)

    def off(self):
        return None

    def _map(self, rdesc, off, nb):
        return self.regions[bytes(rdesc)].data_ptr() + off, None

    def _tensor(self, addr, n):
        return next(t for t in self.regions.values() if t.data_ptr() == addr)

    def _view(self, rdesc):
        t = self.regions[bytes(rdesc)]
        return t, t.data_ptr()


_COPY = taskpath.best(taskpath.Facts(True, taskpath.ROWS))  # a zero-copy task's best path: copy


def test_small_copies_skip_a_receiver_that_failed_while_its_begin_stamp_was_written():
    """The launch waits for the begin stamps first and only then decides whom to skip: a receiver
    whose begin stamp failed during that wait (the engine fenced it) gets none of the copies."""
    from types import SimpleNamespace

    regions = {b"g0": torch.zeros(64, dtype=torch.uint8), b"g1": torch.zeros(64, dtype=torch.uint8)}
    waits = []

    def wait():
        waits.append(1)
        s.links.failed = [SimpleNamespace(peer=11)]  # receiver gpu 1's begin stamp failed meanwhile

    s = _CopySender(regions, {b"g0": 0, b"g1": 1}, wait)
    src = torch.full((16,), 5, dtype=torch.uint8)
    prep = SimpleNamespace(
        zero_copy=True, direct=None, whole=[("w", src)], dests=[(b"g0", 0, 0, 16), (b"g1", 0, 0, 16)], best=_COPY
    )
    assert s.queue_copy(SimpleNamespace(prep=prep, sends=True, nbytes=16, task=0))
    assert waits == []  # queued: nothing waited for yet
    s.flush_copies()
    assert len(waits) == 1
    assert torch.equal(regions[b"g0"][:16], src) and int(regions[b"g1"].count_nonzero()) == 0
    assert s.n["skipped_writes"] == 1
    # one external task to the receiver written alone, signalled done (host copies)
    assert s.engine.tasks == [([(b"g0", 0, 0, 16)], direct.COPIES_TAG)] and s.engine.signalled == [1]


def test_small_copies_skip_a_receiver_that_failed_after_they_were_queued():
    """A copy queued before its receiver failed is not written at the batch's launch (the
    engine fenced that peer; nothing of this push may land there after), the others are."""
    from types import SimpleNamespace

    regions = {b"g0": torch.zeros(64, dtype=torch.uint8), b"g1": torch.zeros(64, dtype=torch.uint8)}
    s = _CopySender(regions, {b"g0": 0, b"g1": 1})

    def op(task, val):
        src = torch.full((16,), val, dtype=torch.uint8)
        dests = [(b"g0", 16 * task, 0, 16), (b"g1", 16 * task, 0, 16)]
        prep = SimpleNamespace(zero_copy=True, direct=None, whole=[("w", src)], dests=dests, best=_COPY)
        return SimpleNamespace(prep=prep, sends=True, nbytes=16, task=task)

    assert s.queue_copy(op(0, 7))  # queued to both receivers
    s.links.failed = [SimpleNamespace(peer=11)]  # receiver gpu 1 fails (its peer 11)
    assert s.queue_copy(op(1, 9))
    s.flush_copies()
    assert torch.equal(regions[b"g0"][:32], torch.tensor([7] * 16 + [9] * 16, dtype=torch.uint8))
    assert int(regions[b"g1"].count_nonzero()) == 0  # neither copy landed on the failed one
    assert s.n["copies"] == 2 and s.n["skipped_writes"] == 2
    assert s.engine.tasks == [([(b"g0", 0, 0, 16), (b"g0", 16, 0, 16)], direct.COPIES_TAG)]


def test_queue_copys_fast_path_reuses_a_binding_only_for_the_same_prep_memory_and_push_state():
    """queue_copy's per-task fast path (issue 37: the checks made once per push and per binding):
    the cached binding is reused while the task's prep and memory are the same; memory that moved
    or a new prep is bound again (the new bytes land); verify on or direct switched off in a push
    copy nothing; the bytes queued are those of every destination; the counters are the push's."""
    from types import SimpleNamespace

    regions = {b"g0": torch.zeros(64, dtype=torch.uint8), b"g1": torch.zeros(64, dtype=torch.uint8)}
    s = _CopySender(regions, {b"g0": 0, b"g1": 1})
    s.off = lambda: None if s.enabled else "off"  # switch() is seen, as the product's off() sees it
    dests = [(b"g0", 8, 0, 16), (b"g1", 24, 0, 16)]
    prep = SimpleNamespace(
        zero_copy=True, direct=None, whole=[("w", torch.full((16,), 7, dtype=torch.uint8))], dests=dests, best=_COPY
    )
    op = SimpleNamespace(prep=prep, sends=True, nbytes=16, task=0)

    def push(version, verify=False):
        s.start(version, verify, lambda: None)
        got = s.queue_copy(op)
        queued = s.copy_q_bytes
        s.flush_copies()
        return got, queued

    assert push(1) == (True, 32)  # 16 bytes to each of the two receivers
    host = s.stats()["last_push"]  # the push's launches and their host seconds
    assert host["launches"] == 1 and host["launch_s"] >= host["begin_wait_s"] >= 0 and host["bound"] == 1
    bound = s.copy_plans[0]
    assert torch.equal(regions[b"g0"][8:24], prep.whole[0][1]) and torch.equal(regions[b"g1"][24:40], prep.whole[0][1])
    prep.whole[0][1].fill_(3)  # same memory, new bytes: the same binding copies them
    assert push(2) == (True, 32) and s.copy_plans[0] is bound and s.n["copies"] == 1
    assert s.stats()["last_push"]["bound"] == 0  # nothing bound again
    assert int(regions[b"g1"][24:40].sum()) == 3 * 16
    prep.whole = [("w", torch.full((16,), 9, dtype=torch.uint8))]  # the memory moved: bound again
    assert push(3) == (True, 32) and s.copy_plans[0] is not bound
    assert int(regions[b"g0"][8:24].sum()) == 9 * 16
    bound = s.copy_plans[0]
    op.prep = prep = SimpleNamespace(**vars(prep))  # prepared again (same memory): bound again
    prep.whole[0][1].fill_(5)
    assert push(4) == (True, 32) and s.copy_plans[0] is not bound and s.copy_plans[0][0] is prep
    assert int(regions[b"g1"][24:40].sum()) == 5 * 16
    prep.whole[0][1].fill_(6)
    assert push(5, verify=True) == (False, 0)  # verify on: the engine's way, nothing copied
    s.start(6, False, lambda: None)
    s.switch(False)  # direct off within a push: from the next task on
    assert s.queue_copy(op) is False and s.copy_q == []
    s.switch(True)
    assert s.queue_copy(op) is True and s.n["copies"] == 1
    s.flush_copies()
    assert int(regions[b"g0"][8:24].sum()) == 6 * 16
    assert len(s.engine.tasks) == 5 and all(t[1] == direct.COPIES_TAG for t in s.engine.tasks)


def test_a_launchs_range_table_is_kept_only_for_the_same_bound_items(monkeypatch):
    """The batched copy kernel's range table of a push's i-th launch is the last push's when its
    items are the same bindings' (no table made per launch per push), and made again -- the new
    addresses -- when a task was bound again or the batch differs; always copies.table(items)."""
    from types import SimpleNamespace

    from wxfer.runtime import copies

    seen = []
    real = copies.copy_ranges

    def record(device, items, copier=None, ranges=None):
        assert ranges is not None and list(ranges) == list(copies.table(items))
        seen.append(ranges)
        return real(device, items, copier)

    monkeypatch.setattr(copies, "copy_ranges", record)
    regions = {b"g0": torch.zeros(256, dtype=torch.uint8)}
    s = _CopySender(regions, {b"g0": 0})
    srcs = [torch.full((16,), i + 1, dtype=torch.uint8) for i in range(3)]
    ops = [
        SimpleNamespace(
            prep=SimpleNamespace(whole=[("w", srcs[i])], dests=[(b"g0", 16 * i, 0, 16)], best=_COPY),
            sends=True,
            nbytes=16,
            task=i,
        )
        for i in range(3)
    ]

    def push(version, which):
        s.start(version, False, lambda: None)
        for i in which:
            assert s.queue_copy(ops[i])
        s.flush_copies()

    push(1, [0, 1, 2])
    push(2, [0, 1, 2])
    assert seen[1] is seen[0]  # the same bindings: the same table
    ops[1].prep.whole = [("w", torch.full((16,), 7, dtype=torch.uint8))]  # task 1's memory moved
    push(3, [0, 1, 2])
    assert seen[2] is not seen[1] and int(regions[b"g0"][16:32].sum()) == 7 * 16
    push(4, [0, 2])  # another batch at that launch
    assert seen[3] is not seen[2] and len(seen[3]) == 2 * 4
    s.forget(0, [b"g0"])
    push(5, [0, 2])
    assert seen[4] is not seen[3]  # bound again after the restart: made again


def test_a_push_ramps_its_copy_launches_from_the_first_launchs_bytes(monkeypatch):
    """WXFER_DIRECT_COPY_FIRST (issue 37: the GPU starts on a push's copies after a few tasks):
    the push's first batched copy launch closes at that many bytes, each next at twice the last;
    queue_copy (the first push binds) and queue_run (the next push's cached bindings) cut the
    same launches, every byte lands, and without it one launch takes them all."""
    from types import SimpleNamespace

    monkeypatch.setenv("WXFER_DIRECT_COPY_FIRST", "16")
    regions = {b"g0": torch.zeros(7 * 16, dtype=torch.uint8)}
    s = _CopySender(regions, {b"g0": 0})
    ops = []
    for i in range(7):
        src = torch.full((16,), i + 1, dtype=torch.uint8)
        dests = [(b"g0", 16 * i, 0, 16)]
        prep = SimpleNamespace(zero_copy=True, direct=None, whole=[("w", src)], dests=dests, best=_COPY)
        ops.append(SimpleNamespace(prep=prep, sends=True, nbytes=16, task=i))

    def push(version, run):
        s.engine.tasks.clear()
        regions[b"g0"].zero_()
        s.start(version, False, lambda: None)
        if run:
            assert s.queue_run(ops, 0) == len(ops)
        else:
            assert all(s.queue_copy(op) for op in ops)
        s.flush_copies()
        want = torch.arange(1, 8, dtype=torch.uint8).repeat_interleave(16)
        assert torch.equal(regions[b"g0"], want)
        return [len(t[0]) for t in s.engine.tasks], s.stats()["last_push"]["launches"]

    assert push(1, run=False) == ([1, 2, 4], 3)  # 16, 32 and 64 bytes
    assert push(2, run=True) == ([1, 2, 4], 3)
    monkeypatch.delenv("WXFER_DIRECT_COPY_FIRST")
    assert push(3, run=True) == ([7], 1)
