"""Whether a checkpoint is whole, where the adapter and its tests first found it; the code is in
`nanotron_datastates.checkpoint.verify`, which imports no Nanotron."""

from __future__ import annotations

from ...checkpoint.verify import Report, verify

__all__ = ["Report", "verify"]
