"""This rank's place in Nanotron's process groups, on every Nanotron from 2cde8f6 (2024-12) to main.

Found by attribute, never by version. Main added context parallelism (`cp_pg`; `dp_cp_pg`, the data- and
context-parallel replicas of one model shard, which share out the writing of its weights) and renamed
`expert_pg` to `ep_pg`. On a Nanotron without them, cp is 1 and the replicas are the data-parallel group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

from nanotron import distributed as dist

from ..checkpoint.names import Place
from ..checkpoint.topology import topology
from .compat import NanotronUnavailable

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from .types import ParallelContext

T = TypeVar("T")

# What the adapter reads from a ParallelContext; a tuple means any one of these names.
REQUIRED: tuple[str | tuple[str, ...], ...] = (
    "world_pg",
    "tp_pg",
    "dp_pg",
    "pp_pg",
    ("ep_pg", "expert_pg"),
    "world_ranks_to_pg",
    "expert_parallel_size",
)


def check(pc: ParallelContext) -> None:
    """Raises NanotronUnavailable, at start-up, if this Nanotron's ParallelContext lacks a group the adapter
    reads (rather than an AttributeError at the first checkpoint)."""
    missing = []
    for need in REQUIRED:
        names = need if isinstance(need, tuple) else (need,)
        if not any(hasattr(pc, n) for n in names):
            missing.append(" or ".join(names))
    if missing:
        raise NanotronUnavailable(
            f"this Nanotron's ParallelContext has no {', '.join(missing)}, which nanotron-datastates reads "
            "to plan each rank's files; it supports Nanotron from commit 2cde8f6 (2024-12-05) to main"
        )


def ep(pc: ParallelContext) -> ProcessGroup:
    """The expert-parallel group (`ep_pg` on main, `expert_pg` before 2025-03)."""
    return pc.ep_pg if hasattr(pc, "ep_pg") else pc.expert_pg


def cp_size(pc: ParallelContext) -> int:
    cp = getattr(pc, "cp_pg", None)
    return cp.size() if cp is not None else 1


def cp_rank(pc: ParallelContext) -> int:
    cp = getattr(pc, "cp_pg", None)
    return dist.get_rank(cp) if cp is not None else 0


def dp_cp(pc: ParallelContext) -> ProcessGroup:
    """The ranks holding the same model shard: data- and context-parallel replicas."""
    return getattr(pc, "dp_cp_pg", None) or pc.dp_pg


def replica_cp_ranks(pc: ParallelContext) -> list[int]:
    """The context-parallel rank of each member of `dp_cp(pc)`, in the group's rank order."""
    group = dp_cp(pc)
    if cp_size(pc) == 1:
        return [0] * group.size()
    world = [dist.get_global_rank(group, r) for r in range(group.size())]
    return [int(pc.get_local_ranks(int(w))["cp"]) for w in world]


def rank(pg: ProcessGroup) -> int:
    return dist.get_rank(pg)


def place(pc: ParallelContext) -> Place:
    """This rank's (rank, size) in each dimension that names its files."""
    return Place(
        tp=(rank(pc.tp_pg), pc.tp_pg.size()),
        dp=(rank(pc.dp_pg), pc.dp_pg.size()),
        pp=(rank(pc.pp_pg), pc.pp_pg.size()),
        cp=(cp_rank(pc), cp_size(pc)),
        ep=(rank(ep(pc)), pc.expert_parallel_size),
    )


def layout_of(pc: ParallelContext, zero_stage: int) -> dict[str, int]:
    """The manifest's topology for this ParallelContext."""
    return topology(
        tp=pc.tp_pg.size(),
        pp=pc.pp_pg.size(),
        dp=pc.dp_pg.size(),
        cp=cp_size(pc),
        expert=pc.expert_parallel_size,
        zero_stage=zero_stage,
    )


def gather(obj: T, pc: ParallelContext) -> list[T]:
    """`obj` of every rank, in rank order (collective over the world group; [obj] without one)."""
    import torch.distributed as tdist

    if not tdist.is_initialized():
        return [obj]
    out = [obj] * tdist.get_world_size(pc.world_pg)  # each entry replaced by that rank's
    tdist.all_gather_object(out, obj, group=pc.world_pg)
    return out
