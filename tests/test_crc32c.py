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
