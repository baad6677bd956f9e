"""Committing a multi-rank checkpoint, where the adapter and its tests first found it; the code is in
`nanotron_datastates.save.commit`, which imports no Nanotron. CheckpointError (errors.py) stays importable
from here."""

from __future__ import annotations

from ...save.commit import CheckpointError, CommitResult, Committer, PendingCheckpoint, summary

__all__ = ["CheckpointError", "CommitResult", "Committer", "PendingCheckpoint", "summary"]
