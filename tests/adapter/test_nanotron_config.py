"""`checkpointing_engine: datastates` and the `datastates:` section, parsed by Nanotron's own config code.

Runs against each Nanotron tree (see conftest.py)."""

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import yaml

from nanotron_datastates import DataStatesConfig  # noqa: E402
from nanotron_datastates.nanotron import yaml_config as ds_config  # noqa: E402
from nanotron_datastates.trainer_settings import TrainerSettings  # noqa: E402

BASE = {
    "checkpoints": {"checkpoint_interval": 5, "checkpoints_path": "/tmp/ckpt"},
    "data_stages": [
        {
            "data": {"dataset": None, "num_loading_workers": 1, "seed": 42},
            "name": "Stable Training Stage",
            "start_training_step": 1,
        }
    ],
    "general": {
        "benchmark_csv_path": None,
        "consumed_train_samples": None,
        "ignore_sanity_checks": True,
        "project": "debug",
        "run": "tiny",
        "seed": 42,
        "step": None,
    },
    "lighteval": None,
    "logging": {"iteration_step_info_interval": 1, "log_level": "info", "log_level_replica": "info"},
    "model": {
        "ddp_bucket_cap_mb": 25,
        "dtype": "bfloat16",
        "init_method": {"std": 0.025},
        "make_vocab_size_divisible_by": 1,
        "model_config": {
            "bos_token_id": 1,
            "eos_token_id": 2,
            "hidden_act": "silu",
            "hidden_size": 64,
            "initializer_range": 0.02,
            "intermediate_size": 128,
            "is_llama_config": True,
            "max_position_embeddings": 64,
            "num_attention_heads": 4,
            "num_hidden_layers": 2,
            "num_key_value_heads": 4,
            "pad_token_id": None,
            "pretraining_tp": 1,
            "rms_norm_eps": 1e-05,
            "rope_scaling": None,
            "tie_word_embeddings": True,
            "use_cache": True,
            "vocab_size": 256,
        },
    },
    "optimizer": {
        "accumulate_grad_in_fp32": True,
        "clip_grad": 1.0,
        "learning_rate_scheduler": {
            "learning_rate": 0.0003,
            "lr_decay_starting_step": None,
            "lr_decay_steps": 13,
            "lr_decay_style": "cosine",
            "lr_warmup_steps": 2,
            "lr_warmup_style": "linear",
            "min_decay_lr": 1e-05,
        },
        "optimizer_factory": {
            "adam_beta1": 0.9,
            "adam_beta2": 0.95,
            "adam_eps": 1e-08,
            "name": "adamW",
            "torch_adam_is_fused": True,
        },
        "weight_decay": 0.01,
        "zero_stage": 0,
    },
    "parallelism": {
        "dp": 1,
        "expert_parallel_size": 1,
        "pp": 1,
        "pp_engine": "1f1b",
        "tp": 1,
        "tp_linear_async_communication": False,
        "tp_mode": "ALL_REDUCE",
    },
    "profiler": None,
    "tokenizer": {"tokenizer_max_length": None, "tokenizer_name_or_path": None, "tokenizer_revision": None},
    "tokens": {
        "batch_accumulation_per_replica": 1,
        "limit_test_batches": 0,
        "limit_val_batches": 0,
        "micro_batch_size": 2,
        "sequence_length": 64,
        "train_steps": 10,
        "val_check_interval": -1,
    },
}


def parse(tmp_path, **changes):
    doc = copy.deepcopy(BASE)
    for key, value in changes.items():
        if key == "checkpoints":
            doc["checkpoints"].update(value)
        else:
            doc[key] = value
    path = tmp_path / "config.yaml"
    path.write_text(yaml.dump(doc))
    ds_config.register()
    from nanotron.config import get_config_from_file

    return get_config_from_file(str(path))


def test_default_is_nanotrons_engine(tmp_path):
    c = parse(tmp_path)
    assert c.checkpoints.checkpointing_engine == "torch" and not c.uses_datastates
    assert ds_config.settings_of(c) == TrainerSettings.from_dict({}) == c.datastates


def test_datastates_under_checkpoints_with_a_section(tmp_path):
    c = parse(
        tmp_path,
        checkpoints={"checkpointing_engine": "datastates"},
        datastates={"host_cache_size": 8, "parser_threads": 3, "pin_host_cache": False, "keep_last_n": 2},
    )
    assert c.uses_datastates and c.checkpoints.checkpointing_engine == "datastates"
    engine = trainer = ds_config.settings_of(c)
    assert engine is c.datastates  # one object: the engine's config and the trainer's settings
    assert (engine.host_cache_size, engine.parser_threads, engine.pin_host_cache) == (8, 3, False)
    assert engine.flush_threads == DataStatesConfig().flush_threads  # the engine's default
    assert trainer.keep_last_n == 2 and trainer.telemetry is TrainerSettings().telemetry
    assert c.datastates["keep_last_n"] == 2 and c.datastates["flush_threads"] == engine.flush_threads
    assert c.datastates.keep_last_n == 2 and c.datastates.host_cache_size == 8  # by attribute, as Nanotron's
    written = tmp_path / "written.yaml"
    c.save_as_yaml(written)  # plain keys, read back the same
    text = written.read_text()
    assert "TrainerSettings" not in text and "keep_last_n: 2" in text
    from nanotron.config import get_config_from_file

    assert get_config_from_file(str(written)).datastates == c.datastates


def test_top_level_key_as_datastates_docs_write_it(tmp_path):
    c = parse(tmp_path, checkpointing_engine="datastates")
    assert c.checkpoints.checkpointing_engine == "datastates" and c.checkpointing_engine is None


@pytest.mark.parametrize(
    "changes,match",
    [
        ({"datastates": {"host_cache_sise": 1}}, "host_cache_sise"),
        ({"datastates": {"parser_threads": -1}}, r"datastates\.parser_threads=-1"),
        ({"datastates": {"io_backend": "aio"}}, r"datastates\.io_backend"),
        ({"datastates": {"keep_last_n": -1}}, r"datastates\.keep_last_n=-1"),
        ({"checkpoints": {"checkpointing_engine": "tensorstore"}}, "checkpoints.checkpointing_engine"),
        ({"checkpointing_engine": "x"}, "checkpointing_engine='x'"),
    ],
)
def test_bad_keys_and_values_are_rejected_when_loaded(tmp_path, changes, match):
    with pytest.raises(ValueError, match=match):
        parse(tmp_path, **changes)


def test_config_yaml_round_trip(tmp_path):
    c = parse(
        tmp_path, checkpoints={"checkpointing_engine": "datastates"}, datastates={"host_cache_size": 0.5}
    )
    c.save_as_yaml(str(tmp_path / "again.yaml"))  # Nanotron re-reads it to check
    from nanotron.config import get_config_from_file

    again = get_config_from_file(str(tmp_path / "again.yaml"))
    assert again.uses_datastates and ds_config.settings_of(again) == ds_config.settings_of(c)
    assert ds_config.settings_of(again).host_cache_size == 0.5


HOOK = textwrap.dedent(
    """
    import cpu_stand_ins  # main's CUDA-only imports
    import nanotron.trainer as t
    from nanotron.config import get_config_from_file
    print(t.DistributedTrainer.__name__, get_config_from_file.__defaults__[0].__module__,
          hasattr(get_config_from_file.__defaults__[0], "uses_datastates"))
    """
)


def _run(env_extra):
    env = dict(os.environ, **env_extra)
    return subprocess.run([sys.executable, "-c", HOOK], capture_output=True, text=True, env=env)


def test_post_import_hook_makes_nanotron_use_the_adapter():
    r = _run({})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["DataStatesTrainer", "nanotron.config.config", "True"]


def test_post_import_hook_can_be_turned_off():
    r = _run({"NANOTRON_DATASTATES_AUTOLOAD": "0"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["DistributedTrainer", "nanotron.config.config", "False"]


def test_explicit_trainer_import_first_with_the_hook_on():
    """`from nanotron_datastates.nanotron import DataStatesTrainer` before anything imported Nanotron's
    trainer: our module imports it, the hook fires inside that import, and the trainer is still installed."""
    code = (
        "import cpu_stand_ins\n"
        "from nanotron_datastates.nanotron import DataStatesTrainer\n"
        "import nanotron.trainer as t\n"
        "print(t.DistributedTrainer is DataStatesTrainer)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ))
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["True"]


def test_a_section_set_while_nanotrons_engine_is_in_use_is_warned_of(tmp_path):
    """`datastates:` keys take effect only with `checkpointing_engine: datastates`: set without it, they
    are named in a warning rather than ignored in silence; the defaults (a saved config.yaml's), not."""
    with pytest.warns(UserWarning, match=r"datastates: host_cache_size, keep_last_n .*checkpointing_engine"):
        c = parse(tmp_path, datastates={"host_cache_size": 8, "keep_last_n": 3})
    assert not c.uses_datastates
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parse(tmp_path, datastates=TrainerSettings().to_dict())
        parse(tmp_path, checkpoints={"checkpointing_engine": "datastates"}, datastates={"keep_last_n": 3})
