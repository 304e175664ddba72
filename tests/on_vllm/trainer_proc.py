"""A trainer rank for tests/on_vllm/test_llm.py (not a test module).

python trainer_proc.py CKPT STORE NAME MODE RANK WORLD DIST_PORT CONN_PORT

Builds transformers' Qwen3ForCausalLM for the checkpoint's config with weights seeded by the
round, and reaches the vLLM engine through vLLM's trainer factory (backend "wxfer") with a
client whose four RPCs go to the test process over a multiprocessing connection (the test
process runs the offline vllm.LLM).  MODE: "ok" (two rounds, reporting transformers' greedy
tokens after each push), "wrong" (a mapping with gate and up swapped in gate_up_proj), "missing"
(a trainer model of three layers for the engine's two), "traced" (mapping=None: the plan
from the map the workers trace from vLLM's load_weights, any architecture), "serve" (one rank,
"traced" jobs one after the other, each sent as ("job", ckpt, store, name[, seed0])), "kill" (two
ranks; rank 1 SIGKILLs itself in the middle of the second push).  Rank 0 reports ("pushed",
round, tokens) / ("error", message).
"""

import contextlib
import os
import signal
import sys
import threading
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPT = [3, 17, 101, 45, 9, 250]
NEW = 8


def completion_request(model: str) -> dict:
    """The body of `vllm serve`'s /v1/completions request for the greedy tokens of PROMPT (NEW of
    them, EOS ignored, their ids returned) from `model` (test_serve, serve_trainer)."""
    greedy = dict(max_tokens=NEW, min_tokens=NEW, temperature=0.0, ignore_eos=True)
    return dict(model=model, prompt=PROMPT, return_token_ids=True, **greedy)


@contextlib.contextmanager
def reported(conn, rank: int, reraise: bool):
    """A trainer's job: rank 0 tells the test ("done", None) at its end, or ("error", "Type: msg")
    when it raises; the exception goes on on the other ranks, and on rank 0 where `reraise`."""
    try:
        yield
        if rank == 0:
            conn.send(("done", None))
    except Exception as e:  # noqa: BLE001 -- reported to the test
        if rank == 0:
            conn.send(("error", f"{type(e).__name__}: {e}"))
        if reraise or rank != 0:
            raise


class ConnClient:
    """VLLMWeightSyncClient over a connection to the test process (one call in flight at a time)."""

    def __init__(self, conn):
        self.conn, self.lock = conn, threading.Lock()

    def _call(self, method, **kw):
        with self.lock:
            self.conn.send(("rpc", method, kw))
            kind, msg = self.conn.recv()
        if kind != "ok":
            raise RuntimeError(f"{method}: {msg}")

    def init_weight_transfer_engine(self, init_info):
        self._call("init_weight_transfer_engine", init_info=init_info)

    def start_weight_update(self):
        self._call("start_weight_update")

    def update_weights(self, update_info):
        self._call("update_weights", update_info=update_info)

    def finish_weight_update(self, weight_version=None):
        self._call("finish_weight_update", weight_version=weight_version)


def seeded(model, seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            t = torch.randn(p.shape, generator=g) * 0.2
            if n.endswith("norm.weight"):
                t = 1.0 + 0.1 * t
            p.copy_(t.to(p.dtype))


def checkpoint_named(model):
    """`model`, or where transformers keeps a MoE layer's experts fused (``experts.gate_up_proj``
    [E, 2I, H], ``experts.down_proj`` [E, H, I]) while its save_pretrained writes them per expert
    (``experts.<e>.gate_proj.weight``...), a module of views of its parameters under the
    checkpoint's names (storage shared: the Sender reads the model's own memory).  The traced
    map speaks the checkpoint's names."""
    from wxfer.integrations.vllm.trainer import with_persistent_buffers

    model = with_persistent_buffers(model)  # a persistent buffer the checkpoint holds (DeepSeek-V3's bias)
    named = dict(model.named_parameters())
    if not any(n.endswith("experts.gate_up_proj") for n in named):
        return model
    out = {}
    for n, p in named.items():
        pre = n.rsplit(".", 1)[0]
        if n.endswith("experts.gate_up_proj") and p.dim() == 3:
            half = p.shape[1] // 2
            for e in range(p.shape[0]):
                out[f"{pre}.{e}.gate_proj.weight"] = p.data[e, :half]
                out[f"{pre}.{e}.up_proj.weight"] = p.data[e, half:]
        elif n.endswith("experts.down_proj") and p.dim() == 3:
            for e in range(p.shape[0]):
                out[f"{pre}.{e}.down_proj.weight"] = p.data[e]
        else:
            out[n] = p
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers
    from helpers import module_with

    return module_with(out)


def greedy(model):
    """transformers' greedy decode: [(token, runner-up token, logit margin between them, top logit)] per step."""
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([PROMPT]),
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
    steps = []
    for tok, sc in zip(out.sequences[0, len(PROMPT) :].tolist(), out.scores):
        top = sc[0].float().topk(2)
        steps.append((tok, int(top.indices[1]), float(top.values[0] - top.values[1]), float(top.values[0])))
    return steps


def main(ckpt, store, name, mode, rank, world, dist_port, conn_port):
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{dist_port}", rank=rank, world_size=world)
    conn = None
    if rank == 0:
        from multiprocessing.connection import Client

        conn = Client(("127.0.0.1", conn_port), authkey=b"wxfer-test")
    if mode != "serve":
        return job(ckpt, store, name, mode, rank, conn)
    while True:  # one process for several jobs: ("job", ckpt, store, name) ... ("quit",)
        msg = conn.recv()
        if msg[0] != "job":
            return
        if len(msg) > 4:  # the job's own WXFER_TEST_SEED0
            os.environ["WXFER_TEST_SEED0"] = str(msg[4])
        job(msg[1], msg[2], msg[3], "traced", 0, conn)


def job(ckpt, store, name, mode, rank, conn):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    import wxfer.integrations.vllm  # noqa: F401 -- registers the backend
    from wxfer.integrations.vllm import WxferTrainerInitInfo

    cfg = AutoConfig.from_pretrained(ckpt)
    if mode == "missing":  # the trainers' model has a layer the engine's lacks
        cfg.num_hidden_layers += 1
        cfg.layer_types = (cfg.layer_types or ["full_attention"] * (cfg.num_hidden_layers - 1)) + ["full_attention"]
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    seed0 = int(os.environ.get("WXFER_TEST_SEED0", "0"))  # a test's own weights for rounds 1, 2
    seeded(model, seed0 + 1)
    mapping = dict(cfg.to_dict(), name_or_path="tiny")
    if mode == "wrong":
        from wxfer.mapping import Fuse, from_config

        p = from_config("tiny", mapping)
        rules = [Fuse(r.dst, tuple(reversed(r.srcs))) if r.dst.endswith("gate_up_proj.weight") else r for r in p.rules]
        mapping = type(p)(p.name, p.arch, rules, p.config)
    if mode == "traced":  # no preset: the plan from the workers' traced maps
        mapping = None
    info = WxferTrainerInitInfo(
        store=store, mapping=mapping, name=name, timeout=60.0, update_timeout=15.0, watermark="64KiB", rank=rank
    )
    with reported(conn, rank, reraise=False):
        src = checkpoint_named(model) if mode == "traced" else model
        eng = WeightTransferTrainerFactory.trainer_init(info, client=ConnClient(conn), source=ModuleSource(src))
        for rnd in (1, 2):
            if rnd == 2:
                seeded(model, seed0 + 2)
                if mode == "kill" and rank == 1:  # after its first writes of this push were handed over
                    for hook in ("_run_task", "_submit_fast"):
                        real = getattr(eng.sender, hook)

                        def die_after(*a, _real=real):
                            _real(*a)
                            time.sleep(0.2)  # the writes handed over so far land
                            os.kill(os.getpid(), signal.SIGKILL)

                        setattr(eng.sender, hook, die_after)
            v = eng.send_weights()
            if rank == 0:
                conn.send(("pushed", v, greedy(model)))
                assert conn.recv() == ("next", None)
        if mode == "traced":
            eng.shutdown()


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], a[1], a[2], a[3], int(a[4]), int(a[5]), int(a[6]), int(a[7]))
