"""Helpers shared by the tests (import as `from helpers import ...`)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from nanotron_datastates import DataStatesConfig, _core

BACKENDS = ("io_uring", "pwrite")


def small_config(**kw) -> DataStatesConfig:
    """A 16 MiB cache of 1 MiB chunks: most test states stream through it with backpressure."""
    base = dict(host_cache_size=16 / 1024, chunk_size=1, parser_threads=2, flush_threads=2, queue_depth=4)
    base.update(kw)
    return DataStatesConfig(**base)


def mapped_at(path: Path) -> list[int]:
    """Where this process maps the file at `path` now (the kernel names a mapping by its current name)."""
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(path):
            out.append(int(fields[0].split("-")[0], 16))
    return out


def wait_until(done: Callable[[], bool], timeout: float = 300.0) -> bool:
    """Polls `done` until it holds (True) or `timeout` seconds have passed (False): a deadline with room for
    a loaded machine, where only a hang should reach it."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN-safe, unlike torch.equal)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ab = a.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    bb = b.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return torch.equal(ab, bb)


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random bytes of every dtype (NaN and denormal patterns included); bools stay 0/1."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    itemsize = torch.empty(0, dtype=dtype).element_size()
    n = 1
    for s in shape:
        n *= s
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def no_temporaries(directory: Path) -> bool:
    return not [n for n in os.listdir(directory) if ".dstmp." in n]


@contextlib.contextmanager
def injected_fault(kind: str, err: int, path_contains: str, skip: int = 0, count: int = 1) -> Iterator[None]:
    """The core's flush layer fails matching ops with `err` (see ext/fault.hpp) within the block."""
    _core._arm_fault(kind, err, path_contains, skip, count)
    try:
        yield
    finally:
        _core._disarm_fault()


def write_nanotron_checkpoint(engine, root: Path, step: int, *, latest: bool = True) -> Path:
    """A datastates checkpoint of a tiny model in Nanotron's layout, committed as the trainer commits one
    (engine files, Nanotron's json/yaml, the manifest, then latest.txt), with a real AdamW state."""
    import json

    import yaml

    from nanotron_datastates.checkpoint.file_io import write_atomic
    from nanotron_datastates.checkpoint.manifest import manifest as make_manifest
    from nanotron_datastates.checkpoint.manifest import manifest_text
    from nanotron_datastates.checkpoint.names import LATEST, MANIFEST, random_states_name
    from nanotron_datastates.nanotron import rng_states as states

    torch.manual_seed(step)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
    folder = root / str(step)
    meta = {"nanotron_format_version": "1.4", "tensor_parallel_size": "1"}
    handles = {}
    for name, p in model.named_parameters():
        rel = f"model/model/lm_head/model_{name}_pp-rank-0-of-1_tp-rank-0-of-1.safetensors"
        handles[rel] = engine.save({"data": p.detach()}, folder / rel, metadata=meta, exact_metadata=True)
    others = {
        "optimizer/optimizer_pp-0-of-1_tp-0-of-1.safetensors": opt.state_dict(),
        "lr_scheduler/lr_scheduler_pp-0-of-1_tp-0-of-1.safetensors": {"last_epoch": step, "base_lrs": [1e-3]},
        f"random/{random_states_name((0, 1), (0, 1), (0, 1))}": {
            "nanotron": {},
            "global": states.global_rng_state(),
        },
    }
    for rel, obj in others.items():
        handles[rel] = engine.save(obj, folder / rel)
    files = {}
    for rel, h in handles.items():
        sums = h.checksums()
        files[rel] = {"bytes": h.stats["file_bytes"], "crc32c": {k: f"{v:08x}" for k, v in sums.items()}}
    checkpoint_meta = {
        "version": "1.4",
        "tp": 1,
        "dp": 1,
        "metas": {"last_train_step": step, "consumed_train_samples": 4 * step},
    }
    write_atomic(folder / "checkpoint_metadata.json", json.dumps(checkpoint_meta))
    config = {
        "checkpoints": {"checkpointing_engine": "datastates", "checkpoints_path": str(root)},
        "datastates": {"host_cache_size": 1},
        "parallelism": {"dp": 1, "pp": 1, "tp": 1},
        "optimizer": {"zero_stage": 0},
    }
    write_atomic(folder / "config.yaml", yaml.dump(config))
    write_atomic(folder / "model_config.json", json.dumps({"hidden_size": 8}))
    topology = {"tp": 1, "pp": 1, "dp": 1, "expert": 1, "zero_stage": 0}
    write_atomic(folder / MANIFEST, manifest_text(make_manifest(step, topology, files)))
    if latest:
        write_atomic(root / LATEST, str(step))
    return folder


@contextlib.contextmanager
def constructors_forced_to(dtype: torch.dtype):
    """What Nanotron's `init_on_device_and_dtype` does while it builds a model, process-wide: torch.empty,
    zeros, ones and full replaced by wrappers that force their dtype."""
    names = ("empty", "zeros", "ones", "full")
    saved = {n: getattr(torch, n) for n in names}

    def forcing(fn):
        def wrapper(*args, **kwargs):
            kwargs["dtype"] = dtype
            return fn(*args, **kwargs)

        return wrapper

    for n in names:
        setattr(torch, n, forcing(saved[n]))
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(torch, n, fn)


def forge_crc32c(data: bytes, change: dict[int, int], fix_at: int) -> bytes:
    """`data` with the bytes at the offsets of `change` set to its values and the 4 bytes at `fix_at`
    (which `change` must not touch) rewritten so that the CRC-32C of the result equals that of `data`: CRC is
    no defence against a chosen input. CRC-32C is affine in its input, so the 32 bits at `fix_at` are solved
    for over GF(2)."""
    n = len(data)
    zero = _core.crc32c(bytes(n))

    def linear(delta: bytes) -> int:  # the linear part of the CRC of a difference of n bytes
        return _core.crc32c(delta) ^ zero

    delta = bytearray(n)
    for at, value in change.items():
        delta[at] = data[at] ^ value
    target = linear(bytes(delta))
    # Columns: the effect of each of the 32 bits at fix_at; solve sum(x_i * col_i) = target.
    rows = []
    for bit in range(32):
        d = bytearray(n)
        d[fix_at + bit // 8] = 1 << (bit % 8)
        rows.append((linear(bytes(d)), 1 << bit))
    basis: dict[int, tuple[int, int]] = {}  # top bit -> (effect, which bits), a row echelon basis
    for col, mask in rows:
        while col and col.bit_length() in basis:
            b_col, b_mask = basis[col.bit_length()]
            col, mask = col ^ b_col, mask ^ b_mask
        if col:
            basis[col.bit_length()] = (col, mask)
    solution = 0
    while target and target.bit_length() in basis:
        b_col, b_mask = basis[target.bit_length()]
        target, solution = target ^ b_col, solution ^ b_mask
    assert target == 0, "the 32 bits at fix_at do not span the CRC's space"
    for i in range(4):
        delta[fix_at + i] = (solution >> (8 * i)) & 0xFF
    out = bytes(a ^ b for a, b in zip(data, delta))
    assert _core.crc32c(out) == _core.crc32c(data)
    return out


def within(fn: Callable[[], Any], seconds: float, fifos: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Runs `fn` on a thread that must end within `seconds`: {"out": what it returned} or {"error": what it
    raised}. A thread still running then fails the test, once a writer has opened each of `fifos`, so that
    a reader blocked on one gets its end of file and its thread ends."""
    import pytest

    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["out"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        for _ in range(3):
            for path in fifos:
                with contextlib.suppress(OSError):  # ENXIO: no reader on it
                    os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            time.sleep(0.1)
        t.join(seconds)
        pytest.fail(f"still blocked after {seconds} s: it waits on a file that is not a regular file")
    return box
