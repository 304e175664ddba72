"""transformers 5 training layouts: routed experts as fused 3-D parameters
(``mlp.experts.gate_up_proj`` [E, 2 x inter, hidden], ``mlp.experts.down_proj`` [E, hidden, inter]).

The names and shapes come from transformers' own model classes built on the meta device;
the inference bytes (EP and TP, BF16 and FP8 with each expert on its own 128x128 grid) must
equal, bit for bit, those of the transformers 4 per-expert layout of the same weights."""

import pytest
import torch

from wxfer.mapping import (
    Layout,
    MappingError,
    arch_of,
    dequantize_fp8_block,
    expand,
    from_config,
    pack_shard,
    quantize_fp8_block,
)
from wxfer.runtime import prepare
from test_mapping import assemble_bytes  # tests/test_mapping.py
from helpers import small_moe  # tests/helpers.py

transformers = pytest.importorskip("transformers")

E, H, I = 4, 256, 256  # 128-multiples: FP8 splits on whole blocks at TP 2


def _qwen3_moe_cfg():
    assert (H, I) == (256, 256)  # small_moe's widths
    return transformers.Qwen3MoeConfig(**small_moe({"num_experts_per_tok": 2, "intermediate_size": 512}, E, 2, 512))


def _deepseek_cfg():
    return transformers.DeepseekV3Config(
        hidden_size=H,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        n_routed_experts=E,
        n_shared_experts=1,
        moe_intermediate_size=I,
        intermediate_size=512,
        vocab_size=512,
        q_lora_rank=256,
        kv_lora_rank=128,
        qk_nope_head_dim=64,
        qk_rope_head_dim=64,
        v_head_dim=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=2,
    )


CFGS = {"qwen3_moe": _qwen3_moe_cfg, "deepseek_v3": _deepseek_cfg}


def _meta_params(cfg):
    with torch.device("meta"):
        m = transformers.AutoModelForCausalLM.from_config(cfg)
    return {n: tuple(p.shape) for n, p in m.named_parameters()}


def _split(fused):
    """transformers 4 per-expert tensors of the same weights."""
    out = {}
    for n, t in fused.items():
        if n.endswith("mlp.experts.gate_up_proj"):
            base = n[: -len("gate_up_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, : t.shape[1] // 2]
                out[f"{base}{e}.up_proj.weight"] = t[e, t.shape[1] // 2 :]
        elif n.endswith("mlp.experts.down_proj"):
            base = n[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e]
        else:
            out[n] = t
    return out


_assemble = assemble_bytes


@pytest.mark.parametrize("arch", sorted(CFGS))
def test_preset_names_and_shapes_are_transformers_own(arch):
    cfg = CFGS[arch]()
    real = _meta_params(cfg)
    d = cfg.to_dict()
    assert not d.get("architectures")  # a config built in code: model_type decides
    pre = from_config("x", d)
    assert pre.arch == arch == arch_of(cfg)
    ours = {n: s for n, (s, _, _) in pre.hf_params(d, fused_experts=True).items()}
    assert ours == real
    gu = "model.layers.1.mlp.experts.gate_up_proj"
    assert real[gu] == (E, 2 * I, H) and real["model.layers.1.mlp.experts.down_proj"] == (E, H, I)
    # every parameter of the real model is read by a rule (strict expansion)
    ex = expand(pre.rules, real, Layout(tp=2, ep=True), d)
    assert ex.used == set(real)


@pytest.mark.parametrize("arch", sorted(CFGS))
@pytest.mark.parametrize("ep,quant", [(True, None), (False, None), (True, "fp8"), (False, "fp8")])
def test_fused_experts_bytes_equal_per_expert_layout(arch, ep, quant):
    d = CFGS[arch]().to_dict()
    pre = from_config("x", d)
    fused_shapes = {n: s for n, (s, _, _) in pre.hf_params(d, fused_experts=True).items()}
    g = torch.Generator().manual_seed(7)
    fused = {n: torch.randn(*s, generator=g).to(torch.bfloat16) for n, s in fused_shapes.items()}
    per = _split(fused)
    lay = Layout(tp=2, ep=ep, quant=quant)
    a = expand(pre.rules, fused_shapes, lay, d)
    b = expand(pre.rules, {n: tuple(t.shape) for n, t in per.items()}, lay, d)
    assert a.dest == b.dest
    for r in range(2):
        x, y = _assemble(a, r, fused), _assemble(b, r, per)
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]), (k, r)
    # and against the definition, independently of the mapping: layer 1, rank 1
    out = _assemble(a, 1, fused)
    dst = a.dest[1]["model.layers.1.mlp.experts.w13_weight"]
    gu = fused["model.layers.1.mlp.experts.gate_up_proj"]
    dn = fused["model.layers.1.mlp.experts.down_proj"]
    e, le, c = (3, 1, slice(0, I)) if ep else (2, 2, slice(I // 2, I))  # EP: experts 2, 3 on rank 1
    gate, up = gu[e, :I][c], gu[e, I:][c]
    if quant is None:
        w13 = out["model.layers.1.mlp.experts.w13_weight"].view(torch.bfloat16).view(dst.shape)
        assert torch.equal(w13[le], torch.cat([gate, up]))
        w2d = a.dest[1]["model.layers.1.mlp.experts.w2_weight"]
        w2 = out["model.layers.1.mlp.experts.w2_weight"].view(torch.bfloat16).view(w2d.shape)
        assert torch.equal(w2[le], dn[e][:, c])
    else:
        assert dst.dtype == "float8_e4m3fn"
        w13 = out["model.layers.1.mlp.experts.w13_weight"].view(dst.shape)
        qg, sg = quantize_fp8_block(gate)
        qu, su = quantize_fp8_block(up)
        assert torch.equal(w13[le], torch.cat([qg, qu]).view(torch.uint8))
        sc = a.dest[1]["model.layers.1.mlp.experts.w13_weight_scale_inv"]
        s13 = out["model.layers.1.mlp.experts.w13_weight_scale_inv"].view(torch.float32).view(sc.shape)
        assert torch.equal(s13[le], torch.cat([sg, su]))
        back = dequantize_fp8_block(w13[le].view(torch.float8_e4m3fn), s13[le])
        assert torch.allclose(back, torch.cat([gate, up]).float(), rtol=0.07, atol=0.05)


def test_the_senders_packer_matches_the_reference_on_3d_sources():
    d = _qwen3_moe_cfg().to_dict()
    pre = from_config("x", d)
    shapes = {n: s for n, (s, _, _) in pre.hf_params(d, fused_experts=True).items()}
    g = torch.Generator().manual_seed(3)
    t = {n: torch.randn(*s, generator=g) for n, s in shapes.items()}  # float32, as trainers hold them
    for quant in (None, "fp8"):
        ex = expand(pre.rules, shapes, Layout(tp=2, ep=False, quant=quant), d)
        (c,) = [c for c in ex.components if c.rule == "model.layers.0.mlp.experts"]
        assert c.sources == ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj")
        nb = sum(s.nbytes for s in c.shards)
        got = prepare.pack_into(c.shards, t, nb, "cpu")
        want = torch.cat([pack_shard(s, t) for s in c.shards])
        assert torch.equal(got, want)


def test_wrong_fused_shapes_and_expert_count_are_named():
    d = _qwen3_moe_cfg().to_dict()
    pre = from_config("x", d)
    shapes = {n: s for n, (s, _, _) in pre.hf_params(d, fused_experts=True).items()}
    bad = dict(shapes, **{"model.layers.0.mlp.experts.down_proj": (E, H, I // 2)})
    with pytest.raises(MappingError, match=r"model.layers.0.mlp.experts.down_proj: shape \(4, 256, 128\)"):
        expand(pre.rules, bad, Layout(tp=2, ep=True), d)
    with pytest.raises(MappingError, match="config says num_experts=8"):
        expand(pre.rules, shapes, Layout(tp=2, ep=True), dict(d, num_experts=8))


def test_config_without_architectures_or_known_model_type_says_what_to_pass():
    assert arch_of({"architectures": None, "model_type": "qwen3"}) == "qwen3"
    assert arch_of({"model_type": "kimi_k2"}) == "deepseek_v3"
    with pytest.raises(ValueError) as ei:
        arch_of({"architectures": None, "model_type": "gpt2"})
    msg = str(ei.value)
    assert "model_type='gpt2'" in msg and "Qwen3ForCausalLM" in msg and "Preset(" in msg


@pytest.mark.parametrize("name", ["kimi-k2", "qwen3-235b"])
def test_full_size_presets_same_destinations_from_fused_experts(name):
    from wxfer.mapping import get_preset

    pre = get_preset(name)
    cfg = dict(pre.config, num_hidden_layers=3)
    lay = Layout(pre.infer_tp, pre.infer_ep, pre.quant)
    fused = expand(pre.rules, {n: s for n, (s, _, _) in pre.hf_params(cfg, fused_experts=True).items()}, lay, cfg)
    per = expand(pre.rules, {n: s for n, (s, _, _) in pre.hf_params(cfg).items()}, lay, cfg)
    if name == "kimi-k2":  # transformers 5 keeps e_score_correction_bias as a buffer: not a training parameter
        for r in per.dest:
            per.dest[r] = {n: p for n, p in per.dest[r].items() if not n.endswith("e_score_correction_bias")}
    assert fused.dest == per.dest
    assert fused.dest_bytes() == per.dest_bytes()


def test_synthesized_plan_from_fused_experts_covers_the_same_bytes():
    from wxfer.meta import Cluster, synthesize
    from wxfer.mapping import get_preset

    pre = get_preset("qwen3-30b-a3b")
    pre.config = dict(pre.config, num_hidden_layers=2)
    cl = Cluster(train_gpus=8, infer_gpus=4, infer_tp=4, infer_ep=True, quant="fp8")
    a, b = synthesize(pre, cl, fused_experts=True), synthesize(pre, cl)
    gu = [p for p in a.train if p.name.endswith("experts.gate_up_proj")]
    assert len(gu) == 2 and gu[0].shape == (128, 2 * 768, 2048) and gu[0].meshes == (tuple(range(8)),)
    assert a.expanded.dest == b.expanded.dest


def test_sender_mapping_from_a_config_built_in_code():
    # the Sender's and Receiver's `mapping=model.config.to_dict()` (architectures None)
    from wxfer.runtime.program import get_preset

    for cfg, arch in (
        (_qwen3_moe_cfg(), "qwen3_moe"),
        (_deepseek_cfg(), "deepseek_v3"),
        (transformers.Qwen3Config(num_hidden_layers=1), "qwen3"),
    ):
        pre = get_preset(cfg.to_dict())
        assert pre.arch == arch
        real = _meta_params(cfg)
        lay = Layout(tp=1)
        assert expand(pre.rules, real, lay, pre.config).used == set(real)
