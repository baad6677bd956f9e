"""Whether a checkpoint is copied on the GPU first (`datastates.device_snapshot`).

A staged checkpoint costs its size in GPU memory from the checkpoint until its bytes reach the host cache
(a step or a few later): the forward and backward passes in between must still fit. So it is staged only
where, above the peak memory training has used so far, the GPU has room for it and some to spare.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .plan import SavePlan
from .stage import copy_many, staged_nbytes

GIB = 1 << 30
KEEP_WITHIN = 10  # steps: memory checkpoints at most this far apart keep their staging memory between them


def spare_bytes(total: int) -> int:
    """Memory left unused by a staged checkpoint: the larger of 1 GiB and 5% of the GPU."""
    return max(GIB, total // 20)


def fits(nbytes: int, *, free: int, reserved: int, peak: int, total: int) -> bool:
    """Whether a copy of `nbytes` fits above the training's `peak` (bytes allocated at most so far): the
    process can hold what the driver has `free` plus what its allocator has `reserved`."""
    return nbytes <= free + reserved - peak - spare_bytes(total)


def keep(memory_interval: int) -> bool:
    """Whether a staged checkpoint's GPU memory is kept for the next one (`DataStatesEngine.stage`'s
    `keep`): where memory checkpoints come every few steps, the next one then copies into it without an
    allocation or a view made (1-2 ms of the training thread's time a checkpoint). Checkpoints further apart
    leave it to torch's allocator, which can give it back to training should training run short."""
    return 0 < memory_interval <= KEEP_WITHIN


def decide(mode: str, nbytes: int, held: int = 0) -> tuple[bool, str]:
    """(stage?, why) for a checkpoint of `nbytes` on the current GPU, by `mode` (auto, always, never);
    'always' without a GPU stages in host memory. `held`: bytes of staging memory kept from the last
    checkpoint (`keep`), which the peak counts and this one reuses."""
    if mode in ("never", "always"):
        return mode == "always", f"device_snapshot: {mode}"
    if not torch.cuda.is_available():
        return False, "no GPU"
    if nbytes <= held:  # the memory is the staging's already: no query of the allocator (a checkpoint's 1 ms)
        return True, f"{nbytes / GIB:.2f} GiB to stage into the memory kept from the last checkpoint"
    device = torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(device)
    # The allocator's table as it comes (memory_stats flattens it too: 160 more Python calls per checkpoint)
    stats = torch.cuda.memory_stats_as_nested_dict(device)
    reserved = stats.get("reserved_bytes", {}).get("all", {}).get("current", 0)
    peak = stats.get("allocated_bytes", {}).get("all", {}).get("peak", 0)
    room = free + reserved - peak - spare_bytes(total) + held
    ok = fits(nbytes - held, free=free, reserved=reserved, peak=peak, total=total)
    return ok, f"{nbytes / GIB:.2f} GiB to stage, {max(room, 0) / GIB:.2f} GiB of room above the peak"


def warm(plans: Sequence[SavePlan]) -> None:
    """Pays, after the first step, what the first staged checkpoint would pay for once: a buffer of its size
    is allocated and freed, so that torch's allocator holds it (a 2.2 GB cudaMalloc took 20 ms on an H100;
    the allocator hands it back to training should training run short), and the staging copy runs once per
    dtype, so that its kernels are loaded (CUDA loads them lazily, at their first launch)."""
    if not torch.cuda.is_available():  # staged in host memory: nothing to load or hold
        return
    nbytes = staged_nbytes(plans) + (2 << 20)  # 2 MiB above the state's files (the only ones staged)
    torch.empty_strided((nbytes,), (1,), dtype=torch.uint8, device="cuda")
    for dtype in {a.dtype for p in plans for a in p.arrays if a.is_cuda}:
        src = torch.zeros(2, dtype=dtype, device="cuda")
        copy_many([torch.empty_like(src)], [src])
