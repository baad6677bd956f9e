"""Where each piece of a Nanotron checkpoint goes, and the manifest that marks a datastates checkpoint: the
names of `nanotron_datastates.checkpoint` (which imports no Nanotron), kept importable from here.

`names` (file names, `Place`), `manifest` (`datastates.json`: made, read, checked; `member`), `topology`,
`checksums` (a file's entry in the manifest), `reads` (`files_to_read`: what a rank reads on resume),
`file_io` (atomic writes, fsync, JSON and YAML read without trusting them).
"""

from __future__ import annotations

from ...checkpoint.checksums import file_block_checksums, file_checksums, file_entry
from ...checkpoint.file_io import fsync_path, read_json, read_yaml, write_atomic
from ...checkpoint.manifest import (
    MANIFEST_FORMAT,
    MANIFEST_VERSION,
    MAX_FILES,
    MAX_MANIFEST,
    ManifestError,
    check_manifest,
    is_datastates_checkpoint,
    manifest,
    member,
    read_manifest,
)
from ...checkpoint.names import (
    FOLDERS,
    LATEST,
    MANIFEST,
    NANOTRON_METADATA,
    Place,
    as_safetensors,
    random_states_name,
    stock_random_states,
)
from ...checkpoint.reads import (
    MAX_SMALL_FILES,
    ReadSet,
    files_to_read,
    optimizer_files,
    random_states_at,
    weight_files,
)
from ...checkpoint.topology import (
    TOPOLOGY_DEFAULTS,
    TOPOLOGY_KEYS,
    stock_topology,
    topology,
    topology_changes,
)

__all__ = [
    "FOLDERS",
    "LATEST",
    "MANIFEST",
    "MANIFEST_FORMAT",
    "MANIFEST_VERSION",
    "MAX_FILES",
    "MAX_MANIFEST",
    "MAX_SMALL_FILES",
    "NANOTRON_METADATA",
    "TOPOLOGY_DEFAULTS",
    "TOPOLOGY_KEYS",
    "ManifestError",
    "Place",
    "ReadSet",
    "as_safetensors",
    "check_manifest",
    "file_block_checksums",
    "file_checksums",
    "file_entry",
    "files_to_read",
    "optimizer_files",
    "fsync_path",
    "is_datastates_checkpoint",
    "manifest",
    "member",
    "random_states_at",
    "random_states_name",
    "read_json",
    "read_manifest",
    "read_yaml",
    "stock_random_states",
    "stock_topology",
    "topology",
    "topology_changes",
    "weight_files",
    "write_atomic",
]
