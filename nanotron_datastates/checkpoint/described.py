"""What `describe` (folder.py) says a path holds, by its kind: the JSON `nanotron-datastates inspect --json`
prints, and the lines it prints without (cli/checkpoints.py)."""

from __future__ import annotations

from typing import Literal, TypedDict, Union


class TensorInfo(TypedDict):
    """One tensor of a safetensors file, as `describe` lists it."""

    name: str
    dtype: str
    shape: list[int]
    bytes: int


class _Listed(TypedDict):
    file: str  # its path in the folder described
    bytes: int


class ListedFile(_Listed, total=False):
    """One file of a folder described (`folder._file_entry`): a safetensors file's tensors, or the error
    reading it."""

    error: str
    tensors: int
    dtypes: list[str]
    engine: str
    checksums: bool
    tensor_list: list[TensorInfo]  # with `tensors`
    checksums_in_manifest: bool


class FileInfo(TypedDict):
    kind: Literal["file"]
    path: str
    bytes: int
    engine: str
    checksums: bool
    metadata: dict[str, str]
    tensors: list[TensorInfo]


class FolderInfo(TypedDict):
    kind: Literal["folder"]
    path: str
    files: list[ListedFile]
    bytes: int
    tensors: int
    temporaries: list[str]


class CheckpointInfo(TypedDict):
    kind: Literal["checkpoint"]
    path: str
    engine: str | None
    step: object  # the manifest's, else what Nanotron's metadata says (read as it is)
    topology: dict[str, object]
    committed: bool
    latest: bool
    files: list[ListedFile]
    bytes: int
    tensors: int
    temporaries: list[str]


class RootInfo(TypedDict):
    kind: Literal["root"]
    path: str
    latest: int | None
    checkpoints: list[CheckpointInfo]


Described = Union[FileInfo, FolderInfo, CheckpointInfo, RootInfo]  # what `describe` returns, by its "kind"
