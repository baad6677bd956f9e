"""The read-ahead started with the trainer's construction (early.py): which files it guesses every rank reads,
from the config and the manifest alone, and where it guesses nothing. Reading them is prefetch.py's, tested
in test_nanotron_prefetch.py; a GPU resume adopts it (the benchmarks' logs say so).

Runs against each Nanotron tree (see conftest.py).
"""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import yaml

from nanotron_datastates.nanotron import config as ds_config  # noqa: E402
from nanotron_datastates.nanotron import early, layout  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "config_tiny_llama_datastates.yaml"
OPTIMIZER = "optimizer/optimizer_pp-rank-0-of-1_tp-rank-0-of-1_exp-rank-0-of-1.safetensors"
TOPOLOGY = {"tp": 1, "pp": 1, "dp": 1, "expert": 1, "zero_stage": 0}


def checkpoint(root: Path, step: int = 7, topology=None, optimizers=(OPTIMIZER,)) -> Path:
    """A checkpoints folder holding one committed step (a manifest naming its files) and latest.txt."""
    files = ["model/model/decoder/0/w.safetensors", "model/model/lm_head/w.safetensors", *optimizers]
    files += ["optimizer/optimizer_config.json", "random/tp-0-of-1_dp-0-of-1_pp-0-of-1.safetensors"]
    folder = root / str(step)
    folder.mkdir(parents=True)
    doc = layout.manifest(step, topology or TOPOLOGY, {f: {"bytes": 1} for f in files})
    (folder / layout.MANIFEST).write_text(json.dumps(doc))
    (root / "latest.txt").write_text(str(step))
    return folder


def config_file(tmp_path: Path, resume: Path | None, **parallelism) -> Path:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["checkpoints"]["resume_checkpoint_path"] = None if resume is None else str(resume)
    doc["parallelism"].update(parallelism)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def guess(tmp_path: Path, resume: Path | None, **parallelism):
    ds_config.register()
    config = early._config((str(config_file(tmp_path, resume, **parallelism)),), {})
    root = early._resume_folder(config)
    return root, (early._files(config, layout.read_manifest(root), root) if root is not None else None)


def test_every_weight_file_and_the_one_optimizer_file_of_the_latest_step(tmp_path):
    folder = checkpoint(tmp_path / "ckpt")
    root, (weights, optimizer) = guess(tmp_path, tmp_path / "ckpt")
    assert root == folder  # latest.txt followed, as Nanotron does
    assert weights == [folder / f"model/model/{w}/w.safetensors" for w in ("decoder/0", "lm_head")]
    assert optimizer == folder / OPTIMIZER


def test_a_step_folder_itself_is_resumed_from(tmp_path):
    folder = checkpoint(tmp_path / "ckpt")
    (folder / "model_config.json").write_text("{}")  # how Nanotron recognises a step folder
    assert guess(tmp_path, folder)[0] == folder


@pytest.mark.parametrize(
    "saved, here",
    [
        ({**TOPOLOGY, "dp": 2}, {}),  # another layout: the trainer reshards, nothing is guessed
        ({**TOPOLOGY, "tp": 2}, {"tp": 2}),  # the model spread over ranks: which files a rank reads varies
        ({**TOPOLOGY, "zero_stage": 1}, {}),
    ],
)
def test_nothing_is_guessed_where_ranks_read_different_files(tmp_path, saved, here):
    checkpoint(tmp_path / "ckpt", topology=saved)
    _, (weights, optimizer) = guess(tmp_path, tmp_path / "ckpt", **here)
    assert weights == [] and optimizer is None


def test_several_optimizer_files_leave_the_optimizer_to_the_trainer(tmp_path):
    other = OPTIMIZER.replace("tp-rank-0", "tp-rank-1")
    checkpoint(tmp_path / "ckpt", optimizers=(OPTIMIZER, other))
    _, (weights, optimizer) = guess(tmp_path, tmp_path / "ckpt")
    assert len(weights) == 2 and optimizer is None


def test_no_resume_and_a_folder_without_a_manifest_start_nothing(tmp_path):
    assert guess(tmp_path, None)[0] is None
    stock = tmp_path / "stock"
    (stock / "3").mkdir(parents=True)
    (stock / "latest.txt").write_text("3")  # Nanotron's own checkpoint: its loaders read it
    assert guess(tmp_path, stock)[0] is None


def test_the_config_is_parsed_from_positional_and_keyword_arguments(tmp_path):
    from nanotron.config import Config

    ds_config.register()
    path = str(config_file(tmp_path, None))
    by_position = early._config((path, Config), {})
    by_keyword = early._config((), {"config_or_config_file": path, "config_class": Config})
    assert by_position.checkpoints == by_keyword.checkpoints
    assert by_position.datastates == by_keyword.datastates


def test_start_never_raises_and_starts_nothing_it_cannot_use(tmp_path):
    assert early.start((str(tmp_path / "missing.yaml"),), {}) is None
    if not torch.cuda.is_available():  # a CPU trainer reads no checkpoint ahead
        checkpoint(tmp_path / "ckpt")
        assert early.start((str(config_file(tmp_path, tmp_path / "ckpt")),), {}) is None


def test_an_early_read_is_adopted_only_for_the_same_files_on_the_same_device(tmp_path):
    a = early.EarlyRead(tmp_path, None, None, [tmp_path / "w"], tmp_path / "o", torch.device("cuda", 0))
    assert a.matches(tmp_path, [tmp_path / "w"], tmp_path / "o", torch.device("cuda", 0))
    assert not a.matches(tmp_path, [tmp_path / "w"], tmp_path / "o", torch.device("cuda", 1))
    assert not a.matches(tmp_path, [tmp_path / "w"], None, torch.device("cuda", 0))
    assert not a.matches(tmp_path, [], tmp_path / "o", torch.device("cuda", 0))


def test_context_parallel_ranks_read_the_whole_model(tmp_path):
    """Where this Nanotron has context parallelism: a checkpoint saved with cp=2 is read ahead by a cp=2
    layout (each of its ranks holds the whole model); one saved before cp existed (no cp in its manifest)
    is not, by a layout with cp=2."""
    from nanotron.config import ParallelismArgs

    if "context_parallel_size" not in {f.name for f in dataclasses.fields(ParallelismArgs)}:
        with pytest.raises(Exception, match="context_parallel_size"):  # a Nanotron without it refuses the key
            guess(tmp_path, checkpoint(tmp_path / "ckpt"), context_parallel_size=2)
        return
    folder = checkpoint(tmp_path / "a", topology={**TOPOLOGY, "cp": 2})
    _, (weights, optimizer) = guess(tmp_path, tmp_path / "a", context_parallel_size=2)
    assert len(weights) == 2 and optimizer == folder / OPTIMIZER
    checkpoint(tmp_path / "b")
    assert guess(tmp_path, tmp_path / "b", context_parallel_size=2)[1] == ([], None)
    assert guess(tmp_path, tmp_path / "b", context_parallel_size=1)[1][1] is not None
