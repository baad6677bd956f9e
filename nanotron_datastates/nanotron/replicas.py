"""The memory replicas' names where the adapter and its tests first found them; the code is in
`nanotron_datastates.tier` (replicas.py, replica_transfer.py, replica_restore.py), which imports no
Nanotron."""

from __future__ import annotations

from ..tier.memory import REPLICAS, MemoryTier
from ..tier.replica_restore import node_copies, restart_source
from ..tier.replica_transfer import CHUNK, ReplicaError, Transfer, _temporary, check_and_place, move
from ..tier.replicas import Replicated, Replicator, describe, node_key, placement, prune, replica_area

__all__ = [
    "CHUNK",
    "REPLICAS",
    "MemoryTier",
    "ReplicaError",
    "Replicated",
    "Replicator",
    "Transfer",
    "_temporary",
    "check_and_place",
    "describe",
    "move",
    "node_copies",
    "node_key",
    "placement",
    "prune",
    "replica_area",
    "restart_source",
]
