"""The adapter's log lines, through Nanotron's logger: `[datastates] ...`, by rank 0 unless `every_rank`."""

from __future__ import annotations

from nanotron import logging
from nanotron.logging import log_rank

_logger = logging.get_logger("nanotron_datastates")
_notes: list[str] = []


def info(msg: str) -> None:
    while _notes:
        log_rank(f"[datastates] {_notes.pop(0)}", logger=_logger, level=logging.INFO, rank=0)
    log_rank(f"[datastates] {msg}", logger=_logger, level=logging.INFO, rank=0)


def note(msg: str) -> None:
    """An info line said just before the next one: Nanotron sets its log level only after `pre_init`, where
    the resume decides what it reads, so lines said there directly would be lost."""
    _notes.append(msg)


def error(msg: str, *, every_rank: bool = False) -> None:
    log_rank(f"[datastates] {msg}", logger=_logger, level=logging.ERROR, rank=None if every_rank else 0)
