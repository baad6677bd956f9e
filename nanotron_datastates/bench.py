"""`nanotron-datastates bench`: the engine on this machine, against `torch.save` + fsync, in one run.

A quick figure for a user's own disk and GPU; `benchmarks/bench_engine.py` (in the repository) is the full
benchmark with every baseline and ceiling.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import TypedDict

import torch

from .engine import DataStatesEngine
from .engine_settings import DataStatesConfig
from .store import open_store


class _Measured(TypedDict):
    bytes: int
    tensors: int
    device: str
    directory: str
    io_backend: str
    repeat: int
    config: dict[str, object]  # DataStatesConfig.to_dict()
    raw: dict[str, list[float]]  # every value, by measure
    median: dict[str, float]
    persisted_gbps: float
    load_gbps: float


class Measured(_Measured, total=False):
    """What :func:`run` measured; the comparisons with `torch.save` where it ran (`baseline`)."""

    torch_save_gbps: float
    blocking_vs_torch_save: float


def make_state(size_mib: int, device: str) -> dict[str, torch.Tensor]:
    """Tensors from 64 KiB to 64 MiB (a model's mix of norms, biases and matrices), `size_mib` in all."""
    state, total, i = {}, size_mib << 20, 0
    sizes = [64 << 10, 1 << 20, 16 << 20, 64 << 20]
    gen = torch.Generator().manual_seed(0)
    while total > 0:
        n = min(sizes[i % len(sizes)], total)
        values = torch.randint(-(2**15), 2**15, (n // 2,), dtype=torch.int16, generator=gen)
        state[f"t{i}"] = values.to(device)
        total -= n
        i += 1
    return state


def run(
    size_mib: int = 1024,
    repeat: int = 3,
    directory: str | None = None,
    device: str = "cpu",
    config: DataStatesConfig | None = None,
    baseline: bool = True,
    progress: bool = True,
) -> Measured:
    """Saves a `size_mib` state `repeat` times (after one warm-up) and loads it back; returns medians and
    every value. Seconds; throughputs in GB/s (1e9 bytes/s)."""
    from tqdm import tqdm

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA device here")
    base = Path(directory) if directory else Path(tempfile.gettempdir())
    work = Path(tempfile.mkdtemp(prefix="datastates-bench-", dir=base))
    scratch = open_store(work)  # its files removed as a checkpoint's are (store/)
    config = config or DataStatesConfig(host_cache_size=max(1 / 64, 2 * size_mib / 1024))
    state = make_state(size_mib, device)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    raw: dict[str, list[float]] = {"blocking_s": [], "persisted_s": [], "load_s": [], "torch_save_s": []}
    backend = ""
    steps = (repeat + 1) * (3 if baseline else 2)
    try:
        with DataStatesEngine(config) as engine, tqdm(total=steps, disable=not progress, unit="step") as bar:
            engine.prepare_cache()
            backend = io_backend_text(engine.io_backend, config.io_backend)
            for r in range(repeat + 1):  # the first round warms up and is not kept
                keep = r > 0
                path = work / f"state{r}.safetensors"
                bar.set_description(f"engine save {r}/{repeat}")
                t0 = time.perf_counter()
                h = engine.save(state, path)
                h.wait_snapshot()
                t1 = time.perf_counter()
                h.wait_persisted()
                t2 = time.perf_counter()
                bar.update()
                bar.set_description(f"engine load {r}/{repeat}")
                loaded = engine.load(path, device)
                t3 = time.perf_counter()
                if r == 0 and any(not torch.equal(loaded[k], v) for k, v in state.items()):
                    raise RuntimeError(f"{path}: the load did not return the saved tensors")
                del loaded
                bar.update()
                if keep:
                    raw["blocking_s"].append(t1 - t0)
                    raw["persisted_s"].append(t2 - t0)
                    raw["load_s"].append(t3 - t2)
                if baseline:
                    bar.set_description(f"torch.save {r}/{repeat}")
                    t0 = time.perf_counter()
                    with open(work / f"torch{r}.pt", "wb") as f:
                        torch.save(state, f)
                        f.flush()
                        os.fsync(f.fileno())
                    if keep:
                        raw["torch_save_s"].append(time.perf_counter() - t0)
                    bar.update()
                for p in work.iterdir():  # the next round writes on a disk as empty as this one's
                    scratch.remove(p.name)
    finally:
        open_store(work.parent).remove(work.name)
    med = {k: statistics.median(v) for k, v in raw.items() if v}
    out: Measured = {
        "bytes": nbytes,
        "tensors": len(state),
        "device": device,
        "directory": str(base),
        "io_backend": backend,
        "repeat": repeat,
        "config": config.to_dict(),
        "raw": raw,
        "median": med,
        "persisted_gbps": nbytes / med["persisted_s"] / 1e9,
        "load_gbps": nbytes / med["load_s"] / 1e9,
    }
    if "torch_save_s" in med:
        out["torch_save_gbps"] = nbytes / med["torch_save_s"] / 1e9
        out["blocking_vs_torch_save"] = med["blocking_s"] / med["torch_save_s"]
    return out


def io_backend_text(used: str, asked: str) -> str:
    """The backend the engine writes with, and why where it is not io_uring."""
    from . import _core

    if used == "io_uring":
        return "io_uring"
    if not _core.built_with_io_uring:
        return f"pwrite (this build has no io_uring: {_core.io_uring_absent_why})"
    return "pwrite (as asked)" if asked == "pwrite" else "pwrite (io_uring is refused on this machine)"


def table(r: Measured) -> str:
    """The summary as a small text table."""
    m = r["median"]
    rows = [
        ("state", f"{r['bytes'] / 1e9:.2f} GB, {r['tensors']} tensors on {r['device']}, to {r['directory']}"),
        ("io backend", r["io_backend"]),
        ("blocking (save + wait_snapshot)", f"{m['blocking_s']:.3f} s"),
        ("time to persisted", f"{m['persisted_s']:.3f} s ({r['persisted_gbps']:.2f} GB/s)"),
        ("load", f"{m['load_s']:.3f} s ({r['load_gbps']:.2f} GB/s)"),
    ]
    if "torch_save_s" in m:
        rows.append(("torch.save + fsync", f"{m['torch_save_s']:.3f} s ({r['torch_save_gbps']:.2f} GB/s)"))
        rows.append(("blocking / torch.save", f"{r['blocking_vs_torch_save']:.3f}"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
