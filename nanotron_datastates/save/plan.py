"""Save, stage 0 (caller's thread): flatten a state into named tensors plus its skeleton.

This is the only work a save does on the caller's thread, so it does the least it can. Once per state
(`plan_save`): walk the structure and take a reference to each tensor (so it stays alive until it is copied).
At every save of it, prepare.py hands the plan to the core. Layout, header and every byte copy happen on the
engine's threads.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

from .. import _core, skeleton, skeleton_text
from .. import format as fmt

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
# What a tensor's entry in a plan depends on: data pointer, shape, strides, dtype, requires_grad.
_Key = tuple[int, torch.Size, tuple[int, ...], torch.dtype, bool]


@dataclass
class SavePlan:
    """A flattened state. Reusable: it holds the tensors themselves, so each save (through
    :func:`prepare.prepare`) captures their values at that time."""

    names: list[str] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    arrays: list[torch.Tensor] = field(default_factory=list)  # what the core reads (keeps them alive)
    streams: list[tuple[int, int]] = field(default_factory=list)  # set by prepare.py
    metadata: list[tuple[str, str]] = field(default_factory=list)
    nbytes: int = 0
    exact_metadata: bool = False  # metadata verbatim: no skeleton and no checksums in the file
    devices: list[int] = field(default_factory=list)  # CUDA devices of the tensors
    # CUDA tensors that are not contiguous, by index into `arrays`: each save copies them (prepare.py).
    gathered: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    # Set by a staging save (prepare.py): every tensor's place in the staged copies (in which of `bases`,
    # where, element size, shape): the core takes the few buffers instead of a DLPack export per tensor.
    views: list[_core.StagedView] = field(default_factory=list)
    bases: list[torch.Tensor] = field(default_factory=list)  # one uint8 buffer per device
    # Each tensor as planned, in `arrays` order: the tensor given, and its `_Key` (what its entry depends
    # on), CUDA device (-1: host) and bytes. A plan `like` this one reuses the entries of those it holds.
    sources: list[torch.Tensor] = field(default_factory=list)
    keys: list[tuple[_Key, int, int]] = field(default_factory=list)

    def holds(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether `tensors` are this plan's, in its order and as it planned them: the same objects, over the
        same memory, with the same shapes, strides, dtypes and autograd flag. Its exports then still read them
        as they are (a dtype DLPack lacks goes as an integer view of the memory planned), its dtypes are
        theirs, and copies staged from it are theirs."""
        return (
            len(tensors) == len(self.sources)
            and all(map(operator.is_, tensors, self.sources))
            and self._describes(tensors)
        )

    def _describes(self, tensors: Sequence[torch.Tensor]) -> bool:
        return [k[0] for k in self.keys] == [
            (t.data_ptr(), t.shape, t.stride(), t.dtype, t.requires_grad) for t in tensors
        ]

    def copy(self) -> SavePlan:
        """A shallow copy (its lists shared: a renewal replaces them, never changes them), made without
        `copy.copy`'s generic path: a checkpoint copies each of its files' plans on the training thread."""
        new = object.__new__(SavePlan)
        new.__dict__.update(self.__dict__)
        return new

    def renew(self, path: str = "") -> None:
        """Makes again, in place, the entries of the tensors this plan no longer describes (`holds`): the same
        tensors under the same names, with the same plain values and metadata, as they are now. Lists are
        replaced, never changed: a copy of the plan taken before keeps its entries. ValueError naming the
        tensor (and `path`, the file) where one can no longer be saved."""
        if self._describes(self.sources):
            return
        new = SavePlan(exact_metadata=self.exact_metadata, metadata=self.metadata)
        devices: set[int] = set()
        for t, name in zip(self.sources, self.names):
            try:
                _add(new, t, name, name, devices, self)
            except TypeError as e:
                raise ValueError(
                    f"{path or 'a saved plan'}: tensor {name!r} changed since planned: {e}"
                ) from e
        new.devices = sorted(devices)
        for f in ("dtypes", "arrays", "keys", "gathered", "devices", "nbytes"):
            setattr(self, f, getattr(new, f))
        self.streams, self.views, self.bases = [], [], []


def export_view(t: torch.Tensor) -> torch.Tensor:
    """A tensor over the same memory that DLPack can carry, on any torch >= 2.1."""
    if t.requires_grad:  # DLPack refuses them; detach() costs microseconds, so only where needed
        t = t.detach()
    if t.dtype in _EXPORTABLE:
        return t
    return t.view(_INT_OF_SIZE[t.element_size()])


def plan_save(
    state: object,
    *,
    metadata: Mapping[str, str] | None = None,
    allow_pickle: bool = False,
    exact_metadata: bool = False,
    like: SavePlan | None = None,
    keep: dict[object, object] | None = None,
) -> SavePlan:
    """Flattens `state`; :func:`prepare.prepare` makes a save of it. With `exact_metadata`, `state` must be a
    flat dict of str to tensor and `metadata` becomes the whole `__metadata__` (no skeleton, version or
    checksums), as strict readers require.

    `like`: an earlier plan of a state much like this one (an optimizer's, checkpoint after checkpoint). Each
    tensor that is the one `like` planned at the same place, under the same name, as `like` planned it
    (`SavePlan.holds`: memory, shape, strides, dtype, autograd flag), takes that plan's checks and export
    instead of doing them again; the walk, the names and the plain values are this call's. The result is
    the plan `state` alone gives."""
    plan = SavePlan(exact_metadata=exact_metadata)
    if exact_metadata and (
        not isinstance(state, dict)
        or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items())
    ):
        raise TypeError("exact_metadata=True needs a flat dict of str to tensor")
    by_id: dict[int, str] = {}
    taken: set[str] = {"__metadata__"}
    devices: set[int] = set()

    def name_of(path: str) -> str:
        name = path or "tensor"
        if name in taken:
            k = 1
            while f"{name}#{k}" in taken:
                k += 1
            name = f"{name}#{k}"
        taken.add(name)
        return name

    met: list[tuple[torch.Tensor, str, str]] = []  # each tensor once, in the walk's order: (it, name, path)

    def on_tensor(t: torch.Tensor, path: str) -> str:
        known = by_id.get(id(t))
        if known is not None:  # the same tensor twice (tied weights): stored once, aliased on load
            return known
        name = name_of(path)
        by_id[id(t)] = name
        met.append((t, name, path))
        return name

    if exact_metadata and isinstance(state, dict):  # a flat dict (checked above): no skeleton to write
        skel = ""
        for k, v in state.items():
            on_tensor(v, k)
    else:
        skel = skeleton.encode(state, on_tensor, allow_pickle=allow_pickle, keep=keep)
    if not _take_whole(plan, met, like):
        for t, name, path in met:  # a refusal fails the whole plan
            _add(plan, t, name, path, devices, like)
        plan.devices = sorted(devices)

    plan.metadata = fmt.header_metadata(dict(metadata or {}), None if exact_metadata else skel)
    return plan


def plan_again(
    state: object, like: SavePlan, reuse: Mapping[object, object], texts: skeleton_text.Texts | None = None
) -> SavePlan | None:
    """`plan_save(state, like=like)` where every tensor of `state` is in the top-level values whose encoded
    nodes `reuse` holds (`skeleton.encode`'s `keep` for `like`), as `like` planned them: the caller vouches
    (an optimizer's per-parameter state, checked before the step). Only the rest (its param groups) is
    walked; with `texts` (kept by the caller from one call to the next), the skeleton's text is made from
    the last one's where only plain values changed (skeleton_text.py). None where the rest holds a tensor."""

    met: list[str] = []

    def on_tensor(t: torch.Tensor, path: str) -> str:
        met.append(path)
        return path

    skel = skeleton_text.encode(state, reuse, texts) if texts is not None else None  # None: walked
    if skel is None:
        skel = skeleton.encode(state, on_tensor, reuse=reuse)
    if met:  # a tensor outside the reused values
        return None
    plan = SavePlan()
    _take_entries(plan, like, like.sources)
    plan.metadata = fmt.header_metadata({}, skel)
    return plan


def _take_whole(plan: SavePlan, met: list[tuple[torch.Tensor, str, str]], like: SavePlan | None) -> bool:
    """Where `like` planned these very tensors under these names, as they are now (`SavePlan.holds`), its
    entries go into `plan` whole: an optimizer's state planned at every checkpoint is checked in one pass
    over its tensors, not entry by entry. False (nothing taken) otherwise."""
    if like is None or len(met) != len(like.sources) or not like.names:
        return False
    tensors = [m[0] for m in met]
    if [m[1] for m in met] != like.names or not like.holds(tensors):
        return False
    _take_entries(plan, like, tensors)
    return True


def _take_entries(plan: SavePlan, like: SavePlan, tensors: list[torch.Tensor]) -> None:
    plan.names, plan.dtypes, plan.arrays = list(like.names), list(like.dtypes), list(like.arrays)
    plan.sources, plan.keys, plan.gathered = tensors, list(like.keys), list(like.gathered)
    plan.nbytes, plan.devices = like.nbytes, list(like.devices)


def _add(
    plan: SavePlan, t: torch.Tensor, name: str, path: str, devices: set[int], like: SavePlan | None
) -> None:
    """Appends `t`'s entry under `name` to `plan` (and its CUDA device to `devices`): `like`'s entry at the
    same place where it is of this very tensor, under this name, as it is now; else a new one. TypeError
    naming `path` where `t` cannot be saved."""
    n = len(plan.arrays)
    if like is not None and n < len(like.sources) and like.sources[n] is t and like.names[n] == name:
        entry = like.keys[n]
        if entry[0] == (t.data_ptr(), t.shape, t.stride(), t.dtype, t.requires_grad):
            return _append(plan, t, name, like.dtypes[n], like.arrays[n], entry, devices)
    if t.device.type not in ("cpu", "cuda"):
        raise TypeError(f"cannot save the tensor at {path!r}: it is on {t.device} (CPU and CUDA only)")
    if t.is_sparse or t.layout != torch.strided:
        raise TypeError(f"cannot save the tensor at {path!r}: layout {t.layout} is not strided")
    try:
        dt = fmt.dtype_of(t.dtype)
    except TypeError:
        raise TypeError(f"cannot save the tensor at {path!r}: {t.dtype} has no safetensors dtype") from None
    key = (t.data_ptr(), t.shape, t.stride(), t.dtype, t.requires_grad)
    device = t.device.index if t.device.type == "cuda" else -1
    _append(plan, t, name, dt.name, export_view(t), (key, device, t.numel() * dt.itemsize), devices)


def _append(
    plan: SavePlan,
    t: torch.Tensor,
    name: str,
    dtype: str,
    array: torch.Tensor,
    entry: tuple[_Key, int, int],
    devices: set[int],
) -> None:
    """Appends a tensor's entry to `plan`; a non-contiguous CUDA tensor is also gathered at each save."""
    device = entry[1]
    if device >= 0:
        devices.add(device)
        if not t.is_contiguous():  # made contiguous at each save (prepare.py)
            plan.gathered.append((len(plan.arrays), t))
    plan.names.append(name)
    plan.dtypes.append(dtype)
    plan.arrays.append(array)
    plan.sources.append(t)
    plan.keys.append(entry)
    plan.nbytes += entry[2]
