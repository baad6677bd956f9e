"""Which files a rank reads on resume (`files_to_read`): before the process groups exist, from the
config and the manifest alone (what the read-ahead from the trainer's first line reads: only what every rank
reads), and with a rank's place in the groups. Reading them is read_ahead.py's, tested in
test_nanotron_prefetch.py; a GPU resume adopts the early read-ahead (the benchmarks' logs say so).

Runs against each Nanotron tree (see conftest.py).
"""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import yaml

from nanotron_datastates.checkpoint.manifest import ManifestError, read_manifest
from nanotron_datastates.checkpoint.manifest import manifest as make_manifest
from nanotron_datastates.checkpoint.names import MANIFEST, Place
from nanotron_datastates.checkpoint.reads import files_to_read, weight_files
from nanotron_datastates.nanotron import yaml_config as ds_config  # noqa: E402
from nanotron_datastates.nanotron.resume import source as target  # noqa: E402
from nanotron_datastates.nanotron.resume.resume import Resume  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "config_tiny_llama_datastates.yaml"
OPTIMIZER = "optimizer/optimizer_pp-0-of-1_tp-0-of-1_exp-0-of-1.safetensors"
RANDOM = "random/tp-0-of-1_dp-0-of-1_pp-0-of-1.safetensors"
TOPOLOGY = {"tp": 1, "pp": 1, "dp": 1, "expert": 1, "zero_stage": 0}


def checkpoint(root: Path, step: int = 7, topology=None, optimizers=(OPTIMIZER,)) -> Path:
    """A checkpoints folder holding one committed step (a manifest naming its files) and latest.txt."""
    files = ["model/model/decoder/0/w.safetensors", "model/model/lm_head/w.safetensors", *optimizers]
    files += [RANDOM]
    folder = root / str(step)
    folder.mkdir(parents=True)
    doc = make_manifest(step, topology or TOPOLOGY, {f: {"bytes": 1} for f in files})
    (folder / MANIFEST).write_text(json.dumps(doc))
    (root / "latest.txt").write_text(str(step))
    return folder


def config_file(tmp_path: Path, resume: Path | None, **parallelism) -> Path:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["checkpoints"]["resume_checkpoint_path"] = None if resume is None else str(resume)
    doc["parallelism"].update(parallelism)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def guess(tmp_path: Path, resume: Path | None, place: Place | None = None, **parallelism):
    """(folder, (weights, optimizer)) the config resumes from and reads, where no process group exists."""
    ds_config.register()
    config = target.parse_config((str(config_file(tmp_path, resume, **parallelism)),), {})
    root = target.resume_folder(config)
    if root is None:
        return None, None
    reads = files_to_read(
        read_manifest(root), root, target.asked_layout(config), place, **target.loads(config)
    )
    return root, ([], ()) if reads is None else (reads.weights, reads.optimizer)


def test_every_weight_file_and_the_one_optimizer_file_of_the_latest_step(tmp_path):
    folder = checkpoint(tmp_path / "ckpt")
    root, (weights, optimizer) = guess(tmp_path, tmp_path / "ckpt")
    assert root == folder  # latest.txt followed, as Nanotron does
    assert weights == [folder / f"model/model/{w}/w.safetensors" for w in ("decoder/0", "lm_head")]
    assert optimizer == (folder / OPTIMIZER,)


def test_a_step_folder_itself_is_resumed_from(tmp_path):
    folder = checkpoint(tmp_path / "ckpt")
    (folder / "model_config.json").write_text("{}")  # how Nanotron recognises a step folder
    assert guess(tmp_path, folder)[0] == folder


def test_an_optimizer_file_in_parts_is_read_whole_by_every_replica_and_refused_without_a_part(tmp_path):
    """Without ZeRO, the replicas write the optimizer file in parts: every rank reads all of them, before
    its place is known and after; a manifest that lacks one is refused, naming the file."""
    parts = [OPTIMIZER.replace(".safetensors", f"_part-{k}-of-2.safetensors") for k in (1, 0)]
    folder = checkpoint(tmp_path / "ckpt", topology={**TOPOLOGY, "dp": 2}, optimizers=parts)
    assert guess(tmp_path, tmp_path / "ckpt", dp=2)[1][1] == (folder / parts[1], folder / parts[0])
    doc = read_manifest(folder)
    here = {**TOPOLOGY, "cp": 1, "dp": 2, "zero_stage": 0}
    place = Place(tp=(0, 1), dp=(1, 2), pp=(0, 1))
    reads = files_to_read(doc, folder, here, place, optimizer=True, scheduler=True)
    assert reads.optimizer == (folder / parts[1], folder / parts[0])
    del doc["files"][parts[0]]
    with pytest.raises(ManifestError, match=r"optimizer_pp-0-of-1_tp-0-of-1_exp-0-of-1.safetensors: .*\[0\]"):
        files_to_read(doc, folder, here, place, optimizer=True, scheduler=True)


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
    assert weights == [] and optimizer == ()


def test_several_optimizer_files_leave_the_optimizer_to_the_trainer(tmp_path):
    other = OPTIMIZER.replace("_pp-0-of-1_", "_pp-0-of-1_dp-1-of-2_")
    checkpoint(tmp_path / "ckpt", optimizers=(OPTIMIZER, other))
    _, (weights, optimizer) = guess(tmp_path, tmp_path / "ckpt")
    assert len(weights) == 2 and optimizer == ()


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
    by_position = target.parse_config((path, Config), {})
    by_keyword = target.parse_config((), {"config_or_config_file": path, "config_class": Config})
    assert by_position.checkpoints == by_keyword.checkpoints
    assert by_position.datastates == by_keyword.datastates


def test_start_never_raises_and_starts_nothing_it_cannot_use(tmp_path):
    assert not Resume.start((str(tmp_path / "missing.yaml"),), {}).prefetch
    if not torch.cuda.is_available():  # a CPU trainer reads no checkpoint ahead
        checkpoint(tmp_path / "ckpt")
        started = Resume.start((str(config_file(tmp_path, tmp_path / "ckpt")),), {})
        assert started.state == "idle" and started.prefetch is None and started.engine is None


def test_with_its_place_a_rank_reads_its_own_optimizer_shard_and_random_states(tmp_path):
    """ZeRO-1 over two data-parallel ranks: before the process groups nothing tells the two shards apart;
    with its place, each rank reads its own, and its own random states and the scheduler first."""
    shards = [f"optimizer/optimizer_pp-0-of-1_dp-{r}-of-2_tp-0-of-1_exp-0-of-1.safetensors" for r in (0, 1)]
    folder = checkpoint(tmp_path / "ckpt", topology={**TOPOLOGY, "dp": 2, "zero_stage": 1}, optimizers=shards)
    assert guess(tmp_path, tmp_path / "ckpt", dp=2)[1][1] == ()
    place = Place(tp=(0, 1), dp=(1, 2), pp=(0, 1))
    doc = read_manifest(folder)
    here = {**TOPOLOGY, "cp": 1, "dp": 2, "zero_stage": 1}
    reads = files_to_read(doc, folder, here, place, optimizer=True, scheduler=True)
    assert reads.optimizer == (folder / shards[1],) and len(reads.weights) == 2
    assert folder / "random/tp-0-of-1_dp-1-of-2_pp-0-of-1.safetensors" in reads.small
    assert folder / "lr_scheduler/lr_scheduler_pp-0-of-1_tp-0-of-1_exp-0-of-1.safetensors" in reads.small
    assert files_to_read(doc, folder, here, place, optimizer=False, scheduler=True).optimizer == ()


@pytest.mark.parametrize(
    "entry",
    [
        "/etc/passwd.safetensors",
        "model/../../x.safetensors",
        "model/./w.safetensors",
        "other/w.safetensors",
        "model/w.bin",
        "model",
        "",
    ],
)
def test_a_manifest_naming_anything_but_a_file_of_the_layout_is_refused(tmp_path, entry):
    folder = checkpoint(tmp_path / "ckpt")
    doc = json.loads((folder / MANIFEST).read_text())
    doc["files"][entry] = {"bytes": 1}
    (folder / MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(ManifestError, match="entry"):
        read_manifest(folder)


def test_a_file_of_the_manifest_linked_out_of_the_checkpoint_is_refused(tmp_path):
    folder = checkpoint(tmp_path / "ckpt")
    (tmp_path / "elsewhere.safetensors").write_bytes(b"")
    (folder / "model" / "model" / "lm_head").mkdir(parents=True)
    (folder / "model/model/lm_head/w.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    with pytest.raises(ManifestError, match="link out of the checkpoint"):
        weight_files(read_manifest(folder), folder)


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
    assert len(weights) == 2 and optimizer == (folder / OPTIMIZER,)
    checkpoint(tmp_path / "b")
    assert guess(tmp_path, tmp_path / "b", context_parallel_size=2)[1] == ([], ())
    assert guess(tmp_path, tmp_path / "b", context_parallel_size=1)[1][1] is not None
