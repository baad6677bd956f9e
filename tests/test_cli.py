"""The `nanotron-datastates` command on real checkpoints: inspect, verify (what it catches), bench, plot."""

import json
import shutil
import subprocess
import sys

import pytest

from nanotron_datastates.cli import main
from nanotron_datastates.nanotron import housekeeping, layout
from nanotron_datastates.nanotron.commit import CommitResult

from helpers import write_nanotron_checkpoint

OPTIMIZER = "optimizer/optimizer_pp-0-of-1_tp-0-of-1.safetensors"
RANDOM = "random/tp-0-of-1_dp-0-of-1_pp-0-of-1.safetensors"


@pytest.fixture
def ckpt(engine, tmp_path):
    root = tmp_path / "ckpt"
    for step in (20, 40):
        write_nanotron_checkpoint(engine, root, step)
    return root


def run(capsys, *argv):
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_inspect_a_checkpoints_folder(ckpt, capsys):
    (ckpt / "60").mkdir()  # a save in progress
    rc, out, _ = run(capsys, "inspect", str(ckpt))
    assert rc == 0
    assert "3 checkpoints, latest.txt names 40" in out
    assert "40: step 40, datastates, committed, latest;" in out
    assert "tp=1, pp=1, dp=1, expert=1, zero_stage=0" in out
    assert "60: step None, unknown engine, NOT committed" in out
    rc, out, _ = run(capsys, "inspect", str(ckpt), "--json")
    info = json.loads(out)
    (c40,) = [c for c in info["checkpoints"] if c["path"].endswith("40")]
    assert c40["topology"]["zero_stage"] == 0 and c40["committed"] and c40["latest"]
    assert {f["file"] for f in c40["files"]} >= {OPTIMIZER, RANDOM, layout.MANIFEST, "config.yaml"}


def test_inspect_one_checkpoint_lists_tensors_and_one_file(ckpt, capsys):
    rc, out, _ = run(capsys, "inspect", str(ckpt / "40"), "--tensors")
    assert rc == 0 and "model_weight_pp-rank-0-of-1_tp-rank-0-of-1.safetensors" in out
    assert "data: F32 [4, 8] (128 bytes)" in out
    rc, out, _ = run(capsys, "inspect", str(ckpt / "40" / OPTIMIZER))
    assert rc == 0 and "datastates, CRC-32C per tensor" in out and "F32 [4, 8]" in out


def test_verify_passes_on_whole_checkpoints(ckpt, capsys):
    rc, out, _ = run(capsys, "verify", str(ckpt))
    assert rc == 0, out
    assert out.strip().endswith("OK; 10 files checked, 20 tensors checksummed")  # 2 checkpoints x 5 files
    rc, out, _ = run(capsys, "verify", str(ckpt / "20" / OPTIMIZER))
    assert rc == 0 and ": OK;" in out


def test_verify_finds_a_flipped_byte_naming_file_and_tensor(ckpt, capsys):
    path = ckpt / "40" / OPTIMIZER
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0x10
    path.write_bytes(bytes(raw))
    rc, out, _ = run(capsys, "verify", str(ckpt), "--json")
    report = json.loads(out)
    assert rc == 1 and not report["ok"]
    (problem,) = report["problems"]
    assert str(path) in problem and "fails its checksum" in problem


def test_verify_finds_missing_rank_files_and_a_wrong_latest(ckpt, capsys):
    (ckpt / "40" / RANDOM).unlink()
    shutil.rmtree(ckpt / "20")
    (ckpt / layout.LATEST).write_text("30")
    rc, out, _ = run(capsys, "verify", str(ckpt))
    assert rc == 1
    assert f"PROBLEM: {ckpt / '40' / RANDOM}: listed in the manifest, missing" in out
    assert "latest.txt names step 30, which is not a checkpoint" in out
    assert "FAILED (2 problems)" in out


def test_verify_a_truncated_weight_file(ckpt, capsys):
    (weight,) = [p for p in (ckpt / "20" / "model").rglob("*weight*")]
    weight.write_bytes(weight.read_bytes()[:-4])
    rc, out, _ = run(capsys, "verify", str(ckpt / "20"))
    assert rc == 1 and f"{weight}: " in out and "the manifest says" in out


def test_a_manifest_entry_out_of_the_folder_is_refused_by_every_command(ckpt, tmp_path, capsys):
    folder = ckpt / "20"
    doc = json.loads((folder / layout.MANIFEST).read_text())
    doc["files"]["model/../../../secret.safetensors"] = {"bytes": 1}
    (folder / layout.MANIFEST).write_text(json.dumps(doc))
    rc, out, _ = run(capsys, "verify", str(folder))
    assert rc == 1 and "model/../../../secret.safetensors" in out and "leaves the checkpoint" in out
    rc, _, err = run(capsys, "inspect", str(folder))
    assert rc == 1 and "leaves the checkpoint" in err
    rc, _, err = run(capsys, "convert", str(folder), str(tmp_path / "out"), "--to", "torch")
    assert rc == 1 and "leaves the checkpoint" in err


def test_a_file_linked_out_of_the_folder_is_a_problem(ckpt, tmp_path, capsys):
    (weight,) = [p for p in (ckpt / "20" / "model").rglob("*weight*")]
    moved = tmp_path / "elsewhere.safetensors"
    weight.rename(moved)
    weight.symlink_to(moved)
    rc, out, _ = run(capsys, "verify", str(ckpt / "20"))
    assert rc == 1 and "link out of the checkpoint" in out


def test_bad_paths_and_usage(tmp_path, capsys):
    rc, _, err = run(capsys, "inspect", str(tmp_path / "nowhere"))
    assert rc == 1 and str(tmp_path / "nowhere") in err
    rc, out, _ = run(capsys, "verify", str(tmp_path))
    assert rc == 1 and "neither a safetensors file nor a checkpoint folder" in out
    with pytest.raises(SystemExit) as e:
        main(["convert", str(tmp_path), str(tmp_path / "o")])  # --to is required
    assert e.value.code == 2


def test_bench_writes_a_summary(tmp_path, capsys):
    out_json = tmp_path / "bench.json"
    rc, out, _ = run(
        capsys,
        "bench",
        "--size-mib",
        "8",
        "--repeat",
        "1",
        "--quiet",
        "--dir",
        str(tmp_path),
        "--json",
        str(out_json),
    )
    assert rc == 0 and "time to persisted" in out and "blocking / torch.save" in out
    result = json.loads(out_json.read_text())
    assert result["bytes"] == 8 << 20 and result["median"]["persisted_s"] > 0
    assert [p.name for p in tmp_path.iterdir()] == ["bench.json"]  # its files are removed


def test_plot_draws_the_telemetry(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    for step, ok in ((20, True), (40, False), (60, True)):
        errors = [] if ok else ["rank 0: EIO"]
        r = CommitResult(step, tmp_path / str(step), ok, errors, 10**9, 5, 0.01, 0.05, 1.0, 1.1)
        cache = {"chunks": 4, "chunk_bytes": 1 << 20, "high_water": 3, "wait_ns": 0}
        housekeeping.append_telemetry(tmp_path, housekeeping.telemetry_record(r, cache, []))
    png = tmp_path / "t.png"
    rc, out, _ = run(capsys, "plot", str(tmp_path), "-o", str(png))
    assert rc == 0 and "3 checkpoints" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rc, _, err = run(capsys, "plot", str(tmp_path / "none.jsonl"))
    assert rc == 1 and "none.jsonl" in err


def test_the_console_script_and_module_entry_point(ckpt):
    exe = shutil.which("nanotron-datastates")
    assert exe, "the console script is installed with the package"
    proc = subprocess.run([exe, "verify", str(ckpt)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cmd = [sys.executable, "-m", "nanotron_datastates", "--help"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0 and "inspect" in proc.stdout
