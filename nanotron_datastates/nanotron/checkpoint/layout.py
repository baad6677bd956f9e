"""Where each piece of a Nanotron checkpoint goes, and the manifest that marks a datastates checkpoint.

The folder is Nanotron's: `model/` holds its own file names, tensor key ("data") and tensor metadata, so that
Nanotron's `load_weights` and its scripts read it unchanged. Optimizer, LR scheduler and random states, which
Nanotron writes with pickle (`.pt`), are written by the engine as safetensors under the same names with
`.safetensors`. `checkpoint_metadata.json`, `config.yaml` and `model_config.json` are Nanotron's.

`datastates.json`, written by rank 0 once every rank's files are persisted and before `latest.txt` names the
checkpoint, lists each file with its size and per-tensor CRC-32C. A checkpoint folder without it is either
Nanotron's own or incomplete. A manifest is trusted for nothing: every file it names must be a file of this
layout inside the checkpoint's folder (`member`), or reading it is a ManifestError naming the entry.

`files_to_read` is the one answer to "which files does this rank read on resume", given the manifest, the
layout here and, once the process groups exist, this rank's `Place` in them (before, only files every rank
reads are named).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from ... import trust

MANIFEST = "datastates.json"
MANIFEST_FORMAT = "nanotron-datastates"
MANIFEST_VERSION = 1
LATEST = "latest.txt"
NANOTRON_METADATA = "checkpoint_metadata.json"  # Nanotron's CHECKPOINT_FILE_NAME, without importing Nanotron


FOLDERS = ("model", "optimizer", "lr_scheduler", "random")  # where the engine's files of a checkpoint go
MAX_SMALL_FILES = 16  # the scheduler's and random states' files read into the page cache first, at most


class ManifestError(ValueError):
    """A manifest that is not ours, or names a file outside the checkpoint's layout."""


def is_datastates_checkpoint(folder: str | os.PathLike) -> bool:
    return (Path(folder) / MANIFEST).is_file()


def as_safetensors(pt_name: str) -> str:
    """Nanotron's pickle file name for optimizer and scheduler shards, as our safetensors file name."""
    return pt_name[: -len(".pt")] + ".safetensors" if pt_name.endswith(".pt") else pt_name + ".safetensors"


def random_states_name(
    tp: tuple[int, int], dp: tuple[int, int], pp: tuple[int, int], cp: tuple[int, int] = (0, 1)
) -> str:
    """Nanotron's `random/` file name (rank, size per dimension), as safetensors. With context parallelism,
    `_cp-<rank>-of-<size>` follows: Nanotron main names the file without it, so that its context-parallel
    ranks all write one file and all read it back; each of ours keeps its own generators."""
    name = f"tp-{tp[0]}-of-{tp[1]}_dp-{dp[0]}-of-{dp[1]}_pp-{pp[0]}-of-{pp[1]}"
    if cp[1] > 1:
        name += f"_cp-{cp[0]}-of-{cp[1]}"
    return name + ".safetensors"


@dataclasses.dataclass(frozen=True)
class Place:
    """A rank's (rank, size) in each parallel dimension: what its optimizer, scheduler and random-state files
    are named after."""

    tp: tuple[int, int]
    dp: tuple[int, int]
    pp: tuple[int, int]
    cp: tuple[int, int] = (0, 1)
    ep: tuple[int, int] = (0, 1)

    def _ranks(self, dp: bool) -> str:
        parts = [f"pp-{self.pp[0]}-of-{self.pp[1]}", f"tp-{self.tp[0]}-of-{self.tp[1]}"]
        if dp:
            parts.insert(1, f"dp-{self.dp[0]}-of-{self.dp[1]}")
        return "_".join([*parts, f"exp-{self.ep[0]}-of-{self.ep[1]}"])

    def optimizer_name(self, zero: bool) -> str:
        """Nanotron's `optimizer_filename`, as safetensors: with the data-parallel rank for a ZeRO shard."""
        return f"optimizer_{self._ranks(dp=zero)}.safetensors"

    def lr_scheduler_name(self) -> str:
        """Nanotron's `lr_scheduler_filename` for an integer ZeRO stage (it tests `is_zero is True`, so the
        name never has the data-parallel rank), as safetensors."""
        return f"lr_scheduler_{self._ranks(dp=False)}.safetensors"

    def random_states_name(self) -> str:
        return random_states_name(self.tp, self.dp, self.pp, self.cp)


_RANDOM_NAME = re.compile(r"tp-(\d+)-of-(\d+)_dp-(\d+)-of-(\d+)_pp-(\d+)-of-(\d+)(?:_cp-(\d+)-of-(\d+))?")


def stock_random_states(name: str) -> tuple[str, bool] | None:
    """For one of our `random/` file names: Nanotron's name for it (`.pt`, without the context-parallel part)
    and whether this file is the one Nanotron keeps there (context-parallel rank 0's); None for another
    name."""
    m = _RANDOM_NAME.fullmatch(name.removesuffix(".safetensors"))
    if m is None:
        return None
    return m.group(0).split("_cp-")[0] + ".pt", m.group(7) in (None, "0")


TOPOLOGY_KEYS = ("tp", "pp", "dp", "cp", "expert", "zero_stage")
# What a manifest without the key was written with (cp: before Nanotron had context parallelism).
TOPOLOGY_DEFAULTS = {"cp": 1}


def topology(*, tp: int, pp: int, dp: int, cp: int, expert: int, zero_stage: int) -> dict[str, int]:
    """The parallel layout a checkpoint was written with, as its manifest records it."""
    return {"tp": tp, "pp": pp, "dp": dp, "cp": cp, "expert": expert, "zero_stage": zero_stage}


def stock_topology(folder: str | os.PathLike) -> dict[str, int]:
    """The layout a checkpoint of Nanotron's own format was saved with, as far as its files say (tp, dp and cp
    from its metadata, pp and the ZeRO stage from its config, else from its optimizer's config, as Nanotron's
    loader reads them); {} if they say nothing."""
    folder = Path(folder)
    meta, config = read_json(folder / NANOTRON_METADATA), read_yaml(folder / "config.yaml")
    out = {k: int(meta[k]) for k in ("tp", "dp", "cp") if isinstance(meta.get(k), int)}
    par, opt = config.get("parallelism") or {}, config.get("optimizer") or {}
    if isinstance(par.get("pp"), int):
        out["pp"] = par["pp"]
    if isinstance(opt.get("zero_stage"), int):
        out["zero_stage"] = opt["zero_stage"]
    saved_optimizer = read_json(folder / "optimizer" / "optimizer_config.json")
    sizes = saved_optimizer.get("parallelism") or {}
    pp_size = str(sizes.get("pp_size", ""))
    if "pp" not in out and pp_size.isascii() and pp_size.isdigit():
        out["pp"] = int(pp_size)
    if "zero_stage" not in out and isinstance(saved_optimizer.get("type"), str):
        out["zero_stage"] = int(saved_optimizer["type"] == "ZeroDistributedOptimizer")
    return out


def topology_changes(saved: dict[str, Any], here: dict[str, int]) -> dict[str, tuple[Any, int]]:
    """{key: (saved, here)} for every dimension that differs; a key the manifest lacks has its default."""
    return {
        k: (saved.get(k, TOPOLOGY_DEFAULTS.get(k)), v)
        for k, v in here.items()
        if saved.get(k, TOPOLOGY_DEFAULTS.get(k)) != v
    }


def write_atomic(path: str | os.PathLike, data: bytes | str) -> None:
    """Temporary file in the same folder, fsync, rename, fsync of the folder: readers see all or nothing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_path(path.parent)


def fsync_path(path: str | os.PathLike) -> None:
    """fsync of a file, or of a folder (which makes the names in it durable)."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if os.path.isdir(path) else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_json(path: str | os.PathLike) -> dict[str, Any]:
    """A JSON object from `path`; {} if it is missing, unreadable or not an object (for describing folders
    whatever state they are in); an OSError naming it where it is not a regular file (a FIFO, a folder)."""
    return _read_doc(path, json.loads, ValueError)


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """Like `read_json`, for YAML (Nanotron's config.yaml)."""
    import yaml

    return _read_doc(path, yaml.safe_load, yaml.YAMLError)


def _read_doc(path: str | os.PathLike, parse: Any, bad: type[Exception]) -> dict[str, Any]:
    try:
        with os.fdopen(trust.open_to_read(path), "rb") as f:
            doc = parse(f.read())
    except (trust.UntrustedPath, IsADirectoryError):
        raise  # not a file at all: never taken for a missing one
    except (OSError, ValueError, bad):
        return {}
    return doc if isinstance(doc, dict) else {}


def manifest(
    step: int,
    topology: dict[str, int],
    files: dict[str, dict[str, Any]],
    replicas: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A manifest; `replicas`: where each rank's memory copy is replicated (`nodes`: each rank's node;
    `holders`: the ranks keeping each rank's replicas), where it is."""
    doc = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "step": step,
        "topology": topology,
        "files": dict(sorted(files.items())),
    }
    return {**doc, "replicas": replicas} if replicas else doc


MAX_MANIFEST = 256 << 20  # bytes a manifest may hold (about 1 KB per file; a million files)
MAX_FILES = 1 << 20
_MAX_DIM = 1 << 20  # ranks per dimension of a topology
_HEX8 = re.compile(r"[0-9a-f]{8}")


def read_manifest(folder: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a checkpoint folder, checked against its schema (`check_manifest`): ManifestError,
    naming the file and the key, if it is not ours, is newer than this package, or holds anything of the
    wrong type or out of range; never followed through a link (OSError)."""
    path = Path(folder) / MANIFEST
    raw = trust.read_regular(path, MAX_MANIFEST)
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ManifestError(f"{path} is not valid JSON: {e}") from None
    return check_manifest(doc, path)


def check_manifest(doc: Any, path: str | os.PathLike) -> dict[str, Any]:
    """`doc` if it is a manifest this package reads, else ManifestError naming `path` and the key at fault.
    Checked: the format and version; the step, a step number; every file a file of the layout (`member`)
    with its size in 63 bits and its checksums spelled as written (8 lowercase hex digits per tensor; block
    checksums as text); the topology, positive integers (ZeRO stage 0-3) whose ranks fit the files listed
    (each tp x dp x pp x cp rank writes one)."""

    def bad(key: str, what: str) -> ManifestError:
        return ManifestError(f"{path}: {key} {what}")

    if (
        not isinstance(doc, dict)
        or doc.get("format") != MANIFEST_FORMAT
        or not isinstance(doc.get("files"), dict)
    ):
        raise ManifestError(f"{path} is not a nanotron-datastates manifest")
    version = doc.get("version", 0)
    if not _is_int(version) or version < 0:
        raise bad("'version'", f"is {version!r}, not a version number")
    if version > MANIFEST_VERSION:
        raise ManifestError(f"{path} was written by a newer nanotron-datastates (version {version})")
    step = doc.get("step")
    if not (isinstance(step, int) and _is_int(step) and 0 <= step < 2**63):
        raise bad("'step'", f"is {step!r}, not a step number")
    files = doc["files"]
    if len(files) > MAX_FILES:
        raise bad("'files'", f"lists {len(files)} files, more than {MAX_FILES}")
    for rel, entry in files.items():
        why = _not_a_member(rel)
        if why:
            raise bad(f"entry {rel!r}", why)
        _check_entry(entry, lambda key, what, rel=rel: bad(f"files[{rel!r}].{key}", what))
    topo = doc.get("topology", {})
    if not isinstance(topo, dict):
        raise bad("'topology'", "is not an object")
    for key, value in topo.items():
        low = 0 if key == "zero_stage" else 1
        high = 3 if key == "zero_stage" else _MAX_DIM
        if not _is_int(value) or not low <= value <= high:
            raise bad(f"topology.{key}", f"is {value!r}, not an integer from {low} to {high}")
    ranks = 1
    for key in ("tp", "dp", "pp", "cp"):
        ranks *= topo.get(key, 1)
    if ranks > max(len(files), 1):
        raise bad(
            "'topology'", f"has {ranks} tp x dp x pp x cp ranks, more than the {len(files)} files listed"
        )
    return doc


def _check_entry(entry: Any, bad: Any) -> None:
    """A manifest's entry of one file (see `file_entry`)."""
    if not isinstance(entry, dict):
        raise bad("", "is not an object")
    size = entry.get("bytes")
    if not (isinstance(size, int) and _is_int(size) and 0 <= size < 2**63):
        raise bad("bytes", f"is {size!r}, not a size")
    sums = entry.get("crc32c", {})
    if not isinstance(sums, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and _HEX8.fullmatch(v) for k, v in sums.items()
    ):
        raise bad("crc32c", "must map tensor names to 8 lowercase hex digits")
    blocks = entry.get("crc32c_blocks", {})
    if not isinstance(blocks, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in blocks.items()
    ):
        raise bad("crc32c_blocks", "must map tensor names to text")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _not_a_member(rel: Any) -> str | None:
    """Why `rel` cannot name a file of a checkpoint's layout, or None."""
    try:
        p = trust.relative_name(rel)
    except trust.UntrustedPath:
        return "leaves the checkpoint's folder or is not a plain path"
    if len(p.parts) < 2 or p.parts[0] not in FOLDERS or p.suffix != ".safetensors":
        return f"is not a safetensors file under {', '.join(f + '/' for f in FOLDERS)}"
    return None


def member(folder: str | os.PathLike, rel: str) -> Path:
    """`folder / rel`, for a file a manifest names; ManifestError if `rel` is not a file of the layout or
    resolves (through a link) outside `folder`."""
    why = _not_a_member(rel)
    if why:
        raise ManifestError(f"{Path(folder) / MANIFEST}: entry {rel!r} {why}")
    path = Path(folder) / rel
    real, top = os.path.realpath(path), os.path.realpath(folder)
    if os.path.commonpath([real, top]) != top:
        raise ManifestError(f"{path} is a link out of the checkpoint's folder (to {real})")
    return path


def weight_files(doc: dict[str, Any], folder: Path) -> list[Path]:
    """Every weight file a manifest names, under `folder`, in name order: what a rank of a layout without
    tensor, pipeline or expert parallelism reads."""
    return [member(folder, f) for f in sorted(doc["files"]) if f.startswith("model/")]


def file_checksums(
    doc: dict[str, Any], folder: str | os.PathLike, path: str | os.PathLike
) -> dict[str, int] | None:
    """The checksums the manifest holds for `path` (a file of the checkpoint in `folder`), if any."""
    entry = doc["files"].get(Path(os.path.relpath(path, folder)).as_posix())
    if not entry or "crc32c" not in entry:
        return None
    return {name: int(v, 16) for name, v in entry["crc32c"].items()}


def file_entry(nbytes: int, handle: Any) -> dict[str, Any]:
    """The manifest's entry for a persisted file (a SaveHandle's): its size and its tensors' CRCs; for a
    file whose header holds none (`exact_metadata`: Nanotron's weight files), its block segments' CRCs too,
    spelled as in a header (`B:` and 8 hex digits per segment), so that a part of it can be read and
    checked."""
    from ... import format as fmt  # here: this module stays free of torch

    sums = handle.checksums()
    entry: dict[str, Any] = {"bytes": nbytes, "crc32c": {n: f"{c:08x}" for n, c in sums.items()}}
    if handle.exact_metadata:
        size, blocks = handle.block_checksums()
        if size:
            entry["crc32c_blocks"] = {n: fmt.spell_blocks(size, v) for n, v in blocks.items()}
    return entry


def file_block_checksums(
    doc: dict[str, Any], folder: str | os.PathLike, path: str | os.PathLike
) -> tuple[int, dict[str, list[int]]] | None:
    """The block checksums the manifest holds for `path`, if any (see `file_entry`)."""
    from ... import format as fmt  # here: this module stays free of torch

    rel = Path(os.path.relpath(path, folder)).as_posix()
    raw = (doc["files"].get(rel) or {}).get("crc32c_blocks")
    if raw is None:
        return None
    bad = ManifestError(f"{folder}/{MANIFEST}: the block checksums of {rel} are malformed")
    if not isinstance(raw, dict):
        raise bad
    sizes, out = set(), {}
    for name, text in raw.items():
        parsed = fmt.parse_blocks(text) if isinstance(text, str) else None
        if parsed is None:
            raise bad
        sizes.add(parsed[0])
        out[str(name)] = parsed[1]
    if len(sizes) != 1:
        raise bad
    return sizes.pop(), out


def random_states_at(doc: dict[str, Any], place: Place) -> str:
    """The saved random-state file of the rank at `place`, each rank index taken modulo the saved size of its
    dimension: a deterministic choice for a rank of another layout, which did not exist when it was saved."""
    saved = doc.get("topology", {})

    def at(dim: tuple[int, int], key: str) -> tuple[int, int]:
        size = int(saved.get(key, TOPOLOGY_DEFAULTS.get(key, 1)))
        return dim[0] % size, size

    return random_states_name(at(place.tp, "tp"), at(place.dp, "dp"), at(place.pp, "pp"), at(place.cp, "cp"))


@dataclasses.dataclass(frozen=True)
class ReadSet:
    """What a rank reads to resume: weight files (every one, where no rank holds a part of the model only;
    else none, as which ones depends on the model), its optimizer file, and the small files (scheduler,
    random states, metadata) to read into the page cache before the large ones."""

    weights: list[Path]
    optimizer: Path | None
    small: list[Path]


def files_to_read(
    doc: dict[str, Any],
    folder: Path,
    here: dict[str, int],
    place: Place | None,
    *,
    optimizer: bool,
    scheduler: bool,
) -> ReadSet | None:
    """The files this rank reads from the checkpoint `doc` describes, in `folder`, for the layout `here`
    (`topology`); None where the layout differs from the saved one (the state is resharded). Without a
    `place` (before the process groups exist), only what every rank reads: the optimizer file where there
    is one, the small files where there are few."""
    if topology_changes(doc.get("topology", {}), here):
        return None
    whole = (here["tp"], here["pp"], here["expert"]) == (1, 1, 1)
    if place is None and not whole:  # which shard a rank holds is not known yet
        return ReadSet([], None, [])
    weights = weight_files(doc, folder) if whole else []
    names = [f for f in doc["files"] if f.startswith("optimizer/")]
    if place is not None:
        names = [f for f in names if f == "optimizer/" + place.optimizer_name(zero=here["zero_stage"] > 0)]
    opt = member(folder, names[0]) if optimizer and len(names) == 1 else None
    small = [folder / NANOTRON_METADATA]
    if place is not None:
        small.append(folder / "random" / place.random_states_name())
        if scheduler:
            small.append(folder / "lr_scheduler" / place.lr_scheduler_name())
    else:
        rest = [f for f in sorted(doc["files"]) if f.startswith(("lr_scheduler/", "random/"))]
        small += [member(folder, f) for f in rest] if len(rest) <= MAX_SMALL_FILES else []
    return ReadSet(weights, opt, small)
