"""HF -> vLLM mapping: fusion, TP/EP slicing, KV replication, FP8 block scales, refusals."""

import math

import pytest
import torch

from wxfer.mapping import (
    BLOCK,
    Experts,
    Fuse,
    Ignore,
    Layout,
    MappingError,
    Piece,
    Row,
    dequantize_fp8_block,
    expand,
    get_preset,
    pack_shard,
    quantize_fp8_block,
)
from helpers import small_moe  # tests/helpers.py


def _shapes(preset, config=None):
    return {n: s for n, (s, _, _) in preset.hf_params(config).items()}


def assemble_bytes(ex, rank, tensors):
    """{name: uint8 tensor} of `rank`'s destination parameters, rebuilt from the reference
    shard bytes (tests/test_mapping_hf5.py uses it too)."""
    out = {n: torch.zeros(p.nbytes, dtype=torch.uint8) for n, p in ex.dest[rank].items()}
    for c in ex.components:
        for s in c.shards:
            if s.rank == rank:
                out[s.dst][s.offset : s.offset + s.nbytes] = pack_shard(s, tensors)
    return out


def _assemble(ex, rank, tensors):
    """Destination parameters of `rank` rebuilt from the reference shard bytes."""
    out = assemble_bytes(ex, rank, tensors)
    return {n: b.view(getattr(torch, ex.dest[rank][n].dtype)).view(ex.dest[rank][n].shape) for n, b in out.items()}


def _rand_tensors(shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(*s, generator=g).to(torch.bfloat16) for n, s in shapes.items()}


def test_qkv_kv_heads_replicated_when_tp_exceeds_kv_heads():
    cfg = dict(get_preset("qwen3-tiny").config)  # 4 heads, 2 KV heads, head_dim 64
    pre = get_preset("qwen3-tiny")
    shapes = _shapes(pre)
    ex = expand(pre.rules, shapes, Layout(tp=4), cfg)
    q = "model.layers.0.self_attn.q_proj.weight"
    k = "model.layers.0.self_attn.k_proj.weight"
    for r in range(4):
        (shard,) = [
            s
            for c in ex.components
            for s in c.shards
            if s.rank == r and s.dst == "model.layers.0.self_attn.qkv_proj.weight"
        ]
        pq, pk, pv = shard.pieces
        assert (pq.src, pq.r0, pq.r1) == (q, 64 * r, 64 * (r + 1))  # one query head per rank
        h = r * 2 // 4  # KV head r // 2, replicated twice
        assert (pk.src, pk.r0, pk.r1) == (k, 64 * h, 64 * (h + 1))
        assert (pv.r0, pv.r1) == (64 * h, 64 * (h + 1))
        assert ex.dest[r]["model.layers.0.self_attn.qkv_proj.weight"].shape == (192, 256)
    # bytes: the reference packs [q_r | k_h | v_h] exactly
    t = _rand_tensors(shapes)
    d = _assemble(ex, 3, t)
    a = "model.layers.0.self_attn."
    want = torch.cat([t[a + "q_proj.weight"][192:256], t[a + "k_proj.weight"][64:128], t[a + "v_proj.weight"][64:128]])
    assert torch.equal(d[a + "qkv_proj.weight"], want)


def test_tp2_dense_bytes_bit_for_bit_bf16():
    pre = get_preset("qwen3-tiny")
    shapes = _shapes(pre)
    ex = expand(pre.rules, shapes, Layout(tp=2), pre.config)
    assert not ex.unmatched
    t = _rand_tensors(shapes, 1)
    for r in range(2):
        d = _assemble(ex, r, t)
        m = "model.layers.1.mlp."
        gu = torch.cat(
            [t[m + "gate_proj.weight"][256 * r : 256 * (r + 1)], t[m + "up_proj.weight"][256 * r : 256 * (r + 1)]]
        )
        assert torch.equal(d[m + "gate_up_proj.weight"], gu)
        assert torch.equal(d[m + "down_proj.weight"], t[m + "down_proj.weight"][:, 256 * r : 256 * (r + 1)])
        assert torch.equal(d["model.embed_tokens.weight"], t["model.embed_tokens.weight"][512 * r : 512 * (r + 1)])
        assert torch.equal(d["model.norm.weight"], t["model.norm.weight"])
        assert "lm_head.weight" not in d  # tied embeddings


def test_fp8_block_quantization_roundtrip_and_shapes():
    w = torch.randn(300, 200, dtype=torch.float32) * 3
    q, s = quantize_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (300, 200)
    assert s.dtype == torch.float32 and s.shape == (math.ceil(300 / 128), math.ceil(200 / 128))
    back = dequantize_fp8_block(q, s)
    blk = s.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]
    assert ((back - w).abs() <= blk * 448 * 2**-3 + 1e-6).all()  # e4m3: 3 mantissa bits
    assert (back - w).abs().max() < 0.2 * w.abs().max()
    # the largest element of a block maps to +-448
    assert q.to(torch.float32).abs().max() == 448


def test_mla_fused_qkv_a_scale_offsets_and_fp8_bytes():
    cfg = dict(
        get_preset("kimi-k2").config,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        n_routed_experts=4,
        hidden_size=256,
        q_lora_rank=256,
        kv_lora_rank=32,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        num_attention_heads=4,
        moe_intermediate_size=256,
        intermediate_size=256,
        vocab_size=512,
    )
    pre = get_preset("kimi-k2")
    shapes = _shapes(pre, cfg)
    ex = expand(pre.rules, shapes, Layout(tp=2, ep=True, quant="fp8"), cfg)
    a = "model.layers.0.self_attn."
    d = ex.dest[1]
    assert d[a + "fused_qkv_a_proj.weight"].shape == (256 + 96, 256)
    assert d[a + "fused_qkv_a_proj.weight"].dtype == "float8_e4m3fn"
    # q_a: 2 scale rows, kv_a (96 rows) starts at ceil(256/128) = 2 and takes 1 row
    assert d[a + "fused_qkv_a_proj.weight_scale_inv"].shape == (3, 2)
    assert d["model.embed_tokens.weight"].dtype == "bfloat16"
    assert d["model.layers.1.mlp.gate.weight"].dtype == "bfloat16"  # router stays BF16
    assert d["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == "float32"
    assert d["model.layers.1.mlp.experts.w13_weight"].shape == (2, 512, 256)  # EP: 2 local experts
    assert d["model.layers.1.mlp.experts.w13_weight_scale_inv"].shape == (2, 4, 2)
    assert d["model.layers.1.mlp.experts.w2_weight"].shape == (2, 256, 256)
    t = _rand_tensors(shapes, 2)
    out = _assemble(ex, 1, t)
    qa, kva = t[a + "q_a_proj.weight"], t[a + "kv_a_proj_with_mqa.weight"]
    s = out[a + "fused_qkv_a_proj.weight_scale_inv"]
    q1, s1 = quantize_fp8_block(qa)
    q2, s2 = quantize_fp8_block(kva)
    assert torch.equal(s[:2], s1) and torch.equal(s[2:], s2)
    w = out[a + "fused_qkv_a_proj.weight"]
    assert torch.equal(w[:256].view(torch.uint8), q1.view(torch.uint8))
    assert torch.equal(w[256:].view(torch.uint8), q2.view(torch.uint8))
    # experts on rank 1 are experts 2 and 3, w13 = [gate | up]
    e = "model.layers.1.mlp.experts.3."
    w13 = out["model.layers.1.mlp.experts.w13_weight"][1]
    qg, _ = quantize_fp8_block(t[e + "gate_proj.weight"])
    qu, _ = quantize_fp8_block(t[e + "up_proj.weight"])
    assert torch.equal(w13.view(torch.uint8), torch.cat([qg, qu]).view(torch.uint8))
    deq = dequantize_fp8_block(
        out["model.layers.1.mlp.experts.w2_weight"][1], out["model.layers.1.mlp.experts.w2_weight_scale_inv"][1]
    )
    assert torch.allclose(deq, t[e + "down_proj.weight"].float(), rtol=0.07, atol=0.05)


def test_experts_tp_sliced_without_ep():
    pre = get_preset("qwen3-30b-a3b")
    cfg = small_moe(pre.config, 4)
    shapes = _shapes(pre, cfg)
    ex = expand(pre.rules, shapes, Layout(tp=2, ep=False, quant="fp8"), cfg)
    assert ex.dest[0]["model.layers.0.mlp.experts.w13_weight"].shape == (4, 256, 256)
    sh = [s for c in ex.components for s in c.shards if s.rank == 1 and s.dst.endswith("w2_weight")]
    assert [(p.c0, p.c1) for s in sh for p in s.pieces] == [(128, 256)] * 4


def test_fp8_split_not_multiple_of_128_is_refused_with_name():
    pre = get_preset("qwen3-235b")  # moe_intermediate 1536: 192 per rank at TP8
    cfg = dict(pre.config, num_hidden_layers=1, num_experts=2)
    with pytest.raises(MappingError) as ei:
        expand(pre.rules, _shapes(pre, cfg), Layout(tp=8, ep=False, quant="fp8"), cfg)
    msg = str(ei.value)
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in msg and "192 rows per rank" in msg
    # the same layout in BF16, or with expert parallelism, is fine
    expand(pre.rules, _shapes(pre, cfg), Layout(tp=8, ep=False), cfg)
    expand(pre.rules, _shapes(pre, cfg), Layout(tp=2, ep=True, quant="fp8"), cfg)


def test_user_rule_in_a_few_lines():
    pre = get_preset("qwen3-tiny")
    shapes = _shapes(pre)
    shapes["model.layers.0.mlp.my_gate.weight"] = (128, 256)
    shapes["model.layers.0.mlp.my_up.weight"] = (128, 256)
    with pytest.raises(MappingError) as ei:  # a parameter no rule reads: refused, by name
        expand(pre.rules, shapes, Layout(tp=2), pre.config)
    assert "model.layers.0.mlp.my_gate.weight, model.layers.0.mlp.my_up.weight" in str(ei.value)
    assert "Ignore" in str(ei.value)
    lax = expand(pre.rules, shapes, Layout(tp=2), pre.config, strict=False)
    assert lax.unmatched == ["model.layers.0.mlp.my_gate.weight", "model.layers.0.mlp.my_up.weight"]
    ign = expand(
        pre.rules + [Ignore("", ("model.layers.{L}.mlp.my_gate.weight", "model.layers.{L}.mlp.my_up.weight"))],
        shapes,
        Layout(tp=2),
        pre.config,
    )
    assert ign.ignored == {"model.layers.0.mlp.my_gate.weight", "model.layers.0.mlp.my_up.weight"}
    pre.rules.append(
        Fuse(
            "model.layers.{L}.mlp.my_gate_up.weight",
            ("model.layers.{L}.mlp.my_gate.weight", "model.layers.{L}.mlp.my_up.weight"),
        )
    )
    ex = expand(pre.rules, shapes, Layout(tp=2), pre.config)
    assert not ex.unmatched
    assert ex.dest[1]["model.layers.0.mlp.my_gate_up.weight"].shape == (128, 256)


def test_missing_source_and_double_use_are_reported():
    pre = get_preset("qwen3-tiny")
    shapes = _shapes(pre)
    del shapes["model.layers.1.self_attn.v_proj.weight"]
    with pytest.raises(MappingError, match="model.layers.1.self_attn.v_proj.weight"):
        expand(pre.rules, shapes, Layout(tp=2), pre.config)
    rules = pre.rules + [Row("model.layers.{L}.x.weight", ("model.layers.{L}.mlp.down_proj.weight",))]
    with pytest.raises(MappingError, match="used by two rules"):
        expand(rules, _shapes(pre), Layout(tp=2), pre.config)


@pytest.mark.parametrize("name", ["llama3-8b", "qwen2-7b", "qwen3-8b", "qwen3-30b-a3b", "deepseek-v3"])
def test_presets_expand_and_cover_every_training_param(name):
    pre = get_preset(name)
    cfg = dict(pre.config, num_hidden_layers=min(pre.config["num_hidden_layers"], 4))
    shapes = _shapes(pre, cfg)
    ex = expand(pre.rules, shapes, Layout(tp=pre.infer_tp, ep=pre.infer_ep, quant=pre.quant), cfg)
    assert not ex.unmatched and ex.used == set(shapes)
    if name == "qwen2-7b":
        assert ex.dest[0]["model.layers.0.self_attn.qkv_proj.bias"].shape == ((28 // 2 + 2 * (4 // 2)) * 128,)


def test_kimi_k2_sizes():
    pre = get_preset("kimi-k2")
    hp = pre.hf_params()
    n = sum(math.prod(s) for s, _, _ in hp.values())
    assert 1.02e12 < n < 1.035e12
    ex = expand(pre.rules, {k: v[0] for k, v in hp.items()}, Layout(16, True, "fp8"), pre.config)
    per_rank = [ex.dest_bytes(r) for r in range(16)]
    assert max(per_rank) - min(per_rank) < 0.001 * max(per_rank)
    assert 64e9 < max(per_rank) < 66e9


def test_piece_and_experts_rule_are_declarative():
    r = Experts("model.layers.{L}.moe", ("a.{L}.{E}.g", "a.{L}.{E}.u", "a.{L}.{E}.d"))
    b = r.bindings(["a.3.0.g", "a.3.1.g", "a.4.0.g", "x"])
    assert b == [{"L": "3", "_experts": [0, 1]}, {"L": "4", "_experts": [0]}]
    assert Piece("x", 0, 256, 0, 128).numel() == 256 * 128 and BLOCK == 128


@pytest.mark.parametrize("ep", [True, False])
def test_expert_grouping_changes_no_byte(ep):
    pre = get_preset("qwen3-30b-a3b")
    cfg = small_moe(pre.config, 6)
    shapes = _shapes(pre, cfg)
    t = _rand_tensors(shapes, 5)
    one = expand(pre.rules, shapes, Layout(tp=2, ep=ep, quant="fp8", expert_group=1), cfg)
    three = expand(pre.rules, shapes, Layout(tp=2, ep=ep, quant="fp8", expert_group=3), cfg)
    n_one = sum(len(c.shards) for c in one.components)
    n_three = sum(len(c.shards) for c in three.components)
    assert n_three < n_one and len(three.components) < len(one.components)
    for r in range(2):
        a, b = _assemble(one, r, t), _assemble(three, r, t)
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k
