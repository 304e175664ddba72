"""The inference side: register weight memory once, publish metadata, answer the trainers'
connection handshakes during setup, and then run nothing per step.

    recv = wxfer.Receiver(model.named_parameters(), mapping="qwen3-8b", store="host:29650",
                          replica=0, rank=tp_rank, tp=2, replicas=4)
    ...
    recv.version()   # the training step whose weights are fully in place (-1: none yet)

Memory is registered per storage (or, on CUDA with ``register="segments"``, per caching
allocator segment), deduplicated, so parameters that share memory cost one registration.
Each parameter's descriptor is (byte offset in its region, the region's descriptor); the
trainers add the plan's destination offsets to it.

Version stamps (a seqlock per writing trainer): two int64 slots per sending trainer rank,
in registered memory next to the weights.  A sender writes step N into its *begin* slot,
and waits until that write has landed, before its first data write of step N; it writes N
into its *end* slot only after all its data writes of step N have landed.  ``version()``
is the step whose weights are all in place: the minimum end stamp when every sender's
begin equals its end, else -1 (some sender is writing, or gave up, or died, mid-step).
``state()`` says which, with the trainers' word from the store ("torn/<gpu>/..."): a
trainer that gives up on this worker (or on a step) records it there, so a worker the
trainers dropped learns it at its next ``state()`` / ``wait_version()``.
"""

from __future__ import annotations

import base64
import logging
import socket
import struct
import time

from .. import envs
from . import alias, control, digest, jobs, liveness
from .control import Bounded, Control, SetupError
from .isolation import warn_fault_isolation
from .transport_opts import (  # noqa: F401 -- imported from here by sender, tools and tests
    capabilities,
    transport_choice,
    gpu_memory_options,
    registration_info,
    _storage_base,
    _CudaRange,
    _segment_bases,
)

_DESC_HEAD = struct.Struct("<Q")
STATE_STORE_S = 1.0  # state() waits for the trainers' store at most this long (then answers without it)
log = logging.getLogger(__name__)


class TornError(RuntimeError):
    """The weights here are not a complete step and will not become one without a new
    push to this worker: a trainer gave up or died in the middle of writing them, or the
    trainers dropped this worker (``Receiver.state()`` says which)."""


def encode_param_descriptor(region_descriptor: bytes, offset: int) -> bytes:
    return _DESC_HEAD.pack(offset) + bytes(region_descriptor)


def decode_param_descriptor(data: bytes) -> tuple[bytes, int]:
    if len(data) < _DESC_HEAD.size + 1:
        raise ValueError("wxfer: parameter descriptor too short (%d bytes)" % len(data))
    (off,) = _DESC_HEAD.unpack_from(data)
    return bytes(data[_DESC_HEAD.size :]), off


def _b64(b: bytes) -> str:
    return base64.b64encode(bytes(b)).decode()


def _unb64(s: str) -> bytes:
    return base64.b64decode(s.encode())


def _dtype_name(dt) -> str:
    return str(dt).replace("torch.", "")


class Receiver:
    """Register `named_parameters` (inference layout) for one-sided writes and publish them.

    named_parameters: iterable of (name, tensor) or a dict; every tensor contiguous.  Two
    names over the same bytes are refused naming both, but for a tie the mapping declares
    (``tie_word_embeddings``: lm_head.weight is the embedding), written once through the
    kept name (``stats()["tied"]``); a parameter of no elements is left out
    (``stats()["empty"]``).
    mapping: the preset name (or Preset) the trainers use; checked against theirs.
    store: a torch Store, "host:port", or None ($WXFER_STORE / $MASTER_ADDR:$WXFER_STORE_PORT).
    replica, rank: this worker's replica index and TP rank; tp, replicas: the layout.
    The constructor returns once every trainer that writes here has connected and the
    trainers' connect phase is over (bounded by `timeout`); setup errors of any trainer
    rank (planning or connecting) are raised here too.  secret (default
    $WXFER_SECRET): the trainers' job secret; every store record is then authenticated.

    A worker started again for a (replica, rank) after the trainers' setup (a restart)
    registers anew and replaces the previous one: the trainers connect to it at their
    next push() and write there from then on, with the plan unchanged for every other
    worker.  Its parameters must match the first worker's (names, shapes, dtypes) and
    the constructor waits for that next push, however far off, as long as the trainer job
    lives (its lease) and each trainer rank writing here does (its pid, its lease), or at
    most `rejoin_timeout` seconds where given; SetupError naming what it waited for.

    delta_staging (bytes, an int or e.g. "64MiB"; default $WXFER_DELTA_STAGING, else 0: none):
    a registered staging area for the trainers' delta records (``Sender(delta=True)``, issue 36),
    split evenly among the trainer ranks writing here; call ``apply()`` after every push (vLLM:
    in ``finish_weight_update``) to apply them.  Without one, delta trainers write here dense.
    """

    def __init__(
        self,
        named_parameters,
        mapping=None,
        store=None,
        replica: int = 0,
        rank: int = 0,
        tp: int = 1,
        replicas: int = 1,
        ep: bool = False,
        transport: str = "auto",
        transport_options: dict | None = None,
        name: str = "default",
        timeout: float = control.DEFAULT_TIMEOUT,
        register: str = "auto",
        stamp_slots: int = 1024,
        verify: bool | None = None,
        secret=None,
        rejoin_timeout: float | None = None,
        delta_staging=0,
    ):
        if not (0 <= rank < tp) or not (0 <= replica < replicas):
            raise ValueError(f"wxfer.Receiver: replica {replica} of {replicas}, rank {rank} of tp={tp} is out of range")
        _check_stamp_slots(stamp_slots)
        # names sharing bytes: a tie the mapping knows is written once, anything else refused
        self.params, self.tied = alias.resolve(_checked_params(named_parameters), mapping)
        self.replica, self.rank, self.tp, self.replicas, self.ep = replica, rank, tp, replicas, ep
        self.gpu = replica * tp + rank
        self.timeout = float(timeout)
        self.rejoin_timeout = None if rejoin_timeout is None else float(rejoin_timeout)
        devs = {t.device for t in self.params.values()}
        if len(devs) != 1:
            raise ValueError(f"wxfer.Receiver: parameters live on several devices {sorted(map(str, devs))}")
        self.device = devs.pop()
        self.mapping_name = _mapping_name(mapping)
        self._digests(mapping)
        t_setup = time.perf_counter()
        self.ctl = Control(
            control.resolve_store(store, False, timeout), name, timeout, secret=control.job_secret(secret)
        )
        self.ctl = jobs.receiver_namespace(self.ctl, name)  # not a finished job's records (issue 25.5)
        self._open_transport(transport, transport_options)
        self._init_records()
        try:
            self._register(register, stamp_slots, delta_staging)
            self._publish()
            self._handshakes()
            self._watch_writers()
            from .verify import Checker, verify_enabled

            if verify_enabled(verify):
                self.verifier = Checker(self)
                self.verifier.start()
        except Exception as e:
            log.error("Receiver gpu %s (replica %d, tp rank %d) setup failed: %s", self.gpu, replica, rank, e)
            self.close()
            raise
        log.info(
            "Receiver ready: gpu %s, replica %d of %d, tp rank %d of %d, written by %d trainer rank(s), "
            "transport %s, %d parameters in %d region(s), setup %.3f s (register %.3f s)",
            self.gpu,
            replica,
            replicas,
            rank,
            tp,
            len(self.senders),
            self.transport_name,
            len(self.param_range),
            len(self.regions),
            time.perf_counter() - t_setup,
            self.register_s,
        )

    # ------------------------------------------------------------------ setup
    def _open_transport(self, transport, transport_options) -> None:
        from .. import _wxfer

        self.transport_name, self.transport_options = transport_choice(transport, self.device.type, transport_options)
        warn_fault_isolation(self.transport_name, self.transport_options, f"wxfer.Receiver gpu {self.gpu}")
        # opened with the GPU check for this worker's device; published without it (the
        # trainers check their own memory, and the workers' options must agree)
        try:
            self.transport = _wxfer.Transport(
                self.transport_name, gpu_memory_options(self.transport_name, self.device, self.transport_options)
            )
        except _wxfer.Error as e:
            raise SetupError(f"wxfer.Receiver gpu {self.gpu}: opening transport {self.transport_name}: {e}") from e

    def _digests(self, mapping) -> None:
        """What the trainers compare (issues 25.4, 35.6): digests of content, never skipped."""
        shapes = {n: [list(t.shape), _dtype_name(t.dtype)] for n, t in self.params.items()}
        self.params_digest = digest.of(digest.params_content(shapes))
        self.mapping_rules = digest.mapping_rules(mapping, self.tp, self.ep, digest.quant_of(shapes), self.rank)

    def _init_records(self) -> None:
        """What setup fills in, empty (close() may run after a setup that failed anywhere)."""
        self.regions = []
        self.region_base = {}  # region descriptor -> uint8 tensor over it (verify mode)
        self.param_range = {}  # name -> (region descriptor, offset, nbytes)
        self.verifier = None
        self.staging = None  # wxfer.runtime.delta.Staging (delta_staging > 0)
        import threading

        self._apply_lock = threading.Lock()  # apply(): the owner's and verify's Checker
        self.lease = None
        self.writers = None  # liveness.WriterWatch over self.senders (after the handshakes)
        self._gone: dict = {}  # trainer rank -> why it is dead (state())
        self._closed = False
        self.senders = []
        self._busy_key = self._busy_since = None
        self._marks_checked, self._last_marks = -1.0, []
        self._store_look = Bounded(self._look_store, f"Receiver gpu {self.gpu} store look")

    def _register(self, mode: str, stamp_slots: int, delta_staging=0) -> None:
        import torch

        tensors = list(self.params.values())
        seg = {}
        self.register_mode = "storages"
        if self.device.type == "cuda" and mode in ("auto", "segments"):
            try:
                seg = _segment_bases(tensors)
                self.register_mode = "segments"
            except Exception as e:  # noqa: BLE001 -- fall back to storages
                if mode == "segments":
                    raise SetupError(f"wxfer.Receiver: reading the CUDA allocator segments: {e}") from e
                self.register_mode = f"storages (segments unavailable: {type(e).__name__}: {e})"
        by_base = {}  # base address -> (region, base address)
        self.param_desc = {}
        # a parameter of no elements has no bytes to write: not registered (a transport
        # refuses an empty buffer), no descriptor; the trainers write nothing there
        self.empty = sorted(n for n, t in self.params.items() if t.numel() == 0)
        t0 = time.perf_counter()
        for n, t in self.params.items():
            if t.numel() == 0:
                continue
            sptr = t.untyped_storage().data_ptr()
            if sptr in seg:
                base, addr = seg[sptr]
            else:
                base, addr = None, sptr
            if addr not in by_base:
                if base is None:
                    base = _storage_base(t)
                try:
                    reg = self.transport.register(base, export=True)
                except Exception as e:
                    raise SetupError(
                        f"wxfer.Receiver gpu {self.gpu}: registering the memory of {n} "
                        f"({base.numel()} bytes on {t.device}): {e}"
                    ) from e
                self.regions.append(reg)
                self.region_base[bytes(reg.descriptor)] = base
                by_base[addr] = (reg, addr)
            reg, addr = by_base[addr]
            off = t.data_ptr() - addr
            if off < 0 or off + t.numel() * t.element_size() > reg.nbytes:
                raise SetupError(f"wxfer.Receiver: parameter {n} lies outside its registered region")
            self.param_desc[n] = encode_param_descriptor(reg.descriptor, off)
            self.param_range[n] = (bytes(reg.descriptor), off, t.numel() * t.element_size())
        # end stamps in [0, stamp_slots), begin stamps in [stamp_slots, 2 * stamp_slots)
        self.stamps = torch.full((2 * stamp_slots,), -1, dtype=torch.int64, device=self.device)
        self.stamp_slots = int(stamp_slots)
        self.stamp_region = self.transport.register(self.stamps, export=True)
        self.regions.append(self.stamp_region)
        self._register_staging(delta_staging)
        self.register_s = time.perf_counter() - t0
        self.n_regions = len(by_base)

    def _register_staging(self, nbytes) -> None:
        """The delta staging area (delta_staging bytes; 0: none), registered after the weights
        and stamps (its region is not in the weight regions the records name)."""
        from .delta import Staging

        if nbytes in (None, 0, "0"):
            nbytes = envs.get("WXFER_DELTA_STAGING", "0")
        if isinstance(nbytes, str):
            from .. import _wxfer

            nbytes = int(_wxfer.parse_size(nbytes)) if nbytes.strip() not in ("", "0") else 0
        if isinstance(nbytes, bool) or int(nbytes) < 0:
            raise ValueError(f"wxfer.Receiver: delta_staging must be bytes >= 0, got {nbytes!r}")
        if int(nbytes) > 0:
            self.staging = Staging(self, int(nbytes))

    def apply(self, version: int | None = None, sender: int | None = None) -> dict:
        """Apply the trainers' delta records of the last complete push (``Sender(delta=True)``):
        call it after every push, before the weights are used (vLLM: ``finish_weight_update``).
        Idempotent; does nothing while a push is being written (``version()`` is -1) or without
        a staging area.  Returns {records, bytes, changed, applied_s, version}; raises
        wxfer.runtime.delta.DeltaError when this worker missed an earlier push's records (the
        trainers then send the next push dense).  version, sender: that step's records of that
        trainer rank alone, whether or not the step is complete (verify's Checker: they landed)."""
        if self.staging is None:
            return dict(records=0, bytes=0, changed=0, applied_s=0.0, version=self.version())
        with self._apply_lock:
            regions = [self.region_base[bytes(r.descriptor)] for r in self.regions[:-1]]
            return self.staging.apply(regions, version, sender)

    def _publish(self) -> None:
        meta = dict(
            gpu=self.gpu,
            replica=self.replica,
            rank=self.rank,
            tp=self.tp,
            replicas=self.replicas,
            ep=self.ep,
            mapping=self.mapping_name,
            rules=self.mapping_rules,
            params_digest=self.params_digest,
            transport=self.transport_name,
            options=self.transport_options,
            export=_b64(self.transport.export()),
            params={n: [list(t.shape), _dtype_name(t.dtype)] for n, t in self.params.items()},
            desc={n: _b64(d) for n, d in self.param_desc.items()},
            stamp=_b64(self.stamp_region.descriptor),
            stamp_slots=self.stamp_slots,
            stamp_begin=8 * self.stamp_slots,
            **(self.staging.meta(self.regions[:-1]) if self.staging is not None else {}),
            host=socket.gethostname(),
            device=str(self.device),
            lease_s=liveness.lease_interval(),
            **liveness.identity(),  # pid, start time, pid namespace: a trainer on this host sees it exit
        )
        # one worker per (replica, rank): during setup a second one is refused, and so is the
        # whole setup; once the trainers' setup is through, a new one is a restart: it
        # replaces the previous one at the trainers' next push()
        self.epoch = 0
        if self.ctl.add("infer/claim/%d" % self.gpu, 1) > 1:
            if self.ctl.check("status"):
                control.decode_result(
                    self.ctl.get("status", "the trainers' setup status"), "trainer rank 0 (controller)"
                )
                self.epoch = self.ctl.add("infer/epoch/%d" % self.gpu, 1)
                meta["epoch"] = self.epoch
                self._start_lease(meta["lease_s"])
                self.ctl.set_json("infer/%d/e%d/meta" % (self.gpu, self.epoch), meta)
                self.ctl.add("infer/rejoins", 1)
                return
            self.ctl.set_json("infer/dup/%d" % self.gpu, dict(host=meta["host"], pid=meta["pid"]))
            self.ctl.add("infer/dups", 1)
            raise SetupError(
                f"wxfer.Receiver: replica {self.replica} rank {self.rank} (gpu {self.gpu}) is "
                f"already registered by another inference worker; this one "
                f"({meta['host']} pid {meta['pid']}) is refused"
            )
        self._start_lease(meta["lease_s"])
        # what a trainer needs to connect (no parameter list, no descriptors: those reach it in the
        # plan), read by every trainer that writes here; the whole record by the controller alone
        self.ctl.set_json("infer/%d/peer" % self.gpu, {k: v for k, v in meta.items() if k not in ("params", "desc")})
        self.ctl.set_json("infer/%d" % self.gpu, meta)
        self.ctl.add("infer/count", 1)

    def _start_lease(self, interval: float) -> None:
        """The lease the trainers check (liveness.py), renewed by a Python thread until close()."""
        self.lease = liveness.Lease(self.ctl, liveness.lease_key(self.gpu, self.epoch), interval)

    def _watch_writers(self) -> None:
        """Read once what tells whether each trainer rank writing here is alive (its record)."""
        if self.writers is not None:  # a restart's, read while it waited for the trainers
            return
        recs = {}
        for r in self.senders:
            try:
                recs[r] = self.ctl.get_json("train/%d/who" % r, f"trainer rank {r}'s record", 5)
            except Exception:  # noqa: BLE001 -- not checked (state() reads the stamps alone)
                recs[r] = None
        self.writers = liveness.WriterWatch(self.ctl, self.senders, recs)

    def _handshakes(self) -> None:
        if self.epoch:
            return self._rejoin_handshakes()
        st = self.ctl.get(
            "status", "the trainers' plan (trainer rank 0 builds it once every inference worker has published)"
        )
        self.ctl.add("status/acks", 1)
        control.decode_result(st, "trainer rank 0 (controller)")
        lay = self.ctl.get_json("layout", "the inference layout the trainers planned for", 5)
        if (lay["replicas"], lay["tp"]) != (self.replicas, self.tp) or self.gpu >= lay["workers"]:
            raise SetupError(
                f"wxfer.Receiver gpu {self.gpu}: this worker says replica {self.replica} of "
                f"{self.replicas}, rank {self.rank} of tp={self.tp}, but the trainers planned for "
                f"replicas={lay['replicas']} tp={lay['tp']} (from inference worker gpu 0): the "
                "inference workers disagree on the layout"
            )
        senders = self.ctl.get_json("senders/%d" % self.gpu, "the list of trainers writing here")
        for r in senders:
            control.target_accept(self.ctl, self.transport, r, self.gpu)
        self.ctl.set("ready/%d" % self.gpu, b"1")
        # every trainer rank's connect phase (to every worker) is over, or its error is here
        done = self.ctl.get("setup", "the trainers' word that their connect phase is over")
        self.ctl.add("setup/acks", 1)
        control.decode_result(done, "the trainers (connecting to the inference workers)")
        self.senders = senders

    def _rejoin_handshakes(self) -> None:
        """A restarted worker: its record (``infer/<gpu>/e<epoch>/meta``) is seen by the watcher
        of every trainer rank writing here (each acknowledges it), then ``infer/<gpu>/e<epoch>``
        says so: from then on the next push() of each takes it, however far off.  Wait for
        those pushes as long as the trainer job lives (its lease: jobs.JobWatch) and each
        trainer rank does (its pid and lease: liveness.WriterWatch), or `rejoin_timeout`
        seconds where one was given, or for a trainer's refusal (issue 35.2)."""
        self.senders = self.ctl.get_json("senders/%d" % self.gpu, "the list of trainers writing here")
        g, e = self.gpu, self.epoch
        self._t_rejoin, self._job = time.monotonic(), jobs.JobWatch(self.ctl)
        self._watch_writers()
        seen = "rejoin/seen/%d/e%d" % (g, e)
        self._wait_trainers(lambda: self.ctl.add(seen, 0) >= len(self.senders), None, "see its record")
        self.ctl.set("infer/%d/e%d" % (g, e), b"1")  # every writer's next push takes it
        for r in self.senders:
            req = control.hs_key("req", r, g, e)
            self._wait_trainers(lambda: self.ctl.check(req), r, "connect")
            control.target_accept(self.ctl, self.transport, r, g, epoch=e)
        self.ctl.set("ready/%d/e%d" % (g, e), b"1")

    def _wait_trainers(self, done, rank, what: str) -> None:
        """Wait until `done()` (trainer `rank`, or every one when None, to `what`): while the job
        and the writers live, at most `rejoin_timeout` from the start of the rejoin if given;
        SetupError on a refusal, a timeout, or the trainers gone."""
        refused = "rejoin/refused/%d/e%d" % (self.gpu, self.epoch)
        who = f"wxfer.Receiver gpu {self.gpu} (restarted, replica {self.replica} rank {self.rank})"
        them = "the trainer ranks" if rank is None else f"trainer rank {rank}"
        delay, looked = 0.005, time.monotonic()
        while not done():
            if self.ctl.check(refused):
                why = self.ctl.get(refused, "the trainers' refusal").decode(errors="replace")
                raise SetupError(f"{who}: refused by the trainers: {why}")
            waited = time.monotonic() - self._t_rejoin
            if self.rejoin_timeout is not None and waited > self.rejoin_timeout:
                raise SetupError(
                    f"{who}: {them} did not {what} within rejoin_timeout={self.rejoin_timeout:g} s "
                    "(the trainers pick up a restarted worker at their next push())"
                )
            if time.monotonic() - looked >= 0.25:  # the trainers alive: a few store reads a second
                looked = time.monotonic()
                gone = self.writers.gone()
                if gone or not self._job.alive():
                    why = "; ".join(f"trainer rank {r}: {w}" for r, w in sorted(gone.items()))
                    why = why or f"its job lease was not renewed for {jobs.STALE_S:g} s"
                    raise SetupError(
                        f"{who}: {them} will not {what}: the trainer job is gone ({why}; waited "
                        f"{waited:.1f} s for its next push())"
                    )
            time.sleep(delay)
            delay = min(2 * delay, 0.1)

    # ------------------------------------------------------------------ per step: nothing
    def _stamps(self) -> tuple[list, list]:
        """(end stamps, begin stamps) of the senders, the end ones read first: a begin
        read after an equal end means that sender was not writing when its end was read."""
        n = len(self.senders)
        end = self.stamps[:n].tolist()
        begin = self.stamps[self.stamp_slots : self.stamp_slots + n].tolist()
        return end, begin

    def version(self) -> int:
        """The step whose weights are all in place here; -1 before the first push, and while
        any trainer is writing (or gave up, or died, in the middle of writing) a step here.
        A reader that wants its use of the weights covered checks it again afterwards: the
        same value, not -1, means no write touched them in between."""
        if not self.senders:
            return -1
        end, begin = self._stamps()
        if any(b != e for b, e in zip(begin, end)):
            return -1
        return int(min(end))

    def _marks(self):
        """The trainers' records of giving up on this worker (store keys torn/<gpu>/e<epoch>/<i>);
        None when the store cannot be reached."""
        base = "torn/%d/e%d" % (self.gpu, self.epoch)
        try:
            n = self.ctl.add(base, 0)
            return [
                self.ctl.get_json("%s/%d" % (base, i), "a trainer's record of giving up", 5)
                for i in range(1, n + 1)
                if self.ctl.check("%s/%d" % (base, i))
            ]
        except Exception:  # noqa: BLE001 -- the store is gone
            return None

    def state(self) -> dict:
        """What the weights here are, one of:

        - ``complete``: ``version`` is the step fully in place;
        - ``unwritten``: no step written since this Receiver's setup (``version`` -1): the
          weights are what the memory held before (a loaded checkpoint, or what an earlier
          job left, maybe half written: issue 35.8 -- not ``complete`` at -1);
        - ``writing``: trainer rank(s) ``ranks`` are writing step ``step`` (for ``for_s`` s);
        - ``torn``: step ``step`` was left half written (``why``: which trainer rank gave up
          or died); the weights mix two steps until a push reaches this worker again
          (``final`` False: the trainers said their next push will);
        - ``dropped``: the trainers gave up on this worker at step ``step`` (``why``); it holds
          step ``version`` complete (-1 with ``step``: it was dropped in the middle of that
          step, a stalled worker the trainers skipped, and its weights are torn) but will not
          be written again until it is restarted.

        ``message`` says it in one line.  Reads the store (one round trip) only when a trainer
        has recorded giving up on this worker or some sender is mid-step."""
        if not self.senders:
            return _unwritten(self.gpu)
        end, begin = self._stamps()
        busy = [(r, b) for r, b, e in zip(self.senders, begin, end) if b != e]
        now = time.monotonic()
        first = self._busy_since if busy and self._busy_key == busy else now
        self._busy_key, self._busy_since = (busy, first) if busy else (None, None)
        v = -1 if busy else int(min(end))
        silent = 0.0  # seconds the store has not answered this look (0: it answered)
        if busy or self._marks_checked + 0.1 < now or self._store_look.in_flight():
            self._marks_checked = now
            answered, got = self._store_look.look(STATE_STORE_S)
            if answered:
                self._last_marks, gone = got
                self._gone = self._gone if gone is None else gone
            else:
                silent = got
        if silent:
            return _silent(self._state_of(busy, v, end, now, first), silent)
        return self._state_of(busy, v, end, now, first)

    def _look_store(self):
        """The trainers' records of giving up here, and the trainer ranks dead by now (None: not
        watched): what state() reads from the store, on the Bounded look's thread."""
        return self._marks(), (self.writers.gone() if self.writers is not None else None)

    def _state_of(self, busy: list, v: int, end: list, now: float, first: float) -> dict:
        """state() from the stamps read and the store's last answer."""
        marks = self._last_marks
        ranks = [r for r, _ in busy]
        if marks is None:
            if busy:  # nobody left to finish the step: the trainers' store is gone
                step = max(b for _, b in busy)
                why = "the trainers' store cannot be reached (the trainer hosting it died?)"
                msg = (
                    f"inference worker gpu {self.gpu}: torn since step {step}: trainer rank(s) {ranks} did "
                    "not finish it and the trainers' store cannot be reached (the trainer hosting it died?)"
                )
                return _state("torn", -1, step, ranks, why, now - first, True, msg)
            marks = []
        endof = dict(zip(self.senders, end))
        live = [
            m
            for m in marks
            if (m.get("writer") is None and busy) or (m.get("writer") in endof and endof[m["writer"]] < m["step"])
        ]
        if live:
            return self._marked(live, busy, v, now - first)
        if self._gone:
            return self._writers_gone(v, busy, end, now - first)
        where = f"inference worker gpu {self.gpu} (replica {self.replica} rank {self.rank})"
        if busy:
            step = max(b for _, b in busy)
            msg = f"{where}: step {step} being written by trainer rank(s) {ranks} (for {now - first:.1f} s)"
            return _state("writing", -1, step, ranks, "", now - first, False, msg)
        if v < 0:
            return _unwritten(self.gpu)
        return _state("complete", v, v, [], "", 0.0, False, f"{where}: step {v} complete")

    def _marked(self, live: list, busy: list, v: int, for_s: float) -> dict:
        """state() when trainers recorded giving up on a step here (`live`: their records that
        a later stamp has not overtaken): torn while a step is half written, else dropped."""
        where = f"inference worker gpu {self.gpu} (replica {self.replica} rank {self.rank})"
        m = min(live, key=lambda m: m["step"])
        why = "; ".join(sorted({x["why"] for x in live}))
        final = any(x.get("final", True) for x in live)
        skipped = [x for x in live if x.get("dropped")]  # skipped for good (a stalled worker)
        if busy and skipped:
            m = min(skipped, key=lambda m: m["step"])
            msg = (
                f"{where}: dropped by the trainers in the middle of step {m['step']} ({why}); its "
                "weights are torn (that step half written) and it is not written again until it is restarted"
            )
            ranks = sorted({x.get("writer") for x in live}, key=str)
            return _state("dropped", -1, m["step"], ranks, why, for_s, True, msg)
        if busy:
            msg = f"{where}: torn since step {m['step']}: {why}" + (
                "" if final else " (the trainers go on: their next push to this worker rewrites it)"
            )
        else:
            msg = (
                f"{where}: dropped by the trainers at step {m['step']} ({why}); it holds step {v} "
                "complete and is not written again until it is restarted"
            )
        ranks = sorted({x.get("writer") for x in live}, key=str)
        return _state("torn" if busy else "dropped", v, m["step"], ranks, why, for_s, final, msg)

    def _writers_gone(self, v: int, busy: list, end: list, for_s: float) -> dict:
        """state() when trainer ranks writing here died with no record of it (between pushes, or
        before they could record it): torn if one was mid-step, else dropped at its last step."""
        where = f"inference worker gpu {self.gpu} (replica {self.replica} rank {self.rank})"
        ranks = sorted(self._gone)
        recs = self.writers.records if self.writers is not None else {}
        name = {r: f"trainer rank {r} (pid {recs[r].get('pid')}, host {recs[r].get('host')})" for r in ranks}
        why = "; ".join(f"{name[r]} died: {self._gone[r]}" for r in ranks)
        endof = dict(zip(self.senders, end))
        if busy:
            step = max(b for _, b in busy)
            msg = f"{where}: torn since step {step}: {why}"
        else:
            step = min(endof[r] for r in ranks)
            msg = (
                f"{where}: dropped: {why}; it holds step {v} complete and is not written again until "
                "the trainers are restarted"
            )
        return _state("torn" if busy else "dropped", v, step, ranks, why, for_s, True, msg)

    def wait_version(self, version: int, timeout: float = 60.0) -> int:
        """Poll (bounded) until version() >= `version`; returns it.  Raises TornError as soon
        as the trainers record that they gave up on this worker for good (dropped it, or a
        trainer rank died or stopped with a step half written here), and TimeoutError naming
        the trainer ranks not done (and the state) at the deadline."""
        deadline = time.monotonic() + timeout
        delay, checked = 0.0005, 0.0
        while True:
            v = self.version()
            if v >= version:
                return v
            now = time.monotonic()
            if now - checked >= 0.1:
                checked = now
                st = self.state()
                if st["state"] in ("torn", "dropped") and st.get("final", True):
                    log.error("Receiver gpu %s: %s (waiting for version %d)", self.gpu, st["message"], version)
                    raise TornError(f"wxfer.Receiver: {st['message']} (waiting for version {version})")
            if now > deadline:
                st = self.state()
                end, _ = self._stamps()
                late = [r for r, s in zip(self.senders, end) if s < version]
                log.warning("Receiver gpu %s: version %d after %.0f s, waiting for %d", self.gpu, v, timeout, version)
                raise TimeoutError(
                    f"wxfer.Receiver gpu {self.gpu}: version {v} after {timeout:.0f} s, "
                    f"waiting for {version}; trainer ranks not done: {late}; {st['message']}"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.02)

    def stats(self) -> dict:
        return dict(
            gpu=self.gpu,
            regions=self.n_regions,
            register_mode=self.register_mode,
            params=len(self.params),
            register_s=self.register_s,
            bytes=sum(t.numel() * t.element_size() for t in self.params.values()),
            transport=self.transport_name,
            registration=registration_info(self.transport_name, self.transport.info()),
            senders=list(self.senders),
            empty=list(self.empty),
            tied=dict(self.tied),
            **({} if self.staging is None else {"delta": self.staging.stats()}),
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.verifier is not None:
            self.verifier.stop()
        if self.lease is not None:
            self.lease.stop()
        self._store_look.close()
        if self.writers is not None:
            self.writers.pids.close()  # the pidfds of the trainers on this host
        for r in self.regions:
            try:
                r.close()
            except Exception:  # noqa: BLE001
                pass
        self.regions = []
        if self.staging is not None:
            self.staging.close()
        try:
            self.transport.close()
        except Exception:  # noqa: BLE001
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return (
            f"<wxfer.Receiver replica {self.replica} rank {self.rank}/{self.tp} {len(self.params)} params "
            f"{self.transport_name}>"
        )


def _checked_params(named_parameters) -> dict:
    """{name: tensor} of a Receiver's parameters (a dict or (name, tensor) pairs), each a
    contiguous tensor, no name twice, at least one."""
    import torch

    items = list(named_parameters.items() if hasattr(named_parameters, "items") else named_parameters)
    params: dict = {}
    for n, t in items:
        t = t.detach() if isinstance(t, torch.Tensor) else t
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"wxfer.Receiver: parameter {n} is a {type(t).__name__}, not a tensor")
        if not t.is_contiguous():
            raise ValueError(
                f"wxfer.Receiver: parameter {n} is not contiguous; one-sided writes fill parameters as flat byte ranges"
            )
        if n in params:
            raise ValueError(f"wxfer.Receiver: parameter {n} listed twice")
        params[n] = t
    if not params:
        raise ValueError("wxfer.Receiver: no parameters")
    return params


def _unwritten(gpu) -> dict:
    return _state(
        "unwritten",
        -1,
        None,
        [],
        "",
        0.0,
        False,
        f"inference worker gpu {gpu}: no step written since this Receiver's setup (the weights are what "
        "the memory held before it)",
    )


def _silent(st: dict, silent: float) -> dict:
    """state() `st` from the store's last answer, when the store has not answered for `silent`
    seconds (stopped or stalled): said in its message."""
    st["message"] += (
        f" (the trainers' store has not answered for {silent:.1f} s: a trainer's record of "
        f"giving up on this worker, or a trainer's lease, is read from its last answer)"
    )
    return st


def _state(state, version, step, ranks, why, for_s, final, message) -> dict:
    """One answer of Receiver.state() (its keys are the documented ones)."""
    return dict(
        state=state, version=version, step=step, ranks=ranks, why=why, for_s=for_s, final=final, message=message
    )


def _check_stamp_slots(stamp_slots) -> None:
    if isinstance(stamp_slots, bool) or not isinstance(stamp_slots, int) or stamp_slots < 1:
        raise ValueError(
            f"wxfer.Receiver: stamp_slots must be an int >= 1 (the version stamps: one slot per "
            f"trainer rank that writes to this worker), got {stamp_slots!r}"
        )


def _mapping_name(mapping) -> str:
    if mapping is None:
        return ""
    if isinstance(mapping, str):
        return mapping
    return getattr(mapping, "name", "") or ""
