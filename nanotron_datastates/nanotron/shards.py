"""This rank's share of a Nanotron checkpoint: which files it writes and reads, under Nanotron's rules.

`weight_shards` mirrors `nanotron.serialize.weights.save_weights` (one rank per tied group; experts; sharded
parameters carry Nanotron's TensorMetadata), and `weight_sources` mirrors `load_weights` for the same
topology. ZeRO-1 optimizer shards are written by every DP rank. Context-parallel ranks hold the same optimizer
state (ZeRO shards over the data-parallel group only): where Nanotron main has each of them write the same
file, only context-parallel rank 0 writes it here, since one file has one writer.

The files every data- and context-parallel replica of a model shard holds alike (its weights; the optimizer
without ZeRO; the scheduler) are each written by one replica: by rank 0 of them, as Nanotron does, or, with
`Writers` from `writers(balance=True)`, shared out among them (`assign`), so that each copies and writes
about an equal part. Only who writes a file changes: its name and bytes are Nanotron's either way.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Callable, TypedDict

import torch
from nanotron import distributed as dist
from nanotron import optim
from nanotron.constants import CHECKPOINT_VERSION
from nanotron.distributed import get_global_rank
from nanotron.parallel.parameters import NanotronParameter, SlicesPair
from nanotron.serialize.metadata import CheckpointMetadata, TensorMetadata, process_type
from nanotron.serialize.utils import ObjectType, get_exp_tp_pp_rank_and_size_from, get_path

from ..checkpoint.names import part_name
from . import groups

if TYPE_CHECKING:
    from collections.abc import Iterable

    from .types import BaseOptimizer, ParallelContext, TrainingMetadata


def _prefixes(model: torch.nn.Module) -> dict[int, str]:
    prefixes = {id(module): f"{name}." for name, module in model.named_modules()}
    prefixes[id(model)] = ""
    return prefixes


def _param(model: torch.nn.Module, name: str) -> NanotronParameter:
    try:
        param = model.get_parameter(name)
    except AttributeError:
        param = None
    if not isinstance(param, NanotronParameter):
        raise NotImplementedError(f"{name}: Nanotron checkpoints hold NanotronParameters only")
    return param


FILE_COST = 4096  # bytes a file counts for besides its tensors' when shared out: its header, its alignment
ADAM_BYTES = 8  # per parameter in an optimizer file: Adam's two fp32 moments (an estimate, for sharing out)


@dataclasses.dataclass(frozen=True)
class Writers:
    """Which rank of the data- and context-parallel replicas (`dp_cp`) writes each file they hold alike, by
    its name in the checkpoint; a file not in `of` is rank 0's. `me`: this rank's place among them. `parts`:
    the number of parts the optimizer file without ZeRO is written in (part k by replica k; 1: whole)."""

    of: dict[str, int]
    me: int
    parts: int = 1

    def mine(self, rel: Path | str) -> bool:
        return self.of.get(Path(rel).as_posix(), 0) == self.me


def assign(sizes: dict[str, int], loads: list[int]) -> dict[str, int]:
    """Each file of `sizes` ({name: bytes}) to one of `len(loads)` ranks, whose `loads` are the bytes they
    write besides: the largest file first (ties: by name), each to the least loaded rank so far (ties: the
    lowest). A function of its arguments only, so every rank computes the same."""
    loads = list(loads)
    out = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        r = min(range(len(loads)), key=lambda i: (loads[i], i))
        out[name] = r
        loads[r] += sizes[name]
    return out


def writers(
    model: torch.nn.Module, optimizer: BaseOptimizer, pc: ParallelContext, *, balance: bool = True
) -> Writers:
    """Who writes each file the replicas of this rank's model shard hold alike: with `balance`, shared out by
    `assign` from sizes the model and topology alone give, the same on every replica (they agree with no
    communication), each replica's ZeRO shard counted as its load; else rank 0 of them, as Nanotron."""
    dp_cp = groups.dp_cp(pc)
    me, size = groups.rank(dp_cp), dp_cp.size()
    if not balance or size == 1:
        return Writers({}, me)
    sizes = {rel.as_posix(): _nbytes(p) + FILE_COST for rel, p, _ in _model_files(model, pc)}
    optimizer_bytes = ADAM_BYTES * sum(p.numel() for p in model.parameters())
    sizes[lr_scheduler_file(pc, Path()).as_posix()] = FILE_COST
    if is_zero(optimizer):  # each replica's own shard is its load (context-parallel rank 0 writes each)
        shard = optimizer_bytes // pc.dp_pg.size()
        return Writers(assign(sizes, [0 if cp else shard for cp in groups.replica_cp_ranks(pc)]), me)
    # The optimizer state all replicas hold, written in parts: replica k writes part k (state_parts.py)
    return Writers(assign(sizes, [optimizer_bytes // size] * size), me, parts=size)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def weight_shards(
    model: torch.nn.Module, pc: ParallelContext, root: Path, writes: Writers | None = None
) -> list[tuple[Path, torch.Tensor, dict[str, str]]]:
    """(file, parameter, Nanotron's tensor metadata) for every weight file this rank writes: those `writes`
    gives it (default: every one where it is rank 0 of its replicas, as Nanotron).

    Depends on the model and topology only, so a trainer computes it once, with a relative `root`."""
    writes = writes or Writers({}, groups.rank(groups.dp_cp(pc)))
    return [(root / rel, p, md) for rel, p, md in _model_files(model, pc) if writes.mine(rel)]


def _model_files(
    model: torch.nn.Module, pc: ParallelContext
) -> list[tuple[Path, torch.Tensor, dict[str, str]]]:
    """(file relative to the checkpoint, parameter, tensor metadata) of every weight file the replicas of
    this rank's model shard hold."""
    prefixes = _prefixes(model)
    out = []
    planned: set[Path] = set()
    for name in model.state_dict():
        if groups.rank(groups.ep(pc)) != 0 and "experts" not in name:
            continue
        param = _param(model, name)
        base_name = name
        if param.is_tied:
            tied = param.get_tied_info()
            base_name = tied.get_full_name_from_module_id_to_prefix(module_id_to_prefix=prefixes)
            if dist.get_rank(pc.world_ranks_to_pg[tied.global_ranks]) != 0:
                continue  # one rank of a tied group writes it
        metadata: dict[str, str] = {}
        ranks, expert_sharded = None, False
        if param.is_sharded:
            info = param.get_sharded_info()
            group = pc.world_ranks_to_pg[info.global_ranks]
            ranks = get_exp_tp_pp_rank_and_size_from(
                world_rank=get_global_rank(group=group, group_rank=dist.get_rank(group)), parallel_context=pc
            )
            expert_sharded = info.is_expert_sharded(pc)
            metadata = TensorMetadata(
                version=CHECKPOINT_VERSION,
                local_global_slices_pairs=plain_pairs(info.local_global_slices_pairs),
                unsharded_shape=tuple(int(n) for n in info.unsharded_shape),
            ).to_str_dict()
        path = get_path(
            base_name,
            type=ObjectType.MODEL,
            exp_tp_pp_rank_and_size=ranks,
            is_expert_sharded=expert_sharded,
            prefix=Path("model"),
        )
        if path in planned:  # tied within this rank (embeddings and LM head): one file, written once
            continue
        planned.add(path)
        out.append((path, param, metadata))  # the parameter, not the state_dict's detached alias of it
    return out


def plain_pairs(pairs: Iterable[SlicesPair]) -> tuple[SlicesPair, ...]:
    """Nanotron's slice pairs with Python ints: its fused projections compute them with NumPy, whose
    integers print as `np.int64(48)` from NumPy 2 on, which no reader of the metadata parses back."""

    def plain(s: slice) -> slice:
        return slice(*(None if x is None else int(x) for x in (s.start, s.stop, s.step)))

    return tuple(
        SlicesPair(tuple(map(plain, p.local_slices)), tuple(map(plain, p.global_slices))) for p in pairs
    )


def weight_sources(
    model: torch.nn.Module, pc: ParallelContext, root: Path, served: Callable[[Path], bool] | None = None
) -> list[tuple[str, torch.Tensor, Path]] | None:
    """(name, destination, file) for every weight, where this topology wrote them; None if any file is
    missing (the topology changed: Nanotron's own loader merges and reshards) and not `served` (at a
    restart, by another rank's GPU)."""
    prefixes = _prefixes(model)
    out = []
    for name, tensor in model.state_dict().items():
        param = _param(model, name)
        base_name = name
        if param.is_tied:
            base_name = param.get_tied_info().get_full_name_from_module_id_to_prefix(
                module_id_to_prefix=prefixes
            )
        ranks, expert_sharded = None, False
        if param.is_sharded:
            info = param.get_sharded_info()
            if param.is_tied:  # the first rank of the tied group wrote it
                group, group_rank = pc.world_ranks_to_pg[param.get_tied_info().global_ranks], 0
            else:
                group = pc.world_ranks_to_pg[info.global_ranks]
                group_rank = dist.get_rank(group)
            ranks = get_exp_tp_pp_rank_and_size_from(
                world_rank=get_global_rank(group=group, group_rank=group_rank), parallel_context=pc
            )
            expert_sharded = info.is_expert_sharded(pc)
        path = get_path(
            base_name,
            type=ObjectType.MODEL,
            exp_tp_pp_rank_and_size=ranks,
            is_expert_sharded=expert_sharded,
            prefix=root / "model",
        )
        if not path.exists() and not (served is not None and served(path)):
            return None
        out.append((name, tensor, path))
    return out


def is_zero(optimizer: BaseOptimizer) -> bool:
    return optimizer.inherit_from(optim.ZeroDistributedOptimizer)


def optimizer_path(
    optimizer: BaseOptimizer, pc: ParallelContext, root: Path, *, writing: bool, writes: Writers | None = None
) -> Path | None:
    """This rank's optimizer file; when `writing`, None where it writes none: every DP rank writes its shard
    with ZeRO (context-parallel rank 0 only); without, its part where `writes` has the replicas write the one
    file in parts, else the one file, by rank 0 of the replicas."""
    zero = is_zero(optimizer)
    path = optimizer_file(pc, root, zero=zero)
    if writing and not zero and writes is not None and writes.parts > 1:
        return path.with_name(part_name(path.name, writes.me, writes.parts))
    if writing and (groups.cp_rank(pc) != 0 if zero else not _mine(pc, writes, path.relative_to(root))):
        return None
    return path


def _mine(pc: ParallelContext, writes: Writers | None, rel: Path) -> bool:
    return (writes or Writers({}, groups.rank(groups.dp_cp(pc)))).mine(rel)


def lr_scheduler_file(pc: ParallelContext, root: Path) -> Path:
    """The scheduler's file under `root`, which every rank reads."""
    return root / "lr_scheduler" / groups.place(pc).lr_scheduler_name()


def optimizer_file(pc: ParallelContext, root: Path, *, zero: bool) -> Path:
    """This rank's optimizer file under `root`, for a ZeRO optimizer (`zero`) or not."""
    return root / "optimizer" / groups.place(pc).optimizer_name(zero)


def lr_scheduler_path(
    pc: ParallelContext, root: Path, *, writing: bool, writes: Writers | None = None
) -> Path | None:
    """The scheduler's file. Every rank holds the same schedule, and Nanotron's name has no data-parallel rank
    for an integer ZeRO stage, so one replica writes it (the one `writes` gives it to; default: rank 0 of
    them) and every rank reads it."""
    path = lr_scheduler_file(pc, root)
    if writing and not _mine(pc, writes, path.relative_to(root)):
        return None
    return path


def random_states_path(pc: ParallelContext, root: Path) -> Path:
    """This rank's random-state file (every rank writes one)."""
    return root / "random" / groups.place(pc).random_states_name()


class OptimizerConfig(TypedDict):
    """The document of `optimizer/optimizer_config.json`, every value a string (or containers of them)."""

    type: str
    parallelism: dict[str, str]
    configs: dict[str, object]


def optimizer_config(optimizer: BaseOptimizer, pc: ParallelContext) -> OptimizerConfig:
    """The `optimizer/optimizer_config.json` Nanotron writes (its tools read the parallelism from it)."""

    def strings(x: object) -> object:
        if isinstance(x, dict):
            return {str(k): strings(v) for k, v in x.items()}
        if isinstance(x, list):
            return [strings(v) for v in x]
        if isinstance(x, tuple):  # torch.Size too, as Nanotron's writer does
            return tuple(strings(v) for v in x)
        return str(x)

    config: OptimizerConfig = {
        "type": str(optimizer.__class__.__name__),
        "parallelism": {
            "tp_size": str(pc.tp_pg.size()),
            "dp_size": str(pc.dp_pg.size()),
            "pp_size": str(pc.pp_pg.size()),
            "expert_parallel_size": str(pc.expert_parallel_size),
        },
        "configs": {},
    }
    if isinstance(optimizer, optim.ZeroDistributedOptimizer):
        config["configs"]["param_name_to_dp_rank_offsets"] = strings(optimizer.param_name_to_dp_rank_offsets)
        config["configs"]["orig_param_shapes"] = strings(optimizer._orig_param_shapes)
    return config


def checkpoint_metadata_text(pc: ParallelContext, metas: TrainingMetadata) -> str:
    """The `checkpoint_metadata.json` Nanotron's `save_meta` writes for the training metadata `metas`: its
    sizes (cp too where this Nanotron's CheckpointMetadata has it) and every field of `metas` (main's
    consumed tokens per dataset folder and sequence lengths, which its dataloader resumes from)."""
    sizes = {"tp": pc.tp_pg.size(), "dp": pc.dp_pg.size()}
    if "cp" in {f.name for f in dataclasses.fields(CheckpointMetadata)}:
        sizes["cp"] = groups.cp_size(pc)
    meta = CheckpointMetadata(version=CHECKPOINT_VERSION, metas=metas, **sizes)
    doc = process_type(dataclasses.asdict(meta), type_hooks={type(CHECKPOINT_VERSION): str})
    return json.dumps(doc, indent=2, sort_keys=True)
