"""Resume on another parallel layout, on Nanotron's real Llama, optimizer and scheduler (cpu_ranks.py): a
checkpoint saved by every rank of one layout (gloo processes) is resumed by every rank of another, from tp,
pp, dp, cp and ZeRO stage to any other. The oracle: the state the new layout holds after the same training
from the start (initial values and gradients are drawn by position in the full tensors, so they are the
same whatever the layout; Adam is elementwise): weights, Adam moments and step counts, the scheduler and the
training metadata, every element bit for bit. Runs against each Nanotron tree (see conftest.py).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from cpu_ranks import launch
from nanotron.serialize.metadata import CheckpointMetadata

HAS_CP = "cp" in {f.name for f in dataclasses.fields(CheckpointMetadata)}
# (world size, tp, dp, pp, cp, ZeRO stage), saved -> resumed
CASES = [
    pytest.param((1, 1, 1, 1, 1, 0), (2, 2, 1, 1, 1, 0), id="single-to-tp2"),
    pytest.param((2, 2, 1, 1, 1, 0), (1, 1, 1, 1, 1, 0), id="tp2-to-single"),
    pytest.param((1, 1, 1, 1, 1, 0), (2, 1, 2, 1, 1, 1), id="single-to-dp2-zero1"),
    pytest.param((2, 1, 2, 1, 1, 1), (2, 1, 2, 1, 1, 0), id="dp2-zero1-to-zero0"),
    pytest.param((4, 2, 2, 1, 1, 1), (2, 1, 1, 2, 1, 0), id="tp2-dp2-zero1-to-pp2"),
    pytest.param((2, 1, 1, 2, 1, 0), (4, 2, 2, 1, 1, 1), id="pp2-to-tp2-dp2-zero1"),
    # Without ZeRO the replicas write the optimizer state in parts (balance_writes): read whole on one rank,
    # and resharded onto tensor-parallel ranks from the parts
    pytest.param((2, 1, 2, 1, 1, 0), (1, 1, 1, 1, 1, 0), id="dp2-parts-to-single"),
    pytest.param((2, 1, 2, 1, 1, 0), (2, 2, 1, 1, 1, 0), id="dp2-parts-to-tp2"),
]
if HAS_CP:
    CASES.append(pytest.param((2, 1, 1, 1, 2, 0), (2, 1, 2, 1, 1, 1), id="cp2-to-dp2-zero1"))


@pytest.mark.parametrize("saved, here", CASES)
def test_every_rank_resumes_the_state_its_layout_would_hold(saved, here, tmp_path):
    launch(tmp_path, *saved, mode="save")
    reports = launch(tmp_path, *here, mode="resume")
    assert len(reports) == here[0] and sum(r["tensors"] for r in reports) > 20
    for r in reports:
        assert r["differences"] == [] and r["tensors"] > 5, r["differences"][:10]
        assert r["last_train_step"] == 7
    # While the model was built, the ranks read the saved weight and optimizer files into the page cache,
    # each file by one rank.
    warmed = [f for r in reports for f in r["warmed"]]
    manifest = json.loads((tmp_path / "ckpt" / "7" / "datastates.json").read_text())
    large = [f for f in manifest["files"] if f.startswith(("model/", "optimizer/"))]
    assert sorted(warmed) == sorted(large) and any(f.startswith("optimizer/") for f in large)


def test_a_model_of_another_shape_is_refused_naming_the_tensor_on_every_rank(tmp_path, monkeypatch):
    launch(tmp_path, 1, mode="save")
    monkeypatch.setenv("CPU_RANKS_INTERMEDIATE", "48")
    reports = launch(tmp_path, 2, 2, mode="resume")
    for r in reports:
        assert r["error"] is not None and "gate_up_proj.weight" in r["error"] and "[64, 16]" in r["error"], r
        assert "the model changed" in r["error"]


def test_a_stock_checkpoint_of_another_layout_is_refused_then_resumes_once_converted(tmp_path, monkeypatch):
    """Nanotron's own checkpoint (pickles) of tp=2, dp=2, ZeRO-1: resuming it on one process would go to
    Nanotron's loader, which cannot merge those optimizer shards: refused, saying to convert it; converted
    with `convert --to datastates`, it reshards like ours."""
    import torch.distributed as tdist
    from cpu_ranks import config, parallel_context

    from nanotron_datastates.nanotron.checkpoint.convert import convert
    from nanotron_datastates.nanotron.resume.resume import Resume
    from nanotron_datastates.resume.reshard_plan import ReshardError

    launch(tmp_path, 4, 2, 2, 1, 1, 1)  # Nanotron's own save of the state, in tmp_path/stock
    for k, v in (("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("RANK", "0")):
        monkeypatch.setenv(k, v)
    tdist.init_process_group("gloo", init_method=f"file://{tmp_path}/init1", rank=0, world_size=1)
    try:
        with pytest.raises(ReshardError, match=r"tp 2 -> 1.*nanotron-datastates convert"):
            Resume().plan(config(), parallel_context(), tmp_path / "stock")
    finally:
        tdist.destroy_process_group()
    convert(tmp_path / "stock", tmp_path / "ckpt" / "7", to="datastates")
    for r in launch(tmp_path, 1, mode="resume"):
        assert r["differences"] == [] and r["tensors"] > 20, r["differences"][:10]


def test_where_one_rank_finds_the_newest_checkpoint_damaged_every_rank_falls_back(tmp_path, monkeypatch):
    """dp=2 with ZeRO-1: rank 1's optimizer shard of checkpoint 9 has a flipped byte. Rank 0 reads its own
    files whole, yet both ranks resume checkpoint 5, with the state of that step."""
    monkeypatch.setenv("CPU_RANKS_TWO", "1")
    launch(tmp_path, 2, 1, 2, 1, 1, 1, mode="save")
    (shard,) = (tmp_path / "ckpt" / "9" / "optimizer").glob("*dp-1-of-2*.safetensors")
    data = bytearray(shard.read_bytes())
    data[-12] ^= 0xFF
    shard.write_bytes(bytes(data))
    monkeypatch.setenv("CPU_RANKS_STEP", "9")
    for r in launch(tmp_path, 2, 1, 2, 1, 1, 1, mode="resume"):
        assert r["resumed_from"] == "5" and r["last_train_step"] == 5
        assert r["differences"] == [], r["differences"][:10]


def test_a_stock_zero0_checkpoint_resumes_on_another_dp_size_through_nanotron_as_without_the_adapter(
    tmp_path, monkeypatch
):
    """What Nanotron manages on its own stays allowed: a ZeRO-0 checkpoint of its own format, saved on dp=2,
    resumes on one process (its optimizer files are per tp and pp rank); the adapter leaves it to Nanotron's
    loaders, which restore every weight and Adam moment bit for bit."""
    import torch.distributed as tdist
    from cpu_ranks import config, differences, parallel_context, snapshot, training_state
    from nanotron.serialize.optimizer import load_lr_scheduler, load_optimizer
    from nanotron.serialize.weights import load_weights

    from nanotron_datastates.nanotron.resume.resume import Resume

    launch(tmp_path, 2, 1, 2, 1, 1, 0)  # Nanotron's own save, dp=2 ZeRO-0, in tmp_path/stock
    for k, v in (("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("RANK", "0")):
        monkeypatch.setenv(k, v)
    tdist.init_process_group("gloo", init_method=f"file://{tmp_path}/init1", rank=0, world_size=1)
    try:
        c, pc = config(), parallel_context()
        assert not Resume().plan(c, pc, tmp_path / "stock")  # not ours, and not refused
        expected = snapshot(*training_state(pc, c))
        model, optimizer, lr_scheduler, random_states = training_state(pc, c, seed=1)
        load_weights(model=model, parallel_context=pc, root_folder=tmp_path / "stock")
        load_optimizer(optimizer=optimizer, parallel_context=pc, root_folder=tmp_path / "stock", model=model)
        load_lr_scheduler(lr_scheduler, False, pc, tmp_path / "stock")
        got = snapshot(model, optimizer, lr_scheduler, random_states)
        for k in ("random", "lr_scheduler"):  # Nanotron's loader steps the scheduler once after loading it
            expected.pop(k), got.pop(k)
        for groups in (expected["optimizer"]["param_groups"], got["optimizer"]["param_groups"]):
            for g in groups:  # Nanotron's loader keeps the configured lr; its scheduler sets it at the step
                g.pop("lr")
        assert differences(expected, got) == []
    finally:
        tdist.destroy_process_group()
