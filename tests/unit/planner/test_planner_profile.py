"""Profile: JSON round trip and validation that names the bad field."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings

from dcredit_opt.planner.profile import (
    Profile,
    ProfileError,
    TensorProfile,
    bytes_of,
    canonical_dtype,
)

from .strategies import profiles


def small_profile(**overrides) -> dict:
    data = {
        "version": 1,
        "alpha_s": 1e-4,
        "beta_s_per_byte": 1e-9,
        "world_size": 4,
        "ready_order": None,
        "tensors": [
            {"name": f"layer{i}.weight", "numel": 100 * (i + 1), "dtype": "float32", "forward_index": i,
             "fwd_s": 0.001, "bwd_s": 0.002}
            for i in range(4)
        ],
    }
    data.update(overrides)
    return data


def test_bytes_of_names_and_aliases():
    assert bytes_of("float32") == 4
    assert bytes_of("torch.bfloat16") == 2
    assert bytes_of("half") == 2
    assert bytes_of("int64") == 8
    assert canonical_dtype("torch.float") == "float32"
    with pytest.raises(ProfileError, match="unknown dtype 'float13'"):
        bytes_of("float13")


def test_bytes_of_torch_dtypes():
    torch = pytest.importorskip("torch")
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8):
        assert bytes_of(dtype) == torch.tensor([], dtype=dtype).element_size()


def test_defaults_and_derived_views():
    p = Profile.from_dict(small_profile())
    assert p.order() == (3, 2, 1, 0)
    assert p.numels == (100, 200, 300, 400)
    assert p.nbytes == (400, 800, 1200, 1600)
    assert p.total_bytes == 4000
    assert p.tensors[1].nbytes == 800


def test_json_round_trip(tmp_path):
    p = Profile.from_dict(small_profile(ready_order=[3, 1, 2, 0]))
    assert Profile.from_json(p.to_json()) == p
    path = tmp_path / "profile.json"
    p.save(path)
    assert Profile.load(path) == p
    assert json.loads(path.read_text())["version"] == 1


def test_host_cost_is_optional_in_json_and_kept():
    """A profile written before the field existed loads with no host cost; one with it keeps it."""
    old = Profile.from_dict(small_profile())
    assert old.host_s_per_collective == 0.0
    p = Profile.from_dict(small_profile(host_s_per_collective=2.5e-5))
    assert p.host_s_per_collective == 2.5e-5
    assert Profile.from_json(p.to_json()) == p != old


@settings(max_examples=50, deadline=None)
@given(profiles(host_cost=True))
def test_json_round_trip_random(p):
    assert Profile.from_json(p.to_json()) == p


def _with_tensor(i: int, **fields) -> dict:
    data = small_profile()
    data["tensors"][i].update(fields)
    return data


@pytest.mark.parametrize(("data", "message"), [
    (_with_tensor(3, bwd_s=-0.1), r"tensors\[3\]\.bwd_s is -0\.1; times must be >= 0"),
    (_with_tensor(2, fwd_s=float("nan")), r"tensors\[2\]\.fwd_s is nan; times must be finite"),
    (_with_tensor(1, numel=-5), r"tensors\[1\]\.numel is -5; it must be >= 0"),
    (_with_tensor(1, numel="12"), r"tensors\[1\]\.numel is '12' \(str\); expected an integer"),
    (_with_tensor(1, numel=12.0), r"tensors\[1\]\.numel is 12\.0 \(float\); expected an integer"),
    (_with_tensor(0, numel=True), r"tensors\[0\]\.numel is True \(bool\); expected an integer"),
    (_with_tensor(0, bwd_s="fast"), r"tensors\[0\]\.bwd_s is 'fast' \(str\); expected a number"),
    (_with_tensor(0, dtype="float13"), r"tensors\[0\]\.dtype: unknown dtype 'float13'"),
    (_with_tensor(0, dtype=4), r"tensors\[0\]\.dtype is 4 \(int\)"),
    (_with_tensor(0, name=None), r"tensors\[0\]\.name is None"),
    (_with_tensor(2, forward_index=5), r"tensors\[2\]\.forward_index is 5; .* must be 2"),
    (_with_tensor(2, colour="red"), r"unknown field tensors\[2\]\.colour"),
    (small_profile(alpha_s=-1.0), r"alpha_s is -1\.0; times must be >= 0"),
    (small_profile(beta_s_per_byte="1e-9"), r"beta_s_per_byte is '1e-9' \(str\); expected a number"),
    (small_profile(world_size=0), r"world_size is 0; it must be >= 1"),
    (small_profile(host_s_per_collective=-2e-5), r"host_s_per_collective is -2e-05; times must be >= 0"),
    (small_profile(host_s_per_collective=float("inf")), r"host_s_per_collective is inf; times must be finite"),
    (small_profile(ready_order=[0, 1, 1, 2]), r"ready_order must be a permutation of 0\.\.3"),
    (small_profile(ready_order="0123"), r"ready_order is '0123'"),
    (small_profile(version=2), r"version is 2"),
    (small_profile(tensors={"a": 1}), r"tensors is \{'a': 1\}"),
    (small_profile(tensors=[1]), r"tensors\[0\] is 1 \(int\); expected an object"),
])
def test_invalid_fields_are_named(data, message):
    with pytest.raises(ProfileError, match=message):
        Profile.from_dict(data)


@pytest.mark.parametrize("field", ["alpha_s", "beta_s_per_byte", "world_size", "tensors"])
def test_missing_top_level_field(field):
    data = small_profile()
    del data[field]
    with pytest.raises(ProfileError, match=f"^{field} is missing$"):
        Profile.from_dict(data)


@pytest.mark.parametrize("field", ["name", "numel", "dtype", "forward_index", "fwd_s", "bwd_s"])
def test_missing_tensor_field(field):
    data = small_profile()
    del data["tensors"][2][field]
    with pytest.raises(ProfileError, match=rf"^tensors\[2\]\.{field} is missing$"):
        Profile.from_dict(data)


def test_not_json():
    with pytest.raises(ProfileError, match="not valid JSON"):
        Profile.from_json("{")
    with pytest.raises(ProfileError, match="must be a JSON object"):
        Profile.from_json("[]")


def test_constructor_validates_too():
    t = TensorProfile("w", 10, "float32", 0, 0.1, -0.2)
    with pytest.raises(ProfileError, match=r"tensors\[0\]\.bwd_s is -0\.2"):
        Profile((t,), 0.0, 0.0, 1)


def test_profile_error_is_a_value_error():
    assert issubclass(ProfileError, ValueError)
