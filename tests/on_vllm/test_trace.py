"""The destination map traced from vLLM's own load_weights (wxfer.integrations.vllm.trace) against
wxfer's hand-written rules (wxfer.mapping.presets), element by element, on vLLM's real model
classes: Qwen3, Llama, Qwen2 and Qwen3-MoE (EP off and on), both ranks of TP2 (every split of the
rules: fused qkv / gate_up by heads, row-parallel, vocab-parallel, experts by the intermediate size
or by EP), BF16; FP8 block where this CPU builds vLLM's FP8 layers (AMX).  Any difference is a
failure; a deliberately wrong rule (gate and up swapped) must differ.  Each TP rank is one process
(tests/on_vllm/trace_proc.py) that builds every model in turn: two processes for the module, side
by side.  (TP1 runs end to end in test_reach.py; ``python tests/on_vllm/trace_proc.py OUT 1 0 PORT
CKPT:0:0 ...`` compares TP1 by hand.)"""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

DENSE = ("qwen3", "llama", "qwen2")


def _amx() -> bool:
    try:
        return "amx_tile" in open("/proc/cpuinfo").read()
    except OSError:
        return False


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    from trace_proc import save_tiny
    from wxfer.runtime.control import free_port

    tmp = str(tmp_path_factory.mktemp("trace"))
    specs = []
    for arch in DENSE + ("qwen3_moe",):
        save_tiny(os.path.join(tmp, arch), arch)
        specs.append(os.path.join(tmp, arch) + ":0:0")
    tp2 = specs + [os.path.join(tmp, "qwen3_moe") + ":0:1"]
    if _amx():
        save_tiny(os.path.join(tmp, "qwen3-fp8"), "qwen3", fp8=True, head_dim=128)
        tp2.append(os.path.join(tmp, "qwen3-fp8") + ":1:0")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + HERE)
    jobs = [(2, 0, tp2), (2, 1, tp2)]
    ports = {2: free_port()}
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.join(HERE, "trace_proc.py"), os.path.join(tmp, f"tp{tp}r{r}.json")]
            + [str(tp), str(r), str(ports[tp])]
            + s,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for tp, r, s in jobs
    ]
    outs = [p.communicate(timeout=480)[0] for p in procs]
    for (tp, r, _), p, o in zip(jobs, procs, outs):
        assert p.returncode == 0, f"tp{tp} rank {r} failed:\n" + o[-4000:]
    return {(tp, r): json.load(open(os.path.join(tmp, f"tp{tp}r{r}.json"))) for tp, r, _ in jobs}


@pytest.mark.parametrize("tp,rank", [(2, 0), (2, 1)])
def test_traced_map_equals_the_rules(traced, tp, rank):
    recs = traced[(tp, rank)]
    assert len(recs) >= 4
    for rec in recs:
        what = f"{rec['arch']} fp8={rec['fp8']} ep={rec['ep']} tp{tp} rank {rank}"
        assert rec["changed"] == [], f"{what}: the trace changed live parameters {rec['changed']}"
        assert rec["problems"] == {} and rec["shard_problems"] == [], what
        assert rec["raw_diff"] == [], f"{what}: shards differ from the raw traced map: {rec['raw_diff']}"
        assert rec["rules"], f"{what}: wxfer has rules for this architecture"
        assert rec["diff"] == [], f"{what}: traced map and hand-written rules differ at {rec['diff']}"
        assert rec["compared"] == rec["written"] >= 15, what
        if rec["arch"] in DENSE:  # the planted difference is seen
            assert any("gate_up_proj" in n for n in rec["wrong"]), what
        assert rec["kinds"] == (["fp8", "raw", "scale"] if rec["fp8"] else ["raw"]), what


def test_fp8_where_the_cpu_builds_it():
    if not _amx():
        pytest.skip("vLLM 0.32's CPU FP8 block linear needs AMX (Sapphire Rapids or newer); this CPU has none")
