"""Which path a task takes on its sending rank, decided in one place for the runtime (the
Sender: wxfer.runtime.prepare, tasks, inplace) and the simulator (wxfer.plan.kinds, which
feeds wxfer.plan.simulate).  Pure Python: no torch, no numpy.

``classify(facts, in_place=..., copy=...)`` returns a ``Choice``: the path (one of ``PATHS``,
the simulator's kinds) and the reason (one of ``REASONS``).  The facts are what the decision
needs: whether the rank sends (``Facts.sends``), the layout of the task's shards against its
sources (``layout``: fused sources, FP8, a cast, slices, or the source's own bytes), whether
the rank holds the one source whole (no gather), in device memory (not CPU-offloaded), and
whether that memory holds the bytes as the layout says (contiguous, in bounds); and two facts
of the push: why the task cannot be written straight into the receivers' memory (``in_place``:
cuda_ipc, every piece inside a mapped destination, verify off; None: it can) and why a
zero-copy task is not copied there by batched kernels (``copy``: also fewer bytes than
copy_max; None: it is).  The runtime gives them from the tensors and its in-place writer;
the simulator from the plan's training parameters (shape, dtype), the mesh and its options.

  sends nothing                          collective_only  (sends_nothing)
  own bytes (held whole, whole rows of the one source in its dtype, the memory fits):
      in host memory                     staged     (offloaded: written after its H2D copy)
      copy possible                      copy       (small_copy)
      else                               zero_copy  (own_bytes)
  in place possible                      direct     (in_place)
  one raw shard, all of a gathered source staged    (gathered_whole: written from the gather)
  else                                   packed     (fused, fp8, cast, sliced, gathered, unfit)
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from .zerocopy import all_of_it, zero_copy

# the paths, in the simulator's order (its arrays hold indices into this tuple)
PATHS = ("zero_copy", "staged", "packed", "direct", "collective_only", "copy")
ZERO_COPY, STAGED, PACKED, DIRECT, COLLECTIVE_ONLY, COPY = PATHS

# layouts of a task's shards against its sources (``layout``)
FUSED = "fused"  # several sources (fused on the sender)
FP8 = "fp8"  # some shard is FP8 e4m3 bytes or their scales
CAST = "cast"  # some raw shard is in another dtype than its source
WHOLE = "whole"  # one raw shard that is all of the source in its dtype
ROWS = "rows"  # every shard one contiguous run of whole rows of the source in its dtype
SLICED = "sliced"  # raw shards in the source's dtype, not each one run of whole rows
UNKNOWN = "unknown"  # the sources' shapes and dtypes are not known (the simulator without them)

REASONS = {
    "sends_nothing": "this rank takes part in the task's collective and sends none of its shards",
    "offloaded": "its own bytes, in host memory: written from fresh memory after its H2D copy",
    "small_copy": "its own bytes, fewer than copy_max, every destination mapped: batched copy kernels",
    "own_bytes": "its own bytes on the device: written from the parameter's memory",
    "in_place": "packed by its kernel straight into the receivers' mapped memory",
    "gathered_whole": "one raw shard that is all of its gathered source: written from the gather",
    FUSED: "several sources fused into its buffer",
    FP8: "quantized to FP8 into its buffer",
    CAST: "cast to the destination's dtype into its buffer",
    SLICED: "slices of its source packed into its buffer",
    "gathered": "rows of a gathered source packed into its buffer",
    UNKNOWN: "its sources' shapes and dtypes not given: modelled packed",
    "unfit": "the source's memory does not hold the bytes as the layout says (not contiguous)",
}

NOT_ASKED = "not asked"  # in_place / copy: the caller did not look (the engine's path)


class Facts(NamedTuple):
    """What the path of one task on one sending rank is decided from (see the module)."""

    sends: bool  # the rank sends some of the task's shards
    layout: str  # ``layout(shards, sources)``
    held: bool = True  # the rank holds its one source whole (a 1-rank mesh, replicated): no gather
    on_device: bool = True  # ... in device memory (False: CPU-offloaded)
    fits: bool = True  # ... contiguous, the shards inside it (wxfer.zerocopy.zero_copy_dests)

    @property
    def own(self) -> bool:
        """The bytes can be written from the source's memory as it is (no pack, no gather)."""
        return self.held and self.fits and self.layout in (WHOLE, ROWS)


class Choice(NamedTuple):
    path: str  # one of PATHS
    reason: str  # a key of REASONS


# every (path, reason) classify returns, made once
_C = {
    (p, r): Choice(p, r)
    for p, r in [
        (COLLECTIVE_ONLY, "sends_nothing"),
        (STAGED, "offloaded"),
        (COPY, "small_copy"),
        (ZERO_COPY, "own_bytes"),
        (DIRECT, "in_place"),
        (STAGED, "gathered_whole"),
        (PACKED, "unfit"),
        (PACKED, "gathered"),
    ]
    + [(PACKED, lay) for lay in (FUSED, FP8, CAST, SLICED, UNKNOWN)]
}


def layout(shards: Sequence, sources: Sequence) -> str:
    """The layout of a task's `shards` (wxfer.plan.core.Shard) against its `sources`
    [(name, shape, dtype name such as "bfloat16")], None where one is not known: one of FUSED,
    FP8, CAST, WHOLE, ROWS, SLICED, UNKNOWN (the rules: wxfer.zerocopy)."""
    if len(sources) != 1:
        return FUSED
    if any(sh.kind != "raw" for sh in shards):
        return FP8
    if sources[0] is None:
        return UNKNOWN
    src, shape, dtype = sources[0]
    if any(sh.dtype != dtype for sh in shards):
        return CAST
    if all_of_it(shards, src, shape, dtype):
        return WHOLE
    return ROWS if zero_copy(shards, src, shape, dtype) else SLICED


def classify(f: Facts, in_place: str | None = NOT_ASKED, copy: str | None = NOT_ASKED) -> Choice:
    """The path of a task on a sending rank, and why (see the module's table).  in_place: why
    the task cannot be written straight into the receivers' memory (None: it can); copy: why a
    zero-copy task is not copied there by batched kernels (None: it is).  With neither asked:
    the path the engine takes (no in-place writer)."""
    if not f.sends:
        return _C[COLLECTIVE_ONLY, "sends_nothing"]
    if f.own:
        if not f.on_device:
            return _C[STAGED, "offloaded"]
        return _C[COPY, "small_copy"] if copy is None else _C[ZERO_COPY, "own_bytes"]
    if in_place is None:
        return _C[DIRECT, "in_place"]
    if f.layout == WHOLE and not f.held:
        return _C[STAGED, "gathered_whole"]
    if f.layout in (WHOLE, ROWS):
        return _C[PACKED, "unfit" if f.held else "gathered"]
    return _C[PACKED, f.layout]


def best(f: Facts) -> Choice:
    """The path when the in-place writer can do everything it does (direct, copy): which of
    those a task is a candidate for."""
    return classify(f, None, None)
