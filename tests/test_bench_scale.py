"""benchmarks/bench_scale.py (issue 9) cannot rot: its CPU dry run (2 FSDP2 trainer
processes -> 1 replica x TP2, gloo + fabric tcp, tiny model) runs wxfer and the rank-0
broadcast end to end on the same weights, the rank-0 pattern leaves every inference rank
bit-identical to wxfer, every receiver reaches the last version, and the simulator's
prediction for the trainers' own plan is reported beside the measured time."""

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from helpers import bench_dry_run  # noqa: E402 -- tests/helpers.py


def test_row_shards_are_torch_chunk_and_weights_are_deterministic():
    import torch
    import bench_scale as bs

    w = bs.weight("model.layers.0.mlp.up_proj.weight", (7, 3), torch.bfloat16, torch.device("cpu"))
    assert torch.equal(w, bs.weight("model.layers.0.mlp.up_proj.weight", (7, 3), torch.bfloat16, torch.device("cpu")))
    assert not torch.equal(
        w, bs.weight("model.layers.0.mlp.gate_proj.weight", (7, 3), torch.bfloat16, torch.device("cpu"))
    )
    parts = [bs.rows(w, 4, r) for r in range(4)]
    assert [p.shape[0] for p in parts] == [2, 2, 2, 1] and torch.equal(torch.cat(parts), w)
    assert bs.rows(w[:2], 4, 3).shape[0] == 0  # more ranks than rows: empty shards


@pytest.mark.slow  # make test-slow (CI runs it after make test)
@pytest.mark.timeout(240)
def test_dry_run_wxfer_and_rank0_agree_and_the_simulator_is_reported(tmp_path):
    out = tmp_path / "bs"
    args = ("--models", "tiny", "--quant", "bf16,fp8", "--config-timeout", "100", "--max-s", "200")
    res, _ = bench_dry_run("bench_scale.py", out, *args, timeout=230, env=dict(WXFER_FABRIC_PROVIDER="tcp"))
    assert res["layout"] == dict(trainers=2, replicas=1, tp=2, colocated=True)
    assert [r["config"]["quant"] for r in res["results"]] == ["bf16", "fp8"]
    for r in res["results"]:
        assert "error" not in r["wxfer"] and "error" not in r["rank0"], r
        assert r["check"] is True and r["wxfer_written"] is True, r
        w = r["wxfer"]
        assert w["seconds"] > 0 and w["bytes"] == sum(w["bytes_per_rank"]) > 0
        assert all(v > 0 for v in w["bandwidths"].values()) and set(w["bandwidths"]) == {
            "write_GBps",
            "mem_GBps",
            "allgather_GBps",
        }
        assert 0 < w["simulated"]["lower_bound_s"] <= w["simulated"]["seconds"]
        assert r["sim_over_measured"] == pytest.approx(w["simulated"]["seconds"] / w["seconds"])
        assert r["rank0_over_wxfer"] == pytest.approx(r["rank0"]["seconds"] / w["seconds"])
    table = (out / "table.md").read_text()
    assert table.count("| tiny |") == 2 and "| ok |" in table
    assert json.loads((out / "results.json").read_text())["machine"]["dry_run"] is True
    assert (out / "trace-tiny-bf16.json").exists()
