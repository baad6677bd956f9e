"""A memory checkpoint's documents in the tier (tier/memory_steps.py): written whole into the step's folder,
read back checked; a planted link or FIFO in their place is never followed or waited on, and a manifest of
another step is refused, naming it."""

import json
import os
import threading

import pytest

from nanotron_datastates.checkpoint.manifest import ManifestError, manifest
from nanotron_datastates.checkpoint.names import MANIFEST, NANOTRON_METADATA
from nanotron_datastates.checkpoint.topology import topology
from nanotron_datastates.tier.memory import MemoryTier
from nanotron_datastates.tier.memory_steps import keep_documents, read_documents, steps_with_manifest


def documents(step: int) -> dict[str, str]:
    layout = topology(tp=1, pp=1, dp=1, cp=1, expert=1, zero_stage=0)
    return {MANIFEST: json.dumps(manifest(step, layout, {})), NANOTRON_METADATA: '{"last_train_step": 1}'}


@pytest.fixture
def tier(tmp_path):
    return MemoryTier(tmp_path / "shm", tmp_path / "ckpt", 0)


def test_documents_are_kept_and_read_back_and_only_newer_steps_listed(tier):
    for step in (10, 20, 30):
        keep_documents(tier, step, documents(step))
    assert read_documents(tier, 20) == documents(20)
    assert steps_with_manifest(tier, 10) == [20, 30] and steps_with_manifest(tier, None) == [10, 20, 30]
    with pytest.raises(ValueError, match="not a document"):
        keep_documents(tier, 40, {"config.yaml": "x"})


def test_a_manifest_of_another_step_is_refused_naming_it(tier):
    keep_documents(tier, 20, documents(10))
    with pytest.raises(ManifestError, match="step 10, not 20"):
        read_documents(tier, 20)


def test_a_planted_link_or_fifo_in_place_of_a_manifest_is_never_followed_nor_waited_on(tier, tmp_path):
    """Hostile: step 20's manifest is a link to a valid manifest elsewhere, step 30's a FIFO nobody writes."""
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(documents(20)[MANIFEST])
    keep_documents(tier, 10, documents(10))
    (tier.folder / "20").mkdir()
    os.symlink(elsewhere, tier.folder / "20" / MANIFEST)
    (tier.folder / "30").mkdir()
    os.mkfifo(tier.folder / "30" / MANIFEST)
    found: list = []
    t = threading.Thread(target=lambda: found.append(steps_with_manifest(tier, None)), daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "waited on a FIFO"
    assert found == [[10]]
    for step in (20, 30):
        with pytest.raises(OSError):
            read_documents(tier, step)
