"""Whether the memory tier (memory.py) has room for what a job keeps there, checked once the first step gives
the checkpoint's size, before any of it is written."""

from __future__ import annotations

import json
import os

from .. import trust
from .folders import tree_size
from .memory import MemoryTier, TierError


def check_room(tier: MemoryTier, node_bytes: int, replicas: int = 0) -> None:
    """Raises TierError unless the tier's file system has room for `tier.sets()` checkpoints of this node's
    ranks (`node_bytes` each: held, spare), and two of each of the `replicas` copies it keeps for other
    nodes (the one held and the one arriving), besides what this job already holds there; then records the
    job's checkpoints folder in its folder (`job.json`, for `nanotron-datastates tier`)."""
    st = os.statvfs(tier.folder)
    free = st.f_bavail * st.f_frsize + tree_size(tier.folder)
    need = (tier.sets() + 2 * replicas) * node_bytes
    if free < need:
        also = f" and 2 x {replicas} of other nodes' (memory_replicas)" if replicas else ""
        raise TierError(
            f"datastates.memory_tier needs {need / 1e9:.2f} GB in {tier.folder.parent} ("
            f"{tier.sets()} checkpoint(s) of this node's ranks: memory_tier_copies{also}), and "
            f"{free / 1e9:.2f} GB is free there: turn the memory tier off, set memory_tier_copies to 1"
            f"{', lower memory_replicas' if replicas else ''}, or give the tmpfs more room (mount -o "
            "remount,size=...)"
        )
    trust.write_in(
        tier.folder, "job.json", json.dumps({"checkpoints": str(tier.checkpoints.resolve())}).encode()
    )
