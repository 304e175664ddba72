"""The layout proof at setup, on by default: vLLM's own loader and post-processing against the mapping.

Worker (``worker_proof``, inside ``init_transfer_engine``, before the Receiver registers):
``postproc.classify`` over every layer (seeded random checkpoint tensors, FP8 block-quantized as an
FP8 checkpoint stores them when the model is FP8, through a fresh instance of the model's class:
vLLM's ``load_weights`` + ``process_weights_after_loading``, against the mapping's packed bytes
written where wxfer writes them, plus its finalize step); every parameter is direct, finalize or
refused by name.  The SHA-256 of the mapping's bytes of every proven destination is published in
the trainers' store (``vllm/proof/<gpu>``), with the classification.  ``load_and_digest`` (the
loader alone, on a model in its loader layout) stays for the contract tests.

Trainer rank 0 (``trainer_check``, inside the trainer engine's ``trainer_init``, before the
Senders are built): the same seeded tensors packed by the trainers' mapping (the reference
packing, which every fast path equals bit for bit), compared digest by digest with every
worker's.  Any difference is a setup error naming the parameter and the worker, raised on every
trainer rank and on every worker (through the plan status the Receivers wait for).
"""

from __future__ import annotations

import math
import time

from .layout import PROOF_SEED, compare_digests, digest, fp8_checkpoint, proof_digests, seeded_checkpoint

KEY = "vllm/proof/%d"


class LayoutProofError(RuntimeError):
    workers = 0  # how many workers published a proof (they wait for the plan status)


def fp8_sources(preset, cfg: dict, tp: int, ep: bool, layers) -> set:
    """The checkpoint names an FP8 checkpoint stores quantized (the mapping's FP8 pieces)."""
    from ...mapping import Layout, expand

    full = seeded_checkpoint(preset, cfg, layers, 0)
    ex = expand(preset.rules, {n: tuple(t.shape) for n, t in full.items()}, Layout(tp, ep, "fp8"), cfg)
    return {p.src for c in ex.components for sh in c.shards if sh.kind == "fp8" for p in sh.pieces}


def load_and_digest(model, preset, cfg, selected, tp, rank, quant, ep, layers, seed, where):
    """(digests, errors, seconds): the seeded checkpoint through the model's own load_weights, the
    SHA-256 of every destination the proof covers, compared with the mapping `preset`; the
    parameters' previous bytes put back."""
    import torch

    expected = proof_digests(preset, cfg, tp, rank, quant, ep, layers, seed)
    full = seeded_checkpoint(preset, cfg, layers, seed)
    if quant == "fp8":
        q = fp8_sources(preset, cfg, tp, ep, layers)
        ckpt = fp8_checkpoint(full, lambda n: n in q)
    else:
        ckpt = list(full.items())
    sel = dict(selected)
    touched = {n: t for n, t in sel.items() if n in expected}
    before = {n: (t.data_ptr(), tuple(t.shape), t.dtype) for n, t in sel.items()}
    saved = {n: t.detach().clone() for n, t in touched.items()}
    t0 = time.perf_counter()
    errors = []
    try:
        with torch.no_grad():
            model.load_weights(iter(ckpt))
        moved = [n for n, t in sel.items() if (t.data_ptr(), tuple(t.shape), t.dtype) != before[n]]
        if moved:
            errors.append(
                f"{where}: vLLM's loader replaced the storage of {moved[:6]}: wxfer writes parameter memory in "
                "place and cannot follow it"
            )
        got = {n: digest(t) for n, t in touched.items()}
    finally:
        with torch.no_grad():
            for n, t in touched.items():
                t.copy_(saved[n])
    errors += compare_digests(expected, got, where)
    return got, errors, time.perf_counter() - t0


def checkpoint_for(preset, cfg, tp, quant, ep, layers, seed) -> list:
    """[(checkpoint name, tensor)]: the seeded checkpoint as vLLM's loader reads it (FP8
    block-quantized where an FP8 checkpoint stores it so)."""
    full = seeded_checkpoint(preset, cfg, layers, seed)
    if quant == "fp8":
        q = fp8_sources(preset, cfg, tp, ep, layers)
        return fp8_checkpoint(full, lambda n: n in q)
    return list(full.items())


def classify_worker(model, vllm_config, device, preset, cfg, named, par, quant, skip, seed, where):
    """(Classification, destinations): postproc.classify over every layer of the worker's model,
    the mapping `preset` the one whose bytes are written.  destinations: destination name ->
    (model tensor name, shape, dtype).  RuntimeError naming what the model lacks."""
    from .layout import expected_destinations, proof_bytes, select_parameters, vllm_names
    from .postproc import classify

    layers = list(range(int(cfg.get("num_hidden_layers", 1))))
    tp, rank, ep = par["tp"], par["rank"], par["ep"]
    expected = expected_destinations(preset, cfg, tp, rank, quant, ep)
    sel, left, missing = select_parameters(named, expected, skip)
    if missing:
        raise RuntimeError(
            f"wxfer: {where} lacks {len(missing)} parameter(s) the mapping {preset.name!r} writes: {missing[:10]}"
        )
    chosen = {d for d, _ in sel}
    rename = vllm_names(expected, [n for n, _ in named])
    dests = {d: (rename[d], expected[d][0], expected[d][1]) for d in expected if d in chosen}
    packed = proof_bytes(preset, cfg, tp, rank, quant, ep, layers, seed)
    ckpt = checkpoint_for(preset, cfg, tp, quant, ep, layers, seed)
    c = classify(model, vllm_config, device, dests, packed, ckpt)
    c.left_out = left
    c.packed_digests = {d: digest(b) for d, b in packed.items() if d in dests}
    return c, dests


def worker_proof(model, preset, cfg, named, par, quant, replica, replicas, store, info, where, vllm_config, device):
    """(record, Classification): the post-processing proof over every layer (postproc.classify),
    published for the trainers; LayoutProofError naming every refused parameter."""
    from ...runtime.control import Control, job_secret
    from .extension import worker_place

    place = worker_place(par, replica, replicas)
    gpu = place["gpu"]
    t0 = time.perf_counter()
    cls, dests = classify_worker(
        model, vllm_config, device, preset, cfg, named, par, quant, info.skip, info.proof_seed, where
    )
    errors = [f"{where}: {r}" for r in cls.refused]
    proven = set(cls.direct) | set(cls.finalize_dests)
    got = {d: h for d, h in cls.packed_digests.items() if d in proven}
    out = dict(
        place,
        quant=quant,
        layers=list(range(int(cfg.get("num_hidden_layers", 1)))),
        seed=info.proof_seed,
        digests=got,
        errors=errors,
        seconds=time.perf_counter() - t0,
        classes=cls.summary(),
    )
    Control(store, info.name, info.timeout, secret=job_secret(None)).set_json(KEY % gpu, out)
    if errors:
        raise LayoutProofError(
            f"wxfer: layout proof failed ({len(errors)} parameter(s); vLLM's load_weights + "
            "process_weights_after_loading of seeded checkpoint tensors against what wxfer leaves): "
            + "; ".join(errors[:6])
        )
    return out, cls, dests


def trainer_check(ctl, mapping, timeout: float, alive=lambda: None) -> dict:
    """Rank 0: every worker's proof against the trainers' `mapping`; raises LayoutProofError.
    `alive()` returns the init RPC's error once it failed (the workers then publish nothing)."""
    first = _get(ctl, KEY % 0, timeout, alive)
    n = int(first["replicas"]) * int(first["tp"])
    recs = [first] + [_get(ctl, KEY % g, timeout, alive) for g in range(1, n)]
    errors = []
    for r in recs:
        where = f"vLLM worker gpu {r['gpu']} (replica {r['replica']}, tp rank {r['rank']})"
        if r["errors"]:
            errors += r["errors"]
            continue
        exp = proof_digests(mapping, None, r["tp"], r["rank"], r["quant"], r["ep"], r["layers"], r["seed"])
        errors += compare_digests(exp, r["digests"], where + " against the trainers' mapping")
        extra = sorted(set(r["digests"]) - set(exp))
        errors += [f"{where}: {n}: filled by vLLM's loader but not written by the trainers' mapping" for n in extra]
    if errors:
        e = LayoutProofError(
            f"wxfer: layout proof failed ({len(errors)} parameter(s)): the bytes vLLM's own load_weights lays "
            "for seeded checkpoint tensors differ from what the trainers' mapping packs: " + "; ".join(errors[:6])
        )
        e.workers = len(recs)
        raise e
    return {r["gpu"]: len(r["digests"]) for r in recs}


def _get(ctl, key, timeout, alive):
    from ...runtime.control import wait_key

    wait_key(
        ctl,
        key,
        timeout,
        alive,
        lambda err: RuntimeError(f"wxfer: init_weight_transfer_engine failed before the layout proof: {err}"),
        f"wxfer: no layout proof {key!r} from the vLLM workers after {timeout:.0f} s",
    )
    return ctl.get_json(key, "a vLLM worker's layout proof", 10)


# ------------------------------------------------------------------ the traced path (no preset)


def traced_checkpoint(m, seed: int = PROOF_SEED) -> tuple[dict, list]:
    """(training tensors {name: tensor}, checkpoint [(name, tensor)] as vLLM's loader reads it)
    for the checkpoint names, shapes and dtypes traced map `m` was traced over: a seeded tensor
    each (layout.seeded_tensor); a float8 weight with ``<name>_scale_inv`` is a BF16 training
    tensor, block-quantized in the checkpoint as an FP8 checkpoint stores it."""
    from .layout import seeded_tensor

    fp8 = {n for n, (_, dt) in m.sources.items() if dt == "float8_e4m3fn" and n + "_scale_inv" in m.sources}
    scales = {n + "_scale_inv" for n in fp8}
    full = {
        n: seeded_tensor(n, shape, "bfloat16" if n in fp8 else dt, seed)
        for n, (shape, dt) in m.sources.items()
        if n not in scales
    }
    return full, fp8_checkpoint(full, lambda n: n in fp8)


def traced_packed(m, params, shards, full) -> dict:
    """parameter name -> the bytes (uint8, the whole parameter) wxfer leaves there for the
    training tensors `full`: the map's shards (``rank_shards``) packed by the trainers' reference
    packing (``pack_shard``) at their place; a parameter written as a window (vocab padding)
    holds, outside it, the constant vLLM's loader sets there (the trace's ``fill_``: wxfer never
    writes those rows, so they keep what the load left)."""
    import torch

    from ...mapping import pack_shard
    from ...mapping.rules import dtype_size

    buf, base = {}, {}
    for dp in params:
        shape, dt = m.params[dp.name]
        es = dtype_size(dt)
        b = torch.zeros(math.prod(shape) * es, dtype=torch.uint8)
        typed = b.view(getattr(torch, dt))
        for el, v in m.const.get(dp.name, []):
            typed[torch.from_numpy(el)] = v
        buf[dp.name] = b
        base[dp.name] = (m.window(dp.name) or (0, 0))[0] * es
    for sh in shards:
        b = pack_shard(sh, full)
        o = base[sh.dst] + sh.offset
        buf[sh.dst][o : o + b.numel()] = b
    return buf


def traced_classify(model, vllm_config, device, m, params, shards, seed: int = PROOF_SEED):
    """(Classification, destinations) of the post-processing proof (postproc.classify, every
    layer) on the traced path: what wxfer writes is the worker's own traced map, its shards
    packed for seeded tensors of the checkpoint names it was traced over.  Destinations are the
    whole parameters (name -> (name, shape, dtype)); a windowed one is compared whole, its rows
    outside the window the loader's constant in the reference and in what wxfer leaves (and, for
    a direct one, checked to be that constant in the live model: ``Classification.refused``)."""
    import torch

    from .postproc import classify

    full, ckpt = traced_checkpoint(m, seed)
    packed = traced_packed(m, params, shards, full)
    dests = {dp.name: (dp.name, tuple(m.params[dp.name][0]), m.params[dp.name][1]) for dp in params}
    c = classify(model, vllm_config, device, dests, packed, ckpt)
    live = dict(model.named_parameters(remove_duplicate=False))
    live.update(dict(model.named_buffers(remove_duplicate=False)))
    for d in c.direct:
        w = m.window(d)
        if w is None:
            continue
        es = packed[d].numel() // max(1, math.prod(m.params[d][0]))
        have = live[d].detach().contiguous().view(-1).view(torch.uint8).cpu()
        a, b = w[0] * es, w[1] * es
        if not (torch.equal(have[:a], packed[d][:a]) and torch.equal(have[b:], packed[d][b:])):
            c.refused.append(f"{d}: the elements outside [{w[0]}, {w[1]}) (not written) are not the loader's constant")
    c.packed_digests = {d: digest(b) for d, b in packed.items()}
    return c, dests
