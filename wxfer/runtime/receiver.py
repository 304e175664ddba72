"""The inference side: register weight memory once, publish metadata, answer the trainers'
connection handshakes during setup, and then run nothing per step.

    recv = wxfer.Receiver(model.named_parameters(), mapping="qwen3-8b", store="host:29650",
                          replica=0, rank=tp_rank, tp=2, replicas=4)
    ...
    recv.version()   # the training step whose weights are fully in place (-1: none yet)

The parts: recv_setup.py (transport, registration, publishing, handshakes), recv_rejoin.py
(a restarted worker), recv_state.py (the version stamps: version(), state(), wait_version()),
param_desc.py (the parameter descriptors the trainers receive).
"""

from __future__ import annotations

import logging
import time

from . import alias, control, jobs
from .control import Control
from .param_desc import _b64, _dtype_name, _unb64, decode_param_descriptor, encode_param_descriptor  # noqa: F401
from .recv_rejoin import ReceiverRejoin
from .recv_setup import ReceiverSetup, _check_stamp_slots, _checked_params, _mapping_name
from .recv_state import STATE_STORE_S, ReceiverState, TornError  # noqa: F401 -- named from here too
from .transport_opts import (  # noqa: F401 -- imported from here by sender, tools and tests
    capabilities,
    transport_choice,
    gpu_memory_options,
    registration_info,
    _storage_base,
    _CudaRange,
    _segment_bases,
)

log = logging.getLogger(__name__)


class Receiver(ReceiverSetup, ReceiverRejoin, ReceiverState):
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
    a registered staging area for the trainers' delta records (``Sender(delta=True)``),
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
        self.ctl = jobs.receiver_namespace(self.ctl, name)  # not a finished job's records
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
