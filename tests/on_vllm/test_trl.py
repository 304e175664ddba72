"""TRL's own GRPO loop (trl 1.16.0, colocate mode: its ``vllm.LLM`` in the trainer's process) with
every weight sync through the wxfer backend (trl_proc.py's ``WxferGRPOTrainer``, the lines
docs/vllm.md "TRL GRPO" shows): a tiny random Qwen3, CPU, a toy reward, three GRPO steps of two
completions of four tokens.  After the steps (and the sync the next step would do first) every
byte vLLM's engine holds equals what vLLM's own loader lays for the trainer's weights, which
moved; the syncs were wxfer's (its Receiver's version and vLLM's weight version advanced once per
sync) and TRL's own ``load_weights`` was never called."""

import json
import os
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_trl_grpo_colocate_syncs_through_wxfer(tmp_path):
    from test_llm import same_greedy

    pytest.importorskip("trl", reason="trl is not installed in this Python (make vllm-setup installs trl==1.16.0)")
    out = tmp_path / "out.json"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env.update(PYTHONPATH=ROOT + os.pathsep + HERE, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")
    t0 = time.monotonic()
    try:
        p = subprocess.run(
            [sys.executable, os.path.join(HERE, "trl_proc.py"), str(out), "wxfer"],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=840,
        )
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"TRL's GRPO run did not finish in 840 s:\n{(e.stdout or '')[-4000:]}") from e
    wall = time.monotonic() - t0
    log = (p.stdout + p.stderr)[-6000:]
    assert p.returncode == 0 and out.exists(), f"trl_proc.py failed ({p.returncode}):\n{log}"
    res = json.loads(out.read_text())
    assert "error" not in res, res.get("traceback", res["error"])
    syncs = res["sync_s"] + [res["final_sync_s"]]
    print(
        f"\ntest_trl: wall {wall:.1f} s (trainer + LLM built in {res['build_s']:.1f} s, {res['global_step']} GRPO "
        f"steps in {res['train_s']:.1f} s); wxfer syncs {', '.join('%.3f' % s for s in syncs)} s"
    )
    assert res["global_step"] == 3 and len(res["sync_s"]) == 3, res  # one sync before each step's generation
    assert res["engine"] == "WxferWeightTransferEngine", res
    assert res["receiver_version"] == 4 and res["weight_version"] == "4", res
    assert res["load_weights_calls"] == 0, res  # TRL's own sync never ran
    assert res["proof"].get("errors") == 0 and res["registered"] == 19, res
    assert len(res["moved"]) == 25, res  # GRPO moved every trainer parameter
    assert res["differ"] == [], res  # vLLM holds exactly the trainer's last weights
    assert same_greedy(res["vllm_greedy"], res["hf_greedy"]) >= 4, res  # and generates from them
