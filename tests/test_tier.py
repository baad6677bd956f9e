"""The memory tier's bookkeeping on real folders: what a rank marks, drops and prunes."""

from __future__ import annotations

from nanotron_datastates.nanotron.tier import MemoryTier


def _hold(tier: MemoryTier, step: int, *, mark: bool = True) -> None:
    rel = f"model/w_{tier.rank}.safetensors"
    tier.path(step, rel).parent.mkdir(parents=True, exist_ok=True)
    tier.path(step, rel).write_bytes(b"x" * 10)
    if mark:
        (tier.folder / str(step) / f".rank-{tier.rank}.json").write_text(
            f'{{"step": {step}, "files": {{"{rel}": {{"bytes": 10}}}}}}'
        )


def test_prune_keeps_the_latest_step_and_what_other_ranks_hold(tmp_path):
    """A process killed between marking a step and dropping the older ones leaves several marked steps;
    the next start keeps only the step latest.txt names (and drops unmarked leftovers below it), and never
    touches another rank's marked files or an unmarked step above it (a save in flight)."""
    r0, r1 = (MemoryTier(tmp_path / "shm", tmp_path / "ckpt", rank) for rank in (0, 1))
    for step in (10, 20, 30):
        _hold(r0, step)
    _hold(r1, 20)
    _hold(r0, 5, mark=False)  # a save killed before it was committed
    _hold(r0, 40, mark=False)  # one in flight
    r0.prune(30)
    assert [int(p.name) for p in r0.steps()] == [20, 30, 40]
    assert not r0.path(20, "model/w_0.safetensors").exists()  # rank 0's copy of 20 dropped ...
    assert r1.path(20, "model/w_1.safetensors").exists()  # ... rank 1's kept
    assert r0.path(30, "model/w_0.safetensors").exists() and r0.path(40, "model/w_0.safetensors").exists()


def test_prune_without_a_latest_step_drops_every_step_this_rank_marked(tmp_path):
    tier = MemoryTier(tmp_path / "shm", tmp_path / "ckpt", 0)
    _hold(tier, 1)
    _hold(tier, 2)
    tier.prune(None)
    assert tier.steps() == []
