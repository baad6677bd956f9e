"""What preparing the host cache costs (GPU): faulting in and page-locking `--cache-gib` GiB, with 4 KiB pages
and with transparent huge pages (`datastates.huge_pages`), and what it does meanwhile to a thread launching
small kernels (pinning holds the CUDA driver's locks).

Per setting and round (settings alternate, `--rounds` times):

* `prepare_s`: the whole cache prepared on the calling thread (`prepare_cache(wait=True)`), in a fresh engine;
* `background_s`, `launches`, `launch_max_ms`, `launch_p99_ms`: the same cache prepared on the engine's
  background thread while this thread launches 4 small kernels at a time and times each launch (no sync);
* `d2h_gbps`: the cache's device-to-host throughput once prepared: `--save-gib` of CUDA tensors saved to
  /dev/shm (no disk), bytes over the time until every byte is in the cache.

    python3 benchmarks/bench_pinning.py --out DIR [--cache-gib 16 --rounds 2 --save-gib 2]

Writes DIR/bench_pinning.json with every value and the medians.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the helpers in benchmarks/
from _common import command_info  # noqa: E402


def one_round(huge: bool, cache_gib: float, save_gib: float) -> dict[str, Any]:
    from nanotron_datastates import DataStatesConfig, DataStatesEngine

    config = DataStatesConfig(host_cache_size=cache_gib, huge_pages=huge)
    out: dict[str, Any] = {}
    with DataStatesEngine(config) as engine:
        t0 = time.perf_counter()
        engine.prepare_cache(wait=True)
        out["prepare_s"] = time.perf_counter() - t0
        out["huge_pages"] = engine.cache_stats()["huge_pages"]

    x = torch.zeros(1024, device="cuda")
    with DataStatesEngine(config) as engine:
        chunks = engine.cache_stats()["chunks"]
        laps: list[float] = []
        t0 = time.perf_counter()
        engine.prepare_cache(wait=False)
        while engine.cache_stats()["prepared"] < chunks:
            t = time.perf_counter()
            for _ in range(4):
                x.add_(1.0)
            laps.append((time.perf_counter() - t) / 4)
        out["background_s"] = time.perf_counter() - t0
        torch.cuda.synchronize()
        laps.sort()
        out["launches"] = len(laps)
        out["launch_max_ms"] = 1e3 * laps[-1] if laps else None
        out["launch_p99_ms"] = 1e3 * laps[int(0.99 * (len(laps) - 1))] if laps else None

        n = int(save_gib * (1 << 30)) // 4 // 64
        state = {f"t{i}": torch.randn(n, device="cuda") for i in range(64)}
        folder = Path("/dev/shm/ds_pinning")
        folder.mkdir(parents=True, exist_ok=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        handle = engine.save(state, folder / "s.safetensors")
        handle.wait_snapshot()
        out["d2h_gbps"] = sum(t.numel() * 4 for t in state.values()) / (time.perf_counter() - t0) / 1e9
        handle.wait_persisted()
        shutil.rmtree(folder, ignore_errors=True)
    return out


def main() -> int:
    a = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a.add_argument("--out", required=True)
    a.add_argument("--cache-gib", type=float, default=16.0)
    a.add_argument("--save-gib", type=float, default=2.0)
    a.add_argument("--rounds", type=int, default=2)
    args = a.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.zeros(1, device="cuda")  # the context first: its creation is not what is measured
    raw: dict[str, list[dict[str, Any]]] = {"4k": [], "huge": []}
    for _ in range(args.rounds):
        for name in raw:
            raw[name].append(one_round(name == "huge", args.cache_gib, args.save_gib))
            print(name, json.dumps(raw[name][-1]), flush=True)
    keys = ("prepare_s", "background_s", "launch_max_ms", "launch_p99_ms", "d2h_gbps")
    med = {n: {k: statistics.median(r[k] for r in rs) for k in keys} for n, rs in raw.items()}
    result = {
        "command": command_info(),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cache_gib": args.cache_gib,
        "median": med,
        "raw": raw,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_pinning.json").write_text(json.dumps(result, indent=1))
    for name, m in med.items():
        print(name, " ".join(f"{k} {v:.3f}" for k, v in m.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
