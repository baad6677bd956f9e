"""A restart from storage whose newest checkpoint holds a FIFO where one of its files belongs (a weight file,
the optimizer's, the scheduler's, the random states', Nanotron's metadata, the manifest): the file is taken
for an unreadable one, at once, and every rank falls back to the previous committed checkpoint. A reader
that waited on the FIFO would hang the restart forever: the resume runs on a thread with a deadline. A save
never writes through a link left where a checkpoint's folder goes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from cpu_ranks import differences
from test_nanotron_save_resume import resumed, two_checkpoints

from nanotron_datastates import DataStatesEngine, trust
from nanotron_datastates.checkpoint.names import MANIFEST, NANOTRON_METADATA

from helpers import small_config, within

DEADLINE = 30.0  # seconds; the resume and its fallback take a few


def _weight(folder: Path) -> Path:
    return next((folder / "model").rglob("*.safetensors"))


def _one(sub: str) -> Any:
    return lambda folder: next((folder / sub).glob("*.safetensors"))


FILES = {
    "weight file": _weight,
    "optimizer file": _one("optimizer"),
    "scheduler file": _one("lr_scheduler"),
    "random states": _one("random"),
    "training metadata": lambda folder: folder / NANOTRON_METADATA,
    "manifest": lambda folder: folder / MANIFEST,
}


@pytest.mark.parametrize("which", FILES)
def test_a_fifo_in_the_newest_checkpoint_falls_back_to_the_previous_one(rank0, tmp_path, which):  # noqa: F811
    first, _ = two_checkpoints(rank0, tmp_path / "ckpt")
    newest = tmp_path / "ckpt" / "7"
    path = FILES[which](newest)
    path.unlink()
    os.mkfifo(path)
    box = within(lambda: resumed(rank0, newest), DEADLINE, fifos=(path,))
    assert "error" not in box, box["error"]
    resume, got, metadata = box["out"]
    assert resume.folder == tmp_path / "ckpt" / "5" and metadata.last_train_step == 5
    got.pop("random"), first.pop("random")
    assert differences(first, got) == []


def test_a_step_folder_left_as_a_link_is_never_written_through(tmp_path):
    """A checkpoint's folder that is a link (to another run's step, left by hand) fails that checkpoint's
    queuing, naming it, before any file is written there."""
    from nanotron_datastates.nanotron.save.rank_files import targets
    from nanotron_datastates.save.commit import PendingCheckpoint

    other = tmp_path / "other_run" / "20"
    other.mkdir(parents=True)
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "20").symlink_to(other, target_is_directory=True)
    with DataStatesEngine(small_config()) as engine:
        plan = engine.plan({"w": torch.ones(4)})
        with pytest.raises(trust.UntrustedPath, match="link") as e:
            targets(None, PendingCheckpoint(20, root / "20", []), [(Path("model/w.safetensors"), plan)])
        assert str(root / "20") in str(e.value)
        (root / "20").unlink()
        paths, _, _ = targets(None, PendingCheckpoint(20, root / "20", []), [(Path("w.safetensors"), plan)])
        assert paths[0][1] == str(root / "20" / "w.safetensors")  # a real folder (or none yet): taken
    assert list(other.iterdir()) == []
