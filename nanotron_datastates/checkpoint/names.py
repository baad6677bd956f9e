"""Where each piece of a Nanotron checkpoint goes, and the names Nanotron gives its files.

The folder is Nanotron's: `model/` holds its own file names, tensor key ("data") and tensor metadata, so that
Nanotron's `load_weights` and its scripts read it unchanged. Optimizer, LR scheduler and random states, which
Nanotron writes with pickle (`.pt`), are written by the engine as safetensors under the same names with
`.safetensors`. `checkpoint_metadata.json`, `config.yaml` and `model_config.json` are Nanotron's; the names
here are spelled without importing Nanotron.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

MANIFEST = "datastates.json"  # marks a datastates checkpoint: see manifest.py
LATEST = "latest.txt"
NANOTRON_METADATA = "checkpoint_metadata.json"  # Nanotron's CHECKPOINT_FILE_NAME, without importing Nanotron

FOLDERS = ("model", "optimizer", "lr_scheduler", "random")  # where the engine's files of a checkpoint go


def name_in(path: str | os.PathLike, folder: str | os.PathLike) -> str:
    """`path`'s name in the checkpoint `folder`, as the manifest names it (`os.path.relpath`'s, with `/`):
    taken as the path's tail where it lies below `folder` as given, as every file a checkpoint writes does
    (a committer names each of a checkpoint's files; relpath costs microseconds a file)."""
    path = os.fspath(path)
    prefix = os.fspath(folder).rstrip("/") + "/"
    tail = path[len(prefix) :] if path.startswith(prefix) else ""
    if tail and os.path.normpath(tail) == tail and not tail.startswith(("/", "..")):
        return tail
    return Path(os.path.relpath(path, folder)).as_posix()


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


# ASCII digits only, at most 7 (a manifest lists at most 2**20 files): never a number of a hostile size
_PART = re.compile(r"(.+)_part-([0-9]{1,7})-of-([0-9]{1,7})\.safetensors")


def part_name(name: str, part: int, count: int) -> str:
    """The file of `part` (0 to `count` - 1) of a state that the replicas write in parts, for its whole
    file's `name` (`x.safetensors`): `x_part-<part>-of-<count>.safetensors`. Parts are ours alone (stock
    Nanotron reads no optimizer file of ours; `convert` writes it whole)."""
    return f"{name.removesuffix('.safetensors')}_part-{part}-of-{count}.safetensors"


def whole_name(name: str) -> tuple[str, int, int] | None:
    """(the whole file's name, part, count) for a part's file name; None for another name."""
    m = _PART.fullmatch(name)
    return None if m is None else (m[1] + ".safetensors", int(m[2]), int(m[3]))


_RANDOM_NAME = re.compile(
    r"tp-([0-9]+)-of-([0-9]+)_dp-([0-9]+)-of-([0-9]+)_pp-([0-9]+)-of-([0-9]+)(?:_cp-([0-9]+)-of-([0-9]+))?"
)


def stock_random_states(name: str) -> tuple[str, bool] | None:
    """For one of our `random/` file names: Nanotron's name for it (`.pt`, without the context-parallel part)
    and whether this file is the one Nanotron keeps there (context-parallel rank 0's); None for another
    name."""
    m = _RANDOM_NAME.fullmatch(name.removesuffix(".safetensors"))
    if m is None:
        return None
    return m.group(0).split("_cp-")[0] + ".pt", m.group(7) in (None, "0")
