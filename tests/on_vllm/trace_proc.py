"""One TP rank of tests/on_vllm/test_trace.py (not a test module), and tiny HF checkpoints of
several architectures (``tiny_config`` / ``save_tiny``, also used by test_reach.py).

python trace_proc.py OUT.json TP RANK PORT CKPT:FP8:EP ...

Builds vLLM's own model class for each checkpoint (one distributed init for all; no
post-processing: the trace is of the loader layout), traces its ``load_weights``
(wxfer.integrations.vllm.trace), checks that no parameter byte changed, converts the map into the
plan's shards (wxfer.mapping.traced) and, where wxfer has hand-written rules for the
architecture, compares the two element by element.  Writes one JSON record per checkpoint."""

import json
import os
import sys
import time

from vhelp import FP8, TINY  # (also sets vLLM's CPU environment: HF offline, 1 GiB KV cache)

COMMON = dict(TINY, intermediate_size=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def tiny_config(arch, head_dim=64, **over):
    """A tiny random transformers config of `arch` (a model_type)."""
    import transformers as T

    if arch == "deepseek_v3":  # mla_proc's tiny DeepSeek-V3 (MLA, one dense and one MoE layer, noaux_tc)
        from mla_proc import tiny_config as mla_tiny

        return T.DeepseekV3Config(**dict(mla_tiny(), **over))
    kw = dict(COMMON, head_dim=head_dim)
    kw.update(over)
    if arch == "qwen3_moe":
        kw.update(moe_intermediate_size=over.get("moe_intermediate_size", 128), num_experts=4, num_experts_per_tok=2)
        kw.setdefault("decoder_sparse_step", 1)
    if arch == "phi3":
        kw.pop("head_dim")
    if arch in ("gemma2", "gemma3_text"):  # tied; hidden 64: at 256 the scaled tied embedding of
        # the last prompt token wins every step for random weights (greedy decodes repeat it)
        kw.update(query_pre_attn_scalar=head_dim, sliding_window=64, tie_word_embeddings=True)
        kw["hidden_size"] = over.get("hidden_size", 64)
    cls = T.CONFIG_MAPPING[arch]
    return cls(**kw)


def save_tiny(path, arch, fp8=False, seed=0, **over):
    """An HF directory of a seeded tiny `arch` model (BF16 weights; an FP8 quantization_config
    when `fp8`, the names of the BF16 tensors: the trace makes the FP8 checkpoint's names).
    Once vLLM built models in this process its compile decorators may have wrapped a
    transformers class (seen: OLMo2's, "Current vLLM config is not set"), so then the checkpoint
    is made in a clean interpreter."""
    import torch
    from transformers import AutoModelForCausalLM

    if "vllm" in sys.modules and not os.environ.get("WXFER_SAVE_TINY_CHILD"):
        import subprocess

        here = os.path.dirname(os.path.abspath(__file__))
        code = (
            f"import sys; sys.path.insert(0, {here!r}); from trace_proc import save_tiny; "
            f"save_tiny({path!r}, {arch!r}, fp8={fp8!r}, seed={seed!r}, **{over!r})"
        )
        env = dict(os.environ, WXFER_SAVE_TINY_CHILD="1")
        subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300)
        return tiny_config(arch, **over)

    cfg = tiny_config(arch, **over)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(path)
    if fp8:
        p = os.path.join(path, "config.json")
        d = json.load(open(p))
        d["quantization_config"] = dict(FP8)
        json.dump(d, open(p, "w"))
    if arch == "deepseek_v3":  # what vLLM's DeepSeek-V3 reads, whether transformers' config kept it or not
        p = os.path.join(path, "config.json")
        d = json.load(open(p))
        d.update(architectures=["DeepseekV3ForCausalLM"], topk_method="noaux_tc", scoring_func="sigmoid")
        json.dump(d, open(p, "w"))
    return cfg


def build(path, tp, ep=False):
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    from vhelp import engine_config

    vc = engine_config(path, tp, ep)
    with set_current_vllm_config(vc), set_default_torch_dtype(vc.model_config.dtype), torch.device("cpu"):
        model = initialize_model(vllm_config=vc, model_config=vc.model_config)
    return vc, model


def init_dist(tp, rank, port):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    os.environ["VLLM_DIST_IDENT"] = str(port)
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(
            world_size=tp, rank=rank, distributed_init_method=f"tcp://127.0.0.1:{port}", local_rank=rank, backend="gloo"
        )
        initialize_model_parallel(tp)


def rules_table(cfg, ckpt, tp, rank, quant, ep, model_names, swap=False):
    """(rank, vLLM name) -> elements, from wxfer's hand-written rules (None: no preset)."""
    from wxfer.integrations.vllm.layout import vllm_names
    from wxfer.mapping import Fuse, Layout, Preset, expand, from_config
    from wxfer.mapping.presets import ARCH_RULES, arch_of
    from wxfer.mapping.traced import element_table

    try:
        arch = arch_of(cfg)
    except Exception:  # noqa: BLE001 -- no preset for it
        return None
    if arch not in ARCH_RULES:
        return None
    preset = from_config("x", cfg)
    rules = preset.rules
    if swap:  # a deliberately wrong rule: gate and up swapped (same shapes)
        rules = [Fuse(r.dst, tuple(reversed(r.srcs))) if r.dst.endswith("gate_up_proj.weight") else r for r in rules]
        preset = Preset("x", preset.arch, rules, preset.config)
    shapes = {n: tuple(s) for n, s, _ in ckpt}
    ex = expand(preset.rules, shapes, Layout(tp, ep, quant), dict(preset.config, **cfg))
    shards = [sh for c in ex.components for sh in c.shards if sh.rank == rank]
    ren = vllm_names({sh.dst for sh in shards}, model_names)
    tab = element_table(shards, shapes)
    return {(r, ren[d]): v for (r, d), v in tab.items()}


def one(spec, tp, rank):
    import hashlib

    import torch
    from vllm.config import set_current_vllm_config

    from wxfer.integrations.vllm.trace import checkpoint_of_dir, trace_model
    from wxfer.mapping.traced import SHIFT, MASK, TracedMap, element_table, rank_shards

    path, fp8, ep = spec.split(":")
    fp8, ep = fp8 == "1", ep == "1"
    vc, model = build(path, tp, ep)
    cfg = vc.model_config.hf_config.to_dict()
    named = list(model.named_parameters())
    before = {n: hashlib.sha256(t.detach().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest() for n, t in named}
    ckpt = checkpoint_of_dir(path)
    with set_current_vllm_config(vc):
        m = trace_model(model, ckpt, rank)
    changed = [
        n
        for n, t in model.named_parameters()
        if hashlib.sha256(t.detach().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest() != before[n]
    ]
    blob = m.to_bytes()
    back = TracedMap.from_bytes(blob, m.digest())
    params, shards, problems = rank_shards(back)
    shapes = {n: s for n, (s, _) in back.sources.items()}
    traced = element_table(shards, shapes)
    # the shards against the raw map, element by element
    names = back.names()
    raw_diff = []
    for (r, p), rows in traced.items():
        d, g = back.elements(p)
        want = sorted(zip(d.tolist(), [names[x >> SHIFT] for x in g.tolist()], (g & MASK).tolist()))
        if [x[:3] for x in rows] != want:
            raw_diff.append(p)
    quant = "fp8" if fp8 else None
    mnames = [n for n, _ in named]
    rules = rules_table(cfg, ckpt, tp, rank, quant, ep, mnames)
    diff = wrong = None
    if rules is not None:
        differ = {k[1] for k in rules if k in traced and rules[k] != traced[k]}
        diff = sorted({k[1] for k in set(rules) ^ set(traced)} | differ)
        bad = rules_table(cfg, ckpt, tp, rank, quant, ep, mnames, swap=True)
        wrong = sorted(k[1] for k in bad if bad[k] != traced.get(k))
    return dict(
        path=path,
        arch=cfg.get("model_type"),
        fp8=fp8,
        ep=ep,
        seconds=m.seconds,
        nparams=sum(t.numel() for _, t in named),
        written=len(m.written()),
        problems=back.problems,
        shard_problems=problems,
        changed=changed,
        bytes=len(blob),
        digest=back.digest(),
        raw_diff=raw_diff,
        rules=rules is not None,
        diff=diff,
        wrong=wrong,
        compared=len(traced),
        kinds=sorted({sh.kind for sh in shards}),
        unwritten=sorted(n for n in mnames if n not in back.runs),
    )


if __name__ == "__main__":
    out, tp, rank, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    init_dist(tp, rank, port)
    recs = []
    for spec in sys.argv[5:]:
        t0 = time.perf_counter()
        rec = one(spec, tp, rank)
        rec["build_and_trace_s"] = time.perf_counter() - t0
        recs.append(rec)
    with open(out, "w") as f:
        json.dump(recs, f)
