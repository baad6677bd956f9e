"""Fuzzing the readers of untrusted bytes with hypothesis: the safetensors header parser, the whole load path,
and the skeleton decoder. Whatever the input, only FormatError (ChecksumError among them) or OSError comes
out: never a crash, a hang or another exception. Checksums catch every flipped data byte."""

import contextlib
import json
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanotron_datastates import ChecksumError, DataStatesEngine, FormatError, skeleton
from nanotron_datastates import format as fmt

from helpers import small_config

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

_ints = st.one_of(st.integers(-10, 10), st.integers(0, 1 << 64), st.integers(-(1 << 70), 1 << 70))
_dtypes = st.sampled_from(["F32", "F16", "BF16", "I64", "U8", "BOOL", "F8_E4M3", "X9", "", 3])
_json = st.recursive(
    st.one_of(st.none(), st.booleans(), _ints, st.floats(allow_nan=False), st.text(max_size=8)),
    lambda c: st.one_of(st.lists(c, max_size=4), st.dictionaries(st.text(max_size=6), c, max_size=4)),
    max_leaves=12,
)
_entry = st.fixed_dictionaries(
    {"dtype": _dtypes, "shape": st.lists(_ints, max_size=3), "data_offsets": st.lists(_ints, max_size=3)}
)
_header = st.dictionaries(st.text(max_size=6), st.one_of(_entry, _json), max_size=5)


def _only_clean_errors(fn):
    with contextlib.suppress(FormatError, OSError):  # a plain ValueError (int()'s, say) names no file
        fn()


@FUZZ
@given(header=_header, data=st.binary(max_size=256), length_delta=st.integers(-64, 64))
def test_header_parser_takes_any_header(header, data, length_delta):
    raw = json.dumps(header).encode()
    buf = struct.pack("<Q", max(0, len(raw) + length_delta)) + raw
    _only_clean_errors(lambda: fmt.parse_header(buf + data, len(buf) + len(data)))


@FUZZ
@given(raw=st.binary(max_size=512), huge=st.sampled_from([0, 1 << 32, (1 << 64) - 1, 100 << 20]))
def test_header_parser_takes_any_bytes(raw, huge):
    _only_clean_errors(lambda: fmt.parse_header(raw, len(raw)))
    _only_clean_errors(lambda: fmt.parse_header(struct.pack("<Q", huge) + raw, 8 + len(raw)))


@FUZZ
@given(doc=_json, names=st.lists(st.text(max_size=3), max_size=3))
def test_skeleton_decoder_takes_any_json(doc, names):
    tensors = {n: torch.zeros(1) for n in names}
    _only_clean_errors(lambda: skeleton.decode(json.dumps(doc), tensors, path="fuzz"))
    tagged = {"d": [[k, {"t": k}] for k in names]} if names else {"l": [doc]}
    _only_clean_errors(lambda: skeleton.decode(json.dumps(tagged), tensors, path="fuzz"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz")
    state = {"a": torch.randn(300, 7), "b": torch.arange(1000, dtype=torch.int16), "n": {"x": 3, "y": [1.5]}}
    engine = DataStatesEngine(small_config())
    engine.save(state, folder / "f.safetensors").wait_persisted()
    yield engine, (folder / "f.safetensors").read_bytes(), folder
    engine.close()


@FUZZ
@given(
    flips=st.lists(st.tuples(st.integers(0, 1 << 40), st.integers(1, 255)), min_size=1, max_size=4),
    cut=st.one_of(st.none(), st.integers(0, 1 << 40)),
)
def test_load_of_a_damaged_file_fails_cleanly(saved, flips, cut):
    engine, good, folder = saved
    raw = bytearray(good)
    for pos, bits in flips:
        raw[pos % len(raw)] ^= bits
    if cut is not None:
        raw = raw[: cut % len(raw)]
    path = folder / "damaged.safetensors"
    path.write_bytes(bytes(raw))
    header_len = 8 + struct.unpack("<Q", good[:8])[0]
    changed = {
        pos % len(good)
        for pos, _ in flips
        if raw[pos % len(good) : pos % len(good) + 1] != good[pos % len(good) : pos % len(good) + 1]
    }
    data_flipped = cut is None and bool(changed) and min(changed) >= header_len
    try:
        engine.load(path)
    except ChecksumError:
        return
    except (FormatError, OSError):
        assert not data_flipped, "a flipped data byte must be a ChecksumError"
        return
    # Loaded: only possible when every flip landed in the header's padding (spaces) and changed nothing read.
    assert not data_flipped
