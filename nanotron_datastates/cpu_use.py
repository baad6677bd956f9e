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


def thread_cpu_seconds() -> dict[str, float]:
    """CPU seconds (user and system) used so far by this process's engine threads, summed by role."""
    out: dict[str, float] = {}
    try:
        tasks = list(Path("/proc/self/task").iterdir())
    except OSError:  # no /proc: nothing to say
        return out
    for task in tasks:
        try:
            role = _role((task / "comm").read_text().strip())
            if role is None:
                continue
            stat = (task / "stat").read_text()
        except OSError:  # the thread has exited
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # the name may hold spaces and parentheses
        out[role] = out.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime
    return out


def since(before: dict[str, float], now: dict[str, float] | None = None) -> dict[str, float]:
    """CPU seconds by role used from `before` to `now` (both :func:`thread_cpu_seconds`; `now` read here where
    not given), the roles that used any."""
    now = thread_cpu_seconds() if now is None else now
    return {k: v - before.get(k, 0.0) for k, v in sorted(now.items()) if v - before.get(k, 0.0) > 0}
