"""The file format: byte-exact headers from the core's encoder, and a reader that accepts every valid
safetensors file and rejects everything else with a FormatError naming the file."""

import json
import struct

import pytest
import safetensors.torch
import torch

from nanotron_datastates import FormatError, _core
from nanotron_datastates import format as fmt


def test_golden_header():
    # Given F16 before F32: the file puts larger elements first, so every tensor stays naturally aligned.
    raw = _core.encode_header(
        ["b", "w"], ["F16", "F32"], [[3], [2, 2]], [2, 4], [("format", "pt"), ("note", 'a"b\n\u00e9')], True
    )
    body = (
        '{"__metadata__":{"format":"pt","note":"a\\"b\\n\u00e9","datastates.crc32c":"0000000000000000"},'
        '"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},'
        '"b":{"dtype":"F16","shape":[3],"data_offsets":[16,22]}}'
    ).encode()
    assert len(raw) == 4096
    assert raw[:8] == struct.pack("<Q", 4088)
    assert raw[8:] == body + b" " * (4088 - len(body))


def test_header_grows_in_whole_pages():
    names = [f"tensor_{i:04d}" for i in range(200)]
    raw = _core.encode_header(names, ["F32"] * 200, [[1]] * 200, [4] * 200, [], False)
    assert len(raw) % 4096 == 0 and len(raw) > 4096
    (n,) = struct.unpack("<Q", raw[:8])
    assert 8 + n == len(raw)
    assert b"datastates.crc32c" not in raw


def _file(tmp_path, header: dict, data: bytes = b"", pad: int = 0) -> str:
    h = json.dumps(header).encode() + b" " * pad
    p = tmp_path / "f.safetensors"
    p.write_bytes(struct.pack("<Q", len(h)) + h + data)
    return str(p)


def test_reads_safetensors_written_files(tmp_path):
    p = str(tmp_path / "st.safetensors")
    safetensors.torch.save_file(
        {"a": torch.zeros(3), "b": torch.ones(2, 2, dtype=torch.bfloat16)}, p, {"k": "v"}
    )
    h = fmt.read_header(p)
    assert [t.name for t in h.tensors] == sorted(["a", "b"], key=lambda n: h.tensors[0].name != n)
    assert {t.name: t.shape for t in h.tensors} == {"a": (3,), "b": (2, 2)}
    assert h.user_metadata() == {"k": "v"} and h.checksums() is None


@pytest.mark.parametrize(
    "header,data,match",
    [
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, "truncated"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 12, "data section has 12"),
        ({"a": {"dtype": "F33", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, "unknown dtype"),
        ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, "cannot hold"),
        ({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8, "non-negative"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, b"\0" * 8, "bad data_offsets"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8.0]}}, b"\0" * 8, "two integers"),
        (
            {
                "a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]},
            },
            b"\0" * 6,
            "overlaps",
        ),
        (
            {
                "a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
                "b": {"dtype": "U8", "shape": [2], "data_offsets": [4, 6]},
            },
            b"\0" * 6,
            "hole",
        ),
        ({"__metadata__": {"k": 1}}, b"", "strings to strings"),
        ({"a": [1]}, b"", "not an object"),
        ({"__metadata__": {"datastates.version": "99"}}, b"", "newer"),
        ({"__metadata__": {"datastates.version": "\u00b2"}}, b"", "newer"),
        ({"__metadata__": {"datastates.version": "9" * 5000}}, b"", "newer"),  # past int()'s 4300 digits
        *(
            (
                {
                    "__metadata__": {"datastates.crc32c_blocks": blocks},
                    "a": {"dtype": "U8", "shape": [5000], "data_offsets": [0, 5000]},
                },
                b"\0" * 5000,
                "a block size",
            )
            for blocks in [
                "\u00b2:" + "0" * 16,
                "4096:" + "0" * 8,
                "4000:" + "0" * 16,
                "1024:" + "0" * 40,
                "4096",
                "4" * 5000 + ":" + "0" * 16,
            ]
        ),
        (
            {
                "__metadata__": {"datastates.crc32c": "xyz"},
                "a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
            },
            b"\0",
            "hex digits",
        ),
    ],
)
def test_rejects_invalid_headers(tmp_path, header, data, match):
    p = _file(tmp_path, header, data)
    with pytest.raises(FormatError, match=match) as e:
        fmt.read_header(p)
    assert p in str(e.value)


@pytest.mark.parametrize(
    "raw,match",
    [
        (b"", "too short"),
        (struct.pack("<Q", 10**12), "exceeds"),
        (struct.pack("<Q", 50) + b"{}", "past the end"),
        (struct.pack("<Q", 2) + b"[]", "start with"),
        (struct.pack("<Q", 3) + b"{x}", "not valid JSON"),
        (struct.pack("<Q", 2) + b"\xff\xfe", "start with"),
        (struct.pack("<Q", 15) + b'{"a":1,"a":2}  ', "duplicate"),
        (struct.pack("<Q", 3) + b"{\xff}", "not valid JSON"),
    ],
)
def test_rejects_malformed_bytes(raw, match):
    with pytest.raises(FormatError, match=match):
        fmt.parse_header(raw, len(raw), "mem")


def test_deep_nesting_is_a_format_error():
    body = b'{"a":' + b"[" * 100000 + b"]" * 100000 + b"}"
    raw = struct.pack("<Q", len(body)) + body
    with pytest.raises(FormatError):
        fmt.parse_header(raw, len(raw), "mem")


def test_padding_and_empty_tensors_are_valid(tmp_path):
    header = {
        "e": {"dtype": "F32", "shape": [0, 3], "data_offsets": [0, 0]},
        "a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
    }
    h = fmt.read_header(_file(tmp_path, header, b"\1\2", pad=100))
    assert [t.name for t in h.tensors] == ["e", "a"] and h.data_start == 8 + len(json.dumps(header)) + 100


@pytest.mark.parametrize("shape", [[2**64, 0], [0, 2**63], [2**32, 2**31, 0], [2**62, 2, 0]])
def test_a_shape_that_does_not_fit_63_bits_is_a_format_error(tmp_path, shape):
    """No byte, but no tensor can have it: refused with the header, before `load` builds anything."""
    from nanotron_datastates import DataStatesEngine

    p = _file(tmp_path, {"a": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}}, b"")
    with pytest.raises(FormatError, match="63 bits"):
        fmt.read_header(p)
    with DataStatesEngine(host_cache_size=1 / 64) as engine, pytest.raises(FormatError, match="63 bits"):
        engine.load(p)
