"""The trainer side: ``Sender`` on every training rank, and the one-line hook ``push()``.

    sender = wxfer.Sender(model, mapping="qwen3-8b", store="host:29650")   # every rank
    for step in ...:
        loss.backward(); optimizer.step()
        sender.push()                      # returns when this rank's writes have landed

Setup (once): every rank publishes its parameter metadata; rank 0 waits for the
receivers' metadata, builds and checks the plan and hands it (serialized, versioned) to
every rank through the store; every rank connects to the receivers it writes to.  A
setup error on any rank (or on rank 0's controller) is raised on every rank.

A step first writes its number into this rank's *begin* stamp slot on every receiver it
writes to (an engine fence task: no data write is posted before those landed; the host does
not wait for them, except a push with direct tasks at its first, direct.py), then replays
the plan: for each mesh group, for each task of this rank in order, H2D (offloaded FSDP) ->
full_tensor() + fusion + FP8 + packing -> Engine.submit (or straight into the receivers'
memory on cuda_ipc, direct.py); an asynchronous gloo barrier after the group's last
full_tensor(); then its *end* stamp into every receiver it wrote to, a fence task posted once
every data write of the step completed and the side stream's work (the direct writes) is
done (Receiver.version() counts a step only where begin == end).  A
receiver this rank gives up on, or a step it abandons half written, is recorded in the
store (torn/<gpu>/e<epoch>/<i>) for Receiver.state().  A failure seen by any rank, raised
anywhere inside push(), is raised on every rank (the same barriers, then one gloo
all-reduce of a flag per push, are joined on every path).  One push() at a time per
Sender: a second one from another thread is refused.  An inference worker restarted since
the last push is connected and written from this push on.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time

from . import control, prepare, program
from .control import Control, SetupError
from .direct import DirectMixin
from . import digest, jobs, setup_waits
from .faults import FaultsMixin, mapping_digest
from .finish import FinishMixin
from .rejoin import RejoinMixin
from .tasks import STAMP_TAG, TaskMixin
from .receiver import _unb64, decode_param_descriptor, gpu_memory_options, transport_choice
from .verify import verify_enabled

log = logging.getLogger(__name__)


FAST_BATCH = 32  # zero-copy tasks per Engine.submit_prepared call (the first writes start early)
FAST_BATCH_BYTES = 256 << 20  # ... or fewer, once their bytes reach this (a large write is not held back)


def task_bound(watermark: int) -> int:
    """The plan's size bound of a task (training bytes) under a watermark: half of it, so
    that two tasks fit (one prepared while the other is written), within [16 MiB, 1 GiB]."""
    if not watermark:
        return 1 << 30
    return int(min(1 << 30, max(16 << 20, watermark // 2)))


def _parse_size(v) -> int:
    if isinstance(v, int):
        return v
    from .. import _wxfer

    return int(_wxfer.parse_size(str(v)))


class PushHandle:
    """What ``push(async_op=True)`` returns: every task is submitted (sources packed);
    ``wait()`` returns once this rank's writes and version stamps have landed."""

    def __init__(self, sender, version, t0, barrier, keep):
        self._s, self.version, self._t0, self._barrier, self._keep = sender, version, t0, barrier, keep
        self._done = False
        self.seconds = None
        self._end_event = None  # CUDA event the end stamps wait for (the side stream's work)

    def done(self) -> bool:
        return self._done

    def wait(self, timeout: float | None = None) -> float:
        with self._s._lock:  # one thread finishes a step; another waits for it
            if not self._done:
                try:
                    self._s._finish(self, timeout)
                finally:
                    self._done = True  # a failed step is reported once, not again by the next push
        return self.seconds


def writer_options(tname: str, topts: dict, env, given: dict | None = None) -> dict:
    """The options a trainer opens transport `tname` with, from the receivers' published ones
    (`given`: this rank's own transport_options, merged into them).

    What names the receivers' own host does not travel: their `iface` (their NIC; the trainer's
    comes from $WXFER_IFACE, and only for fabric, the one backend with that option: verbs and
    cuda_ipc refuse an unknown option, so a job that set the variable for its fabric NIC failed
    at setup) and, on verbs, their GPU check (`gpu`, `gpu_memory`; this rank checks for its own
    memory) unless `given` sets it."""
    mine = ("gpu", "gpu_memory") if tname == "verbs" else ()
    out = {k: v for k, v in topts.items() if k != "iface" and (k not in mine or k in (given or {}))}
    if tname == "fabric" and env.get("WXFER_IFACE"):
        out["iface"] = env["WXFER_IFACE"]
    return out


class Sender(TaskMixin, RejoinMixin, FaultsMixin, DirectMixin, FinishMixin):
    """Push this rank's share of the model to the inference workers after each step.

    model: the training model (FSDP2 ``fully_shard``ed, or plain).  mapping: a preset
    name, a wxfer.mapping.Preset or an HF config dict.  store: a torch Store, "host:port"
    or None (rank 0 hosts a TCPStore at $WXFER_STORE or $MASTER_ADDR:$WXFER_STORE_PORT).
    transport: "auto" (what the receivers registered with) or a backend name.
    watermark: bytes of prepared-but-unsent buffers per rank (the Engine blocks admission
    above it), e.g. "2GiB".  device: where stage 2 runs (default: cuda:current when CUDA
    is available, else cpu).  write_timeout: seconds a step's writes may take before push()
    fails naming the task and the inference worker (30 s).  store_bind: the address or
    interface the hosted TCPStore listens on (see wxfer.runtime.control.resolve_store).
    secret (default $WXFER_SECRET): a job secret (>= 16 bytes) shared with the receivers;
    with it every record in the store is authenticated (HMAC-SHA256, control.Control), so
    a store writer without it can neither redirect nor inject writes.
    direct (default $WXFER_DIRECT, on): on cuda_ipc, a packed task whose destinations are all
    mapped on this rank's GPU (receivers colocated on it) is packed and FP8-quantized straight
    into the receivers' memory, with no send buffer and no copy (wxfer.runtime.direct;
    ``stats()["direct"]`` counts them); False: every packed task through a send buffer.
    copy_max (default $WXFER_DIRECT_COPY_MAX, else 32 MiB): with direct on cuda_ipc, a
    zero-copy task of fewer bytes than this whose destinations are all mapped here is copied
    straight into the receivers' memory by batched copy kernels instead of one engine write
    each: bytes (an int or e.g. "1MiB"); 0: never; "all" or -1: no upper bound (every such
    task).  ``stats()["direct"]["copy_max"]`` is the bound in use (-1: none).
    max_task_bytes (default: half the watermark, 16 MiB .. 1 GiB, `task_bound`): the plan's
    bound on a task's training bytes (rank 0's is used); 1: every component its own task
    (``python -m wxfer calibrate`` probes fine and coarse tasks this way).
    """

    def __init__(
        self,
        model,
        mapping,
        store=None,
        transport: str = "auto",
        watermark="2GiB",
        name: str = "default",
        timeout: float = control.DEFAULT_TIMEOUT,
        device=None,
        transport_options: dict | None = None,
        host_store: bool | None = None,
        write_timeout: float = 30.0,
        store_bind: str | None = None,
        secret=None,
        direct: bool | None = None,
        copy_max=None,
        max_task_bytes: int | None = None,
    ):
        import torch
        import torch.distributed as dist

        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.timeout = float(timeout)
        self.write_timeout = float(write_timeout)
        self.version = 0
        self._pending = None
        self._sums = self._last_sums = self.last_verify = None
        self._verify = False
        self._lock = threading.RLock()  # push() / PushHandle.wait(): one step at a time
        self._marked = set()
        self._epoch = {}
        self.engine = self.transport = None
        if max_task_bytes is not None and (isinstance(max_task_bytes, bool) or int(max_task_bytes) < 1):
            raise ValueError(f"wxfer.Sender: max_task_bytes must be an int >= 1 or None, got {max_task_bytes!r}")
        self._direct_init(direct, copy_max)  # validates direct and copy_max before anything is set up
        if device is None:
            device = (
                torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
            )
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.group = control.gloo_group(timeout)
        if host_store is None:
            host_store = self.rank == 0 and store is None
        elif host_store not in (True, False):  # 1 / 0 are accepted as True / False
            raise TypeError(f"wxfer.Sender: host_store must be True, False or None, got {host_store!r}")
        host_store = bool(host_store)
        self.ctl = Control(
            control.resolve_store(store, host_store, timeout, bind=store_bind),
            name,
            timeout,
            secret=control.job_secret(secret),
        )
        self._store_host = host_store
        self._hosted = store is None or host_store  # a trainer process hosts the store
        jobs.join(self, name)  # this job's generation of `name` in the store (issue 25.5)
        self.mapping = mapping
        self.watermark = _parse_size(watermark)
        self.max_task_bytes = task_bound(self.watermark) if max_task_bytes is None else int(max_task_bytes)
        self.last_submit_s = None
        # seconds from the start of the last push() to the end of each of its phases
        self.last_phases: dict = {}
        self.setup_s = {}
        t0 = time.perf_counter()
        # ---- 1. metadata of this rank (and the mapping it was given: every rank's must agree)
        err = None
        try:
            self.ctl.set_json("train/%d/mapping" % self.rank, mapping_digest(mapping))
            control.publish_who(self.ctl, self.rank)
            if hasattr(model, "reshard"):
                model.reshard()  # FSDP2: the sharded DTensor parameters, even after a no-grad forward
            self.params = {n: p for n, p in model.named_parameters()}
            self.ctl.set_json("train/%d" % self.rank, program.train_metadata(model))
        except Exception as e:  # noqa: BLE001
            err = f"{type(e).__name__}: {e}"
        control.agree(self.group, err, self.rank, "publishing training metadata", self.timeout)
        # ---- 2. rank 0 builds the plan; every rank receives it (or the error), within 1.1x timeout
        setup_waits.phase_deadline(self)
        if self.rank == 0:
            try:
                self._controller(mapping)
            except SetupError as e:
                log.error("trainer rank 0: building the plan failed: %s", e)
                # the store lives in this process: before raising (and maybe exiting) let the
                # other ranks and the registered receivers read the error from it
                self._linger("plan/acks", self.world - 1, "status/acks", None)
                raise
        self.setup_s["plan"] = time.perf_counter() - t0
        data = self.ctl.get("plan", "the plan from trainer rank 0 (controller)", setup_waits.PLAN_WAIT * self.timeout)
        if self.rank:
            self.ctl.add("plan/acks", 1)
            if data[:2] == control.ERR:  # torchrun ends rank 0 once this rank exits: wait for the receivers
                self._linger(None, 0, "status/acks", None)
        self.plan = setup_waits.load_plan(self, data)  # decoded, checked and agreed on every rank
        # ---- 3. this rank's program, transport, connections
        t1 = time.perf_counter()
        self._connect_phase(transport, transport_options, watermark)
        self.setup_s["connect"] = time.perf_counter() - t1
        log.info(
            "Sender ready: trainer rank %d of %d, writes %d of %d inference workers, transport %s, "
            "plan %d tasks (%d bytes per step from this rank), setup %.3f s (plan %.3f s, connect %.3f s)",
            self.rank,
            self.world,
            len(self.workers),
            len(program.receivers_of(self.plan)),
            self.transport_name,
            sum(len(ops) for ops in self.program.groups),
            self.bytes_per_step,
            self.setup_s["plan"] + self.setup_s["connect"],
            self.setup_s["plan"],
            self.setup_s["connect"],
        )

    # ------------------------------------------------------------------ setup
    def _connect_phase(self, transport, transport_options, watermark) -> None:
        """Setup step 3 on every rank; its verdict (every rank's errors) reaches every rank
        through gloo and every receiver through the store key `setup`."""
        setup_waits.phase_deadline(self)
        err = None
        try:
            self._connect(transport, transport_options, watermark)
            if self.rank == 0:  # a worker that registered after the plan was built, outside its layout
                n = len(program.receivers_of(self.plan))
                late = self.ctl.add("infer/count", 0) - n
                if late > 0:
                    raise SetupError(
                        f"{late} inference worker(s) registered beyond the {n} the plan is for "
                        "(the inference workers disagree on replicas/tp; see their own errors)"
                    )
        except Exception as e:  # noqa: BLE001
            err = f"{type(e).__name__}: {e}"
        try:
            control.agree(self.group, err, self.rank, "connecting to the inference workers", self.timeout)
        except SetupError as e:
            log.error("trainer rank %d: connecting to the inference workers failed: %s", self.rank, e)
            if self.rank == 0:  # the receivers learn it too (they wait for this key)
                self.ctl.set("setup", control.encode_result(None, str(e)))
            # every rank waits for the receivers to read it: the store lives in rank 0, and a
            # launcher (torchrun) ends rank 0 as soon as another rank exits
            self._linger(None, 0, "setup/acks", len(program.receivers_of(self.plan)))
            raise
        if self.rank == 0:
            self.ctl.set("setup", control.encode_result(b"", None))

    def _controller(self, mapping) -> None:
        ctl = self.ctl
        try:
            per_rank = [
                ctl.get_json("train/%d" % r, f"training metadata of trainer rank {r}") for r in range(self.world)
            ]
            train, problems = program.merge_train_metadata(per_rank)
            digests = [
                ctl.get_json("train/%d/mapping" % r, f"the mapping of trainer rank {r}") for r in range(self.world)
            ]
            problems = list(problems) + [
                f"trainer rank {r} was given mapping {d['name']!r} (digest {d['sha'][:12]}), "
                f"rank 0 {digests[0]['name']!r} (digest {digests[0]['sha'][:12]})"
                for r, d in enumerate(digests)
                if d != digests[0]
            ]
            if problems:
                raise SetupError("trainer ranks disagree:\n  " + "\n  ".join(problems))
            self._workers_by = time.monotonic() + self.timeout  # one deadline for every worker
            first = ctl.get_json("infer/0", "the metadata of inference worker gpu 0 (replica 0 rank 0)")
            n = first["replicas"] * first["tp"]
            self._tp = first["tp"]
            self._wait_workers(n)
            workers = [first] + [
                ctl.get_json("infer/%d" % g, f"metadata of inference worker gpu {g}") for g in range(1, n)
            ]
            probs = []
            extra = ctl.add("infer/count", 0) - n  # registered beyond gpu 0's layout
            for g in range(n, n + max(0, extra) + 8):
                if extra > 0 and ctl.check("infer/%d" % g):
                    w = ctl.get_json("infer/%d" % g, f"metadata of inference worker gpu {g}", 5)
                    probs.append(
                        f"inference worker gpu {g} (replica {w['replica']} of {w['replicas']}, rank "
                        f"{w['rank']} of tp={w['tp']}) lies outside gpu 0's layout replicas="
                        f"{first['replicas']} tp={first['tp']} ({n} workers)"
                    )
            pname = getattr(program.get_preset(mapping), "name", "")
            rules = digest.mapping_rules(mapping)
            for w in workers:
                if w["mapping"] and pname and w["mapping"] != pname:
                    probs.append(
                        f"inference worker gpu {w['gpu']} uses mapping {w['mapping']!r}, the trainers {pname!r}"
                    )
                elif digest.compare_rules(w, rules):
                    probs.append(digest.compare_rules(w, rules))
                if (w["transport"], w["options"]) != (first["transport"], first["options"]):
                    probs.append(
                        f"inference worker gpu {w['gpu']} registered with {w['transport']} "
                        f"{w['options']}, gpu 0 with {first['transport']} {first['options']}"
                    )
                if (w["replicas"], w["tp"]) != (first["replicas"], first["tp"]):
                    probs.append(
                        f"inference worker gpu {w['gpu']}: replicas={w['replicas']} tp={w['tp']}, "
                        f"gpu 0 says replicas={first['replicas']} tp={first['tp']}"
                    )
            if probs:
                raise SetupError("inference workers disagree:\n  " + "\n  ".join(probs))
            plan = program.build_controller_plan(train, workers, mapping, max_task_bytes=self.max_task_bytes)
            plan.check()  # every destination byte written exactly once, by one sender, in range
            senders = program.receivers_of(plan)
            for w in workers:
                if len(senders[w["gpu"]]) > w["stamp_slots"]:
                    raise SetupError(
                        f"inference worker gpu {w['gpu']} has {w['stamp_slots']} version "
                        f"stamp slots but {len(senders[w['gpu']])} trainers write to it"
                    )
            blob = program.plan_to_bytes(plan)
        except Exception as e:  # noqa: BLE001 -- every rank and every receiver learns it
            msg = f"{type(e).__name__}: {e}"
            ctl.set("plan", control.encode_result(None, msg))
            ctl.set("status", control.encode_result(None, msg))
            raise SetupError(f"wxfer: building the plan on trainer rank 0 failed: {msg}") from e
        for g, s in senders.items():
            ctl.set_json("senders/%d" % g, s)
        ctl.set("layout", json.dumps(dict(replicas=first["replicas"], tp=first["tp"], workers=n)))
        ctl.set("plan", control.encode_result(blob, None))
        ctl.set("status", control.encode_result(b"", None))

    def _wait_workers(self, n: int) -> None:
        """Wait (bounded) for the `n` inference workers; a worker registered twice, or one
        missing at the deadline, is refused naming every such worker."""
        ctl = self.ctl
        deadline = getattr(self, "_workers_by", time.monotonic() + self.timeout)
        delay, dup_seen = 0.005, None
        while True:
            have = ctl.add("infer/count", 0)
            dups = ctl.add("infer/dups", 0)
            now = time.monotonic()
            if dups and dup_seen is None:
                dup_seen = now
            if have >= n and not dups:
                return
            # a duplicate may stand in for a missing worker: give the others 1 s, then refuse
            if (dup_seen is not None and (have >= n or now - dup_seen > 1.0)) or now > deadline:
                probs = []
                for g in range(n):
                    if len(probs) >= 20:  # gpu 0 may claim a huge layout: name the first 20
                        probs.append(
                            f"... (gpu 0 says replicas={n // max(1, self._tp)} tp={self._tp}: "
                            f"{n} workers, {have} registered)"
                        )
                        break
                    if ctl.check("infer/dup/%d" % g):
                        d = ctl.get_json("infer/dup/%d" % g, "a duplicate worker's note", 1)
                        w = ctl.get_json("infer/%d" % g, f"metadata of inference worker gpu {g}", 5)
                        probs.append(
                            f"inference worker gpu {g} (replica {g // max(1, self._tp)} rank "
                            f"{g % max(1, self._tp)}) registered twice: {w['host']} pid {w['pid']} "
                            f"and {d['host']} pid {d['pid']}"
                        )
                    elif not ctl.check("infer/%d" % g):
                        probs.append(
                            f"inference worker gpu {g} (replica {g // max(1, self._tp)} rank "
                            f"{g % max(1, self._tp)}) has not registered"
                        )
                head = (
                    "inference workers registered twice or missing"
                    if dups
                    else f"waited {self.timeout:.0f} s for the {n} inference workers' metadata, {have} arrived"
                )
                raise SetupError(head + ":\n  " + "\n  ".join(probs))
            time.sleep(delay)
            delay = min(delay * 2, 0.1)

    def _connect(self, transport, transport_options, watermark) -> None:
        from .. import _wxfer

        self.program = program.RankProgram.from_plan(self.plan, self.rank, self.params)
        senders = program.receivers_of(self.plan)
        # every gpu this rank writes to (data and version stamp)
        self.workers = {}
        for g in self.program.gpus:
            # its connection record (the descriptors of what this rank writes there are in the plan): a few
            # hundred bytes, where its whole record grows with its parameters (issue 24: read by every trainer)
            self.workers[g] = self.ctl.get_json("infer/%d/peer" % g, f"metadata of inference worker gpu {g}")
        names = {(w["transport"], json.dumps(w["options"], sort_keys=True)) for w in self.workers.values()}
        if len(names) > 1:
            raise SetupError(f"inference workers use different transports: {sorted(names)}")
        if names:
            tname, topts = names.pop()
            topts = dict(json.loads(topts), **(transport_options or {}))
            if transport not in ("auto", tname):
                raise SetupError(
                    f"transport={transport!r} but the inference workers registered their memory with {tname!r}"
                )
        else:
            tname, topts = transport_choice(transport, self.device.type, transport_options)
        topts = gpu_memory_options(tname, self.device, writer_options(tname, topts, os.environ, transport_options))
        if tname == "cuda_ipc":
            import socket

            far = sorted(g for g, w in self.workers.items() if w.get("host") != socket.gethostname())
            if far:
                raise SetupError(
                    f"transport cuda_ipc joins GPUs of one host, but inference worker gpu {far[0]} is on "
                    f"{self.workers[far[0]].get('host')!r} and trainer rank {self.rank} on "
                    f"{socket.gethostname()!r}; give the receivers transport='verbs' or 'fabric' "
                    "(or set WXFER_TRANSPORT there)"
                )
        self.transport_name = tname
        self.transport = _wxfer.Transport(tname, topts)
        # isolate: a receiver that fails or stops answering fails alone; the others get their bytes
        self.engine = _wxfer.Engine(self.transport, watermark=self.watermark, timeout=self.write_timeout, isolate=True)
        # the version stamps' sources live in host memory (pinned with CUDA): filled without
        # a device synchronize; the engine's fences order them around the step's data writes
        self.stamp_src = _host_int64(self.device)
        self.begin_src = _host_int64(self.device)
        self._stamp_dest = {}
        self._begin_dest = {}
        self.peers = {}
        for g, w in self.workers.items():  # all requests first, then the replies
            self.peers[g] = control.writer_request(self.ctl, self.transport, self.rank, g, _unb64(w["export"]))
        for g, w in self.workers.items():
            control.writer_finish(self.ctl, self.transport, self.rank, g, self.peers[g])
            self._stamp_dest[g] = (_unb64(w["stamp"]), 8 * senders[g].index(self.rank), 0, 8)
            self._begin_dest[g] = (_unb64(w["stamp"]), w["stamp_begin"] + 8 * senders[g].index(self.rank), 0, 8)
        self.task_names = {op.task: op.name for ops in self.program.groups for op in ops}
        self.task_params = {op.task: len(op.sources) for ops in self.program.groups for op in ops}
        self._prepare_tasks()
        self._gpu_of_peer = {pid: g for g, pid in self.peers.items()}
        self._gpu_of_region = {
            decode_param_descriptor(d)[0]: g for (g, _), d in self.plan.descriptors.items() if g in self.workers
        }
        self._epoch = {g: 0 for g in self.workers}
        self._rejoins_seen = 0
        self._refused = {}  # gpu -> why its restarted worker was not taken (reported once)
        self.rejoined = 0  # restarted workers taken so far

    def _prepare_tasks(self) -> None:
        """Per task, once: how its sources are gathered, zero copy or not, what it holds
        (prepare.TaskPrep); warn about a parameter the watermark cannot hold.  (A zero-copy
        task's source is registered at the first push: prepare.zero_copy_task.)"""
        import warnings

        over = []
        for ops in self.program.groups:
            for op in ops:
                op.prep = prepare.task_prep(op, self.device)
                nb, name = op.prep.largest
                if self.watermark and op.sends and op.prep.held and nb > self.watermark:
                    over.append((nb, name, op.prep.held))
        for nb, name, held in sorted(over, reverse=True)[:20]:
            warnings.warn(
                f"wxfer: training parameter {name} ({nb} bytes) is larger than the watermark "
                f"({self.watermark} bytes) on trainer rank {self.rank}: its task ({held} bytes) is "
                "admitted alone, so a push's extra GPU memory can reach the watermark plus that "
                "task's buffer",
                stacklevel=3,
            )

    @property
    def stamp_dests(self) -> list:
        return list(self._stamp_dest.values())

    # ------------------------------------------------------------------ per step
    @property
    def bytes_per_step(self) -> int:
        """Bytes of weights this rank writes per push (version stamps not counted)."""
        return self.program.bytes_per_step

    def push(self, async_op: bool = False, version: int | None = None, verify: bool | None = None):
        """Replay the plan for the current weights.  Returns the seconds it took, or with
        ``async_op=True`` a PushHandle (call ``wait()`` before the weights change again).

        verify (default: $WXFER_VERIFY=1): checksum every write's source bytes here, and once
        they landed ask every receiver written to for the checksum of what it holds there;
        any mismatch raises wxfer.runtime.verify.VerifyError naming the worker, parameter and bytes."""
        if not self._lock.acquire(blocking=False):
            raise RuntimeError(
                f"wxfer: trainer rank {self.rank}: push() called while another push() (or "
                "PushHandle.wait()) of this Sender is running in another thread; one step at "
                "a time (the trainer ranks' collectives and the version stamps are per step)"
            )
        try:
            return self._push(async_op, version, verify)
        finally:
            self._lock.release()

    def _push(self, async_op, version, verify):
        import torch

        if self._pending is not None and not self._pending.done():
            self._pending.wait()
        self._verify = verify_enabled(verify)
        self._sums = {} if self._verify else None
        self.version = self.version + 1 if version is None else int(version)
        t0 = time.perf_counter()
        ph = self.last_phases = {}
        self._adopt_rejoins()  # before the begin stamps: a replaced worker is not written at all
        ph["rejoin_check"] = time.perf_counter() - t0
        keep = []  # CUDA events must outlive the engine's wait on them
        barrier = None
        ev = None
        at = (0, -1)  # (mesh group, task) reached: a failure drains the collectives from there
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            ev = torch.cuda.Event()  # what the zero-copy writes wait for
            ev.record(self.stream)
            keep.append(ev)
        try:
            self._write_begin(self.version)
            ph["begin_stamps"] = time.perf_counter() - t0
            with torch.no_grad(), torch.cuda.stream(self.stream) if self.stream is not None else _nullcontext():
                for gi, ops in enumerate(self.program.groups):
                    if barrier is not None:
                        barrier.wait(self.timeout)
                    batch, held = [], 0  # zero-copy tasks, handed to the engine in one call; their bytes
                    for oi, op in enumerate(ops):
                        at = (gi, oi)
                        if self._direct_copy(op):  # small: one batched copy into the receivers
                            continue
                        fast = self._fast_task(op)
                        if fast is not None:
                            batch.append(fast)
                            held += op.nbytes
                            if len(batch) >= FAST_BATCH or held >= FAST_BATCH_BYTES:
                                self._submit_fast(batch, ev)
                                batch, held = [], 0
                            continue
                        if batch:
                            at = (gi, oi - 1)  # a failure here: task oi's collectives are still to drain
                            self._submit_fast(batch, ev)
                            batch, held = [], 0
                            at = (gi, oi)
                        self._run_task(op, ev)
                    if batch:
                        self._submit_fast(batch, ev)
                    self._direct_copy_flush()
                    # stage 4: the barrier overlaps this group's writes
                    at = (gi, len(ops))
                    barrier = control.Barrier(
                        self.group, f"the barrier after mesh group {gi} (trainer rank {self.rank}, step {self.version})"
                    )
                    at = (gi + 1, -1)
        except Exception as e:
            self._direct_abandon()  # its direct writes land before this push raises
            own = f"{type(e).__name__}: {e}"
            log.error("trainer rank %d: step %d failed while submitting: %s", self.rank, self.version, own)
            self._mark(
                set(self.workers) - self._dropped(),
                self.version,
                f"trainer rank {self.rank} gave up on step {self.version} half written: {own}",
                final=False,
            )
            self._join_failed(e, own, barrier, at)
            raise
        except BaseException as e:  # KeyboardInterrupt, SystemExit: record, no collectives
            self._direct_abandon()
            log.warning("trainer rank %d: step %d stopped: %s", self.rank, self.version, type(e).__name__)
            self._mark(
                set(self.workers) - self._dropped(),
                self.version,
                f"trainer rank {self.rank} stopped in step {self.version}: {type(e).__name__}",
            )
            raise
        end_ev = None
        if self.stream is not None:
            end_ev = torch.cuda.Event()  # the end stamps wait for the side stream's work
            end_ev.record(self.stream)
            keep.append(end_ev)
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        self.last_submit_s = ph["submit"] = time.perf_counter() - t0
        h = PushHandle(self, self.version, t0, barrier, keep)
        h._end_event = end_ev
        self._pending = h
        if async_op:
            return h
        return h.wait()

    def verify(self, timeout: float | None = None) -> dict:
        """Check again that every receiver holds what the last push sent (checksums of the
        last push made with verify on).  Raises VerifyError listing any mismatch."""
        if not self._last_sums:
            raise RuntimeError("wxfer: Sender.verify() needs a previous push(verify=True)")
        from .verify import request

        return request(
            self.ctl,
            self.rank,
            self.version,
            self._last_sums,
            self.workers,
            self.write_timeout if timeout is None else timeout,
        )

    def _wait_engine(self, timeout, what, fence=None) -> None:
        """Engine.wait (fence: only until that fence task finished), its failure raised as this
        rank's step error saying `what` it waited for."""
        try:
            self.engine.wait(timeout=timeout, fence=fence)
        except Exception as e:
            self.engine.clear_error()
            raise RuntimeError(
                f"wxfer: trainer rank {self.rank}, step {self.version}: {what}: {self._describe(e)}"
            ) from e

    def _describe(self, err: BaseException) -> str:
        """The user's message for an engine failure: the engine's own, and from its fields
        (wxfer.Error.tag, .peer) the plan task and the inference worker it concerns."""
        msg = str(err)
        tag, peer = getattr(err, "tag", None), getattr(err, "peer", None)
        if tag is not None and tag in self.task_names:
            msg += f" [plan task {tag}: {self.task_names[tag]}]"
        elif tag == STAMP_TAG:
            msg += " [the version stamps]"
        if peer is not None and peer in self._gpu_of_peer:
            msg += f" [peer {peer} is {self._worker_name(self._gpu_of_peer[peer])}]"
        return msg

    def _worker_name(self, g: int) -> str:
        w = self.workers.get(g, {})
        return (
            f"inference worker gpu {g} (replica {w.get('replica')} rank {w.get('rank')}, "
            f"{w.get('host')} pid {w.get('pid')})"
        )

    # ------------------------------------------------------------------ inspection
    def trace(self, clear: bool = False):
        return self.engine.trace(clear=clear)

    def host_times(self, records=None) -> dict:
        """Host time of the push loop's stages 1-2 per task and per parameter, from the
        engine trace (default: the records so far; wxfer.runtime.trace.host_times)."""
        from .trace import host_times

        recs = self.trace() if records is None else records
        return host_times(recs, self.task_params, skip_tags={STAMP_TAG})

    def write_trace(self, path: str) -> None:
        from .trace import write_chrome

        write_chrome(self.trace(), path, pid=self.rank, name=f"wxfer trainer rank {self.rank}")

    def stats(self) -> dict:
        s = dict(self.engine.stats())
        s.update(
            rank=self.rank,
            bytes_per_step=self.bytes_per_step,
            receivers=list(self.workers),
            rejoined=self.rejoined,
            last_submit_s=self.last_submit_s,
            last_phases=dict(self.last_phases),
            transport=self.transport_name,
            setup_s=self.setup_s,
            quantizer=_quantizer_stats(self.device),
            direct=self._direct_stats(),
        )
        return s

    def close(self) -> None:
        if getattr(self, "job", None) is not None:
            self.job["stop"].set()  # its lease ends: a later job may take the name
        if self._pending is not None and not self._pending.done():
            try:
                self._pending.wait()
            except Exception:  # noqa: BLE001
                pass
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        self._direct_close()  # the views of the receivers' memory, before the transport unmaps it
        for ops in getattr(getattr(self, "program", None), "groups", ()):
            for op in ops:
                if op.prep is not None:
                    op.prep.fast = None  # the zero-copy Regions, released before their transport
        if self.transport is not None:
            self.transport.close()
            self.transport = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _host_int64(device):
    """One int64 in host memory (pinned when `device` is CUDA): a version stamp's source."""
    import torch

    t = torch.zeros(1, dtype=torch.int64)
    return t.pin_memory() if device.type == "cuda" else t


def _quantizer_stats(device) -> dict:
    """Which FP8 quantizer ran last in this process and why (fp8.last()), else which one would
    run on `device` (without compiling the kernel just for this), with the call counts."""
    from . import fp8

    d = fp8.info(device, probe=False)
    ran = fp8.last()
    if ran is not None:
        d.update(ran)
    return d


def _nullcontext():
    import contextlib

    return contextlib.nullcontext()
