"""Memory checkpoints never stall training. One that falls due while `MAX_IN_FLIGHT` checkpoints are still in
flight (a memory tier slower than `memory_interval`, a checkpoint to storage still persisting) is skipped,
where a checkpoint to storage would wait for the oldest: the next one due is taken instead. Every rank skips
the same ones: the outcomes ready on every rank are agreed first (one gloo all-reduce of a count, on a group
of the saver's own), and taken, so that each rank counts the same checkpoints in flight."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as tdist

from .. import log as say
from .saver import MAX_IN_FLIGHT, Saver


def agreed(count: int, group: tdist.ProcessGroup | None) -> int:
    """The least `count` of the ranks of `group` (collective); `count` itself without a group."""
    if group is None:
        return count
    least = torch.tensor([count], dtype=torch.int64)
    tdist.all_reduce(least, op=tdist.ReduceOp.MIN, group=group)
    return int(least.item())


def skips(saver: Saver, step: int, on_committed: Callable[[int], None]) -> bool:
    """Whether the memory checkpoint of `step`, due, is skipped. Collective: every rank calls it at the same
    memory checkpoints and gets the same answer. First takes the outcomes every rank already has (raising
    CheckpointError for a checkpoint to storage that failed, as `Saver.backpressure` would)."""
    saver.take(agreed(saver.committer.ready(), saver.pace_group), on_committed)
    if saver.outstanding < MAX_IN_FLIGHT:
        return False
    saver.memory_skipped.append(step)
    say.info(
        f"memory checkpoint of step {step} skipped: {saver.outstanding} checkpoints still in flight (the "
        "memory tier, or storage, takes longer than datastates.memory_interval's steps); the next one due is "
        "taken instead"
    )
    return True
