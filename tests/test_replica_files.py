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
from nanotron_datastates.tier.replica_reserve import reserving, room
from nanotron_datastates.tier.replica_transfer import Transfer, _temporary


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


def test_a_receive_into_a_tier_without_room_fails_before_a_byte_moves_naming_the_folder(small_tmpfs):
    """A tier out of room (here a 4 MiB tmpfs, 8 MiB to receive) fails before the ranks agree to go, with
    ENOSPC naming the folder, and leaves nothing: a copy into a mapping with no page behind it would be a
    SIGBUS that kills the rank in the middle of a transfer."""
    top = small_tmpfs / "tier"
    (top / "replicas").mkdir(parents=True, mode=0o700)
    t = Transfer(0, "model/w.bin", 8 << 20)
    with (
        pytest.raises(OSError, match=r"replica files to receive.*tier/replicas") as e,
        contextlib.ExitStack() as s,
    ):
        s.enter_context(_temporary(top / "replicas", t))
        room([t], top / "replicas")
    assert e.value.errno == errno.ENOSPC
    assert not any(f.is_file() for f in top.rglob("*")) and t.buf is None


def test_the_room_is_asked_of_the_temporaries_not_of_a_folder_swapped_for_a_link(small_tmpfs, tmp_path):
    """A neighbour swaps the tier folder for a link to a roomy file system once the temporaries are made:
    the room is still that of the file system the temporaries are on (8 MiB into a 4 MiB tmpfs: ENOSPC)."""
    top = small_tmpfs / "tier"
    (top / "replicas").mkdir(parents=True, mode=0o700)
    t = Transfer(0, "w.bin", 8 << 20)
    roomy = tmp_path / "roomy"
    roomy.mkdir()
    with pytest.raises(OSError, match="replica files to receive") as e, contextlib.ExitStack() as s:
        s.enter_context(_temporary(top / "replicas", t))
        (top / "replicas").rename(top / "moved")
        (top / "replicas").symlink_to(roomy)
        room([t], top / "replicas")
    assert e.value.errno == errno.ENOSPC


def test_a_file_whose_memory_runs_out_mid_transfer_is_dropped_and_named_never_a_sigbus(small_tmpfs):
    """The room taken by another process after the check: the reservation beside the transfer fails on the
    second file (1 + 8 MiB into a 4 MiB tmpfs). A link writes a range only once it is reserved: the first
    file lands whole and passes its check; the second's bytes are dropped (a write would be a SIGBUS), its
    check fails with ENOSPC naming its temporary, and neither is placed then."""
    from nanotron_datastates.tier.replica_check import Checks

    top = small_tmpfs / "tier"
    (top / "replicas").mkdir(parents=True, mode=0o700)
    data = torch.arange(8 << 20, dtype=torch.int64).to(torch.uint8)
    with DataStatesEngine(DataStatesConfig(host_cache_size=4 / 1024, chunk_size=1)) as engine:
        handle = engine.save({"w": torch.ones(1 << 18)}, small_tmpfs / "a.safetensors")  # 1 MiB of tensor
        handle.wait_persisted()
        first = torch.frombuffer(bytearray((small_tmpfs / "a.safetensors").read_bytes()), dtype=torch.uint8)
        entry = file_entry(len(first), handle)
        (small_tmpfs / "a.safetensors").unlink()
        ts = [Transfer(0, "a.safetensors", len(first)), Transfer(0, "b.bin", 8 << 20)]
        with contextlib.ExitStack() as stack:
            for t in ts:
                stack.enter_context(_temporary(top / "replicas", t))
            stack.enter_context(reserving(ts))
            checks = stack.enter_context(Checks(engine, ts, lambda t: entry))
            written = []
            for t, src in zip(ts, (first, data)):  # as a link does: range by range, each once writable
                assert t.buf is not None
                for a in range(0, t.nbytes, 1 << 20):
                    b = min(t.nbytes, a + (1 << 20))
                    if t.writable(b):
                        t.buf[a:b].copy_(src[a:b])
                        written.append((t.rel, a >> 20))
            assert written[:2] == [("a.safetensors", 0), ("a.safetensors", 1)]
            assert written[2:] == [("b.bin", a) for a in range(len(written) - 2)]
            assert len(written) < 6  # b.bin stopped short of its 8 MiB: no SIGBUS
            checks.landed(ts[0])
            with pytest.raises(OSError, match=r"reserving the memory.*\.b\.bin\.dstmp") as e:
                checks.place()
            assert e.value.errno == errno.ENOSPC
    assert not any(f.is_file() for f in top.rglob("*"))


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


def _move_into(rank: int, init: str, into: str, out: str) -> None:
    """Rank 0 sends 1 + 8 MiB over gloo; rank 1 receives them into `into` (a 4 MiB tmpfs), its reservation
    beside the move and no room checked first (as where another process took the room after the check)."""
    import json

    import torch.distributed as dist

    from nanotron_datastates.tier.replica_transfer import move

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    sizes = {"a.bin": 1 << 20, "b.bin": 8 << 20}
    data = {rel: torch.full((n,), 7 + i, dtype=torch.uint8) for i, (rel, n) in enumerate(sizes.items())}
    got: dict = {}
    with contextlib.ExitStack() as stack:
        if rank == 0:
            sends = [Transfer(1, rel, n, buf=data[rel]) for rel, n in sizes.items()]
            move([dist.group.WORLD], sends, [], chunk=1 << 20)
        else:
            recvs = [Transfer(0, rel, n) for rel, n in sizes.items()]
            for t in recvs:
                stack.enter_context(_temporary(Path(into), t))
            stack.enter_context(reserving(recvs))
            move([dist.group.WORLD], [], recvs, chunk=1 << 20)
            a, b = recvs
            assert a.buf is not None and b.reservation is not None
            got = {"a": bool(torch.equal(a.buf, data["a.bin"])), "b": b.reservation.error.errno}
    dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(got))


def test_a_gloo_move_drops_what_cannot_be_reserved_and_both_ranks_finish(small_tmpfs, tmp_path):
    """Over a real gloo pair: the receiver's second file cannot be reserved mid-move; its bytes are received
    and dropped (no SIGBUS, and the sender is not left waiting), the first file lands whole, and the second's
    reservation holds ENOSPC for its check to name."""
    import json
    import multiprocessing as mp

    into = small_tmpfs / "tier" / "replicas"
    into.mkdir(parents=True, mode=0o700)
    ctx = mp.get_context("spawn")
    init = f"file://{tmp_path}/rendezvous"
    procs = [ctx.Process(target=_move_into, args=(r, init, str(into), str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
        assert p.exitcode == 0, f"a rank of the move exited with {p.exitcode}"
    assert json.loads((tmp_path / "rank1.json").read_text()) == {"a": True, "b": errno.ENOSPC}


@pytest.mark.parametrize("corrupt", [None, "t1", "t14"])
def test_a_large_file_is_checked_in_runs_as_its_bytes_arrive(tmp_path, monkeypatch, corrupt):
    """A large received file (here over 2 runs of 64 KiB) has its runs of tensors checked as their bytes
    arrive, before the file has landed; a byte damaged on the way, in an early tensor or a late one, fails
    the check naming the file and the tensor, and nothing is placed; an intact file is placed whole."""
    from nanotron_datastates.tier import replica_check
    from nanotron_datastates.tier.replica_check import Checks

    monkeypatch.setattr(replica_check, "RUN", 64 << 10)
    top, into = _area(tmp_path)
    src = tmp_path / "src.safetensors"
    with DataStatesEngine(DataStatesConfig(host_cache_size=4 / 1024, chunk_size=1)) as engine:
        handle = engine.save({f"t{i}": torch.full((8192,), float(i)) for i in range(16)}, src)  # 32 KiB each
        handle.wait_persisted()
        data = torch.frombuffer(bytearray(src.read_bytes()), dtype=torch.uint8)
        entry = file_entry(len(data), handle)
        if corrupt is not None:
            from nanotron_datastates.format import read_header

            header = read_header(src)
            e = next(e for e in header.tensors if e.name.endswith(corrupt))
            data[header.data_start + e.begin + 7] ^= 0x10
        t = Transfer(0, "model/w.safetensors", len(data))
        with contextlib.ExitStack() as stack:
            stack.enter_context(_temporary(into, t))
            checks = stack.enter_context(Checks(engine, [t], lambda t: entry))
            assert t.buf is not None
            step = len(data) // 8 + 1
            for a in range(0, len(data), step):
                t.buf[a : a + step].copy_(data[a : a + step])
                checks.arrived(t, min(len(data), a + step))
            started = len(checks._arriving[id(t)].runs)
            assert 0 < started < len(checks._arriving[id(t)].check.runs) + 1
            checks.landed(t)
            if corrupt is None:
                checks.place()
            else:
                with pytest.raises(ChecksumError, match=rf"dstmp.*{corrupt}"):
                    checks.place()
    placed = sorted(p.name for p in (into / "model").iterdir())
    assert placed == (["w.safetensors"] if corrupt is None else [])


def test_files_laid_end_to_end_are_reported_arriving_then_landed_in_order():
    from nanotron_datastates.tier.replica_transfer import Landing

    files = [Transfer(1, f"f{i}", n) for i, n in enumerate([100, 300, 50])]
    got: list[tuple] = []
    ends = Landing(
        [(100, files[0]), (400, files[1]), (450, files[2])],
        lambda t: got.append((t.rel,)),
        lambda t, n: got.append((t.rel, n)),
    )
    ends.upto(64)
    ends.upto(250)
    ends.upto(450)
    assert got == [("f0", 64), ("f0",), ("f1", 150), ("f1",), ("f2",)]


def test_the_reservation_says_when_it_finished_and_how_long_the_copies_waited(shm_dir):
    """What the restart's log reports of the reservation beside the transfer: each file's time fully reserved
    (none for a file whose reservation failed), and the copies' waits."""
    import time

    from nanotron_datastates.tier.replica_reserve import reserved_within

    (shm_dir / "replicas").mkdir(mode=0o700)
    ts = [Transfer(0, "a.bin", 3 << 20), Transfer(0, "b.bin", 200 << 20)]
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:
        for t in ts:
            stack.enter_context(_temporary(shm_dir / "replicas", t))
        stack.enter_context(reserving(ts))
        assert all(t.writable(t.nbytes) for t in ts)
        after, waited = reserved_within(ts, t0)
    assert all(t.reservation is not None and t.reservation.done_at is not None for t in ts)
    assert 0 < after < time.monotonic() - t0 and waited >= 0
