"""Engine benchmark: DataStatesEngine against torch.save, safetensors and dd, on one state, in one run.

What is measured (each `--repeat` times, after one warm-up save; medians and every value are kept):

* engine save to `--dir`: *blocking* time (``save`` + ``wait_snapshot``: what training stalls for), time to
  *persisted* (``save`` until ``wait_persisted`` returns: fsync'd, renamed, directory fsync'd) and throughput
  = file bytes / time to persisted;
* engine cold restore (page cache dropped, then ``engine.load``);
* baselines: ``torch.save`` + fsync, ``safetensors.torch.save_file`` + fsync (time until fsync returns), and
  the cold loads of those files with ``torch.load`` and ``safetensors.torch.load_file``. A load counts until
  its data is in memory: safetensors returns tensors that map the file, so one byte per page is touched
  (for every loader alike; the time until the call returned is kept too);
* DCP, as a user of ``torch.distributed.checkpoint`` would save the same state (one gloo process): its
  ``async_save`` with the default stager, and in its zero-overhead configuration (torch >= 2.9: a reused
  ``DefaultStager`` with shared-memory, asynchronous staging, the checkpoint process writing; pinned
  memory only where CUDA is there): *blocking* = the call plus the wait for its staging, *persisted* = until
  its upload completes (its writer fsyncs);
* ceilings: ``dd if=/dev/zero bs=64M oflag=direct`` with 1, 2 and 4 parallel streams (separate files; the
  best aggregate is the write ceiling, since the engine keeps several writes in flight), then a cold
  ``dd iflag=direct`` read of the same files;
* the engine saving to /dev/shm (tmpfs, fsync on): where the engine itself tops out, next to a dd to
  /dev/shm, since tmpfs writes cost the kernel a copy per byte;
* with CUDA: the same state on ``cuda:0``; blocking time and device-to-host throughput (bytes / snapshot
  time) against a plain ``copy_`` of every tensor into pinned host tensors, and cold restore to the GPU with
  the engine against ``safetensors.torch.load_file(..., device="cuda:0")``.

Goals, judged from the same run: persisted throughput >= 0.9x the dd write ceiling; blocking <= 0.1x
torch.save + fsync; cold restore >= 1.5x faster than safetensors (on CPU, and on cuda:0 too); (GPU) D2H
>= 0.8x the pinned copy. The exit status is 1 if a restore did not return the saved tensors.

Run (root, for drop_caches; otherwise cold reads fall back to per-file fadvise, or use --no-drop-caches)::

    python3 benchmarks/bench_engine.py                                   # 1 GiB, 3 repeats
    python3 benchmarks/bench_engine.py --size-gib 0.25 --repeat 1        # quick check
    python3 benchmarks/bench_engine.py --flush-threads 4 --flush-depth 16 --out /tmp/t.json

Results go to ``--out`` as JSON (host, versions, config, state, raw values, medians, ratios, verdicts); a

This file is the command line and the run's order; the measurements are `_engine_measure.py`, the CPU and GPU
runs of them `_engine_runs.py`, the summaries, goals and table `_engine_report.py`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _common import (
    REPO_ROOT,
    CacheDropper,
    GiB,
    command_info,
    describe_state,
    host_info,
    make_state,
    state_nbytes,
    write_json,
)
from _engine_measure import SHM_DIR, engine_save, remove
from _engine_report import failed_checks, print_report, summarize_cpu, summarize_gpu
from _engine_runs import run_cpu, run_cuda


def import_engine() -> Any:
    """The package, from PYTHONPATH or else from this checkout (so `python3 benchmarks/...` just works)."""
    try:
        import nanotron_datastates
    except ImportError:
        sys.path.insert(0, str(REPO_ROOT))
        import nanotron_datastates
    return nanotron_datastates


# -- command line ------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gib", type=float, default=1.0, help="state size (default 1.0)")
    p.add_argument("--repeat", type=int, default=3, help="repeats of every measurement (default 3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic state")
    p.add_argument(
        "--dir", help="where files go (default: a fresh directory under /work/benchscratch or /tmp)"
    )
    p.add_argument(
        "--out",
        help="JSON results (default: ./engine_cpu.json, or ./engine_gpu.json with a CUDA part)",
    )
    p.add_argument("--no-drop-caches", action="store_true", help="leave restores warm (e.g. not root)")
    p.add_argument("--skip-baselines", action="store_true", help="engine and dd only")
    p.add_argument("--device", choices=("cpu", "cuda", "both"), help="default: cpu, plus cuda if available")
    p.add_argument("--host-cache-gib", type=float, default=2.0, help="engine host cache, GiB (default 2)")
    p.add_argument("--parser-threads", type=int, help="engine copy/restore threads (default: the engine's)")
    p.add_argument("--flush-threads", type=int, help="engine flush workers (default: the engine's)")
    p.add_argument("--flush-depth", type=int, help="writes in flight per flush worker (default: engine)")
    p.add_argument("--queue-depth", type=int, help="reads in flight per parser thread (default: engine)")
    p.add_argument("--chunk-mib", type=int, help="engine cache chunk, MiB (default: the engine's)")
    p.add_argument("--read-mib", type=int, help="engine restore read size, MiB (default: the engine's)")
    args = p.parse_args(argv)
    if args.repeat < 1 or args.size_gib <= 0:
        p.error("--repeat must be >= 1 and --size-gib > 0")
    if args.device is None:
        args.device = "both" if torch.cuda.is_available() else "cpu"
    if args.device != "cpu" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: CUDA is not available here")
    if args.out is None:
        args.out = "engine_cpu.json" if args.device == "cpu" else "engine_gpu.json"
    return args


def make_workdir(requested: str | None) -> tuple[Path, bool]:
    """The directory for benchmark files and whether we created it (then we remove it at the end)."""
    if requested:
        path = Path(requested)
        created = not path.exists()
        path.mkdir(parents=True, exist_ok=True)
        return path, created
    base = "/work/benchscratch" if os.path.isdir("/work/benchscratch") else tempfile.gettempdir()
    return Path(tempfile.mkdtemp(prefix="bench_engine_", dir=base)), True


def check_space(path: Path, need: int, what: str) -> None:
    free = shutil.disk_usage(path).free
    if free < need:
        sys.exit(f"{what}: {free / GiB:.1f} GiB free at {path}, the benchmark needs {need / GiB:.1f} GiB")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    nds = import_engine()
    workdir, created = make_workdir(args.dir)
    nbytes_target = int(args.size_gib * GiB)
    check_space(workdir, 2 * nbytes_target + GiB, "disk")
    dropper = CacheDropper(enabled=not args.no_drop_caches)
    result: dict[str, Any] = {
        "benchmark": "bench_engine",
        "command": command_info(),
        "host": host_info([str(workdir), SHM_DIR]),
        "package_version": nds.__version__,
        "cache_drop": dropper.method,
        "workdir": str(workdir),
        "loadavg_start": os.getloadavg(),  # other work on the machine makes numbers noisy: say so
    }
    fs = result["host"]["filesystems"][str(workdir)]["fs_type"]
    if fs in ("tmpfs", "overlay", "ramfs"):
        print(f"warning: {workdir} is on {fs}: disk numbers will not be disk numbers; pass --dir", flush=True)
    print(f"building a {args.size_gib} GiB state (seed {args.seed}) ...", flush=True)
    state = make_state(nbytes_target, seed=args.seed)
    nbytes = state_nbytes(state)
    result["state"] = describe_state(state, args.seed)

    knobs = {
        "host_cache_size": args.host_cache_gib,
        "parser_threads": args.parser_threads,
        "flush_threads": args.flush_threads,
        "flush_depth": args.flush_depth,
        "queue_depth": args.queue_depth,
        "chunk_size": args.chunk_mib,
        "read_size": args.read_mib,
    }
    config = nds.DataStatesConfig(**{k: v for k, v in knobs.items() if v is not None})
    t0 = time.perf_counter()
    engine = nds.DataStatesEngine(config)
    init_s = time.perf_counter() - t0
    engine.prepare_cache()  # steady state: the background preparation of the cache is done
    result["engine"] = {
        "config": config.to_dict(),
        "init_s": init_s,
        "prepare_cache_s": time.perf_counter() - t0 - init_s,
        "io_backend": engine.io_backend,
        "pinned": engine.pinned,
    }
    try:
        # Warm-up: the first save pays one-off costs (thread start, first touch of file-system paths).
        warm = workdir / "warmup.safetensors"
        result["engine"]["warmup_save"] = engine_save(engine, state, warm)
        remove(warm)
        goals: list[dict] = []
        if args.device in ("cpu", "both"):
            raw = run_cpu(engine, state, workdir, args, dropper)
            med, derived, g = summarize_cpu(raw, nbytes)
            result["cpu"] = {"raw": raw, "summary": med, "derived": derived}
            goals += g
        if args.device in ("cuda", "both"):
            raw = run_cuda(engine, state, workdir, args, dropper)
            med, derived, g = summarize_gpu(raw, nbytes)
            result["cuda"] = {"raw": raw, "summary": med, "derived": derived}
            goals += g
        result["goals"] = goals
    finally:
        engine.close()
        if created:
            shutil.rmtree(workdir, ignore_errors=True)
    result["loadavg_end"] = os.getloadavg()
    write_json(args.out, result)
    print_report(result)
    print(f"\nresults: {args.out}")
    bad = failed_checks(result)
    if bad:
        print(f"DATA MISMATCH: a restore did not return the saved tensors ({', '.join(bad)})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
