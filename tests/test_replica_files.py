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
from nanotron_datastates.tier.replica_transfer import Transfer, _temporary, check_and_place, reserve


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
