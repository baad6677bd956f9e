"""What a checkpoint costs the training steps after it, taken apart (GPU): a training loop runs on one GPU,
and between its steps, in turn, one of these events happens:

* `nothing`: the reference;
* `stage_only`: the checkpoint's tensors copied on the GPU as a save stages them, then dropped;
* `save`: the trainer's save: its files staged together and saved to `--dir` (`engine.save_plans`);
* `save_nocrc`: the same without checksums (`checksums: false`);
* `save_shm`: the same to /dev/shm (no disk);
* `save_1chunk`: the same with a host cache of 256 MiB chunks (fewer, larger copies to the host);
* `save_4k`: the same with a host cache of 4 KiB pages (`huge_pages: false`; the others ask for huge pages).

    python3 benchmarks/bench_interference.py --out DIR [--rounds 12 --dir /tmp/ds_interf]

The state saved has the shapes of the 180M model's checkpoint (`bench_staging.llama_files`: 2.16 GB). The loop
is a Transformer of that size (8 layers, width 1024) trained with fused Adam on 4 sequences of 1024 tokens,
each step timed after a CUDA sync. Per event and round: the call's own time, and its *excess*: the time of
the 3 steps after it over 3 times the median of the 10 steps before it. Events are interleaved within each
round; each save is persisted (and removed) before the next round's quiet steps. Writes
DIR/bench_interference.json with every value and the medians.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the helpers in benchmarks/
from _common import command_info  # noqa: E402
from bench_staging import _tensors, llama_files  # noqa: E402

BEFORE, AFTER = 10, 3


def make_step(
    device: str = "cuda", batch: int = 4, tokens: int = 1024, micro: int = 1, fused: bool = True
) -> Callable[[], float]:
    """One training step of a Transformer of about 180M parameters (8 layers of 1024), `micro` micro-batches
    of `batch` sequences of `tokens` tokens; returns its time (after a sync). Few short sequences make a
    step bound by the thread that launches its kernels, as Nanotron's 180M step is."""
    layer = torch.nn.TransformerEncoderLayer(1024, 16, 4096, batch_first=True, norm_first=True)
    model = torch.nn.TransformerEncoder(layer, 8, enable_nested_tensor=False).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    x = torch.randn(batch, tokens, 1024, device=device)

    def step() -> float:
        t0 = time.perf_counter()
        for _ in range(micro):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x).float().pow(2).mean()
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    return step


def saving_events(
    files: dict[str, Any], settings: dict[str, tuple[dict[str, Any], Path]]
) -> tuple[dict[str, tuple[Any, Path]], dict[str, Callable[[], Any]], int]:
    """For each setting (name -> DataStatesConfig's keywords, folder), an engine with its cache prepared for
    `files`, and the events: `stage_only`, what the first setting's save stages, dropped; and each setting's
    staged save of `files` into its folder. Returns the engines with their folders, the events and the
    files' bytes."""
    from nanotron_datastates import DataStatesConfig, DataStatesEngine
    from nanotron_datastates.save.prepare import prepare_all

    nbytes = sum(t.numel() * t.element_size() for s in files.values() for t in _tensors(s))
    engines = {
        name: (DataStatesEngine(DataStatesConfig(**kw)), folder) for name, (kw, folder) in settings.items()
    }
    plans: dict[str, list[tuple[Any, Path]]] = {}
    for name, (engine, folder) in engines.items():
        engine.prepare_cache(wait=True, nbytes=nbytes + len(files) * engine.cache_stats()["chunk_bytes"])
        plans[name] = [(engine.plan(state), folder / f) for f, state in files.items()]
    first = next(iter(plans.values()))

    def stage_only() -> None:
        staged = prepare_all([plan for plan, _ in first], stage=True)  # what a save stages
        del staged

    def save(engine: Any, files: list[tuple[Any, Path]]) -> Callable[[], Any]:
        return lambda: engine.save_plans(files, stage=True)

    events = {"stage_only": stage_only}
    events.update({name: save(engine, plans[name]) for name, (engine, _) in engines.items()})
    return engines, events, nbytes


def write_result(
    out: str, file: str, raw: dict[str, dict[str, list[float]]], nbytes: int, **extra: Any
) -> dict:
    """Writes `out/file`: the command, the GPU, `extra`, every event's raw values and their medians; returns
    the medians by event."""
    med = {n: {k: statistics.median(v) for k, v in d.items()} for n, d in raw.items()}
    result = {
        "command": command_info(),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "bytes": nbytes,
        **extra,
        "median": med,
        "raw": raw,
    }
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / file).write_text(json.dumps(result, indent=1))
    return med


def main() -> int:
    a = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a.add_argument("--out", required=True)
    a.add_argument("--dir", default="/tmp/ds_interf")
    a.add_argument("--rounds", type=int, default=12)
    a.add_argument("--cache-gib", type=float, default=8.0)
    args = a.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    files = llama_files("180m", "cuda")
    disk, shm = Path(args.dir), Path("/dev/shm/ds_interf")
    cache = {"host_cache_size": args.cache_gib}
    settings = {
        "save": (cache, disk),
        "save_nocrc": ({**cache, "checksums": False}, disk),
        "save_shm": (cache, shm),
        "save_1chunk": ({**cache, "chunk_size": 256}, disk),
        "save_4k": ({**cache, "huge_pages": False}, disk),
    }
    engines, saves, nbytes = saving_events(files, settings)
    events: dict[str, Callable[[], Any]] = {"nothing": lambda: None, **saves}

    step = make_step("cuda")
    for _ in range(20):  # warm-up: kernels chosen, allocator filled
        step()
    raw: dict[str, dict[str, list[float]]] = {n: {"call_s": [], "excess_s": []} for n in events}
    for r in range(args.rounds + 1):  # round 0 warms the events up (first allocations, files): left out
        for name, event in events.items():
            for _, folder in engines.values():
                (folder / "model").mkdir(parents=True, exist_ok=True)
                (folder / "optimizer").mkdir(parents=True, exist_ok=True)
            before = [step() for _ in range(BEFORE)]
            t0 = time.perf_counter()
            event()
            call = time.perf_counter() - t0
            after = [step() for _ in range(AFTER)]
            for engine, _ in engines.values():
                engine.wait_persisted()
            for _, folder in engines.values():
                shutil.rmtree(folder, ignore_errors=True)
            if r:
                raw[name]["call_s"].append(call)
                raw[name]["excess_s"].append(call + sum(after) - AFTER * statistics.median(before))
    for engine, _ in engines.values():
        engine.close()
    med = write_result(args.out, "bench_interference.json", raw, nbytes)
    for name, m in med.items():
        print(f"{name:12s} call {1e3 * m['call_s']:7.2f} ms   excess {1e3 * m['excess_s']:7.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
