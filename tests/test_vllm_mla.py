"""wxfer.integrations.vllm.mla without vLLM: the draft-model decision from a config's fields, the
view test that tells a BF16 kv_b_proj's derived copies (views) from FP8's (new tensors), and that
a model without vLLM's MLA layers gets no finalizer.  The checks against vLLM itself are in
tests/on_vllm/test_mla.py."""

from types import SimpleNamespace as NS

import torch

from wxfer.integrations.vllm.mla import _inside, draft_refusal, mla_finalizers, mla_refusals


def _vc(method=None, draft=True, layers=61, nextn=1):
    target = NS(hf_config=NS(num_hidden_layers=layers, num_nextn_predict_layers=nextn))
    if method is None:
        return NS(speculative_config=None, model_config=target)
    dm = NS(hf_config=NS(architectures=["DeepSeekMTPModel"])) if draft else None
    return NS(
        speculative_config=NS(method=method, draft_model_config=dm, num_speculative_tokens=1), model_config=target
    )


def test_draft_refusal_names_the_mtp_layers():
    why = draft_refusal(_vc("mtp"))
    assert "'mtp'" in why and "DeepSeekMTPModel" in why and "model.layers.61.*" in why
    assert "model.layers.62" not in why
    two = draft_refusal(_vc("mtp", nextn=2))
    assert "model.layers.61.*, model.layers.62.*" in two


def test_no_draft_weights_no_refusal():
    assert draft_refusal(_vc()) is None  # no speculative decoding
    assert draft_refusal(_vc("ngram", draft=False)) is None  # a method without a draft model
    assert draft_refusal(NS()) is None


def test_views_of_the_weight_are_told_from_copies():
    w = torch.randn(8 * 6, 16, dtype=torch.bfloat16)  # kv_b_proj [N*(P+V), L]
    uk, uv = w.T.view(16, 8, 6).split([4, 2], dim=-1)  # what vLLM's split makes of it
    assert _inside(uv.transpose(0, 1), w) and _inside(uk.permute(1, 2, 0), w)
    assert not _inside(uv.transpose(0, 1).contiguous(), w)  # a copy (the FP8 path's new tensors)
    assert not _inside(torch.randn(3), w) and not _inside(w[:0], w)


def test_a_model_without_mla_has_nothing_to_finalize():
    m = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert mla_finalizers(m) == [] and mla_refusals(m) == []


def test_derived_copies_on_an_unknown_module_are_refused_by_what_it_holds():
    """A module that holds W_UV / W_UK_T (itself or on its impl) without being vLLM 0.32's
    MLAAttention (here: no vLLM at all) is refused by name, and mla_finalizers raises."""
    m = torch.nn.Module()
    m.add_module("attn", torch.nn.Module())
    m.attn.impl = torch.nn.Module()
    m.attn.impl.W_UV = torch.zeros(2, 4, 3)
    (why,) = mla_refusals(m)
    assert why.startswith("attn: Module.impl holds MLA's derived W_UV / W_UK_T"), why
    try:
        mla_finalizers(m)
    except ValueError as e:
        assert "attn: Module.impl" in str(e)
    else:
        raise AssertionError("mla_finalizers accepted an unknown MLA module")
