"""Rotation (`keep_last_n`), stale temporaries and telemetry lines: what rank 0 does after a commit."""

import json
from pathlib import Path

import pytest

from nanotron_datastates.checkpoint.file_io import write_atomic
from nanotron_datastates.checkpoint.manifest import is_datastates_checkpoint
from nanotron_datastates.checkpoint.manifest import manifest as make_manifest
from nanotron_datastates.checkpoint.names import LATEST, MANIFEST, NANOTRON_METADATA
from nanotron_datastates.save import housekeeping


def _folder(root: Path, step: int, committed: bool = True, stock: bool = False) -> Path:
    folder = root / str(step)
    (folder / "model").mkdir(parents=True)
    (folder / "model" / "w.safetensors").write_bytes(b"x" * 10)
    if committed and stock:
        (folder / "checkpoint_metadata.json").write_text("{}")
    elif committed:
        write_atomic(folder / MANIFEST, json.dumps(make_manifest(step, {}, {})))
    return folder


def _names(root: Path) -> list[int]:
    return sorted(int(p.name) for p in root.iterdir() if p.is_dir())


def test_keeps_the_newest_n_committed_and_removes_the_rest(tmp_path):
    for step in (10, 20, 30, 40):
        _folder(tmp_path, step)
    _folder(tmp_path, 25, committed=False)  # a save that failed or was cut short
    _folder(tmp_path, 50, committed=False)  # in flight: newer than the committed step
    (tmp_path / LATEST).write_text("40")
    removed = housekeeping.rotate(tmp_path, 2, committed_step=40)
    assert sorted(int(p.name) for p in removed) == [10, 20, 25]
    assert _names(tmp_path) == [30, 40, 50]


def test_never_removes_the_checkpoint_latest_names(tmp_path):
    for step in (10, 20, 30):
        _folder(tmp_path, step)
    (tmp_path / LATEST).write_text("10")  # e.g. moved back by hand to restart from there
    housekeeping.rotate(tmp_path, 1, committed_step=30)
    assert _names(tmp_path) == [10, 30]


def test_zero_keeps_everything_and_stock_checkpoints_count(tmp_path):
    _folder(tmp_path, 10, stock=True)
    _folder(tmp_path, 20)
    _folder(tmp_path, 15, committed=False)
    (tmp_path / LATEST).write_text("20")
    assert housekeeping.rotate(tmp_path, 0, committed_step=20) == []
    assert _names(tmp_path) == [10, 15, 20]
    housekeeping.rotate(tmp_path, 1, committed_step=20)
    assert _names(tmp_path) == [20]


def test_a_removal_cut_short_never_looks_committed(tmp_path, monkeypatch):
    for step in (10, 20):
        _folder(tmp_path, step)
    (tmp_path / LATEST).write_text("20")
    monkeypatch.setattr(housekeeping.trust, "remove_tree", lambda *a, **k: False)  # the process dies here
    housekeeping.rotate(tmp_path, 1, committed_step=20)
    assert not is_datastates_checkpoint(tmp_path / "10")  # markers went first
    assert is_datastates_checkpoint(tmp_path / "20")


def test_unreadable_latest_removes_nothing(tmp_path):
    for step in (10, 20):
        _folder(tmp_path, step)
    (tmp_path / LATEST).write_text("garbage")
    assert housekeeping.rotate(tmp_path, 1, committed_step=20) == []
    assert _names(tmp_path) == [10, 20]


def test_stale_temporaries_are_removed_from_a_committed_folder(tmp_path):
    folder = _folder(tmp_path, 10)
    (folder / "model" / ".w.safetensors.dstmp.123.4").write_bytes(b"half")
    (folder / ".config.yaml.abc.tmp").write_text("half")
    assert housekeeping.remove_temporaries(folder) == 2
    assert sorted(p.name for p in folder.rglob("*")) == ["datastates.json", "model", "w.safetensors"]


def test_telemetry_lines_append_and_a_torn_line_is_skipped(tmp_path):
    from nanotron_datastates.save.commit import CommitResult

    r = CommitResult(40, tmp_path / "40", True, [], 2_000_000, 3, 0.012, 0.05, 1.1, 1.2)
    cache = {"chunks": 8, "chunk_bytes": 1 << 20, "high_water": 5, "wait_ns": 2_000_000}
    housekeeping.append_telemetry(tmp_path, housekeeping.telemetry_record(r, cache, [tmp_path / "0"]))
    with open(tmp_path / housekeeping.TELEMETRY, "a") as f:
        f.write('{"step": 80, "by')  # a crash mid-line
    (rec,) = housekeeping.read_telemetry(tmp_path)
    assert rec["step"] == 40 and rec["bytes"] == 2_000_000 and rec["stall_s"] == 0.012
    assert rec["cache_high_water_bytes"] == 5 << 20 and rec["cache_wait_s"] == 0.002
    assert rec["throughput_gbps"] == r.gbps and rec["removed"] == [str(tmp_path / "0")]


def test_rotation_never_follows_a_link_named_like_a_step(tmp_path):
    """A link named like an old step (`5 -> elsewhere`) is not a checkpoint of the folder: rotation leaves
    it and what it points to; folders named by non-canonical numbers (`05`, `+7`, `٣`) are not steps."""
    root = tmp_path / "ckpt"
    elsewhere = _folder(tmp_path / "elsewhere", 5)
    (elsewhere / NANOTRON_METADATA).write_text("{}")
    root.mkdir()
    (root / "5").symlink_to(elsewhere)
    for name in ("05", "+7", "٣"):
        _folder(root, 0).rename(root / name)
    for step in (10, 20, 30):
        _folder(root, step)
    (root / LATEST).write_text("30")
    removed = housekeeping.rotate(root, 2, committed_step=30)
    assert [p.name for p in removed] == ["10"]
    assert (elsewhere / MANIFEST).is_file() and (elsewhere / NANOTRON_METADATA).is_file()
    assert (root / "5").is_symlink() and all((root / n).is_dir() for n in ("05", "+7", "٣", "20", "30"))


def test_one_parser_of_step_numbers():
    from nanotron_datastates.trust import step_number

    assert [step_number(t) for t in ("0", "10", "9223372036854775807")] == [0, 10, 2**63 - 1]
    bad = ("", "010", "+20", "-1", "2_0", " 10", "10 ", "١٠", "１０", "²", "9223372036854775808", "1e3")
    assert all(step_number(t) is None for t in bad)


def test_latest_txt_is_read_strictly_and_never_through_a_link(tmp_path):
    """Only canonical ASCII digits name a step; a latest.txt that is a link is refused without quoting its
    target's content."""
    from nanotron_datastates.checkpoint.folder import latest_step

    for text in ("١٠", "１０", "+20", "2_0", "20 x"):
        (tmp_path / LATEST).write_text(text)
        with pytest.raises(ValueError, match="not a step number"):
            latest_step(tmp_path)
    (tmp_path / LATEST).write_text("20\n")
    assert latest_step(tmp_path) == 20
    secret = tmp_path / "secret"
    secret.write_text("TOKEN-abc123")
    (tmp_path / LATEST).unlink()
    (tmp_path / LATEST).symlink_to(secret)
    with pytest.raises(ValueError) as e:
        latest_step(tmp_path)
    assert "TOKEN" not in str(e.value) and "link" in str(e.value)
