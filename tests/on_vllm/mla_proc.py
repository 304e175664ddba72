"""Helpers of the MLA tests on the real vLLM (not a test module): a tiny DeepSeek-V3 config with
its MTP layer, seeded checkpoints in the HF layout, vLLM's own model classes (the target model
and the MTP draft) built from them without an engine, and the finalize check
(``python tests/on_vllm/mla_proc.py OUT.json`` runs every case in one process).

Nothing of vLLM's attention backend choice is patched: vLLM 0.32's CPU platform picks its
reference ``CPU_MLA`` backend on a host without AMX (this VM), and attention is never run.  For
FP8 (``fp8_kernel_patch``) the AMX check of vLLM's CPU W8A16 block-FP8 linear kernel is patched:
without AMX vLLM cannot build any FP8 block linear on CPU (``ValueError: Failed to find a
kernel that can implement the ScaledMM linear layer``, from ``create_weights`` in
``quantization/fp8.py``).  Only ``kv_b_proj`` is FP8 (``ignored_layers`` names every other
linear), and for it that kernel's ``process_weights_after_loading`` returns at once
(``_cpu_skip_gemm_dispatch``) and its GEMM is never called: what runs is vLLM's ``Fp8LinearMethod``
(weights and ``weight_scale_inv`` as loaded) and MLA's own dequantization."""

import json
import os
import sys
import time
import zlib

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

SEED = 20261206
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def tiny_config(fp8=False, heads=4, nope=64, v=64, layers=2):
    """A DeepSeek-V3 config dict: `layers` decoder layers (the first dense, the rest MoE) and one
    MTP layer.  kv_lora_rank 512 and qk_rope_head_dim 64: vLLM's CPU MLA backend supports head
    size 576 only."""
    from transformers import DeepseekV3Config

    c = DeepseekV3Config(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        kv_lora_rank=512,
        q_lora_rank=128,
        qk_rope_head_dim=64,
        qk_nope_head_dim=nope,
        v_head_dim=v,
        max_position_embeddings=256,
        num_nextn_predict_layers=1,
        tie_word_embeddings=False,
    )
    d = c.to_dict()
    d.update(architectures=["DeepseekV3ForCausalLM"], topk_method="noaux_tc", scoring_func="sigmoid")
    if fp8:  # kv_b_proj alone in FP8 block: every other linear is left BF16
        ign = []
        for i in range(layers + 1):
            p = f"model.layers.{i}."
            ign += [p + "self_attn." + x for x in ("q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "o_proj")]
            ign += [
                p + "mlp." + x
                for x in ("gate_proj", "up_proj", "down_proj", "experts", "gate")
                + tuple("shared_experts." + y for y in ("gate_proj", "up_proj", "down_proj"))
            ]
        d["quantization_config"] = dict(FP8, ignored_layers=ign)
    return d


def save_config(path, cfg):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def _seeded(name, shape, seed, dtype):
    import torch

    g = torch.Generator().manual_seed((seed * 1000003 + zlib.crc32(name.encode())) & 0x7FFFFFFFFFFF)
    t = torch.randn(tuple(shape), generator=g) * 0.05
    if name.endswith("norm.weight"):
        t = t + 1.0
    return t.to(getattr(torch, dtype))


def checkpoint(cfg, seed=SEED, kv_seed=None):
    """name -> tensor in the HF layout, MTP layer included; kv_b_proj (and its weight_scale_inv
    for FP8) drawn from `kv_seed` when given, everything else from `seed`."""
    import torch

    from wxfer.runtime.program import get_preset

    n = cfg["num_hidden_layers"]
    shapes = {k: (s, dt) for k, (s, dt, _) in get_preset(cfg).hf_params(cfg).items()}
    last = f"model.layers.{n - 1}."
    for k, sd in list(shapes.items()):  # the MTP layer: a decoder layer like the last one, and its own parts
        if k.startswith(last):
            shapes[k.replace(last, f"model.layers.{n}.")] = sd
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    m = f"model.layers.{n}."
    for k, s in (
        ("enorm.weight", (H,)),
        ("hnorm.weight", (H,)),
        ("eh_proj.weight", (H, 2 * H)),
        ("shared_head.norm.weight", (H,)),
        ("shared_head.head.weight", (V, H)),
        ("embed_tokens.weight", (V, H)),
    ):
        shapes[m + k] = (s, "bfloat16")
    fp8 = bool(cfg.get("quantization_config"))
    out = {}
    for k, (s, dt) in shapes.items():
        kv = k.endswith("kv_b_proj.weight")
        sd = kv_seed if kv and kv_seed is not None else seed
        t = _seeded(k, s, sd, dt)
        if kv and fp8:
            bn, bk = FP8["weight_block_size"]
            out[k] = (t.float() * 4000).to(torch.float8_e4m3fn)  # any finite FP8 bytes
            g = torch.Generator().manual_seed(sd + zlib.crc32(k.encode()))
            rows, cols = -(-s[0] // bn), -(-s[1] // bk)
            out[k + "_scale_inv"] = torch.rand((rows, cols), generator=g) * 1e-4 + 1e-5
        else:
            out[k] = t
    return out


_DIST = {"tp": 1, "rank": 0, "port": None}


def engine_config(path, mtp=False):
    import vhelp

    from wxfer.integrations.vllm import keep_cpu_weights

    keep_cpu_weights()  # what the wxfer worker plugin does: linear weights stay in place
    spec = {"method": "mtp", "num_speculative_tokens": 1} if mtp else None
    return vhelp.engine_config(path, _DIST["tp"], speculative_config=spec)


def build(vc, draft=False):
    """vLLM's own model class for `vc` (the MTP draft's when `draft`), not loaded."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    mc = vc.speculative_config.draft_model_config if draft else vc.model_config
    with set_current_vllm_config(vc):
        if not _DIST.get("up"):
            from wxfer.runtime.control import free_port

            tp, rank, port = _DIST["tp"], _DIST["rank"], _DIST["port"] or free_port()
            os.environ["VLLM_DIST_IDENT"] = str(port)  # what vLLM's CPU worker sets before its gloo groups
            init_distributed_environment(
                world_size=tp,
                rank=rank,
                distributed_init_method=f"tcp://127.0.0.1:{port}",
                local_rank=rank,
                backend="gloo",
            )
            initialize_model_parallel(tp)
            _DIST["up"] = True
        with set_default_torch_dtype(vc.model_config.dtype), torch.device("cpu"):
            model = initialize_model(vllm_config=vc, model_config=mc)
    return model, mc


def load(vc, model, mc, ckpt):
    """vLLM's own load_weights + process_weights_after_loading, as its default loader runs them."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    with set_current_vllm_config(vc):
        model.load_weights(iter(list(ckpt.items())))
        process_weights_after_loading(model, mc, torch.device("cpu"))


def state(model) -> dict:
    """name -> tensor: every parameter and buffer, and the tensors the MLA modules keep as plain
    attributes (``_k_scale_cpu``, ...)."""
    import torch

    from wxfer.integrations.vllm.mla import _mla_modules

    out = dict(model.named_parameters())
    out.update({"buffer:" + n: b for n, b in model.named_buffers()})
    for n, m in _mla_modules(model):
        for k, v in vars(m).items():
            if isinstance(v, torch.Tensor) and k not in ("_parameters", "_buffers"):
                out[f"attr:{n}.{k}"] = v
    return out


def differ(a: dict, b: dict) -> list:
    """Names whose tensors are not bit for bit equal (or present in one only)."""
    import torch

    def raw(t):
        t = t.detach().contiguous()
        return t.reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1).to(torch.uint8)

    bad = sorted(set(a) ^ set(b))
    for k in sorted(set(a) & set(b)):
        x, y = a[k], b[k]
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(raw(x), raw(y)):
            bad.append(k)
    return bad


def ckpt_name(param_name: str) -> str:
    """The checkpoint tensor a kv_b_proj parameter is loaded from (TP1: the whole tensor)."""
    return param_name.replace(".mtp_block.", ".")


def write_like_wxfer(model, names, ckpt):
    """The checkpoint bytes written raw into each parameter's storage, as a one-sided write lands:
    no torch op of vLLM's runs.  kv_b_proj is column-parallel: TP rank r holds rows r/tp..(r+1)/tp
    of the weight (whole heads) and the same share of weight_scale_inv's block rows."""
    import torch

    params = dict(model.named_parameters())
    tp, r = _DIST["tp"], _DIST["rank"]
    for n in names:
        src = ckpt[ckpt_name(n)]
        rows = src.shape[0] // tp
        p, src = params[n], src[r * rows : (r + 1) * rows]
        assert p.dtype == src.dtype and p.shape == src.shape, (n, p.dtype, p.shape, src.dtype, src.shape)
        p.data.reshape(-1).view(torch.uint8).copy_(src.contiguous().reshape(-1).view(torch.uint8))


def case(tmp, fp8=False, draft=False):
    """One finalize check: model A loads checkpoint 1 through vLLM, gets checkpoint 2's kv_b_proj
    bytes written raw and its finalizers run; model B loads checkpoint 2 fresh.  Reports the
    names that differ before and after finalize, and what the finalizers declare."""
    from wxfer.integrations.vllm.mla import draft_refusal, mla_finalizers, mla_refusals

    cfg = tiny_config(fp8)
    path = save_config(os.path.join(tmp, "fp8" if fp8 else "bf16"), cfg)
    ck1 = checkpoint(cfg)
    ck2 = checkpoint(cfg, kv_seed=SEED + 1)
    vc_a, vc_b = engine_config(path, draft), engine_config(path, draft)
    (a, mc), (b, _) = build(vc_a, draft), build(vc_b, draft)
    load(vc_a, a, mc, ck1)
    load(vc_b, b, mc, ck2)
    fins = mla_finalizers(a)
    ptrs = {n: t.data_ptr() for n, t in a.named_parameters()}
    written = [n for f in fins for n in f.reads]
    write_like_wxfer(a, written, ck2)
    stale = differ(state(a), state(b))
    secs = [f.timed_run() for f in fins]
    after = differ(state(a), state(b))
    aliased = [f.aliased for f in fins]
    for f in fins:  # vLLM's re-derivation run even where it is not needed: still equal, nothing moved
        f.aliased = False
        f.run()
    forced = differ(state(a), state(b))
    moved = [n for n, t in a.named_parameters() if ptrs.get(n) != t.data_ptr()]
    return dict(
        finalizers=[
            dict(
                name=f.name,
                reads=list(f.reads),
                derives=list(f.derives),
                kept_bytes=f.kept_bytes,
                derived_bytes=f.derived_bytes,
                aliased=al,
            )
            for f, al in zip(fins, aliased)
        ],
        refusals=mla_refusals(a),
        stale=stale,
        after=after,
        forced=forced,
        moved=moved,
        finalize_s=secs,
        backends=sorted({type(m.impl).__name__ for _, m in _mods(a)}),
        kv_quant=sorted({type(m.kv_b_proj.quant_method).__name__ for _, m in _mods(a)}),
        n_params=len(dict(a.named_parameters())),
        draft_refusal=draft_refusal(vc_a),
        model=type(a).__name__,
        planted_amx=planted_amx(a),
        hooked=hooked(a),
        derive_equal=derive_equal(a, cfg),
    )


def _mods(model):
    from wxfer.integrations.vllm.mla import _mla_modules

    return _mla_modules(model)


def derive_equal(model, cfg):
    """Per MLA module: whether wxfer's own ``mla.derive`` of its kv_b_proj gives vLLM's W_UV and
    W_UK_T bit for bit."""
    import torch

    from wxfer.integrations.vllm.mla import derive

    out = []
    for _, m in _mods(model):
        kv = m.kv_b_proj
        s = getattr(kv, "weight_scale_inv", None)
        uv, ukt = derive(kv.weight, s, FP8["weight_block_size"], m.num_heads, m.qk_nope_head_dim, m.v_head_dim)
        out.append(
            all(
                x.shape == y.shape and torch.equal(x.contiguous().view(torch.int16), y.contiguous().view(torch.int16))
                for x, y in ((uv, m.W_UV), (ukt, m.W_UK_T))
            )
        )
    return out


def hooked(model):
    """The modules mla_hook (post's FINALIZER_HOOKS entry) answers for, with what it builds."""
    from wxfer.integrations.vllm.mla import mla_hook

    def wrap(name, params, run, late):
        return dict(name=name, params=sorted(params), late=late, run=callable(run))

    return [r for n, m in model.named_modules() if (r := mla_hook(model, n, m, None, wrap)) is not None]


def planted_amx(model):
    """mla_refusals with vLLM's real AMXMLAImpl class (an uninitialized instance: it cannot be
    built without AMX) put in place of the first MLA module's impl, then put back."""
    from vllm.v1.attention.backends.mla.amx_mla import AMXMLAImpl

    from wxfer.integrations.vllm.mla import mla_refusals

    name, m = _mods(model)[0]
    saved = m.impl
    m.impl = object.__new__(AMXMLAImpl)
    try:
        return mla_refusals(model)
    finally:
        m.impl = saved


def fp8_kernel_patch():
    """Patch the AMX check of vLLM's CPU W8A16 block-FP8 linear kernel (see the module
    docstring): its weights are created; its GEMM is never called here."""
    from vllm.model_executor.kernels.linear.scaled_mm import cpu as K

    K.CPUFp8BlockScaledMMKernel.is_supported = classmethod(lambda cls, compute_capability=None: (True, None))


def main_tp(out, tmp, tp, rank, port):
    """One TP rank of the FP8 and BF16 target cases (the MTP draft runs at TP1 in main)."""
    _DIST.update(tp=tp, rank=rank, port=port)
    fp8_kernel_patch()
    rep = {"tp": tp, "rank": rank, "bf16": case(tmp), "fp8": case(tmp, fp8=True)}
    with open(out, "w") as f:
        json.dump(rep, f, indent=1)


def main(out, tmp):
    import torch

    from wxfer.integrations.vllm.mla import draft_refusal

    rep = {"amx": bool(torch.cpu._is_amx_tile_supported())}
    t = time.perf_counter()
    rep["bf16"] = case(tmp)
    rep["mtp"] = case(tmp, draft=True)
    fp8_kernel_patch()
    rep["fp8"] = case(tmp, fp8=True)
    rep["fp8_mtp"] = case(tmp, fp8=True, draft=True)
    rep["plain"] = dict(draft_refusal=draft_refusal(engine_config(os.path.join(tmp, "bf16"))))
    rep["total_s"] = time.perf_counter() - t
    with open(out, "w") as f:
        json.dump(rep, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) > 3:  # OUT TMP TP RANK PORT
        main_tp(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    else:
        main(sys.argv[1], sys.argv[2])
