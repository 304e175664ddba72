"""The trainer of tests/on_vllm/test_serve.py (not a test module), two ranks under torchrun:

    python -m torch.distributed.run --nproc_per_node 2 serve_trainer.py CKPT URL STORE START_S

Each rank builds transformers' model for the checkpoint's config with seeded weights (the same
on both ranks); rank 0 records transformers' greedy tokens of the checkpoint and of those
weights.  The model is then sharded by FSDP2 (``fully_shard`` per decoder layer and at the root,
gloo, CPU).  Rank 0 waits (at most START_S seconds) until the `vllm serve` at URL answers
``/health``, asks it for the greedy tokens before the push (``/v1/completions``), and every rank
reaches it through vLLM's trainer factory (backend "wxfer") with vLLM's own
``HTTPVLLMWeightSyncClient`` (``/init_weight_transfer_engine``).  Rank 0 pauses generation
(``POST /pause``), every rank pushes (``send_weights``: ``/start_weight_update``,
``/update_weights``, ``/finish_weight_update``), rank 0 resumes (``POST /resume``) and prints one
line ``RESULT {json}``.  Every HTTP call is bounded (HTTP_S) and its error names the step.
"""

import datetime
import json
import os
import sys
import time

import requests  # vLLM's HTTP client uses it too

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.stdout.reconfigure(line_buffering=True, write_through=False)  # one write per line (torchrun)

HTTP_S = 60.0  # each HTTP call's bound


def call(method, url, route, what, **kw):
    """One HTTP call, bounded; raises naming the step on an error or a status other than 200."""
    try:
        r = requests.request(method, f"{url}/{route}", timeout=HTTP_S, **kw)
    except requests.RequestException as e:
        raise RuntimeError(f"{what}: {method} /{route} failed: {type(e).__name__}: {e}") from e
    if r.status_code != 200:
        raise RuntimeError(f"{what}: {method} /{route} returned {r.status_code}: {r.text[:500]}")
    return r.json() if r.content else None


def wait_health(url, start_s):
    deadline = time.monotonic() + start_s
    while time.monotonic() < deadline:
        try:
            if requests.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"vllm serve at {url} did not answer /health within {start_s:.0f} s")


def completion_tokens(url, model, what):
    """vLLM's greedy tokens for trainer_proc.PROMPT over /v1/completions."""
    from trainer_proc import completion_request

    return call("POST", url, "v1/completions", what, json=completion_request(model))["choices"][0]["token_ids"]


def main(ckpt, url, store, start_s):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig, AutoModelForCausalLM
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    from trainer_proc import greedy, seeded
    from wxfer.integrations.vllm import WxferTrainerInitInfo  # registers the backend
    from wxfer.models.train import shard_fsdp2

    t_start = time.monotonic()
    start_s = float(start_s)
    # rank 1 waits in the barrier below while rank 0 waits for the server
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=start_s + 120))
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = AutoConfig.from_pretrained(ckpt)
    ref = {}
    if rank == 0:  # transformers' greedy tokens of the checkpoint
        ref["checkpoint"] = greedy(AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).eval())
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    seeded(model, 1)
    if rank == 0:  # ... and of the weights the trainers push
        ref["pushed"] = greedy(model)
    model = shard_fsdp2(model, init_device_mesh("cpu", (world,)))
    for p in model.parameters():
        p.requires_grad_(False)
    assert type(model.model.layers[0].mlp.down_proj.weight).__name__ == "DTensor"
    res = dict(ref, trainer_ready_s=time.monotonic() - t_start)
    client = None
    if rank == 0:
        wait_health(url, start_s)
        res["server_seen_s"] = time.monotonic() - t_start
        res["before"] = completion_tokens(url, ckpt, "before the push")
        client = HTTPVLLMWeightSyncClient(url, timeout=HTTP_S)
    dist.barrier()
    info = WxferTrainerInitInfo(
        store=store,
        mapping=dict(cfg.to_dict(), name_or_path="tiny"),  # the HF config: no preset named
        name="serve",
        timeout=60.0,
        update_timeout=30.0,
        rank=rank,
    )
    t0 = time.monotonic()
    eng = WeightTransferTrainerFactory.trainer_init(info, client=client, source=ModuleSource(model))
    res["setup_s"] = time.monotonic() - t0
    t0 = time.monotonic()
    if rank == 0:
        call("POST", url, "pause", "pausing generation")
        res["paused"] = call("GET", url, "is_paused", "reading the pause state")["is_paused"]
    dist.barrier()
    res["version"] = eng.send_weights()
    if rank == 0:
        call("POST", url, "resume", "resuming generation")
    res["update_s"] = time.monotonic() - t0
    if rank == 0:
        res["weight_version"] = call("GET", url, "weight_info", "reading the weight version")["weight_version"]
        print("RESULT " + json.dumps(res))
    dist.barrier()
    eng.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:5])
