"""The NCCL link's host copies (`streamed`, the core's `copy_streaming`, stores past the caches): exact bytes
into any offset of a larger buffer, from any offset, the bytes around untouched; runs of unequal size or with
gaps refused."""

import random

import pytest
import torch

from nanotron_datastates.tier.link_nccl import streamed


def test_a_streamed_copy_between_tensors_stores_every_byte_and_only_those_at_every_alignment():
    rng = random.Random(5)
    src = torch.tensor([rng.randrange(256) for _ in range(70000)], dtype=torch.uint8)
    for n in (0, 5, 63, 4095, 4096, 4100, 24577, 70000 - 3):
        for start in (0, 3):
            for offset in (0, 1, 7, 8, 13, 16):
                dst = torch.full((n + 32,), 0xA5, dtype=torch.uint8)
                piece = src[start : start + n]
                streamed(dst[offset : offset + n], piece)
                assert dst[offset : offset + n].equal(piece), (n, start, offset)
                assert bool((dst[:offset] == 0xA5).all() and (dst[offset + n :] == 0xA5).all())
    wide = torch.arange(5000, dtype=torch.float32)  # counted in bytes, not elements
    out = torch.zeros_like(wide)
    streamed(out, wide)
    assert out.equal(wide)
    with pytest.raises(ValueError, match="contiguous host runs of one size"):
        streamed(torch.empty(10, dtype=torch.uint8), src[:11])
    with pytest.raises(ValueError, match="contiguous host runs of one size"):
        streamed(torch.empty(10, dtype=torch.uint8), src[:20:2])
    with pytest.raises(ValueError, match="contiguous host runs of one size"):
        streamed(torch.empty(10, dtype=torch.uint8, device="meta"), src[:10])  # never a device's address
