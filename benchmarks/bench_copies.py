#!/usr/bin/env python3
"""The batched copies alone: many device-to-device copies in one call, as a push copies its
zero-copy tasks straight into colocated receivers (wxfer.runtime.inplace), by the native
kernel (csrc/prepare/wx_copy_kernel.cu, wxfer.runtime.copies), by the driver's own batched
copy (cuMemcpyBatchAsync, CUDA 12.8+ drivers; copies.COPIER = "driver" makes it the product
path) and by torch._foreach_copy_ (the fallback), the same bytes in the same run, against the
bound measured there too: one on-device copy of the same total bytes (dst.copy_(src)). GB/s
counts each byte read and written (2 x bytes), as wxfer.tools.calibrate does. Batches:

  uniform-128   128 ranges of 8 MiB (the calibration's shape: 1 GiB)
  qwen3-8b      the 399 parameter sizes of Qwen3-8B (16.4 GB), in launches of at most
                COPY_BATCH ranges or COPY_BATCH_BYTES (as the push batches them)
  qwen3-1.7b    the same for the 1.7B-class model (311 parameters)
  norms         145 ranges of 8 KiB (Qwen3-8B's norms alone: launch-bound)

Every figure is the median of --reps repetitions, timed with CUDA events; the copied bytes
are checked. On a machine without CUDA it runs small shapes on the CPU (the torch path only).

  python3 benchmarks/bench_copies.py [--json] [--reps 5]
  python3 benchmarks/bench_copies.py --variants 4:8,8:8,8:4,4:16   # children, one table

A variant is UNROLL:CTAS: the kernel compiled with UNROLL 16-byte loads in flight per thread,
launched on CTAS CTAs per SM (the product's: 4:16); each runs in a child process (the kernel is
compiled once per process; the child picks it with `--kernel UNROLL:CTAS`) and checks its
bytes. Variants need a build made for the sweep (the product build has 4:16 only):

  WXFER_KERNEL_SWEEP=1 .venv/bin/python setup.py build_ext --inplace --force
"""

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]


def _sizes(model: str) -> list:
    """Bytes of each training parameter of a curated model (BF16), in the plan's order."""
    import math

    from common.baselines import model_spec

    cfg, preset = model_spec(model)
    return [math.prod(shape) * 2 for shape, _dt, _ in preset.hf_params(cfg).values()]


def _batches(sizes: list) -> list:
    """The sizes cut as the push cuts its queued copies (wxfer.zerocopy: COPY_BATCH ranges or
    COPY_BATCH_BYTES), one range each."""
    from wxfer.zerocopy import COPY_BATCH, COPY_BATCH_BYTES, Batcher

    b = Batcher(COPY_BATCH, COPY_BATCH_BYTES)
    out = [full for full in (b.add(n, n) for n in sizes) if full is not None]
    if len(b):
        out.append(b.take())
    return out


def _timed(fn, dev, reps: int) -> float:
    import torch

    fn()
    if dev.type != "cuda":
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)
    torch.cuda.synchronize(dev)
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return statistics.median(ts)


def run_case(name: str, batches: list, dev, reps: int) -> dict:
    import torch

    from wxfer.runtime import copies

    total = sum(sum(b) for b in batches)
    src = torch.randint(0, 256, (total,), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    launches, at = [], 0
    for b in batches:
        items = []
        for n in b:
            d, s = dst[at : at + n], src[at : at + n]
            items.append((d, s, d.data_ptr(), s.data_ptr(), n))
            at += n
        launches.append(items)
    row = dict(case=name, ranges=sum(len(b) for b in batches), launches=len(batches), bytes=total)
    t_bound = _timed(lambda: dst.copy_(src), dev, reps)
    row["bound_GBps"] = 2 * total / t_bound / 1e9
    for label, env, copier in (("native", "", "kernel"), ("driver", "", "driver"), ("torch", "torch", None)):
        if label != "torch" and (dev.type != "cuda" or (label == "driver" and copies.driver_why(dev))):
            continue
        os.environ["WXFER_COPY"] = env
        dst.zero_()
        ran = {copies.copy_ranges(dev, items, copier) for items in launches}
        ok = bool(torch.equal(dst, src))
        t = _timed(lambda: [copies.copy_ranges(dev, items, copier) for items in launches], dev, reps)
        row[label] = dict(copier=sorted(ran), seconds=t, GBps=2 * total / t / 1e9, of_bound=t_bound / t, bytes_ok=ok)
    os.environ.pop("WXFER_COPY", None)
    return row


def pick_kernel(spec: str) -> None:
    """Compile the copy kernel as UNROLL:CTAS in this process (a WXFER_KERNEL_SWEEP build)."""
    from wxfer import _wxfer

    if not getattr(_wxfer, "KERNEL_SWEEP", 0):
        sys.exit(
            "bench_copies: kernel variants need a build with WXFER_KERNEL_SWEEP=1 "
            "(WXFER_KERNEL_SWEEP=1 .venv/bin/python setup.py build_ext --inplace --force)"
        )
    unroll, ctas = (int(x) for x in spec.split(":"))
    _wxfer.kernel_sweep("copy", unroll=unroll, ctas_per_sm=ctas)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--variants", default="", help="comma list of UNROLL:CTAS, one child each")
    ap.add_argument("--kernel", default="", help=argparse.SUPPRESS)  # a child's variant
    args = ap.parse_args(argv)
    if args.variants:
        return variants(args)
    if args.kernel:
        pick_kernel(args.kernel)
    import torch

    gpu = torch.cuda.is_available()
    dev = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    name = torch.cuda.get_device_name(dev) if gpu else "CPU"
    from wxfer.runtime import copies

    inf = copies.info(dev) if gpu else copies.info(None)
    print(f"bench_copies on {platform.node()}, {name}; copier: {inf['copier']} ({inf['reason']})")
    if gpu:
        print(f"driver batch (cuMemcpyBatchAsync): {copies.driver_why(dev) or 'available'}")
    scale = 1 if gpu else 64  # the CPU: the same shapes, 64x smaller
    cases = [("uniform-128", [[(8 << 20) // scale] * 128])]
    for m in ("qwen3-8b", "qwen3-1.7b"):
        cases.append((m, _batches([max(1, n // scale) for n in _sizes(m)])))
    cases.append(("norms", [[8 << 10] * 128, [8 << 10] * 17]))
    rows = []
    for cname, batches in cases:
        r = run_case(cname, batches, dev, args.reps)
        rows.append(r)
        parts = [f"{cname:12s} {r['ranges']:4d} ranges {r['launches']:3d} launches {r['bytes'] / 1e9:7.3f} GB"]
        parts.append(f"bound {r['bound_GBps']:7.0f} GB/s")
        for label in ("native", "driver", "torch"):
            if label in r:
                x = r[label]
                parts.append(
                    f"{label} {x['seconds'] * 1e3:8.3f} ms {x['GBps']:7.0f} GB/s "
                    f"({x['of_bound']:.2f} of bound{'' if x['bytes_ok'] else ', BYTES WRONG'})"
                )
        print("  ".join(parts), flush=True)
    if args.json:
        print(json.dumps(dict(bench="copies", machine=platform.node(), gpu=name, copier=inf, results=rows)))
    return 0 if all(r[k]["bytes_ok"] for r in rows for k in ("native", "driver", "torch") if k in r) else 1


def variants(args) -> int:
    """One child per variant (its --kernel), then one table of the native rows."""
    rows, ok = [], True
    for v in args.variants.split(","):
        if not re.fullmatch(r"\d+:\d+", v.strip()):
            sys.exit(f"bench_copies: --variants {v!r}: expected UNROLL:CTAS")
    for v in args.variants.split(","):
        p = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--json", "--reps", str(args.reps), "--kernel", v.strip()],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if p.returncode != 0 or not p.stdout.strip():
            print(f"variant {v}: failed (rc {p.returncode}): {(p.stdout + p.stderr)[-800:]}", flush=True)
            ok = False
            continue
        out = json.loads(p.stdout.strip().splitlines()[-1])
        for r in out["results"]:
            x = r.get("native")
            if x is None:
                print(f"{v:12s} {r['case']:12s} no native run (no CUDA device)", flush=True)
                continue
            rows.append(dict(variant=v, case=r["case"], bound_GBps=r["bound_GBps"], **x))
            bad = "" if x["bytes_ok"] else " BYTES WRONG"
            print(
                f"{v:12s} {r['case']:12s} native {x['seconds'] * 1e3:8.3f} ms {x['GBps']:7.0f} GB/s "
                f"({x['of_bound']:.2f} of bound {r['bound_GBps']:.0f}){bad}",
                flush=True,
            )
            ok = ok and bool(x["bytes_ok"])
    if args.json:
        print(json.dumps(dict(bench="copies-variants", machine=platform.node(), results=rows)))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
