"""Failures are clear Python exceptions naming the file; nothing is left at the final path; earlier files are
untouched; the engine keeps working."""

import errno
import os
import struct

import pytest
import torch

from nanotron_datastates import ChecksumError, DataStatesConfig, DataStatesEngine, FormatError

from helpers import BACKENDS, no_temporaries, same


@pytest.mark.parametrize("backend", BACKENDS)
def test_enospc_gives_oserror_and_leaves_nothing(small_tmpfs, backend):
    with DataStatesEngine(DataStatesConfig(host_cache_size=4 / 1024, chunk_size=1, io_backend=backend)) as e:
        good = small_tmpfs / "good.safetensors"
        e.save({"v": torch.arange(100)}, good).wait_persisted()
        before = good.read_bytes()

        h = e.save({"big": torch.randn(3 << 20)}, small_tmpfs / "big.safetensors")  # 12 MiB into 4 MiB
        with pytest.raises(OSError) as err:
            h.wait_persisted()
        assert err.value.errno == errno.ENOSPC
        assert err.value.filename == str(small_tmpfs / "big.safetensors")
        assert not (small_tmpfs / "big.safetensors").exists()
        assert no_temporaries(small_tmpfs)

        # Overwriting the good file with a save that fails keeps the good file.
        with pytest.raises(OSError):
            e.save({"big": torch.randn(3 << 20)}, good).wait_persisted()
        assert good.read_bytes() == before

        # Once there is room, the same engine saves again.
        e.save({"v": torch.ones(1000)}, small_tmpfs / "after.safetensors").wait_persisted()
        assert same(e.load(small_tmpfs / "after.safetensors")["v"], torch.ones(1000))


def _saved(engine, tmp_path):
    p = tmp_path / "c.safetensors"
    engine.save({"a": torch.randn(5000), "b": torch.randn(300, 7)}, p).wait_persisted()
    return p


def test_flipped_data_byte_names_the_tensor(engine, tmp_path):
    p = _saved(engine, tmp_path)
    h_len = struct.unpack("<Q", p.read_bytes()[:8])[0]
    with open(p, "r+b") as f:
        # "a" (20000 bytes) comes first in the data section; flip a byte in its middle.
        f.seek(8 + h_len + 10001)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(ChecksumError, match=r"tensor 'a' fails its checksum") as err:
        engine.load(p)
    assert str(p) in str(err.value)
    first = engine.load(p, verify=False)["a"].reshape(-1).view(torch.uint8)[:16]  # unverified: still read
    assert f"20000 bytes read beginning {bytes(first.tolist()).hex(' ')}" in str(err.value)  # as read


def test_flipped_header_byte_is_a_format_error(engine, tmp_path):
    p = _saved(engine, tmp_path)
    raw = bytearray(p.read_bytes())
    i = raw.index(b'"shape":[300,7]')
    raw[i + 10] = ord("8")
    p.write_bytes(bytes(raw))
    with pytest.raises(FormatError, match="cannot hold"):
        engine.load(p)


def test_truncated_file_is_a_format_error(engine, tmp_path):
    p = _saved(engine, tmp_path)
    with open(p, "r+b") as f:
        f.truncate(os.path.getsize(p) - 100)
    with pytest.raises(FormatError, match="truncated"):
        engine.load(p)
    with open(p, "r+b") as f:
        f.truncate(5)
    with pytest.raises(FormatError, match="too short"):
        engine.load(p)


def test_missing_file_is_file_not_found(engine, tmp_path):
    with pytest.raises(FileNotFoundError):
        engine.load(tmp_path / "nope.safetensors")


def test_type_errors_name_the_key_and_save_nothing(engine, tmp_path):
    with pytest.raises(TypeError, match="'opt.sched'"):
        engine.save({"opt": {"sched": object()}}, tmp_path / "x.safetensors")
    engine.wait_persisted()
    assert not os.listdir(tmp_path)
