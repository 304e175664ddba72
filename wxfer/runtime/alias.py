"""Receiver parameters that share bytes (issue 25.3).

Two names over one tensor's memory (tied weights listed twice, two views of one storage)
would each be a destination of the plan: the trainers would write both there, and one of
them would hold the other's bytes under a complete version.  At Receiver setup:

- a tie the mapping knows (its config says ``tie_word_embeddings``: ``lm_head.weight`` is
  ``model.embed_tokens.weight``, as vLLM builds it, ``self.lm_head = model.embed_tokens``)
  is written once: the name the trainers do not send (``lm_head.weight``: transformers'
  tied model has only the embedding) is left out of what the receiver publishes;
- any other overlap is refused, naming both parameters and the bytes they share.
"""

from __future__ import annotations

# (kept, left out) pairs a mapping's config can declare tied
_TIES = {"tie_word_embeddings": ("model.embed_tokens.weight", "lm_head.weight")}


def known_ties(mapping) -> list[tuple[str, str]]:
    """The (kept, left out) name pairs `mapping` (a Preset, a built-in preset's name or an
    HF config dict) declares tied; [] when it declares none or cannot be resolved here."""
    from . import program

    if mapping is None or mapping == "":
        return []
    try:
        config = dict(program.get_preset(mapping).config or {})
    except (ValueError, TypeError, KeyError):
        return []
    return [pair for key, pair in _TIES.items() if config.get(key)]


def _span(t) -> tuple:
    return (str(t.device), t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())


def overlaps(params: dict) -> list[tuple[str, str, int, int]]:
    """(a, b, first shared byte of a, shared bytes) for every pair of parameters whose
    memory overlaps (same device, overlapping address ranges); 0-byte ones never overlap."""
    spans = sorted((_span(t), n) for n, t in params.items() if t.numel())
    out = []
    for i, ((dev, lo, hi), a) in enumerate(spans):
        for (dev2, lo2, hi2), b in spans[i + 1 :]:
            if dev2 != dev or lo2 >= hi:
                break
            out.append((a, b, lo2 - lo, min(hi, hi2) - lo2))
    return out


def resolve(params: dict, mapping) -> tuple[dict, dict]:
    """(the parameters to publish, {left-out name: the name it is tied to}); ValueError
    naming both parameters of the first overlap that is no known tie."""
    ties = {frozenset(p): p for p in known_ties(mapping)}
    tied: dict[str, str] = {}
    for a, b, off, n in overlaps(params):
        pair = ties.get(frozenset((a, b)))
        ta, tb = params[a], params[b]
        same = ta.data_ptr() == tb.data_ptr() and ta.shape == tb.shape and ta.dtype == tb.dtype
        if pair is not None and same:
            tied[pair[1]] = pair[0]
            continue
        raise ValueError(
            f"wxfer.Receiver: parameters {a} and {b} share memory ({n} bytes from byte {off} of {a}: "
            f"tied weights or two views of one storage); the trainers would write both there. Pass "
            f"one of them"
            + ("" if pair is None else " (they are tied in the mapping, but not as one whole tensor)")
            + (f"; ties the mapping declares: {sorted(known_ties(mapping))}" if ties else "")
        )
    return {k: v for k, v in params.items() if k not in tied}, tied
