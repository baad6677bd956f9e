"""Manifests written by someone else: every one is checked against its schema when read (a ManifestError
naming the key, which a resume catches and falls back from), and `verify` reports each bad checkpoint and goes
on to the next, in bounded time."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from nanotron_datastates.checkpoint.manifest import MAX_MANIFEST, ManifestError, read_manifest
from nanotron_datastates.checkpoint.names import MANIFEST
from nanotron_datastates.checkpoint.verify import verify

from helpers import write_nanotron_checkpoint


def _edit(doc: dict, how: str) -> tuple[dict, str]:
    """The manifest `doc` damaged one way; the key its error must name."""
    rel = next(iter(doc["files"]))
    if how == "version-text":
        doc["version"] = "2"
        return doc, "version"
    if how == "version-list":
        doc["version"] = [1]
        return doc, "version"
    if how == "huge-topology":
        doc["topology"].update(tp=100_000, dp=100_000)
        return doc, "topology"
    if how == "topology-list":
        doc["topology"] = [1, 2]
        return doc, "topology"
    if how == "topology-text":
        doc["topology"]["tp"] = "1"
        return doc, "topology.tp"
    if how == "entry-list":
        doc["files"][rel] = [1]
        return doc, rel
    if how == "crc-list":
        doc["files"][rel]["crc32c"] = ["00000000"]
        return doc, "crc32c"
    if how == "crc-number":
        doc["files"][rel]["crc32c"] = {"data": 12}
        return doc, "crc32c"
    if how == "bytes-negative":
        doc["files"][rel]["bytes"] = -1
        return doc, "bytes"
    if how == "bytes-huge":
        doc["files"][rel]["bytes"] = 2**64
        return doc, "bytes"
    if how == "step-text":
        doc["step"] = "20"
        return doc, "step"
    if how == "blocks-list":
        doc["files"][rel]["crc32c_blocks"] = ["4096:00000000"]
        return doc, "crc32c_blocks"
    raise AssertionError(how)


HOW = [
    "version-text", "version-list", "huge-topology", "topology-list", "topology-text", "entry-list",
    "crc-list", "crc-number", "bytes-negative", "bytes-huge", "step-text", "blocks-list",
]  # fmt: skip


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from nanotron_datastates import DataStatesEngine

    root = tmp_path_factory.mktemp("ckpt")
    with DataStatesEngine(host_cache_size=1 / 64, chunk_size=1) as engine:
        for step in (10, 20):
            write_nanotron_checkpoint(engine, root, step)
    return root


@pytest.mark.parametrize("how", HOW)
def test_a_hostile_manifest_is_a_manifest_error_naming_its_key(saved, how, tmp_path):
    folder = tmp_path / "20"
    folder.mkdir()
    doc, key = _edit(json.loads((saved / "20" / MANIFEST).read_text()), how)
    (folder / MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(ManifestError, match=key.replace("[", r"\[")):
        read_manifest(folder)


def test_a_manifest_nested_too_deeply_or_too_large_is_refused(tmp_path):
    (tmp_path / MANIFEST).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ManifestError):
        read_manifest(tmp_path)
    with open(tmp_path / MANIFEST, "wb") as f:
        f.truncate(MAX_MANIFEST + 1)
    with pytest.raises(OSError, match="more than"):
        read_manifest(tmp_path)


def test_verify_reports_each_bad_checkpoint_and_goes_on_in_bounded_time(saved, tmp_path):
    """Every damage at once, one per checkpoint folder, beside a whole checkpoint: `verify` names each bad
    one, verifies the whole one, and finishes (10^10 rank combinations are never walked)."""
    import shutil

    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    for i, how in enumerate(HOW):
        folder = root / str(100 + i)
        shutil.copytree(saved / "20", folder)
        doc = json.loads((folder / MANIFEST).read_text())
        doc["step"] = 100 + i
        (folder / MANIFEST).write_text(json.dumps(_edit(doc, how)[0]))
    script = (
        "import json, resource; from nanotron_datastates.checkpoint.verify import verify; "
        f"r = verify({str(root)!r}).as_dict(); "
        "r['max_rss_kib'] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss; print(json.dumps(r))"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    # torch, the engine's host cache in use and the files come to about 1 GiB: the bound catches memory that
    # grows with what a hostile manifest claims (ranks, files, sizes)
    assert report["max_rss_kib"] < 2 * 1024 * 1024, report["max_rss_kib"]
    for i in range(len(HOW)):
        assert any(str(root / str(100 + i)) in p for p in report["problems"]), (HOW[i], report["problems"])
    assert not any(f"{root / '10'}/" in p or f"{root / '20'}/" in p for p in report["problems"])
    assert report["files_checked"] >= 2 * len(read_manifest(saved / "10")["files"])


def test_a_whole_checkpoint_still_verifies(saved):
    assert verify(saved).ok


def test_a_manifest_is_written_one_line_a_file_and_reads_back_as_made(saved):
    """The manifest's text (made by the C encoder, not the indenting one): the document it was made from,
    each file's entry on a line of its own."""
    from nanotron_datastates.checkpoint.manifest import manifest_text

    text = (saved / "10" / MANIFEST).read_text()
    doc = json.loads(text)
    assert manifest_text(doc) == text
    lines = [line.rstrip(",") for line in text.splitlines()]
    for rel, entry in doc["files"].items():
        assert f"  {json.dumps(rel)}: {json.dumps(entry)}" in lines
    doc["files"] = {}
    assert json.loads(manifest_text(doc)) == doc


@pytest.mark.parametrize(
    "name", ["", "/etc/passwd", "../x", "a/../b", "a//b", "a/./b", ".", "a/", "a\\b", "a\0b", 7, None]
)
def test_a_name_that_leaves_its_folder_is_refused_by_both_checks_alike(name):
    from nanotron_datastates import trust

    with pytest.raises(trust.UntrustedPath) as parts:
        trust.name_parts(name, "the marker")
    with pytest.raises(trust.UntrustedPath) as path:
        trust.relative_name(name, "the marker")
    assert str(parts.value) == str(path.value) and "the marker" in str(parts.value)


def test_a_plain_name_has_the_parts_of_its_path():
    from nanotron_datastates import trust

    for name in ("a", "model/w.safetensors", "x/y/z/.rank-0.json", "..a/b.."):
        assert trust.name_parts(name) == trust.relative_name(name).parts


@pytest.mark.parametrize("count", ["9999999", str(10**13), "9" * 5000])
def test_an_optimizer_part_count_a_manifest_names_is_never_trusted_to_size_anything(count):
    """A part's name says how many parts make its file: a count of billions is a ManifestError naming the
    file (never a list of that many built), a count of thousands of digits no part name at all."""
    from nanotron_datastates.checkpoint.reads import optimizer_files

    name = f"optimizer/optimizer_pp-0-of-1_tp-0-of-1_part-0-of-{count}.safetensors"
    try:
        got = optimizer_files([name, "model/w.safetensors"])
    except ManifestError as e:
        assert "optimizer/optimizer_pp-0-of-1_tp-0-of-1.safetensors" in str(e)
    else:  # not taken for a part: a whole file of that name
        assert got == {name: [name]}


def test_an_optimizer_part_name_with_digits_other_than_ascii_is_no_part():
    from nanotron_datastates.checkpoint.reads import optimizer_files

    name = "optimizer/o_part-\u0660-of-\u0661.safetensors"  # Arabic-Indic 0 and 1
    assert optimizer_files([name]) == {name: [name]}
    ok = ["optimizer/o_part-0-of-2.safetensors", "optimizer/o_part-1-of-2.safetensors"]
    assert optimizer_files(ok) == {"optimizer/o.safetensors": ok}
