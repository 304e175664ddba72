"""Versioned plan bytes: round trip, and clean ValueErrors on hostile input."""

import json
import struct
import zlib

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from wxfer.meta import Cluster
from wxfer.plan import Plan, plan_for
from wxfer.plan.serialize import MAGIC, VERSION, _HEAD
from helpers import small_moe  # tests/helpers.py

COLS = ("sender", "task", "shard", "replica", "infer_rank", "dst", "dst_offset", "nbytes", "src_offset")


@pytest.fixture(scope="module")
def plan():
    c = Cluster(
        train_gpus=4,
        infer_gpus=4,
        infer_tp=2,
        gpus_per_node=2,
        dense_shard=2,
        expert_shard=2,
        infer_ep=True,
        quant="fp8",
    )
    from wxfer.mapping import get_preset

    pre = get_preset("qwen3-30b-a3b")
    pre.config = small_moe(pre.config, 8, layers=2, vocab=512)
    p = plan_for(pre, c)
    p.descriptors[(3, p.names[0])] = b"\x00addr\xff"
    return p


def _same(a: Plan, b: Plan):
    for k in COLS:
        assert np.array_equal(getattr(a, k), getattr(b, k)), k
    assert a.names == b.names and a.meshes == b.meshes and a.groups == b.groups and a.mesh_tasks == b.mesh_tasks
    assert [(t.name, t.sources, t.mesh, t.group, t.src_bytes, t.shards) for t in a.tasks] == [
        (t.name, t.sources, t.mesh, t.group, t.src_bytes, t.shards) for t in b.tasks
    ]
    assert np.array_equal(a.dest_nbytes, b.dest_nbytes) and np.array_equal(a.gpu_of, b.gpu_of)
    assert a.train_params == b.train_params and a.descriptors == b.descriptors and a.ignored == b.ignored
    assert (a.tp, a.replicas, a.quant, a.ep, a.train_world) == (b.tp, b.replicas, b.quant, b.ep, b.train_world)


def test_round_trip(plan):
    data = plan.to_bytes()
    assert data[:6] == MAGIC
    back = Plan.from_bytes(data)
    _same(plan, back)
    assert back.check() == []
    assert len(data) < 40 * plan.n_transfers + 20000  # compact


def test_every_truncation_is_a_clean_value_error(plan):
    data = plan.to_bytes()
    for n in list(range(0, 64)) + list(range(64, len(data), max(1, len(data) // 200))):
        with pytest.raises(ValueError):
            Plan.from_bytes(data[:n])
    with pytest.raises(ValueError, match="truncated or padded"):
        Plan.from_bytes(data + b"\0")


def test_wrong_magic_version_and_checksum(plan):
    data = bytearray(plan.to_bytes())
    with pytest.raises(ValueError, match="magic"):
        Plan.from_bytes(b"NOTAPL" + bytes(data[6:]))
    bad = bytearray(data)
    struct.pack_into("<H", bad, 6, VERSION + 1)
    with pytest.raises(ValueError, match=f"version {VERSION + 1}"):
        Plan.from_bytes(bytes(bad))
    bad = bytearray(data)
    bad[-5] ^= 0x40
    with pytest.raises(ValueError, match="checksum"):
        Plan.from_bytes(bytes(bad))
    with pytest.raises(ValueError):
        Plan.from_bytes("not bytes")


def _wrap(body: bytes) -> bytes:
    comp = zlib.compress(body)
    return _HEAD.pack(MAGIC, VERSION, len(comp), zlib.crc32(comp)) + comp


def test_valid_checksum_but_garbage_inside(plan):
    body = zlib.decompress(plan.to_bytes()[_HEAD.size :])
    (hl,) = struct.unpack_from("<I", body)
    header = json.loads(body[4 : 4 + hl])
    arrays = body[4 + hl :]
    for junk in (b"", b"\x01\x00", b"\xff\xff\xff\xff{}", struct.pack("<I", 2) + b"[]", struct.pack("<I", 3) + b"{x}"):
        with pytest.raises(ValueError):
            Plan.from_bytes(_wrap(junk))

    def with_header(h, arr=arrays):
        hj = json.dumps(h).encode()
        return _wrap(struct.pack("<I", len(hj)) + hj + arr)

    Plan.from_bytes(with_header(header))  # re-wrapping untouched parts is fine
    for mutate in (
        lambda h: h.update(tp=0),
        lambda h: h["meshes"].append([999]),
        lambda h: h.update(names=h["names"][:1]),
        lambda h: h["tasks"].pop(),
        lambda h: h["arrays"][0].__setitem__(2, 10**12),
        lambda h: h["groups"].pop(),
        lambda h: h.pop("names"),
        lambda h: h["tasks"][0].__setitem__(1, -1),
    ):
        h = json.loads(json.dumps(header))
        mutate(h)
        with pytest.raises(ValueError):
            Plan.from_bytes(with_header(h))
    # an out-of-range index inside the transfer columns
    names = [a[0] for a in header["arrays"]]
    sizes = [a[2] * (1 if a[1] == "u1" else 8) for a in header["arrays"]]
    pos = sum(sizes[: names.index("t_sender")])
    arr = bytearray(arrays)
    struct.pack_into("<q", arr, pos, 10**6)
    with pytest.raises(ValueError, match="sender out of range"):
        Plan.from_bytes(with_header(header, bytes(arr)))


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_never_crash(blob):
    for data in (blob, _HEAD.pack(MAGIC, VERSION, len(blob), zlib.crc32(blob)) + blob, _wrap(blob)):
        with pytest.raises(ValueError):
            Plan.from_bytes(data)


def test_a_small_blob_cannot_inflate_beyond_its_cap():
    """1 MB of zlib claiming a 1 GiB array is refused before the array is inflated (the
    decoder inflated up to 4 GiB before checking anything), within a few MB of memory."""
    import resource

    from wxfer.plan.serialize import MAX_RATIO, body_cap

    hj = json.dumps(dict(arrays=[["task_src_start", "u1", 1 << 30]])).encode()
    z = zlib.compressobj(9)
    parts = [z.compress(struct.pack("<I", len(hj)) + hj)]
    chunk = bytes(1 << 20)
    for _ in range(1024):  # 1 GiB of zeros: about 1 MB compressed
        parts.append(z.compress(chunk))
    comp = b"".join(parts) + z.flush()
    assert len(comp) < 2 << 20
    blob = _HEAD.pack(MAGIC, VERSION, len(comp), zlib.crc32(comp)) + comp
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ValueError, match=f"array task_src_start declares {1 << 30} bytes.*{MAX_RATIO}x"):
        Plan.from_bytes(blob)
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mb < 64, grown_mb  # peak RSS, kB on Linux
    assert body_cap(len(comp)) < 300 << 20


def test_a_body_larger_than_declared_is_refused(plan):
    """Bytes after the declared arrays are refused (the declared sizes bound what is read)."""
    body = zlib.decompress(plan.to_bytes()[_HEAD.size :])
    with pytest.raises(ValueError, match="trailing bytes"):
        Plan.from_bytes(_wrap(body + bytes(100)))
    with pytest.raises(ValueError, match="ends after"):
        Plan.from_bytes(_wrap(body[:-1]))
