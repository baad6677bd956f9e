"""What a run measures besides its iteration times: its host memory (`MemorySampler`), the cudaMallocs so
far (`device_allocs`) and a cProfile of a block (`Profiled`).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path
from typing import Any


class MemorySampler:
    """Host memory of a run, measured without loading the run: the peak resident set from the kernel's own
    high-water mark (`VmHWM`), what `/dev/shm` gained (statvfs every 50 ms, constant time), and the
    proportional set size (PSS: shared pages split among the processes mapping them) summed over the process
    and every process it started (DCP's checkpoint process), which counts pinned and shared-memory staging
    once, read when the caller asks (`sample_pss`) and at `stop` if never.

    PSS is not sampled in the background by default: reading `smaps_rollup` walks every page table entry of
    the process holding its mmap lock, 10 ms for 1.8 GB in 4 KiB pages and 45 ms for 7.2 GB on a 2-core
    machine, so a read every 50 ms was a load of its own on the run, and a larger one on the modes that hold
    more memory. `pss_every` > 0 brings that sampling back (to measure what it costs)."""

    def __init__(self, every_s: float = 0.05, pss_every: float = 0.0) -> None:
        self.peak_pss = self.peak_shm = 0
        self.pss_reads: list[float] = []  # seconds each PSS reading of the process tree took
        self._shm0 = self._shm_used()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every_s, pss_every), daemon=True)
        self._thread.start()

    @staticmethod
    def _shm_used() -> int:
        try:
            st = os.statvfs("/dev/shm")
        except OSError:
            return 0
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    @staticmethod
    def _tree(pid: int) -> list[int]:
        """`pid` and its descendants."""
        out, todo = [], [pid]
        while todo:
            p = todo.pop()
            out.append(p)
            for task in Path(f"/proc/{p}/task").glob("*/children"):
                with contextlib.suppress(OSError):  # the task ended meanwhile
                    todo += [int(c) for c in task.read_text().split()]
        return out

    @staticmethod
    def _pss(pid: int) -> int:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    return int(line.split()[1]) << 10
        except OSError:
            pass
        return 0

    @staticmethod
    def _hwm() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) << 10
        return 0

    def sample_pss(self) -> None:
        """Reads the PSS of the process tree now (tens of milliseconds for a process of several GB)."""
        t = time.perf_counter()
        self.peak_pss = max(self.peak_pss, sum(self._pss(p) for p in self._tree(os.getpid())))
        self.pss_reads.append(time.perf_counter() - t)

    def _run(self, every_s: float, pss_every: float) -> None:
        last_pss = time.perf_counter()
        while not self._stop.wait(every_s):
            self.peak_shm = max(self.peak_shm, self._shm_used() - self._shm0)
            if pss_every > 0 and time.perf_counter() - last_pss >= pss_every:
                self.sample_pss()
                last_pss = time.perf_counter()

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        if not self.pss_reads:
            self.sample_pss()
        return {
            "host_peak_rss_bytes": self._hwm(),
            "host_pss_tree_bytes": self.peak_pss,
            "pss_reads": len(self.pss_reads),
            "pss_read_max_s": max(self.pss_reads),
            "shm_peak_bytes": self.peak_shm,
        }


def device_allocs() -> int:
    """cudaMallocs so far: read from the allocator's table as it comes (`memory_stats` also flattens it, 160
    Python calls, inside the queuing this benchmark times)."""
    import torch

    return int(torch.cuda.memory_stats_as_nested_dict().get("num_device_alloc", 0))


class ProfileSum:
    """cProfile of several blocks summed (`on`, `off`, as often as wanted), written as `Profiled` writes one,
    headed by how many blocks it sums."""

    def __init__(self) -> None:
        import cProfile

        self.prof, self.blocks = cProfile.Profile(), 0

    def on(self) -> None:
        self.blocks += 1
        self.prof.enable()

    def off(self) -> None:
        self.prof.disable()

    def write(self, path: Path) -> None:
        import io
        import pstats

        text = io.StringIO()
        text.write(f"{self.blocks} blocks\n")
        pstats.Stats(self.prof, stream=text).sort_stats("cumulative").print_stats(80)
        pstats.Stats(self.prof, stream=text).sort_stats("tottime").print_stats(40)
        path.write_text(text.getvalue())


class Profiled:
    """cProfile of a block, written as text to `path` (the 60 costliest calls, cumulative, then the 30
    costliest by their own time); None: no-op."""

    def __init__(self, path: Path | None) -> None:
        self.path = path

    def __enter__(self) -> None:
        if self.path is not None:
            import cProfile

            self.prof = cProfile.Profile()
            self.prof.enable()

    def __exit__(self, *exc: Any) -> None:
        if self.path is None:
            return
        import io
        import pstats

        self.prof.disable()
        text = io.StringIO()
        pstats.Stats(self.prof, stream=text).sort_stats("cumulative").print_stats(60)
        pstats.Stats(self.prof, stream=text).sort_stats("tottime").print_stats(30)
        self.path.write_text(text.getvalue())


def threads_cpu() -> dict[str, float]:
    """CPU seconds used so far by each thread of this process (`cpu_use.thread_seconds`), by name: Python's
    own for its threads (their native ids matched), the kernel's `comm` for the others (the core's
    `ds-<role>`, torch's, the driver's); threads of one name summed. Read at each --blocks boundary: whose
    CPU the blocks with checkpoints add."""
    from nanotron_datastates.cpu_use import thread_seconds

    names = {t.native_id: f"py:{t.name}" for t in threading.enumerate()}
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            seconds = thread_seconds(tid)
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:  # exited
            continue
        name = names.get(int(tid), comm)
        out[name] = out.get(name, 0.0) + seconds
    return out
