"""Which elements of which saved tensors one rank needs to rebuild its piece of one parameter's state, and
putting them together (the adapter's nanotron/resume/reshard.py plans and reads through this). Imports no
Nanotron: a piece's slice pairs are read by their attributes only.

Everything is counted in rows, dim 0 of each tensor. The rank's piece of the full tensor (its tensor-parallel
slices, and with ZeRO a flat range of those) lies within windows of the full tensor's rows, one per slice
pair (a fused projection's chunks each give one); each saved piece holds a span of its own rows that maps
onto a window; a saved piece's rows are a contiguous flat range of its local tensor, so each file holding a
ZeRO shard of it contributes one contiguous range of elements per window. Those ranges are all that is
read: a ZeRO flat range or a dim-0 slice costs only its own bytes, a dim-1 slice the rows it crosses.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Iterator, Protocol

import torch

from ..errors import DataStatesError
from ..load.restore import empty

_CPU = torch.device("cpu")


class ReshardError(DataStatesError, ValueError):
    """The checkpoint cannot be resumed on this layout (a parameter is missing or changed shape)."""


class SlicesPair(Protocol):
    """Nanotron's SlicesPair, as read here: a piece's local slices (one per dim), and the global slices of
    the full tensor they map to."""

    @property
    def local_slices(self) -> Iterable[slice]: ...

    @property
    def global_slices(self) -> Iterable[slice]: ...


@dataclasses.dataclass(frozen=True)
class Piece:
    """Where a tensor-parallel rank's local tensor sits in the full one (and the weight file holding it)."""

    local_shape: tuple[int, ...]
    pairs: tuple[SlicesPair, ...]  # Nanotron's: local -> global slices
    path: Path | None = None


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
class Window:
    """Rows of the full tensor that this rank's piece holds, and the saved pieces' reads that cover them."""

    rows: tuple[int, int]
    pieces: tuple[PieceReads, ...]


@dataclasses.dataclass(frozen=True)
class Plan:
    """How to rebuild one state of one parameter on this rank."""

    name: str
    need: Need
    local_rows: tuple[int, int]  # of this rank's local tensor
    windows: tuple[Window, ...]

    def ranges(self) -> Iterator[tuple[Path, str, tuple[int, int]]]:
        """(file, tensor, elements) of every read."""
        for w in self.windows:
            for p in w.pieces:
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
    windows = []
    for rows in _windows(name, need.piece, need.full_shape, local_rows):
        out = []
        for piece, sources in pieces.values():
            saved_rows = _map(name, piece, need.full_shape, rows)
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
                raise ReshardError(
                    f"parameter {name!r}: the saved shards do not hold every element of its piece"
                )
            out.append(PieceReads(piece, saved_rows, tuple(reads)))
        windows.append(Window(rows, tuple(out)))
    return Plan(name, need, local_rows, tuple(windows))


def assemble(
    p: Plan, read: dict[tuple[Path, str, tuple[int, int]], torch.Tensor], dtype: torch.dtype | None = None
) -> torch.Tensor:
    """This rank's state tensor, from the ranges read (keyed by file, tensor and elements, as `Plan.ranges`
    names them), in `dtype` (default: as read)."""
    full = _rows_of(p.need.full_shape)
    filled: list[tuple[tuple[int, int], torch.Tensor]] = []  # (rows of the full tensor, their values)
    for w in p.windows:
        window: torch.Tensor | None = None
        for pr in w.pieces:
            parts = [read[(r.source.path, r.source.tensor, r.elements)] for r in pr.reads]
            kind = dtype or parts[0].dtype
            src = empty((pr.rows[1] - pr.rows[0], *_rows_of(pr.piece.local_shape)[1:]), kind, _CPU)
            flat = src.view(-1)
            for r, part in zip(pr.reads, parts):
                flat[r.at : r.at + part.numel()] = part
            if window is None:
                window = empty((w.rows[1] - w.rows[0], *full[1:]), kind, _CPU)
            for (la, _), (ga, gb), lrest, grest in _pairs(p.name, pr.piece, p.need.full_shape):
                u, v = max(ga, w.rows[0]), min(gb, w.rows[1])
                if v > u:
                    at = u - ga + la - pr.rows[0]
                    window[(slice(u - w.rows[0], v - w.rows[0]),) + grest] = src[
                        (slice(at, at + v - u),) + lrest
                    ]
        if window is not None:
            filled.append((w.rows, window))
    local = _rows_of(p.need.piece.local_shape)
    lo, hi = p.local_rows
    kind = filled[0][1].dtype if filled else dtype or torch.float32
    mine = empty((hi - lo, *local[1:]), kind, _CPU)
    for (la, lb), (ga, _), lrest, grest in _pairs(p.name, p.need.piece, p.need.full_shape):
        for (wa, wb), window in filled:
            # The pair's local rows within [lo, hi) whose global rows fall in this window.
            x, y = max(la, lo, wa - ga + la), min(lb, hi, wb - ga + la)
            if y > x:
                at = x - la + ga - wa
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


def _windows(
    name: str, piece: Piece, full_shape: tuple[int, ...], local_rows: tuple[int, int]
) -> list[tuple[int, int]]:
    """The rows of the full tensor that the piece's local `local_rows` cover: one span per slice pair,
    sorted, those that touch or overlap merged."""
    spans = []
    for (la, lb), (ga, _), _, _ in _pairs(name, piece, full_shape):
        x, y = max(la, local_rows[0]), min(lb, local_rows[1])
        if y > x:
            spans.append((x - la + ga, y - la + ga))
    out: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _map(name: str, piece: Piece, full_shape: tuple[int, ...], rows: tuple[int, int]) -> tuple[int, int]:
    """The piece's local rows that cover the full tensor's `rows`, as one span."""
    span: tuple[int, int] | None = None
    for (la, _), (ga, gb), _, _ in _pairs(name, piece, full_shape):
        a, b = max(ga, rows[0]), min(gb, rows[1])
        if b > a:
            a, b = a - ga + la, b - ga + la
            span = (a, b) if span is None else (min(span[0], a), max(span[1], b))
    return span if span is not None else (0, 0)
