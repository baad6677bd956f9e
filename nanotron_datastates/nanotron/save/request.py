"""A checkpoint between its request and its hand-over to the committer: what it carries from the request (the
host values of that moment, copied), what it has queued so far, and how a failure to queue is reported."""

from __future__ import annotations

import collections
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from ...save.commit import PendingCheckpoint
from ...save.staged_save import StagedSave
from .. import log as say
from .. import rng_states as states
from .rank_files import RankFiles

if TYPE_CHECKING:
    from ...save.handle import SaveHandle
    from ...save.plan import SavePlan
    from ..types import FileEntries, LRScheduler, RandomStates


@dataclasses.dataclass
class Request:
    """A checkpoint between its request and its hand-over to the committer."""

    pending: PendingCheckpoint
    later: list[tuple[Path, object]]  # (path in the checkpoint, host value captured at the request)
    finalizer: Callable[[], Callable[[FileEntries], None]] | None
    deferred: bool  # captured at the next step's start and queued once it is launched
    staged: StagedSave | None = None  # the state's files, staged before the step, queued after it
    # (index among the staged files, copy of the optimizer's state before the step): planned after the step
    replan: tuple[int, object] | None = None
    # The state's files (path in the checkpoint, plan), known at the capture, their targets at the queuing
    files: list[tuple[Path, SavePlan]] = dataclasses.field(default_factory=list)
    handles: list[SaveHandle] = dataclasses.field(default_factory=list)  # every file queued so far
    seconds: float = 0.0  # on the training thread, capturing and queuing
    captured: float = 0.0  # of which capturing (before the step, where deferred)
    background: float = 0.0  # on the queuer's thread


def host_values(
    files: RankFiles, lr_scheduler: LRScheduler, random_states: RandomStates
) -> list[tuple[Path, object]]:
    """The host values of the request's moment, copied (the next forward pass draws random numbers), each
    with its file: nothing changes them, so their files are planned and queued later, when the GPU has work
    queued."""
    later: list[tuple[Path, object]] = [(files.random, random_state(random_states))]
    if files.lr_scheduler is not None:
        later.insert(0, (files.lr_scheduler, host_copy(lr_scheduler.state_dict())))
    return later


def random_state(random_states: RandomStates) -> dict[str, object]:
    """The random states, copied: each of its tensors a copy (fewer copies than `host_copy` of them makes:
    each torch call lets the engine's threads take the GIL from the training thread)."""
    return {
        "nanotron": {k: states.random_state_to_plain(v, copy=True) for k, v in random_states.items()},
        "global": states.global_rng_state(),
    }


def queuing_failed(pending: PendingCheckpoint, e: Exception) -> None:
    """Reported at the next checkpoint or the end, as a failed write would be."""
    pending.errors.append(f"queuing its files failed: {e!r}")
    say.error(f"checkpoint {pending.step}: {pending.errors[-1]}", every_rank=True)


def add_stall(pending: PendingCheckpoint, seconds: float) -> None:
    pending.stall_s += seconds


def host_copy(x: object) -> object:
    """`x` with its containers and tensors copied (a scheduler's state here: the random states are copied by
    `random_state`), so that the files made of it are read as they were at the request, whenever the engine
    reads them (a GPU tensor's copy is made in its stream's order, before any later change)."""
    if isinstance(x, torch.Tensor):
        return x.clone()
    # Exactly these types: the containers a skeleton holds as data
    if isinstance(x, dict) and type(x) in (dict, collections.OrderedDict):
        return type(x)((k, host_copy(v)) for k, v in x.items())
    if isinstance(x, (list, tuple)) and type(x) in (list, tuple):
        if set(map(type, x)) <= _PLAIN:  # plain values only (learning rates): checked and copied at C speed
            return x if type(x) is tuple else list(x)
        return type(x)(host_copy(v) for v in x)
    return x


_PLAIN = frozenset((type(None), bool, int, float, str))  # immutable: a tuple of them is its own copy
