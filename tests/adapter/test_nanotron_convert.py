"""Converting a stock checkpoint that holds Nanotron's pickled RandomStates, and back (the helpers are
test_convert.py's)."""

from __future__ import annotations

from pathlib import Path

import nanotron.random as nanotron_random
import torch
from test_convert import RANDOM, check_datastates, check_torch, stock_checkpoint

from nanotron_datastates import DataStatesEngine
from nanotron_datastates.nanotron import layout
from nanotron_datastates.nanotron.convert import convert


def test_round_trip(tmp_path: Path) -> None:
    stock = tmp_path / "stock"
    original = stock_checkpoint(stock, with_random=True)
    dstates = convert(stock, tmp_path / "datastates", "datastates")
    assert dstates == tmp_path / "datastates"
    check_datastates(dstates, original, with_random=True)
    with DataStatesEngine(host_cache_size=1 / 64, pin_host_cache=False) as engine:
        saved = engine.load(dstates / layout.as_safetensors(RANDOM))
    assert set(saved) == {"nanotron"}  # no process-wide states: the stock layout never kept them

    back = convert(dstates, tmp_path / "torch", "torch")
    check_torch(back, dstates, original)
    random_states = torch.load(back / RANDOM, map_location="cpu", weights_only=False)
    assert isinstance(random_states, nanotron_random.RandomStates)
    assert random_states == original["random"]
