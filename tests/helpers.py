"""Helpers the tests share (not shipped in the wheel; wxfer.testing keeps what the tools and
benchmarks use too): torchrun arguments, Receivers constructed in threads and joined, a
mapping Shard worked out from its pieces, and the reference bytes the tiny models' mapping
writes. Imported as `helpers` (pytest puts tests/ on sys.path; a child process run from the
checkout puts it there itself)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

from wxfer.testing import in_thread, joined  # noqa: F401 -- joined: the tests import it from here

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# The first line of a script run under torchrun whose stdout a test parses: torchrun runs its
# ranks as `python -u`, where print() writes the text and its newline in two write(2) calls, so
# two ranks sharing the pipe interleaved a line once ("...mismatchrank 1 setup failed", a CI
# failure); line-buffered, each line of up to 8 KiB is one write(2), atomic on a pipe.
ONE_WRITE_PER_LINE = "import sys; sys.stdout.reconfigure(line_buffering=True, write_through=False)\n"


FABRIC_PROVIDERS = ["tcp", "shm"]


def run_c_check(tmp_path, name, flags, after=()):
    """Compiles the stand-alone check tests/c/`name`.c (`cc` `flags` -o EXE the source `after`:
    more sources, libraries) and runs it: its CompletedProcess (text). Skips without a C compiler."""
    import shutil

    import pytest

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    exe = str(tmp_path / name)
    src = os.path.join(ROOT, "tests", "c", name + ".c")
    subprocess.run([cc, *flags, "-o", exe, src, *after], check=True, capture_output=True, timeout=60)
    return subprocess.run([exe], capture_output=True, text=True, timeout=60)


def gpu_count() -> int:
    """CUDA GPUs torch sees here (0 where torch or the driver cannot tell: a broken install)."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 -- no GPU, for the tests' skips
        return 0


def small_moe(config: dict, experts: int, layers: int = 1, vocab: int = 256) -> dict:
    """An MoE model's config (qwen3-30b-a3b's) shrunk to CPU size: `experts` experts of 256 x 256,
    4 heads of 128 (2 KV), `layers` layers."""
    heads = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=128)
    widths = dict(hidden_size=256, moe_intermediate_size=256, vocab_size=vocab)
    return dict(config, num_hidden_layers=layers, num_experts=experts, **heads, **widths)


def small_dense(arch: str, layers: int, head_dim: int, **over) -> dict:
    """A dense decoder's config dict at CPU size, of the HF architecture `arch`: 4 heads of
    `head_dim` (2 KV), hidden 256, intermediate 512, a 1024-token vocabulary, `layers` layers;
    `over` added."""
    heads = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim)
    widths = dict(hidden_size=256, intermediate_size=512, vocab_size=1024)
    return dict(architectures=[arch], num_hidden_layers=layers, **heads, **widths, **over)


def random_fulls(seed: int, **more) -> dict:
    """Full tensors for the pipeline's packing tests, from one seeded generator: "a" [300, 260]
    float32, "b" [300, 260] and "n" [257] BF16, then `more` ({name: shape}, BF16) in order."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {"a": torch.randn(300, 260, generator=g, dtype=torch.float32)}
    for name, shape in dict(b=(300, 260), n=(257,), **more).items():
        out[name] = torch.randn(*shape, generator=g).to(torch.bfloat16)
    return out


def frozen_model(config: dict, seed: int | None = None):
    """wxfer.models.train_model(config) with every parameter's requires_grad off (its random
    weights from torch.manual_seed(seed) first, where a seed is given)."""
    import torch

    from wxfer.models import train_model

    if seed is not None:
        torch.manual_seed(seed)
    model = train_model(config)
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def module_with(params: dict):
    """A torch.nn.Module holding `params` ({dotted name: tensor}) under nested modules named
    like vLLM's: a Parameter as it is, any other tensor as a frozen Parameter of its memory."""
    import torch

    model = torch.nn.Module()
    for n, t in params.items():
        mod = model
        *path, leaf = n.split(".")
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, t if isinstance(t, torch.nn.Parameter) else torch.nn.Parameter(t, False))
    return model


def needs_verbs_emulation():
    """The skip mark of the tests that run the libibverbs emulation (built from rdma-core's
    headers: conftest's emu_lib)."""
    import pytest

    return pytest.mark.skipif(
        not os.path.exists("/usr/include/infiniband/verbs.h"),
        reason="rdma-core headers (infiniband/verbs.h) missing: the libibverbs emulation is built from them",
    )


def loads(name: str) -> bool:
    """Whether the shared library `name` loads in this process."""
    import ctypes

    try:
        ctypes.CDLL(name)
        return True
    except OSError:
        return False


def needs_fabric():
    """The skip mark of the tests that need the fabric backend (libfabric: tcp and shm)."""
    import pytest
    import wxfer

    b = wxfer.backends()["fabric"]
    return pytest.mark.skipif(not b["available"], reason="fabric backend unavailable: %s" % b["reason"])


def connected_pair(request, sizes):
    """For a fixture parametrized by FABRIC_PROVIDERS: yields (writer Transport, TargetProcess
    with zeroed buffers of `sizes`) connected over provider request.param; closed after."""
    from wxfer.testing import connected_fabric

    with connected_fabric(request.param, sizes) as pair:
        yield pair


@contextlib.contextmanager
def held_word_engine(size: int = 4 << 20):
    """The held fence word's setup (test_engine, test_sender_parts): two fabric tcp targets of one
    `size`-byte region, `good` (peer 0) and `bad` (peer 1), a Transport `t` connected to both, an
    isolating Engine `eng` with a 1 s deadline and its fence word `word` (a ctypes uint32).
    Yields them as a namespace with both(n) (one write of n bytes at 0 to each target), stop()
    (SIGSTOP to `bad`: its writes miss their deadline, NOT fenced), resume() (SIGCONT) and
    released() (waits up to 15 s for the engine to hold the word no longer: whether it does
    not); a `bad` still stopped is resumed at the exit, before the targets go, and the
    transport is closed after a clean exit."""
    import ctypes
    import signal
    import time
    from types import SimpleNamespace

    from wxfer import _wxfer
    from wxfer.testing import TargetProcess

    opts = {"provider": "tcp"}
    with TargetProcess("fabric", opts, [size]) as good, TargetProcess("fabric", opts, [size]) as bad:
        t = _wxfer.Transport("fabric", opts)
        assert good.connect(t) == 0 and bad.connect(t) == 1
        eng = _wxfer.Engine(t, timeout=1.0, isolate=True)
        word = ctypes.c_uint32(0)
        eng.fence_word(ctypes.addressof(word), word)
        h = SimpleNamespace(good=good, bad=bad, t=t, eng=eng, word=word, stopped=False)

        def send(sig, stopped):
            os.kill(bad.proc.pid, sig)
            h.stopped = stopped

        def released():
            end = time.monotonic() + 15
            while eng.word_state() is not None and time.monotonic() < end:
                time.sleep(0.02)
            return eng.word_state() is None

        h.stop, h.resume = lambda: send(signal.SIGSTOP, True), lambda: send(signal.SIGCONT, False)
        h.released = released
        h.both = lambda n: [(good.descriptors[0], 0, 0, n), (bad.descriptors[0], 0, 0, n)]
        try:
            yield h
        finally:
            if h.stopped:
                h.resume()
        t.close()


def run_wxfer(*args, timeout: float, rc: int = 0, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m wxfer *args` to its end (output captured); its exit status must be rc."""
    p = subprocess.run([sys.executable, "-m", "wxfer", *args], capture_output=True, text=True, timeout=timeout, env=env)
    assert p.returncode == rc, p.stdout[-3000:] + p.stderr[-3000:]
    return p


def run_script(*argv, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python argv...` run to its end from the repository root (on PYTHONPATH, `env` added to
    the environment): its CompletedProcess (text), whatever its exit status."""
    e = dict(os.environ, PYTHONPATH=ROOT, **(env or {}))
    return subprocess.run(
        [sys.executable, *map(str, argv)], capture_output=True, text=True, timeout=timeout, env=e, cwd=ROOT
    )


def run_json(*argv, timeout: float, env: dict | None = None) -> tuple[dict, str]:
    """`python argv...` run as run_script() does; its exit status must be 0.  (The JSON object
    of its last output line, its whole output.)"""
    import json

    p = run_script(*argv, timeout=timeout, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1]), p.stdout


def bench_dry_run(script: str, out, *args, timeout: float, env: dict | None = None) -> tuple[dict, str]:
    """benchmarks/`script` --dry-run --reps 1 --out `out` --json `args...`, as run_json runs it."""
    bench = os.path.join(ROOT, "benchmarks", script)
    return run_json(bench, "--dry-run", "--reps", "1", "--out", out, "--json", *args, timeout=timeout, env=env)


def python(*args, env: dict, cwd) -> subprocess.Popen:
    """A child `python args...` whose stdout and stderr come back in one text pipe."""
    return subprocess.Popen(
        [sys.executable, *map(str, args)], env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def outputs(procs, timeout, others=()) -> list:
    """Each of `procs`' whole output, in order, each waited for at most `timeout` seconds (one
    number, or one per process); then every one of them and of `others` still running (a test
    that failed on the way) is killed."""
    ts = list(timeout) if isinstance(timeout, (list, tuple)) else [timeout] * len(procs)
    try:
        return [p.communicate(timeout=t)[0] for p, t in zip(procs, ts)]
    finally:
        for p in [*procs, *others]:
            if p.poll() is None:
                p.kill()


def child_env(**kw) -> dict:
    """os.environ for a child process whose stdout a test parses line by line, with `kw` on
    top, PYTHONUNBUFFERED dropped (under it print() is two write(2) calls: see
    ONE_WRITE_PER_LINE, which torchrun's ranks need as well)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env.update(kw)
    return env


def store_env(port: int) -> dict:
    """The environment of a test's trainer and worker processes: this checkout importable,
    the store at 127.0.0.1:`port`, one thread per process, fabric over tcp."""
    return child_env(
        PYTHONPATH=ROOT,
        WXFER_STORE_PORT=str(port),
        WXFER_STORE="127.0.0.1:%d" % port,
        OMP_NUM_THREADS="1",
        WXFER_FABRIC_PROVIDER="tcp",
    )


def torchrun_args(script, *args, nproc: int = 2) -> list:
    """The arguments after the Python executable that run `script` (with `args`) under
    torchrun as `nproc` local ranks, the rendezvous on a free loopback port."""
    from wxfer.runtime.control import free_port

    return [
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        str(script),
        *(str(a) for a in args),
    ]


def receivers_in_threads(config: dict, store, name: str, tp: int = 1, quant=None, ep: bool = False, timeout=30.0, **kw):
    """One replica of `config`'s inference model, TP `tp`, as Receivers constructed in threads
    (a constructor waits for the trainers): (each rank's params, [(thread, box)] as in_thread
    gives them; see joined). `kw`: more Receiver arguments (verify, ...)."""
    from wxfer.models import inference_params, preset_for
    from wxfer.runtime.receiver import Receiver

    params = [inference_params(config, tp, r, quant, ep) for r in range(tp)]
    common = dict(mapping=preset_for(config).name, store=store, replica=0, tp=tp, replicas=1, name=name)
    if ep:
        common["ep"] = True
    return params, [in_thread(Receiver, params[r], rank=r, timeout=timeout, **common, **kw) for r in range(tp)]


def native_gpu(info, key: str, what: str):
    """The current CUDA device, asserted to run `what` natively: info(device)[key] must be
    "native" (copies.info / fp8.info), its reason shown otherwise. For the kernel tests'
    device fixtures."""
    import torch

    d = torch.device("cuda", torch.cuda.current_device())
    inf = info(d)
    assert inf[key] == "native", f"{what} is not used: {inf['reason']}"
    return d


def reporting(target, *args):
    """A child process's target: target(*args), where an exception is put on the out queue (the
    last argument) as its repr instead of only ending the child."""
    try:
        target(*args)
    except BaseException as e:  # noqa: BLE001 -- reported to the parent
        args[-1].put(repr(e))


def gpu_receiver(config: dict, store, name: str, timeout: float, quant=None, before=None, **kw):
    """cuda:0 made this process's device and a Receiver of `config`'s inference model (`quant`)
    there, on freshly allocated parameters, by default the one worker of one replica
    (ONE_WORKER; `kw` may say replica=, replicas=): (params, receiver). `before(params)` is
    called before the Receiver is constructed; `kw`: more Receiver arguments (verify, ...).
    For the GPU tests' receiver processes."""
    import torch

    from wxfer.models import inference_params, preset_for
    from wxfer.runtime.receiver import Receiver
    from wxfer.testing import ONE_WORKER

    torch.cuda.set_device(0)
    params = inference_params(config, 1, 0, quant, device="cuda:0")
    if before is not None:
        before(params)
    kw = dict(ONE_WORKER, mapping=preset_for(config).name, store=store, name=name, timeout=timeout, **kw)
    return params, Receiver(params, **kw)


def hold_up_first_call(monkeypatch, owner, attr: str) -> list:
    """`owner.attr` patched to queue about 0.3 s of GPU sleep (torch.cuda._sleep) on the current
    stream before its first call, and torch.cuda.Stream.synchronize to fail the test: returns
    the list that is non-empty once the sleep was queued."""
    import pytest
    import torch

    real, slept = getattr(owner, attr), []

    def slow(*args, **kw):
        if not slept:
            slept.append(1)
            torch.cuda._sleep(int(0.3 * 2e9))  # ~0.3 s at up to 2 GHz
        return real(*args, **kw)

    monkeypatch.setattr(owner, attr, slow)
    monkeypatch.setattr(torch.cuda.Stream, "synchronize", lambda self: pytest.fail("a stream synchronize"))
    return slept


def externals_before_the_end_stamp(engine) -> list:
    """The external tasks of `engine`'s trace (the in-place kernels' CUDA events), each asserted
    finished with status 0 before the step's last stamp task was first posted: the end stamps
    waited for them. For the GPU tests that hold the side stream up."""
    from wxfer.runtime.tasks import STAMP_TAG

    recs = engine.trace()
    ext = [r for r in recs if r["kind"] == "external"]
    end = max((r for r in recs if r["tag"] == STAMP_TAG), key=lambda r: r["id"])
    assert ext and all(r["status"] == 0 for r in ext)
    assert all(r["t_done"] <= end["t_post_first"] for r in ext)
    return ext


class StoreCtl:
    """A store as Control shows it, in memory (`kv`): counters, records, the calls made
    (`calls`); `down`: every call fails. For the tests of the parts that take a Control."""

    def __init__(self):
        self.kv, self.calls, self.down = {}, [], False

    def _call(self, what):
        self.calls.append(what)
        if self.down:
            raise ConnectionError("the store is gone")

    def add(self, key, n):
        self._call(("add", key))
        self.kv[key] = self.kv.get(key, 0) + n
        return self.kv[key]

    def counters(self, keys):
        self._call(("counters", tuple(keys)))
        return [self.kv.get(k, 0) for k in keys]

    def set(self, key, value):
        self._call(("set", key))
        self.kv[key] = value

    def set_json(self, key, value):
        self.set(key, value)

    def get_json(self, key, what, timeout=None):
        self._call(("get", key))
        if key not in self.kv:
            raise KeyError(f"{what}: {key} not in the store")
        return self.kv[key]

    def check(self, key):
        return key in self.kv


def shard(kind: str, dtype: str, *pieces, rank: int = 0, dst: str = "d"):
    """A mapping Shard of `pieces` at offset 0 with its byte count worked out: raw pieces in
    `dtype`, e4m3 bytes (fp8) or their float32 block scales (scale)."""
    import torch

    from wxfer.mapping.rules import Shard

    if kind == "scale":
        nb = sum(p.scale_nbytes() for p in pieces)
    else:
        nb = sum(p.numel() * (1 if kind == "fp8" else getattr(torch, dtype).itemsize) for p in pieces)
    return Shard(rank, dst, 0, nb, kind, dtype, tuple(pieces))


def expected_shards(model, config: dict, tp: int = 1, quant: str | None = None) -> list:
    """[(TP rank, destination name, byte offset, uint8 bytes)]: what the mapping of the tiny
    models (wxfer.models.preset_for(config)) writes to each inference rank for `model`'s
    current weights, by the reference packing."""
    from wxfer.mapping import Layout, expand, pack_shard
    from wxfer.models import preset_for

    full = {n: p.detach() for n, p in model.named_parameters()}
    ex = expand(
        preset_for(config).rules, {n: tuple(t.shape) for n, t in full.items()}, Layout(tp, False, quant), config
    )
    return [(sh.rank, sh.dst, sh.offset, pack_shard(sh, full)) for c in ex.components for sh in c.shards]


def landed(model, params, rank, tp=2, config=None) -> bool:
    """Every byte the plan of `config` (default: the tiny dense model, wxfer.models.TINY) writes
    to TP rank `rank` of `tp` for `model`'s current weights is in that rank's `params`."""
    import torch

    from wxfer.models import TINY

    return all(
        torch.equal(params[dst].view(-1).view(torch.uint8)[off : off + b.numel()], b)
        for r, dst, off, b in expected_shards(model, config or TINY, tp)
        if r == rank
    )
