"""A trainer rank of tests/on_vllm/test_vllm_delta.py (not a test module); the arguments of
trainer_proc.py (MODE "delta").

Two ranks (gloo) push transformers' Qwen3ForCausalLM into the test's vllm.LLM through vLLM's
trainer factory with ``WxferTrainerInitInfo(delta={"link_Bps": 125e6, "measure_link": False})``
(a pinned 1 Gb/s link, so that the chooser sends records).  Round 1 is the seeded weights (the
first push: dense by rule); every later round moves 1% of each parameter's elements by +-0.05
(`nudge`, the same on both ranks).  Rounds 1-3 go through ``send_weights``; round 4 is pushed
with the Sender alone (no RPC: the workers never run finish_weight_update, so they miss its
records); round 5's ``send_weights`` then fails on the workers' apply (DeltaError, a resync
asked); round 6's is dense to them and commits.  Rank 0 reports each round:
("pushed", round, {tokens, weights (BF16 bits as int16 arrays: torch's pickler would share
memory), delta (Sender.stats()["delta"]["last"]), error}).
"""

import os
import sys

from trainer_proc import ConnClient, greedy, reported, seeded

os.environ.setdefault("HF_HUB_OFFLINE", "1")

LINK = {"link_Bps": 125e6, "measure_link": False}


def nudge(model, rnd):
    """1% of every parameter's elements (at least one) moved by +-0.05, seeded by the round."""
    import torch

    g = torch.Generator().manual_seed(1000 + rnd)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            flat = p.data.view(-1)
            idx = torch.randperm(flat.numel(), generator=g)[: max(1, flat.numel() // 100)]
            sign = torch.randint(0, 2, (len(idx),), generator=g).float() * 2 - 1
            flat[idx] = (flat[idx].float() + 0.05 * sign).to(p.dtype)


def main(ckpt, store, name, mode, rank, world, dist_port, conn_port):
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    import wxfer.integrations.vllm  # noqa: F401 -- registers the backend
    from wxfer.integrations.vllm import WxferTrainerInitInfo

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{dist_port}", rank=rank, world_size=world)
    conn = None
    if rank == 0:
        from multiprocessing.connection import Client

        conn = Client(("127.0.0.1", conn_port), authkey=b"wxfer-test")
    cfg = AutoConfig.from_pretrained(ckpt)
    mapping = dict(cfg.to_dict(), name_or_path="tiny")  # FP8: its quantization_config, the FP8 rules
    plain = cfg.__class__.from_dict({k: v for k, v in cfg.to_dict().items() if k != "quantization_config"})
    model = AutoModelForCausalLM.from_config(plain, dtype=torch.bfloat16).eval()  # trains in BF16
    for p in model.parameters():
        p.requires_grad_(False)
    seeded(model, 1)
    info = WxferTrainerInitInfo(
        store=store,
        mapping=mapping,
        name=name,
        timeout=60.0,
        update_timeout=15.0,
        watermark="64MiB",
        delta=dict(LINK),
        delta_staging="1MiB",
        rank=rank,
    )
    with reported(conn, rank, reraise=True):
        eng = WeightTransferTrainerFactory.trainer_init(info, client=ConnClient(conn), source=ModuleSource(model))
        for rnd in range(1, 7):
            if rnd > 1:
                nudge(model, rnd)
            err = None
            if rnd == 4:  # pushed, never committed: the workers do not apply its records
                eng.sender.push(version=rnd)
                continue
            try:
                eng.send_weights(version=rnd)
            except Exception as e:  # noqa: BLE001 -- raised on every rank (round 5); reported
                err = f"{type(e).__name__}: {e}"
            if rank == 0:
                out = dict(delta=eng.sender.stats()["delta"]["last"], error=err)
                if err is None:
                    out.update(
                        tokens=greedy(model),
                        weights={n: p.detach().view(torch.int16).numpy().copy() for n, p in model.named_parameters()},
                    )
                conn.send(("pushed", rnd, out))
                assert conn.recv() == ("next", None)
            dist.barrier()
        eng.shutdown()


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], a[1], a[2], a[3], int(a[4]), int(a[5]), int(a[6]), int(a[7]))
