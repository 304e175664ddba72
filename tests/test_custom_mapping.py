"""A user-written mapping: the `hf_layout_preset` of docs/mapping.md (taken from the page
itself, so the page shows what runs) for an engine that keeps the Hugging Face layout (no
fusion, TP 1).  A trainer process (FSDP2 over gloo, transformers' Qwen3ForCausalLM) pushes
through it into a receiver in this process holding its own transformers model in BF16;
every parameter must equal the trainer's weights in BF16, and the engine model's logits the
logits of those weights."""

import multiprocessing as mp
import os
import re

import pytest
import torch

from wxfer import _wxfer
from wxfer.testing import ONE_WORKER

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "mapping.md")
FABRIC = _wxfer.backends()["fabric"][0]
pytestmark = [
    pytest.mark.skipif(not FABRIC, reason="fabric transport not built"),
    pytest.mark.skipif(not os.path.exists(DOC), reason="docs/mapping.md is not here (installed tests)"),
]
T = 60.0


def _doc_preset_fn():
    text = open(DOC).read()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    (code,) = [b for b in blocks if "def hf_layout_preset" in b]
    ns: dict = {}
    exec(compile(code, DOC, "exec"), ns)
    return ns["hf_layout_preset"]


def _trainer(addr, preset, cfg, out_path, port):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from wxfer.models import logits, shard_fsdp2, train_model
    from wxfer.runtime import prepare
    from wxfer.runtime.sender import Sender

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        model = shard_fsdp2(train_model(cfg, seed=3), init_device_mesh("cpu", (1,)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ids = torch.randint(0, cfg["vocab_size"], (2, 17), generator=torch.Generator().manual_seed(1))
        out = logits(model, ids[:, :-1])
        torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), ids[:, 1:].reshape(-1)).backward()
        opt.step()
        sender = Sender(model, mapping=preset, store=addr, name="custom", timeout=T)
        sender.push(version=1)
        with torch.no_grad():
            full = {n: prepare.full_tensor(p, p.to_local()).detach().clone() for n, p in model.named_parameters()}
        torch.save(full, out_path)
        sender.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_hf_layout_preset_from_the_docs_between_two_processes(store, tmp_path):
    from wxfer.models import TINY, logits, logits_close, logits_of_weights, train_model
    from wxfer.mapping import Fuse, Layout, expand
    from wxfer.runtime import control
    from wxfer.runtime.receiver import Receiver

    fn = _doc_preset_fn()
    cfg = dict(TINY)
    preset = fn(cfg)
    assert all(isinstance(r, Fuse) for r in preset.rules)
    # the preset covers every parameter of transformers' model, each into itself
    engine = train_model(cfg, seed=99, dtype=torch.bfloat16)  # the engine's own model, other weights
    shapes = {n: tuple(p.shape) for n, p in engine.named_parameters()}
    ex = expand(preset.rules, shapes, Layout(tp=1), cfg)
    assert {n: d.shape for n, d in ex.dest[0].items()} == shapes
    _, addr = store
    out_path = str(tmp_path / "weights.pt")
    proc = mp.get_context("spawn").Process(target=_trainer, args=(addr, preset, cfg, out_path, control.free_port()))
    proc.start()
    try:
        before = {n: p.detach().clone() for n, p in engine.named_parameters()}
        recv = Receiver(
            engine.named_parameters(),
            mapping=preset,
            store=addr,
            **ONE_WORKER,
            name="custom",
            timeout=T,
        )
        assert recv.wait_version(1, T) == 1
        proc.join(T)
        assert proc.exitcode == 0, proc.exitcode
        full = torch.load(out_path)
        assert set(full) == set(shapes)
        for n, p in engine.named_parameters():
            assert torch.equal(p.detach().view(torch.uint8), full[n].to(torch.bfloat16).view(torch.uint8)), n
        assert any(not torch.equal(before[n], p.detach()) for n, p in engine.named_parameters())
        ids = torch.randint(0, cfg["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            got = logits(engine, ids).float()  # the engine's model, its own forward, in BF16
        ok, err = logits_close(logits_of_weights(cfg, full, ids, torch.bfloat16), got, None)
        assert ok and err < 0.01, err  # BF16 arithmetic (and BF16 rotary tables) against FP32
        recv.close()
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(5)
