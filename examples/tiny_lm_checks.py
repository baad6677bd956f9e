"""What ``train_tiny_lm.py`` measures and verifies: each checkpoint's stall (time inside ``engine.save()`` and
``handle.wait_snapshot()``) beside ``torch.save`` + ``fsync`` of the same state, the losses of both runs
(written as exact hex floats), their bit-for-bit comparison after the resume point, the exact equality of two
loaded states, and the summary table printed at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nanotron_datastates import SaveHandle

# -- checkpoints ------------------------------------------------------------------------------------------


@dataclass
class CheckpointRecord:
    step: int
    file_mb: float
    save_ms: float  # inside engine.save()
    wait_ms: float  # blocked in wait_snapshot()
    torch_save_ms: float  # torch.save + fsync of the same state, measured off the clock
    persisted_ms: float  # from engine.save() until the file is durable

    @property
    def stall_ms(self) -> float:
        return self.save_ms + self.wait_ms


@dataclass
class Pending:
    """A save whose snapshot is still being taken while the next step computes."""

    handle: SaveHandle
    state: dict[str, Any]
    step: int
    save_ms: float


def timed_torch_save(state: dict[str, Any], directory: Path) -> float:
    """Milliseconds for torch.save + fsync of `state` into a scratch file next to the checkpoints."""
    scratch = directory / "torch_save.scratch.pt"
    t0 = time.perf_counter()
    with open(scratch, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    ms = (time.perf_counter() - t0) * 1e3
    scratch.unlink()
    return ms


def finish_checkpoint(pending: Pending, directory: Path) -> CheckpointRecord:
    """Waits for the snapshot (the only blocking part, timed), then measures the torch.save comparison."""
    t0 = time.perf_counter()
    pending.handle.wait_snapshot()
    wait_ms = (time.perf_counter() - t0) * 1e3
    # Off the training clock from here. Waiting for the file first keeps the two writers off the same disk;
    # the saved tensors are still those of `pending.step`: only gradients changed since.
    pending.handle.wait_persisted()
    stats = pending.handle.stats
    record = CheckpointRecord(
        step=pending.step,
        file_mb=stats["file_bytes"] / 1e6,
        save_ms=pending.save_ms,
        wait_ms=wait_ms,
        torch_save_ms=timed_torch_save(pending.state, directory),
        persisted_ms=stats["persisted_s"] * 1e3,
    )
    print(
        f"step {record.step:4d}  checkpoint {record.file_mb:.1f} MB  stall {record.stall_ms:.1f} ms "
        f"(save {record.save_ms:.1f} + wait {record.wait_ms:.1f})  "
        f"torch.save+fsync {record.torch_save_ms:.1f} ms  persisted after {record.persisted_ms:.0f} ms"
    )
    return record


def checkpoint_path(directory: Path, step: int) -> Path:
    return directory / f"step_{step:06d}.safetensors"


# -- outputs and verdicts ---------------------------------------------------------------------------------


def clear_outputs(out: Path) -> None:
    """Removes what an earlier run of this script left in `out`, and nothing else."""
    for sub in ("ckpt", "resume"):
        shutil.rmtree(out / sub, ignore_errors=True)
    for name in ("train_losses.json", "resume_losses.json"):
        (out / name).unlink(missing_ok=True)


def default_resume_step(steps: int, every: int) -> int:
    """The last checkpoint at or before two thirds of the run: it leaves a third of the steps to compare."""
    step = (2 * steps // 3) // every * every
    if not 0 < step < steps:
        raise SystemExit(f"--steps {steps} and --ckpt-every {every} leave no checkpoint before the end")
    return step


def write_losses(path: Path, losses: dict[int, float]) -> None:
    # float.hex round-trips exactly; a decimal repr would also do, but hex makes the intent obvious.
    path.write_text(json.dumps({str(step): loss.hex() for step, loss in losses.items()}, indent=0))


def read_losses(path: Path) -> dict[int, float]:
    return {int(step): float.fromhex(h) for step, h in json.loads(path.read_text()).items()}


def compare_losses(first: dict[int, float], resumed: dict[int, float], resume_step: int) -> bool:
    steps = sorted(s for s in first if s > resume_step)
    if sorted(resumed) != steps:
        print(f"resume: FAILED, the resumed run covered {len(resumed)} steps, expected {len(steps)}")
        return False
    diff = [s for s in steps if first[s].hex() != resumed[s].hex()]
    if diff:
        s = diff[0]
        print(f"resume: FAILED, {len(diff)} of {len(steps)} losses differ, first at step {s}: ", end="")
        print(f"{first[s]!r} vs {resumed[s]!r}")
        return False
    print(f"resume: {len(steps)} steps after step {resume_step} match bit for bit")
    return True


def same_state(a: Any, b: Any) -> bool:
    """Exact equality of two nested states (tensors: same dtype, shape and bits)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same_state, a, b))
    return a == b


def print_summary(records: list[CheckpointRecord]) -> None:
    stall = [r.stall_ms for r in records]
    torch_save = [r.torch_save_ms for r in records]
    mean_stall, mean_torch = statistics.mean(stall), statistics.mean(torch_save)
    print(f"\nsummary over {len(records)} checkpoints of {records[0].file_mb:.1f} MB")
    print(f"  {'':28s}{'mean':>10s}{'max':>10s}")
    print(f"  {'training stall (datastates)':28s}{mean_stall:8.1f}ms{max(stall):8.1f}ms")
    print(f"  {'torch.save + fsync':28s}{mean_torch:8.1f}ms{max(torch_save):8.1f}ms")
    print(f"  {'persisted after save()':28s}{statistics.mean(r.persisted_ms for r in records):8.1f}ms")
    print(f"  torch.save + fsync stalls {mean_torch / max(mean_stall, 1e-6):.0f}x longer on average")
