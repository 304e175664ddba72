"""Which transport a receiver opens, with which options, and how its memory is registered:
``transport_choice`` (the name and options a receiver publishes), ``capabilities`` (what a
backend declares of itself in C), ``gpu_memory_options`` / ``registration_info`` (GPU memory
for a NIC), and the CUDA allocator segments a ``register="segments"`` receiver registers
(``_segment_bases``).  Split out of receiver.py, which imports them from here."""

from __future__ import annotations

from .. import envs
from .control import SetupError


def capabilities(transport: str) -> dict:
    """What backend `transport` declares of itself in C (`_wxfer.capabilities()`: the options
    it accepts, which name this host's own resources, which both ends share, their defaults,
    the GPU-memory check, the memory it writes, same host only, whether it sees a dead peer);
    {} for a name this build does not know."""
    from .. import _wxfer

    return _wxfer.capabilities().get(transport) or {}


def transport_choice(transport: str, device_type: str, options: dict | None = None) -> tuple[str, dict]:
    """(backend name, options) for "auto" or an explicit name.

    auto: the usable backends that write `device_type` memory, in the order they declare
    (CUDA memory: cuda_ipc for GPUs of one node, else verbs, else fabric; host memory:
    fabric). $WXFER_TRANSPORT overrides "auto". The options both ends must share (fabric's
    provider) get the backend's default when not given (read in C: $WXFER_FABRIC_PROVIDER,
    else tcp), so the receivers publish the value their writers open with."""
    from .. import _wxfer

    opts = dict(options or {})
    if transport == "auto":
        transport = envs.get("WXFER_TRANSPORT", "auto")
    avail = _wxfer.backends()
    if transport == "auto":
        mem = "cuda" if device_type == "cuda" else "host"
        caps = _wxfer.capabilities()
        order = [n for _, n in sorted((c["auto"][mem], n) for n, c in caps.items() if c and c["auto"][mem])]
        for name in order:
            if avail.get(name, (False, ""))[0]:
                transport = name
                break
        else:
            raise SetupError(
                "wxfer: no usable transport for %s memory: %s"
                % (device_type, "; ".join("%s: %s" % (n, avail.get(n, (False, "unknown"))[1]) for n in order))
            )
    elif not avail.get(transport, (False, "unknown transport"))[0]:
        raise SetupError(
            "wxfer: transport %r is not usable here: %s"
            % (transport, avail.get(transport, (False, "unknown transport"))[1])
        )
    caps = capabilities(transport)
    for k in caps.get("shared_options", ()):
        if k in caps["defaults"]:
            opts.setdefault(k, caps["defaults"][k])
    return transport, opts


def gpu_memory_options(transport: str, device, options: dict) -> dict:
    """`options` plus what makes `transport` check, when it opens, that it can register GPU
    memory of `device` with the network, so that a machine where it cannot fails at setup
    with the cause and its fix, before any byte moves: the backend's declared gpu_check
    (verbs gpu=<index> gpu_memory=yes: dma-buf or nvidia-peermem, docs/verbs.md; fabric
    hmem=on: a provider offering FI_HMEM). Host memory and cuda_ipc: unchanged. Options the
    caller gave win."""
    opts = dict(options)
    if getattr(device, "type", device) != "cuda":
        return opts
    index = str(getattr(device, "index", None) or 0)
    for k, v in capabilities(transport).get("gpu_check", {}).items():
        opts.setdefault(k, v.replace("{gpu}", index))
    return opts


def registration_info(transport: str, info: str) -> str:
    """How this transport registers memory with the network, from its info() text: verbs: the
    registration route (host, dmabuf, peermem) and why, and the GPU route decided at open;
    fabric: the provider, whether it offers FI_HMEM, and its registrations by memory kind."""
    import re

    if transport == "verbs":
        parts = []
        m = re.search(r"registration=(\S+) \((.*?)\) reg_calls", info)
        if m:
            parts.append("registration=%s (%s)" % (m.group(1), m.group(2)))
        m = re.search(r"gpu_route=(\S+) \((.*?)\)(?: TEST-ONLY|$)", info)
        if m:
            parts.append("gpu_route=%s (%s)" % (m.group(1), m.group(2)))
        return "; ".join(parts) or info
    if transport == "fabric":
        d = dict(re.findall(r"(provider|hmem|reg_host|reg_cuda)=(\S+)", info))
        if d:
            return "provider %s, FI_HMEM %s, registered: %s host, %s CUDA (FI_HMEM_CUDA)" % (
                d.get("provider"),
                "offered" if d.get("hmem") == "yes" else "not offered",
                d.get("reg_host", "?"),
                d.get("reg_cuda", "?"),
            )
    return transport


def _storage_base(t):
    """A uint8 tensor over the whole storage of `t` (shares its memory)."""
    import torch

    st = t.untyped_storage()
    base = torch.empty(0, dtype=torch.uint8, device=t.device)
    base.set_(st, 0, (st.nbytes(),), (1,))
    return base


class _CudaRange:
    """A raw CUDA address range as a __cuda_array_interface__ producer."""

    def __init__(self, addr: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (addr, False),
            "version": 3,
            "strides": None,
        }


def _segment_bases(tensors):
    """{storage ptr: (segment base tensor, segment address)} for CUDA tensors, from the caching
    allocator's snapshot; storages not found in a segment are left out."""
    import torch

    segs = []
    for s in torch.cuda.memory_snapshot():
        segs.append((int(s["address"]), int(s["total_size"]), int(s["device"])))
    segs.sort()
    out, made = {}, {}
    for t in tensors:
        ptr = t.untyped_storage().data_ptr()
        for a, n, dev in segs:
            if a <= ptr < a + n and dev == t.device.index:
                if a not in made:
                    with torch.cuda.device(dev):
                        made[a] = torch.as_tensor(_CudaRange(a, n), device="cuda:%d" % dev)
                out[ptr] = (made[a], a)
                break
    return out
