"""wxfer as a vLLM weight-transfer backend, the worker side: ``WeightTransferConfig(backend="wxfer")``.

vLLM builds one engine per worker in ``load_model()`` (``WeightTransferEngineFactory``) and calls
it from the client's RPCs (``LLM`` / ``AsyncLLM`` / HTTP / Ray):

- ``init_transfer_engine(WxferInitInfo)``: checks that the model holds every destination the
  mapping writes, runs the proof (``proof.py`` / ``postproc.py``: vLLM's own ``load_weights`` +
  ``process_weights_after_loading`` against what wxfer leaves, every layer, on seeded tensors):
  each parameter is direct (its final storage registered), finalize (loader-layout memory kept
  and registered instead) or refused by name (the setup fails); then builds one
  ``wxfer.Receiver``; it returns once the trainers' Senders connected (they write one-sided from
  then on);
- ``start_weight_update()``: forgets the announced version;
- ``update_weights({"version": v, "timeout": s})``: moves nothing (the trainers write) and waits,
  bounded, until step ``v`` is in place; synchronizes only a CUDA device;
- ``finish_weight_update()``: fails unless ``Receiver.state()`` is complete at ``v`` (a torn or
  missing step raises naming the trainer ranks and the parameters), applies the trainers' delta
  records of ``v`` where the init info gave a ``delta_staging`` (issue 36; a worker that missed
  an earlier push's records fails the update saying so, and the trainers send it the next push
  dense), then runs the finalizers
  (vLLM's post-processing of each finalize module re-run from the kept memory), timed:
  ``finalize_report`` (seconds per module, in all, and the bytes kept); the whole update is
  timed in ``update_report`` (``start_s`` from ``start_weight_update`` to ``update_weights``,
  ``write_s`` the wait in ``update_weights`` until the step is in place, ``finish_s`` the whole
  ``finish_weight_update`` of which ``apply_s`` the delta records (None without staging) and
  ``finalize_s`` the finalizers, ``total_s`` from ``start_weight_update`` to the end of ``finish_weight_update``),
  logged at INFO per update;
- ``shutdown()``: closes the Receiver.

The class itself is built on first access (``WxferWeightTransferEngine``, PEP 562) for the
installed vLLM's API (``build_engine_class``, versions.py), so this module imports without
vLLM; the logic is in ``WorkerSide``, tested with and without vLLM.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from .layout import PROOF_SEED, quant_of, writable_parameters
from .versions import built_class, lazy_attr

log = logging.getLogger(__name__)


@dataclass
class WxferInitInfo:
    """What the trainers send to every worker once (``init_weight_transfer_engine``)."""

    store: str = ""  # "host:port" of the trainers' store (trainer rank 0 hosts it)
    mapping: str | dict | None = None  # a preset name or an HF config dict; None: the worker's hf_config
    mapping_name: str | None = None  # the trainers' mapping name when `mapping` is None
    name: str = "default"  # the wxfer job name (several jobs can share one store)
    replica: int | None = None  # None: vLLM's data_parallel_index
    replicas: int | None = None  # None: vLLM's data_parallel_size
    timeout: float = 300.0
    transport: str = "auto"
    skip: str | None = None  # a regex of vLLM parameter names not to register
    proof: bool = True  # the layout proof at setup (proof.py)
    proof_layers: int = 2
    proof_seed: int = PROOF_SEED
    delta_staging: int | str = 0  # bytes registered for delta records (issue 36); 0: dense pushes only
    traced: bool = False  # the destination map traced from vLLM's load_weights (traced.py), no preset
    extra: dict = field(default_factory=dict)  # reserved for later fields of newer trainers

    def __post_init__(self):
        self.delta_staging = staging_bytes(self.delta_staging, "wxfer init_info: delta_staging")


def staging_bytes(value, what: str) -> int:
    """`value` (an int, or a size string such as "64MiB") as bytes >= 0; ValueError naming `what`."""
    n = value
    if isinstance(value, str):
        from ... import _wxfer

        try:
            n = int(_wxfer.parse_size(value.strip())) if value.strip() not in ("", "0") else 0
        except ValueError as e:
            raise ValueError(f"{what} must be bytes >= 0 (an int or a size such as '64MiB'), got {value!r}") from e
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"{what} must be bytes >= 0 (an int or a size such as '64MiB'), got {value!r}")
    return n


@dataclass
class WxferUpdateInfo:
    """What the trainers send each step (``update_weights``): the version they push."""

    version: int
    timeout: float = 60.0

    def __post_init__(self):
        if isinstance(self.version, bool) or not isinstance(self.version, int) or self.version < 0:
            raise ValueError(f"wxfer update_info: version must be an int >= 0, got {self.version!r}")
        if not isinstance(self.timeout, (int, float)) or not 0 < self.timeout <= 3600:
            raise ValueError(f"wxfer update_info: timeout must be in (0, 3600] s, got {self.timeout!r}")


def worker_preset(info: WxferInitInfo, hf_config: dict):
    """The mapping rebuilt from the worker's hf_config, under the trainers' mapping name."""
    from ...mapping import from_config

    if isinstance(info.mapping, str):
        name = info.mapping
    elif isinstance(info.mapping, dict):
        name = info.mapping.get("name_or_path", "custom")
    else:
        name = info.mapping_name or hf_config.get("name_or_path") or "custom"
    return from_config(name, hf_config)


class WorkerSide:
    """The worker engine's logic; needs ``self.model``, ``self.vllm_config``, ``self.device``
    (what vLLM's ``WeightTransferEngine.__init__`` sets)."""

    init_info_cls = WxferInitInfo
    update_info_cls = WxferUpdateInfo
    supports_draft_weight_update = False

    receiver = None
    _announced = None
    _t_start = None
    _t_wait = None
    update_report = None
    proof_result = None
    traced_map = None

    # ---- vLLM's internals, in two places
    def _parallel(self) -> dict:
        from .extension import parallel_info

        return parallel_info(self.vllm_config)

    def _hf_config(self) -> dict:
        return self.vllm_config.model_config.hf_config.to_dict()

    # ---- the RPCs
    def init_transfer_engine(self, init_info: WxferInitInfo) -> None:
        from ...runtime.receiver import Receiver
        from .extension import receiver_place

        info = init_info
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None
        par = self._parallel()
        where = f"vLLM worker (replica {par['dp_rank']}, tp rank {par['rank']} of {par['tp']})"
        major = None
        if getattr(self.device, "type", "cpu") == "cuda":
            import torch

            major = torch.cuda.get_device_capability(self.device)[0]
        place = receiver_place(par, info.replica, info.replicas)
        replica, replicas = place["replica"], place["replicas"]
        self._refuse_draft_and_mla(where)
        # nothing of an earlier job on this engine (a traced job's map, its proof) outlives it
        self.finalizers, self.traced_map, self.proof_result, self.update_report = [], None, None, None
        if info.traced:
            preset = None
            store, sel, left = self._traced(info, par, replica, replicas, where, major)
        else:
            preset, store, sel, left = self._preset(info, par, replica, replicas, where, major)
        self.finalize_report = dict(
            modules={}, seconds=0.0, kept_bytes=sum(f.kept_bytes for f in self.finalizers), updates=0
        )
        self.left_out = left
        self._refuse_delta_over_rewrites(info, where)
        self.receiver = Receiver(
            sel,
            mapping=preset,  # its rules too: the trainers compare them (issue 25.4); None when traced
            store=store,
            name=info.name,
            timeout=info.timeout,
            transport=info.transport,
            delta_staging=info.delta_staging,
            **place,
        )

    def _refuse_draft_and_mla(self, where):
        """A draft model (MTP, EAGLE) wxfer would leave stale, and MLA attention whose
        post-processing mla.py cannot re-run, are refused by name (mla.py)."""
        from .mla import draft_refusal, mla_refusals

        bad = mla_refusals(self.model)
        draft = draft_refusal(getattr(self, "vllm_config", None))
        if draft:
            bad.insert(0, draft)
        if bad:
            raise RuntimeError(f"wxfer: {where} refuses to be written: " + "; ".join(bad[:6]))

    def _refuse_delta_over_rewrites(self, info, where):
        """Delta records are the bytes that changed since the trainers' last push, applied over
        the memory they wrote: a finalizer whose post-processing rewrote its kept memory in place
        (seen by the proof) would leave other bytes there, so delta is refused naming it: where
        the worker has a staging area, or the trainers say they push delta (``extra["delta"]``:
        the cuda_ipc scatter writes the changed bytes with no staging area)."""
        bad = [f.module_name for f in self.finalizers if getattr(f, "rewrites_kept", False)]
        if (info.delta_staging or (info.extra or {}).get("delta")) and bad:
            raise RuntimeError(
                f"wxfer: {where}: delta pushes (init_info delta_staging / extra['delta']) need the memory "
                f"the trainers write left as written, and vLLM's post-processing of {', '.join(bad[:6])} rewrites its "
                "kept memory in place; push dense (WxferTrainerInitInfo(delta=False))"
            )

    def _preset(self, info, par, replica, replicas, where, major):
        """(preset, store, selected, left out) by the hand-written rules.  With the proof (the
        default: proof.py / postproc.py) every parameter is direct (its final storage registered),
        finalize (loader-layout memory kept and registered instead, vLLM's post-processing re-run
        in finish_weight_update) or refused by name; without it, only parameters whose live storage
        has the mapping's layout."""
        from ...runtime import control

        cfg = self._hf_config()
        preset = worker_preset(info, cfg)
        named = list(self.model.named_parameters())
        quant = quant_of(named)
        store = control.resolve_store(info.store or None, False, info.timeout)
        if not info.proof:
            sel, left = writable_parameters(named, preset, cfg, par, quant, info.skip, where, preset.name)
            return preset, store, sel, left
        from .proof import worker_proof

        args = (self.model, preset, cfg, named, par, quant, replica, replicas, store, info, where)
        self.proof_result, cls, dests = worker_proof(*args, self.vllm_config, self.device)
        live = dict(named)
        sel = []
        for d in sorted(set(cls.direct) | set(cls.finalize_dests)):
            if d in cls.finalize_dests:
                f, attr = cls.finalize_dests[d]
                sel.append((d, f.params[attr]))
            else:
                sel.append((d, live[dests[d][0]]))
        self.finalizers = sorted(cls.finalize, key=lambda f: f.late)
        return preset, store, sel, cls.left_out

    def _traced(self, info, par, replica, replicas, where, major):
        """(store, selected, left out) by the map traced from vLLM's own load_weights (traced.py),
        published for the trainers.  With the proof (the default) the same post-processing proof
        as ``_preset`` (proof.traced_classify: the map's shards packed for seeded tensors) makes
        every parameter the map writes direct, finalize or refused by name, and registers it
        accordingly; without it, the live parameters the map writes."""
        from ...runtime.control import Control, job_secret, resolve_store
        from .traced import proven, registered, worker_trace

        store = resolve_store(info.store or None, False, info.timeout)
        ctl = Control(store, info.name, info.timeout, secret=job_secret(None))
        prove = None
        if info.proof:
            from .proof import traced_classify

            def prove(m, params, shards):
                return traced_classify(self.model, self.vllm_config, self.device, m, params, shards, info.proof_seed)

        self.traced_map, windows, cls = worker_trace(
            self.model, self.vllm_config, par, replica, replicas, ctl, info.skip, where, prove
        )
        named = list(self.model.named_parameters())
        if cls is None:
            return (store, *registered(named, windows))
        self.proof_result = dict(seconds=cls.seconds, classes=cls.summary(), traced=True)
        self.finalizers = sorted(cls.finalize, key=lambda f: f.late)
        return (store, *proven(named, windows, cls))

    def _need(self, what: str):
        if self.receiver is None:
            raise RuntimeError(f"wxfer: {what} before init_weight_transfer_engine")
        return self.receiver

    def start_weight_update(self) -> None:
        self._need("start_weight_update")
        self._announced = None
        self._t_start, self._t_wait = time.monotonic(), None

    def receive_weights(self, update_info: WxferUpdateInfo) -> None:
        r = self._need("update_weights")
        self._announced = int(update_info.version)
        t0 = time.monotonic()
        r.wait_version(self._announced, float(update_info.timeout))
        self.last_wait_s = time.monotonic() - t0
        self._t_wait = (t0, t0 + self.last_wait_s)

    def update_weights(self, update_info: dict) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if getattr(self.device, "type", "cpu") == "cuda":  # the trainers' writes are done; no accelerator call on CPU
            import torch

            torch.cuda.synchronize(self.device)

    def finish_weight_update(self) -> None:
        r = self._need("finish_weight_update")
        t_finish = time.monotonic()
        v = self._announced
        self._announced = None
        st = r.state()
        if v is None:
            raise RuntimeError(
                f"wxfer: finish_weight_update without update_weights announcing a version; {st['message']}"
            )
        if st["state"] != "complete" or st["version"] != v:
            names = sorted(r.params)
            raise RuntimeError(
                f"wxfer: weight update to version {v} is not complete: {st['message']}; trainer rank(s) "
                f"{st['ranks']}; the {len(names)} registered parameter(s) ({', '.join(names[:4])}"
                f"{', ...' if len(names) > 4 else ''}) do not hold version {v}"
            )
        t_apply = time.monotonic()
        applied = self._apply_delta(r, v)  # before the finalizers: they re-derive from these bytes
        t_fin = time.monotonic()
        self.run_finalizers()
        self._report_update(v, t_finish, (t_apply, applied), t_fin, time.monotonic())

    def _apply_delta(self, r, v):
        """The trainers' delta records of step `v` applied into the registered memory (issue 36,
        docs/delta.md): Receiver.apply(v)'s answer, or None where this worker has no staging area
        (dense pushes only).  The update fails (the trainers asked for a dense push to this
        worker) where they cannot be: the worker missed an earlier push's records (its
        finish_weight_update never ran), or a later push began writing before they were applied."""
        if getattr(r, "staging", None) is None:
            return None
        from ...runtime.delta import DeltaError

        mix = (
            f"this worker's memory now holds a mix of versions: the tasks of version {v} sent dense or "
            "scattered are in place, those sent as records are not, and the finalizers did not run; the "
            "trainers send it dense from their next push (a resync), which brings it whole"
        )
        try:
            out = self.last_apply = r.apply(v)
        except DeltaError as e:
            log.error("wxfer: update to version %d: delta records not applied: %s", v, e)
            raise RuntimeError(
                f"wxfer: weight update to version {v} failed on this worker: its delta records cannot be "
                f"applied ({e}); {mix}"
            ) from e
        missing, now = r.staging.unapplied(v), r.version()
        if missing or now != v:
            r.staging.ask_resync(v)
            what = (
                f"the delta records of trainer rank(s) {missing} were not applied (their slots hold another step)"
                if missing
                else "its delta records were applied while a later push was being written"
            )
            raise RuntimeError(
                f"wxfer: weight update to version {v} failed on this worker: {what}; version now {now} "
                f"(a later push began); {mix}"
            )
        return out

    def _report_update(self, v, t_finish, apply, t_fin, t_end) -> dict:
        """``update_report``: the update to version `v` timed on this worker, start -> writes ->
        finish (see the module docstring); None where the update had no ``start_weight_update``
        or ``update_weights`` on this worker.  apply: (its start, Receiver.apply()'s answer or
        None): ``apply_s`` is None where no records were applied (no staging area)."""
        (t_apply, applied), t0, wait = apply, self._t_start, self._t_wait
        self._t_start = self._t_wait = None
        if t0 is None or wait is None:
            self.update_report = None
            return None
        rep = self.update_report = dict(
            version=v,
            start_s=wait[0] - t0,
            write_s=wait[1] - wait[0],
            finish_s=t_end - t_finish,
            apply_s=None if applied is None else t_fin - t_apply,
            finalize_s=t_end - t_fin,
            total_s=t_end - t0,
        )
        what = "no delta"
        if applied is not None:
            rep["apply"] = {k: applied[k] for k in ("records", "bytes", "changed")}
            n = (rep["apply_s"], applied["records"], applied["changed"])
            what = "apply %.4f s: %d records, %d bytes changed" % n
        log.info(
            "wxfer: update to version %d: start %.4f s, writes %.4f s, finish %.4f s (%s, finalize %.4f s), "
            "total %.4f s",
            v,
            rep["start_s"],
            rep["write_s"],
            rep["finish_s"],
            what,
            rep["finalize_s"],
            rep["total_s"],
        )
        return rep

    def run_finalizers(self) -> dict:
        """vLLM's post-processing re-run for every finalize module, timed (``finalize_report``)."""
        fins = getattr(self, "finalizers", [])
        per = {f.module_name: f() for f in fins}
        if fins and getattr(self.device, "type", "cpu") == "cuda":
            import torch

            torch.cuda.synchronize(self.device)
        rep = self.finalize_report
        rep.update(modules=per, seconds=sum(per.values()), updates=rep["updates"] + 1)
        if fins:
            log.info(
                "wxfer: finalize of update %d: %d module(s) in %.4f s (%.1f MiB kept)",
                rep["updates"],
                len(fins),
                rep["seconds"],
                rep["kept_bytes"] / 2**20,
            )
        return rep

    def shutdown(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None


def _no_trainer_send_weights(iterator, trainer_args):
    """vLLM 0.26's worker ABC declares this static trainer-side sender; wxfer's trainers push
    with their own engine (trainer.py) instead."""
    raise NotImplementedError(
        "wxfer: WxferWeightTransferEngine.trainer_send_weights is not how wxfer's trainers send: "
        "every trainer rank builds WxferTrainerWeightTransferEngine (WeightTransferTrainerFactory."
        "trainer_init) and calls its send_weights(); the workers are written one-sided"
    )


def _update_weights(self, update_info: dict) -> None:
    """vLLM's base would call torch.accelerator.synchronize(), which raises on a CPU host."""
    return WorkerSide.update_weights(self, update_info)


def build_engine_class(base, shape: str):
    """wxfer's worker engine over vLLM's `base` (``WeightTransferEngine``) of API `shape`
    (versions.py): the same RPCs on every shape; 0.26's ABC also wants ``trainer_send_weights``."""
    ns = dict(
        __doc__="wxfer's worker-side vLLM weight-transfer engine (see wxfer.integrations.vllm.engine).",
        __module__=__name__,
        init_info_cls=WxferInitInfo,
        update_info_cls=WxferUpdateInfo,
        update_weights=_update_weights,
        wxfer_vllm_api=shape,
    )
    if shape == "0.26":
        ns["trainer_send_weights"] = staticmethod(_no_trainer_send_weights)
    return type("WxferWeightTransferEngine", (WorkerSide, base), ns)


_CLASSES: dict = {}


def _engine_class():
    return built_class(_CLASSES, "engine", "WeightTransferEngine", build_engine_class)


__getattr__ = lazy_attr(__name__, "WxferWeightTransferEngine", _engine_class)
