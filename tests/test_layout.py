"""The house rules of the tree that no linter checks: docs/ARCHITECTURE.md's map names every module of the
package and every file of the core, and no file outgrows its size rule (350 lines a Python module, 400 a
C++ file: one that grows is split by job)."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE, EXT = ROOT / "nanotron_datastates", ROOT / "ext"
TREE = (ROOT / "docs" / "ARCHITECTURE.md").read_text().split("```")[1]  # the map: the first block
PY = sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py")
CPP = sorted(p for p in EXT.iterdir() if p.suffix in (".cpp", ".hpp"))


def _named(path: Path) -> bool:
    """`path`'s name in the map, as itself or as its stem with any suffix (`engine.*`)."""
    words = {w.strip("(),:;`") for w in TREE.split()}
    return path.name in words or f"{path.stem}.*" in words


@pytest.mark.parametrize("path", PY + CPP, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_architecture_map_names_the_file(path):
    assert _named(path), f"docs/ARCHITECTURE.md's tree does not name {path.relative_to(ROOT)}"


@pytest.mark.parametrize("path", PY + CPP, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_file_keeps_its_size_rule(path):
    limit = 350 if path.suffix == ".py" else 400
    lines = len(path.read_text().splitlines())
    assert lines <= limit, f"{path.relative_to(ROOT)}: {lines} lines, over {limit}: split it by job"
