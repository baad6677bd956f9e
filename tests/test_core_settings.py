"""The core takes every setting from Python: its binding defaults none, and `core_setup.start_core` passes
each one from DataStatesConfig, so the C++ defaults can never stand in for Python's at run time."""

import ast
import re
from pathlib import Path

import pytest

from nanotron_datastates import DataStatesConfig, _core, core_setup


def binding_parameters() -> dict[str, str]:
    """The core Engine's parameters, each with its default text ('' for none), from its signature."""
    signature = _core.Engine.__init__.__doc__.splitlines()[0]
    inside = signature[signature.index("(") + 1 : signature.rindex(")")]
    out = {}
    for part in inside.split(", ")[1:]:  # past self
        name, _, rest = part.partition(":")
        out[name.strip()] = rest.partition("=")[2].strip()
    return out


def start_core_keywords() -> set[str]:
    tree = ast.parse(Path(core_setup.__file__).read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func) == "_core.Engine"]
    assert len(calls) == 1, "one place starts the core"
    return {k.arg for k in calls[0].keywords if k.arg is not None}


def test_the_binding_defaults_no_setting_and_start_core_passes_every_one():
    params = binding_parameters()
    assert len(params) >= 19
    assert {n: d for n, d in params.items() if d} == {}
    assert start_core_keywords() == set(params)


def test_a_missing_setting_is_refused_naming_none_taken_silently():
    with pytest.raises(TypeError, match=re.escape("__init__")):
        _core.Engine(cache_bytes=1 << 20, chunk_bytes=1 << 20)  # the rest left out
    config = DataStatesConfig(host_cache_size=1 / 1024, chunk_size=1)
    core = core_setup.start_core(config)  # every setting given: it starts
    core.close()
