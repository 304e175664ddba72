"""Reach at TP2 (issue 34.4): a real offline vllm.LLM of a tiny random Qwen3 with
``tensor_parallel_size=2`` on vLLM's CPU platform, its two workers in processes of vLLM's own
multiprocess executor (``distributed_executor_backend="mp"``, gloo).  Two jobs on the one engine,
two pushes each, and after each push all 8 of vLLM's greedy tokens equal transformers' greedy decode
of the trainer's weights (test_llm_moe.all_equal: the trainer's seeds are chosen so that no step
is a near tie, asserted first):

- the trainer with ``mapping=None``: each worker traces its own TP shard of vLLM's load_weights
  and the plan is built from both maps;
- the trainer with the hand-written rules (the HF config dict, the qwen3 preset).

vLLM's CPU GEMM dispatch as vLLM ships it (no keep_cpu_weights: every linear layer finalize).
vLLM's CPU executor binds each TP worker's OpenMP threads to a NUMA node by default
(``VLLM_CPU_OMP_THREADS_BIND=auto``); this VM has one node, and vLLM refuses ("Not enough allowed
NUMA nodes to bind threads of 2 local CPUWorkers"), so the test sets ``nobind``."""

import os
import sys
import time

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from test_llm import served, tokens  # noqa: E402
from test_llm_moe import all_equal  # noqa: E402


def summary(worker):
    """What one TP worker's wxfer engine holds (run in the worker by collective_rpc)."""
    eng = worker.weight_transfer_engine
    tm = eng.traced_map
    return dict(
        version=eng.receiver.version() if eng.receiver is not None else None,
        shapes={n: tuple(t.shape) for n, t in eng.receiver.params.items()} if eng.receiver is not None else {},
        traced=tm is not None,
        problems=list(tm.problems) if tm is not None else [],
        classes=(eng.proof_result or {}).get("classes"),
        finalize=dict(getattr(eng, "finalize_report", {}) or {}),
        update=dict(getattr(eng, "update_report", {}) or {}),
        tp_rank=eng._parallel()["rank"],
        pid=os.getpid(),
    )


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from trace_proc import save_tiny

    import wxfer.integrations.vllm as wv

    assert wv.register()
    old = {k: os.environ.get(k) for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_ENABLE_V1_MULTIPROCESSING")}
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core here, its workers vLLM's processes
    ck = str(tmp_path_factory.mktemp("tp2") / "qwen3")
    save_tiny(ck, "qwen3")
    from vhelp import wxfer_llm

    engine = wxfer_llm(ck, tensor_parallel_size=2, distributed_executor_backend="mp")
    yield engine
    try:
        engine.shutdown_weight_transfer_engine()
        engine.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 -- nothing left to release
        pass
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def two_pushes(llm, mode, seed0, monkeypatch):
    monkeypatch.setenv("WXFER_TEST_SEED0", str(seed0))
    first = tokens(llm)
    seen = []

    def pushed(v, hf):
        seen.append((v, tokens(llm), hf, llm.get_weight_version(), llm.collective_rpc(summary)))

    t0 = time.monotonic()
    served(llm, mode, pushed, shutdown=True)  # (the Receivers closed before the trainer's store goes)
    assert [s[0] for s in seen] == [1, 2]
    for v, got, hf, version, workers in seen:
        all_equal(got, hf)
        assert version == str(v)
        assert sorted(w["tp_rank"] for w in workers) == [0, 1] and len({w["pid"] for w in workers}) == 2
        assert all(w["version"] == v for w in workers), workers
    assert seen[0][1] != first or seen[1][1] != first
    workers = seen[1][4]
    for w in workers:
        sh = w["shapes"]
        # each worker registered its own shard: half the heads of qkv (q 4x64 + k, v 2x64 -> 512
        # rows at TP1), half of gate_up's rows, half of o_proj's / down_proj's columns
        assert sh["model.layers.0.self_attn.qkv_proj.weight"] == (256, 256), sh
        assert sh["model.layers.0.mlp.gate_up_proj.weight"] == (256, 256), sh
        assert sh["model.layers.0.self_attn.o_proj.weight"] == (256, 128), sh
        assert sh["model.layers.1.mlp.down_proj.weight"] == (256, 128), sh
        cls = w["classes"]
        assert cls is not None and cls["refused"] == [], cls
        # vLLM's CPU GEMM as shipped: every linear layer finalize, re-run after each update
        assert "model.layers.0.self_attn.qkv_proj" in cls["finalize"], cls
        assert w["finalize"]["updates"] == 2 and w["finalize"]["seconds"] > 0, w["finalize"]
        up = w["update"]  # the whole update timed by the backend on each worker
        assert up["version"] == 2 and up["finalize_s"] > 0 and up["total_s"] >= up["write_s"] + up["finish_s"], up
    print(
        f"\n{mode}: tokens {[s[1] for s in seen]}, transformers {[[h[0] for h in s[2]] for s in seen]}; "
        f"engine start {llm.wxfer_start_s:.1f} s, job {time.monotonic() - t0:.1f} s; "
        f"finalize per update per worker {[round(w['finalize']['seconds'], 4) for w in workers]} s; "
        f"update {[w['update'] for w in workers]}"
    )
    return workers


def test_tp2_traced_map_two_pushes_give_transformers_tokens(llm, monkeypatch):
    workers = two_pushes(llm, "traced", 45, monkeypatch)  # seeds 46, 47: margins >= 4 BF16 ulps
    assert all(w["traced"] and not w["problems"] for w in workers), workers


def test_tp2_preset_two_pushes_give_transformers_tokens(llm, monkeypatch):
    workers = two_pushes(llm, "ok", 72, monkeypatch)  # seeds 73, 74: margins >= 6 BF16 ulps
    assert not any(w["traced"] for w in workers), workers
