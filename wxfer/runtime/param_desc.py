"""A parameter's descriptor as the trainers receive it: (byte offset in its registered region,
the region's transport descriptor), and the base64 text form that store records carry."""

from __future__ import annotations

import base64
import struct

_DESC_HEAD = struct.Struct("<Q")


def encode_param_descriptor(region_descriptor: bytes, offset: int) -> bytes:
    return _DESC_HEAD.pack(offset) + bytes(region_descriptor)


def decode_param_descriptor(data: bytes) -> tuple[bytes, int]:
    if len(data) < _DESC_HEAD.size + 1:
        raise ValueError("wxfer: parameter descriptor too short (%d bytes)" % len(data))
    (off,) = _DESC_HEAD.unpack_from(data)
    return bytes(data[_DESC_HEAD.size :]), off


def _b64(b: bytes) -> str:
    return base64.b64encode(bytes(b)).decode()


def _unb64(s: str) -> bytes:
    return base64.b64decode(s.encode())


def _dtype_name(dt) -> str:
    return str(dt).replace("torch.", "")
