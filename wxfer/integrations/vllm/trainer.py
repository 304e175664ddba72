"""wxfer as a vLLM weight-transfer backend, the trainer side.

    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    info = WxferTrainerInitInfo(store="trainer0:29650", mapping="qwen3-8b", rank=dist.get_rank())
    engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=ModuleSource(model))
    # vLLM 0.26: WeightTransferTrainerFactory.trainer_init("wxfer", WeightTransferConfig(backend="wxfer"),
    #                                                     info, client=client, source=ModuleSource(model))
    for step in ...:
        ...optimizer.step()
        engine.send_weights()          # every rank

Every trainer rank builds a ``wxfer.Sender`` over its (FSDP2) model; rank 0 hosts the store and
drives the client's RPCs (any ``VLLMWeightSyncClient``: ``LLMClient(llm)`` for an offline
``vllm.LLM``, vLLM's HTTP / Ray clients) on a thread while the ranks set up and push:

- ``trainer_init``: rank 0 calls ``init_weight_transfer_engine`` on a thread (it returns once the
  workers' Receivers and the trainers' Senders connected), checks the workers' layout proof
  against its mapping (proof.py) before the Senders are built, then every rank builds its Sender;
- ``send_weights(version=None)``: rank 0 ``start_weight_update()``, then ``update_weights`` on a
  thread (the workers wait there, bounded, for the version) while every rank ``push()``es; rank 0
  then ``finish_weight_update(weight_version=str(version))`` (where the client takes it).  An
  error on any rank is raised on every rank; on an error path rank 0 never waits on the RPC
  thread beyond its bound and never calls ``finish_weight_update``: the workers fail the update
  themselves (their wait ends torn or timed out) and vLLM keeps its previous weight version.

The class is built on first access for the installed vLLM's API (``build_trainer_class``,
versions.py: the ``__init__`` / ``trainer_init`` of vLLM 0.26, 0.32 or 0.33), like engine.py:
importable without vLLM.
"""

from __future__ import annotations

import inspect
import threading
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .versions import built_class, lazy_attr


BACKEND = "wxfer"


@dataclass
class WxferTrainerInitInfo:
    backend: ClassVar[str] = BACKEND
    store: str = ""  # "host:port" that trainer rank 0 hosts and the workers reach
    mapping: Any = None  # preset name, HF config dict or wxfer.mapping.Preset
    name: str = "default"
    timeout: float = 300.0
    update_timeout: float = 60.0  # how long the workers wait for a pushed version
    transport: str = "auto"
    watermark: Any = "2GiB"
    proof: bool = True
    proof_layers: int = 2
    replicas: int | None = None
    # the plan from the map each worker traces from vLLM's own load_weights (traced.py); None:
    # when `mapping` is None or names no preset (an HF config of an architecture wxfer has no rules for)
    traced: bool | None = None
    # delta pushes (issue 36, docs/delta.md): the trainers send only the destination bytes that
    # changed; each worker registers `delta_staging` bytes (e.g. "64MiB") for the records and
    # applies them in finish_weight_update.  False: dense pushes, no staging.
    delta: Any = False
    delta_staging: Any = "64MiB"
    rank: int = field(default=0, kw_only=True)

    def __post_init__(self):
        self.delta = delta_field(self.delta)
        if self.delta:
            from .engine import staging_bytes

            n = staging_bytes(self.delta_staging, "WxferTrainerInitInfo.delta_staging")
            if n == 0:
                raise ValueError(
                    "WxferTrainerInitInfo.delta_staging must be > 0 bytes with delta on (each vLLM worker "
                    "registers it for the trainers' records), got %r" % (self.delta_staging,)
                )

    @property
    def is_sender(self) -> bool:
        return self.rank == 0


def delta_field(delta):
    """WxferTrainerInitInfo.delta as the Sender takes it (False, True or a dict of the delta
    writer's options; an empty dict is True), checked before any RPC, naming the field."""
    from ...runtime.sender import _delta_option

    try:
        d = _delta_option(delta)
    except (TypeError, ValueError) as e:
        raise type(e)(f"WxferTrainerInitInfo.delta: {e}".replace("wxfer.Sender: ", "")) from e
    return True if d == {} else d


class LLMClient:
    """The four RPCs of an offline ``vllm.LLM`` as a ``VLLMWeightSyncClient``."""

    def __init__(self, llm):
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        if weight_version is None or takes_weight_version(self.llm.finish_weight_update) is False:
            self.llm.finish_weight_update()  # vLLM 0.26's LLM has no weight version
        else:
            self.llm.finish_weight_update(weight_version=weight_version)


def takes_weight_version(fn) -> bool | None:
    """Whether `fn` (a client's finish_weight_update) takes ``weight_version`` (vLLM 0.32 / 0.33's
    clients and LLM do, 0.26's do not); None when its signature cannot be read."""
    try:
        ps = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    return any(p.name == "weight_version" or p.kind is inspect.Parameter.VAR_KEYWORD for p in ps)


class _Call(threading.Thread):
    """One client RPC on a daemon thread; .error holds what it raised."""

    def __init__(self, fn, *args, **kw):
        super().__init__(daemon=True, name=f"wxfer-vllm-{getattr(fn, '__name__', 'rpc')}")
        self.fn, self.args, self.kw = fn, args, kw
        self.error = None
        self.start()

    def run(self):
        try:
            self.fn(*self.args, **self.kw)
        except BaseException as e:  # noqa: BLE001 -- handed to the caller
            self.error = e

    def result(self, timeout: float, what: str) -> str | None:
        """None when it returned, else a line saying why not (never waits past `timeout`)."""
        self.join(timeout)
        if self.is_alive():
            return f"{what} did not return within {timeout:.0f} s"
        if self.error is not None:
            return f"{what} raised {type(self.error).__name__}: {self.error}"
        return None


def _wait_first_receiver(ctl, alive, timeout: float) -> None:
    from ...runtime.control import wait_key

    wait_key(
        ctl,
        "infer/0",
        timeout,
        alive,
        lambda err: RuntimeError(f"wxfer: init_weight_transfer_engine failed: {err}"),
        f"wxfer: no vLLM worker registered within {timeout:.0f} s",
    )


def _linger(ctl, workers: int, timeout: float) -> None:
    """After a setup error set as the plan status: wait (bounded) until `workers` Receivers read
    it from the store this process hosts, so that each raises it rather than a lost store."""
    deadline = time.monotonic() + timeout
    try:
        while workers and ctl.add("status/acks", 0) < workers and time.monotonic() < deadline:
            time.sleep(0.02)
    except Exception:  # noqa: BLE001 -- nothing left to wait for
        pass


def _checked_maps(ctl, info, alive):
    """Rank 0: every worker's traced map, read and digest-checked (trainer_maps); on an error the
    workers learn it from the plan status, like the layout proof's."""
    from ...runtime import control
    from .traced import trainer_maps

    try:
        return trainer_maps(ctl, info.timeout, alive)[1]
    except Exception as e:  # noqa: BLE001
        ctl.set("status", control.encode_result(None, f"{type(e).__name__}: {e}"))
        _linger(ctl, 0, min(info.timeout, 10.0))
        raise


def _module_of(source):
    mod = getattr(source, "_module", None) or getattr(source, "module", None)
    if mod is None and hasattr(source, "named_parameters"):
        mod = source
    if mod is None:
        raise TypeError(
            "wxfer trainer engine: source must be vLLM's ModuleSource(model) or the model itself: wxfer's "
            f"Sender reads the (FSDP2) parameters in place, not a stream of tensors (got {type(source).__name__})"
        )
    return mod


def with_persistent_buffers(model):
    """`model`, or where it holds persistent buffers (in its state dict, so in the checkpoint the
    engine loaded, but not parameters: transformers 5's DeepseekV3 gate ``e_score_correction_bias``)
    a module tree of its parameters (the same objects) and those buffers as parameters over the
    same storage, under the same names: the Sender pushes parameters, and the engine loads those
    buffers too.  A buffer the training code replaces by a new tensor (rather than writing it in
    place) is not seen; ``reshard`` (FSDP2) is the model's own."""
    import torch

    params = dict(model.named_parameters())
    extra = {}
    for mname, mod in model.named_modules():
        skip = getattr(mod, "_non_persistent_buffers_set", set())
        for bname, b in mod._buffers.items():
            n = f"{mname}.{bname}" if mname else bname
            if b is not None and bname not in skip and n not in params:
                extra[n] = b
    if not extra:
        return model
    root = torch.nn.Module()
    items = list(params.items()) + [(n, torch.nn.Parameter(b, requires_grad=False)) for n, b in extra.items()]
    for n, t in items:
        mod = root
        *path, leaf = n.split(".")
        for k in path:
            if not hasattr(mod, k):
                mod.add_module(k, torch.nn.Module())
            mod = getattr(mod, k)
        mod.register_parameter(leaf, t)
    if hasattr(model, "reshard"):
        root.reshard = model.reshard
    root.wxfer_buffers = sorted(extra)
    return root


def _worker_mapping(mapping) -> dict:
    """How the mapping travels to the workers: a preset name or an HF config dict as they are;
    a Preset as its name (the workers rebuild it from their hf_config)."""
    if isinstance(mapping, (str, dict)):
        return dict(mapping=mapping)
    return dict(mapping=None, mapping_name=getattr(mapping, "name", None))


def uses_trace(info) -> bool:
    """Whether the trainers build the plan from the workers' traced maps (see WxferTrainerInitInfo.traced)."""
    from ...runtime.program import get_preset

    if info.traced is not None:
        return bool(info.traced)
    if info.mapping is None:
        return True
    try:
        get_preset(info.mapping)
    except (ValueError, KeyError, TypeError):
        return True
    return False


def _traced_preset(info, store):
    """Every rank: the preset of the workers' traced maps, read from the store (digests checked)."""
    from ...mapping.traced import traced_preset
    from ...runtime import control
    from .traced import trainer_maps

    ctl = control.Control(store, info.name, info.timeout, secret=control.job_secret(None))
    maps, _ = trainer_maps(ctl, info.timeout)
    cfg = info.mapping if isinstance(info.mapping, dict) else {}
    return traced_preset(maps, "traced:" + str(cfg.get("model_type", "")), cfg)


class TrainerSide:
    def __init__(self, *, client, source=None, is_sender: bool = True, info=None):
        self.client, self.source, self.is_sender = client, source, is_sender
        self.info = info
        self.sender = None
        self.group = None
        self.rank = info.rank if info is not None else 0
        self.pending = None  # the last update_weights thread (joined, bounded, before the next round)
        self.last_send = None  # rank 0: the last send_weights timed (start, push, update_weights, finish, total)

    @classmethod
    def trainer_init(cls, init_info, *, client, source=None):
        """vLLM 0.32 / 0.33's form; the engine built for 0.26 takes ``(config, init_info, ...)``."""
        return cls._setup(init_info, client, source)

    @classmethod
    def _new(cls, info, client, source, config):
        return cls(client=client, source=source, is_sender=info.is_sender, info=info)

    @classmethod
    def _setup(cls, init_info, client, source, config=None):
        from ...runtime import control
        from ...runtime.program import get_preset
        from ...runtime.sender import Sender
        from .proof import trainer_check

        info = init_info
        if not isinstance(info, WxferTrainerInitInfo):
            raise TypeError(
                f"wxfer trainer engine: init_info must be a WxferTrainerInitInfo, got {type(info).__name__}"
            )
        self = cls._new(info, client, source, config)
        model = with_persistent_buffers(_module_of(source))
        traced = uses_trace(info)
        preset = None if traced else get_preset(info.mapping)
        self.group = control.gloo_group(info.timeout)
        store, err, call = info.store, None, None
        if self.is_sender:
            try:
                store = control.resolve_store(info.store, True, info.timeout)
                ctl = control.Control(store, info.name, info.timeout, secret=control.job_secret(None))
                winfo = dict(
                    store=info.store,
                    name=info.name,
                    timeout=info.timeout,
                    transport=info.transport,
                    proof=info.proof,  # traced: the post-processing proof on the worker's own map
                    proof_layers=info.proof_layers,
                    replicas=info.replicas,
                    traced=traced,
                    delta_staging=info.delta_staging if info.delta else 0,
                    **(dict(extra=dict(delta=True)) if info.delta else {}),  # the worker's rewrite check
                    **(dict(mapping=None) if traced else _worker_mapping(info.mapping)),
                )
                call = _Call(client.init_weight_transfer_engine, winfo)
                alive = lambda: call.error and f"{type(call.error).__name__}: {call.error}"
                if traced:
                    self.traced = _checked_maps(ctl, info, alive)
                elif not info.proof:  # a worker that refuses fails the setup now, not at the Senders' timeout
                    _wait_first_receiver(ctl, alive, info.timeout)
                else:
                    try:
                        self.proof = trainer_check(ctl, preset, info.timeout, alive)
                    except Exception as e:  # noqa: BLE001 -- the workers learn it from the plan status
                        ctl.set("status", control.encode_result(None, f"{type(e).__name__}: {e}"))
                        _linger(ctl, getattr(e, "workers", 0), min(info.timeout, 10.0))
                        raise
            except Exception as e:  # noqa: BLE001 -- raised on every rank by agree()
                err = f"{type(e).__name__}: {e}"
        control.agree(self.group, err, self.rank, "the vLLM init_weight_transfer_engine and layout proof", info.timeout)
        if traced:
            err = None
            try:
                here = store if self.is_sender else control.resolve_store(info.store, False, info.timeout)
                preset = _traced_preset(info, here)
            except Exception as e:  # noqa: BLE001 -- raised on every rank by agree()
                err = f"{type(e).__name__}: {e}"
            control.agree(self.group, err, self.rank, "reading the workers' traced maps", info.timeout)
        self.sender = Sender(
            model,
            mapping=preset,
            store=store,
            host_store=False,
            name=info.name,
            timeout=info.timeout,
            transport=info.transport,
            watermark=info.watermark,
            delta=info.delta,
        )
        err = call.result(info.timeout, "init_weight_transfer_engine") if call is not None else None
        control.agree(self.group, err, self.rank, "the vLLM init_weight_transfer_engine", info.timeout)
        return self

    def send_weights(self, version: int | None = None) -> int:
        """Push the current weights as `version` (default: the next) and commit them in vLLM;
        returns the version.  Every rank."""
        from ...runtime import control

        info, s = self.info, self.sender
        v = s.version + 1 if version is None else int(version)
        call, err = None, None
        t = [time.monotonic()]  # rank 0's parts timed: last_send (start, push, update_weights, finish)
        if self.is_sender:
            if self.pending is not None:  # a previous round's RPC that failed: bounded, then dropped
                self.pending.result(info.update_timeout, "the previous update_weights")
                self.pending = None
            try:
                try:
                    self.client.start_weight_update()
                except Exception as e:  # noqa: BLE001
                    # vLLM keeps its update session open after a finish_weight_update that raised:
                    # this round's update_weights and finish_weight_update complete that one
                    if "already active" not in str(e):
                        raise
                call = self.pending = _Call(
                    self.client.update_weights, {"version": v, "timeout": float(info.update_timeout)}
                )
            except Exception as e:  # noqa: BLE001
                err = f"start_weight_update raised {type(e).__name__}: {e}"
        t.append(time.monotonic())
        s.push(version=v)  # raises on every rank when any rank fails (the Sender's own agreement)
        t.append(time.monotonic())
        if call is not None:
            err = call.result(info.update_timeout + 30.0, f"update_weights (version {v})")
            t.append(time.monotonic())
            if err is None:
                self.pending = None
                try:
                    self._finish(v)
                except Exception as e:  # noqa: BLE001
                    err = f"finish_weight_update raised {type(e).__name__}: {e}"
                t.append(time.monotonic())
        control.agree(self.group, err, self.rank, f"committing version {v} in vLLM", info.timeout)
        if len(t) == 5:
            keys = ("start_s", "push_s", "update_weights_s", "finish_s")
            self.last_send = dict(version=v, total_s=t[4] - t[0], **{k: t[i + 1] - t[i] for i, k in enumerate(keys)})
        return v

    def _finish(self, v: int) -> None:
        if takes_weight_version(self.client.finish_weight_update) is False:  # vLLM 0.26: no weight version
            self.client.finish_weight_update()
            return
        try:
            self.client.finish_weight_update(weight_version=str(v))
        except TypeError as e:  # a client of a vLLM before weight_version
            if "weight_version" not in str(e):
                raise
            self.client.finish_weight_update()

    def shutdown(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None


def build_trainer_class(base, shape: str):
    """wxfer's trainer engine over vLLM's `base` (``TrainerWeightTransferEngine``) of API `shape`
    (versions.py), with that ABC's ``__init__`` and ``trainer_init`` signatures."""
    if shape == "0.26":

        class WxferTrainerWeightTransferEngine(TrainerSide, base):
            def __init__(self, config=None, *, client, source=None, is_sender: bool = True, info=None):
                base.__init__(self, config, client=client, source=source, is_sender=is_sender)
                TrainerSide.__init__(self, client=client, source=source, is_sender=is_sender, info=info)

            @classmethod
            def trainer_init(cls, config, init_info, *, client, source=None):
                backend = getattr(config, "backend", BACKEND)
                if backend != BACKEND:
                    raise ValueError(f"wxfer trainer engine: config.backend is {backend!r}, not {BACKEND!r}")
                return cls._setup(init_info, client, source, config)

            @classmethod
            def _new(cls, info, client, source, config):
                return cls(config, client=client, source=source, is_sender=info.is_sender, info=info)

    elif shape == "0.32":

        class WxferTrainerWeightTransferEngine(TrainerSide, base):
            def __init__(self, *, client, source=None, is_sender: bool = True, info=None):
                base.__init__(self, client=client, source=source, is_sender=is_sender)
                TrainerSide.__init__(self, client=client, source=source, is_sender=is_sender, info=info)

            @classmethod
            def trainer_init(cls, init_info, *, client, source=None):
                return cls._setup(init_info, client, source)

    elif shape == "0.33":

        class WxferTrainerWeightTransferEngine(TrainerSide, base):
            def __init__(self, *, client, source=None, is_sender: bool = True, rank: int = 0, info=None):
                base.__init__(self, client=client, source=source, is_sender=is_sender, rank=rank)
                TrainerSide.__init__(self, client=client, source=source, is_sender=is_sender, info=info)

            @classmethod
            def trainer_init(cls, init_info, *, client, source=None):
                return cls._setup(init_info, client, source)

            @classmethod
            def _new(cls, info, client, source, config):
                return cls(client=client, source=source, is_sender=info.is_sender, rank=info.rank, info=info)

    else:
        raise ValueError(f"wxfer: no trainer engine for the vLLM API {shape!r}")
    c = WxferTrainerWeightTransferEngine
    c.__doc__ = "wxfer's trainer-side vLLM weight-transfer engine (see wxfer.integrations.vllm.trainer)."
    c.__module__, c.__qualname__ = __name__, c.__name__
    c.init_info_cls, c.wxfer_vllm_api = WxferTrainerInitInfo, shape
    return c


_CLASSES: dict = {}


def _trainer_class():
    return built_class(_CLASSES, "trainer", "TrainerWeightTransferEngine", build_trainer_class)


__getattr__ = lazy_attr(__name__, "WxferTrainerWeightTransferEngine", _trainer_class)
