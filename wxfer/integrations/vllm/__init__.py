"""wxfer in vLLM.

- ``WeightTransferConfig(backend="wxfer")``: the worker side is engine.py, the trainer side
  trainer.py, built for the weight-transfer API of vLLM 0.26, 0.32 or 0.33 (versions.py; run on
  vllm-cpu 0.32.0 only, 0.26 and 0.33 matched to their sources); both are registered in vLLM's
  factories when this package is imported with vLLM installed, and in every vLLM process by the
  ``vllm.general_plugins`` entry point ``wxfer`` (``register``), a no-op without vLLM.  Another
  vLLM version is detected here (``VLLM_API``) and refused by name when the backend is built.
- ``WxferWorkerExtension`` (extension.py): the worker extension class for a vLLM before the registry.
- layout.py / proof.py / postproc.py: what the mapping writes, and the proof against vLLM's loader
  and post-processing (direct / finalize / refused; ``Finalizer`` hooks).
- cpu.py: ``keep_cpu_weights`` for vLLM's CPU platform.

Everything here imports without vLLM; docs/vllm.md has the usage.
"""

from __future__ import annotations

import importlib.util

from ... import envs
from .cpu import keep_cpu_weights
from .engine import WorkerSide, WxferInitInfo, WxferUpdateInfo
from .extension import WxferWorkerExtension, parallel_info
from .layout import expected_destinations, quant_of, select_parameters, vllm_names
from .postproc import FINALIZER_HOOKS, Finalizer
from .trainer import BACKEND, LLMClient, TrainerSide, WxferTrainerInitInfo
from .versions import UnsupportedVLLM, api

VLLM_API: str | None = None  # "0.26" / "0.32" / "0.33" once register() found that vLLM
VLLM_UNSUPPORTED: str | None = None  # why this vLLM is not supported (raised when the backend is built)


def register() -> bool:
    """Register the ``wxfer`` backend in vLLM's worker and trainer factories (idempotent);
    with $WXFER_VLLM_CPU_KEEP_WEIGHTS=1 also ``keep_cpu_weights()``.  Returns whether vLLM was there."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory
    except ImportError:  # no vLLM, or one before the weight-transfer registry
        return False
    global VLLM_API, VLLM_UNSUPPORTED

    try:  # never raised here: vLLM calls this plugin unguarded in every process
        VLLM_API, VLLM_UNSUPPORTED = api(), None
    except UnsupportedVLLM as e:
        VLLM_API, VLLM_UNSUPPORTED = None, str(e)

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__ + ".engine", "WxferWeightTransferEngine")
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, __name__ + ".trainer", "WxferTrainerWeightTransferEngine")
    if envs.get("WXFER_VLLM_CPU_KEEP_WEIGHTS") == "1":
        keep_cpu_weights()
    return True


if importlib.util.find_spec("vllm") is not None:  # no vLLM: nothing to import
    register()

__all__ = [
    "BACKEND",
    "LLMClient",
    "TrainerSide",
    "UnsupportedVLLM",
    "VLLM_API",
    "VLLM_UNSUPPORTED",
    "WorkerSide",
    "WxferInitInfo",
    "WxferTrainerInitInfo",
    "WxferUpdateInfo",
    "WxferWorkerExtension",
    "FINALIZER_HOOKS",
    "Finalizer",
    "expected_destinations",
    "keep_cpu_weights",
    "parallel_info",
    "quant_of",
    "register",
    "select_parameters",
    "vllm_names",
]
