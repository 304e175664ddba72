"""MLA (DeepSeek-V3 / Kimi-K2) against vLLM's own post-processing, on vLLM 0.32's CPU platform.

A tiny DeepSeek-V3 config with its MTP layer (``num_nextn_predict_layers=1``); vLLM's own
``DeepseekV3ForCausalLM`` and its MTP draft ``DeepSeekMTP`` built without an engine, loaded with
seeded checkpoint tensors through vLLM's ``load_weights`` + ``process_weights_after_loading``.
Then new seeded ``kv_b_proj`` bytes (and ``weight_scale_inv`` for FP8) are written raw into the
parameters, as a one-sided write lands, the MLA finalizers run, and every parameter, buffer and
MLA tensor attribute of the model must equal, bit for bit, a second model loaded fresh from the
new checkpoint.

What is patched: nothing for attention. vLLM 0.32's CPU platform picks its reference ``CPU_MLA``
backend on this VM (no AMX; the ``NotImplementedError("MLA is not supported on CPU.")`` the
issue quotes is not in 0.32's ``platforms/cpu.py``), and attention is never run. For the FP8
cases only: vLLM builds no block-FP8 linear on a CPU without AMX (``ValueError: Failed to find a
kernel that can implement the ScaledMM linear layer ... CPUFp8BlockScaledMMKernel requires AMX
tile support``, raised from ``Fp8LinearMethod.create_weights``), so
``mla_proc.fp8_kernel_patch`` makes that kernel's hardware check pass; only ``kv_b_proj`` is FP8
(``ignored_layers``), and for it the kernel's post-processing returns at once and its GEMM never
runs.

All cases run in one child process (``mla_proc.py``: vLLM's import and model builds dominate)."""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


@pytest.fixture(scope="module")
def rep(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("mla"))
    out = os.path.join(tmp, "out.json")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + HERE)
    p = subprocess.run(
        [sys.executable, os.path.join(HERE, "mla_proc.py"), out, tmp],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=400,
    )
    assert p.returncode == 0, p.stdout[-4000:]
    with open(out) as f:
        return json.load(f)


def _derived(case):
    return sorted(n for f in case["finalizers"] for n in f["derives"])


def test_cpu_builds_mla_with_vllm_own_backend(rep):
    """No backend patch: the CPU platform chose CPU_MLA for every MLA layer (target and draft)."""
    assert rep["amx"] is False  # on an AMX host vLLM picks AMX_MLA, which mla_refusals names
    for k in ("bf16", "mtp", "fp8", "fp8_mtp"):
        assert rep[k]["backends"] == ["CPUMLAImpl"], (k, rep[k]["backends"])
        assert rep[k]["refusals"] == [], rep[k]["refusals"]
    assert rep["bf16"]["model"] == "DeepseekV3ForCausalLM" and rep["mtp"]["model"] == "DeepSeekMTP"
    assert len(rep["bf16"]["finalizers"]) == 2 and len(rep["mtp"]["finalizers"]) == 1


def test_fp8_kv_b_proj_finalize_equals_fresh_load(rep):
    """FP8 block kv_b_proj: the write alone leaves exactly W_UV / W_UK_T of every layer stale; after
    the finalizers the whole model equals a fresh load of the new bytes, and no parameter moved."""
    for k in ("fp8", "fp8_mtp"):
        c = rep[k]
        assert c["kv_quant"] == ["Fp8LinearMethod"]
        assert c["stale"] == _derived(c) and c["stale"], (k, c["stale"])
        assert c["after"] == [] and c["forced"] == [], (k, c["after"], c["forced"])
        assert c["moved"] == []
        for f in c["finalizers"]:
            assert [r.rsplit(".", 1)[1] for r in f["reads"]] == ["weight", "weight_scale_inv"]
            assert f["reads"][0].endswith("self_attn.kv_b_proj.weight")
            assert not f["aliased"] and f["derived_bytes"] == 2 * 4 * 512 * 64 * 2  # (N,L,V) + (N,P,L) BF16


def test_bf16_derived_weights_are_views_of_kv_b_proj(rep):
    """BF16 kv_b_proj: vLLM's W_UV / W_UK_T are views of the weight, so the write alone already
    equals a fresh load (nothing to run); re-running vLLM's derivation anyway changes nothing."""
    for k in ("bf16", "mtp"):
        c = rep[k]
        assert c["kv_quant"] == ["UnquantizedLinearMethod"]
        assert all(f["aliased"] and f["derived_bytes"] == 0 for f in c["finalizers"])
        assert c["stale"] == [] and c["after"] == [] and c["forced"] == [] and c["moved"] == []
        assert [f["reads"] for f in c["finalizers"]][0][0].endswith("kv_b_proj.weight")


def test_mtp_draft_is_refused_by_name(rep):
    """The MTP draft (its own layer model.layers.2.*) is refused by name; no draft, no refusal."""
    why = rep["mtp"]["draft_refusal"]
    assert why and "'mtp'" in why and "DeepSeekMTPModel" in why and "model.layers.2.*" in why, why
    assert rep["bf16"]["draft_refusal"] is None and rep["plain"]["draft_refusal"] is None


def test_finalizer_hook_for_the_finalize_mechanism(rep):
    """mla_hook answers for exactly the MLA modules, with no kept memory, late (after kv_b_proj)."""
    for k in ("fp8", "fp8_mtp", "bf16"):
        want = [f["name"] for f in rep[k]["finalizers"]]
        got = rep[k]["hooked"]
        assert [h["name"] for h in got] == want and want, (k, got)
        assert all(h["params"] == [] and h["late"] and h["run"] for h in got)


def test_an_impl_with_its_own_post_processing_is_refused(rep):
    """vLLM's AMXMLAImpl (it packs its own W_UK / W_UV) planted in the first layer: refused by the
    override of process_weights_after_loading, naming the module; the others stay covered."""
    (why,) = rep["fp8"]["planted_amx"]
    assert why.startswith("model.layers.0.self_attn.mla_attn.mla_attn: attention impl AMXMLAImpl"), why


def test_own_derivation_equals_vllm(rep):
    """wxfer's mla.derive (the trainer-side alternative, and the GPU timing's ops) gives vLLM's W_UV /
    W_UK_T bit for bit, BF16 and FP8 block, target and MTP layers."""
    for k in ("bf16", "mtp", "fp8", "fp8_mtp"):
        assert rep[k]["derive_equal"] and all(rep[k]["derive_equal"]), (k, rep[k]["derive_equal"])


@pytest.fixture(scope="module")
def rep_tp2(tmp_path_factory):
    from wxfer.runtime.control import free_port

    tmp = str(tmp_path_factory.mktemp("mla_tp2"))
    port = free_port()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + HERE)
    procs = []
    for r in range(2):
        d = os.path.join(tmp, "r%d" % r)
        os.makedirs(d)
        cmd = [
            sys.executable,
            os.path.join(HERE, "mla_proc.py"),
            os.path.join(d, "out.json"),
            d,
            "2",
            str(r),
            str(port),
        ]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        outs = [p.communicate(timeout=400)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r}:\n" + outs[r][-4000:]
    reps = []
    for r in range(2):
        with open(os.path.join(tmp, "r%d" % r, "out.json")) as f:
            reps.append(json.load(f))
    return reps


def test_tp2_each_rank_finalizes_its_heads(rep_tp2):
    """TP2 (two processes, gloo): each rank's kv_b_proj holds its 2 of the 4 heads (rows and scale
    block rows of the new checkpoint written raw); after its finalizers each rank equals its own
    fresh load bit for bit, FP8 (stale before) and BF16 (views); no collective in the finalize."""
    for rep in rep_tp2:
        fp8, bf16 = rep["fp8"], rep["bf16"]
        assert fp8["stale"] == _derived(fp8) and fp8["stale"], fp8["stale"]
        assert fp8["after"] == [] and fp8["forced"] == [] and fp8["moved"] == [], rep["rank"]
        assert all(f["derived_bytes"] == 2 * 2 * 512 * 64 * 2 for f in fp8["finalizers"])  # 2 heads a rank
        assert all(fp8["derive_equal"]) and all(bf16["derive_equal"])
        assert bf16["stale"] == [] and bf16["after"] == [] and all(f["aliased"] for f in bf16["finalizers"])
