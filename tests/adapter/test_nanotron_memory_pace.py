"""Memory checkpoints never stall training (`memory_pace`): one due while two checkpoints are still in flight
is skipped at once, never waited for, and every rank skips the same ones."""

from __future__ import annotations

import multiprocessing
import os
import signal

import cpu_stand_ins  # noqa: F401 - first: a spawned rank imports this module before Nanotron
import torch.distributed as tdist
from cpu_ranks import training_metadata
from test_nanotron_save_resume import saver_commits

from nanotron_datastates.nanotron.save import memory_pace
from nanotron_datastates.nanotron.save.saver import Saver
from nanotron_datastates.nanotron.trainer import DataStatesTrainer
from nanotron_datastates.trainer_settings import TrainerSettings

from helpers import wait_until


def _timed_out(*_) -> None:
    raise TimeoutError("the trainer waited for a memory checkpoint in flight")


def test_a_memory_checkpoint_due_while_two_are_in_flight_is_skipped_and_the_next_one_taken(rank0, tmp_path):
    """memory_interval 1, the memory tier's commits held back (its lock taken on this thread, which the
    committer's commit of each checkpoint takes): steps 1 and 2 are asked for, 3 to 5 skipped at once (a
    wait here would never end: the alarm fails the test); once the commits go through, 6 is taken."""
    pc, c, (model, optimizer, lr_scheduler, random_states), engine = rank0
    shm, ckpt = tmp_path / "shm", tmp_path / "ckpt"
    settings = TrainerSettings(memory_tier=True, memory_tier_path=str(shm), memory_interval=1)
    t = DataStatesTrainer.__new__(DataStatesTrainer)
    t.config, t.parallel_context, t.current_dataloader = c, pc, iter(())
    c.data_stages = None
    t.optimizer, t.lr_scheduler, t.random_states = optimizer, lr_scheduler, random_states
    t.iteration_step, t.s3_mover, t._ds_stepped = 1, None, True
    t.datastates = saver = Saver(engine, settings, pc, model, optimizer, ckpt)
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
    assert [r["step"] for r in saver_commits(ckpt)] == [1, 2, 6]
    saver.close()


def _agree(rank: int, init: str, ready: int, out) -> None:
    tdist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    out.put((rank, memory_pace.agreed(ready, tdist.new_group(backend="gloo"))))
    out.close()
    out.join_thread()
    os._exit(0)  # no gloo teardown (see test_replica_way.py)


def test_every_rank_takes_the_outcomes_that_every_rank_has(tmp_path):
    """Rank 0 knows 3 outcomes, rank 1 one: both take one, so both count the same checkpoints in flight."""
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    init = f"file://{tmp_path}/init"
    ranks = [context.Process(target=_agree, args=(r, init, 3 - 2 * r, out)) for r in range(2)]
    for p in ranks:
        p.start()
    answers = dict(out.get(timeout=120) for _ in ranks)
    for p in ranks:
        p.join(60)
        assert p.exitcode == 0
    assert answers == {0: 1, 1: 1}
