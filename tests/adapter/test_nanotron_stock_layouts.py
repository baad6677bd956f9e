"""Nanotron's own checkpoints (pickles, no manifest) resumed on another layout with the optimizer loaded:
which ones the adapter refuses (`saved_layout.refuse_stock`) and which it leaves to Nanotron's loaders. A
change of context parallelism alone is no change for them: Nanotron main names no file after the
context-parallel rank, and its context-parallel ranks hold the weights, the optimizer (its ZeRO shard is
per data-parallel rank) and the scheduler alike. A change of data parallelism under ZeRO is refused, naming
only what changed. Nanotron's real classes on gloo ranks (cpu_ranks.py); runs against each Nanotron tree
(see conftest.py).
"""

from __future__ import annotations

import dataclasses

import pytest
from cpu_ranks import launch
from nanotron.serialize.metadata import CheckpointMetadata

HAS_CP = "cp" in {f.name for f in dataclasses.fields(CheckpointMetadata)}
# (world size, tp, dp, pp, cp, ZeRO stage) of Nanotron's save; resumed on one process with the same ZeRO
# stage; what refuse_stock names as changed (None: not refused)
CASES = [pytest.param((2, 1, 2, 1, 1, 1), "dp 2 -> 1", id="dp2-zero1-refused")]
if HAS_CP:
    CASES += [
        pytest.param((2, 1, 1, 1, 2, 0), None, id="cp2-zero0-loads"),
        pytest.param((2, 1, 1, 1, 2, 1), None, id="cp2-zero1-loads"),
        pytest.param((4, 1, 2, 1, 2, 0), None, id="dp2-cp2-zero0-loads"),
        pytest.param((4, 1, 2, 1, 2, 1), "dp 2 -> 1", id="dp2-cp2-zero1-refused"),
    ]


@pytest.mark.parametrize("saved, refused", CASES)
def test_a_stock_checkpoint_is_refused_only_for_a_change_nanotron_cannot_load(
    saved, refused, tmp_path, monkeypatch
):
    import torch.distributed as tdist
    from cpu_ranks import config, differences, parallel_context, snapshot, training_state
    from nanotron.serialize.optimizer import load_lr_scheduler, load_optimizer
    from nanotron.serialize.weights import load_weights

    from nanotron_datastates.nanotron.resume.resume import Resume
    from nanotron_datastates.resume.reshard_plan import ReshardError

    zero = saved[-1]
    launch(tmp_path, *saved)  # Nanotron's own save of the state, in tmp_path/stock
    stock = tmp_path / "stock"
    assert not (stock / "datastates.json").exists() and (stock / "checkpoint_metadata.json").is_file()
    for k, v in (("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("RANK", "0")):
        monkeypatch.setenv(k, v)
    tdist.init_process_group("gloo", init_method=f"file://{tmp_path}/init1", rank=0, world_size=1)
    try:
        c, pc = config(zero_stage=zero), parallel_context()
        assert c.checkpoints.load_optimizer
        if refused is not None:
            with pytest.raises(ReshardError) as e:
                Resume().plan(c, pc, stock)
            assert refused in str(e.value) and "nanotron-datastates convert" in str(e.value), e.value
            assert "cp " not in str(e.value), f"a change of cp named as a layout change: {e.value}"
            return
        assert not Resume().plan(c, pc, stock)  # not ours, and not refused
        expected = snapshot(*training_state(pc, c))
        model, optimizer, lr_scheduler, random_states = training_state(pc, c, seed=1)
        load_weights(model=model, parallel_context=pc, root_folder=stock)
        load_optimizer(optimizer=optimizer, parallel_context=pc, root_folder=stock, model=model)
        load_lr_scheduler(lr_scheduler, zero, pc, stock)
        got = snapshot(model, optimizer, lr_scheduler, random_states)
        for k in ("random", "lr_scheduler"):  # Nanotron's loader steps the scheduler once after loading it
            expected.pop(k), got.pop(k)
        for groups in (expected["optimizer"]["param_groups"], got["optimizer"]["param_groups"]):
            for g in groups:  # Nanotron's loader keeps the configured lr; its scheduler sets it at the step
                g.pop("lr")
        assert differences(expected, got) == []
    finally:
        tdist.destroy_process_group()
