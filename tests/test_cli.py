"""The `nanotron-datastates` command on real checkpoints: inspect, verify (what it catches), bench, plot;
on every kind of path (a file, a folder of engine files, a Nanotron checkpoint, a checkpoints folder, a
missing path, a folder of something else), its words and units, a closed pipe, and its help."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from nanotron_datastates import format as fmt
from nanotron_datastates import telemetry
from nanotron_datastates.checkpoint.names import LATEST, MANIFEST, NANOTRON_METADATA
from nanotron_datastates.cli import main, measure, parser, words
from nanotron_datastates.save import housekeeping
from nanotron_datastates.save.commit import CommitResult

from helpers import write_nanotron_checkpoint

OPTIMIZER = "optimizer/optimizer_pp-0-of-1_tp-0-of-1.safetensors"
RANDOM = "random/tp-0-of-1_dp-0-of-1_pp-0-of-1.safetensors"


@pytest.fixture
def ckpt(engine, tmp_path):
    root = tmp_path / "ckpt"
    for step in (20, 40):
        write_nanotron_checkpoint(engine, root, step)
    return root


@pytest.fixture
def tiny_lm(engine, tmp_path):
    """What examples/train_tiny_lm.py leaves in its output folder: files of plain `DataStatesEngine.save`
    (no manifest), `ckpt/step_<n>.safetensors` and `resume/...`, beside other files."""
    out = tmp_path / "tiny_lm"
    handles = []
    for i, rel in enumerate(
        ["ckpt/step_000050.safetensors", "ckpt/step_000100.safetensors", "resume/step_000100.safetensors"]
    ):
        torch.manual_seed(i)
        state = {
            "model": {"w": torch.randn(8, 16), "b": torch.randn(16)},
            "optimizer": {"m": torch.randn(8, 16).to(torch.bfloat16)},
            "step": 50 * (i + 1),
        }
        handles.append(engine.save(state, out / rel))
    for h in handles:
        h.wait_persisted()
    (out / "train_losses.json").write_text("[1.0, 0.5]")
    return out


TINY_LM_FILES = (
    "ckpt/step_000050.safetensors",
    "ckpt/step_000100.safetensors",
    "resume/step_000100.safetensors",
)


def run(capsys, *argv):
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def flip_byte(path, tensor, at=3):
    """Flips one bit of a tensor's bytes in the file (its header stays sound)."""
    header = fmt.read_header(path)
    (entry,) = [e for e in header.tensors if e.name == tensor]
    raw = bytearray(path.read_bytes())
    raw[header.data_start + entry.begin + at] ^= 0x10
    path.write_bytes(bytes(raw))


def test_inspect_a_checkpoints_folder(ckpt, capsys):
    (ckpt / "60").mkdir()  # a save in progress
    rc, out, _ = run(capsys, "inspect", str(ckpt))
    assert rc == 0
    assert "3 checkpoints, latest.txt names 40" in out
    assert "40: step 40, datastates, committed, latest;" in out
    assert "tp=1, pp=1, dp=1, expert=1, zero_stage=0" in out
    assert "60: step ?, unknown engine, NOT committed; 0 files, 0 tensors, 0 B; ?" in out
    rc, out, _ = run(capsys, "inspect", str(ckpt), "--json")
    info = json.loads(out)
    (c40,) = [c for c in info["checkpoints"] if c["path"].endswith("40")]
    assert c40["topology"]["zero_stage"] == 0 and c40["committed"] and c40["latest"]
    assert {f["file"] for f in c40["files"]} >= {OPTIMIZER, RANDOM, MANIFEST, "config.yaml"}


def test_inspect_one_checkpoint_lists_tensors_and_one_file(ckpt, capsys):
    rc, out, _ = run(capsys, "inspect", str(ckpt / "40"), "--tensors")
    assert rc == 0 and "model_weight_pp-rank-0-of-1_tp-rank-0-of-1.safetensors" in out
    assert "data: F32 [4, 8] (128 B)" in out
    assert (
        "model_weight_pp-rank-0-of-1_tp-rank-0-of-1.safetensors: 4.22 kB, 1 tensor F32, safetensors, " in out
    )
    assert (
        "CRC-32C per tensor in datastates.json" in out
    )  # Nanotron's weight metadata; the manifest's checksums
    rc, out, _ = run(capsys, "inspect", str(ckpt / "40" / OPTIMIZER))
    assert rc == 0 and "6 tensors F32 (296 B of data), datastates, CRC-32C per tensor" in out
    assert "F32 [4, 8]" not in out  # the tensors themselves with --tensors only
    rc, out, _ = run(capsys, "inspect", str(ckpt / "40" / OPTIMIZER), "--tensors")
    assert rc == 0 and "  state.0.exp_avg: F32 [4, 8] (128 B)" in out.splitlines()


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
    assert str(path) in problem and "'state.1.exp_avg_sq' fails its checksum" in problem
    assert report["files_checked"] == 10 and report["files_failed"] == 1
    assert report["tensors_checksummed"] == 20 and report["tensors_failed"] == 1
    rc, out, _ = run(capsys, "verify", str(ckpt))
    assert rc == 1 and out.count("PROBLEM: ") == 1
    last = out.strip().splitlines()[-1]
    assert (
        last == f"{ckpt}: FAILED (1 problem); 10 files checked (1 failed), 20 tensors checksummed (1 failed)"
    )


def test_verify_finds_missing_rank_files_and_a_wrong_latest(ckpt, capsys):
    (ckpt / "40" / RANDOM).unlink()
    shutil.rmtree(ckpt / "20")
    (ckpt / LATEST).write_text("30")
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
    doc = json.loads((folder / MANIFEST).read_text())
    doc["files"]["model/../../../secret.safetensors"] = {"bytes": 1}
    (folder / MANIFEST).write_text(json.dumps(doc))
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
    for command in ("inspect", "verify", "plot"):
        rc, out, err = run(capsys, command, str(tmp_path / "nowhere"))
        assert (rc, out) == (1, "")
        assert err == f"nanotron-datastates {command}: no such file or folder: {tmp_path / 'nowhere'}\n"
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("not a checkpoint")
    for command in ("inspect", "verify"):
        rc, out, err = run(capsys, command, str(tmp_path / "notes"), "--json")
        assert (rc, out) == (1, "")
        assert err.startswith(f"nanotron-datastates {command}: {tmp_path / 'notes'}: not a checkpoint: ")
        for looked_for in ("no safetensors files", "datastates.json", "checkpoint_metadata.json"):
            assert looked_for in err
        assert "no latest.txt or step folders" in err
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
    # a memory replicas' line is drawn beside its checkpoint, not counted as one
    ranks = [{"sent_bytes": 10**9, "received_bytes": 10**9, "seconds": 0.4, "to": [1], "error": None}]
    housekeeping.append_telemetry(tmp_path, telemetry.replication(20, ranks))
    png = tmp_path / "t.png"
    rc, out, _ = run(capsys, "plot", str(tmp_path), "-o", str(png))
    assert rc == 0 and "3 checkpoints" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rc, _, err = run(capsys, "plot", str(tmp_path / "none.jsonl"))
    assert rc == 1 and "none.jsonl" in err
    # By default the plot goes beside the telemetry it draws, not into the current folder; an -o into a
    # folder that does not exist is refused naming it, before anything is drawn
    rc, out, _ = run(capsys, "plot", str(tmp_path))
    assert rc == 0 and out.startswith(str(tmp_path / "datastates_telemetry.png"))
    assert (tmp_path / "datastates_telemetry.png").read_bytes()[:4] == b"\x89PNG"
    rc, _, err = run(capsys, "plot", str(tmp_path), "-o", str(tmp_path / "missing" / "t.png"))
    assert (
        rc == 1 and f"{tmp_path / 'missing'}: no such folder" in err and not (tmp_path / "missing").exists()
    )


def test_the_console_script_and_module_entry_point(ckpt):
    exe = shutil.which("nanotron-datastates")
    assert exe, "the console script is installed with the package"
    proc = subprocess.run([exe, "verify", str(ckpt)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cmd = [sys.executable, "-m", "nanotron_datastates", "--help"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0 and "inspect" in proc.stdout


# -- a folder of engine files (plain DataStatesEngine.save, no manifest) ------------------------------------


def test_inspect_a_folder_of_engine_files(tiny_lm, capsys):
    rc, out, err = run(capsys, "inspect", str(tiny_lm))
    assert (rc, err) == (0, "")
    lines = out.splitlines()
    total = sum((tiny_lm / rel).stat().st_size for rel in TINY_LM_FILES)
    assert lines[0] == f"{tiny_lm}: 3 safetensors files, 9 tensors, {words.human_bytes(total)}"
    for rel in TINY_LM_FILES:  # nested, in path order; other files are not listed
        size = words.human_bytes((tiny_lm / rel).stat().st_size)
        assert f"  {rel}: {size}, 3 tensors BF16/F32, datastates, CRC-32C per tensor" in lines
    assert len(lines) == 4 and "train_losses" not in out
    rc, out, _ = run(capsys, "inspect", str(tiny_lm), "--tensors")
    assert rc == 0 and out.count("    model.w: F32 [8, 16] (512 B)") == 3
    assert out.count("    optimizer.m: BF16 [8, 16] (256 B)") == 3 and "model.b: F32 [16] (64 B)" in out
    rc, out, _ = run(capsys, "inspect", str(tiny_lm / "ckpt"), "--json", "--tensors")
    info = json.loads(out)
    assert rc == 0 and info["kind"] == "folder" and info["tensors"] == 6
    assert [f["file"] for f in info["files"]] == ["step_000050.safetensors", "step_000100.safetensors"]
    assert (
        info["bytes"]
        == sum(f["bytes"] for f in info["files"])
        == sum((tiny_lm / rel).stat().st_size for rel in TINY_LM_FILES[:2])
    )
    names = [t["name"] for t in info["files"][0]["tensor_list"]]
    assert sorted(names) == ["model.b", "model.w", "optimizer.m"]
    rc, out, _ = run(capsys, "inspect", str(tiny_lm / "ckpt"), "--json")
    assert "tensor_list" not in out


def test_verify_a_folder_of_engine_files_names_every_failed_tensor(tiny_lm, capsys):
    rc, out, _ = run(capsys, "verify", str(tiny_lm))
    assert rc == 0, out
    assert out == f"{tiny_lm}: OK; 3 files checked, 9 tensors checksummed\n"
    damaged = tiny_lm / "resume" / "step_000100.safetensors"
    flip_byte(damaged, "model.w")
    flip_byte(damaged, "optimizer.m")
    rc, out, _ = run(capsys, "verify", str(tiny_lm))
    problems = [line for line in out.splitlines() if line.startswith("PROBLEM: ")]
    assert rc == 1 and len(problems) == 2
    assert all(p.startswith(f"PROBLEM: {damaged}: tensor ") for p in problems)
    assert "'model.w' fails its checksum" in problems[0] and "'optimizer.m' fails its checksum" in problems[1]
    last = out.splitlines()[-1]
    assert (
        last
        == f"{tiny_lm}: FAILED (2 problems); 3 files checked (1 failed), 9 tensors checksummed (2 failed)"
    )
    rc, out, _ = run(capsys, "verify", str(damaged), "--json")
    report = json.loads(out)
    assert rc == 1 and len(report["problems"]) == 2
    assert (report["files_checked"], report["files_failed"]) == (1, 1)
    assert (report["tensors_checksummed"], report["tensors_failed"]) == (3, 2)


def test_verify_one_file_with_a_flipped_bit_counts_what_it_checked(tiny_lm, capsys):
    path = tiny_lm / "ckpt" / "step_000050.safetensors"
    rc, out, _ = run(capsys, "verify", str(path))
    assert (rc, out) == (0, f"{path}: OK; 1 file checked, 3 tensors checksummed\n")
    flip_byte(path, "model.b", at=0)
    rc, out, _ = run(capsys, "verify", str(path))
    problem, summary = out.splitlines()
    assert rc == 1 and problem.startswith(f"PROBLEM: {path}: tensor 'model.b' fails its checksum")
    assert (
        summary == f"{path}: FAILED (1 problem); 1 file checked (1 failed), 3 tensors checksummed (1 failed)"
    )


def test_a_folder_of_a_checkpoint_never_committed_is_checked_file_by_file(ckpt, capsys):
    folder = ckpt / "40"
    (folder / MANIFEST).unlink()
    (folder / NANOTRON_METADATA).unlink()
    (ckpt / LATEST).unlink()
    shutil.rmtree(ckpt / "20")
    rc, out, _ = run(capsys, "verify", str(folder))
    assert rc == 0, out
    assert "config.yaml and model_config.json but neither datastates.json nor checkpoint_metadata.json" in out
    assert out.splitlines()[-1] == (
        f"{folder}: OK; 5 files checked, 8 tensors checksummed, 2 files without checksums (structure checked)"
    )
    rc, out, _ = run(capsys, "verify", str(ckpt))  # its checkpoints folder: nothing committed, nothing used
    assert rc == 0 and "not committed (a save in progress or cut short); not used" in out


def test_nanotron_own_layout_is_read_without_a_manifest(ckpt, capsys):
    folder = ckpt / "40"
    (folder / MANIFEST).unlink()  # checkpoint_metadata.json remains: Nanotron's own layout
    rc, out, _ = run(capsys, "inspect", str(folder))
    assert rc == 0 and "40: step 40, nanotron (torch), committed, latest; 8 files, 10 tensors" in out
    rc, out, _ = run(capsys, "verify", str(folder))
    assert rc == 0, out
    assert f"note: {folder}: Nanotron's own layout; safetensors headers checked, pickles not" in out
    assert out.splitlines()[-1] == (
        f"{folder}: OK; 5 files checked, 8 tensors checksummed, 2 files without checksums (structure checked)"
    )


# -- words, units, --tensors everywhere -------------------------------------------------------------------


def test_human_units_and_plurals():
    sizes = [0, 1, 999, 1000, 1234, 12_345, 512_000, 999_499, 999_999, 2_160_000_000, 5 * 10**12]
    expected = ["0 B", "1 B", "999 B", "1 kB", "1.23 kB", "12.3 kB", "512 kB", "999 kB", "1 MB", "2.16 GB"]
    assert [words.human_bytes(n) for n in sizes] == [*expected, "5 TB"]
    assert [words.plural(n, "tensor") for n in (0, 1, 2)] == ["0 tensors", "1 tensor", "2 tensors"]
    assert words.plural(1, "temporary", "temporaries") == "1 temporary"
    assert words.plural(3, "temporary", "temporaries") == "3 temporaries"


def test_every_size_printed_is_in_one_unit_system(ckpt, tiny_lm, capsys):
    outputs = []
    for argv in (
        [str(ckpt), "--tensors"],
        [str(ckpt / "40")],
        [str(ckpt / "40" / OPTIMIZER), "--tensors"],
        [str(tiny_lm), "--tensors"],
    ):
        rc, out, _ = run(capsys, "inspect", *argv)
        assert rc == 0
        outputs.append(out)
    text = "\n".join(outputs)
    assert "bytes" not in text and "GiB" not in text and "0.000" not in text
    sizes = re.findall(r"(\d+(?:\.\d+)?) (B|kB|MB|GB)\b", text)
    assert len(sizes) > 40
    for number, unit in sizes:  # three significant digits at most, never a zero before the point but for 0 B
        assert len(number.replace(".", "").lstrip("0")) <= 3 and float(number) < 1000
        assert float(number) >= 1 or (number, unit) == ("0", "B")
    assert re.search(r"\b1 tensor F32\b", text) and re.search(r"\b6 tensors F32\b", text)
    assert "1 tensors" not in text and "1 files" not in text and "1 checkpoints" not in text


def test_tensors_lists_every_files_tensors_in_a_checkpoints_folder(ckpt, capsys):
    rc, out, _ = run(capsys, "inspect", str(ckpt))
    assert rc == 0 and "state.0.exp_avg" not in out and len(out.splitlines()) == 3
    rc, out, _ = run(capsys, "inspect", str(ckpt), "--tensors")
    lines = out.splitlines()
    assert rc == 0 and lines.count("      state.0.exp_avg: F32 [4, 8] (128 B)") == 2  # one per checkpoint
    assert lines.count("      data: F32 [4, 8] (128 B)") == 2  # the weight of each
    listed = f"    {OPTIMIZER}: 4.39 kB, 6 tensors F32, datastates, CRC-32C per tensor"
    assert lines.count(listed) == 2 and len(lines) == 3 + 2 * (9 + 10)  # 9 files and 10 tensors each
    rc, out, _ = run(capsys, "inspect", str(ckpt), "--tensors", "--json")
    files = [f for c in json.loads(out)["checkpoints"] for f in c["files"] if f["file"] == OPTIMIZER]
    assert len(files) == 2 and all(len(f["tensor_list"]) == f["tensors"] == 6 for f in files)


# -- plot: what it needs ------------------------------------------------------------------------------------


def test_plot_says_what_it_needs(tiny_lm, ckpt, capsys):
    path = tiny_lm / "ckpt" / "step_000050.safetensors"
    rc, out, err = run(capsys, "plot", str(path))
    assert (rc, out) == (1, "")
    assert err.startswith(f"nanotron-datastates plot: {path}: a safetensors file, not telemetry; ")
    assert "codec" not in err and "decode" not in err
    for needed in (housekeeping.TELEMETRY, "checkpoints folder", "DataStatesEngine(..., telemetry_path=...)"):
        assert needed in err
    rc, out, err = run(capsys, "plot", str(tiny_lm))
    assert (rc, out) == (1, "")
    assert err.startswith(f"nanotron-datastates plot: {tiny_lm / housekeeping.TELEMETRY}: no such file")
    for needed in ("datastates.telemetry: true", "DataStatesEngine(..., telemetry_path=...)"):
        assert needed in err
    r = CommitResult(40, ckpt / "40", True, [], 10**6, 5, 0.01, 0.05, 1.0, 1.1)
    housekeeping.append_telemetry(ckpt, housekeeping.telemetry_record(r, {}, []))
    rc, _, err = run(capsys, "plot", str(ckpt / "40"))  # one checkpoint's folder: its parent holds the file
    assert rc == 1 and f"({ckpt} holds one: plot that folder)" in err
    (tiny_lm / "notes.jsonl").write_bytes(b"\xff\xfe not text")
    rc, _, err = run(capsys, "plot", str(tiny_lm / "notes.jsonl"))
    assert rc == 1 and "no telemetry records" in err and "codec" not in err
    assert measure.TELEMETRY == housekeeping.TELEMETRY


# -- a closed pipe; help ------------------------------------------------------------------------------------


def _console_script() -> str:
    exe = shutil.which("nanotron-datastates")
    assert exe, "the console script is installed with the package"
    return exe


@pytest.mark.slow
@pytest.mark.parametrize("unbuffered", ["1", ""])
def test_a_closed_pipe_ends_the_command_quietly(tiny_lm, unbuffered):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if unbuffered:
        env["PYTHONUNBUFFERED"] = unbuffered
    # Closed before the command writes anything (it takes a while to start): its first write fails.
    for argv in (["inspect", "--json", str(tiny_lm)], ["verify", str(tiny_lm)], ["--help"]):
        proc = subprocess.Popen(
            [_console_script(), *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
        )
        proc.stdout.close()
        err = proc.stderr.read()
        proc.stderr.close()
        rc = proc.wait()
        assert err == b"", (argv, err)
        assert rc in ((0, 1) if argv == ["--help"] else (1,)), argv  # 1: all of it could not be written


def test_piped_into_head_prints_no_broken_pipe(engine, tmp_path):
    path = tmp_path / "many.safetensors"
    engine.save({f"layer{i}.weight": torch.zeros(2) for i in range(3000)}, path).wait_persisted()
    cmd = [sys.executable, "-m", "nanotron_datastates", "inspect", "--json", "--tensors", str(tmp_path)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # block-buffered, as in a shell
    producer = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    head = subprocess.Popen(["head", "-c", "1"], stdin=producer.stdout, stdout=subprocess.PIPE)
    producer.stdout.close()  # head holds the only reading end
    first, _ = head.communicate()
    err = producer.stderr.read()
    producer.stderr.close()
    assert first == b"{" and head.returncode == 0
    assert err == b"" and producer.wait() == 1  # far more than a pipe holds: its writes failed, quietly


def test_every_option_says_what_it_does_and_its_default(capsys):
    p = parser.build_parser()
    (commands,) = [a for a in p._actions if isinstance(a, type(p._subparsers._group_actions[0]))]
    assert set(commands.choices) == {"inspect", "verify", "convert", "bench", "plot", "tier"}
    for name, sub in commands.choices.items():
        for action in sub._actions:
            if action.option_strings and action.dest != "help":
                assert action.help and ("default" in action.help or "required" in action.help), (name, action)
        with pytest.raises(SystemExit) as e:
            main([name, "--help"])
        assert e.value.code == 0
        text = " ".join(capsys.readouterr().out.split())
        assert text.count("(default: ") + text.count("(required") >= 1
        assert "exit status: 0 all is well, 1 problems found or the command failed, 2 bad usage" in text
    with pytest.raises(SystemExit):
        main(["plot", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: datastates_telemetry.png beside the telemetry file drawn)" in text
    assert "datastates.telemetry: true" in text


def test_tier_lists_and_clears_what_jobs_keep_in_memory(tmp_path, capsys):
    from nanotron_datastates.tier.memory import MemoryTier
    from nanotron_datastates.tier.room import check_room

    base = tmp_path / "shm"
    for job in ("a", "b"):
        tier = MemoryTier(base, tmp_path / job, 0)
        check_room(tier, 1)
        (tier.path(40, "model/w.safetensors")).parent.mkdir(parents=True)
        tier.path(40, "model/w.safetensors").write_bytes(b"x" * 1500)
        tier.commit(40, {"model/w.safetensors": {"bytes": 1500, "crc32c": {}}})
    replicas = MemoryTier(base, tmp_path / "b", 3, copies=1, area="replicas")  # kept for rank 3's node
    replicas.path(40, "model/w3.safetensors").parent.mkdir(parents=True)
    replicas.path(40, "model/w3.safetensors").write_bytes(b"y" * 2000)
    replicas.commit(40, {"model/w3.safetensors": {"bytes": 2000, "crc32c": {}}})
    rc, out, _ = run(capsys, "tier", "list", "--path", str(base))
    assert rc == 0 and out.count("1 step (40)") == 2 and str(tmp_path / "a") in out and " kB" in out
    assert out.count("replicas of step 40 for rank(s) 3 of other nodes (2.") == 1, out
    rc, out, _ = run(capsys, "tier", "clear", str(tmp_path / "a"), "--path", str(base))
    assert rc == 0 and "removed 1 job folder" in out
    rc, out, _ = run(capsys, "tier", "list", "--path", str(base), "--json")
    assert [j["checkpoints"] for j in json.loads(out)] == [str((tmp_path / "b").resolve())]
    rc, out, _ = run(capsys, "tier", "clear", "--path", str(base))
    assert rc == 0 and "removed 1 job folder" in out
    rc, out, _ = run(capsys, "tier", "list", "--path", str(base))
    assert rc == 0 and "no checkpoint held in memory" in out
    # Nothing to clear is said, with a failing status: a tier folder or a job that is not there
    rc, _, err = run(capsys, "tier", "clear", "--path", str(tmp_path / "nowhere"))
    assert rc == 1 and f"{tmp_path / 'nowhere'}: no such folder" in err
    rc, _, err = run(capsys, "tier", "clear", str(tmp_path / "a"), "--path", str(base))
    assert rc == 1 and f"no job of {tmp_path / 'a'}" in err


def test_tier_refuses_a_folder_another_user_planted(tmp_path, capsys):
    base = tmp_path / "shm"
    base.mkdir(mode=0o700)
    os.chown(base, 65534, 65534)
    for action in ("list", "clear"):
        rc, _, err = run(capsys, "tier", action, "--path", str(base))
        assert rc == 1 and str(base) in err and "uid 65534" in err
    assert base.is_dir()
