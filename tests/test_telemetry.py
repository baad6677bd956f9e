"""The engine's telemetry (`telemetry_path`): one JSON line per saved file once it is persisted or failed,
in the format `nanotron-datastates plot` draws (the Nanotron trainer's, per checkpoint)."""

import errno

import pytest
import torch

from nanotron_datastates import DataStatesEngine, telemetry
from nanotron_datastates.cli import main

from helpers import injected_fault, small_config


def test_one_line_per_file_saved_and_one_for_a_failure(tmp_path):
    log = tmp_path / "telemetry.jsonl"
    with DataStatesEngine(small_config(telemetry_path=str(log))) as engine:
        for i in range(3):
            engine.save({"w": torch.randn(200_000), "i": i}, tmp_path / f"{i}.safetensors").wait_snapshot()
        with injected_fault("write", errno.EIO, "bad", count=1 << 30):
            h = engine.save({"w": torch.randn(1000)}, tmp_path / "bad.safetensors")
            with pytest.raises(OSError):
                h.wait_persisted()
    lines = telemetry.read(log)
    saved = [line for line in lines if line["committed"]]
    # Lines come in the order the files become durable, which the flush workers do not fix.
    assert sorted(line["folder"] for line in saved) == [str(tmp_path / f"{i}.safetensors") for i in range(3)]
    for line in saved:
        assert line["committed"] and line["bytes"] == (tmp_path / line["folder"]).stat().st_size
        assert 0 < line["snapshot_s"] <= line["persisted_s"] and line["stall_s"] >= 0
    assert sum(line["cache_bytes"] for line in lines) > 0  # the cache's statistics, once per batch of lines
    (bad,) = [line for line in lines if not line["committed"]]
    assert "bad.safetensors" in bad["folder"] and bad["errors"]


def test_plot_draws_the_engines_telemetry(tmp_path, capsys):
    log = tmp_path / "t.jsonl"
    with DataStatesEngine(small_config(telemetry_path=str(log))) as engine:
        for i in range(2):
            engine.save({"w": torch.ones(1000) * i}, tmp_path / f"{i}.safetensors")
    assert main(["plot", str(log), "-o", str(tmp_path / "t.png")]) == 0
    assert "2 checkpoints" in capsys.readouterr().out and (tmp_path / "t.png").stat().st_size > 0


def test_without_a_path_no_line_is_written(tmp_path):
    with DataStatesEngine(small_config()) as engine:
        engine.save({"w": torch.ones(10)}, tmp_path / "a.safetensors").wait_persisted()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors"]
