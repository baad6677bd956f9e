"""`bench_nanotron.py resummarize` (benchmarks/_bench_summary.py) recomputes a committed result's figures
from its per-run records: a copy of the folder, recomputed, holds the same figures and table as committed.
The folders were written by runs of the GPU benchmark; records are its raw iteration times, saves, commits."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
RESULTS = BENCH / "results"
# The figures summarize computes from the records, apart from what the call that ran them passed in
FIGURES = (
    "model",
    "layout",
    "steps",
    "interval",
    "median_iteration_s",
    "modes",
    "restore_to_first_step_s",
    "first_step_end_s",
    "setup_marks_s",
    "resume_losses",
    "ratios",
    "runs",
    "sync",
)


def resummarize(folder: Path) -> None:
    r = subprocess.run(
        [sys.executable, "bench_nanotron.py", "resummarize", str(folder)],
        cwd=BENCH,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, f"resummarize {folder}: {r.stdout}{r.stderr}"


def text(value: Any) -> str:
    """JSON's own spelling, so that NaN figures compare equal."""
    return json.dumps(value, sort_keys=True)


def test_one_call_recomputed_as_committed(tmp_path: Path) -> None:
    committed = RESULTS / "h200" / "multi_4xh200" / "1b-dp4-zero1"
    folder = tmp_path / committed.name
    shutil.copytree(committed, folder)
    resummarize(folder)
    old = json.loads((committed / "bench_nanotron_1b.json").read_text())
    new = json.loads((folder / "bench_nanotron_1b.json").read_text())
    for key in FIGURES:
        assert text(new.get(key)) == text(old.get(key)), f"bench_nanotron_1b.json: {key} differs"
    assert new["command"] == old["command"], "resummarize must keep the command that ran the runs"
    assert new["resummarized"].split()[1:] == ["resummarize", str(folder)]
    assert (folder / "bench_nanotron_1b.md").read_text() == (committed / "bench_nanotron_1b.md").read_text()


def test_rounds_recomputed_as_committed(tmp_path: Path) -> None:
    committed = RESULTS / "h100" / "overhead_1b_plan_after_step"
    folder = tmp_path / committed.name
    shutil.copytree(committed, folder)
    resummarize(folder)
    old = json.loads((committed / "rounds_summary.json").read_text())
    new = json.loads((folder / "rounds_summary.json").read_text())
    assert set(new) == set(old) | {"resummarized"}, "rounds_summary.json: keys differ"
    for key in ("rounds", "modes", "ratios", "excess_after_s"):
        assert text(new[key]) == text(old[key]), f"rounds_summary.json: {key} differs"
    assert (folder / "rounds_summary.md").read_text() == (committed / "rounds_summary.md").read_text()
    for k in range(old["rounds"]):  # each round recomputed from its own records first
        one = json.loads((folder / f"round{k}" / "bench_nanotron_1b.json").read_text())
        assert "resummarized" in one, f"round{k}/bench_nanotron_1b.json was not recomputed"


def test_blocks_take_checkpoints_every_other_block_and_compare_within_the_run() -> None:
    # --blocks 4: steps 1-4 take none (warm-up), 5-8 take them, 9-12 none, 13-16 them. Iterations of the
    # blocks that take checkpoints last 11 ms, the others 10 ms, each block's first two 30 ms (left out).
    sys.path.insert(0, str(BENCH))
    from _bench_figures import block_on, blocks_figures

    assert [s for s in range(1, 17) if block_on(s, 4)] == [5, 6, 7, 8, 13, 14, 15, 16]
    assert all(block_on(s, 0) for s in range(1, 17))  # no blocks: every step takes them
    t, ends = 0.0, [[0, 0.0]]
    for s in range(1, 17):
        t += 0.030 if (s - 1) % 4 < 2 else (0.011 if block_on(s, 4) else 0.010)
        ends.append([s, t])
    got = blocks_figures({"ends": ends}, 4)
    assert got is not None and abs(got["on_vs_off"] - 0.1) < 1e-9, got
    assert abs(got["on_mean_iteration_s"] - 0.011) < 1e-12
    assert abs(got["off_mean_iteration_s"] - 0.010) < 1e-12
    assert blocks_figures({"ends": ends}, 0) is None


def test_threads_cpu_names_python_threads_and_counts_their_cpu() -> None:
    # --blocks reads each thread's CPU at every block's end: a Python thread by its name, its time counted.
    import threading
    import time

    sys.path.insert(0, str(BENCH))
    from _bench_measure import threads_cpu

    done = threading.Event()

    def spin() -> None:
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.2:
            pass
        done.set()
        time.sleep(5)  # alive while it is read

    worker = threading.Thread(target=spin, name="bench-spinner", daemon=True)
    worker.start()
    assert done.wait(30)
    got = threads_cpu()
    assert "py:MainThread" in got, got
    assert got.get("py:bench-spinner", 0.0) >= 0.15, got


def test_a_variants_switch_interval_is_the_runs_not_a_datastates_setting() -> None:
    sys.path.insert(0, str(BENCH))
    from bench_nanotron import run_settings, variants

    from nanotron_datastates.trainer_settings import TrainerSettings

    [(name, settings)] = variants(["si:memory_tier=true,switch_interval_ms=20"])
    assert name == "datastates-si"
    assert run_settings(settings) == {"switch_interval_ms": 20}
    assert settings == {"memory_tier": True}
    TrainerSettings(**settings)  # what goes into the YAML's datastates: section is valid there
    r = subprocess.run(
        [sys.executable, "bench_nanotron.py", "phase", "--help"], cwd=BENCH, capture_output=True, text=True
    )
    assert r.returncode == 0 and "--switch-interval-ms" in r.stdout, r.stderr
