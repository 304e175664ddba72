"""Issue 25.4 and 25.3: what the receivers expect is compared, not only named.

- receivers publish the digest of their mapping's rules; trainers given a Preset of the
  same name but gate and up swapped are refused at setup naming the rule (they used to
  pass, and gate and up arrived swapped under a complete version);
- two parameter names over one tensor's bytes (tied weights, two views of one storage)
  are written once where the mapping knows the tie, and otherwise refused by name.

Sender and receivers in one process (threads), fabric tcp."""

import dataclasses

import pytest
import torch

from wxfer import _wxfer
from wxfer.mapping import Preset
from wxfer.mapping.rules import Fuse
from wxfer.models import TINY, inference_params, preset_for, train_model
from wxfer.runtime import digest
from wxfer.runtime.control import SetupError
from wxfer.runtime.receiver import Receiver
from wxfer.testing import in_thread
from helpers import frozen_model, joined  # tests/helpers.py

FABRIC = _wxfer.backends()["fabric"][0]
pytestmark = pytest.mark.skipif(not FABRIC, reason="fabric transport not built")
T = 30.0
GATE_UP = "model.layers.{L}.mlp.gate_up_proj.weight"


def _swapped(preset: Preset) -> Preset:
    """The same name and config, gate and up swapped in the gate_up rule."""
    rules = [
        dataclasses.replace(r, srcs=tuple(reversed(r.srcs))) if r.dst.endswith("mlp.gate_up_proj.weight") else r
        for r in preset.rules
    ]
    assert rules != preset.rules
    return dataclasses.replace(preset, rules=rules)


def test_rule_digests_name_the_first_differing_rule():
    tiny = preset_for(TINY)
    good = digest.mapping_rules(tiny)
    assert good["name"] == tiny.name and len(good["rules"]) > 5
    assert digest.compare_rules(dict(gpu=3, rules=good), digest.mapping_rules(tiny)) is None
    same_name = digest.mapping_rules(_swapped(tiny))
    msg = digest.compare_rules(dict(gpu=3, rules=good), same_name)
    i = next(i for i, (a, b) in enumerate(zip(good["rules"], same_name["rules"])) if a != b)
    assert msg.startswith(f"inference worker gpu 3 (mapping {tiny.name!r}) expects other rules than the trainers'")
    assert f"rule {i} is Fuse(dst='{GATE_UP}', srcs=('model.layers.{{L}}.mlp.gate_proj.weight'" in msg
    assert "srcs=('model.layers.{L}.mlp.up_proj.weight', 'model.layers.{L}.mlp.gate_proj.weight')" in msg
    shorter = dict(good, rules=good["rules"][:-1])
    assert "is only on the trainers" in digest.compare_rules(dict(gpu=0, rules=shorter), good)
    assert digest.mapping_rules("a-custom-mapping") is None and digest.mapping_rules(None) is None
    # another rank or TP size of the same rules: other content
    assert digest.mapping_rules(tiny, tp=2, rank=1) != digest.mapping_rules(tiny, tp=2, rank=0)


class _Masked(Fuse):
    """A Fuse whose repr hides its sources (shows those of `shown`)."""

    def __repr__(self):
        shown = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return repr(Fuse(**dict(shown, srcs=tuple(reversed(self.srcs)))))


def test_rules_with_the_same_repr_but_other_content_differ():
    """Issue 35.6: the digest is of what the rules expand to, not of their repr."""
    tiny = preset_for(TINY)
    masked = [
        _Masked(**{f.name: getattr(r, f.name) for f in dataclasses.fields(r)}) if r.dst == GATE_UP else r
        for r in _swapped(tiny).rules
    ]
    assert [digest.rule_text(r) for r in masked] == [digest.rule_text(r) for r in tiny.rules]  # equal reprs
    theirs = digest.mapping_rules(dataclasses.replace(tiny, rules=masked))
    msg = digest.compare_rules(dict(gpu=1, rules=digest.mapping_rules(tiny)), theirs)
    assert msg is not None and GATE_UP in msg and "what they expand to differs" in msg, msg
    assert digest.of({"a": (1, 2), "b": None}) == digest.of({"b": None, "a": [1, 2]})  # canonical content
    assert digest.of([1, 2]) != digest.of([2, 1])


def test_a_receiver_without_rules_is_still_checked_by_its_parameters():
    """Issue 35.6: a receiver that knows no rules (a custom mapping's name) publishes the digest
    of its parameters; the trainers compare it with what their mapping makes for its rank."""
    params = {n: [list(t.shape), str(t.dtype).replace("torch.", "")] for n, t in inference_params(TINY, 1, 0).items()}
    made = {n: (tuple(s), d) for n, (s, d) in params.items()}
    w = dict(gpu=2, params=params, params_digest=digest.of(digest.params_content(params)), rules=None)
    assert digest.compare_params(w, made) is None
    name = sorted(made)[3]
    other = dict(made, **{name: (made[name][0], "float16")})
    msg = digest.compare_params(w, other)
    assert msg is not None and "inference worker gpu 2 holds other parameters" in msg and name in msg, msg
    # a record whose parameters and digest disagree is refused too (not skipped)
    forged = dict(w, params_digest=digest.of([]))
    assert "do not match its own digest" in digest.compare_params(forged, made)


def test_trainers_with_the_same_name_but_swapped_rules_are_refused(store):
    from wxfer.runtime.sender import Sender

    _, addr = store
    params = inference_params(TINY, 1, 0)
    before = {n: t.clone() for n, t in params.items()}
    th = in_thread(Receiver, params, mapping=preset_for(TINY), store=addr, name="swap", timeout=T)
    with pytest.raises(SetupError, match=f"(?s)inference workers disagree:.*gpu 0 .*expects other rules.*{GATE_UP}"):
        Sender(frozen_model(TINY, seed=0), mapping=_swapped(preset_for(TINY)), store=addr, name="swap", timeout=T)
    th[0].join(T)
    assert isinstance(th[1].get("error"), SetupError) and "expects other rules" in str(th[1]["error"])
    assert all(torch.equal(before[n].view(torch.uint8), params[n].view(torch.uint8)) for n in params)  # untouched


def test_the_same_rules_pass_and_arrive_in_place(store):
    from wxfer.runtime.sender import Sender
    from helpers import expected_shards  # tests/helpers.py

    _, addr = store
    params = inference_params(TINY, 1, 0)
    th = in_thread(Receiver, params, mapping=preset_for(TINY), store=addr, name="same", timeout=T)
    model = frozen_model(TINY, seed=0)
    sender = Sender(model, mapping=preset_for(TINY), store=addr, name="same", timeout=T)
    (recv,) = joined([th], T)
    sender.push()
    assert recv.version() == 1
    for _, dst, off, b in expected_shards(model, TINY):
        assert torch.equal(params[dst].view(-1).view(torch.uint8)[off : off + b.numel()], b), dst
    sender.close()
    recv.close()


TIED = dict(TINY, tie_word_embeddings=True)


def test_tied_embeddings_of_transformers_qwen3_are_written_once(store):
    """transformers' Qwen3ForCausalLM with tie_word_embeddings=True has one parameter,
    model.embed_tokens.weight (lm_head.weight is the same tensor; named_parameters() lists
    it once), and so does vLLM's (self.lm_head = self.model.embed_tokens).  A receiver that
    lists both names over that one tensor is written once, through the embedding."""
    from wxfer.runtime.sender import Sender
    from helpers import expected_shards  # tests/helpers.py

    _, addr = store
    model = train_model(TIED)
    for p in model.parameters():
        p.requires_grad_(False)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert "lm_head.weight" not in dict(model.named_parameters())
    params = inference_params(TIED, 1, 0)
    assert "lm_head.weight" not in params  # the mapping's own layout of the tied model
    params["lm_head.weight"] = params["model.embed_tokens.weight"]  # named_parameters(remove_duplicate=False)
    th = in_thread(Receiver, params, mapping=preset_for(TIED), store=addr, name="tied", timeout=T)
    sender = Sender(model, mapping=preset_for(TIED), store=addr, name="tied", timeout=T)
    (recv,) = joined([th], T)
    assert recv.stats()["tied"] == {"lm_head.weight": "model.embed_tokens.weight"}
    sender.push()
    assert recv.version() == 1
    for _, dst, off, b in expected_shards(model, TIED):
        assert torch.equal(params[dst].view(-1).view(torch.uint8)[off : off + b.numel()], b), dst
    assert torch.equal(params["lm_head.weight"], model.lm_head.weight.to(torch.bfloat16))
    sender.close()
    recv.close()


def test_two_views_of_one_storage_are_refused_by_name():
    """Two names over the same bytes (or part of them), with no tie the mapping knows: refused
    at Receiver setup naming both (they were accepted, and version() read complete while one
    held the other's bytes)."""
    q, k = "model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight"
    params = inference_params(TINY, 1, 0)
    buf = torch.zeros(128 + 64, dtype=torch.bfloat16)
    for a, b, shared in ((buf[:128], buf[:128], 256), (buf[:128], buf[64:], 128)):
        bad = dict(params, **{q: a, k: b})
        first, second = sorted((q, k), key=lambda n: (bad[n].data_ptr(), n))
        with pytest.raises(ValueError, match=f"parameters {first} and {second} share memory \\({shared} bytes"):
            Receiver(bad, mapping=preset_for(TINY), store="127.0.0.1:1", timeout=1)
    # embed_tokens and lm_head over one tensor, with a mapping that does not tie them
    untied = dict(params, **{"lm_head.weight": params["model.embed_tokens.weight"]})
    with pytest.raises(ValueError, match="parameters lm_head.weight and model.embed_tokens.weight share memory"):
        Receiver(untied, mapping=preset_for(TINY), store="127.0.0.1:1", timeout=1)
    # the tie declared, but lm_head only a part of the embedding: refused too
    tparams = inference_params(TIED, 1, 0)
    half = dict(tparams, **{"lm_head.weight": tparams["model.embed_tokens.weight"][:256]})
    with pytest.raises(ValueError, match="tied in the mapping, but not as one whole tensor"):
        Receiver(half, mapping=preset_for(TIED), store="127.0.0.1:1", timeout=1)
