"""Where a restart finds a checkpoint in this node's memory tier (memory.py): the tier's copy of a checkpoint
of storage's folder, where it holds that copy whole, or why not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .memory import MemoryTier


def tier_copy(settings: Any, folder: Path, manifest: dict[str, Any], rank: int) -> Path | None:
    """The memory tier's copy of the checkpoint in `folder` (TrainerSettings `settings`), where this node's
    tier holds it whole; None otherwise, or where the memory tier is off."""
    if not settings.memory_tier or why_not(settings, folder, manifest, rank) is not None:
        return None
    tier = MemoryTier(settings.memory_tier_path, folder.parent, rank)
    return tier.folder / str(int(manifest.get("step", -1)))


def why_not(settings: Any, folder: Path, manifest: dict[str, Any], rank: int) -> str | None:
    """Why the memory tier holds no whole copy of the checkpoint in `folder` (None: it does); a tier folder
    that is not private to this user is a reason."""
    try:
        tier = MemoryTier(settings.memory_tier_path, folder.parent, rank)
    except OSError as e:
        return str(e)
    step = manifest.get("step")
    return tier.why_not(step, manifest) if isinstance(step, int) else "the manifest names no step"
