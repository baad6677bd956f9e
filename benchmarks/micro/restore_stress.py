"""Resume's read-ahead, repeated: the hunt for its checksum mismatch (NOTES steps 15-18; the cause was
Nanotron's patched torch.empty, which the model build below reproduces where Nanotron is installed).

A state shaped like the 180M model's checkpoint (51 bf16 weight files, one optimizer file of AdamW moments
with CPU `step` scalars) is saved once. Then each round, in a fresh process with a fresh engine (a cold host
cache, as in a new run), does what the trainer's resume does: `Prefetch` reads the weights and then the
optimizer onto the GPU while the main thread builds a model (allocations, init kernels), copies the weights
read ahead into it and drops them. Every tensor is compared with the saved bytes.

Rounds alternate between the trainer's exact path (checksums on: a mismatch shows as the prefetch's warning)
and the same reads with checksums off, where a bad read lands on the GPU and is compared byte by byte, so the
report says which bytes were wrong and what they held.

    python3 benchmarks/restore_stress.py --work /tmp/rs --procs 6 --rounds 6 --out OUT/restore-stress
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from nanotron_datastates import DataStatesConfig, DataStatesEngine
from nanotron_datastates.resume.read_ahead import Prefetch

HIDDEN, LAYERS = 576, 30  # the 180M Llama's widths: 51 weight files
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: a smoke run of the script itself


def shapes() -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [(49152, HIDDEN)]
    for _ in range(LAYERS):
        out += [(3 * HIDDEN, HIDDEN), (1536 * 2, HIDDEN)]
    return out[:51]


def config() -> DataStatesConfig:
    return DataStatesConfig(host_cache_size=8, parser_threads=4)


def make(work: Path) -> None:
    """The files and the sums of their tensors (kept apart, as the trainer's manifest keeps them)."""
    work.mkdir(parents=True, exist_ok=True)
    g = torch.Generator(device=DEVICE).manual_seed(0)
    sums: dict[str, dict[str, int]] = {}
    with DataStatesEngine(config()) as e:
        for i, shape in enumerate(shapes()):
            w = torch.randn(shape, generator=g, device=DEVICE).to(torch.bfloat16)
            path = work / f"w{i:02d}.safetensors"
            sums[path.name] = e.save({"data": w}, path, exact_metadata=True, metadata={}).checksums()
        state = {
            str(i): {
                "step": torch.tensor(400.0),
                "exp_avg": torch.randn(shape, generator=g, device=DEVICE) * 1e-3,
                "exp_avg_sq": torch.rand(shape, generator=g, device=DEVICE) * 1e-6,
            }
            for i, shape in enumerate(shapes())
        }
        groups = [{"lr": 1e-4, "params": list(range(len(state)))}]
        e.save({"state": state, "param_groups": groups}, work / "opt.safetensors")
        e.wait_persisted()
    (work / "sums.json").write_text(json.dumps(sums))


def flat(x: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return {prefix: x}
    items = x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, (list, tuple)) else []
    out: dict[str, torch.Tensor] = {}
    for k, v in items:
        out.update(flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def differences(name: str, got: torch.Tensor, want: torch.Tensor) -> dict[str, Any] | None:
    a = got.reshape(-1).view(torch.uint8).to(DEVICE)
    b = want.reshape(-1).view(torch.uint8).to(DEVICE)
    bad = (a != b).nonzero().flatten()
    if bad.numel() == 0:
        return None
    lo, hi = int(bad[0]), int(bad[-1])
    return {
        "tensor": name,
        "bytes": a.numel(),
        "differing": bad.numel(),
        "first": lo,
        "last": hi,
        "got": a[lo : lo + 32].cpu().tolist(),
        "want": b[lo : lo + 32].cpu().tolist(),
    }


def build_model(params: list[torch.Tensor]) -> None:
    """Stands for Nanotron building the model: allocations, init kernels, frees, while the reads run, under
    Nanotron's own `init_on_device_and_dtype` where Nanotron is installed (it patches torch.empty & co.
    process-wide to force bf16: how the fp32 state read ahead once came back as bf16, NOTES step 16)."""
    try:
        from nanotron.models.base import init_on_device_and_dtype

        building = init_on_device_and_dtype(torch.device(DEVICE), torch.bfloat16)
    except ImportError:
        building = contextlib.nullcontext()
    with building:
        for shape in shapes():
            t = torch.empty(shape, device=DEVICE, dtype=torch.float32).normal_()
            params.append(t.to(torch.bfloat16))
            del t


def one_round(work: Path, verify: bool, reference: dict[str, torch.Tensor]) -> dict[str, Any]:
    sums = json.loads((work / "sums.json").read_text())
    weights = sorted(work.glob("w*.safetensors"))
    warnings: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    log = logging.getLogger("nanotron_datastates")
    handler = Catch(logging.WARNING)
    log.addHandler(handler)
    t0 = time.perf_counter()
    engine = DataStatesEngine(config(), verify_checksums=verify)
    try:
        ahead = Prefetch(
            engine,
            torch.device(DEVICE, 0 if DEVICE == "cuda" else None),
            weights,
            [work / "opt.safetensors"],
            lambda p: sums[p.name],
        )
        params: list[torch.Tensor] = []
        build_model(params)
        got = ahead.weights()

        def fill(i: int) -> None:  # as the trainer does: what was not read ahead is read the ordinary way
            if weights[i] in got:
                params[i].copy_(got[weights[i]]["data"])
            else:
                engine.load_into(weights[i], {"data": params[i]}, checksums=sums[weights[i].name])

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            list(pool.map(fill, range(len(params))))
        read_ahead = len(got)
        got.clear()
        state = ahead.optimizer([work / "opt.safetensors"])
        optimizer_read_ahead = state is not None
        if state is None:
            state = engine.load(work / "opt.safetensors", DEVICE)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        diffs = [differences(f"w{i:02d}", p, reference[f"w{i:02d}"]) for i, p in enumerate(params)]
        for name, t in flat(state).items():
            diffs.append(differences(name, t, reference[name]))
    finally:
        engine.close()
        log.removeHandler(handler)
    diffs = [d for d in diffs if d is not None]
    return {
        "verify": verify,
        "seconds": elapsed,
        "warnings": warnings,
        "weights_read_ahead": read_ahead,
        "optimizer_read_ahead": optimizer_read_ahead,
        "diffs": diffs,
    }


def child(work: Path, rounds: int, first: int) -> list[dict[str, Any]]:
    with DataStatesEngine(config()) as e:  # the reference, read through the host path (file mapping)
        reference = {k: v.to(DEVICE) for k, v in flat(e.load(work / "opt.safetensors")).items()}
        for i, p in enumerate(sorted(work.glob("w*.safetensors"))):
            reference[f"w{i:02d}"] = e.load(p)["data"].to(DEVICE)
    out = []
    for r in range(rounds):
        drop_caches()
        out.append(one_round(work, verify=(first + r) % 2 == 0, reference=reference))
    return out


def drop_caches() -> None:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        pass  # not root: the reads use O_DIRECT anyway


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--procs", type=int, default=6, help="fresh processes, one after another")
    ap.add_argument("--rounds", type=int, default=6, help="rounds per process, each with a fresh engine")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.work, args.rounds, args.child)))
        return
    if not (args.work / "sums.json").exists():
        make(args.work)
    results: list[dict[str, Any]] = []
    for p in range(args.procs):
        cmd = [sys.executable, __file__, "--work", str(args.work), "--out", str(args.out)]
        cmd += ["--rounds", str(args.rounds), "--child", str(p)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            results.append({"process": p, "failed": res.stderr[-3000:]})
            continue
        for r in json.loads(res.stdout.strip().splitlines()[-1]):
            results.append({"process": p, **r})
        mine = [
            (round(r["seconds"], 2), len(r["warnings"]), len(r["diffs"])) for r in results[-args.rounds :]
        ]
        print(f"process {p} (seconds, warnings, tensors differing): {mine}")
    summary = {
        "command": " ".join(sys.argv),
        "rounds": sum(1 for r in results if "seconds" in r),
        "rounds_with_warnings": sum(1 for r in results if r.get("warnings")),
        "rounds_with_differences": sum(1 for r in results if r.get("diffs")),
        "processes_failed": sum(1 for r in results if "failed" in r),
        "results": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "restore_stress.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "results"}))


if __name__ == "__main__":
    main()
