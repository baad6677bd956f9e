"""Reading part of a tensor (`load_ranges`): the block checksums a file holds, only the blocks over a range
read and checked, whole tensors where a file has no block checksums."""

import os
import random
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

from nanotron_datastates import ChecksumError, DataStatesEngine, _core
from nanotron_datastates import format as fmt

from helpers import small_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _common import resident_bytes  # noqa: E402 - the benchmarks' page-cache probe (mincore)

MIB = 1 << 20


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "big": torch.randn(3 * MIB // 4 + 123, generator=g),  # ~3 MiB of fp32: several blocks
        "rows": torch.randn(700, 1000, generator=g).bfloat16(),  # starts mid-block, after "big"
        "bytes": torch.randint(-128, 127, (5000,), dtype=torch.int8, generator=g),
        "scalar": torch.tensor(7.5),
    }


@pytest.mark.parametrize(
    "chunk_size, cache_gib, block", [(1, 16 / 1024, MIB), (64, 0.5, MIB), (1, 1 / 1024, MIB // 4)]
)
def test_every_block_segment_is_summed_and_they_combine_to_the_tensors_checksum(
    tmp_path, chunk_size, cache_gib, block
):
    """Blocks of 1 MiB, or of the chunk's size where chunks are smaller (a block is summed in one piece)."""
    path = tmp_path / "s.safetensors"
    with DataStatesEngine(small_config(chunk_size=chunk_size, host_cache_size=cache_gib)) as engine:
        engine.save(_state(), path).wait_persisted()
    header = fmt.read_header(path)
    assert header.block_checksums()[0] == block
    block, sums = header.block_checksums()
    raw = path.read_bytes()[header.data_start :]
    whole = header.checksums()
    for e in header.tensors:
        cuts = sorted({e.begin, e.end, *range((e.begin // block + 1) * block, e.end, block)})
        segments = [_core.crc32c(raw[a:b]) for a, b in zip(cuts, cuts[1:])]
        assert sums[e.name] == segments, e.name
        crc = segments[0] if segments else 0
        for (a, b), s in zip(zip(cuts[1:], cuts[2:]), segments[1:]):
            crc = _core.crc32c_combine(crc, s, b - a)
        assert crc == whole[e.name], e.name
    assert len(sums["big"]) == 3 * MIB // block + 1  # 3 MiB + 492 bytes from offset 0
    assert safetensors.torch.load_file(path)["rows"].equal(_state()["rows"])  # still plain safetensors


def test_ranges_are_exactly_the_elements_asked_for(tmp_path):
    state, path = _state(), tmp_path / "s.safetensors"
    rng = random.Random(1)
    with DataStatesEngine(small_config()) as engine:
        engine.save(state, path).wait_persisted()
        for _ in range(40):
            ranges = {}
            for name in rng.sample(sorted(state), rng.randint(1, len(state))):
                n = state[name].numel()
                a = rng.randint(0, n)
                ranges[name] = (a, rng.randint(a, n))
            got = engine.load_ranges(path, ranges)
            for name, (a, b) in ranges.items():
                assert got[name].equal(state[name].reshape(-1)[a:b]), (name, a, b)
        edges = {"big": (MIB // 4 - 1, MIB // 4 + 1), "rows": (0, 700_000), "scalar": (0, 1), "bytes": (9, 9)}
        got = engine.load_ranges(path, edges)
        assert got["rows"].view(700, 1000).equal(state["rows"]) and got["scalar"].item() == 7.5
        assert got["bytes"].numel() == 0 and got["big"].equal(state["big"][MIB // 4 - 1 : MIB // 4 + 1])


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def test_only_the_blocks_over_a_range_are_read_and_checked(tmp_path):
    state, path = _state(), tmp_path / "s.safetensors"
    with DataStatesEngine(small_config()) as engine:
        engine.save(state, path).wait_persisted()
        header = fmt.read_header(path)
        big = next(e for e in header.tensors if e.name == "big")
        _flip(path, header.data_start + big.begin + 2 * MIB + 10)  # in the third block of "big"
        per_block = MIB // 4
        first_two = engine.load_ranges(path, {"big": (0, 2 * per_block)})["big"]
        assert first_two.equal(state["big"][: 2 * per_block])
        third = rf"s\.safetensors: tensor 'big' .*bytes \[{2 * MIB}, {3 * MIB}\)"
        with pytest.raises(ChecksumError, match=third):
            engine.load_ranges(path, {"big": (2 * per_block + 100, 2 * per_block + 101)})
        with pytest.raises(ChecksumError, match="tensor 'big'"):
            engine.load(path)
        assert engine.load_ranges(path, {"rows": (0, 10)})["rows"].equal(state["rows"].reshape(-1)[:10])


def test_files_without_block_checksums_are_read_and_checked_whole(tmp_path):
    state, ours, theirs = _state(), tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    safetensors.torch.save_file(state, theirs)
    with DataStatesEngine(small_config()) as engine:
        h = engine.save(state, ours, exact_metadata=True)  # a strict reader's file: checksums kept outside
        sums = h.checksums()
        assert fmt.read_header(ours).block_checksums() is None
        assert engine.load_ranges(theirs, {"big": (5, 9)})["big"].equal(state["big"][5:9])
        header = fmt.read_header(ours)
        big = next(e for e in header.tensors if e.name == "big")
        _flip(ours, header.data_start + big.end - 1)  # far from the range asked for
        with pytest.raises(ChecksumError, match="tensor 'big'"):
            engine.load_ranges(ours, {"big": (5, 9)}, checksums=sums)
        assert engine.load_ranges(ours, {"rows": (5, 9)}, checksums=sums)["rows"].equal(
            state["rows"].reshape(-1)[5:9]
        )


def test_a_name_or_range_not_in_the_file_is_named(tmp_path):
    path = tmp_path / "s.safetensors"
    with DataStatesEngine(small_config()) as engine:
        engine.save(_state(), path).wait_persisted()
        with pytest.raises(KeyError, match="holds no tensor 'nope'"):
            engine.load_ranges(path, {"nope": (0, 1)})
        with pytest.raises(ValueError, match=r"elements \[4990, 5001\) are outside tensor 'bytes' of 5000"):
            engine.load_ranges(path, {"bytes": (4990, 5001)})
        assert engine.load_ranges(path, {"bytes": (0, 2)})["bytes"].numel() == 2  # still working


def _evict(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # persisted, hence clean: dropped at once
    finally:
        os.close(fd)


def test_a_range_or_a_tensor_reads_its_own_pages_from_storage_not_the_file(tmp_path):
    """What a read brings into the page cache, from a cold file: the block over one element (and what the
    kernel reads around it); one tensor's pages, not the 68 MiB file."""
    path = tmp_path / "s.safetensors"
    state = {"a": torch.randn(8 * MIB), "b": torch.randn(MIB), "c": torch.randn(8 * MIB)}  # 68 MiB
    with DataStatesEngine(small_config()) as engine:
        engine.save(state, path).wait_persisted()
        _evict(path)
        assert resident_bytes([path]) == 0
        assert engine.load_ranges(path, {"a": (5 * MIB, 5 * MIB + 1)})["a"].item() == state["a"][5 * MIB]
        ranged = resident_bytes([path])
        _evict(path)
        assert engine.load_tensors(path, ["b"])["b"].equal(state["b"])
        one = resident_bytes([path])
    assert 0 < ranged <= 2 * MIB, ranged  # its block, and the header's page
    assert 4 * MIB <= one <= 5 * MIB, one  # tensor "b" alone


def test_a_damaged_block_checksum_is_found_by_verify_and_by_the_read_over_it(tmp_path):
    state, path = _state(), tmp_path / "s.safetensors"
    with DataStatesEngine(small_config()) as engine:
        engine.save(state, path).wait_persisted()
        raw = path.read_bytes()
        at = raw.index(b'"datastates.crc32c_blocks":"1048576:') + len(b'"datastates.crc32c_blocks":"1048576:')
        digit = b"1" if raw[at + 8 : at + 9] != b"1" else b"2"  # the second block's first digit
        path.write_bytes(raw[: at + 8] + digit + raw[at + 9 :])
        with pytest.raises(ChecksumError, match="block checksums of tensor 'big' do not combine"):
            engine.verify(path)
        with pytest.raises(ChecksumError, match=rf"tensor 'big' .*bytes \[{MIB}, {2 * MIB}\)"):
            engine.load_ranges(path, {"big": (MIB // 4 + 1, MIB // 4 + 2)})
        assert engine.load_ranges(path, {"big": (1, 2)})["big"].item() == state["big"][1].item()


def test_a_file_without_checksums_in_its_header_is_read_in_part_with_those_kept_outside(tmp_path):
    """Nanotron's weight files (`exact_metadata`): the manifest keeps each one's checksums, per tensor and
    per block (`file_entry`), and a reshard reads a part of it with them."""
    from nanotron_datastates.checkpoint.checksums import file_block_checksums, file_checksums, file_entry
    from nanotron_datastates.checkpoint.manifest import ManifestError

    state, path = _state(), tmp_path / "model" / "w.safetensors"
    with DataStatesEngine(small_config()) as engine:
        h = engine.save(state, path, exact_metadata=True)
        h.wait_persisted()
        doc = {"files": {"model/w.safetensors": file_entry(path.stat().st_size, h)}}
        sums = file_checksums(doc, tmp_path, path)
        blocks = file_block_checksums(doc, tmp_path, path)
        assert blocks is not None and blocks[0] == MIB and sums == h.checksums()
        assert engine.verify(path, sums, blocks)
        header = fmt.read_header(path)
        big = next(e for e in header.tensors if e.name == "big")
        _flip(path, header.data_start + big.begin + 2 * MIB + 10)  # in the third block of "big"
        kept = {"checksums": sums, "block_checksums": blocks}
        got = engine.load_ranges(path, {"big": (0, MIB // 4)}, **kept)["big"]
        assert got.equal(state["big"][: MIB // 4])  # the first block alone: read and checked
        with pytest.raises(ChecksumError, match="tensor 'big'"):
            engine.load_ranges(
                path, {"big": (MIB // 2, MIB // 2 + 1)}, checksums=sums, block_checksums=blocks
            )
        with pytest.raises(ChecksumError, match="the block checksums given do not fit"):
            engine.load_ranges(path, {"big": (0, 1)}, checksums=sums, block_checksums=(MIB, {"big": [1]}))
        doc["files"]["model/w.safetensors"]["crc32c_blocks"]["big"] = "1048576:xyz"
        with pytest.raises(ManifestError, match="block checksums of model/w.safetensors are malformed"):
            file_block_checksums(doc, tmp_path, path)


def test_several_ranges_of_one_tensor_come_back_in_order_and_only_their_blocks_are_read(tmp_path):
    """`load_range_list`: two far apart ranges of "big" (a fused projection's two chunks), one inside the
    first and an empty one, and a range of another tensor; overlapping ranges are read once. A flipped byte
    between the two far ranges is not read, so not found; one inside the second is found."""
    state, path = _state(), tmp_path / "s.safetensors"
    items = [("big", 10, MIB // 8), ("big", 5 * MIB // 8, 5 * MIB // 8 + 3), ("rows", 999, 2001)]
    items += [("big", 20, 30), ("big", 7, 7), ("scalar", 0, 1)]
    with DataStatesEngine(small_config()) as engine:
        engine.save(state, path).wait_persisted()
        got = engine.load_range_list(path, items)
        for (name, a, b), t in zip(items, got):
            assert t.equal(state[name].reshape(-1)[a:b]), (name, a, b)
        header = fmt.read_header(path)
        big = next(e for e in header.tensors if e.name == "big")
        _flip(path, header.data_start + big.begin + MIB + 100)  # in the second block: between the two
        assert engine.load_range_list(path, items[:2])[1].equal(state["big"][5 * MIB // 8 : 5 * MIB // 8 + 3])
        _flip(path, header.data_start + big.begin + 5 * MIB // 2 + 4)  # in the third: the second range's
        with pytest.raises(ChecksumError, match="tensor 'big'"):
            engine.load_range_list(path, items[:2])
        with pytest.raises(ValueError, match="outside tensor 'rows'"):
            engine.load_range_list(path, [("rows", 0, 700_001)])
