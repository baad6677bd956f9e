"""The package as users get it: a wheel built by pip (scikit-build-core + nanobind) with the private extension
and its generated stub, installed into a fresh virtual environment and used from outside the source tree."""

import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
STUB = ROOT / "nanotron_datastates" / "_core.pyi"  # what mypy checks the package against


def test_the_core_stub_in_the_tree_is_the_one_the_build_generates():
    """The build generates the extension's stub from its binding (nanobind's stubgen) and installs it beside
    the extension; the tree keeps a copy for mypy and the wheel. A binding changed without its stub fails
    here."""
    spec = importlib.util.find_spec("nanotron_datastates._core")
    assert spec is not None and spec.origin is not None
    built = Path(spec.origin).with_name("_core.pyi")
    assert built.exists(), f"{built}: the build installs the stub beside the extension"
    assert STUB.read_text() == built.read_text(), f"the binding changed: cp {built} {STUB.relative_to(ROOT)}"


def run_py(py: str, code: str, **env: str) -> str:
    r = subprocess.run([py, "-c", code], capture_output=True, text=True, env={**os.environ, **env})
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def make_venv(where: Path, with_torch: bool = True) -> str:
    """A fresh virtual environment whose python finds this torch (a .pth line naming the directory it is
    installed in, which does not run that directory's .pth hooks), or nothing beyond the standard library
    (`with_torch=False`); returns its python."""
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True)
    py = str(where / "bin" / "python")
    if with_torch:
        Path(venv_site(py), "host_torch.pth").write_text(str(Path(torch.__file__).parents[1]) + "\n")
    return py


def venv_site(py: str) -> str:
    """The site-packages folder of the virtual environment of `py`."""
    return run_py(py, "import sysconfig; print(sysconfig.get_paths()['purelib'])")


@pytest.mark.slow
def test_wheel_installs_and_works_outside_the_tree(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (wheel,) = wheels.glob("nanotron_datastates-*.whl")
    zf = zipfile.ZipFile(wheel)
    names = zf.namelist()
    (so,) = [n for n in names if n.startswith("nanotron_datastates/_core") and n.endswith(".so")]
    assert "nanotron_datastates/_core.pyi" in names and "nanotron_datastates/engine.py" in names
    assert "nanotron_datastates/py.typed" in names  # type checkers read the package's hints and the stub
    assert zf.read("nanotron_datastates/_core.pyi").decode() == STUB.read_text()
    # One build serves every torch and every machine: no torch, CUDA or Python library among its dependencies.
    needed = subprocess.run(
        ["readelf", "-d", zf.extract(so, tmp_path)], capture_output=True, text=True
    ).stdout
    libs = [line.split("[")[1].rstrip("]") for line in needed.splitlines() if "(NEEDED)" in line]
    assert libs and not [lib for lib in libs if any(k in lib for k in ("torch", "c10", "cuda", "python"))], (
        libs
    )

    # A venv of its own, so that a development (editable) install cannot shadow the wheel; beside it, the same
    # venv without the wheel.
    py, bare = make_venv(tmp_path / "venv"), make_venv(tmp_path / "bare")
    subprocess.run(
        [py, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", str(wheel)], check=True
    )
    # The post-import hook runs at every Python start: it must cost next to nothing, that is import nothing a
    # start without it does not (no torch, not even typing): the modules loaded are compared, not timed.
    loaded = "import sys; print(' '.join(sorted(sys.modules)))"
    added = set(run_py(py, loaded).split()) - set(run_py(bare, loaded).split())
    assert added == {"nanotron_datastates", "nanotron_datastates._autoload", "__future__"}, added
    probe = "import sys; print(sorted(m for m in ('torch', 'nanotron_datastates') if m in sys.modules))"
    assert run_py(py, probe) == "['nanotron_datastates']"  # the hook's finder, registered; nothing else
    assert run_py(py, probe, NANOTRON_DATASTATES_AUTOLOAD="0") == "[]"  # turned off before any import
    script = (
        "import torch, nanotron_datastates as n; from nanotron_datastates import DataStatesEngine;"
        "assert 'site-packages' in n.__file__, n.__file__;"
        "e = DataStatesEngine(host_cache_size=0.01); x = torch.randn(1000);"
        "e.save({'x': x}, 'w.safetensors').wait_persisted();"
        "assert torch.equal(e.load('w.safetensors')['x'], x); e.close(); print('ok')"
    )
    r = subprocess.run([py, "-c", script], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_a_hook_left_without_its_package_says_how_to_mend_it_and_python_still_starts(tmp_path):
    """The post-import hook's .pth left behind where the package no longer imports (an editable install whose
    checkout was removed, a half-uninstalled one): every Python start still succeeds, and its one line
    names the package, the error and what to do."""
    py = make_venv(tmp_path / "venv", with_torch=False)  # where no copy of the package can be found
    Path(venv_site(py), "nanotron_datastates.pth").write_text((ROOT / "nanotron_datastates.pth").read_text())
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "NANOTRON_DATASTATES_AUTOLOAD")}
    r = subprocess.run([py, "-c", "print('started')"], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "started", r.stderr
    # One line a site folder (a venv may list its folder twice, as lib and lib64)
    (line,) = set(r.stderr.splitlines())
    assert line.startswith("nanotron_datastates: Nanotron hook not installed (ModuleNotFoundError(")
    assert "pip uninstall nanotron-datastates" in line and "NANOTRON_DATASTATES_AUTOLOAD=0" in line
    quiet = subprocess.run(
        [py, "-c", "pass"],
        capture_output=True,
        text=True,
        env={**env, "NANOTRON_DATASTATES_AUTOLOAD": "0"},
    )
    assert quiet.returncode == 0 and quiet.stderr == ""
