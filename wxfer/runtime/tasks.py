"""One push's per-task work on the trainer side (the Sender's ``TaskRunner``): the version
stamps as engine fence tasks, zero-copy tasks submitted prepared and in batches, packed tasks
admitted under the watermark before their buffer is made (or written in place), verify mode's
checksums, and the words of an engine failure (which plan task, which inference worker)."""

from __future__ import annotations

import ctypes
import logging
import warnings

from .. import envs, taskpath
from . import prepare
from .inplace import COPIES_TAG
from .receiver import _b64

STAMP_TAG = 1 << 62  # engine tag of the version-stamp writes (plan tasks use their index)

log = logging.getLogger(__name__)


def _host_int64(device):
    """One int64 in host memory (pinned when `device` is CUDA): a version stamp's source."""
    import torch

    t = torch.zeros(1, dtype=torch.int64)
    return t.pin_memory() if device.type == "cuda" else t


BEGIN_WAITS = ("host", "stream", "device")  # WXFER_BEGIN_WAIT's choices, the default first


def begin_wait_choice() -> str:
    """How the in-place writes are ordered after the begin stamps (``WXFER_BEGIN_WAIT``):
    ``host`` (the default: the order measured on GPUs) waits on the host for the begin fence
    (bounded); ``stream`` (opt-in until it has run on a GPU) writes them on the side stream
    ahead of the writes (``InPlaceWriter.stamp_begin``: no wait at all); ``device``, the side
    stream waits for the begin fence's id in the fence word (cuStreamWaitValue32,
    begin_wait_word).  docs/cuda_ipc.md compares them."""
    choice = (envs.get("WXFER_BEGIN_WAIT") or BEGIN_WAITS[0]).strip().lower()
    if choice not in BEGIN_WAITS:
        raise ValueError(f"WXFER_BEGIN_WAIT must be one of {', '.join(BEGIN_WAITS)}, got {choice!r}")
    return choice


def begin_wait_word(engine, device):
    """The begin stamps' device wait (``WXFER_BEGIN_WAIT=device``, opt-in): a uint32 in pinned
    host memory into which `engine` stores each fence task's id as it finishes -- held while a
    receiver whose stamp did not land is not fenced (``Engine.fence_word``, docs/cuda_ipc.md)
    -- and its device address for ``_wxfer.stream_wait`` (cuStreamWaitValue32).  (word, device
    address, None), or (None, 0, why not): CPU, another choice, the driver without
    cuStreamWaitValue32_v2, the memory with no device address."""
    import torch

    from .. import _wxfer

    choice = begin_wait_choice()
    if device.type != "cuda":
        return None, 0, "not a CUDA device"
    if choice != "device":
        return None, 0, f"WXFER_BEGIN_WAIT={choice}"
    retire_word(None, ())  # (the words of closed Senders whose streams are past them go)
    word = torch.zeros(1, dtype=torch.int32).pin_memory()
    dev, why = _wxfer.stream_wait_addr(_index(device), word.data_ptr())
    if not dev:
        return None, 0, why
    engine.fence_word(word.data_ptr(), word)
    return word, dev, None


# fence words of closed Senders, each kept with CUDA events recorded on the streams that waited
# on it, until those streams have passed their waits (a queued cuStreamWaitValue32 reads the
# word when the stream reaches it: freed, the pinned memory may be reused for another value)
_RETIRED: list = []


def retire_word(word, streams) -> None:
    """Keep `word` (a begin_wait_word word whose engine has stopped: set past every task) until
    every stream in `streams` has passed the waits queued on it; drop the words retired
    earlier whose streams have."""
    if word is not None and streams:
        import torch

        events = []
        for st in streams:
            ev = torch.cuda.Event()
            ev.record(st)
            events.append(ev)
        _RETIRED.append((events, word))
    _RETIRED[:] = [(evs, w) for evs, w in _RETIRED if not all(ev.query() for ev in evs)]


def _index(device) -> int:
    """The CUDA device's index (the current one for a bare "cuda")."""
    import torch

    return device.index if device.index is not None else torch.cuda.current_device()


def writes_bound(write_timeout: float) -> float:
    """How long to wait for writes that hold the engine (the step's, the begin stamps', the
    watermark's): every task has its own deadline (write_timeout from its first write) and a
    receiver that stops answering fails alone at it, so a little longer than that."""
    return 1.5 * write_timeout + 1.0


def _stamp_source(transport, t):
    """Stamp source `t` registered once with `transport` (a Region, export=False), so that no
    stamp submission imports it through DLPack and registers it again where the transport
    needs that (fabric FI_MR_LOCAL, verbs); on fabric tcp, 2-core CPU, a fence submission from
    the Region took 31 us (median) against 104 us from the tensor (issue 26).  Refused: `t`."""
    try:
        return transport.register(t, export=False)
    except Exception:  # noqa: BLE001 -- imported at each submission instead, as before
        return t


class TaskRunner:
    """engine: this rank's _wxfer.Engine; transport: its transport (zero-copy sources are
    registered with it); device, stream: where stage 2 runs (stream None: the current one);
    rank: this trainer rank; program: its RankProgram; links: its workers
    (wxfer.runtime.links.Links: stamp destinations, whose region is which, peer names);
    inplace: the in-place writer (wxfer.runtime.inplace.InPlaceWriter); write_timeout: the
    bound of a write (and of waiting for the begin stamps before an in-place write)."""

    def __init__(self, engine, transport, device, stream, rank, program, links, inplace, write_timeout):
        self.engine, self.transport, self.device, self.stream = engine, transport, device, stream
        self.rank, self.program, self.links, self.inplace = rank, program, links, inplace
        self.write_timeout = float(write_timeout)
        self.task_names = {op.task: op.name for ops in program.groups for op in ops}
        self.task_params = {op.task: len(op.sources) for ops in program.groups for op in ops}
        # the version stamps' sources live in host memory (pinned with CUDA): filled without
        # a device synchronize; the engine's fences order them around the step's data writes
        self.stamp_src = _host_int64(device)
        self.begin_src = _host_int64(device)
        self.stamp_srcs = {
            w: _stamp_source(transport, t) for w, t in (("end", self.stamp_src), ("begin", self.begin_src))
        }
        # each stamp's int64 as a ctypes view of the tensor's memory (kept alive by the tensor
        # above), not torch's fill_: on the 2-core VM 0.15 us against 0.8 us back to back, and
        # 8 us against 31 us after a 5 ms gap (a push after a training step; issue 37)
        self._stamp_val = ctypes.c_int64.from_address(self.stamp_src.data_ptr())
        self._begin_val = ctypes.c_int64.from_address(self.begin_src.data_ptr())
        self.version = 0  # the push under way
        self.begin_fence = None  # its begin stamps' fence task
        # the in-place writes wait for that fence on the device where the driver can
        # (begin_wait_word); else (why_host_wait says why) on the host, as before
        self.begin_word, self.begin_word_dev, self.why_host_wait = None, 0, "no in-place writes"
        self.begin_on_stream = False  # WXFER_BEGIN_WAIT=stream: written on the side stream (stamp_begin)
        self.wait_streams = {}  # the streams a device wait was queued on (by handle): retire_word
        self.word_held_pushes = 0  # pushes that waited on the host because the word was held
        off = getattr(inplace, "off", None)  # why no task is written in place, or None
        if off is not None and off() is None:
            if begin_wait_choice() == "stream" and hasattr(inplace, "stamp_begin"):
                self.begin_on_stream, self.why_host_wait = True, None
            else:
                self.begin_word, self.begin_word_dev, self.why_host_wait = begin_wait_word(engine, device)
            if self.why_host_wait and device.type == "cuda":
                log.info("wxfer: trainer rank %d: begin stamps waited for on the host: %s", rank, self.why_host_wait)
        self.verify = False  # whether it verifies (the last push's setting, between pushes)
        self.sums = None  # {gpu: [checksum record]} of the push under way (verify on)
        self.last_sums = None  # those of the last push verified
        self.last_verify = None  # what the receivers answered for them

    def prepare_all(self, watermark: int) -> None:
        """Per task, once: how its sources are gathered, zero copy or not, what it holds
        (prepare.TaskPrep); warn about a parameter the watermark cannot hold.  (A zero-copy
        task's source is registered at the first push: prepare.zero_copy_task.)"""
        over = []
        for ops in self.program.groups:
            for op in ops:
                op.prep = prepare.task_prep(op, self.device)
                nb, name = op.prep.largest
                if watermark and op.sends and op.prep.held and nb > watermark:
                    over.append((nb, name, op.prep.held))
        for nb, name, held in sorted(over, reverse=True)[:20]:
            warnings.warn(
                f"wxfer: training parameter {name} ({nb} bytes) is larger than the watermark "
                f"({watermark} bytes) on trainer rank {self.rank}: its task ({held} bytes) is "
                "admitted alone, so a push's extra GPU memory can reach the watermark plus that "
                "task's buffer",
                stacklevel=3,
            )

    # ------------------------------------------------------------------ stamps
    def start(self, version: int, verify: bool) -> None:
        """A push begins: its number and whether it checksums what it sends (and the in-place
        writer learns both, and how to wait for the begin stamps)."""
        self.version, self.verify = version, bool(verify)
        self.sums = {} if verify else None
        self.inplace.start(version, self.verify, self._wait_begin)

    def write_begin(self) -> None:
        """This rank's begin stamps, landed before its first data write of the step: a fence
        task, so the engine posts no data write before they completed, while this thread goes
        on preparing the step's tasks.  The in-place writes wait for that fence alone."""
        dests = self.links.begin_dest
        self.begin_fence = None
        if dests:
            self._begin_val.value = self.version
            # a receiver that fails here is skipped by the engine for the data writes too
            self.begin_fence = self.submit_stamps(self.stamp_srcs["begin"], dests, "begin")

    def _wait_begin(self) -> None:
        """Before this push's first in-place write: its begin stamps ahead of it.  With
        ``WXFER_BEGIN_WAIT=stream`` (opt-in) written on the current (side) stream by
        ``InPlaceWriter.stamp_begin``, which says why they order the writes (no host wait, no
        device wait: nothing to stall on); where a stamp cannot be mapped here, the host wait
        below, for good, its reason logged.  ``device``: the side stream waits for the fence's
        id in the word the engine stores it into (``begin_wait_word``), this thread goes on
        launching; a refusal falls back to the host wait for good.  ``host`` (the default): until
        the fence task alone landed (with no stamps, everything submitted so far)."""
        if self.begin_on_stream and self.begin_fence is not None:
            why = self.inplace.stamp_begin(self.links.begin_dest, self.version)
            if why is None:
                return
            self.begin_on_stream, self.why_host_wait = False, f"not written on the stream: {why}"
            log.warning("wxfer: trainer rank %d: begin stamps waited for on the host: %s", self.rank, why)
        if self.begin_word_dev and self.begin_fence is not None and not self._word_held():
            import torch

            from .. import _wxfer

            # the fence's stamp copies enqueued first (a short host wait: the engine's post, not
            # the copies' completion): a copy behind the device wait in a hardware queue the
            # two streams share would otherwise wait for it until the fence's deadline
            self.wait_engine(
                writes_bound(self.write_timeout),
                "posting the begin stamps (before the in-place writes)",
                fence=self.begin_fence,
                posted=True,
            )
            try:
                # the stream the in-place launches go to (fp8 / copies: the current one)
                st = torch.cuda.current_stream(self.device)
                fid = self.begin_fence & 0xFFFFFFFF
                self.wait_streams.setdefault(st.cuda_stream, st)
                _wxfer.stream_wait(_index(self.device), st.cuda_stream, self.begin_word_dev, fid)
                return
            except Exception as e:  # noqa: BLE001 -- the host wait below is always right
                self.begin_word_dev, self.why_host_wait = 0, f"stream_wait refused: {e}"
                log.warning("wxfer: trainer rank %d: begin stamps waited for on the host: %s", self.rank, e)
        self.wait_engine(
            writes_bound(self.write_timeout),
            "writing the begin stamps (before the in-place writes)",
            fence=self.begin_fence,
        )

    def begin_order(self) -> str:
        """How this Sender's in-place writes follow the begin stamps now (``stats()["direct"]
        ["begin"]``): "stream", "device", or "host: <why>" (WXFER_BEGIN_WAIT, docs/cuda_ipc.md)."""
        if self.begin_on_stream:
            return "stream"
        return "device" if self.begin_word_dev else f"host: {self.why_host_wait}"

    def _word_held(self) -> bool:
        """Whether the engine holds the fence word for an earlier fence (a receiver whose stamp
        did not land and is not fenced yet, or the engine's error: ``Engine.word_state``): a
        device wait queued now would not pass before it is released, so this push waits for
        its begin stamps on the host (bounded), logged naming the receiver."""
        held = self.engine.word_state()
        if held is None:
            return False
        peer, name, secs = held
        who = "the engine's error (until close)" if peer is None else f"peer {peer}, whose begin stamp did not land"
        wname = None if peer is None else self.links.peer_name(peer)
        if wname or name:
            who += f" ({wname or name})"
        self.word_held_pushes += 1
        log.warning(
            "wxfer: trainer rank %d, step %d: the fence word is held (%.1f s) for %s: this push "
            "waits for its begin stamps on the host",
            self.rank,
            self.version,
            secs,
            who,
        )
        return True

    def close(self) -> None:
        """After the engine's close (the word set past every task): the word is kept until the
        streams that waited on it have passed those waits (retire_word)."""
        word, self.begin_word, self.begin_word_dev = self.begin_word, None, 0
        retire_word(word, list(self.wait_streams.values()))
        self.wait_streams = {}

    def write_end(self) -> None:
        """This rank's end stamps: posted by the engine once every task of the step before them
        has finished (a fence: the in-place writes are external tasks, waited for by their CUDA
        events); the engine skips the failed receivers: the others get their stamp."""
        if self.links.stamp_dest:
            self._stamp_val.value = self.version
            self.submit_stamps(self.stamp_srcs["end"], self.links.stamp_dest, "end")

    def submit_stamps(self, src, dests: dict, which: str, event=None) -> int:
        """Hand this rank's `which` (begin/end) stamp writes to the engine as a fence task
        (posted after every earlier write completed; later writes after them), after the
        CUDA `event` when given; returns its task id (Engine.wait(fence=...)). A refusal (a bad
        stamp descriptor in a worker's metadata) names the stamps and the workers."""
        try:
            kw = {} if event is None else dict(event=event.cuda_event, device=self.device.index)
            return self.engine.submit(src, list(dests.values()), tag=STAMP_TAG, fence=True, **kw)
        except Exception as e:
            raise RuntimeError(
                f"wxfer: trainer rank {self.rank}, step {self.version}: the {which} version stamps "
                f"to inference workers {sorted(dests)} were refused: "
                + str(e).replace(f"(tag {STAMP_TAG})", "(the version stamps)")
            ) from e

    # ------------------------------------------------------------------ tasks
    def fast_task(self, op):
        """The engine's prepared task of a zero-copy task (prepare.zero_copy_task), or None;
        with verify on its bytes are checksummed here, as in run_task."""
        prep = op.prep
        if prep is None or not prep.zero_copy or not op.sends:
            return None
        task = prepare.zero_copy_task(op, self.device, self.transport, self.engine)
        if task is not None and self.sums is not None:
            self._checksum(op, prepare.run(op.prep, op, self.device), op.prep.dests)
        return task

    def submit_fast(self, batch, push_event) -> None:
        """Hand prepared zero-copy tasks to the engine in one call; they wait for the push's
        one event (the training stream's work before push())."""
        if push_event is not None:
            self.engine.submit_prepared(batch, event=push_event.cuda_event, device=self.device.index)
        else:
            self.engine.submit_prepared(batch)

    def run_task(self, op, push_event) -> None:
        """One task (on the side stream, under no_grad): admitted under the watermark before
        its buffer is made, prepared, submitted (or written in place).  A zero-copy task waits
        for the push's one event (the training stream's work before push()); the others for
        their own."""
        prep = op.prep
        if prep is None:
            prep = op.prep = prepare.task_prep(op, self.device)
        if not op.sends:
            prepare.run(prep, op, self.device)  # the collectives only
            return
        if self.inplace.write_task(op):  # packed straight into the receivers' memory
            return
        held = prep.held
        # bounded: the writes holding the watermark finish or fail within their deadlines
        t_admit = self.engine.reserve(held, timeout=writes_bound(self.write_timeout))
        try:
            buf = prepare.run(prep, op, self.device)
            ev = None
            if self.stream is not None:
                if prep.zero_copy:
                    ev = push_event
                else:
                    if prep.event is None:
                        import torch

                        prep.event = torch.cuda.Event()
                    ev = prep.event
                    ev.record(self.stream)
            if self.sums is not None:
                self._checksum(op, buf, prep.dests)
        except BaseException:
            self.engine.unreserve(held)
            raise
        if ev is not None:
            self.engine.submit(
                buf, prep.dests, event=ev.cuda_event, device=self.device.index, tag=op.task, held=held, reserved=t_admit
            )
        else:
            self.engine.submit(buf, prep.dests, tag=op.task, held=held, reserved=t_admit)

    def task_kinds(self) -> dict:
        """{plan task: kind} of this rank's tasks, as it runs them (wxfer.taskpath.PATHS:
        zero_copy, staged, packed, direct, collective_only, copy), for the simulator
        (``simulate(..., kinds=...)``): ``task_choices``' paths."""
        return {t: c.path for t, c in self.task_choices().items()}

    def task_choices(self) -> dict:
        """{plan task: wxfer.taskpath.Choice} of this rank's tasks: the classifier's answer from
        each task's facts (decided at setup; a zero-copy task whose memory moved is decided again
        at a push) and what the in-place writer says of it now: a task that is not the
        parameter's own bytes is direct when this Sender can write it straight into the
        receivers (inplace.py: cuda_ipc, its layout's pieces inside the mapped destinations;
        not with verify on); a zero-copy task is copy when a push copies it there
        (``InPlaceWriter.copy_why``: fewer bytes than copy_max, every destination mapped)."""
        out = {}
        ip = self.inplace
        off = ip.off() or ("verify" if ip.verify else None)
        for ops in self.program.groups:
            for op in ops:
                prep = op.prep if op.prep is not None else prepare.task_prep(op, self.device)
                in_place = copy = off or taskpath.NOT_ASKED
                if off is None and prep.best.path == taskpath.DIRECT:
                    in_place = ip.plan_of(op)[1]
                elif off is None and prep.best.path == taskpath.COPY and op.prep is prep:
                    copy = ip.copy_why(op)  # (a task prepared again at the next push goes the engine's way there)
                out[op.task] = taskpath.classify(prep.facts, in_place, copy)
        return out

    # ------------------------------------------------------------------ verify
    def _checksum(self, op, buf, dests) -> None:
        from .verify import crc

        flat = buf.reshape(-1).view(__import__("torch").uint8)
        for rdesc, doff, soff, n in dests:
            g = self.links.gpu_of_region[bytes(rdesc)]
            self.sums.setdefault(g, []).append((_b64(rdesc), int(doff), int(n), crc(flat[soff : soff + n]), op.name))

    def drop_sums(self) -> None:
        """A step that failed somewhere: nothing of it is verified."""
        self.sums = None

    def verify_landed(self, ctl, timeout: float) -> None:
        """With verify on: ask every receiver written to for the checksums of what it holds
        where this push wrote (a mismatch raises VerifyError); they become last_sums."""
        if self.sums is None:
            return
        self.last_sums, self.sums = self.sums, None
        from .verify import request

        self.last_verify = request(ctl, self.rank, self.version, self.last_sums, self.links.workers, timeout)

    # ------------------------------------------------------------------ the engine's words
    def wait_engine(self, timeout, what, fence=None, posted: bool = False) -> None:
        """Engine.wait (fence: only until that fence task finished; posted: only until it is done
        posting), its failure raised as this rank's step error saying `what` it waited for."""
        try:
            if posted:
                self.engine.wait(timeout=timeout, fence=fence, posted=True)
            else:
                self.engine.wait(timeout=timeout, fence=fence)
        except Exception as e:
            self.engine.clear_error()
            raise RuntimeError(
                f"wxfer: trainer rank {self.rank}, step {self.version}: {what}: {self.describe(e)}"
            ) from e

    def describe(self, err: BaseException) -> str:
        """The user's message for an engine failure: the engine's own, and from its fields
        (wxfer.Error.tag, .peer) the plan task and the inference worker it concerns."""
        msg = str(err)
        tag, peer = getattr(err, "tag", None), getattr(err, "peer", None)
        if tag is not None and tag in self.task_names:
            msg += f" [plan task {tag}: {self.task_names[tag]}]"
        elif tag == STAMP_TAG:
            msg += " [the version stamps]"
        elif tag == COPIES_TAG:
            msg += " [a batched copy of small tasks straight into the receivers' memory]"
        name = None if peer is None else self.links.peer_name(peer)
        if name is not None:
            msg += f" [peer {peer} is {name}]"
        return msg
