"""Who sends the memory replicas while training runs (`memory_replica_process`): every rank takes the same
way, decided from every rank's answer; `auto` takes a process of each rank's own only where all can."""

from __future__ import annotations

import multiprocessing
import os
import types

import pytest
import torch.distributed as tdist
from cpu_ranks import two_gloo_ranks

from nanotron_datastates.nanotron.save.memory import process_token, process_unable
from nanotron_datastates.trainer_settings import TrainerSettings


def _rank(rank: int, init: str, mode: str, lacking: int, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if rank == lacking:  # this rank was not started by torchrun: no store to meet at
        del os.environ["MASTER_PORT"]
    tdist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    settings = TrainerSettings(memory_tier=True, memory_replicas=1, memory_replica_process=mode)
    token = process_token(settings, types.SimpleNamespace(world_pg=None))  # raises: exit status 1
    tdist.barrier()
    out.put((rank, token))
    out.close()
    out.join_thread()
    # Gloo's teardown, where the peer has let go of its end first, sometimes aborts the process (SIGABRT,
    # "terminate called without an active exception"): nothing here needs it, so none runs.
    os._exit(0)


def _tokens(tmp_path, mode: str, lacking: int) -> list:
    init = f"file://{tmp_path}/init-{mode}-{lacking}"
    answers = two_gloo_ranks(_rank, lambda rank: (init, mode, lacking, 29999))
    return [answers[0], answers[1]]


@pytest.mark.parametrize("lacking", [-1, 1])
def test_auto_takes_the_process_only_where_every_rank_can_start_one(tmp_path, lacking):
    tokens = _tokens(tmp_path, "auto", lacking)
    if lacking < 0:  # one token for both: their processes' keys under the same prefix
        assert tokens[0] is not None and tokens[0] == tokens[1], tokens
    else:  # rank 1 cannot: both send from their threads
        assert tokens == [None, None]


def test_never_takes_the_threads_and_always_the_process(tmp_path):
    assert _tokens(tmp_path, "never", -1) == [None, None]
    tokens = _tokens(tmp_path, "always", -1)
    assert tokens[0] is not None and tokens[0] == tokens[1]


def test_why_a_rank_cannot_start_a_replica_process(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert process_unable(TrainerSettings()) is None
    assert "transport=nccl" in process_unable(TrainerSettings(memory_replica_transport="nccl"))
    monkeypatch.delenv("MASTER_PORT")
    assert "MASTER_ADDR and MASTER_PORT" in process_unable(TrainerSettings())
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setitem(multiprocessing.current_process()._config, "daemon", True)
    assert "daemonic" in process_unable(TrainerSettings())
