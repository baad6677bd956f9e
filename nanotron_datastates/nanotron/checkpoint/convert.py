"""Converts one Nanotron checkpoint folder between Nanotron's stock layout and ours, on CPU.

``to="torch"`` turns a datastates checkpoint into the folder Nanotron's own `save()` writes (optimizer, LR
scheduler and random states as pickles, `.pt`), for tools that know only that layout; every file is checked
against the manifest on the way. ``to="datastates"`` turns a stock checkpoint into ours: the pickles become
engine-written safetensors and the weight files are rewritten to get their checksums, then the manifest is
written last. The weights' names, tensor key and metadata are the same in both layouts.

Nanotron itself is needed only for the random states (its `RandomStates` is what the stock pickle holds)::

    from nanotron_datastates.nanotron.checkpoint.convert import convert
    convert("checkpoints/40", "stock/40", to="torch")

Nothing is unpickled without `allow_pickle=True`: the stock `.pt` files are read with
`torch.load(weights_only=True)`, which builds tensors and plain containers only, and for the random states
the few classes they hold (Nanotron's RandomStates and RandomState, NumPy's uint32 array); a file that needs
anything else is refused (UnpicklingRefused, naming it). Unpickling runs whatever code the file names: opt
in only for a checkpoint you trust.

The work is split by job: `convert_to_stock` (ours -> Nanotron's), `convert_from_stock` (Nanotron's -> ours),
`stock_pickles` (the `.pt` files read without unpickling), `nanotron_datastates.checkpoint.folder_copy`
(the folder's files listed, copied, made durable).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from ...checkpoint.file_io import read_json
from ...checkpoint.folder_copy import CONFIG, MODEL, PICKLED, RANDOM, regular_files
from ...checkpoint.manifest import is_datastates_checkpoint, read_manifest
from ...checkpoint.names import MANIFEST, NANOTRON_METADATA
from ...engine import DataStatesEngine
from ...save.handle import SaveHandle
from ...store import open_store
from .convert_from_stock import to_datastates
from .convert_to_stock import to_torch
from .stock_pickles import UnpicklingRefused

__all__ = ["CONFIG", "METADATA", "MODEL", "PICKLED", "RANDOM", "TARGETS", "UnpicklingRefused", "convert"]

TARGETS = ("torch", "datastates")
METADATA = NANOTRON_METADATA


def convert(
    src: str | os.PathLike,
    out: str | os.PathLike,
    to: str,
    engine: DataStatesEngine | None = None,
    allow_pickle: bool = False,
) -> Path:
    """Writes the checkpoint folder `src` into the new folder `out` in the layout `to` ("torch": Nanotron's
    stock layout, from ours; "datastates": ours, from Nanotron's). Returns `Path(out)`.

    `allow_pickle=True` unpickles what `src` holds: the stock `.pt` files with `torch.load(weights_only=
    False)`, pickled leaves of a datastates file. That runs any code the files name: only for a checkpoint
    you trust. Without it, the stock files are read with `weights_only=True` (tensors, plain containers and
    the classes Nanotron's random states hold).

    Raises ValueError if `src` is not a checkpoint of the other layout, FileExistsError if `out` exists and is
    not empty, ChecksumError if a file of a datastates `src` does not match its manifest, UnpicklingRefused
    (a ValueError) naming a stock file that needs `allow_pickle`. On any error, what was written into `out`
    is removed.
    """
    src, out = Path(src), Path(out)
    if to not in TARGETS:
        raise ValueError(f"to={to!r} is invalid: expected one of {', '.join(TARGETS)}")
    _check_source(src, to)
    if out.resolve() == src.resolve() or src.resolve() in out.resolve().parents:
        raise ValueError(f"{out}: the output folder cannot be {src} or lie inside it")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not empty; converting writes a new folder")
    if engine is None:
        # Small and unpinned: converting runs on CPU, one file at a time.
        with DataStatesEngine(host_cache_size=0.25, pin_host_cache=False) as own:
            return _convert(src, out, to, own, allow_pickle)
    return _convert(src, out, to, engine, allow_pickle)


def _check_source(src: Path, to: str) -> None:
    if not os.path.lexists(src):
        raise FileNotFoundError(f"{src}: no such checkpoint folder (the checkpoint to convert)")
    if not os.path.isdir(src):
        raise ValueError(
            f"{src} is not a folder: convert takes a checkpoint's folder (a step of checkpoints)"
        )
    if not os.path.lexists(src / METADATA):
        raise ValueError(f"{src} is not a Nanotron checkpoint folder (no {METADATA})")
    regular_files(src)  # an error naming any that is not a regular file, before anything is written
    meta = read_json(src / METADATA)
    if to == "torch":
        if not is_datastates_checkpoint(src):
            raise ValueError(f"{src} is not a datastates checkpoint (no {MANIFEST})")
        try:
            read_manifest(src)
        except (OSError, ValueError) as e:
            raise ValueError(f"{src}: unreadable manifest: {e}") from e
        return
    if is_datastates_checkpoint(src):
        raise ValueError(f"{src} is already a datastates checkpoint ({MANIFEST})")
    if not all(isinstance(meta.get(k), int) for k in ("tp", "dp")):
        raise ValueError(f"{src / METADATA}: not Nanotron's checkpoint metadata (no integer tp and dp)")


def _convert(src: Path, out: Path, to: str, engine: DataStatesEngine, allow_pickle: bool) -> Path:
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    handles: list[SaveHandle] = []
    try:
        if to == "torch":
            to_torch(src, out, engine, allow_pickle)
        else:
            to_datastates(src, out, engine, handles, allow_pickle)
    except BaseException:
        # Saves still in flight would write into the folder being removed (or fail to rename into it).
        for h in handles:
            with contextlib.suppress(Exception):
                h.wait_persisted()
        # What was written goes through the store (no link followed); what cannot go is left.
        if created:
            with contextlib.suppress(OSError):
                open_store(out.parent).remove(out.name)
        else:  # an empty folder the caller made: leave it, empty
            store = open_store(out)
            for p in list(out.iterdir()):
                with contextlib.suppress(OSError):
                    store.remove(p.name)
        raise
    return out
