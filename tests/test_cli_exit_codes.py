"""The command's exit status says what its output says (0 all well, 1 a problem found or a failure, 2 bad
usage) for every command and kind of path; its errors name the path without a bare `[Errno N]`; and a name
read from disk cannot forge a line of its output."""

import os

import pytest
import torch

from nanotron_datastates.cli import main
from nanotron_datastates.cli.words import printable

from helpers import write_nanotron_checkpoint

FORGED = "w\nPROBLEM: forged\x1b[2J.safetensors"


def run(capsys, *argv):
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def break_file(path):
    path.write_bytes(b"\xff" * 64)  # no safetensors header


@pytest.fixture
def files(engine, tmp_path):
    folder = tmp_path / "files"
    for name in ("a.safetensors", "b.safetensors"):
        engine.save({"x": torch.arange(8.0)}, folder / name).wait_persisted()
    return folder


def test_inspect_exits_1_where_a_file_of_a_folder_is_unreadable_as_for_the_file_alone(files, capsys):
    assert run(capsys, "inspect", str(files))[0] == 0
    break_file(files / "b.safetensors")
    for path in (files, files / "b.safetensors"):
        rc, out, err = run(capsys, "inspect", str(path))
        assert rc == 1, (path, out, err)
        assert "b.safetensors" in out + err
    rc, out, _ = run(capsys, "inspect", str(files), "--json")
    assert rc == 1 and '"error"' in out


def test_inspect_exits_1_where_a_file_of_a_checkpoint_or_of_a_checkpoints_folder_is_unreadable(
    engine, tmp_path, capsys
):
    root = tmp_path / "ckpt"
    for step in (20, 40):
        write_nanotron_checkpoint(engine, root, step)
    assert run(capsys, "inspect", str(root))[0] == 0
    assert run(capsys, "inspect", str(root / "40"))[0] == 0
    weight = next((root / "20" / "model").rglob("*.safetensors"))
    break_file(weight)
    rc, out, _ = run(capsys, "inspect", str(root / "20"))
    assert rc == 1 and "ERROR" in out, out
    rc, out, _ = run(capsys, "inspect", str(root), "--tensors")
    assert rc == 1 and "ERROR" in out, out
    assert run(capsys, "inspect", str(root / "40"))[0] == 0


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--size-mib", "-5"], "-5: must be at least 1"),
        (["--size-mib", "0"], "0: must be at least 1"),
        (["--repeat", "0"], "0: must be at least 1"),
        (["--size-mib", "x"], "'x' is not a whole number"),
        (["--dir", "/nonexistent/bench"], "/nonexistent/bench does not exist"),
    ],
)
def test_bench_bad_usage_exits_2_naming_the_option(argv, said, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--quiet", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert argv[0] in err and said in err and "[Errno" not in err


def test_bench_dir_that_is_a_file_is_bad_usage(tmp_path, capsys):
    (tmp_path / "f").write_text("")
    with pytest.raises(SystemExit) as e:
        main(["bench", "--dir", str(tmp_path / "f")])
    assert e.value.code == 2 and f"{tmp_path / 'f'} is not a folder" in capsys.readouterr().err


def test_an_os_error_is_said_with_its_path_never_as_a_bare_errno(tmp_path, capsys):
    base = tmp_path / "shm"
    base.mkdir(mode=0o777)  # a tier folder others may write: refused with an OSError of ours
    os.chmod(base, 0o777)
    rc, _, err = run(capsys, "tier", "list", "--path", str(base))
    assert rc == 1 and str(base) in err and "[Errno" not in err, err
    (tmp_path / "dir.safetensors").mkdir()
    rc, _, err = run(capsys, "plot", str(tmp_path / "dir.safetensors" / "x"))
    assert rc == 1 and "[Errno" not in err, err


def test_a_name_read_from_disk_cannot_forge_a_line_of_verify_or_inspect(engine, tmp_path, capsys):
    folder = tmp_path / "files"
    engine.save({"x": torch.arange(8.0)}, folder / "ok.safetensors").wait_persisted()
    engine.save({"x": torch.arange(8.0)}, folder / FORGED).wait_persisted()
    break_file(folder / FORGED)
    rc, out, _ = run(capsys, "verify", str(folder))
    assert rc == 1
    lines = out.splitlines()
    assert not [line for line in lines if line.startswith("PROBLEM: forged")], out
    assert sum(line.startswith("PROBLEM: ") for line in lines) == 1, out
    assert "\x1b" not in out and "w\\nPROBLEM: forged\\x1b[2J.safetensors" in out
    rc, out, _ = run(capsys, "inspect", str(folder))
    assert rc == 1 and len(out.splitlines()) == 3 and "\x1b" not in out, out


def test_printable_escapes_controls_separators_and_bidi_but_keeps_letters():
    assert printable("step 40: é 中 ok") == "step 40: é 中 ok"
    assert printable("a\nb\r\tc\x1b\u202e\u2028\x00") == "a\\nb\\r\\tc\\x1b\\u202e\\u2028\\x00"
