"""The trainer-side scatter of a delta push on cuda_ipc (issue 36, item 2; docs/delta.md).

Where every destination range of a task is memory the transport maps here (``Transport.map``,
as the in-place writes use it: cuda_ipc opens the receiver's allocation in the writer's context
with ``cuIpcOpenMemHandle``), the delta writer may send the task's changed bytes by a kernel of
this rank (``delta_gpu.scatter``: for each set bit of the bitmask the compare made,
``dst[doff + i] = shadow[so + i]``) instead of records: the receiver runs nothing, and holds a
dense push's bytes once the push landed.

Ordering, exactly as the in-place writes (wxfer.runtime.inplace): the push's begin stamps are
waited for before its first scatter launch (the engine's fence orders its own writes, not this
process's kernels); a receiver that failed or was dropped is not written (nor named in the
task); each launch is handed to the engine as an external task (``Engine.submit_external``,
a CUDA event recorded after it) so that the end stamps wait for it and torn detection is
unchanged.  The shadow rule: a scattered receiver is in step like one that applied records;
its ``last_rec`` is kept (its staging header, where it has one, still names the last records
sent to it, which its apply() checks: the scatter writes the changed bytes over them).

``Sender(delta={"scatter": ...})``: ``"auto"`` (default) a task the delta writer runs is
scattered when that is the cheapest of dense, records and scatter (``changed /
scatter_Bps``: byte stores scattered move a 32-byte sector each, timed at setup,
``calibrate``); ``"force"``: every task whose destinations are all mapped here is scattered
(after the dense pushes the rules demand), the colocated ones too, which otherwise bypass the
delta writer (a one-GPU test or benchmark of this path); ``"off"``: never."""

from __future__ import annotations

import time

MODES = ("auto", "force", "off")


def mode_option(value) -> str:
    """The ``scatter`` entry of ``Sender(delta={...})``, checked (None: "auto")."""
    if value is None:
        return "auto"
    if not isinstance(value, str) or value not in MODES:
        raise ValueError(f"wxfer.Sender: delta['scatter'] must be 'auto', 'force' or 'off', got {value!r}")
    return value


def calibrate(shadow, bits, changed: int, reps: int = 3) -> float:
    """Changed bytes stored per second by the scatter kernel: `shadow`'s changed bytes (`changed`
    of them, marked in `bits` by a compare) into a buffer of this device, the best of `reps`
    (the sample of calibrate_costs: 64 MiB at 1% changed, so that nearly every store is a
    sector of its own, the rate is per changed byte and high rates are overcharged)."""
    import torch

    from . import delta_gpu

    dst = torch.empty_like(shadow)
    best = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize(shadow.device)
        t0 = time.perf_counter()
        delta_gpu.scatter(shadow, bits, [(dst.data_ptr(), 0, shadow.numel())])
        torch.cuda.synchronize(shadow.device)
        best = min(best, time.perf_counter() - t0)
    return max(int(changed), 1) / max(best, 1e-9)


class Scatter:
    """The delta writer's scatter (a collaborator of delta_send.DeltaWriter, `w`): which tasks
    can be scattered, the cost, the launch and its hand-off to the engine."""

    def __init__(self, mode: str, w):
        self.mode, self.w = mode_option(mode), w
        self._targets: dict = {}  # task -> (its dests list, [destination address] or None, why not)
        self.total = dict(tasks=0, bytes=0, skipped=0)

    def why_not(self) -> str | None:
        """Why no task of this Sender is scattered, or None."""
        w = self.w
        if self.mode == "off":
            return "off (Sender(delta={'scatter': 'off'}))"
        if not w.gpu:
            return "the delta kernels do not run here" + (f" ({w.encoder_why})" if w.encoder_why else "")
        if getattr(w.runner, "inplace", None) is None:
            return "no in-place writer (its begin-stamp wait and external tasks)"
        return None

    def targets(self, op):
        """The address here of each destination range of task `op` (in the order of its
        prepared destinations, ``op.prep.dests``, which the delta writer runs), or None when one
        is not mapped on this rank's GPU (decided once per list of destinations)."""
        dests = op.prep.dests if getattr(op, "prep", None) is not None else op.dests
        hit = self._targets.get(op.task)
        if hit is not None and hit[0] is dests:
            return hit[1]
        addrs, why = None, self.why_not()
        if why is None:
            try:
                addrs = [self.address(bytes(d[0]), int(d[1]), int(d[3])) for d in dests] or None
            except Exception as e:  # noqa: BLE001 -- not mapped here: records or dense, as before
                addrs, why = None, f"{type(e).__name__}: {e}"
        self._targets[op.task] = (dests, addrs, why)
        return addrs

    def address(self, rdesc: bytes, off: int, n: int) -> int:
        """[off, off+n) of a receiver's region, mapped here by the transport (it checks the
        range as it checks a write); memory on another GPU than this rank's is refused."""
        addr, dev = self.w.runner.transport.map(rdesc, off, n)
        if dev != self.w.device.index:
            raise ValueError(f"the range is mapped on cuda:{dev}, the delta writer runs on {self.w.device}")
        return int(addr)

    def forced(self, op) -> bool:
        """Mode "force", and task `op` can be scattered: it neither bypasses the delta writer nor is
        sent dense for a fast link (only the rules' dense pushes remain)."""
        return self.mode == "force" and self.targets(op) is not None

    def cost(self, changed: int) -> float:
        """Seconds to scatter `changed` bytes (every destination's), at the measured rate."""
        rate = self.w.costs.get("scatter_Bps")
        return float("inf") if not rate else changed / rate

    def chosen(self, op, changed: int, t_dense: float, t_rec: float) -> bool:
        """Scatter task `op` (its destinations' `changed` bytes), rather than dense
        (`t_dense` seconds) or records (`t_rec`)?"""
        if self.targets(op) is None:
            return False
        return self.mode == "force" or (self.mode == "auto" and self.cost(changed) < min(t_dense, t_rec))

    def write(self, op, dests, gpus, sh, counted, per_range) -> None:
        """The scatter of task `op`: after the push's begin stamps, one launch over every
        destination of a receiver not failed nor dropped (the changed bytes of its range:
        `per_range` {source offset: (range index, changed)}, `sh` the task's shadow, `counted`
        delta_gpu.count's state), handed to the engine as one external task to those receivers."""
        from . import delta_gpu

        shadow_of = {int(soff): (int(so), int(n)) for soff, n, so in sh[0]}
        addrs = self.targets(op)
        if len(addrs) != len(dests):  # (the same list: targets follows op.prep.dests)
            raise RuntimeError(f"delta scatter: task {op.task}: {len(dests)} destinations, {len(addrs)} mapped")
        for i, d in enumerate(dests):  # each store inside the range mapped for it, before anything runs
            so, n = shadow_of.get(int(d[2]), (None, None))
            if n != int(d[3]):
                raise ValueError(
                    f"delta scatter: task {op.task}: destination {i} (offset {int(d[1])}, {int(d[3])} bytes, "
                    f"source offset {int(d[2])}) has a shadow range of {n} bytes there: its length differs "
                    "from the destination's mapped length; nothing scattered"
                )
        ip = self.w.runner.inplace
        skip = ip.external_begin()
        todo, live, stored, skipped = [], [], 0, 0
        for d, addr, g in zip(dests, addrs, gpus):
            if g in skip:
                skipped += 1
                continue
            live.append(d)
            c = per_range[int(d[2])][1]
            if c:
                so, n = shadow_of[int(d[2])]
                todo.append((addr, so, n))
                stored += c
        if todo:
            delta_gpu.scatter(sh[1], counted["bits"], todo)
        ip.external_done(live, op.task)
        st = self.w.step
        st["tasks_scatter"] += 1
        st["scatter_bytes"] += stored
        st["scatter_skipped"] += skipped
        self.total["tasks"] += 1
        self.total["bytes"] += stored
        self.total["skipped"] += skipped

    def forget(self) -> None:
        """A worker was replaced by its restart: every task's addresses mapped again at its next
        use (the new worker's memory; the transport maps it afresh)."""
        self._targets.clear()

    def stats(self) -> dict:
        d = dict(mode=self.mode, total=dict(self.total))
        why = self.why_not()
        if why is not None:
            d["why_not"] = why
        return d
