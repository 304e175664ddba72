"""Parameter metadata of the training and inference sides, and the cluster description.

Three sources:

- `from_fsdp_model(model)`: a live training model under FSDP2 (DTensor parameters).
- `from_inference_worker(named_tensors, ...)`: a live inference worker's parameters in
  the inference layout, plus per-parameter descriptors (opaque bytes, e.g. address and
  remote key of the registered memory).
- `synthesize(preset_or_config, cluster)`: both sides from a Hugging Face config dict and
  a `Cluster`, with no GPU -- a 1T-parameter plan on a laptop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from .mapping import Expanded, Layout, Preset, expand, from_config, get_preset
from .mapping.rules import Sized
from .zerocopy import ZERO_COPY_BATCH


@dataclass(frozen=True)
class TrainParam(Sized):
    """One training parameter.

    meshes: the independent groups of global ranks that can each produce the full tensor
    with one ``full_tensor()`` collective among themselves (one group under plain FSDP;
    one per replica under HSDP; one single-rank group per rank for a replicated tensor).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    meshes: tuple[tuple[int, ...], ...]
    placements: tuple[str, ...] = ()

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted({r for m in self.meshes for r in m}))


@dataclass(frozen=True)
class InferParam(Sized):
    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass
class InferWorker:
    """One inference GPU: its replica, its rank inside the replica, its parameters."""

    replica: int
    rank: int  # TP rank inside the replica (also its EP rank when EP is on)
    tp: int
    ep: bool = False
    params: dict[str, InferParam] = field(default_factory=dict)
    descriptors: dict[str, bytes] = field(default_factory=dict)
    gpu: int | None = None  # global index; defaults to replica * tp + rank

    def __post_init__(self):
        if self.gpu is None:
            self.gpu = self.replica * self.tp + self.rank


@dataclass
class Calibration:
    """The per-task costs of stage 2, the collectives and the write path that the simulator
    charges on top of the links' bandwidths (which live in `Cluster`).

    Defaults: one H200 with wxfer's runtime as of issue 13 (per-parameter Python host
    work, the reference FP8 quantizer).  `wxfer.plan.calibrate.CALIBRATIONS` has other named
    sets ("free-stage2": the old model, stage 2 at memory speed and no host time; "h200-native":
    the one-pass quantizer kernel), and ``python -m wxfer calibrate --json`` measures one on
    the current machine.  Optional link rates (None: the Cluster's) are what that command
    measured on this machine; `apply()` puts them into a Cluster.

    Every term (wxfer.plan.calibrate.TERMS) has a source (`source_of`): measured (a value of
    this calibration's `source`), assumed (named in `assumptions` with why: given on purpose, or
    a default that no measurement backs) or unmeasured (None, named in `unmeasured` with why).
    A simulation asks for the terms a plan charges (`need`): an unmeasured one refuses by name,
    an assumed one is listed with the result (SimResult.assumptions)."""

    name: str = "h200"
    # host (Python) work on a trainer rank per task: fixed + per source parameter + per packed piece
    host_task_s: float | None = 0.0  # one H200 (issue 13): not separable from the per-parameter figure
    host_param_s: float | None = 0.25e-3  # one H200 (issue 13): ~0.25 ms of host work per parameter (311-param
    #                                        1.7B-class model as slow as 399-param Qwen3-8B), 1-parameter tasks
    host_piece_s: float | None = 0.0  # one H200 (issue 13): included in host_param_s
    # host work of a zero-copy task (Engine.prepare'd once, handed to Engine.submit_prepared in
    # batches of zc_batch): per task (the loop's check of its memory + the native submit) and per
    # batch (one submit_prepared call); no gather, pack, buffer or watermark
    host_zc_task_s: float | None = 5e-6  # 2-core CPU VM (benchmarks/README.md, bench_push_host): 4.3-5.0 us
    #                                        per task of last_submit_s; per batch not separated there
    host_zc_batch_s: float | None = 0.0
    zc_batch: float = ZERO_COPY_BATCH  # tasks per submit_prepared call (the Sender's, wxfer.zerocopy)
    # host work of a direct task (wxfer.runtime.inplace: gather, the raw copies and one quantizer launch
    # issued straight into the receivers' memory; no reservation, no submission); None: a packed task's
    # (host_s).  Fitted per push on the Sender's trace (wxfer.runtime.hostfit); no default measured
    host_direct_task_s: float | None = None
    # host work of a copy task (wxfer.runtime.inplace.InPlaceWriter.queue_copy: a small zero-copy task's ranges queued
    # for a batched torch._foreach_copy_ into the receivers' memory, the launches every COPY_BATCH ranges
    # and at the mesh group's end included); None: host_zc_task_s.  Fitted per push on the Sender's trace
    # (wxfer.runtime.hostfit: copy tasks have no record, their time is in the next record's gap)
    host_copy_task_s: float | None = None
    # host work of one batched copy launch of copy tasks (wxfer.runtime.copies.copy_ranges: its range
    # table, the launch) and per range in it, charged at each launch; measured apart by calibrate
    # (measure_kernels), None: not charged apart (an in-run fit holds it in host_copy_task_s)
    host_copy_launch_s: float | None = None
    host_copy_range_s: float | None = None
    # fuse / quantize / pack: per launch (one per packed piece) + bytes (full tensors read + buffer written) / rate
    pack_launch_s: float | None = 90e-6  # one H200 (issue 13): 128 experts, one reference quantize each: 15 ms,
    #                                        of which 128 x 4.7 MB at 170 GB/s is 3.5 ms -> ~90 us per piece
    # launches of a task's packing: one per packed piece (the reference quantizer, one torch pass per
    # piece) or, False, one per merged raw piece plus one for all its FP8 pieces (the native kernel)
    launch_per_piece: bool = True
    quant_GBps: float | None = (
        170.0  # None: Cluster.mem_GBps; one H200 (issue 13): wxfer.mapping.reference.quantize_fp8_block,
    )
    #                                        150-190 GB/s effective (BF16 read + FP8 written)
    copy_GBps: float | None = None  # BF16 packing; None: Cluster.mem_GBps (the on-device copy, 2.1 TB/s H200)
    # the batched small copies straight into the receivers (torch._foreach_copy_ of up to 128 ranges,
    # read + write); None: copy_GBps.  Measured by wxfer.tools.calibrate.measure_kernels; not on a GPU
    # yet: the 11:58 UTC H200 run's trace implies about half the bulk copy rate (benchmarks/README.md)
    copy_batch_GBps: float | None = None
    # the quantizer on a task whose FP8 pieces average at most small_piece_elems elements (a MoE layer's
    # experts); None: quant_GBps.  One H200 (issue 13, native kernel): 1.62 TB/s on 128 experts of
    # 768x2048 in one launch against 2.32 TB/s on one 12288x4096 tensor
    quant_small_GBps: float | None = None
    small_piece_elems: float = 4e6
    # the collective (full_tensor) per call (one per source parameter) on top of bytes / link rate
    coll_call_s: float | None = 0.0  # not measured on the H200 yet (calibrate measures it)
    # the write path per write (one per transfer, posted one after the other by a rank's engine, while
    # the link moves the earlier ones): the engine's posting gap, fitted on the trace (hostfit.post_cost)
    write_call_s: float | None = 0.0  # not measured on the H200 yet; the engine's stages were 72 ms of a
    #                                        3.1 s Qwen3-30B-A3B push (issue 13): small next to stage 2
    # the write path's own time per write beyond its bytes at the write rate (the copy's fixed cost and its
    # completion, in the order the writes were posted), fitted on the trace (hostfit.write_extra): it
    # depends on the writes' sizes (small writes cost more of it), so it is a figure of the plan measured
    write_dev_s: float | None = 0.0
    h2d_call_s: float | None = 0.0  # per offloaded source parameter; not measured on the H200 yet
    push_fixed_s: float | None = 0.0  # per push, added at the end (older calibrations: everything fixed in one)
    # per push, measured apart: before the first task (the restart check's store round trip, the begin
    # stamps: a device synchronize, their write and the engine's round trip) and after the last write
    # lands (the engine wait's wake-up, the end stamps likewise, the last mesh-group barrier, the flag)
    push_begin_s: float | None = 0.0
    push_end_s: float | None = 0.0
    # the begin stamps as an engine fence (wxfer.runtime.tasks.TaskRunner.write_begin): the host goes on with the
    # tasks after push_begin_s, no data write is posted before the stamps landed, begin_fence_s after
    begin_fence_s: float | None = 0.0
    # how a rank runs stage 2: serial = its gathers and packs on one stream, one after the other (wxfer's
    # runtime: one side stream); host_sync = the host waits for each (CPU: the host does the work)
    serial: bool = True
    host_sync: bool = False
    # the writes' work shares the CPU cores with stage 2 (the CPU demo: trainers, transport threads and
    # receivers on the same few cores): the push is at least stage 2 on the busiest rank plus all the writes'
    # bytes at the write rate (measured with one writer and one target on those cores)
    cpu_shared: bool = False
    # trainer and receiver on one GPU (colocated): the packing kernels and the writes (on-device
    # copies) take turns on its memory bandwidth: the push is at least the begin cost, a rank's kernel
    # seconds plus its write bytes at the write rate, and the end cost
    device_shared: bool = False
    # measured link rates (None: the Cluster's), GB/s per GPU and direction
    allgather_GBps: float | None = None  # the trainers' all-gather bus rate
    write_GBps: float | None = None  # the write path (transport) between two processes
    h2d_GBps: float | None = None  # pinned host-to-device
    # the receiver's apply of delta records, GB/s of records (the delta term's input, wxfer.plan.delta;
    # not a stage-2 term): None, the delta term's default (its --delta-apply-gbytes, else
    # wxfer.plan.delta.APPLY_GBPS); benchmarks/bench_delta.py --parts apply --cal-in/--cal-out puts
    # the native apply's measured rate here
    delta_apply_GBps: float | None = None
    source: str = "defaults: one H200, wxfer at issue 13 (per-parameter Python, reference quantizer)"
    # terms a measurement could not take, term -> why (``python -m wxfer calibrate`` records them
    # rather than a 0): the simulator refuses a plan that needs one (wxfer.plan.simulate.check_terms,
    # naming it) unless `assumptions` gives it a value
    unmeasured: dict = field(default_factory=dict)
    # term -> why: a value put in an unmeasured term's field on purpose (wxfer.plan.calibrate.assume);
    # a simulation that uses one lists it (SimResult.assumptions).  By default: the defaults that no
    # measurement backs (DEFAULT_ASSUMED), for those terms still at their default value
    assumptions: dict = field(default_factory=lambda: {k: default_why(k) for k in DEFAULT_ASSUMED})

    def __post_init__(self):
        # a default's mark leaves a term given another value (dataclasses.replace) or named unmeasured
        self.assumptions = {
            k: v
            for k, v in self.assumptions.items()
            if k not in DEFAULT_ASSUMED
            or v != default_why(k)
            or (getattr(self, k) == _default(k) and k not in self.unmeasured)
        }

    def source_of(self, term: str) -> tuple:
        """(source, why) of a term: ("unmeasured", why) for a term named in `unmeasured`
        (its value None), ("assumed", why) for one named in `assumptions`, ("instead", which)
        for a None that means another figure (NONE_MEANS), else ("measured", this
        calibration's `source`)."""
        if term in self.unmeasured and term not in self.assumptions:
            return "unmeasured", self.unmeasured[term]
        if term in self.assumptions:
            return "assumed", self.assumptions[term]
        if getattr(self, term) is None and term in NONE_MEANS:
            return "instead", NONE_MEANS[term]
        return "measured", self.source

    def need(self, term: str, by: str = "") -> float | None:
        """The value of `term` for what charges it (`by`, named in the error): a ValueError
        naming the term and why when it is unmeasured and no assumption gives it a value, or
        when it is None with no reason and its None means nothing else (NEED_VALUE).  Terms
        whose None means another figure (quant_GBps: the Cluster's memory rate, ...) may
        return None."""
        src, why = self.source_of(term)
        at = " (charged by %s)" % by if by else ""
        if src == "unmeasured":
            raise ValueError("%s%s: unmeasured: %s" % (term, at, why))
        v = getattr(self, term)
        if v is None and term in NEED_VALUE:
            raise ValueError("%s%s: None, and not named in unmeasured with a reason" % (term, at))
        return v

    def host_s(self, nsrc: int, pieces: int) -> float:
        """Host seconds of one task on one rank (a term that is None is not charged: the
        simulator checks first that the plan's tasks do not need it, simulate.check_terms)."""
        return (self.host_task_s or 0.0) + (self.host_param_s or 0.0) * nsrc + (self.host_piece_s or 0.0) * pieces

    def apply(self, cluster: "Cluster", **kw) -> "Cluster":
        """A copy of `cluster` using this calibration and its measured link rates."""
        from dataclasses import replace

        upd = dict(calibration=self)
        if self.allgather_GBps is not None:
            upd["nvlink_GBps"] = self.allgather_GBps
        if self.write_GBps is not None:
            upd["write_GBps"] = self.write_GBps
        if self.h2d_GBps is not None:
            upd["pcie_GBps"] = self.h2d_GBps
        upd.update(kw)
        return replace(cluster, **upd)


# the terms whose None has no meaning of its own (the others' None means another figure: quant_GBps
# None is Cluster.mem_GBps, host_direct_task_s None the packed task's host figures, ...)
NEED_VALUE = frozenset(
    "host_task_s host_param_s host_piece_s host_zc_task_s host_zc_batch_s pack_launch_s coll_call_s write_call_s "
    "write_dev_s h2d_call_s push_fixed_s push_begin_s push_end_s begin_fence_s".split()
)

# the terms whose None means another figure: term -> which (Calibration.source_of: "instead")
NONE_MEANS = {
    "quant_GBps": "the Cluster's mem_GBps",
    "copy_GBps": "the Cluster's mem_GBps",
    "copy_batch_GBps": "copy_GBps",
    "quant_small_GBps": "quant_GBps",
    "host_direct_task_s": "the packed task's host figures (host_task_s, host_param_s, host_piece_s)",
    "host_copy_task_s": "host_zc_task_s",
    "host_copy_launch_s": "not charged apart (in host_copy_task_s)",
    "host_copy_range_s": "not charged apart (in host_copy_task_s)",
    "allgather_GBps": "the Cluster's nvlink_GBps",
    "write_GBps": "the Cluster's write path (Cluster.write_GBps, else its NIC)",
    "h2d_GBps": "the Cluster's pcie_GBps",
}

# the default set's figures that no measurement backs (Calibration(): one H200 at issue 13): a
# simulation that charges one lists it as an assumption, with this reason
DEFAULT_ASSUMED = {
    "host_task_s": "the H200 (issue 13) did not separate it from host_param_s",
    "host_piece_s": "included in host_param_s on the H200 (issue 13)",
    "host_zc_task_s": "measured on the 2-core CPU VM (bench_push_host), not on a GPU",
    "host_zc_batch_s": "not separated from host_zc_task_s (bench_push_host)",
    "coll_call_s": "not measured on the H200",
    "write_call_s": "not measured on the H200",
    "write_dev_s": "not measured on the H200",
    "h2d_call_s": "not measured on the H200",
    "push_fixed_s": "not measured on the H200",
    "push_begin_s": "not measured on the H200",
    "push_end_s": "not measured on the H200",
    "begin_fence_s": "not measured on the H200",
}


def _default(term: str):
    return Calibration.__dataclass_fields__[term].default


def default_why(term: str) -> str:
    """The assumption mark of a default figure that no measurement backs (DEFAULT_ASSUMED)."""
    return "%s = %r, the default: %s" % (term, _default(term), DEFAULT_ASSUMED[term])


@dataclass
class Cluster:
    """Hardware and sharding description used to synthesize metadata and to simulate.

    Bandwidths are per GPU and per direction, in GB/s (1e9 bytes/s).  One NIC per GPU.
    Training layout: dense parameters FSDP-sharded over the `dense_shard` GPUs of a node
    (HSDP-replicated across nodes, so any node can produce them); routed experts
    partitioned over expert meshes of `expert_shard` ranks, one per node (the same
    local GPU index on consecutive node blocks), i.e. sharded across nodes.
    """

    train_gpus: int = 8
    infer_gpus: int = 2
    infer_tp: int = 2
    infer_ep: bool = False
    quant: str | None = None
    gpus_per_node: int = 8
    nic_gbps: float = 400.0  # line rate in Gb/s
    nic_efficiency: float = 1.0  # fraction of line rate achievable by RDMA writes
    nvlink_GBps: float = 370.0  # measured NCCL broadcast on 2 x H200 NVLink (DESIGN.md)
    pcie_GBps: float = 55.0  # measured pinned H2D on one H200 (55.4 GB/s, issue 13)
    mem_GBps: float = 2100.0  # measured device-to-device copy on one H200 (what "free-stage2" packs at)
    dense_shard: int = 8  # FSDP size for dense params (<= gpus_per_node: inside a node)
    expert_shard: int = 2  # FSDP size for routed experts (across nodes)
    cpu_offload: bool = False
    watermark_bytes: int = 8 << 30  # prepared-but-unsent bytes per trainer rank
    barrier_s: float = 0.5e-3  # gloo barrier between mesh groups
    write_latency_s: float = 5e-6
    max_posted_bytes: int = 16 << 30  # writes a trainer rank keeps posted at once (>= one task's)
    # the trainer -> inference write path per GPU and direction, GB/s; None: the NIC.  Set it
    # (e.g. to the measured cuda_ipc peer-copy rate) when trainers and receivers share a node
    # and write over NVLink; the all-gathers are then still modelled on their own NVLink.  Measured
    # between two H200s over cuda_ipc: 392-394 GB/s.
    write_GBps: float | None = None
    # per-task costs of stage 2, collectives and writes (see Calibration); None: Calibration() (H200)
    calibration: Calibration | None = None

    @property
    def cal(self) -> Calibration:
        return self.calibration if self.calibration is not None else Calibration()

    @property
    def nic_GBps(self) -> float:
        return self.nic_gbps / 8 * self.nic_efficiency

    @property
    def write_bw(self) -> float:
        """Bytes/s of the write path per GPU and direction (the NIC unless write_GBps is set)."""
        return (self.nic_GBps if self.write_GBps is None else self.write_GBps) * 1e9

    @property
    def replicas(self) -> int:
        if self.infer_gpus % self.infer_tp:
            raise ValueError(f"infer_gpus={self.infer_gpus} is not a multiple of infer_tp={self.infer_tp}")
        return self.infer_gpus // self.infer_tp

    @property
    def layout(self) -> Layout:
        return Layout(self.infer_tp, self.infer_ep, self.quant)

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node


# --------------------------------------------------------------------------- FSDP2


def _dtype_name(dt) -> str:
    return str(dt).replace("torch.", "")


def _mesh_groups(mesh_ranks, placements) -> tuple[tuple[int, ...], ...]:
    """Groups of ranks that can produce the full tensor among themselves.

    Mesh dims with a Replicate placement enumerate independent groups; Shard / Partial
    dims must take part in the collective."""
    import numpy as np

    arr = np.asarray(mesh_ranks)
    rep = [d for d, p in enumerate(placements) if type(p).__name__ == "Replicate"]
    other = [d for d in range(arr.ndim) if d not in rep]
    arr = arr.transpose(rep + other)
    n_groups = math.prod(arr.shape[: len(rep)])
    arr = arr.reshape(n_groups, -1)
    return tuple(tuple(int(x) for x in row) for row in arr)


_WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "module.")


def clean_name(name: str) -> str:
    """Drop the wrapper components torch.compile / activation checkpointing / DDP insert."""
    parts = [p for p in name.split(".") if p + "." not in _WRAPPER_PREFIXES]
    return ".".join(parts)


def from_fsdp_model(model, world_size: int | None = None) -> list[TrainParam]:
    """Metadata of every parameter of a model sharded with FSDP2 (`fully_shard`).

    DTensor parameters: the global shape and dtype, the mesh's placements and the rank
    groups that can run ``full_tensor()``.  Plain tensors (not sharded) are producible by
    every rank alone.  Wrapper components in names (``_orig_mod``,
    ``_checkpoint_wrapped_module``, ...) are dropped so that names match Hugging Face's."""
    from torch.distributed.tensor import DTensor

    if world_size is None:
        import torch.distributed as dist

        world_size = dist.get_world_size() if dist.is_initialized() else 1
    out = []
    for name, p in model.named_parameters():
        name = clean_name(name)
        if isinstance(p, DTensor):
            mesh = p.device_mesh
            out.append(
                TrainParam(
                    name,
                    tuple(p.shape),
                    _dtype_name(p.dtype),
                    _mesh_groups(mesh.mesh.tolist(), p.placements),
                    tuple(repr(x) for x in p.placements),
                )
            )
        else:
            out.append(
                TrainParam(
                    name, tuple(p.shape), _dtype_name(p.dtype), tuple((r,) for r in range(world_size)), ("Replicate()",)
                )
            )
    return out


# --------------------------------------------------------------------------- inference


def from_inference_worker(
    named_tensors: Iterable,
    replica: int,
    rank: int,
    tp: int,
    ep: bool = False,
    descriptors: Mapping[str, bytes] | None = None,
    gpu: int | None = None,
) -> InferWorker:
    """Metadata of a live inference worker: `named_tensors` yields (name, tensor) in the
    inference layout (anything with .shape and .dtype); `descriptors` maps each name to
    opaque bytes (address, remote key, ...) that the plan carries to the senders."""
    params = {}
    for name, t in named_tensors:
        params[name] = InferParam(name, tuple(int(x) for x in t.shape), _dtype_name(t.dtype))
    desc = dict(descriptors or {})
    bad = [n for n in desc if n not in params]
    if bad:
        raise ValueError(f"descriptors for unknown parameters: {bad}")
    for n, d in desc.items():
        if not isinstance(d, (bytes, bytearray)):
            raise TypeError(f"descriptor of {n} must be bytes, got {type(d).__name__}")
    return InferWorker(replica, rank, tp, ep, params, {k: bytes(v) for k, v in desc.items()}, gpu)


# --------------------------------------------------------------------------- synthesized


def train_meshes(cluster: Cluster, n_experts_hint: int = 0):
    """(dense groups, expert meshes) of the synthesized training layout."""
    n = cluster.train_gpus
    ds = min(cluster.dense_shard, n)
    if n % ds:
        raise ValueError(f"train_gpus={n} not a multiple of dense_shard={ds}")
    dense = tuple(tuple(range(i, i + ds)) for i in range(0, n, ds))
    es = min(cluster.expert_shard, n)
    if n % es:
        raise ValueError(f"train_gpus={n} not a multiple of expert_shard={es}")
    stride = n // es  # mesh k = {k, k + stride, ...}: one rank per node block when stride >= gpus/node
    experts = tuple(tuple(k + j * stride for j in range(es)) for k in range(stride))
    return dense, experts


def synthesize_train(preset: Preset, cluster: Cluster, fused_experts: bool = False) -> list[TrainParam]:
    """Training parameters on the cluster's meshes.  fused_experts: transformers 5's fused
    3-D expert parameters (one per layer and projection), FSDP-sharded along the experts
    over the dense meshes, instead of one parameter per expert on the expert meshes."""
    dense, emeshes = train_meshes(cluster)
    out = []
    hp = preset.hf_params(fused_experts=fused_experts)
    n_exp = max((e for (_, _, e) in hp.values() if e is not None), default=-1) + 1
    per_mesh = max(1, -(-n_exp // len(emeshes))) if n_exp else 1
    for name, (shape, dtype, expert) in hp.items():
        if expert is None:
            pl = ("Replicate()", "Shard(dim=0)") if len(dense) > 1 else ("Shard(dim=0)",)
            out.append(TrainParam(name, shape, dtype, dense, pl))
        else:
            m = emeshes[(expert // per_mesh) % len(emeshes)]
            out.append(TrainParam(name, shape, dtype, (m,), ("Shard(dim=0)",)))
    return out


def expert_group_of(train: Iterable[TrainParam]) -> int:
    """How many consecutive routed experts share a mesh (gcd over layers; 1 if none)."""
    import re
    from math import gcd

    pat = re.compile(r"^(.*\.experts)\.(\d+)\.")
    by_layer: dict[str, dict[int, tuple]] = {}
    for p in train:
        m = pat.match(p.name)
        if m:
            by_layer.setdefault(m.group(1), {})[int(m.group(2))] = p.meshes
    g = 0
    for d in by_layer.values():
        es = sorted(d)
        run = 1
        for a, b in zip(es, es[1:]):
            if b == a + 1 and d[a] == d[b]:
                run += 1
            else:
                g, run = gcd(g, run), 1
        g = gcd(g, run)
    return max(g, 1)


def workers_from_expanded(ex: Expanded, cluster: Cluster) -> list[InferWorker]:
    """Inference workers of every replica holding the layout of an expansion.

    Workers of the same rank in different replicas share one (read-only) params dict."""
    per_rank = [
        {d.name: InferParam(d.name, d.shape, d.dtype) for d in ex.dest[r].values()} for r in range(cluster.infer_tp)
    ]
    return [
        InferWorker(rep, r, cluster.infer_tp, cluster.infer_ep, per_rank[r])
        for rep in range(cluster.replicas)
        for r in range(cluster.infer_tp)
    ]


@dataclass
class Synthesized:
    preset: Preset
    cluster: Cluster
    train: list[TrainParam]
    workers: list[InferWorker]
    expanded: Expanded


def synthesize(preset: Preset | str | Mapping, cluster: Cluster, fused_experts: bool = False) -> Synthesized:
    """Training params and inference workers from a preset name, a Preset or an HF config dict
    (fused_experts: the transformers 5 training layout of routed experts)."""
    if isinstance(preset, str):
        preset = get_preset(preset)
    elif not isinstance(preset, Preset):
        preset = from_config("custom", preset)
    train = synthesize_train(preset, cluster, fused_experts)
    layout = Layout(cluster.infer_tp, cluster.infer_ep, cluster.quant, expert_group_of(train))
    ex = expand(preset.rules, {p.name: p.shape for p in train}, layout, preset.config)
    return Synthesized(preset, cluster, train, workers_from_expanded(ex, cluster), ex)
