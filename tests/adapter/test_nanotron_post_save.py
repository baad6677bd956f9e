"""Nanotron's post-save hooks run once a checkpoint is committed, seeing the step it was saved at: the S3
upload (both Nanotrons) and, on main, lighteval's evaluation of that checkpoint. Nanotron's own
`post_save_checkpoint` on the real trainer class; the S3 mover and lighteval runner are recorders (they would
upload and launch jobs).
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch.distributed as tdist

from nanotron_datastates.nanotron.manager import CheckpointManager
from nanotron_datastates.nanotron.resume.resume import Resume
from nanotron_datastates.nanotron.trainer import DataStatesTrainer


class Recorder:
    """Stands in for Nanotron's S3Mover and LightEvalRunner: records what the trainer held at each call."""

    def __init__(self, trainer: DataStatesTrainer) -> None:
        self.trainer, self.calls = trainer, []

    def start_uploading(self) -> None:
        self.calls.append(("upload", self.trainer.iteration_step, self.trainer.config.general.step))

    def eval_single_checkpoint(self, path: Path) -> None:
        self.calls.append(("eval", Path(path)))


@pytest.fixture
def trainer(tmp_path):
    tdist.init_process_group("gloo", init_method=f"file://{tmp_path}/init", rank=0, world_size=1)
    t = DataStatesTrainer.__new__(DataStatesTrainer)
    t.config = types.SimpleNamespace(
        checkpoints=types.SimpleNamespace(checkpoints_path=tmp_path / "ckpt", checkpoint_interval=10),
        general=types.SimpleNamespace(step=25),
        lighteval=None,
    )
    t.parallel_context = types.SimpleNamespace(world_pg=tdist.group.WORLD)
    t.iteration_step = 25  # training moved on since the checkpoint of step 20 was asked for
    t.datastates = CheckpointManager(t, Resume())
    yield t
    tdist.destroy_process_group()


def test_s3_upload_sees_the_checkpoints_step(trainer):
    trainer.s3_mover = Recorder(trainer)
    trainer.datastates.post_save(20)
    assert trainer.s3_mover.calls == [("upload", 20, 20)]
    assert (trainer.iteration_step, trainer.config.general.step) == (25, 25)


def test_lighteval_evaluates_the_committed_checkpoint(trainer, tmp_path):
    """Nanotron main evaluates a checkpoint from its post-save hook; 2cde8f6 has no lighteval there."""
    trainer.s3_mover = None
    trainer.config.lighteval = types.SimpleNamespace(eval_interval=10)
    trainer.lighteval_runner = Recorder(trainer)
    trainer.datastates.post_save(20)
    has_lighteval = "lighteval" in DataStatesTrainer.post_save_checkpoint.__code__.co_names
    expected = [("eval", tmp_path / "ckpt" / "20")] if has_lighteval else []
    assert trainer.lighteval_runner.calls == expected
    trainer.datastates.post_save(25)  # not on the evaluation interval
    assert trainer.lighteval_runner.calls == expected
    assert trainer.iteration_step == 25
