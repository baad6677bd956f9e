"""The GPU benchmark times the package's own functions by wrapping them where they live
(benchmarks/_bench_phase.py): each name it wraps, and each module it reads it from, must exist, or a run on
the GPU fails at its start. Checked here, without a GPU, from the benchmark's source, with the Nanotron tree
the adapter's tests run against."""

import ast
import importlib
from pathlib import Path

PHASE = Path(__file__).resolve().parents[2] / "benchmarks" / "_bench_phase.py"


def imported_names(tree: ast.AST) -> dict[str, str]:
    """Each name the benchmark imports from the package: its dotted path."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("nanotron_datastates"):
            for alias in node.names:
                out[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return out


def wrapped(tree: ast.AST) -> list[str]:
    """`X.y` of every `X.y = adds_to(...)` or `X.y = timed(...)` assignment."""
    out = []
    for node in ast.walk(tree):
        call = isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
        if call and ast.unparse(node.value.func) in ("adds_to", "timed"):
            out += [ast.unparse(t) for t in node.targets if isinstance(t, ast.Attribute)]
    return out


def resolve(dotted: str) -> object:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def test_every_function_the_benchmark_wraps_exists_where_it_looks_for_it():
    tree = ast.parse(PHASE.read_text())
    names = imported_names(tree)
    targets = wrapped(tree)
    assert len(targets) >= 6
    checked = 0
    for target in targets:
        head, _, attr = target.partition(".")
        if head not in names:  # a local object (the core's wrapper), not the package's
            continue
        resolve(f"{names[head]}.{attr}")
        checked += 1
    assert checked >= 5
