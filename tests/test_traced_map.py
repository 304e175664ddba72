"""The load_weights tracer (wxfer.integrations.vllm.trace) and the traced map's shards
(wxfer.mapping.traced) without vLLM: a torch module whose load_weights does what vLLM's loaders do
(a fused [q|k|v] by narrow, a row-parallel narrow on dim 1, a transposed copy, a stacked expert
weight by cat, setitem, a cast), traced over fake checkpoint tensors; the shards packed from real
tensors by the reference packing equal, byte for byte, what the same load_weights writes when it
runs for real.  What the tracer cannot express is reported by parameter name; the live
parameters never change; the map's digest covers its content."""

import copy

import numpy as np
import pytest
import torch

from wxfer.integrations.vllm.trace import trace_load, trace_model
from wxfer.mapping import pack_shard
from wxfer.mapping.traced import TracedMap, element_table, rank_shards, traced_preset
from helpers import StoreCtl  # tests/helpers.py

H, Q, KV, TP = 8, 8, 4, 2


class Toy(torch.nn.Module):
    """TP rank `rank` of 2 of a toy model; load_weights in vLLM's style."""

    def __init__(self, rank=1, bad=False):
        super().__init__()
        self.rank, self.bad = rank, bad
        self.qkv = torch.nn.Parameter(torch.zeros((Q + 2 * KV) // TP, H, dtype=torch.bfloat16), requires_grad=False)
        self.o = torch.nn.Parameter(torch.zeros(H, Q // TP, dtype=torch.bfloat16), requires_grad=False)
        self.tr = torch.nn.Parameter(torch.zeros(H, 6, dtype=torch.float32), requires_grad=False)
        self.experts = torch.nn.Parameter(torch.zeros(2, 4, H, dtype=torch.bfloat16), requires_grad=False)
        self.emb = torch.nn.Parameter(torch.zeros(12, H, dtype=torch.bfloat16), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.zeros(H, dtype=torch.bfloat16), requires_grad=False)
        self.register_buffer("rope", torch.ones(4))
        self.held = {}

    def load_weights(self, weights):
        r = self.rank
        for name, w in weights:
            if name in ("q", "k", "v"):
                n = {"q": Q, "k": KV, "v": KV}[name] // TP
                at = {"q": 0, "k": Q // TP, "v": Q // TP + KV // TP}[name]
                self.qkv.data.narrow(0, at, n).copy_(w.narrow(0, r * n, n))
            elif name == "o":
                self.o.data.copy_(w.narrow(1, r * (Q // TP), Q // TP))
            elif name == "t":  # stored transposed, cast to float32
                self.tr.data.copy_(w.t().to(torch.float32))
            elif name.startswith("x"):  # experts stacked with cat once both arrived
                self.held[name] = w
                if len(self.held) == 2:
                    self.experts.data.copy_(torch.stack([self.held["x0"], self.held["x1"]]))
            elif name == "emb":  # vocab padding: 10 rows of the checkpoint, 2 padded
                self.emb[: w.shape[0]] = w
                self.emb.data[w.shape[0] :].fill_(0)
            elif name == "norm":
                self.norm.data.copy_(w * 2 if self.bad else w)
                if self.bad:  # a constant in the middle of a parameter: not a window of rows
                    self.qkv.data[1:2].fill_(0)


CKPT = [
    ("q", (Q, H), "bfloat16"),
    ("k", (KV, H), "bfloat16"),
    ("v", (KV, H), "bfloat16"),
    ("o", (H, Q), "bfloat16"),
    ("t", (6, H), "bfloat16"),
    ("x0", (4, H), "bfloat16"),
    ("x1", (4, H), "bfloat16"),
    ("emb", (10, H), "bfloat16"),
    ("norm", (H,), "bfloat16"),
]


def real_tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g).to(getattr(torch, d)) for n, s, d in CKPT}


def test_trace_records_every_write_without_doing_it():
    m = Toy()
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(7)
    before = copy.deepcopy(m.state_dict())
    tm = trace_load(m, CKPT, rank=1)
    for n, t in m.state_dict().items():
        assert torch.equal(t, before[n]), f"{n} changed"
    assert set(tm.written()) == {"qkv", "o", "tr", "experts", "emb", "norm"}
    assert "buffer:rope" in tm.params and "buffer:rope" not in tm.runs
    # the vocab padding: rows [10, 12) constant, the plan writes rows [0, 10) as the parameter
    assert tm.problems == {} and tm.window("emb") == (0, 10 * H) and tm.dest_shape("emb") == (10, H)
    d, s, n = tm.runs["o"]  # row-parallel: one run per row of 4, from column 4 of each row of o
    assert len(d) == H and set(n.tolist()) == {Q // TP}
    assert [int(x) & ((1 << 40) - 1) for x in s[:2]] == [4, 12]


def test_shards_pack_the_bytes_the_real_load_writes():
    tm = trace_load(Toy(), CKPT, rank=1)
    params, shards, problems = rank_shards(tm)
    assert not problems and [p.shape for p in params if p.name == "emb"] == [(10, H)]
    kinds = {sh.dst: sh for sh in shards}
    assert [p.src for p in kinds["qkv"].pieces] == ["q", "k", "v"]
    assert len(kinds["o"].pieces) == 1 and kinds["o"].pieces[0][1:] == (0, H, 4, 8)  # one box
    real = real_tensors()
    ref = Toy()
    with torch.no_grad():
        ref.load_weights(iter(real.items()))
    from wxfer.integrations.vllm.traced import registered

    windows = {p.name: tm.window(p.name) for p in params}
    sel, left = registered(ref.named_parameters(), windows)
    assert left == [] and dict(sel)["emb"].shape == (10, H)  # the written rows, a view of the parameter
    assert dict(sel)["emb"].data_ptr() == ref.emb.data_ptr()
    got = {}
    for sh in shards:
        got.setdefault(sh.dst, bytearray(dict(sel)[sh.dst].numel() * sh_es(sh)))
        b = pack_shard(sh, real).numpy().tobytes()
        got[sh.dst][sh.offset : sh.offset + len(b)] = b
    for n, p in sel:
        assert bytes(got[n]) == p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes(), n


def sh_es(sh):
    return {"bfloat16": 2, "float32": 4}[sh.dtype]


def test_unexpressible_writes_are_named():
    tm = trace_load(Toy(bad=True), CKPT, rank=0)
    assert "mul.Tensor computed from checkpoint tensor(s) norm" in " ".join(tm.problems["norm"])
    assert "norm" not in tm.runs
    assert "qkv" in tm.problems and "also writes from the checkpoint" in tm.problems["qkv"][0]
    _, _, problems = rank_shards(tm)
    assert any(p.startswith("qkv (rank 0)") for p in problems)


def test_map_travels_digest_checked():
    tm = trace_load(Toy(), CKPT, rank=1)
    blob = tm.to_bytes()
    back = TracedMap.from_bytes(blob, tm.digest())
    assert back.digest() == tm.digest() and back.written() == tm.written()
    for p in tm.runs:
        for a, b in zip(tm.runs[p], back.runs[p]):
            assert np.array_equal(a, b)
    bad = blob.replace(b'"rank":1', b'"rank":0')
    with pytest.raises(ValueError, match="do not match their digest"):
        TracedMap.from_bytes(bad, tm.digest())
    other = trace_load(Toy(rank=0), CKPT, rank=1)
    assert other.digest() != tm.digest()  # rank 0's slices: other runs, another digest
    assert tm.digest() in repr(traced_preset({0: tm}))  # what mapping digests hash: content


def test_traced_preset_expands_like_rules():
    from wxfer.mapping import Layout, expand

    maps = {r: trace_load(Toy(rank=r), CKPT, rank=r) for r in range(TP)}
    preset = traced_preset(maps)
    shapes = {n: s for n, s, _ in CKPT}
    ex = expand(preset.rules, shapes, Layout(TP), {}, strict=False)
    assert sorted(ex.dest) == [0, 1] and "qkv" in ex.dest[0] and ex.dest[1]["emb"].shape == (10, H)
    tab = element_table([sh for c in ex.components for sh in c.shards], shapes)
    assert tab[(0, "qkv")][0][1:3] == ("q", 0) and tab[(1, "qkv")][0][1:3] == ("q", (Q // TP) * H)
    with pytest.raises(ValueError, match="lacks checkpoint tensor"):
        expand(preset.rules, {n: s for n, s in shapes.items() if n != "k"}, Layout(TP), {}, strict=False)
    with pytest.raises(ValueError, match="TP=4"):
        expand(preset.rules, shapes, Layout(4), {}, strict=False)


def test_fp8_names_are_made_for_float8_parameters():
    class F(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(256, 128, dtype=torch.float8_e4m3fn), requires_grad=False)
            self.w_scale_inv = torch.nn.Parameter(torch.zeros(2, 1), requires_grad=False)

        def load_weights(self, weights):
            for n, t in weights:
                getattr(self, n).data.copy_(t)

    m = trace_model(F(), [("w", (256, 128), "bfloat16")])
    assert m.sources == {"w": ((256, 128), "float8_e4m3fn"), "w_scale_inv": ((2, 1), "float32")}
    _, shards, problems = rank_shards(m)
    assert not problems and sorted(sh.kind for sh in shards) == ["fp8", "scale"]


def test_trainers_use_the_trace_without_a_preset():
    from wxfer.integrations.vllm.trainer import WxferTrainerInitInfo, uses_trace

    assert uses_trace(WxferTrainerInitInfo(mapping=None))
    assert uses_trace(WxferTrainerInitInfo(mapping={"model_type": "olmo2", "hidden_size": 8}))
    assert not uses_trace(WxferTrainerInitInfo(mapping="qwen3-8b"))
    assert not uses_trace(WxferTrainerInitInfo(mapping=None, traced=False))
    assert uses_trace(WxferTrainerInitInfo(mapping="qwen3-8b", traced=True))


def test_traced_proof_packs_whole_parameters_and_registers_by_class():
    """proof.traced_checkpoint / traced_packed (the post-processing proof's input on the traced
    path): seeded tensors for the traced checkpoint names, the map's shards packed into each whole
    parameter, the vocab padding outside the window the loader's constant: byte for byte what the
    same load_weights lays for those tensors.  traced.proven registers a direct parameter's live
    storage and a finalize one's kept memory, each with its window."""
    from types import SimpleNamespace

    from wxfer.integrations.vllm.proof import traced_checkpoint, traced_packed
    from wxfer.integrations.vllm.traced import proven

    tm = trace_load(Toy(), CKPT, rank=1)
    params, shards, problems = rank_shards(tm)
    assert not problems
    full, ckpt = traced_checkpoint(tm, seed=5)
    assert [n for n, _ in ckpt] == list(tm.sources) and all(full[n].dtype == t.dtype for n, t in ckpt)
    packed = traced_packed(tm, params, shards, full)
    ref = Toy()
    with torch.no_grad():
        ref.emb.fill_(7.0)  # the loader sets the padding rows itself
        ref.load_weights(iter(ckpt))
    live = dict(ref.named_parameters())
    assert set(packed) == {p.name for p in params}
    for n, b in packed.items():
        assert torch.equal(b, live[n].detach().contiguous().view(-1).view(torch.uint8)), n
    assert packed["emb"].numel() == live["emb"].numel() * 2  # the whole parameter, padding included

    kept = torch.empty_like(ref.emb)
    f = SimpleNamespace(params={"weight": kept})
    direct = [p.name for p in params if p.name != "emb"]
    cls = SimpleNamespace(direct=direct, finalize_dests={"emb": (f, "weight")})
    windows = {p.name: tm.window(p.name) for p in params}
    sel, left = proven(list(ref.named_parameters()), windows, cls)
    sel = dict(sel)
    assert left == [] and set(sel) == {p.name for p in params}
    assert sel["emb"].data_ptr() == kept.data_ptr() and sel["emb"].shape == (10, H)  # the kept memory's window
    assert all(sel[n].data_ptr() == live[n].data_ptr() for n in direct)


def test_worker_trace_publishes_the_proofs_refusals(tmp_path):
    """worker_trace runs `prove` before publishing: its refusals go into the map's meta as the
    worker's errors (the trainers raise them) and the worker raises them by name; a clean proof's
    classification is returned and summarized in the meta."""
    from types import SimpleNamespace

    from safetensors.torch import save_file

    from wxfer.integrations.vllm.traced import TraceError, worker_trace

    save_file({n: t.contiguous() for n, t in real_tensors().items()}, str(tmp_path / "model.safetensors"))
    vc = SimpleNamespace(model_config=SimpleNamespace(model=str(tmp_path)))
    par = dict(tp=2, rank=1, ep=False)
    seen = []

    def prove(refused):
        def run(m, params, shards):
            seen.append(sorted(p.name for p in params))
            return SimpleNamespace(refused=refused, summary=lambda: dict(direct=len(params))), {}

        return run

    ctl = StoreCtl()
    with pytest.raises(TraceError, match="post-processing proof refused 1 tensor.*o: bytes differ"):
        worker_trace(Toy(), vc, par, 0, 1, ctl, None, "worker", prove(["o: bytes differ"]))
    meta = ctl.kv["vllm/trace/1/meta"]
    assert meta["errors"] == ["post-processing proof: o: bytes differ"] and "vllm/trace/1" in ctl.kv
    ctl = StoreCtl()
    m, windows, cls = worker_trace(Toy(), vc, par, 0, 1, ctl, None, "worker", prove([]))
    assert ctl.kv["vllm/trace/1/meta"]["errors"] == [] and ctl.kv["vllm/trace/1/meta"]["proof"]["direct"] == 6
    assert windows["emb"] == (0, 10 * H) and cls.refused == [] and seen[0] == seen[1] == sorted(windows)
