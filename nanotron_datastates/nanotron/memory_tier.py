"""The memory tier's names where the adapter and its tests first found them; the code is in
`nanotron_datastates.tier` (memory.py, folders.py, jobs.py), which imports no Nanotron."""

from __future__ import annotations

from ..tier.folders import tree_size as _size
from ..tier.jobs import clear_jobs, jobs
from ..tier.memory import (
    MARKER,
    MAX_MARKER,
    REPLICAS,
    MemoryTier,
    TierError,
    job_folder,
    root,
    tier_copy,
    why_not,
)

__all__ = [
    "MARKER",
    "MAX_MARKER",
    "REPLICAS",
    "MemoryTier",
    "TierError",
    "_size",
    "clear_jobs",
    "job_folder",
    "jobs",
    "root",
    "tier_copy",
    "why_not",
]
