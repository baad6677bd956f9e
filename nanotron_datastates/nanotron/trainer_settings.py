"""The trainer's settings and the `datastates:` section, where the adapter and its tests first found them; the
code is in `nanotron_datastates.trainer_settings`, which imports no Nanotron."""

from __future__ import annotations

from ..trainer_settings import DatastatesSection, Section, TrainerSettings, section_keys

__all__ = ["DatastatesSection", "Section", "TrainerSettings", "section_keys"]
