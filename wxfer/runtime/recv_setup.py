"""A Receiver's setup: open the transport, register the weight memory and the version stamps,
publish the worker's record, and answer the trainers' connection handshakes.

Memory is registered per storage (or, on CUDA with ``register="segments"``, per caching
allocator segment), deduplicated, so parameters that share memory cost one registration.
Each parameter's descriptor is (byte offset in its region, the region's descriptor); the
trainers add the plan's destination offsets to it.
"""

from __future__ import annotations

import socket
import time

from .. import envs
from . import control, digest, liveness
from .control import Bounded, SetupError
from .isolation import warn_fault_isolation
from .param_desc import _b64, _dtype_name, encode_param_descriptor
from .transport_opts import transport_choice, gpu_memory_options, _storage_base, _segment_bases


class ReceiverSetup:
    """The setup steps of wxfer.Receiver (a mixin: the constructor calls them in order)."""

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
        """What the trainers compare with theirs: digests of the parameters' names, shapes and
        dtypes, and of the mapping rules this worker applies (computed always, never skipped)."""
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

    def _publish(self) -> None:
        """This worker's record in the store (its parameters, descriptors, stamps, transport
        address, identity) and its lease; a restart publishes under a new epoch instead."""
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
                return self._publish_restart(meta)
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
