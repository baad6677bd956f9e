"""Whether a checkpoint is copied on the GPU first, where the adapter and its tests first found it; the code
is in `nanotron_datastates.save.staging`, which imports no Nanotron."""

from __future__ import annotations

from ...save.staging import GIB, decide, fits, spare_bytes, warm

__all__ = ["GIB", "decide", "fits", "spare_bytes", "warm"]
