"""The Nanotron adapter's tests (tests/adapter/), once per supported Nanotron: at 2cde8f6 and at main's
newest code, each tree used in place from `../shared/nanotron/` beside the checkout (NANOTRON_TREES overrides
it).

Each tree runs in a pytest process of its own: one process imports one Nanotron. Missing trees skip on a
developer's machine and fail in CI (CI=true), where they are always there.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TREES = Path(os.environ.get("NANOTRON_TREES", ROOT.parent / "shared" / "nanotron"))
COMMITS = ("2cde8f6", "7bc99232")


@pytest.mark.slow
@pytest.mark.parametrize("commit", COMMITS)
def test_adapter_on_nanotron(commit):
    src = TREES / commit / "src"
    if not (src / "nanotron").is_dir():
        why = f"no Nanotron tree at {src}"
        if os.environ.get("CI"):
            pytest.fail(f"{why}: CI runs the adapter's tests on every supported Nanotron")
        pytest.skip(why)
    env = dict(os.environ, NANOTRON_SRC=str(src))
    args = ["-q", "-rfs", "-p", "no:cacheprovider", str(ROOT / "tests" / "adapter")]
    r = subprocess.run(
        [sys.executable, "-m", "pytest", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,  # about 5 minutes a tree on a quiet 2-core machine; room for a loaded one
    )
    out = r.stdout + r.stderr
    summary = out.strip().splitlines()[-1] if out.strip() else ""
    print(f"Nanotron {commit}: {summary}")
    assert r.returncode == 0, out[-8000:]
    assert " passed" in summary and "skipped" not in summary, out[-8000:]  # nothing hidden by a skip
