"""The traced destination map at setup: each vLLM worker traces its model's ``load_weights``
(trace.py) and publishes the map in the trainers' store; the trainers read every worker's map,
check its digest and build the plan from it (``wxfer.mapping.traced.traced_preset``).  No preset,
no hand-written rule: the engine's own loader is the layout.

Store keys (under the job's name, MACed like every other record): ``vllm/trace/<gpu>`` the map's
canonical bytes (``TracedMap.to_bytes``), ``vllm/trace/<gpu>/meta`` JSON {gpu, replica, replicas,
tp, rank, digest (SHA-256 of those bytes), seconds, nparams, errors}.  A worker whose trace has a
problem publishes it (errors, by parameter name) and raises; the trainers raise it too.

Where the names, shapes and dtypes come from: the checkpoint vLLM loaded, its safetensors headers
(the first 8 bytes + the JSON header of each file: no tensor data is read).  They are the names
the trainers' HF model uses (transformers' ``save_pretrained`` writes its state dict).  For an FP8
block model whose checkpoint holds BF16 names, the FP8 checkpoint's names are made from them
(``trace.trace_model``).
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager

KEY = "vllm/trace/%d"


class TraceError(RuntimeError):
    pass


def checkpoint_dir(model_config) -> str:
    """The local directory of the checkpoint vLLM loaded (a path, or a hub id in the local HF
    cache: no download)."""
    path = getattr(model_config, "model", None) or ""
    if os.path.isdir(path):
        return path
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(path, revision=getattr(model_config, "revision", None), local_files_only=True)
    except Exception as e:  # noqa: BLE001 -- said in the error
        raise TraceError(
            f"wxfer trace: the checkpoint {path!r} is neither a local directory nor in the local HF cache "
            f"({type(e).__name__}: {e}); the trace reads its safetensors headers"
        ) from e


def worker_trace(
    model, vllm_config, par: dict, replica: int, replicas: int, ctl, skip: str | None, where: str, prove=None
):
    """Trace, publish, and return (the map, {parameter the plan writes: its window or None}, the
    proof's Classification or None).  `prove(map, params, shards)`, run before the map is
    published, returns (Classification, destinations) (proof.traced_classify): its refusals are
    published as the worker's errors, so the trainers raise them too."""
    import re

    from ...mapping.traced import rank_shards
    from .extension import worker_place
    from .trace import checkpoint_of_dir, trace_model

    ckpt = checkpoint_of_dir(checkpoint_dir(vllm_config.model_config))
    with loader_layout(model):
        m = trace_model(model, ckpt, par["rank"], where)
    pat = re.compile(skip) if skip else None
    skipped = {p for p in m.params if pat and pat.search(p)}
    params, shards, problems = rank_shards(m, skipped)
    problems += [f"{k}: {w}" for k, ws in m.problems.items() if k not in m.runs and k not in skipped for w in ws]
    cls, refused, t0 = None, [], time.perf_counter()
    if prove is not None and not problems:
        cls, _ = prove(m, params, shards)
        refused = list(cls.refused)
    place = worker_place(par, replica, replicas)
    gpu = place["gpu"]
    blob = m.to_bytes()
    meta = dict(
        place,
        digest=m.digest(),
        seconds=m.seconds,
        nparams=sum(t.numel() for t in model.parameters()),
        written=len(params),
        errors=problems + [f"post-processing proof: {r}" for r in refused],
        proof=None if cls is None else dict(cls.summary(), seconds=time.perf_counter() - t0),
    )
    ctl.set(KEY % gpu, blob)
    ctl.set_json(KEY % gpu + "/meta", meta)
    if problems:
        raise TraceError(
            f"wxfer: {where}: vLLM's load_weights writes {len(problems)} thing(s) the traced map cannot express: "
            + "; ".join(problems[:8])
        )
    if refused:
        raise TraceError(
            f"wxfer: {where}: post-processing proof refused {len(refused)} tensor(s) (vLLM's load_weights + "
            "process_weights_after_loading of seeded checkpoint tensors against what the traced map leaves): "
            + "; ".join(refused[:6])
        )
    return m, {p.name: m.window(p.name) for p in params}, cls


def _differs(t, meta) -> bool:
    return t is None or tuple(t.shape) != tuple(meta.shape) or t.dtype != meta.dtype


@contextmanager
def loader_layout(model):
    """The modules whose post-processing replaced a parameter (missing, or of another shape or
    dtype than vLLM recorded before loading: e.g. vLLM's CPU GEMM drops a linear's weight for a
    packed copy, the CPU MoE prepacks its experts) put back in the loader layout while the trace
    runs: each recorded parameter a tensor of the recorded shape, stride, dtype and attributes
    (its ``weight_loader``) over fresh memory the trace never writes (``torch.empty``: on a CPU
    host, pages never touched); the module's own tensors and attributes back afterwards."""
    import torch

    from .postproc import _loader_metadata, _loader_view

    swapped = []
    for _, mod in model.named_modules():
        meta = _loader_metadata(mod)
        params = dict(meta[0]) if meta else {}
        if not params or not any(_differs(mod._parameters.get(n), mt) for n, mt in params.items()):
            continue
        dev = next((t.device for t in mod._parameters.values() if t is not None), torch.device("cpu"))
        swapped.append((mod, dict(mod._parameters), {n: vars(mod)[n] for n in params if n in vars(mod)}))
        for n, mt in params.items():
            if hasattr(mod, n):
                delattr(mod, n)
            t = torch.empty_strided(tuple(mt.shape), tuple(mt.stride()), dtype=mt.dtype, device=dev)
            mod.register_parameter(n, _loader_view(t, mt, mod))
    try:
        yield
    finally:
        for mod, params, attrs in swapped:
            mod._parameters.clear()
            mod._parameters.update(params)
            mod.__dict__.update(attrs)


def registered(named, windows: dict) -> tuple[list, list]:
    """(selected [(name, tensor)], left out [names]): the parameters the map writes, each one as a
    whole or, with a window (vocab padding), the view of the rows the checkpoint fills."""
    sel, left = [], []
    for n, t in named:
        if n not in windows:
            left.append(n)
            continue
        w = windows[n]
        if w is not None:
            t = t.detach().view(-1)[w[0] : w[1]].view((-1,) + tuple(t.shape[1:]))
        sel.append((n, t))
    return sel, left


def proven(named, windows: dict, cls) -> tuple[list, list]:
    """(selected, left out) as ``registered``, by the proof's classification: a direct parameter
    is its live storage, a finalize one the loader-layout memory kept for it (its finalizer
    re-runs vLLM's post-processing from it in finish_weight_update); each with its window."""
    fin = {d: f.params[attr] for d, (f, attr) in cls.finalize_dests.items()}
    ok = set(cls.direct) | set(fin)
    sel, left = registered(((n, fin.get(n, t)) for n, t in named if n in ok), windows)
    return sel, [n for n, _ in named if n not in ok] + left


def trainer_maps(ctl, timeout: float, alive=lambda: None) -> tuple[dict, list[dict]]:
    """({inference rank: TracedMap}, every worker's meta): every worker's map read from the store,
    its digest checked, replicas compared (one map per TP rank); TraceError naming the worker."""
    from ...mapping.traced import TracedMap

    first = _get_meta(ctl, 0, timeout, alive)
    n = int(first["replicas"]) * int(first["tp"])
    metas = [first] + [_get_meta(ctl, g, timeout, alive) for g in range(1, n)]
    maps, errors = {}, []
    for mt in metas:
        who = f"vLLM worker gpu {mt['gpu']} (replica {mt['replica']}, tp rank {mt['rank']})"
        if mt["errors"]:
            errors += [f"{who}: {e}" for e in mt["errors"][:8]]
            continue
        blob = ctl.get(KEY % mt["gpu"], f"the traced map of {who}", timeout)
        try:
            m = TracedMap.from_bytes(blob, mt["digest"], who)
        except ValueError as e:
            errors.append(str(e))
            continue
        if m.rank != mt["rank"]:
            errors.append(f"{who}: its map is of tp rank {m.rank}")
        have = maps.get(mt["rank"])
        if have is None:
            maps[mt["rank"]] = m
        elif have.digest() != mt["digest"]:
            errors.append(f"{who}: its traced map differs from replica 0's for tp rank {mt['rank']}")
    if errors:
        raise TraceError("wxfer: the workers' traced maps:\n  " + "\n  ".join(errors[:20]))
    return maps, metas


def _get_meta(ctl, gpu: int, timeout: float, alive) -> dict:
    from ...runtime.control import wait_key

    key = KEY % gpu + "/meta"
    wait_key(
        ctl,
        key,
        timeout,
        alive,
        lambda err: TraceError(
            f"wxfer: init_weight_transfer_engine failed before gpu {gpu} published its trace: {err}"
        ),
        f"wxfer: vLLM worker gpu {gpu} published no traced map within {timeout:.0f} s",
    )
    return ctl.get_json(key, f"the traced map of vLLM worker gpu {gpu}", 1)
