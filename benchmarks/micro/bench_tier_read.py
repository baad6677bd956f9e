"""How fast the memory tier reads into GPU memory (GPU): one file in /dev/shm shaped like the 1.1B Llama's
optimizer file (fp32 moments of its weight shapes), restored into preallocated CUDA tensors with checksums
verified, by the engine reading it through a mapping (`map_memory_files`, the default) and through read(2)
into chunks, with several parser-thread counts; next to the ceilings of the same call:

* `h2d_gbps`: one pinned host tensor copied to the GPU (the link);
* `host_copy_gbps`: the file's mapping copied into pinned memory by torch's own threads (memory to memory).

Per setting (settings alternate, `--rounds` times), in a fresh engine: `first_s`, the first restore (its
chunks pinned on the way, as in a restarted process), then `--repeat` restores (`gbps`: file bytes / time).

    python3 benchmarks/micro/bench_tier_read.py --out DIR [--gib 8 --threads 4,8,16 --rounds 2 --repeat 3]

Writes DIR/bench_tier_read.json with every value and the medians.
"""

from __future__ import annotations

import argparse
import json
import mmap
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
from _common import command_info  # noqa: E402

# The 1.1B Llama's weight shapes (hidden 2048, MLP 5632, vocabulary 32000), whose fp32 Adam moments the
# optimizer file holds: cycled until the file has the bytes asked for.
SHAPES = [(32000, 2048), (2048, 2048), (512, 2048), (512, 2048), (2048, 2048), (11264, 2048), (2048, 5632)]


def make_state(nbytes: int) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    total, i = 0, 0
    while total < nbytes:
        shape = SHAPES[i % len(SHAPES)]
        t = torch.randn(shape, device="cuda")
        state[f"m{i}"] = t
        total += t.numel() * 4
        i += 1
    return state


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def one_setting(
    path: Path, targets: dict[str, torch.Tensor], mapped: bool, threads: int, repeat: int
) -> dict[str, Any]:
    from nanotron_datastates import DataStatesConfig, DataStatesEngine

    nbytes = path.stat().st_size
    config = DataStatesConfig(host_cache_size=4, parser_threads=threads, map_memory_files=mapped)
    with DataStatesEngine(config) as engine:
        first = timed(lambda: engine.load_into(path, targets))
        laps = [timed(lambda: engine.load_into(path, targets)) for _ in range(repeat)]
    return {
        "first_s": first,
        "first_gbps": nbytes / first / 1e9,
        "laps_s": laps,
        "gbps": nbytes / statistics.median(laps) / 1e9,
    }


def ceilings(path: Path) -> dict[str, float]:
    n = min(path.stat().st_size, 2 << 30) // 4096 * 4096
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    dev.copy_(pinned, non_blocking=True)  # warm-up
    h2d = min(timed(lambda: dev.copy_(pinned, non_blocking=True)) for _ in range(3))
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), n) as m:
        host = copy_rate(m, pinned)
    return {"bytes": n, "h2d_gbps": n / h2d / 1e9, "host_copy_gbps": n / host / 1e9}


def copy_rate(m: mmap.mmap, pinned: torch.Tensor) -> float:
    """Seconds for the best of three copies of the mapping into `pinned` (after one that faults it in)."""
    views = [torch.frombuffer(m, dtype=torch.uint8, count=pinned.numel())]
    pinned.copy_(views[0])
    best = min(timed(lambda: pinned.copy_(views[0])) for _ in range(3))
    views.clear()  # the mapping closes only once no tensor holds it
    return best


def main() -> int:
    a = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a.add_argument("--out", required=True)
    a.add_argument("--gib", type=float, default=8.0)
    a.add_argument("--threads", default="4,8,16")
    a.add_argument("--rounds", type=int, default=2)
    a.add_argument("--repeat", type=int, default=3)
    args = a.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from nanotron_datastates import DataStatesConfig, DataStatesEngine

    folder = Path(tempfile.mkdtemp(prefix="ds-tier-read-", dir="/dev/shm"))
    try:
        path = folder / "optimizer.safetensors"
        state = make_state(int(args.gib * (1 << 30)))
        with DataStatesEngine(DataStatesConfig(host_cache_size=4)) as engine:
            engine.save(state, path).wait_persisted()
        targets = {k: torch.empty_like(v) for k, v in state.items()}
        settings = [(m, int(t)) for t in args.threads.split(",") for m in (True, False)]
        raw: dict[str, list[dict[str, Any]]] = {f"{'map' if m else 'read'}-{t}": [] for m, t in settings}
        ceil = []
        for _ in range(args.rounds):
            ceil.append(ceilings(path))
            print("ceilings", json.dumps(ceil[-1]), flush=True)
            for m, t in settings:
                name = f"{'map' if m else 'read'}-{t}"
                raw[name].append(one_setting(path, targets, m, t, args.repeat))
                print(name, json.dumps(raw[name][-1]), flush=True)
        for k, v in state.items():
            if not torch.equal(targets[k], v):
                print(f"restored tensor {k} differs from the saved one", file=sys.stderr)
                return 1
        nbytes = path.stat().st_size
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    med = {
        n: {k: statistics.median(r[k] for r in rs) for k in ("first_s", "first_gbps", "gbps")}
        for n, rs in raw.items()
    }
    result = {
        "command": command_info(),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "file_bytes": nbytes,
        "ceilings": {k: statistics.median(c[k] for c in ceil) for k in ("h2d_gbps", "host_copy_gbps")},
        "median": med,
        "raw": raw,
        "raw_ceilings": ceil,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_tier_read.json").write_text(json.dumps(result, indent=1))
    print("ceilings", json.dumps(result["ceilings"]))
    for name, m in med.items():
        print(name, " ".join(f"{k} {v:.3f}" for k, v in m.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
