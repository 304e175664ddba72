"""What vLLM's post-processing does to the memory wxfer writes, decided by proof at setup.

``classify`` runs on an inference worker, inside ``init_transfer_engine``, over the worker's own
model (already loaded and post-processed by vLLM):

1. every tensor of every module (parameters, buffers and plain tensor attributes such as MLA's
   ``W_UV``, all layers) is saved, with each module's own attributes;
2. the reference: vLLM's first load of the seeded checkpoint tensors, in a fresh instance of the
   worker's model class (``initialize_model`` with the worker's config, dropped afterwards): its
   ``load_weights``, then ``model_loader.utils.process_weights_after_loading``; every tensor's
   shape, dtype and SHA-256 is kept, and which module attributes post-processing built (a new
   object: e.g. vLLM's CPU GEMM closure over a packed copy of the weight).  Not vLLM's reload
   path (``model_loader.reload``): in 0.32 its fused-MoE methods take a "weight update" branch
   that skips the experts' own post-processing (the CPU MoE's prepack), so it is not what the
   kernels compute from;
3. wxfer's side, on the live model: the mapping's packed bytes for the same
   seeded tensors (the trainers' reference packing) written where wxfer writes them;
4. a module all of whose tensors equal the reference, and none of whose attributes
   post-processing rebuilds, is **direct**: its written parameters are written one-sided into
   their final storage, its other tensors are constant (equal before and after);
5. any other module is offered to the finalizer hooks (``FINALIZER_HOOKS``, first match wins);
   the finalizer is run on the bytes written into its kept memory and the module compared again:
   equal is **finalize**, else (or with no finalizer) every differing tensor is **refused**, by
   name, with what differs (a written tensor of a finalize module for which vLLM recorded no
   loader layout, a bias, which vLLM's reload leaves in place, is written into its live storage
   and is direct: the comparison after finalize covers it);
6. everything saved is put back (the engine serves its previous weights until the first push).

The loader layout of a module whose post-processing replaced its parameters comes from vLLM
itself: ``initialize_model`` records, for every module, its parameters and buffers as meta
tensors before anything is loaded (``record_metadata_for_reloading``: shape, dtype, stride and
the attributes, ``weight_loader`` included, that vLLM's reload path restores).  wxfer allocates
real memory of those shapes once (the *kept* memory), registers it with the Receiver in place of
the final storage, and ``finish_weight_update`` re-runs the module's post-processing from it.

The finalizer interface (how other code adds one)::

    Finalizer(module_name, params, run, late=False)

- ``module_name``: the vLLM module's qualified name (``model.layers.0.mlp.experts``);
- ``params``: ``{attribute name: tensor}`` the kept loader-layout memory wxfer writes for this
  module (registered with the Receiver instead of the final storage); may be empty when the
  finalizer only re-derives tensors from parameters written directly (MLA's ``W_UV`` /
  ``W_UK_T`` from ``kv_b_proj``);
- ``run()``: brings the module's final tensors to what vLLM's post-processing makes of those
  bytes, in the final storage (addresses kept: CUDA graphs hold them);
- ``late``: run after the others (attention layers read other modules' weights).

A hook is ``hook(model, name, module, ctx) -> Finalizer | None`` appended to (or inserted at the
front of) ``FINALIZER_HOOKS``; ``ctx`` is a ``FinalizeContext`` (the model config, the
loader-layout metadata vLLM recorded for the module).  The default hook,
``rerun_post_processing``, re-runs vLLM's own per-module post-processing
(``quant_method.process_weights_after_loading(module)``, or an attention layer's
``process_weights_after_loading(dtype)``) on the kept memory and copies the results into the
module's final tensors.  Whatever a hook returns is kept only if the proof then finds the
module equal to vLLM's reference.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

import torch

# ------------------------------------------------------------------ the finalizer interface


@dataclass
class Finalizer:
    module_name: str
    params: dict  # attribute name -> kept loader-layout tensor (what wxfer writes)
    run: object  # callable() -> None
    late: bool = False
    seconds: list = field(default_factory=list)  # per run, newest last
    # the proof's run changed the kept memory itself (post-processing in place): a delta push,
    # which writes only the bytes that changed since the last push, would build on those bytes
    rewrites_kept: bool = False

    @property
    def kept_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.params.values())

    def __call__(self) -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            self.run()
        s = time.perf_counter() - t0
        self.seconds.append(s)
        del self.seconds[:-16]
        return s


@dataclass
class FinalizeContext:
    model_config: object  # vLLM's ModelConfig (its dtype for attention layers)
    loader_params: dict  # name -> meta tensor vLLM recorded before loading
    loader_buffers: dict


FINALIZER_HOOKS: list = []


def _loader_metadata(module):
    """(params, buffers) meta tensors vLLM recorded for `module` at build time, or None."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except ImportError:
        return None
    info = LAYERWISE_INFO.get(module)
    return None if info is None else info.restore_metadata


def _post_process(module, model_config) -> bool:
    """vLLM's own post-processing of one module (what model_loader.utils runs per module);
    False when the module has none."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    qm = getattr(module, "quant_method", None)
    if isinstance(qm, QuantizeMethodBase):
        if hasattr(module, "_already_called_process_weights_after_loading"):
            delattr(module, "_already_called_process_weights_after_loading")
        if getattr(qm, "moe_kernel", None) is not None:
            # vLLM 0.32's fused-MoE methods take a "weight update" branch once their kernel exists:
            # they copy the loader layout into the old storage and skip the experts' own
            # post-processing (the CPU MoE's prepack); the first load's branch is the layout the
            # kernel computes from, so the re-run takes that one (the proof compares with it)
            qm.moe_kernel = None
        qm.process_weights_after_loading(module)
        if hasattr(module, "update_param_tp_status"):
            module.update_param_tp_status()
        return True
    if is_deferred_attention_layer(module):
        module.process_weights_after_loading(model_config.dtype)
        return True
    return False


def _loader_view(kept: torch.Tensor, meta: torch.Tensor, module) -> torch.Tensor:
    """A tensor over `kept`'s storage carrying the class and attributes vLLM recorded (its
    weight_loader bound to `module` again, the reload path's layer reference undone)."""
    from types import MethodType

    t = kept.detach()
    t.__class__ = meta.__class__
    d = dict(meta.__dict__)
    for k, v in d.items():
        if isinstance(v, MethodType) and not isinstance(v.__self__, torch.nn.Module):
            d[k] = v.__func__.__get__(module)  # vLLM's sanitized reference to the layer
    t.__dict__ = d
    return t


def rerun_post_processing(model, name, module, ctx: FinalizeContext):
    """The default hook: kept memory in the loader layout vLLM recorded for `module`, and a run
    that puts it in place of the module's parameters, re-runs vLLM's post-processing of the
    module and copies what it made into the module's final tensors."""
    if not ctx.loader_params:
        return None
    qm = getattr(module, "quant_method", None)
    from vllm.model_executor.layers.attention import is_deferred_attention_layer

    late = is_deferred_attention_layer(module)
    if qm is None and not late:
        return None
    dev = next((t.device for t in module._parameters.values() if t is not None), torch.device("cpu"))
    kept = {
        n: torch.empty_strided(tuple(m.shape), tuple(m.stride()), dtype=m.dtype, device=dev)
        for n, m in ctx.loader_params.items()
    }

    def run():
        entries = dict(module._parameters)  # None entries too (a linear's bias=None)
        final_p = {n: t for n, t in entries.items() if t is not None}
        bentries = dict(module._buffers)
        final_b = {n: t for n, t in bentries.items() if t is not None}
        for n in kept:
            delattr(module, n)
            module.register_parameter(n, _loader_view(kept[n], ctx.loader_params[n], module))
        try:
            _post_process(module, ctx.model_config)
            made = {n: getattr(module, n, None) for n in list(final_p) + list(final_b)}
        finally:  # the module's own tensors back (their addresses: CUDA graphs hold them)
            module._parameters.clear()
            module._parameters.update(entries)
            module._buffers.clear()
            module._buffers.update(bentries)
        bad = []
        for n, t in list(final_p.items()) + list(final_b.items()):
            m = made[n]
            if m is None or tuple(m.shape) != tuple(t.shape) or m.dtype != t.dtype:
                got = None if m is None else (tuple(m.shape), str(m.dtype))
                bad.append(f"{name}.{n}: post-processing made {got}, the final tensor is {(tuple(t.shape), t.dtype)}")
            elif m.data_ptr() != t.data_ptr():
                t.data.copy_(m)
        if bad:
            raise RuntimeError("wxfer: finalize: " + "; ".join(bad))

    return Finalizer(name, kept, run, late)


FINALIZER_HOOKS.append(rerun_post_processing)


def _mla_hook(model, name, module, ctx=None):
    """MLA attention (mla.py): vLLM's own MLAAttention post-processing re-run after kv_b_proj."""
    from .mla import mla_hook

    return mla_hook(model, name, module, ctx)


FINALIZER_HOOKS.insert(0, _mla_hook)


# ------------------------------------------------------------------ the proof


def _tensors(module, derived=None) -> dict:
    """name -> tensor: a module's own parameters and buffers, and its plain tensor attributes
    (all of them, or those named in `derived`: the ones vLLM's post-processing sets, such as
    MLA's W_UV; the engine's own state bound later, the KV cache, is not the weights')."""
    out = {n: t for n, t in module._parameters.items() if t is not None}
    out.update({n: t for n, t in module._buffers.items() if t is not None})
    for n, v in vars(module).items():
        if isinstance(v, torch.Tensor) and n not in out and (derived is None or n in derived):
            out[n] = v
    return out


# torch's own bookkeeping, and the flags vLLM's reload path itself sets and restores
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module())) | {
    "_do_torchao_reload",
    "_original_do_torchao_reload",
    "_already_called_process_weights_after_loading",
}


def _attrs(module) -> dict:
    """A module's own attributes other than torch's bookkeeping and its tensors."""
    return {k: v for k, v in vars(module).items() if k not in _MODULE_INTERNALS and not isinstance(v, torch.Tensor)}


def _sha(t: torch.Tensor) -> str:
    t = t.detach()
    if t.numel() == 0:
        return hashlib.sha256(b"").hexdigest()
    b = t.contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()
    return hashlib.sha256(b).hexdigest()


def _fingerprint(t: torch.Tensor):
    return (tuple(t.shape), str(t.dtype).replace("torch.", ""), _sha(t))


class _Saved:
    """Every module's tensors (contents) and attributes, to be put back."""

    def __init__(self, modules):
        self.modules = modules
        self.state = {}
        for name, m in modules.items():
            self.state[name] = (
                dict(m._parameters),
                dict(m._buffers),
                _attrs(m),
                {n: v for n, v in vars(m).items() if isinstance(v, torch.Tensor)},
                {n: t.detach().to("cpu", copy=True) for n, t in _tensors(m).items()},  # host memory
            )

    def restore(self, only=None):
        with torch.no_grad():
            for name, m in self.modules.items():
                if only is not None and name not in only:
                    continue
                params, buffers, attrs, tattrs, data = self.state[name]
                m._parameters.clear()
                m._parameters.update(params)
                m._buffers.clear()
                m._buffers.update(buffers)
                for k in [k for k in _attrs(m) if k not in attrs]:
                    delattr(m, k)
                m.__dict__.update(attrs)
                m.__dict__.update(tattrs)
                for n, t in _tensors(m).items():
                    if n in data and t.shape == data[n].shape and t.dtype == data[n].dtype:
                        t.copy_(data[n])


@dataclass
class Classification:
    direct: list  # destination names written into their final storage
    finalize: list  # Finalizer, one per module (their params: what wxfer writes)
    finalize_dests: dict  # destination name -> (finalizer, attribute name)
    refused: list  # "model name: why"
    constant: list  # model tensor names neither written nor changed by post-processing
    seconds: float = 0.0

    @property
    def kept_bytes(self) -> int:
        return sum(f.kept_bytes for f in self.finalize)

    def summary(self) -> dict:
        return dict(
            direct=len(self.direct),
            finalize={f.module_name: sorted(f.params) for f in self.finalize},
            refused=list(self.refused),
            constant=len(self.constant),
            kept_bytes=self.kept_bytes,
            seconds=self.seconds,
        )


def _fresh_model(vllm_config, device):
    """A second instance of the worker's model class, built by vLLM's ``initialize_model`` for
    the same config (the attention layers' registry entries of the live model kept aside
    meanwhile: vLLM refuses a layer name twice)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    ctx = vllm_config.compilation_config.static_forward_context
    kept = dict(ctx)
    ctx.clear()
    try:
        with set_current_vllm_config(vllm_config), set_default_torch_dtype(vllm_config.model_config.dtype):
            with torch.device(device):
                return initialize_model(vllm_config=vllm_config, model_config=vllm_config.model_config)
    finally:
        ctx.clear()
        ctx.update(kept)


def _reference(vllm_config, device, checkpoint):
    """(tensors, built attributes) of vLLM's first load of `checkpoint`: a fresh model, its
    ``load_weights``, then vLLM's ``process_weights_after_loading`` (model_loader.utils)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    ref = _fresh_model(vllm_config, device)
    with set_current_vllm_config(vllm_config), torch.no_grad():
        ref.load_weights(iter(checkpoint))
        before = {m: dict(vars(mod)) for m, mod in ref.named_modules()}
        process_weights_after_loading(ref, vllm_config.model_config, torch.device(device))
    derived = {
        m: {n for n, v in vars(mod).items() if isinstance(v, torch.Tensor) and before[m].get(n, _MISSING) is not v}
        for m, mod in ref.named_modules()
    }
    tensors = _state(dict(ref.named_modules()), derived)
    built = _fold(
        {
            m: {k: v for k, v in _attrs(mod).items() if before[m].get(k, _MISSING) is not v}
            for m, mod in ref.named_modules()
        }
    )
    del ref
    return tensors, built, derived


_MISSING = object()


def _root(name: str) -> tuple:
    """(owner module name, prefix): a quant method (an nn.Module of vLLM's) and what hangs below it
    belong to the layer that owns it: its post-processing is that layer's."""
    i = name.find(".quant_method")
    if i < 0 and name.startswith("quant_method"):
        i = 0
    if i < 0:
        return name, ""
    return name[:i], name[i + 1 if i else 0 :] + "."


def _fold(per_module: dict) -> dict:
    """{module: {name: x}} -> {owner module: {prefixed name: x}} (see _root)."""
    out = {}
    for m, d in per_module.items():
        r, pre = _root(m)
        out.setdefault(r, {}).update({pre + k: v for k, v in d.items()})
    return out


def _state(modules: dict, derived: dict) -> dict:
    return _fold(
        {m: {n: _fingerprint(t) for n, t in _tensors(mod, derived.get(m, ())).items()} for m, mod in modules.items()}
    )


def _write(t: torch.Tensor, b: torch.Tensor) -> None:
    t.detach().view(-1).view(torch.uint8).copy_(b.to(t.device))


def _fits(t, shape, dtype) -> bool:
    return t is not None and tuple(t.shape) == tuple(shape) and str(t.dtype).replace("torch.", "") == dtype


def _diff(name, ref, got) -> str:
    if ref[:2] != got[:2]:
        return f"{name}: vLLM's post-processing makes {ref[0]} {ref[1]}, wxfer leaves {got[0]} {got[1]}"
    return f"{name}: bytes differ from vLLM's post-processing (sha256 {got[2][:12]} != {ref[2][:12]})"


class _Proof:
    """The state of one classify(): the live modules, the reference, what the mapping writes."""

    def __init__(self, model, vllm_config, device, dests, packed, checkpoint, hooks):
        self.model, self.dests, self.packed, self.hooks = model, dests, packed, hooks
        self.model_config = vllm_config.model_config
        self.modules = dict(model.named_modules())
        self.saved = _Saved(self.modules)
        self.by_module = {}  # module name -> {attribute: destination}
        for d, (mname, _, _) in dests.items():
            mod, _, attr = mname.rpartition(".")
            self.by_module.setdefault(mod, {})[attr] = d
        self.ref, built, self.derived = _reference(vllm_config, device, checkpoint)
        missing = sorted(set(_fold({m: {} for m in self.modules})) ^ set(self.ref))
        if missing:
            raise RuntimeError(f"wxfer: postproc: the reference model's modules are not the live ones: {missing[:6]}")
        # what post-processing builds from the weights (a new object, not the one the live module holds)
        live = _fold({m: self.saved.state[m][2] for m in self.modules})
        self.rebuilt = {m: sorted(k for k, v in built[m].items() if live[m].get(k, _MISSING) is not v) for m in built}
        self.roots = {m: mod for m, mod in self.modules.items() if _root(m) == (m, "")}

    def differ(self, m, got) -> list:
        ref = self.ref.get(m, {})
        return [n for n in sorted(set(ref) | set(got)) if ref.get(n) != got.get(n)]

    def direct_pass(self):
        """(direct, constant, [(module, its module object, written, differing names)] to finalize)."""
        with torch.no_grad():  # the bytes into the final storage where its layout is the loader's
            for d, (mname, shape, dtype) in self.dests.items():
                mod, _, attr = mname.rpartition(".")
                t = _tensors(self.modules[mod]).get(attr)
                if _fits(t, shape, dtype):
                    _write(t, self.packed[d])
        direct, constant, todo = [], [], []
        now = _state(self.modules, self.derived)
        for m, mod in self.roots.items():
            got, written = now.get(m, {}), self.by_module.get(m, {})
            differ = self.differ(m, got)
            if not differ and not self.rebuilt.get(m):
                direct += list(written.values())
                constant += [f"{m}.{n}" if m else n for n in got if n not in written]
            else:
                todo.append((m, mod, written, differ))
        return direct, constant, todo

    def finalizer(self, m, mod, written):
        """(a hook's Finalizer whose kept memory has the mapping's layout, or None, why not)."""
        meta = _loader_metadata(mod) or ({}, {})
        ctx = FinalizeContext(self.model_config, dict(meta[0]), dict(meta[1]))
        f = next((f for h in self.hooks if (f := h(self.model, m, mod, ctx)) is not None), None)
        for attr, d in written.items() if f is not None else ():
            _, shape, dtype = self.dests[d]
            k = f.params.get(attr)
            if k is None and _fits(_tensors(mod).get(attr), shape, dtype):
                continue  # no loader layout kept for it (vLLM's reload leaves a bias in place): written live
            if not _fits(k, shape, dtype):
                have = None if k is None else (tuple(k.shape), str(k.dtype))
                return None, f"{m}.{attr}: the mapping writes {tuple(shape)} {dtype}, the loader layout is {have}"
        return f, None

    def finalize_pass(self, todo):
        """[(module, module object, written, differ, Finalizer or None, why not)], each finalizer run
        on the mapping's bytes written into its kept memory."""
        roots = {t[0] for t in todo}
        self.saved.restore(only={n for n in self.modules if _root(n)[0] in roots})
        cands = [(m, mod, written, differ, *self.finalizer(m, mod, written)) for m, mod, written, differ in todo]
        with torch.no_grad():
            # a tensor one of those modules shares with a module written in place got its old bytes
            # back (DeepSeek-V3's RoutedExperts holds its gate's e_score_correction_bias): those
            # modules' bytes are written again
            for d, (mname, shape, dtype) in self.dests.items():
                mod, _, attr = mname.rpartition(".")
                t = _tensors(self.modules[mod]).get(attr)
                if _root(mod)[0] not in roots and _fits(t, shape, dtype):
                    _write(t, self.packed[d])
            for _, mod, written, _, f, _ in cands:
                for attr, d in written.items() if f is not None else ():
                    _write(f.params[attr] if attr in f.params else _tensors(mod)[attr], self.packed[d])
            for i in sorted(range(len(cands)), key=lambda i: bool(cands[i][4] and cands[i][4].late)):
                m, mod, written, differ, f, _ = cands[i]
                try:
                    if f is not None:
                        kept = {a: _sha(t) for a, t in f.params.items()}
                        f()
                        f.rewrites_kept = any(_sha(t) != kept[a] for a, t in f.params.items())
                except Exception as e:  # noqa: BLE001 -- a refusal naming the module
                    cands[i] = (m, mod, written, differ, None, f"{m}: finalize raised {e!r}")
        return cands

    def judge(self, cands):
        """(Finalizers proven, destination -> (Finalizer, attribute), refusals, destinations of
        finalize modules written into their live storage: those no kept memory is for)."""
        fins, fdest, refused, live = [], {}, [], []
        for m, mod, written, differ, f, why in cands:
            name = lambda n, m=m: f"{m}.{n}" if m else n  # noqa: E731
            if f is not None:
                got = _state({n: x for n, x in self.modules.items() if _root(n)[0] == m}, self.derived).get(m, {})
                still = self.differ(m, got)
                if not still:
                    fins.append(f)
                    fdest.update({d: (f, attr) for attr, d in written.items() if attr in f.params})
                    live += [d for attr, d in written.items() if attr not in f.params]
                absent = ((), "absent", "")
                refused += [
                    _diff(name(n), self.ref.get(m, {}).get(n, absent), got.get(n, absent)) + " (after finalize)"
                    for n in still
                ]
                continue
            refused += [why] if why else []
            for n in differ:
                what = "written by wxfer" if n in written else "neither written by wxfer nor constant"
                refused.append(f"{name(n)}: {what}; vLLM's post-processing changes it and no finalizer applies")
            for k in self.rebuilt.get(m, []) if not differ else []:
                refused.append(
                    f"{name(k)}: vLLM's post-processing rebuilds this attribute from the weights "
                    f"({type(getattr(mod, k, None)).__name__}) and no finalizer applies"
                )
        return fins, fdest, refused, live


def classify(model, vllm_config, device, dests: dict, packed: dict, checkpoint, hooks=None) -> Classification:
    """The proof (module docstring).  dests: destination name -> (model tensor name, shape,
    dtype) the mapping writes; packed: destination name -> the mapping's bytes (uint8) for the
    seeded `checkpoint` ([(checkpoint name, tensor)] as vLLM's loader reads it)."""
    t0 = time.perf_counter()
    p = _Proof(model, vllm_config, device, dests, packed, checkpoint, FINALIZER_HOOKS if hooks is None else hooks)
    try:
        direct, constant, todo = p.direct_pass()
        fins, fdest, refused, live = p.judge(p.finalize_pass(todo))
    finally:
        p.saved.restore()
    out = Classification(sorted(direct + live), fins, fdest, refused, sorted(constant))
    out.seconds = time.perf_counter() - t0
    return out
