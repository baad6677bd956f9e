"""The engine's threads carry their role in their name (`ds-<role>`), and cpu_use adds up their CPU time by
role from /proc: what a checkpoint's work takes from the machine's cores."""

import os
from pathlib import Path

import pytest
import torch

from nanotron_datastates import DataStatesEngine, cpu_use

from helpers import small_config


def thread_names() -> set[str]:
    return {(t / "comm").read_text().strip() for t in Path("/proc/self/task").iterdir()}


def test_the_engines_threads_are_named_for_their_role_and_go_with_it(tmp_path):
    with DataStatesEngine(small_config()):
        names = thread_names()
        assert {"ds-parse", "ds-copy", "ds-copy-host", "ds-flush", "ds-pin"} <= names, names
    assert not {n for n in thread_names() if n.startswith("ds-")}


def nice_by_name() -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for t in Path("/proc/self/task").iterdir():
        stat = (t / "stat").read_text()
        nice = int(stat[stat.rindex(")") + 2 :].split()[16])  # field 19 of proc(5)
        out.setdefault((t / "comm").read_text().strip(), set()).add(nice)
    return out


@pytest.mark.parametrize("backend", ["io_uring", "pwrite"])
def test_the_flush_workers_run_below_the_trainings_priority_and_the_others_do_not(tmp_path, backend):
    base = os.getpriority(os.PRIO_PROCESS, 0)  # this thread's nice, which the engine's threads start from
    with DataStatesEngine(small_config(flush_nice=7, io_backend=backend)) as engine:
        engine.save({"x": torch.randn(1 << 20)}, tmp_path / "f.safetensors").wait_persisted()
        nice = nice_by_name()
    assert nice["ds-flush"] == {min(19, base + 7)}, nice
    for role in ("ds-parse", "ds-copy", "ds-copy-host", "ds-pin"):
        assert nice[role] == {base}, (role, nice)
    with DataStatesEngine(small_config(flush_nice=0, io_backend=backend)):
        assert nice_by_name()["ds-flush"] == {base}


def test_the_cpu_of_a_save_is_counted_by_role(tmp_path):
    state = {"x": torch.randn(16 << 20)}  # 64 MiB of host tensors: copied and summed by the copy threads
    before = cpu_use.thread_cpu()
    with DataStatesEngine(small_config()) as engine:
        for i in range(4):
            engine.save(state, tmp_path / f"f{i}.safetensors").wait_persisted()
        used = cpu_use.since(before)
        roles = {role for role, _ in cpu_use.thread_cpu().values()}
    assert used.get("copy-host", 0.0) > 0.0, used
    assert set(used) <= roles and all(v > 0 for v in used.values())


def test_a_thread_that_exits_between_two_reads_takes_only_its_own_time(tmp_path):
    # The first engine's copy threads work more than the second's, and exit between the two reads: their
    # past must not be taken from the second engine's threads of the same role.
    state = {"x": torch.randn(16 << 20)}
    first = DataStatesEngine(small_config())
    for i in range(8):
        first.save(state, tmp_path / f"a{i}.safetensors").wait_persisted()
    before = cpu_use.thread_cpu()
    first.close()
    with DataStatesEngine(small_config()) as second:
        second.save(state, tmp_path / "b.safetensors").wait_persisted()
        used = cpu_use.since(before)
    assert used.get("copy-host", 0.0) > 0.0, used


def test_each_checkpoints_outcome_carries_the_cpu_its_saves_took(tmp_path):
    from nanotron_datastates.save.commit import Committer, PendingCheckpoint

    state = {"x": torch.randn(16 << 20)}
    with DataStatesEngine(small_config()) as engine:
        committer = Committer(None)
        handles = [engine.save(state, tmp_path / "1" / f"f{i}.safetensors") for i in range(4)]
        committer.submit(PendingCheckpoint(1, tmp_path / "1", handles))
        (result,) = committer.take(1)
        committer.close()
    assert result.committed and result.engine_cpu_s.get("copy-host", 0.0) > 0.0, result.engine_cpu_s


def test_any_threads_cpu_is_read_to_below_a_tick_and_an_exited_one_raises():
    import threading
    import time

    tid = threading.get_native_id()
    before = cpu_use.thread_seconds(tid)
    t0 = time.thread_time()
    while time.thread_time() - t0 < 0.005:  # half a clock tick: schedstat's nanoseconds see it
        pass
    assert cpu_use.thread_seconds(tid) - before >= 0.004
    worker = threading.Thread(target=lambda: None)
    worker.start()
    gone = worker.native_id
    worker.join()  # returns before the kernel's thread is gone: wait for its entry to go
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/self/task/{gone}") and time.monotonic() < deadline:
        time.sleep(0.001)
    with pytest.raises(OSError):
        cpu_use.thread_seconds(gone)


def test_a_threads_name_is_read_once_and_a_thread_named_late_is_found_within_a_recheck():
    """Each thread's name is read once (the committer reads the engine's CPU at every checkpoint); a thread
    seen before it names itself `ds-<role>` is counted from the next recheck on."""
    import ctypes
    import threading

    libc = ctypes.CDLL(None, use_errno=True)
    named, go, done = threading.Event(), threading.Event(), threading.Event()

    def late() -> None:
        go.wait()
        assert libc.prctl(15, b"ds-late", 0, 0, 0) == 0  # PR_SET_NAME
        named.set()
        done.wait()

    worker = threading.Thread(target=late)
    worker.start()
    try:
        first = cpu_use.thread_cpu()  # the worker still bears its creator's name
        assert worker.native_id not in first
        go.set()
        named.wait()
        recheck = cpu_use._RECHECK - cpu_use._Names.calls % cpu_use._RECHECK  # the calls to the next one
        seen = [worker.native_id in cpu_use.thread_cpu() for _ in range(recheck + 2)]
        assert seen == [False] * (recheck - 1) + [True] * 3  # its name read again at the recheck only, kept
        assert cpu_use.thread_cpu()[worker.native_id][0] == "late"
    finally:
        go.set()
        done.set()
        worker.join()
