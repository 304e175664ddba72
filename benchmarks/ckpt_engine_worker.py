"""The inference worker of benchmarks/bench_ckpt_engine.py (rank 1): the vLLM-layout parameters,
written by wxfer's Receiver or by checkpoint-engine's update_weights_from_ipc through Loader."""

from __future__ import annotations

import os
import traceback

from common import baselines as bb
from ckpt_engine_parts import Loader, _med, feed_in_buckets, fingerprints, step_name, train_weights, wait_any


class Worker:
    """Rank 1: the vLLM-layout parameters, written by wxfer's Receiver or checkpoint-engine."""

    def __init__(self, a, store, ctl, dev):
        self.a, self.store, self.ctl, self.dev = a, store, ctl, dev
        self.key = None
        self.params = None
        self.zmq_ctx = None

    def layout(self, s):
        import torch

        k = (s["model"], s["quant"])
        if self.key != k:
            self.params = None
            if self.dev.type == "cuda":
                torch.cuda.empty_cache()
            conf, preset = bb.model_spec(s["model"])
            self.conf, self.preset = conf, preset
            self.ex = bb.expanded(preset, conf, "fp8" if s["quant"] == "fp8" else None)
            self.params = bb.infer_params(self.ex, self.dev)
            self.key = k
        return self.ex

    def run(self, s) -> None:
        i, a = s["i"], self.a
        if s["method"] == "bound":
            return
        got = wait_any(
            self.ctl,
            ["s/%d/go" % i, "s/%d/skip" % i, "s/%d/fail/0" % i],
            "the trainer's start of " + step_name(s),
            a["step_timeout"],
        )
        if not got.endswith("go"):
            return
        info: dict = {}
        try:
            ex = self.layout(s)
            bb.reset(self.params)
            if os.environ.get("BCE_FAIL_METHOD") == s["method"]:  # tests: a failing step
                raise RuntimeError(f"injected failure in {s['method']}")
            if s["method"] == "wxfer":
                self.wxfer(s, info)
            elif s["method"] == "ckpt-engine":
                self.ckpt(s, info, ex)
            elif s["method"] == "loader":
                self.ctl.set("s/%d/ready" % i, b"1")
                fulls = train_weights(self.preset, self.conf, self.dev)
                ld = Loader(ex, self.params)
                feed_in_buckets(ld, fulls, a["loader_bucket"])
                info["loader"] = ld.stats()
                del fulls
            bb.sync_dev(self.dev)
            self.ctl.set_json("s/%d/sums" % i, dict(fp=fingerprints(self.params), info=info))
        except Exception as e:  # noqa: BLE001 -- reported to the trainer
            traceback.print_exc()
            self.ctl.set("s/%d/fail/1" % i, f"{type(e).__name__}: {e}")

    def _wait_end(self, i, what):
        k = wait_any(self.ctl, ["s/%d/done" % i, "s/%d/fail/0" % i], what, self.a["step_timeout"])
        if not k.endswith("done"):
            raise RuntimeError("trainer failed: " + self.ctl.get(k, "error").decode())

    def wxfer(self, s, info) -> None:
        from wxfer.runtime.receiver import Receiver

        i = s["i"]
        self.ctl.set("s/%d/ready" % i, b"1")  # the Receiver waits for the Sender's plan
        r = Receiver(
            self.params,
            mapping=self.preset.name,
            store=self.store,
            name="%s_%d" % (self.a["name"], i),
            timeout=self.a["timeout"],
        )
        try:
            self._wait_end(i, "the trainer's wxfer steps")
            info["version"] = r.version()
        finally:
            r.close()

    def ckpt(self, s, info, ex) -> None:
        import torch
        import zmq
        from checkpoint_engine.worker import update_weights_from_ipc

        i, a = s["i"], self.a
        if self.zmq_ctx is None:
            self.zmq_ctx = zmq.Context()
        gpu = self.dev.type == "cuda"
        uuid = "GPU-%s" % torch.cuda.get_device_properties(self.dev.index or 0).uuid if gpu else None
        ld = Loader(ex, self.params)
        self.ctl.set("s/%d/ready" % i, b"1")
        k, stats = 0, []
        while True:
            got = wait_any(
                self.ctl,
                ["s/%d/req/%d" % (i, k), "s/%d/done" % i, "s/%d/fail/0" % i],
                "the trainer's next update request",
                a["step_timeout"],
            )
            if not got.endswith("/%d" % k) or "/req/" not in got:
                break
            paths = dict(tuple(x) for x in self.ctl.get_json(got, "socket paths"))
            handle = paths.get(uuid) or (next(iter(paths.values())) if len(paths) == 1 else None)
            if handle is None:
                raise RuntimeError(f"no checkpoint-engine socket for this GPU ({uuid}) in {sorted(paths)}")
            ld.begin()
            update_weights_from_ipc(self.zmq_ctx, handle, self.dev.index if gpu else None, run=ld)
            st = ld.stats()
            stats.append(st)
            self.ctl.set_json("s/%d/ack/%d" % (i, k), st)
            if not st["complete"]:
                raise RuntimeError(
                    f"update {k}: the loader wrote {st['components']} of {st['of']} components "
                    f"({st['missing_sources']} sources never arrived)"
                )
            k += 1
        if got.endswith("fail/0"):
            raise RuntimeError("trainer failed: " + self.ctl.get(got, "error").decode())
        info["updates"] = k
        info["loader"] = stats[-1] if stats else {}
        if stats:
            info["load_fn_s"] = _med([x["load_fn_s"] for x in stats])
