"""The reshard's read plan (reshard_plan.py), against Nanotron's own slice pairs and ZeRO-1 partition: for
grids of saved and new layouts (tp, dp with ZeRO-1 or not) and every kind of sharding Nanotron makes (dim 0,
dim 1, dim 0 in contiguous chunks as for fused projections, not sharded, 0-d), every rank's state equals the
same slice of the full tensor, and a rank reads little more than its own part."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch
from nanotron.parallel.parameters import SlicesPair

from nanotron_datastates.nanotron.resume.saved_layout import zero_ranges
from nanotron_datastates.resume import reshard_plan
from nanotron_datastates.resume.reshard_plan import Need, Piece, Source


def pieces_of(shape: tuple[int, ...], tp: int, split: int | None, chunks: tuple[int, ...] | None) -> dict:
    """{tp rank: Piece}, as Nanotron's create_sharded_parameter_from_config slices (rank -1: not sharded)."""
    if split is None:
        every = tuple(slice(None) for _ in shape)
        return {-1: Piece(shape, (SlicesPair(every, every),))}
    out = {}
    for rank in range(tp):
        local = tuple(n // tp if d == split else n for d, n in enumerate(shape))
        pairs = []
        starts = list(itertools.accumulate((0, *(chunks or (shape[split],)))))
        for c, (g0, g1) in enumerate(zip(starts, starts[1:])):
            size = (g1 - g0) // tp
            lo = sum((b - a) // tp for a, b in zip(starts[:c], starts[1 : c + 1]))
            pick = lambda sl: tuple(sl if d == split else slice(None) for d in range(len(shape)))  # noqa: E731
            pairs.append(
                SlicesPair(pick(slice(lo, lo + size)), pick(slice(g0 + rank * size, g0 + (rank + 1) * size)))
            )
        out[rank] = Piece(local, tuple(pairs))
    return out


def local_of(full: torch.Tensor, piece: Piece) -> torch.Tensor:
    out = torch.empty(piece.local_shape, dtype=full.dtype)
    for pair in piece.pairs:
        out[pair.local_slices] = full[pair.global_slices]
    return out


KINDS = [
    pytest.param((12, 10), 0, None, id="dim0"),
    pytest.param((6, 8), 1, None, id="dim1"),
    pytest.param((24, 5), 0, (16, 8), id="dim0-chunks"),
    pytest.param((35,), None, None, id="replicated"),
    pytest.param((), None, None, id="0-d"),
]
LAYOUTS = [(1, 1, 0), (2, 1, 0), (1, 3, 1), (2, 2, 1), (4, 3, 1)]  # (tp, dp, ZeRO stage)


@pytest.mark.parametrize("shape, split, chunks", KINDS)
@pytest.mark.parametrize("saved", LAYOUTS, ids=str)
@pytest.mark.parametrize("here", LAYOUTS, ids=str)
def test_every_rank_gets_its_slice_of_the_full_tensor(shape, split, chunks, saved, here):
    full = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    stored, pieces = {}, {}
    for t, piece in pieces_of(shape, saved[0], split, chunks).items():
        flat = local_of(full, piece).reshape(-1)
        sources = []
        for d in range(saved[1] if saved[2] else 1):
            rng = zero_ranges(flat.numel(), saved[1]).get(d, (0, 0)) if saved[2] else (0, flat.numel())
            if rng[1] > rng[0]:
                path = Path(f"t{t}d{d}")
                stored[(path, "x")] = flat[rng[0] : rng[1]].clone()
                sources.append(Source(path, "x", rng))
        pieces[t] = (piece, sources)
    for t, piece in pieces_of(shape, here[0], split, chunks).items():
        mine = local_of(full, piece)
        for d in range(here[1]):
            zero = zero_ranges(mine.numel(), here[1]).get(d, (0, 0)) if here[2] else None
            want = mine.reshape(-1)[zero[0] : zero[1]] if zero else mine
            need = Need(0, tuple(want.shape), tuple(full.shape), piece, zero)
            plan = reshard_plan.plan("w", need, pieces)
            read = {}
            for path, name, (a, b) in plan.ranges():
                read[(path, name, (a, b))] = stored[(path, name)][a:b]
            got = reshard_plan.assemble(plan, read)
            assert got.shape == want.shape and got.equal(want), (t, d)
            # What is read: the rank's own rows of each saved piece (of each chunk of a fused projection), at
            # most one partial row more each side.
            width = math.prod(piece.local_shape[1:])
            if split in (0, None) and here[0] % saved[0] == 0:
                ends = 2 * width * len(chunks or (1,))
                assert sum(b - a for _, _, (a, b) in plan.ranges()) <= want.numel() + ends


def test_a_saved_piece_missing_elements_is_refused():
    (piece,) = pieces_of((4, 4), 1, None, None).values()
    need = Need(0, (4, 4), (4, 4), piece, None)
    with pytest.raises(ValueError, match="parameter 'w': the saved shards do not hold every element"):
        reshard_plan.plan("w", need, {-1: (piece, [Source(Path("a"), "x", (0, 8))])})
