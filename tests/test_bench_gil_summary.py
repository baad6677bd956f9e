"""benchmarks/micro/gil_summary.py: py-spy's raw lines (`--gil --threads --subprocesses`, the format py-spy
0.4 writes) summed per process and named thread, functions inclusive and counted once a stack whatever their
line, seconds at the sampling rate."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "micro"))

from gil_summary import summarize  # noqa: E402

RAW = [
    'process 7:"python3 run_train.py";thread (8): datastates-committer;Thread.run (threading.py:982);'
    "_run (commit.py:166);finalize (commit_files.py:63) 30\n",
    'process 7:"python3 run_train.py";thread (8): datastates-committer;Thread.run (threading.py:982);'
    "_run (commit.py:170);dump (yaml/__init__.py:248) 10\n",
    'process 7:"python3 run_train.py";thread (7): MainThread;<module> (run_train.py:9);'
    "train (trainer.py:4) 60\n",
    "not a stack line\n",
]


def test_each_named_thread_is_summed_with_its_functions_once_a_stack():
    s = summarize(RAW, rate=20)
    assert list(s) == ["run_train.py | MainThread", "run_train.py | datastates-committer"]
    committer = s["run_train.py | datastates-committer"]
    assert committer["samples"] == 40 and committer["gil_s"] == 2.0
    functions = dict(committer["functions"])
    assert functions["_run (commit.py)"] == 2.0  # two lines of one function: one entry, 40 samples
    assert functions["finalize (commit_files.py)"] == 1.5 and functions["dump (yaml/__init__.py)"] == 0.5
