"""One push's per-task work on the trainer side (a Sender mixin): the begin version stamps,
zero-copy tasks submitted prepared and in batches, packed tasks admitted under the watermark
before their buffer is made, verify-mode checksums."""

from __future__ import annotations

from . import prepare
from .receiver import _b64

STAMP_TAG = 1 << 62  # engine tag of the version-stamp writes (plan tasks use their index)


class TaskMixin:
    def _write_begin(self, version: int) -> None:
        """This rank's begin stamps, landed before its first data write of the step: a fence
        task, so the engine posts no data write before they completed, while this thread goes
        on preparing the step's tasks."""
        dests = self._begin_dest
        self._begin_fence = None
        self._direct_begun = None  # this push's direct writes wait for these stamps (a version may repeat)
        if not dests:
            return
        self.begin_src.fill_(version)
        # a receiver that fails here is skipped by the engine for the data writes too
        self._begin_fence = self._submit_stamps(self.begin_src, dests, "begin")

    def _submit_stamps(self, src, dests: dict, which: str, event=None) -> int:
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

    def _fast_task(self, op):
        """The engine's prepared task of a zero-copy task (prepare.zero_copy_task), or None;
        with verify on its bytes are checksummed here, as in _run_task."""
        prep = op.prep
        if prep is None or not prep.zero_copy or not op.sends:
            return None
        task = prepare.zero_copy_task(op, self.device, self.transport, self.engine)
        if task is not None and self._sums is not None:
            self._checksum(op, prepare.run(op.prep, op, self.device), op.prep.dests)
        return task

    def _submit_fast(self, batch, push_event) -> None:
        """Hand prepared zero-copy tasks to the engine in one call; they wait for the push's
        one event (the training stream's work before push())."""
        if push_event is not None:
            self.engine.submit_prepared(batch, event=push_event.cuda_event, device=self.device.index)
        else:
            self.engine.submit_prepared(batch)

    def _run_task(self, op, push_event) -> None:
        """One task (on the side stream, under no_grad): admitted under the watermark before
        its buffer is made, prepared, submitted.  A zero-copy task waits for the push's one
        event (the training stream's work before push()); the others for their own."""
        prep = op.prep
        if prep is None:
            prep = op.prep = prepare.task_prep(op, self.device)
        if not op.sends:
            prepare.run(prep, op, self.device)  # the collectives only
            return
        if self._direct_task(op):  # packed straight into the receivers' memory (direct.py)
            return
        held = prep.held
        t_admit = self.engine.reserve(held)
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
            if self._sums is not None:
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
        """{plan task: kind} of this rank's tasks, as it runs them (wxfer.plan.kinds: zero_copy,
        staged, packed, direct, collective_only, copy), for the simulator (``simulate(...,
        kinds=...)``).  Decided at setup; a zero-copy task whose memory moved is decided again
        at a push; a packed task is direct when this Sender can write it straight into the
        receivers (direct.py: cuda_ipc, its layout's pieces inside the mapped destinations;
        not with verify on, which sends every task the staging way); a zero-copy task is copy
        when a push copies it into the receivers' mapped memory (direct.py ``copy_ok``: fewer
        bytes than copy_max(), direct possible, every destination mapped; not with verify on)."""
        out = {}
        off = self._direct_off() or ("verify" if getattr(self, "_verify", False) else None)
        for ops in self.program.groups:
            for op in ops:
                prep = op.prep if op.prep is not None else prepare.task_prep(op, self.device)
                k = prepare.kind_of(prep, op)
                if k in ("packed", "staged") and prep.direct is None and off is None:
                    k = prepare.kind_of(prep, op, direct=self._direct_plan(op)[0] is not None)
                elif k == "zero_copy" and off is None and op.prep is prep and self.copy_ok(op):
                    k = "copy"  # (a task prepared again at the next push goes the engine's way there)
                out[op.task] = k
        return out

    def _checksum(self, op, buf, dests) -> None:
        from .verify import crc

        flat = buf.reshape(-1).view(__import__("torch").uint8)
        for rdesc, doff, soff, n in dests:
            g = self._gpu_of_region[bytes(rdesc)]
            self._sums.setdefault(g, []).append((_b64(rdesc), int(doff), int(n), crc(flat[soff : soff + n]), op.name))
