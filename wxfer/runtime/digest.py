"""What a receiver says its mapping is, and the trainers' check of it (issue 25.4).

A receiver used to publish only its mapping's *name*, so trainers given a Preset of the
same name but other rules (gate and up swapped) passed setup and wrote gate where up
belongs under a complete version.  Each receiver now publishes the digest of the rules it
expects, rule by rule (``mapping_rules``); the trainers' controller compares it with the
rules of its own mapping and refuses a difference naming the first rule that differs, as
each side has it (``compare_rules``).  What the rules produce on each rank (destination
names, shapes, dtypes) is compared name by name against the receiver's parameters when the
plan is built (wxfer.plan.core._dest_tables), so the rules are what this adds.

A receiver given only a name that is no built-in preset (a custom mapping known to the
trainers alone) cannot know the rules: it publishes none and the trainers compare the name.
"""

from __future__ import annotations

import hashlib
import re

_ADDR = re.compile(r" at 0x[0-9a-fA-F]+")  # an object's default repr: not the same in two processes


def rule_text(rule) -> str:
    """A rule as text both sides can compare: its dataclass repr (class, dst, srcs, fp8,
    dtype, tp, heads, ...), with object addresses left out."""
    return _ADDR.sub("", repr(rule))


def mapping_rules(mapping) -> dict | None:
    """{name, rules: [[text, sha256 of text], ...]} of `mapping` (a Preset, a
    built-in preset's name or an HF config dict); None when the rules cannot be known here
    (None, or a name that is no built-in preset)."""
    from . import program

    if mapping is None or mapping == "":
        return None
    try:
        p = program.get_preset(mapping)
    except (ValueError, TypeError, KeyError):
        return None
    texts = [rule_text(r) for r in p.rules]
    return dict(
        name=getattr(p, "name", ""),
        rules=[[t, hashlib.sha256(t.encode()).hexdigest()] for t in texts],
    )


def compare_rules(worker: dict, trainers: dict | None) -> str | None:
    """The first difference between what inference worker `worker` (its published metadata:
    its `rules` digest) expects and the trainers' `trainers` (mapping_rules of their mapping),
    as one message naming the rule as each side has it; None when they agree or when the
    worker published no rules."""
    theirs = worker.get("rules")
    if not theirs or trainers is None:
        return None
    who = f"inference worker gpu {worker['gpu']} (mapping {theirs['name']!r})"
    mine = trainers["rules"]
    for i, (a, b) in enumerate(zip(mine, theirs["rules"])):
        if a[1] != b[1]:
            return (
                f"{who} expects other rules than the trainers' mapping {trainers['name']!r}: rule {i} "
                f"is {b[0]} there, {a[0]} on the trainers"
            )
    n, m = len(mine), len(theirs["rules"])
    if n != m:
        extra = mine[m][0] if n > m else theirs["rules"][n][0]
        return (
            f"{who} expects {m} rules, the trainers' mapping {trainers['name']!r} has {n}: rule "
            f"{min(n, m)} ({extra}) is only on {'the trainers' if n > m else 'the worker'}"
        )
    return None
