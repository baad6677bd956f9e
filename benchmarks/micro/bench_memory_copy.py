"""How fast a memory checkpoint reaches the memory tier, against a pinned `copy_` of as many bytes (GPU).

A state shaped like the 1.1B Llama's (fp32 tensors of its weight shapes, `--gib` in all, in `--files`
files) is saved as the trainer saves a memory checkpoint: staged on the GPU (`stage_plans`), queued, each
file kept in memory only in /dev/shm, recycling the files of the checkpoint before the last (two sets made
and pinned ahead, `prepare_mirrors`, as the tier does). Per setting (`--settings`: `name:key=value,...` of
DataStatesConfig, `;`-separated), in turns, `--rounds` times, `--saves` saves each:

* `copy_gbps`: the checkpoint's bytes over the time from the queuing to the last file's snapshot (every byte
  in the tier's memory: what a staged checkpoint's GPU memory waits for);
* `persisted_gbps`: the same to the last file persisted (summed and renamed into place: committed);
* `queue_ms`: the queuing's time on the caller's thread, staging included.

Beside them, in the same process, `pinned_copy_gbps`: one `copy_` of `--baseline-gib` from the GPU into a
pinned host tensor (the link's speed as torch reaches it). Every checkpoint is read back and compared once.

    python3 benchmarks/micro/bench_memory_copy.py --out DIR [--gib 14.5 --files 8 --rounds 3 --saves 3]

Writes DIR/bench_memory_copy.json with every value and the medians. Without a GPU it runs on the CPU (host
tensors, a host copy as the baseline), to check the script.
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
from _common import command_info  # noqa: E402

# The 1.1B Llama's weight shapes (hidden 2048, MLP 5632, vocabulary 32000), cycled until the bytes are there.
SHAPES = [(32000, 2048), (2048, 2048), (512, 2048), (512, 2048), (2048, 2048), (11264, 2048), (2048, 5632)]
DEFAULT_SETTINGS = "default:;sum1:checksum_threads=1;copy2:copy_threads=2;whole:device_copy_size=0"


def make_files(nbytes: int, files: int, device: str) -> list[dict[str, torch.Tensor]]:
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(files)]
    total, i = 0, 0
    while total < nbytes:
        t = torch.randn(SHAPES[i % len(SHAPES)], device=device)
        out[i % files][f"t{i}"] = t
        total += t.numel() * 4
        i += 1
    return out


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def pinned_copy_gbps(nbytes: int, device: str) -> float:
    n = nbytes // 4096 * 4096
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty(n, dtype=torch.uint8, pin_memory=device == "cuda")
    laps = []
    for _ in range(4):  # the first one warms up
        sync()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync()
        laps.append(time.perf_counter() - t0)
    return n / min(laps[1:]) / 1e9


def one_setting(
    folder: Path, files: list[dict[str, torch.Tensor]], settings: dict[str, Any], saves: int
) -> list[dict[str, float]]:
    from nanotron_datastates import DataStatesConfig, DataStatesEngine

    config = DataStatesConfig(**{"host_cache_size": 1, "device_copy_gbps": 16.0, **settings})
    sets = [[folder / s / f"f{k}.safetensors" for k in range(len(files))] for s in ("a", "b", "c")]
    out = []
    with DataStatesEngine(config) as engine:
        plans = [engine.plan(f) for f in files]
        engine.prepare_mirrors([(p, path) for s in sets[:2] for p, path in zip(plans, s)])
        nbytes = sum(p.nbytes for p in plans)
        for k in range(saves):  # into set k+2 (mod 3), recycling set k's
            new, old = sets[(k + 2) % 3], sets[k % 3]
            sync()
            t0 = time.perf_counter()
            handles = engine.save_plans(
                list(zip(plans, new)), stage=True, mirrors=new, recycle=old
            )  # fmt: skip
            queue = time.perf_counter() - t0
            for h in handles:
                h.wait_persisted()
            copy = max(h.stats["snapshot_s"] for h in handles)
            done = max(h.stats["persisted_s"] for h in handles)
            out.append({
                "queue_ms": queue * 1e3, "copy_s": copy, "persisted_s": done,
                "copy_gbps": nbytes / copy / 1e9, "persisted_gbps": nbytes / done / 1e9,
            })  # fmt: skip
            print(json.dumps(out[-1]), flush=True)
        back = engine.load(new[0])
        if any(not torch.equal(back[n].to(t.device), t) for n, t in files[0].items()):
            raise SystemExit(f"{new[0]}: a tensor read back differs from the one saved")
    return out


def parse_settings(text: str) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for part in filter(None, text.split(";")):
        name, _, kv = part.partition(":")
        out[name] = {k: json.loads(v) for k, v in (x.split("=", 1) for x in filter(None, kv.split(",")))}
    return out


def main() -> int:
    a = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a.add_argument("--out", required=True)
    a.add_argument("--gib", type=float, default=14.5)
    a.add_argument("--files", type=int, default=8)
    a.add_argument("--rounds", type=int, default=3)
    a.add_argument("--saves", type=int, default=3)
    a.add_argument("--baseline-gib", type=float, default=4.0)
    a.add_argument("--settings", default=DEFAULT_SETTINGS)
    args = a.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    settings = parse_settings(args.settings)
    files = make_files(int(args.gib * (1 << 30)), args.files, device)
    raw: dict[str, list[dict[str, float]]] = {n: [] for n in settings}
    baseline = []
    folder = Path(tempfile.mkdtemp(prefix="ds-memory-copy-", dir="/dev/shm"))
    try:
        for r in range(args.rounds):
            baseline.append(pinned_copy_gbps(int(args.baseline_gib * (1 << 30)), device))
            print("pinned_copy_gbps", round(baseline[-1], 2), flush=True)
            for name, s in settings.items():
                print(f"round {r} {name}", flush=True)
                raw[name] += one_setting(folder / name, files, s, args.saves)
                shutil.rmtree(folder / name, ignore_errors=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    keys = ("queue_ms", "copy_gbps", "persisted_gbps")
    med = {n: {k: statistics.median(x[k] for x in rs) for k in keys} for n, rs in raw.items()}
    result = {
        "command": command_info(),
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "checkpoint_bytes": sum(t.numel() * 4 for f in files for t in f.values()),
        "settings": settings,
        "pinned_copy_gbps": statistics.median(baseline),
        "median": med,
        "copy_over_pinned": {n: m["copy_gbps"] / statistics.median(baseline) for n, m in med.items()},
        "raw": raw,
        "raw_pinned_copy_gbps": baseline,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_memory_copy.json").write_text(json.dumps(result, indent=1))
    print("pinned_copy_gbps", round(result["pinned_copy_gbps"], 2))
    for name, m in med.items():
        over = result["copy_over_pinned"][name]
        print(name, " ".join(f"{k} {v:.2f}" for k, v in m.items()), f"over pinned {over:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
