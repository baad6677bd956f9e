"""The saved layout of a checkpoint, read from its own files, for resharding (reshard.py): each optimizer
file's name gives its rank (pp, tp, and dp for a ZeRO shard) and its skeleton the parameters it holds; each
weight file's tensor metadata gives the slices of the full tensor its tensor-parallel rank held; a ZeRO shard
is the flat range of the local tensor that Nanotron's partition (`zero_ranges`) gives its data-parallel rank.
Only headers are read here.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ... import state_parts
from ...checkpoint.manifest import entries, member
from ...checkpoint.reads import optimizer_files
from ...checkpoint.topology import stock_topology, topology_changes
from ...engine import DataStatesEngine
from ...format import read_header
from ...load.restore import TensorRef, read_structure
from ...resume.reshard_plan import Piece, ReshardError

if TYPE_CHECKING:
    from nanotron.parallel.parameters import SlicesPair

    from ..types import Config, ParallelContext

N = "([0-9]{1,9})"  # a rank or a count in a file's name: ASCII digits, never a number of a hostile size
_OPTIMIZER = re.compile(rf"optimizer_pp-{N}-of-{N}(?:_dp-{N}-of-{N})?_tp-{N}-of-{N}_exp-{N}-of-{N}")
_WEIGHT_TP = re.compile(rf"_tp-rank-{N}-of-{N}")
_NP_INT = re.compile(
    r"np\.int\d+\((-?\d+)\)"
)  # NumPy 2's integers in Nanotron's metadata (shards.plain_pairs)
MASTER = "gradient_accumulator"  # Nanotron's key of the fp32 master weights in its optimizer's state_dict


def refuse_stock(folder: Path, config: Config, pc: ParallelContext) -> None:
    """A Nanotron checkpoint of its own (pickles, no manifest) is left to Nanotron's loaders, whose merge of
    optimizer shards across layouts is broken (its file patterns miss its own names; it drops the fp32
    master weights). Where the optimizer would be loaded on another layout, say what works instead.

    What counts, of what the checkpoint's files record (`stock_topology`): a change of tp or pp, of
    the ZeRO stage, and of dp under ZeRO (each data-parallel rank's optimizer file is its shard). Not a
    change of dp at ZeRO-0 on both sides: the optimizer files are per tp and pp rank, Nanotron's to load.
    Never a change of cp (context parallelism, recorded by Nanotron main): its files carry no
    context-parallel rank in their names, its context-parallel ranks hold the weights, the optimizer (ZeRO
    shards over dp alone) and the scheduler alike, so each rank of another cp size finds its files under the
    same names; a cp change alongside a real one is not named."""
    from .. import groups

    saved = stock_topology(folder)
    if not saved or not config.checkpoints.load_optimizer:
        return
    here = groups.layout_of(pc, int(config.optimizer.zero_stage))
    changed = {k: v for k, v in topology_changes(saved, here).items() if k in saved and k != "cp"}
    if set(changed) <= {"dp"} and saved.get("zero_stage") == 0 == here["zero_stage"]:
        return
    if changed:
        moved = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items())
        raise ReshardError(
            f"{folder} is a checkpoint of Nanotron's own format saved on another layout ({moved}), whose "
            "optimizer state Nanotron's loader cannot reshard; convert it first: `nanotron-datastates "
            f"convert {folder} <new folder> --to datastates`, and resume from the new folder (it reshards)"
        )


def zero_ranges(numel: int, dp: int) -> dict[int, tuple[int, int]]:
    """Nanotron's ZeRO-1 partition of a flat tensor of `numel` elements over `dp` ranks (optim/zero.py):
    equal parts, the last ranks one element short; ranks with nothing are left out."""
    per = (numel - 1) // dp + 1 if numel else 0
    sizes = [per] * dp
    for i in range(per * dp - numel):
        sizes[dp - 1 - i] -= 1
    out, start = {}, 0
    for rank, size in enumerate(sizes):
        if size > 0:
            out[rank] = (start, start + size)
        start += size
    return out


@dataclasses.dataclass
class SavedFile:
    path: Path
    pp: int
    tp: tuple[int, int]
    dp: tuple[int, int] | None  # a ZeRO shard's data-parallel rank; None for a whole optimizer
    names: dict[int, str]  # the state_dict's parameter indices -> names
    state: dict[str, dict[str, TensorRef]]  # parameter name -> {state key: tensor}
    masters: dict[str, TensorRef]  # parameter name -> fp32 master weight
    param_groups: list[dict[str, Any]]  # as torch's optimizer holds them
    parts: dict[str, Path] = dataclasses.field(default_factory=dict)  # tensor -> its part's file, if in parts

    def file_of(self, ref: TensorRef) -> Path:
        """The file that holds `ref`: `path`, or one of its parts where the replicas wrote it in parts."""
        return self.parts.get(ref.name, self.path)


def _refs(tree: object) -> list[TensorRef]:
    if isinstance(tree, TensorRef):
        return [tree]
    items = tree.values() if isinstance(tree, dict) else tree if isinstance(tree, (list, tuple)) else ()
    return [ref for item in items for ref in _refs(item)]


def read_saved(manifest: Mapping[str, object], folder: Path, engine: DataStatesEngine) -> list[SavedFile]:
    """Every optimizer file of the checkpoint, described from its name and skeleton (headers only)."""
    out = []
    for rel, parts in sorted(optimizer_files(entries(manifest)).items()):
        m = _OPTIMIZER.fullmatch(Path(rel).stem)
        if m is None:
            continue
        paths = [member(folder, p) for p in parts]
        docs = [engine.read_structure(p) for p in paths]
        doc = state_parts.merge(docs)
        where = {ref.name: p for p, d in zip(paths, docs) for ref in _refs(d)} if len(paths) > 1 else {}
        path = paths[0] if len(paths) == 1 else folder / rel  # the parts' whole, by name
        names = {int(k): v for k, v in doc["names"].items()}
        state = {names[int(i)]: dict(s) for i, s in doc["state"].items()}
        dp = (int(m[3]), int(m[4])) if m[3] is not None else None
        groups = [dict(g) for g in doc["param_groups"]]
        masters = dict(doc.get(MASTER, {}))
        saved = SavedFile(path, int(m[1]), (int(m[5]), int(m[6])), dp, names, state, masters, groups, where)
        out.append(saved)
    if not out:
        raise ReshardError(f"{folder}: the checkpoint holds no optimizer file")
    return out


def saved_pieces(
    manifest: Mapping[str, object], folder: Path, name: str
) -> tuple[tuple[int, ...], dict[int, Piece]]:
    """(full shape, {saved tensor-parallel rank: its piece}) of parameter `name`, from its weight files; one
    piece at rank -1 where the parameter is not sharded (every rank held all of it)."""
    from nanotron.serialize.metadata import TensorMetadata
    from nanotron.serialize.utils import ObjectType, get_path

    whole = Path(
        get_path(
            name,
            type=ObjectType.MODEL,
            exp_tp_pp_rank_and_size=None,
            is_expert_sharded=False,
            prefix=Path("model"),
        )
    )
    files = [
        f for f in entries(manifest) if Path(f).parent == whole.parent and Path(f).stem.startswith(whole.stem)
    ]
    if str(whole) in files:
        path = member(folder, str(whole))
        shape = tuple(read_structure(path)["data"].shape)
        return shape, {-1: Piece(shape, (whole_pair(shape),), path)}
    pieces, full = {}, None
    for rel in files:
        m = _WEIGHT_TP.search(Path(rel).stem)
        if m is None:
            continue
        path = member(folder, rel)
        header = read_header(path)
        text = {k: _NP_INT.sub(r"\1", v) for k, v in header.user_metadata().items()}
        meta = TensorMetadata.from_str_dict(text)
        (entry,) = header.tensors
        pieces[int(m[1])] = Piece(tuple(entry.shape), tuple(meta.local_global_slices_pairs), path)
        full = tuple(int(n) for n in meta.unsharded_shape)
    if full is None:
        raise ReshardError(
            f"{folder}: no weight file of parameter {name!r} (looked for {whole} and its shards)"
        )
    return full, pieces


def whole_pair(shape: tuple[int, ...]) -> SlicesPair:
    from nanotron.parallel.parameters import SlicesPair

    every = tuple(slice(0, n) for n in shape)
    return SlicesPair(local_slices=every, global_slices=every)
