"""The files of a replica on their way in (tier/replica_transfer.py), on real files: an older replica's file
that a new one takes over is never followed through a link, never a FIFO waited on, never a file with a
second name overwritten; a received file whose bytes differ from its manifest entry is never renamed into
place, and nothing of it is left."""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path

import pytest
import torch

from nanotron_datastates import ChecksumError, DataStatesConfig, DataStatesEngine
from nanotron_datastates.checkpoint.checksums import file_entry
from nanotron_datastates.tier.replica_check import check_and_place
from nanotron_datastates.tier.replica_transfer import Transfer, _temporary, reserve


def _area(tmp_path: Path) -> tuple[Path, Path]:
    top = tmp_path / "tier"
    (top / "replicas").mkdir(parents=True, mode=0o700)
    (top / "spare").mkdir(mode=0o700)
    return top, top / "replicas"


def _receive(into: Path, t: Transfer, data: bytes) -> os.stat_result:
    """Receives `data` as the link would (into the temporary's mapping); the temporary's status."""
    with _temporary(into, t):
        assert t.buf is not None and t.temporary is not None
        t.buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        st = os.lstat(t.temporary)
    return st


def test_a_spare_file_is_taken_over_in_place(tmp_path):
    top, into = _area(tmp_path)
    donor = top / "spare" / "w.bin"
    donor.write_bytes(b"old" * 100)
    inode = donor.stat().st_ino
    st = _receive(into, Transfer(0, "w.bin", 6, donor=donor), b"newbie")
    assert st.st_ino == inode and st.st_size == 6
    assert not donor.exists() and not os.listdir(into)  # not renamed into place: removed on the way out


def test_a_donor_that_became_a_link_is_not_followed(tmp_path):
    top, into = _area(tmp_path)
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"precious")
    donor = top / "spare" / "w.bin"
    donor.symlink_to(outside)
    st = _receive(into, Transfer(0, "w.bin", 6, donor=donor), b"newbie")
    assert st.st_ino != outside.stat().st_ino and os.path.isfile(outside)
    assert outside.read_bytes() == b"precious" and not os.path.lexists(donor)


def test_a_donor_that_became_a_fifo_is_not_waited_on(tmp_path):
    top, into = _area(tmp_path)
    donor = top / "spare" / "w.bin"
    os.mkfifo(donor)
    st = _receive(into, Transfer(0, "w.bin", 6, donor=donor), b"newbie")  # returns: no reader waited for
    assert st.st_size == 6 and not os.path.lexists(donor)


def test_a_donor_with_a_second_name_is_not_overwritten(tmp_path):
    top, into = _area(tmp_path)
    other = tmp_path / "other-name.bin"
    other.write_bytes(b"precious")
    donor = top / "spare" / "w.bin"
    os.link(other, donor)
    _receive(into, Transfer(0, "w.bin", 6, donor=donor), b"newbie")
    assert other.read_bytes() == b"precious"


def test_a_receive_into_a_tier_without_room_fails_before_a_byte_moves_naming_the_file(small_tmpfs):
    """A tier out of room (here a 4 MiB tmpfs, 8 MiB to receive) fails where the temporary is made, with
    ENOSPC naming it, and leaves nothing: a copy into a mapping with no page behind it would be a SIGBUS
    that kills the rank in the middle of a transfer."""
    top = small_tmpfs / "tier"
    (top / "replicas").mkdir(parents=True, mode=0o700)
    t = Transfer(0, "model/w.bin", 8 << 20)
    with pytest.raises(OSError, match=r"model/\.w\.bin\.dstmp") as e, contextlib.ExitStack() as stack:
        stack.enter_context(_temporary(top / "replicas", t))
        reserve([t])
    assert e.value.errno == errno.ENOSPC
    assert not any(f.is_file() for f in top.rglob("*")) and t.buf is None


@pytest.mark.parametrize("corrupt", [False, True])
def test_a_received_file_is_placed_only_where_every_byte_matches_its_entry(tmp_path, corrupt):
    top, into = _area(tmp_path)
    src = tmp_path / "src.safetensors"
    with DataStatesEngine(DataStatesConfig(host_cache_size=4 / 1024, chunk_size=1)) as engine:
        handle = engine.save({"w": torch.arange(50_000, dtype=torch.float32)}, src)
        handle.wait_persisted()
        data = bytearray(src.read_bytes())
        entry = file_entry(len(data), handle)
        if corrupt:
            data[-5] ^= 0xFF  # a tensor byte, as a transfer gone wrong would leave it
        ts = [Transfer(0, "model/w.safetensors", len(data)), Transfer(0, "model/b.safetensors", len(data))]
        with contextlib.ExitStack() as stack:
            for t in ts:
                stack.enter_context(_temporary(into, t))
                assert t.buf is not None
                t.buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            if corrupt:
                with pytest.raises(ChecksumError, match="dstmp"):
                    check_and_place(engine, ts, lambda t: entry)
            else:
                check_and_place(engine, ts, lambda t: entry)
    placed = sorted(p.name for p in (into / "model").iterdir())
    assert placed == ([] if corrupt else ["b.safetensors", "w.safetensors"])
    if not corrupt:
        assert (into / "model" / "w.safetensors").read_bytes() == bytes(data)


def test_a_file_checked_as_it_lands_while_another_is_still_received_is_placed_with_it(tmp_path):
    """`Checks.landed` starts a file's check while the other file's bytes are still to come (as a link
    reports files received whole mid-transfer); `place` waits for both checks and places both, and a file
    damaged after its bytes landed but before its check fails by name."""
    from nanotron_datastates.tier.replica_check import Checks

    top, into = _area(tmp_path)
    src = tmp_path / "src.safetensors"
    with DataStatesEngine(DataStatesConfig(host_cache_size=4 / 1024, chunk_size=1)) as engine:
        handle = engine.save({"w": torch.arange(50_000, dtype=torch.float32)}, src)
        handle.wait_persisted()
        data = torch.frombuffer(bytearray(src.read_bytes()), dtype=torch.uint8)
        entry = file_entry(len(data), handle)
        ts = [Transfer(0, "model/a.safetensors", len(data)), Transfer(0, "model/b.safetensors", len(data))]
        with contextlib.ExitStack() as stack:
            for t in ts:
                stack.enter_context(_temporary(into, t))
            checks = stack.enter_context(Checks(engine, ts, lambda t: entry))
            assert ts[0].buf is not None and ts[1].buf is not None
            ts[0].buf.copy_(data)
            checks.landed(ts[0])
            checks.landed(ts[0])  # reported twice: checked once
            ts[1].buf.copy_(data)
            checks.place()
    assert sorted(p.name for p in (into / "model").iterdir()) == ["a.safetensors", "b.safetensors"]
    assert (into / "model" / "b.safetensors").read_bytes() == src.read_bytes()


def test_a_received_file_is_reported_whole_only_once_every_chunk_up_to_its_end_is_in():
    """The NCCL link's waves land out of order on its copying threads: one peer's files, laid end to end in
    chunks of 128 bytes, are reported (to be checked) only once every chunk up to each one's end is in its
    mapping; a chunk whose copy failed holds back every file from it on."""
    from concurrent.futures import Future

    from nanotron_datastates.tier.link_nccl import _Drained
    from nanotron_datastates.tier.replica_transfer import Landing

    sizes = [0, 100, 50, 0, 300, 10]
    files = [Transfer(1, f"f{i}", n) for i, n in enumerate(sizes)]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    got: list[str] = []
    ends = Landing([(a + t.nbytes, t) for t, a in zip(files, starts)], lambda t: got.append(t.rel))
    drained = _Drained([ends], 128)
    assert got == ["f0"]  # no bytes: whole at once
    waves = [[Future(), Future()] for _ in range(4)]  # 460 bytes: 4 chunks, each copied in 2 pieces
    for w, fs in enumerate(waves):
        drained.watch(w, fs)
    for f in waves[1]:
        f.set_result(None)
    assert got == ["f0"]  # the second chunk before the first: nothing more yet
    waves[0][0].set_result(None)
    assert got == ["f0"]
    waves[0][1].set_result(None)  # bytes [0, 256): f1 ends at 100, f2 at 150, f3 (empty) at 150
    assert got == ["f0", "f1", "f2", "f3"]
    waves[2][0].set_exception(OSError("copy failed"))
    waves[2][1].set_result(None)
    for f in waves[3]:
        f.set_result(None)
    assert got == ["f0", "f1", "f2", "f3"]  # f4 and f5 reach into the failed chunk: never reported


@pytest.mark.parametrize("corrupt", [None, 0, 5])
def test_a_file_checked_in_runs_at_once_checks_every_tensor(tmp_path, corrupt):
    """`verify(callers=3)` splits a file's tensors into runs read at once: every tensor is checked, the
    first and a later run's alike, and a damaged byte fails naming the file and the tensor."""
    from nanotron_datastates.errors import ChecksumError

    path = tmp_path / "w.safetensors"
    with DataStatesEngine(DataStatesConfig(host_cache_size=4 / 1024, chunk_size=1)) as engine:
        handle = engine.save({f"t{i}": torch.full((1000 + i,), float(i)) for i in range(7)}, path)
        handle.wait_persisted()
        sums = handle.checksums()
        if corrupt is not None:
            from nanotron_datastates.format import read_header

            entry = next(e for e in read_header(path).tensors if e.name.endswith(f"t{corrupt}"))
            with open(path, "r+b") as f:
                f.seek(read_header(path).data_start + entry.begin + 3)
                byte = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([byte[0] ^ 0x40]))
            with pytest.raises(ChecksumError, match=rf"w\.safetensors.*t{corrupt}"):
                engine.verify(path, sums, callers=3)
        else:
            assert engine.verify(path, sums, callers=3)
