"""The C++ core built with AddressSanitizer (leaks included) and ThreadSanitizer runs its stress test
(tests/cpp/stress.cpp): concurrent saves through a tiny cache on both backends, failures, close() in
flight. Built without liburing, the core runs the same test on its pwrite backend alone, and says so at
build time."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize("sanitizer", ["address", "thread"])
def test_stress_under_sanitizer(tmp_path, sanitizer):
    if not shutil.which("cmake") or not shutil.which("c++"):
        pytest.skip("needs cmake and a C++ compiler")
    build = tmp_path / "build"
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run(
        ["cmake", "-S", str(ROOT), "-B", str(build), *gen, f"-DDATASTATES_SANITIZE={sanitizer}"],
        check=True,
        capture_output=True,
    )
    subprocess.run(
        ["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2)], check=True, capture_output=True
    )
    env = dict(os.environ, TSAN_OPTIONS="halt_on_error=1", ASAN_OPTIONS="detect_leaks=1:abort_on_error=1")
    r = subprocess.run(
        [str(build / "ds_stress"), str(tmp_path / "data"), "2"], capture_output=True, text=True, env=env
    )
    assert r.returncode == 0, r.stdout + r.stderr[-20000:]
    assert "all checks passed" in r.stdout
    assert "Sanitizer" not in r.stderr


@pytest.mark.slow
def test_the_core_builds_without_liburing_says_so_and_runs_on_pwrite(tmp_path):
    if not shutil.which("cmake") or not shutil.which("c++"):
        pytest.skip("needs cmake and a C++ compiler")
    build = tmp_path / "build"
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    flags = ["-DDATASTATES_IO_URING=OFF", "-DDATASTATES_BUILD_MODULE=OFF", "-DDATASTATES_BUILD_STRESS=ON"]
    configure = subprocess.run(
        ["cmake", "-S", str(ROOT), "-B", str(build), *gen, *flags], check=True, capture_output=True, text=True
    )
    assert "building without io_uring" in configure.stderr, configure.stderr
    subprocess.run(
        ["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2)], check=True, capture_output=True
    )
    r = subprocess.run(
        [str(build / "ds_stress"), str(tmp_path / "data"), "1"], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr[-20000:]
    assert "on pwrite (built without io_uring): all checks passed" in r.stdout
    assert "no io_uring: it was built with DATASTATES_IO_URING=OFF" in r.stdout  # not "headers missing"
    symbols = subprocess.run(["nm", "-C", str(build / "ds_stress")], capture_output=True, text=True).stdout
    assert "io_uring_queue_init" not in symbols
