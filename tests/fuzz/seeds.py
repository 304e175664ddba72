"""Write the seed corpus of the libFuzzer target tests/fuzz/fuzz_desc.c into DIR: a real
descriptor and a real export blob of the fabric transport (first byte: 0 = descriptor,
1 = export blob), plus a few hand-made edge cases. Usage: python tests/fuzz/seeds.py DIR"""

import os
import sys

import numpy as np

import wxfer
from wxfer import _wxfer


def main(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    seeds = [b"\x00WXD\x01\x01\x00\x00\x00\x00\x00\x00", b"\x01WXE\x01\x01\x00\x00\x00\x00\x00\x00"]
    if wxfer.backends()["fabric"]["available"]:
        t = _wxfer.Transport("fabric", {"provider": "tcp"})
        regions = [t.register(np.zeros(n, np.uint8)) for n in (4096, 100)]
        seeds += [b"\x00" + regions[0].descriptor, b"\x01" + t.export()]
        for r in regions:
            r.close()
        t.close()
    for i, s in enumerate(seeds):
        with open(os.path.join(out, "seed%d" % i), "wb") as f:
            f.write(s)


if __name__ == "__main__":
    main(sys.argv[1])
