"""The data of the GPU reshard harness (benchmarks/_reshard_phase.py, `sample_rows`): every layout of
the same global batch trains on the same whole sequences at each step. Data-parallel ranks take disjoint
samples; context-parallel ranks of one data-parallel rank take the same samples, each its own slice of every
sequence, as Nanotron main's dummy data gives them (data/dataloader.py), so that their slices put together
are the sequences a layout without context parallelism trains on."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _reshard_phase import sample_rows  # noqa: E402 - the harness's data, drawn by sample index

SEQ, VOCAB, STEPS, START = 16, 50, 3, 24
# (micro-batch, micro-batches a step, dp, cp): 8 sequences a step each
LAYOUTS = [(4, 2, 1, 1), (4, 1, 2, 1), (2, 1, 4, 1), (4, 2, 1, 2), (4, 1, 2, 2), (2, 2, 2, 4)]


def sequences(micro: int, acc: int, dp: int, cp: int) -> list[Counter]:
    """Per step, the whole sequences (input and label tokens) the layout trains on, each cp rank's slices put
    back together; an AssertionError where the ranks' slices do not make up whole sequences."""
    out = []
    for step in range(STEPS):
        seen: Counter = Counter()
        for j in range(acc):
            k = step * acc + j
            for d in range(dp):
                parts = [
                    [
                        sample_rows(
                            k, START, micro, acc, (d, dp), (c, cp), salt, (SEQ // cp,), VOCAB, torch.long
                        )
                        for c in range(cp)
                    ]
                    for salt in (0, 1)
                ]
                for part in parts:
                    assert all(p.shape == (micro, SEQ // cp) for p in part), [p.shape for p in part]
                inputs, labels = (torch.cat(part, dim=-1) for part in parts)
                for x, y in zip(inputs, labels):
                    seen[(tuple(x.tolist()), tuple(y.tolist()))] += 1
        out.append(seen)
    return out


def test_a_layout_without_cp_draws_each_sequence_from_its_index_as_before():
    """The rows of cp 1 are those the harness has always drawn (its earlier runs' data): sample i's inputs
    from seed 2i, its labels from 2i + 1."""
    rows = sample_rows(3, START, 4, 2, (1, 2), (0, 1), 1, (SEQ,), VOCAB, torch.long)
    step, j = divmod(3, 2)
    first = START + step * 2 * 4 * 2 + (j * 2 + 1) * 4
    for i, row in enumerate(rows):
        expected = torch.randint(
            0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(2 * (first + i) + 1)
        )
        assert torch.equal(row, expected), (i, row, expected)


@pytest.mark.parametrize("layout", LAYOUTS[1:], ids=lambda v: "m{}-acc{}-dp{}-cp{}".format(*v))
def test_every_layout_trains_on_the_same_whole_sequences_at_each_step(layout):
    reference = sequences(*LAYOUTS[0])
    assert all(len(s) == 8 and set(s.values()) == {1} for s in reference)  # 8 distinct samples a step
    got = sequences(*layout)
    for step, (a, b) in enumerate(zip(reference, got)):
        assert a == b, (
            f"step {step} of layout {layout}: {sum((a - b).values())} sequences not the reference's"
        )


def test_context_parallel_ranks_of_one_dp_rank_take_slices_of_the_same_samples():
    whole = sample_rows(1, START, 2, 2, (1, 2), (0, 1), 0, (SEQ,), VOCAB, torch.long)
    for c in range(4):
        part = sample_rows(1, START, 2, 2, (1, 2), (c, 4), 0, (SEQ // 4,), VOCAB, torch.long)
        assert torch.equal(part, whole[:, c * SEQ // 4 : (c + 1) * SEQ // 4]), c
