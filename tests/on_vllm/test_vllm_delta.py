"""Delta pushes (issue 36, docs/delta.md) through the vLLM backend, on a real offline vllm.LLM
(CPU, in this process) with vLLM's CPU GEMMs as shipped: every linear layer, the embedding and
the head are finalize (their loader-layout memory kept, registered and re-packed in
finish_weight_update), the norms direct; BF16, and FP8 block (the linear layers float8 with
block scales; only where the CPU has AMX, which vLLM 0.32's CPU FP8 linear needs: never run on
this VM, which has none).  Two trainer ranks (delta_proc.py) push with
``WxferTrainerInitInfo(delta={"link_Bps": 125e6, "measure_link": False}, delta_staging="1MiB")``:

- round 1 (the seeded weights) is dense by rule (``first``); rounds 2 and 3 (1% of every
  parameter's elements moved) send records, which each worker applies in finish_weight_update
  before the finalizers (``update_report["apply_s"]``, ``["apply"]``);
- after each committed round every tensor of the engine's model (the kept memory, the packed
  GEMM weights, the norms) equals what vLLM's own first load makes of the trainer's weights, and
  vLLM's greedy tokens equal transformers' (up to a BF16 near tie, test_llm.same_greedy);
- round 4 is pushed with the Sender alone (finish_weight_update never runs: its records are never
  applied); round 5's finish_weight_update fails naming the missed records and the resync, and
  vLLM keeps weight version 3; round 6 goes dense to the worker (``not_in_step``) and commits,
  its bytes again vLLM's own load's.
"""

import os
import sys

import pytest

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from test_llm import same_greedy, served, tokens, worker_engine  # noqa: E402
from trainer_proc import NEW  # noqa: E402


LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _fp8_linear(name: str) -> bool:
    """The checkpoint tensors an FP8 block checkpoint of vLLM's Qwen3 stores as float8 + _scale_inv."""
    return name.rsplit(".", 2)[-2] in LINEAR and name.endswith(".weight")


def _amx() -> bool:
    try:
        return "amx_tile" in open("/proc/cpuinfo").read()
    except OSError:
        return False


def fp8_checkpoint_dir(path):
    """The checkpoint at `path` (BF16 weights, an FP8 quantization_config) rewritten as the FP8
    block checkpoint vLLM loads: the linear weights float8_e4m3fn with ``_scale_inv`` (wxfer's
    reference quantizer, the one the layout proof uses), the others as they are."""
    from safetensors.torch import load_file, save_file

    from wxfer.integrations.vllm.layout import fp8_checkpoint

    f = os.path.join(path, "model.safetensors")
    save_file(dict(fp8_checkpoint(load_file(f), _fp8_linear)), f, metadata={"format": "pt"})


@pytest.fixture(scope="module", params=["bf16", "fp8"])
def llm(request, tmp_path_factory):
    from vhelp import release, save_checkpoint, wxfer_llm

    fp8 = request.param == "fp8"
    if fp8 and not _amx():
        pytest.skip("vLLM 0.32's CPU FP8 block linear needs AMX (Sapphire Rapids or newer); this CPU has none")

    import vllm.model_executor.layers.utils as U
    import wxfer.integrations.vllm as wv

    assert wv.register()
    patched = U.dispatch_cpu_unquantized_gemm  # vLLM's CPU GEMM as shipped (keep_cpu_weights undone)
    U.dispatch_cpu_unquantized_gemm = getattr(patched, "_wxfer_original", patched)
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()  # an engine of an earlier module in this process
    ck = str(tmp_path_factory.mktemp("ckpt_delta"))
    save_checkpoint(ck, seed=0, fp8=fp8, **(dict(head_dim=128) if fp8 else {}))
    if fp8:
        fp8_checkpoint_dir(ck)
    engine = wxfer_llm(ck)
    engine.wxfer_fp8 = fp8
    yield engine
    release(engine)
    U.dispatch_cpu_unquantized_gemm = patched


def _gemm(mod, k: int):
    """A linear layer's output through vLLM's CPU GEMM dispatch (``cpu_linear``: a oneDNN handle
    over a packed copy of the weight, which no tensor of the module shows) for fixed inputs."""
    import torch

    x = torch.randn(3, k, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16)
    return mod.cpu_linear(x, mod.weight, getattr(mod, "bias", None))


def assert_every_tensor_is_vllms_own_load(llm, weights):
    """vLLM's own first load of `weights` (name -> the BF16 bits as int16 arrays): a fresh model,
    its load_weights, then process_weights_after_loading.  What the Receiver registered (the kept
    loader-layout memory of the finalize modules, the norms' live storage) equals the loaded
    bytes before post-processing; every parameter, buffer and derived tensor of the engine's model
    equals the reference's after it, and so does every linear layer's packed GEMM (its output)."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from wxfer.integrations.vllm.layout import fp8_checkpoint
    from wxfer.integrations.vllm.postproc import _fresh_model, _state

    eng = worker_engine(llm)
    ref = _fresh_model(eng.vllm_config, "cpu")
    with set_current_vllm_config(eng.vllm_config), torch.no_grad():
        ckpt = {n: torch.from_numpy(a).view(torch.bfloat16) for n, a in weights.items()}
        ref.load_weights(iter(fp8_checkpoint(ckpt, _fp8_linear) if llm.wxfer_fp8 else ckpt.items()))
        loaded = dict(ref.named_parameters())
        bits = lambda t: t.detach().contiguous().view(-1).view(torch.uint8)  # noqa: E731 (float8 too)
        written = [n for n, t in eng.receiver.params.items() if not torch.equal(bits(t), bits(loaded[n]))]
        # 19 tensors (BF16); FP8: the 8 linear layers' weight_scale_inv too
        assert not written and len(eng.receiver.params) == 19 + 8 * llm.wxfer_fp8, written
        process_weights_after_loading(ref, eng.vllm_config.model_config, torch.device("cpu"))
    mods = dict(ref.named_modules())
    live, want = _state(dict(eng.model.named_modules()), {}), _state(mods, {})
    differ = [(m, n) for m in want for n in want[m] if live.get(m, {}).get(n) != want[m][n]]
    assert not differ, differ[:8]
    gemms = [m for m, mod in mods.items() if hasattr(mod, "cpu_linear") and m + ".weight" in loaded]
    assert len(gemms) >= (1 if llm.wxfer_fp8 else 8), gemms  # qkv, o, gate_up, down of both layers, the head
    with torch.no_grad():
        k = {m: loaded[m + ".weight"].shape[-1] for m in gemms}
        differ = [m for m in gemms if not torch.equal(_gemm(eng.model.get_submodule(m), k[m]), _gemm(mods[m], k[m]))]
    assert not differ, differ


def test_delta_pushes_through_finalize_equal_vllms_own_load(llm):
    seen = {}

    def on_pushed(rnd, out):
        eng = worker_engine(llm)
        out.update(version=llm.get_weight_version(), report=dict(eng.update_report or {}))
        if out["error"] is None:
            assert_every_tensor_is_vllms_own_load(llm, out.pop("weights"))
            out["vllm_tokens"] = tokens(llm)
        if rnd == 6:  # the last round: the worker's Receiver closed while the trainers' store is up
            out.update(classes=eng.proof_result["classes"], recv=eng.receiver.stats())
            llm.shutdown_weight_transfer_engine()
        seen[rnd] = out

    served(llm, "delta", on_pushed, world=2, script="delta_proc.py")
    assert sorted(seen) == [1, 2, 3, 5, 6], sorted(seen)
    first = seen[1]["delta"]
    assert first["tasks_delta"] == 0 and first["dense_why"].get("first", 0) == first["tasks_dense"] > 0, first
    for rnd in (2, 3):
        d, rep = seen[rnd]["delta"], seen[rnd]["report"]
        assert (
            d["tasks_delta"] > 0 and d["record_bytes"] > 0 and d["sent_bytes"] < d["delta_bytes"] + d["dense_bytes"]
        ), d
        assert rep["version"] == rnd and rep["apply"]["records"] > 0 and rep["apply"]["changed"] > 0, rep
        assert rep["apply_s"] > 0 and rep["finish_s"] >= rep["apply_s"] + rep["finalize_s"], rep
    # round 4's records never applied: round 5 fails on the worker, vLLM keeps version 3
    err = seen[5]["error"]
    assert err and "delta records cannot be applied" in err and "step 4" in err and "dense" in err, err
    assert seen[5]["version"] == "3" and seen[5]["report"]["version"] == 3
    d6 = seen[6]["delta"]
    assert d6["tasks_delta"] == 0 and d6["dense_why"].get("not_in_step", 0) > 0, d6
    assert seen[6]["version"] == "6" and seen[6]["report"]["version"] == 6
    for rnd in (1, 2, 3, 6):
        got, hf = seen[rnd]["vllm_tokens"], seen[rnd]["tokens"]
        assert same_greedy(got, hf) >= NEW // 2, f"round {rnd}: vLLM {got} != transformers {hf}"
    classes = seen[6]["classes"]
    assert "model.layers.0.self_attn.qkv_proj" in classes["finalize"] and classes["direct"] > 0, classes
    assert seen[6]["recv"]["delta"]["total"]["records"] > 0, seen[6]["recv"]
    sent = [
        f"{r}: {seen[r]['delta']['sent_bytes']}/{seen[r]['delta']['delta_bytes'] + seen[r]['delta']['dense_bytes']}"
        for r in (1, 2, 3, 6)
    ]
    applied = [f"{seen[r]['report']['apply_s']:.4f}" for r in (2, 3)]
    print(f"\nbytes sent/dense per round {', '.join(sent)}; apply_s of rounds 2, 3: {', '.join(applied)}")
