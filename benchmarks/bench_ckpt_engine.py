"""wxfer against MoonshotAI's checkpoint-engine on one GPU, in the same run (issue 16).

    # the GPU machine has no registry: carry the wheels (benchmarks/README.md lists them)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
        --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site python3 benchmarks/bench_ckpt_engine.py --json --out $OUT/ckpt.json
    python benchmarks/bench_ckpt_engine.py --dry-run --json          # CPU, tiny models

Two processes on GPU 0: a trainer holding the weights (Hugging Face names, random values of
the real shapes of qwen3-8b / qwen3-30b-a3b) and an inference worker holding the vLLM layout
of the mapping preset (fused qkv / gate_up / experts, BF16 or FP8 with block scales, TP1),
as wxfer's Receiver and bench_baselines use it.  Per model x quantization, two jobs:

  host   weights in host memory.  bound: the training bytes over a pinned H2D copy (its
         bandwidth measured here).  wxfer: an FSDP2 model (world 1) under CPUOffloadPolicy,
         Sender.push().  checkpoint-engine: its normal input, a ParameterServer holding
         the registered checkpoint in its pinned pool; the timed step is update().
  gpu    weights on the GPU.  bound: an on-device copy of the bytes the worker receives.
         wxfer: Sender.push() of the plain GPU tensors.  checkpoint-engine: its API takes
         GPU tensors only at register_checkpoint, which copies them into its pinned host
         pool; update() always reads that pool (H2D).  The timed step is what a training
         loop must do per step: register_checkpoint (shared pool) + gather_metas + update.

checkpoint-engine runs in its colocated broadcast mode: ParameterServer(world_size=1)
with an NCCL group, update(name, req_func) with ranks=None; req_func hands the ZeroMQ
socket paths to the worker, which calls checkpoint_engine.worker.update_weights_from_ipc
(..., run=load_fn).  load_fn (class Loader) does what checkpoint-engine leaves to the
engine's loader: fusion, TP slice and FP8 block quantization on the inference side, with
the mapping's reference packing (wxfer.runtime.prepare.pack_shard_into).  After every
method the worker's memory (reset to 0xFF first) is fingerprinted per parameter (byte sum
and position-weighted byte sum) and compared with the reference packing of the same
weights computed on the trainer.  checkpoint-engine's own log lines (loguru) are parsed
for its bucket size, bucket count and per-bucket times.

A step that fails is reported and the run goes on (fresh processes after a hang), with the
children's Python stacks (faulthandler) and exit codes in its row; the host job's trainer
setup phases are printed as they end and kept in the row; --max-s bounds the whole run.
Without checkpoint-engine (not importable, or the CPU dry run: it needs CUDA) its rows are
reported as skipped, saying why.

Here: the steps, the trainer (rank 0), the children's loop and the parent; the inference
worker in ckpt_engine_worker.py, weights / checks / Loader / the offloaded model in
ckpt_engine_parts.py, rows and table in ckpt_engine_report.py, the supervisor (spawn,
collect, stop at a failure, stacks, the retry loop) in common/supervise.py, shared with
bench_baselines.py.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (ROOT, HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from common import supervise as sup  # noqa: E402
from common import baselines as bb  # noqa: E402  -- model_spec, expanded, infer_params, reset, machine, _sync_dev
from ckpt_engine_parts import (  # noqa: E402
    LogTap,
    _med,
    _Plain,
    _summ,
    compare,
    fsdp_model,
    host_avail_gb,
    reference,
    rss_peak_gb,
    step_name,
    train_weights,
    wait_any,
)
from ckpt_engine_report import _row_view, summarize, table  # noqa: E402
from ckpt_engine_worker import Worker  # noqa: E402

GPU_MODELS = ("qwen3-8b", "qwen3-30b-a3b")
CPU_MODELS = ("tiny", "tiny-moe")
JOBS = ("gpu", "host")
GiB = 1 << 30


def ckpt_engine():
    """(module, None) or (None, why it cannot be used)."""
    try:
        import checkpoint_engine

        return checkpoint_engine, None
    except Exception as e:  # noqa: BLE001
        return None, f"checkpoint-engine not importable ({type(e).__name__}: {e})"


# --------------------------------------------------------------------------- steps


def make_steps(models, quants, jobs, dry_run: bool) -> list:
    """The order keeps host memory to one copy of the weights at a time: per model, the GPU
    job (weights on the GPU; checkpoint-engine's pool filled from them), then the host job
    (checkpoint-engine's pool; then the FSDP2 offloaded model after the pool is freed)."""
    steps = []
    for m in models:
        if "gpu" in jobs:
            for q in quants:
                steps += [dict(model=m, quant=q, job="gpu", method=x) for x in ("bound", "wxfer", "ckpt-engine")]
                if dry_run:
                    steps.append(dict(model=m, quant=q, job="gpu", method="loader"))
        if "host" in jobs:
            for q in quants:
                steps += [dict(model=m, quant=q, job="host", method=x) for x in ("bound", "ckpt-engine")]
            steps += [dict(model=m, quant=q, job="host", method="wxfer") for q in quants]
    for i, s in enumerate(steps):
        s["i"] = i
    return steps


# --------------------------------------------------------------------------- the trainer


class Trainer:
    """Rank 0: the weights, the bounds, wxfer's Sender and checkpoint-engine's ParameterServer."""

    def __init__(self, a, store, ctl, dev):
        self.a, self.store, self.ctl, self.dev = a, store, ctl, dev
        self.m = None  # model whose state is held
        self.W = None  # its weights on the device (gpu job)
        self.fsdp = None  # its FSDP2 offloaded model (host job)
        self.refs: dict = {}  # quant -> reference fingerprints
        self.ps = self.tap = None
        self.pool = None  # (model, checkpoint name) registered in the pool
        self.k = 0  # update requests sent

    # ---- state of one model
    def model(self, s):
        if self.m != s["model"]:
            self.W = self.fsdp = None
            self.refs = {}
            self._free_pool()
            self._release_host()
            self.m = s["model"]
            self.conf, self.preset = bb.model_spec(s["model"])
            self.hf = self.preset.hf_params(self.conf)
        return self.conf, self.preset

    def _release_host(self):
        """Give freed pinned memory back to the system: torch caches every pinned block it
        allocated (checkpoint-engine's pool, the FSDP2 model's slabs) until told otherwise."""
        if self.dev.type == "cuda":
            import gc
            import torch

            gc.collect()
            torch.cuda.empty_cache()
            getattr(torch._C, "_host_emptyCache", lambda: None)()

    def log(self, s, what: str, **kw):
        """One line on stderr as each setup phase ends, and the phase in the store's `at` key
        (a step that times out says where it was)."""
        extra = " ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in kw.items())
        print(
            f"[bce {time.time() - self.a['t_start']:.1f} s] {step_name(s)}: {what} {extra}", file=sys.stderr, flush=True
        )
        self.ctl.set("at/0", f"{step_name(s)}: after {what}")

    def build_fsdp(self, s, ex) -> None:
        """The host job's trainer, each setup phase timed (res["setup"]): one host copy of the
        weights at a time (checkpoint-engine's pool freed and given back first)."""
        t = time.perf_counter()
        self.ref(s["quant"], ex)  # made from the GPU weights unless already known
        self.free_weights()
        self._free_pool()
        self._release_host()
        ph = dict(reference_s=time.perf_counter() - t, host_avail_GB=host_avail_gb())
        self.log(s, "reference and release", **ph)
        self.fsdp = fsdp_model(self.preset, self.conf, self.dev, ph, log=lambda k, v: self.log(s, k, seconds=v))
        ph.update(host_avail_after_GB=host_avail_gb(), trainer_rss_peak_GB=rss_peak_gb())
        self.log(s, "FSDP2 model built", **{k: v for k, v in ph.items() if not k.endswith("_s")})
        self.setup = ph

    def weights(self):
        if self.W is None:
            self.W = train_weights(self.preset, self.conf, self.dev)
            bb.sync_dev(self.dev)
        return self.W

    def free_weights(self):
        self.W = None
        if self.dev.type == "cuda":
            import torch

            torch.cuda.empty_cache()

    def ref(self, q, ex):
        if q not in self.refs:
            had = self.W is not None
            self.refs[q] = reference(ex, self.weights())
            if not had and self.fsdp is not None:
                self.free_weights()
        return self.refs[q]

    def train_bytes(self):
        import torch

        return sum(int(torch.Size(sh).numel()) * getattr(torch, dt).itemsize for sh, dt, _ in self.hf.values())

    # ---- timing
    def timed(self, fn, label):
        a, times, t0 = self.a, [], time.perf_counter()
        self.warm: list = []  # the warm-up steps' seconds
        for k in range(a["warmup"] + a["reps"]):
            self.ctl.set("at/0", f"{label} step {k}")
            bb.sync_dev(self.dev)
            t = time.perf_counter()
            fn(k)
            bb.sync_dev(self.dev)
            if k >= a["warmup"]:
                times.append(time.perf_counter() - t)
                if time.perf_counter() - t0 > a["method_s"] or time.time() > a["deadline"]:
                    break
            else:
                self.warm.append(time.perf_counter() - t)
        return times

    # ---- one step
    def run(self, s) -> dict:
        conf, preset = self.model(s)
        quant = "fp8" if s["quant"] == "fp8" else None
        ex = bb.expanded(preset, conf, quant)
        res = dict(step=s, dest_bytes=ex.dest_bytes(0), train_bytes=self.train_bytes(), train_tensors=len(self.hf))
        m = s["method"]
        if m == "bound":
            res.update(self.bound(s, ex))
            return res
        if m == "ckpt-engine":
            why = self.a["ckpt_skip"]
            if why:
                res["skipped"] = why
                self.ctl.set("s/%d/skip" % s["i"], why)
                return res
        if s["job"] == "host" and m == "wxfer":
            self._free_pool()  # one host copy of the weights at a time
            if self.fsdp is None:
                self.build_fsdp(s, ex)
            res["setup"] = dict(self.setup)
        elif s["job"] == "gpu":
            self.weights()
        want = self.ref(s["quant"], ex)
        if s["job"] == "host" and m == "ckpt-engine":
            self.free_weights()
        i = s["i"]
        self.ctl.set("s/%d/go" % i, b"1")
        wait_any(self.ctl, ["s/%d/ready" % i, "s/%d/fail/1" % i], "the inference worker's setup", self.a["timeout"])
        err = None
        try:
            self._fail_if_peer(i)
            if m == "wxfer":
                res.update(self.wxfer(s))
            elif m == "ckpt-engine":
                res.update(self.ckpt(s))
            elif m == "loader":
                pass  # the worker does it alone
        except Exception as e:  # noqa: BLE001 -- reported, the worker told
            err = f"{type(e).__name__}: {e}"
            self.ctl.set("s/%d/fail/0" % i, err)
            res["error"] = err
            res["traceback"] = traceback.format_exc()[-2000:]
        if err is None:
            self.ctl.set("s/%d/done" % i, b"1")
            k = wait_any(self.ctl, ["s/%d/sums" % i, "s/%d/fail/1" % i], "the worker's fingerprints", self.a["timeout"])
            if k.endswith("sums"):
                got = self.ctl.get_json("s/%d/sums" % i, "fingerprints")
                res["check"] = compare(got["fp"], want, ex)
                res["worker"] = got.get("info", {})
                if m == "loader" and res["worker"].get("loader"):
                    res.update(_summ([res["worker"]["loader"]["load_fn_s"]], res["dest_bytes"]))
            else:
                res["error"] = "inference worker: " + self.ctl.get(k, "error").decode()
        return res

    def _fail_if_peer(self, i):
        if self.ctl.check("s/%d/fail/1" % i):
            raise RuntimeError("inference worker: " + self.ctl.get("s/%d/fail/1" % i, "error").decode())

    def bound(self, s, ex) -> dict:
        import torch

        gpu = self.dev.type == "cuda"
        if s["job"] == "gpu":  # on-device copy of the bytes the worker receives
            n = ex.dest_bytes(0)
            piece = min(GiB, n)
            src = torch.empty(piece, dtype=torch.uint8, device=self.dev).fill_(7)
            dst = torch.empty(piece, dtype=torch.uint8, device=self.dev)

            def one(_):
                bb.copy_through(dst, src, n)

            times = self.timed(one, step_name(s))
            return dict(_summ(times, ex.dest_bytes(0)), what="on-device copy of the received bytes")
        n = self.train_bytes()  # pinned H2D of the training bytes, bandwidth measured
        piece = min(GiB, n)
        total = min(n, self.a["h2d_probe"])
        src = torch.empty(piece, dtype=torch.uint8, pin_memory=gpu).fill_(7)
        dst = torch.empty(piece, dtype=torch.uint8, device=self.dev)

        def one(_):
            bb.copy_through(dst, src, total)

        times = self.timed(one, step_name(s))
        gbps = total / min(times) / 1e9
        sec = n / (gbps * 1e9)
        return dict(
            seconds=sec,
            best=sec,
            times=[sec],
            gbps=ex.dest_bytes(0) / sec / 1e9,
            h2d_GBps=gbps,
            probe_bytes=total,
            what="pinned H2D of the training bytes" + ("" if gpu else " (CPU: a host copy)"),
        )

    def wxfer(self, s) -> dict:
        from wxfer.runtime.sender import Sender

        a, i = self.a, s["i"]
        if os.environ.get("BCE_HANG_STEP") == step_name(s):  # tests: a step that hangs
            _injected_hang()
        model = _Plain(self.W) if s["job"] == "gpu" else self.fsdp
        t0 = time.perf_counter()
        snd = Sender(
            model,
            mapping=self.preset,
            store=self.store,
            name="%s_%d" % (a["name"], i),
            watermark=a["watermark"],
            timeout=a["timeout"],
            write_timeout=a["timeout"],
        )
        try:
            setup = time.perf_counter() - t0
            self.log(s, "Sender setup", seconds=setup, tasks=len(snd.plan.tasks))
            last = a["warmup"] + a["reps"] - 1

            def one(k):
                if k == last or k == a["warmup"]:
                    snd.trace(clear=True)
                t = time.perf_counter()
                snd.push()
                if k < a["warmup"]:
                    self.log(s, "warm-up push %d" % k, seconds=time.perf_counter() - t)

            times = self.timed(one, step_name(s))
            out = dict(
                _summ(times, bb.expanded(self.preset, self.conf, "fp8" if s["quant"] == "fp8" else None).dest_bytes(0)),
                setup_s=setup,
                warmup_s=self.warm,
                tasks=len(snd.plan.tasks),
                transport=snd.transport_name,
                bytes_per_step=snd.bytes_per_step,
            )
            if a.get("logs"):
                p = os.path.join(a["logs"], "trace-%s-%s-%s.json" % (s["model"], s["quant"], s["job"]))
                snd.write_trace(p)
                out["trace"] = p
            return out
        finally:
            snd.close()

    # ---- checkpoint-engine
    def _ps_server(self):
        if self.ps is None:
            from checkpoint_engine.ps import ParameterServer
            from wxfer.runtime import control

            os.environ.setdefault("RANK", "0")  # ParameterServer reads RANK when rank=0 (falsy)
            os.environ.setdefault("WORLD_SIZE", "1")
            logs = self.a.get("logs")
            self.tap = LogTap(os.path.join(logs, "checkpoint-engine.log") if logs else None)
            self.ps = ParameterServer(
                rank=0,
                world_size=1,
                auto_pg=False,
                mem_fraction=self.a["ckpt_mem_fraction"],
                master_addr="127.0.0.1",
                master_port=control.free_port(),
            )
        return self.ps

    def _free_pool(self):
        if self.pool is not None and self.ps is not None:
            self.ps.unregister_checkpoint(self.pool[1], force=True)
        self.pool = None

    def _register(self, name, tensors):
        ps = self._ps_server()
        if self.pool is not None:
            ps.unregister_checkpoint(self.pool[1])  # the shared pool stays allocated
        self.pool = None
        t = time.perf_counter()
        ps.register_checkpoint(name, named_tensors=tensors, use_shared_memory_pool=True)
        t1 = time.perf_counter()
        ps.gather_metas(name)
        self.pool = (self.m, name)
        return t1 - t, time.perf_counter() - t1

    def ckpt(self, s) -> dict:
        import checkpoint_engine

        a, i = self.a, s["i"]
        ps = self._ps_server()
        self.k = 0  # the worker counts this step's requests from 0
        name = "bench-%s" % s["model"]
        parts: dict = dict(register_s=[], gather_s=[], update_s=[])
        logs: list = []

        def req(socket_paths):  # what vLLM's collective_rpc would carry
            k = self.k
            self.k += 1
            self.ctl.set_json("s/%d/req/%d" % (i, k), [list(x) for x in socket_paths])
            if a["ckpt_req"] == "post":  # as checkpoint-engine's own test (queue.put): no wait
                return
            got = wait_any(
                self.ctl,
                ["s/%d/ack/%d" % (i, k), "s/%d/fail/1" % i],
                "the worker's update_weights_from_ipc",
                a["timeout"],
            )
            if got.endswith("/1") and "fail" in got:
                raise RuntimeError("inference worker failed")

        def update():
            mark = self.tap.mark()
            t = time.perf_counter()
            ps.update(name, req)
            parts["update_s"].append(time.perf_counter() - t)
            logs.append(self.tap.parse(mark))

        if s["job"] == "gpu":

            def one(_):
                r, g = self._register(name, self.W)
                parts["register_s"].append(r)
                parts["gather_s"].append(g)
                update()
        else:
            if self.pool != (self.m, name):
                had = self.W is not None
                self._register(name, self.weights())
                if not had:
                    self.free_weights()

            def one(_):
                update()

        times = self.timed(one, step_name(s))
        if self.k:  # the worker has finished every request
            wait_any(
                self.ctl, ["s/%d/ack/%d" % (i, self.k - 1), "s/%d/fail/1" % i], "the worker's last update", a["timeout"]
            )
        nt = len(times)
        out = dict(
            _summ(times, bb.expanded(self.preset, self.conf, "fp8" if s["quant"] == "fp8" else None).dest_bytes(0)),
            version=checkpoint_engine.__version__,
            parts={k: _med(v[-nt:]) for k, v in parts.items() if v},
            ckpt_log=logs[-1] if logs else {},
        )
        return out


def _injected_hang():
    while True:
        time.sleep(1.0)


# --------------------------------------------------------------------------- the inference worker


# --------------------------------------------------------------------------- the two processes


def _child(rank: int, a: dict, steps: list, q) -> None:
    sup.child(_child_main, rank, q, a, steps)


def _shim():
    """Tests only: $BCE_CPU_SHIM names a file whose install() lets checkpoint-engine's code run
    on CPU (tests/ckpt_engine_cpu_shim.py)."""
    path = os.environ.get("BCE_CPU_SHIM")
    if not path:
        return False
    import importlib.util

    spec = importlib.util.spec_from_file_location("_bce_cpu_shim", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["_bce_cpu_shim"] = mod
    spec.loader.exec_module(mod)
    mod.install()
    return True


def stack_paths(a: dict) -> dict:
    """{rank: the file its Python stacks go to} (common/supervise.stack_file)."""
    return {r: os.path.join(a["stack_dir"], "stacks-%s-rank%d.txt" % (a["name"], r)) for r in (0, 1)}


def _child_main(rank: int, a: dict, steps: list) -> None:
    import torch
    import torch.distributed as dist
    from wxfer.runtime import control

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    gpu = not a["dry_run"]
    if gpu:
        torch.cuda.set_device(0)
        dev = torch.device("cuda", 0)
    else:
        torch.multiprocessing.set_sharing_strategy("file_system")
        dev = torch.device("cpu")
    shim = _shim()
    mod, why = ckpt_engine()
    if mod is not None and not gpu and not shim:
        why = "checkpoint-engine needs CUDA (its DeviceManager takes cuda or npu only): not run in the CPU dry run"
    a = dict(a, ckpt_skip=why)
    store = control.resolve_store(a["store"], False, a["timeout"])
    ctl = control.Control(store, a["name"], a["timeout"])
    if rank == 0:  # one trainer rank: the group FSDP2's mesh and the ParameterServer use
        dist.init_process_group(
            "cpu:gloo,cuda:nccl" if gpu else "gloo",
            rank=0,
            world_size=1,
            store=dist.PrefixStore("pg/" + a["name"], store),
            timeout=datetime.timedelta(seconds=a["timeout"]),
        )
        side = Trainer(a, store, ctl, dev)
    else:
        side = Worker(a, store, ctl, dev)
    stacks = sup.stack_file(stack_paths(a)[rank])
    for s in steps:
        ctl.set("at/%d" % rank, step_name(s))
        sup.arm_stack_dump(stacks, "step " + step_name(s), a["step_timeout"] - 10)
        if gpu:
            torch.cuda.empty_cache()  # checkpoint-engine sizes its buckets by the free memory
        if rank == 0:
            if time.time() > a["deadline"]:
                res = dict(step=s, skipped="not run: --max-s reached")
                ctl.set("s/%d/skip" % s["i"], b"budget")
            else:
                try:
                    res = side.run(s)
                except Exception as e:  # noqa: BLE001 -- this step's error; the next step goes on
                    traceback.print_exc()
                    res = dict(step=s, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-2000:])
                    ctl.set("s/%d/fail/0" % s["i"], res["error"])
            ctl.set_json("res/%d" % s["i"], res)
        else:
            side.run(s)
        sup.disarm_stack_dump()
    if rank == 0 and dist.is_initialized():
        dist.destroy_process_group()


# --------------------------------------------------------------------------- the parent


def _why(ctl, f, procs, step_s: float) -> str:
    """What a failed step says: the children's errors, or a timeout (`step_s` into the step),
    or who exited (and where each child was)."""
    if f.errs:
        return "; ".join(f"rank {r}: {e.strip().splitlines()[-1]}" for r, e in sorted(f.errs.items()))
    at = {r: ctl.get("at/%d" % r, "at").decode() for r in (0, 1) if ctl.check("at/%d" % r)}
    if f.over:
        return "timed out after %.0f s (at %s)" % (step_s, at)
    gone = ", ".join("rank %d exited with %s" % (r, p.exitcode) for r, p in enumerate(procs) if not p.is_alive())
    return "%s (at %s)" % (gone, at)


def run(args, emit=print) -> dict:
    import multiprocessing as mp

    for k, v in bb.NO_MULTICAST.items():
        os.environ.setdefault(k, v)
    signal.signal(signal.SIGTERM, sup._kill_children)
    models = args.models.split(",") if args.models else list(CPU_MODELS if args.dry_run else GPU_MODELS)
    steps = make_steps(models, args.quant.split(","), args.jobs.split(","), args.dry_run)
    logs = args.logs
    if logs:
        os.makedirs(logs, exist_ok=True)
    t_start = time.time()
    store, run = bb.run_store(args)
    mod, why = ckpt_engine()
    a = dict(
        run,
        step_timeout=args.step_timeout,
        method_s=args.method_s,
        deadline=t_start + args.max_s,
        watermark=args.watermark,
        logs=os.path.abspath(logs) if logs else None,
        h2d_probe=bb.parse_size(args.h2d_probe),
        loader_bucket=bb.parse_size(args.loader_bucket),
        ckpt_mem_fraction=args.ckpt_mem_fraction,
        ckpt_req=args.ckpt_req,
        t_start=t_start,
        stack_dir=os.path.abspath(logs) if logs else tempfile.mkdtemp(prefix="bce-stacks-"),
    )
    results: list = [None] * len(steps)
    todo = list(range(len(steps)))

    def got(ctl, i):
        results[i] = ctl.get_json("res/%d" % i, "result")
        emit(json.dumps(dict(type="row", name=step_name(steps[i]), **_row_view(results[i]))), flush=True)

    def failed(ctl, i, why_, procs, stacks):
        results[i] = dict(step=steps[i], error=why_, exitcodes=[p.exitcode for p in procs], stacks=stacks)
        for r, txt in sorted(stacks.items()):
            print(f"{step_name(steps[i])} failed; rank {r}'s stacks:\n{txt}", file=sys.stderr, flush=True)
        todo.remove(i)
        emit(json.dumps(dict(type="row", name=step_name(steps[i]), **_row_view(results[i]))), flush=True)
        if time.time() > t_start + args.max_s:
            for j in todo:
                results[j] = dict(step=steps[j], skipped="not run: --max-s reached")
            todo.clear()

    sup.run_attempts(
        mp.get_context("spawn"),
        _child,
        a,
        store,
        "bce%d" % os.getpid(),
        args.timeout,
        todo,
        lambda todo: [steps[i] for i in todo],
        got,
        lambda step_s: step_s > args.step_timeout or time.time() > t_start + args.max_s + args.grace_s,
        _why,
        failed,
        stop_wait=10,
        kill=True,
        stack_paths=stack_paths,
    )
    cases = summarize(results)
    out = dict(
        type="summary",
        machine=bb.machine(args.dry_run),
        ckpt_engine=getattr(mod, "__version__", None),
        ckpt_engine_why=why,
        command=" ".join([os.path.basename(sys.executable)] + sys.argv),
        dry_run=args.dry_run,
        total_s=time.time() - t_start,
        cases=cases,
        steps=results,
    )
    out["table"] = table(cases, out)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    if logs:
        with open(os.path.join(logs, "ckpt-engine-table.md"), "w") as f:
            f.write(out["table"] + "\n")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="CPU, tiny models, gloo, fabric tcp (checkpoint-engine needs CUDA: its rows are skipped)",
    )
    ap.add_argument("--models", default=None, help="comma list (default qwen3-8b,qwen3-30b-a3b; dry run tiny,tiny-moe)")
    ap.add_argument("--quant", default="bf16,fp8", help="comma list of bf16, fp8 (the inference side)")
    ap.add_argument("--jobs", default="gpu,host", help="comma list: gpu (weights on the GPU), host (in host memory)")
    bb.step_options(ap, 5)
    ap.add_argument(
        "--method-s",
        type=float,
        default=12.0,
        help="stop timing a method after this many seconds (at least one timed step)",
    )
    ap.add_argument("--max-s", type=float, default=240.0, help="steps are not started after this many seconds")
    ap.add_argument(
        "--grace-s",
        type=float,
        default=45.0,
        help="a step still running this long after --max-s is stopped (processes killed)",
    )
    ap.add_argument("--step-timeout", type=float, default=200.0, help="one step (a hang: processes restarted)")
    ap.add_argument("--timeout", type=float, default=120.0, help="every wait inside a step")
    ap.add_argument("--watermark", default="2GiB", help="wxfer Sender watermark")
    ap.add_argument("--h2d-probe", default="4GiB", help="bytes copied to measure the pinned H2D bandwidth")
    ap.add_argument("--loader-bucket", default="64KiB", help="dry run: bucket size of the load_fn-only check")
    ap.add_argument(
        "--ckpt-mem-fraction",
        type=float,
        default=0.8,
        help="checkpoint-engine's mem_fraction (its buckets: this share of free GPU memory / 3)",
    )
    ap.add_argument(
        "--ckpt-req",
        choices=("wait", "post"),
        default="wait",
        help="checkpoint-engine's req_func: wait until the worker's update_weights_from_ipc returned "
        "(as vLLM's collective_rpc HTTP call does), or post the request and return at once "
        "(as checkpoint-engine's own test does with queue.put)",
    )
    ap.add_argument(
        "--out",
        default=os.path.join(os.environ["OUT"], "ckpt.json") if os.environ.get("OUT") else None,
        help="the results as one JSON file (default $OUT/ckpt.json when $OUT is set)",
    )
    ap.add_argument(
        "--logs",
        default=os.environ.get("OUT") or None,
        help="directory for checkpoint-engine's log, wxfer traces and the table (default $OUT)",
    )
    ap.add_argument("--json", action="store_true", help="print JSON lines: one per step, a summary last")
    args = ap.parse_args(argv)
    out = run(args, emit=print if args.json else (lambda *a, **k: None))
    print(out["table"])
    if args.dry_run:
        print("(CPU dry run: tiny models on this machine; these are not GPU figures)")
    if out.get("ckpt_engine_why"):
        print("checkpoint-engine rows skipped: " + out["ckpt_engine_why"])
    if args.json:
        print(json.dumps(dict(out, table=None)))
    bad = [r for r in out["steps"] if r is None or r.get("error") or (r.get("check") and not r["check"]["ok"])]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
