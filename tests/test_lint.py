"""The code as configured in pyproject.toml: ruff's lint and format, mypy on the package."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "command",
    [["ruff", "check", "."], ["ruff", "format", "--check", "."], ["mypy", "--no-incremental"]],
    ids=["ruff-check", "ruff-format", "mypy"],
)
def test_clean(command):
    r = subprocess.run(
        [sys.executable, "-m", *command], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stdout + r.stderr
