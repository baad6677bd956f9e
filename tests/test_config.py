"""DataStatesConfig: defaults, validation naming the field, from_dict, environment overrides."""

import pytest

from nanotron_datastates import DataStatesConfig, DataStatesEngine


def test_defaults_are_valid_and_sized():
    c = DataStatesConfig()
    assert c.host_cache_size > 0 and c.parser_threads >= 1 and c.pin_host_cache is True
    assert c.chunk_bytes % 4096 == 0 and c.cache_bytes // c.chunk_bytes >= 2


@pytest.mark.parametrize(
    "field,value",
    [
        ("host_cache_size", 0),
        ("host_cache_size", -1.0),
        ("host_cache_size", "2"),
        ("parser_threads", 0),
        ("parser_threads", 1.5),
        ("flush_threads", 0),
        ("queue_depth", 0),
        ("queue_depth", 5000),
        ("chunk_size", 0),
        ("read_size", 0),
        ("pin_host_cache", "yes"),
        ("fsync", 1),
        ("io_backend", "aio"),
    ],
)
def test_bad_value_names_the_field(field, value):
    with pytest.raises(ValueError, match=rf"datastates\.{field}="):
        DataStatesConfig(**{field: value})


def test_from_dict_rejects_unknown_keys_by_name():
    with pytest.raises(ValueError, match="host_cache_sise"):
        DataStatesConfig.from_dict({"host_cache_sise": 1})
    c = DataStatesConfig.from_dict({"host_cache_size": 0.5, "parser_threads": 3})
    assert (c.host_cache_size, c.parser_threads) == (0.5, 3)


def test_environment_overrides(monkeypatch):
    monkeypatch.setenv("DATASTATES_HOST_CACHE_SIZE", "0.25")
    monkeypatch.setenv("DATASTATES_FSYNC", "off")
    c = DataStatesConfig.from_dict({"host_cache_size": 4})
    assert c.host_cache_size == 0.25 and c.fsync is False
    assert DataStatesConfig.from_dict({"host_cache_size": 4}, env=False).host_cache_size == 4
    monkeypatch.setenv("DATASTATES_PARSER_THREADS", "many")
    with pytest.raises(ValueError, match="DATASTATES_PARSER_THREADS"):
        DataStatesConfig.from_dict({})


def test_small_cache_clamps_chunks():
    c = DataStatesConfig(host_cache_size=1 / 1024, chunk_size=64)  # 1 MiB cache
    assert c.chunk_bytes == 256 << 10


def test_cache_larger_than_memory_is_refused():
    with pytest.raises(ValueError, match="host_cache_size"):
        DataStatesEngine(DataStatesConfig(host_cache_size=100_000))
