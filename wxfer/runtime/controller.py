"""Setup on the trainer side, beside the Sender: trainer rank 0 builds and checks the plan
from every rank's and every inference worker's metadata and hands it out through the store
(``build_plan``), after waiting (bounded) for the workers (``wait_workers``); after a setup
error the processes that host the store wait until the others read it (``linger``)."""

from __future__ import annotations

import json
import time

from . import control, digest, program, setup_waits
from .control import SetupError


def build_plan(ctl, world: int, mapping, timeout: float, max_task_bytes: int) -> None:
    """Trainer rank 0: read every rank's metadata and every inference worker's, build and
    check the plan, hand it to every rank and receiver through the store (or the error).
    The waits for the workers share one deadline, `timeout` from the first (issue 25.7)."""
    try:
        train = _train_metadata(ctl, world)
        by = time.monotonic() + timeout  # one deadline for every worker
        first = json.loads(
            ctl.get(
                "infer/0",
                "the metadata of inference worker gpu 0 (replica 0 rank 0)",
                timeout,
                abort=setup_waits.STOPPED,
                abort_where="another trainer rank",
            ).decode()
        )
        n = layout_size(first)
        wait_workers(ctl, n, first["tp"], timeout, deadline=by)
        workers = [first] + [ctl.get_json("infer/%d" % g, f"metadata of inference worker gpu {g}") for g in range(1, n)]
        probs = []
        extra = ctl.add("infer/count", 0) - n  # registered beyond gpu 0's layout
        for g in range(n, n + max(0, extra) + 8):
            if extra > 0 and ctl.check("infer/%d" % g):
                w = ctl.get_json("infer/%d" % g, f"metadata of inference worker gpu {g}", 5)
                probs.append(
                    f"inference worker gpu {g} (replica {w['replica']} of {w['replicas']}, rank "
                    f"{w['rank']} of tp={w['tp']}) lies outside gpu 0's layout replicas="
                    f"{first['replicas']} tp={first['tp']} ({n} workers)"
                )
        pname = getattr(program.get_preset(mapping), "name", "")
        rules: dict = {}  # (tp, ep, quant) -> the trainers' mapping_rules_all there (one expansion)
        rule_probs = []  # raised after the plan is built: its errors name a missing parameter by name
        for w in workers:
            at = (w["tp"], w["ep"], digest.quant_of(w["params"]))
            if w.get("rules") and at not in rules:
                rules[at] = digest.mapping_rules_all(mapping, *at)
            mine = (rules.get(at) or {}).get(w["rank"])
            if w["mapping"] and pname and w["mapping"] != pname:
                probs.append(f"inference worker gpu {w['gpu']} uses mapping {w['mapping']!r}, the trainers {pname!r}")
            elif digest.compare_rules(w, mine):
                rule_probs.append(digest.compare_rules(w, mine))
            if (w["transport"], w["options"]) != (first["transport"], first["options"]):
                probs.append(
                    f"inference worker gpu {w['gpu']} registered with {w['transport']} "
                    f"{w['options']}, gpu 0 with {first['transport']} {first['options']}"
                )
            if (w["replicas"], w["tp"]) != (first["replicas"], first["tp"]):
                probs.append(
                    f"inference worker gpu {w['gpu']}: replicas={w['replicas']} tp={w['tp']}, "
                    f"gpu 0 says replicas={first['replicas']} tp={first['tp']}"
                )
        if probs:
            raise SetupError("inference workers disagree:\n  " + "\n  ".join(probs))
        ex = program.expand_for(train, workers, mapping)
        plan = program.build_controller_plan(train, workers, mapping, max_task_bytes=max_task_bytes, expanded=ex)
        if rule_probs:
            raise SetupError("inference workers disagree:\n  " + "\n  ".join(rule_probs))
        _check_params(workers, ex)
        plan.check()  # every destination byte written exactly once, by one sender, in range
        senders = program.receivers_of(plan)
        for w in workers:
            if len(senders[w["gpu"]]) > w["stamp_slots"]:
                raise SetupError(
                    f"inference worker gpu {w['gpu']} has {w['stamp_slots']} version "
                    f"stamp slots but {len(senders[w['gpu']])} trainers write to it"
                )
        blob = program.plan_to_bytes(plan)
    except Exception as e:  # noqa: BLE001 -- every rank and every receiver learns it
        msg = f"{type(e).__name__}: {e}"
        ctl.set("plan", control.encode_result(None, msg))
        ctl.set("status", control.encode_result(None, msg))
        raise SetupError(f"wxfer: building the plan on trainer rank 0 failed: {msg}") from e
    for g, s in senders.items():
        ctl.set_json("senders/%d" % g, s)
    ctl.set("layout", json.dumps(dict(replicas=first["replicas"], tp=first["tp"], workers=n)))
    ctl.set("plan", control.encode_result(blob, None))
    ctl.set("status", control.encode_result(b"", None))


def _train_metadata(ctl, world: int):
    """Every trainer rank's metadata, merged; SetupError when the ranks disagree (their shards,
    or the mapping each was given)."""
    per_rank = [ctl.get_json("train/%d" % r, f"training metadata of trainer rank {r}") for r in range(world)]
    train, problems = program.merge_train_metadata(per_rank)
    digests = [ctl.get_json("train/%d/mapping" % r, f"the mapping of trainer rank {r}") for r in range(world)]
    problems = list(problems) + [
        f"trainer rank {r} was given mapping {d['name']!r} (digest {d['sha'][:12]}), "
        f"rank 0 {digests[0]['name']!r} (digest {digests[0]['sha'][:12]})"
        for r, d in enumerate(digests)
        if d != digests[0]
    ]
    if problems:
        raise SetupError("trainer ranks disagree:\n  " + "\n  ".join(problems))
    return train


def _check_params(workers: list, ex) -> None:
    """Never skipped (issue 35.6): each worker's parameters, by their digest, against what the
    mapping makes for its rank (`ex`; the plan named any difference by name before: this
    catches what it let through, a record whose digest is not its parameters' included)."""
    probs = [
        digest.compare_params(w, {n: (p.shape, p.dtype) for n, p in ex.dest.get(w["rank"], {}).items()})
        for w in workers
    ]
    if any(probs):
        raise SetupError("inference workers disagree:\n  " + "\n  ".join(p for p in probs if p))


MAX_WORKERS = 1 << 16  # inference workers one plan may hold (a layout beyond: a forged or damaged record)


def layout_size(first: dict) -> int:
    """The number of inference workers gpu 0's record says the layout has (replicas x tp),
    refused at once (SetupError) when it is not a positive int product of at most
    MAX_WORKERS: a forged or damaged record (replicas=1e9) had cost the whole setup timeout."""
    rep, tp = first.get("replicas"), first.get("tp")
    ok = all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (rep, tp))
    if not ok or rep * tp > MAX_WORKERS:
        raise SetupError(
            f"inference worker gpu 0's record (store key infer/0) says replicas={rep!r} tp={tp!r}: "
            + ("not two ints >= 1" if not ok else f"{rep * tp} workers, more than {MAX_WORKERS}")
            + "; the record is damaged or was not written by a wxfer Receiver (check who writes to this store)"
        )
    return rep * tp


def wait_workers(ctl, n: int, tp: int, timeout: float, deadline: float | None = None) -> None:
    """Wait (bounded: until `deadline`, else `timeout` from now) for the `n` inference workers;
    a worker registered twice, or one missing at the deadline, is refused naming every such
    worker."""
    deadline = time.monotonic() + timeout if deadline is None else deadline
    delay, dup_seen = 0.005, None
    while True:
        setup_waits.check_stopped(ctl)  # a trainer rank was interrupted: no reason to wait on
        have = ctl.add("infer/count", 0)
        dups = ctl.add("infer/dups", 0)
        now = time.monotonic()
        if dups and dup_seen is None:
            dup_seen = now
        if have >= n and not dups:
            return
        # a duplicate may stand in for a missing worker: give the others 1 s, then refuse
        if (dup_seen is not None and (have >= n or now - dup_seen > 1.0)) or now > deadline:
            probs = []
            for g in range(n):
                if len(probs) >= 20:  # gpu 0 may claim a huge layout: name the first 20
                    probs.append(f"... (gpu 0 says replicas={n // max(1, tp)} tp={tp}: {n} workers, {have} registered)")
                    break
                if ctl.check("infer/dup/%d" % g):
                    d = ctl.get_json("infer/dup/%d" % g, "a duplicate worker's note", 1)
                    w = ctl.get_json("infer/%d" % g, f"metadata of inference worker gpu {g}", 5)
                    probs.append(
                        f"inference worker gpu {g} (replica {g // max(1, tp)} rank "
                        f"{g % max(1, tp)}) registered twice: {w['host']} pid {w['pid']} "
                        f"and {d['host']} pid {d['pid']}"
                    )
                elif not ctl.check("infer/%d" % g):
                    probs.append(
                        f"inference worker gpu {g} (replica {g // max(1, tp)} rank {g % max(1, tp)}) has not registered"
                    )
            head = (
                "inference workers registered twice or missing"
                if dups
                else f"waited {timeout:.0f} s for the {n} inference workers' metadata, {have} arrived"
            )
            raise SetupError(head + ":\n  " + "\n  ".join(probs))
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


def linger(ctl, hosted: bool, timeout: float, trainer_key, trainers: int, recv_key, receivers, phase=None) -> None:
    """After a setup error: wait (up to `timeout` for the other trainer ranks, 10 s for the
    receivers, and no later than the setup phase's bound: `phase`, a setup_waits.Phase) until
    they read it from the store a trainer hosts."""
    if not hosted:
        return
    try:
        _linger_on(ctl, timeout, trainer_key, trainers, recv_key, receivers, phase)
    except Exception:  # noqa: BLE001 -- the store's host exited: nothing left to wait for
        pass


def _linger_on(ctl, timeout: float, trainer_key, trainers, recv_key, receivers, phase) -> None:
    for key, n, t in ((trainer_key, trainers, timeout), (recv_key, receivers, min(timeout, 10.0))):
        if key is None or n == 0:
            continue
        deadline = time.monotonic() + (phase.left(t) if phase is not None else t)
        while time.monotonic() < deadline:
            want = n
            if want is None:  # every receiver of gpu 0's layout (it may not have registered yet)
                try:
                    w = ctl.get_json("infer/0", "", 0) if ctl.check("infer/0") else None
                except Exception:  # noqa: BLE001
                    w = None
                want = w["replicas"] * w["tp"] if w else 1
            if ctl.add(key, 0) >= want or (key == trainer_key and ctl.check(setup_waits.STOPPED)):
                break  # (a trainer rank stopped during setup acks nothing)
            time.sleep(0.02)


def mapping_digest(mapping) -> dict:
    """{name, sha}: what a trainer rank was given as `mapping` (compared across ranks)."""
    import hashlib

    try:
        p = program.get_preset(mapping)
    except Exception as e:  # noqa: BLE001 -- reported by the controller as a disagreement or its own error
        return dict(name=repr(mapping)[:80], sha=hashlib.sha256(f"{type(e).__name__}: {e}".encode()).hexdigest())
    return dict(name=getattr(p, "name", ""), sha=hashlib.sha256(repr(p).encode()).hexdigest())
