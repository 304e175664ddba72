#!/usr/bin/env python3
"""The block-FP8 quantizer alone: the reference (wxfer.mapping.reference.quantize_fp8_block
and copies) against the native kernel (csrc/prepare/wx_fp8_kernel.cu, one launch per call),
both through wxfer.runtime.fp8.quantize_into writing into one packed uint8 buffer.

Cases (bfloat16 sources, as a trainer's weights):
  dense          one 12288x4096 tensor
  experts-1      128 experts of 768x2048 (one 3-D tensor), all in one call (one launch)
  experts-1, table reused   the same call through fp8.quantize_cached, as pack_into makes it
                 on every push after the first: the piece table is built (and copied to the
                 device) once, so a call costs one launch and no per-piece Python work
  experts-128    the same experts, one call (one launch) per expert
Effective GB/s counts the bytes read (bf16) and written (fp8 + float32 scales). The bound is
an on-device copy of the same source bytes (dst.copy_(src)) measured in the same run,
counted the same way (read + written). Every figure is the median of --reps repetitions of
--iters calls, timed with CUDA events. The native bytes are checked against the reference.

  python3 benchmarks/bench_quant.py [--json] [--reps 5] [--iters 20] [--native-only]
  python3 benchmarks/bench_quant.py --minb 2,3,4,5   # the native kernel compiled for n CTAs/SM
  python3 benchmarks/bench_quant.py --variants v0,v1,v2,v3,v2:3   # kernel variants (children)
  python3 benchmarks/bench_quant.py --dry-run      # CPU, small shapes (CI)

The product kernel is variant v6 at 2 CTAs per SM. The other variants (v0-v8,
benchmarks/kernels/sweep_fp8_kernel.cu lists them) are in builds made for the sweep only:

  WXFER_KERNEL_SWEEP=1 .venv/bin/python setup.py build_ext --inplace --force

--variants runs one child process per variant v<n>[:<CTAs per SM>] (the kernel is compiled
once per process; the child picks it with `--kernel v<n>[:<m>]`, _wxfer.kernel_sweep), each
checking its bytes against the reference, and prints one table; --minb n,m,... is --variants
v6:n,v6:m,... (CTAs per SM: the register budget; v6-v8 also size their shared-memory ring
from it: 1: 6 tile buffers, 2: 3, 3 or more: 2).
"""

import argparse
import collections
import json
import os
import platform
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CASES = {
    "full": {"dense": (12288, 4096), "experts": (128, 768, 2048)},
    "dry": {"dense": (384, 520), "experts": (4, 256, 384)},
}


def _sync(dev):
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, dev, iters, reps):
    """Median seconds per call of fn over reps repetitions of iters calls."""
    import torch

    fn()
    _sync(dev)
    times = []
    for _ in range(reps):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(iters):
                fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3 / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times)


def layout(ts):
    """Jobs (tensor, fp8 offset, scale offset) packing each tensor's fp8 bytes then its scales,
    like an fp8 shard followed by its scale shard; and the buffer size."""
    jobs, off = [], 0
    for t in ts:
        jobs.append([t, off, None])
        off += t.numel()
    for j in jobs:
        r, c = j[0].shape
        j[2] = off
        off += -(-r // 128) * -(-c // 128) * 4
    return [tuple(j) for j in jobs], off


def quantize(out, groups, quantizer, key=None):
    """One fp8.quantize_into call per group of jobs (key: fp8.quantize_cached(out, (key, i),
    ...) instead, the piece table kept from the first call), WXFER_FP8 set to `quantizer`
    around all of them (not per call: the environment update is no part of a call's cost)."""
    from wxfer.runtime import fp8

    old = os.environ.get("WXFER_FP8")
    os.environ["WXFER_FP8"] = quantizer
    try:
        for i, g in enumerate(groups):
            if key is None:
                kind = fp8.quantize_into(out, g)
            else:
                kind = fp8.quantize_cached(out, (key, quantizer, i), lambda g=g: g)
        return kind
    finally:
        if old is None:
            del os.environ["WXFER_FP8"]
        else:
            os.environ["WXFER_FP8"] = old


def run_case(name, ts, calls, dev, quantizers, iters, reps, check=False, cached=False):
    """Rows for one case: ts the source tensors, calls how to split them into calls. check:
    also quantize once (untimed) with the reference and compare every byte. cached: through
    fp8.quantize_cached (the piece table built by the first, untimed, call)."""
    import torch

    jobs, nbytes = layout(ts)
    groups = [jobs] if calls == 1 else [[j] for j in jobs]
    src_bytes = sum(t.numel() * t.element_size() for t in ts)
    moved = src_bytes + nbytes  # read + written
    out = {q: torch.zeros(nbytes, dtype=torch.uint8, device=dev) for q in quantizers}
    ran = {}

    def fn_for(q):
        def fn():
            ran[q] = quantize(out[q], groups, q, key=name if cached else None)

        return fn

    src = torch.cat([t.reshape(-1) for t in ts])
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src), dev, iters, reps)
    copy_gbps = 2 * src_bytes / copy_s / 1e9
    rows = []
    for q in quantizers:
        it = iters if q == "native" else max(1, iters // 10)
        s = timed(fn_for(q), dev, it, reps)
        gbps = moved / s / 1e9
        rows.append(
            dict(
                case=name,
                quantizer=q,
                ran=ran.get(q),
                launches=len(groups) if ran.get(q) == "native" else 0,
                pieces=len(jobs),
                bytes_moved=moved,
                ms=round(s * 1e3, 4),
                GBps=round(gbps, 3),
                copy_ms=round(copy_s * 1e3, 4),
                copy_GBps=round(copy_gbps, 3),
                vs_copy=round(gbps / copy_gbps, 3),
            )
        )
    if check and "reference" not in quantizers:
        out["reference"] = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
        fn_for("reference")()
        quantizers = ["reference"] + list(quantizers)
    if len(quantizers) > 1:
        same = all(torch.equal(out[quantizers[0]], out[q]) for q in quantizers[1:])
        for r in rows:
            r["identical"] = same
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="also print one JSON line")
    ap.add_argument("--dry-run", action="store_true", help="CPU, small shapes, reference only")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--native-only", action="store_true", help="skip the (slow) reference")
    ap.add_argument("--minb", help="comma-separated CTAs-per-SM values to compare (child processes)")
    ap.add_argument(
        "--variants",
        help="comma-separated kernel variants v<n>[:<minb>] to compare "
        "(child processes; each checked byte for byte against the reference)",
    )
    ap.add_argument("--check-only-native", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--kernel", default="", help=argparse.SUPPRESS)  # a child's variant (sweep_variants)
    a = ap.parse_args(argv)
    if a.minb:
        a.variants = ",".join(f"v6:{m.strip()}" for m in a.minb.split(",") if m.strip())
    if a.variants:
        return sweep_variants(a)
    import torch
    from wxfer.runtime import fp8

    variant, _, minb = a.kernel.partition(":")
    if a.kernel:
        pick_variant(variant, minb, a.dry_run)

    if a.dry_run:
        dev = torch.device("cpu")
        a.reps, a.iters = min(a.reps, 2), min(a.iters, 2)
    else:
        if not torch.cuda.is_available():
            sys.exit("bench_quant: needs a CUDA GPU (or --dry-run)")
        dev = torch.device("cuda", torch.cuda.current_device())
    shapes = CASES["dry" if a.dry_run else "full"]
    inf = fp8.info(dev)
    quantizers = ([] if a.native_only and inf["quantizer"] == "native" else ["reference"]) + (
        ["native"] if inf["quantizer"] == "native" else []
    )
    chk = a.check_only_native
    g = torch.Generator(device="cpu").manual_seed(0)
    dense = torch.randn(*shapes["dense"], generator=g).to(torch.bfloat16).to(dev)
    experts = torch.randn(*shapes["experts"], generator=g).to(torch.bfloat16).to(dev)
    ex = [experts[e] for e in range(experts.shape[0])]
    rows = []
    rows += run_case("dense %dx%d" % shapes["dense"], [dense], 1, dev, quantizers, a.iters, a.reps, chk)
    rows += run_case("experts %dx%dx%d, one call" % shapes["experts"], ex, 1, dev, quantizers, a.iters, a.reps, chk)
    rows += run_case(
        "experts %dx%dx%d, one call, table reused" % shapes["experts"],
        ex,
        1,
        dev,
        quantizers,
        a.iters,
        a.reps,
        chk,
        cached=True,
    )
    rows += run_case(
        "experts %dx%dx%d, call per expert" % shapes["experts"],
        ex,
        len(ex),
        dev,
        quantizers,
        max(1, a.iters // 4),
        a.reps,
        chk,
    )
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "none (CPU dry run)"
    print(f"bench_quant on {platform.node()}, {gpu}; native quantizer: {inf['quantizer']} ({inf['reason']})")
    heads = ("case", "quantizer", "launches", "ms", "effective GB/s", "on-device copy GB/s", "vs copy")
    cells = "{case} | {quantizer} | {launches} | {ms:.3f} | {GBps:.1f} | {copy_GBps:.1f} | {vs_copy:.3f}"
    extra = dict(torch=torch.__version__, native=inf, variant=variant or "product", minb=minb)
    report(a, "quant", gpu, heads, cells, rows, **extra)
    if any(r.get("identical") is False for r in rows):
        print("bench_quant: the native bytes differ from the reference", file=sys.stderr)
    return 1 if any(r.get("identical") is False for r in rows) else 0


def report(a, bench: str, gpu: str, heads, cells: str, rows: list, **extra) -> None:
    """The rows as a markdown table (`cells` formatted with each row's fields, None where a row
    has none) and, with --json, one JSON object last: bench, machine, gpu, dry_run, `extra`,
    results."""
    print("| " + " | ".join(heads) + " |")
    print("|" + "---|" * len(heads))
    for r in rows:
        print("| " + cells.format_map(collections.defaultdict(lambda: None, r)) + " |")
    if a.json:
        print(json.dumps(dict(bench=bench, machine=platform.node(), gpu=gpu, dry_run=a.dry_run, **extra, results=rows)))


def pick_variant(variant: str, minb: str, dry_run: bool) -> None:
    """Compile FP8 kernel variant v<n> (at minb CTAs per SM, "" for its own) in this process:
    a WXFER_KERNEL_SWEEP build's _wxfer.kernel_sweep. A CPU dry run has no kernel to pick."""
    from wxfer import _wxfer

    if not getattr(_wxfer, "KERNEL_SWEEP", 0):
        if dry_run:
            return
        sys.exit(
            "bench_quant: kernel variants need a build with WXFER_KERNEL_SWEEP=1 "
            "(WXFER_KERNEL_SWEEP=1 .venv/bin/python setup.py build_ext --inplace --force)"
        )
    _wxfer.kernel_sweep("fp8", variant=int(variant[1:]), ctas_per_sm=int(minb or 0))


def sweep_variants(a):
    """The native rows of each kernel variant (v<n>[:<minb>]), one child process each, every
    case's bytes compared with the reference's (quantized once, untimed) in that child."""
    import re

    specs = [v.strip() for v in a.variants.split(",") if v.strip()]
    for v in specs:
        if not re.fullmatch(r"v\d+(:\d+)?", v):
            sys.exit(f"bench_quant: --variants {v!r}: expected v<n> or v<n>:<CTAs per SM>")
    rows, gpu, bad = [], None, []
    for v in specs:
        name, _, minb = v.partition(":")
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--json",
            "--native-only",
            "--check-only-native",
            "--kernel",
            v,
            "--reps",
            str(a.reps),
            "--iters",
            str(a.iters),
        ] + (["--dry-run"] if a.dry_run else [])
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if p.returncode != 0 and not p.stdout.strip().endswith("}"):
            print(f"bench_quant: variant {v} failed:\n" + p.stdout[-2000:] + p.stderr[-2000:], file=sys.stderr)
            bad.append(v)
            continue
        res = json.loads(p.stdout.strip().splitlines()[-1])
        gpu = res["gpu"]
        if res.get("variant") != name or res.get("minb") != minb:
            print(f"bench_quant: variant {v}: the child ran {res.get('variant')}:{res.get('minb')}", file=sys.stderr)
            bad.append(v)
            continue
        if not a.dry_run and res["native"]["quantizer"] != "native":
            print(
                f"bench_quant: variant {v}: the native kernel did not run: {res['native']['reason']}", file=sys.stderr
            )
            bad.append(v)
            continue
        want = "reference" if a.dry_run else "native"
        rows += [dict(r, variant=v) for r in res["results"] if r["quantizer"] == want]
    print(f"bench_quant --variants on {platform.node()}, {gpu}")
    heads = ("case", "variant", "ms", "effective GB/s", "vs copy", "identical to the reference")
    cells = "{case} | {variant} | {ms:.3f} | {GBps:.1f} | {vs_copy:.3f} | {identical}"
    report(a, "quant-variants", gpu, heads, cells, rows, failed=bad)
    differ = [r for r in rows if r.get("identical") is False]
    if differ:
        print(
            "bench_quant: bytes differ from the reference: " + ", ".join(sorted({r["variant"] for r in differ})),
            file=sys.stderr,
        )
    return 1 if bad or differ else 0


if __name__ == "__main__":
    sys.exit(main())
