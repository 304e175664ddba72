"""vLLM's CPU platform, kept writable: on CPU, ``process_weights_after_loading`` hands each linear
layer to ``dispatch_cpu_unquantized_gemm``, which computes from a packed copy of the weight
(oneDNN / sgl-kernel) and replaces the parameter by an empty tensor (shape [0]); one-sided writes
into the parameter would then change nothing.  ``keep_cpu_weights()`` (called in the worker
process before the model loads: the ``vllm.general_plugins`` entry point does it when
$WXFER_VLLM_CPU_KEEP_WEIGHTS=1) makes that dispatch use ``torch.nn.functional.linear`` on the
parameter itself, so the weights stay in place; slower GEMMs, for tests and CPU experiments.
Without it the post-processing proof makes each such layer finalize (its loader-layout weight kept,
vLLM's dispatch re-run after every update; postproc.py): both are proven, the choice is GEMM speed
against finalize seconds per update."""

from __future__ import annotations


def keep_cpu_weights() -> bool:
    """Patch vLLM's CPU GEMM dispatch to compute from the parameters in place. Returns whether
    vLLM was there to patch."""
    try:
        import torch
        import vllm.model_executor.layers.utils as U
    except ImportError:
        return False
    if getattr(U.dispatch_cpu_unquantized_gemm, "_wxfer_keeps_weights", False):
        return True

    def dispatch_cpu_unquantized_gemm(layer, remove_weight: bool) -> None:
        if layer.weight.ndim != 2:  # vLLM's own dispatch leaves these (MoE experts, convs) alone too
            return
        layer.cpu_linear = torch.nn.functional.linear

    dispatch_cpu_unquantized_gemm._wxfer_keeps_weights = True
    dispatch_cpu_unquantized_gemm._wxfer_original = U.dispatch_cpu_unquantized_gemm
    U.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm
    return True
