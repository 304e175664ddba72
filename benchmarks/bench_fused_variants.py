#!/usr/bin/env python3
"""The fused FP8 quantize + compare kernel's variants against the dense quantize kernel alone
(issue 36's target: fused <= 1.2x), each checked byte for byte.

The variants are compiled from the product's own source (csrc/prepare/wx_delta_kernel.cu, its
WX_DPF / WX_DPAIR / WX_DBITS switches; wx_sweep.c's kernel "delta") in a build made for the sweep:

  WXFER_KERNEL_SWEEP=1 python3 setup.py build_ext --inplace --force
  python3 benchmarks/bench_fused_variants.py --variants p,d1:2,d2:2,d4:2,d5:2,d0:1,d1:1,d2:1
  python3 benchmarks/bench_fused_variants.py --dry-run   # CPU: the checks and the table only

A variant is `p` (the product, no kernel_sweep call) or d<v>:<CTAs per SM>: WX_DPF = v % 4
(0 the old bytes loaded when the tile is quantized, 1 prefetched into L2 when the tile enters
the ring, 2 copied into a shadow ring in shared memory, 3 prefetched into L2 one tile ahead),
WX_DPAIR = v // 4 % 2 (1: one bitmask atomic per 32 bytes, not per 16), WX_DBITS = v // 8 (1: the
bitmask words of rows 32-aligned in the shadow gathered by shuffles and written with plain stores,
no atomics, where a byte changed; 2: every such word, zeros too); d24-d29: WX_DPF 4 (the old
bytes copied by cp.async into one 16 KiB shared buffer one tile ahead, each thread its own
chunks), WX_DPAIR = (v - 24) % 2, WX_DBITS = (v - 24) // 2; 2 CTAs per SM is the product's shape
(ring of 3 tiles), 1 takes 6 (4 with WX_DPF 2, 3 with WX_DPF 4). d0:2 is the product.

Each variant runs in a child process (a kernel is compiled once per process) that:
  1. checks the fused kernel byte for byte: the shadow after it equals the product FP8
     kernel's dense bytes of the new weights (and, on the small shapes, the CPU reference
     quantizer's), the bitmask marks exactly the bytes that differ; two pieces (one a column
     slice: an unaligned row pitch) at offsets 0 and 5, BF16 / FP16 / FP32, 0-100% changed;
  2. times, on one --shape BF16 weight, the dense quantize alone (the product FP8 kernel,
     the same in every child) and the fused kernel, with CUDA events over --iters launches
     queued behind a sleep kernel (no host time in the figure), alternating the old and new
     weights so that every launch sees the rate's changes (the shadow toggles between the
     two); fused+zero also clears the bitmask before each launch (a push's bits_for); count:
     the count kernel alone over the bitmask (the pass a count fused into the kernel saves).
The ratio is taken within the child (the same process, GPU and minute). Prints one table
and, with --json, one JSON line; exits 1 when a variant failed or differed.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (200, 336): partial tiles on 16-aligned rows; (300, 200), (129, 1000): rows 8-aligned; (64, 300): 4-aligned;
# (160, 416), (130, 352): rows 32-aligned (not 128), right tiles 32 and 96 wide (WX_DBITS's word stores)
CHECK_SHAPES = [(4096, 4096), (200, 336), (300, 200), (129, 1000), (64, 300), (77, 130), (160, 416), (130, 352)]
DRY_SHAPES = [(256, 384), (129, 200)]
CHECK_RATES = [0.0, 0.004, 0.5, 1.0]


def _moved(w, rate, g):
    """w with about `rate` of its elements changed (x1.07 + a small offset)."""
    import torch

    m = (torch.rand(w.shape, generator=g, device=g.device) < rate).to(w.device)
    w2 = w.clone()
    w2[m] = (w2[m].float() * 1.07 + 0.003).to(w.dtype)
    return w2


def two_pieces(w, q_off):
    """All of w at q_off, its scales after; its right columns (an unaligned row pitch in general)
    with their own scales; and the bytes needed."""
    rows, cols = w.shape
    sb = -(-rows // 128) * -(-cols // 128) * 4
    c0 = cols // 3
    sb1 = -(-rows // 128) * -(-(cols - c0) // 128) * 4
    o = q_off + rows * cols
    jobs = [(w, q_off, o + 1), (w[:, c0:], o + 1 + sb + 2, o + 1 + sb + 2 + rows * (cols - c0) + 3)]
    return jobs, jobs[1][2] + sb1 + 5


def packed_bits(d):
    """The bitmask of bool tensor d (little-endian bit order) as int32 words, one past the end."""
    import torch

    n = d.numel()
    b = torch.zeros(((n + 31) // 32 + 1) * 32, dtype=torch.uint8, device=d.device)
    b[:n] = d
    w = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=d.device)
    return (b.view(-1, 8) * w).sum(1, dtype=torch.uint8).view(torch.int32)


def fused_standin(shadow, bits, jobs):
    """delta_gpu.quantize_compare's contract on CPU (--dry-run): the reference quantizer's
    bytes into the shadow, the changed ones marked."""
    from wxfer.runtime import fp8

    new = shadow.clone()
    fp8.quantize_into(new, jobs)
    words = packed_bits(new != shadow)
    bits.copy_(bits | words)
    shadow.copy_(new)


def check(dev, fused, shapes, dry):
    """(cases, mismatches): the fused kernel against the dense bytes, every shape, dtype, rate
    and offset."""
    import torch

    from wxfer.runtime import delta_gpu, fp8

    bad, n_cases = [], 0
    for shape in shapes:
        big = shape[0] * shape[1] > 1 << 22
        for dtype in ["bfloat16"] if big else ["bfloat16", "float16", "float32"]:
            for rate in CHECK_RATES:
                g = torch.Generator(device=dev).manual_seed(shape[0] * 7919 + shape[1] + int(rate * 1000) + len(dtype))
                w = (torch.randn(shape, generator=g, device=dev) * 0.02).to(getattr(torch, dtype))
                w2 = _moved(w, rate, g)
                for q_off in (0,) if big else (0, 5):
                    jobs1, n = two_pieces(w, q_off)
                    jobs2, _ = two_pieces(w2, q_off)
                    old = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g, device=dev)
                    fp8.quantize_into(old, jobs1)
                    new = old.clone()
                    fp8.quantize_into(new, jobs2)
                    if not big and not dry:  # the product kernel against the CPU reference
                        cpu = old.cpu()
                        fp8.quantize_into(cpu, [(t.cpu(), a, b) for t, a, b in jobs2])
                        if not torch.equal(cpu, new.cpu()):
                            bad.append(f"{shape} {dtype} {rate} +{q_off}: the product kernel vs the reference")
                    shadow, bits = old.clone(), delta_gpu.bits_for(n, dev)
                    fused(shadow, bits, jobs2)
                    n_cases += 1
                    if not torch.equal(shadow, new) or not torch.equal(bits, packed_bits(new != old)):
                        bad.append(f"{shape} {dtype} {rate} +{q_off}: {int((shadow != new).sum())} bytes differ")
    return n_cases, bad


def timed(dev, iters, reps, launch, before=None):
    """Median seconds per launch(i) over reps runs of iters launches (before(i) ahead of each),
    queued behind a sleep kernel and timed with CUDA events (perf_counter on CPU)."""
    import torch

    cuda = dev.type == "cuda"
    times = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize(dev)
            torch.cuda._sleep(int(2e7))  # ~10 ms: the launches below queue up behind it
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        t0 = time.perf_counter()
        for i in range(iters):
            if before is not None:
                before(i)
            launch(i)
        if cuda:
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3 / iters)
        else:
            times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times)


def launches(dev, out, shadow, bits, jobs_a, jobs_b):
    """(quantize(i), fused(i)): one launch each, the piece tables made once; launch i takes the
    new weights (b) when i is even, the old (a) when odd."""
    from wxfer.runtime import fp8

    if dev.type != "cuda":
        return (lambda i: fp8.quantize_into(out, (jobs_b, jobs_a)[i & 1]),
                lambda i: fused_standin(shadow, bits, (jobs_b, jobs_a)[i & 1]))  # fmt: skip
    from wxfer import _wxfer

    tabs = [fp8._table(dev, j)[0] for j in (jobs_b, jobs_a)]
    st = fp8._raw_stream(dev)
    n, nb = out.numel(), bits.numel() * 4

    def quant(i):
        _wxfer.fp8_launch(dev.index, st, out.data_ptr(), n, tabs[i & 1], 0)

    def fused(i):
        _wxfer.delta_quant_launch(dev.index, st, shadow.data_ptr(), n, tabs[i & 1], 0, bits.data_ptr(), nb)

    return quant, fused


def count_launch(dev, bits, n):
    """The count kernel over the whole shadow's bitmask (one launch, its table made once; the
    pass a fused count would save), or None on CPU."""
    if dev.type != "cuda":
        return None
    import array

    import torch

    from wxfer import _wxfer
    from wxfer.runtime import delta_gpu, fp8

    segs = (n + delta_gpu.SEG - 1) // delta_gpu.SEG
    table = array.array("Q", (0, n, 0))
    dtab, counts = delta_gpu._dev(table, dev), torch.empty(segs, dtype=torch.int32, device=dev)
    st = fp8._raw_stream(dev)
    return lambda i: _wxfer.delta_launch(
        1, dev.index, st, table, dtab.data_ptr(), bits.data_ptr(), bits.numel() * 4, counts.data_ptr(), segs
    )


def bench(dev, rows, cols, rates, iters, reps):
    """The timed rows of one rows x cols BF16 weight (one piece: fp8 bytes then scales)."""
    import torch

    from wxfer.runtime import delta_gpu, fp8

    g = torch.Generator(device=dev).manual_seed(1)
    w = (torch.randn(rows, cols, generator=g, device=dev) * 0.02).to(torch.bfloat16)
    nq = rows * cols
    n = nq + -(-rows // 128) * -(-cols // 128) * 4
    jobs_a = [(w, 0, nq)]
    a = torch.zeros(n, dtype=torch.uint8, device=dev)
    fp8.quantize_into(a, jobs_a)
    src = w.reshape(-1)
    dst = torch.empty_like(src)
    copy_s = timed(dev, iters, reps, lambda i: dst.copy_(src))
    res = []
    for rate in rates:
        w2 = _moved(w, rate, g)
        jobs_b = [(w2, 0, nq)]
        b = a.clone()
        fp8.quantize_into(b, jobs_b)
        out, shadow, bits = torch.empty_like(a), a.clone(), delta_gpu.bits_for(n, dev)
        quant, fused = launches(dev, out, shadow, bits, jobs_a, jobs_b)
        q_s = timed(dev, iters, reps, quant)
        f_s = timed(dev, iters, reps, fused)
        fz_s = timed(dev, iters, reps, fused, lambda i: bits.zero_())
        count = count_launch(dev, bits, n)
        c_s = timed(dev, iters, reps, count) if count else None
        ok = torch.equal(shadow, a if iters % 2 == 0 else b)  # after an even count: back to a
        res.append(
            dict(
                rate=rate,
                changed_bytes=int((a != b).sum()),
                quantize_ms=q_s * 1e3,
                fused_ms=f_s * 1e3,
                fused_zero_ms=fz_s * 1e3,
                fused_vs_quantize=f_s / q_s,
                fused_zero_vs_quantize=fz_s / q_s,
                count_ms=None if c_s is None else c_s * 1e3,
                quantize_GBps=3 * nq / q_s / 1e9,
                copy_GBps=2 * 2 * nq / copy_s / 1e9,
                shadow_toggled=bool(ok),
            )
        )
    return res


def pick(variant: str, dry: bool) -> None:
    """Compile the fused kernel's variant d<v>:<c> in this process (p: the product's)."""
    from wxfer import _wxfer

    if variant == "p":
        return
    if not getattr(_wxfer, "KERNEL_SWEEP", 0):
        if dry:
            return
        sys.exit(
            "bench_fused_variants: variants need a build with WXFER_KERNEL_SWEEP=1 "
            "(WXFER_KERNEL_SWEEP=1 python3 setup.py build_ext --inplace --force)"
        )
    v, _, c = variant[1:].partition(":")
    _wxfer.kernel_sweep("delta", variant=int(v), ctas_per_sm=int(c or 0))


def child(a) -> int:
    """One variant: its checks and timed rows, one JSON line."""
    import torch

    from wxfer.runtime import delta_gpu

    pick(a.kernel, a.dry_run)
    cuda = torch.cuda.is_available() and not a.dry_run
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if cuda:
        why = delta_gpu.why(dev)
        if why is not None:
            sys.exit(f"bench_fused_variants: the delta kernels do not run here: {why}")
    fused = delta_gpu.quantize_compare if cuda else fused_standin
    n_cases, bad = check(dev, fused, CHECK_SHAPES if cuda else DRY_SHAPES, not cuda)
    rows, cols = (int(x) for x in (a.shape if cuda else "384x512").split("x"))
    res = bench(dev, rows, cols, [float(r) for r in a.rates.split(",")], a.iters, a.reps)
    print(json.dumps(dict(variant=a.kernel, gpu=torch.cuda.get_device_name(dev) if cuda else "cpu",
                          shape=[rows, cols], cases=n_cases, mismatches=bad, rows=res)))  # fmt: skip
    return 1 if bad else 0


def _row(r: dict, x: dict) -> str:
    count = "-" if x["count_ms"] is None else "%.4f" % x["count_ms"]
    return (
        f"| {r['variant']} | {x['rate']:g} | {x['changed_bytes']} | {x['quantize_ms']:.4f} | "
        f"{x['quantize_GBps']:.1f} | "
        f"{x['fused_ms']:.4f} | {x['fused_vs_quantize']:.3f} | {x['fused_zero_ms']:.4f} | "
        f"{x['fused_zero_vs_quantize']:.3f} | {count} | {not r['mismatches'] and x['shadow_toggled']} ({r['cases']}) |"
    )


def sweep(a) -> int:
    """One child per variant; each variant's rows printed as it ends (a bound run keeps what ran)."""
    import re

    specs = [v.strip() for v in a.variants.split(",") if v.strip()]
    for v in specs:
        if not re.fullmatch(r"p|d(1?[0-9]|2[0-9])(:[0-2])?", v):
            sys.exit(f"bench_fused_variants: --variants {v!r}: expected p or d<0-29>[:<0-2>]")
    out, failed = [], []
    print(f"bench_fused_variants on {platform.node()}, {a.shape} BF16, {a.iters} launches x {a.reps}", flush=True)
    print(
        "| variant | changed | bytes changed | quantize ms | GB/s | fused ms | x | fused+zero ms | x | count ms "
        "| exact (cases) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for v in specs:
        cmd = [sys.executable, os.path.abspath(__file__), "--kernel", v, "--shape", a.shape, "--rates", a.rates,
               "--iters", str(a.iters), "--reps", str(a.reps)] + (["--dry-run"] if a.dry_run else [])  # fmt: skip
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        last = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
        if not last.startswith("{"):
            print(f"bench_fused_variants: variant {v} failed:\n{p.stdout[-2000:]}{p.stderr[-2000:]}", file=sys.stderr)
            failed.append(v)
            continue
        r = json.loads(last)
        out.append(r)
        if r["mismatches"]:
            failed.append(v)
            print(f"bench_fused_variants: {v}: " + "; ".join(r["mismatches"][:5]), file=sys.stderr)
        for x in r["rows"]:
            print(_row(r, x), flush=True)
    gpu = out[0]["gpu"] if out else "?"
    if out:
        shape = "x".join(str(x) for x in out[0]["shape"])
        print(f"({gpu}, {shape}; copy of the BF16 source: {out[0]['rows'][0]['copy_GBps']:.1f} GB/s read + written)")
    if a.json:
        print(json.dumps(dict(bench="fused-variants", machine=platform.node(), gpu=gpu, failed=failed, results=out)))
    return 1 if failed or any(not x["shadow_toggled"] for r in out for x in r["rows"]) else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="p", help="comma-separated: p, d<v>[:<CTAs per SM>]")
    ap.add_argument("--shape", default="8192x8192", help="the timed BF16 weight")
    ap.add_argument("--rates", default="0,0.004,0.03,0.5", help="fractions of elements changed")
    ap.add_argument("--iters", type=int, default=20, help="launches per timing (even: the shadow toggles)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--dry-run", action="store_true", help="CPU: the reference stand-in, small shapes")
    ap.add_argument("--kernel", default="", help=argparse.SUPPRESS)  # a child's variant
    a = ap.parse_args(argv)
    if a.iters < 2 or a.iters % 2:
        sys.exit("bench_fused_variants: --iters must be even and >= 2 (the shadow toggles back)")
    return child(a) if a.kernel else sweep(a)


if __name__ == "__main__":
    sys.exit(main())
