"""`python -m nanotron_datastates.nanotron.train`: finding Nanotron's run_train.py."""

import pytest

from nanotron_datastates.nanotron import train


def test_explicit_path_then_environment(tmp_path, monkeypatch):
    explicit, env = tmp_path / "a.py", tmp_path / "b.py"
    explicit.write_text("")
    env.write_text("")
    monkeypatch.setenv("NANOTRON_RUN_TRAIN", str(env))
    assert train.find_run_train(str(explicit)) == explicit
    assert train.find_run_train(None) == env


def test_a_clear_error_when_nowhere(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOTRON_RUN_TRAIN", str(tmp_path / "missing.py"))
    monkeypatch.setitem(__import__("sys").modules, "nanotron", None)  # as if Nanotron were not installed
    with pytest.raises(SystemExit, match="--run-train"):
        train.find_run_train(None)
