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
staging area.  On cuda_ipc a task whose destinations are all mapped here may instead be
scattered straight into the receivers' memory by a kernel of this rank (delta_scatter.py),
when that costs least (``changed / scatter_Bps``) or ``Sender(delta={"scatter": "force"})``."""

from __future__ import annotations

import base64
import logging
import time

from . import delta, delta_cpu, delta_scatter, prepare, program

log = logging.getLogger(__name__)


def calibrate_costs(device, n: int = 1 << 22, rate: float = 0.01, gpu: bool = False) -> dict:
    """Encode and apply throughput (record bytes per second) of a range of `n` bytes with
    `rate` of them changed, on `device` (timed once: a few ms); gpu: the encode is the delta
    kernels' (delta_gpu.emit), else the torch ops', and ``scatter_Bps`` the scatter kernel's
    changed bytes stored per second (delta_scatter.calibrate, on the 64 MiB sample)."""
    import torch

    if not gpu and delta_cpu.available(device):  # what the CPU pushes run: the native compare and encode
        return delta_cpu.calibrate(n, rate)
    old, new = delta_cpu.sample(n, rate, device)
    dst = old.clone()
    best_e = best_a = float("inf")
    rec = None
    t0 = time.perf_counter()
    d, c = delta.changed(new, old)  # paid by every task, records or dense: not a records' cost
    compare_s = time.perf_counter() - t0
    st = None
    if gpu:  # the kernels' compare and count (one read back) of 64 MiB: what a task pays first
        from . import delta_gpu

        _, st = delta_gpu.compare_count(old.clone(), new, [(0, n, 0)])
        big = 1 << 26
        o2 = torch.randint(0, 256, (big,), dtype=torch.uint8, device=device)
        n2 = o2.clone()
        n2[:: int(1 / rate)] ^= 1
        best_c = float("inf")
        for _ in range(3):
            sh = o2.clone()
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            cs2, st2 = delta_gpu.compare_count(sh, n2, [(0, big, 0)])
            best_c = min(best_c, time.perf_counter() - t0)
        compare_s = best_c * n / big  # scaled to the sample's n bytes (compare_Bps below)
        scatter_Bps = delta_scatter.calibrate(sh, st2["bits"], cs2[0])
        del o2, n2, sh, st2
    for _ in range(3):
        t0 = time.perf_counter()
        rec = delta.encode(new, d, c, 0, 0) if st is None else delta_gpu.emit(new, st, [(0, 0, 0)])[0]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best_e = min(best_e, time.perf_counter() - t0)
        t0 = time.perf_counter()
        delta.apply_records(rec, 1, [dst])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best_a = min(best_a, time.perf_counter() - t0)
    more = dict(scatter_Bps=scatter_Bps) if gpu else {}
    return delta_cpu.rates(rec.numel(), best_e, best_a, n, compare_s, rate, **more)


SCATTERED = "scattered"  # _encode's answer for a task the scatter wrote (delta_scatter.py)


def _kernels(device) -> tuple:
    """(the delta kernels run on `device`, why not or None): on a CUDA device where they cannot
    load, the torch ops of delta.py do the work and the reason is logged once."""
    if device is None or getattr(device, "type", "cpu") != "cuda":
        return False, None
    from . import delta_gpu

    why = delta_gpu.why(device)
    if why is not None:
        log.warning("delta pushes on %s: the delta kernels cannot run (%s); using torch ops", device, why)
    return why is None, why


class DeltaWriter:
    """engine, device, stream, rank: this rank's; runner: its TaskRunner (verify's checksums,
    the engine's words); links: its workers (their staging areas, restarts); ctl: the job's
    Control (the receivers' resync requests); costs: calibrate_costs's (None: timed here);
    link_Bps: the link throughput assumed before a dense push measured it (None: 1 GB/s);
    measure_link False: keep link_Bps (a known link, or a test that pins the choice); scatter:
    "auto", "force" or "off" (delta_scatter.py: on cuda_ipc, the changed bytes stored straight
    into the receivers' memory by a kernel of this rank)."""

    def __init__(
        self, engine, device, stream, rank, links, runner, ctl, costs=None, link_Bps=None, measure_link: bool = True,
        scatter: str = "auto",
    ):  # fmt: skip
        self.engine, self.device, self.stream, self.rank = engine, device, stream, rank
        self.links, self.runner, self.ctl = links, runner, ctl
        self.senders = program.receivers_of(links.plan)  # gpu -> trainer ranks writing it (slot order)
        self.gpu, self.encoder_why = _kernels(device)
        self.costs = dict(costs) if costs is not None else calibrate_costs(device, gpu=self.gpu)
        self.scatter = delta_scatter.Scatter(scatter, self)
        self._fresh = False  # the shadow of the task under way already updated (the kernels' compare)
        self._pre = None  # delta_gpu.count's answer for the task under way (the fused path)
        self._bypassed: set = set()  # tasks of the push under way sent a plain push's way (bypass)
        self._coloc: dict = {}  # task -> (its dests, all of them this GPU's memory)
        self.link_Bps = 1e9 if link_Bps is None else float(link_Bps)
        self.measure_link = bool(measure_link)
        self.cpu_native = not self.gpu and delta_cpu.available(device)  # the CPU path's compare/encode in C
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
            tasks_delta=0, tasks_dense=0, dense_why={}, encode_s=0.0, fused_tasks=0, tasks_bypassed=0,
            tasks_scatter=0, scatter_bytes=0, scatter_skipped=0,
            make_s=0.0, gather_s=0.0, compare_s=0.0, keep_s=0.0,
        )  # fmt: skip

    # ------------------------------------------------------------------ a push
    def start(self, version: int) -> None:
        self.version = int(version)
        self._bypassed = set()
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
        self.scatter.forget()
        self.synced.discard(g)
        self.regions.pop(g, None)
        self.last_rec.pop(g, None)

    def run_task(self, op, push_event) -> None:
        """One task of a delta push (TaskRunner.run_task's contract)."""
        prep = op.prep
        self._fresh = False
        if prep is None:
            prep = op.prep = prepare.task_prep(op, self.device)
        if not op.sends:
            prepare.run(prep, op, self.device)
            return
        t0 = time.perf_counter()
        made = self._fused(op, prep)  # FP8 tasks: quantized, compared and counted in the shadow
        buf, self._pre = (prepare.run(prep, op, self.device), None) if made is None else made
        self.step["make_s"] += time.perf_counter() - t0
        self.step["gather_s"] += prep.gather_s
        prep.gather_s = 0.0
        if self.runner.sums is not None:  # verify: the whole destination, whatever is sent
            self.runner._checksum(op, buf, prep.dests)
        ranges = sorted({(int(s), int(n)) for _, _, s, n in prep.dests})
        sh = self.shadow.get(op.task)
        gpus = [self.links.gpu_of_region.get(bytes(d[0])) for d in prep.dests]
        why = self._dense_reason(op, sh, ranges, gpus)
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
            self._submit_dense(op, prep, buf, push_event, own=made is not None)
        elif recs is SCATTERED:  # its changed bytes stored in the receivers' memory (delta_scatter)
            self.step["delta_bytes"] += nb
        else:
            self.step["tasks_delta"] += 1
            self.step["delta_bytes"] += nb
            for g, lst in recs.items():
                self.recs[g].extend(lst)
        if why == "link_fast":  # no shadow kept: the first push after a slower link is dense
            self.shadow.pop(op.task, None)
        elif not self._fresh and not kept:  # (the kernels' compare and the native encode updated it)
            t0 = time.perf_counter()
            self._keep(op.task, buf, ranges, sh)
            self.step["keep_s"] += time.perf_counter() - t0

    def bypass(self, op) -> bool:
        """True when task `op` takes a plain push's dense way (the StepLoop's: in-place writes on
        cuda_ipc, batched zero-copy tasks), not this writer: on the kernel path, every destination
        of the task is this GPU's own memory (colocated: no link to save), or the link is faster
        than the compare. Its shadow is dropped (stale from now on).  Never a task that
        ``Sender(delta={"scatter": "force"})`` scatters."""
        if self.scatter.forced(op) or not (self.link_fast() or self._colocated(op)):
            return False
        self.shadow.pop(op.task, None)
        self.step["tasks_bypassed"] += 1
        self._bypassed.add(op.task)
        return True

    def bypassed(self, op) -> bool:
        """Did `bypass` send task `op` a plain push's way in the push under way?"""
        return op.task in self._bypassed

    def _colocated(self, op) -> bool:
        """The kernel path with the link measured (not pinned), and every destination of task `op`
        mapped on this rank's own GPU (the transport's map, as in-place writes check it: cuda_ipc
        between processes of one GPU)."""
        hit = self._coloc.get(op.task)
        if hit is not None and hit[0] is op.dests:
            return hit[1]
        ok = bool(self.gpu and self.measure_link and op.dests)  # a pinned link is taken as given
        mp = getattr(getattr(self.runner, "transport", None), "map", None)
        try:
            ok = (
                ok
                and mp is not None
                and all(mp(bytes(d[0]), int(d[1]), int(d[3]))[1] == self.device.index for d in op.dests)
            )
        except Exception:  # noqa: BLE001 -- not mapped here (another transport, another GPU): not colocated
            ok = False
        self._coloc[op.task] = (op.dests, ok)
        return ok

    def link_fast(self) -> bool:
        """The kernel path, and the link faster than the compare (colocated): compare nothing, the
        tasks go a plain push's way (``bypass``; fixed for a push: the link is measured after it)."""
        return self.gpu and self.link_Bps >= self.costs.get("compare_Bps", float("inf"))

    def _fast(self, op) -> bool:
        """link_fast, for task `op`: not for a task the scatter is forced on."""
        return self.link_fast() and not self.scatter.forced(op)

    def _fused(self, op, prep):
        """The task's bytes made in its shadow by the delta kernels (FP8 pieces quantized and
        compared in one pass; raw pieces copied, then compared) when the task has FP8 pieces and
        its shadow is its whole buffer in order: (the shadow, delta_gpu.count's answer), the
        collectives run here; else None, nothing done (the caller runs prepare.run)."""
        if not self.gpu or prep.zero_copy or prep.direct is not None or self._fast(op):
            return None
        sh = self.shadow.get(op.task)
        if sh is None or sh[1].numel() != op.nbytes or any(s != so for s, _, so in sh[0]):
            return None
        _, raw, fp8_pieces, end, _ = prepare._layout(op.shards)
        if not fp8_pieces or end != op.nbytes:
            return None
        import torch

        from . import delta_gpu

        fulls, _ = prepare.gather(prep, op, self.device)
        shadow = sh[1]
        bits = delta_gpu.bits_for(op.nbytes, self.device)
        spans = [(off, int(r.nbytes), off) for r, off, _ in raw if r.nbytes]
        if spans:
            tmp = torch.empty(op.nbytes, dtype=torch.uint8, device=self.device)
            prepare._copy_raw(tmp, fulls, raw)
            delta_gpu.compare(shadow, bits, tmp, spans)
        delta_gpu.quantize_compare(shadow, bits, prepare._jobs(fulls, fp8_pieces))
        self._fresh = True
        self.step["fused_tasks"] += 1
        return shadow, delta_gpu.count(bits, [(so, n) for _, n, so in sh[0]])

    def _dense_reason(self, op, sh, ranges, gpus):
        if self.force_dense:
            return "forced"
        if self._fast(op):
            return "link_fast"  # the compare alone takes longer than the dense write (colocated)
        if sh is None or [r[:2] for r in sh[0]] != ranges:
            return "first"
        if any(g is None or g not in self.synced for g in gpus):
            return "not_in_step"
        if any(self.room.get(g, 0) <= 0 for g in gpus) and not (self.gpu and self.scatter.targets(op)):
            return "no_staging"  # (a scatter needs no staging area)
        return None

    def _encode(self, op, buf, dests, sh, gpus) -> tuple:
        """({gpu: [records]}, None) when records are cheaper than the task's bytes; (SCATTERED,
        None) when the task was scattered (cheaper still, or forced); else (None, why)."""
        old = sh[1]
        per_range, rec_bytes, st = {}, 0, None
        if self.gpu:  # one kernel compares and updates the shadow, one counts (one read back)
            from . import delta_gpu

            cs, st = self._pre if self._pre is not None else delta_gpu.compare_count(old, buf, sh[0])
            self._fresh = True
            for i, ((soff, n, so), c) in enumerate(zip(sh[0], cs)):
                per_range[soff] = (i, c)
        else:
            for soff, n, so in sh[0]:
                per_range[soff] = delta.changed(buf[soff : soff + n], old[so : so + n])
        for soff, n, so in sh[0]:
            self.step["compared_bytes"] += n
            self.step["changed_bytes"] += per_range[soff][1]
        need: dict = {}
        dense = 0
        for (rdesc, doff, soff, n), g in zip(dests, gpus):
            c = per_range[int(soff)][1]
            need[g] = need.get(g, 0) + delta.record_size(int(n), c)
            dense += int(n)
        rec_bytes = sum(need.values())
        cst = self.costs
        t_rec = rec_bytes / self.link_Bps + rec_bytes / cst["apply_Bps"] + rec_bytes / cst["encode_Bps"]
        if any(self.room.get(g, 0) <= 0 for g in need):
            t_rec = float("inf")  # a receiver without a staging area: no records (the scatter needs none)
        if st is not None:
            changed = sum(per_range[int(d[2])][1] for d in dests)
            if self.scatter.chosen(op, changed, dense / self.link_Bps, t_rec):
                self.scatter.write(op, dests, gpus, sh, st, per_range)
                return SCATTERED, None
        if t_rec == float("inf"):
            return None, "no_staging"
        if t_rec >= dense / self.link_Bps:
            return None, "cost"
        if any(need[g] > self.room[g] for g in need):
            return None, "slot_full"
        out: dict = {}
        todo = []  # (gpu, (range index, region index, destination offset)) for the emit kernel
        for (rdesc, doff, soff, n), g in zip(dests, gpus):
            d, c = per_range[int(soff)]
            if c == 0:
                continue
            idx = self._region_index(g).get(bytes(rdesc))
            if idx is None:
                return None, "no_staging"
            if st is not None:
                todo.append((g, (d, idx, int(doff))))
            else:
                out.setdefault(g, []).append(delta.encode(buf[soff : soff + n], d, c, idx, int(doff)))
        if todo:
            for (g, _), rec in zip(todo, delta_gpu.emit(old, st, [t for _, t in todo])):
                out.setdefault(g, []).append(rec)
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

    def _submit_dense(self, op, prep, buf, push_event, own: bool = False) -> None:
        """own: buf is the task's shadow (already counted against the watermark)."""
        from .tasks import writes_bound

        held = int(buf.numel()) if not (prep.zero_copy or own) else 0
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
            if self.measure_link and s["tasks_delta"] == s["tasks_scatter"] == 0 and s["tasks_dense"]:
                self.link_Bps = self._link_measured(s["tasks_dense"]) or self.link_Bps
        else:
            self.synced = set()
            self.last_rec = {}
        s["sent_bytes"] = s["dense_bytes"] + s["record_bytes"] + s["scatter_bytes"]
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
            encoder="kernels" if self.gpu else "torch",
            encoder_why=self.encoder_why,
            synced=sorted(self.synced),
            link_Bps=self.link_Bps,
            costs=dict(self.costs),
            scatter=self.scatter.stats(),
            last=dict(self.last),
            total=dict(self.total),
        )
