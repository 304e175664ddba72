"""Finalize seconds per module kind on vLLM's CPU platform, and the setup proof's seconds.

    .venv-vllm/bin/python benchmarks/bench_finalize.py [--layers 4] [--vocab 2048] [--repeat 5]

For each case (a random Qwen3 / Qwen3-MoE saved as an HF directory, vLLM's own model class
built from it in its own process, TP1): the post-processing proof of wxfer.integrations.vllm
.postproc over every layer (its seconds: the fresh reference model, its load_weights and
post-processing, wxfer's writes, the finalizers, the comparisons), then every finalizer run
`repeat` times; prints the machine, then one line per (case, module kind): how many modules,
the bytes kept, the median seconds of one finalize of one module and of all of them.

Cases: qwen3 with vLLM's CPU GEMM dispatch as vLLM ships it (every linear layer repacked:
finalize), qwen3 with keep_cpu_weights (direct), qwen3-moe with keep_cpu_weights (the CPU MoE's
prepacked experts: finalize).
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CASES = {"qwen3-cpu-gemm": (False, False), "qwen3-keep": (False, True), "qwen3-moe-keep": (True, True)}


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    import torch

    try:
        import vllm

        v = vllm.__version__
    except ImportError:
        v = "none"
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, vllm {v}, python {platform.python_version()}"


def one(case, vocab, layers, repeat, port, out):
    sys.path[:0] = [ROOT, os.path.join(ROOT, "tests", "on_vllm")]
    import torch
    from vhelp import build, save_checkpoint
    from vllm.config import set_current_vllm_config

    from wxfer.integrations.vllm.engine import WxferInitInfo, worker_preset
    from wxfer.integrations.vllm.proof import classify_worker

    moe, keep = CASES[case]
    ck = tempfile.mkdtemp(prefix="wxfer-bench-finalize-")
    save_checkpoint(ck, moe=moe, layers=layers, vocab=vocab)
    vc, model = build(ck, port=port, keep=keep)
    cfg = vc.model_config.hf_config.to_dict()
    preset = worker_preset(WxferInitInfo(mapping_name="bench"), cfg)
    named = list(model.named_parameters())
    with set_current_vllm_config(vc):
        c, _ = classify_worker(model, vc, "cpu", preset, cfg, named, dict(tp=1, rank=0, ep=False), None, None, 7, case)
        mods = dict(model.named_modules())
        for _ in range(repeat):
            for f in c.finalize:
                f()
    kinds = {}
    for f in c.finalize:
        k = kinds.setdefault(type(mods[f.module_name]).__name__, dict(n=0, kept=0, runs=[]))
        k["n"] += 1
        k["kept"] += f.kept_bytes
        k["runs"].append(f.seconds[1:] or f.seconds)  # the first run warms up
    rep = dict(
        case=case,
        params=sum(t.numel() for _, t in named),
        proof_s=c.seconds,
        direct=len(c.direct),
        refused=c.refused,
        kinds={
            k: dict(
                n=v["n"],
                kept=v["kept"],
                one=statistics.median(s for r in v["runs"] for s in r),
                all=sum(statistics.median(r) for r in v["runs"]),
            )
            for k, v in kinds.items()
        },
        threads=torch.get_num_threads(),
    )
    with open(out, "w") as fh:
        json.dump(rep, fh)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--one", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        case, port, out = a.one.split(",")
        return one(case, a.vocab, a.layers, a.repeat, int(port), out)
    print("machine:", machine())
    print(f"model: vhelp.hf_config (hidden 256, MoE 4 experts), {a.layers} layers, vocab {a.vocab}; TP1, BF16")
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")
    for i, case in enumerate(a.cases.split(",")):
        out = os.path.join(tempfile.mkdtemp(), "r.json")
        cmd = [sys.executable, __file__, "--one", f"{case},{29850 + i},{out}"]
        cmd += ["--vocab", str(a.vocab), "--layers", str(a.layers), "--repeat", str(a.repeat)]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if p.returncode:
            print(f"{case}: failed\n{p.stdout[-2000:]}{p.stderr[-3000:]}")
            continue
        r = json.load(open(out))
        print(
            f"{case}: {r['params'] / 1e6:.1f} M live parameter elements (a packed layer's hold 0), "
            f"proof {r['proof_s']:.2f} s, "
            f"{r['direct']} direct, {sum(k['n'] for k in r['kinds'].values())} finalize modules, "
            f"{len(r['refused'])} refused, torch threads {r['threads']}"
        )
        for k, v in sorted(r["kinds"].items()):
            print(
                f"  finalize {k:<26} x{v['n']:<3} kept {v['kept'] / 2**20:7.2f} MiB  "
                f"one {v['one'] * 1e3:8.2f} ms  all {v['all'] * 1e3:8.2f} ms"
            )


if __name__ == "__main__":
    main()
