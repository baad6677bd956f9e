"""`bench_restart.py summarize` (benchmarks/_restart_summary.py) recomputes a committed result's summary from
the records it holds: a copy of the lost-node result (two simulated nodes, one lost and restarted from its
peer's replica), recomputed, is the committed file byte for byte."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
COMMITTED = BENCH / "results" / "h200" / "multi_2xh200" / "restart_1b_lost_node" / "bench_restart_1b.json"


def _summarize(path: Path) -> None:
    """`bench_restart.py summarize` on `path`, in place."""
    r = subprocess.run(
        [sys.executable, "bench_restart.py", "summarize", str(path)],
        cwd=BENCH,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, f"summarize {path}: {r.stdout}{r.stderr}"


def test_lost_node_summary_recomputed_as_committed(tmp_path: Path) -> None:
    path = tmp_path / COMMITTED.name
    shutil.copy(COMMITTED, path)
    old = json.loads(COMMITTED.read_text())
    stale = {**old, "ratios": {}, "lost_node": None, "bitwise": not old["bitwise"]}  # recomputed, not kept
    path.write_text(json.dumps(stale, indent=1))
    _summarize(path)
    new = json.loads(path.read_text())
    for key in sorted(set(old) | set(new)):
        assert json.dumps(new.get(key), sort_keys=True) == json.dumps(old.get(key), sort_keys=True), (
            f"{COMMITTED.name}: {key} differs"
        )
    assert path.read_text() == COMMITTED.read_text()


def test_with_a_second_start_from_scratch_each_restore_is_over_the_median_of_its_engines_starts(
    tmp_path: Path,
) -> None:
    """`--scratch-twice`: the committed call's records with `datastates.end` and `torch.end` added (each
    engine from scratch again, at the end): every restore is taken over the median of its engine's starts,
    and the starts are in `scratch_s`."""
    old = json.loads(COMMITTED.read_text())
    records = old["records"]
    t = {k: old["first_step_end_s"][k] for k in ("datastates", "torch", "restart-replica", "restore-torch")}
    for engine, later in (("datastates", 3.0), ("torch", 1.0)):
        again = json.loads(json.dumps(records[engine]))
        again["runs"][-1]["marks"]["first_step_end_s"] = t[engine] + later
        records[f"{engine}.end"] = again
    path = tmp_path / COMMITTED.name
    path.write_text(json.dumps(old, indent=1))
    _summarize(path)
    new = json.loads(path.read_text())
    assert new["scratch_s"]["datastates"] == [t["datastates"], t["datastates"] + 3.0]
    over = new["restore_over_scratch_s"]
    assert abs(over["restart-replica"] - (t["restart-replica"] - t["datastates"] - 1.5)) < 1e-9
    assert abs(over["restore-torch"] - (t["restore-torch"] - t["torch"] - 0.5)) < 1e-9
