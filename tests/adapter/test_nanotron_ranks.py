"""Which rank writes and reads which file, on Nanotron's real ParallelContext (gloo, one process per rank) and
its real Llama, optimizer and scheduler: against the checkpoint Nanotron's own save functions write for the
same state. Then the manifest's topology, `verify` and `convert` on that checkpoint, context parallelism
included where this Nanotron has it.
"""

from __future__ import annotations

import collections
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from cpu_ranks import launch
from nanotron.serialize.metadata import CheckpointMetadata

from nanotron_datastates.checkpoint import folder as checkpoint
from nanotron_datastates.checkpoint import verify
from nanotron_datastates.checkpoint.file_io import write_atomic
from nanotron_datastates.checkpoint.manifest import read_manifest
from nanotron_datastates.checkpoint.names import MANIFEST, NANOTRON_METADATA, stock_random_states, whole_name
from nanotron_datastates.checkpoint.reads import optimizer_files
from nanotron_datastates.nanotron.checkpoint.convert import convert

HAS_CP = "cp" in {f.name for f in dataclasses.fields(CheckpointMetadata)}  # Nanotron from 2025-04 on

# (world size, tp, dp, pp, cp, ZeRO stage); context parallelism where this Nanotron has it
LAYOUTS = [
    pytest.param((1, 1, 1, 1, 1, 0), id="single"),
    pytest.param((4, 2, 2, 1, 1, 1), id="tp2-dp2-zero1"),
]
if HAS_CP:
    LAYOUTS += [
        pytest.param((2, 1, 1, 1, 2, 0), id="cp2"),
        pytest.param((4, 1, 2, 1, 2, 1), id="dp2-cp2-zero1"),
    ]
_runs: dict[tuple[int, ...], tuple[Path, list[dict]]] = {}


@pytest.fixture(params=LAYOUTS)
def run(request, tmp_path_factory) -> tuple[tuple[int, ...], Path, list[dict]]:
    """The layout, Nanotron's own checkpoint of its state, and each rank's report (one launch per layout)."""
    key = request.param
    if key not in _runs:
        work = tmp_path_factory.mktemp("ranks")
        world, tp, dp, pp, cp, zero = key
        _runs[key] = (work / "stock", launch(work, world, tp, dp, pp, cp, zero))
    return (key, *_runs[key])


def stock_name(ours: str) -> str:
    """The file Nanotron's own save writes for one of ours."""
    parts = Path(ours).parts
    if parts[0] == "random":
        name, _ = stock_random_states(parts[-1])
        return f"random/{name}"
    if parts[0] in ("optimizer", "lr_scheduler"):
        whole = whole_name(parts[-1])  # a part of the optimizer state: Nanotron's one file
        ours = f"{parts[0]}/{whole[0]}" if whole else ours
        return ours.removesuffix(".safetensors") + ".pt"
    return ours


def test_every_file_has_one_writer_and_stock_writes_the_same_files(run):
    (world, tp, dp, pp, cp, zero), stock, ranks = run
    writes = [f for r in ranks for f in r["writes"]]
    assert len(writes) == len(set(writes)), [f for f, n in collections.Counter(writes).items() if n > 1]
    written = {str(p.relative_to(stock)) for p in stock.rglob("*") if p.is_file()}
    written -= {NANOTRON_METADATA, "optimizer/optimizer_config.json"}  # written by the commit
    assert {stock_name(f) for f in writes} == written
    randoms = [f for f in writes if f.startswith("random/")]
    assert len(randoms) == world  # one per rank: context-parallel ranks each keep theirs
    # ZeRO: each dp rank its shard; without, each data- and context-parallel replica its part of the one
    assert sum(f.startswith("optimizer/") for f in writes) == (dp if zero else dp * cp) * tp * pp


def test_every_rank_reads_what_was_written(run):
    _, stock, ranks = run
    writes = {f for r in ranks for f in r["writes"]}
    for r in ranks:
        optimizer, random = r["reads"]
        assert optimizer in optimizer_files(writes) and random in r["writes"]
        assert r["weight_sources"] is not None  # every weight file where this layout reads it
        assert set(r["weight_sources"]) <= {stock_name(f) for f in writes}


def test_topology_and_metadata_match_nanotron(run):
    (world, tp, dp, pp, cp, zero), stock, ranks = run
    for r in ranks:
        assert r["topology"] == {"tp": tp, "pp": pp, "dp": dp, "cp": cp, "expert": 1, "zero_stage": zero}
    # checkpoint_metadata.json as Nanotron's save_meta writes it, main's new training metadata included
    assert ranks[0]["metadata_text"] == (stock / NANOTRON_METADATA).read_text()
    meta = json.loads(ranks[0]["metadata_text"])
    assert meta.get("cp", 1) == cp and meta["metas"]["last_train_step"] == 7
    if HAS_CP:
        stage = meta["metas"]["data_stages"][0]
        assert stage["consumed_tokens_per_dataset_folder"] == {"/data/a": 1400, "/data/b": 392}
        assert meta["metas"]["consumed_tokens_total"] == 1792 and stage["sequence_length"] == 32


def test_convert_and_verify_keep_every_rank(run, tmp_path):
    """Nanotron's checkpoint to ours: one random-state file per tp × dp × pp × cp rank (Nanotron main keeps
    one for all context-parallel ranks: each of ours starts from it); verified; and back, identical."""
    (world, tp, dp, pp, cp, zero), stock, _ = run
    (stock / "config.yaml").write_text(
        f"parallelism: {{tp: {tp}, dp: {dp}, pp: {pp}, context_parallel_size: {cp}}}\n"
        f"optimizer: {{zero_stage: {zero}}}\n"
    )
    (stock / "model_config.json").write_text("{}")
    ours = convert(stock, tmp_path / "ours", "datastates")
    doc = read_manifest(ours)
    assert doc["topology"] == {"tp": tp, "pp": pp, "dp": dp, "cp": cp, "expert": 1, "zero_stage": zero}
    assert sum(f.startswith("random/") for f in doc["files"]) == world
    report = verify.verify(ours)
    assert report.ok, report.problems
    assert checkpoint.describe_checkpoint(ours)["topology"]["cp"] == cp

    back = convert(ours, tmp_path / "back", "torch")
    for p in sorted((stock / "random").iterdir()):
        again = torch.load(back / "random" / p.name, weights_only=False)
        assert again == torch.load(p, weights_only=False), p.name
    assert sorted(q.name for q in (back / "random").iterdir()) == sorted(
        q.name for q in (stock / "random").iterdir()
    )

    # A rank's random states missing from the manifest: verify names the rank
    last = sorted(f for f in doc["files"] if f.startswith("random/"))[-1]
    del doc["files"][last]
    write_atomic(ours / MANIFEST, json.dumps(doc))
    report = verify.verify(ours)
    assert any("no file from rank" in p and last in p for p in report.problems), report.problems
    if cp > 1:
        assert any(f"cp={cp - 1}" in p for p in report.problems), report.problems
