"""bench_engine.py's runs: every CPU-side measurement repeat by repeat (`run_cpu`), and the GPU part
(`run_cuda`); each returns the raw values that `_engine_report` summarizes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from _common import CacheDropper, GiB, state_nbytes
from _engine_measure import (
    DD_STREAMS,
    SHM_DIR,
    DcpSaver,
    cold_load,
    dd_shm_write,
    dd_write_read,
    engine_save,
    pinned_copy,
    remove,
    restore_knobs,
    safetensors_save_fsync,
    same_tensors,
    torch_save_fsync,
)


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
