"""The begin stamps' fence submission alone (Engine.submit of one 8-byte fence from a registered
int64, fabric tcp), back to back and 5 ms apart, and its round trip to the fence finished:

    PYTHONPATH=. python benchmarks/runs/cpu-2026-12-07-stamps/submit_alone.py
"""

import statistics
import time

import torch

from wxfer import _wxfer
from wxfer.testing import TargetProcess


def main():
    opts = {"provider": "tcp"}
    with TargetProcess("fabric", opts, [4096]) as tgt:
        t = _wxfer.Transport("fabric", opts)
        tgt.connect(t)
        eng = _wxfer.Engine(t, timeout=5.0, isolate=True)
        src = torch.zeros(1, dtype=torch.int64)
        reg = t.register(src, export=False)
        d = [(tgt.descriptors[0], 8, 0, 8)]
        for gap in (0, 0.005):
            xs, ws = [], []
            for _ in range(300):
                if gap:
                    time.sleep(gap)
                a = time.perf_counter()
                f = eng.submit(reg, list(d), tag=1 << 62, fence=True)
                b = time.perf_counter()
                eng.wait(timeout=5, fence=f)
                ws.append(time.perf_counter() - b)
                xs.append(b - a)
            print(
                "gap",
                gap,
                "submit median us",
                round(statistics.median(xs) * 1e6, 1),
                "p90",
                round(sorted(xs)[270] * 1e6, 1),
                "fence round trip median us",
                round(statistics.median(ws) * 1e6, 1),
            )
        eng.close()
        t.close()


if __name__ == "__main__":
    main()
