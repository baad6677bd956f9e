"""CPU time of the engine's threads, by role, read from /proc: where a checkpoint's work runs, and how much
of it competes with the threads that feed the GPU.

The core names its threads `ds-<role>` (`copy`, `copy-host`, `flush`, `parse`, `pin`, `cache-prep`); the
kernel names the workers that carry io_uring's buffered I/O `iou-wrk-<tid>`, counted as `io_uring`. A
thread's time is counted while it lives: io_uring's workers exit when idle, so their figure is a floor.
"""

from __future__ import annotations

import os

_TICK = os.sysconf("SC_CLK_TCK")
_TASKS = "/proc/self/task"


def _role(comm: str) -> str | None:
    if comm.startswith("ds-"):
        return comm[3:]
    if comm.startswith("iou-wrk"):
        return "io_uring"
    return None


Marks = dict[int, tuple[str, float]]
"""Engine threads by thread id: (role, CPU seconds used so far)."""


_RECHECK = 64  # calls after which a thread's name is read again where it was not an engine thread's


class _Names:
    """Each listed thread's role (None: not the engine's), as the last call found it: a thread's name is
    read once, not at every call. A thread is named by itself once started, so a thread first seen without
    an engine name is asked again every `_RECHECK` calls."""

    roles: dict[str, str | None] = {}
    calls = 0


def thread_cpu() -> Marks:
    """CPU seconds (user and system) used so far by each of this process's engine threads, with its role.
    Read with plain descriptors, not path objects, and each thread's name once (`_Names`): a committer
    reads it at every checkpoint, holding the GIL between reads, and the process has tens of threads
    (torch's, NCCL's, the engine's); reading every one's name took about a millisecond a call."""
    out: Marks = {}
    try:
        tasks = os.listdir(_TASKS)
    except OSError:  # no /proc: nothing to say
        return out
    _Names.calls += 1
    recheck = _Names.calls % _RECHECK == 0
    known: dict[str, str | None] = _Names.roles
    roles: dict[str, str | None] = {}
    for tid in tasks:
        try:
            if tid in known and (known[tid] is not None or not recheck):
                role = known[tid]
            else:
                role = _role(_read(f"{_TASKS}/{tid}/comm").strip())
            roles[tid] = role
            if role is not None:
                out[int(tid)] = (role, _seconds(f"{_TASKS}/{tid}"))
        except OSError:  # the thread has exited
            continue
    _Names.roles = roles  # replaced whole: the threads gone are forgotten (another caller may be reading)
    return out


def thread_seconds(tid: int | str) -> float:
    """CPU seconds used so far by thread `tid` of this process, any thread (OSError once it has exited)."""
    return _seconds(f"{_TASKS}/{tid}")


def _read(path: str) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 4096).decode(errors="replace")
    finally:
        os.close(fd)


def _seconds(task: str) -> float:
    """A thread's time on a CPU: in nanoseconds from `schedstat`, else in clock ticks (10 ms, in which the
    few milliseconds a thread works between two reads may not show) from `stat`'s utime and stime."""
    try:
        return int(_read(f"{task}/schedstat").split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        stat = _read(f"{task}/stat")
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
