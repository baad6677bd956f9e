"""Where io_uring is refused (containers' seccomp profiles), the engine falls back to a pwrite thread pool
with one logged warning. Proven for real: a child process installs a seccomp filter that makes io_uring_setup
fail with EPERM, as Docker's default profile does, then saves and loads."""

import subprocess
import sys
import textwrap

import torch

from nanotron_datastates import DataStatesEngine

from helpers import same, small_config

CHILD = textwrap.dedent(
    r"""
    import ctypes, logging, struct, sys
    libc = ctypes.CDLL(None, use_errno=True)
    # BPF: load the syscall number; io_uring_setup (425 on x86-64) -> ERRNO(EPERM); everything else allowed.
    prog = [(0x20, 0, 0, 0), (0x15, 0, 1, 425), (0x06, 0, 0, 0x00050000 | 1), (0x06, 0, 0, 0x7FFF0000)]
    buf = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *i) for i in prog))
    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    fprog = Fprog(len(prog), ctypes.addressof(buf))
    assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
    assert libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) == 0, ctypes.get_errno()  # PR_SET_SECCOMP, FILTER

    records = []
    class Keep(logging.Handler):
        def emit(self, r):
            records.append(r.getMessage())
    logging.getLogger("nanotron_datastates").addHandler(Keep())

    import torch
    from nanotron_datastates import DataStatesConfig, DataStatesEngine
    cfg = DataStatesConfig(host_cache_size=4 / 1024, chunk_size=1)
    x = torch.randn(3 << 20)
    for i in range(2):
        with DataStatesEngine(cfg) as e:
            assert e.io_backend == "pwrite", e.io_backend
            e.save({"x": x}, sys.argv[1]).wait_persisted()
            assert torch.equal(e.load(sys.argv[1])["x"], x)
    warnings = [m for m in records if "io_uring is refused" in m]
    assert len(warnings) == 1, records
    try:
        DataStatesEngine(cfg, io_backend="io_uring")
    except ValueError as e:
        assert "io_uring" in str(e)
    else:
        raise AssertionError("io_backend='io_uring' should be refused")
    print("fallback ok:", warnings[0])
    """
)


def test_seccomp_refusal_falls_back_to_pwrite_with_one_warning(tmp_path):
    r = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "f.safetensors")], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "fallback ok" in r.stdout and "Operation not permitted" in r.stdout


def test_both_backends_write_identical_files(tmp_path):
    state = {"a": torch.randn(1 << 20), "b": torch.arange(1000, dtype=torch.int16)}
    blobs = []
    for backend in ("io_uring", "pwrite"):
        with DataStatesEngine(small_config(io_backend=backend)) as e:
            assert e.io_backend == backend
            e.save(state, tmp_path / f"{backend}.safetensors").wait_persisted()
            assert all(same(v, state[k]) for k, v in e.load(tmp_path / f"{backend}.safetensors").items())
        blobs.append((tmp_path / f"{backend}.safetensors").read_bytes())
    assert blobs[0] == blobs[1]


def test_direct_and_buffered_writes_give_identical_files(tmp_path):
    state = {"x": torch.randn(300_001), "y": torch.arange(77, dtype=torch.int8)}  # unaligned tail
    blobs = []
    for direct in (True, False):
        with DataStatesEngine(small_config(direct_io=direct)) as e:
            h = e.save(state, tmp_path / f"{direct}.safetensors")
            h.wait_persisted()
            assert h.stats["direct_io"] is direct
        blobs.append((tmp_path / f"{direct}.safetensors").read_bytes())
    assert blobs[0] == blobs[1] and len(blobs[0]) == 4096 + 300_001 * 4 + 77
