"""Reach (issue 34.4): a real offline vllm.LLM per architecture, tiny random checkpoints, written by
trainers that pass no mapping (``WxferTrainerInitInfo(mapping=None)``): the plan comes from the map
each worker traces from vLLM's own load_weights.  After each of two pushes vLLM's greedy tokens
equal transformers' greedy decode of the trainer's weights.  OLMo2 is an architecture no line of
wxfer names; Phi-3's checkpoint holds fused qkv_proj / gate_up_proj; Gemma 2 ties its embeddings.
TP1 (vLLM's CPU platform runs TP>1 only with its multiprocess executor, which this in-process
harness does not start; the TP2 layout is covered by test_trace.py)."""

import gc
import os
import sys
import time

import pytest

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from test_llm import NEW, ROOT, Trainers, tokens, ulp_bf16, worker_engine  # noqa: E402
from vhelp import release  # noqa: E402

ARCHS = ["qwen3", "llama", "mistral", "qwen2", "gemma2", "phi3", "olmo2"]
# Llama with a vocabulary of 480: vLLM pads the embedding and head to 512 rows, set to zero at
# load; the plan writes the 480 rows the checkpoint fills (the traced map's window)
EXTRA = {"llama": dict(vocab_size=480)}
TIMES = {}


def engine(path):
    import wxfer.integrations.vllm as wv

    assert wv.register() and wv.keep_cpu_weights()

    from vhelp import wxfer_llm

    llm = wxfer_llm(path)
    return llm


def agree(got, hf) -> int:
    """How many leading greedy tokens of vLLM equal transformers' (hf: [(token, runner-up, margin,
    top logit)]): every one must, until a near tie (the two best logits within 2 BF16 ulps, where
    vLLM's CPU kernels and transformers' round differently and the sequences may part)."""
    for i, (tok, _, margin, top) in enumerate(hf):
        if got[i] != tok:
            assert margin <= 2 * ulp_bf16(top), f"step {i}: vLLM {got[i]} != transformers {tok}: {got} vs {hf}"
            return i
    return len(hf)


class Serving(Trainers):
    """One trainer process (trainer_proc.py "serve") for every architecture's job in turn: the
    imports of torch, transformers and vLLM paid once."""

    def __init__(self):
        import subprocess
        from multiprocessing.connection import Listener

        self.listener = Listener(("127.0.0.1", 0), authkey=b"wxfer-test")
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + HERE)
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        args = ["-", "-", "-", "serve", "0", "1", "0", str(self.listener.address[1])]
        self.procs = [
            subprocess.Popen(
                [sys.executable, os.path.join(HERE, "trainer_proc.py")] + args,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        ]
        self.conn = None  # accepted at the first job: its imports overlap the first engine's start

    prefix = "reach"  # the jobs' names: PREFIX<port>

    def job(self, llm, ckpt, *extra):
        """The next job (`extra`: what trainer_proc.py's job takes past its name) for `llm`."""
        from wxfer.integrations.vllm import LLMClient
        from wxfer.runtime.control import free_port

        if self.conn is None:
            self.conn = self._accept(180)
        self.llm, self.client, self.rpc_errors = llm, LLMClient(llm), []
        port = free_port()
        self.conn.send(("job", ckpt, "127.0.0.1:%d" % port, "%s%d" % (self.prefix, port), *extra))

    def quit(self):
        """The serving process told to exit (unless it is gone already), then waited for."""
        try:
            if self.conn is not None:
                self.conn.send(("quit",))
        except OSError:
            pass
        self.close()


@pytest.fixture(scope="module")
def trainer():
    tr = Serving()
    yield tr
    tr.quit()


@pytest.mark.parametrize("arch", ARCHS)
def test_two_pushes_by_the_traced_map_give_transformers_tokens(tmp_path, trainer, arch):
    from trace_proc import save_tiny

    t0 = time.monotonic()
    ck = str(tmp_path / arch)
    save_tiny(ck, arch, **EXTRA.get(arch, {}))
    llm = engine(ck)
    try:
        first = tokens(llm)
        seen = []
        trainer.job(llm, ck)
        kind, msg = trainer.serve(lambda v, hf: seen.append((v, tokens(llm), hf, llm.get_weight_version())))
        assert kind == "done", (kind, msg)
        assert [s[0] for s in seen] == [1, 2]
        for v, got, hf, version in seen:
            assert agree(got, hf) >= NEW // 2, f"{arch} version {v}: vLLM {got} != transformers {hf}"
            assert version == str(v)
        assert seen[0][1] != first or seen[1][1] != first
        eng = worker_engine(llm)
        assert eng.traced_map is not None and not eng.traced_map.problems
        assert eng.receiver.version() == 2
        # the post-processing proof on the traced map: with keep_cpu_weights() every parameter
        # the map writes is direct (its live storage registered), nothing finalize or refused
        cls = eng.proof_result["classes"]
        assert cls["finalize"] == {} and cls["refused"] == [] and eng.finalizers == [], cls
        assert cls["direct"] == len(eng.receiver.params), (cls, sorted(eng.receiver.params))
        if arch in EXTRA:
            assert eng.traced_map.window("model.embed_tokens.weight") == (0, 480 * 256)
            assert eng.receiver.params["lm_head.weight"].shape == (480, 256)
        TIMES[arch] = (llm.wxfer_start_s, eng.traced_map.seconds, time.monotonic() - t0)
        print(
            f"{arch}: engine start {llm.wxfer_start_s:.1f} s, trace {eng.traced_map.seconds:.3f} s, "
            f"proof {eng.proof_result['seconds']:.3f} s, test {time.monotonic() - t0:.1f} s"
        )
    finally:
        release(llm)
        # no reference may outlive this test (a failure's traceback keeps this frame): a vLLM
        # engine collected later tears down the distributed state the next engine runs in
        trainer.llm = trainer.client = llm = None
        gc.collect()
