"""What a checkpoint path holds, where the adapter and its tests first found it; the code is in
`nanotron_datastates.checkpoint.folder`, which imports no Nanotron."""

from __future__ import annotations

from ...checkpoint.folder import (
    KINDS,
    NANOTRON_FILES,
    NotACheckpoint,
    describe,
    describe_checkpoint,
    describe_file,
    describe_folder,
    describe_root,
    explain,
    is_committed,
    is_temporary,
    kind_of,
    latest_step,
    marked,
    safetensors_files,
    step_folders,
    step_of,
    temporaries,
)

__all__ = [
    "KINDS",
    "NANOTRON_FILES",
    "NotACheckpoint",
    "describe",
    "describe_checkpoint",
    "describe_file",
    "describe_folder",
    "describe_root",
    "explain",
    "is_committed",
    "is_temporary",
    "kind_of",
    "latest_step",
    "marked",
    "safetensors_files",
    "step_folders",
    "step_of",
    "temporaries",
]
