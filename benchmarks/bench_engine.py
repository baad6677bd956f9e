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
table is printed at the end. Throughputs are in GB/s (1e9 bytes/s), as dd prints them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
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
    MiB,
    command_info,
    describe_state,
    format_table,
    fsync_path,
    gbps,
    host_info,
    make_state,
    state_nbytes,
    summarize,
    write_json,
)

DD_BLOCK = 64 * MiB
DD_STREAMS = (1, 2, 4)
SHM_DIR = "/dev/shm"
WAIT_TIMEOUT_S = 900.0  # a save that takes longer is a hang to report, not a number to wait for

# Goals from the issue: name -> (threshold, direction). "min": value must be >= threshold, "max": <=.
GOALS = {
    "persisted_vs_dd_write": (0.9, "min"),
    "blocking_vs_torch_save": (0.1, "max"),
    "restore_speedup_vs_safetensors": (1.5, "min"),
    "gpu_d2h_vs_pinned_copy": (0.8, "min"),
    "gpu_restore_speedup_vs_safetensors": (1.5, "min"),  # the restore goal, applied to cuda:0 as well
}


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


def remove(*paths: str | Path) -> None:
    for p in paths:
        Path(p).unlink(missing_ok=True)
    os.sync()  # the next timed write should not share the disk with this one's writeback or discards


# -- measurements: each returns one repeat's raw values ----------------------------------------------------


def engine_save(
    engine: Any, state: dict[str, torch.Tensor], path: Path, cuda: bool = False
) -> dict[str, Any]:
    engine.cache_stats(reset=True)
    if cuda:
        torch.cuda.synchronize()  # the state must be complete on the GPU before the clock starts
    t0 = time.perf_counter()
    handle = engine.save(state, path)
    handle.wait_snapshot(WAIT_TIMEOUT_S)
    t1 = time.perf_counter()
    handle.wait_persisted(WAIT_TIMEOUT_S)
    t2 = time.perf_counter()
    stats, cache = handle.stats, engine.cache_stats()
    return {
        "blocking_s": t1 - t0,
        "persisted_s": t2 - t0,
        "file_bytes": stats["file_bytes"],
        "engine_snapshot_s": stats["snapshot_s"],  # the engine's own clocks, from submission
        "engine_persisted_s": stats["persisted_s"],
        "direct_io": stats["direct_io"],
        "cache_wait_s": cache["wait_ns"] / 1e9,  # backpressure: copies waiting for a free chunk
        "cache_high_water_chunks": cache["high_water"],
    }


class DcpSaver:
    """DCP's `async_save` in one gloo process: `save(state, folder, zero_overhead)` returns one repeat's raw
    values. The zero-overhead stager is made once and reused, as torchtitan does (see bench_nanotron.py's
    `dcp_zero_overhead_stager` for torch 2.11's stager, which closes itself after each staging)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        os.environ.setdefault("DCP_USE_PREFIX_STORE", "1")
        self._own_group = not dist.is_initialized()
        if self._own_group:
            dist.init_process_group("gloo", rank=0, world_size=1)
        self._stager: Any = None

    def save(self, state: dict[str, torch.Tensor], folder: Path, zero_overhead: bool) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp

        shutil.rmtree(folder, ignore_errors=True)
        t0 = time.perf_counter()
        if not zero_overhead:
            future = dcp.async_save(state, checkpoint_id=str(folder))
            t_call = t_staged = time.perf_counter()
        else:
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

            response = dcp.async_save(
                state,
                checkpoint_id=str(folder),
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                async_stager=self.stager(),
            )
            t_call = time.perf_counter()
            response.staging_completion.result()
            t_staged = time.perf_counter()
            future = response.upload_completion
        future.result()
        t_done = time.perf_counter()
        return {"call_s": t_call - t0, "blocking_s": t_staged - t0, "persisted_s": t_done - t0}

    def stager(self) -> Any:
        if self._stager is None:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from bench_nanotron import dcp_zero_overhead_stager

            self._stager = dcp_zero_overhead_stager(pinned=torch.cuda.is_available())
        return self._stager

    def close(self) -> None:
        import torch.distributed as dist

        if self._stager is not None:
            self._stager.close()
        if self._own_group:
            dist.destroy_process_group()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_resident(state: dict[str, torch.Tensor]) -> None:
    """Reads one byte of every 4 KiB page: safetensors' default loader returns tensors that map the file, so
    its pages are read later, on first touch; a restore counts only once the data is in memory."""
    for t in state.values():
        if t.device.type == "cpu" and t.numel():
            t.reshape(-1).view(torch.uint8)[::4096].sum()


# A cold load is timed in a fresh process, as at a restart: in a long-lived process that has churned through
# gigabytes, this VM charges microseconds for the first touch of each page the kernel hands out (measured:
# 1 GiB of freshly read page cache took 1.7 s to touch once in such a process, 0.04 s in a fresh one),
# whichever loader touches it. The child loads, makes the data resident (CPU) or synchronizes (CUDA), and
# reports.
_PROBE = r"""
import json, sys, time
import torch
loader, path, device, knobs = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
t0 = time.perf_counter()
if loader == "engine":
    from nanotron_datastates import DataStatesConfig, DataStatesEngine
    engine = DataStatesEngine(DataStatesConfig(**knobs))
    load = lambda: engine.load(path, device=device)
elif loader == "safetensors":
    from safetensors.torch import load_file
    load = lambda: load_file(path, device=device)
else:
    load = lambda: torch.load(path, map_location=device, weights_only=True)
setup = time.perf_counter() - t0
t0 = time.perf_counter()
out = load()
returned = time.perf_counter() - t0
if device.startswith("cuda"):
    torch.cuda.synchronize()
else:
    for t in out.values():  # safetensors maps the file: its pages are read on first touch
        if t.numel():
            t.reshape(-1).view(torch.uint8)[::4096].sum()
print(json.dumps({"total": time.perf_counter() - t0, "returned": returned, "setup": setup}))
"""


def cold_load(
    raw: dict[str, list[Any]],
    key: str,
    loader: str,
    path: Path,
    dropper: CacheDropper,
    device: str = "cpu",
    knobs: dict[str, Any] | None = None,
) -> None:
    """Drops the page cache for `path`, loads it with `loader` (engine, safetensors, torch) in a fresh process
    and appends the time until the data is resident or on the device to raw[key]; the time until the call
    returned goes to raw[key + "_returned"], the loader's start-up (the engine's cache) to
    raw[key + "_setup"].
    """
    dropper.drop([path])
    argv = [sys.executable, "-c", _PROBE, loader, str(path), device, json.dumps(knobs or {})]
    r = subprocess.run(argv, capture_output=True, text=True, cwd=REPO_ROOT)
    if r.returncode != 0:
        raise RuntimeError(f"{loader} load of {path} failed:\n{r.stderr[-4000:]}")
    times = json.loads(r.stdout.strip().splitlines()[-1])
    raw.setdefault(key, []).append(times["total"])
    raw.setdefault(key + "_returned", []).append(times["returned"])
    raw.setdefault(key + "_setup", []).append(times["setup"])


def restore_knobs(engine: Any) -> dict[str, Any]:
    """The benchmarked engine's config for a restore-only engine: a small cache is enough to restore."""
    return {**engine.config.to_dict(), "host_cache_size": 0.25}


def torch_save_fsync(state: dict[str, torch.Tensor], path: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    torch.save(state, path)
    fsync_path(path)
    return {"persisted_s": time.perf_counter() - t0, "file_bytes": path.stat().st_size}


def safetensors_save_fsync(state: dict[str, torch.Tensor], path: Path) -> dict[str, Any]:
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    save_file(state, str(path))
    fsync_path(path)
    return {"persisted_s": time.perf_counter() - t0, "file_bytes": path.stat().st_size}


def run_dd(cmds: list[list[str]]) -> dict[str, Any]:
    """Runs dd commands in parallel; aggregate = all bytes / wall time from first start to last exit."""
    env = {**os.environ, "LC_ALL": "C"}  # dd's summary line in a parseable locale
    t0 = time.perf_counter()
    procs = [subprocess.Popen(c, stderr=subprocess.PIPE, text=True, env=env) for c in cmds]
    errs = [p.communicate()[1] for p in procs]
    wall = time.perf_counter() - t0
    total, own = 0, []
    for cmd, proc, err in zip(cmds, procs, errs):
        m = re.search(r"^(\d+) bytes .* copied, ([\d.]+) s", err, re.MULTILINE)
        if proc.returncode != 0 or not m:
            raise RuntimeError(f"{' '.join(cmd)} failed (rc {proc.returncode}): {err.strip()}")
        total += int(m.group(1))
        own.append(float(m.group(2)))
    return {"bytes": total, "wall_s": wall, "dd_reported_s": own, "gbps": gbps(total, wall)}


def dd_write_read(workdir: Path, nbytes: int, streams: int, dropper: CacheDropper) -> dict[str, Any]:
    """O_DIRECT write of ~nbytes split over `streams` fresh files, then a cold O_DIRECT read of them."""
    blocks = -(-nbytes // DD_BLOCK)
    per_stream = [blocks // streams + (i < blocks % streams) for i in range(streams)]
    files = [workdir / f"dd_{streams}_{i}" for i in range(streams) if per_stream[i]]
    bs = f"bs={DD_BLOCK // MiB}M"
    write = run_dd(
        [
            ["dd", "if=/dev/zero", f"of={f}", bs, f"count={n}", "oflag=direct"]
            for f, n in zip(files, per_stream)
        ]
    )
    dropper.drop(files)
    read = run_dd([["dd", f"if={f}", "of=/dev/null", bs, "iflag=direct"] for f in files])
    remove(*files)
    return {"streams": streams, "write": write, "read": read}


def dd_shm_write(shm: Path, nbytes: int) -> dict[str, Any]:
    """tmpfs has no disk: a write there costs the kernel's page allocation and copy, which is the bound the
    engine's /dev/shm number has to be read against (buffered, then fsync, as the engine does)."""
    path = shm / "dd"
    blocks = -(-nbytes // DD_BLOCK)
    out = run_dd(
        [["dd", "if=/dev/zero", f"of={path}", f"bs={DD_BLOCK // MiB}M", f"count={blocks}", "conv=fsync"]]
    )
    remove(path)
    return out


def pinned_copy(state: dict[str, torch.Tensor], dests: list[torch.Tensor]) -> float:
    """Seconds to copy_ every GPU tensor into its pinned host twin: the D2H bound without the engine."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for dst, src in zip(dests, state.values()):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k].to(a[k].device)) for k in a)


# -- the run -----------------------------------------------------------------------------------------------


def run_cpu(
    engine: Any,
    state: dict[str, torch.Tensor],
    workdir: Path,
    args: argparse.Namespace,
    dropper: CacheDropper,
) -> dict[str, list[Any]]:
    """Every CPU-side measurement, interleaved per repeat so that drift in the machine hits all alike: first
    the saves (each format's last file is kept), then the cold loads of those files, one loader after another.
    """

    nbytes = state_nbytes(state)
    keys = ("engine_save", "engine_shm_save", "dd_shm_write", "dd", "verified")
    raw: dict[str, list[Any]] = {k: [] for k in keys}
    if not args.skip_baselines:
        raw.update({k: [] for k in ("torch_save", "safetensors_save", "dcp_save", "dcp_zo_save")})
    shm = Path(tempfile.mkdtemp(prefix="bench_engine_", dir=SHM_DIR)) if shm_fits(nbytes) else None
    dcp = DcpSaver() if not args.skip_baselines else None
    try:
        for r in range(args.repeat):
            print(f"repeat {r + 1}/{args.repeat}: engine", flush=True)
            path = workdir / "engine.safetensors"
            raw["engine_save"].append(engine_save(engine, state, path))
            if r == 0:
                raw["verified"].append({"engine_cpu_roundtrip": same_tensors(state, engine.load(path))})

            if shm is not None:
                raw["engine_shm_save"].append(engine_save(engine, state, shm / "engine.safetensors"))
                remove(shm / "engine.safetensors")
                raw["dd_shm_write"].append(dd_shm_write(shm, nbytes))

            if not args.skip_baselines:
                print(f"repeat {r + 1}/{args.repeat}: torch, safetensors", flush=True)
                raw["torch_save"].append(torch_save_fsync(state, workdir / "torch.pt"))
                st_path = workdir / "safetensors.safetensors"
                raw["safetensors_save"].append(safetensors_save_fsync(state, st_path))
            if dcp is not None:
                print(f"repeat {r + 1}/{args.repeat}: DCP async_save, default and zero-overhead", flush=True)
                raw["dcp_save"].append(dcp.save(state, workdir / "dcp", zero_overhead=False))
                raw["dcp_zo_save"].append(dcp.save(state, workdir / "dcp", zero_overhead=True))
                shutil.rmtree(workdir / "dcp", ignore_errors=True)

            print(f"repeat {r + 1}/{args.repeat}: dd", flush=True)
            raw["dd"].append([dd_write_read(workdir, nbytes, s, dropper) for s in DD_STREAMS])

        loads = [("engine_restore_s", "engine", workdir / "engine.safetensors", restore_knobs(engine))]
        if not args.skip_baselines:
            loads += [
                ("safetensors_load_s", "safetensors", workdir / "safetensors.safetensors", None),
                ("torch_load_s", "torch", workdir / "torch.pt", None),
            ]
        for r in range(args.repeat):
            print(f"repeat {r + 1}/{args.repeat}: cold loads", flush=True)
            for key, loader, path, knobs in loads:
                cold_load(raw, key, loader, path, dropper, knobs=knobs)
        remove(*(path for _, _, path, _ in loads))
    finally:
        if shm is not None:
            shutil.rmtree(shm, ignore_errors=True)
        if dcp is not None:
            dcp.close()
    if shm is None:
        raw["shm_skipped"] = f"not enough free space in {SHM_DIR}"
    return raw


def shm_fits(nbytes: int) -> bool:
    return os.path.isdir(SHM_DIR) and shutil.disk_usage(SHM_DIR).free > 1.5 * nbytes + GiB


def run_cuda(
    engine: Any,
    state: dict[str, torch.Tensor],
    workdir: Path,
    args: argparse.Namespace,
    dropper: CacheDropper,
) -> dict[str, list[Any]]:
    """The GPU part: D2H snapshot against pinned copy_, and cold restores onto the GPU."""

    dev = "cuda:0"
    gstate = {k: v.to(dev) for k, v in state.items()}
    dests = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in gstate.values()]
    path = workdir / "engine_gpu.safetensors"
    engine_save(engine, gstate, path, cuda=True)  # warm-up: CUDA streams, events, first pinned transfers
    pinned_copy(gstate, dests)
    remove(path)
    raw: dict[str, list[Any]] = {"engine_save": [], "pinned_copy_s": [], "verified": []}
    for r in range(args.repeat):
        print(f"repeat {r + 1}/{args.repeat}: cuda", flush=True)
        raw["engine_save"].append(engine_save(engine, gstate, path, cuda=True))
        raw["pinned_copy_s"].append(pinned_copy(gstate, dests))
        cold_load(raw, "engine_restore_s", "engine", path, dropper, dev, restore_knobs(engine))
        if r == 0:
            raw["verified"].append(
                {"engine_gpu_roundtrip": same_tensors(gstate, engine.load(path, device=dev))}
            )
        if not args.skip_baselines:
            cold_load(raw, "safetensors_load_s", "safetensors", path, dropper, dev)
        remove(path)
    del gstate, dests
    torch.cuda.empty_cache()
    return raw


# -- results -----------------------------------------------------------------------------------------------


def goal(name: str, value: float | None, detail: str) -> dict[str, Any]:
    threshold, direction = GOALS[name]
    if value is None:
        verdict = "SKIPPED"
    elif direction == "min":
        verdict = "PASS" if value >= threshold else "FAIL"
    else:
        verdict = "PASS" if value <= threshold else "FAIL"
    return {
        "name": name,
        "value": value,
        "threshold": threshold,
        "direction": direction,
        "verdict": verdict,
        "detail": detail,
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize_cpu(raw: dict[str, Any], nbytes: int) -> tuple[dict[str, Any], dict[str, Any], list[dict]]:
    """Medians per measurement, derived throughputs and ratios, and the CPU goal verdicts."""
    med: dict[str, Any] = {}

    def field(key: str, name: str) -> list[float]:
        return [x[name] for x in raw.get(key, [])]

    med["engine_blocking_s"] = summarize(field("engine_save", "blocking_s"))
    med["engine_persisted_s"] = summarize(field("engine_save", "persisted_s"))
    med["engine_shm_blocking_s"] = summarize(field("engine_shm_save", "blocking_s"))
    med["engine_shm_persisted_s"] = summarize(field("engine_shm_save", "persisted_s"))
    for key in ("torch", "safetensors"):
        med[f"{key}_save_fsync_s"] = summarize(field(f"{key}_save", "persisted_s"))
    for key in ("dcp", "dcp_zo"):
        med[f"{key}_blocking_s"] = summarize(field(f"{key}_save", "blocking_s"))
        med[f"{key}_persisted_s"] = summarize(field(f"{key}_save", "persisted_s"))
    for key in ("engine_restore_s", "torch_load_s", "safetensors_load_s"):
        med[key] = summarize(raw.get(key, []))
        med[key + "_returned"] = summarize(raw.get(key + "_returned", []))
    med["dd_shm_write_gbps"] = summarize([x["gbps"] for x in raw["dd_shm_write"]])
    for i, streams in enumerate(DD_STREAMS):
        for op in ("write", "read"):
            med[f"dd_{op}_{streams}x_gbps"] = summarize([rep[i][op]["gbps"] for rep in raw["dd"]])

    file_bytes = raw["engine_save"][0]["file_bytes"] if raw["engine_save"] else nbytes
    m = {k: v["median"] for k, v in med.items()}
    write_ceiling = max(m[f"dd_write_{s}x_gbps"] for s in DD_STREAMS)
    read_ceiling = max(m[f"dd_read_{s}x_gbps"] for s in DD_STREAMS)
    persisted_gbps = gbps(file_bytes, m["engine_persisted_s"])
    restore_gbps = gbps(file_bytes, m["engine_restore_s"])
    derived = {
        "engine_file_bytes": file_bytes,
        "engine_persisted_gbps": persisted_gbps,
        "engine_snapshot_gbps": gbps(nbytes, m["engine_blocking_s"]),
        "engine_restore_gbps": restore_gbps,
        "engine_shm_persisted_gbps": gbps(file_bytes, m["engine_shm_persisted_s"]),
        "engine_shm_vs_dd_shm_write": ratio(
            gbps(file_bytes, m["engine_shm_persisted_s"]), m["dd_shm_write_gbps"]
        ),
        "torch_save_fsync_gbps": gbps(nbytes, m["torch_save_fsync_s"]),
        "safetensors_save_fsync_gbps": gbps(nbytes, m["safetensors_save_fsync_s"]),
        "torch_load_gbps": gbps(nbytes, m["torch_load_s"]),
        "safetensors_load_gbps": gbps(nbytes, m["safetensors_load_s"]),
        "dd_write_ceiling_gbps": write_ceiling,
        "dd_read_ceiling_gbps": read_ceiling,
        "persisted_vs_dd_write": ratio(persisted_gbps, write_ceiling),
        "restore_vs_dd_read": ratio(restore_gbps, read_ceiling),
        "blocking_vs_torch_save": ratio(m["engine_blocking_s"], m["torch_save_fsync_s"]),
        "blocking_vs_safetensors_save": ratio(m["engine_blocking_s"], m["safetensors_save_fsync_s"]),
        "persisted_speedup_vs_torch_save": ratio(m["torch_save_fsync_s"], m["engine_persisted_s"]),
        "restore_speedup_vs_safetensors": ratio(m["safetensors_load_s"], m["engine_restore_s"]),
        "restore_speedup_vs_torch_load": ratio(m["torch_load_s"], m["engine_restore_s"]),
        "blocking_vs_dcp_zo": ratio(m["engine_blocking_s"], m["dcp_zo_blocking_s"]),
        "persisted_speedup_vs_dcp_zo": ratio(m["dcp_zo_persisted_s"], m["engine_persisted_s"]),
    }
    goals = [
        goal(
            "persisted_vs_dd_write",
            derived["persisted_vs_dd_write"],
            f"engine {fmt_rate(persisted_gbps)} vs dd O_DIRECT write ceiling {fmt_rate(write_ceiling)}",
        ),
        goal(
            "blocking_vs_torch_save",
            derived["blocking_vs_torch_save"],
            f"engine {fmt_s(m['engine_blocking_s'])} vs torch.save+fsync {fmt_s(m['torch_save_fsync_s'])}",
        ),
        goal(
            "restore_speedup_vs_safetensors",
            derived["restore_speedup_vs_safetensors"],
            f"engine {fmt_s(m['engine_restore_s'])} vs safetensors {fmt_s(m['safetensors_load_s'])}",
        ),
    ]
    return med, derived, goals


def summarize_gpu(raw: dict[str, Any], nbytes: int) -> tuple[dict[str, Any], dict[str, Any], list[dict]]:
    med = {
        "engine_blocking_s": summarize([x["blocking_s"] for x in raw["engine_save"]]),
        "engine_snapshot_s": summarize([x["engine_snapshot_s"] for x in raw["engine_save"]]),
        "engine_persisted_s": summarize([x["persisted_s"] for x in raw["engine_save"]]),
        "pinned_copy_s": summarize(raw["pinned_copy_s"]),
        "engine_restore_s": summarize(raw["engine_restore_s"]),
        "safetensors_load_s": summarize(raw.get("safetensors_load_s", [])),
        "safetensors_load_s_returned": summarize(raw.get("safetensors_load_s_returned", [])),
    }
    m = {k: v["median"] for k, v in med.items()}
    d2h, pinned = gbps(nbytes, m["engine_snapshot_s"]), gbps(nbytes, m["pinned_copy_s"])
    derived = {
        "engine_d2h_gbps": d2h,
        "engine_blocking_gbps": gbps(nbytes, m["engine_blocking_s"]),
        "pinned_copy_gbps": pinned,
        "engine_persisted_gbps": gbps(nbytes, m["engine_persisted_s"]),
        "engine_restore_gbps": gbps(nbytes, m["engine_restore_s"]),
        "safetensors_load_gbps": gbps(nbytes, m["safetensors_load_s"]),
        "gpu_d2h_vs_pinned_copy": ratio(d2h, pinned),
        "restore_speedup_vs_safetensors": ratio(m["safetensors_load_s"], m["engine_restore_s"]),
    }
    goals = [
        goal(
            "gpu_d2h_vs_pinned_copy",
            derived["gpu_d2h_vs_pinned_copy"],
            f"engine D2H {fmt_rate(d2h)} (snapshot {fmt_s(m['engine_snapshot_s'])}) vs pinned copy_ "
            f"{fmt_rate(pinned)}",
        ),
        goal(
            "gpu_restore_speedup_vs_safetensors",
            derived["restore_speedup_vs_safetensors"],
            f"engine {fmt_s(m['engine_restore_s'])} vs safetensors {fmt_s(m['safetensors_load_s'])}",
        ),
    ]
    return med, derived, goals


def fmt_s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f} s"


def fmt_rate(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} GB/s"


def fmt_row(label: str, s: dict[str, Any], nbytes: int) -> list[str]:
    """One table row: median seconds, every value, and the throughput of the median."""
    if not s["n"]:
        return [label, "-", "-", "-"]
    values = " ".join(f"{v:.3f}" for v in s["values"])
    return [label, f"{s['median']:.3f}", values, fmt_rate(gbps(nbytes, s["median"]))]


def print_report(result: dict[str, Any]) -> None:
    nbytes = result["state"]["total_bytes"]
    rows: list[list[str]] = []
    cpu = result.get("cpu")
    if cpu:
        med = cpu["summary"]
        labels = {
            "engine_blocking_s": "engine blocking (save+wait_snapshot)",
            "engine_persisted_s": "engine save -> persisted",
            "engine_restore_s": "engine cold restore",
            "engine_shm_persisted_s": "engine -> /dev/shm persisted",
            "torch_save_fsync_s": "torch.save + fsync",
            "safetensors_save_fsync_s": "safetensors save_file + fsync",
            "dcp_blocking_s": "DCP async_save: blocking",
            "dcp_persisted_s": "DCP async_save: persisted",
            "dcp_zo_blocking_s": "DCP zero-overhead: blocking (staged)",
            "dcp_zo_persisted_s": "DCP zero-overhead: persisted",
            "torch_load_s": "torch.load (cold)",
            "safetensors_load_s": "safetensors load_file (cold, resident)",
            "safetensors_load_s_returned": "  of which until load_file returned",
        }
        rows += [fmt_row(label, med[k], nbytes) for k, label in labels.items()]
        dd_rows = {
            f"dd_{op}_{n}x_gbps": f"dd O_DIRECT {op}, {n} stream(s)"
            for op in ("write", "read")
            for n in DD_STREAMS
        }
        dd_rows["dd_shm_write_gbps"] = "dd to /dev/shm (buffered + fsync)"
        for key, label in dd_rows.items():
            values = " ".join(f"{v:.2f}" for v in med[key]["values"])
            rows.append([label, "", f"GB/s: {values}", fmt_rate(med[key]["median"])])
    gpu = result.get("cuda")
    if gpu:
        med = gpu["summary"]
        labels = {
            "engine_blocking_s": "cuda: engine blocking",
            "engine_snapshot_s": "cuda: engine snapshot (D2H)",
            "pinned_copy_s": "cuda: pinned copy_ (D2H)",
            "engine_persisted_s": "cuda: engine save -> persisted",
            "engine_restore_s": "cuda: engine cold restore",
            "safetensors_load_s": "cuda: safetensors load_file (cold)",
        }
        rows += [fmt_row(label, med[k], nbytes) for k, label in labels.items()]
    drop = result["cache_drop"]
    restores = f"cold ({drop})" if drop != "none" else "WARM (--no-drop-caches)"
    print()
    print(
        f"state: {result['state']['n_tensors']} tensors, {nbytes / GiB:.3f} GiB; "
        f"restores: {restores}; engine io: {result['engine']['io_backend']}; "
        f"load average {result['loadavg_start'][0]:.1f} -> {result['loadavg_end'][0]:.1f}"
    )
    print(format_table(["measurement", "median s", "values", "rate (median)"], rows))
    print()
    goal_rows = [
        [
            g["name"],
            g["verdict"],
            "-" if g["value"] is None else f"{g['value']:.3f}",
            f"{'>=' if g['direction'] == 'min' else '<='} {g['threshold']}",
            g["detail"],
        ]
        for g in result["goals"]
    ]
    print(format_table(["goal", "verdict", "value", "target", "detail"], goal_rows))


def failed_checks(result: dict[str, Any]) -> list[str]:
    """Names of the round-trip checks (restored == saved) that failed."""
    bad = []
    for part in ("cpu", "cuda"):
        for checks in result.get(part, {}).get("raw", {}).get("verified", []):
            bad += [name for name, ok in checks.items() if not ok]
    return bad


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
