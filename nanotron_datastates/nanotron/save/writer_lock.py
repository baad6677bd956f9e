"""One writer per checkpoints folder, where the adapter and its tests first found it; the code is in
`nanotron_datastates.save.writer_lock`, which imports no Nanotron."""

from __future__ import annotations

from ...save.writer_lock import LOCK, FolderBusy, WriterLock

__all__ = ["LOCK", "FolderBusy", "WriterLock"]
