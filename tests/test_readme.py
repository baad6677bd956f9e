"""Every example in README.md runs: its Python, its YAML, its `nanotron-datastates` commands, the main job,
and the configuration table matches the code (keys and defaults)."""

import dataclasses
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from nanotron_datastates import DataStatesEngine
from nanotron_datastates.save import housekeeping
from nanotron_datastates.save.commit import CommitResult
from nanotron_datastates.trainer_settings import TrainerSettings

from helpers import write_nanotron_checkpoint

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```(\w*)\n(.*?)```", README, flags=re.S)
HAS_NANOTRON = importlib.util.find_spec("nanotron") is not None


def blocks(lang: str) -> list[str]:
    return [body for kind, body in BLOCKS if kind == lang]


def test_the_readme_has_the_examples_this_file_runs():
    assert len(blocks("python")) >= 1 and len(blocks("yaml")) >= 1 and len(blocks("bash")) >= 3


def test_the_two_contract_commands_are_the_ones_ci_and_the_install_run():
    first, second = blocks("bash")[:2]
    assert first.strip() == "bash .ci/install && python3 examples/train_tiny_lm.py"
    assert second.strip() == "bash .ci/install && python3 -m pytest -q -rfs tests"
    assert second.strip() in (ROOT / ".ci/run").read_text()  # CI runs the test command verbatim


@pytest.mark.slow
def test_the_main_job_runs(tmp_path):
    # The first command's job, as written (the install is what CI runs before this suite).
    proc = subprocess.run(
        [sys.executable, "examples/train_tiny_lm.py", "--out", str(tmp_path / "out")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=2700,  # a minute on a quiet 2-core machine; room for a loaded one
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (shown,) = blocks("text")  # the output the Quick start shows: its verdicts, as printed
    verdicts = [line for line in shown.splitlines() if "bit for bit" in line or "identical" in line]
    assert len(verdicts) == 2 and all(line in proc.stdout for line in verdicts), proc.stdout[-3000:]
    assert (tmp_path / "out" / "ckpt" / "datastates_telemetry.jsonl").stat().st_size > 0


@pytest.mark.parametrize("code", blocks("python"))
def test_python_examples_run_as_written(code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # each block alone, in a fresh folder: nothing defined for it
    exec(compile(code, "README.md", "exec"), {"__name__": "readme"})


@pytest.mark.parametrize("text", blocks("yaml"))
def test_yaml_examples_are_valid_configs(text):
    doc = yaml.safe_load(text)
    assert doc["checkpoints"]["checkpointing_engine"] in ("datastates", "torch")
    TrainerSettings.from_dict(doc.get("datastates"), env=False)  # raises naming a bad key


def test_config_table_lists_every_key_with_its_default():
    rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]+) \|", README, flags=re.M))
    for f in dataclasses.fields(TrainerSettings):  # the engine's keys and the trainer's
        assert f.name in rows, f"README's configuration table lacks {f.name}"
        shown = rows[f.name].strip().strip("`")
        default = str(f.default).lower() if isinstance(f.default, bool) else str(f.default) or '""'
        assert shown == default, (f.name, shown, default)


def _commands() -> list[str]:
    lines = [line.split("  #")[0].strip() for body in blocks("bash") for line in body.splitlines()]
    return [line for line in lines if line.startswith("nanotron-datastates ")]


@pytest.fixture
def readme_dir(tmp_path):
    """What the README's commands expect to find: `ckpt/` with two checkpoints and their telemetry, and a
    stock checkpoint at `stock/40` for the `--to datastates` example (written by the first convert)."""
    root = tmp_path / "ckpt"
    with DataStatesEngine(host_cache_size=1 / 64) as engine:
        for step in (20, 40):
            write_nanotron_checkpoint(engine, root, step)
    for step in (20, 40):
        r = CommitResult(step, root / str(step), True, [], 10**6, 5, 0.012, 0.05, 0.4, 0.5)
        cache = {"chunks": 8, "chunk_bytes": 1 << 20, "high_water": 2, "wait_ns": 0}
        housekeeping.append_telemetry(root, housekeeping.telemetry_record(r, cache, []))
    return tmp_path


@pytest.mark.slow
def test_command_examples_run(readme_dir):
    commands = _commands()
    assert {c.split()[1] for c in commands} == {"inspect", "verify", "convert", "bench", "plot", "tier"}
    exe = shutil.which("nanotron-datastates")
    assert exe, "the console script is installed with the package"
    env = {**os.environ, "TMPDIR": str(readme_dir)}
    ran = 0
    for command in commands:
        if " convert " in f" {command} " and not HAS_NANOTRON:
            continue  # needs Nanotron's classes for the random states: run where Nanotron is installed
        argv = [exe, *shlex.split(command)[1:]]
        proc = subprocess.run(argv, cwd=readme_dir, capture_output=True, text=True, env=env, timeout=600)
        assert proc.returncode == 0, (command, proc.stdout[-2000:], proc.stderr[-2000:])
        ran += 1
    assert ran >= len(commands) - (0 if HAS_NANOTRON else 2)
    assert (readme_dir / "telemetry.png").stat().st_size > 0
