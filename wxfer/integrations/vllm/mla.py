"""MLA (DeepSeek-V2/V3, Kimi-K2) on a vLLM worker: bringing ``W_UV`` / ``W_UK_T`` back to what
vLLM's own post-processing makes of the ``kv_b_proj`` bytes wxfer wrote.

vLLM's ``MLAAttention.process_weights_after_loading`` dequantizes ``kv_b_proj`` (BF16 as is, FP8
block through its ``weight_scale_inv``) and keeps two BF16 copies as parameters of the attention
module: ``W_UV`` (N, L, V) and ``W_UK_T`` (N, P, L).  With a BF16 ``kv_b_proj`` they are views of
its weight (vLLM 0.32's ``split_kv_b_proj``: ``weight.to(bfloat16)`` returns the parameter
itself; the tests check it), so a write updates them; with FP8 block they are two views of one
new BF16 buffer (the dequantized ``kv_b_proj`` in its [N * (P + V), L] layout), and a one-sided
write into ``kv_b_proj`` leaves them stale.  ``kv_b_proj`` itself stays in the loader layout (vLLM marks it
``_cpu_skip_gemm_dispatch``: no CPU repacking, FP8 weight and scales kept as loaded), so wxfer
writes it directly and the copies are re-derived in ``finish_weight_update``.

The finalizer re-runs vLLM's own ``MLAAttention.process_weights_after_loading`` on the module
(no math of ours): on the plain path it calls ``replace_parameter(..., prefer_copy=True)``, which
copies into the existing ``W_UV`` / ``W_UK_T`` (same addresses, so captured graphs and any
registration stay valid), and resets the default q/k/v/prob scales to 1.0 as a fresh load does.
``run()`` checks that the addresses did not move.

Interface (the lead wires it to the finalize mechanism of ``postproc.py`` / ``engine.py``)::

    finalizers = mla_finalizers(model)     # [] for a model without MLA
    refused = mla_refusals(model)          # ["<module>: why", ...]; refuse the model if non-empty
    for f in finalizers:                   # in finish_weight_update, after the writes are fenced
        f.run()                            # and after any finalizer of kv_b_proj itself
                                           # (f.timed_run() returns its seconds, for the report)

With ``post``'s mechanism: ``postproc.FINALIZER_HOOKS.insert(0, mla_hook)``; the proof then
finds each FP8 MLA module equal to vLLM's reference after the run (finalize), a BF16 one direct.

Wiring (at merge): ``init_transfer_engine`` refuses when ``mla_refusals(model)`` or
``draft_refusal(vllm_config)`` says so (these replace the MLA lines of ``layout.refusals``), keeps
``mla_finalizers(model)`` beside ``post``'s finalizers, and the plan / proof treat each
finalizer's ``derives`` as parameters wxfer never writes (finalize, or direct through the alias)
rather than "neither written nor constant".

``MLAFinalizer`` fields:

- ``name``: the ``MLAAttention`` module's name in ``model.named_modules()``
  (``model.layers.0.self_attn.mla_attn.mla_attn`` in vLLM 0.32).
- ``reads``: the model's parameter names (``model.named_parameters()``) wxfer writes and the
  finalizer reads: ``...self_attn.kv_b_proj.weight`` and, for FP8 block,
  ``...self_attn.kv_b_proj.weight_scale_inv``.  They are written *direct* (loader layout).
- ``derives``: the parameter names the finalizer rewrites in place, ``<name>.W_UV`` and
  ``<name>.W_UK_T``: never written by wxfer (the plan must leave them out), *finalize* in the
  proof's classes.
- ``kept_bytes``: extra memory kept for the loader layout: 0 (vLLM keeps ``kv_b_proj`` itself).
- ``derived_bytes``: the bytes ``run()`` rewrites (``W_UV`` + ``W_UK_T``; 0 when aliased).
- ``aliased``: ``W_UV`` and ``W_UK_T`` are views of ``kv_b_proj.weight`` (BF16 ``kv_b_proj``:
  vLLM's dequantization is then ``weight.to(bfloat16)``, which returns the parameter itself, and
  the copies are slices of its transpose).  The write updates them; ``run()`` does nothing, and
  they count as *direct* (still never written on their own: the plan leaves them out).
- ``run()``: re-derives; raises ``RuntimeError`` naming the module if vLLM re-registered a
  derived parameter instead of copying into it.

``mla_refusals(model)`` names the MLA paths the finalizer does not cover (AMX_MLA, which frees
``kv_b_proj.weight`` and packs its own copies; any attention impl that overrides the no-op
``process_weights_after_loading`` of vLLM's ``AttentionImplBase`` -- by construction, not by name;
ROCm aiter FP8/FP4 BMM copies; DCP query replication, whose re-derivation is a collective;
post-processing not run yet; and any module holding ``W_UV`` / ``W_UK_T``, on itself or on its
``impl``, that is not vLLM 0.32's ``MLAAttention``, e.g. another vLLM version's layout).

``draft_refusal(vllm_config)`` is the decision for speculative decoding with a draft model (MTP,
EAGLE, a draft LM): refused by name.  vLLM 0.32 builds the draft as a separate model
(``DeepSeekMTP`` for ``method="mtp"``: per MTP layer ``enorm``, ``hnorm``, ``eh_proj``,
``shared_head.norm`` and a whole ``mtp_block`` decoder layer with its own MLA attention and MoE;
``embed_tokens`` and ``lm_head`` shared with the target), loaded from the checkpoint's
``model.layers.{num_hidden_layers + i}.*``, and updates it only in a separate session
(``start_draft_weight_update``) that wxfer's engine does not support
(``supports_draft_weight_update = False``).  A wxfer update writes the target model only, so the
draft would keep the old weights; the worker refuses it at setup instead.
"""

from __future__ import annotations

import dataclasses
import time


def _mla_modules(model):
    """(name, module) of every vLLM ``MLAAttention`` in `model`."""
    try:
        from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    except ImportError:  # no vLLM: nothing of its kind can be in the model
        return []
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MLAAttention)]


def _param_names(model) -> dict:
    """id(parameter) -> its name in ``model.named_parameters()``."""
    return {id(p): n for n, p in model.named_parameters()}


@dataclasses.dataclass
class MLAFinalizer:
    name: str
    module: object = dataclasses.field(repr=False)
    act_dtype: object
    reads: tuple
    derives: tuple
    kept_bytes: int = 0
    derived_bytes: int = 0
    aliased: bool = False

    def run(self) -> None:
        if self.aliased:  # W_UV / W_UK_T are views of kv_b_proj.weight: the write already updated them
            return
        import torch

        m = self.module
        before = {k: getattr(m, k).data_ptr() for k in ("W_UV", "W_UK_T")}
        with torch.no_grad():
            m.process_weights_after_loading(self.act_dtype)
        moved = [k for k, p in before.items() if getattr(m, k).data_ptr() != p]
        if moved:
            raise RuntimeError(
                f"wxfer: {self.name}: vLLM's post-processing re-registered {moved} instead of copying "
                "into them; the addresses the model reads moved"
            )

    def timed_run(self) -> float:
        t = time.perf_counter()
        self.run()
        return time.perf_counter() - t


def _own_post(impl) -> str | None:
    """The impl's class name if it overrides the base (no-op) process_weights_after_loading."""
    if impl is None:
        return None
    try:
        from vllm.v1.attention.backend import AttentionImplBase
    except ImportError:
        return None
    base = AttentionImplBase.process_weights_after_loading
    mine = getattr(type(impl), "process_weights_after_loading", base)
    return None if mine is base else type(impl).__name__


def _refusal(name: str, m) -> str | None:
    if getattr(m, "is_amx_bmm_enabled", False):
        return (
            f"{name}: AMX_MLA backend: vLLM replaces kv_b_proj.weight by an empty tensor and packs W_UK / W_UV "
            "into the backend's own buffers, nothing wxfer can write; select attention backend CPU_MLA"
        )
    if getattr(m, "is_aiter_triton_fp8_bmm_enabled", False) or getattr(m, "is_aiter_triton_fp4_bmm_enabled", False):
        return f"{name}: ROCm aiter FP8/FP4 BMM: W_K / W_V quantized copies, re-derivation not proven"
    impl = getattr(m, "impl", None)
    own = _own_post(impl)
    if own:
        return (
            f"{name}: attention impl {own} has its own process_weights_after_loading (its own copies of the "
            "weights); re-running it is not proven"
        )
    if getattr(m, "dcp_q_replicate", False):
        return f"{name}: decode context parallel query replication: re-derivation all-gathers W_UK_T, not proven"
    kv = getattr(m, "kv_b_proj", None)
    w = getattr(kv, "weight", None)
    if w is None or w.numel() == 0:
        return f"{name}: kv_b_proj.weight is not kept after loading"
    for k in ("W_UV", "W_UK_T"):
        if getattr(m, k, None) is None:
            return f"{name}: {k} missing: post-processing has not run on this model"
    return None


def _inside(t, base) -> bool:
    """Whether tensor `t` is a view into `base`'s memory."""
    if base.numel() == 0 or t.numel() == 0:
        return False
    lo = base.data_ptr()
    hi = lo + base.numel() * base.element_size()
    same = t.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    return same and lo <= t.data_ptr() < hi


def _derived_elsewhere(model, known) -> list[str]:
    """Modules holding MLA's derived copies (``W_UV`` / ``W_UK_T``, on themselves or their
    ``impl``) that are not vLLM 0.32's ``MLAAttention`` (another vLLM version or class): by what
    they hold, not by their name, so an unknown layout is refused rather than left stale."""
    out = []
    seen = {id(x) for m in known for x in (m, getattr(m, "impl", None))}  # nor their impls, nor a reported one
    for n, m in model.named_modules():
        if id(m) in seen:
            continue
        for owner, where in ((m, ""), (getattr(m, "impl", None), ".impl")):
            if owner is not None and any(getattr(owner, k, None) is not None for k in ("W_UV", "W_UK_T")):
                seen.add(id(owner))
                out.append(
                    f"{n}: {type(m).__name__}{where} holds MLA's derived W_UV / W_UK_T, not vLLM 0.32's "
                    "MLAAttention: re-derivation not proven"
                )
                break
    return out


def mla_refusals(model) -> list[str]:
    """One line per MLA attention module whose post-processing the finalizer does not re-run."""
    mods = _mla_modules(model)
    bad = [r for n, m in mods if (r := _refusal(n, m))]
    return bad + _derived_elsewhere(model, [m for _, m in mods])


def _finalizer(names: dict, n: str, m) -> MLAFinalizer:
    kv = m.kv_b_proj
    reads = [names[id(kv.weight)]]
    scale = getattr(kv, "weight_scale_inv", None)
    if scale is None:
        scale = getattr(kv, "weight_scale", None)
    if scale is not None:
        reads.append(names[id(scale)])
    derived = [m.W_UV, m.W_UK_T]
    aliased = all(_inside(t, kv.weight) for t in derived)
    return MLAFinalizer(
        name=n,
        module=m,
        act_dtype=m.W_UV.dtype,  # vLLM derives both at the model's dtype
        reads=tuple(reads),
        derives=(names[id(m.W_UV)], names[id(m.W_UK_T)]),
        derived_bytes=0 if aliased else sum(t.numel() * t.element_size() for t in derived),
        aliased=aliased,
    )


def mla_finalizers(model) -> list[MLAFinalizer]:
    """A finalizer per vLLM ``MLAAttention`` of `model` (after its load and post-processing).
    ValueError listing ``mla_refusals`` when some module is not covered."""
    mods = _mla_modules(model)
    bad = mla_refusals(model)
    if bad:
        raise ValueError("wxfer: MLA post-processing not covered: " + "; ".join(bad))
    names = _param_names(model)
    return [_finalizer(names, n, m) for n, m in mods]


def mla_hook(model, name, module, ctx=None, wrap=None):
    """An entry for ``postproc.FINALIZER_HOOKS`` (insert it first): for a covered vLLM
    ``MLAAttention`` module, ``postproc.Finalizer(name, {}, run, late=True)`` (no kept memory:
    ``kv_b_proj`` is written direct; late: it reads another module's weight); None for any other
    module, or a refused one (the proof then refuses it by name).  `wrap`: the Finalizer class
    (default: postproc's)."""
    mods = dict(_mla_modules(module))
    if "" not in mods or _refusal(name, module):
        return None
    f = _finalizer(_param_names(model), name, module)
    if wrap is None:
        from .postproc import Finalizer as wrap  # the finalize mechanism (helper `post`)
    return wrap(name, {}, f.run, late=True)


def derive(weight, scale=None, block=(128, 128), num_heads=None, nope=None, v=None, out_dtype=None):
    """(W_UV (N, L, V), W_UK_T (N, P, L)) from one rank's ``kv_b_proj`` [N * (P + V), L]: our own
    few torch ops, the arithmetic of vLLM 0.32's ``split_kv_b_proj`` on its plain paths (BF16 as
    is; FP8 block: float32 weight times the float32 block scale, one rounding to BF16).  Not used
    by the finalizer (which re-runs vLLM's code); the tests check it equal to vLLM's result bit
    for bit, so it can stand for the trainer-side alternative and time it on a GPU without vLLM.
    vLLM's other FP8 paths (DeepGEMM: an identity GEMM through the layer) are not this."""
    import torch

    out_dtype = out_dtype or torch.bfloat16
    if scale is None:
        w = weight.to(out_dtype)
    else:
        bn, bk = block
        s = scale.to(torch.float32).repeat_interleave(bn, 0)[: weight.shape[0]]
        s = s.repeat_interleave(bk, 1)[:, : weight.shape[1]]
        w = (weight.to(torch.float32) * s).to(out_dtype)
    L = w.shape[1]
    uk, uv = w.T.view(L, num_heads, nope + v).split([nope, v], dim=-1)
    return uv.transpose(0, 1), uk.permute(1, 2, 0)


def draft_refusal(vllm_config) -> str | None:
    """Why wxfer must not serve this engine's speculative decoding, or None: a draft model (MTP,
    EAGLE, a draft LM) holds weights of its own that a wxfer update would leave stale.  Methods
    without weights (ngram, suffix) are fine."""
    spec = getattr(vllm_config, "speculative_config", None)
    draft = getattr(spec, "draft_model_config", None) if spec is not None else None
    if draft is None:
        return None
    hf = getattr(draft, "hf_config", None)
    archs = list(getattr(hf, "architectures", None) or getattr(draft, "architectures", None) or [])
    target = getattr(getattr(vllm_config, "model_config", None), "hf_config", None)
    n = getattr(target, "num_hidden_layers", None)
    k = getattr(target, "num_nextn_predict_layers", None) or getattr(spec, "num_speculative_tokens", None)
    where = ""
    if spec.method == "mtp" and n is not None and k:
        where = " (checkpoint " + ", ".join(f"model.layers.{i}.*" for i in range(n, n + int(k))) + ")"
    return (
        f"speculative decoding method {spec.method!r}: its draft model {archs or '?'}{where} holds weights of "
        "its own that a wxfer update does not write (vLLM updates a draft only in a separate "
        "start_draft_weight_update session, which wxfer does not support); serve without speculative_config "
        "or use a backend that updates the draft"
    )
