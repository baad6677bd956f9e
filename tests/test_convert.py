"""Converting a checkpoint folder between Nanotron's stock layout and ours: real files, engine and optimizers.

Stock random states are pickles of Nanotron's `RandomStates`: the test that holds them needs Nanotron and is
in nanotron/test_nanotron_convert.py; these run anywhere.
"""

from __future__ import annotations

import json
import os
import pickle
import re
from pathlib import Path
from typing import Any

import pytest
import safetensors
import safetensors.torch
import torch
import yaml

from nanotron_datastates import DataStatesEngine
from nanotron_datastates.checkpoint import verify
from nanotron_datastates.checkpoint.manifest import read_manifest
from nanotron_datastates.checkpoint.names import MANIFEST, as_safetensors
from nanotron_datastates.errors import ChecksumError
from nanotron_datastates.nanotron.checkpoint.convert import convert

from helpers import same

WEIGHT = "model/model/decoder/0/pp_block/attn/qkv_proj/model_weight_pp-rank-0-of-1_tp-rank-0-of-1.safetensors"
BIAS = "model/model/decoder/0/pp_block/attn/qkv_proj/model_bias_pp-rank-0-of-1_tp-rank-0-of-1.safetensors"
OPTIMIZER = "optimizer/optimizer_pp-0-of-1_tp-0-of-1_exp-0-of-1.pt"
LR_SCHEDULER = "lr_scheduler/lr_scheduler_pp-0-of-1_tp-0-of-1_exp-0-of-1.pt"
RANDOM = "random/tp-0-of-1_dp-0-of-1_pp-0-of-1.pt"
STEP = 40


def _tensor_metadata(shape: list[int]) -> dict[str, str]:
    return {  # as Nanotron's TensorMetadata.to_str_dict writes it
        "version": "1.4",
        "local_global_slices_pairs": json.dumps([[[0, shape[0], None]], [[0, shape[0], None]]]),
        "unsharded_shape": json.dumps(shape),
    }


def stock_checkpoint(folder: Path, with_random: bool) -> dict[str, Any]:
    """A checkpoint as Nanotron's `save()` writes it, from a Linear trained 2 steps with AdamW."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(8, 4)).pow(2).sum().backward()
        optimizer.step()
        scheduler.step()
    weights = {WEIGHT: model.weight.detach().clone(), BIAS: model.bias.detach().clone()}
    for rel, t in weights.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        safetensors.torch.save_file({"data": t}, folder / rel, metadata=_tensor_metadata(list(t.shape)))
    for rel, obj in ((OPTIMIZER, optimizer.state_dict()), (LR_SCHEDULER, scheduler.state_dict())):
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        torch.save(obj, folder / rel)
    (folder / "optimizer" / "optimizer_config.json").write_text(
        json.dumps({"type": "AdamW", "kwargs": {"lr": 1e-3}})
    )
    random_states = None
    if with_random:
        import nanotron.random

        random_states = nanotron.random.RandomStates(
            {"tp_synced": nanotron.random.get_current_random_state()}
        )
        (folder / RANDOM).parent.mkdir(parents=True, exist_ok=True)
        torch.save(random_states, folder / RANDOM)
    meta = {
        "version": "1.4",
        "tp": 1,
        "dp": 1,
        "metas": {
            "consumed_train_samples": 160,
            "last_train_step": STEP,
            "last_stage_idx": 0,
            "data_stages": [{"name": "Stable", "start_training_step": 1, "consumed_train_samples": 160}],
        },
        "custom_metas": None,
    }
    (folder / "checkpoint_metadata.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
    config = {
        "checkpoints": {"checkpointing_engine": "datastates", "checkpoints_path": "x"},
        "datastates": {"host_cache_size": 1},
        "parallelism": {"pp": 1, "tp": 1, "dp": 1},
        "optimizer": {"zero_stage": 0},
    }
    (folder / "config.yaml").write_text(yaml.dump(config))
    (folder / "model_config.json").write_text("{}")
    return {
        "weights": weights,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "random": random_states,
    }


def equal(a: Any, b: Any) -> bool:
    """Structures equal, tensors by dtype, shape and bytes, containers by type."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and same(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    return a == b


def flip_data_byte(path: Path) -> None:
    """Flips the first byte after the header: a tensor's data, never the header."""
    raw = bytearray(path.read_bytes())
    offset = 8 + int.from_bytes(raw[:8], "little")
    raw[offset] ^= 0xFF
    path.write_bytes(bytes(raw))


def check_datastates(folder: Path, original: dict[str, Any], with_random: bool) -> None:
    doc = read_manifest(folder)
    engine_files = {WEIGHT, BIAS, as_safetensors(OPTIMIZER), as_safetensors(LR_SCHEDULER)}
    if with_random:
        engine_files.add(as_safetensors(RANDOM))
    assert set(doc["files"]) == engine_files
    assert doc["step"] == STEP
    assert doc["topology"] == {"tp": 1, "pp": 1, "dp": 1, "cp": 1, "expert": 1, "zero_stage": 0}
    assert not list(folder.rglob("*.pt"))
    report = verify.verify(folder)
    if with_random:
        assert report.ok, report.problems
    else:  # only the random states, which this checkpoint never had, are missing
        assert report.problems and all("tp-0-of-1_dp-0-of-1_pp-0-of-1" in p for p in report.problems)
    assert report.tensors_checksummed >= 2 + 6  # weights, and the optimizer's step/exp_avg/exp_avg_sq
    for rel in (WEIGHT, BIAS):
        # Still Nanotron's weight files: its metadata verbatim, nothing of ours, one tensor "data".
        with safetensors.safe_open(folder / rel, "pt") as f:
            assert f.metadata() == _tensor_metadata(list(original["weights"][rel].shape))
            assert list(f.keys()) == ["data"]
            assert same(f.get_tensor("data"), original["weights"][rel])
    for name in ("config.yaml", "model_config.json", "optimizer/optimizer_config.json"):
        assert (folder / name).read_bytes() == (folder.parent / "stock" / name).read_bytes()


def check_torch(folder: Path, dstates: Path, original: dict[str, Any]) -> None:
    assert not (folder / MANIFEST).exists()
    assert all(p.is_relative_to(folder / "model") for p in folder.rglob("*.safetensors"))
    for rel in (WEIGHT, BIAS):
        assert (folder / rel).read_bytes() == (dstates / rel).read_bytes()
        assert same(safetensors.torch.load_file(folder / rel)["data"], original["weights"][rel])
    optimizer = torch.load(folder / OPTIMIZER, map_location="cpu", weights_only=False)
    assert equal(optimizer, original["optimizer"])
    fresh = torch.optim.AdamW(torch.nn.Linear(4, 3).parameters(), lr=1e-3)
    fresh.load_state_dict(optimizer)  # what Nanotron's load_optimizer does with it
    scheduler = torch.load(folder / LR_SCHEDULER, map_location="cpu", weights_only=False)
    assert equal(scheduler, original["scheduler"])
    config = yaml.safe_load((folder / "config.yaml").read_text())
    assert "datastates" not in config and "checkpointing_engine" not in config
    assert "checkpointing_engine" not in config["checkpoints"]
    assert config["checkpoints"]["checkpoints_path"] == "x" and config["parallelism"]["pp"] == 1
    stock = folder.parent / "stock"
    for name in ("checkpoint_metadata.json", "model_config.json", "optimizer/optimizer_config.json"):
        assert (folder / name).read_bytes() == (stock / name).read_bytes()
    report = verify.verify(folder)
    assert report.ok, report.problems


def test_round_trip_without_random_states(tmp_path: Path) -> None:
    """Everything but the random states needs no Nanotron; a caller's engine is used and left open."""
    stock = tmp_path / "stock"
    original = stock_checkpoint(stock, with_random=False)
    with DataStatesEngine(host_cache_size=1 / 64, chunk_size=1, pin_host_cache=False) as engine:
        dstates = convert(stock, tmp_path / "datastates", "datastates", engine=engine)
        check_datastates(dstates, original, with_random=False)
        back = convert(dstates, tmp_path / "torch", "torch", engine=engine)
        check_torch(back, dstates, original)
        assert engine.load(dstates / WEIGHT)["data"].shape == (3, 4)  # still open


def test_corrupt_optimizer_fails_and_leaves_nothing(tmp_path: Path) -> None:
    stock = tmp_path / "stock"
    stock_checkpoint(stock, with_random=False)
    dstates = convert(stock, tmp_path / "datastates", "datastates")
    flip_data_byte(dstates / as_safetensors(OPTIMIZER))
    out = tmp_path / "torch"
    with pytest.raises(ChecksumError):
        convert(dstates, out, "torch")
    assert not out.exists()


def test_corrupt_weight_fails_against_the_manifest(tmp_path: Path) -> None:
    """Weight files carry no checksums of their own: the manifest's catch a flipped byte in the copy."""
    stock = tmp_path / "stock"
    stock_checkpoint(stock, with_random=False)
    dstates = convert(stock, tmp_path / "datastates", "datastates")
    flip_data_byte(dstates / WEIGHT)
    out = tmp_path / "torch"
    out.mkdir()  # the caller's empty folder: left in place, empty
    with pytest.raises(ChecksumError):
        convert(dstates, out, "torch")
    assert out.is_dir() and not any(out.iterdir())


def test_unreadable_pickle_leaves_nothing(tmp_path: Path) -> None:
    """The weights' saves are in flight when the optimizer fails: they are drained, then removed."""
    stock = tmp_path / "stock"
    stock_checkpoint(stock, with_random=False)
    (stock / OPTIMIZER).write_bytes(b"not a pickle")
    out = tmp_path / "datastates"
    with pytest.raises(pickle.UnpicklingError):
        convert(stock, out, "datastates")
    assert not out.exists()


def test_refuses_what_it_cannot_convert(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such checkpoint folder"):
        convert(tmp_path / "missing", tmp_path / "out", "torch")
    (tmp_path / "a.safetensors").write_bytes(b"x")
    with pytest.raises(ValueError, match="is not a folder"):
        convert(tmp_path / "a.safetensors", tmp_path / "out", "datastates")
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("hello")
    for to in ("torch", "datastates"):
        with pytest.raises(ValueError, match=re.escape(str(junk))):
            convert(junk, tmp_path / "out", to)
    assert not (tmp_path / "out").exists()

    stock = tmp_path / "stock"
    stock_checkpoint(stock, with_random=False)
    with pytest.raises(ValueError, match=re.escape(str(stock))):  # already stock
        convert(stock, tmp_path / "out", "torch")
    with pytest.raises(ValueError, match="to='pickle'"):
        convert(stock, tmp_path / "out", "pickle")
    with pytest.raises(ValueError, match="inside"):
        convert(stock, stock / "out", "datastates")

    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=re.escape(str(out))):
        convert(stock, out, "datastates")
    assert sorted(os.listdir(out)) == ["keep.txt"]

    dstates = convert(stock, tmp_path / "datastates", "datastates")
    with pytest.raises(ValueError, match=re.escape(str(dstates))):  # already ours
        convert(dstates, tmp_path / "again", "datastates")
