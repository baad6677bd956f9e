"""What filling a kept staging buffer costs the thread that launches it (GPU), by way of copying: the state of
the trainer's checkpoint (`bench_staging.llama_files`: one bf16 weight a file, Adam's moments, steps and fp32
master weights) copied into one buffer per dtype, as the kept staging does (save/stage.py).

    python3 benchmarks/micro/bench_staging_launches.py --out DIR [--models 180m,1b --repeat 11]

Ways: `torch._foreach_copy_` per dtype (the package's), `torch.cat(flat views, out=buffer)` per dtype, a
`copy_` per tensor, and the driver's `cuMemcpyBatchAsync` over every tensor at once (on a side stream: it
refuses the legacy default stream), where the driver has it. For each: the launching thread's time with the
GPU idle (medians of `--repeat`), the GPU's time (events) and the kernels launched (torch.profiler); every
way's copies are checked equal to their sources. Writes DIR/bench_staging_launches.json.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the helpers in benchmarks/
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import command_info  # noqa: E402
from bench_staging import _tensors, llama_files  # noqa: E402


class _Location(ctypes.Structure):  # CUmemLocation
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Attributes(ctypes.Structure):  # CUmemcpyAttributes
    _fields_ = [("order", ctypes.c_int), ("src", _Location), ("dst", _Location), ("flags", ctypes.c_uint)]


def batch_copy(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> Callable[[], None] | None:
    """One `cuMemcpyBatchAsync` call copying every src into its dst, ordered after the current stream's
    work and before its later work; None where the driver has no such call."""
    lib = ctypes.CDLL("libcuda.so.1")
    v2 = hasattr(lib, "cuMemcpyBatchAsync_v2")  # CUDA 13's signature: no failIdx
    if not v2 and not hasattr(lib, "cuMemcpyBatchAsync"):
        return None
    call = lib.cuMemcpyBatchAsync_v2 if v2 else lib.cuMemcpyBatchAsync
    n = len(srcs)
    d = (ctypes.c_uint64 * n)(*[t.data_ptr() for t in dsts])
    s = (ctypes.c_uint64 * n)(*[t.data_ptr() for t in srcs])
    z = (ctypes.c_size_t * n)(*[t.numel() * t.element_size() for t in srcs])
    device = srcs[0].device.index or 0
    attrs = _Attributes(1, _Location(1, device), _Location(1, device), 0)  # in stream order, device to device
    index, fail = (ctypes.c_size_t * 1)(0), ctypes.c_size_t(0)
    side = torch.cuda.Stream()

    def run() -> None:
        side.wait_stream(torch.cuda.current_stream())
        args: list[Any] = [d, s, z, ctypes.c_size_t(n), ctypes.byref(attrs), index, ctypes.c_size_t(1)]
        if not v2:
            args.append(ctypes.byref(fail))
        rc = call(*args, ctypes.c_void_p(side.cuda_stream))
        if rc:
            raise RuntimeError(f"cuMemcpyBatchAsync failed: CUresult {rc}")
        torch.cuda.current_stream().wait_stream(side)

    return run


def measure(model: str, repeat: int) -> dict[str, Any]:
    tensors = [t for s in llama_files(model, "cuda").values() for t in _tensors(s)]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    groups = []  # (buffer, views in it, sources, sources' flat views)
    for dtype, srcs in by_dtype.items():
        buf = torch.empty(sum(t.numel() for t in srcs), dtype=dtype, device="cuda")
        views = [v.view(t.shape) for v, t in zip(buf.split([t.numel() for t in srcs]), srcs)]
        groups.append((buf, views, srcs, [t.view(-1) for t in srcs]))
    every_dst = [v for g in groups for v in g[1]]
    every_src = [t for g in groups for t in g[2]]

    def foreach() -> None:
        for _, views, srcs, _ in groups:
            torch._foreach_copy_(views, srcs)

    def cat() -> None:
        for buf, _, _, flat in groups:
            torch.cat(flat, out=buf)

    def each() -> None:
        for d, s in zip(every_dst, every_src):
            d.copy_(s)

    ways: dict[str, Callable[[], None]] = {"foreach": foreach, "cat": cat, "copy_each": each}
    batch = batch_copy(every_dst, every_src)
    if batch is not None:
        ways["driver_batch"] = batch
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    out: dict[str, Any] = {"tensors": len(tensors), "bytes": nbytes}
    for way, fn in ways.items():
        calls, gpu = [], []
        for k in range(repeat + 1):  # the first warms up
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            e1.record()
            torch.cuda.synchronize()
            if k:
                calls.append(1e3 * (t1 - t0))
                gpu.append(e0.elapsed_time(e1))
        for buf, *_ in groups:
            buf.zero_()
        fn()
        torch.cuda.synchronize()
        equal = all(torch.equal(d, s) for d, s in zip(every_dst, every_src))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        kernels = sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA")
        out[way] = {
            "call_ms_median": statistics.median(calls),
            "gpu_ms_median": statistics.median(gpu),
            "kernels": kernels,
            "equal": equal,
        }
        print(model, way, out[way], flush=True)
    return out


def main() -> int:
    a = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a.add_argument("--out", required=True)
    a.add_argument("--models", default="180m,1b")
    a.add_argument("--repeat", type=int, default=11)
    args = a.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    result: dict[str, Any] = {
        "command": command_info(),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
    }
    for model in args.models.split(","):
        result[model] = measure(model, args.repeat)
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_staging_launches.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
