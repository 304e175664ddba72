"""The batched copy kernel (csrc/prepare/wx_copy_kernel.cu, through wxfer.runtime.copies) and
the driver's batched copy (cuMemcpyBatchAsync): the range table and validation (CPU), the
torch fallback and why it ran (CPU), and on a GPU, by each copier, every byte of many ranges
in one call -- sizes around the 16-byte vectors and the 64 KiB
chunks, unaligned and mutually misaligned addresses, hundreds of ranges -- with the bytes
between the ranges untouched, and the device table reused when the same batch comes again."""

import array
import random

import pytest
import torch

from wxfer import _wxfer
from wxfer.runtime import copies

FILL = 0x5A


def _table(sizes, base=1 << 20):
    t = array.array("Q")
    chunk0 = 0
    for i, n in enumerate(sizes):
        t.extend((base + 2 * i * (1 << 30), base + (2 * i + 1) * (1 << 30), n, chunk0))
        chunk0 += -(-n // copies.CHUNK)
    return t, chunk0


def test_table_counts_chunks_as_the_kernel_does():
    sizes = [1, copies.CHUNK, copies.CHUNK + 1, 3 * copies.CHUNK - 1, 17]
    t, chunks = _table(sizes)
    assert _wxfer.copy_check(t) == chunks == 1 + 1 + 2 + 3 + 1
    items = [(None, None, t[4 * i], t[4 * i + 1], n) for i, n in enumerate(sizes)]
    assert copies.table(items) == t  # the Python table is the one the kernel is given


@pytest.mark.parametrize(
    "field, value, says",
    [
        (0, 0, "copy range 1: null destination address"),
        (1, 0, "copy range 1: null source address"),
        (2, 0, "copy range 1: 0 bytes"),
        (3, 0, "copy range 1: chunk0 0, expected 1"),
        (0, (1 << 64) - 4, "copy range 1: its bytes wrap"),
    ],
)
def test_a_bad_range_is_refused_naming_it(field, value, says):
    t, _ = _table([100, 200, 300])
    t[4 + field] = value
    with pytest.raises(_wxfer.Error, match=says):
        _wxfer.copy_check(t)


def test_a_launch_with_a_bad_grid_is_refused_before_any_device_is_touched():
    """copy_launch's ctas_per_sm (wxfer.runtime.overlap's small grid): 0 (the product's) to 64;
    another value refused naming it, before the kernel or a device is looked at."""
    t, _ = _table([100, 200])
    for bad in (-1, 65):
        with pytest.raises(_wxfer.Error, match=f"copy: ctas_per_sm {bad} \\(expected 0"):
            _wxfer.copy_launch(0, 0, t, 1 << 20, bad)


def test_a_table_of_the_wrong_size_is_refused():
    with pytest.raises(ValueError, match="copy range table: 24 bytes"):
        _wxfer.copy_check(array.array("Q", [1, 2, 3]))
    with pytest.raises(ValueError, match="copy range table: 0 bytes"):
        _wxfer.copy_check(array.array("Q"))


def test_cpu_tensors_are_copied_by_torch_and_it_says_why(monkeypatch):
    src = torch.arange(1000, dtype=torch.uint8)
    dst = torch.full((1000,), FILL, dtype=torch.uint8)
    items = [(dst[a:b], src[c : c + b - a], 0, 0, b - a) for a, b, c in ((0, 10, 5), (100, 400, 600), (999, 1000, 0))]
    assert copies.copy_ranges(torch.device("cpu"), items) == "torch._foreach_copy_"
    assert "CUDA devices only" in copies.last()["reason"]
    want = torch.full((1000,), FILL, dtype=torch.uint8)
    want[0:10], want[100:400], want[999:1000] = src[5:15], src[600:900], src[0:1]
    assert torch.equal(dst, want)
    monkeypatch.setenv("WXFER_COPY", "torch")
    assert copies.info(torch.device("cpu"))["reason"] == "WXFER_COPY=torch"
    monkeypatch.setenv("WXFER_COPY", "fast")
    assert "expected native or torch" in copies.info(torch.device("cpu"))["reason"]


def test_the_driver_batch_validates_its_copies_and_says_why_it_cannot_run():
    """copy_batch's table is (dst, src, nbytes) triples; a null address or 0 bytes is refused
    naming the copy before any driver call; without a CUDA driver the probe says so."""
    with pytest.raises(ValueError, match=r"copy_batch table: 16 bytes \(expected 1 to \d+ \(dst, src, nbytes\)"):
        _wxfer.copy_batch(0, 0, array.array("Q", [1, 2]))
    for bad, says in (
        ((1 << 20, 0, 8), "copy 1: null address"),
        ((1 << 20, 1 << 21, 0), "copy 1: null address or 0 bytes"),
    ):
        with pytest.raises(_wxfer.Error, match=says):
            _wxfer.copy_batch(0, 0, array.array("Q", [1 << 20, 1 << 21, 8, *bad]))
        with pytest.raises(_wxfer.Error, match=says):  # (beside the SMs' work: wxfer.runtime.overlap)
            _wxfer.copy_batch(0, 0, array.array("Q", [1 << 20, 1 << 21, 8, *bad]), True)
    if not torch.cuda.is_available():
        ok, why = _wxfer.copy_batch_probe(0)
        assert not ok and ("libcuda" in why or "cuInit" in why)
        assert copies.driver_why(torch.device("cuda", 0)) == why
        inf = copies.info(torch.device("cuda", 0), copier="driver")  # neither path: both reasons
        assert inf["copier"] == "torch._foreach_copy_" and inf["reason"].endswith("; and " + why)


def test_wxfer_copy_torch_or_a_typo_keeps_the_driver_batch_off_too(monkeypatch):
    for value, allowed in (("", True), ("native", True), ("torch", False), ("fast", False)):
        monkeypatch.setenv("WXFER_COPY", value)
        assert copies._PROBE.allowed() is allowed
    monkeypatch.setenv("WXFER_COPY", "torch")
    assert copies.info(torch.device("cuda", 0), copier="driver")["reason"] == "WXFER_COPY=torch"


def test_the_copier_switch_is_checked_and_cpu_tensors_go_to_torch_with_either():
    src = torch.arange(64, dtype=torch.uint8)
    dst = torch.zeros(64, dtype=torch.uint8)
    items = [(dst[:40], src[24:], 0, 0, 40)]
    assert copies.COPIER in copies.COPIERS == ("kernel", "driver")
    with pytest.raises(ValueError, match="copier must be one of .* got 'dma'"):
        copies.copy_ranges(torch.device("cpu"), items, copier="dma")
    assert copies.copy_ranges(torch.device("cpu"), items, copier="driver") == "torch._foreach_copy_"
    assert torch.equal(dst[:40], src[24:]) and not dst[40:].any()
    assert "CUDA devices only" in copies.last()["reason"]
    assert "CUDA devices only" in copies.driver_why(torch.device("cpu"))


def test_an_empty_batch_launches_nothing():
    before = dict(copies._calls)
    assert copies.copy_ranges(torch.device("cpu"), []) == "none"
    assert copies._calls == before


@pytest.fixture(scope="module")
def gpu():
    d = torch.device("cuda", torch.cuda.current_device())
    inf = copies.info(d)
    assert inf["copier"] == "native", f"the native copy kernel is not used: {inf['reason']}"
    return d


def _cases(rng):
    """(dst offset, src offset, nbytes): sizes around 16 B and the 64 KiB chunk; offsets both
    16-byte aligned (the vector path), both unaligned alike and mutually misaligned (the byte
    path); then random ones."""
    c = copies.CHUNK
    sizes = [1, 15, 16, 17, 255, 4096, c - 1, c, c + 1, 2 * c + 16, 3 * c - 17, (3 << 20) + 5]
    offs = [(0, 0), (16, 32), (1, 1), (3, 8), (8, 3), (15, 0)]
    out = [(do, so, n) for n in sizes for do, so in offs]
    out += [(rng.randrange(64), rng.randrange(64), rng.randrange(1, 200_000)) for _ in range(300)]
    rng.shuffle(out)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("copier", ["kernel", "driver"])
def test_every_byte_of_many_ranges_in_one_call(gpu, copier):
    """All ranges by one launch of the kernel, or by one cuMemcpyBatchAsync of the driver."""
    ran = {"kernel": "native", "driver": "driver"}[copier]
    if copier == "driver" and copies.driver_why(gpu):
        pytest.skip(f"no driver batch here: {copies.driver_why(gpu)}")
    rng = random.Random(7)
    cases = _cases(rng)
    pad = 256
    total = sum(n + pad for _, _, n in cases) + 64
    src = torch.randint(0, 256, (total,), dtype=torch.uint8, device=gpu)
    dst = torch.full((total,), FILL, dtype=torch.uint8, device=gpu)
    items, at = [], 0
    for do, so, n in cases:
        d, s = dst[at + do : at + do + n], src[at + so : at + so + n]
        items.append((d, s, d.data_ptr(), s.data_ptr(), n))
        at += n + pad
    before = copies._calls[ran]
    assert copies.copy_ranges(gpu, items, copier) == ran
    assert copies._calls[ran] == before + 1
    want = torch.full((total,), FILL, dtype=torch.uint8)
    s_cpu = src.cpu()
    at = 0
    for do, so, n in cases:
        want[at + do : at + do + n] = s_cpu[at + so : at + so + n]
        at += n + pad
    got = dst.cpu()
    bad = (got != want).nonzero()
    assert bad.numel() == 0, f"{bad.numel()} bytes differ, first at {int(bad[0])}"


@pytest.mark.gpu
def test_the_same_batch_reuses_its_device_table_and_copies_the_new_bytes(gpu):
    src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device=gpu)
    dst = torch.zeros_like(src)
    k = src.numel() // 8
    items = [(dst[i * k : (i + 1) * k], src[i * k : (i + 1) * k], 0, 0, k) for i in range(8)]
    items = [(d, s, d.data_ptr(), s.data_ptr(), n) for d, s, _, _, n in items]
    copies.copy_ranges(gpu, items)
    kept = len(copies._tables)
    src.add_(1)  # the next step's weights, same memory
    copies.copy_ranges(gpu, items)
    assert len(copies._tables) == kept
    torch.cuda.synchronize(gpu)
    assert torch.equal(dst, src)
