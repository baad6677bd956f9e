"""The replicas' NCCL calls made at the optimizer steps (tier/step_order.py): two ranks whose transfer threads
hand over their calls at different moments, and whose training threads reach their steps at different
moments, make every call at the same step, in the same order; the calls left after the last step are made
then (what is ready by the training thread, the rest by the transfer thread). Real processes, a real gloo
group, real threads."""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp

CALLS, STEPS = 12, 40


def rank_main(rank: int, world: int, work: str) -> None:
    import torch.distributed as dist

    from nanotron_datastates.tier.step_order import StepOrder

    dist.init_process_group("gloo", init_method=f"file://{work}/init", rank=rank, world_size=world)
    order = StepOrder(dist.new_group(backend="gloo"))
    made: list[tuple[int, int, str]] = []  # (call, the step it was made at, at a step or after the last)
    rng = random.Random(rank)
    last = threading.Event()  # the training thread is past its last step

    def transfer() -> None:  # the replicas' thread: a call ready now and then, each waited for in turn
        for k in range(CALLS):
            time.sleep(rng.uniform(0, 0.02))
            done = order.submit(
                lambda k=k: made.append((k, order.steps, "after" if last.is_set() else "step"))
            )
            if k % 3 == 2:
                done.result()  # as a link waits for a wave's works before reusing its slot

    thread = threading.Thread(target=transfer, name="transfer")
    thread.start()
    for _ in range(STEPS // 2):  # the training thread
        time.sleep(rng.uniform(0, 0.01))
        order.at_step()
    last.set()
    order.finish()  # after the last step: what is ready now, then the transfer thread makes its own
    thread.join(300)
    Path(work, f"made{rank}.json").write_text(json.dumps(made))
    dist.destroy_process_group()


@pytest.mark.slow
def test_every_rank_makes_each_call_at_the_same_step_and_the_rest_after_the_last(tmp_path):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(r, 2, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
        assert p.exitcode == 0
    made = [json.loads((tmp_path / f"made{r}.json").read_text()) for r in range(2)]
    assert [k for k, _, _ in made[0]] == list(range(CALLS)) == [k for k, _, _ in made[1]]
    at_steps = [[(k, step) for k, step, when in m if when == "step"] for m in made]
    assert at_steps[0] == at_steps[1]  # the same calls at the same steps on both ranks
    assert at_steps[0], "no call was made at a step"
    later = [[k for k, _, when in m if when == "after"] for m in made]
    assert later[0] == later[1]  # after the last step: the same calls


def test_finish_makes_the_ready_calls_before_any_later_one_and_never_two_at_once():
    """`finish` (the training thread) makes the calls ready while the replicas' thread hands over more: those
    are made after the ready ones, in order, never while another call runs (a communicator is not
    thread-safe: two threads queuing NCCL calls on it at once crashed a GPU run)."""
    from nanotron_datastates.tier.step_order import StepOrder

    order = StepOrder(group=None)  # no step is taken: `at_step`, the only user of the group, is not called
    made: list[int] = []
    running = threading.Lock()
    overlaps = []

    def call(k: int) -> int:
        if not running.acquire(blocking=False):
            overlaps.append(k)
            running.acquire()
        try:
            time.sleep(0.002)  # long enough for the other thread to come in
            made.append(k)
            return k
        finally:
            running.release()

    ready = [order.submit(lambda k=k: call(k)) for k in range(20)]  # ready before the last step
    started = threading.Event()

    def transfer() -> None:  # the replicas' thread goes on handing over calls, a few waves ahead
        started.set()
        later = []
        for k in range(20, 40):
            later.append(order.submit(lambda k=k: call(k)))
            time.sleep(0.001)
        assert [f.result(timeout=30) for f in later] == list(range(20, 40))

    thread = threading.Thread(target=transfer)
    thread.start()
    started.wait(10)
    order.finish()
    thread.join(300)
    assert [f.result(timeout=1) for f in ready] == list(range(20))
    assert overlaps == []
    assert made == list(range(40))
