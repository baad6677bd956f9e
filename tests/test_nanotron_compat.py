"""A missing or broken Nanotron gives a clear ImportError saying what to install. The broken case is real:
a package whose modules import each other circularly, as PyPI's nanotron 0.4 wheel does."""

import subprocess
import sys
import textwrap


def _run(code, path):
    env_path = f"{path}"
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": env_path, "NANOTRON_DATASTATES_AUTOLOAD": "0", "PATH": "/usr/bin:/bin"},
    )


PROBE = textwrap.dedent(
    """
    from nanotron_datastates.nanotron import compat
    try:
        compat.check()
    except compat.NanotronUnavailable as e:
        print("UNAVAILABLE:", e)
    """
)


def test_broken_circular_import_is_named(tmp_path):
    pkg = tmp_path / "nanotron"
    (pkg / "config").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "logging.py").write_text("from nanotron.config import LoggingArgs\n")
    (pkg / "config" / "__init__.py").write_text("from nanotron.config.config import *\n")
    (pkg / "config" / "config.py").write_text(
        "from nanotron.logging import get_logger\nclass LoggingArgs: pass\n"
    )
    r = _run(PROBE, f"{tmp_path}:{':'.join(p for p in sys.path if p)}")
    assert "UNAVAILABLE:" in r.stdout, r.stdout + r.stderr
    assert "nanotron 0.4 wheel is broken" in r.stdout and "install Nanotron from source" in r.stdout


def test_missing_nanotron_is_named(tmp_path):
    r = _run(PROBE + "\n", ":".join(p for p in sys.path if p and "nanotron/src" not in p))
    assert "UNAVAILABLE: cannot import nanotron" in r.stdout, r.stdout + r.stderr


def test_a_module_nanotron_imports_is_named_with_what_provides_it(tmp_path):
    """Nanotron main imports CUDA builds and packages its pyproject does not declare: the message names the
    missing module and where it comes from, not Nanotron's install."""
    pkg = tmp_path / "nanotron"
    (pkg / "config").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "config" / "__init__.py").write_text("")
    (pkg / "config" / "config.py").write_text("import grouped_gemm\n")
    r = _run(PROBE, f"{tmp_path}:{':'.join(p for p in sys.path if p)}")
    assert "UNAVAILABLE: cannot import nanotron.config.config: Nanotron imports 'grouped_gemm'" in r.stdout, (
        r.stdout + r.stderr
    )
    assert "a CUDA build" in r.stdout and "install Nanotron from source" not in r.stdout
