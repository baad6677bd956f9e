"""Round trips through save and load: every dtype and shape, non-contiguous views, nested structures; the
safetensors library reads our files, and we read its files."""

import collections

import pytest
import safetensors
import safetensors.torch
import torch

from nanotron_datastates import ChecksumError, DataStatesEngine, _core
from nanotron_datastates import format as fmt
from nanotron_datastates.load import restore

from helpers import constructors_forced_to, random_tensor, same, small_config

SHAPES = [(), (0,), (3, 0, 2), (1,), (7,), (3, 5), (2, 3, 4, 5), (65537,)]


@pytest.mark.parametrize("dtype_name", sorted(fmt.DTYPES))
def test_every_dtype_and_shape(engine, tmp_path, dtype_name):
    dtype = fmt.DTYPES[dtype_name].torch
    state = {f"s{i}": random_tensor(dtype, s, seed=i) for i, s in enumerate(SHAPES)}
    engine.save(state, tmp_path / "f.safetensors").wait_persisted()
    back = engine.load(tmp_path / "f.safetensors")
    assert list(back) == list(state)
    for k in state:
        assert same(back[k], state[k]), k


def test_non_contiguous_views(engine, tmp_path):
    base = torch.randn(64, 48)
    state = {
        "transposed": base.t(),
        "strided": base[:, ::3],
        "offset": base[5:9, 7:40],
        "expanded": torch.arange(5.0).expand(6, 5),
        "permuted": torch.randn(4, 5, 6).permute(2, 0, 1),
        "bf16_slice": base.bfloat16()[::2, 1::2],
        "bool_t": (base > 0).t(),
    }
    engine.save(state, tmp_path / "v.safetensors").wait_persisted()
    back = engine.load(tmp_path / "v.safetensors")
    for k, v in state.items():
        assert same(back[k], v.contiguous()), k
        assert back[k].is_contiguous()


def test_nested_state_with_plain_values(engine, tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    state = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "step": 7,
        "lr": 1e-3,
        "name": "run",
        "flags": (True, None),
        "rng": torch.get_rng_state(),
        "blob": b"\x00\x01",
    }
    engine.save(state, tmp_path / "n.safetensors").wait_persisted()
    back = engine.load(tmp_path / "n.safetensors")
    assert type(back["model"]) is collections.OrderedDict
    assert list(back["model"]) == list(state["model"])
    assert back["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    assert set(back["optimizer"]["state"]) == set(state["optimizer"]["state"])  # int keys
    for i, s in state["optimizer"]["state"].items():
        for k, v in s.items():
            assert same(back["optimizer"]["state"][i][k], v)
    assert (back["step"], back["lr"], back["name"], back["flags"], back["blob"]) == (
        7,
        1e-3,
        "run",
        (True, None),
        b"\0\1",
    )
    assert same(back["rng"], state["rng"])
    # The restored optimizer steps exactly like the original.
    opt2 = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt2.load_state_dict(back["optimizer"])


def test_tied_tensors_stay_tied(engine, tmp_path):
    w = torch.randn(10, 4)
    engine.save({"embed": w, "head": w}, tmp_path / "t.safetensors").wait_persisted()
    back = engine.load(tmp_path / "t.safetensors")
    assert back["embed"] is back["head"] and same(back["embed"], w)


def test_safetensors_reads_our_files(engine, tmp_path):
    state = {name: random_tensor(d.torch, (4, 3), seed=1) for name, d in fmt.DTYPES.items()}
    state = {
        k: v for k, v in state.items() if k in safetensors.torch._TYPES
    }  # what this safetensors can load
    p = str(tmp_path / "ours.safetensors")
    engine.save(state, p, metadata={"origin": "test"}).wait_persisted()
    theirs = safetensors.torch.load_file(p)
    assert set(theirs) == set(state)
    for k in state:
        assert same(theirs[k], state[k]), k
    with safetensors.safe_open(p, framework="pt") as f:
        md = f.metadata()
        assert md["format"] == "pt" and md["origin"] == "test"
        assert same(f.get_slice("F32")[1:3], state["F32"][1:3])
    assert engine.read_metadata(p) == {"format": "pt", "origin": "test"}
    with open(p, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
    assert (8 + n) % 4096 == 0


def test_we_read_safetensors_files(engine, tmp_path):
    state = {"a": torch.randn(100, 3), "b": torch.arange(10, dtype=torch.int16), "c": torch.zeros(0)}
    p = str(tmp_path / "theirs.safetensors")
    safetensors.torch.save_file(state, p, metadata={"x": "y"})
    back = engine.load(p)
    assert set(back) == set(state) and all(same(back[k], state[k]) for k in state)


def test_load_without_verification_and_to_an_explicit_device(engine, tmp_path):
    engine.save({"a": torch.ones(3)}, tmp_path / "a.safetensors").wait_persisted()
    assert same(engine.load(tmp_path / "a.safetensors", "cpu", verify=False)["a"], torch.ones(3))
    with pytest.raises(ValueError, match="CPU and CUDA"):
        engine.load(tmp_path / "a.safetensors", "meta")


def test_unaligned_foreign_files_are_copied_into_aligned_tensors(engine, tmp_path):
    # A valid safetensors file whose data section starts at an odd offset: no float can be a view there.
    import json
    import struct

    a, b = torch.randn(1000), torch.arange(7, dtype=torch.int64)
    header = {
        "a": {"dtype": "F32", "shape": [1000], "data_offsets": [0, 4000]},
        "b": {"dtype": "I64", "shape": [7], "data_offsets": [4000, 4056]},
    }
    h = json.dumps(header).encode()
    h += b" " * (1 - len(h) % 2)  # 8 + len(h) odd
    p = tmp_path / "odd.safetensors"
    p.write_bytes(struct.pack("<Q", len(h)) + h + a.numpy().tobytes() + b.numpy().tobytes())
    back = engine.load(p)
    assert same(back["a"], a) and same(back["b"], b)
    assert back["a"].data_ptr() % 4 == 0 and back["b"].data_ptr() % 8 == 0


def test_cpu_loads_are_separate_storages_that_torch_accepts_everywhere(engine, tmp_path):
    # torch.set_rng_state ignores storage offsets: a view into a shared buffer would crash it.
    state = {"w": torch.randn(1 << 18), "rng": torch.get_rng_state(), "b": torch.randn(3, 3).double()}
    engine.save(state, tmp_path / "s.safetensors").wait_persisted()
    back = engine.load(tmp_path / "s.safetensors")
    for t in back.values():
        assert t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    torch.set_rng_state(back["rng"])
    assert same(torch.get_rng_state(), state["rng"])
    back["w"].add_(1)  # writable, and independent of its neighbours
    assert same(back["b"], state["b"])
    del back["w"], back["b"]  # the shared buffer lives on with the remaining tensor
    assert same(back["rng"], state["rng"])


def test_exact_metadata_for_strict_readers_with_checksums_kept_outside(engine, tmp_path):
    # Nanotron parses a weight file's metadata strictly: nothing but its own keys may be there.
    md = {"version": "1.4", "unsharded_shape": "(8, 4)", "local_global_slices_pairs": "x"}
    w = torch.randn(4, 4)
    h = engine.save({"data": w}, tmp_path / "w.safetensors", metadata=md, exact_metadata=True)
    sums = h.checksums()
    with safetensors.safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        assert f.metadata() == md and same(f.get_tensor("data"), w)
    assert set(sums) == {"data"} and sums["data"] == _core.crc32c(w.numpy().tobytes())
    assert same(engine.load(tmp_path / "w.safetensors", checksums=sums)["data"], w)
    with pytest.raises(ChecksumError, match="'data'"):
        engine.load(tmp_path / "w.safetensors", checksums={"data": sums["data"] ^ 1})
    with pytest.raises(TypeError, match="flat dict"):
        engine.save({"a": {"b": w}}, tmp_path / "x.safetensors", exact_metadata=True)


def test_checksums_of_a_normal_save_match_the_header(engine, tmp_path):
    state = {"a": torch.randn(3000), "b": torch.arange(10)}
    h = engine.save(state, tmp_path / "n.safetensors")
    assert h.checksums() == fmt.read_header(tmp_path / "n.safetensors").checksums()


def test_load_into_existing_tensors(engine, tmp_path):
    state = {"w": torch.randn(100, 7), "b": torch.arange(5, dtype=torch.int32)}
    engine.save(state, tmp_path / "i.safetensors").wait_persisted()
    dest = {"w": torch.empty(100, 7)}
    engine.load_into(tmp_path / "i.safetensors", dest)
    assert same(dest["w"], state["w"])
    with pytest.raises(ValueError, match=r"'b' is I32\[5\]; the destination is torch.float32\[5\]"):
        engine.load_into(tmp_path / "i.safetensors", {"b": torch.empty(5)})
    with pytest.raises(KeyError, match="'zz'"):
        engine.load_into(tmp_path / "i.safetensors", {"zz": torch.empty(1)})


@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (2, 3), (7,)])
def test_tensors_are_allocated_as_the_file_says_while_another_library_patches_torch_empty(shape):
    # A resume reads ahead on a thread of its own while Nanotron builds the model with torch.empty patched to
    # its dtype: the optimizer's fp32 state once came back as bf16 and failed its checksums.
    with constructors_forced_to(torch.bfloat16):
        assert torch.empty(2).dtype == torch.bfloat16  # the patch is in force
        t = restore.empty(shape, torch.float32, torch.device("cpu"))
    assert t.dtype == torch.float32 and tuple(t.shape) == shape and t.is_contiguous()


def test_empty_tensors_among_many_large_ones_do_not_hide_any_bytes(tmp_path):
    """An empty tensor starts where the next one does; a piece boundary falls inside that next one."""
    state = {}
    for i in range(40):
        state[f"x{i:02d}"] = torch.full((300_000 + i,), float(i))  # ~1.2 MiB each: pieces of 1 MiB split them
        state[f"e{i:02d}"] = torch.empty(0)
    with DataStatesEngine(small_config(read_size=1)) as engine:
        engine.save(state, tmp_path / "e.safetensors").wait_persisted()
        back = engine.load(tmp_path / "e.safetensors")
        some = engine.load_tensors(tmp_path / "e.safetensors", [f"x{i:02d}" for i in range(0, 40, 3)])
    assert all(same(back[k], v) for k, v in state.items())
    assert all(same(t, state[k]) for k, t in some.items())
