"""The trainer side of delta pushes (``Sender(delta=True)``, issue 36; the format: delta.py).

``DeltaWriter`` runs every sending task of a push in place of the TaskRunner: it makes the
task's bytes as a dense push would (prepare.run: fusion, FP8, packing; a zero-copy task's own
bytes), compares each distinct source range with the shadow of what this rank last wrote,
chooses per task dense or records by cost, updates the shadow, and at the end of the task loop
writes each receiver's records (one write per receiver, into this rank's staging slot there).

The per-task choice, from measured costs: records when
``rec_bytes / link + rec_bytes / apply + rec_bytes / encode < task_bytes / link``, link being
the throughput of this rank's last all-dense push (its tasks' bytes over the union of their
write spans in the engine trace; before any: 1 GB/s) and
apply / encode the receiver's apply and this rank's encode throughput per record byte, timed
once at setup on this device (``calibrate_costs``).  A task is dense when any of its
receivers is not in step with the shadow (the first push, after any failure, a restarted or
resyncing worker), when its records do not fit the slot's room left, or the receiver has no
staging area."""

from __future__ import annotations

import base64
import logging
import time

from . import delta, delta_cpu, prepare, program

log = logging.getLogger(__name__)


def calibrate_costs(device, n: int = 1 << 22, rate: float = 0.01) -> dict:
    """Encode and apply throughput (record bytes per second) of a range of `n` bytes with
    `rate` of them changed, on `device` (timed once: a few ms)."""
    import torch

    if delta_cpu.available(device):  # what the CPU pushes run: the native compare and encode
        return delta_cpu.calibrate(n, rate)
    g = torch.Generator().manual_seed(0)
    old = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).to(device)
    new = old.clone()
    k = max(1, int(n * rate))
    idx = torch.randperm(n, generator=g)[:k].to(device)
    new[idx] ^= 1
    dst = old.clone()
    best_e = best_a = float("inf")
    rec = None
    t0 = time.perf_counter()
    d, c = delta.changed(new, old)  # paid by every task, records or dense: not a records' cost
    compare_s = time.perf_counter() - t0
    for _ in range(3):
        t0 = time.perf_counter()
        rec = delta.encode(new, d, c, 0, 0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best_e = min(best_e, time.perf_counter() - t0)
        t0 = time.perf_counter()
        delta.apply_records(rec, 1, [dst])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best_a = min(best_a, time.perf_counter() - t0)
    nb = rec.numel()
    return dict(
        encode_Bps=nb / max(best_e, 1e-9),
        apply_Bps=nb / max(best_a, 1e-9),
        compare_Bps=n / max(compare_s, 1e-9),
        sample_bytes=n,
        rate=rate,
    )


class DeltaWriter:
    """engine, device, stream, rank: this rank's; runner: its TaskRunner (verify's checksums,
    the engine's words); links: its workers (their staging areas, restarts); ctl: the job's
    Control (the receivers' resync requests); costs: calibrate_costs's (None: timed here);
    link_Bps: the link throughput assumed before a dense push measured it (None: 1 GB/s);
    measure_link False: keep link_Bps (a known link, or a test that pins the choice)."""

    def __init__(
        self, engine, device, stream, rank, links, runner, ctl, costs=None, link_Bps=None, measure_link: bool = True
    ):
        self.engine, self.device, self.stream, self.rank = engine, device, stream, rank
        self.links, self.runner, self.ctl = links, runner, ctl
        self.senders = program.receivers_of(links.plan)  # gpu -> trainer ranks writing it (slot order)
        self.costs = dict(costs) if costs is not None else calibrate_costs(device)
        self.link_Bps = 1e9 if link_Bps is None else float(link_Bps)
        self.measure_link = bool(measure_link)
        self.cpu_native = delta_cpu.available(device)  # the CPU path's compare/encode in C
        self.shadow: dict = {}  # task -> (ranges [(soff, n, shadow offset)], uint8 tensor)
        self.synced: set = set()  # gpus whose memory matches the shadow (after apply())
        self.last_rec: dict = {}  # gpu -> version of the last push that sent it records (-1: none)
        self.regions: dict = {}  # gpu -> {region descriptor: index} of its staging records
        self.resync_seen = 0
        self.force_dense = False  # the next pushes dense, shadow kept (a benchmark's dense push in the same run)
        self.version = 0
        self.recs: dict = {}  # gpu -> [record tensors] of the push under way
        self.room: dict = {}  # gpu -> record bytes left in this rank's slot
        self.step = self._zero()
        self.last: dict = {}
        self.total = dict(pushes=0, delta_bytes=0, dense_bytes=0, sent_bytes=0)
        links.on_adopt.append(self._adopted)

    @staticmethod
    def _zero() -> dict:
        return dict(
            dense_bytes=0, delta_bytes=0, record_bytes=0, changed_bytes=0, compared_bytes=0,
            tasks_delta=0, tasks_dense=0, dense_why={}, encode_s=0.0,
            make_s=0.0, gather_s=0.0, compare_s=0.0, keep_s=0.0,
        )  # fmt: skip

    # ------------------------------------------------------------------ a push
    def start(self, version: int) -> None:
        self.version = int(version)
        self._resyncs()
        for g in list(self.last_rec):
            if g not in self.synced:  # written dense this push: no earlier records to build on
                del self.last_rec[g]
        self.recs = {g: [] for g in self.links.workers}
        self.room = {}
        for g, w in self.links.workers.items():
            slot = self._slot(g, w)
            self.room[g] = 0 if slot is None else slot[2] - delta.HEAD.size
        self.step = self._zero()
        self._t0 = time.perf_counter()

    def _slot(self, g: int, w: dict):
        """(region descriptor, offset, size) of this rank's staging slot on gpu `g`, or None."""
        if not w.get("delta_bytes"):
            return None
        senders = self.senders.get(g, [])
        if self.rank not in senders:
            return None
        i, n = senders.index(self.rank), len(senders)
        size = (int(w["delta_bytes"]) // max(n, 1)) & ~7
        return base64.b64decode(w["delta"]), i * size, size

    def _region_index(self, g: int) -> dict:
        m = self.regions.get(g)
        if m is None:
            w = self.links.workers[g]
            m = self.regions[g] = {base64.b64decode(d): i for i, d in enumerate(w.get("delta_regions", []))}
        return m

    def _resyncs(self) -> None:
        """Workers that asked for a dense push (they missed records): out of step."""
        try:
            n = self.ctl.add("delta/resync", 0)
        except Exception:  # noqa: BLE001 -- the store is checked again at the next push
            return
        if n != self.resync_seen:
            self.resync_seen = n
            for g in list(self.synced):
                if self.ctl.check("delta/resync/%d" % g):
                    self.synced.discard(g)

    def _adopted(self, g: int, old_regions) -> None:
        self.synced.discard(g)
        self.regions.pop(g, None)
        self.last_rec.pop(g, None)

    def run_task(self, op, push_event) -> None:
        """One task of a delta push (TaskRunner.run_task's contract)."""
        prep = op.prep
        if prep is None:
            prep = op.prep = prepare.task_prep(op, self.device)
        if not op.sends:
            prepare.run(prep, op, self.device)
            return
        t0 = time.perf_counter()
        buf = prepare.run(prep, op, self.device)
        self.step["make_s"] += time.perf_counter() - t0
        self.step["gather_s"] += prep.gather_s
        prep.gather_s = 0.0
        if self.runner.sums is not None:  # verify: the whole destination, whatever is sent
            self.runner._checksum(op, buf, prep.dests)
        ranges = sorted({(int(s), int(n)) for _, _, s, n in prep.dests})
        sh = self.shadow.get(op.task)
        gpus = [self.links.gpu_of_region.get(bytes(d[0])) for d in prep.dests]
        why = self._dense_reason(sh, ranges, gpus)
        recs, kept = None, False
        if why is None:
            t0 = time.perf_counter()
            if self.cpu_native:  # one native pass per range, the shadow updated there (delta_cpu.py)
                recs, why = delta_cpu.encode(self, op, buf, prep.dests, sh, gpus)
                kept = True
            else:
                recs, why = self._encode(op, buf, prep.dests, sh, gpus)
            self.step["encode_s"] += time.perf_counter() - t0
        nb = sum(int(d[3]) for d in prep.dests)
        if recs is None:
            self.step["dense_why"][why] = self.step["dense_why"].get(why, 0) + 1
            self.step["tasks_dense"] += 1
            self.step["dense_bytes"] += nb
            self._submit_dense(op, prep, buf, push_event)
        else:
            self.step["tasks_delta"] += 1
            self.step["delta_bytes"] += nb
            for g, lst in recs.items():
                self.recs[g].extend(lst)
        if not kept:
            t0 = time.perf_counter()
            self._keep(op.task, buf, ranges, sh)
            self.step["keep_s"] += time.perf_counter() - t0

    def _dense_reason(self, sh, ranges, gpus):
        if self.force_dense:
            return "forced"
        if sh is None or [r[:2] for r in sh[0]] != ranges:
            return "first"
        if any(g is None or g not in self.synced for g in gpus):
            return "not_in_step"
        if any(self.room.get(g, 0) <= 0 for g in gpus):
            return "no_staging"
        return None

    def _encode(self, op, buf, dests, sh, gpus) -> tuple:
        """({gpu: [records]}, None) when records are cheaper than the task's bytes, else
        (None, why)."""
        old = sh[1]
        per_range, rec_bytes = {}, 0
        for soff, n, so in sh[0]:
            d, c = delta.changed(buf[soff : soff + n], old[so : so + n])
            per_range[soff] = (d, c)
            self.step["compared_bytes"] += n
            self.step["changed_bytes"] += c
        need: dict = {}
        dense = 0
        for (rdesc, doff, soff, n), g in zip(dests, gpus):
            c = per_range[int(soff)][1]
            need[g] = need.get(g, 0) + delta.record_size(int(n), c)
            dense += int(n)
        rec_bytes = sum(need.values())
        cst = self.costs
        t_rec = rec_bytes / self.link_Bps + rec_bytes / cst["apply_Bps"] + rec_bytes / cst["encode_Bps"]
        if t_rec >= dense / self.link_Bps:
            return None, "cost"
        if any(need[g] > self.room[g] for g in need):
            return None, "slot_full"
        out: dict = {}
        for (rdesc, doff, soff, n), g in zip(dests, gpus):
            d, c = per_range[int(soff)]
            if c == 0:
                continue
            idx = self._region_index(g).get(bytes(rdesc))
            if idx is None:
                return None, "no_staging"
            out.setdefault(g, []).append(delta.encode(buf[soff : soff + n], d, c, idx, int(doff)))
        for g, v in need.items():
            self.room[g] -= v
        return out, None

    def _keep(self, task: int, buf, ranges, sh) -> None:
        """The shadow of task `task` made equal to `buf`'s ranges."""
        import torch

        if sh is None or [r[:2] for r in sh[0]] != ranges:
            total, layout = 0, []
            for s, n in ranges:
                layout.append((s, n, total))
                total += n
            sh = (layout, torch.empty(total, dtype=torch.uint8, device=buf.device))
            self.shadow[task] = sh
        for s, n, so in sh[0]:
            sh[1][so : so + n].copy_(buf[s : s + n])

    def _submit_dense(self, op, prep, buf, push_event) -> None:
        from .tasks import writes_bound

        held = int(buf.numel()) if not prep.zero_copy else 0
        t_admit = self.engine.reserve(held, timeout=writes_bound(self.runner.write_timeout))
        kw = {}
        if self.stream is not None:
            import torch

            ev = push_event if prep.zero_copy else torch.cuda.Event()
            if not prep.zero_copy:
                prep.event = ev
                ev.record(self.stream)
            kw = dict(event=ev.cuda_event, device=self.device.index)
        self.engine.submit(buf, prep.dests, tag=op.task, held=held, reserved=t_admit, **kw)

    def flush(self) -> None:
        """After the task loop: each receiver's records (header first) in one write into this
        rank's slot there; a receiver with a staging area gets its header even with no records
        (its apply() then knows this step has none)."""
        import torch

        for g, w in self.links.workers.items():
            if g in self.links.dropped:
                continue
            slot = self._slot(g, w)
            if slot is None:
                continue
            lst = self.recs.get(g, [])
            payload = sum(int(r.numel()) for r in lst)
            last = self.last_rec.get(g, -1)
            head = delta.HEAD.pack(delta.MAGIC, self.version, last, len(lst), payload, 0)
            h = torch.frombuffer(bytearray(head), dtype=torch.uint8).to(self.device)
            out = torch.cat([h] + lst) if lst else h
            self.step["record_bytes"] += int(out.numel())
            kw = {}
            if self.stream is not None:
                ev = torch.cuda.Event()
                ev.record(self.stream)
                kw = dict(event=ev.cuda_event, device=self.device.index)
                self._flush_events = getattr(self, "_flush_events", []) + [ev]
            self.engine.submit(out, [(slot[0], slot[1], 0, int(out.numel()))], tag=delta.DELTA_TAG, **kw)

    def landed(self, ok: bool, seconds: float | None = None) -> None:
        """The push finished: `ok` (every rank agreed it went well): every live worker written
        is in step with the shadow from now on; else none is (the next push is dense)."""
        self._flush_events = []
        s = self.step
        if ok:
            live = set(self.links.workers) - set(self.links.dropped)
            self.synced = live
            for g in live:
                if self.recs.get(g):
                    self.last_rec[g] = self.version
            if self.measure_link and s["tasks_delta"] == 0 and s["tasks_dense"]:
                self.link_Bps = self._link_measured(s["tasks_dense"]) or self.link_Bps
        else:
            self.synced = set()
            self.last_rec = {}
        s["sent_bytes"] = s["dense_bytes"] + s["record_bytes"]
        s["tasks_dense_cost"] = s["dense_why"].get("cost", 0)  # dense because records cost more
        s["ok"], s["seconds"] = bool(ok), seconds
        self.last = dict(s, dense_why=dict(s["dense_why"]))
        self.total["pushes"] += 1
        for k in ("delta_bytes", "dense_bytes", "sent_bytes"):
            self.total[k] += s[k]
        self.recs = {}

    def _link_measured(self, ntasks: int) -> float | None:
        """This rank's link throughput in its last (all dense) push, from the engine trace: its
        data tasks' bytes over the union of their write spans (first write posted .. last
        landed), so that stage 2 does not count as link time.  None when not measurable."""
        from .tasks import STAMP_TAG

        try:
            recs = [r for r in self.engine.trace()[-(ntasks + 8) :] if r["tag"] not in (STAMP_TAG, delta.DELTA_TAG)]
        except Exception:  # noqa: BLE001
            return None
        spans = sorted((r["t_post_first"], r["t_done"]) for r in recs if r["t_post_first"] and r["t_done"])
        busy, end = 0, 0
        for a, b in spans:
            a = max(a, end)
            if b > a:
                busy += b - a
                end = b
        nb = sum(int(r["bytes"]) for r in recs)
        return nb / (busy / 1e9) if busy > 0 and nb > 0 else None

    def shadow_bytes(self) -> int:
        return sum(int(t.numel()) for _, t in self.shadow.values())

    def stats(self) -> dict:
        return dict(
            shadow_bytes=self.shadow_bytes(),
            synced=sorted(self.synced),
            link_Bps=self.link_Bps,
            costs=dict(self.costs),
            last=dict(self.last),
            total=dict(self.total),
        )
