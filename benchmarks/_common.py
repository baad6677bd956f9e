"""Helpers shared by the benchmarks: the synthetic state, cold-cache control, timing summaries, host facts.

Kept free of engine imports so that a benchmark can describe the machine even when the engine fails to load.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import random
import shlex
import socket
import statistics
import sys
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
REPO_ROOT = Path(__file__).resolve().parent.parent


def gbps(nbytes: float, seconds: float | None) -> float | None:
    """Throughput in GB/s (1e9 bytes per second, as dd prints it)."""
    if not seconds or seconds <= 0:
        return None
    return nbytes / seconds / 1e9


def summarize(values: Sequence[float]) -> dict[str, Any]:
    """Median, spread and every value, so that a noisy run shows as one."""
    vals = [float(v) for v in values]
    if not vals:
        return {"n": 0, "median": None, "min": None, "max": None, "values": []}
    return {
        "n": len(vals),
        "median": statistics.median(vals),
        "min": min(vals),
        "max": max(vals),
        "values": vals,
    }


# -- the synthetic state -----------------------------------------------------------------------------------


def make_state(
    total_bytes: int,
    *,
    seed: int = 0,
    min_bytes: int = 64 * KiB,
    max_bytes: int = 64 * MiB,
    bf16_fraction: float = 0.25,
) -> dict[str, torch.Tensor]:
    """A deterministic dict of random tensors, sizes log-uniform in [min_bytes, max_bytes], ~total_bytes.

    Random values rather than zeros: nothing in the path (page cache, disk, checksums) may get them for free.
    Shapes mix widths that are and are not powers of two, so tensor ends fall off 4 KiB boundaries.
    """
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    lo, hi = math.log(min_bytes), math.log(max_bytes)
    state: dict[str, torch.Tensor] = {}
    left = total_bytes
    while left >= min_bytes:
        nbytes = min(int(math.exp(rng.uniform(lo, hi))), left)
        if left - nbytes < min_bytes and left <= max_bytes:
            nbytes = left  # no runt below min_bytes at the end
        dtype = torch.bfloat16 if rng.random() < bf16_fraction else torch.float32
        numel = nbytes // dtype.itemsize
        cols = rng.choice((1, 768, 1000, 1024, 4096))
        shape = (numel,) if cols == 1 else (numel // cols, cols)
        tensor = torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
        state[f"layer{len(state):03d}.{'bf16' if dtype == torch.bfloat16 else 'fp32'}"] = tensor
        left -= tensor.numel() * tensor.element_size()
    return state


def state_nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def describe_state(state: dict[str, torch.Tensor], seed: int) -> dict[str, Any]:
    sizes = [t.numel() * t.element_size() for t in state.values()]
    by_dtype: dict[str, dict[str, int]] = {}
    for t, n in zip(state.values(), sizes):
        d = by_dtype.setdefault(str(t.dtype).replace("torch.", ""), {"tensors": 0, "bytes": 0})
        d["tensors"] += 1
        d["bytes"] += n
    return {
        "n_tensors": len(sizes),
        "total_bytes": sum(sizes),
        "total_gib": sum(sizes) / GiB,
        "min_tensor_bytes": min(sizes),
        "median_tensor_bytes": int(statistics.median(sizes)),
        "max_tensor_bytes": max(sizes),
        "by_dtype": by_dtype,
        "seed": seed,
        "generator": "log-uniform sizes, torch.randn values (benchmarks/_common.py:make_state)",
    }


# -- durability and cold caches ----------------------------------------------------------------------------


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file written by someone else (torch.save, safetensors): Linux flushes it through any fd."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CacheDropper:
    """Makes the next read of some files cold.

    'drop_caches' (root) empties the whole page cache; 'fadvise' (anyone) evicts just the given files, which
    works for clean pages, hence the sync first; 'none' leaves reads warm (and the results say so).
    """

    def __init__(self, enabled: bool = True) -> None:
        if not enabled:
            self.method = "none"
        elif os.access("/proc/sys/vm/drop_caches", os.W_OK):
            self.method = "drop_caches"
        else:
            self.method = "fadvise"

    @property
    def cold(self) -> bool:
        return self.method != "none"

    def drop(self, paths: Iterable[str | os.PathLike] = ()) -> None:
        if self.method == "none":
            return
        os.sync()
        if self.method == "drop_caches":
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            return
        evict(paths)


def evict(paths: Iterable[str | os.PathLike]) -> None:
    """Drops the clean page-cache pages of these files (no privilege needed; sync first for dirty ones)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_bytes(paths: Iterable[str | os.PathLike]) -> int:
    """Bytes of these files in the page cache (mincore over a mapping of each; no privilege needed)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    page, total = mmap.PAGESIZE, 0
    for p in paths:
        size = os.path.getsize(p)
        if size == 0:
            continue
        fd = os.open(p, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap of {p}")
            try:
                vec = ctypes.create_string_buffer((size + page - 1) // page)
                if libc.mincore(addr, size, vec) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore of {p}")
                pages = sum(b & 1 for b in vec.raw)
                total += min(pages * page, size)
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
    return total


# -- the host ----------------------------------------------------------------------------------------------


def _first_match(path: str, key: str) -> str | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _mount_of(path: str) -> dict[str, str]:
    """The mount (device, type) that holds `path`: the longest mount point that prefixes it."""
    real = os.path.realpath(path)
    best = {"mount_point": "", "device": "?", "fs_type": "?"}
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype = line.split()[:3]
                inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best["mount_point"]):
                    best = {"mount_point": mnt, "device": dev, "fs_type": fstype}
    except OSError:
        pass
    return best


def _repo_commit() -> str | None:
    # DATASTATES_REPO_COMMIT where the tree was copied without its .git (a GPU machine's copy: its .git,
    # where there is one, can be older than the tree); else read .git directly: benchmarks must not depend
    # on (or run) git.
    if os.environ.get("DATASTATES_REPO_COMMIT"):
        return os.environ["DATASTATES_REPO_COMMIT"]
    git = REPO_ROOT / ".git"
    try:
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head
        ref = head[5:]
        if (git / ref).exists():
            return (git / ref).read_text().strip()
        for line in (git / "packed-refs").read_text().splitlines():
            if line.endswith(" " + ref):
                return line.split()[0]
    except OSError:
        pass
    return None


def command_info() -> dict[str, Any]:
    """The command as run, and a line that re-runs it from any shell."""
    cwd = os.getcwd()
    pythonpath = os.environ.get("PYTHONPATH")
    env = f"PYTHONPATH={shlex.quote(pythonpath)} " if pythonpath else ""
    return {
        "argv": list(sys.argv),
        "cwd": cwd,
        "python": sys.executable,
        "pythonpath": pythonpath,
        "command_line": f"cd {shlex.quote(cwd)} && {env}{shlex.join([sys.executable, *sys.argv])}",
    }


def host_info(dirs: Sequence[str]) -> dict[str, Any]:
    mem_kib = _first_match("/proc/meminfo", "MemTotal")
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "kernel": platform.release(),
        "cpu_model": _first_match("/proc/cpuinfo", "model name"),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "mem_total_gib": int(mem_kib.split()[0]) / (1 << 20) if mem_kib else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "repo_commit": _repo_commit(),
        "filesystems": {d: _mount_of(d) for d in dirs},
        "gpu": None,
    }
    try:
        import safetensors

        info["safetensors"] = safetensors.__version__
    except ImportError:
        info["safetensors"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = {
            "name": props.name,
            "count": torch.cuda.device_count(),
            "memory_gib": props.total_memory / GiB,
            "cuda": torch.version.cuda,
        }
    return info


# -- output ------------------------------------------------------------------------------------------------


def write_json(path: str | os.PathLike, obj: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned first column, right-aligned others: readable in a terminal and in a PR comment."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]

    def line(r: Sequence[str]) -> str:
        cells = [str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths))]
        return "  ".join(cells).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])
