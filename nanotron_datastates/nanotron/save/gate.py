"""The snapshot gate, where the adapter and its tests first found it; the code is in
`nanotron_datastates.save.gate`, which imports no Nanotron."""

from __future__ import annotations

from ...save.gate import SnapshotGate

__all__ = ["SnapshotGate"]
