"""What the copy threads buy a save of host tensors (CPU): the blocking time (`save` + `wait_snapshot`) of one
state with `copy_threads` 1, 0 (automatic: one per core, up to 4) and 4, settings alternating `--rounds`
times, each in a fresh engine whose cache is prepared first; beside it, `torch.save` + fsync of the same
state in the same folder.

    python3 benchmarks/micro/bench_copy_threads.py --out DIR [--size-gib 0.74 --max-mib 4 --rounds 2]

Writes DIR/bench_copy_threads.json with every value and the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the helpers in benchmarks/
from _common import KiB, MiB, command_info, make_state  # noqa: E402

SETTINGS = (1, 0, 4)


def blocking(state: dict[str, torch.Tensor], folder: Path, copy_threads: int, saves: int) -> list[float]:
    from nanotron_datastates import DataStatesEngine

    out = []
    with DataStatesEngine(host_cache_size=2, copy_threads=copy_threads) as engine:
        engine.prepare_cache(wait=True)
        engine.save(state, folder / "warm.safetensors").wait_persisted()
        for i in range(saves):
            t0 = time.perf_counter()
            handle = engine.save(state, folder / f"{i}.safetensors")
            handle.wait_snapshot()
            out.append(time.perf_counter() - t0)
            handle.wait_persisted()
    return out


def torch_save(state: dict[str, torch.Tensor], path: Path) -> float:
    t0 = time.perf_counter()
    torch.save(state, path)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for bench_copy_threads.json (required)")
    p.add_argument("--size-gib", type=float, default=0.74, help="state size, GiB (default %(default)s)")
    p.add_argument("--max-mib", type=float, default=4, help="largest tensor, MiB (default %(default)s)")
    p.add_argument("--rounds", type=int, default=2, help="rounds over the settings (default %(default)s)")
    p.add_argument("--saves", type=int, default=4, help="timed saves each time (default %(default)s)")
    p.add_argument("--dir", default=None, help="where files go (default: a fresh folder in the current one)")
    args = p.parse_args()
    state = make_state(int(args.size_gib * (1 << 30)), min_bytes=64 * KiB, max_bytes=int(args.max_mib * MiB))
    folder = Path(tempfile.mkdtemp(dir=args.dir or "."))
    values: dict[str, Any] = {str(s): [] for s in SETTINGS}
    values["torch_save_fsync"] = []
    try:
        for _ in range(args.rounds):
            for s in SETTINGS:
                values[str(s)] += blocking(state, folder, s, args.saves)
            values["torch_save_fsync"].append(torch_save(state, folder / "state.pt"))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    medians = {k: statistics.median(v) for k, v in values.items()}
    result = {
        "command": command_info(),
        "cpus": os.cpu_count(),
        "tensors": len(state),
        "bytes": sum(t.numel() * t.element_size() for t in state.values()),
        "blocking_s": values,
        "median_s": medians,
        "blocking_over_torch_save": {
            s: medians[str(s)] / medians["torch_save_fsync"] for s in map(str, SETTINGS)
        },
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_copy_threads.json").write_text(json.dumps(result, indent=1))
    for k, v in medians.items():
        print(f"{k:>18s}: {v * 1e3:8.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
