"""libFuzzer (atheris) target over every decoder that reads bytes from another process:
region descriptors, export blobs (C, in wxfer._wxfer) and serialized plans (Python).

Accepted outcomes for any input: a value, or wxfer's own Error / ValueError. Anything else
(another exception, a crash, a hang) is a finding.

    python tests/fuzz/fuzz_decoders.py CORPUS_DIR -max_total_time=60
"""

import sys
import zlib

import atheris

with atheris.instrument_imports():
    from wxfer import _wxfer
    from wxfer.plan import serialize


def _wrap_plan(body: bytes) -> bytes:
    comp = zlib.compress(body)
    return serialize._HEAD.pack(serialize.MAGIC, serialize.VERSION, len(comp), zlib.crc32(comp)) + comp


def one_input(data: bytes) -> None:
    if not data:
        return
    which, rest = data[0] % 4, data[1:]
    try:
        if which == 0:
            _wxfer.decode_descriptor(rest)
        elif which == 1:
            _wxfer.decode_export(rest)
        elif which == 2:
            serialize.decode(rest)
        else:
            # past the magic, length and checksum: reach the parser itself
            serialize.decode(_wrap_plan(rest))
    except (_wxfer.Error, ValueError):
        pass


def main(argv):
    atheris.Setup(argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
