"""What a checkpoint's copies to the host cost the data-parallel all-reduce beside them (2 GPUs of one host).

A memory checkpoint of the 1.1B every 10 steps keeps copies from the GPU to the host running most of the
time, and the steps beside them slow by 13-20%. This measures the two ranks' all-reduce of a gradient-sized
buffer (`--grad-gib` fp32, as DDP's buckets of 25 MB) alone and beside a thread that copies a GPU buffer to
pinned host memory in `--piece-mib` pieces on a side stream (two in flight, as the engine's copies), and
each copy alone and beside the all-reduce: where both cross the same PCIe links (no NVLink between the
GPUs) they share their bandwidth, and a step's all-reduce waits for the checkpoint's copies.

    torchrun --nproc-per-node 2 benchmarks/micro/bench_allreduce_copy.py --out DIR

Writes DIR/bench_allreduce_copy.json (rank 0): every timing, GB/s, and `nvidia-smi topo -m`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the helpers in benchmarks/
from _common import host_info  # noqa: E402

BUCKET = 25 << 20  # bytes: DDP's default bucket


def all_reduce_s(grads: list[torch.Tensor]) -> float:
    """Seconds for one all-reduce of every bucket, as DDP issues them (asynchronously, then waited)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    works = [dist.all_reduce(g, async_op=True) for g in grads]
    for w in works:
        w.wait()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


class Copier(threading.Thread):
    """Copies `src` to pinned host memory in pieces, two in flight, over and over until stopped."""

    def __init__(self, src: torch.Tensor, piece: int) -> None:
        super().__init__(daemon=True)
        self.src, self.piece = src, piece
        self.dst = torch.empty(src.numel(), dtype=torch.uint8, pin_memory=True)
        self.stream = torch.cuda.Stream()
        self.stop = threading.Event()
        self.bytes, self.seconds = 0, 0.0

    def run(self) -> None:
        torch.cuda.set_device(self.src.device)
        t0 = time.perf_counter()
        n, events = self.src.numel(), []
        while not self.stop.is_set():
            for lo in range(0, n, self.piece):
                hi = min(n, lo + self.piece)
                with torch.cuda.stream(self.stream):
                    self.dst[lo:hi].copy_(self.src[lo:hi], non_blocking=True)
                    ev = torch.cuda.Event(blocking=True)
                    ev.record()
                events.append(ev)
                if len(events) > 2:
                    events.pop(0).synchronize()
                self.bytes += hi - lo
                if self.stop.is_set():
                    break
        for ev in events:
            ev.synchronize()
        self.seconds = time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--grad-gib", type=float, default=4.0, help="fp32 gradients all-reduced (1.1B: 4.1)")
    p.add_argument("--copy-gib", type=float, default=4.0, help="GPU bytes each copy pass reads")
    p.add_argument("--piece-mib", type=int, default=4, help="bytes of a copy (the engine's device_copy_size)")
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    elems = int(a.grad_gib * (1 << 30)) // 4
    per = BUCKET // 4
    grads = [torch.ones(min(per, elems - lo), device="cuda") for lo in range(0, elems, per)]
    src = torch.ones(int(a.copy_gib * (1 << 30)), dtype=torch.uint8, device="cuda")
    nbytes = elems * 4
    for _ in range(2):
        all_reduce_s(grads)  # warm: the communicator and its channels
    alone = [all_reduce_s(grads) for _ in range(a.rounds)]
    dist.barrier()
    copier = Copier(src, a.piece_mib << 20)
    copier.start()
    time.sleep(0.5)
    beside = [all_reduce_s(grads) for _ in range(a.rounds)]
    copier.stop.set()
    copier.join()
    dist.barrier()
    solo = Copier(src, a.piece_mib << 20)
    solo.start()
    time.sleep(2.0)
    solo.stop.set()
    solo.join()
    results = {
        "rank": rank,
        "all_reduce_gb": nbytes / 1e9,
        "all_reduce_alone_s": alone,
        "all_reduce_beside_copies_s": beside,
        "copy_gbps_beside_all_reduce": copier.bytes / copier.seconds / 1e9,
        "copy_gbps_alone": solo.bytes / solo.seconds / 1e9,
    }
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if rank == 0:
        topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True).stdout
        med = {
            k: statistics.median(statistics.median(g[k]) for g in gathered)
            for k in ("all_reduce_alone_s", "all_reduce_beside_copies_s")
        }
        summary = {
            "command": "torchrun --nproc-per-node 2 benchmarks/micro/bench_allreduce_copy.py "
            f"--grad-gib {a.grad_gib} --copy-gib {a.copy_gib} --piece-mib {a.piece_mib} --rounds {a.rounds}",
            "gpu": torch.cuda.get_device_name(),
            "host": host_info([]),
            "nccl_algorithm_bus_gbps": {k: nbytes / v / 1e9 for k, v in med.items()},
            "median_s": med,
            "ranks": gathered,
            "topology": topo,
        }
        Path(a.out).mkdir(parents=True, exist_ok=True)
        Path(a.out, "bench_allreduce_copy.json").write_text(json.dumps(summary, indent=1))
        print(json.dumps({k: v for k, v in summary.items() if k != "ranks"}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
