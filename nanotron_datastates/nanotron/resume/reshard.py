"""A checkpoint resharded onto this rank's parallel layout: weights, Adam moments, step counts and fp32 master
weights land exactly where this layout keeps them, for any change of tp, pp, dp, cp and ZeRO stage; the LR
scheduler's entries follow their param groups.

Planned from metadata, as PyTorch's distributed checkpoint plans a reshard:
- the saved layout is read from the files themselves (saved_layout.py);
- this rank's needs are its model's and optimizer's parameters: each one's slices of the full tensor (the
  model's sharding) and, with ZeRO, its flat range;
- for each state of each parameter, `nanotron_datastates.resume.reshard_plan` finds the ranges of the saved
  tensors that hold this rank's piece. Only those are read, each checked against the checksums of the
  blocks it spans (the optimizer's files hold them; a weight file is read whole and checked against the
  manifest), and put together.
A parameter missing from the checkpoint, or of another shape, is a ReshardError naming it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch

from ...checkpoint.checksums import file_block_checksums, file_checksums
from ...checkpoint.manifest import entries, member
from ...engine import DataStatesEngine
from ...load.restore import TensorRef
from ...resume import reshard_plan
from ...resume.reshard_plan import Need, Piece, ReshardError, Source
from .saved_layout import MASTER, N, SavedFile, read_saved, saved_pieces, whole_pair, zero_ranges

if TYPE_CHECKING:
    from nanotron.parallel.parameters import NanotronParameter

    from ..types import BaseOptimizer, NanotronModel, ParallelContext


def load_weights(
    engine: DataStatesEngine, manifest: Mapping[str, object], folder: Path, model: NanotronModel
) -> int:
    """Fills this rank's parameters from the weight files of another layout; returns how many."""
    params = model_params(model)
    for name, param in params.items():
        full_shape, pieces = saved_pieces(manifest, folder, name)
        need = _need_of(param, tuple(param.shape), None)
        if full_shape != need.full_shape:
            raise _changed(name, full_shape, need.full_shape)
        sources = {}
        for t, piece in pieces.items():
            assert piece.path is not None
            sources[t] = (piece, [Source(piece.path, "data", (0, math.prod(piece.local_shape)))])
        p = reshard_plan.plan(name, need, sources)
        read = _read(engine, p.ranges(), lambda path: _manifest_sums(manifest, folder, path))
        with torch.no_grad():
            param.copy_(reshard_plan.assemble(p, read, param.dtype))
    return len(params)


Sums = tuple[dict[str, int] | None, tuple[int, dict[str, list[int]]] | None]


def _manifest_sums(manifest: Mapping[str, object], folder: Path, path: Path) -> Sums:
    """A weight file's checksums, per tensor and per block, which the manifest holds for it."""
    return file_checksums(manifest, folder, path), file_block_checksums(manifest, folder, path)


def _read(
    engine: DataStatesEngine,
    ranges: Iterable[tuple[Path, str, tuple[int, int]]],
    checksums: Callable[[Path], Sums] | None = None,
) -> dict[tuple[Path, str, tuple[int, int]], torch.Tensor]:
    """The ranges of saved tensors, keyed as given, each file read once by the engine's parser threads;
    `checksums` gives a file's where its header has none."""
    by_file: dict[Path, dict[tuple[str, tuple[int, int]], None]] = {}
    for path, tensor, elements in ranges:
        by_file.setdefault(path, {})[(tensor, elements)] = None
    out = {}
    for path, wanted in by_file.items():
        sums, blocks = checksums(path) if checksums is not None else (None, None)
        items = [(tensor, a, b) for tensor, (a, b) in wanted]
        got = engine.load_range_list(path, items, checksums=sums, block_checksums=blocks)
        for (tensor, elements), t in zip(wanted, got):
            out[(path, tensor, elements)] = t
    return out


def _changed(name: str, saved: tuple[int, ...], here: tuple[int, ...]) -> ReshardError:
    return ReshardError(
        f"parameter {name!r} is {list(saved)} in the checkpoint and {list(here)} here: the model changed, "
        "which a reshard cannot honour"
    )


def needs(optimizer: BaseOptimizer, model: NanotronModel, pc: ParallelContext) -> dict[str, Need]:
    """Every parameter of this rank's optimizer, with where its state sits in the full tensor."""
    inner = optimizer
    while getattr(inner, "optimizer", None) is not None:
        inner = inner.optimizer  # the torch optimizer under Nanotron's wrappers
    params = model_params(model)
    offsets = getattr(optimizer, "param_name_to_dp_rank_offsets", None)
    dp_rank = pc.dp_pg.rank() if offsets is not None else None
    out = {}
    flat = [p for g in inner.param_groups for p in g["params"]]
    for index, p in enumerate(flat):
        name = optimizer.id_to_name[id(p)]
        zero = tuple(int(x) for x in offsets[name][dp_rank]) if offsets is not None else None
        out[name] = _need_of(params[name], tuple(p.shape), zero, index)  # type: ignore[arg-type]
    return out


def _need_of(
    param: NanotronParameter, shape: tuple[int, ...], zero: tuple[int, int] | None, index: int = -1
) -> Need:
    if param.is_sharded:
        info = param.get_sharded_info()
        full, pairs = tuple(int(n) for n in info.unsharded_shape), tuple(info.local_global_slices_pairs)
    else:
        full, pairs = tuple(param.shape), (whole_pair(tuple(param.shape)),)
    return Need(index, shape, full, Piece(tuple(param.shape), pairs), zero)


def optimizer_state(
    engine: DataStatesEngine,
    manifest: Mapping[str, object],
    folder: Path,
    optimizer: BaseOptimizer,
    model: NanotronModel,
    pc: ParallelContext,
) -> dict[str, object]:
    """The state_dict this rank's `optimizer` loads, resharded from the checkpoint in `folder`."""
    saved = read_saved(manifest, folder, engine)
    wanted = needs(optimizer, model, pc)
    keys = sorted({k for f in saved for s in f.state.values() for k in s} - {"step"})
    here_masters = _has_masters(optimizer)
    with_masters = here_masters and any(f.masters for f in saved)
    plans: dict[tuple[str, str], reshard_plan.Plan] = {}
    steps: dict[str, tuple[Path, TensorRef]] = {}  # Adam's step count: one value, read from one holder
    for name, need in wanted.items():
        holders = [f for f in saved if name in f.state]
        if not holders:
            raise ReshardError(f"{folder}: parameter {name!r} is not in the checkpoint's optimizer state")
        full_shape, pieces = saved_pieces(manifest, folder, name)
        if full_shape != need.full_shape:
            raise _changed(name, full_shape, need.full_shape)
        for key in keys + ([MASTER] if with_masters else []):
            plans[(name, key)] = reshard_plan.plan(name, need, _sources(name, key, holders, pieces))
        if "step" in holders[0].state[name]:
            ref = holders[0].state[name]["step"]
            steps[name] = (holders[0].file_of(ref), ref)
    whole = [(path, ref.name, (0, math.prod(ref.shape))) for path, ref in steps.values()]
    read = _read(engine, [*(r for p in plans.values() for r in p.ranges()), *whole])
    state: dict[int, dict[str, torch.Tensor]] = {}
    masters: dict[str, torch.Tensor] = {}
    for name, need in wanted.items():
        entry = {key: reshard_plan.assemble(plans[(name, key)], read) for key in keys}
        if name in steps:
            path, ref = steps[name]
            entry["step"] = read[(path, ref.name, (0, math.prod(ref.shape)))].clone().view(ref.shape)
        state[need.index] = dict(sorted(entry.items()))
        if with_masters:
            masters[name] = reshard_plan.assemble(plans[(name, MASTER)], read)
        elif here_masters:  # saved without fp32 masters: Nanotron's own start, from the weights just loaded
            masters[name] = _cut_local(model_params(model)[name].detach().float(), need)
    out: dict[str, object] = {
        "state": state,
        "param_groups": _groups(optimizer, saved, wanted),
        "names": {need.index: name for name, need in wanted.items()},
    }
    if here_masters:
        out[MASTER] = masters
    return out


def _has_masters(optimizer: object) -> bool:
    """Whether this optimizer keeps fp32 master weights (Nanotron's `accumulate_grad_in_fp32`)."""
    while optimizer is not None:
        if getattr(optimizer, "gradient_accumulator", None) is not None:
            return True
        optimizer = getattr(optimizer, "optimizer", None)
    return False


def model_params(model: NanotronModel) -> dict[str, NanotronParameter]:
    return dict(model.get_named_params_with_correct_tied())


def _sources(
    name: str, key: str, holders: list[SavedFile], pieces: dict[int, Piece]
) -> dict[int, tuple[Piece, list[Source]]]:
    """For each saved piece of one parameter, the saved tensors that hold its state `key` (MASTER: its fp32
    master weight), each with the flat range of the piece that Nanotron's ZeRO partition gave it."""
    out = {}
    for tp_rank, piece in pieces.items():
        files = [f for f in holders if tp_rank in (-1, f.tp[0])]
        if tp_rank == -1:
            files = [f for f in files if f.tp[0] == files[0].tp[0]]  # every tp rank holds it: one is enough
        pp0 = min(f.pp for f in files)
        files = [f for f in files if f.pp == pp0]  # tied across stages: each stage holds the same state
        files.sort(key=lambda f: f.dp[0] if f.dp else 0)
        numel = math.prod(piece.local_shape)
        sources = []
        for f in files:
            ref = f.masters[name] if key == MASTER else f.state[name][key]
            flat = zero_ranges(numel, f.dp[1]).get(f.dp[0], (0, 0)) if f.dp is not None else (0, numel)
            if math.prod(ref.shape) != flat[1] - flat[0]:
                raise ReshardError(
                    f"{f.path}: parameter {name!r} holds {math.prod(ref.shape)} elements; its ZeRO range "
                    f"there is [{flat[0]}, {flat[1]}) of {numel}"
                )
            sources.append(Source(f.file_of(ref), ref.name, flat))
        if sum(s.flat[1] - s.flat[0] for s in sources) != numel:
            raise ReshardError(
                f"parameter {name!r}: the saved shards hold {sum(s.flat[1] - s.flat[0] for s in sources)} "
                f"of its {numel} elements"
            )
        out[tp_rank] = (piece, sources)
    return out


def _cut_local(local: torch.Tensor, need: Need) -> torch.Tensor:
    """With ZeRO, the flat range of this rank's local tensor."""
    flat = local.reshape(-1)
    if need.zero is not None:
        flat = flat[need.zero[0] : need.zero[1]]
    return flat.clone().view(need.shape)


def _group_firsts(optimizer: BaseOptimizer, wanted: dict[str, Need]) -> list[tuple[str | None, int]]:
    """For each of this optimizer's param groups: its first parameter's name (None: empty here, as a ZeRO
    rank's group may be), and how many parameters it holds."""
    inner = optimizer
    while getattr(inner, "optimizer", None) is not None:
        inner = inner.optimizer
    by_index = {need.index: name for name, need in wanted.items()}
    out, index = [], 0
    for group in inner.param_groups:
        n = len(group["params"])
        out.append((by_index[index] if n else None, n))
        index += n
    return out


def _saved_groups(saved: list[SavedFile]) -> dict[str, tuple[SavedFile, int]]:
    """Each parameter's saved group: the file and the group's position in it."""
    out: dict[str, tuple[SavedFile, int]] = {}
    for f in saved:
        for g, group in enumerate(f.param_groups):
            for i in group["params"]:
                out.setdefault(f.names[i], (f, g))
    return out


def _groups(
    optimizer: BaseOptimizer, saved: list[SavedFile], wanted: dict[str, Need]
) -> list[dict[str, object]]:
    """This optimizer's param groups (their parameters, in its order), each with the hyperparameters of the
    saved group that held its first parameter: groups follow parameters, and their number varies with the
    layout (Nanotron's groups per parameter spread over pipeline stages)."""
    where = _saved_groups(saved)
    out, index = [], 0
    for g, (first, n) in enumerate(_group_firsts(optimizer, wanted)):
        f, k = where[first] if first is not None else (saved[0], min(g, len(saved[0].param_groups) - 1))
        old = {key: v for key, v in f.param_groups[k].items() if key != "params"}
        out.append({**old, "params": list(range(index, index + n))})
        index += n
    return out


GROUP_LISTS = ("base_lrs", "_last_lr", "lr_lambdas")  # a torch scheduler's entries per param group


def scheduler_state(
    engine: DataStatesEngine,
    manifest: Mapping[str, object],
    folder: Path,
    optimizer: BaseOptimizer,
    model: NanotronModel,
    pc: ParallelContext,
) -> dict[str, object]:
    """The LR scheduler's state for this rank's optimizer: the schedule (step, counts) is the same for every
    rank; its entries per param group are those of each group's first parameter in the saved layout (each
    pipeline stage saved the scheduler of its own groups)."""
    saved = read_saved(manifest, folder, engine)
    wanted = needs(optimizer, model, pc)
    where = _saved_groups(saved)
    schedules: dict[tuple[int, int], dict[str, Any]] = {}  # each a torch scheduler's state_dict
    for rel in sorted(f for f in entries(manifest) if f.startswith("lr_scheduler/")):
        m = re.fullmatch(rf"lr_scheduler_pp-{N}-of-{N}_tp-{N}-of-{N}_exp-{N}-of-{N}", Path(rel).stem)
        if m is not None:
            schedules[(int(m[1]), int(m[3]))] = engine.load(member(folder, rel))
    if not schedules:
        raise ReshardError(f"{folder}: the checkpoint holds no LR scheduler file")
    first = next(iter(schedules.values()))
    out = {k: v for k, v in first.items() if k not in GROUP_LISTS}
    lists: dict[str, list[object]] = {k: [] for k in GROUP_LISTS if k in first}
    for g, (name, _) in enumerate(_group_firsts(optimizer, wanted)):
        f, k = where[name] if name is not None else (saved[0], g)
        schedule = schedules.get((f.pp, f.tp[0]), first)
        for key, values in lists.items():
            values.append(schedule[key][min(k, len(schedule[key]) - 1)])
    return {**out, **lists}
