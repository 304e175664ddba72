"""Descriptor and export-blob decoding: round trips, and clean errors (never a crash) on
truncated, garbage and wrong-version input."""

import os
import random
import struct

import pytest

from wxfer import _wxfer

KIND_FABRIC = 1


def rinfo(key=7, base=0x1000, nbytes=4096, mem=1, device=-1, blob=b""):
    return struct.pack("<QQQIiI", key, base, nbytes, mem, device, len(blob)) + blob


def desc(addr=b"addr-bytes", version=1, kind=KIND_FABRIC, **kw):
    return b"WXD" + bytes([version, kind, 0, 0, 0]) + struct.pack("<I", len(addr)) + addr + rinfo(**kw)


def export(addr=b"addr", regions=(), version=1, kind=KIND_FABRIC, count=None):
    body = b"".join(rinfo(**r) for r in regions)
    n = len(regions) if count is None else count
    return b"WXE" + bytes([version, kind, 0, 0, 0]) + struct.pack("<I", len(addr)) + addr + struct.pack("<I", n) + body


def test_descriptor_round_trip_fields():
    d = _wxfer.decode_descriptor(desc(addr=b"xyz", key=0xABC, base=0x10, nbytes=99, blob=b"hi"))
    assert d["transport"] == "fabric"
    assert d["address"] == b"xyz"
    assert d["region"] == {"key": 0xABC, "base": 0x10, "nbytes": 99, "mem": "host", "device": -1, "blob": b"hi"}


def test_export_round_trip():
    e = _wxfer.decode_export(export(regions=[dict(key=1), dict(key=2, mem=2, device=3)]))
    assert [r["key"] for r in e["regions"]] == [1, 2]
    assert e["regions"][1]["mem"] == "cuda" and e["regions"][1]["device"] == 3


@pytest.mark.parametrize("cut", range(0, 60, 3))
def test_truncated_descriptor_is_a_clean_error(cut):
    full = desc()
    with pytest.raises(_wxfer.Error) as ei:
        _wxfer.decode_descriptor(full[:cut])
    assert "descriptor" in str(ei.value)


def test_a_decode_failure_is_a_decode_error_from_module_state(monkeypatch):
    """DecodeError (an Error and a ValueError) is held in the module's state: rebinding the
    module attribute does not change what the decoders raise."""
    cls = _wxfer.DecodeError
    assert issubclass(cls, _wxfer.Error) and issubclass(cls, ValueError)
    monkeypatch.setattr(_wxfer, "DecodeError", None)
    for fn in (_wxfer.decode_descriptor, _wxfer.decode_export):
        with pytest.raises(cls) as ei:
            fn(b"XXXX")
        assert type(ei.value) is cls and ei.value.errno and fn.__name__ in str(ei.value)


def test_wrong_version_and_magic_and_kind():
    with pytest.raises(_wxfer.Error, match="version 9"):
        _wxfer.decode_descriptor(desc(version=9))
    with pytest.raises(_wxfer.Error, match="magic"):
        _wxfer.decode_descriptor(b"XXXX" + desc()[4:])
    with pytest.raises(_wxfer.Error, match="kind"):
        _wxfer.decode_descriptor(desc(kind=77))
    with pytest.raises(_wxfer.Error, match="trailing"):
        _wxfer.decode_descriptor(desc() + b"\0")


def test_oversized_fields_refused():
    with pytest.raises(_wxfer.Error, match="address length"):
        _wxfer.decode_descriptor(desc(addr=b"a" * 300))
    with pytest.raises(_wxfer.Error, match="blob length"):
        _wxfer.decode_descriptor(desc(blob=b"b" * 200))
    with pytest.raises(_wxfer.Error, match="wraps"):
        _wxfer.decode_descriptor(desc(base=2**64 - 10, nbytes=100))


def test_export_count_larger_than_buffer_refused_before_allocating():
    with pytest.raises(_wxfer.Error, match="truncated|claims"):
        _wxfer.decode_export(export(regions=[dict()], count=1_000_000))
    with pytest.raises(_wxfer.Error, match="claims"):
        _wxfer.decode_export(export(count=0xFFFFFFFF))


def test_random_garbage_never_crashes():
    rng = random.Random(1234)
    good_d, good_e = desc(), export(regions=[dict(), dict(key=3)])
    for i in range(3000):
        base = good_d if i % 2 else good_e
        b = bytearray(base)
        for _ in range(rng.randint(1, 6)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        b = bytes(b[: rng.randint(0, len(b))]) if i % 3 == 0 else bytes(b)
        for fn in (_wxfer.decode_descriptor, _wxfer.decode_export):
            try:
                fn(b)
            except _wxfer.Error:
                pass
    for _ in range(500):
        junk = os.urandom(rng.randint(0, 200))
        with pytest.raises(_wxfer.Error):
            _wxfer.decode_descriptor(junk)


def test_parse_size():
    assert _wxfer.parse_size("64MiB") == 64 << 20
    assert _wxfer.parse_size("2GiB") == 2 << 30
    assert _wxfer.parse_size("4k") == 4096
    assert _wxfer.parse_size("123") == 123
    for bad in ("", "x", "-1", "12Q", "1 MiBx"):
        with pytest.raises(ValueError):
            _wxfer.parse_size(bad)
