"""Rotation, temporaries and telemetry after a commit, where the adapter and its tests first found them; the
code is in `nanotron_datastates.save.housekeeping`, which imports no Nanotron."""

from __future__ import annotations

from ...save.housekeeping import (
    LOCK,
    TELEMETRY,
    after_commit,
    append_telemetry,
    describe,
    read_telemetry,
    remove_temporaries,
    rotate,
    telemetry_record,
)

__all__ = [
    "LOCK",
    "TELEMETRY",
    "after_commit",
    "append_telemetry",
    "describe",
    "read_telemetry",
    "remove_temporaries",
    "rotate",
    "telemetry_record",
]
