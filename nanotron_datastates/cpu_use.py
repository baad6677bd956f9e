"""CPU time of the engine's threads, by role, read from /proc: where a checkpoint's work runs, and how much
of it competes with the threads that feed the GPU.

The core names its threads `ds-<role>` (`copy`, `copy-host`, `flush`, `parse`, `pin`, `cache-prep`); the
kernel names the workers that carry io_uring's buffered I/O `iou-wrk-<tid>`, counted as `io_uring`. A
thread's time is counted while it lives: io_uring's workers exit when idle, so their figure is a floor.
"""

from __future__ import annotations

import os
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")


def _role(comm: str) -> str | None:
    if comm.startswith("ds-"):
        return comm[3:]
    if comm.startswith("iou-wrk"):
        return "io_uring"
    return None


Marks = dict[int, tuple[str, float]]
"""Engine threads by thread id: (role, CPU seconds used so far)."""


def thread_cpu() -> Marks:
    """CPU seconds (user and system) used so far by each of this process's engine threads, with its role."""
    out: Marks = {}
    try:
        tasks = list(Path("/proc/self/task").iterdir())
    except OSError:  # no /proc: nothing to say
        return out
    for task in tasks:
        try:
            role = _role((task / "comm").read_text().strip())
            if role is None:
                continue
            out[int(task.name)] = (role, _seconds(task))
        except OSError:  # the thread has exited
            continue
    return out


def _seconds(task: Path) -> float:
    """A thread's time on a CPU: in nanoseconds from `schedstat`, else in clock ticks (10 ms, in which the
    few milliseconds a thread works between two reads may not show) from `stat`'s utime and stime."""
    try:
        return int((task / "schedstat").read_text().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        stat = (task / "stat").read_text()
        fields = stat[stat.rindex(")") + 2 :].split()  # the name may hold spaces and parentheses
        return (int(fields[11]) + int(fields[12])) / _TICK


def since(before: Marks, now: Marks | None = None) -> dict[str, float]:
    """CPU seconds by role used from `before` to `now` (both :func:`thread_cpu`; `now` read here where not
    given) by the threads alive at `now`, the roles that used any. Thread by thread: a thread that exited in
    between (an engine closed, an idle io_uring worker) takes its time with it, where a difference of sums
    by role would subtract its whole past from the others' work."""
    now = thread_cpu() if now is None else now
    out: dict[str, float] = {}
    for tid, (role, seconds) in now.items():
        prev = before.get(tid)
        used = seconds - (prev[1] if prev is not None and prev[0] == role else 0.0)
        if used > 0:
            out[role] = out.get(role, 0.0) + used
    return dict(sorted(out.items()))
