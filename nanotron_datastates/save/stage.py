"""Save, staging (caller's thread): every tensor of the files saved together copied where it is, so that the
caller may change the originals as soon as the save returns.

The copies go into one byte buffer per device, each file's packed in the order of its data section (the
core's layout: by element size, largest first, stable), so that the copies to the host can take a piece of
the file in one transfer; each element still sits at a multiple of its size. One multi-tensor copy per dtype
fills the buffer.

Where each tensor goes depends only on the files' tensors' shapes, dtypes and devices, and a trainer saves
the same tensors at every checkpoint: the layout is kept (`Stager`) and reused while the files hold the same
tensors, unchanged. A checkpoint then costs, on the caller's thread, an allocation per device and, per
dtype, one call that makes every tensor's view and one multi-tensor copy, instead of the layout's walk and a
view per tensor (`benchmarks/micro/bench_staging.py`).
"""

from __future__ import annotations

import itertools
import operator
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

from .. import _core

if TYPE_CHECKING:
    from .plan import SavePlan

ALIGN = 256  # bytes: each file's staged copy starts where vectorized kernels and DMA like it

# What the layout of a tensor depends on, and the tensor itself (by a weak reference: a kept layout keeps no
# tensor alive).
_Key = tuple["weakref.ref[torch.Tensor]", torch.Size, torch.dtype, torch.device]


@dataclass
class _Group:
    """The tensors of one dtype in one buffer, in buffer order."""

    buffer: int
    dtype: torch.dtype
    split: list[int]  # the buffer seen as `dtype`, cut in turn: gap, tensor, gap, tensor, ..., the rest
    shapes: list[torch.Size]
    places: list[tuple[int, int]]  # (file, index in the file) of each tensor
    flat: list[int]  # each tensor's index among every file's tensors in turn
    # From the layout's second use on: meta tensors of the gaps' and tensors' shapes, for one call that
    # makes every view (torch's unflatten_dense_tensors, a C++ loop), and which of them are the tensors.
    templates: list[torch.Tensor] | None = None
    picks: list[int] | None = None

    def views(self, typed: torch.Tensor, reused: bool) -> list[torch.Tensor]:
        """The tensors' places in `typed` (the buffer seen as `dtype`), shaped as the tensors."""
        if not reused:  # made for one use, perhaps: a view per tensor
            cut = typed.split_with_sizes(self.split)
            return [cut[2 * j + 1].view(shape) for j, shape in enumerate(self.shapes)]
        if self.templates is None or self.picks is None:
            self.templates, self.picks = [], []
            for j, shape in enumerate(self.shapes):
                if self.split[2 * j]:
                    self.templates.append(_meta((self.split[2 * j],)))
                self.picks.append(len(self.templates))
                self.templates.append(_meta(shape))
        every = torch._C._nn.unflatten_dense_tensors(typed, self.templates)
        return [every[j] for j in self.picks]


@dataclass
class Layout:
    """Where every tensor of a list of files lies in the staged buffers."""

    keys: list[list[_Key]]  # per file, per tensor
    devices: list[torch.device]  # per buffer
    sizes: list[int]  # bytes, per buffer
    groups: list[_Group]
    views: list[list[_core.StagedView]]  # per file, per tensor: its place in the buffers

    # Per file, what described its tensors when they were last found to fit (a plan's list of entries, which
    # a plan's renewal replaces, never changes): the same object again needs no check of each tensor.
    checked: list[object] = field(default_factory=list)

    def fits(
        self, arrays: Sequence[Sequence[torch.Tensor]], described: Sequence[object] | None = None
    ) -> bool:
        """Whether `arrays` are the very tensors this layout was made for, with their shapes and dtypes.
        `described`: per file, the object that describes its tensors as checked by the caller (a plan's
        entries, `SavePlan.keys`): a file described by the same object as at the last fit is not checked
        tensor by tensor again."""
        if len(arrays) != len(self.keys):
            return False
        same = described is not None and len(described) == len(self.checked)
        for k, (row, keys) in enumerate(zip(arrays, self.keys)):
            if len(row) != len(keys):
                return False
            if same and described is not None and described[k] is self.checked[k]:
                continue
            for a, (ref, shape, dtype, device) in zip(row, keys):
                if ref() is not a or a.shape != shape or a.dtype != dtype or a.device != device:
                    return False
        if described is not None:
            self.checked = list(described)
        return True


def layout_of(arrays: Sequence[Sequence[torch.Tensor]]) -> Layout:
    """The layout of `arrays` (a list of tensors per file), files one after the other on each device."""
    places: dict[torch.device, list[tuple[int, int, int]]] = {}  # per device: (file, index, byte offset)
    sizes: dict[torch.device, int] = {}
    placed: list[dict[int, _core.StagedView]] = [{} for _ in arrays]  # per file, by tensor index
    for k, row in enumerate(arrays):
        order = sorted(range(len(row)), key=lambda i: -row[i].element_size())  # stable, as the core's layout
        starts: dict[torch.device, int] = {}  # this file's next byte on each device
        for i in order:
            a = row[i]
            if a.device not in starts:
                starts[a.device] = -(-sizes.get(a.device, 0) // ALIGN) * ALIGN
            places.setdefault(a.device, []).append((k, i, starts[a.device]))
            starts[a.device] += a.numel() * a.element_size()
        sizes.update(starts)
    devices = list(places)
    first = list(itertools.accumulate((len(row) for row in arrays), initial=0))  # each file's first tensor
    groups: list[_Group] = []
    for b, device in enumerate(devices):
        size = sizes[device] = -(-sizes[device] // 16) * 16  # a whole number of elements of every dtype
        by_dtype: dict[torch.dtype, list[tuple[int, int, int]]] = {}
        for k, i, at in places[device]:
            a = arrays[k][i]
            placed[k][i] = _core.StagedView(base=b, offset=at, itemsize=a.element_size(), shape=a.shape)
            by_dtype.setdefault(a.dtype, []).append((k, i, at))
        for dtype, where in by_dtype.items():
            where = sorted((w for w in where if arrays[w[0]][w[1]].numel()), key=lambda w: w[2])
            if not where:  # empty tensors: nothing to copy, the core reads none of their bytes
                continue
            itemsize = arrays[where[0][0]][where[0][1]].element_size()
            split, end = [], 0  # in elements of `dtype`
            for k, i, at in where:
                n = arrays[k][i].numel()
                split += [at // itemsize - end, n]
                end = at // itemsize + n
            split.append(size // itemsize - end)
            shapes = [arrays[k][i].shape for k, i, _ in where]
            flat = [first[k] + i for k, i, _ in where]
            groups.append(_Group(b, dtype, split, shapes, [(k, i) for k, i, _ in where], flat))
    keys = [[(weakref.ref(a), a.shape, a.dtype, a.device) for a in row] for row in arrays]
    views = [[where[i] for i in range(len(row))] for where, row in zip(placed, arrays)]
    return Layout(keys, devices, [sizes[d] for d in devices], groups, views)


class Stager:
    """Stages files, keeping the last layout for the next files that hold the same tensors, and, where asked
    (`keep`), the buffers with every tensor's view in them: the next staging of the same tensors, once the
    engine no longer reads the buffers (`lend`), copies into them without an allocation or a view made."""

    def __init__(self) -> None:
        self._last: Layout | None = None
        self._kept: _Kept | None = None

    def stage(
        self,
        arrays: list[list[torch.Tensor]],
        views: list[list[_core.StagedView]],
        described: Sequence[object] | None = None,
        keep: bool = False,
    ) -> list[torch.Tensor]:
        """Replaces every tensor of `arrays` (a list per file) by its copy, fills `views` (a list per file:
        where each copy lies) and returns the buffers that hold the copies. `described`: as `Layout.fits`
        takes it. `keep`: the buffers kept for the next staging of the same tensors (`lend` says when the
        engine is done with them; `release` lets go of them)."""
        layout = self._last
        reused = layout is not None and layout.fits(arrays, described)
        if layout is None or not reused:
            layout = self._last = layout_of(arrays)
            if described is not None:
                layout.checked = list(described)
        kept = self._kept
        if kept is not None and not (keep and kept.layout is layout):
            kept = self._kept = None  # not wanted, or made for other tensors
        if kept is not None and not kept.free():
            kept = None  # a save still reads them: new buffers, kept in their place
        flat = list(itertools.chain.from_iterable(arrays))  # every file's tensors in turn
        if kept is not None:  # the same tensors into the same buffers: no allocation, no view, no walk
            for group, dsts in zip(layout.groups, kept.views):
                copy_many(dsts, list(map(flat.__getitem__, group.flat)))
            arrays[:] = [list(row) for row in kept.rows]
            bases = kept.bases
        else:
            # empty_strided: Nanotron patches torch.empty (and others) while it builds a model
            bases = [
                torch.empty_strided((n,), (1,), dtype=torch.uint8, device=d)
                for d, n in zip(layout.devices, layout.sizes)
            ]
            groups = []
            for group in layout.groups:
                dsts = group.views(bases[group.buffer].view(group.dtype), reused)
                copy_many(dsts, list(map(flat.__getitem__, group.flat)))
                for dst, (k, i) in zip(dsts, group.places):
                    arrays[k][i] = dst
                groups.append(dsts)
            if keep:
                kept = self._kept = _Kept(layout, bases, groups, [list(row) for row in arrays])
        if kept is not None:
            kept.readers = None  # lent to the save being made, until `lend` names its readers
        for k, row in enumerate(layout.views):
            views[k] = list(row)
        return bases

    def lend(self, bases: Sequence[torch.Tensor], readers: Sequence[_core.Job]) -> None:
        """The kept buffers, if `bases` are they, are read by `readers` (the core's jobs, each with
        `snapshot_done()`): free again once every one of them has its snapshot (every byte read)."""
        kept = self._kept
        if kept is not None and len(bases) == len(kept.bases) and all(map(operator.is_, bases, kept.bases)):
            kept.readers = list(readers)

    def release(self) -> None:
        """Lets go of the kept buffers (their memory goes back once no save reads them)."""
        self._kept = None

    @property
    def kept_nbytes(self) -> int:
        """Bytes of the buffers kept for the next staging."""
        return sum(b.numel() for b in self._kept.bases) if self._kept is not None else 0


@dataclass
class _Kept:
    """Buffers kept for the next staging of the same layout, with each group's views in them."""

    layout: Layout
    bases: list[torch.Tensor]
    views: list[list[torch.Tensor]]  # per group of the layout
    rows: list[list[torch.Tensor]]  # per file, its tensors' copies (where the staging puts them)
    readers: list[_core.Job] | None = None  # the saves that read them; None: lent to a save not yet queued

    def free(self) -> bool:
        """Whether no save reads the buffers any more. A staging never queued (it failed, or was dropped)
        leaves them lent: the next staging takes new ones."""
        return self.readers is not None and all(r.snapshot_done() for r in self.readers)


def _meta(shape: Sequence[int]) -> torch.Tensor:
    """A tensor of `shape` without memory. empty_strided: Nanotron patches torch.empty (and others) while it
    builds a model, forcing its device and dtype."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return torch.empty_strided(tuple(shape), tuple(reversed(strides)), device="meta")


def staged_nbytes(plans: Sequence[SavePlan]) -> int:
    """The most bytes staging these plans together takes on one device."""
    return sum(-(-p.nbytes // ALIGN) * ALIGN for p in plans) + 16


def copy_many(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """Copies each of `srcs` into the tensor of `dsts` beside it (same dtype): one multi-tensor kernel."""
    if hasattr(torch, "_foreach_copy_"):
        torch._foreach_copy_(dsts, srcs)
    else:  # torch before 2.1
        for d, s in zip(dsts, srcs):
            d.copy_(s)
