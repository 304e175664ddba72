"""One tree's stamps' fences on CPU (run.sh): argv ROOT N; one JSON line of median / p90 us."""

import importlib.util
import json
import sys

root, n = sys.argv[1], int(sys.argv[2])
sys.path.insert(0, root)
spec = importlib.util.spec_from_file_location("bhf", root + "/benchmarks/bench_host_fixed.py")
b = importlib.util.module_from_spec(spec)
spec.loader.exec_module(b)
import torch  # noqa: E402
import wxfer  # noqa: E402

assert wxfer.__file__.startswith(root), wxfer.__file__
torch.set_num_threads(1)
store, sender, recvs = b._setup(2, "tcp", 60.0)
try:
    b._pushes(sender, 10, 0.005)
    fence: dict = {}
    ph = b._pushes(sender, n, 0.005, fence=fence)
    out = {k: b._stats(v) for k, v in list(ph.items()) + list(fence.items())}
    print(json.dumps({"root": root, **{k: (v["median_us"], v["p90_us"]) for k, v in out.items()}}))
finally:
    sender.close()
    for r in recvs:
        r.close()
