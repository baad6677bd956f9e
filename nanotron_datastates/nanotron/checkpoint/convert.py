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
"""

from __future__ import annotations

import codecs
import contextlib
import json
import os
import pickle
import re
import shutil
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import yaml
from torch.torch_version import TorchVersion

from ... import trust
from ...engine import DataStatesEngine
from ...errors import FormatError
from ...save_handle import SaveHandle
from .. import rng_states as states
from . import layout

TARGETS = ("torch", "datastates")
METADATA = layout.NANOTRON_METADATA
CONFIG = "config.yaml"
# Subfolders whose `.pt` pickles (stock) are engine-written safetensors (ours).
PICKLED = ("optimizer", "lr_scheduler")
RANDOM = "random"
MODEL = "model"


class UnpicklingRefused(pickle.UnpicklingError, ValueError):
    """A stock `.pt` file holds objects that loading without unpickling does not build; `allow_pickle=True`
    (`--allow-pickle`) unpickles it, which runs whatever code it names: only for a trusted checkpoint."""


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
    if not os.path.lexists(src / METADATA):
        raise ValueError(f"{src} is not a Nanotron checkpoint folder (no {METADATA})")
    _files(src)  # an error naming any that is not a regular file, before anything is written
    meta = layout.read_json(src / METADATA)
    if to == "torch":
        if not layout.is_datastates_checkpoint(src):
            raise ValueError(f"{src} is not a datastates checkpoint (no {layout.MANIFEST})")
        try:
            layout.read_manifest(src)
        except (OSError, ValueError) as e:
            raise ValueError(f"{src}: unreadable manifest: {e}") from e
        return
    if layout.is_datastates_checkpoint(src):
        raise ValueError(f"{src} is already a datastates checkpoint ({layout.MANIFEST})")
    if not all(isinstance(meta.get(k), int) for k in ("tp", "dp")):
        raise ValueError(f"{src / METADATA}: not Nanotron's checkpoint metadata (no integer tp and dp)")


def _convert(src: Path, out: Path, to: str, engine: DataStatesEngine, allow_pickle: bool) -> Path:
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    handles: list[SaveHandle] = []
    try:
        if to == "torch":
            _to_torch(src, out, engine, allow_pickle)
        else:
            _to_datastates(src, out, engine, handles, allow_pickle)
    except BaseException:
        # Saves still in flight would write into the folder being removed (or fail to rename into it).
        for h in handles:
            with contextlib.suppress(Exception):
                h.wait_persisted()
        if created:
            shutil.rmtree(out, ignore_errors=True)
        else:  # an empty folder the caller made: leave it, empty
            for p in list(out.iterdir()):
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)
        raise
    return out


# -- datastates -> torch ------------------------------------------------------------------------------------


def _to_torch(src: Path, out: Path, engine: DataStatesEngine, allow_pickle: bool) -> None:
    doc = layout.read_manifest(src)
    for rel, entry in doc["files"].items():
        path = layout.member(src, rel)
        size = path.stat().st_size  # FileNotFoundError names a file the manifest lists but the folder lacks
        if size != entry.get("bytes"):
            raise FormatError(f"{path}: {size} bytes, the manifest says {entry.get('bytes')}")
        sums = layout.file_checksums(doc, src, path)
        parts = Path(rel).parts
        if parts[0] == MODEL:
            # Same file in both layouts. The copy is what gets checked: a bad source and a bad copy both fail.
            _copy(path, out / rel)
            engine.verify(out / rel, sums)
        elif parts[0] == RANDOM:
            stock = layout.stock_random_states(parts[-1])
            if stock is None:
                raise FormatError(f"{path}: not a random-state file name of Nanotron's layout")
            name, kept = stock
            if not kept:  # Nanotron main keeps one file for all context-parallel ranks: rank 0's
                engine.verify(path, sums)
                continue
            saved = engine.load(path, checksums=sums, allow_pickle=allow_pickle)
            if not isinstance(saved, dict) or "nanotron" not in saved:
                raise FormatError(f"{path}: not the random states of a datastates checkpoint")
            # Stock Nanotron keeps Nanotron's generators only; the process-wide ones ("global") have no place.
            random_states = _nanotron_random().RandomStates(
                {k: states.random_state_from_plain(v) for k, v in saved["nanotron"].items()}
            )
            _torch_save(random_states, out / RANDOM / name)
        else:
            _torch_save(engine.load(path, checksums=sums, allow_pickle=allow_pickle), out / _as_pt(rel))
    _copy_rest(src, out, listed=set(doc["files"]), to="torch")
    _sync_dirs(out)
    # Nanotron's own save is synchronous: its metadata file is what marks a whole stock checkpoint.
    layout.write_atomic(out / METADATA, _read(src / METADATA))


def _as_pt(rel: str) -> str:
    return rel[: -len(".safetensors")] + ".pt" if rel.endswith(".safetensors") else rel + ".pt"


def _stock_config(text: str) -> str:
    """config.yaml without our keys, which stock Nanotron's strict parser rejects (unparsable: as is)."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if not isinstance(doc, dict):
        return text
    dropped = [doc.pop(k) for k in ("datastates", "checkpointing_engine") if k in doc]
    checkpoints = doc.get("checkpoints")
    if isinstance(checkpoints, dict) and "checkpointing_engine" in checkpoints:
        dropped.append(checkpoints.pop("checkpointing_engine"))
    return yaml.dump(doc) if dropped else text  # untouched configs keep their formatting


def _torch_save(obj: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


# -- torch -> datastates ------------------------------------------------------------------------------------


def _to_datastates(
    src: Path, out: Path, engine: DataStatesEngine, handles: list[SaveHandle], allow_pickle: bool
) -> None:
    meta = layout.read_json(src / METADATA)
    step = _step(src, meta)
    config = layout.read_yaml(src / CONFIG)
    parallelism = config.get("parallelism") or {}
    topology = layout.topology(
        tp=meta["tp"],
        pp=int(parallelism.get("pp") or 1),
        dp=meta["dp"],
        cp=int(meta.get("cp") or parallelism.get("context_parallel_size") or 1),  # Nanotron main's
        expert=int(parallelism.get("expert_parallel_size") or 1),
        zero_stage=int((config.get("optimizer") or {}).get("zero_stage") or 0),
    )
    saved: list[tuple[str, SaveHandle]] = []  # (file in `out`, its save)
    for rel in _files(src):
        parts = Path(rel).parts
        if parts[0] == MODEL and rel.endswith(".safetensors"):
            tensors = engine.load(src / rel)
            metadata = engine.read_metadata(src / rel)
            # Rewritten rather than copied: the engine computes the checksums the manifest keeps. The file
            # stays Nanotron's (its metadata verbatim, nothing of ours), as the trainer writes weights.
            made = [(rel, engine.save(tensors, out / rel, metadata=metadata, exact_metadata=True))]
        elif parts[0] in PICKLED and rel.endswith(".pt"):
            obj = _load_stock(src / rel, allow_pickle)
            target = layout.as_safetensors(rel)
            made = [(target, engine.save(obj, out / target))]
        elif parts[0] == RANDOM and rel.endswith(".pt"):
            nanotron_random = _nanotron_random()  # unpickling needs it: fail with a clear message
            loaded = _load_stock(src / rel, allow_pickle, _random_state_globals(nanotron_random))
            # No "global" entry: the stock layout never kept the process-wide generators (resume allows it).
            plain = {"nanotron": _random_states_to_plain(src / rel, loaded, nanotron_random)}
            # Nanotron main's context-parallel ranks all read this one file: each of ours gets a copy.
            made = [(t, engine.save(plain, out / t)) for t in _random_targets(rel, topology["cp"])]
        else:
            if rel != METADATA:  # written last
                _copy(src / rel, out / rel)
            continue
        for target, h in made:
            handles.append(h)
            saved.append((target, h))
            # One file in memory at a time: the next is read while this one is flushed.
            h.wait_snapshot()
    entries = {}
    for target, h in saved:
        h.wait_persisted()  # raises the save's error
        entries[target] = layout.file_entry((out / target).stat().st_size, h)
    _sync_dirs(out)
    # As the trainer commits: the metadata, then the manifest, which makes the folder a datastates checkpoint.
    layout.write_atomic(out / METADATA, _read(src / METADATA))
    layout.write_atomic(out / layout.MANIFEST, json.dumps(layout.manifest(step, topology, entries), indent=1))


def _load_stock(path: Path, allow_pickle: bool, allowed: Sequence[Any] = ()) -> Any:
    """One of Nanotron's `.pt` files. Without `allow_pickle`, torch builds only tensors, plain containers and
    the `allowed` classes and functions (exactly those): anything else raises UnpicklingRefused, unrun."""
    with os.fdopen(trust.open_to_read(path), "rb") as f:
        if allow_pickle:
            return torch.load(f, map_location="cpu", weights_only=False)
        return _load_weights_only(path, f, allowed)


def _load_weights_only(path: Path, f: Any, allowed: Sequence[Any]) -> Any:
    try:
        with _safe_globals(path, allowed):
            return torch.load(f, map_location="cpu", weights_only=True)
    except UnpicklingRefused:  # this torch cannot allow them: already says so
        raise
    except pickle.UnpicklingError as e:
        what = (
            "tensors, plain containers and Nanotron's random states"
            if allowed
            else "tensors and plain containers"
        )
        raise UnpicklingRefused(
            f"{path}: refused by torch.load(weights_only=True), which builds only {what} ({_why(e)}). The "
            "file is damaged or holds other objects, and unpickling those runs any code they name: only if "
            "the checkpoint is trusted, pass --allow-pickle (convert(..., allow_pickle=True))"
        ) from None


@contextlib.contextmanager
def _safe_globals(path: Path, allowed: Sequence[Any]) -> Iterator[None]:
    """Lets weights_only build `allowed` for the duration of one load, where this torch can."""
    serialization = torch.serialization
    if not allowed:
        yield
    elif hasattr(serialization, "safe_globals"):  # torch >= 2.5
        with serialization.safe_globals(list(allowed)):
            yield
    elif hasattr(serialization, "add_safe_globals"):  # torch 2.4: process-wide, so undone after the load
        before = serialization.get_safe_globals() if hasattr(serialization, "get_safe_globals") else None
        serialization.add_safe_globals(list(allowed))
        try:
            yield
        finally:
            if before is not None and hasattr(serialization, "clear_safe_globals"):
                serialization.clear_safe_globals()
                serialization.add_safe_globals(before)
    else:
        raise UnpicklingRefused(
            f"{path}: Nanotron's random states hold classes that torch {torch.__version__} cannot allow "
            "without unpickling (torch.serialization.add_safe_globals needs torch >= 2.4): upgrade torch, "
            "or, only if the checkpoint is trusted, pass --allow-pickle (convert(..., allow_pickle=True))"
        )


def _why(e: pickle.UnpicklingError) -> str:
    """torch's reason for refusing a file, without its advice to unpickle it (worded differently by each
    torch: the paragraph after "WeightsUnpickler error:", else the first that is not advice)."""
    text = str(e)
    found = re.search(r"WeightsUnpickler error:\s*(.+?)(?:\n\s*\n|$)", text, re.S)
    if found:
        reason = found.group(1)
    else:
        advice = ("Weights only load failed", "Check the documentation")
        kept = [p for p in re.split(r"\n\s*\n", text) if p.strip() and not p.strip().startswith(advice)]
        reason = kept[0] if kept else text
    reason = reason.split(" Please use `torch.serialization")[0]  # allow-listing: not what we advise
    return " ".join(reason.split())[:300].rstrip(".") or type(e).__name__


def _random_state_globals(nanotron_random: Any) -> list[Any]:
    """What Nanotron's random-state pickle holds beyond tensors and plain containers (nanotron/random.py),
    exactly: RandomStates of RandomState, whose `numpy` field is NumPy's legacy generator state, a uint32
    array, and how that array unpickles."""
    import numpy as np

    # The array's rebuilder, from NumPy itself: `numpy.core.multiarray._reconstruct`, `numpy._core` from 2.0.
    reconstruct = np.zeros(0).__reduce__()[0]
    allowed: list[Any] = [
        nanotron_random.RandomStates,
        nanotron_random.RandomState,
        np.ndarray,
        np.dtype,
        type(np.dtype(np.uint32)),  # numpy.dtypes.UInt32DType (`numpy.dtype[uint32]` before NumPy 1.25)
        codecs.encode,  # `_codecs.encode`: how pickle protocol 2 spells the array's bytes
    ]
    if TorchVersion(torch.__version__) >= "2.6":  # compared as versions, not as text
        # torch allows a function by its module's name: a file written under the other NumPy major version
        # names the other module; torch >= 2.6 takes (function, name) pairs.
        allowed += [(reconstruct, f"{m}.multiarray._reconstruct") for m in ("numpy.core", "numpy._core")]
    else:
        allowed.append(reconstruct)
    return allowed


def _random_states_to_plain(path: Path, loaded: Any, nanotron_random: Any) -> dict[str, Any]:
    """The loaded RandomStates as plain values; ValueError naming `path` for anything else, as a crafted
    file can hold (the allowed classes are built without their checks)."""
    if not isinstance(loaded, Mapping):
        raise ValueError(f"{path}: {type(loaded).__name__}, not Nanotron's RandomStates")
    plain = {}
    for key, value in loaded.items():
        if not isinstance(key, str) or not isinstance(value, nanotron_random.RandomState):
            raise ValueError(f"{path}: entry {key!r} is {type(value).__name__}, not Nanotron's RandomState")
        try:
            plain[key] = states.random_state_to_plain(value)
        except (AttributeError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: entry {key!r} is not a random state Nanotron writes ({e})") from None
    return plain


def _random_targets(rel: str, cp: int) -> list[str]:
    """Our names for Nanotron's random-state file `rel`, one per context-parallel rank."""
    base = layout.as_safetensors(rel)
    if cp == 1:
        return [base]
    stem = base.removesuffix(".safetensors")
    return [f"{stem}_cp-{r}-of-{cp}.safetensors" for r in range(cp)]


def _step(src: Path, meta: dict[str, Any]) -> int:
    step = (meta.get("metas") or {}).get("last_train_step")
    if isinstance(step, int):
        return step
    named = trust.step_number(src.resolve().name)
    if named is not None:
        return named
    raise ValueError(f"{src}: no metas.last_train_step in {METADATA} and the folder is not named by its step")


# -- shared -------------------------------------------------------------------------------------------------


def _files(folder: Path) -> list[str]:
    """The folder's files, relative, without hidden ones (temporaries of a save that died, locks); an error
    naming any that is not a regular file (a FIFO), never skipped."""
    found = [p.relative_to(folder) for p in folder.rglob("*") if not p.is_dir()]
    rels = sorted(str(r) for r in found if not any(part.startswith(".") for part in r.parts))
    for rel in rels:
        os.close(trust.open_to_read(folder / rel))
    return rels


def _copy_rest(src: Path, out: Path, listed: set[str], to: str) -> None:
    """Nanotron's json/yaml files and anything else not converted; never the manifest or the metadata file
    (written last), nor safetensors the manifest does not list (resume ignores them: leftovers)."""
    for rel in _files(src):
        if rel in listed or rel in (layout.MANIFEST, METADATA) or rel.endswith(".safetensors"):
            continue
        if rel == CONFIG and to == "torch":
            (out / rel).write_text(_stock_config(_read(src / rel).decode()))
            layout.fsync_path(out / rel)
        else:
            _copy(src / rel, out / rel)


def _read(path: Path) -> bytes:
    with os.fdopen(trust.open_to_read(path), "rb") as f:
        return f.read()


def _copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    with os.fdopen(trust.open_to_read(src), "rb") as f, open(dst, "wb") as out:
        shutil.copyfileobj(f, out, 16 << 20)
    layout.fsync_path(dst)


def _sync_dirs(folder: Path) -> None:
    """Makes the new files' names durable before the file that marks the checkpoint whole is written."""
    for d, _, _ in os.walk(folder):
        layout.fsync_path(d)


def _nanotron_random() -> Any:
    try:
        import nanotron.random
    except ImportError as e:
        raise RuntimeError(
            "converting random states needs Nanotron importable (install it from source): its RandomStates "
            f"is what the stock checkpoint pickles ({e})"
        ) from e
    return nanotron.random
