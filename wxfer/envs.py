"""Every ``WXFER_*`` environment variable wxfer reads, in one place: its type, default, who
reads it and what it does.  Python code reads them through ``get`` (a name not declared here is
an error).  The C extension reads its own through one table, csrc/core/wx_param.h, which it
exposes as ``_wxfer.params()``: their rows here (``_c``) take type, default and doc from it.
tests/test_envs.py checks that every ``WXFER_*`` name in wxfer/, csrc/ and setup.py is declared,
that csrc/ calls getenv() only in that table's file, and that README's table is
``markdown_table()`` (``python -m wxfer.envs`` prints it).

Not declared (the rule): names used only by the test suite, the benchmarks, the Makefile or the
verbs emulation (tests/, benchmarks/, csrc/testing/, ``WXEMU_*``)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Var:
    name: str
    type: str  # flag, str, int, size, path, choice, list
    default: str  # what applies when unset, as text
    read_by: str  # Python, C or setup.py (the build)
    doc: str
    when: str = "run"  # run: at run time; build: by setup.py; test build: WXFER_TESTING=1 builds only


def _native_table() -> dict:
    """The C table (csrc/core/wx_param.h) by name; empty where the extension is not built."""
    try:
        from . import _wxfer
    except ImportError:
        return {}
    return {p["name"]: p for p in _wxfer.params()}


NATIVE = _native_table()


def _py(name: str, type: str, default: str, doc: str) -> Var:
    """The row of a variable only the Python side reads, at run time."""
    return Var(name, type, default, "Python", doc)


def _c(name: str, also: str = "", when: str = "") -> Var:
    """The row of a variable the C code reads, from its table; `also`: who else reads it."""
    read_by = "C, " + also if also else "C"
    p = NATIVE.get(name)
    if p is None:  # no extension: the name is all this side knows
        return Var(name, "str", "see csrc/core/wx_param.h", read_by, "read by the C extension", when or "run")
    return Var(name, p["type"], p["default"], read_by, p["doc"], when or p["when"])


_VARS = (
    # transports and the store (Python: Sender / Receiver setup)
    _py("WXFER_TRANSPORT", "choice", "auto", "the backend for transport=\"auto\": cuda_ipc, verbs or fabric"),
    _c("WXFER_FABRIC_PROVIDER"),
    _c("WXFER_IFACE"),
    _c("WXFER_FABRIC_IFACE"),
    _c("WXFER_IB_DEVICES"),
    _py("WXFER_STORE", "str", "MASTER_ADDR:WXFER_STORE_PORT", "the rendezvous store, host:port"),
    _py("WXFER_STORE_PORT", "int", "29650", "the store's port when WXFER_STORE is unset"),
    _py("WXFER_STORE_BIND", "str", "the store's host if an IP", "the address rank 0's store listens on"),
    _py("WXFER_SECRET", "str", "unset", "the job secret (>= 16 bytes) that authenticates store records"),
    _py(
        "WXFER_LEASE_S",
        "float",
        "1.0",
        "seconds between the lease renewals of a worker and of a trainer rank (liveness: a dead one is seen by it)",
    ),
    # a push
    _py("WXFER_VERIFY", "flag", "off", "checksum every write (Sender.push / Receiver verify=)"),
    _py("WXFER_DIRECT", "flag", "on", "colocated in-place writes on cuda_ipc (0/off/false/no: off)"),
    _py("WXFER_GC_PAUSE", "flag", "on", "Python's cyclic garbage collector paused while push() submits (0: not)"),
    _py("WXFER_DIRECT_COPY_MAX", "size", "32MiB", "zero-copy tasks below this are copied by kernels"),
    _py(
        "WXFER_DIRECT_COPY_FIRST",
        "size",
        "0",
        "a push's first batched copy launch closes at this many bytes, each next at twice the last (0: off)",
    ),
    _py(
        "WXFER_DIRECT_OVERLAP",
        "choice",
        "engines",
        "larger zero-copy tasks copied beside the FP8 kernel: engines (the default where the driver has "
        "the batched copy, else off), kernel or 0 (off)",
    ),
    _py("WXFER_DIRECT_OVERLAP_CTAS", "int", "2", "CTAs per SM of the copy kernel's grid there (kernel)"),
    _py("WXFER_DIRECT_OVERLAP_AFTER", "int", "4", "those copies launched after this many quantizer launches"),
    _py("WXFER_DELTA_STAGING", "size", "0", "Receiver delta staging area bytes (docs/delta.md)"),
    _py("WXFER_DELTA_GPU", "choice", "native", "delta pushes on CUDA: native (the delta kernels) or torch"),
    _py(
        "WXFER_DELTA_APPLY",
        "choice",
        "native",
        "a CUDA receiver's apply of delta records: native (the wx_delta_apply kernel) or torch",
    ),
    _py("WXFER_COPY", "choice", "native", "the batched copy: native (copies.COPIER's) or torch"),
    _py("WXFER_FP8", "choice", "native", "FP8 quantization: native (NVRTC kernel) or reference (torch)"),
    _py(
        "WXFER_BEGIN_WAIT",
        "choice",
        "host",
        "how in-place writes follow the begin stamps: host (the default: the host waits, bounded), "
        "stream (opt-in: written on the side stream ahead of them, no wait; no faster in one H100 A/B) or "
        "device (the stream waits with cuStreamWaitValue32 on the fence word: a word held until close "
        "stalls it); docs/cuda_ipc.md",
    ),
    # libraries (dlopened by the C extension)
    _c("WXFER_LIBCUDA"),
    _c("WXFER_LIBFABRIC"),
    _c("WXFER_LIBIBVERBS"),
    _c("WXFER_LIBNVRTC"),
    _c("WXFER_DEBUG", also="setup.py", when="run, build"),
    # tools and integrations
    _py("WXFER_VLLM_CPU_KEEP_WEIGHTS", "flag", "off", "the vLLM plugin keeps CPU weights (=1)"),
    _py(
        "WXFER_VLLM_API",
        "str",
        "unset",
        "the vLLM API form (0.26, 0.32, 0.33) for a vLLM version wxfer has not read (still signature-checked)",
    ),
    _py("WXFER_DEMO_CPU", "flag", "off", "the demo runs on the CPU even with GPUs (=1)"),
    _py("WXFER_SELFTEST_KEY", "str", "wxfer-selftest", "the verbs self-test's worker authentication key"),
    # the build (setup.py)
    Var("WXFER_SANITIZE", "flag", "off", "setup.py", "build with ASan + UBSan", "build"),
    Var("WXFER_WERROR", "flag", "off", "setup.py", "warnings are errors", "build"),
    Var("WXFER_TESTING", "flag", "off", "setup.py", "compile in the tests' fault-injection options", "build"),
    Var("WXFER_ABI_CHECK", "flag", "off", "setup.py", "compare the ABI declarations with system headers", "build"),
    Var(
        "WXFER_KERNEL_SWEEP",
        "flag",
        "off",
        "setup.py",
        "also build the benchmarks' kernel variants (_wxfer.kernel_sweep; bench_quant/bench_copies --variants)",
        "build",
    ),
    _c("WXFER_TEST_GPUREG"),
)

VARS: dict = {v.name: v for v in _VARS}


def get(name: str, fallback: str | None = None) -> str | None:
    """The value of the declared variable `name` in the environment, else `fallback` (the caller
    keeps its own parsing and default, as before this module); KeyError for an undeclared name."""
    if name not in VARS:
        raise KeyError(f"wxfer.envs: {name} is not declared in wxfer/envs.py")
    return os.environ.get(name, fallback)


OFF = ("0", "off", "false", "no")  # a flag's values that turn it off (any case, spaces around)


def on(name: str) -> bool:
    """The declared flag `name` of a default "on": on unless set to one of ``OFF``."""
    return get(name, "1").strip().lower() not in OFF


def size(name: str, default: int) -> int:
    """The declared size variable `name` in bytes (e.g. ``32MiB``; unset or empty: `default`),
    ValueError naming it when it is not a size."""
    v = (get(name) or "").strip()
    if not v:
        return default
    from . import _wxfer

    try:
        return max(0, int(_wxfer.parse_size(v)))
    except ValueError:
        raise ValueError(f"wxfer: ${name} must be a size in bytes (e.g. 32MiB) or 0, got {v!r}") from None


def values() -> dict:
    """{name: value} of the declared variables set now (those the C code reads, as its table
    sees them)."""
    native = _native_table()
    out = {}
    for v in _VARS:
        value = native[v.name]["value"] if v.name in native else os.environ.get(v.name)
        if value is not None:
            out[v.name] = value
    return out


def markdown_table() -> str:
    """README's environment-variable table."""
    rows = ["| Variable | Type | Default | Read by | When | What |", "|---|---|---|---|---|---|"]
    for v in _VARS:
        rows.append(f"| `{v.name}` | {v.type} | {v.default} | {v.read_by} | {v.when} | {v.doc} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
