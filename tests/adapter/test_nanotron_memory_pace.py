"""Memory checkpoints never stall training (`memory_pace`): one due while two checkpoints are still in flight
is skipped at once, never waited for, and every rank skips the same ones."""

from __future__ import annotations

import os
import signal

import cpu_stand_ins  # noqa: F401 - first: a spawned rank imports this module before Nanotron
import torch.distributed as tdist
from cpu_ranks import training_metadata, two_gloo_ranks
from test_nanotron_save_resume import memory_trainer, saver_commits

from nanotron_datastates.nanotron.save import memory_pace

from helpers import wait_until


def _timed_out(*_) -> None:
    raise TimeoutError("the trainer waited for a memory checkpoint in flight")


def test_a_memory_checkpoint_due_while_two_are_in_flight_is_skipped_and_the_next_one_taken(rank0, tmp_path):
    """memory_interval 1, the memory tier's commits held back (its lock taken on this thread, which the
    committer's commit of each checkpoint takes): steps 1 and 2 are asked for, 3 to 5 skipped at once (a
    wait here would never end: the alarm fails the test); once the commits go through, 6 is taken."""
    t, saver = memory_trainer(rank0, tmp_path, every=1, iteration=1)
    t.datastates.stepped = True
    saver.start()
    saver.after_first_step()

    def iteration(at: int) -> None:
        t.metadata = training_metadata(at)
        t._update_dataloader_based_on_training_stages(None)
        saver.before_step()
        saver.after_step()

    before = signal.signal(signal.SIGALRM, _timed_out)
    signal.alarm(60)
    try:
        with saver.tier._lock:
            for at in range(1, 6):
                iteration(at)
            assert saver.memory_step == 2 and saver.memory_skipped == [3, 4, 5] and saver.outstanding == 2
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)
    assert wait_until(lambda: saver.committer.ready() == 2)
    iteration(6)
    assert saver.memory_step == 6 and saver.memory_skipped == [3, 4, 5]
    saver.take(saver.outstanding, lambda s: None)
    assert [r["step"] for r in saver_commits(tmp_path / "ckpt")] == [1, 2, 6]
    saver.close()


def _agree(rank: int, init: str, ready: int, out) -> None:
    tdist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    out.put((rank, memory_pace.agreed(ready, tdist.new_group(backend="gloo"))))
    out.close()
    out.join_thread()
    os._exit(0)  # no gloo teardown (see test_replica_way.py)


def test_every_rank_takes_the_outcomes_that_every_rank_has(tmp_path):
    """Rank 0 knows 3 outcomes, rank 1 one: both take one, so both count the same checkpoints in flight."""
    init = f"file://{tmp_path}/init"
    assert two_gloo_ranks(_agree, lambda rank: (init, 3 - 2 * rank)) == {0: 1, 1: 1}
