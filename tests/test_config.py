"""DataStatesConfig (the engine's settings) and TrainerSettings (the `datastates:` section: the engine's keys
and the Nanotron trainer's): defaults, validation naming the field, from_dict, environment overrides."""

import dataclasses
import os

import pytest

from nanotron_datastates import DataStatesConfig, DataStatesEngine
from nanotron_datastates.core_setup import check_memory
from nanotron_datastates.trainer_settings import TrainerSettings


def test_defaults_are_valid_and_sized():
    c = DataStatesConfig()
    assert c.host_cache_size > 0 and c.parser_threads == 0 and c.pin_host_cache is True
    assert c.chunk_bytes % 4096 == 0 and c.cache_bytes // c.chunk_bytes >= 2


BAD = {
    "host_cache_size": [0, -1.0, "2", True, 1e9],
    "parser_threads": [-1, 1.5, 257, "4"],
    "copy_threads": [-1, 2.0, 257, None],
    "checksum_threads": [-1, 1.5, 257, "4"],
    "pin_host_cache": ["yes", 1],
    "huge_pages": ["on", 0],
    "flush_threads": [0, 65],
    "flush_nice": [-1, 20, 1.5, "5"],
    "flush_depth": [0, 5000, 2.0],
    "queue_depth": [0, 5000],
    "chunk_size": [0, 2.5, 5000],
    "device_copy_size": [-1, 4097, 1.5, "4"],
    "device_copy_gbps": [-1, 1e5, "8", None],
    "read_size": [0, 4097],
    "direct_io": ["true"],
    "read_direct_io": ["false", 0],
    "fsync": [1],
    "checksums": [None],
    "verify_checksums": [0],
    "memory_checksums": ["no"],
    "map_memory_files": ["no", 1],
    "io_backend": ["aio", 3],
    "telemetry_path": [3, None],
    "keep_last_n": [-1, 1.0, "3", True],
    "device_snapshot": [True, "on", None],
    "queue_at_step": ["false", 0],
    "balance_writes": ["false", 0],
    "telemetry": ["yes", 0],
    "memory_tier": ["on", 1],
    "memory_tier_copies": [0, 3, 1.5, "2"],
    "memory_tier_path": ["", 3, None],
    "memory_replicas": [-1, 65, 1.0, "1", 1],
    "memory_replica_gbps": [-1, "2", None],
    "memory_replica_transport": ["ucx", True, None],
    "memory_replica_process": ["yes", 1],
    "memory_interval": [-1, 1.5, "10", 10],
}
ACCEPTS = {
    "host_cache_size": "[1/1024, 2**20]",
    "parser_threads": "[0, 256]",
    "copy_threads": "[0, 256]",
    "checksum_threads": "[0, 256]",
    "flush_threads": "[1, 64]",
    "flush_nice": "[0, 19]",
    "flush_depth": "[1, 1024]",
    "queue_depth": "[1, 1024]",
    "chunk_size": "[1, 4096]",
    "device_copy_size": "[0, 4096]",
    "device_copy_gbps": "[0, 10000]",
    "read_size": "[1, 4096]",
    "io_backend": "auto, io_uring, pwrite",
    "keep_last_n": "integer >= 0",
    "device_snapshot": "auto, always, never",
    "telemetry": "true or false",
    "memory_tier_copies": "1 or 2",
    "memory_tier_path": "a path",
    "memory_replicas": "[0, 64]",
    "memory_replica_gbps": "[0, 10000]",
    "memory_replica_transport": "auto, nccl, gloo",
    "memory_replica_process": "auto, always, never",
    "memory_interval": "a number of steps >= 0",
    "telemetry_path": 'a path (or "" for none)',
}


ENGINE = {f.name for f in dataclasses.fields(DataStatesConfig)}
TRAINER = {f.name for f in dataclasses.fields(TrainerSettings)} - ENGINE  # the trainer's own keys


def test_every_key_has_bad_values_under_test():
    assert set(BAD) == ENGINE | TRAINER and not ENGINE & TRAINER


@pytest.mark.parametrize("field,value", [(f, v) for f, values in BAD.items() for v in values])
def test_bad_value_names_the_key_and_what_it_accepts(field, value):
    with pytest.raises(ValueError) as e:
        (DataStatesConfig if field in ENGINE else TrainerSettings)(**{field: value})
    msg = str(e.value)
    assert msg.startswith(f"datastates.{field}={value!r} is invalid: expected"), msg
    assert ACCEPTS.get(field, "true or false") in msg, msg


def test_a_replica_process_over_nccl_is_refused_naming_both_settings():
    with pytest.raises(ValueError, match="memory_replica_process=always is invalid with .*transport=nccl"):
        TrainerSettings(
            memory_tier=True,
            memory_replicas=1,
            memory_replica_process="always",
            memory_replica_transport="nccl",
        )
    auto = TrainerSettings(memory_tier=True, memory_replicas=1, memory_replica_transport="nccl")
    assert auto.memory_replica_process == "auto"  # the threads then: auto takes the process only over gloo


@pytest.mark.parametrize(
    "alias,name", [(True, "always"), (False, "never"), ("True", "always"), ("false", "never")]
)
def test_true_and_false_name_always_and_never_for_the_replica_process(alias, name, monkeypatch):
    assert TrainerSettings(memory_replica_process=alias).memory_replica_process == name
    monkeypatch.setenv("DATASTATES_MEMORY_REPLICA_PROCESS", str(alias).lower())
    assert TrainerSettings.from_dict({}).memory_replica_process == name


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


def test_the_section_is_one_flat_settings_that_the_engine_takes_as_it_is(monkeypatch):
    s = TrainerSettings.from_dict({"host_cache_size": 1 / 64, "keep_last_n": 3})
    assert s.host_cache_size == 1 / 64 and s.keep_last_n == 3 and s["keep_last_n"] == 3
    assert TrainerSettings.from_dict(s.to_dict()) == s and set(s.keys()) == ENGINE | TRAINER
    with pytest.raises(KeyError, match="keep_lst_n"):
        s["keep_lst_n"]
    with pytest.raises(ValueError, match=r"keep_lst_n; known keys: .*host_cache_size.*keep_last_n"):
        TrainerSettings.from_dict({"keep_lst_n": 3})
    with DataStatesEngine(s, pin_host_cache=False) as engine:  # an override keeps the trainer's keys
        assert engine.config.keep_last_n == 3 and engine.config.pin_host_cache is False
    monkeypatch.setenv("DATASTATES_KEEP_LAST_N", "5")
    assert TrainerSettings.from_dict({}).keep_last_n == 5


def test_small_cache_clamps_chunks():
    c = DataStatesConfig(host_cache_size=1 / 1024, chunk_size=64)  # 1 MiB cache
    assert c.chunk_bytes == 256 << 10


def test_cache_larger_than_memory_is_refused():
    with pytest.raises(ValueError, match="host_cache_size"):
        DataStatesEngine(DataStatesConfig(host_cache_size=100_000))


def test_a_host_cache_that_the_nodes_ranks_cannot_all_hold_is_refused_naming_the_setting(monkeypatch):
    """Each rank allocates its own cache: a per-rank size that fits once but not once per rank of the node
    (torchrun's LOCAL_WORLD_SIZE) is refused before anything is pinned."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    config = DataStatesConfig(host_cache_size=0.3 * total / 2**30)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    check_memory(config)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ValueError, match=r"host_cache_size=.* per rank.* 4 ranks .*LOCAL_WORLD_SIZE"):
        check_memory(config)


def test_an_invalid_value_from_the_environment_names_the_variable(monkeypatch):
    monkeypatch.setenv("DATASTATES_HOST_CACHE_SIZE", "0")
    with pytest.raises(ValueError, match=r"host_cache_size=0.0 .*DATASTATES_HOST_CACHE_SIZE='0'"):
        TrainerSettings.from_dict({"host_cache_size": 16})
    monkeypatch.setenv("DATASTATES_HOST_CACHE_SIZE", "1")
    monkeypatch.setenv("DATASTATES_FSYNC", "maybe")
    with pytest.raises(ValueError, match=r"DATASTATES_FSYNC='maybe'.*1, true, yes, on.*0, false, no, off"):
        TrainerSettings.from_dict({})


def test_the_trainers_error_is_importable_beside_the_engine():
    from nanotron_datastates import CheckpointError
    from nanotron_datastates.errors import CheckpointError as where

    assert CheckpointError is where
