"""Shared by the Nanotron harnesses (nanotron_proof.py, bench_nanotron.py): configs derived from the example
config, and Nanotron's run_train.py loaded as a module (for its dataloader)."""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
BASE_CONFIG = REPO / "examples" / "config_tiny_llama_datastates.yaml"


def write_config(
    path: Path,
    *,
    engine: str,
    checkpoints: dict[str, Any],
    cache_gib: float | None = None,
    steps: int,
    parallelism: dict[str, int] | None = None,
    zero: int = 0,
    run: str = "run",
    model: dict[str, Any] | None = None,
    tokens: dict[str, Any] | None = None,
    datastates: dict[str, Any] | None = None,
    fp32_grads: bool = True,
    init_from: Path | None = None,
) -> Path:
    """The example config with these changes; `engine` "torch" leaves none of our keys (stock Nanotron
    parses it). `init_from`: the model's weights from that checkpoint (Nanotron's ExistingCheckpointInit).
    `fp32_grads` False: gradients accumulated in the model's dtype, no fp32 master weights
    (Nanotron main raises NotImplementedError for fp32 accumulation with ZeRO-1 on more than one dp rank)."""
    doc = yaml.safe_load(BASE_CONFIG.read_text())
    doc["checkpoints"].update(checkpoints)
    if engine == "datastates":
        doc["checkpoints"]["checkpointing_engine"] = "datastates"
        if cache_gib is not None:
            doc["datastates"]["host_cache_size"] = cache_gib
        doc["datastates"].update(datastates or {})
    else:
        doc["checkpoints"].pop("checkpointing_engine", None)
        doc.pop("datastates", None)
    doc["tokens"]["train_steps"] = steps
    doc["tokens"].update(tokens or {})
    doc["parallelism"].update(parallelism or {})
    doc["optimizer"]["zero_stage"] = zero
    doc["optimizer"]["accumulate_grad_in_fp32"] = fp32_grads
    doc["model"]["model_config"].update(model or {})
    if init_from is not None:
        doc["model"]["init_method"] = {"path": str(init_from)}
    doc["general"]["run"] = run
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.dump(doc))
    return path


def load_run_train() -> ModuleType:
    """Nanotron's run_train.py ($NANOTRON_RUN_TRAIN), imported without running its main."""
    spec = importlib.util.spec_from_file_location("nanotron_run_train", os.environ["NANOTRON_RUN_TRAIN"])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def book_dummy_tokens(metadata: Any) -> None:
    """Nanotron main counts the tokens trained in total and per dataset folder of the stage, and its
    `load_meta` refuses a checkpoint whose two counts differ; its dummy data (no dataset) has no folder, so
    stock main cannot resume its own checkpoints of it. The dummy data's tokens are booked under one folder,
    as a real dataset's are. Nanotron before 2025-04 counts neither."""
    total = getattr(metadata, "consumed_tokens_total", None)
    if total is None or len(metadata.data_stages) != 1:
        return
    folders = metadata.data_stages[0].consumed_tokens_per_dataset_folder
    if not folders or set(folders) == {"dummy"}:
        folders["dummy"] = total


class LossOnEveryStage:
    """A trainer mixin: Nanotron main builds its step's log line, the loss's `.item()` included, on every rank
    (trainer.py's `train_step_logs`, huggingface/nanotron#405), where only the last pipeline stage holds a
    loss: with pp > 1 the first stage raises at step 1, stock or ours. The other stages' loss is given as
    NaN, which no log shows (only the last stage's ranks log); 2cde8f6 builds the line on those ranks only."""

    def train_step_logs(self, *a: Any, **k: Any) -> Any:
        if "loss_avg" in k and k["loss_avg"] is None:
            import torch

            k["loss_avg"] = torch.full((), float("nan"), device="cuda")
        return super().train_step_logs(*a, **k)  # type: ignore[misc]


def time_library_report(marks: dict[str, float]) -> None:
    """Times Nanotron main's collect_env report (2-5 s of subprocesses while the trainer is constructed,
    varying from run to run) into `marks["library_report_s"]`, to be left out of the time to the first
    step. Nanotron without that report is left as it is."""
    import nanotron.trainer

    report = getattr(nanotron.trainer, "log_libraries_versions", None)
    if report is None:
        return

    def timed_report(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return report(*a, **k)
        finally:
            marks["library_report_s"] = time.perf_counter() - t

    nanotron.trainer.log_libraries_versions = timed_report
