"""Which elements of which saved tensors one rank needs to rebuild its piece of one parameter's state, and
putting them together (reshard.py plans and reads through this).

Everything is counted in rows, dim 0 of each tensor. The rank's piece of the full tensor (its tensor-parallel
slices, and with ZeRO a flat range of those) lies within a window of the full tensor's rows; each saved piece
holds a window of its own rows that maps into it; a saved piece's rows are a contiguous flat range of its
local tensor, so each file holding a ZeRO shard of it contributes one contiguous range of elements. Those
ranges are all that is read: a ZeRO flat range or a dim-0 slice costs only its own bytes, a dim-1 slice the
rows it crosses.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Iterator

import torch

from ..restore import empty
from .saved_layout import Piece, ReshardError

_CPU = torch.device("cpu")


@dataclasses.dataclass(frozen=True)
class Need:
    """What this rank's optimizer holds of one parameter."""

    index: int  # in the optimizer's state_dict
    shape: tuple[int, ...]  # of its state tensors: the local shape, or a ZeRO flat range's length
    full_shape: tuple[int, ...]
    piece: Piece
    zero: tuple[int, int] | None  # flat range of the local tensor, with ZeRO


@dataclasses.dataclass(frozen=True)
class Source:
    """A saved tensor holding part of a saved piece: `flat` are the elements of the piece's local tensor,
    flattened, that it holds (a ZeRO shard's range, or all of them)."""

    path: Path
    tensor: str  # its name in the file
    flat: tuple[int, int]


@dataclasses.dataclass(frozen=True)
class Read:
    source: Source
    elements: tuple[int, int]  # of the saved tensor
    at: int  # where they go in the piece's row window, flattened


@dataclasses.dataclass(frozen=True)
class PieceReads:
    piece: Piece
    rows: tuple[int, int]  # of the saved piece's local tensor
    reads: tuple[Read, ...]


@dataclasses.dataclass(frozen=True)
class Plan:
    """How to rebuild one state of one parameter on this rank."""

    name: str
    need: Need
    rows: tuple[int, int]  # of the full tensor
    local_rows: tuple[int, int]  # of this rank's local tensor
    pieces: tuple[PieceReads, ...]

    def ranges(self) -> Iterator[tuple[Path, str, tuple[int, int]]]:
        """(file, tensor, elements) of every read."""
        for p in self.pieces:
            for r in p.reads:
                yield r.source.path, r.source.tensor, r.elements


def plan(name: str, need: Need, pieces: dict[int, tuple[Piece, list[Source]]]) -> Plan:
    """The reads that rebuild `need` from the saved pieces (by saved tensor-parallel rank), each with the
    sources that hold it."""
    local = _rows_of(need.piece.local_shape)
    row = math.prod(local[1:])
    if need.zero is not None and row:
        lo, hi = need.zero
        local_rows = (lo // row, -(-hi // row)) if hi > lo else (0, 0)
    else:
        local_rows = (0, local[0])
    rows = _map(name, need.piece, need.full_shape, local_rows, False)
    out = []
    for piece, sources in pieces.values():
        saved_rows = _map(name, piece, need.full_shape, rows, True)
        if saved_rows[1] <= saved_rows[0]:
            continue
        width = math.prod(_rows_of(piece.local_shape)[1:])
        lo, hi = saved_rows[0] * width, saved_rows[1] * width
        reads = []
        for s in sources:
            a, b = max(lo, s.flat[0]), min(hi, s.flat[1])
            if b > a:
                reads.append(Read(s, (a - s.flat[0], b - s.flat[0]), a - lo))
        if sum(r.elements[1] - r.elements[0] for r in reads) != hi - lo:
            raise ReshardError(f"parameter {name!r}: the saved shards do not hold every element of its piece")
        out.append(PieceReads(piece, saved_rows, tuple(reads)))
    return Plan(name, need, rows, local_rows, tuple(out))


def assemble(
    p: Plan, read: dict[tuple[Path, str], torch.Tensor], dtype: torch.dtype | None = None
) -> torch.Tensor:
    """This rank's state tensor, from the ranges read (keyed by file and tensor, as `Plan.ranges` names
    them), in `dtype` (default: as read)."""
    window: torch.Tensor | None = None
    full = _rows_of(p.need.full_shape)
    for pr in p.pieces:
        parts = [read[(r.source.path, r.source.tensor)] for r in pr.reads]
        kind = dtype or parts[0].dtype
        src = empty((pr.rows[1] - pr.rows[0], *_rows_of(pr.piece.local_shape)[1:]), kind, _CPU)
        flat = src.view(-1)
        for r, part in zip(pr.reads, parts):
            flat[r.at : r.at + part.numel()] = part
        if window is None:
            window = empty((p.rows[1] - p.rows[0], *full[1:]), kind, _CPU)
        for (la, _), (ga, gb), lrest, grest in _pairs(p.name, pr.piece, p.need.full_shape):
            u, v = max(ga, p.rows[0]), min(gb, p.rows[1])
            if v > u:
                at = u - ga + la - pr.rows[0]
                window[(slice(u - p.rows[0], v - p.rows[0]),) + grest] = src[(slice(at, at + v - u),) + lrest]
    local = _rows_of(p.need.piece.local_shape)
    lo, hi = p.local_rows
    kind = window.dtype if window is not None else dtype or torch.float32
    mine = empty((hi - lo, *local[1:]), kind, _CPU)
    if window is not None:
        for (la, lb), (ga, _), lrest, grest in _pairs(p.name, p.need.piece, p.need.full_shape):
            x, y = max(la, lo), min(lb, hi)
            if y > x:
                at = x - la + ga - p.rows[0]
                mine[(slice(x - lo, y - lo),) + lrest] = window[(slice(at, at + y - x),) + grest]
    flat = mine.view(-1)
    if p.need.zero is not None:
        start = lo * math.prod(local[1:])
        flat = flat[p.need.zero[0] - start : p.need.zero[1] - start]
    return flat.clone().view(p.need.shape)


Pair = tuple[tuple[int, int], tuple[int, int], tuple[slice, ...], tuple[slice, ...]]


def _rows_of(shape: tuple[int, ...]) -> tuple[int, ...]:
    return shape if shape else (1,)  # a 0-d tensor as one row of one element


def _pairs(name: str, piece: Piece, full_shape: tuple[int, ...]) -> list[Pair]:
    """Each of a piece's slice pairs as (local rows, global rows, local slices of the other dims, global
    slices of the other dims)."""
    local, full = _rows_of(piece.local_shape), _rows_of(full_shape)
    out = []
    for pair in piece.pairs:
        ls = tuple(pair.local_slices) or (slice(0, 1),)
        gs = tuple(pair.global_slices) or (slice(0, 1),)
        if any(s.step not in (None, 1) for s in ls + gs):
            raise ReshardError(
                f"parameter {name!r} is sharded with strided slices, which a reshard cannot map"
            )
        la, lb, _ = ls[0].indices(local[0])
        ga, gb, _ = gs[0].indices(full[0])
        if lb - la != gb - ga:
            raise ReshardError(f"parameter {name!r}: a slice pair maps {lb - la} local rows to {gb - ga}")
        out.append(((la, lb), (ga, gb), ls[1:], gs[1:]))
    return out


def _map(
    name: str, piece: Piece, full_shape: tuple[int, ...], rows: tuple[int, int], to_local: bool
) -> tuple[int, int]:
    """The rows of the full tensor that a piece's local `rows` cover (or with `to_local`, the piece's local
    rows that cover the full tensor's `rows`), as one span."""
    lo, hi = None, None
    for (la, lb), (ga, gb), _, _ in _pairs(name, piece, full_shape):
        src, dst = ((ga, gb), (la, lb)) if to_local else ((la, lb), (ga, gb))
        a, b = max(src[0], rows[0]), min(src[1], rows[1])
        if b > a:
            a, b = a - src[0] + dst[0], b - src[0] + dst[0]
            lo, hi = (a, b) if lo is None else (min(lo, a), max(hi, b))  # type: ignore[type-var]
    return (lo, hi) if lo is not None and hi is not None else (0, 0)
