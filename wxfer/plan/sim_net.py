"""The network side of the simulator (wxfer.plan.simulate): the (sender, task) jobs of the
transfer table, the water-filling step, and the write flows (per (sender, receiver) FIFOs,
a posting window per rank, the cross-node all-gather rings).  Split out of simulate.py;
see its docstring for the model."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .kinds import KINDS


def _waterfill(fa, fb, cap, demand, iters=16):
    """Bytes per flow for one step: flows over links (fa, fb), link capacities `cap`."""
    F = fa.size
    alloc = np.zeros(F)
    if F == 0:
        return alloc
    L = cap.size
    rem = cap.copy()
    idx = np.flatnonzero(demand > 0)
    for _ in range(iters):
        if idx.size == 0:
            break
        a, b = fa[idx], fb[idx]
        cnt = np.bincount(a, minlength=L) + np.bincount(b, minlength=L)
        share = rem / np.maximum(cnt, 1)
        give = np.minimum(np.minimum(share[a], share[b]), demand[idx] - alloc[idx])
        alloc[idx] += give
        rem -= np.bincount(a, give, L) + np.bincount(b, give, L)
        sat = rem <= cap * 1e-9
        keep = (alloc[idx] < demand[idx] * (1 - 1e-9)) & ~sat[a] & ~sat[b]
        idx = idx[keep]
    return alloc


# --------------------------------------------------------------------------- parts
#
# simulate() below is an event loop over four parts, each tested alone:
#   _jobs        the (sender, task) jobs of the transfer table and their writes per receiver
#   _Network     the writes (per (sender, receiver) FIFOs, a posting window per rank) and the
#                cross-node all-gather ring flows, advanced one water-filled step at a time
#   _StageModel  how long each stage of one task takes (H2D, all-gather, quantize/pack)
#   _Meshes      the order of stage events: all-gathers per mesh in plan order under the
#                watermark and the group barriers, packing per rank, the jobs it makes ready


@dataclass
class _Jobs:
    """(sender, task) runs of the transfer table ("jobs") and their writes summed per
    receiver GPU ("entries", sorted by job)."""

    rank: np.ndarray  # [J] sending trainer rank
    task: np.ndarray  # [J] plan task
    packed: np.ndarray  # [J] bytes of the job's packed buffer
    ejob: np.ndarray  # [E] job of each entry
    egpu: np.ndarray  # [E] receiving GPU of each entry
    ebytes: np.ndarray  # [E] bytes
    start: np.ndarray  # [J] first entry of the job
    end: np.ndarray  # [J] one past its last entry
    wbytes: np.ndarray  # [J] bytes the job writes
    of_task: dict  # task -> [job]
    packed_of: dict  # (rank, task) -> packed bytes
    pieces: np.ndarray | None = None  # [J] pieces the job packs (one launch each; an FP8 piece once for fp8 + scale)
    fp8: np.ndarray | None = None  # [J] whether it quantizes
    nwrites: np.ndarray | None = None  # [J] transfers (one write each)
    job_of: dict | None = None  # (rank, task) -> job
    kind: np.ndarray | None = None  # [J] index into wxfer.plan.kinds.KINDS (None: every job packed)
    launches: np.ndarray | None = None  # [J] packing kernel launches (native kernel: merged raw pieces + 1 for FP8)
    fp8_piece_elems: np.ndarray | None = None  # [J] mean elements of its FP8 pieces (0: none)
    ewrites: np.ndarray | None = None  # [E] the entry's writes (transfers; 0 for a direct job's)
    # [J] bytes and ranges of the job's transfers, whoever writes them (a copy job's batched copies)
    xbytes: np.ndarray | None = None
    xwrites: np.ndarray | None = None
    # [J] bytes of the full tensors the job's packing reads: its own pieces' (a rank of a mesh quantizes
    # only the pieces it sends, wxfer.runtime.prepare.pack_into), at the sources' bytes per element
    src_read: np.ndarray | None = None

    @property
    def n(self) -> int:
        return int(self.rank.size)


def _jobs(plan, ngpu: int, kinds: dict | None = None) -> _Jobs:
    """The jobs of `plan`; kinds: task -> kind on its senders (wxfer.plan.kinds; absent: packed)."""
    n = plan.n_transfers
    if n:
        brk = np.r_[True, (plan.sender[1:] != plan.sender[:-1]) | (plan.task[1:] != plan.task[:-1])]
        job_of = np.cumsum(brk) - 1
        js = np.flatnonzero(brk)
        jrank, jtask = plan.sender[js], plan.task[js]
        packed = np.zeros(js.size)
        np.maximum.at(packed, job_of, (plan.src_offset + plan.nbytes).astype(float))
        ukey, einv = np.unique(job_of * ngpu + plan.gpu, return_inverse=True)
        ebytes = np.bincount(einv.reshape(-1), plan.nbytes, ukey.size).astype(float)
        ewrites = np.bincount(einv.reshape(-1), minlength=ukey.size).astype(np.int64)
        ejob, egpu = ukey // ngpu, ukey % ngpu
    else:
        jrank = jtask = ejob = egpu = ewrites = np.empty(0, np.int64)
        packed = ebytes = np.empty(0)
    J = jrank.size
    of_task: dict = {}
    for j in range(J):
        of_task.setdefault(int(jtask[j]), []).append(j)
    pieces, fp8, nwrites, launches, fp8_elems, read = _job_pieces(plan, job_of if n else np.empty(0, np.int64), J)
    per_elem = {}  # task -> its sources' bytes per element
    for t in set(jtask.tolist()) if J else ():
        per_elem[t] = _bytes_per_elem(plan.tasks[t])
    src_read = np.array([read[j] * per_elem[int(jtask[j])] for j in range(J)]) if J else np.zeros(0)
    code = {k: i for i, k in enumerate(KINDS)}
    kind = np.array([code[(kinds or {}).get(int(t), "packed")] for t in jtask], np.int64)
    xbytes = np.bincount(ejob, ebytes, J) if J else np.zeros(0)
    xwrites = nwrites.copy()
    own = (kind == code["direct"]) | (kind == code["copy"])  # written by the rank's kernels, not the engine
    if J and own.any():  # no write left (its job has no entries: the stages end it, wxfer.plan.sim_stages)
        keep = ~own[ejob]
        ejob, egpu, ebytes, ewrites = ejob[keep], egpu[keep], ebytes[keep], ewrites[keep]
        nwrites = np.where(own, 0, nwrites)
    return _Jobs(
        jrank,
        jtask,
        packed,
        ejob,
        egpu,
        ebytes,
        np.searchsorted(ejob, np.arange(J)),
        np.searchsorted(ejob, np.arange(J), side="right"),
        np.bincount(ejob, ebytes, J) if J else np.zeros(0),
        of_task,
        {(int(jrank[j]), int(jtask[j])): packed[j] for j in range(J)},
        pieces,
        fp8,
        nwrites,
        {(int(jrank[j]), int(jtask[j])): j for j in range(J)},
        kind,
        launches,
        fp8_elems,
        ewrites,
        xbytes,
        xwrites,
        src_read,
    )


def _bytes_per_elem(task) -> float:
    """The task's sources' bytes per element: its src_bytes over their elements (each source's
    rows and columns as far as the task's pieces reach)."""
    rows: dict = {}
    cols: dict = {}
    for sh in task.shards:
        for pc in sh.pieces:
            rows[pc.src] = max(rows.get(pc.src, 0), pc.r1)
            cols[pc.src] = max(cols.get(pc.src, 0), pc.c1)
    n = sum(rows[k] * max(cols[k], 1) for k in rows)
    return task.src_bytes / n if n else 0.0


def _job_pieces(plan, job_of, J: int):
    """Per job: pieces packed (each distinct shard of its buffer once; a scale shard shares its
    fp8 shard's quantization), whether any is FP8, its number of writes, and the launches of
    the native packing (one copy per run of consecutive row ranges of a raw shard, as
    wxfer.zerocopy.merged_rows, plus one launch for all its FP8 pieces)."""
    nwrites = np.bincount(job_of, minlength=J).astype(np.int64) if J else np.zeros(0, np.int64)
    pieces = np.zeros(J, np.int64)
    launches = np.zeros(J, np.int64)
    fp8 = np.zeros(J, bool)
    elems = np.zeros(J)
    npc = np.zeros(J)
    read = np.zeros(J)  # source elements its packing reads (each packed shard's pieces; a scale shard's none)
    if not J:
        return pieces, fp8, nwrites, launches, elems, read
    key = job_of * (int(plan.src_offset.max()) + 1) + plan.src_offset  # one per packed shard
    _, first = np.unique(key, return_index=True)
    for i in first.tolist():
        sh = plan.tasks[int(plan.task[i])].shards[int(plan.shard[i])]
        j = int(job_of[i])
        if sh.kind == "fp8":
            fp8[j] = True
            elems[j] += sum(pc.numel() for pc in sh.pieces)
            npc[j] += len(sh.pieces)
        if sh.kind != "scale":
            pieces[j] += len(sh.pieces)
            read[j] += sum(pc.numel() for pc in sh.pieces)
        if sh.kind == "raw":
            launches[j] += _merged(sh.pieces)
    return pieces, fp8, nwrites, launches + fp8, elems / np.maximum(npc, 1), read


def _merged(pieces) -> int:
    """Pieces left after merging runs of consecutive row ranges of one source (same columns)."""
    n, last = 0, None
    for pc in pieces:
        if last is None or not (last.src == pc.src and last.r1 == pc.r0 and (last.c0, last.c1) == (pc.c0, pc.c1)):
            n += 1
        last = pc
    return n


class _Network:
    """The flows on the links: every job's writes, as per (sender, receiver) FIFOs of its
    entries in the sender's job order, and the ring flows of cross-node all-gathers.

    Links: [0, world) trainer send side (the write path), [world, 2 world) trainer NIC
    receive side (rings), [2 world, 2 world + ngpu) inference receive side.  A rank posts
    its queued jobs in order while it has fewer than `max_posted` bytes posted (at least one
    job).  `step()` moves one time step of bytes."""

    def __init__(
        self,
        jobs: _Jobs,
        world: int,
        ngpu: int,
        nic_bw: float,
        write_bw: float,
        max_posted: float,
        write_latency_s: float,
        write_dev_s: float = 0.0,
    ):
        from collections import deque

        self.jobs, self.world, self.ngpu = jobs, world, ngpu
        self.write_latency_s = write_latency_s
        self.max_posted = float(max_posted)
        self.cap = np.concatenate([np.full(world, write_bw), np.full(world, nic_bw), np.full(ngpu, write_bw)])
        E = jobs.ejob.size
        pkeys, epair = np.unique(jobs.rank[jobs.ejob] * ngpu + jobs.egpu, return_inverse=True)
        self.epair = epair.reshape(-1)
        self.pair_rank, self.pair_gpu = pkeys // ngpu, pkeys % ngpu
        P = pkeys.size
        order = np.lexsort((jobs.ejob, self.epair))  # FIFO positions
        self.pos_of = np.empty(E, np.int64)
        self.pos_of[order] = np.arange(E)
        # each write holds the link for its bytes and write_dev_s more (its share of the copy's fixed
        # cost and completion): counted as that many bytes at the write rate
        size = (
            jobs.ebytes
            if not write_dev_s or jobs.ewrites is None
            else jobs.ebytes + write_dev_s * write_bw * jobs.ewrites
        )
        self.srem = size[order].copy()  # remaining bytes by FIFO position
        self.ssize = size[order]
        self.sentry = order
        pstart = np.searchsorted(self.epair[order], np.arange(P))
        self.head = pstart.copy()  # first unfinished position of each pair
        self.pend = pstart.copy()  # one past the last posted position
        self.pair_rem = np.zeros(P)
        self.entries_left = np.bincount(jobs.ejob, minlength=jobs.n)
        self.queued: list[deque] = [deque() for _ in range(world)]  # packed jobs waiting to be posted
        self.posted = np.zeros(world, np.int64)
        self.posted_bytes = np.zeros(world)
        self.post_ranks: set = set()
        self.jobs_left = int(np.count_nonzero(self.entries_left))  # a direct job has no writes here
        self.gpu_finish = np.zeros(ngpu)
        # ring flows of cross-node all-gathers
        self.ag_src: list = []
        self.ag_dst: list = []
        self.ag_rem: list = []
        self.ag_start: list = []  # when each flow's all-gather started (its bytes move from then on)
        self.ag_end: dict = {}  # flow -> when its last byte moved
        self.ag_live: set = set()
        self.ag_done: set = set()
        self.rings: dict = {}  # mesh -> (task, start, flow ids)

    # ---- writes
    def queue(self, jobs_ready) -> None:
        """Jobs whose buffers are packed, in job order, join their rank's posting queue."""
        for j in sorted(jobs_ready):
            r = int(self.jobs.rank[j])
            self.queued[r].append(j)
            self.post_ranks.add(r)

    def post(self) -> None:
        jb = self.jobs
        for r in self.post_ranks:
            q = self.queued[r]
            while q and (self.posted[r] == 0 or self.posted_bytes[r] + jb.wbytes[q[0]] <= self.max_posted):
                j = q.popleft()
                self.posted[r] += 1
                self.posted_bytes[r] += jb.wbytes[j]
                es = np.arange(jb.start[j], jb.end[j])
                ps, poss = self.epair[es], self.pos_of[es]
                if (poss != self.pend[ps]).any():
                    raise RuntimeError("writes posted out of FIFO order")
                self.pend[ps] += 1
                self.pair_rem[ps] += self.srem[poss]
        self.post_ranks.clear()

    def active_pairs(self) -> np.ndarray:
        return np.flatnonzero(self.pend > self.head)

    def idle(self, ap) -> bool:
        return ap.size == 0 and not self.ag_live and not any(self.queued)

    # ---- rings
    def add_ring(self, m: int, ti: int, start: float, ranks, nbytes: float) -> None:
        ids = []
        k = len(ranks)
        for i in range(k):
            ids.append(len(self.ag_src))
            self.ag_src.append(ranks[i])
            self.ag_dst.append(ranks[(i + 1) % k])
            self.ag_rem.append(nbytes)
            self.ag_start.append(start)
            self.ag_live.add(ids[-1])
        self.rings[m] = (ti, start, ids)

    # ---- one step
    def _consume(self, ap, palloc, now: float, dt: float) -> list:
        """FIFO inside each pair: spend each pair's bytes on its head entries.  Returns
        [(entry, end time)] of the entries finished in this step."""
        head, pend, srem = self.head, self.pend, self.srem
        nap = ap.size
        left = palloc.copy()
        used = np.zeros(nap)
        done: list = []
        while nap:
            sel = np.flatnonzero((left > 0) & (head[ap] < pend[ap]))
            if sel.size == 0:
                break
            p_, h_ = ap[sel], head[ap[sel]]
            take = np.minimum(srem[h_], left[sel])
            srem[h_] -= take
            self.pair_rem[p_] -= take
            left[sel] -= take
            used[sel] += take
            fin = srem[h_] <= 1e-6 * np.maximum(self.ssize[h_], 1.0)
            if not fin.any():
                break
            hf, pf = h_[fin], p_[fin]
            self.pair_rem[pf] -= srem[hf]
            srem[hf] = 0.0
            head[pf] += 1
            tend = now + dt * np.minimum(used[sel][fin] / np.maximum(palloc[sel][fin], 1e-30), 1.0)
            np.maximum.at(self.gpu_finish, self.pair_gpu[pf], tend)
            done.extend(zip(self.sentry[hf].tolist(), tend.tolist()))
        return done

    def step(self, ap, now: float, dt: float):
        """Move one step of bytes.  Returns (finished jobs [(job, end time)], finished rings
        [(mesh, task, start, end time)], bytes written, bytes of rings).  A ring flow moves bytes
        from its start on (one that starts inside the step gets the rest of the step), and ends
        inside the step where its last byte moved (_ring_ends)."""
        agi = np.array(sorted(self.ag_live), np.int64)
        nap = ap.size
        fa = self.pair_rank[ap]
        fb = 2 * self.world + self.pair_gpu[ap]
        dem = np.maximum(self.pair_rem[ap], 0.0)
        if agi.size:
            fa = np.concatenate([fa, np.array(self.ag_src, np.int64)[agi]])
            fb = np.concatenate([fb, self.world + np.array(self.ag_dst, np.int64)[agi]])
            t0 = np.maximum(np.array(self.ag_start)[agi], now)
            lim = np.minimum(self.cap[fa[nap:]], self.cap[fb[nap:]]) * np.maximum(now + dt - t0, 0.0)
            dem = np.concatenate([dem, np.minimum(np.array(self.ag_rem)[agi], lim)])
        alloc = _waterfill(fa, fb, self.cap * dt, dem)
        palloc = alloc[:nap]
        jobs_done = []
        for e, te in self._consume(ap, palloc, now, dt):
            j = int(self.jobs.ejob[e])
            self.entries_left[j] -= 1
            if self.entries_left[j] == 0:
                self.jobs_left -= 1
                r = int(self.jobs.rank[j])
                self.posted[r] -= 1
                self.posted_bytes[r] -= self.jobs.wbytes[j]
                if self.queued[r]:
                    self.post_ranks.add(r)
                jobs_done.append((j, te + self.write_latency_s))
        fin = []
        for q, i in enumerate(agi.tolist()):
            got = alloc[nap + q]
            self.ag_rem[i] -= got
            if self.ag_rem[i] <= 1e-6 * max(got, 1):
                self.ag_done.add(i)
                self.ag_live.discard(i)
                fin.append((q, i, got))
        if fin:
            self._ring_ends(fin, fa, fb, dem, alloc, nap, now, dt)
        rings_done = []
        for m in list(self.rings):
            ti, s, ids = self.rings[m]
            if all(i in self.ag_done for i in ids):
                del self.rings[m]
                rings_done.append((m, ti, s, max(self.ag_end.pop(i) for i in ids)))
        return jobs_done, rings_done, float(palloc.sum()), float(alloc[nap:].sum())

    def _ring_ends(self, fin, fa, fb, dem, alloc, nap: int, now: float, dt: float) -> None:
        """When each finishing ring flow's last byte moved: its bytes in the step at the rate it
        would have had with more to send (the step water-filled again with those flows' demand at
        what their links allow), from its start or the step's, whichever is later."""
        more = dem.copy()
        for q, i, _ in fin:
            more[nap + q] = np.inf
        full = _waterfill(fa, fb, self.cap * dt, more)
        for q, i, got in fin:
            t0 = max(now, float(self.ag_start[i]))
            rate = full[nap + q] / dt  # bytes/s: its share of the step, had it more bytes
            self.ag_end[i] = min(now + dt, t0 + got / rate) if rate > 0 else now + dt
