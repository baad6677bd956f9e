"""The adapter's log lines, through Nanotron's logger: `[datastates] ...`, by rank 0 unless `every_rank`."""

from __future__ import annotations

from nanotron import logging
from nanotron.logging import log_rank

_logger = logging.get_logger("nanotron_datastates")


def info(msg: str) -> None:
    log_rank(f"[datastates] {msg}", logger=_logger, level=logging.INFO, rank=0)


def error(msg: str, *, every_rank: bool = False) -> None:
    log_rank(f"[datastates] {msg}", logger=_logger, level=logging.ERROR, rank=None if every_rank else 0)
