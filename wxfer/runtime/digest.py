"""What a receiver says its layout is, and the trainers' check of it (issues 25.4, 35.6).

A receiver used to publish only its mapping's *name*, then the ``repr`` of its rules, so
trainers given a Preset of the same name but other rules passed setup when the reprs
agreed, and a receiver that knew no rules (a custom mapping known to the trainers alone)
was not checked at all.  Now every receiver publishes digests of *content*, never of a
repr, and the trainers compare every one of them:

- ``params``: its parameters with bytes (names, shapes, dtypes), always; the trainers
  compare it with what their mapping makes for that worker's rank from the training
  metadata (``params_content``);
- ``rules`` (where the receiver knows its mapping's rules: a Preset, a built-in preset's
  name, an HF config dict): rule by rule, what the rule expands to on the receiver's rank
  over the preset's own config (destination names, shapes, dtypes; each shard's offset,
  size, kind, dtype and pieces; the training names it ignores) (``rule_content``).

``of(content)`` is the one hash: any JSON-able content (dicts, lists, tuples, str, numbers,
None), canonical (keys sorted), so a map traced elsewhere can be hashed the same way.
"""

from __future__ import annotations

import hashlib
import json
import re

_ADDR = re.compile(r" at 0x[0-9a-fA-F]+")  # an object's default repr: not the same in two processes
FP8 = "float8_e4m3fn"


def of(content) -> str:
    """sha256 (hex) of `content`: any JSON-able value, tuples as lists, dict keys sorted."""
    text = json.dumps(content, sort_keys=True, separators=(",", ":"), default=_plain)
    return hashlib.sha256(text.encode()).hexdigest()


def _plain(x):
    if isinstance(x, (set, frozenset)):
        return sorted(x)
    raise TypeError(f"wxfer digest: {type(x).__name__} is not content (JSON-able values only)")


def rule_text(rule) -> str:
    """A rule as text for a message: its repr, object addresses left out (never hashed)."""
    return _ADDR.sub("", repr(rule))


def params_content(params: dict) -> list:
    """[[name, shape, dtype], ...] (sorted) of `params` ({name: (shape, dtype name)}) with bytes."""
    out = []
    for n, (shape, dt) in params.items():
        if all(int(d) != 0 for d in shape):
            out.append([n, [int(d) for d in shape], str(dt)])
    return sorted(out)


def quant_of(params: dict) -> str | None:
    """ "fp8" where `params` ({name: (shape, dtype name)}) hold FP8 weights, else None (BF16)."""
    return "fp8" if any(dt == FP8 for _, dt in params.values()) else None


def rule_content(params, comps, errors, ignored, tp: int) -> dict:
    """What one rule makes on each inference rank (``wxfer.mapping.rules.each_rule``'s
    destinations `params`, components `comps`, `errors`, `ignored` names): {rank: [destinations,
    shards, ignored training names]}, or {rank: ["refused", errors]}."""
    ranks = range(tp)
    if errors:
        return {r: ["refused", errors] for r in ranks}
    dests: dict = {r: [] for r in ranks}
    shards: dict = {r: [] for r in ranks}
    for p in params:
        dests[p.rank].append([p.name, list(p.shape), p.dtype])
    for c in comps:
        for s in c.shards:
            shards[s.rank].append([s.dst, s.offset, s.nbytes, s.kind, s.dtype, [list(p) for p in s.pieces]])
    ignored = sorted(ignored)
    return {r: [sorted(dests[r]), sorted(shards[r]), ignored] for r in ranks}


def mapping_rules_all(mapping, tp: int = 1, ep: bool = False, quant: str | None = None) -> dict | None:
    """{rank: mapping_rules of that rank} for every rank of inference layout (`tp`, `ep`,
    `quant`): the rules expanded once for all of them; None as for ``mapping_rules``."""
    from ..mapping.rules import Layout, each_rule
    from . import program

    if mapping is None or mapping == "":
        return None
    try:
        p = program.get_preset(mapping)
    except (ValueError, TypeError, KeyError):
        return None
    try:
        shapes, why = {n: tuple(v[0]) for n, v in p.hf_params().items()}, ""
    except Exception as e:  # noqa: BLE001 -- no shapes to expand over: every rule says why
        shapes, why = None, f"{type(e).__name__}: {e}"
    lay = Layout(int(tp), bool(ep), quant, 1)
    out: dict = {r: dict(name=getattr(p, "name", ""), rules=[]) for r in range(int(tp))}
    if shapes is None:
        for rule in p.rules:
            for r in out:
                out[r]["rules"].append([rule_text(rule), of(["no shapes", why])])
        return out
    for rule, params, comps, errors, ignored in each_rule(p.rules, shapes, lay, p.config):
        for r, content in rule_content(params, comps, errors, ignored, lay.tp).items():
            out[r]["rules"].append([rule_text(rule), of(content)])
    return out


def mapping_rules(mapping, tp: int = 1, ep: bool = False, quant: str | None = None, rank: int = 0) -> dict | None:
    """{name, rules: [[text, digest of its content], ...]} of `mapping` (a Preset, a built-in
    preset's name or an HF config dict) on rank `rank` of inference layout (`tp`, `ep`,
    `quant`), expanded over the preset's config; None when the rules cannot be known here
    (None, or a name that is no built-in preset)."""
    every = mapping_rules_all(mapping, tp, ep, quant)
    return None if every is None else every[int(rank)]


def compare_rules(worker: dict, trainers: dict | None) -> str | None:
    """The first difference between what inference worker `worker` (its published metadata:
    its `rules` digests) expects and the trainers' `trainers` (mapping_rules of their mapping
    on that worker's layout and rank), as one message naming the rule as each side has it;
    None when they agree.  A worker that published no rules is compared by its parameters
    (``compare_params``)."""
    theirs = worker.get("rules")
    if not theirs:
        return None
    who = f"inference worker gpu {worker['gpu']} (mapping {theirs['name']!r})"
    if trainers is None:
        return f"{who} expects the rules of its mapping, the trainers' mapping has none known here"
    mine = trainers["rules"]
    for i, (a, b) in enumerate(zip(mine, theirs["rules"])):
        if a[1] != b[1]:
            return (
                f"{who} expects other rules than the trainers' mapping {trainers['name']!r}: rule {i} "
                f"is {b[0]} there, {a[0]} on the trainers (what they expand to differs)"
            )
    n, m = len(mine), len(theirs["rules"])
    if n != m:
        extra = mine[m][0] if n > m else theirs["rules"][n][0]
        return (
            f"{who} expects {m} rules, the trainers' mapping {trainers['name']!r} has {n}: rule "
            f"{min(n, m)} ({extra}) is only on {'the trainers' if n > m else 'the worker'}"
        )
    return None


def compare_params(worker: dict, made: dict) -> str | None:
    """Whether inference worker `worker`'s published parameter digest (``params_digest``) is
    the digest of `made` ({name: (shape, dtype)}: what the trainers' mapping makes for its
    rank from the training metadata); None when they agree."""
    mine = params_content(made)
    if worker.get("params_digest") == of(mine):
        return None
    theirs = params_content(worker.get("params") or {})
    a, b = dict((n, (s, d)) for n, s, d in mine), dict((n, (s, d)) for n, s, d in theirs)
    first = next((n for n in sorted(set(a) | set(b)) if a.get(n) != b.get(n)), None)
    where = (
        f"first at {first}: {b.get(first, 'missing')} there, {a.get(first, 'not made')} by the trainers' mapping"
        if first is not None
        else "its published parameters do not match its own digest"
    )
    who = f"inference worker gpu {worker['gpu']}"
    return f"{who} holds other parameters than the trainers' mapping makes for it ({where})"
