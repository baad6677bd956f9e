"""The memory tier's job folders as `nanotron-datastates tier` shows them: listed (each job's checkpoints
folder, the steps it holds, their bytes, the replicas it keeps for other nodes' ranks) and cleared. Only a
tier root private to this user is read or cleared."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TypedDict

from .. import trust
from .folders import step_numbers, tree_size
from .memory import REPLICAS, root


class Job(TypedDict):
    """A job's folder in the tier, as `jobs` lists it."""

    folder: str
    checkpoints: str | None  # its checkpoints folder (None: job.json does not say)
    steps: list[int]
    bytes: int
    replicas: dict[str, list[int]]  # by step: the ranks of other nodes whose replicas it keeps
    replica_bytes: int


def clear_jobs(base: str | os.PathLike, folders: list[Path] | None = None) -> list[Path]:
    """Removes these jobs' folders of the tier (default: every one); returns those removed. The tier's root
    must be private to this user."""
    top = root(base)
    folders = [Path(f["folder"]) for f in jobs(base)] if folders is None else folders
    return [f for f in folders if f.parent == top and trust.remove_tree(top, f.name)]


def jobs(base: str | os.PathLike) -> list[Job]:
    """Every job's folder in the tier: its checkpoints folder, the steps it holds, their bytes (all, and the
    replicas'), and the replicas it keeps for other nodes' ranks ({step: those ranks}). The tier's root must
    be private to this user (nothing is created where it is missing)."""
    path = Path(str(base).replace("{uid}", str(os.geteuid())))
    if not os.path.lexists(path):
        return []
    top = root(path)
    out: list[Job] = []
    for name in sorted(os.listdir(top)):
        folder = top / name
        if not trust.is_real_dir(folder):
            continue
        try:
            doc = json.loads(trust.read_regular(folder / "job.json", 1 << 16, own=True))
        except (OSError, ValueError):
            doc = {}
        checkpoints = doc.get("checkpoints") if isinstance(doc, dict) else None
        area = folder / REPLICAS
        real = trust.is_real_dir(area)
        out.append(
            {
                "folder": str(folder),
                "checkpoints": checkpoints if isinstance(checkpoints, str) else None,
                "steps": step_numbers(folder),
                "bytes": tree_size(folder),
                "replicas": {str(s): marked_ranks(area / str(s)) for s in step_numbers(area)} if real else {},
                "replica_bytes": tree_size(area) if real else 0,
            }
        )
    return out


def marked_ranks(folder: Path) -> list[int]:
    """The ranks whose markers a step's folder holds."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    marked = [n for n in names if n.startswith(".rank-") and n.endswith(".json")]
    ranks = [n[len(".rank-") : -len(".json")] for n in marked]
    return sorted(int(r) for r in ranks if r.isdigit())
