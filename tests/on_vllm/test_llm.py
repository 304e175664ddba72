"""A real offline vllm.LLM on CPU with WeightTransferConfig(backend="wxfer"), driven through
vLLM's own client RPCs by trainer processes that reach it through vLLM's trainer factory.

The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) with vLLM's CPU GEMM
dispatch patched to compute from the parameters in place (keep_cpu_weights: vLLM's CPU platform
otherwise repacks every linear weight into a private copy and leaves shape-[0] parameters, so
one-sided writes would change nothing).  The checkpoint is a tiny random Qwen3 saved as an HF
directory (no hub: HF_HUB_OFFLINE=1), prompts are token ids (skip_tokenizer_init=True).

In order (one engine for the module): a trainer whose mapping swaps gate and up is refused by
the layout proof; a trainer whose mapping writes a layer the model lacks is refused naming it;
two pushes whose greedy tokens equal transformers' greedy decode of the trainer's weights (and
whose bytes equal what vLLM's own load_weights lays for them);
bad payloads; a trainer rank killed in the middle of a push (finish_weight_update raises, the
engine keeps its previous weight version)."""

import math
import os
import re
import subprocess
import sys
import threading
import time

import pytest

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from trainer_proc import NEW, PROMPT  # noqa: E402


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from vhelp import save_checkpoint

    import wxfer.integrations.vllm as wv

    assert wv.register()
    assert wv.keep_cpu_weights()

    ck = str(tmp_path_factory.mktemp("ckpt"))
    save_checkpoint(ck, seed=0)
    from vhelp import release, wxfer_llm

    engine = wxfer_llm(ck)
    yield engine
    release(engine)


def tokens(llm):
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=NEW, min_tokens=NEW, temperature=0.0, detokenize=False, ignore_eos=True)
    return list(llm.generate([{"prompt_token_ids": PROMPT}], sp, use_tqdm=False)[0].outputs[0].token_ids)


def ulp_bf16(x: float) -> float:
    return 2.0 ** (math.floor(math.log2(max(abs(x), 1e-30))) - 7)


def same_greedy(got, hf) -> int:
    """How many leading greedy tokens of vLLM equal transformers' (hf: [(token, runner-up,
    margin, top logit)]).  Every one must, up to a near tie (the two best logits within 2 BF16
    ulps, where vLLM's CPU kernels and transformers' round differently) where either of the two
    is right and the sequences may part; returns the count compared exactly."""
    for i, (tok, second, margin, top) in enumerate(hf):
        if margin <= 2 * ulp_bf16(top):
            assert got[i] in (tok, second), (i, got, hf)
            return i
        assert got[i] == tok, f"step {i}: vLLM {got[i]} != transformers {tok} (margin {margin:.3f}): {got} vs {hf}"
    return len(hf)


def worker_engine(llm):
    return llm.collective_rpc(lambda self: self.weight_transfer_engine)[0]


class Trainers:
    """The trainer processes of one job and the client's RPCs they send, served on `llm` here."""

    def __init__(self, llm, mode, world=1, script="trainer_proc.py"):
        from multiprocessing.connection import Listener

        from wxfer.integrations.vllm import LLMClient
        from wxfer.runtime.control import free_port

        self.llm, self.client = llm, LLMClient(llm)
        self.listener = Listener(("127.0.0.1", 0), authkey=b"wxfer-test")
        store = "127.0.0.1:%d" % free_port()
        dist_port = free_port()
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + HERE)
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        name = "%s%d" % (mode, free_port())
        self.procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    os.path.join(HERE, script),
                    llm.wxfer_ckpt,
                    store,
                    name,
                    mode,
                    str(r),
                    str(world),
                    str(dist_port),
                    str(self.listener.address[1]),
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for r in range(world)
        ]
        self.rpc_errors = []
        self.conn = self._accept(120)

    def _accept(self, timeout):
        box = {}
        th = threading.Thread(target=lambda: box.setdefault("c", self.listener.accept()), daemon=True)
        th.start()
        th.join(timeout)
        if "c" not in box:
            raise AssertionError("trainer rank 0 did not connect: " + self.output())
        return box["c"]

    def output(self):
        out = []
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            out.append(p.communicate(timeout=30)[0][-3000:])
        return "\n---\n".join(out)

    def serve(self, on_pushed=None, timeout=180.0):
        """Serve RPCs until the trainers report done or an error; returns that message."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.conn.poll(1.0):
                if self.procs[0].poll() is not None:
                    return ("exited", self.output())
                continue
            try:
                msg = self.conn.recv()
            except EOFError:
                return ("exited", self.output())
            if msg[0] == "rpc":
                try:
                    getattr(self.client, msg[1])(**msg[2])
                    reply = ("ok", None)
                except Exception as e:  # noqa: BLE001 -- handed back to the trainer
                    self.rpc_errors.append((msg[1], f"{type(e).__name__}: {e}"))
                    reply = ("err", f"{type(e).__name__}: {e}")
                try:
                    self.conn.send(reply)
                except (BrokenPipeError, OSError):  # rank 0 is gone: what it sent before is still to read
                    pass
            elif msg[0] == "pushed":
                on_pushed(msg[1], msg[2])
                self.conn.send(("next", None))
            else:
                return msg
        raise AssertionError("the trainers did not finish in time: " + self.output())

    def close(self):
        for p in self.procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
        self.listener.close()


def served(llm, mode, on_pushed, shutdown=False, **kw):
    """Trainers(llm, mode, **kw) served (on_pushed after each push) until they report done,
    asserted, and closed; `shutdown`: the engine's weight transfer shut down first (its
    Receivers closed before the trainers' store goes)."""
    tr = Trainers(llm, mode, **kw)
    kind, msg = tr.serve(on_pushed)
    if shutdown:
        llm.shutdown_weight_transfer_engine()
    tr.close()
    assert kind == "done", (kind, msg)


def test_a_wrong_mapping_is_refused_by_the_layout_proof(llm):
    before = tokens(llm)
    tr = Trainers(llm, "wrong")
    kind, msg = tr.serve()
    tr.close()
    assert kind == "error" and "layout proof failed" in msg and "gate_up_proj.weight" in msg, (kind, msg)
    (call, err) = tr.rpc_errors[0]
    assert call == "init_weight_transfer_engine" and "layout proof failed" in err, tr.rpc_errors
    assert tokens(llm) == before  # the proof put the engine's bytes back


def test_b_a_parameter_the_model_lacks_is_refused_by_name(llm):
    tr = Trainers(llm, "missing")
    kind, msg = tr.serve()
    tr.close()
    assert kind == "error" and "model.layers.2." in msg, (kind, msg)
    assert tr.rpc_errors and tr.rpc_errors[0][0] == "init_weight_transfer_engine", tr.rpc_errors


def assert_bytes_equal_vllms_loader(llm, seed):
    """Every byte wxfer wrote equals what vLLM's own load_weights lays for the trainer's weights
    (the same seeded transformers model, built here)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from trainer_proc import seeded
    from vllm.config import set_current_vllm_config

    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(llm.wxfer_ckpt), dtype=torch.bfloat16)
    seeded(hf, seed)
    eng = worker_engine(llm)
    pushed = {n: t.detach().clone() for n, t in eng.receiver.params.items()}
    with set_current_vllm_config(eng.vllm_config), torch.no_grad():
        for t in eng.receiver.params.values():  # so that a parameter the loader skipped shows
            t.zero_()
        eng.model.load_weights((n, p.detach()) for n, p in hf.named_parameters())
    differ = [
        n for n, t in eng.receiver.params.items() if not torch.equal(t.view(torch.uint8), pushed[n].view(torch.uint8))
    ]
    assert not differ and len(pushed) == 19, differ


def test_c_pushes_change_the_tokens_to_the_trainers(llm):
    first = tokens(llm)
    seen = []

    def on_pushed(v, hf_tokens):
        got = tokens(llm)
        seen.append((v, got, hf_tokens, llm.get_weight_version()))
        if v == 1:
            assert_bytes_equal_vllms_loader(llm, seed=1)

    served(llm, "ok", on_pushed)
    assert [s[0] for s in seen] == [1, 2]
    for v, got, hf, version in seen:
        assert same_greedy(got, hf) >= NEW // 2, f"version {v}: vLLM greedy {got} != transformers greedy {hf}"
        assert version == str(v)
    assert seen[0][1] != first and seen[1][1] != seen[0][1]
    eng = worker_engine(llm)
    assert type(eng).__name__ == "WxferWeightTransferEngine" and eng.receiver.version() == 2
    assert eng.proof_result and not eng.proof_result["errors"] and len(eng.proof_result["digests"]) >= 10
    llm.wxfer_tokens = seen[1][1]


def test_d_bad_payloads_are_refused(llm):
    for bad, what in (({"bogus": 1}, "Invalid update_info"), ({"version": "2"}, "version must be an int")):
        llm.start_weight_update()
        with pytest.raises(ValueError, match=what):
            llm.update_weights({"update_info": bad})
        with pytest.raises(RuntimeError, match="without a matching start_weight_update"):
            llm.finish_weight_update(weight_version="bad")
    llm.start_weight_update()  # announced nothing: our finish refuses
    with pytest.raises(RuntimeError, match="without update_weights announcing a version"):
        llm.finish_weight_update(weight_version="bad")
    # vLLM keeps the session open after a finish that raised (the next trainer round completes it)
    with pytest.raises(RuntimeError, match="already active"):
        llm.start_weight_update()
    assert llm.get_weight_version() == "2"
    assert tokens(llm) == llm.wxfer_tokens


def test_e_a_trainer_killed_mid_push_fails_the_update(llm):
    tr = Trainers(llm, "kill", world=2)
    kind, msg = tr.serve(lambda v, hf: None)
    tr.close()
    assert kind == "error" and "rank 1" in msg, (kind, msg)
    # (round 1 found the session test_d left open: its start_weight_update raised "already active")
    errs = [(c, e) for c, e in tr.rpc_errors if "already active" not in e]
    assert [c for c, _ in errs] == ["update_weights"], tr.rpc_errors
    assert re.search(r"version 2|waiting for 2", errs[0][1]), tr.rpc_errors
    with pytest.raises(RuntimeError):
        llm.finish_weight_update(weight_version="2")  # the failed update is over on the worker
    assert llm.get_weight_version() == "1"  # this job's version 1 committed, version 2 never
    st = worker_engine(llm).receiver.state()
    # never version 2; either a begin stamp of step 2 landed before the trainers died (torn: -1),
    # or none did and the worker holds step 1 whole, its trainers named dead by their pids and
    # leases (dropped: 1; wxfer.runtime.liveness): which depends on how far rank 0 got
    assert (st["state"] in ("torn", "writing") and st["version"] == -1) or (
        st["state"] == "dropped" and st["version"] == 1 and 1 in st["ranks"]
    ), st
