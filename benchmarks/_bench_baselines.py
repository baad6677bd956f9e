"""What the modes that datastates is compared with do inside the trainer: DCP's key prefixes and its
zero-overhead stager (`dcp`, `dcp-zo`), and the raw copies of a checkpoint's bytes (`copy-*`) with the byte
count they copy.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from typing import Any


def dcp_key_prefixes(pc: Any, zero_stage: int) -> tuple[str, str]:
    """Prefixes that keep DCP's keys apart where ranks hold different tensors under the same name: the
    model's by tensor- and pipeline-parallel rank (replicas share theirs, and DCP writes each once, spread
    over the ranks that hold it), the optimizer's also by data-parallel rank under ZeRO (its states are keyed
    by a parameter's index on the rank)."""
    import torch.distributed as dist

    tp, pp = dist.get_rank(pc.tp_pg), dist.get_rank(pc.pp_pg)
    shard = f"pp{pp}-tp{tp}/"
    return shard, shard + (f"dp{dist.get_rank(pc.dp_pg)}/" if zero_stage > 0 else "")


class RawCopy:
    """The `copy-*` modes' copy of `nbytes`, started by `issue()`:

    * `d2h`: from a GPU buffer to pinned host memory on a side stream, in one copy or (`pace_s` > 0) in 64 MiB
      pieces with GPU sleeps between them, so that it takes about `pace_s`;
    * `h2d`: the other way, in one copy;
    * `host`: between two host buffers, by a thread of its own (torch's copy on 4 threads: about the rate of
      the copy engine's writes), the GPU not involved: what the memory traffic alone costs;
    * `engine`: from a GPU buffer into a file in /dev/shm by the engine's core, as a memory checkpoint's copy
      goes (pieces of `device_copy_size`, two in flight, into files made and pinned ahead, the file before
      last's recycled; no checksums), with one Python call: the copy into the memory tier without the
      trainer's planning, staging, queuing and commit. One due while two are in flight is skipped, as a
      memory checkpoint is. `parts` adds a memory checkpoint's parts one at a time (`_engine_setup`)."""

    PIECE = 64 << 20

    def __init__(
        self,
        nbytes: int,
        way: str = "d2h",
        pace_s: float = 0.0,
        files: list[dict[str, Any]] | None = None,
        parts: list[str] | None = None,
    ) -> None:
        import torch

        self.way, self.nbytes = way, nbytes
        if way == "engine":
            self._engine_setup(nbytes, files, set(parts or ()))
            return
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=way != "host")
        if way == "host":
            torch.set_num_threads(4)  # the training runs on the GPU: its own CPU ops are few
            self.other = torch.empty(nbytes, dtype=torch.uint8)
            self.host.fill_(1)
            self.other.fill_(2)
        else:
            self.dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            self.stream = torch.cuda.Stream()
        self.pieces = [(lo, min(lo + self.PIECE, nbytes)) for lo in range(0, nbytes, self.PIECE)]
        self.sleep_cycles = 0
        self.timed: list[Any] = []  # (begin, end) CUDA events of each copy, or its seconds on the host
        self.thread: threading.Thread | None = None
        if pace_s > 0:
            self._issue(paced=False)
            torch.cuda.synchronize()
            plain_s = self.seconds()[-1]
            probe = 10_000_000
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(self.stream):
                begin.record(self.stream)
                torch.cuda._sleep(probe)
                end.record(self.stream)
            torch.cuda.synchronize()
            gap_s = max(pace_s - plain_s, 0.0) / len(self.pieces)
            self.sleep_cycles = int(probe * gap_s / (begin.elapsed_time(end) / 1e3))
            self.timed.clear()

    def _engine_setup(self, nbytes: int, files: list[dict[str, Any]] | None, parts: set[str]) -> None:
        import tempfile
        from pathlib import Path

        import torch

        from nanotron_datastates import DataStatesConfig, DataStatesEngine

        # A memory checkpoint's parts (mode copy-engine-PART-...), one at a time: `files` saves the
        # trainer's own tensors in its files (one a parameter, the optimizer's state in one), `stage` stages
        # them on the GPU first as a memory checkpoint does (into kept buffers), `checksums` sums them; and
        # `size<N>`: copies of N MiB (device_copy_size). DATASTATES_* variables apply.
        sizes = {p for p in parts if p.startswith("size") and p[4:].isdigit()}
        unknown = parts - {"files", "stage", "checksums"} - sizes
        if unknown:
            known = "files, stage, checksums, sizeN"
            raise ValueError(f"copy-engine: unknown parts {sorted(unknown)} ({known})")
        self.options = parts
        self.timed, self.sleep_cycles, self.thread = [], 0, None
        settings: dict[str, Any] = {"host_cache_size": 0.25, "checksums": "checksums" in parts}
        for p in sizes:
            settings["device_copy_size"] = int(p[4:])
        self.engine = DataStatesEngine(DataStatesConfig.from_dict(settings))
        if "files" in self.options and files:
            self.plans = [self.engine.plan(f) for f in files]
        else:
            device = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: to check the script
            self.dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self.plans = [self.engine.plan({"bytes": self.dev})]
        folder = Path(tempfile.mkdtemp(prefix="ds-copy-engine-", dir="/dev/shm"))
        self.files = [
            [folder / str(k) / f"{i}.safetensors" for i in range(len(self.plans))] for k in range(3)
        ]
        self.engine.prepare_mirrors([(p, f) for s in self.files[:2] for p, f in zip(self.plans, s)])
        self.saves: list[Any] = []  # each save's handles, oldest first
        self.skipped = 0

    def _issue_engine(self) -> None:
        self.saves = [h for h in self.saves if not all(x.done() for x in h)]
        if len(self.saves) >= 2:
            self.skipped += 1
            return
        k = len(self.timed)
        new, old = self.files[(k + 2) % 3], self.files[k % 3]
        if "stage" in self.options:
            staged = self.engine.stage(self.plans, keep=True)
            staged.target(new, mirrors=new, recycle=old)
            self.saves.append(staged.queue())
        else:  # nothing waits for these copies: the step may change what they read (a cost, not a checkpoint)
            self.saves.append(self.engine.save_plans(list(zip(self.plans, new)), mirrors=new, recycle=old))
        self.timed.append(self.saves[-1])

    def _issue(self, paced: bool) -> None:
        import torch

        if self.way == "engine":
            self._issue_engine()
            return
        if self.way == "host":
            self._join()

            def copy() -> None:
                t0 = time.perf_counter()
                self.other.copy_(self.host)  # releases the GIL
                self.timed.append(time.perf_counter() - t0)

            self.thread = threading.Thread(target=copy, daemon=True)
            self.thread.start()
            return
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            begin.record(self.stream)
            if self.way == "h2d":
                self.dev.copy_(self.host, non_blocking=True)
            elif not paced:
                self.host.copy_(self.dev, non_blocking=True)
            else:
                for lo, hi in self.pieces:
                    self.host[lo:hi].copy_(self.dev[lo:hi], non_blocking=True)
                    torch.cuda._sleep(self.sleep_cycles)
            end.record(self.stream)
        self.timed.append((begin, end))

    def _join(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None

    def issue(self) -> None:
        self._issue(paced=self.sleep_cycles > 0)

    def seconds(self) -> list[float]:
        """Each copy's time (waits for them): on the GPU, or the host thread's."""
        if self.way == "host":
            self._join()
            return list(self.timed)
        if self.way == "engine":  # the time to each save's snapshot: every byte in the file's memory
            for handles in self.timed:
                for h in handles:
                    h.wait_persisted()
            seconds = [max(h.stats["snapshot_s"] for h in handles) for handles in self.timed]
            self.engine.close()
            shutil.rmtree(self.files[0][0].parent.parent, ignore_errors=True)
            return seconds
        self.stream.synchronize()
        return [b.elapsed_time(e) / 1e3 for b, e in self.timed]


def checkpoint_bytes(trainer: Any) -> int:
    """The bytes of a checkpoint's tensors: the model's and the optimizer state's (moments, master
    weights)."""
    import torch

    def tensors(x: Any) -> list[Any]:
        if isinstance(x, torch.Tensor):
            return [x]
        if isinstance(x, dict):
            return [t for v in x.values() for t in tensors(v)]
        if isinstance(x, (list, tuple)):
            return [t for v in x for t in tensors(v)]
        return []

    every = tensors(dict(trainer.unwrapped_model.state_dict())) + tensors(trainer.optimizer.state_dict())
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in every}.values())


def trainer_files(trainer: Any) -> list[dict[str, Any]]:
    """The trainer's state as a checkpoint's files lay it out (`copy-engine-files`): one a
    parameter, as Nanotron writes its weights, and the optimizer's state in one."""
    weights = [{"weight": p} for _, p in trainer.unwrapped_model.named_parameters()]
    return [*weights, trainer.optimizer.state_dict()]


def dcp_zero_overhead_stager(pinned: bool = True) -> Any:
    """DCP's stager in its zero-overhead configuration, made once and reused for every save (`pinned`:
    page-locked staging and non-blocking copies, for GPU state; host state is staged into shared memory only).

    torch 2.11's `DefaultStager._stage` closes its StateDictStager after each staging (pytorch/pytorch#183413,
    a fix of a leak): `close` empties the copier table, so the second save fails with `KeyError: <class
    'type'>` and every save would pin its host memory anew. As later releases do, the stager stays open
    until the run ends (`close` at the end of training).

    The checkpoint process joins the job's own store (`DCP_USE_PREFIX_STORE=1`) instead of a port it probes
    for and binds later: among Nanotron's many process groups, another socket took that port in between
    (EADDRINUSE) in the first save."""
    os.environ.setdefault("DCP_USE_PREFIX_STORE", "1")
    import inspect

    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    options = StagingOptions(
        use_pinned_memory=pinned, use_shared_memory=True, use_async_staging=True, use_non_blocking_copy=pinned
    )
    stager = DefaultStager(options)
    if "_state_dict_stager.close()" in inspect.getsource(DefaultStager._stage):
        inner = stager._state_dict_stager
        final_close = inner.close
        inner.close = lambda: None  # the call at the end of each staging
        plain_close = stager.close

        def close() -> None:
            plain_close()
            final_close()

        stager.close = close
    return stager
