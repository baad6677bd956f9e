"""A FIFO, a socket or a folder where a checkpoint's file belongs: every reader of the engine and every
command fails at once with an error naming the file, and never waits on it (a FIFO's reader blocks until a
writer comes, forever). Each reader runs on a thread with a deadline, so that one that blocks fails its
test."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch
from test_convert import OPTIMIZER, stock_checkpoint

from nanotron_datastates import ChecksumError, DataStatesEngine
from nanotron_datastates import format as fmt
from nanotron_datastates.checkpoint.names import MANIFEST, NANOTRON_METADATA
from nanotron_datastates.cli import main

from helpers import small_config, within, write_nanotron_checkpoint

DEADLINE = 5.0  # seconds; a reader that fails at once takes milliseconds


@pytest.fixture(scope="module")
def engine() -> Iterator[DataStatesEngine]:
    with DataStatesEngine(small_config()) as e:
        yield e


@pytest.fixture
def fifo() -> Iterator[Callable[[Path], Path]]:
    """Makes a FIFO at a path (what was there removed); afterwards, a writer opens each once, so that a reader
    still blocked on one (the failure under test) gets its end of file and its thread ends."""
    made: list[Path] = []

    def make(path: Path) -> Path:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif os.path.lexists(path):
            path.unlink()
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(path)
        made.append(path)
        return path

    yield make
    for _ in range(3):
        for path in made:
            with contextlib.suppress(OSError):  # ENXIO: no reader on it
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        time.sleep(0.05)


@pytest.fixture
def writer_waits() -> Iterator[Callable[[Path], threading.Event]]:
    """A writer blocked on a FIFO until a reader opens it: its event is set if anything opened the FIFO for
    reading, which no reader of the package ever does. Released afterwards."""
    waiting: list[tuple[Path, threading.Thread]] = []

    def start(path: Path) -> threading.Event:
        opened = threading.Event()

        def write() -> None:
            os.close(os.open(path, os.O_WRONLY))
            opened.set()

        waiting.append((path, threading.Thread(target=write, daemon=True)))
        waiting[-1][1].start()
        return opened

    yield start
    for path, thread in waiting:
        with (
            contextlib.suppress(OSError),
            open(path, "rb", opener=lambda p, f: os.open(p, f | os.O_NONBLOCK)),
        ):
            thread.join(DEADLINE)


def outcome(fn: Callable[[], Any]) -> BaseException | None:
    """What `fn()` raised (None where it returned), on a thread that must end within DEADLINE."""
    return within(fn, DEADLINE).get("error")


def fails_naming(fn: Callable[[], Any], path: Path, kind: type[BaseException] = OSError) -> BaseException:
    err = outcome(fn)
    assert isinstance(err, kind), f"expected {kind.__name__} naming {path}, got {err!r}"
    assert str(path) in str(err), err
    return err


# -- the engine's readers ------------------------------------------------------------------------------------

READERS: dict[str, Callable[[DataStatesEngine, Path], Any]] = {
    "load": lambda e, p: e.load(p),
    "load_into": lambda e, p: e.load_into(p, {"a": torch.empty(4)}),
    "load_tensors": lambda e, p: e.load_tensors(p, ["a"]),
    "load_ranges": lambda e, p: e.load_ranges(p, {"a": (0, 2)}),
    "load_range_list": lambda e, p: e.load_range_list(p, [("a", 0, 2)]),
    "read_header": lambda e, p: fmt.read_header(p),
    "read_metadata": lambda e, p: e.read_metadata(p),
    "read_structure": lambda e, p: e.read_structure(p),
    "verify": lambda e, p: e.verify(p),
}


@pytest.mark.parametrize("reader", READERS)
def test_every_reader_refuses_a_fifo_at_once_naming_it_and_never_opens_it(
    engine, fifo, writer_waits, tmp_path, reader
):
    path = fifo(tmp_path / "state.safetensors")
    opened = writer_waits(path)
    err = fails_naming(lambda: READERS[reader](engine, path), path)
    assert "FIFO" in err.strerror and err.filename == str(path)
    assert not opened.wait(0.2), f"{reader} opened the FIFO"


@pytest.mark.parametrize("reader", READERS)
def test_every_reader_refuses_a_folder_naming_it(engine, tmp_path, reader):
    path = tmp_path / "state.safetensors"
    path.mkdir()
    err = fails_naming(lambda: READERS[reader](engine, path), path, IsADirectoryError)
    assert err.filename == str(path)


@pytest.mark.parametrize("reader", ["load", "read_header", "verify"])
def test_a_socket_is_refused_naming_it(engine, tmp_path, reader):
    path = tmp_path / "state.safetensors"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        err = fails_naming(lambda: READERS[reader](engine, path), path)
    assert "socket" in err.strerror


def test_a_link_the_caller_chose_to_a_file_is_read(engine, tmp_path):
    """The caller's own path may be a link: followed, unlike the files of a checkpoint folder."""
    engine.save({"a": torch.arange(4.0)}, tmp_path / "real.safetensors").wait_persisted()
    (tmp_path / "link.safetensors").symlink_to(tmp_path / "real.safetensors")
    assert torch.equal(engine.load(tmp_path / "link.safetensors")["a"], torch.arange(4.0))
    assert engine.verify(tmp_path / "link.safetensors")


# -- a CPU load of a file that others can change -----------------------------------------------------------

OTHER = 12345  # another user's uid (CI runs as root, which may chown)
ONES = 1 << 16


def _shared_file(engine: DataStatesEngine, tmp_path: Path, who: str) -> Path:
    """A saved file of ones that another user could rewrite: theirs, or writable by all."""
    path = tmp_path / "shared.safetensors"
    engine.save({"a": torch.ones(ONES)}, path).wait_persisted()
    if who == "other-user":
        try:
            os.chown(path, OTHER, OTHER)
        except PermissionError:
            pytest.skip("no permission to give a file to another user here")
        path.chmod(0o644)
    else:
        path.chmod(0o666)
    return path


def _rewrite_in_place(path: Path) -> None:
    """Every 1.0 of the data section made 2.0, in the same file (the page cache the mappings share)."""
    raw = path.read_bytes()
    start = 8 + int.from_bytes(raw[:8], "little")
    with open(path, "r+b") as f:
        f.seek(start)
        f.write(raw[start:].replace(b"\x00\x00\x80\x3f", b"\x00\x00\x00\x40"))


@pytest.mark.parametrize("who", ["other-user", "world-writable"])
def test_a_cpu_load_of_a_file_others_can_write_is_a_copy_they_cannot_change(engine, tmp_path, who):
    """Checked, then changed in place by its owner: the tensors loaded keep the bytes that were checked."""
    path = _shared_file(engine, tmp_path, who)
    got = engine.load(path)["a"]
    _rewrite_in_place(path)
    with pytest.raises(ChecksumError):  # the file did change: a new load finds it so
        engine.load(path)
    assert torch.equal(got, torch.ones(ONES))


TRUNCATED = """
import os, sys
from nanotron_datastates import DataStatesEngine
with DataStatesEngine(host_cache_size=1 / 64, chunk_size=1) as engine:
    got = engine.load(sys.argv[1])["a"]
    os.truncate(sys.argv[1], 0)
    print(float(got.sum()), flush=True)
"""


@pytest.mark.parametrize("who", ["other-user", "world-writable"])
def test_a_cpu_load_outlives_its_file_cut_short_by_another_user(engine, tmp_path, who):
    """A mapping of a file cut short is a SIGBUS when touched past its new end: a copy is not."""
    path = _shared_file(engine, tmp_path, who)
    r = subprocess.run(
        [sys.executable, "-c", TRUNCATED, str(path)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0 and r.stdout.strip() == f"{float(ONES)}", (r.returncode, r.stderr[-2000:])


# -- the commands --------------------------------------------------------------------------------------------


def run(capsys, *argv: str) -> tuple[int, str]:
    box: dict[str, int] = {}
    err = outcome(lambda: box.setdefault("rc", main(list(argv))))
    assert err is None, err
    out = capsys.readouterr()
    return box["rc"], out.out + out.err


@pytest.fixture
def ckpt(engine, tmp_path) -> Path:
    """A committed datastates checkpoint, step 40, in its checkpoints folder."""
    return write_nanotron_checkpoint(engine, tmp_path / "ckpt", 40)


NANOTRON_FILES = [NANOTRON_METADATA, "config.yaml"]
OPTIMIZER_OURS = "optimizer/optimizer_pp-0-of-1_tp-0-of-1.safetensors"


@pytest.mark.parametrize("name", NANOTRON_FILES)
@pytest.mark.parametrize("command", ["inspect", "verify"])
@pytest.mark.parametrize("ours", [True, False], ids=["datastates", "stock"])
def test_inspect_and_verify_fail_on_a_fifo_nanotron_file_naming_it(ckpt, fifo, capsys, name, command, ours):
    if not ours:
        (ckpt / MANIFEST).unlink()  # Nanotron's own layout
    path = fifo(ckpt / name)
    for where in (ckpt, ckpt.parent):  # the checkpoint, and its checkpoints folder
        rc, out = run(capsys, command, str(where))
        assert rc == 1 and str(path) in out, out


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_a_fifo_manifest_is_never_taken_for_a_stock_checkpoint(ckpt, fifo, capsys, command):
    path = fifo(ckpt / MANIFEST)
    for where in (ckpt, ckpt.parent):
        rc, out = run(capsys, command, str(where))
        assert rc == 1 and str(path) in out, out
        assert "Nanotron's own layout" not in out, out


def test_verify_says_a_fifo_is_not_a_regular_file_rather_than_missing(ckpt, fifo, capsys):
    paths = [fifo(ckpt / "config.yaml"), fifo(ckpt / OPTIMIZER_OURS)]
    rc, out = run(capsys, "verify", str(ckpt))
    assert rc == 1
    for path in paths:
        assert str(path) in out and f"{path}: missing" not in out and "missing" not in out, out


def test_a_fifo_among_engine_files_is_verified_not_skipped(engine, fifo, tmp_path, capsys):
    engine.save({"a": torch.ones(3)}, tmp_path / "run" / "a.safetensors").wait_persisted()
    path = fifo(tmp_path / "run" / "b.safetensors")
    rc, out = run(capsys, "verify", str(tmp_path / "run"))
    assert rc == 1 and str(path) in out, out
    rc, out = run(capsys, "inspect", str(tmp_path / "run"))
    assert rc == 1 and str(path) in out and "2 safetensors files" in out, out  # listed, with its error


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_inspect_and_verify_fail_on_a_fifo_weight_file_naming_it(ckpt, fifo, capsys, command):
    """A stock checkpoint's weights are not in a manifest: found by listing, the FIFO among them."""
    (ckpt / MANIFEST).unlink()
    path = fifo(next((ckpt / "model").rglob("*.safetensors")))
    rc, out = run(capsys, command, str(ckpt))
    assert rc == 1 and str(path) in out, out  # inspect lists the file with its error


@pytest.mark.parametrize("name", [*NANOTRON_FILES, OPTIMIZER])
def test_convert_to_datastates_refuses_a_fifo_naming_it(fifo, tmp_path, capsys, name):
    stock = tmp_path / "stock"
    stock_checkpoint(stock, with_random=False)
    path = fifo(stock / name)
    out = tmp_path / "out"
    rc, text = run(capsys, "convert", str(stock), str(out), "--to", "datastates")
    assert rc == 1 and str(path) in text, text
    assert not out.exists()


@pytest.mark.parametrize("name", [*NANOTRON_FILES, "model_config.json"])
def test_convert_to_torch_refuses_a_fifo_naming_it(ckpt, fifo, tmp_path, capsys, name):
    path = fifo(ckpt / name)
    out = tmp_path / "out"
    rc, text = run(capsys, "convert", str(ckpt), str(out), "--to", "torch")
    assert rc == 1 and str(path) in text, text
    assert not out.exists()


def _plant_links(folder: Path, secret: Path, where: str) -> Path:
    """A link planted in a checkpoint given to `convert`: to a file (`file`), as a weight file (`weight`), or
    as a whole subfolder (`folder`); each leads to `secret` or its folder."""
    if where == "file":
        link = folder / "notes.txt"
        link.symlink_to(secret)
    elif where == "weight":
        link = folder / "model" / "stolen.safetensors"
        link.symlink_to(secret)
    else:
        link = folder / "extra"
        link.symlink_to(secret.parent, target_is_directory=True)
    return link


@pytest.fixture
def secret(tmp_path) -> Path:
    """A private file of the user who runs `convert` (often root), outside the checkpoint."""
    path = tmp_path / "private" / "id_key"
    path.parent.mkdir()
    path.write_bytes(b"-----BEGIN PRIVATE KEY----- not for the neighbour")
    path.chmod(0o600)
    return path


def _leaked(out: Path, secret: Path) -> list[Path]:
    data = secret.read_bytes()
    return [p for p in out.rglob("*") if p.is_file() and data in p.read_bytes()] if out.exists() else []


@pytest.mark.parametrize("where", ["file", "weight", "folder"])
def test_convert_to_datastates_refuses_a_link_in_the_checkpoint_naming_it(tmp_path, capsys, secret, where):
    stock = tmp_path / "stock"
    stock_checkpoint(stock, with_random=False)
    link = _plant_links(stock, secret, where)
    out = tmp_path / "out"
    rc, text = run(capsys, "convert", str(stock), str(out), "--to", "datastates")
    assert rc == 1 and str(link) in text and "link" in text, text
    assert not out.exists() and not _leaked(tmp_path / "out", secret)


@pytest.mark.parametrize("where", ["file", "folder"])
def test_convert_to_torch_refuses_a_link_in_the_checkpoint_naming_it(ckpt, tmp_path, capsys, secret, where):
    link = _plant_links(ckpt, secret, where)
    out = tmp_path / "out"
    rc, text = run(capsys, "convert", str(ckpt), str(out), "--to", "torch")
    assert rc == 1 and str(link) in text and "link" in text, text
    assert not out.exists() and not _leaked(out, secret)


# -- the core's own open, and the telemetry --------------------------------------------------------------


@pytest.mark.parametrize("direct", [True, False])
def test_the_core_opening_a_path_itself_refuses_a_fifo_at_once_and_never_opens_it(
    fifo, writer_waits, tmp_path, direct
):
    path = fifo(tmp_path / "state.safetensors")
    opened = writer_waits(path)
    with DataStatesEngine(small_config(direct_io=direct)) as e:
        err = fails_naming(lambda: e._core.restore_host(str(path), 4096, 16, [0], [16], False), path)
    assert isinstance(err, OSError) and err.filename == str(path)
    assert not opened.wait(0.2), "the core opened the FIFO"


def test_telemetry_is_never_waited_on_where_a_fifo_takes_its_name(fifo, tmp_path):
    from nanotron_datastates import telemetry

    path = fifo(tmp_path / telemetry.FILE)
    fails_naming(lambda: telemetry.append(tmp_path, [{"step": 1}]), path)
    fails_naming(lambda: telemetry.read(tmp_path), path)
    rc = outcome(lambda: main(["plot", str(tmp_path), "-o", str(tmp_path / "t.png")]))
    assert rc is None  # returned (exit 1, said on stderr), never blocked


# -- a file swapped for a FIFO between its check and its open ------------------------------------------------

SWAPPED = """
import json, os, sys, threading
from nanotron_datastates import trust
target, fifo, how = sys.argv[1:4]
at = int(sys.argv[4]) if len(sys.argv) > 4 else 1  # which open of the file's name the swap comes before
opens, swaps, writer_in = [], [], threading.Event()

def neighbour(event, args):  # swaps the FIFO in just before the package opens the file's name
    if event == "open" and isinstance(args[0], str) and args[0].endswith("state.bin"):
        opens.append(args[0])
        if len(opens) == at:
            swaps.append(os.rename(fifo, target))

def writer():  # blocks until a reader opens the FIFO: that open is what must never happen
    os.close(os.open(fifo, os.O_WRONLY))
    writer_in.set()

threading.Thread(target=writer, daemon=True).start()
sys.addaudithook(neighbour)
try:
    if how == "open_to_read":
        os.close(trust.open_to_read(target))
    elif how == "read_regular":
        trust.read_regular(target, 1 << 20)
    else:
        os.close(trust.open_regular(os.path.basename(target), within=os.path.dirname(target)))
    error = None
except OSError as e:
    error = f"{type(e).__name__}: {e}"
opened = writer_in.wait(0.5)
with open(target, "rb", opener=lambda p, f: os.open(p, f | os.O_NONBLOCK)):
    pass  # releases the writer, if still waiting
print(json.dumps({"swapped": len(swaps), "opened": opened, "error": error}))
"""


@pytest.mark.parametrize("how", ["open_to_read", "read_regular", "open_regular"])
def test_a_file_swapped_for_a_fifo_after_its_check_is_never_opened(tmp_path, how):
    """The neighbour renames a FIFO over the file at the moment of the open (an audit hook times it): the
    package refuses it, naming it, and never opens it: a writer waiting on that FIFO stays waiting."""
    target, fifo = tmp_path / "state.bin", tmp_path / "planted"
    target.write_bytes(b"x" * 64)
    os.mkfifo(fifo)
    r = subprocess.run(
        [sys.executable, "-c", SWAPPED, str(target), str(fifo), how],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout)
    assert got["swapped"] == 1, got
    assert got["error"] and "UntrustedPath" in got["error"] and str(target) in got["error"], got
    assert not got["opened"], f"{how} opened the FIFO swapped in after its check: {got}"


NO_PROC = """
import json, os, sys
from nanotron_datastates import DataStatesEngine, trust
folder = sys.argv[1]
got = {"proc": os.path.isdir("/proc/self/fd")}
with os.fdopen(trust.open_to_read(os.path.join(folder, "state.bin")), "rb") as f:
    got["open_to_read"] = f.read().decode()
got["read_regular"] = trust.read_regular(os.path.join(folder, "state.bin"), 64).decode()
with DataStatesEngine(host_cache_size=1 / 64) as e:  # the core's own open, by path
    spans, _ = e._core.restore_host(os.path.join(folder, "state.bin"), 0, 8, [0], [8], False)
    got["core"] = bytes(spans[0].numpy()).decode()
fifo = os.path.join(folder, "fifo")
for how, read in (("open_to_read", trust.open_to_read), ("open_regular", trust.open_regular)):
    try:
        read(fifo)
    except OSError as e:
        got[how + "_fifo"] = f"{type(e).__name__}: {e}"
print(json.dumps(got))
"""


def test_without_proc_files_are_still_read_and_a_fifo_refused(tmp_path):
    """Where /proc is not mounted (no /proc/self/fd to open a checked handle through), a file is opened by
    name again and refused unless it is the file checked: reads work, a FIFO is an error naming it."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("hiding /proc takes root and unshare (CI runs as root)")
    (tmp_path / "state.bin").write_text("datastat")
    os.mkfifo(tmp_path / "fifo")
    script = tmp_path / "no_proc.py"
    script.write_text(NO_PROC)
    hide = f"mount -t tmpfs none /proc && exec {sys.executable} {script} {tmp_path}"
    r = subprocess.run(["unshare", "-m", "sh", "-c", hide], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["proc"] is False, got
    assert got["open_to_read"] == got["read_regular"] == got["core"] == "datastat", got
    for how in ("open_to_read", "open_regular"):
        assert "UntrustedPath" in got[how + "_fifo"] and str(tmp_path / "fifo") in got[how + "_fifo"], got
    # A FIFO swapped in after the check, before the open by name: opened (nothing else can be), then refused.
    os.mkfifo(tmp_path / "planted")
    script.write_text(SWAPPED)
    args = f"{tmp_path / 'state.bin'} {tmp_path / 'planted'} open_to_read 2"
    swap = f"mount -t tmpfs none /proc && exec {sys.executable} {script} {args}"
    r = subprocess.run(["unshare", "-m", "sh", "-c", swap], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    swapped = json.loads(r.stdout)
    assert swapped["swapped"] == 1 and "replaced while opened" in swapped["error"], swapped
