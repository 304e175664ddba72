"""Plugging the wxfer Receiver into vLLM workers, without changing vLLM.

vLLM lets a user add methods to every worker with a *worker extension class*, and call
them on all workers with ``collective_rpc``.  This module is such a class::

    from vllm import LLM
    llm = LLM(model="Qwen/Qwen3-8B", tensor_parallel_size=2,
              worker_extension_cls="wxfer.integrations.vllm.WxferWorkerExtension")
    # once, while the trainers construct their wxfer.Sender:
    llm.collective_rpc("wxfer_setup", kwargs=dict(store="trainer0:29650", mapping="qwen3-8b",
                                                  replica=0, replicas=4))
    # before each generation round, make sure step s is in place:
    llm.collective_rpc("wxfer_wait", args=(s, 60.0))

(vLLM 0.32 has a weight-transfer registry: prefer ``WeightTransferConfig(backend="wxfer")``,
wxfer.integrations.vllm.engine.)  Each worker registers its own weight memory (the model's parameters, in vLLM's layout:
fused ``qkv_proj``/``gate_up_proj``, FP8 ``weight_scale_inv``...), publishes it, answers
the trainers' connection handshakes and then runs nothing per step: the trainers write
straight into the weights.  Only the parameters the mapping writes are registered;
others (activation scales, KV-cache scales) are listed in the setup result.

vLLM is not a dependency: everything that touches it is in ``parallel_info`` /
``_vllm_parallel_info`` and ``_vllm_model``, and the rest is plain Python tested without vLLM.
"""

from __future__ import annotations

from .layout import quant_of, writable_parameters


def parallel_info(vllm_config) -> dict:
    """tp, rank, dp (replicas) and dp_index (this replica) and ep of a vLLM worker.

    The replica is ``parallel_config.data_parallel_index``: for a dense model vLLM resets
    every engine's ``data_parallel_rank`` to 0, so that one would make every replica claim
    slot 0 (``data_parallel_rank`` only where a vLLM before the index is running)."""
    from vllm.distributed import parallel_state as ps

    pc = vllm_config.parallel_config
    idx = getattr(pc, "data_parallel_index", None)
    return dict(
        tp=ps.get_tensor_model_parallel_world_size(),
        rank=ps.get_tensor_model_parallel_rank(),
        dp_rank=int(idx if idx is not None else getattr(pc, "data_parallel_rank", 0)),
        dp=int(getattr(pc, "data_parallel_size", 1)),
        ep=bool(getattr(pc, "enable_expert_parallel", False)),
    )


def receiver_place(par: dict, replica=None, replicas=None) -> dict:
    """The ``Receiver`` keywords that place one vLLM worker: its replica (the DP rank unless
    given), the replica count (the DP size unless given), and its tp rank, tp size and EP flag
    from ``parallel_info``. Both entry points (this extension and ``engine.py``) build theirs here."""
    return dict(
        replica=par["dp_rank"] if replica is None else int(replica),
        rank=par["rank"],
        tp=par["tp"],
        replicas=par["dp"] if replicas is None else int(replicas),
        ep=par["ep"],
    )


def worker_place(par: dict, replica=None, replicas=None) -> dict:
    """``receiver_place``'s keywords and the worker's GPU index in the job (replica * tp + rank):
    the place the worker's published records carry (its proof, its traced map)."""
    place = receiver_place(par, replica, replicas)
    return dict(gpu=place["replica"] * place["tp"] + place["rank"], **place)


class WxferWorkerExtension:
    """Methods added to every vLLM worker (``worker_extension_cls``)."""

    _wxfer = None

    # ---- the two places that know vLLM's internals
    def _vllm_parallel_info(self) -> dict:
        return parallel_info(self.vllm_config)

    def _vllm_model(self):
        return self.model_runner.model

    def _vllm_hf_config(self) -> dict:
        return self.vllm_config.model_config.hf_config.to_dict()

    # ---- the RPCs
    def wxfer_setup(
        self,
        store=None,
        mapping=None,
        replica: int | None = None,
        replicas: int | None = None,
        name: str = "default",
        timeout: float = 300.0,
        skip: str | None = None,
        transport: str = "auto",
    ) -> dict:
        from ...runtime.receiver import Receiver

        info = self._vllm_parallel_info()
        model = self._vllm_model()
        named = list(model.named_parameters())
        quant = quant_of(named)
        hf = self._vllm_hf_config()
        if isinstance(mapping, (str, dict)) and hf.get("quantization_config"):
            # the rules follow the engine's quantization config (an FP8 MoE router unless excluded);
            # the trainers pass the same HF config dict
            from ...mapping import from_config
            from ...runtime.program import get_preset

            base = get_preset(mapping)
            mapping = from_config(base.name, dict(base.config, **hf))
        sel, left = writable_parameters(named, mapping, hf, info, quant, skip, f"vLLM worker tp rank {info['rank']}")
        place = receiver_place(info, replica, replicas)
        self._wxfer = Receiver(
            sel, mapping=mapping, store=store, name=name, timeout=timeout, transport=transport, **place
        )
        out = self._wxfer.stats()
        out.update(left_out=left, quant=quant)
        return out

    def wxfer_version(self) -> int:
        return self._wxfer.version() if self._wxfer is not None else -1

    def wxfer_wait(self, version: int, timeout: float = 60.0) -> int:
        if self._wxfer is None:
            raise RuntimeError("wxfer: call wxfer_setup first")
        return self._wxfer.wait_version(version, timeout)

    def wxfer_close(self) -> None:
        if self._wxfer is not None:
            self._wxfer.close()
            self._wxfer = None
