"""The core takes every setting from Python in one object: `_core.EngineOptions` defaults none of them, and
`core_setup.core_options` fills each one from DataStatesConfig, so the C++ defaults can never stand in for
Python's at run time; the engine keeps the object it was started with, field for field."""

import ast
import os
import re
from pathlib import Path

import pytest

from nanotron_datastates import DataStatesConfig, DataStatesEngine, _core, core_setup


def binding_parameters() -> dict[str, str]:
    """EngineOptions' parameters, each with its default text ('' for none), from its signature."""
    signature = _core.EngineOptions.__init__.__doc__.splitlines()[0]
    inside = signature[signature.index("(") + 1 : signature.rindex(")")]
    out = {}
    for part in inside.split(", ")[1:]:  # past self
        name, _, rest = part.partition(":")
        out[name.strip()] = rest.partition("=")[2].strip()
    return out


def core_options_keywords() -> set[str]:
    tree = ast.parse(Path(core_setup.__file__).read_text())
    calls = [
        n for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func) == "_core.EngineOptions"
    ]
    assert len(calls) == 1, "one place builds the core's settings"
    engines = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func) == "_core.Engine"]
    assert len(engines) == 1, "one place starts the core"
    return {k.arg for k in calls[0].keywords if k.arg is not None}


def test_the_options_default_no_setting_and_core_options_passes_every_one():
    params = binding_parameters()
    assert len(params) >= 20
    assert {n: d for n, d in params.items() if d} == {}
    assert core_options_keywords() == set(params)


def test_a_missing_setting_is_refused_naming_none_taken_silently():
    with pytest.raises(TypeError, match=re.escape("__init__")):
        _core.EngineOptions(cache_bytes=1 << 20, chunk_bytes=1 << 20)  # the rest left out
    with pytest.raises(TypeError):
        _core.Engine(cache_bytes=1 << 20)  # settings come in one object only


def test_the_engine_runs_with_the_very_settings_of_its_config():
    config = DataStatesConfig(
        host_cache_size=1 / 64, chunk_size=2, parser_threads=3, flush_depth=5, queue_depth=7, read_size=3,
        direct_io=False, read_direct_io=True, fsync=False, checksums=False, map_memory_files=False,
        io_backend="pwrite", flush_nice=0, device_copy_size=1, device_copy_gbps=2.5, copy_threads=2,
        checksum_threads=3,
    )  # fmt: skip
    with DataStatesEngine(config) as engine:
        got = engine._core.options
        want = core_setup.core_options(config, pin_device=-1)
        for name in binding_parameters():
            assert getattr(got, name) == getattr(want, name), name
        assert (got.cache_bytes, got.chunk_bytes, got.read_bytes) == (1 << 24, 2 << 20, 3 << 20)
        assert (got.parser_threads, got.flush_depth, got.queue_depth) == (3, 5, 7)
        assert (got.direct_io, got.read_direct_io, got.fsync, got.checksums) == (False, True, False, False)
        assert (got.io_backend, got.copy_threads, got.host_copy_threads) == ("pwrite", 2, 2)
        assert got.device_copy_bytes_per_s == 2.5e9 and not got.map_memory_files
        assert got.checksum_threads == 3


def test_checksum_threads_0_runs_a_quarter_of_the_ranks_share_from_1_to_4():
    from nanotron_datastates.engine_settings import auto_checksum_threads

    assert auto_checksum_threads(cpus=16, local_ranks=1) == 4  # one GPU's host
    assert auto_checksum_threads(cpus=128, local_ranks=8) == 4
    assert auto_checksum_threads(cpus=64, local_ranks=8) == 2
    assert auto_checksum_threads(cpus=2, local_ranks=1) == 1  # never none
    with DataStatesEngine(DataStatesConfig(host_cache_size=1 / 64, chunk_size=2)) as engine:
        assert engine._core.options.checksum_threads == auto_checksum_threads()


def test_parser_threads_0_runs_one_per_cpu_of_the_ranks_share_from_4_to_16(monkeypatch):
    from nanotron_datastates.engine_settings import auto_parser_threads

    assert auto_parser_threads(cpus=32, local_ranks=1) == 16  # a node of one rank: capped
    assert auto_parser_threads(cpus=64, local_ranks=8) == 8  # its share
    assert auto_parser_threads(cpus=2, local_ranks=1) == 4  # a small machine: as many as a disk wants
    assert auto_parser_threads(cpus=128, local_ranks=0) == 16
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "not a number")  # taken as one rank
    mine = len(os.sched_getaffinity(0))
    assert auto_parser_threads() == max(4, min(16, mine))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "64")
    assert auto_parser_threads(cpus=128) == 4
    with DataStatesEngine(DataStatesConfig(host_cache_size=1 / 64, chunk_size=2)) as engine:
        assert engine.config.parser_threads == 0  # automatic, as written
        assert (
            engine._core.options.parser_threads == auto_parser_threads() == engine.config.parser_thread_count
        )
