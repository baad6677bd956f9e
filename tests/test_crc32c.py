"""CRC-32C of the core against an independent pure-Python implementation and the standard check value."""

import random

from nanotron_datastates import _core


def crc32c_reference(data: bytes, crc: int = 0) -> int:
    crc ^= 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
    return crc ^ 0xFFFFFFFF


def test_check_value():
    assert _core.crc32c(b"123456789") == 0xE3069283
    assert _core.crc32c(b"") == 0


def test_matches_reference_on_every_length_and_alignment():
    rng = random.Random(1)
    blob = bytes(rng.randrange(256) for _ in range(20000))
    for n in list(range(0, 70)) + [4095, 4096, 4097, 12289, 20000]:
        for start in (0, 1, 3):
            piece = blob[start : start + n]
            assert _core.crc32c(piece) == crc32c_reference(piece), (n, start)


def test_continuation_and_combine():
    rng = random.Random(2)
    a = bytes(rng.randrange(256) for _ in range(5000))
    b = bytes(rng.randrange(256) for _ in range(7777))
    whole = _core.crc32c(a + b)
    assert _core.crc32c(b, _core.crc32c(a)) == whole
    assert _core.crc32c_combine(_core.crc32c(a), _core.crc32c(b), len(b)) == whole
    assert _core.crc32c_combine(_core.crc32c(a), _core.crc32c(b""), 0) == _core.crc32c(a)


def test_sums_of_equal_lengths_in_a_row_each_match_the_reference():
    # The hardware path keeps its combine constant per length: each sum must still be its own.
    rng = random.Random(3)
    blocks = [bytes(rng.randrange(256) for _ in range(8192)) for _ in range(3)]
    for b in blocks + blocks[::-1]:
        assert _core.crc32c(b) == crc32c_reference(b)
    assert _core.crc32c(blocks[1], _core.crc32c(blocks[0])) == crc32c_reference(blocks[0] + blocks[1])


def test_a_copy_sums_exactly_the_bytes_it_stores_at_every_alignment():
    rng = random.Random(4)
    blob = bytes(rng.randrange(256) for _ in range(70000))
    for n in (0, 5, 4095, 4096, 4100, 24577, 70000 - 3):
        for start in (0, 3):
            for offset in (0, 1, 7, 8, 13):
                piece = blob[start : start + n]
                crc, copied = _core.crc32c_copy(piece, offset)
                assert copied == piece and crc == _core.crc32c(piece), (n, start, offset)


def test_a_streamed_copy_between_tensors_stores_every_byte_and_only_those_at_every_alignment():
    """The NCCL link's host copies (`streamed`): exact bytes into any offset of a larger buffer, the bytes
    around untouched; the sum returned is that of the bytes."""
    import pytest
    import torch

    from nanotron_datastates.tier.link_nccl import streamed

    rng = random.Random(5)
    src = torch.tensor([rng.randrange(256) for _ in range(70000)], dtype=torch.uint8)
    for n in (0, 5, 4095, 4096, 4100, 24577, 70000 - 3):
        for start in (0, 3):
            for offset in (0, 1, 7, 8, 13):
                dst = torch.full((n + 32,), 0xA5, dtype=torch.uint8)
                piece = src[start : start + n]
                streamed(dst[offset : offset + n], piece)
                assert dst[offset : offset + n].equal(piece), (n, start, offset)
                assert bool((dst[:offset] == 0xA5).all() and (dst[offset + n :] == 0xA5).all())
    piece, out = src[:12289], torch.empty(12289, dtype=torch.uint8)
    crc = _core.copy_streaming(out.data_ptr(), piece.data_ptr(), piece.numel())
    assert out.equal(piece) and crc == _core.crc32c(bytes(piece.tolist()))
    with pytest.raises(ValueError, match="contiguous runs of one size"):
        streamed(torch.empty(10, dtype=torch.uint8), src[:11])
    with pytest.raises(ValueError, match="contiguous runs of one size"):
        streamed(torch.empty(10, dtype=torch.uint8), src[:20:2])
