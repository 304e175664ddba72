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
not wait for them, except a push with in-place tasks at its first, inplace.py), then replays
the plan: for each mesh group, for each task of this rank in order, H2D (offloaded FSDP) ->
full_tensor() + fusion + FP8 + packing -> Engine.submit (or straight into the receivers'
memory on cuda_ipc, inplace.py: external engine tasks); an asynchronous gloo barrier after
the group's last full_tensor(); then its *end* stamp into every receiver it wrote to, a fence
task posted once every task of the step before it finished, the in-place writes included
(Receiver.version() counts a step only where begin == end).  A
receiver this rank gives up on, or a step it abandons half written, is recorded in the
store (torn/<gpu>/e<epoch>/<i>) for Receiver.state().  A failure seen by any rank, raised
anywhere inside push(), is raised on every rank (the same barriers, then one gloo
all-reduce of a flag per push, are joined on every path).  One push() at a time per
Sender: a second one from another thread is refused.  An inference worker restarted at any
moment is connected by the first push() that starts after its record is complete (and seen by
this rank's watcher, links.WATCH_S) and written from then on; a push in flight finishes
without it.

The Sender is composed of one collaborator per concern, each made in ``__init__`` from what it
needs (not the Sender) and testable alone (tests/test_sender_parts.py): ``Links`` (links.py),
``InPlaceWriter`` (inplace.py), ``TaskRunner`` (tasks.py), ``FailureExchange`` (failures.py)
and ``StepLoop`` (steps.py); rank 0's plan at setup is controller.py's.
"""

from __future__ import annotations

import json
import logging
import threading
import time

from . import control, inplace, jobs, liveness, program, setup_waits
from .control import Control, SetupError
from .controller import build_plan, linger, mapping_digest
from .failures import FailureExchange
from .links import Links
from .isolation import warn_fault_isolation
from .receiver import capabilities, gpu_memory_options, transport_choice
from .steps import PushHandle, StepLoop
from .tasks import STAMP_TAG, TaskRunner
from .verify import verify_enabled

__all__ = ["STAMP_TAG", "PushHandle", "Sender", "task_bound", "writer_options"]

log = logging.getLogger(__name__)


def _held(part: str, name: str, doc: str | None = None) -> property:
    """A read-only Sender property that is its collaborator `part`'s attribute `name`."""
    return property(lambda self: getattr(getattr(self, part), name), doc=doc)


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


def writer_options(tname: str, topts: dict, given: dict | None = None) -> dict:
    """The options a trainer opens transport `tname` with, from the receivers' published ones
    (`given`: this rank's own transport_options, merged into them).

    What names the receivers' own host does not travel: the backend's declared host options
    (fabric's `iface`: their NIC, the trainer's own is its default, $WXFER_IFACE read by the
    backend; verbs' GPU check `gpu`, `gpu_memory`: this rank checks for its own memory),
    unless `given` sets them."""
    own = set(capabilities(tname).get("host_options", ()))
    return {k: v for k, v in topts.items() if k not in own or k in (given or {})}


class Sender:
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
    direct (default $WXFER_DIRECT, on; the in-place writes, kept by that name): on cuda_ipc, a
    packed task whose destinations are all mapped on this rank's GPU (receivers colocated on
    it) is packed and FP8-quantized straight into the receivers' memory, in place, with no
    send buffer and no copy (wxfer.runtime.inplace; ``stats()["direct"]`` counts them); False:
    every packed task through a send buffer.
    copy_max (default $WXFER_DIRECT_COPY_MAX, else 32 MiB): with in-place writes on cuda_ipc, a
    zero-copy task of fewer bytes than this whose destinations are all mapped here is copied
    straight into the receivers' memory by batched copy kernels instead of one engine write
    each: bytes (an int or e.g. "1MiB"); 0: never; "all" or -1: no upper bound (every such
    task).  ``stats()["direct"]["copy_max"]`` is the bound in use (-1: none).
    max_task_bytes (default: half the watermark, 16 MiB .. 1 GiB, `task_bound`): the plan's
    bound on a task's training bytes (rank 0's is used); 1: every component its own task
    (``python -m wxfer calibrate`` probes fine and coarse tasks this way).
    delta (default False; issue 36, docs/delta.md): keep a shadow of what this rank last wrote
    (its share in the destination's format) and send per task only the bytes that changed, as
    records into the receivers' staging areas (``Receiver(delta_staging=...)``, applied by
    ``Receiver.apply()``), or dense where that is cheaper or the receiver is not in step (the
    first push, after a failure, a restart).  The shadow's bytes count against the watermark
    (setup fails when they leave less than the largest task); in-place writes serve only the
    tasks that bypass the delta writer (colocated on a GPU: docs/delta.md).
    ``stats()["delta"]`` reports the shadow, the bytes and the choices of the last push.  A dict
    instead of True sets the chooser's inputs: {"link_Bps": bytes/s, "measure_link": False}
    pins the link throughput (default: measured from the last all-dense push), "costs" the
    encode/apply/scatter throughputs (default: timed at setup), "scatter" ("auto", "force" or
    "off"; wxfer.runtime.delta_scatter) whether on cuda_ipc a task's changed bytes may be stored
    straight into the receivers' mapped memory by a kernel of this rank: "auto" where cheapest,
    "force" for every task mapped here (colocated ones too, which otherwise bypass delta).

    Composed of collaborators made at setup, each in its own module: ``links`` (the inference
    workers written, their connections, the failed ones, restarts taken), ``inplace`` (the
    in-place writes), ``runner`` (one task's submission, the version stamps, verify's
    checksums), ``failures`` (torn records, the trainers' failure flag) and ``steps`` (one
    push: the task loop and its end).
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
        delta: bool = False,
    ):
        import torch
        import torch.distributed as dist

        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.timeout = float(timeout)
        self.write_timeout = float(write_timeout)
        self.version = 0
        self._lock = threading.RLock()  # push() / PushHandle.wait(): one step at a time
        if max_task_bytes is not None and (isinstance(max_task_bytes, bool) or int(max_task_bytes) < 1):
            raise ValueError(f"wxfer.Sender: max_task_bytes must be an int >= 1 or None, got {max_task_bytes!r}")
        # checked before anything is set up; with delta, in-place writes serve only the tasks that
        # bypass the delta writer (colocated: DeltaWriter.bypass)
        in_place = inplace.options(direct, copy_max)
        self.delta_on = _delta_option(delta)
        self.delta = None  # wxfer.runtime.delta_send.DeltaWriter (delta=True), made at connect
        self.shadow_bound = 0  # bytes of the delta shadow counted against the watermark
        if device is None:
            device = (
                torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
            )
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.group = control.gloo_group(timeout)
        host_store = _host_store(host_store, self.rank, store)
        st = control.resolve_store(store, host_store, timeout, bind=store_bind)
        self.ctl = Control(st, name, timeout, control.job_secret(secret))
        # this job's generation of `name` in the store (issue 25.5): rank 0 claims it (a lease)
        self.ctl, self.job = jobs.join(self.ctl, self.group, self.rank, name, self.timeout)
        self._store_host = host_store
        self._hosted = store is None or host_store  # a trainer process hosts the store
        self.phase = setup_waits.Phase(self.timeout)  # each setup phase within 1.1x timeout (issue 25.7)
        self.mapping = mapping
        self.watermark = _parse_size(watermark)
        self.max_task_bytes = task_bound(self.watermark) if max_task_bytes is None else int(max_task_bytes)
        t0 = time.perf_counter()
        self._lease = None
        try:
            self.params = self._publish(model, mapping)
            self.plan = self._receive_plan(mapping)
            self.setup_s = {"plan": time.perf_counter() - t0}
            t1 = time.perf_counter()
            self.program, self.transport_name, self.transport, self.engine, self.links, self.inplace, self.runner = (
                self._connect_phase(transport, transport_options, in_place)
            )
        except BaseException as e:
            self._stop_leases()  # a failed setup: no more pushes from this rank, nor this job
            if not isinstance(e, Exception):  # Ctrl-C, SystemExit: the other ranks are told (issue 35.8)
                setup_waits.tell_stopped(self.ctl, self.rank, e)
            raise
        self.setup_s["connect"] = time.perf_counter() - t1
        self.failures, self.steps = self._step_parts()
        self._delta_part()
        self._log_ready()

    # ------------------------------------------------------------------ setup
    def _delta_part(self) -> None:
        """delta=True: the DeltaWriter (delta_send.py), which the StepLoop runs every task through."""
        if self.delta_on:
            from .delta_send import DeltaWriter

            opts = self.delta_on if isinstance(self.delta_on, dict) else {}
            self.delta = DeltaWriter(
                self.engine, self.device, self.stream, self.rank, self.links, self.runner, self.ctl, **opts
            )
            self.steps.delta = self.delta

    def _step_parts(self) -> tuple:
        """(FailureExchange, StepLoop) over the collaborators made at connect."""
        # what both take first: the store, the trainer group, this rank's place, the bounds
        job = (self.ctl, self.group, self.rank, self.world, self.timeout, self.write_timeout)
        failures = FailureExchange(*job, self._store_host, self.links, program.receivers_of(self.plan))
        return failures, StepLoop(
            *job,
            self.device,
            self.stream,
            self.engine,
            self.program,
            self.links,
            self.runner,
            self.inplace,
            failures,
        )

    def _publish(self, model, mapping) -> dict:
        """Setup step 1: this rank's metadata (and the mapping it was given: every rank's must
        agree), its verdict agreed among the ranks; returns the model's parameters."""
        err, params = None, {}
        try:
            self.ctl.set_json("train/%d/mapping" % self.rank, mapping_digest(mapping))
            self._lease_start()
            if hasattr(model, "reshard"):
                model.reshard()  # FSDP2: the sharded DTensor parameters, even after a no-grad forward
            params = {n: p for n, p in model.named_parameters()}
            self.ctl.set_json("train/%d" % self.rank, program.train_metadata(model))
        except Exception as e:  # noqa: BLE001
            err = f"{type(e).__name__}: {e}"
        control.agree(self.group, err, self.rank, "publishing training metadata", self.timeout)
        return params

    def _lease_start(self) -> None:
        """This rank's lease (a Python thread, liveness.Lease) and its record for the workers it
        writes: they learn of its death between pushes by its pid or its lease (issue 25 item 6)."""
        key, every = liveness.trainer_lease_key(self.rank), liveness.lease_interval()
        self._lease = liveness.Lease(self.ctl, key, every)
        extra = dict(liveness.identity(), lease_s=every, lease_key=key, write_timeout=self.write_timeout)
        control.publish_who(self.ctl, self.rank, extra)

    def _stop_leases(self) -> None:
        """This rank's lease (its workers then see it gone) and, on rank 0, the job's (a later
        job may then take the name)."""
        if self._lease is not None:
            self._lease.stop()
            self._lease = None
        if self.job is not None:
            self.job["stop"].set()

    def _receive_plan(self, mapping):
        """Setup step 2: rank 0 builds the plan; every rank receives it (or the error), checks
        it and agrees on it, within 1.1x timeout."""
        self.phase.start()
        if self.rank == 0:
            try:
                build_plan(self.ctl, self.world, mapping, self.timeout, self.max_task_bytes)
            except SetupError as e:
                log.error("trainer rank 0: building the plan failed: %s", e)
                # the store lives in this process: before raising (and maybe exiting) let the
                # other ranks and the registered receivers read the error from it
                self._linger("plan/acks", self.world - 1, "status/acks", None)
                if self.world > 1:  # the others agree on the plan: they raise this reason
                    setup_waits.join_refusal(self.group, str(e), self.phase.left(self.timeout))
                raise
        # a little longer than rank 0's wait for the receivers: this rank reads rank 0's reason
        err = None
        try:
            data = self.ctl.get(
                "plan",
                "the plan from trainer rank 0 (controller)",
                setup_waits.PLAN_WAIT * self.timeout,
                abort=setup_waits.STOPPED,
                abort_where="another trainer rank",
            )
        except SetupError as e:  # its record fails authentication: agreed on below, every rank told
            data, err = b"", str(e)
        if self.rank:  # (rank 0, when it failed, lingers for the receivers, then joins load_plan's agreement)
            self.ctl.add("plan/acks", 1)
        return setup_waits.load_plan(  # decoded, checked and agreed on every rank
            self.ctl, self.group, self.rank, self.timeout, data, lambda n: self._linger(None, 0, "setup/acks", n), err
        )

    def _linger(self, trainer_key, trainers, recv_key, receivers) -> None:
        """After a setup error, within this setup phase's bound (controller.linger)."""
        linger(self.ctl, self._hosted, self.timeout, trainer_key, trainers, recv_key, receivers, self.phase)

    def _connect_phase(self, transport, transport_options, in_place) -> tuple:
        """Setup step 3 on every rank; its verdict (every rank's errors) reaches every rank
        through gloo and every receiver through the store key `setup`.  Returns _connect's."""
        self.phase.start()
        err, parts = None, None
        try:
            parts = self._connect(transport, transport_options, in_place)
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
        return parts

    def _connect(self, transport, transport_options, in_place) -> tuple:
        """This rank's program, transport, engine and connections: (program, transport name,
        transport, engine, Links, InPlaceWriter, TaskRunner)."""
        from .. import _wxfer

        prog = program.RankProgram.from_plan(self.plan, self.rank, self.params)
        # every gpu this rank writes to (data and version stamp): its connection record (the descriptors of
        # what this rank writes there are in the plan): a few hundred bytes, where its whole record grows
        # with its parameters (issue 24: read by every trainer)
        workers = {}
        for g in prog.gpus:
            workers[g] = self.ctl.get_json("infer/%d/peer" % g, f"metadata of inference worker gpu {g}")
        tname, topts = self._transport_for(workers, transport, transport_options)
        warn_fault_isolation(tname, topts, f"wxfer.Sender trainer rank {self.rank}")
        tr = _wxfer.Transport(tname, topts)
        # isolate: a receiver that fails or stops answering fails alone; the others get their bytes
        engine = _wxfer.Engine(tr, watermark=self._engine_watermark(prog), timeout=self.write_timeout, isolate=True)
        links = Links(self.ctl, tr, self.rank, self.plan, prog, workers, self.write_timeout)
        links.connect()
        links.start_watch()  # restarts and deaths looked at between pushes: a push reads a flag (issue 37)
        ip = inplace.InPlaceWriter(*in_place, self.device, self.stream, tr, tname, engine, links)
        runner = TaskRunner(engine, tr, self.device, self.stream, self.rank, prog, links, ip, self.write_timeout)
        runner.prepare_all(self.watermark)
        return prog, tname, tr, engine, links, ip, runner

    def _engine_watermark(self, prog) -> int:
        """The engine's watermark: the Sender's, less the delta shadow's bytes (at most this
        rank's bytes per step) when delta is on; a shadow that leaves less room than the largest
        task is refused, naming both."""
        if not self.delta_on or not self.watermark:
            return self.watermark
        self.shadow_bound = sum(op.nbytes for ops in prog.groups for op in ops if op.sends)
        largest = max([op.nbytes for ops in prog.groups for op in ops if op.sends] or [0])
        left = self.watermark - self.shadow_bound
        if left < largest:
            raise SetupError(
                f"wxfer.Sender(delta=True): trainer rank {self.rank}: the delta shadow takes "
                f"{self.shadow_bound} bytes of the watermark ({self.watermark} bytes), leaving "
                f"{left}, less than the largest task ({largest} bytes); raise watermark to at least "
                f"{self.shadow_bound + largest}"
            )
        return left

    def _transport_for(self, workers: dict, transport, transport_options) -> tuple:
        """(name, options) of the transport this rank writes `workers` with."""
        names = {(w["transport"], json.dumps(w["options"], sort_keys=True)) for w in workers.values()}
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
        topts = gpu_memory_options(tname, self.device, writer_options(tname, topts, transport_options))
        if capabilities(tname).get("same_host"):
            import socket

            far = sorted(g for g, w in workers.items() if w.get("host") != socket.gethostname())
            if far:
                raise SetupError(
                    f"transport {tname} joins GPUs of one host, but inference worker gpu {far[0]} is on "
                    f"{workers[far[0]].get('host')!r} and trainer rank {self.rank} on "
                    f"{socket.gethostname()!r}; give the receivers transport='verbs' or 'fabric' "
                    "(or set WXFER_TRANSPORT there)"
                )
        return tname, topts

    def _log_ready(self) -> None:
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

    # ------------------------------------------------------------------ what the collaborators hold
    workers = _held("links", "workers", "{gpu: record} of the inference workers this rank writes.")
    peers = _held("links", "peers", "{gpu: engine peer id} of those workers.")
    rejoined = _held("links", "rejoined", "Restarted inference workers taken so far.")
    stamp_dests = property(lambda self: list(self.links.stamp_dest.values()))
    task_names = _held("runner", "task_names")
    task_params = _held("runner", "task_params")
    last_verify = _held("runner", "last_verify", "What the receivers answered for the last push made with verify on.")
    last_submit_s = _held("steps", "last_submit_s")
    last_phases = _held("steps", "last_phases", "Seconds from the start of the last push() to the end of each phase.")
    bytes_per_step = _held(
        "program", "bytes_per_step", "Bytes of weights this rank writes per push (stamps not counted)."
    )

    @property
    def direct(self) -> bool:
        """Whether in-place writes are on (the ``direct`` argument; settable, kept by that name)."""
        return self.inplace.enabled

    @direct.setter
    def direct(self, on: bool) -> None:
        self.inplace.switch(on)

    # ------------------------------------------------------------------ per step
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
            self.steps.settle()
            on = verify_enabled(verify)
            self.version = self.version + 1 if version is None else int(version)
            h = self.steps.push(self.version, on, self._run_task, self._lock)
            return h if async_op else h.wait()
        finally:
            self._lock.release()

    def _run_task(self, op, push_event) -> None:
        """One task of a push (TaskRunner.run_task, or the delta writer's; the hook a test may wrap)."""
        if self.delta is not None and not self.delta.bypassed(op):
            self.delta.run_task(op, push_event)
        else:  # a plain push's task (delta: one the StepLoop let bypass the delta writer)
            self.runner.run_task(op, push_event)

    def task_kinds(self) -> dict:
        """{plan task: kind} of this rank's tasks, as it runs them (TaskRunner.task_kinds)."""
        return self.runner.task_kinds()

    def task_choices(self) -> dict:
        """{plan task: wxfer.taskpath.Choice}: task_kinds with the reason of each."""
        return self.runner.task_choices()

    def verify(self, timeout: float | None = None) -> dict:
        """Check again that every receiver holds what the last push sent (checksums of the
        last push made with verify on).  Raises VerifyError listing any mismatch."""
        if not self.runner.last_sums:
            raise RuntimeError("wxfer: Sender.verify() needs a previous push(verify=True)")
        from .verify import request

        return request(
            self.ctl,
            self.rank,
            self.version,
            self.runner.last_sums,
            self.workers,
            self.write_timeout if timeout is None else timeout,
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
            direct=dict(self.inplace.stats(), begin=self.runner.begin_order()),
            watcher=self.links.watch_trouble(),  # None while the watcher's store looks pass
        )
        if self.delta is not None:
            s["delta"] = dict(self.delta.stats(), shadow_bound=self.shadow_bound, watermark=self.watermark)
        return s

    def close(self) -> None:
        try:
            self.steps.settle()
        except Exception:  # noqa: BLE001
            pass
        self._stop_leases()  # close() means no more pushes
        self.links.close()
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        if getattr(self, "runner", None) is not None:
            self.runner.close()  # the begin stamps' fence word kept until no stream waits on it
        self.inplace.close()  # the views of the receivers' memory, before the transport unmaps it
        for ops in self.program.groups:
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


def _host_store(host_store, rank: int, store) -> bool:
    """Whether this rank hosts the store: `host_store` as given (True / False, or 1 / 0), or, when
    None, rank 0 when no store is given."""
    if host_store is None:
        return rank == 0 and store is None
    if host_store not in (True, False):
        raise TypeError(f"wxfer.Sender: host_store must be True, False or None, got {host_store!r}")
    return bool(host_store)


def _delta_option(delta):
    """Sender(delta=...): False, True, or a dict of the delta writer's options (link_Bps,
    measure_link, costs, scatter: wxfer.runtime.delta_send.DeltaWriter)."""
    if isinstance(delta, dict):
        bad = set(delta) - {"link_Bps", "measure_link", "costs", "scatter"}
        if bad:
            raise ValueError(
                f"wxfer.Sender: delta options {sorted(bad)} unknown (link_Bps, measure_link, costs, scatter)"
            )
        if "scatter" in delta:
            from .delta_scatter import mode_option

            mode_option(delta["scatter"])  # checked before anything is set up
        return dict(delta)
    if delta not in (True, False, 0, 1):
        raise TypeError(f"wxfer.Sender: delta must be True, False or a dict of options, got {delta!r}")
    return bool(delta)


def _quantizer_stats(device) -> dict:
    """Which FP8 quantizer ran last in this process and why (fp8.last()), else which one would
    run on `device` (without compiling the kernel just for this), with the call counts."""
    from . import fp8

    d = fp8.info(device, probe=False)
    ran = fp8.last()
    if ran is not None:
        d.update(ran)
    return d
