"""`bench` and `plot`: the engine measured on this machine, and a run's telemetry drawn."""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

from .words import median_size, plural

TELEMETRY = "datastates_telemetry.jsonl"  # telemetry.FILE, without importing it for --help


def cmd_bench(args: argparse.Namespace) -> int:
    from .. import bench

    result = bench.run(
        args.size_mib,
        args.repeat,
        args.dir,
        args.device,
        baseline=not args.no_baseline,
        progress=not args.quiet,
    )
    print(bench.table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


HOW_TO_GET_TELEMETRY = (
    f"the Nanotron trainer writes {TELEMETRY} into its checkpoints folder when its config sets "
    "`datastates.telemetry: true`; the plain engine writes the same lines when given a telemetry path, "
    "DataStatesEngine(..., telemetry_path=...)"
)


def telemetry_records(path: str | os.PathLike) -> tuple[Path, list[dict[str, object]]]:
    """The telemetry file `path` names (itself, or the one in the folder) and its records; ValueError or
    FileNotFoundError say what was looked for and how to get one."""
    from .. import format as fmt
    from ..telemetry import read as read_telemetry

    path = Path(path)
    if not os.path.lexists(path):
        raise FileNotFoundError(f"no such file or folder: {path}")
    if path.is_dir():
        file = path / TELEMETRY
        if not file.is_file():
            hint = ""
            if (path.parent / TELEMETRY).is_file():
                hint = f" ({path.parent} holds one: plot that folder)"
            raise FileNotFoundError(
                f"{file}: no such file (plot looks for {TELEMETRY} in the folder it is given){hint}; "
                f"{HOW_TO_GET_TELEMETRY}"
            )
    else:
        file = path
        try:
            fmt.read_header(file)
        except (OSError, ValueError):
            pass
        else:
            raise ValueError(
                f"{file}: a safetensors file, not telemetry; plot needs a telemetry file ({TELEMETRY}) "
                f"or the checkpoints folder holding one: {HOW_TO_GET_TELEMETRY}"
            )
    try:
        lines = read_telemetry(file)
    except UnicodeDecodeError:
        lines = []
    records = [r for r in lines if isinstance(r, dict)]
    if not records:
        raise ValueError(
            f"{file}: no telemetry records (JSON lines as in {TELEMETRY}); plot needs a telemetry file "
            f"or the checkpoints folder holding one: {HOW_TO_GET_TELEMETRY}"
        )
    return file, records


def cmd_plot(args: argparse.Namespace) -> int:
    file, lines = telemetry_records(args.path)
    out = Path(args.out) if args.out else file.with_name("datastates_telemetry.png")
    if not out.parent.is_dir():
        raise FileNotFoundError(f"{out.parent}: no such folder to write the plot into (-o {args.out})")
    records = [r for r in lines if "event" not in r]  # one per checkpoint
    replicated = {r.get("step"): r for r in lines if r.get("event") == "replicated"}
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("plot needs matplotlib: pip install matplotlib") from None

    def series(key: str, scale: float = 1.0) -> list[float]:
        return [scale * v if isinstance(v := r.get(key), (int, float)) else math.nan for r in records]

    have_steps = all(isinstance(r.get("step"), int) for r in records)
    xs = [r["step"] for r in records] if have_steps else list(range(1, len(records) + 1))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    top.plot(xs, series("stall_s", 1e3), marker="o", label="training stall")
    top.plot(xs, series("snapshot_s", 1e3), marker=".", label="snapshot")
    top.set_ylabel("ms")
    top.legend()
    bottom.plot(xs, series("persisted_s"), marker="o", label="persisted")
    bottom.plot(xs, series("committed_s"), marker=".", label="committed")
    bottom.plot(xs, series("cache_wait_s"), marker="x", label="waiting for free cache")
    if replicated:
        copies = [replicated.get(r.get("step"), {}).get("seconds", math.nan) for r in records]
        bottom.plot(xs, copies, marker="^", label="replicated to peers' memory")
    bottom.set_ylabel("s")
    bottom.set_xlabel("step" if have_steps else "checkpoint")
    bottom.legend()
    failed = [x for x, r in zip(xs, records) if r.get("committed") is False]
    for x in failed:
        top.axvline(x, color="red", linestyle=":")
    sizes = [v for r in records if isinstance(v := r.get("bytes"), (int, float))]
    each = f", {median_size(sizes)} each (median)" if sizes else ""
    top.set_title(f"{plural(len(records), 'checkpoint')} ({len(failed)} failed){each}")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"{out}: {plural(len(records), 'checkpoint')} from {file}")
    return 0
