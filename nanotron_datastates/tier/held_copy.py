"""What a restart finds in this node's memory tier (memory.py): whether a tier folder holds a step whole
as its manifest describes it (`holds`, `step_why_not`), which of its files it holds whole (`held`), and the
tier's copy of a checkpoint of storage's folder (`tier_copy`). Every marker and file must be a regular file
of this user's, reached without a link."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from .. import trust
from ..checkpoint.manifest import entries, manifest_step
from .folders import regular_size
from .memory import MemoryTier, marker_rank

if TYPE_CHECKING:
    from ..trainer_settings import TrainerSettings


def holds(tier: MemoryTier, step: int, manifest: Mapping[str, object]) -> bool:
    """Whether `tier` holds the whole checkpoint of `step` as the manifest describes it: marked by the ranks
    that wrote its files (on this node), every file present with the manifest's size and the checksums its
    writer recorded."""
    return step_why_not(tier, step, manifest) is None


def held(tier: MemoryTier, step: int, manifest: Mapping[str, object]) -> dict[str, Path]:
    """The files of `step` that `tier`'s folder holds whole, by name: marked held by some rank with the
    manifest's entry, present with its size."""
    folder = tier.folder / str(step)
    if manifest.get("step") != step or not trust.is_real_dir(folder):
        return {}
    files, out = entries(manifest), {}
    for name in tier.markers(step):
        try:
            marked = tier.marked(step, marker_rank(name), strict=True) or {}
        except (OSError, ValueError):
            continue
        for rel, entry in marked.items():
            with contextlib.suppress(OSError):
                if files.get(rel) == entry and regular_size(folder, rel) == entry.get("bytes"):
                    out[rel] = folder / rel
    return out


def step_why_not(tier: MemoryTier, step: int, manifest: Mapping[str, object]) -> str | None:
    """Why `tier` does not hold the checkpoint of `step` whole (None: it does; see `holds`)."""
    folder = tier.folder / str(step)
    if not trust.is_real_dir(folder):
        return f"no copy of step {step} in {tier.folder}"
    marked: dict[str, dict[str, object]] = {}
    for name in tier.markers(step):
        try:
            theirs = tier.marked(step, marker_rank(name), strict=True)
        except (OSError, ValueError) as e:
            return str(e)
        marked.update(theirs or {})
    files = entries(manifest)
    if manifest.get("step") != step:
        return f"the manifest is of step {manifest.get('step')}, not {step}"
    if set(marked) != set(files):
        lacking = sorted(set(files) - set(marked))
        return f"{len(lacking)} of {len(files)} files not marked held (first: {lacking[:1]})"
    for rel, entry in files.items():
        try:
            size = regular_size(folder, rel)
        except OSError as e:
            return f"{folder / rel}: {e.strerror or e}"
        if size != entry.get("bytes") or marked[rel] != entry:
            return f"{folder / rel} differs from the manifest's entry"
    return None


def tier_copy(
    settings: TrainerSettings, folder: Path, manifest: Mapping[str, object], rank: int
) -> Path | None:
    """The memory tier's copy of the checkpoint in `folder`, where this node's tier holds it whole; None
    otherwise, or where the memory tier is off."""
    if not settings.memory_tier or why_not(settings, folder, manifest, rank) is not None:
        return None
    tier = MemoryTier(settings.memory_tier_path, folder.parent, rank)
    return tier.folder / str(manifest_step(manifest))


def why_not(settings: TrainerSettings, folder: Path, manifest: Mapping[str, object], rank: int) -> str | None:
    """Why the memory tier holds no whole copy of the checkpoint in `folder` (None: it does); a tier folder
    that is not private to this user is a reason."""
    try:
        tier = MemoryTier(settings.memory_tier_path, folder.parent, rank)
    except OSError as e:
        return str(e)
    step = manifest.get("step")
    return step_why_not(tier, step, manifest) if isinstance(step, int) else "the manifest names no step"
