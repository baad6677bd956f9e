"""The C++ core built with AddressSanitizer (leaks included) and ThreadSanitizer runs its stress test
(tests/cpp/stress.cpp): concurrent saves through a tiny cache on both backends, failures, close() in
flight."""

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
