"""Save, stage 0 (caller's thread): flatten a state into named tensors plus its skeleton.

This is the only work a save does on the caller's thread, so it does the least it can. Once per state
(`plan_save`): walk the structure and take a reference to each tensor (so it stays alive until it is copied).
At every save of it (`prepare`): note each CUDA device's current stream (the core records an event there),
make CUDA views contiguous on that stream and, when staging, copy every tensor where it is. Layout, header
and every byte copy happen on the engine's threads.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from . import format as fmt
from . import skeleton
from .stage import Stager

# Dtypes every supported torch exports through DLPack; others are exported as a same-size integer view.
_EXPORTABLE = {
    torch.float16,
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
}
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class SavePlan:
    """A flattened state. Reusable: it holds the tensors themselves, so each save (through :func:`prepare`)
    captures their values at that time."""

    names: list[str] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    arrays: list[torch.Tensor] = field(default_factory=list)  # what the core reads (keeps them alive)
    streams: list[tuple[int, int]] = field(default_factory=list)  # set by prepare()
    metadata: list[tuple[str, str]] = field(default_factory=list)
    nbytes: int = 0
    exact_metadata: bool = False  # metadata verbatim: no skeleton and no checksums in the file
    devices: list[int] = field(default_factory=list)  # CUDA devices of the tensors
    # CUDA tensors that are not contiguous, by index into `arrays`: each save copies them (prepare()).
    gathered: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    # Set by a staging prepare(): every tensor's place in the staged copies, as (index into `bases`, byte
    # offset, element size, shape): the core takes the few buffers instead of a DLPack export per tensor.
    views: list[tuple[int, int, int, torch.Size]] = field(default_factory=list)
    bases: list[torch.Tensor] = field(default_factory=list)  # one uint8 buffer per device
    # Each tensor as planned, in `arrays` order: the tensor given, and its data pointer, shape, dtype, CUDA
    # device (-1: host) and bytes. A later plan `like` this one reuses the checks of those it still holds.
    sources: list[torch.Tensor] = field(default_factory=list)
    keys: list[tuple[int, torch.Size, torch.dtype, int, int]] = field(default_factory=list)

    def holds(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether `tensors` are this plan's, in its order and as it planned them: the same objects, over the
        same memory, with the same shapes and dtypes. Its exports then still read them (a dtype DLPack lacks
        goes as an integer view of the memory planned), and copies staged from it are theirs."""
        return (
            len(tensors) == len(self.sources)
            and all(map(operator.is_, tensors, self.sources))
            and [k[:3] for k in self.keys] == [(t.data_ptr(), t.shape, t.dtype) for t in tensors]
        )


def prepare(plan: SavePlan, *, stage: bool = False) -> SavePlan:
    """What a save of `plan` hands the core now: each device's current stream, and fresh contiguous copies
    of the CUDA views that need one. With `stage`, every tensor is copied (on its own device, in the
    caller's stream order): the save then reads those copies, and the caller may change the originals at
    once."""
    return prepare_many([plan], stage=stage)[0]


@dataclass
class Prepared:
    """What a save of several plans hands the core now, per file: the arrays to read (staged copies, or
    the tensors with their non-contiguous CUDA views made contiguous), their places in the staged buffers,
    and each CUDA device's current stream; and the staged buffers."""

    arrays: list[list[torch.Tensor]]
    views: list[list[tuple[int, int, int, torch.Size]]]
    streams: list[list[tuple[int, int]]]
    bases: list[torch.Tensor]


def prepare_all(plans: Sequence[SavePlan], *, stage: bool = False, stager: Stager | None = None) -> Prepared:
    """:func:`prepare_many`'s work without a copy of each plan (what a save of a checkpoint's many files
    does on the caller's thread)."""
    arrays = [list(p.arrays) for p in plans]
    views: list[list[Any]] = [[] for _ in plans]
    bases: list[torch.Tensor] = []
    if stage:  # every tensor copied, the non-contiguous ones too
        bases = (stager or Stager()).stage(arrays, views)
    else:
        for k, p in enumerate(plans):
            for i, t in p.gathered:  # queued on the caller's stream, before the event the core records
                arrays[k][i] = export_view(t.contiguous())
    current: dict[int, tuple[int, int]] = {}  # each device's current stream, asked for once
    streams = []
    for p in plans:
        for d in p.devices:
            if d not in current:
                current[d] = (d, torch.cuda.current_stream(d).cuda_stream)
        streams.append([current[d] for d in p.devices])
    return Prepared(arrays, views, streams, bases)


def prepare_many(
    plans: Sequence[SavePlan], *, stage: bool = False, stager: Stager | None = None
) -> list[SavePlan]:
    """:func:`prepare` for several plans saved together (a checkpoint's files). Staged, their copies share one
    allocation per device, filled by one multi-tensor copy per dtype: a few kernel launches on the caller's
    thread instead of an allocation and a copy per tensor (stage.py; `stager` keeps the layout for the next
    call that stages the same tensors)."""
    prep = prepare_all(plans, stage=stage, stager=stager)
    return [
        dataclasses.replace(p, arrays=a, views=v, bases=prep.bases, streams=s)
        for p, a, v, s in zip(plans, prep.arrays, prep.views, prep.streams)
    ]


def export_view(t: torch.Tensor) -> torch.Tensor:
    """A tensor over the same memory that DLPack can carry, on any torch >= 2.1."""
    if t.requires_grad:  # DLPack refuses them; detach() costs microseconds, so only where needed
        t = t.detach()
    if t.dtype in _EXPORTABLE:
        return t
    return t.view(_INT_OF_SIZE[t.element_size()])


def plan_save(
    state: Any,
    *,
    metadata: Mapping[str, str] | None = None,
    allow_pickle: bool = False,
    exact_metadata: bool = False,
    like: SavePlan | None = None,
) -> SavePlan:
    """Flattens `state`; :func:`prepare` makes a save of it. With `exact_metadata`, `state` must be a flat
    dict of str to tensor and `metadata` becomes the whole `__metadata__` (no skeleton, version or
    checksums), as strict readers require.

    `like`: an earlier plan of a state much like this one (an optimizer's, checkpoint after checkpoint). Each
    tensor that is the one `like` planned at the same place, under the same name, with the same data and
    shape, takes that plan's checks and export instead of doing them again; the walk, the names and the
    plain values are this call's. The result is the plan `state` alone gives."""
    plan = SavePlan(exact_metadata=exact_metadata)
    if exact_metadata and (
        not isinstance(state, dict)
        or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items())
    ):
        raise TypeError("exact_metadata=True needs a flat dict of str to tensor")
    by_id: dict[int, str] = {}
    taken: set[str] = {"__metadata__"}
    devices: set[int] = set()
    gathered_before = dict(like.gathered) if like is not None else {}

    def name_of(path: str) -> str:
        name = path or "tensor"
        if name in taken:
            k = 1
            while f"{name}#{k}" in taken:
                k += 1
            name = f"{name}#{k}"
        taken.add(name)
        return name

    def reused(t: torch.Tensor, name: str) -> bool:
        n = len(plan.arrays)
        if like is None or n >= len(like.sources) or like.sources[n] is not t or like.names[n] != name:
            return False
        key = like.keys[n]
        if t.data_ptr() != key[0] or t.shape != key[1] or t.dtype != key[2]:  # resized, data replaced
            return False
        if key[3] >= 0:
            devices.add(key[3])
        if n in gathered_before:
            plan.gathered.append((n, t))
        plan.names.append(name)
        plan.dtypes.append(like.dtypes[n])
        plan.arrays.append(like.arrays[n])
        plan.sources.append(t)
        plan.keys.append(key)
        plan.nbytes += key[4]
        return True

    def on_tensor(t: torch.Tensor, path: str) -> str:
        known = by_id.get(id(t))
        if known is not None:  # the same tensor twice (tied weights): stored once, aliased on load
            return known
        name = name_of(path)  # a refusal below fails the whole plan: naming first changes nothing
        by_id[id(t)] = name
        if reused(t, name):
            return name
        if t.device.type not in ("cpu", "cuda"):
            raise TypeError(f"cannot save the tensor at {path!r}: it is on {t.device} (CPU and CUDA only)")
        if t.is_sparse or t.layout != torch.strided:
            raise TypeError(f"cannot save the tensor at {path!r}: layout {t.layout} is not strided")
        try:
            dt = fmt.dtype_of(t.dtype)
        except TypeError:
            raise TypeError(
                f"cannot save the tensor at {path!r}: {t.dtype} has no safetensors dtype"
            ) from None
        device = -1
        if t.device.type == "cuda":
            device = t.device.index
            devices.add(device)
            if not t.is_contiguous():
                plan.gathered.append((len(plan.arrays), t))
        plan.names.append(name)
        plan.dtypes.append(dt.name)
        plan.arrays.append(export_view(t))
        plan.sources.append(t)
        plan.keys.append((t.data_ptr(), t.shape, t.dtype, device, t.numel() * dt.itemsize))
        plan.nbytes += t.numel() * dt.itemsize
        return name

    if exact_metadata:  # no skeleton to write: the flat dict is walked as it is
        skel = ""
        for k, v in state.items():
            on_tensor(v, k)
    else:
        skel = skeleton.encode(state, on_tensor, allow_pickle=allow_pickle)
    plan.devices = sorted(devices)

    plan.metadata = fmt.header_metadata(dict(metadata or {}), None if exact_metadata else skel)
    return plan
