"""Resume, the optimizer state: where the layout changed, put together from the saved shards and loaded now
(reshard.py); else this rank's file, loaded at the first optimizer step (`nanotron_datastates.resume`'s
deferred_optimizer.py, which logs through `log.info`), as read ahead (its read_ahead.py) or read then."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from ... import state_parts
from ...checkpoint.manifest import entries
from ...checkpoint.reads import optimizer_files
from ...engine import DataStatesEngine
from ...resume.deferred_optimizer import DeferredOptimizer
from ...resume.read_ahead import Prefetch
from .. import log as say
from .. import shards
from . import reshard

if TYPE_CHECKING:
    from ..types import BaseOptimizer, NanotronModel, ParallelContext

Device = torch.device | None


def load(
    engine: DataStatesEngine,
    manifest: Mapping[str, object],
    src: Path,
    optimizer: BaseOptimizer,
    model: NanotronModel,
    pc: ParallelContext,
    changed: dict[str, tuple[int | None, int]],
    device: Device,
    read: Callable[[Path, Device], object],
    ahead: bool,
) -> DeferredOptimizer | None:
    """The optimizer state from `src`: saved on another layout (`changed`), resharded and loaded now (None);
    else this rank's file (`deferred`), loaded at its first use where it is being read ahead (`ahead`), else
    now."""
    if changed:
        load_resharded(engine, manifest, src, optimizer, model, pc, changed, device)
        return None
    state = deferred(optimizer, pc, src, read, device)
    if not ahead:
        state.load()  # not read ahead: loaded now
    return state


def load_resharded(
    engine: DataStatesEngine,
    manifest: Mapping[str, object],
    src: Path,
    optimizer: BaseOptimizer,
    model: NanotronModel,
    pc: ParallelContext,
    changed: dict[str, tuple[int | None, int]],
    device: Device,
) -> None:
    """The state saved on another layout (`changed`: what changed, from what to what), loaded now."""
    state = reshard.optimizer_state(engine, manifest, src, optimizer, model, pc)
    optimizer.load_state_dict(state, map_location=device or "cpu")
    moved = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items())
    say.info(f"optimizer state resharded ({moved})")


def deferred(
    optimizer: BaseOptimizer,
    pc: ParallelContext,
    src: Path,
    read: Callable[[Path, Device], object],
    device: Device,
) -> DeferredOptimizer:
    """This rank's optimizer file, to be loaded into `optimizer` at its first use: `read(path, device)` reads
    it (`read_file`, with the resume's read-ahead and engine of the time)."""
    path = shards.optimizer_file(pc, src, zero=shards.is_zero(optimizer))
    return DeferredOptimizer(optimizer, functools.partial(read, path, device), device or "cpu", say.info)


def read_file(
    prefetch: Prefetch | None,
    engine: Callable[[], DataStatesEngine],
    manifest: Mapping[str, object],
    path: Path,
    device: Device,
) -> object:
    """The optimizer state of the file `path` (in `manifest`'s checkpoint, or its copy in memory): as read
    ahead, or read now; put together from its parts where the replicas wrote it in parts."""
    paths = parts(manifest, path)
    state = prefetch.optimizer(paths) if prefetch is not None else None
    if state is None:  # not read ahead, or (were Nanotron to change) not the optimizer's file
        state = state_parts.merge([engine().load(p, device or "cpu") for p in paths])
    return state


def parts(manifest: Mapping[str, object], path: Path) -> list[Path]:
    """The files that hold the optimizer file `path`: itself, or its parts (`optimizer_files`)."""
    rel = f"optimizer/{path.name}"
    names = optimizer_files(entries(manifest)).get(rel, [rel])
    return [path.parent / Path(name).name for name in names]
