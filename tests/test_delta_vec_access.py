"""The fused delta kernel's shadow reads and writes (wx_old16 / wx_put16 in
csrc/prepare/wx_delta_kernel.cu: 16, 8 or 4 bytes at a time as the piece's rows are aligned,
else byte by byte) give exactly the bytes of plain byte copies: their text, copied out of the
kernel source, is compiled on the CPU into tests/c/delta_vec_check.c (C++) and run over random
alignments, lengths and change masks. The kernel itself runs in tests/test_delta_gpu.py (shapes
with 16-, 8-, 4- and 1-aligned rows)."""

import os

from helpers import run_c_check  # tests/helpers.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIRST = "/* The widest access p's alignment allows"
AFTER = "/* The tile's scale: before it is written"


def test_shadow_accesses_equal_byte_copies(tmp_path):
    with open(os.path.join(ROOT, "csrc", "prepare", "wx_delta_kernel.cu")) as f:
        src = f.read()
    assert src.count(FIRST) == 1 and src.count(AFTER) == 1, "the helpers' markers moved: update this test"
    (tmp_path / "delta_vec_helpers.h").write_text(src[src.index(FIRST) : src.index(AFTER)])
    p = run_c_check(tmp_path, "delta_vec_check", ["-x", "c++", "-O1", "-fno-strict-aliasing", "-I", str(tmp_path)])
    assert p.returncode == 0 and p.stdout.startswith("ok "), p.stdout[-2000:]
    assert int(p.stdout.split()[1]) == 200_000


BITS_FIRST = "/* WX_DBITS: the bitmask words of the tile row"
BITS_AFTER = "/* wx_tile16's work into the shadow"


def test_owned_bitmask_words_equal_the_ored_bits(tmp_path):
    """wx_dbits_row (WX_DBITS 1 and 2: a tile row's bitmask words by plain stores) leaves the
    bitmask the atomics' OR would: tests/c/delta_bits_check.c, one warp emulated lane by lane."""
    with open(os.path.join(ROOT, "csrc", "prepare", "wx_delta_kernel.cu")) as f:
        src = f.read()
    assert src.count(BITS_FIRST) == 1 and src.count(BITS_AFTER) == 1, "the helper's markers moved: update this test"
    (tmp_path / "delta_bits_helper.h").write_text(src[src.index(BITS_FIRST) : src.index(BITS_AFTER)])
    inc = ["-I", str(tmp_path), "-I", os.path.join(ROOT, "csrc", "prepare")]
    for mode in (1, 2):
        p = run_c_check(tmp_path, "delta_bits_check", ["-x", "c++", "-O1", f"-DWX_DBITS={mode}", *inc])
        assert p.returncode == 0 and p.stdout.startswith("ok "), (mode, p.stdout[-2000:])
        assert int(p.stdout.split()[1]) == 20_000
