"""The process groups the adapter reads, on this Nanotron's real ParallelContext (gloo, world size 1), and the
start-up error where a ParallelContext lacks one."""

from __future__ import annotations

import types

import pytest
import torch.distributed as tdist
from cpu_ranks import parallel_context

from nanotron_datastates.checkpoint.names import Place
from nanotron_datastates.nanotron import groups
from nanotron_datastates.nanotron.compat import NanotronUnavailable


@pytest.fixture
def pc(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("RANK", "0")
    tdist.init_process_group("gloo", init_method=f"file://{tmp_path}/init", rank=0, world_size=1)
    yield parallel_context()
    tdist.destroy_process_group()


def test_this_nanotrons_groups_are_found(pc):
    groups.check(pc)
    assert groups.ep(pc) is getattr(pc, "ep_pg", None) or groups.ep(pc) is pc.expert_pg
    assert groups.dp_cp(pc) is getattr(pc, "dp_cp_pg", pc.dp_pg)
    assert (groups.cp_rank(pc), groups.cp_size(pc)) == (0, 1)
    assert groups.place(pc) == Place(tp=(0, 1), dp=(0, 1), pp=(0, 1), cp=(0, 1), ep=(0, 1))
    assert groups.layout_of(pc, 1) == {"tp": 1, "pp": 1, "dp": 1, "cp": 1, "expert": 1, "zero_stage": 1}


def test_a_parallel_context_without_an_expert_group_is_refused_at_start_up(pc):
    lacking = types.SimpleNamespace(**{k: v for k, v in vars(pc).items() if k not in ("ep_pg", "expert_pg")})
    with pytest.raises(NanotronUnavailable, match="ParallelContext has no ep_pg or expert_pg"):
        groups.check(lacking)
