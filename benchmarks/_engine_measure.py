"""bench_engine.py's measurements, each one repeat's raw values: the engine's save (blocking, persisted),
DCP's async_save in one gloo process, torch.save and safetensors with fsync, cold loads in a fresh process,
dd's O_DIRECT ceilings and its write to /dev/shm, and a pinned copy_ from the GPU.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _common import REPO_ROOT, CacheDropper, MiB, fsync_path, gbps

DD_BLOCK = 64 * MiB
DD_STREAMS = (1, 2, 4)
SHM_DIR = "/dev/shm"
WAIT_TIMEOUT_S = 900.0  # a save that takes longer is a hang to report, not a number to wait for


def remove(*paths: str | Path) -> None:
    for p in paths:
        Path(p).unlink(missing_ok=True)
    os.sync()  # the next timed write should not share the disk with this one's writeback or discards


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
    values. The zero-overhead stager is made once and reused, as torchtitan does (see _bench_baselines.py's
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
            from _bench_baselines import dcp_zero_overhead_stager

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
