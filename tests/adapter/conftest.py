"""The Nanotron adapter's tests, against one Nanotron source tree: the one NANOTRON_SRC names (its `src/`).

`tests/test_nanotron_trees.py` runs this folder once per tree in `../shared/nanotron/` (Nanotron at 2cde8f6
and at main), each in a process of its own, since one process imports one Nanotron. On this CPU machine,
`cpu_stand_ins.py` (beside the trees) answers main's CUDA-only imports; `cpu_ranks.py` here builds Nanotron's
real classes on CPU. By hand: `NANOTRON_SRC=../shared/nanotron/7bc99232/src python3 -m pytest tests/adapter`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

SRC = os.environ.get("NANOTRON_SRC")
if not SRC or not (Path(SRC) / "nanotron").is_dir():
    raise pytest.UsageError(f"tests/adapter needs NANOTRON_SRC set to a Nanotron tree's src/ (got {SRC!r})")
HERE = Path(__file__).resolve().parent
STAND_INS = Path(SRC).resolve().parents[1]  # cpu_stand_ins.py sits beside the trees
# Subprocesses (the hook's tests, the ranks of cpu_ranks.py) see the same Nanotron.
PATH = [str(Path(SRC).resolve()), str(STAND_INS), str(HERE), str(HERE.parent)]
os.environ["PYTHONPATH"] = os.pathsep.join([*PATH, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
sys.path[:0] = PATH

import cpu_stand_ins  # noqa: E402, F401 - before anything imports nanotron


@pytest.fixture
def rank0(tmp_path, monkeypatch):
    """A gloo world of one, Nanotron's ParallelContext, config and trained state; an engine."""
    import torch.distributed as tdist
    from cpu_ranks import config, parallel_context, training_state

    from nanotron_datastates import DataStatesEngine

    for k, v in (("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("RANK", "0")):
        monkeypatch.setenv(k, v)
    tdist.init_process_group("gloo", init_method=f"file://{tmp_path}/init", rank=0, world_size=1)
    pc = parallel_context()
    c = config()
    engine = DataStatesEngine(host_cache_size=1 / 64, chunk_size=1)
    yield pc, c, training_state(pc, c), engine
    engine.close()
    tdist.destroy_process_group()
