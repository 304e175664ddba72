"""The whole weight update in a real vLLM on CPU, start -> writes -> finish, against vLLM's own
reload of the same bytes in the same process.

    .venv-vllm/bin/python benchmarks/bench_vllm_update.py [--arch qwen3] [--hidden 512] [--layers 4]
        [--vocab 4096] [--pushes 5] [--mapping traced|preset] [--keep] [--out r.json]

A random `arch` model (tests/on_vllm/trace_proc.tiny_config with the sizes given) saved as an HF
directory; an offline ``vllm.LLM`` (in this process, TP1, ``WeightTransferConfig(backend="wxfer")``,
vLLM's CPU GEMM as vLLM ships it unless --keep: ``keep_cpu_weights()``); one trainer process (this
script, --trainer) that builds transformers' model of the same config, reaches the engine through
vLLM's trainer factory (``mapping=None``: the plan from the map the worker traces; ``preset``: the
hand-written rules from the HF config) and pushes `pushes` times, new weights each time.

Printed: the machine; the setup (engine start, trainer_init: trace, proof, connection); per push
the trainer's parts (``last_send``: start RPC, push, the update_weights RPC, finish RPC, total)
and the worker's (``update_report``: start_s, write_s, finish_s with apply_s (None: dense, no apply) and finalize_s,
total_s); then the bounds measured in the same process on the same model: vLLM's own reload of the
trainer's last weights (``initialize_layerwise_reload``, ``load_weights``, ``finalize_layerwise_reload``:
what its nccl / ipc backends run once the tensors arrived, transport not counted) and a plain
``copy_`` of the same bytes into same-sized tensors.  Seconds are medians over the pushes after the
first (and over `pushes` reloads / copies).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TESTS = os.path.join(ROOT, "tests", "on_vllm")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def sizes(a) -> dict:
    """The config overrides of --hidden / --layers / --vocab; none: the tests' tiny model."""
    if not a.hidden:
        return {}
    heads = max(1, a.hidden // 64)
    return dict(
        hidden_size=a.hidden,
        intermediate_size=2 * a.hidden,
        num_hidden_layers=a.layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        vocab_size=a.vocab,
    )


def save_deepseek(path):
    """mla_proc.tiny_config as an HF directory of transformers' DeepseekV3ForCausalLM (in a clean
    interpreter: nothing of vLLM imported yet here)."""
    import torch
    from mla_proc import tiny_config
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    d = tiny_config()
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(DeepseekV3Config(**d), dtype=torch.bfloat16)
    m.save_pretrained(path)
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg.update(architectures=d["architectures"], topk_method=d["topk_method"], scoring_func=d["scoring_func"])
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


def trainer(ckpt, store, name, port, mapping, pushes):
    """The trainer process: transformers' model, vLLM's trainer factory, `pushes` pushes."""
    from multiprocessing.connection import Client

    import torch
    from trainer_proc import ConnClient, checkpoint_named, seeded
    from transformers import AutoConfig, AutoModelForCausalLM
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    from wxfer.integrations.vllm import WxferTrainerInitInfo

    conn = Client(("127.0.0.1", port), authkey=b"wxfer-bench")
    cfg = AutoConfig.from_pretrained(ckpt)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    m = None if mapping == "traced" else dict(cfg.to_dict(), name_or_path="bench")
    info = WxferTrainerInitInfo(store=store, mapping=m, name=name, timeout=600.0, update_timeout=120.0, rank=0)
    t0 = time.monotonic()
    src = checkpoint_named(model) if mapping == "traced" else model
    eng = WeightTransferTrainerFactory.trainer_init(info, client=ConnClient(conn), source=ModuleSource(src))
    setup = time.monotonic() - t0
    for v in range(1, pushes + 1):
        seeded(model, v)  # new weights (not timed)
        eng.send_weights()
        conn.send(("pushed", v, dict(eng.last_send)))
        assert conn.recv() == ("next", None)
    conn.send(("done", setup))
    conn.recv()  # the workers closed their Receivers (before this process's store goes)
    eng.shutdown()


def serve(llm, conn, proc, timeout=1800.0):
    """The client's RPCs from the trainer, served on `llm`; per push the worker's update_report."""
    from wxfer.integrations.vllm import LLMClient

    client, pushes, deadline = LLMClient(llm), [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not conn.poll(1.0):
            if proc.poll() is not None:
                raise SystemExit("the trainer exited:\n" + proc.stdout.read()[-4000:])
            continue
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            proc.wait(timeout=60)
            raise SystemExit("the trainer exited:\n" + proc.stdout.read()[-6000:]) from None
        if msg[0] == "rpc":
            try:
                getattr(client, msg[1])(**msg[2])
                conn.send(("ok", None))
            except Exception as e:  # noqa: BLE001 -- handed back to the trainer
                conn.send(("err", f"{type(e).__name__}: {e}"))
        elif msg[0] == "pushed":
            eng = llm.collective_rpc(lambda self: self.weight_transfer_engine)[0]
            pushes.append(dict(version=msg[1], trainer=msg[2], worker=dict(eng.update_report)))
            conn.send(("next", None))
        elif msg[0] == "done":
            llm.shutdown_weight_transfer_engine()
            conn.send(("bye", None))
            return msg[1], pushes
    raise SystemExit("the trainer did not finish in time")


def bounds(llm, seed, repeat):
    """vLLM's own reload of the trainer's weights of `seed` into the live model, and a plain copy of
    the same bytes, `repeat` times each: [seconds], [seconds], bytes."""
    import torch
    from trainer_proc import checkpoint_named, seeded
    from transformers import AutoConfig, AutoModelForCausalLM
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    eng = llm.collective_rpc(lambda self: self.weight_transfer_engine)[0]
    with set_current_vllm_config(eng.vllm_config):  # vLLM's compile decorator wraps some HF classes
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(llm.wxfer_ckpt), dtype=torch.bfloat16)
    seeded(hf, seed)
    named = [(n, p.detach()) for n, p in checkpoint_named(hf).named_parameters()]
    reload_s, copy_s = [], []
    with set_current_vllm_config(eng.vllm_config), torch.no_grad():
        for _ in range(repeat):
            t0 = time.monotonic()
            initialize_layerwise_reload(eng.model)
            eng.model.load_weights(iter(named))
            finalize_layerwise_reload(eng.model, eng.vllm_config.model_config)
            reload_s.append(time.monotonic() - t0)
        dst = [torch.zeros_like(t) for _, t in named]  # pages touched before the clock
        for _ in range(repeat):
            t0 = time.monotonic()
            for d, (_, t) in zip(dst, named):
                d.copy_(t)
            copy_s.append(time.monotonic() - t0)
    return reload_s, copy_s, sum(t.numel() * t.element_size() for _, t in named)


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="qwen3")
    ap.add_argument("--hidden", type=int, default=0, help="0: the tests' tiny model (hidden 256, 2 layers)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--pushes", type=int, default=5)
    ap.add_argument("--mapping", choices=("traced", "preset"), default="traced")
    ap.add_argument("--keep", action="store_true", help="keep_cpu_weights(): vLLM's CPU GEMMs on the parameters")
    ap.add_argument("--out", help="write the figures as JSON here too")
    ap.add_argument("--trainer", nargs=5, help=argparse.SUPPRESS)
    a = ap.parse_args()
    sys.path[:0] = [ROOT, TESTS]
    if a.trainer:
        ck, store, name, port, mapping = a.trainer
        return trainer(ck, store, name, int(port), mapping, a.pushes)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process
    from bench_finalize import machine
    from trace_proc import save_tiny

    ck = tempfile.mkdtemp(prefix="wxfer-bench-update-")
    if a.arch == "deepseek_v3":  # tests/on_vllm/mla_proc.py's tiny DeepSeek-V3 (MLA, MoE), BF16, no MTP weights
        save_deepseek(ck)
    else:
        save_tiny(ck, a.arch, **sizes(a))

    import wxfer.integrations.vllm as wv

    assert wv.register()
    if a.keep:
        wv.keep_cpu_weights()
    from multiprocessing.connection import Listener

    from vhelp import wxfer_llm

    from wxfer.runtime.control import free_port

    print("machine:", machine(), flush=True)
    llm = wxfer_llm(ck)
    model = llm.collective_rpc(lambda self: self.weight_transfer_engine)[0].model
    n_params = sum(t.numel() for t in model.parameters())
    listener = Listener(("127.0.0.1", 0), authkey=b"wxfer-bench")
    port = free_port()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + TESTS)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    store, name = f"127.0.0.1:{port}", f"bench{port}"
    cmd = [sys.executable, __file__, "--pushes", str(a.pushes), "--trainer", ck, store, name]
    cmd += [str(listener.address[1]), a.mapping]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    conn = listener.accept()
    setup, pushes = serve(llm, conn, proc)
    proc.wait(timeout=120)
    eng = llm.collective_rpc(lambda self: self.weight_transfer_engine)[0]
    reload_s, copy_s, nbytes = bounds(llm, a.pushes, a.pushes)
    cls = eng.proof_result["classes"] if eng.proof_result else {}
    rep = dict(
        arch=a.arch,
        sizes=sizes(a),
        mapping=a.mapping,
        keep=a.keep,
        params=n_params,
        bytes=nbytes,
        engine_start_s=llm.wxfer_start_s,
        trainer_init_s=setup,
        trace_s=eng.traced_map.seconds if eng.traced_map is not None else None,
        proof_s=(eng.proof_result or {}).get("seconds"),
        direct=cls.get("direct"),
        finalize_modules=len(cls.get("finalize") or {}),
        kept_bytes=eng.finalize_report["kept_bytes"],
        pushes=pushes,
        reload_s=reload_s,
        copy_s=copy_s,
    )
    gemm = "keep_cpu_weights()" if a.keep else "vLLM's CPU GEMM as shipped"
    shape = f"hidden {a.hidden}, {a.layers} layers, vocab {a.vocab}" if a.hidden else "the tests' tiny config"
    print(
        f"model: {a.arch}, {shape}: {nbytes / 2**20:.1f} MiB of "
        f"checkpoint tensors (BF16); TP1; {gemm}; mapping {a.mapping}"
    )
    print(
        f"setup: engine start {rep['engine_start_s']:.1f} s; trainer_init {setup:.2f} s (trace "
        f"{rep['trace_s'] if rep['trace_s'] is None else round(rep['trace_s'], 3)} s, proof {rep['proof_s']:.2f} s); "
        f"{rep['direct']} direct, {rep['finalize_modules']} finalize modules, kept {rep['kept_bytes'] / 2**20:.2f} MiB"
    )
    tk = ("start_s", "push_s", "update_weights_s", "finish_s", "total_s")
    wk = ("start_s", "write_s", "finish_s", "apply_s", "finalize_s", "total_s")
    print("push  trainer: " + " ".join(f"{k:>16}" for k in tk) + "  | worker: " + " ".join(f"{k:>10}" for k in wk))
    for p in pushes:
        print(
            f"{p['version']:>4}           "
            + " ".join(f"{p['trainer'][k]:16.4f}" for k in tk)
            + "  |         "
            + " ".join(f"{p['worker'][k]:10.4f}" if p["worker"][k] is not None else f"{'-':>10}" for k in wk)
        )
    later = pushes[1:] or pushes
    t_med = {k: med([p["trainer"][k] for p in later]) for k in tk}
    w_med = {k: med([p["worker"][k] for p in later if p["worker"][k] is not None]) for k in wk}  # apply_s: None, dense
    rep.update(trainer_median=t_med, worker_median=w_med)
    print(
        f"median of pushes 2..{len(pushes)}: trainer total {t_med['total_s']:.4f} s (push {t_med['push_s']:.4f} s); "
        f"worker total {w_med['total_s']:.4f} s = start {w_med['start_s']:.4f} + writes {w_med['write_s']:.4f} "
        f"+ between + finish {w_med['finish_s']:.4f} (finalize {w_med['finalize_s']:.4f})"
    )
    print(
        f"bound, same process, same bytes: vLLM's own reload (layerwise reload + load_weights + finalize) "
        f"{med(reload_s):.4f} s (median of {len(reload_s)}); plain copy_ {med(copy_s):.4f} s "
        f"({nbytes / med(copy_s) / 1e9:.2f} GB/s)"
    )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rep, f, indent=1)


if __name__ == "__main__":
    main()
