"""The parallel layout a checkpoint was written with (its manifest's `topology`, or what a stock Nanotron
checkpoint's files say), and how it differs from the layout resuming it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from .file_io import read_json, read_yaml, section
from .names import NANOTRON_METADATA

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
    out = {k: meta[k] for k in ("tp", "dp", "cp") if _is_count(meta.get(k))}
    par, opt = section(config, "parallelism"), section(config, "optimizer")
    if _is_count(par.get("pp")):
        out["pp"] = par["pp"]
    if _is_count(opt.get("zero_stage")):
        out["zero_stage"] = opt["zero_stage"]
    saved_optimizer = read_json(folder / "optimizer" / "optimizer_config.json")
    sizes = section(saved_optimizer, "parallelism")
    pp_size = str(sizes.get("pp_size", ""))
    if "pp" not in out and pp_size.isascii() and pp_size.isdigit() and len(pp_size) <= 9:
        out["pp"] = int(pp_size)
    if "zero_stage" not in out and isinstance(saved_optimizer.get("type"), str):
        out["zero_stage"] = int(saved_optimizer["type"] == "ZeroDistributedOptimizer")
    return out


def _is_count(value: object) -> bool:
    """A size or a stage as a config may give it: an int (not a bool), below 2**31."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31


def saved_topology(doc: Mapping[str, object]) -> Mapping[str, int]:
    """A manifest's topology, as `check_manifest` passed it ({} where it has none)."""
    topo = doc.get("topology", {})
    return topo if isinstance(topo, dict) else {}


def topology_changes(saved: Mapping[str, int], here: Mapping[str, int]) -> dict[str, tuple[int | None, int]]:
    """{key: (saved, here)} for every dimension that differs; a key the manifest lacks has its default."""
    return {
        k: (saved.get(k, TOPOLOGY_DEFAULTS.get(k)), v)
        for k, v in here.items()
        if saved.get(k, TOPOLOGY_DEFAULTS.get(k)) != v
    }
