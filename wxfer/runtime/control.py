"""Control plane: discovery through torch.distributed's TCPStore, the connection handshake
carried through the store, and gloo helpers among the trainers.

The inference workers are not in the trainers' process group, so everything that crosses
the two sides goes through one TCPStore (hosted by trainer rank 0 unless the user brings
their own).  Every wait is bounded and its error names the key, the peer and the timeout.

Keys live under ``wxfer/<name>/`` (generation 0 of the name; generation N >= 1 under
``wxfer/<name>/g<N>/``, the current one in the counter ``wxfer/<name>/gen``: wxfer.runtime.jobs)::

    job, job/claim, job/lease   the trainer job holding this generation   trainer rank 0
                                (id, host, pid), its claim, its lease

    infer/<gpu>                 a receiver's metadata (JSON)            receiver -> rank 0
    infer/count                 counter of receivers that published       receiver
    train/<rank>                a trainer's metadata digest (JSON)        trainer -> rank 0
    plan                        b"OK" + plan bytes  |  b"ER" + message    rank 0 -> all
    senders/<gpu>               JSON list of trainer ranks writing to gpu rank 0 -> receiver
    hs/req/<rank>/<gpu>         handshake request (may be empty)          trainer -> receiver
    hs/rep/<rank>/<gpu>         handshake reply                           receiver -> trainer
    ready/<gpu>                 receiver finished its handshakes          receiver -> trainers
    plan/acks, status/acks      counters: the plan/status was read        trainers / receivers
    setup                       b"OK" | b"ER" + message: the trainers'    rank 0 -> receivers
                                connect phase (every rank's) is over
    setup/acks                  counter: a receiver read `setup`          receivers
    torn/<gpu>/e<epoch>[/<i>]   counter / a trainer's record of giving    trainers -> receiver
                                up on that worker (Receiver.state())

Every wait polls (at most 50 ms apart), so Ctrl-C is honoured within that, and ends at
the deadline it names.
"""

from __future__ import annotations

import json
import os
import socket
import time
from datetime import timedelta

from .. import envs

DEFAULT_PORT = 29650
DEFAULT_TIMEOUT = 300.0


class SetupError(RuntimeError):
    """Setup failed (on this process or on another one; the message says where)."""


class CollectiveError(TimeoutError):
    """A gloo collective among the trainer ranks failed or timed out: a rank died or hung."""


# --------------------------------------------------------------------------- the store


def parse_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"store address {addr!r} must be host:port")
    return host or "127.0.0.1", int(port)


def resolve_store(store=None, is_master: bool = False, timeout: float = DEFAULT_TIMEOUT, bind: str | None = None):
    """A torch.distributed Store from what the user gave.

    - a Store object: used as is;
    - "host:port": a TCPStore there (hosted here when `is_master`);
    - None: $WXFER_STORE ("host:port"), else $MASTER_ADDR with port $WXFER_STORE_PORT
      (default 29650), hosted by trainer rank 0 (`is_master`).

    The hosted store listens only on `bind` (an IPv4/IPv6 address or an interface name such
    as "eth1"; default $WXFER_STORE_BIND, else the store's host when that is a literal IP
    address, else every interface as torch does): the control plane carries the keys that
    grant remote write into the receivers' memory, so keep it on the cluster network.
    """
    import torch.distributed as dist

    if store is not None and not isinstance(store, str):
        return store
    if store is None:
        store = envs.get("WXFER_STORE") or None
    if store is None:
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        store = "%s:%s" % (host, envs.get("WXFER_STORE_PORT", DEFAULT_PORT))
    host, port = parse_addr(store)
    lsock = None
    try:
        if is_master:
            addr = bind_address(host, bind)
            if addr is not None:
                lsock = _listen(addr, port)
        if is_master:
            st = dist.TCPStore(
                host,
                port,
                is_master=True,
                timeout=timedelta(seconds=timeout),
                wait_for_workers=False,
                use_libuv=True,
                master_listen_fd=lsock.fileno() if lsock is not None else None,
            )
        else:
            st = _connect_store(host, port, timeout)
    except Exception as e:
        if lsock is not None:
            lsock.close()
        role = "host" if is_master else "reach"
        raise SetupError(
            f"wxfer: cannot {role} the TCPStore at {host}:{port} within {timeout:.0f} s: {type(e).__name__}: {e}"
        ) from e
    if lsock is not None:
        lsock.detach()  # the store serves on (and owns) this socket now
    return st


def _connect_store(host: str, port: int, timeout: float):
    """A TCPStore client, connecting within `timeout`: wait (quietly, interruptibly, by the
    deadline) until the port accepts a TCP connection, then connect the store with what is
    left (torch's own retries stretch one attempt to 2-3x its timeout and log each)."""
    import torch.distributed as dist

    deadline = time.monotonic() + timeout
    delay = 0.01
    while True:
        left = deadline - time.monotonic()
        try:
            socket.create_connection((host.strip("[]"), port), timeout=max(0.05, min(1.0, left))).close()
            break
        except OSError as e:
            if left <= delay:
                raise TimeoutError(f"nothing accepted a connection at {host}:{port}: {e}") from None
            time.sleep(delay)
            delay = min(2 * delay, 0.1)
    return dist.TCPStore(
        host,
        port,
        is_master=False,
        timeout=timedelta(seconds=max(1.0, deadline - time.monotonic())),
        wait_for_workers=False,
        use_libuv=True,
    )


def _is_ip(s: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(s.strip("[]"))
        return True
    except ValueError:
        return False


def iface_address(iface: str) -> str:
    """The IPv4 address of network interface `iface` (Linux)."""
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            res = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", iface.encode()[:15]))  # SIOCGIFADDR
        except OSError as e:
            raise SetupError(f"wxfer: interface {iface!r} has no IPv4 address: {e}") from None
    return socket.inet_ntoa(res[20:24])


def bind_address(host: str, bind: str | None = None) -> str | None:
    """The address the hosted store listens on (None: every interface)."""
    bind = bind or envs.get("WXFER_STORE_BIND") or None
    if bind is None:
        return host.strip("[]") if _is_ip(host) else None
    if bind in ("*", "0.0.0.0", "::"):
        return None
    return bind.strip("[]") if _is_ip(bind) else iface_address(bind)


def _listen(addr: str, port: int) -> socket.socket:
    fam = socket.AF_INET6 if ":" in addr else socket.AF_INET
    s = socket.socket(fam, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((addr, port))
        s.listen(1024)
    except OSError as e:
        s.close()
        raise OSError(f"binding the store to {addr}:{port}: {e}") from None
    return s


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


_MAC_HEAD = b"WXH1"


def job_secret(secret) -> bytes | None:
    """The job secret as bytes: `secret` (str or bytes), else $WXFER_SECRET, else None."""
    if secret is None:
        secret = envs.get("WXFER_SECRET") or None
    if secret is None:
        return None
    if isinstance(secret, str):
        secret = secret.encode()
    if not isinstance(secret, (bytes, bytearray)) or len(secret) < 16:
        raise ValueError("wxfer: the job secret must be a str or bytes of at least 16 bytes")
    return bytes(secret)


class Control:
    """Namespaced, bounded access to the store.

    secret (bytes, see job_secret): every record written is authenticated with
    HMAC-SHA256 over its key and value, and every record read is checked, so a store writer
    without the secret can neither alter (redirect: swap two descriptors) nor inject records
    (metadata, plans, handshakes, verify reports).  Counters (``add``) are not covered: a
    forged count can stall or fail setup, not redirect a write."""

    def __init__(self, store, name: str = "default", timeout: float = DEFAULT_TIMEOUT, secret: bytes | None = None):
        self.store = store
        self.prefix = "wxfer/%s/" % name
        self.timeout = float(timeout)
        self.secret = secret

    def key(self, k: str) -> str:
        return self.prefix + k

    def _mac(self, key: str, value: bytes) -> bytes:
        import hashlib
        import hmac

        return hmac.new(self.secret, key.encode() + b"\0" + value, hashlib.sha256).digest()

    def _open(self, k: str, raw: bytes) -> bytes:
        """The value of a record read from the store, checked when there is a secret."""
        signed = raw[:4] == _MAC_HEAD and len(raw) >= 36
        if self.secret is None:
            if signed:
                raise SetupError(
                    f"wxfer: store record {self.key(k)!r} is authenticated with a job secret this "
                    "process lacks: give it the same secret (secret= or $WXFER_SECRET)"
                )
            return raw
        import hmac

        if not signed or not hmac.compare_digest(raw[4:36], self._mac(self.key(k), raw[36:])):
            raise SetupError(
                f"wxfer: store record {self.key(k)!r} fails authentication with the job secret: "
                "it was altered or written by someone without the secret (or this process and "
                "the writer use different secrets)"
            )
        return raw[36:]

    def set(self, k: str, value) -> None:
        if isinstance(value, str):
            value = value.encode()
        value = bytes(value)
        if self.secret is not None:
            value = _MAC_HEAD + self._mac(self.key(k), value) + value
        self.store.set(self.key(k), value)

    def add(self, k: str, n: int) -> int:
        return int(self.store.add(self.key(k), n))

    def counters(self, keys: list) -> list:
        """The values of counters `keys` (each made by ``add`` already): one key, one ``add(k, 0)``
        (one store round trip; TCPStore's multi_get waits for the keys first, and took 19-21 us
        against add's 14-15 us on a 2-core CPU); more, one Store.multi_get (a store without it:
        one ``add(k, 0)`` each)."""
        if len(keys) <= 1:
            return [self.add(k, 0) for k in keys]
        multi = getattr(self.store, "multi_get", None)
        if multi is not None:
            try:
                return [int(bytes(v)) for v in multi([self.key(k) for k in keys])]
            except (NotImplementedError, RuntimeError) as e:
                if "not implemented" not in str(e).lower() and not isinstance(e, NotImplementedError):
                    raise
        return [self.add(k, 0) for k in keys]

    def check(self, k: str) -> bool:
        return bool(self.store.check([self.key(k)]))

    def get(
        self, k: str, what: str, timeout: float | None = None, abort: str | None = None, abort_where: str = ""
    ) -> bytes:
        """The value of `k`, waiting at most `timeout` seconds; `what` says what it is and
        who should have written it (used in the error).  Polls (Ctrl-C is honoured within
        50 ms).  abort: a key holding an encode_result(); when it appears holding an error,
        that error is raised (SetupError, naming `abort_where`) instead of waiting on."""
        t = self.timeout if timeout is None else float(timeout)
        deadline = time.monotonic() + t
        delay = 0.001
        key = self.key(k)
        try:
            while not self.store.check([key]):
                if abort is not None and self.check(abort):
                    decode_result(self._open(abort, bytes(self.store.get(self.key(abort)))), abort_where)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"wxfer: waited {t:.0f} s for {what} (store key {key!r})")
                time.sleep(delay)
                delay = min(2 * delay, 0.05)
        except (TimeoutError, SetupError):
            raise
        except Exception as e:  # the store itself failed (its host exited)
            raise TimeoutError(
                f"wxfer: waiting for {what} (store key {key!r}): the store failed: "
                f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            ) from None
        return self._open(k, bytes(self.store.get(key)))

    def get_json(self, k: str, what: str, timeout: float | None = None):
        return json.loads(self.get(k, what, timeout).decode())

    def set_json(self, k: str, obj) -> None:
        self.set(k, json.dumps(obj, separators=(",", ":")))

    def wait_count(self, k: str, n: int, what: str, timeout: float | None = None) -> int:
        """Wait until counter `k` reaches `n` (polling, bounded)."""
        t = self.timeout if timeout is None else float(timeout)
        deadline = time.monotonic() + t
        delay = 0.005
        while True:
            v = self.add(k, 0)
            if v >= n:
                return v
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"wxfer: waited {t:.0f} s for {what}: {v} of {n} arrived (store counter {self.key(k)!r})"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.05)


# --------------------------------------------------------------------------- result / error broadcast

OK, ERR = b"OK", b"ER"


class Bounded:
    """One store look at a time, run on a daemon thread, so that its caller waits at most a
    bound (a store that stopped answering -- SIGSTOPped, a stalled host -- blocks a TCPStore
    call past any timeout of ours: the thread blocked in it is left there, and answers when the
    store does).

    ``look(bound)`` starts `fn` unless a look is in flight already, and waits for it at most
    `bound` seconds from when that look started: callers polling a stuck store all return at
    once, not each after `bound`.  Returns ``(True, value)``; ``(False, seconds)``, the
    seconds the look in flight has taken, when it has not answered; raises what `fn` raised."""

    def __init__(self, fn, name: str):
        import threading

        self._fn, self._name = fn, name
        self._cv = threading.Condition()
        self._asked = self._done = 0  # looks asked for / answered
        self._since = 0.0  # when the look in flight started (monotonic)
        self._value = self._error = None
        self._thread = None
        self._closed = False

    def look(self, bound: float):
        import threading

        with self._cv:
            if self._closed:
                raise RuntimeError(f"wxfer: {self._name}: closed")
            if self._done == self._asked:  # none in flight: ask for one
                self._asked += 1
                self._since = time.monotonic()
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name=f"wxfer {self._name}", daemon=True)
                    self._thread.start()
                self._cv.notify_all()
            want = self._asked
            left = self._since + float(bound) - time.monotonic()
            if left > 0:
                self._cv.wait_for(lambda: self._done >= want, timeout=left)
            if self._done < want:
                return False, time.monotonic() - self._since
            if self._error is not None:
                raise self._error
            return True, self._value

    def in_flight(self) -> bool:
        """A look has been asked for and has not answered."""
        with self._cv:
            return self._done < self._asked

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._asked > self._done or self._closed)
                if self._closed:
                    return
                n = self._asked
            value = error = None
            try:
                value = self._fn()
            except Exception as e:  # noqa: BLE001 -- raised to the caller of look()
                error = e
            with self._cv:
                self._value, self._error, self._done = value, error, n
                self._cv.notify_all()

    def close(self) -> None:
        """The thread ends once idle (one blocked in the store ends when the store answers)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()


def encode_result(payload: bytes | None, error: str | None) -> bytes:
    return ERR + error.encode() if error is not None else OK + (payload or b"")


def decode_result(data: bytes, where: str) -> bytes:
    if data[:2] == ERR:
        raise SetupError(f"wxfer: setup failed on {where}: {data[2:].decode(errors='replace')}")
    if data[:2] != OK:
        raise SetupError(f"wxfer: malformed setup message from {where}")
    return data[2:]


# --------------------------------------------------------------------------- handshake through the store


def hs_key(kind: str, rank: int, gpu: int, epoch: int = 0) -> str:
    """Store key of a handshake message; a restarted worker (epoch >= 1) gets fresh keys."""
    return "hs/%s/%d/%d" % (kind, rank, gpu) + ("/e%d" % epoch if epoch else "")


def writer_connect(
    ctl: Control, transport, rank: int, gpu: int, export_blob: bytes, timeout: float | None = None, epoch: int = 0
) -> int:
    """Trainer side: connect `transport` to receiver `gpu` (its export blob), exchanging the
    handshake through the store.  Returns the peer id."""
    peer = writer_request(ctl, transport, rank, gpu, export_blob, epoch)
    writer_finish(ctl, transport, rank, gpu, peer, timeout, epoch)
    return peer


def writer_request(ctl: Control, transport, rank: int, gpu: int, export_blob: bytes, epoch: int = 0) -> int:
    """Step 1 (trainer): post the handshake request for receiver `gpu`; returns the peer id.
    A trainer posts all its requests first, then collects the replies (writer_finish)."""
    peer, req = transport.connect_request(export_blob)
    ctl.set(hs_key("req", rank, gpu, epoch), req)
    return peer


def writer_finish(
    ctl: Control, transport, rank: int, gpu: int, peer: int, timeout: float | None = None, epoch: int = 0
) -> None:
    """Step 3 (trainer): the receiver's reply, then finish the connection."""
    rep = ctl.get(
        hs_key("rep", rank, gpu, epoch),
        f"the handshake reply of inference worker gpu {gpu} to trainer rank {rank}",
        timeout,
    )
    rep = decode_result(rep, f"inference worker gpu {gpu} answering trainer rank {rank}")
    transport.connect_finish(peer, rep)


def target_accept(ctl: Control, transport, rank: int, gpu: int, timeout: float | None = None, epoch: int = 0) -> None:
    """Receiver side: answer the handshake request of trainer `rank` (or raise the trainers'
    setup error, should their connect phase fail first)."""
    try:
        req = ctl.get(
            hs_key("req", rank, gpu, epoch),
            f"the handshake request of trainer rank {rank} to inference worker gpu {gpu}",
            timeout,
            abort=None if epoch else "setup",
            abort_where="the trainers (connecting to the inference workers)",
        )
    except SetupError:
        if not epoch and ctl.check("setup"):  # the trainers' error was read: they need not linger for it
            ctl.add("setup/acks", 1)
        raise
    try:
        rep = transport.accept(req) if req else b""
        ctl.set(hs_key("rep", rank, gpu, epoch), encode_result(rep, None))
    except Exception as e:
        ctl.set(hs_key("rep", rank, gpu, epoch), encode_result(None, f"{type(e).__name__}: {e}"))
        raise SetupError(f"wxfer: inference worker gpu {gpu}: accepting trainer rank {rank}: {e}") from e


# --------------------------------------------------------------------------- gloo among trainers


def gloo_group(timeout: float = DEFAULT_TIMEOUT):
    """A gloo process group over all trainer ranks (the default group when it is gloo)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))


def agree(group, error: str | None, rank: int, what: str, timeout: float = DEFAULT_TIMEOUT) -> None:
    """Every rank learns every rank's setup error; all of them raise (naming the ranks).
    Bounded by `timeout` and interruptible (gather_strings)."""
    if group is None:
        if error:
            raise SetupError(f"wxfer: {what} failed on trainer rank {rank}: {error}")
        return
    errs = gather_strings(group, error, timeout, f"the trainer ranks' results of {what} (trainer rank {rank})")
    bad = [(r, e) for r, e in enumerate(errs) if e]
    if bad:
        err = SetupError(
            f"wxfer: {what} failed on %d trainer rank(s):\n  " % len(bad)
            + "\n  ".join(f"rank {r}: {e}" for r, e in bad)
        )
        err.ranks = [r for r, _ in bad]
        raise err


def gather_strings(group, s: str | None, timeout: float, what: str) -> list:
    """Every rank's `s` (None allowed): two asynchronous gloo all-gathers of fixed-size
    tensors (the lengths, then the bytes padded to the longest), each waited for by
    wait_work, so the whole exchange is bounded by `timeout` and Ctrl-C is honoured within
    50 ms (dist.all_gather_object waits for gloo's own timeout, 30 min by default)."""
    import torch
    import torch.distributed as dist

    deadline = time.monotonic() + timeout
    w = dist.get_world_size(group)
    data = b"" if s is None else str(s).encode()
    n = torch.tensor([-1 if s is None else len(data)], dtype=torch.int64)
    ns = [torch.zeros(1, dtype=torch.int64) for _ in range(w)]
    wait_work(dist.all_gather(ns, n, group=group, async_op=True), timeout, what)
    lens = [int(x.item()) for x in ns]
    buf = torch.zeros(max(1, *lens), dtype=torch.uint8)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    outs = [torch.zeros_like(buf) for _ in range(w)]
    left = max(0.0, deadline - time.monotonic())
    wait_work(dist.all_gather(outs, buf, group=group, async_op=True), left, what)
    return [None if k < 0 else bytes(o[:k].numpy()).decode(errors="replace") for k, o in zip(lens, outs)]


def gather_json(group, obj, timeout: float, what: str) -> list:
    """Every rank's JSON-able `obj` (tuples come back as lists), bounded like gather_strings."""
    return [json.loads(x) for x in gather_strings(group, json.dumps(obj), timeout, what)]


def roll_call(ctl, key: str, rank: int, world: int, wait: float) -> list:
    """After a collective among the trainer ranks failed: each live rank answers in the
    store under `key`; returns the ranks that did not answer within `wait` seconds (dead
    or hung), as "trainer rank R (pid N, host H)" from what each published at setup
    (publish_who).  Polls: bounded and interruptible."""
    ctl.set(f"{key}/{rank}", b"1")
    deadline = time.monotonic() + wait
    missing = [r for r in range(world) if r != rank]
    while True:
        missing = [r for r in missing if not ctl.check(f"{key}/{r}")]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return [who(ctl, r) for r in missing]


def publish_who(ctl, rank: int, extra: dict | None = None) -> None:
    """This trainer rank's pid and host, for messages naming it (roll_call); `extra`: more of
    it (its start time and lease, wxfer.runtime.liveness, for the workers it writes)."""
    ctl.set_json(f"train/{rank}/who", dict(extra or {}, pid=os.getpid(), host=socket.gethostname()))


def who(ctl, rank: int) -> str:
    try:
        w = json.loads(ctl.get(f"train/{rank}/who", f"trainer rank {rank}'s pid", 0.5).decode())
        return f"trainer rank {rank} (pid {w['pid']}, host {w['host']})"
    except Exception:  # noqa: BLE001 -- it never published it
        return f"trainer rank {rank}"


def wait_key(ctl, key: str, timeout: float, alive, failed, late: str) -> None:
    """Wait until `key` is in the store (a look every 50 ms), at most `timeout` seconds: the
    exception ``failed(why)`` once ``alive()`` returns why its writer will not write it (its
    init failed), TimeoutError(`late`) past the bound."""
    deadline = time.monotonic() + timeout
    while not ctl.check(key):
        err = alive()
        if err:
            raise failed(err)
        if time.monotonic() > deadline:
            raise TimeoutError(late)
        time.sleep(0.05)


def wait_work(work, timeout: float, what: str) -> None:
    """Wait for a gloo Work, polling (Ctrl-C within 50 ms), at most `timeout` seconds;
    CollectiveError when it fails or is late (a trainer rank died or hung)."""
    deadline = time.monotonic() + timeout
    delay = 0.0005
    try:
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise CollectiveError(
                    f"wxfer: {what} did not complete within {timeout:.0f} s (a trainer rank died or hung?)"
                )
            time.sleep(delay)
            delay = min(2 * delay, 0.05)
        ok = work.wait(timedelta(seconds=max(1.0, deadline - time.monotonic())))
    except CollectiveError:
        raise
    except Exception as e:
        raise CollectiveError(f"wxfer: {what} failed: {e}") from e
    if ok is False:
        raise CollectiveError(f"wxfer: {what} did not complete within {timeout:.0f} s")


class Barrier:
    """An asynchronous gloo barrier (stage 4) whose wait is bounded."""

    def __init__(self, group, what: str):
        import torch.distributed as dist

        self.what = what
        self.work = dist.barrier(group=group, async_op=True) if group is not None else None

    def wait(self, timeout: float) -> None:
        if self.work is None:
            return
        work, self.work = self.work, None
        wait_work(work, timeout, self.what)
