#!/usr/bin/env python3
"""cuda_ipc bandwidth: our one-sided writes vs the raw copies measured in the same run.

For each placement
  cross: writer process on cuda:0, receiving process on cuda:1 (needs 2 GPUs)
  same:  writer and receiving processes both on cuda:0
it prints, per write size (default 64 MiB .. 4 GiB):
  ours       cuda_ipc writes through the Engine (pipelined: `iters` tasks submitted, then
             waited for), wall clock from first submit to last completion
  peer copy  (cross) dst.copy_(src) from cuda:0 to cuda:1 inside ONE process (torch, peer
             access on), wall clock around the copies and the synchronize
  on-device  (same) dst.copy_(src) on cuda:0 inside one process
  naive      (cross) the trap: a tensor of the receiver shared through torch.multiprocessing,
             written with x.copy_(src) by the other process
and the ratio ours / raw. Every number is the median of --reps repetitions.

  python3 benchmarks/bench_cuda_ipc.py [--sizes 64M,256M,1G,4G] [--json] [--diagnose]
      [--placements cross,same] [--opts streams=4,split=0]

--diagnose adds, at 256 MiB and 1 GiB across GPUs, one fresh writer process per variant of
the backend's options (map=owner, peer_access=1, ipc_lazy=0, streams=1, split) and a
profile of the naive path (which copy kinds the driver ran), to tell the causes apart.
Needs torch with CUDA; GPU numbers come only from a GPU machine.
"""

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import time

TIMEOUT = 300
MiB = 1 << 20
# run from a checkout: the in-place build of wxfer is in the repository root
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_size(s):
    s = s.strip().upper().replace("IB", "").replace("B", "")
    mul = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(float(s.rstrip("KMG")) * mul)


def fmt_size(n):
    return "%d GiB" % (n >> 30) if n >= 1 << 30 and n % (1 << 30) == 0 else "%d MiB" % (n >> 20)


def iters_for(size):
    return max(3, min(64, (8 << 30) // size))


# ---- processes --------------------------------------------------------------------------


def receiver(conn, device, nbytes, queue):
    """Receiving process: allocate, register, export; then run nothing until told to exit."""
    import torch
    from wxfer import _wxfer

    torch.cuda.set_device(device)
    dst = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    t = _wxfer.Transport("cuda_ipc", {})
    r = t.register(dst, export=True)
    conn.send((t.export(), r.descriptor))
    while conn.poll(TIMEOUT):
        msg = conn.recv()
        if msg == "share":  # the naive path: torch.multiprocessing's CUDA IPC
            queue.put(dst)
            conn.send("shared")
        elif msg == "check":
            torch.cuda.synchronize(device)
            conn.send(int(dst[: 1 << 20].to(torch.int64).sum().item()))
        else:
            break
    t.close()


def _copy_rates(dst, src, sizes, sync, reps) -> dict:
    """{n: GB/s} of copying the first n bytes of `src` into `dst` (a warm-up copy first) for
    each n of `sizes`."""
    rates = {}
    for n in sizes:
        it = iters_for(n)
        d, s = dst[:n], src[:n]
        d.copy_(s)
        dt = _time(lambda: d.copy_(s), sync, it, reps)
        rates[n] = n * it / dt / 1e9
    return rates


def _time(fn, sync, iters, reps):
    out = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def worker(conn, job, body=None):
    """One measurement job in a fresh process (`body(job)`, default this script's jobs); sends
    back a dict."""
    try:
        conn.send((body or _worker)(job))
    except Exception as e:  # report instead of hanging the parent
        import traceback

        conn.send({"error": "%s: %s" % (type(e).__name__, e), "trace": traceback.format_exc()})


def _worker(job):
    import torch
    from wxfer import _wxfer

    kind, wdev, rdev, sizes, reps = job["kind"], job["wdev"], job["rdev"], job["sizes"], job["reps"]
    torch.cuda.set_device(wdev)
    src = torch.randint(0, 255, (max(sizes),), dtype=torch.uint8, device=wdev)
    res = {"kind": kind, "opts": job.get("opts", {}), "gbps": {}}

    def sync():
        torch.cuda.synchronize(wdev)
        if rdev != wdev:
            torch.cuda.synchronize(rdev)

    if kind == "raw":
        dst = torch.empty(max(sizes), dtype=torch.uint8, device=rdev)
        if rdev != wdev:
            res["can_access_peer"] = torch.cuda.can_device_access_peer(wdev, rdev)
        res["gbps"] = _copy_rates(dst, src, sizes, sync, reps)
        return res

    if kind == "naive":
        job["conn"].send("share")
        x = job["queue"].get(timeout=TIMEOUT)
        assert job["conn"].recv() == "shared"
        res["shared_tensor_device"] = str(x.device)
        res["current_device"] = torch.cuda.current_device()
        res["gbps"] = _copy_rates(x, src, sizes, sync, reps)
        if job.get("profile"):
            from torch.profiler import ProfilerActivity, profile

            n = sizes[-1]
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                x[:n].copy_(src[:n])
                sync()
            rows = []
            for e in prof.key_averages():
                if e.device_type.name == "CUDA" or "emcpy" in e.key or "opy" in e.key:
                    rows.append("%s x%d" % (e.key, e.count))
            res["profile"] = rows
        del x
        return res

    # ours
    opts = dict(job.get("opts", {}))
    opts.setdefault("device", str(wdev))
    t = _wxfer.Transport("cuda_ipc", opts)
    peer, req = t.connect_request(job["blob"])
    t.connect_finish(peer, req)  # empty request: nothing to exchange
    sreg = t.register(src, export=False)
    eng = _wxfer.Engine(t, depth=64, timeout=120)
    for n in sizes:
        it = iters_for(n)

        def post(n=n):
            eng.submit(sreg, [(job["desc"], 0, 0, n)])

        def wait():
            eng.wait(timeout=120)
            eng.reap()

        post()
        wait()
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(it):
                post()
            wait()
            out.append(time.perf_counter() - t0)
        res["gbps"][n] = n * it / statistics.median(out) / 1e9
        # one write at a time (latency-bound view)
        t0 = time.perf_counter()
        for _ in range(3):
            post()
            wait()
        res.setdefault("gbps_serial", {})[n] = n * 3 / (time.perf_counter() - t0) / 1e9
    res["info"] = t.info()
    eng.close()
    t.close()
    # bytes landed: the receiver sums its first MiB, we compare with our source
    job["conn"].send("check")
    got = job["conn"].recv()
    want = int(src[: 1 << 20].to(torch.int64).sum().item())
    res["check"] = "ok" if got == want else "MISMATCH (%d != %d)" % (got, want)
    return res


def run_job(ctx, job, timeout=TIMEOUT, body=None):
    """`worker` in a fresh process: its dict, or {"error": ...} after `timeout` seconds."""
    a, b = ctx.Pipe()
    p = ctx.Process(target=worker, args=(b, job, body))
    p.start()
    b.close()
    if not a.poll(timeout):
        p.kill()
        p.join()
        return {"error": "timed out after %d s" % timeout}
    res = a.recv()
    p.join(30)
    return res


# ---- machine ------------------------------------------------------------------------------


def machine():
    import torch

    m = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpus": [],
        "host": platform.node(),
    }
    for i in range(torch.cuda.device_count()):
        m["gpus"].append(torch.cuda.get_device_name(i))
    try:
        q = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,pci.bus_id", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        m["nvidia_smi"] = q.stdout.strip().splitlines()
        m["driver"] = m["nvidia_smi"][0].split(",")[1].strip() if m["nvidia_smi"] else "?"
        topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30)
        m["topology"] = topo.stdout.strip().splitlines()[:4]
    except Exception as e:  # no nvidia-smi: still report what torch knows
        m["driver"] = "? (%s)" % e
    return m


# ---- main ---------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", default="64M,256M,1G,4G")
    ap.add_argument("--placements", default="cross,same")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--opts", default="", help="backend options k=v,k=v for 'ours'")
    ap.add_argument("--no-naive", action="store_true")
    ap.add_argument("--diagnose", action="store_true")
    ap.add_argument("--json", action="store_true", help="also print one JSON line at the end")
    a = ap.parse_args()
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(k, v)
    import torch

    if not torch.cuda.is_available():
        print("bench_cuda_ipc: no CUDA GPU here; nothing measured", file=sys.stderr)
        return 2
    sizes = [parse_size(s) for s in a.sizes.split(",") if s]
    opts = dict(kv.split("=", 1) for kv in a.opts.split(",") if kv)
    ngpu = torch.cuda.device_count()
    m = machine()
    print(
        "machine: %d x %s | driver %s | torch %s (CUDA %s) | python %s"
        % (ngpu, ", ".join(sorted(set(m["gpus"]))), m.get("driver"), m["torch"], m["cuda"], m["python"])
    )
    for line in m.get("topology", []):
        print("  topo: " + line)
    ctx = mp.get_context("spawn")
    report = {"machine": m, "sizes": sizes, "opts": opts, "placements": {}}
    for pl in a.placements.split(","):
        if pl == "cross" and ngpu < 2:
            print("\n[cross] skipped: needs 2 GPUs")
            continue
        wdev, rdev = (0, 1) if pl == "cross" else (0, 0)
        queue = ctx.Queue()
        rc, rchild = ctx.Pipe()
        rx = ctx.Process(target=receiver, args=(rchild, rdev, max(sizes), queue))
        rx.start()
        if not rc.poll(120):
            print("[%s] receiver process failed to start (exit code %s)" % (pl, rx.exitcode))
            rx.kill()
            continue
        blob, desc = rc.recv()
        base = {"wdev": wdev, "rdev": rdev, "sizes": sizes, "reps": a.reps}
        raw = run_job(ctx, dict(base, kind="raw"))
        ours = run_job(ctx, dict(base, kind="ours", opts=opts, blob=blob, desc=desc, conn=rc))
        naive = None
        if pl == "cross" and not a.no_naive:
            naive = run_job(ctx, dict(base, kind="naive", queue=queue, conn=rc, profile=a.diagnose))
        entry = {"writer": "cuda:%d" % wdev, "receiver": "cuda:%d" % rdev, "raw": raw, "ours": ours, "naive": naive}
        rawname = "peer copy" if pl == "cross" else "on-device copy"
        target = 0.90 if pl == "cross" else 0.80
        print(
            "\n[%s] writer process cuda:%d -> receiver process cuda:%d  (raw = %s in one "
            "process; target ours >= %d%% of raw for >= 256 MiB)" % (pl, wdev, rdev, rawname, target * 100)
        )
        for r in (raw, ours, naive):
            if r and "error" in r:
                print("  ERROR in %s job: %s\n%s" % (r.get("kind", "?"), r["error"], r.get("trace", "")))
        hdr = "  %8s  %10s  %10s  %6s  %12s" % ("size", "ours GB/s", "raw GB/s", "ratio", "ours 1-by-1")
        if naive:
            hdr += "  %11s" % "naive GB/s"
        print(hdr)
        rows = []
        for n in sizes:
            o = ours.get("gbps", {}).get(n)
            w = raw.get("gbps", {}).get(n)
            s1 = ours.get("gbps_serial", {}).get(n)
            ratio = o / w if o and w else None
            flag = ""
            if ratio is not None and n >= 256 * MiB:
                flag = " ok" if ratio >= target else " BELOW"
            line = "  %8s  %10s  %10s  %6s  %12s" % (
                fmt_size(n),
                "%.1f" % o if o else "-",
                "%.1f" % w if w else "-",
                ("%.2f" % ratio + flag) if ratio else "-",
                "%.1f" % s1 if s1 else "-",
            )
            nv = naive.get("gbps", {}).get(n) if naive else None
            if naive:
                line += "  %11s" % ("%.1f" % nv if nv else "-")
            print(line)
            rows.append({"size": n, "ours": o, "raw": w, "ratio": ratio, "ours_serial": s1, "naive": nv})
        entry["rows"] = rows
        print("  ours: %s | bytes check: %s" % (ours.get("info", "?"), ours.get("check", "?")))
        if naive and "shared_tensor_device" in naive:
            print(
                "  naive: shared tensor on %s, writer's current device cuda:%s"
                % (naive["shared_tensor_device"], naive["current_device"])
            )
        if a.diagnose and pl == "cross":
            dsizes = [256 * MiB, 1 << 30]
            variants = [
                {},
                {"map": "owner"},
                {"map": "owner", "peer_access": "1"},
                {"peer_access": "1"},
                {"ipc_lazy": "0"},
                {"streams": "1"},
                {"split": str(128 * MiB), "streams": "8"},
            ]
            entry["diagnose"] = []
            print("  diagnose (fresh writer process per variant, sizes %s):" % ", ".join(fmt_size(s) for s in dsizes))
            for v in variants:
                r = run_job(ctx, dict(base, kind="ours", opts=v, sizes=dsizes, blob=blob, desc=desc, conn=rc))
                entry["diagnose"].append(r)
                vals = ", ".join("%.1f" % r["gbps"][s] for s in dsizes) if "gbps" in r else r.get("error", "?")
                print(
                    "    ours %-36s %s GB/s  [%s]"
                    % (",".join("%s=%s" % kv for kv in v.items()) or "(defaults)", vals, r.get("check", ""))
                )
            if naive and naive.get("profile"):
                print("    naive path, profiler: " + "; ".join(naive["profile"]))
        rc.send("exit")
        rx.join(60)
        report["placements"][pl] = entry
    if a.json:

        def clean(o):
            if isinstance(o, dict):
                return {str(k): clean(v) for k, v in o.items() if k not in ("conn", "queue")}
            if isinstance(o, list):
                return [clean(v) for v in o]
            if isinstance(o, bytes):
                return o.hex()[:32]
            return o

        print("JSON " + json.dumps(clean(report)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
