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


def test_a_child_process_is_named_by_its_mode_and_its_leaves_counted():
    # --subprocesses: a child's stack starts with its parents' process frames, then its own and its thread
    root = 'process 1:"python3 bench_nanotron.py all --out <out>/gil-180m"'
    child = 'process 946:"python -u bench_nanotron.py phase --mode datastates-memtier2 --interval 2"'
    raw = [
        f"{root};{child};thread (946): datastates-queuer;run (queuer.py:40);plan (plan.py:9) 7\n",
        f"{root};{child};thread (946): datastates-queuer;run (queuer.py:41) 3\n",
        f"{root};thread (1): MainThread;main (bench_nanotron.py:5) 1\n",
    ]
    s = summarize(raw, rate=10)
    queuer = s["datastates-memtier2 | datastates-queuer"]
    assert queuer["samples"] == 10 and dict(queuer["functions"])["run (queuer.py)"] == 1.0
    assert dict(queuer["leaves"]) == {"plan (plan.py)": 0.7, "run (queuer.py)": 0.3}
    assert s["<out>/gil-180m | MainThread"]["samples"] == 1
