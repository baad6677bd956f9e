"""The caller-thread part of a save: naming, aliasing, metadata rules, refusals."""

import pytest
import torch

from nanotron_datastates.plan import plan_save


def test_flat_dict_keeps_its_keys_as_tensor_names():
    p = plan_save({"w": torch.zeros(2), "b": torch.zeros(3, dtype=torch.bfloat16)})
    assert p.names == ["w", "b"] and p.dtypes == ["F32", "BF16"] and p.nbytes == 8 + 6


def test_nested_names_collisions_and_the_reserved_name():
    t1, t2, t3 = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    p = plan_save({"a.b": t1, "a": {"b": t2}, "__metadata__": t3})
    assert p.names == ["a.b", "a.b#1", "__metadata__#1"]


def test_the_same_tensor_twice_is_stored_once():
    w = torch.randn(4, 4)
    p = plan_save({"embed": w, "lm_head": w})
    assert p.names == ["embed"]


def test_exported_arrays_share_memory_with_the_state():
    x = torch.randn(8, 8, requires_grad=True)
    b = torch.zeros(3, dtype=torch.bool)
    p = plan_save({"x": x, "b": b, "view": x.detach().t()})
    assert p.arrays[0].data_ptr() == x.data_ptr() and not p.arrays[0].requires_grad
    assert p.arrays[1].dtype == torch.uint8 and p.arrays[1].data_ptr() == b.data_ptr()
    assert p.arrays[2].stride() == (1, 8)  # host views are gathered by the core, not copied here


def test_metadata_rules():
    md = dict(plan_save({}, metadata={"k": "v"}).metadata)
    assert md["format"] == "pt" and md["k"] == "v" and md["datastates.version"] == "1"
    assert dict(plan_save({}, metadata={"format": "np"}).metadata)["format"] == "np"
    with pytest.raises(ValueError, match="reserved"):
        plan_save({}, metadata={"datastates.x": "1"})
    with pytest.raises(TypeError, match="str to str"):
        plan_save({}, metadata={"k": 1})


def test_unsupported_tensors_are_refused_by_key():
    with pytest.raises(TypeError, match="'m.x'.*meta"):
        plan_save({"m": {"x": torch.empty(2, device="meta")}})
    with pytest.raises(TypeError, match="'s'"):
        plan_save({"s": torch.zeros(2, 2).to_sparse()})
    with pytest.raises(TypeError, match="complex128"):
        plan_save({"c": torch.zeros(2, dtype=torch.complex128)})
