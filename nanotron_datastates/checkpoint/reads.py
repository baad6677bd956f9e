"""Which files a rank reads on resume: `files_to_read` is the one answer, given the manifest, the layout
(names.py) and, once the process groups exist, this rank's `Place` in them (before, only files every rank
reads are named)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from pathlib import Path

from .manifest import ManifestError, entries, member
from .names import NANOTRON_METADATA, Place, name_in, random_states_name, whole_name
from .topology import TOPOLOGY_DEFAULTS, saved_topology, topology_changes

MAX_SMALL_FILES = 16  # the scheduler's and random states' files read into the page cache first, at most


def weight_files(doc: Mapping[str, object], folder: Path) -> list[Path]:
    """Every weight file a manifest names, under `folder`, in name order: what a rank of a layout without
    tensor, pipeline or expert parallelism reads."""
    return [member(folder, f) for f in sorted(entries(doc)) if f.startswith("model/")]


def optimizer_files(files: Iterable[str]) -> dict[str, list[str]]:
    """The checkpoint's optimizer files (names relative to it) by the whole file each stands for: the file
    itself, or its parts in order where the replicas wrote it in parts (`names.part_name`). Raises
    ManifestError naming a whole file some of whose parts are not listed."""
    out: dict[str, dict[int, str]] = {}
    counts: dict[str, set[int]] = {}
    for rel in sorted(f for f in files if f.startswith("optimizer/") and f.endswith(".safetensors")):
        whole = whole_name(rel)
        if whole is None:
            out.setdefault(rel, {})[-1] = rel
            continue
        name, part, count = whole
        out.setdefault(name, {})[part] = rel
        counts.setdefault(name, set()).add(count)
    for name, parts in out.items():
        if -1 in parts:  # written whole: any part beside it is not read
            out[name] = {-1: parts[-1]}
            continue
        count = max(counts[name])
        if len(counts[name]) > 1 or count != len(parts) or sorted(parts) != list(range(count)):
            raise ManifestError(
                f"{name}: the checkpoint lists parts {sorted(parts)} of it, named as parts of "
                f"{sorted(counts[name])}: not one whole"
            )
    return {name: [parts[k] for k in sorted(parts)] for name, parts in out.items()}


def random_states_at(doc: Mapping[str, object], place: Place) -> str:
    """The saved random-state file of the rank at `place`, each rank index taken modulo the saved size of its
    dimension: a deterministic choice for a rank of another layout, which did not exist when it was saved."""
    saved = saved_topology(doc)

    def at(dim: tuple[int, int], key: str) -> tuple[int, int]:
        size = int(saved.get(key, TOPOLOGY_DEFAULTS.get(key, 1)))
        return dim[0] % size, size

    return random_states_name(at(place.tp, "tp"), at(place.dp, "dp"), at(place.pp, "pp"), at(place.cp, "cp"))


@dataclasses.dataclass(frozen=True)
class ReadSet:
    """What a rank reads to resume: weight files (every one, where no rank holds a part of the model only;
    else none, as which ones depends on the model), its optimizer file, and the small files (scheduler,
    random states, metadata) to read into the page cache before the large ones."""

    weights: list[Path]
    optimizer: tuple[Path, ...]  # its file, or its parts; () where none is read
    small: list[Path]


def needed(names: Iterable[str], reads: ReadSet | None, root: Path) -> set[str]:
    """The files of `names` (a manifest's) that a rank reading `reads` from `root` needs: all of them where
    its layout changed (None); else those `reads` lists, and every weight file where ranks hold parts of the
    model (listed by the model later, not in `reads`)."""
    names = set(names)
    if reads is None:
        return names
    out = set(relative([*reads.weights, *reads.optimizer, *reads.small], root))
    if not reads.weights:
        out |= {n for n in names if n.startswith("model/")}
    return out & names


def relative(paths: Iterable[Path], root: Path) -> list[str]:
    """`paths`, each relative to `root`, as the manifest names them."""
    return [name_in(p, root) for p in paths]


def files_to_read(
    doc: Mapping[str, object],
    folder: Path,
    here: dict[str, int],
    place: Place | None,
    *,
    optimizer: bool,
    scheduler: bool,
) -> ReadSet | None:
    """The files this rank reads from the checkpoint `doc` describes, in `folder`, for the layout `here`
    (`topology`); None where the layout differs from the saved one (the state is resharded). Without a
    `place` (before the process groups exist), only what every rank reads: the optimizer file where there
    is one, the small files where there are few."""
    if topology_changes(saved_topology(doc), here):
        return None
    whole = (here["tp"], here["pp"], here["expert"]) == (1, 1, 1)
    if place is None and not whole:  # which shard a rank holds is not known yet
        return ReadSet([], (), [])
    weights = weight_files(doc, folder) if whole else []
    files = optimizer_files(entries(doc))
    if place is not None:
        mine = "optimizer/" + place.optimizer_name(zero=here["zero_stage"] > 0)
        files = {name: parts for name, parts in files.items() if name == mine}
    (parts,) = files.values() if optimizer and len(files) == 1 else ([],)
    opt = tuple(member(folder, f) for f in parts)
    small = [folder / NANOTRON_METADATA]
    if place is not None:
        small.append(folder / "random" / place.random_states_name())
        if scheduler:
            small.append(folder / "lr_scheduler" / place.lr_scheduler_name())
    else:
        rest = [f for f in sorted(entries(doc)) if f.startswith(("lr_scheduler/", "random/"))]
        small += [member(folder, f) for f in rest] if len(rest) <= MAX_SMALL_FILES else []
    return ReadSet(weights, opt, small)
