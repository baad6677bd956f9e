"""What a resume restores besides the weights and the optimizer state: the LR scheduler with the training
metadata, and the random states, on the saved layout or another (reshard.py, random_states_at)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from ... import trust
from ...checkpoint.checksums import file_checksums
from ...checkpoint.manifest import entries
from ...checkpoint.names import NANOTRON_METADATA, name_in
from ...checkpoint.reads import random_states_at
from ...engine import DataStatesEngine
from .. import groups, shards
from .. import log as say
from .. import rng_states as states
from . import reshard

if TYPE_CHECKING:
    from ..types import (
        BaseOptimizer,
        LRScheduler,
        NanotronModel,
        ParallelContext,
        RandomStates,
        TrainingMetadata,
    )


def load_scheduler(
    engine: DataStatesEngine,
    manifest: Mapping[str, object],
    folder: Path,
    src: Path,
    changed: dict[str, tuple[int | None, int]],
    lr_scheduler: LRScheduler,
    optimizer: BaseOptimizer,
    model: NanotronModel,
    pc: ParallelContext,
    train_steps: int,
) -> TrainingMetadata:
    """Loads the LR scheduler's state from `src` (resharded where the layout `changed`); returns the training
    metadata of the checkpoint in `folder` (Nanotron's `checkpoint_metadata.json`), ValueError where it has
    trained `train_steps` (the config's) already."""
    from nanotron.serialize.metadata import load_meta

    # Unlike Nanotron's loader, no `_initial_step()` after this: it steps the schedule once more, so the
    # resumed run would use the next step's learning rate. The optimizer's param groups, restored first,
    # already hold the rate the original run would use now.
    if changed:
        lr_scheduler.load_state_dict(reshard.scheduler_state(engine, manifest, src, optimizer, model, pc))
    else:
        lr_scheduler.load_state_dict(engine.load(shards.lr_scheduler_file(pc, src)))
    os.close(trust.open_to_read(folder / NANOTRON_METADATA))  # a FIFO: an error, not Nanotron's wait
    metadata = load_meta(parallel_context=pc, root_folder=folder).metas
    if train_steps <= metadata.last_train_step:
        steps = metadata.last_train_step
        raise ValueError(f"the checkpoint has already trained {steps} steps; set tokens.train_steps higher")
    return metadata


def load_random_states(
    engine: DataStatesEngine,
    manifest: Mapping[str, object],
    src: Path,
    changed: dict[str, tuple[int | None, int]],
    random_states: RandomStates,
    pc: ParallelContext,
) -> None:
    """Restores this rank's random states in place (the model holds them), and the process's generators. On
    another layout, a rank that did not exist takes those of the saved rank at its place (modulo the saved
    sizes)."""
    path = shards.random_states_path(pc, src)
    listed = name_in(path, src) in entries(manifest)
    if not path.exists() and listed:
        raise FileNotFoundError(f"{path}: listed in the checkpoint's manifest, missing")
    if not path.exists() and changed:
        path = src / "random" / random_states_at(manifest, groups.place(pc))
        say.info(
            f"random states: this layout's ranks take those of the saved ranks at the same places, "
            f"modulo the saved sizes (rank 0: {path.name})"
        )
    if not path.exists():
        return
    saved = engine.load(path, checksums=file_checksums(manifest, src, path))
    for key, value in saved["nanotron"].items():
        random_states[key] = states.random_state_from_plain(value)
    if "global" in saved:  # absent from checkpoints converted from Nanotron's layout
        states.set_global_rng_state(saved["global"])
